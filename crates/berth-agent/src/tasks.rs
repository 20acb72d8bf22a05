//! The task side of the agent: long-poll for assignments, run each with its executor under the
//! task's timeout and cancellation, journal the outcome, and send a signed result.
//!
//! The agent never decides that a task succeeded by itself: it reports what the executor said,
//! signed with its key, and the server decides what that means for the task.

use berth_client::ClientError;
use berth_proto::error::ErrorChain;
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    self, AgentTaskAssignment, AgentTaskCancellation, AgentTaskPollRequest, SubmitResult,
    CONTRACT_VERSION,
};
use berth_proto::{AgentId, AssignmentId};
use time::OffsetDateTime;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::artifacts::ServerArtifacts;
use crate::config::AgentConfig;
use crate::journal::Journal;
use crate::link::SharedLink;
use crate::report::{sign, unsigned_envelope};
use crate::retry::with_link_retries;
use crate::start::{check_expiry, DeliveryLease};
use crate::AgentError;

/// A poll waits at most 25 s on the server; the client allows a little more.
const POLL_TIMEOUT: Duration = Duration::from_secs(35);
/// After cancelling or timing out, how long an executor gets to clean up before it is dropped.
const CLEANUP_GRACE: Duration = Duration::from_secs(30);

struct Shared {
    agent_id: AgentId,
    generation: String,
    link: SharedLink,
    /// The executor of each task kind this agent runs.
    executors: HashMap<TaskKind, Arc<dyn Executor>>,
    /// What polls offer, kept current by the heartbeat loop.
    capabilities: Capabilities,
    journal: Journal,
    retry_budget: Duration,
    /// Running assignments and the tokens that stop them.
    running: Mutex<HashMap<AssignmentId, CancellationToken>>,
    /// Cancellations already received, echoed to the server so it does not resend them.
    known_cancellations: Mutex<BTreeSet<AssignmentId>>,
}

pub struct Runner {
    shared: Arc<Shared>,
    slots: Arc<Semaphore>,
    tracker: TaskTracker,
}

