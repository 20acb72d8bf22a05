//! The OpenBao of `scripts/openbao.sh` (`BERTH_TEST_OPENBAO_*`), and [`SeedMounts`]: what seed
//! 001's Terraform sets up (a JWT auth mount reading berth's JWKS, the `see-env` role, a KV v2
//! mount and the templated `see-env` policy), under names unique to one call so tests never share
//! or leave state.

use std::time::Duration;

use serde_json::{json, Value};

use crate::require_service;

/// The role name of seed 001.
pub const ROLE: &str = "see-env";

/// The `BERTH_TEST_OPENBAO_*` variables `scripts/openbao.sh` prints.
#[derive(Clone)]
pub struct OpenBaoEnv {
    /// `http://127.0.0.1:58200`.
    pub addr: String,
    /// The dev server's root token.
    pub root_token: String,
    http: reqwest::Client,
}

impl std::fmt::Debug for OpenBaoEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenBaoEnv")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl OpenBaoEnv {
    /// The running OpenBao, or `None` (SKIP; a failure when services are required).
    pub async fn from_env(test: &str) -> Option<OpenBaoEnv> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let (Some(addr), Some(root_token)) = (
            var("BERTH_TEST_OPENBAO_ADDR"),
            var("BERTH_TEST_OPENBAO_TOKEN"),
        ) else {
            return require_service(
                test,
                "BERTH_TEST_OPENBAO_ADDR/_TOKEN are not set (run scripts/openbao.sh and export what it prints)",
            );
        };
        let http = berth_client::external_http_client(&addr, None, Duration::from_secs(30))
            .expect("an http client for the test OpenBao");
        let env = OpenBaoEnv {
            addr,
            root_token,
            http,
        };
        match env.call("GET", "auth/token/lookup-self", None).await {
            Ok((200, _)) => Some(env),
            Ok((status, body)) => require_service(
                test,
                &format!(
                    "OpenBao at {} refuses the root token: {status} {body}",
                    env.addr
                ),
            ),
            Err(e) => require_service(test, &format!("no OpenBao answers at {}: {e}", env.addr)),
        }
    }

    /// One API call as root: `(status, body)` (`Null` for an empty body).
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), String> {
        self.call_as(&self.root_token, method, path, body).await
    }

    /// One API call with `token` (none when empty).
    pub async fn call_as(
        &self,
        token: &str,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<(u16, Value), String> {
        let method = reqwest::Method::from_bytes(method.as_bytes()).map_err(|e| e.to_string())?;
        let mut request = self
            .http
            .request(method, format!("{}/v1/{path}", self.addr));
        if !token.is_empty() {
            request = request.header("X-Vault-Token", token);
        }
        if let Some(body) = body {
            request = request.json(body);
        }
        let response = request.send().await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let text = response.text().await.map_err(|e| e.to_string())?;
        let body = if text.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).map_err(|e| format!("{status}: {e}: {text}"))?
        };
        Ok((status, body))
    }

    /// Like [`call`](Self::call), panicking unless the answer is a 2xx.
    pub async fn must(&self, method: &str, path: &str, body: Option<&Value>) -> Value {
        match self.call(method, path, body).await {
            Ok((status, body)) if (200..300).contains(&status) => body,
            Ok((status, body)) => panic!("OpenBao {method} {path}: {status} {body}"),
            Err(e) => panic!("OpenBao {method} {path}: {e}"),
        }
    }
}

/// Seed 001's OpenBao setup under unique names. Torn down by [`teardown`](Self::teardown), or
/// on drop (from a thread of its own, so it also works inside a runtime).
pub struct SeedMounts {
    env: OpenBaoEnv,
    /// The JWT auth mount, `jwt-<rand>` (seed: `jwt-tenancy`).
    pub auth_mount: String,
    /// Its accessor, which the policy template names.
    pub auth_accessor: String,
    /// The KV v2 mount, `kv-<rand>` (seed: `monky`).
    pub kv_mount: String,
    /// [`ROLE`].
    pub role: String,
    /// The role's policy, `see-env-<rand>`.
    pub policy: String,
    /// The policy of [`server_token`](Self::server_token), `berth-server-<rand>`.
    pub server_policy: String,
    torn_down: bool,
}

impl std::fmt::Debug for SeedMounts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeedMounts")
            .field("auth_mount", &self.auth_mount)
            .field("kv_mount", &self.kv_mount)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// Seed 001's token lifetimes: 24 h, at most 30 d.
const TOKEN_TTL_S: u64 = 86_400;
const TOKEN_MAX_TTL_S: u64 = 2_592_000;

