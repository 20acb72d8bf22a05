//! `docker.run` and `rollback` (seed 000, module agent-docker) through the Engine API.
//!
//! `docker.run`, in the seed's order: pull `image@digest` → verify the digest → pre-deploy hook →
//! stop the current container and rename it `<name>-previous-<unix ms>` → create (berth labels,
//! env, ports, volumes, restart policy, limits) → start → wait healthy → post-deploy hook →
//! remove the previous container → write the sticker. Nothing running is touched before the
//! digest is verified and the pre-deploy hook passed (and nothing at all, not even the pull, when
//! a hook names a program off the agent's allow-list); any failure (or cancellation) after that
//! removes the new container and restores the previous one under its name.
//!
//! Payload values reach the engine only as API fields, never through a shell.

use berth_proto::transport::ProgressPhase;
use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use berth_proto::kind::TaskKind;
use berth_proto::payload::{
    DeployTaskPayload, HealthCheckConfig, HealthCheckKind, InspectedContainer, RollbackTaskPayload,
};
use berth_proto::result::error_types;
use bollard::models::{
    ContainerCreateBody, ContainerInspectResponse, HostConfig, PortBinding, RestartPolicy,
    RestartPolicyNameEnum,
};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, RemoveContainerOptionsBuilder, RenameContainerOptionsBuilder,
    StopContainerOptionsBuilder,
};
use bollard::Docker;
use tokio::time::Instant;

use crate::engine::{self, engine_error, Engine, Judgement};
use crate::error::ExecError;
use crate::hooks::{self, AllowedHooks};
use crate::reference::{self, ImageRef};
use crate::run::{millis_since, Log, Run, Stop};
use crate::sticker::volume::VolumeSticker;
use crate::sticker::{Sticker, StickerStore};
use crate::{parse_payload, Executor, Outcome, Task};

/// Seconds the engine gives a container to stop before killing it (the seed's `stop({t: 10})`).
const STOP_TIMEOUT_SECS: i32 = 10;

/// Budget for restoring the previous container after a failure; not cancellable.
const RESTORE_BUDGET: Duration = Duration::from_secs(120);

/// Runs `docker.run` and `rollback` against the local Docker engine.
///
/// The engine connection is made lazily, on the first task (`DOCKER_HOST` when it is a
/// `unix://` socket, else `/var/run/docker.sock`), so constructing the executor never fails; an
/// engine that cannot be reached makes that task fail with the retriable `DOCKER_UNAVAILABLE`.
/// Registry logins come from the task's credentials `registryUsername` and `registryPassword`
/// (optionally `registryServer`, default: the image's registry host). Hooks run only programs
/// on [`with_allowed_hooks`](DockerExecutor::with_allowed_hooks)' list (none by default).
pub struct DockerExecutor {
    stickers: StickerStore,
    engine: Engine,
    allowed_hooks: AllowedHooks,
}

impl DockerExecutor {
    pub fn new(sticker_store: StickerStore) -> DockerExecutor {
        DockerExecutor {
            stickers: sticker_store,
            engine: Engine::new(),
            allowed_hooks: AllowedHooks::default(),
        }
    }

    /// The programs pre- and post-deploy hooks may run (absolute paths, matched exactly).
    pub fn with_allowed_hooks(mut self, programs: Vec<PathBuf>) -> DockerExecutor {
        self.allowed_hooks = AllowedHooks::new(programs);
        self
    }

    /// Every container with berth labels, with state and health: for the agent's `inspect`.
    pub async fn inspect_containers(&self) -> Result<Vec<InspectedContainer>, ExecError> {
        let docker = self.engine.docker().await?;
        engine::inspect_containers(docker).await
    }
}

#[async_trait::async_trait]
impl Executor for DockerExecutor {
    fn task_types(&self) -> &'static [TaskKind] {
        &[TaskKind::DockerRun, TaskKind::Rollback]
    }

    async fn execute(&self, task: &Task) -> Outcome {
        match TaskKind::parse(&task.task_type) {
            Some(TaskKind::DockerRun) => {
                let payload: DeployTaskPayload = match parse_payload(task) {
                    Ok(p) => p,
                    Err(o) => return *o,
                };
                let mut run = Run::new(task);
                let result = self.deploy(&mut run, &payload).await;
                run.finish(result)
            }
            Some(TaskKind::Rollback) => {
                let payload: RollbackTaskPayload = match parse_payload(task) {
                    Ok(p) => p,
                    Err(o) => return *o,
                };
                let mut run = Run::new(task);
                let result = self.rollback(&mut run, payload).await;
                run.finish(result)
            }
            _ => Outcome::failed(
                error_types::UNSUPPORTED_TASK_TYPE,
                format!("the docker executor does not run {}", task.task_type),
                false,
            ),
        }
    }
}

