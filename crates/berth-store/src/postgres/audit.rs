//! The audit log on PostgreSQL. A writer stages its entry in its own transaction; a
//! sequencer pass links it at the head of its tenant's chain (`sequencer.rs`), so writers never
//! take turns on a chain through their commits. Reads first wait for a pass, so they see every
//! entry whose action committed before.

use berth_proto::audit::AuditEntry;
use berth_proto::TenantId;
use sqlx::PgConnection;

use super::PostgresStore;
use crate::domain::audit::parse;
use crate::rows::{db_error, ColumnReader};
use crate::{AuditStore, NewAuditEvent, Result};

/// Stages `event` inside the caller's transaction: a sequencer pass links it once that commits.
pub(super) async fn append(conn: &mut PgConnection, event: NewAuditEvent) -> Result<()> {
    let (tenant, draft) = super::sequencer::staged(event)?;
    sqlx::query("INSERT INTO audit_pending (tenant_id, draft) VALUES ($1, $2)")
        .bind(tenant.0)
        .bind(draft)
        .execute(conn)
        .await
        .map_err(db_error("stage audit entry"))?;
    Ok(())
}

#[async_trait::async_trait]
impl AuditStore for PostgresStore {
    async fn append_audit(&self, event: NewAuditEvent) -> Result<AuditEntry> {
        self.sequencer.append(event).await
    }

    async fn list_audit(
        &self,
        tenant: TenantId,
        after: u64,
        limit: u32,
    ) -> Result<Vec<AuditEntry>> {
        self.sequencer.flush().await?;
        sqlx::query(
            "SELECT entry FROM audit_log WHERE tenant_id = $1 AND seq > $2 ORDER BY seq LIMIT $3",
        )
        .bind(tenant.0)
        .bind(i64::try_from(after).unwrap_or(i64::MAX))
        .bind(i64::from(limit))
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list audit entries"))?
        .iter()
        .map(|row| parse(&row.text("entry")?))
        .collect()
    }
}
