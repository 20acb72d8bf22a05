//! `agent-task-transport/v1`, field for field as seed 000 specifies, plus the session lease.
//!
//! Additions the seed allows ("more fields may be added"): `assignmentId` in the result envelope
//! (inside the signed bytes, so a result is bound to one delivery), `idempotencyKey`,
//! `expiresAt` and `sideEffects` in the assignment, and `cancellations` in the poll answer.
//!
//! Sealing (issue 17): an assignment's `payload` and `credentials` travel only inside `sealed`,
//! HPKE-sealed to the agent's certificate key, and the seed's two fields are sent empty. A
//! result's `logs` travel inside `resultData.sealedLogs`, sealed to the server's key, which the
//! session answer hands the agent. Both use the assignment id as associated data.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::{AgentId, AssignmentId, Method, Request, TaskId};

pub const CONTRACT_VERSION: &str = "agent-task-transport/v1";
pub use crate::headers::GENERATION_HEADER;
/// The signing scheme and the progress phase are defined where they belong (`json`, `task`);
/// these paths stay for callers.
pub use crate::json::signing_input;
pub use crate::task::ProgressPhase;
pub const ALG_ECDSA_SHA256: &str = "ecdsa-sha256";
pub const ALG_RSA_SHA256: &str = "rsa-sha256";

/// `POST /api/v1/agents/{id}/session` (mTLS): acquire the session lease.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AcquireSession {
    #[serde(skip)]
    pub agent_id: AgentId,
    /// Random per agent process: a restarted or cloned process has another one.
    pub instance_id: String,
    /// The host's boot id (`/proc/sys/kernel/random/boot_id`): another host, or the same host
    /// after a reboot, has another one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// Sent only while this process holds the exclusive lock on its installation's
    /// `<state-dir>/agent.lock`, which it keeps for its whole life: that file's identity on this
    /// boot (`<device>:<inode>`). A contender that presents the holder's `bootId` and `lock`
    /// holds the lock the holder held, so the holder is dead: it takes the session at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock: Option<String>,
    /// The version this agent process runs (1-50 printable ASCII characters, no spaces; sent
    /// since 0.2.0). It replaces the agent's `version`, so an agent upgraded in place shows what
    /// it runs; without it the registered version stays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Session {
    pub generation: i64,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub lease_expires_at: OffsetDateTime,
    pub heartbeat_interval_seconds: u64,
    /// The server's sealing public key (standard base64 of the uncompressed P-256 point): the
    /// agent seals its result logs to it. Replicas share it (it lives in the data dir).
    pub sealing_key: String,
}

impl Request for AcquireSession {
    type Response = Session;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/agents/{}/session", self.agent_id)
    }
}

