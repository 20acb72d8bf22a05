//! Dispatch: the long-poll that hands out assignments (sealed to the agent), and the start
//! handshake that confirms a lease is live before any side effect.

use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::Json;
use berth_proto::error::codes;
use berth_proto::headers::KNOWN_CANCELLATIONS_HEADER;
use berth_proto::kind::TaskKind;
use berth_proto::transport::{
    self, AgentTaskAssignment, AgentTaskCancellation, AgentTaskPollRequest, AgentTaskPollResponse,
    SealedAssignment, SealedBox, StartTask, TaskStarted, CONTRACT_VERSION,
};
use berth_proto::{AgentId, ErrorBody, TaskId};
use berth_store::{ClaimOutcome, StartAttempt, StartOutcome, Task};

use berth_crypto::hpke::{self, RecipientPublicKey};

use super::gate::{fenced, transport_enabled};
use super::results::check_contract;
use crate::http::auth::{binding_refused, FencedAgent};
use crate::http::extract::{ApiJson, ApiPath};
use crate::http::tls::PeerCertificate;
use crate::infra::error::{ApiError, ApiResult};
use crate::SharedState;

/// Long-poll for the next assignment (mTLS, with the generation). Answers as soon as one exists,
/// or with cancellations of running assignments, or empty after at most 25 s.
#[utoipa::path(post, path = "/api/v1/release-orchestrator/agent-runtime/agents/{agentId}/tasks:poll", tag = "agent-runtime",
    request_body = AgentTaskPollRequest, security(("agentCertificate" = [])),
    params(("agentId" = String, Path, format = Uuid), ("X-Berth-Generation" = i64, Header)),
    responses(
        (status = 200, body = AgentTaskPollResponse),
        (status = 422, body = ErrorBody, description = "UNSUPPORTED_CONTRACT_VERSION, AGENT_ID_MISMATCH, SEALING_KEY_UNSUPPORTED"),
        (status = 503, body = ErrorBody, description = "TRANSPORT_DISABLED"),
    ))]
pub async fn poll(
    State(state): State<SharedState>,
    FencedAgent {
        id,
        peer,
        generation,
    }: FencedAgent,
    headers: HeaderMap,
    ApiJson(req): ApiJson<AgentTaskPollRequest>,
) -> ApiResult<Json<AgentTaskPollResponse>> {
    transport_enabled(&state)?;
    check_poll(&state, id, &req, &peer)?;
    let known = known_cancellations(&headers);
    let deadline = tokio::time::Instant::now() + poll_hold(state.config.long_poll);
    let notify = state.wakeups.notifier(id);
    loop {
        let notified = notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();

        let now = state.config.clock.now();
        let claim = state
            .store
            .claim_task(
                id,
                generation,
                &peer.fingerprint,
                &req.capabilities,
                req.start_handshake,
                now,
                state.config.lease_grace,
            )
            .await?;
        let cancellations: Vec<AgentTaskCancellation> = state
            .store
            .pending_cancellations(id)
            .await?
            .into_iter()
            .filter(|(_, assignment)| !known.contains(&assignment.to_string()))
            .map(|(task_id, assignment_id)| AgentTaskCancellation {
                task_id,
                assignment_id,
            })
            .collect();
        match claim {
            ClaimOutcome::Fenced => {
                return Err(fenced("this process's generation is no longer current"))
            }
            ClaimOutcome::Revoked => return Err(binding_refused(&state, id, &peer).await),
            ClaimOutcome::Claimed(task, attempt) => {
                state.metrics.task_assigned();
                crate::http::trace::record("task_id", task.id);
                crate::http::trace::record("assignment_id", attempt.assignment_id);
                tracing::info!(
                    agent_id = %id, generation, task_id = %task.id,
                    assignment_id = %attempt.assignment_id, task_type = %task.task_type,
                    expires_at = %attempt.lease_expires_at, "task assigned"
                );
                let assignment = assignment(&state, &task, attempt, &peer)?;
                return Ok(Json(AgentTaskPollResponse {
                    contract_version: CONTRACT_VERSION.into(),
                    assignment: Some(assignment),
                    cancellations,
                }));
            }
            ClaimOutcome::Empty if !cancellations.is_empty() => {
                return Ok(Json(AgentTaskPollResponse {
                    contract_version: CONTRACT_VERSION.into(),
                    assignment: None,
                    cancellations,
                }))
            }
            ClaimOutcome::Empty => {}
        }
        let _parked = state.metrics.poll_parked();
        tokio::select! {
            _ = &mut notified => state.metrics.poll_woken(),
            _ = tokio::time::sleep_until(deadline) => {
                return Ok(Json(AgentTaskPollResponse {
                    contract_version: CONTRACT_VERSION.into(),
                    assignment: None,
                    cancellations: vec![],
                }));
            }
        }
    }
}

