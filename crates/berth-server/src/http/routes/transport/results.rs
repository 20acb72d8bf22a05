//! Results: a signed envelope counts only when the certificate, the signature, the contract and
//! the assignment all check out, and the store records it under the live lease.

use axum::extract::State;
use axum::Json;
use base64::Engine;
use berth_proto::error::codes;
use berth_proto::result::{error_types, TaskResult};
use berth_proto::transport::{self, AgentTaskResultEnvelope, ResultAck, CONTRACT_VERSION};
use berth_proto::{AgentId, ErrorBody, TaskId};
use berth_store::{AttemptResult, CompleteOutcome, Completion, Task};
use serde::Deserialize;

use berth_crypto::hpke::{self, RecipientKey};

use super::gate::{fenced, transport_enabled};
use crate::http::auth::{binding_refused, FencedAgent};
use crate::http::extract::{ApiJson, ApiPath};
use crate::infra::error::{ApiError, ApiResult};
use crate::SharedState;

/// The one contract this server speaks, for polls and results alike.
pub fn check_contract(version: &str) -> Result<(), Refusal> {
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
pub struct Refusal {
    pub reason: &'static str,
    pub code: &'static str,
    pub detail: String,
}

impl Refusal {
    /// Counts the refusal by its reason and answers it as a `422`.
    pub(super) fn answer(self, state: &SharedState) -> ApiError {
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
pub struct VerifiedResult {
    pub envelope: AgentTaskResultEnvelope,
    /// `resultData`, a verified `TaskResult`, as the JSON the store records (parsed once).
    pub result_data: Option<serde_json::Value>,
    pub attempt: AttemptResult,
}

/// The signature of a signed body as received (a result, a heartbeat), before anything in it is
/// believed: `signature` present, `signatureAlgorithm` one berth knows, the signature standard
/// base64, and `verifies(algorithm, message, signature)` over the JCS of `raw` without
/// `signature` — so the algorithm is inside the signed bytes. `what` names the body in details.
pub fn verify_signature(
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
pub fn verify_result(
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
        crate::infra::fault::crash_after("read-back-result");
        crate::services::readback::resolve(state, parent, task).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_crypto::{AgentKey, Ca, ResultVerifier};
    use berth_proto::result::TaskResult;
    use berth_proto::transport::SealedBox;
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
}
