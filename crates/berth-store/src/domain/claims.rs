//! Reconciler claims: the row lease a replica takes on one unit of a reconciler's work before it
//! does it, so two replicas never work the same unit at once, and the database's own clock, by
//! which both that lease and every reconciler's "due" are judged (replicas' clocks may differ).

use std::time::Duration;

use time::OffsetDateTime;

use crate::Result;

/// Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait ClaimStore: Send + Sync {
    /// The database's clock now (PostgreSQL `clock_timestamp()`, SQLite `julianday('now')`), at
    /// millisecond precision: the one clock every replica agrees on.
    async fn database_now(&self) -> Result<OffsetDateTime>;

    /// Takes each of `reconciler`'s `units` for `holder` until `lease` from the database's now,
    /// when nobody holds it, its lease ran out, or `holder` holds it already (then the lease is
    /// renewed): the units taken, sorted. One statement for the lot, so a pass pays for its
    /// claims per page, not per unit. A unit missing from the answer is another holder's.
    async fn claim_units(
        &self,
        reconciler: &str,
        units: &[String],
        holder: &str,
        lease: Duration,
    ) -> Result<Vec<String>>;

    /// Lets go of those of `units` that `holder` holds (a claim taken over after its expiry
    /// stays the new holder's). How many it held.
    async fn release_units(&self, reconciler: &str, units: &[String], holder: &str) -> Result<u64>;
}

/// The distinct units in sorted order: two claimants lock the rows of a batch in one order, so
/// overlapping batches never deadlock, and no row is upserted twice in one statement.
pub(crate) fn claim_order(units: &[String]) -> Vec<String> {
    let set: std::collections::BTreeSet<&String> = units.iter().collect();
    set.into_iter().cloned().collect()
}
