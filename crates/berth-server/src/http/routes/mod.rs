//! The HTTP surface: one router, JSON errors everywhere (including unknown routes and methods).

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Router;
use berth_proto::error::codes;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::error::ApiError;
use crate::SharedState;

pub mod admin;
pub mod agents;
pub mod audit;
pub mod deployments;
pub mod desired;
pub mod events;
pub mod install;
pub mod meta;
pub mod notify;
pub mod readiness;
pub mod releases;
pub mod secrets;
pub mod ssh_targets;
pub mod stream;
pub mod tasks;
pub mod transport;

/// Every route, declared once: each handler's `#[utoipa::path]` gives both its axum route and
/// its operation in the OpenAPI document, so the two cannot disagree. One `routes!` per path.
pub(crate) fn declared() -> OpenApiRouter<SharedState> {
    OpenApiRouter::with_openapi(crate::openapi::document_base())
        .routes(routes!(meta::healthz))
        .routes(routes!(meta::readyz))
        .routes(routes!(meta::metrics))
        .routes(routes!(meta::openapi))
        .routes(routes!(meta::jwks))
        .routes(routes!(meta::api_jwks))
        .routes(routes!(meta::registry_token_certificate))
        .routes(routes!(install::ca_certificate))
        .routes(routes!(install::script))
        .routes(routes!(install::agent_binary))
        .routes(routes!(admin::create_tenant))
        .routes(routes!(admin::create_api_token))
        .routes(routes!(admin::create_agent_token))
        .routes(routes!(agents::register))
        .routes(routes!(agents::issue_jwt))
        .routes(routes!(agents::list))
        .routes(routes!(agents::get, agents::update, agents::delete))
        .routes(routes!(agents::cordon))
        .routes(routes!(agents::uncordon))
        .routes(routes!(agents::suspend))
        .routes(routes!(agents::resume))
        .routes(routes!(agents::heartbeat))
        .routes(routes!(agents::legacy_complete))
        .routes(routes!(agents::renew_certificate))
        .routes(routes!(
            transport::acquire_session,
            transport::release_session
        ))
        .routes(routes!(transport::poll))
        .routes(routes!(stream::task_stream))
        .routes(routes!(transport::start_task))
        .routes(routes!(transport::submit_result))
        .routes(routes!(tasks::create, tasks::list))
        .routes(routes!(tasks::get))
        .routes(routes!(tasks::cancel))
        .routes(routes!(tasks::retry))
        .routes(routes!(releases::create, releases::list))
        .routes(routes!(releases::get))
        .routes(routes!(
            deployments::create_environment,
            deployments::list_environments
        ))
        .routes(routes!(deployments::get_environment))
        .routes(routes!(deployments::environment_status))
        .routes(routes!(deployments::unpin_environment))
        .routes(routes!(readiness::get_readiness))
        .routes(routes!(readiness::verify))
        .routes(routes!(deployments::rollback_environment))
        .routes(routes!(deployments::create, deployments::list))
        .routes(routes!(deployments::plan))
        .routes(routes!(deployments::get))
        .routes(routes!(deployments::approve))
        .routes(routes!(deployments::cancel))
        .routes(routes!(desired::agent_checkin))
        .routes(routes!(desired::api_agent_checkin))
        .routes(routes!(desired::agent_bundle))
        .routes(routes!(desired::api_agent_bundle))
        .routes(routes!(desired::agent_report))
        .routes(routes!(desired::api_agent_report))
        .routes(routes!(desired::push_bundle, desired::list_bundles))
        .routes(routes!(desired::set_desired, desired::desired_state))
        .routes(routes!(desired::retire))
        .routes(routes!(secrets::list_secrets))
        .routes(routes!(
            secrets::put_secret,
            secrets::secret_versions,
            secrets::delete_secret
        ))
        .routes(routes!(secrets::kit))
        .routes(routes!(secrets::agent_lease))
        .routes(routes!(secrets::api_agent_lease))
        .routes(routes!(secrets::agent_kv))
        .routes(routes!(secrets::api_agent_kv))
        .routes(routes!(ssh_targets::create, ssh_targets::list))
        .routes(routes!(ssh_targets::get, ssh_targets::delete))
        .routes(routes!(
            ssh_targets::push_artifact,
            ssh_targets::list_artifacts
        ))
        .routes(routes!(ssh_targets::agent_artifact))
        .routes(routes!(notify::create_webhook, notify::list_webhooks))
        .routes(routes!(notify::delete_webhook))
        .routes(routes!(notify::list_notifications))
        .routes(routes!(notify::resend))
        .routes(routes!(audit::list))
        .routes(routes!(events::stream))
}

pub fn router(state: SharedState) -> Router {
    let body_limit = state.config.body_limit;
    let (router, _) = declared().split_for_parts();
    router
        .merge(crate::ui::router())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(body_limit))
        .with_state(state)
}

/// The request headers the server reads: bytes, counted as HTTP/2 counts a header list (name,
/// value and 32 per field), and fields.
pub const MAX_HEADER_BYTES: usize = 32 * 1024;
pub const MAX_HEADERS: usize = 100;

/// `431 HEADERS_TOO_LARGE` with `{code, detail}`, over HTTP/1.1 and HTTP/2 alike, for a request
/// whose headers pass hyper's own, larger limits (see `tls.rs`, which asks this for every
/// request before routing it).
pub(crate) fn headers_too_large(headers: &axum::http::HeaderMap) -> Option<Response> {
    let bytes: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 32)
        .sum();
    (bytes > MAX_HEADER_BYTES || headers.len() > MAX_HEADERS).then(|| {
        ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            codes::HEADERS_TOO_LARGE,
            format!(
                "request headers are {bytes} bytes in {} fields; the server reads at most \
                 {MAX_HEADER_BYTES} bytes in {MAX_HEADERS} fields",
                headers.len()
            ),
        )
        .into_response()
    })
}

/// The span of one request (`tls.rs` opens it around each request). Its agent, task, assignment
/// and generation fields start empty; the extractors and handlers record them as they learn
/// them ([`record`]). It is a debug span: at `info` the lines about a delivery (assigned, result
/// recorded or refused) name those ids themselves, and the server does not pay for a span on
/// every request (an info span was part of a 7 % cost in end-to-end tasks/s, BENCHMARKS.md).
pub(crate) fn request_span(request: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    tracing::debug_span!(
        "request",
        method = %request.method(),
        path = request.uri().path(),
        agent_id = tracing::field::Empty,
        generation = tracing::field::Empty,
        task_id = tracing::field::Empty,
        assignment_id = tracing::field::Empty,
    )
}

/// Records one of the request span's ids (`agent_id`, `generation`, `task_id`, `assignment_id`).
pub(crate) fn record(field: &'static str, value: impl std::fmt::Display) {
    tracing::Span::current().record(field, tracing::field::display(value));
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
