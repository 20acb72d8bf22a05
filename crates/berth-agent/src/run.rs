//! Enrollment and the agent's main loop.
//!
//! Enrollment pins the CA by the fingerprint the operator gave, generates the key locally and
//! sends only a CSR. The loop heartbeats at the server's interval, renews the certificate after
//! two thirds of its life, backs off with jitter on failure, and turns each outcome into the
//! exit code a supervisor needs.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use berth_client::{Client, ClientConfig, ClientError, Identity as ClientIdentity, Trust};
use berth_crypto::AgentKey;
use berth_proto::agent::{AgentStatus, Capability, Heartbeat, RegisterAgent, RenewCertificate};
use berth_proto::error::codes;
use berth_proto::AgentId;
use time::OffsetDateTime;

use crate::backoff::Backoff;
use crate::capabilities;
use crate::resources::Sampler;
use crate::state::{Identity, IdentityFile, StateDir};
use crate::AgentError;

const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// Compose is detected by running a program; do it rarely to keep an idle agent idle.
const COMPOSE_PROBE_EVERY: Duration = Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct RegisterOptions {
    pub server: String,
    pub state_dir: PathBuf,
    pub token: String,
    pub ca_fingerprint: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// How long to keep retrying an unreachable server before giving up (exit 75).
    pub retry_budget: Duration,
}

#[derive(Debug, Clone)]
pub struct Registered {
    pub agent_id: AgentId,
    pub name: String,
}

#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// Overrides the server URL recorded at registration.
    pub server: Option<String>,
    pub state_dir: PathBuf,
    pub retry_budget: Duration,
}

fn client(
    server: &str,
    trust: Trust,
    identity: Option<ClientIdentity>,
) -> Result<Client, AgentError> {
    Client::new(ClientConfig {
        server: server.to_string(),
        trust,
        identity,
        bearer: None,
        timeout: REQUEST_TIMEOUT,
    })
    .map_err(|e| AgentError::Config(e.to_string()))
}

/// What to do about a failed call.
enum Failure {
    /// Stop: the error is final.
    Stop(AgentError),
    /// Try again after this long (from `Retry-After`), or after the back-off delay.
    Retry(Option<Duration>, String),
}

fn classify(e: ClientError) -> Failure {
    match &e {
        ClientError::Api {
            status,
            body,
            retry_after,
        } => match (*status, body.code.as_str()) {
            (401, codes::AGENT_REVOKED)
            | (403, codes::CERT_BINDING_MISMATCH)
            | (401, codes::CLIENT_CERT_REQUIRED) => {
                Failure::Stop(AgentError::Revoked(e.to_string()))
            }
            (401, codes::REGISTRATION_TOKEN_INVALID) | (409, _) => {
                Failure::Stop(AgentError::Config(e.to_string()))
            }
            (429, _) => Failure::Retry(*retry_after, e.to_string()),
            (s, _) if s >= 500 => Failure::Retry(*retry_after, e.to_string()),
            _ => Failure::Stop(AgentError::Fatal(e.to_string())),
        },
        ClientError::Transport { .. } => Failure::Retry(None, format!("{e}: {}", error_chain(&e))),
        ClientError::Decode(_) => Failure::Retry(None, e.to_string()),
        ClientError::Config(_) => Failure::Stop(AgentError::Config(e.to_string())),
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut source = e.source();
    while let Some(s) = source {
        out.push(s.to_string());
        source = s.source();
    }
    out.join(": ")
}

/// Retries `call` with jittered back-off until it succeeds, fails for good, or the budget is
/// spent (then `Temporary`, exit 75).
async fn with_retries<T, F, Fut>(what: &str, budget: Duration, mut call: F) -> Result<T, AgentError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    let started = Instant::now();
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) => match classify(e) {
                Failure::Stop(e) => return Err(e),
                Failure::Retry(after, why) => {
                    let delay = after.unwrap_or_else(|| backoff.next_delay());
                    if started.elapsed() + delay > budget {
                        return Err(AgentError::Temporary(format!(
                            "{what}: gave up after {:?}: {why}",
                            started.elapsed()
                        )));
                    }
                    tracing::warn!(%why, retry_in = ?delay, "{what} failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            },
        }
    }
}

