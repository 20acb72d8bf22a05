//! Web UI sessions: an API token exchanged for a cookie, the CSRF token each form carries, and
//! the extractors that turn a request into the same [`Caller`] a bearer token makes, so every
//! page and action goes through the API's own authorization (`Caller::require_*`).
//!
//! The session id is 32 random bytes, sent only in a `__Host-` cookie (`HttpOnly; Secure;
//! SameSite=Strict; Path=/`); the store keeps its SHA-256 and the token it acts as (migration
//! 0017: a deleted token ends its sessions). The CSRF token is derived from the session id
//! (SHA-256 under its own label), so it needs no row, cannot be guessed without the cookie, and
//! does not reveal the id. Signing in carries a pre-session token of its own (double submit),
//! so another site cannot sign a browser in as someone else.

use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use berth_proto::error::codes;
use berth_store::NewUiSession;
use serde::Deserialize;
use time::Duration;

use crate::http::auth::Caller;
use crate::infra::error::ApiError;
use crate::SharedState;

pub const SESSION_COOKIE: &str = "__Host-berth_session";
pub const LOGIN_COOKIE: &str = "__Host-berth_login";
/// How long a session lives; signing in again makes a new one.
pub const SESSION_LIFETIME: Duration = Duration::hours(12);
/// The pre-session token's life: long enough to paste a token.
const LOGIN_LIFETIME_SECS: i64 = 15 * 60;

/// A signed-in browser: the session's token as a [`Caller`], and the CSRF token its forms carry.
pub struct UiCaller {
    pub caller: Caller,
    pub csrf: String,
    id_hash: String,
}

/// A UI request without a live session: pages send the browser to sign in (303), and actions
/// are refused (`401 SESSION_REQUIRED`) with the same page.
pub struct NoSession {
    get: bool,
}

impl IntoResponse for NoSession {
    fn into_response(self) -> Response {
        if self.get {
            Redirect::to("/login").into_response()
        } else {
            super::layout::error_page(&ApiError::unauthenticated(
                codes::SESSION_REQUIRED,
                "sign in again: the session has ended",
            ))
        }
    }
}

impl FromRequestParts<SharedState> for UiCaller {
    type Rejection = NoSession;

    async fn from_request_parts(parts: &mut Parts, state: &SharedState) -> Result<Self, NoSession> {
        let rejection = NoSession {
            get: parts.method == axum::http::Method::GET,
        };
        let Some(id) = cookie(&parts.headers, SESSION_COOKIE) else {
            return Err(rejection);
        };
        session_caller(state, &id).await.ok_or(rejection)
    }
}

/// The session `id` names, when it is live.
async fn session_caller(state: &SharedState, id: &str) -> Option<UiCaller> {
    let id_hash = berth_crypto::hash_token(id);
    match state
        .store
        .ui_session(&id_hash, state.config.clock.now())
        .await
    {
        Ok(Some(session)) => Some(UiCaller {
            caller: Caller(session.token),
            csrf: csrf_token(id),
            id_hash,
        }),
        Ok(None) => None,
        Err(e) => {
            tracing::error!(error = %berth_proto::error::ErrorChain(&e), "web UI session lookup failed");
            None
        }
    }
}

/// A caller of the API's reads a browser makes directly (the event stream, the audit export):
/// the API's bearer token, or else a UI session (an `EventSource` or a download link cannot send
/// an `Authorization` header). Only GET routes take it, so the cookie's `SameSite=Strict` is the
/// whole of its CSRF defence.
pub struct ReadCaller(pub Caller);

impl FromRequestParts<SharedState> for ReadCaller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &SharedState) -> Result<Self, ApiError> {
        if !parts.headers.contains_key(header::AUTHORIZATION) {
            if let Some(id) = cookie(&parts.headers, SESSION_COOKIE) {
                if let Some(ui) = session_caller(state, &id).await {
                    return Ok(ReadCaller(ui.caller));
                }
            }
        }
        Caller::from_request_parts(parts, state)
            .await
            .map(ReadCaller)
    }
}

impl UiCaller {
    /// Checks a form's CSRF token against the session's: `403 CSRF_INVALID` otherwise.
    pub fn check_csrf(&self, submitted: &str) -> Result<(), ApiError> {
        if constant_time_eq(submitted.as_bytes(), self.csrf.as_bytes()) {
            Ok(())
        } else {
            Err(ApiError::forbidden(
                codes::CSRF_INVALID,
                "the form's CSRF token is missing or not this session's; reload the page",
            ))
        }
    }
}

