//! `berth secret put|ls|versions|rm` and `berth env kit`. A value goes to the server from a file
//! or stdin (never from an argument, which every process list shows) or is generated there; no
//! command ever prints a value. `env kit` prints only the install command, which carries the
//! grant.

use std::io::Read as _;
use std::path::Path;

use anyhow::Context as _;
use berth_client::Client;
use berth_proto::agent::Deleted;
use berth_proto::desired::{KitView, PutSecret, SecretVersionView};
use berth_proto::{Method, Request};
use serde::Serialize;

use crate::output::{table, Output};

/// `PUT /api/v1/secrets/{path}`.
#[derive(Serialize)]
pub struct PutSecretAt {
    #[serde(skip)]
    pub path: String,
    #[serde(flatten)]
    pub body: PutSecret,
}

impl Request for PutSecretAt {
    type Response = SecretVersionView;
    const METHOD: Method = Method::Put;
    fn path(&self) -> String {
        format!("/api/v1/secrets/{}", self.path)
    }
}

/// `GET /api/v1/secrets?prefix=`.
#[derive(Serialize)]
pub struct ListSecrets {
    #[serde(skip)]
    pub prefix: Option<String>,
}

impl Request for ListSecrets {
    type Response = Vec<SecretVersionView>;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        match &self.prefix {
            // Paths are letters, digits and `-_.+@=/`: only `+` and `=` need escaping.
            Some(p) => format!(
                "/api/v1/secrets?prefix={}",
                p.replace('+', "%2B").replace('=', "%3D")
            ),
            None => "/api/v1/secrets".to_string(),
        }
    }
}

/// `GET /api/v1/secrets/{path}/versions`.
#[derive(Serialize)]
pub struct SecretVersions {
    #[serde(skip)]
    pub path: String,
}

impl Request for SecretVersions {
    type Response = Vec<SecretVersionView>;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        format!("/api/v1/secrets/{}/versions", self.path)
    }
}

/// `DELETE /api/v1/secrets/{path}`.
#[derive(Serialize)]
pub struct DeleteSecret {
    #[serde(skip)]
    pub path: String,
}

impl Request for DeleteSecret {
    type Response = Deleted;
    const METHOD: Method = Method::Delete;
    fn path(&self) -> String {
        format!("/api/v1/secrets/{}", self.path)
    }
}

/// `POST /api/v1/environments/{name}/kit`.
#[derive(Serialize)]
pub struct RevealKit {
    #[serde(skip)]
    pub environment: String,
}

impl Request for RevealKit {
    type Response = KitView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/environments/{}/kit", self.environment)
    }
}

/// The value of `--from-file`: the file's content, or stdin for `-`. One trailing newline (what
/// `echo` and editors add) is dropped.
pub fn read_value(from: &Path) -> anyhow::Result<String> {
    let mut value = String::new();
    if from == Path::new("-") {
        std::io::stdin()
            .read_to_string(&mut value)
            .context("reading the secret from stdin")?;
    } else {
        value = std::fs::read_to_string(from)
            .with_context(|| format!("reading the secret from {}", from.display()))?;
    }
    if value.ends_with('\n') {
        value.pop();
        if value.ends_with('\r') {
            value.pop();
        }
    }
    Ok(value)
}

fn rows(versions: &[SecretVersionView]) -> String {
    table(
        &["PATH", "VERSION", "CREATED", "DELETED"],
        &versions
            .iter()
            .map(|v| {
                vec![
                    v.path.clone(),
                    v.version.to_string(),
                    v.created_at.to_string(),
                    if v.deleted { "yes" } else { "" }.to_string(),
                ]
            })
            .collect::<Vec<_>>(),
    )
}

pub async fn put(
    client: &Client,
    out: Output,
    path: String,
    from_file: Option<&Path>,
    generate: bool,
) -> anyhow::Result<()> {
    let body = match (from_file, generate) {
        (Some(file), false) => PutSecret {
            value: Some(read_value(file)?),
            generate: false,
        },
        (None, true) => PutSecret {
            value: None,
            generate: true,
        },
        _ => anyhow::bail!("give exactly one of --from-file and --generate"),
    };
    let v = client.send(&PutSecretAt { path, body }).await?;
    out.print(&v, || format!("{} version {}", v.path, v.version))
}

pub async fn ls(client: &Client, out: Output, prefix: Option<String>) -> anyhow::Result<()> {
    let items = client.send(&ListSecrets { prefix }).await?;
    out.print(&items, || rows(&items))
}

pub async fn versions(client: &Client, out: Output, path: String) -> anyhow::Result<()> {
    let items = client.send(&SecretVersions { path }).await?;
    out.print(&items, || rows(&items))
}

pub async fn rm(client: &Client, out: Output, path: String) -> anyhow::Result<()> {
    let d = client.send(&DeleteSecret { path: path.clone() }).await?;
    out.print(&d, || format!("{path} deleted"))
}

/// Prints the install command (it carries the grant: run it on the host, do not share it).
pub async fn kit(client: &Client, out: Output, environment: String) -> anyhow::Result<()> {
    let kit = client.send(&RevealKit { environment }).await?;
    out.print(&kit, || kit.install_command.clone())
}
