//! Runs the Store conformance suite on both backends: SQLite in a temp dir always, PostgreSQL
//! when `BERTH_TEST_POSTGRES_URL` names an admin URL (each run gets its own throwaway database).
//! Under `CI=true` a missing PostgreSQL is a failure, never a silent skip.

use std::collections::BTreeSet;
use std::sync::Arc;

use berth_store::{conformance, DynStore, PostgresStore, SqliteStore};
use sqlx::{Connection, Executor, PgConnection};

const POSTGRES_URL_VAR: &str = "BERTH_TEST_POSTGRES_URL";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_conformance() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(&dir.path().join("berth.db"))
        .await
        .expect("open sqlite");
    conformance::run_all(Arc::new(store)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_reopen_keeps_data_and_migrations_are_idempotent() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("nested.db");
    let now = time::OffsetDateTime::now_utc();
    let tenant = {
        let store = SqliteStore::open(&path).await.expect("open sqlite");
        berth_store::TenantStore::ensure_tenant(&store, "default", now)
            .await
            .expect("ensure")
    };
    let store: DynStore = berth_store::open(&format!("sqlite://{}", path.display()))
        .await
        .expect("reopen");
    assert_eq!(store.backend(), "sqlite");
    assert_eq!(
        store.get_tenant(tenant.id).await.expect("get"),
        Some(tenant)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_conformance() {
    let Ok(admin_url) = std::env::var(POSTGRES_URL_VAR) else {
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            panic!(
                "{POSTGRES_URL_VAR} is not set under CI=true: start PostgreSQL with \
                 `bash scripts/postgres.sh` and export its last line as {POSTGRES_URL_VAR}"
            );
        }
        eprintln!("postgres_conformance skipped: {POSTGRES_URL_VAR} is not set");
        return;
    };
    let database = TestDatabase::create(&admin_url).await;
    let url = database.url.clone();
    // Run in a task so a failing case (a panic) still lets us drop the database below.
    let outcome = tokio::spawn(async move {
        let store: DynStore = Arc::new(
            PostgresStore::connect(&url)
                .await
                .expect("connect postgres"),
        );
        conformance::run_all(store.clone()).await;
        listener_survives_a_dropped_connection(&store, &url).await;
        // `open` dispatches on the URL scheme and re-running migrations is a no-op.
        let reopened = berth_store::open(&url).await.expect("reopen postgres");
        assert_eq!(reopened.backend(), "postgres");
        reopened.ping().await.expect("ping");
    })
    .await;
    database.drop().await;
    if let Err(failure) = outcome {
        std::panic::resume_unwind(failure.into_panic());
    }
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

/// A database `berth_test_<random>` on the admin URL's server, dropped by [`TestDatabase::drop`].
struct TestDatabase {
    admin_url: String,
    name: String,
    url: String,
}

impl TestDatabase {
    async fn create(admin_url: &str) -> TestDatabase {
        let name = format!("berth_test_{}", uuid::Uuid::new_v4().simple());
        let mut admin = PgConnection::connect(admin_url)
            .await
            .expect("connect to the admin url");
        // DDL takes no bind parameters; the name is ours, made of [a-z0-9_] only.
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .expect("create test database");
        admin.close().await.ok();
        TestDatabase {
            admin_url: admin_url.to_string(),
            url: with_database(admin_url, &name),
            name,
        }
    }

    async fn drop(self) {
        let mut admin = PgConnection::connect(&self.admin_url)
            .await
            .expect("connect to the admin url");
        // FORCE ends the pool's connections that may still be closing.
        admin
            .execute(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name).as_str())
            .await
            .expect("drop test database");
        admin.close().await.ok();
    }
}

/// The admin URL with its database path replaced, keeping any query string.
fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map_or(0, |i| i + 3);
    let authority_end = base[scheme_end..]
        .find('/')
        .map_or(base.len(), |i| scheme_end + i);
    let mut out = format!("{}/{database}", &base[..authority_end]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

#[test]
fn with_database_replaces_only_the_path() {
    assert_eq!(
        with_database("postgres://berth:berth@127.0.0.1:55432/postgres", "x"),
        "postgres://berth:berth@127.0.0.1:55432/x"
    );
    assert_eq!(
        with_database("postgres://h:1?sslmode=disable", "x"),
        "postgres://h:1/x?sslmode=disable"
    );
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
