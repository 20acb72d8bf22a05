//! Tasks and their deliveries on PostgreSQL.

use berth_proto::{AgentId, AssignmentId, DeploymentId, TaskId, TenantId};
use sqlx::types::Json;
use sqlx::{Postgres, QueryBuilder};
use time::OffsetDateTime;
use tokio::sync::broadcast;

use super::completion::{decide_completion, Accepted};
use super::task_batches::ClaimRequest;
use super::{check_binding, fetch_page, PostgresStore, BINDING_EXCLUSIVE, BINDING_SHARE};
use crate::domain::audit::{task_created_event, task_event};
use crate::domain::tasks::READ_BACK_KEY_PREFIX;
use crate::lifecycle::{self, Binding};
use crate::rows::{self, attempt_columns, db_error, millis, task_columns, ColumnReader};
use crate::{
    Attempt, CancelOutcome, ClaimOutcome, CompleteOutcome, Completion, CreateTaskOutcome,
    LeaseSweep, NewTask, Page, PayloadKey, Result, RetryOutcome, RetryPolicy, StartAttempt,
    StartOutcome, StoreError, Task, TaskFilter, TaskState, TaskStore,
};
use berth_proto::audit::actions::{TASK_CANCEL, TASK_RETRY};
use berth_proto::audit::AuditActor;

