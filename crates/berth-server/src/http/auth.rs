//! Who is calling: an API token (admins, CI) or an agent proven by its client certificate.
//!
//! Bearer tokens are looked up by hash and scope every query to their tenant. Agent calls are
//! accepted only when the connection's certificate is the one currently bound to the agent the
//! request names; deleting an agent or rotating its certificate therefore revokes it at once.

use axum::extract::{FromRequestParts, RawPathParams};
use axum::http::request::Parts;
use berth_proto::error::codes;
use berth_proto::AgentId;
use berth_store::Agent;

use crate::http::tls::{Peer, PeerCertificate};
use crate::infra::error::{ApiError, ApiResult};
pub use crate::services::caller::{Caller, DesiredCaller};
use crate::SharedState;

impl FromRequestParts<SharedState> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &SharedState) -> ApiResult<Caller> {
        let header = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| {
                ApiError::unauthenticated(
                    codes::UNAUTHENTICATED,
                    "missing Authorization: Bearer token",
                )
            })?;
        let token = header
            .strip_prefix("Bearer ")
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| {
                ApiError::unauthenticated(
                    codes::UNAUTHENTICATED,
                    "Authorization must be a Bearer token",
                )
            })?;
        match state
            .store
            .api_token_by_hash(&berth_crypto::hash_token(token))
            .await?
        {
            Some(t) => Ok(Caller(t)),
            None => Err(ApiError::unauthenticated(
                codes::UNAUTHENTICATED,
                "unknown API token",
            )),
        }
    }
}

/// An agent-runtime caller: the connection's client certificate, which names the agent the path
/// names (`{id}` or `{agentId}`; routes without one act for the certificate's agent). A certificate naming
/// another agent is `403 CERT_BINDING_MISMATCH`, decided before any lookup so it tells nothing
/// about whether `id` exists. Whether the certificate is still the agent's *binding* is decided
/// afterwards: by [`AgentCaller::bound`], or by the store inside the write's own transaction.
pub struct AgentCaller {
    pub id: AgentId,
    pub peer: PeerCertificate,
}

/// An [`AgentCaller`] on a mutating call, with its session generation (`X-Berth-Generation`;
/// missing or malformed is fenced, like a stale one). The store compares it in the write's
/// transaction.
pub struct FencedAgent {
    pub id: AgentId,
    pub peer: PeerCertificate,
    pub generation: i64,
}

impl FromRequestParts<SharedState> for AgentCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &SharedState) -> ApiResult<AgentCaller> {
        let peer = parts
            .extensions
            .get::<Peer>()
            .and_then(|p| p.0.clone())
            .ok_or_else(|| {
                ApiError::unauthenticated(
                    codes::CLIENT_CERT_REQUIRED,
                    "agent routes require the agent's client certificate",
                )
            })?;
        // The handshake checked the certificate's validity once; the connection may outlive it.
        if state.config.clock.now() > peer.not_after {
            state.metrics.agent_auth_refused("expired");
            return Err(ApiError::unauthenticated(
                codes::CLIENT_CERT_EXPIRED,
                "the client certificate has expired; connect again with a current one",
            ));
        }
        let path_id = match RawPathParams::from_request_parts(parts, state).await {
            Ok(params) => params
                .iter()
                .find(|(name, _)| matches!(*name, "id" | "agentId"))
                .map(|(_, value)| {
                    value.parse::<AgentId>().map_err(|_| {
                        ApiError::bad_request(codes::INVALID_ID, "the agent id is not a UUID")
                    })
                })
                .transpose()?,
            Err(_) => None,
        };
        let id = match (path_id, peer.agent_id) {
            (Some(id), Some(named)) if id == named => id,
            (None, Some(named)) => named,
            (None, None) => return Err(agent_revoked(state)),
            (Some(_), _) => {
                state.metrics.agent_auth_refused("binding_mismatch");
                return Err(ApiError::forbidden(
                    codes::CERT_BINDING_MISMATCH,
                    "the client certificate does not belong to this agent",
                ));
            }
        };
        crate::http::trace::record("agent_id", id);
        Ok(AgentCaller { id, peer })
    }
}

impl FromRequestParts<SharedState> for FencedAgent {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &SharedState) -> ApiResult<FencedAgent> {
        let AgentCaller { id, peer } = AgentCaller::from_request_parts(parts, state).await?;
        let generation = parts
            .headers
            .get(berth_proto::headers::GENERATION_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<i64>().ok())
            .ok_or_else(|| {
                ApiError::conflict(codes::FENCED, "missing or malformed X-Berth-Generation")
            })?;
        crate::http::trace::record("generation", generation);
        Ok(FencedAgent {
            id,
            peer,
            generation,
        })
    }
}

impl AgentCaller {
    /// The agent, when the certificate is still its current binding; else the refusal of
    /// [`binding_refused`].
    pub async fn bound(&self, state: &SharedState) -> ApiResult<Agent> {
        match state.store.get_agent_for_runtime(self.id).await? {
            Some(agent)
                if agent.certificate_fingerprint.as_deref() == Some(&*self.peer.fingerprint) =>
            {
                Ok(agent)
            }
            other => Err(name_refusal(state, other.as_ref(), &self.peer)),
        }
    }
}

