//! `berth ssh-target add|ls|show|rm|scan`, `berth artifact push|ls`, and the `ssh` part of
//! `berth release create` (`--ssh-dir`): the files of a directory pushed as artifacts and named
//! by sha256 in the release. No command reads or prints a private key: `--key-secret` names a
//! builtin secret (`berth secret put`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use berth_client::Client;
use berth_proto::agent::Deleted;
use berth_proto::payload::{HookConfig, SshArtifact, SshHealthCheck, SshHealthCheckKind};
use berth_proto::release::SshRelease;
use berth_proto::ssh_target::{
    ArtifactView, CreateSshTarget, DeleteSshTarget, GetSshTarget, ListArtifacts, ListSshTargets,
    SshTargetView,
};

use crate::output::{rfc3339, table, Output};

#[derive(clap::Subcommand, Debug)]
pub enum SshTargetCommand {
    /// Register a host without an agent, deployed to through an agent (admin).
    Add {
        name: String,
        #[arg(long)]
        host: String,
        #[arg(long, default_value_t = 22)]
        port: u16,
        #[arg(long)]
        user: String,
        /// The agent that acts for it: an agent's name, or labels KEY=VALUE[,KEY=VALUE…] (any
        /// online agent carrying them).
        #[arg(long)]
        via: String,
        /// The host key to pin, as `berth ssh-target scan` prints it (`ssh-ed25519 AAAA…`).
        #[arg(long)]
        host_key: String,
        /// The builtin secret holding the private key (`<env>/<name>`; `berth secret put`).
        #[arg(long)]
        key_secret: String,
        /// A label environments select it by, KEY=VALUE (repeatable).
        #[arg(long = "label")]
        labels: Vec<String>,
    },
    /// List SSH targets.
    #[command(alias = "list")]
    Ls,
    Show {
        name: String,
    },
    /// Remove an SSH target (admin).
    Rm {
        name: String,
    },
    /// Print a host's SSH host key for a person to check before pinning it: nothing is
    /// trusted automatically, and nothing is authenticated.
    Scan {
        host: String,
        #[arg(long, default_value_t = 22)]
        port: u16,
    },
}

#[derive(clap::Subcommand, Debug)]
pub enum ArtifactCommand {
    /// Store a file for releases to ship to SSH targets; prints its sha256.
    Push { file: PathBuf },
    /// List artifacts.
    #[command(alias = "list")]
    Ls,
}

/// `KEY=VALUE` pairs, each its own argument or comma-separated.
fn pairs(items: &[String]) -> anyhow::Result<BTreeMap<String, String>> {
    items
        .iter()
        .flat_map(|i| i.split(','))
        .map(|pair| {
            pair.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .with_context(|| format!("{pair:?} is not KEY=VALUE"))
        })
        .collect()
}

pub async fn run(client: &Client, out: Output, cmd: SshTargetCommand) -> anyhow::Result<()> {
    match cmd {
        SshTargetCommand::Add {
            name,
            host,
            port,
            user,
            via,
            host_key,
            key_secret,
            labels,
        } => {
            let (via_agent, via_selector) = if via.contains('=') {
                (None, pairs(&[via])?)
            } else {
                (Some(via), BTreeMap::new())
            };
            let created = client
                .send(&CreateSshTarget {
                    name,
                    host,
                    port: Some(port),
                    user,
                    via_agent,
                    via_selector,
                    host_key,
                    key_secret,
                    labels: pairs(&labels)?,
                })
                .await?;
            print_target(out, &created)
        }
        SshTargetCommand::Ls => {
            let targets = client.send(&ListSshTargets {}).await?;
            out.print(&targets, || {
                table(
                    &["NAME", "ADDRESS", "VIA", "LABELS"],
                    &targets
                        .iter()
                        .map(|t| {
                            vec![
                                t.name.clone(),
                                format!("{}@{}:{}", t.user, t.host, t.port),
                                via(t),
                                join(&t.labels),
                            ]
                        })
                        .collect::<Vec<_>>(),
                )
            })
        }
        SshTargetCommand::Show { name } => {
            print_target(out, &client.send(&GetSshTarget { name }).await?)
        }
        SshTargetCommand::Rm { name } => {
            let d: Deleted = client.send(&DeleteSshTarget { name: name.clone() }).await?;
            out.print(&d, || format!("{name} removed"))
        }
        SshTargetCommand::Scan { host, port } => {
            let key =
                berth_exec::ssh::scan_host_key(&host, port, std::time::Duration::from_secs(15))
                    .await
                    .with_context(|| format!("scanning {host}:{port}"))?;
            out.print(&serde_json::json!({ "hostKey": key }), || {
                format!(
                    "{key}\n\ncheck it against the host's own key (on the host: \
                     ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub) before --host-key"
                )
            })
        }
    }
}

