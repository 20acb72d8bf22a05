//! A real TLS 1.3 listener for the client's tests.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use berth_client::Identity;
use berth_crypto::{AgentKey, Ca};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub const OK: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";

/// A listener with a certificate from `ca` (sent with the CA in its chain) that requires a
/// client certificate from `ca` and answers every request with the bytes of `answer`, counting
/// the requests in `hits`.
pub async fn server(ca: &Ca, answer: &'static [u8], hits: Arc<AtomicUsize>) -> String {
    listen(ca, move |mut tls| {
        let hits = hits.clone();
        async move {
            let mut buf = [0u8; 4096];
            let _ = tls.read(&mut buf).await;
            hits.fetch_add(1, Ordering::SeqCst);
            let _ = tls.write_all(answer).await;
            let _ = tls.shutdown().await;
        }
    })
    .await
}

/// A listener like [`server`] that accepts every WebSocket upgrade, counts it in `hits` and
/// sends one text message, `hello`.
#[allow(dead_code)]
pub async fn websocket_server(ca: &Ca, hits: Arc<AtomicUsize>) -> String {
    use futures_util::SinkExt;
    listen(ca, move |tls| {
        let hits = hits.clone();
        async move {
            if let Ok(mut socket) = tokio_tungstenite::accept_async(tls).await {
                hits.fetch_add(1, Ordering::SeqCst);
                let _ = socket
                    .send(tokio_tungstenite::tungstenite::Message::text("hello"))
                    .await;
                let _ = socket.close(None).await;
            }
        }
    })
    .await
}

type Tls = tokio_rustls::server::TlsStream<tokio::net::TcpStream>;

/// Accepts TLS connections (a certificate from `ca`, a client certificate from `ca` required)
/// and hands each to `serve`; returns the listener's URL.
async fn listen<F, Fut>(ca: &Ca, serve: F) -> String
where
    F: Fn(Tls) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let now = OffsetDateTime::now_utc();
    let leaf = ca
        .issue_server_cert(&["127.0.0.1".into()], now, time::Duration::days(1))
        .unwrap();
    let chain = vec![
        CertificateDer::from(leaf.cert_der.clone()),
        CertificateDer::from(ca.cert_der().to_vec()),
    ];
    let key = PrivateKeyDer::from_pem_slice(leaf.key_pem.unwrap().as_bytes()).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(ca.cert_der().to_vec()))
        .unwrap();
    let clients = rustls::server::WebPkiClientVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_client_cert_verifier(clients)
        .with_single_cert(chain, key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serve = Arc::new(serve);
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let acceptor = acceptor.clone();
            let serve = serve.clone();
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(tcp).await {
                    serve(tls).await;
                }
            });
        }
    });
    format!("https://{addr}")
}

pub fn agent_identity(ca: &Ca) -> Identity {
    let key = AgentKey::generate().unwrap();
    let cert = ca
        .sign_agent_csr(
            &key.csr_pem("a").unwrap(),
            uuid::Uuid::new_v4(),
            OffsetDateTime::now_utc(),
            time::Duration::days(1),
        )
        .unwrap();
    Identity {
        cert_pem: cert.cert_pem,
        key_pem: key.to_pem(),
    }
}
