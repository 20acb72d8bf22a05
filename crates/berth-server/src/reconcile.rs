//! Reconcilers: idempotent loops that move derived state toward the truth.
//!
//! - Agent staleness: late heartbeats make an agent `degraded` (2 intervals), missing ones
//!   `offline` (3).
//! - Delivery leases: a lease that ran out makes a side-effecting task `unknown` (then read back)
//!   and requeues or dead-letters a read-only one. Safe to run in several replicas at once: the
//!   store locks the rows it moves.

use berth_proto::error::ErrorChain;
use std::time::Duration;

use time::OffsetDateTime;
use tokio::sync::watch;

use crate::SharedState;

const LEASE_SWEEP_EVERY: Duration = Duration::from_millis(500);

pub async fn run(state: SharedState, mut stop: watch::Receiver<bool>) {
    let interval = state.config.heartbeat_interval;
    let staleness_every = (interval / 2).clamp(Duration::from_millis(200), Duration::from_secs(5));
    let mut staleness = tokio::time::interval(staleness_every);
    let mut leases = tokio::time::interval(LEASE_SWEEP_EVERY);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = staleness.tick() => sweep_agents(&state).await,
            _ = leases.tick() => sweep_leases(&state).await,
        }
    }
}

async fn sweep_agents(state: &SharedState) {
    let interval = state.config.heartbeat_interval;
    let now = OffsetDateTime::now_utc();
    match state
        .store
        .sweep_stale_agents(now - interval * 2, now - interval * 3)
        .await
    {
        Ok(sweep) => {
            state.metrics.agents_marked("degraded", sweep.degraded);
            state.metrics.agents_marked("offline", sweep.offline);
            if sweep.offline > 0 || sweep.degraded > 0 {
                tracing::info!(
                    offline = sweep.offline,
                    degraded = sweep.degraded,
                    "agent status swept"
                );
            }
        }
        Err(e) => {
            state.metrics.error("reconcile_store");
            tracing::warn!(error = %ErrorChain(&e), "agent staleness sweep failed");
        }
    }
}

async fn sweep_leases(state: &SharedState) {
    match state
        .store
        .expire_leases(OffsetDateTime::now_utc(), &state.config.retry_policy)
        .await
    {
        Ok(sweep) => {
            state.metrics.leases_expired(
                sweep.unknown.len() as u64,
                sweep.requeued.len() as u64,
                sweep.dead_lettered,
            );
            let now = OffsetDateTime::now_utc();
            for task in &sweep.requeued {
                let at = task.next_attempt_at.unwrap_or(now);
                state
                    .wakeups
                    .wake_after(task.agent_id, (at - now).try_into().unwrap_or_default());
            }
            for task in &sweep.unknown {
                tracing::warn!(task_id = %task.id, agent_id = %task.agent_id, "delivery lease lost on a task with side effects: unknown");
                crate::readback::schedule(state, task).await;
            }
        }
        Err(e) => {
            state.metrics.error("reconcile_store");
            tracing::warn!(error = %ErrorChain(&e), "lease sweep failed");
        }
    }
}
