//! The one listener: TLS 1.3 only, client certificates requested but optional, and each
//! connection's verified client certificate attached to every request it carries.
//!
//! Chain verification happens here (rustls/webpki against the berth CA); whether a certificate
//! is still *bound* to an agent is the route's business, checked against the store per request.

use berth_proto::error::ErrorChain;
use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::infra::error::{Context, ServerError};
use axum::Router;
use berth_crypto::hpke::RecipientPublicKey;
use berth_crypto::ResultVerifier;
use futures_util::future::Either;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;
use tracing::Instrument;

use crate::infra::bootstrap::Material;
use crate::infra::metrics::Metrics;
use crate::ServerConfig;

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an idle connection being closed gets for the last of an answer and, on HTTP/2, the
/// GOAWAY exchange; a client that does not take part is then cut off.
const IDLE_CLOSE_GRACE: Duration = Duration::from_secs(2);
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
    /// `der`'s key as a sealing recipient, parsed on the first assignment; like `verifier`.
    recipient: Arc<OnceLock<RecipientPublicKey>>,
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
            recipient: Arc::new(OnceLock::new()),
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

    /// This certificate's key as the recipient of sealed assignments, built on first use and
    /// cached for the connection like [`PeerCertificate::result_verifier`]. A key that cannot
    /// receive (RSA, another curve) is `UnsupportedKey`, again on every call.
    pub fn sealing_recipient(&self) -> berth_crypto::Result<&RecipientPublicKey> {
        if let Some(recipient) = self.recipient.get() {
            return Ok(recipient);
        }
        let built = RecipientPublicKey::from_cert(&self.der)?;
        Ok(self.recipient.get_or_init(|| built))
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
///
/// Slow and greedy clients are bounded here: at most `max_connections` at once (within the
/// open-files budget, see [`connection_budget`]) and `max_connections_per_source` from one
/// address; a connection with no request in flight for `header_read_timeout` is closed (for
/// longer once it has made a request, see [`closing`]), and a request body must arrive within
/// `body_read_timeout` of its first read.
pub(crate) async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
    config: &ServerConfig,
    metrics: Metrics,
) -> Result<(), ServerError> {
    let slots = Arc::new(Semaphore::new(config.max_connections));
    let sources = Arc::new(Sources {
        cap: config.max_connections_per_source,
        open: Mutex::new(HashMap::new()),
    });
    let (stop, stopping) = watch::channel(false);
    let connections = Connections {
        acceptor: tokio_rustls::TlsAcceptor::from(tls),
        app,
        stopping,
        metrics: metrics.clone(),
        header_timeout: config.header_read_timeout,
        body_timeout: config.body_read_timeout,
        // An agent with no request for three heartbeat intervals is offline: nothing to keep
        // for it.
        keep_alive: config
            .header_read_timeout
            .max(config.heartbeat_interval * 3),
    };
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
        let Some(source) = sources.admit(remote.ip()) else {
            tracing::debug!(%remote, "connection refused: its source holds the most allowed");
            metrics.connection_closed("source_cap");
            continue;
        };
        let _ = tcp.set_nodelay(true);
        // Held by the connection, and by an upgraded WebSocket that outlives it.
        let hold = ConnectionHold(Arc::new((permit, source)));
        tokio::spawn(connections.clone().serve(tcp, remote, hold));
    }
    drop(listener);
    let _ = stop.send(true);
    // Every connection holds a slot until it ends: all slots back means all drained.
    let all = u32::try_from(config.max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(DRAIN_TIMEOUT, slots.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!("connections still open after drain timeout");
    }
    Ok(())
}

/// What every connection of one listener shares.
#[derive(Clone)]
struct Connections {
    acceptor: tokio_rustls::TlsAcceptor,
    app: Router,
    stopping: watch::Receiver<bool>,
    metrics: Metrics,
    header_timeout: Duration,
    body_timeout: Duration,
    keep_alive: Duration,
}

impl Connections {
    /// One connection: the TLS handshake, then HTTP/1.1 or HTTP/2 until the client leaves, the
    /// connection idles out, or the server stops.
    async fn serve(
        self,
        tcp: tokio::net::TcpStream,
        remote: std::net::SocketAddr,
        slots: ConnectionHold,
    ) {
        let Connections {
            acceptor,
            app,
            stopping,
            metrics,
            header_timeout,
            body_timeout,
            keep_alive,
        } = self;
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
        let (in_flight, watch_in_flight) = watch::channel(0usize);
        let service = request_service(app, peer, slots, body_timeout, Arc::new(in_flight));
        let builder = http_builder(header_timeout);
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
        tokio::pin!(conn);
        let ended = tokio::select! {
            ended = conn.as_mut() => ended,
            reason = closing(watch_in_flight, header_timeout, keep_alive, stopping) => {
                let grace = match reason {
                    Close::Idle => {
                        tracing::debug!(%remote, "closing a connection with no request in flight");
                        metrics.connection_closed("idle");
                        IDLE_CLOSE_GRACE
                    }
                    Close::Shutdown => DRAIN_TIMEOUT,
                };
                // HTTP/2: GOAWAY, so a client's request in transit is retried elsewhere.
                conn.as_mut().graceful_shutdown();
                tokio::time::timeout(grace, conn.as_mut())
                    .await
                    .unwrap_or(Ok(()))
            }
        };
        if let Err(e) = ended {
            tracing::debug!(%remote, error = %ErrorChain(&*e), "connection ended with an error");
        }
    }
}