/// A validated `docker.run` payload.
#[derive(Debug)]
struct Plan {
    name: String,
    image: ImageRef,
    digest: String,
    env: Vec<String>,
    exposed_ports: Vec<String>,
    port_bindings: HashMap<String, Option<Vec<PortBinding>>>,
    binds: Vec<String>,
    restart: RestartPolicy,
    memory: Option<i64>,
    cpu_quota: Option<i64>,
    health: Option<HealthCheckConfig>,
    cleanup_previous: bool,
    release_id: Option<String>,
    release_name: Option<String>,
    previous_digest: Option<String>,
    /// Where the sticker goes when it is not the sticker directory.
    sticker_volume: Option<VolumeSticker>,
}

fn plan(p: &DeployTaskPayload, allowed_hooks: &AllowedHooks) -> Result<Plan, ExecError> {
    let c = &p.config;
    let name = c
        .container_name
        .clone()
        .ok_or_else(|| ExecError::InvalidPayload("config.containerName is required".into()))?;
    if !reference::valid_container_name(&name) {
        return Err(ExecError::InvalidPayload(format!(
            "container name {name:?} must be 1-100 of A-Z a-z 0-9 _ . - starting with a letter or digit"
        )));
    }
    let raw = p
        .image
        .as_deref()
        .ok_or_else(|| ExecError::InvalidPayload("image is required".into()))?;
    let image = reference::parse_image(raw).map_err(ExecError::InvalidPayload)?;
    let digest = match (&p.digest, &image.digest) {
        (Some(d), Some(i)) if d != i => {
            return Err(ExecError::InvalidPayload(format!(
                "the image reference pins {i} but digest says {d}"
            )))
        }
        (Some(d), _) | (None, Some(d)) => d.clone(),
        (None, None) => {
            return Err(ExecError::DigestRequired(format!(
                "{raw} has no digest: berth deploys only image@sha256 references, never a tag"
            )))
        }
    };
    if !reference::is_sha256_digest(&digest) {
        return Err(ExecError::DigestRequired(format!(
            "digest {digest:?} is not sha256: followed by 64 lowercase hex digits"
        )));
    }
    let mut env = Vec::new();
    for (k, v) in &c.environment {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err(ExecError::InvalidPayload(format!(
                "environment variable name {k:?} is invalid"
            )));
        }
        env.push(format!("{k}={v}"));
    }
    let mut exposed_ports = Vec::new();
    let mut port_bindings: HashMap<String, Option<Vec<PortBinding>>> = HashMap::new();
    for spec in &c.ports {
        let (key, binding) = parse_port(spec).map_err(ExecError::InvalidPayload)?;
        if !exposed_ports.contains(&key) {
            exposed_ports.push(key.clone());
        }
        port_bindings
            .entry(key)
            .or_insert_with(|| Some(Vec::new()))
            .get_or_insert_with(Vec::new)
            .push(binding);
    }
    let binds = c
        .volumes
        .iter()
        .map(|v| validate_volume(v).map(|()| v.clone()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(ExecError::InvalidPayload)?;
    let restart = parse_restart_policy(c.restart_policy.as_deref().unwrap_or("unless-stopped"))
        .map_err(ExecError::InvalidPayload)?;
    if c.memory_limit.is_some_and(|m| m < 6 * 1024 * 1024) {
        // The engine's own minimum; refusing here keeps the running container untouched.
        return Err(ExecError::InvalidPayload(
            "memoryLimit must be at least 6 MiB (in bytes)".into(),
        ));
    }
    if c.cpu_limit.is_some_and(|q| q < 1000) {
        return Err(ExecError::InvalidPayload(
            "cpuLimit is a CPU quota in microseconds per 100 ms and must be at least 1000".into(),
        ));
    }
    if let Some(h) = &c.health_check {
        engine::validate_health_check(h)?;
    }
    hooks::validate_all(&p.hooks, allowed_hooks)?;
    if let Some(prev) = &p.previous_digest {
        if !reference::is_sha256_digest(prev) {
            return Err(ExecError::InvalidPayload(format!(
                "previousDigest {prev:?} is not a sha256 digest"
            )));
        }
    }
    let sticker_volume = p
        .volume_sticker(Some(&digest))
        .map_err(ExecError::InvalidPayload)?;
    Ok(Plan {
        name,
        image,
        digest,
        env,
        exposed_ports,
        port_bindings,
        binds,
        restart,
        memory: c.memory_limit,
        cpu_quota: c.cpu_limit,
        health: c.health_check.clone(),
        cleanup_previous: c.cleanup_previous.unwrap_or(true),
        release_id: c.release_id.clone(),
        release_name: c.release_name.clone(),
        previous_digest: p.previous_digest.clone(),
        sticker_volume,
    })
}

/// `[ip:][hostPort:]containerPort[/proto]` (docker CLI syntax; IPv6 in brackets) → the
/// `ExposedPorts`/`PortBindings` key and binding. Port ranges are refused.
pub(crate) fn parse_port(spec: &str) -> Result<(String, PortBinding), String> {
    let bad = |why: &str| format!("port {spec:?} is invalid: {why}");
    let (rest, proto) = match spec.rsplit_once('/') {
        Some((r, p)) => (r, p),
        None => (spec, "tcp"),
    };
    if !matches!(proto, "tcp" | "udp" | "sctp") {
        return Err(bad("the protocol must be tcp, udp or sctp"));
    }
    let (ip, rest) = if let Some(v6) = rest.strip_prefix('[') {
        let (ip, after) = v6
            .split_once("]:")
            .ok_or_else(|| bad("unclosed IPv6 address"))?;
        (Some(ip), after)
    } else {
        let parts: Vec<&str> = rest.split(':').collect();
        match parts.len() {
            1 | 2 => (None, rest),
            3 => (Some(parts[0]), &rest[parts[0].len() + 1..]),
            _ => return Err(bad("expected [ip:][hostPort:]containerPort[/proto]")),
        }
    };
    let (host_port, container_port) = match rest.split_once(':') {
        Some((h, c)) => (Some(h), c),
        None => (None, rest),
    };
    let port = |p: &str| p.parse::<u16>().ok().filter(|p| *p > 0);
    let container_port =
        port(container_port).ok_or_else(|| bad("the container port must be 1-65535"))?;
    let host_port = match host_port {
        None | Some("") => None,
        Some(h) => Some(port(h).ok_or_else(|| bad("the host port must be 1-65535"))?),
    };
    if let Some(ip) = ip {
        ip.parse::<IpAddr>()
            .map_err(|_| bad("the host address is not an IP address"))?;
    }
    Ok((
        format!("{container_port}/{proto}"),
        PortBinding {
            host_ip: ip.map(str::to_string),
            host_port: host_port.map(|p| p.to_string()),
        },
    ))
}

/// `name:/path[:opts]` (named volume) or `/host/path:/path[:opts]` (bind mount).
pub(crate) fn validate_volume(spec: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("volume {spec:?} is invalid: {why}"));
    let parts: Vec<&str> = spec.split(':').collect();
    if !(2..=3).contains(&parts.len()) {
        return bad("expected source:/container/path[:options]");
    }
    let clean_path = |p: &str| {
        p.starts_with('/') && !p.contains('\0') && !p.split('/').any(|c| c == ".." || c == ".")
    };
    let source = parts[0];
    if source.starts_with('/') {
        if !clean_path(source) {
            return bad("a bind mount source must be an absolute path without . or ..");
        }
    } else if !reference::valid_container_name(source) {
        return bad("a volume name must be A-Z a-z 0-9 _ . - starting with a letter or digit");
    }
    if !clean_path(parts[1]) || parts[1] == "/" {
        return bad("the container path must be absolute, not /, without . or ..");
    }
    if let Some(opts) = parts.get(2) {
        const ALLOWED: &[&str] = &[
            "ro",
            "rw",
            "z",
            "Z",
            "nocopy",
            "shared",
            "rshared",
            "slave",
            "rslave",
            "private",
            "rprivate",
            "consistent",
            "cached",
            "delegated",
        ];
        if opts.is_empty() || !opts.split(',').all(|o| ALLOWED.contains(&o)) {
            return bad("unknown mount option");
        }
    }
    Ok(())
}

