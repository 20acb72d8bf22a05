//! Conformance cases of environment readiness: the row by compare-and-set on `version`, a
//! reconciler's write never touching the operator's verify nonce, the `environment.verify`
//! audit entry, the `environment.readiness` event, the sweep's listing and tenant isolation.

use berth_proto::audit::actions;
use berth_proto::readiness::{Condition, ConditionStatus, ConditionType};

use super::deployments::{audit_actions, create_environment};
use super::support::*;
use crate::{EventFilter, Readiness, ReadinessPass};

fn conditions(status: ConditionStatus, at: OffsetDateTime, generation: i64) -> Vec<Condition> {
    ConditionType::ALL
        .into_iter()
        .map(|kind| Condition {
            kind,
            status,
            reason: "OK".into(),
            message: format!("{kind} checked"),
            observed_at: at,
            generation,
        })
        .collect()
}

pub async fn readiness_round_trip(store: &DynStore) {
    let t = tenant(store).await;
    let env = create_environment(store, t.id, "qa").await;
    assert_eq!(store.get_readiness(t.id, env.id).await.expect("get"), None);
    let at = millis(now());
    let first = Readiness {
        tenant_id: t.id,
        environment_id: env.id,
        generation: 1,
        spec: "spec-1".into(),
        conditions: conditions(ConditionStatus::Unknown, at, 1),
        operational_ready: false,
        pass: Some(ReadinessPass {
            id: uuid::Uuid::new_v4(),
            started_at: at,
            nonce: None,
            probes: vec![(AgentId::new(), TaskId::new())],
            complete: false,
        }),
        verify_request: None,
        verify_observed: None,
        version: 1,
        updated_at: at,
    };
    assert!(store
        .put_readiness(first.clone(), None)
        .await
        .expect("insert"));
    assert!(
        !store
            .put_readiness(first.clone(), None)
            .await
            .expect("insert again"),
        "a second insert finds the row and writes nothing"
    );
    let read = store.get_readiness(t.id, env.id).await.expect("get");
    assert_eq!(read.as_ref(), Some(&first), "reads back as written");

    // Compare-and-set: the writer that read version 1 wins once; the stale one writes nothing.
    let mut next = first.clone();
    next.conditions = conditions(ConditionStatus::True, at, 1);
    next.operational_ready = true;
    assert!(store
        .put_readiness(next.clone(), Some(1))
        .await
        .expect("update"));
    assert!(!store
        .put_readiness(first.clone(), Some(1))
        .await
        .expect("stale"));
    let read = store
        .get_readiness(t.id, env.id)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(read.version, 2);
    assert!(read.operational_ready);

    // Another tenant sees nothing.
    let other = tenant(store).await;
    assert_eq!(
        store.get_readiness(other.id, env.id).await.expect("get"),
        None
    );
    let mut foreign = read.clone();
    foreign.tenant_id = other.id;
    assert!(!store
        .put_readiness(foreign, Some(2))
        .await
        .expect("foreign"));
}

pub async fn readiness_verify_nonce(store: &DynStore) {
    let t = tenant(store).await;
    let env = create_environment(store, t.id, "qa").await;
    let at = millis(now());
    // A verify before any pass makes the row.
    store
        .request_verify(&env, "nonce-1", operator(), at)
        .await
        .expect("verify");
    let row = store
        .get_readiness(t.id, env.id)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(row.verify_request.as_deref(), Some("nonce-1"));
    assert_eq!(row.verify_observed, None);
    assert_eq!(row.generation, 0);
    assert!(row.conditions.is_empty());

    // A reconciler's write never touches the request, even when it read none.
    let mut pass = row.clone();
    pass.verify_request = None;
    pass.generation = 1;
    pass.conditions = conditions(ConditionStatus::False, at, 1);
    pass.verify_observed = Some("nonce-1".into());
    assert!(store
        .put_readiness(pass, Some(row.version))
        .await
        .expect("put"));
    store
        .request_verify(&env, "nonce-2", operator(), at)
        .await
        .expect("verify again");
    let row = store
        .get_readiness(t.id, env.id)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(row.verify_request.as_deref(), Some("nonce-2"));
    assert_eq!(row.verify_observed.as_deref(), Some("nonce-1"));
    assert_eq!(
        row.generation, 1,
        "the request leaves the pass's columns alone"
    );

    let audit = audit_actions(store, t.id).await;
    let verifies = audit
        .iter()
        .filter(|(action, subject)| {
            action == actions::ENVIRONMENT_VERIFY && subject == &env.id.to_string()
        })
        .count();
    assert_eq!(verifies, 2, "{audit:?}");

    // The pass's write (conditions, the observed nonce) is an event of the environment.
    let events = store
        .read_events(
            t.id,
            &EventFilter {
                environment: Some(env.id),
                ..EventFilter::default()
            },
            0,
            1000,
        )
        .await
        .expect("events");
    let readiness: Vec<_> = events
        .iter()
        .filter(|e| e.kind == "environment.readiness")
        .collect();
    assert_eq!(readiness.len(), 1, "{events:?}");
    assert_eq!(readiness[0].data["verifyObserved"], "nonce-1");
    assert_eq!(readiness[0].data["operationalReady"], false);
}

pub async fn readiness_environments_listed(store: &DynStore) {
    let t = tenant(store).await;
    let a = create_environment(store, t.id, "a").await;
    let b = create_environment(store, t.id, "b").await;
    let mut all = Vec::new();
    let mut after = None;
    loop {
        let page = store.readiness_environments(after, 50).await.expect("list");
        all.extend(page.iter().map(|e| e.id));
        match page.last() {
            Some(last) if page.len() == 50 => after = Some(last.id),
            _ => break,
        }
    }
    assert!(all.contains(&a.id) && all.contains(&b.id));
    let mut sorted = all.clone();
    sorted.sort();
    assert_eq!(all, sorted, "by id");
}
