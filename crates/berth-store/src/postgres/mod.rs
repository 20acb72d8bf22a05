//! The PostgreSQL backend, for several `berth server` replicas on one database. Every
//! check-and-change is one conditional statement or a row lock inside one transaction; it must
//! never rely on a process-local lock, because other replicas do not share it.
//!
//! One file per domain (`tenants.rs`, `agents.rs`, `tasks.rs`) implements that domain's trait;
//! this one connects, forwards task events and holds what the domains share.

use berth_proto::error::ErrorChain;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_proto::AgentId;
use sqlx::migrate::Migrator;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::{Connection as _, Postgres, QueryBuilder, Transaction};
use time::OffsetDateTime;
use tokio::sync::{broadcast, oneshot, watch, Notify};
use uuid::Uuid;

use crate::lifecycle::{self, Binding};
use crate::pool::AcquireWaits;
use crate::rows::{self, db_error, get, ColumnReader, PageRequest};
use crate::{Page, PayloadKey, PoolStats, PostgresPoolConfig, Result, Store};

mod agents;
mod audit;
mod batch;
mod claims;
mod completion;
mod deployments;
mod desired;
mod events;
mod notify;
#[cfg(test)]
mod pool_tests;
mod readiness;
mod releases;
mod secrets;
mod sequencer;
mod ssh_targets;
mod task_batches;
mod tasks;
mod tenants;

use sequencer::{EVENT_CHANNEL, TASK_CHANNEL};
pub use task_batches::TaskBatchStats;

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

const EVENT_CAPACITY: usize = 1024;
const LISTENER_BACKOFF_MAX: Duration = Duration::from_secs(30);
/// A pooled connection idle for this long is pinged before it is handed out.
const PING_IDLE_AFTER: Duration = Duration::from_secs(1);

pub struct PostgresStore {
    pool: PgPool,
    /// Fed by the listener task with every replica's wake-ups (ours included), sent by the
    /// sequencer pass that numbers their events; and by this store itself right after it
    /// created or cancelled a task, so a poll held here need not wait for that pass.
    events: broadcast::Sender<AgentId>,
    /// Counts `berth_events` notifications (and listener reconnects, which may have lost some).
    written: watch::Sender<u64>,
    /// Seals and opens task payloads.
    payload_key: PayloadKey,
    /// How long operations waited for a pooled connection (`/metrics`), batches included.
    waits: Arc<AcquireWaits>,
    /// The task path's batched operations (`task_batches.rs`).
    batches: task_batches::TaskBatches,
    /// Numbers staged events and links staged audit entries (`sequencer.rs`).
    sequencer: Arc<sequencer::Sequencer>,
    /// Dropping the store drops these, which stops the listener and sequencer tasks.
    _stop_listener: oneshot::Sender<()>,
    _stop_sequencer: oneshot::Sender<()>,
}

impl PostgresStore {
    /// [`PostgresStore::connect_with`] the default pool bounds.
    pub async fn connect(url: &str, payload_key: PayloadKey) -> Result<PostgresStore> {
        PostgresStore::connect_with(url, payload_key, PostgresPoolConfig::default()).await
    }

