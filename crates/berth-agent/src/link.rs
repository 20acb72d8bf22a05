//! The agent's link to the control plane: the HTTPS client (pinned CA on first contact, mTLS
//! with the agent's certificate afterwards) and the key that signs results and opens sealed
//! assignments, kept together.

use std::sync::Arc;
use std::time::Duration;

use berth_client::{Client, ClientConfig, Identity as ClientIdentity, Trust};
use berth_crypto::hpke::RecipientKey;
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
/// result is always signed with the key of the certificate its connection presents, and an
/// assignment is opened with the key of the certificate the poll that fetched it presented (the
/// server seals to that certificate's key).
#[derive(Clone)]
pub(crate) struct Link {
    pub client: Client,
    pub key: Arc<AgentKey>,
    /// `key` as an HPKE recipient: the same P-256 key, loaded for ECDH.
    pub opener: Arc<RecipientKey>,
    /// Which of the [`SharedLink`]'s servers `client` talks to.
    pub at: usize,
}

impl Link {
    pub fn new(server: &str, identity: &Identity) -> Result<Link, AgentError> {
        Ok(Link {
            client: mtls_client(server, identity)?,
            key: Arc::new(AgentKey::from_pem(&identity.key_pem).map_err(|e| {
                AgentError::Config(format!("agent.pem holds an unusable key: {e}"))
            })?),
            opener: Arc::new(
                RecipientKey::from_pkcs8_pem(&identity.key_pem).map_err(|e| {
                    AgentError::Config(format!("agent.pem holds an unusable key: {e}"))
                })?,
            ),
            at: 0,
        })
    }
}

/// The link every loop uses; the heartbeat loop replaces it after a renewal, and `run` when it
/// fails over to the next server. Once replaced, the old client goes with the last request
/// still holding it, and its connections with it.
#[derive(Clone)]
pub(crate) struct SharedLink {
    link: Arc<watch::Sender<Link>>,
    /// Every server this agent may use (`--server A,B`), in the order it tries them. All are
    /// replicas of one control plane: one database, one CA.
    servers: Arc<[String]>,
}

impl SharedLink {
    /// A link to `link`'s server alone.
    #[cfg(test)]
    pub fn new(link: Link) -> SharedLink {
        let server = link.client.server().to_string();
        SharedLink {
            link: Arc::new(watch::Sender::new(Link { at: 0, ..link })),
            servers: Arc::from(vec![server]),
        }
    }

    /// A link to the first of `servers` (at least one), as `identity`.
    pub fn connect(servers: Vec<String>, identity: &Identity) -> Result<SharedLink, AgentError> {
        let first = servers
            .first()
            .ok_or_else(|| AgentError::Config("no server to connect to".into()))?;
        Ok(SharedLink {
            link: Arc::new(watch::Sender::new(Link::new(first, identity)?)),
            servers: Arc::from(servers),
        })
    }

    /// Whether another server can be tried when the one in use fails.
    pub fn fails_over(&self) -> bool {
        self.servers.len() > 1
    }

    pub fn server_count(&self) -> usize {
        self.servers.len()
    }

    /// The server the link talks to now.
    pub fn server(&self) -> String {
        self.servers[self.current().at].clone()
    }

    /// The link as it is now (cheap: a client handle and a key pointer).
    pub fn current(&self) -> Link {
        self.link.borrow().clone()
    }

    /// Puts in place a link with the renewed `identity`, to the same server.
    pub fn renewed(&self, identity: &Identity) -> Result<(), AgentError> {
        let at = self.current().at;
        let link = Link::new(&self.servers[at], identity)?;
        self.link.send_replace(Link { at, ..link });
        Ok(())
    }

    /// Moves to the next server (after the last, the first again), keeping the key: a caller
    /// waiting for a renewal ([`SharedLink::replaced`]) is not woken by a change of server.
    /// Returns the server now in use.
    pub fn fail_over(&self, identity: &Identity) -> Result<String, AgentError> {
        let now = self.current();
        let at = (now.at + 1) % self.servers.len();
        let server = &self.servers[at];
        self.link.send_replace(Link {
            client: mtls_client(server, identity)?,
            at,
            ..now
        });
        Ok(server.clone())
    }

    #[cfg(test)]
    pub fn replace(&self, link: Link) {
        self.link.send_replace(link);
    }

    /// Resolves once the link is no longer `used` (at once if it already is not).
    pub async fn replaced(&self, used: &Link) {
        let mut changes = self.link.subscribe();
        // Never fails: `self` holds the sender.
        let _ = changes
            .wait_for(|now| !Arc::ptr_eq(&now.key, &used.key))
            .await;
    }
}
