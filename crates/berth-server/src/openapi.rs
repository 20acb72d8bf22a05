//! The OpenAPI document, generated from the handlers' annotations. A test compares it with the
//! committed `openapi/berth.json`, so the contract cannot drift silently.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::routes::{admin, agents, meta, tasks, transport};

#[derive(OpenApi)]
#[openapi(
    info(title = "berth", description = "berth control plane API"),
    paths(
        meta::healthz, meta::readyz, meta::metrics, meta::openapi, meta::jwks,
        admin::create_tenant, admin::create_api_token, admin::create_agent_token,
        agents::register, agents::list, agents::get, agents::update, agents::delete,
        agents::heartbeat, agents::issue_jwt, agents::renew_certificate,
        transport::acquire_session, transport::release_session, transport::poll, transport::submit_result,
        tasks::create, tasks::list, tasks::get, tasks::cancel, tasks::retry,
    ),
    modifiers(&BearerAuth),
)]
struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document as pretty JSON, with a fixed version so it only changes when the API does.
pub fn openapi_json() -> String {
    let mut doc = ApiDoc::openapi();
    doc.info.version = "v1".to_string();
    doc.to_pretty_json().unwrap_or_else(|_| "{}".to_string())
}
