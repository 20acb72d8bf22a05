//! The task state machine both backends apply: whether a result may complete a delivery
//! ([`accept_completion`]), where a task goes when a delivery ends with a result
//! ([`completion_transition`]) or with its lease running out ([`expiry_transition`]), and the
//! deadline of a delivery; and the operator's holds on an agent: whether a new task is admitted
//! to its queue ([`admit`]: cordon, queue cap) and whether it may claim ([`may_claim`]:
//! suspension); and the fencing of every agent-runtime write ([`binding`]: current, fenced or
//! revoked). Pure functions of the rows read: no SQL, no connection, no clock.

use time::OffsetDateTime;

use crate::rows::millis;
use crate::{
    Attempt, AttemptResult, AttemptState, CompleteOutcome, CreateTaskOutcome, NewTask, RetryPolicy,
    Task, TaskState,
};

/// Where a task goes when a delivery ends: the one decision both backends apply.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Transition {
    pub state: TaskState,
    pub attempt: AttemptState,
    /// For `retry_wait`.
    pub next_attempt_at: Option<OffsetDateTime>,
    /// The new `error_code`; `None` keeps the previous one.
    pub error_code: Option<String>,
    /// `finished_at`, set when the task reaches a terminal state.
    pub finished_at: Option<OffsetDateTime>,
}

/// Error code of a delivery whose lease ran out before a result arrived.
pub(crate) const LEASE_EXPIRED: &str = "LEASE_EXPIRED";
/// Error code of the open tasks of a deleted agent.
pub(crate) const AGENT_DELETED: &str = "AGENT_DELETED";

/// A failed delivery of a task that may run again: `retry_wait` after the policy's backoff, or
/// `dead_letter` once `attempts` reached the budget. A task an operator asked to cancel is not
/// requeued against that wish: it becomes `cancelled`.
fn requeue(
    attempts: u32,
    cancel_requested: bool,
    policy: &RetryPolicy,
    now: OffsetDateTime,
    attempt: AttemptState,
    error_code: &str,
) -> Transition {
    let (state, next_attempt_at) = if cancel_requested {
        (TaskState::Cancelled, None)
    } else if attempts >= policy.max_attempts {
        (TaskState::DeadLetter, None)
    } else {
        (
            TaskState::RetryWait,
            Some(millis(now + policy.delay_after(attempts))),
        )
    };
    Transition {
        state,
        attempt,
        next_attempt_at,
        error_code: Some(error_code.to_string()),
        finished_at: state.is_terminal().then(|| millis(now)),
    }
}

/// How an agent-runtime call stands against its agent's row: the fencing decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Binding {
    /// The caller's certificate is the agent's binding and its generation the session's.
    Current,
    /// The agent's certificate, but another session's generation (older or newer): a process
    /// that lost its session, or one that never held this one.
    Fenced,
    /// The agent is gone, or bound to another certificate: nothing the caller says counts.
    Revoked,
}

/// The one fencing decision every agent-runtime write takes (claims, starts, results,
/// heartbeats, a certificate's rebind), on both backends and in the batches. `stored` is the
/// agent's row read in the write's transaction, `(certificate_fingerprint, generation)`, or
/// `None` when there is no such agent. The certificate is checked first: a caller that is not
/// the agent's binding is revoked whatever generation it names.
pub(crate) fn binding(
    stored: Option<(Option<&str>, i64)>,
    certificate_fingerprint: &str,
    generation: i64,
) -> Binding {
    match stored {
        Some((Some(bound), current)) if bound == certificate_fingerprint => {
            if current == generation {
                Binding::Current
            } else {
                Binding::Fenced
            }
        }
        _ => Binding::Revoked,
    }
}

