//! The signed result of one delivery: the executor's [`Outcome`] as a typed
//! [`TaskResult`] (the envelope's `resultData`), inside an [`AgentTaskResultEnvelope`] signed
//! with the agent's key over [`AgentTaskResultEnvelope::signing_input`]. Its logs travel
//! sealed to the server's key (`sealedLogs`), so only the server reads them: the signature
//! covers the ciphertext.

use std::time::Duration;

use base64::Engine;
use berth_crypto::hpke::RecipientPublicKey;
use berth_crypto::AgentKey;
use berth_exec::Outcome;
use berth_proto::result::TaskResult;
use berth_proto::transport::{
    format_timespan, AgentTaskAssignment, AgentTaskResultEnvelope, SealedBox, ALG_ECDSA_SHA256,
    CONTRACT_VERSION, LOGS_SEAL_INFO,
};
use berth_proto::AgentId;
use time::OffsetDateTime;

/// The server's sealing key from the session answer (base64 of its P-256 point).
pub(crate) fn server_sealing_key(text: &str) -> Result<RecipientPublicKey, crate::AgentError> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .ok()
        .and_then(|point| RecipientPublicKey::from_sec1(&point).ok())
        .ok_or_else(|| {
            crate::AgentError::Fatal("the session answer's sealingKey is not a P-256 key".into())
        })
}

/// `logs` sealed to the server's key for the assignment `a` (its id as associated data).
fn seal_logs(
    a: &AgentTaskAssignment,
    logs: &str,
    server_key: &RecipientPublicKey,
) -> Result<SealedBox, String> {
    berth_client::sealing::seal_box(server_key, LOGS_SEAL_INFO, a.assignment_id, logs.as_bytes())
}

/// What the agent reports about one delivery, its logs in clear (see [`unsigned_envelope`]).
pub(crate) fn task_result(
    a: &AgentTaskAssignment,
    outcome: &Outcome,
    started_at: OffsetDateTime,
    completed_at: OffsetDateTime,
) -> TaskResult {
    TaskResult {
        task_id: a.task_id,
        success: outcome.success,
        started_at,
        completed_at,
        outputs: outcome.outputs.clone(),
        artifacts: Vec::new(),
        error: (!outcome.success).then(|| outcome.message.clone()),
        error_type: outcome.error_type.clone(),
        retriable: outcome.retriable,
        logs: outcome.logs.clone(),
        sealed_logs: None,
        metrics: outcome.metrics.clone(),
    }
}

/// The envelope for `outcome`, without its signature: built once per delivery, signed by
/// [`sign`] for each link it is sent on. The logs are sealed to `server_key` (`sealedLogs`,
/// `logs` empty).
pub(crate) fn unsigned_envelope(
    agent_id: AgentId,
    a: &AgentTaskAssignment,
    outcome: &Outcome,
    started_at: OffsetDateTime,
    took: Duration,
    server_key: &RecipientPublicKey,
) -> Result<AgentTaskResultEnvelope, String> {
    let completed_at = OffsetDateTime::now_utc();
    let mut result = task_result(a, outcome, started_at, completed_at);
    result.sealed_logs = Some(seal_logs(a, &result.logs, server_key)?);
    result.logs = String::new();
    Ok(AgentTaskResultEnvelope {
        contract_version: CONTRACT_VERSION.into(),
        agent_id,
        task_id: a.task_id,
        assignment_id: Some(a.assignment_id),
        success: outcome.success,
        message: Some(outcome.message.clone()),
        result_data: Some(
            serde_json::to_string(&result).map_err(|e| format!("encoding the result: {e}"))?,
        ),
        duration: format_timespan(took),
        completed_at,
        signature_algorithm: ALG_ECDSA_SHA256.into(),
        signature: None,
    })
}

