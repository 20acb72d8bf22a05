//! `agent-task-transport/v1`: the session lease, the long-poll and the signed result.
//!
//! Fails closed everywhere: a result counts only when the connection's certificate is the agent's
//! binding, the signature verifies with that certificate's key over the JCS of the envelope, the
//! contract version, task id and agent id match, and — in the same transaction that records it —
//! the agent's generation is current and the assignment is the task's live lease.

use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use base64::Engine;
use berth_proto::error::codes;
use berth_proto::headers::KNOWN_CANCELLATIONS_HEADER;
use berth_proto::kind::TaskKind;
use berth_proto::result::{error_types, TaskResult};
use berth_proto::transport::{
    self, AcquireSession, AgentTaskAssignment, AgentTaskCancellation, AgentTaskPollRequest,
    AgentTaskPollResponse, AgentTaskResultEnvelope, Released, ResultAck, SealedAssignment,
    SealedBox, Session, StartTask, TaskStarted, CONTRACT_VERSION,
};
use berth_proto::{AgentId, ErrorBody, TaskId};
use berth_store::{
    AttemptResult, ClaimOutcome, CompleteOutcome, Completion, SessionOutcome, StartAttempt,
    StartOutcome, Task,
};
use serde::Deserialize;

use berth_crypto::hpke::{self, RecipientKey, RecipientPublicKey};

use crate::auth::{binding_refused, AgentCaller, FencedAgent};
use crate::error::{ApiError, ApiResult};
use crate::extract::{ApiJson, ApiPath};
use crate::services::validate::validate_agent_version;
use crate::tls::PeerCertificate;
use crate::SharedState;

pub(crate) fn fenced(detail: &str) -> ApiError {
    ApiError::conflict(codes::FENCED, detail)
}

pub(crate) fn transport_enabled(state: &SharedState) -> ApiResult<()> {
    if state.config.agent_transport_enabled {
        Ok(())
    } else {
        state.metrics.result_rejected("transport_disabled");
        Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            codes::TRANSPORT_DISABLED,
            "the agent task transport is disabled on this server",
        ))
    }
}

/// Acquire the session lease (mTLS). A second live process with the same identity is refused,
/// unless it holds the lock the holder held on the same boot (the holder is dead: a restart).
#[utoipa::path(post, path = "/api/v1/agents/{id}/session", tag = "agent-runtime", request_body = AcquireSession,
    security(("agentCertificate" = [])), params(("id" = String, Path, format = Uuid)),
    responses(
        (status = 200, body = Session),
        (status = 409, body = ErrorBody, description = "SESSION_HELD: another live process holds this identity"),
    ))]
pub async fn acquire_session(
    State(state): State<SharedState>,
    AgentCaller { id, peer }: AgentCaller,
    ApiJson(req): ApiJson<AcquireSession>,
) -> ApiResult<Json<Session>> {
    if req.instance_id.is_empty() || req.instance_id.len() > 128 {
        return Err(ApiError::unprocessable(
            codes::INVALID_REQUEST,
            "instanceId must be 1-128 characters",
        ));
    }
    let restart_key = restart_key(&req)?;
    if let Some(version) = &req.version {
        validate_agent_version(version)?;
    }
    let now = state.config.clock.now();
    let lease_expires_at = now + state.config.heartbeat_interval * 3;
    match state
        .store
        .acquire_session(
            id,
            &peer.fingerprint,
            &req.instance_id,
            restart_key.as_deref(),
            now,
            lease_expires_at,
        )
        .await?
    {
        SessionOutcome::Acquired {
            generation,
            lease_expires_at,
        } => {
            tracing::info!(agent_id = %id, generation, instance = %req.instance_id, holds_lock = restart_key.is_some(), version = req.version.as_deref().unwrap_or("-"), "session acquired");
            // What this process runs: an agent upgraded in place shows its new version. A newer
            // session taking over first wins (the write is for this generation only).
            if let Some(version) = &req.version {
                state
                    .store
                    .record_agent_version(id, generation, version)
                    .await?;
            }
            Ok(Json(Session {
                generation,
                lease_expires_at,
                heartbeat_interval_seconds: state.config.heartbeat_interval.as_secs().max(1),
                sealing_key: state.sealing_public.clone(),
            }))
        }
        SessionOutcome::Held {
            holder_instance,
            lease_expires_at,
        } => {
            // Two live processes with one identity: a cloned VM or a copied state dir.
            tracing::error!(
                agent_id = %id, holder = %holder_instance, contender = %req.instance_id,
                "ALERT: a second live process presents this agent's identity; session refused"
            );
            state.metrics.session_held();
            // Degraded for as long as a session lease from now: a clone that keeps trying
            // keeps it so, and the mark fades once it has stopped.
            state
                .store
                .mark_agent_degraded(id, now + state.config.heartbeat_interval * 3)
                .await?;
            let mut error = ApiError::conflict(
                codes::SESSION_HELD,
                format!("another live process holds this agent's session until {lease_expires_at}"),
            );
            error.retry_after = Some((lease_expires_at - now).whole_seconds().max(1) as u64);
            Err(error)
        }
        SessionOutcome::Revoked => Err(binding_refused(&state, id, &peer).await),
    }
}

