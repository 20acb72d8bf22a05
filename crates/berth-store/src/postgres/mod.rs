//! The PostgreSQL backend, for several `berth server` replicas on one database. Every
//! check-and-change is one conditional statement or a row lock inside one transaction; it must
//! never rely on a process-local lock, because other replicas do not share it.
//!
//! One file per domain (`tenants.rs`, `agents.rs`, `tasks.rs`) implements that domain's trait;
//! this one connects, forwards task events and holds what the domains share.

use berth_proto::error::ErrorChain;
use std::time::Duration;

use berth_proto::AgentId;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Postgres, QueryBuilder};
use time::OffsetDateTime;
use tokio::sync::{broadcast, oneshot, watch};
use uuid::Uuid;

use crate::rows::{self, db_error, get, ColumnReader, PageRequest};
use crate::{Page, PayloadKey, Result, Store};

mod agents;
mod audit;
mod deployments;
mod desired;
mod events;
mod notify;
mod readiness;
mod releases;
mod secrets;
mod ssh_targets;
mod tasks;
mod tenants;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

const MAX_CONNECTIONS: u32 = 16;
/// The LISTEN/NOTIFY channel that carries "this agent has something to claim" across replicas.
const TASK_CHANNEL: &str = "berth_tasks";
/// Notified by migration 0011's `events_number()` at the commit of every transaction that
/// wrote events, on every replica's listener.
const EVENT_CHANNEL: &str = "berth_events";
const EVENT_CAPACITY: usize = 1024;
const LISTENER_BACKOFF_MAX: Duration = Duration::from_secs(30);

pub struct PostgresStore {
    pool: PgPool,
    /// Fed only by the listener task, so every replica's writes (ours included) arrive once.
    events: broadcast::Sender<AgentId>,
    /// Counts `berth_events` notifications (and listener reconnects, which may have lost some).
    written: watch::Sender<u64>,
    /// Seals and opens task payloads.
    payload_key: PayloadKey,
    /// Dropping the store drops this, which stops the listener task.
    _stop_listener: oneshot::Sender<()>,
}

impl PostgresStore {
    /// Connects and runs the migrations (sqlx serialises concurrent migrators across replicas
    /// with an advisory lock). Task payloads are sealed with `payload_key` (see `sealed.rs`).
    pub async fn connect(url: &str, payload_key: PayloadKey) -> Result<PostgresStore> {
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .connect(url)
            .await
            .map_err(db_error("connect to postgres"))?;
        crate::migrate(&MIGRATOR, &pool).await?;
        // LISTEN before returning, so no write after `connect` can go unnoticed.
        let listener = listen(&pool).await?;
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let (written, _) = watch::channel(0);
        let (stop, stopped) = oneshot::channel();
        tokio::spawn(forward_task_events(
            pool.clone(),
            listener,
            events.clone(),
            written.clone(),
            stopped,
        ));
        Ok(PostgresStore {
            pool,
            events,
            written,
            payload_key,
            _stop_listener: stop,
        })
    }
}

async fn listen(pool: &PgPool) -> Result<PgListener> {
    let mut listener = PgListener::connect_with(pool)
        .await
        .map_err(db_error("listen for task events"))?;
    listener
        .listen_all([TASK_CHANNEL, EVENT_CHANNEL])
        .await
        .map_err(db_error("listen for task events"))?;
    Ok(listener)
}

