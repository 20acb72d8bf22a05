//! `readiness-probe`: the agent-side checks of an environment's readiness (issue 14). Nothing
//! on the host changes: the Docker engine is asked over a fresh connection (a socket that went
//! away since the agent started is found, not hidden by a pooled connection), each registry's
//! `/v2/` is asked whether it answers at all, berth's containers are listed, and, when asked,
//! the environment's OpenBao secrets are resolved through a [`SecretsResolver`] the agent
//! supplies (only which ones did not resolve is reported, never a value). The server decides
//! what the report means (`berth-server/src/readiness.rs`); the probe only reports.

use std::time::Duration;

use std::sync::Arc;

use berth_proto::kind::TaskKind;
use berth_proto::payload::{ReadinessProbePayload, SecretsProbe, OPENBAO_LOGIN_JWT_CREDENTIAL};
use berth_proto::readiness::{ProbeCheck, ProbeReport, RegistryCheck, SecretsCheck};
use berth_proto::result::error_types;
use bollard::Docker;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{parse_payload, Executor, Outcome, Task};

/// Bounds each check, so one silent endpoint cannot hold the probe to its task timeout.
const CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// Resolves an environment's secrets at OpenBao from this host, the way a desired-state apply
/// would: the agent's OpenBao client (this crate has none). What did not resolve, by manifest
/// path with why; `Err` when OpenBao could not be asked at all.
#[async_trait::async_trait]
pub trait SecretsResolver: Send + Sync {
    async fn unresolved(
        &self,
        probe: &SecretsProbe,
        login_jwt: &str,
    ) -> Result<Vec<String>, String>;
}

#[derive(Default)]
pub struct ReadinessProbe {
    /// `None`: this agent cannot resolve secrets, and says so when asked.
    pub secrets: Option<Arc<dyn SecretsResolver>>,
}

#[async_trait::async_trait]
impl Executor for ReadinessProbe {
    fn task_types(&self) -> &'static [TaskKind] {
        &[TaskKind::ReadinessProbe]
    }

    async fn execute(&self, task: &Task) -> Outcome {
        let p: ReadinessProbePayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        if let Err(e) = berth_proto::payload::CheckPayload::check(&p) {
            return Outcome::failed(error_types::INVALID_PAYLOAD, e, false);
        }
        let mut report = ProbeReport::default();
        if p.docker {
            let (check, containers) = docker(&p.containers).await;
            report.docker = Some(check);
            report.containers = containers;
        }
        for host in &p.registries {
            report.registries.push(registry(host).await);
        }
        if let Some(probe) = &p.secrets {
            report.secrets = Some(self.secrets(probe, task).await);
        }
        let outputs = match serde_json::to_value(&report) {
            Ok(serde_json::Value::Object(map)) => map,
            _ => Default::default(),
        };
        Outcome {
            outputs,
            ..Outcome::ok("probed")
        }
    }
}

impl ReadinessProbe {
    async fn secrets(&self, probe: &SecretsProbe, task: &Task) -> SecretsCheck {
        let failed = |detail: String| SecretsCheck {
            ok: false,
            detail,
            unresolved: Vec::new(),
            checked: probe.entries.len(),
        };
        let Some(resolver) = &self.secrets else {
            return failed("this agent cannot resolve OpenBao secrets".into());
        };
        let Some(jwt) = task.credentials.get(OPENBAO_LOGIN_JWT_CREDENTIAL) else {
            return failed(format!(
                "the task carries no {OPENBAO_LOGIN_JWT_CREDENTIAL} credential"
            ));
        };
        match resolver.unresolved(probe, jwt).await {
            Ok(unresolved) => SecretsCheck {
                ok: true,
                detail: String::new(),
                unresolved,
                checked: probe.entries.len(),
            },
            Err(detail) => failed(detail),
        }
    }
}

