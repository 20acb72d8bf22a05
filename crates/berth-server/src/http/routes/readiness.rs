//! An environment's readiness (issue 14): its conditions, and `verify`, which asks for a fresh
//! pass and answers with the nonce the pass will echo. Adapters over `services::environments`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use berth_proto::readiness::{EnvironmentReadiness, VerifyResponse};
use berth_proto::ErrorBody;

use crate::http::auth::Caller;
use crate::http::extract::ApiPath;
use crate::infra::error::ApiResult;
use crate::services::environments;
use crate::SharedState;

/// The environment's readiness conditions as its last pass left them, in evaluation order.
/// `operationalReady` is true only while every condition is `True` for the environment's
/// current generation; `verifyObserved` equals `verifyRequest` once a verification is done.
#[utoipa::path(get, path = "/api/v1/environments/{name}/readiness", tag = "environments", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = EnvironmentReadiness),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn get_readiness(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<EnvironmentReadiness>> {
    environments::get_readiness(&state, &caller, name)
        .await
        .map(Json)
}

/// Ask for a completely fresh readiness pass (no result of an earlier pass is reused). The
/// answer's nonce becomes `verifyObserved` once every condition of that pass is terminal.
#[utoipa::path(post, path = "/api/v1/environments/{name}/verify", tag = "environments", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 202, body = VerifyResponse),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn verify(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<(StatusCode, Json<VerifyResponse>)> {
    environments::verify(&state, &caller, name)
        .await
        .map(|(status, body)| (status, Json(body)))
}
