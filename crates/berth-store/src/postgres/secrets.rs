//! Builtin secrets and deploy grants on PostgreSQL.

use berth_proto::audit::AuditActor;
use berth_proto::{EnvironmentId, TenantId};
use sqlx::types::Json;
use sqlx::PgConnection;
use time::OffsetDateTime;

use super::PostgresStore;
use crate::domain::secrets::{kit_event, secret_delete_event, secret_put_event, Superseded};
use crate::rows::{self, db_error, get, grant_columns, millis, secret_meta_columns};
use crate::{
    Grant, GrantStore, GrantUse, Result, SealedSecret, SecretMeta, SecretStore, StoreError,
};

#[async_trait::async_trait]
impl SecretStore for PostgresStore {
    async fn secret_head(&self, tenant: TenantId, key: &str) -> Result<u32> {
        let row = sqlx::query(
            "SELECT COALESCE(MAX(version), 0)::BIGINT AS version FROM secrets \
             WHERE tenant_id = $1 AND key = $2",
        )
        .bind(tenant.0)
        .bind(key)
        .fetch_one(&mut *self.conn().await?)
        .await
        .map_err(db_error("secret head"))?;
        let head: i64 = get(&row, "version")?;
        u32::try_from(head).map_err(|_| StoreError::Corrupt(format!("secrets.version: {head}")))
    }

    async fn put_secret(&self, secret: SealedSecret) -> Result<SecretMeta> {
        const OP: &str = "put secret";
        let mut tx = self.begin(OP).await?;
        let row = sqlx::query(concat!(
            "INSERT INTO secrets (tenant_id, key, version, wrapped_key, ciphertext, created_at, \
             created_by) VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING ",
            secret_meta_columns!()
        ))
        .bind(secret.meta.tenant_id.0)
        .bind(&secret.meta.key)
        .bind(i64::from(secret.meta.version))
        .bind(&secret.wrapped_key)
        .bind(&secret.ciphertext)
        .bind(millis(secret.meta.created_at))
        .bind(Json(&secret.meta.created_by))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let meta = rows::read_secret_meta(&row)?;
        super::audit::append(&mut tx, secret_put_event(&meta)).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(meta)
    }

    async fn get_secret(
        &self,
        tenant: TenantId,
        key: &str,
        version: Option<u32>,
    ) -> Result<Option<SealedSecret>> {
        sqlx::query(concat!(
            "SELECT ",
            secret_meta_columns!(),
            ", wrapped_key, ciphertext FROM secrets \
             WHERE tenant_id = $1 AND key = $2 AND deleted_at IS NULL \
             AND ($3::BIGINT IS NULL OR version = $3) ORDER BY version DESC LIMIT 1"
        ))
        .bind(tenant.0)
        .bind(key)
        .bind(version.map(i64::from))
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("get secret"))?
        .map(|row| rows::read_sealed_secret(&row))
        .transpose()
    }

    async fn list_secrets(&self, tenant: TenantId, prefix: &str) -> Result<Vec<SecretMeta>> {
        sqlx::query(concat!(
            "SELECT DISTINCT ON (key) ",
            secret_meta_columns!(),
            " FROM secrets WHERE tenant_id = $1 AND deleted_at IS NULL \
             AND left(key, length($2)) = $2 ORDER BY key, version DESC"
        ))
        .bind(tenant.0)
        .bind(prefix)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list secrets"))?
        .iter()
        .map(rows::read_secret_meta)
        .collect()
    }

    async fn secret_versions(&self, tenant: TenantId, key: &str) -> Result<Vec<SecretMeta>> {
        sqlx::query(concat!(
            "SELECT ",
            secret_meta_columns!(),
            " FROM secrets WHERE tenant_id = $1 AND key = $2 ORDER BY version"
        ))
        .bind(tenant.0)
        .bind(key)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("secret versions"))?
        .iter()
        .map(rows::read_secret_meta)
        .collect()
    }

    async fn delete_secret(
        &self,
        tenant: TenantId,
        key: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<u32> {
        const OP: &str = "delete secret";
        let mut tx = self.begin(OP).await?;
        let marked = sqlx::query(
            "UPDATE secrets SET deleted_at = $3 \
             WHERE tenant_id = $1 AND key = $2 AND deleted_at IS NULL",
        )
        .bind(tenant.0)
        .bind(key)
        .bind(millis(now))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .rows_affected();
        let marked = u32::try_from(marked).unwrap_or(u32::MAX);
        if marked > 0 {
            super::audit::append(
                &mut tx,
                secret_delete_event(tenant, key, marked, actor, now),
            )
            .await?;
        }
        tx.commit().await.map_err(db_error(OP))?;
        Ok(marked)
    }
}

