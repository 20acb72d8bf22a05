//! Readiness (issue 14, seed 003's "Readiness flow"): each environment's seven conditions,
//! evaluated in order by passes, each pass fresh (nothing kept from an earlier one).
//!
//! A pass starts when the environment's generation changes, or when an operator's `verify`
//! set a nonce no pass has answered yet. The generation counts the environment's spec
//! revisions: a change of its current, previous or pinned release (each moves `updated_at`) or
//! of its desired bundle is a new one. Within a pass:
//!
//! 1. `Configured`: the current release resolves, and each component's digest is asked of its
//!    registry (`registry.rs`, the manifest by digest; credentials are never stored, so a
//!    registry that wants them is `REGISTRY_UNAUTHORIZED`).
//! 2. `TargetsReachable`: each selected target is online with a heartbeat within three
//!    intervals (an SSH target: its via agent).
//! 3. `CapabilitiesMatch`: each target's agent reports the capability of the release's kind.
//! 4. `SecretsResolvable`: each secrets-manifest entry of the desired bundle exists; builtin
//!    ones by the store's row (never opened). OpenBao-backed ones are resolved by an agent: the
//!    pass's first probe carries them, with a `lease` grant minted for that probe alone (it
//!    supersedes nothing, so the environment's running agents keep theirs, and expires with the
//!    probe) sealed in the task's credentials; the agent logs in and reads each entry as an
//!    apply would, and reports only which did not resolve. No value reaches the server.
//! 5. to 7. One `readiness-probe` task per reachable host, keyed by the pass (so the next
//!    pass never reuses it). Its verified, signed result is `RoutesExecutable` for that host;
//!    its report gives `RegistryReachable` (each registry's `/v2/` from the host) and `Healthy`
//!    (the Docker engine answers, and each of the release's containers runs and is not
//!    unhealthy). A probe not finished yet is `Unknown` (transient: the pass stays open) until
//!    [`PROBE_DEADLINE`], then `PROBE_TIMEOUT`.
//!
//! A completed pass is also refreshed every `driftIntervalSecs`. The pass is complete once
//! every condition is terminal; only then is `operationalReady` written (until then it is the
//! last completed pass's of the same generation; a new generation starts at false), and the
//! nonce it was started for echoed as `verifyObserved`. Like every reconciler
//! this is a sweep: a crash between steps only delays the pass. Each environment is claimed
//! while a replica works its pass (`workers::driver`), so no two replicas mint its grant.

use std::collections::BTreeMap;
use std::time::Duration;

use crate::infra::registry::ResolveError;
use crate::services::targets::{Target, TargetKind};
use crate::services::tasks::{Origin, Placement, TaskRequest};
use crate::SharedState;
use berth_proto::kind::TaskKind;
use berth_proto::payload::{
    ReadinessProbePayload, SecretsProbe, SecretsProbeEntry, OPENBAO_LOGIN_JWT_CREDENTIAL,
};
use berth_proto::readiness::{reasons, Condition, ConditionStatus, ConditionType, ProbeReport};
use berth_proto::reference::parse_image;
use berth_proto::{AgentId, TaskId};
use berth_store::{Environment, Readiness, ReadinessPass, Release, StoreError, TaskState};
use time::OffsetDateTime;

/// What one host's probe said: its report, or why there is none (a reason and a message).
type ProbeOutcome = Result<ProbeReport, (String, String)>;

pub(crate) const SWEEP_EVERY: Duration = Duration::from_secs(1);
pub(crate) const PAGE: u32 = 100;
const PROBE_TIMEOUT_SECS: u32 = 60;
/// How long a pass waits for a probe before it calls it `PROBE_TIMEOUT`.
pub const PROBE_DEADLINE: Duration = Duration::from_secs(120);
/// Probes run before the host's queued work (a read-back still goes first).
const PROBE_PRIORITY: i32 = 1000;
/// A probe's OpenBao grant outlives the longest wait for its probe, and no more.
const PROBE_GRANT_TTL: time::Duration =
    time::Duration::seconds(PROBE_DEADLINE.as_secs() as i64 + 60);

/// How a pass learns whether the desired bundle's secrets resolve.
enum SecretsVerdict {
    /// Known on the server (builtin secrets, nothing to check, a bundle it cannot read).
    Decided(Condition),
    /// OpenBao-backed: the pass's first probe resolves them.
    ByAgent(SecretsProbe),
}

