//! Agents and their sessions on PostgreSQL.

use std::collections::BTreeMap;

use berth_proto::agent::AgentStatus;
use berth_proto::{AgentId, TenantId};
use sqlx::types::Json;
use sqlx::{Postgres, QueryBuilder};
use time::OffsetDateTime;

use super::audit::append;
use super::{check_binding, fetch_page, PostgresStore, BINDING_EXCLUSIVE};
use crate::domain::agents::hold_change;
use crate::domain::audit::admin_event;
use crate::lifecycle::{self, Binding};
use crate::rows::{self, agent_columns, db_error, millis, ColumnReader};
use crate::{
    Agent, AgentFilter, AgentHold, AgentStore, AgentUpdate, HeartbeatOutcome, HeartbeatRecord,
    NewAgent, Page, RebindOutcome, RegisterError, Result, SessionOutcome, StaleSweep,
};
use berth_proto::audit::actions::{AGENT_DELETE, AGENT_UPDATE};
use berth_proto::audit::AuditActor;
use serde_json::json;

#[async_trait::async_trait]
impl AgentStore for PostgresStore {
    async fn register_agent(
        &self,
        token_hash: &str,
        agent: NewAgent,
        now: OffsetDateTime,
    ) -> Result<std::result::Result<Agent, RegisterError>> {
        const OP: &str = "register agent";
        let mut tx = self.begin(OP).await?;
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
             VALUES ($1, $2, $3, $4, $5, $6, 'registered', 'registered', $7, $8, $9, $10, $10) \
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
        if let Ok(found) = self.batches.agent.run((tenant, id)).await? {
            return Ok(found);
        }
        sqlx::query(concat!(
            "SELECT ",
            agent_columns!(),
            " FROM agents WHERE tenant_id = $1 AND id = $2"
        ))
        .bind(tenant.0)
        .bind(id.0)
        .fetch_optional(&mut *self.conn().await?)
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
        .fetch_optional(&mut *self.conn().await?)
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
        match filter.status {
            None => {}
            Some(AgentStatus::Blocked) => {
                query.push(" AND suspended");
            }
            Some(status) => {
                query
                    .push(" AND NOT suspended AND status = ")
                    .push_bind(status.as_str());
            }
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
            &mut *self.conn().await?,
            query,
            crate::rows::PageRequest {
                after: after.map(|id| id.0),
                order: berth_proto::task::ListOrder::Oldest,
                limit,
            },
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
        const OP: &str = "update agent";
        let mut tx = self.begin(OP).await?;
        let agent = sqlx::query(concat!(
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
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_agent(&row))
        .transpose()?;
        if let (Some(actor), Some(_)) = (update.updated_by, &agent) {
            let details = json!({"labels": update.labels, "capabilities": update.capabilities});
            let event = admin_event(tenant, actor, AGENT_UPDATE, id, details, now);
            append(&mut tx, event).await?;
        }
        tx.commit().await.map_err(db_error(OP))?;
        Ok(agent)
    }

    async fn set_agent_hold(
        &self,
        tenant: TenantId,
        id: AgentId,
        hold: AgentHold,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<Agent>> {
        const OP: &str = "set agent hold";
        let (column, value, action) = hold_change(hold);
        let mut tx = self.begin(OP).await?;
        // FOR UPDATE, a key lock, not only the update's own NO KEY UPDATE: it conflicts with the
        // KEY SHARE a task creation holds on the agent from its read of `cordoned` to its commit
        // (`tasks.rs`, `task_batches.rs`). A creation that read the agent first commits before
        // this hold does; a later one waits for this commit, then reads the row's new version
        // (a locking read in READ COMMITTED follows the row's update). So once a cordon has
        // answered, no task lands on its agent. Heartbeats (NO KEY UPDATE) still never wait on
        // creations; holds are rare.
        sqlx::query("SELECT 1 FROM agents WHERE tenant_id = $1 AND id = $2 FOR UPDATE")
            .bind(tenant.0)
            .bind(id.0)
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
        let changed = sqlx::query(&format!(
            "UPDATE agents SET {column} = $1, updated_at = $2 \
             WHERE tenant_id = $3 AND id = $4 AND {column} <> $1 RETURNING {}",
            agent_columns!()
        ))
        .bind(value)
        .bind(millis(now))
        .bind(tenant.0)
        .bind(id.0)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_agent(&row))
        .transpose()?;
        let agent = match changed {
            Some(agent) => {
                let event = admin_event(tenant, actor, action, id, json!({}), now);
                append(&mut tx, event).await?;
                Some(agent)
            }
            None => sqlx::query(concat!(
                "SELECT ",
                agent_columns!(),
                " FROM agents WHERE tenant_id = $1 AND id = $2"
            ))
            .bind(tenant.0)
            .bind(id.0)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?
            .map(|row| rows::read_agent(&row))
            .transpose()?,
        };
        tx.commit().await.map_err(db_error(OP))?;
        Ok(agent)
    }

    async fn delete_agent(
        &self,
        tenant: TenantId,
        id: AgentId,
        actor: AuditActor,
        at: OffsetDateTime,
    ) -> Result<bool> {
        const OP: &str = "delete agent";
        let now = millis(at);
        let mut tx = self.begin(OP).await?;
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
        // The audit chain's lock last, as in every writer, so no two transactions wait on
        // each other's task rows and chain.
        let event = admin_event(tenant, actor, AGENT_DELETE, id, json!({}), at);
        append(&mut tx, event).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(true)
    }

    async fn rebind_certificate(
        &self,
        id: AgentId,
        generation: i64,
        old_fingerprint: &str,
        new_fingerprint: &str,
        new_expires_at: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<RebindOutcome> {
        const OP: &str = "rebind certificate";
        let mut tx = self.begin(OP).await?;
        // The row lock holds the generation and the binding until the rebind commits.
        match check_binding(&mut tx, BINDING_EXCLUSIVE, id, old_fingerprint, generation).await? {
            (Binding::Current, _) => {}
            (Binding::Fenced, _) => return Ok(RebindOutcome::Fenced),
            (Binding::Revoked, _) => return Ok(RebindOutcome::Revoked),
        }
        sqlx::query(
            "UPDATE agents SET certificate_fingerprint = $1, certificate_expires_at = $2, \
             updated_at = $3, previous_certificate_fingerprint = $5 WHERE id = $4",
        )
        .bind(new_fingerprint)
        .bind(millis(new_expires_at))
        .bind(millis(now))
        .bind(id.0)
        .bind(old_fingerprint)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(RebindOutcome::Rebound)
    }

    async fn record_heartbeats(&self, batch: &[HeartbeatRecord]) -> Result<Vec<HeartbeatOutcome>> {
        const OP: &str = "record heartbeats";
        let mut outcomes = vec![HeartbeatOutcome::Revoked; batch.len()];
        if batch.is_empty() {
            return Ok(outcomes);
        }
        // One transaction, one commit for the whole batch: that is the group commit.
        let mut tx = self.begin(OP).await?;
        for i in rows::lock_order(batch) {
            let record = &batch[i];
            // Binding and generation are conditions of the update itself.
            let done = sqlx::query(
                "UPDATE agents SET reported_status = $1, \
                 status = CASE WHEN session_conflict_until > $2 THEN 'degraded' ELSE $1 END, \
                 last_heartbeat = $2, \
                 resource_usage = $3, capabilities = $4, updated_at = $2, \
                 session_expires_at = $7, heartbeat_generation = $8, heartbeat_sequence = $9 \
                 WHERE id = $5 AND certificate_fingerprint = $6 AND generation = $8 \
                 AND (heartbeat_generation <> $8 OR heartbeat_sequence < $9)",
            )
            .bind(record.reported_status.as_str())
            .bind(millis(record.at))
            .bind(Json(&record.resource_usage))
            .bind(Json(&record.capabilities))
            .bind(record.agent_id.0)
            .bind(&record.certificate_fingerprint)
            .bind(millis(record.session_expires_at))
            .bind(record.generation)
            .bind(record.sequence)
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            outcomes[i] = if done.rows_affected() > 0 {
                HeartbeatOutcome::Applied
            } else {
                // Only says why the update was refused.
                let generation: Option<i64> = sqlx::query_scalar(
                    "SELECT generation FROM agents WHERE id = $1 AND certificate_fingerprint = $2",
                )
                .bind(record.agent_id.0)
                .bind(&record.certificate_fingerprint)
                .fetch_optional(&mut *tx)
                .await
                .map_err(db_error(OP))?;
                let bound = Some(record.certificate_fingerprint.as_str());
                match lifecycle::binding(
                    generation.map(|g| (bound, g)),
                    &record.certificate_fingerprint,
                    record.generation,
                ) {
                    Binding::Revoked => HeartbeatOutcome::Revoked,
                    Binding::Fenced => HeartbeatOutcome::Fenced,
                    Binding::Current => HeartbeatOutcome::Replayed,
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
        let mut tx = self.begin(OP).await?;
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
        restart_key: Option<&str>,
        now: OffsetDateTime,
        lease_expires_at: OffsetDateTime,
    ) -> Result<SessionOutcome> {
        const OP: &str = "acquire session";
        let mut tx = self.begin(OP).await?;
        let row = sqlx::query(
            "SELECT certificate_fingerprint, session_instance_id, session_expires_at, \
             session_restart_key FROM agents WHERE id = $1 FOR NO KEY UPDATE",
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
        let holder_key = row.text_opt("session_restart_key")?;
        if let (Some(holder), Some(expires)) = (holder, expires) {
            let restart = restart_key.is_some() && holder_key.as_deref() == restart_key;
            if holder != instance_id && expires > millis(now) && !restart {
                return Ok(SessionOutcome::Held {
                    holder_instance: holder,
                    lease_expires_at: expires,
                });
            }
        }
        let row = sqlx::query(
            "UPDATE agents SET generation = generation + 1, session_instance_id = $2, \
             session_expires_at = $3, session_restart_key = $4, \
             session_conflict_until = NULL WHERE id = $1 \
             RETURNING generation, session_expires_at",
        )
        .bind(agent.0)
        .bind(instance_id)
        .bind(millis(lease_expires_at))
        .bind(restart_key)
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
        .execute(&mut *self.conn().await?)
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
            .execute(&mut *self.conn().await?)
            .await
            .map_err(db_error("mark agent degraded"))?;
        Ok(())
    }

    async fn record_agent_version(
        &self,
        agent: AgentId,
        generation: i64,
        version: &str,
    ) -> Result<bool> {
        let done = sqlx::query(
            "UPDATE agents SET version = $3 WHERE id = $1 AND generation = $2 AND version <> $3",
        )
        .bind(agent.0)
        .bind(generation)
        .bind(version)
        .execute(&mut *self.conn().await?)
        .await
        .map_err(db_error("record agent version"))?;
        Ok(done.rows_affected() > 0)
    }
}
