//! Environments and deployments (`DESIGN.md`, "Releases, environments, deployments").
//!
//! An environment names its targets by agent labels and says how to roll out to them. A
//! deployment takes one release into one environment: one task per component per target, in
//! waves of `maxParallel` targets. Its state is aggregated from the tasks' verified results and
//! read-backs only; a target whose task is `unknown` holds it in `running`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::audit::AuditActor;
use crate::{AgentId, DeploymentId, EnvironmentId, Method, Request, TaskId};

/// Environment names follow the release name rules: one URL path segment as they are.
pub use crate::names::valid_release_name as valid_environment_name;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    Dev,
    Qa,
    Prod,
}

impl Tier {
    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Dev => "dev",
            Tier::Qa => "qa",
            Tier::Prod => "prod",
        }
    }

    pub fn parse(s: &str) -> Option<Tier> {
        [Tier::Dev, Tier::Qa, Tier::Prod]
            .into_iter()
            .find(|t| t.as_str() == s)
    }

    /// Approvals a deployment needs when the environment does not say: one for prod.
    pub fn default_approvals(self) -> u32 {
        match self {
            Tier::Prod => 1,
            Tier::Dev | Tier::Qa => 0,
        }
    }
}

/// What an environment's selector picks: agents (their labels; a release's components run
/// there), or SSH targets (their labels; a release's `ssh` part is deployed to each through its
/// via agent).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum TargetType {
    #[default]
    Agents,
    Ssh,
}

impl TargetType {
    pub fn as_str(self) -> &'static str {
        match self {
            TargetType::Agents => "agents",
            TargetType::Ssh => "ssh",
        }
    }

    pub fn parse(s: &str) -> Option<TargetType> {
        [TargetType::Agents, TargetType::Ssh]
            .into_iter()
            .find(|t| t.as_str() == s)
    }
}

/// How a deployment rolls out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RolloutPolicy {
    /// Targets per wave (≥ 1).
    #[serde(default = "one")]
    pub max_parallel: u32,
    /// Start no further wave once a target failed.
    #[serde(default = "yes")]
    pub stop_on_failure: bool,
    /// After a failure, return every target this deployment updated to the environment's
    /// previous successful release.
    #[serde(default = "yes")]
    pub auto_rollback: bool,
    /// Seconds a target has to become healthy; overrides each component's health-check timeout.
    #[serde(default = "sixty")]
    pub health_timeout_secs: u64,
    /// Seconds one target's task may take in all (pull, start, health), like Nomad's
    /// `progress_deadline`; also its delivery lease, so a lost agent is noticed after it.
    #[serde(default = "ten_minutes")]
    pub task_timeout_secs: u64,
    /// A deployment may start only while the environment is `OperationalReady` for its
    /// current generation (`crate::readiness`; else 409 `ENV_NOT_READY`). Default false.
    #[serde(default)]
    pub require_ready: bool,
}

fn ten_minutes() -> u64 {
    600
}

fn one() -> u32 {
    1
}
fn yes() -> bool {
    true
}
fn sixty() -> u64 {
    60
}

impl Default for RolloutPolicy {
    fn default() -> RolloutPolicy {
        RolloutPolicy {
            max_parallel: 1,
            stop_on_failure: true,
            auto_rollback: true,
            health_timeout_secs: 60,
            task_timeout_secs: 600,
            require_ready: false,
        }
    }
}

/// Default seconds between drift read-backs of an environment's targets.
pub const DEFAULT_DRIFT_INTERVAL_SECS: u32 = 300;

/// `POST /api/v1/environments`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateEnvironment {
    pub name: String,
    pub tier: Tier,
    /// Labels a target carries, every one of them (at least one).
    pub selector: BTreeMap<String, String>,
    /// Whether the selector picks agents (default) or SSH targets.
    #[serde(default)]
    pub target_type: TargetType,
    #[serde(default)]
    pub policy: RolloutPolicy,
    /// Promotion rule: a release may be deployed here only once it succeeded in this
    /// environment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promote_from: Option<String>,
    /// Approvals from tokens other than the requester's; default 1 for prod, else 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approvals: Option<u32>,
    /// Redeploy the current release when a target drifted (default false: report only).
    #[serde(default)]
    pub auto_heal: bool,
    /// Seconds between drift read-backs (default 300, at least 1); each target's check is
    /// spread over the period.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift_interval_secs: Option<u32>,
}

