//! The `health-check` executor against real listeners on loopback: an HTTP server that answers
//! 200 on `/ok` and 500 on `/fail`, a TCP listener, a listener that never answers, and a port
//! nobody listens on. The listeners live in this test's runtime and go with it.

use std::time::{Duration, Instant};

use berth_exec::builtin::HealthCheck;
use berth_exec::Executor;
use berth_test_utils::docker::{assert_failed, assert_success, task};
use berth_test_utils::free_port;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// An HTTP/1.1 server on 127.0.0.1: `GET /ok` → 200, anything else → 500. Sends each request
/// head it reads to the returned channel.
async fn http_server() -> (u16, mpsc::UnboundedReceiver<String>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (seen, requests) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let Ok((mut stream, _)) = listener.accept().await else {
                return;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let status = if head.starts_with("GET /ok ") {
                    "200 OK"
                } else {
                    "500 Internal Server Error"
                };
                let _ = seen.send(head);
                let answer = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi"
                );
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    (port, requests)
}

/// A TCP listener that accepts and holds connections without a word; counts the accepts.
async fn silent_listener() -> (u16, mpsc::UnboundedReceiver<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (accepted, accepts) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = listener.accept().await {
            held.push(stream);
            let _ = accepted.send(());
        }
    });
    (port, accepts)
}

async fn check(payload: serde_json::Value) -> berth_exec::Outcome {
    HealthCheck.execute(&task("health-check", payload)).await
}

#[tokio::test]
async fn http_200_is_healthy_and_500_is_a_retriable_failure() {
    let (port, mut requests) = http_server().await;

    let outcome =
        check(json!({"type": "http", "url": format!("http://127.0.0.1:{port}/ok")})).await;
    assert_success(&outcome);
    assert_eq!(
        outcome.outputs["probe"],
        json!({"status": 200}),
        "{outcome:?}"
    );
    assert!(outcome.metrics.health_check_duration_ms.is_some());
    let head = requests.recv().await.expect("the server saw the probe");
    assert!(head.starts_with("GET /ok HTTP/1.1\r\n"), "{head:?}");
    assert!(
        head.contains(&format!("Host: 127.0.0.1:{port}\r\n")),
        "{head:?}"
    );

    let outcome =
        check(json!({"type": "http", "url": format!("http://127.0.0.1:{port}/fail")})).await;
    assert_failed(&outcome, "HEALTH_CHECK_FAILED");
    assert!(outcome.retriable, "{outcome:?}");
    assert!(outcome.message.contains("HTTP 500"), "{outcome:?}");
    let head = requests.recv().await.expect("the server saw the probe");
    assert!(head.starts_with("GET /fail HTTP/1.1\r\n"), "{head:?}");
}

#[tokio::test]
async fn tcp_succeeds_on_a_listener_and_fails_on_a_closed_port() {
    let (port, mut accepts) = silent_listener().await;
    let outcome = check(json!({"type": "tcp", "host": "127.0.0.1", "port": port})).await;
    assert_success(&outcome);
    tokio::time::timeout(Duration::from_secs(10), accepts.recv())
        .await
        .expect("the listener accepted the probe")
        .expect("the listener is running");

    let closed = free_port();
    let outcome = check(json!({"type": "tcp", "host": "127.0.0.1", "port": closed})).await;
    assert_failed(&outcome, "HEALTH_CHECK_FAILED");
    assert!(outcome.retriable, "{outcome:?}");
    assert!(
        outcome.message.contains(&format!("127.0.0.1:{closed}")),
        "{outcome:?}"
    );

    let outcome =
        check(json!({"type": "http", "url": format!("http://127.0.0.1:{closed}/")})).await;
    assert_failed(&outcome, "HEALTH_CHECK_FAILED");
    assert!(outcome.message.contains("connect"), "{outcome:?}");
}

#[tokio::test]
async fn an_http_server_that_never_answers_fails_at_the_probe_timeout() {
    let (port, _accepts) = silent_listener().await;
    let started = Instant::now();
    let outcome = check(json!({
        "type": "http",
        "url": format!("http://127.0.0.1:{port}/ok"),
        "timeout": 1,
    }))
    .await;
    let took = started.elapsed();
    assert_failed(&outcome, "HEALTH_CHECK_FAILED");
    assert!(outcome.message.contains("no answer within"), "{outcome:?}");
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(10),
        "took {took:?}"
    );
}

#[tokio::test]
async fn a_payload_without_its_target_is_invalid_and_not_retried() {
    for payload in [
        json!({"type": "http"}),
        json!({"type": "tcp", "host": "127.0.0.1"}),
        json!({"type": "udp", "host": "127.0.0.1", "port": 1}),
        json!({"type": "http", "url": "https://127.0.0.1/"}),
    ] {
        let outcome = check(payload.clone()).await;
        assert_failed(&outcome, "INVALID_PAYLOAD");
        assert!(!outcome.retriable, "{payload}: {outcome:?}");
    }
}
