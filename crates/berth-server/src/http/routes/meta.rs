//! Liveness, readiness, metrics, the OpenAPI document and the agent JWKS.

use std::time::Duration;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::Json;
use berth_proto::agent::{Jwk, Jwks};
use berth_proto::error::ErrorChain;
use serde_json::json;

use crate::infra::error::{ApiError, ApiResult};
use crate::SharedState;

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "meta", responses((status = 200, description = "alive")))]
pub async fn healthz() -> impl IntoResponse {
    Json(json!({"status": "ok"}))
}

/// How long `/readyz` waits for the database before it answers not ready. Unbounded, the
/// check waited in the pool's acquire, where sqlx retries a refused connect until the acquire
/// timeout (`--database-acquire-timeout-secs`, 10 s): with PostgreSQL down, a prober (1 s by
/// default in Kubernetes) saw a timeout instead of the 503 and its reason, and each probe held
/// a request for 10 s. A database that cannot answer `SELECT 1` within this is not ready.
const DATABASE_CHECK_DEADLINE: Duration = Duration::from_secs(2);

/// Readiness: the database answers.
#[utoipa::path(get, path = "/readyz", tag = "meta", responses(
    (status = 200, description = "ready"),
    (status = 503, description = "a dependency is unavailable"),
))]
pub async fn readyz(State(state): State<SharedState>) -> impl IntoResponse {
    let database = match tokio::time::timeout(DATABASE_CHECK_DEADLINE, state.store.ping()).await {
        Ok(Ok(())) => "ok",
        Ok(Err(e)) => {
            tracing::warn!(error = %ErrorChain(&e), "readiness: database unavailable");
            "unavailable"
        }
        // Dropping the ping gives its pool acquire up: sqlx's acquire is cancel-safe.
        Err(_) => {
            tracing::warn!(deadline = ?DATABASE_CHECK_DEADLINE, "readiness: the database did not answer in time");
            "unavailable"
        }
    };
    // The seed's rule: with the transport off, the server is not ready to run tasks, and says so.
    let transport = if state.config.agent_transport_enabled {
        "ok"
    } else {
        "disabled"
    };
    let ready = database == "ok" && transport == "ok";
    (
        if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        },
        Json(json!({
            "status": if ready { "ready" } else { "unavailable" },
            "checks": {"database": database, "agentTaskTransport": transport},
        })),
    )
}

/// The metrics, in the format the scraper asks for: OpenMetrics when its `Accept` names
/// `application/openmetrics-text`, else the classic Prometheus text format (0.0.4).
#[utoipa::path(get, path = "/metrics", tag = "meta", responses((status = 200,
    description = "the classic Prometheus text format (0.0.4), or OpenMetrics 1.0 when asked for")))]
pub async fn metrics(State(state): State<SharedState>, headers: HeaderMap) -> impl IntoResponse {
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    if openmetrics {
        (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            state.metrics.encode(),
        )
    } else {
        (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            state.metrics.encode_classic(),
        )
    }
}

#[utoipa::path(get, path = "/api/v1/openapi.json", tag = "meta", responses((status = 200, description = "this document")))]
pub async fn openapi() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi_json(),
    )
}

/// The certificate of the key that signs berth's registry pull tokens (PEM): what a registry
/// berth is the token server of takes as its `auth.token.rootcertbundle`. The tokens name the
/// key by its libtrust key id, which the registry derives from this certificate.
#[utoipa::path(get, path = "/api/v1/registry-token/certificate", tag = "meta", responses(
    (status = 200, description = "the PEM certificate", content_type = "application/x-pem-file", body = String),
))]
pub async fn registry_token_certificate(State(state): State<SharedState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/x-pem-file")],
        state.registry_token_key.cert_pem().to_string(),
    )
}

/// The public keys that verify agent JWTs and deploy grants: the server's own agent-JWT key,
/// and the key of every deploy grant that is neither superseded, used nor expired (each grant
/// has a key of its own, `kid` = its `jti`). OpenBao's JWT mount fetches this, so a grant
/// stops verifying there once it is superseded or used and the mount refetches.
#[utoipa::path(get, path = "/.well-known/agent-jwks.json", tag = "meta", responses((status = 200, body = Jwks)))]
pub async fn jwks(State(state): State<SharedState>) -> ApiResult<impl IntoResponse> {
    agent_jwks(&state).await
}

/// [`jwks`] under `/api`.
#[utoipa::path(get, path = "/api/.well-known/agent-jwks.json", tag = "meta", responses((status = 200, body = Jwks)))]
pub async fn api_jwks(State(state): State<SharedState>) -> ApiResult<impl IntoResponse> {
    agent_jwks(&state).await
}

async fn agent_jwks(state: &SharedState) -> ApiResult<impl IntoResponse> {
    let k = state.jwt.public_jwk();
    let mut keys = vec![Jwk {
        kty: k.kty,
        crv: k.crv,
        x: k.x,
        y: k.y,
        kid: k.kid,
        use_: k.use_,
        alg: k.alg,
    }];
    let now = state.config.clock.now();
    for text in state.store.live_grant_jwks(None, now).await? {
        let jwk: Jwk = serde_json::from_str(&text).map_err(|e| ApiError::internal(&e))?;
        keys.push(jwk);
    }
    // A superseded grant must drop out at once: no cache may keep serving its key.
    Ok(([(header::CACHE_CONTROL, "no-store")], Json(Jwks { keys })))
}
