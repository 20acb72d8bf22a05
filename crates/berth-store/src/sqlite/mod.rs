//! The embedded SQLite backend: one file in WAL mode; one writer thread that owns the only
//! read-write connection, a few reader threads with read-only connections, and a checkpointer
//! (see [`threads`]). It must never write through a reader.
//!
//! One file per domain (`tenants.rs`, `agents.rs`, `tasks.rs`) implements that domain's trait;
//! this one opens the connections and holds what the domains share.

use berth_proto::error::ErrorChain;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use berth_proto::AgentId;
use rusqlite::types::Value;
use rusqlite::{params_from_iter, Connection, OpenFlags, Row};
use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::Connection as _;
use time::OffsetDateTime;
use tokio::sync::{broadcast, watch};
use uuid::Uuid;

use crate::lifecycle::{self, Binding};
use crate::rows::{self, db_error, ColumnReader, PageRequest};
use crate::{Page, PayloadKey, Result, Store, StoreError};

mod agents;
mod audit;
mod claims;
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
mod threads;

use threads::{Readers, Writer};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// How long a connection waits for another process's write lock before failing with BUSY.
/// Within one process the single writer thread already serialises writes.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
const READERS: usize = 4;
/// How often WAL frames are copied back into the database file, off the writer's path.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
/// A WAL file larger than this is checkpointed with TRUNCATE: the writer waits for that one
/// checkpoint (its busy timeout), and the file goes back to empty. PASSIVE checkpoints never
/// catch up with a writer that never pauses: a retention sweep deleting a million old tasks
/// under load grew the WAL to 20 GB beside a 2.6 GB database that way (BENCHMARKS.md).
const WAL_LIMIT: u64 = 64 << 20;
const EVENT_CAPACITY: usize = 1024;
/// Every statement a connection runs stays prepared; the writer has about forty.
const STATEMENT_CACHE: usize = 64;

pub struct SqliteStore {
    /// Every write: SQLite admits one writer at a time, and queueing on one thread is fairer
    /// and cheaper than retrying SQLITE_BUSY.
    writer: Writer,
    /// Read-only connections; in WAL mode they never block the writer, nor it them.
    readers: Readers,
    /// Task events: one process owns the file, so an in-process channel reaches every poller.
    events: broadcast::Sender<AgentId>,
    /// The highest event id, after each commit that wrote events (the writer sends it).
    written: watch::Sender<u64>,
    /// Seals and opens task payloads.
    payload_key: PayloadKey,
    /// Dropping it stops the checkpointer.
    _checkpointer: mpsc::Sender<()>,
}

fn open_error(operation: &'static str) -> impl Fn(rusqlite::Error) -> StoreError {
    move |source| StoreError::Sqlite {
        operation,
        source: Arc::new(source),
    }
}

