//! The session lease: acquiring it bumps the agent's generation, which fences every older process.

use axum::extract::State;
use axum::Json;
use berth_proto::error::codes;
use berth_proto::transport::{AcquireSession, Released, Session};
use berth_proto::ErrorBody;
use berth_store::SessionOutcome;

use super::gate::fenced;
use crate::http::auth::{binding_refused, AgentCaller, FencedAgent};
use crate::http::extract::ApiJson;
use crate::infra::error::{ApiError, ApiResult};
use crate::services::validate::validate_agent_version;
use crate::SharedState;

/// Acquire the session lease (mTLS). A second live process with the same identity is refused,
/// unless it holds the lock the holder held on the same boot (the holder is dead: a restart).
#[utoipa::path(post, path = "/api/v1/agents/{id}/session", tag = "agent-runtime", request_body = AcquireSession,
    security(("agentCertificate" = [])), params(("id" = String, Path, format = Uuid)),
    responses(
        (status = 200, body = Session),
        (status = 409, body = ErrorBody, description = "SESSION_HELD: another live process holds this identity"),
    ))]
pub async fn acquire_session(
    State(state): State<SharedState>,
    AgentCaller { id, peer }: AgentCaller,
    ApiJson(req): ApiJson<AcquireSession>,
) -> ApiResult<Json<Session>> {
    if req.instance_id.is_empty() || req.instance_id.len() > 128 {
        return Err(ApiError::unprocessable(
            codes::INVALID_REQUEST,
            "instanceId must be 1-128 characters",
        ));
    }
    let restart_key = restart_key(&req)?;
    if let Some(version) = &req.version {
        validate_agent_version(version)?;
    }
    let now = state.config.clock.now();
    let lease_expires_at = now + state.config.heartbeat_interval * 3;
    match state
        .store
        .acquire_session(
            id,
            &peer.fingerprint,
            &req.instance_id,
            restart_key.as_deref(),
            now,
            lease_expires_at,
        )
        .await?
    {
        SessionOutcome::Acquired {
            generation,
            lease_expires_at,
        } => {
            tracing::info!(agent_id = %id, generation, instance = %req.instance_id, holds_lock = restart_key.is_some(), version = req.version.as_deref().unwrap_or("-"), "session acquired");
            // What this process runs: an agent upgraded in place shows its new version. A newer
            // session taking over first wins (the write is for this generation only).
            if let Some(version) = &req.version {
                state
                    .store
                    .record_agent_version(id, generation, version)
                    .await?;
            }
            Ok(Json(Session {
                generation,
                lease_expires_at,
                heartbeat_interval_seconds: state.config.heartbeat_interval.as_secs().max(1),
                sealing_key: state.sealing_public.clone(),
            }))
        }
        SessionOutcome::Held {
            holder_instance,
            lease_expires_at,
        } => {
            // Two live processes with one identity: a cloned VM or a copied state dir.
            tracing::error!(
                agent_id = %id, holder = %holder_instance, contender = %req.instance_id,
                "ALERT: a second live process presents this agent's identity; session refused"
            );
            state.metrics.session_held();
            // Degraded for as long as a session lease from now: a clone that keeps trying
            // keeps it so, and the mark fades once it has stopped.
            state
                .store
                .mark_agent_degraded(id, now + state.config.heartbeat_interval * 3)
                .await?;
            let mut error = ApiError::conflict(
                codes::SESSION_HELD,
                format!("another live process holds this agent's session until {lease_expires_at}"),
            );
            error.retry_after = Some((lease_expires_at - now).whole_seconds().max(1) as u64);
            Err(error)
        }
        SessionOutcome::Revoked => Err(binding_refused(&state, id, &peer).await),
    }
}

/// What a session request proves about its process: it holds its installation's lock (`lock`)
/// on this boot (`bootId`). A later process presenting the same key holds the same lock, so the
/// holder that recorded it is dead (the store lets it take the live lease). Without both, None.
fn restart_key(req: &AcquireSession) -> ApiResult<Option<String>> {
    let field = |name: &str, value: &Option<String>| match value.as_deref() {
        Some(v) if v.is_empty() || v.len() > 128 || v.contains('/') => {
            Err(ApiError::unprocessable(
                codes::INVALID_REQUEST,
                format!("{name} must be 1-128 characters without '/'"),
            ))
        }
        v => Ok(v.map(str::to_owned)),
    };
    Ok(
        match (field("bootId", &req.boot_id)?, field("lock", &req.lock)?) {
            (Some(boot), Some(lock)) => Some(format!("{boot}/{lock}")),
            _ => None,
        },
    )
}

/// Release the session lease on a graceful stop (mTLS, with the generation).
#[utoipa::path(delete, path = "/api/v1/agents/{id}/session", tag = "agent-runtime",
    security(("agentCertificate" = [])),
    params(("id" = String, Path, format = Uuid), ("X-Berth-Generation" = i64, Header)),
    responses((status = 200, body = Released)))]
pub async fn release_session(
    State(state): State<SharedState>,
    FencedAgent { id, generation, .. }: FencedAgent,
) -> ApiResult<Json<Released>> {
    let released = state
        .store
        .release_session(id, generation, state.config.clock.now())
        .await?;
    if released {
        Ok(Json(Released { released }))
    } else {
        Err(fenced("the session is held by a newer generation"))
    }
}
