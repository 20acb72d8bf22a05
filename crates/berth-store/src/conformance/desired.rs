//! Conformance cases of desired-state environments: bundles content-addressed (a second push
//! of a sha keeps the first), set-desired only to a pushed sha, retire, checkins and reports
//! per agent with their audit entries, and tenant isolation.

use berth_proto::audit::actions;
use berth_proto::deploy::{RolloutPolicy, Tier};
use berth_proto::desired::{ContainerState, HostFacts, ReportResult};
use berth_proto::EnvironmentId;

use super::support::*;
use crate::{
    CheckinRecord, DesiredEnvironment, Environment, NewBundle, ReportRecord, SetDesiredOutcome,
};

async fn desired_env(store: &DynStore, tenant: TenantId, name: &str) -> DesiredEnvironment {
    let at = millis(now());
    store
        .create_environment(
            Environment {
                id: EnvironmentId::new(),
                tenant_id: tenant,
                name: name.to_string(),
                tier: Tier::Qa,
                selector: labels(&[("env", name)]),
                target_type: Default::default(),
                policy: RolloutPolicy {
                    max_parallel: 1,
                    stop_on_failure: true,
                    auto_rollback: false,
                    health_timeout_secs: 45,
                    task_timeout_secs: 300,
                    require_ready: false,
                },
                promote_from: None,
                approvals: 0,
                auto_heal: false,
                drift_interval_secs: 120,
                current_release: None,
                previous_release: None,
                pinned_release: None,
                created_by: operator(),
                created_at: at,
                updated_at: at,
            },
            operator(),
        )
        .await
        .expect("create environment");
    store
        .desired_environment(tenant, name)
        .await
        .expect("read")
        .expect("the environment")
}

fn bundle(env: &DesiredEnvironment, sha: &str, content: &[u8]) -> NewBundle {
    NewBundle {
        tenant_id: env.tenant_id,
        environment_id: env.id,
        sha: sha.to_string(),
        content: content.to_vec(),
        created_at: now(),
        created_by: operator(),
    }
}

fn report(env: &DesiredEnvironment, key: &str, result: ReportResult, sha: &str) -> ReportRecord {
    ReportRecord {
        tenant_id: env.tenant_id,
        environment_id: env.id,
        agent_key: key.to_string(),
        sha: Some(sha.to_string()),
        result,
        detail: (result == ReportResult::Failed).then(|| "APPLY_FAILED: web".to_string()),
        log_tail: "INFO applied".to_string(),
        containers: vec![ContainerState {
            name: "web".into(),
            state: "running".into(),
            health: Some("healthy".into()),
        }],
        actor: berth_proto::audit::AuditActor::Agent {
            id: uuid::Uuid::new_v4(),
        },
        audit_log_tail: "INFO".to_string(),
        at: now(),
    }
}

pub async fn desired_bundles_and_set_desired(store: &DynStore) {
    let t = tenant(store).await;
    let env = desired_env(store, t.id, "env-qa-02").await;
    assert_eq!(env.desired_sha, None);
    assert!(!env.retired && !env.purge_volumes);
    assert_eq!(env.checkin_interval_secs, 60, "the seed's default interval");

    let sha = "a".repeat(64);
    let (first, created) = store
        .put_bundle(bundle(&env, &sha, b"first"))
        .await
        .expect("put");
    assert!(created);
    assert_eq!(first.size_bytes, 5);
    // Content addressed: the same sha again is idempotent and never replaces the content.
    let (again, created) = store
        .put_bundle(bundle(&env, &sha, b"other content"))
        .await
        .expect("put again");
    assert!(!created);
    assert_eq!(again, first);
    assert_eq!(
        store.get_bundle(env.id, &sha).await.expect("get"),
        Some(b"first".to_vec())
    );
    assert_eq!(
        store
            .get_bundle(env.id, &"b".repeat(64))
            .await
            .expect("get"),
        None
    );
    assert_eq!(store.list_bundles(env.id).await.expect("list"), vec![first]);

    // Only a pushed sha can be desired; a refusal writes nothing.
    assert_eq!(
        store
            .set_desired(t.id, &env.name, &"b".repeat(64), operator(), now())
            .await
            .expect("set"),
        SetDesiredOutcome::BundleNotFound
    );
    assert_eq!(
        store
            .set_desired(t.id, "nope", &sha, operator(), now())
            .await
            .expect("set"),
        SetDesiredOutcome::NoSuchEnvironment
    );
    let SetDesiredOutcome::Set(set) = store
        .set_desired(t.id, &env.name, &sha, operator(), now())
        .await
        .expect("set")
    else {
        panic!("a pushed sha is set");
    };
    assert_eq!(set.desired_sha.as_deref(), Some(sha.as_str()));
    let read = store
        .desired_environment(t.id, &env.name)
        .await
        .expect("read")
        .expect("env");
    assert_eq!(read, set);

    let retired = store
        .retire_environment(t.id, &env.name, true, operator(), now())
        .await
        .expect("retire")
        .expect("env");
    assert!(retired.retired && retired.purge_volumes);
    assert_eq!(retired.desired_sha.as_deref(), Some(sha.as_str()));
    assert_eq!(
        store
            .retire_environment(t.id, "nope", false, operator(), now())
            .await
            .expect("retire"),
        None
    );

    let audit = store.list_audit(t.id, 0, 100).await.expect("audit");
    let set_entries: Vec<_> = audit
        .iter()
        .filter(|e| e.action == actions::ENVIRONMENT_SET_DESIRED)
        .collect();
    assert_eq!(
        set_entries.len(),
        1,
        "only the write that happened is audited"
    );
    assert_eq!(set_entries[0].details["sha"], sha.as_str());
    assert!(audit
        .iter()
        .any(|e| e.action == actions::ENVIRONMENT_RETIRE && e.details["purgeVolumes"] == true));

    // Another tenant sees nothing of it.
    let other = tenant(store).await;
    assert_eq!(
        store
            .desired_environment(other.id, &env.name)
            .await
            .expect("read"),
        None
    );
    assert_eq!(
        store
            .set_desired(other.id, &env.name, &sha, operator(), now())
            .await
            .expect("set"),
        SetDesiredOutcome::NoSuchEnvironment
    );
}

