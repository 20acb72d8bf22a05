//! The PostgreSQL backend, for several `berth server` replicas on one database. Every
//! check-and-change is one conditional statement or a row lock inside one transaction; it must
//! never rely on a process-local lock, because other replicas do not share it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use berth_proto::agent::AgentStatus;
use berth_proto::{AgentId, AssignmentId, TaskId, TenantId};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnection, PgListener, PgPool, PgPoolOptions, PgRow};
use sqlx::types::Json;
use sqlx::{Postgres, QueryBuilder};
use time::OffsetDateTime;
use tokio::sync::{broadcast, oneshot};
use uuid::Uuid;

use crate::lifecycle;
use crate::rows::{
    self, agent_columns, attempt_columns, db_error, get, millis, task_columns, ColumnReader,
};
use crate::{
    Agent, AgentFilter, AgentUpdate, ApiToken, Attempt, CancelOutcome, ClaimOutcome,
    CompleteOutcome, Completion, CreateTaskOutcome, HeartbeatOutcome, HeartbeatRecord, LeaseSweep,
    NewAgent, NewApiToken, NewRegistrationToken, NewTask, Page, RegisterError, Result,
    RetryOutcome, RetryPolicy, SessionOutcome, StaleSweep, Store, StoreError, Task, TaskFilter,
    TaskState, Tenant,
};

static MIGRATOR: Migrator = sqlx::migrate!("./migrations/postgres");

const MAX_CONNECTIONS: u32 = 16;
/// The LISTEN/NOTIFY channel that carries "this agent has something to claim" across replicas.
const TASK_CHANNEL: &str = "berth_tasks";
const EVENT_CAPACITY: usize = 1024;
const LISTENER_BACKOFF_MAX: Duration = Duration::from_secs(30);

pub struct PostgresStore {
    pool: PgPool,
    /// Fed only by the listener task, so every replica's writes (ours included) arrive once.
    events: broadcast::Sender<AgentId>,
    /// Dropping the store drops this, which stops the listener task.
    _stop_listener: oneshot::Sender<()>,
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
        // LISTEN before returning, so no write after `connect` can go unnoticed.
        let listener = listen(&pool).await?;
        let (events, _) = broadcast::channel(EVENT_CAPACITY);
        let (stop, stopped) = oneshot::channel();
        tokio::spawn(forward_task_events(
            pool.clone(),
            listener,
            events.clone(),
            stopped,
        ));
        Ok(PostgresStore {
            pool,
            events,
            _stop_listener: stop,
        })
    }
}

