//! berth's side of OpenBao (seed 001): verifying an agent's bearer token with
//! `auth/token/lookup` (answers cached 60 s), resetting the JWT mount's cached keyset when a grant
//! is superseded or used, and revoking a superseded grant's tokens by accessor.
//!
//! The server calls OpenBao with a token of its own (`OpenBaoSettings::token_file`) whose policy
//! allows `update` on `auth/token/lookup` and `auth/token/revoke-accessor`, and `read`+`update`
//! on `auth/<auth_mount>/config`. Tokens are never logged, never part of an error, and the cache
//! is keyed by their SHA-256, never by the token itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::infra::config::OpenBaoSettings;

/// How long a positive lookup is trusted (seed: "cached 60 s").
pub const CACHE_TTL: Duration = Duration::from_secs(60);
/// Most cached answers; past it, expired ones go, and if that is not enough, all of them.
const MAX_CACHED: usize = 10_000;
const TIMEOUT: Duration = Duration::from_secs(15);
/// OpenBao's own error words are cut to this length in an error.
const MAX_DETAIL: usize = 300;

/// What a deploy-grant token says about its holder.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMeta {
    /// `meta.env_id` (the role's `claim_mappings`): the environment the token was minted for.
    pub env_id: String,
    /// `meta.grant_jti`: the grant it was minted from, to compare against live leases.
    pub grant_jti: String,
    pub accessor: String,
}

#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// OpenBao does not know the token (or it is not a deploy-grant token): 401.
    #[error("unknown token: {0}")]
    Unknown(String),
    /// OpenBao is down, or refuses the server's own token: temporary for the agent (503).
    #[error("OpenBao is unavailable: {0}")]
    Unavailable(String),
}

struct Cached {
    meta: TokenMeta,
    until: Instant,
}

/// The server's OpenBao client.
pub struct TokenVerifier {
    addr: String,
    http: reqwest::Client,
    /// The server's own token.
    token: String,
    cache: Mutex<HashMap<[u8; 32], Cached>>,
    cache_ttl: Duration,
    lookups: AtomicU64,
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenVerifier")
            .field("addr", &self.addr)
            .field("cache_ttl", &self.cache_ttl)
            .finish_non_exhaustive()
    }
}

impl TokenVerifier {
    /// From the server's settings: the token is read from `token_file` (required).
    pub fn new(settings: &OpenBaoSettings) -> Result<TokenVerifier, String> {
        let file = settings
            .token_file
            .as_ref()
            .ok_or("OpenBao: no token file for the server's own token")?;
        let token = std::fs::read_to_string(file)
            .map_err(|e| format!("OpenBao token file {}: {e}", file.display()))?;
        TokenVerifier::with_token(
            &settings.addr,
            settings.ca_pem.as_deref().map(str::as_bytes),
            token.trim().to_string(),
        )
    }

    pub fn with_token(
        addr: &str,
        ca_pem: Option<&[u8]>,
        token: String,
    ) -> Result<TokenVerifier, String> {
        if token.is_empty() {
            return Err("OpenBao: the server's own token is empty".into());
        }
        let addr = addr.trim_end_matches('/').to_string();
        let http = berth_client::external_http_client(&addr, ca_pem, TIMEOUT)?;
        Ok(TokenVerifier {
            addr,
            http,
            token,
            cache: Mutex::new(HashMap::new()),
            cache_ttl: CACHE_TTL,
            lookups: AtomicU64::new(0),
        })
    }

    /// Trusts a positive answer for `ttl` instead of [`CACHE_TTL`] (tests).
    pub fn with_cache_ttl(mut self, ttl: Duration) -> TokenVerifier {
        self.cache_ttl = ttl;
        self
    }

    /// How many lookups reached OpenBao.
    pub fn lookups(&self) -> u64 {
        self.lookups.load(Ordering::Relaxed)
    }

    /// The holder of `bearer`: a cached answer younger than the cache TTL (and the token's own
    /// remaining TTL), else `POST auth/token/lookup`. A token without `meta.env_id` and
    /// `meta.grant_jti` (not minted from a deploy grant) is [`VerifyError::Unknown`].
    pub async fn verify(&self, bearer: &str) -> Result<TokenMeta, VerifyError> {
        // An empty token makes `auth/token/lookup` describe the caller: the server itself.
        if bearer.trim().is_empty() || bearer.len() > 4096 {
            return Err(VerifyError::Unknown("empty or oversized token".into()));
        }
        let key = berth_crypto::sha256(bearer.as_bytes());
        let now = Instant::now();
        if let Some(hit) = self.lock_cache().get(&key).filter(|c| c.until > now) {
            return Ok(hit.meta.clone());
        }
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let body = match self
            .call("auth/token/lookup", json!({ "token": bearer }))
            .await?
        {
            Answer::Ok(body) => body,
            Answer::Refused(status, detail) => {
                // `bad token` is about the agent's token; `permission denied` about ours.
                return Err(if detail.contains("permission denied") {
                    VerifyError::Unavailable(format!(
                        "auth/token/lookup: {status} {detail} (the server's own token)"
                    ))
                } else {
                    VerifyError::Unknown(format!("{status} {detail}"))
                });
            }
        };
        let data = &body["data"];
        let field = |name: &str| {
            data["meta"][name]
                .as_str()
                .filter(|v| !v.is_empty())
                .map(str::to_string)
        };
        let (Some(env_id), Some(grant_jti)) = (field("env_id"), field("grant_jti")) else {
            return Err(VerifyError::Unknown(
                "the token was not minted from a deploy grant (no meta.env_id/grant_jti)".into(),
            ));
        };
        let meta = TokenMeta {
            env_id,
            grant_jti,
            accessor: data["accessor"].as_str().unwrap_or_default().to_string(),
        };
        // A token's `ttl` of 0 means it never expires (root-like); otherwise it bounds the cache.
        let ttl = match data["ttl"].as_u64() {
            Some(0) | None => self.cache_ttl,
            Some(s) => self.cache_ttl.min(Duration::from_secs(s)),
        };
        let mut cache = self.lock_cache();
        if cache.len() >= MAX_CACHED {
            cache.retain(|_, c| c.until > now);
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
        }
        cache.insert(
            key,
            Cached {
                meta: meta.clone(),
                until: now + ttl,
            },
        );
        Ok(meta)
    }

