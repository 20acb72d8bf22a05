//! Agent registration, management and the heartbeat (seed 000 "API Endpoints").

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::json::signing_input;
use crate::{AgentId, Method, Request};

/// Where every request path was built before `url` owned them; kept for callers.
pub use crate::url::{encode_query_value, with_query};

/// What an agent can do on its host, with the version it found and whether it works now.
///
/// Accepted as seed 000's plain string (`"docker"`, a healthy capability of that name) or as this
/// object; always written as the object.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", try_from = "CapabilityForm")]
pub struct Capability {
    /// Seed 000's capability string ([`crate::kind::capability`]): `docker`, `compose`, `ssh`, …
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// False when the capability is present but broken (the engine stopped answering, say).
    #[serde(default = "default_true")]
    pub healthy: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

fn default_true() -> bool {
    true
}

impl Capability {
    /// A healthy capability of that name, as a seed agent's plain string means.
    pub fn named(name: impl Into<String>) -> Capability {
        Capability {
            name: name.into(),
            version: None,
            healthy: true,
            detail: None,
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum CapabilityForm {
    Name(String),
    Object(CapabilityObject),
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CapabilityObject {
    name: String,
    #[serde(default)]
    version: Option<String>,
    #[serde(default = "default_true")]
    healthy: bool,
    #[serde(default)]
    detail: Option<String>,
}

impl TryFrom<CapabilityForm> for Capability {
    type Error = String;
    fn try_from(form: CapabilityForm) -> Result<Capability, String> {
        Ok(match form {
            CapabilityForm::Name(name) => Capability::named(name),
            CapabilityForm::Object(o) => Capability {
                name: o.name,
                version: o.version,
                healthy: o.healthy,
                detail: o.detail,
            },
        })
    }
}

/// Host resource usage reported with each heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResourceUsage {
    /// Host CPU busy share since the previous heartbeat, 0–100 across all cores.
    pub cpu_percent: f64,
    pub cpu_cores: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
    /// Free bytes on the file system holding the agent's state directory.
    pub disk_free_bytes: u64,
    pub disk_total_bytes: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum AgentStatus {
    /// Registered, but no heartbeat yet: shown as such, never picked by a selector. The
    /// staleness sweep makes it `offline` three heartbeat intervals after registration, as it
    /// does an agent whose heartbeats stopped; it is never made `degraded`.
    Registered,
    Online,
    Degraded,
    Offline,
    /// Suspended by an operator (`berth agents suspend`): it claims nothing new. Only in views
    /// and filters; never stored (the stored status, its liveness, goes on underneath).
    Blocked,
}

impl AgentStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            AgentStatus::Registered => "registered",
            AgentStatus::Online => "online",
            AgentStatus::Degraded => "degraded",
            AgentStatus::Offline => "offline",
            AgentStatus::Blocked => "blocked",
        }
    }

    pub fn parse(s: &str) -> Option<AgentStatus> {
        match s {
            "registered" => Some(AgentStatus::Registered),
            "online" => Some(AgentStatus::Online),
            "degraded" => Some(AgentStatus::Degraded),
            "offline" => Some(AgentStatus::Offline),
            "blocked" => Some(AgentStatus::Blocked),
            _ => None,
        }
    }
}

/// `POST /api/v1/agents/register`, header `X-Registration-Token`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisterAgent {
    pub name: String,
    pub version: String,
    #[serde(default)]
    pub capabilities: Vec<Capability>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// PKCS#10 CSR, PEM. Only its public key is used: the server sets the identity.
    pub csr: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RegisterAgentResponse {
    pub agent_id: AgentId,
    /// The agent's certificate, PEM.
    pub certificate: String,
    /// The CA certificate, PEM. The agent checks it against the fingerprint it was given.
    pub ca_certificate: String,
}

impl Request for RegisterAgent {
    type Response = RegisterAgentResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/agents/register".into()
    }
}

/// An agent as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Agent {
    pub id: AgentId,
    pub name: String,
    pub version: String,
    pub capabilities: Vec<Capability>,
    pub labels: BTreeMap<String, String>,
    /// `blocked` while suspended, whatever its liveness.
    pub status: AgentStatus,
    /// No new work is routed to it (`berth agents cordon`): task creates naming it are refused
    /// (`409 AGENT_CORDONED`), selectors and deployments skip it; its queued tasks still run.
    #[serde(default)]
    pub cordoned: bool,
    /// It claims nothing new (`berth agents suspend`); it keeps its session and heartbeats.
    #[serde(default)]
    pub suspended: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    #[serde(default, with = "crate::rfc3339::option")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub last_heartbeat: Option<OffsetDateTime>,
    #[serde(default)]
    pub resource_usage: Option<ResourceUsage>,
    /// `sha256:` + hex of the bound client certificate's DER.
    #[serde(default)]
    pub certificate_fingerprint: Option<String>,
    #[serde(default, with = "crate::rfc3339::option")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub certificate_expires_at: Option<OffsetDateTime>,
    /// The session generation last granted (`X-Berth-Generation`); 0 before its first session.
    /// Each new session increments it, and a request carrying an older one is fenced.
    #[serde(default)]
    pub session_generation: u64,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub updated_at: OffsetDateTime,
}

