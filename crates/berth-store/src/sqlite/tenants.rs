//! Tenants, API tokens and registration tokens on SQLite.

use berth_proto::TenantId;
use rusqlite::params;
use time::OffsetDateTime;

use super::audit::append;
use super::{id_text, json_text, SqliteStore};
use crate::domain::audit::{admin_event, agent_token_event, api_token_event};
use crate::rows::{self, unix_millis, ColumnReader};
use crate::{ApiToken, NewApiToken, NewRegistrationToken, Result, Tenant, TenantStore};
use berth_proto::audit::actions::TENANT_CREATE;
use berth_proto::audit::AuditActor;
use serde_json::json;

#[async_trait::async_trait]
impl TenantStore for SqliteStore {
    async fn ensure_tenant(&self, name: &str, now: OffsetDateTime) -> Result<Tenant> {
        let (id, name, now) = (
            id_text(TenantId::new().0),
            name.to_owned(),
            unix_millis(now),
        );
        self.writer
            .write("ensure tenant", move |tx| {
                tx.execute(
                    "INSERT INTO tenants (id, name, created_at) VALUES (?1, ?2, ?3) \
                     ON CONFLICT (name) DO NOTHING",
                    params![id, name, now],
                )?;
                tx.one(
                    "SELECT id, name, created_at FROM tenants WHERE name = ?1",
                    [name],
                    |row| rows::read_tenant(row),
                )
            })
            .await
    }

    async fn create_tenant(
        &self,
        id: TenantId,
        name: &str,
        actor: AuditActor,
        at: OffsetDateTime,
    ) -> Result<Tenant> {
        let name = name.to_owned();
        self.writer
            .write("create tenant", move |tx| {
                let tenant = tx.one(
                    "INSERT INTO tenants (id, name, created_at) VALUES (?1, ?2, ?3) \
                     RETURNING id, name, created_at",
                    params![id_text(id.0), name, unix_millis(at)],
                    |row| rows::read_tenant(row),
                )?;
                let details = json!({"name": tenant.name});
                append(tx, admin_event(id, actor, TENANT_CREATE, id, details, at))?;
                Ok(tenant)
            })
            .await
    }

    async fn get_tenant(&self, id: TenantId) -> Result<Option<Tenant>> {
        self.readers
            .read("get tenant", move |db| {
                db.optional(
                    "SELECT id, name, created_at FROM tenants WHERE id = ?1",
                    [id_text(id.0)],
                    |row| rows::read_tenant(row),
                )
            })
            .await
    }

    async fn create_api_token(&self, token: NewApiToken) -> Result<ApiToken> {
        self.writer
            .write("create api token", move |tx| {
                let created = tx.one(
                    "INSERT INTO api_tokens \
                     (id, tenant_id, name, role, operator, token_hash, created_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
                     RETURNING id, tenant_id, name, role, operator, created_at",
                    params![
                        id_text(token.id.0),
                        id_text(token.tenant_id.0),
                        token.name,
                        token.role.as_str(),
                        token.operator,
                        token.token_hash,
                        unix_millis(token.created_at),
                    ],
                    |row| rows::read_api_token(row),
                )?;
                if let Some(actor) = token.created_by {
                    append(tx, api_token_event(&created, actor))?;
                }
                Ok(created)
            })
            .await
    }

    async fn api_token_by_hash(&self, token_hash: &str) -> Result<Option<ApiToken>> {
        let token_hash = token_hash.to_owned();
        self.readers
            .read("look up api token", move |db| {
                db.optional(
                    "SELECT id, tenant_id, name, role, operator, created_at FROM api_tokens \
                     WHERE token_hash = ?1",
                    [token_hash],
                    |row| rows::read_api_token(row),
                )
            })
            .await
    }

    async fn has_operator_token(&self, tenant: TenantId) -> Result<bool> {
        self.readers
            .read("check operator token", move |db| {
                db.one(
                    "SELECT EXISTS (SELECT 1 FROM api_tokens WHERE tenant_id = ?1 AND operator) \
                     AS found",
                    [id_text(tenant.0)],
                    |row| row.flag("found"),
                )
            })
            .await
    }

    async fn create_registration_token(&self, token: NewRegistrationToken) -> Result<()> {
        let labels = json_text("registration_tokens.labels", &token.labels)?;
        self.writer
            .write("create registration token", move |tx| {
                tx.execute(
                    "INSERT INTO registration_tokens \
                     (id, tenant_id, token_hash, labels, environment, expires_at, created_at) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                    params![
                        id_text(token.id.0),
                        id_text(token.tenant_id.0),
                        token.token_hash,
                        labels,
                        token.environment,
                        unix_millis(token.expires_at),
                        unix_millis(token.created_at),
                    ],
                )?;
                if let Some(actor) = token.created_by.clone() {
                    append(tx, agent_token_event(&token, actor))?;
                }
                Ok(())
            })
            .await
    }
}