fn parse_restart_policy(s: &str) -> Result<RestartPolicy, String> {
    let (name, retries) = match s.split_once(':') {
        Some(("on-failure", n)) => (
            RestartPolicyNameEnum::ON_FAILURE,
            Some(n.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                format!("restart policy {s:?}: the retry count must be a number")
            })?),
        ),
        Some(_) => return Err(format!("restart policy {s:?} is unknown")),
        None => (
            match s {
                "no" => RestartPolicyNameEnum::NO,
                "always" => RestartPolicyNameEnum::ALWAYS,
                "unless-stopped" => RestartPolicyNameEnum::UNLESS_STOPPED,
                "on-failure" => RestartPolicyNameEnum::ON_FAILURE,
                _ => {
                    return Err(format!(
                        "restart policy {s:?} must be no, always, unless-stopped or on-failure[:N]"
                    ))
                }
            },
            None,
        ),
    };
    Ok(RestartPolicy {
        name: Some(name),
        maximum_retry_count: retries,
    })
}

/// The container that was running under the target name, and how far it has been moved.
#[derive(Debug)]
struct Previous {
    id: String,
    digest: Option<String>,
    was_running: bool,
    /// Its temporary name once renamed.
    renamed_to: Option<String>,
}

/// What a deployment changed so far, so a failure can undo it.
#[derive(Debug, Default)]
struct Touched {
    previous: Option<Previous>,
    /// A create request was sent: a container under the target name is ours from then on.
    create_sent: bool,
    new_id: Option<String>,
}

fn unix_millis() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default()
}

fn label(c: &ContainerInspectResponse, key: &str) -> Option<String> {
    c.config.as_ref()?.labels.as_ref()?.get(key).cloned()
}

fn is_running(c: &ContainerInspectResponse) -> bool {
    c.state.as_ref().and_then(|s| s.running) == Some(true)
}