/// `DELETE /api/v1/agents/{id}/session` (mTLS, with the generation): a graceful stop ends the
/// lease at once, so a restarted process need not wait for it to expire.
#[derive(Debug, Clone, Serialize)]
pub struct ReleaseSession {
    #[serde(skip)]
    pub agent_id: AgentId,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Released {
    pub released: bool,
}

impl Request for ReleaseSession {
    type Response = Released;
    const METHOD: Method = Method::Delete;
    fn path(&self) -> String {
        format!("/api/v1/agents/{}/session", self.agent_id)
    }
}

fn agent_runtime(agent: AgentId) -> String {
    format!("/api/v1/release-orchestrator/agent-runtime/agents/{agent}")
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentTaskPollRequest {
    pub contract_version: String,
    pub agent_id: AgentId,
    /// Seed 000's capability strings ([`crate::kind::capability`]): only tasks whose
    /// `requiredCapability` is among them are handed out on this poll.
    #[serde(default)]
    pub capabilities: Vec<String>,
    /// The agent confirms every delivery with side effects through [`StartTask`] before it
    /// touches the host. The server then knows that a lost delivery it never saw started did
    /// nothing, and requeues it instead of making it `unknown`. Seed 000 agents leave it out:
    /// their lost side-effecting deliveries stay `unknown`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub start_handshake: bool,
}

impl Request for AgentTaskPollRequest {
    type Response = AgentTaskPollResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("{}/tasks:poll", agent_runtime(self.agent_id))
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentTaskPollResponse {
    pub contract_version: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignment: Option<AgentTaskAssignment>,
    /// Running assignments the operator cancelled: stop them and report `cancelled`.
    #[serde(default)]
    pub cancellations: Vec<AgentTaskCancellation>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentTaskCancellation {
    pub task_id: TaskId,
    pub assignment_id: AssignmentId,
}

/// `WS /api/v1/agents/{id}/task-stream` (mTLS, `X-Berth-Generation` on the upgrade request):
/// seed 000's push stream, an alternative to the long-poll with the same rules. The path.
pub fn task_stream_path(agent: AgentId) -> String {
    format!("/api/v1/agents/{agent}/task-stream")
}

/// What the server pushes on the task stream (JSON text messages). Seed 000's two messages;
/// `task_cancelled` also names the assignment, as a poll's cancellation does.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TaskStreamMessage {
    /// One claimed delivery, exactly what a poll would have answered.
    TaskAssigned { task: Box<AgentTaskAssignment> },
    /// A running assignment the operator cancelled: stop it and report `cancelled`.
    #[serde(rename_all = "camelCase")]
    TaskCancelled {
        task_id: TaskId,
        assignment_id: AssignmentId,
    },
}

/// What the agent sends on the task stream: `{"type": "ready", …the poll's body}` asks for one
/// delivery, as one poll would (same contract version, capabilities and start handshake). The
/// server pushes at most one `task_assigned` per `ready`, so the agent's own limit on tasks
/// at once holds over the stream as over polls.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TaskStreamRequest {
    Ready(AgentTaskPollRequest),
}

/// The close code of a task stream the server ends with a refusal: 4000 + the HTTP status the
/// same refusal has on a poll (4409 `FENCED`, 4401 `CERTIFICATE_SUPERSEDED`, …), the reason
/// being the stable code. Codes below 4000 are WebSocket's own (1000 normal, 1001 going away).
pub const fn stream_close_code(http_status: u16) -> u16 {
    4000 + http_status
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentTaskAssignment {
    pub contract_version: String,
    /// Fresh for every delivery of the task.
    pub assignment_id: AssignmentId,
    pub task_id: TaskId,
    pub agent_id: AgentId,
    /// [`crate::kind::TaskKind::required_capability`]: `docker`, `compose`, or `agent` for the
    /// built-in task types.
    pub required_capability: String,
    pub task_type: String,
    /// Empty: the payload travels in `sealed`.
    pub payload: String,
    /// Empty: the credentials travel in `sealed`.
    pub credentials: BTreeMap<String, String>,
    /// The JSON of a [`SealedAssignment`] (the payload and credentials), sealed to the agent's
    /// certificate key with [`ASSIGNMENT_SEAL_INFO`] and this assignment's id as associated data,
    /// so it opens for no other key and in no other assignment. Always present from berth.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed: Option<SealedBox>,
    pub variables: BTreeMap<String, String>,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub assigned_at: OffsetDateTime,
    /// TimeSpan (`hh:mm:ss`): the agent kills the work after this long.
    pub timeout: String,
    /// Stable across deliveries of one task: the agent's journal key. Derived by the server from
    /// the tenant and the task, never from a client's `Idempotency-Key`.
    pub idempotency_key: String,
    /// When the server stops waiting for this delivery's result.
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub expires_at: OffsetDateTime,
    pub side_effects: bool,
}

/// The one sealing suite: HPKE (RFC 9180) base mode, DHKEM(P-256, HKDF-SHA256), HKDF-SHA256,
/// AES-256-GCM.
pub const SEAL_ALG: &str = "HPKE-P256-SHA256-A256GCM";
/// HPKE `info` of an assignment's sealed payload and credentials.
pub const ASSIGNMENT_SEAL_INFO: &[u8] = b"berth agent-task-transport/v1 assignment";
/// HPKE `info` of a result's sealed logs.
pub const LOGS_SEAL_INFO: &[u8] = b"berth agent-task-transport/v1 result logs";

/// One HPKE-sealed message: `enc` (the encapsulated key) and `ciphertext` (with its tag), both
/// standard base64, under the suite `alg` names ([`SEAL_ALG`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SealedBox {
    pub alg: String,
    pub enc: String,
    pub ciphertext: String,
}

/// What an assignment's `sealed` holds once opened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SealedAssignment {
    /// JSON text of the task payload.
    pub payload: String,
    #[serde(default)]
    pub credentials: BTreeMap<String, String>,
}

/// `POST …/agents/{agentId}/tasks/{taskId}/start` (mTLS, with the generation): the agent asks,
/// before any side effect, whether this delivery is still its to run. Yes only while the
/// generation is current and the assignment is the task's live lease; the yes is recorded on the
/// delivery (it may have run from then on). Asking again for the same delivery is harmless.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct StartTask {
    #[serde(skip)]
    pub agent_id: AgentId,
    #[serde(skip)]
    pub task_id: TaskId,
    pub assignment_id: AssignmentId,
    /// The step the delivery is about to take, when it reports one: recorded on the delivery
    /// (`AttemptView::phase`), so a deployment can show it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ProgressPhase>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TaskStarted {
    pub assignment_id: AssignmentId,
    /// When the delivery was first confirmed.
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub started_at: OffsetDateTime,
    /// The lease's deadline: past it the agent takes no irreversible step.
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub expires_at: OffsetDateTime,
}

impl Request for StartTask {
    type Response = TaskStarted;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!(
            "{}/tasks/{}/start",
            agent_runtime(self.agent_id),
            self.task_id
        )
    }
}

/// The signed result. The signed bytes are the RFC 8785 (JCS) canonical JSON of this object
/// without `signature`, exactly as sent (see [`signing_input`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentTaskResultEnvelope {
    pub contract_version: String,
    pub agent_id: AgentId,
    pub task_id: TaskId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignment_id: Option<AssignmentId>,
    pub success: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// JSON text of a [`crate::result::TaskResult`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_data: Option<String>,
    /// TimeSpan.
    pub duration: String,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub completed_at: OffsetDateTime,
    pub signature_algorithm: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

