//! Environments and the deployments asked of them: create, list, show, status, unpin, rollback,
//! readiness and verify; plan, create, list, show, approve and cancel a deployment. The rollout
//! itself is `services::deployments`'; these check a request and write what was asked.

use axum::http::StatusCode;
use berth_proto::deploy::{
    valid_environment_name, ApprovalView, CreateDeployment, CreateEnvironment, DeploymentKind,
    DeploymentList, DeploymentPlan, DeploymentTargetView, DeploymentView, Drift, EnvironmentList,
    EnvironmentStatus, EnvironmentView, ListDeployments, PlanComponent, PlanTarget, PlanWave,
    SkippedTarget, TargetStatus, TargetType, DEFAULT_DRIFT_INTERVAL_SECS,
};
use berth_proto::error::codes;
use berth_proto::kind::TaskKind;
use berth_proto::readiness::{EnvironmentReadiness, VerifyResponse};
use berth_proto::{DeploymentId, EnvironmentId};
use berth_store::{
    ApproveOutcome, DeploymentDetail, Environment, Release, StoreError, TargetObservation,
};

use crate::infra::error::{ApiError, ApiResult};
use crate::services::caller::actor;
use crate::services::caller::Caller;
use crate::services::targets::{Target, TargetKind};
use crate::services::validate::validate_labels;
use crate::SharedState;

/// Seconds a health check may be given at most.
const MAX_HEALTH_TIMEOUT_SECS: u64 = 3600;
/// A deploy task's longest timeout: a day, as for any task.
const MAX_TASK_TIMEOUT_SECS: u64 = 86_400;

fn invalid(detail: impl Into<String>) -> ApiError {
    ApiError::unprocessable(codes::INVALID_REQUEST, detail)
}

fn env_view(e: Environment) -> EnvironmentView {
    EnvironmentView {
        id: e.id,
        name: e.name,
        tier: e.tier,
        selector: e.selector,
        target_type: e.target_type,
        policy: e.policy,
        promote_from: e.promote_from,
        approvals: e.approvals,
        auto_heal: e.auto_heal,
        drift_interval_secs: e.drift_interval_secs,
        current_release: e.current_release.map(|r| r.name),
        previous_release: e.previous_release.map(|r| r.name),
        pinned_release: e.pinned_release.map(|r| r.name),
        created_at: e.created_at,
        updated_at: e.updated_at,
    }
}

pub(crate) fn deployment_view(d: DeploymentDetail) -> DeploymentView {
    let DeploymentDetail {
        deployment: dep,
        targets,
        approvals,
    } = d;
    DeploymentView {
        id: dep.id,
        environment: dep.environment_name,
        environment_id: dep.environment_id,
        release: dep.release.name,
        kind: dep.kind,
        state: dep.state,
        rolling_back: dep.rolling_back,
        requested_by: dep.requested_by,
        rollback_release: dep.rollback_release.map(|r| r.name),
        approvals_required: dep.approvals_required,
        approvals: approvals
            .into_iter()
            .map(|a| ApprovalView {
                by: a.actor,
                at: a.approved_at,
            })
            .collect(),
        cancel_requested: dep.cancel_requested,
        current_wave: dep.current_wave,
        targets: targets
            .into_iter()
            .map(|t| DeploymentTargetView {
                agent_id: t.agent_id,
                agent_name: t.agent_name,
                wave: t.wave,
                phase: t.phase,
                tasks: t.tasks,
                rollback_tasks: t.rollback_tasks,
                error_code: t.error_code,
                detail: t.detail,
                started_at: t.started_at,
                finished_at: t.finished_at,
            })
            .collect(),
        error_code: dep.error_code,
        detail: dep.detail,
        created_at: dep.created_at,
        updated_at: dep.updated_at,
        finished_at: dep.finished_at,
    }
}

pub(crate) fn environment_not_found(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        codes::ENVIRONMENT_NOT_FOUND,
        format!("no environment named {name:?}"),
    )
}

pub(crate) async fn environment(
    state: &SharedState,
    caller: &Caller,
    name: &str,
) -> ApiResult<Environment> {
    state
        .store
        .get_environment(caller.tenant(), name)
        .await?
        .ok_or_else(|| environment_not_found(name))
}

