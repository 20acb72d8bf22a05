//! Reconcilers: idempotent loops that move derived state toward the truth.
//!
//! Each is a [`Reconciler`] run by `workers::driver`, judged by the database's clock.
//!
//! - Agent staleness: late heartbeats make an agent `degraded` (2 intervals), missing ones
//!   `offline` (3).
//! - Delivery leases: a lease that ran out makes a side-effecting task `unknown` (then read back)
//!   and requeues or dead-letters a read-only one. Safe to run in several replicas at once: the
//!   store locks the rows it moves.
//! - Read-backs: every `unknown` task without a read-back of its lost delivery gets one, and every
//!   read-back that succeeded while its task is still `unknown` decides it. This, not the calls
//!   right after a lease expiry or a result, is what makes read-back survive a crash between its
//!   steps. Safe to repeat and to run in several replicas: scheduling is keyed by the lost
//!   delivery, and a verdict only moves a task that is still `unknown`.

use std::time::Duration;

use berth_proto::TaskId;
use berth_store::{StoreError, Task};

use crate::workers::reconciler::{Due, Pass, Reconciler, Schedule};
use crate::SharedState;

const LEASE_SWEEP_EVERY: Duration = Duration::from_millis(500);
const READ_BACK_SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Tasks per page of the read-back sweep; it reads every page each time.
const READ_BACK_PAGE: u32 = 100;

/// Agent staleness: one store statement per pass, which locks the rows it moves.
pub(crate) struct AgentStaleness(pub SharedState);

impl Reconciler for AgentStaleness {
    type Unit = ();

    fn name(&self) -> &'static str {
        "agent_staleness"
    }

    fn schedule(&self) -> Schedule {
        let interval = self.0.config.heartbeat_interval;
        Schedule::every((interval / 2).clamp(Duration::from_millis(200), Duration::from_secs(5)))
    }

    async fn due(&self, _pass: &Pass, _after: Option<&()>) -> Result<Due<()>, StoreError> {
        Ok(Due::all(vec![()]))
    }

    fn key(&self, _unit: &()) -> String {
        "agents".into()
    }

    fn claimed_by_store(&self) -> bool {
        true
    }

    async fn reconcile(&self, pass: &Pass, _unit: &()) -> Result<(), StoreError> {
        let state = &self.0;
        let interval = state.config.heartbeat_interval;
        let now = pass.now;
        let sweep = state
            .store
            .sweep_stale_agents(now - interval * 2, now - interval * 3)
            .await?;
        state.metrics.agents_marked("degraded", sweep.degraded);
        state.metrics.agents_marked("offline", sweep.offline);
        if sweep.offline > 0 || sweep.degraded > 0 {
            tracing::info!(
                offline = sweep.offline,
                degraded = sweep.degraded,
                "agent status swept"
            );
        }
        Ok(())
    }
}

/// Delivery leases: one store statement per pass, which locks the rows it moves.
pub(crate) struct DeliveryLeases(pub SharedState);

impl Reconciler for DeliveryLeases {
    type Unit = ();

    fn name(&self) -> &'static str {
        "delivery_leases"
    }

    fn schedule(&self) -> Schedule {
        Schedule::every(LEASE_SWEEP_EVERY)
    }

    async fn due(&self, _pass: &Pass, _after: Option<&()>) -> Result<Due<()>, StoreError> {
        Ok(Due::all(vec![()]))
    }

    fn key(&self, _unit: &()) -> String {
        "leases".into()
    }

    fn claimed_by_store(&self) -> bool {
        true
    }

    async fn reconcile(&self, pass: &Pass, _unit: &()) -> Result<(), StoreError> {
        let state = &self.0;
        let now = pass.now;
        let sweep = state
            .store
            .expire_leases(now, &state.config.retry_policy)
            .await?;
        state.metrics.leases_expired(
            sweep.unknown.len() as u64,
            sweep.requeued.len() as u64,
            sweep.dead_lettered,
        );
        for task in &sweep.requeued {
            let at = task.next_attempt_at.unwrap_or(now);
            state
                .wakeups
                .wake_after(task.agent_id, (at - now).try_into().unwrap_or_default());
        }
        // Committed: a crash from here on leaves these tasks to the read-back sweep.
        if !sweep.unknown.is_empty() {
            crate::infra::fault::crash_after("lease-expiry");
        }
        for task in &sweep.unknown {
            tracing::warn!(task_id = %task.id, agent_id = %task.agent_id, "delivery lease lost on a task with side effects: unknown");
            crate::services::readback::schedule(state, task).await;
        }
        Ok(())
    }
}

