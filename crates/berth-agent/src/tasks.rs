//! The task side of the agent: long-poll for assignments, run each with its executor under the
//! task's timeout and cancellation, journal the outcome, and send a signed result.
//!
//! The agent never decides that a task succeeded by itself: it reports what the executor said,
//! signed with its key, and the server decides what that means for the task.
//!
//! An assignment's payload and credentials arrive sealed to this agent's key; one that does not
//! open (missing, tampered, another key's, another assignment's) runs nothing and is reported
//! failed as `PAYLOAD_UNSEALABLE`.

use berth_client::sealing::open_assignment;
use berth_client::ClientError;
use berth_proto::error::ErrorChain;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use berth_crypto::hpke::{RecipientKey, RecipientPublicKey};
use berth_exec::builtin::{ExecuteCommand, HealthCheck, Inspect, Stickers};
use berth_exec::sticker::StickerStore;
use berth_exec::{
    ArtifactSource, Capabilities, ComposeExecutor, DockerExecutor, Executor, Lease, LeaseCheck,
    Outcome, SshExecutor, Task, UploadFiles,
};
use berth_proto::headers::{GENERATION_HEADER, KNOWN_CANCELLATIONS_HEADER};
use berth_proto::kind::TaskKind;
use berth_proto::result::error_types;
use berth_proto::transport::{
    self, AgentTaskAssignment, AgentTaskCancellation, AgentTaskPollRequest, SealedAssignment,
    SubmitResult, TaskStreamMessage, TaskStreamRequest, CONTRACT_VERSION,
};
use berth_proto::{AgentId, AssignmentId, TaskId};
use futures_util::{SinkExt, StreamExt};
use time::OffsetDateTime;
use tokio::sync::OwnedSemaphorePermit;
use tokio::sync::Semaphore;
use tokio_tungstenite::tungstenite::Message as WsMessage;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::artifacts::ServerArtifacts;
use crate::config::{AgentConfig, TaskTransport};
use crate::journal::Journal;
use crate::link::{Link, SharedLink};
use crate::report::{sign, unsigned_envelope};
use crate::retry::{with_link_retries, with_link_retries_or_fail_over};
use crate::start::{check_expiry, DeliveryLease};
use crate::AgentError;

/// A poll waits at most 25 s on the server; the client allows a little more.
const POLL_TIMEOUT: Duration = Duration::from_secs(35);
/// After the shutdown grace, how long interrupted tasks get to clean up and report.
const INTERRUPT_REPORT: Duration = Duration::from_secs(10);
/// After cancelling or timing out, how long an executor gets to clean up before it is dropped.
const CLEANUP_GRACE: Duration = Duration::from_secs(30);

/// What one session of this process holds: the generation its calls carry and the server key
/// its results' logs are sealed to. A delivery keeps the session whose poll fetched it: after a
/// fail-over to another server (a new session), its start and its result still carry the old
/// generation, so the server refuses them as `FENCED` instead of the task running twice.
pub struct HeldSession {
    pub generation: String,
    /// The server's sealing key, from the session answer: result logs are sealed to it.
    pub server_key: RecipientPublicKey,
}

/// Why the agent interrupts the tasks still running when it stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interrupt {
    /// A requested stop (SIGTERM) whose grace ran out, or a failure that ends the process.
    Stopping,
    /// Another process took this agent's session: the deliveries are no longer this
    /// process's, whatever they were doing.
    Fenced,
}

impl Interrupt {
    /// The `errorType` and message an interrupted task reports.
    fn reported(self) -> (&'static str, &'static str) {
        match self {
            Interrupt::Stopping => (
                error_types::AGENT_STOPPED,
                "interrupted: the agent was stopping and its shutdown grace ran out",
            ),
            Interrupt::Fenced => (
                error_types::LEASE_LOST,
                "interrupted: another process took over this agent's session (fenced)",
            ),
        }
    }
}

struct Shared {
    agent_id: AgentId,
    link: SharedLink,
    /// The executor of each task kind this agent runs.
    executors: HashMap<TaskKind, Arc<dyn Executor>>,
    /// What polls offer, kept current by the heartbeat loop.
    capabilities: Capabilities,
    journal: Journal,
    retry_budget: Duration,
    /// Running assignments, their tasks, and the tokens that stop them.
    running: Mutex<HashMap<AssignmentId, (TaskId, CancellationToken)>>,
    /// Set when the agent interrupts what still runs: a token cancelled from then on
    /// interrupts its task for this reason rather than cancels it for an operator.
    interrupt: OnceLock<Interrupt>,
    /// Cancellations already received, echoed to the server so it does not resend them.
    known_cancellations: Mutex<BTreeSet<AssignmentId>>,
}

