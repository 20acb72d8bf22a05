//! Admin API: tenants (operator only), API tokens and one-time agent registration tokens.

use crate::http::auth::Caller;
use crate::http::extract::ApiJson;
use crate::infra::error::ApiResult;
use crate::services::tokens;
use crate::SharedState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use berth_proto::admin::{
    CreateAgentToken, CreateAgentTokenResponse, CreateApiToken, CreateApiTokenResponse,
    CreateTenant, CreateTenantResponse,
};
use berth_proto::ErrorBody;

/// Create a tenant and its first admin token (operator token only).
#[utoipa::path(post, path = "/api/v1/admin/tenants", tag = "admin", request_body = CreateTenant,
    security(("bearer" = [])),
    responses(
        (status = 201, body = CreateTenantResponse),
        (status = 403, body = ErrorBody, description = "OPERATOR_ONLY"),
        (status = 409, body = ErrorBody, description = "TENANT_NAME_TAKEN"),
    ))]
pub async fn create_tenant(
    State(state): State<SharedState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateTenant>,
) -> ApiResult<(StatusCode, Json<CreateTenantResponse>)> {
    tokens::create_tenant(&state, &caller, req)
        .await
        .map(|(status, body)| (status, Json(body)))
}

/// Create an API token in the caller's tenant.
#[utoipa::path(post, path = "/api/v1/admin/api-tokens", tag = "admin", request_body = CreateApiToken,
    security(("bearer" = [])),
    responses(
        (status = 201, body = CreateApiTokenResponse),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
    ))]
pub async fn create_api_token(
    State(state): State<SharedState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateApiToken>,
) -> ApiResult<(StatusCode, Json<CreateApiTokenResponse>)> {
    tokens::create_api_token(&state, &caller, req)
        .await
        .map(|(status, body)| (status, Json(body)))
}

/// Create a one-time agent registration token.
#[utoipa::path(post, path = "/api/v1/admin/agent-tokens", tag = "admin", request_body = CreateAgentToken,
    security(("bearer" = [])),
    responses(
        (status = 201, body = CreateAgentTokenResponse),
        (status = 400, body = ErrorBody, description = "INVALID_REQUEST: expiresInSeconds out of range"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: a label or the environment is not a valid name; INVALID_LABEL"),
    ))]
pub async fn create_agent_token(
    State(state): State<SharedState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateAgentToken>,
) -> ApiResult<(StatusCode, Json<CreateAgentTokenResponse>)> {
    tokens::create_agent_token(&state, &caller, req)
        .await
        .map(|(status, body)| (status, Json(body)))
}
