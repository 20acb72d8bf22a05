//! Upgrades of a populated database (issue 16 item 5), on SQLite and on PostgreSQL: one
//! database is migrated one migration at a time, and after migration `NNNN` the rows of
//! `tests/upgrade/NNNN.sql` (as berth wrote them at that version) are added. So every migration
//! runs on a database populated at the versions before it, and no table may lose a row to it.
//! Then today's store opens the database and reads and uses every row: the payloads written in
//! clear, the audit chain (verified, and appended to), policies written before their newer
//! fields, the old pending task claimed and the expired lease swept.
//!
//! Without `BERTH_TEST_POSTGRES_URL` the PostgreSQL case skips, except under `CI=true` or
//! `BERTH_REQUIRE_SERVICES=1`, where it fails.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use berth_proto::audit::AuditActor;
use berth_proto::task::TaskState;
use berth_proto::{AgentId, TaskId, TenantId};
use berth_store::{
    ClaimOutcome, DynStore, EventFilter, NewAuditEvent, PayloadKey, PostgresStore, RetryPolicy,
    SessionOutcome, SqliteStore,
};
use berth_test_utils::postgres::{admin_url, TestDatabase};
use serde_json::json;
use sqlx::migrate::Migrator;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{PgPool, SqlitePool};
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

static SQLITE: Migrator = sqlx::migrate!("./migrations/sqlite");
static POSTGRES: Migrator = sqlx::migrate!("./migrations/postgres");

const TENANT: &str = "01900000-0000-7000-8000-000000000001";
const WEB_1: &str = "01900000-0000-7000-8000-000000000011";
const DB_1: &str = "01900000-0000-7000-8000-000000000012";
const WEB_1_CERT: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const SUCCEEDED: &str = "01900000-0000-7000-8000-000000000021";
const PENDING_DEPLOY: &str = "01900000-0000-7000-8000-000000000022";
const UNKNOWN_DEPLOY: &str = "01900000-0000-7000-8000-000000000023";
const READ_BACK: &str = "01900000-0000-7000-8000-000000000024";
const LEASED_LONG_AGO: &str = "01900000-0000-7000-8000-000000000025";
const DEPLOYMENT: &str = "01900000-0000-7000-8000-000000000061";

fn uuid(text: &str) -> uuid::Uuid {
    text.parse().expect("a fixture id")
}

#[derive(Clone, Copy, Debug)]
enum Dialect {
    Sqlite,
    Postgres,
}

/// `tests/upgrade/NNNN.sql` for `version` in `dialect`, when there is one.
fn fixture(version: i64, dialect: Dialect) -> Option<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/upgrade")
        .join(format!("{version:04}.sql"));
    let text = std::fs::read_to_string(path).ok()?;
    Some(translate(&text, dialect))
}

/// Replaces the markers of tests/upgrade/README.md with `dialect`'s spelling. Any other `@` (an
/// image reference's `@sha256:`) stays as it is.
fn translate(sql: &str, dialect: Dialect) -> String {
    const MARKERS: [&str; 3] = ["@ts(", "@b(", "@hex("];
    let mut out = String::with_capacity(sql.len());
    let mut rest = sql;
    while let Some((at, marker)) = MARKERS
        .iter()
        .filter_map(|m| rest.find(m).map(|at| (at, *m)))
        .min()
    {
        out.push_str(&rest[..at]);
        let after = &rest[at + marker.len()..];
        let close = after.find(')').expect("a marker is closed");
        let value = &after[..close];
        out.push_str(&match (marker, dialect) {
            ("@ts(", Dialect::Sqlite) => {
                let at = OffsetDateTime::parse(value, &Rfc3339).expect("an RFC 3339 time");
                (at.unix_timestamp_nanos() / 1_000_000).to_string()
            }
            ("@ts(", Dialect::Postgres) => format!("'{value}'"),
            ("@b(", Dialect::Sqlite) => value.to_string(),
            ("@b(", Dialect::Postgres) => if value == "1" { "TRUE" } else { "FALSE" }.to_string(),
            ("@hex(", Dialect::Sqlite) => format!("X'{value}'"),
            (_, Dialect::Postgres) => format!("'\\x{value}'::bytea"),
            _ => unreachable!("one of MARKERS"),
        });
        rest = &after[close + 1..];
    }
    out.push_str(rest);
    out
}

