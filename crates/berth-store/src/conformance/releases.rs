//! Conformance cases of releases.

use berth_proto::release::Component;
use berth_proto::ReleaseId;

use super::support::*;
use crate::Release;

fn component(name: &str) -> Component {
    Component {
        name: name.to_string(),
        image: format!("registry.example:5000/team/{name}"),
        digest: format!("sha256:{}", "ab".repeat(32)),
        resolved_from: Some("1.0".to_string()),
        config: Some(serde_json::json!({"containerName": name, "ports": ["8080:80"]})),
    }
}

fn release(tenant: TenantId, name: &str) -> Release {
    Release {
        id: ReleaseId::new(),
        tenant_id: tenant,
        name: name.to_string(),
        components: vec![component("web"), component("worker")],
        compose_lock: None,
        ssh: None,
        created_at: now(),
    }
}

pub async fn release_create_get(store: &DynStore) {
    let t = tenant(store).await;
    let mut wanted = release(t.id, "2024.06.1");
    wanted.compose_lock = Some("services:\n  web:\n    image: x@sha256:ab\n".into());
    let created = store
        .create_release(wanted.clone(), operator())
        .await
        .expect("create release");
    wanted.created_at = millis(wanted.created_at);
    assert_eq!(created, wanted, "the release reads back as written");
    // Recorded in the audit chain by the same transaction, with what it pins.
    let audit = store.list_audit(t.id, 0, 100).await.expect("audit");
    let entry = audit
        .iter()
        .find(|e| e.action == berth_proto::audit::actions::RELEASE_CREATE)
        .expect("a release.create entry");
    assert_eq!(entry.subject, created.id.to_string());
    assert_eq!(entry.details["name"], "2024.06.1");
    assert_eq!(
        store.get_release(t.id, "2024.06.1").await.expect("get"),
        Some(wanted.clone())
    );
    assert_eq!(
        store.get_release(t.id, "2024.06.2").await.expect("get"),
        None
    );

    // Immutable and unique per tenant: the same name again is a conflict, even with other
    // components, and leaves the first untouched.
    let mut again = release(t.id, "2024.06.1");
    again.components.truncate(1);
    assert_conflict(
        store.create_release(again, operator()).await,
        "release_name",
    );
    assert_eq!(
        store.get_release(t.id, "2024.06.1").await.expect("get"),
        Some(wanted.clone())
    );
    // The same id is a conflict too.
    let mut same_id = release(t.id, "other");
    same_id.id = wanted.id;
    assert_conflict(
        store.create_release(same_id, operator()).await,
        "release_id",
    );

    // Another tenant neither sees it nor is blocked by its name.
    let other = tenant(store).await;
    assert_eq!(
        store.get_release(other.id, "2024.06.1").await.expect("get"),
        None
    );
    let theirs = store
        .create_release(release(other.id, "2024.06.1"), operator())
        .await
        .expect("same name in another tenant");
    assert_ne!(theirs.id, wanted.id);
}

pub async fn release_create_concurrent(store: &DynStore) {
    let t = tenant(store).await;
    let attempts = (0..8).map(|_| {
        let store = store.clone();
        let release = release(t.id, "race");
        tokio::spawn(async move { store.create_release(release, operator()).await })
    });
    let mut won = 0;
    for attempt in attempts {
        match attempt.await.expect("join") {
            Ok(_) => won += 1,
            Err(StoreError::Conflict { constraint }) => assert_eq!(constraint, "release_name"),
            Err(e) => panic!("unexpected error: {e:?}"),
        }
    }
    assert_eq!(won, 1, "exactly one concurrent create of a name wins");
}

pub async fn list_releases(store: &DynStore) {
    let t = tenant(store).await;
    let other = tenant(store).await;
    store
        .create_release(release(other.id, "theirs"), operator())
        .await
        .expect("create");
    let mut names = Vec::new();
    for i in 0..5 {
        let r = store
            .create_release(release(t.id, &format!("r{i}")), operator())
            .await
            .expect("create");
        names.push(r.name);
    }
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = store
            .list_releases(t.id, after, 2)
            .await
            .expect("list releases");
        assert!(page.items.len() <= 2);
        seen.extend(page.items.iter().map(|r| r.name.clone()));
        match page.next {
            Some(next) => after = Some(ReleaseId(next)),
            None => break,
        }
    }
    assert_eq!(
        seen, names,
        "every release once, in creation order, none of another tenant"
    );
    let empty = tenant(store).await;
    assert_eq!(
        store.list_releases(empty.id, None, 10).await.expect("list"),
        Page {
            items: vec![],
            next: None
        }
    );
}
