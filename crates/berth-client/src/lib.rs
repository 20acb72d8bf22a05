//! The one typed HTTPS client for the berth API, used by the CLI, the agent and the tests.
//!
//! TLS 1.3 only, with the aws-lc-rs provider. It trusts exactly one CA: either a CA certificate
//! the caller holds, or — on an agent's first contact — a CA pinned by fingerprint, which the
//! server must present in its chain. It never trusts on first use silently.

mod events;
mod external;
pub mod sealing;
mod stream;

pub use events::{EventStream, StreamError};
pub use external::{external_http_client, webhook_http_client};
pub use stream::WebSocket;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use berth_proto::{ErrorBody, Method, Request};
use reqwest::StatusCode;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};

/// Which CA the client trusts for the server's certificate.
#[derive(Debug, Clone)]
pub enum Trust {
    /// A CA certificate, PEM.
    CaPem(String),
    /// `sha256:<hex>` of the CA certificate's DER. The server must send that CA in its chain;
    /// the server certificate is then verified against it as usual.
    CaFingerprint(String),
}

/// A client certificate and its PKCS#8 key, both PEM.
#[derive(Clone)]
pub struct Identity {
    pub cert_pem: String,
    pub key_pem: String,
}

#[derive(Clone)]
pub struct ClientConfig {
    /// `https://host:port`, without a trailing slash.
    pub server: String,
    pub trust: Trust,
    pub identity: Option<Identity>,
    /// `Authorization: Bearer …` for admin calls.
    pub bearer: Option<String>,
    /// Per-request timeout (long-polls pass their own).
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("invalid client configuration: {0}")]
    Config(String),
    /// The server could not be reached, or the connection broke (retriable).
    #[error("cannot reach {server}")]
    Transport {
        server: String,
        #[source]
        source: reqwest::Error,
    },
    /// The server answered with an error body.
    #[error("{status}: {} ({})", .body.detail, .body.code)]
    Api {
        status: u16,
        body: ErrorBody,
        /// From `Retry-After`, when the server sent one.
        retry_after: Option<Duration>,
    },
    #[error("unexpected response from server")]
    Decode(#[source] reqwest::Error),
    /// A WebSocket could not be opened or broke (retriable, like `Transport`).
    #[error("cannot reach {server}")]
    Connect {
        server: String,
        #[source]
        source: std::io::Error,
    },
}

impl ClientError {
    /// The stable error code, for an API error.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { body, .. } => Some(&body.code),
            _ => None,
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// Why the TLS handshake failed, when it failed for a certificate reason, read from the typed
    /// `rustls::Error` in the transport error's source chain.
    pub fn tls_failure(&self) -> Option<TlsFailure> {
        let mut next: Option<&(dyn std::error::Error + 'static)> = match self {
            ClientError::Transport { source, .. } => Some(source),
            ClientError::Connect { source, .. } => Some(source),
            _ => return None,
        };
        while let Some(e) = next {
            if let Some(tls) = as_rustls(e) {
                return TlsFailure::of(tls);
            }
            next = e.source();
        }
        None
    }
}

/// A handshake failure about certificates; retrying the same call cannot fix either.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsFailure {
    /// This client refused the server: its certificate does not verify against the trusted CA,
    /// or the server did not present the pinned CA.
    ServerNotTrusted,
    /// The server refused this client's certificate (a fatal `bad_certificate`,
    /// `certificate_expired` or `unknown_ca` alert).
    ClientCertificateRefused,
}

impl TlsFailure {
    fn of(e: &rustls::Error) -> Option<TlsFailure> {
        use rustls::AlertDescription as Alert;
        match e {
            rustls::Error::InvalidCertificate(_) => Some(TlsFailure::ServerNotTrusted),
            rustls::Error::Other(other) if other.0.downcast_ref::<PinnedCaMissing>().is_some() => {
                Some(TlsFailure::ServerNotTrusted)
            }
            rustls::Error::AlertReceived(
                Alert::BadCertificate | Alert::CertificateExpired | Alert::UnknownCA,
            ) => Some(TlsFailure::ClientCertificateRefused),
            _ => None,
        }
    }
}

