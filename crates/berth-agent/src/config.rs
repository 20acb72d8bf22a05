//! How the agent runs: what `berth-agent` passes in after reading its flags, environment and
//! `/etc/berth-agent/agent.toml`. [`AgentConfig::new`] owns the defaults.

use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The servers to use, in order (`--server A,B`): replicas of one control plane. Overrides
    /// the server recorded at registration; empty: that one alone.
    pub servers: Vec<String>,
    pub state_dir: PathBuf,
    pub retry_budget: Duration,
    /// Programs `execute-command` may run (absolute paths); empty turns it off.
    pub allow_commands: Vec<PathBuf>,
    /// Programs deployment hooks may run (absolute paths, matched exactly); empty: any
    /// deployment with a hook fails with `HOOK_NOT_ALLOWED`. Separate from `allow_commands`.
    pub allow_hooks: Vec<PathBuf>,
    /// Where version stickers live; default `<state_dir>/stickers`.
    pub sticker_dir: Option<PathBuf>,
    /// `upload-files` on this host writes only below it; default `<state_dir>/uploads`.
    pub upload_root: Option<PathBuf>,
    /// Tasks run at once.
    pub max_concurrent_tasks: usize,
    /// Where `/healthz` and `/readyz` are served (plain HTTP); `None`: nowhere.
    pub probe_listen: Option<std::net::SocketAddr>,
    /// Where a readiness probe reaches OpenBao; `None`: the address the server names.
    pub openbao_addr: Option<String>,
    /// The CA (PEM) OpenBao's certificate is validated against; `None`: the system's CAs.
    pub openbao_ca_file: Option<PathBuf>,
    /// How assignments reach the agent: the long-poll, the task stream, or the stream when the
    /// server offers it (else the long-poll, trying the stream again later).
    pub task_transport: TaskTransport,
    /// On SIGTERM: how long running tasks get to finish, with the session held and no new
    /// work taken, before they are interrupted (`AGENT_STOPPED`).
    pub shutdown_grace: Duration,
}

/// How the agent takes its assignments (`--task-transport`). Both carry the same deliveries
/// under the same rules; only how the agent waits differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskTransport {
    /// `POST …/tasks:poll`, held up to 25 s.
    Poll,
    /// `WS /api/v1/agents/{id}/task-stream` only.
    Stream,
    /// The stream when the server offers it, else the long-poll.
    #[default]
    Auto,
}

impl std::str::FromStr for TaskTransport {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "poll" => Ok(TaskTransport::Poll),
            "stream" => Ok(TaskTransport::Stream),
            "auto" => Ok(TaskTransport::Auto),
            other => Err(format!("{other:?} is not poll, stream or auto")),
        }
    }
}

impl AgentConfig {
    /// Refuses an allow-list entry that is not an absolute, clean path (exit 78).
    pub fn validate(&self) -> Result<(), crate::AgentError> {
        if let Some(bad) = self
            .allow_hooks
            .iter()
            .find(|p| !berth_exec::hooks::is_clean_absolute(p))
        {
            return Err(crate::AgentError::Config(format!(
                "--allow-hook {} must be an absolute path without . or .. components",
                bad.display()
            )));
        }
        Ok(())
    }

    /// The directory local `upload-files` tasks write below (created at the first upload).
    pub fn upload_root(&self) -> PathBuf {
        self.upload_root
            .clone()
            .unwrap_or_else(|| self.state_dir.join("uploads"))
    }

    /// Where compose registry logins live while a task runs (0700; swept at start).
    pub fn credentials_dir(&self) -> PathBuf {
        self.state_dir.join("tmp")
    }

    pub fn new(state_dir: PathBuf) -> AgentConfig {
        AgentConfig {
            servers: Vec::new(),
            state_dir,
            retry_budget: Duration::from_secs(600),
            allow_commands: Vec::new(),
            allow_hooks: Vec::new(),
            sticker_dir: None,
            upload_root: None,
            max_concurrent_tasks: 8,
            probe_listen: None,
            openbao_addr: None,
            openbao_ca_file: None,
            task_transport: TaskTransport::Auto,
            shutdown_grace: Duration::from_secs(240),
        }
    }
}
