//! The HTTP surface: one router, JSON errors everywhere (including unknown routes and methods).

use axum::extract::DefaultBodyLimit;
use axum::http::StatusCode;
use axum::Router;
use berth_proto::error::codes;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::infra::error::ApiError;
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
    OpenApiRouter::with_openapi(crate::http::openapi::document_base())
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
        .merge(crate::http::ui::router())
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
