//! Tasks and their deliveries (attempts): creation with idempotency keys, the claim order,
//! verified results, cancellation, retry, lease expiry and read-back. Where a task goes when a
//! delivery ends is decided in `lifecycle.rs`.

use std::collections::BTreeMap;

use berth_proto::audit::AuditActor;
use berth_proto::transport::ProgressPhase;
use berth_proto::{AgentId, AssignmentId, TaskId, TenantId};
use time::OffsetDateTime;

use crate::{Page, Result};

/// Task and attempt states are wire types; the store persists them by `as_str`.
pub use berth_proto::task::{AttemptState, TaskState};

/// Delivery policy (seed 003): requeue after `backoff[attempt-1]` (the last entry repeats),
/// dead-letter once `max_attempts` deliveries failed.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub backoff: Vec<std::time::Duration>,
    pub max_attempts: u32,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        use std::time::Duration;
        RetryPolicy {
            backoff: vec![
                Duration::from_secs(1),
                Duration::from_secs(8),
                Duration::from_secs(64),
                Duration::from_secs(300),
            ],
            max_attempts: 5,
        }
    }
}

impl RetryPolicy {
    /// Delay before the next delivery after `attempts` failed deliveries (attempts >= 1).
    pub fn delay_after(&self, attempts: u32) -> std::time::Duration {
        let i = (attempts.max(1) as usize - 1).min(self.backoff.len().saturating_sub(1));
        self.backoff.get(i).copied().unwrap_or_default()
    }
}