/// The CSRF token of session `id`: hex SHA-256 of a label and the id.
fn csrf_token(id: &str) -> String {
    berth_crypto::sha256_hex(format!("berth-ui-csrf\0{id}").as_bytes())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The value of cookie `name`, if the request carries it.
pub fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
        .filter(|v| !v.is_empty())
}

fn set_cookie(name: &str, value: &str, max_age: i64) -> HeaderValue {
    let text =
        format!("{name}={value}; HttpOnly; Secure; SameSite=Strict; Path=/; Max-Age={max_age}");
    // Invariant: the names are constants and the values base64url or empty.
    HeaderValue::from_str(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// `GET /login`: the sign-in form, with a fresh pre-session token in a cookie and the form.
pub async fn login_page() -> Response {
    let token = berth_crypto::random_token("");
    let mut response =
        super::layout::page_response(StatusCode::OK, super::layout::login(&token, None));
    response.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(LOGIN_COOKIE, &token, LOGIN_LIFETIME_SECS),
    );
    response
}

#[derive(Deserialize)]
pub struct LoginForm {
    #[serde(default)]
    token: String,
    #[serde(default)]
    csrf: String,
}

/// `POST /login`: a known API token makes a session (303 to the overview); anything else
/// shows the form again with one answer for every failure.
pub async fn login(
    State(state): State<SharedState>,
    headers: HeaderMap,
    Form(form): Form<LoginForm>,
) -> Response {
    let expected = cookie(&headers, LOGIN_COOKIE).unwrap_or_default();
    if expected.is_empty() || !constant_time_eq(expected.as_bytes(), form.csrf.as_bytes()) {
        return super::layout::error_page(&ApiError::forbidden(
            codes::CSRF_INVALID,
            "the sign-in form expired or came from another site; open it again",
        ));
    }
    let refused = |detail: &str| {
        super::layout::page_response(
            StatusCode::UNAUTHORIZED,
            super::layout::login(&expected, Some(detail)),
        )
    };
    let token = match state
        .store
        .api_token_by_hash(&berth_crypto::hash_token(form.token.trim()))
        .await
    {
        Ok(Some(token)) => token,
        Ok(None) => return refused("That token is not valid."),
        Err(e) => return super::layout::error_page(&ApiError::from(e)),
    };
    let id = berth_crypto::random_token("");
    let now = state.config.clock.now();
    let created = state
        .store
        .create_ui_session(NewUiSession {
            id_hash: berth_crypto::hash_token(&id),
            token_id: token.id,
            created_at: now,
            expires_at: now + SESSION_LIFETIME,
        })
        .await;
    if let Err(e) = created {
        return super::layout::error_page(&ApiError::from(e));
    }
    tracing::info!(token_id = %token.id.0, "web UI session started");
    let mut response = Redirect::to("/").into_response();
    let headers = response.headers_mut();
    headers.append(
        header::SET_COOKIE,
        set_cookie(SESSION_COOKIE, &id, SESSION_LIFETIME.whole_seconds()),
    );
    headers.append(header::SET_COOKIE, set_cookie(LOGIN_COOKIE, "", 0));
    response
}

#[derive(Deserialize)]
pub struct CsrfForm {
    #[serde(default)]
    pub csrf: String,
}

/// `POST /logout`: deletes the session and its cookie.
pub async fn logout(
    State(state): State<SharedState>,
    ui: UiCaller,
    Form(form): Form<CsrfForm>,
) -> Response {
    if let Err(e) = ui.check_csrf(&form.csrf) {
        return super::layout::error_page(&e);
    }
    if let Err(e) = state.store.delete_ui_session(&ui.id_hash).await {
        return super::layout::error_page(&ApiError::from(e));
    }
    let mut response = Redirect::to("/login").into_response();
    response
        .headers_mut()
        .append(header::SET_COOKIE, set_cookie(SESSION_COOKIE, "", 0));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_found_by_exact_name() {
        let mut headers = HeaderMap::new();
        headers.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; __Host-berth_session=abc; b="),
        );
        assert_eq!(cookie(&headers, SESSION_COOKIE).as_deref(), Some("abc"));
        assert_eq!(cookie(&headers, "b"), None);
        assert_eq!(cookie(&headers, "berth_session"), None);
    }

    #[test]
    fn csrf_token_is_per_session_and_hides_the_id() {
        let (a, b) = (csrf_token("one"), csrf_token("two"));
        assert_ne!(a, b);
        assert!(!a.contains("one"));
        assert!(constant_time_eq(a.as_bytes(), csrf_token("one").as_bytes()));
        assert!(!constant_time_eq(a.as_bytes(), b.as_bytes()));
        assert!(!constant_time_eq(b"", a.as_bytes()));
    }
}