/// Whether the image defines a HEALTHCHECK the engine will run.
fn image_has_healthcheck(inspect: &bollard::models::ImageInspect) -> bool {
    inspect
        .config
        .as_ref()
        .and_then(|c| c.healthcheck.as_ref())
        .and_then(|h| h.test.as_ref())
        .is_some_and(|t| !t.is_empty() && t[0] != "NONE")
}

impl DockerExecutor {
    async fn deploy(
        &self,
        run: &mut Run<'_>,
        payload: &DeployTaskPayload,
    ) -> Result<String, ExecError> {
        let plan = plan(payload, &self.allowed_hooks)?;
        let reference = format!("{}@{}", plan.image.repository, plan.digest);
        run.output("containerName", plan.name.clone());
        run.output("image", plan.image.repository.clone());
        run.output("digest", plan.digest.clone());
        // Present in every outcome; filled in as the deployment gets there.
        run.output("containerId", serde_json::Value::Null);
        run.output(
            "previousDigest",
            plan.previous_digest
                .clone()
                .map_or(serde_json::Value::Null, Into::into),
        );
        let credentials =
            engine::registry_credentials(&run.task.credentials, plan.image.registry())?;
        let docker = run.stop.guard(self.engine.docker()).await?;

        // 1. Pull and verify: nothing running is touched before this passed.
        run.enter(ProgressPhase::Pulling).await?;
        run.log.line(format!(
            "pulling {reference}{}",
            if credentials.is_some() {
                " (with registry credentials)"
            } else {
                ""
            }
        ));
        let started = Instant::now();
        let pulled = run
            .stop
            .guard(engine::pull(
                docker,
                &plan.image,
                &plan.digest,
                credentials,
                &mut run.log,
            ))
            .await;
        run.metrics.pull_duration_ms = Some(millis_since(started));
        pulled?;
        let image = run
            .stop
            .guard(engine::verify_digest(docker, &plan.image, &plan.digest))
            .await?;
        run.log.line(format!("digest verified: {}", plan.digest));
        if plan
            .health
            .as_ref()
            .is_some_and(|h| h.kind == HealthCheckKind::Docker)
            && !image_has_healthcheck(&image)
        {
            return Err(ExecError::HealthCheckUnavailable(format!(
                "healthCheck type docker needs a HEALTHCHECK in the image, and {reference} has none"
            )));
        }

        // 2. Pre-deploy hook.
        let hook_env = vec![
            ("BERTH_CONTAINER_NAME".to_string(), plan.name.clone()),
            ("BERTH_IMAGE".to_string(), plan.image.repository.clone()),
            ("BERTH_DIGEST".to_string(), plan.digest.clone()),
        ];
        if let Some(hook) = &payload.hooks.pre_deploy {
            run.confirm_lease("the pre-deploy hook").await?;
            hooks::run_hook(
                run,
                hook,
                "pre-deploy",
                None,
                hook_env.clone(),
                &self.allowed_hooks,
            )
            .await?;
        }
        run.enter(ProgressPhase::Starting).await?;
        run.log.line("lease confirmed before the container swap");

        // 3.–7. Everything from here on is undone on failure.
        let deploy_started = Instant::now();
        let mut touched = Touched::default();
        let result = self
            .replace(run, docker, &plan, &mut touched, payload, hook_env)
            .await;
        if run.metrics.deploy_duration_ms.is_none() {
            run.metrics.deploy_duration_ms = Some(millis_since(deploy_started));
        }
        let previous_digest = plan
            .previous_digest
            .clone()
            .or_else(|| touched.previous.as_ref().and_then(|p| p.digest.clone()));
        run.output(
            "previousDigest",
            previous_digest.map_or(serde_json::Value::Null, Into::into),
        );
        match result {
            Ok(container_id) => {
                run.output("containerId", container_id.clone());
                self.finish_success(run, docker, &plan, &touched, &container_id)
                    .await
            }
            Err(e) => {
                let rolled_back = restore(docker, &plan.name, &touched, &mut run.log).await;
                run.output("rolledBack", rolled_back);
                Err(e)
            }
        }
    }

