//! Runs the Store conformance suite on both backends, one test per case per backend
//! (`sqlite::<case>`, `postgres::<case>`), each on a store of its own: SQLite in a temp dir,
//! PostgreSQL in a throwaway database on the server `BERTH_TEST_POSTGRES_URL` names (an admin
//! URL). Without that variable the PostgreSQL tests skip, except under `CI=true` or
//! `BERTH_REQUIRE_SERVICES=1`, where they fail.
//!
//! One case on one backend: `cargo test -p berth-store --test conformance -- --exact
//! postgres::task_cancel`.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;

use berth_store::{DynStore, PayloadKey, PostgresStore, SqliteStore};
use berth_test_utils::postgres::{admin_url as postgres_admin_url, TestDatabase};
use sqlx::{Connection, PgConnection};

/// The one payload key of this test process: a database reopened by a case opens its rows.
fn key() -> PayloadKey {
    static KEY: std::sync::LazyLock<PayloadKey> =
        std::sync::LazyLock::new(|| PayloadKey::new(berth_crypto::MasterKey::generate()));
    KEY.clone()
}

/// Runs `test` on a fresh SQLite store in a temp dir.
async fn on_sqlite<F, Fut>(test: F)
where
    F: FnOnce(DynStore) -> Fut,
    Fut: Future<Output = ()>,
{
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(&dir.path().join("berth.db"), key())
        .await
        .expect("open sqlite");
    test(Arc::new(store)).await;
}

/// Runs `test` on a fresh PostgreSQL store in a database of its own, dropped afterwards even
/// when the test fails. `test` also gets the database's URL.
async fn on_postgres<F, Fut>(test: F)
where
    F: FnOnce(DynStore, String) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let Some(admin_url) = postgres_admin_url("postgres conformance") else {
        return;
    };
    let database = TestDatabase::create(&admin_url);
    let url = database.url.clone();
    // Run in a task so a failing case (a panic) still lets us drop the database below.
    let outcome = tokio::spawn(async move {
        let store: DynStore = Arc::new(
            PostgresStore::connect(&url, key())
                .await
                .expect("connect postgres"),
        );
        test(store, url).await;
    })
    .await;
    drop(database);
    if let Err(failure) = outcome {
        std::panic::resume_unwind(failure.into_panic());
    }
}

/// One test per case on each backend.
macro_rules! conformance_tests {
    ($($case:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::on_sqlite(|store| async move {
                        berth_store::conformance::$case(&store).await
                    })
                    .await;
                }
            )*
        }

        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    super::on_postgres(|store, _| async move {
                        berth_store::conformance::$case(&store).await
                    })
                    .await;
                }
            )*
        }
    };
}

berth_store::conformance_cases!(conformance_tests);

/// The names `conformance_cases!` lists, for [`every_case_is_listed`].
macro_rules! case_names {
    ($($case:ident),* $(,)?) => {
        [$(stringify!($case)),*]
    };
}

