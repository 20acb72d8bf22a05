//! Persistence for berth: one [`Store`] trait, two backends (SQLite, the embedded default, and
//! PostgreSQL for several replicas), their migrations, and one conformance suite both must pass.
//!
//! Invariants: every query about tenant-owned objects is scoped by tenant; uniqueness and
//! single-use are enforced by database constraints and conditional updates, never by a
//! read-then-write in the application. This crate knows nothing about HTTP or TLS.

use std::sync::Arc;

#[cfg(feature = "conformance")]
pub mod conformance;
mod domain;
mod lifecycle;
mod pool;
mod postgres;
mod rows;
mod sealed;
mod sqlite;

pub use domain::agents::*;
pub use domain::audit::{AuditStore, NewAuditEvent};
pub use domain::claims::ClaimStore;
pub use domain::deployments::*;
pub use domain::desired::{
    Bundle, CheckinRecord, DesiredAgent, DesiredEnvironment, DesiredStore, NewBundle, ReportRecord,
    SetDesiredOutcome,
};
pub use domain::events::*;
pub use domain::notify::*;
pub use domain::readiness::*;
pub use domain::releases::*;
pub use domain::secrets::*;
pub use domain::ssh_targets::*;
pub use domain::tasks::*;
pub use domain::tenants::*;
pub use pool::{BatchStats, PoolStats, PostgresPoolConfig, ACQUIRE_WAIT_BOUNDS};
pub use postgres::{PostgresStore, TaskBatchStats};
pub use sealed::PayloadKey;
pub use sqlite::SqliteStore;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A unique constraint refused the write; `constraint` names what collided: `tenant_id`,
    /// `tenant_name`, `api_token_id`, `api_token_hash`, `registration_token_id`,
    /// `registration_token_hash`, `agent_id`, `agent_name`, `agent_certificate`, `task_id`,
    /// `assignment_id`, `release_id`, `release_name`, `environment_id`, `environment_name`,
    /// `deployment_id`, `deployment_target`, `deployment_in_progress` (the environment has a
    /// pending, awaiting or running deployment), `task_agent` (a task for an agent that is not,
    /// or no longer, the tenant's), `approval_token` (an approval by other than an API token), `secret_version` (a concurrent put
    /// took that version), `grant_jti`, `ssh_target_name` or `webhook_name`.
    #[error("conflict on {constraint}")]
    Conflict { constraint: &'static str },
    #[error("database error during {operation}")]
    Database {
        operation: &'static str,
        #[source]
        source: sqlx::Error,
    },
    /// The database did not answer in time: a statement ran past the pool's
    /// `statement_timeout` (SQLSTATE 57014, PostgreSQL cancelled it and rolled its transaction
    /// back), or no pooled connection came free within its `acquire_timeout`
    /// ([`PostgresPoolConfig`]). Nothing is wrong with the request: the same one may succeed
    /// once the database or the pool is less busy, so the server answers it as retriable.
    #[error("the database timed out during {operation}")]
    Timeout {
        operation: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("database error during {operation}")]
    Sqlite {
        operation: &'static str,
        /// Shared: when a batch's commit fails, every operation in it reports the same error.
        #[source]
        source: Arc<rusqlite::Error>,
    },
    /// A SQLite connection's thread or a PostgreSQL batch worker is gone, or the operation
    /// panicked on it.
    #[error("the database worker stopped during {operation}")]
    ThreadStopped { operation: &'static str },
    #[error("migration failed")]
    Migrate(#[source] sqlx::migrate::MigrateError),
    /// The database holds a migration newer than any this build knows: a newer berth wrote it.
    /// Nothing is changed; running on would misread rows of a schema it has never seen.
    #[error(
        "the database is at schema version {found}, newer than this berth knows (up to {known}): \
         it was upgraded by a newer berth. Run that version, or restore a backup taken before \
         the upgrade"
    )]
    SchemaFromTheFuture { found: i64, known: i64 },
    #[error("stored row is corrupt: {0}")]
    Corrupt(String),
}

