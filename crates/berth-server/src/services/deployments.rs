//! The deployment reconciler: moves every `pending` or `running` deployment one step toward its
//! end, from the states of its tasks only (verified results and read-backs).
//!
//! A step is decided from one read of the deployment (its `version`) and its tasks, and
//! recorded by compare-and-set on that version, so replicas running this loop at once cannot
//! both apply a step. Tasks are created before the step that names them, under an idempotency
//! key per (deployment, target, purpose, component): a crash or a lost race between the two
//! leaves tasks that the next run finds again instead of duplicating. Each create is guarded by
//! the version the pass read (`create_deployment_task`): after a cancel it is refused, and a
//! cancel after it cancels what it queued for targets that never started. Nothing here runs once
//! after a commit; every pass re-derives what to do from the database.
//!
//! The rules:
//! - waves run in order; a wave ends when each of its targets succeeded or failed. A target
//!   whose task is `unknown` holds the wave (and the deployment, `running`) until read-back
//!   decides it; it never counts as success;
//! - a failed target fails its other open tasks (cancelled) and, with `stopOnFailure`, ends the
//!   rollout after its wave; with `autoRollback`, every target this deployment touched gets the
//!   deployment's `rollbackRelease` (the environment's current release when the deployment was
//!   created: the same for every target), and the deployment ends `rolled_back`, or `failed`
//!   if a rollback failed;
//! - a cancellation ends the deployment after the running wave.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use berth_proto::audit::AuditActor;
use berth_proto::deploy::{DeploymentKind, DeploymentState, RolloutPolicy, TargetPhase};
use berth_proto::error::codes;
use berth_proto::kind::TaskKind;
use berth_proto::payload::WriteStickerPayload;
use berth_proto::release::Component;
use berth_proto::transport::ProgressPhase;
use berth_proto::{DeploymentId, TaskId, TenantId};
use berth_store::{
    Deployment, DeploymentDetail, DeploymentStep, DeploymentTarget, Environment, NewDeployment,
    Release, ReleaseRef, StoreError, TaskState,
};
use serde_json::{json, Value};

use crate::services;
use crate::services::targets::{SshTaskError, Target, TargetKind};
use crate::services::tasks::{Origin, Placement, Refused, TaskRequest};
use crate::SharedState;

/// Deployments advanced per pass.
pub(crate) const ACTIVE_PAGE: u32 = 200;
/// A pass also runs this often without any event, for steps that wait on time alone.
pub(crate) const IDLE_PASS: Duration = Duration::from_secs(1);

/// What [`create_tasks`] answers (as a `Conflict`) when the deployment moved on since the pass
/// read it: the pass ends without recording, quietly.
pub(crate) const SUPERSEDED: &str = "deployment_superseded";

pub const DEPLOY: &str = "deploy";
pub const ROLLBACK: &str = "rollback";

/// `targets` (by name, as [`crate::services::targets::matching`] gives them) in waves of the policy's
/// `maxParallel`: what a deployment runs and its plan shows.
pub(crate) fn waves<'a>(
    targets: &'a [Target],
    policy: &RolloutPolicy,
) -> impl Iterator<Item = (u32, &'a [Target])> {
    targets
        .chunks(policy.max_parallel.max(1) as usize)
        .enumerate()
        .map(|(wave, chunk)| (wave as u32, chunk))
}

/// Inserts a deployment of `release` into `env` over `targets` (in [`waves`]). A deploy waits for the environment's approvals; a rollback or a heal returns to a
/// release the environment already ran and waits for none. A rollback pins the environment.
/// The deployment's rollback release is the environment's current one.
pub(crate) async fn create(
    state: &SharedState,
    env: &Environment,
    release: &Release,
    kind: DeploymentKind,
    requested_by: AuditActor,
    targets: &[Target],
) -> Result<DeploymentDetail, StoreError> {
    let now = state.config.clock.now();
    let id = DeploymentId::new();
    let approvals_required = match kind {
        DeploymentKind::Deploy => env.approvals,
        DeploymentKind::Rollback | DeploymentKind::Heal => 0,
    };
    let targets = waves(targets, &env.policy)
        .flat_map(|(wave, chunk)| chunk.iter().map(move |target| (wave, target)))
        .map(|(wave, target)| DeploymentTarget {
            deployment_id: id,
            agent_id: target.id,
            agent_name: target.name.clone(),
            wave,
            phase: TargetPhase::Waiting,
            tasks: Vec::new(),
            rollback_tasks: Vec::new(),
            error_code: None,
            detail: None,
            started_at: None,
            finished_at: None,
        })
        .collect();
    state
        .store
        .create_deployment(NewDeployment {
            deployment: Deployment {
                id,
                tenant_id: env.tenant_id,
                environment_id: env.id,
                environment_name: env.name.clone(),
                release: ReleaseRef {
                    id: release.id,
                    name: release.name.clone(),
                },
                kind,
                state: if approvals_required > 0 {
                    DeploymentState::AwaitingApproval
                } else {
                    DeploymentState::Pending
                },
                rolling_back: false,
                requested_by,
                rollback_release: env.current_release.clone(),
                approvals_required,
                cancel_requested: false,
                current_wave: 0,
                error_code: None,
                detail: None,
                version: 0,
                created_at: now,
                updated_at: now,
                finished_at: None,
            },
            targets,
            pin: kind == DeploymentKind::Rollback,
        })
        .await
}

