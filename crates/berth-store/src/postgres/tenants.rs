//! Tenants, API tokens and registration tokens on PostgreSQL.

use berth_proto::TenantId;
use sqlx::types::Json;
use time::OffsetDateTime;

use super::audit::append;
use super::PostgresStore;
use crate::domain::audit::{admin_event, agent_token_event, api_token_event};
use crate::rows::{self, db_error, get, millis, ColumnReader};
use crate::{
    ApiToken, NewApiToken, NewRegistrationToken, NewUiSession, Result, Tenant, TenantStore,
    UiSession,
};
use berth_proto::audit::actions::TENANT_CREATE;
use berth_proto::audit::AuditActor;
use serde_json::json;

#[async_trait::async_trait]
impl TenantStore for PostgresStore {
    async fn ensure_tenant(&self, name: &str, now: OffsetDateTime) -> Result<Tenant> {
        // Under READ COMMITTED the SELECT sees the row a concurrent winner committed, so two
        // replicas bootstrapping at once end up with the same tenant.
        sqlx::query(
            "INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3) \
             ON CONFLICT (name) DO NOTHING",
        )
        .bind(TenantId::new().0)
        .bind(name)
        .bind(millis(now))
        .execute(&mut *self.conn().await?)
        .await
        .map_err(db_error("ensure tenant"))?;
        let row = sqlx::query("SELECT id, name, created_at FROM tenants WHERE name = $1")
            .bind(name)
            .fetch_one(&mut *self.conn().await?)
            .await
            .map_err(db_error("ensure tenant"))?;
        rows::read_tenant(&row)
    }

    async fn create_tenant(
        &self,
        id: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Tenant> {
        const OP: &str = "create tenant";
        let mut tx = self.begin(OP).await?;
        let row = sqlx::query(
            "INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3) \
             RETURNING id, name, created_at",
        )
        .bind(id.0)
        .bind(name)
        .bind(millis(now))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let tenant = rows::read_tenant(&row)?;
        let details = json!({"name": tenant.name});
        append(
            &mut tx,
            admin_event(id, actor, TENANT_CREATE, id, details, now),
        )
        .await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(tenant)
    }

    async fn get_tenant(&self, id: TenantId) -> Result<Option<Tenant>> {
        sqlx::query("SELECT id, name, created_at FROM tenants WHERE id = $1")
            .bind(id.0)
            .fetch_optional(&mut *self.conn().await?)
            .await
            .map_err(db_error("get tenant"))?
            .map(|row| rows::read_tenant(&row))
            .transpose()
    }

    async fn create_api_token(&self, token: NewApiToken) -> Result<ApiToken> {
        const OP: &str = "create api token";
        let mut tx = self.begin(OP).await?;
        let row = sqlx::query(
            "INSERT INTO api_tokens (id, tenant_id, name, role, operator, token_hash, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7) \
             RETURNING id, tenant_id, name, role, operator, created_at",
        )
        .bind(token.id.0)
        .bind(token.tenant_id.0)
        .bind(&token.name)
        .bind(token.role.as_str())
        .bind(token.operator)
        .bind(&token.token_hash)
        .bind(millis(token.created_at))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let created = rows::read_api_token(&row)?;
        if let Some(actor) = token.created_by {
            append(&mut tx, api_token_event(&created, actor)).await?;
        }
        tx.commit().await.map_err(db_error(OP))?;
        Ok(created)
    }

    async fn api_token_by_hash(&self, token_hash: &str) -> Result<Option<ApiToken>> {
        if let Ok(found) = self.batches.api_token.run(token_hash.to_string()).await? {
            return Ok(found);
        }
        sqlx::query(
            "SELECT id, tenant_id, name, role, operator, created_at FROM api_tokens \
             WHERE token_hash = $1",
        )
        .bind(token_hash)
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("look up api token"))?
        .map(|row| rows::read_api_token(&row))
        .transpose()
    }

    async fn has_operator_token(&self, tenant: TenantId) -> Result<bool> {
        let row = sqlx::query(
            "SELECT EXISTS (SELECT 1 FROM api_tokens WHERE tenant_id = $1 AND operator) AS found",
        )
        .bind(tenant.0)
        .fetch_one(&mut *self.conn().await?)
        .await
        .map_err(db_error("check operator token"))?;
        get(&row, "found")
    }

    async fn create_ui_session(&self, session: NewUiSession) -> Result<()> {
        const OP: &str = "create ui session";
        let mut tx = self.begin(OP).await?;
        sqlx::query("DELETE FROM ui_sessions WHERE expires_at <= $1")
            .bind(millis(session.created_at))
            .execute(&mut *tx)
            .await
            .map_err(db_error(OP))?;
        sqlx::query(
            "INSERT INTO ui_sessions (id_hash, token_id, created_at, expires_at) \
             VALUES ($1, $2, $3, $4)",
        )
        .bind(&session.id_hash)
        .bind(session.token_id.0)
        .bind(millis(session.created_at))
        .bind(millis(session.expires_at))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        tx.commit().await.map_err(db_error(OP))
    }

    async fn ui_session(&self, id_hash: &str, now: OffsetDateTime) -> Result<Option<UiSession>> {
        sqlx::query(
            "SELECT t.id, t.tenant_id, t.name, t.role, t.operator, t.created_at, \
             s.expires_at AS session_expires_at \
             FROM ui_sessions s JOIN api_tokens t ON t.id = s.token_id \
             WHERE s.id_hash = $1 AND s.expires_at > $2",
        )
        .bind(id_hash)
        .bind(millis(now))
        .fetch_optional(&mut *self.conn().await?)
        .await
        .map_err(db_error("look up ui session"))?
        .map(|row| {
            Ok(UiSession {
                token: rows::read_api_token(&row)?,
                expires_at: row.time("session_expires_at")?,
            })
        })
        .transpose()
    }

    async fn delete_ui_session(&self, id_hash: &str) -> Result<bool> {
        let done = sqlx::query("DELETE FROM ui_sessions WHERE id_hash = $1")
            .bind(id_hash)
            .execute(&mut *self.conn().await?)
            .await
            .map_err(db_error("delete ui session"))?;
        Ok(done.rows_affected() > 0)
    }

    async fn create_registration_token(&self, token: NewRegistrationToken) -> Result<()> {
        const OP: &str = "create registration token";
        let mut tx = self.begin(OP).await?;
        sqlx::query(
            "INSERT INTO registration_tokens \
             (id, tenant_id, token_hash, labels, environment, expires_at, created_at) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(token.id.0)
        .bind(token.tenant_id.0)
        .bind(&token.token_hash)
        .bind(Json(&token.labels))
        .bind(&token.environment)
        .bind(millis(token.expires_at))
        .bind(millis(token.created_at))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        if let Some(actor) = token.created_by.clone() {
            append(&mut tx, agent_token_event(&token, actor)).await?;
        }
        tx.commit().await.map_err(db_error(OP))?;
        Ok(())
    }
}
