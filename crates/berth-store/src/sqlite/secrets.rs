//! Builtin secrets and deploy grants on SQLite.

use berth_proto::audit::AuditActor;
use berth_proto::{EnvironmentId, TenantId};
use rusqlite::params;
use time::OffsetDateTime;

use super::{id_text, json_text, SqliteStore};
use crate::domain::secrets::{kit_event, secret_delete_event, secret_put_event, Superseded};
use crate::rows::{self, grant_columns, secret_meta_columns, unix_millis};
use crate::{
    Grant, GrantStore, GrantUse, Result, SealedSecret, SecretMeta, SecretStore, StoreError,
};

#[async_trait::async_trait]
impl SecretStore for SqliteStore {
    async fn secret_head(&self, tenant: TenantId, key: &str) -> Result<u32> {
        let key = key.to_owned();
        let head = self
            .readers
            .read("secret head", move |db| {
                db.one(
                    "SELECT COALESCE(MAX(version), 0) AS version FROM secrets \
                     WHERE tenant_id = ?1 AND key = ?2",
                    params![id_text(tenant.0), key],
                    |row| rows::ColumnReader::int(row, "version"),
                )
            })
            .await?;
        u32::try_from(head).map_err(|_| StoreError::Corrupt(format!("secrets.version: {head}")))
    }

    async fn put_secret(&self, secret: SealedSecret) -> Result<SecretMeta> {
        let created_by = json_text("secrets.created_by", &secret.meta.created_by)?;
        self.writer
            .write("put secret", move |tx| {
                let meta = tx.one(
                    concat!(
                        "INSERT INTO secrets (tenant_id, key, version, wrapped_key, ciphertext, \
                         created_at, created_by) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) RETURNING ",
                        secret_meta_columns!()
                    ),
                    params![
                        id_text(secret.meta.tenant_id.0),
                        secret.meta.key,
                        i64::from(secret.meta.version),
                        secret.wrapped_key,
                        secret.ciphertext,
                        unix_millis(secret.meta.created_at),
                        created_by,
                    ],
                    |row| rows::read_secret_meta(row),
                )?;
                super::audit::append(tx, secret_put_event(&meta))?;
                Ok(meta)
            })
            .await
    }

    async fn get_secret(
        &self,
        tenant: TenantId,
        key: &str,
        version: Option<u32>,
    ) -> Result<Option<SealedSecret>> {
        let key = key.to_owned();
        self.readers
            .read("get secret", move |db| {
                db.optional(
                    concat!(
                        "SELECT ",
                        secret_meta_columns!(),
                        ", wrapped_key, ciphertext FROM secrets \
                         WHERE tenant_id = ?1 AND key = ?2 AND deleted_at IS NULL \
                         AND (?3 IS NULL OR version = ?3) ORDER BY version DESC LIMIT 1"
                    ),
                    params![id_text(tenant.0), key, version.map(i64::from)],
                    |row| rows::read_sealed_secret(row),
                )
            })
            .await
    }

    async fn list_secrets(&self, tenant: TenantId, prefix: &str) -> Result<Vec<SecretMeta>> {
        let prefix = prefix.to_owned();
        self.readers
            .read("list secrets", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        secret_meta_columns!(),
                        " FROM secrets s WHERE tenant_id = ?1 AND deleted_at IS NULL \
                         AND substr(key, 1, length(?2)) = ?2 \
                         AND version = (SELECT MAX(version) FROM secrets l \
                           WHERE l.tenant_id = s.tenant_id AND l.key = s.key \
                           AND l.deleted_at IS NULL) \
                         ORDER BY key"
                    ),
                    params![id_text(tenant.0), prefix],
                    |row| rows::read_secret_meta(row),
                )
            })
            .await
    }

    async fn secret_versions(&self, tenant: TenantId, key: &str) -> Result<Vec<SecretMeta>> {
        let key = key.to_owned();
        self.readers
            .read("secret versions", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        secret_meta_columns!(),
                        " FROM secrets WHERE tenant_id = ?1 AND key = ?2 ORDER BY version"
                    ),
                    params![id_text(tenant.0), key],
                    |row| rows::read_secret_meta(row),
                )
            })
            .await
    }

    async fn delete_secret(
        &self,
        tenant: TenantId,
        key: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<u32> {
        let key = key.to_owned();
        self.writer
            .write("delete secret", move |tx| {
                let marked = tx.execute(
                    "UPDATE secrets SET deleted_at = ?3 \
                     WHERE tenant_id = ?1 AND key = ?2 AND deleted_at IS NULL",
                    params![id_text(tenant.0), key, unix_millis(now)],
                )?;
                let marked = u32::try_from(marked).unwrap_or(u32::MAX);
                if marked > 0 {
                    super::audit::append(
                        tx,
                        secret_delete_event(tenant, &key, marked, actor, now),
                    )?;
                }
                Ok(marked)
            })
            .await
    }
}

