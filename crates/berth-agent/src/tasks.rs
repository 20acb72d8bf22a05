//! The task side of the agent: long-poll for assignments, run each with its executor under the
//! task's timeout and cancellation, journal the outcome, and send a signed result.
//!
//! The agent never decides that a task succeeded by itself: it reports what the executor said,
//! signed with its key, and the server decides what that means for the task.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use berth_exec::builtin::{ExecuteCommand, HealthCheck, Inspect, Stickers};
use berth_exec::sticker::StickerStore;
use berth_exec::{ComposeExecutor, DockerExecutor, Executor, Outcome, Task};
use berth_proto::result::TaskResult;
use berth_proto::transport::{
    self, AgentTaskAssignment, AgentTaskPollRequest, AgentTaskResultEnvelope, SubmitResult,
    CONTRACT_VERSION, GENERATION_HEADER,
};
use berth_proto::{AgentId, AssignmentId};
use time::OffsetDateTime;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::journal::Journal;
use crate::run::{current, with_retries, AgentConfig, SharedLink};
use crate::AgentError;

/// A poll waits at most 25 s on the server; the client allows a little more.
const POLL_TIMEOUT: Duration = Duration::from_secs(35);
/// After cancelling or timing out, how long an executor gets to clean up before it is dropped.
const CLEANUP_GRACE: Duration = Duration::from_secs(30);