impl Request for CreateEnvironment {
    type Response = EnvironmentView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/environments".into()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentView {
    pub id: EnvironmentId,
    pub name: String,
    pub tier: Tier,
    pub selector: BTreeMap<String, String>,
    pub target_type: TargetType,
    pub policy: RolloutPolicy,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub promote_from: Option<String>,
    pub approvals: u32,
    pub auto_heal: bool,
    pub drift_interval_secs: u32,
    /// The release of the last successful deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_release: Option<String>,
    /// The release before it: where `berth rollback` goes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_release: Option<String>,
    /// While set, only this release may be deployed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_release: Option<String>,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub updated_at: OffsetDateTime,
}

/// `GET /api/v1/environments/{name}`.
#[derive(Debug, Clone, Serialize)]
pub struct GetEnvironment {
    #[serde(skip)]
    pub name: String,
}

impl Request for GetEnvironment {
    type Response = EnvironmentView;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        environment_path(&self.name, "")
    }
}

pub(crate) fn environment_path(name: &str, tail: &str) -> String {
    format!(
        "/api/v1/environments/{}{tail}",
        crate::url::encode_query_value(name)
    )
}

/// `GET /api/v1/environments`: every environment of the tenant, by name.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ListEnvironments {}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentList {
    pub items: Vec<EnvironmentView>,
}

impl Request for ListEnvironments {
    type Response = EnvironmentList;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        "/api/v1/environments".into()
    }
}

/// `POST /api/v1/environments/{name}/unpin`: lift the pin a rollback set.
#[derive(Debug, Clone, Serialize)]
pub struct UnpinEnvironment {
    #[serde(skip)]
    pub name: String,
}

impl Request for UnpinEnvironment {
    type Response = EnvironmentView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        environment_path(&self.name, "/unpin")
    }
}

/// `POST /api/v1/environments/{name}/rollback`: deploy the environment's previous successful
/// release and pin it. Needs no approval: it returns to a release the environment already ran.
#[derive(Debug, Clone, Serialize)]
pub struct RollbackEnvironment {
    #[serde(skip)]
    pub name: String,
}

impl Request for RollbackEnvironment {
    type Response = DeploymentView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        environment_path(&self.name, "/rollback")
    }
}

/// Drift of one target, from its last read-back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Drift {
    /// Every component runs the desired digest.
    InSync,
    /// A component is missing, stopped, or runs another digest.
    Drifted,
    /// Not read back yet, or the read-back did not answer.
    Unverified,
}

impl Drift {
    pub fn as_str(self) -> &'static str {
        match self {
            Drift::InSync => "in_sync",
            Drift::Drifted => "drifted",
            Drift::Unverified => "unverified",
        }
    }

    pub fn parse(s: &str) -> Option<Drift> {
        [Drift::InSync, Drift::Drifted, Drift::Unverified]
            .into_iter()
            .find(|d| d.as_str() == s)
    }
}

/// What a read-back of one component found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ObservedComponent {
    pub name: String,
    /// The container's image digest, absent when no such container runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The release its berth labels name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release: Option<String>,
    /// `running`, `exited`, …; absent when missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
}

/// `GET /api/v1/environments/{name}/status`: desired against running, per target.
#[derive(Debug, Clone, Serialize)]
pub struct EnvironmentStatusRequest {
    #[serde(skip)]
    pub name: String,
}