/// `GET /api/v1/agents?status=&capability=&label=k=v&cursor=&limit=`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListAgents {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<AgentStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capability: Option<String>,
    /// `key=value`: only agents carrying that label.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentList {
    pub items: Vec<Agent>,
    /// Pass as `cursor` to get the next page; absent on the last page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

impl Request for ListAgents {
    type Response = AgentList;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        let status = self.status.map(|s| s.as_str().to_string());
        let limit = self.limit.map(|l| l.to_string());
        with_query(
            "/api/v1/agents",
            &[
                ("status", status.as_deref()),
                ("capability", self.capability.as_deref()),
                ("label", self.label.as_deref()),
                ("cursor", self.cursor.as_deref()),
                ("limit", limit.as_deref()),
            ],
        )
    }
}

/// `GET /api/v1/agents/{id}/artifacts/{sha256}` (agent certificate): an artifact of the agent's
/// tenant by its SHA-256 (64 lowercase hex), `application/octet-stream`, with `X-Artifact-Sha256`.
/// What `ssh.deploy` and `upload-files` fetch for an artifact given by reference; the agent writes
/// it only if the bytes hash to that value (`ARTIFACT_DIGEST_MISMATCH`). 404 `ARTIFACT_NOT_FOUND`.
pub fn agent_artifact_path(agent: crate::AgentId, sha256: &str) -> String {
    format!(
        "/api/v1/agents/{agent}/artifacts/{}",
        encode_query_value(sha256)
    )
}

/// `GET /api/v1/agents/{id}`.
#[derive(Debug, Clone, Serialize)]
pub struct GetAgent {
    #[serde(skip)]
    pub id: AgentId,
}

impl Request for GetAgent {
    type Response = Agent;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        format!("/api/v1/agents/{}", self.id)
    }
}

/// `PUT /api/v1/agents/{id}`: replaces labels and/or capabilities.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct UpdateAgent {
    #[serde(skip)]
    pub id: AgentId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Vec<Capability>>,
}

impl Request for UpdateAgent {
    type Response = Agent;
    const METHOD: Method = Method::Put;
    fn path(&self) -> String {
        format!("/api/v1/agents/{}", self.id)
    }
}

/// `DELETE /api/v1/agents/{id}`: the agent's certificate stops working at once.
#[derive(Debug, Clone, Serialize)]
pub struct DeleteAgent {
    #[serde(skip)]
    pub id: AgentId,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Deleted {
    pub deleted: bool,
}

impl Request for DeleteAgent {
    type Response = Deleted;
    const METHOD: Method = Method::Delete;
    fn path(&self) -> String {
        format!("/api/v1/agents/{}", self.id)
    }
}

/// What the agent's probe listener (`berth-agent --probe-listen`) answers on `GET /healthz`
/// (always `ready: true` while the process runs) and `GET /readyz` (`503` with `ready: false`
/// and a `reason` while it holds no live session or an executor it offered is unhealthy).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProbeStatus {
    pub ready: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `POST /api/v1/agents/{id}/{cordon|uncordon|suspend|resume}` (admin): sets or lifts a hold and
/// answers the agent as it now is. Idempotent: holding a held agent changes nothing.
#[derive(Debug, Clone, Serialize)]
pub struct HoldAgent {
    #[serde(skip)]
    pub id: AgentId,
    #[serde(skip)]
    pub hold: AgentHold,
}

/// The four operator holds on an agent, named as their route segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentHold {
    Cordon,
    Uncordon,
    Suspend,
    Resume,
}

impl AgentHold {
    pub fn as_str(self) -> &'static str {
        match self {
            AgentHold::Cordon => "cordon",
            AgentHold::Uncordon => "uncordon",
            AgentHold::Suspend => "suspend",
            AgentHold::Resume => "resume",
        }
    }
}

impl Request for HoldAgent {
    type Response = Agent;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/agents/{}/{}", self.id, self.hold.as_str())
    }
}

/// `POST /api/v1/agents/{id}/heartbeat` (mTLS), signed like a task result: the signature covers
/// the RFC 8785 (JCS) canonical JSON of this object without `signature`, exactly as sent (see
/// [`crate::transport::signing_input`]), so the capability refresh and the sequence are signed
/// with the algorithm. An unsigned heartbeat is refused (`SIGNATURE_MISSING`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Heartbeat {
    #[serde(skip)]
    pub agent_id: AgentId,
    /// What the agent says of itself: `online`, or `degraded` when a capability is broken.
    pub status: AgentStatus,
    pub resource_usage: ResourceUsage,
    pub capabilities: Vec<Capability>,
    /// The session generation this heartbeat is for; it must equal `X-Berth-Generation`, so a
    /// signed heartbeat cannot be replayed into a later session.
    pub generation: i64,
    /// Strictly increasing within a generation (the agent starts at 1 with each session); the
    /// server refuses one not above the last it applied (`HEARTBEAT_REPLAYED`). At most
    /// `i64::MAX`.
    pub sequence: u64,
    /// `ecdsa-sha256` or `rsa-sha256`.
    pub signature_algorithm: String,
    /// Standard base64 of the signature over the heartbeat's signing input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
}

