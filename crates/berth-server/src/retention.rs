//! Retention (issue 16): finished tasks (with their attempts) and events older than
//! `--retention-days` are deleted, a small batch at a time, so the store stays bounded on a fleet
//! that runs for years. The audit log is never pruned: it is exported (`berth audit export`).
//!
//! Each batch is its own short transaction, and the sweep sleeps between batches, so requests
//! (and on SQLite, the one writer's queue) never wait behind a long delete. Like every
//! reconciler it only re-derives from the database: every replica may run it, and a batch two
//! replicas both take deletes each row once.

use std::time::Duration;

use berth_proto::error::ErrorChain;
use tokio::sync::watch;

use crate::SharedState;

/// Rows per delete: a few milliseconds of writer time each.
const BATCH: u32 = 500;
/// Between two batches of one sweep.
const PAUSE: Duration = Duration::from_millis(50);
/// Between sweeps.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

pub async fn run(state: SharedState, mut stop: watch::Receiver<bool>) {
    let Some(keep) = state.config.retention else {
        return;
    };
    let mut tick = tokio::time::interval(SWEEP_EVERY);
    // A sweep longer than the period (a first prune of a large backlog) is followed by the
    // next one a period later, not by a burst of the ticks it missed.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        let before = state.config.clock.now() - keep;
        let swept = tokio::select! {
            _ = stop.changed() => return,
            swept = sweep(&state, before) => swept,
        };
        match swept {
            Ok((0, 0)) => {}
            Ok((tasks, events)) => {
                tracing::info!(tasks, events, %before, "retention: pruned what finished before");
            }
            Err(e) => {
                state.metrics.error("reconcile_store");
                tracing::warn!(error = %ErrorChain(&e), "retention sweep failed");
            }
        }
    }
}

/// Deletes, batch by batch, every finished task and event older than `before`: (tasks, events).
pub(crate) async fn sweep(
    state: &SharedState,
    before: time::OffsetDateTime,
) -> Result<(u64, u64), berth_store::StoreError> {
    let (mut tasks, mut events) = (0, 0);
    loop {
        let t = state.store.prune_finished_tasks(before, BATCH).await?;
        let e = state.store.prune_events(before, BATCH).await?;
        tasks += t;
        events += e;
        if t < u64::from(BATCH) && e < u64::from(BATCH) {
            return Ok((tasks, events));
        }
        tokio::time::sleep(PAUSE).await;
    }
}
