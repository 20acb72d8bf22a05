//! `berth-agent`'s settings: each one a flag and a key of `/etc/berth-agent/agent.toml` (the
//! flag's long name, `-` as `_`), some also an environment variable, in one struct. Precedence:
//! flag > environment (clap) > file > default. The defaults are [`AgentConfig::new`]'s and
//! [`DesiredConfig`]'s, plus the state dir only the binary has ([`DEFAULT_STATE_DIR`]). The
//! one-off actions (`--register`, `--token`, `--once`, `--bootstrap-file`) are flags only.

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_agent::desired::DesiredConfig;
use berth_agent::{AgentConfig, AgentError, TaskTransport};
use serde::{Deserialize, Serialize};

use crate::config::{self, ConfigError};

/// Read when present; `--config FILE` / `BERTH_AGENT_CONFIG` names another, which must exist.
pub const DEFAULT_FILE: &str = "/etc/berth-agent/agent.toml";
pub const DEFAULT_STATE_DIR: &str = "/var/lib/berth-agent";

/// Every setting of `berth-agent`; `None`: not given at this layer. Run
/// `berth-agent --print-config` for the effective values, defaults included.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSettings {
    /// The server, e.g. https://berth.example:8443. Repeatable (or a comma list; in the file
    /// an array): replicas of one control plane, used one at a time; when the one in use is
    /// unreachable or answers 5xx, the agent moves to the next and acquires a new session
    /// there. --register and --env use the first.
    #[arg(long, env = "BERTH_SERVER", value_delimiter = ',')]
    #[serde(default, deserialize_with = "one_or_many")]
    pub server: Option<Vec<String>>,
    /// The CA fingerprint (sha256:…) printed with the token; with --register, or --env.
    #[arg(long, env = "BERTH_CA_FINGERPRINT")]
    pub ca_fingerprint: Option<String>,
    /// Identity, journal, stickers and uploads.
    #[arg(long, env = "BERTH_AGENT_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// Agent name, with --register; defaults to the host name.
    #[arg(long)]
    pub name: Option<String>,
    /// Labels, k=v,k2=v2; with --register.
    #[arg(long, value_delimiter = ',')]
    pub labels: Option<Vec<String>>,
    /// Give up (exit 75) after the server (with several: every one) has been unreachable this
    /// long.
    #[arg(long)]
    pub retry_budget_secs: Option<u64>,
    /// A program `execute-command` tasks may run (absolute path; repeatable). None: off.
    #[arg(long, value_name = "PATH")]
    pub allow_command: Option<Vec<PathBuf>>,
    /// A program preDeploy/postDeploy hooks may run (absolute path, matched exactly, no PATH
    /// lookup; repeatable or comma-separated). A separate list: --allow-command does not allow
    /// hooks. None: a deployment with a hook fails with HOOK_NOT_ALLOWED before any change.
    #[arg(
        long,
        value_name = "PATH",
        env = "BERTH_AGENT_ALLOW_HOOKS",
        value_delimiter = ','
    )]
    pub allow_hook: Option<Vec<PathBuf>>,
    /// Where version stickers are kept (default <state-dir>/stickers).
    #[arg(long)]
    pub sticker_dir: Option<PathBuf>,
    /// upload-files tasks for this host write only below this directory (symlinks resolved;
    /// anything else is PATH_FORBIDDEN). Default <state-dir>/uploads.
    #[arg(long, value_name = "DIR", env = "BERTH_AGENT_UPLOAD_ROOT")]
    pub upload_root: Option<PathBuf>,
    /// Tasks run at once.
    #[arg(long)]
    pub max_concurrent_tasks: Option<usize>,
    /// On SIGTERM the agent takes no new work and keeps its session while running tasks
    /// finish; after this many seconds it interrupts them (they report AGENT_STOPPED), then
    /// releases the session so a successor starts at once.
    #[arg(long, env = "BERTH_AGENT_SHUTDOWN_GRACE_SECS")]
    pub shutdown_grace_secs: Option<u64>,
    /// Serve GET /healthz and /readyz over plain HTTP on this address (e.g. 127.0.0.1:9100),
    /// for systemd or a load balancer. Off unless given; nothing else is served there.
    #[arg(long, value_name = "ADDR")]
    pub probe_listen: Option<std::net::SocketAddr>,
    /// How assignments arrive: poll (the long-poll), stream (the WebSocket task stream), or
    /// auto (the stream when the server offers it, else the long-poll).
    #[arg(long, value_name = "MODE", env = "BERTH_AGENT_TASK_TRANSPORT")]
    pub task_transport: Option<TaskTransport>,
    /// Desired-state mode (seed 001): converge this environment's stack (checkin, bundle,
    /// lease, report) instead of running tasks.
    #[arg(long, value_name = "ENV", env = "BERTH_AGENT_ENV")]
    pub env: Option<String>,
    /// With --env, bearer mode: the berth CA (PEM) to trust; or pass --ca-fingerprint.
    #[arg(long)]
    pub ca_file: Option<PathBuf>,
    /// Where OpenBao is reached (else the address the server names): by the --env loop, and
    /// by a readiness probe resolving an environment's secrets.
    #[arg(long, env = "BERTH_OPENBAO_ADDR")]
    pub openbao_addr: Option<String>,
    /// The CA (PEM) OpenBao's certificate is validated against (else the system's CAs).
    #[arg(long)]
    pub openbao_ca_file: Option<PathBuf>,
    /// With --env: OpenBao's JWT auth mount and role for the bootstrap login.
    #[arg(long)]
    pub openbao_auth_mount: Option<String>,
    #[arg(long)]
    pub openbao_role: Option<String>,
    /// With --env: the compose command, e.g. "docker-compose" or "docker compose" (detected
    /// when absent).
    #[arg(long)]
    pub compose_command: Option<String>,
    /// With --env: seconds every service has to be running and healthy after `up`.
    #[arg(long)]
    pub health_timeout_secs: Option<u64>,
    /// text (plain unless stderr is a terminal) or json (one object per line, for log
    /// shippers).
    #[arg(long, value_name = "FORMAT", env = "BERTH_LOG_FORMAT")]
    pub log_format: Option<crate::LogFormat>,
}