impl AgentTaskResultEnvelope {
    /// The bytes its signature covers (see [`signing_input`]).
    pub fn signing_input(&self) -> Result<Vec<u8>, serde_json::Error> {
        signing_input(&serde_json::to_value(self)?)
    }
}

/// `POST …/agents/{agentId}/tasks/{taskId}/result`: the body is the envelope. The path's ids are
/// explicit, so a test can send an envelope whose ids disagree with them.
#[derive(Debug, Clone)]
pub struct SubmitResult {
    pub agent_id: AgentId,
    pub task_id: TaskId,
    pub envelope: AgentTaskResultEnvelope,
}

impl SubmitResult {
    /// Submits the envelope under its own ids.
    pub fn new(envelope: AgentTaskResultEnvelope) -> SubmitResult {
        SubmitResult {
            agent_id: envelope.agent_id,
            task_id: envelope.task_id,
            envelope,
        }
    }
}

impl Serialize for SubmitResult {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.envelope.serialize(serializer)
    }
}

/// Where the signed result of `task` goes.
pub fn result_path(agent: AgentId, task: TaskId) -> String {
    format!("{}/tasks/{task}/result", agent_runtime(agent))
}

impl Request for SubmitResult {
    type Response = ResultAck;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        result_path(self.agent_id, self.task_id)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ResultAck {
    pub accepted: bool,
    /// The same result was already recorded for this assignment.
    pub duplicate: bool,
    /// The task's state after the result.
    pub state: crate::task::TaskState,
}

/// .NET TimeSpan text: `hh:mm:ss`, with `d.` for days and `.fffffff` for fractions.
pub fn format_timespan(d: Duration) -> String {
    let secs = d.as_secs();
    let (days, h, m, s) = (
        secs / 86400,
        (secs / 3600) % 24,
        (secs / 60) % 60,
        secs % 60,
    );
    let ticks = d.subsec_nanos() / 100;
    let mut out = String::new();
    if days > 0 {
        out.push_str(&format!("{days}."));
    }
    out.push_str(&format!("{h:02}:{m:02}:{s:02}"));
    if ticks > 0 {
        out.push_str(&format!(".{ticks:07}"));
    }
    out
}

/// Parses [`format_timespan`]'s output (and .NET's `c` format generally).
pub fn parse_timespan(s: &str) -> Option<Duration> {
    let (days, rest) = match s.split_once('.') {
        Some((d, rest)) if !d.contains(':') => (d.parse::<u64>().ok()?, rest),
        _ => (0, s),
    };
    let (hms, fraction) = match rest.split_once('.') {
        Some((hms, f)) => (hms, Some(f)),
        None => (rest, None),
    };
    let parts: Vec<&str> = hms.split(':').collect();
    if parts.len() != 3 {
        return None;
    }
    let num = |p: &str, max: u64| p.parse::<u64>().ok().filter(|v| *v < max);
    let (h, m, sec) = (num(parts[0], 24)?, num(parts[1], 60)?, num(parts[2], 60)?);
    let nanos = match fraction {
        None => 0,
        Some(f) if !f.is_empty() && f.len() <= 7 && f.bytes().all(|b| b.is_ascii_digit()) => {
            format!("{f:0<7}").parse::<u32>().ok()? * 100
        }
        Some(_) => return None,
    };
    Some(Duration::new(days * 86400 + h * 3600 + m * 60 + sec, nanos))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timespans_round_trip() {
        for d in [
            Duration::ZERO,
            Duration::from_secs(59),
            Duration::from_secs(3600 * 5 + 61),
            Duration::from_secs(86400 * 2 + 1),
            Duration::from_millis(1500),
            Duration::new(3, 123_456_700),
        ] {
            assert_eq!(
                parse_timespan(&format_timespan(d)),
                Some(d),
                "{}",
                format_timespan(d)
            );
        }
        assert_eq!(format_timespan(Duration::from_secs(300)), "00:05:00");
        assert_eq!(
            parse_timespan("1.02:03:04.5"),
            Some(Duration::new(93784, 500_000_000))
        );
        for bad in [
            "",
            "5",
            "00:60:00",
            "24:00:00",
            "a:b:c",
            "00:00:00.12345678",
            "00:00:00.",
        ] {
            assert_eq!(parse_timespan(bad), None, "{bad}");
        }
    }

    #[test]
    fn signing_input_is_jcs_without_the_signature() {
        let envelope = serde_json::json!({
            "taskId": "t", "success": true, "signature": "abc", "agentId": "a",
            "message": "é\u{1f600}", "contractVersion": CONTRACT_VERSION,
        });
        let bytes = signing_input(&envelope).unwrap();
        assert_eq!(
            String::from_utf8(bytes).unwrap(),
            "{\"agentId\":\"a\",\"contractVersion\":\"agent-task-transport/v1\",\"message\":\"é\u{1f600}\",\"success\":true,\"taskId\":\"t\"}"
        );
    }
}
