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

    #[test]
    fn hash_input_is_jcs_without_the_hash() {
        let entry = serde_json::json!({"seq": 2, "hash": "h", "prevHash": "p", "action": "a"});
        assert_eq!(
            String::from_utf8(hash_input(&entry).unwrap()).unwrap(),
            r#"{"action":"a","prevHash":"p","seq":2}"#
        );
    }
}