#[derive(Debug, Clone)]
pub struct NewTask {
    pub id: TaskId,
    pub tenant_id: TenantId,
    pub task_type: String,
    /// The agent that will run it (a label selector is resolved by the server before this).
    pub agent_id: AgentId,
    pub payload: serde_json::Value,
    /// Credentials sealed with the master key (AEAD, aad = task id); never stored in clear.
    pub credentials_sealed: Option<Vec<u8>>,
    pub variables: BTreeMap<String, String>,
    pub timeout_seconds: u32,
    /// Higher runs first among an agent's queued tasks.
    pub priority: i32,
    pub side_effects: bool,
    /// `Idempotency-Key` of the create request, unique per tenant, with the hash of the request
    /// body: the same key with the same hash returns the existing task, another hash conflicts.
    pub idempotency_key: Option<String>,
    pub request_hash: Option<String>,
    /// A read-back task points at the `unknown` task it checks. A read-back is never refused
    /// by a cordon or the queue cap: it resolves work the agent already had.
    pub read_back_of: Option<TaskId>,
    /// The most open tasks (not terminal) the agent may hold before this one, counted in the
    /// insert's transaction: at the cap, [`CreateTaskOutcome::QueueFull`]. None: no cap (the
    /// server's own deployment and drift tasks, whose number the server bounds itself).
    pub queue_cap: Option<u32>,
    pub created_at: OffsetDateTime,
    /// Who asked for it: when set, a `task.create` audit entry is appended in the insert's
    /// transaction (not for an existing task an idempotency key returns). The server's own
    /// read-backs have none.
    pub created_by: Option<AuditActor>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Task {
    pub id: TaskId,
    pub tenant_id: TenantId,
    pub task_type: String,
    pub agent_id: AgentId,
    pub payload: serde_json::Value,
    pub credentials_sealed: Option<Vec<u8>>,
    pub variables: BTreeMap<String, String>,
    pub timeout_seconds: u32,
    pub priority: i32,
    pub side_effects: bool,
    pub idempotency_key: Option<String>,
    pub read_back_of: Option<TaskId>,
    pub state: TaskState,
    /// Deliveries so far.
    pub attempts: u32,
    /// For `retry_wait`: not before this.
    pub next_attempt_at: Option<OffsetDateTime>,
    /// The current delivery, while `leased`.
    pub current_assignment: Option<AssignmentId>,
    pub lease_expires_at: Option<OffsetDateTime>,
    /// An operator asked to cancel a leased task; delivered to the agent with its next poll.
    pub cancel_requested: bool,
    /// The task succeeded because read-back found its intended state, not through a result.
    pub read_back: bool,
    /// Stable code of the last failure (`TIMEOUT`, `HEALTH_CHECK_FAILED`, `LEASE_EXPIRED`, …).
    pub error_code: Option<String>,
    /// The verified `resultData` of the deciding attempt, decoded.
    pub result: Option<serde_json::Value>,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
    pub finished_at: Option<OffsetDateTime>,
}

/// One delivery, with the signed result that ended it (stored as received, for audit).
#[derive(Debug, Clone, PartialEq)]
pub struct Attempt {
    pub assignment_id: AssignmentId,
    pub task_id: TaskId,
    pub agent_id: AgentId,
    /// The agent's session generation when the assignment was made.
    pub generation: i64,
    pub state: AttemptState,
    pub assigned_at: OffsetDateTime,
    pub lease_expires_at: OffsetDateTime,
    pub finished_at: Option<OffsetDateTime>,
    /// The verified result envelope, as JSON, including its signature.
    pub envelope: Option<serde_json::Value>,
    pub error_code: Option<String>,
    /// The poll that took this delivery promised the start handshake: the agent confirms it
    /// ([`TaskStore::start_attempt`]) before any side effect.
    pub start_handshake: bool,
    /// When the agent's start was confirmed; from then on the delivery may have had effects.
    pub started_at: Option<OffsetDateTime>,
    /// The step the agent last reported through a start.
    pub phase: Option<ProgressPhase>,
}

impl Attempt {
    /// The delivery a claim opens: leased, nothing reported yet.
    pub(crate) fn leased(
        assignment_id: AssignmentId,
        task_id: TaskId,
        agent_id: AgentId,
        generation: i64,
        assigned_at: OffsetDateTime,
        lease_expires_at: OffsetDateTime,
        start_handshake: bool,
    ) -> Attempt {
        Attempt {
            assignment_id,
            task_id,
            agent_id,
            generation,
            state: AttemptState::Leased,
            assigned_at,
            lease_expires_at,
            finished_at: None,
            envelope: None,
            error_code: None,
            start_handshake,
            started_at: None,
            phase: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum CreateTaskOutcome {
    Created(Task),
    /// Same idempotency key, same request: the existing task.
    Existing(Task),
    /// Same idempotency key, different request.
    KeyConflict,
    /// The agent is cordoned; nothing was inserted.
    AgentCordoned,
    /// The agent already holds `open` open tasks, at least [`NewTask::queue_cap`]; nothing was
    /// inserted.
    QueueFull {
        open: u64,
    },
}

#[derive(Debug, Clone, Default)]
pub struct TaskFilter {
    pub state: Option<TaskState>,
    pub agent_id: Option<AgentId>,
    pub task_type: Option<String>,
    pub order: berth_proto::task::ListOrder,
}

// One value per poll, moved once: boxing would only add an allocation and clumsier matches.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum ClaimOutcome {
    /// The next task for the agent, now leased under a fresh assignment.
    Claimed(Task, Attempt),
    /// Nothing claimable now.
    Empty,
    /// `generation` is not the agent's current generation.
    Fenced,
    /// The agent is gone or the certificate is not its binding.
    Revoked,
}

/// How an attempt ended, as the verified result says.
#[derive(Debug, Clone, PartialEq)]
pub enum AttemptResult {
    Succeeded,
    Failed { error_code: String, retriable: bool },
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct Completion {
    pub agent_id: AgentId,
    pub generation: i64,
    pub certificate_fingerprint: String,
    /// The DER of that certificate, recorded with the result in the audit log.
    pub certificate_der: Vec<u8>,
    pub task_id: TaskId,
    /// From the envelope; `None` means "the task's current assignment".
    pub assignment_id: Option<AssignmentId>,
    pub result: AttemptResult,
    /// The decoded `resultData`.
    pub result_data: Option<serde_json::Value>,
    /// The whole signed envelope as received.
    pub envelope: serde_json::Value,
    pub now: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq)]
pub enum CompleteOutcome {
    /// Recorded; the task in its new state.
    Recorded(Task),
    /// This assignment already ended with an identical envelope: the task as it is.
    Duplicate(Task),
    /// Stale generation, or the assignment is not (or no longer) the task's current lease.
    Fenced,
    Revoked,
    /// No such task for this agent.
    NotFound,
}

/// The agent asks to start a delivery ([`TaskStore::start_attempt`]).
#[derive(Debug, Clone)]
pub struct StartAttempt {
    pub agent_id: AgentId,
    pub generation: i64,
    pub certificate_fingerprint: String,
    pub task_id: TaskId,
    pub assignment_id: AssignmentId,
    /// The step the agent reports it is about to take; recorded on the attempt (the last one
    /// wins), `None` leaves it as it is.
    pub phase: Option<ProgressPhase>,
    pub now: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq)]
pub enum StartOutcome {
    /// The delivery is the agent's to run; recorded as started (at its first confirmation).
    Started(Attempt),
    /// Stale generation, or the assignment is not (or no longer) the task's live lease.
    Fenced,
    Revoked,
    /// No such task for this agent.
    NotFound,
}

#[derive(Debug, Clone, PartialEq)]
pub enum CancelOutcome {
    /// Pending, retry_wait or unknown: cancelled at once.
    Cancelled(Task),
    /// Leased: marked; the agent is told with its next poll and reports `cancelled`.
    Requested(Task),
    /// Already terminal: unchanged.
    AlreadyFinished(Task),
}

#[derive(Debug, Clone, PartialEq)]
pub enum RetryOutcome {
    /// Unknown or dead_letter: back to pending with a fresh attempt budget.
    Requeued(Task),
    /// Any other state: unchanged.
    NotRetriable(Task),
}

/// What a lease sweep did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LeaseSweep {
    /// Tasks with side effects whose lease ran out: now `unknown`, to be read back.
    pub unknown: Vec<Task>,
    /// Read-only tasks requeued (`retry_wait`): the server wakes their agents at
    /// `next_attempt_at`, since time alone makes them claimable.
    pub requeued: Vec<Task>,
    pub dead_lettered: u64,
}

/// The idempotency key of the read-back of `task`'s lost delivery number `attempts`: one
/// read-back per lost delivery. The read-back sweep ([`TaskStore::unknown_without_read_back`],
/// [`TaskStore::finished_read_backs_of_unknown`]) finds a task's read-back by this key.
pub fn read_back_key(task: TaskId, attempts: u32) -> String {
    format!("{READ_BACK_KEY_PREFIX}{task}:{attempts}")
}

/// The SQL of the read-back sweep builds keys from it too (as a bound parameter).
pub(crate) const READ_BACK_KEY_PREFIX: &str = "read-back:";

/// The idempotency key of the task that puts one component on one target of a deployment
/// (`purpose`: `deploy` or `rollback`): a reconciler that runs a step again finds the task the
/// first run created instead of creating a second.
pub fn deployment_task_key(
    deployment: berth_proto::DeploymentId,
    agent: AgentId,
    purpose: &str,
    component: &str,
) -> String {
    format!(
        "{}{purpose}:{component}",
        deployment_target_key_prefix(deployment, agent)
    )
}

/// What every [`deployment_task_key`] of one target of a deployment starts with: a cancel
/// finds the tasks a step created for a target by it.
pub(crate) fn deployment_target_key_prefix(
    deployment: berth_proto::DeploymentId,
    agent: AgentId,
) -> String {
    format!("{DEPLOYMENT_KEY_PREFIX}{deployment}:{agent}:")
}

/// The idempotency key of a drift read-back of one target of an environment, due at `due`
/// (unix milliseconds).
pub fn drift_check_key(
    environment: berth_proto::EnvironmentId,
    agent: AgentId,
    due: i64,
) -> String {
    format!("{DRIFT_KEY_PREFIX}{environment}:{agent}:{due}")
}

const DEPLOYMENT_KEY_PREFIX: &str = "deployment:";
const DRIFT_KEY_PREFIX: &str = "drift:";
const READINESS_KEY_PREFIX: &str = "readiness:";

/// The key of a readiness pass's probe of one host: a repeated sweep of the same pass finds
/// the task again, and the next pass (another `pass`) never reuses it.
pub fn readiness_probe_key(
    environment: berth_proto::EnvironmentId,
    pass: uuid::Uuid,
    agent: AgentId,
) -> String {
    format!("{READINESS_KEY_PREFIX}{environment}:{pass}:{agent}")
}

/// Whether an idempotency key is in the server's own namespace (read-backs, deployments, drift
/// checks), which a client's `Idempotency-Key` may never use: a client key there could stop a
/// read-back from being created, or slip its own task into a deployment.
pub fn is_internal_key(key: &str) -> bool {
    [
        READ_BACK_KEY_PREFIX,
        DEPLOYMENT_KEY_PREFIX,
        DRIFT_KEY_PREFIX,
        READINESS_KEY_PREFIX,
    ]
    .iter()
    .any(|prefix| key.starts_with(prefix))
}

/// Tasks, their deliveries and the wake-ups of long-polls. Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait TaskStore: Send + Sync {
    /// Inserts the task as `pending`, honouring the idempotency key (unique per tenant).
    /// `Conflict { constraint: "task_agent" }` when `agent_id` is not an agent of the tenant
    /// (checked in the same transaction, so a concurrently deleted agent gets no orphan task).
    /// In the same transaction, with the agent row locked, `lifecycle::admit` decides
    /// `AgentCordoned` and `QueueFull` (so concurrent creators cannot pass the cap together);
    /// a request whose idempotency key already names a task gets that task (or `KeyConflict`)
    /// even so.
    async fn create_task(&self, task: NewTask) -> Result<CreateTaskOutcome>;
    async fn get_task(&self, tenant: TenantId, id: TaskId) -> Result<Option<(Task, Vec<Attempt>)>>;
    /// Ordered by id (creation order), oldest or newest first as `filter.order` says; `after`
    /// is the previous page's `next`.
    async fn list_tasks(
        &self,
        tenant: TenantId,
        filter: &TaskFilter,
        after: Option<TaskId>,
        limit: u32,
    ) -> Result<Page<Task>>;