async fn listen(pool: &PgPool) -> Result<PgListener> {
    let mut listener = PgListener::connect_with(pool)
        .await
        .map_err(db_error("listen for task events"))?;
    listener
        .listen(TASK_CHANNEL)
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
    mut stop: oneshot::Receiver<()>,
) {
    let wake_everyone = AgentId(Uuid::nil());
    loop {
        let received = tokio::select! {
            _ = &mut stop => return,
            received = listener.try_recv() => received,
        };
        match received {
            Ok(Some(notification)) => match notification.payload().parse::<Uuid>() {
                Ok(id) => {
                    // No receivers is not an error: nobody is long-polling right now.
                    let _ = events.send(AgentId(id));
                }
                Err(e) => tracing::warn!(error = %e, "ignoring a malformed berth_tasks payload"),
            },
            // The connection dropped and `try_recv` re-established it (and re-LISTENed).
            Ok(None) => {
                let _ = events.send(wake_everyone);
            }
            Err(e) => {
                tracing::warn!(error = %e, "task event listener failed; reconnecting");
                let mut backoff = Duration::from_millis(250);
                listener = loop {
                    tokio::select! {
                        _ = &mut stop => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    match listen(&pool).await {
                        Ok(listener) => break listener,
                        Err(e) => {
                            tracing::warn!(error = %e, "task event listener reconnect failed");
                            backoff = (backoff * 2).min(LISTENER_BACKOFF_MAX);
                        }
                    }
                };
                let _ = events.send(wake_everyone);
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

/// Ends a keyset-paged list query — rows after `after` in id order, at most `limit` — and
/// reads the page.
async fn fetch_page<T>(
    pool: &PgPool,
    mut query: QueryBuilder<'_, Postgres>,
    after: Option<Uuid>,
    limit: u32,
    operation: &'static str,
    read: fn(&PgRow) -> Result<T>,
    id: fn(&T) -> Uuid,
) -> Result<Page<T>> {
    if let Some(after) = after {
        query.push(" AND id > ").push_bind(after);
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
        fetch_page(
            &self.pool,
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
        const OP: &str = "delete agent";
        // The trait gives no clock here.
        let now = millis(OffsetDateTime::now_utc());
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        // The agent row first, like every other writer: its lock waits out claims, results and
        // task creations in flight, and those that come after find no agent.
        let done = sqlx::query("DELETE FROM agents WHERE tenant_id = $1 AND id = $2")
            .bind(tenant.0)
            .bind(id.0)
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
        .bind(tenant.0)
        .bind(id.0)
        .bind(now)
        .bind(lifecycle::AGENT_DELETED)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        // Tasks before their attempts, the lock order of every other writer.
        sqlx::query(
            "UPDATE task_attempts SET state = 'expired', finished_at = $2, error_code = $3 \
             WHERE agent_id = $1 AND state = 'leased'",
        )
        .bind(id.0)
        .bind(now)
        .bind(lifecycle::AGENT_DELETED)
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
        .bind(millis(new_expires_at))
        .bind(millis(now))
        .bind(id.0)
        .bind(old_fingerprint)
        .execute(&self.pool)
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
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        for i in rows::lock_order(batch) {
            let record = &batch[i];
            // Binding and generation are conditions of the update itself.
            let done = sqlx::query(
                "UPDATE agents SET reported_status = $1, \
                 status = CASE WHEN session_conflict_until > $2 THEN 'degraded' ELSE $1 END, \
                 last_heartbeat = $2, \
                 resource_usage = $3, capabilities = $4, updated_at = $2, \
                 session_expires_at = $7 \
                 WHERE id = $5 AND certificate_fingerprint = $6 AND generation = $8",
            )
            .bind(record.reported_status.as_str())
            .bind(millis(record.at))
            .bind(Json(&record.resource_usage))
            .bind(Json(&record.capabilities))
            .bind(record.agent_id.0)
            .bind(&record.certificate_fingerprint)
            .bind(millis(record.session_expires_at))
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
                .bind(record.agent_id.0)
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
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        let row = sqlx::query(
            "SELECT certificate_fingerprint, session_instance_id, session_expires_at \
             FROM agents WHERE id = $1 FOR NO KEY UPDATE",
        )
        .bind(agent.0)
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
             session_expires_at = $3, session_conflict_until = NULL WHERE id = $1 \
             RETURNING generation, session_expires_at",
        )
        .bind(agent.0)
        .bind(instance_id)
        .bind(millis(lease_expires_at))
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
        .bind(agent.0)
        .bind(generation)
        .execute(&self.pool)
        .await
        .map_err(db_error("release session"))?;
        Ok(done.rows_affected() > 0)
    }

    async fn mark_agent_degraded(&self, agent: AgentId, until: OffsetDateTime) -> Result<()> {
        // Like the staleness sweep, a status the server infers is not an edit: no `updated_at`.
        sqlx::query("UPDATE agents SET status = $1, session_conflict_until = $3 WHERE id = $2")
            .bind(AgentStatus::Degraded.as_str())
            .bind(agent.0)
            .bind(millis(until))
            .execute(&self.pool)
            .await
            .map_err(db_error("mark agent degraded"))?;
        Ok(())
    }

    // --- tasks ---

    async fn create_task(&self, task: NewTask) -> Result<CreateTaskOutcome> {
        const OP: &str = "create task";
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        // KEY SHARE conflicts only with deleting the agent: a concurrent delete_agent either
        // commits first (we see no agent) or waits for us (and then expires this task).
        let agent_ok = sqlx::query(
            "SELECT 1 AS found FROM agents WHERE id = $1 AND tenant_id = $2 FOR KEY SHARE",
        )
        .bind(task.agent_id.0)
        .bind(task.tenant_id.0)
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
            .bind(task.id.0)
            .bind(task.tenant_id.0)
            .bind(&task.task_type)
            .bind(task.agent_id.0)
            .bind(Json(&task.payload))
            .bind(&task.credentials_sealed)
            .bind(Json(&task.variables))
            .bind(i64::from(task.timeout_seconds))
            .bind(i64::from(task.priority))
            .bind(task.side_effects)
            .bind(&task.idempotency_key)
            .bind(&task.request_hash)
            .bind(task.read_back_of.map(|t| t.0))
            .bind(millis(task.created_at))
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            if let Some(row) = inserted {
                let created = rows::read_task(&row)?;
                notify(&mut tx, created.agent_id).await?;
                tx.commit().await.map_err(db_error(OP))?;
                return Ok(CreateTaskOutcome::Created(created));
            }
        }
        // The key is taken (ON CONFLICT waited for its writer to commit, so the row is visible).
        if let Some(key) = &task.idempotency_key {
            let existing = sqlx::query(concat!(
                "SELECT ",
                task_columns!(),
                " FROM tasks WHERE tenant_id = $1 AND idempotency_key = $2"
            ))
            .bind(task.tenant_id.0)
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
        .bind(tenant.0)
        .bind(id.0)
        .fetch_optional(&self.pool)
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
        .bind(id.0)
        .fetch_all(&self.pool)
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
        let mut query = QueryBuilder::<Postgres>::new(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = "
        ));
        query.push_bind(tenant.0);
        if let Some(state) = filter.state {
            query.push(" AND state = ").push_bind(state.as_str());
        }
        if let Some(agent) = filter.agent_id {
            query.push(" AND agent_id = ").push_bind(agent.0);
        }
        if let Some(task_type) = &filter.task_type {
            query.push(" AND task_type = ").push_bind(task_type.clone());
        }
        fetch_page(
            &self.pool,
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
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        // The exclusive agent-row lock serialises every claim for this agent across replicas:
        // strict order and "one side-effecting task at a time" are decisions over several rows,
        // which SKIP LOCKED on the task rows could not keep (it would hand out the second task
        // while the first is being claimed). Claims for different agents never wait on each other.
        match check_binding(
            &mut tx,
            BINDING_EXCLUSIVE,
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
        let head = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE agent_id = $1 AND state IN ('pending', 'retry_wait') \
             ORDER BY priority DESC, seq LIMIT 1"
        ))
        .bind(agent.0)
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
            .bind(agent.0)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            if busy.is_some() {
                return Ok(ClaimOutcome::Empty);
            }
        }
        let assignment = AssignmentId::new();
        let lease_expires_at = lifecycle::lease_deadline(now, head.timeout_seconds, lease_grace);
        // Conditional: an operator may have cancelled the head since we read it.
        let claimed = sqlx::query(concat!(
            "UPDATE tasks SET state = 'leased', attempts = attempts + 1, \
             current_assignment = $2, lease_expires_at = $3, next_attempt_at = NULL, \
             updated_at = $4 WHERE id = $1 AND state IN ('pending', 'retry_wait') RETURNING ",
            task_columns!()
        ))
        .bind(head.id.0)
        .bind(assignment.0)
        .bind(lease_expires_at)
        .bind(now)
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
        .bind(assignment.0)
        .bind(task.id.0)
        .bind(agent.0)
        .bind(generation)
        .bind(now)
        .bind(lease_expires_at)
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
        .bind(agent.0)
        .fetch_all(&self.pool)
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
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        // FOR SHARE: the generation cannot move (acquire_session waits) until this commits.
        match check_binding(
            &mut tx,
            BINDING_SHARE,
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
            " FROM tasks WHERE id = $1 AND agent_id = $2 FOR UPDATE"
        ))
        .bind(completion.task_id.0)
        .bind(completion.agent_id.0)
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
            .bind(assignment.0)
            .bind(task.id.0),
            None => sqlx::query(concat!(
                "SELECT ",
                attempt_columns!(),
                " FROM task_attempts WHERE task_id = $1 \
                 ORDER BY assigned_at DESC, assignment_id DESC LIMIT 1"
            ))
            .bind(task.id.0),
        }
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_attempt(&row))
        .transpose()?;
        let now = millis(completion.now);
        let attempt = match lifecycle::accept_completion(&task, attempt, &completion.envelope, now)
        {
            Ok(attempt) => attempt,
            Err(refused) => return Ok(refused.outcome(task)),
        };
        let next = lifecycle::completion_transition(
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
        .bind(attempt.assignment_id.0)
        .bind(next.attempt.as_str())
        .bind(now)
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
        .bind(task.id.0)
        .bind(next.state.as_str())
        .bind(next.next_attempt_at)
        .bind(&next.error_code)
        .bind(completion.result_data.as_ref().map(Json))
        .bind(now)
        .bind(next.finished_at)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let task = rows::read_task(&row)?;
        // The agent's queue may have unblocked (a side-effecting task ended, or the head moved).
        notify(&mut tx, task.agent_id).await?;
        tx.commit().await.map_err(db_error(OP))?;
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
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        let task = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = $1 AND id = $2 FOR UPDATE"
        ))
        .bind(tenant.0)
        .bind(id.0)
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
                .bind(id.0)
                .bind(now)
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
                .bind(id.0)
                .bind(now)
                .fetch_one(&mut *tx)
                .await
                .map_err(db_error(OP))?;
                CancelOutcome::Requested(rows::read_task(&task)?)
            }
            _ => return Ok(Some(CancelOutcome::AlreadyFinished(task))),
        };
        // Wakes the agent's long-poll: a cancellation to deliver, or a queue head that moved.
        notify(&mut tx, task.agent_id).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(Some(outcome))
    }

    async fn retry_task(
        &self,
        tenant: TenantId,
        id: TaskId,
        now: OffsetDateTime,
    ) -> Result<Option<RetryOutcome>> {
        const OP: &str = "retry task";
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        let task = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = $1 AND id = $2 FOR UPDATE"
        ))
        .bind(tenant.0)
        .bind(id.0)
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
        .bind(id.0)
        .bind(millis(now))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let task = rows::read_task(&row)?;
        notify(&mut tx, task.agent_id).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(Some(RetryOutcome::Requeued(task)))
    }

    async fn expire_leases(&self, now: OffsetDateTime, policy: &RetryPolicy) -> Result<LeaseSweep> {
        const OP: &str = "expire leases";
        let now = millis(now);
        let mut tx = self.pool.begin().await.map_err(db_error(OP))?;
        // SKIP LOCKED: a row another replica sweeps, or a result being recorded, is theirs; the
        // task is re-checked as leased under our lock, so nothing transitions twice.
        let expired = sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE state = 'leased' AND lease_expires_at <= $1 \
             ORDER BY lease_expires_at FOR UPDATE SKIP LOCKED"
        ))
        .bind(now)
        .fetch_all(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .iter()
        .map(rows::read_task)
        .collect::<Result<Vec<_>>>()?;
        let mut sweep = LeaseSweep::default();
        let mut agents = BTreeSet::new();
        for task in expired {
            let next = lifecycle::expiry_transition(
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
            .bind(task.current_assignment.map(|a| a.0))
            .bind(next.attempt.as_str())
            .bind(now)
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
            .bind(task.id.0)
            .bind(next.state.as_str())
            .bind(next.next_attempt_at)
            .bind(&next.error_code)
            .bind(now)
            .bind(next.finished_at)
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
        // A task leaving `leased` may unblock its agent's queue.
        for agent in agents {
            notify(&mut tx, agent).await?;
        }
        tx.commit().await.map_err(db_error(OP))?;
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
        .bind(id.0)
        .bind(found)
        .bind(Json(&evidence))
        .bind(millis(now))
        .fetch_optional(&self.pool)
        .await
        .map_err(db_error("resolve read-back"))?
        .map(|row| rows::read_task(&row))
        .transpose()
    }

    fn task_events(&self) -> broadcast::Receiver<AgentId> {
        self.events.subscribe()
    }
}