impl Runner {
    pub fn new(
        agent_id: AgentId,
        generation: i64,
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
            Arc::new(berth_exec::readiness::ReadinessProbe),
        ];
        let executors = executors
            .into_iter()
            .flat_map(|e| e.task_types().iter().map(move |&kind| (kind, e.clone())))
            .collect();
        Ok(Runner {
            shared: Arc::new(Shared {
                agent_id,
                generation: generation.to_string(),
                link,
                executors,
                capabilities,
                journal: Journal::open(config.state_dir.join("journal"))?,
                retry_budget: config.retry_budget,
                running: Mutex::new(HashMap::new()),
                known_cancellations: Mutex::new(BTreeSet::new()),
            }),
            slots: Arc::new(Semaphore::new(config.max_concurrent_tasks.max(1))),
            tracker: TaskTracker::new(),
        })
    }

    /// Polls until a failure ends the agent (fenced, revoked, retry budget spent).
    pub async fn poll_loop(&self) -> Result<(), AgentError> {
        loop {
            // Seed capability strings of what this host has (see `Capabilities::offered`).
            let request = AgentTaskPollRequest {
                contract_version: CONTRACT_VERSION.into(),
                agent_id: self.shared.agent_id,
                capabilities: self.shared.capabilities.offered(),
                start_handshake: true,
            };
            let permit = self
                .slots
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| AgentError::Fatal("task slots closed".into()))?;
            let known = self.known_cancellations();
            let headers = [
                (GENERATION_HEADER, self.shared.generation.as_str()),
                (KNOWN_CANCELLATIONS_HEADER, known.as_str()),
            ];
            let (request, headers) = (&request, &headers);
            let response = with_link_retries(
                "task poll",
                self.shared.retry_budget,
                &self.shared.link,
                |link| async move {
                    link.client
                        .send_with(request, headers, Some(POLL_TIMEOUT))
                        .await
                },
            )
            .await?;
            for c in &response.cancellations {
                self.cancel(c);
            }
            if let Some(assignment) = response.assignment {
                // One span per delivery: with RUST_LOG=info every line of this task's path
                // (journal, executor, result) carries these fields.
                let span =
                    delivery_span(self.shared.agent_id, &self.shared.generation, &assignment);
                let shared = self.shared.clone();
                self.tracker.spawn(
                    async move {
                        let _permit = permit;
                        shared.handle(assignment).await;
                    }
                    .instrument(span),
                );
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
        if let Some(token) = running.get(&assignment) {
            tracing::info!(task_id = %c.task_id, assignment_id = %assignment, agent_id = %self.shared.agent_id, "cancelling a running task");
            token.cancel();
            self.shared
                .known_cancellations
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(assignment);
        }
    }

    /// Stops taking work; waits up to `grace` for running tasks, then cancels what is left.
    pub async fn stop(&self, grace: Duration) {
        self.tracker.close();
        if tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_err()
            || grace.is_zero()
        {
            for token in self
                .shared
                .running
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .values()
            {
                token.cancel();
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), self.tracker.wait()).await;
        }
    }
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
    async fn handle(&self, a: AgentTaskAssignment) {
        let started = Instant::now();
        let started_at = OffsetDateTime::now_utc();
        tracing::info!(side_effects = a.side_effects, timeout = %a.timeout, "task received");
        let token = CancellationToken::new();
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(a.assignment_id, token.clone());
        if let Some(outcome) = self.outcome(&a, token).await {
            tracing::info!(success = outcome.success, error = ?outcome.error_type, "task finished");
            self.report(&a, &outcome, started_at, started.elapsed())
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
    async fn outcome(&self, a: &AgentTaskAssignment, token: CancellationToken) -> Option<Outcome> {
        if let Some(recorded) = self.journal.get(&a.idempotency_key) {
            tracing::info!("redelivered task already completed; answering from the journal");
            return Some(recorded);
        }
        let lease = self.lease(a);
        let refused = match &lease {
            Some(lease) => lease.confirm(None).await,
            None => check_expiry(a.expires_at),
        };
        if let Err(why) = refused {
            tracing::warn!(%why, "not running the task: the delivery is no longer ours");
            return None;
        }
        let lease = lease.map_or_else(Lease::unfenced, |l| Lease::new(l));
        let outcome = self.execute(a, token, lease).await;
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
    fn lease(&self, a: &AgentTaskAssignment) -> Option<Arc<DeliveryLease>> {
        a.side_effects.then(|| {
            Arc::new(DeliveryLease::new(
                self.link.clone(),
                &self.generation,
                self.agent_id,
                a,
            ))
        })
    }

    async fn execute(
        &self,
        a: &AgentTaskAssignment,
        cancel: CancellationToken,
        lease: Lease,
    ) -> Outcome {
        let payload = match serde_json::from_str(&a.payload) {
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
            credentials: a.credentials.clone(),
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
    ) {
        let envelope = match unsigned_envelope(self.agent_id, a, outcome, started_at, took) {
            Ok(envelope) => envelope,
            Err(e) => {
                tracing::error!(error = %e, "could not build the result");
                return;
            }
        };
        let headers = [(GENERATION_HEADER, self.generation.as_str())];
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
    use berth_proto::{AssignmentId, TaskId};
    use std::io::Write;

    fn runner(dir: &std::path::Path) -> Runner {
        let client = crate::link::client(
            "https://127.0.0.1:9",
            berth_client::Trust::CaFingerprint(format!("sha256:{}", "0".repeat(64))),
            None,
        )
        .unwrap();
        let link = SharedLink::new(Link {
            client,
            key: Arc::new(berth_crypto::AgentKey::generate().unwrap()),
        });
        let config = AgentConfig {
            allow_commands: vec!["/bin/sleep".into()],
            ..AgentConfig::new(dir.to_path_buf())
        };
        Runner::new(
            AgentId(uuid::Uuid::new_v4()),
            7,
            link,
            &config,
            Capabilities::default(),
        )
        .unwrap()
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
            shared
                .execute(&a, CancellationToken::new(), Lease::unfenced())
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