/// What a poll's body must say, whether it comes as a poll or as a task stream's `ready`.
pub fn check_poll(
    state: &SharedState,
    id: AgentId,
    req: &AgentTaskPollRequest,
    peer: &PeerCertificate,
) -> ApiResult<()> {
    check_contract(&req.contract_version).map_err(|refusal| refusal.answer(state))?;
    if req.agent_id != id {
        return Err(ApiError::unprocessable(
            codes::AGENT_ID_MISMATCH,
            "agentId differs from the path",
        ));
    }
    // Before anything is claimed: a task handed to a key that cannot receive it would sit leased
    // with nothing sent, and clear text is never the fallback.
    sealing_recipient(peer)?;
    Ok(())
}

/// How long an empty long-poll is held: a random 75–100 % of the configured wait (25 s at
/// most). Agents that started polling together, such as a fleet reconnecting after a server
/// restart, would otherwise all be answered, and all poll again, in the same instant every
/// 25 s; the jitter spreads them further apart with every round.
fn poll_hold(configured: Duration) -> Duration {
    configured
        .min(Duration::from_secs(25))
        .mul_f64(0.75 + 0.25 * berth_crypto::random_unit())
}

/// `X-Berth-Known-Cancellations`: assignment ids whose cancellation the agent already has, so a
/// poll does not return at once for them again.
fn known_cancellations(headers: &HeaderMap) -> Vec<String> {
    headers
        .get(KNOWN_CANCELLATIONS_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect()
        })
        .unwrap_or_default()
}

/// The capability an assignment names: from the task kind table (a task of a type this server no
/// longer knows names none the agent has, and the agent fails it closed).
fn required_capability(task_type: &str) -> &'static str {
    TaskKind::parse(task_type).map_or("unknown", TaskKind::required_capability)
}

/// The key an assignment for the agent behind `peer` is sealed to: its certificate's. The claim
/// checked, in its transaction, that this certificate is the agent's binding, so this is the
/// key of the certificate the store holds for the agent. Only P-256 keys can receive.
fn sealing_recipient(peer: &PeerCertificate) -> ApiResult<&RecipientPublicKey> {
    peer.sealing_recipient().map_err(|e| {
        ApiError::unprocessable(
            codes::SEALING_KEY_UNSUPPORTED,
            format!("this agent's certificate key cannot receive sealed assignments: {e}"),
        )
    })
}

/// The assignment of `attempt` as the agent behind `peer` receives it: the payload and the
/// credentials only inside `sealed`, HPKE-sealed to that agent's certificate key with the
/// assignment id as associated data, so a proxy, a request log or a dump of the answer holds
/// ciphertext, and a box cannot be replayed into another assignment. Every way of delivering an
/// assignment (the poll, the task stream) builds it here.
pub fn assignment(
    state: &SharedState,
    task: &Task,
    attempt: berth_store::Attempt,
    peer: &PeerCertificate,
) -> ApiResult<AgentTaskAssignment> {
    let recipient = sealing_recipient(peer)?;
    let mut credentials = match &task.credentials_sealed {
        None => Default::default(),
        Some(sealed) => {
            let clear = state
                .master_key
                .open(sealed, task.id.0.as_bytes())
                .map_err(|e| ApiError::internal(&e))?;
            serde_json::from_slice(&clear).map_err(|e| ApiError::internal(&e))?
        }
    };
    // A deployment task's registry scope becomes this delivery's pull token.
    crate::infra::registry_token::mint_for_delivery(state, task, &attempt, &mut credentials)
        .map_err(|e| ApiError::internal(&e))?;
    let clear = serde_json::to_vec(&SealedAssignment {
        payload: task.payload.to_string(),
        credentials,
    })
    .map_err(|e| ApiError::internal(&e))?;
    let sealed = hpke::seal(
        hpke::Aead::Aes256Gcm,
        recipient,
        transport::ASSIGNMENT_SEAL_INFO,
        attempt.assignment_id.to_string().as_bytes(),
        &clear,
    )
    .map_err(|e| ApiError::internal(&e))?;
    let (enc, ciphertext) = sealed.to_base64();
    Ok(AgentTaskAssignment {
        contract_version: CONTRACT_VERSION.into(),
        assignment_id: attempt.assignment_id,
        task_id: task.id,
        agent_id: task.agent_id,
        required_capability: required_capability(&task.task_type).into(),
        task_type: task.task_type.clone(),
        payload: String::new(),
        credentials: Default::default(),
        sealed: Some(SealedBox {
            alg: transport::SEAL_ALG.into(),
            enc,
            ciphertext,
        }),
        variables: task.variables.clone(),
        assigned_at: attempt.assigned_at,
        timeout: transport::format_timespan(Duration::from_secs(task.timeout_seconds.into())),
        idempotency_key: journal_key(task),
        expires_at: attempt.lease_expires_at,
        side_effects: task.side_effects,
    })
}

