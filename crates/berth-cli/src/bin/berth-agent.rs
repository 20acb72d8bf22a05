//! `berth-agent`: register once with a one-time token, then run. Settings: flags > environment >
//! `/etc/berth-agent/agent.toml` (`--config`) > defaults (`berth_cli::agent_config`). Exit codes:
//! 0 stop, 1 fatal (identity revoked: re-register), 75 temporary, 78 configuration.

use berth_proto::error::ErrorChain;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

use berth_agent::{AgentError, RegisterOptions};
use berth_cli::agent_config::AgentSettings;
use clap::{CommandFactory, FromArgMatches, Parser};

#[derive(Parser, Debug)]
#[command(name = "berth-agent", version, about = "The berth agent")]
struct Args {
    /// Register with a one-time token, then keep running.
    #[arg(long)]
    register: bool,
    /// Register with a one-time token, then exit 0 (what the install script runs before it
    /// starts the service).
    #[arg(long, conflicts_with = "register")]
    register_only: bool,
    /// One-time registration token (reg_…); with --register.
    #[arg(long, env = "BERTH_REGISTRATION_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// With --env: one tick, then exit 0, 1 (re-run the install), 75 (temporary) or 78.
    #[arg(long)]
    once: bool,
    /// With --env: a kit's bootstrap grant, moved into the state dir (0600) before the first tick.
    #[arg(long)]
    bootstrap_file: Option<PathBuf>,
    /// The config file (TOML): every setting below is also a key, its long name with - as _.
    /// Default /etc/berth-agent/agent.toml, read when it exists; a file named here must exist.
    #[arg(long, env = "BERTH_AGENT_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Print the effective configuration (flags > environment > file > defaults) as TOML and
    /// exit 0 without starting; 78 when it is not valid.
    #[arg(long)]
    print_config: bool,
    #[command(flatten)]
    settings: AgentSettings,
    /// Without a subcommand the agent runs; the subcommands only print documentation.
    #[command(subcommand)]
    docs: Option<berth_cli::docs::DocsCommand>,
}

/// The command, each setting's default shown in its help.
fn command() -> clap::Command {
    berth_cli::config::document_defaults(Args::command(), &AgentSettings::defaults())
}

fn main() -> ExitCode {
    let args = match command()
        .try_get_matches()
        .and_then(|m| Args::from_arg_matches(&m))
    {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 78 } else { 0 });
        }
    };
    if let Some(docs) = args.docs {
        return match berth_cli::docs::run(command(), docs) {
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
    let settings = match AgentSettings::resolve(&args.settings, args.config.as_deref()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("berth-agent: {e}");
            return ExitCode::from(e.exit_code() as u8);
        }
    };
    let log_format = settings.log_format.unwrap_or_default();
    berth_cli::init_logging(log_format);
    if args.print_config {
        return match settings
            .agent_config()
            .and_then(|_| settings.to_toml(args.config.as_deref()))
        {
            Ok(text) => {
                print!("{text}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("berth-agent: {e}");
                ExitCode::from(e.exit_code() as u8)
            }
        };
    }
    match runtime.block_on(agent(args, settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %ErrorChain(&e), exit_code = e.exit_code(), "agent stopped");
            // For a person; a JSON log keeps every line an object.
            if log_format == berth_cli::LogFormat::Text {
                eprintln!("berth-agent: {e}");
            }
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

async fn agent(args: Args, settings: AgentSettings) -> Result<(), AgentError> {
    let shutdown = berth_cli::shutdown_signal();
    tokio::pin!(shutdown);
    let config = settings.agent_config()?;
    for (flag, given) in [
        ("--once", args.once),
        ("--bootstrap-file", args.bootstrap_file.is_some()),
        ("--ca-file", settings.ca_file.is_some()),
    ] {
        if given && settings.env.is_none() {
            return Err(AgentError::Config(format!(
                "{flag} needs --env (or `env` in the config file)"
            )));
        }
    }
    if args.register || args.register_only {
        let missing = |flag: &str| AgentError::Config(format!("--register needs {flag}"));
        let labels = parse_labels(settings.labels.as_deref().unwrap_or_default())
            .map_err(AgentError::Config)?;
        let registering = berth_agent::register(RegisterOptions {
            server: settings.first_server().ok_or_else(|| missing("--server"))?,
            state_dir: settings.state_dir(),
            token: args.token.clone().ok_or_else(|| missing("--token"))?,
            ca_fingerprint: settings
                .ca_fingerprint
                .clone()
                .ok_or_else(|| missing("--ca-fingerprint"))?,
            name: settings
                .name
                .clone()
                .unwrap_or_else(berth_cli::default_agent_name),
            labels,
            retry_budget: config.retry_budget,
        });
        let registered = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            registered = registering => registered?,
        };
        eprintln!(
            "registered as {} ({})",
            registered.name, registered.agent_id
        );
        if args.register_only {
            return Ok(());
        }
    }
    if let Some(env_id) = settings.env.clone() {
        return desired(&args, settings.desired_config(env_id, args.once), shutdown).await;
    }
    berth_agent::run(config, shutdown).await
}

/// `--env`: the desired-state loop (after registering, when asked to).
async fn desired(
    args: &Args,
    config: berth_agent::desired::DesiredConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    if let Some(file) = &args.bootstrap_file {
        let grant = std::fs::read(file)
            .map_err(|e| AgentError::Config(format!("--bootstrap-file {}: {e}", file.display())))?;
        berth_agent::StateDir(config.state_dir.clone()).ensure()?;
        berth_fs::write_atomic(
            &config.state_dir.join(berth_agent::desired::BOOTSTRAP_FILE),
            &grant,
            0o600,
        )
        .map_err(|e| AgentError::Config(format!("staging the bootstrap grant: {e}")))?;
        let _ = std::fs::remove_file(file);
    }
    berth_agent::desired::run_desired(config, shutdown).await
}

fn parse_labels(items: &[String]) -> Result<BTreeMap<String, String>, String> {
    berth_cli::parse_labels(items)
}
