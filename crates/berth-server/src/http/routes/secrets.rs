//! Builtin secrets and deploy grants over HTTP: the admin secret API (values go in, never out),
//! the install kit, the agent's lease and its `builtin` KV read (shaped like OpenBao's KV v2).
//!
//! A value is decrypted only for the KV read of an agent that proves its certificate, belongs
//! to the path's environment and presents a live lease of it; it is never logged.

use crate::http::auth::{Caller, DesiredCaller};
use crate::http::extract::{ApiJson, ApiPath, ApiQuery};
use crate::infra::error::ApiResult;
use crate::services::secrets::{self, kv_read, lease, KvQuery, ListSecrets};
use crate::SharedState;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Json;
use berth_proto::agent::Deleted;
use berth_proto::desired::{KitView, LeaseRequest, LeaseResponse, PutSecret, SecretVersionView};
use berth_proto::ErrorBody;

/// Store a new version of a secret: the given `value`, or 32 random bytes (`generate`). The
/// answer is the version's metadata, never the value.
#[utoipa::path(put, path = "/api/v1/secrets/{*path}", tag = "secrets", request_body = PutSecret,
    security(("bearer" = [])), params(("path" = String, Path, description = "`<env>/<name>`")),
    responses((status = 200, body = SecretVersionView),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 409, body = ErrorBody, description = "CONSTRAINT_CONFLICT: concurrent puts took the next versions"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: a bad path, or not exactly one of `value` and `generate`")))]
pub async fn put_secret(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(path): ApiPath<String>,
    ApiJson(req): ApiJson<PutSecret>,
) -> ApiResult<Json<SecretVersionView>> {
    secrets::put_secret(&state, &caller, path, req)
        .await
        .map(Json)
}

/// The latest live version of every secret (metadata only).
#[utoipa::path(get, path = "/api/v1/secrets", tag = "secrets", security(("bearer" = [])),
    params(ListSecrets), responses((status = 200, body = [SecretVersionView])))]
pub async fn list_secrets(
    State(state): State<SharedState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<ListSecrets>,
) -> ApiResult<Json<Vec<SecretVersionView>>> {
    secrets::list_secrets(&state, &caller, query)
        .await
        .map(Json)
}

/// Every version of a secret, deleted ones too (metadata only). The path ends in `/versions`:
/// `GET /api/v1/secrets/qa/see/pg/versions`.
#[utoipa::path(get, path = "/api/v1/secrets/{*path}", tag = "secrets", security(("bearer" = [])),
    params(("path" = String, Path, description = "`<env>/<name>/versions`")),
    responses((status = 200, body = [SecretVersionView]),
        (status = 404, body = ErrorBody, description = "SECRET_NOT_FOUND: no version was ever stored"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: not a secret path")))]
pub async fn secret_versions(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(path): ApiPath<String>,
) -> ApiResult<Json<Vec<SecretVersionView>>> {
    secrets::secret_versions(&state, &caller, path)
        .await
        .map(Json)
}

/// Mark every version of a secret deleted: agents' reads of it answer `404 SECRET_NOT_FOUND`.
#[utoipa::path(delete, path = "/api/v1/secrets/{*path}", tag = "secrets", security(("bearer" = [])),
    params(("path" = String, Path, description = "`<env>/<name>`")),
    responses((status = 200, body = Deleted),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody, description = "SECRET_NOT_FOUND"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: not a secret path")))]
pub async fn delete_secret(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(path): ApiPath<String>,
) -> ApiResult<Json<Deleted>> {
    secrets::delete_secret(&state, &caller, path)
        .await
        .map(Json)
}

/// Reveal an install kit: a bootstrap deploy grant for the environment. Every earlier grant of
/// the environment (kits and leases) is superseded in the same transaction, so an older kit
/// stops working. The grant is in this answer only.
#[utoipa::path(post, path = "/api/v1/environments/{name}/kit", tag = "environments", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = KitView),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn kit(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<KitView>> {
    secrets::kit(&state, &caller, name).await.map(Json)
}

/// A deploy grant to log in with at OpenBao (`mount`, `role`, `addr`), or, with the `builtin`
/// provider (`mount: builtin`), to present in `X-Berth-Lease` to the KV read.
#[utoipa::path(post, path = "/v1/agent/lease", tag = "agent-runtime", request_body = LeaseRequest,
    security(("agentCertificate" = [])),
    responses((status = 200, body = LeaseResponse),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH: the agent is not in `env_id`")))]
pub async fn agent_lease(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    ApiJson(req): ApiJson<LeaseRequest>,
) -> ApiResult<Response> {
    lease(state, caller, req).await
}

/// [`agent_lease`] under `/api`.
#[utoipa::path(post, path = "/api/v1/agent/lease", tag = "agent-runtime", request_body = LeaseRequest,
    security(("agentCertificate" = [])),
    responses((status = 200, body = LeaseResponse),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH: the agent is not in `env_id`")))]
pub async fn api_agent_lease(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    ApiJson(req): ApiJson<LeaseRequest>,
) -> ApiResult<Response> {
    lease(state, caller, req).await
}

/// berth's own secret read (provider `builtin`), shaped like OpenBao's KV v2 read:
/// `{"data": {"data": {"value": …}, "metadata": {"version": N}}}`. Both manifest path forms
/// (`<mount>/<env>/<name>`, `<mount>/data/<env>/<name>`) read the same secret.
#[utoipa::path(get, path = "/v1/agent/kv/{*path}", tag = "agent-runtime",
    security(("agentCertificate" = [])),
    params(("path" = String, Path), KvQuery, ("X-Berth-Lease" = String, Header)),
    responses((status = 200, description = "the secret, KV v2 shaped"),
        (status = 401, body = ErrorBody, description = "LEASE_REQUIRED: no, an invalid, a superseded or an expired lease"),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH: the path's environment is not the agent's"),
        (status = 404, body = ErrorBody, description = "SECRET_NOT_FOUND"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: not a secret path")))]
pub async fn agent_kv(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    headers: HeaderMap,
    ApiPath(path): ApiPath<String>,
    ApiQuery(query): ApiQuery<KvQuery>,
) -> ApiResult<Response> {
    kv_read(state, caller, headers, path, query.version).await
}

/// [`agent_kv`] under `/api`.
#[utoipa::path(get, path = "/api/v1/agent/kv/{*path}", tag = "agent-runtime",
    security(("agentCertificate" = [])),
    params(("path" = String, Path), KvQuery, ("X-Berth-Lease" = String, Header)),
    responses((status = 200, description = "the secret, KV v2 shaped"),
        (status = 401, body = ErrorBody, description = "LEASE_REQUIRED: no, an invalid, a superseded or an expired lease"),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH: the path's environment is not the agent's"),
        (status = 404, body = ErrorBody, description = "SECRET_NOT_FOUND"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: not a secret path")))]
pub async fn api_agent_kv(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    headers: HeaderMap,
    ApiPath(path): ApiPath<String>,
    ApiQuery(query): ApiQuery<KvQuery>,
) -> ApiResult<Response> {
    kv_read(state, caller, headers, path, query.version).await
}
