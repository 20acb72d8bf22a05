//! The audit log: one hash-chained, append-only chain of entries per tenant
//! (`berth_proto::audit`). Appends are serialised per tenant (SQLite: its single writer;
//! PostgreSQL: a transaction-scoped advisory lock on the tenant's chain), so concurrent writers,
//! replicas included, extend one linear chain. Results are appended inside `complete_attempt`'s
//! own transaction, and so is every operator action (tenant, token and agent-token creation,
//! agent update and delete, task create, cancel and retry): each store method that performs one
//! takes its actor.

use berth_proto::audit::{AuditActor, AuditEntry, GENESIS_HASH};
use berth_proto::TenantId;
use time::OffsetDateTime;

use crate::{Result, StoreError};

/// An event to record; the store gives it its `seq`, `prevHash` and `hash`.
#[derive(Debug, Clone)]
pub struct NewAuditEvent {
    pub tenant_id: TenantId,
    pub actor: AuditActor,
    pub action: &'static str,
    pub subject: String,
    pub details: serde_json::Value,
    pub at: OffsetDateTime,
}

/// The audit log. Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait AuditStore: Send + Sync {
    /// Appends the event at the head of its tenant's chain, in its own transaction: for an event
    /// that belongs to no store action (the server records its actions through the methods that
    /// perform them).
    async fn append_audit(&self, event: NewAuditEvent) -> Result<AuditEntry>;
    /// The tenant's entries with `seq > after`, in `seq` order, at most `limit`.
    async fn list_audit(&self, tenant: TenantId, after: u64, limit: u32)
        -> Result<Vec<AuditEntry>>;
}

/// The entry that follows `head` (`(seq, hash)` of the chain's last entry, None for an empty
/// chain), with its hash, and its stored text. Both backends store that text as it is, so an
/// export hashes to what was written.
pub(crate) fn chain(
    event: NewAuditEvent,
    head: Option<(i64, String)>,
) -> Result<(AuditEntry, String)> {
    link(draft(event), head)
}

/// The entry `event` becomes, not yet linked: no `seq` and no hashes. PostgreSQL stages it as
/// text in the writing transaction and links it later (`postgres/sequencer.rs`).
pub(crate) fn draft(event: NewAuditEvent) -> AuditEntry {
    // Millisecond precision, as every other stored time: the text round-trips exactly.
    let at = event
        .at
        .replace_nanosecond(event.at.millisecond() as u32 * 1_000_000)
        .unwrap_or(event.at);
    AuditEntry {
        seq: 0,
        tenant_id: event.tenant_id,
        at,
        actor: event.actor,
        action: event.action.to_string(),
        subject: event.subject,
        details: event.details,
        prev_hash: String::new(),
        hash: String::new(),
    }
}

/// `draft` linked after `head`: its `seq`, `prevHash` and `hash`, and its stored text.
pub(crate) fn link(
    mut entry: AuditEntry,
    head: Option<(i64, String)>,
) -> Result<(AuditEntry, String)> {
    let (seq, prev_hash) = match head {
        Some((seq, hash)) => (seq + 1, hash),
        None => (1, GENESIS_HASH.to_string()),
    };
    let corrupt = |e: serde_json::Error| StoreError::Corrupt(format!("audit entry: {e}"));
    entry.seq = seq as u64;
    entry.prev_hash = prev_hash;
    entry.hash = String::new();
    let value = serde_json::to_value(&entry).map_err(corrupt)?;
    entry.hash =
        berth_proto::audit::entry_hash(&berth_proto::audit::hash_input(&value).map_err(corrupt)?);
    let text = serde_json::to_string(&entry).map_err(corrupt)?;
    Ok((entry, text))
}

/// Reads a stored entry's text.
pub(crate) fn parse(text: &str) -> Result<AuditEntry> {
    serde_json::from_str(text).map_err(|e| StoreError::Corrupt(format!("audit entry: {e}")))
}

/// The `task.result` entry of a recorded result: the envelope as received and the certificate
/// it was verified with, so `berth audit verify` can check the signature again offline.
/// `state` is the one the result moved the task to.
pub(crate) fn result_event(
    completion: &crate::Completion,
    tenant_id: TenantId,
    task_id: berth_proto::TaskId,
    state: crate::TaskState,
) -> NewAuditEvent {
    use base64::Engine as _;
    let evidence = berth_proto::audit::ResultEvidence {
        envelope: completion.envelope.clone(),
        certificate: base64::engine::general_purpose::STANDARD.encode(&completion.certificate_der),
        state,
    };
    NewAuditEvent {
        tenant_id,
        actor: AuditActor::Agent {
            id: completion.agent_id.0,
        },
        action: berth_proto::audit::actions::TASK_RESULT,
        subject: task_id.to_string(),
        // A struct of JSON values and strings always serialises.
        details: serde_json::to_value(evidence).unwrap_or_default(),
        at: completion.now,
    }
}

