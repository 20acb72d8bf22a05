//! The audit log (`GET /api/v1/audit`, `berth audit export|verify`): one hash-chained entry per
//! admin action and per verified agent result, in one chain per tenant.
//!
//! An entry's `hash` is the lowercase hex SHA-256 of [`hash_input`]: the RFC 8785 (JCS) JSON
//! of the entry without `hash`, so `seq` and `prevHash` are covered. The first entry of a
//! tenant has `seq` 1 and `prevHash` [`GENESIS_HASH`]. A result entry (`task.result`) carries
//! the signed envelope as received and the certificate it was verified with
//! ([`ResultEvidence`]), so the signature can be checked again with no server. Secrets never
//! enter an entry: tokens appear by id, name and role only.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::admin::Role;
use crate::{Method, Request, TenantId};

/// `prevHash` of a chain's first entry.
pub const GENESIS_HASH: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The actions berth records.
pub mod actions {
    pub const TENANT_CREATE: &str = "tenant.create";
    pub const API_TOKEN_CREATE: &str = "api_token.create";
    pub const AGENT_TOKEN_CREATE: &str = "agent_token.create";
    pub const AGENT_UPDATE: &str = "agent.update";
    pub const AGENT_DELETE: &str = "agent.delete";
    /// No new work is routed to the agent (`details`: `{}`); `agent.uncordon` lifts it.
    pub const AGENT_CORDON: &str = "agent.cordon";
    pub const AGENT_UNCORDON: &str = "agent.uncordon";
    /// The agent claims nothing new; `agent.resume` lifts it.
    pub const AGENT_SUSPEND: &str = "agent.suspend";
    pub const AGENT_RESUME: &str = "agent.resume";
    pub const TASK_CREATE: &str = "task.create";
    pub const TASK_CANCEL: &str = "task.cancel";
    pub const TASK_RETRY: &str = "task.retry";
    /// `details`: the release's name and components (name, image, digest).
    pub const RELEASE_CREATE: &str = "release.create";
    pub const ENVIRONMENT_CREATE: &str = "environment.create";
    /// The pin a rollback set was lifted.
    pub const ENVIRONMENT_UNPIN: &str = "environment.unpin";
    /// A fresh readiness pass asked for; `details`: the environment's name and the nonce.
    pub const ENVIRONMENT_VERIFY: &str = "environment.verify";
    pub const DEPLOYMENT_CREATE: &str = "deployment.create";
    pub const DEPLOYMENT_APPROVE: &str = "deployment.approve";
    pub const DEPLOYMENT_CANCEL: &str = "deployment.cancel";
    /// Webhooks and their notifications (issue 14 item 3).
    pub const WEBHOOK_CREATE: &str = "webhook.create";
    pub const WEBHOOK_DELETE: &str = "webhook.delete";
    pub const NOTIFICATION_RESEND: &str = "notification.resend";
    /// The environment now wants a pushed bundle; `details`: its name and the sha.
    pub const ENVIRONMENT_SET_DESIRED: &str = "environment.set_desired";
    /// Checkins answer `down` from now on; `details`: its name and `purgeVolumes`.
    pub const ENVIRONMENT_RETIRE: &str = "environment.retire";
    /// A desired-state agent's report; `details`: the agent, result, sha, detail and the
    /// redacted head of `log_tail` (`desired::AUDIT_LOG_TAIL_BYTES`).
    pub const DESIRED_REPORT: &str = "desired.report";
    /// A builtin secret's new version; `details`: its path and version, never the value.
    pub const SECRET_PUT: &str = "secret.put";
    /// Every version of a builtin secret marked deleted; `details`: the path.
    pub const SECRET_DELETE: &str = "secret.delete";
    /// An install kit revealed: `details` the grant's jti and how many grants it superseded,
    /// never the grant itself.
    pub const ENVIRONMENT_KIT: &str = "environment.kit";
    /// `details`: the SSH target's name, address, via and pinned host key (never the key).
    pub const SSH_TARGET_CREATE: &str = "ssh_target.create";
    pub const SSH_TARGET_DELETE: &str = "ssh_target.delete";
    /// A new artifact stored; `details`: its sha256 and size.
    pub const ARTIFACT_PUSH: &str = "artifact.push";
    /// A verified agent result; `details` is a [`super::ResultEvidence`].
    pub const TASK_RESULT: &str = "task.result";
}