/// Create an environment: its tier, the agent labels that select its targets, its rollout
/// policy, promotion rule, approvals (default one for prod) and drift read-back period.
pub async fn create_environment(
    state: &SharedState,
    caller: &Caller,
    req: CreateEnvironment,
) -> ApiResult<(StatusCode, EnvironmentView)> {
    caller.require_admin()?;
    if !valid_environment_name(&req.name) {
        return Err(invalid(
            "name must be 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit",
        ));
    }
    if req.selector.is_empty() {
        return Err(invalid(
            "selector needs at least one label: an environment never selects every agent",
        ));
    }
    validate_labels(&req.selector)?;
    let policy = req.policy;
    if policy.max_parallel == 0 {
        return Err(invalid("policy.maxParallel must be at least 1"));
    }
    if !(1..=MAX_HEALTH_TIMEOUT_SECS).contains(&policy.health_timeout_secs) {
        return Err(invalid(format!(
            "policy.healthTimeoutSecs must be 1..={MAX_HEALTH_TIMEOUT_SECS}"
        )));
    }
    if !(policy.health_timeout_secs..=MAX_TASK_TIMEOUT_SECS).contains(&policy.task_timeout_secs) {
        return Err(invalid(format!(
            "policy.taskTimeoutSecs must be at least healthTimeoutSecs and at most \
             {MAX_TASK_TIMEOUT_SECS}"
        )));
    }
    let drift_interval_secs = req
        .drift_interval_secs
        .unwrap_or(DEFAULT_DRIFT_INTERVAL_SECS);
    if drift_interval_secs == 0 {
        return Err(invalid("driftIntervalSecs must be at least 1"));
    }
    if let Some(from) = &req.promote_from {
        if from == &req.name
            || state
                .store
                .get_environment(caller.tenant(), from)
                .await?
                .is_none()
        {
            return Err(ApiError::unprocessable(
                codes::ENVIRONMENT_NOT_FOUND,
                format!("promoteFrom names {from:?}, which is not another environment"),
            ));
        }
    }
    let now = state.config.clock.now();
    let env = Environment {
        id: EnvironmentId::new(),
        tenant_id: caller.tenant(),
        name: req.name,
        tier: req.tier,
        selector: req.selector,
        target_type: req.target_type,
        policy,
        promote_from: req.promote_from,
        approvals: req.approvals.unwrap_or(req.tier.default_approvals()),
        auto_heal: req.auto_heal,
        drift_interval_secs,
        current_release: None,
        previous_release: None,
        pinned_release: None,
        created_by: actor(caller),
        created_at: now,
        updated_at: now,
    };
    match state.store.create_environment(env, actor(caller)).await {
        Ok(env) => Ok((StatusCode::CREATED, env_view(env))),
        Err(StoreError::Conflict {
            constraint: "environment_name",
        }) => Err(ApiError::conflict(
            codes::ENVIRONMENT_EXISTS,
            "the tenant has an environment of that name",
        )),
        Err(e) => Err(e.into()),
    }
}

/// Every environment of the tenant, by name.
pub async fn list_environments(state: &SharedState, caller: &Caller) -> ApiResult<EnvironmentList> {
    caller.can_read()?;
    let items = state.store.list_environments(caller.tenant()).await?;
    Ok(EnvironmentList {
        items: items.into_iter().map(env_view).collect(),
    })
}

/// One environment.
pub async fn get_environment(
    state: &SharedState,
    caller: &Caller,
    name: String,
) -> ApiResult<EnvironmentView> {
    caller.can_read()?;
    Ok(env_view(environment(state, caller, &name).await?))
}

/// Each target's desired release against what its last verified read-back found, and when.
pub async fn environment_status(
    state: &SharedState,
    caller: &Caller,
    name: String,
) -> ApiResult<EnvironmentStatus> {
    caller.can_read()?;
    let env = environment(state, caller, &name).await?;
    let targets = crate::services::targets::matching(state, &env).await?;
    let observations = state.store.target_observations(env.id).await?;
    let desired = env.current_release.as_ref().map(|r| r.name.clone());
    let targets = targets
        .into_iter()
        .map(|target| {
            let obs = observations.iter().find(|o| o.agent_id == target.id);
            target_status(&target, desired.clone(), obs, &env)
        })
        .collect();
    Ok(EnvironmentStatus {
        environment: env_view(env),
        targets,
    })
}