/// What the generation is counted for: everything a condition depends on that an operator
/// changes on the environment.
async fn spec_of(state: &SharedState, env: &Environment) -> Result<String, StoreError> {
    let desired = state
        .store
        .desired_environment(env.tenant_id, &env.name)
        .await?
        .and_then(|d| d.desired_sha);
    let id = |r: &Option<berth_store::ReleaseRef>| r.as_ref().map(|r| r.id.to_string());
    Ok(format!(
        "current={:?} pinned={:?} updated={} desired={:?}",
        id(&env.current_release),
        id(&env.pinned_release),
        env.updated_at.unix_timestamp_nanos() / 1_000_000,
        desired
    ))
}

fn condition(
    kind: ConditionType,
    status: ConditionStatus,
    reason: &str,
    message: impl Into<String>,
    at: OffsetDateTime,
    generation: i64,
) -> Condition {
    Condition {
        kind,
        status,
        reason: reason.to_string(),
        message: message.into(),
        observed_at: at,
        generation,
    }
}

/// Whether the stored readiness answers for the environment as it is now: its spec summary
/// and a completed pass. The deployment gate (`requireReady`) asks this.
pub(crate) async fn current(
    state: &SharedState,
    env: &Environment,
) -> Result<Option<Readiness>, StoreError> {
    let Some(r) = state.store.get_readiness(env.tenant_id, env.id).await? else {
        return Ok(None);
    };
    let fresh = r.spec == spec_of(state, env).await?;
    Ok(fresh.then_some(r))
}

/// The id of the pass that starts from the stored row at `version`: derived, not random, so two
/// replicas that start the same pass at once give it the same id, and so the same probe keys,
/// and queue each probe once (the compare-and-set then keeps one of their writes).
fn pass_id(env: &Environment, version: i64, generation: i64) -> uuid::Uuid {
    let digest = berth_crypto::sha256(
        format!("berth.readiness.pass:{}:{version}:{generation}", env.id).as_bytes(),
    );
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    uuid::Builder::from_custom_bytes(bytes).into_uuid()
}

/// `now` is the pass's (the database's clock), so whether a completed pass is stale is the same
/// question on every replica.
pub(crate) async fn reconcile(
    state: &SharedState,
    env: &Environment,
    now: OffsetDateTime,
) -> Result<(), StoreError> {
    let stored = state.store.get_readiness(env.tenant_id, env.id).await?;
    let spec = spec_of(state, env).await?;
    let mut r = stored.clone().unwrap_or_else(|| Readiness {
        tenant_id: env.tenant_id,
        environment_id: env.id,
        generation: 0,
        spec: String::new(),
        conditions: Vec::new(),
        operational_ready: false,
        pass: None,
        verify_request: None,
        verify_observed: None,
        version: 0,
        updated_at: now,
    });
    let new_generation = r.spec != spec;
    if new_generation {
        r.generation += 1;
        r.spec = spec;
    }
    // A nonce no pass answered yet, and no pass in flight for it: a fresh pass.
    let open_nonce = r
        .verify_request
        .clone()
        .filter(|n| r.verify_observed.as_ref() != Some(n));
    let nonce_unserved =
        open_nonce.is_some() && r.pass.as_ref().and_then(|p| p.nonce.clone()) != open_nonce;
    // A completed pass is refreshed every `driftIntervalSecs`, as drift is read back: a target
    // that went away since is noticed without a verify.
    let refresh = time::Duration::seconds(env.drift_interval_secs.into());
    let stale = r
        .pass
        .as_ref()
        .is_some_and(|p| p.complete && now >= p.started_at + refresh);
    if new_generation || r.pass.is_none() || nonce_unserved || stale {
        r.pass = Some(ReadinessPass {
            id: pass_id(env, stored.as_ref().map_or(0, |s| s.version), r.generation),
            started_at: now,
            nonce: open_nonce,
            probes: Vec::new(),
            complete: false,
        });
        r.conditions = ConditionType::ALL
            .into_iter()
            .map(|kind| {
                condition(
                    kind,
                    ConditionStatus::Unknown,
                    reasons::PENDING,
                    "not evaluated yet",
                    now,
                    r.generation,
                )
            })
            .collect();
        // Within a generation, readiness is the last completed pass's until this one completes.
        if new_generation {
            r.operational_ready = false;
        }
    } else if r.pass.as_ref().is_some_and(|p| p.complete) {
        return Ok(());
    }
    evaluate(state, env, &mut r, now).await?;
    if stored.as_ref() == Some(&r) {
        return Ok(());
    }
    r.updated_at = now;
    let expected = stored.map(|s| s.version);
    if state.store.put_readiness(r.clone(), expected).await?
        && r.pass.as_ref().is_some_and(|p| p.complete)
    {
        {
            tracing::info!(environment = %env.name, generation = r.generation, ready = r.operational_ready, "readiness pass complete");
        }
    }
    Ok(())
}

