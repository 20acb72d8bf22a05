//! The agent's lifetime: load the identity, acquire the session (whose generation fences every
//! later call), run the heartbeat and task loops side by side, and on the way out stop the work
//! and release the session. The first loop to fail decides the exit code, except the loss of
//! the server in use when several are named (`--server A,B`): then the next one is tried and a
//! new session (a new generation) acquired there; the replicas share one database, so the
//! old generation is fenced everywhere.

use berth_proto::error::ErrorChain;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use berth_exec::Capabilities;
use berth_proto::headers::GENERATION_HEADER;
use berth_proto::transport::{AcquireSession, ReleaseSession, Session as SessionGranted};

use crate::backoff::Backoff;
use crate::capabilities;
use crate::config::AgentConfig;
use crate::heartbeat::Heartbeats;
use crate::installation::Installation;
use crate::link::SharedLink;
use crate::probe::{self, Readiness};
use crate::retry::{classify, Failure};
use crate::state::StateDir;
use crate::tasks::{HeldSession, Interrupt, Runner};
use crate::AgentError;

/// How long running tasks get to finish (and report) when a failure stops the agent; a
/// requested stop gives them [`AgentConfig::shutdown_grace`], with the session kept alive.
const FAILURE_GRACE: Duration = Duration::from_secs(10);
/// A session that held this long before its server was lost was no flap: the next fail-over
/// is not delayed.
const HELD_LONG_ENOUGH: Duration = Duration::from_secs(60);

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
    let servers = if config.servers.is_empty() {
        vec![identity.file.server.clone()]
    } else {
        config.servers.clone()
    };
    let agent_id = identity.file.agent_id;
    let link = SharedLink::connect(servers, &identity)?;
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
        version: Some(crate::VERSION.to_string()),
    };
    // One runner for the process: its task slots, journal and running tasks outlive a change
    // of server; each poll carries the session it was made in.
    let runner = Runner::new(agent_id, link.clone(), &config, capabilities.clone())?;
    // The generation of the last session acquired, released on a clean stop.
    let mut held: Option<i64> = None;
    // Since when no server has been reachable: set when the one in use is lost. The retry
    // budget of the next acquisition counts from it, across every server tried.
    let mut lost_since: Option<Instant> = None;
    // Paces fail-overs when servers grant sessions but fail right after (a flapping replica),
    // so the generation does not spin; a session that held for a while resets it.
    let mut flapping = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
    let outcome = loop {
        let asked = Instant::now();
        let session = tokio::select! {
            _ = &mut shutdown => break Ok(()),
            s = acquire_session(&link, &state, &acquire, config.retry_budget, lost_since) => match s {
                Ok(s) => s,
                Err(e) => break Err(e),
            },
        };
        let granted_at = Instant::now();
        readiness.renewed(
            asked,
            probe::lease_after(Duration::from_secs(
                session.heartbeat_interval_seconds.max(1),
            )),
        );
        let generation = session.generation;
        let server = link.server();
        if held.replace(generation).is_none() {
            tracing::info!(%agent_id, %server, generation, instance = %instance_id, capabilities = ?capabilities.offered(), "agent started; session acquired");
        } else {
            tracing::info!(%agent_id, %server, generation, instance = %instance_id, "failed over; session acquired");
        }
        let server_key = match crate::report::server_sealing_key(&session.sealing_key) {
            Ok(key) => key,
            Err(e) => break Err(e),
        };
        let current = Arc::new(HeldSession {
            generation: generation.to_string(),
            server_key,
        });
        // Loaded again for every session: a renewal since the last one replaced it on disk.
        let identity = match state.load() {
            Ok(identity) => identity,
            Err(e) => break Err(e),
        };
        let heartbeats = Heartbeats {
            config: &config,
            state: &state,
            link: link.clone(),
            generation,
            capabilities: capabilities.clone(),
            compose: compose.clone(),
            readiness: readiness.clone(),
        }
        .run(identity);
        tokio::pin!(heartbeats);
        let (ended, stopping) = tokio::select! {
            // The task loop is dropped here: no new work. Heartbeats go on, so the session
            // (and with it the running tasks' right to report) lives through the grace.
            _ = &mut shutdown => (tokio::select! {
                r = &mut heartbeats => r,
                _ = quiesce(&runner, config.shutdown_grace) => Ok(()),
            }, true),
            r = &mut heartbeats => (r, false),
            r = runner.task_loop(config.task_transport, current) => (r, false),
            never = crate::idle::release_while_idle(&runner) => match never {},
        };
        if stopping {
            // Asked to stop: no fail-over (and `shutdown` has resolved, never to be polled
            // again). A server lost meanwhile still ends in a clean stop.
            break match ended {
                Err(AgentError::ServerLost(_)) => Ok(()),
                other => other,
            };
        }
        match ended {
            // Both loops are dropped here (a poll parked on the lost server goes with them);
            // running tasks go on, and their starts and results, sent under this generation,
            // are refused as fenced once the next session is held.
            Err(AgentError::ServerLost(why)) => {
                lost_since = Some(Instant::now());
                let next = match state.load().and_then(|identity| link.fail_over(&identity)) {
                    Ok(next) => next,
                    Err(e) => break Err(e),
                };
                tracing::warn!(%why, lost = %server, next = %next, generation, "server lost; failing over");
                if granted_at.elapsed() >= HELD_LONG_ENOUGH {
                    flapping = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
                } else {
                    let delay = flapping.next_delay();
                    tokio::select! {
                        _ = &mut shutdown => break Ok(()),
                        _ = tokio::time::sleep(delay) => {}
                    }
                }
            }
            other => break other,
        }
    };
    readiness.lost(match &outcome {
        Ok(()) => "the agent is stopping".into(),
        Err(e) => e.to_string(),
    });
    // Stop what still runs (nothing after a clean quiesce): all of it at once when fenced
    // (another process owns the identity now), after a short grace otherwise so results already
    // computed still reach the server.
    let interrupted = if matches!(outcome, Err(AgentError::Fenced(_))) {
        runner.stop(Duration::ZERO, Interrupt::Fenced).await
    } else {
        runner.stop(FAILURE_GRACE, Interrupt::Stopping).await
    };
    if !interrupted.is_empty() {
        tracing::warn!(interrupted = %task_list(&interrupted), "stopped with tasks still running; they were interrupted");
    }
    if let (Ok(()), Some(generation)) = (&outcome, held) {
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

/// A requested stop: no new work is taken (the caller dropped the task loop); running tasks get
/// `grace` to finish, then are interrupted and report `AGENT_STOPPED`.
async fn quiesce(runner: &Runner, grace: Duration) {
    let running = runner.running();
    if !running.is_empty() {
        tracing::info!(running = %task_list(&running), ?grace, "stopping: taking no new work; waiting for running tasks");
    }
    let interrupted = runner.stop(grace, Interrupt::Stopping).await;
    if !interrupted.is_empty() {
        tracing::warn!(interrupted = %task_list(&interrupted), ?grace, "shutdown grace ran out: interrupted running tasks");
    }
}

fn task_list(tasks: &[berth_proto::TaskId]) -> String {
    tasks
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Acquires the session on the server in use; with several servers, an outage there moves to
/// the next at once, and a back-off delay follows each round in which every server failed. Gives
/// up (`Temporary`, exit 75) once no server has answered for `budget`, counted from `since`
/// (when the server last in use was lost) or from now.
async fn acquire_session(
    link: &SharedLink,
    state: &StateDir,
    request: &AcquireSession,
    budget: Duration,
    since: Option<Instant>,
) -> Result<SessionGranted, AgentError> {
    let started = since.unwrap_or_else(Instant::now);
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
    // Servers that failed since the last back-off (the one just lost counts).
    let mut failed = usize::from(since.is_some());
    loop {
        let client = link.current().client;
        let why = match client.send(request).await {
            Ok(granted) => return Ok(granted),
            Err(e) => match classify(e) {
                Failure::Stop(e) => return Err(e),
                Failure::Outage(after, why) => {
                    failed += 1;
                    if failed < link.server_count() {
                        let next = link.fail_over(&state.load()?)?;
                        tracing::warn!(%why, next = %next, "session: server unreachable; trying the next");
                        continue;
                    }
                    failed = 0;
                    if link.fails_over() {
                        link.fail_over(&state.load()?)?;
                    }
                    (after, why)
                }
                Failure::Retry(after, why) => (after, why),
            },
        };
        let (after, why) = why;
        let delay = after.unwrap_or_else(|| backoff.next_delay());
        if started.elapsed() + delay > budget {
            return Err(AgentError::Temporary(format!(
                "session: gave up after {:?}: {why}",
                started.elapsed()
            )));
        }
        tracing::warn!(%why, retry_in = ?delay, "session failed; retrying");
        tokio::time::sleep(delay).await;
    }
}

/// Aborts its task when dropped, whichever way [`run`] returns.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