fn config_error(e: ConfigError) -> AgentError {
    AgentError::Config(e.0)
}

impl AgentSettings {
    /// Every default of `berth-agent`, taken from the library that owns it.
    pub fn defaults() -> AgentSettings {
        let c = AgentConfig::new(PathBuf::from(DEFAULT_STATE_DIR));
        AgentSettings {
            state_dir: Some(c.state_dir),
            retry_budget_secs: Some(c.retry_budget.as_secs()),
            max_concurrent_tasks: Some(c.max_concurrent_tasks),
            shutdown_grace_secs: Some(c.shutdown_grace.as_secs()),
            log_format: Some(crate::LogFormat::default()),
            task_transport: Some(c.task_transport),
            openbao_auth_mount: Some(berth_proto::desired::DEFAULT_OPENBAO_AUTH_MOUNT.into()),
            openbao_role: Some(berth_proto::desired::DEFAULT_OPENBAO_ROLE.into()),
            health_timeout_secs: Some(DesiredConfig::DEFAULT_HEALTH_TIMEOUT.as_secs()),
            ..AgentSettings::default()
        }
    }

    /// `given` (flags and environment) over the file (`named`, else [`DEFAULT_FILE`] when it
    /// exists) over [`AgentSettings::defaults`]. Errors exit 78.
    pub fn resolve(
        given: &AgentSettings,
        named: Option<&Path>,
    ) -> Result<AgentSettings, AgentError> {
        let file: AgentSettings =
            config::read_file(named, Path::new(DEFAULT_FILE)).map_err(config_error)?;
        let set = config::layer(given, &file).map_err(config_error)?;
        config::layer(&set, &AgentSettings::defaults()).map_err(config_error)
    }

    /// The settings as TOML, passwords in URLs masked.
    pub fn to_toml(&self, named: Option<&Path>) -> Result<String, AgentError> {
        let mut shown = self.clone();
        shown.server = shown
            .server
            .map(|all| all.iter().map(|s| config::mask_url(s)).collect());
        shown.openbao_addr = shown.openbao_addr.as_deref().map(config::mask_url);
        config::to_toml(
            &shown,
            "berth-agent",
            &config::file_in_use(named, Path::new(DEFAULT_FILE)),
        )
        .map_err(config_error)
    }

    /// The first `--server`: the one `--register` and `--env` use.
    pub fn first_server(&self) -> Option<String> {
        self.server.as_ref().and_then(|all| all.first().cloned())
    }

