//! SSH targets and artifacts on PostgreSQL.

use berth_proto::audit::{actions, AuditActor};
use berth_proto::{SshTargetId, TenantId};
use sqlx::types::Json;
use time::OffsetDateTime;

use super::PostgresStore;
use crate::domain::ssh_targets::{artifact_event, ssh_target_event};
use crate::rows::{self, artifact_columns, db_error, get, millis, ssh_target_columns};
use crate::{Artifact, ArtifactStore, Result, SshTarget, SshTargetStore};

#[async_trait::async_trait]
impl SshTargetStore for PostgresStore {
    async fn create_ssh_target(&self, target: SshTarget, actor: AuditActor) -> Result<SshTarget> {
        const OP: &str = "create ssh target";
        let mut tx = self.begin(OP).await?;
        let row = sqlx::query(concat!(
            "INSERT INTO ssh_targets (id, tenant_id, name, host, port, user_name, via_agent, \
             via_selector, host_key, key_secret, labels, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) RETURNING ",
            ssh_target_columns!()
        ))
        .bind(target.id.0)
        .bind(target.tenant_id.0)
        .bind(&target.name)
        .bind(&target.host)
        .bind(i64::from(target.port))
        .bind(&target.user)
        .bind(&target.via_agent)
        .bind(Json(&target.via_selector))
        .bind(&target.host_key)
        .bind(&target.key_secret)
        .bind(Json(&target.labels))
        .bind(millis(target.created_at))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let created = rows::read_ssh_target(&row)?;
        super::audit::append(
            &mut tx,
            ssh_target_event(
                &created,
                actions::SSH_TARGET_CREATE,
                actor,
                created.created_at,
            ),
        )
        .await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(created)
    }

    async fn get_ssh_target(&self, tenant: TenantId, name: &str) -> Result<Option<SshTarget>> {
        sqlx::query(concat!(
            "SELECT ",
            ssh_target_columns!(),
            " FROM ssh_targets WHERE tenant_id = $1 AND name = $2"
        ))
        .bind(tenant.0)
        .bind(name)
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("get ssh target"))?
        .map(|row| rows::read_ssh_target(&row))
        .transpose()
    }

    async fn get_ssh_target_by_id(
        &self,
        tenant: TenantId,
        id: SshTargetId,
    ) -> Result<Option<SshTarget>> {
        sqlx::query(concat!(
            "SELECT ",
            ssh_target_columns!(),
            " FROM ssh_targets WHERE tenant_id = $1 AND id = $2"
        ))
        .bind(tenant.0)
        .bind(id.0)
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("get ssh target by id"))?
        .map(|row| rows::read_ssh_target(&row))
        .transpose()
    }

    async fn list_ssh_targets(&self, tenant: TenantId) -> Result<Vec<SshTarget>> {
        sqlx::query(concat!(
            "SELECT ",
            ssh_target_columns!(),
            " FROM ssh_targets WHERE tenant_id = $1 ORDER BY name"
        ))
        .bind(tenant.0)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list ssh targets"))?
        .iter()
        .map(rows::read_ssh_target)
        .collect()
    }

    async fn delete_ssh_target(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<bool> {
        const OP: &str = "delete ssh target";
        let mut tx = self.begin(OP).await?;
        let deleted = sqlx::query(concat!(
            "DELETE FROM ssh_targets WHERE tenant_id = $1 AND name = $2 RETURNING ",
            ssh_target_columns!()
        ))
        .bind(tenant.0)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_ssh_target(&row))
        .transpose()?;
        if let Some(target) = &deleted {
            super::audit::append(
                &mut tx,
                ssh_target_event(target, actions::SSH_TARGET_DELETE, actor, now),
            )
            .await?;
        }
        tx.commit().await.map_err(db_error(OP))?;
        Ok(deleted.is_some())
    }
}

#[async_trait::async_trait]
impl ArtifactStore for PostgresStore {
    async fn put_artifact(
        &self,
        artifact: Artifact,
        content: Vec<u8>,
        actor: AuditActor,
    ) -> Result<Artifact> {
        const OP: &str = "put artifact";
        let mut tx = self.begin(OP).await?;
        let inserted = sqlx::query(
            "INSERT INTO artifacts (tenant_id, sha256, size, content, created_by, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (tenant_id, sha256) DO NOTHING",
        )
        .bind(artifact.tenant_id.0)
        .bind(&artifact.sha256)
        .bind(i64::try_from(artifact.size).unwrap_or(i64::MAX))
        .bind(&content)
        .bind(Json(&actor))
        .bind(millis(artifact.created_at))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .rows_affected();
        if inserted > 0 {
            super::audit::append(&mut tx, artifact_event(&artifact, actor)).await?;
        }
        let row = sqlx::query(concat!(
            "SELECT ",
            artifact_columns!(),
            " FROM artifacts WHERE tenant_id = $1 AND sha256 = $2"
        ))
        .bind(artifact.tenant_id.0)
        .bind(&artifact.sha256)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let stored = rows::read_artifact(&row)?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(stored)
    }

    async fn get_artifact(&self, tenant: TenantId, sha256: &str) -> Result<Option<Artifact>> {
        sqlx::query(concat!(
            "SELECT ",
            artifact_columns!(),
            " FROM artifacts WHERE tenant_id = $1 AND sha256 = $2"
        ))
        .bind(tenant.0)
        .bind(sha256)
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("get artifact"))?
        .map(|row| rows::read_artifact(&row))
        .transpose()
    }

    async fn artifact_content(&self, tenant: TenantId, sha256: &str) -> Result<Option<Vec<u8>>> {
        sqlx::query("SELECT content FROM artifacts WHERE tenant_id = $1 AND sha256 = $2")
            .bind(tenant.0)
            .bind(sha256)
            .fetch_optional(&mut *self.conn().await?)
            .await
            .map_err(db_error("artifact content"))?
            .map(|row| get::<_, Vec<u8>>(&row, "content"))
            .transpose()
    }

    async fn list_artifacts(&self, tenant: TenantId) -> Result<Vec<Artifact>> {
        sqlx::query(concat!(
            "SELECT ",
            artifact_columns!(),
            " FROM artifacts WHERE tenant_id = $1 ORDER BY created_at DESC, sha256"
        ))
        .bind(tenant.0)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list artifacts"))?
        .iter()
        .map(rows::read_artifact)
        .collect()
    }
}