struct Shared {
    agent_id: AgentId,
    generation: String,
    link: SharedLink,
    executors: Vec<Arc<dyn Executor>>,
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
        capabilities: Arc<Mutex<serde_json::Value>>,
    ) -> Result<Runner, AgentError> {
        let stickers = StickerStore::new(
            config
                .sticker_dir
                .clone()
                .unwrap_or_else(|| config.state_dir.join("stickers")),
        );
        let docker = Arc::new(DockerExecutor::new(stickers.clone()));
        let executors: Vec<Arc<dyn Executor>> = vec![
            Arc::new(HealthCheck),
            Arc::new(Stickers(stickers.clone())),
            docker.clone(),
            Arc::new(ComposeExecutor::new(stickers.clone())),
            Arc::new(Inspect {
                stickers,
                capabilities,
                docker: Some(docker),
            }),
            Arc::new(ExecuteCommand {
                allowed: config.allow_commands.clone(),
            }),
        ];
        Ok(Runner {
            shared: Arc::new(Shared {
                agent_id,
                generation: generation.to_string(),
                link,
                executors,
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
        let capabilities: Vec<String> = self
            .shared
            .executors
            .iter()
            .flat_map(|e| e.task_types().iter().map(|t| t.to_string()))
            .collect();
        let request = AgentTaskPollRequest {
            contract_version: CONTRACT_VERSION.into(),
            agent_id: self.shared.agent_id,
            capabilities,
        };
        loop {
            let permit = self
                .slots
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| AgentError::Fatal("task slots closed".into()))?;
            let known = self.known_cancellations();
            let client = current(&self.shared.link).client;
            let headers = [
                (GENERATION_HEADER, self.shared.generation.as_str()),
                ("x-berth-known-cancellations", known.as_str()),
            ];
            let response = with_retries("task poll", self.shared.retry_budget, || {
                client.send_with(&request, &headers, Some(POLL_TIMEOUT))
            })
            .await?;
            for c in &response.cancellations {
                self.cancel(c.assignment_id);
            }
            if let Some(assignment) = response.assignment {
                let shared = self.shared.clone();
                self.tracker.spawn(async move {
                    let _permit = permit;
                    shared.handle(assignment).await;
                });
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

    fn cancel(&self, assignment: AssignmentId) {
        let running = self
            .shared
            .running
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(token) = running.get(&assignment) {
            tracing::info!(%assignment, "cancelling a running task");
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

impl Shared {
    async fn handle(&self, a: AgentTaskAssignment) {
        let started = Instant::now();
        let token = CancellationToken::new();
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(a.assignment_id, token.clone());
        let outcome = match self.journal.get(&a.idempotency_key) {
            Some(recorded) => {
                tracing::info!(task_id = %a.task_id, "redelivered task already completed; answering from the journal");
                recorded
            }
            None => {
                let outcome = self.execute(&a, token).await;
                // Retriable failures are not journaled: a redelivery must try again.
                if outcome.success || !outcome.retriable {
                    if let Err(e) = self.journal.put(&a.idempotency_key, &outcome) {
                        tracing::error!(task_id = %a.task_id, error = %e, "could not journal the outcome");
                    }
                }
                outcome
            }
        };
        tracing::info!(task_id = %a.task_id, task_type = %a.task_type, success = outcome.success, error = ?outcome.error_type, "task finished");
        self.report(&a, &outcome, started.elapsed()).await;
        self.running
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&a.assignment_id);
    }

    async fn execute(&self, a: &AgentTaskAssignment, cancel: CancellationToken) -> Outcome {
        let payload = match serde_json::from_str(&a.payload) {
            Ok(p) => p,
            Err(e) => {
                return Outcome::failed(
                    "INVALID_PAYLOAD",
                    format!("the payload is not JSON: {e}"),
                    false,
                )
            }
        };
        let Some(executor) = self
            .executors
            .iter()
            .find(|e| e.task_types().contains(&a.task_type.as_str()))
        else {
            return Outcome::failed(
                "UNSUPPORTED_TASK_TYPE",
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
        };
        let work = executor.execute(&task);
        tokio::pin!(work);
        let stopped = tokio::select! {
            outcome = &mut work => return outcome,
            _ = tokio::time::sleep(timeout) => Outcome::failed(
                "TIMEOUT",
                format!("the task ran past its timeout of {timeout:?} and was stopped"),
                !a.side_effects,
            ),
            _ = cancel.cancelled() => Outcome::failed("CANCELLED", "cancelled by an operator", false),
        };
        // Let the executor clean up (it sees the token), then drop it: dropping kills its
        // child processes.
        cancel.cancel();
        match tokio::time::timeout(CLEANUP_GRACE, &mut work).await {
            Ok(cleaned) if stopped.error_type.as_deref() == Some("CANCELLED") => cleaned,
            Ok(cleaned) => Outcome {
                logs: cleaned.logs,
                ..stopped
            },
            Err(_) => stopped,
        }
    }

    /// Builds, signs and sends the result envelope; retries while the server is unreachable.
    async fn report(&self, a: &AgentTaskAssignment, outcome: &Outcome, duration: Duration) {
        let link = current(&self.link);
        let completed_at = OffsetDateTime::now_utc();
        let result = TaskResult {
            task_id: a.task_id,
            success: outcome.success,
            started_at: completed_at - duration,
            completed_at,
            outputs: outcome.outputs.clone(),
            artifacts: Vec::new(),
            error: (!outcome.success).then(|| outcome.message.clone()),
            error_type: outcome.error_type.clone(),
            retriable: outcome.retriable,
            logs: outcome.logs.clone(),
            metrics: Default::default(),
        };
        let result_data = match serde_json::to_string(&result) {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(error = %e, "could not encode the result");
                return;
            }
        };
        let mut envelope = AgentTaskResultEnvelope {
            contract_version: CONTRACT_VERSION.to_string(),
            agent_id: self.agent_id,
            task_id: a.task_id,
            assignment_id: Some(a.assignment_id),
            success: outcome.success,
            message: Some(outcome.message.clone()),
            result_data: Some(result_data),
            duration: transport::format_timespan(duration),
            completed_at,
            signature_algorithm: transport::ALG_ECDSA_SHA256.to_string(),
            signature: None,
        };
        let signature = envelope
            .signing_input()
            .map_err(|e| e.to_string())
            .and_then(|bytes| link.key.sign(&bytes).map_err(|e| e.to_string()));
        match signature {
            Ok(sig) => {
                envelope.signature = Some(base64::engine::general_purpose::STANDARD.encode(sig));
            }
            Err(e) => {
                tracing::error!(error = %e, "could not sign the result");
                return;
            }
        }
        let submit = SubmitResult::new(envelope);
        let headers = [(GENERATION_HEADER, self.generation.as_str())];
        match with_retries("result", self.retry_budget, || {
            link.client.send_with(&submit, &headers, None)
        })
        .await
        {
            Ok(ack) => {
                tracing::debug!(task_id = %a.task_id, state = %ack.state, duplicate = ack.duplicate, "result accepted")
            }
            Err(e) => tracing::warn!(task_id = %a.task_id, error = %e, "result not accepted"),
        }
    }
}
