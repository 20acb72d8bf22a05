//! SSH targets (create, list, show, delete) and artifacts (push, list; the agent's read by
//! sha256). A target's private key never passes here: it names a builtin secret, which only a
//! task for its via agent carries, sealed (`targets.rs`).

use axum::http::StatusCode;
use berth_proto::agent::Deleted;
use berth_proto::desired::{SecretPath, BUILTIN_MOUNT};
use berth_proto::error::codes;
use berth_proto::payload::SshTarget as PayloadTarget;
use berth_proto::ssh_target::{
    valid_ssh_target_name, ArtifactView, CreateSshTarget, SshTargetView,
};
use berth_proto::{AgentId, SshTargetId};
use berth_store::{Agent, Artifact, SshTarget, StoreError};

use crate::infra::error::{ApiError, ApiResult};
use crate::services::caller::actor;
use crate::services::caller::Caller;
use crate::services::validate::validate_labels;
use crate::SharedState;

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
pub async fn create(
    state: &SharedState,
    caller: &Caller,
    req: CreateSshTarget,
) -> ApiResult<(StatusCode, SshTargetView)> {
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
        (Some(name), true) => Some(agent_named(state, caller, name).await?.id.to_string()),
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
    match state.store.create_ssh_target(target, actor(caller)).await {
        Ok(t) => Ok((StatusCode::CREATED, view(state, t).await?)),
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
pub async fn list(state: &SharedState, caller: &Caller) -> ApiResult<Vec<SshTargetView>> {
    caller.can_read()?;
    let mut views = Vec::new();
    for t in state.store.list_ssh_targets(caller.tenant()).await? {
        views.push(view(state, t).await?);
    }
    Ok(views)
}

pub async fn get(state: &SharedState, caller: &Caller, name: String) -> ApiResult<SshTargetView> {
    caller.can_read()?;
    let target = state
        .store
        .get_ssh_target(caller.tenant(), &name)
        .await?
        .ok_or_else(|| not_found(&name))?;
    view(state, target).await
}

pub async fn delete(state: &SharedState, caller: &Caller, name: String) -> ApiResult<Deleted> {
    caller.require_admin()?;
    let deleted = state
        .store
        .delete_ssh_target(
            caller.tenant(),
            &name,
            actor(caller),
            state.config.clock.now(),
        )
        .await?;
    if !deleted {
        return Err(not_found(&name));
    }
    Ok(Deleted { deleted })
}

pub fn artifact_view(a: Artifact) -> ArtifactView {
    ArtifactView {
        sha256: a.sha256,
        size: a.size,
        created_at: a.created_at,
    }
}

/// The tenant's artifacts (metadata), newest first.
pub async fn list_artifacts(state: &SharedState, caller: &Caller) -> ApiResult<Vec<ArtifactView>> {
    caller.can_read()?;
    let artifacts = state.store.list_artifacts(caller.tenant()).await?;
    Ok(artifacts.into_iter().map(artifact_view).collect())
}
