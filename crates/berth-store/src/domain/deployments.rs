//! Environments, deployments and their targets, approvals, and what drift read-backs observed.
//!
//! The store keeps the rows and enforces what must never be decided by a read before a write:
//! one active deployment per environment (a partial unique index), one approval per token per
//! deployment (the primary key), and deployment progress by compare-and-set on `version`, so
//! two replicas' reconcilers cannot both apply a step. What the next step is, the server's
//! deployment reconciler decides (`berth-server/src/deploy.rs`) from the tasks' states.

use std::collections::BTreeMap;

use berth_proto::audit::AuditActor;
use berth_proto::deploy::{
    DeploymentKind, DeploymentState, Drift, ObservedComponent, RolloutPolicy, TargetPhase,
    TargetType, Tier,
};
use berth_proto::{AgentId, DeploymentId, EnvironmentId, ReleaseId, TaskId, TenantId, TokenId};
use time::OffsetDateTime;

use crate::Result;

#[derive(Debug, Clone, PartialEq)]
pub struct Environment {
    pub id: EnvironmentId,
    pub tenant_id: TenantId,
    pub name: String,
    pub tier: Tier,
    pub selector: BTreeMap<String, String>,
    pub target_type: TargetType,
    pub policy: RolloutPolicy,
    /// The environment a release must have succeeded in first (by name).
    pub promote_from: Option<String>,
    pub approvals: u32,
    pub auto_heal: bool,
    pub drift_interval_secs: u32,
    /// Set by the step that makes a deployment `succeeded`; `previous` is what `current` was.
    pub current_release: Option<ReleaseRef>,
    pub previous_release: Option<ReleaseRef>,
    pub pinned_release: Option<ReleaseRef>,
    /// Who created it; an `autoHeal` deployment is requested in their name.
    pub created_by: AuditActor,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
}

