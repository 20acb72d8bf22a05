//! Releases on SQLite.

use berth_proto::{ReleaseId, TenantId};
use rusqlite::params;

use super::{id_text, json_text, Query, SqliteStore};
use crate::domain::releases::release_event;
use crate::rows::{self, release_columns, unix_millis};
use crate::{Page, Release, ReleaseStore, Result};
use berth_proto::audit::AuditActor;

#[async_trait::async_trait]
impl ReleaseStore for SqliteStore {
    async fn create_release(&self, release: Release, actor: AuditActor) -> Result<Release> {
        let components = json_text("releases.components", &release.components)?;
        let ssh = release
            .ssh
            .as_ref()
            .map(|s| json_text("releases.ssh", s))
            .transpose()?;
        self.writer
            .write("create release", move |tx| {
                let created = tx.one(
                    concat!(
                        "INSERT INTO releases \
                         (id, tenant_id, name, components, compose_lock, ssh, created_at) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) RETURNING ",
                        release_columns!()
                    ),
                    params![
                        id_text(release.id.0),
                        id_text(release.tenant_id.0),
                        release.name,
                        components,
                        release.compose_lock,
                        ssh,
                        unix_millis(release.created_at),
                    ],
                    |row| rows::read_release(row),
                )?;
                super::audit::append(tx, release_event(&created, actor))?;
                Ok(created)
            })
            .await
    }

    async fn get_release(&self, tenant: TenantId, name: &str) -> Result<Option<Release>> {
        let name = name.to_owned();
        self.readers
            .read("get release", move |db| {
                db.optional(
                    concat!(
                        "SELECT ",
                        release_columns!(),
                        " FROM releases WHERE tenant_id = ?1 AND name = ?2"
                    ),
                    params![id_text(tenant.0), name],
                    |row| rows::read_release(row),
                )
            })
            .await
    }

    async fn list_releases(
        &self,
        tenant: TenantId,
        after: Option<ReleaseId>,
        limit: u32,
    ) -> Result<Page<Release>> {
        let limit = limit.max(1);
        let mut query = Query::new(concat!(
            "SELECT ",
            release_columns!(),
            " FROM releases WHERE tenant_id = "
        ));
        query.push_bind(id_text(tenant.0));
        self.fetch_page(
            "list releases",
            query,
            crate::rows::PageRequest {
                after: after.map(|id| id.0),
                order: berth_proto::task::ListOrder::Oldest,
                limit,
            },
            |row| rows::read_release(row),
            |r| r.id.0,
        )
        .await
    }
}
