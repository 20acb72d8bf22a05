//! Issue 29's deployment race, on two replicas over one PostgreSQL: a cancel (on replica B)
//! committing while a deployment pass (the reconciler of either replica) creates the
//! deployment's tasks must not leave a task queued for the cancelled deployment.
//!
//! The interleaving is forced, not hoped for: the test holds the target agent's row lock, so
//! every pass that reaches the task insert waits there with the deployment read as `pending`;
//! the cancel is sent while they wait, and the lock released after it committed (or once it
//! waits for the passes' creates, which is what the fix makes it do).

mod common;

use std::time::Duration;

use berth_proto::audit::AuditActor;
use berth_proto::deploy::{
    CancelDeployment, DeploymentKind, DeploymentState, RolloutPolicy, TargetPhase, Tier,
};
use berth_proto::release::Component;
use berth_proto::{AgentId, DeploymentId, EnvironmentId, ReleaseId, TenantId};
use berth_store::{
    Deployment, DeploymentTarget, Environment, NewDeployment, PayloadKey, PostgresStore, Release,
    ReleaseRef, Store,
};
use sqlx::{Connection, PgConnection};

/// Polls `$ready` (an expression that may `.await`) every 50 ms until it is true, or panics
/// naming `$what` after 30 s.
macro_rules! wait_until {
    ($what:expr, $ready:expr) => {{
        let give_up = tokio::time::Instant::now() + Duration::from_secs(30);
        while !$ready {
            assert!(
                tokio::time::Instant::now() < give_up,
                "timed out waiting for {}",
                $what
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }};
}

/// Backends of this database waiting for a lock, each with the pids blocking it.
async fn lock_waiters(conn: &mut PgConnection) -> Vec<(i32, Vec<i32>)> {
    sqlx::query_as::<_, (i32, Vec<i32>)>(
        "SELECT pid, pg_blocking_pids(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND cardinality(pg_blocking_pids(pid)) > 0",
    )
    .fetch_all(conn)
    .await
    .expect("lock waiters")
}

/// Open tasks (`pending`, `retry_wait`, `leased`) the deployment's passes created.
async fn open_tasks(conn: &mut PgConnection, deployment: DeploymentId) -> Vec<(String, String)> {
    sqlx::query_as::<_, (String, String)>(
        "SELECT id::text, state FROM tasks WHERE idempotency_key LIKE $1 \
         AND state IN ('pending', 'retry_wait', 'leased')",
    )
    .bind(format!("deployment:{deployment}:%"))
    .fetch_all(conn)
    .await
    .expect("open tasks")
}

/// An environment, a release and a `pending` deployment of it onto `agent`, written the way the
/// deployment API writes them (through the store: the release needs no registry this way).
async fn pending_deployment(store: &dyn Store, tenant: TenantId, agent: AgentId) -> Deployment {
    let now = time::OffsetDateTime::now_utc();
    let actor = AuditActor::Token {
        id: uuid::Uuid::nil(),
        name: "race".into(),
        role: berth_proto::admin::Role::Admin,
    };
    let env = store
        .create_environment(
            Environment {
                id: EnvironmentId::new(),
                tenant_id: tenant,
                name: "race".into(),
                tier: Tier::Qa,
                selector: [("role".to_string(), "web".to_string())].into(),
                target_type: Default::default(),
                policy: RolloutPolicy::default(),
                promote_from: None,
                approvals: 0,
                auto_heal: false,
                drift_interval_secs: 3600,
                current_release: None,
                previous_release: None,
                pinned_release: None,
                created_by: actor.clone(),
                created_at: now,
                updated_at: now,
            },
            actor.clone(),
        )
        .await
        .expect("environment");
    let digest = format!("sha256:{}", "ab".repeat(32));
    let release = store
        .create_release(
            Release {
                id: ReleaseId::new(),
                tenant_id: tenant,
                name: "race-1".into(),
                components: vec![Component {
                    name: "web".into(),
                    image: "127.0.0.1:9/race/web".into(),
                    digest,
                    resolved_from: None,
                    config: None,
                }],
                compose_lock: None,
                ssh: None,
                created_at: now,
            },
            actor.clone(),
        )
        .await
        .expect("release");
    let id = DeploymentId::new();
    let created = store
        .create_deployment(NewDeployment {
            deployment: Deployment {
                id,
                tenant_id: tenant,
                environment_id: env.id,
                environment_name: env.name.clone(),
                release: ReleaseRef {
                    id: release.id,
                    name: release.name.clone(),
                },
                kind: DeploymentKind::Deploy,
                state: DeploymentState::Pending,
                rolling_back: false,
                requested_by: actor,
                rollback_release: None,
                approvals_required: 0,
                cancel_requested: false,
                current_wave: 0,
                error_code: None,
                detail: None,
                version: 0,
                created_at: now,
                updated_at: now,
                finished_at: None,
            },
            targets: vec![DeploymentTarget {
                deployment_id: id,
                agent_id: agent,
                agent_name: "race-host".into(),
                wave: 0,
                phase: TargetPhase::Waiting,
                tasks: Vec::new(),
                rollback_tasks: Vec::new(),
                error_code: None,
                detail: None,
                started_at: None,
                finished_at: None,
            }],
            pin: false,
        })
        .await
        .expect("deployment");
    created.deployment
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_during_a_pass_on_another_replica_leaves_no_task_queued() {
    let Some(admin_url) = berth_test_utils::postgres::admin_url("deployment cancel race") else {
        return;
    };
    let db = berth_test_utils::postgres::TestDatabase::create(&admin_url);
    let url = db.url.clone();
    let a = common::start_with(|config| config.database = Some(url.clone())).await;
    let b = common::start_replica(&a, |c| c.database = Some(url.to_string())).await;
    let agent = a.agent("race-host").await;
    // The deployment's docker.run needs an agent that reports `docker` (checked at create).
    let updated = a
        .raw(None)
        .put(format!("{}/api/v1/agents/{}", a.url, agent.id))
        .header("authorization", format!("Bearer {}", a.admin_token))
        .json(&serde_json::json!({"capabilities": [{"name": "docker"}]}))
        .send()
        .await
        .expect("update the agent");
    assert!(updated.status().is_success(), "{}", updated.status());

    let mut probe = PgConnection::connect(&url).await.expect("connect");
    let tenant: uuid::Uuid = sqlx::query_scalar("SELECT tenant_id FROM agents WHERE id = $1")
        .bind(agent.id.0)
        .fetch_one(&mut probe)
        .await
        .expect("agent's tenant");
    let store = PostgresStore::connect(&url, PayloadKey::new(berth_crypto::MasterKey::generate()))
        .await
        .expect("store");

    // Every task insert for the agent waits behind this lock (a create takes KEY SHARE on it).
    let mut holder = PgConnection::connect(&url).await.expect("connect");
    let holder_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut holder)
        .await
        .expect("pid");
    sqlx::query("BEGIN")
        .execute(&mut holder)
        .await
        .expect("begin");
    sqlx::query("SELECT 1 FROM agents WHERE id = $1 FOR UPDATE")
        .bind(agent.id.0)
        .execute(&mut holder)
        .await
        .expect("lock the agent");

    let d = pending_deployment(&store, TenantId(tenant), agent.id).await;
    // A pass (on either replica) read it as pending and waits to create its task.
    wait_until!(
        "a pass waiting to create the task",
        lock_waiters(&mut probe)
            .await
            .iter()
            .any(|(_, by)| by.contains(&holder_pid))
    );

    // The cancel, on replica B: it commits at once, or (fixed) waits for the passes' creates.
    let cancel = {
        let client = b.admin();
        let id = d.id;
        tokio::spawn(async move { client.send(&CancelDeployment { id }).await })
    };
    wait_until!(
        "the cancel to commit or to wait for the creates",
        cancel.is_finished()
            || lock_waiters(&mut probe)
                .await
                .iter()
                .any(|(_, by)| !by.contains(&holder_pid))
    );
    sqlx::query("ROLLBACK")
        .execute(&mut holder)
        .await
        .expect("release the agent");
    let cancelled = cancel.await.expect("cancel task").expect("cancel answered");
    assert_eq!(cancelled.state, DeploymentState::Cancelled, "{cancelled:?}");

    // Every waiting pass now finishes its create (or is refused): nothing may stay queued.
    wait_until!(
        "no pass waiting on a lock",
        lock_waiters(&mut probe).await.is_empty()
    );
    let settle = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < settle {
        let open = open_tasks(&mut probe, d.id).await;
        assert!(
            open.is_empty(),
            "tasks queued for cancelled deployment {}: {open:?}",
            d.id
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    drop(holder.close().await);
    drop(probe.close().await);
    drop(store);
    b.stop().await;
    a.stop().await;
    drop(db);
}