#[async_trait::async_trait]
impl TaskStore for PostgresStore {
    async fn create_task(&self, task: NewTask) -> Result<CreateTaskOutcome> {
        // Decided in a batch with concurrent creations, unless the batch declines it: then
        // alone, here (`task_batches.rs`).
        let task = match self.batches.create.run(task).await? {
            Ok(outcome) => return Ok(outcome),
            Err(task) => task,
        };
        let tx = self.begin(CREATE_TASK).await?;
        create_in(self, tx, task, None).await
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
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error(OP))?;
        let Some(row) = row else {
            return Ok(None);
        };
        let task = rows::read_task(&row, &self.payload_key)?;
        let attempts = sqlx::query(concat!(
            "SELECT ",
            attempt_columns!(),
            " FROM task_attempts WHERE task_id = $1 ORDER BY assigned_at, assignment_id"
        ))
        .bind(id.0)
        .fetch_all(&mut *self.conn().await?)
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
            &mut *self.conn().await?,
            query,
            crate::rows::PageRequest {
                after: after.map(|id| id.0),
                order: filter.order,
                limit,
            },
            "list tasks",
            |row| rows::read_task(row, &self.payload_key),
            |t| t.id.0,
        )
        .await
    }

    async fn claim_task(
        &self,
        agent: AgentId,
        generation: i64,
        certificate_fingerprint: &str,
        capabilities: &[String],
        start_handshake: bool,
        now: OffsetDateTime,
        lease_grace: std::time::Duration,
    ) -> Result<ClaimOutcome> {
        let batched = self
            .batches
            .claim
            .run(ClaimRequest {
                agent,
                generation,
                certificate_fingerprint: certificate_fingerprint.to_string(),
                capabilities: capabilities.to_vec(),
                start_handshake,
                now,
                lease_grace,
            })
            .await?;
        if let Ok(outcome) = batched {
            return Ok(outcome);
        }
        const OP: &str = "claim task";
        // Most polls find nothing: answer those from one unlocked read, without a transaction.
        // A task or a resume that commits after this read wakes the poll through its event,
        // and a binding this read finds wrong is decided under the lock below.
        let probe = sqlx::query(
            "SELECT generation, certificate_fingerprint, suspended, EXISTS (SELECT 1 FROM tasks \
             WHERE agent_id = $1 AND state IN ('pending', 'retry_wait') \
               AND (next_attempt_at IS NULL OR next_attempt_at <= $2)) AS claimable \
             FROM agents WHERE id = $1",
        )
        .bind(agent.0)
        .bind(millis(now))
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error(OP))?;
        if let Some(row) = &probe {
            let bound = row.text_opt("certificate_fingerprint")?;
            let current = lifecycle::binding(
                Some((bound.as_deref(), row.int("generation")?)),
                certificate_fingerprint,
                generation,
            ) == Binding::Current;
            if current && (row.flag("suspended")? || !row.flag("claimable")?) {
                return Ok(ClaimOutcome::Empty);
            }
        }
        let mut tx = self.begin(OP).await?;
        // The exclusive agent-row lock serialises every claim for this agent across replicas:
        // strict order and "one side-effecting task at a time" are decisions over several rows,
        // which SKIP LOCKED on the task rows could not keep (it would hand out the second task
        // while the first is being claimed). Claims for different agents never wait on each other.
        // Under the row lock: a suspension commits before this claim or after it.
        let suspended = match check_binding(
            &mut tx,
            BINDING_EXCLUSIVE,
            agent,
            certificate_fingerprint,
            generation,
        )
        .await?
        {
            (Binding::Current, suspended) => suspended,
            (Binding::Fenced, _) => return Ok(ClaimOutcome::Fenced),
            (Binding::Revoked, _) => return Ok(ClaimOutcome::Revoked),
        };
        if !lifecycle::may_claim(suspended) {
            return Ok(ClaimOutcome::Empty);
        }
        let now = millis(now);
        // Every answer from here commits (once, below), so that a head failed as unrunnable
        // stays failed.
        let outcome = 'claim: {
            let head = loop {
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
                .map(|row| rows::read_task(&row, &self.payload_key))
                .transpose()?;
                let Some(head) = head else {
                    break 'claim ClaimOutcome::Empty;
                };
                let Some(code) = lifecycle::unrunnable(&head.task_type, capabilities) else {
                    break head;
                };
                sqlx::query(
                    "UPDATE tasks SET state = 'failed', error_code = $2, finished_at = $3, \
                 updated_at = $3 WHERE id = $1",
                )
                .bind(head.id.0)
                .bind(code)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(db_error(OP))?;
            };
            if head.state == TaskState::RetryWait && head.next_attempt_at.is_some_and(|t| t > now) {
                break 'claim ClaimOutcome::Empty;
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
                    break 'claim ClaimOutcome::Empty;
                }
            }
            let assignment = AssignmentId::new();
            let lease_expires_at =
                lifecycle::lease_deadline(now, head.timeout_seconds, lease_grace);
            let attempt = Attempt::leased(
                assignment,
                head.id,
                agent,
                generation,
                now,
                lease_expires_at,
                start_handshake,
            );
            // One statement: the task leased (conditional: an operator may have cancelled the
            // head since we read it) and, only then, its delivery, exactly as `attempt` says.
            let claimed = sqlx::query(concat!(
                "WITH claimed AS (UPDATE tasks SET state = 'leased', attempts = attempts + 1, \
                 current_assignment = $2, lease_expires_at = $3, next_attempt_at = NULL, \
                 updated_at = $4 WHERE id = $1 AND state IN ('pending', 'retry_wait') \
                 RETURNING *), \
                 delivery AS (INSERT INTO task_attempts (assignment_id, task_id, agent_id, \
                 generation, state, assigned_at, lease_expires_at, start_handshake) \
                 SELECT $2, id, $5, $6, $7, $4, $3, $8 FROM claimed) \
                 SELECT ",
                task_columns!(),
                " FROM claimed"
            ))
            .bind(head.id.0)
            .bind(attempt.assignment_id.0)
            .bind(attempt.lease_expires_at)
            .bind(attempt.assigned_at)
            .bind(agent.0)
            .bind(generation)
            .bind(attempt.state.as_str())
            .bind(attempt.start_handshake)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?;
            let Some(claimed) = claimed else {
                break 'claim ClaimOutcome::Empty;
            };
            ClaimOutcome::Claimed(rows::read_task(&claimed, &self.payload_key)?, attempt)
        };
        tx.commit().await.map_err(db_error(OP))?;
        Ok(outcome)
    }

    async fn open_task_counts(&self, agents: &[AgentId]) -> Result<Vec<(AgentId, i64)>> {
        let ids: Vec<uuid::Uuid> = agents.iter().map(|a| a.0).collect();
        let counted = sqlx::query(
            "SELECT agent_id, COUNT(*) AS n FROM tasks WHERE agent_id = ANY($1) \
             AND state IN ('pending', 'leased', 'retry_wait') GROUP BY agent_id",
        )
        .bind(&ids)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("open task counts"))?
        .iter()
        .map(|row| Ok((AgentId(row.uuid("agent_id")?), row.int("n")?)))
        .collect::<Result<std::collections::HashMap<_, _>>>()?;
        Ok(agents
            .iter()
            .map(|a| (*a, counted.get(a).copied().unwrap_or(0)))
            .collect())
    }

    async fn queued_tasks(&self, agent: AgentId, limit: u32) -> Result<Vec<Task>> {
        sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE agent_id = $1 AND state IN ('pending', 'retry_wait') \
             ORDER BY priority DESC, seq LIMIT $2"
        ))
        .bind(agent.0)
        .bind(i64::from(limit))
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("queued tasks"))?
        .iter()
        .map(|row| rows::read_task(row, &self.payload_key))
        .collect()
    }

    async fn pending_cancellations(&self, agent: AgentId) -> Result<Vec<(TaskId, AssignmentId)>> {
        if let Ok(found) = self.batches.cancellations.run(agent).await? {
            return Ok(found);
        }
        sqlx::query(
            "SELECT id, current_assignment FROM tasks \
             WHERE agent_id = $1 AND state = 'leased' AND cancel_requested ORDER BY seq",
        )
        .bind(agent.0)
        .fetch_all(&mut *self.conn().await?)
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

    async fn start_attempt(&self, start: StartAttempt) -> Result<StartOutcome> {
        const OP: &str = "start attempt";
        let mut tx = self.begin(OP).await?;
        // FOR SHARE: the generation cannot move until this commits.
        match check_binding(
            &mut tx,
            BINDING_SHARE,
            start.agent_id,
            &start.certificate_fingerprint,
            start.generation,
        )
        .await?
        {
            (Binding::Current, _) => {}
            (Binding::Fenced, _) => return Ok(StartOutcome::Fenced),
            (Binding::Revoked, _) => return Ok(StartOutcome::Revoked),
        }
        // The task row locked: the lease sweep locks it too, so a start and an expiry of one
        // delivery never interleave; whichever waits sees the other's outcome.
        let Some((task, attempt)) = locked_delivery(
            &mut tx,
            &self.payload_key,
            OP,
            start.agent_id,
            start.task_id,
            Some(start.assignment_id),
        )
        .await?
        else {
            return Ok(StartOutcome::NotFound);
        };
        let now = millis(start.now);
        let attempt = match attempt {
            Some(attempt) if lifecycle::is_live_lease(&task, &attempt, start.generation, now) => {
                attempt
            }
            _ => return Ok(StartOutcome::Fenced),
        };
        let row = sqlx::query(concat!(
            "UPDATE task_attempts SET started_at = COALESCE(started_at, $2), \
             phase = COALESCE($3, phase) WHERE assignment_id = $1 RETURNING ",
            attempt_columns!()
        ))
        .bind(attempt.assignment_id.0)
        .bind(now)
        .bind(start.phase.map(|p| p.as_str()))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let attempt = rows::read_attempt(&row)?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(StartOutcome::Started(attempt))
    }

    async fn complete_attempt(
        &self,
        completion: Completion,
        policy: &RetryPolicy,
    ) -> Result<CompleteOutcome> {
        let (completion, _) = match self
            .batches
            .complete
            .run((completion, policy.clone()))
            .await?
        {
            Ok(outcome) => return Ok(outcome),
            Err(declined) => declined,
        };
        const OP: &str = "complete attempt";
        let mut tx = self.begin(OP).await?;
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
            (Binding::Current, _) => {}
            (Binding::Fenced, _) => return Ok(CompleteOutcome::Fenced),
            (Binding::Revoked, _) => return Ok(CompleteOutcome::Revoked),
        }
        let Some((task, attempt)) = locked_delivery(
            &mut tx,
            &self.payload_key,
            OP,
            completion.agent_id,
            completion.task_id,
            completion.assignment_id,
        )
        .await?
        else {
            return Ok(CompleteOutcome::NotFound);
        };
        let Accepted {
            attempt,
            next,
            audit: (audit_tenant, audit_draft),
            now,
        } = match decide_completion(&task, attempt, &completion, policy)? {
            Ok(accepted) => accepted,
            Err(answer) => return Ok(answer),
        };
        // The attempt, the task and the `task.result` audit entry in one statement.
        let row = sqlx::query(concat!(
            "WITH attempt AS (UPDATE task_attempts SET state = $8, finished_at = $6, \
             envelope = $9, error_code = $4 WHERE assignment_id = $10), \
             audit AS (INSERT INTO audit_pending (tenant_id, draft) VALUES ($11, $12)) \
             UPDATE tasks SET state = $2, next_attempt_at = $3, \
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
        .bind(next.attempt.as_str())
        .bind(Json(&completion.envelope))
        .bind(attempt.assignment_id.0)
        .bind(audit_tenant.0)
        .bind(audit_draft)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let task = rows::read_task(&row, &self.payload_key)?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(CompleteOutcome::Recorded(task))
    }

    async fn cancel_task(
        &self,
        tenant: TenantId,
        id: TaskId,
        actor: AuditActor,
        at: OffsetDateTime,
    ) -> Result<Option<CancelOutcome>> {
        const OP: &str = "cancel task";
        let mut tx = self.begin(OP).await?;
        let Some(task) = locked_tenant_task(&mut tx, &self.payload_key, OP, tenant, id).await?
        else {
            return Ok(None);
        };
        let outcome = cancel_locked(&mut tx, &self.payload_key, OP, &task, actor, at).await?;
        if let CancelOutcome::AlreadyFinished(_) = outcome {
            return Ok(Some(outcome));
        }
        tx.commit().await.map_err(db_error(OP))?;
        self.wake(task.agent_id);
        Ok(Some(outcome))
    }

    async fn retry_task(
        &self,
        tenant: TenantId,
        id: TaskId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<RetryOutcome>> {
        const OP: &str = "retry task";
        let mut tx = self.begin(OP).await?;
        let Some(task) = locked_tenant_task(&mut tx, &self.payload_key, OP, tenant, id).await?
        else {
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
        let task = rows::read_task(&row, &self.payload_key)?;
        // The read-backs of the losses before the retry are history: their keys go, so a
        // delivery lost after it gets a read-back of its own.
        sqlx::query(
            "UPDATE tasks SET idempotency_key = NULL \
             WHERE read_back_of = $1 AND idempotency_key IS NOT NULL",
        )
        .bind(id.0)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        super::audit::append(&mut tx, task_event(TASK_RETRY, &task, actor, now)).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(Some(RetryOutcome::Requeued(task)))
    }

    async fn expire_leases(&self, now: OffsetDateTime, policy: &RetryPolicy) -> Result<LeaseSweep> {
        const OP: &str = "expire leases";
        let now = millis(now);
        let mut tx = self.begin(OP).await?;
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
        .map(|row| rows::read_task(row, &self.payload_key))
        .collect::<Result<Vec<_>>>()?;
        let mut sweep = LeaseSweep::default();
        for task in expired {
            let attempt = sqlx::query(concat!(
                "SELECT ",
                attempt_columns!(),
                " FROM task_attempts WHERE assignment_id = $1"
            ))
            .bind(task.current_assignment.map(|a| a.0))
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?
            .map(|row| rows::read_attempt(&row))
            .transpose()?;
            let next = lifecycle::expiry_transition(
                lifecycle::may_have_run(task.side_effects, attempt.as_ref()),
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
            let task = rows::read_task(&row, &self.payload_key)?;
            match task.state {
                TaskState::Unknown => sweep.unknown.push(task),
                TaskState::RetryWait => sweep.requeued.push(task),
                TaskState::DeadLetter => sweep.dead_lettered += 1,
                _ => {}
            }
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
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("resolve read-back"))?
        .map(|row| rows::read_task(&row, &self.payload_key))
        .transpose()
    }

    async fn prune_finished_tasks(&self, before: OffsetDateTime, limit: u32) -> Result<u64> {
        let done = sqlx::query(
            "DELETE FROM tasks WHERE id IN (\
               SELECT t.id FROM tasks t \
               WHERE t.state IN ('succeeded', 'failed', 'dead_letter', 'cancelled', 'expired') \
               AND t.finished_at < $1 \
               AND NOT EXISTS (SELECT 1 FROM tasks rb WHERE rb.read_back_of = t.id) \
               AND NOT EXISTS (SELECT 1 FROM tasks p \
                               WHERE p.id = t.read_back_of AND p.state = 'unknown' \
                               AND t.idempotency_key = \
                                   $3 || p.id::text || ':' || p.attempts::text) \
               ORDER BY t.finished_at LIMIT $2)",
        )
        .bind(millis(before))
        .bind(i64::from(limit))
        .bind(READ_BACK_KEY_PREFIX)
        .execute(&mut *self.conn().await?)
        .await
        .map_err(db_error("prune finished tasks"))?;
        Ok(done.rows_affected())
    }

    async fn unknown_without_read_back(
        &self,
        after: Option<TaskId>,
        limit: u32,
    ) -> Result<Vec<Task>> {
        sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks p WHERE p.state = 'unknown' AND ($1::uuid IS NULL OR p.id > $1) \
             AND EXISTS (SELECT 1 FROM agents a \
                         WHERE a.id = p.agent_id AND a.tenant_id = p.tenant_id) \
             AND NOT EXISTS (SELECT 1 FROM tasks rb \
                             WHERE rb.tenant_id = p.tenant_id \
                             AND rb.idempotency_key = \
                                 $3 || p.id::text || ':' || p.attempts::text) \
             ORDER BY p.id LIMIT $2"
        ))
        .bind(after.map(|id| id.0))
        .bind(i64::from(limit))
        .bind(READ_BACK_KEY_PREFIX)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("unknown tasks without read-back"))?
        .iter()
        .map(|row| rows::read_task(row, &self.payload_key))
        .collect()
    }

    async fn finished_read_backs_of_unknown(
        &self,
        after: Option<TaskId>,
        limit: u32,
    ) -> Result<Vec<Task>> {
        sqlx::query(concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE id IN ( \
                 SELECT rb.id FROM tasks p JOIN tasks rb \
                 ON rb.tenant_id = p.tenant_id \
                 AND rb.idempotency_key = $3 || p.id::text || ':' || p.attempts::text \
                 WHERE p.state = 'unknown' AND ($1::uuid IS NULL OR p.id > $1) \
                 AND rb.read_back_of = p.id AND rb.state = 'succeeded' \
                 AND (p.result ->> 'readBackTaskId') IS DISTINCT FROM rb.id::text \
                 ORDER BY p.id LIMIT $2) \
             ORDER BY read_back_of"
        ))
        .bind(after.map(|id| id.0))
        .bind(i64::from(limit))
        .bind(READ_BACK_KEY_PREFIX)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("finished read-backs of unknown tasks"))?
        .iter()
        .map(|row| rows::read_task(row, &self.payload_key))
        .collect()
    }

    fn task_events(&self) -> broadcast::Receiver<AgentId> {
        self.events.subscribe()
    }
}