/// A `rustls::Error` itself, or inside the `io::Error`s the TLS stream wraps it in (an
/// `io::Error`'s `source()` skips its payload, so it is unwrapped here).
fn as_rustls<'e>(e: &'e (dyn std::error::Error + 'static)) -> Option<&'e rustls::Error> {
    if let Some(tls) = e.downcast_ref::<rustls::Error>() {
        return Some(tls);
    }
    let inner = e.downcast_ref::<std::io::Error>()?.get_ref()?;
    as_rustls(inner)
}

/// The server's chain does not contain the CA pinned by fingerprint.
#[derive(Debug, thiserror::Error)]
#[error("server did not present the pinned CA {0}")]
struct PinnedCaMissing(String);

#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    /// For a WebSocket's own HTTP/1.1 connection (`stream.rs`).
    stream_tls: Arc<rustls::ClientConfig>,
    server: String,
    /// Every server this client may use, `server` first: replicas of one control plane
    /// ([`Client::with_fallbacks`]).
    servers: Arc<[String]>,
    /// Which of `servers` answered last; requests start there.
    current: Arc<AtomicUsize>,
    bearer: Option<String>,
}

impl Client {
    pub fn new(config: ClientConfig) -> Result<Client, ClientError> {
        let tls = tls_config(&config.trust, config.identity.as_ref())?;
        let stream_tls = stream::stream_tls(tls.clone());
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .timeout(config.timeout)
            .connect_timeout(Duration::from_secs(10))
            .pool_idle_timeout(Duration::from_secs(120))
            .build()
            .map_err(|e| ClientError::Config(format!("http client: {e}")))?;
        let server = config.server.trim_end_matches('/').to_string();
        Ok(Client {
            http,
            stream_tls,
            servers: Arc::from(vec![server.clone()]),
            server,
            current: Arc::new(AtomicUsize::new(0)),
            bearer: config.bearer,
        })
    }

    /// This client with more servers to try, in order, after its own: replicas of one control
    /// plane (same CA, one database). A request that cannot connect (nothing was sent) goes to
    /// the next server; so does one answered 5xx when it is safe to repeat: a GET, or a request
    /// with an `Idempotency-Key` (a 5xx may come after the server acted, and the key makes the
    /// next server answer with what the first one did). Any other answer is final, and later
    /// requests start at the server that gave it. The task stream's WebSocket moves on the
    /// same way (`stream.rs`).
    pub fn with_fallbacks(mut self, others: impl IntoIterator<Item = String>) -> Client {
        let mut servers = vec![self.server.clone()];
        servers.extend(
            others
                .into_iter()
                .map(|s| s.trim_end_matches('/').to_string()),
        );
        self.servers = Arc::from(servers);
        self.current = Arc::new(AtomicUsize::new(0));
        self
    }

    pub fn server(&self) -> &str {
        &self.server
    }

    /// Sends a typed request and decodes its typed response.
    pub async fn send<R: Request>(&self, request: &R) -> Result<R::Response, ClientError> {
        self.send_with(request, &[], None).await
    }

    /// Like [`Client::send`], with extra headers and an optional per-call timeout.
    pub async fn send_with<R: Request>(
        &self,
        request: &R,
        headers: &[(&str, &str)],
        timeout: Option<Duration>,
    ) -> Result<R::Response, ClientError> {
        let method = match R::METHOD {
            Method::Get => reqwest::Method::GET,
            Method::Post => reqwest::Method::POST,
            Method::Put => reqwest::Method::PUT,
            Method::Delete => reqwest::Method::DELETE,
        };
        let path = request.path();
        let response = self
            .execute(|server| {
                let mut builder = self.http.request(method.clone(), format!("{server}{path}"));
                if request.has_body() {
                    builder = builder.json(request);
                }
                for (name, value) in headers {
                    builder = builder.header(*name, *value);
                }
                if let Some(timeout) = timeout {
                    builder = builder.timeout(timeout);
                }
                builder
            })
            .await?;
        response.json().await.map_err(ClientError::Decode)
    }