/// The delivery a result may complete, or the answer when it may not: no such attempt, or one
/// already finished (the identical envelope again is a duplicate, answered idempotently; any
/// other is fenced), or a delivery that is no longer current. The lease is the proof window:
/// a result after its deadline is refused even before the sweep has moved the task, so "on
/// time" never depends on the sweeper's pace. A delivery belongs to the session that claimed
/// it: a result sent under any other `generation` (a later session of the same agent included)
/// is fenced, as [`is_live_lease`] says. `now` is in whole milliseconds.
pub(crate) fn accept_completion(
    task: &Task,
    attempt: Option<Attempt>,
    envelope: &serde_json::Value,
    generation: i64,
    now: OffsetDateTime,
) -> Result<Attempt, Refused> {
    let Some(attempt) = attempt else {
        return Err(Refused::Fenced);
    };
    if attempt.state != AttemptState::Leased {
        return Err(if attempt.envelope.as_ref() == Some(envelope) {
            Refused::Duplicate
        } else {
            Refused::Fenced
        });
    }
    if !is_live_lease(task, &attempt, generation, now) {
        return Err(Refused::Fenced);
    }
    Ok(attempt)
}

/// Whether `attempt` is `task`'s current delivery, claimed by the session of `generation`, and
/// its lease holds at `now`: what a result and a start must both find. The generation is the
/// session's own, not merely the agent's current one (which [`binding`] checks): when a process
/// acquires a new session, the deliveries of the old one are not handed over to it; they end as
/// lost leases do (seed 003: a lease is held by one generation, and every write is fenced
/// against it), so a newer process can never complete or start what an older one may be running.
pub(crate) fn is_live_lease(
    task: &Task,
    attempt: &Attempt,
    generation: i64,
    now: OffsetDateTime,
) -> bool {
    attempt.state == AttemptState::Leased
        && attempt.generation == generation
        && task.state == TaskState::Leased
        && task.current_assignment == Some(attempt.assignment_id)
        && attempt.lease_expires_at >= now
}

/// Whether a delivery that ended without a result may have changed the host: its task has side
/// effects and its agent either confirmed the start or never promised to ask
/// ([`Attempt::start_handshake`], which seed 000 agents do not send). Only a delivery that
/// provably never started is safe to hand out again.
pub(crate) fn may_have_run(side_effects: bool, attempt: Option<&Attempt>) -> bool {
    side_effects && attempt.is_none_or(|a| !a.start_handshake || a.started_at.is_some())
}

/// Why [`accept_completion`] refused a result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    Fenced,
    Duplicate,
}

impl Refused {
    /// The answer for a result refused on `task`.
    pub(crate) fn outcome(self, task: Task) -> CompleteOutcome {
        match self {
            Refused::Fenced => CompleteOutcome::Fenced,
            Refused::Duplicate => CompleteOutcome::Duplicate(task),
        }
    }
}

/// A verified result for the task's current delivery, its `attempts`-th.
pub(crate) fn completion_transition(
    result: &AttemptResult,
    attempts: u32,
    cancel_requested: bool,
    policy: &RetryPolicy,
    now: OffsetDateTime,
) -> Transition {
    let done = |state, attempt, error_code: Option<&String>| Transition {
        state,
        attempt,
        next_attempt_at: None,
        error_code: error_code.cloned(),
        finished_at: Some(millis(now)),
    };
    match result {
        AttemptResult::Succeeded => done(TaskState::Succeeded, AttemptState::Succeeded, None),
        AttemptResult::Cancelled => done(TaskState::Cancelled, AttemptState::Cancelled, None),
        AttemptResult::Failed {
            error_code,
            retriable: false,
        } => done(TaskState::Failed, AttemptState::Failed, Some(error_code)),
        AttemptResult::Failed {
            error_code,
            retriable: true,
        } => requeue(
            attempts,
            cancel_requested,
            policy,
            now,
            AttemptState::Failed,
            error_code,
        ),
    }
}