/// The database a migration at a time, as an operator's database lived through each release.
enum Steps {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

impl Steps {
    fn migrator(&self) -> &'static Migrator {
        match self {
            Steps::Sqlite(_) => &SQLITE,
            Steps::Postgres(_) => &POSTGRES,
        }
    }

    fn dialect(&self) -> Dialect {
        match self {
            Steps::Sqlite(_) => Dialect::Sqlite,
            Steps::Postgres(_) => Dialect::Postgres,
        }
    }

    /// Applies the migrations up to and including the `upto`-th.
    async fn migrate(&self, upto: usize) {
        let all = self.migrator().migrations.as_ref();
        let partial = Migrator {
            migrations: Cow::Owned(all[..=upto].to_vec()),
            ..Migrator::DEFAULT
        };
        let version = all[upto].version;
        match self {
            Steps::Sqlite(pool) => partial.run(pool).await,
            Steps::Postgres(pool) => partial.run(pool).await,
        }
        .unwrap_or_else(|e| panic!("migration {version} on a populated database: {e}"));
    }

    async fn execute(&self, sql: &str, what: &str) {
        match self {
            Steps::Sqlite(pool) => sqlx::raw_sql(sql).execute(pool).await.map(drop),
            Steps::Postgres(pool) => sqlx::raw_sql(sql).execute(pool).await.map(drop),
        }
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    }

    /// The number of rows of every table berth owns.
    async fn row_counts(&self) -> BTreeMap<String, i64> {
        let tables: Vec<String> = match self {
            Steps::Sqlite(pool) => {
                sqlx::query_scalar(
                    "SELECT name FROM sqlite_master WHERE type = 'table' \
                 AND name NOT LIKE 'sqlite_%' AND name <> '_sqlx_migrations'",
                )
                .fetch_all(pool)
                .await
            }
            Steps::Postgres(pool) => {
                sqlx::query_scalar(
                    "SELECT table_name::text FROM information_schema.tables \
                 WHERE table_schema = current_schema() AND table_type = 'BASE TABLE' \
                 AND table_name <> '_sqlx_migrations'",
                )
                .fetch_all(pool)
                .await
            }
        }
        .expect("list the tables");
        let mut counts = BTreeMap::new();
        for table in tables {
            let sql = format!("SELECT COUNT(*) FROM \"{table}\"");
            let n: i64 = match self {
                Steps::Sqlite(pool) => sqlx::query_scalar(&sql).fetch_one(pool).await,
                Steps::Postgres(pool) => sqlx::query_scalar(&sql).fetch_one(pool).await,
            }
            .expect("count a table's rows");
            counts.insert(table, n);
        }
        counts
    }

    /// Every migration in order, each on the rows of the versions before it.
    async fn populate_through_every_version(&self) {
        let dialect = self.dialect();
        let migrations = self.migrator().migrations.as_ref();
        let mut populated = 0;
        for (i, migration) in migrations.iter().enumerate() {
            let before = self.row_counts().await;
            self.migrate(i).await;
            let after = self.row_counts().await;
            for (table, rows) in &before {
                let now = after.get(table).copied().unwrap_or(0);
                assert!(
                    now >= *rows,
                    "migration {} ({}) lost rows of {table}: {rows} before, {now} after",
                    migration.version,
                    migration.description
                );
            }
            if let Some(sql) = fixture(migration.version, dialect) {
                self.execute(&sql, &format!("rows of schema {:04}", migration.version))
                    .await;
                populated += 1;
            }
        }
        assert!(populated >= 13, "the fixtures were not found: {populated}");
    }
}