/// Forwards `berth_tasks` notifications into the in-process channel until the store is dropped.
/// Whenever notifications may have been lost (the connection dropped), it sends the nil id,
/// which tells every long-poll to look again.
async fn forward_task_events(
    pool: PgPool,
    mut listener: PgListener,
    events: broadcast::Sender<AgentId>,
    written: watch::Sender<u64>,
    mut stop: oneshot::Receiver<()>,
) {
    let wake_everyone = AgentId(Uuid::nil());
    let announce = || written.send_modify(|n| *n = n.wrapping_add(1));
    loop {
        let received = tokio::select! {
            _ = &mut stop => return,
            received = listener.try_recv() => received,
        };
        match received {
            Ok(Some(notification)) if notification.channel() == EVENT_CHANNEL => announce(),
            Ok(Some(notification)) => match notification.payload().parse::<Uuid>() {
                Ok(id) => {
                    // No receivers is not an error: nobody is long-polling right now.
                    let _ = events.send(AgentId(id));
                }
                Err(e) => {
                    tracing::warn!(error = %ErrorChain(&e), "ignoring a malformed berth_tasks payload")
                }
            },
            // The connection dropped and `try_recv` re-established it (and re-LISTENed).
            Ok(None) => {
                let _ = events.send(wake_everyone);
                announce();
            }
            Err(e) => {
                tracing::warn!(error = %ErrorChain(&e), "task event listener failed; reconnecting");
                let mut backoff = Duration::from_millis(250);
                listener = loop {
                    tokio::select! {
                        _ = &mut stop => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    match listen(&pool).await {
                        Ok(listener) => break listener,
                        Err(e) => {
                            tracing::warn!(error = %ErrorChain(&e), "task event listener reconnect failed");
                            backoff = (backoff * 2).min(LISTENER_BACKOFF_MAX);
                        }
                    }
                };
                let _ = events.send(wake_everyone);
                announce();
            }
        }
    }
}

/// Tells every replica's long-polls (this one's included) that `agent` may have work. Runs
/// inside the writing transaction: PostgreSQL delivers it only if, and when, that commits.
async fn notify(conn: &mut PgConnection, agent: AgentId) -> Result<()> {
    sqlx::query("SELECT pg_notify($1, $2)")
        .bind(TASK_CHANNEL)
        .bind(agent.0.hyphenated().to_string())
        .execute(conn)
        .await
        .map_err(db_error("notify task event"))?;
    Ok(())
}

/// Ends a keyset-paged list query — rows after `after` in id order, at most `limit` — and
/// reads the page.
async fn fetch_page<T>(
    pool: &PgPool,
    mut query: QueryBuilder<'_, Postgres>,
    page: PageRequest,
    operation: &'static str,
    read: impl Fn(&PgRow) -> Result<T>,
    id: fn(&T) -> Uuid,
) -> Result<Page<T>> {
    let PageRequest {
        after,
        order,
        limit,
    } = page;
    let (past, direction) = rows::order_sql(order);
    if let Some(after) = after {
        query.push(past).push_bind(after);
    }
    query
        .push(direction)
        .push(" LIMIT ")
        .push_bind(i64::from(limit));
    let items = query
        .build()
        .fetch_all(pool)
        .await
        .map_err(db_error(operation))?
        .iter()
        .map(read)
        .collect::<Result<Vec<_>>>()?;
    Ok(rows::page(items, limit, id))
}

impl ColumnReader for PgRow {
    fn uuid(&self, column: &'static str) -> Result<Uuid> {
        get(self, column)
    }
    fn time(&self, column: &'static str) -> Result<OffsetDateTime> {
        get(self, column)
    }
    fn time_opt(&self, column: &'static str) -> Result<Option<OffsetDateTime>> {
        get(self, column)
    }
    fn text(&self, column: &'static str) -> Result<String> {
        get(self, column)
    }
    fn text_opt(&self, column: &'static str) -> Result<Option<String>> {
        get(self, column)
    }
    fn flag(&self, column: &'static str) -> Result<bool> {
        get(self, column)
    }
    fn json(&self, column: &'static str) -> Result<serde_json::Value> {
        get(self, column)
    }
    fn json_opt(&self, column: &'static str) -> Result<Option<serde_json::Value>> {
        get(self, column)
    }
    fn uuid_opt(&self, column: &'static str) -> Result<Option<Uuid>> {
        get(self, column)
    }
    fn int(&self, column: &'static str) -> Result<i64> {
        get(self, column)
    }
    fn bytes_opt(&self, column: &'static str) -> Result<Option<Vec<u8>>> {
        get(self, column)
    }
}

#[async_trait::async_trait]
impl Store for PostgresStore {
    fn backend(&self) -> &'static str {
        "postgres"
    }

    async fn ping(&self) -> Result<()> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map_err(db_error("ping"))?;
        Ok(())
    }
}

/// How an agent-runtime write stands against the agent's row.
enum Binding {
    Current,
    Fenced,
    Revoked,
}

/// Checks the certificate binding and the session generation under a row lock held until the
/// transaction ends, so neither can change before the write that depends on them commits.
/// `query` locks `FOR SHARE` (excludes generation bumps) or `FOR NO KEY UPDATE` (also
/// serialises the callers with each other).
async fn check_binding(
    conn: &mut PgConnection,
    query: &'static str,
    agent: AgentId,
    certificate_fingerprint: &str,
    generation: i64,
) -> Result<Binding> {
    let row = sqlx::query(query)
        .bind(agent.0)
        .fetch_optional(conn)
        .await
        .map_err(db_error("check agent binding"))?;
    let Some(row) = row else {
        return Ok(Binding::Revoked);
    };
    if row.text_opt("certificate_fingerprint")?.as_deref() != Some(certificate_fingerprint) {
        return Ok(Binding::Revoked);
    }
    Ok(if row.int("generation")? == generation {
        Binding::Current
    } else {
        Binding::Fenced
    })
}

const BINDING_SHARE: &str =
    "SELECT generation, certificate_fingerprint FROM agents WHERE id = $1 FOR SHARE";
const BINDING_EXCLUSIVE: &str =
    "SELECT generation, certificate_fingerprint FROM agents WHERE id = $1 FOR NO KEY UPDATE";