    /// Connects and runs the migrations (sqlx serialises concurrent migrators across replicas
    /// with an advisory lock). Task payloads are sealed with `payload_key` (see `sealed.rs`).
    /// The pool holds at most `pool.max_connections`, every one with `pool.statement_timeout`;
    /// a connection is pinged as it comes back and, after `PING_IDLE_AFTER` idle, before it is
    /// handed out, so one the server or a network cut killed is replaced, not used.
    pub async fn connect_with(
        url: &str,
        payload_key: PayloadKey,
        pool: PostgresPoolConfig,
    ) -> Result<PostgresStore> {
        let options: PgConnectOptions = url.parse().map_err(db_error("parse the postgres url"))?;
        // Migrations run on a connection of their own, without the statement timeout: a
        // migration, or waiting on the advisory lock while another replica migrates, may take
        // longer than any statement should while serving.
        // (A pool of one rather than a bare connection: `migrate` over `&mut PgConnection`
        // makes the caller's future not `Send` for every lifetime, which `tokio::spawn` needs.)
        let migrating = PgPoolOptions::new()
            .max_connections(1)
            .connect_with(options.clone())
            .await
            .map_err(db_error("connect to postgres"))?;
        let migrated = crate::migrate(&MIGRATOR, &migrating).await;
        migrating.close().await;
        migrated?;
        let options = match pool.statement_timeout {
            // A startup parameter (`-c statement_timeout=…`), so it holds from the first
            // statement of every connection the pool opens, and a reconnect keeps it.
            Some(timeout) => {
                options.options([("statement_timeout", format!("{}ms", timeout.as_millis()))])
            }
            None => options,
        };
        // The listener holds its connection for good (sqlx's `PgListener` takes it from the
        // pool it is given): a pool of its own, so operations get all of `max_connections`,
        // and a saturated pool never keeps the listener from reconnecting.
        let pool_of_one = || {
            PgPoolOptions::new()
                .max_connections(1)
                .acquire_timeout(pool.acquire_timeout)
                .connect_with(options.clone())
        };
        let listener_pool = pool_of_one()
            .await
            .map_err(db_error("connect to postgres"))?;
        // The sequencer's own pool of one, for the same reasons.
        let sequencer_pool = pool_of_one()
            .await
            .map_err(db_error("connect to postgres"))?;
        let poke = Arc::new(Notify::new());
        let poked = poke.clone();
        let pool = PgPoolOptions::new()
            .max_connections(pool.max_connections)
            .acquire_timeout(pool.acquire_timeout)
            // sqlx pings every connection as it comes back (`return_to_pool`, always); a ping
            // before each acquire too would cost every operation a second round trip. So only a
            // connection idle for longer than `PING_IDLE_AFTER` is pinged first, as HikariCP's
            // `aliveBypassWindowMs` does; one that failed it is dropped and another handed out.
            .test_before_acquire(false)
            .before_acquire(|conn, meta| {
                Box::pin(async move {
                    if meta.idle_for >= PING_IDLE_AFTER {
                        conn.ping().await?;
                    }
                    Ok(true)
                })
            })
            // Whatever the connection did may have staged events or audit entries.
            .after_release(move |_, _| {
                poked.notify_one();
                Box::pin(async { Ok(true) })
            })
            // Generic plans for the pool's prepared statements: the task path's batch statements
            // (`task_batches.rs`) take arrays, for which PostgreSQL would otherwise plan every
            // execution anew, as the array's length changes the estimate; planning cost them
            // more than running (pg_stat_statements `track_planning`). The sequencer's pool
            // keeps the default: its numbering statement runs faster on a custom plan.
            .connect_with(options.options([("plan_cache_mode", "force_generic_plan")]))
            .await
            .map_err(db_error("connect to postgres"))?;
        // LISTEN before returning, so no write after `connect` can go unnoticed.
        let listener = listen(&listener_pool).await?;
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let (written, _) = watch::channel(0);
        let (stop, stopped) = oneshot::channel();
        tokio::spawn(forward_task_events(
            listener_pool,
            listener,
            events.clone(),
            written.clone(),
            stopped,
        ));
        let sequencer = sequencer::Sequencer::new(sequencer_pool, poke);
        let waits = Arc::new(AcquireWaits::default());
        let batches = task_batches::TaskBatches::start(task_batches::Context {
            pool: pool.clone(),
            payload_key: payload_key.clone(),
            events: events.clone(),
            waits: waits.clone(),
        });
        let (stop_sequencer, sequencer_stopped) = oneshot::channel();
        tokio::spawn(sequencer::run(sequencer.clone(), sequencer_stopped));
        Ok(PostgresStore {
            pool,
            events,
            written,
            payload_key,
            waits,
            batches,
            sequencer,
            _stop_listener: stop,
            _stop_sequencer: stop_sequencer,
        })
    }

    /// A pooled connection for one statement or a few; the wait is recorded for `/metrics`.
    async fn conn(&self) -> Result<PoolConnection<Postgres>> {
        self.acquire("acquire a database connection").await
    }

    /// A pooled connection, its wait recorded; a pool that stays full past the acquire
    /// timeout is [`crate::StoreError::Timeout`] under `operation`.
    async fn acquire(&self, operation: &'static str) -> Result<PoolConnection<Postgres>> {
        acquire(&self.pool, &self.waits, operation).await
    }

