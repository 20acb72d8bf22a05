//! What every deployment run shares: its log, its stop signal (cancellation or the task's time
//! budget) and the conversion of its result into a redacted [`Outcome`]. This module owns the one
//! place where secrets are scrubbed before an outcome leaves the executor.

use std::future::Future;
use std::time::Duration;

use berth_proto::result::TaskMetrics;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::ExecError;
use crate::redact::redact;
use crate::{Outcome, Task};

/// The outcome's log is capped so a chatty hook cannot blow up the signed result.
const MAX_LOG_BYTES: usize = 256 * 1024;

/// Timestamped lines of what a run did. Redacted once, in [`Run::finish`].
#[derive(Debug)]
pub(crate) struct Log {
    started: Instant,
    text: String,
    truncated: bool,
}

impl Log {
    pub fn new() -> Log {
        Log {
            started: Instant::now(),
            text: String::new(),
            truncated: false,
        }
    }

    /// The lines so far, unredacted: the caller redacts before they leave the executor.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn line(&mut self, line: impl AsRef<str>) {
        if self.truncated {
            return;
        }
        let elapsed = self.started.elapsed().as_secs_f64();
        let entry = format!("[{elapsed:8.3}s] {}\n", line.as_ref());
        if self.text.len() + entry.len() > MAX_LOG_BYTES {
            self.text.push_str("… log truncated\n");
            self.truncated = true;
            return;
        }
        self.text.push_str(&entry);
    }
}

/// Why a run must stop early: the operator cancelled it, or its time budget ran out. Cheap to
/// clone; cleanup after a stop uses [`Stop::cleanup`], which nobody can cancel.
#[derive(Debug, Clone)]
pub(crate) struct Stop {
    cancel: CancellationToken,
    deadline: Instant,
}

impl Stop {
    /// The budget is the task timeout less a margin, so that a run that hits it still has time
    /// to clean up (roll back) before the agent gives up on the whole task.
    pub fn for_task(task: &Task) -> Stop {
        let margin = (task.timeout / 10).min(Duration::from_secs(30));
        Stop {
            cancel: task.cancel.clone(),
            deadline: Instant::now() + task.timeout.saturating_sub(margin),
        }
    }

    /// A stop signal for cleanup work: never cancelled, only bounded in time.
    pub fn cleanup(budget: Duration) -> Stop {
        Stop {
            cancel: CancellationToken::new(),
            deadline: Instant::now() + budget,
        }
    }

    /// `Err` once the run must stop.
    pub fn check(&self) -> Result<(), ExecError> {
        if self.cancel.is_cancelled() {
            Err(ExecError::Cancelled)
        } else if Instant::now() >= self.deadline {
            Err(ExecError::TimedOut)
        } else {
            Ok(())
        }
    }

    /// Resolves when the run must stop, with the reason.
    pub async fn stopped(&self) -> ExecError {
        tokio::select! {
            _ = self.cancel.cancelled() => ExecError::Cancelled,
            _ = tokio::time::sleep_until(self.deadline) => ExecError::TimedOut,
        }
    }

    /// Runs `fut` unless the run is stopped first; dropping `fut` aborts it (an engine request,
    /// a pull stream).
    pub async fn guard<T>(
        &self,
        fut: impl Future<Output = Result<T, ExecError>>,
    ) -> Result<T, ExecError> {
        self.check()?;
        tokio::select! {
            r = fut => r,
            e = self.stopped() => Err(e),
        }
    }

    /// Time left before the deadline.
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

/// The pieces of an outcome a run collects as it goes.
#[derive(Debug)]
pub(crate) struct Run<'t> {
    pub task: &'t Task,
    pub log: Log,
    pub stop: Stop,
    pub metrics: TaskMetrics,
    pub outputs: serde_json::Map<String, serde_json::Value>,
}

impl<'t> Run<'t> {
    pub fn new(task: &'t Task) -> Run<'t> {
        Run {
            task,
            log: Log::new(),
            stop: Stop::for_task(task),
            metrics: TaskMetrics::default(),
            outputs: serde_json::Map::new(),
        }
    }

    /// Right before an irreversible step: the run must not be stopped, and the delivery's lease
    /// must still hold (see [`crate::Lease`]).
    pub async fn confirm_lease(&mut self, step: &str) -> Result<(), ExecError> {
        self.stop.check()?;
        self.task.lease.confirm(None).await?;
        self.log.line(format!("lease confirmed before {step}"));
        Ok(())
    }

    /// Reports the step a deployment is entering (`pulling`, `starting`, `health`) with a
    /// confirmation of the lease: a delivery that lost it stops here.
    pub async fn enter(
        &mut self,
        phase: berth_proto::transport::ProgressPhase,
    ) -> Result<(), ExecError> {
        self.stop.check()?;
        self.task.lease.confirm(Some(phase)).await
    }

    pub fn output(&mut self, key: &str, value: impl Into<serde_json::Value>) {
        self.outputs.insert(key.to_string(), value.into());
    }

    /// The outcome, with every credential value masked in its message, logs and outputs.
    pub fn finish(mut self, result: Result<String, ExecError>) -> Outcome {
        let mut outcome = match result {
            Ok(message) => {
                self.log.line(&message);
                Outcome::ok(message)
            }
            Err(e) => {
                let message = e.chain();
                self.log.line(format!("failed ({}): {message}", e.code()));
                Outcome::failed(e.code(), message, e.retriable())
            }
        };
        let creds = &self.task.credentials;
        outcome.message = redact(&outcome.message, creds.values());
        outcome.logs = redact(&self.log.text, creds.values());
        outcome.metrics = self.metrics;
        outcome.outputs = self
            .outputs
            .into_iter()
            .map(|(k, v)| (k, redact_value(v, creds)))
            .collect();
        outcome
    }
}

fn redact_value(
    value: serde_json::Value,
    creds: &std::collections::BTreeMap<String, String>,
) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(s) => Value::String(redact(&s, creds.values())),
        Value::Array(a) => Value::Array(a.into_iter().map(|v| redact_value(v, creds)).collect()),
        Value::Object(o) => Value::Object(
            o.into_iter()
                .map(|(k, v)| (k, redact_value(v, creds)))
                .collect(),
        ),
        other => other,
    }
}

/// Milliseconds since `start`, for [`TaskMetrics`].
pub(crate) fn millis_since(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}