/// What one step of a pass reads once and every condition's evaluator shares.
struct PassInputs {
    release: Option<Release>,
    targets: Vec<Target>,
    /// Each target's probe host: the agent itself, or an SSH target's via agent.
    hosts: Vec<(Target, Option<berth_store::Agent>)>,
    /// A host whose last heartbeat is older than this is not reachable.
    live_after: OffsetDateTime,
    now: OffsetDateTime,
    generation: i64,
}

impl PassInputs {
    async fn read(
        state: &SharedState,
        env: &Environment,
        now: OffsetDateTime,
        generation: i64,
    ) -> Result<Self, StoreError> {
        let release = match &env.current_release {
            Some(current) => {
                state
                    .store
                    .get_release(env.tenant_id, &current.name)
                    .await?
            }
            None => None,
        };
        let targets = crate::services::targets::matching(state, env).await?;
        let mut hosts: Vec<(Target, Option<berth_store::Agent>)> = Vec::new();
        for target in &targets {
            let host = match &target.kind {
                TargetKind::Agent(agent) => Some((**agent).clone()),
                TargetKind::Ssh(ssh) => crate::services::targets::via_agent(state, ssh).await?,
            };
            hosts.push((target.clone(), host));
        }
        let live_after = now
            - time::Duration::try_from(state.config.heartbeat_interval * 3)
                .unwrap_or(time::Duration::seconds(90));
        Ok(Self {
            release,
            targets,
            hosts,
            live_after,
            now,
            generation,
        })
    }

    fn reachable(&self, host: &Option<berth_store::Agent>) -> bool {
        host.as_ref().is_some_and(|a| {
            a.status == berth_proto::agent::AgentStatus::Online
                && a.last_heartbeat.is_some_and(|h| h >= self.live_after)
        })
    }

    fn condition(
        &self,
        kind: ConditionType,
        status: ConditionStatus,
        reason: &str,
        message: impl Into<String>,
    ) -> Condition {
        condition(kind, status, reason, message, self.now, self.generation)
    }

    /// The registries the release's images name, each once.
    fn registries(&self) -> Vec<String> {
        self.release
            .as_ref()
            .map(|rel| {
                let mut hosts: Vec<String> = rel
                    .components
                    .iter()
                    .filter_map(|c| parse_image(&c.image).ok())
                    .map(|i| i.registry().to_string())
                    .collect();
                hosts.sort();
                hosts.dedup();
                hosts
            })
            .unwrap_or_default()
    }
}

/// What this step's probes said: each host's outcome, and the hosts whose probe runs still.
struct Probes {
    reports: Vec<(String, ProbeOutcome)>,
    pending: Vec<String>,
}

impl Probes {
    /// A condition the probes decide, while some have not finished.
    fn pending_condition(&self, inputs: &PassInputs, kind: ConditionType) -> Condition {
        inputs.condition(
            kind,
            ConditionStatus::Unknown,
            reasons::PROBE_PENDING,
            format!("waiting for the probe of {}", self.pending.join(", ")),
        )
    }
}

fn get_condition(r: &Readiness, kind: ConditionType) -> Condition {
    r.conditions
        .iter()
        .find(|c| c.kind == kind)
        .cloned()
        .expect("every condition")
}

fn is_terminal(r: &Readiness, kind: ConditionType) -> bool {
    get_condition(r, kind).status.is_terminal()
}

fn set_condition(r: &mut Readiness, c: Condition) {
    if let Some(slot) = r.conditions.iter_mut().find(|x| x.kind == c.kind) {
        *slot = c;
    }
}

/// One step of the pass in `r`: the server-side conditions once, the probes until they settle.
async fn evaluate(
    state: &SharedState,
    env: &Environment,
    r: &mut Readiness,
    now: OffsetDateTime,
) -> Result<(), StoreError> {
    let generation = r.generation;
    let mut pass = r.pass.clone().expect("a pass");
    let inputs = PassInputs::read(state, env, now, generation).await?;

    // 1. Configured.
    if !is_terminal(r, ConditionType::Configured) {
        let c = configured(state, env, inputs.release.as_ref(), now, generation).await;
        set_condition(r, c);
    }
    // 2. TargetsReachable.
    if !is_terminal(r, ConditionType::TargetsReachable) {
        set_condition(r, targets_reachable(&inputs));
    }
    // 3. CapabilitiesMatch.
    if !is_terminal(r, ConditionType::CapabilitiesMatch) {
        set_condition(r, capabilities_match(env, &inputs));
    }
    // 4. SecretsResolvable (OpenBao-backed: decided with the probes below).
    let mut by_agent = None;
    if !is_terminal(r, ConditionType::SecretsResolvable) {
        match secrets(state, env, now, generation).await? {
            SecretsVerdict::Decided(c) => set_condition(r, c),
            SecretsVerdict::ByAgent(probe) => by_agent = Some(probe),
        }
    }

    // 5-7. The probes, one per reachable host (an SSH target's via agent once).
    let registries = inputs.registries();
    let probes = run_probes(state, env, &inputs, &mut pass, &registries, &by_agent).await?;
    set_condition(r, routes_executable(&inputs, &probes));
    set_condition(r, registry_reachable(&inputs, &registries, &probes));
    set_condition(r, healthy(env, &inputs, &probes));
    if let Some(probe) = &by_agent {
        let c = if probes.pending.is_empty() {
            resolved_by_agent(
                probe,
                &probes.reports,
                inputs.targets.is_empty(),
                now,
                generation,
            )
        } else {
            probes.pending_condition(&inputs, ConditionType::SecretsResolvable)
        };
        set_condition(r, c);
    }

    pass.complete = r.conditions.iter().all(|c| c.status.is_terminal());
    if pass.complete {
        r.operational_ready = r
            .conditions
            .iter()
            .all(|c| c.status == ConditionStatus::True && c.generation == generation);
        if let Some(nonce) = &pass.nonce {
            r.verify_observed = Some(nonce.clone());
        }
    }
    r.pass = Some(pass);
    Ok(())
}

