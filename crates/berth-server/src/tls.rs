//! The one listener: TLS 1.3 only, client certificates requested but optional, and each
//! connection's verified client certificate attached to every request it carries.
//!
//! Chain verification happens here (rustls/webpki against the berth CA); whether a certificate
//! is still *bound* to an agent is the route's business, checked against the store per request.

use berth_proto::error::ErrorChain;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::error::{Context, ServerError};
use axum::Router;
use berth_crypto::ResultVerifier;
use futures_util::future::Either;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tracing::Instrument;

use crate::bootstrap::Material;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// Past this many bytes of request head (HTTP/1.1: the read buffer, hyper's default; HTTP/2:
/// the header list, raised from hyper's 16 KiB) hyper itself answers a bare `431`.
const HYPER_HEADER_BYTES: usize = 8192 + 4096 * 100;
/// Past this many HTTP/1.1 header fields hyper itself answers a bare `431` (its default: 100).
const HYPER_MAX_HEADERS: usize = 1000;

/// The verified client certificate of a connection, as seen by handlers.
#[derive(Debug, Clone)]
pub struct PeerCertificate {
    /// The certificate itself: result signatures are verified with its public key.
    pub der: Arc<Vec<u8>>,
    /// `sha256:<hex>` of the DER: what agent bindings store.
    pub fingerprint: Arc<str>,
    /// The agent id from the `urn:berth:agent:<id>` SAN, when the certificate carries one.
    pub agent_id: Option<berth_proto::AgentId>,
    /// The certificate's notAfter. The handshake checked it once; a connection outlives it, so
    /// every agent request checks it again (`AgentCaller`). One that does not parse counts as
    /// long expired.
    pub not_after: time::OffsetDateTime,
    /// `der`'s public key, parsed on the first signed result and kept for the connection's
    /// life; shared by every request of the connection (see [`PeerCertificate::result_verifier`]).
    verifier: Arc<OnceLock<ResultVerifier>>,
}

impl PeerCertificate {
    fn new(der: &[u8]) -> Self {
        PeerCertificate {
            der: Arc::new(der.to_vec()),
            fingerprint: berth_crypto::fingerprint(der).into(),
            agent_id: berth_crypto::agent_id_from_cert(der)
                .ok()
                .map(berth_proto::AgentId),
            not_after: berth_crypto::cert_not_after(der)
                .unwrap_or(time::OffsetDateTime::UNIX_EPOCH),
            verifier: Arc::new(OnceLock::new()),
        }
    }

    /// The signature verifier for this certificate's key, built on first use.
    ///
    /// Cached per connection rather than in a server-wide map keyed by fingerprint: this struct
    /// is built once per TLS connection and cloned into each of its requests, and a connection's
    /// client certificate cannot change (TLS 1.3, no post-handshake authentication), so the
    /// verifier is derived from exactly `der`: nothing to key, evict or bound (it is freed with
    /// the connection, so at most one per open connection), and nothing shared between
    /// connections. Agents keep their connections (pooled client, long polls), so results almost
    /// never pay for the parse; a global map could only save one parse per new connection, which
    /// already parses the certificate above for `agent_id`.
    ///
    /// The verifier decides only whether a signature verifies with this key. It never decides
    /// trust: whether the certificate names the agent and is its current binding is checked by
    /// the route and the store exactly as before. A certificate that does not parse is not
    /// cached; it fails again on every call, as it did before the cache.
    pub fn result_verifier(&self) -> berth_crypto::Result<&ResultVerifier> {
        if let Some(verifier) = self.verifier.get() {
            return Ok(verifier);
        }
        let built = ResultVerifier::from_cert(&self.der)?;
        // Two results racing on one HTTP/2 connection may both build one; the first is kept.
        Ok(self.verifier.get_or_init(|| built))
    }
}

/// What a request knows about its connection's client certificate.
#[derive(Debug, Clone)]
pub struct Peer(pub Option<PeerCertificate>);

