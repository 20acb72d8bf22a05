//! The error body every refusal carries, and the stable codes.

use serde::{Deserialize, Serialize};

/// `{code, detail}`: `code` is a stable UPPER_SNAKE identifier for each distinct refusal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub code: String,
    pub detail: String,
}

/// Stable error codes. Clients match on these, so they never change meaning.
pub mod codes {
    pub const MALFORMED_JSON: &str = "MALFORMED_JSON";
    pub const INVALID_REQUEST: &str = "INVALID_REQUEST";
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "UNSUPPORTED_MEDIA_TYPE";
    pub const PAYLOAD_TOO_LARGE: &str = "PAYLOAD_TOO_LARGE";
    pub const INVALID_ID: &str = "INVALID_ID";
    pub const NOT_FOUND: &str = "NOT_FOUND";
    pub const METHOD_NOT_ALLOWED: &str = "METHOD_NOT_ALLOWED";
    pub const CONFLICT: &str = "CONFLICT";
    pub const UNAUTHENTICATED: &str = "UNAUTHENTICATED";
    pub const FORBIDDEN: &str = "FORBIDDEN";
    pub const OPERATOR_ONLY: &str = "OPERATOR_ONLY";
    pub const REGISTRATION_TOKEN_INVALID: &str = "REGISTRATION_TOKEN_INVALID";
    pub const INVALID_CSR: &str = "INVALID_CSR";
    pub const AGENT_NAME_TAKEN: &str = "AGENT_NAME_TAKEN";
    pub const TENANT_NAME_TAKEN: &str = "TENANT_NAME_TAKEN";
    /// An agent-runtime route was called without a client certificate.
    pub const CLIENT_CERT_REQUIRED: &str = "CLIENT_CERT_REQUIRED";
    /// The client certificate is not the one bound to the agent named in the path.
    pub const CERT_BINDING_MISMATCH: &str = "CERT_BINDING_MISMATCH";
    /// The agent was deleted or its certificate rotated: re-register.
    pub const AGENT_REVOKED: &str = "AGENT_REVOKED";
    pub const RATE_LIMITED: &str = "RATE_LIMITED";
    pub const INTERNAL: &str = "INTERNAL";
    // --- task transport ---
    pub const SESSION_HELD: &str = "SESSION_HELD";
    /// Stale or missing generation, or a result for an assignment that is no longer current.
    pub const FENCED: &str = "FENCED";
    pub const TRANSPORT_DISABLED: &str = "TRANSPORT_DISABLED";
    pub const SIGNATURE_MISSING: &str = "SIGNATURE_MISSING";
    pub const SIGNATURE_INVALID: &str = "SIGNATURE_INVALID";
    pub const UNSUPPORTED_SIGNATURE_ALGORITHM: &str = "UNSUPPORTED_SIGNATURE_ALGORITHM";
    pub const UNSUPPORTED_CONTRACT_VERSION: &str = "UNSUPPORTED_CONTRACT_VERSION";
    pub const TASK_ID_MISMATCH: &str = "TASK_ID_MISMATCH";
    pub const AGENT_ID_MISMATCH: &str = "AGENT_ID_MISMATCH";
    pub const NO_MATCHING_AGENT: &str = "NO_MATCHING_AGENT";
    pub const TASK_NOT_RETRIABLE: &str = "TASK_NOT_RETRIABLE";
    pub const UNAVAILABLE: &str = "UNAVAILABLE";
    /// A task type no agent runs (see `kind::TaskKind`).
    pub const UNSUPPORTED_TASK_TYPE: &str = "UNSUPPORTED_TASK_TYPE";
    /// The payload does not parse as the task type's payload type.
    pub const INVALID_PAYLOAD: &str = "INVALID_PAYLOAD";
    /// The agent named does not report the capability the task type needs.
    pub const CAPABILITY_MISSING: &str = "CAPABILITY_MISSING";
}
