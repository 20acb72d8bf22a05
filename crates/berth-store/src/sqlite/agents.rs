//! Agents and their sessions on SQLite.

use berth_proto::agent::AgentStatus;
use berth_proto::{AgentId, TenantId};
use rusqlite::params;
use time::OffsetDateTime;

use super::audit::append;
use super::{binding, id_text, json_text, Query, SqliteStore};
use crate::domain::agents::hold_change;
use crate::domain::audit::admin_event;
use crate::lifecycle::{self, Binding};
use crate::rows::{self, agent_columns, millis, unix_millis, ColumnReader};
use crate::{
    Agent, AgentFilter, AgentHold, AgentStore, AgentUpdate, HeartbeatOutcome, HeartbeatRecord,
    NewAgent, Page, RebindOutcome, RegisterError, Result, SessionOutcome, StaleSweep, StoreError,
};
use berth_proto::audit::actions::{AGENT_DELETE, AGENT_UPDATE};
use berth_proto::audit::AuditActor;
use serde_json::json;

#[async_trait::async_trait]
impl AgentStore for SqliteStore {
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
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'registered', 'registered', ?7, ?8, ?9, ?10, \
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
        match filter.status {
            None => {}
            Some(AgentStatus::Blocked) => {
                query.push(" AND suspended");
            }
            Some(status) => {
                query
                    .push(" AND NOT suspended AND status = ")
                    .push_bind(status.as_str().to_string());
            }
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
            crate::rows::PageRequest {
                after: after.map(|id| id.0),
                order: berth_proto::task::ListOrder::Oldest,
                limit,
            },
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
        let details = json!({"labels": update.labels, "capabilities": update.capabilities});
        let by = update.updated_by;
        self.writer
            .write("update agent", move |tx| {
                let agent = tx.optional(
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
                )?;
                if let (Some(actor), Some(_)) = (by, &agent) {
                    let event = admin_event(tenant, actor, AGENT_UPDATE, id, details, now);
                    append(tx, event)?;
                }
                Ok(agent)
            })
            .await
    }

