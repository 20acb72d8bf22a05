//! Agents: registration with a one-time token and a CSR, management by admins, and the
//! mTLS-only calls an agent makes about itself (heartbeat, JWT, certificate renewal).

use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use berth_proto::agent::{
    Agent, AgentHold, AgentJwt, AgentList, AgentStatus, Capability, Deleted, Heartbeat,
    HeartbeatResponse, IssueAgentJwt, ListAgents, RegisterAgent, RegisterAgentResponse,
    RenewCertificate, RenewCertificateResponse, UpdateAgent, HEARTBEAT_TASKS_MAX,
};
use berth_proto::error::codes;
use berth_proto::{AgentId, ErrorBody, TaskId};
use berth_store::{
    AgentUpdate, HeartbeatOutcome, HeartbeatRecord, NewAgent, RebindOutcome, RegisterError,
};
use serde_json::json;

use crate::http::auth::{binding_refused, AgentCaller, Caller, FencedAgent};
use crate::http::extract::{ApiJson, ApiPath, ApiQuery};
use crate::http::routes::transport::verify_signature;
use crate::infra::error::{ApiError, ApiResult};
use crate::services::agents;
use crate::services::caller::actor;
use crate::services::validate::{validate_agent_version, validate_labels, validate_name};
use crate::SharedState;

use berth_proto::headers::REGISTRATION_TOKEN_HEADER;

fn validate_capabilities(capabilities: &[Capability]) -> ApiResult<()> {
    let invalid = |detail: String| ApiError::unprocessable(codes::INVALID_REQUEST, detail);
    if capabilities.len() > 32 {
        return Err(invalid("at most 32 capabilities".into()));
    }
    for c in capabilities {
        let name_ok = !c.name.is_empty()
            && c.name.len() <= 32
            && c.name.chars().all(|ch| {
                ch.is_ascii_lowercase() || ch.is_ascii_digit() || matches!(ch, '-' | '.' | '_')
            });
        if !name_ok {
            return Err(invalid(format!(
                "capability name {:?} must be 1-32 of a-z 0-9 . _ -",
                c.name
            )));
        }
        let short = |s: &Option<String>, max: usize| s.as_ref().is_none_or(|s| s.len() <= max);
        if !short(&c.version, 64) || !short(&c.detail, 512) {
            return Err(invalid(format!(
                "capability {:?} has an overlong version or detail",
                c.name
            )));
        }
    }
    Ok(())
}

/// Register an agent: one-time token in `X-Registration-Token`, CSR in the body.
#[utoipa::path(post, path = "/api/v1/agents/register", tag = "agents", request_body = RegisterAgent,
    params(("X-Registration-Token" = String, Header, description = "one-time registration token")),
    responses(
        (status = 201, body = RegisterAgentResponse),
        (status = 400, body = ErrorBody, description = "INVALID_CSR"),
        (status = 401, body = ErrorBody, description = "REGISTRATION_TOKEN_INVALID: unknown, used or expired"),
        (status = 409, body = ErrorBody, description = "AGENT_NAME_TAKEN"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: name, version, a label or a capability is invalid; INVALID_LABEL"),
    ))]
