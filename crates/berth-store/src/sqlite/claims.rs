//! Reconciler claims on SQLite: one writer thread orders every claim, and "now" is SQLite's
//! own `julianday('now')` in the statement, never the caller's clock. Claims are written
//! without a flush of their own: a claim lost to a power cut only lets a unit be taken again,
//! which a claim's lapse allows anyway, and one flush per unit would tax the one writer.

use std::time::Duration;

use super::SqliteStore;
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

    async fn claim_unit(
        &self,
        reconciler: &str,
        unit: &str,
        holder: &str,
        lease: Duration,
    ) -> Result<bool> {
        let sql = format!(
            "INSERT INTO reconciler_claims (reconciler, unit, holder, expires_at) \
             VALUES (?1, ?2, ?3, {NOW_MILLIS} + ?4) \
             ON CONFLICT (reconciler, unit) DO UPDATE SET holder = excluded.holder, \
               expires_at = excluded.expires_at \
             WHERE reconciler_claims.holder = excluded.holder \
                OR reconciler_claims.expires_at <= {NOW_MILLIS}"
        );
        let params = (
            reconciler.to_string(),
            unit.to_string(),
            holder.to_string(),
            i64::try_from(lease.as_millis()).unwrap_or(i64::MAX / 2),
        );
        self.writer
            .write_unflushed("claim a reconciler unit", move |tx| {
                tx.execute(&sql, params).map(|n| n == 1)
            })
            .await
    }

    async fn release_unit(&self, reconciler: &str, unit: &str, holder: &str) -> Result<bool> {
        let params = (reconciler.to_string(), unit.to_string(), holder.to_string());
        self.writer
            .write_unflushed("release a reconciler unit", move |tx| {
                tx.execute(
                    "DELETE FROM reconciler_claims \
                     WHERE reconciler = ?1 AND unit = ?2 AND holder = ?3",
                    params,
                )
                .map(|n| n == 1)
            })
            .await
    }
}
