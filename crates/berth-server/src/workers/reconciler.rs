//! The background reconcilers' contract: each is a [`Reconciler`] (a name, how to find its due
//! work a page at a time, how to reconcile one unit) and `driver::run` is the one loop that
//! runs every one of them. A reconciler never ticks, paginates, claims or counts by itself.
//!
//! Architecture invariant: a unit of work is claimed before it is done (a row lease in
//! `reconciler_claims`, or the store's own row lock where [`Reconciler::claimed_by_store`]),
//! and "due" is judged by [`Pass::now`], the database's clock, never a replica's own.

use std::future::Future;
use std::time::Duration;

use berth_store::StoreError;
use time::OffsetDateTime;
use tokio::sync::watch;

/// What one pass of a reconciler knows when it starts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Pass {
    /// The database's clock at the start of the pass (plus how far a test moved a
    /// `ManualClock`): the "now" every due decision of the pass is judged by, the same on every
    /// replica however wrong its own clock is.
    pub now: OffsetDateTime,
}

/// One page of due work; `more`: another page may follow the last unit of this one.
pub(crate) struct Due<U> {
    pub units: Vec<U>,
    pub more: bool,
}

impl<U> Due<U> {
    /// Everything that is due in one page.
    pub fn all(units: Vec<U>) -> Due<U> {
        Due { units, more: false }
    }

    /// A page read with `limit`: a full one may have more after it.
    pub fn page(units: Vec<U>, limit: u32) -> Due<U> {
        let more = units.len() >= limit as usize;
        Due { units, more }
    }
}

/// What starts a pass besides the period.
pub(crate) enum Wake {
    /// The period alone.
    Period,
    /// The server's `notify_wake` (an operator's resend).
    Notify,
    /// Every committed change that may have written an event, in any replica.
    EventsWritten(watch::Receiver<u64>),
}

/// When a reconciler runs.
pub(crate) struct Schedule {
    pub every: Duration,
    pub wake: Wake,
    /// Stopping the server abandons a pass in flight (only for work that is safe to cut off
    /// between any two statements, like retention's deletes).
    pub cancel_on_stop: bool,
}

impl Schedule {
    pub fn every(every: Duration) -> Schedule {
        Schedule {
            every,
            wake: Wake::Period,
            cancel_on_stop: false,
        }
    }
}

/// One background reconciler. Units of one pass are reconciled one after another. (An
/// implementation writes these methods as `async fn`s.)
pub(crate) trait Reconciler: Send + Sync + 'static {
    type Unit: Send + Sync + 'static;

    /// Bounded: the `name` label of the reconciler metrics and the claims' namespace.
    fn name(&self) -> &'static str;

    fn schedule(&self) -> Schedule;

    /// The page of due units after `after` (the last unit of the previous page), or the first.
    fn due(
        &self,
        pass: &Pass,
        after: Option<&Self::Unit>,
    ) -> impl Future<Output = Result<Due<Self::Unit>, StoreError>> + Send;

    /// The unit's stable key: what it is claimed under and logged as.
    fn key(&self, unit: &Self::Unit) -> String;

    /// Moves one unit toward the truth. An error is logged and counted by the driver, and the
    /// unit is found again by a later pass.
    fn reconcile(
        &self,
        pass: &Pass,
        unit: &Self::Unit,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// How long a claim on a unit lasts (a page's units are claimed together, before the
    /// first is worked): longer than a page takes, so a live replica keeps them, and no
    /// longer, so a dead replica's units are taken up again soon.
    fn lease(&self) -> Duration {
        Duration::from_secs(60)
    }

    /// The store's own statement already claims each unit as it is found (a row lease or a row
    /// lock), so the driver takes no claim of its own.
    fn claimed_by_store(&self) -> bool {
        false
    }

    /// After the last pass, before the driver returns (work a pass handed off ends here).
    fn stopped(&self) -> impl Future<Output = ()> + Send {
        std::future::ready(())
    }
}
