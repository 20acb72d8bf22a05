//! The background reconcilers: each is a [`reconciler::Reconciler`] run by the one loop,
//! [`driver::run`]. [`spawn_all`] starts every one of them for this replica.

pub(crate) mod deployments;
pub(crate) mod drift;
pub(crate) mod driver;
pub(crate) mod notify;
pub(crate) mod readiness;
pub mod reconcile;
pub(crate) mod reconciler;
pub mod retention;

use crate::SharedState;

/// Every background reconciler, each under the one driver (`workers::driver`), claiming
/// as this replica.
pub(crate) fn spawn_all(
    state: &SharedState,
    stop: &tokio::sync::watch::Receiver<bool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    use driver::{run, Holder};
    let holder = Holder::new();
    let mut workers = vec![
        tokio::spawn(run(
            state.clone(),
            crate::workers::reconcile::AgentStaleness(state.clone()),
            holder.clone(),
            stop.clone(),
        )),
        tokio::spawn(run(
            state.clone(),
            crate::workers::reconcile::DeliveryLeases(state.clone()),
            holder.clone(),
            stop.clone(),
        )),
        tokio::spawn(run(
            state.clone(),
            crate::workers::reconcile::ReadBacks(state.clone()),
            holder.clone(),
            stop.clone(),
        )),
        tokio::spawn(run(
            state.clone(),
            deployments::Deployments(state.clone()),
            holder.clone(),
            stop.clone(),
        )),
        tokio::spawn(run(
            state.clone(),
            drift::DriftChecks(state.clone()),
            holder.clone(),
            stop.clone(),
        )),
        tokio::spawn(run(
            state.clone(),
            readiness::ReadinessPasses(state.clone()),
            holder.clone(),
            stop.clone(),
        )),
        tokio::spawn(run(
            state.clone(),
            crate::workers::retention::Retention(state.clone()),
            holder.clone(),
            stop.clone(),
        )),
    ];
    if let Some(sender) = notify::Sender::new(state.clone()) {
        workers.push(tokio::spawn(run(
            state.clone(),
            sender,
            holder,
            stop.clone(),
        )));
    }
    workers
}