impl SeedMounts {
    /// Mounts and configures everything; `jwks_url` must answer now (OpenBao fetches it when the
    /// mount is configured). `jwks_ca_pem`: the CA of an HTTPS JWKS (berth's own).
    pub async fn configure(
        env: &OpenBaoEnv,
        jwks_url: &str,
        jwks_ca_pem: Option<&str>,
    ) -> SeedMounts {
        let suffix = uuid::Uuid::new_v4().simple().to_string()[..12].to_string();
        let mut mounts = SeedMounts {
            env: env.clone(),
            auth_mount: format!("jwt-{suffix}"),
            auth_accessor: String::new(),
            kv_mount: format!("kv-{suffix}"),
            role: ROLE.to_string(),
            policy: format!("see-env-{suffix}"),
            server_policy: format!("berth-server-{suffix}"),
            torn_down: false,
        };
        env.must(
            "POST",
            &format!("sys/auth/{}", mounts.auth_mount),
            Some(&json!({"type": "jwt", "description": "berth test (seed 001 jwt-tenancy)"})),
        )
        .await;
        let auths = env.must("GET", "sys/auth", None).await;
        mounts.auth_accessor = auths["data"][format!("{}/", mounts.auth_mount)]["accessor"]
            .as_str()
            .expect("the new auth mount's accessor")
            .to_string();
        let mut config = json!({"jwks_url": jwks_url});
        if let Some(ca) = jwks_ca_pem {
            config["jwks_ca_pem"] = json!(ca);
        }
        env.must(
            "POST",
            &format!("auth/{}/config", mounts.auth_mount),
            Some(&config),
        )
        .await;
        env.must(
            "POST",
            &format!("sys/mounts/{}", mounts.kv_mount),
            Some(&json!({"type": "kv", "options": {"version": "2"}})),
        )
        .await;
        let kv = &mounts.kv_mount;
        let env_id = format!(
            "{{{{identity.entity.aliases.{}.metadata.env_id}}}}",
            mounts.auth_accessor
        );
        let policy = format!(
            r#"path "{kv}/data/{env_id}/see/*" {{ capabilities = ["read"] }}
path "{kv}/metadata/{env_id}/see/*" {{ capabilities = ["list"] }}
path "{kv}/metadata/{env_id}/see" {{ capabilities = ["list"] }}
path "auth/token/renew-self" {{ capabilities = ["update"] }}
path "auth/token/lookup-self" {{ capabilities = ["read"] }}
path "auth/token/revoke-self" {{ capabilities = ["update"] }}
"#
        );
        env.must(
            "PUT",
            &format!("sys/policies/acl/{}", mounts.policy),
            Some(&json!({"policy": policy})),
        )
        .await;
        // What berth's server needs: look tokens up, revoke a superseded grant's tokens, and
        // re-write the JWT mount's config (the keyset reset).
        let server_policy = format!(
            r#"path "auth/token/lookup" {{ capabilities = ["update"] }}
path "auth/token/revoke-accessor" {{ capabilities = ["update"] }}
path "auth/{}/config" {{ capabilities = ["read", "update"] }}
"#,
            mounts.auth_mount
        );
        env.must(
            "PUT",
            &format!("sys/policies/acl/{}", mounts.server_policy),
            Some(&json!({"policy": server_policy})),
        )
        .await;
        mounts.write_role(TOKEN_TTL_S, TOKEN_MAX_TTL_S).await;
        mounts
    }

    async fn write_role(&self, ttl_s: u64, max_ttl_s: u64) {
        self.env
            .must(
                "POST",
                &format!("auth/{}/role/{}", self.auth_mount, self.role),
                Some(&json!({
                    "role_type": "jwt",
                    "user_claim": "env_id",
                    "bound_audiences": [berth_proto::desired::GRANT_AUDIENCE],
                    "bound_claims": {"kind": berth_proto::desired::GRANT_KIND},
                    "claim_mappings": {"env_id": "env_id", "jti": "grant_jti"},
                    "token_ttl": ttl_s,
                    "token_max_ttl": max_ttl_s,
                    "token_no_default_policy": true,
                    "token_policies": [self.policy],
                })),
            )
            .await;
    }

    /// Sets the role's token lifetimes (the renewal test uses a short `token_ttl`).
    pub async fn set_token_ttl(&self, ttl_s: u64, max_ttl_s: u64) {
        self.write_role(ttl_s, max_ttl_s).await;
    }

    /// Writes `{"value": value}` at `<kv>/data/<env_id>/see/<name>`; returns the new version.
    pub async fn put_secret(&self, env_id: &str, name: &str, value: &str) -> u32 {
        let body = self
            .env
            .must(
                "POST",
                &format!("{}/data/{env_id}/see/{name}", self.kv_mount),
                Some(&json!({"data": {"value": value}})),
            )
            .await;
        body["data"]["version"]
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .expect("a KV v2 write answers its version")
    }

    /// Logs in with a grant as the agent does (no token of its own): `(status, body)`.
    pub async fn login(&self, jwt: &str) -> (u16, Value) {
        self.env
            .call_as(
                "",
                "POST",
                &format!("auth/{}/login", self.auth_mount),
                Some(&json!({"role": self.role, "jwt": jwt})),
            )
            .await
            .expect("OpenBao answers a login")
    }

    /// The manifest path of a secret, tenancy's form: `<kv>/<env_id>/see/<name>`.
    pub fn manifest_path(&self, env_id: &str, name: &str) -> String {
        format!("{}/{env_id}/see/{name}", self.kv_mount)
    }

