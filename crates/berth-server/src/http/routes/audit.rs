//! The audit log: `GET /api/v1/audit` (admin), and [`actor`], how a handler names its caller to
//! the store method that records the action. Every entry is appended by the store, in the
//! transaction of the action it records (see `berth_store::AuditStore`).

use axum::extract::State;
use axum::Json;
use berth_proto::audit::{AuditActor, AuditPage, ListAudit};
use berth_proto::ErrorBody;

use crate::auth::Caller;
use crate::error::ApiResult;
use crate::extract::ApiQuery;
use crate::ui::session::ReadCaller;
use crate::SharedState;

/// The caller as the audit log names it: by token id, name and role, never the secret.
pub(crate) fn actor(caller: &Caller) -> AuditActor {
    AuditActor::Token {
        id: caller.0.id.0,
        name: caller.0.name.clone(),
        role: caller.0.role,
    }
}

/// The caller's tenant's audit chain, in `seq` order (admin). `berth audit export` pages
/// through it; `berth audit verify` checks the export offline.
#[utoipa::path(get, path = "/api/v1/audit", tag = "audit", params(ListAudit), security(("bearer" = [])),
    responses((status = 200, body = AuditPage),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin")))]
pub async fn list(
    State(state): State<SharedState>,
    ReadCaller(caller): ReadCaller,
    ApiQuery(query): ApiQuery<ListAudit>,
) -> ApiResult<Json<AuditPage>> {
    caller.require_admin()?;
    let limit = query.limit.unwrap_or(100).clamp(1, 1000);
    let items = state
        .store
        .list_audit(caller.tenant(), query.after, limit)
        .await?;
    let next = (items.len() == limit as usize)
        .then(|| items.last().map(|e| e.seq))
        .flatten();
    Ok(Json(AuditPage { items, next }))
}
