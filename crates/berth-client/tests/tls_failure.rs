//! `ClientError::tls_failure` against a real TLS 1.3 listener: the typed reading the agent picks
//! its exit code from, for each way a handshake about certificates can fail.

use std::sync::Arc;
use std::time::Duration;

use berth_client::{Client, ClientConfig, ClientError, Identity, TlsFailure, Trust};
use berth_crypto::{AgentKey, Ca};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use time::OffsetDateTime;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A listener with a certificate from `ca` (sent with the CA in its chain) that requires a
/// client certificate from `ca` and answers every request `200 {}`.
async fn server(ca: &Ca) -> String {
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
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(mut tls) = acceptor.accept(tcp).await {
                    let mut buf = [0u8; 4096];
                    let _ = tls.read(&mut buf).await;
                    let _ = tls
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                        .await;
                    let _ = tls.shutdown().await;
                }
            });
        }
    });
    format!("https://{addr}")
}

fn agent_identity(ca: &Ca) -> Identity {
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

async fn call(
    server: &str,
    trust: Trust,
    identity: Option<Identity>,
) -> Result<String, ClientError> {
    let client = Client::new(ClientConfig {
        server: server.into(),
        trust,
        identity,
        bearer: None,
        timeout: Duration::from_secs(10),
    })
    .unwrap();
    client.get_text("/").await
}

#[tokio::test]
async fn certificate_failures_are_typed() {
    let now = OffsetDateTime::now_utc();
    let ca = Ca::generate("right CA", now).unwrap();
    let other = Ca::generate("other CA", now).unwrap();
    let url = server(&ca).await;

    // The CA and a valid identity: no failure at all.
    let ok = call(
        &url,
        Trust::CaPem(ca.cert_pem().into()),
        Some(agent_identity(&ca)),
    )
    .await;
    assert_eq!(ok.unwrap(), "{}");

    // Pinned by the fingerprint of a CA the server does not present.
    let e = call(&url, Trust::CaFingerprint(other.fingerprint()), None)
        .await
        .unwrap_err();
    assert_eq!(e.tls_failure(), Some(TlsFailure::ServerNotTrusted), "{e:?}");

    // Trusting another CA: the server's certificate does not verify.
    let e = call(
        &url,
        Trust::CaPem(other.cert_pem().into()),
        Some(agent_identity(&ca)),
    )
    .await
    .unwrap_err();
    assert_eq!(e.tls_failure(), Some(TlsFailure::ServerNotTrusted), "{e:?}");

    // A client certificate from another CA: the server refuses it.
    let e = call(
        &url,
        Trust::CaPem(ca.cert_pem().into()),
        Some(agent_identity(&other)),
    )
    .await
    .unwrap_err();
    assert_eq!(
        e.tls_failure(),
        Some(TlsFailure::ClientCertificateRefused),
        "{e:?}"
    );

    // Nobody listening: a transport error that is not about certificates.
    let e = call(
        "https://127.0.0.1:9",
        Trust::CaPem(ca.cert_pem().into()),
        None,
    )
    .await
    .unwrap_err();
    assert!(matches!(e, ClientError::Transport { .. }));
    assert_eq!(e.tls_failure(), None);
}
