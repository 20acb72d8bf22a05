//! The executors that need nothing but the host: `health-check`, `read-sticker`,
//! `write-sticker`, `inspect` and `execute-command` (off unless the agent was started with an
//! allow-list of programs; an argument vector, never a shell). `health-check` (type `command`),
//! `read-sticker` and `inspect` with an `sshTarget` read that SSH target instead, through
//! [`crate::ssh`].

use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use berth_proto::agent::Capability;
use berth_proto::kind::{capability, TaskKind};
use berth_proto::payload::{
    CheckPayload, CommandPayload, HealthCheckPayload, InspectPayload, ReadStickerPayload,
    WriteStickerPayload,
};
use berth_proto::result::{error_types, TaskMetrics};
use serde_json::json;

use crate::redact::redact;
use crate::sticker::{Sticker, StickerStore};
use crate::{parse_payload, probe, ssh, ExecError, Executor, Outcome, Task};

const MAX_OUTPUT: usize = 64 * 1024;

pub struct HealthCheck;

#[async_trait::async_trait]
impl Executor for HealthCheck {
    fn task_types(&self) -> &'static [TaskKind] {
        &[TaskKind::HealthCheck]
    }

    async fn execute(&self, task: &Task) -> Outcome {
        let p: HealthCheckPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        if let Err(e) = p.check() {
            return Outcome::failed(error_types::INVALID_PAYLOAD, e, false);
        }
        if p.kind == "command" {
            return ssh::health_command(task, &p).await;
        }
        let timeout = Duration::from_secs(p.timeout.unwrap_or(5).clamp(1, 300));
        let started = Instant::now();
        let result = match (p.kind.as_str(), &p.url, &p.host, p.port) {
            ("http", Some(url), _, _) => match probe::parse_http_url(url) {
                Ok(target) => probe::http_get(&target, timeout)
                    .await
                    .map(|s| json!({ "status": s })),
                Err(e) => return Outcome::failed(error_types::INVALID_PAYLOAD, e, false),
            },
            ("tcp", _, Some(host), Some(port)) => probe::tcp_connect(host, port, timeout)
                .await
                .map(|_| json!({})),
            _ => {
                return Outcome::failed(
                    error_types::INVALID_PAYLOAD,
                    "health-check needs type http with url, or type tcp with host and port",
                    false,
                )
            }
        };
        let metrics = TaskMetrics {
            health_check_duration_ms: Some(started.elapsed().as_millis() as u64),
            ..Default::default()
        };
        match result {
            Ok(detail) => Outcome {
                metrics,
                ..Outcome::ok("healthy").with_output("probe", detail)
            },
            Err(e) => Outcome {
                metrics,
                // A probe can pass later; the task is read-only, so retrying is safe.
                ..Outcome::failed(error_types::HEALTH_CHECK_FAILED, e, true)
            },
        }
    }
}

/// `read-sticker` and `write-sticker`.
pub struct Stickers(pub StickerStore);

