//! Reconciler claims on PostgreSQL: one upsert takes a page's free or expired claims (the row
//! locks, taken in sorted order, order two replicas racing for them), judged by
//! `clock_timestamp()`, never the caller's clock.

use std::time::Duration;

use super::PostgresStore;
use crate::domain::claims::claim_order;
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

    async fn claim_units(
        &self,
        reconciler: &str,
        units: &[String],
        holder: &str,
        lease: Duration,
    ) -> Result<Vec<String>> {
        const OP: &str = "claim reconciler units";
        let units = claim_order(units);
        if units.is_empty() {
            return Ok(Vec::new());
        }
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX / 2);
        let mut claimed: Vec<String> = sqlx::query_scalar(
            "INSERT INTO reconciler_claims (reconciler, unit, holder, expires_at) \
             SELECT $1, unit, $3, clock_timestamp() + make_interval(secs => $4::float8 / 1000) \
             FROM unnest($2::text[]) WITH ORDINALITY AS u (unit, n) ORDER BY n \
             ON CONFLICT (reconciler, unit) DO UPDATE SET holder = excluded.holder, \
               expires_at = excluded.expires_at \
             WHERE reconciler_claims.holder = excluded.holder \
                OR reconciler_claims.expires_at <= clock_timestamp() \
             RETURNING unit",
        )
        .bind(reconciler)
        .bind(&units)
        .bind(holder)
        .bind(lease_ms)
        .fetch_all(&mut *self.acquire(OP).await?)
        .await
        .map_err(db_error(OP))?;
        claimed.sort();
        Ok(claimed)
    }

    async fn release_units(&self, reconciler: &str, units: &[String], holder: &str) -> Result<u64> {
        const OP: &str = "release reconciler units";
        if units.is_empty() {
            return Ok(0);
        }
        let released = sqlx::query(
            "DELETE FROM reconciler_claims \
             WHERE reconciler = $1 AND unit = ANY($2::text[]) AND holder = $3",
        )
        .bind(reconciler)
        .bind(units)
        .bind(holder)
        .execute(&mut *self.acquire(OP).await?)
        .await
        .map_err(db_error(OP))?;
        Ok(released.rows_affected())
    }
}
