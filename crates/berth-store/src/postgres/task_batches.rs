//! The task path in batches on PostgreSQL (`batch.rs`): creations (with the token and agent
//! lookups the admin API does first), claims, results and the poll's cancellation read. A
//! task's life on this path (created, claimed, completed, and the polls around it) was about
//! 25 statements in 3 transactions, each its own round trip; here a batch of concurrent calls
//! shares each statement, and each transaction's WAL flush.
//!
//! Every batch takes the locks the single-call transaction (`tasks.rs`) takes, for all its
//! calls at once, in one order (agents by id, then their tasks), so batches never deadlock
//! with each other. The decisions are the same functions of `lifecycle`. What a batch does not
//! decide it declines, and the single-call transaction decides it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use berth_proto::error::ErrorChain;
use berth_proto::{AgentId, AssignmentId, TaskId, TenantId};
use sqlx::{Connection as _, PgConnection, PgPool};
use time::OffsetDateTime;
use tokio::sync::broadcast;

use super::batch::{decline_all, Batcher, Decided};
use super::completion::{decide_completion, Accepted};
use crate::domain::audit::task_created_event;
use crate::lifecycle::{self, Binding};
use crate::pool::AcquireWaits;
use crate::rows::{self, agent_columns, attempt_columns, db_error, millis, ColumnReader};
use crate::{
    Agent, ApiToken, Attempt, BatchStats, ClaimOutcome, CompleteOutcome, Completion,
    CreateTaskOutcome, NewTask, PayloadKey, Result, RetryPolicy, StoreError, Task, TaskState,
};

/// Workers per operation: while one waits on PostgreSQL the next batch gathers. Six
/// operations of two each use at most 12 of the pool's 16 connections.
const WORKERS: usize = 2;

/// What the batches need of the store.
pub(super) struct Context {
    pub(super) pool: PgPool,
    pub(super) payload_key: PayloadKey,
    /// Wakes this replica's polls of an agent that got a task.
    pub(super) events: broadcast::Sender<AgentId>,
    pub(super) waits: Arc<AcquireWaits>,
}

/// A poll's claim, owned so it can queue.
pub(super) struct ClaimRequest {
    pub(super) agent: AgentId,
    pub(super) generation: i64,
    pub(super) certificate_fingerprint: String,
    pub(super) capabilities: Vec<String>,
    pub(super) start_handshake: bool,
    pub(super) now: OffsetDateTime,
    pub(super) lease_grace: std::time::Duration,
}

impl ClaimRequest {
    /// The fencing decision for this poll against its agent's row (`None`: no such agent).
    fn binding(&self, stored: Option<(Option<&str>, i64)>) -> Binding {
        lifecycle::binding(stored, &self.certificate_fingerprint, self.generation)
    }
}

type Cancellations = Vec<(TaskId, AssignmentId)>;

pub(super) struct TaskBatches {
    /// The admin API's token lookup, which every task creation starts with.
    pub(super) api_token: Batcher<String, Option<ApiToken>>,
    /// An agent by id, as a creation checks its target.
    pub(super) agent: Batcher<(TenantId, AgentId), Option<Agent>>,
    pub(super) create: Batcher<NewTask, CreateTaskOutcome>,
    pub(super) claim: Batcher<ClaimRequest, ClaimOutcome>,
    pub(super) complete: Batcher<(Completion, RetryPolicy), CompleteOutcome>,
    pub(super) cancellations: Batcher<AgentId, Cancellations>,
}

impl TaskBatches {
    pub(super) fn start(context: Context) -> TaskBatches {
        let context = Arc::new(context);
        TaskBatches {
            api_token: batcher(&context, "look up api tokens", api_tokens, drop),
            agent: batcher(&context, "get agents", agents, drop),
            create: batcher(&context, "create tasks", create, drop),
            claim: batcher(
                &context,
                "claim tasks",
                claim,
                release_undelivered(&context),
            ),
            complete: batcher(&context, "complete attempts", complete, drop),
            cancellations: batcher(&context, "pending cancellations", cancellations, drop),
        }
    }
}

/// The task path's batchers, by operation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TaskBatchStats {
    pub api_token: BatchStats,
    pub agent: BatchStats,
    pub create: BatchStats,
    pub claim: BatchStats,
    pub complete: BatchStats,
    pub cancellations: BatchStats,
}

impl TaskBatchStats {
    /// Every operation's, for `/metrics`.
    pub fn all(&self) -> Vec<BatchStats> {
        vec![
            self.api_token,
            self.agent,
            self.create,
            self.claim,
            self.complete,
            self.cancellations,
        ]
    }
}