#[async_trait::async_trait]
impl Executor for Stickers {
    fn task_types(&self) -> &'static [TaskKind] {
        &[TaskKind::ReadSticker, TaskKind::WriteSticker]
    }

    async fn execute(&self, task: &Task) -> Outcome {
        let kind = TaskKind::parse(&task.task_type);
        if kind == Some(TaskKind::ReadSticker) {
            let p: ReadStickerPayload = match parse_payload(task) {
                Ok(p) => p,
                Err(o) => return *o,
            };
            if let Err(e) = p.check() {
                return Outcome::failed(error_types::INVALID_PAYLOAD, e, false);
            }
            if let (Some(target), Some(dir)) = (&p.ssh_target, &p.deploy_directory) {
                return ssh::read_sticker(task, &p.name, target, dir).await;
            }
            match p.volume() {
                Err(e) => return Outcome::failed(error_types::INVALID_PAYLOAD, e, false),
                Ok(Some(v)) => return read_volume_sticker(&p.name, &v).await,
                Ok(None) => {}
            }
            return match self.0.read(&p.name) {
                Ok(Some(s)) => Outcome::ok(format!("sticker {} found", p.name))
                    .with_output("sticker", json!(s)),
                Ok(None) => Outcome::ok(format!("no sticker named {}", p.name))
                    .with_output("sticker", serde_json::Value::Null),
                Err(e) => Outcome::failed(error_types::STICKER_UNREADABLE, e.to_string(), false),
            };
        }
        if kind != Some(TaskKind::WriteSticker) {
            return Outcome::failed(
                error_types::UNSUPPORTED_TASK_TYPE,
                format!("the sticker executor does not run {}", task.task_type),
                false,
            );
        }
        let p: WriteStickerPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        if let Err(e) = p.check() {
            return Outcome::failed(error_types::INVALID_PAYLOAD, e, false);
        }
        let volume = match p.volume() {
            Ok(v) => v,
            Err(e) => return Outcome::failed(error_types::INVALID_PAYLOAD, e, false),
        };
        let sticker = Sticker {
            name: p.name,
            release_id: p.release_id,
            release_name: p.release_name,
            image: p.image,
            digest: p.digest,
            task_id: task.task_id.to_string(),
            written_at: time::OffsetDateTime::now_utc(),
            extra: p.extra,
        };
        if let Err(e) = task.lease.confirm(None).await {
            return lease_lost(e);
        }
        if let Some(v) = volume {
            let written = async {
                let engine = crate::engine::Engine::new();
                crate::sticker::volume::write(engine.docker().await?, &v, &sticker).await
            };
            return match written.await {
                Ok(()) => Outcome::ok(format!(
                    "sticker written to {} in volume {}",
                    v.path, v.volume
                ))
                .with_output("sticker", json!(sticker)),
                Err(e) => Outcome::failed(
                    error_types::STICKER_WRITE_FAILED,
                    e.to_string(),
                    e.retriable(),
                ),
            };
        }
        match self.0.write(&sticker) {
            Ok(path) => Outcome::ok(format!("sticker written to {}", path.display()))
                .with_output("sticker", json!(sticker)),
            Err(e) => Outcome::failed(error_types::STICKER_WRITE_FAILED, e.to_string(), false),
        }
    }
}

/// `read-sticker` of a sticker in a named volume.
async fn read_volume_sticker(name: &str, v: &crate::sticker::volume::VolumeSticker) -> Outcome {
    let read = async {
        let engine = crate::engine::Engine::new();
        crate::sticker::volume::read(engine.docker().await?, v).await
    };
    match read.await {
        Ok(Some(s)) => Outcome::ok(format!("sticker {name} found in volume {}", v.volume))
            .with_output("sticker", json!(s)),
        Ok(None) => Outcome::ok(format!("no sticker {} in volume {}", v.path, v.volume))
            .with_output("sticker", serde_json::Value::Null),
        Err(e) => Outcome::failed(
            error_types::STICKER_UNREADABLE,
            e.to_string(),
            e.retriable(),
        ),
    }
}

/// The agent's capabilities as its latest heartbeat reported them, shared between the heartbeat
/// loop (which detects them), the poll (which offers them) and `inspect`.
#[derive(Debug, Clone, Default)]
pub struct Capabilities(Arc<RwLock<Vec<Capability>>>);

impl Capabilities {
    pub fn new(detected: Vec<Capability>) -> Capabilities {
        Capabilities(Arc::new(RwLock::new(detected)))
    }

    pub fn set(&self, detected: Vec<Capability>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = detected;
    }

    pub fn get(&self) -> Vec<Capability> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// What a poll offers: seed 000's capability strings, [`capability::AGENT`] (every agent runs
    /// the built-in kinds) and then the name of each capability the host has, healthy or not. The
    /// server fails a task whose capability a poll does not offer (`CAPABILITY_MISSING`, for
    /// good), while an engine that is down for a while only fails a delivery retriably
    /// (`DOCKER_UNAVAILABLE`): so a broken capability is still offered.
    pub fn offered(&self) -> Vec<String> {
        let detected = self.0.read().unwrap_or_else(|e| e.into_inner());
        std::iter::once(capability::AGENT.to_string())
            .chain(
                detected
                    .iter()
                    .filter(|c| c.name != capability::AGENT)
                    .map(|c| c.name.clone()),
            )
            .collect()
    }
}

/// `inspect`: host facts, the agent's capabilities and every sticker.
pub struct Inspect {
    pub stickers: StickerStore,
    /// Filled in by the agent: its capabilities as it reports them in heartbeats.
    pub capabilities: Capabilities,
    /// Lists berth-managed containers, when the host has Docker.
    pub docker: Option<std::sync::Arc<crate::DockerExecutor>>,
}

