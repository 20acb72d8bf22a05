//! The agent's side of OpenBao (seed 001, "Bootstrap → lease → token"): the JWT login with a
//! deploy grant, KV v2 reads of the manifest's secrets, the token's upkeep, and the token file.
//!
//! Nothing here prints a token, a grant or a secret value: [`BaoToken`]'s `Debug` hides the
//! token, and [`BaoError`] carries OpenBao's own error words (which never echo them), never a
//! request body.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_proto::desired::{LeaseResponse, SecretPath};
use berth_proto::error::codes;
use reqwest::StatusCode;
use serde_json::{json, Value};

/// Renew when the token has less than this left (seed: "ttl < 12 h → renew-self").
pub const RENEW_BELOW_S: u64 = 12 * 3600;
/// Re-lease when the token is older than this: 30 d (the role's `token_max_ttl`) − 2 d, so a
/// new token is in hand well before the old one cannot be renewed any more.
pub const RELEASE_AFTER_S: u64 = (30 - 2) * 24 * 3600;
/// A readiness probe's [`berth_exec::readiness::SecretsResolver`]: logs in with the probe's
/// grant as a desired-state apply does, reads each manifest entry as the apply reads it (so a
/// policy that would refuse the apply refuses the probe), keeps only whether it resolved, and
/// revokes the token. The values are dropped where they are read.
pub struct ProbeSecrets {
    /// `--openbao-addr`: wins over the address the server names.
    pub addr: Option<String>,
    /// `--openbao-ca-file`'s PEM.
    pub ca_pem: Option<Vec<u8>>,
}

#[async_trait::async_trait]
impl berth_exec::readiness::SecretsResolver for ProbeSecrets {
    async fn unresolved(
        &self,
        probe: &berth_proto::payload::SecretsProbe,
        login_jwt: &str,
    ) -> Result<Vec<String>, String> {
        let addr = self.addr.as_deref().unwrap_or(&probe.addr);
        let bao = OpenBao::new(addr, self.ca_pem.as_deref()).map_err(|e| e.to_string())?;
        let token = bao
            .login_jwt(&probe.auth_mount, &probe.role, login_jwt)
            .await
            .map_err(|e| format!("login at {addr}: {e}"))?;
        let mut unresolved = Vec::new();
        let mut failure = None;
        for entry in &probe.entries {
            let Some(path) = SecretPath::parse(&entry.path) else {
                unresolved.push(format!("{} (not a secret path)", entry.path));
                continue;
            };
            match bao
                .kv_read(&token.token, &probe.kv_mount, &path, entry.version)
                .await
            {
                Ok(Some(_value)) => {}
                Ok(None) => unresolved.push(format!("{} (not found)", entry.path)),
                Err(BaoError::Denied(e)) => {
                    unresolved.push(format!("{} (refused: {e})", entry.path))
                }
                Err(e) => {
                    failure = Some(format!("reading {}: {e}", entry.path));
                    break;
                }
            }
        }
        if let Err(e) = bao.revoke_self(&token.token).await {
            tracing::warn!(error = %e, "revoking the readiness probe's OpenBao token failed");
        }
        match failure {
            Some(f) => Err(f),
            None => Ok(unresolved),
        }
    }
}

/// The token file in the agent's state directory (0600).
pub const TOKEN_FILE: &str = "bao.token";

const TIMEOUT: Duration = Duration::from_secs(30);
/// OpenBao's own error words are cut to this length in an error.
const MAX_DETAIL: usize = 300;

#[derive(Debug, thiserror::Error)]
pub enum BaoError {
    /// OpenBao could not be reached, is sealed or overloaded (5xx, 429): temporary, retry later.
    #[error("OpenBao is unreachable: {0}")]
    Unreachable(String),
    /// OpenBao refused (400/401/403): a bad grant or token, or a path the policy denies.
    #[error("OpenBao refused: {0}")]
    Denied(String),
    /// Anything else: a configuration mistake, an unexpected answer.
    #[error("OpenBao: {0}")]
    Other(String),
}

impl BaoError {
    pub fn is_temporary(&self) -> bool {
        matches!(self, BaoError::Unreachable(_))
    }
}

/// A token from a login. `Debug` leaves the token out.
#[derive(Clone, PartialEq, Eq)]
pub struct BaoToken {
    pub token: String,
    pub accessor: String,
    pub ttl_s: u64,
    /// The token's metadata: `env_id` and `grant_jti` (the role's `claim_mappings`), `role`.
    pub meta: BTreeMap<String, String>,
}

impl fmt::Debug for BaoToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BaoToken")
            .field("token", &"<redacted>")
            .field("accessor", &self.accessor)
            .field("ttl_s", &self.ttl_s)
            .field("meta", &self.meta)
            .finish()
    }
}