impl TaskBatches {
    pub(super) fn stats(&self) -> TaskBatchStats {
        TaskBatchStats {
            api_token: self.api_token.stats(),
            agent: self.agent.stats(),
            create: self.create.stats(),
            claim: self.claim.stats(),
            complete: self.complete.stats(),
            cancellations: self.cancellations.stats(),
        }
    }
}

/// `undelivered` takes the answers decided for callers that went away while their batch ran
/// ([`Batcher::start`]): `drop` where an answer nobody reads harms nothing (a lookup; a
/// creation or a result, which commit as a request whose client went away would).
fn batcher<I, O, F, U>(
    context: &Arc<Context>,
    name: &'static str,
    batch: F,
    undelivered: U,
) -> Batcher<I, O>
where
    I: Send + Sync + 'static,
    O: Send + 'static,
    F: for<'a> AsyncBatch<'a, I, O> + Send + Sync + 'static,
    U: Fn(O) + Send + Sync + 'static,
{
    let context = context.clone();
    Batcher::start(
        name,
        WORKERS,
        move |inputs| {
            let context = context.clone();
            async move { declined_on_error(&context, name, inputs, batch).await }
        },
        undelivered,
    )
}

/// A claim whose poll went away while its batch ran holds a lease nobody will ever use: left
/// alone, its task would wait for the lease to run out (the task's timeout plus the grace).
/// Released at once instead, off the batch's worker.
fn release_undelivered(context: &Arc<Context>) -> impl Fn(ClaimOutcome) + Send + Sync + 'static {
    let context = context.clone();
    move |outcome| {
        let ClaimOutcome::Claimed(_, attempt) = outcome else {
            return;
        };
        let context = context.clone();
        tokio::spawn(async move {
            if let Err(e) = release(&context, &attempt).await {
                tracing::warn!(task = %attempt.task_id, assignment = %attempt.assignment_id,
                    error = %ErrorChain(&e),
                    "an undelivered claim was not released; its lease runs out instead");
            }
        });
    }
}

/// Undoes an undelivered claim in one statement (its own transaction): the task goes back to
/// the state it was claimed from (`pending` if this was its first delivery, else `retry_wait`,
/// due at once: it was due when claimed) without spending an attempt, and the delivery, which no
/// agent ever saw (so never started), is deleted. Only while it is still the task's current
/// delivery: nothing else can have touched it, since nobody knows its assignment id, but a
/// cancellation or the lease sweep may have, and then there is nothing to undo.
async fn release(context: &Context, attempt: &Attempt) -> Result<()> {
    const OP: &str = "release an undelivered claim";
    let mut conn = super::acquire(&context.pool, &context.waits, OP).await?;
    let released = sqlx::query(
        "WITH released AS (UPDATE tasks SET \
             state = CASE WHEN attempts > 1 THEN 'retry_wait' ELSE 'pending' END, \
             attempts = attempts - 1, current_assignment = NULL, lease_expires_at = NULL, \
             next_attempt_at = CASE WHEN attempts > 1 THEN updated_at END \
           WHERE id = $2 AND state = 'leased' AND current_assignment = $1 RETURNING id) \
         DELETE FROM task_attempts a USING released \
         WHERE a.assignment_id = $1 AND a.task_id = released.id",
    )
    .bind(attempt.assignment_id.0)
    .bind(attempt.task_id.0)
    .execute(&mut *conn)
    .await
    .map_err(db_error(OP))?;
    if released.rows_affected() > 0 {
        // Its agent's other polls may claim it now.
        let _ = context.events.send(attempt.agent_id);
    }
    Ok(())
}

/// Runs `batch` on a pooled connection; if it fails as a whole (a statement's error, a
/// deadlock, a lost connection), every call is declined to run alone. When the connection was
/// lost at the commit, the batch may have committed: the single call then sees that and
/// answers as it would a repeat (a result as a duplicate; a creation as a conflict on its id,
/// an error as a lost commit was before; a claim leases the next task, and the first one's
/// lease expires as an undelivered one does).
async fn declined_on_error<I, O, F>(
    context: &Context,
    name: &'static str,
    inputs: Vec<I>,
    batch: F,
) -> Vec<Decided<I, O>>
where
    F: for<'a> AsyncBatch<'a, I, O>,
{
    let conn = super::acquire(
        &context.pool,
        &context.waits,
        "acquire a database connection",
    );
    let Ok(mut conn) = conn.await else {
        return decline_all(inputs);
    };
    match batch.call(context, &mut conn, &inputs).await {
        Ok(decided) => inputs
            .into_iter()
            .zip(decided)
            .map(|(input, decided)| decided.ok_or(input))
            .collect(),
        Err(e) => {
            tracing::debug!(batch = name, size = inputs.len(), error = %ErrorChain(&e),
                "a batch failed; its calls run alone");
            decline_all(inputs)
        }
    }
}

