//! Tenants, API tokens and registration tokens on PostgreSQL.

use berth_proto::TenantId;
use sqlx::types::Json;
use time::OffsetDateTime;

use super::PostgresStore;
use crate::rows::{self, db_error, get, millis};
use crate::{ApiToken, NewApiToken, NewRegistrationToken, Result, Tenant, TenantStore};

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
        .execute(&self.pool)
        .await
        .map_err(db_error("ensure tenant"))?;
        let row = sqlx::query("SELECT id, name, created_at FROM tenants WHERE name = $1")
            .bind(name)
            .fetch_one(&self.pool)
            .await
            .map_err(db_error("ensure tenant"))?;
        rows::read_tenant(&row)
    }

    async fn create_tenant(&self, id: TenantId, name: &str, now: OffsetDateTime) -> Result<Tenant> {
        let row = sqlx::query(
            "INSERT INTO tenants (id, name, created_at) VALUES ($1, $2, $3) \
             RETURNING id, name, created_at",
        )
        .bind(id.0)
        .bind(name)
        .bind(millis(now))
        .fetch_one(&self.pool)
        .await
        .map_err(db_error("create tenant"))?;
        rows::read_tenant(&row)
    }

    async fn get_tenant(&self, id: TenantId) -> Result<Option<Tenant>> {
        sqlx::query("SELECT id, name, created_at FROM tenants WHERE id = $1")
            .bind(id.0)
            .fetch_optional(&self.pool)
            .await
            .map_err(db_error("get tenant"))?
            .map(|row| rows::read_tenant(&row))
            .transpose()
    }

    async fn create_api_token(&self, token: NewApiToken) -> Result<ApiToken> {
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
        .fetch_one(&self.pool)
        .await
        .map_err(db_error("create api token"))?;
        rows::read_api_token(&row)
    }

    async fn api_token_by_hash(&self, token_hash: &str) -> Result<Option<ApiToken>> {
        sqlx::query(
            "SELECT id, tenant_id, name, role, operator, created_at FROM api_tokens \
             WHERE token_hash = $1",
        )
        .bind(token_hash)
        .fetch_optional(&self.pool)
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
        .fetch_one(&self.pool)
        .await
        .map_err(db_error("check operator token"))?;
        get(&row, "found")
    }

    async fn create_registration_token(&self, token: NewRegistrationToken) -> Result<()> {
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
        .execute(&self.pool)
        .await
        .map_err(db_error("create registration token"))?;
        Ok(())
    }
}