    pub fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| DEFAULT_STATE_DIR.into())
    }

    /// Task mode's configuration; refuses an allow-list entry that is not absolute.
    pub fn agent_config(&self) -> Result<AgentConfig, AgentError> {
        let allow_commands = self.allow_command.clone().unwrap_or_default();
        if let Some(bad) = allow_commands.iter().find(|p| !p.is_absolute()) {
            return Err(AgentError::Config(format!(
                "--allow-command {} must be an absolute path",
                bad.display()
            )));
        }
        let mut c = AgentConfig::new(self.state_dir());
        c.servers = self.server.clone().unwrap_or_default();
        if let Some(v) = self.retry_budget_secs {
            c.retry_budget = Duration::from_secs(v);
        }
        c.allow_commands = allow_commands;
        c.allow_hooks = self.allow_hook.clone().unwrap_or_default();
        c.sticker_dir = self.sticker_dir.clone();
        c.upload_root = self.upload_root.clone();
        if let Some(v) = self.max_concurrent_tasks {
            c.max_concurrent_tasks = v;
        }
        if let Some(v) = self.shutdown_grace_secs {
            c.shutdown_grace = Duration::from_secs(v);
        }
        c.probe_listen = self.probe_listen;
        c.openbao_addr = self.openbao_addr.clone();
        c.openbao_ca_file = self.openbao_ca_file.clone();
        if let Some(v) = self.task_transport {
            c.task_transport = v;
        }
        Ok(c)
    }

    /// Desired-state mode's configuration (`env` set), `once` from the flag.
    pub fn desired_config(&self, env_id: String, once: bool) -> DesiredConfig {
        DesiredConfig {
            env_id,
            state_dir: self.state_dir(),
            server: self.first_server(),
            server_ca_file: self.ca_file.clone(),
            server_ca_fingerprint: self.ca_fingerprint.clone(),
            once,
            openbao_addr: self.openbao_addr.clone(),
            openbao_ca_file: self.openbao_ca_file.clone(),
            openbao_auth_mount: self
                .openbao_auth_mount
                .clone()
                .unwrap_or_else(|| berth_proto::desired::DEFAULT_OPENBAO_AUTH_MOUNT.into()),
            openbao_role: self
                .openbao_role
                .clone()
                .unwrap_or_else(|| berth_proto::desired::DEFAULT_OPENBAO_ROLE.into()),
            compose_command: self
                .compose_command
                .as_deref()
                .map(|c| c.split_whitespace().map(str::to_string).collect())
                .unwrap_or_default(),
            health_timeout: self
                .health_timeout_secs
                .map_or(DesiredConfig::DEFAULT_HEALTH_TIMEOUT, Duration::from_secs),
        }
    }
}

/// A key that takes one value or several: `server = "https://a"` or `server = ["https://a",
/// "https://b"]`.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged, expecting = "a string or an array of strings")]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(Option::<OneOrMany>::deserialize(d)?.map(|v| match v {
        OneOrMany::One(one) => vec![one],
        OneOrMany::Many(many) => many,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        settings: AgentSettings,
    }

    /// One test sets the variables, so no other test of this binary sees them.
    #[test]
    fn flag_beats_environment_beats_file_beats_default() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("agent.toml");
        std::fs::write(
            &file,
            "server = \"https://file:8443\"\ntask_transport = \"poll\"\n\
             max_concurrent_tasks = 3\nallow_hook = [\"/usr/bin/true\"]\nenv = \"qa\"\n",
        )
        .unwrap();
        std::env::set_var("BERTH_AGENT_TASK_TRANSPORT", "stream");
        std::env::set_var("BERTH_SERVER", "https://env:8443");
        let given = Cli::try_parse_from(["x", "--server", "https://flag:8443"])
            .unwrap()
            .settings;
        std::env::remove_var("BERTH_AGENT_TASK_TRANSPORT");
        std::env::remove_var("BERTH_SERVER");
        let s = AgentSettings::resolve(&given, Some(&file)).unwrap();
        assert_eq!(
            s.first_server().as_deref(),
            Some("https://flag:8443"),
            "flag"
        );
        let file_only = AgentSettings::resolve(&AgentSettings::default(), Some(&file)).unwrap();
        assert_eq!(
            file_only.server,
            Some(vec!["https://file:8443".to_string()])
        );
        std::fs::write(&file, "server = [\"https://a:8443\", \"https://b:8443\"]\n").unwrap();
        let replicas = AgentSettings::resolve(&AgentSettings::default(), Some(&file)).unwrap();
        assert_eq!(replicas.server.map(|s| s.len()), Some(2), "replicas");
        assert_eq!(s.task_transport, Some(TaskTransport::Stream), "environment");
        assert_eq!(s.max_concurrent_tasks, Some(3), "file");
        assert_eq!(s.retry_budget_secs, Some(600), "default");
        assert_eq!(s.env.as_deref(), Some("qa"));
        let c = s.agent_config().unwrap();
        assert_eq!(c.allow_hooks, [PathBuf::from("/usr/bin/true")]);
        assert_eq!(c.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
        let d = s.desired_config("qa".into(), false);
        assert_eq!(d.health_timeout, DesiredConfig::DEFAULT_HEALTH_TIMEOUT);
        assert_eq!(d.openbao_role, berth_proto::desired::DEFAULT_OPENBAO_ROLE);
    }

    #[test]
    fn an_unknown_key_is_a_configuration_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("agent.toml");
        std::fs::write(
            &file,
            "state_dir = \"/x\"\nallow_commands = [\"/bin/true\"]\n",
        )
        .unwrap();
        let err = AgentSettings::resolve(&AgentSettings::default(), Some(&file)).unwrap_err();
        assert_eq!(err.exit_code(), 78);
        let err = err.to_string();
        assert!(err.contains("unknown key `allow_commands`"), "{err}");
        assert!(err.contains(&format!("{}:2", file.display())), "{err}");
        std::fs::write(&file, "task_transport = \"pigeon\"\n").unwrap();
        let err = AgentSettings::resolve(&AgentSettings::default(), Some(&file)).unwrap_err();
        assert!(err.to_string().contains("pigeon"), "{err}");
    }
}