    /// A transaction on a pooled connection. Its wait is recorded through its `BEGIN` (sqlx
    /// gives no hook between the two; `BEGIN` is one round trip).
    async fn begin(&self, operation: &'static str) -> Result<Transaction<'static, Postgres>> {
        let started = Instant::now();
        let begun = self.pool.begin().await;
        record_wait(&self.waits, started, begun.as_ref().err());
        begun.map_err(db_error(operation))
    }

    /// What the task path's batchers did so far (`task_batches.rs`).
    pub fn task_batch_stats(&self) -> TaskBatchStats {
        self.batches.stats()
    }

    /// Wakes this replica's polls of `agent` now; other replicas' wait for the sequencer pass.
    fn wake(&self, agent: AgentId) {
        // No receivers is not an error: nobody is long-polling right now.
        let _ = self.events.send(agent);
    }
}

/// A connection of `pool`, its wait recorded in `waits`.
async fn acquire(
    pool: &PgPool,
    waits: &AcquireWaits,
    operation: &'static str,
) -> Result<PoolConnection<Postgres>> {
    let started = Instant::now();
    let acquired = pool.acquire().await;
    record_wait(waits, started, acquired.as_ref().err());
    acquired.map_err(db_error(operation))
}

fn record_wait(waits: &AcquireWaits, started: Instant, failed: Option<&sqlx::Error>) {
    match failed {
        None => waits.acquired(started.elapsed()),
        Some(sqlx::Error::PoolTimedOut) => waits.timed_out(),
        // Connecting failed or BEGIN did: not a wait for the pool, and the error says so.
        Some(_) => {}
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
    // The listener's own pool of one (see `connect_with`).
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
                // Let go of its connection first: the listener's pool holds only that one.
                drop(listener);
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

/// Ends a keyset-paged list query — rows after `after` in id order, at most `limit` — and
/// reads the page.
async fn fetch_page<T>(
    conn: &mut PgConnection,
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
        .fetch_all(conn)
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
            .execute(&mut *self.conn().await?)
            .await
            .map_err(db_error("ping"))?;
        Ok(())
    }

    fn pool_stats(&self) -> Option<PoolStats> {
        let idle = u32::try_from(self.pool.num_idle()).unwrap_or(u32::MAX);
        let stats = self.waits.stats(
            self.pool.size(),
            idle,
            self.pool.options().get_max_connections(),
        );
        Some(PoolStats {
            batches: self.batches.stats().all(),
            ..stats
        })
    }
}

/// Checks the certificate binding and the session generation under a row lock held until the
/// transaction ends, so neither can change before the write that depends on them commits, and
/// decides by [`lifecycle::binding`]. Also answers the agent's `suspended` flag, read under the
/// same lock (false for an agent that is gone). `query` locks `FOR SHARE` (excludes generation
/// bumps) or `FOR NO KEY UPDATE` (also serialises the callers with each other).
async fn check_binding(
    conn: &mut PgConnection,
    query: &'static str,
    agent: AgentId,
    certificate_fingerprint: &str,
    generation: i64,
) -> Result<(Binding, bool)> {
    let row = sqlx::query(query)
        .bind(agent.0)
        .fetch_optional(conn)
        .await
        .map_err(db_error("check agent binding"))?;
    let stored = match &row {
        Some(row) => Some((
            row.text_opt("certificate_fingerprint")?,
            row.int("generation")?,
            row.flag("suspended")?,
        )),
        None => None,
    };
    let decided = lifecycle::binding(
        stored
            .as_ref()
            .map(|(bound, current, _)| (bound.as_deref(), *current)),
        certificate_fingerprint,
        generation,
    );
    Ok((decided, stored.is_some_and(|(_, _, suspended)| suspended)))
}

const BINDING_SHARE: &str =
    "SELECT generation, certificate_fingerprint, suspended FROM agents WHERE id = $1 FOR SHARE";
const BINDING_EXCLUSIVE: &str =
    "SELECT generation, certificate_fingerprint, suspended FROM agents \
     WHERE id = $1 FOR NO KEY UPDATE";
