//! Resolving an image tag to its digest through the registry's HTTP API (distribution v2):
//! `GET /v2/<repo>/manifests/<tag>` with `Accept` for the OCI index and manifest and the Docker
//! manifest list and v2 manifest. The digest is sha256 of the manifest bytes; a
//! `Docker-Content-Digest` header that disagrees with them is refused. A reference that already
//! names a digest is checked the same way: the registry must serve those exact bytes.
//!
//! Authentication follows the registry's `401` challenge: `Basic` with the credentials given,
//! or `Bearer realm=…,service=…,scope=…`, whose token the realm hands out (with the credentials,
//! if given). Credentials live for the call only; they are never stored nor logged.
//!
//! Scheme: a registry on a loopback host (`localhost`, `127.0.0.0/8`, `::1`) is spoken to over
//! plain HTTP, as the Docker engine does by default; every other registry over HTTPS, verified
//! against the system's CA bundle (`SSL_CERT_FILE`, else `/etc/ssl/certs/ca-certificates.crt`).

use std::sync::Arc;
use std::time::Duration;

use berth_proto::reference::{is_sha256_digest, ImageRef};
use reqwest::header::{HeaderMap, ACCEPT, AUTHORIZATION, CONTENT_TYPE, WWW_AUTHENTICATE};
use reqwest::StatusCode;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

/// The manifest media types berth accepts, in the `Accept` header.
const MANIFEST_TYPES: [&str; 4] = [
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json",
];
/// A manifest (even an index of many platforms) is far below this.
const MAX_MANIFEST_BYTES: usize = 4 * 1024 * 1024;
/// Bounds on each registry request: a registry that does not answer fails the create, with
/// `DIGEST_UNRESOLVABLE`, instead of holding it.
const TIMEOUT: Duration = Duration::from_secs(30);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a digest could not be had: the registry refused the credentials, or anything else.
#[derive(Debug)]
pub enum ResolveError {
    Unauthorized(String),
    /// The registry answered `404` for the manifest: it does not have it.
    NotFound(String),
    Unresolvable(String),
}

pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// The HTTP client for registries, built once.
pub struct Registries {
    http: reqwest::Client,
}

impl Registries {
    pub fn new() -> Result<Registries, String> {
        let mut roots = rustls::RootCertStore::empty();
        let bundle = std::env::var_os("SSL_CERT_FILE")
            .unwrap_or_else(|| "/etc/ssl/certs/ca-certificates.crt".into());
        // No bundle means no HTTPS registry verifies; loopback registries still work.
        if let Ok(certs) = CertificateDer::pem_file_iter(&bundle) {
            for cert in certs.flatten() {
                let _ = roots.add(cert);
            }
        }
        let tls = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .timeout(TIMEOUT)
            .connect_timeout(CONNECT_TIMEOUT)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(Registries { http })
    }

    /// The digest of `image` (by tag, `latest` without one, or checked when it names a digest).
    pub async fn resolve(
        &self,
        image: &ImageRef,
        credentials: Option<&Credentials>,
    ) -> Result<String, ResolveError> {
        self.resolve_as(image, credentials, None).await
    }

    /// [`Registries::resolve`] with a bearer token berth minted itself for a registry it is the
    /// token server of (`registry_token.rs`): sent at once, no challenge followed.
    pub async fn resolve_with_token(
        &self,
        image: &ImageRef,
        token: &str,
    ) -> Result<String, ResolveError> {
        self.resolve_as(image, None, Some(format!("Bearer {token}")))
            .await
    }

