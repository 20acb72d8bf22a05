//! The one loop that runs every reconciler: ticking (the period, and a wake-up signal where the
//! reconciler has one), stopping, pagination, claims, error handling and metrics. It owns no
//! decision of any reconciler; a failure is logged once with its chain, counted, and the pass
//! goes on to the next unit.

use std::sync::Arc;
use std::time::Instant;

use berth_proto::error::ErrorChain;
use tokio::sync::watch;

use super::reconciler::{Pass, Reconciler, Wake};
use crate::SharedState;

/// Who holds a claim: one id per running server (replica), fresh at each start, so a restarted
/// replica does not inherit the claims of its previous life (they lapse with their lease).
#[derive(Clone, Debug)]
pub(crate) struct Holder(Arc<str>);

impl Holder {
    pub fn new() -> Holder {
        Holder(uuid::Uuid::new_v4().to_string().into())
    }
}

/// How a unit ended: the `outcome` label of `berth_reconciler_units_total`.
const DONE: &str = "done";
const FAILED: &str = "failed";
/// Another replica's claim on it is live: not this replica's to do now.
const HELD: &str = "held";

/// Runs `reconciler` until `stop` turns (or its sender is gone).
pub(crate) async fn run<R: Reconciler>(
    state: SharedState,
    reconciler: R,
    holder: Holder,
    mut stop: watch::Receiver<bool>,
) {
    let schedule = reconciler.schedule();
    let mut tick = tokio::time::interval(schedule.every);
    // A pass longer than the period is followed by the next a period later, not by a burst.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut wake = schedule.wake;
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = tick.tick() => {}
            _ = woken(&state, &mut wake) => {}
        }
        if schedule.cancel_on_stop {
            tokio::select! {
                _ = stop.changed() => break,
                _ = pass(&state, &reconciler, &holder) => {}
            }
        } else {
            pass(&state, &reconciler, &holder).await;
        }
    }
    reconciler.stopped().await;
}

/// Resolves when the reconciler's wake-up signal fires; never, without one.
async fn woken(state: &SharedState, wake: &mut Wake) {
    match wake {
        Wake::Period => std::future::pending().await,
        Wake::Notify => state.notify_wake.notified().await,
        Wake::EventsWritten(written) => {
            if written.changed().await.is_err() {
                // The store is closing: only the period (and the stop) from now on.
                *wake = Wake::Period;
            }
        }
    }
}

/// One pass: every page of due units, claimed (one statement a page), reconciled one by one,
/// and let go.
pub(crate) async fn pass<R: Reconciler>(state: &SharedState, reconciler: &R, holder: &Holder) {
    let name = reconciler.name();
    let started = Instant::now();
    match state.store.database_now().await {
        Ok(now) => {
            let pass = Pass {
                now: now + state.config.clock.advanced(),
            };
            pages(state, reconciler, holder, &pass).await;
        }
        Err(e) => {
            state.metrics.error("reconcile_store");
            tracing::warn!(reconciler = name, error = %ErrorChain(&e), "reconciler pass failed: no database clock");
        }
    }
    state
        .metrics
        .reconciler_pass(name, started.elapsed().as_secs_f64());
}

async fn pages<R: Reconciler>(state: &SharedState, reconciler: &R, holder: &Holder, pass: &Pass) {
    let name = reconciler.name();
    let mut after: Option<R::Unit> = None;
    loop {
        let due = match reconciler.due(pass, after.as_ref()).await {
            Ok(due) => due,
            Err(e) => {
                state.metrics.error("reconcile_store");
                tracing::warn!(reconciler = name, error = %ErrorChain(&e), "reconciler pass failed: finding due work");
                return;
            }
        };
        let more = due.more;
        let claimed = claim(state, reconciler, holder, &due.units).await;
        for unit in due.units {
            let outcome = match &claimed {
                Claimed::All => reconcile(state, reconciler, pass, &unit).await,
                Claimed::These(keys) if keys.binary_search(&reconciler.key(&unit)).is_ok() => {
                    reconcile(state, reconciler, pass, &unit).await
                }
                Claimed::These(_) => HELD,
                Claimed::Failed => FAILED,
            };
            state.metrics.reconciler_unit(name, outcome);
            after = Some(unit);
        }
        if let Claimed::These(keys) = &claimed {
            // Not let go: the claims lapse with their lease, and the units wait until then.
            if let Err(e) = state.store.release_units(name, keys, &holder.0).await {
                state.metrics.error("reconcile_store");
                tracing::warn!(reconciler = name, error = %ErrorChain(&e), "reconciler claims not released");
            }
        }
        if !more || after.is_none() {
            return;
        }
    }
}

/// What this replica may work of a page.
enum Claimed {
    /// Every unit: the store's own statement claimed them as it found them.
    All,
    /// The units of these keys (sorted); the others are another replica's now.
    These(Vec<String>),
    /// None: the claim itself failed (logged).
    Failed,
}

/// Claims a page's units, all in one statement.
async fn claim<R: Reconciler>(
    state: &SharedState,
    reconciler: &R,
    holder: &Holder,
    units: &[R::Unit],
) -> Claimed {
    if reconciler.claimed_by_store() {
        return Claimed::All;
    }
    let name = reconciler.name();
    let keys: Vec<String> = units.iter().map(|u| reconciler.key(u)).collect();
    match state
        .store
        .claim_units(name, &keys, &holder.0, reconciler.lease())
        .await
    {
        Ok(claimed) => Claimed::These(claimed),
        Err(e) => {
            state.metrics.error("reconcile_store");
            tracing::warn!(reconciler = name, error = %ErrorChain(&e), "reconciler claims failed");
            Claimed::Failed
        }
    }
}

/// Reconciles one claimed unit: its outcome.
async fn reconcile<R: Reconciler>(
    state: &SharedState,
    reconciler: &R,
    pass: &Pass,
    unit: &R::Unit,
) -> &'static str {
    match reconciler.reconcile(pass, unit).await {
        Ok(()) => DONE,
        Err(e) => {
            state.metrics.error("reconcile_store");
            tracing::warn!(reconciler = reconciler.name(), unit = %reconciler.key(unit), error = %ErrorChain(&e), "reconciler unit failed");
            FAILED
        }
    }
}