/// 2. `TargetsReachable`: each selected target's host is online with a live heartbeat.
fn targets_reachable(inputs: &PassInputs) -> Condition {
    let offline: Vec<String> = inputs
        .hosts
        .iter()
        .filter(|(_, host)| !inputs.reachable(host))
        .map(|(t, host)| match (&t.kind, host) {
            (TargetKind::Ssh(_), Some(via)) => format!("{} (via {})", t.name, via.name),
            (TargetKind::Ssh(_), None) => format!("{} (no via agent)", t.name),
            _ => t.name.clone(),
        })
        .collect();
    let kind = ConditionType::TargetsReachable;
    if inputs.targets.is_empty() {
        inputs.condition(
            kind,
            ConditionStatus::False,
            reasons::NO_TARGETS,
            "the selector picks no target",
        )
    } else if offline.is_empty() {
        inputs.condition(
            kind,
            ConditionStatus::True,
            reasons::OK,
            format!("{} target(s) online", inputs.targets.len()),
        )
    } else {
        inputs.condition(
            kind,
            ConditionStatus::False,
            reasons::TARGET_OFFLINE,
            format!("offline or without a live session: {}", offline.join(", ")),
        )
    }
}

/// 3. `CapabilitiesMatch`: each target's host reports the capability of the release's kind.
fn capabilities_match(env: &Environment, inputs: &PassInputs) -> Condition {
    let kind = match (env.target_type, inputs.release.as_ref()) {
        (berth_proto::deploy::TargetType::Ssh, _) => Some(TaskKind::SshDeploy),
        (_, Some(rel)) if !rel.components.is_empty() => Some(TaskKind::DockerRun),
        _ => None,
    };
    let missing: Vec<String> = match kind {
        None => Vec::new(),
        Some(kind) => inputs
            .hosts
            .iter()
            .filter_map(|(t, host)| match host {
                Some(a) if crate::services::tasks::can_run(a, kind) => None,
                _ => Some(format!("{} lacks {}", t.name, kind.required_capability())),
            })
            .collect(),
    };
    if missing.is_empty() {
        inputs.condition(
            ConditionType::CapabilitiesMatch,
            ConditionStatus::True,
            if kind.is_some() {
                reasons::OK
            } else {
                reasons::NOTHING_TO_CHECK
            },
            kind.map_or("no release to run".to_string(), |k| {
                format!("every target can run {k}")
            }),
        )
    } else {
        inputs.condition(
            ConditionType::CapabilitiesMatch,
            ConditionStatus::False,
            reasons::CAPABILITY_MISSING,
            missing.join(", "),
        )
    }
}

