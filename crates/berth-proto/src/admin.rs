//! Admin API: tenants, API tokens, registration tokens. Shapes fixed by DESIGN.md.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::{Method, Request, TenantId};

/// Role carried by an API token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Admin,
    Deployer,
    Viewer,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Deployer => "deployer",
            Role::Viewer => "viewer",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "admin" => Some(Role::Admin),
            "deployer" => Some(Role::Deployer),
            "viewer" => Some(Role::Viewer),
            _ => None,
        }
    }
}

/// `POST /api/v1/admin/tenants` (operator token only).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateTenant {
    pub name: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CreateTenantResponse {
    pub tenant_id: TenantId,
    pub admin_token: String,
}

impl Request for CreateTenant {
    type Response = CreateTenantResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/admin/tenants".into()
    }
}

/// `POST /api/v1/admin/api-tokens`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateApiToken {
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CreateApiTokenResponse {
    pub token: String,
    pub role: Role,
}

impl Request for CreateApiToken {
    type Response = CreateApiTokenResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/admin/api-tokens".into()
    }
}

/// `POST /api/v1/admin/agent-tokens`: a one-time registration token.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateAgentToken {
    /// Labels the registering agent inherits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// Environment the agent is bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    /// Lifetime of the token; default 1 hour, at most 30 days.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_seconds: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct CreateAgentTokenResponse {
    pub token: String,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub expires_at: OffsetDateTime,
    /// `sha256:` + lowercase hex of SHA-256 over the CA certificate's DER.
    pub ca_fingerprint: String,
    /// One line to run as root on the new host: it checks the CA against the fingerprint,
    /// then downloads, installs, registers and starts the agent (`GET /install.sh`).
    pub install_command: String,
}

impl Request for CreateAgentToken {
    type Response = CreateAgentTokenResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/admin/agent-tokens".into()
    }
}