/// A batch: each input's answer, or `None` to decline it.
trait AsyncBatch<'a, I: 'a, O>: Copy {
    type Future: std::future::Future<Output = Result<Vec<Option<O>>>> + Send + 'a;
    fn call(
        self,
        context: &'a Context,
        conn: &'a mut PgConnection,
        inputs: &'a [I],
    ) -> Self::Future;
}

impl<'a, I: 'a, O, F, Fut> AsyncBatch<'a, I, O> for F
where
    F: Fn(&'a Context, &'a mut PgConnection, &'a [I]) -> Fut + Copy,
    Fut: std::future::Future<Output = Result<Vec<Option<O>>>> + Send + 'a,
{
    type Future = Fut;
    fn call(self, context: &'a Context, conn: &'a mut PgConnection, inputs: &'a [I]) -> Fut {
        self(context, conn, inputs)
    }
}

/// Token lookups by hash, in one statement.
async fn api_tokens(
    _context: &Context,
    conn: &mut PgConnection,
    hashes: &[String],
) -> Result<Vec<Option<Option<ApiToken>>>> {
    let found: HashMap<String, ApiToken> = sqlx::query(
        "SELECT token_hash, id, tenant_id, name, role, operator, created_at FROM api_tokens \
         WHERE token_hash = ANY($1)",
    )
    .bind(hashes)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error("look up api tokens"))?
    .iter()
    .map(|row| Ok((row.text("token_hash")?, rows::read_api_token(row)?)))
    .collect::<Result<_>>()?;
    Ok(hashes.iter().map(|h| Some(found.get(h).cloned())).collect())
}

/// Agents by id, each answered only within its tenant, in one statement.
async fn agents(
    _context: &Context,
    conn: &mut PgConnection,
    keys: &[(TenantId, AgentId)],
) -> Result<Vec<Option<Option<Agent>>>> {
    let ids: Vec<uuid::Uuid> = keys.iter().map(|(_, a)| a.0).collect();
    let found: HashMap<AgentId, Agent> = sqlx::query(concat!(
        "SELECT ",
        agent_columns!(),
        " FROM agents WHERE id = ANY($1)"
    ))
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error("get agents"))?
    .iter()
    .map(|row| {
        let agent = rows::read_agent(row)?;
        Ok((agent.id, agent))
    })
    .collect::<Result<_>>()?;
    Ok(keys
        .iter()
        .map(|(tenant, id)| Some(found.get(id).filter(|a| a.tenant_id == *tenant).cloned()))
        .collect())
}