#[async_trait::async_trait]
impl GrantStore for SqliteStore {
    async fn record_grant(&self, grant: Grant) -> Result<()> {
        self.writer
            .write("record grant", move |tx| insert_grant(tx, &grant))
            .await
    }

    async fn record_kit_grant(&self, grant: Grant, actor: AuditActor) -> Result<Superseded> {
        self.writer
            .write("record kit grant", move |tx| {
                let superseded = supersede(tx, grant.environment_id, grant.issued_at)?;
                insert_grant(tx, &grant)?;
                super::audit::append(tx, kit_event(&grant, superseded.count, actor))?;
                Ok(superseded)
            })
            .await
    }

    async fn supersede_grants(
        &self,
        environment: EnvironmentId,
        now: OffsetDateTime,
    ) -> Result<u64> {
        self.writer
            .write("supersede grants", move |tx| {
                supersede(tx, environment, now).map(|s| s.count)
            })
            .await
    }

    async fn grant(&self, jti: &str) -> Result<Option<Grant>> {
        let jti = jti.to_owned();
        self.readers
            .read("get grant", move |db| {
                db.optional(
                    concat!("SELECT ", grant_columns!(), " FROM grants WHERE jti = ?1"),
                    params![jti],
                    |row| rows::read_grant(row),
                )
            })
            .await
    }

    async fn mark_grant_used(
        &self,
        jti: &str,
        token_accessor: &str,
        now: OffsetDateTime,
    ) -> Result<GrantUse> {
        let (jti, accessor) = (jti.to_owned(), token_accessor.to_owned());
        self.writer
            .write("mark grant used", move |tx| {
                let marked = tx.execute(
                    "UPDATE grants SET used_at = ?3, token_accessor = ?2 \
                     WHERE jti = ?1 AND used_at IS NULL",
                    params![jti, accessor, unix_millis(now)],
                )?;
                if marked > 0 {
                    return Ok(GrantUse::First);
                }
                let held = tx.optional(
                    "SELECT token_accessor FROM grants WHERE jti = ?1",
                    params![jti],
                    |row| rows::ColumnReader::text_opt(row, "token_accessor"),
                )?;
                Ok(match held {
                    None => GrantUse::Unknown,
                    Some(Some(held)) if held == accessor => GrantUse::Again,
                    Some(_) => GrantUse::Replay,
                })
            })
            .await
    }

    async fn live_grant_jwks(
        &self,
        tenant: Option<TenantId>,
        now: OffsetDateTime,
    ) -> Result<Vec<String>> {
        self.readers
            .read("live grant jwks", move |db| {
                db.all(
                    "SELECT public_jwk FROM grants \
                     WHERE (?1 IS NULL OR tenant_id = ?1) AND superseded_at IS NULL \
                     AND used_at IS NULL AND expires_at > ?2 ORDER BY jti",
                    params![tenant.map(|t| id_text(t.0)), unix_millis(now)],
                    |row| rows::ColumnReader::text(row, "public_jwk"),
                )
            })
            .await
    }
}

fn insert_grant(tx: &super::threads::Db<'_>, grant: &Grant) -> Result<()> {
    tx.execute(
        "INSERT INTO grants (jti, tenant_id, environment_id, kind, public_jwk, issued_at, \
         expires_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            grant.jti,
            id_text(grant.tenant_id.0),
            id_text(grant.environment_id.0),
            grant.kind.as_str(),
            grant.public_jwk,
            unix_millis(grant.issued_at),
            unix_millis(grant.expires_at),
        ],
    )?;
    Ok(())
}

fn supersede(
    tx: &super::threads::Db<'_>,
    environment: EnvironmentId,
    now: OffsetDateTime,
) -> Result<Superseded> {
    let accessors: Vec<Option<String>> = tx.all(
        "UPDATE grants SET superseded_at = ?2 \
         WHERE environment_id = ?1 AND superseded_at IS NULL RETURNING token_accessor",
        params![id_text(environment.0), unix_millis(now)],
        |row| rows::ColumnReader::text_opt(row, "token_accessor"),
    )?;
    Ok(Superseded {
        count: accessors.len() as u64,
        token_accessors: accessors.into_iter().flatten().collect(),
    })
}