    /// POSTs raw bytes of `content_type` (a bundle's tar) and decodes the JSON answer.
    pub async fn post_bytes<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        content_type: &str,
        body: Vec<u8>,
    ) -> Result<T, ClientError> {
        let response = self
            .execute(|server| {
                self.http
                    .post(format!("{server}{path}"))
                    .header(reqwest::header::CONTENT_TYPE, content_type)
                    .body(body.clone())
            })
            .await?;
        response.json().await.map_err(ClientError::Decode)
    }

    /// GET a path and return the body as text (metrics, OpenAPI, JWKS).
    pub async fn get_text(&self, path: &str) -> Result<String, ClientError> {
        let response = self
            .execute(|server| self.http.get(format!("{server}{path}")))
            .await?;
        response.text().await.map_err(ClientError::Decode)
    }

    /// GET a path with extra headers; the body as bytes, with the response headers (bundles).
    pub async fn get_bytes(
        &self,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<(reqwest::header::HeaderMap, Vec<u8>), ClientError> {
        let response = self
            .execute(|server| {
                let mut builder = self.http.get(format!("{server}{path}"));
                for (name, value) in headers {
                    builder = builder.header(*name, *value);
                }
                builder
            })
            .await?;
        let headers = response.headers().clone();
        let body = response.bytes().await.map_err(ClientError::Decode)?;
        Ok((headers, body.to_vec()))
    }

    /// GET a path; the body as bytes, or `None` once it proves longer than `limit` bytes (by its
    /// `Content-Length` or while it is read, so no more than `limit` bytes are ever buffered).
    pub async fn get_bytes_capped(
        &self,
        path: &str,
        limit: u64,
    ) -> Result<Option<Vec<u8>>, ClientError> {
        let mut response = self
            .execute(|server| self.http.get(format!("{server}{path}")))
            .await?;
        if response.content_length().is_some_and(|n| n > limit) {
            return Ok(None);
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(ClientError::Decode)? {
            if body.len() as u64 + chunk.len() as u64 > limit {
                return Ok(None);
            }
            body.extend_from_slice(&chunk);
        }
        Ok(Some(body))
    }

    /// GET a path with extra headers, the answer as untyped JSON (a KV read).
    pub async fn get_value(
        &self,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<serde_json::Value, ClientError> {
        let response = self
            .execute(|server| {
                let mut builder = self.http.get(format!("{server}{path}"));
                for (name, value) in headers {
                    builder = builder.header(*name, *value);
                }
                builder
            })
            .await?;
        response.json().await.map_err(ClientError::Decode)
    }

    /// POST a JSON body, the answer as untyped JSON: for answers whose shape the caller checks
    /// before it trusts them (a lease).
    pub async fn post_value<B: serde::Serialize>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<serde_json::Value, ClientError> {
        let response = self
            .execute(|server| self.http.post(format!("{server}{path}")).json(body))
            .await?;
        response.json().await.map_err(ClientError::Decode)
    }

    /// Whether this client has servers to fall back on ([`Client::with_fallbacks`]).
    pub fn has_fallbacks(&self) -> bool {
        self.servers.len() > 1
    }

    /// Sends the request `build` makes for a server, to the server that answered last and, on
    /// a failed connection or (when it is safe to repeat) a 5xx, to each next one in turn (see
    /// [`Client::with_fallbacks`]).
    async fn execute(
        &self,
        build: impl Fn(&str) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, ClientError> {
        let first = self.current.load(Ordering::Relaxed);
        let count = self.servers.len();
        let mut tried = 0;
        let response = loop {
            let at = (first + tried) % count;
            tried += 1;
            let server = &self.servers[at];
            let mut builder = build(server);
            if let Some(token) = &self.bearer {
                builder = builder.bearer_auth(token);
            }
            let more = tried < count;
            let transport = |source| ClientError::Transport {
                server: server.clone(),
                source,
            };
            let request = builder.build().map_err(transport)?;
            let repeatable = request.method() == reqwest::Method::GET
                || request
                    .headers()
                    .contains_key(berth_proto::headers::IDEMPOTENCY_KEY_HEADER);
            match self.http.execute(request).await {
                // Not connected: the request never left, so the next server may take it.
                Err(source) if more && source.is_connect() => continue,
                Err(source) => return Err(transport(source)),
                Ok(response) if more && repeatable && response.status().is_server_error() => {
                    continue
                }
                Ok(response) => {
                    if count > 1 {
                        self.current.store(at, Ordering::Relaxed);
                    }
                    break response;
                }
            }
        };
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs);
        let text = response.text().await.unwrap_or_default();
        let body = serde_json::from_str::<ErrorBody>(&text).unwrap_or_else(|_| ErrorBody {
            code: fallback_code(status).to_string(),
            detail: text.chars().take(512).collect(),
        });
        Err(ClientError::Api {
            status: status.as_u16(),
            body,
            retry_after,
        })
    }
}

fn fallback_code(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "UNAUTHENTICATED",
        403 => "FORBIDDEN",
        404 => "NOT_FOUND",
        429 => "RATE_LIMITED",
        s if s >= 500 => "INTERNAL",
        _ => "INVALID_REQUEST",
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The rustls client configuration: TLS 1.3 only, the given trust, an optional client identity.
pub fn tls_config(
    trust: &Trust,
    identity: Option<&Identity>,
) -> Result<rustls::ClientConfig, ClientError> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| ClientError::Config(format!("tls versions: {e}")))?;
    let verifier: Arc<dyn ServerCertVerifier> = match trust {
        Trust::CaPem(pem) => {
            let ca = CertificateDer::from_pem_slice(pem.as_bytes())
                .map_err(|e| ClientError::Config(format!("CA certificate: {e}")))?;
            webpki_verifier(ca)?
        }
        Trust::CaFingerprint(fp) => Arc::new(PinnedCaVerifier {
            fingerprint: normalize_fingerprint(fp)?,
        }),
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match identity {
        Some(id) => {
            let certs = CertificateDer::pem_slice_iter(id.cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| ClientError::Config(format!("client certificate: {e}")))?;
            let key = PrivateKeyDer::from_pem_slice(id.key_pem.as_bytes())
                .map_err(|e| ClientError::Config(format!("client key: {e}")))?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| ClientError::Config(format!("client identity: {e}")))?
        }
        None => builder.with_no_client_auth(),
    };
    // An agent (a client identity) speaks HTTP/2: its heartbeats and its long-poll share one
    // connection instead of holding two sockets each in the server (10,000 agents would need
    // 20,000). Admin clients stay on HTTP/1.1, whose pool spreads parallel requests over
    // several connections; over one HTTP/2 connection they would all queue on one server task.
    config.alpn_protocols = match identity {
        Some(_) => vec![b"h2".to_vec(), b"http/1.1".to_vec()],
        None => vec![b"http/1.1".to_vec()],
    };
    Ok(config)
}

fn webpki_verifier(ca: CertificateDer<'static>) -> Result<Arc<WebPkiServerVerifier>, ClientError> {
    let mut roots = RootCertStore::empty();
    roots
        .add(ca)
        .map_err(|e| ClientError::Config(format!("CA certificate: {e}")))?;
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| ClientError::Config(format!("verifier: {e}")))
}

