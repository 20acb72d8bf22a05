//! The audit log on PostgreSQL. Replicas share the database, so an append first takes a
//! transaction-scoped advisory lock on the tenant's chain: the next appender reads the head only
//! after this one committed (READ COMMITTED sees it), and the chain stays linear. The primary
//! key `(tenant_id, seq)` would refuse a fork even without the lock. Every writer appends as
//! its last statement before commit, so the chain's lock is always taken after any row lock:
//! two transactions never wait on each other's rows and chain.

use berth_proto::audit::AuditEntry;
use berth_proto::TenantId;
use sqlx::PgConnection;

use super::PostgresStore;
use crate::domain::audit::{chain, parse};
use crate::rows::{db_error, ColumnReader};
use crate::{AuditStore, NewAuditEvent, Result};

const OP: &str = "append audit entry";

/// Appends `event` to its tenant's chain inside the caller's transaction.
pub(super) async fn append(conn: &mut PgConnection, event: NewAuditEvent) -> Result<AuditEntry> {
    // Held until the transaction ends, whichever way.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('berth.audit:' || $1::text, 0))")
        .bind(event.tenant_id.0)
        .execute(&mut *conn)
        .await
        .map_err(db_error(OP))?;
    let head = sqlx::query(
        "SELECT seq, hash FROM audit_log WHERE tenant_id = $1 ORDER BY seq DESC LIMIT 1",
    )
    .bind(event.tenant_id.0)
    .fetch_optional(&mut *conn)
    .await
    .map_err(db_error(OP))?
    .map(|row| Ok::<_, crate::StoreError>((row.int("seq")?, row.text("hash")?)))
    .transpose()?;
    let tenant = event.tenant_id.0;
    let (entry, text) = chain(event, head)?;
    sqlx::query("INSERT INTO audit_log (tenant_id, seq, hash, entry) VALUES ($1, $2, $3, $4)")
        .bind(tenant)
        .bind(entry.seq as i64)
        .bind(&entry.hash)
        .bind(text)
        .execute(&mut *conn)
        .await
        .map_err(db_error(OP))?;
    Ok(entry)
}

#[async_trait::async_trait]
impl AuditStore for PostgresStore {
    async fn append_audit(&self, event: NewAuditEvent) -> Result<AuditEntry> {
        let mut tx = self.begin(OP).await?;
        let entry = append(&mut tx, event).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(entry)
    }

    async fn list_audit(
        &self,
        tenant: TenantId,
        after: u64,
        limit: u32,
    ) -> Result<Vec<AuditEntry>> {
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
