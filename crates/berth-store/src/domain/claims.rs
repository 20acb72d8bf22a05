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

    /// Takes `reconciler`'s `unit` for `holder` until `lease` from the database's now, when
    /// nobody holds it, its lease ran out, or `holder` holds it already (then the lease is
    /// renewed). `false`: another holder's lease is live; the unit is not this holder's to do.
    async fn claim_unit(
        &self,
        reconciler: &str,
        unit: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<bool>;

    /// Lets go of `unit` if `holder` holds it (a claim taken over after its expiry stays the new
    /// holder's). Whether it was held.
    async fn release_unit(&self, reconciler: &str, unit: &str, holder: &str) -> Result<bool>;
}