    /// Steps 3–7: stop and rename the current container, create, start, wait healthy,
    /// post-deploy hook. Records every change in `touched`; returns the new container's id.
    async fn replace(
        &self,
        run: &mut Run<'_>,
        docker: &Docker,
        plan: &Plan,
        touched: &mut Touched,
        payload: &DeployTaskPayload,
        hook_env: Vec<(String, String)>,
    ) -> Result<String, ExecError> {
        let stop = run.stop.clone();
        let deploy_started = Instant::now();
        if let Some(current) = stop
            .guard(engine::find_container(docker, &plan.name))
            .await?
        {
            let id = current.id.clone().unwrap_or_default();
            let was_running = is_running(&current);
            touched.previous = Some(Previous {
                id: id.clone(),
                digest: label(&current, engine::LABEL_DIGEST),
                was_running,
                renamed_to: None,
            });
            run.output("previousContainerId", id.clone());
            if was_running {
                run.log.line(format!(
                    "stopping the current container {} ({id:.12})",
                    plan.name
                ));
                let options = StopContainerOptionsBuilder::default()
                    .t(STOP_TIMEOUT_SECS)
                    .build();
                // Changes to the engine's state are never abandoned half-way (a dropped request
                // may still be carried out, and the undo would not know); the stop signal is
                // looked at between them.
                docker
                    .stop_container(&id, Some(options))
                    .await
                    .map_err(|e| engine_error("stop", &plan.name, e))?;
            }
            let previous_name = format!("{}-previous-{}", plan.name, unix_millis());
            run.log.line(format!("renaming it to {previous_name}"));
            let options = RenameContainerOptionsBuilder::default()
                .name(&previous_name)
                .build();
            docker
                .rename_container(&id, options)
                .await
                .map_err(|e| engine_error("rename", &plan.name, e))?;
            if let Some(p) = touched.previous.as_mut() {
                p.renamed_to = Some(previous_name);
            }
            stop.check()?;
        }

        run.log.line(format!(
            "creating {} from {}@{}",
            plan.name, plan.image.repository, plan.digest
        ));
        let deployed_at = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        let mut labels = HashMap::from([
            (engine::LABEL_DIGEST.to_string(), plan.digest.clone()),
            (
                engine::LABEL_IMAGE.to_string(),
                plan.image.repository.clone(),
            ),
            (engine::LABEL_DEPLOYED_AT.to_string(), deployed_at),
        ]);
        if let Some(id) = &plan.release_id {
            labels.insert(engine::LABEL_RELEASE_ID.to_string(), id.clone());
        }
        if let Some(n) = &plan.release_name {
            labels.insert(engine::LABEL_RELEASE_NAME.to_string(), n.clone());
        }
        let body = ContainerCreateBody {
            // Always the digest, never a tag.
            image: Some(format!("{}@{}", plan.image.repository, plan.digest)),
            env: Some(plan.env.clone()),
            exposed_ports: Some(plan.exposed_ports.clone()),
            labels: Some(labels),
            host_config: Some(HostConfig {
                binds: Some(plan.binds.clone()),
                port_bindings: Some(plan.port_bindings.clone()),
                restart_policy: Some(plan.restart.clone()),
                memory: plan.memory,
                cpu_quota: plan.cpu_quota,
                cpu_period: plan.cpu_quota.map(|_| 100_000),
                ..Default::default()
            }),
            ..Default::default()
        };
        let options = CreateContainerOptionsBuilder::default()
            .name(&plan.name)
            .build();
        touched.create_sent = true;
        let created = docker
            .create_container(Some(options), body)
            .await
            .map_err(|e| engine_error("create", &plan.name, e))?;
        let id = created.id;
        touched.new_id = Some(id.clone());
        for warning in created.warnings {
            run.log.line(format!("engine warning: {warning}"));
        }

        stop.check()?;
        run.log.line(format!("starting {} ({id:.12})", plan.name));
        docker
            .start_container(&id, None)
            .await
            .map_err(|e| engine_error("start", &plan.name, e))?;
        run.metrics.deploy_duration_ms = Some(millis_since(deploy_started));
        stop.check()?;

        let health_started = Instant::now();
        let healthy = match &plan.health {
            Some(check) => {
                run.enter(ProgressPhase::Health).await?;
                run.log
                    .line(format!("waiting for health ({:?})", check.kind));
                engine::wait_container_healthy(docker, &id, check, &stop, &mut run.log).await
            }
            None => {
                // No check asked for: the container must at least be running.
                let c = stop
                    .guard(async {
                        docker
                            .inspect_container(&id, None)
                            .await
                            .map_err(|e| engine_error("inspect container", &plan.name, e))
                    })
                    .await?;
                match engine::judge(&c, engine::DockerHealth::Ignore) {
                    Judgement::Failed(why) => Err(ExecError::HealthCheckFailed(why)),
                    _ => Ok(()),
                }
            }
        };
        run.metrics.health_check_duration_ms = Some(millis_since(health_started));
        healthy.map_err(|e| match e {
            ExecError::HealthCheckFailed(why) => ExecError::HealthCheckFailed(format!(
                "container {} failed its health check: {why}",
                plan.name
            )),
            other => other,
        })?;
        run.log.line(format!("{} is healthy", plan.name));

        if let Some(hook) = &payload.hooks.post_deploy {
            hooks::run_hook(
                run,
                hook,
                "post-deploy",
                None,
                hook_env,
                &self.allowed_hooks,
            )
            .await?;
        }
        Ok(id)
    }

