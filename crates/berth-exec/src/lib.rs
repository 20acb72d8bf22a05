//! Task executors: the code that does what a task asks, on the agent's host or, over SSH, on a
//! host that runs no agent.
//!
//! An executor gets a [`Task`] and returns an [`Outcome`]; it never talks to the control plane,
//! never signs anything and never decides retries on its own (it says whether a failure is
//! retriable). Commands run as argument vectors, never through a shell, and every log line that
//! leaves an executor has the task's credential values redacted.

use berth_proto::transport::ProgressPhase;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use berth_proto::kind::{decode_payload, TaskKind};
use berth_proto::result::{error_types, TaskMetrics};
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

pub mod artifact;
pub mod builtin;
pub mod compose;
pub mod docker;
mod engine;
pub mod error;
pub mod hooks;
pub mod probe;
mod process;
pub mod readiness;
pub mod redact;
mod reference;
mod run;
pub mod ssh;
pub mod stack;
pub mod sticker;
pub mod upload;

pub use artifact::{ArtifactSource, FetchError};
pub use builtin::Capabilities;
pub use compose::ComposeExecutor;
pub use docker::DockerExecutor;
pub use engine::{
    CREDENTIAL_REGISTRY_PASSWORD, CREDENTIAL_REGISTRY_SERVER, CREDENTIAL_REGISTRY_USERNAME,
    LABEL_DEPLOYED_AT, LABEL_DIGEST, LABEL_IMAGE, LABEL_RELEASE_ID, LABEL_RELEASE_NAME,
};
pub use error::ExecError;
pub use ssh::{scan_host_key, SshExecutor};
pub use upload::UploadFiles;

/// One delivery of a task, as the executor sees it.
#[derive(Debug, Clone)]
pub struct Task {
    pub task_id: uuid::Uuid,
    /// `assignment.taskType`; an executor runs the [`TaskKind`]s it names in
    /// [`Executor::task_types`] and refuses anything else with `UNSUPPORTED_TASK_TYPE`.
    pub task_type: String,
    /// The decoded `assignment.payload`.
    pub payload: serde_json::Value,
    /// Secrets for this task (registry passwords…): never logged, never echoed in outcomes.
    pub credentials: BTreeMap<String, String>,
    pub variables: BTreeMap<String, String>,
    /// The executor must finish (or give up) within this time; the agent also enforces it.
    pub timeout: Duration,
    /// Cancelled when the operator cancels the task or the agent is fenced: stop, clean up,
    /// and return an outcome with `error_type: CANCELLED`.
    pub cancel: CancellationToken,
    /// Asked right before each irreversible step (the sticker write, the container swap, the
    /// compose `up`, a hook): the step is taken only while the delivery's lease holds.
    pub lease: Lease,
}

/// Whether a delivery's lease still holds: the agent asks its server (the start handshake).
#[async_trait::async_trait]
pub trait LeaseCheck: Send + Sync {
    /// `Err` with the reason once the lease is gone or cannot be confirmed. `phase`: the step
    /// the executor is about to take, recorded by the server for those who follow the task.
    async fn confirm(&self, phase: Option<ProgressPhase>) -> Result<(), String>;
}

/// The lease of one delivery, as executors see it.
#[derive(Clone)]
pub struct Lease(Option<Arc<dyn LeaseCheck>>);

impl Lease {
    pub fn new(check: Arc<dyn LeaseCheck>) -> Lease {
        Lease(Some(check))
    }

    /// A lease nobody can take away: for read-only tasks, which have nothing irreversible to
    /// fence, and for running an executor outside an agent (tests).
    pub fn unfenced() -> Lease {
        Lease(None)
    }

    /// `Err(LeaseLost)` unless the lease still holds; `phase` is reported with the question.
    pub async fn confirm(&self, phase: Option<ProgressPhase>) -> Result<(), ExecError> {
        match &self.0 {
            None => Ok(()),
            Some(check) => check.confirm(phase).await.map_err(ExecError::LeaseLost),
        }
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "Lease(fenced)"
        } else {
            "Lease(unfenced)"
        })
    }
}

/// What happened. The agent journals it as is and reports it as a
/// [`TaskResult`](berth_proto::result::TaskResult) inside the signed result envelope.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Outcome {
    pub success: bool,
    /// One line for people.
    pub message: String,
    /// Stable code for a failure: one of [`error_types`] (`TIMEOUT`, `CANCELLED`,
    /// `INVALID_PAYLOAD`, …) or an executor's own (`DIGEST_MISMATCH`, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error_type: Option<String>,
    /// Whether running the task again may succeed (registry down: yes; bad password: no).
    #[serde(default)]
    pub retriable: bool,
    #[serde(default)]
    pub outputs: serde_json::Map<String, serde_json::Value>,
    /// Redacted log of what the executor did.
    #[serde(default)]
    pub logs: String,
    #[serde(default)]
    pub metrics: TaskMetrics,
}

impl Outcome {
    pub fn ok(message: impl Into<String>) -> Outcome {
        Outcome {
            success: true,
            message: message.into(),
            ..Default::default()
        }
    }

    pub fn failed(error_type: &str, message: impl Into<String>, retriable: bool) -> Outcome {
        Outcome {
            success: false,
            message: message.into(),
            error_type: Some(error_type.to_string()),
            retriable,
            ..Default::default()
        }
    }

    pub fn with_output(mut self, key: &str, value: impl Into<serde_json::Value>) -> Outcome {
        self.outputs.insert(key.to_string(), value.into());
        self
    }

    pub fn with_logs(mut self, logs: String) -> Outcome {
        self.logs = logs;
        self
    }
}

/// Does one or more task types.
#[async_trait::async_trait]
pub trait Executor: Send + Sync {
    /// The task kinds this executor runs, e.g. `[DockerRun, Rollback]`. What each kind means
    /// (side effects, capability, payload type) is [`TaskKind::spec`]'s business, not the
    /// executor's.
    fn task_types(&self) -> &'static [TaskKind];

    /// Runs the task. Never panics on bad payloads: returns `INVALID_PAYLOAD`.
    async fn execute(&self, task: &Task) -> Outcome;
}

/// Parses the payload into the kind's payload type with [`decode_payload`] (as the server checks
/// it at create; `null` reads as `{}`), or a non-retriable `INVALID_PAYLOAD` outcome.
pub fn parse_payload<T: serde::de::DeserializeOwned>(task: &Task) -> Result<T, Box<Outcome>> {
    decode_payload(&task.payload).map_err(|e| {
        Box::new(Outcome::failed(
            error_types::INVALID_PAYLOAD,
            format!("the {} payload is invalid: {e}", task.task_type),
            false,
        ))
    })
}