/// The tenant's task `id`, its row locked `FOR UPDATE`.
async fn locked_tenant_task(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    key: &PayloadKey,
    op: &'static str,
    tenant: TenantId,
    id: TaskId,
) -> Result<Option<Task>> {
    sqlx::query(concat!(
        "SELECT ",
        task_columns!(),
        " FROM tasks WHERE tenant_id = $1 AND id = $2 FOR UPDATE"
    ))
    .bind(tenant.0)
    .bind(id.0)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db_error(op))?
    .map(|row| rows::read_task(&row, key))
    .transpose()
}

/// Cancels `task`, whose row `tx` holds locked: pending, retry_wait or unknown at once; leased
/// by request (the agent is told with its next poll); terminal unchanged. A change gets a
/// `task.cancel` entry by `actor`. The one place a cancellation is written (a task's own
/// cancel, and a deployment cancel's tasks for the targets it stops).
pub(super) async fn cancel_locked(
    tx: &mut sqlx::Transaction<'static, Postgres>,
    key: &PayloadKey,
    op: &'static str,
    task: &Task,
    actor: AuditActor,
    at: OffsetDateTime,
) -> Result<CancelOutcome> {
    let now = millis(at);
    let outcome = match task.state {
        TaskState::Pending | TaskState::RetryWait | TaskState::Unknown => {
            let task = sqlx::query(concat!(
                "UPDATE tasks SET state = 'cancelled', next_attempt_at = NULL, \
                 finished_at = $2, updated_at = $2 WHERE id = $1 RETURNING ",
                task_columns!()
            ))
            .bind(task.id.0)
            .bind(now)
            .fetch_one(&mut **tx)
            .await
            .map_err(db_error(op))?;
            CancelOutcome::Cancelled(rows::read_task(&task, key)?)
        }
        TaskState::Leased => {
            let task = sqlx::query(concat!(
                "UPDATE tasks SET cancel_requested = TRUE, updated_at = $2 \
                 WHERE id = $1 RETURNING ",
                task_columns!()
            ))
            .bind(task.id.0)
            .bind(now)
            .fetch_one(&mut **tx)
            .await
            .map_err(db_error(op))?;
            CancelOutcome::Requested(rows::read_task(&task, key)?)
        }
        _ => return Ok(CancelOutcome::AlreadyFinished(task.clone())),
    };
    if let CancelOutcome::Cancelled(task) | CancelOutcome::Requested(task) = &outcome {
        super::audit::append(tx, task_event(TASK_CANCEL, task, actor, at)).await?;
    }
    Ok(outcome)
}

