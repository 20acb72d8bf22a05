//! Agents and their sessions: registration (which consumes a registration token), the
//! certificate binding, heartbeats and staleness, and the session lease that fences a paused
//! or cloned agent process.

use std::collections::BTreeMap;

pub use berth_proto::agent::AgentHold;
use berth_proto::agent::{AgentStatus, Capability, ResourceUsage};
use berth_proto::audit::AuditActor;
use berth_proto::{AgentId, TenantId};
use time::OffsetDateTime;

use crate::{Page, Result};

/// Everything the server decided about a registering agent before it is stored.
#[derive(Debug, Clone)]
pub struct NewAgent {
    pub id: AgentId,
    pub name: String,
    pub version: String,
    pub capabilities: Vec<Capability>,
    /// Labels the agent asked for; the token's labels are merged over them by the store.
    pub labels: BTreeMap<String, String>,
    pub certificate_fingerprint: String,
    pub certificate_expires_at: OffsetDateTime,
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Agent {
    pub id: AgentId,
    pub tenant_id: TenantId,
    pub name: String,
    pub version: String,
    pub capabilities: Vec<Capability>,
    pub labels: BTreeMap<String, String>,
    pub status: AgentStatus,
    /// What the agent last said of itself (`online` or `degraded`); `status` also reflects lateness.
    pub reported_status: AgentStatus,
    pub environment: Option<String>,
    pub last_heartbeat: Option<OffsetDateTime>,
    pub resource_usage: Option<ResourceUsage>,
    pub certificate_fingerprint: Option<String>,
    pub certificate_expires_at: Option<OffsetDateTime>,
    /// The certificate the last renewal replaced: refused like any unbound one, but named
    /// `CERTIFICATE_SUPERSEDED` so the agent resends what was in flight on it.
    pub previous_certificate_fingerprint: Option<String>,
    /// No new work is routed to it: creates naming it are refused (`AGENT_CORDONED`), the
    /// server's selectors and deployments leave it out. Its queued tasks still run.
    pub cordoned: bool,
    /// It claims nothing new ([`crate::TaskStore::claim_task`] answers `Empty`); shown as
    /// `blocked`. Its session and heartbeats go on, so it can be resumed without a restart.
    pub suspended: bool,
    /// The session generation last granted (0: never had a session); a request with another
    /// is fenced.
    pub generation: i64,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterError {
    /// Unknown, expired or already used token. One answer for all three, on purpose.
    TokenInvalid,
    /// Another agent of the tenant has this name; the token is not consumed.
    NameTaken,
}

#[derive(Debug, Clone, Default)]
pub struct AgentFilter {
    /// `Blocked` matches the suspended agents; any other status matches the agents that are not
    /// suspended and hold it (a suspended agent is shown as `blocked`, whatever its liveness).
    pub status: Option<AgentStatus>,
    /// An agent matches when it has a capability of this name.
    pub capability: Option<String>,
    /// An agent matches when it has this label with this value.
    pub label: Option<(String, String)>,
}

#[derive(Debug, Clone)]
pub struct AgentUpdate {
    pub labels: Option<BTreeMap<String, String>>,
    pub capabilities: Option<Vec<Capability>>,
    /// Who asked: an `agent.update` entry is appended in the update's transaction.
    pub updated_by: Option<AuditActor>,
}

/// What a hold changes: its column, the value it sets, and its audit action. The column is one
/// of two fixed names, never input.
pub(crate) fn hold_change(hold: AgentHold) -> (&'static str, bool, &'static str) {
    use berth_proto::audit::actions::{AGENT_CORDON, AGENT_RESUME, AGENT_SUSPEND, AGENT_UNCORDON};
    match hold {
        AgentHold::Cordon => ("cordoned", true, AGENT_CORDON),
        AgentHold::Uncordon => ("cordoned", false, AGENT_UNCORDON),
        AgentHold::Suspend => ("suspended", true, AGENT_SUSPEND),
        AgentHold::Resume => ("suspended", false, AGENT_RESUME),
    }
}

/// One heartbeat, applied with others in a single transaction (group commit).
#[derive(Debug, Clone)]
pub struct HeartbeatRecord {
    pub agent_id: AgentId,
    /// The certificate the heartbeat came with; it applies only while this is still the binding.
    pub certificate_fingerprint: String,
    /// The session generation the agent holds (`X-Berth-Generation`); a stale one is fenced.
    pub generation: i64,
    /// The signed heartbeat's sequence (0..=i64::MAX). Within `generation` it must be above the
    /// last one applied, else the heartbeat is `Replayed`; a new generation starts afresh.
    pub sequence: i64,
    /// The renewed session lease: `session_expires_at` is set to this.
    pub session_expires_at: OffsetDateTime,
    pub reported_status: AgentStatus,
    pub resource_usage: ResourceUsage,
    pub capabilities: Vec<Capability>,
    pub at: OffsetDateTime,
}

/// How many agents a staleness sweep moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StaleSweep {
    pub degraded: u64,
    pub offline: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RebindOutcome {
    Rebound,
    /// `generation` is not the agent's current one.
    Fenced,
    /// The agent is gone or `old_fingerprint` is not its binding.
    Revoked,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeartbeatOutcome {
    Applied,
    Fenced,
    Revoked,
    /// Bound and current, but `sequence` is not above the last one applied in this generation.
    Replayed,
}

/// The session lease of an agent process (seed 003 fencing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SessionOutcome {
    /// Acquired: `generation` was incremented and is now the only one accepted.
    Acquired {
        generation: i64,
        lease_expires_at: OffsetDateTime,
    },
    /// Another live instance holds the lease.
    Held {
        holder_instance: String,
        lease_expires_at: OffsetDateTime,
    },
    /// The agent is gone or the certificate is not its binding.
    Revoked,
}

/// Agents, their certificate binding, heartbeats and session leases. Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait AgentStore: Send + Sync {
    /// Atomically consumes the registration token (unused, not expired at `now`) and inserts the
    /// agent into the token's tenant with its labels (token labels win) and environment.
    /// Exactly one of any number of concurrent calls with one token succeeds.
    async fn register_agent(
        &self,
        token_hash: &str,
        agent: NewAgent,
        now: OffsetDateTime,
    ) -> Result<std::result::Result<Agent, RegisterError>>;

    async fn get_agent(&self, tenant: TenantId, id: AgentId) -> Result<Option<Agent>>;
    /// Looks an agent up by id alone: only for agent-runtime routes, which then prove the
    /// caller's identity by certificate binding.
    async fn get_agent_for_runtime(&self, id: AgentId) -> Result<Option<Agent>>;
    /// Ordered by id; `after` is the previous page's `next`. `limit` is at least 1.
    async fn list_agents(
        &self,
        tenant: TenantId,
        filter: &AgentFilter,
        after: Option<AgentId>,
        limit: u32,
    ) -> Result<Page<Agent>>;
    async fn update_agent(
        &self,
        tenant: TenantId,
        id: AgentId,
        update: AgentUpdate,
        now: OffsetDateTime,
    ) -> Result<Option<Agent>>;
    /// True when the agent existed. Its certificate binding goes with it. In the same
    /// transaction its `pending`/`retry_wait` tasks become `expired` (`AGENT_DELETED`), and its
    /// `leased` ones `unknown` if they have side effects, else `expired` (attempts `expired`),
    /// and an `agent.delete` entry by `actor` is appended.
    /// Sets or lifts an operator hold (`cordoned` or `suspended`) on the tenant's agent and
    /// appends the hold's audit entry (`agent.cordon`, …) by `actor` in the same transaction,
    /// when it changed anything; the `agent.hold` event comes with the change. None: no such
    /// agent.
    async fn set_agent_hold(
        &self,
        tenant: TenantId,
        id: AgentId,
        hold: AgentHold,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<Agent>>;

    async fn delete_agent(
        &self,
        tenant: TenantId,
        id: AgentId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<bool>;

    /// Replaces the certificate binding only while `old_fingerprint` is still bound and
    /// `generation` is the agent's current session generation, checked in the same transaction:
    /// a fenced process (a refused clone holding a copied key) cannot rotate the binding and so
    /// lock out the live one. `old_fingerprint` becomes `previous_certificate_fingerprint`.
    async fn rebind_certificate(
        &self,
        id: AgentId,
        generation: i64,
        old_fingerprint: &str,
        new_fingerprint: &str,
        new_expires_at: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<RebindOutcome>;

    /// Applies a batch of heartbeats in one transaction. Per record: `Revoked` when the agent is
    /// gone or the certificate is no longer its binding, `Fenced` when `generation` is not the
    /// agent's current generation, else `Applied`: sets `status` and `reported_status` to the
    /// reported status, `last_heartbeat` to `at`, and renews `session_expires_at`. `Replayed`
    /// when `sequence` is not above the last applied in the same generation. The sequence is a
    /// condition of the update itself, so of two concurrent heartbeats with one sequence exactly
    /// one applies, and a refused one changes nothing.
    async fn record_heartbeats(&self, batch: &[HeartbeatRecord]) -> Result<Vec<HeartbeatOutcome>>;

    /// Marks agents whose last heartbeat is older than `offline_before` (or never came and were
    /// created before it) `offline`, and online agents older than `degraded_before` `degraded`.
    async fn sweep_stale_agents(
        &self,
        degraded_before: OffsetDateTime,
        offline_before: OffsetDateTime,
    ) -> Result<StaleSweep>;

    // --- sessions (fencing) ---

    /// Acquires the agent's session lease for `instance_id` when it is free, expired at `now`,
    /// already held by `instance_id`, or held by a process whose `restart_key` equals this
    /// `restart_key` (a restart of the same installation on the same boot: the contender holds
    /// the lock the holder held until it died). Acquiring increments `generation`, records
    /// `restart_key` (None: nothing proven) and clears the degraded mark. Checks the certificate
    /// binding in the same transaction.
    async fn acquire_session(
        &self,
        agent: AgentId,
        certificate_fingerprint: &str,
        instance_id: &str,
        restart_key: Option<&str>,
        now: OffsetDateTime,
        lease_expires_at: OffsetDateTime,
    ) -> Result<SessionOutcome>;

    /// Ends the lease early (graceful stop) when `generation` is still current. True if released.
    async fn release_session(
        &self,
        agent: AgentId,
        generation: i64,
        now: OffsetDateTime,
    ) -> Result<bool>;

    /// Marks the agent `degraded` because a second live process claims its identity, and keeps
    /// it so until `until`: heartbeats before then record what the agent reports but leave the
    /// status `degraded`. A new session acquisition (a takeover) clears the mark.
    async fn mark_agent_degraded(&self, agent: AgentId, until: OffsetDateTime) -> Result<()>;

    /// Records `version` as the agent's version when `generation` is its current session: what
    /// the process that acquired it says it runs, so an agent upgraded in place shows its new
    /// version (the registered one stays for agents that do not say). True if it changed (a
    /// reconnect naming the same version writes nothing); a reported version is not an edit, so
    /// `updated_at` stays.
    async fn record_agent_version(
        &self,
        agent: AgentId,
        generation: i64,
        version: &str,
    ) -> Result<bool>;
}
