//! The HTTP surface: one router, JSON errors everywhere (including unknown routes and methods).

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use berth_proto::error::codes;

use crate::error::ApiError;
use crate::SharedState;

pub mod admin;
pub mod agents;
pub mod meta;
pub mod tasks;
pub mod transport;

pub fn router(state: SharedState) -> Router {
    let body_limit = state.config.body_limit;
    Router::new()
        .route("/healthz", get(meta::healthz))
        .route("/readyz", get(meta::readyz))
        .route("/metrics", get(meta::metrics))
        .route("/api/v1/openapi.json", get(meta::openapi))
        .route("/.well-known/agent-jwks.json", get(meta::jwks))
        .route("/api/v1/admin/tenants", post(admin::create_tenant))
        .route("/api/v1/admin/api-tokens", post(admin::create_api_token))
        .route(
            "/api/v1/admin/agent-tokens",
            post(admin::create_agent_token),
        )
        .route("/api/v1/agents/register", post(agents::register))
        .route("/api/v1/agents/token", post(agents::issue_jwt))
        .route("/api/v1/agents", get(agents::list))
        .route(
            "/api/v1/agents/{id}",
            get(agents::get).put(agents::update).delete(agents::delete),
        )
        .route("/api/v1/agents/{id}/heartbeat", post(agents::heartbeat))
        .route(
            "/api/v1/agents/{id}/certificate",
            post(agents::renew_certificate),
        )
        .route(
            "/api/v1/agents/{id}/session",
            post(transport::acquire_session).delete(transport::release_session),
        )
        .route(
            "/api/v1/release-orchestrator/agent-runtime/agents/{id}/tasks:poll",
            post(transport::poll),
        )
        .route(
            "/api/v1/release-orchestrator/agent-runtime/agents/{id}/tasks/{task_id}/result",
            post(transport::submit_result),
        )
        .route("/api/v1/tasks", post(tasks::create).get(tasks::list))
        .route("/api/v1/tasks/{id}", get(tasks::get))
        .route("/api/v1/tasks/{id}/cancel", post(tasks::cancel))
        .route("/api/v1/tasks/{id}/retry", post(tasks::retry))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::new(StatusCode::NOT_FOUND, codes::NOT_FOUND, "no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        codes::METHOD_NOT_ALLOWED,
        "method not allowed on this route",
    )
}
