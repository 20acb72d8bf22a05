//! Releases on PostgreSQL.

use berth_proto::{ReleaseId, TenantId};
use sqlx::types::Json;
use sqlx::{Postgres, QueryBuilder};

use super::{fetch_page, PostgresStore};
use crate::domain::releases::release_event;
use crate::rows::{self, db_error, millis, release_columns};
use crate::{Page, Release, ReleaseStore, Result};
use berth_proto::audit::AuditActor;

#[async_trait::async_trait]
impl ReleaseStore for PostgresStore {
    async fn create_release(&self, release: Release, actor: AuditActor) -> Result<Release> {
        const OP: &str = "create release";
        let mut tx = self.begin(OP).await?;
        let row = sqlx::query(concat!(
            "INSERT INTO releases (id, tenant_id, name, components, compose_lock, ssh, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING ",
            release_columns!()
        ))
        .bind(release.id.0)
        .bind(release.tenant_id.0)
        .bind(&release.name)
        .bind(Json(&release.components))
        .bind(&release.compose_lock)
        .bind(release.ssh.as_ref().map(Json))
        .bind(millis(release.created_at))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let created = rows::read_release(&row)?;
        super::audit::append(&mut tx, release_event(&created, actor)).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(created)
    }

    async fn get_release(&self, tenant: TenantId, name: &str) -> Result<Option<Release>> {
        sqlx::query(concat!(
            "SELECT ",
            release_columns!(),
            " FROM releases WHERE tenant_id = $1 AND name = $2"
        ))
        .bind(tenant.0)
        .bind(name)
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("get release"))?
        .map(|row| rows::read_release(&row))
        .transpose()
    }

    async fn list_releases(
        &self,
        tenant: TenantId,
        after: Option<ReleaseId>,
        limit: u32,
    ) -> Result<Page<Release>> {
        let limit = limit.max(1);
        let mut query = QueryBuilder::<Postgres>::new(concat!(
            "SELECT ",
            release_columns!(),
            " FROM releases WHERE tenant_id = "
        ));
        query.push_bind(tenant.0);
        fetch_page(
            &mut *self.conn().await?,
            query,
            crate::rows::PageRequest {
                after: after.map(|id| id.0),
                order: berth_proto::task::ListOrder::Oldest,
                limit,
            },
            "list releases",
            rows::read_release,
            |r| r.id.0,
        )
        .await
    }
}