/// Who acted: an API token (by id, name and role, never its secret) or an agent (by id; its
/// proof is the certificate in the entry).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", tag = "kind")]
pub enum AuditActor {
    Token {
        id: uuid::Uuid,
        name: String,
        role: Role,
    },
    Agent {
        id: uuid::Uuid,
    },
    /// A seed 001 agent authenticated by an OpenBao token: the environment it was minted for and
    /// the deploy grant it was minted from.
    #[serde(rename_all = "camelCase")]
    OpenbaoToken {
        environment: String,
        grant_jti: String,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AuditEntry {
    /// 1, 2, 3, … within the tenant's chain, without gaps.
    pub seq: u64,
    pub tenant_id: TenantId,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub at: OffsetDateTime,
    pub actor: AuditActor,
    /// One of [`actions`].
    pub action: String,
    /// The id of the object acted on (tenant, token, agent, task, environment or deployment).
    pub subject: String,
    /// What was done, beyond the action: for `task.result` a [`ResultEvidence`].
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub details: serde_json::Value,
    /// The previous entry's `hash` ([`GENESIS_HASH`] for `seq` 1).
    pub prev_hash: String,
    pub hash: String,
}

/// `details` of a `task.result` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResultEvidence {
    /// The signed `AgentTaskResultEnvelope` exactly as received, `signature` included.
    pub envelope: serde_json::Value,
    /// The agent's certificate at that time: standard base64 of its DER.
    pub certificate: String,
    /// The task's state after the result.
    pub state: crate::task::TaskState,
}

/// The bytes an entry's `hash` covers: JCS of the entry without its `hash` member.
pub fn hash_input(entry: &serde_json::Value) -> Result<Vec<u8>, serde_json::Error> {
    crate::json::jcs_without(entry, "hash")
}

/// Lowercase hex SHA-256 of an entry's [`hash_input`]: its `hash`.
pub fn entry_hash(hash_input: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(hash_input)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Why an entry breaks its chain. Each variant names the entry by the `seq` it claims.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainFault {
    /// Not the `seq` after its predecessor's.
    OutOfSequence { seq: u64, expected: u64 },
    /// Of another tenant than the entries before it.
    OtherTenant { seq: u64 },
    /// Its `prevHash` is not its predecessor's `hash` (or [`GENESIS_HASH`] for `seq` 1).
    BrokenLink {
        seq: u64,
        prev_hash: String,
        expected: String,
    },
    /// Its `hash` is not the hash of its content.
    Altered {
        seq: u64,
        hash: String,
        computed: String,
    },
    /// It has no canonical form (JCS) to hash.
    NoCanonicalForm { seq: u64, detail: String },
}

impl ChainFault {
    /// The `seq` of the entry at fault.
    pub fn seq(&self) -> u64 {
        match self {
            ChainFault::OutOfSequence { seq, .. }
            | ChainFault::OtherTenant { seq }
            | ChainFault::BrokenLink { seq, .. }
            | ChainFault::Altered { seq, .. }
            | ChainFault::NoCanonicalForm { seq, .. } => *seq,
        }
    }
}

impl std::fmt::Display for ChainFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ChainFault::OutOfSequence { expected, .. } => write!(
                f,
                "out of sequence: expected seq {expected} (an entry was removed, inserted or moved)"
            ),
            ChainFault::OtherTenant { .. } => f.write_str("belongs to another tenant's chain"),
            ChainFault::BrokenLink {
                prev_hash,
                expected,
                ..
            } => write!(
                f,
                "prevHash {prev_hash} is not the previous entry's hash {expected}"
            ),
            ChainFault::Altered { hash, computed, .. } => write!(
                f,
                "hash {hash} does not match its content (which hashes to {computed}): the entry was altered"
            ),
            ChainFault::NoCanonicalForm { detail, .. } => {
                write!(f, "no canonical form: {detail}")
            }
        }
    }
}

impl std::error::Error for ChainFault {}

