//! `berth audit verify`: checks an audit export (JSON lines, `berth audit export`) with no
//! server. Pure: the caller reads the files. For every entry in order it checks the chain
//! (`seq` 1, 2, 3 … of one tenant, `prevHash` the previous `hash`, `hash` the SHA-256 of the
//! entry's JCS without `hash`), and for every `task.result` entry that the recorded certificate
//! was issued by the CA, names the acting agent, and verifies the envelope's signature over its
//! JCS without `signature` (what the server checked when it accepted the result). The chain
//! alone proves order and completeness against edits that do not rewrite every later hash; the
//! signatures prove each result came from the agent's key, even if someone rewrote the chain.

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use berth_proto::audit::{actions, AuditEntry, ChainCheck, ResultEvidence};

/// The first entry that fails, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// 1-based line of the export.
    pub line: usize,
    /// The `seq` the line claims, when it parses that far.
    pub seq: Option<u64>,
    pub reason: String,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.seq {
            Some(seq) => write!(f, "entry seq {seq} (line {}): {}", self.line, self.reason),
            None => write!(f, "line {}: {}", self.line, self.reason),
        }
    }
}

/// What a valid export held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verified {
    pub entries: u64,
    pub results: u64,
}

/// Verifies `export` (JSON lines) against the CA certificate `ca_der`.
pub fn verify(export: &str, ca_der: &[u8]) -> Result<Verified, Fault> {
    let mut chain = ChainCheck::after(0);
    let mut verified = Verified {
        entries: 0,
        results: 0,
    };
    for (i, text) in export
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let fault = |seq, reason: String| Fault {
            line: i + 1,
            seq,
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| fault(None, format!("not JSON: {e}")))?;
        let entry: AuditEntry = serde_json::from_value(value.clone())
            .map_err(|e| fault(None, format!("not an audit entry: {e}")))?;
        let fail = |reason: String| fault(Some(entry.seq), reason);
        // Hashed as read, so a member added to the line breaks the chain too.
        chain
            .entry_as_read(&entry, &value)
            .map_err(|f| fail(f.to_string()))?;
        if entry.action == actions::TASK_RESULT {
            check_result(&entry, ca_der).map_err(fail)?;
            verified.results += 1;
        }
        verified.entries += 1;
    }
    Ok(verified)
}