/// Queues this pass's probe on each reachable host that has none yet (an SSH target's via
/// agent once), and reads back what each probe said so far.
async fn run_probes(
    state: &SharedState,
    env: &Environment,
    inputs: &PassInputs,
    pass: &mut ReadinessPass,
    registries: &[String],
    by_agent: &Option<SecretsProbe>,
) -> Result<Probes, StoreError> {
    let mut probes = Probes {
        reports: Vec::new(),
        pending: Vec::new(),
    };
    let mut probed: BTreeMap<AgentId, ()> = BTreeMap::new();
    let deadline_passed = inputs.now
        >= pass.started_at
            + time::Duration::try_from(PROBE_DEADLINE).unwrap_or(time::Duration::minutes(2));
    let release = inputs.release.as_ref();
    for (target, host) in &inputs.hosts {
        let Some(agent) = host.as_ref().filter(|_| inputs.reachable(host)) else {
            probes.reports.push((
                target.name.clone(),
                Err((
                    reasons::TARGET_OFFLINE.into(),
                    format!("{}: not probed, the target is not reachable", target.name),
                )),
            ));
            continue;
        };
        if probed.insert(agent.id, ()).is_some() {
            continue;
        }
        let containers: Vec<String> = match (&target.kind, release) {
            (TargetKind::Agent(_), Some(rel)) => rel
                .components
                .iter()
                .filter_map(|c| crate::services::deployments::container_name(c, target).ok())
                .collect(),
            _ => Vec::new(),
        };
        let task_id = match pass.probes.iter().find(|(a, _)| *a == agent.id) {
            Some((_, t)) => Some(*t),
            None => {
                let payload = ReadinessProbePayload {
                    docker: matches!(target.kind, TargetKind::Agent(_))
                        && release.is_some_and(|r| !r.components.is_empty()),
                    registries: registries.to_vec(),
                    containers,
                    pass: Some(pass.id.to_string()),
                    // One host resolves the environment's secrets: the first one probed.
                    secrets: by_agent.clone().filter(|_| pass.probes.is_empty()),
                };
                let created = create_probe(state, env, pass, agent.id, payload).await?;
                if let Some(t) = created {
                    pass.probes.push((agent.id, t));
                }
                created
            }
        };
        let Some(task_id) = task_id else {
            probes.reports.push((
                target.name.clone(),
                Err((
                    reasons::PROBE_FAILED.into(),
                    format!(
                        "{}: the probe could not be queued (cordoned or queue full)",
                        agent.name
                    ),
                )),
            ));
            continue;
        };
        match probe_outcome(state, env, agent, task_id, deadline_passed).await? {
            Some(outcome) => probes.reports.push((agent.name.clone(), outcome)),
            None => probes.pending.push(agent.name.clone()),
        }
    }
    Ok(probes)
}

/// What the probe task `task_id` on `agent` said, or `None` while it may still finish.
async fn probe_outcome(
    state: &SharedState,
    env: &Environment,
    agent: &berth_store::Agent,
    task_id: TaskId,
    deadline_passed: bool,
) -> Result<Option<ProbeOutcome>, StoreError> {
    let task = state.store.get_task(env.tenant_id, task_id).await?;
    Ok(match task.map(|(t, _)| t) {
        Some(t) if t.state == TaskState::Succeeded => {
            let report = t
                .result
                .as_ref()
                .and_then(|r| r.get("outputs"))
                .and_then(|o| serde_json::from_value::<ProbeReport>(o.clone()).ok())
                .unwrap_or_default();
            Some(Ok(report))
        }
        Some(t) if t.state.is_terminal() => Some(Err((
            reasons::PROBE_FAILED.into(),
            format!(
                "{}: the probe task {} ended {} ({})",
                agent.name,
                t.id,
                t.state.as_str(),
                t.error_code.as_deref().unwrap_or("no code")
            ),
        ))),
        Some(_) if !deadline_passed => None,
        Some(t) => Some(Err((
            reasons::PROBE_TIMEOUT.into(),
            format!(
                "{}: the probe task {} did not finish within {}s",
                agent.name,
                t.id,
                PROBE_DEADLINE.as_secs()
            ),
        ))),
        None => Some(Err((
            reasons::PROBE_FAILED.into(),
            format!("{}: the probe task is gone", agent.name),
        ))),
    })
}

/// 6. `RoutesExecutable`: every host ran this pass's probe and its signed result verified.
fn routes_executable(inputs: &PassInputs, probes: &Probes) -> Condition {
    let kind = ConditionType::RoutesExecutable;
    let failed: Vec<&(String, String)> = probes
        .reports
        .iter()
        .filter_map(|(_, r)| r.as_ref().err())
        .collect();
    if !probes.pending.is_empty() {
        probes.pending_condition(inputs, kind)
    } else if inputs.targets.is_empty() {
        inputs.condition(
            kind,
            ConditionStatus::False,
            reasons::NO_TARGETS,
            "no target to probe",
        )
    } else if let Some((reason, _)) = failed.first() {
        inputs.condition(
            kind,
            ConditionStatus::False,
            reason,
            failed
                .iter()
                .map(|(_, m)| m.as_str())
                .collect::<Vec<_>>()
                .join("; "),
        )
    } else {
        inputs.condition(
            kind,
            ConditionStatus::True,
            reasons::OK,
            format!("{} host(s) ran the signed probe", probes.reports.len()),
        )
    }
}

