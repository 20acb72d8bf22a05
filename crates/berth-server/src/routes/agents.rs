//! Agents: registration with a one-time token and a CSR, management by admins, and the
//! mTLS-only calls an agent makes about itself (heartbeat, JWT, certificate renewal).

use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use berth_proto::agent::{
    Agent, AgentJwt, AgentList, AgentStatus, Capability, Deleted, Heartbeat, HeartbeatResponse,
    IssueAgentJwt, ListAgents, RegisterAgent, RegisterAgentResponse, RenewCertificate,
    RenewCertificateResponse, UpdateAgent,
};
use berth_proto::error::codes;
use berth_proto::{AgentId, ErrorBody};
use berth_store::{
    AgentFilter, AgentUpdate, HeartbeatOutcome, HeartbeatRecord, NewAgent, RebindOutcome,
    RegisterError,
};
use serde_json::json;

use crate::auth::{binding_refused, AgentCaller, Caller, FencedAgent};
use crate::error::{ApiError, ApiResult};
use crate::extract::{ApiJson, ApiPath, ApiQuery};
use crate::routes::admin::{validate_labels, validate_name};
use crate::routes::audit::actor;
use crate::SharedState;

use berth_proto::headers::REGISTRATION_TOKEN_HEADER;
const DEFAULT_PAGE: u32 = 100;
const MAX_PAGE: u32 = 1000;

fn to_wire(a: berth_store::Agent) -> Agent {
    Agent {
        id: a.id,
        name: a.name,
        version: a.version,
        capabilities: a.capabilities,
        labels: a.labels,
        status: a.status,
        environment: a.environment,
        last_heartbeat: a.last_heartbeat,
        resource_usage: a.resource_usage,
        certificate_fingerprint: a.certificate_fingerprint,
        certificate_expires_at: a.certificate_expires_at,
        created_at: a.created_at,
        updated_at: a.updated_at,
    }
}

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
    if req.version.is_empty() || req.version.len() > 50 {
        return Err(ApiError::unprocessable(
            codes::INVALID_REQUEST,
            "version must be 1-50 characters",
        ));
    }
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
    caller.can_read()?;
    let label = match &query.label {
        None => None,
        Some(l) => match l.split_once('=') {
            Some((k, v)) if !k.is_empty() => Some((k.to_string(), v.to_string())),
            _ => {
                return Err(ApiError::bad_request(
                    codes::INVALID_REQUEST,
                    "label must be key=value",
                ))
            }
        },
    };
    let after: Option<AgentId> = crate::extract::cursor(query.cursor.as_deref())?;
    let limit = query.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE);
    let filter = AgentFilter {
        status: query.status,
        capability: query.capability.clone(),
        label,
    };
    let page = state
        .store
        .list_agents(caller.tenant(), &filter, after, limit)
        .await?;
    Ok(Json(AgentList {
        items: page.items.into_iter().map(to_wire).collect(),
        next_cursor: page.next.map(|id| id.to_string()),
    }))
}

#[utoipa::path(get, path = "/api/v1/agents/{id}", tag = "agents", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = Agent), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<AgentId>,
) -> ApiResult<Json<Agent>> {
    caller.can_read()?;
    match state.store.get_agent(caller.tenant(), id).await? {
        Some(a) => Ok(Json(to_wire(a))),
        None => Err(ApiError::not_found("agent")),
    }
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
        Some(a) => Ok(Json(to_wire(a))),
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

/// Heartbeat (mTLS): status, resource usage and capabilities. Committed in a group with
/// concurrent heartbeats; applied only while the certificate is the agent's binding.
#[utoipa::path(post, path = "/api/v1/agents/{id}/heartbeat", tag = "agent-runtime", request_body = Heartbeat,
    security(("agentCertificate" = [])),
    params(("id" = String, Path, format = Uuid), ("X-Berth-Generation" = i64, Header)),
    responses((status = 200, body = HeartbeatResponse)))]
pub async fn heartbeat(
    State(state): State<SharedState>,
    FencedAgent {
        id,
        peer,
        generation,
    }: FencedAgent,
    ApiJson(req): ApiJson<Heartbeat>,
) -> ApiResult<Json<HeartbeatResponse>> {
    if matches!(req.status, AgentStatus::Offline | AgentStatus::Registered) {
        return Err(ApiError::unprocessable(
            codes::INVALID_REQUEST,
            "an agent reports itself online or degraded",
        ));
    }
    validate_capabilities(&req.capabilities)?;
    let now = state.config.clock.now();
    // The binding is checked inside the heartbeat transaction, so a heartbeat racing a delete
    // or a renewal cannot resurrect the old certificate.
    let outcome = state
        .heartbeats
        .record(HeartbeatRecord {
            agent_id: id,
            certificate_fingerprint: peer.fingerprint.to_string(),
            generation,
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
        HeartbeatOutcome::Revoked => return Err(binding_refused(&state, id, &peer).await),
    }
    Ok(Json(HeartbeatResponse {
        acknowledged: true,
        status: req.status,
        heartbeat_interval_seconds: state.config.heartbeat_interval.as_secs().max(1),
    }))
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