#[async_trait::async_trait]
impl GrantStore for PostgresStore {
    async fn record_grant(&self, grant: Grant) -> Result<()> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(db_error("record grant"))?;
        insert_grant(&mut conn, &grant).await
    }

    async fn record_kit_grant(&self, grant: Grant, actor: AuditActor) -> Result<Superseded> {
        const OP: &str = "record kit grant";
        let mut tx = self.begin(OP).await?;
        let superseded = supersede(&mut tx, grant.environment_id, grant.issued_at).await?;
        insert_grant(&mut tx, &grant).await?;
        super::audit::append(&mut tx, kit_event(&grant, superseded.count, actor)).await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(superseded)
    }

    async fn supersede_grants(
        &self,
        environment: EnvironmentId,
        now: OffsetDateTime,
    ) -> Result<u64> {
        let mut conn = self
            .pool
            .acquire()
            .await
            .map_err(db_error("supersede grants"))?;
        supersede(&mut conn, environment, now)
            .await
            .map(|s| s.count)
    }

    async fn grant(&self, jti: &str) -> Result<Option<Grant>> {
        sqlx::query(concat!(
            "SELECT ",
            grant_columns!(),
            " FROM grants WHERE jti = $1"
        ))
        .bind(jti)
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("get grant"))?
        .map(|row| rows::read_grant(&row))
        .transpose()
    }

    async fn mark_grant_used(
        &self,
        jti: &str,
        token_accessor: &str,
        now: OffsetDateTime,
    ) -> Result<GrantUse> {
        // The conditional UPDATE decides: only the first accessor sets `used_at`; a loser then
        // reads who won (the accessor never changes once set).
        const OP: &str = "mark grant used";
        let marked = sqlx::query(
            "UPDATE grants SET used_at = $3, token_accessor = $2 \
             WHERE jti = $1 AND used_at IS NULL",
        )
        .bind(jti)
        .bind(token_accessor)
        .bind(millis(now))
        .execute(&mut *self.conn().await?)
        .await
        .map_err(db_error(OP))?
        .rows_affected();
        if marked > 0 {
            return Ok(GrantUse::First);
        }
        let held = sqlx::query("SELECT token_accessor FROM grants WHERE jti = $1")
            .bind(jti)
            .fetch_optional(&mut *self.conn().await?)
            .await
            .map_err(db_error(OP))?;
        Ok(match held {
            None => GrantUse::Unknown,
            Some(row) => match get::<_, Option<String>>(&row, "token_accessor")? {
                Some(held) if held == token_accessor => GrantUse::Again,
                _ => GrantUse::Replay,
            },
        })
    }

    async fn live_grant_jwks(
        &self,
        tenant: Option<TenantId>,
        now: OffsetDateTime,
    ) -> Result<Vec<String>> {
        sqlx::query(
            "SELECT public_jwk::TEXT AS public_jwk FROM grants \
             WHERE ($1::UUID IS NULL OR tenant_id = $1) AND superseded_at IS NULL \
             AND used_at IS NULL AND expires_at > $2 ORDER BY jti",
        )
        .bind(tenant.map(|t| t.0))
        .bind(millis(now))
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("live grant jwks"))?
        .iter()
        .map(|row| get(row, "public_jwk"))
        .collect()
    }
}

async fn insert_grant(conn: &mut PgConnection, grant: &Grant) -> Result<()> {
    let jwk: serde_json::Value = serde_json::from_str(&grant.public_jwk)
        .map_err(|e| StoreError::Corrupt(format!("grants.public_jwk: {e}")))?;
    sqlx::query(
        "INSERT INTO grants (jti, tenant_id, environment_id, kind, public_jwk, issued_at, \
         expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(&grant.jti)
    .bind(grant.tenant_id.0)
    .bind(grant.environment_id.0)
    .bind(grant.kind.as_str())
    .bind(Json(jwk))
    .bind(millis(grant.issued_at))
    .bind(millis(grant.expires_at))
    .execute(&mut *conn)
    .await
    .map_err(db_error("record grant"))?;
    Ok(())
}

async fn supersede(
    conn: &mut PgConnection,
    environment: EnvironmentId,
    now: OffsetDateTime,
) -> Result<Superseded> {
    let accessors: Vec<Option<String>> = sqlx::query_scalar(
        "UPDATE grants SET superseded_at = $2 \
         WHERE environment_id = $1 AND superseded_at IS NULL RETURNING token_accessor",
    )
    .bind(environment.0)
    .bind(millis(now))
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error("supersede grants"))?;
    Ok(Superseded {
        count: accessors.len() as u64,
        token_accessors: accessors.into_iter().flatten().collect(),
    })
}
