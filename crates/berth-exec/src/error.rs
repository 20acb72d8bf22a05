//! Why a deployment step failed, as a typed error with a stable `UPPER_SNAKE` code and whether a
//! retry may help. Executors turn it into an [`Outcome`](crate::Outcome) in one place; messages
//! never carry credential values (the outcome is redacted again anyway).

use berth_proto::result::error_types;

/// A failed step of `docker.run`, `rollback`, `compose.up`, `ssh.deploy`, `upload-files` or a
/// task run over SSH.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error("{0}")]
    InvalidPayload(String),
    #[error("{0}")]
    DigestRequired(String),
    #[error("{0}")]
    DigestMismatch(String),
    #[error("docker engine unreachable: {0}")]
    DockerUnavailable(String),
    #[error("registry unreachable while pulling {image}: {detail}")]
    RegistryUnavailable { image: String, detail: String },
    #[error("registry refused the credentials for {image} (check registryUsername/registryPassword): {detail}")]
    RegistryAuthFailed { image: String, detail: String },
    #[error("image {image} not found in its registry: {detail}")]
    ImageNotFound { image: String, detail: String },
    #[error("pulling {image} failed: {detail}")]
    PullFailed { image: String, detail: String },
    #[error("{0}")]
    HealthCheckUnavailable(String),
    #[error("{0}")]
    HealthCheckFailed(String),
    #[error("{hook} hook failed: {detail}")]
    HookFailed { hook: &'static str, detail: String },
    #[error("the {hook} hook's program {program:?} is not on this agent's hook allow-list (--allow-hook; an absolute path, matched exactly)")]
    HookNotAllowed { hook: &'static str, program: String },
    #[error("{hook} hook timed out after {seconds}s and was killed")]
    HookTimeout { hook: &'static str, seconds: u64 },
    #[error("docker engine refused to {action} {target}: {detail}")]
    Engine {
        action: &'static str,
        target: String,
        detail: String,
    },
    #[error("no previous container {0}-previous-* to roll back to")]
    NoPreviousContainer(String),
    #[error("writing the version sticker failed")]
    Sticker(#[source] crate::sticker::StickerError),
    #[error("the payload has no compose_lock artifact with inline content")]
    ComposeLockMissing,
    #[error("the compose lock is invalid: {0}")]
    ComposeLockInvalid(String),
    #[error("{0}")]
    ServiceNotFound(String),
    #[error("neither `docker compose` nor `docker-compose` works on this host: {0}")]
    ComposeUnavailable(String),
    #[error("`compose {action}` failed: {detail}")]
    Compose {
        action: &'static str,
        detail: String,
    },
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the host key of {target} is not the pinned one (pinned {pinned}, presented {presented}); nothing was sent")]
    HostKeyMismatch {
        target: String,
        pinned: String,
        presented: String,
    },
    #[error("sshd at {target} unreachable: {detail}")]
    SshUnreachable { target: String, detail: String },
    #[error("{0}")]
    SshAuthFailed(String),
    #[error("{0}")]
    Ssh(String),
    #[error("{0}")]
    DeployScriptFailed(String),
    #[error("{0}")]
    StickerUnreadable(String),
    #[error("{0}")]
    ArtifactNotFound(String),
    #[error("{detail}")]
    ArtifactUnavailable { detail: String, retriable: bool },
    #[error("{0}")]
    ArtifactDigestMismatch(String),
    #[error("{0}")]
    PathForbidden(String),
    #[error("the delivery's lease no longer holds, so nothing irreversible was done: {0}")]
    LeaseLost(String),
    #[error("the task was cancelled")]
    Cancelled,
    #[error("the task ran out of time")]
    TimedOut,
}

impl ExecError {
    /// The stable code in `Outcome.error_type`.
    pub fn code(&self) -> &'static str {
        match self {
            ExecError::InvalidPayload(_) => error_types::INVALID_PAYLOAD,
            ExecError::DigestRequired(_) => "DIGEST_REQUIRED",
            ExecError::DigestMismatch(_) => "DIGEST_MISMATCH",
            ExecError::DockerUnavailable(_) => "DOCKER_UNAVAILABLE",
            ExecError::RegistryUnavailable { .. } => "REGISTRY_UNAVAILABLE",
            ExecError::RegistryAuthFailed { .. } => "REGISTRY_AUTH_FAILED",
            ExecError::ImageNotFound { .. } => "IMAGE_NOT_FOUND",
            ExecError::PullFailed { .. } => "PULL_FAILED",
            ExecError::HealthCheckUnavailable(_) => "HEALTH_CHECK_UNAVAILABLE",
            ExecError::HealthCheckFailed(_) => error_types::HEALTH_CHECK_FAILED,
            ExecError::HookFailed { .. } => "HOOK_FAILED",
            ExecError::HookNotAllowed { .. } => error_types::HOOK_NOT_ALLOWED,
            ExecError::HookTimeout { .. } => "HOOK_TIMEOUT",
            ExecError::Engine { .. } => "DOCKER_ERROR",
            ExecError::NoPreviousContainer(_) => "NO_PREVIOUS_CONTAINER",
            ExecError::Sticker(_) => error_types::STICKER_WRITE_FAILED,
            ExecError::ComposeLockMissing => "COMPOSE_LOCK_MISSING",
            ExecError::ComposeLockInvalid(_) => "COMPOSE_LOCK_INVALID",
            ExecError::ServiceNotFound(_) => "SERVICE_NOT_FOUND",
            ExecError::ComposeUnavailable(_) => "COMPOSE_UNAVAILABLE",
            ExecError::Compose { .. } => "COMPOSE_FAILED",
            ExecError::Io { .. } => "IO_ERROR",
            ExecError::HostKeyMismatch { .. } => error_types::HOST_KEY_MISMATCH,
            ExecError::SshUnreachable { .. } => error_types::SSH_UNREACHABLE,
            ExecError::SshAuthFailed(_) => error_types::SSH_AUTH_FAILED,
            ExecError::Ssh(_) => error_types::SSH_FAILED,
            ExecError::DeployScriptFailed(_) => error_types::DEPLOY_SCRIPT_FAILED,
            ExecError::StickerUnreadable(_) => error_types::STICKER_UNREADABLE,
            ExecError::ArtifactNotFound(_) => error_types::ARTIFACT_NOT_FOUND,
            ExecError::ArtifactUnavailable { .. } => error_types::ARTIFACT_UNAVAILABLE,
            ExecError::ArtifactDigestMismatch(_) => error_types::ARTIFACT_DIGEST_MISMATCH,
            ExecError::PathForbidden(_) => error_types::PATH_FORBIDDEN,
            ExecError::LeaseLost(_) => error_types::LEASE_LOST,
            ExecError::Cancelled => error_types::CANCELLED,
            ExecError::TimedOut => error_types::TIMEOUT,
        }
    }

    /// Whether running the same task again may succeed without anyone changing anything.
    pub fn retriable(&self) -> bool {
        if let ExecError::ArtifactUnavailable { retriable, .. } = self {
            return *retriable;
        }
        matches!(
            self,
            ExecError::DockerUnavailable(_)
                | ExecError::RegistryUnavailable { .. }
                | ExecError::PullFailed { .. }
                // Nothing was changed on the target: the connection never opened.
                | ExecError::SshUnreachable { .. }
                // Not journaled: a later delivery of the task runs it for real.
                | ExecError::LeaseLost(_)
        )
    }

    /// The message with its source chain, for the outcome (logged once, where it is handled).
    pub fn chain(&self) -> String {
        let mut out = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(s) = source {
            out.push_str(": ");
            out.push_str(&s.to_string());
            source = s.source();
        }
        out
    }
}
