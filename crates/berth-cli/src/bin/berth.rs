//! `berth`: the control plane (`berth server`), a one-command local setup (`berth dev`), and the
//! admin CLI. Admin commands read `BERTH_SERVER`, `BERTH_TOKEN` and `BERTH_CA_FILE`. `berth
//! server` reads flags > environment > `/etc/berth/server.toml` (`--config`) > defaults
//! (`berth_cli::server_config`); a configuration error exits 78.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use berth_cli::config::ConfigError;
use berth_cli::deploy;
use berth_cli::output::{print_agent, print_agents, Output};
use berth_cli::output::{print_release, print_releases, print_task, print_tasks};
use berth_cli::server_config::ServerSettings;
use berth_client::{Client, ClientConfig, Trust};
use berth_proto::admin::{CreateAgentToken, CreateApiToken, CreateTenant, Role};
use berth_proto::agent::{
    AgentHold, AgentStatus, DeleteAgent, GetAgent, HoldAgent, ListAgents, UpdateAgent,
};
use berth_proto::audit::ListAudit;
use berth_proto::deploy::{
    ApproveDeployment, CancelDeployment, CreateDeployment, CreateEnvironment, DeploymentView,
    EnvironmentStatusRequest, GetDeployment, GetEnvironment, ListDeployments, ListEnvironments,
    PlanDeployment, RollbackEnvironment, RolloutPolicy, TargetType, Tier, UnpinEnvironment,
};
use berth_proto::error::ErrorChain;
use berth_proto::event::{EventQuery, TaskStateEvent, TASK_STATE};
use berth_proto::release::{ComponentSpec, CreateRelease, GetRelease, ListReleases};
use berth_proto::task::{CancelTask, CreateTask, GetTask, ListTasks, RetryTask, TaskState};
use berth_proto::{AgentId, DeploymentId, TaskId};
use berth_server::{Server, ServerConfig};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "berth",
    version,
    about = "berth: deploy to fleets through pull-based agents, and prove what ran"
)]
struct Cli {
    #[command(flatten)]
    conn: Connection,
    /// Output format for admin commands.
    #[arg(long, short = 'o', global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Args, Debug, Clone)]
struct Connection {
    /// The server URL. Repeatable (or a comma list): replicas of one control plane, tried in
    /// order when one cannot be connected to or answers 5xx.
    #[arg(
        long,
        global = true,
        env = "BERTH_SERVER",
        value_delimiter = ',',
        default_value = "https://127.0.0.1:8443"
    )]
    server: Vec<String>,
    /// An API token (bat_…).
    #[arg(long, global = true, env = "BERTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The berth CA certificate (ca.crt in the server's data dir).
    #[arg(long, global = true, env = "BERTH_CA_FILE")]
    ca_file: Option<PathBuf>,
}

// Parsed once per process: boxing `ServerArgs` to shrink the enum would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Run the control plane.
    Server(Box<ServerArgs>),
    /// Run a server and one local agent on this machine, ready to deploy to the local Docker engine.
    Dev(DevArgs),
    /// Back up a running server: a consistent copy of its SQLite database and its key
    /// material, encrypted with age (a passphrase or X25519 recipients). On PostgreSQL the key
    /// material only: back the database up with pg_dump.
    Backup(Box<BackupArgs>),
    /// Restore a backup into a new data dir; agents reconnect without registering again.
    Restore(RestoreArgs),
    /// Agent registration tokens.
    #[command(subcommand)]
    Token(TokenCommand),
    /// Agents.
    #[command(subcommand)]
    Agents(AgentsCommand),
    /// API tokens for people and CI.
    #[command(subcommand, name = "api-token")]
    ApiToken(ApiTokenCommand),
    /// Tenants (operator token only).
    #[command(subcommand)]
    Tenant(TenantCommand),
    /// Tasks: one unit of work for one agent.
    #[command(subcommand)]
    Task(TaskCommand),
    /// Releases: immutable sets of images pinned by digest.
    #[command(subcommand)]
    Release(ReleaseCommand),
    /// The tenant's hash-chained audit log.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Environments: named sets of targets with a rollout policy.
    #[command(subcommand)]
    Env(EnvCommand),
    /// Builtin secrets: sealed on the server, read by agents with a lease. Never printed.
    #[command(subcommand)]
    Secret(SecretCommand),
    /// Hosts without an agent, deployed to through one over SSH.
    #[command(subcommand, name = "ssh-target")]
    SshTarget(berth_cli::ssh_target::SshTargetCommand),
    /// Files releases ship to SSH targets, stored by sha256.
    #[command(subcommand)]
    Artifact(berth_cli::ssh_target::ArtifactCommand),
    /// Webhooks on deployment and approval events (signed, through an outbox).
    #[command(subcommand)]
    Webhook(berth_cli::notify::WebhookCommand),
    /// The notification outbox: what each webhook send did; resend by choice.
    #[command(subcommand)]
    Notify(berth_cli::notify::NotifyCommand),
    /// Deploy a release into an environment.
    Deploy {
        release: String,
        #[arg(long = "env")]
        environment: String,
        /// Print the plan per wave and target, and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// Follow the deployment until it ends; exit non-zero unless it succeeded.
        #[arg(long)]
        wait: bool,
    },
    /// Deploy the environment's previous successful release and pin the environment to it.
    Rollback {
        #[arg(long = "env")]
        environment: String,
        #[arg(long)]
        wait: bool,
    },
    /// Deployments: show, list, approve, cancel, wait.
    #[command(subcommand)]
    Deployment(DeploymentCommand),
    /// Seed 001 bundles: build one from a directory, push it to an environment.
    #[command(subcommand)]
    Bundle(berth_cli::bundle::BundleCommand),
    #[command(flatten)]
    Docs(berth_cli::docs::DocsCommand),
}