/// A lease that ran out: a delivery that [`may_have_run`] makes its task `unknown` (never re-run
/// automatically); any other is requeued like a retriable failure.
pub(crate) fn expiry_transition(
    may_have_run: bool,
    attempts: u32,
    cancel_requested: bool,
    policy: &RetryPolicy,
    now: OffsetDateTime,
) -> Transition {
    if may_have_run {
        Transition {
            state: TaskState::Unknown,
            attempt: AttemptState::Expired,
            next_attempt_at: None,
            error_code: Some(LEASE_EXPIRED.to_string()),
            finished_at: None,
        }
    } else {
        requeue(
            attempts,
            cancel_requested,
            policy,
            now,
            AttemptState::Expired,
            LEASE_EXPIRED,
        )
    }
}

/// The deadline of a delivery: the task timeout plus the grace period.
pub(crate) fn lease_deadline(
    now: OffsetDateTime,
    timeout_seconds: u32,
    grace: std::time::Duration,
) -> OffsetDateTime {
    millis(now + std::time::Duration::from_secs(u64::from(timeout_seconds)) + grace)
}

/// Why the head of an agent's queue can never run on the agent that polls, as its error code:
/// a type no agent runs, or a capability the poll does not list. Such a task fails at once instead
/// of being handed out (or of blocking the queue behind it).
pub(crate) fn unrunnable(task_type: &str, capabilities: &[String]) -> Option<&'static str> {
    use berth_proto::error::codes;
    match berth_proto::kind::TaskKind::parse(task_type) {
        None => Some(codes::UNSUPPORTED_TASK_TYPE),
        Some(kind) if !kind.runs_on(capabilities) => Some(codes::CAPABILITY_MISSING),
        Some(_) => None,
    }
}

/// The task states that count as open for the queue cap: every state that is not terminal
/// (`unknown` holds its agent's attention until read-back). Both backends count with this list.
pub(crate) const OPEN_STATES_SQL: &str = "('pending', 'leased', 'retry_wait', 'unknown')";

/// Why a new task is not queued for its agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NotAdmitted {
    Cordoned,
    QueueFull { open: u64 },
}

impl NotAdmitted {
    pub(crate) fn outcome(self) -> CreateTaskOutcome {
        match self {
            NotAdmitted::Cordoned => CreateTaskOutcome::AgentCordoned,
            NotAdmitted::QueueFull { open } => CreateTaskOutcome::QueueFull { open },
        }
    }
}

/// The cap a new task is counted against, if any: a read-back never is (it resolves a task the
/// agent already had, and refusing it would leave that task `unknown`).
pub(crate) fn queue_cap(task: &NewTask) -> Option<u32> {
    task.queue_cap.filter(|_| task.read_back_of.is_none())
}

/// Whether `task` may join its agent's queue: not when the agent is cordoned, nor when it already
/// has `open` open tasks at or above the task's [`queue_cap`]. A read-back passes both. `open` is
/// counted in the insert's transaction with the agent row locked; `None` when there is no cap.
pub(crate) fn admit(task: &NewTask, cordoned: bool, open: Option<u64>) -> Result<(), NotAdmitted> {
    if task.read_back_of.is_some() {
        return Ok(());
    }
    if cordoned {
        return Err(NotAdmitted::Cordoned);
    }
    match (queue_cap(task), open) {
        (Some(cap), Some(open)) if open >= u64::from(cap) => Err(NotAdmitted::QueueFull { open }),
        _ => Ok(()),
    }
}

/// Whether an agent's poll may claim anything: a suspended agent claims nothing new (its
/// leased tasks may still finish). A cordon does not stop claims: drain waits on them.
pub(crate) fn may_claim(suspended: bool) -> bool {
    !suspended
}

#[cfg(test)]
mod tests {
    //! Every row is one explicit expectation. The policy is the default one: backoff 1 s, 8 s,
    //! 64 s, 300 s (the last repeats), dead letter once 5 deliveries failed.

    use super::*;
    use berth_proto::{AgentId, AssignmentId, TaskId, TenantId};
    use std::collections::BTreeMap;
    use time::macros::datetime;
    use time::Duration;

    /// Sub-millisecond digits, so every timestamp a transition sets must be truncated.
    const NOW: OffsetDateTime = datetime!(2030-06-01 12:00:00.123_456_789 UTC);
    /// `NOW` in whole milliseconds.
    const NOW_MS: OffsetDateTime = datetime!(2030-06-01 12:00:00.123 UTC);

