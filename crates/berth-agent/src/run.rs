//! The agent's lifetime: load the identity, acquire the session (whose generation fences every
//! later call), run the heartbeat and task loops side by side, and on the way out stop the work
//! and release the session. The first loop to fail decides the exit code.

use berth_proto::error::ErrorChain;
use std::future::Future;
use std::time::Duration;

use berth_exec::Capabilities;
use berth_proto::headers::GENERATION_HEADER;
use berth_proto::transport::{AcquireSession, ReleaseSession};

use crate::capabilities;
use crate::config::AgentConfig;
use crate::heartbeat::Heartbeats;
use crate::installation::Installation;
use crate::link::{Link, SharedLink};
use crate::probe::{self, Readiness};
use crate::retry::with_retries;
use crate::state::StateDir;
use crate::tasks::Runner;
use crate::AgentError;

/// How long running tasks get to finish (and report) when the agent stops.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Removes the `docker-config-*` registry logins an earlier agent process left in
/// [`AgentConfig::credentials_dir`] (it was killed while a compose task ran). Only one agent
/// process runs per state dir, so none of them is in use.
pub fn sweep_credentials(config: &AgentConfig) {
    let dir = config.credentials_dir();
    match berth_exec::compose::sweep_credentials(&dir) {
        Ok(0) => {}
        Ok(n) => {
            tracing::warn!(dir = %dir.display(), removed = n, "removed registry logins left by an earlier agent process")
        }
        Err(e) => {
            tracing::error!(dir = %dir.display(), error = %e, "cannot sweep leftover registry logins")
        }
    }
}

/// Runs until `shutdown` resolves (Ok: exit 0) or a failure decides the exit code.
pub async fn run(
    config: AgentConfig,
    shutdown: impl Future<Output = ()>,
) -> Result<(), AgentError> {
    config.validate()?;
    let state = StateDir(config.state_dir.clone());
    let identity = state.load()?;
    // A compose task's registry login outlives a kill -9 of the agent: remove it before anything.
    sweep_credentials(&config);
    let server = config
        .server
        .clone()
        .unwrap_or_else(|| identity.file.server.clone());
    let agent_id = identity.file.agent_id;
    let link = SharedLink::new(Link::new(&server, &identity)?);
    let instance_id = uuid::Uuid::new_v4().to_string();

    tokio::pin!(shutdown);
    // Bound first, so a bad address stops the agent before anything else; served once the
    // executors are known (what readiness checks), answering 503 until the session is held.
    let probe_listener = match config.probe_listen {
        Some(addr) => Some(probe::bind(addr).await?),
        None => None,
    };
    let readiness = Readiness::default();
    // Before the first poll, so it already offers what this host can do.
    let (docker, compose) = tokio::select! {
        _ = &mut shutdown => return Ok(()),
        d = async { tokio::join!(capabilities::docker(), capabilities::compose()) } => d,
    };
    let capabilities = Capabilities::new(
        docker
            .into_iter()
            .chain(compose.clone())
            .chain([capabilities::ssh()])
            .collect(),
    );

    // Aborted when this function returns: the probes end with the agent's work.
    let _probes = probe_listener.map(|listener| {
        AbortOnDrop(tokio::spawn(probe::serve(
            listener,
            readiness.clone(),
            capabilities.clone(),
        )))
    });

    // Held until this function returns: the proof to the next process of this installation.
    let installation = Installation::claim(&state);
    let acquire = AcquireSession {
        agent_id,
        instance_id: instance_id.clone(),
        boot_id: installation.boot_id.clone(),
        lock: installation.lock_id(),
    };
    let client = link.current().client;
    let asked = std::time::Instant::now();
    let session = tokio::select! {
        _ = &mut shutdown => return Ok(()),
        s = with_retries("session", config.retry_budget, || client.send(&acquire)) => s?,
    };
    readiness.renewed(
        asked,
        probe::lease_after(Duration::from_secs(
            session.heartbeat_interval_seconds.max(1),
        )),
    );
    let generation = session.generation;
    tracing::info!(%agent_id, %server, generation, instance = %instance_id, capabilities = ?capabilities.offered(), "agent started; session acquired");

    let runner = Runner::new(
        agent_id,
        generation,
        link.clone(),
        &config,
        capabilities.clone(),
    )?;
    let heartbeats = Heartbeats {
        config: &config,
        state: &state,
        server: &server,
        link: link.clone(),
        generation,
        capabilities,
        compose,
        readiness: readiness.clone(),
    }
    .run(identity);
    let outcome = tokio::select! {
        _ = &mut shutdown => Ok(()),
        r = heartbeats => r,
        r = runner.poll_loop() => r,
    };
    readiness.lost(match &outcome {
        Ok(()) => "the agent is stopping".into(),
        Err(e) => e.to_string(),
    });
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
        let client = link.current().client;
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
                tracing::warn!(error = %ErrorChain(&e), "could not release the session; it expires by itself")
            }
        }
    }
    outcome
}

/// Aborts its task when dropped, whichever way [`run`] returns.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
