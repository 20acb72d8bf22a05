//! `berth`: the control plane (`berth server`), a one-command local setup (`berth dev`), and the
//! admin CLI. Admin commands read `BERTH_SERVER`, `BERTH_TOKEN` and `BERTH_CA_FILE`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Context};
use berth_cli::deploy;
use berth_cli::output::{print_agent, print_agents, Output};
use berth_cli::output::{print_release, print_releases, print_task, print_tasks};
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
use clap::{Args, CommandFactory, Parser, Subcommand};

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
    /// The server URL.
    #[arg(
        long,
        global = true,
        env = "BERTH_SERVER",
        default_value = "https://127.0.0.1:8443"
    )]
    server: String,
    /// An API token (bat_…).
    #[arg(long, global = true, env = "BERTH_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// The berth CA certificate (ca.crt in the server's data dir).
    #[arg(long, global = true, env = "BERTH_CA_FILE")]
    ca_file: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run the control plane.
    Server(ServerArgs),
    /// Run a server and one local agent on this machine, ready to deploy to the local Docker engine.
    Dev(DevArgs),
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
    #[arg(long, env = "BERTH_DATA_DIR", default_value = "./berth-data")]
    data_dir: PathBuf,
    #[arg(long, env = "BERTH_LISTEN", default_value = "127.0.0.1:8443")]
    listen: SocketAddr,
    /// A SQLite file or a postgres:// URL; default <data-dir>/berth.db.
    #[arg(long, env = "BERTH_DATABASE")]
    database: Option<String>,
    /// Extra names for the server certificate (repeatable).
    #[arg(long = "hostname", env = "BERTH_HOSTNAMES", value_delimiter = ',')]
    hostnames: Vec<String>,
    /// The URL agents reach this server at (install kits, builtin leases); default
    /// https://<first hostname or localhost>:<listen port>.
    #[arg(long, env = "BERTH_PUBLIC_URL")]
    public_url: Option<String>,
    /// Agent heartbeat interval; agents are offline after 3 missed intervals.
    #[arg(long, env = "BERTH_HEARTBEAT_INTERVAL_SECS", default_value_t = 30)]
    heartbeat_interval_secs: u64,
    /// Agent certificate lifetime; agents renew after two thirds of it.
    #[arg(long, env = "BERTH_AGENT_CERT_VALIDITY_SECS", default_value_t = 30 * 24 * 3600)]
    agent_cert_validity_secs: u64,
    /// `disabled` makes every task poll and result fail closed, and /readyz report it.
    #[arg(long, env = "BERTH_AGENT_TRANSPORT", value_parser = ["enabled", "disabled"], default_value = "enabled")]
    agent_transport: String,
    /// Added to a task's timeout to form its delivery lease.
    #[arg(long, env = "BERTH_LEASE_GRACE_SECS", default_value_t = 30)]
    lease_grace_secs: u64,
    /// Most connections from one source address (IPv6: per /64); 0 for no cap. Agents behind
    /// one NAT share an address (about one connection each): set it above that fleet's size.
    #[arg(long, env = "BERTH_MAX_CONNECTIONS_PER_SOURCE", default_value_t = 1000)]
    max_connections_per_source: usize,
    /// A connection that sends no complete request head for this long is closed (slow or idle).
    #[arg(long, env = "BERTH_HEADER_READ_TIMEOUT_SECS", default_value_t = 30)]
    header_read_timeout_secs: u64,
    /// A request whose body does not arrive within this long is refused and its connection closed.
    #[arg(long, env = "BERTH_BODY_READ_TIMEOUT_SECS", default_value_t = 30)]
    body_read_timeout_secs: u64,
    /// Most open tasks one agent may hold before a create for it is refused (429 QUEUE_FULL);
    /// read-backs and the server's own deployment and drift tasks are never refused by it.
    #[arg(long, env = "BERTH_MAX_OPEN_TASKS_PER_AGENT", default_value_t = 1000)]
    max_open_tasks_per_agent: u32,
    /// The delays before each retry of a webhook send that was refused or answered 5xx, then
    /// the notification is dead (units ms, s, m, h).
    #[arg(
        long,
        env = "BERTH_NOTIFY_RETRY_SCHEDULE",
        default_value = "1s,8s,64s,5m"
    )]
    notify_retry_schedule: String,
    /// The longest one webhook send may take; one that times out after the request left is
    /// `unknown` and is never resent by itself.
    #[arg(long, env = "BERTH_NOTIFY_TIMEOUT_SECS", default_value_t = 10)]
    notify_timeout_secs: u64,
    /// OpenBao holds desired-state secrets (seed 001's `openbao` provider): its address, given
    /// to agents in leases. Without it the `builtin` store serves them.
    #[arg(long, env = "BERTH_OPENBAO_ADDR")]
    openbao_addr: Option<String>,
    /// The KV v2 mount agents read secrets from (checkin's `vault.mount`).
    #[arg(
        long,
        env = "BERTH_OPENBAO_KV_MOUNT",
        default_value = "berth",
        requires = "openbao_addr"
    )]
    openbao_kv_mount: String,
    /// The JWT auth mount agents log in at with a deploy grant (its `jwks_url` is this server's
    /// /.well-known/agent-jwks.json), and its role.
    #[arg(
        long,
        env = "BERTH_OPENBAO_AUTH_MOUNT",
        default_value = "jwt-berth",
        requires = "openbao_addr"
    )]
    openbao_auth_mount: String,
    #[arg(
        long,
        env = "BERTH_OPENBAO_ROLE",
        default_value = "see-env",
        requires = "openbao_addr"
    )]
    openbao_role: String,
    /// The CA (PEM) OpenBao's certificate is checked against; default the system's.
    #[arg(long, env = "BERTH_OPENBAO_CA_FILE", requires = "openbao_addr")]
    openbao_ca_file: Option<PathBuf>,
    /// A file (0600) with the server's own OpenBao token (`auth/token/lookup`, the JWT mount's
    /// config): needed to accept agents that authenticate with their OpenBao token.
    #[arg(long, env = "BERTH_OPENBAO_TOKEN_FILE", requires = "openbao_addr")]
    openbao_token_file: Option<PathBuf>,
}

