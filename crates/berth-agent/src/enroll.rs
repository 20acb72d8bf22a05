//! Enrollment: pin the CA by the fingerprint the operator gave, generate the key locally, send
//! only a CSR with the one-time token, check what comes back, and store the identity.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use berth_client::Trust;
use berth_crypto::AgentKey;
use berth_proto::agent::RegisterAgent;
use berth_proto::headers::REGISTRATION_TOKEN_HEADER;
use berth_proto::AgentId;
use time::OffsetDateTime;

use crate::capabilities;
use crate::link::client;
use crate::retry::with_retries;
use crate::state::{Identity, IdentityFile, StateDir};
use crate::AgentError;

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
        capabilities: capabilities::detect().await,
        labels: opts.labels.clone(),
        csr,
    };
    let token_header = [(REGISTRATION_TOKEN_HEADER, opts.token.as_str())];
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