#[async_trait::async_trait]
impl Executor for Inspect {
    fn task_types(&self) -> &'static [TaskKind] {
        &[TaskKind::Inspect]
    }

    async fn execute(&self, task: &Task) -> Outcome {
        let p: InspectPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        if let Err(e) = p.check() {
            return Outcome::failed(error_types::INVALID_PAYLOAD, e, false);
        }
        if let (Some(target), Some(dir)) = (&p.ssh_target, &p.deploy_directory) {
            return ssh::inspect(task, target, dir).await;
        }
        let read = |p: &str| {
            std::fs::read_to_string(p)
                .map(|s| s.trim().to_string())
                .unwrap_or_default()
        };
        let os = read("/etc/os-release")
            .lines()
            .find_map(|l| {
                l.strip_prefix("PRETTY_NAME=")
                    .map(|v| v.trim_matches('"').to_string())
            })
            .unwrap_or_default();
        let stickers = match self.stickers.list() {
            Ok(s) => s,
            Err(e) => return Outcome::failed(error_types::STICKER_UNREADABLE, e.to_string(), true),
        };
        let capabilities = self.capabilities.get();
        let containers = match &self.docker {
            None => serde_json::Value::Null,
            Some(docker) => match docker.inspect_containers().await {
                Ok(list) => json!(list),
                Err(e) => json!({ "error": e.code(), "detail": e.to_string() }),
            },
        };
        Outcome::ok("inspected")
            .with_output("containers", containers)
            .with_output(
                "host",
                json!({
                    "hostname": read("/proc/sys/kernel/hostname"),
                    "os": os,
                    "kernel": read("/proc/sys/kernel/osrelease"),
                    "arch": std::env::consts::ARCH,
                    "cpuCores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
                }),
            )
            .with_output("capabilities", json!(capabilities))
            .with_output("stickers", json!(stickers))
    }
}

/// The outcome of a step not taken because the delivery's lease no longer held.
fn lease_lost(e: ExecError) -> Outcome {
    Outcome::failed(e.code(), e.chain(), e.retriable())
}

/// `execute-command`: only programs on the allow-list the agent was started with.
pub struct ExecuteCommand {
    pub allowed: Vec<PathBuf>,
}

