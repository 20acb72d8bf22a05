//! Retention (issue 16): finished tasks (with their attempts) and events older than
//! `--retention-days` are deleted, a small batch at a time, so the store stays bounded on a fleet
//! that runs for years. The audit log is never pruned: it is exported (`berth audit export`).
//!
//! Each batch is its own short transaction, sized to hold the writer for about [`BATCH_TIME`]
//! (on SQLite there is one writer, and every task created or finished waits behind a delete
//! that holds it), and after each the sweep rests [`REST_FACTOR`] times as long as the batch
//! took, so a large backlog takes at most a fifth of the writer's time while it drains
//! (BENCHMARKS.md, "Retention"). Like every reconciler it only re-derives from the database:
//! every replica may run it, and a batch two replicas both take deletes each row once.

use std::time::{Duration, Instant};

use berth_proto::error::ErrorChain;
use tokio::sync::watch;

use crate::SharedState;

/// What one batch (its tasks' delete, then its events') should take.
const BATCH_TIME: Duration = Duration::from_millis(10);
/// Rows per delete: the first batch's, and the bounds the batch adapts between.
const FIRST_BATCH: u32 = 100;
const MIN_BATCH: u32 = 10;
const MAX_BATCH: u32 = 500;
/// After a batch, the sweep rests this many times as long as the batch took.
const REST_FACTOR: u32 = 4;
/// The shortest rest between two batches.
const MIN_REST: Duration = Duration::from_millis(20);
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
    let mut batch = FIRST_BATCH;
    loop {
        let started = Instant::now();
        let t = state.store.prune_finished_tasks(before, batch).await?;
        let e = state.store.prune_events(before, batch).await?;
        let took = started.elapsed();
        tasks += t;
        events += e;
        if t < u64::from(batch) && e < u64::from(batch) {
            return Ok((tasks, events));
        }
        batch = next_batch(batch, took);
        tokio::time::sleep((took * REST_FACTOR).max(MIN_REST)).await;
    }
}

/// The size of the next batch after one of `batch` rows took `took`: scaled toward
/// [`BATCH_TIME`], at most doubling at a time, within [`MIN_BATCH`]..=[`MAX_BATCH`].
fn next_batch(batch: u32, took: Duration) -> u32 {
    let scaled = u128::from(batch) * BATCH_TIME.as_micros() / took.as_micros().max(1);
    let scaled = u32::try_from(scaled).unwrap_or(u32::MAX);
    scaled
        .min(batch.saturating_mul(2))
        .clamp(MIN_BATCH, MAX_BATCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_adapts_toward_its_time_within_bounds() {
        let ms = Duration::from_millis;
        // On time: unchanged. Twice too slow: halved. Far too slow: the floor.
        assert_eq!(next_batch(100, ms(10)), 100);
        assert_eq!(next_batch(100, ms(20)), 50);
        assert_eq!(next_batch(100, ms(10_000)), MIN_BATCH);
        // Fast: at most doubled, never past the ceiling; an instant batch too.
        assert_eq!(next_batch(100, ms(1)), 200);
        assert_eq!(next_batch(400, ms(1)), MAX_BATCH);
        assert_eq!(next_batch(100, Duration::ZERO), 200);
    }
}
