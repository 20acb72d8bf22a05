//! The executors that need nothing but the host: `health-check`, `read-sticker`,
//! `write-sticker`, `inspect` and `execute-command` (off unless the agent was started with an
//! allow-list of programs; an argument vector, never a shell).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::json;

use crate::redact::redact;
use crate::sticker::{Sticker, StickerStore};
use crate::{parse_payload, probe, Executor, Outcome, PhaseMetrics, Task};

const MAX_OUTPUT: usize = 64 * 1024;

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct HealthCheckPayload {
    /// `http` or `tcp`.
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    url: Option<String>,
    #[serde(default)]
    host: Option<String>,
    #[serde(default)]
    port: Option<u16>,
    /// Seconds for one probe; default 5.
    #[serde(default)]
    timeout: Option<u64>,
}

pub struct HealthCheck;

#[async_trait::async_trait]
impl Executor for HealthCheck {
    fn task_types(&self) -> &'static [&'static str] {
        &["health-check"]
    }

    fn has_side_effects(&self, _: &str) -> bool {
        false
    }

    async fn execute(&self, task: &Task) -> Outcome {
        let p: HealthCheckPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        let timeout = Duration::from_secs(p.timeout.unwrap_or(5).clamp(1, 300));
        let started = Instant::now();
        let result = match (p.kind.as_str(), &p.url, &p.host, p.port) {
            ("http", Some(url), _, _) => match probe::parse_http_url(url) {
                Ok(target) => probe::http_get(&target, timeout)
                    .await
                    .map(|s| json!({ "status": s })),
                Err(e) => return Outcome::failed("INVALID_PAYLOAD", e, false),
            },
            ("tcp", _, Some(host), Some(port)) => probe::tcp_connect(host, port, timeout)
                .await
                .map(|_| json!({})),
            _ => {
                return Outcome::failed(
                    "INVALID_PAYLOAD",
                    "health-check needs type http with url, or type tcp with host and port",
                    false,
                )
            }
        };
        let metrics = PhaseMetrics {
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
                ..Outcome::failed("HEALTH_CHECK_FAILED", e, true)
            },
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ReadStickerPayload {
    name: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WriteStickerPayload {
    name: String,
    #[serde(default)]
    release_id: Option<String>,
    #[serde(default)]
    release_name: Option<String>,
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    digest: Option<String>,
    #[serde(default)]
    extra: serde_json::Map<String, serde_json::Value>,
}

/// `read-sticker` and `write-sticker`.
pub struct Stickers(pub StickerStore);

#[async_trait::async_trait]
impl Executor for Stickers {
    fn task_types(&self) -> &'static [&'static str] {
        &["read-sticker", "write-sticker"]
    }

    fn has_side_effects(&self, task_type: &str) -> bool {
        task_type == "write-sticker"
    }

    async fn execute(&self, task: &Task) -> Outcome {
        if task.task_type == "read-sticker" {
            let p: ReadStickerPayload = match parse_payload(task) {
                Ok(p) => p,
                Err(o) => return *o,
            };
            return match self.0.read(&p.name) {
                Ok(Some(s)) => Outcome::ok(format!("sticker {} found", p.name))
                    .with_output("sticker", json!(s)),
                Ok(None) => Outcome::ok(format!("no sticker named {}", p.name))
                    .with_output("sticker", serde_json::Value::Null),
                Err(e) => Outcome::failed("STICKER_UNREADABLE", e.to_string(), false),
            };
        }
        let p: WriteStickerPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
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
        match self.0.write(&sticker) {
            Ok(path) => Outcome::ok(format!("sticker written to {}", path.display()))
                .with_output("sticker", json!(sticker)),
            Err(e) => Outcome::failed("STICKER_WRITE_FAILED", e.to_string(), false),
        }
    }
}

/// `inspect`: host facts, the agent's capabilities and every sticker.
pub struct Inspect {
    pub stickers: StickerStore,
    /// Filled in by the agent: its capabilities as it reports them in heartbeats.
    pub capabilities: std::sync::Arc<std::sync::Mutex<serde_json::Value>>,
    /// Lists berth-managed containers, when the host has Docker.
    pub docker: Option<std::sync::Arc<crate::DockerExecutor>>,
}

#[async_trait::async_trait]
impl Executor for Inspect {
    fn task_types(&self) -> &'static [&'static str] {
        &["inspect"]
    }

    fn has_side_effects(&self, _: &str) -> bool {
        false
    }

    async fn execute(&self, _task: &Task) -> Outcome {
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
            Err(e) => return Outcome::failed("STICKER_UNREADABLE", e.to_string(), true),
        };
        let capabilities = self
            .capabilities
            .lock()
            .map(|c| c.clone())
            .unwrap_or(serde_json::Value::Null);
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
            .with_output("capabilities", capabilities)
            .with_output("stickers", json!(stickers))
    }
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CommandPayload {
    /// Program (absolute path, on the allow-list) and its arguments.
    command: Vec<String>,
    #[serde(default)]
    working_directory: Option<PathBuf>,
    #[serde(default)]
    environment: BTreeMap<String, String>,
}

/// `execute-command`: only programs on the allow-list the agent was started with.
pub struct ExecuteCommand {
    pub allowed: Vec<PathBuf>,
}

#[async_trait::async_trait]
impl Executor for ExecuteCommand {
    fn task_types(&self) -> &'static [&'static str] {
        &["execute-command"]
    }

    fn has_side_effects(&self, _: &str) -> bool {
        true
    }

    async fn execute(&self, task: &Task) -> Outcome {
        let p: CommandPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        let Some(program) = p.command.first() else {
            return Outcome::failed("INVALID_PAYLOAD", "command must name a program", false);
        };
        if self.allowed.is_empty() {
            return Outcome::failed(
                "COMMAND_NOT_ALLOWED",
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
                "COMMAND_NOT_ALLOWED",
                format!("{program} is not on this agent's allow-list"),
                false,
            );
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
            _ = task.cancel.cancelled() => return Outcome::failed("CANCELLED", "cancelled", false),
        };
        let output = match output {
            Ok(o) => o,
            Err(e) => {
                return Outcome::failed(
                    "COMMAND_FAILED",
                    format!("{program} could not start: {e}"),
                    false,
                )
            }
        };
        let clip = |b: &[u8]| {
            redact(
                &String::from_utf8_lossy(&b[..b.len().min(MAX_OUTPUT)]),
                &task.credentials,
            )
        };
        let (stdout, stderr) = (clip(&output.stdout), clip(&output.stderr));
        let code = output.status.code();
        let outcome = if output.status.success() {
            Outcome::ok(format!("{program} exited 0"))
        } else {
            Outcome::failed(
                "COMMAND_FAILED",
                format!(
                    "{program} exited {}",
                    code.map_or("by a signal".into(), |c| c.to_string())
                ),
                false,
            )
        };
        Outcome {
            metrics: PhaseMetrics {
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
