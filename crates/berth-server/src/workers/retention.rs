//! Retention (issue 16): finished tasks (with their attempts) and events older than
//! `--retention-days` are deleted, a small batch at a time, so the store stays bounded on a fleet
//! that runs for years. The audit log is never pruned: it is exported (`berth audit export`).
//!
//! Each batch is its own short transaction, sized to hold the writer for about [`BATCH_TIME`]
//! (on SQLite there is one writer, and every task created or finished waits behind a delete
//! that holds it), and after each the sweep rests [`REST_FACTOR`] times as long as the batch
//! took, so a large backlog takes at most a fifth of the writer's time while it drains
//! (BENCHMARKS.md, "Retention"). Like every reconciler it only re-derives from the database,
//! and "finished before" is judged by the database's clock; one replica prunes at a time (the
//! driver's claim), and were two to, a batch both take deletes each row once.

use std::time::{Duration, Instant};

use berth_store::StoreError;
use time::OffsetDateTime;

use crate::workers::reconciler::{Due, Pass, Reconciler, Schedule};
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
/// Between sweeps; a sweep longer than this is followed by the next a period later, not by a
/// burst of the ticks it missed.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// The retention reconciler: one unit (the prune) per pass, when `--retention-days` is set.
pub(crate) struct Retention(pub SharedState);

impl Reconciler for Retention {
    /// Rows finished before this are pruned.
    type Unit = OffsetDateTime;

    fn name(&self) -> &'static str {
        "retention"
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            // Stopping cuts a prune off between two batches' statements: each is its own
            // transaction, and the next start prunes the rest.
            cancel_on_stop: true,
            ..Schedule::every(SWEEP_EVERY)
        }
    }

    async fn due(
        &self,
        pass: &Pass,
        _after: Option<&OffsetDateTime>,
    ) -> Result<Due<OffsetDateTime>, StoreError> {
        Ok(Due::all(
            self.0
                .config
                .retention
                .map(|keep| pass.now - keep)
                .into_iter()
                .collect(),
        ))
    }

    /// One prune at a time across replicas: two would only share the writer's time.
    fn key(&self, _before: &OffsetDateTime) -> String {
        "prune".into()
    }

    /// A first prune of a large backlog takes minutes (it rests between batches).
    fn lease(&self) -> Duration {
        Duration::from_secs(600)
    }

    async fn reconcile(&self, _pass: &Pass, before: &OffsetDateTime) -> Result<(), StoreError> {
        let (tasks, events) = sweep(&self.0, *before).await?;
        if tasks > 0 || events > 0 {
            tracing::info!(tasks, events, %before, "retention: pruned what finished before");
        }
        Ok(())
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