pub async fn register(
    State(state): State<SharedState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<RegisterAgent>,
) -> ApiResult<(StatusCode, Json<RegisterAgentResponse>)> {
    let token = headers
        .get(REGISTRATION_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|t| !t.is_empty())
        .ok_or_else(|| {
            ApiError::unauthenticated(
                codes::REGISTRATION_TOKEN_INVALID,
                "missing X-Registration-Token",
            )
        })?;
    validate_name("agent name", &req.name)?;
    validate_agent_version(&req.version)?;
    validate_labels(&req.labels)?;
    validate_capabilities(&req.capabilities)?;

    let now = state.config.clock.now();
    let id = AgentId::new();
    let validity = time::Duration::try_from(state.config.agent_cert_validity)
        .map_err(|e| ApiError::internal(&e))?;
    let issued = state
        .ca
        .sign_agent_csr(&req.csr, id.0, now, validity)
        .map_err(|e| {
            state.metrics.registration("invalid_csr");
            ApiError::bad_request(codes::INVALID_CSR, format!("the CSR was refused: {e}"))
        })?;
    let outcome = state
        .store
        .register_agent(
            &berth_crypto::hash_token(token),
            NewAgent {
                id,
                name: req.name.clone(),
                version: req.version,
                capabilities: req.capabilities,
                labels: req.labels,
                certificate_fingerprint: issued.fingerprint.clone(),
                certificate_expires_at: issued.not_after,
                created_at: now,
            },
            now,
        )
        .await?;
    match outcome {
        Ok(agent) => {
            state.metrics.registration("ok");
            tracing::info!(agent_id = %agent.id, name = %agent.name, tenant = %agent.tenant_id, "agent registered");
            Ok((
                StatusCode::CREATED,
                Json(RegisterAgentResponse {
                    agent_id: agent.id,
                    certificate: issued.cert_pem,
                    ca_certificate: state.ca.cert_pem().to_string(),
                }),
            ))
        }
        Err(RegisterError::TokenInvalid) => {
            state.metrics.registration("token_invalid");
            Err(ApiError::unauthenticated(
                codes::REGISTRATION_TOKEN_INVALID,
                "the registration token is unknown, used or expired",
            ))
        }
        Err(RegisterError::NameTaken) => {
            state.metrics.registration("name_taken");
            Err(ApiError::conflict(
                codes::AGENT_NAME_TAKEN,
                format!("an agent named {:?} exists in this tenant", req.name),
            ))
        }
    }
}

/// List the tenant's agents, filtered, a page at a time.
#[utoipa::path(get, path = "/api/v1/agents", tag = "agents", params(ListAgents), security(("bearer" = [])),
    responses((status = 200, body = AgentList)))]
pub async fn list(
    State(state): State<SharedState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<ListAgents>,
) -> ApiResult<Json<AgentList>> {
    agents::list(&state, &caller, query).await.map(Json)
}

#[utoipa::path(get, path = "/api/v1/agents/{id}", tag = "agents", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = Agent), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<AgentId>,
) -> ApiResult<Json<Agent>> {
    agents::get(&state, &caller, id).await.map(Json)
}

