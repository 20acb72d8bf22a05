//! Gates every transport call passes: the transport switch, and the `FENCED` refusal.

use axum::http::StatusCode;
use berth_proto::error::codes;

use crate::infra::error::{ApiError, ApiResult};
use crate::SharedState;

pub fn fenced(detail: &str) -> ApiError {
    ApiError::conflict(codes::FENCED, detail)
}

pub fn transport_enabled(state: &SharedState) -> ApiResult<()> {
    if state.config.agent_transport_enabled {
        Ok(())
    } else {
        state.metrics.result_rejected("transport_disabled");
        Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::TRANSPORT_DISABLED,
            "the agent task transport is disabled on this server",
        ))
    }
}