/// 5. `RegistryReachable`: each registry's `/v2/` from each probed host.
fn registry_reachable(inputs: &PassInputs, registries: &[String], probes: &Probes) -> Condition {
    let kind = ConditionType::RegistryReachable;
    if registries.is_empty() {
        return inputs.condition(
            kind,
            ConditionStatus::True,
            reasons::NOTHING_TO_CHECK,
            "the release names no registry",
        );
    }
    if !probes.pending.is_empty() {
        return probes.pending_condition(inputs, kind);
    }
    let mut bad = Vec::new();
    for (host, report) in &probes.reports {
        match report {
            Ok(report) => {
                for check in report.registries.iter().filter(|c| !c.ok) {
                    bad.push((
                        reasons::REGISTRY_UNREACHABLE,
                        format!("registry {} from {host}: {}", check.host, check.detail),
                    ));
                }
            }
            Err((reason, message)) => bad.push((reason.as_str(), message.clone())),
        }
    }
    verdict(
        kind,
        bad,
        "every registry answers /v2/ from every target",
        inputs.now,
        inputs.generation,
    )
}

/// 7. `Healthy`: the engine answers and each container of the current release runs healthy.
fn healthy(env: &Environment, inputs: &PassInputs, probes: &Probes) -> Condition {
    let kind = ConditionType::Healthy;
    let Some(rel) = inputs.release.as_ref() else {
        return inputs.condition(
            kind,
            ConditionStatus::True,
            reasons::NOTHING_TO_CHECK,
            "no release deployed yet",
        );
    };
    // An SSH target runs no containers: its release is read back by drift (the sticker).
    if env.target_type == berth_proto::deploy::TargetType::Ssh {
        return inputs.condition(
            kind,
            ConditionStatus::True,
            reasons::NOTHING_TO_CHECK,
            "ssh targets run no containers; drift reads their sticker back",
        );
    }
    if !probes.pending.is_empty() {
        return probes.pending_condition(inputs, kind);
    }
    let mut bad = Vec::new();
    for (target, _) in inputs
        .hosts
        .iter()
        .filter(|(t, _)| matches!(t.kind, TargetKind::Agent(_)))
    {
        let report = probes
            .reports
            .iter()
            .find(|(n, _)| *n == target.name)
            .map(|(_, r)| r);
        match report {
            Some(Ok(report)) => unhealthy_on(rel, target, report, &mut bad),
            Some(Err((reason, message))) => bad.push((reason.as_str(), message.clone())),
            None => {}
        }
    }
    verdict(
        kind,
        bad,
        "every container of the release runs healthy",
        inputs.now,
        inputs.generation,
    )
}

/// Adds to `bad` why `target`'s probe `report` shows its engine or a container of `rel`
/// unhealthy (a container is healthy when it runs the release's digest, not unhealthy or
/// starting).
fn unhealthy_on(
    rel: &Release,
    target: &Target,
    report: &ProbeReport,
    bad: &mut Vec<(&str, String)>,
) {
    if let Some(docker) = report.docker.as_ref().filter(|d| !d.ok) {
        bad.push((
            reasons::DOCKER_UNAVAILABLE,
            format!("docker on {}: {}", target.name, docker.detail),
        ));
        return;
    }
    for component in &rel.components {
        let Ok(name) = crate::services::deployments::container_name(component, target) else {
            continue;
        };
        let found = report.containers.iter().find(|c| c.name == name);
        let ok = found.is_some_and(|c| {
            c.state == "running"
                && !matches!(c.health.as_deref(), Some("unhealthy" | "starting"))
                && c.image.ends_with(&component.digest)
        });
        if !ok {
            bad.push((
                reasons::UNHEALTHY,
                format!(
                    "{name} on {}: {}",
                    target.name,
                    found.map_or("missing".to_string(), |c| format!(
                        "{} {}",
                        c.state,
                        c.health.as_deref().unwrap_or("")
                    ))
                ),
            ));
        }
    }
}

fn verdict(
    kind: ConditionType,
    bad: Vec<(&str, String)>,
    ok: &str,
    now: OffsetDateTime,
    generation: i64,
) -> Condition {
    match bad.first() {
        None => condition(
            kind,
            ConditionStatus::True,
            reasons::OK,
            ok,
            now,
            generation,
        ),
        Some((reason, _)) => condition(
            kind,
            ConditionStatus::False,
            reason,
            bad.iter()
                .map(|(_, m)| m.as_str())
                .collect::<Vec<_>>()
                .join("; "),
            now,
            generation,
        ),
    }
}