/// What `lookup-self` says about a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenInfo {
    pub accessor: String,
    /// Seconds left.
    pub ttl_s: u64,
    /// Unix seconds.
    pub creation_time: u64,
    pub meta: BTreeMap<String, String>,
}

/// The client of one OpenBao.
#[derive(Clone)]
pub struct OpenBao {
    addr: String,
    http: reqwest::Client,
}

impl fmt::Debug for OpenBao {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenBao").field("addr", &self.addr).finish()
    }
}

impl OpenBao {
    /// `addr`: `https://host:port` (validated against `ca_pem` when given, else the system's
    /// CAs), or `http://127.0.0.1:port`.
    pub fn new(addr: &str, ca_pem: Option<&[u8]>) -> Result<OpenBao, BaoError> {
        let addr = addr.trim_end_matches('/').to_string();
        let http =
            berth_client::external_http_client(&addr, ca_pem, TIMEOUT).map_err(BaoError::Other)?;
        Ok(OpenBao { addr, http })
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// `POST /v1/auth/{mount}/login {"role", "jwt"}` with a deploy grant.
    pub async fn login_jwt(
        &self,
        auth_mount: &str,
        role: &str,
        jwt: &str,
    ) -> Result<BaoToken, BaoError> {
        check_segment(auth_mount)?;
        let body = self
            .send(
                reqwest::Method::POST,
                &format!("auth/{auth_mount}/login"),
                None,
                Some(json!({"role": role, "jwt": jwt})),
            )
            .await?
            .ok_or_else(|| BaoError::Other(format!("auth/{auth_mount}/login: not found")))?;
        let auth = &body["auth"];
        let token = auth["client_token"]
            .as_str()
            .filter(|t| !t.is_empty())
            .ok_or_else(|| BaoError::Other("the login answer has no client_token".into()))?;
        Ok(BaoToken {
            token: token.to_string(),
            accessor: auth["accessor"].as_str().unwrap_or_default().to_string(),
            ttl_s: auth["lease_duration"].as_u64().unwrap_or(0),
            meta: string_map(&auth["metadata"]),
        })
    }

    /// Reads a manifest secret: `GET /v1/{kv_mount}/data/{env}/{rest}?version=N`. The manifest
    /// path's own mount segment gives way to `kv_mount` (the agent adopts checkin's
    /// `vault.mount`). `None` when OpenBao has no such secret (or version); the secret's `value`
    /// otherwise.
    pub async fn kv_read(
        &self,
        token: &str,
        kv_mount: &str,
        path: &SecretPath,
        version: Option<u32>,
    ) -> Result<Option<String>, BaoError> {
        check_segment(kv_mount)?;
        let at = SecretPath {
            mount: kv_mount.to_string(),
            ..path.clone()
        };
        let mut api_path = at.kv_data_path();
        if let Some(v) = version {
            api_path.push_str(&format!("?version={v}"));
        }
        let Some(body) = self
            .send(reqwest::Method::GET, &api_path, Some(token), None)
            .await?
        else {
            return Ok(None);
        };
        // A deleted or destroyed version answers 404 (handled above) or `data: null`.
        let data = &body["data"]["data"];
        if data.is_null() {
            return Ok(None);
        }
        match data["value"].as_str() {
            Some(value) => Ok(Some(value.to_string())),
            None => Err(BaoError::Other(format!(
                "{}: the secret document has no string `value`",
                at.kv_data_path()
            ))),
        }
    }

    /// `GET /v1/auth/token/lookup-self`.
    pub async fn lookup_self(&self, token: &str) -> Result<TokenInfo, BaoError> {
        let body = self
            .send(
                reqwest::Method::GET,
                "auth/token/lookup-self",
                Some(token),
                None,
            )
            .await?
            .ok_or_else(|| BaoError::Denied("lookup-self: unknown token".into()))?;
        let data = &body["data"];
        Ok(TokenInfo {
            accessor: data["accessor"].as_str().unwrap_or_default().to_string(),
            ttl_s: data["ttl"].as_u64().unwrap_or(0),
            creation_time: data["creation_time"].as_u64().unwrap_or(0),
            meta: string_map(&data["meta"]),
        })
    }

    /// `POST /v1/auth/token/renew-self`, then what the renewed token looks like.
    pub async fn renew_self(&self, token: &str) -> Result<TokenInfo, BaoError> {
        self.send(
            reqwest::Method::POST,
            "auth/token/renew-self",
            Some(token),
            Some(json!({})),
        )
        .await?
        .ok_or_else(|| BaoError::Denied("renew-self: unknown token".into()))?;
        self.lookup_self(token).await
    }

    /// `POST /v1/auth/token/revoke-self`: the token is gone afterwards.
    pub async fn revoke_self(&self, token: &str) -> Result<(), BaoError> {
        self.send(
            reqwest::Method::POST,
            "auth/token/revoke-self",
            Some(token),
            Some(json!({})),
        )
        .await?;
        Ok(())
    }

    /// One call. `Ok(None)` for a 404; `Ok(Some(Null))` for an empty 2xx body.
    async fn send(
        &self,
        method: reqwest::Method,
        api_path: &str,
        token: Option<&str>,
        body: Option<Value>,
    ) -> Result<Option<Value>, BaoError> {
        let what = api_path.split('?').next().unwrap_or(api_path);
        let mut request = self
            .http
            .request(method, format!("{}/v1/{api_path}", self.addr));
        if let Some(token) = token {
            request = request.header("X-Vault-Token", token);
        }
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request.send().await.map_err(|e| {
            // reqwest's message names the URL (no token or body in it) and the cause.
            BaoError::Unreachable(format!("{what}: {}", berth_proto::error::ErrorChain(&e)))
        })?;
        let status = response.status();
        let text = response.text().await.map_err(|e| {
            BaoError::Unreachable(format!("{what}: {}", berth_proto::error::ErrorChain(&e)))
        })?;
        if status == StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            let detail = format!("{what}: {} {}", status.as_u16(), bao_errors(&text));
            return Err(match status.as_u16() {
                400 | 401 | 403 => BaoError::Denied(detail),
                429 | 500..=599 => BaoError::Unreachable(detail),
                _ => BaoError::Other(detail),
            });
        }
        if text.trim().is_empty() {
            return Ok(Some(Value::Null));
        }
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|_| BaoError::Other(format!("{what}: the answer is not JSON")))
    }
}