/// `envelope` signed with `key`.
pub(crate) fn sign(
    envelope: &AgentTaskResultEnvelope,
    key: &AgentKey,
) -> Result<AgentTaskResultEnvelope, String> {
    let mut envelope = AgentTaskResultEnvelope {
        signature: None,
        ..envelope.clone()
    };
    envelope.signature = Some(crate::link::signature(
        "the result",
        envelope.signing_input(),
        key,
    )?);
    Ok(envelope)
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine;
    use berth_crypto::hpke;
    use berth_proto::result::error_types;
    use berth_proto::transport::signing_input;
    use berth_proto::{AssignmentId, TaskId};

    fn assignment(agent: AgentId) -> AgentTaskAssignment {
        AgentTaskAssignment {
            contract_version: CONTRACT_VERSION.into(),
            assignment_id: AssignmentId(uuid::Uuid::new_v4()),
            task_id: TaskId(uuid::Uuid::new_v4()),
            agent_id: agent,
            required_capability: "agent".into(),
            task_type: "health-check".into(),
            payload: "{}".into(),
            credentials: Default::default(),
            sealed: None,
            variables: Default::default(),
            assigned_at: OffsetDateTime::now_utc(),
            timeout: "00:05:00".into(),
            idempotency_key: "k".into(),
            expires_at: OffsetDateTime::now_utc(),
            side_effects: false,
        }
    }

    #[test]
    fn the_envelope_carries_a_typed_result_and_a_signature_the_server_verifies() {
        let now = OffsetDateTime::now_utc();
        let ca = berth_crypto::Ca::generate("test CA", now).unwrap();
        let key = AgentKey::generate().unwrap();
        let agent = AgentId(uuid::Uuid::new_v4());
        let cert = ca
            .sign_agent_csr(
                &key.csr_pem("a").unwrap(),
                agent.0,
                now,
                time::Duration::days(1),
            )
            .unwrap();
        let a = assignment(agent);
        let outcome = Outcome {
            logs: "probe refused".into(),
            ..Outcome::failed(error_types::HEALTH_CHECK_FAILED, "connection refused", true)
        }
        .with_output("probe", serde_json::json!({"port": 1}));
        let server_key = berth_crypto::hpke::RecipientKey::generate().unwrap();
        let envelope = sign(
            &unsigned_envelope(
                agent,
                &a,
                &outcome,
                now,
                Duration::from_millis(1500),
                server_key.public_key(),
            )
            .unwrap(),
            &key,
        )
        .unwrap();

        // As the server sees it: the JSON text sent, parsed back.
        let sent: serde_json::Value = serde_json::to_value(&envelope).unwrap();
        assert_eq!(sent["message"], "connection refused");
        assert_eq!(sent["assignmentId"], serde_json::json!(a.assignment_id));
        let signature = base64::engine::general_purpose::STANDARD
            .decode(sent["signature"].as_str().unwrap())
            .unwrap();
        berth_crypto::verify_with_cert(
            &cert.cert_der,
            ALG_ECDSA_SHA256,
            &signing_input(&sent).unwrap(),
            &signature,
        )
        .unwrap();

        let result: TaskResult =
            serde_json::from_str(sent["resultData"].as_str().unwrap()).unwrap();
        assert_eq!(result.task_id, a.task_id);
        assert!(!result.success && result.retriable);
        assert_eq!(result.error.as_deref(), Some("connection refused"));
        assert_eq!(
            result.error_type.as_deref(),
            Some(error_types::HEALTH_CHECK_FAILED)
        );
        assert_eq!(result.outputs["probe"]["port"], 1);
        // The logs travel sealed to the server's key, for this assignment only.
        assert_eq!(result.logs, "");
        assert!(!sent["resultData"]
            .as_str()
            .unwrap()
            .contains("probe refused"));
        let sealed = result.sealed_logs.unwrap();
        let sealed = hpke::Sealed::from_base64(&sealed.enc, &sealed.ciphertext).unwrap();
        let open = |aad: String| {
            server_key.open(
                hpke::Aead::Aes256Gcm,
                &sealed,
                LOGS_SEAL_INFO,
                aad.as_bytes(),
            )
        };
        assert_eq!(open(a.assignment_id.to_string()).unwrap(), b"probe refused");
        assert!(open(AssignmentId(uuid::Uuid::new_v4()).to_string()).is_err());
        assert_eq!(result.completed_at, envelope.completed_at);
        assert!(result.artifacts.is_empty());

        let ok = task_result(&a, &Outcome::ok("healthy"), now, now);
        assert!(ok.success && ok.error.is_none() && ok.error_type.is_none());
    }
}