/// Replace an agent's labels and/or capabilities (admin).
#[utoipa::path(put, path = "/api/v1/agents/{id}", tag = "agents", request_body = UpdateAgent,
    security(("bearer" = [])), params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = Agent), (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: a label or a capability is invalid; INVALID_LABEL")))]
pub async fn update(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<AgentId>,
    ApiJson(req): ApiJson<UpdateAgent>,
) -> ApiResult<Json<Agent>> {
    caller.require_admin()?;
    if let Some(labels) = &req.labels {
        validate_labels(labels)?;
    }
    if let Some(capabilities) = &req.capabilities {
        validate_capabilities(capabilities)?;
    }
    let update = AgentUpdate {
        labels: req.labels,
        capabilities: req.capabilities,
        updated_by: Some(actor(&caller)),
    };
    match state
        .store
        .update_agent(caller.tenant(), id, update, state.config.clock.now())
        .await?
    {
        Some(a) => Ok(Json(agents::to_wire(a))),
        None => Err(ApiError::not_found("agent")),
    }
}

/// Delete an agent (admin). Its certificate is refused from the next call on.
#[utoipa::path(delete, path = "/api/v1/agents/{id}", tag = "agents", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = Deleted), (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody)))]
pub async fn delete(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<AgentId>,
) -> ApiResult<Json<Deleted>> {
    caller.require_admin()?;
    let (by, now) = (actor(&caller), state.config.clock.now());
    if state
        .store
        .delete_agent(caller.tenant(), id, by, now)
        .await?
    {
        tracing::info!(agent_id = %id, "agent deleted");
        Ok(Json(Deleted { deleted: true }))
    } else {
        Err(ApiError::not_found("agent"))
    }
}

/// Sets or lifts a hold. Admin only: a hold changes where every deployer's work may go (and a
/// suspension stops an agent's queue), which is an operator's call about the fleet, like
/// deleting an agent; a deployer's lever is the task or the deployment.
async fn hold(
    state: SharedState,
    caller: Caller,
    id: AgentId,
    hold: AgentHold,
) -> ApiResult<Json<Agent>> {
    caller.require_admin()?;
    let (by, now) = (actor(&caller), state.config.clock.now());
    let agent = state
        .store
        .set_agent_hold(caller.tenant(), id, hold, by, now)
        .await?
        .ok_or_else(|| ApiError::not_found("agent"))?;
    tracing::info!(agent_id = %id, hold = hold.as_str(), "agent hold");
    if hold == AgentHold::Resume {
        // A poll parked while the agent was suspended found nothing; its queue may hold work.
        // (A poll parked on another replica finds it when its hold ends, within 25 s.)
        state.wakeups.wake(id);
    }
    Ok(Json(agents::to_wire(agent)))
}

/// Cordon an agent (admin): no new work is routed to it. Creates naming it get `409
/// AGENT_CORDONED`, selectors and deployments skip it; the tasks it already has still run.
#[utoipa::path(post, path = "/api/v1/agents/{id}/cordon", tag = "agents", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = Agent), (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody)))]
pub async fn cordon(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<AgentId>,
) -> ApiResult<Json<Agent>> {
    hold(state, caller, id, AgentHold::Cordon).await
}

/// Lift a cordon (admin).
#[utoipa::path(post, path = "/api/v1/agents/{id}/uncordon", tag = "agents", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = Agent), (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody)))]
pub async fn uncordon(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<AgentId>,
) -> ApiResult<Json<Agent>> {
    hold(state, caller, id, AgentHold::Uncordon).await
}

/// Suspend an agent (admin): it claims nothing new and shows as `blocked`; it keeps its
/// session and heartbeats, and what it already holds may still finish.
#[utoipa::path(post, path = "/api/v1/agents/{id}/suspend", tag = "agents", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = Agent), (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody)))]
pub async fn suspend(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<AgentId>,
) -> ApiResult<Json<Agent>> {
    hold(state, caller, id, AgentHold::Suspend).await
}

/// Resume a suspended agent (admin).
#[utoipa::path(post, path = "/api/v1/agents/{id}/resume", tag = "agents", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = Agent), (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody)))]
pub async fn resume(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<AgentId>,
) -> ApiResult<Json<Agent>> {
    hold(state, caller, id, AgentHold::Resume).await
}

/// Heartbeat (mTLS): status, resource usage and capabilities, signed with the agent's key like a
/// result. Committed in a group with concurrent heartbeats; applied only while the certificate is
/// the agent's binding, the generation current and the sequence above the last one applied.
#[utoipa::path(post, path = "/api/v1/agents/{id}/heartbeat", tag = "agent-runtime", request_body = Heartbeat,
    security(("agentCertificate" = [])),
    params(("id" = String, Path, format = Uuid), ("X-Berth-Generation" = i64, Header)),
    responses(
        (status = 200, body = HeartbeatResponse),
        (status = 409, body = ErrorBody, description = "FENCED: stale generation; HEARTBEAT_REPLAYED: the sequence is not above the last one applied in this generation, or the signed generation is not X-Berth-Generation"),
        (status = 422, body = ErrorBody, description = "SIGNATURE_MISSING, SIGNATURE_INVALID, UNSUPPORTED_SIGNATURE_ALGORITHM, INVALID_REQUEST"),
    ))]
