//! Reconciler claims on PostgreSQL: one upsert takes a free or expired claim (the row lock
//! orders two replicas racing for it), judged by `clock_timestamp()`, never the caller's clock.

use std::time::Duration;

use super::PostgresStore;
use crate::rows::db_error;
use crate::{ClaimStore, Result};
use sqlx::Row;
use time::OffsetDateTime;

#[async_trait::async_trait]
impl ClaimStore for PostgresStore {
    async fn database_now(&self) -> Result<OffsetDateTime> {
        // Truncated to milliseconds, as every timestamp the store keeps.
        let row = sqlx::query("SELECT date_trunc('milliseconds', clock_timestamp()) AS now")
            .fetch_one(&mut *self.acquire("database now").await?)
            .await
            .map_err(db_error("database now"))?;
        row.try_get::<OffsetDateTime, _>("now")
            .map_err(db_error("database now"))
    }

    async fn claim_unit(
        &self,
        reconciler: &str,
        unit: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<bool> {
        const OP: &str = "claim a reconciler unit";
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX / 2);
        let claimed = sqlx::query(
            "INSERT INTO reconciler_claims (reconciler, unit, holder, expires_at) \
             VALUES ($1, $2, $3, clock_timestamp() + make_interval(secs => $4::float8 / 1000)) \
             ON CONFLICT (reconciler, unit) DO UPDATE SET holder = excluded.holder, \
               expires_at = excluded.expires_at \
             WHERE reconciler_claims.holder = excluded.holder \
                OR reconciler_claims.expires_at <= clock_timestamp()",
        )
        .bind(reconciler)
        .bind(unit)
        .bind(holder)
        .bind(lease_ms)
        .execute(&mut *self.acquire(OP).await?)
        .await
        .map_err(db_error(OP))?;
        Ok(claimed.rows_affected() == 1)
    }

    async fn release_unit(&self, reconciler: &str, unit: &str, holder: &str) -> Result<bool> {
        const OP: &str = "release a reconciler unit";
        let released = sqlx::query(
            "DELETE FROM reconciler_claims WHERE reconciler = $1 AND unit = $2 AND holder = $3",
        )
        .bind(reconciler)
        .bind(unit)
        .bind(holder)
        .execute(&mut *self.acquire(OP).await?)
        .await
        .map_err(db_error(OP))?;
        Ok(released.rows_affected() == 1)
    }
}