    /// Step 8–9: remove the previous container (unless asked to keep it), write the sticker.
    async fn finish_success(
        &self,
        run: &mut Run<'_>,
        docker: &Docker,
        plan: &Plan,
        touched: &Touched,
        container_id: &str,
    ) -> Result<String, ExecError> {
        if let Some(prev) = &touched.previous {
            let name = prev.renamed_to.as_deref().unwrap_or(&prev.id);
            if plan.cleanup_previous {
                run.log
                    .line(format!("removing the previous container {name}"));
                let options = RemoveContainerOptionsBuilder::default().force(true).build();
                if let Err(e) = docker.remove_container(&prev.id, Some(options)).await {
                    // The deployment itself worked; a leftover container is only untidy.
                    run.log
                        .line(format!("warning: could not remove {name}: {e}"));
                }
            } else {
                run.log
                    .line(format!("keeping the previous container as {name}"));
                run.output("previousContainerName", name.to_string());
            }
        }
        let sticker = Sticker {
            name: plan.name.clone(),
            release_id: plan.release_id.clone(),
            release_name: plan.release_name.clone(),
            image: Some(plan.image.repository.clone()),
            digest: Some(plan.digest.clone()),
            task_id: run.task.task_id.to_string(),
            written_at: time::OffsetDateTime::now_utc(),
            extra: serde_json::Map::from_iter([(
                "containerId".to_string(),
                serde_json::Value::from(container_id),
            )]),
        };
        self.write_sticker(run, docker, &sticker, plan.sticker_volume.as_ref())
            .await?;
        Ok(format!(
            "deployed {} as {}@{}",
            plan.name, plan.image.repository, plan.digest
        ))
    }

    /// Step 9: the sticker, in the sticker directory or, for `stickerLocation: "volume"`, in
    /// its volume through the Engine API.
    async fn write_sticker(
        &self,
        run: &mut Run<'_>,
        docker: &Docker,
        sticker: &Sticker,
        volume: Option<&VolumeSticker>,
    ) -> Result<(), ExecError> {
        match volume {
            Some(v) => {
                crate::sticker::volume::write(docker, v, sticker).await?;
                run.log.line(format!(
                    "sticker written to {} in volume {}",
                    v.path, v.volume
                ));
            }
            None => {
                let path = self.stickers.write(sticker).map_err(ExecError::Sticker)?;
                run.log
                    .line(format!("sticker written to {}", path.display()));
            }
        }
        Ok(())
    }

