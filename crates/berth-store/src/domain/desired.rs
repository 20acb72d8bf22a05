//! Desired-state environments (seed 001): the bundles pushed to an environment (content
//! addressed, never replaced), the sha it should run, whether it is retired, and what each of
//! its agents last said at checkin and report.
//!
//! The store keeps rows and makes each audited write one transaction with its audit entry.
//! Which action an agent is told (apply, none, down) is the server's decision
//! (`berth-server/src/routes/desired.rs`), from the rows read here.

use std::collections::BTreeMap;

use berth_proto::audit::{actions, AuditActor};
use berth_proto::desired::{ContainerState, HostFacts, ReportResult};
use berth_proto::{EnvironmentId, TenantId};
use time::OffsetDateTime;

use crate::rows::ColumnReader;
use crate::{NewAuditEvent, Result, StoreError};

/// An environment as the desired-state loop sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredEnvironment {
    pub id: EnvironmentId,
    pub tenant_id: TenantId,
    pub name: String,
    pub selector: BTreeMap<String, String>,
    pub desired_sha: Option<String>,
    pub retired: bool,
    pub purge_volumes: bool,
    pub checkin_interval_secs: u64,
}

/// A stored bundle's metadata (its content is read only by [`DesiredStore::get_bundle`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bundle {
    pub environment_id: EnvironmentId,
    pub sha: String,
    pub size_bytes: u64,
    pub created_at: OffsetDateTime,
    pub created_by: AuditActor,
}

#[derive(Debug, Clone)]
pub struct NewBundle {
    pub tenant_id: TenantId,
    pub environment_id: EnvironmentId,
    /// The seed's sha of the tar's members, computed by the server.
    pub sha: String,
    pub content: Vec<u8>,
    pub created_at: OffsetDateTime,
    pub created_by: AuditActor,
}

/// What [`DesiredStore::set_desired`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SetDesiredOutcome {
    Set(DesiredEnvironment),
    NoSuchEnvironment,
    /// No bundle of that sha was pushed to the environment; nothing written.
    BundleNotFound,
}

/// One agent's row: `agent:<uuid>` (mTLS) or `token:<env>` (an OpenBao bearer token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredAgent {
    pub environment_id: EnvironmentId,
    pub agent_key: String,
    pub applied_sha: Option<String>,
    pub last_result: Option<ReportResult>,
    pub detail: Option<String>,
    pub host: HostFacts,
    pub containers: Vec<ContainerState>,
    pub log_tail: Option<String>,
    pub last_checkin_at: Option<OffsetDateTime>,
    pub last_report_at: Option<OffsetDateTime>,
}

#[derive(Debug, Clone)]
pub struct CheckinRecord {
    pub environment_id: EnvironmentId,
    pub agent_key: String,
    pub applied_sha: Option<String>,
    pub host: HostFacts,
    pub containers: Vec<ContainerState>,
    pub at: OffsetDateTime,
}

/// A report, already cut and redacted by the server; `audit` is written in the same
/// transaction (`desired.report`).
#[derive(Debug, Clone)]
pub struct ReportRecord {
    pub tenant_id: TenantId,
    pub environment_id: EnvironmentId,
    pub agent_key: String,
    pub sha: Option<String>,
    pub result: ReportResult,
    pub detail: Option<String>,
    pub log_tail: String,
    pub containers: Vec<ContainerState>,
    pub actor: AuditActor,
    /// The first `AUDIT_LOG_TAIL_BYTES` of `log_tail`.
    pub audit_log_tail: String,
    pub at: OffsetDateTime,
}

impl ReportRecord {
    /// The applied sha after this report: `applied` sets it, `down` clears it, `failed` keeps
    /// `previous`.
    pub fn applied_sha(&self, previous: Option<String>) -> Option<String> {
        match self.result {
            ReportResult::Applied => self.sha.clone(),
            ReportResult::Failed => previous,
            ReportResult::Down => None,
        }
    }

    pub(crate) fn audit_event(&self) -> NewAuditEvent {
        NewAuditEvent {
            tenant_id: self.tenant_id,
            actor: self.actor.clone(),
            action: actions::DESIRED_REPORT,
            subject: self.environment_id.to_string(),
            details: serde_json::json!({
                "agent": self.agent_key,
                "result": self.result.as_str(),
                "sha": self.sha,
                "detail": self.detail,
                "logTail": self.audit_log_tail,
            }),
            at: self.at,
        }
    }
}

pub(crate) fn set_desired_event(
    env: &DesiredEnvironment,
    actor: AuditActor,
    at: OffsetDateTime,
) -> NewAuditEvent {
    NewAuditEvent {
        tenant_id: env.tenant_id,
        actor,
        action: actions::ENVIRONMENT_SET_DESIRED,
        subject: env.id.to_string(),
        details: serde_json::json!({"name": env.name, "sha": env.desired_sha}),
        at,
    }
}

pub(crate) fn retire_event(
    env: &DesiredEnvironment,
    actor: AuditActor,
    at: OffsetDateTime,
) -> NewAuditEvent {
    NewAuditEvent {
        tenant_id: env.tenant_id,
        actor,
        action: actions::ENVIRONMENT_RETIRE,
        subject: env.id.to_string(),
        details: serde_json::json!({"name": env.name, "purgeVolumes": env.purge_volumes}),
        at,
    }
}

