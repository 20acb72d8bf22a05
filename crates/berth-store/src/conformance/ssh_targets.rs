//! Conformance cases of SSH targets and artifacts: names unique per tenant (the constraint
//! decides), tenant isolation, audit entries that never carry a key, and artifacts content
//! addressed (a second put keeps the first and writes no second entry).

use berth_proto::audit::actions;
use berth_proto::release::SshRelease;
use berth_proto::{ReleaseId, SshTargetId};

use super::deployments::audit_actions;
use super::support::*;
use crate::{Artifact, Release, SshTarget};

fn ssh_target(tenant: TenantId, name: &str) -> SshTarget {
    SshTarget {
        id: SshTargetId::new(),
        tenant_id: tenant,
        name: name.to_string(),
        host: "10.0.0.7".into(),
        port: 2222,
        user: "deploy".into(),
        via_agent: None,
        via_selector: labels(&[("zone", "a")]),
        host_key: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEurclYv".into(),
        key_secret: "ssh/web-1".into(),
        labels: labels(&[("role", "web")]),
        created_at: millis(now()),
    }
}

pub async fn ssh_targets_create_get_delete(store: &DynStore) {
    let t = tenant(store).await;
    let other = tenant(store).await;
    let wanted = ssh_target(t.id, "web-1");
    let created = store
        .create_ssh_target(wanted.clone(), operator())
        .await
        .expect("create");
    assert_eq!(created, wanted, "reads back as written");
    assert_eq!(
        store.get_ssh_target(t.id, "web-1").await.expect("get"),
        Some(wanted.clone())
    );
    assert_eq!(
        store
            .get_ssh_target_by_id(t.id, wanted.id)
            .await
            .expect("get by id"),
        Some(wanted.clone())
    );
    // Another tenant sees nothing of it, and may use the name itself.
    assert_eq!(
        store.get_ssh_target(other.id, "web-1").await.expect("get"),
        None
    );
    assert_eq!(
        store
            .get_ssh_target_by_id(other.id, wanted.id)
            .await
            .expect("get"),
        None
    );
    store
        .create_ssh_target(ssh_target(other.id, "web-1"), operator())
        .await
        .expect("another tenant's web-1");
    // The same name again in the tenant: the unique constraint refuses it.
    assert_conflict(
        store
            .create_ssh_target(ssh_target(t.id, "web-1"), operator())
            .await,
        "ssh_target_name",
    );
    // Via one agent by name instead of a selector.
    let mut by_name = ssh_target(t.id, "db-1");
    by_name.via_agent = Some("edge-1".into());
    by_name.via_selector.clear();
    store
        .create_ssh_target(by_name.clone(), operator())
        .await
        .expect("via an agent");
    let names: Vec<String> = store
        .list_ssh_targets(t.id)
        .await
        .expect("list")
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names, ["db-1", "web-1"], "by name, this tenant's only");

    assert!(store
        .delete_ssh_target(t.id, "web-1", operator(), now())
        .await
        .expect("delete"));
    assert!(!store
        .delete_ssh_target(t.id, "web-1", operator(), now())
        .await
        .expect("delete again"));
    assert_eq!(
        store.get_ssh_target(t.id, "web-1").await.expect("get"),
        None
    );
    let actions: Vec<String> = audit_actions(store, t.id)
        .await
        .into_iter()
        .map(|(action, _)| action)
        .collect();
    assert_eq!(
        actions,
        [
            actions::TENANT_CREATE,
            actions::SSH_TARGET_CREATE,
            actions::SSH_TARGET_CREATE,
            actions::SSH_TARGET_DELETE
        ]
    );
    // The entries name the key's secret, never a key.
    let entries = store.list_audit(t.id, 0, 100).await.expect("audit");
    assert_eq!(entries[1].details["keySecret"], "ssh/web-1");
}

pub async fn artifacts_content_addressed(store: &DynStore) {
    let t = tenant(store).await;
    let other = tenant(store).await;
    let bytes = b"#!/bin/sh\necho deployed\n".to_vec();
    let sha = "5".repeat(64);
    let artifact = Artifact {
        tenant_id: t.id,
        sha256: sha.clone(),
        size: bytes.len() as u64,
        created_at: millis(now()),
    };
    let stored = store
        .put_artifact(artifact.clone(), bytes.clone(), operator())
        .await
        .expect("put");
    assert_eq!(stored, artifact);
    // Again, later: the first row stays, and no second audit entry.
    let again = Artifact {
        created_at: millis(now() + time::Duration::seconds(5)),
        ..artifact.clone()
    };
    assert_eq!(
        store
            .put_artifact(again, bytes.clone(), operator())
            .await
            .expect("put again"),
        artifact
    );
    assert_eq!(
        audit_actions(store, t.id).await[1..],
        [(actions::ARTIFACT_PUSH.to_string(), sha.clone())],
        "one artifact.push after the tenant's creation"
    );
    assert_eq!(
        store.artifact_content(t.id, &sha).await.expect("content"),
        Some(bytes)
    );
    assert_eq!(
        store.get_artifact(t.id, &sha).await.expect("get"),
        Some(artifact.clone())
    );
    assert_eq!(
        store.list_artifacts(t.id).await.expect("list"),
        vec![artifact]
    );
    // Tenant isolation.
    assert_eq!(store.get_artifact(other.id, &sha).await.expect("get"), None);
    assert_eq!(
        store
            .artifact_content(other.id, &sha)
            .await
            .expect("content"),
        None
    );
    assert!(store
        .list_artifacts(other.id)
        .await
        .expect("list")
        .is_empty());

    // A release keeps its SSH part as written.
    let ssh: SshRelease = serde_json::from_value(serde_json::json!({
        "deployDirectory": "/srv/app",
        "artifacts": [{"name": "deploy.sh", "sha256": sha, "executable": true}],
        "script": {"command": ["./deploy.sh"]},
        "healthCheck": {"type": "tcp", "host": "127.0.0.1", "port": 8080},
    }))
    .expect("ssh release");
    let release = Release {
        id: ReleaseId::new(),
        tenant_id: t.id,
        name: "files-1".into(),
        components: vec![],
        compose_lock: None,
        ssh: Some(ssh),
        created_at: millis(now()),
    };
    store
        .create_release(release.clone(), operator())
        .await
        .expect("create release");
    assert_eq!(
        store.get_release(t.id, "files-1").await.expect("get"),
        Some(release)
    );
}