/// Creations: the queue-cap locks of every capped agent, then one read of the agents'
/// cordons and open counts, the admission decided here, and one insert of the admitted tasks
/// with their audit entries staged. Declined: a taken idempotency key (the single call tells
/// an existing task from a conflict), an agent that is missing or not the tenant's, and a
/// refusal (the single call answers it after the key check, as it orders them).
async fn create(
    context: &Context,
    conn: &mut PgConnection,
    tasks: &[NewTask],
) -> Result<Vec<Option<CreateTaskOutcome>>> {
    const OP: &str = "create tasks";
    let mut tx = conn.begin().await.map_err(db_error(OP))?;
    let mut capped: Vec<uuid::Uuid> = tasks
        .iter()
        .filter(|t| lifecycle::queue_cap(t).is_some())
        .map(|t| t.agent_id.0)
        .collect();
    capped.sort_unstable();
    capped.dedup();
    if !capped.is_empty() {
        // The single call's lock per agent, taken in id order; the read below is a statement
        // of its own, so its snapshot sees every task committed before the locks were ours.
        sqlx::query(
            "SELECT pg_advisory_xact_lock(hashtextextended('berth.queue:' || a::text, 0)) \
             FROM unnest($1::uuid[]) AS a ORDER BY a",
        )
        .bind(&capped)
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
    }
    let mut agents: Vec<uuid::Uuid> = tasks.iter().map(|t| t.agent_id.0).collect();
    agents.sort_unstable();
    agents.dedup();
    // KEY SHARE, as the single call: a concurrent delete_agent or hold (`set_agent_hold`
    // locks FOR UPDATE) commits before (the agent is gone here, or its `cordoned` is the new
    // one) or waits for this commit.
    let mut standing: HashMap<uuid::Uuid, (uuid::Uuid, bool, u64)> = sqlx::query(&format!(
        "SELECT id, tenant_id, cordoned, CASE WHEN id = ANY($2) THEN (SELECT COUNT(*) FROM tasks t \
         WHERE t.agent_id = a.id AND t.state IN {}) ELSE 0 END AS open \
         FROM agents a WHERE id = ANY($1) ORDER BY id FOR KEY SHARE",
        lifecycle::OPEN_STATES_SQL
    ))
    .bind(&agents)
    .bind(&capped)
    .fetch_all(&mut *tx)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| {
        let open = u64::try_from(row.int("open")?).unwrap_or(0);
        Ok((
            row.uuid("id")?,
            (row.uuid("tenant_id")?, row.flag("cordoned")?, open),
        ))
    })
    .collect::<Result<_>>()?;
    let mut admitted = Vec::new();
    for (i, task) in tasks.iter().enumerate() {
        let Some((tenant, cordoned, open)) = standing.get_mut(&task.agent_id.0) else {
            continue;
        };
        if *tenant != task.tenant_id.0 {
            continue;
        }
        let counted = lifecycle::queue_cap(task).map(|_| *open);
        if lifecycle::admit(task, *cordoned, counted).is_ok() {
            // The batch's own earlier tasks count against the cap of the ones after them.
            *open += 1;
            admitted.push(i);
        }
    }
    if admitted.is_empty() {
        return Ok(tasks.iter().map(|_| None).collect());
    }
    let mut rows = CreateRows::default();
    for &i in &admitted {
        rows.push(&context.payload_key, &tasks[i])?;
    }
    let created: HashMap<TaskId, Task> = sqlx::query(
        "WITH input AS (SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::uuid[], \
             $5::jsonb[], $6::bytea[], $7::jsonb[], $8::bigint[], $9::bigint[], $10::bool[], \
             $11::text[], $12::text[], $13::uuid[], $14::timestamptz[], $15::text[]) \
           WITH ORDINALITY AS i(in_id, in_tenant, in_type, in_agent, in_payload, in_credentials, \
             in_variables, in_timeout, in_priority, in_side_effects, in_key, in_hash, \
             in_read_back_of, in_created, in_draft, in_ord)), \
         inserted AS (INSERT INTO tasks (id, tenant_id, task_type, agent_id, payload, \
             credentials_sealed, variables, timeout_seconds, priority, side_effects, \
             idempotency_key, request_hash, read_back_of, state, created_at, updated_at) \
           SELECT in_id, in_tenant, in_type, in_agent, in_payload, in_credentials, in_variables, \
             in_timeout, in_priority, in_side_effects, in_key, in_hash, in_read_back_of, \
             'pending', in_created, in_created FROM input ORDER BY in_ord \
           ON CONFLICT (tenant_id, idempotency_key) WHERE idempotency_key IS NOT NULL \
           DO NOTHING RETURNING *), \
         audit AS (INSERT INTO audit_pending (tenant_id, draft) \
           SELECT in_tenant, in_draft FROM input JOIN inserted ON inserted.id = in_id \
           WHERE in_draft IS NOT NULL ORDER BY in_ord) \
         SELECT * FROM inserted",
    )
    .bind(&rows.id)
    .bind(&rows.tenant)
    .bind(&rows.task_type)
    .bind(&rows.agent)
    .bind(&rows.payload)
    .bind(&rows.credentials)
    .bind(&rows.variables)
    .bind(&rows.timeout)
    .bind(&rows.priority)
    .bind(&rows.side_effects)
    .bind(&rows.key)
    .bind(&rows.hash)
    .bind(&rows.read_back_of)
    .bind(&rows.created)
    .bind(&rows.draft)
    .fetch_all(&mut *tx)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| {
        let task = rows::read_task(row, &context.payload_key)?;
        Ok((task.id, task))
    })
    .collect::<Result<_>>()?;
    tx.commit().await.map_err(db_error(OP))?;
    Ok(tasks
        .iter()
        .map(|task| {
            let created = created.get(&task.id)?.clone();
            // No receivers is not an error: nobody is long-polling right now.
            let _ = context.events.send(created.agent_id);
            Some(CreateTaskOutcome::Created(created))
        })
        .collect())
}

/// The columns of the admitted tasks, as the insert's arrays.
#[derive(Default)]
struct CreateRows {
    id: Vec<uuid::Uuid>,
    tenant: Vec<uuid::Uuid>,
    task_type: Vec<String>,
    agent: Vec<uuid::Uuid>,
    payload: Vec<serde_json::Value>,
    credentials: Vec<Option<Vec<u8>>>,
    variables: Vec<serde_json::Value>,
    timeout: Vec<i64>,
    priority: Vec<i64>,
    side_effects: Vec<bool>,
    key: Vec<Option<String>>,
    hash: Vec<Option<String>>,
    read_back_of: Vec<Option<uuid::Uuid>>,
    created: Vec<OffsetDateTime>,
    draft: Vec<Option<String>>,
}