fn target_status(
    target: &Target,
    desired_release: Option<String>,
    obs: Option<&TargetObservation>,
    env: &Environment,
) -> TargetStatus {
    // A verification older than the current release says nothing about it.
    let current = obs.filter(|o| o.verified_at.is_some_and(|v| v >= env.updated_at));
    TargetStatus {
        agent_id: target.id,
        agent_name: target.name.clone(),
        desired_release,
        running_release: obs.and_then(|o| o.running_release.clone()),
        drift: current.map_or(Drift::Unverified, |o| o.drift),
        components: obs.map(|o| o.components.clone()).unwrap_or_default(),
        verified_at: obs.and_then(|o| o.verified_at),
        check_task_id: obs.and_then(|o| o.check_task_id),
    }
}

/// Lift the pin a rollback set: any release may be deployed again.
pub async fn unpin_environment(
    state: &SharedState,
    caller: &Caller,
    name: String,
) -> ApiResult<EnvironmentView> {
    caller.require_deployer()?;
    let env = state
        .store
        .unpin_environment(
            caller.tenant(),
            &name,
            actor(caller),
            state.config.clock.now(),
        )
        .await?;
    env.map(env_view)
        .ok_or_else(|| environment_not_found(&name))
}

/// Deploy the environment's previous successful release to every target and pin the
/// environment to it, so the bad release cannot come back until `unpin`. No approval: it
/// returns to a release the environment already ran.
pub async fn rollback_environment(
    state: &SharedState,
    caller: &Caller,
    name: String,
) -> ApiResult<(StatusCode, DeploymentView)> {
    caller.require_deployer()?;
    let env = environment(state, caller, &name).await?;
    let previous = env.previous_release.clone().ok_or_else(|| {
        ApiError::conflict(
            codes::NO_PREVIOUS_RELEASE,
            format!("environment {name:?} has no earlier successful release to return to"),
        )
    })?;
    let release = release(state, caller, &previous.name).await?;
    let (targets, _) = targets(state, &env, &release).await?;
    start(
        state,
        &env,
        &release,
        DeploymentKind::Rollback,
        caller,
        &targets,
    )
    .await
}

async fn release(state: &SharedState, caller: &Caller, name: &str) -> ApiResult<Release> {
    state
        .store
        .get_release(caller.tenant(), name)
        .await?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                codes::RELEASE_NOT_FOUND,
                format!("no release named {name:?}"),
            )
        })
}

