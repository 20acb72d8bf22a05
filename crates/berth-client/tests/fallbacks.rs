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

/// The task stream's WebSocket moves on as a GET does: past a server that cannot be reached
/// and one that answers 5xx, to one that upgrades, where the next stream then starts. Alone,
/// the unreachable server's refusal is the error.
#[tokio::test]
async fn a_websocket_moves_on_past_an_unreachable_server_and_a_5xx() {
    use futures_util::StreamExt;
    let ca = Ca::generate("fallback CA", OffsetDateTime::now_utc()).unwrap();
    let (failing, upgraded) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    // A port nothing listens on any more.
    let unreachable = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("https://{}", listener.local_addr().unwrap())
    };
    let unavailable = common::server(&ca, UNAVAILABLE, failing.clone()).await;
    let healthy = common::websocket_server(&ca, upgraded.clone()).await;
    let client = |server: &str| {
        Client::new(ClientConfig {
            server: server.to_string(),
            trust: Trust::CaPem(ca.cert_pem().into()),
            identity: Some(common::agent_identity(&ca)),
            bearer: None,
            timeout: Duration::from_secs(10),
        })
        .unwrap()
    };
    let hits = || {
        (
            failing.load(Ordering::SeqCst),
            upgraded.load(Ordering::SeqCst),
        )
    };
    let path = "/api/v1/agents/a/tasks/stream";
    let headers = [("X-Berth-Generation", "1")];

    let spread = client(&unreachable).with_fallbacks([unavailable.clone(), healthy.clone()]);
    let mut socket = spread.websocket(path, &headers).await.unwrap();
    let hello = socket.next().await.unwrap().unwrap();
    assert_eq!(hello.to_text().unwrap(), "hello");
    assert_eq!(hits(), (1, 1));
    spread.websocket(path, &headers).await.unwrap();
    assert_eq!(
        hits(),
        (1, 2),
        "the next stream starts where the last one opened"
    );

    match client(&unreachable).websocket(path, &headers).await {
        Err(ClientError::Connect { server, .. }) => assert_eq!(server, unreachable),
        Err(other) => panic!("the refused connection: {other:?}"),
        Ok(_) => panic!("nothing listens there"),
    }
    match client(&unavailable).websocket(path, &headers).await {
        Err(ClientError::Api { status, .. }) => assert_eq!(status, 503),
        Err(other) => panic!("the 503 itself: {other:?}"),
        Ok(_) => panic!("that server upgrades nothing"),
    }
}
