//! The event stream, `GET /api/v1/events` (Server-Sent Events): one SSE event per row of the
//! server's durable event table. Each is `id: <seq>`, `event: <kind>`, `data: <EventView>`;
//! `Last-Event-ID` (or `?after=`) resumes after a sequence number.
//!
//! Kinds: `task.state` (data [`TaskStateEvent`]), `agent.registered`, `agent.status`,
//! `agent.deleted`, `agent.hold` (data [`AgentEvent`]), `deployment.state`, `deployment.target`,
//! `deployment.approval` and `environment.drift` (data in `crate::deploy`), and
//! `environment.readiness` (data `{environmentId, generation, operationalReady, verifyObserved}`;
//! the conditions are read from `GET …/readiness`). Clients ignore kinds they do not know.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::task::TaskState;
use crate::url::with_query;
use crate::{AgentId, DeploymentId, EnvironmentId, TaskId};

pub const TASK_STATE: &str = "task.state";
pub const AGENT_REGISTERED: &str = "agent.registered";
pub const AGENT_STATUS: &str = "agent.status";
pub const AGENT_DELETED: &str = "agent.deleted";
/// An operator cordoned, uncordoned, suspended or resumed the agent (data [`AgentEvent`] with
/// `cordoned` and `suspended`).
pub const AGENT_HOLD: &str = "agent.hold";
/// An environment's readiness conditions, readiness or answered verify nonce changed.
pub const ENVIRONMENT_READINESS: &str = "environment.readiness";

/// The `Last-Event-ID` request header of SSE, lowercase as HTTP/2 sends it.
pub const LAST_EVENT_ID_HEADER: &str = "last-event-id";

/// `GET /api/v1/events?task=&agent=&deployment=&environment=&after=&follow=`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EventQuery {
    /// Only this task's events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<TaskId>,
    /// Only this agent's events and its tasks'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent: Option<AgentId>,
    /// Only this deployment's events (its state and its targets').
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment: Option<DeploymentId>,
    /// Only this environment's events (its deployments, their targets, its drift).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<EnvironmentId>,
    /// Events after this sequence number; the `Last-Event-ID` header wins when both are sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<u64>,
    /// The same as `after`, named as SSE names it, for clients that cannot set headers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_event_id: Option<u64>,
    /// `false`: send the events stored so far and end the response; default `true`: keep the
    /// stream open and send each new event as it commits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub follow: Option<bool>,
}

impl EventQuery {
    pub fn path(&self) -> String {
        let task = self.task.map(|t| t.to_string());
        let agent = self.agent.map(|a| a.to_string());
        let deployment = self.deployment.map(|d| d.to_string());
        let environment = self.environment.map(|e| e.to_string());
        let after = self.after.map(|a| a.to_string());
        let last = self.last_event_id.map(|a| a.to_string());
        let follow = self.follow.map(|f| f.to_string());
        with_query(
            "/api/v1/events",
            &[
                ("task", task.as_deref()),
                ("agent", agent.as_deref()),
                ("deployment", deployment.as_deref()),
                ("environment", environment.as_deref()),
                ("after", after.as_deref()),
                ("lastEventId", last.as_deref()),
                ("follow", follow.as_deref()),
            ],
        )
    }
}

/// One message of the stream as SSE frames it, for the OpenAPI document (`text/event-stream`
/// responses are described per message): `data` is an [`EventView`] as JSON.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventMessage {
    /// [`EventView::id`], as text.
    pub id: String,
    /// [`EventView::kind`].
    pub event: String,
    /// An [`EventView`], as JSON.
    pub data: String,
}

/// The `data:` of every event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct EventView {
    /// The SSE `id`: increasing in commit order within one database.
    pub id: u64,
    /// The SSE `event`.
    pub kind: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<TaskId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<AgentId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deployment_id: Option<DeploymentId>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment_id: Option<EnvironmentId>,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    /// Per kind: [`TaskStateEvent`] or [`AgentEvent`].
    pub data: serde_json::Value,
}

/// `task.state`: a task was created or changed state (or attempts, agent, cancellation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TaskStateEvent {
    pub task_id: TaskId,
    pub agent_id: AgentId,
    #[serde(rename = "type")]
    pub task_type: String,
    pub state: TaskState,
    pub attempts: u32,
    pub cancel_requested: bool,
    pub read_back: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
}

/// `agent.*`: registered, status changed (online, degraded, offline), deleted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AgentEvent {
    pub agent_id: AgentId,
    pub name: String,
    /// Absent on `agent.deleted` and `agent.hold`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<crate::agent::AgentStatus>,
    /// On `agent.hold` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cordoned: Option<bool>,
    /// On `agent.hold` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspended: Option<bool>,
}
