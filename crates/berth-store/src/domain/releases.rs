//! Releases: immutable, a name unique in its tenant plus components pinned by digest, or a
//! compose lock. The server resolves every digest before it writes one; the store only keeps
//! what it was given and refuses a second release of the same name.

use berth_proto::audit::AuditActor;
use berth_proto::release::Component;
use berth_proto::{ReleaseId, TenantId};
use time::OffsetDateTime;

use crate::{Page, Result};

/// The audit entry of a release's creation: what it pins, by digest.
pub(crate) fn release_event(release: &Release, actor: AuditActor) -> crate::NewAuditEvent {
    crate::NewAuditEvent {
        tenant_id: release.tenant_id,
        actor,
        action: berth_proto::audit::actions::RELEASE_CREATE,
        subject: release.id.to_string(),
        details: serde_json::json!({
            "name": release.name,
            "components": release.components.iter().map(|c| serde_json::json!({
                "name": c.name, "image": c.image, "digest": c.digest,
            })).collect::<Vec<_>>(),
            "composeLock": release.compose_lock.is_some(),
            "sshArtifacts": release.ssh.as_ref().map(|s| s.artifacts.iter().map(|a| serde_json::json!({
                "name": a.name, "sha256": a.sha256,
            })).collect::<Vec<_>>()),
        }),
        at: release.created_at,
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Release {
    pub id: ReleaseId,
    pub tenant_id: TenantId,
    pub name: String,
    pub components: Vec<Component>,
    pub compose_lock: Option<String>,
    /// What it deploys to SSH targets.
    pub ssh: Option<berth_proto::release::SshRelease>,
    pub created_at: OffsetDateTime,
}

/// Releases. Part of [`crate::Store`]. There is no update: a release never changes (the
/// migration's trigger refuses any `UPDATE`).
#[async_trait::async_trait]
pub trait ReleaseStore: Send + Sync {
    /// `Conflict { constraint: "release_name" }` when the tenant has a release of that name
    /// (the unique constraint decides, so two concurrent creates cannot both win). A
    /// `release.create` audit entry by `actor` in the same transaction.
    async fn create_release(&self, release: Release, actor: AuditActor) -> Result<Release>;
    /// The tenant's release of that name; another tenant's is `None`.
    async fn get_release(&self, tenant: TenantId, name: &str) -> Result<Option<Release>>;
    /// The tenant's releases in creation (id) order, after the cursor.
    async fn list_releases(
        &self,
        tenant: TenantId,
        after: Option<ReleaseId>,
        limit: u32,
    ) -> Result<Page<Release>>;
}
