//! The embedded SQLite backend: one file in WAL mode, one writer connection for every write,
//! and a pool of read-only connections. It must never write through the reader pool, and never
//! run a read-then-write that a single conditional statement can do.

use std::collections::BTreeSet;
use std::path::Path;
use std::time::Duration;

use berth_proto::agent::AgentStatus;
use berth_proto::{AgentId, AssignmentId, TaskId, TenantId};
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteRow, SqliteSynchronous,
};
use sqlx::types::Json;
use sqlx::{QueryBuilder, Sqlite};
use time::OffsetDateTime;
use tokio::sync::broadcast;
use uuid::Uuid;

use crate::rows::{
    self, agent_columns, attempt_columns, db_error, get, millis, task_columns, unix_millis,
    ColumnReader,
};
use crate::{
    Agent, AgentFilter, AgentUpdate, ApiToken, Attempt, AttemptState, CancelOutcome, ClaimOutcome,
    CompleteOutcome, Completion, CreateTaskOutcome, HeartbeatOutcome, HeartbeatRecord, LeaseSweep,
    NewAgent, NewApiToken, NewRegistrationToken, NewTask, Page, RegisterError, Result,
    RetryOutcome, RetryPolicy, SessionOutcome, StaleSweep, Store, StoreError, Task, TaskFilter,
    TaskState, Tenant,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// How long a connection waits for another process's write lock before failing with BUSY.
/// Within one process the single writer connection already serialises writes.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
const READERS: u32 = 4;
/// How often WAL frames are copied back into the database file, off the writer's path.
const CHECKPOINT_EVERY: Duration = Duration::from_secs(1);
const EVENT_CAPACITY: usize = 1024;

pub struct SqliteStore {
    /// Exactly one connection: SQLite admits one writer at a time, and queueing on the pool is
    /// fairer and cheaper than retrying SQLITE_BUSY.
    write: SqlitePool,
    /// Read-only connections; in WAL mode they never block the writer, nor it them.
    read: SqlitePool,
    /// Task events: one process owns the file, so an in-process channel reaches every poller.
    events: broadcast::Sender<AgentId>,
    /// Stops the checkpointer when the store goes away.
    _checkpointer: AbortOnDrop,
}

struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Checkpoints the WAL from its own connection. SQLite's automatic checkpoint would run inside
/// whichever commit crosses the threshold, on the single writer, stalling every queued
/// heartbeat behind its fsyncs; a PASSIVE checkpoint here runs beside the writer instead.
async fn checkpoint_loop(pool: SqlitePool) {
    let mut tick = tokio::time::interval(CHECKPOINT_EVERY);
    loop {
        tick.tick().await;
        if let Err(e) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
            .execute(&pool)
            .await
        {
            tracing::warn!(error = %e, "sqlite checkpoint failed; will retry");
        }
    }
}

impl SqliteStore {
    /// Opens (creating if missing) the database file and runs the migrations.
    pub async fn open(path: &Path) -> Result<SqliteStore> {
        let writer_options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // WAL + NORMAL: a commit is durable against process crashes and costs no fsync;
            // a power loss can lose the last commits but never corrupts the file.
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        let checkpoint_options = writer_options.clone();
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(writer_options.pragma("wal_autocheckpoint", "0"))
            .await
            .map_err(db_error("open sqlite database"))?;
        MIGRATOR.run(&write).await.map_err(StoreError::Migrate)?;

        // The journal mode is a property of the file, set above; readers only need to find it.
        let reader_options = SqliteConnectOptions::new()
            .filename(path)
            .read_only(true)
            .foreign_keys(true)
            .busy_timeout(BUSY_TIMEOUT);
        let read = SqlitePoolOptions::new()
            .max_connections(READERS)
            .connect_with(reader_options)
            .await
            .map_err(db_error("open sqlite readers"))?;
        let checkpoint = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(checkpoint_options)
            .await
            .map_err(db_error("open sqlite checkpointer"))?;
        let checkpointer = AbortOnDrop(tokio::spawn(checkpoint_loop(checkpoint)).abort_handle());
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        Ok(SqliteStore {
            write,
            read,
            events,
            _checkpointer: checkpointer,
        })
    }

    /// A write transaction that takes the write lock up front, so it never has to upgrade a
    /// read lock (an upgrade conflict is SQLITE_BUSY that no timeout resolves).
    async fn begin_write(
        &self,
        operation: &'static str,
    ) -> Result<sqlx::Transaction<'static, Sqlite>> {
        self.write
            .begin_with("BEGIN IMMEDIATE")
            .await
            .map_err(db_error(operation))
    }

    /// Sent after the commit that made `agent`'s work claimable (never before: a woken poller
    /// must find it). No receivers is not an error: nobody is long-polling right now.
    fn wake(&self, agent: AgentId) {
        let _ = self.events.send(agent);
    }
}

/// How an agent-runtime write stands against the agent's row.
enum Binding {
    Current,
    Fenced,
    Revoked,
}

const BINDING: &str = "SELECT generation, certificate_fingerprint FROM agents WHERE id = $1";