/// Opens one of the backend's own connections. The file exists and is in WAL mode by now (the
/// migration connection made it so); these settings are per connection.
fn connect(path: &Path, read_only: bool) -> Result<Connection> {
    let fail = open_error("open sqlite connection");
    let flags = if read_only {
        OpenFlags::SQLITE_OPEN_READ_ONLY
    } else {
        OpenFlags::SQLITE_OPEN_READ_WRITE
    };
    let conn = Connection::open_with_flags(path, flags | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(&fail)?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(&fail)?;
    conn.pragma_update(None, "foreign_keys", "ON")
        .map_err(&fail)?;
    if !read_only {
        // WAL + FULL: a commit fsyncs the WAL, so nothing acknowledged is lost even to a
        // power cut. The writer commits once per batch, so the fsync is shared; only batches
        // of heartbeats alone skip it (`Writer::write_unflushed`).
        conn.pragma_update(None, "synchronous", "FULL")
            .map_err(&fail)?;
        // The checkpointer does this off the writer's path.
        conn.pragma_update(None, "wal_autocheckpoint", 0)
            .map_err(&fail)?;
    }
    // Every file a connection needs is opened now, never per request, so running out of file
    // descriptors later cannot fail a query ("unable to open database file"): sorts and
    // temporary tables stay in memory, and a first read opens the -wal and -shm files, which
    // SQLite otherwise opens on a connection's first transaction.
    conn.pragma_update(None, "temp_store", "MEMORY")
        .map_err(&fail)?;
    conn.query_row("SELECT count(*) FROM sqlite_master", [], |_| Ok(()))
        .map_err(&fail)?;
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    Ok(conn)
}

/// Checkpoints the WAL (`wal`, the `-wal` file) from its own connection, until `stop`'s sender
/// is dropped. SQLite's automatic checkpoint would run inside whichever commit crosses the
/// threshold, on the single writer, stalling every queued heartbeat behind its fsyncs; a
/// PASSIVE checkpoint here runs beside the writer instead, and a TRUNCATE one past
/// [`WAL_LIMIT`] bounds the file.
fn checkpoint_loop(conn: Connection, wal: PathBuf, stop: mpsc::Receiver<()>) {
    let checkpoint = |mode: &str| {
        let sql = format!("PRAGMA wal_checkpoint({mode})");
        if let Err(e) = conn.query_row(&sql, [], |_| Ok(())) {
            tracing::warn!(error = %ErrorChain(&e), mode, "sqlite checkpoint failed; will retry");
        }
    };
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(CHECKPOINT_EVERY) {
        // PASSIVE first, so the TRUNCATE that may follow (and that the writer waits for) has
        // only the frames written since left to copy.
        checkpoint("PASSIVE");
        if std::fs::metadata(&wal).is_ok_and(|m| m.len() > WAL_LIMIT) {
            checkpoint("TRUNCATE");
        }
    }
}

impl SqliteStore {
    /// Opens (creating if missing) the database file and runs the migrations. Task payloads
    /// are sealed with `payload_key` (see `sealed.rs`).
    pub async fn open(path: &Path, payload_key: PayloadKey) -> Result<SqliteStore> {
        // sqlx's migrator owns the bookkeeping table, so migrations run on a connection of
        // their own, closed before the backend's threads open theirs. Closed by hand: a pool
        // may close it in the background, and closed beside the threads' connections SQLite
        // keeps its file descriptor open for good (POSIX locks are per process).
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        let migrate = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .map_err(db_error("open sqlite database"))?;
        crate::migrate(&MIGRATOR, &migrate).await?;
        const CLOSE: &str = "close the migration connection";
        let conn = migrate.acquire().await.map_err(db_error(CLOSE))?.detach();
        conn.close().await.map_err(db_error(CLOSE))?;
        migrate.close().await;

        const SPAWN: &str = "start sqlite threads";
        let stopped = |_| StoreError::ThreadStopped { operation: SPAWN };
        let (written, _) = watch::channel(0);
        let writer = Writer::spawn(connect(path, false)?, written.clone()).map_err(stopped)?;
        let readers = (0..READERS)
            .map(|_| connect(path, true))
            .collect::<Result<Vec<_>>>()?;
        let readers = Readers::spawn(readers).map_err(stopped)?;
        let (checkpointer, stop) = mpsc::channel();
        let checkpoint = connect(path, false)?;
        let wal = PathBuf::from(format!("{}-wal", path.display()));
        std::thread::Builder::new()
            .name("berth-sqlite-checkpoint".to_string())
            .spawn(move || checkpoint_loop(checkpoint, wal, stop))
            .map_err(stopped)?;
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        Ok(SqliteStore {
            writer,
            readers,
            events,
            written,
            payload_key,
            _checkpointer: checkpointer,
        })
    }

    /// Sent after the commit that made `agent`'s work claimable (never before: a woken poller
    /// must find it). No receivers is not an error: nobody is long-polling right now.
    fn wake(&self, agent: AgentId) {
        let _ = self.events.send(agent);
    }

    /// A keyset-paged list: `query` (a SELECT whose WHERE clause is open) gets the rows after
    /// `after` in id order, at most `limit`, each read by `read`.
    async fn fetch_page<T: Send + 'static>(
        &self,
        operation: &'static str,
        mut query: Query,
        page: PageRequest,
        read: impl Fn(&Row<'_>) -> Result<T> + Send + 'static,
        id: fn(&T) -> Uuid,
    ) -> Result<Page<T>> {
        let PageRequest {
            after,
            order,
            limit,
        } = page;
        let (past, direction) = rows::order_sql(order);
        if let Some(after) = after {
            query.push(past).push_bind(id_text(after));
        }
        query
            .push(direction)
            .push(" LIMIT ")
            .push_bind(i64::from(limit));
        let items = self
            .readers
            .read(operation, move |db| {
                db.all(&query.sql, params_from_iter(query.params), read)
            })
            .await?;
        Ok(rows::page(items, limit, id))
    }
}

/// SQL built from fixed fragments, every value bound as a numbered parameter (never spliced).
struct Query {
    sql: String,
    params: Vec<Value>,
}

impl Query {
    fn new(sql: &str) -> Query {
        Query {
            sql: sql.to_string(),
            params: Vec::new(),
        }
    }

    fn push(&mut self, sql: &str) -> &mut Query {
        self.sql.push_str(sql);
        self
    }

    fn push_bind(&mut self, value: impl Into<Value>) -> &mut Query {
        self.params.push(value.into());
        self.sql.push_str(&format!("?{}", self.params.len()));
        self
    }
}

/// A value for a JSON column: SQLite stores JSON as text.
fn json_text<T: serde::Serialize + ?Sized>(column: &'static str, value: &T) -> Result<String> {
    serde_json::to_string(value)
        .map_err(|e| StoreError::Corrupt(format!("{column}: not serialisable as JSON: {e}")))
}

/// `Row::get` with a conversion failure reported as a corrupt row, naming the column.
fn cell<T: rusqlite::types::FromSql>(row: &Row<'_>, column: &'static str) -> Result<T> {
    row.get(column)
        .map_err(|e| StoreError::Corrupt(format!("column {column}: {e}")))
}

fn parse_uuid(column: &'static str, text: &str) -> Result<Uuid> {
    Uuid::parse_str(text).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

fn parse_json(column: &'static str, text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

/// Ids are text, timestamps Unix milliseconds, flags 0/1 and JSON text.
impl ColumnReader for Row<'_> {
    fn uuid(&self, column: &'static str) -> Result<Uuid> {
        parse_uuid(column, &cell::<String>(self, column)?)
    }
    fn time(&self, column: &'static str) -> Result<OffsetDateTime> {
        rows::from_unix_millis(column, cell(self, column)?)
    }
    fn time_opt(&self, column: &'static str) -> Result<Option<OffsetDateTime>> {
        cell::<Option<i64>>(self, column)?
            .map(|ms| rows::from_unix_millis(column, ms))
            .transpose()
    }
    fn text(&self, column: &'static str) -> Result<String> {
        cell(self, column)
    }
    fn text_opt(&self, column: &'static str) -> Result<Option<String>> {
        cell(self, column)
    }
    fn flag(&self, column: &'static str) -> Result<bool> {
        cell(self, column)
    }
    fn json(&self, column: &'static str) -> Result<serde_json::Value> {
        parse_json(column, &cell::<String>(self, column)?)
    }
    fn json_opt(&self, column: &'static str) -> Result<Option<serde_json::Value>> {
        cell::<Option<String>>(self, column)?
            .map(|text| parse_json(column, &text))
            .transpose()
    }
    fn uuid_opt(&self, column: &'static str) -> Result<Option<Uuid>> {
        cell::<Option<String>>(self, column)?
            .map(|text| parse_uuid(column, &text))
            .transpose()
    }
    fn int(&self, column: &'static str) -> Result<i64> {
        cell(self, column)
    }
    fn bytes_opt(&self, column: &'static str) -> Result<Option<Vec<u8>>> {
        cell(self, column)
    }
}

/// Ids are bound as lowercase hyphenated text, the form whose text order is creation order.
fn id_text(id: Uuid) -> String {
    id.hyphenated().to_string()
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    async fn ping(&self) -> Result<()> {
        self.readers
            .read("ping", |db| db.one("SELECT 1", [], |_| Ok(())))
            .await
    }

    /// None: SQLite has no pool; its writer and readers are threads it owns for its lifetime.
    fn pool_stats(&self) -> Option<crate::PoolStats> {
        None
    }
}

/// Reads the certificate binding and the session generation, and decides by
/// [`lifecycle::binding`]. Inside the writer's transaction neither can change before the write
/// that depends on them commits; on a reader it is only a hint for skipping the writer, which
/// checks again.
fn binding(
    db: &threads::Db<'_>,
    agent: AgentId,
    fingerprint: &str,
    generation: i64,
) -> Result<Binding> {
    let stored = db.optional(
        "SELECT certificate_fingerprint, generation FROM agents WHERE id = ?1",
        [id_text(agent.0)],
        |row| {
            Ok((
                row.text_opt("certificate_fingerprint")?,
                row.int("generation")?,
            ))
        },
    )?;
    Ok(lifecycle::binding(
        stored
            .as_ref()
            .map(|(bound, current)| (bound.as_deref(), *current)),
        fingerprint,
        generation,
    ))
}
