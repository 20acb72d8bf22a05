//! The agent's link to the control plane: the HTTPS client (pinned CA on first contact, mTLS
//! with the agent's certificate afterwards) and the key that signs results, kept together.

use std::sync::Arc;
use std::time::Duration;

use berth_client::{Client, ClientConfig, Identity as ClientIdentity, Trust};
use berth_crypto::AgentKey;
use tokio::sync::watch;

use crate::state::Identity;
use crate::AgentError;

const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) fn client(
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

/// The `signature` of a signed body (a result, a heartbeat): standard base64 of the key's
/// signature over `input`, the body's JCS without `signature` (its `signing_input`). `what`
/// names the body in the error.
pub(crate) fn signature(
    what: &str,
    input: Result<Vec<u8>, serde_json::Error>,
    key: &AgentKey,
) -> Result<String, String> {
    let input = input.map_err(|e| format!("canonicalizing {what}: {e}"))?;
    key.sign_base64(&input)
        .map_err(|e| format!("signing {what}: {e}"))
}

/// The client and signing key in use; replaced together when the certificate is renewed, so a
/// result is always signed with the key of the certificate its connection presents.
#[derive(Clone)]
pub(crate) struct Link {
    pub client: Client,
    pub key: Arc<AgentKey>,
}

impl Link {
    pub fn new(server: &str, identity: &Identity) -> Result<Link, AgentError> {
        Ok(Link {
            client: mtls_client(server, identity)?,
            key: Arc::new(AgentKey::from_pem(&identity.key_pem).map_err(|e| {
                AgentError::Config(format!("agent.pem holds an unusable key: {e}"))
            })?),
        })
    }
}

/// The link every loop uses; the heartbeat loop replaces it after a renewal. Once replaced,
/// the old client goes with the last request still holding it, and its connections with it.
#[derive(Clone)]
pub(crate) struct SharedLink(Arc<watch::Sender<Link>>);

impl SharedLink {
    pub fn new(link: Link) -> SharedLink {
        SharedLink(Arc::new(watch::Sender::new(link)))
    }

    /// The link as it is now (cheap: a client handle and a key pointer).
    pub fn current(&self) -> Link {
        self.0.borrow().clone()
    }

    pub fn replace(&self, link: Link) {
        self.0.send_replace(link);
    }

    /// Resolves once the link is no longer `used` (at once if it already is not).
    pub async fn replaced(&self, used: &Link) {
        let mut changes = self.0.subscribe();
        // Never fails: `self` holds the sender.
        let _ = changes
            .wait_for(|now| !Arc::ptr_eq(&now.key, &used.key))
            .await;
    }
}