/// A component's `docker.run` config for one target. Like Octopus's machine-scoped variables,
/// any string in it may name the target: `{{target.name}}` (the target's name) and
/// `{{target.labels.KEY}}` (one of its labels), so one release can give each host its own
/// container name, port or setting. The server substitutes them as text; nothing is evaluated,
/// and a label the target lacks is an error naming it.
pub(crate) fn target_config(component: &Component, target: &Target) -> Result<Value, String> {
    fn render(value: &mut Value, target: &Target) -> Result<(), String> {
        match value {
            Value::String(s) => {
                let mut out = String::with_capacity(s.len());
                let mut rest = s.as_str();
                while let Some(start) = rest.find("{{") {
                    let end = rest[start..]
                        .find("}}")
                        .ok_or_else(|| format!("unclosed {{{{ in {s:?}"))?;
                    let name = rest[start + 2..start + end].trim();
                    out.push_str(&rest[..start]);
                    let value = match name.strip_prefix("target.labels.") {
                        _ if name == "target.name" => target.name.as_str(),
                        Some(key) => {
                            target.labels.get(key).map(String::as_str).ok_or_else(|| {
                                format!("target {} has no label {key:?}", target.name)
                            })?
                        }
                        None => return Err(format!("unknown placeholder {{{{{name}}}}}")),
                    };
                    out.push_str(value);
                    rest = &rest[start + end + 2..];
                }
                out.push_str(rest);
                *s = out;
            }
            Value::Array(items) => items.iter_mut().try_for_each(|v| render(v, target))?,
            Value::Object(map) => map.values_mut().try_for_each(|v| render(v, target))?,
            _ => {}
        }
        Ok(())
    }
    let mut config = component
        .config
        .clone()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    if config.get("containerName").is_none() {
        config["containerName"] = json!(component.name);
    }
    render(&mut config, target).map_err(|e| format!("component {}: {e}", component.name))?;
    Ok(config)
}

/// The container a component runs as on a target.
pub(crate) fn container_name(component: &Component, target: &Target) -> Result<String, String> {
    Ok(target_config(component, target)?
        .get("containerName")
        .and_then(Value::as_str)
        .unwrap_or(&component.name)
        .to_string())
}

/// The `docker.run` payload that puts one component of `release` on a target: pinned by digest,
/// labelled with the release, health-checked within the environment's timeout.
pub(crate) fn component_payload(
    release: &Release,
    component: &Component,
    target: &Target,
    policy: &RolloutPolicy,
) -> Result<Value, String> {
    let mut config = target_config(component, target)?;
    config["releaseId"] = json!(release.id.to_string());
    config["releaseName"] = json!(release.name);
    if let Some(health) = config.get_mut("healthCheck").filter(|h| h.is_object()) {
        health["timeout"] = json!(policy.health_timeout_secs);
    }
    Ok(json!({ "image": component.image, "digest": component.digest, "config": config }))
}

/// What one task looks like to a deployment.
#[derive(Debug, Clone)]
struct Snapshot {
    state: TaskState,
    error_code: Option<String>,
    /// A delivery was confirmed started (the agent is working on the target).
    started: bool,
    /// The step the current delivery last reported.
    phase: Option<ProgressPhase>,
}

