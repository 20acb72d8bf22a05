//! `berth-agent`: register once with a one-time token, then run. Exit codes: 0 stop, 1 fatal
//! (identity revoked: re-register), 75 temporary, 78 configuration.

use berth_proto::error::ErrorChain;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use berth_agent::{AgentConfig, AgentError, RegisterOptions};
use clap::{CommandFactory, Parser};

#[derive(Parser, Debug)]
#[command(name = "berth-agent", version, about = "The berth agent")]
struct Args {
    /// Register with a one-time token, then keep running.
    #[arg(long)]
    register: bool,
    /// One-time registration token (reg_…); with --register.
    #[arg(long, env = "BERTH_REGISTRATION_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The server, e.g. https://berth.example:8443.
    #[arg(long, env = "BERTH_SERVER")]
    server: Option<String>,
    /// The CA fingerprint (sha256:…) printed with the token; with --register.
    #[arg(long, env = "BERTH_CA_FINGERPRINT")]
    ca_fingerprint: Option<String>,
    #[arg(
        long,
        env = "BERTH_AGENT_STATE_DIR",
        default_value = "/var/lib/berth-agent"
    )]
    state_dir: PathBuf,
    /// Agent name; defaults to the host name.
    #[arg(long)]
    name: Option<String>,
    /// Labels, k=v,k2=v2.
    #[arg(long, value_delimiter = ',')]
    labels: Vec<String>,
    /// Give up (exit 75) after the server has been unreachable this long.
    #[arg(long, default_value_t = 600)]
    retry_budget_secs: u64,
    /// A program `execute-command` tasks may run (absolute path; repeatable). None: off.
    #[arg(long = "allow-command", value_name = "PATH")]
    allow_commands: Vec<PathBuf>,
    /// A program preDeploy/postDeploy hooks may run (absolute path, matched exactly, no PATH
    /// lookup; repeatable or comma-separated). A separate list: --allow-command does not allow
    /// hooks. None: a deployment with a hook fails with HOOK_NOT_ALLOWED before any change.
    #[arg(
        long = "allow-hook",
        value_name = "PATH",
        env = "BERTH_AGENT_ALLOW_HOOKS",
        value_delimiter = ','
    )]
    allow_hooks: Vec<PathBuf>,
    /// Where version stickers are kept (default <state-dir>/stickers).
    #[arg(long)]
    sticker_dir: Option<PathBuf>,
    /// upload-files tasks for this host write only below this directory (symlinks resolved;
    /// anything else is PATH_FORBIDDEN). Default <state-dir>/uploads.
    #[arg(long, value_name = "DIR", env = "BERTH_AGENT_UPLOAD_ROOT")]
    upload_root: Option<PathBuf>,
    /// Tasks run at once.
    #[arg(long, default_value_t = 8)]
    max_concurrent_tasks: usize,
    /// Serve GET /healthz and /readyz over plain HTTP on this address (e.g. 127.0.0.1:9100),
    /// for systemd or a load balancer. Off unless given; nothing else is served there.
    #[arg(long, value_name = "ADDR")]
    probe_listen: Option<std::net::SocketAddr>,
    /// Desired-state mode (seed 001): converge this environment's stack (checkin, bundle,
    /// lease, report) instead of running tasks.
    #[arg(long = "env", value_name = "ENV", env = "BERTH_AGENT_ENV")]
    env_id: Option<String>,
    /// With --env: one tick, then exit 0, 1 (re-run the install), 75 (temporary) or 78.
    #[arg(long, requires = "env_id")]
    once: bool,
    /// With --env, bearer mode: the berth CA (PEM) to trust; or pass --ca-fingerprint.
    #[arg(long, requires = "env_id")]
    ca_file: Option<PathBuf>,
    /// With --env: a kit's bootstrap grant, moved into the state dir (0600) before the first tick.
    #[arg(long, requires = "env_id")]
    bootstrap_file: Option<PathBuf>,
    /// With --env: where OpenBao is reached (else the lease's address).
    #[arg(long, env = "BERTH_OPENBAO_ADDR", requires = "env_id")]
    openbao_addr: Option<String>,
    /// With --env: the CA (PEM) OpenBao's certificate is validated against.
    #[arg(long, requires = "env_id")]
    openbao_ca_file: Option<PathBuf>,
    /// With --env: OpenBao's JWT auth mount and role for the bootstrap login.
    #[arg(long, default_value = "jwt-berth")]
    openbao_auth_mount: String,
    #[arg(long, default_value = "see-env")]
    openbao_role: String,
    /// With --env: the compose command, e.g. "docker-compose" or "docker compose" (detected
    /// when absent).
    #[arg(long)]
    compose_command: Option<String>,
    /// With --env: seconds every service has to be running and healthy after `up`.
    #[arg(long, default_value_t = 120)]
    health_timeout_secs: u64,
    /// Without a subcommand the agent runs; the subcommands only print documentation.
    #[command(subcommand)]
    docs: Option<berth_cli::docs::DocsCommand>,
}