/// The `task.create` entry of `task`: what was asked, the payload by its `payloadSha256` (the
/// SHA-256 of its JCS, since the payload is sealed at rest and the audit log is kept for good;
/// never the credentials).
pub(crate) fn task_created_event(task: &crate::NewTask, actor: AuditActor) -> NewAuditEvent {
    let payload_sha256 = serde_jcs::to_vec(&task.payload)
        .map(|jcs| berth_crypto::sha256_hex(&jcs))
        .unwrap_or_default();
    let details = serde_json::json!({"type": task.task_type, "agentId": task.agent_id,
        "payloadSha256": payload_sha256, "variables": task.variables});
    admin_event(
        task.tenant_id,
        actor,
        berth_proto::audit::actions::TASK_CREATE,
        task.id,
        details,
        task.created_at,
    )
}

/// The entry of an operator's action on a task, `task.cancel` or `task.retry`, with the state
/// the task went to.
pub(crate) fn task_event(
    action: &'static str,
    task: &crate::Task,
    actor: AuditActor,
    at: OffsetDateTime,
) -> NewAuditEvent {
    let details = serde_json::json!({"state": task.state});
    admin_event(task.tenant_id, actor, action, task.id, details, at)
}

/// An operator's action on a tenant's object, with what was done in `details`.
pub(crate) fn admin_event(
    tenant_id: TenantId,
    actor: AuditActor,
    action: &'static str,
    subject: impl ToString,
    details: serde_json::Value,
    at: OffsetDateTime,
) -> NewAuditEvent {
    NewAuditEvent {
        tenant_id,
        actor,
        action,
        subject: subject.to_string(),
        details,
        at,
    }
}

/// `api_token.create`: the token's id, name and role, never its secret (nor its hash).
pub(crate) fn api_token_event(token: &crate::ApiToken, actor: AuditActor) -> NewAuditEvent {
    let details = serde_json::json!({"name": token.name, "role": token.role});
    let action = berth_proto::audit::actions::API_TOKEN_CREATE;
    admin_event(
        token.tenant_id,
        actor,
        action,
        token.id,
        details,
        token.created_at,
    )
}

/// `agent_token.create`: what the registration token grants, never the token (nor its hash).
pub(crate) fn agent_token_event(
    token: &crate::NewRegistrationToken,
    actor: AuditActor,
) -> NewAuditEvent {
    let details = serde_json::json!({"labels": token.labels, "environment": token.environment,
        "expiresAt": token.expires_at.unix_timestamp()});
    let action = berth_proto::audit::actions::AGENT_TOKEN_CREATE;
    admin_event(
        token.tenant_id,
        actor,
        action,
        token.id,
        details,
        token.created_at,
    )
}

/// `environment.create`: what the environment says (its policy, selector and approvals).
pub(crate) fn environment_create_event(
    env: &crate::Environment,
    actor: AuditActor,
) -> NewAuditEvent {
    let details = serde_json::json!({"name": env.name, "tier": env.tier,
        "selector": env.selector, "policy": env.policy, "promoteFrom": env.promote_from,
        "approvals": env.approvals, "autoHeal": env.auto_heal,
        "driftIntervalSecs": env.drift_interval_secs});
    let action = berth_proto::audit::actions::ENVIRONMENT_CREATE;
    admin_event(
        env.tenant_id,
        actor,
        action,
        env.id,
        details,
        env.created_at,
    )
}

/// `deployment.create`, by its requester: which release goes where, and how many targets.
pub(crate) fn deployment_create_event(
    created: &crate::DeploymentDetail,
    pinned: bool,
) -> NewAuditEvent {
    let d = &created.deployment;
    let details = serde_json::json!({"environment": d.environment_name,
        "release": d.release.name, "kind": d.kind, "state": d.state,
        "rollbackRelease": d.rollback_release.as_ref().map(|r| &r.name),
        "approvalsRequired": d.approvals_required, "targets": created.targets.len(),
        "pinned": pinned});
    let action = berth_proto::audit::actions::DEPLOYMENT_CREATE;
    admin_event(
        d.tenant_id,
        d.requested_by.clone(),
        action,
        d.id,
        details,
        d.created_at,
    )
}