/// A target's phase from its tasks: deploy tasks, or rollback tasks once it has some.
fn phase_of(
    target: &DeploymentTarget,
    tasks: &HashMap<TaskId, Snapshot>,
) -> (TargetPhase, Option<String>) {
    let rolling_back = !target.rollback_tasks.is_empty();
    // A rollback that could not be placed (cordon, queue cap, agent gone) is final: the deploy
    // tasks must not turn the target back into `succeeded` or `failed`.
    if !rolling_back && target.phase == TargetPhase::RollbackFailed {
        return (target.phase, target.error_code.clone());
    }
    let ids = if rolling_back {
        &target.rollback_tasks
    } else {
        &target.tasks
    };
    if ids.is_empty() {
        return (target.phase, target.error_code.clone());
    }
    let snaps: Vec<&Snapshot> = ids.iter().filter_map(|id| tasks.get(id)).collect();
    // A failure's own code before the cancellations it caused.
    let failed = snaps
        .iter()
        .find(|s| {
            matches!(
                s.state,
                TaskState::Failed | TaskState::DeadLetter | TaskState::Expired
            )
        })
        .or_else(|| snaps.iter().find(|s| s.state == TaskState::Cancelled));
    let (done, failure, holding, working) = if rolling_back {
        (
            TargetPhase::RolledBack,
            TargetPhase::RollbackFailed,
            TargetPhase::RollingBack,
            TargetPhase::RollingBack,
        )
    } else {
        (
            TargetPhase::Succeeded,
            TargetPhase::Failed,
            TargetPhase::Unknown,
            TargetPhase::Deploying,
        )
    };
    if let Some(f) = failed {
        let code = f
            .error_code
            .clone()
            .or_else(|| (f.state == TaskState::Cancelled).then(|| "CANCELLED".to_string()));
        return (failure, code);
    }
    if snaps.len() == ids.len() && snaps.iter().all(|s| s.state == TaskState::Succeeded) {
        return (done, None);
    }
    if snaps.iter().any(|s| s.state == TaskState::Unknown) {
        return (holding, Some("UNKNOWN".into()));
    }
    if snaps
        .iter()
        .any(|s| s.started || s.state == TaskState::Succeeded)
    {
        if rolling_back {
            return (working, None);
        }
        let step = snaps
            .iter()
            .find(|s| s.state == TaskState::Leased)
            .and_then(|s| s.phase);
        let phase = match step {
            Some(ProgressPhase::Pulling) => TargetPhase::Pulling,
            Some(ProgressPhase::Starting) => TargetPhase::Starting,
            Some(ProgressPhase::Health) => TargetPhase::Health,
            None => working,
        };
        return (phase, None);
    }
    let queued = if rolling_back {
        TargetPhase::RollingBack
    } else {
        TargetPhase::Queued
    };
    (queued, None)
}

async fn snapshots(
    state: &SharedState,
    tenant: TenantId,
    targets: &[DeploymentTarget],
) -> Result<HashMap<TaskId, Snapshot>, StoreError> {
    let mut out = HashMap::new();
    // Collected first: a borrowing iterator held across `.await` makes the future not `Send`.
    let ids: Vec<TaskId> = targets
        .iter()
        .flat_map(|t| t.tasks.iter().chain(&t.rollback_tasks).copied())
        .collect();
    for id in ids {
        if let Some((task, attempts)) = state.store.get_task(tenant, id).await? {
            let current = attempts
                .iter()
                .find(|a| Some(a.assignment_id) == task.current_assignment);
            let started =
                task.state == TaskState::Leased && current.is_some_and(|a| a.started_at.is_some());
            out.insert(
                id,
                Snapshot {
                    state: task.state,
                    error_code: task.error_code,
                    started,
                    phase: current.and_then(|a| a.phase),
                },
            );
        }
    }
    Ok(out)
}

/// One step of one deployment.
pub(crate) async fn advance(
    state: &SharedState,
    detail: DeploymentDetail,
) -> Result<(), StoreError> {
    let d = &detail.deployment;
    let now = state.config.clock.now();
    let tasks = snapshots(state, d.tenant_id, &detail.targets).await?;
    let environment = state
        .store
        .get_environment(d.tenant_id, &d.environment_name)
        .await?;
    let policy = environment
        .as_ref()
        .map(|e| e.policy.clone())
        .unwrap_or_default();

    let mut targets = detail.targets.clone();
    settle_targets(state, d, &mut targets, &tasks, now).await?;

    let mut next = Next {
        state: DeploymentState::Running,
        rolling_back: d.rolling_back,
        wave: d.current_wave,
        error_code: d.error_code.clone(),
        detail: d.detail.clone(),
    };
    if d.rolling_back {
        finish_rollback(&targets, &mut next);
    } else {
        settle_wave(state, &detail, &mut targets, &mut next, &policy, now).await?;
        // Start the current wave's targets that have no tasks yet.
        if next.state == DeploymentState::Running && !next.rolling_back {
            start_wave(state, &detail, &mut targets, next.wave, &policy, now).await?;
        }
    }
    record_step(state, &detail, targets, next, now).await
}

