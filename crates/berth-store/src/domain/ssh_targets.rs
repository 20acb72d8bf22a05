//! SSH targets and the artifacts releases ship to them (issue 12). The store keeps the rows;
//! which agent acts for a target, and what it deploys there, the server decides
//! (`berth-server/src/targets.rs`).

use std::collections::BTreeMap;

use berth_proto::audit::{actions, AuditActor};
use berth_proto::{SshTargetId, TenantId};
use time::OffsetDateTime;

use crate::Result;

#[derive(Debug, Clone, PartialEq)]
pub struct SshTarget {
    pub id: SshTargetId,
    pub tenant_id: TenantId,
    pub name: String,
    pub host: String,
    pub port: u16,
    pub user: String,
    /// Exactly one of these: an agent by name, or a non-empty label selector.
    pub via_agent: Option<String>,
    pub via_selector: BTreeMap<String, String>,
    pub host_key: String,
    /// The builtin secret holding the private key (its store key, `<env>/<name>`).
    pub key_secret: String,
    pub labels: BTreeMap<String, String>,
    pub created_at: OffsetDateTime,
}

/// An artifact's metadata; the bytes come from [`ArtifactStore::artifact_content`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Artifact {
    pub tenant_id: TenantId,
    pub sha256: String,
    pub size: u64,
    pub created_at: OffsetDateTime,
}

pub(crate) fn ssh_target_event(
    target: &SshTarget,
    action: &'static str,
    actor: AuditActor,
    at: OffsetDateTime,
) -> crate::NewAuditEvent {
    crate::NewAuditEvent {
        tenant_id: target.tenant_id,
        actor,
        action,
        subject: target.id.to_string(),
        details: serde_json::json!({
            "name": target.name,
            "host": target.host,
            "port": target.port,
            "user": target.user,
            "viaAgent": target.via_agent,
            "viaSelector": target.via_selector,
            "hostKey": target.host_key,
            "keySecret": target.key_secret,
        }),
        at,
    }
}

pub(crate) fn artifact_event(artifact: &Artifact, actor: AuditActor) -> crate::NewAuditEvent {
    crate::NewAuditEvent {
        tenant_id: artifact.tenant_id,
        actor,
        action: actions::ARTIFACT_PUSH,
        subject: artifact.sha256.clone(),
        details: serde_json::json!({ "sha256": artifact.sha256, "size": artifact.size }),
        at: artifact.created_at,
    }
}

/// Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait SshTargetStore: Send + Sync {
    /// `Conflict { constraint: "ssh_target_name" }` when the tenant has one of that name. An
    /// `ssh_target.create` audit entry by `actor` in the same transaction.
    async fn create_ssh_target(&self, target: SshTarget, actor: AuditActor) -> Result<SshTarget>;
    async fn get_ssh_target(&self, tenant: TenantId, name: &str) -> Result<Option<SshTarget>>;
    async fn get_ssh_target_by_id(
        &self,
        tenant: TenantId,
        id: SshTargetId,
    ) -> Result<Option<SshTarget>>;
    /// Every SSH target of the tenant, by name.
    async fn list_ssh_targets(&self, tenant: TenantId) -> Result<Vec<SshTarget>>;
    /// Whether it existed; an `ssh_target.delete` audit entry when it did.
    async fn delete_ssh_target(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<bool>;
}

/// Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait ArtifactStore: Send + Sync {
    /// Stores the bytes under their SHA-256 (computed by the caller, checked by nobody else:
    /// the server hashes what it received). A second put of the same sha keeps the first row
    /// and writes no audit entry; a new one writes an `artifact.push` entry.
    async fn put_artifact(
        &self,
        artifact: Artifact,
        content: Vec<u8>,
        actor: AuditActor,
    ) -> Result<Artifact>;
    async fn get_artifact(&self, tenant: TenantId, sha256: &str) -> Result<Option<Artifact>>;
    async fn artifact_content(&self, tenant: TenantId, sha256: &str) -> Result<Option<Vec<u8>>>;
    /// The tenant's artifacts, newest first.
    async fn list_artifacts(&self, tenant: TenantId) -> Result<Vec<Artifact>>;
}