/// A result entry: certificate from the CA and of the acting agent, signature by its key.
fn check_result(entry: &AuditEntry, ca_der: &[u8]) -> Result<(), String> {
    let evidence: ResultEvidence = serde_json::from_value(entry.details.clone())
        .map_err(|e| format!("result evidence is malformed: {e}"))?;
    let cert = STANDARD
        .decode(&evidence.certificate)
        .map_err(|_| "the certificate is not standard base64".to_string())?;
    berth_crypto::verify_cert_issued_by(&cert, ca_der)
        .map_err(|e| format!("the certificate was not issued by the CA: {e}"))?;
    let cert_agent = berth_crypto::agent_id_from_cert(&cert)
        .map_err(|e| format!("the certificate names no agent: {e}"))?;
    let text = |name: &str| {
        evidence
            .envelope
            .get(name)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    let actor = match &entry.actor {
        berth_proto::audit::AuditActor::Agent { id } => *id,
        other => return Err(format!("a result recorded for {other:?}, not an agent")),
    };
    if cert_agent != actor || text("agentId") != actor.to_string() {
        return Err(format!(
            "the certificate (agent {cert_agent}), the envelope (agent {}) and the actor (agent {actor}) disagree",
            text("agentId")
        ));
    }
    if text("taskId") != entry.subject {
        return Err(format!(
            "the envelope is for task {}, the entry for {}",
            text("taskId"),
            entry.subject
        ));
    }
    let signature = STANDARD
        .decode(text("signature"))
        .map_err(|_| "the signature is not standard base64".to_string())?;
    let signed = berth_proto::transport::signing_input(&evidence.envelope)
        .map_err(|e| format!("the envelope has no canonical form: {e}"))?;
    berth_crypto::verify_with_cert(&cert, &text("signatureAlgorithm"), &signed, &signature).map_err(
        |e| format!("the result signature does not verify with the agent's certificate: {e}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_crypto::{AgentKey, Ca};
    use berth_proto::audit::{hash_input, AuditActor, GENESIS_HASH};
    use berth_proto::task::TaskState;
    use berth_proto::TenantId;
    use serde_json::{json, Value};
    use time::OffsetDateTime;

    struct Fixture {
        ca: Ca,
        key: AgentKey,
        cert: Vec<u8>,
        agent: uuid::Uuid,
        tenant: TenantId,
    }

    impl Fixture {
        fn new() -> Fixture {
            let now = OffsetDateTime::now_utc();
            let ca = Ca::generate("test CA", now).unwrap();
            let key = AgentKey::generate().unwrap();
            let agent = uuid::Uuid::new_v4();
            let issued = ca
                .sign_agent_csr(
                    &key.csr_pem("a").unwrap(),
                    agent,
                    now,
                    time::Duration::hours(1),
                )
                .unwrap();
            let cert = berth_crypto::cert_pem_to_der(&issued.cert_pem).unwrap();
            Fixture {
                ca,
                key,
                cert,
                agent,
                tenant: TenantId::new(),
            }
        }

        fn signed(&self, task: &str) -> Value {
            let mut envelope = json!({
                "contractVersion": "agent-task-transport/v1", "agentId": self.agent.to_string(),
                "taskId": task, "success": true, "duration": "00:00:01",
                "completedAt": "2026-01-01T00:00:00Z", "signatureAlgorithm": "ecdsa-sha256",
            });
            let input = berth_proto::transport::signing_input(&envelope).unwrap();
            envelope["signature"] = STANDARD.encode(self.key.sign(&input).unwrap()).into();
            envelope
        }

        /// Entries: an admin action, then two signed results.
        fn entries(&self) -> Vec<Value> {
            let admin = AuditActor::Token {
                id: uuid::Uuid::new_v4(),
                name: "ops".into(),
                role: berth_proto::admin::Role::Admin,
            };
            let result = |task: &str| {
                let evidence = ResultEvidence {
                    envelope: self.signed(task),
                    certificate: STANDARD.encode(&self.cert),
                    state: TaskState::Succeeded,
                };
                (
                    AuditActor::Agent { id: self.agent },
                    actions::TASK_RESULT,
                    task.to_string(),
                    serde_json::to_value(evidence).unwrap(),
                )
            };
            let (t1, t2) = (
                uuid::Uuid::new_v4().to_string(),
                uuid::Uuid::new_v4().to_string(),
            );
            let events = vec![
                (
                    admin,
                    actions::TASK_CREATE,
                    t1.clone(),
                    json!({"type": "inspect"}),
                ),
                result(&t1),
                result(&t2),
            ];
            let mut entries = Vec::new();
            for (actor, action, subject, details) in events {
                let entry = AuditEntry {
                    seq: entries.len() as u64 + 1,
                    tenant_id: self.tenant,
                    at: OffsetDateTime::UNIX_EPOCH,
                    actor,
                    action: action.into(),
                    subject,
                    details,
                    prev_hash: String::new(),
                    hash: String::new(),
                };
                entries.push(serde_json::to_value(entry).unwrap());
            }
            rehash(&mut entries);
            entries
        }
    }

    /// Sets every prevHash and hash as the server would: what a forger who rewrites the whole
    /// chain can do.
    fn rehash(entries: &mut [Value]) {
        let mut prev = GENESIS_HASH.to_string();
        for entry in entries {
            entry["prevHash"] = prev.clone().into();
            let hash = berth_crypto::sha256_hex(&hash_input(entry).unwrap());
            entry["hash"] = hash.clone().into();
            prev = hash;
        }
    }

    fn export(entries: &[Value]) -> String {
        entries.iter().map(|e| format!("{e}\n")).collect()
    }

    fn fault(fixture: &Fixture, entries: &[Value]) -> Fault {
        verify(&export(entries), fixture.ca.cert_der()).expect_err("verify must fail")
    }

    #[test]
    fn a_genuine_export_verifies() {
        let f = Fixture::new();
        assert_eq!(
            verify(&export(&f.entries()), f.ca.cert_der()),
            Ok(Verified {
                entries: 3,
                results: 2
            })
        );
    }

    #[test]
    fn an_altered_entry_is_named() {
        let f = Fixture::new();
        let mut entries = f.entries();
        entries[1]["details"]["state"] = "failed".into();
        let fault = fault(&f, &entries);
        assert_eq!(fault.seq, Some(2), "{fault}");
        assert!(fault.reason.contains("altered"), "{fault}");
    }

    #[test]
    fn reordered_entries_are_named() {
        let f = Fixture::new();
        let mut entries = f.entries();
        entries.swap(1, 2);
        let fault = fault(&f, &entries);
        assert_eq!((fault.line, fault.seq), (2, Some(3)), "{fault}");
        assert!(fault.reason.contains("out of sequence"), "{fault}");
    }

    #[test]
    fn a_swapped_signature_is_named_even_in_a_rehashed_chain() {
        let f = Fixture::new();
        let mut entries = f.entries();
        let other = entries[2]["details"]["envelope"]["signature"].clone();
        entries[1]["details"]["envelope"]["signature"] = other;
        rehash(&mut entries);
        let fault = fault(&f, &entries);
        assert_eq!(fault.seq, Some(2), "{fault}");
        assert!(
            fault.reason.contains("signature does not verify"),
            "{fault}"
        );
    }

    #[test]
    fn a_certificate_of_another_ca_is_named() {
        let f = Fixture::new();
        let other = Fixture::new();
        let entries = f.entries();
        let fault = verify(&export(&entries), other.ca.cert_der()).expect_err("other CA");
        assert_eq!(fault.seq, Some(2), "{fault}");
        assert!(fault.reason.contains("not issued by the CA"), "{fault}");
    }

    #[test]
    fn a_removed_entry_is_named() {
        let f = Fixture::new();
        let mut entries = f.entries();
        entries.remove(0);
        assert_eq!(fault(&f, &entries).seq, Some(2));
    }
}
