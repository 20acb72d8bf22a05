//! A client with fallback servers (`berth --server A,B`): which requests a 5xx sends on to the
//! next server. A 5xx may come after the first server acted (it committed, then failed to
//! answer), so only a request that is safe to repeat goes on: a GET, or one with an
//! `Idempotency-Key`. Real TLS listeners count what reached each server.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use berth_client::{Client, ClientConfig, ClientError, Trust};
use berth_crypto::Ca;
use berth_proto::headers::IDEMPOTENCY_KEY_HEADER;
use berth_proto::{Method, Request};
use time::OffsetDateTime;

const UNAVAILABLE: &[u8] =
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
content-length: 52\r\n\r\n{\"code\":\"STORE_UNAVAILABLE\",\"detail\":\"the database\"}";

#[derive(serde::Serialize)]
struct Create;

impl Request for Create {
    type Response = serde_json::Value;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/things".into()
    }
}

#[tokio::test]
async fn a_5xx_moves_on_only_what_is_safe_to_repeat() {
    let ca = Ca::generate("fallback CA", OffsetDateTime::now_utc()).unwrap();
    let (failing, healthy) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let first = common::server(&ca, UNAVAILABLE, failing.clone()).await;
    let second = common::server(&ca, common::OK, healthy.clone()).await;
    let client = || {
        Client::new(ClientConfig {
            server: first.clone(),
            trust: Trust::CaPem(ca.cert_pem().into()),
            identity: Some(common::agent_identity(&ca)),
            bearer: None,
            timeout: Duration::from_secs(10),
        })
        .unwrap()
        .with_fallbacks([second.clone()])
    };
    let hits = || {
        (
            failing.load(Ordering::SeqCst),
            healthy.load(Ordering::SeqCst),
        )
    };

    // A POST without a key: the first server's 5xx is the answer; the second never sees it.
    let refused = client().send_with(&Create, &[], None).await.unwrap_err();
    match &refused {
        ClientError::Api { status, body, .. } => {
            assert_eq!((*status, body.code.as_str()), (503, "STORE_UNAVAILABLE"))
        }
        other => panic!("the 503 itself: {other:?}"),
    }
    assert_eq!(hits(), (1, 0));

    // The same POST with a key goes on to the second server.
    let answered = client()
        .send_with(&Create, &[(IDEMPOTENCY_KEY_HEADER, "create-1")], None)
        .await
        .unwrap();
    assert_eq!(answered, serde_json::json!({}));
    assert_eq!(hits(), (2, 1));

    // A GET goes on too.
    assert_eq!(client().get_text("/api/v1/things").await.unwrap(), "{}");
    assert_eq!(hits(), (3, 2));
}
