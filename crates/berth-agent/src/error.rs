//! Agent failures, each mapped to the exit code operators and supervisors act on.

/// Exit codes: 0 stop, 1 fatal (identity revoked: re-register; or fenced by a newer process),
/// 75 temporary, 78 configuration.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Wrong flags, missing or unusable state, a refused registration token: fix the setup.
    #[error("configuration: {0}")]
    Config(String),
    /// The server no longer accepts this identity: register again.
    #[error("identity revoked: {0}")]
    Revoked(String),
    /// The request went out with the certificate this agent's last renewal replaced. Loops that
    /// run beside a renewal send it again on the new link (`retry::with_link_retries`);
    /// anywhere else the stored identity is out of date: register again.
    #[error("certificate superseded: {0}")]
    Superseded(String),
    /// Another process took over this identity (a newer session generation): stop all work.
    #[error("fenced: {0}")]
    Fenced(String),
    /// Something that should not happen and will not get better by retrying.
    #[error("fatal: {0}")]
    Fatal(String),
    /// The server stayed unreachable, or kept rate-limiting, past the retry budget.
    #[error("temporary: {0}")]
    Temporary(String),
    /// The server in use is unreachable (or answered 5xx) and others were named (`--server
    /// A,B`): `run` moves to the next and acquires a new session there. Never ends the agent.
    #[error("server lost: {0}")]
    ServerLost(String),
}

impl AgentError {
    pub fn exit_code(&self) -> i32 {
        match self {
            AgentError::Config(_) => 78,
            AgentError::Revoked(_)
            | AgentError::Superseded(_)
            | AgentError::Fenced(_)
            | AgentError::Fatal(_) => 1,
            AgentError::Temporary(_) | AgentError::ServerLost(_) => 75,
        }
    }
}
