//! Releases: an immutable name plus components, each an image pinned by digest (and the
//! `docker.run` config to run it with), or a compose lock whose every image is pinned.
//! The server resolves tags to digests when the release is created and stores only digests.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::{Method, ReleaseId, Request};

pub use crate::names::valid_release_name;

/// At most this many components in one release.
pub const MAX_COMPONENTS: usize = 64;
/// A compose file is at most this many bytes.
pub const MAX_COMPOSE_BYTES: usize = 256 * 1024;

/// Component names: like compose service names, 1-63 of `a-z 0-9 _ -`, starting with a letter or
/// digit.
pub fn valid_component_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-'))
}

/// One component as asked for: an image by tag (`host/repo:tag`) or by digest
/// (`host/repo@sha256:…`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ComponentSpec {
    pub name: String,
    pub image: String,
    /// The `docker.run` config for this component (everything but the image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub config: Option<serde_json::Value>,
}

/// `POST /api/v1/releases`: components, or a compose file, or both. Registry credentials are
/// used for this resolution only: never stored, never logged.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateRelease {
    pub name: String,
    #[serde(default)]
    pub components: Vec<ComponentSpec>,
    /// A compose file (YAML). Each service's `image:` is resolved and pinned as
    /// `repo@sha256:…` in the release's `composeLock`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compose: Option<String>,
    /// What the release puts on SSH targets (an environment of `targetType: ssh` deploys only
    /// this; one of `agents` deploys only components).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub ssh: Option<SshRelease>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_username: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_password: Option<String>,
}

impl Request for CreateRelease {
    type Response = ReleaseView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/releases".into()
    }
}

/// What a release puts on an SSH target, as seed 000's `SSHRemoteExecutor.deploy` does: the
/// artifacts (by reference only: `sha256` of an artifact pushed to the server) into the deploy
/// directory, then the hooks and the script, then the health check. Each target's `ssh.deploy`
/// is this plus the target and a sticker naming the release.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SshRelease {
    pub deploy_directory: String,
    pub artifacts: Vec<crate::payload::SshArtifact>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub script: Option<crate::payload::HookConfig>,
    #[serde(default)]
    pub hooks: crate::payload::DeployHooks,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<crate::payload::SshHealthCheck>,
}

impl SshRelease {
    /// The rules of `ssh.deploy`'s payload, and artifacts by reference only (a release row
    /// carries no file contents).
    pub fn check(&self) -> Result<(), String> {
        crate::payload::check_deploy_spec(
            &self.deploy_directory,
            &self.artifacts,
            &self.script,
            &self.hooks,
            &self.health_check,
        )?;
        match self.artifacts.iter().find(|a| a.content.is_some()) {
            Some(a) => Err(format!(
                "artifact {:?}: a release names artifacts by sha256 (push the file first)",
                a.name
            )),
            None => Ok(()),
        }
    }

    /// The `ssh.deploy` payload that puts this on `target`, writing `sticker`.
    pub fn payload(
        &self,
        target: crate::payload::SshTarget,
        sticker: crate::payload::WriteStickerPayload,
    ) -> crate::payload::SshDeployPayload {
        crate::payload::SshDeployPayload {
            target,
            deploy_directory: self.deploy_directory.clone(),
            artifacts: self.artifacts.clone(),
            script: self.script.clone(),
            hooks: self.hooks.clone(),
            health_check: self.health_check.clone(),
            sticker,
        }
    }
}

/// One component as stored: the repository and the digest it resolved to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct Component {
    pub name: String,
    /// `host/repo`, without tag or digest.
    pub image: String,
    /// `sha256:<64 hex>`.
    pub digest: String,
    /// The tag it was resolved from, for the record (never used to pull).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub config: Option<serde_json::Value>,
}

impl Component {
    /// `host/repo@sha256:…`: the only reference a deployment pulls.
    pub fn pinned(&self) -> String {
        format!("{}@{}", self.image, self.digest)
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReleaseView {
    pub id: ReleaseId,
    pub name: String,
    pub components: Vec<Component>,
    /// The compose file with every service's image pinned by digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compose_lock: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<Object>))]
    pub ssh: Option<SshRelease>,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
}

/// `GET /api/v1/releases/{name}`.
#[derive(Debug, Clone, Serialize)]
pub struct GetRelease {
    #[serde(skip)]
    pub name: String,
}

impl Request for GetRelease {
    type Response = ReleaseView;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        // Names are checked by `valid_release_name` on create; anything else is encoded so it
        // stays one path segment and simply is not found.
        format!(
            "/api/v1/releases/{}",
            crate::url::encode_query_value(&self.name)
        )
    }
}

/// `GET /api/v1/releases?cursor=&limit=`, in creation order.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListReleases {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct ReleaseList {
    pub items: Vec<ReleaseView>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

impl Request for ListReleases {
    type Response = ReleaseList;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        let limit = self.limit.map(|l| l.to_string());
        crate::url::with_query(
            "/api/v1/releases",
            &[
                ("cursor", self.cursor.as_deref()),
                ("limit", limit.as_deref()),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_release_name("2024.06.1-rc_1"));
        for bad in ["", ".x", "a/b", "a b", "a%2f", &"a".repeat(129)] {
            assert!(!valid_release_name(bad), "{bad:?}");
        }
        assert!(valid_component_name("web_1-a"));
        for bad in ["", "Web", "-w", "a.b", &"a".repeat(64)] {
            assert!(!valid_component_name(bad), "{bad:?}");
        }
    }
}