    /// Forgets every cached answer naming `grant_jti` (a superseded grant), so its tokens are
    /// looked up again at their next call.
    pub fn forget_grant(&self, grant_jti: &str) {
        self.lock_cache()
            .retain(|_, c| c.meta.grant_jti != grant_jti);
    }

    /// Makes the JWT mount drop the keys it cached from berth's JWKS, so a grant whose key berth
    /// no longer lists (superseded or used) fails at login. OpenBao fetches `jwks_url` again only
    /// for a `kid` it has not cached; re-writing the mount's config (read, then written back
    /// unchanged) rebuilds its key set. Meant for a `jwks_url` mount (seed 001's): OpenBao never
    /// reads back `oidc_client_secret`, so an OIDC mount would lose it here.
    pub async fn reset_keyset(&self, auth_mount: &str) -> Result<(), VerifyError> {
        if auth_mount.is_empty()
            || !auth_mount
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(VerifyError::Unavailable(format!(
                "{auth_mount:?} is not a mount name"
            )));
        }
        let path = format!("auth/{auth_mount}/config");
        let current = match self.request(reqwest::Method::GET, &path, None).await? {
            Answer::Ok(body) => body,
            Answer::Refused(status, detail) => {
                return Err(VerifyError::Unavailable(format!(
                    "{path}: {status} {detail}"
                )))
            }
        };
        let config = writable_config(&current["data"]);
        match self.call(&path, config).await? {
            Answer::Ok(_) => Ok(()),
            Answer::Refused(status, detail) => Err(VerifyError::Unavailable(format!(
                "{path}: {status} {detail}"
            ))),
        }
    }

    /// Revokes the token with `accessor` (and its children). An unknown accessor is no error:
    /// the token is gone either way.
    pub async fn revoke_accessor(&self, accessor: &str) -> Result<(), VerifyError> {
        match self
            .call(
                "auth/token/revoke-accessor",
                json!({ "accessor": accessor }),
            )
            .await?
        {
            Answer::Ok(_) => Ok(()),
            Answer::Refused(400, detail) if detail.contains("invalid accessor") => Ok(()),
            Answer::Refused(status, detail) => Err(VerifyError::Unavailable(format!(
                "auth/token/revoke-accessor: {status} {detail}"
            ))),
        }
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Cached>> {
        // The map holds no invariant a panicking holder could break halfway.
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn call(&self, path: &str, body: Value) -> Result<Answer, VerifyError> {
        self.request(reqwest::Method::POST, path, Some(body)).await
    }

    async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Answer, VerifyError> {
        let mut request = self
            .http
            .request(method, format!("{}/v1/{path}", self.addr))
            .header("X-Vault-Token", &self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let unavailable = |e: reqwest::Error| {
            VerifyError::Unavailable(format!("{path}: {}", berth_proto::error::ErrorChain(&e)))
        };
        let response = request.send().await.map_err(unavailable)?;
        let status = response.status().as_u16();
        let text = response.text().await.map_err(unavailable)?;
        match status {
            200..=299 => Ok(Answer::Ok(if text.trim().is_empty() {
                Value::Null
            } else {
                serde_json::from_str(&text).map_err(|_| {
                    VerifyError::Unavailable(format!("{path}: the answer is not JSON"))
                })?
            })),
            400 | 401 | 403 | 404 => Ok(Answer::Refused(status, bao_errors(&text))),
            _ => Err(VerifyError::Unavailable(format!(
                "{path}: {status} {}",
                bao_errors(&text)
            ))),
        }
    }
}

enum Answer {
    Ok(Value),
    Refused(u16, String),
}

/// The JWT mount's config as read, minus what cannot be written back as it was read (empty and
/// null values; OpenBao answers every field, and writing an empty `oidc_discovery_url` next to a
/// `jwks_url` is refused as two key sources).
fn writable_config(data: &Value) -> Value {
    let Some(fields) = data.as_object() else {
        return json!({});
    };
    Value::Object(
        fields
            .iter()
            .filter(|(_, v)| match v {
                Value::Null => false,
                Value::String(s) => !s.is_empty(),
                Value::Array(a) => !a.is_empty(),
                Value::Object(o) => !o.is_empty(),
                _ => true,
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    )
}

/// OpenBao's `{"errors": [...]}`, joined and cut.
fn bao_errors(text: &str) -> String {
    let mut joined = serde_json::from_str::<Value>(text)
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
        .unwrap_or_default();
    if joined.len() > MAX_DETAIL {
        let mut end = MAX_DETAIL;
        while !joined.is_char_boundary(end) {
            end -= 1;
        }
        joined.truncate(end);
        joined.push('…');
    }
    joined
}