/// The agent's task, its row locked `FOR UPDATE`, with the delivery `assignment` names; without
/// one, the task's current delivery, or (for a duplicate result) its last. `None`: no such task
/// for this agent.
async fn locked_delivery(
    tx: &mut sqlx::Transaction<'_, Postgres>,
    key: &PayloadKey,
    op: &'static str,
    agent: AgentId,
    task: TaskId,
    assignment: Option<AssignmentId>,
) -> Result<Option<(Task, Option<Attempt>)>> {
    let task = sqlx::query(concat!(
        "SELECT ",
        task_columns!(),
        " FROM tasks WHERE id = $1 AND agent_id = $2 FOR UPDATE"
    ))
    .bind(task.0)
    .bind(agent.0)
    .fetch_optional(&mut **tx)
    .await
    .map_err(db_error(op))?
    .map(|row| rows::read_task(&row, key))
    .transpose()?;
    let Some(task) = task else {
        return Ok(None);
    };
    let attempt = match assignment.or(task.current_assignment) {
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
    .fetch_optional(&mut **tx)
    .await
    .map_err(db_error(op))?
    .map(|row| rows::read_attempt(&row))
    .transpose()?;
    Ok(Some((task, attempt)))
}

/// The name of a single create's transaction.
const CREATE_TASK: &str = "create task";

/// A create outside a batch, in `tx` (which it commits when it inserts): the agent's cordon and
/// queue cap (`lifecycle::admit`), the idempotency key, the audit entry. `deployment` is
/// recorded on the row ([`crate::DeploymentStore::create_deployment_task`] checked it in `tx`).
pub(super) async fn create_in(
    store: &PostgresStore,
    mut tx: sqlx::Transaction<'static, Postgres>,
    task: NewTask,
    deployment: Option<DeploymentId>,
) -> Result<CreateTaskOutcome> {
    const OP: &str = CREATE_TASK;
    // KEY SHARE conflicts with deleting the agent and with a hold (`set_agent_hold` locks the
    // row FOR UPDATE), never with heartbeats: a concurrent delete_agent or cordon either
    // commits first (we see no agent, or `cordoned` already set: the locking read returns the
    // row's newest version) or waits for this create to commit.
    let cordoned =
        sqlx::query("SELECT cordoned FROM agents WHERE id = $1 AND tenant_id = $2 FOR KEY SHARE")
            .bind(task.agent_id.0)
            .bind(task.tenant_id.0)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error(OP))?
            .map(|row| row.flag("cordoned"))
            .transpose()?;
    let agent_ok = cordoned.is_some();
    let refused = match cordoned {
        None => None,
        Some(cordoned) => {
            let open = match lifecycle::queue_cap(&task) {
                None => None,
                Some(_) => {
                    // Creates for one agent take turns from here to their commit, so each
                    // count (a fresh snapshot, after the lock) sees every task inserted
                    // before it. An advisory lock, not the agent row's: a row lock strong
                    // enough would also queue the agent's heartbeats behind creates.
                    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('berth.queue:' || $1::text, 0))")
                        .bind(task.agent_id.0)
                        .execute(&mut *tx)
                        .await
                        .map_err(db_error(OP))?;
                    let n: i64 = sqlx::query_scalar(&format!(
                        "SELECT COUNT(*) FROM tasks WHERE agent_id = $1 AND state IN {}",
                        lifecycle::OPEN_STATES_SQL
                    ))
                    .bind(task.agent_id.0)
                    .fetch_one(&mut *tx)
                    .await
                    .map_err(db_error(OP))?;
                    Some(u64::try_from(n).unwrap_or(0))
                }
            };
            lifecycle::admit(&task, cordoned, open).err()
        }
    };
    if agent_ok && refused.is_none() {
        let inserted = sqlx::query(concat!(
            "INSERT INTO tasks (id, tenant_id, task_type, agent_id, payload, \
             credentials_sealed, variables, timeout_seconds, priority, side_effects, \
             idempotency_key, request_hash, read_back_of, state, created_at, updated_at, \
             deployment_id) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, 'pending', \
             $14, $14, $15) \
             ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL \
             DO NOTHING RETURNING ",
            task_columns!()
        ))
        .bind(task.id.0)
        .bind(task.tenant_id.0)
        .bind(&task.task_type)
        .bind(task.agent_id.0)
        .bind(Json(store.payload_key.seal(task.id, &task.payload)?))
        .bind(&task.credentials_sealed)
        .bind(Json(&task.variables))
        .bind(i64::from(task.timeout_seconds))
        .bind(i64::from(task.priority))
        .bind(task.side_effects)
        .bind(&task.idempotency_key)
        .bind(&task.request_hash)
        .bind(task.read_back_of.map(|t| t.0))
        .bind(millis(task.created_at))
        .bind(deployment.map(|d| d.0))
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        if let Some(row) = inserted {
            let created = rows::read_task(&row, &store.payload_key)?;
            if let Some(actor) = task.created_by.clone() {
                let event = task_created_event(&task, actor);
                super::audit::append(&mut tx, event).await?;
            }
            tx.commit().await.map_err(db_error(OP))?;
            store.wake(created.agent_id);
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
            let existing = rows::read_task(&row, &store.payload_key)?;
            return Ok(if same {
                CreateTaskOutcome::Existing(existing)
            } else {
                CreateTaskOutcome::KeyConflict
            });
        }
    }
    if let Some(refused) = refused {
        return Ok(refused.outcome());
    }
    Err(StoreError::Conflict {
        constraint: if agent_ok {
            "task_idempotency_key"
        } else {
            "task_agent"
        },
    })
}
