//! SSH targets (issue 12, seed 000's agent-ssh): hosts that run no agent, each acted for by an
//! agent (`via`: one agent by name, or any online agent carrying a set of labels). The private
//! key is never here: the target names a `builtin` secret (`keySecret`), which the server opens
//! only to seal it into the credentials of a task for the via agent. Also the artifacts a release
//! ships to SSH targets: files stored by the server under their SHA-256.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::agent::Deleted;
use crate::url::encode_query_value;
use crate::{Method, Request, SshTargetId};

/// SSH target names follow the release name rules: one URL path segment as they are.
pub use crate::release::valid_release_name as valid_ssh_target_name;

/// `POST /api/v1/ssh-targets`. Exactly one of `viaAgent` and a non-empty `viaSelector`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSshTarget {
    pub name: String,
    pub host: String,
    /// Default 22.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    pub user: String,
    /// The agent (by name) that acts for the target.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via_agent: Option<String>,
    /// Or: any online agent carrying every one of these labels (the first by name).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub via_selector: BTreeMap<String, String>,
    /// The pinned host key, an OpenSSH public key line (`ssh-ed25519 AAAA…`, as
    /// `berth ssh-target scan` prints it). Any other key is refused before authentication.
    pub host_key: String,
    /// The `builtin` secret (`<env>/<name>`) holding the private key (OpenSSH or PKCS#8 PEM).
    pub key_secret: String,
    /// What environments select the target by.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

impl Request for CreateSshTarget {
    type Response = SshTargetView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/ssh-targets".into()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SshTargetView {
    pub id: SshTargetId,
    pub name: String,
    pub host: String,
    pub port: u16,
    pub user: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub via_agent: Option<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub via_selector: BTreeMap<String, String>,
    pub host_key: String,
    pub key_secret: String,
    pub labels: BTreeMap<String, String>,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
}

fn ssh_target_path(name: &str) -> String {
    format!("/api/v1/ssh-targets/{}", encode_query_value(name))
}

/// `GET /api/v1/ssh-targets/{name}`.
#[derive(Debug, Clone, Serialize)]
pub struct GetSshTarget {
    #[serde(skip)]
    pub name: String,
}

impl Request for GetSshTarget {
    type Response = SshTargetView;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        ssh_target_path(&self.name)
    }
}

/// `GET /api/v1/ssh-targets`: the tenant's SSH targets, by name.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ListSshTargets {}

impl Request for ListSshTargets {
    type Response = Vec<SshTargetView>;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        "/api/v1/ssh-targets".into()
    }
}

/// `DELETE /api/v1/ssh-targets/{name}`. A deployment that still lists it fails that target
/// (`SSH_TARGET_NOT_FOUND`) when it reaches it.
#[derive(Debug, Clone, Serialize)]
pub struct DeleteSshTarget {
    #[serde(skip)]
    pub name: String,
}

impl Request for DeleteSshTarget {
    type Response = Deleted;
    const METHOD: Method = Method::Delete;
    fn path(&self) -> String {
        ssh_target_path(&self.name)
    }
}

/// At most this many bytes in one artifact.
pub const MAX_ARTIFACT_BYTES: usize = 256 * 1024 * 1024;

/// A stored artifact. Pushed with `POST /api/v1/artifacts` (body: the bytes,
/// `application/octet-stream`); content addressed per tenant, so a second push of the same
/// bytes finds the first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ArtifactView {
    /// 64 lowercase hex digits.
    pub sha256: String,
    pub size: u64,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
}

/// `GET /api/v1/artifacts`: the tenant's artifacts (metadata), newest first.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ListArtifacts {}

impl Request for ListArtifacts {
    type Response = Vec<ArtifactView>;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        "/api/v1/artifacts".into()
    }
}
