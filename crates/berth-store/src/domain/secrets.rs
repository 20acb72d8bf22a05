//! Builtin secrets (sealed versions of a tenant's key) and deploy grants (the JWTs a kit or a
//! lease hands out, each verified by a public key of its own).
//!
//! The store never sees a secret's value: the server seals it before the row is written
//! (`berth-server/src/secrets.rs`) and the audit entries name the path and version only. Only a
//! grant's public key is stored; its private key never leaves the handler that signed it.

use berth_proto::audit::AuditActor;
use berth_proto::{EnvironmentId, TenantId};
use time::OffsetDateTime;

use crate::Result;

/// A secret version without its sealed bytes: what listings show.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretMeta {
    pub tenant_id: TenantId,
    /// `<env>/<rest>`.
    pub key: String,
    pub version: u32,
    pub created_at: OffsetDateTime,
    pub created_by: AuditActor,
    pub deleted_at: Option<OffsetDateTime>,
}

/// A secret version as stored: the data key wrapped by the master key, and the value sealed by
/// the data key, both with the associated data `<tenant>/<key>#<version>`.
#[derive(Clone, PartialEq, Eq)]
pub struct SealedSecret {
    pub meta: SecretMeta,
    pub wrapped_key: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

impl std::fmt::Debug for SealedSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SealedSecret")
            .field("meta", &self.meta)
            .finish_non_exhaustive()
    }
}

/// The audit entry of a secret version: its path and version, never the value.
pub(crate) fn secret_put_event(meta: &SecretMeta) -> crate::NewAuditEvent {
    crate::NewAuditEvent {
        tenant_id: meta.tenant_id,
        actor: meta.created_by.clone(),
        action: berth_proto::audit::actions::SECRET_PUT,
        subject: meta.key.clone(),
        details: serde_json::json!({ "path": meta.key, "version": meta.version }),
        at: meta.created_at,
    }
}

pub(crate) fn secret_delete_event(
    tenant: TenantId,
    key: &str,
    versions: u32,
    actor: AuditActor,
    at: OffsetDateTime,
) -> crate::NewAuditEvent {
    crate::NewAuditEvent {
        tenant_id: tenant,
        actor,
        action: berth_proto::audit::actions::SECRET_DELETE,
        subject: key.to_string(),
        details: serde_json::json!({ "path": key, "versions": versions }),
        at,
    }
}

/// Builtin secrets. Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait SecretStore: Send + Sync {
    /// The highest version the key ever had in the tenant, deleted or not; 0 when none. A put
    /// seals its value for this + 1 (the version is part of the associated data).
    async fn secret_head(&self, tenant: TenantId, key: &str) -> Result<u32>;
    /// Inserts the version, with a `secret.put` audit entry by `meta.created_by` (path and
    /// version only). `Conflict { constraint: "secret_version" }` when that version exists:
    /// a concurrent put took it, the caller seals again for the next one.
    async fn put_secret(&self, secret: SealedSecret) -> Result<SecretMeta>;
    /// The version (`None`: the latest), unless it is deleted or missing.
    async fn get_secret(
        &self,
        tenant: TenantId,
        key: &str,
        version: Option<u32>,
    ) -> Result<Option<SealedSecret>>;
    /// The latest live version of every key starting with `prefix`, by key.
    async fn list_secrets(&self, tenant: TenantId, prefix: &str) -> Result<Vec<SecretMeta>>;
    /// Every version of the key, deleted ones too, oldest first.
    async fn secret_versions(&self, tenant: TenantId, key: &str) -> Result<Vec<SecretMeta>>;
    /// Marks every live version deleted, with a `secret.delete` audit entry; the number of
    /// versions it marked (0: nothing live, and no entry).
    async fn delete_secret(
        &self,
        tenant: TenantId,
        key: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<u32>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantKind {
    /// The bootstrap grant of an install kit (supersedes every earlier grant).
    Kit,
    /// A grant minted by `POST /v1/agent/lease`.
    Lease,
}

impl GrantKind {
    pub fn as_str(self) -> &'static str {
        match self {
            GrantKind::Kit => "kit",
            GrantKind::Lease => "lease",
        }
    }

    pub fn parse(s: &str) -> Option<GrantKind> {
        match s {
            "kit" => Some(GrantKind::Kit),
            "lease" => Some(GrantKind::Lease),
            _ => None,
        }
    }
}

/// A deploy grant as recorded: its public key (JWK JSON, `kid` = `jti`), never the JWT.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    pub jti: String,
    pub tenant_id: TenantId,
    pub environment_id: EnvironmentId,
    pub kind: GrantKind,
    /// The JWK as JSON text.
    pub public_jwk: String,
    pub issued_at: OffsetDateTime,
    pub expires_at: OffsetDateTime,
    pub superseded_at: Option<OffsetDateTime>,
    pub used_at: Option<OffsetDateTime>,
    pub token_accessor: Option<String>,
}

/// What [`GrantStore::mark_grant_used`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrantUse {
    /// This call recorded the first use.
    First,
    /// Used before with the same accessor (a retried call): nothing changed.
    Again,
    /// Used before with another accessor: the grant was replayed. Nothing changed.
    Replay,
    /// No such grant.
    Unknown,
}

/// Deploy grants. Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait GrantStore: Send + Sync {
    /// Records a grant (a lease: supersedes nothing). `Conflict { constraint: "grant_jti" }`
    /// on a repeated jti.
    async fn record_grant(&self, grant: Grant) -> Result<()>;
    /// An install kit, in one transaction: every earlier grant of the environment superseded,
    /// the kit's grant recorded, an `environment.kit` audit entry by `actor` (the jti, never the
    /// JWT). What it superseded: how many grants, and the OpenBao token accessors they were
    /// exchanged for (to revoke).
    async fn record_kit_grant(&self, grant: Grant, actor: AuditActor) -> Result<Superseded>;
    /// Marks every live grant of the environment superseded (a retire); how many.
    async fn supersede_grants(
        &self,
        environment: EnvironmentId,
        now: OffsetDateTime,
    ) -> Result<u64>;
    async fn grant(&self, jti: &str) -> Result<Option<Grant>>;
    /// Records that the grant was exchanged for the OpenBao token `token_accessor`: the first
    /// accessor wins; a different one later is a [`GrantUse::Replay`].
    async fn mark_grant_used(
        &self,
        jti: &str,
        token_accessor: &str,
        now: OffsetDateTime,
    ) -> Result<GrantUse>;
    /// The public JWKs (JSON text) of grants neither superseded, used nor expired at `now`, of
    /// one tenant or (`None`) of all, by jti.
    async fn live_grant_jwks(
        &self,
        tenant: Option<TenantId>,
        now: OffsetDateTime,
    ) -> Result<Vec<String>>;
}

/// The audit entry of an install kit: the grant's jti and what it superseded, never the JWT.
/// The grants a kit superseded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Superseded {
    pub count: u64,
    /// The accessors of the OpenBao tokens those grants were exchanged for.
    pub token_accessors: Vec<String>,
}

pub(crate) fn kit_event(grant: &Grant, superseded: u64, actor: AuditActor) -> crate::NewAuditEvent {
    crate::NewAuditEvent {
        tenant_id: grant.tenant_id,
        actor,
        action: berth_proto::audit::actions::ENVIRONMENT_KIT,
        subject: grant.environment_id.to_string(),
        details: serde_json::json!({
            "jti": grant.jti,
            "expiresAt": grant.expires_at.unix_timestamp(),
            "superseded": superseded,
        }),
        at: grant.issued_at,
    }
}
