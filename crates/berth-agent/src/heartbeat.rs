//! The heartbeat loop: detect capabilities, sample resources, send a heartbeat at the server's
//! interval, and renew the certificate when it is due (swapping the shared link).

use std::time::{Duration, Instant};

use berth_exec::Capabilities;
use berth_proto::agent::{AgentStatus, Capability, Heartbeat};
use berth_proto::headers::GENERATION_HEADER;
use time::OffsetDateTime;

use crate::capabilities;
use crate::config::AgentConfig;
use crate::link::{Link, SharedLink};
use crate::renew::{renew, renewal_due};
use crate::resources::Sampler;
use crate::retry::with_retries;
use crate::state::{Identity, StateDir};
use crate::AgentError;

/// Compose is detected by running a program; do it rarely to keep an idle agent idle.
const COMPOSE_PROBE_EVERY: Duration = Duration::from_secs(600);

pub(crate) struct Heartbeats<'a> {
    pub config: &'a AgentConfig,
    pub state: &'a StateDir,
    pub server: &'a str,
    pub link: SharedLink,
    pub generation: i64,
    /// Updated with every detection, for the poll and `inspect`.
    pub capabilities: Capabilities,
    /// The compose capability found at start; probed again every [`COMPOSE_PROBE_EVERY`].
    pub compose: Option<Capability>,
}

impl Heartbeats<'_> {
    /// Runs until a failure ends the agent (fenced, revoked, retry budget spent).
    pub async fn run(self, mut identity: Identity) -> Result<(), AgentError> {
        let agent_id = identity.file.agent_id;
        let generation_header = self.generation.to_string();
        let mut sampler = Sampler::default();
        let mut compose = self.compose;
        let mut compose_probed = Instant::now();
        loop {
            if renewal_due(&identity.file, OffsetDateTime::now_utc()) {
                let client = self.link.current().client;
                identity = renew(
                    self.state,
                    &client,
                    &identity,
                    self.config.retry_budget,
                    &generation_header,
                )
                .await?;
                self.link.replace(Link::new(self.server, &identity)?);
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
            };
            let client = self.link.current().client;
            let headers = [(GENERATION_HEADER, generation_header.as_str())];
            let sent = with_retries("heartbeat", self.config.retry_budget, || {
                client.send_with(&heartbeat, &headers, None)
            })
            .await?;
            let interval = Duration::from_secs(sent.heartbeat_interval_seconds.max(1));
            tokio::time::sleep(interval).await;
        }
    }
}
