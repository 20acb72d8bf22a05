//! Reconciler claims on SQLite: one writer thread orders every claim, and "now" is SQLite's
//! own `julianday('now')` in the statement, never the caller's clock. Claims are written
//! without a flush of their own: a claim lost to a power cut only lets a unit be taken again,
//! which a claim's lapse allows anyway, and one flush per unit would tax the one writer.

use std::time::Duration;

use super::SqliteStore;
use crate::domain::claims::claim_order;
use crate::rows::{from_unix_millis, ColumnReader};
use crate::{ClaimStore, Result};
use time::OffsetDateTime;

/// The database's now in Unix milliseconds, as an SQL expression.
const NOW_MILLIS: &str = "CAST(ROUND((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)";

#[async_trait::async_trait]
impl ClaimStore for SqliteStore {
    async fn database_now(&self) -> Result<OffsetDateTime> {
        let sql = format!("SELECT {NOW_MILLIS} AS now");
        let ms = self
            .readers
            .read("database now", move |db| {
                db.one(&sql, [], |row| row.int("now"))
            })
            .await?;
        from_unix_millis("now", ms)
    }

    async fn claim_units(
        &self,
        reconciler: &str,
        units: &[String],
        holder: &str,
        lease: Duration,
    ) -> Result<Vec<String>> {
        let sql = format!(
            "INSERT INTO reconciler_claims (reconciler, unit, holder, expires_at) \
             VALUES (?1, ?2, ?3, {NOW_MILLIS} + ?4) \
             ON CONFLICT (reconciler, unit) DO UPDATE SET holder = excluded.holder, \
               expires_at = excluded.expires_at \
             WHERE reconciler_claims.holder = excluded.holder \
                OR reconciler_claims.expires_at <= {NOW_MILLIS}"
        );
        let (reconciler, holder) = (reconciler.to_string(), holder.to_string());
        let units = claim_order(units);
        let lease = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX / 2);
        self.writer
            .write_unflushed("claim reconciler units", move |tx| {
                let mut claimed = Vec::new();
                for unit in units {
                    if tx.execute(&sql, (&reconciler, &unit, &holder, lease))? == 1 {
                        claimed.push(unit);
                    }
                }
                Ok(claimed)
            })
            .await
    }

    async fn release_units(&self, reconciler: &str, units: &[String], holder: &str) -> Result<u64> {
        let (reconciler, holder) = (reconciler.to_string(), holder.to_string());
        let units = claim_order(units);
        self.writer
            .write_unflushed("release reconciler units", move |tx| {
                let mut released = 0;
                for unit in units {
                    released += tx.execute(
                        "DELETE FROM reconciler_claims \
                         WHERE reconciler = ?1 AND unit = ?2 AND holder = ?3",
                        (&reconciler, &unit, &holder),
                    )? as u64;
                }
                Ok(released)
            })
            .await
    }
}
