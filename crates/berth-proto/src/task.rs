//! The admin task API: create, list, show, cancel and retry tasks. Credentials go in and never
//! come back out.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::url::with_query;
use crate::{AgentId, AssignmentId, Method, Request, TaskId};

/// `POST /api/v1/tasks`, optional header `Idempotency-Key`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateTask {
    /// `health-check`, `inspect`, `read-sticker`, `write-sticker`, `execute-command`,
    /// `docker.run`, `compose.up`, `rollback`, …
    #[serde(rename = "type")]
    pub task_type: String,
    /// The agent to run it. Exactly one of `agentId` and `selector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<AgentId>,
    /// Labels: the task goes to the matching online agent with the fewest open tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<BTreeMap<String, String>>,
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub payload: serde_json::Value,
    /// Secrets for the task; sealed at rest, delivered only to the agent, never shown again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variables: Option<BTreeMap<String, String>>,
    /// Default 300, at most 86400.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u32>,
    /// Higher first among one agent's queued tasks; default 0, within -1000..=1000 (read-backs,
    /// which the server creates, run at `i32::MAX`, above every task a user can create).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
}

/// At most this many credentials per task (`422 TOO_MANY_CREDENTIALS`).
pub const MAX_CREDENTIALS: usize = 64;
/// At most this many bytes in one credential value (`422 TOO_MANY_CREDENTIALS`).
pub const MAX_VALUE_BYTES: usize = 64 * 1024;
/// At most this many variables per task (`422 TOO_MANY_VARIABLES`); as many as labels.
pub const MAX_VARIABLES: usize = 64;
/// The priorities a user may give (`422 PRIORITY_OUT_OF_RANGE`); the server's read-backs use
/// `i32::MAX`, so they always run first.
pub const PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -1000..=1000;

/// Control, bidi-override (U+202A–U+202E, U+2066–U+2069) and zero-width (U+200B–U+200D,
/// U+FEFF) characters: text that displays as something other than what it is.
pub fn is_deceptive_char(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200B}'..='\u{200D}' | '\u{FEFF}')
}

/// Task states (DESIGN "Delivery semantics").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum TaskState {
    Pending,
    Leased,
    Succeeded,
    Failed,
    RetryWait,
    DeadLetter,
    Unknown,
    Cancelled,
    Expired,
}

impl TaskState {
    pub const ALL: [TaskState; 9] = [
        TaskState::Pending,
        TaskState::Leased,
        TaskState::Succeeded,
        TaskState::Failed,
        TaskState::RetryWait,
        TaskState::DeadLetter,
        TaskState::Unknown,
        TaskState::Cancelled,
        TaskState::Expired,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            TaskState::Pending => "pending",
            TaskState::Leased => "leased",
            TaskState::Succeeded => "succeeded",
            TaskState::Failed => "failed",
            TaskState::RetryWait => "retry_wait",
            TaskState::DeadLetter => "dead_letter",
            TaskState::Unknown => "unknown",
            TaskState::Cancelled => "cancelled",
            TaskState::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<TaskState> {
        TaskState::ALL.into_iter().find(|t| t.as_str() == s)
    }

    /// The states the task moves out of on its own, through its agent: queued, delivered, or
    /// waiting for its next retry. What an agent drain waits out.
    pub const IN_FLIGHT: [TaskState; 3] =
        [TaskState::Pending, TaskState::Leased, TaskState::RetryWait];

    /// The state machine's end: no further transition happens without an operator.
    ///
    /// `unknown` is not terminal: a read-back (or an operator) still moves it to `succeeded` or
    /// `failed`, so the server keeps it open. Every state is exactly one of terminal,
    /// [`is_in_flight`](Self::is_in_flight) and `unknown`.
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Succeeded
                | TaskState::Failed
                | TaskState::DeadLetter
                | TaskState::Cancelled
                | TaskState::Expired
        )
    }

    /// The task is still on its way through its agent ([`TaskState::IN_FLIGHT`]): a client
    /// that waits for it (`berth tasks get --wait`) keeps waiting.
    ///
    /// A waiting client stops on every other state and reports it, `unknown` included: an
    /// `unknown` task is not terminal, but only a read-back or an operator moves it on, which
    /// may take as long as the next drift check, so waiting would look like a hang. The same
    /// test tells the drift loop that a read-back task is still open.
    pub const fn is_in_flight(self) -> bool {
        matches!(
            self,
            TaskState::Pending | TaskState::Leased | TaskState::RetryWait
        )
    }
}

impl std::fmt::Display for TaskState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Display for AttemptState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// States of one delivery (an attempt).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum AttemptState {
    Leased,
    Succeeded,
    Failed,
    Cancelled,
    Expired,
}

