//! `ClientError::tls_failure` against a real TLS 1.3 listener: the typed reading the agent picks
//! its exit code from, for each way a handshake about certificates can fail.

mod common;

use std::time::Duration;

use berth_client::{Client, ClientConfig, ClientError, Identity, TlsFailure, Trust};
use berth_crypto::Ca;
use time::OffsetDateTime;

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
    let url = common::server(&ca, common::OK, Default::default()).await;

    // The CA and a valid identity: no failure at all.
    let ok = call(
        &url,
        Trust::CaPem(ca.cert_pem().into()),
        Some(common::agent_identity(&ca)),
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
        Some(common::agent_identity(&ca)),
    )
    .await
    .unwrap_err();
    assert_eq!(e.tls_failure(), Some(TlsFailure::ServerNotTrusted), "{e:?}");

    // A client certificate from another CA: the server refuses it.
    let e = call(
        &url,
        Trust::CaPem(ca.cert_pem().into()),
        Some(common::agent_identity(&other)),
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