/// The engine answers `/_ping` on a new connection (`DOCKER_HOST` as the other executors read
/// it); then berth's containers the payload names.
async fn docker(names: &[String]) -> (ProbeCheck, Vec<berth_proto::payload::InspectedContainer>) {
    let failed = |detail: String| (ProbeCheck { ok: false, detail }, Vec::new());
    if let Ok(host) = std::env::var("DOCKER_HOST") {
        if !host.is_empty() && !host.starts_with("unix://") {
            return failed(format!("DOCKER_HOST={host} is not a unix:// socket"));
        }
    }
    let docker = match Docker::connect_with_unix_defaults() {
        Ok(d) => d.with_timeout(CHECK_TIMEOUT),
        Err(e) => return failed(e.to_string()),
    };
    match tokio::time::timeout(CHECK_TIMEOUT, docker.ping()).await {
        Err(_) => return failed(format!("no answer within {}s", CHECK_TIMEOUT.as_secs())),
        Ok(Err(e)) => return failed(e.to_string()),
        Ok(Ok(_)) => {}
    }
    let ok = ProbeCheck {
        ok: true,
        detail: String::new(),
    };
    if names.is_empty() {
        return (ok, Vec::new());
    }
    match crate::engine::inspect_containers(&docker).await {
        Ok(list) => (
            ok,
            list.into_iter()
                .filter(|c| names.contains(&c.name))
                .collect(),
        ),
        Err(e) => failed(format!("listing containers: {e}")),
    }
}

/// Whether `host[:port]` answers `/v2/` at all. A loopback registry is plain HTTP (as the
/// engine and the server speak to it): any HTTP status line counts, a `401` too. Any other
/// registry is HTTPS on 443 by default, and a completed TCP connection counts (this crate
/// carries no TLS client).
async fn registry(host: &str) -> RegistryCheck {
    let loopback = is_loopback(host);
    let has_port = match host.strip_prefix('[') {
        Some(rest) => rest.contains("]:"),
        None => host.contains(':'),
    };
    let address = if has_port {
        host.to_string()
    } else if loopback {
        format!("{host}:80")
    } else {
        format!("{host}:443")
    };
    let check = |ok: bool, detail: String| RegistryCheck {
        host: host.to_string(),
        ok,
        detail,
    };
    let connected =
        tokio::time::timeout(CHECK_TIMEOUT, tokio::net::TcpStream::connect(&address)).await;
    let mut stream = match connected {
        Err(_) => return check(false, format!("no connection to {address} within 5s")),
        Ok(Err(e)) => return check(false, format!("connecting to {address}: {e}")),
        Ok(Ok(s)) => s,
    };
    if !loopback {
        return check(true, format!("connected to {address}"));
    }
    let request = format!("GET /v2/ HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
    let answer = tokio::time::timeout(CHECK_TIMEOUT, async {
        stream.write_all(request.as_bytes()).await?;
        let mut head = [0u8; 32];
        let n = stream.read(&mut head).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&head[..n]).to_string())
    })
    .await;
    match answer {
        Ok(Ok(head)) if head.starts_with("HTTP/") => {
            let status = head.split_whitespace().nth(1).unwrap_or("?").to_string();
            check(true, format!("/v2/ answered {status}"))
        }
        Ok(Ok(head)) => check(false, format!("{address} did not answer HTTP ({head:?})")),
        Ok(Err(e)) => check(false, format!("asking {address} /v2/: {e}")),
        Err(_) => check(false, format!("no answer from {address} /v2/ within 5s")),
    }
}

fn is_loopback(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name == "localhost"
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_closed_port_is_unreachable_and_an_http_answer_is_reachable() {
        // A port nobody listens on.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let closed = listener.local_addr().unwrap();
        drop(listener);
        let c = registry(&closed.to_string()).await;
        assert!(!c.ok, "{c:?}");

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let open = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 256];
            let _ = s.read(&mut buf).await;
            let _ = s
                .write_all(b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n")
                .await;
        });
        let c = registry(&open.to_string()).await;
        assert!(c.ok, "{c:?}");
        assert!(c.detail.contains("401"), "{c:?}");
    }
}