fn main() -> ExitCode {
    berth_cli::init_logging();
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 78 } else { 0 });
        }
    };
    if let Some(docs) = args.docs {
        return match berth_cli::docs::run(Args::command(), docs) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("berth-agent: {e}");
                ExitCode::from(1)
            }
        };
    }
    // One thread keeps the idle agent small; it does little but wait on the network.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("berth-agent: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(agent(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %ErrorChain(&e), exit_code = e.exit_code(), "agent stopped");
            eprintln!("berth-agent: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

async fn agent(args: Args) -> Result<(), AgentError> {
    let shutdown = berth_cli::shutdown_signal();
    tokio::pin!(shutdown);
    let retry_budget = Duration::from_secs(args.retry_budget_secs);
    if args.register {
        let missing = |flag: &str| AgentError::Config(format!("--register needs {flag}"));
        let labels = parse_labels(&args.labels).map_err(AgentError::Config)?;
        let registering = berth_agent::register(RegisterOptions {
            server: args.server.clone().ok_or_else(|| missing("--server"))?,
            state_dir: args.state_dir.clone(),
            token: args.token.clone().ok_or_else(|| missing("--token"))?,
            ca_fingerprint: args
                .ca_fingerprint
                .clone()
                .ok_or_else(|| missing("--ca-fingerprint"))?,
            name: args
                .name
                .clone()
                .unwrap_or_else(berth_cli::default_agent_name),
            labels,
            retry_budget,
        });
        let registered = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            registered = registering => registered?,
        };
        eprintln!(
            "registered as {} ({})",
            registered.name, registered.agent_id
        );
    }
    if let Some(env_id) = args.env_id.clone() {
        return desired(args, env_id, shutdown).await;
    }
    if let Some(bad) = args.allow_commands.iter().find(|p| !p.is_absolute()) {
        return Err(AgentError::Config(format!(
            "--allow-command {} must be an absolute path",
            bad.display()
        )));
    }
    let config = AgentConfig {
        server: args.server,
        retry_budget,
        allow_commands: args.allow_commands,
        allow_hooks: args.allow_hooks,
        sticker_dir: args.sticker_dir,
        upload_root: args.upload_root,
        max_concurrent_tasks: args.max_concurrent_tasks,
        probe_listen: args.probe_listen,
        ..AgentConfig::new(args.state_dir)
    };
    berth_agent::run(config, shutdown).await
}

/// `--env`: the desired-state loop (after registering, when asked to).
async fn desired(
    args: Args,
    env_id: String,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    if let Some(file) = &args.bootstrap_file {
        let grant = std::fs::read(file)
            .map_err(|e| AgentError::Config(format!("--bootstrap-file {}: {e}", file.display())))?;
        berth_agent::StateDir(args.state_dir.clone()).ensure()?;
        berth_fs::write_atomic(
            &args.state_dir.join(berth_agent::desired::BOOTSTRAP_FILE),
            &grant,
            0o600,
        )
        .map_err(|e| AgentError::Config(format!("staging the bootstrap grant: {e}")))?;
        let _ = std::fs::remove_file(file);
    }
    let config = berth_agent::desired::DesiredConfig {
        env_id,
        state_dir: args.state_dir,
        server: args.server,
        server_ca_file: args.ca_file,
        server_ca_fingerprint: args.ca_fingerprint,
        once: args.once,
        openbao_addr: args.openbao_addr,
        openbao_ca_file: args.openbao_ca_file,
        openbao_auth_mount: args.openbao_auth_mount,
        openbao_role: args.openbao_role,
        compose_command: args
            .compose_command
            .map(|c| c.split_whitespace().map(str::to_string).collect())
            .unwrap_or_default(),
        health_timeout: Duration::from_secs(args.health_timeout_secs),
    };
    berth_agent::desired::run_desired(config, shutdown).await
}

fn parse_labels(items: &[String]) -> Result<BTreeMap<String, String>, String> {
    berth_cli::parse_labels(items)
}
