//! An environment's readiness (issue 14): the conditions its last pass observed, the pass in
//! flight, and the operator's verify nonce. What a condition means and how a pass runs is the
//! server's readiness reconciler's business (`berth-server/src/readiness.rs`); the store keeps
//! the row, lets two replicas' reconcilers write it only by compare-and-set on `version`, and
//! never lets a reconciler's write touch the nonce an operator set meanwhile.

use berth_proto::audit::AuditActor;
use berth_proto::readiness::Condition;
use berth_proto::{AgentId, EnvironmentId, TaskId, TenantId};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::{Environment, Result};

/// One environment's readiness row.
#[derive(Debug, Clone, PartialEq)]
pub struct Readiness {
    pub tenant_id: TenantId,
    pub environment_id: EnvironmentId,
    /// The environment's generation (spec revision) as the reconciler counts it.
    pub generation: i64,
    /// What `generation` was counted for: the reconciler's summary of the environment's spec.
    /// Another summary means a new generation.
    pub spec: String,
    /// In `ConditionType::ALL` order.
    pub conditions: Vec<Condition>,
    /// Every condition `True` for `generation`, as the last completed pass found.
    pub operational_ready: bool,
    /// The pass in flight or last finished.
    pub pass: Option<ReadinessPass>,
    /// The last nonce `verify` set: written only by [`ReadinessStore::request_verify`].
    pub verify_request: Option<String>,
    /// The last nonce a completed pass answered.
    pub verify_observed: Option<String>,
    /// Incremented by each [`ReadinessStore::put_readiness`].
    pub version: i64,
    pub updated_at: OffsetDateTime,
}

/// A readiness pass: one fresh evaluation of every condition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReadinessPass {
    /// Names the pass's probe tasks (their idempotency keys).
    pub id: uuid::Uuid,
    #[serde(with = "berth_proto::rfc3339")]
    pub started_at: OffsetDateTime,
    /// The verify nonce this pass answers, when it was started for one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nonce: Option<String>,
    /// Each target's probe task.
    #[serde(default)]
    pub probes: Vec<(AgentId, TaskId)>,
    /// Every condition reached a terminal status.
    #[serde(default)]
    pub complete: bool,
}

/// The audit entry of a verify request.
pub(crate) fn verify_event(
    env: &Environment,
    nonce: &str,
    actor: AuditActor,
    at: OffsetDateTime,
) -> crate::NewAuditEvent {
    crate::NewAuditEvent {
        tenant_id: env.tenant_id,
        actor,
        action: berth_proto::audit::actions::ENVIRONMENT_VERIFY,
        subject: env.id.to_string(),
        details: serde_json::json!({ "name": env.name, "nonce": nonce }),
        at,
    }
}

/// Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait ReadinessStore: Send + Sync {
    /// The environment's readiness row, if any pass or verify made one.
    async fn get_readiness(
        &self,
        tenant: TenantId,
        environment: EnvironmentId,
    ) -> Result<Option<Readiness>>;
    /// Writes `readiness` except its `verify_request`. `expected`: `None` inserts (nothing
    /// written when a row exists); `Some(v)` updates only while the row's version is `v`, to
    /// v + 1. Whether it was written: a `false` means another writer came first.
    async fn put_readiness(&self, readiness: Readiness, expected: Option<i64>) -> Result<bool>;
    /// Sets the environment's verify nonce (creating its row if needed), with an
    /// `environment.verify` audit entry by `actor`, in one transaction.
    async fn request_verify(
        &self,
        env: &Environment,
        nonce: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<()>;
    /// Environments of every tenant, by id after `after`, at most `limit` (the sweep).
    async fn readiness_environments(
        &self,
        after: Option<EnvironmentId>,
        limit: u32,
    ) -> Result<Vec<Environment>>;
}
