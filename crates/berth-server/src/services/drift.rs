//! Drift: every target of an environment that has a current release is read back once per
//! `driftIntervalSecs` (each target at its own offset in the period, so a fleet's checks
//! spread out), by an `inspect` task whose signed result says which containers run which
//! digest. A target whose containers are missing, stopped or on another digest is `drifted`.
//! Drift is reported (the target's observation, an `environment.drift` event); it is corrected
//! only when the environment says `autoHeal`, by a `heal` deployment of its current release.
//!
//! Like every reconciler this is a sweep over the database: a check is created under a key
//! naming its due time, so a repeated pass finds it again, and a finished check is applied by
//! whichever pass sees it first. Each environment is claimed for its check
//! (`workers::driver`), and due times are the database's clock, so replicas whose clocks
//! differ never read a target back twice in one period.

use std::collections::HashMap;
use std::time::Duration;

use crate::services::deployments::container_name;
use crate::services::targets::{SshTaskError, Target, TargetKind};
use crate::services::tasks::{Origin, Placement, TaskRequest};
use crate::SharedState;
use berth_proto::deploy::{DeploymentKind, Drift, ObservedComponent};
use berth_proto::error::ErrorChain;
use berth_proto::kind::TaskKind;
use berth_proto::payload::{InspectedContainer, ReadStickerPayload};
use berth_proto::{AgentId, TaskId};
use berth_store::{Environment, Release, StoreError, TargetObservation, TaskState};
use serde_json::Value;
use time::OffsetDateTime;

pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(1);
pub(crate) const PAGE: u32 = 100;
const CHECK_TIMEOUT_SECS: u32 = 60;

/// The target's first check is due at an offset in the period derived from its id.
fn offset(agent: AgentId, period: Duration) -> Duration {
    let millis = period.as_millis().max(1) as u64;
    Duration::from_millis(agent.0.as_u128() as u64 % millis)
}

/// `now` is the pass's, the database's clock: a replica whose own clock runs ahead must not find
/// a check due that the others do not.
pub(crate) async fn check_environment(
    state: &SharedState,
    env: &Environment,
    now: OffsetDateTime,
) -> Result<(), StoreError> {
    let Some(current) = &env.current_release else {
        return Ok(());
    };
    let Some(release) = state
        .store
        .get_release(env.tenant_id, &current.name)
        .await?
    else {
        return Ok(());
    };
    let period = Duration::from_secs(env.drift_interval_secs.into());
    let targets = crate::services::targets::matching(state, env).await?;
    let known: HashMap<AgentId, TargetObservation> = state
        .store
        .target_observations(env.id)
        .await?
        .into_iter()
        .map(|o| (o.agent_id, o))
        .collect();
    let mut drifted = false;
    for target in targets {
        let old = known.get(&target.id);
        let mut obs = old.cloned().unwrap_or_else(|| TargetObservation {
            tenant_id: env.tenant_id,
            environment_id: env.id,
            agent_id: target.id,
            check_task_id: None,
            next_check_at: now + offset(target.id, period),
            drift: Drift::Unverified,
            running_release: None,
            components: Vec::new(),
            verified_at: None,
        });
        // A verification from before the current release was set says nothing about it.
        if obs.verified_at.is_some_and(|v| v < env.updated_at) && obs.drift != Drift::Unverified {
            obs.drift = Drift::Unverified;
            obs.next_check_at = now;
        }
        let mut open = false;
        if let Some(id) = obs.check_task_id {
            if let Some((task, _)) = state.store.get_task(env.tenant_id, id).await? {
                let fresh = task
                    .finished_at
                    .is_some_and(|f| f >= env.updated_at && obs.verified_at.is_none_or(|v| v < f));
                if task.state == TaskState::Succeeded && fresh {
                    let (drift, running, components) =
                        observe(&release, &target, task.result.as_ref());
                    obs.drift = drift;
                    obs.running_release = running;
                    obs.components = components;
                    obs.verified_at = task.finished_at;
                }
                open = task.state.is_in_flight();
            }
        }
        if !open && obs.next_check_at <= now {
            if let Some(id) = schedule_check(state, env, &target, obs.next_check_at).await? {
                obs.check_task_id = Some(id);
                obs.next_check_at = now + period;
            }
        }
        if old != Some(&obs) {
            if obs.drift == Drift::Drifted && old.map(|o| o.drift) != Some(Drift::Drifted) {
                tracing::warn!(environment = %env.name, target = %target.name, running = ?obs.running_release, desired = %current.name, "target drifted from the environment's release");
            }
            state.store.put_target_observation(obs.clone()).await?;
        }
        drifted |= obs.drift == Drift::Drifted;
    }
    if drifted && env.auto_heal {
        heal(state, env, &release).await?;
    }
    Ok(())
}

