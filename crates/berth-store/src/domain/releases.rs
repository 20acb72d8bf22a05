//! Releases: immutable, a name unique in its tenant plus components pinned by digest, or a
//! compose lock. The server resolves every digest before it writes one; the store only keeps
//! what it was given and refuses a second release of the same name.

use berth_proto::release::Component;
use berth_proto::{ReleaseId, TenantId};
use time::OffsetDateTime;

use crate::{Page, Result};

#[derive(Debug, Clone, PartialEq)]
pub struct Release {
    pub id: ReleaseId,
    pub tenant_id: TenantId,
    pub name: String,
    pub components: Vec<Component>,
    pub compose_lock: Option<String>,
    pub created_at: OffsetDateTime,
}

/// Releases. Part of [`crate::Store`]. There is no update: a release never changes (the
/// migration's trigger refuses any `UPDATE`).
#[async_trait::async_trait]
pub trait ReleaseStore: Send + Sync {
    /// `Conflict { constraint: "release_name" }` when the tenant has a release of that name
    /// (the unique constraint decides, so two concurrent creates cannot both win).
    async fn create_release(&self, release: Release) -> Result<Release>;
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