/// What [`upkeep`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Upkeep {
    /// Nothing to do.
    Fine,
    /// The token had less than [`RENEW_BELOW_S`] left and was renewed.
    Renewed(TokenInfo),
    /// The token is older than [`RELEASE_AFTER_S`]: lease a new grant, log in with it, then
    /// `revoke_self` this token.
    Release,
}

/// The seed's upkeep, run at the end of every tick: `lookup-self`; a token older than
/// 30 d − 2 d → [`Upkeep::Release`] (renewing it would not outlive `token_max_ttl`); less than
/// 12 h left → `renew-self`.
pub async fn upkeep(bao: &OpenBao, token: &str, now_unix: u64) -> Result<Upkeep, BaoError> {
    let info = bao.lookup_self(token).await?;
    if now_unix.saturating_sub(info.creation_time) > RELEASE_AFTER_S {
        return Ok(Upkeep::Release);
    }
    if info.ttl_s < RENEW_BELOW_S {
        return Ok(Upkeep::Renewed(bao.renew_self(token).await?));
    }
    Ok(Upkeep::Fine)
}

/// Reads a `/lease` answer. Refuses the pre-Gate-1 AppRole shape (`wrapping_token` or `role_id`)
/// with `LEASE_SHAPE`, as a guard against a stale server; refuses a body that is not a lease
/// with the same code. The message names fields, never their values.
pub fn parse_lease(body: &Value) -> Result<LeaseResponse, (&'static str, String)> {
    let Some(object) = body.as_object() else {
        return Err((
            codes::LEASE_SHAPE,
            "the lease answer is not a JSON object".into(),
        ));
    };
    let approle: Vec<&str> = ["wrapping_token", "role_id"]
        .into_iter()
        .filter(|k| object.contains_key(*k))
        .collect();
    if !approle.is_empty() {
        return Err((
            codes::LEASE_SHAPE,
            format!(
                "the lease has the AppRole shape ({}); this server predates deploy grants",
                approle.join(", ")
            ),
        ));
    }
    serde_json::from_value(body.clone()).map_err(|_| {
        let fields = ["env_id", "login_jwt", "ttl_s", "mount", "role", "addr"];
        let wrong: Vec<&str> = fields
            .into_iter()
            .filter(|f| match (object.get(*f), *f) {
                (Some(v), "ttl_s") => !v.is_u64(),
                (Some(v), _) => !v.is_string(),
                (None, _) => true,
            })
            .collect();
        (
            codes::LEASE_SHAPE,
            format!(
                "the lease answer is missing or mistypes: {}",
                wrong.join(", ")
            ),
        )
    })
}

/// `<state_dir>/bao.token`.
pub fn token_path(state_dir: &Path) -> PathBuf {
    state_dir.join(TOKEN_FILE)
}