impl CreateRows {
    fn push(&mut self, key: &PayloadKey, task: &NewTask) -> Result<()> {
        self.id.push(task.id.0);
        self.tenant.push(task.tenant_id.0);
        self.task_type.push(task.task_type.clone());
        self.agent.push(task.agent_id.0);
        self.payload
            .push(to_json(&key.seal(task.id, &task.payload)?)?);
        self.credentials.push(task.credentials_sealed.clone());
        self.variables.push(to_json(&task.variables)?);
        self.timeout.push(i64::from(task.timeout_seconds));
        self.priority.push(i64::from(task.priority));
        self.side_effects.push(task.side_effects);
        self.key.push(task.idempotency_key.clone());
        self.hash.push(task.request_hash.clone());
        self.read_back_of.push(task.read_back_of.map(|t| t.0));
        self.created.push(millis(task.created_at));
        let draft = match &task.created_by {
            Some(actor) => {
                Some(super::sequencer::staged(task_created_event(task, actor.clone()))?.1)
            }
            None => None,
        };
        self.draft.push(draft);
        Ok(())
    }
}

fn to_json(value: &impl serde::Serialize) -> Result<serde_json::Value> {
    serde_json::to_value(value)
        .map_err(|e| StoreError::Corrupt(format!("encode a task column: {e}")))
}