    use AttemptState as A;
    use TaskState as T;

    /// What a transition should be: `next` is the delay before the next delivery, `finished`
    /// whether `finished_at` is set (always to `NOW_MS`).
    fn expect(
        state: TaskState,
        attempt: AttemptState,
        next: Option<Duration>,
        error_code: Option<&str>,
        finished: bool,
    ) -> Transition {
        Transition {
            state,
            attempt,
            next_attempt_at: next.map(|d| NOW_MS + d),
            error_code: error_code.map(str::to_string),
            finished_at: finished.then_some(NOW_MS),
        }
    }

    fn failed(retriable: bool) -> AttemptResult {
        AttemptResult::Failed {
            error_code: "BOOM".to_string(),
            retriable,
        }
    }

    #[test]
    fn completion_transition_table() {
        let policy = RetryPolicy::default();
        let s = Duration::seconds;
        #[rustfmt::skip]
        let table: Vec<(AttemptResult, u32, bool, Transition)> = vec![
            // (result, attempts, cancel_requested) => transition
            (AttemptResult::Succeeded, 1, false, expect(T::Succeeded, A::Succeeded, None, None, true)),
            (AttemptResult::Succeeded, 5, false, expect(T::Succeeded, A::Succeeded, None, None, true)),
            // A result that arrived wins over a cancellation that was only requested.
            (AttemptResult::Succeeded, 1, true, expect(T::Succeeded, A::Succeeded, None, None, true)),
            (AttemptResult::Cancelled, 1, false, expect(T::Cancelled, A::Cancelled, None, None, true)),
            (AttemptResult::Cancelled, 1, true, expect(T::Cancelled, A::Cancelled, None, None, true)),
            (failed(false), 1, false, expect(T::Failed, A::Failed, None, Some("BOOM"), true)),
            (failed(false), 5, false, expect(T::Failed, A::Failed, None, Some("BOOM"), true)),
            (failed(false), 1, true, expect(T::Failed, A::Failed, None, Some("BOOM"), true)),
            // Retriable: requeued after the backoff of its attempt, the last entry repeating...
            (failed(true), 0, false, expect(T::RetryWait, A::Failed, Some(s(1)), Some("BOOM"), false)),
            (failed(true), 1, false, expect(T::RetryWait, A::Failed, Some(s(1)), Some("BOOM"), false)),
            (failed(true), 2, false, expect(T::RetryWait, A::Failed, Some(s(8)), Some("BOOM"), false)),
            (failed(true), 3, false, expect(T::RetryWait, A::Failed, Some(s(64)), Some("BOOM"), false)),
            (failed(true), 4, false, expect(T::RetryWait, A::Failed, Some(s(300)), Some("BOOM"), false)),
            // ...dead-lettered once the budget is spent...
            (failed(true), 5, false, expect(T::DeadLetter, A::Failed, None, Some("BOOM"), true)),
            (failed(true), 6, false, expect(T::DeadLetter, A::Failed, None, Some("BOOM"), true)),
            // ...and never requeued against a requested cancellation, budget or not.
            (failed(true), 1, true, expect(T::Cancelled, A::Failed, None, Some("BOOM"), true)),
            (failed(true), 5, true, expect(T::Cancelled, A::Failed, None, Some("BOOM"), true)),
        ];
        for (result, attempts, cancel_requested, expected) in table {
            assert_eq!(
                completion_transition(&result, attempts, cancel_requested, &policy, NOW),
                expected,
                "{result:?} after {attempts} attempts, cancel_requested={cancel_requested}"
            );
        }
    }