    /// In one transaction, with the generation and certificate binding checked in it: a
    /// suspended agent claims nothing (`Empty`, `lifecycle::may_claim`); otherwise picks the
    /// agent's next task and leases it under a fresh assignment (attempts + 1, lease until
    /// `now + timeout + lease_grace`).
    ///
    /// Order: the agent's open tasks (`pending`, `retry_wait`) are considered by priority
    /// (higher first), then creation order. Only the FIRST of them may be claimed (strict order):
    /// nothing is claimed when it is `retry_wait` with `next_attempt_at > now`, or when it has
    /// side effects while another side-effecting task of the agent is `leased`. A head the agent
    /// cannot run — a type no agent runs, or a kind whose capability is not among `capabilities`
    /// (the poll's seed strings) — fails there and then (`UNSUPPORTED_TASK_TYPE`,
    /// `CAPABILITY_MISSING`), and the next task is considered. `start_handshake` is recorded on
    /// the new delivery ([`Attempt::start_handshake`]).
    #[allow(clippy::too_many_arguments)]
    async fn claim_task(
        &self,
        agent: AgentId,
        generation: i64,
        certificate_fingerprint: &str,
        capabilities: &[String],
        start_handshake: bool,
        now: OffsetDateTime,
        lease_grace: std::time::Duration,
    ) -> Result<ClaimOutcome>;