/// Claims: one unlocked read answers the polls with nothing to claim (most of them); for the
/// rest, every agent row is locked in id order, as the single call locks its one, their heads
/// read, and the claims written in one statement. Declined: a second poll of one agent in the
/// batch, and a head its agent cannot run (the single call fails it and looks further).
async fn claim(
    context: &Context,
    conn: &mut PgConnection,
    claims: &[ClaimRequest],
) -> Result<Vec<Option<ClaimOutcome>>> {
    const OP: &str = "claim tasks";
    let mut decided: Vec<Option<ClaimOutcome>> = claims.iter().map(|_| None).collect();
    let mut seen = HashSet::new();
    let first: Vec<usize> = (0..claims.len())
        .filter(|&i| seen.insert(claims[i].agent))
        .collect();
    let agents: Vec<uuid::Uuid> = first.iter().map(|&i| claims[i].agent.0).collect();
    let nows: Vec<OffsetDateTime> = first.iter().map(|&i| millis(claims[i].now)).collect();
    let probed: HashMap<uuid::Uuid, (i64, Option<String>, bool, bool)> = sqlx::query(
        "SELECT q.agent, a.generation, a.certificate_fingerprint, a.suspended, EXISTS ( \
           SELECT 1 FROM tasks WHERE agent_id = q.agent AND state IN ('pending', 'retry_wait') \
           AND (next_attempt_at IS NULL OR next_attempt_at <= q.now)) AS claimable \
         FROM unnest($1::uuid[], $2::timestamptz[]) AS q(agent, now) \
         JOIN agents a ON a.id = q.agent",
    )
    .bind(&agents)
    .bind(&nows)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| {
        Ok((
            row.uuid("agent")?,
            (
                row.int("generation")?,
                row.text_opt("certificate_fingerprint")?,
                row.flag("suspended")?,
                row.flag("claimable")?,
            ),
        ))
    })
    .collect::<Result<_>>()?;
    // As the single call's probe: only a current binding with nothing claimable is answered
    // without the lock; anything else is decided under it.
    let mut locking = Vec::new();
    for &i in &first {
        let claim = &claims[i];
        match probed.get(&claim.agent.0) {
            Some((generation, fingerprint, suspended, claimable))
                if claim.binding(Some((fingerprint.as_deref(), *generation)))
                    == Binding::Current
                    && (*suspended || !*claimable) =>
            {
                decided[i] = Some(ClaimOutcome::Empty)
            }
            _ => locking.push(i),
        }
    }
    if locking.is_empty() {
        return Ok(decided);
    }
    let mut tx = conn.begin().await.map_err(db_error(OP))?;
    let mut locked: Vec<uuid::Uuid> = locking.iter().map(|&i| claims[i].agent.0).collect();
    locked.sort_unstable();
    let bindings: HashMap<uuid::Uuid, (i64, Option<String>, bool)> = sqlx::query(
        "SELECT id, generation, certificate_fingerprint, suspended FROM agents \
         WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE",
    )
    .bind(&locked)
    .fetch_all(&mut *tx)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| {
        Ok((
            row.uuid("id")?,
            (
                row.int("generation")?,
                row.text_opt("certificate_fingerprint")?,
                row.flag("suspended")?,
            ),
        ))
    })
    .collect::<Result<_>>()?;
    let mut current = Vec::new();
    for &i in &locking {
        let claim = &claims[i];
        let row = bindings.get(&claim.agent.0);
        let suspended = row.is_some_and(|(_, _, suspended)| *suspended);
        decided[i] = match claim.binding(row.map(|(g, f, _)| (f.as_deref(), *g))) {
            Binding::Revoked => Some(ClaimOutcome::Revoked),
            Binding::Fenced => Some(ClaimOutcome::Fenced),
            Binding::Current if !lifecycle::may_claim(suspended) => Some(ClaimOutcome::Empty),
            Binding::Current => {
                current.push(i);
                None
            }
        };
    }
    let heads_of: Vec<uuid::Uuid> = current.iter().map(|&i| claims[i].agent.0).collect();
    let heads: HashMap<AgentId, (Task, bool)> = sqlx::query(
        "SELECT h.* FROM unnest($1::uuid[]) AS q(agent) CROSS JOIN LATERAL ( \
           SELECT *, EXISTS (SELECT 1 FROM tasks b WHERE b.agent_id = q.agent \
             AND b.state = 'leased' AND b.side_effects) AS busy \
           FROM tasks WHERE agent_id = q.agent AND state IN ('pending', 'retry_wait') \
           ORDER BY priority DESC, seq LIMIT 1) AS h",
    )
    .bind(&heads_of)
    .fetch_all(&mut *tx)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| {
        let head = rows::read_task(row, &context.payload_key)?;
        Ok((head.agent_id, (head, row.flag("busy")?)))
    })
    .collect::<Result<_>>()?;
    let mut leases: Vec<(usize, Attempt)> = Vec::new();
    for &i in &current {
        let claim = &claims[i];
        let now = millis(claim.now);
        let Some((head, busy)) = heads.get(&claim.agent) else {
            decided[i] = Some(ClaimOutcome::Empty);
            continue;
        };
        if lifecycle::unrunnable(&head.task_type, &claim.capabilities).is_some() {
            continue;
        }
        if (head.state == TaskState::RetryWait && head.next_attempt_at.is_some_and(|t| t > now))
            || (head.side_effects && *busy)
        {
            decided[i] = Some(ClaimOutcome::Empty);
            continue;
        }
        let attempt = Attempt::leased(
            AssignmentId::new(),
            head.id,
            claim.agent,
            claim.generation,
            now,
            lifecycle::lease_deadline(now, head.timeout_seconds, claim.lease_grace),
            claim.start_handshake,
        );
        leases.push((i, attempt));
    }
    if !leases.is_empty() {
        let column =
            |f: fn(&Attempt) -> uuid::Uuid| leases.iter().map(|(_, a)| f(a)).collect::<Vec<_>>();
        let times = |f: fn(&Attempt) -> OffsetDateTime| {
            leases.iter().map(|(_, a)| f(a)).collect::<Vec<_>>()
        };
        // As the single call's statement: each head leased (still claimable: nothing else
        // holds its agent's lock, but an operator's cancel may have taken it) and only then
        // its delivery opened.
        let mut claimed: HashMap<TaskId, Task> = sqlx::query(
            "WITH input AS (SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::uuid[], \
                 $4::bigint[], $5::timestamptz[], $6::timestamptz[], $7::bool[]) \
               AS i(in_task, in_assignment, in_agent, in_generation, in_assigned, in_expires, \
                 in_handshake)), \
             claimed AS (UPDATE tasks t SET state = 'leased', attempts = t.attempts + 1, \
                 current_assignment = in_assignment, lease_expires_at = in_expires, \
                 next_attempt_at = NULL, updated_at = in_assigned FROM input \
               WHERE t.id = in_task AND t.state IN ('pending', 'retry_wait') RETURNING t.*), \
             delivery AS (INSERT INTO task_attempts (assignment_id, task_id, agent_id, \
                 generation, state, assigned_at, lease_expires_at, start_handshake) \
               SELECT in_assignment, in_task, in_agent, in_generation, 'leased', in_assigned, \
                 in_expires, in_handshake FROM input JOIN claimed ON claimed.id = in_task) \
             SELECT * FROM claimed",
        )
        .bind(column(|a| a.task_id.0))
        .bind(column(|a| a.assignment_id.0))
        .bind(column(|a| a.agent_id.0))
        .bind(leases.iter().map(|(_, a)| a.generation).collect::<Vec<_>>())
        .bind(times(|a| a.assigned_at))
        .bind(times(|a| a.lease_expires_at))
        .bind(
            leases
                .iter()
                .map(|(_, a)| a.start_handshake)
                .collect::<Vec<_>>(),
        )
        .fetch_all(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .iter()
        .map(|row| {
            let task = rows::read_task(row, &context.payload_key)?;
            Ok((task.id, task))
        })
        .collect::<Result<_>>()?;
        for (i, attempt) in leases {
            decided[i] = Some(match claimed.remove(&attempt.task_id) {
                Some(task) => ClaimOutcome::Claimed(task, attempt),
                None => ClaimOutcome::Empty,
            });
        }
    }
    tx.commit().await.map_err(db_error(OP))?;
    Ok(decided)
}