    #[test]
    fn expiry_transition_table() {
        let policy = RetryPolicy::default();
        let s = Duration::seconds;
        let lost = Some(LEASE_EXPIRED);
        #[rustfmt::skip]
        let table: Vec<(bool, u32, bool, Transition)> = vec![
            // (may_have_run, attempts, cancel_requested) => transition
            // It may have run: unknown, whatever the budget or a cancellation.
            (true, 1, false, expect(T::Unknown, A::Expired, None, lost, false)),
            (true, 5, false, expect(T::Unknown, A::Expired, None, lost, false)),
            (true, 6, false, expect(T::Unknown, A::Expired, None, lost, false)),
            (true, 1, true, expect(T::Unknown, A::Expired, None, lost, false)),
            (true, 5, true, expect(T::Unknown, A::Expired, None, lost, false)),
            // Provably did nothing (read-only, or never started): requeued like a retriable
            // failure.
            (false, 1, false, expect(T::RetryWait, A::Expired, Some(s(1)), lost, false)),
            (false, 2, false, expect(T::RetryWait, A::Expired, Some(s(8)), lost, false)),
            (false, 3, false, expect(T::RetryWait, A::Expired, Some(s(64)), lost, false)),
            (false, 4, false, expect(T::RetryWait, A::Expired, Some(s(300)), lost, false)),
            (false, 5, false, expect(T::DeadLetter, A::Expired, None, lost, true)),
            (false, 6, false, expect(T::DeadLetter, A::Expired, None, lost, true)),
            (false, 1, true, expect(T::Cancelled, A::Expired, None, lost, true)),
            (false, 5, true, expect(T::Cancelled, A::Expired, None, lost, true)),
        ];
        for (may_have_run, attempts, cancel_requested, expected) in table {
            assert_eq!(
                expiry_transition(may_have_run, attempts, cancel_requested, &policy, NOW),
                expected,
                "may_have_run={may_have_run} after {attempts} attempts, \
                 cancel_requested={cancel_requested}"
            );
        }
    }

    #[test]
    fn only_a_promised_start_that_never_came_proves_nothing_ran() {
        let attempt = |start_handshake, started: bool| Attempt {
            start_handshake,
            started_at: started.then_some(NOW),
            ..attempt_of(
                &leased_task(AssignmentId::new()),
                AttemptState::Leased,
                None,
            )
        };
        #[rustfmt::skip]
        let table = [
            // (side_effects, attempt) => may have run
            (true, Some(attempt(true, false)), false),
            (true, Some(attempt(true, true)), true),
            // A seed 000 agent never asks: whatever it was handed may have run.
            (true, Some(attempt(false, false)), true),
            (true, None, true),
            (false, Some(attempt(false, false)), false),
            (false, Some(attempt(true, true)), false),
        ];
        for (side_effects, attempt, expected) in table {
            assert_eq!(
                may_have_run(side_effects, attempt.as_ref()),
                expected,
                "side_effects={side_effects} {attempt:?}"
            );
        }
    }

    #[test]
    fn requeue_follows_a_custom_policy() {
        let policy = RetryPolicy {
            backoff: vec![std::time::Duration::from_millis(1500)],
            max_attempts: 2,
        };
        assert_eq!(
            completion_transition(&failed(true), 1, false, &policy, NOW),
            expect(
                T::RetryWait,
                A::Failed,
                Some(Duration::milliseconds(1500)),
                Some("BOOM"),
                false
            )
        );
        assert_eq!(
            expiry_transition(false, 2, false, &policy, NOW),
            expect(T::DeadLetter, A::Expired, None, Some(LEASE_EXPIRED), true)
        );
    }

    /// Every terminal state a transition can reach sets `finished_at`, and no other does.
    #[test]
    fn finished_at_is_set_exactly_for_terminal_states() {
        let policy = RetryPolicy::default();
        let mut transitions = Vec::new();
        for cancel_requested in [false, true] {
            for attempts in 0..=6 {
                for result in [
                    AttemptResult::Succeeded,
                    AttemptResult::Cancelled,
                    failed(false),
                    failed(true),
                ] {
                    transitions.push(completion_transition(
                        &result,
                        attempts,
                        cancel_requested,
                        &policy,
                        NOW,
                    ));
                }
                for may_have_run in [false, true] {
                    transitions.push(expiry_transition(
                        may_have_run,
                        attempts,
                        cancel_requested,
                        &policy,
                        NOW,
                    ));
                }
            }
        }
        for t in transitions {
            assert_eq!(t.finished_at.is_some(), t.state.is_terminal(), "{t:?}");
            assert_eq!(
                t.next_attempt_at.is_some(),
                t.state == T::RetryWait,
                "{t:?}"
            );
        }
    }

