//! Enrollment and the agent's main loop.
//!
//! Enrollment pins the CA by the fingerprint the operator gave, generates the key locally and
//! sends only a CSR. The loop heartbeats at the server's interval, renews the certificate after
//! two thirds of its life, backs off with jitter on failure, and turns each outcome into the
//! exit code a supervisor needs.

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use berth_client::{Client, ClientConfig, ClientError, Identity as ClientIdentity, Trust};
use berth_crypto::AgentKey;
use berth_proto::agent::{AgentStatus, Capability, Heartbeat, RegisterAgent, RenewCertificate};
use berth_proto::error::codes;
use berth_proto::transport::{AcquireSession, ReleaseSession, GENERATION_HEADER};
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
    /// Programs `execute-command` may run (absolute paths); empty turns it off.
    pub allow_commands: Vec<PathBuf>,
    /// Where version stickers live; default `<state_dir>/stickers`.
    pub sticker_dir: Option<PathBuf>,
    /// Tasks run at once.
    pub max_concurrent_tasks: usize,
}

impl AgentConfig {
    pub fn new(state_dir: PathBuf) -> AgentConfig {
        AgentConfig {
            server: None,
            state_dir,
            retry_budget: Duration::from_secs(600),
            allow_commands: Vec::new(),
            sticker_dir: None,
            max_concurrent_tasks: 8,
        }
    }
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
pub(crate) enum Failure {
    /// Stop: the error is final.
    Stop(AgentError),
    /// Try again after this long (from `Retry-After`), or after the back-off delay.
    Retry(Option<Duration>, String),
}

pub(crate) fn classify(e: ClientError) -> Failure {
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
            // Another live process holds this identity's session: wait for its lease to lapse.
            (409, codes::SESSION_HELD) => Failure::Retry(*retry_after, e.to_string()),
            // A newer process took over: stop everything. (A result for a stale assignment is
            // refused with the same code; `tasks::report` only logs that.)
            (409, codes::FENCED) => Failure::Stop(AgentError::Fenced(e.to_string())),
            (401, codes::REGISTRATION_TOKEN_INVALID) | (409, _) => {
                Failure::Stop(AgentError::Config(e.to_string()))
            }
            (429, _) => Failure::Retry(*retry_after, e.to_string()),
            (s, _) if s >= 500 => Failure::Retry(*retry_after, e.to_string()),
            _ => Failure::Stop(AgentError::Fatal(e.to_string())),
        },
        ClientError::Transport { .. } => {
            let chain = error_chain(&e);
            // Certificate failures do not heal by retrying: the server is not the one we pinned
            // (configuration), or it refuses our certificate (re-register).
            if chain.contains("pinned CA") || chain.contains("invalid peer certificate") {
                Failure::Stop(AgentError::Config(format!("{e}: {chain}")))
            } else if chain.contains("BadCertificate")
                || chain.contains("CertificateExpired")
                || chain.contains("UnknownCA")
            {
                Failure::Stop(AgentError::Revoked(format!("{e}: {chain}")))
            } else {
                Failure::Retry(None, format!("{e}: {chain}"))
            }
        }
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
pub(crate) async fn with_retries<T, F, Fut>(
    what: &str,
    budget: Duration,
    mut call: F,
) -> Result<T, AgentError>
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

/// The client and signing key in use; replaced together when the certificate is renewed, so a
/// result is always signed with the key of the certificate its connection presents.
#[derive(Clone)]
pub(crate) struct Link {
    pub client: Client,
    pub key: Arc<AgentKey>,
}

pub(crate) type SharedLink = Arc<RwLock<Link>>;

pub(crate) fn current(link: &SharedLink) -> Link {
    link.read().unwrap_or_else(|e| e.into_inner()).clone()
}

fn make_link(server: &str, identity: &Identity) -> Result<Link, AgentError> {
    Ok(Link {
        client: mtls_client(server, identity)?,
        key: Arc::new(
            AgentKey::from_pem(&identity.key_pem)
                .map_err(|e| AgentError::Config(format!("agent.pem holds an unusable key: {e}")))?,
        ),
    })
}

/// Runs until `shutdown` resolves (Ok: exit 0) or a failure decides the exit code.
pub async fn run(
    config: AgentConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AgentError> {
    let state = StateDir(config.state_dir.clone());
    let identity = state.load()?;
    let server = config
        .server
        .clone()
        .unwrap_or_else(|| identity.file.server.clone());
    let agent_id = identity.file.agent_id;
    let link: SharedLink = Arc::new(RwLock::new(make_link(&server, &identity)?));
    let instance_id = uuid::Uuid::new_v4().to_string();

    tokio::pin!(shutdown);
    let acquire = AcquireSession {
        agent_id,
        instance_id: instance_id.clone(),
    };
    let client = current(&link).client;
    let session = tokio::select! {
        _ = &mut shutdown => return Ok(()),
        s = with_retries("session", config.retry_budget, || client.send(&acquire)) => s?,
    };
    let generation = session.generation;
    tracing::info!(%agent_id, %server, generation, instance = %instance_id, "agent started; session acquired");

    let capabilities = Arc::new(std::sync::Mutex::new(serde_json::Value::Null));
    let runner = crate::tasks::Runner::new(
        agent_id,
        generation,
        link.clone(),
        &config,
        capabilities.clone(),
    )?;
    let heartbeats = heartbeat_loop(
        &config,
        &state,
        identity,
        &server,
        link.clone(),
        generation,
        capabilities,
    );
    let outcome = tokio::select! {
        _ = &mut shutdown => Ok(()),
        r = heartbeats => r,
        r = runner.poll_loop() => r,
    };
    // Stop running work: all of it when fenced (another process owns the identity now), after a
    // short grace otherwise so results already computed still reach the server.
    let fenced = matches!(outcome, Err(AgentError::Fenced(_)));
    runner
        .stop(if fenced {
            Duration::ZERO
        } else {
            SHUTDOWN_GRACE
        })
        .await;
    if outcome.is_ok() {
        let release = ReleaseSession { agent_id };
        let generation_header = generation.to_string();
        let client = current(&link).client;
        match client
            .send_with(
                &release,
                &[(GENERATION_HEADER, &generation_header)],
                Some(Duration::from_secs(5)),
            )
            .await
        {
            Ok(_) => tracing::info!("session released"),
            Err(e) => {
                tracing::warn!(error = %e, "could not release the session; it expires by itself")
            }
        }
    }
    outcome
}

const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

async fn heartbeat_loop(
    config: &AgentConfig,
    state: &StateDir,
    mut identity: Identity,
    server: &str,
    link: SharedLink,
    generation: i64,
    shared_capabilities: Arc<std::sync::Mutex<serde_json::Value>>,
) -> Result<(), AgentError> {
    let agent_id = identity.file.agent_id;
    let generation_header = generation.to_string();
    let mut sampler = Sampler::default();
    let mut compose = capabilities::compose().await;
    let mut compose_probed = Instant::now();
    loop {
        if renewal_due(&identity.file, OffsetDateTime::now_utc()) {
            let client = current(&link).client;
            identity = renew(
                state,
                &client,
                &identity,
                config.retry_budget,
                &generation_header,
            )
            .await?;
            *link.write().unwrap_or_else(|e| e.into_inner()) = make_link(server, &identity)?;
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
        if let Ok(mut shared) = shared_capabilities.lock() {
            *shared = serde_json::to_value(&capabilities).unwrap_or_default();
        }
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
        let client = current(&link).client;
        let headers = [(GENERATION_HEADER, generation_header.as_str())];
        let sent = with_retries("heartbeat", config.retry_budget, || {
            client.send_with(&heartbeat, &headers, None)
        })
        .await?;
        let interval = Duration::from_secs(sent.heartbeat_interval_seconds.max(1));
        tokio::time::sleep(interval).await;
    }
}

async fn renew(
    state: &StateDir,
    client: &Client,
    identity: &Identity,
    budget: Duration,
    generation: &str,
) -> Result<Identity, AgentError> {
    let key =
        AgentKey::generate().map_err(|e| AgentError::Fatal(format!("generating the key: {e}")))?;
    let request = RenewCertificate {
        agent_id: identity.file.agent_id,
        csr: key
            .csr_pem(&identity.file.name)
            .map_err(|e| AgentError::Fatal(format!("building the CSR: {e}")))?,
    };
    let headers = [(GENERATION_HEADER, generation)];
    let response = with_retries("certificate renewal", budget, || {
        client.send_with(&request, &headers, None)
    })
    .await?;
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