/// Results: every agent row locked `FOR SHARE` and every task `FOR UPDATE` (agents by id,
/// then tasks), their deliveries read, each result decided by `lifecycle` as the single call
/// does, and the accepted ones written, audit entries staged, in one statement. Declined: a
/// task that is not the agent's (the single call answers not found), an agent that is gone,
/// a result that names no delivery while its task has none current, and a second result for
/// one task in the batch.
async fn complete(
    context: &Context,
    conn: &mut PgConnection,
    completions: &[(Completion, RetryPolicy)],
) -> Result<Vec<Option<CompleteOutcome>>> {
    const OP: &str = "complete attempts";
    let mut decided: Vec<Option<CompleteOutcome>> = completions.iter().map(|_| None).collect();
    let mut seen = HashSet::new();
    let first: Vec<usize> = (0..completions.len())
        .filter(|&i| seen.insert(completions[i].0.task_id))
        .collect();
    let mut tx = conn.begin().await.map_err(db_error(OP))?;
    let task_ids: Vec<uuid::Uuid> = first.iter().map(|&i| completions[i].0.task_id.0).collect();
    let found: HashMap<TaskId, (i64, Option<String>, Task)> = sqlx::query(
        "SELECT b.generation AS bound_generation, \
           b.certificate_fingerprint AS bound_fingerprint, t.* \
         FROM tasks t JOIN agents b ON b.id = t.agent_id WHERE t.id = ANY($1) \
         ORDER BY b.id, t.id FOR SHARE OF b FOR UPDATE OF t",
    )
    .bind(&task_ids)
    .fetch_all(&mut *tx)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| {
        let task = rows::read_task(row, &context.payload_key)?;
        Ok((
            task.id,
            (
                row.int("bound_generation")?,
                row.text_opt("bound_fingerprint")?,
                task,
            ),
        ))
    })
    .collect::<Result<_>>()?;
    // Each result's delivery: the one it names, else its task's current one.
    let mut named = Vec::new();
    for &i in &first {
        let completion = &completions[i].0;
        let Some((_, _, task)) = found.get(&completion.task_id) else {
            continue;
        };
        if task.agent_id != completion.agent_id {
            continue;
        }
        if let Some(assignment) = completion.assignment_id.or(task.current_assignment) {
            named.push((i, assignment));
        }
    }
    let assignments: Vec<uuid::Uuid> = named.iter().map(|(_, a)| a.0).collect();
    let attempts: HashMap<AssignmentId, Attempt> = sqlx::query(concat!(
        "SELECT ",
        attempt_columns!(),
        " FROM task_attempts WHERE assignment_id = ANY($1)"
    ))
    .bind(&assignments)
    .fetch_all(&mut *tx)
    .await
    .map_err(db_error(OP))?
    .iter()
    .map(|row| {
        let attempt = rows::read_attempt(row)?;
        Ok((attempt.assignment_id, attempt))
    })
    .collect::<Result<_>>()?;
    let mut writes = CompleteRows::default();
    for (i, assignment) in named {
        let (completion, policy) = &completions[i];
        let (generation, fingerprint, task) = &found[&completion.task_id];
        match lifecycle::binding(
            Some((fingerprint.as_deref(), *generation)),
            &completion.certificate_fingerprint,
            completion.generation,
        ) {
            Binding::Current => {}
            Binding::Fenced => {
                decided[i] = Some(CompleteOutcome::Fenced);
                continue;
            }
            Binding::Revoked => {
                decided[i] = Some(CompleteOutcome::Revoked);
                continue;
            }
        }
        let attempt = attempts
            .get(&assignment)
            .filter(|a| a.task_id == task.id)
            .cloned();
        let Accepted {
            attempt,
            next,
            audit: (audit_tenant, audit_draft),
            now,
        } = match decide_completion(task, attempt, completion, policy)? {
            Ok(accepted) => accepted,
            Err(answer) => {
                decided[i] = Some(answer);
                continue;
            }
        };
        writes.task.push(task.id.0);
        writes.state.push(next.state.as_str());
        writes.next_attempt_at.push(next.next_attempt_at);
        writes.error_code.push(next.error_code);
        writes.result.push(completion.result_data.clone());
        writes.now.push(now);
        writes.finished_at.push(next.finished_at);
        writes.attempt_state.push(next.attempt.as_str());
        writes.envelope.push(completion.envelope.clone());
        writes.assignment.push(attempt.assignment_id.0);
        writes.audit_tenant.push(audit_tenant.0);
        writes.audit_draft.push(audit_draft);
        writes.index.push(i);
    }
    if !writes.index.is_empty() {
        // As the single call's statement: the attempt, the task and the `task.result` audit
        // entry, for every accepted result at once.
        let mut recorded: HashMap<TaskId, Task> = sqlx::query(
            "WITH input AS (SELECT * FROM unnest($1::uuid[], $2::text[], $3::timestamptz[], \
                 $4::text[], $5::jsonb[], $6::timestamptz[], $7::timestamptz[], $8::text[], \
                 $9::jsonb[], $10::uuid[], $11::uuid[], $12::text[]) WITH ORDINALITY \
               AS i(in_task, in_state, in_next, in_error, in_result, in_now, in_finished, \
                 in_attempt_state, in_envelope, in_assignment, in_audit_tenant, in_draft, \
                 in_ord)), \
             attempt AS (UPDATE task_attempts SET state = in_attempt_state, \
                 finished_at = in_now, envelope = in_envelope, error_code = in_error \
               FROM input WHERE assignment_id = in_assignment), \
             audit AS (INSERT INTO audit_pending (tenant_id, draft) \
               SELECT in_audit_tenant, in_draft FROM input ORDER BY in_ord) \
             UPDATE tasks t SET state = in_state, next_attempt_at = in_next, \
               error_code = COALESCE(in_error, t.error_code), result = in_result, \
               current_assignment = NULL, lease_expires_at = NULL, updated_at = in_now, \
               finished_at = in_finished \
             FROM input WHERE t.id = in_task RETURNING t.*",
        )
        .bind(&writes.task)
        .bind(&writes.state)
        .bind(&writes.next_attempt_at)
        .bind(&writes.error_code)
        .bind(&writes.result)
        .bind(&writes.now)
        .bind(&writes.finished_at)
        .bind(&writes.attempt_state)
        .bind(&writes.envelope)
        .bind(&writes.assignment)
        .bind(&writes.audit_tenant)
        .bind(&writes.audit_draft)
        .fetch_all(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .iter()
        .map(|row| {
            let task = rows::read_task(row, &context.payload_key)?;
            Ok((task.id, task))
        })
        .collect::<Result<_>>()?;
        for i in writes.index {
            let task = recorded.remove(&completions[i].0.task_id).ok_or_else(|| {
                StoreError::Corrupt("a locked task was not updated by its result".into())
            })?;
            decided[i] = Some(CompleteOutcome::Recorded(task));
        }
    }
    tx.commit().await.map_err(db_error(OP))?;
    Ok(decided)
}