/// `sha256:<64 lowercase hex>`; accepts upper-case hex and colons between bytes.
pub fn normalize_fingerprint(fp: &str) -> Result<String, ClientError> {
    let hex: String = fp
        .strip_prefix("sha256:")
        .ok_or_else(|| ClientError::Config("CA fingerprint must start with sha256:".into()))?
        .chars()
        .filter(|c| *c != ':')
        .collect::<String>()
        .to_ascii_lowercase();
    if hex.len() != 64 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(ClientError::Config(
            "CA fingerprint must be sha256: followed by 64 hex digits".into(),
        ));
    }
    Ok(format!("sha256:{hex}"))
}

/// Verifies the server against a CA found in the presented chain by its pinned fingerprint.
#[derive(Debug)]
struct PinnedCaVerifier {
    fingerprint: String,
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ca = intermediates
            .iter()
            .find(|c| berth_crypto::fingerprint(c) == self.fingerprint)
            .ok_or_else(|| {
                rustls::Error::Other(rustls::OtherError(Arc::new(PinnedCaMissing(
                    self.fingerprint.clone(),
                ))))
            })?;
        let verifier = webpki_verifier(ca.clone().into_owned())
            .map_err(|e| rustls::Error::General(e.to_string()))?;
        verifier.verify_server_cert(end_entity, &[], server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // TLS 1.2 is not offered by this client.
        Err(rustls::Error::PeerIncompatible(
            rustls::PeerIncompatible::Tls12NotOffered,
        ))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &provider().signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure_of(e: &(dyn std::error::Error + 'static)) -> Option<TlsFailure> {
        as_rustls(e).and_then(TlsFailure::of)
    }

    #[test]
    fn certificate_failures_are_read_from_the_typed_rustls_error() {
        let pinned = rustls::Error::Other(rustls::OtherError(Arc::new(PinnedCaMissing(
            "sha256:00".into(),
        ))));
        assert!(pinned.to_string().contains("did not present the pinned CA"));
        // hyper hands rustls errors up inside an io::Error.
        let wrapped = std::io::Error::other(pinned);
        assert_eq!(failure_of(&wrapped), Some(TlsFailure::ServerNotTrusted));
        let invalid = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        assert_eq!(failure_of(&invalid), Some(TlsFailure::ServerNotTrusted));
        for alert in [
            rustls::AlertDescription::BadCertificate,
            rustls::AlertDescription::CertificateExpired,
            rustls::AlertDescription::UnknownCA,
        ] {
            let e = std::io::Error::other(rustls::Error::AlertReceived(alert));
            assert_eq!(failure_of(&e), Some(TlsFailure::ClientCertificateRefused));
        }
        let other = rustls::Error::General("boom".into());
        assert_eq!(failure_of(&other), None);
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert_eq!(failure_of(&reset), None);
    }
}
