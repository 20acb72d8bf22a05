//! The one loop that runs every reconciler: ticking (the period, and a wake-up signal where the
//! reconciler has one), stopping, pagination, claims, error handling and metrics. It owns no
//! decision of any reconciler; a failure is logged once with its chain, counted, and the pass
//! goes on to the next unit.

use std::sync::Arc;
use std::time::Instant;

use berth_proto::error::ErrorChain;
use tokio::sync::watch;

use super::{Pass, Reconciler, Wake};
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

/// One pass: every page of due units, each claimed, reconciled and let go.
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
        for unit in due.units {
            let outcome = unit_of_work(state, reconciler, holder, pass, &unit).await;
            state.metrics.reconciler_unit(name, outcome);
            after = Some(unit);
        }
        if !more || after.is_none() {
            return;
        }
    }
}

/// Claims, reconciles and lets go of one unit: its outcome.
async fn unit_of_work<R: Reconciler>(
    state: &SharedState,
    reconciler: &R,
    holder: &Holder,
    pass: &Pass,
    unit: &R::Unit,
) -> &'static str {
    let name = reconciler.name();
    let claim = (!reconciler.claimed_by_store()).then(|| reconciler.key(unit));
    if let Some(key) = &claim {
        match state
            .store
            .claim_unit(name, key, &holder.0, reconciler.lease())
            .await
        {
            Ok(true) => {}
            Ok(false) => return HELD,
            Err(e) => {
                state.metrics.error("reconcile_store");
                tracing::warn!(reconciler = name, unit = %key, error = %ErrorChain(&e), "reconciler claim failed");
                return FAILED;
            }
        }
    }
    let outcome = match reconciler.reconcile(pass, unit).await {
        Ok(()) => DONE,
        Err(e) => {
            state.metrics.error("reconcile_store");
            tracing::warn!(reconciler = name, unit = %reconciler.key(unit), error = %ErrorChain(&e), "reconciler unit failed");
            FAILED
        }
    };
    if let Some(key) = &claim {
        // Not let go: the claim lapses with its lease, and the unit waits until then.
        if let Err(e) = state.store.release_unit(name, key, &holder.0).await {
            state.metrics.error("reconcile_store");
            tracing::warn!(reconciler = name, unit = %key, error = %ErrorChain(&e), "reconciler claim not released");
        }
    }
    outcome
}
