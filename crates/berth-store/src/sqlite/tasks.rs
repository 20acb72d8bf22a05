//! Tasks and their deliveries on SQLite.

use std::collections::BTreeSet;

use berth_proto::{AgentId, AssignmentId, DeploymentId, TaskId, TenantId};
use rusqlite::params;
use time::OffsetDateTime;
use tokio::sync::broadcast;

use super::threads::Db;
use super::{binding, id_text, json_text, Query, SqliteStore};
use crate::domain::audit::{result_event, task_created_event, task_event};
use crate::domain::tasks::READ_BACK_KEY_PREFIX;
use crate::lifecycle::{self, Binding};
use crate::rows::{self, attempt_columns, millis, task_columns, unix_millis, ColumnReader};
use crate::{
    Attempt, CancelOutcome, ClaimOutcome, CompleteOutcome, Completion, CreateTaskOutcome,
    LeaseSweep, NewTask, Page, PayloadKey, Result, RetryOutcome, RetryPolicy, StartAttempt,
    StartOutcome, StoreError, Task, TaskFilter, TaskState, TaskStore,
};
use berth_proto::audit::actions::{TASK_CANCEL, TASK_RETRY};
use berth_proto::audit::AuditActor;

/// The tenant's task `id`, if it has one.
/// The agent's task with the delivery `assignment` names; without one, the task's current
/// delivery, or (for a duplicate result) its last. `None`: no such task for this agent.
fn agent_delivery(
    db: &Db<'_>,
    key: &PayloadKey,
    agent: AgentId,
    task: TaskId,
    assignment: Option<AssignmentId>,
) -> Result<Option<(Task, Option<Attempt>)>> {
    let task = db.optional(
        concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE id = ?1 AND agent_id = ?2"
        ),
        params![id_text(task.0), id_text(agent.0)],
        |row| rows::read_task(row, key),
    )?;
    let Some(task) = task else {
        return Ok(None);
    };
    let attempt = match assignment.or(task.current_assignment) {
        Some(assignment) => db.optional(
            concat!(
                "SELECT ",
                attempt_columns!(),
                " FROM task_attempts WHERE assignment_id = ?1 AND task_id = ?2"
            ),
            params![id_text(assignment.0), id_text(task.id.0)],
            |row| rows::read_attempt(row),
        )?,
        None => db.optional(
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
    Ok(Some((task, attempt)))
}

/// Whether the agent is suspended (an agent that is gone is not; the binding check says so).
fn suspended(db: &Db<'_>, agent: AgentId) -> Result<bool> {
    Ok(db
        .optional(
            "SELECT suspended FROM agents WHERE id = ?1",
            [id_text(agent.0)],
            |row| row.flag("suspended"),
        )?
        .unwrap_or(false))
}

fn tenant_task(
    db: &Db<'_>,
    key: &PayloadKey,
    tenant: TenantId,
    id: TaskId,
) -> Result<Option<Task>> {
    db.optional(
        concat!(
            "SELECT ",
            task_columns!(),
            " FROM tasks WHERE tenant_id = ?1 AND id = ?2"
        ),
        [id_text(tenant.0), id_text(id.0)],
        |row| rows::read_task(row, key),
    )
}

/// A create in the writer's transaction `tx`: the agent's cordon and queue cap
/// (`lifecycle::admit`), the idempotency key, the audit entry. `payload` and `variables` are
/// the columns' text; `deployment` is recorded on the row
/// ([`crate::DeploymentStore::create_deployment_task`] checked it in `tx`).
pub(super) fn create_in(
    tx: &Db<'_>,
    key: &PayloadKey,
    task: &NewTask,
    payload: String,
    variables: String,
    deployment: Option<DeploymentId>,
) -> Result<CreateTaskOutcome> {
    // The writer runs one operation at a time: a delete_agent either ran before
    // (no agent) or runs after (and expires this task), and no other create counts
    // the agent's open tasks between this count and the insert.
    let cordoned = tx.optional(
        "SELECT cordoned FROM agents WHERE id = ?1 AND tenant_id = ?2",
        params![id_text(task.agent_id.0), id_text(task.tenant_id.0)],
        |row| row.flag("cordoned"),
    )?;
    let agent_ok = cordoned.is_some();
    let refused = match cordoned {
        None => None,
        Some(cordoned) => {
            let open = match lifecycle::queue_cap(task) {
                None => None,
                Some(_) => Some(tx.one(
                    &format!(
                        "SELECT COUNT(*) AS n FROM tasks WHERE agent_id = ?1 \
                         AND state IN {}",
                        lifecycle::OPEN_STATES_SQL
                    ),
                    [id_text(task.agent_id.0)],
                    |row| row.int("n"),
                )?),
            };
            let open = open.map(|n| u64::try_from(n).unwrap_or(0));
            lifecycle::admit(task, cordoned, open).err()
        }
    };
    if agent_ok && refused.is_none() {
        let inserted = tx.optional(
            concat!(
                "INSERT INTO tasks (id, tenant_id, task_type, agent_id, payload, \
                 credentials_sealed, variables, timeout_seconds, priority, \
                 side_effects, idempotency_key, request_hash, read_back_of, state, \
                 created_at, updated_at, deployment_id) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, \
                 'pending', ?14, ?14, ?15) \
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
                deployment.map(|d| id_text(d.0)),
            ],
            |row| rows::read_task(row, key),
        )?;
        if let Some(created) = inserted {
            if let Some(actor) = task.created_by.clone() {
                let event = task_created_event(task, actor);
                super::audit::append(tx, event)?;
            }
            return Ok(CreateTaskOutcome::Created(created));
        }
    }
    // The key is taken.
    if let Some(idempotency_key) = &task.idempotency_key {
        let existing = tx.optional(
            concat!(
                "SELECT ",
                task_columns!(),
                " FROM tasks WHERE tenant_id = ?1 AND idempotency_key = ?2"
            ),
            params![id_text(task.tenant_id.0), idempotency_key],
            |row| Ok((row.text_opt("request_hash")?, rows::read_task(row, key)?)),
        )?;
        if let Some((request_hash, existing)) = existing {
            return Ok(if request_hash == task.request_hash {
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

/// Cancels `task` in the writer's transaction: pending, retry_wait or unknown at once; leased
/// by request (the agent is told with its next poll); terminal unchanged. A change gets a
/// `task.cancel` entry by `actor`. The one place a cancellation is written (a task's own
/// cancel, and a deployment cancel's tasks for the targets it stops).
pub(super) fn cancel_locked(
    tx: &Db<'_>,
    key: &PayloadKey,
    task: &Task,
    actor: AuditActor,
    at: OffsetDateTime,
) -> Result<CancelOutcome> {
    let now = unix_millis(at);
    let id = task.id;
    let outcome = match task.state {
        TaskState::Pending | TaskState::RetryWait | TaskState::Unknown => {
            CancelOutcome::Cancelled(tx.one(
                concat!(
                    "UPDATE tasks SET state = 'cancelled', next_attempt_at = NULL, \
                     finished_at = ?2, updated_at = ?2 WHERE id = ?1 RETURNING ",
                    task_columns!()
                ),
                params![id_text(id.0), now],
                |row| rows::read_task(row, key),
            )?)
        }
        TaskState::Leased => CancelOutcome::Requested(tx.one(
            concat!(
                "UPDATE tasks SET cancel_requested = TRUE, updated_at = ?2 \
                 WHERE id = ?1 RETURNING ",
                task_columns!()
            ),
            params![id_text(id.0), now],
            |row| rows::read_task(row, key),
        )?),
        _ => return Ok(CancelOutcome::AlreadyFinished(task.clone())),
    };
    if let CancelOutcome::Cancelled(task) | CancelOutcome::Requested(task) = &outcome {
        super::audit::append(tx, task_event(TASK_CANCEL, task, actor, at))?;
    }
    Ok(outcome)
}

#[async_trait::async_trait]
impl TaskStore for SqliteStore {
    async fn create_task(&self, task: NewTask) -> Result<CreateTaskOutcome> {
        let key = self.payload_key.clone();
        let payload = json_text("tasks.payload", &key.seal(task.id, &task.payload)?)?;
        let variables = json_text("tasks.variables", &task.variables)?;
        let created = self
            .writer
            .write("create task", move |tx| {
                create_in(tx, &key, &task, payload, variables, None)
            })
            .await?;
        if let CreateTaskOutcome::Created(task) = &created {
            self.wake(task.agent_id);
        }
        Ok(created)
    }

    async fn get_task(&self, tenant: TenantId, id: TaskId) -> Result<Option<(Task, Vec<Attempt>)>> {
        let key = self.payload_key.clone();
        self.readers
            .read("get task", move |db| {
                let Some(task) = tenant_task(db, &key, tenant, id)? else {
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
        let key = self.payload_key.clone();
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
            crate::rows::PageRequest {
                after: after.map(|id| id.0),
                order: filter.order,
                limit,
            },
            move |row| rows::read_task(row, &key),
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
        let key = self.payload_key.clone();
        const OP: &str = "claim task";
        let fingerprint = certificate_fingerprint.to_owned();
        let capabilities = capabilities.to_vec();
        // Most polls find nothing to claim. Answer those from a reader, so that thousands of
        // idle long-polls never queue on the single writer (and heartbeats behind them). The
        // same binding check runs again in the writer before anything is leased.
        let early = self
            .readers
            .read(OP, {
                let fingerprint = fingerprint.clone();
                move |db| {
                    Ok(match binding(db, agent, &fingerprint, generation)? {
                        Binding::Current if !lifecycle::may_claim(suspended(db, agent)?) => {
                            Some(ClaimOutcome::Empty)
                        }
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
                if !lifecycle::may_claim(suspended(tx, agent)?) {
                    return Ok(ClaimOutcome::Empty);
                }
                let now = millis(now);
                // The writer runs one operation at a time, so the head read here is still the
                // head when it is leased.
                let head = loop {
                    let head = tx.optional(
                        concat!(
                            "SELECT ",
                            task_columns!(),
                            " FROM tasks WHERE agent_id = ?1 \
                             AND state IN ('pending', 'retry_wait') \
                             ORDER BY priority DESC, seq LIMIT 1"
                        ),
                        [id_text(agent.0)],
                        |row| rows::read_task(row, &key),
                    )?;
                    let Some(head) = head else {
                        return Ok(ClaimOutcome::Empty);
                    };
                    let Some(code) = lifecycle::unrunnable(&head.task_type, &capabilities) else {
                        break head;
                    };
                    tx.execute(
                        "UPDATE tasks SET state = 'failed', error_code = ?2, finished_at = ?3, \
                         updated_at = ?3 WHERE id = ?1",
                        params![id_text(head.id.0), code, unix_millis(now)],
                    )?;
                };
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
                    |row| rows::read_task(row, &key),
                )?;
                let Some(task) = task else {
                    return Ok(ClaimOutcome::Empty);
                };
                let attempt = tx.one(
                    concat!(
                        "INSERT INTO task_attempts (assignment_id, task_id, agent_id, \
                         generation, state, assigned_at, lease_expires_at, start_handshake) \
                         VALUES (?1, ?2, ?3, ?4, 'leased', ?5, ?6, ?7) RETURNING ",
                        attempt_columns!()
                    ),
                    params![
                        id_text(assignment.0),
                        id_text(task.id.0),
                        id_text(agent.0),
                        generation,
                        unix_millis(now),
                        unix_millis(lease_expires_at),
                        start_handshake,
                    ],
                    |row| rows::read_attempt(row),
                )?;
                Ok(ClaimOutcome::Claimed(task, attempt))
            })
            .await
    }

    async fn open_task_counts(&self, agents: &[AgentId]) -> Result<Vec<(AgentId, i64)>> {
        let agents = agents.to_vec();
        self.readers
            .read("open task counts", move |db| {
                agents
                    .iter()
                    .map(|agent| {
                        let n = db.all(
                            "SELECT COUNT(*) AS n FROM tasks WHERE agent_id = ?1 \
                             AND state IN ('pending', 'leased', 'retry_wait')",
                            [id_text(agent.0)],
                            |row| row.int("n"),
                        )?;
                        Ok((*agent, n.first().copied().unwrap_or(0)))
                    })
                    .collect()
            })
            .await
    }

    async fn queued_tasks(&self, agent: AgentId, limit: u32) -> Result<Vec<Task>> {
        let key = self.payload_key.clone();
        self.readers
            .read("queued tasks", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        task_columns!(),
                        " FROM tasks WHERE agent_id = ?1 \
                         AND state IN ('pending', 'retry_wait') \
                         ORDER BY priority DESC, seq LIMIT ?2"
                    ),
                    params![id_text(agent.0), i64::from(limit)],
                    |row| rows::read_task(row, &key),
                )
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

    async fn start_attempt(&self, start: StartAttempt) -> Result<StartOutcome> {
        let key = self.payload_key.clone();
        self.writer
            .write("start attempt", move |tx| {
                // The writer runs one operation at a time: neither the generation nor the lease
                // (the sweep is a writer too) moves until this commits.
                match binding(
                    tx,
                    start.agent_id,
                    &start.certificate_fingerprint,
                    start.generation,
                )? {
                    Binding::Current => {}
                    Binding::Fenced => return Ok(StartOutcome::Fenced),
                    Binding::Revoked => return Ok(StartOutcome::Revoked),
                }
                let Some((task, attempt)) = agent_delivery(
                    tx,
                    &key,
                    start.agent_id,
                    start.task_id,
                    Some(start.assignment_id),
                )?
                else {
                    return Ok(StartOutcome::NotFound);
                };
                let now = millis(start.now);
                match attempt {
                    Some(attempt)
                        if lifecycle::is_live_lease(&task, &attempt, start.generation, now) =>
                    {
                        tx.one(
                            concat!(
                                "UPDATE task_attempts SET started_at = COALESCE(started_at, ?2), \
                                 phase = COALESCE(?3, phase) WHERE assignment_id = ?1 RETURNING ",
                                attempt_columns!()
                            ),
                            params![
                                id_text(attempt.assignment_id.0),
                                unix_millis(now),
                                start.phase.map(|p| p.as_str()),
                            ],
                            |row| rows::read_attempt(row),
                        )
                        .map(StartOutcome::Started)
                    }
                    _ => Ok(StartOutcome::Fenced),
                }
            })
            .await
    }

    async fn complete_attempt(
        &self,
        completion: Completion,
        policy: &RetryPolicy,
    ) -> Result<CompleteOutcome> {
        let key = self.payload_key.clone();
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
                let Some((task, attempt)) = agent_delivery(
                    tx,
                    &key,
                    completion.agent_id,
                    completion.task_id,
                    completion.assignment_id,
                )?
                else {
                    return Ok(CompleteOutcome::NotFound);
                };
                let now = millis(completion.now);
                let attempt = match lifecycle::accept_completion(
                    &task,
                    attempt,
                    &completion.envelope,
                    completion.generation,
                    now,
                ) {
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
                    |row| rows::read_task(row, &key),
                )?;
                super::audit::append(
                    tx,
                    result_event(&completion, task.tenant_id, task.id, task.state),
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
        actor: AuditActor,
        at: OffsetDateTime,
    ) -> Result<Option<CancelOutcome>> {
        let key = self.payload_key.clone();
        let outcome = self
            .writer
            .write("cancel task", move |tx| {
                let Some(task) = tenant_task(tx, &key, tenant, id)? else {
                    return Ok(None);
                };
                cancel_locked(tx, &key, &task, actor, at).map(Some)
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
        actor: AuditActor,
        at: OffsetDateTime,
    ) -> Result<Option<RetryOutcome>> {
        let key = self.payload_key.clone();
        let now = unix_millis(at);
        let outcome = self
            .writer
            .write("retry task", move |tx| {
                let Some(task) = tenant_task(tx, &key, tenant, id)? else {
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
                    |row| rows::read_task(row, &key),
                )?;
                // The read-backs of the losses before the retry are history: their keys go, so
                // a delivery lost after it gets a read-back of its own.
                tx.execute(
                    "UPDATE tasks SET idempotency_key = NULL \
                     WHERE read_back_of = ?1 AND idempotency_key IS NOT NULL",
                    params![id_text(id.0)],
                )?;
                super::audit::append(tx, task_event(TASK_RETRY, &task, actor, at))?;
                Ok(Some(RetryOutcome::Requeued(task)))
            })
            .await?;
        if let Some(RetryOutcome::Requeued(task)) = &outcome {
            self.wake(task.agent_id);
        }
        Ok(outcome)
    }

    async fn expire_leases(&self, now: OffsetDateTime, policy: &RetryPolicy) -> Result<LeaseSweep> {
        let key = self.payload_key.clone();
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
                    |row| rows::read_task(row, &key),
                )?;
                let mut sweep = LeaseSweep::default();
                let mut agents = BTreeSet::new();
                for task in expired {
                    let attempt = tx.optional(
                        concat!(
                            "SELECT ",
                            attempt_columns!(),
                            " FROM task_attempts WHERE assignment_id = ?1"
                        ),
                        [task.current_assignment.map(|a| id_text(a.0))],
                        |row| rows::read_attempt(row),
                    )?;
                    let next = lifecycle::expiry_transition(
                        lifecycle::may_have_run(task.side_effects, attempt.as_ref()),
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
                        |row| rows::read_task(row, &key),
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
        let key = self.payload_key.clone();
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
                    |row| rows::read_task(row, &key),
                )
            })
            .await
    }

    async fn prune_finished_tasks(&self, before: OffsetDateTime, limit: u32) -> Result<u64> {
        self.writer
            .write("prune finished tasks", move |tx| {
                tx.execute(
                    "DELETE FROM tasks WHERE id IN (\
                       SELECT t.id FROM tasks t \
                       WHERE t.state IN ('succeeded', 'failed', 'dead_letter', 'cancelled', \
                                         'expired') \
                       AND t.finished_at < ?1 \
                       AND NOT EXISTS (SELECT 1 FROM tasks rb WHERE rb.read_back_of = t.id) \
                       AND NOT EXISTS (SELECT 1 FROM tasks p \
                                       WHERE p.id = t.read_back_of AND p.state = 'unknown' \
                                       AND t.idempotency_key = \
                                           ?3 || p.id || ':' || p.attempts) \
                       ORDER BY t.finished_at LIMIT ?2)",
                    params![unix_millis(before), i64::from(limit), READ_BACK_KEY_PREFIX],
                )
                .map(|n| n as u64)
            })
            .await
    }

    async fn unknown_without_read_back(
        &self,
        after: Option<TaskId>,
        limit: u32,
    ) -> Result<Vec<Task>> {
        let key = self.payload_key.clone();
        // Ids are lower-case hyphenated text: '' sorts before all of them.
        let after = after.map(|id| id_text(id.0)).unwrap_or_default();
        self.readers
            .read("unknown tasks without read-back", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        task_columns!(),
                        " FROM tasks p WHERE p.state = 'unknown' AND p.id > ?1 \
                         AND EXISTS (SELECT 1 FROM agents a \
                                     WHERE a.id = p.agent_id AND a.tenant_id = p.tenant_id) \
                         AND NOT EXISTS (SELECT 1 FROM tasks rb \
                                         WHERE rb.tenant_id = p.tenant_id \
                                         AND rb.idempotency_key = \
                                             ?3 || p.id || ':' || p.attempts) \
                         ORDER BY p.id LIMIT ?2"
                    ),
                    params![after, i64::from(limit), READ_BACK_KEY_PREFIX],
                    |row| rows::read_task(row, &key),
                )
            })
            .await
    }

    async fn finished_read_backs_of_unknown(
        &self,
        after: Option<TaskId>,
        limit: u32,
    ) -> Result<Vec<Task>> {
        let key = self.payload_key.clone();
        let after = after.map(|id| id_text(id.0)).unwrap_or_default();
        self.readers
            .read("finished read-backs of unknown tasks", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        task_columns!(),
                        " FROM tasks WHERE id IN ( \
                             SELECT rb.id FROM tasks p JOIN tasks rb \
                             ON rb.tenant_id = p.tenant_id \
                             AND rb.idempotency_key = ?3 || p.id || ':' || p.attempts \
                             WHERE p.state = 'unknown' AND p.id > ?1 \
                             AND rb.read_back_of = p.id AND rb.state = 'succeeded' \
                             AND json_extract(p.result, '$.readBackTaskId') IS NOT rb.id \
                             ORDER BY p.id LIMIT ?2) \
                         ORDER BY read_back_of"
                    ),
                    params![after, i64::from(limit), READ_BACK_KEY_PREFIX],
                    |row| rows::read_task(row, &key),
                )
            })
            .await
    }

    fn task_events(&self) -> broadcast::Receiver<AgentId> {
        self.events.subscribe()
    }
}