/// `SecretsResolvable` from the probe that resolved the environment's OpenBao secrets.
fn resolved_by_agent(
    probe: &SecretsProbe,
    reports: &[(String, ProbeOutcome)],
    no_targets: bool,
    now: OffsetDateTime,
    generation: i64,
) -> Condition {
    let make = |status, reason: &str, message: String| {
        condition(
            ConditionType::SecretsResolvable,
            status,
            reason,
            message,
            now,
            generation,
        )
    };
    let checked = reports.iter().find_map(|(host, r)| {
        r.as_ref()
            .ok()
            .and_then(|r| r.secrets.as_ref())
            .map(|c| (host, c))
    });
    match checked {
        Some((host, c)) if !c.ok => make(
            ConditionStatus::False,
            reasons::SECRETS_UNAVAILABLE,
            format!(
                "{host} could not resolve the secrets at OpenBao: {}",
                c.detail
            ),
        ),
        Some((host, c)) if c.unresolved.is_empty() => make(
            ConditionStatus::True,
            reasons::OK,
            format!(
                "{} secret(s) resolve at OpenBao from {host}",
                probe.entries.len()
            ),
        ),
        Some((host, c)) => make(
            ConditionStatus::False,
            reasons::SECRET_NOT_FOUND,
            format!("not resolved from {host}: {}", c.unresolved.join(", ")),
        ),
        None if no_targets => make(
            ConditionStatus::False,
            reasons::NO_TARGETS,
            "no target to resolve the OpenBao secrets from".into(),
        ),
        None => {
            let failures: Vec<&(String, String)> = reports
                .iter()
                .filter_map(|(_, r)| r.as_ref().err())
                .collect();
            make(
                ConditionStatus::False,
                failures
                    .first()
                    .map_or(reasons::PROBE_FAILED, |(reason, _)| reason.as_str()),
                format!(
                    "no probe resolved the OpenBao secrets: {}",
                    failures
                        .iter()
                        .map(|(_, m)| m.as_str())
                        .collect::<Vec<_>>()
                        .join("; ")
                ),
            )
        }
    }
}

async fn configured(
    state: &SharedState,
    env: &Environment,
    release: Option<&Release>,
    now: OffsetDateTime,
    generation: i64,
) -> Condition {
    let make = |status, reason: &str, message: String| {
        condition(
            ConditionType::Configured,
            status,
            reason,
            message,
            now,
            generation,
        )
    };
    let Some(current) = &env.current_release else {
        return make(
            ConditionStatus::True,
            reasons::NOTHING_TO_CHECK,
            "no release deployed yet".into(),
        );
    };
    let Some(release) = release else {
        return make(
            ConditionStatus::False,
            reasons::RELEASE_NOT_FOUND,
            format!("release {:?} does not resolve", current.name),
        );
    };
    let mut bad: Vec<(&str, String)> = Vec::new();
    for component in &release.components {
        let reference = format!("{}@{}", component.image, component.digest);
        let image = match parse_image(&reference) {
            Ok(i) => i,
            Err(e) => {
                bad.push((reasons::DIGEST_NOT_FOUND, e));
                continue;
            }
        };
        match state.registries.resolve(&image, None).await {
            Ok(_) => {}
            Err(ResolveError::NotFound(why)) => bad.push((
                reasons::DIGEST_NOT_FOUND,
                format!("component {} ({reference}): {why}", component.name),
            )),
            Err(ResolveError::Unauthorized(why)) => bad.push((
                reasons::REGISTRY_UNAUTHORIZED,
                format!("component {} ({reference}): {why}", component.name),
            )),
            Err(ResolveError::Unresolvable(why)) => bad.push((
                reasons::REGISTRY_UNREACHABLE,
                format!("component {} ({reference}): {why}", component.name),
            )),
        }
    }
    match bad.first() {
        None => make(
            ConditionStatus::True,
            reasons::OK,
            format!(
                "release {} resolves; {} digest(s) found",
                release.name,
                release.components.len()
            ),
        ),
        Some((reason, _)) => make(
            ConditionStatus::False,
            reason,
            bad.iter()
                .map(|(_, m)| m.as_str())
                .collect::<Vec<_>>()
                .join("; "),
        ),
    }
}