fn key() -> PayloadKey {
    PayloadKey::new(berth_crypto::MasterKey::generate())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_upgrades_a_database_populated_at_every_version() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("berth.db");
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .foreign_keys(true);
    let pool = SqlitePool::connect_with(options)
        .await
        .expect("open sqlite");
    let steps = Steps::Sqlite(pool.clone());
    steps.populate_through_every_version().await;
    pool.close().await;

    let store: DynStore = Arc::new(SqliteStore::open(&path, key()).await.expect("open"));
    check_upgraded(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_upgrades_a_database_populated_at_every_version() {
    let Some(admin) = admin_url("postgres upgrade") else {
        return;
    };
    let database = TestDatabase::create(&admin);
    let url = database.url.clone();
    // In a task, so that a failure still drops the database below.
    let outcome = tokio::spawn(async move {
        let pool = PgPool::connect(&url).await.expect("connect postgres");
        let steps = Steps::Postgres(pool.clone());
        steps.populate_through_every_version().await;
        pool.close().await;
        let store: DynStore = Arc::new(PostgresStore::connect(&url, key()).await.expect("open"));
        check_upgraded(&store).await;
    })
    .await;
    drop(database);
    if let Err(failure) = outcome {
        std::panic::resume_unwind(failure.into_panic());
    }
}

/// Today's store on the upgraded database: every fixture row reads back as written, and the old
/// rows take part in today's operations.
async fn check_upgraded(store: &DynStore) {
    let tenant = TenantId(uuid(TENANT));
    let now = OffsetDateTime::now_utc();

    // 0001: the tenant, the operator's token, the agents.
    assert_eq!(
        store
            .get_tenant(tenant)
            .await
            .unwrap()
            .expect("tenant")
            .name,
        "default"
    );
    let token = store
        .api_token_by_hash("a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0")
        .await
        .unwrap()
        .expect("the operator's token");
    assert!(token.operator, "{token:?}");
    assert!(store.has_operator_token(tenant).await.unwrap());
    let web = store
        .get_agent(tenant, AgentId(uuid(WEB_1)))
        .await
        .unwrap()
        .expect("web-1");
    assert_eq!(web.name, "web-1");
    assert_eq!(web.labels.get("role").map(String::as_str), Some("web"));
    assert_eq!(web.capabilities.len(), 2, "{web:?}");
    assert_eq!(web.generation, 3);
    assert_eq!(web.certificate_fingerprint.as_deref(), Some(WEB_1_CERT));
    assert_eq!(web.resource_usage.expect("resource usage").cpu_cores, 2);
    let db = store
        .get_agent(tenant, AgentId(uuid(DB_1)))
        .await
        .unwrap()
        .expect("db-1");
    assert!(db.cordoned && !db.suspended, "0018's hold: {db:?}");
    let agents = store
        .list_agents(tenant, &Default::default(), None, 10)
        .await
        .unwrap();
    assert_eq!(agents.items.len(), 2);

    // 0002: tasks in every state, their payloads written in clear.
    let task = |id: &str| {
        let id = TaskId(uuid(id));
        async move {
            store
                .get_task(tenant, id)
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("task {}", id.0))
        }
    };
    let (succeeded, attempts) = task(SUCCEEDED).await;
    assert_eq!(succeeded.state, TaskState::Succeeded);
    assert_eq!(succeeded.payload["url"], "http://127.0.0.1:8080/health");
    assert_eq!(succeeded.variables.get("K").map(String::as_str), Some("V"));
    assert_eq!(succeeded.result, Some(json!({"ok": true})));
    assert_eq!(attempts.len(), 1);
    assert!(attempts[0].envelope.is_some() && !attempts[0].start_handshake);
    let (unknown, _) = task(UNKNOWN_DEPLOY).await;
    assert_eq!(unknown.state, TaskState::Unknown);
    let (read_back, _) = task(READ_BACK).await;
    assert!(read_back.read_back);
    assert_eq!(read_back.read_back_of, Some(unknown.id));
    assert_eq!(read_back.result, Some(json!({"found": false})));

    // The old pending deploy is claimed under a new session, its clear payload intact.
    let generation = match store
        .acquire_session(
            web.id,
            WEB_1_CERT,
            "instance-after-upgrade",
            None,
            now,
            now + Duration::from_secs(30),
        )
        .await
        .unwrap()
    {
        SessionOutcome::Acquired { generation, .. } => generation,
        other => panic!("web-1's session after the upgrade: {other:?}"),
    };
    assert_eq!(generation, 4, "the generation goes on from the stored one");
    match store
        .claim_task(
            web.id,
            generation,
            WEB_1_CERT,
            &["docker".to_string(), "compose".to_string()],
            true,
            now,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    {
        ClaimOutcome::Claimed(task, attempt) => {
            assert_eq!(task.id, TaskId(uuid(PENDING_DEPLOY)));
            assert_eq!(task.idempotency_key.as_deref(), Some("deploy-web-v1"));
            assert_eq!(task.payload["containerName"], "web");
            assert_eq!(attempt.generation, generation);
        }
        other => panic!("the old pending task is not claimed: {other:?}"),
    }
    // The lease that ran out before the upgrade is swept as any other.
    let sweep = store
        .expire_leases(now, &RetryPolicy::default())
        .await
        .unwrap();
    assert_eq!(sweep.requeued.len(), 1, "{sweep:?}");
    let (swept, _) = task(LEASED_LONG_AGO).await;
    assert_eq!(swept.state, TaskState::RetryWait, "{swept:?}");

    // Every old task is listed.
    let listed = store
        .list_tasks(tenant, &Default::default(), None, 100)
        .await
        .unwrap();
    assert_eq!(listed.items.len(), 6, "{:?}", listed.items);

    // 0009: the release.
    let release = store
        .get_release(tenant, "v1")
        .await
        .unwrap()
        .expect("release v1");
    assert_eq!(release.components.len(), 2);

    // 0010: the audit chain verifies, and today's store appends after it.
    let appended = store
        .append_audit(NewAuditEvent {
            tenant_id: tenant,
            actor: AuditActor::Agent { id: web.id.0 },
            action: berth_proto::audit::actions::AGENT_CORDON,
            subject: WEB_1.into(),
            details: json!({}),
            at: now,
        })
        .await
        .unwrap();
    let chain = store.list_audit(tenant, 0, 100).await.unwrap();
    assert_eq!(chain.len(), 3);
    assert_eq!(berth_proto::audit::verify_chain(&chain, 0), Ok(3));
    assert_eq!(appended.seq, 3);

    // 0011 and later: the events the triggers wrote.
    let events = store
        .read_events(tenant, &EventFilter::default(), 0, 1000)
        .await
        .unwrap();
    for kind in ["task.state", "agent.status", "agent.hold"] {
        assert!(
            events.iter().any(|e| e.kind == kind),
            "no {kind} event: {events:?}"
        );
    }

    // 0012: the environment (its policy from before requireReady), the deployment.
    let prod = store
        .get_environment(tenant, "prod")
        .await
        .unwrap()
        .expect("prod");
    assert!(prod.policy.auto_rollback && !prod.policy.require_ready);
    assert_eq!(
        prod.current_release.as_ref().map(|r| r.name.as_str()),
        Some("v1")
    );
    let deployment = store
        .get_deployment(tenant, berth_proto::DeploymentId(uuid(DEPLOYMENT)))
        .await
        .unwrap()
        .expect("the deployment");
    assert_eq!(deployment.targets.len(), 1);
    assert_eq!(deployment.approvals.len(), 1);
    assert_eq!(store.target_observations(prod.id).await.unwrap().len(), 1);

    // 0014: the desired-state environment, its bundle and its agent.
    let edge = store
        .desired_environment(tenant, "edge")
        .await
        .unwrap()
        .expect("edge");
    let sha = edge.desired_sha.clone().expect("a desired bundle");
    assert_eq!(
        store.get_bundle(edge.id, &sha).await.unwrap(),
        Some(vec![0x1f, 0x8b, 0x08, 0x00])
    );
    let desired = store.desired_agents(edge.id).await.unwrap();
    assert_eq!(desired.len(), 1);
    assert_eq!(desired[0].applied_sha.as_deref(), Some(sha.as_str()));

    // 0015: the secret's metadata and the grant.
    assert_eq!(store.list_secrets(tenant, "prod/").await.unwrap().len(), 1);
    assert!(store.grant("g-upgrade-kit").await.unwrap().is_some());

    // 0016: the SSH target, the artifact, the SSH environment.
    let target = store
        .get_ssh_target(tenant, "db-1")
        .await
        .unwrap()
        .expect("the SSH target");
    assert_eq!(target.port, 2222);
    assert_eq!(store.list_artifacts(tenant).await.unwrap().len(), 1);
    assert!(store.get_environment(tenant, "db").await.unwrap().is_some());

    // 0017: the operator's web session.
    assert!(store
        .ui_session(
            "e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0e0",
            now
        )
        .await
        .unwrap()
        .is_some());

    // 0019: the webhook and the notification its outbox trigger wrote.
    assert_eq!(store.list_webhooks(tenant).await.unwrap().len(), 1);
    let notifications = store.list_notifications(tenant, None, 10).await.unwrap();
    assert!(
        notifications.iter().any(|n| n.event_kind == "agent.status"),
        "{notifications:?}"
    );

    // 0020: the readiness of prod.
    let readiness = store
        .get_readiness(tenant, prod.id)
        .await
        .unwrap()
        .expect("prod's readiness");
    assert!(readiness.operational_ready);
    assert_eq!(readiness.conditions.len(), 1);
}
