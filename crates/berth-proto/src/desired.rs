//! Seed 001's desired-state protocol (`../shared/seeds/001_*.txt`): the four agent calls
//! (`checkin`, `bundle`, `lease`, `report`), their snake_case bodies, the secret paths, the exit
//! codes, and the admin calls around them (bundles, the desired sha, secrets, the kit).
//!
//! Bodies follow the seed exactly: snake_case, and unknown fields are ignored (no
//! `deny_unknown_fields` here), so an agent written to the seed alone talks to berth.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::{Method, Request};

/// The seed's paths, served as they are and again under `/api`.
pub mod paths {
    pub const CHECKIN: &str = "/v1/agent/checkin";
    pub const LEASE: &str = "/v1/agent/lease";
    pub const REPORT: &str = "/v1/agent/report";
    /// `/v1/agent/bundle/{env_id}/{sha}`.
    pub const BUNDLE_PREFIX: &str = "/v1/agent/bundle";
    /// berth's own read of a `builtin` secret, shaped like OpenBao's KV v2 read:
    /// `GET /v1/agent/kv/{manifest path}?version=N`, with the lease in [`LEASE_HEADER`].
    pub const BUILTIN_KV_PREFIX: &str = "/v1/agent/kv";
    /// The public keys that verify deploy grants (OpenBao's JWT mount fetches them).
    pub const AGENT_JWKS: &str = "/.well-known/agent-jwks.json";
    /// Where the API prefix puts the same calls: `/api` + the seed path.
    pub const API_PREFIX: &str = "/api";

    pub fn bundle(env_id: &str, sha: &str) -> String {
        format!("{BUNDLE_PREFIX}/{env_id}/{sha}")
    }
}

/// The lease a `builtin` secret read presents (the `login_jwt` of `/lease`).
pub const LEASE_HEADER: &str = "x-berth-lease";
/// Response headers of a bundle: tenancy's and doc 24's names; the agent reads either.
pub const BUNDLE_SHA_HEADER: &str = "x-bundle-sha";
pub const BUNDLE_SHA256_HEADER: &str = "x-bundle-sha256";
/// A bundle's media type.
pub const BUNDLE_CONTENT_TYPE: &str = "application/x-tar";

/// `log_tail` is cut to this many bytes (at a char boundary) before it is stored.
pub const MAX_LOG_TAIL_BYTES: usize = 16 * 1024;
/// The head of `log_tail` that goes into the audit log, after redaction.
pub const AUDIT_LOG_TAIL_BYTES: usize = 2 * 1024;
/// The deploy grant's audience (the OpenBao role's `bound_audiences`).
pub const GRANT_AUDIENCE: &str = "openbao-see-env";
/// The deploy grant's `kind` claim (the role's `bound_claims`).
pub const GRANT_KIND: &str = "deploy-grant";
/// How long a deploy grant (kit or lease) may be used to log in.
pub const GRANT_TTL_SECS: u64 = 3600;
/// The JWT auth mount and role a deploy grant logs in at unless configured otherwise (the
/// server's `--openbao-auth-mount`/`--openbao-role`, the agent's for a kit's bootstrap login).
pub const DEFAULT_OPENBAO_AUTH_MOUNT: &str = "jwt-berth";
pub const DEFAULT_OPENBAO_ROLE: &str = "see-env";
/// Default seconds between checkins.
pub const DEFAULT_CHECKIN_INTERVAL_SECS: u64 = 60;

/// Rate buckets per environment (seed 001): requests per period.
pub mod rate {
    pub const CHECKIN_PER_MINUTE: u32 = 6;
    pub const BUNDLE_PER_MINUTE: u32 = 10;
    pub const REPORT_PER_MINUTE: u32 = 30;
    pub const LEASE_PER_HOUR: u32 = 5;
}

/// The agent's exit codes under `--once` (and when it gives up in daemon mode).
pub mod exit {
    /// The tick converged (or nothing was to do).
    pub const OK: i32 = 0;
    /// Fatal: credentials gone and no bootstrap grant on disk ("re-run the install kit").
    pub const FATAL: i32 = 1;
    /// Temporary (EX_TEMPFAIL): rate limited, server or OpenBao unreachable. Retry later.
    pub const TEMPORARY: i32 = 75;
    /// Configuration (EX_CONFIG): `AGENT_ENV_MISMATCH`. Never retried.
    pub const CONFIG: i32 = 78;
}

/// A container as the agent sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ContainerState {
    pub name: String,
    #[serde(default)]
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health: Option<String>,
}

/// The host facts a checkin carries. Every field is optional: the server records what it gets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HostFacts {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub os: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kernel: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docker: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compose: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transport: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub site: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub laptop_mode: Option<bool>,
}

/// `POST /v1/agent/checkin`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Checkin {
    pub env_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    /// The sha the agent last applied; `None` before the first apply or after `down`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied_sha: Option<String>,
    #[serde(default)]
    pub host: HostFacts,
    #[serde(default)]
    pub containers: Vec<ContainerState>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum CheckinAction {
    /// Desired ≠ applied: fetch `bundle_url` and apply it.
    Apply,
    /// Converged: this checkin was the heartbeat.
    None,
    /// The environment is retired: remove the stack (its volumes only with `purge_volumes`).
    Down,
}