    fn leased_task(assignment: AssignmentId) -> Task {
        Task {
            id: TaskId::new(),
            tenant_id: TenantId::new(),
            task_type: "health-check".to_string(),
            agent_id: AgentId::new(),
            payload: serde_json::json!({}),
            credentials_sealed: None,
            variables: BTreeMap::new(),
            timeout_seconds: 30,
            priority: 0,
            side_effects: false,
            idempotency_key: None,
            read_back_of: None,
            state: T::Leased,
            attempts: 1,
            next_attempt_at: None,
            current_assignment: Some(assignment),
            lease_expires_at: Some(NOW_MS),
            cancel_requested: false,
            read_back: false,
            error_code: None,
            result: None,
            created_at: NOW_MS,
            updated_at: NOW_MS,
            finished_at: None,
        }
    }

    fn attempt_of(task: &Task, state: AttemptState, envelope: Option<&str>) -> Attempt {
        Attempt {
            assignment_id: task.current_assignment.expect("leased"),
            task_id: task.id,
            agent_id: task.agent_id,
            generation: 1,
            state,
            assigned_at: NOW_MS - Duration::seconds(10),
            lease_expires_at: NOW_MS,
            finished_at: None,
            envelope: envelope.map(|e| serde_json::json!({ "e": e })),
            error_code: None,
            start_handshake: false,
            started_at: None,
            phase: None,
        }
    }

    /// (case, task, the attempt the result names, the result's generation, now) => accepted,
    /// or why not.
    type AcceptCase = (
        &'static str,
        Task,
        Option<Attempt>,
        i64,
        OffsetDateTime,
        Result<(), Refused>,
    );

    #[test]
    fn accept_completion_table() {
        use Refused::{Duplicate, Fenced};
        let envelope = serde_json::json!({ "e": "this" });
        let task = leased_task(AssignmentId::new());
        // Claimed by the session of generation 1 (`attempt_of`).
        let live = attempt_of(&task, A::Leased, None);
        let later = NOW_MS + Duration::milliseconds(1);
        let earlier = NOW_MS - Duration::milliseconds(1);
        let with = |f: fn(&mut Task)| {
            let mut t = task.clone();
            f(&mut t);
            t
        };
        #[rustfmt::skip]
        let table: Vec<AcceptCase> = vec![
            ("the live delivery, before its deadline", task.clone(), Some(live.clone()), 1, earlier, Ok(())),
            ("the live delivery, at its deadline", task.clone(), Some(live.clone()), 1, NOW_MS, Ok(())),
            ("the live delivery, after its deadline", task.clone(), Some(live.clone()), 1, later, Err(Fenced)),
            ("no such delivery", task.clone(), None, 1, earlier, Err(Fenced)),
            // A delivery belongs to the session that claimed it: a later session of the same
            // agent (or an earlier one) cannot complete it, even with its lease live.
            ("the live delivery, from a newer session", task.clone(), Some(live.clone()), 2, earlier, Err(Fenced)),
            ("the live delivery, from an older session", task.clone(), Some(live.clone()), 0, earlier, Err(Fenced)),
            // An ended delivery: the same envelope again is a duplicate, anything else fenced.
            ("succeeded, same envelope", task.clone(), Some(attempt_of(&task, A::Succeeded, Some("this"))), 1, earlier, Err(Duplicate)),
            ("failed, same envelope", task.clone(), Some(attempt_of(&task, A::Failed, Some("this"))), 1, earlier, Err(Duplicate)),
            ("cancelled, same envelope", task.clone(), Some(attempt_of(&task, A::Cancelled, Some("this"))), 1, earlier, Err(Duplicate)),
            ("same envelope, after the deadline", task.clone(), Some(attempt_of(&task, A::Succeeded, Some("this"))), 1, later, Err(Duplicate)),
            // Answering a duplicate writes nothing, so it needs no session of its own.
            ("same envelope, from a newer session", task.clone(), Some(attempt_of(&task, A::Succeeded, Some("this"))), 2, earlier, Err(Duplicate)),
            ("succeeded, other envelope", task.clone(), Some(attempt_of(&task, A::Succeeded, Some("other"))), 1, earlier, Err(Fenced)),
            ("expired, no envelope", task.clone(), Some(attempt_of(&task, A::Expired, None)), 1, earlier, Err(Fenced)),
            // A live attempt row, but the task moved on.
            ("task no longer leased", with(|t| t.state = T::RetryWait), Some(live.clone()), 1, earlier, Err(Fenced)),
            ("task unknown", with(|t| t.state = T::Unknown), Some(live.clone()), 1, earlier, Err(Fenced)),
            ("task leased under another assignment", with(|t| t.current_assignment = Some(AssignmentId::new())), Some(live.clone()), 1, earlier, Err(Fenced)),
            ("task without an assignment", with(|t| t.current_assignment = None), Some(live.clone()), 1, earlier, Err(Fenced)),
        ];
        for (case, task, attempt, generation, now, expected) in table {
            let got = accept_completion(&task, attempt.clone(), &envelope, generation, now);
            match (got, expected) {
                (Ok(accepted), Ok(())) => assert_eq!(Some(accepted), attempt, "{case}"),
                (got, expected) => assert_eq!(got.map(|_| ()), expected, "{case}"),
            }
        }
    }