/// The one check of an audit chain, entry by entry, in order: `seq` counts up by one, every
/// entry is of the first one's tenant, `prevHash` is the previous entry's `hash`, and `hash` is
/// [`entry_hash`] of the entry's [`hash_input`]. The store's tests, `berth audit verify` and the
/// web UI all check through it. It proves order and completeness against edits that do not
/// rewrite every later hash; only the results' signatures prove who wrote them.
#[derive(Debug, Clone)]
pub struct ChainCheck {
    next_seq: u64,
    /// The `hash` the next entry must link to; `None` when the run starts mid-chain and its
    /// predecessor was not seen (its first link cannot be checked).
    prev_hash: Option<String>,
    tenant: Option<TenantId>,
}

impl ChainCheck {
    /// A run of entries that starts after `seq` `after` (0: at the chain's start, where the first
    /// entry must link to [`GENESIS_HASH`]).
    pub fn after(after: u64) -> ChainCheck {
        ChainCheck {
            next_seq: after + 1,
            prev_hash: (after == 0).then(|| GENESIS_HASH.to_string()),
            tenant: None,
        }
    }

    /// Checks the next entry, typed.
    pub fn entry(&mut self, entry: &AuditEntry) -> Result<(), ChainFault> {
        let value = serde_json::to_value(entry).map_err(|e| ChainFault::NoCanonicalForm {
            seq: entry.seq,
            detail: e.to_string(),
        })?;
        self.entry_as_read(entry, &value)
    }

    /// Checks the next entry, hashing `value`: the entry exactly as it was read (an export's
    /// line), so a member the type does not know is covered too.
    pub fn entry_as_read(
        &mut self,
        entry: &AuditEntry,
        value: &serde_json::Value,
    ) -> Result<(), ChainFault> {
        let seq = entry.seq;
        if seq != self.next_seq {
            return Err(ChainFault::OutOfSequence {
                seq,
                expected: self.next_seq,
            });
        }
        if *self.tenant.get_or_insert(entry.tenant_id) != entry.tenant_id {
            return Err(ChainFault::OtherTenant { seq });
        }
        if let Some(expected) = self.prev_hash.as_ref().filter(|p| **p != entry.prev_hash) {
            return Err(ChainFault::BrokenLink {
                seq,
                prev_hash: entry.prev_hash.clone(),
                expected: expected.clone(),
            });
        }
        let input = hash_input(value).map_err(|e| ChainFault::NoCanonicalForm {
            seq,
            detail: e.to_string(),
        })?;
        let computed = entry_hash(&input);
        if entry.hash != computed {
            return Err(ChainFault::Altered {
                seq,
                hash: entry.hash.clone(),
                computed,
            });
        }
        self.next_seq = seq + 1;
        self.prev_hash = Some(entry.hash.clone());
        Ok(())
    }
}

/// Checks `entries`, a run of one chain that starts after `seq` `after` (0: the whole chain),
/// and returns how many there were.
pub fn verify_chain(entries: &[AuditEntry], after: u64) -> Result<u64, ChainFault> {
    let mut check = ChainCheck::after(after);
    for entry in entries {
        check.entry(entry)?;
    }
    Ok(entries.len() as u64)
}

/// `GET /api/v1/audit?after=&limit=` (admin role): the caller's tenant's entries with
/// `seq > after`, in order.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListAudit {
    #[serde(default)]
    pub after: u64,
    /// 1–1000, default 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct AuditPage {
    pub items: Vec<AuditEntry>,
    /// The last `seq` of this page when more may follow; pass it back as `after`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<u64>,
}

impl Request for ListAudit {
    type Response = AuditPage;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        match self.limit {
            Some(limit) => format!("/api/v1/audit?after={}&limit={limit}", self.after),
            None => format!("/api/v1/audit?after={}", self.after),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u64) -> Vec<AuditEntry> {
        let tenant = TenantId::new();
        let mut out: Vec<AuditEntry> = Vec::new();
        for seq in 1..=n {
            let mut entry = AuditEntry {
                seq,
                tenant_id: tenant,
                at: OffsetDateTime::UNIX_EPOCH,
                actor: AuditActor::Agent {
                    id: uuid::Uuid::nil(),
                },
                action: actions::TASK_CREATE.into(),
                subject: format!("task-{seq}"),
                details: serde_json::json!({"n": seq}),
                prev_hash: out
                    .last()
                    .map_or(GENESIS_HASH.to_string(), |e| e.hash.clone()),
                hash: String::new(),
            };
            rehash(&mut entry);
            out.push(entry);
        }
        out
    }