    /// The start handshake, in one transaction that checks the generation, the binding, and
    /// that the assignment is the task's current, still-leased delivery whose lease has not run
    /// out at `start.now` (the same checks as a result). Then `started_at` is set, once: a
    /// repeated start of the same delivery answers `Started` with the first time. A lease sweep
    /// and a start of one delivery are serialised, so a delivery the sweep saw unstarted was
    /// never confirmed to its agent.
    async fn start_attempt(&self, start: StartAttempt) -> Result<StartOutcome>;

    /// How many open tasks (pending, leased, retry_wait) each of `agents` has; a selector sends
    /// new work to the capable agent with the fewest.
    async fn open_task_counts(&self, agents: &[AgentId]) -> Result<Vec<(AgentId, i64)>>;

    /// The agent's queued tasks (`pending`, `retry_wait`) in claim order (priority, then
    /// creation), at most `limit`: what a heartbeat answer lists. A read on the claim index;
    /// it claims nothing.
    async fn queued_tasks(&self, agent: AgentId, limit: u32) -> Result<Vec<Task>>;

    /// Leased tasks of the agent with `cancel_requested`, with their current assignment.
    async fn pending_cancellations(&self, agent: AgentId) -> Result<Vec<(TaskId, AssignmentId)>>;

    /// Records a verified result in one transaction that also checks generation, binding and
    /// that the assignment is the task's current, still-leased one whose lease has not run out at
    /// `completion.now`. Transitions: Succeeded →
    /// `succeeded`; Cancelled → `cancelled`; Failed and retriable → `retry_wait` (next attempt
    /// after `policy.delay_after(attempts)`) or `dead_letter` once attempts reach
    /// `policy.max_attempts`; Failed and not retriable → `failed`. The attempt row gets the
    /// envelope, and the tenant's audit chain a `task.result` entry (envelope and certificate),
    /// in the same transaction. A second submission for an already-ended assignment with an identical envelope
    /// is `Duplicate`; a different one is `Fenced`. A task whose cancellation was requested is
    /// never requeued: a retriable failure makes it `cancelled` instead of `retry_wait`.
    async fn complete_attempt(
        &self,
        completion: Completion,
        policy: &RetryPolicy,
    ) -> Result<CompleteOutcome>;