/// The per-request service of one connection: the header budget, the request's span, and the
/// peer's certificate and connection hold for the handlers.
fn request_service(
    app: Router,
    peer: Peer,
    slots: ConnectionHold,
    body_timeout: Duration,
    in_flight: Arc<watch::Sender<usize>>,
) -> impl hyper::service::Service<
    hyper::Request<hyper::body::Incoming>,
    Response = axum::response::Response,
    Error = std::convert::Infallible,
    Future = impl Future<Output = Result<axum::response::Response, std::convert::Infallible>>
                 + Send
                 + 'static,
> + Clone {
    hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(peer.clone());
        req.extensions_mut().insert(slots.clone());
        // A body must arrive in time, and one the handler leaves unread (a 413, a
        // refusal before the body) is read to its end after the answer; see
        // `RequestBody`.
        let req = req.map(|body| RequestBody::wrap(body, body_timeout));
        // Every request: the header limit, then its span around the whole answer.
        // Here rather than as router middleware, which cost a boxed future and a
        // service clone per request.
        match crate::http::trace::headers_too_large(req.headers()) {
            Some(refusal) => Either::Left(std::future::ready(Ok(strict_transport(refusal)))),
            None => {
                let busy = InFlight::start(&in_flight);
                let span = crate::http::trace::request_span(&req);
                let answer = app.clone().oneshot(req).instrument(span);
                Either::Right(async move {
                    answer
                        .await
                        .map(|response| busy_while_streaming(strict_transport(response), busy))
                })
            }
        }
    })
}

/// hyper's settings for both protocols.
fn http_builder(header_timeout: Duration) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    // hyper's own header limits answer a bare 431 with no body and no hook to give it
    // one; set them well above `routes::MAX_HEADER_BYTES`, which answers with
    // `{code, detail}`, so only requests past these reach hyper's bare answer.
    builder
        .http1()
        .max_buf_size(HYPER_HEADER_BYTES)
        .max_headers(HYPER_MAX_HEADERS)
        // Exact for a slow HTTP/1.1 head, and hyper's bound on an idle HTTP/1.1
        // keep-alive; `closing` below covers HTTP/2 and a client silent before its
        // first bytes tell hyper the protocol.
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    builder
        .http2()
        .max_header_list_size(HYPER_HEADER_BYTES as u32);
    builder
}

/// A connection's slots in the connection budget and its source's count. An upgraded
/// connection (the task stream's WebSocket) leaves hyper's connection task when the upgrade
/// completes; its handler keeps a clone so the socket still counts until it closes.
#[derive(Clone)]
pub(crate) struct ConnectionHold(
    #[allow(dead_code)] Arc<(tokio::sync::OwnedSemaphorePermit, SourceSlot)>,
);

/// Descriptors kept out of the connection budget: the store's files and sockets, the listener,
/// the runtime's own, logs, and a margin.
const FD_RESERVE: usize = 128;

/// Raises the open-files soft limit to the hard limit and returns how many of `wanted`
/// connections fit in it with [`FD_RESERVE`] to spare, so a flood of connections waits in the
/// listen backlog instead of leaving the store, or `accept`, without a file descriptor.
pub(crate) fn connection_budget(wanted: usize) -> usize {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "reading the open files limit");
        return wanted;
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            ..limit
        };
        // SAFETY: as above.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit = raised;
        } else {
            tracing::warn!(error = %std::io::Error::last_os_error(), "raising the open files limit");
        }
    }
    let files = if limit.rlim_cur == libc::RLIM_INFINITY {
        usize::MAX
    } else {
        usize::try_from(limit.rlim_cur).unwrap_or(usize::MAX)
    };
    let budget = wanted.min(files.saturating_sub(FD_RESERVE)).max(1);
    tracing::info!("open files limit {files}: serving at most {budget} connections at once");
    budget
}

/// Open connections per source address, for the per-source cap.
struct Sources {
    /// `0`: no cap.
    cap: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

impl Sources {
    /// A slot for one more connection from `ip`, or `None` when its source is at the cap.
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Option<SourceSlot> {
        if self.cap == 0 {
            return Some(SourceSlot(None));
        }
        // An IPv6 host can pick any address of its /64: count the prefix, not the address.
        let key = match ip.to_canonical() {
            IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & (!0u128 << 64))),
            v4 => v4,
        };
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let count = open.entry(key).or_insert(0);
        if *count >= self.cap {
            return None;
        }
        *count += 1;
        Some(SourceSlot(Some((self.clone(), key))))
    }
}

