//! Two replicas over one PostgreSQL (issue 29 item 3): the reconcilers that used to do the same
//! unit of work twice when two replicas ran them.
//!
//! - Drift: a replica whose clock runs an hour ahead must not find a target's read-back due
//!   that the other replica scheduled for a period later ("due" is the database's clock).
//! - Readiness: two replicas starting the same pass at once must mint its OpenBao grant once
//!   (the environment is claimed while a replica works its pass).
//!
//! Both tests also read the driver's metrics, which must stay valid Prometheus text.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use berth_proto::agent::UpdateAgent;
use berth_proto::audit::AuditActor;
use berth_proto::deploy::{Drift, RolloutPolicy, TargetType, Tier};
use berth_proto::release::Component;
use berth_proto::{EnvironmentId, ReleaseId, TenantId};
use berth_server::{Clock, OpenBaoSettings, ServerConfig};
use berth_store::{
    DynStore, Environment, PayloadKey, PostgresStore, Release, ReleaseRef, TargetObservation,
};
use berth_test_utils::postgres::{admin_url, TestDatabase};
use berth_test_utils::wait_until;
use common::{next_sequence, ok, start_replica, start_with, TestAgent, TestServer};
use serde_json::{json, Value};
use sqlx::{Connection, PgConnection};
use time::OffsetDateTime;

/// A replica's wall clock that runs `ahead` of the true time: wrong, not moved by a test, so
/// nothing but this replica's own reading of it may follow it.
#[derive(Debug)]
struct SkewedClock {
    ahead: Duration,
}

impl Clock for SkewedClock {
    fn now(&self) -> OffsetDateTime {
        OffsetDateTime::now_utc() + self.ahead
    }
}

/// The sample of `name` with exactly `labels` (as written in the exposition), 0 when absent.
fn sample(metrics: &str, name: &str, labels: &str) -> f64 {
    let prefix = format!("{name}{{{labels}}} ");
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(&prefix)?.parse().ok())
        .unwrap_or(0.0)
}

async fn metrics(server: &TestServer) -> String {
    server
        .client(None, None)
        .get_text("/metrics")
        .await
        .expect("metrics")
}

/// Units of `reconciler` that `server` reconciled (claimed and done).
async fn units_done(server: &TestServer, reconciler: &str) -> f64 {
    let text = metrics(server).await;
    sample(
        &text,
        "berth_reconciler_units_total",
        &format!("name=\"{reconciler}\",outcome=\"done\""),
    )
}

/// Every sample line of the exposition parses as `name{labels} value`, and the driver's
/// families are declared with their types.
fn assert_valid_exposition(text: &str) {
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let value = line.rsplit(' ').next().expect("a value");
        assert!(
            value.parse::<f64>().is_ok() || value == "+Inf",
            "bad sample line {line:?}"
        );
    }
    for declared in [
        "# TYPE berth_reconciler_passes_total counter",
        "# TYPE berth_reconciler_units_total counter",
        "# TYPE berth_reconciler_pass_seconds histogram",
    ] {
        assert!(text.contains(declared), "{declared} missing:\n{text}");
    }
}

/// A store of the test's own on the replicas' database, for what the API cannot set up (a
/// release without a registry, a target observation due now).
async fn store(url: &str) -> DynStore {
    let key = PayloadKey::new(berth_crypto::MasterKey::generate());
    Arc::new(PostgresStore::connect(url, key).await.expect("store"))
}

async fn count(db: &str, sql: &str, bind: uuid::Uuid) -> i64 {
    let mut conn = PgConnection::connect(db).await.expect("connect");
    let n: i64 = sqlx::query_scalar(sql)
        .bind(bind)
        .fetch_one(&mut conn)
        .await
        .expect("count");
    drop(conn.close().await);
    n
}

