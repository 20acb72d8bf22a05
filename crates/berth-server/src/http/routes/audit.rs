//! The audit log: `GET /api/v1/audit` (admin), and [`actor`], how a handler names its caller to
//! the store method that records the action. Every entry is appended by the store, in the
//! transaction of the action it records (see `berth_store::AuditStore`).

use axum::extract::State;
use axum::Json;
use berth_proto::audit::{AuditPage, ListAudit};
use berth_proto::ErrorBody;

use crate::http::extract::ApiQuery;
use crate::http::ui::session::ReadCaller;
use crate::infra::error::ApiResult;
use crate::services::audit;
use crate::SharedState;

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
    audit::list(&state, &caller, query).await.map(Json)
}
