//! Tenants, API tokens and registration tokens on SQLite.

use berth_proto::TenantId;
use rusqlite::params;
use time::OffsetDateTime;

use super::audit::append;
use super::{id_text, json_text, SqliteStore};
use crate::domain::audit::{admin_event, agent_token_event, api_token_event};
use crate::rows::{self, unix_millis, ColumnReader};
use crate::{
    ApiToken, NewApiToken, NewRegistrationToken, NewUiSession, Result, Tenant, TenantStore,
    UiSession,
};
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

    async fn create_ui_session(&self, session: NewUiSession) -> Result<()> {
        self.writer
            .write("create ui session", move |tx| {
                let created = unix_millis(session.created_at);
                tx.execute("DELETE FROM ui_sessions WHERE expires_at <= ?1", [created])?;
                tx.execute(
                    "INSERT INTO ui_sessions (id_hash, token_id, created_at, expires_at) \
                     VALUES (?1, ?2, ?3, ?4)",
                    params![
                        session.id_hash,
                        id_text(session.token_id.0),
                        created,
                        unix_millis(session.expires_at),
                    ],
                )?;
                Ok(())
            })
            .await
    }

    async fn ui_session(&self, id_hash: &str, now: OffsetDateTime) -> Result<Option<UiSession>> {
        let (id_hash, now) = (id_hash.to_owned(), unix_millis(now));
        self.readers
            .read("look up ui session", move |db| {
                db.optional(
                    "SELECT t.id, t.tenant_id, t.name, t.role, t.operator, t.created_at, \
                     s.expires_at AS session_expires_at \
                     FROM ui_sessions s JOIN api_tokens t ON t.id = s.token_id \
                     WHERE s.id_hash = ?1 AND s.expires_at > ?2",
                    params![id_hash, now],
                    |row| {
                        Ok(UiSession {
                            token: rows::read_api_token(row)?,
                            expires_at: row.time("session_expires_at")?,
                        })
                    },
                )
            })
            .await
    }

    async fn delete_ui_session(&self, id_hash: &str) -> Result<bool> {
        let id_hash = id_hash.to_owned();
        self.writer
            .write("delete ui session", move |tx| {
                Ok(tx.execute("DELETE FROM ui_sessions WHERE id_hash = ?1", [id_hash])? > 0)
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
