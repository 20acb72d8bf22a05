//! The notification sender (issue 14 item 3): a reconciler over the outbox, every
//! `sweep_interval` (1 s; not on every event commit: a pass costs two writes, and most events
//! match no webhook) or when a resend wakes it. Each pass first
//! turns rows left `sending` past their lease (the server stopped mid-send) into `unknown`, then
//! claims due `pending` rows — `sending`, committed, before any request leaves — and sends each
//! once, signed, with a timeout:
//!
//! - 2xx: `succeeded`; any other non-5xx answer (4xx; redirects are not followed): `failed`;
//! - refused (no connection was made) or 5xx: `pending` after the schedule's next delay, `dead`
//!   once the schedule is used up;
//! - no answer after the request left (timeout, reset): `unknown`, never sent again by itself.
//!
//! Every send of a notification carries its `Idempotency-Key`, so a receiver can drop a repeat
//! the operator chose (`berth notify resend`). The secret is opened only to sign, and neither it
//! nor the URL (a Slack URL is itself a credential) is ever written to a row or a log.

use std::time::Duration;

use berth_proto::error::ErrorChain;
use berth_proto::notify::{
    slack_text, GenericBody, SlackBody, WebhookFormat, IDEMPOTENCY_KEY_HEADER, SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
};
use berth_store::{Delivery, SendOutcome};
use time::OffsetDateTime;

use crate::infra::envelope::{self as envelope, Envelope};
use crate::SharedState;

/// How a send ended, before the schedule decides what a retryable one becomes.
#[derive(Debug, PartialEq, Eq)]
enum Sent {
    Succeeded,
    Permanent(String, String),
    Retryable(String, String),
    Unknown(String, String),
}

fn classify(result: Result<reqwest::StatusCode, reqwest::Error>) -> Sent {
    match result {
        Ok(status) if status.is_success() => Sent::Succeeded,
        Ok(status) => {
            let code = format!("HTTP_{}", status.as_u16());
            let message = format!("the receiver answered {status}");
            if status.is_server_error() {
                Sent::Retryable(code, message)
            } else {
                Sent::Permanent(code, message)
            }
        }
        // No connection was made, so nothing was sent: safe to send again. (Checked first: a
        // connect timeout is both.)
        Err(e) if e.is_connect() => Sent::Retryable(
            "CONNECT_FAILED".into(),
            "no connection to the receiver".into(),
        ),
        Err(e) if e.is_timeout() => Sent::Unknown(
            "TIMEOUT".into(),
            "no answer within the timeout; the receiver may have it".into(),
        ),
        Err(_) => Sent::Unknown(
            "SEND_FAILED".into(),
            "the exchange broke off after the request was sent; the receiver may have it".into(),
        ),
    }
}

/// The schedule's verdict on a send that ended as `sent`, the row having had `retries`.
fn outcome(sent: Sent, retries: u32, schedule: &[Duration], now: OffsetDateTime) -> SendOutcome {
    match sent {
        Sent::Succeeded => SendOutcome::Succeeded,
        Sent::Permanent(code, message) => SendOutcome::Failed { code, message },
        Sent::Unknown(code, message) => SendOutcome::Unknown { code, message },
        Sent::Retryable(code, message) => match schedule.get(retries as usize) {
            Some(delay) => SendOutcome::Retry {
                at: now + *delay,
                code,
                message,
            },
            None => SendOutcome::Dead { code, message },
        },
    }
}

/// The body a webhook of `format` receives for the claimed row.
fn body(delivery: &Delivery) -> Vec<u8> {
    let n = &delivery.notification;
    let value = match delivery.format {
        WebhookFormat::Generic => serde_json::to_value(GenericBody {
            id: n.idempotency_key.clone(),
            event_id: n.event_id,
            kind: n.event_kind.clone(),
            tenant_id: n.tenant_id,
            occurred_at: n.event_at,
            data: n.event_data.clone(),
        }),
        WebhookFormat::Slack => serde_json::to_value(SlackBody {
            text: slack_text(&n.event_kind, &n.event_data),
        }),
    };
    serde_json::to_vec(&value.unwrap_or_default()).unwrap_or_default()
}

/// `sha256=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
pub(crate) fn signature(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    let mut signed = format!("{timestamp}.").into_bytes();
    signed.extend_from_slice(body);
    format!(
        "sha256={}",
        hex::encode(berth_crypto::hmac_sha256(secret, &signed))
    )
}