fn join(labels: &BTreeMap<String, String>) -> String {
    labels
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

fn via(t: &SshTargetView) -> String {
    t.via_agent.clone().unwrap_or_else(|| join(&t.via_selector))
}

fn print_target(out: Output, t: &SshTargetView) -> anyhow::Result<()> {
    out.print(t, || {
        format!(
            "name:       {}\nid:         {}\naddress:    {}@{}:{}\nvia:        {}\nhost key:   {}\nkey secret: {}\nlabels:     {}\ncreated:    {}",
            t.name,
            t.id,
            t.user,
            t.host,
            t.port,
            via(t),
            t.host_key,
            t.key_secret,
            join(&t.labels),
            rfc3339(t.created_at)
        )
    })
}

pub async fn artifact(client: &Client, out: Output, cmd: ArtifactCommand) -> anyhow::Result<()> {
    match cmd {
        ArtifactCommand::Push { file } => {
            let view = push(client, &file).await?;
            out.print(&view, || view.sha256.clone())
        }
        ArtifactCommand::Ls => {
            let artifacts = client.send(&ListArtifacts {}).await?;
            out.print(&artifacts, || {
                table(
                    &["SHA256", "SIZE", "CREATED"],
                    &artifacts
                        .iter()
                        .map(|a| vec![a.sha256.clone(), a.size.to_string(), rfc3339(a.created_at)])
                        .collect::<Vec<_>>(),
                )
            })
        }
    }
}

async fn push(client: &Client, file: &Path) -> anyhow::Result<ArtifactView> {
    let bytes = std::fs::read(file).with_context(|| format!("reading {}", file.display()))?;
    Ok(client
        .post_bytes("/api/v1/artifacts", "application/octet-stream", bytes)
        .await?)
}

/// How a release's files are checked on an SSH target after the script.
#[derive(clap::Args, Debug, Default)]
pub struct SshReleaseArgs {
    /// Ship this directory's files (its top level, executable bits kept) to SSH targets: each
    /// is pushed as an artifact and named by sha256 in the release.
    #[arg(long, requires = "deploy_dir")]
    pub ssh_dir: Option<PathBuf>,
    /// Where the files go on each target (absolute).
    #[arg(long, requires = "ssh_dir")]
    pub deploy_dir: Option<String>,
    /// The deploy script: one of the files, run as `./NAME` in the deploy directory.
    #[arg(long, requires = "ssh_dir")]
    pub script: Option<String>,
    /// Seconds the script may run (default 300).
    #[arg(long, requires = "script")]
    pub script_timeout: Option<u64>,
    /// Healthy when this URL answers 2xx, probed from the agent.
    #[arg(long, requires = "ssh_dir", conflicts_with = "health_tcp")]
    pub health_url: Option<String>,
    /// Healthy when HOST:PORT accepts a connection, probed from the agent.
    #[arg(long, requires = "ssh_dir")]
    pub health_tcp: Option<String>,
}

/// The release's `ssh` part from `--ssh-dir`, its files pushed first.
pub async fn ssh_release(
    client: &Client,
    args: SshReleaseArgs,
) -> anyhow::Result<Option<SshRelease>> {
    let (Some(dir), Some(deploy_directory)) = (args.ssh_dir, args.deploy_dir) else {
        return Ok(None);
    };
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    let mut artifacts = Vec::new();
    for entry in entries {
        let meta = entry.metadata()?;
        if !meta.is_file() {
            continue;
        }
        let name = entry
            .file_name()
            .into_string()
            .map_err(|n| anyhow::anyhow!("{n:?} is not a UTF-8 file name"))?;
        let pushed = push(client, &entry.path()).await?;
        eprintln!("pushed {name} ({} bytes) as {}", pushed.size, pushed.sha256);
        artifacts.push(SshArtifact {
            name,
            content: None,
            sha256: Some(pushed.sha256),
            executable: std::os::unix::fs::PermissionsExt::mode(&meta.permissions()) & 0o111 != 0,
        });
    }
    let health_check = match (args.health_url, args.health_tcp) {
        (Some(url), _) => Some(SshHealthCheck {
            kind: SshHealthCheckKind::Http,
            url: Some(url),
            host: None,
            port: None,
            command: Vec::new(),
            timeout: None,
            interval: None,
        }),
        (None, Some(tcp)) => {
            let (host, port) = tcp.rsplit_once(':').context("--health-tcp is HOST:PORT")?;
            Some(SshHealthCheck {
                kind: SshHealthCheckKind::Tcp,
                url: None,
                host: Some(host.to_string()),
                port: Some(port.parse().context("--health-tcp's port")?),
                command: Vec::new(),
                timeout: None,
                interval: None,
            })
        }
        (None, None) => None,
    };
    Ok(Some(SshRelease {
        deploy_directory,
        artifacts,
        script: args.script.map(|name| HookConfig {
            command: vec![format!("./{name}")],
            timeout: Some(args.script_timeout.unwrap_or(300)),
        }),
        hooks: Default::default(),
        health_check,
    }))
}