impl ServerArgs {
    fn config(&self) -> anyhow::Result<ServerConfig> {
        if self.heartbeat_interval_secs == 0 || self.agent_cert_validity_secs < 60 {
            bail!("--heartbeat-interval-secs must be at least 1 and --agent-cert-validity-secs at least 60");
        }
        if self.header_read_timeout_secs == 0 || self.body_read_timeout_secs == 0 {
            bail!("--header-read-timeout-secs and --body-read-timeout-secs must be at least 1");
        }
        let mut config = ServerConfig::new(self.data_dir.clone(), self.listen);
        config.database = self.database.clone();
        config.hostnames = self.hostnames.clone();
        config.public_url = self.public_url.clone();
        config.heartbeat_interval = Duration::from_secs(self.heartbeat_interval_secs);
        config.agent_cert_validity = Duration::from_secs(self.agent_cert_validity_secs);
        config.agent_transport_enabled = self.agent_transport == "enabled";
        config.lease_grace = Duration::from_secs(self.lease_grace_secs);
        config.max_connections_per_source = self.max_connections_per_source;
        config.header_read_timeout = Duration::from_secs(self.header_read_timeout_secs);
        config.body_read_timeout = Duration::from_secs(self.body_read_timeout_secs);
        config.max_open_tasks_per_agent = self.max_open_tasks_per_agent;
        if self.notify_timeout_secs == 0 {
            bail!("--notify-timeout-secs must be at least 1");
        }
        config.notify.retry_schedule =
            berth_server::parse_retry_schedule(&self.notify_retry_schedule)
                .map_err(|e| anyhow::anyhow!("--notify-retry-schedule: {e}"))?;
        config.notify.timeout = Duration::from_secs(self.notify_timeout_secs);
        if let Some(addr) = &self.openbao_addr {
            let ca_pem = match &self.openbao_ca_file {
                Some(f) => Some(
                    std::fs::read_to_string(f)
                        .with_context(|| format!("reading {}", f.display()))?,
                ),
                None => None,
            };
            config.openbao = Some(berth_server::OpenBaoSettings {
                addr: addr.clone(),
                kv_mount: self.openbao_kv_mount.clone(),
                auth_mount: self.openbao_auth_mount.clone(),
                role: self.openbao_role.clone(),
                ca_pem,
                token_file: self.openbao_token_file.clone(),
            });
        }
        Ok(config)
    }
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

fn main() -> ExitCode {
    berth_cli::init_logging();
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("berth: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(dispatch(cli)) {
        Ok(()) => ExitCode::SUCCESS,
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
        Command::Docs(docs) => Ok(berth_cli::docs::run(Cli::command(), docs)?),
        Command::Bundle(berth_cli::bundle::BundleCommand::Build(args)) => {
            let built = berth_cli::bundle::build(&args)?;
            eprintln!("wrote {}", built.file.display());
            println!("{}", built.sha);
            Ok(())
        }
        Command::Server(args) => serve(args.config()?).await,
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
                    "token:          {}\nexpires at:     {}\nCA fingerprint: {}\n\nberth-agent --register --token={} --server {} --ca-fingerprint {} --state-dir /var/lib/berth-agent",
                    response.token, berth_cli::output::rfc3339(response.expires_at), response.ca_fingerprint,
                    response.token, cli.conn.server, response.ca_fingerprint
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
            let headers: Vec<(&str, &str)> = idempotency_key
                .iter()
                .map(|k| (berth_proto::headers::IDEMPOTENCY_KEY_HEADER, k.as_str()))
                .collect();
            let mut task = client.send_with(&request, &headers, None).await?;
            if wait && in_progress(task.state) {
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

/// `--wait` waits while a task is in one of these states.
fn in_progress(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Pending | TaskState::Leased | TaskState::RetryWait
    )
}

/// Waits until the task leaves [`in_progress`] and returns it, following its events (the
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
                        if !in_progress(data.state) {
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
        if !in_progress(task.state) {
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
    Ok(Client::new(ClientConfig {
        server: conn.server.clone(),
        trust: Trust::CaPem(ca_pem),
        identity: None,
        bearer: Some(token),
        timeout: Duration::from_secs(30),
    })?)
}

async fn serve(config: ServerConfig) -> anyhow::Result<()> {
    let listen = config.listen;
    let server = Server::bootstrap(config).await?;
    let boot = server.bootstrapped().clone();
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let local = listener.local_addr()?;
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
    server.run(listener, berth_cli::shutdown_signal()).await?;
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