    async fn rollback(
        &self,
        run: &mut Run<'_>,
        payload: RollbackTaskPayload,
    ) -> Result<String, ExecError> {
        let name = payload
            .container_name
            .clone()
            .or_else(|| payload.deploy.config.container_name.clone())
            .ok_or_else(|| ExecError::InvalidPayload("containerName is required".into()))?;
        if !reference::valid_container_name(&name) {
            return Err(ExecError::InvalidPayload(format!(
                "container name {name:?} is invalid"
            )));
        }
        // Hooks the agent does not allow fail the rollback before it looks anything up.
        hooks::validate_all(&payload.deploy.hooks, &self.allowed_hooks)?;
        if let Some(target) = &payload.target_digest {
            // A redeploy of that digest, with the rest of the payload.
            let mut deploy = payload.deploy.clone();
            deploy.digest = Some(target.clone());
            deploy.config.container_name = Some(name.clone());
            if deploy.image.is_none() {
                // The repository the container runs now, as its label says.
                let docker = run.stop.guard(self.engine.docker()).await?;
                let current = run
                    .stop
                    .guard(engine::find_container(docker, &name))
                    .await?;
                deploy.image = current.as_ref().and_then(|c| label(c, engine::LABEL_IMAGE));
                if deploy.image.is_none() {
                    return Err(ExecError::InvalidPayload(format!(
                        "rollback to {target} needs image: {name} carries no {} label",
                        engine::LABEL_IMAGE
                    )));
                }
            }
            run.log
                .line(format!("rollback of {name}: redeploying {target}"));
            return self.deploy(run, &deploy).await;
        }
        if let Some(h) = &payload.deploy.config.health_check {
            engine::validate_health_check(h)?;
        }
        let docker = run.stop.guard(self.engine.docker()).await?;
        let stop = run.stop.clone();

        // The newest `<name>-previous-<ms>`.
        let prefix = format!("{name}-previous-");
        let candidates = stop
            .guard(engine::container_names_like(docker, &prefix))
            .await?;
        let previous = candidates
            .into_iter()
            .filter_map(|(id, n)| {
                let ts = n.strip_prefix(&prefix)?.parse::<u128>().ok()?;
                Some((ts, id, n))
            })
            .max_by_key(|(ts, _, _)| *ts);
        let Some((_, previous_id, previous_name)) = previous else {
            return Err(ExecError::NoPreviousContainer(name));
        };
        run.log
            .line(format!("rolling {name} back to {previous_name}"));

        run.confirm_lease("the container swap").await?;
        let started = Instant::now();
        let mut failed_name = None;
        // The replaced container (id, was running), to put back if the swap fails.
        let mut replaced = None;
        if let Some(current) = stop.guard(engine::find_container(docker, &name)).await? {
            let id = current.id.clone().unwrap_or_default();
            stop.check()?;
            if is_running(&current) {
                run.log
                    .line(format!("stopping the current container {name}"));
                let options = StopContainerOptionsBuilder::default()
                    .t(STOP_TIMEOUT_SECS)
                    .build();
                // Not abandoned half-way: see `replace`.
                docker
                    .stop_container(&id, Some(options))
                    .await
                    .map_err(|e| engine_error("stop", &name, e))?;
            }
            let new_name = format!("{name}-failed-{}", unix_millis());
            run.log.line(format!("renaming it to {new_name}"));
            let options = RenameContainerOptionsBuilder::default()
                .name(&new_name)
                .build();
            if let Err(e) = docker.rename_container(&id, options).await {
                // Put it back the way it was before giving up.
                if is_running(&current) {
                    let _ = docker.start_container(&id, None).await;
                }
                return Err(engine_error("rename", &name, e));
            }
            run.output("failedContainerName", new_name.clone());
            failed_name = Some(new_name);
            replaced = Some((id, is_running(&current)));
        }
        run.log.line(format!(
            "renaming {previous_name} to {name} and starting it"
        ));
        let options = RenameContainerOptionsBuilder::default().name(&name).build();
        let swapped = match docker.rename_container(&previous_id, options).await {
            Err(e) => Err(engine_error("rename", &previous_name, e)),
            Ok(()) => match docker.start_container(&previous_id, None).await {
                Err(e) => {
                    let options = RenameContainerOptionsBuilder::default()
                        .name(&previous_name)
                        .build();
                    let _ = docker.rename_container(&previous_id, options).await;
                    Err(engine_error("start", &name, e))
                }
                Ok(()) => Ok(()),
            },
        };
        if let Err(e) = swapped {
            // Best effort: the replaced container back under its name, as it was.
            if let Some((id, was_running)) = &replaced {
                run.log.line(format!("putting {name} back"));
                let options = RenameContainerOptionsBuilder::default().name(&name).build();
                if docker.rename_container(id, options).await.is_ok() && *was_running {
                    let _ = docker.start_container(id, None).await;
                }
            }
            return Err(e);
        }
        run.metrics.deploy_duration_ms = Some(millis_since(started));
        run.output("containerId", previous_id.clone());

        if let Some(check) = &payload.deploy.config.health_check {
            let started = Instant::now();
            let healthy =
                engine::wait_container_healthy(docker, &previous_id, check, &stop, &mut run.log)
                    .await;
            run.metrics.health_check_duration_ms = Some(millis_since(started));
            healthy?;
        }
        let restored = docker
            .inspect_container(&previous_id, None)
            .await
            .map_err(|e| engine_error("inspect container", &name, e))?;
        let digest = label(&restored, engine::LABEL_DIGEST);
        run.output(
            "digest",
            digest.clone().map_or(serde_json::Value::Null, Into::into),
        );
        let sticker = Sticker {
            name: name.clone(),
            release_id: label(&restored, engine::LABEL_RELEASE_ID),
            release_name: label(&restored, engine::LABEL_RELEASE_NAME),
            image: label(&restored, engine::LABEL_IMAGE),
            digest: digest.clone(),
            task_id: run.task.task_id.to_string(),
            written_at: time::OffsetDateTime::now_utc(),
            extra: serde_json::Map::from_iter([
                (
                    "containerId".to_string(),
                    serde_json::Value::from(previous_id.as_str()),
                ),
                ("rollback".to_string(), serde_json::Value::Bool(true)),
            ]),
        };
        let volume = payload
            .volume_sticker()
            .map_err(ExecError::InvalidPayload)?;
        self.write_sticker(run, docker, &sticker, volume.as_ref())
            .await?;
        Ok(format!(
            "rolled {name} back to {}{}",
            digest.as_deref().unwrap_or(&previous_name),
            failed_name
                .map(|f| format!("; the replaced container is {f}"))
                .unwrap_or_default()
        ))
    }
}