/// Runs `migrator` on `pool`'s database. A database that has applied a migration newer than
/// every one this build carries is [`StoreError::SchemaFromTheFuture`], found before anything
/// runs (sqlx checks what was applied against what it knows first).
pub(crate) async fn migrate<'a, A>(migrator: &sqlx::migrate::Migrator, pool: A) -> Result<()>
where
    A: sqlx::Acquire<'a>,
    <A::Connection as std::ops::Deref>::Target: sqlx::migrate::Migrate,
{
    let known = migrator.iter().map(|m| m.version).max().unwrap_or(0);
    migrator.run(pool).await.map_err(|e| match e {
        sqlx::migrate::MigrateError::VersionMissing(found) if found > known => {
            StoreError::SchemaFromTheFuture { found, known }
        }
        e => StoreError::Migrate(e),
    })
}

pub type Result<T, E = StoreError> = std::result::Result<T, E>;
#[derive(Debug, Clone, PartialEq)]
pub struct Page<T> {
    pub items: Vec<T>,
    /// The last id of this page when more may follow; pass it back as `after`.
    pub next: Option<uuid::Uuid>,
}

/// A whole backend: every domain's operations (one supertrait per domain), plus what belongs
/// to none of them. Through [`DynStore`] every domain's methods are callable as they are: a
/// trait object carries its supertraits' methods, so callers import no domain trait. Code that
/// calls them on a concrete backend (`SqliteStore`) imports the domain trait it uses.
#[async_trait::async_trait]
pub trait Store:
    TenantStore
    + AgentStore
    + TaskStore
    + ReleaseStore
    + AuditStore
    + EventStore
    + DeploymentStore
    + DesiredStore
    + SecretStore
    + GrantStore
    + SshTargetStore
    + ArtifactStore
    + NotifyStore
    + ReadinessStore
    + ClaimStore
    + Send
    + Sync
    + 'static
{
    /// Backend name for logs and metrics: `sqlite` or `postgres`.
    fn backend(&self) -> &'static str;

    /// Succeeds when the database answers a trivial query (`/readyz`).
    async fn ping(&self) -> Result<()>;

    /// The connection pool's state and acquire waits, for `/metrics`; `None` for a backend
    /// without a pool (SQLite owns a fixed set of connection threads, nothing waits on a pool).
    fn pool_stats(&self) -> Option<PoolStats>;
}

pub type DynStore = Arc<dyn Store>;

/// What a `--database` value names: a `postgres://` / `postgresql://` URL, or a SQLite file
/// path (`sqlite://` prefix optional). Every reader of the option asks this.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Database<'a> {
    Postgres(&'a str),
    Sqlite(&'a std::path::Path),
}

impl<'a> Database<'a> {
    pub fn parse(database: &'a str) -> Database<'a> {
        if database.starts_with("postgres://") || database.starts_with("postgresql://") {
            Database::Postgres(database)
        } else {
            let path = database.strip_prefix("sqlite://").unwrap_or(database);
            Database::Sqlite(std::path::Path::new(path))
        }
    }
}

/// Opens a store from `--database` ([`Database`]). Runs the migrations. Task payloads are sealed
/// at rest with `payload_key` (the server's master key). A PostgreSQL pool gets the default
/// bounds.
pub async fn open(database: &str, payload_key: PayloadKey) -> Result<DynStore> {
    open_with(database, payload_key, PostgresPoolConfig::default()).await
}

/// [`open`], a PostgreSQL pool bounded by `pool` (SQLite ignores it).
pub async fn open_with(
    database: &str,
    payload_key: PayloadKey,
    pool: PostgresPoolConfig,
) -> Result<DynStore> {
    Ok(match Database::parse(database) {
        Database::Postgres(url) => {
            Arc::new(PostgresStore::connect_with(url, payload_key, pool).await?)
        }
        Database::Sqlite(path) => Arc::new(SqliteStore::open(path, payload_key).await?),
    })
}
