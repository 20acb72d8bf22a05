//! Registers simulated agents the way `berth-agent --register` does: one registration token
//! each, a fresh P-256 key, a CSR, `RegisterAgent` with `X-Registration-Token`, then an mTLS
//! client holding that identity. Each agent keeps only its id and its client, which opens its
//! own connection on first use and keeps it alive.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use berth_client::{Client, ClientConfig, Identity, Trust};
use berth_crypto::AgentKey;
use berth_proto::admin::CreateAgentToken;
use berth_proto::agent::{Capability, Heartbeat, RegisterAgent};
use berth_proto::AgentId;
use tokio::task::JoinSet;

use crate::stats::{micros, Latencies};

pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the server is and how to reach it as an admin.
#[derive(Debug, Clone)]
pub struct Target {
    pub server: String,
    pub ca_pem: String,
    pub admin_token: String,
}

impl Target {
    /// A client with no identity: for admin calls (with `bearer`), registration and `/metrics`.
    pub fn client(&self, bearer: Option<String>) -> anyhow::Result<Client> {
        Ok(Client::new(ClientConfig {
            server: self.server.clone(),
            trust: Trust::CaPem(self.ca_pem.clone()),
            identity: None,
            bearer,
            timeout: REQUEST_TIMEOUT,
        })?)
    }
}

pub struct SimAgent {
    pub id: AgentId,
    /// `<prefix>-<i>`, also its label value with `register`'s `label_key`.
    pub name: String,
    pub client: Client,
    /// The agent's private key, for signing task results (`berth-bench tasks`).
    pub key: Arc<AgentKey>,
}

pub struct Fleet {
    pub agents: Vec<SimAgent>,
    pub token_latency: Latencies,
    pub register_latency: Latencies,
    pub elapsed: Duration,
    pub errors: Vec<String>,
}

impl Fleet {
    pub fn rate(&self) -> f64 {
        self.agents.len() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    pub fn print(&self, wanted: usize) {
        println!(
            "registered {}/{} agents in {:.2} s ({:.0} agents/s); {} failed",
            self.agents.len(),
            wanted,
            self.elapsed.as_secs_f64(),
            self.rate(),
            self.errors.len()
        );
        println!("  create agent token: {}", self.token_latency);
        println!("  register agent:     {}", self.register_latency);
        for e in self.errors.iter().take(5) {
            println!("  registration error: {e}");
        }
    }
}

struct Registered {
    agent: SimAgent,
    token_us: u64,
    register_us: u64,
}

/// Registers `count` agents named `<prefix>-<i>` with `concurrency` registrations in flight.
/// With `label_key`, each agent registers with the one label `<label_key>=<its name>` (what
/// `berth-bench checkins` selects its own environment by).
pub async fn register(
    target: &Target,
    prefix: &str,
    count: usize,
    concurrency: usize,
    label_key: Option<&str>,
) -> anyhow::Result<Fleet> {
    let admin = target.client(Some(target.admin_token.clone()))?;
    let anonymous = target.client(None)?;
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = JoinSet::new();
    for _ in 0..concurrency.clamp(1, count.max(1)) {
        let (admin, anonymous, next) = (admin.clone(), anonymous.clone(), next.clone());
        let (target, prefix) = (target.clone(), prefix.to_string());
        let label_key = label_key.map(str::to_string);
        workers.spawn(async move {
            let mut done = Vec::new();
            let mut errors = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    break;
                }
                let name = format!("{prefix}-{i}");
                let labels = label_key
                    .iter()
                    .map(|k| (k.clone(), name.clone()))
                    .collect();
                match register_one(&target, &admin, &anonymous, &name, labels).await {
                    Ok(r) => done.push(r),
                    Err(e) => errors.push(format!("{name}: {e:#}")),
                }
            }
            (done, errors)
        });
    }
    let mut agents = Vec::with_capacity(count);
    let (mut token_us, mut register_us, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    while let Some(joined) = workers.join_next().await {
        let (done, failed) = joined.context("registration worker panicked")?;
        for r in done {
            token_us.push(r.token_us);
            register_us.push(r.register_us);
            agents.push(r.agent);
        }
        errors.extend(failed);
    }
    Ok(Fleet {
        agents,
        token_latency: Latencies::from_micros(token_us),
        register_latency: Latencies::from_micros(register_us),
        elapsed: started.elapsed(),
        errors,
    })
}

async fn register_one(
    target: &Target,
    admin: &Client,
    anonymous: &Client,
    name: &str,
    labels: BTreeMap<String, String>,
) -> anyhow::Result<Registered> {
    let t = Instant::now();
    let token = admin
        .send(&CreateAgentToken {
            labels: None,
            environment: None,
            expires_in_seconds: Some(3600),
        })
        .await
        .context("creating a registration token")?;
    let token_us = micros(t.elapsed());

    let key = AgentKey::generate()?;
    let request = RegisterAgent {
        name: name.to_string(),
        version: "bench".into(),
        capabilities: capabilities(),
        labels,
        csr: key.csr_pem(name)?,
    };
    let t = Instant::now();
    let registered = anonymous
        .send_with(
            &request,
            &[(
                berth_proto::headers::REGISTRATION_TOKEN_HEADER,
                &token.token,
            )],
            None,
        )
        .await
        .context("registering")?;
    let register_us = micros(t.elapsed());

    let der = berth_crypto::cert_pem_to_der(&registered.certificate)?;
    anyhow::ensure!(
        key.matches_cert(&der)?,
        "the issued certificate is not for this key"
    );
    let client = Client::new(ClientConfig {
        server: target.server.clone(),
        trust: Trust::CaPem(target.ca_pem.clone()),
        identity: Some(Identity {
            cert_pem: registered.certificate,
            key_pem: key.to_pem(),
        }),
        bearer: None,
        timeout: REQUEST_TIMEOUT,
    })?;
    Ok(Registered {
        agent: SimAgent {
            id: registered.agent_id,
            name: name.to_string(),
            client,
            key: Arc::new(key),
        },
        token_us,
        register_us,
    })
}

/// What a host with Docker reports.
pub fn capabilities() -> Vec<Capability> {
    vec![Capability {
        name: "docker".into(),
        version: Some("27.3.1".into()),
        healthy: true,
        detail: None,
    }]
}

/// `template` with `sequence`, signed with `key` as berth-agent signs every heartbeat (the
/// server refuses unsigned ones and sequences it has seen in the session's generation).
pub fn signed_heartbeat(
    template: &Heartbeat,
    sequence: u64,
    key: &AgentKey,
) -> anyhow::Result<Heartbeat> {
    let mut heartbeat = Heartbeat {
        sequence,
        signature: None,
        ..template.clone()
    };
    heartbeat.signature = Some(key.sign_base64(&heartbeat.signing_input()?)?);
    Ok(heartbeat)
}
