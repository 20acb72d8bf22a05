//! Persistence for berth: one [`Store`] trait, two backends (SQLite, the embedded default, and
//! PostgreSQL for several replicas), their migrations, and one conformance suite both must pass.
//!
//! Invariants: every query about tenant-owned objects is scoped by tenant; uniqueness and
//! single-use are enforced by database constraints and conditional updates, never by a
//! read-then-write in the application. This crate knows nothing about HTTP or TLS.

use std::collections::BTreeMap;
use std::sync::Arc;

use berth_proto::admin::Role;
use berth_proto::agent::{AgentStatus, Capability, ResourceUsage};
use berth_proto::{AgentId, TenantId, TokenId};
use time::OffsetDateTime;

pub mod conformance;
mod postgres;
mod rows;
mod sqlite;

pub use postgres::PostgresStore;
pub use sqlite::SqliteStore;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A unique constraint refused the write; `constraint` names what collided: `tenant_id`,
    /// `tenant_name`, `api_token_id`, `api_token_hash`, `registration_token_id`,
    /// `registration_token_hash`, `agent_id`, `agent_name` or `agent_certificate`.
    #[error("conflict on {constraint}")]
    Conflict { constraint: &'static str },
    #[error("database error during {operation}")]
    Database {
        operation: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("migration failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    #[error("stored row is corrupt: {0}")]
    Corrupt(String),
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiToken {
    pub id: TokenId,
    pub tenant_id: TenantId,
    pub name: String,
    pub role: Role,
    /// The bootstrap admin token of the `default` tenant: the only one that may create tenants.
    pub operator: bool,
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone)]
pub struct NewApiToken {
    pub id: TokenId,
    pub tenant_id: TenantId,
    pub name: String,
    pub role: Role,
    pub operator: bool,
    /// SHA-256 of the secret, hex. The secret itself is never stored.
    pub token_hash: String,
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone)]
pub struct NewRegistrationToken {
    pub id: TokenId,
    pub tenant_id: TenantId,
    pub token_hash: String,
    pub labels: BTreeMap<String, String>,
    pub environment: Option<String>,
    pub expires_at: OffsetDateTime,
    pub created_at: OffsetDateTime,
}

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
    pub status: Option<AgentStatus>,
    /// An agent matches when it has a capability of this name.
    pub capability: Option<String>,
    /// An agent matches when it has this label with this value.
    pub label: Option<(String, String)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// The last id of this page when more may follow; pass it back as `after`.
    pub next: Option<AgentId>,
}

#[derive(Debug, Clone)]
pub struct AgentUpdate {
    pub labels: Option<BTreeMap<String, String>>,
    pub capabilities: Option<Vec<Capability>>,
}

/// One heartbeat, applied with others in a single transaction (group commit).
#[derive(Debug, Clone)]
pub struct HeartbeatRecord {
    pub agent_id: AgentId,
    /// The certificate the heartbeat came with; it applies only while this is still the binding.
    pub certificate_fingerprint: String,
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

#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Backend name for logs and metrics: `sqlite` or `postgres`.
    fn backend(&self) -> &'static str;

    /// Succeeds when the database answers a trivial query (`/readyz`).
    async fn ping(&self) -> Result<()>;

    // --- tenants ---

    /// Creates the tenant or returns the existing one with that name (bootstrap).
    async fn ensure_tenant(&self, name: &str, now: OffsetDateTime) -> Result<Tenant>;
    /// `Conflict { constraint: "tenant_name" }` when the name exists.
    async fn create_tenant(&self, id: TenantId, name: &str, now: OffsetDateTime) -> Result<Tenant>;
    async fn get_tenant(&self, id: TenantId) -> Result<Option<Tenant>>;

    // --- API tokens ---

    /// `Conflict { constraint: "api_token_hash" }` on a duplicate hash.
    async fn create_api_token(&self, token: NewApiToken) -> Result<ApiToken>;
    async fn api_token_by_hash(&self, token_hash: &str) -> Result<Option<ApiToken>>;
    /// Whether the tenant already has an operator token (bootstrap runs once).
    async fn has_operator_token(&self, tenant: TenantId) -> Result<bool>;

    // --- registration tokens and agents ---

    async fn create_registration_token(&self, token: NewRegistrationToken) -> Result<()>;

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
    /// True when the agent existed. Its certificate binding goes with it.
    async fn delete_agent(&self, tenant: TenantId, id: AgentId) -> Result<bool>;

    /// Replaces the certificate binding only while `old_fingerprint` is still bound.
    async fn rebind_certificate(
        &self,
        id: AgentId,
        old_fingerprint: &str,
        new_fingerprint: &str,
        new_expires_at: OffsetDateTime,
        now: OffsetDateTime,
    ) -> Result<bool>;

    /// Applies a batch of heartbeats in one transaction. Returns, per record, whether it applied
    /// (false: the agent is gone or the certificate is no longer its binding). Sets `status` to
    /// the reported status and `last_heartbeat` to `at`.
    async fn record_heartbeats(&self, batch: &[HeartbeatRecord]) -> Result<Vec<bool>>;

    /// Marks agents whose last heartbeat is older than `offline_before` (or never came and were
    /// created before it) `offline`, and online agents older than `degraded_before` `degraded`.
    async fn sweep_stale_agents(
        &self,
        degraded_before: OffsetDateTime,
        offline_before: OffsetDateTime,
    ) -> Result<StaleSweep>;
}

pub type DynStore = Arc<dyn Store>;

/// Opens a store from `--database`: a `postgres://` / `postgresql://` URL, or a SQLite file path
/// (`sqlite://` prefix optional). Runs the migrations.
pub async fn open(database: &str) -> Result<DynStore> {
    if database.starts_with("postgres://") || database.starts_with("postgresql://") {
        Ok(Arc::new(PostgresStore::connect(database).await?))
    } else {
        let path = database.strip_prefix("sqlite://").unwrap_or(database);
        Ok(Arc::new(
            SqliteStore::open(std::path::Path::new(path)).await?,
        ))
    }
}