pub struct Runner {
    shared: Arc<Shared>,
    slots: Arc<Semaphore>,
    tracker: TaskTracker,
    /// Deliveries dispatched by this process: `idle` releases pages again only after tasks ran.
    dispatched: AtomicU64,
}

impl Runner {
    pub fn new(
        agent_id: AgentId,
        link: SharedLink,
        config: &AgentConfig,
        capabilities: Capabilities,
    ) -> Result<Runner, AgentError> {
        let stickers = StickerStore::new(
            config
                .sticker_dir
                .clone()
                .unwrap_or_else(|| config.state_dir.join("stickers")),
        );
        let docker = Arc::new(
            DockerExecutor::new(stickers.clone()).with_allowed_hooks(config.allow_hooks.clone()),
        );
        let openbao_ca = match &config.openbao_ca_file {
            Some(p) => Some(std::fs::read(p).map_err(|e| {
                AgentError::Config(format!("--openbao-ca-file {}: {e}", p.display()))
            })?),
            None => None,
        };
        let artifacts: Arc<dyn ArtifactSource> = Arc::new(ServerArtifacts {
            agent_id,
            link: link.clone(),
        });
        let executors: Vec<Arc<dyn Executor>> = vec![
            Arc::new(HealthCheck),
            Arc::new(Stickers(stickers.clone())),
            docker.clone(),
            Arc::new(
                ComposeExecutor::new(stickers.clone(), config.credentials_dir())
                    .with_allowed_hooks(config.allow_hooks.clone()),
            ),
            Arc::new(Inspect {
                stickers,
                capabilities: capabilities.clone(),
                docker: Some(docker),
            }),
            Arc::new(ExecuteCommand {
                allowed: config.allow_commands.clone(),
            }),
            Arc::new(SshExecutor::with_artifacts(artifacts.clone())),
            Arc::new(UploadFiles::new(config.upload_root()).with_artifacts(artifacts)),
            Arc::new(berth_exec::readiness::ReadinessProbe {
                secrets: Some(Arc::new(crate::openbao::ProbeSecrets {
                    addr: config.openbao_addr.clone(),
                    ca_pem: openbao_ca,
                })),
            }),
        ];
        let executors = executors
            .into_iter()
            .flat_map(|e| e.task_types().iter().map(move |&kind| (kind, e.clone())))
            .collect();
        Ok(Runner {
            shared: Arc::new(Shared {
                agent_id,
                link,
                executors,
                capabilities,
                journal: Journal::open(config.state_dir.join("journal"))?,
                retry_budget: config.retry_budget,
                running: Mutex::new(HashMap::new()),
                interrupt: OnceLock::new(),
                known_cancellations: Mutex::new(BTreeSet::new()),
            }),
            slots: Arc::new(Semaphore::new(config.max_concurrent_tasks.max(1))),
            tracker: TaskTracker::new(),
            dispatched: AtomicU64::new(0),
        })
    }

    /// Takes assignments until a failure ends the agent (fenced, revoked, retry budget spent),
    /// over the transport `mode` names. `Auto` uses the stream while the server offers it and
    /// long-polls for [`STREAM_RETRY`] whenever it does not, then tries the stream again.
    /// Everything it takes is run under `session`. With several servers, returns
    /// [`AgentError::ServerLost`] when the one in use fails.
    pub async fn task_loop(
        &self,
        mode: TaskTransport,
        session: Arc<HeldSession>,
    ) -> Result<(), AgentError> {
        loop {
            match mode {
                TaskTransport::Poll => return self.poll_loop(None, &session).await,
                TaskTransport::Stream | TaskTransport::Auto => {}
            }
            let why = self.stream_loop(&session).await?;
            if mode == TaskTransport::Stream {
                return Err(AgentError::Config(format!(
                    "--task-transport stream, but the server does not offer it: {why}"
                )));
            }
            tracing::info!(%why, retry_in = ?STREAM_RETRY, "the server offers no task stream; long-polling");
            self.poll_loop(Some(tokio::time::Instant::now() + STREAM_RETRY), &session)
                .await?;
        }
    }

