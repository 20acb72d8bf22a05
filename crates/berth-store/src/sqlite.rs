//! The embedded SQLite backend: one file in WAL mode, one writer connection for every write,
//! and a pool of read-only connections. It must never write through the reader pool, and never
//! run a read-then-write that a single conditional statement can do.

use std::path::Path;
use std::time::Duration;

use berth_proto::agent::AgentStatus;
use berth_proto::{AgentId, TenantId};
use sqlx::migrate::Migrator;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::types::Json;
use sqlx::{QueryBuilder, Sqlite};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::rows::{self, agent_columns, db_error, get, unix_millis, ColumnReader};
use crate::{
    Agent, AgentFilter, AgentUpdate, ApiToken, HeartbeatRecord, NewAgent, NewApiToken,
    NewRegistrationToken, Page, RegisterError, Result, StaleSweep, Store, StoreError, Tenant,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/sqlite");

/// How long a connection waits for another process's write lock before failing with BUSY.
/// Within one process the single writer connection already serialises writes.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
const READERS: u32 = 4;

pub struct SqliteStore {
    /// Exactly one connection: SQLite admits one writer at a time, and queueing on the pool is
    /// fairer and cheaper than retrying SQLITE_BUSY.
    write: SqlitePool,
    /// Read-only connections; in WAL mode they never block the writer, nor it them.
    read: SqlitePool,
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
        let write = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(writer_options)
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
        Ok(SqliteStore { write, read })
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
        if let Some(after) = after {
            query.push(" AND id > ").push_bind(id_text(after.0));
        }
        query
            .push(" ORDER BY id LIMIT ")
            .push_bind(i64::from(limit));
        let items = query
            .build()
            .fetch_all(&self.read)
            .await
            .map_err(db_error("list agents"))?
            .iter()
            .map(rows::read_agent)
            .collect::<Result<Vec<_>>>()?;
        Ok(rows::page(items, limit))
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
        let done = sqlx::query("DELETE FROM agents WHERE tenant_id = $1 AND id = $2")
            .bind(id_text(tenant.0))
            .bind(id_text(id.0))
            .execute(&self.write)
            .await
            .map_err(db_error("delete agent"))?;
        Ok(done.rows_affected() > 0)
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

    async fn record_heartbeats(&self, batch: &[HeartbeatRecord]) -> Result<Vec<bool>> {
        const OP: &str = "record heartbeats";
        let mut applied = vec![false; batch.len()];
        if batch.is_empty() {
            return Ok(applied);
        }
        // One transaction, one commit for the whole batch: that is the group commit.
        let mut tx = self.begin_write(OP).await?;
        for i in rows::lock_order(batch) {
            let record = &batch[i];
            let done = sqlx::query(
                "UPDATE agents SET status = $1, reported_status = $1, last_heartbeat = $2, \
                 resource_usage = $3, capabilities = $4, updated_at = $2 \
                 WHERE id = $5 AND certificate_fingerprint = $6",
            )
            .bind(record.reported_status.as_str())
            .bind(unix_millis(record.at))
            .bind(Json(&record.resource_usage))
            .bind(Json(&record.capabilities))
            .bind(id_text(record.agent_id.0))
            .bind(&record.certificate_fingerprint)
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            applied[i] = done.rows_affected() > 0;
        }
        tx.commit().await.map_err(db_error(OP))?;
        Ok(applied)
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
}
