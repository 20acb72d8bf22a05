//! The pool's hygiene on a real PostgreSQL (issue 15 item 5): its statement timeout, its bound
//! under load, its acquire timeout, and dead connections replaced. Each test has a throwaway
//! database on `BERTH_TEST_POSTGRES_URL`'s server and watches it from an admin connection to
//! the server's own database. Without the variable they skip, except where services are
//! required (`CI=true`, `BERTH_REQUIRE_SERVICES=1`), where they fail.

use std::sync::Arc;
use std::time::Duration;

use berth_proto::audit::AuditActor;
use berth_proto::TenantId;
use berth_test_utils::postgres::{admin_url, TestDatabase};
use sqlx::{Connection, PgConnection};
use time::OffsetDateTime;
use uuid::Uuid;

use super::PostgresStore;
use crate::rows::db_error;
use crate::{PayloadKey, PostgresPoolConfig, Store, StoreError, TaskStore, TenantStore};

fn key() -> PayloadKey {
    PayloadKey::new(berth_crypto::MasterKey::generate())
}

/// A database of its own and an admin connection (to the server's `postgres` database, so it
/// is not one of the connections counted on the test database).
async fn database(test: &str) -> Option<(TestDatabase, PgConnection)> {
    let url = admin_url(test)?;
    let database = TestDatabase::create(&url);
    let admin = PgConnection::connect(&url).await.expect("admin connection");
    Some((database, admin))
}

async fn store(database: &TestDatabase, pool: PostgresPoolConfig) -> PostgresStore {
    PostgresStore::connect_with(&database.url, key(), pool)
        .await
        .expect("connect postgres")
}

/// Connections open on `database`, as the server counts them.
async fn backends(admin: &mut PgConnection, database: &TestDatabase) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname = $1")
        .bind(&database.name)
        .fetch_one(admin)
        .await
        .expect("count backends")
}

/// `n` pooled connections at once: held together, so the pool opens that many.
async fn hold(store: &PostgresStore, n: usize) -> Vec<sqlx::pool::PoolConnection<sqlx::Postgres>> {
    let mut held = Vec::new();
    for _ in 0..n {
        held.push(store.conn().await.expect("a connection"));
    }
    held
}