#[derive(Subcommand, Debug)]
enum EnvCommand {
    /// Create an environment (admin).
    Create {
        name: String,
        /// dev, qa or prod.
        #[arg(long, value_parser = parse_tier)]
        tier: Tier,
        /// A label every target carries, KEY=VALUE (repeatable, at least one).
        #[arg(long = "selector", required = true)]
        selector: Vec<String>,
        /// The selector picks SSH targets (`berth ssh-target`), not agents.
        #[arg(long)]
        ssh_targets: bool,
        /// Targets per wave.
        #[arg(long, default_value_t = 1)]
        max_parallel: u32,
        /// Keep starting waves after a target failed.
        #[arg(long)]
        no_stop_on_failure: bool,
        /// Do not return updated targets to the previous release after a failure.
        #[arg(long)]
        no_auto_rollback: bool,
        /// Seconds a target has to become healthy.
        #[arg(long, default_value_t = 60)]
        health_timeout: u64,
        /// Seconds one target's task may take in all (pull, start, health); also how long a
        /// lost agent holds its target before read-back.
        #[arg(long, default_value_t = 600)]
        task_timeout: u64,
        /// A release must have succeeded in this environment first.
        #[arg(long)]
        promote_from: Option<String>,
        /// Approvals from other tokens (default: 1 for prod, else 0).
        #[arg(long)]
        approvals: Option<u32>,
        /// Redeploy the current release when a target drifts.
        #[arg(long)]
        auto_heal: bool,
        /// How often each target is read back for drift (e.g. 5m, 30s).
        #[arg(long, default_value = "5m")]
        drift_interval: String,
        /// A deployment starts only while the environment is OperationalReady
        /// (`berth env verify`); else 409 ENV_NOT_READY.
        #[arg(long)]
        require_ready: bool,
    },
    /// List environments.
    #[command(alias = "list")]
    Ls,
    /// Show an environment.
    Show { name: String },
    /// Each target's desired and running release, drift, and when it was verified.
    Status { name: String },
    /// Lift the pin a rollback set.
    Unpin { name: String },
    /// The readiness conditions as the last pass left them.
    Readiness { name: String },
    /// Run a completely fresh readiness pass, wait for every condition to reach a terminal
    /// status, print them; exit 3 when the environment is not OperationalReady, 1 on errors
    /// and when the pass did not complete within --timeout.
    Verify {
        name: String,
        /// Give up after this long (e.g. 5m, 90s).
        #[arg(long, default_value = "5m")]
        timeout: String,
    },
    /// Point the environment at a pushed bundle; its agents apply it at their next checkin.
    SetDesired { name: String, sha: String },
    /// Retire the environment: its agents take the stack down (admin).
    Retire {
        name: String,
        /// Remove the stack's volumes too.
        #[arg(long)]
        purge_volumes: bool,
    },
    /// The desired sha and what each agent last applied and reported.
    Desired { name: String },
    /// Reveal an install kit (admin): prints the one-line install command carrying a fresh
    /// bootstrap grant. Every earlier grant of the environment stops working.
    Kit { name: String },
}

#[derive(Subcommand, Debug)]
enum SecretCommand {
    /// Store a new version of `<env>/<name>`.
    Put {
        path: String,
        /// Read the value from this file (`-`: stdin). One trailing newline is dropped.
        #[arg(
            long,
            conflicts_with = "generate",
            required_unless_present = "generate"
        )]
        from_file: Option<PathBuf>,
        /// Let the server generate 32 random bytes (URL-safe base64).
        #[arg(long)]
        generate: bool,
    },
    /// The latest version of every secret under a prefix.
    #[command(alias = "list")]
    Ls { prefix: Option<String> },
    /// Every version of a secret.
    Versions { path: String },
    /// Delete every version of a secret.
    Rm { path: String },
}

#[derive(Subcommand, Debug)]
enum DeploymentCommand {
    /// Show a deployment with its targets.
    Show { id: DeploymentId },
    /// List deployments, oldest first.
    #[command(alias = "list")]
    Ls {
        #[arg(long = "env")]
        environment: Option<String>,
    },
    /// Approve a deployment awaiting approval (not with the requester's token).
    Approve { id: DeploymentId },
    /// Cancel: a waiting deployment ends now, a running one after its running wave.
    Cancel { id: DeploymentId },
    /// Follow a deployment until it ends.
    Wait { id: DeploymentId },
}

#[derive(Subcommand, Debug)]
enum ReleaseCommand {
    /// Create a release; the server resolves every tag to its digest through the registry.
    Create {
        name: String,
        /// A component, NAME=HOST/REPO:TAG or NAME=HOST/REPO@sha256:… (repeatable).
        #[arg(long = "image")]
        images: Vec<String>,
        /// The docker.run config of a component, NAME=JSON or NAME=@FILE (repeatable).
        #[arg(long = "config")]
        configs: Vec<String>,
        /// A compose file: every service's image is pinned by digest into the lock.
        #[arg(long)]
        compose: Option<PathBuf>,
        /// Where to write the compose lock (default: FILE.lock.yml beside --compose).
        #[arg(long, requires = "compose")]
        lock: Option<PathBuf>,
        /// A user for the registry (used for this resolution only, never stored).
        #[arg(long, env = "BERTH_REGISTRY_USERNAME")]
        registry_username: Option<String>,
        /// Its password; prefer the environment variable to the command line.
        #[arg(long, env = "BERTH_REGISTRY_PASSWORD", hide_env_values = true)]
        registry_password: Option<String>,
        #[command(flatten)]
        ssh: Box<berth_cli::ssh_target::SshReleaseArgs>,
    },
    /// List releases.
    #[command(alias = "list")]
    Ls,
    /// Show a release with its pinned components.
    Show { name: String },
}