/// Queues the read-back of the target: an `inspect` on an agent; on an SSH target, a
/// `read-sticker` over SSH by its via agent (the sticker `ssh.deploy` wrote names the release).
/// `None` when the agent is gone, or no agent can act for the SSH target.
async fn schedule_check(
    state: &SharedState,
    env: &Environment,
    target: &Target,
    due: OffsetDateTime,
) -> Result<Option<TaskId>, StoreError> {
    let (kind, agent, payload, credentials) = match &target.kind {
        TargetKind::Agent(agent) => (TaskKind::Inspect, agent.id, serde_json::json!({}), None),
        TargetKind::Ssh(ssh) => {
            let (Some(via), Some(release)) = (
                crate::services::targets::via_agent(state, ssh).await?,
                env.current_release.as_ref(),
            ) else {
                return Ok(None);
            };
            let Some(directory) = state
                .store
                .get_release(env.tenant_id, &release.name)
                .await?
                .and_then(|r| r.ssh)
                .map(|s| s.deploy_directory)
            else {
                return Ok(None);
            };
            let key = match crate::services::targets::key_credentials(state, ssh).await {
                Ok(key) => key,
                Err(SshTaskError::Store(e)) => return Err(e),
                Err(e) => {
                    tracing::warn!(environment = %env.name, target = %ssh.name, error = %ErrorChain(&e), "drift: cannot read the ssh target back");
                    return Ok(None);
                }
            };
            let payload = ReadStickerPayload {
                name: ssh.name.clone(),
                ssh_target: Some(crate::services::targets::payload_target(ssh)),
                deploy_directory: Some(directory),
                ..Default::default()
            };
            let payload = serde_json::to_value(payload)
                .map_err(|e| StoreError::Corrupt(format!("read-sticker payload: {e}")))?;
            (TaskKind::ReadSticker, via.id, payload, Some(key))
        }
    };
    let request = TaskRequest {
        tenant: env.tenant_id,
        kind,
        placement: Placement::Agent(agent),
        payload,
        credentials,
        variables: Default::default(),
        timeout_seconds: CHECK_TIMEOUT_SECS,
        priority: 0,
        origin: Origin::Drift {
            environment: env.id,
            target: target.id,
            due,
        },
    };
    // Refused (a cordoned agent, a full queue, a deleted one): no check until it takes work.
    Ok(crate::services::tasks::create(state, request)
        .await?
        .ok()
        .map(|placed| placed.task().id))
}

/// What a read-back says of the target: an `inspect` result, of each component of the release;
/// an SSH target's sticker, of the release as a whole.
fn observe(
    release: &Release,
    target: &Target,
    result: Option<&Value>,
) -> (Drift, Option<String>, Vec<ObservedComponent>) {
    if let TargetKind::Ssh(_) = target.kind {
        let sticker = result.and_then(|r| r.pointer("/outputs/sticker"));
        let field = |name: &str| sticker.and_then(|s| s.get(name)).and_then(Value::as_str);
        let in_sync = field("releaseId") == Some(release.id.to_string().as_str());
        let drift = if in_sync {
            Drift::InSync
        } else {
            Drift::Drifted
        };
        return (drift, field("releaseName").map(str::to_string), Vec::new());
    }
    let containers: Vec<InspectedContainer> = result
        .and_then(|r| r.pointer("/outputs/containers"))
        .and_then(|c| serde_json::from_value(c.clone()).ok())
        .unwrap_or_default();
    let mut in_sync = true;
    let mut running = None;
    let mut components = Vec::new();
    for component in &release.components {
        let name = container_name(component, target).ok();
        let found = containers.iter().find(|c| Some(&c.name) == name.as_ref());
        // The digest the container was created from, not what its labels claim.
        let digest = found.and_then(|c| {
            c.image
                .split_once('@')
                .map(|(_, d)| d.to_string())
                .or_else(|| c.digest.clone())
        });
        let state = found.map(|c| c.state.clone());
        in_sync &= digest.as_deref() == Some(component.digest.as_str())
            && state.as_deref() == Some("running");
        let release_name = found.and_then(|c| c.release_name.clone());
        if running.is_none() {
            running = release_name.clone();
        }
        components.push(ObservedComponent {
            name: component.name.clone(),
            digest,
            release: release_name,
            state,
        });
    }
    let drift = if in_sync {
        Drift::InSync
    } else {
        Drift::Drifted
    };
    (drift, running, components)
}

/// Redeploys the environment's current release, unless a deployment is already running there.
async fn heal(state: &SharedState, env: &Environment, release: &Release) -> Result<(), StoreError> {
    // A cordoned target is left out, as a deploy leaves it out.
    let mut targets = crate::services::targets::matching(state, env).await?;
    targets.retain(|t| !t.cordoned());
    if targets.is_empty() {
        return Ok(());
    }
    let created = crate::services::deployments::create(
        state,
        env,
        release,
        DeploymentKind::Heal,
        env.created_by.clone(),
        &targets,
    )
    .await;
    match created {
        Ok(d) => {
            tracing::info!(environment = %env.name, deployment_id = %d.deployment.id, "drift: healing with the current release");
            Ok(())
        }
        Err(StoreError::Conflict {
            constraint: "deployment_in_progress",
        }) => Ok(()),
        Err(e) => Err(e),
    }
}
