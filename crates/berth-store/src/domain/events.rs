//! The event stream: what changed, in commit order, per tenant. Events are rows written by
//! database triggers on the rows they describe (migration 0011), so every state change writes
//! its event in its own transaction, whichever operation made it; this domain only reads them
//! (and retention deletes old ones).

use berth_proto::{AgentId, DeploymentId, EnvironmentId, TaskId, TenantId};
use time::OffsetDateTime;

use crate::Result;

#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// Commit-ordered per database: once a reader sees `id`, every lower id is visible too.
    pub id: i64,
    pub tenant_id: TenantId,
    /// `task.state`, `agent.registered`, `agent.status`, `agent.deleted`, `deployment.state`,
    /// `deployment.target`, `deployment.approval` (migration 0019), `environment.drift`.
    pub kind: String,
    pub task_id: Option<TaskId>,
    pub agent_id: Option<AgentId>,
    pub deployment_id: Option<DeploymentId>,
    pub environment_id: Option<EnvironmentId>,
    pub data: serde_json::Value,
    pub created_at: OffsetDateTime,
}

/// Narrows a tenant's events; every field set must match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventFilter {
    pub task: Option<TaskId>,
    /// The agent's own events and those of its tasks.
    pub agent: Option<AgentId>,
    pub deployment: Option<DeploymentId>,
    /// The environment's deployments, their targets, and its drift.
    pub environment: Option<EnvironmentId>,
}

/// Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait EventStore: Send + Sync {
    /// The tenant's events with an id above `after`, in id order, at most `limit`.
    async fn read_events(
        &self,
        tenant: TenantId,
        filter: &EventFilter,
        after: i64,
        limit: u32,
    ) -> Result<Vec<Event>>;

    /// The id of the tenant's newest visible event (0 without any): a cursor taken before a
    /// page reads its data, so a reader resuming from it misses no later change.
    async fn latest_event_id(&self, tenant: TenantId) -> Result<i64>;
    /// Retention: deletes at most `limit` of the oldest events created before `before`. A
    /// reader's cursor stays valid (ids are never reused); what it missed is gone. How many.
    async fn prune_events(&self, before: OffsetDateTime, limit: u32) -> Result<u64>;

    /// Changes after a commit that may have written events — in this process and, on
    /// PostgreSQL, in every replica (LISTEN/NOTIFY on `berth_events`). Only a wake-up: readers
    /// read again after their cursor. A change may carry no new event for a given reader.
    fn events_written(&self) -> tokio::sync::watch::Receiver<u64>;
}