/// Moves each target to the phase its tasks show; a target that just failed has its other
/// open tasks cancelled.
async fn settle_targets(
    state: &SharedState,
    d: &berth_store::Deployment,
    targets: &mut [DeploymentTarget],
    tasks: &HashMap<TaskId, Snapshot>,
    now: time::OffsetDateTime,
) -> Result<(), StoreError> {
    for t in targets {
        let (phase, code) = phase_of(t, tasks);
        if phase != t.phase {
            if phase == TargetPhase::Failed {
                // The target's remaining components must not run after one failed.
                cancel_open(state, d, &t.tasks, tasks).await?;
            }
            // `phase_of` never yields `skipped` (only the wave start sets it), so this is the
            // target's first settled phase.
            if phase.is_settled() {
                t.finished_at = Some(now);
            }
            if phase.is_working() && t.started_at.is_none() {
                t.started_at = Some(now);
            }
            t.phase = phase;
            t.error_code = code;
        }
    }
    Ok(())
}

/// A rolling-back deployment ends once every target its rollback covers settled:
/// `rolled_back`, or `failed` naming the targets whose rollback failed.
fn finish_rollback(targets: &[DeploymentTarget], next: &mut Next) {
    // Every target the rollback covers, a deleted agent's (no tasks, failed) included.
    let rolling: Vec<&DeploymentTarget> = targets
        .iter()
        .filter(|t| {
            matches!(
                t.phase,
                TargetPhase::RollingBack | TargetPhase::RolledBack | TargetPhase::RollbackFailed
            )
        })
        .collect();
    if !rolling.iter().all(|t| t.phase.is_settled()) {
        return;
    }
    let failed: Vec<&str> = rolling
        .iter()
        .filter(|t| t.phase == TargetPhase::RollbackFailed)
        .map(|t| t.agent_name.as_str())
        .collect();
    if failed.is_empty() {
        next.state = DeploymentState::RolledBack;
    } else {
        next.state = DeploymentState::Failed;
        next.detail = Some(format!(
            "{}; the rollback failed on {}",
            next.detail.take().unwrap_or_default(),
            failed.join(", ")
        ));
    }
}

