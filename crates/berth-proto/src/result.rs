//! Seed 000's `TaskResult`: what a task did, as the agent reports it inside the signed envelope
//! (the JSON text of `AgentTaskResultEnvelope.resultData`), and the stable `errorType` codes.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::payload::ArtifactReference;
use crate::TaskId;

/// Stable `errorType` values. The server reads [`CANCELLED`](error_types::CANCELLED); the rest
/// are for people and tools.
pub mod error_types {
    /// The task was stopped because an operator cancelled it.
    pub const CANCELLED: &str = "CANCELLED";
    /// The task ran past its timeout and was stopped.
    pub const TIMEOUT: &str = "TIMEOUT";
    /// The agent was stopping (SIGTERM) and the task was still running when its shutdown grace
    /// ran out, so it was interrupted. Retriable unless the task has side effects.
    pub const AGENT_STOPPED: &str = "AGENT_STOPPED";
    pub const INVALID_PAYLOAD: &str = "INVALID_PAYLOAD";
    /// The agent has no executor for the task type.
    pub const UNSUPPORTED_TASK_TYPE: &str = "UNSUPPORTED_TASK_TYPE";
    /// A failed result that named no `errorType`.
    pub const FAILED: &str = "FAILED";
    pub const HEALTH_CHECK_FAILED: &str = "HEALTH_CHECK_FAILED";
    pub const STICKER_UNREADABLE: &str = "STICKER_UNREADABLE";
    pub const STICKER_WRITE_FAILED: &str = "STICKER_WRITE_FAILED";
    pub const COMMAND_NOT_ALLOWED: &str = "COMMAND_NOT_ALLOWED";
    pub const COMMAND_FAILED: &str = "COMMAND_FAILED";
    /// A deployment's hook names a program that is not on the agent's `--allow-hook` list.
    pub const HOOK_NOT_ALLOWED: &str = "HOOK_NOT_ALLOWED";
    /// The delivery's lease no longer held right before an irreversible step (the server fenced
    /// it, or its `expiresAt` passed), so the step was not taken. Retriable: the agent does not
    /// journal it, and a later delivery runs the task for real. Also what a task reports when
    /// another process took the agent's session while it ran and the fenced process interrupted
    /// it; then, like [`AGENT_STOPPED`], it is retriable only without side effects.
    pub const LEASE_LOST: &str = "LEASE_LOST";
    /// `ssh.deploy`: the target's host key is not the pinned one; nothing was sent to it.
    pub const HOST_KEY_MISMATCH: &str = "HOST_KEY_MISMATCH";
    /// `ssh.deploy`: the target's sshd could not be reached (refused, timed out). Retriable.
    pub const SSH_UNREACHABLE: &str = "SSH_UNREACHABLE";
    /// `ssh.deploy`: the target refused the key of the `sshPrivateKey` credential.
    pub const SSH_AUTH_FAILED: &str = "SSH_AUTH_FAILED";
    /// `ssh.deploy`: the connection failed after it was established (a channel, SFTP, a drop).
    pub const SSH_FAILED: &str = "SSH_FAILED";
    /// `ssh.deploy`: the deploy script exited non-zero or ran past its timeout; the deploy
    /// directory was restored from its backup.
    pub const DEPLOY_SCRIPT_FAILED: &str = "DEPLOY_SCRIPT_FAILED";
    /// An artifact given by reference: the server has none with that SHA-256 (not retriable).
    pub const ARTIFACT_NOT_FOUND: &str = "ARTIFACT_NOT_FOUND";
    /// An artifact given by reference could not be fetched from the server now (retriable
    /// unless the agent has no way to fetch at all).
    pub const ARTIFACT_UNAVAILABLE: &str = "ARTIFACT_UNAVAILABLE";
    /// An artifact given by reference hashed to another SHA-256 than its reference; nothing was
    /// written.
    pub const ARTIFACT_DIGEST_MISMATCH: &str = "ARTIFACT_DIGEST_MISMATCH";
    /// `upload-files` on the agent's own host: the directory is outside its upload root.
    pub const PATH_FORBIDDEN: &str = "PATH_FORBIDDEN";
    /// The assignment's `sealed` payload and credentials did not open with the agent's key
    /// (missing, tampered, sealed to another key or for another assignment). Nothing ran.
    pub const PAYLOAD_UNSEALABLE: &str = "PAYLOAD_UNSEALABLE";
}

/// Durations of the phases of a deployment, in milliseconds (DESIGN "Executors").
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TaskMetrics {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_duration_ms: Option<u64>,
    /// `ssh.deploy`: sending the artifacts over SFTP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deploy_duration_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check_duration_ms: Option<u64>,
}

/// Seed 000's `TaskResult`, field for field. Unknown fields are ignored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TaskResult {
    pub task_id: TaskId,
    pub success: bool,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub started_at: OffsetDateTime,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub completed_at: OffsetDateTime,
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub outputs: serde_json::Map<String, serde_json::Value>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(value_type = Vec<Object>))]
    pub artifacts: Vec<ArtifactReference>,
    /// What went wrong, for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// One of [`error_types`], or an executor's own stable code (`DIGEST_MISMATCH`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_type: Option<String>,
    /// Whether running the task again may succeed.
    #[serde(default)]
    pub retriable: bool,
    /// Redacted log of what the executor did. berth-agent sends it empty and the log in
    /// `sealedLogs`; the server records the opened log here.
    #[serde(default)]
    pub logs: String,
    /// `logs` sealed to the server's key ([`crate::transport::SealedBox`], info
    /// [`crate::transport::LOGS_SEAL_INFO`], the assignment id as associated data).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed_logs: Option<crate::transport::SealedBox>,
    #[serde(default)]
    pub metrics: TaskMetrics,
}

impl TaskResult {
    /// Whether the result reports an operator's cancellation.
    pub fn cancelled(&self) -> bool {
        !self.success && self.error_type.as_deref() == Some(error_types::CANCELLED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_seed_shape_and_ignores_unknown_fields() {
        let text = r#"{"taskId": "0190a3e2-4c1c-7d4e-9a2b-3c4d5e6f7a8b", "success": false,
            "startedAt": "2026-01-01T00:00:00Z", "completedAt": "2026-01-01T00:00:01.5Z",
            "error": "boom", "errorType": "CANCELLED", "logs": "", "later": 1,
            "metrics": {"pullDurationMs": 3}}"#;
        let r: TaskResult = serde_json::from_str(text).unwrap();
        assert!(r.cancelled());
        assert_eq!(r.metrics.pull_duration_ms, Some(3));
        assert!(r.outputs.is_empty() && !r.retriable);
        let again: TaskResult = serde_json::from_value(serde_json::to_value(&r).unwrap()).unwrap();
        assert_eq!(again, r);
    }
}