pub async fn heartbeat(
    State(state): State<SharedState>,
    FencedAgent {
        id,
        peer,
        generation,
    }: FencedAgent,
    ApiJson(raw): ApiJson<serde_json::Value>,
) -> ApiResult<Json<HeartbeatResponse>> {
    // Nothing in the body is believed before its signature verifies with the connection's
    // certificate; the store then applies it only while that certificate is the binding.
    let refused = |code: &'static str, detail: String| {
        tracing::warn!(agent_id = %id, generation, code, %detail, "heartbeat refused");
        state.metrics.error("heartbeat_refused");
    };
    verify_signature(&raw, "heartbeat", |algorithm, message, signature| {
        peer.result_verifier()
            .and_then(|verifier| verifier.verify(algorithm, message, signature))
            .is_ok()
    })
    .map_err(|refusal| {
        refused(refusal.code, refusal.detail.clone());
        ApiError::unprocessable(refusal.code, refusal.detail)
    })?;
    let req: Heartbeat = serde_json::from_value(raw)
        .map_err(|e| ApiError::unprocessable(codes::INVALID_REQUEST, e.to_string()))?;
    if req.generation != generation {
        let detail = format!(
            "the heartbeat is signed for generation {}, not this session's {generation}",
            req.generation
        );
        refused(codes::HEARTBEAT_REPLAYED, detail.clone());
        return Err(ApiError::conflict(codes::HEARTBEAT_REPLAYED, detail));
    }
    let sequence = i64::try_from(req.sequence)
        .map_err(|_| ApiError::unprocessable(codes::INVALID_REQUEST, "sequence is above 2^63-1"))?;
    // `blocked` is the server's view of a suspension, never the agent's word.
    if matches!(
        req.status,
        AgentStatus::Offline | AgentStatus::Registered | AgentStatus::Blocked
    ) {
        return Err(ApiError::unprocessable(
            codes::INVALID_REQUEST,
            "an agent reports itself online or degraded",
        ));
    }
    validate_capabilities(&req.capabilities)?;
    let now = state.config.clock.now();
    // The binding, the generation and the sequence are checked inside the heartbeat's
    // transaction, so a heartbeat racing a delete, a renewal or a copy of itself cannot apply
    // twice or resurrect the old certificate.
    let outcome = state
        .heartbeats
        .record(HeartbeatRecord {
            agent_id: id,
            certificate_fingerprint: peer.fingerprint.to_string(),
            generation,
            sequence,
            session_expires_at: now + state.config.heartbeat_interval * 3,
            reported_status: req.status,
            resource_usage: req.resource_usage,
            capabilities: req.capabilities,
            at: now,
        })
        .await
        .map_err(|e| ApiError::internal(&e))?;
    match outcome {
        HeartbeatOutcome::Applied => {}
        HeartbeatOutcome::Fenced => {
            return Err(ApiError::conflict(
                codes::FENCED,
                "this process's generation is no longer current; another process took over",
            ))
        }
        HeartbeatOutcome::Replayed => {
            let detail = format!(
                "sequence {sequence} is not above the last heartbeat applied in generation {generation}"
            );
            refused(codes::HEARTBEAT_REPLAYED, detail.clone());
            return Err(ApiError::conflict(codes::HEARTBEAT_REPLAYED, detail));
        }
        HeartbeatOutcome::Revoked => return Err(binding_refused(&state, id, &peer).await),
    }
    // After the commit, outside the group's transaction: one capped read on the claim index.
    let tasks = state
        .store
        .queued_tasks(id, HEARTBEAT_TASKS_MAX)
        .await?
        .iter()
        .map(crate::http::routes::transport::listed_task)
        .collect();
    Ok(Json(HeartbeatResponse {
        acknowledged: true,
        status: req.status,
        heartbeat_interval_seconds: state.config.heartbeat_interval.as_secs().max(1),
        tasks,
    }))
}

/// Seed 000's legacy `complete` call (mTLS), whose body `{success, result, logs}` is unsigned:
/// always refused, and nothing is read or recorded. A result counts only signed, at the result
/// endpoint the refusal names.
#[utoipa::path(post, path = "/api/v1/agents/{id}/tasks/{taskId}/complete", tag = "agent-runtime",
    security(("agentCertificate" = [])),
    params(("id" = String, Path, format = Uuid), ("taskId" = String, Path, format = Uuid)),
    responses(
        (status = 422, body = ErrorBody, description = "SIGNED_RESULT_REQUIRED: send the signed result envelope to the endpoint the detail names"),
    ))]