/// First run: generate a key, register with the token, and store the identity.
pub async fn register(opts: RegisterOptions) -> Result<Registered, AgentError> {
    let state = StateDir(opts.state_dir.clone());
    if state.is_registered() {
        return Err(AgentError::Config(format!(
            "{} already holds an agent identity; remove it to register again",
            opts.state_dir.display()
        )));
    }
    state.ensure()?;
    let fingerprint = berth_client::normalize_fingerprint(&opts.ca_fingerprint)
        .map_err(|e| AgentError::Config(e.to_string()))?;
    let key =
        AgentKey::generate().map_err(|e| AgentError::Fatal(format!("generating the key: {e}")))?;
    let csr = key
        .csr_pem(&opts.name)
        .map_err(|e| AgentError::Fatal(format!("building the CSR: {e}")))?;
    let client = client(
        &opts.server,
        Trust::CaFingerprint(fingerprint.clone()),
        None,
    )?;
    let request = RegisterAgent {
        name: opts.name.clone(),
        version: crate::VERSION.to_string(),
        capabilities: detect_capabilities().await,
        labels: opts.labels.clone(),
        csr,
    };
    let token_header = [("x-registration-token", opts.token.as_str())];
    let response = with_retries("registration", opts.retry_budget, || {
        client.send_with(&request, &token_header, None)
    })
    .await?;

    // The TLS handshake already proved the server holds a certificate from the pinned CA; the CA
    // it hands us to keep must be that same CA.
    let ca_der = berth_crypto::cert_pem_to_der(&response.ca_certificate).map_err(|e| {
        AgentError::Fatal(format!("the server's CA certificate is unreadable: {e}"))
    })?;
    if berth_crypto::fingerprint(&ca_der) != fingerprint {
        return Err(AgentError::Fatal(
            "the server returned a CA that does not match the pinned fingerprint".into(),
        ));
    }
    let cert_der = berth_crypto::cert_pem_to_der(&response.certificate)
        .map_err(|e| AgentError::Fatal(format!("the issued certificate is unreadable: {e}")))?;
    let cert_agent = berth_crypto::agent_id_from_cert(&cert_der)
        .map_err(|e| AgentError::Fatal(format!("the issued certificate names no agent: {e}")))?;
    if cert_agent != response.agent_id.0 {
        return Err(AgentError::Fatal(
            "the issued certificate names another agent".into(),
        ));
    }
    let expires = berth_crypto::cert_not_after(&cert_der)
        .map_err(|e| AgentError::Fatal(format!("the issued certificate has no expiry: {e}")))?;
    state.save(&Identity {
        file: IdentityFile {
            agent_id: response.agent_id,
            name: opts.name.clone(),
            server: opts.server.clone(),
            ca_fingerprint: fingerprint,
            certificate_issued_at: OffsetDateTime::now_utc(),
            certificate_expires_at: expires,
        },
        cert_pem: response.certificate,
        key_pem: key.to_pem(),
        ca_pem: response.ca_certificate,
    })?;
    tracing::info!(agent_id = %response.agent_id, name = %opts.name, "registered");
    Ok(Registered {
        agent_id: response.agent_id,
        name: opts.name,
    })
}

async fn detect_capabilities() -> Vec<Capability> {
    let (docker, compose) = tokio::join!(capabilities::docker(), capabilities::compose());
    docker.into_iter().chain(compose).collect()
}

fn mtls_client(server: &str, identity: &Identity) -> Result<Client, AgentError> {
    client(
        server,
        Trust::CaPem(identity.ca_pem.clone()),
        Some(ClientIdentity {
            cert_pem: identity.cert_pem.clone(),
            key_pem: identity.key_pem.clone(),
        }),
    )
}

/// Renewal is due once two thirds of the certificate's life have passed.
fn renewal_due(file: &IdentityFile, now: OffsetDateTime) -> bool {
    let life = file.certificate_expires_at - file.certificate_issued_at;
    now >= file.certificate_issued_at + life * 2 / 3
}

/// Runs until `shutdown` resolves (Ok: exit 0) or a failure decides the exit code.
pub async fn run(
    config: AgentConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AgentError> {
    let state = StateDir(config.state_dir.clone());
    let mut identity = state.load()?;
    let server = config
        .server
        .clone()
        .unwrap_or_else(|| identity.file.server.clone());
    let agent_id = identity.file.agent_id;
    let mut client = mtls_client(&server, &identity)?;
    tracing::info!(%agent_id, %server, "agent started");

    tokio::pin!(shutdown);
    let mut sampler = Sampler::default();
    let mut compose = capabilities::compose().await;
    let mut compose_probed = Instant::now();
    loop {
        if renewal_due(&identity.file, OffsetDateTime::now_utc()) {
            identity = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                renewed = renew(&state, &client, &identity, config.retry_budget) => renewed?,
            };
            client = mtls_client(&server, &identity)?;
        }
        if compose_probed.elapsed() >= COMPOSE_PROBE_EVERY {
            compose = capabilities::compose().await;
            compose_probed = Instant::now();
        }
        let capabilities: Vec<Capability> = capabilities::docker()
            .await
            .into_iter()
            .chain(compose.clone())
            .collect();
        let status = if capabilities.iter().all(|c| c.healthy) {
            AgentStatus::Online
        } else {
            AgentStatus::Degraded
        };
        let heartbeat = Heartbeat {
            agent_id,
            status,
            resource_usage: sampler.sample(&config.state_dir),
            capabilities,
        };
        let sent = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            sent = with_retries("heartbeat", config.retry_budget, || client.send(&heartbeat)) => sent?,
        };
        let interval = Duration::from_secs(sent.heartbeat_interval_seconds.max(1));
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

async fn renew(
    state: &StateDir,
    client: &Client,
    identity: &Identity,
    budget: Duration,
) -> Result<Identity, AgentError> {
    let key =
        AgentKey::generate().map_err(|e| AgentError::Fatal(format!("generating the key: {e}")))?;
    let request = RenewCertificate {
        agent_id: identity.file.agent_id,
        csr: key
            .csr_pem(&identity.file.name)
            .map_err(|e| AgentError::Fatal(format!("building the CSR: {e}")))?,
    };
    let response = with_retries("certificate renewal", budget, || client.send(&request)).await?;
    let renewed = Identity {
        file: IdentityFile {
            certificate_issued_at: OffsetDateTime::now_utc(),
            certificate_expires_at: response.expires_at,
            ..identity.file.clone()
        },
        cert_pem: response.certificate,
        key_pem: key.to_pem(),
        ca_pem: identity.ca_pem.clone(),
    };
    state.save(&renewed)?;
    tracing::info!(expires_at = %response.expires_at, "certificate renewed");
    Ok(renewed)
}