/// A release by id, with its name (read through a join; only the id is stored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseRef {
    pub id: ReleaseId,
    pub name: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Deployment {
    pub id: DeploymentId,
    pub tenant_id: TenantId,
    pub environment_id: EnvironmentId,
    /// Read through a join.
    pub environment_name: String,
    pub release: ReleaseRef,
    pub kind: DeploymentKind,
    pub state: DeploymentState,
    pub rolling_back: bool,
    /// The token that asked for it (a heal: the environment's `created_by`).
    pub requested_by: AuditActor,
    /// The environment's current release when the deployment was created: where every target
    /// it updated returns after a failure.
    pub rollback_release: Option<ReleaseRef>,
    pub approvals_required: u32,
    pub cancel_requested: bool,
    pub current_wave: u32,
    pub error_code: Option<String>,
    pub detail: Option<String>,
    /// Incremented by every write; [`DeploymentStore::record_deployment_step`] compares it.
    pub version: i64,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
    pub finished_at: Option<OffsetDateTime>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct DeploymentTarget {
    pub deployment_id: DeploymentId,
    pub agent_id: AgentId,
    pub agent_name: String,
    pub wave: u32,
    pub phase: TargetPhase,
    /// Deploy tasks, one per component, in component order.
    pub tasks: Vec<TaskId>,
    pub rollback_tasks: Vec<TaskId>,
    pub error_code: Option<String>,
    pub detail: Option<String>,
    pub started_at: Option<OffsetDateTime>,
    pub finished_at: Option<OffsetDateTime>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Approval {
    pub deployment_id: DeploymentId,
    pub token_id: TokenId,
    pub actor: AuditActor,
    pub approved_at: OffsetDateTime,
}

/// A deployment with its targets (by wave, then agent name) and approvals (by time).
#[derive(Debug, Clone, PartialEq)]
pub struct DeploymentDetail {
    pub deployment: Deployment,
    pub targets: Vec<DeploymentTarget>,
    pub approvals: Vec<Approval>,
}

#[derive(Debug, Clone)]
pub struct NewDeployment {
    /// `state` is `pending` or `awaiting_approval`; `version` is ignored (starts at 0).
    pub deployment: Deployment,
    pub targets: Vec<DeploymentTarget>,
    /// Pin the environment to the deployment's release in the same transaction (a rollback).
    pub pin: bool,
}

/// One step of a deployment, decided by the reconciler from the version it read.
#[derive(Debug, Clone)]
pub struct DeploymentStep {
    pub tenant_id: TenantId,
    pub id: DeploymentId,
    /// The `version` the step was decided from; another writer's step in between wins.
    pub expected_version: i64,
    pub state: DeploymentState,
    pub rolling_back: bool,
    pub current_wave: u32,
    pub error_code: Option<String>,
    pub detail: Option<String>,
    /// The targets that changed, whole (matched by agent id).
    pub targets: Vec<DeploymentTarget>,
    pub now: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ApproveOutcome {
    /// Recorded (or this token had already approved); the deployment as it is now, `pending`
    /// once it has enough approvals.
    Approved(DeploymentDetail),
    /// The deployment is not awaiting approval.
    NotAwaiting(DeploymentDetail),
}

/// What the last drift read-back of one target of an environment found.
#[derive(Debug, Clone, PartialEq)]
pub struct TargetObservation {
    pub tenant_id: TenantId,
    pub environment_id: EnvironmentId,
    pub agent_id: AgentId,
    /// The read-back in flight or last finished.
    pub check_task_id: Option<TaskId>,
    /// When the next read-back is due.
    pub next_check_at: OffsetDateTime,
    pub drift: Drift,
    pub running_release: Option<String>,
    pub components: Vec<ObservedComponent>,
    pub verified_at: Option<OffsetDateTime>,
}

/// The deployment a task is created for (of the task's tenant), and the version of it the
/// step was decided from ([`DeploymentStore::create_deployment_task`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeploymentGuard {
    pub deployment_id: DeploymentId,
    pub expected_version: i64,
}

impl DeploymentGuard {
    /// Whether the deployment, read as (state, version) under its row lock (`None`: it is
    /// gone), is still the one the step was decided from: the same version, and still
    /// `pending` or `running`.
    pub(crate) fn holds(&self, current: Option<(DeploymentState, i64)>) -> bool {
        current.is_some_and(|(state, version)| {
            version == self.expected_version
                && matches!(state, DeploymentState::Pending | DeploymentState::Running)
        })
    }
}

// One value per create, matched once: boxing would only add an allocation (as `ClaimOutcome`).
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum DeploymentTaskOutcome {
    /// The deployment was still as the step read it: what the create did.
    Decided(crate::CreateTaskOutcome),
    /// The deployment moved on (cancelled, finished, or another step recorded) since the step
    /// read it: nothing was inserted.
    Superseded,
}

/// Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait DeploymentStore: Send + Sync {
    /// `Conflict { constraint: "environment_name" }` when the tenant has one of that name. An
    /// `environment.create` audit entry by `actor` in the same transaction.
    async fn create_environment(&self, env: Environment, actor: AuditActor) -> Result<Environment>;
    async fn get_environment(&self, tenant: TenantId, name: &str) -> Result<Option<Environment>>;
    /// Every environment of the tenant, by name.
    async fn list_environments(&self, tenant: TenantId) -> Result<Vec<Environment>>;
    /// Environments of every tenant that have a current release (the drift sweep), by id after
    /// `after`, at most `limit`.
    async fn environments_with_release(
        &self,
        after: Option<EnvironmentId>,
        limit: u32,
    ) -> Result<Vec<Environment>>;
    /// Clears the pin; an `environment.unpin` audit entry. `None`: no such environment.
    async fn unpin_environment(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<Environment>>;

    /// Inserts the deployment and its targets, and a `deployment.create` audit entry by its
    /// requester, in one transaction. `Conflict { constraint: "deployment_in_progress" }` when
    /// the environment has a deployment that is `pending`, `awaiting_approval` or `running`:
    /// the database's partial unique index decides.
    async fn create_deployment(&self, new: NewDeployment) -> Result<DeploymentDetail>;
    async fn get_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
    ) -> Result<Option<DeploymentDetail>>;
    /// The tenant's deployments (of one environment when given), by id after `after`, oldest or
    /// newest first.
    async fn list_deployments(
        &self,
        tenant: TenantId,
        environment: Option<EnvironmentId>,
        after: Option<DeploymentId>,
        order: berth_proto::task::ListOrder,
        limit: u32,
    ) -> Result<crate::Page<Deployment>>;
    /// Whether the release has a `succeeded` deployment in the tenant's environment of that
    /// name (the promotion rule).
    async fn succeeded_in(
        &self,
        tenant: TenantId,
        environment: &str,
        release: ReleaseId,
    ) -> Result<bool>;

    /// In one transaction: records `approver`'s approval (once per token), and moves the
    /// deployment from `awaiting_approval` to `pending` once it has `approvals_required`; a
    /// `deployment.approve` audit entry. `actor` must be a token (the server refuses the
    /// requester's own token before). `None`: no such deployment.
    async fn approve_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<ApproveOutcome>>;
    /// `pending` or `awaiting_approval`: `cancelled` at once (targets `skipped`, finished).
    /// `running`: `cancel_requested`, and the reconciler stops after the running wave.
    /// Terminal: unchanged. A `deployment.cancel` audit entry when it changed anything.
    ///
    /// In the same transaction, with the deployment row locked against
    /// [`Self::create_deployment_task`], the open tasks created for targets still `waiting`
    /// (by a step that read the deployment before this cancel, and whose record now fails on
    /// `version`) are cancelled as [`crate::TaskStore::cancel_task`] would (pending at once,
    /// leased by request), each with a `task.cancel` entry by `actor`: nothing stays queued
    /// for a wave the cancel stopped. Rollback tasks are never touched (their targets are not
    /// `waiting`; a later step finds them again by key).
    async fn cancel_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<DeploymentDetail>>;

    /// Creates a task of one step of a deployment, as [`crate::TaskStore::create_task`] does,
    /// in a transaction that first locks the deployment's row (shared: `FOR SHARE` on
    /// PostgreSQL; the one writer on SQLite) and checks that it is still `pending` or `running`
    /// at `guard.expected_version`, the version the step was decided from. Otherwise
    /// [`DeploymentTaskOutcome::Superseded`] and nothing is inserted: a cancel (or another
    /// replica's step) committed since, and the step's record would fail anyway. The lock
    /// conflicts with [`Self::cancel_deployment`]'s, so either the cancel sees the task (and
    /// cancels it) or the create sees the cancel. The task row remembers its deployment.
    async fn create_deployment_task(
        &self,
        guard: DeploymentGuard,
        task: crate::NewTask,
    ) -> Result<DeploymentTaskOutcome>;

    /// Deployments of every tenant that are `pending` or `running`, oldest first.
    async fn active_deployments(&self, limit: u32) -> Result<Vec<DeploymentDetail>>;
    /// Applies the step if the deployment's `version` is still `expected_version` (then
    /// version + 1), in one transaction. When the step makes it `succeeded` the environment's
    /// `current_release` becomes its release (the old one `previous_release`, unless it is the
    /// same release). `None`: another step came first (or no such deployment); nothing written.
    async fn record_deployment_step(
        &self,
        step: DeploymentStep,
    ) -> Result<Option<DeploymentDetail>>;

    /// Every observation of the environment's targets, by agent id.
    async fn target_observations(
        &self,
        environment: EnvironmentId,
    ) -> Result<Vec<TargetObservation>>;
    /// Inserts or replaces the observation of (environment, agent).
    async fn put_target_observation(&self, observation: TargetObservation) -> Result<()>;
}
