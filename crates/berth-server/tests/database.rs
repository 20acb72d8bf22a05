//! The database pool seen from outside (issue 15 item 5): `/metrics` reports the PostgreSQL
//! pool (and nothing of the kind for SQLite, which has none), and a request the database times
//! out is a retriable `503 UNAVAILABLE`, not an internal error.

mod common;

use std::time::Duration;

use berth_proto::error::codes;
use berth_proto::ErrorBody;
use berth_server::PostgresPoolConfig;
use sqlx::{Connection, PgConnection};

/// `name`'s unlabelled sample.
fn sample(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_pool_metrics_and_a_timed_out_statement_is_a_retriable_503() {
    let Some(admin_url) = berth_test_utils::postgres::admin_url("database pool on postgres") else {
        return;
    };
    let db = berth_test_utils::postgres::TestDatabase::create(&admin_url);
    let url = db.url.clone();
    let server = common::start_with(|config| {
        config.database = Some(url);
        config.database_pool = PostgresPoolConfig {
            max_connections: 3,
            statement_timeout: Some(Duration::from_millis(500)),
            ..PostgresPoolConfig::default()
        };
    })
    .await;
    let anonymous = server.client(None, None);
    let metrics = anonymous.get_text("/metrics").await.expect("metrics");
    assert_eq!(
        sample(&metrics, "berth_database_pool_max_connections"),
        Some(3.0),
        "{metrics}"
    );
    let open = sample(&metrics, "berth_database_pool_connections").expect("open connections");
    assert!((1.0..=3.0).contains(&open), "{metrics}");
    assert!(sample(&metrics, "berth_database_pool_idle_connections").is_some());
    assert!(
        sample(&metrics, "berth_database_pool_acquire_wait_seconds_count").unwrap_or(0.0) > 0.0,
        "bootstrap acquired connections: {metrics}"
    );
    assert!(metrics.contains("berth_database_pool_acquire_wait_seconds_bucket{le=\"0.001\"}"));
    assert_eq!(
        sample(&metrics, "berth_database_pool_acquire_timeouts_total"),
        Some(0.0)
    );
    // An admin request: its token is looked up in a batch (of one here).
    let listed = server
        .raw(None)
        .get(format!("{}/api/v1/agents", server.url))
        .bearer_auth(&server.admin_token)
        .send()
        .await
        .expect("list agents");
    assert!(listed.status().is_success());
    let metrics = anonymous.get_text("/metrics").await.expect("metrics");
    let token_lookups = "berth_database_batch_calls_total{operation=\"look up api tokens\",\
                         outcome=\"decided\"}";
    assert!(
        sample(&metrics, token_lookups).unwrap_or(0.0) >= 1.0,
        "{metrics}"
    );
    assert!(metrics.contains("berth_database_batches_total{operation=\"create tasks\"} 0"));

    // A list blocked on a lock past the statement timeout.
    let mut locker = PgConnection::connect(&db.url).await.expect("connect");
    sqlx::query("BEGIN")
        .execute(&mut locker)
        .await
        .expect("begin");
    sqlx::query("LOCK TABLE agents IN ACCESS EXCLUSIVE MODE")
        .execute(&mut locker)
        .await
        .expect("lock agents");
    let answer = server
        .raw(None)
        .get(format!("{}/api/v1/agents", server.url))
        .bearer_auth(&server.admin_token)
        .send()
        .await
        .expect("an answer");
    assert_eq!(answer.status(), 503);
    assert_eq!(answer.headers()["retry-after"], "1");
    let body: ErrorBody = answer.json().await.expect("error body");
    assert_eq!(body.code, codes::UNAVAILABLE, "{body:?}");
    assert!(
        !body.detail.contains("SELECT"),
        "no SQL in the detail: {body:?}"
    );
    sqlx::query("ROLLBACK")
        .execute(&mut locker)
        .await
        .expect("rollback");
    drop(locker.close().await);
    // The lock gone, the same request is served.
    server
        .admin()
        .get_text("/api/v1/agents")
        .await
        .expect("agents list after the lock");
    server.stop().await;
    drop(db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_reports_no_pool() {
    let server = common::start().await;
    let metrics = server
        .client(None, None)
        .get_text("/metrics")
        .await
        .expect("metrics");
    assert!(metrics.contains("berth_heartbeats_total"), "{metrics}");
    assert!(!metrics.contains("berth_database_pool"), "{metrics}");
    server.stop().await;
}
