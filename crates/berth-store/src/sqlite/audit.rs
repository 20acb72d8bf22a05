//! The audit log on SQLite. The single writer thread runs one operation at a time, so reading
//! the chain head and inserting after it cannot interleave with another append.

use berth_proto::audit::AuditEntry;
use berth_proto::TenantId;
use rusqlite::params;

use super::threads::Db;
use super::{id_text, SqliteStore};
use crate::domain::audit::{chain, parse};
use crate::rows::ColumnReader;
use crate::{AuditStore, NewAuditEvent, Result};

/// Appends `event` to its tenant's chain inside the caller's transaction.
pub(super) fn append(tx: &Db<'_>, event: NewAuditEvent) -> Result<AuditEntry> {
    let tenant = id_text(event.tenant_id.0);
    let head = tx.optional(
        "SELECT seq, hash FROM audit_log WHERE tenant_id = ?1 ORDER BY seq DESC LIMIT 1",
        [&tenant],
        |row| Ok((row.int("seq")?, row.text("hash")?)),
    )?;
    let (entry, text) = chain(event, head)?;
    tx.execute(
        "INSERT INTO audit_log (tenant_id, seq, hash, entry) VALUES (?1, ?2, ?3, ?4)",
        params![tenant, entry.seq as i64, entry.hash, text],
    )?;
    Ok(entry)
}

#[async_trait::async_trait]
impl AuditStore for SqliteStore {
    async fn append_audit(&self, event: NewAuditEvent) -> Result<AuditEntry> {
        self.writer
            .write("append audit entry", move |tx| append(tx, event))
            .await
    }

    async fn list_audit(
        &self,
        tenant: TenantId,
        after: u64,
        limit: u32,
    ) -> Result<Vec<AuditEntry>> {
        self.readers
            .read("list audit entries", move |db| {
                db.all(
                    "SELECT entry FROM audit_log WHERE tenant_id = ?1 AND seq > ?2 \
                     ORDER BY seq LIMIT ?3",
                    params![
                        id_text(tenant.0),
                        i64::try_from(after).unwrap_or(i64::MAX),
                        i64::from(limit)
                    ],
                    |row| parse(&row.text("entry")?),
                )
            })
            .await
    }
}