#[async_trait::async_trait]
impl Executor for ExecuteCommand {
    fn task_types(&self) -> &'static [TaskKind] {
        &[TaskKind::ExecuteCommand]
    }

    async fn execute(&self, task: &Task) -> Outcome {
        let p: CommandPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        let Some(program) = p.command.first() else {
            return Outcome::failed(
                error_types::INVALID_PAYLOAD,
                "command must name a program",
                false,
            );
        };
        if self.allowed.is_empty() {
            return Outcome::failed(
                error_types::COMMAND_NOT_ALLOWED,
                "execute-command is off: start the agent with --allow-command",
                false,
            );
        }
        if !self
            .allowed
            .iter()
            .any(|a| a.as_os_str() == program.as_str())
        {
            return Outcome::failed(
                error_types::COMMAND_NOT_ALLOWED,
                format!("{program} is not on this agent's allow-list"),
                false,
            );
        }
        if let Err(e) = task.lease.confirm(None).await {
            return lease_lost(e);
        }
        let mut command = tokio::process::Command::new(program);
        command
            .args(&p.command[1..])
            .envs(&p.environment)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        if let Some(dir) = &p.working_directory {
            command.current_dir(dir);
        }
        let started = Instant::now();
        let output = tokio::select! {
            out = command.output() => out,
            _ = task.cancel.cancelled() => return Outcome::failed(error_types::CANCELLED, "cancelled", false),
        };
        let output = match output {
            Ok(o) => o,
            Err(e) => {
                return Outcome::failed(
                    error_types::COMMAND_FAILED,
                    format!("{program} could not start: {e}"),
                    false,
                )
            }
        };
        let clip = |b: &[u8]| {
            redact(
                &String::from_utf8_lossy(&b[..b.len().min(MAX_OUTPUT)]),
                task.credentials.values(),
            )
        };
        let (stdout, stderr) = (clip(&output.stdout), clip(&output.stderr));
        let code = output.status.code();
        let outcome = if output.status.success() {
            Outcome::ok(format!("{program} exited 0"))
        } else {
            Outcome::failed(
                error_types::COMMAND_FAILED,
                format!(
                    "{program} exited {}",
                    code.map_or("by a signal".into(), |c| c.to_string())
                ),
                false,
            )
        };
        Outcome {
            metrics: TaskMetrics {
                deploy_duration_ms: Some(started.elapsed().as_millis() as u64),
                ..Default::default()
            },
            ..outcome
                .with_output("exitCode", json!(code))
                .with_output("stdout", stdout.clone())
                .with_output("stderr", stderr.clone())
                .with_logs(format!("{stdout}{stderr}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(task_type: &str, payload: serde_json::Value) -> Task {
        Task {
            task_id: uuid::Uuid::new_v4(),
            task_type: task_type.into(),
            payload,
            credentials: Default::default(),
            variables: Default::default(),
            timeout: Duration::from_secs(10),
            cancel: Default::default(),
            lease: crate::Lease::unfenced(),
        }
    }

    struct Fenced;

    #[async_trait::async_trait]
    impl crate::LeaseCheck for Fenced {
        async fn confirm(
            &self,
            _: Option<berth_proto::transport::ProgressPhase>,
        ) -> Result<(), String> {
            Err("FENCED".into())
        }
    }

    /// Without its lease, `write-sticker` writes nothing and `execute-command` starts nothing.
    #[tokio::test]
    async fn without_its_lease_nothing_is_written_or_run() {
        let dir = tempfile::tempdir().unwrap();
        let store = StickerStore::new(dir.path().join("stickers"));
        let fenced = |mut task: Task| {
            task.lease = crate::Lease::new(Arc::new(Fenced));
            task
        };
        let o = Stickers(store.clone())
            .execute(&fenced(task(
                "write-sticker",
                json!({"name": "site", "releaseId": "r1"}),
            )))
            .await;
        assert_eq!(
            o.error_type.as_deref(),
            Some(error_types::LEASE_LOST),
            "{o:?}"
        );
        assert!(o.retriable, "not journaled: a later delivery runs it");
        assert!(
            store.read("site").unwrap().is_none(),
            "written without a lease"
        );

        let marker = dir.path().join("ran");
        let touch = ExecuteCommand {
            allowed: vec!["/usr/bin/touch".into()],
        };
        let o = touch
            .execute(&fenced(task(
                "execute-command",
                json!({"command": ["/usr/bin/touch", marker.display().to_string()]}),
            )))
            .await;
        assert_eq!(
            o.error_type.as_deref(),
            Some(error_types::LEASE_LOST),
            "{o:?}"
        );
        assert!(!marker.exists(), "ran without a lease");
    }

    #[test]
    fn polls_offer_agent_and_every_capability_the_host_has() {
        let caps = Capabilities::new(vec![
            Capability::named("docker"),
            Capability {
                healthy: false,
                ..Capability::named("compose")
            },
        ]);
        assert_eq!(caps.offered(), vec!["agent", "docker", "compose"]);
        caps.set(vec![]);
        assert_eq!(caps.offered(), vec!["agent"]);
    }

    #[tokio::test]
    async fn builtin_payloads_decode_with_the_proto_types() {
        let dir = tempfile::tempdir().unwrap();
        let stickers = Stickers(StickerStore::new(dir.path()));
        // `null` reads as `{}`, which lacks the name.
        let o = stickers
            .execute(&task("write-sticker", serde_json::Value::Null))
            .await;
        assert_eq!(o.error_type.as_deref(), Some(error_types::INVALID_PAYLOAD));
        let o = stickers
            .execute(&task("write-sticker", json!({"name": "web", "bogus": 1})))
            .await;
        assert_eq!(o.error_type.as_deref(), Some(error_types::INVALID_PAYLOAD));
        let o = stickers
            .execute(&task(
                "write-sticker",
                json!({"name": "web", "digest": "sha256:1"}),
            ))
            .await;
        assert!(o.success, "{o:?}");
        let o = stickers
            .execute(&task("read-sticker", json!({"name": "web"})))
            .await;
        assert_eq!(o.outputs["sticker"]["digest"], "sha256:1");
        let o = stickers.execute(&task("inspect", json!({}))).await;
        assert_eq!(
            o.error_type.as_deref(),
            Some(error_types::UNSUPPORTED_TASK_TYPE)
        );

        let inspect = Inspect {
            stickers: stickers.0.clone(),
            capabilities: Capabilities::new(vec![Capability::named("docker")]),
            docker: None,
        };
        let o = inspect
            .execute(&task("inspect", serde_json::Value::Null))
            .await;
        assert!(o.success, "{o:?}");
        assert_eq!(
            o.outputs["capabilities"],
            json!([{"name": "docker", "healthy": true}])
        );
    }
}