pub(crate) fn server_config(material: &Material) -> Result<Arc<rustls::ServerConfig>, ServerError> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from(material.ca.cert_der().to_vec()))
        .context("adding the CA to the client verifier")?;
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .allow_unauthenticated()
            .build()
            .context("building the client certificate verifier")?;
    let chain = CertificateDer::pem_slice_iter(material.server_cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .context("parsing the server certificate chain")?;
    let key = PrivateKeyDer::from_pem_slice(material.server_key_pem.as_bytes())
        .context("parsing the server key")?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .context("selecting TLS 1.3")?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(chain, key)
        .context("loading the server certificate")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Accepts connections until `shutdown` resolves, then lets open connections finish their
/// requests for a while before returning.
pub(crate) async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    max_connections: usize,
) -> Result<(), ServerError> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let slots = Arc::new(Semaphore::new(max_connections));
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            _ = &mut shutdown => break,
            permit = slots.clone().acquire_owned() => permit.context("connection slots closed")?,
        };
        let (tcp, remote) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %ErrorChain(&e), "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    tracing::debug!(%remote, error = %ErrorChain(&e), "TLS handshake refused");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%remote, "TLS handshake timed out");
                    return;
                }
            };
            let peer = Peer(
                stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .and_then(|chain| chain.first())
                    .map(|der| PeerCertificate::new(der)),
            );
            let service = hyper::service::service_fn(
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    req.extensions_mut().insert(peer.clone());
                    // A body the handler leaves unread (a 413, a refusal before the body) is
                    // read to its end after the answer; see `RequestBody`.
                    let req = req.map(|body| axum::body::Body::new(RequestBody(Some(body))));
                    // Every request: the header limit, then its span around the whole answer.
                    // Here rather than as router middleware, which cost a boxed future and a
                    // service clone per request.
                    match crate::routes::headers_too_large(req.headers()) {
                        Some(refusal) => Either::Left(std::future::ready(Ok(refusal))),
                        None => {
                            let span = crate::routes::request_span(&req);
                            Either::Right(app.clone().oneshot(req).instrument(span))
                        }
                    }
                },
            );
            let mut builder = auto::Builder::new(TokioExecutor::new());
            // hyper's own header limits answer a bare 431 with no body and no hook to give it
            // one; set them well above `routes::MAX_HEADER_BYTES`, which answers with
            // `{code, detail}`, so only requests past these reach hyper's bare answer.
            builder
                .http1()
                .max_buf_size(HYPER_HEADER_BYTES)
                .max_headers(HYPER_MAX_HEADERS);
            builder
                .http2()
                .max_header_list_size(HYPER_HEADER_BYTES as u32);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            if let Err(e) = watcher.watch(conn.into_owned()).await {
                tracing::debug!(%remote, error = %ErrorChain(&*e), "connection ended with an error");
            }
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(DRAIN_TIMEOUT) => tracing::warn!("connections still open after drain timeout"),
    }
    Ok(())
}

/// At most this much of a request body a handler refused is read and thrown away, and for at
/// most [`DRAIN_BODY_TIMEOUT`]; past either, the stream is reset (the HTTP/1.1 connection closed).
const DRAIN_BODY_BYTES: usize = 64 * 1024 * 1024;
const DRAIN_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// A request body that, dropped unread, is read to its end in the background.
///
/// Dropping an h2 request body makes the `h2` crate reset the stream: `CANCEL` before the
/// response is sent, `NO_ERROR` after. A handler that refuses a body (the 413 of
/// `DefaultBodyLimit`) drops it before hyper sends the refusal, and clients still uploading
/// (curl 7.88 with nghttp2: "Stream error in the HTTP/2 framing layer") reported the reset and
/// never the `413 PAYLOAD_TOO_LARGE` answer. Read to its end instead, the client finishes its
/// upload and reads the answer; the bytes are counted and discarded, never buffered.
///
/// HTTP/1.1 the same: hyper answers such a request as kept alive, then closes the connection
/// unless the rest of the body had already arrived, so a client sending its next request on it
/// (schemathesis did, after 405s and 415s) saw the connection drop. Read to its end, the
/// connection serves the next request.
struct RequestBody(Option<hyper::body::Incoming>);

impl hyper::body::Body for RequestBody {
    type Data = hyper::body::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        match self.0.as_mut() {
            Some(body) => std::pin::Pin::new(body).poll_frame(cx),
            None => std::task::Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.0.as_ref().is_none_or(hyper::body::Body::is_end_stream)
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.0
            .as_ref()
            .map(hyper::body::Body::size_hint)
            .unwrap_or_default()
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        let Some(mut body) = self.0.take() else {
            return;
        };
        if hyper::body::Body::is_end_stream(&body) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move {
            let drain = async {
                let mut read = 0usize;
                while let Some(Ok(frame)) = std::future::poll_fn(|cx| {
                    hyper::body::Body::poll_frame(std::pin::Pin::new(&mut body), cx)
                })
                .await
                {
                    read += frame.data_ref().map_or(0, |d| d.len());
                    if read > DRAIN_BODY_BYTES {
                        break;
                    }
                }
            };
            let _ = tokio::time::timeout(DRAIN_BODY_TIMEOUT, drain).await;
        });
    }
}