impl Request for EnvironmentStatusRequest {
    type Response = EnvironmentStatus;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        environment_path(&self.name, "/status")
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct EnvironmentStatus {
    pub environment: EnvironmentView,
    pub targets: Vec<TargetStatus>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct TargetStatus {
    pub agent_id: AgentId,
    pub agent_name: String,
    /// The environment's current release.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_release: Option<String>,
    /// The release the last read-back found (its berth labels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running_release: Option<String>,
    pub drift: Drift,
    #[serde(default)]
    pub components: Vec<ObservedComponent>,
    /// When the last read-back was verified (its signed result received).
    #[serde(
        default,
        with = "crate::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub verified_at: Option<OffsetDateTime>,
    /// The `inspect` task that read it back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub check_task_id: Option<TaskId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DeploymentState {
    Pending,
    AwaitingApproval,
    Running,
    Succeeded,
    Failed,
    RolledBack,
    Cancelled,
}

impl DeploymentState {
    pub const ALL: [DeploymentState; 7] = [
        DeploymentState::Pending,
        DeploymentState::AwaitingApproval,
        DeploymentState::Running,
        DeploymentState::Succeeded,
        DeploymentState::Failed,
        DeploymentState::RolledBack,
        DeploymentState::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DeploymentState::Pending => "pending",
            DeploymentState::AwaitingApproval => "awaiting_approval",
            DeploymentState::Running => "running",
            DeploymentState::Succeeded => "succeeded",
            DeploymentState::Failed => "failed",
            DeploymentState::RolledBack => "rolled_back",
            DeploymentState::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<DeploymentState> {
        Self::ALL.into_iter().find(|d| d.as_str() == s)
    }

    /// Pending, awaiting approval and running: the states the database allows one of per
    /// environment.
    pub fn is_active(self) -> bool {
        matches!(
            self,
            DeploymentState::Pending | DeploymentState::AwaitingApproval | DeploymentState::Running
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DeploymentKind {
    /// Asked for by `berth deploy`.
    Deploy,
    /// `berth rollback --env`: the previous successful release, pinned.
    Rollback,
    /// The environment's `autoHeal`: its current release again, after drift.
    Heal,
}

impl DeploymentKind {
    pub fn as_str(self) -> &'static str {
        match self {
            DeploymentKind::Deploy => "deploy",
            DeploymentKind::Rollback => "rollback",
            DeploymentKind::Heal => "heal",
        }
    }

    pub fn parse(s: &str) -> Option<DeploymentKind> {
        [
            DeploymentKind::Deploy,
            DeploymentKind::Rollback,
            DeploymentKind::Heal,
        ]
        .into_iter()
        .find(|k| k.as_str() == s)
    }
}

/// Where one target of a deployment is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum TargetPhase {
    /// Its wave has not started.
    Waiting,
    /// Its tasks are queued for the agent.
    Queued,
    /// The agent confirmed it started (the start handshake) and reported no step yet.
    Deploying,
    /// Pulling the release's images.
    Pulling,
    /// Replacing the container.
    Starting,
    /// Waiting for the health check.
    Health,
    /// Every task succeeded (a verified result or a read-back).
    Succeeded,
    /// A task failed; the error code says why.
    Failed,
    /// A task's delivery was lost after it started: held until read-back decides.
    Unknown,
    /// Being returned to the rollback release.
    RollingBack,
    RolledBack,
    /// The rollback itself failed: the target needs an operator.
    RollbackFailed,
    /// Never touched: the deployment stopped or was cancelled before its wave.
    Skipped,
}

impl TargetPhase {
    pub const ALL: [TargetPhase; 13] = [
        TargetPhase::Waiting,
        TargetPhase::Queued,
        TargetPhase::Deploying,
        TargetPhase::Pulling,
        TargetPhase::Starting,
        TargetPhase::Health,
        TargetPhase::Succeeded,
        TargetPhase::Failed,
        TargetPhase::Unknown,
        TargetPhase::RollingBack,
        TargetPhase::RolledBack,
        TargetPhase::RollbackFailed,
        TargetPhase::Skipped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            TargetPhase::Waiting => "waiting",
            TargetPhase::Queued => "queued",
            TargetPhase::Deploying => "deploying",
            TargetPhase::Pulling => "pulling",
            TargetPhase::Starting => "starting",
            TargetPhase::Health => "health",
            TargetPhase::Succeeded => "succeeded",
            TargetPhase::Failed => "failed",
            TargetPhase::Unknown => "unknown",
            TargetPhase::RollingBack => "rolling_back",
            TargetPhase::RolledBack => "rolled_back",
            TargetPhase::RollbackFailed => "rollback_failed",
            TargetPhase::Skipped => "skipped",
        }
    }

    pub fn parse(s: &str) -> Option<TargetPhase> {
        Self::ALL.into_iter().find(|p| p.as_str() == s)
    }

    /// The target is at rest in this deployment: nothing more happens to it unless the
    /// deployment decides so (a wave ends when all its targets are settled; a failure may still
    /// start a rollback). Succeeded, failed, rolled back, rollback failed, or skipped.
    ///
    /// `unknown` is not settled: a read-back decides it, and its wave waits. A waiting client
    /// (`berth deploy --wait`) shows a settled target as finished.
    pub fn is_settled(self) -> bool {
        matches!(
            self,
            TargetPhase::Succeeded
                | TargetPhase::Failed
                | TargetPhase::RolledBack
                | TargetPhase::RollbackFailed
                | TargetPhase::Skipped
        )
    }

    /// The target went wrong in this deployment: it failed, or failed and was rolled back, or
    /// its rollback failed too. Its failed tasks are worth showing.
    pub fn is_failure(self) -> bool {
        matches!(
            self,
            TargetPhase::Failed | TargetPhase::RolledBack | TargetPhase::RollbackFailed
        )
    }

    /// The agent is at work on the target (started, whatever step it reported).
    pub fn is_working(self) -> bool {
        matches!(
            self,
            TargetPhase::Deploying
                | TargetPhase::Pulling
                | TargetPhase::Starting
                | TargetPhase::Health
        )
    }
}

/// `POST /api/v1/deployments` (and `…/plan` for the dry run, which changes nothing).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateDeployment {
    pub release: String,
    pub environment: String,
}

impl Request for CreateDeployment {
    type Response = DeploymentView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/deployments".into()
    }
}

/// The dry run of a [`CreateDeployment`].
#[derive(Debug, Clone, Serialize)]
pub struct PlanDeployment(pub CreateDeployment);

impl Request for PlanDeployment {
    type Response = DeploymentPlan;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/deployments/plan".into()
    }
}

