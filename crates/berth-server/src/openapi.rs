//! The OpenAPI document, generated from the handlers' annotations through the router that serves
//! them (`routes::declared`). A test compares it with the committed `openapi/berth.json`, so the
//! contract cannot drift silently.

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(title = "berth", description = "berth control plane API"),
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

/// The document's title and security schemes; the routes add the paths and schemas.
pub(crate) fn document_base() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The document as pretty JSON, with a fixed version so it only changes when the API does.
pub fn openapi_json() -> String {
    let mut doc = crate::routes::declared().into_openapi();
    doc.info.version = "v1".to_string();
    doc.to_pretty_json().unwrap_or_else(|_| "{}".to_string())
}
