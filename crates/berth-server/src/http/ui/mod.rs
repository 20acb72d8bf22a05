//! The web UI, served at `/` on the API's listener: server-rendered HTML (maud), one script for
//! live updates (`assets/app.js`: an `EventSource` on `/api/v1/events` that re-renders the page's
//! `<main>` from the server) and one stylesheet, both compiled into the binary and served under
//! a content-hashed name.
//!
//! What stays true: every response carries [`CSP`] (no inline script or style anywhere, so the
//! templates use neither) and `nosniff`/`no-referrer`/`frame-ancestors 'none'`; every value is
//! interpolated through maud, which escapes it (nothing here uses `PreEscaped` on data); every
//! POST checks the session's CSRF token before anything else; and every page and action acts as
//! the session's API token through the API's own handlers, so the roles and tenant scoping are
//! the API's (`session.rs`). These routes are not part of the JSON API: they are merged into the
//! router outside `routes::declared`, so the OpenAPI document does not list them.

use axum::extract::Path;
use axum::http::{header, HeaderValue};
use axum::middleware::map_response;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::infra::error::ApiError;
use crate::SharedState;

mod actions;
pub(crate) mod layout;
mod pages;
pub mod session;

/// The Content-Security-Policy of every UI response.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; \
    base-uri 'none'";

pub(crate) fn router() -> Router<SharedState> {
    Router::new()
        .route("/", get(pages::overview))
        .route("/login", get(session::login_page).post(session::login))
        .route("/logout", post(session::logout))
        .route("/agents", get(pages::agents))
        .route("/agents/{id}", get(pages::agent))
        .route("/tasks", get(pages::tasks))
        .route("/tasks/{id}", get(pages::task))
        .route("/audit", get(pages::audit))
        .route("/audit/export", get(pages::audit_export))
        .route("/environments", get(pages::environments))
        .route("/environments/{name}", get(pages::environment))
        .route("/environments/{name}/plan", post(actions::plan))
        .route("/environments/{name}/deploy", post(actions::deploy))
        .route("/environments/{name}/rollback", post(actions::rollback))
        .route("/environments/{name}/verify", post(actions::verify))
        .route("/deployments/{id}", get(pages::deployment))
        .route("/deployments/{id}/approve", post(actions::approve))
        .route("/assets/{file}", get(serve_asset))
        .layer(map_response(security_headers))
}

/// The headers every UI response carries, whatever produced it.
async fn security_headers(mut response: Response) -> Response {
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers
        .entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    response
}

async fn serve_asset(Path(file): Path<String>) -> Response {
    for asset in [&*layout::SCRIPT_ASSET, &*layout::STYLE_ASSET] {
        if asset.path.strip_prefix("/assets/") == Some(file.as_str()) {
            return (
                [
                    (header::CONTENT_TYPE, asset.content_type),
                    (header::CACHE_CONTROL, "public, max-age=31536000, immutable"),
                ],
                asset.body,
            )
                .into_response();
        }
    }
    layout::error_page(&ApiError::not_found("asset"))
}