/// Seed 000's `AgentTask` for a queued task a heartbeat lists: not claimed, so no assignment
/// times, and never its credentials (they leave only inside an assignment).
pub fn listed_task(task: &Task) -> berth_proto::agent::AgentTask {
    berth_proto::agent::AgentTask {
        id: task.id,
        task_type: task.task_type.clone(),
        target_id: task.agent_id,
        payload: serde_json::Value::Null,
        credentials: Default::default(),
        timeout: task.timeout_seconds,
        priority: task.priority,
        idempotency_key: journal_key(task),
        assigned_at: None,
        expires_at: None,
    }
}

/// The agent's journal key for a task: derived by the server from the tenant and the task, so it
/// is unique per task and no client can choose it (a client's `Idempotency-Key` only dedupes
/// creates; naming another task's id there must not make the agent answer from that task's
/// journal entry).
fn journal_key(task: &Task) -> String {
    format!("{}/{}", task.tenant_id, task.id)
}

/// Confirm, before any side effect, that an assignment is still the agent's to run (mTLS, with
/// the generation). Yes only while the generation is current and the assignment is the task's
/// live lease; the yes is recorded, so a lost delivery that never got one is requeued instead of
/// becoming `unknown`. Asking again for the same assignment answers the same.
#[utoipa::path(post, path = "/api/v1/release-orchestrator/agent-runtime/agents/{agentId}/tasks/{taskId}/start", tag = "agent-runtime",
    request_body = StartTask, security(("agentCertificate" = [])),
    params(("agentId" = String, Path, format = Uuid), ("taskId" = String, Path, format = Uuid), ("X-Berth-Generation" = i64, Header)),
    responses(
        (status = 200, body = TaskStarted),
        (status = 404, body = ErrorBody, description = "NOT_FOUND: no such task for this agent"),
        (status = 409, body = ErrorBody, description = "FENCED: stale generation, or an assignment that is no longer the task's live lease"),
        (status = 503, body = ErrorBody, description = "TRANSPORT_DISABLED"),
    ))]
pub async fn start_task(
    State(state): State<SharedState>,
    // The extractor checked that the certificate names the path's agent.
    FencedAgent {
        id: agent_id,
        peer,
        generation,
    }: FencedAgent,
    ApiPath((_, task_id)): ApiPath<(AgentId, TaskId)>,
    ApiJson(req): ApiJson<StartTask>,
) -> ApiResult<Json<TaskStarted>> {
    crate::http::trace::record("task_id", task_id);
    crate::http::trace::record("assignment_id", req.assignment_id);
    transport_enabled(&state)?;
    let outcome = state
        .store
        .start_attempt(StartAttempt {
            agent_id,
            generation,
            certificate_fingerprint: peer.fingerprint.to_string(),
            task_id,
            assignment_id: req.assignment_id,
            phase: req.phase,
            now: state.config.clock.now(),
        })
        .await?;
    match outcome {
        StartOutcome::Started(attempt) => {
            let started_at = attempt.started_at.unwrap_or(attempt.assigned_at);
            tracing::info!(
                %agent_id, generation, %task_id, assignment_id = %attempt.assignment_id,
                %started_at, "task start confirmed"
            );
            Ok(Json(TaskStarted {
                assignment_id: attempt.assignment_id,
                started_at,
                expires_at: attempt.lease_expires_at,
            }))
        }
        StartOutcome::Fenced => {
            tracing::warn!(
                %agent_id, generation, %task_id, assignment_id = %req.assignment_id,
                "start refused: the generation or the assignment is no longer current"
            );
            Err(fenced(
                "the generation or the assignment is no longer current: do not run it",
            ))
        }
        StartOutcome::Revoked => Err(binding_refused(&state, agent_id, &peer).await),
        StartOutcome::NotFound => Err(ApiError::not_found("task")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_hold_is_jittered_within_three_quarters_and_all_of_the_wait() {
        let holds: Vec<Duration> = (0..1000)
            .map(|_| poll_hold(Duration::from_secs(60)))
            .collect();
        for hold in &holds {
            assert!(
                (Duration::from_millis(18_750)..=Duration::from_secs(25)).contains(hold),
                "{hold:?}: the configured wait is capped at 25 s, then jittered"
            );
        }
        let (min, max) = (holds.iter().min().unwrap(), holds.iter().max().unwrap());
        assert!(
            *max - *min > Duration::from_secs(3),
            "not spread: {min:?}..{max:?}"
        );
    }
}