    /// What a forger who rewrites an entry's hash can do.
    fn rehash(entry: &mut AuditEntry) {
        let value = serde_json::to_value(&*entry).unwrap();
        entry.hash = entry_hash(&hash_input(&value).unwrap());
    }

    #[test]
    fn entry_hash_is_sha256_hex() {
        assert_eq!(
            entry_hash(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn the_chain_check_names_each_kind_of_break() {
        type Case = (
            &'static str,
            fn(&mut Vec<AuditEntry>),
            u64,
            Option<(u64, &'static str)>,
        );
        let cases: [Case; 8] = [
            ("a good chain", |_| {}, 0, None),
            (
                "a good page after seq 2",
                |c| {
                    c.drain(..2);
                },
                2,
                None,
            ),
            (
                "a tampered entry",
                |c| c[1].details = serde_json::json!({"n": 99}),
                0,
                Some((2, "altered")),
            ),
            (
                "a tampered entry, rehashed",
                |c| {
                    c[1].subject = "forged".into();
                    rehash(&mut c[1]);
                },
                0,
                Some((3, "prevHash")),
            ),
            (
                "reordered entries",
                |c| c.swap(1, 2),
                0,
                Some((3, "out of sequence")),
            ),
            (
                "a removed entry",
                |c| {
                    c.remove(1);
                },
                0,
                Some((3, "out of sequence")),
            ),
            (
                "a missing link",
                |c| {
                    c[2].prev_hash = GENESIS_HASH.into();
                    rehash(&mut c[2]);
                },
                0,
                Some((3, "prevHash")),
            ),
            (
                "another tenant's entry",
                |c| {
                    c[3].tenant_id = TenantId::new();
                    rehash(&mut c[3]);
                },
                0,
                Some((4, "another tenant")),
            ),
        ];
        for (name, break_it, after, expected) in cases {
            let mut entries = chain(4);
            break_it(&mut entries);
            let got = verify_chain(&entries, after);
            match expected {
                None => assert_eq!(got, Ok(entries.len() as u64), "{name}"),
                Some((seq, words)) => {
                    let fault = got.expect_err(name);
                    assert_eq!(fault.seq(), seq, "{name}: {fault}");
                    assert!(fault.to_string().contains(words), "{name}: {fault}");
                }
            }
        }
    }

    #[test]
    fn a_chain_must_start_at_genesis() {
        let mut entries = chain(2);
        entries[0].prev_hash = "f".repeat(64);
        rehash(&mut entries[0]);
        let fault = verify_chain(&entries, 0).expect_err("a first entry off genesis");
        assert!(
            matches!(fault, ChainFault::BrokenLink { seq: 1, .. }),
            "{fault}"
        );
        // A page that starts mid-chain cannot check its first link, only the rest.
        let mut page = chain(3);
        page.remove(0);
        assert_eq!(verify_chain(&page, 1), Ok(2));
        assert!(
            verify_chain(&page, 0).is_err(),
            "seq 2 is not the chain's start"
        );
    }

    #[test]
    fn an_exported_line_is_hashed_as_read() {
        let entries = chain(1);
        let mut value = serde_json::to_value(&entries[0]).unwrap();
        value["added"] = "by hand".into();
        let fault = ChainCheck::after(0)
            .entry_as_read(&entries[0], &value)
            .expect_err("a member added to the line changes its hash");
        assert!(
            matches!(fault, ChainFault::Altered { seq: 1, .. }),
            "{fault}"
        );
    }

    #[test]
    fn hash_input_is_jcs_without_the_hash() {
        let entry = serde_json::json!({"seq": 2, "hash": "h", "prevHash": "p", "action": "a"});
        assert_eq!(
            String::from_utf8(hash_input(&entry).unwrap()).unwrap(),
            r#"{"action":"a","prevHash":"p","seq":2}"#
        );
    }
}
