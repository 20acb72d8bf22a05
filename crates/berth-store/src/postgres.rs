//! The PostgreSQL backend, for several `berth server` replicas on one database. Every
//! check-and-change is one conditional statement or a row lock inside one transaction; it must
//! never rely on a process-local lock, because other replicas do not share it.

use std::collections::BTreeMap;

use berth_proto::agent::AgentStatus;
use berth_proto::{AgentId, TenantId};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgPool, PgPoolOptions, PgRow};
use sqlx::types::Json;
use sqlx::{Postgres, QueryBuilder};
use time::OffsetDateTime;
use uuid::Uuid;

use crate::rows::{self, agent_columns, db_error, get, millis, ColumnReader};
use crate::{
    Agent, AgentFilter, AgentUpdate, ApiToken, HeartbeatRecord, NewAgent, NewApiToken,
    NewRegistrationToken, Page, RegisterError, Result, StaleSweep, Store, StoreError, Tenant,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

const MAX_CONNECTIONS: u32 = 16;

pub struct PostgresStore {
    pool: PgPool,
}

impl PostgresStore {
    /// Connects and runs the migrations (sqlx serialises concurrent migrators across replicas
    /// with an advisory lock).
    pub async fn connect(url: &str) -> Result<PostgresStore> {
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            .connect(url)
            .await
            .map_err(db_error("connect to postgres"))?;
        MIGRATOR.run(&pool).await.map_err(StoreError::Migrate)?;
        Ok(PostgresStore { pool })
    }
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

    async fn ensure_tenant(&self, name: &str, now: OffsetDateTime) -> Result<Tenant> {
        // Under READ COMMITTED the SELECT sees the row a concurrent winner committed, so two
        // replicas bootstrapping at once end up with the same tenant.
        sqlx::query(
            "INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(TenantId::new().0)
        .bind(name)
        .bind(millis(now))
        .execute(&self.pool)
        .await
        .map_err(db_error("ensure tenant"))?;
        let row = sqlx::query("SELECT id, name, created_at FROM tenants WHERE name = $1")
            .bind(name)
            .fetch_one(&self.pool)
            .await
            .map_err(db_error("ensure tenant"))?;
        rows::read_tenant(&row)
    }

    async fn create_tenant(&self, id: TenantId, name: &str, now: OffsetDateTime) -> Result<Tenant> {
        let row = sqlx::query(
            "INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3) \
             RETURNING id, name, created_at",
        )
        .bind(id.0)
        .bind(name)
        .bind(millis(now))
        .fetch_one(&self.pool)
        .await
        .map_err(db_error("create tenant"))?;
        rows::read_tenant(&row)
    }

    async fn get_tenant(&self, id: TenantId) -> Result<Option<Tenant>> {
        sqlx::query("SELECT id, name, created_at FROM tenants WHERE id = $1")
            .bind(id.0)
            .fetch_optional(&self.pool)
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
        .bind(token.id.0)
        .bind(token.tenant_id.0)
        .bind(&token.name)
        .bind(token.role.as_str())
        .bind(token.operator)
        .bind(&token.token_hash)
        .bind(millis(token.created_at))
        .fetch_one(&self.pool)
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
        .fetch_optional(&self.pool)
        .await
        .map_err(db_error("look up api token"))?
        .map(|row| rows::read_api_token(&row))
        .transpose()
    }

    async fn has_operator_token(&self, tenant: TenantId) -> Result<bool> {
        let row = sqlx::query(
            "SELECT EXISTS (SELECT 1 FROM api_tokens WHERE tenant_id = $1 AND operator) AS found",
        )
        .bind(tenant.0)
        .fetch_one(&self.pool)
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
        .bind(token.id.0)
        .bind(token.tenant_id.0)
        .bind(&token.token_hash)
        .bind(Json(&token.labels))
        .bind(&token.environment)
        .bind(millis(token.expires_at))
        .bind(millis(token.created_at))
        .execute(&self.pool)
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
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        // The row lock taken here holds concurrent consumers until this transaction ends; they
        // then re-check `used_at IS NULL` and find nothing, or take the token after a rollback.
        let consumed = sqlx::query(
            "UPDATE registration_tokens SET used_at = $1 \
             WHERE token_hash = $2 AND used_at IS NULL AND expires_at > $1 \
             RETURNING tenant_id, labels, environment",
        )
        .bind(millis(now))
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
        .bind(agent.id.0)
        .bind(token.tenant_id.0)
        .bind(&agent.name)
        .bind(&agent.version)
        .bind(Json(&agent.capabilities))
        .bind(Json(&labels))
        .bind(&token.environment)
        .bind(&agent.certificate_fingerprint)
        .bind(millis(agent.certificate_expires_at))
        .bind(millis(agent.created_at))
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
        .bind(tenant.0)
        .bind(id.0)
        .fetch_optional(&self.pool)
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
        .bind(id.0)
        .fetch_optional(&self.pool)
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
        let mut query = QueryBuilder::<Postgres>::new(concat!(
            "SELECT ",
            agent_columns!(),
            " FROM agents WHERE tenant_id = "
        ));
        query.push_bind(tenant.0);
        if let Some(status) = filter.status {
            query.push(" AND status = ").push_bind(status.as_str());
        }
        // Containment (`@>`) is what the GIN indexes answer.
        if let Some(capability) = &filter.capability {
            let probe = serde_json::json!([{ "name": capability }]);
            query.push(" AND capabilities @> ").push_bind(Json(probe));
        }
        if let Some((key, value)) = &filter.label {
            let probe = BTreeMap::from([(key.clone(), value.clone())]);
            query.push(" AND labels @> ").push_bind(Json(probe));
        }
        if let Some(after) = after {
            query.push(" AND id > ").push_bind(after.0);
        }
        query
            .push(" ORDER BY id LIMIT ")
            .push_bind(i64::from(limit));
        let items = query
            .build()
            .fetch_all(&self.pool)
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
        .bind(millis(now))
        .bind(tenant.0)
        .bind(id.0)
        .fetch_optional(&self.pool)
        .await
        .map_err(db_error("update agent"))?
        .map(|row| rows::read_agent(&row))
        .transpose()
    }

    async fn delete_agent(&self, tenant: TenantId, id: AgentId) -> Result<bool> {
        let done = sqlx::query("DELETE FROM agents WHERE tenant_id = $1 AND id = $2")
            .bind(tenant.0)
            .bind(id.0)
            .execute(&self.pool)
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
        .bind(millis(new_expires_at))
        .bind(millis(now))
        .bind(id.0)
        .bind(old_fingerprint)
        .execute(&self.pool)
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
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        for i in rows::lock_order(batch) {
            let record = &batch[i];
            let done = sqlx::query(
                "UPDATE agents SET status = $1, reported_status = $1, last_heartbeat = $2, \
                 resource_usage = $3, capabilities = $4, updated_at = $2 \
                 WHERE id = $5 AND certificate_fingerprint = $6",
            )
            .bind(record.reported_status.as_str())
            .bind(millis(record.at))
            .bind(Json(&record.resource_usage))
            .bind(Json(&record.capabilities))
            .bind(record.agent_id.0)
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
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        // Rows are locked in id order, like heartbeat batches, so the two cannot deadlock; a row
        // a heartbeat holds right now is skipped, since it is evidently not stale.
        // Offline first, so an agent late enough for both is counted once, as offline.
        // `updated_at` is left alone: lateness is not an edit, and the sweep has no clock.
        let offline = sqlx::query(
            "UPDATE agents SET status = $1 WHERE id IN ( \
                 SELECT id FROM agents WHERE status <> $1 \
                 AND (last_heartbeat < $2 OR (last_heartbeat IS NULL AND created_at < $2)) \
                 ORDER BY id FOR UPDATE SKIP LOCKED)",
        )
        .bind(AgentStatus::Offline.as_str())
        .bind(millis(offline_before))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .rows_affected();
        let degraded = sqlx::query(
            "UPDATE agents SET status = $1 WHERE id IN ( \
                 SELECT id FROM agents WHERE status = $2 AND last_heartbeat < $3 \
                 ORDER BY id FOR UPDATE SKIP LOCKED)",
        )
        .bind(AgentStatus::Degraded.as_str())
        .bind(AgentStatus::Online.as_str())
        .bind(millis(degraded_before))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .rows_affected();
        tx.commit().await.map_err(db_error(OP))?;
        Ok(StaleSweep { degraded, offline })
    }
}