/// An online agent of `server` labelled `env=<env>`, heartbeating until the handle is dropped.
async fn labelled_agent(
    server: &TestServer,
    name: &str,
    env: &str,
) -> (Arc<TestAgent>, i64, tokio::task::JoinHandle<()>) {
    let agent = Arc::new(server.agent(name).await);
    let generation = agent.go_online().await;
    let beating = agent.clone();
    let heartbeats = tokio::spawn(async move {
        loop {
            let _ = beating.heartbeat(generation, next_sequence()).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    server
        .admin()
        .send(&UpdateAgent {
            id: agent.id,
            labels: Some(BTreeMap::from([("env".to_string(), env.to_string())])),
            capabilities: None,
        })
        .await
        .expect("label");
    (agent, generation, heartbeats)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_clock_runs_ahead_does_not_read_a_target_back_twice() {
    let Some(admin) = admin_url("two replicas: drift") else {
        return;
    };
    let db = TestDatabase::create(&admin);
    let url = db.url.clone();
    let on_db = |url: String| move |c: &mut ServerConfig| c.database = Some(url);
    let a = start_with(on_db(url.clone())).await;
    let (agent, generation, heartbeats) = labelled_agent(&a, "web-1", "prod").await;

    // A release and an environment running it, and the target's read-back due now.
    let store = store(&url).await;
    let tenant: TenantId = store
        .ensure_tenant("default", OffsetDateTime::now_utc())
        .await
        .expect("default tenant")
        .id;
    let actor = AuditActor::Token {
        id: uuid::Uuid::new_v4(),
        name: "test".into(),
        role: berth_proto::admin::Role::Admin,
    };
    let now = OffsetDateTime::now_utc();
    let release = store
        .create_release(
            Release {
                id: ReleaseId(uuid::Uuid::new_v4()),
                tenant_id: tenant,
                name: "r1".into(),
                components: vec![Component {
                    name: "web".into(),
                    image: "127.0.0.1:1/team/web".into(),
                    digest: format!("sha256:{}", "0".repeat(64)),
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
    let env = store
        .create_environment(
            Environment {
                id: EnvironmentId(uuid::Uuid::new_v4()),
                tenant_id: tenant,
                name: "prod".into(),
                tier: Tier::Prod,
                selector: BTreeMap::from([("env".to_string(), "prod".to_string())]),
                target_type: TargetType::default(),
                policy: RolloutPolicy::default(),
                promote_from: None,
                approvals: 0,
                auto_heal: false,
                drift_interval_secs: 3600,
                current_release: Some(ReleaseRef {
                    id: release.id,
                    name: release.name.clone(),
                }),
                previous_release: None,
                pinned_release: None,
                created_by: actor,
                created_at: now,
                updated_at: now,
            },
            AuditActor::Agent {
                id: uuid::Uuid::new_v4(),
            },
        )
        .await
        .expect("environment");
    store
        .put_target_observation(TargetObservation {
            tenant_id: tenant,
            environment_id: env.id,
            agent_id: agent.id,
            check_task_id: None,
            next_check_at: now - time::Duration::seconds(1),
            drift: Drift::Unverified,
            running_release: None,
            components: Vec::new(),
            verified_at: None,
        })
        .await
        .expect("observation");

    // Replica A reads the target back, and the read-back finishes: the next is an hour away.
    let inspects = "SELECT count(*) FROM tasks WHERE agent_id = $1 AND task_type = 'inspect'";
    // (The environment's readiness probes reach the agent too: each is answered as it comes.)
    loop {
        let Some(task) = agent.poll(generation).await.expect("poll").assignment else {
            continue;
        };
        agent
            .submit(
                generation,
                agent.sign(agent.envelope(task.assignment_id, ok(task.task_id))),
            )
            .await
            .expect("submit");
        if task.task_type == "inspect" {
            break;
        }
    }
    wait_until(Duration::from_secs(30), "the read-back applied", || async {
        store
            .target_observations(env.id)
            .await
            .expect("observations")
            .iter()
            .any(|o| o.verified_at.is_some())
    })
    .await;

    // Replica B's clock runs an hour and a minute ahead: by it, the next read-back is due.
    let b = start_replica(&a, |c| {
        c.database = Some(url.clone());
        c.clock = Arc::new(SkewedClock {
            ahead: Duration::from_secs(3660),
        });
    })
    .await;
    let before = units_done(&b, "drift").await;
    wait_until(
        Duration::from_secs(60),
        "replica B checked the environment three times",
        || async { units_done(&b, "drift").await >= before + 3.0 },
    )
    .await;
    assert_eq!(
        count(&url, inspects, agent.id.0).await,
        1,
        "one read-back per period, whichever replica's clock is wrong"
    );
    assert_valid_exposition(&metrics(&b).await);

    heartbeats.abort();
    b.stop().await;
    a.stop().await;
    drop(db);
}

fn tar(files: &[(&str, String)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, content) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(content.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder
            .append_data(&mut header, name, content.as_bytes())
            .expect("append");
    }
    builder.into_inner().expect("tar")
}

async fn admin_call(
    server: &TestServer,
    method: reqwest::Method,
    path: &str,
    body: Value,
) -> Value {
    let response = server
        .raw(None)
        .request(method, format!("{}{path}", server.url))
        .bearer_auth(&server.admin_token)
        .json(&body)
        .send()
        .await
        .expect("send");
    let status = response.status();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    assert!(status.is_success(), "{path}: {status} {body}");
    body
}

/// How many statements of the test database wait on a lock right now.
async fn lock_waiters(url: &str) -> i64 {
    let mut conn = PgConnection::connect(url).await.expect("connect");
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(&mut conn)
    .await
    .expect("waiters");
    drop(conn.close().await);
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_mint_one_openbao_grant_for_a_readiness_pass() {
    let Some(admin) = admin_url("two replicas: readiness grant") else {
        return;
    };
    let Ok(bao) = std::env::var("BERTH_TEST_OPENBAO_ADDR") else {
        berth_test_utils::require_service::<()>(
            "two replicas: readiness grant",
            "BERTH_TEST_OPENBAO_ADDR",
        );
        return;
    };
    let db = TestDatabase::create(&admin);
    let url = db.url.clone();
    // The probe's grant is minted for the agent to log in to this OpenBao with; minting it
    // asks nothing of OpenBao, so its mounts need not exist for this test.
    let openbao = OpenBaoSettings {
        addr: bao,
        auth_mount: "berth-jwt".into(),
        role: "berth-deploy".into(),
        kv_mount: "berth-kv".into(),
        ca_pem: None,
        token_file: None,
    };
    let on = |url: String, openbao: OpenBaoSettings| {
        move |c: &mut ServerConfig| {
            c.database = Some(url);
            c.openbao = Some(openbao);
        }
    };
    let a = start_with(on(url.clone(), openbao.clone())).await;
    let b = start_replica(&a, on(url.clone(), openbao.clone())).await;
    let (agent, _generation, heartbeats) = labelled_agent(&a, "qa-1", "qa").await;
    let created = admin_call(
        &a,
        reqwest::Method::POST,
        "/api/v1/environments",
        json!({"name": "qa", "tier": "qa", "selector": {"env": "qa"}}),
    )
    .await;
    let env_id: uuid::Uuid = created["id"].as_str().expect("id").parse().expect("uuid");
    let files = [
        (
            "docker-compose.yml",
            "services:\n  web:\n    image: nginx\n    environment:\n      GREETING: \"${GREETING}\"\n"
                .to_string(),
        ),
        (
            "secrets.manifest.json",
            json!({"vault_mode": "openbao", "entries": [
                {"var": "GREETING", "path": "qa/web/greeting", "kind": "supplied", "version": null}
            ]})
            .to_string(),
        ),
        (
            "bundle.json",
            json!({"env_id": "qa", "tier": "qa", "renderer": "compose"}).to_string(),
        ),
    ];
    let pushed = a
        .raw(None)
        .post(format!("{}/api/v1/environments/qa/bundles", a.url))
        .bearer_auth(&a.admin_token)
        .header("content-type", "application/x-tar")
        .body(tar(&files))
        .send()
        .await
        .expect("push");
    assert!(pushed.status().is_success(), "push: {}", pushed.status());
    let sha = pushed.json::<Value>().await.expect("pushed")["sha"]
        .as_str()
        .expect("sha")
        .to_string();
    // Both replicas have run passes of the environment without a desired bundle.
    let (a0, b0) = (
        units_done(&a, "readiness").await,
        units_done(&b, "readiness").await,
    );
    wait_until(Duration::from_secs(30), "both replicas' passes", || async {
        units_done(&a, "readiness").await > a0 && units_done(&b, "readiness").await > b0
    })
    .await;

    // Hold every replica at the first read of a pass (the stored readiness) while the desired
    // bundle changes the generation: both then start the new pass at the same instant.
    let mut locker = PgConnection::connect(&url).await.expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut locker)
        .await
        .expect("begin");
    sqlx::query("LOCK TABLE environment_readiness IN ACCESS EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .expect("lock");
    admin_call(
        &a,
        reqwest::Method::PUT,
        "/api/v1/environments/qa/desired",
        json!({"sha": sha}),
    )
    .await;
    wait_until(Duration::from_secs(30), "a replica at the lock", || async {
        lock_waiters(&url).await >= 1
    })
    .await;
    // Without claims both replicas wait here; with them the second never gets this far. Give
    // it a bounded chance to arrive, then let the pass go either way.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while lock_waiters(&url).await < 2 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sqlx::query("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("rollback");
    drop(locker.close().await);

    let grants = "SELECT count(*) FROM grants WHERE environment_id = $1 AND kind = 'lease'";
    wait_until(Duration::from_secs(30), "the probe's grant", || async {
        count(&url, grants, env_id).await >= 1
    })
    .await;
    let probes = "SELECT count(*) FROM tasks WHERE agent_id = $1 AND task_type = 'readiness-probe'";
    assert!(
        count(&url, probes, agent.id.0).await >= 1,
        "the probe queued"
    );
    // Both replicas went on to pass over the environment again.
    let (a1, b1) = (
        units_done(&a, "readiness").await,
        units_done(&b, "readiness").await,
    );
    wait_until(
        Duration::from_secs(30),
        "both replicas' next passes",
        || async {
            units_done(&a, "readiness").await >= a1 + 2.0
                && units_done(&b, "readiness").await >= b1 + 2.0
        },
    )
    .await;
    assert_eq!(
        count(&url, grants, env_id).await,
        1,
        "one grant for the pass's probe, however many replicas ran it"
    );
    assert_valid_exposition(&metrics(&a).await);

    heartbeats.abort();
    b.stop().await;
    a.stop().await;
    drop(db);
}