    #[test]
    fn is_live_lease_table() {
        let task = leased_task(AssignmentId::new());
        let live = attempt_of(&task, A::Leased, None);
        let later = NOW_MS + Duration::milliseconds(1);
        #[rustfmt::skip]
        let table: Vec<(&str, Attempt, i64, OffsetDateTime, bool)> = vec![
            // (case, attempt, the caller's generation, now) => live
            ("its own session, in time", live.clone(), 1, NOW_MS, true),
            ("its own session, too late", live.clone(), 1, later, false),
            ("a newer session", live.clone(), 2, NOW_MS, false),
            ("an older session", live.clone(), 0, NOW_MS, false),
            ("an ended delivery", attempt_of(&task, A::Succeeded, None), 1, NOW_MS, false),
        ];
        for (case, attempt, generation, now, expected) in table {
            assert_eq!(
                is_live_lease(&task, &attempt, generation, now),
                expected,
                "{case}"
            );
        }
    }

    /// (case, the agent's row (fingerprint, generation), the caller's fingerprint and
    /// generation) => decision.
    type BindingCase = (
        &'static str,
        Option<(Option<&'static str>, i64)>,
        &'static str,
        i64,
        Binding,
    );

    #[test]
    fn binding_table() {
        use Binding::{Current, Fenced, Revoked};
        #[rustfmt::skip]
        let table: Vec<BindingCase> = vec![
            ("bound, same generation", Some((Some("fp"), 3)), "fp", 3, Current),
            ("bound, older generation", Some((Some("fp"), 3)), "fp", 2, Fenced),
            ("bound, newer generation", Some((Some("fp"), 3)), "fp", 4, Fenced),
            ("bound, generation 0 never acquired", Some((Some("fp"), 0)), "fp", 0, Current),
            ("another certificate, same generation", Some((Some("other"), 3)), "fp", 3, Revoked),
            // The certificate is checked first: a stale generation of a revoked caller is
            // still revoked, so it never learns it only needs a new session.
            ("another certificate, stale generation", Some((Some("other"), 3)), "fp", 2, Revoked),
            ("unbound agent", Some((None, 3)), "fp", 3, Revoked),
            ("no such agent", None, "fp", 3, Revoked),
            ("an empty fingerprint is not a match for unbound", Some((None, 3)), "", 3, Revoked),
        ];
        for (case, stored, fingerprint, generation, expected) in table {
            assert_eq!(binding(stored, fingerprint, generation), expected, "{case}");
        }
    }

    #[test]
    fn refusals_answer() {
        let task = leased_task(AssignmentId::new());
        assert_eq!(
            Refused::Fenced.outcome(task.clone()),
            CompleteOutcome::Fenced
        );
        assert_eq!(
            Refused::Duplicate.outcome(task.clone()),
            CompleteOutcome::Duplicate(task)
        );
    }

    #[test]
    fn lease_deadline_is_timeout_plus_grace_in_whole_milliseconds() {
        let grace = std::time::Duration::from_secs(30);
        assert_eq!(
            lease_deadline(NOW, 60, grace),
            datetime!(2030-06-01 12:01:30.123 UTC)
        );
        assert_eq!(lease_deadline(NOW, 0, std::time::Duration::ZERO), NOW_MS);
    }

    #[test]
    fn unrunnable_heads() {
        let caps = |c: &[&str]| c.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let rows: [(&str, &[&str], Option<&str>); 6] = [
            ("inspect", &[], None),
            ("write-sticker", &["docker"], None),
            ("docker.run", &["docker", "compose"], None),
            ("docker.run", &["compose"], Some("CAPABILITY_MISSING")),
            ("compose.up", &[], Some("CAPABILITY_MISSING")),
            ("deploy", &["docker"], Some("UNSUPPORTED_TASK_TYPE")),
        ];
        for (task_type, offered, expected) in rows {
            assert_eq!(
                unrunnable(task_type, &caps(offered)),
                expected,
                "{task_type} {offered:?}"
            );
        }
    }

    /// (case, task, cordoned, open tasks counted) => admitted, or why not.
    type AdmitCase = (
        &'static str,
        NewTask,
        bool,
        Option<u64>,
        Result<(), NotAdmitted>,
    );

    #[test]
    fn admission_table() {
        let task = |cap: Option<u32>, read_back: bool| NewTask {
            id: TaskId::new(),
            tenant_id: TenantId::new(),
            task_type: "inspect".into(),
            agent_id: AgentId::new(),
            payload: serde_json::json!({}),
            credentials_sealed: None,
            variables: BTreeMap::new(),
            timeout_seconds: 30,
            priority: 0,
            side_effects: false,
            idempotency_key: None,
            request_hash: None,
            read_back_of: read_back.then(TaskId::new),
            queue_cap: cap,
            created_at: NOW_MS,
            created_by: None,
        };
        use NotAdmitted::*;
        #[rustfmt::skip]
        let table: Vec<AdmitCase> = vec![
            ("no cap, not cordoned", task(None, false), false, None, Ok(())),
            ("below the cap", task(Some(5), false), false, Some(4), Ok(())),
            ("at the cap", task(Some(5), false), false, Some(5), Err(QueueFull { open: 5 })),
            ("over the cap", task(Some(5), false), false, Some(9), Err(QueueFull { open: 9 })),
            ("a cap of 0 refuses all", task(Some(0), false), false, Some(0), Err(QueueFull { open: 0 })),
            ("cordoned", task(None, false), true, None, Err(Cordoned)),
            ("cordoned wins over the cap", task(Some(5), false), true, Some(9), Err(Cordoned)),
            ("a read-back at the cap", task(Some(5), true), false, Some(9), Ok(())),
            ("a read-back of a cordoned agent", task(Some(5), true), true, Some(9), Ok(())),
        ];
        for (case, task, cordoned, open, expected) in table {
            assert_eq!(admit(&task, cordoned, open), expected, "{case}");
        }
        assert_eq!(queue_cap(&task(Some(5), true)), None);
        assert_eq!(queue_cap(&task(Some(5), false)), Some(5));
        assert!(may_claim(false));
        assert!(!may_claim(true));
    }
}
