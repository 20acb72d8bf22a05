//! Tenants and their tokens: API tokens (bearer credentials of a tenant's users), the web UI's
//! sessions made from them, and registration tokens (single-use admissions of agents into a
//! tenant).

use std::collections::BTreeMap;

use berth_proto::admin::Role;
use berth_proto::audit::AuditActor;
use berth_proto::{TenantId, TokenId};
use time::OffsetDateTime;

use crate::Result;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiToken {
    pub id: TokenId,
    pub tenant_id: TenantId,
    pub name: String,
    pub role: Role,
    /// The bootstrap admin token of the `default` tenant: the only one that may create tenants.
    pub operator: bool,
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone)]
pub struct NewApiToken {
    pub id: TokenId,
    pub tenant_id: TenantId,
    pub name: String,
    pub role: Role,
    pub operator: bool,
    /// SHA-256 of the secret, hex. The secret itself is never stored.
    pub token_hash: String,
    pub created_at: OffsetDateTime,
    /// Who issued it: an `api_token.create` entry (id, name, role; never the secret) is
    /// appended in the insert's transaction. None only for the bootstrap operator token.
    pub created_by: Option<AuditActor>,
}

/// A web UI session (migration 0017): made by signing in with an API token, it acts as that
/// token. Only the hash of its random id is stored.
#[derive(Debug, Clone)]
pub struct NewUiSession {
    /// SHA-256 of the session id, hex (`berth_crypto::hash_token`).
    pub id_hash: String,
    pub token_id: TokenId,
    pub created_at: OffsetDateTime,
    pub expires_at: OffsetDateTime,
}

/// A live session: its token as it is now (tenant, current role) and when the session ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UiSession {
    pub token: ApiToken,
    pub expires_at: OffsetDateTime,
}

#[derive(Debug, Clone)]
pub struct NewRegistrationToken {
    pub id: TokenId,
    pub tenant_id: TenantId,
    pub token_hash: String,
    pub labels: BTreeMap<String, String>,
    pub environment: Option<String>,
    pub expires_at: OffsetDateTime,
    pub created_at: OffsetDateTime,
    /// Who issued it: an `agent_token.create` entry is appended in the insert's transaction.
    pub created_by: Option<AuditActor>,
}

/// Tenants, API tokens and registration tokens. Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait TenantStore: Send + Sync {
    /// Creates the tenant or returns the existing one with that name (bootstrap).
    async fn ensure_tenant(&self, name: &str, now: OffsetDateTime) -> Result<Tenant>;
    /// `Conflict { constraint: "tenant_name" }` when the name exists. The new tenant's audit
    /// chain starts, in the same transaction, with a `tenant.create` entry by `actor`.
    async fn create_tenant(
        &self,
        id: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Tenant>;
    async fn get_tenant(&self, id: TenantId) -> Result<Option<Tenant>>;

    // --- API tokens ---

    /// `Conflict { constraint: "api_token_hash" }` on a duplicate hash.
    async fn create_api_token(&self, token: NewApiToken) -> Result<ApiToken>;
    async fn api_token_by_hash(&self, token_hash: &str) -> Result<Option<ApiToken>>;
    /// Whether the tenant already has an operator token (bootstrap runs once).
    async fn has_operator_token(&self, tenant: TenantId) -> Result<bool>;

    // --- web UI sessions ---

    /// Records a session; expired sessions (at `created_at`) are deleted in the same write.
    async fn create_ui_session(&self, session: NewUiSession) -> Result<()>;
    /// The session with this id hash and its token, when it exists and `now` is before its
    /// expiry; a deleted token has no sessions left (the foreign key cascades).
    async fn ui_session(&self, id_hash: &str, now: OffsetDateTime) -> Result<Option<UiSession>>;
    /// Ends a session (sign out); whether it existed.
    async fn delete_ui_session(&self, id_hash: &str) -> Result<bool>;

    // --- registration tokens ---

    async fn create_registration_token(&self, token: NewRegistrationToken) -> Result<()>;
}
