//! The notification reconciler: each pass expires interrupted sends, then claims due outbox
//! rows and hands each to `services::notify::deliver`, at most [`CONCURRENCY`] in flight. What a
//! send does and how its outcome is recorded is `services::notify`'s.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_proto::error::ErrorChain;
use berth_store::{Delivery, StoreError};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use super::reconciler::{Due, Pass, Reconciler, Schedule, Wake};
use crate::services::notify;
use crate::SharedState;

/// Sends in flight at once.
const CONCURRENCY: usize = 16;
/// Added to twice the timeout to form a send's lease: past it, a row still `sending` was
/// interrupted (a send ends within the timeout; the rest is for recording its outcome).
const LEASE_GRACE: Duration = Duration::from_secs(5);

/// The notification reconciler: each pass expires interrupted sends, then claims due rows (the
/// store's claim statement is the unit's claim: the row turns `sending` with a lease) and hands
/// each to a send of its own, at most [`CONCURRENCY`] in flight.
pub(crate) struct Sender {
    state: SharedState,
    client: reqwest::Client,
    permits: Arc<Semaphore>,
    sends: Mutex<JoinSet<()>>,
}

impl Sender {
    /// `None`: no webhook client could be built (logged); notifications are not sent.
    pub fn new(state: SharedState) -> Option<Sender> {
        match berth_client::webhook_http_client(state.config.notify.timeout) {
            Ok(client) => Some(Sender {
                state,
                client,
                permits: Arc::new(Semaphore::new(CONCURRENCY)),
                sends: Mutex::new(JoinSet::new()),
            }),
            Err(e) => {
                tracing::error!(error = %e, "webhook client; notifications are not sent");
                None
            }
        }
    }

    fn sends(&self) -> std::sync::MutexGuard<'_, JoinSet<()>> {
        self.sends.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Reconciler for Sender {
    type Unit = Delivery;

    fn name(&self) -> &'static str {
        "notify"
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            wake: Wake::Notify,
            ..Schedule::every(self.state.config.notify.sweep_interval)
        }
    }

    async fn due(
        &self,
        pass: &Pass,
        _after: Option<&Delivery>,
    ) -> Result<Due<Delivery>, StoreError> {
        while self.sends().try_join_next().is_some() {}
        let state = &self.state;
        match state.store.expire_sending(pass.now).await {
            Ok(0) => {}
            Ok(n) => tracing::warn!(
                count = n,
                "notifications interrupted mid-send are unknown now; resend them by choice"
            ),
            Err(e) => {
                state.metrics.error("reconcile_store");
                tracing::warn!(error = %ErrorChain(&e), "notification expiry failed");
            }
        }
        let free = self.permits.available_permits();
        if free == 0 {
            return Ok(Due::all(Vec::new()));
        }
        let lease = pass.now + 2 * state.config.notify.timeout + LEASE_GRACE;
        let claimed = state
            .store
            .claim_notifications(pass.now, lease, free as u32)
            .await?;
        Ok(Due::all(claimed))
    }

    fn key(&self, delivery: &Delivery) -> String {
        delivery.notification.id.to_string()
    }

    fn claimed_by_store(&self) -> bool {
        true
    }

    async fn reconcile(&self, _pass: &Pass, delivery: &Delivery) -> Result<(), StoreError> {
        // At most as many rows were claimed as permits were free, and only this loop takes one.
        let Ok(permit) = self.permits.clone().try_acquire_owned() else {
            tracing::warn!(
                notification = delivery.notification.id,
                "no send permit; the claimed row turns unknown when its lease ends"
            );
            return Ok(());
        };
        let (state, client, delivery) = (self.state.clone(), self.client.clone(), delivery.clone());
        self.sends().spawn(async move {
            notify::deliver(&state, &client, delivery).await;
            drop(permit);
        });
        Ok(())
    }

    /// A send in flight ends (at most the timeout) rather than being left to turn `unknown`.
    async fn stopped(&self) {
        let mut sends = std::mem::take(&mut *self.sends());
        while sends.join_next().await.is_some() {}
    }
}