    /// A fresh token with what berth's server needs and nothing else (`auth/token/lookup`,
    /// `auth/token/revoke-accessor`, this mount's config).
    pub async fn server_token(&self) -> String {
        let body = self
            .env
            .must(
                "POST",
                "auth/token/create",
                Some(&json!({
                    "policies": [self.server_policy],
                    "no_default_policy": true,
                    "ttl": "1h",
                })),
            )
            .await;
        body["auth"]["client_token"]
            .as_str()
            .expect("a created token")
            .to_string()
    }

    /// Removes the mounts, policies and the logins' entities (disabling the auth mount revokes
    /// its tokens).
    pub async fn teardown(mut self) {
        self.torn_down = true;
        remove(&self.env, &self.auth_accessor, &self.paths()).await;
    }

    fn paths(&self) -> Vec<String> {
        vec![
            format!("sys/auth/{}", self.auth_mount),
            format!("sys/mounts/{}", self.kv_mount),
            format!("sys/policies/acl/{}", self.policy),
            format!("sys/policies/acl/{}", self.server_policy),
        ]
    }
}

/// Removes the entities the logins through `accessor` made (one per env), then `paths`.
async fn remove(env: &OpenBaoEnv, accessor: &str, paths: &[String]) {
    let mut doomed = Vec::new();
    if let Ok((200, aliases)) = env.call("LIST", "identity/entity-alias/id", None).await {
        if let Some(info) = aliases["data"]["key_info"].as_object() {
            for alias in info.values() {
                if alias["mount_accessor"] == accessor {
                    if let Some(entity) = alias["canonical_id"].as_str() {
                        doomed.push(format!("identity/entity/id/{entity}"));
                    }
                }
            }
        }
    }
    for path in doomed.iter().chain(paths) {
        match env.call("DELETE", path, None).await {
            Ok((status, _)) if (200..300).contains(&status) || status == 404 => {}
            Ok((status, body)) => eprintln!("OpenBao cleanup DELETE {path}: {status} {body}"),
            Err(e) => eprintln!("OpenBao cleanup DELETE {path}: {e}"),
        }
    }
}

impl Drop for SeedMounts {
    fn drop(&mut self) {
        if self.torn_down {
            return;
        }
        // A client of its own too: a client's connections belong to the runtime that made them.
        let env = OpenBaoEnv {
            http: berth_client::external_http_client(&self.env.addr, None, Duration::from_secs(30))
                .expect("an http client for the test OpenBao"),
            ..self.env.clone()
        };
        let paths = self.paths();
        let accessor = self.auth_accessor.clone();
        // A runtime of its own on a thread of its own: drop may run inside the test's runtime,
        // which cannot be blocked on from within.
        let cleanup =
            std::thread::spawn(move || {
                match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt.block_on(remove(&env, &accessor, &paths)),
                    Err(e) => eprintln!("OpenBao cleanup: no runtime: {e}"),
                }
            });
        let _ = cleanup.join();
    }
}

/// A JWKS endpoint for OpenBao to fetch, `http://127.0.0.1:<port>/.well-known/agent-jwks.json`,
/// serving whatever keys the test sets (berth serves one key per live grant). It counts the
/// fetches, so a test can see OpenBao come back for the keys. Stops on drop.
pub struct JwksServer {
    pub url: String,
    keys: std::sync::Arc<std::sync::Mutex<Vec<berth_crypto::PublicJwk>>>,
    fetches: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl JwksServer {
    pub async fn start() -> JwksServer {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port for the JWKS server");
        let url = format!(
            "http://{}{}",
            listener.local_addr().expect("its address"),
            berth_proto::desired::paths::AGENT_JWKS
        );
        let keys = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let fetches = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let (served, counted) = (keys.clone(), fetches.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (served, counted) = (served.clone(), counted.clone());
                tokio::spawn(async move {
                    // One request per connection; its head is all that matters.
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 65536 {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let keys = served.lock().expect("keys").clone();
                    let body = json!({ "keys": keys }).to_string();
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(response.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        JwksServer {
            url,
            keys,
            fetches,
            task,
        }
    }

    /// Serves exactly these keys from now on.
    pub fn set_keys(&self, keys: Vec<berth_crypto::PublicJwk>) {
        *self.keys.lock().expect("keys") = keys;
    }

    /// How many times the keys were fetched.
    pub fn fetches(&self) -> u64 {
        self.fetches.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for JwksServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The claims of a seed 001 deploy grant for `env_id`: `iss`, `aud` openbao-see-env, `sub`
/// agent:<env_id>, `env_id`, `kind` deploy-grant, `jti`, `iat`, `exp` in an hour. Tests change
/// a field to see it refused.
pub fn grant_claims(env_id: &str, jti: &str) -> Value {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock after 1970")
        .as_secs();
    json!({
        "iss": "berth-test",
        "aud": berth_proto::desired::GRANT_AUDIENCE,
        "sub": format!("agent:{env_id}"),
        "env_id": env_id,
        "kind": berth_proto::desired::GRANT_KIND,
        "jti": jti,
        "iat": now,
        "nbf": now - 5,
        "exp": now + berth_proto::desired::GRANT_TTL_SECS,
    })
}
