//! SSH targets and artifacts on SQLite.

use berth_proto::audit::{actions, AuditActor};
use berth_proto::{SshTargetId, TenantId};
use rusqlite::params;
use time::OffsetDateTime;

use super::{cell, id_text, json_text, SqliteStore};
use crate::domain::ssh_targets::{artifact_event, ssh_target_event};
use crate::rows::{self, artifact_columns, ssh_target_columns, unix_millis};
use crate::{Artifact, ArtifactStore, Result, SshTarget, SshTargetStore};

#[async_trait::async_trait]
impl SshTargetStore for SqliteStore {
    async fn create_ssh_target(&self, target: SshTarget, actor: AuditActor) -> Result<SshTarget> {
        let via_selector = json_text("ssh_targets.via_selector", &target.via_selector)?;
        let labels = json_text("ssh_targets.labels", &target.labels)?;
        self.writer
            .write("create ssh target", move |tx| {
                let created = tx.one(
                    concat!(
                        "INSERT INTO ssh_targets (id, tenant_id, name, host, port, user_name, \
                         via_agent, via_selector, host_key, key_secret, labels, created_at) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12) RETURNING ",
                        ssh_target_columns!()
                    ),
                    params![
                        id_text(target.id.0),
                        id_text(target.tenant_id.0),
                        target.name,
                        target.host,
                        target.port,
                        target.user,
                        target.via_agent,
                        via_selector,
                        target.host_key,
                        target.key_secret,
                        labels,
                        unix_millis(target.created_at),
                    ],
                    |row| rows::read_ssh_target(row),
                )?;
                super::audit::append(
                    tx,
                    ssh_target_event(
                        &created,
                        actions::SSH_TARGET_CREATE,
                        actor,
                        created.created_at,
                    ),
                )?;
                Ok(created)
            })
            .await
    }

    async fn get_ssh_target(&self, tenant: TenantId, name: &str) -> Result<Option<SshTarget>> {
        let name = name.to_owned();
        self.readers
            .read("get ssh target", move |db| {
                db.optional(
                    concat!(
                        "SELECT ",
                        ssh_target_columns!(),
                        " FROM ssh_targets WHERE tenant_id = ?1 AND name = ?2"
                    ),
                    params![id_text(tenant.0), name],
                    |row| rows::read_ssh_target(row),
                )
            })
            .await
    }

    async fn get_ssh_target_by_id(
        &self,
        tenant: TenantId,
        id: SshTargetId,
    ) -> Result<Option<SshTarget>> {
        self.readers
            .read("get ssh target by id", move |db| {
                db.optional(
                    concat!(
                        "SELECT ",
                        ssh_target_columns!(),
                        " FROM ssh_targets WHERE tenant_id = ?1 AND id = ?2"
                    ),
                    params![id_text(tenant.0), id_text(id.0)],
                    |row| rows::read_ssh_target(row),
                )
            })
            .await
    }

    async fn list_ssh_targets(&self, tenant: TenantId) -> Result<Vec<SshTarget>> {
        self.readers
            .read("list ssh targets", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        ssh_target_columns!(),
                        " FROM ssh_targets WHERE tenant_id = ?1 ORDER BY name"
                    ),
                    params![id_text(tenant.0)],
                    |row| rows::read_ssh_target(row),
                )
            })
            .await
    }

    async fn delete_ssh_target(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<bool> {
        let name = name.to_owned();
        self.writer
            .write("delete ssh target", move |tx| {
                let deleted = tx.optional(
                    concat!(
                        "DELETE FROM ssh_targets WHERE tenant_id = ?1 AND name = ?2 RETURNING ",
                        ssh_target_columns!()
                    ),
                    params![id_text(tenant.0), name],
                    |row| rows::read_ssh_target(row),
                )?;
                if let Some(target) = &deleted {
                    super::audit::append(
                        tx,
                        ssh_target_event(target, actions::SSH_TARGET_DELETE, actor, now),
                    )?;
                }
                Ok(deleted.is_some())
            })
            .await
    }
}

#[async_trait::async_trait]
impl ArtifactStore for SqliteStore {
    async fn put_artifact(
        &self,
        artifact: Artifact,
        content: Vec<u8>,
        actor: AuditActor,
    ) -> Result<Artifact> {
        let created_by = json_text("artifacts.created_by", &actor)?;
        self.writer
            .write("put artifact", move |tx| {
                let inserted = tx.execute(
                    "INSERT INTO artifacts (tenant_id, sha256, size, content, created_by, \
                     created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6) \
                     ON CONFLICT (tenant_id, sha256) DO NOTHING",
                    params![
                        id_text(artifact.tenant_id.0),
                        artifact.sha256,
                        i64::try_from(artifact.size).unwrap_or(i64::MAX),
                        content,
                        created_by,
                        unix_millis(artifact.created_at),
                    ],
                )?;
                if inserted > 0 {
                    super::audit::append(tx, artifact_event(&artifact, actor))?;
                }
                tx.one(
                    concat!(
                        "SELECT ",
                        artifact_columns!(),
                        " FROM artifacts WHERE tenant_id = ?1 AND sha256 = ?2"
                    ),
                    params![id_text(artifact.tenant_id.0), artifact.sha256],
                    |row| rows::read_artifact(row),
                )
            })
            .await
    }

    async fn get_artifact(&self, tenant: TenantId, sha256: &str) -> Result<Option<Artifact>> {
        let sha256 = sha256.to_owned();
        self.readers
            .read("get artifact", move |db| {
                db.optional(
                    concat!(
                        "SELECT ",
                        artifact_columns!(),
                        " FROM artifacts WHERE tenant_id = ?1 AND sha256 = ?2"
                    ),
                    params![id_text(tenant.0), sha256],
                    |row| rows::read_artifact(row),
                )
            })
            .await
    }

    async fn artifact_content(&self, tenant: TenantId, sha256: &str) -> Result<Option<Vec<u8>>> {
        let sha256 = sha256.to_owned();
        self.readers
            .read("artifact content", move |db| {
                db.optional(
                    "SELECT content FROM artifacts WHERE tenant_id = ?1 AND sha256 = ?2",
                    params![id_text(tenant.0), sha256],
                    |row| cell::<Vec<u8>>(row, "content"),
                )
            })
            .await
    }

    async fn list_artifacts(&self, tenant: TenantId) -> Result<Vec<Artifact>> {
        self.readers
            .read("list artifacts", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        artifact_columns!(),
                        " FROM artifacts WHERE tenant_id = ?1 ORDER BY created_at DESC, sha256"
                    ),
                    params![id_text(tenant.0)],
                    |row| rows::read_artifact(row),
                )
            })
            .await
    }
}
