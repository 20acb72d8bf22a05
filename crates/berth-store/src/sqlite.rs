//! The embedded SQLite backend: one file in WAL mode; one writer thread that owns the only
//! read-write connection, a few reader threads with read-only connections, and a checkpointer
//! (see [`threads`]). It must never write through a reader.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use berth_proto::agent::AgentStatus;
use berth_proto::{AgentId, AssignmentId, TaskId, TenantId};
use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, Connection, OpenFlags, Row};
use sqlx::migrate::Migrator;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use time::OffsetDateTime;
use tokio::sync::broadcast;
use uuid::Uuid;

use crate::lifecycle;
use crate::rows::{
    self, agent_columns, attempt_columns, db_error, millis, task_columns, unix_millis, ColumnReader,
};
use crate::{
    Agent, AgentFilter, AgentUpdate, ApiToken, Attempt, CancelOutcome, ClaimOutcome,
    CompleteOutcome, Completion, CreateTaskOutcome, HeartbeatOutcome, HeartbeatRecord, LeaseSweep,
    NewAgent, NewApiToken, NewRegistrationToken, NewTask, Page, RegisterError, Result,
    RetryOutcome, RetryPolicy, SessionOutcome, StaleSweep, Store, StoreError, Task, TaskFilter,
    TaskState, Tenant,
};

mod threads;

use threads::{Db, Readers, Writer};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// How long a connection waits for another process's write lock before failing with BUSY.
/// Within one process the single writer thread already serialises writes.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
const READERS: usize = 4;
/// How often WAL frames are copied back into the database file, off the writer's path.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
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
    conn.set_prepared_statement_cache_capacity(STATEMENT_CACHE);
    Ok(conn)
}

/// Checkpoints the WAL from its own connection, until `stop`'s sender is dropped. SQLite's
/// automatic checkpoint would run inside whichever commit crosses the threshold, on the single
/// writer, stalling every queued heartbeat behind its fsyncs; a PASSIVE checkpoint here runs
/// beside the writer instead.
fn checkpoint_loop(conn: Connection, stop: mpsc::Receiver<()>) {
    while let Err(mpsc::RecvTimeoutError::Timeout) = stop.recv_timeout(CHECKPOINT_EVERY) {
        if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::warn!(error = %e, "sqlite checkpoint failed; will retry");
        }
    }
}