/// Once the current wave settled: a failure ends the rollout (rolling back, with
/// `autoRollback`), a cancel ends it, else the next wave starts or the deployment succeeded.
async fn settle_wave(
    state: &SharedState,
    detail: &DeploymentDetail,
    targets: &mut [DeploymentTarget],
    next: &mut Next,
    policy: &RolloutPolicy,
    now: time::OffsetDateTime,
) -> Result<(), StoreError> {
    let d = &detail.deployment;
    let last_wave = targets.iter().map(|t| t.wave).max().unwrap_or(0);
    let wave_done = targets
        .iter()
        .filter(|t| t.wave == next.wave)
        .all(|t| t.phase.is_settled());
    if !wave_done {
        return Ok(());
    }
    let failed: Vec<&DeploymentTarget> = targets
        .iter()
        .filter(|t| t.phase == TargetPhase::Failed)
        .collect();
    if !failed.is_empty() && (policy.stop_on_failure || next.wave == last_wave) {
        next.error_code = failed[0].error_code.clone();
        next.detail = Some(
            failed
                .iter()
                .map(|t| {
                    format!(
                        "{} failed: {}",
                        t.agent_name,
                        t.error_code.as_deref().unwrap_or("FAILED")
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
        );
        let rollback = (policy.auto_rollback && d.kind == DeploymentKind::Deploy)
            .then_some(d.rollback_release.as_ref())
            .flatten();
        match rollback {
            Some(to) => {
                next.rolling_back = true;
                start_rollback(state, detail, targets, &to.name, policy, now).await?;
            }
            None => next.state = DeploymentState::Failed,
        }
        skip_waiting(targets);
    } else if d.cancel_requested {
        next.state = DeploymentState::Cancelled;
        skip_waiting(targets);
    } else if next.wave < last_wave {
        next.wave += 1;
    } else {
        next.state = DeploymentState::Succeeded;
    }
    Ok(())
}

/// Gives every target this deployment touched (succeeded or failed) the release `to`.
async fn start_rollback(
    state: &SharedState,
    detail: &DeploymentDetail,
    targets: &mut [DeploymentTarget],
    to: &str,
    policy: &RolloutPolicy,
    now: time::OffsetDateTime,
) -> Result<(), StoreError> {
    let release = load_release(state, detail.deployment.tenant_id, to).await?;
    for t in targets {
        if matches!(t.phase, TargetPhase::Succeeded | TargetPhase::Failed) {
            match create_tasks(state, detail, t, &release, policy, ROLLBACK).await? {
                Ok(ids) => {
                    t.rollback_tasks = ids;
                    t.phase = TargetPhase::RollingBack;
                    t.finished_at = None;
                }
                Err(why) => why.mark(t, TargetPhase::RollbackFailed, now),
            }
        }
    }
    Ok(())
}

/// Queues the deployment's release on each target of `wave` still waiting.
async fn start_wave(
    state: &SharedState,
    detail: &DeploymentDetail,
    targets: &mut [DeploymentTarget],
    wave: u32,
    policy: &RolloutPolicy,
    now: time::OffsetDateTime,
) -> Result<(), StoreError> {
    let d = &detail.deployment;
    let release = load_release(state, d.tenant_id, &d.release.name).await?;
    for t in targets {
        if t.wave == wave && t.phase == TargetPhase::Waiting {
            match create_tasks(state, detail, t, &release, policy, DEPLOY).await? {
                Ok(ids) => {
                    t.tasks = ids;
                    t.phase = TargetPhase::Queued;
                }
                Err(why) => why.mark(t, TargetPhase::Failed, now),
            }
        }
    }
    Ok(())
}

/// Records the step (compare-and-set on the version the pass read), if it changed anything.
async fn record_step(
    state: &SharedState,
    detail: &DeploymentDetail,
    targets: Vec<DeploymentTarget>,
    next: Next,
    now: time::OffsetDateTime,
) -> Result<(), StoreError> {
    let d = &detail.deployment;
    let changed: Vec<DeploymentTarget> = targets
        .into_iter()
        .zip(&detail.targets)
        .filter(|(new, old)| new != *old)
        .map(|(new, _)| new)
        .collect();
    let same = next.state == d.state
        && next.rolling_back == d.rolling_back
        && next.wave == d.current_wave
        && changed.is_empty();
    if same {
        return Ok(());
    }
    let terminal = !next.state.is_active();
    let recorded = state
        .store
        .record_deployment_step(DeploymentStep {
            tenant_id: d.tenant_id,
            id: d.id,
            expected_version: d.version,
            state: next.state,
            rolling_back: next.rolling_back,
            current_wave: next.wave,
            error_code: next.error_code,
            detail: next.detail,
            targets: changed,
            now,
        })
        .await?;
    if let (Some(r), true) = (recorded, terminal) {
        tracing::info!(
            deployment_id = %r.deployment.id,
            environment = %r.deployment.environment_name,
            release = %r.deployment.release.name,
            state = r.deployment.state.as_str(),
            "deployment finished"
        );
    }
    Ok(())
}

struct Next {
    state: DeploymentState,
    rolling_back: bool,
    wave: u32,
    error_code: Option<String>,
    detail: Option<String>,
}

/// Why a target's tasks cannot be created: it ends the target with this code.
struct Unplaceable {
    code: &'static str,
    detail: String,
    hold: Hold,
}

/// An operator's hold, or the agent's full queue, that refused a target's task.
#[derive(PartialEq)]
enum Hold {
    None,
    /// Its agent was cordoned after the deployment was planned: a deploy skips the target (a
    /// rollback cannot return it, and fails it).
    Cordoned,
    /// Its agent's queue is at `--max-open-tasks-per-agent`: a deploy leaves the target
    /// waiting, and the next pass tries again (a rollback fails it).
    QueueFull,
}

impl Unplaceable {
    fn mark(self, t: &mut DeploymentTarget, phase: TargetPhase, now: time::OffsetDateTime) {
        if self.hold == Hold::QueueFull && phase == TargetPhase::Failed {
            return;
        }
        t.phase = if self.hold == Hold::Cordoned && phase == TargetPhase::Failed {
            TargetPhase::Skipped
        } else {
            phase
        };
        t.error_code = Some(self.code.into());
        t.detail = Some(self.detail);
        t.finished_at = Some(now);
    }
}

/// A refused task's detail, naming the target.
fn describe(refused: &Refused, target: &str) -> String {
    match refused {
        Refused::AgentNotFound(_) => format!("the agent of target {target} was deleted"),
        Refused::Cordoned(_) => format!("the agent of target {target} is cordoned"),
        Refused::QueueFull { open, cap, .. } => {
            format!("the agent of target {target} already has {open} open tasks (at most {cap})")
        }
        Refused::CapabilityMissing { kind, .. } => format!(
            "the agent of target {target} does not report the {:?} capability that {kind} needs",
            kind.required_capability()
        ),
        other => format!("target {target}: {other:?}"),
    }
}

/// A target's code when its agent is gone.
const AGENT_DELETED: &str = "AGENT_DELETED";

fn skip_waiting(targets: &mut [DeploymentTarget]) {
    for t in targets {
        if t.phase == TargetPhase::Waiting {
            t.phase = TargetPhase::Skipped;
        }
    }
}

async fn load_release(
    state: &SharedState,
    tenant: TenantId,
    name: &str,
) -> Result<Release, StoreError> {
    state.store.get_release(tenant, name).await?.ok_or_else(|| {
        StoreError::Corrupt(format!("deployment names release {name:?}, which is gone"))
    })
}

/// Cancels the target's tasks that have not ended; the deployment's requester is the actor.
async fn cancel_open(
    state: &SharedState,
    d: &berth_store::Deployment,
    ids: &[TaskId],
    tasks: &HashMap<TaskId, Snapshot>,
) -> Result<(), StoreError> {
    for id in ids {
        let open = tasks.get(id).is_some_and(|s| !s.state.is_terminal());
        if open {
            state
                .store
                .cancel_task(
                    d.tenant_id,
                    *id,
                    d.requested_by.clone(),
                    state.config.clock.now(),
                )
                .await?;
        }
    }
    Ok(())
}

/// What a deployment task's sealed credentials hold.
enum Credentials<'a> {
    /// A `docker.run`: the registry token scope, if berth issues for the image's registry.
    Registry(Option<BTreeMap<String, String>>),
    /// An `ssh.deploy`: the SSH target's private key.
    SshKey(&'a berth_store::SshTarget),
}

/// One task a target's deployment needs: its kind, the agent it runs on, its payload, what
/// its credentials hold, and the part of the target it deploys (a component, or `ssh`).
type PlannedTask<'a> = (
    TaskKind,
    berth_proto::AgentId,
    Value,
    Credentials<'a>,
    &'a str,
);

/// Creates (or finds again, by key) the target's tasks for `release`: one `docker.run` per
/// component on an agent, one `ssh.deploy` on an SSH target's via agent. `Err` when the target
/// can no longer be deployed to (its agent or SSH target deleted, no via agent, its key gone,
/// its agent cordoned, or its queue full: see [`Hold`]). Made by `services::tasks`.
async fn create_tasks(
    state: &SharedState,
    detail: &DeploymentDetail,
    target: &DeploymentTarget,
    release: &Release,
    policy: &RolloutPolicy,
    purpose: &str,
) -> Result<Result<Vec<TaskId>, Unplaceable>, StoreError> {
    let d = &detail.deployment;
    let Some(found) = crate::services::targets::get(state, d.tenant_id, target.agent_id).await?
    else {
        return Ok(Err(Unplaceable {
            code: AGENT_DELETED,
            detail: format!("target {} was deleted", target.agent_name),
            hold: Hold::None,
        }));
    };
    let tasks = match plan_tasks(state, d, target, &found, release, policy).await? {
        Ok(tasks) => tasks,
        Err(why) => return Ok(Err(why)),
    };
    let mut ids = Vec::new();
    for (kind, agent_id, payload, credentials, part) in tasks {
        let credentials = match credentials {
            Credentials::Registry(creds) => creds,
            Credentials::SshKey(ssh) => {
                match crate::services::targets::key_credentials(state, ssh).await {
                    Ok(creds) => Some(creds),
                    Err(SshTaskError::Store(e)) => return Err(e),
                    Err(e) => {
                        return Ok(Err(Unplaceable {
                            code: codes::SECRET_NOT_FOUND,
                            detail: e.to_string(),
                            hold: Hold::None,
                        }))
                    }
                }
            }
        };
        let request = TaskRequest {
            tenant: d.tenant_id,
            kind,
            placement: Placement::Agent(agent_id),
            payload,
            credentials,
            variables: Default::default(),
            timeout_seconds: u32::try_from(policy.task_timeout_secs).unwrap_or(u32::MAX),
            priority: 0,
            origin: Origin::Deployment {
                deployment: d.id,
                version: d.version,
                target: target.agent_id,
                purpose: purpose.to_string(),
                part: part.to_string(),
                requested_by: d.requested_by.clone(),
            },
        };
        match services::tasks::create(state, request).await? {
            Ok(placed) => ids.push(placed.task().id),
            Err(refused) => return unplaceable(d, target, refused).map(Err),
        }
    }
    Ok(Ok(ids))
}

/// The tasks `found` needs to run `release` (their credentials not opened yet), or why it
/// cannot be deployed to.
async fn plan_tasks<'a>(
    state: &SharedState,
    d: &Deployment,
    target: &DeploymentTarget,
    found: &'a Target,
    release: &'a Release,
    policy: &RolloutPolicy,
) -> Result<Result<Vec<PlannedTask<'a>>, Unplaceable>, StoreError> {
    let mut tasks = Vec::new();
    match &found.kind {
        TargetKind::Agent(_) => {
            for component in &release.components {
                // Checked for every target when the deployment was created (and its labels
                // are the agent's own); a label removed since fails the step loudly.
                let payload = component_payload(release, component, found, policy)
                    .map_err(|e| StoreError::Corrupt(format!("deployment {}: {e}", d.id)))?;
                // On a registry berth is the token server of, the task carries the scope its
                // deliveries mint a pull token for: this component's repository only.
                let credentials = berth_proto::reference::parse_image(&component.image)
                    .ok()
                    .and_then(|image| {
                        crate::infra::registry_token::task_credentials(state, &image)
                    });
                tasks.push((
                    TaskKind::DockerRun,
                    target.agent_id,
                    payload,
                    Credentials::Registry(credentials),
                    component.name.as_str(),
                ));
            }
        }
        TargetKind::Ssh(ssh) => {
            let Some(spec) = &release.ssh else {
                return Err(StoreError::Corrupt(format!(
                    "deployment {}: release {} has no ssh part",
                    d.id, release.name
                )));
            };
            let Some(via) = crate::services::targets::via_agent(state, ssh).await? else {
                return Ok(Err(Unplaceable {
                    code: codes::SSH_VIA_UNAVAILABLE,
                    detail: format!("no agent can act for ssh target {}", ssh.name),
                    hold: Hold::None,
                }));
            };
            let sticker = WriteStickerPayload {
                name: ssh.name.clone(),
                release_id: Some(release.id.to_string()),
                release_name: Some(release.name.clone()),
                image: None,
                digest: None,
                extra: Default::default(),
                ..Default::default()
            };
            let payload = serde_json::to_value(
                spec.payload(crate::services::targets::payload_target(ssh), sticker),
            )
            .map_err(|e| StoreError::Corrupt(format!("deployment {}: {e}", d.id)))?;
            tasks.push((
                TaskKind::SshDeploy,
                via.id,
                payload,
                Credentials::SshKey(ssh),
                "ssh",
            ));
        }
    }
    Ok(Ok(tasks))
}

