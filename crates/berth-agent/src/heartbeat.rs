//! The heartbeat loop: detect capabilities, sample resources, send a heartbeat at the server's
//! interval, and renew the certificate when it is due (swapping the shared link).

use std::time::{Duration, Instant};

use berth_client::ClientError;
use berth_crypto::AgentKey;
use berth_exec::Capabilities;
use berth_proto::agent::{AgentStatus, Capability, Heartbeat};
use berth_proto::headers::GENERATION_HEADER;
use berth_proto::transport::ALG_ECDSA_SHA256;
use time::OffsetDateTime;

use crate::capabilities;
use crate::config::AgentConfig;
use crate::link::{Link, SharedLink};
use crate::probe::Readiness;
use crate::renew::{renew, renewal_due};
use crate::resources::Sampler;
use crate::retry::with_retries_or_fail_over;
use crate::state::{Identity, StateDir};
use crate::AgentError;

/// Compose is detected by running a program; do it rarely to keep an idle agent idle.
const COMPOSE_PROBE_EVERY: Duration = Duration::from_secs(600);

pub(crate) struct Heartbeats<'a> {
    pub config: &'a AgentConfig,
    pub state: &'a StateDir,
    pub link: SharedLink,
    pub generation: i64,
    /// Updated with every detection, for the poll and `inspect`.
    pub capabilities: Capabilities,
    /// The compose capability found at start; probed again every [`COMPOSE_PROBE_EVERY`].
    pub compose: Option<Capability>,
    /// Renewed with every heartbeat the server applied, for `/readyz`.
    pub readiness: Readiness,
}

impl Heartbeats<'_> {
    /// Runs until a failure ends the agent (fenced, revoked, retry budget spent), or, with
    /// several servers, until the one in use is lost ([`AgentError::ServerLost`]).
    pub async fn run(self, mut identity: Identity) -> Result<(), AgentError> {
        let agent_id = identity.file.agent_id;
        let generation_header = self.generation.to_string();
        let mut sampler = Sampler::default();
        let mut compose = self.compose;
        let mut compose_probed = Instant::now();
        // The heartbeat sequence. Nothing is persisted: the server compares it only within this
        // process's session generation, which the server increments in the same transaction
        // that grants a session. A restarted agent (after a crash too) holds a new generation,
        // so starting again at 1 can never repeat a (generation, sequence) the server applied.
        let mut sequence: u64 = 0;
        loop {
            if renewal_due(&identity.file, OffsetDateTime::now_utc()) {
                let client = self.link.current().client;
                identity = renew(
                    self.state,
                    &client,
                    &identity,
                    self.config.retry_budget,
                    &generation_header,
                    self.link.fails_over(),
                )
                .await?;
                self.link.renewed(&identity)?;
            }
            if compose_probed.elapsed() >= COMPOSE_PROBE_EVERY {
                compose = capabilities::compose().await;
                compose_probed = Instant::now();
            }
            let detected: Vec<Capability> = capabilities::docker()
                .await
                .into_iter()
                .chain(compose.clone())
                .chain([capabilities::ssh()])
                .collect();
            self.capabilities.set(detected.clone());
            let status = if detected.iter().all(|c| c.healthy) {
                AgentStatus::Online
            } else {
                AgentStatus::Degraded
            };
            let heartbeat = Heartbeat {
                agent_id,
                status,
                resource_usage: sampler.sample(&self.config.state_dir),
                capabilities: detected,
                generation: self.generation,
                sequence: 0,
                signature_algorithm: ALG_ECDSA_SHA256.into(),
                signature: None,
            };
            let Link { client, key, .. } = self.link.current();
            let headers = [(GENERATION_HEADER, generation_header.as_str())];
            let mut attempted = Instant::now();
            let fail_over = self.link.fails_over();
            let sent =
                with_retries_or_fail_over("heartbeat", self.config.retry_budget, fail_over, || {
                    // Every attempt is a new heartbeat: one whose answer was lost may have been
                    // applied, and sending its sequence again would be refused as a replay.
                    sequence += 1;
                    attempted = Instant::now();
                    let signed = signed(&heartbeat, sequence, &key);
                    let client = &client;
                    let headers = &headers;
                    async move { client.send_with(&signed?, headers, None).await }
                })
                .await?;
            let interval = Duration::from_secs(sent.heartbeat_interval_seconds.max(1));
            self.readiness
                .renewed(attempted, crate::probe::lease_after(interval));
            tokio::time::sleep(interval).await;
        }
    }
}

/// `heartbeat` with `sequence`, signed with `key`.
fn signed(heartbeat: &Heartbeat, sequence: u64, key: &AgentKey) -> Result<Heartbeat, ClientError> {
    let mut heartbeat = Heartbeat {
        sequence,
        signature: None,
        ..heartbeat.clone()
    };
    heartbeat.signature = Some(
        crate::link::signature("the heartbeat", heartbeat.signing_input(), key)
            .map_err(ClientError::Config)?,
    );
    Ok(heartbeat)
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use berth_proto::agent::ResourceUsage;
    use berth_proto::AgentId;

    #[test]
    fn a_heartbeat_is_signed_over_its_jcs_with_the_sequence_and_the_algorithm() {
        let now = OffsetDateTime::now_utc();
        let ca = berth_crypto::Ca::generate("test CA", now).unwrap();
        let key = AgentKey::generate().unwrap();
        let agent = AgentId(uuid::Uuid::new_v4());
        let cert = ca
            .sign_agent_csr(
                &key.csr_pem("a").unwrap(),
                agent.0,
                now,
                time::Duration::days(1),
            )
            .unwrap();
        let heartbeat = Heartbeat {
            agent_id: agent,
            status: AgentStatus::Online,
            resource_usage: ResourceUsage::default(),
            capabilities: vec![],
            generation: 7,
            sequence: 0,
            signature_algorithm: ALG_ECDSA_SHA256.into(),
            signature: None,
        };
        let sent = serde_json::to_value(signed(&heartbeat, 3, &key).unwrap()).unwrap();
        assert_eq!(sent["sequence"], 3);
        assert_eq!(sent["generation"], 7);
        let verifies = |body: &serde_json::Value| {
            let signature = base64::engine::general_purpose::STANDARD
                .decode(body["signature"].as_str().unwrap())
                .unwrap();
            berth_crypto::verify_with_cert(
                &cert.cert_der,
                ALG_ECDSA_SHA256,
                &berth_proto::transport::signing_input(body).unwrap(),
                &signature,
            )
            .is_ok()
        };
        assert!(verifies(&sent));
        // Every signed member is covered: the sequence, the algorithm, the capability refresh.
        for (member, value) in [
            ("sequence", serde_json::json!(4)),
            ("generation", serde_json::json!(8)),
            ("signatureAlgorithm", serde_json::json!("rsa-sha256")),
            (
                "capabilities",
                serde_json::json!([{"name": "docker", "healthy": true}]),
            ),
        ] {
            let mut changed = sent.clone();
            changed[member] = value;
            assert!(
                !verifies(&changed),
                "{member} is not covered by the signature"
            );
        }
        // Another agent's key does not make this agent's signature.
        let other = AgentKey::generate().unwrap();
        let forged = serde_json::to_value(signed(&heartbeat, 3, &other).unwrap()).unwrap();
        assert!(!verifies(&forged));
    }
}
