//! SSH targets (create, list, show, delete) and artifacts (push, list; the agent's read by
//! sha256). A target's private key never passes here: it names a builtin secret, which only a
//! task for its via agent carries, sealed (`targets.rs`).

use crate::http::auth::{AgentCaller, Caller};
use crate::http::extract::{ApiJson, ApiPath};
use crate::infra::error::{ApiError, ApiResult};
use crate::services::caller::actor;
use crate::services::ssh_targets::{self, artifact_view};
use crate::SharedState;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_proto::agent::Deleted;
use berth_proto::desired::valid_sha;
use berth_proto::error::codes;
use berth_proto::ssh_target::{ArtifactView, CreateSshTarget, SshTargetView, MAX_ARTIFACT_BYTES};
use berth_proto::{AgentId, ErrorBody};
use berth_store::Artifact;

/// Documents the bytes of an artifact.
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)] // Only documents the bytes.
pub struct ArtifactBytes(Vec<u8>);

/// The header that names an artifact's SHA-256 on the agent's read.
pub const ARTIFACT_SHA256_HEADER: &str = "x-artifact-sha256";

/// Register a host without an agent, reached through one: an agent by name (`viaAgent`), or
/// any online agent carrying `viaSelector`'s labels. Its host key is pinned now; its private
/// key stays in the named builtin secret.
#[utoipa::path(post, path = "/api/v1/ssh-targets", tag = "ssh-targets", request_body = CreateSshTarget,
    security(("bearer" = [])),
    responses((status = 201, body = SshTargetView, description = "created"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 409, body = ErrorBody, description = "SSH_TARGET_EXISTS"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST (names the field), AGENT_NOT_FOUND (`viaAgent`) or SECRET_NOT_FOUND (`keySecret`)")))]
pub async fn create(
    State(state): State<SharedState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateSshTarget>,
) -> ApiResult<(StatusCode, Json<SshTargetView>)> {
    ssh_targets::create(&state, &caller, req)
        .await
        .map(|(status, body)| (status, Json(body)))
}

/// The tenant's SSH targets, by name.
#[utoipa::path(get, path = "/api/v1/ssh-targets", tag = "ssh-targets", security(("bearer" = [])),
    responses((status = 200, body = [SshTargetView])))]
pub async fn list(
    State(state): State<SharedState>,
    caller: Caller,
) -> ApiResult<Json<Vec<SshTargetView>>> {
    ssh_targets::list(&state, &caller).await.map(Json)
}

#[utoipa::path(get, path = "/api/v1/ssh-targets/{name}", tag = "ssh-targets", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = SshTargetView),
        (status = 404, body = ErrorBody, description = "SSH_TARGET_NOT_FOUND")))]
pub async fn get(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<SshTargetView>> {
    ssh_targets::get(&state, &caller, name).await.map(Json)
}

#[utoipa::path(delete, path = "/api/v1/ssh-targets/{name}", tag = "ssh-targets", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = Deleted),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody, description = "SSH_TARGET_NOT_FOUND")))]
pub async fn delete(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<Deleted>> {
    ssh_targets::delete(&state, &caller, name).await.map(Json)
}

/// The tenant's artifacts (metadata), newest first.
#[utoipa::path(get, path = "/api/v1/artifacts", tag = "ssh-targets", security(("bearer" = [])),
    responses((status = 200, body = [ArtifactView])))]
pub async fn list_artifacts(
    State(state): State<SharedState>,
    caller: Caller,
) -> ApiResult<Json<Vec<ArtifactView>>> {
    ssh_targets::list_artifacts(&state, &caller).await.map(Json)
}

/// Store a file a release can ship to SSH targets, under its SHA-256 (computed here). Pushing
/// the same bytes again changes nothing (200).
#[utoipa::path(post, path = "/api/v1/artifacts", tag = "ssh-targets", security(("bearer" = [])),
    request_body(content = ArtifactBytes, content_type = "application/octet-stream"),
    responses((status = 201, body = ArtifactView, description = "stored"),
        (status = 200, body = ArtifactView, description = "already stored"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 413, body = ErrorBody, description = "PAYLOAD_TOO_LARGE: over 256 MiB")))]
pub async fn push_artifact(
    State(state): State<SharedState>,
    caller: Caller,
    body: Body,
) -> ApiResult<(StatusCode, Json<ArtifactView>)> {
    caller.require_deployer()?;
    let bytes = axum::body::to_bytes(body, MAX_ARTIFACT_BYTES)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                codes::PAYLOAD_TOO_LARGE,
                format!("an artifact is at most {MAX_ARTIFACT_BYTES} bytes"),
            )
        })?;
    let sha256 = hex::encode(berth_crypto::sha256(&bytes));
    if let Some(existing) = state.store.get_artifact(caller.tenant(), &sha256).await? {
        return Ok((StatusCode::OK, Json(artifact_view(existing))));
    }
    let stored = state
        .store
        .put_artifact(
            Artifact {
                tenant_id: caller.tenant(),
                sha256,
                size: bytes.len() as u64,
                created_at: state.config.clock.now(),
            },
            bytes.to_vec(),
            actor(&caller),
        )
        .await?;
    Ok((StatusCode::CREATED, Json(artifact_view(stored))))
}

/// An artifact of the agent's tenant, by SHA-256: what `ssh.deploy` and `upload-files` fetch
/// for a file given by reference (the agent checks the hash before writing it).
#[utoipa::path(get, path = "/api/v1/agents/{id}/artifacts/{sha256}", tag = "agent-runtime",
    security(("agentCertificate" = [])),
    params(("id" = String, Path, format = Uuid), ("sha256" = String, Path)),
    responses(
        (status = 200, body = ArtifactBytes, content_type = "application/octet-stream"),
        (status = 404, body = ErrorBody, description = "ARTIFACT_NOT_FOUND")))]
pub async fn agent_artifact(
    State(state): State<SharedState>,
    caller: AgentCaller,
    ApiPath((_, sha256)): ApiPath<(AgentId, String)>,
) -> ApiResult<Response> {
    let agent = caller.bound(&state).await?;
    let content = if valid_sha(&sha256) {
        state
            .store
            .artifact_content(agent.tenant_id, &sha256)
            .await?
    } else {
        None
    };
    let content = content.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            codes::ARTIFACT_NOT_FOUND,
            "no artifact with that sha256 in the agent's tenant",
        )
    })?;
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/octet-stream"),
    );
    headers.insert(
        ARTIFACT_SHA256_HEADER,
        header::HeaderValue::from_str(&sha256).map_err(|e| ApiError::internal(&e))?,
    );
    Ok((headers, content).into_response())
}