/// What a session request proves about its process: it holds its installation's lock (`lock`)
/// on this boot (`bootId`). A later process presenting the same key holds the same lock, so the
/// holder that recorded it is dead (the store lets it take the live lease). Without both, None.
fn restart_key(req: &AcquireSession) -> ApiResult<Option<String>> {
    let field = |name: &str, value: &Option<String>| match value.as_deref() {
        Some(v) if v.is_empty() || v.len() > 128 || v.contains('/') => {
            Err(ApiError::unprocessable(
                codes::INVALID_REQUEST,
                format!("{name} must be 1-128 characters without '/'"),
            ))
        }
        v => Ok(v.map(str::to_owned)),
    };
    Ok(
        match (field("bootId", &req.boot_id)?, field("lock", &req.lock)?) {
            (Some(boot), Some(lock)) => Some(format!("{boot}/{lock}")),
            _ => None,
        },
    )
}

/// Release the session lease on a graceful stop (mTLS, with the generation).
#[utoipa::path(delete, path = "/api/v1/agents/{id}/session", tag = "agent-runtime",
    security(("agentCertificate" = [])),
    params(("id" = String, Path, format = Uuid), ("X-Berth-Generation" = i64, Header)),
    responses((status = 200, body = Released)))]
pub async fn release_session(
    State(state): State<SharedState>,
    FencedAgent { id, generation, .. }: FencedAgent,
) -> ApiResult<Json<Released>> {
    let released = state
        .store
        .release_session(id, generation, state.config.clock.now())
        .await?;
    if released {
        Ok(Json(Released { released }))
    } else {
        Err(fenced("the session is held by a newer generation"))
    }
}

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
pub(crate) fn check_poll(
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
pub(crate) fn assignment(
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
    crate::registry_token::mint_for_delivery(state, task, &attempt, &mut credentials)
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
pub(crate) fn listed_task(task: &Task) -> berth_proto::agent::AgentTask {
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

/// The one contract this server speaks, for polls and results alike.
fn check_contract(version: &str) -> Result<(), Refusal> {
    if version == CONTRACT_VERSION {
        return Ok(());
    }
    Err(refuse(
        "unsupported_contract_version",
        codes::UNSUPPORTED_CONTRACT_VERSION,
        format!("contract version {version:?} is not {CONTRACT_VERSION}"),
    ))
}

/// Why a result was refused before it reached the store: the metric reason, the code, and a
/// detail for the agent.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Refusal {
    pub reason: &'static str,
    pub code: &'static str,
    pub detail: String,
}

impl Refusal {
    /// Counts the refusal by its reason and answers it as a `422`.
    fn answer(self, state: &SharedState) -> ApiError {
        state.metrics.result_rejected(self.reason);
        ApiError::unprocessable(self.code, self.detail)
    }
}

fn refuse(reason: &'static str, code: &'static str, detail: impl Into<String>) -> Refusal {
    Refusal {
        reason,
        code,
        detail: detail.into(),
    }
}

/// A result whose signature verified over the received bytes and whose ids match the path.
#[derive(Debug)]
pub(crate) struct VerifiedResult {
    pub envelope: AgentTaskResultEnvelope,
    /// `resultData`, a verified `TaskResult`, as the JSON the store records (parsed once).
    pub result_data: Option<serde_json::Value>,
    pub attempt: AttemptResult,
}

/// The signature of a signed body as received (a result, a heartbeat), before anything in it is
/// believed: `signature` present, `signatureAlgorithm` one berth knows, the signature standard
/// base64, and `verifies(algorithm, message, signature)` over the JCS of `raw` without
/// `signature` — so the algorithm is inside the signed bytes. `what` names the body in details.
pub(crate) fn verify_signature(
    raw: &serde_json::Value,
    what: &str,
    verifies: impl FnOnce(&str, &[u8], &[u8]) -> bool,
) -> Result<(), Refusal> {
    let text = |name: &str| raw.get(name).and_then(|v| v.as_str()).unwrap_or_default();
    let signature = text("signature");
    if signature.is_empty() {
        return Err(refuse(
            "no_signature",
            codes::SIGNATURE_MISSING,
            format!("the {what} is not signed"),
        ));
    }
    let algorithm = text("signatureAlgorithm");
    if algorithm != transport::ALG_ECDSA_SHA256 && algorithm != transport::ALG_RSA_SHA256 {
        return Err(refuse(
            "bad_signature",
            codes::UNSUPPORTED_SIGNATURE_ALGORITHM,
            format!("signatureAlgorithm {algorithm:?} is not ecdsa-sha256 or rsa-sha256"),
        ));
    }
    let invalid = |detail: String| refuse("bad_signature", codes::SIGNATURE_INVALID, detail);
    let signature = base64::engine::general_purpose::STANDARD
        .decode(signature)
        .map_err(|_| invalid("the signature is not standard base64".into()))?;
    let signed = transport::signing_input(raw)
        .map_err(|_| invalid(format!("the {what} has no canonical form")))?;
    if !verifies(algorithm, &signed, &signature) {
        return Err(invalid(
            "the signature does not verify with the agent's certificate".into(),
        ));
    }
    Ok(())
}

/// Everything a result must prove that needs no database, in order: the contract version, a
/// signature in a known algorithm that `verifies` over the JCS of the received envelope without
/// `signature`, then — parsed only after that — the ids, and a `resultData` that is seed 000's
/// `TaskResult` of this task. `verifies(algorithm, message, signature)` is the connection's
/// certificate key. The binding, the generation and the live lease are the store's to check.
pub(crate) fn verify_result(
    raw: &serde_json::Value,
    agent_id: AgentId,
    task_id: TaskId,
    verifies: impl FnOnce(&str, &[u8], &[u8]) -> bool,
    logs_key: &RecipientKey,
) -> Result<VerifiedResult, Refusal> {
    let text = |name: &str| raw.get(name).and_then(|v| v.as_str()).unwrap_or_default();
    check_contract(text("contractVersion"))?;
    verify_signature(raw, "result", verifies)?;

    let malformed = |detail: String| refuse("malformed", codes::INVALID_REQUEST, detail);
    let envelope: AgentTaskResultEnvelope =
        serde_json::from_value(raw.clone()).map_err(|e| malformed(e.to_string()))?;
    let task_mismatch = || {
        refuse(
            "task_id_mismatch",
            codes::TASK_ID_MISMATCH,
            "taskId differs from the path",
        )
    };
    if envelope.task_id != task_id {
        return Err(task_mismatch());
    }
    if envelope.agent_id != agent_id {
        return Err(refuse(
            "agent_id_mismatch",
            codes::AGENT_ID_MISMATCH,
            "agentId differs from the path",
        ));
    }
    let (result, result_data) = match &envelope.result_data {
        None => (None, None),
        Some(text) => {
            let not_a_result =
                |e: serde_json::Error| malformed(format!("resultData is not a TaskResult: {e}"));
            let data: serde_json::Value = serde_json::from_str(text).map_err(not_a_result)?;
            let result = TaskResult::deserialize(&data).map_err(not_a_result)?;
            if result.task_id != task_id {
                return Err(task_mismatch());
            }
            if result.success != envelope.success {
                return Err(malformed(
                    "resultData.success disagrees with the envelope's success".into(),
                ));
            }
            let data = open_logs(data, &result, envelope.assignment_id, logs_key)?;
            (Some(result), Some(data))
        }
    };
    let attempt = match &result {
        _ if envelope.success => AttemptResult::Succeeded,
        Some(r) if r.cancelled() => AttemptResult::Cancelled,
        Some(r) => AttemptResult::Failed {
            error_code: r
                .error_type
                .clone()
                .unwrap_or_else(|| error_types::FAILED.into()),
            retriable: r.retriable,
        },
        None => AttemptResult::Failed {
            error_code: error_types::FAILED.into(),
            retriable: false,
        },
    };
    Ok(VerifiedResult {
        envelope,
        result_data,
        attempt,
    })
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

/// `resultData` as the store records it: its `sealedLogs`, opened with the server's sealing key
/// (the envelope's assignment id as associated data), becomes `logs`. The signature covered the
/// ciphertext; the envelope kept on the attempt row keeps it. A box that does not open refuses
/// the whole result, so nothing is recorded. A result with clear `logs` and no `sealedLogs`
/// (a seed 000 agent, which knows no server key) is recorded as it came.
fn open_logs(
    mut data: serde_json::Value,
    result: &TaskResult,
    assignment: Option<berth_proto::AssignmentId>,
    key: &RecipientKey,
) -> Result<serde_json::Value, Refusal> {
    let Some(sealed) = &result.sealed_logs else {
        return Ok(data);
    };
    let unsealable = |detail: &str| refuse("logs_unsealable", codes::LOGS_UNSEALABLE, detail);
    let Some(assignment) = assignment else {
        return Err(unsealable(
            "sealedLogs needs the envelope's assignmentId, its associated data",
        ));
    };
    if !result.logs.is_empty() {
        return Err(unsealable(
            "a result carries its logs sealed or clear, not both",
        ));
    }
    if sealed.alg != transport::SEAL_ALG {
        return Err(unsealable("sealedLogs.alg is not the one berth seals with"));
    }
    let clear = hpke::Sealed::from_base64(&sealed.enc, &sealed.ciphertext)
        .and_then(|sealed| {
            key.open(
                hpke::Aead::Aes256Gcm,
                &sealed,
                transport::LOGS_SEAL_INFO,
                assignment.to_string().as_bytes(),
            )
        })
        .map_err(|_| {
            unsealable("sealedLogs does not open with the server's key for this assignment")
        })?;
    let clear =
        String::from_utf8(clear).map_err(|_| unsealable("the opened logs are not UTF-8"))?;
    if let Some(fields) = data.as_object_mut() {
        fields.remove("sealedLogs");
        fields.insert("logs".into(), serde_json::Value::String(clear));
    }
    Ok(data)
}

/// Submit the signed result of an assignment (mTLS, with the generation).
#[utoipa::path(post, path = "/api/v1/release-orchestrator/agent-runtime/agents/{agentId}/tasks/{taskId}/result", tag = "agent-runtime",
    request_body = AgentTaskResultEnvelope, security(("agentCertificate" = [])),
    params(("agentId" = String, Path, format = Uuid), ("taskId" = String, Path, format = Uuid), ("X-Berth-Generation" = i64, Header)),
    responses(
        (status = 200, body = ResultAck),
        (status = 409, body = ErrorBody, description = "FENCED: stale generation or an assignment that is no longer current"),
        (status = 422, body = ErrorBody, description = "SIGNATURE_MISSING, SIGNATURE_INVALID, UNSUPPORTED_SIGNATURE_ALGORITHM, UNSUPPORTED_CONTRACT_VERSION, TASK_ID_MISMATCH, AGENT_ID_MISMATCH, LOGS_UNSEALABLE, INVALID_REQUEST"),
        (status = 503, body = ErrorBody, description = "TRANSPORT_DISABLED"),
    ))]
pub async fn submit_result(
    State(state): State<SharedState>,
    caller: Result<FencedAgent, ApiError>,
    ApiPath((agent_id, task_id)): ApiPath<(AgentId, TaskId)>,
    ApiJson(raw): ApiJson<serde_json::Value>,
) -> ApiResult<Json<ResultAck>> {
    crate::http::trace::record("task_id", task_id);
    transport_enabled(&state)?;
    let FencedAgent {
        peer, generation, ..
    } = caller.inspect_err(|e| {
        state.metrics.result_rejected(match e.code {
            codes::FENCED => "fenced",
            _ => "binding_mismatch",
        })
    })?;
    // The verifier of this connection's certificate (`peer.der`, parsed once per connection).
    // It decides only whether the signature verifies: the extractor checked that the
    // certificate names this agent, and `complete_attempt` checks `peer.fingerprint` against the
    // agent's current binding in the write's own transaction.
    let verified = verify_result(
        &raw,
        agent_id,
        task_id,
        |algorithm, message, signature| {
            peer.result_verifier()
                .and_then(|verifier| verifier.verify(algorithm, message, signature))
                .is_ok()
        },
        &state.sealing_key,
    )
    .map_err(|refusal| {
        tracing::warn!(
            %agent_id, generation, %task_id, code = refusal.code, detail = %refusal.detail,
            "result refused"
        );
        refusal.answer(&state)
    })?;
    let verified_assignment = verified.envelope.assignment_id;
    if let Some(assignment) = verified_assignment {
        crate::http::trace::record("assignment_id", assignment);
    }
    let outcome = state
        .store
        .complete_attempt(
            Completion {
                agent_id,
                generation,
                certificate_fingerprint: peer.fingerprint.to_string(),
                certificate_der: peer.der.to_vec(),
                task_id,
                assignment_id: verified.envelope.assignment_id,
                result: verified.attempt,
                result_data: verified.result_data,
                envelope: raw,
                now: state.config.clock.now(),
            },
            &state.config.retry_policy,
        )
        .await?;
    match outcome {
        CompleteOutcome::Recorded(task) => {
            state.metrics.result_accepted(task.state.as_str());
            tracing::info!(
                %agent_id, generation, %task_id, assignment_id = ?verified_assignment,
                state = %task.state, "result recorded"
            );
            after_result(&state, &task).await;
            Ok(Json(ResultAck {
                accepted: true,
                duplicate: false,
                state: task.state,
            }))
        }
        CompleteOutcome::Duplicate(task) => Ok(Json(ResultAck {
            accepted: true,
            duplicate: true,
            state: task.state,
        })),
        CompleteOutcome::Fenced => {
            tracing::warn!(
                %agent_id, generation, %task_id, assignment_id = ?verified_assignment,
                "result refused: the generation or the assignment is no longer current"
            );
            state.metrics.result_rejected("fenced");
            Err(fenced(
                "the generation or the assignment is no longer current",
            ))
        }
        CompleteOutcome::Revoked => {
            state.metrics.result_rejected("binding_mismatch");
            Err(binding_refused(&state, agent_id, &peer).await)
        }
        CompleteOutcome::NotFound => Err(ApiError::not_found("task")),
    }
}

/// Follow-ups of a recorded result: wake the agent for a retry, and resolve read-backs.
async fn after_result(state: &SharedState, task: &Task) {
    if let Some(at) = task.next_attempt_at {
        let delay = (at - state.config.clock.now())
            .try_into()
            .unwrap_or_default();
        state.wakeups.wake_after(task.agent_id, delay);
    }
    if let Some(parent) = task.read_back_of {
        crate::fault::crash_after("read-back-result");
        crate::readback::resolve(state, parent, task).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_crypto::{AgentKey, Ca, ResultVerifier};
    use berth_proto::result::TaskResult;
    use serde_json::Value;
    use time::OffsetDateTime;

    struct Signer {
        key: AgentKey,
        verifier: ResultVerifier,
        agent: AgentId,
        task: TaskId,
        assignment: berth_proto::AssignmentId,
        /// The server's sealing key.
        logs_key: RecipientKey,
    }

    impl Signer {
        fn new() -> Signer {
            let now = OffsetDateTime::now_utc();
            let ca = Ca::generate("test CA", now).unwrap();
            let key = AgentKey::generate().unwrap();
            let agent = AgentId::new();
            let issued = ca
                .sign_agent_csr(
                    &key.csr_pem("a").unwrap(),
                    agent.0,
                    now,
                    time::Duration::hours(1),
                )
                .unwrap();
            let der = berth_crypto::cert_pem_to_der(&issued.cert_pem).unwrap();
            Signer {
                key,
                verifier: ResultVerifier::from_cert(&der).unwrap(),
                agent,
                task: TaskId::new(),
                assignment: berth_proto::AssignmentId::new(),
                logs_key: RecipientKey::generate().unwrap(),
            }
        }

        /// `logs` sealed as berth-agent seals them, to `key` for `assignment`.
        fn sealed_logs(
            logs: &str,
            key: &RecipientKey,
            assignment: berth_proto::AssignmentId,
        ) -> SealedBox {
            let sealed = hpke::seal(
                hpke::Aead::Aes256Gcm,
                key.public_key(),
                transport::LOGS_SEAL_INFO,
                assignment.to_string().as_bytes(),
                logs.as_bytes(),
            )
            .unwrap();
            let (enc, ciphertext) = sealed.to_base64();
            SealedBox {
                alg: transport::SEAL_ALG.into(),
                enc,
                ciphertext,
            }
        }

        /// The envelope of a successful result whose logs are `logs`.
        fn with_logs(&self, logs: Option<SealedBox>, clear: &str) -> Value {
            let mut r = self.result(true, None);
            r.sealed_logs = logs;
            r.logs = clear.into();
            self.envelope(&r)
        }

        fn result(&self, success: bool, error_type: Option<&str>) -> TaskResult {
            let now = OffsetDateTime::now_utc();
            TaskResult {
                task_id: self.task,
                success,
                started_at: now,
                completed_at: now,
                outputs: Default::default(),
                artifacts: vec![],
                error: (!success).then(|| "boom".into()),
                error_type: error_type.map(str::to_string),
                retriable: error_type == Some("FLAKY"),
                logs: String::new(),
                sealed_logs: None,
                metrics: Default::default(),
            }
        }

        /// The unsigned envelope of a result, as JSON.
        fn envelope(&self, result: &TaskResult) -> Value {
            serde_json::to_value(AgentTaskResultEnvelope {
                contract_version: CONTRACT_VERSION.into(),
                agent_id: self.agent,
                task_id: self.task,
                assignment_id: Some(self.assignment),
                success: result.success,
                message: Some("done".into()),
                result_data: Some(serde_json::to_string(result).unwrap()),
                duration: "00:00:01".into(),
                completed_at: result.completed_at,
                signature_algorithm: transport::ALG_ECDSA_SHA256.into(),
                signature: None,
            })
            .unwrap()
        }

        fn sign(&self, mut envelope: Value) -> Value {
            let bytes = transport::signing_input(&envelope).unwrap();
            envelope["signature"] = base64::engine::general_purpose::STANDARD
                .encode(self.key.sign(&bytes).unwrap())
                .into();
            envelope
        }

        fn verify(&self, raw: &Value) -> Result<VerifiedResult, Refusal> {
            verify_result(
                raw,
                self.agent,
                self.task,
                |alg, message, signature| self.verifier.verify(alg, message, signature).is_ok(),
                &self.logs_key,
            )
        }
    }

    /// One row per refusal: a change to a genuine envelope, whether it is signed after the change
    /// (else the change breaks the signature), and the code and metric reason that must come back.
    #[test]
    fn every_refusal_has_its_code_and_reason() {
        let s = Signer::new();
        let genuine = s.envelope(&s.result(true, None));
        type Tamper = fn(&Signer, &mut Value);
        let rows: Vec<(&str, Tamper, bool, &str, &str)> = vec![
            (
                "content changed after signing",
                |_, e| e["message"] = "donf".into(),
                false,
                "SIGNATURE_INVALID",
                "bad_signature",
            ),
            (
                "signature not base64",
                |_, e| e["signature"] = "***".into(),
                false,
                "SIGNATURE_INVALID",
                "bad_signature",
            ),
            (
                "claims rsa for an ecdsa signature",
                |_, e| e["signatureAlgorithm"] = "rsa-sha256".into(),
                true,
                "SIGNATURE_INVALID",
                "bad_signature",
            ),
            (
                "unknown algorithm",
                |_, e| e["signatureAlgorithm"] = "none".into(),
                true,
                "UNSUPPORTED_SIGNATURE_ALGORITHM",
                "bad_signature",
            ),
            (
                "other contract",
                |_, e| e["contractVersion"] = "agent-task-transport/v2".into(),
                true,
                "UNSUPPORTED_CONTRACT_VERSION",
                "unsupported_contract_version",
            ),
            (
                "other task in the envelope",
                |_, e| e["taskId"] = TaskId::new().to_string().into(),
                true,
                "TASK_ID_MISMATCH",
                "task_id_mismatch",
            ),
            (
                "other agent in the envelope",
                |_, e| e["agentId"] = AgentId::new().to_string().into(),
                true,
                "AGENT_ID_MISMATCH",
                "agent_id_mismatch",
            ),
            (
                "other task in resultData",
                |s, e| {
                    let mut r = s.result(true, None);
                    r.task_id = TaskId::new();
                    e["resultData"] = serde_json::to_string(&r).unwrap().into();
                },
                true,
                "TASK_ID_MISMATCH",
                "task_id_mismatch",
            ),
            (
                "resultData disagrees on success",
                |s, e| {
                    e["resultData"] = serde_json::to_string(&s.result(false, Some("X")))
                        .unwrap()
                        .into()
                },
                true,
                "INVALID_REQUEST",
                "malformed",
            ),
            (
                "resultData not a TaskResult",
                |_, e| e["resultData"] = "{\"outputs\": {}}".into(),
                true,
                "INVALID_REQUEST",
                "malformed",
            ),
            (
                "envelope missing a field",
                |_, e| {
                    e.as_object_mut().unwrap().remove("duration");
                },
                true,
                "INVALID_REQUEST",
                "malformed",
            ),
        ];
        // Sealed logs that do not open: each refused with its own code, nothing recorded.
        let rows: Vec<(&str, Tamper, bool, &str, &str)> = rows
            .into_iter()
            .chain([
                (
                    "logs sealed to another key",
                    (|s, e| {
                        let other = RecipientKey::generate().unwrap();
                        *e = s.with_logs(Some(Signer::sealed_logs("l", &other, s.assignment)), "");
                    }) as Tamper,
                    true,
                    "LOGS_UNSEALABLE",
                    "logs_unsealable",
                ),
                (
                    "logs sealed for another assignment",
                    |s, e| {
                        let other = berth_proto::AssignmentId::new();
                        *e = s.with_logs(Some(Signer::sealed_logs("l", &s.logs_key, other)), "");
                    },
                    true,
                    "LOGS_UNSEALABLE",
                    "logs_unsealable",
                ),
                (
                    "tampered sealed logs",
                    |s, e| {
                        let mut sealed = Signer::sealed_logs("logs", &s.logs_key, s.assignment);
                        let mut ct = base64::engine::general_purpose::STANDARD
                            .decode(&sealed.ciphertext)
                            .unwrap();
                        ct[0] ^= 1;
                        sealed.ciphertext = base64::engine::general_purpose::STANDARD.encode(ct);
                        *e = s.with_logs(Some(sealed), "");
                    },
                    true,
                    "LOGS_UNSEALABLE",
                    "logs_unsealable",
                ),
                (
                    "sealed logs without an assignment id",
                    |s, e| {
                        *e = s.with_logs(
                            Some(Signer::sealed_logs("l", &s.logs_key, s.assignment)),
                            "",
                        );
                        e.as_object_mut().unwrap().remove("assignmentId");
                    },
                    true,
                    "LOGS_UNSEALABLE",
                    "logs_unsealable",
                ),
                (
                    "sealed and clear logs",
                    |s, e| {
                        *e = s.with_logs(
                            Some(Signer::sealed_logs("l", &s.logs_key, s.assignment)),
                            "clear",
                        );
                    },
                    true,
                    "LOGS_UNSEALABLE",
                    "logs_unsealable",
                ),
            ])
            .collect();
        for (name, tamper, resign, code, reason) in rows {
            let mut envelope = if resign {
                genuine.clone()
            } else {
                s.sign(genuine.clone())
            };
            tamper(&s, &mut envelope);
            if resign {
                envelope = s.sign(envelope);
            }
            let refusal = s.verify(&envelope).expect_err(name);
            assert_eq!(
                (refusal.code, refusal.reason),
                (code, reason),
                "{name}: {}",
                refusal.detail
            );
        }
        let unsigned = s.verify(&genuine).unwrap_err();
        assert_eq!(
            (unsigned.code, unsigned.reason),
            ("SIGNATURE_MISSING", "no_signature")
        );
        // Signed by another key: a valid signature, but not the certificate's.
        let stranger = Signer {
            key: AgentKey::generate().unwrap(),
            ..Signer::new()
        };
        let forged = stranger.sign(genuine.clone());
        assert_eq!(s.verify(&forged).unwrap_err().code, "SIGNATURE_INVALID");
    }

    #[test]
    fn sealed_logs_are_recorded_opened_and_clear_logs_as_sent() {
        let s = Signer::new();
        let sealed = Signer::sealed_logs("pulled web:1\n", &s.logs_key, s.assignment);
        let raw = s.sign(s.with_logs(Some(sealed.clone()), ""));
        let verified = s.verify(&raw).unwrap();
        let data = verified.result_data.unwrap();
        assert_eq!(data["logs"], "pulled web:1\n");
        assert!(data.get("sealedLogs").is_none());
        // What was signed, and is kept on the attempt row, is the ciphertext.
        assert!(!raw["resultData"].as_str().unwrap().contains("pulled web"));

        let clear = s.sign(s.with_logs(None, "seed agent log"));
        let data = s.verify(&clear).unwrap().result_data.unwrap();
        assert_eq!(data["logs"], "seed agent log");
    }

    #[test]
    fn verified_results_say_how_the_attempt_ended() {
        let s = Signer::new();
        let cases = [
            (s.result(true, None), AttemptResult::Succeeded),
            (s.result(false, Some("CANCELLED")), AttemptResult::Cancelled),
            (
                s.result(false, Some("FLAKY")),
                AttemptResult::Failed {
                    error_code: "FLAKY".into(),
                    retriable: true,
                },
            ),
            (
                s.result(false, None),
                AttemptResult::Failed {
                    error_code: "FAILED".into(),
                    retriable: false,
                },
            ),
        ];
        for (result, expected) in cases {
            let verified = s.verify(&s.sign(s.envelope(&result))).unwrap();
            assert_eq!(verified.attempt, expected);
            assert_eq!(
                verified.result_data,
                Some(serde_json::to_value(&result).unwrap())
            );
        }
        // No resultData at all: a success is a success, a failure is FAILED.
        let mut bare = s.envelope(&s.result(false, None));
        bare.as_object_mut().unwrap().remove("resultData");
        let verified = s.verify(&s.sign(bare)).unwrap();
        assert!(verified.result_data.is_none());
        assert_eq!(
            verified.attempt,
            AttemptResult::Failed {
                error_code: "FAILED".into(),
                retriable: false
            }
        );
    }

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