/// Checks the certificate binding and the session generation inside the caller's write
/// transaction, so neither can change before the write that depends on them commits.
async fn check_binding(
    conn: &mut SqliteConnection,
    query: &'static str,
    agent: AgentId,
    certificate_fingerprint: &str,
    generation: i64,
) -> Result<Binding> {
    let row = sqlx::query(query)
        .bind(id_text(agent.0))
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

/// Ends a keyset-paged list query — rows after `after` in id order, at most `limit` — and
/// reads the page.
async fn fetch_page<T>(
    pool: &SqlitePool,
    mut query: QueryBuilder<'_, Sqlite>,
    after: Option<Uuid>,
    limit: u32,
    operation: &'static str,
    read: fn(&SqliteRow) -> Result<T>,
    id: fn(&T) -> Uuid,
) -> Result<Page<T>> {
    if let Some(after) = after {
        query.push(" AND id > ").push_bind(id_text(after));
    }
    query
        .push(" ORDER BY id LIMIT ")
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

impl ColumnReader for SqliteRow {
    fn uuid(&self, column: &'static str) -> Result<Uuid> {
        let text: String = get(self, column)?;
        Uuid::parse_str(&text).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
    }
    fn time(&self, column: &'static str) -> Result<OffsetDateTime> {
        rows::from_unix_millis(column, get(self, column)?)
    }
    fn time_opt(&self, column: &'static str) -> Result<Option<OffsetDateTime>> {
        get::<_, Option<i64>>(self, column)?
            .map(|ms| rows::from_unix_millis(column, ms))
            .transpose()
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
        get::<_, Option<String>>(self, column)?
            .map(|text| {
                Uuid::parse_str(&text).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
            })
            .transpose()
    }
    fn int(&self, column: &'static str) -> Result<i64> {
        get(self, column)
    }
    fn bytes_opt(&self, column: &'static str) -> Result<Option<Vec<u8>>> {
        get(self, column)
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
        sqlx::query("SELECT 1")
            .execute(&self.read)
            .await
            .map_err(db_error("ping"))?;
        Ok(())
    }

    async fn ensure_tenant(&self, name: &str, now: OffsetDateTime) -> Result<Tenant> {
        let mut tx = self.begin_write("ensure tenant").await?;
        sqlx::query(
            "INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(id_text(TenantId::new().0))
        .bind(name)
        .bind(unix_millis(now))
        .execute(&mut *tx)
        .await
        .map_err(db_error("ensure tenant"))?;
        let row = sqlx::query("SELECT id, name, created_at FROM tenants WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error("ensure tenant"))?;
        let tenant = rows::read_tenant(&row)?;
        tx.commit().await.map_err(db_error("ensure tenant"))?;
        Ok(tenant)
    }

    async fn create_tenant(&self, id: TenantId, name: &str, now: OffsetDateTime) -> Result<Tenant> {
        let row = sqlx::query(
            "INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3) \
             RETURNING id, name, created_at",
        )
        .bind(id_text(id.0))
        .bind(name)
        .bind(unix_millis(now))
        .fetch_one(&self.write)
        .await
        .map_err(db_error("create tenant"))?;
        rows::read_tenant(&row)
    }

    async fn get_tenant(&self, id: TenantId) -> Result<Option<Tenant>> {
        sqlx::query("SELECT id, name, created_at FROM tenants WHERE id = $1")
            .bind(id_text(id.0))
            .fetch_optional(&self.read)
            .await
            .map_err(db_error("get tenant"))?
            .map(|row| rows::read_tenant(&row))
            .transpose()
    }

    async fn create_api_token(&self, token: NewApiToken) -> Result<ApiToken> {
        let row = sqlx::query(
            "INSERT INTO api_tokens (id, tenant_id, name, role, operator, token_hash, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) \
             RETURNING id, tenant_id, name, role, operator, created_at",
        )
        .bind(id_text(token.id.0))
        .bind(id_text(token.tenant_id.0))
        .bind(&token.name)
        .bind(token.role.as_str())
        .bind(token.operator)
        .bind(&token.token_hash)
        .bind(unix_millis(token.created_at))
        .fetch_one(&self.write)
        .await
        .map_err(db_error("create api token"))?;
        rows::read_api_token(&row)
    }

    async fn api_token_by_hash(&self, token_hash: &str) -> Result<Option<ApiToken>> {
        sqlx::query(
            "SELECT id, tenant_id, name, role, operator, created_at FROM api_tokens \
             WHERE token_hash = $1",
        )
        .bind(token_hash)
        .fetch_optional(&self.read)
        .await
        .map_err(db_error("look up api token"))?
        .map(|row| rows::read_api_token(&row))
        .transpose()
    }

    async fn has_operator_token(&self, tenant: TenantId) -> Result<bool> {
        let row = sqlx::query(
            "SELECT EXISTS (SELECT 1 FROM api_tokens WHERE tenant_id = $1 AND operator) AS found",
        )
        .bind(id_text(tenant.0))
        .fetch_one(&self.read)
        .await
        .map_err(db_error("check operator token"))?;
        get(&row, "found")
    }

    async fn create_registration_token(&self, token: NewRegistrationToken) -> Result<()> {
        sqlx::query(
            "INSERT INTO registration_tokens \
             (id, tenant_id, token_hash, labels, environment, expires_at, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(id_text(token.id.0))
        .bind(id_text(token.tenant_id.0))
        .bind(&token.token_hash)
        .bind(Json(&token.labels))
        .bind(&token.environment)
        .bind(unix_millis(token.expires_at))
        .bind(unix_millis(token.created_at))
        .execute(&self.write)
        .await
        .map_err(db_error("create registration token"))?;
        Ok(())
    }

    async fn register_agent(
        &self,
        token_hash: &str,
        agent: NewAgent,
        now: OffsetDateTime,
    ) -> Result<std::result::Result<Agent, RegisterError>> {
        const OP: &str = "register agent";
        let mut tx = self.begin_write(OP).await?;
        // Consuming is the conditional update itself: of concurrent callers, only the first
        // sees `used_at IS NULL`.
        let consumed = sqlx::query(
            "UPDATE registration_tokens SET used_at = $1 \
             WHERE token_hash = $2 AND used_at IS NULL AND expires_at > $1 \
             RETURNING tenant_id, labels, environment",
        )
        .bind(unix_millis(now))
        .bind(token_hash)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let Some(consumed) = consumed else {
            tx.rollback().await.map_err(db_error(OP))?;
            return Ok(Err(RegisterError::TokenInvalid));
        };
        let token = rows::read_consumed_token(&consumed)?;
        let labels = rows::merge_labels(agent.labels, token.labels);
        let inserted = sqlx::query(concat!(
            "INSERT INTO agents (id, tenant_id, name, version, capabilities, labels, status, \
             reported_status, environment, certificate_fingerprint, certificate_expires_at, \
             created_at, updated_at) \
             VALUES ($1, $2, $3, $4, $5, $6, 'online', 'online', $7, $8, $9, $10, $10) \
             RETURNING ",
            agent_columns!()
        ))
        .bind(id_text(agent.id.0))
        .bind(id_text(token.tenant_id.0))
        .bind(&agent.name)
        .bind(&agent.version)
        .bind(Json(&agent.capabilities))
        .bind(Json(&labels))
        .bind(&token.environment)
        .bind(&agent.certificate_fingerprint)
        .bind(unix_millis(agent.certificate_expires_at))
        .bind(unix_millis(agent.created_at))
        .fetch_one(&mut *tx)
        .await;
        // Rolling back un-consumes the token (dropping `tx` on an error return does too).
        match inserted {
            Ok(row) => {
                let agent = rows::read_agent(&row)?;
                tx.commit().await.map_err(db_error(OP))?;
                Ok(Ok(agent))
            }
            Err(e) if rows::unique_violation(&e) == Some("agent_name") => {
                tx.rollback().await.map_err(db_error(OP))?;
                Ok(Err(RegisterError::NameTaken))
            }
            Err(e) => Err(db_error(OP)(e)),
        }
    }

    async fn get_agent(&self, tenant: TenantId, id: AgentId) -> Result<Option<Agent>> {
        sqlx::query(concat!(
            "SELECT ",
            agent_columns!(),
            " FROM agents WHERE tenant_id = $1 AND id = $2"
        ))
        .bind(id_text(tenant.0))
        .bind(id_text(id.0))
        .fetch_optional(&self.read)
        .await
        .map_err(db_error("get agent"))?
        .map(|row| rows::read_agent(&row))
        .transpose()
    }

    async fn get_agent_for_runtime(&self, id: AgentId) -> Result<Option<Agent>> {
        sqlx::query(concat!(
            "SELECT ",
            agent_columns!(),
            " FROM agents WHERE id = $1"
        ))
        .bind(id_text(id.0))
        .fetch_optional(&self.read)
        .await
        .map_err(db_error("get agent"))?
        .map(|row| rows::read_agent(&row))
        .transpose()
    }

    async fn list_agents(
        &self,
        tenant: TenantId,
        filter: &AgentFilter,
        after: Option<AgentId>,
        limit: u32,
    ) -> Result<Page<Agent>> {
        let limit = limit.max(1);
        let mut query = QueryBuilder::<Sqlite>::new(concat!(
            "SELECT ",
            agent_columns!(),
            " FROM agents WHERE tenant_id = "
        ));
        query.push_bind(id_text(tenant.0));
        if let Some(status) = filter.status {
            query.push(" AND status = ").push_bind(status.as_str());
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
        fetch_page(
            &self.read,
            query,
            after.map(|id| id.0),
            limit,
            "list agents",
            rows::read_agent,
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
        sqlx::query(concat!(
            "UPDATE agents SET labels = COALESCE($1, labels), \
             capabilities = COALESCE($2, capabilities), updated_at = $3 \
             WHERE tenant_id = $4 AND id = $5 RETURNING ",
            agent_columns!()
        ))
        .bind(update.labels.as_ref().map(Json))
        .bind(update.capabilities.as_ref().map(Json))
        .bind(unix_millis(now))
        .bind(id_text(tenant.0))
        .bind(id_text(id.0))
        .fetch_optional(&self.write)
        .await
        .map_err(db_error("update agent"))?
        .map(|row| rows::read_agent(&row))
        .transpose()
    }

    async fn delete_agent(&self, tenant: TenantId, id: AgentId) -> Result<bool> {
        const OP: &str = "delete agent";
        // The trait gives no clock here.
        let now = unix_millis(OffsetDateTime::now_utc());
        let mut tx = self.begin_write(OP).await?;
        let done = sqlx::query("DELETE FROM agents WHERE tenant_id = $1 AND id = $2")
            .bind(id_text(tenant.0))
            .bind(id_text(id.0))
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
        if done.rows_affected() == 0 {
            return Ok(false);
        }
        // A leased task with side effects may have run: unknown, like a lost lease.
        sqlx::query(
            "UPDATE tasks SET \
             state = CASE WHEN state = 'leased' AND side_effects THEN 'unknown' ELSE 'expired' END, \
             finished_at = CASE WHEN state = 'leased' AND side_effects THEN NULL ELSE $3 END, \
             error_code = $4, next_attempt_at = NULL, current_assignment = NULL, \
             lease_expires_at = NULL, updated_at = $3 \
             WHERE tenant_id = $1 AND agent_id = $2 AND state IN ('pending', 'retry_wait', 'leased')",
        )
        .bind(id_text(tenant.0))
        .bind(id_text(id.0))
        .bind(now)
        .bind(rows::AGENT_DELETED)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        // Tasks before their attempts, the lock order of every other writer.
        sqlx::query(
            "UPDATE task_attempts SET state = 'expired', finished_at = $2, error_code = $3 \
             WHERE agent_id = $1 AND state = 'leased'",
        )
        .bind(id_text(id.0))
        .bind(now)
        .bind(rows::AGENT_DELETED)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(true)
    }

    async fn rebind_certificate(
        &self,
        id: AgentId,
        old_fingerprint: &str,
        new_fingerprint: &str,
        new_expires_at: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE agents SET certificate_fingerprint = $1, certificate_expires_at = $2, \
             updated_at = $3 WHERE id = $4 AND certificate_fingerprint = $5",
        )
        .bind(new_fingerprint)
        .bind(unix_millis(new_expires_at))
        .bind(unix_millis(now))
        .bind(id_text(id.0))
        .bind(old_fingerprint)
        .execute(&self.write)
        .await
        .map_err(db_error("rebind certificate"))?;
        Ok(done.rows_affected() > 0)
    }

    async fn record_heartbeats(&self, batch: &[HeartbeatRecord]) -> Result<Vec<HeartbeatOutcome>> {
        const OP: &str = "record heartbeats";
        let mut outcomes = vec![HeartbeatOutcome::Revoked; batch.len()];
        if batch.is_empty() {
            return Ok(outcomes);
        }
        // One transaction, one commit for the whole batch: that is the group commit.
        let mut tx = self.begin_write(OP).await?;
        for i in rows::lock_order(batch) {
            let record = &batch[i];
            // Binding and generation are conditions of the update itself.
            let done = sqlx::query(
                "UPDATE agents SET status = $1, reported_status = $1, last_heartbeat = $2, \
                 resource_usage = $3, capabilities = $4, updated_at = $2, \
                 session_expires_at = $7 \
                 WHERE id = $5 AND certificate_fingerprint = $6 AND generation = $8",
            )
            .bind(record.reported_status.as_str())
            .bind(unix_millis(record.at))
            .bind(Json(&record.resource_usage))
            .bind(Json(&record.capabilities))
            .bind(id_text(record.agent_id.0))
            .bind(&record.certificate_fingerprint)
            .bind(unix_millis(record.session_expires_at))
            .bind(record.generation)
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            outcomes[i] = if done.rows_affected() > 0 {
                HeartbeatOutcome::Applied
            } else {
                // Only says why the update was refused.
                let bound = sqlx::query(
                    "SELECT 1 AS found FROM agents WHERE id = $1 AND certificate_fingerprint = $2",
                )
                .bind(id_text(record.agent_id.0))
                .bind(&record.certificate_fingerprint)
                .fetch_optional(&mut *tx)
                .await
                .map_err(db_error(OP))?;
                if bound.is_some() {
                    HeartbeatOutcome::Fenced
                } else {
                    HeartbeatOutcome::Revoked
                }
            };
        }
        tx.commit().await.map_err(db_error(OP))?;
        Ok(outcomes)
    }

    async fn sweep_stale_agents(
        &self,
        degraded_before: OffsetDateTime,
        offline_before: OffsetDateTime,
    ) -> Result<StaleSweep> {
        const OP: &str = "sweep stale agents";
        let mut tx = self.begin_write(OP).await?;
        // Offline first, so an agent late enough for both is counted once, as offline.
        // `updated_at` is left alone: lateness is not an edit, and the sweep has no clock.
        let offline = sqlx::query(
            "UPDATE agents SET status = $1 WHERE status <> $1 \
             AND (last_heartbeat < $2 OR (last_heartbeat IS NULL AND created_at < $2))",
        )
        .bind(AgentStatus::Offline.as_str())
        .bind(unix_millis(offline_before))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .rows_affected();
        let degraded =
            sqlx::query("UPDATE agents SET status = $1 WHERE status = $2 AND last_heartbeat < $3")
                .bind(AgentStatus::Degraded.as_str())
                .bind(AgentStatus::Online.as_str())
                .bind(unix_millis(degraded_before))
                .execute(&mut *tx)
                .await
                .map_err(db_error(OP))?
                .rows_affected();
        tx.commit().await.map_err(db_error(OP))?;
        Ok(StaleSweep { degraded, offline })
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
        const OP: &str = "acquire session";
        let mut tx = self.begin_write(OP).await?;
        let row = sqlx::query(
            "SELECT certificate_fingerprint, session_instance_id, session_expires_at \
             FROM agents WHERE id = $1",
        )
        .bind(id_text(agent.0))
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let Some(row) = row else {
            return Ok(SessionOutcome::Revoked);
        };
        if row.text_opt("certificate_fingerprint")?.as_deref() != Some(certificate_fingerprint) {
            return Ok(SessionOutcome::Revoked);
        }
        let holder = row.text_opt("session_instance_id")?;
        let expires = row.time_opt("session_expires_at")?;
        if let (Some(holder), Some(expires)) = (holder, expires) {
            if holder != instance_id && expires > millis(now) {
                return Ok(SessionOutcome::Held {
                    holder_instance: holder,
                    lease_expires_at: expires,
                });
            }
        }
        let row = sqlx::query(
            "UPDATE agents SET generation = generation + 1, session_instance_id = $2, \
             session_expires_at = $3 WHERE id = $1 RETURNING generation, session_expires_at",
        )
        .bind(id_text(agent.0))
        .bind(instance_id)
        .bind(unix_millis(lease_expires_at))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let outcome = SessionOutcome::Acquired {
            generation: row.int("generation")?,
            lease_expires_at: row.time("session_expires_at")?,
        };
        tx.commit().await.map_err(db_error(OP))?;
        Ok(outcome)
    }

    async fn release_session(
        &self,
        agent: AgentId,
        generation: i64,
        _now: OffsetDateTime,
    ) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE agents SET session_instance_id = NULL, session_expires_at = NULL \
             WHERE id = $1 AND generation = $2 AND session_instance_id IS NOT NULL",
        )
        .bind(id_text(agent.0))
        .bind(generation)
        .execute(&self.write)
        .await
        .map_err(db_error("release session"))?;
        Ok(done.rows_affected() > 0)
    }

    async fn mark_agent_degraded(&self, agent: AgentId, _now: OffsetDateTime) -> Result<()> {
        // Like the staleness sweep, a status the server infers is not an edit: no `updated_at`.
        sqlx::query("UPDATE agents SET status = $1 WHERE id = $2")
            .bind(AgentStatus::Degraded.as_str())
            .bind(id_text(agent.0))
            .execute(&self.write)
            .await
            .map_err(db_error("mark agent degraded"))?;
        Ok(())
    }

    // --- tasks ---

    async fn create_task(&self, task: NewTask) -> Result<CreateTaskOutcome> {
        const OP: &str = "create task";
        let mut tx = self.begin_write(OP).await?;
        // Under the write lock a concurrent delete_agent either committed before (no agent) or
        // runs after (and expires this task).
        let agent_ok =
            sqlx::query("SELECT 1 AS found FROM agents WHERE id = $1 AND tenant_id = $2")
                .bind(id_text(task.agent_id.0))
                .bind(id_text(task.tenant_id.0))
                .fetch_optional(&mut *tx)
                .await
                .map_err(db_error(OP))?
                .is_some();
        if agent_ok {
            let inserted = sqlx::query(concat!(
                "INSERT INTO tasks (id, tenant_id, task_type, agent_id, payload, \
                 credentials_sealed, variables, timeout_seconds, priority, side_effects, \
                 idempotency_key, request_hash, read_back_of, state, created_at, updated_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, 'pending', \
                 $14, $14) \
                 ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL \
                 DO NOTHING RETURNING ",
                task_columns!()
            ))
            .bind(id_text(task.id.0))
            .bind(id_text(task.tenant_id.0))
            .bind(&task.task_type)
            .bind(id_text(task.agent_id.0))
            .bind(Json(&task.payload))
            .bind(&task.credentials_sealed)
            .bind(Json(&task.variables))
            .bind(i64::from(task.timeout_seconds))
            .bind(i64::from(task.priority))
            .bind(task.side_effects)
            .bind(&task.idempotency_key)
            .bind(&task.request_hash)
            .bind(task.read_back_of.map(|t| id_text(t.0)))
            .bind(unix_millis(task.created_at))
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            if let Some(row) = inserted {
                let created = rows::read_task(&row)?;
                tx.commit().await.map_err(db_error(OP))?;
                self.wake(created.agent_id);
                return Ok(CreateTaskOutcome::Created(created));
            }
        }
        // The key is taken.
        if let Some(key) = &task.idempotency_key {
            let existing = sqlx::query(concat!(
                "SELECT ",
                task_columns!(),
                " FROM tasks WHERE tenant_id = $1 AND idempotency_key = $2"
            ))
            .bind(id_text(task.tenant_id.0))
            .bind(key)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            if let Some(row) = existing {
                let same = row.text_opt("request_hash")? == task.request_hash;
                let existing = rows::read_task(&row)?;
                return Ok(if same {
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
    }

    async fn get_task(&self, tenant: TenantId, id: TaskId) -> Result<Option<(Task, Vec<Attempt>)>> {
        const OP: &str = "get task";
        let row = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = $1 AND id = $2"
        ))
        .bind(id_text(tenant.0))
        .bind(id_text(id.0))
        .fetch_optional(&self.read)
        .await
        .map_err(db_error(OP))?;
        let Some(row) = row else {
            return Ok(None);
        };
        let task = rows::read_task(&row)?;
        let attempts = sqlx::query(concat!(
            "SELECT ",
            attempt_columns!(),
            " FROM task_attempts WHERE task_id = $1 ORDER BY assigned_at, assignment_id"
        ))
        .bind(id_text(id.0))
        .fetch_all(&self.read)
        .await
        .map_err(db_error(OP))?
        .iter()
        .map(rows::read_attempt)
        .collect::<Result<Vec<_>>>()?;
        Ok(Some((task, attempts)))
    }

    async fn list_tasks(
        &self,
        tenant: TenantId,
        filter: &TaskFilter,
        after: Option<TaskId>,
        limit: u32,
    ) -> Result<Page<Task>> {
        let limit = limit.max(1);
        let mut query = QueryBuilder::<Sqlite>::new(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = "
        ));
        query.push_bind(id_text(tenant.0));
        if let Some(state) = filter.state {
            query.push(" AND state = ").push_bind(state.as_str());
        }
        if let Some(agent) = filter.agent_id {
            query.push(" AND agent_id = ").push_bind(id_text(agent.0));
        }
        if let Some(task_type) = &filter.task_type {
            query.push(" AND task_type = ").push_bind(task_type.clone());
        }
        fetch_page(
            &self.read,
            query,
            after.map(|id| id.0),
            limit,
            "list tasks",
            rows::read_task,
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
        // Most polls find nothing to claim. Answer those from a reader, so that thousands of
        // idle long-polls never queue on the single writer (and heartbeats behind them). The
        // same binding check runs again under the write lock before anything is leased.
        {
            let mut conn = self.read.acquire().await.map_err(db_error(OP))?;
            match check_binding(
                &mut conn,
                BINDING,
                agent,
                certificate_fingerprint,
                generation,
            )
            .await?
            {
                Binding::Current => {}
                Binding::Fenced => return Ok(ClaimOutcome::Fenced),
                Binding::Revoked => return Ok(ClaimOutcome::Revoked),
            }
            let open = sqlx::query(
                "SELECT 1 AS found FROM tasks WHERE agent_id = $1 \
                 AND state IN ('pending', 'retry_wait') LIMIT 1",
            )
            .bind(id_text(agent.0))
            .fetch_optional(&mut *conn)
            .await
            .map_err(db_error(OP))?;
            if open.is_none() {
                return Ok(ClaimOutcome::Empty);
            }
        }
        let mut tx = self.begin_write(OP).await?;
        // BEGIN IMMEDIATE serialises this with every other write, so the head read below is
        // still the head when it is leased.
        match check_binding(&mut tx, BINDING, agent, certificate_fingerprint, generation).await? {
            Binding::Current => {}
            Binding::Fenced => return Ok(ClaimOutcome::Fenced),
            Binding::Revoked => return Ok(ClaimOutcome::Revoked),
        }
        let head = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE agent_id = $1 AND state IN ('pending', 'retry_wait') \
             ORDER BY priority DESC, seq LIMIT 1"
        ))
        .bind(id_text(agent.0))
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_task(&row))
        .transpose()?;
        let Some(head) = head else {
            return Ok(ClaimOutcome::Empty);
        };
        let now = millis(now);
        if head.state == TaskState::RetryWait && head.next_attempt_at.is_some_and(|t| t > now) {
            return Ok(ClaimOutcome::Empty);
        }
        if head.side_effects {
            let busy = sqlx::query(
                "SELECT 1 AS found FROM tasks WHERE agent_id = $1 AND state = 'leased' \
                 AND side_effects LIMIT 1",
            )
            .bind(id_text(agent.0))
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            if busy.is_some() {
                return Ok(ClaimOutcome::Empty);
            }
        }
        let assignment = AssignmentId::new();
        let lease_expires_at = rows::lease_deadline(now, head.timeout_seconds, lease_grace);
        // Conditional: an operator may have cancelled the head since we read it.
        let claimed = sqlx::query(concat!(
            "UPDATE tasks SET state = 'leased', attempts = attempts + 1, \
             current_assignment = $2, lease_expires_at = $3, next_attempt_at = NULL, \
             updated_at = $4 WHERE id = $1 AND state IN ('pending', 'retry_wait') RETURNING ",
            task_columns!()
        ))
        .bind(id_text(head.id.0))
        .bind(id_text(assignment.0))
        .bind(unix_millis(lease_expires_at))
        .bind(unix_millis(now))
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let Some(claimed) = claimed else {
            return Ok(ClaimOutcome::Empty);
        };
        let task = rows::read_task(&claimed)?;
        let attempt = sqlx::query(concat!(
            "INSERT INTO task_attempts (assignment_id, task_id, agent_id, generation, state, \
             assigned_at, lease_expires_at) VALUES ($1, $2, $3, $4, 'leased', $5, $6) \
             RETURNING ",
            attempt_columns!()
        ))
        .bind(id_text(assignment.0))
        .bind(id_text(task.id.0))
        .bind(id_text(agent.0))
        .bind(generation)
        .bind(unix_millis(now))
        .bind(unix_millis(lease_expires_at))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let attempt = rows::read_attempt(&attempt)?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(ClaimOutcome::Claimed(task, attempt))
    }

    async fn pending_cancellations(&self, agent: AgentId) -> Result<Vec<(TaskId, AssignmentId)>> {
        sqlx::query(
            "SELECT id, current_assignment FROM tasks \
             WHERE agent_id = $1 AND state = 'leased' AND cancel_requested ORDER BY seq",
        )
        .bind(id_text(agent.0))
        .fetch_all(&self.read)
        .await
        .map_err(db_error("pending cancellations"))?
        .iter()
        .map(|row| {
            let assignment = row.uuid_opt("current_assignment")?.ok_or_else(|| {
                StoreError::Corrupt("tasks.current_assignment: leased without one".to_string())
            })?;
            Ok((TaskId(row.uuid("id")?), AssignmentId(assignment)))
        })
        .collect()
    }

    async fn complete_attempt(
        &self,
        completion: Completion,
        policy: &RetryPolicy,
    ) -> Result<CompleteOutcome> {
        const OP: &str = "complete attempt";
        let mut tx = self.begin_write(OP).await?;
        // The write lock (BEGIN IMMEDIATE) keeps the generation still until this commits.
        match check_binding(
            &mut tx,
            BINDING,
            completion.agent_id,
            &completion.certificate_fingerprint,
            completion.generation,
        )
        .await?
        {
            Binding::Current => {}
            Binding::Fenced => return Ok(CompleteOutcome::Fenced),
            Binding::Revoked => return Ok(CompleteOutcome::Revoked),
        }
        let task = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE id = $1 AND agent_id = $2"
        ))
        .bind(id_text(completion.task_id.0))
        .bind(id_text(completion.agent_id.0))
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_task(&row))
        .transpose()?;
        let Some(task) = task else {
            return Ok(CompleteOutcome::NotFound);
        };
        // Without an assignment id: the current delivery, or (for a duplicate) the last one.
        let attempt = match completion.assignment_id.or(task.current_assignment) {
            Some(assignment) => sqlx::query(concat!(
                "SELECT ",
                attempt_columns!(),
                " FROM task_attempts WHERE assignment_id = $1 AND task_id = $2"
            ))
            .bind(id_text(assignment.0))
            .bind(id_text(task.id.0)),
            None => sqlx::query(concat!(
                "SELECT ",
                attempt_columns!(),
                " FROM task_attempts WHERE task_id = $1 \
                 ORDER BY assigned_at DESC, assignment_id DESC LIMIT 1"
            ))
            .bind(id_text(task.id.0)),
        }
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_attempt(&row))
        .transpose()?;
        let Some(attempt) = attempt else {
            return Ok(CompleteOutcome::Fenced);
        };
        if attempt.state != AttemptState::Leased {
            return Ok(if attempt.envelope.as_ref() == Some(&completion.envelope) {
                CompleteOutcome::Duplicate(task)
            } else {
                CompleteOutcome::Fenced
            });
        }
        let now = millis(completion.now);
        // The lease is the proof window: a result after its deadline is refused even before
        // the sweep has moved the task, so "on time" never depends on the sweeper's pace.
        if task.state != TaskState::Leased
            || task.current_assignment != Some(attempt.assignment_id)
            || attempt.lease_expires_at < now
        {
            return Ok(CompleteOutcome::Fenced);
        }
        let next = rows::completion_transition(
            &completion.result,
            task.attempts,
            task.cancel_requested,
            policy,
            now,
        );
        sqlx::query(
            "UPDATE task_attempts SET state = $2, finished_at = $3, envelope = $4, \
             error_code = $5 WHERE assignment_id = $1",
        )
        .bind(id_text(attempt.assignment_id.0))
        .bind(next.attempt.as_str())
        .bind(unix_millis(now))
        .bind(Json(&completion.envelope))
        .bind(&next.error_code)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let row = sqlx::query(concat!(
            "UPDATE tasks SET state = $2, next_attempt_at = $3, \
             error_code = COALESCE($4, error_code), result = $5, current_assignment = NULL, \
             lease_expires_at = NULL, updated_at = $6, finished_at = $7 \
             WHERE id = $1 RETURNING ",
            task_columns!()
        ))
        .bind(id_text(task.id.0))
        .bind(next.state.as_str())
        .bind(next.next_attempt_at.map(unix_millis))
        .bind(&next.error_code)
        .bind(completion.result_data.as_ref().map(Json))
        .bind(unix_millis(now))
        .bind(next.finished_at.map(unix_millis))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let task = rows::read_task(&row)?;
        // The agent's queue may have unblocked (a side-effecting task ended, or the head moved).
        tx.commit().await.map_err(db_error(OP))?;
        self.wake(task.agent_id);
        Ok(CompleteOutcome::Recorded(task))
    }

    async fn cancel_task(
        &self,
        tenant: TenantId,
        id: TaskId,
        now: OffsetDateTime,
    ) -> Result<Option<CancelOutcome>> {
        const OP: &str = "cancel task";
        let now = millis(now);
        let mut tx = self.begin_write(OP).await?;
        let task = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = $1 AND id = $2"
        ))
        .bind(id_text(tenant.0))
        .bind(id_text(id.0))
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_task(&row))
        .transpose()?;
        let Some(task) = task else {
            return Ok(None);
        };
        let outcome = match task.state {
            TaskState::Pending | TaskState::RetryWait | TaskState::Unknown => {
                let task = sqlx::query(concat!(
                    "UPDATE tasks SET state = 'cancelled', next_attempt_at = NULL, \
                     finished_at = $2, updated_at = $2 WHERE id = $1 RETURNING ",
                    task_columns!()
                ))
                .bind(id_text(id.0))
                .bind(unix_millis(now))
                .fetch_one(&mut *tx)
                .await
                .map_err(db_error(OP))?;
                CancelOutcome::Cancelled(rows::read_task(&task)?)
            }
            TaskState::Leased => {
                let task = sqlx::query(concat!(
                    "UPDATE tasks SET cancel_requested = TRUE, updated_at = $2 \
                     WHERE id = $1 RETURNING ",
                    task_columns!()
                ))
                .bind(id_text(id.0))
                .bind(unix_millis(now))
                .fetch_one(&mut *tx)
                .await
                .map_err(db_error(OP))?;
                CancelOutcome::Requested(rows::read_task(&task)?)
            }
            _ => return Ok(Some(CancelOutcome::AlreadyFinished(task))),
        };
        // Wakes the agent's long-poll: a cancellation to deliver, or a queue head that moved.
        tx.commit().await.map_err(db_error(OP))?;
        self.wake(task.agent_id);
        Ok(Some(outcome))
    }

    async fn retry_task(
        &self,
        tenant: TenantId,
        id: TaskId,
        now: OffsetDateTime,
    ) -> Result<Option<RetryOutcome>> {
        const OP: &str = "retry task";
        let mut tx = self.begin_write(OP).await?;
        let task = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = $1 AND id = $2"
        ))
        .bind(id_text(tenant.0))
        .bind(id_text(id.0))
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_task(&row))
        .transpose()?;
        let Some(task) = task else {
            return Ok(None);
        };
        if !matches!(task.state, TaskState::Unknown | TaskState::DeadLetter) {
            return Ok(Some(RetryOutcome::NotRetriable(task)));
        }
        // A fresh attempt budget: the counter the policy compares with starts again.
        let row = sqlx::query(concat!(
            "UPDATE tasks SET state = 'pending', attempts = 0, next_attempt_at = NULL, \
             cancel_requested = FALSE, finished_at = NULL, updated_at = $2 \
             WHERE id = $1 RETURNING ",
            task_columns!()
        ))
        .bind(id_text(id.0))
        .bind(unix_millis(now))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let task = rows::read_task(&row)?;
        tx.commit().await.map_err(db_error(OP))?;
        self.wake(task.agent_id);
        Ok(Some(RetryOutcome::Requeued(task)))
    }

    async fn expire_leases(&self, now: OffsetDateTime, policy: &RetryPolicy) -> Result<LeaseSweep> {
        const OP: &str = "expire leases";
        let now = millis(now);
        let mut tx = self.begin_write(OP).await?;
        let expired = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE state = 'leased' AND lease_expires_at <= $1 \
             ORDER BY lease_expires_at"
        ))
        .bind(unix_millis(now))
        .fetch_all(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .iter()
        .map(rows::read_task)
        .collect::<Result<Vec<_>>>()?;
        let mut sweep = LeaseSweep::default();
        let mut agents = BTreeSet::new();
        for task in expired {
            let next = rows::expiry_transition(
                task.side_effects,
                task.attempts,
                task.cancel_requested,
                policy,
                now,
            );
            sqlx::query(
                "UPDATE task_attempts SET state = $2, finished_at = $3, error_code = $4 \
                 WHERE assignment_id = $1 AND state = 'leased'",
            )
            .bind(task.current_assignment.map(|a| id_text(a.0)))
            .bind(next.attempt.as_str())
            .bind(unix_millis(now))
            .bind(&next.error_code)
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            let row = sqlx::query(concat!(
                "UPDATE tasks SET state = $2, next_attempt_at = $3, \
                 error_code = COALESCE($4, error_code), current_assignment = NULL, \
                 lease_expires_at = NULL, updated_at = $5, finished_at = $6 \
                 WHERE id = $1 RETURNING ",
                task_columns!()
            ))
            .bind(id_text(task.id.0))
            .bind(next.state.as_str())
            .bind(next.next_attempt_at.map(unix_millis))
            .bind(&next.error_code)
            .bind(unix_millis(now))
            .bind(next.finished_at.map(unix_millis))
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            let task = rows::read_task(&row)?;
            agents.insert(task.agent_id);
            match task.state {
                TaskState::Unknown => sweep.unknown.push(task),
                TaskState::RetryWait => sweep.requeued.push(task),
                TaskState::DeadLetter => sweep.dead_lettered += 1,
                _ => {}
            }
        }
        tx.commit().await.map_err(db_error(OP))?;
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
        sqlx::query(concat!(
            "UPDATE tasks SET state = CASE WHEN $2 THEN 'succeeded' ELSE state END, \
             read_back = $2, result = $3, updated_at = $4, \
             finished_at = CASE WHEN $2 THEN $4 ELSE finished_at END \
             WHERE id = $1 AND state = 'unknown' RETURNING ",
            task_columns!()
        ))
        .bind(id_text(id.0))
        .bind(found)
        .bind(Json(&evidence))
        .bind(unix_millis(now))
        .fetch_optional(&self.write)
        .await
        .map_err(db_error("resolve read-back"))?
        .map(|row| rows::read_task(&row))
        .transpose()
    }

    fn task_events(&self) -> broadcast::Receiver<AgentId> {
        self.events.subscribe()
    }
}