/// Keeps the token (only the token: the rest is `lookup-self`'s) in `bao.token`, 0600.
pub fn save_token(state_dir: &Path, token: &BaoToken) -> std::io::Result<()> {
    berth_fs::write_atomic(&token_path(state_dir), token.token.as_bytes(), 0o600)
}

/// The saved token, `None` when there is none.
pub fn load_token(state_dir: &Path) -> std::io::Result<Option<String>> {
    match std::fs::read_to_string(token_path(state_dir)) {
        Ok(text) => {
            let token = text.trim();
            Ok((!token.is_empty()).then(|| token.to_string()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Forgets the token (a superseded grant, a revoked token). No token is not an error.
pub fn delete_token(state_dir: &Path) -> std::io::Result<()> {
    match std::fs::remove_file(token_path(state_dir)) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// A mount name becomes a URL path segment as it is: the same characters as a manifest path's.
fn check_segment(mount: &str) -> Result<(), BaoError> {
    let ok = !mount.is_empty()
        && mount != "."
        && mount != ".."
        && mount.len() <= 128
        && mount
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(BaoError::Other(format!("{mount:?} is not a mount name")))
    }
}

/// `{"k": "v", …}` (OpenBao's metadata maps); non-string values are left out, `null` is empty.
fn string_map(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .map(|m| {
            m.iter()
                .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// OpenBao's `{"errors": [...]}`, joined and cut; the raw text's start when it is not that.
fn bao_errors(text: &str) -> String {
    let joined = serde_json::from_str::<Value>(text)
        .ok()
        .and_then(|v| {
            v["errors"].as_array().map(|errors| {
                errors
                    .iter()
                    .filter_map(Value::as_str)
                    .collect::<Vec<_>>()
                    .join("; ")
            })
        })
        .unwrap_or_else(|| text.trim().to_string());
    let mut cut = joined;
    if cut.len() > MAX_DETAIL {
        let mut end = MAX_DETAIL;
        while !cut.is_char_boundary(end) {
            end -= 1;
        }
        cut.truncate(end);
        cut.push('…');
    }
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_approle_lease_is_refused() {
        let (code, detail) = parse_lease(&json!({"wrapping_token": "s.secret", "ttl": 60}))
            .expect_err("AppRole shape");
        assert_eq!(code, codes::LEASE_SHAPE);
        assert!(detail.contains("wrapping_token"), "{detail}");
        assert!(!detail.contains("s.secret"), "{detail}");
        let (code, _) = parse_lease(&json!({"role_id": "r", "secret_id": "s"})).unwrap_err();
        assert_eq!(code, codes::LEASE_SHAPE);
        let (code, detail) =
            parse_lease(&json!({"env_id": "e", "login_jwt": "eyJ.secret", "ttl_s": "x"}))
                .unwrap_err();
        assert_eq!(code, codes::LEASE_SHAPE);
        assert!(
            detail.contains("ttl_s") && detail.contains("mount"),
            "{detail}"
        );
        assert!(!detail.contains("eyJ"), "{detail}");
    }

    #[test]
    fn the_seed_lease_parses() {
        let lease = parse_lease(
            &json!({"env_id": "env-qa-02", "login_jwt": "eyJ…", "ttl_s": 3600,
            "mount": "jwt-tenancy", "role": "see-env", "addr": "https://bao.cbs.tikali.net:8200",
            "extra": true}),
        )
        .unwrap();
        assert_eq!(lease.mount, "jwt-tenancy");
        assert_eq!(lease.ttl_s, 3600);
    }

    #[test]
    fn debug_hides_the_token() {
        let token = BaoToken {
            token: "s.topsecret".into(),
            accessor: "acc".into(),
            ttl_s: 1,
            meta: BTreeMap::new(),
        };
        assert!(!format!("{token:?}").contains("topsecret"));
    }

    #[test]
    fn the_token_file_is_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load_token(dir.path()).unwrap(), None);
        let token = BaoToken {
            token: "s.abc".into(),
            accessor: String::new(),
            ttl_s: 0,
            meta: BTreeMap::new(),
        };
        save_token(dir.path(), &token).unwrap();
        let mode = std::fs::metadata(token_path(dir.path()))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        assert_eq!(load_token(dir.path()).unwrap().as_deref(), Some("s.abc"));
        delete_token(dir.path()).unwrap();
        delete_token(dir.path()).unwrap();
        assert_eq!(load_token(dir.path()).unwrap(), None);
    }

    #[test]
    fn errors_are_cut() {
        let long = format!(r#"{{"errors":["{}"]}}"#, "é".repeat(400));
        assert!(bao_errors(&long).len() <= MAX_DETAIL + 3);
        assert_eq!(bao_errors(r#"{"errors":["a","b"]}"#), "a; b");
    }
}