/// Undoes a failed deployment: removes the new container, gives the previous one its name back
/// and starts it if it was running. Runs to the end even when the task was cancelled. `true`
/// when a previous container is serving again under its name.
async fn restore(docker: &Docker, name: &str, touched: &Touched, log: &mut Log) -> bool {
    let stop = Stop::cleanup(RESTORE_BUDGET);
    let mut ok = true;
    let name_was_freed = touched
        .previous
        .as_ref()
        .is_none_or(|p| p.renamed_to.is_some());
    let mut new_id = touched.new_id.clone();
    if new_id.is_none() && touched.create_sent && name_was_freed {
        // The create request may have been carried out although its answer never came: the
        // name was free before it, so whoever holds it now is ours.
        if let Ok(Some(c)) = engine::find_container(docker, name).await {
            new_id = c.id;
        }
    }
    if let Some(id) = &new_id {
        log.line(format!("rollback: removing the new container {id:.12}"));
        let options = RemoveContainerOptionsBuilder::default().force(true).build();
        let removed = stop
            .guard(async {
                docker
                    .remove_container(id, Some(options))
                    .await
                    .map_err(|e| engine_error("remove", name, e))
            })
            .await;
        if let Err(e) = removed {
            log.line(format!("rollback: {}", e.chain()));
            ok = false;
        }
    }
    let Some(prev) = &touched.previous else {
        log.line("rollback: there was no previous container to restore");
        return false;
    };
    if let Some(temporary) = &prev.renamed_to {
        log.line(format!("rollback: renaming {temporary} back to {name}"));
        let options = RenameContainerOptionsBuilder::default().name(name).build();
        let renamed = stop
            .guard(async {
                docker
                    .rename_container(&prev.id, options)
                    .await
                    .map_err(|e| engine_error("rename", temporary, e))
            })
            .await;
        if let Err(e) = renamed {
            log.line(format!("rollback: {}", e.chain()));
            ok = false;
        }
    }
    if prev.was_running {
        log.line(format!("rollback: starting {name} again"));
        let started = stop
            .guard(async {
                match docker.start_container(&prev.id, None).await {
                    // 304: already running.
                    Err(bollard::errors::Error::DockerResponseServerError {
                        status_code: 304,
                        ..
                    }) => Ok(()),
                    other => other.map_err(|e| engine_error("start", name, e)),
                }
            })
            .await;
        if let Err(e) = started {
            log.line(format!("rollback: {}", e.chain()));
            ok = false;
        }
    }
    if ok {
        log.line(format!("rollback: the previous {name} is back"));
    }
    ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ports_in_cli_syntax() {
        let (k, b) = parse_port("127.0.0.1:18080:8080/tcp").unwrap();
        assert_eq!(k, "8080/tcp");
        assert_eq!(
            (b.host_ip.as_deref(), b.host_port.as_deref()),
            (Some("127.0.0.1"), Some("18080"))
        );
        let (k, b) = parse_port("53:53/udp").unwrap();
        assert_eq!(
            (k.as_str(), b.host_ip, b.host_port.as_deref()),
            ("53/udp", None, Some("53"))
        );
        let (k, b) = parse_port("8080").unwrap();
        assert_eq!((k.as_str(), b.host_port), ("8080/tcp", None));
        let (_, b) = parse_port("127.0.0.1::80").unwrap();
        assert_eq!(
            (b.host_ip.as_deref(), b.host_port),
            (Some("127.0.0.1"), None)
        );
        let (_, b) = parse_port("[::1]:80:80").unwrap();
        assert_eq!(b.host_ip.as_deref(), Some("::1"));
        for bad in [
            "",
            "0",
            "80/icmp",
            "a:80",
            "1.2.3.4.5:80:80",
            "8000-8010:80",
            "1:2:3:4",
            "x:1:2",
        ] {
            assert!(parse_port(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn validates_volumes() {
        for ok in ["data:/data", "data:/data:ro", "/srv/x:/x:rw,z"] {
            assert!(validate_volume(ok).is_ok(), "{ok}");
        }
        for bad in [
            "data",
            "data:rel",
            "/a/../b:/b",
            "data:/",
            "data:/d:rx",
            "$(x):/d",
            "a:/b:ro:x",
        ] {
            assert!(validate_volume(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn plans_refuse_tags_and_bad_input() {
        let base = |image: &str, digest: Option<&str>| DeployTaskPayload {
            image: Some(image.into()),
            digest: digest.map(Into::into),
            config: berth_proto::payload::DeployConfig {
                container_name: Some("web".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let d = format!("sha256:{}", "a".repeat(64));
        assert!(plan(
            &base("127.0.0.1:5000/web", Some(&d)),
            &AllowedHooks::default()
        )
        .is_ok());
        assert!(plan(
            &base(&format!("127.0.0.1:5000/web@{d}"), None),
            &AllowedHooks::default()
        )
        .is_ok());
        assert_eq!(
            plan(
                &base("127.0.0.1:5000/web:1.0", None),
                &AllowedHooks::default()
            )
            .unwrap_err()
            .code(),
            "DIGEST_REQUIRED"
        );
        assert_eq!(
            plan(&base("web", Some("sha256:abc")), &AllowedHooks::default())
                .unwrap_err()
                .code(),
            "DIGEST_REQUIRED"
        );
        let other = format!("sha256:{}", "b".repeat(64));
        assert_eq!(
            plan(
                &base(&format!("web@{d}"), Some(&other)),
                &AllowedHooks::default()
            )
            .unwrap_err()
            .code(),
            "INVALID_PAYLOAD"
        );
        let mut p = base("web", Some(&d));
        p.config.container_name = Some("web; rm -rf /".into());
        assert_eq!(
            plan(&p, &AllowedHooks::default()).unwrap_err().code(),
            "INVALID_PAYLOAD"
        );
        let mut p = base("web", Some(&d));
        p.config.restart_policy = Some("sometimes".into());
        assert_eq!(
            plan(&p, &AllowedHooks::default()).unwrap_err().code(),
            "INVALID_PAYLOAD"
        );
    }
}
