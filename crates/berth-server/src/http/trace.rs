//! What the listener applies to every request before routing it: the header budget and the
//! request's span, whose ids the extractors and handlers [`record`] as they learn them.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use berth_proto::error::codes;

use crate::infra::error::ApiError;

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