/// A case written but not listed in `conformance_cases!` would never run: every
/// `pub async fn <case>(store: &DynStore)` of the suite's sources must be listed, once.
#[test]
fn every_case_is_listed() {
    let listed: Vec<&str> = berth_store::conformance_cases!(case_names).to_vec();
    let unique: BTreeSet<&str> = listed.iter().copied().collect();
    assert_eq!(unique.len(), listed.len(), "a case is listed twice");
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/conformance");
    let mut defined = BTreeSet::new();
    for entry in std::fs::read_dir(&dir).expect("read src/conformance") {
        let source = std::fs::read_to_string(entry.expect("dir entry").path()).expect("read");
        for line in source.lines() {
            if let Some(rest) = line.strip_prefix("pub async fn ") {
                if let Some(name) = rest.strip_suffix("(store: &DynStore) {") {
                    defined.insert(name.to_string());
                }
            }
        }
    }
    let listed: BTreeSet<String> = unique.iter().map(|s| s.to_string()).collect();
    assert_eq!(defined, listed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_reopen_keeps_data_and_migrations_are_idempotent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("nested.db");
    let now = time::OffsetDateTime::now_utc();
    let tenant = {
        let store = SqliteStore::open(&path, key()).await.expect("open sqlite");
        berth_store::TenantStore::ensure_tenant(&store, "default", now)
            .await
            .expect("ensure")
    };
    let store: DynStore = berth_store::open(&format!("sqlite://{}", path.display()), key())
        .await
        .expect("reopen");
    assert_eq!(store.backend(), "sqlite");
    assert_eq!(
        store.get_tenant(tenant.id).await.expect("get"),
        Some(tenant)
    );
}

/// Issue 17: a task's payload is sealed at rest. A dump of the database (here: every byte of
/// the SQLite file and its WAL) does not hold it, nor does the audit log; the store opens it;
/// a server with another master key reads the row as corrupt, never as some other payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_keeps_task_payloads_sealed_at_rest() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("berth.db");
    let marker = format!("marker-{}", uuid::Uuid::new_v4());
    let store: DynStore = Arc::new(SqliteStore::open(&path, key()).await.expect("open"));
    let task = berth_store::conformance::task_with_payload_marker(&store, &marker).await;
    let mut dump = std::fs::read(&path).expect("the database file");
    dump.extend(std::fs::read(dir.path().join("berth.db-wal")).unwrap_or_default());
    assert!(
        !dump.windows(marker.len()).any(|w| w == marker.as_bytes()),
        "the payload is in the database in clear"
    );
    let conn = rusqlite::Connection::open(&path).expect("raw connection");
    let stored: String = conn
        .query_row("SELECT payload FROM tasks", [], |row| row.get(0))
        .expect("the row");
    assert!(stored.starts_with("\"sealed:v1:"), "{stored}");
    let entry: String = conn
        .query_row(
            "SELECT entry FROM audit_log WHERE entry LIKE '%task.create%'",
            [],
            |row| row.get(0),
        )
        .expect("the audit entry");
    assert!(entry.contains("payloadSha256"), "{entry}");
    drop(conn);
    drop(store);

    let other = berth_store::PayloadKey::new(berth_crypto::MasterKey::generate());
    let store = SqliteStore::open(&path, other).await.expect("reopen");
    match berth_store::TaskStore::get_task(&store, task.tenant_id, task.id).await {
        Err(berth_store::StoreError::Corrupt(why)) => assert!(why.contains("master key"), "{why}"),
        other => panic!("another key must not open the payload: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_keeps_task_payloads_sealed_at_rest() {
    on_postgres(|store, url| async move {
        let marker = format!("marker-{}", uuid::Uuid::new_v4());
        berth_store::conformance::task_with_payload_marker(&store, &marker).await;
        let mut admin = PgConnection::connect(&url).await.expect("connect");
        let dump: Vec<(String,)> =
            sqlx::query_as("SELECT t::text FROM tasks t UNION ALL SELECT a::text FROM audit_log a")
                .fetch_all(&mut admin)
                .await
                .expect("the rows");
        assert!(dump.len() >= 2, "{dump:?}");
        for (row,) in &dump {
            assert!(!row.contains(&marker), "in clear: {row}");
        }
        assert!(dump[0].0.contains("sealed:v1:"), "{}", dump[0].0);
        assert!(
            dump.iter().any(|(row,)| row.contains("payloadSha256")),
            "{dump:?}"
        );
        admin.close().await.ok();
    })
    .await;
}

/// A migration row newer than any this build knows, as a newer berth would leave it.
const FUTURE_MIGRATION: &str = "INSERT INTO _sqlx_migrations \
     (version, description, success, checksum, execution_time) \
     VALUES (999999, 'from a newer berth', TRUE, '\\x00', 0)";

/// The refusal a store must give on a database from the future: the versions, and no change.
fn assert_from_the_future(opened: berth_store::Result<DynStore>) {
    match opened {
        Err(
            e @ berth_store::StoreError::SchemaFromTheFuture {
                found: 999999,
                known,
            },
        ) => {
            assert!(known > 0 && known < 999999);
            let message = e.to_string();
            assert!(
                message.contains("999999") && message.contains("newer berth"),
                "{message}"
            );
        }
        Err(e) => panic!("expected SchemaFromTheFuture, got {e:?}"),
        Ok(_) => panic!("a database from a newer berth was opened"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_refuses_a_database_from_a_newer_berth() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("berth.db");
    drop(SqliteStore::open(&path, key()).await.expect("open sqlite"));
    let conn = rusqlite::Connection::open(&path).expect("raw connection");
    conn.execute(&FUTURE_MIGRATION.replace("'\\x00'", "x'00'"), [])
        .expect("a future migration row");
    drop(conn);
    assert_from_the_future(berth_store::open(&format!("sqlite://{}", path.display()), key()).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_a_database_from_a_newer_berth() {
    on_postgres(|_, url| async move {
        let mut admin = PgConnection::connect(&url).await.expect("connect");
        sqlx::query(FUTURE_MIGRATION)
            .execute(&mut admin)
            .await
            .expect("a future migration row");
        assert_from_the_future(berth_store::open(&url, key()).await);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_reopen_runs_migrations_again() {
    on_postgres(|_, url| async move {
        // `open` dispatches on the URL scheme and re-running migrations is a no-op.
        let reopened = berth_store::open(&url, key())
            .await
            .expect("reopen postgres");
        assert_eq!(reopened.backend(), "postgres");
        reopened.ping().await.expect("ping");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_listener_survives_a_dropped_connection() {
    on_postgres(
        |store, url| async move { listener_survives_a_dropped_connection(&store, &url).await },
    )
    .await;
}

/// Kills the backend of the store's LISTEN connection: the store must say "wake everyone" (the
/// nil agent id), listen again, and carry the next notification.
async fn listener_survives_a_dropped_connection(store: &DynStore, url: &str) {
    use std::time::Duration;
    let mut events = store.task_events();
    let mut admin = PgConnection::connect(url).await.expect("connect");
    let killed: Vec<(bool,)> = sqlx::query_as(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND pid <> pg_backend_pid() \
         AND query ILIKE 'LISTEN%'",
    )
    .fetch_all(&mut admin)
    .await
    .expect("terminate the listener");
    assert_eq!(killed, vec![(true,)], "exactly one listener connection");
    let woken = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            match events.recv().await {
                Ok(id) if id.0.is_nil() => return,
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("task events closed: {e}"),
            }
        }
    })
    .await;
    assert!(woken.is_ok(), "a dropped listener wakes everyone");
    // Listening again: a notification sent now arrives.
    let agent = uuid::Uuid::new_v4();
    let arrived = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            sqlx::query("SELECT pg_notify('berth_tasks', $1)")
                .bind(agent.to_string())
                .execute(&mut admin)
                .await
                .expect("notify");
            match tokio::time::timeout(Duration::from_millis(500), events.recv()).await {
                Ok(Ok(id)) if id.0 == agent => return,
                _ => {}
            }
        }
    })
    .await;
    assert!(
        arrived.is_ok(),
        "the listener listens again after reconnecting"
    );
    admin.close().await.ok();
}

/// Both backends must carry the same schema history: a migration added to one and not the
/// other is a drift this test refuses.
#[test]
fn migration_directories_match() {
    let sqlite = sqlx::migrate!("./migrations/sqlite");
    let postgres = sqlx::migrate!("./migrations/postgres");
    let versions = |m: &sqlx::migrate::Migrator| {
        m.iter()
            .map(|m| (m.version, m.description.to_string()))
            .collect::<Vec<_>>()
    };
    assert!(sqlite.iter().next().is_some(), "migrations are embedded");
    assert_eq!(versions(&sqlite), versions(&postgres));

    let files = |backend: &str| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("migrations")
            .join(backend);
        std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
            .map(|entry| {
                entry
                    .expect("dir entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(files("sqlite"), files("postgres"));
}

/// The store has no way to change a release, and the database refuses one too (migration
/// 0009's trigger), so not even a future query can rewrite what was deployed.
async fn release_rows_refuse_updates(store: &DynStore, update: impl Future<Output = bool>) {
    let tenant = store
        .create_tenant(
            berth_proto::TenantId::new(),
            "immutable",
            berth_proto::audit::AuditActor::Agent {
                id: uuid::Uuid::nil(),
            },
            time::OffsetDateTime::now_utc(),
        )
        .await
        .expect("tenant");
    store
        .create_release(
            berth_store::Release {
                id: berth_proto::ReleaseId::new(),
                tenant_id: tenant.id,
                name: "r1".into(),
                components: vec![],
                compose_lock: None,
                ssh: None,
                created_at: time::OffsetDateTime::now_utc(),
            },
            berth_proto::audit::AuditActor::Agent {
                id: uuid::Uuid::nil(),
            },
        )
        .await
        .expect("create release");
    assert!(!update.await, "an UPDATE of a release row must fail");
    assert_eq!(
        store
            .get_release(tenant.id, "r1")
            .await
            .expect("get")
            .map(|r| r.name),
        Some("r1".to_string())
    );
}

const UPDATE_RELEASE: &str = "UPDATE releases SET name = 'rewritten'";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_release_rows_refuse_updates() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("berth.db");
    let store: DynStore = Arc::new(SqliteStore::open(&path, key()).await.expect("open sqlite"));
    let update = async {
        let conn = rusqlite::Connection::open(&path).expect("open");
        conn.execute(UPDATE_RELEASE, []).is_ok()
    };
    release_rows_refuse_updates(&store, update).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_release_rows_refuse_updates() {
    on_postgres(|store, url| async move {
        let update = async move {
            let mut conn = PgConnection::connect(&url).await.expect("connect");
            sqlx::query(UPDATE_RELEASE).execute(&mut conn).await.is_ok()
        };
        release_rows_refuse_updates(&store, update).await;
    })
    .await;
}

/// Two replicas (two stores, each with its own pool, on one database) appending to one tenant's
/// audit chain at once still make one linear chain: no fork, no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_two_replicas_append_one_audit_chain() {
    on_postgres(|first, url| async move {
        let second: DynStore =
            Arc::new(PostgresStore::connect(&url, key()).await.expect("connect"));
        let tenant = first
            .create_tenant(
                berth_proto::TenantId::new(),
                "audited",
                berth_proto::audit::AuditActor::Agent {
                    id: uuid::Uuid::nil(),
                },
                time::OffsetDateTime::now_utc(),
            )
            .await
            .expect("tenant");
        let appends = (0..60).map(|i| {
            let store = if i % 2 == 0 {
                first.clone()
            } else {
                second.clone()
            };
            tokio::spawn(async move {
                store
                    .append_audit(berth_store::NewAuditEvent {
                        tenant_id: tenant.id,
                        actor: berth_proto::audit::AuditActor::Agent {
                            id: uuid::Uuid::new_v4(),
                        },
                        action: berth_proto::audit::actions::TASK_RETRY,
                        subject: format!("task-{i}"),
                        details: serde_json::Value::Null,
                        at: time::OffsetDateTime::now_utc(),
                    })
                    .await
                    .expect("append")
            })
        });
        for append in appends.collect::<Vec<_>>() {
            append.await.expect("append task");
        }
        let chain = second.list_audit(tenant.id, 0, 1000).await.expect("list");
        assert_eq!(chain.len(), 61, "tenant.create and 60 appends");
        berth_store::conformance::assert_linear_chain(&chain);
    })
    .await;
}

/// What a replica that died right after its commit leaves behind: an event staged without an id
/// and an audit entry not yet linked (`postgres/sequencer.rs`). Nothing pokes the surviving
/// store, so its once-a-second sweep must number and link them: the event readable with an id,
/// the entry at the head of its tenant's chain, nothing left staged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_dead_replicas_staged_rows_are_numbered_and_linked() {
    use std::time::Duration;
    on_postgres(|store, url| async move {
        let at = time::OffsetDateTime::now_utc();
        let actor = berth_proto::audit::AuditActor::Agent {
            id: uuid::Uuid::nil(),
        };
        let tenant = store
            .create_tenant(berth_proto::TenantId::new(), "orphaned", actor.clone(), at)
            .await
            .expect("tenant");
        let draft = berth_proto::audit::AuditEntry {
            seq: 0,
            tenant_id: tenant.id,
            at: at.replace_nanosecond(0).expect("whole second"),
            actor,
            action: berth_proto::audit::actions::TASK_RETRY.to_string(),
            subject: "left-by-a-dead-replica".to_string(),
            details: serde_json::Value::Null,
            prev_hash: String::new(),
            hash: String::new(),
        };
        let mut dead = PgConnection::connect(&url).await.expect("connect");
        sqlx::query(
            "INSERT INTO events (tenant_id, kind, data, created_at) \
             VALUES ($1, 'agent.status', '{}'::jsonb, now())",
        )
        .bind(tenant.id.0)
        .execute(&mut dead)
        .await
        .expect("stage an event");
        sqlx::query("INSERT INTO audit_pending (tenant_id, draft) VALUES ($1, $2)")
            .bind(tenant.id.0)
            .bind(serde_json::to_string(&draft).expect("draft"))
            .execute(&mut dead)
            .await
            .expect("stage an audit entry");
        let swept = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                let staged: i64 = sqlx::query_scalar(
                    "SELECT (SELECT count(*) FROM events WHERE id IS NULL) \
                     + (SELECT count(*) FROM audit_pending)",
                )
                .fetch_one(&mut dead)
                .await
                .expect("count staged rows");
                if staged == 0 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
        .await;
        assert!(
            swept.is_ok(),
            "the sweep numbered and linked the staged rows"
        );
        let events = store
            .read_events(tenant.id, &berth_store::EventFilter::default(), 0, 100)
            .await
            .expect("events");
        assert!(
            events.iter().any(|e| e.kind == "agent.status" && e.id > 0),
            "{events:?}"
        );
        let chain = store.list_audit(tenant.id, 0, 100).await.expect("audit");
        berth_store::conformance::assert_linear_chain(&chain);
        let last = chain.last().expect("entries");
        assert_eq!(last.subject, "left-by-a-dead-replica");
        assert_eq!(last.seq, 2, "after tenant.create");
        drop(dead.close().await);
    })
    .await;
}

/// Issue 15: on PostgreSQL the concurrent task path runs in batches. The conformance case
/// `task_path_concurrent` passes either way, since a declined call runs alone; this checks
/// that the batches decided its calls, several at a time, and declined only what they must
/// (the idempotency keys sent twice, the repeated results).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_runs_the_task_path_in_batches() {
    let Some(admin_url) = postgres_admin_url("postgres batches") else {
        return;
    };
    let database = TestDatabase::create(&admin_url);
    let store = Arc::new(
        PostgresStore::connect(&database.url, key())
            .await
            .expect("connect postgres"),
    );
    let dyn_store: DynStore = store.clone();
    berth_store::conformance::task_path_concurrent(&dyn_store).await;
    let stats = store.task_batch_stats();
    eprintln!("{stats:#?}");
    // 16 creators × 10 creations × 2 (the second of a keyed pair is declined: its key is taken).
    let keyed = 16 * 10 / 5;
    assert_eq!(stats.create.decided + stats.create.declined, 320);
    assert!(stats.create.declined <= keyed, "{stats:?}");
    assert!(
        stats.create.batches < 320,
        "creations were batched: {stats:?}"
    );
    // Every result is sent twice at once: the one of each pair that loses the task's lock, or
    // comes second in one batch, may be declined; the first is decided.
    assert!(stats.complete.decided >= 288, "{stats:?}");
    assert!(stats.complete.batches < stats.complete.decided + stats.complete.declined);
    // Two claimers per agent: a second poll of one agent in a batch is declined.
    assert!(stats.claim.decided > stats.claim.declined, "{stats:?}");
    assert!(stats.claim.batches < stats.claim.decided + stats.claim.declined);
}

/// Issue 29, on two replicas over one PostgreSQL: a cancel on one committing while a
/// deployment step on the other creates tasks leaves no task queued for what it stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_two_replicas_cancel_races_a_deployment_step() {
    on_postgres(|first, url| async move {
        let second: DynStore =
            Arc::new(PostgresStore::connect(&url, key()).await.expect("connect"));
        berth_store::conformance::deployment_cancel_races_steps_on(&first, &second, 40).await;
    })
    .await;
}

/// Issue 29, on two replicas over one PostgreSQL: retention on one never frees the key of the
/// read-back an `unknown` task's dedupe rests on, so the read-back sweep on the other
/// schedules no second read-back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_replicas_retention_keeps_an_unknown_tasks_read_back() {
    on_postgres(|first, url| async move {
        let second: DynStore =
            Arc::new(PostgresStore::connect(&url, key()).await.expect("connect"));
        berth_store::conformance::retention_keeps_an_unknown_tasks_read_back_on(&first, &second)
            .await;
    })
    .await;
}