/// What a refused task means for its target: the code and hold it ends (or waits) with; a
/// refusal a deployment task can never meet is an error, and one from a moved-on deployment
/// voids the step.
fn unplaceable(
    d: &Deployment,
    target: &DeploymentTarget,
    refused: Refused,
) -> Result<Unplaceable, StoreError> {
    let (code, hold) = match &refused {
        Refused::AgentNotFound(_) => (AGENT_DELETED, Hold::None),
        // A component queued before the cordon stays queued; the target is skipped.
        Refused::Cordoned(_) => (codes::AGENT_CORDONED, Hold::Cordoned),
        // The target waits for room in its agent's queue (a rollback fails instead).
        Refused::QueueFull { .. } => (codes::QUEUE_FULL, Hold::QueueFull),
        Refused::CapabilityMissing { .. } => (codes::CAPABILITY_MISSING, Hold::None),
        // A cancel (or another replica's step) committed since this pass read the
        // deployment: the step is void (its record would fail on `version`), and the next
        // pass decides again from what the cancel left.
        Refused::Superseded => {
            return Err(StoreError::Conflict {
                constraint: SUPERSEDED,
            })
        }
        Refused::KeyConflict | Refused::KeyReserved | Refused::NoMatchingAgent { .. } => {
            return Err(StoreError::Corrupt(format!(
                "deployment {} task for {} was refused: {refused:?}",
                d.id, target.agent_name
            )))
        }
    };
    Ok(Unplaceable {
        code,
        detail: describe(&refused, &target.agent_name),
        hold,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_proto::agent::AgentStatus;
    use berth_proto::AgentId;
    use berth_store::Agent;

    fn agent(name: &str, labels: &[(&str, &str)]) -> Target {
        let now = time::OffsetDateTime::UNIX_EPOCH;
        Target::agent(Agent {
            id: AgentId::new(),
            tenant_id: TenantId::new(),
            name: name.into(),
            version: String::new(),
            capabilities: vec![],
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            status: AgentStatus::Online,
            reported_status: AgentStatus::Online,
            environment: None,
            last_heartbeat: None,
            resource_usage: None,
            certificate_fingerprint: None,
            certificate_expires_at: None,
            previous_certificate_fingerprint: None,
            cordoned: false,
            suspended: false,
            generation: 0,
            created_at: now,
            updated_at: now,
        })
    }

    fn component(config: Value) -> Component {
        Component {
            name: "web".into(),
            image: "r/web".into(),
            digest: "sha256:1".into(),
            resolved_from: None,
            config: Some(config),
        }
    }

    #[test]
    fn placeholders_name_the_target_and_nothing_else() {
        let a = agent("qa-1", &[("port", "18080")]);
        let c = component(json!({
            "containerName": "web-{{target.name}}",
            "ports": ["127.0.0.1:{{ target.labels.port }}:8080/tcp"],
            "environment": {"X": "$(id) {{target.name}}"},
        }));
        let config = target_config(&c, &a).unwrap();
        assert_eq!(config["containerName"], "web-qa-1");
        assert_eq!(config["ports"][0], "127.0.0.1:18080:8080/tcp");
        // Substituted as text: nothing else in the string is interpreted.
        assert_eq!(config["environment"]["X"], "$(id) qa-1");
        assert_eq!(container_name(&c, &a).unwrap(), "web-qa-1");

        let missing = component(json!({"ports": ["{{target.labels.nope}}"]}));
        let err = target_config(&missing, &a).unwrap_err();
        assert!(err.contains("qa-1") && err.contains("nope"), "{err}");
        for bad in ["{{target.id}}", "{{env.SECRET}}", "{{target.name"] {
            let c = component(json!({ "containerName": bad }));
            assert!(target_config(&c, &a).is_err(), "{bad}");
        }
        // No config: the component's name is the container's.
        let plain = Component {
            config: None,
            ..component(json!({}))
        };
        assert_eq!(container_name(&plain, &a).unwrap(), "web");
    }

    fn target(tasks: &[TaskId], rollback: &[TaskId]) -> DeploymentTarget {
        DeploymentTarget {
            deployment_id: DeploymentId::new(),
            agent_id: AgentId::new(),
            agent_name: "t".into(),
            wave: 0,
            phase: TargetPhase::Queued,
            tasks: tasks.to_vec(),
            rollback_tasks: rollback.to_vec(),
            error_code: None,
            detail: None,
            started_at: None,
            finished_at: None,
        }
    }

    fn snap(state: TaskState, code: Option<&str>, started: bool) -> Snapshot {
        Snapshot {
            state,
            error_code: code.map(Into::into),
            started,
            phase: None,
        }
    }

    #[test]
    fn a_rollback_that_could_not_be_placed_stays_failed() {
        let a = TaskId::new();
        let t = DeploymentTarget {
            phase: TargetPhase::RollbackFailed,
            error_code: Some("QUEUE_FULL".into()),
            ..target(&[a], &[])
        };
        let tasks = HashMap::from([(a, snap(TaskState::Succeeded, None, false))]);
        assert_eq!(
            phase_of(&t, &tasks),
            (TargetPhase::RollbackFailed, Some("QUEUE_FULL".into()))
        );
    }

    #[test]
    fn a_target_is_only_as_done_as_its_tasks_say() {
        let (a, b) = (TaskId::new(), TaskId::new());
        let t = target(&[a, b], &[]);
        let phase = |sa: Snapshot, sb: Snapshot| phase_of(&t, &HashMap::from([(a, sa), (b, sb)])).0;
        use TaskState::*;
        assert_eq!(
            phase(snap(Pending, None, false), snap(Pending, None, false)),
            TargetPhase::Queued
        );
        assert_eq!(
            phase(snap(Leased, None, true), snap(Pending, None, false)),
            TargetPhase::Deploying
        );
        // The step the agent reported shows.
        let pulling = Snapshot {
            phase: Some(ProgressPhase::Pulling),
            ..snap(Leased, None, true)
        };
        assert_eq!(
            phase(pulling, snap(Pending, None, false)),
            TargetPhase::Pulling
        );
        let health = Snapshot {
            phase: Some(ProgressPhase::Health),
            ..snap(Leased, None, true)
        };
        assert_eq!(
            phase(snap(Succeeded, None, false), health),
            TargetPhase::Health
        );
        assert_eq!(
            phase(snap(Succeeded, None, false), snap(Succeeded, None, false)),
            TargetPhase::Succeeded
        );
        // Unknown holds: never success, even when the other component succeeded.
        assert_eq!(
            phase(snap(Succeeded, None, false), snap(Unknown, None, false)),
            TargetPhase::Unknown
        );
        let (p, code) = phase_of(
            &t,
            &HashMap::from([
                (a, snap(Succeeded, None, false)),
                (b, snap(Failed, Some("HEALTH_CHECK_FAILED"), false)),
            ]),
        );
        assert_eq!(
            (p, code.as_deref()),
            (TargetPhase::Failed, Some("HEALTH_CHECK_FAILED"))
        );
        // A task the store no longer returns is not success either.
        assert_eq!(
            phase_of(&t, &HashMap::from([(a, snap(Succeeded, None, false))])).0,
            TargetPhase::Deploying
        );
        let r = TaskId::new();
        let rolling = target(&[a], &[r]);
        let rb = |s: Snapshot| phase_of(&rolling, &HashMap::from([(r, s)])).0;
        assert_eq!(rb(snap(Pending, None, false)), TargetPhase::RollingBack);
        assert_eq!(rb(snap(Succeeded, None, false)), TargetPhase::RolledBack);
        assert_eq!(
            rb(snap(DeadLetter, None, false)),
            TargetPhase::RollbackFailed
        );
    }
}