fn is_timeout(result: &crate::Result<impl std::fmt::Debug>) -> bool {
    matches!(result, Err(StoreError::Timeout { .. }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_past_the_statement_timeout_fails_as_a_timeout() {
    let Some((database, admin)) = database("postgres statement timeout").await else {
        return;
    };
    let store = store(
        &database,
        PostgresPoolConfig {
            statement_timeout: Some(Duration::from_millis(300)),
            ..PostgresPoolConfig::default()
        },
    )
    .await;

    // Every pooled connection has it from its start-up, and a statement past it is cancelled.
    let mut conn = store.conn().await.expect("a connection");
    let shown: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(&mut *conn)
        .await
        .expect("show statement_timeout");
    assert_eq!(shown, "300ms");
    // And generic plans, for the batches' statements over arrays (`connect_with`).
    let plans: String = sqlx::query_scalar("SHOW plan_cache_mode")
        .fetch_one(&mut *conn)
        .await
        .expect("show plan_cache_mode");
    assert_eq!(plans, "force_generic_plan");
    let slept = sqlx::query("SELECT pg_sleep(10)")
        .execute(&mut *conn)
        .await
        .map_err(db_error("sleep"));
    match slept {
        Err(StoreError::Timeout { operation, source }) => {
            assert_eq!(operation, "sleep");
            assert!(source.to_string().contains("statement timeout"), "{source}");
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    drop(conn);

    // Through the store's own API: a write blocked on a lock another session holds fails the
    // same way once the timeout passes, rolled back, and the store serves on once it is gone.
    let mut locker = PgConnection::connect(&database.url)
        .await
        .expect("locking connection");
    sqlx::query("BEGIN")
        .execute(&mut locker)
        .await
        .expect("begin");
    sqlx::query("LOCK TABLE tenants IN ACCESS EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .expect("lock tenants");
    let blocked = store
        .ensure_tenant("blocked", OffsetDateTime::now_utc())
        .await;
    assert!(is_timeout(&blocked), "{blocked:?}");
    sqlx::query("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("rollback");
    store
        .ensure_tenant("after", OffsetDateTime::now_utc())
        .await
        .expect("the store serves on after a timeout");
    // Nothing of the timed-out write stayed.
    let blocked_rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM tenants WHERE name = 'blocked'")
            .fetch_one(&mut locker)
            .await
            .expect("count");
    assert_eq!(blocked_rows, 0);
    drop(admin.close().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_times_out_the_acquire_and_counts_it() {
    let Some((database, admin)) = database("postgres acquire timeout").await else {
        return;
    };
    let store = store(
        &database,
        PostgresPoolConfig {
            max_connections: 1,
            acquire_timeout: Duration::from_millis(300),
            ..PostgresPoolConfig::default()
        },
    )
    .await;
    let held = store.conn().await.expect("the one connection");
    let pinged = store.ping().await;
    assert!(is_timeout(&pinged), "{pinged:?}");
    let created = store.ensure_tenant("t", OffsetDateTime::now_utc()).await;
    assert!(is_timeout(&created), "a one-shot statement: {created:?}");
    let actor = AuditActor::Agent { id: Uuid::new_v4() };
    let in_tx = store
        .create_tenant(TenantId::new(), "t", actor, OffsetDateTime::now_utc())
        .await;
    assert!(is_timeout(&in_tx), "a transaction: {in_tx:?}");
    let stats = store.pool_stats().expect("postgres has a pool");
    assert_eq!(stats.acquire_timeouts, 3);
    assert_eq!((stats.size, stats.max), (1, 1));
    drop(held);
    store.ping().await.expect("free again");
    drop(admin.close().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pool_never_opens_more_than_its_max_under_load() {
    let Some((database, mut admin)) = database("postgres pool bound").await else {
        return;
    };
    const MAX: u32 = 4;
    let store = Arc::new(
        store(
            &database,
            PostgresPoolConfig {
                max_connections: MAX,
                ..PostgresPoolConfig::default()
            },
        )
        .await,
    );
    let before = store.pool_stats().expect("stats");
    let waits_before: u64 = before.acquire_wait_buckets.iter().sum();

    // 50 callers at once, each holding its connection a little (half through the store's own
    // API), while the server's count of this database's connections is sampled.
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let database_name = database.name.clone();
    let sampler = tokio::spawn(async move {
        let mut peak = 0;
        loop {
            let now = sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = $1",
            )
            .bind(&database_name)
            .fetch_one(&mut admin)
            .await
            .expect("count backends");
            peak = peak.max(now);
            tokio::select! {
                _ = &mut stopped => return (peak, admin),
                () = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        }
    });
    let callers = (0..50).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            if i % 2 == 0 {
                let mut conn = store.conn().await?;
                sqlx::query("SELECT pg_sleep(0.02)")
                    .execute(&mut *conn)
                    .await
                    .map_err(db_error("sleep"))?;
            } else {
                store
                    .ensure_tenant(&format!("tenant-{i}"), OffsetDateTime::now_utc())
                    .await?;
            }
            let stats = store.pool_stats().expect("stats");
            crate::Result::Ok(stats.size)
        })
    });
    let mut largest = 0;
    let callers: Vec<tokio::task::JoinHandle<crate::Result<u32>>> = callers.collect();
    for caller in callers {
        let size = caller
            .await
            .expect("caller ran")
            .expect("every call succeeds");
        largest = largest.max(size);
    }
    let _ = stop.send(());
    let (peak, mut admin) = sampler.await.expect("sampler ran");
    // 50 callers on 4 connections: the pool grew to its bound, and no further.
    assert_eq!(largest, MAX, "the pool held {largest} connections");
    // The pool's connections, the LISTEN connection and the sequencer's, nothing more.
    assert!(
        peak <= i64::from(MAX) + 2,
        "{peak} backends on the database at once"
    );
    let after = store.pool_stats().expect("stats");
    let waits_after: u64 = after.acquire_wait_buckets.iter().sum();
    // Each `ensure_tenant` acquires twice.
    assert!(waits_after - waits_before >= 50, "{before:?} {after:?}");
    assert_eq!(after.acquire_timeouts, 0);
    assert!(after.acquire_wait_sum > before.acquire_wait_sum);
    assert!(backends(&mut admin, &database).await <= i64::from(MAX) + 2);
    drop(admin.close().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_connections_are_replaced_and_the_listener_comes_back() {
    let Some((database, mut admin)) = database("postgres dead connections").await else {
        return;
    };
    let store = store(
        &database,
        PostgresPoolConfig {
            max_connections: 4,
            ..PostgresPoolConfig::default()
        },
    )
    .await;
    // Fill the pool, then leave every connection idle in it.
    drop(hold(&store, 4).await);
    let mut task_events = store.task_events();

    // Every backend of the database goes: the pool's four, the listener's and the sequencer's.
    let terminated: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = $1) AS t",
    )
    .bind(&database.name)
    .fetch_one(&mut admin)
    .await
    .expect("terminate backends");
    assert_eq!(
        terminated, 6,
        "four pooled connections, the listener and the sequencer"
    );

    // The next operations are served: each dead connection, idle past `PING_IDLE_AFTER`,
    // fails its ping before it is handed out, and is replaced by a new one.
    tokio::time::sleep(super::PING_IDLE_AFTER + Duration::from_millis(100)).await;
    store.ping().await.expect("ping after the terminations");
    store
        .ensure_tenant("after-terminate", OffsetDateTime::now_utc())
        .await
        .expect("a write after the terminations");
    drop(hold(&store, 4).await);

    // The listener sees its connection drop, tells every long-poll to look again (the nil
    // id), reconnects and LISTENs again: a notification sent now reaches it.
    let nil = berth_proto::AgentId(Uuid::nil());
    tokio::time::timeout(Duration::from_secs(30), async {
        while task_events.recv().await.expect("events") != nil {}
    })
    .await
    .expect("the listener announced the lost connection");
    let agent = Uuid::new_v4();
    let mut notifier = PgConnection::connect(&database.url)
        .await
        .expect("notifying connection");
    let delivered = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            sqlx::query("SELECT pg_notify('berth_tasks', $1)")
                .bind(agent.hyphenated().to_string())
                .execute(&mut notifier)
                .await
                .expect("notify");
            let wait = tokio::time::timeout(Duration::from_millis(500), async {
                loop {
                    match task_events.recv().await {
                        Ok(id) if id.0 == agent => return,
                        Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                        Err(e) => panic!("events: {e}"),
                    }
                }
            });
            if wait.await.is_ok() {
                return;
            }
        }
    })
    .await;
    assert!(delivered.is_ok(), "a notification after the reconnect");
    drop(notifier.close().await);
    drop(admin.close().await);
}