/// One connection counted against its source; uncounted when the connection ends.
struct SourceSlot(Option<(Arc<Sources>, IpAddr)>);

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let Some((sources, key)) = self.0.take() else {
            return;
        };
        let mut open = sources.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = open.get_mut(&key) {
            *count -= 1;
            if *count == 0 {
                open.remove(&key);
            }
        }
    }
}

/// One request of a connection being answered (until its response head is ready).
struct InFlight(Arc<watch::Sender<usize>>);

impl InFlight {
    fn start(count: &Arc<watch::Sender<usize>>) -> InFlight {
        count.send_modify(|n| *n += 1);
        InFlight(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

/// `Strict-Transport-Security` on every answer: this listener speaks only HTTPS, so a browser
/// that once reached it must never try plain HTTP for it again (two years).
const HSTS: axum::http::HeaderValue =
    axum::http::HeaderValue::from_static("max-age=63072000; includeSubDomains");

fn strict_transport(mut response: axum::response::Response) -> axum::response::Response {
    response
        .headers_mut()
        .insert(axum::http::header::STRICT_TRANSPORT_SECURITY, HSTS);
    response
}

/// A request is in flight until its answer is sent, which for a stream (Server-Sent Events,
/// `GET /api/v1/events`) is when its body ends, not when its head is ready: the idle close must
/// not cut a quiet stream. Other answers are whole once their head is, so only streams pay for
/// the wrapped body.
fn busy_while_streaming(
    response: axum::response::Response,
    busy: InFlight,
) -> axum::response::Response {
    let streaming = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !streaming {
        return response;
    }
    response.map(|body| {
        axum::body::Body::from_stream(futures_util::StreamExt::map(
            body.into_data_stream(),
            move |chunk| {
                let _busy = &busy;
                chunk
            },
        ))
    })
}

enum Close {
    Idle,
    Shutdown,
}

/// Resolves when the connection should close: the server is stopping, or the connection has
/// had no request in flight for `first` (before its first request) or `later` (after it).
///
/// `first` bounds every way a client can hold a connection without asking anything: silent
/// after the handshake, a request head (HTTP/1.1 or HTTP/2) that never completes. `later` is
/// longer so an agent between heartbeats (HTTP/2, one connection for its polls and heartbeats)
/// is not cut off just as its next heartbeat is due; it still bounds a connection that asked
/// once and then went quiet.
async fn closing(
    mut in_flight: watch::Receiver<usize>,
    first: Duration,
    later: Duration,
    mut stopping: watch::Receiver<bool>,
) -> Close {
    let idle = async {
        let mut limit = first;
        loop {
            if *in_flight.borrow_and_update() > 0 {
                limit = later;
                if in_flight.wait_for(|n| *n == 0).await.is_err() {
                    return std::future::pending().await;
                }
            }
            match tokio::time::timeout(limit, in_flight.changed()).await {
                Err(_) => return,
                Ok(Ok(())) => limit = later,
                Ok(Err(_)) => return std::future::pending().await,
            }
        }
    };
    tokio::select! {
        () = idle => Close::Idle,
        _ = stopping.wait_for(|stop| *stop) => Close::Shutdown,
    }
}

/// At most this much of a request body a handler refused is read and thrown away, and for at
/// most [`DRAIN_BODY_TIMEOUT`]; past either, the stream is reset (the HTTP/1.1 connection closed).
const DRAIN_BODY_BYTES: usize = 64 * 1024 * 1024;
const DRAIN_BODY_TIMEOUT: Duration = Duration::from_secs(10);

/// A request body with a read deadline, read to its end in the background when dropped unread.
///
/// The deadline starts at the handler's first read: a client that stalls partway through its
/// body gets an error (the handler's `400`, and on HTTP/1.1 the connection closed) instead of
/// holding the request, and its connection, for as long as it likes.
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
struct RequestBody {
    body: Option<hyper::body::Incoming>,
    timeout: Duration,
    deadline: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl RequestBody {
    fn wrap(body: hyper::body::Incoming, timeout: Duration) -> axum::body::Body {
        if hyper::body::Body::is_end_stream(&body) {
            return axum::body::Body::new(body);
        }
        axum::body::Body::new(RequestBody {
            body: Some(body),
            timeout,
            deadline: None,
        })
    }
}

impl hyper::body::Body for RequestBody {
    type Data = hyper::body::Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let Some(body) = this.body.as_mut() else {
            return std::task::Poll::Ready(None);
        };
        let timeout = this.timeout;
        let deadline = this
            .deadline
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        if let std::task::Poll::Ready(frame) = std::pin::Pin::new(body).poll_frame(cx) {
            return std::task::Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        std::task::ready!(deadline.as_mut().poll(cx));
        // The client stopped sending: nothing to drain.
        this.body = None;
        std::task::Poll::Ready(Some(Err(format!(
            "the request body did not arrive within {} s",
            timeout.as_secs()
        )
        .into())))
    }

    fn is_end_stream(&self) -> bool {
        self.body
            .as_ref()
            .is_none_or(hyper::body::Body::is_end_stream)
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body
            .as_ref()
            .map(hyper::body::Body::size_hint)
            .unwrap_or_default()
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        let Some(mut body) = self.body.take() else {
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