pub(crate) async fn deliver(state: &SharedState, client: &reqwest::Client, delivery: Delivery) {
    let n = &delivery.notification;
    let sent = match envelope::open(
        &state.master_key,
        n.tenant_id,
        &secret_key(&n.webhook),
        1,
        &Envelope {
            wrapped_key: delivery.secret_wrapped_key.clone(),
            ciphertext: delivery.secret_ciphertext.clone(),
        },
    ) {
        // Nothing left: a permanent failure, and the operator's to look into.
        Err(e) => Sent::Permanent("SECRET_UNAVAILABLE".into(), e.to_string()),
        Ok(secret) => {
            let body = body(&delivery);
            let timestamp = state.config.clock.now().unix_timestamp();
            let result = client
                .post(&delivery.url)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .header(IDEMPOTENCY_KEY_HEADER, &n.idempotency_key)
                .header(TIMESTAMP_HEADER, timestamp.to_string())
                .header(SIGNATURE_HEADER, signature(&secret, timestamp, &body))
                .body(body)
                .send()
                .await
                .map(|response| response.status());
            classify(result)
        }
    };
    let now = state.config.clock.now();
    let outcome = outcome(sent, n.retries, &state.config.notify.retry_schedule, now);
    tracing::info!(
        notification = n.id,
        webhook = %n.webhook,
        event_id = n.event_id,
        attempt = n.attempts,
        outcome = ?outcome,
        "notification sent"
    );
    match state
        .store
        .finish_notification(n.id, n.attempts, outcome, now)
        .await
    {
        Ok(true) => {}
        // Its lease ran out first (it is `unknown` now), or its webhook was deleted meanwhile.
        Ok(false) => tracing::warn!(
            notification = n.id,
            "the notification changed during the send; its outcome was not recorded"
        ),
        Err(e) => {
            // Left `sending`: it becomes `unknown` when its lease ends, never sent twice.
            state.metrics.error("reconcile_store");
            tracing::warn!(notification = n.id, error = %ErrorChain(&e), "recording a send failed");
        }
    }
}

/// Where a webhook's secret is sealed: its name within the tenant, version 1 (a webhook is
/// never edited; delete and create it again).
pub fn secret_key(name: &str) -> String {
    format!("webhook/{name}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener that is bound and then dropped: connecting to it is refused.
    async fn refused_addr() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        listener.local_addr().unwrap()
    }

    #[tokio::test]
    async fn a_refused_connection_is_retryable_and_a_silent_or_closing_receiver_is_unknown() {
        let client = berth_client::webhook_http_client(Duration::from_millis(500)).unwrap();
        let refused = refused_addr().await;
        let sent = classify(
            client
                .post(format!("http://{refused}/"))
                .send()
                .await
                .map(|r| r.status()),
        );
        assert!(matches!(sent, Sent::Retryable(ref code, _) if code == "CONNECT_FAILED"));

        // Accepts the connection, reads the request, never answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hold = tokio::spawn(async move {
            let (socket, _) = listener.accept().await.unwrap();
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(socket);
        });
        let sent = classify(
            client
                .post(format!("http://{addr}/"))
                .body("{}")
                .send()
                .await
                .map(|r| r.status()),
        );
        assert!(matches!(sent, Sent::Unknown(ref code, _) if code == "TIMEOUT"));
        hold.abort();

        // Reads the request, then closes the connection without an answer.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let close = tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = socket.read(&mut buf).await;
            drop(socket);
        });
        let sent = classify(
            client
                .post(format!("http://{addr}/"))
                .body("{}")
                .send()
                .await
                .map(|r| r.status()),
        );
        assert!(
            matches!(sent, Sent::Unknown(ref code, _) if code == "SEND_FAILED"),
            "{sent:?}"
        );
        close.await.unwrap();
    }

    #[test]
    fn the_schedule_decides_retries_then_dead() {
        let schedule = [Duration::from_secs(1), Duration::from_secs(8)];
        let now = OffsetDateTime::UNIX_EPOCH;
        let retry = || Sent::Retryable("HTTP_500".into(), "x".into());
        assert!(matches!(
            outcome(retry(), 0, &schedule, now),
            SendOutcome::Retry { at, .. } if at == now + Duration::from_secs(1)
        ));
        assert!(matches!(
            outcome(retry(), 1, &schedule, now),
            SendOutcome::Retry { at, .. } if at == now + Duration::from_secs(8)
        ));
        assert!(matches!(
            outcome(retry(), 2, &schedule, now),
            SendOutcome::Dead { .. }
        ));
        assert!(matches!(
            classify(Ok(reqwest::StatusCode::NOT_FOUND)),
            Sent::Permanent(ref code, _) if code == "HTTP_404"
        ));
        assert!(matches!(
            classify(Ok(reqwest::StatusCode::BAD_GATEWAY)),
            Sent::Retryable(..)
        ));
        assert_eq!(
            classify(Ok(reqwest::StatusCode::NO_CONTENT)),
            Sent::Succeeded
        );
    }

    #[test]
    fn the_signature_covers_timestamp_and_body() {
        // HMAC-SHA256("secret", "1700000000.{}"), computed independently (Python's hmac).
        let sig = signature(b"secret", 1_700_000_000, b"{}");
        assert_eq!(
            sig,
            "sha256=b8569b78799ff9e3cbff0fc2d63a33a2b57f3282abd07c37ae5e8e7d79a5f163"
        );
        assert_ne!(sig, signature(b"secret", 1_700_000_001, b"{}"));
        assert_ne!(sig, signature(b"other", 1_700_000_000, b"{}"));
    }
}
