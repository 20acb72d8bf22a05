//! The audit log as the API and the UI read it. Every entry is appended by the store, in the
//! transaction of the action it records (see `berth_store::AuditStore`).

use berth_proto::audit::{AuditPage, ListAudit};

use crate::infra::error::ApiResult;
use crate::services::caller::Caller;
use crate::SharedState;

/// The application side of `http/routes/audit.rs`'s `list`.
pub async fn list(state: &SharedState, caller: &Caller, query: ListAudit) -> ApiResult<AuditPage> {
    caller.require_admin()?;
    let limit = query.limit.unwrap_or(100).clamp(1, 1000);
    let items = state
        .store
        .list_audit(caller.tenant(), query.after, limit)
        .await?;
    let next = (items.len() == limit as usize)
        .then(|| items.last().map(|e| e.seq))
        .flatten();
    Ok(AuditPage { items, next })
}
