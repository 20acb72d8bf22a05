//! `ApiError`: every refusal as `{code, detail}` with a stable code and the right status.
//!
//! Internal failures are logged here with their whole chain, once, and answered with a generic
//! detail so nothing internal (SQL, paths, secrets) reaches the client.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_proto::error::{codes, ErrorChain};
use berth_proto::ErrorBody;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub detail: String,
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, detail: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            detail: detail.into(),
            retry_after: None,
        }
    }

    pub fn bad_request(code: &'static str, detail: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, code, detail)
    }

    /// `422`: the request is well-formed but refused; `code` says why.
    pub fn unprocessable(code: &'static str, detail: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, code, detail)
    }

    pub fn not_found(what: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            codes::NOT_FOUND,
            format!("{what} not found"),
        )
    }

    pub fn forbidden(code: &'static str, detail: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, code, detail)
    }

    pub fn unauthenticated(code: &'static str, detail: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, code, detail)
    }

    pub fn conflict(code: &'static str, detail: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::CONFLICT, code, detail)
    }

    /// An unexpected failure: logged with its chain, answered without details.
    pub fn internal(error: &(dyn std::error::Error + 'static)) -> ApiError {
        tracing::error!(error = %ErrorChain(error), "request failed");
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            codes::INTERNAL,
            "internal error; see the server log",
        )
    }
}

impl From<berth_store::StoreError> for ApiError {
    fn from(e: berth_store::StoreError) -> ApiError {
        match e {
            // A uniqueness rule refused the write: the caller's request collided with a row,
            // which is theirs to resolve, not a server fault.
            berth_store::StoreError::Conflict { constraint } => ApiError::conflict(
                codes::CONSTRAINT_CONFLICT,
                format!("the request conflicts with an existing {constraint}"),
            ),
            // The database was too slow or too busy (a statement past its timeout, or no
            // pooled connection in time): the request may well succeed when sent again, so it
            // is a 503 the agents and the CLI retry (another replica, or after `Retry-After`),
            // not an internal error. Logged, since an operator should see the database strain.
            e @ berth_store::StoreError::Timeout { .. } => {
                tracing::warn!(error = %ErrorChain(&e), "request failed: database timeout");
                ApiError {
                    retry_after: Some(DATABASE_RETRY_AFTER_SECS),
                    ..ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        codes::UNAVAILABLE,
                        "the database did not answer in time; retry",
                    )
                }
            }
            e => ApiError::internal(&e),
        }
    }
}

/// `Retry-After` of a request the database timed out: a busy pool frees up in about that.
const DATABASE_RETRY_AFTER_SECS: u64 = 1;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (
            self.status,
            Json(ErrorBody {
                code: self.code.to_string(),
                detail: self.detail,
            }),
        )
            .into_response();
        if let Some(secs) = self.retry_after {
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                response.headers_mut().insert("retry-after", v);
            }
        }
        response
    }
}

pub type ApiResult<T> = Result<T, ApiError>;

/// Why the server could not start or serve: what it was doing, and the cause.
#[derive(Debug, thiserror::Error)]
#[error("{context}")]
pub struct ServerError {
    context: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl ServerError {
    pub(crate) fn new(context: impl Into<String>) -> ServerError {
        ServerError {
            context: context.into(),
            source: None,
        }
    }
}

/// `.context("what was being done")` on any fallible step of start-up.
pub(crate) trait Context<T> {
    fn context(self, context: &str) -> Result<T, ServerError>;
    fn with_context(self, context: impl FnOnce() -> String) -> Result<T, ServerError>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Context<T> for Result<T, E> {
    fn context(self, context: &str) -> Result<T, ServerError> {
        self.with_context(|| context.to_string())
    }
    fn with_context(self, context: impl FnOnce() -> String) -> Result<T, ServerError> {
        self.map_err(|e| ServerError {
            context: context(),
            source: Some(Box::new(e)),
        })
    }
}