/// The accepted results, as the write's arrays.
#[derive(Default)]
struct CompleteRows {
    task: Vec<uuid::Uuid>,
    state: Vec<&'static str>,
    next_attempt_at: Vec<Option<OffsetDateTime>>,
    error_code: Vec<Option<String>>,
    result: Vec<Option<serde_json::Value>>,
    now: Vec<OffsetDateTime>,
    finished_at: Vec<Option<OffsetDateTime>>,
    attempt_state: Vec<&'static str>,
    envelope: Vec<serde_json::Value>,
    assignment: Vec<uuid::Uuid>,
    audit_tenant: Vec<uuid::Uuid>,
    audit_draft: Vec<String>,
    /// Which call each row is.
    index: Vec<usize>,
}

/// The poll's cancellation read, for every agent of the batch in one statement.
async fn cancellations(
    _context: &Context,
    conn: &mut PgConnection,
    agents: &[AgentId],
) -> Result<Vec<Option<Cancellations>>> {
    let ids: Vec<uuid::Uuid> = agents.iter().map(|a| a.0).collect();
    let mut found: HashMap<AgentId, Cancellations> = HashMap::new();
    for row in sqlx::query(
        "SELECT agent_id, id, current_assignment FROM tasks \
         WHERE agent_id = ANY($1) AND state = 'leased' AND cancel_requested ORDER BY seq",
    )
    .bind(&ids)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error("pending cancellations"))?
    {
        let assignment = row.uuid_opt("current_assignment")?.ok_or_else(|| {
            StoreError::Corrupt("tasks.current_assignment: leased without one".to_string())
        })?;
        found
            .entry(AgentId(row.uuid("agent_id")?))
            .or_default()
            .push((TaskId(row.uuid("id")?), AssignmentId(assignment)));
    }
    Ok(agents
        .iter()
        .map(|agent| Some(found.get(agent).cloned().unwrap_or_default()))
        .collect())
}