    async fn set_agent_hold(
        &self,
        tenant: TenantId,
        id: AgentId,
        hold: AgentHold,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<Agent>> {
        let (column, value, action) = hold_change(hold);
        self.writer
            .write("set agent hold", move |tx| {
                let changed = tx.optional(
                    &format!(
                        "UPDATE agents SET {column} = ?1, updated_at = ?2 \
                         WHERE tenant_id = ?3 AND id = ?4 AND {column} <> ?1 RETURNING {}",
                        agent_columns!()
                    ),
                    params![value, unix_millis(now), id_text(tenant.0), id_text(id.0)],
                    |row| rows::read_agent(row),
                )?;
                if let Some(agent) = changed {
                    let event = admin_event(tenant, actor, action, id, json!({}), now);
                    append(tx, event)?;
                    return Ok(Some(agent));
                }
                tx.optional(
                    concat!(
                        "SELECT ",
                        agent_columns!(),
                        " FROM agents WHERE tenant_id = ?1 AND id = ?2"
                    ),
                    params![id_text(tenant.0), id_text(id.0)],
                    |row| rows::read_agent(row),
                )
            })
            .await
    }

    async fn delete_agent(
        &self,
        tenant_id: TenantId,
        agent_id: AgentId,
        actor: AuditActor,
        at: OffsetDateTime,
    ) -> Result<bool> {
        let now = unix_millis(at);
        let (tenant, id) = (id_text(tenant_id.0), id_text(agent_id.0));
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
                let event = admin_event(tenant_id, actor, AGENT_DELETE, agent_id, json!({}), at);
                append(tx, event)?;
                Ok(true)
            })
            .await
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
        let (old, new) = (old_fingerprint.to_owned(), new_fingerprint.to_owned());
        self.writer
            .write("rebind certificate", move |tx| {
                match binding(tx, id, &old, generation)? {
                    Binding::Current => {}
                    Binding::Fenced => return Ok(RebindOutcome::Fenced),
                    Binding::Revoked => return Ok(RebindOutcome::Revoked),
                }
                tx.execute(
                    "UPDATE agents SET certificate_fingerprint = ?1, certificate_expires_at = ?2, \
                     updated_at = ?3, previous_certificate_fingerprint = ?5 WHERE id = ?4",
                    params![
                        new,
                        unix_millis(new_expires_at),
                        unix_millis(now),
                        id_text(id.0),
                        old,
                    ],
                )?;
                Ok(RebindOutcome::Rebound)
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
                record.sequence,
            ));
        }
        let len = batch.len();
        // One operation, so the whole batch shares one commit; unflushed, because liveness is
        // sent again every interval and must not cost a disk flush per heartbeat.
        self.writer
            .write_unflushed("record heartbeats", move |tx| {
                let mut outcomes = vec![HeartbeatOutcome::Revoked; len];
                for (
                    i,
                    status,
                    at,
                    usage,
                    capabilities,
                    agent,
                    fingerprint,
                    session,
                    generation,
                    sequence,
                ) in updates
                {
                    // Binding and generation are conditions of the update itself.
                    let applied = tx.execute(
                        "UPDATE agents SET reported_status = ?1, \
                         status = CASE WHEN session_conflict_until > ?2 THEN 'degraded' \
                         ELSE ?1 END, \
                         last_heartbeat = ?2, resource_usage = ?3, capabilities = ?4, \
                         updated_at = ?2, session_expires_at = ?7, \
                         heartbeat_generation = ?8, heartbeat_sequence = ?9 \
                         WHERE id = ?5 AND certificate_fingerprint = ?6 AND generation = ?8 \
                         AND (heartbeat_generation <> ?8 OR heartbeat_sequence < ?9)",
                        params![
                            status,
                            at,
                            usage,
                            capabilities,
                            agent,
                            fingerprint,
                            session,
                            generation,
                            sequence
                        ],
                    )?;
                    outcomes[i] = if applied > 0 {
                        HeartbeatOutcome::Applied
                    } else {
                        // Only says why the update was refused.
                        let current: Option<i64> = tx.optional(
                            "SELECT generation FROM agents \
                             WHERE id = ?1 AND certificate_fingerprint = ?2",
                            params![agent, fingerprint],
                            |row| row.int("generation"),
                        )?;
                        match lifecycle::binding(
                            current.map(|g| (Some(fingerprint.as_str()), g)),
                            &fingerprint,
                            generation,
                        ) {
                            Binding::Revoked => HeartbeatOutcome::Revoked,
                            Binding::Fenced => HeartbeatOutcome::Fenced,
                            Binding::Current => HeartbeatOutcome::Replayed,
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
        restart_key: Option<&str>,
        now: OffsetDateTime,
        lease_expires_at: OffsetDateTime,
    ) -> Result<SessionOutcome> {
        let (fingerprint, instance_id, restart_key) = (
            certificate_fingerprint.to_owned(),
            instance_id.to_owned(),
            restart_key.map(str::to_owned),
        );
        self.writer
            .write("acquire session", move |tx| {
                let row = tx.optional(
                    "SELECT certificate_fingerprint, session_instance_id, session_expires_at, \
                     session_restart_key FROM agents WHERE id = ?1",
                    [id_text(agent.0)],
                    |row| {
                        Ok((
                            row.text_opt("certificate_fingerprint")?,
                            row.text_opt("session_instance_id")?,
                            row.time_opt("session_expires_at")?,
                            row.text_opt("session_restart_key")?,
                        ))
                    },
                )?;
                let Some((bound, holder, expires, holder_key)) = row else {
                    return Ok(SessionOutcome::Revoked);
                };
                if bound.as_deref() != Some(fingerprint.as_str()) {
                    return Ok(SessionOutcome::Revoked);
                }
                if let (Some(holder), Some(expires)) = (holder, expires) {
                    let restart = restart_key.is_some() && holder_key == restart_key;
                    if holder != instance_id && expires > millis(now) && !restart {
                        return Ok(SessionOutcome::Held {
                            holder_instance: holder,
                            lease_expires_at: expires,
                        });
                    }
                }
                tx.one(
                    "UPDATE agents SET generation = generation + 1, session_instance_id = ?2, \
                     session_expires_at = ?3, session_restart_key = ?4, \
                     session_conflict_until = NULL WHERE id = ?1 \
                     RETURNING generation, session_expires_at",
                    params![
                        id_text(agent.0),
                        instance_id,
                        unix_millis(lease_expires_at),
                        restart_key
                    ],
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

    async fn record_agent_version(
        &self,
        agent: AgentId,
        generation: i64,
        version: &str,
    ) -> Result<bool> {
        let version = version.to_owned();
        self.writer
            .write("record agent version", move |tx| {
                let done = tx.execute(
                    "UPDATE agents SET version = ?3 WHERE id = ?1 AND generation = ?2 AND version <> ?3",
                    params![id_text(agent.0), generation, version],
                )?;
                Ok(done > 0)
            })
            .await
    }
}
