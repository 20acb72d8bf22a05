//! Wire types: everything that crosses the network between the berth server, agents and the CLI.
//!
//! This crate owns the JSON shapes and nothing else. It must never depend on tokio, an HTTP stack
//! or SQL; the store has its own row types and each edge converts explicitly.

pub mod admin;
pub mod agent;
pub mod audit;
pub mod deploy;
pub mod desired;
pub mod error;
pub mod event;
pub mod ids;
pub mod json;
pub mod kind;
pub mod names;
pub mod notify;
pub mod payload;
pub mod readiness;
pub mod redact;
pub mod reference;
pub mod release;
pub mod result;
pub mod ssh_target;
pub mod sticker;
pub mod task;
pub mod transport;
pub mod url;

/// HTTP header names berth defines, lowercase as HTTP/2 sends them.
pub mod headers {
    /// The agent's session generation, on every mutating agent call.
    pub const GENERATION_HEADER: &str = "x-berth-generation";
    /// Assignment ids whose cancellation the agent already has, comma-separated, on a poll.
    pub const KNOWN_CANCELLATIONS_HEADER: &str = "x-berth-known-cancellations";
    /// The one-time registration token on `POST /api/v1/agents/register`.
    pub const REGISTRATION_TOKEN_HEADER: &str = "x-registration-token";
    /// Dedupes creates within a tenant.
    pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
}

pub use error::ErrorBody;
pub use ids::{
    AgentId, AssignmentId, DeploymentId, EnvironmentId, ReleaseId, SshTargetId, TaskId, TenantId,
    TokenId,
};

/// HTTP method of a typed request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Post,
    Put,
    Delete,
}

/// A typed API request: the body (or query) type is tied to its response type, so the one client
/// in `berth-client` cannot send a request and decode the wrong answer.
pub trait Request: serde::Serialize {
    type Response: serde::de::DeserializeOwned;
    const METHOD: Method;
    /// Path and query, starting with `/`.
    fn path(&self) -> String;
    /// Whether the request has a JSON body (false: GET/DELETE with everything in the path).
    fn has_body(&self) -> bool {
        matches!(Self::METHOD, Method::Post | Method::Put)
    }
}

/// Timestamps on the wire are RFC 3339 UTC.
pub mod rfc3339 {
    pub use time::serde::rfc3339::*;
    pub mod option {
        pub use time::serde::rfc3339::option::*;
    }
}
