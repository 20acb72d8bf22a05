//! SSH targets (create, list, show, delete) and artifacts (push, list; the agent's read by
//! sha256). A target's private key never passes here: it names a builtin secret, which only a
//! task for its via agent carries, sealed (`targets.rs`).

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_proto::agent::Deleted;
use berth_proto::desired::{valid_sha, SecretPath, BUILTIN_MOUNT};
use berth_proto::error::codes;
use berth_proto::payload::SshTarget as PayloadTarget;
use berth_proto::ssh_target::{
    valid_ssh_target_name, ArtifactView, CreateSshTarget, SshTargetView, MAX_ARTIFACT_BYTES,
};
use berth_proto::{AgentId, ErrorBody, SshTargetId};
use berth_store::{Agent, Artifact, SshTarget, StoreError};

use crate::auth::{AgentCaller, Caller};
use crate::error::{ApiError, ApiResult};
use crate::extract::{ApiJson, ApiPath};
use crate::routes::admin::validate_labels;
use crate::routes::audit::actor;
use crate::SharedState;

/// Documents the bytes of an artifact.
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)] // Only documents the bytes.
pub struct ArtifactBytes(Vec<u8>);

/// The header that names an artifact's SHA-256 on the agent's read.
pub const ARTIFACT_SHA256_HEADER: &str = "x-artifact-sha256";

fn invalid(detail: impl Into<String>) -> ApiError {
    ApiError::unprocessable(codes::INVALID_REQUEST, detail)
}

fn not_found(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        codes::SSH_TARGET_NOT_FOUND,
        format!("no ssh target named {name:?}"),
    )
}

async fn view(state: &SharedState, t: SshTarget) -> ApiResult<SshTargetView> {
    // Stored by id, shown by name (the id when the agent is gone).
    let via_agent = match &t.via_agent {
        Some(id) => Some(match id.parse() {
            Ok(uuid) => state
                .store
                .get_agent(t.tenant_id, AgentId(uuid))
                .await?
                .map_or_else(|| id.clone(), |a| a.name),
            Err(_) => id.clone(),
        }),
        None => None,
    };
    Ok(SshTargetView {
        id: t.id,
        name: t.name,
        host: t.host,
        port: t.port,
        user: t.user,
        via_agent,
        via_selector: t.via_selector,
        host_key: t.host_key,
        key_secret: t.key_secret,
        labels: t.labels,
        created_at: t.created_at,
    })
}

/// The tenant's agent by id or by name.
async fn agent_named(state: &SharedState, caller: &Caller, name: &str) -> ApiResult<Agent> {
    if let Ok(id) = name.parse() {
        if let Some(agent) = state.store.get_agent(caller.tenant(), AgentId(id)).await? {
            return Ok(agent);
        }
    }
    let every = std::collections::BTreeMap::new();
    crate::services::tasks::matching_agents(state, caller.tenant(), &every, None)
        .await?
        .into_iter()
        .find(|a| a.name == name)
        .ok_or_else(|| {
            ApiError::unprocessable(
                codes::AGENT_NOT_FOUND,
                format!("viaAgent: no agent named {name:?}"),
            )
        })
}

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
    caller.require_admin()?;
    if !valid_ssh_target_name(&req.name) {
        return Err(invalid(
            "name must be 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit",
        ));
    }
    // The address and the pin follow the rules every SSH payload is checked by.
    PayloadTarget {
        host: req.host.clone(),
        port: req.port,
        user: req.user.clone(),
        host_key: req.host_key.clone(),
        connect_timeout: None,
    }
    .check("target")
    .map_err(invalid)?;
    validate_labels(&req.labels)?;
    validate_labels(&req.via_selector)?;
    let via_agent = match (&req.via_agent, req.via_selector.is_empty()) {
        (Some(name), true) => Some(agent_named(&state, &caller, name).await?.id.to_string()),
        (None, false) => None,
        _ => {
            return Err(invalid(
                "give exactly one of viaAgent and a non-empty viaSelector",
            ))
        }
    };
    let key = match SecretPath::parse(&format!("{BUILTIN_MOUNT}/{}", req.key_secret)) {
        Some(p) if p.store_key() == req.key_secret => p.store_key(),
        _ => return Err(invalid("keySecret must be a secret path, `<env>/<name>`")),
    };
    if state
        .store
        .get_secret(caller.tenant(), &key, None)
        .await?
        .is_none()
    {
        return Err(ApiError::unprocessable(
            codes::SECRET_NOT_FOUND,
            format!("keySecret: no secret {key:?}; `berth secret put {key} --from-file KEY` first"),
        ));
    }
    let target = SshTarget {
        id: SshTargetId::new(),
        tenant_id: caller.tenant(),
        name: req.name,
        host: req.host,
        port: req.port.unwrap_or(22),
        user: req.user,
        via_agent,
        via_selector: req.via_selector,
        host_key: req.host_key,
        key_secret: key,
        labels: req.labels,
        created_at: state.config.clock.now(),
    };
    match state.store.create_ssh_target(target, actor(&caller)).await {
        Ok(t) => Ok((StatusCode::CREATED, Json(view(&state, t).await?))),
        Err(StoreError::Conflict {
            constraint: "ssh_target_name",
        }) => Err(ApiError::conflict(
            codes::SSH_TARGET_EXISTS,
            "the tenant has an ssh target of that name",
        )),
        Err(e) => Err(e.into()),
    }
}

/// The tenant's SSH targets, by name.
#[utoipa::path(get, path = "/api/v1/ssh-targets", tag = "ssh-targets", security(("bearer" = [])),
    responses((status = 200, body = [SshTargetView])))]
pub async fn list(
    State(state): State<SharedState>,
    caller: Caller,
) -> ApiResult<Json<Vec<SshTargetView>>> {
    caller.can_read()?;
    let mut views = Vec::new();
    for t in state.store.list_ssh_targets(caller.tenant()).await? {
        views.push(view(&state, t).await?);
    }
    Ok(Json(views))
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
    caller.can_read()?;
    let target = state
        .store
        .get_ssh_target(caller.tenant(), &name)
        .await?
        .ok_or_else(|| not_found(&name))?;
    Ok(Json(view(&state, target).await?))
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
    caller.require_admin()?;
    let deleted = state
        .store
        .delete_ssh_target(
            caller.tenant(),
            &name,
            actor(&caller),
            state.config.clock.now(),
        )
        .await?;
    if !deleted {
        return Err(not_found(&name));
    }
    Ok(Json(Deleted { deleted }))
}

fn artifact_view(a: Artifact) -> ArtifactView {
    ArtifactView {
        sha256: a.sha256,
        size: a.size,
        created_at: a.created_at,
    }
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

/// The tenant's artifacts (metadata), newest first.
#[utoipa::path(get, path = "/api/v1/artifacts", tag = "ssh-targets", security(("bearer" = [])),
    responses((status = 200, body = [ArtifactView])))]
pub async fn list_artifacts(
    State(state): State<SharedState>,
    caller: Caller,
) -> ApiResult<Json<Vec<ArtifactView>>> {
    caller.can_read()?;
    let artifacts = state.store.list_artifacts(caller.tenant()).await?;
    Ok(Json(artifacts.into_iter().map(artifact_view).collect()))
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