impl Heartbeat {
    /// The bytes its signature covers (see [`crate::transport::signing_input`]).
    pub fn signing_input(&self) -> Result<Vec<u8>, serde_json::Error> {
        signing_input(&serde_json::to_value(self)?)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct HeartbeatResponse {
    pub acknowledged: bool,
    /// The status the server now holds for the agent.
    pub status: AgentStatus,
    /// The interval the server wants; the agent adopts it.
    pub heartbeat_interval_seconds: u64,
    /// Seed 000's `{tasks: AgentTask[]}`: the agent's queued work (`pending` or `retry_wait`, in
    /// claim order, at most [`HEARTBEAT_TASKS_MAX`]), so a seed-style agent that only heartbeats
    /// sees what waits for it. Listing claims nothing: a task is delivered, with a fresh
    /// assignment and its credentials, only by a poll or the task stream.
    #[serde(default)]
    pub tasks: Vec<AgentTask>,
}

/// The most tasks a heartbeat answer lists: it stays one small indexed read per heartbeat.
pub const HEARTBEAT_TASKS_MAX: u32 = 16;

/// Seed 000's `AgentTask`, as a heartbeat lists a queued task. The task is not claimed, so it
/// has no assignment yet: `assignedAt` and `expiresAt` are null, and `payload` is null and
/// `credentials` empty (both leave the server only inside an assignment, sealed to the agent's
/// key for that delivery).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentTask {
    pub id: crate::TaskId,
    /// The task type (`docker.run`, `health-check`, …).
    #[serde(rename = "type")]
    pub task_type: String,
    /// The agent the task runs on.
    pub target_id: AgentId,
    /// Always null here: a payload travels only sealed, in an assignment.
    #[cfg_attr(feature = "openapi", schema(value_type = Object, nullable))]
    pub payload: serde_json::Value,
    /// Always empty here (see the type's documentation).
    pub credentials: BTreeMap<String, String>,
    /// Seconds.
    pub timeout: u32,
    /// Higher runs first.
    pub priority: i32,
    /// The agent's journal key for the task (as in its assignment).
    pub idempotency_key: String,
    #[serde(with = "crate::rfc3339::option")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub assigned_at: Option<OffsetDateTime>,
    #[serde(with = "crate::rfc3339::option")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub expires_at: Option<OffsetDateTime>,
}

impl Request for Heartbeat {
    type Response = HeartbeatResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/agents/{}/heartbeat", self.agent_id)
    }
}

/// `POST /api/v1/agents/token` (mTLS): a short-lived ES256 JWT for the calling agent.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct IssueAgentJwt {}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentJwt {
    pub token: String,
    pub expires_in: u64,
    pub token_type: String,
}

impl Request for IssueAgentJwt {
    type Response = AgentJwt;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/agents/token".into()
    }
}

/// `POST /api/v1/agents/{id}/certificate` (mTLS): renew with a fresh CSR. The old certificate
/// stops working the moment the new one is issued.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewCertificate {
    #[serde(skip)]
    pub agent_id: AgentId,
    pub csr: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct RenewCertificateResponse {
    pub certificate: String,
    pub ca_certificate: String,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub expires_at: OffsetDateTime,
}

impl Request for RenewCertificate {
    type Response = RenewCertificateResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/agents/{}/certificate", self.agent_id)
    }
}

/// JWKS document served at `/.well-known/agent-jwks.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Jwks {
    pub keys: Vec<Jwk>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Jwk {
    pub kty: String,
    pub crv: String,
    pub x: String,
    pub y: String,
    pub kid: String,
    #[serde(rename = "use")]
    pub use_: String,
    pub alg: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_paths_encode_only_present_parameters() {
        assert_eq!(ListAgents::default().path(), "/api/v1/agents");
        let query = ListAgents {
            status: Some(AgentStatus::Online),
            label: Some("role=web&x".into()),
            limit: Some(5),
            ..Default::default()
        };
        assert_eq!(
            query.path(),
            "/api/v1/agents?status=online&label=role%3Dweb%26x&limit=5"
        );
    }

    #[test]
    fn capabilities_accept_seed_strings_and_objects() {
        let caps: Vec<Capability> = serde_json::from_str(
            r#"["docker", {"name": "compose", "version": "2.1", "healthy": false}]"#,
        )
        .unwrap();
        assert_eq!(caps[0], Capability::named("docker"));
        assert_eq!(caps[1].version.as_deref(), Some("2.1"));
        assert!(!caps[1].healthy);
        assert!(serde_json::from_str::<Capability>(r#"{"name": "x", "bogus": 1}"#).is_err());
        assert!(serde_json::from_str::<Capability>("1").is_err());
        assert_eq!(
            serde_json::to_value(Capability::named("ssh")).unwrap(),
            serde_json::json!({"name": "ssh", "healthy": true})
        );
    }
}