#[derive(Subcommand, Debug)]
enum AuditCommand {
    /// Write the tenant's audit log as JSON lines to stdout (admin).
    Export,
    /// Check an export offline: the hash chain, and every result's signature and certificate
    /// against the CA. Exits non-zero naming the first bad entry.
    Verify {
        file: PathBuf,
        /// The berth CA certificate (PEM); default --ca-file / BERTH_CA_FILE.
        #[arg(long)]
        ca: Option<PathBuf>,
    },
}

#[derive(Subcommand, Debug)]
enum TaskCommand {
    /// Create a task for one agent (by id or label selector).
    Create {
        /// health-check, inspect, read-sticker, write-sticker, execute-command, docker.run, …
        #[arg(long = "type")]
        task_type: String,
        #[arg(long, conflicts_with = "selector")]
        agent: Option<AgentId>,
        /// Labels, k=v,k2=v2: the first matching online agent.
        #[arg(long, value_delimiter = ',')]
        selector: Vec<String>,
        /// The payload as JSON, or @FILE.
        #[arg(long, default_value = "{}")]
        payload: String,
        /// A credential k=v (repeatable); sealed at rest, never shown again.
        #[arg(long = "credential")]
        credentials: Vec<String>,
        /// A variable k=v (repeatable).
        #[arg(long = "var")]
        variables: Vec<String>,
        #[arg(long)]
        timeout_secs: Option<u32>,
        /// Higher runs first among the agent's queued tasks; -1000..=1000, default 0.
        #[arg(long, allow_hyphen_values = true)]
        priority: Option<i32>,
        /// Makes retrying this command safe: the same key returns the same task.
        #[arg(long)]
        idempotency_key: Option<String>,
        /// Wait until the task is finished (or unknown) and show it.
        #[arg(long)]
        wait: bool,
    },
    /// List tasks (e.g. --state dead_letter).
    #[command(alias = "list")]
    Ls {
        #[arg(long, value_parser = parse_task_state)]
        state: Option<TaskState>,
        #[arg(long)]
        agent: Option<AgentId>,
        #[arg(long = "type")]
        task_type: Option<String>,
    },
    /// Show a task with its attempts and verified results.
    Show { id: TaskId },
    /// Cancel a task (queued: at once; running: the agent stops it; unknown: abandoned).
    Cancel { id: TaskId },
    /// Retry an unknown or dead-lettered task.
    Retry { id: TaskId },
}

#[derive(Args, Debug)]
struct ServerArgs {
    /// The config file (TOML): every server setting is also a key, its long name with - as _
    /// (not --server, --token, --ca-file, --output: the admin commands'). Default
    /// /etc/berth/server.toml, read when it exists; a file named here must exist.
    #[arg(long, env = "BERTH_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// Print the effective configuration (flags > environment > file > defaults) as TOML,
    /// secrets masked, and exit 0 without starting; 78 when it is not valid.
    #[arg(long)]
    print_config: bool,
    #[command(flatten)]
    settings: ServerSettings,
}