/// A unit of the read-back sweep.
pub(crate) enum ReadBackWork {
    /// An `unknown` task without a read-back of its lost delivery: schedule one.
    Schedule(Task),
    /// A read-back that succeeded while its task is still `unknown`: decide the task.
    Resolve(Task),
}

/// Completes read-back work that a crash (or a failed store call) left undone: every page of
/// tasks to schedule a read-back for, then every page of read-backs to decide.
pub(crate) struct ReadBacks(pub SharedState);

impl ReadBacks {
    async fn resolves(&self, after: Option<TaskId>) -> Result<Due<ReadBackWork>, StoreError> {
        let page = self
            .0
            .store
            .finished_read_backs_of_unknown(after, READ_BACK_PAGE)
            .await?;
        let more = page.len() >= READ_BACK_PAGE as usize;
        let units = page.into_iter().map(ReadBackWork::Resolve).collect();
        Ok(Due { units, more })
    }
}

impl Reconciler for ReadBacks {
    type Unit = ReadBackWork;

    fn name(&self) -> &'static str {
        "read_back"
    }

    fn schedule(&self) -> Schedule {
        Schedule::every(READ_BACK_SWEEP_EVERY)
    }

    async fn due(
        &self,
        _pass: &Pass,
        after: Option<&ReadBackWork>,
    ) -> Result<Due<ReadBackWork>, StoreError> {
        let after = match after {
            None => None,
            Some(ReadBackWork::Schedule(task)) => Some(task.id),
            Some(ReadBackWork::Resolve(read_back)) => {
                return self.resolves(read_back.read_back_of).await;
            }
        };
        let page = self
            .0
            .store
            .unknown_without_read_back(after, READ_BACK_PAGE)
            .await?;
        if page.len() >= READ_BACK_PAGE as usize {
            let units = page.into_iter().map(ReadBackWork::Schedule).collect();
            return Ok(Due { units, more: true });
        }
        // The last page of part one: part two's first page follows it.
        let mut due = self.resolves(None).await?;
        let mut units: Vec<ReadBackWork> = page.into_iter().map(ReadBackWork::Schedule).collect();
        units.append(&mut due.units);
        Ok(Due {
            units,
            more: due.more,
        })
    }

    fn key(&self, unit: &ReadBackWork) -> String {
        match unit {
            ReadBackWork::Schedule(task) => format!("schedule:{}", task.id),
            ReadBackWork::Resolve(read_back) => format!("resolve:{}", read_back.id),
        }
    }

    async fn reconcile(&self, _pass: &Pass, unit: &ReadBackWork) -> Result<(), StoreError> {
        let state = &self.0;
        match unit {
            ReadBackWork::Schedule(task) => {
                // A task with nothing to read back was reported when it became unknown.
                if crate::services::readback::intended_sticker(task).is_some() {
                    tracing::info!(task_id = %task.id, "unknown task without a read-back: scheduling one");
                    crate::services::readback::schedule(state, task).await;
                }
            }
            ReadBackWork::Resolve(read_back) => {
                if let Some(parent) = read_back.read_back_of {
                    tracing::info!(task_id = %parent, read_back = %read_back.id, "read-back finished without a verdict: deciding");
                    crate::services::readback::resolve(state, parent, read_back).await;
                }
            }
        }
        Ok(())
    }
}