pub async fn desired_checkins_and_reports(store: &DynStore) {
    let t = tenant(store).await;
    let env = desired_env(store, t.id, "env-dev-01").await;
    let (a, b) = ("agent:one", "agent:two");
    let sha1 = "1".repeat(64);
    let sha2 = "2".repeat(64);
    let at = millis(now());
    store
        .record_checkin(CheckinRecord {
            environment_id: env.id,
            agent_key: a.to_string(),
            applied_sha: None,
            host: HostFacts {
                hostname: Some("h1".into()),
                ..HostFacts::default()
            },
            containers: Vec::new(),
            at,
        })
        .await
        .expect("checkin");
    let agents = store.desired_agents(env.id).await.expect("agents");
    assert_eq!(agents.len(), 1);
    assert_eq!(agents[0].host.hostname.as_deref(), Some("h1"));
    assert_eq!(agents[0].last_checkin_at, Some(at));
    assert_eq!(agents[0].last_result, None);

    let applied = store
        .record_report(report(&env, a, ReportResult::Applied, &sha1))
        .await
        .expect("report");
    assert_eq!(applied.applied_sha.as_deref(), Some(sha1.as_str()));
    assert_eq!(
        applied.host.hostname.as_deref(),
        Some("h1"),
        "a report keeps the host"
    );
    assert_eq!(applied.last_checkin_at, Some(at));
    // Failed keeps the applied sha and stores the detail.
    let failed = store
        .record_report(report(&env, a, ReportResult::Failed, &sha2))
        .await
        .expect("report");
    assert_eq!(failed.applied_sha.as_deref(), Some(sha1.as_str()));
    assert_eq!(failed.last_result, Some(ReportResult::Failed));
    assert_eq!(failed.detail.as_deref(), Some("APPLY_FAILED: web"));
    assert_eq!(failed.containers.len(), 1);
    // Down clears it.
    let down = store
        .record_report(report(&env, a, ReportResult::Down, &sha1))
        .await
        .expect("report");
    assert_eq!(down.applied_sha, None);
    // A report before any checkin makes the row.
    store
        .record_report(report(&env, b, ReportResult::Applied, &sha2))
        .await
        .expect("report");
    let agents = store.desired_agents(env.id).await.expect("agents");
    assert_eq!(
        agents
            .iter()
            .map(|a| a.agent_key.as_str())
            .collect::<Vec<_>>(),
        vec![a, b]
    );
    assert_eq!(agents[1].applied_sha.as_deref(), Some(sha2.as_str()));
    assert_eq!(agents[1].log_tail.as_deref(), Some("INFO applied"));

    let reports: Vec<_> = store
        .list_audit(t.id, 0, 100)
        .await
        .expect("audit")
        .into_iter()
        .filter(|e| e.action == actions::DESIRED_REPORT)
        .collect();
    assert_eq!(reports.len(), 4, "every report is audited");
    assert_eq!(reports[1].details["result"], "failed");
    assert_eq!(reports[1].details["detail"], "APPLY_FAILED: web");
    assert_eq!(reports[1].details["logTail"], "INFO");
    assert_eq!(reports[1].subject, env.id.to_string());
}