/// The environment's targets for this release: at least one, each able to run it, and the ones
/// it selects but leaves out because they are cordoned. Agents run a component release
/// (`docker.run` per component); SSH targets a release's `ssh` part.
async fn targets(
    state: &SharedState,
    env: &Environment,
    release: &Release,
) -> ApiResult<(Vec<Target>, Vec<SkippedTarget>)> {
    match env.target_type {
        TargetType::Agents if release.components.is_empty() || release.compose_lock.is_some() => {
            return Err(ApiError::unprocessable(
                codes::RELEASE_TARGET_MISMATCH,
                format!(
                    "release {:?} has no components to run, or is a compose release; \
                     environments of agents deploy component releases (docker.run per \
                     component) only",
                    release.name
                ),
            ));
        }
        TargetType::Ssh if release.ssh.is_none() => {
            return Err(ApiError::unprocessable(
                codes::RELEASE_TARGET_MISMATCH,
                format!(
                    "release {:?} has no ssh part, and environment {:?} deploys to ssh targets",
                    release.name, env.name
                ),
            ));
        }
        _ => {}
    }
    let (targets, skipped): (Vec<Target>, Vec<Target>) =
        crate::services::targets::matching(state, env)
            .await?
            .into_iter()
            .partition(|t| !t.cordoned());
    let skipped: Vec<SkippedTarget> = skipped
        .into_iter()
        .map(|t| SkippedTarget {
            agent_id: t.id,
            agent_name: t.name,
            reason: codes::AGENT_CORDONED.to_string(),
        })
        .collect();
    if targets.is_empty() {
        return Err(ApiError::unprocessable(
            codes::NO_TARGETS,
            format!(
                "no uncordoned {} carries the labels of environment {:?} ({})",
                match env.target_type {
                    TargetType::Agents => "agent",
                    TargetType::Ssh => "ssh target",
                },
                env.name,
                env.selector
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let kind = match env.target_type {
        TargetType::Agents => TaskKind::DockerRun,
        TargetType::Ssh => TaskKind::SshDeploy,
    };
    let mut unable = Vec::new();
    for target in &targets {
        let able = match &target.kind {
            TargetKind::Agent(agent) => crate::services::tasks::can_run(agent, kind),
            TargetKind::Ssh(ssh) => crate::services::targets::via_agent(state, ssh)
                .await?
                .is_some(),
        };
        if !able {
            unable.push(target.name.as_str());
        }
    }
    if !unable.is_empty() {
        return Err(match env.target_type {
            TargetType::Agents => ApiError::unprocessable(
                codes::CAPABILITY_MISSING,
                format!(
                    "these targets do not report the {:?} capability: {}",
                    kind.required_capability(),
                    unable.join(", ")
                ),
            ),
            TargetType::Ssh => ApiError::unprocessable(
                codes::SSH_VIA_UNAVAILABLE,
                format!(
                    "no online agent can act for these ssh targets: {}",
                    unable.join(", ")
                ),
            ),
        });
    }
    // Every target's config must render and pass the kind's payload checks now, not in a wave.
    for target in &targets {
        for component in &release.components {
            let TargetKind::Agent(_) = target.kind else {
                break;
            };
            let payload = crate::services::deployments::component_payload(
                release,
                component,
                target,
                &env.policy,
            )
            .map_err(invalid)?;
            kind.check_payload(&payload).map_err(|e| {
                ApiError::unprocessable(
                    codes::INVALID_PAYLOAD,
                    format!("component {} on {}: {e}", component.name, target.name),
                )
            })?;
        }
    }
    Ok((targets, skipped))
}

/// Everything a deployment of `req` needs, checked in the order an operator fixes them: the
/// environment and release exist, the pin and the promotion rule allow it, and there are
/// targets that can run it.
async fn prepare(
    state: &SharedState,
    caller: &Caller,
    req: &CreateDeployment,
) -> ApiResult<(Environment, Release, Vec<Target>, Vec<SkippedTarget>)> {
    let env = environment(state, caller, &req.environment).await?;
    let release = release(state, caller, &req.release).await?;
    if let Some(pin) = env.pinned_release.as_ref().filter(|p| p.id != release.id) {
        return Err(ApiError::conflict(
            codes::ENVIRONMENT_PINNED,
            format!(
                "environment {:?} is pinned to release {:?} by a rollback; `berth env unpin {}` \
                 before deploying {:?}",
                env.name, pin.name, env.name, release.name
            ),
        ));
    }
    if let Some(from) = &env.promote_from {
        if !state
            .store
            .succeeded_in(caller.tenant(), from, release.id)
            .await?
        {
            return Err(ApiError::conflict(
                codes::PROMOTION_REQUIRED,
                format!(
                    "release {:?} must succeed in {from:?} before it is deployed to {:?}",
                    release.name, env.name
                ),
            ));
        }
    }
    let (targets, skipped) = targets(state, &env, &release).await?;
    Ok((env, release, targets, skipped))
}

async fn start(
    state: &SharedState,
    env: &Environment,
    release: &Release,
    kind: DeploymentKind,
    caller: &Caller,
    targets: &[Target],
) -> ApiResult<(StatusCode, DeploymentView)> {
    match crate::services::deployments::create(state, env, release, kind, actor(caller), targets)
        .await
    {
        Ok(d) => Ok((StatusCode::CREATED, deployment_view(d))),
        Err(StoreError::Conflict {
            constraint: "deployment_in_progress",
        }) => Err(ApiError::conflict(
            codes::DEPLOYMENT_IN_PROGRESS,
            format!(
                "environment {:?} has a deployment that has not finished; wait for it or \
                 cancel it",
                env.name
            ),
        )),
        Err(e) => Err(e.into()),
    }
}

/// Deploy a release into an environment: one `docker.run` task per component per target, in
/// waves of the environment's `maxParallel`. It waits in `awaiting_approval` when the
/// environment needs approvals.
pub async fn create(
    state: &SharedState,
    caller: &Caller,
    req: CreateDeployment,
) -> ApiResult<(StatusCode, DeploymentView)> {
    caller.require_deployer()?;
    let (env, release, targets, _) = prepare(state, caller, &req).await?;
    if env.policy.require_ready {
        let readiness = readiness_view(state, &env).await?;
        if !readiness.operational_ready {
            let why = readiness.not_true();
            return Err(ApiError::conflict(
                codes::ENV_NOT_READY,
                format!(
                    "environment {:?} requires readiness and is not OperationalReady for \
                     generation {}: {}; `berth env verify {}`",
                    env.name,
                    readiness.generation,
                    if why.is_empty() {
                        "no completed pass yet".to_string()
                    } else {
                        why.join(", ")
                    },
                    env.name
                ),
            ));
        }
    }
    start(
        state,
        &env,
        &release,
        DeploymentKind::Deploy,
        caller,
        &targets,
    )
    .await
}

/// What a deployment would do, per wave and target: each target's release and digests as its
/// last verified read-back found them, and the new digest per component; and the selected
/// agents it would skip (cordoned). Changes nothing.
pub async fn plan(
    state: &SharedState,
    caller: &Caller,
    req: CreateDeployment,
) -> ApiResult<DeploymentPlan> {
    caller.can_read()?;
    let (env, release, targets, skipped) = prepare(state, caller, &req).await?;
    let observations = state.store.target_observations(env.id).await?;
    let waves = crate::services::deployments::waves(&targets, &env.policy)
        .map(|(wave, chunk)| PlanWave {
            wave,
            targets: chunk
                .iter()
                .map(|target| {
                    let obs = observations.iter().find(|o| o.agent_id == target.id);
                    PlanTarget {
                        agent_id: target.id,
                        agent_name: target.name.clone(),
                        current_release: obs.and_then(|o| o.running_release.clone()),
                        verified_at: obs.and_then(|o| o.verified_at),
                        components: release
                            .components
                            .iter()
                            .map(|c| {
                                let current = obs
                                    .and_then(|o| o.components.iter().find(|oc| oc.name == c.name))
                                    .and_then(|oc| oc.digest.clone());
                                PlanComponent {
                                    name: c.name.clone(),
                                    changes: current.as_deref() != Some(c.digest.as_str()),
                                    current_digest: current,
                                    new_digest: c.digest.clone(),
                                }
                            })
                            .collect(),
                    }
                })
                .collect(),
        })
        .collect();
    Ok(DeploymentPlan {
        environment: env.name,
        release: release.name,
        rollback_release: env.current_release.map(|r| r.name),
        approvals: env.approvals,
        waves,
        skipped,
    })
}

/// The tenant's deployments, oldest first unless `order=newest`, optionally of one environment.
pub async fn list(
    state: &SharedState,
    caller: &Caller,
    query: ListDeployments,
) -> ApiResult<DeploymentList> {
    caller.can_read()?;
    let environment_id = match &query.environment {
        Some(name) => Some(environment(state, caller, name).await?.id),
        None => None,
    };
    let after: Option<DeploymentId> = crate::services::validate::cursor(query.cursor.as_deref())?;
    let limit = query.limit.unwrap_or(100).clamp(1, 500);
    let page = state
        .store
        .list_deployments(
            caller.tenant(),
            environment_id,
            after,
            query.order.unwrap_or_default(),
            limit,
        )
        .await?;
    let mut items = Vec::with_capacity(page.items.len());
    for d in page.items {
        if let Some(detail) = state.store.get_deployment(caller.tenant(), d.id).await? {
            items.push(deployment_view(detail));
        }
    }
    Ok(DeploymentList {
        items,
        next_cursor: page.next.map(|n| n.to_string()),
    })
}

async fn deployment(
    state: &SharedState,
    caller: &Caller,
    id: DeploymentId,
) -> ApiResult<DeploymentDetail> {
    state
        .store
        .get_deployment(caller.tenant(), id)
        .await?
        .ok_or_else(|| not_found(id))
}

fn not_found(id: DeploymentId) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        codes::DEPLOYMENT_NOT_FOUND,
        format!("no deployment {id}"),
    )
}

/// One deployment: its state, waves and targets (phase, tasks, failure codes), approvals.
pub async fn get(
    state: &SharedState,
    caller: &Caller,
    id: DeploymentId,
) -> ApiResult<DeploymentView> {
    caller.can_read()?;
    Ok(deployment_view(deployment(state, caller, id).await?))
}

/// Approve a deployment that awaits approval. The requester's own token cannot; once enough
/// other tokens approved, it starts.
pub async fn approve(
    state: &SharedState,
    caller: &Caller,
    id: DeploymentId,
) -> ApiResult<DeploymentView> {
    caller.require_deployer()?;
    let current = deployment(state, caller, id).await?;
    if let berth_proto::audit::AuditActor::Token { id: requester, .. } =
        &current.deployment.requested_by
    {
        if *requester == caller.0.id.0 {
            return Err(ApiError::forbidden(
                codes::SELF_APPROVAL,
                "the token that requested a deployment cannot approve it",
            ));
        }
    }
    match state
        .store
        .approve_deployment(caller.tenant(), id, actor(caller), state.config.clock.now())
        .await?
    {
        Some(ApproveOutcome::Approved(d)) => Ok(deployment_view(d)),
        Some(ApproveOutcome::NotAwaiting(d)) => Err(ApiError::conflict(
            codes::DEPLOYMENT_STATE,
            format!(
                "deployment {id} is {}, not awaiting approval",
                d.deployment.state.as_str()
            ),
        )),
        None => Err(not_found(id)),
    }
}

/// Cancel a deployment: one that waits ends at once; a running one stops after its running
/// wave (the targets it already updated keep the new release). A finished one is unchanged.
pub async fn cancel(
    state: &SharedState,
    caller: &Caller,
    id: DeploymentId,
) -> ApiResult<DeploymentView> {
    caller.require_deployer()?;
    state
        .store
        .cancel_deployment(caller.tenant(), id, actor(caller), state.config.clock.now())
        .await?
        .map(deployment_view)
        .ok_or_else(|| not_found(id))
}

/// The environment's readiness conditions as its last pass left them.
pub async fn get_readiness(
    state: &SharedState,
    caller: &Caller,
    name: String,
) -> ApiResult<EnvironmentReadiness> {
    caller.can_read()?;
    let env = environment(state, caller, &name).await?;
    Ok(readiness_view(state, &env).await?)
}

pub(crate) async fn readiness_view(
    state: &SharedState,
    env: &berth_store::Environment,
) -> Result<EnvironmentReadiness, berth_store::StoreError> {
    let stored = state.store.get_readiness(env.tenant_id, env.id).await?;
    // Ready only for the spec the environment has now (a release moved since: not yet).
    let current = crate::services::readiness::current(state, env)
        .await?
        .is_some();
    Ok(match stored {
        None => EnvironmentReadiness {
            environment: env.name.clone(),
            generation: 0,
            operational_ready: false,
            conditions: Vec::new(),
            verify_request: None,
            verify_observed: None,
        },
        Some(r) => EnvironmentReadiness {
            environment: env.name.clone(),
            generation: r.generation,
            operational_ready: r.operational_ready && current,
            conditions: r.conditions,
            verify_request: r.verify_request,
            verify_observed: r.verify_observed,
        },
    })
}

/// Ask for a completely fresh readiness pass (no result of an earlier pass is reused). The
/// answer's nonce becomes `verifyObserved` once every condition of that pass is terminal.
pub async fn verify(
    state: &SharedState,
    caller: &Caller,
    name: String,
) -> ApiResult<(StatusCode, VerifyResponse)> {
    caller.require_deployer()?;
    let env = environment(state, caller, &name).await?;
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    state
        .store
        .request_verify(&env, &nonce, actor(caller), state.config.clock.now())
        .await?;
    Ok((StatusCode::ACCEPTED, VerifyResponse { nonce }))
}
