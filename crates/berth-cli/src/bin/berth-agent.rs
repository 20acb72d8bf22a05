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
    /// Tasks run at once.
    #[arg(long, default_value_t = 8)]
    max_concurrent_tasks: usize,
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
        max_concurrent_tasks: args.max_concurrent_tasks,
        ..AgentConfig::new(args.state_dir)
    };
    berth_agent::run(config, shutdown).await
}

fn parse_labels(items: &[String]) -> Result<BTreeMap<String, String>, String> {
    berth_cli::parse_labels(items)
}