/// What a deployment would do, per wave and target.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DeploymentPlan {
    pub environment: String,
    pub release: String,
    /// Where a failure would return the updated targets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_release: Option<String>,
    /// Approvals the deployment would wait for.
    pub approvals: u32,
    pub waves: Vec<PlanWave>,
    /// Agents the environment selects that the deployment leaves out, and why
    /// (`AGENT_CORDONED`): they are in no wave.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedTarget>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SkippedTarget {
    pub agent_id: AgentId,
    pub agent_name: String,
    /// A stable code: `AGENT_CORDONED`.
    pub reason: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PlanWave {
    pub wave: u32,
    pub targets: Vec<PlanTarget>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PlanTarget {
    pub agent_id: AgentId,
    pub agent_name: String,
    /// The release its last read-back found, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_release: Option<String>,
    #[serde(
        default,
        with = "crate::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub verified_at: Option<OffsetDateTime>,
    pub components: Vec<PlanComponent>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct PlanComponent {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_digest: Option<String>,
    pub new_digest: String,
    /// Whether the digest changes.
    pub changes: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DeploymentView {
    pub id: DeploymentId,
    pub environment: String,
    pub environment_id: EnvironmentId,
    pub release: String,
    pub kind: DeploymentKind,
    pub state: DeploymentState,
    /// True while failed targets' neighbours are being returned to `rollbackRelease`.
    pub rolling_back: bool,
    pub requested_by: AuditActor,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollback_release: Option<String>,
    pub approvals_required: u32,
    pub approvals: Vec<ApprovalView>,
    pub cancel_requested: bool,
    /// The wave running now (0-based), or the last one that ran.
    pub current_wave: u32,
    pub targets: Vec<DeploymentTargetView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ApprovalView {
    pub by: AuditActor,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub at: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DeploymentTargetView {
    pub agent_id: AgentId,
    pub agent_name: String,
    pub wave: u32,
    pub phase: TargetPhase,
    /// Its deploy tasks, one per component.
    pub tasks: Vec<TaskId>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rollback_tasks: Vec<TaskId>,
    /// The failing task's code (`HEALTH_CHECK_FAILED`, `DIGEST_MISMATCH`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(
        default,
        with = "crate::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub started_at: Option<OffsetDateTime>,
    #[serde(
        default,
        with = "crate::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<String>, format = DateTime))]
    pub finished_at: Option<OffsetDateTime>,
}

/// `GET /api/v1/deployments/{id}`.
#[derive(Debug, Clone, Serialize)]
pub struct GetDeployment {
    #[serde(skip)]
    pub id: DeploymentId,
}

impl Request for GetDeployment {
    type Response = DeploymentView;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        format!("/api/v1/deployments/{}", self.id)
    }
}

/// `POST /api/v1/deployments/{id}/approve`.
#[derive(Debug, Clone, Serialize)]
pub struct ApproveDeployment {
    #[serde(skip)]
    pub id: DeploymentId,
}

impl Request for ApproveDeployment {
    type Response = DeploymentView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/deployments/{}/approve", self.id)
    }
}

/// `POST /api/v1/deployments/{id}/cancel`: waiting deployments end at once; a running one
/// stops after its running wave.
#[derive(Debug, Clone, Serialize)]
pub struct CancelDeployment {
    #[serde(skip)]
    pub id: DeploymentId,
}

impl Request for CancelDeployment {
    type Response = DeploymentView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/deployments/{}/cancel", self.id)
    }
}

/// `GET /api/v1/deployments?environment=&cursor=&limit=`, newest last.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListDeployments {
    /// An environment name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    /// `oldest` (default) or `newest` first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<crate::task::ListOrder>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DeploymentList {
    pub items: Vec<DeploymentView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

impl Request for ListDeployments {
    type Response = DeploymentList;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        let limit = self.limit.map(|l| l.to_string());
        crate::url::with_query(
            "/api/v1/deployments",
            &[
                ("environment", self.environment.as_deref()),
                ("cursor", self.cursor.as_deref()),
                ("limit", limit.as_deref()),
            ],
        )
    }
}

/// `deployment.state`: a deployment was created or changed state (or wave, approvals,
/// cancellation). `data` is the whole [`DeploymentView`] minus its targets.
pub const DEPLOYMENT_STATE_EVENT: &str = "deployment.state";
/// `deployment.target`: one target changed phase; `data` is [`DeploymentTargetEvent`].
pub const DEPLOYMENT_TARGET_EVENT: &str = "deployment.target";
/// `environment.drift`: a target's drift changed (or its first read-back found it drifted);
/// `data` is `{environmentId, agentId, drift, runningRelease}`.
pub const ENVIRONMENT_DRIFT_EVENT: &str = "environment.drift";
/// `deployment.approval`: a token approved a deployment (migration 0019); `data` is
/// `{deploymentId, environmentId, approvedBy}` (`approvedBy`: the approving token's
/// `AuditActor`).
pub const DEPLOYMENT_APPROVAL_EVENT: &str = "deployment.approval";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DeploymentStateEvent {
    pub deployment_id: DeploymentId,
    pub environment_id: EnvironmentId,
    pub state: DeploymentState,
    pub rolling_back: bool,
    pub cancel_requested: bool,
    pub current_wave: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DeploymentTargetEvent {
    pub deployment_id: DeploymentId,
    pub agent_id: AgentId,
    pub wave: u32,
    pub phase: TargetPhase,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_phase_predicates() {
        use TargetPhase::*;
        // (phase, settled, failure, working)
        let table = [
            (Waiting, false, false, false),
            (Queued, false, false, false),
            (Deploying, false, false, true),
            (Pulling, false, false, true),
            (Starting, false, false, true),
            (Health, false, false, true),
            (Succeeded, true, false, false),
            (Failed, true, true, false),
            (Unknown, false, false, false),
            (RollingBack, false, false, false),
            (RolledBack, true, true, false),
            (RollbackFailed, true, true, false),
            (Skipped, true, false, false),
        ];
        assert_eq!(
            table.len(),
            TargetPhase::ALL.len(),
            "every phase is in the table"
        );
        for (phase, settled, failure, working) in table {
            assert_eq!(phase.is_settled(), settled, "{phase:?} settled");
            assert_eq!(phase.is_failure(), failure, "{phase:?} failure");
            assert_eq!(phase.is_working(), working, "{phase:?} working");
            // A target at work, or held in doubt, is never at rest; a failure always is.
            assert!(!(settled && working), "{phase:?}");
            assert!(!failure || settled, "{phase:?}");
        }
    }

    #[test]
    fn names_round_trip() {
        for s in DeploymentState::ALL {
            assert_eq!(DeploymentState::parse(s.as_str()), Some(s));
            let json = serde_json::to_value(s).unwrap();
            assert_eq!(json, s.as_str());
        }
        for p in TargetPhase::ALL {
            assert_eq!(TargetPhase::parse(p.as_str()), Some(p));
            assert_eq!(serde_json::to_value(p).unwrap(), p.as_str());
        }
        assert_eq!(Tier::parse("prod"), Some(Tier::Prod));
        assert_eq!(Tier::Prod.default_approvals(), 1);
        let p: RolloutPolicy = serde_json::from_str("{}").unwrap();
        assert_eq!(p, RolloutPolicy::default());
    }
}
