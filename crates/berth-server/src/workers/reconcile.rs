//! Reconcilers: idempotent loops that move derived state toward the truth.
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

use berth_proto::error::ErrorChain;
use std::time::Duration;

use tokio::sync::watch;

use crate::SharedState;

const LEASE_SWEEP_EVERY: Duration = Duration::from_millis(500);
const READ_BACK_SWEEP_EVERY: Duration = Duration::from_secs(1);
/// Tasks per page of the read-back sweep; it reads every page each time.
const READ_BACK_PAGE: u32 = 100;

pub async fn run(state: SharedState, mut stop: watch::Receiver<bool>) {
    let interval = state.config.heartbeat_interval;
    let staleness_every = (interval / 2).clamp(Duration::from_millis(200), Duration::from_secs(5));
    let mut staleness = tokio::time::interval(staleness_every);
    let mut leases = tokio::time::interval(LEASE_SWEEP_EVERY);
    let mut read_backs = tokio::time::interval(READ_BACK_SWEEP_EVERY);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = staleness.tick() => sweep_agents(&state).await,
            _ = leases.tick() => sweep_leases(&state).await,
            _ = read_backs.tick() => sweep_read_backs(&state).await,
        }
    }
}

async fn sweep_agents(state: &SharedState) {
    let interval = state.config.heartbeat_interval;
    let now = state.config.clock.now();
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
        .expire_leases(state.config.clock.now(), &state.config.retry_policy)
        .await
    {
        Ok(sweep) => {
            state.metrics.leases_expired(
                sweep.unknown.len() as u64,
                sweep.requeued.len() as u64,
                sweep.dead_lettered,
            );
            let now = state.config.clock.now();
            for task in &sweep.requeued {
                let at = task.next_attempt_at.unwrap_or(now);
                state
                    .wakeups
                    .wake_after(task.agent_id, (at - now).try_into().unwrap_or_default());
            }
            // Committed: a crash from here on leaves these tasks to the read-back sweep.
            if !sweep.unknown.is_empty() {
                crate::fault::crash_after("lease-expiry");
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

/// Completes read-back work that a crash (or a failed store call) left undone.
async fn sweep_read_backs(state: &SharedState) {
    let mut after = None;
    loop {
        let page = match state
            .store
            .unknown_without_read_back(after, READ_BACK_PAGE)
            .await
        {
            Ok(page) => page,
            Err(e) => {
                state.metrics.error("reconcile_store");
                tracing::warn!(error = %ErrorChain(&e), "read-back sweep failed");
                return;
            }
        };
        for task in &page {
            // A task with nothing to read back was reported when it became unknown.
            if crate::readback::intended_sticker(task).is_some() {
                tracing::info!(task_id = %task.id, "unknown task without a read-back: scheduling one");
                crate::readback::schedule(state, task).await;
            }
        }
        match page.last() {
            Some(last) if page.len() == READ_BACK_PAGE as usize => after = Some(last.id),
            _ => break,
        }
    }
    let mut after = None;
    loop {
        let page = match state
            .store
            .finished_read_backs_of_unknown(after, READ_BACK_PAGE)
            .await
        {
            Ok(page) => page,
            Err(e) => {
                state.metrics.error("reconcile_store");
                tracing::warn!(error = %ErrorChain(&e), "read-back sweep failed");
                return;
            }
        };
        for read_back in &page {
            if let Some(parent) = read_back.read_back_of {
                tracing::info!(task_id = %parent, read_back = %read_back.id, "read-back finished without a verdict: deciding");
                crate::readback::resolve(state, parent, read_back).await;
            }
        }
        match page.last() {
            Some(last) if page.len() == READ_BACK_PAGE as usize => after = last.read_back_of,
            _ => break,
        }
    }
}