    /// A task that is cancelled or whose cancellation is requested gets a `task.cancel` audit
    /// entry by `actor` in the same transaction.
    async fn cancel_task(
        &self,
        tenant: TenantId,
        id: TaskId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<CancelOutcome>>;
    /// Unknown or dead_letter: back to `pending` with a fresh attempt budget (`attempts = 0`).
    /// In the same transaction the task's read-backs lose their idempotency keys: they were
    /// about losses before the retry, and [`read_back_key`] counts from 1 again, so a delivery
    /// lost after the retry gets a read-back of its own. A requeued task gets a `task.retry`
    /// audit entry by `actor` in the same transaction.
    async fn retry_task(
        &self,
        tenant: TenantId,
        id: TaskId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<RetryOutcome>>;

    /// Leases that ran out at `now`: the attempt becomes `expired`; a task whose delivery may
    /// have had effects (side effects, and a start that was confirmed or never promised:
    /// `lifecycle::may_have_run`) becomes `unknown` (never re-run automatically), any other is
    /// requeued or dead-lettered
    /// per `policy` (or `cancelled` if its cancellation was requested), with
    /// `error_code = LEASE_EXPIRED`. Row locks (SKIP LOCKED on PostgreSQL)
    /// so replicas can sweep concurrently without double transitions.
    async fn expire_leases(&self, now: OffsetDateTime, policy: &RetryPolicy) -> Result<LeaseSweep>;

    /// Resolves an `unknown` task by read-back: when `found` it becomes `succeeded` with
    /// `read_back = true` and `result = evidence`; otherwise it stays `unknown` (the evidence is
    /// stored as `result`). Returns the task, or None if it does not exist or is not `unknown`.
    async fn resolve_read_back(
        &self,
        id: TaskId,
        found: bool,
        evidence: serde_json::Value,
        now: OffsetDateTime,
    ) -> Result<Option<Task>>;

    /// Retention: deletes at most `limit` tasks that finished (`succeeded`, `failed`,
    /// `dead_letter`, `cancelled`, `expired`) before `before`, with their attempts; never an
    /// open or `unknown` task, nor one a remaining read-back names (`read_back_of`; the
    /// read-back goes first, the next batch takes its parent), nor the read-back that holds an
    /// `unknown` task's current [`read_back_key`]: that row is how the read-back sweep knows
    /// the loss was read back already ([`Self::unknown_without_read_back`]), and deleting it
    /// would schedule a second read-back. Their audit entries stay: the audit log is never
    /// pruned. How many were deleted.
    async fn prune_finished_tasks(&self, before: OffsetDateTime, limit: u32) -> Result<u64>;

    /// The read-back sweep, part one: `unknown` tasks whose lost delivery has no read-back yet,
    /// that is, no task of their tenant holds [`read_back_key`]`(id, attempts)`, and whose agent
    /// still exists (a deleted agent's task cannot be read back). A read-back that exists counts
    /// whatever its state (open, succeeded, or ended without deciding): one per lost delivery,
    /// so a task whose read-back failed stays `unknown` for an operator. Ordered by id, after
    /// `after`, at most `limit`.
    async fn unknown_without_read_back(
        &self,
        after: Option<TaskId>,
        limit: u32,
    ) -> Result<Vec<Task>>;

    /// The read-back sweep, part two: read-backs that `succeeded` while their parent
    /// (`read_back_of`) is still `unknown`, not yet applied. A read-back counts only if it holds
    /// its parent's current [`read_back_key`]; it is applied once the parent's `result` names it
    /// as `readBackTaskId` (the evidence the server passes to [`Self::resolve_read_back`]).
    /// Ordered by parent id, after `after` (a parent id), at most `limit`.
    async fn finished_read_backs_of_unknown(
        &self,
        after: Option<TaskId>,
        limit: u32,
    ) -> Result<Vec<Task>>;

    /// Wakes long-polls: yields the agent id each time a task for it becomes claimable or a
    /// cancellation is requested — in this process and, on PostgreSQL, in every replica
    /// (LISTEN/NOTIFY on the channel `berth_tasks`). Lagging receivers should wake everyone.
    /// The nil id `AgentId(Uuid::nil())` also means "wake everyone": events may have been lost
    /// (the PostgreSQL listener connection dropped and was re-established).
    fn task_events(&self) -> tokio::sync::broadcast::Receiver<AgentId>;
}