/// Where secrets live. `vault.mount` is the KV mount; the agent adopts it when it differs from
/// its configuration. `addr` is informational.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VaultInfo {
    pub addr: String,
    pub mount: String,
    pub prefix: String,
    pub auth_mount: String,
    pub auth_role: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckinResponse {
    pub env_id: String,
    /// `None` while nothing was ever set desired.
    #[serde(default)]
    pub desired_sha: Option<String>,
    pub action: CheckinAction,
    #[serde(default)]
    pub purge_volumes: bool,
    /// Set with `action: apply`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bundle_url: Option<String>,
    pub checkin_interval_s: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vault: Option<VaultInfo>,
}

impl Request for Checkin {
    type Response = CheckinResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        paths::CHECKIN.to_string()
    }
}

/// `POST /v1/agent/lease`. `reason` is the agent's own (`apply` or `renew`), ignored by berth.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseRequest {
    pub env_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The lease: a deploy grant to log in with at `{addr}/v1/auth/{mount}/login` as `role`
/// (provider `openbao`), or to present in [`LEASE_HEADER`] to berth's own KV read (provider
/// `builtin`, where `mount` is `builtin` and `role` empty).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseResponse {
    pub env_id: String,
    pub login_jwt: String,
    pub ttl_s: u64,
    pub mount: String,
    pub role: String,
    pub addr: String,
}

impl Request for LeaseRequest {
    type Response = LeaseResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        paths::LEASE.to_string()
    }
}

/// The `auth/jwt` mount name of a `builtin` lease.
pub const BUILTIN_MOUNT: &str = "builtin";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum ReportResult {
    /// Sets the agent's `applied_sha`; health ok.
    Applied,
    /// Health degraded or the apply refused; `detail` is a code and names.
    Failed,
    /// The stack is gone; clears `applied_sha`.
    Down,
}

impl ReportResult {
    pub fn as_str(self) -> &'static str {
        match self {
            ReportResult::Applied => "applied",
            ReportResult::Failed => "failed",
            ReportResult::Down => "down",
        }
    }
}

/// `POST /v1/agent/report`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Report {
    pub env_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha: Option<String>,
    pub result: ReportResult,
    #[serde(default)]
    pub log_tail: String,
    #[serde(default)]
    pub containers: Vec<ContainerState>,
    /// On `failed`: a code and the names it concerns, `ENV_INCOMPLETE: unresolved: A, B`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReportResponse {
    pub env_id: String,
    pub recorded: bool,
}

impl Request for Report {
    type Response = ReportResponse;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        paths::REPORT.to_string()
    }
}

/// The secret document at a KV path: `{"value": "…"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecretDocument {
    pub value: String,
}

/// A manifest path, in either of the seed's forms: `<mount>/<env>/<rest…>` (tenancy) or
/// `<mount>/data/<env>/<rest…>` (doc 24). Both read `GET /v1/<mount>/data/<env>/<rest>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretPath {
    pub mount: String,
    pub env: String,
    /// What follows the environment segment, `see/pg_password`.
    pub rest: String,
}

impl SecretPath {
    /// Parses a manifest path. Every segment must be non-empty, with no `.`/`..`, no `?`, `#`,
    /// `%` or whitespace: it becomes a URL path as it is.
    pub fn parse(path: &str) -> Option<SecretPath> {
        let segments: Vec<&str> = path.split('/').collect();
        let ok = |s: &&str| {
            !s.is_empty()
                && *s != "."
                && *s != ".."
                && s.len() <= 128
                && s.chars().all(|c| {
                    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '+' | '@' | '=')
                })
        };
        if !segments.iter().all(ok) {
            return None;
        }
        let (mount, env, rest) = match segments.as_slice() {
            [mount, "data", env, rest @ ..] if !rest.is_empty() => (*mount, *env, rest),
            [mount, env, rest @ ..] if !rest.is_empty() && *env != "data" => (*mount, *env, rest),
            _ => return None,
        };
        Some(SecretPath {
            mount: mount.to_string(),
            env: env.to_string(),
            rest: rest.join("/"),
        })
    }

    /// The KV v2 read path under `/v1/`: `<mount>/data/<env>/<rest>`.
    pub fn kv_data_path(&self) -> String {
        format!("{}/data/{}/{}", self.mount, self.env, self.rest)
    }

    /// The key a `builtin` secret is stored under: `<env>/<rest>` (the mount is not part of it).
    pub fn store_key(&self) -> String {
        format!("{}/{}", self.env, self.rest)
    }
}

/// A bundle sha as the seed writes it: 64 lowercase hex digits.
pub fn valid_sha(sha: &str) -> bool {
    sha.len() == 64 && sha.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

// ---- Admin calls (bearer token, camelCase like the rest of the admin API) ----

/// A stored bundle. Pushed with `POST /api/v1/environments/{env}/bundles` (body: the tar).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct BundleView {
    pub environment: String,
    pub sha: String,
    pub size_bytes: u64,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
}