/// The answer to a certificate the store refused for agent `id` (it is not the binding): `401
/// CERTIFICATE_SUPERSEDED` when it is the one the agent's last renewal replaced, so the agent
/// sends the request again with its new certificate (a poll or a result in flight across the
/// renewal), else `401 AGENT_REVOKED`. The refusal was decided before, in the store's own
/// transaction; this only names it, from a second read.
pub async fn binding_refused(state: &SharedState, id: AgentId, peer: &PeerCertificate) -> ApiError {
    match state.store.get_agent_for_runtime(id).await {
        Ok(agent) => name_refusal(state, agent.as_ref(), peer),
        Err(e) => e.into(),
    }
}

fn name_refusal(state: &SharedState, agent: Option<&Agent>, peer: &PeerCertificate) -> ApiError {
    match agent {
        Some(agent)
            if agent.previous_certificate_fingerprint.as_deref() == Some(&*peer.fingerprint) =>
        {
            state.metrics.agent_auth_refused("superseded");
            ApiError::unauthenticated(
                codes::CERTIFICATE_SUPERSEDED,
                "this certificate was replaced by the agent's renewal; send again with the new one",
            )
        }
        _ => agent_revoked(state),
    }
}

/// `401 AGENT_REVOKED`: the agent was deleted or its certificate replaced; register again.
fn agent_revoked(state: &SharedState) -> ApiError {
    state.metrics.agent_auth_refused("revoked");
    ApiError::unauthenticated(
        codes::AGENT_REVOKED,
        "this certificate is no longer bound to an agent; register again",
    )
}

fn agent_unauthenticated(detail: impl Into<String>) -> ApiError {
    ApiError::unauthenticated(codes::AGENT_UNAUTHENTICATED, detail)
}

/// The bearer of a seed-compatible agent: its OpenBao token, and the grant it came from.
async fn token_caller(state: &SharedState, bearer: &str) -> ApiResult<DesiredCaller> {
    let Some(verifier) = &state.bao else {
        return Err(agent_unauthenticated(
            "this server verifies no OpenBao tokens (no OpenBao is configured)",
        ));
    };
    let meta = match verifier.verify(bearer).await {
        Ok(meta) => meta,
        Err(crate::infra::openbao::VerifyError::Unknown(why)) => {
            return Err(agent_unauthenticated(format!(
                "OpenBao does not know this token: {why}"
            )))
        }
        Err(crate::infra::openbao::VerifyError::Unavailable(why)) => {
            return Err(ApiError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                codes::PROVIDER_UNAVAILABLE,
                format!("cannot verify the token with OpenBao: {why}"),
            ))
        }
    };
    let grant = state
        .store
        .grant(&meta.grant_jti)
        .await?
        .ok_or_else(|| agent_unauthenticated("the token's grant is unknown to berth"))?;
    if grant.superseded_at.is_some() {
        return Err(agent_unauthenticated(
            "the token's grant was superseded (a newer kit was revealed): re-run the install kit",
        ));
    }
    let now = state.config.clock.now();
    match state
        .store
        .mark_grant_used(&meta.grant_jti, &meta.accessor, now)
        .await?
    {
        berth_store::GrantUse::Again => {}
        berth_store::GrantUse::First => {
            // A used grant leaves the JWKS; OpenBao forgets the key only when its keyset is
            // reset, so a replay of the grant fails at login from now on.
            crate::infra::grants::reset_keyset(state);
        }
        berth_store::GrantUse::Replay => {
            return Err(agent_unauthenticated(
                "the token's grant was already used by another token (a replayed grant)",
            ))
        }
        berth_store::GrantUse::Unknown => {
            return Err(agent_unauthenticated(
                "the token's grant is unknown to berth",
            ))
        }
    }
    Ok(DesiredCaller::Token {
        tenant_id: grant.tenant_id,
        environment_id: grant.environment_id,
        env_id: meta.env_id,
        grant_jti: meta.grant_jti,
    })
}

impl FromRequestParts<SharedState> for DesiredCaller {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &SharedState,
    ) -> ApiResult<DesiredCaller> {
        let peer = parts.extensions.get::<Peer>().and_then(|p| p.0.clone());
        let bearer = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        let peer =
            match (peer, bearer) {
                (Some(peer), _) => peer,
                (None, Some(bearer)) => return token_caller(state, bearer.trim()).await,
                (None, None) => return Err(agent_unauthenticated(
                    "desired-state calls need the agent's client certificate or an OpenBao token",
                )),
            };
        if state.config.clock.now() > peer.not_after {
            state.metrics.agent_auth_refused("expired");
            return Err(ApiError::unauthenticated(
                codes::CLIENT_CERT_EXPIRED,
                "the client certificate has expired; connect again with a current one",
            ));
        }
        let agent = match peer.agent_id {
            Some(id) => state.store.get_agent_for_runtime(id).await?,
            None => None,
        };
        match agent {
            Some(agent) if agent.certificate_fingerprint.as_deref() == Some(&*peer.fingerprint) => {
                crate::http::trace::record("agent_id", agent.id);
                Ok(DesiredCaller::Agent(Box::new(agent)))
            }
            Some(agent)
                if agent.previous_certificate_fingerprint.as_deref()
                    == Some(&*peer.fingerprint) =>
            {
                Err(name_refusal(state, Some(&agent), &peer))
            }
            _ => {
                state.metrics.agent_auth_refused("revoked");
                Err(ApiError::unauthenticated(
                    codes::AGENT_UNAUTHENTICATED,
                    "this certificate is not bound to an agent (removed or replaced)",
                ))
            }
        }
    }
}
