//! What a result does to its task and delivery on PostgreSQL: the one decision the single call
//! (`tasks.rs`) and the batch (`task_batches.rs`) both take, with the `task.result` audit entry
//! it stages. Pure apart from encoding that entry: no SQL, no connection.

use berth_proto::TenantId;
use time::OffsetDateTime;

use crate::domain::audit::result_event;
use crate::lifecycle;
use crate::rows::millis;
use crate::{Attempt, CompleteOutcome, Completion, Result, RetryPolicy, Task};

/// A result accepted for its locked task and delivery ([`decide_completion`]).
pub(super) struct Accepted {
    pub(super) attempt: Attempt,
    pub(super) next: lifecycle::Transition,
    /// The staged `task.result` audit entry: its tenant and draft.
    pub(super) audit: (TenantId, String),
    /// The completion's time in whole milliseconds.
    pub(super) now: OffsetDateTime,
}

/// What a result does to its task and delivery, both read under their locks: refused (the
/// answer), or accepted. The single call and the batch (`task_batches.rs`) both decide by it.
pub(super) fn decide_completion(
    task: &Task,
    attempt: Option<Attempt>,
    completion: &Completion,
    policy: &RetryPolicy,
) -> Result<std::result::Result<Accepted, CompleteOutcome>> {
    let now = millis(completion.now);
    let attempt = match lifecycle::accept_completion(
        task,
        attempt,
        &completion.envelope,
        completion.generation,
        now,
    ) {
        Ok(attempt) => attempt,
        Err(refused) => return Ok(Err(refused.outcome(task.clone()))),
    };
    let next = lifecycle::completion_transition(
        &completion.result,
        task.attempts,
        task.cancel_requested,
        policy,
        now,
    );
    let audit = super::sequencer::staged(result_event(
        completion,
        task.tenant_id,
        task.id,
        next.state,
    ))?;
    Ok(Ok(Accepted {
        attempt,
        next,
        audit,
        now,
    }))
}