impl AttemptState {
    pub const ALL: [AttemptState; 5] = [
        AttemptState::Leased,
        AttemptState::Succeeded,
        AttemptState::Failed,
        AttemptState::Cancelled,
        AttemptState::Expired,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            AttemptState::Leased => "leased",
            AttemptState::Succeeded => "succeeded",
            AttemptState::Failed => "failed",
            AttemptState::Cancelled => "cancelled",
            AttemptState::Expired => "expired",
        }
    }

    pub fn parse(s: &str) -> Option<AttemptState> {
        AttemptState::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

impl Request for CreateTask {
    type Response = TaskView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/tasks".into()
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AttemptView {
    pub assignment_id: AssignmentId,
    pub agent_id: AgentId,
    pub state: AttemptState,
    pub generation: i64,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub assigned_at: OffsetDateTime,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub lease_expires_at: OffsetDateTime,
    /// When the agent's start handshake was confirmed: from then on the delivery may have had
    /// effects. Absent for a delivery that never started (or whose agent does not ask).
    #[serde(
        default,
        with = "crate::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub started_at: Option<OffsetDateTime>,
    /// The step the agent last reported (`pulling`, `starting`, `health`), if it reports any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<ProgressPhase>,
    #[serde(
        default,
        with = "crate::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub finished_at: Option<OffsetDateTime>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    /// The verified, signed result envelope exactly as the agent sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub result: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TaskView {
    pub id: TaskId,
    #[serde(rename = "type")]
    pub task_type: String,
    pub state: TaskState,
    pub agent_id: AgentId,
    /// True when the task succeeded by read-back of the target, not by a result.
    pub read_back: bool,
    pub side_effects: bool,
    pub priority: i32,
    pub timeout_seconds: u32,
    pub attempt_count: u32,
    /// Deliveries, oldest first (only in `GET /api/v1/tasks/{id}`).
    #[serde(default)]
    pub attempts: Vec<AttemptView>,
    /// The verified result data of the deciding delivery, or the read-back evidence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    pub cancel_requested: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_back_of: Option<TaskId>,
    #[serde(
        default,
        with = "crate::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub next_attempt_at: Option<OffsetDateTime>,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub updated_at: OffsetDateTime,
    #[serde(
        default,
        with = "crate::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub finished_at: Option<OffsetDateTime>,
}

/// `GET /api/v1/tasks/{id}`.
#[derive(Debug, Clone, Serialize)]
pub struct GetTask {
    #[serde(skip)]
    pub id: TaskId,
}

impl Request for GetTask {
    type Response = TaskView;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        format!("/api/v1/tasks/{}", self.id)
    }
}

/// Which end of a list comes first: ids are UUIDv7, so id order is creation order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum ListOrder {
    /// Oldest first (the default): a cursor walks forward in time.
    #[default]
    Oldest,
    /// Newest first: what a person looking at recent work wants; a cursor walks back in time.
    Newest,
}

/// `GET /api/v1/tasks?state=&agentId=&type=&order=&cursor=&limit=`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListTasks {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<TaskState>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<AgentId>,
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub task_type: Option<String>,
    /// `oldest` (default) or `newest` first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<ListOrder>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TaskList {
    pub items: Vec<TaskView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

impl Request for ListTasks {
    type Response = TaskList;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        let agent_id = self.agent_id.map(|a| a.to_string());
        let limit = self.limit.map(|l| l.to_string());
        with_query(
            "/api/v1/tasks",
            &[
                ("state", self.state.map(TaskState::as_str)),
                ("agentId", agent_id.as_deref()),
                ("type", self.task_type.as_deref()),
                ("cursor", self.cursor.as_deref()),
                ("limit", limit.as_deref()),
            ],
        )
    }
}

/// `POST /api/v1/tasks/{id}/cancel`: pending → cancelled at once; leased → the agent is told.
#[derive(Debug, Clone, Serialize)]
pub struct CancelTask {
    #[serde(skip)]
    pub id: TaskId,
}

impl Request for CancelTask {
    type Response = TaskView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/tasks/{}/cancel", self.id)
    }
}

/// `POST /api/v1/tasks/{id}/retry`: for `unknown` and `dead_letter` tasks.
#[derive(Debug, Clone, Serialize)]
pub struct RetryTask {
    #[serde(skip)]
    pub id: TaskId,
}

impl Request for RetryTask {
    type Response = TaskView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/tasks/{}/retry", self.id)
    }
}

/// What a deploying executor is doing, as it reports it through the start handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ProgressPhase {
    Pulling,
    Starting,
    Health,
}

impl ProgressPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            ProgressPhase::Pulling => "pulling",
            ProgressPhase::Starting => "starting",
            ProgressPhase::Health => "health",
        }
    }

    pub fn parse(s: &str) -> Option<ProgressPhase> {
        [
            ProgressPhase::Pulling,
            ProgressPhase::Starting,
            ProgressPhase::Health,
        ]
        .into_iter()
        .find(|p| p.as_str() == s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every state is exactly one of: in flight, terminal, or `unknown` (open, but moved on only
    /// by a read-back or an operator).
    #[test]
    fn every_task_state_is_in_flight_terminal_or_unknown() {
        for s in TaskState::ALL {
            let kinds = [s.is_in_flight(), s.is_terminal(), s == TaskState::Unknown];
            assert_eq!(kinds.iter().filter(|k| **k).count(), 1, "{s}");
        }
    }

    #[test]
    fn a_waiting_client_stops_on_unknown_which_is_not_terminal() {
        assert!(!TaskState::Unknown.is_terminal());
        assert!(!TaskState::Unknown.is_in_flight());
        for s in [TaskState::Pending, TaskState::Leased, TaskState::RetryWait] {
            assert!(s.is_in_flight(), "{s}");
        }
        for s in [
            TaskState::Succeeded,
            TaskState::Failed,
            TaskState::DeadLetter,
            TaskState::Cancelled,
            TaskState::Expired,
        ] {
            assert!(s.is_terminal() && !s.is_in_flight(), "{s}");
        }
    }

    #[test]
    fn in_flight_lists_exactly_the_in_flight_states() {
        let listed: Vec<TaskState> = TaskState::IN_FLIGHT.to_vec();
        let computed: Vec<TaskState> = TaskState::ALL
            .into_iter()
            .filter(|s| s.is_in_flight())
            .collect();
        assert_eq!(listed, computed);
    }
}