    async fn resolve_as(
        &self,
        image: &ImageRef,
        credentials: Option<&Credentials>,
        authorization: Option<String>,
    ) -> Result<String, ResolveError> {
        let host = image.registry();
        let (base, path) = endpoint(image);
        let reference = image
            .digest
            .clone()
            .or_else(|| image.tag.clone())
            .unwrap_or_else(|| "latest".into());
        let url = format!("{base}/v2/{path}/manifests/{reference}");
        let unreachable =
            |e: reqwest::Error| ResolveError::Unresolvable(format!("registry {host}: {e}"));

        let mut response = self
            .get(&url, authorization.as_deref())
            .await
            .map_err(unreachable)?;
        if response.status() == StatusCode::UNAUTHORIZED && authorization.is_some() {
            return Err(ResolveError::Unauthorized(format!(
                "registry {host} refused berth's own token for {path}"
            )));
        }
        if response.status() == StatusCode::UNAUTHORIZED {
            let challenge = response
                .headers()
                .get(WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_string();
            let authorization = self.authorize(host, &challenge, credentials).await?;
            response = self
                .get(&url, Some(&authorization))
                .await
                .map_err(unreachable)?;
            if response.status() == StatusCode::UNAUTHORIZED {
                return Err(ResolveError::Unauthorized(format!(
                    "registry {host} refused the credentials for {path}"
                )));
            }
        }
        let status = response.status();
        if status == StatusCode::NOT_FOUND {
            return Err(ResolveError::NotFound(format!(
                "registry {host} has no manifest {reference} in {path}"
            )));
        }
        if !status.is_success() {
            return Err(ResolveError::Unresolvable(format!(
                "registry {host} answered {status} for {path}:{reference}"
            )));
        }
        let headers = response.headers().clone();
        // Read at most the limit: a registry (or whatever answers on its port) cannot make the
        // server buffer an unbounded body.
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(unreachable)? {
            body.extend_from_slice(&chunk);
            if body.len() > MAX_MANIFEST_BYTES {
                return Err(ResolveError::Unresolvable(format!(
                    "registry {host}, {path}:{reference}: the manifest is over {MAX_MANIFEST_BYTES} bytes"
                )));
            }
        }
        manifest_digest(&headers, &body, image.digest.as_deref()).map_err(|why| {
            ResolveError::Unresolvable(format!("registry {host}, {path}:{reference}: {why}"))
        })
    }

    async fn get(
        &self,
        url: &str,
        authorization: Option<&str>,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let mut request = self.http.get(url).header(ACCEPT, MANIFEST_TYPES.join(", "));
        if let Some(a) = authorization {
            request = request.header(AUTHORIZATION, a);
        }
        request.send().await
    }

    /// The `Authorization` value that answers `challenge` (a `WWW-Authenticate` header).
    async fn authorize(
        &self,
        host: &str,
        challenge: &str,
        credentials: Option<&Credentials>,
    ) -> Result<String, ResolveError> {
        let (scheme, params) = challenge.split_once(' ').unwrap_or((challenge, ""));
        if scheme.eq_ignore_ascii_case("basic") {
            let c = credentials.ok_or_else(|| {
                ResolveError::Unauthorized(format!(
                    "registry {host} requires credentials (registryUsername, registryPassword)"
                ))
            })?;
            return Ok(basic(c));
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(ResolveError::Unauthorized(format!(
                "registry {host} asks for authentication berth does not speak ({scheme:?})"
            )));
        }
        let params = challenge_params(params);
        let realm = params
            .iter()
            .find(|(k, _)| k == "realm")
            .map(|(_, v)| v.clone())
            .ok_or_else(|| {
                ResolveError::Unresolvable(format!(
                    "registry {host}: bearer challenge without realm"
                ))
            })?;
        let query: Vec<(&str, &str)> = params
            .iter()
            .filter(|(k, _)| k == "service" || k == "scope")
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let mut request = self.http.get(&realm).query(&query);
        if let Some(c) = credentials {
            request = request.header(AUTHORIZATION, basic(c));
        }
        let response = request.send().await.map_err(|e| {
            ResolveError::Unresolvable(format!("token service of registry {host}: {e}"))
        })?;
        if matches!(
            response.status(),
            StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN
        ) {
            return Err(ResolveError::Unauthorized(format!(
                "the token service of registry {host} refused the credentials"
            )));
        }
        if !response.status().is_success() {
            return Err(ResolveError::Unresolvable(format!(
                "the token service of registry {host} answered {}",
                response.status()
            )));
        }
        #[derive(serde::Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
        }
        let token: Token = response.json().await.map_err(|e| {
            ResolveError::Unresolvable(format!("token service of registry {host}: {e}"))
        })?;
        token
            .token
            .or(token.access_token)
            .map(|t| format!("Bearer {t}"))
            .ok_or_else(|| {
                ResolveError::Unresolvable(format!(
                    "the token service of registry {host} gave no token"
                ))
            })
    }
}