fn corrupt(column: &str, e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(format!("{column}: {e}"))
}

/// The columns [`read_desired_environment`] reads, from `environments`.
macro_rules! desired_environment_columns {
    () => {
        "id, tenant_id, name, selector, desired_sha, retired, purge_volumes, checkin_interval_secs"
    };
}
pub(crate) use desired_environment_columns;

pub(crate) fn read_desired_environment(row: &impl ColumnReader) -> Result<DesiredEnvironment> {
    Ok(DesiredEnvironment {
        id: EnvironmentId(row.uuid("id")?),
        tenant_id: TenantId(row.uuid("tenant_id")?),
        name: row.text("name")?,
        selector: serde_json::from_value(row.json("selector")?)
            .map_err(|e| corrupt("environments.selector", e))?,
        desired_sha: row.text_opt("desired_sha")?,
        retired: row.flag("retired")?,
        purge_volumes: row.flag("purge_volumes")?,
        checkin_interval_secs: u64::try_from(row.int("checkin_interval_secs")?)
            .map_err(|e| corrupt("environments.checkin_interval_secs", e))?,
    })
}

macro_rules! bundle_columns {
    () => {
        "environment_id, sha, size, created_at, created_by"
    };
}
pub(crate) use bundle_columns;

pub(crate) fn read_bundle(row: &impl ColumnReader) -> Result<Bundle> {
    Ok(Bundle {
        environment_id: EnvironmentId(row.uuid("environment_id")?),
        sha: row.text("sha")?,
        size_bytes: u64::try_from(row.int("size")?).map_err(|e| corrupt("bundles.size", e))?,
        created_at: row.time("created_at")?,
        created_by: serde_json::from_value(row.json("created_by")?)
            .map_err(|e| corrupt("bundles.created_by", e))?,
    })
}

macro_rules! desired_agent_columns {
    () => {
        "environment_id, agent_key, applied_sha, last_result, detail, host, containers, \
         log_tail, last_checkin_at, last_report_at"
    };
}
pub(crate) use desired_agent_columns;

pub(crate) fn read_desired_agent(row: &impl ColumnReader) -> Result<DesiredAgent> {
    let last_result = row
        .text_opt("last_result")?
        .map(|r| match r.as_str() {
            "applied" => Ok(ReportResult::Applied),
            "failed" => Ok(ReportResult::Failed),
            "down" => Ok(ReportResult::Down),
            other => Err(corrupt("desired_agents.last_result", other)),
        })
        .transpose()?;
    Ok(DesiredAgent {
        environment_id: EnvironmentId(row.uuid("environment_id")?),
        agent_key: row.text("agent_key")?,
        applied_sha: row.text_opt("applied_sha")?,
        last_result,
        detail: row.text_opt("detail")?,
        host: serde_json::from_value(row.json("host")?)
            .map_err(|e| corrupt("desired_agents.host", e))?,
        containers: serde_json::from_value(row.json("containers")?)
            .map_err(|e| corrupt("desired_agents.containers", e))?,
        log_tail: row.text_opt("log_tail")?,
        last_checkin_at: row.time_opt("last_checkin_at")?,
        last_report_at: row.time_opt("last_report_at")?,
    })
}

/// Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait DesiredStore: Send + Sync {
    /// The tenant's environment of that name; another tenant's is `None`.
    async fn desired_environment(
        &self,
        tenant: TenantId,
        name: &str,
    ) -> Result<Option<DesiredEnvironment>>;
    /// Stores the bundle unless (environment, sha) exists: then the stored one stays, untouched.
    /// The bundle as stored, and whether this call created it.
    async fn put_bundle(&self, bundle: NewBundle) -> Result<(Bundle, bool)>;
    /// The content of the environment's bundle of that sha.
    async fn get_bundle(&self, environment: EnvironmentId, sha: &str) -> Result<Option<Vec<u8>>>;
    /// The environment's bundles, newest first.
    async fn list_bundles(&self, environment: EnvironmentId) -> Result<Vec<Bundle>>;
    /// Points the environment at a pushed bundle, with an `environment.set_desired` audit
    /// entry in the same transaction.
    async fn set_desired(
        &self,
        tenant: TenantId,
        name: &str,
        sha: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<SetDesiredOutcome>;
    /// Marks the environment retired (checkins answer `down`), with an `environment.retire`
    /// audit entry. `None`: no such environment.
    async fn retire_environment(
        &self,
        tenant: TenantId,
        name: &str,
        purge_volumes: bool,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<DesiredEnvironment>>;
    /// Inserts or updates the agent's row: host, containers, applied sha, checkin time.
    async fn record_checkin(&self, checkin: CheckinRecord) -> Result<()>;
    /// Inserts or updates the agent's row from a report, and appends its audit entry, in one
    /// transaction. The row as it is now.
    async fn record_report(&self, report: ReportRecord) -> Result<DesiredAgent>;
    /// The environment's agents, by key.
    async fn desired_agents(&self, environment: EnvironmentId) -> Result<Vec<DesiredAgent>>;
}
