//! What this host can do: a reachable Docker engine (asked for its version over its Unix socket),
//! a compose tool (`docker compose` v2, else `docker-compose` v1), and `ssh`, which every agent
//! has (its SSH client is built in). Commands run as argument
//! vectors with a timeout, never through a shell.

use std::path::PathBuf;
use std::time::Duration;

use berth_proto::agent::Capability;
use berth_proto::kind::capability;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// The Docker engine's socket: `DOCKER_HOST=unix://…` or the default path.
fn docker_socket() -> PathBuf {
    std::env::var("DOCKER_HOST")
        .ok()
        .and_then(|h| h.strip_prefix("unix://").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("/var/run/docker.sock"))
}

/// `None` when this host has no Docker engine at all; a capability with `healthy: false` when the
/// socket is there but the engine does not answer (the agent then reports `degraded`).
pub async fn docker() -> Option<Capability> {
    let socket = docker_socket();
    if !socket.exists() {
        return None;
    }
    Some(
        match tokio::time::timeout(PROBE_TIMEOUT, engine_version(&socket)).await {
            Ok(Ok(version)) => Capability {
                name: capability::DOCKER.into(),
                version: Some(version),
                healthy: true,
                detail: None,
            },
            Ok(Err(e)) => unhealthy(capability::DOCKER, format!("engine not answering: {e}")),
            Err(_) => unhealthy(capability::DOCKER, "engine did not answer in time".into()),
        },
    )
}

fn unhealthy(name: &str, detail: String) -> Capability {
    Capability {
        name: name.into(),
        version: None,
        healthy: false,
        detail: Some(detail),
    }
}

async fn engine_version(socket: &std::path::Path) -> std::io::Result<String> {
    let mut stream = tokio::net::UnixStream::connect(socket).await?;
    stream
        .write_all(b"GET /version HTTP/1.0\r\nHost: docker\r\n\r\n")
        .await?;
    let mut response = Vec::new();
    stream.take(256 * 1024).read_to_end(&mut response).await?;
    let text = String::from_utf8_lossy(&response);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .ok_or_else(|| std::io::Error::other("no HTTP body"))?;
    let json: serde_json::Value =
        serde_json::from_str(body).map_err(|e| std::io::Error::other(format!("bad JSON: {e}")))?;
    json.get("Version")
        .and_then(|v| v.as_str())
        .map(str::to_string)
        .ok_or_else(|| std::io::Error::other("no Version in /version"))
}

/// Docker and compose, probed together, and `ssh`.
pub async fn detect() -> Vec<Capability> {
    let (docker, compose) = tokio::join!(docker(), compose());
    docker.into_iter().chain(compose).chain([ssh()]).collect()
}

/// `ssh.deploy` needs nothing on this host: the executor's SSH client (russh) is part of the
/// agent, so the capability is always there; whether a target answers is each task's business.
pub fn ssh() -> Capability {
    Capability {
        name: capability::SSH.into(),
        version: Some("russh 0.65".into()),
        healthy: true,
        detail: Some("agentless targets over SSH (ssh.deploy)".into()),
    }
}

/// `docker compose` (v2) when present, else `docker-compose` (v1).
pub async fn compose() -> Option<Capability> {
    for (program, args, flavour) in [
        (
            "docker",
            &["compose", "version", "--short"][..],
            "docker compose",
        ),
        (
            "docker-compose",
            &["version", "--short"][..],
            "docker-compose",
        ),
    ] {
        if let Some(version) = command_output(program, args).await {
            return Some(Capability {
                name: capability::COMPOSE.into(),
                version: Some(version),
                healthy: true,
                detail: Some(flavour.into()),
            });
        }
    }
    None
}

async fn command_output(program: &str, args: &[&str]) -> Option<String> {
    let child = Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(10), child)
        .await
        .ok()?
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let version = String::from_utf8_lossy(&output.stdout).trim().to_string();
    (!version.is_empty() && version.len() <= 64).then_some(version)
}