impl SqliteStore {
    /// Opens (creating if missing) the database file and runs the migrations.
    pub async fn open(path: &Path) -> Result<SqliteStore> {
        // sqlx's migrator owns the bookkeeping table, so migrations run on a connection of
        // their own, closed before the backend's threads open theirs.
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
        MIGRATOR.run(&migrate).await.map_err(StoreError::Migrate)?;
        migrate.close().await;

        const SPAWN: &str = "start sqlite threads";
        let stopped = |_| StoreError::ThreadStopped { operation: SPAWN };
        let writer = Writer::spawn(connect(path, false)?).map_err(stopped)?;
        let readers = (0..READERS)
            .map(|_| connect(path, true))
            .collect::<Result<Vec<_>>>()?;
        let readers = Readers::spawn(readers).map_err(stopped)?;
        let (checkpointer, stop) = mpsc::channel();
        let checkpoint = connect(path, false)?;
        std::thread::Builder::new()
            .name("berth-sqlite-checkpoint".to_string())
            .spawn(move || checkpoint_loop(checkpoint, stop))
            .map_err(stopped)?;
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        Ok(SqliteStore {
            writer,
            readers,
            events,
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
        after: Option<Uuid>,
        limit: u32,
        read: fn(&Row<'_>) -> Result<T>,
        id: fn(&T) -> Uuid,
    ) -> Result<Page<T>> {
        if let Some(after) = after {
            query.push(" AND id > ").push_bind(id_text(after));
        }
        query
            .push(" ORDER BY id LIMIT ")
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

/// How an agent-runtime write stands against the agent's row.
enum Binding {
    Current,
    Fenced,
    Revoked,
}

/// Reads the certificate binding and the session generation. Inside the writer's transaction
/// neither can change before the write that depends on them commits; on a reader it is only a
/// hint for skipping the writer, which checks again.
fn binding(db: &Db<'_>, agent: AgentId, fingerprint: &str, generation: i64) -> Result<Binding> {
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
    Ok(match stored {
        Some((Some(bound), current)) if bound == fingerprint => {
            if current == generation {
                Binding::Current
            } else {
                Binding::Fenced
            }
        }
        _ => Binding::Revoked,
    })
}

/// The tenant's task `id`, if it has one.
fn tenant_task(db: &Db<'_>, tenant: TenantId, id: TaskId) -> Result<Option<Task>> {
    db.optional(
        concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = ?1 AND id = ?2"
        ),
        [id_text(tenant.0), id_text(id.0)],
        |row| rows::read_task(row),
    )
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

    async fn ensure_tenant(&self, name: &str, now: OffsetDateTime) -> Result<Tenant> {
        let (id, name, now) = (
            id_text(TenantId::new().0),
            name.to_owned(),
            unix_millis(now),
        );
        self.writer
            .write("ensure tenant", move |tx| {
                tx.execute(
                    "INSERT INTO tenants (id, name, created_at) VALUES (?1, ?2, ?3) \
                     ON CONFLICT (name) DO NOTHING",
                    params![id, name, now],
                )?;
                tx.one(
                    "SELECT id, name, created_at FROM tenants WHERE name = ?1",
                    [name],
                    |row| rows::read_tenant(row),
                )
            })
            .await
    }

    async fn create_tenant(&self, id: TenantId, name: &str, now: OffsetDateTime) -> Result<Tenant> {
        let (id, name, now) = (id_text(id.0), name.to_owned(), unix_millis(now));
        self.writer
            .write("create tenant", move |tx| {
                tx.one(
                    "INSERT INTO tenants (id, name, created_at) VALUES (?1, ?2, ?3) \
                     RETURNING id, name, created_at",
                    params![id, name, now],
                    |row| rows::read_tenant(row),
                )
            })
            .await
    }

    async fn get_tenant(&self, id: TenantId) -> Result<Option<Tenant>> {
        self.readers
            .read("get tenant", move |db| {
                db.optional(
                    "SELECT id, name, created_at FROM tenants WHERE id = ?1",
                    [id_text(id.0)],
                    |row| rows::read_tenant(row),
                )
            })
            .await
    }

    async fn create_api_token(&self, token: NewApiToken) -> Result<ApiToken> {
        self.writer
            .write("create api token", move |tx| {
                tx.one(
                    "INSERT INTO api_tokens \
                     (id, tenant_id, name, role, operator, token_hash, created_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
                     RETURNING id, tenant_id, name, role, operator, created_at",
                    params![
                        id_text(token.id.0),
                        id_text(token.tenant_id.0),
                        token.name,
                        token.role.as_str(),
                        token.operator,
                        token.token_hash,
                        unix_millis(token.created_at),
                    ],
                    |row| rows::read_api_token(row),
                )
            })
            .await
    }

    async fn api_token_by_hash(&self, token_hash: &str) -> Result<Option<ApiToken>> {
        let token_hash = token_hash.to_owned();
        self.readers
            .read("look up api token", move |db| {
                db.optional(
                    "SELECT id, tenant_id, name, role, operator, created_at FROM api_tokens \
                     WHERE token_hash = ?1",
                    [token_hash],
                    |row| rows::read_api_token(row),
                )
            })
            .await
    }

    async fn has_operator_token(&self, tenant: TenantId) -> Result<bool> {
        self.readers
            .read("check operator token", move |db| {
                db.one(
                    "SELECT EXISTS (SELECT 1 FROM api_tokens WHERE tenant_id = ?1 AND operator) \
                     AS found",
                    [id_text(tenant.0)],
                    |row| row.flag("found"),
                )
            })
            .await
    }

    async fn create_registration_token(&self, token: NewRegistrationToken) -> Result<()> {
        let labels = json_text("registration_tokens.labels", &token.labels)?;
        self.writer
            .write("create registration token", move |tx| {
                tx.execute(
                    "INSERT INTO registration_tokens \
                     (id, tenant_id, token_hash, labels, environment, expires_at, created_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                    params![
                        id_text(token.id.0),
                        id_text(token.tenant_id.0),
                        token.token_hash,
                        labels,
                        token.environment,
                        unix_millis(token.expires_at),
                        unix_millis(token.created_at),
                    ],
                )?;
                Ok(())
            })
            .await
    }

    async fn register_agent(
        &self,
        token_hash: &str,
        agent: NewAgent,
        now: OffsetDateTime,
    ) -> Result<std::result::Result<Agent, RegisterError>> {
        let token_hash = token_hash.to_owned();
        let capabilities = json_text("agents.capabilities", &agent.capabilities)?;
        self.writer
            .write("register agent", move |tx| {
                // Consuming is a conditional update: the writer runs one operation at a time,
                // and of several registrations with one token only the first sees
                // `used_at IS NULL`.
                let Some(token) = tx.optional(
                    "UPDATE registration_tokens SET used_at = ?1 \
                     WHERE token_hash = ?2 AND used_at IS NULL AND expires_at > ?1 \
                     RETURNING tenant_id, labels, environment",
                    params![unix_millis(now), token_hash],
                    |row| rows::read_consumed_token(row),
                )?
                else {
                    return Ok(Err(RegisterError::TokenInvalid));
                };
                let labels = json_text(
                    "agents.labels",
                    &rows::merge_labels(agent.labels, token.labels),
                )?;
                let inserted = tx.one(
                    concat!(
                        "INSERT INTO agents (id, tenant_id, name, version, capabilities, labels, \
                         status, reported_status, environment, certificate_fingerprint, \
                         certificate_expires_at, created_at, updated_at) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'online', 'online', ?7, ?8, ?9, ?10, \
                         ?10) RETURNING ",
                        agent_columns!()
                    ),
                    params![
                        id_text(agent.id.0),
                        id_text(token.tenant_id.0),
                        agent.name,
                        agent.version,
                        capabilities,
                        labels,
                        token.environment,
                        agent.certificate_fingerprint,
                        unix_millis(agent.certificate_expires_at),
                        unix_millis(agent.created_at),
                    ],
                    |row| rows::read_agent(row),
                );
                match inserted {
                    Ok(agent) => Ok(Ok(agent)),
                    Err(StoreError::Conflict {
                        constraint: "agent_name",
                    }) => {
                        // A refused registration does not spend the token.
                        tx.execute(
                            "UPDATE registration_tokens SET used_at = NULL WHERE token_hash = ?1",
                            [token_hash],
                        )?;
                        Ok(Err(RegisterError::NameTaken))
                    }
                    // Any other error rolls the whole operation back, token included.
                    Err(e) => Err(e),
                }
            })
            .await
    }

    async fn get_agent(&self, tenant: TenantId, id: AgentId) -> Result<Option<Agent>> {
        self.readers
            .read("get agent", move |db| {
                db.optional(
                    concat!(
                        "SELECT ",
                        agent_columns!(),
                        " FROM agents WHERE tenant_id = ?1 AND id = ?2"
                    ),
                    [id_text(tenant.0), id_text(id.0)],
                    |row| rows::read_agent(row),
                )
            })
            .await
    }

    async fn get_agent_for_runtime(&self, id: AgentId) -> Result<Option<Agent>> {
        self.readers
            .read("get agent", move |db| {
                db.optional(
                    concat!("SELECT ", agent_columns!(), " FROM agents WHERE id = ?1"),
                    [id_text(id.0)],
                    |row| rows::read_agent(row),
                )
            })
            .await
    }

    async fn list_agents(
        &self,
        tenant: TenantId,
        filter: &AgentFilter,
        after: Option<AgentId>,
        limit: u32,
    ) -> Result<Page<Agent>> {
        let limit = limit.max(1);
        let mut query = Query::new(concat!(
            "SELECT ",
            agent_columns!(),
            " FROM agents WHERE tenant_id = "
        ));
        query.push_bind(id_text(tenant.0));
        if let Some(status) = filter.status {
            query
                .push(" AND status = ")
                .push_bind(status.as_str().to_string());
        }
        if let Some(capability) = &filter.capability {
            query
                .push(
                    " AND EXISTS (SELECT 1 FROM json_each(agents.capabilities) \
                     WHERE json_extract(json_each.value, '$.name') = ",
                )
                .push_bind(capability.clone())
                .push(")");
        }
        if let Some((key, value)) = &filter.label {
            // json_each matches the key as a value, so no JSON path is ever built from it.
            query
                .push(" AND EXISTS (SELECT 1 FROM json_each(agents.labels) WHERE json_each.key = ")
                .push_bind(key.clone())
                .push(" AND json_each.type = 'text' AND json_each.value = ")
                .push_bind(value.clone())
                .push(")");
        }
        self.fetch_page(
            "list agents",
            query,
            after.map(|id| id.0),
            limit,
            |row| rows::read_agent(row),
            |a| a.id.0,
        )
        .await
    }

    async fn update_agent(
        &self,
        tenant: TenantId,
        id: AgentId,
        update: AgentUpdate,
        now: OffsetDateTime,
    ) -> Result<Option<Agent>> {
        let labels = update
            .labels
            .as_ref()
            .map(|l| json_text("agents.labels", l))
            .transpose()?;
        let capabilities = update
            .capabilities
            .as_ref()
            .map(|c| json_text("agents.capabilities", c))
            .transpose()?;
        self.writer
            .write("update agent", move |tx| {
                tx.optional(
                    concat!(
                        "UPDATE agents SET labels = COALESCE(?1, labels), \
                         capabilities = COALESCE(?2, capabilities), updated_at = ?3 \
                         WHERE tenant_id = ?4 AND id = ?5 RETURNING ",
                        agent_columns!()
                    ),
                    params![
                        labels,
                        capabilities,
                        unix_millis(now),
                        id_text(tenant.0),
                        id_text(id.0),
                    ],
                    |row| rows::read_agent(row),
                )
            })
            .await
    }

    async fn delete_agent(&self, tenant: TenantId, id: AgentId) -> Result<bool> {
        // The trait gives no clock here.
        let now = unix_millis(OffsetDateTime::now_utc());
        let (tenant, id) = (id_text(tenant.0), id_text(id.0));
        self.writer
            .write("delete agent", move |tx| {
                let deleted = tx.execute(
                    "DELETE FROM agents WHERE tenant_id = ?1 AND id = ?2",
                    params![tenant, id],
                )?;
                if deleted == 0 {
                    return Ok(false);
                }
                // A leased task with side effects may have run: unknown, like a lost lease.
                tx.execute(
                    "UPDATE tasks SET \
                     state = CASE WHEN state = 'leased' AND side_effects THEN 'unknown' \
                     ELSE 'expired' END, \
                     finished_at = CASE WHEN state = 'leased' AND side_effects THEN NULL \
                     ELSE ?3 END, \
                     error_code = ?4, next_attempt_at = NULL, current_assignment = NULL, \
                     lease_expires_at = NULL, updated_at = ?3 \
                     WHERE tenant_id = ?1 AND agent_id = ?2 \
                     AND state IN ('pending', 'retry_wait', 'leased')",
                    params![tenant, id, now, lifecycle::AGENT_DELETED],
                )?;
                // Tasks before their attempts, the lock order of every other writer.
                tx.execute(
                    "UPDATE task_attempts SET state = 'expired', finished_at = ?2, \
                     error_code = ?3 WHERE agent_id = ?1 AND state = 'leased'",
                    params![id, now, lifecycle::AGENT_DELETED],
                )?;
                Ok(true)
            })
            .await
    }

    async fn rebind_certificate(
        &self,
        id: AgentId,
        old_fingerprint: &str,
        new_fingerprint: &str,
        new_expires_at: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<bool> {
        let (old, new) = (old_fingerprint.to_owned(), new_fingerprint.to_owned());
        self.writer
            .write("rebind certificate", move |tx| {
                let done = tx.execute(
                    "UPDATE agents SET certificate_fingerprint = ?1, certificate_expires_at = ?2, \
                     updated_at = ?3 WHERE id = ?4 AND certificate_fingerprint = ?5",
                    params![
                        new,
                        unix_millis(new_expires_at),
                        unix_millis(now),
                        id_text(id.0),
                        old,
                    ],
                )?;
                Ok(done > 0)
            })
            .await
    }

    async fn record_heartbeats(&self, batch: &[HeartbeatRecord]) -> Result<Vec<HeartbeatOutcome>> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        // Serialised here, off the writer thread.
        let mut updates = Vec::with_capacity(batch.len());
        for i in rows::lock_order(batch) {
            let record = &batch[i];
            updates.push((
                i,
                record.reported_status.as_str(),
                unix_millis(record.at),
                json_text("agents.resource_usage", &record.resource_usage)?,
                json_text("agents.capabilities", &record.capabilities)?,
                id_text(record.agent_id.0),
                record.certificate_fingerprint.clone(),
                unix_millis(record.session_expires_at),
                record.generation,
            ));
        }
        let len = batch.len();
        // One operation, so the whole batch shares one commit; unflushed, because liveness is
        // sent again every interval and must not cost a disk flush per heartbeat.
        self.writer
            .write_unflushed("record heartbeats", move |tx| {
                let mut outcomes = vec![HeartbeatOutcome::Revoked; len];
                for (i, status, at, usage, capabilities, agent, fingerprint, session, generation) in
                    updates
                {
                    // Binding and generation are conditions of the update itself.
                    let applied = tx.execute(
                        "UPDATE agents SET reported_status = ?1, \
                         status = CASE WHEN session_conflict_until > ?2 THEN 'degraded' \
                         ELSE ?1 END, \
                         last_heartbeat = ?2, resource_usage = ?3, capabilities = ?4, \
                         updated_at = ?2, session_expires_at = ?7 \
                         WHERE id = ?5 AND certificate_fingerprint = ?6 AND generation = ?8",
                        params![
                            status,
                            at,
                            usage,
                            capabilities,
                            agent,
                            fingerprint,
                            session,
                            generation
                        ],
                    )?;
                    outcomes[i] = if applied > 0 {
                        HeartbeatOutcome::Applied
                    } else {
                        // Only says why the update was refused.
                        let bound = tx.optional(
                            "SELECT 1 FROM agents WHERE id = ?1 AND certificate_fingerprint = ?2",
                            params![agent, fingerprint],
                            |_| Ok(()),
                        )?;
                        if bound.is_some() {
                            HeartbeatOutcome::Fenced
                        } else {
                            HeartbeatOutcome::Revoked
                        }
                    };
                }
                Ok(outcomes)
            })
            .await
    }

    async fn sweep_stale_agents(
        &self,
        degraded_before: OffsetDateTime,
        offline_before: OffsetDateTime,
    ) -> Result<StaleSweep> {
        let (degraded_before, offline_before) =
            (unix_millis(degraded_before), unix_millis(offline_before));
        self.writer
            .write("sweep stale agents", move |tx| {
                // Offline first, so an agent late enough for both is counted once, as offline.
                // `updated_at` is left alone: lateness is not an edit, and the sweep has no
                // clock.
                let offline = tx.execute(
                    "UPDATE agents SET status = ?1 WHERE status <> ?1 \
                     AND (last_heartbeat < ?2 OR (last_heartbeat IS NULL AND created_at < ?2))",
                    params![AgentStatus::Offline.as_str(), offline_before],
                )?;
                let degraded = tx.execute(
                    "UPDATE agents SET status = ?1 WHERE status = ?2 AND last_heartbeat < ?3",
                    params![
                        AgentStatus::Degraded.as_str(),
                        AgentStatus::Online.as_str(),
                        degraded_before,
                    ],
                )?;
                Ok(StaleSweep {
                    degraded: degraded as u64,
                    offline: offline as u64,
                })
            })
            .await
    }

    // --- sessions (fencing) ---

    async fn acquire_session(
        &self,
        agent: AgentId,
        certificate_fingerprint: &str,
        instance_id: &str,
        now: OffsetDateTime,
        lease_expires_at: OffsetDateTime,
    ) -> Result<SessionOutcome> {
        let (fingerprint, instance_id) =
            (certificate_fingerprint.to_owned(), instance_id.to_owned());
        self.writer
            .write("acquire session", move |tx| {
                let row = tx.optional(
                    "SELECT certificate_fingerprint, session_instance_id, session_expires_at \
                     FROM agents WHERE id = ?1",
                    [id_text(agent.0)],
                    |row| {
                        Ok((
                            row.text_opt("certificate_fingerprint")?,
                            row.text_opt("session_instance_id")?,
                            row.time_opt("session_expires_at")?,
                        ))
                    },
                )?;
                let Some((bound, holder, expires)) = row else {
                    return Ok(SessionOutcome::Revoked);
                };
                if bound.as_deref() != Some(fingerprint.as_str()) {
                    return Ok(SessionOutcome::Revoked);
                }
                if let (Some(holder), Some(expires)) = (holder, expires) {
                    if holder != instance_id && expires > millis(now) {
                        return Ok(SessionOutcome::Held {
                            holder_instance: holder,
                            lease_expires_at: expires,
                        });
                    }
                }
                tx.one(
                    "UPDATE agents SET generation = generation + 1, session_instance_id = ?2, \
                     session_expires_at = ?3, session_conflict_until = NULL WHERE id = ?1 \
                     RETURNING generation, session_expires_at",
                    params![id_text(agent.0), instance_id, unix_millis(lease_expires_at)],
                    |row| {
                        Ok(SessionOutcome::Acquired {
                            generation: row.int("generation")?,
                            lease_expires_at: row.time("session_expires_at")?,
                        })
                    },
                )
            })
            .await
    }

    async fn release_session(
        &self,
        agent: AgentId,
        generation: i64,
        _now: OffsetDateTime,
    ) -> Result<bool> {
        self.writer
            .write("release session", move |tx| {
                let done = tx.execute(
                    "UPDATE agents SET session_instance_id = NULL, session_expires_at = NULL \
                     WHERE id = ?1 AND generation = ?2 AND session_instance_id IS NOT NULL",
                    params![id_text(agent.0), generation],
                )?;
                Ok(done > 0)
            })
            .await
    }

    async fn mark_agent_degraded(&self, agent: AgentId, until: OffsetDateTime) -> Result<()> {
        self.writer
            .write("mark agent degraded", move |tx| {
                // Like the staleness sweep, a status the server infers is not an edit: no
                // `updated_at`.
                tx.execute(
                    "UPDATE agents SET status = ?1, session_conflict_until = ?3 WHERE id = ?2",
                    params![
                        AgentStatus::Degraded.as_str(),
                        id_text(agent.0),
                        unix_millis(until)
                    ],
                )?;
                Ok(())
            })
            .await
    }

    // --- tasks ---

    async fn create_task(&self, task: NewTask) -> Result<CreateTaskOutcome> {
        let payload = json_text("tasks.payload", &task.payload)?;
        let variables = json_text("tasks.variables", &task.variables)?;
        let created = self
            .writer
            .write("create task", move |tx| {
                // The writer runs one operation at a time: a delete_agent either ran before
                // (no agent) or runs after (and expires this task).
                let agent_ok = tx
                    .optional(
                        "SELECT 1 FROM agents WHERE id = ?1 AND tenant_id = ?2",
                        params![id_text(task.agent_id.0), id_text(task.tenant_id.0)],
                        |_| Ok(()),
                    )?
                    .is_some();
                if agent_ok {
                    let inserted = tx.optional(
                        concat!(
                            "INSERT INTO tasks (id, tenant_id, task_type, agent_id, payload, \
                             credentials_sealed, variables, timeout_seconds, priority, \
                             side_effects, idempotency_key, request_hash, read_back_of, state, \
                             created_at, updated_at) \
                             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, \
                             'pending', ?14, ?14) \
                             ON CONFLICT (tenant_id, idempotency_key) \
                             WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING ",
                            task_columns!()
                        ),
                        params![
                            id_text(task.id.0),
                            id_text(task.tenant_id.0),
                            task.task_type,
                            id_text(task.agent_id.0),
                            payload,
                            task.credentials_sealed,
                            variables,
                            i64::from(task.timeout_seconds),
                            i64::from(task.priority),
                            task.side_effects,
                            task.idempotency_key,
                            task.request_hash,
                            task.read_back_of.map(|t| id_text(t.0)),
                            unix_millis(task.created_at),
                        ],
                        |row| rows::read_task(row),
                    )?;
                    if let Some(created) = inserted {
                        return Ok(CreateTaskOutcome::Created(created));
                    }
                }
                // The key is taken.
                if let Some(key) = &task.idempotency_key {
                    let existing = tx.optional(
                        concat!(
                            "SELECT ",
                            task_columns!(),
                            " FROM tasks WHERE tenant_id = ?1 AND idempotency_key = ?2"
                        ),
                        params![id_text(task.tenant_id.0), key],
                        |row| Ok((row.text_opt("request_hash")?, rows::read_task(row)?)),
                    )?;
                    if let Some((request_hash, existing)) = existing {
                        return Ok(if request_hash == task.request_hash {
                            CreateTaskOutcome::Existing(existing)
                        } else {
                            CreateTaskOutcome::KeyConflict
                        });
                    }
                }
                Err(StoreError::Conflict {
                    constraint: if agent_ok {
                        "task_idempotency_key"
                    } else {
                        "task_agent"
                    },
                })
            })
            .await?;
        if let CreateTaskOutcome::Created(task) = &created {
            self.wake(task.agent_id);
        }
        Ok(created)
    }

    async fn get_task(&self, tenant: TenantId, id: TaskId) -> Result<Option<(Task, Vec<Attempt>)>> {
        self.readers
            .read("get task", move |db| {
                let Some(task) = tenant_task(db, tenant, id)? else {
                    return Ok(None);
                };
                let attempts = db.all(
                    concat!(
                        "SELECT ",
                        attempt_columns!(),
                        " FROM task_attempts WHERE task_id = ?1 ORDER BY assigned_at, assignment_id"
                    ),
                    [id_text(id.0)],
                    |row| rows::read_attempt(row),
                )?;
                Ok(Some((task, attempts)))
            })
            .await
    }

    async fn list_tasks(
        &self,
        tenant: TenantId,
        filter: &TaskFilter,
        after: Option<TaskId>,
        limit: u32,
    ) -> Result<Page<Task>> {
        let limit = limit.max(1);
        let mut query = Query::new(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = "
        ));
        query.push_bind(id_text(tenant.0));
        if let Some(state) = filter.state {
            query
                .push(" AND state = ")
                .push_bind(state.as_str().to_string());
        }
        if let Some(agent) = filter.agent_id {
            query.push(" AND agent_id = ").push_bind(id_text(agent.0));
        }
        if let Some(task_type) = &filter.task_type {
            query.push(" AND task_type = ").push_bind(task_type.clone());
        }
        self.fetch_page(
            "list tasks",
            query,
            after.map(|id| id.0),
            limit,
            |row| rows::read_task(row),
            |t| t.id.0,
        )
        .await
    }

    async fn claim_task(
        &self,
        agent: AgentId,
        generation: i64,
        certificate_fingerprint: &str,
        now: OffsetDateTime,
        lease_grace: std::time::Duration,
    ) -> Result<ClaimOutcome> {
        const OP: &str = "claim task";
        let fingerprint = certificate_fingerprint.to_owned();
        // Most polls find nothing to claim. Answer those from a reader, so that thousands of
        // idle long-polls never queue on the single writer (and heartbeats behind them). The
        // same binding check runs again in the writer before anything is leased.
        let early = self
            .readers
            .read(OP, {
                let fingerprint = fingerprint.clone();
                move |db| {
                    Ok(match binding(db, agent, &fingerprint, generation)? {
                        Binding::Current => db
                            .optional(
                                "SELECT 1 FROM tasks WHERE agent_id = ?1 \
                                 AND state IN ('pending', 'retry_wait') LIMIT 1",
                                [id_text(agent.0)],
                                |_| Ok(()),
                            )?
                            .is_none()
                            .then_some(ClaimOutcome::Empty),
                        Binding::Fenced => Some(ClaimOutcome::Fenced),
                        Binding::Revoked => Some(ClaimOutcome::Revoked),
                    })
                }
            })
            .await?;
        if let Some(outcome) = early {
            return Ok(outcome);
        }
        self.writer
            .write(OP, move |tx| {
                match binding(tx, agent, &fingerprint, generation)? {
                    Binding::Current => {}
                    Binding::Fenced => return Ok(ClaimOutcome::Fenced),
                    Binding::Revoked => return Ok(ClaimOutcome::Revoked),
                }
                // The writer runs one operation at a time, so the head read here is still the
                // head when it is leased.
                let head = tx.optional(
                    concat!(
                        "SELECT ",
                        task_columns!(),
                        " FROM tasks WHERE agent_id = ?1 AND state IN ('pending', 'retry_wait') \
                         ORDER BY priority DESC, seq LIMIT 1"
                    ),
                    [id_text(agent.0)],
                    |row| rows::read_task(row),
                )?;
                let Some(head) = head else {
                    return Ok(ClaimOutcome::Empty);
                };
                let now = millis(now);
                if head.state == TaskState::RetryWait
                    && head.next_attempt_at.is_some_and(|t| t > now)
                {
                    return Ok(ClaimOutcome::Empty);
                }
                if head.side_effects {
                    let busy = tx.optional(
                        "SELECT 1 FROM tasks WHERE agent_id = ?1 AND state = 'leased' \
                         AND side_effects LIMIT 1",
                        [id_text(agent.0)],
                        |_| Ok(()),
                    )?;
                    if busy.is_some() {
                        return Ok(ClaimOutcome::Empty);
                    }
                }
                let assignment = AssignmentId::new();
                let lease_expires_at =
                    lifecycle::lease_deadline(now, head.timeout_seconds, lease_grace);
                // Conditional all the same, as on every backend: the lease is taken only from
                // a task that is still waiting.
                let task = tx.optional(
                    concat!(
                        "UPDATE tasks SET state = 'leased', attempts = attempts + 1, \
                         current_assignment = ?2, lease_expires_at = ?3, \
                         next_attempt_at = NULL, updated_at = ?4 \
                         WHERE id = ?1 AND state IN ('pending', 'retry_wait') RETURNING ",
                        task_columns!()
                    ),
                    params![
                        id_text(head.id.0),
                        id_text(assignment.0),
                        unix_millis(lease_expires_at),
                        unix_millis(now),
                    ],
                    |row| rows::read_task(row),
                )?;
                let Some(task) = task else {
                    return Ok(ClaimOutcome::Empty);
                };
                let attempt = tx.one(
                    concat!(
                        "INSERT INTO task_attempts (assignment_id, task_id, agent_id, \
                         generation, state, assigned_at, lease_expires_at) \
                         VALUES (?1, ?2, ?3, ?4, 'leased', ?5, ?6) RETURNING ",
                        attempt_columns!()
                    ),
                    params![
                        id_text(assignment.0),
                        id_text(task.id.0),
                        id_text(agent.0),
                        generation,
                        unix_millis(now),
                        unix_millis(lease_expires_at),
                    ],
                    |row| rows::read_attempt(row),
                )?;
                Ok(ClaimOutcome::Claimed(task, attempt))
            })
            .await
    }

    async fn pending_cancellations(&self, agent: AgentId) -> Result<Vec<(TaskId, AssignmentId)>> {
        self.readers
            .read("pending cancellations", move |db| {
                db.all(
                    "SELECT id, current_assignment FROM tasks \
                     WHERE agent_id = ?1 AND state = 'leased' AND cancel_requested ORDER BY seq",
                    [id_text(agent.0)],
                    |row| {
                        let assignment = row.uuid_opt("current_assignment")?.ok_or_else(|| {
                            StoreError::Corrupt(
                                "tasks.current_assignment: leased without one".to_string(),
                            )
                        })?;
                        Ok((TaskId(row.uuid("id")?), AssignmentId(assignment)))
                    },
                )
            })
            .await
    }

    async fn complete_attempt(
        &self,
        completion: Completion,
        policy: &RetryPolicy,
    ) -> Result<CompleteOutcome> {
        let policy = policy.clone();
        let envelope = json_text("task_attempts.envelope", &completion.envelope)?;
        let result_data = completion
            .result_data
            .as_ref()
            .map(|data| json_text("tasks.result", data))
            .transpose()?;
        let outcome = self
            .writer
            .write("complete attempt", move |tx| {
                // The writer runs one operation at a time: the generation stays still until
                // this commits.
                match binding(
                    tx,
                    completion.agent_id,
                    &completion.certificate_fingerprint,
                    completion.generation,
                )? {
                    Binding::Current => {}
                    Binding::Fenced => return Ok(CompleteOutcome::Fenced),
                    Binding::Revoked => return Ok(CompleteOutcome::Revoked),
                }
                let task = tx.optional(
                    concat!(
                        "SELECT ",
                        task_columns!(),
                        " FROM tasks WHERE id = ?1 AND agent_id = ?2"
                    ),
                    params![
                        id_text(completion.task_id.0),
                        id_text(completion.agent_id.0)
                    ],
                    |row| rows::read_task(row),
                )?;
                let Some(task) = task else {
                    return Ok(CompleteOutcome::NotFound);
                };
                // Without an assignment id: the current delivery, or (for a duplicate) the
                // last one.
                let attempt = match completion.assignment_id.or(task.current_assignment) {
                    Some(assignment) => tx.optional(
                        concat!(
                            "SELECT ",
                            attempt_columns!(),
                            " FROM task_attempts WHERE assignment_id = ?1 AND task_id = ?2"
                        ),
                        params![id_text(assignment.0), id_text(task.id.0)],
                        |row| rows::read_attempt(row),
                    )?,
                    None => tx.optional(
                        concat!(
                            "SELECT ",
                            attempt_columns!(),
                            " FROM task_attempts WHERE task_id = ?1 \
                             ORDER BY assigned_at DESC, assignment_id DESC LIMIT 1"
                        ),
                        [id_text(task.id.0)],
                        |row| rows::read_attempt(row),
                    )?,
                };
                let now = millis(completion.now);
                let attempt =
                    match lifecycle::accept_completion(&task, attempt, &completion.envelope, now) {
                        Ok(attempt) => attempt,
                        Err(refused) => return Ok(refused.outcome(task)),
                    };
                let next = lifecycle::completion_transition(
                    &completion.result,
                    task.attempts,
                    task.cancel_requested,
                    &policy,
                    now,
                );
                tx.execute(
                    "UPDATE task_attempts SET state = ?2, finished_at = ?3, envelope = ?4, \
                     error_code = ?5 WHERE assignment_id = ?1",
                    params![
                        id_text(attempt.assignment_id.0),
                        next.attempt.as_str(),
                        unix_millis(now),
                        envelope,
                        next.error_code,
                    ],
                )?;
                let task = tx.one(
                    concat!(
                        "UPDATE tasks SET state = ?2, next_attempt_at = ?3, \
                         error_code = COALESCE(?4, error_code), result = ?5, \
                         current_assignment = NULL, lease_expires_at = NULL, updated_at = ?6, \
                         finished_at = ?7 WHERE id = ?1 RETURNING ",
                        task_columns!()
                    ),
                    params![
                        id_text(task.id.0),
                        next.state.as_str(),
                        next.next_attempt_at.map(unix_millis),
                        next.error_code,
                        result_data,
                        unix_millis(now),
                        next.finished_at.map(unix_millis),
                    ],
                    |row| rows::read_task(row),
                )?;
                Ok(CompleteOutcome::Recorded(task))
            })
            .await?;
        // The agent's queue may have unblocked (a side-effecting task ended, or the head moved).
        if let CompleteOutcome::Recorded(task) = &outcome {
            self.wake(task.agent_id);
        }
        Ok(outcome)
    }

    async fn cancel_task(
        &self,
        tenant: TenantId,
        id: TaskId,
        now: OffsetDateTime,
    ) -> Result<Option<CancelOutcome>> {
        let now = unix_millis(now);
        let outcome = self
            .writer
            .write("cancel task", move |tx| {
                let Some(task) = tenant_task(tx, tenant, id)? else {
                    return Ok(None);
                };
                Ok(Some(match task.state {
                    TaskState::Pending | TaskState::RetryWait | TaskState::Unknown => {
                        CancelOutcome::Cancelled(tx.one(
                            concat!(
                                "UPDATE tasks SET state = 'cancelled', next_attempt_at = NULL, \
                                 finished_at = ?2, updated_at = ?2 WHERE id = ?1 RETURNING ",
                                task_columns!()
                            ),
                            params![id_text(id.0), now],
                            |row| rows::read_task(row),
                        )?)
                    }
                    TaskState::Leased => CancelOutcome::Requested(tx.one(
                        concat!(
                            "UPDATE tasks SET cancel_requested = TRUE, updated_at = ?2 \
                             WHERE id = ?1 RETURNING ",
                            task_columns!()
                        ),
                        params![id_text(id.0), now],
                        |row| rows::read_task(row),
                    )?),
                    _ => CancelOutcome::AlreadyFinished(task),
                }))
            })
            .await?;
        // Wakes the agent's long-poll: a cancellation to deliver, or a queue head that moved.
        if let Some(CancelOutcome::Cancelled(task) | CancelOutcome::Requested(task)) = &outcome {
            self.wake(task.agent_id);
        }
        Ok(outcome)
    }

    async fn retry_task(
        &self,
        tenant: TenantId,
        id: TaskId,
        now: OffsetDateTime,
    ) -> Result<Option<RetryOutcome>> {
        let now = unix_millis(now);
        let outcome = self
            .writer
            .write("retry task", move |tx| {
                let Some(task) = tenant_task(tx, tenant, id)? else {
                    return Ok(None);
                };
                if !matches!(task.state, TaskState::Unknown | TaskState::DeadLetter) {
                    return Ok(Some(RetryOutcome::NotRetriable(task)));
                }
                // A fresh attempt budget: the counter the policy compares with starts again.
                let task = tx.one(
                    concat!(
                        "UPDATE tasks SET state = 'pending', attempts = 0, next_attempt_at = NULL, \
                         cancel_requested = FALSE, finished_at = NULL, updated_at = ?2 \
                         WHERE id = ?1 RETURNING ",
                        task_columns!()
                    ),
                    params![id_text(id.0), now],
                    |row| rows::read_task(row),
                )?;
                Ok(Some(RetryOutcome::Requeued(task)))
            })
            .await?;
        if let Some(RetryOutcome::Requeued(task)) = &outcome {
            self.wake(task.agent_id);
        }
        Ok(outcome)
    }

    async fn expire_leases(&self, now: OffsetDateTime, policy: &RetryPolicy) -> Result<LeaseSweep> {
        let now = millis(now);
        let policy = policy.clone();
        let (sweep, agents) = self
            .writer
            .write("expire leases", move |tx| {
                let expired = tx.all(
                    concat!(
                        "SELECT ",
                        task_columns!(),
                        " FROM tasks WHERE state = 'leased' AND lease_expires_at <= ?1 \
                         ORDER BY lease_expires_at"
                    ),
                    [unix_millis(now)],
                    |row| rows::read_task(row),
                )?;
                let mut sweep = LeaseSweep::default();
                let mut agents = BTreeSet::new();
                for task in expired {
                    let next = lifecycle::expiry_transition(
                        task.side_effects,
                        task.attempts,
                        task.cancel_requested,
                        &policy,
                        now,
                    );
                    tx.execute(
                        "UPDATE task_attempts SET state = ?2, finished_at = ?3, error_code = ?4 \
                         WHERE assignment_id = ?1 AND state = 'leased'",
                        params![
                            task.current_assignment.map(|a| id_text(a.0)),
                            next.attempt.as_str(),
                            unix_millis(now),
                            next.error_code,
                        ],
                    )?;
                    let task = tx.one(
                        concat!(
                            "UPDATE tasks SET state = ?2, next_attempt_at = ?3, \
                             error_code = COALESCE(?4, error_code), current_assignment = NULL, \
                             lease_expires_at = NULL, updated_at = ?5, finished_at = ?6 \
                             WHERE id = ?1 RETURNING ",
                            task_columns!()
                        ),
                        params![
                            id_text(task.id.0),
                            next.state.as_str(),
                            next.next_attempt_at.map(unix_millis),
                            next.error_code,
                            unix_millis(now),
                            next.finished_at.map(unix_millis),
                        ],
                        |row| rows::read_task(row),
                    )?;
                    agents.insert(task.agent_id);
                    match task.state {
                        TaskState::Unknown => sweep.unknown.push(task),
                        TaskState::RetryWait => sweep.requeued.push(task),
                        TaskState::DeadLetter => sweep.dead_lettered += 1,
                        _ => {}
                    }
                }
                Ok((sweep, agents))
            })
            .await?;
        // A task leaving `leased` may unblock its agent's queue.
        for agent in agents {
            self.wake(agent);
        }
        Ok(sweep)
    }

    async fn resolve_read_back(
        &self,
        id: TaskId,
        found: bool,
        evidence: serde_json::Value,
        now: OffsetDateTime,
    ) -> Result<Option<Task>> {
        let evidence = json_text("tasks.result", &evidence)?;
        self.writer
            .write("resolve read-back", move |tx| {
                tx.optional(
                    concat!(
                        "UPDATE tasks SET state = CASE WHEN ?2 THEN 'succeeded' ELSE state END, \
                         read_back = ?2, result = ?3, updated_at = ?4, \
                         finished_at = CASE WHEN ?2 THEN ?4 ELSE finished_at END \
                         WHERE id = ?1 AND state = 'unknown' RETURNING ",
                        task_columns!()
                    ),
                    params![id_text(id.0), found, evidence, unix_millis(now)],
                    |row| rows::read_task(row),
                )
            })
            .await
    }

    fn task_events(&self) -> broadcast::Receiver<AgentId> {
        self.events.subscribe()
    }
}