/// The desired bundle's manifest entries: builtin ones must have a live version in the store
/// (the sealed row is found, never opened); OpenBao-backed ones go to an agent.
async fn secrets(
    state: &SharedState,
    env: &Environment,
    now: OffsetDateTime,
    generation: i64,
) -> Result<SecretsVerdict, StoreError> {
    let make = |status, reason: &str, message: String| {
        SecretsVerdict::Decided(condition(
            ConditionType::SecretsResolvable,
            status,
            reason,
            message,
            now,
            generation,
        ))
    };
    let desired = state
        .store
        .desired_environment(env.tenant_id, &env.name)
        .await?
        .and_then(|d| d.desired_sha);
    let Some(sha) = desired else {
        return Ok(make(
            ConditionStatus::True,
            reasons::NOTHING_TO_CHECK,
            "no desired bundle".into(),
        ));
    };
    let Some(tar) = state.store.get_bundle(env.id, &sha).await? else {
        return Ok(make(
            ConditionStatus::False,
            reasons::BUNDLE_UNREADABLE,
            format!("bundle {sha} is not stored"),
        ));
    };
    let bundle = match berth_bundle::open(&tar, &sha, &berth_bundle::Limits::default()) {
        Ok(b) => b,
        Err(e) => {
            return Ok(make(
                ConditionStatus::False,
                reasons::BUNDLE_UNREADABLE,
                format!("bundle {sha}: {e}"),
            ))
        }
    };
    let manifest = bundle.manifest;
    if manifest.entries.is_empty() {
        return Ok(make(
            ConditionStatus::True,
            reasons::NOTHING_TO_CHECK,
            "the secrets manifest is empty".into(),
        ));
    }
    if manifest.vault_mode != "builtin" {
        return Ok(
            match (&state.config.openbao, manifest.vault_mode.as_str()) {
                (Some(bao), "openbao") => SecretsVerdict::ByAgent(SecretsProbe {
                    addr: bao.addr.clone(),
                    auth_mount: bao.auth_mount.clone(),
                    role: bao.role.clone(),
                    kv_mount: bao.kv_mount.clone(),
                    entries: manifest
                        .entries
                        .iter()
                        .map(|e| SecretsProbeEntry {
                            path: e.path.clone(),
                            version: e.version,
                        })
                        .collect(),
                }),
                _ => make(
                    ConditionStatus::False,
                    reasons::SECRETS_UNCHECKABLE,
                    format!(
                    "{} secret(s) are {}-backed and this server has no OpenBao (--openbao-addr)",
                    manifest.entries.len(),
                    manifest.vault_mode
                ),
                ),
            },
        );
    }
    let mut missing = Vec::new();
    for entry in &manifest.entries {
        let key = berth_proto::desired::SecretPath::parse(&entry.path).map(|p| p.store_key());
        let found = match key {
            Some(key) => state
                .store
                .get_secret(env.tenant_id, &key, entry.version)
                .await?
                .is_some(),
            None => false,
        };
        if !found {
            missing.push(match entry.version {
                Some(v) => format!("{} (version {v})", entry.path),
                None => entry.path.clone(),
            });
        }
    }
    Ok(if missing.is_empty() {
        make(
            ConditionStatus::True,
            reasons::OK,
            format!("{} secret(s) exist", manifest.entries.len()),
        )
    } else {
        make(
            ConditionStatus::False,
            reasons::SECRET_NOT_FOUND,
            format!("not found: {}", missing.join(", ")),
        )
    })
}

/// Queues the pass's probe of one host. `None`: the host takes no task now (cordoned, its
/// queue full, deleted).
async fn create_probe(
    state: &SharedState,
    env: &Environment,
    pass: &ReadinessPass,
    agent: AgentId,
    payload: ReadinessProbePayload,
) -> Result<Option<TaskId>, StoreError> {
    let credentials = match &payload.secrets {
        Some(_) => probe_grant(state, env).await?,
        None => None,
    };
    let payload = serde_json::to_value(payload)
        .map_err(|e| StoreError::Corrupt(format!("readiness-probe payload: {e}")))?;
    let request = TaskRequest {
        tenant: env.tenant_id,
        kind: TaskKind::ReadinessProbe,
        placement: Placement::Agent(agent),
        payload,
        credentials,
        variables: Default::default(),
        timeout_seconds: PROBE_TIMEOUT_SECS,
        priority: PROBE_PRIORITY,
        origin: Origin::Readiness {
            environment: env.id,
            pass: pass.id,
            agent,
        },
    };
    Ok(crate::services::tasks::create(state, request)
        .await?
        .ok()
        .map(|placed| placed.task().id))
}

/// A `lease` grant for one probe's OpenBao login, as the probe task's credentials (sealed by
/// `services::tasks::create`). Recording it supersedes nothing. `None`: the environment has no desired state (nothing to
/// log in for), and the probe reports that it has no grant.
async fn probe_grant(
    state: &SharedState,
    env: &Environment,
) -> Result<Option<BTreeMap<String, String>>, StoreError> {
    let Some(desired) = state
        .store
        .desired_environment(env.tenant_id, &env.name)
        .await?
    else {
        return Ok(None);
    };
    let now = state.config.clock.now();
    let minted = crate::infra::grants::mint(
        state,
        &desired,
        berth_store::GrantKind::Lease,
        now,
        PROBE_GRANT_TTL,
    )
    .map_err(|e| StoreError::Corrupt(format!("minting the probe's grant: {}", e.detail)))?;
    state.store.record_grant(minted.grant).await?;
    Ok(Some(BTreeMap::from([(
        OPENBAO_LOGIN_JWT_CREDENTIAL.to_string(),
        minted.jwt,
    )])))
}
