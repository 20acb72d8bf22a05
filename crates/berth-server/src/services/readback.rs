//! Read-back: when a task with side effects loses its lease, nobody knows whether it ran. Instead
//! of running it again, the control plane asks the target what is there — a `read-sticker` task —
//! and marks the task `succeeded` (read-back) only if the sticker proves the intended state.
//!
//! Both steps are idempotent, and both are driven by the read-back sweep in `reconcile.rs`,
//! which finds every `unknown` task without a read-back and every succeeded read-back not yet
//! applied: the calls right after a lease expiry and in the result handler are only fast paths,
//! and a crash between the steps delays the work by one sweep.

use berth_proto::error::ErrorChain;
use berth_proto::kind::TaskKind;
use berth_proto::payload::ReadStickerPayload;
use berth_proto::TaskId;
use berth_store::{Task, TaskState};
use serde_json::{json, Value};

use crate::services::tasks::{Origin, Placed, Placement, TaskRequest};
use crate::SharedState;

/// The sticker a task of this type writes when it completes, by name (the task kind table).
pub fn intended_sticker(task: &Task) -> Option<String> {
    TaskKind::parse(&task.task_type)?.read_back_sticker(&task.payload)
}

/// Queues a read-back for an `unknown` task, ahead of the agent's other work. Idempotent: the
/// read-back key names the lost delivery, so a second call finds the first read-back.
pub async fn schedule(state: &SharedState, task: &Task) {
    let Some(name) = intended_sticker(task) else {
        tracing::warn!(task_id = %task.id, task_type = %task.task_type, "task is unknown and has no sticker to read back; an operator must retry or cancel it");
        return;
    };
    let kind = TaskKind::parse(&task.task_type);
    let mut payload = match kind.and_then(|k| k.read_back_volume(&task.payload)) {
        // The sticker is in a Docker volume: read it there.
        Some(volume) => serde_json::to_value(ReadStickerPayload::in_volume(&name, volume))
            .unwrap_or_else(|_| json!({ "name": name })),
        None => json!({ "name": name }),
    };
    let mut credentials = None;
    if kind == Some(TaskKind::SshDeploy) {
        // The sticker is on the SSH target: read it there, with the deploy's own key.
        payload["sshTarget"] = task.payload["target"].clone();
        payload["deployDirectory"] = task.payload["deployDirectory"].clone();
        if let Some(sealed) = &task.credentials_sealed {
            match crate::services::tasks::open_credentials(&state.master_key, sealed, task.id) {
                Ok(clear) => credentials = Some(clear),
                Err(e) => {
                    tracing::error!(task_id = %task.id, error = %ErrorChain(&*e), "read-back: the task's credentials cannot be opened");
                    return;
                }
            }
        }
    }
    let request = TaskRequest {
        tenant: task.tenant_id,
        kind: TaskKind::ReadSticker,
        // Where the task ran: only that host has its sticker.
        placement: Placement::Agent(task.agent_id),
        payload,
        credentials,
        variables: Default::default(),
        timeout_seconds: 30,
        // Ahead of the agent's other work.
        priority: i32::MAX,
        // One read-back per lost delivery: scheduling it again (the sweep) is harmless. Never
        // refused by a cordon or the cap: it resolves work the agent already had.
        origin: Origin::ReadBack {
            of: task.id,
            attempts: task.attempts,
        },
    };
    match crate::services::tasks::create(state, request).await {
        Ok(Ok(Placed::Created(rb))) => {
            tracing::info!(task_id = %task.id, read_back = %rb.id, sticker = %name, "task is unknown; reading back the target");
        }
        Ok(Ok(Placed::Existing(_))) => {}
        Ok(Err(refused)) => {
            tracing::warn!(task_id = %task.id, refused = ?refused, "the read-back was refused; the task stays unknown");
        }
        Err(e) => {
            tracing::error!(task_id = %task.id, error = %ErrorChain(&e), "could not schedule the read-back")
        }
    }
}

/// Decides an `unknown` task from its finished read-back. Idempotent: the store only moves a
/// task that is still `unknown`, and the evidence names the read-back, which the sweep checks.
pub async fn resolve(state: &SharedState, parent_id: TaskId, read_back: &Task) {
    if read_back.state != TaskState::Succeeded {
        return;
    }
    let parent = match state.store.get_task(read_back.tenant_id, parent_id).await {
        Ok(Some((parent, _))) => parent,
        Ok(None) => return,
        Err(e) => {
            tracing::error!(task_id = %parent_id, error = %ErrorChain(&e), "read-back: loading the task failed");
            return;
        }
    };
    let sticker = read_back
        .result
        .as_ref()
        .and_then(|r| r.pointer("/outputs/sticker"))
        .cloned()
        .unwrap_or(Value::Null);
    let found = proves(&parent, &sticker);
    let evidence = json!({ "readBackTaskId": read_back.id, "sticker": sticker, "found": found });
    match state
        .store
        .resolve_read_back(parent_id, found, evidence, state.config.clock.now())
        .await
    {
        Ok(Some(t)) => {
            tracing::info!(task_id = %t.id, state = t.state.as_str(), found, "read-back resolved")
        }
        Ok(None) => {}
        Err(e) => {
            tracing::error!(task_id = %parent_id, error = %ErrorChain(&e), "read-back: recording failed")
        }
    }
}

/// The sticker proves the task's intended state when the task itself wrote it, or when it names
/// the digest (and release, if any) the task was deploying.
fn proves(task: &Task, sticker: &Value) -> bool {
    if sticker.get("taskId").and_then(Value::as_str) == Some(&task.id.to_string()) {
        return true;
    }
    let intended_digest = task.payload.get("digest").and_then(Value::as_str);
    let intended_release = task
        .payload
        .pointer("/config/releaseId")
        .and_then(Value::as_str);
    match intended_digest {
        Some(digest) => {
            sticker.get("digest").and_then(Value::as_str) == Some(digest)
                && intended_release
                    .is_none_or(|r| sticker.get("releaseId").and_then(Value::as_str) == Some(r))
        }
        None => false,
    }
}