fn basic(c: &Credentials) -> String {
    use base64::Engine as _;
    let pair = format!("{}:{}", c.username, c.password);
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(pair)
    )
}

/// The registry's base URL and the repository path under `/v2/`.
fn endpoint(image: &ImageRef) -> (String, String) {
    let host = image.registry();
    let path = image
        .repository
        .strip_prefix(&format!("{host}/"))
        .unwrap_or(&image.repository);
    if host == "docker.io" {
        // Docker Hub serves its API on another host, and official images under `library/`.
        let path = if path.contains('/') {
            path.to_string()
        } else {
            format!("library/{path}")
        };
        return ("https://registry-1.docker.io".into(), path);
    }
    let scheme = if is_loopback(host) { "http" } else { "https" };
    (format!("{scheme}://{host}"), path.to_string())
}

/// `localhost`, `127.0.0.0/8` or `::1`, with or without a port.
fn is_loopback(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    name == "localhost"
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// `key="value", key=value` pairs of a challenge.
fn challenge_params(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let Some((key, after)) = rest.split_once('=') else {
            break;
        };
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let (value, after) = match after.strip_prefix('"') {
            Some(quoted) => match quoted.split_once('"') {
                Some((v, a)) => (v.to_string(), a),
                None => (quoted.to_string(), ""),
            },
            None => match after.split_once(',') {
                Some((v, a)) => (v.trim().to_string(), a),
                None => (after.trim().to_string(), ""),
            },
        };
        out.push((key, value));
        rest = after.trim_start_matches([',', ' ']);
    }
    out
}

/// The manifest's digest: sha256 of its bytes, which a `Docker-Content-Digest` header and the
/// digest asked for (if any) must equal.
fn manifest_digest(
    headers: &HeaderMap,
    body: &[u8],
    wanted: Option<&str>,
) -> Result<String, String> {
    let media_type = headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    let media_type = media_type.split(';').next().unwrap_or_default().trim();
    if !MANIFEST_TYPES.contains(&media_type) {
        return Err(format!(
            "the answer is {media_type:?}, not an OCI or Docker v2 manifest"
        ));
    }
    let digest = format!("sha256:{}", berth_crypto::sha256_hex(body));
    if let Some(header) = headers
        .get("docker-content-digest")
        .and_then(|v| v.to_str().ok())
    {
        if is_sha256_digest(header) && header != digest {
            return Err(format!(
                "Docker-Content-Digest {header} is not the digest of the manifest served ({digest})"
            ));
        }
    }
    match wanted {
        Some(w) if w != digest => Err(format!("the manifest served has digest {digest}, not {w}")),
        _ => Ok(digest),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_proto::reference::parse_image;

    #[test]
    fn endpoints() {
        let e = |s: &str| endpoint(&parse_image(s).unwrap());
        assert_eq!(
            e("127.0.0.1:55000/team/web:1"),
            ("http://127.0.0.1:55000".into(), "team/web".into())
        );
        assert_eq!(
            e("localhost:5000/web"),
            ("http://localhost:5000".into(), "web".into())
        );
        assert_eq!(
            e("ghcr.io/org/app:1"),
            ("https://ghcr.io".into(), "org/app".into())
        );
        assert_eq!(
            e("nginx:1"),
            (
                "https://registry-1.docker.io".into(),
                "library/nginx".into()
            )
        );
        assert!(!is_loopback("127.0.0.1.example.com:443"));
        assert!(is_loopback("[::1]:5000"));
    }

    #[test]
    fn parses_bearer_challenges() {
        let p = challenge_params(
            r#"realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull""#,
        );
        assert_eq!(
            p,
            vec![
                ("realm".into(), "https://auth.example/token".into()),
                ("service".into(), "registry.example".into()),
                ("scope".into(), "repository:a/b:pull".into()),
            ]
        );
    }
}