/// `PUT /api/v1/environments/{env}/desired`: point the environment at a pushed bundle.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetDesired {
    pub sha: String,
}

/// `POST /api/v1/environments/{env}/retire`: checkins answer `down` from now on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Retire {
    #[serde(default)]
    pub purge_volumes: bool,
}

/// One agent's view of a desired-state environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DesiredAgentView {
    /// `agent:<id>` (mTLS) or `token:<env>` (an OpenBao bearer token).
    pub agent: String,
    pub applied_sha: Option<String>,
    pub last_result: Option<String>,
    pub detail: Option<String>,
    pub host: HostFacts,
    pub containers: Vec<ContainerState>,
    #[serde(with = "time::serde::rfc3339::option")]
    pub last_checkin_at: Option<OffsetDateTime>,
}

/// `GET /api/v1/environments/{env}/desired`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct DesiredStateView {
    pub environment: String,
    pub desired_sha: Option<String>,
    pub retired: bool,
    pub purge_volumes: bool,
    pub agents: Vec<DesiredAgentView>,
}

/// `PUT /api/v1/environments/{name}/desired` as a typed request.
#[derive(Debug, Clone, Serialize)]
pub struct PutDesired {
    #[serde(skip)]
    pub environment: String,
    pub sha: String,
}

impl Request for PutDesired {
    type Response = DesiredStateView;
    const METHOD: Method = Method::Put;
    fn path(&self) -> String {
        crate::deploy::environment_path(&self.environment, "/desired")
    }
}

/// `POST /api/v1/environments/{name}/retire` as a typed request.
#[derive(Debug, Clone, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RetireEnvironment {
    #[serde(skip)]
    pub environment: String,
    pub purge_volumes: bool,
}

impl Request for RetireEnvironment {
    type Response = DesiredStateView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        crate::deploy::environment_path(&self.environment, "/retire")
    }
}

/// `GET /api/v1/environments/{name}/desired`.
#[derive(Debug, Clone, Serialize)]
pub struct GetDesiredState {
    #[serde(skip)]
    pub environment: String,
}

impl Request for GetDesiredState {
    type Response = DesiredStateView;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        crate::deploy::environment_path(&self.environment, "/desired")
    }
}

/// Where a bundle is pushed (`POST`, the tar as the body) and listed (`GET`).
pub fn bundles_path(environment: &str) -> String {
    crate::deploy::environment_path(environment, "/bundles")
}

/// `PUT /api/v1/secrets/{path}`: a new version. Exactly one of `value` and `generate`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PutSecret {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// Let the server generate 32 random bytes, URL-safe base64.
    #[serde(default)]
    pub generate: bool,
}

/// A secret version's metadata. Never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct SecretVersionView {
    /// `<env>/<rest>`.
    pub path: String,
    pub version: u32,
    #[serde(with = "time::serde::rfc3339")]
    pub created_at: OffsetDateTime,
    pub deleted: bool,
}

/// `POST /api/v1/environments/{env}/kit` (admins only): a bootstrap deploy grant, superseding
/// every earlier grant of the environment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct KitView {
    pub environment: String,
    pub grant: String,
    pub jti: String,
    #[serde(with = "time::serde::rfc3339")]
    pub expires_at: OffsetDateTime,
    /// The one-line install command that stages the grant as `bootstrap.jwt` (0600).
    pub install_command: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_path_forms_read_the_same_kv_path() {
        let a = SecretPath::parse("monky/env-qa-02/see/gemini_api_key").unwrap();
        let b = SecretPath::parse("monky/data/env-qa-02/see/gemini_api_key").unwrap();
        assert_eq!(a, b);
        assert_eq!(a.kv_data_path(), "monky/data/env-qa-02/see/gemini_api_key");
        assert_eq!(a.store_key(), "env-qa-02/see/gemini_api_key");
    }

    #[test]
    fn hostile_paths_are_refused() {
        for bad in [
            "",
            "monky",
            "monky/env",
            "monky/data/env",
            "monky/../x/y",
            "monky/env//x",
            "monky/env/x?version=1",
            "monky/env/x y",
            "/monky/env/x",
            "monky/env/%2e%2e",
        ] {
            assert_eq!(SecretPath::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn unknown_fields_are_ignored_as_the_seed_says() {
        let c: Checkin = serde_json::from_str(
            r#"{"env_id":"e","applied_sha":null,"host":{"hostname":"h","future":1},"later":true}"#,
        )
        .unwrap();
        assert_eq!(c.env_id, "e");
        assert_eq!(c.host.hostname.as_deref(), Some("h"));
        let l: LeaseRequest =
            serde_json::from_str(r#"{"env_id":"e","reason":"apply","x":[]}"#).unwrap();
        assert_eq!(l.reason.as_deref(), Some("apply"));
    }

    #[test]
    fn sha_is_64_lowercase_hex() {
        assert!(valid_sha(&"a".repeat(64)));
        assert!(!valid_sha(&"A".repeat(64)));
        assert!(!valid_sha(&"a".repeat(63)));
    }
}
