//! Extractors that turn every malformed input into a 4xx `{code, detail}` instead of axum's
//! plain-text rejections: JSON bodies, path ids and query strings.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use berth_proto::error::codes;
use serde::de::DeserializeOwned;

use crate::infra::error::ApiError;

/// A JSON body; refusals carry stable codes.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(ApiJson(v)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

/// A JSON body whose numbers all arrive exactly (`berth_proto::json::check_numbers`): one that
/// would not is `422 INVALID_PAYLOAD` naming its JSON pointer, instead of reaching the agent as
/// a different number. The text is read once, checked, then parsed as [`ApiJson`] would.
pub struct LosslessJson(pub serde_json::Value);

impl<S: Send + Sync> FromRequest<S> for LosslessJson {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let is_json = req
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .map(|m| {
                let m = m.trim().to_ascii_lowercase();
                m == "application/json" || (m.starts_with("application/") && m.ends_with("+json"))
            })
            .unwrap_or(false);
        if !is_json {
            return Err(json_rejection(JsonRejection::MissingJsonContentType(
                Default::default(),
            )));
        }
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(|e| json_rejection(JsonRejection::BytesRejection(e)))?;
        let axum::Json(value) =
            axum::Json::<serde_json::Value>::from_bytes(&bytes).map_err(json_rejection)?;
        let text = std::str::from_utf8(&bytes).unwrap_or_default();
        berth_proto::json::check_numbers(text)
            .map_err(|detail| ApiError::unprocessable(codes::INVALID_PAYLOAD, detail))?;
        Ok(LosslessJson(value))
    }
}

fn json_rejection(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::JsonDataError(e) => {
            ApiError::unprocessable(codes::INVALID_REQUEST, e.body_text())
        }
        JsonRejection::JsonSyntaxError(e) => {
            ApiError::bad_request(codes::MALFORMED_JSON, e.body_text())
        }
        JsonRejection::MissingJsonContentType(_) => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            codes::UNSUPPORTED_MEDIA_TYPE,
            "expected Content-Type: application/json",
        ),
        JsonRejection::BytesRejection(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                codes::PAYLOAD_TOO_LARGE,
                "request body is larger than the server accepts",
            )
        }
        other => ApiError::bad_request(codes::INVALID_REQUEST, other.body_text()),
    }
}

/// Path parameters (ids); a bad UUID is `400 INVALID_ID`.
pub struct ApiPath<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(ApiPath(v)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                Err(ApiError::bad_request(codes::INVALID_ID, e.body_text()))
            }
            Err(other) => Err(ApiError::bad_request(
                codes::INVALID_REQUEST,
                other.body_text(),
            )),
        }
    }
}

/// A query string; unknown or malformed parameters are `400 INVALID_REQUEST`.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(ApiQuery(v)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => {
                Err(ApiError::bad_request(codes::INVALID_REQUEST, e.body_text()))
            }
            Err(other) => Err(ApiError::bad_request(
                codes::INVALID_REQUEST,
                other.body_text(),
            )),
        }
    }
}