pub async fn legacy_complete(
    State(state): State<SharedState>,
    caller: AgentCaller,
    ApiPath((_, task_id)): ApiPath<(AgentId, TaskId)>,
) -> ApiResult<StatusCode> {
    // Like every agent route: only the agent's own, currently bound certificate gets an answer.
    caller.bound(&state).await?;
    state.metrics.result_rejected("unsigned_legacy_complete");
    Err(ApiError::unprocessable(
        codes::SIGNED_RESULT_REQUIRED,
        format!(
            "unsigned results are not accepted: POST the signed agent-task-transport/v1 result \
             envelope to {}",
            berth_proto::transport::result_path(caller.id, task_id)
        ),
    ))
}

/// A short-lived ES256 JWT for the calling agent (mTLS).
#[utoipa::path(post, path = "/api/v1/agents/token", tag = "agent-runtime", request_body = IssueAgentJwt,
    security(("agentCertificate" = [])), responses((status = 200, body = AgentJwt)))]
pub async fn issue_jwt(
    State(state): State<SharedState>,
    caller: AgentCaller,
    ApiJson(_req): ApiJson<IssueAgentJwt>,
) -> ApiResult<Json<AgentJwt>> {
    let agent = caller.bound(&state).await?;
    let ttl: Duration = state.config.agent_jwt_ttl;
    let now = state.config.clock.now();
    let claims = json!({
        "iss": state.config.jwt_issuer,
        "aud": "berth-agent",
        "sub": format!("agent:{}", agent.id),
        "tenant_id": agent.tenant_id.to_string(),
        "env_id": agent.environment,
        "kind": "agent",
        "jti": uuid::Uuid::new_v4().to_string(),
        "iat": now.unix_timestamp(),
        "nbf": now.unix_timestamp(),
        "exp": now.unix_timestamp() + ttl.as_secs() as i64,
    });
    let token = state
        .jwt
        .sign(&claims)
        .map_err(|e| ApiError::internal(&e))?;
    Ok(Json(AgentJwt {
        token,
        expires_in: ttl.as_secs(),
        token_type: "Bearer".into(),
    }))
}

/// Renew the calling agent's certificate with a fresh CSR (mTLS). The old certificate stops
/// working as soon as the new binding is stored.
#[utoipa::path(post, path = "/api/v1/agents/{id}/certificate", tag = "agent-runtime", request_body = RenewCertificate,
    security(("agentCertificate" = [])),
    params(("id" = String, Path, format = Uuid), ("X-Berth-Generation" = i64, Header)),
    responses((status = 200, body = RenewCertificateResponse), (status = 400, body = ErrorBody, description = "INVALID_CSR"),
        (status = 409, body = ErrorBody, description = "FENCED: a process whose session generation is not current cannot rotate the binding")))]
pub async fn renew_certificate(
    State(state): State<SharedState>,
    FencedAgent {
        id,
        peer,
        generation,
    }: FencedAgent,
    ApiJson(req): ApiJson<RenewCertificate>,
) -> ApiResult<Json<RenewCertificateResponse>> {
    let now = state.config.clock.now();
    let validity = time::Duration::try_from(state.config.agent_cert_validity)
        .map_err(|e| ApiError::internal(&e))?;
    let issued = state
        .ca
        .sign_agent_csr(&req.csr, id.0, now, validity)
        .map_err(|e| {
            ApiError::bad_request(codes::INVALID_CSR, format!("the CSR was refused: {e}"))
        })?;
    match state
        .store
        .rebind_certificate(
            id,
            generation,
            &peer.fingerprint,
            &issued.fingerprint,
            issued.not_after,
            now,
        )
        .await?
    {
        RebindOutcome::Rebound => {}
        RebindOutcome::Fenced => {
            return Err(ApiError::conflict(
                codes::FENCED,
                "this process's generation is no longer current; it cannot renew the certificate",
            ))
        }
        RebindOutcome::Revoked => return Err(binding_refused(&state, id, &peer).await),
    }
    tracing::info!(agent_id = %id, expires_at = %issued.not_after, "agent certificate renewed");
    Ok(Json(RenewCertificateResponse {
        certificate: issued.cert_pem,
        ca_certificate: state.ca.cert_pem().to_string(),
        expires_at: issued.not_after,
    }))
}
