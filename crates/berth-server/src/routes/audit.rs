//! The audit log: `GET /api/v1/audit` (admin), and [`record`], how the tenant, token and agent
//! handlers append their action. Task actions (create, cancel, retry) and verified results are
//! appended by the store itself, in the action's own transaction (see `berth_store::AuditStore`).

use axum::extract::State;
use axum::Json;
use berth_proto::audit::{AuditActor, AuditPage, ListAudit};
use berth_proto::ErrorBody;
use berth_store::NewAuditEvent;

use crate::auth::Caller;
use crate::error::ApiResult;
use crate::extract::ApiQuery;
use crate::SharedState;

/// Records `action` on `subject` by `caller` in the caller's tenant's chain, right after the
/// action committed (the store methods of these actions take no actor). The token appears by id, name and role; never its secret. A failed append
/// fails the request (500), so an action that answered success is in the log.
pub(crate) async fn record(
    state: &SharedState,
    caller: &Caller,
    action: &'static str,
    subject: impl ToString,
    details: serde_json::Value,
) -> ApiResult<()> {
    state
        .store
        .append_audit(NewAuditEvent {
            tenant_id: caller.tenant(),
            actor: actor(caller),
            action,
            subject: subject.to_string(),
            details,
            at: state.config.clock.now(),
        })
        .await?;
    Ok(())
}

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
    caller: Caller,
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