#[derive(Args, Debug)]
struct BackupArgs {
    /// The backup file to write.
    file: PathBuf,
    /// The server's config file, read for its data_dir and database as `berth server` reads
    /// it (default /etc/berth/server.toml, when it exists).
    #[arg(long, env = "BERTH_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// The server's data dir.
    #[arg(long, env = "BERTH_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The server's database: a SQLite file (copied) or a postgres:// URL (not copied).
    #[arg(long, env = "BERTH_DATABASE", hide_env_values = true)]
    database: Option<String>,
    /// Encrypt to this age X25519 recipient (age1…, repeatable) instead of a passphrase.
    #[arg(long, value_name = "AGE1")]
    recipient: Vec<String>,
    /// A file whose first line is the passphrase; else BERTH_BACKUP_PASSPHRASE.
    #[arg(long, value_name = "FILE")]
    passphrase_file: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct RestoreArgs {
    /// The backup file.
    file: PathBuf,
    /// The data dir to create; it must not exist, or be empty.
    #[arg(long)]
    data_dir: PathBuf,
    /// An age identity file (AGE-SECRET-KEY-1…) for a backup made with --recipient.
    #[arg(long, value_name = "FILE")]
    identity: Option<PathBuf>,
    /// A file whose first line is the passphrase; else BERTH_BACKUP_PASSPHRASE.
    #[arg(long, value_name = "FILE")]
    passphrase_file: Option<PathBuf>,
}

/// `berth backup`: the data dir and database found as `berth server` finds them.
async fn backup(args: BackupArgs, out: Output) -> anyhow::Result<()> {
    let given = ServerSettings {
        data_dir: args.data_dir,
        database: args.database,
        ..ServerSettings::default()
    };
    let config = ServerSettings::resolve(&given, args.config.as_deref())?.server_config()?;
    let seal =
        berth_cli::backup::Seal::from_args(&args.recipient, args.passphrase_file.as_deref())?;
    let (data_dir, database) = (config.data_dir.clone(), config.database_url());
    let report = tokio::task::spawn_blocking(move || {
        berth_cli::backup::backup(&data_dir, &database, seal, &args.file)
    })
    .await??;
    out.print(&report, || {
        format!(
            "wrote {} ({} bytes, {} files, database: {}) in {:.1} s",
            report.file.display(),
            report.bytes,
            report.files,
            report.database,
            report.seconds
        )
    })
}

async fn restore(args: RestoreArgs, out: Output) -> anyhow::Result<()> {
    let unseal = berth_cli::backup::Unseal::from_args(
        args.identity.as_deref(),
        args.passphrase_file.as_deref(),
    )?;
    let report = tokio::task::spawn_blocking(move || {
        berth_cli::backup::restore(&args.file, unseal, &args.data_dir)
    })
    .await??;
    out.print(&report, || {
        let next = if report.database == "sqlite" {
            format!("start it with: berth server --data-dir {}", report.data_dir.display())
        } else {
            "restore the PostgreSQL dump (pg_restore), then start berth server with --data-dir and --database".to_string()
        };
        format!(
            "restored {} files backed up at {} into {}\n{next}",
            report.files,
            berth_cli::output::rfc3339(report.backed_up_at),
            report.data_dir.display()
        )
    })
}

/// `berth server`: its settings resolved (a configuration error exits 78), then printed or run.
async fn server(args: ServerArgs) -> anyhow::Result<()> {
    let settings = ServerSettings::resolve(&args.settings, args.config.as_deref())?;
    let config = settings.server_config()?;
    if args.print_config {
        print!("{}", settings.to_toml(args.config.as_deref())?);
        return Ok(());
    }
    let log_format = settings.log_format.unwrap_or_default();
    berth_cli::init_logging(log_format);
    serve(config, log_format).await
}

#[derive(Args, Debug)]
struct DevArgs {
    #[arg(long, default_value = "./berth-dev-data")]
    data_dir: PathBuf,
    #[arg(long, default_value = "127.0.0.1:8443")]
    listen: SocketAddr,
    #[arg(long, default_value_t = 10)]
    heartbeat_interval_secs: u64,
}

#[derive(Subcommand, Debug)]
enum TokenCommand {
    /// Create a one-time agent registration token.
    Create {
        /// Lifetime: 90s, 30m, 1h, 7d.
        #[arg(long, default_value = "1h")]
        expires: String,
        /// Labels the agent inherits, k=v,k2=v2.
        #[arg(long, value_delimiter = ',')]
        labels: Vec<String>,
        /// Environment the agent is bound to.
        #[arg(long)]
        env: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
enum AgentsCommand {
    /// List agents.
    #[command(alias = "ls")]
    List {
        #[arg(long, value_parser = parse_status)]
        status: Option<AgentStatus>,
        #[arg(long)]
        capability: Option<String>,
        /// key=value
        #[arg(long)]
        label: Option<String>,
    },
    /// Show one agent.
    Show { id: AgentId },
    /// Set labels (k=v) and remove labels (--remove k).
    Label {
        id: AgentId,
        labels: Vec<String>,
        #[arg(long)]
        remove: Vec<String>,
    },
    /// Delete an agent; its certificate stops working at once.
    Rm { id: AgentId },
    /// Route no new work to the agent (admin); the tasks it has still run.
    Cordon { id: AgentId },
    /// Route work to a cordoned agent again (admin).
    Uncordon { id: AgentId },
    /// The agent claims nothing new and shows as blocked; it keeps its session (admin).
    Suspend { id: AgentId },
    /// Let a suspended agent claim again (admin).
    Resume { id: AgentId },
    /// Cordon the agent, then wait until its pending, leased and retry_wait tasks have ended.
    Drain {
        id: AgentId,
        /// Give up (exit 1, still cordoned) after this many seconds.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
    },
}

#[derive(Subcommand, Debug)]
enum ApiTokenCommand {
    /// Create an API token.
    Create {
        #[arg(long, value_parser = parse_role)]
        role: Role,
        #[arg(long)]
        name: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
enum TenantCommand {
    /// Create a tenant; prints its first admin token.
    Create { name: String },
}

async fn hold(client: &Client, out: Output, id: AgentId, hold: AgentHold) -> anyhow::Result<()> {
    print_agent(out, &client.send(&HoldAgent { id, hold }).await?)
}

fn parse_status(s: &str) -> Result<AgentStatus, String> {
    AgentStatus::parse(s)
        .ok_or_else(|| "one of registered, online, degraded, offline, blocked".into())
}

fn parse_role(s: &str) -> Result<Role, String> {
    Role::parse(s).ok_or_else(|| "one of admin, deployer, viewer".into())
}

/// The command, each server setting's default shown in its help.
fn command() -> clap::Command {
    Cli::command().mut_subcommand("server", |server| {
        berth_cli::config::document_defaults(server, &ServerSettings::defaults())
    })
}

fn main() -> ExitCode {
    let cli = match Cli::from_arg_matches(&command().get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    // `berth server` starts its log once its settings (`log_format`) are read.
    if !matches!(cli.command, Command::Server(_)) {
        berth_cli::init_logging(berth_cli::LogFormat::Text);
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("berth: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<ConfigError>() => {
            eprintln!("berth: {e:#}");
            ExitCode::from(berth_cli::config::EXIT_CONFIG)
        }
        Err(e) if e.is::<berth_cli::readiness::NotReady>() => {
            eprintln!("berth: {e:#}");
            ExitCode::from(berth_cli::readiness::EXIT_NOT_READY)
        }
        Err(e) => {
            eprintln!("berth: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let out = cli.output;
    match cli.command {
        Command::Docs(docs) => Ok(berth_cli::docs::run(command(), docs)?),
        Command::Bundle(berth_cli::bundle::BundleCommand::Build(args)) => {
            let built = berth_cli::bundle::build(&args)?;
            eprintln!("wrote {}", built.file.display());
            println!("{}", built.sha);
            Ok(())
        }
        Command::Server(args) => server(*args).await,
        Command::Backup(args) => backup(*args, out).await,
        Command::Restore(args) => restore(args, out).await,
        Command::Dev(args) => {
            berth_cli::dev::run(args.data_dir, args.listen, args.heartbeat_interval_secs).await
        }
        Command::Token(TokenCommand::Create {
            expires,
            labels,
            env,
        }) => {
            let client = admin_client(&cli.conn)?;
            let response = client
                .send(&CreateAgentToken {
                    labels: Some(berth_cli::parse_labels(&labels).map_err(anyhow::Error::msg)?),
                    environment: env,
                    expires_in_seconds: Some(berth_cli::parse_duration(&expires)?.as_secs()),
                })
                .await?;
            out.print(&response, || {
                format!(
                    "token:          {}\nexpires at:     {}\nCA fingerprint: {}\n\n\
                     Install, register and start the agent on a new host (as root):\n{}\n\n\
                     Or, with berth-agent already installed:\n\
                     berth-agent --register --token={} --server {} --ca-fingerprint {} --state-dir /var/lib/berth-agent",
                    response.token, berth_cli::output::rfc3339(response.expires_at), response.ca_fingerprint,
                    response.install_command,
                    response.token, cli.conn.server.join(","), response.ca_fingerprint
                )
            })
        }
        Command::Agents(cmd) => {
            let client = admin_client(&cli.conn)?;
            match cmd {
                AgentsCommand::List {
                    status,
                    capability,
                    label,
                } => {
                    let mut agents = Vec::new();
                    let mut cursor = None;
                    loop {
                        let page = client
                            .send(&ListAgents {
                                status,
                                capability: capability.clone(),
                                label: label.clone(),
                                cursor,
                                limit: Some(500),
                            })
                            .await?;
                        agents.extend(page.items);
                        match page.next_cursor {
                            Some(next) => cursor = Some(next),
                            None => break,
                        }
                    }
                    print_agents(out, &agents)
                }
                AgentsCommand::Show { id } => {
                    print_agent(out, &client.send(&GetAgent { id }).await?)
                }
                AgentsCommand::Label { id, labels, remove } => {
                    let mut current = client.send(&GetAgent { id }).await?.labels;
                    current.extend(berth_cli::parse_labels(&labels).map_err(anyhow::Error::msg)?);
                    for k in &remove {
                        current.remove(k);
                    }
                    let agent = client
                        .send(&UpdateAgent {
                            id,
                            labels: Some(current),
                            capabilities: None,
                        })
                        .await?;
                    print_agent(out, &agent)
                }
                AgentsCommand::Rm { id } => {
                    let deleted = client.send(&DeleteAgent { id }).await?;
                    out.print(&deleted, || format!("deleted agent {id}"))
                }
                AgentsCommand::Cordon { id } => hold(&client, out, id, AgentHold::Cordon).await,
                AgentsCommand::Uncordon { id } => hold(&client, out, id, AgentHold::Uncordon).await,
                AgentsCommand::Suspend { id } => hold(&client, out, id, AgentHold::Suspend).await,
                AgentsCommand::Resume { id } => hold(&client, out, id, AgentHold::Resume).await,
                AgentsCommand::Drain { id, timeout } => {
                    berth_cli::agents::drain(&client, id, Duration::from_secs(timeout)).await
                }
            }
        }
        Command::ApiToken(ApiTokenCommand::Create { role, name }) => {
            let client = admin_client(&cli.conn)?;
            let response = client.send(&CreateApiToken { role, name }).await?;
            out.print(&response, || {
                format!(
                    "{} token (shown once): {}",
                    response.role.as_str(),
                    response.token
                )
            })
        }
        Command::Task(cmd) => task_command(&cli.conn, out, cmd).await,
        Command::Release(cmd) => release_command(&cli.conn, out, cmd).await,
        Command::Audit(AuditCommand::Export) => audit_export(&cli.conn).await,
        Command::Env(cmd) => env_command(&cli.conn, out, cmd).await,
        Command::Bundle(berth_cli::bundle::BundleCommand::Push { file, environment }) => {
            berth_cli::desired::push_bundle(&admin_client(&cli.conn)?, out, file, environment).await
        }
        Command::Secret(cmd) => secret_command(&cli.conn, out, cmd).await,
        Command::SshTarget(cmd) => {
            berth_cli::ssh_target::run(&admin_client(&cli.conn)?, out, cmd).await
        }
        Command::Artifact(cmd) => {
            berth_cli::ssh_target::artifact(&admin_client(&cli.conn)?, out, cmd).await
        }
        Command::Webhook(cmd) => {
            berth_cli::notify::webhook(&admin_client(&cli.conn)?, out, cmd).await
        }
        Command::Notify(cmd) => {
            berth_cli::notify::notify(&admin_client(&cli.conn)?, out, cmd).await
        }
        Command::Deploy {
            release,
            environment,
            dry_run,
            wait,
        } => {
            let client = admin_client(&cli.conn)?;
            let req = CreateDeployment {
                release,
                environment,
            };
            if dry_run {
                return deploy::print_plan(out, &client.send(&PlanDeployment(req)).await?);
            }
            let created = client.send(&req).await?;
            follow(&client, out, created, wait).await
        }
        Command::Rollback { environment, wait } => {
            let client = admin_client(&cli.conn)?;
            let created = client
                .send(&RollbackEnvironment { name: environment })
                .await?;
            follow(&client, out, created, wait).await
        }
        Command::Deployment(cmd) => {
            let client = admin_client(&cli.conn)?;
            match cmd {
                DeploymentCommand::Show { id } => {
                    deploy::print_deployment(out, &client.send(&GetDeployment { id }).await?)
                }
                DeploymentCommand::Ls { environment } => {
                    let mut items = Vec::new();
                    let mut cursor = None;
                    loop {
                        let page = client
                            .send(&ListDeployments {
                                environment: environment.clone(),
                                order: None,
                                cursor,
                                limit: Some(500),
                            })
                            .await?;
                        items.extend(page.items);
                        match page.next_cursor {
                            Some(next) => cursor = Some(next),
                            None => break,
                        }
                    }
                    deploy::print_deployments(out, &items)
                }
                DeploymentCommand::Approve { id } => {
                    deploy::print_deployment(out, &client.send(&ApproveDeployment { id }).await?)
                }
                DeploymentCommand::Cancel { id } => {
                    deploy::print_deployment(out, &client.send(&CancelDeployment { id }).await?)
                }
                DeploymentCommand::Wait { id } => deploy::wait(&client, out, id).await,
            }
        }
        Command::Audit(AuditCommand::Verify { file, ca }) => {
            let ca = ca
                .or(cli.conn.ca_file)
                .context("no CA certificate: pass --ca FILE or set BERTH_CA_FILE")?;
            let ca_pem = std::fs::read_to_string(&ca)
                .with_context(|| format!("reading {}", ca.display()))?;
            let ca_der = berth_crypto::cert_pem_to_der(&ca_pem)
                .with_context(|| format!("{} is not a PEM certificate", ca.display()))?;
            let export = std::fs::read_to_string(&file)
                .with_context(|| format!("reading {}", file.display()))?;
            match berth_cli::audit::verify(&export, &ca_der) {
                Ok(v) => {
                    println!(
                        "OK: {} entries, {} signed results, chain and signatures verified",
                        v.entries, v.results
                    );
                    Ok(())
                }
                Err(fault) => bail!("audit log does not verify: {fault}"),
            }
        }
        Command::Tenant(TenantCommand::Create { name }) => {
            let client = admin_client(&cli.conn)?;
            let response = client.send(&CreateTenant { name: name.clone() }).await?;
            out.print(&response, || {
                format!(
                    "tenant {name}: {}\nadmin token (shown once): {}",
                    response.tenant_id, response.admin_token
                )
            })
        }
    }
}

/// Shows a new deployment, or follows it with `--wait`.
async fn follow(
    client: &Client,
    out: Output,
    created: DeploymentView,
    wait: bool,
) -> anyhow::Result<()> {
    if wait {
        if let Output::Table = out {
            println!(
                "deployment {}: {} into {}",
                created.id, created.release, created.environment
            );
        }
        deploy::wait(client, out, created.id).await
    } else {
        deploy::print_deployment(out, &created)
    }
}

async fn env_command(conn: &Connection, out: Output, cmd: EnvCommand) -> anyhow::Result<()> {
    let client = admin_client(conn)?;
    match cmd {
        EnvCommand::Create {
            name,
            tier,
            selector,
            ssh_targets,
            max_parallel,
            no_stop_on_failure,
            no_auto_rollback,
            health_timeout,
            task_timeout,
            promote_from,
            approvals,
            auto_heal,
            drift_interval,
            require_ready,
        } => {
            let env = client
                .send(&CreateEnvironment {
                    name,
                    tier,
                    selector: deploy::selector(&selector)?,
                    target_type: if ssh_targets {
                        TargetType::Ssh
                    } else {
                        TargetType::Agents
                    },
                    policy: RolloutPolicy {
                        max_parallel,
                        stop_on_failure: !no_stop_on_failure,
                        auto_rollback: !no_auto_rollback,
                        health_timeout_secs: health_timeout,
                        task_timeout_secs: task_timeout,
                        require_ready,
                    },
                    promote_from,
                    approvals,
                    auto_heal,
                    drift_interval_secs: Some(
                        u32::try_from(berth_cli::parse_duration(&drift_interval)?.as_secs())
                            .context("--drift-interval is too long")?,
                    ),
                })
                .await?;
            deploy::print_environment(out, &env)
        }
        EnvCommand::Ls => {
            deploy::print_environments(out, &client.send(&ListEnvironments {}).await?.items)
        }
        EnvCommand::Show { name } => {
            deploy::print_environment(out, &client.send(&GetEnvironment { name }).await?)
        }
        EnvCommand::Status { name } => {
            deploy::print_status(out, &client.send(&EnvironmentStatusRequest { name }).await?)
        }
        EnvCommand::Unpin { name } => {
            deploy::print_environment(out, &client.send(&UnpinEnvironment { name }).await?)
        }
        EnvCommand::Readiness { name } => berth_cli::readiness::show(&client, out, name).await,
        EnvCommand::Verify { name, timeout } => {
            let timeout = berth_cli::parse_duration(&timeout)?;
            berth_cli::readiness::verify(&client, out, name, timeout).await
        }
        EnvCommand::SetDesired { name, sha } => {
            berth_cli::desired::set_desired(&client, out, name, sha).await
        }
        EnvCommand::Retire {
            name,
            purge_volumes,
        } => berth_cli::desired::retire(&client, out, name, purge_volumes).await,
        EnvCommand::Desired { name } => berth_cli::desired::show(&client, out, name).await,
        EnvCommand::Kit { name } => berth_cli::secret::kit(&client, out, name).await,
    }
}

async fn secret_command(conn: &Connection, out: Output, cmd: SecretCommand) -> anyhow::Result<()> {
    use berth_cli::secret;
    let client = admin_client(conn)?;
    match cmd {
        SecretCommand::Put {
            path,
            from_file,
            generate,
        } => secret::put(&client, out, path, from_file.as_deref(), generate).await,
        SecretCommand::Ls { prefix } => secret::ls(&client, out, prefix).await,
        SecretCommand::Versions { path } => secret::versions(&client, out, path).await,
        SecretCommand::Rm { path } => secret::rm(&client, out, path).await,
    }
}

fn parse_tier(s: &str) -> Result<Tier, String> {
    Tier::parse(s).ok_or_else(|| format!("{s:?} is not a tier: dev, qa or prod"))
}

async fn task_command(conn: &Connection, out: Output, cmd: TaskCommand) -> anyhow::Result<()> {
    let client = admin_client(conn)?;
    match cmd {
        TaskCommand::Create {
            task_type,
            agent,
            selector,
            payload,
            credentials,
            variables,
            timeout_secs,
            priority,
            idempotency_key,
            wait,
        } => {
            let payload_text = match payload.strip_prefix('@') {
                Some(file) => {
                    std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?
                }
                None => payload,
            };
            let selector = berth_cli::parse_labels(&selector).map_err(anyhow::Error::msg)?;
            let request = CreateTask {
                task_type,
                agent_id: agent,
                selector: (!selector.is_empty()).then_some(selector),
                payload: serde_json::from_str(&payload_text).context("--payload is not JSON")?,
                credentials: Some(
                    berth_cli::parse_labels(&credentials).map_err(anyhow::Error::msg)?,
                ),
                variables: Some(berth_cli::parse_labels(&variables).map_err(anyhow::Error::msg)?),
                timeout_seconds: timeout_secs,
                priority,
            };
            // With several servers a create that failed with a 5xx is tried on the next one
            // only when it carries a key (the first may have recorded it): one of our own
            // makes that retry safe when none was given.
            let idempotency_key = idempotency_key.or_else(|| {
                client
                    .has_fallbacks()
                    .then(|| format!("berth-cli:{}", uuid::Uuid::new_v4()))
            });
            let headers: Vec<(&str, &str)> = idempotency_key
                .iter()
                .map(|k| (berth_proto::headers::IDEMPOTENCY_KEY_HEADER, k.as_str()))
                .collect();
            let mut task = client.send_with(&request, &headers, None).await?;
            if wait && task.state.is_in_flight() {
                task = wait_for_task(&client, task.id).await?;
            }
            print_task(out, &task)
        }
        TaskCommand::Ls {
            state,
            agent,
            task_type,
        } => {
            let mut tasks = Vec::new();
            let mut cursor = None;
            loop {
                let page = client
                    .send(&ListTasks {
                        state,
                        agent_id: agent,
                        task_type: task_type.clone(),
                        order: None,
                        cursor,
                        limit: Some(500),
                    })
                    .await?;
                tasks.extend(page.items);
                match page.next_cursor {
                    Some(next) => cursor = Some(next),
                    None => break,
                }
            }
            print_tasks(out, &tasks)
        }
        TaskCommand::Show { id } => print_task(out, &client.send(&GetTask { id }).await?),
        TaskCommand::Cancel { id } => print_task(out, &client.send(&CancelTask { id }).await?),
        TaskCommand::Retry { id } => print_task(out, &client.send(&RetryTask { id }).await?),
    }
}

async fn release_command(
    conn: &Connection,
    out: Output,
    cmd: ReleaseCommand,
) -> anyhow::Result<()> {
    let client = admin_client(conn)?;
    match cmd {
        ReleaseCommand::Create {
            name,
            images,
            configs,
            compose,
            lock,
            registry_username,
            registry_password,
            ssh,
        } => {
            let mut components = Vec::new();
            for image in &images {
                let (component, reference) = image
                    .split_once('=')
                    .with_context(|| format!("--image {image:?} is not NAME=IMAGE"))?;
                components.push(ComponentSpec {
                    name: component.to_string(),
                    image: reference.to_string(),
                    config: None,
                });
            }
            for config in &configs {
                let (component, json) = config
                    .split_once('=')
                    .with_context(|| format!("--config {config:?} is not NAME=JSON"))?;
                let text = match json.strip_prefix('@') {
                    Some(file) => {
                        std::fs::read_to_string(file).with_context(|| format!("reading {file}"))?
                    }
                    None => json.to_string(),
                };
                let spec = components
                    .iter_mut()
                    .find(|c| c.name == component)
                    .with_context(|| format!("--config {component}: no --image of that name"))?;
                spec.config = Some(
                    serde_json::from_str(&text)
                        .with_context(|| format!("--config {component} is not JSON"))?,
                );
            }
            let compose_text = match &compose {
                Some(path) => Some(
                    std::fs::read_to_string(path)
                        .with_context(|| format!("reading {}", path.display()))?,
                ),
                None => None,
            };
            let release = client
                .send(&CreateRelease {
                    name,
                    components,
                    compose: compose_text,
                    ssh: berth_cli::ssh_target::ssh_release(&client, *ssh).await?,
                    registry_username,
                    registry_password,
                })
                .await?;
            if let (Some(path), Some(text)) = (&compose, &release.compose_lock) {
                let lock = lock.unwrap_or_else(|| {
                    let mut name = path.as_os_str().to_owned();
                    name.push(".lock.yml");
                    PathBuf::from(name)
                });
                std::fs::write(&lock, text)
                    .with_context(|| format!("writing {}", lock.display()))?;
                eprintln!("compose lock written to {}", lock.display());
            }
            print_release(out, &release)
        }
        ReleaseCommand::Ls => {
            let mut releases = Vec::new();
            let mut cursor = None;
            loop {
                let page = client
                    .send(&ListReleases {
                        cursor,
                        limit: Some(500),
                    })
                    .await?;
                releases.extend(page.items);
                match page.next_cursor {
                    Some(next) => cursor = Some(next),
                    None => break,
                }
            }
            print_releases(out, &releases)
        }
        ReleaseCommand::Show { name } => {
            print_release(out, &client.send(&GetRelease { name }).await?)
        }
    }
}

/// Pages through `GET /api/v1/audit`, one JSON line per entry, as the server stored it.
async fn audit_export(conn: &Connection) -> anyhow::Result<()> {
    use std::io::Write as _;
    let client = admin_client(conn)?;
    let mut stdout = std::io::stdout().lock();
    let mut after = 0;
    loop {
        let page = client
            .send(&ListAudit {
                after,
                limit: Some(1000),
            })
            .await?;
        for entry in &page.items {
            writeln!(stdout, "{}", serde_json::to_string(entry)?)?;
        }
        match page.next {
            Some(next) => after = next,
            None => break,
        }
    }
    stdout.flush()?;
    Ok(())
}

/// Waits until the task is no longer [`TaskState::is_in_flight`] and returns it, following its events (the
/// server's `GET /api/v1/events?task=`). The stream starts at the task's first event, so a task
/// that settled before it opened is seen too; a broken stream resumes after the last event
/// seen. Polling is the fallback for a server without the stream, or one that keeps failing.
async fn wait_for_task(client: &Client, id: TaskId) -> anyhow::Result<berth_proto::task::TaskView> {
    const STREAM_ATTEMPTS: u32 = 3;
    let query = EventQuery {
        task: Some(id),
        ..EventQuery::default()
    };
    let mut last = None;
    let mut failures = 0;
    while failures < STREAM_ATTEMPTS {
        let failure = match client.events(&query, last, WAIT_STREAM_TIMEOUT).await {
            Ok(mut stream) => loop {
                match stream.next().await {
                    Ok(Some(event)) => {
                        last = Some(event.id);
                        failures = 0;
                        if event.kind != TASK_STATE {
                            continue;
                        }
                        let data: TaskStateEvent = serde_json::from_value(event.data)
                            .context("a task.state event the CLI cannot read")?;
                        if !data.state.is_in_flight() {
                            return Ok(client.send(&GetTask { id }).await?);
                        }
                    }
                    Ok(None) => break anyhow::anyhow!("the server ended the event stream"),
                    Err(e) => break e.into(),
                }
            },
            Err(e) => e.into(),
        };
        failures += 1;
        tracing::debug!(error = %ErrorChain(failure.as_ref()), "task event stream failed");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    tracing::warn!("the event stream keeps failing; polling the task instead");
    loop {
        let task = client.send(&GetTask { id }).await?;
        if !task.state.is_in_flight() {
            return Ok(task);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// How long one `--wait` stream may stay open before it is reopened from its last event.
const WAIT_STREAM_TIMEOUT: Duration = Duration::from_secs(3600);

fn admin_client(conn: &Connection) -> anyhow::Result<Client> {
    let token = conn
        .token
        .clone()
        .context("no API token: set BERTH_TOKEN or pass --token")?;
    let ca_file = conn.ca_file.clone().context(
        "no CA certificate: set BERTH_CA_FILE or pass --ca-file (ca.crt in the server's data dir)",
    )?;
    let ca_pem = std::fs::read_to_string(&ca_file)
        .with_context(|| format!("reading {}", ca_file.display()))?;
    let (first, others) = conn
        .server
        .split_first()
        .context("no server: set BERTH_SERVER or pass --server")?;
    Ok(Client::new(ClientConfig {
        server: first.clone(),
        trust: Trust::CaPem(ca_pem),
        identity: None,
        bearer: Some(token),
        timeout: Duration::from_secs(30),
    })?
    .with_fallbacks(others.iter().cloned()))
}

async fn serve(config: ServerConfig, log_format: berth_cli::LogFormat) -> anyhow::Result<()> {
    // Handlers first: a SIGTERM right after the banner below must stop the server cleanly.
    let shutdown = berth_cli::shutdown_signal();
    let listen = config.listen;
    let server = Server::bootstrap(config).await?;
    let boot = server.bootstrapped().clone();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let local = listener.local_addr()?;
    if log_format == berth_cli::LogFormat::Json {
        // Every line a JSON object; the admin token (shown once in text) stays in its file.
        tracing::info!(
            url = %format!("https://{local}"),
            ca_fingerprint = %boot.ca_fingerprint,
            ca_certificate = %boot.data_dir.ca_cert().display(),
            admin_token_file = %boot.data_dir.admin_token().display(),
            "berth server listening"
        );
        server.run(listener, shutdown).await?;
        tracing::info!("berth server stopped");
        return Ok(());
    }
    eprintln!("berth server listening on https://{local}");
    eprintln!("CA fingerprint: {}", boot.ca_fingerprint);
    eprintln!("CA certificate: {}", boot.data_dir.ca_cert().display());
    match &boot.new_admin_token {
        Some(token) => eprintln!(
            "admin token (shown once; also in {}): {token}",
            boot.data_dir.admin_token().display()
        ),
        None => eprintln!("admin token: in {}", boot.data_dir.admin_token().display()),
    }
    server.run(listener, shutdown).await?;
    eprintln!("berth server stopped");
    Ok(())
}

fn parse_task_state(s: &str) -> Result<TaskState, String> {
    TaskState::parse(s).ok_or_else(|| {
        format!(
            "unknown state {s:?}; one of {}",
            TaskState::ALL.map(TaskState::as_str).join(", ")
        )
    })
}