    /// Takes assignments from the task stream, opening it again whenever it drops (a dropped
    /// stream is a lost poll: what was pushed and not received comes back once its lease ends).
    /// Returns (`Ok`) only when the server does not offer the stream, with why.
    async fn stream_loop(&self, session: &Arc<HeldSession>) -> Result<String, AgentError> {
        loop {
            let opened = std::time::Instant::now();
            let end = with_link_retries_or_fail_over(
                "task stream",
                self.shared.retry_budget,
                &self.shared.link,
                |link| self.stream_once(link, session),
            )
            .await?;
            match end {
                StreamEnd::NotOffered(why) => return Ok(why),
                StreamEnd::Dropped => {
                    tracing::info!("the task stream ended; opening it again");
                    // A stream that keeps ending at once must not spin.
                    if opened.elapsed() < Duration::from_secs(1) {
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        }
    }

    /// One task stream: a `ready` (the poll's body) per free task slot, exactly as one poll per
    /// slot, and each pushed assignment run like a polled one. Ends `Dropped` when the
    /// connection goes, with the server's refusal when it closes with one (4000 + status).
    async fn stream_once(
        &self,
        link: Link,
        session: &Arc<HeldSession>,
    ) -> Result<StreamEnd, ClientError> {
        let path = transport::task_stream_path(self.shared.agent_id);
        let headers = [(GENERATION_HEADER, session.generation.as_str())];
        let socket = match link.client.websocket(&path, &headers).await {
            Ok(socket) => socket,
            // Not this server's route (an older server, a proxy without WebSocket): fall back.
            Err(
                e @ ClientError::Api {
                    status: 400 | 404 | 405 | 426 | 501,
                    ..
                },
            ) => return Ok(StreamEnd::NotOffered(e.to_string())),
            Err(e) => return Err(e),
        };
        tracing::info!(agent_id = %self.shared.agent_id, "task stream open");
        let (mut sink, mut source) = socket.split();
        loop {
            // Cancellations keep coming while every slot is busy.
            let permit = loop {
                tokio::select! {
                    permit = self.slots.clone().acquire_owned() => {
                        break permit.map_err(|_| ClientError::Config("task slots closed".into()))?
                    }
                    message = heard(&mut source) => match self.on_message(message)? {
                        Pushed::Other => {}
                        Pushed::Ended => return Ok(StreamEnd::Dropped),
                        Pushed::Assigned(a) => {
                            // Not asked for: the server broke the stream's rule. Not run (its
                            // lease runs out on the server); the stream is opened again.
                            tracing::warn!(task_id = %a.task_id, assignment_id = %a.assignment_id, "the server pushed an assignment that was not asked for; not running it");
                            return Ok(StreamEnd::Dropped);
                        }
                    },
                }
            };
            let ready = TaskStreamRequest::Ready(self.poll_request());
            let text = serde_json::to_string(&ready)
                .map_err(|e| ClientError::Config(format!("ready message: {e}")))?;
            if sink.send(WsMessage::text(text)).await.is_err() {
                return Ok(StreamEnd::Dropped);
            }
            loop {
                match self.on_message(heard(&mut source).await)? {
                    Pushed::Other => {}
                    Pushed::Ended => return Ok(StreamEnd::Dropped),
                    Pushed::Assigned(assignment) => {
                        self.dispatch(*assignment, link.opener.clone(), permit, session.clone());
                        break;
                    }
                }
            }
        }
    }

    /// What one stream message means; a close with a refusal is that refusal.
    fn on_message(
        &self,
        message: Option<Result<WsMessage, tokio_tungstenite::tungstenite::Error>>,
    ) -> Result<Pushed, ClientError> {
        let text = match message {
            Some(Ok(WsMessage::Text(text))) => text,
            Some(Ok(WsMessage::Close(Some(frame)))) if u16::from(frame.code) >= 4000 => {
                let code = frame.reason.to_string();
                return Err(ClientError::Api {
                    status: u16::from(frame.code) - 4000,
                    body: berth_proto::ErrorBody {
                        detail: format!("the server closed the task stream: {code}"),
                        code,
                    },
                    retry_after: None,
                });
            }
            Some(Ok(WsMessage::Close(_))) | Some(Err(_)) | None => return Ok(Pushed::Ended),
            Some(Ok(_)) => return Ok(Pushed::Other),
        };
        match serde_json::from_str::<TaskStreamMessage>(&text) {
            Ok(TaskStreamMessage::TaskAssigned { task }) => Ok(Pushed::Assigned(task)),
            Ok(TaskStreamMessage::TaskCancelled {
                task_id,
                assignment_id,
            }) => {
                self.cancel(&AgentTaskCancellation {
                    task_id,
                    assignment_id,
                });
                Ok(Pushed::Other)
            }
            Err(e) => {
                // Fail closed on a message we cannot read; the stream is opened again.
                tracing::warn!(error = %e, "unreadable task stream message; reconnecting");
                Ok(Pushed::Ended)
            }
        }
    }

    /// The poll's body: seed capability strings of what this host has (see
    /// `Capabilities::offered`), with the start handshake promised.
    fn poll_request(&self) -> AgentTaskPollRequest {
        AgentTaskPollRequest {
            contract_version: CONTRACT_VERSION.into(),
            agent_id: self.shared.agent_id,
            capabilities: self.shared.capabilities.offered(),
            start_handshake: true,
        }
    }

    /// Runs one delivery in its own task, holding its slot until it is done.
    /// Runs a delivery; `opener` is the key of the link it came over (its box is sealed to it).
    fn dispatch(
        &self,
        assignment: AgentTaskAssignment,
        opener: Arc<RecipientKey>,
        permit: OwnedSemaphorePermit,
        session: Arc<HeldSession>,
    ) {
        // One span per delivery: with RUST_LOG=info every line of this task's path (journal,
        // executor, result) carries these fields.
        let span = delivery_span(self.shared.agent_id, &session.generation, &assignment);
        self.dispatched.fetch_add(1, Ordering::Relaxed);
        let shared = self.shared.clone();
        self.tracker.spawn(
            async move {
                let _permit = permit;
                shared.handle(assignment, &opener, &session).await;
            }
            .instrument(span),
        );
    }

    /// Long-polls until a failure ends the agent, or until `until` has passed (then `Ok`).
    async fn poll_loop(
        &self,
        until: Option<tokio::time::Instant>,
        session: &Arc<HeldSession>,
    ) -> Result<(), AgentError> {
        loop {
            if until.is_some_and(|t| tokio::time::Instant::now() >= t) {
                return Ok(());
            }
            let request = self.poll_request();
            let permit = self
                .slots
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| AgentError::Fatal("task slots closed".into()))?;
            let known = self.known_cancellations();
            let headers = [
                (GENERATION_HEADER, session.generation.as_str()),
                (KNOWN_CANCELLATIONS_HEADER, known.as_str()),
            ];
            let (request, headers) = (&request, &headers);
            // The assignment is sealed to the key of the certificate this poll presented: open
            // it with that link's key, even if a renewal replaces the link meanwhile.
            let (response, opener) = with_link_retries_or_fail_over(
                "task poll",
                self.shared.retry_budget,
                &self.shared.link,
                |link| async move {
                    link.client
                        .send_with(request, headers, Some(POLL_TIMEOUT))
                        .await
                        .map(|response| (response, link.opener.clone()))
                },
            )
            .await?;
            for c in &response.cancellations {
                self.cancel(c);
            }
            if let Some(assignment) = response.assignment {
                self.dispatch(assignment, opener, permit, session.clone());
            }
        }
    }

    fn known_cancellations(&self) -> String {
        let running = self
            .shared
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let mut known = self
            .shared
            .known_cancellations
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        // Forget cancellations of assignments that have finished.
        known.retain(|a| running.contains_key(a));
        known
            .iter()
            .map(|a| a.to_string())
            .collect::<Vec<_>>()
            .join(",")
    }

    fn cancel(&self, c: &AgentTaskCancellation) {
        let assignment = c.assignment_id;
        let running = self
            .shared
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some((_, token)) = running.get(&assignment) {
            tracing::info!(task_id = %c.task_id, assignment_id = %assignment, agent_id = %self.shared.agent_id, "cancelling a running task");
            token.cancel();
            self.shared
                .known_cancellations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(assignment);
        }
    }

    /// The tasks running now.
    /// How many deliveries this process has dispatched.
    pub fn dispatched(&self) -> u64 {
        self.dispatched.load(Ordering::Relaxed)
    }

    pub fn running(&self) -> Vec<TaskId> {
        let running = self
            .shared
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        running.values().map(|(task, _)| *task).collect()
    }

    /// Stops taking work; waits up to `grace` for running tasks, then interrupts what is left
    /// (each reports `why`'s code, given a few seconds to clean up and send it) and returns
    /// those tasks.
    pub async fn stop(&self, grace: Duration, why: Interrupt) -> Vec<TaskId> {
        self.tracker.close();
        if !grace.is_zero()
            && tokio::time::timeout(grace, self.tracker.wait())
                .await
                .is_ok()
        {
            return Vec::new();
        }
        // The first reason stands: a fence during a requested stop's grace is still a stop.
        let _ = self.shared.interrupt.set(why);
        let interrupted = {
            let running = self
                .shared
                .running
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            running
                .values()
                .map(|(task, token)| {
                    token.cancel();
                    *task
                })
                .collect()
        };
        let _ = tokio::time::timeout(INTERRUPT_REPORT, self.tracker.wait()).await;
        interrupted
    }
}

/// The server pings an open stream every 20 s: a stream silent for longer than this is dead
/// (a partition that left the socket open), and is opened again, as a poll would time out.
const STREAM_SILENCE: Duration = Duration::from_secs(65);

/// The stream's next message; `None` (ended) after [`STREAM_SILENCE`] without one.
async fn heard<S>(source: &mut S) -> Option<S::Item>
where
    S: futures_util::Stream + Unpin,
{
    tokio::time::timeout(STREAM_SILENCE, source.next())
        .await
        .ok()
        .flatten()
}

/// How long `auto` long-polls before it tries the task stream again.
const STREAM_RETRY: Duration = Duration::from_secs(300);

/// How one task stream ended.
enum StreamEnd {
    /// The connection went (or the server is stopping): open it again.
    Dropped,
    /// The server answered the upgrade as one that has no task stream.
    NotOffered(String),
}

/// What one stream message was.
enum Pushed {
    Assigned(Box<AgentTaskAssignment>),
    /// A cancellation (already acted on), or a control frame.
    Other,
    Ended,
}

/// The span one delivery runs in.
fn delivery_span(agent_id: AgentId, generation: &str, a: &AgentTaskAssignment) -> tracing::Span {
    tracing::info_span!(
        "task",
        task_id = %a.task_id,
        agent_id = %agent_id,
        assignment_id = %a.assignment_id,
        generation = %generation,
        task_type = %a.task_type,
    )
}

impl Shared {
    async fn handle(&self, a: AgentTaskAssignment, opener: &RecipientKey, session: &HeldSession) {
        let started = Instant::now();
        let started_at = OffsetDateTime::now_utc();
        tracing::info!(side_effects = a.side_effects, timeout = %a.timeout, "task received");
        let token = CancellationToken::new();
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(a.assignment_id, (a.task_id, token.clone()));
        if let Some(outcome) = self.outcome(&a, opener, token, session).await {
            tracing::info!(success = outcome.success, error = ?outcome.error_type, "task finished");
            self.report(&a, &outcome, started_at, started.elapsed(), session)
                .await;
        }
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&a.assignment_id);
    }

    /// The journaled outcome of a redelivered task, or what running it gave; `None` when the
    /// delivery is no longer this process's to run. Nothing touches the host unless the delivery
    /// is still ours: not expired, and (with side effects) confirmed by the server. A refused
    /// delivery is dropped unreported, and the server hands it out again once its lease lapses.
    async fn outcome(
        &self,
        a: &AgentTaskAssignment,
        opener: &RecipientKey,
        token: CancellationToken,
        session: &HeldSession,
    ) -> Option<Outcome> {
        if let Some(recorded) = self.journal.get(&a.idempotency_key) {
            tracing::info!("redelivered task already completed; answering from the journal");
            return Some(recorded);
        }
        // Before the lease is asked for: a box that does not open runs nothing, so there is no
        // start to confirm. Not journaled: it says nothing about the task, only this delivery.
        let opened = match open_assignment(a, opener) {
            Ok(opened) => opened,
            Err(why) => {
                tracing::warn!(%why, "not running the task: its sealed payload does not open");
                return Some(Outcome::failed(error_types::PAYLOAD_UNSEALABLE, why, false));
            }
        };
        let lease = self.lease(a, &session.generation);
        let refused = match &lease {
            Some(lease) => lease.confirm(None).await,
            None => check_expiry(a.expires_at),
        };
        if let Err(why) = refused {
            tracing::warn!(%why, "not running the task: the delivery is no longer ours");
            return None;
        }
        let lease = lease.map_or_else(Lease::unfenced, |l| Lease::new(l));
        let mut outcome = self.execute(a, &opened, token, lease).await;
        if let (Some(error_types::CANCELLED), Some(why)) =
            (outcome.error_type.as_deref(), self.interrupt.get())
        {
            // Stopped by the agent itself, not by an operator: the server must not record it
            // as cancelled, and a read-only task may run again elsewhere.
            let (code, message) = why.reported();
            outcome.error_type = Some(code.into());
            outcome.message = message.into();
            outcome.retriable = !a.side_effects;
        }
        // Retriable failures are not journaled: a redelivery must try again.
        if outcome.success || !outcome.retriable {
            if let Err(e) = self.journal.put(&a.idempotency_key, &outcome) {
                tracing::error!(error = %ErrorChain(&e), "could not journal the outcome");
            }
        }
        Some(outcome)
    }

    /// The lease the executor confirms before irreversible steps: with side effects, the start
    /// handshake; a read-only task has nothing irreversible to fence.
    fn lease(&self, a: &AgentTaskAssignment, generation: &str) -> Option<Arc<DeliveryLease>> {
        a.side_effects.then(|| {
            Arc::new(DeliveryLease::new(
                self.link.clone(),
                generation,
                self.agent_id,
                a,
            ))
        })
    }

    async fn execute(
        &self,
        a: &AgentTaskAssignment,
        opened: &SealedAssignment,
        cancel: CancellationToken,
        lease: Lease,
    ) -> Outcome {
        let payload = match serde_json::from_str(&opened.payload) {
            Ok(p) => p,
            Err(e) => {
                return Outcome::failed(
                    error_types::INVALID_PAYLOAD,
                    format!("the payload is not JSON: {e}"),
                    false,
                )
            }
        };
        let Some(executor) = TaskKind::parse(&a.task_type).and_then(|k| self.executors.get(&k))
        else {
            return Outcome::failed(
                error_types::UNSUPPORTED_TASK_TYPE,
                format!("this agent has no executor for {:?}", a.task_type),
                false,
            );
        };
        let timeout = transport::parse_timespan(&a.timeout).unwrap_or(Duration::from_secs(300));
        let task = Task {
            task_id: a.task_id.0,
            task_type: a.task_type.clone(),
            payload,
            credentials: opened.credentials.clone(),
            variables: a.variables.clone(),
            timeout,
            cancel: cancel.clone(),
            lease,
        };
        let work = executor.execute(&task);
        tokio::pin!(work);
        let stopped = tokio::select! {
            outcome = &mut work => return outcome,
            _ = tokio::time::sleep(timeout) => Outcome::failed(
                error_types::TIMEOUT,
                format!("the task ran past its timeout of {timeout:?} and was stopped"),
                !a.side_effects,
            ),
            _ = cancel.cancelled() => Outcome::failed(error_types::CANCELLED, "cancelled by an operator", false),
        };
        // Let the executor clean up (it sees the token), then drop it: dropping kills its
        // child processes.
        cancel.cancel();
        match tokio::time::timeout(CLEANUP_GRACE, &mut work).await {
            Ok(cleaned) if stopped.error_type.as_deref() == Some(error_types::CANCELLED) => cleaned,
            Ok(cleaned) => Outcome {
                logs: cleaned.logs,
                ..stopped
            },
            Err(_) => stopped,
        }
    }

    /// Builds, signs and sends the result envelope; retries while the server is unreachable.
    /// Each attempt is signed with the key of the link it goes out on: the server verifies the
    /// signature with that connection's certificate.
    async fn report(
        &self,
        a: &AgentTaskAssignment,
        outcome: &Outcome,
        started_at: OffsetDateTime,
        took: Duration,
        session: &HeldSession,
    ) {
        let envelope = match unsigned_envelope(
            self.agent_id,
            a,
            outcome,
            started_at,
            took,
            &session.server_key,
        ) {
            Ok(envelope) => envelope,
            Err(e) => {
                tracing::error!(error = %e, "could not build the result");
                return;
            }
        };
        let headers = [(GENERATION_HEADER, session.generation.as_str())];
        let (envelope, headers) = (&envelope, &headers);
        match with_link_retries("result", self.retry_budget, &self.link, |link| async move {
            // Signing with a key we hold does not fail; if it did, nothing could be sent.
            let submit = sign(envelope, &link.key).map_err(ClientError::Config)?;
            link.client
                .send_with(&SubmitResult::new(submit), headers, None)
                .await
        })
        .await
        {
            Ok(ack) => {
                tracing::info!(state = %ack.state, duplicate = ack.duplicate, "result accepted")
            }
            Err(e) => tracing::warn!(error = %ErrorChain(&e), "result not accepted"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::Link;
    use berth_crypto::hpke;
    use berth_proto::transport::{ASSIGNMENT_SEAL_INFO, SEAL_ALG};
    use berth_proto::{AssignmentId, TaskId};
    use std::io::Write;

    fn runner(dir: &std::path::Path) -> Runner {
        let client = crate::link::client(
            "https://127.0.0.1:9",
            berth_client::Trust::CaFingerprint(format!("sha256:{}", "0".repeat(64))),
            None,
        )
        .unwrap();
        let key = berth_crypto::AgentKey::generate().unwrap();
        let link = SharedLink::new(Link {
            client,
            opener: Arc::new(RecipientKey::from_pkcs8_pem(&key.to_pem()).unwrap()),
            key: Arc::new(key),
            at: 0,
        });
        let config = AgentConfig {
            allow_commands: vec!["/bin/sleep".into()],
            ..AgentConfig::new(dir.to_path_buf())
        };
        Runner::new(
            AgentId(uuid::Uuid::new_v4()),
            link,
            &config,
            Capabilities::default(),
        )
        .unwrap()
    }

    fn session() -> HeldSession {
        HeldSession {
            generation: "7".into(),
            server_key: RecipientKey::generate().unwrap().public_key().clone(),
        }
    }

    fn assignment(task_type: &str, payload: &str, timeout: &str) -> AgentTaskAssignment {
        AgentTaskAssignment {
            contract_version: CONTRACT_VERSION.into(),
            assignment_id: AssignmentId(uuid::Uuid::new_v4()),
            task_id: TaskId(uuid::Uuid::new_v4()),
            agent_id: AgentId(uuid::Uuid::new_v4()),
            required_capability: "agent".into(),
            task_type: task_type.into(),
            payload: payload.into(),
            credentials: Default::default(),
            sealed: None,
            variables: Default::default(),
            assigned_at: OffsetDateTime::now_utc(),
            timeout: timeout.into(),
            idempotency_key: "k".into(),
            expires_at: OffsetDateTime::now_utc(),
            side_effects: false,
        }
    }

    #[tokio::test]
    async fn dispatch_goes_through_the_kind_table() {
        let dir = tempfile::tempdir().unwrap();
        let runner = runner(dir.path());
        let shared = &runner.shared;
        for kind in TaskKind::ALL {
            assert!(
                shared.executors.contains_key(&kind),
                "no executor for {kind}"
            );
        }
        let run = |a: AgentTaskAssignment| async move {
            let opened = SealedAssignment {
                payload: a.payload.clone(),
                credentials: Default::default(),
            };
            shared
                .execute(&a, &opened, CancellationToken::new(), Lease::unfenced())
                .await
        };
        let o = run(assignment("docker.exec", "{}", "00:00:10")).await;
        assert_eq!(
            o.error_type.as_deref(),
            Some(error_types::UNSUPPORTED_TASK_TYPE)
        );
        let o = run(assignment("write-sticker", "{not json", "00:00:10")).await;
        assert_eq!(o.error_type.as_deref(), Some(error_types::INVALID_PAYLOAD));
        let o = run(assignment(
            "write-sticker",
            r#"{"name": "web"}"#,
            "00:00:10",
        ))
        .await;
        assert!(o.success, "{o:?}");
        let o = run(assignment("read-sticker", r#"{"name": "web"}"#, "00:00:10")).await;
        assert_eq!(o.outputs["sticker"]["name"], "web");
        // A command that outlives its timeout is stopped by the agent.
        let o = run(assignment(
            "execute-command",
            r#"{"command": ["/bin/sleep", "5"]}"#,
            "00:00:00.2000000",
        ))
        .await;
        assert_eq!(o.error_type.as_deref(), Some(error_types::TIMEOUT), "{o:?}");
        assert!(o.retriable, "a read-only task that timed out may run again");
    }

    /// `a` with `clear` sealed as the server seals it, to `to` for the assignment `aad`.
    fn sealed(
        mut a: AgentTaskAssignment,
        to: &RecipientKey,
        aad: AssignmentId,
    ) -> AgentTaskAssignment {
        let clear = serde_json::to_vec(&SealedAssignment {
            payload: a.payload.clone(),
            credentials: [("token".to_string(), "s3cr3t".to_string())].into(),
        })
        .unwrap();
        let boxed = hpke::seal(
            hpke::Aead::Aes256Gcm,
            to.public_key(),
            ASSIGNMENT_SEAL_INFO,
            aad.to_string().as_bytes(),
            &clear,
        )
        .unwrap();
        let (enc, ciphertext) = boxed.to_base64();
        a.payload = String::new();
        a.sealed = Some(transport::SealedBox {
            alg: SEAL_ALG.into(),
            enc,
            ciphertext,
        });
        a
    }

    #[test]
    fn only_this_agents_key_opens_only_this_assignment() {
        let mine = RecipientKey::generate().unwrap();
        let a = assignment("write-sticker", r#"{"name": "web"}"#, "00:00:10");
        let id = a.assignment_id;
        let opened = open_assignment(&sealed(a.clone(), &mine, id), &mine).unwrap();
        assert_eq!(opened.payload, r#"{"name": "web"}"#);
        assert_eq!(opened.credentials["token"], "s3cr3t");

        // Another agent's key, a box sealed for another assignment (replayed into this one),
        // a changed byte, another suite, no box at all: nothing opens.
        let other = RecipientKey::generate().unwrap();
        assert!(open_assignment(&sealed(a.clone(), &other, id), &mine).is_err());
        let replayed = sealed(a.clone(), &mine, AssignmentId(uuid::Uuid::new_v4()));
        assert!(open_assignment(&replayed, &mine).is_err());
        let mut tampered = sealed(a.clone(), &mine, id);
        let boxed = tampered.sealed.as_mut().unwrap();
        let mut ct = base64::Engine::decode(
            &base64::engine::general_purpose::STANDARD,
            &boxed.ciphertext,
        )
        .unwrap();
        ct[3] ^= 0x80;
        boxed.ciphertext = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, ct);
        assert!(open_assignment(&tampered, &mine).is_err());
        let mut other_suite = sealed(a.clone(), &mine, id);
        other_suite.sealed.as_mut().unwrap().alg = "none".into();
        assert!(open_assignment(&other_suite, &mine).is_err());
        assert!(open_assignment(&a, &mine).is_err());
    }

    #[tokio::test]
    async fn an_unopenable_assignment_runs_nothing_and_fails_with_its_code() {
        let dir = tempfile::tempdir().unwrap();
        let runner = runner(dir.path());
        let stranger = RecipientKey::generate().unwrap();
        let a = assignment("write-sticker", r#"{"name": "web"}"#, "00:00:10");
        let id = a.assignment_id;
        let a = sealed(a, &stranger, id);
        let opener = runner.shared.link.current().opener;
        let o = runner
            .shared
            .outcome(&a, &opener, CancellationToken::new(), &session())
            .await
            .unwrap();
        assert_eq!(
            o.error_type.as_deref(),
            Some(error_types::PAYLOAD_UNSEALABLE)
        );
        assert!(!o.retriable);
        // Nothing ran: no sticker was written, and nothing was journaled.
        let stickers = std::fs::read_dir(dir.path().join("stickers")).map_or(0, |d| d.count());
        assert_eq!(stickers, 0);
        assert!(runner.shared.journal.get(&a.idempotency_key).is_none());
    }

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn every_line_of_a_delivery_names_the_task() {
        let captured = Captured::default();
        let writer = captured.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        let a = assignment("inspect", "{}", "00:00:10");
        let agent = AgentId(uuid::Uuid::new_v4());
        tracing::subscriber::with_default(subscriber, || {
            let _entered = delivery_span(agent, "7", &a).entered();
            tracing::info!("task received");
        });
        let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
        for field in [
            format!("task_id={}", a.task_id),
            format!("agent_id={agent}"),
            format!("assignment_id={}", a.assignment_id),
            "generation=7".to_string(),
            "task_type=inspect".to_string(),
        ] {
            assert!(text.contains(&field), "{field} missing in {text}");
        }
    }
}
