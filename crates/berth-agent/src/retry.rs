//! What to do about a failed call to the control plane, and the retry loop that acts on it.
//!
//! Every decision is read from typed errors: the API error's status and stable code, or
//! [`berth_client::TlsFailure`] for a refused handshake. The result is either a retry (after
//! `Retry-After` or a jittered back-off) or the [`AgentError`] whose exit code ends the agent.

use std::future::Future;
use std::time::{Duration, Instant};

use berth_client::{ClientError, TlsFailure};
use berth_proto::error::codes;

use crate::backoff::Backoff;
use crate::link::{Link, SharedLink};
use crate::AgentError;

/// What to do about a failed call.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Stop: the error is final.
    Stop(AgentError),
    /// Try again after this long (from `Retry-After`), or after the back-off delay.
    Retry(Option<Duration>, String),
    /// The server is unreachable or failing (no connection, a broken one, a 5xx): try again
    /// like [`Failure::Retry`], or on the next server when several are named.
    Outage(Option<Duration>, String),
}

pub(crate) fn classify(e: ClientError) -> Failure {
    match &e {
        ClientError::Api {
            status,
            body,
            retry_after,
        } => match (*status, body.code.as_str()) {
            // An expired certificate is one this agent failed to renew in time.
            (401, codes::AGENT_REVOKED)
            | (403, codes::CERT_BINDING_MISMATCH)
            | (401, codes::CLIENT_CERT_REQUIRED)
            | (401, codes::CLIENT_CERT_EXPIRED) => {
                Failure::Stop(AgentError::Revoked(e.to_string()))
            }
            // Final for this link; `with_link_retries` sends again on the renewed one.
            (401, codes::CERTIFICATE_SUPERSEDED) => {
                Failure::Stop(AgentError::Superseded(e.to_string()))
            }
            // Another live process holds this identity's session: wait for its lease to lapse.
            (409, codes::SESSION_HELD) => Failure::Retry(*retry_after, e.to_string()),
            // A newer process took over: stop everything. (A result for a stale assignment is
            // refused with the same code; `tasks` only logs that.)
            (409, codes::FENCED) => Failure::Stop(AgentError::Fenced(e.to_string())),
            (401, codes::REGISTRATION_TOKEN_INVALID) | (409, _) => {
                Failure::Stop(AgentError::Config(e.to_string()))
            }
            (429, _) => Failure::Retry(*retry_after, e.to_string()),
            (s, _) if s >= 500 => Failure::Outage(*retry_after, e.to_string()),
            _ => Failure::Stop(AgentError::Fatal(e.to_string())),
        },
        ClientError::Transport { .. } | ClientError::Connect { .. } => {
            let why = format!("{e}: {}", error_chain(&e));
            // Certificate failures do not heal by retrying: the server is not the one we pinned
            // (configuration), or it refuses our certificate (re-register).
            match e.tls_failure() {
                Some(TlsFailure::ServerNotTrusted) => Failure::Stop(AgentError::Config(why)),
                Some(TlsFailure::ClientCertificateRefused) => {
                    Failure::Stop(AgentError::Revoked(why))
                }
                None => Failure::Outage(None, why),
            }
        }
        ClientError::Decode(_) => Failure::Retry(None, e.to_string()),
        ClientError::Config(_) => Failure::Stop(AgentError::Config(e.to_string())),
    }
}

/// The error's sources, for the message people read (never for a decision).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = Vec::new();
    let mut source = e.source();
    while let Some(s) = source {
        out.push(s.to_string());
        source = s.source();
    }
    out.join(": ")
}

/// Retries `call` with jittered back-off until it succeeds, fails for good, or the budget is
/// spent (then `Temporary`, exit 75).
pub(crate) async fn with_retries<T, F, Fut>(
    what: &str,
    budget: Duration,
    call: F,
) -> Result<T, AgentError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    with_retries_or_fail_over(what, budget, false, call).await
}

/// [`with_retries`] for the calls that decide which server the agent uses (the session's
/// heartbeats, polls and task stream): with `fail_over` (several servers named), an outage of
/// the server in use is not waited out but returned at once as [`AgentError::ServerLost`], so
/// `run` moves to the next server and acquires a new session there.
pub(crate) async fn with_retries_or_fail_over<T, F, Fut>(
    what: &str,
    budget: Duration,
    fail_over: bool,
    mut call: F,
) -> Result<T, AgentError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    let started = Instant::now();
    let mut backoff = Backoff::new(Duration::from_secs(1), Duration::from_secs(60));
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) => match classify(e) {
                Failure::Stop(e) => return Err(e),
                Failure::Outage(_, why) if fail_over => {
                    return Err(AgentError::ServerLost(format!("{what}: {why}")))
                }
                Failure::Retry(after, why) | Failure::Outage(after, why) => {
                    let delay = after.unwrap_or_else(|| backoff.next_delay());
                    if started.elapsed() + delay > budget {
                        return Err(AgentError::Temporary(format!(
                            "{what}: gave up after {:?}: {why}",
                            started.elapsed()
                        )));
                    }
                    tracing::warn!(%why, retry_in = ?delay, "{what} failed; retrying");
                    tokio::time::sleep(delay).await;
                }
            },
        }
    }
}

/// [`with_retries`] for the calls that run beside a renewal (polls, results): each attempt goes
/// out on the link as it is then. A refusal as superseded means the attempt used the
/// certificate this process's renewal has just replaced (a poll parked on the old connection, a
/// result sent as the renewal committed): once the heartbeat loop has put the new link in place,
/// the call starts again on it. If no new link comes within `budget`, the stored identity is
/// out of date, which is final like a revocation.
pub(crate) async fn with_link_retries<T, F, Fut>(
    what: &str,
    budget: Duration,
    link: &SharedLink,
    call: F,
) -> Result<T, AgentError>
where
    F: FnMut(Link) -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    link_retries(what, budget, link, false, call).await
}

/// [`with_link_retries`] for the session's own loop (polls, the task stream): an outage is
/// [`AgentError::ServerLost`] when the link names several servers (see
/// [`with_retries_or_fail_over`]).
pub(crate) async fn with_link_retries_or_fail_over<T, F, Fut>(
    what: &str,
    budget: Duration,
    link: &SharedLink,
    call: F,
) -> Result<T, AgentError>
where
    F: FnMut(Link) -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    link_retries(what, budget, link, link.fails_over(), call).await
}

async fn link_retries<T, F, Fut>(
    what: &str,
    budget: Duration,
    link: &SharedLink,
    fail_over: bool,
    mut call: F,
) -> Result<T, AgentError>
where
    F: FnMut(Link) -> Fut,
    Fut: Future<Output = Result<T, ClientError>>,
{
    loop {
        let mut used = link.current();
        let result = with_retries_or_fail_over(what, budget, fail_over, || {
            used = link.current();
            call(used.clone())
        })
        .await;
        match result {
            Err(AgentError::Superseded(why)) => {
                if tokio::time::timeout(budget, link.replaced(&used))
                    .await
                    .is_err()
                {
                    return Err(AgentError::Revoked(why));
                }
                tracing::info!("{what}: sent with the certificate just renewed; sending again");
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use berth_proto::ErrorBody;

    fn api(status: u16, code: &str) -> ClientError {
        ClientError::Api {
            status,
            body: ErrorBody {
                code: code.into(),
                detail: "d".into(),
            },
            retry_after: Some(Duration::from_secs(3)),
        }
    }

    fn exit(f: Failure) -> Option<i32> {
        match f {
            Failure::Stop(e) => Some(e.exit_code()),
            Failure::Retry(..) | Failure::Outage(..) => None,
        }
    }

    #[test]
    fn api_errors_pick_the_exit_code_by_status_and_code() {
        assert_eq!(exit(classify(api(401, codes::AGENT_REVOKED))), Some(1));
        assert_eq!(
            exit(classify(api(403, codes::CERT_BINDING_MISMATCH))),
            Some(1)
        );
        assert_eq!(exit(classify(api(409, codes::FENCED))), Some(1));
        assert_eq!(
            exit(classify(api(401, codes::REGISTRATION_TOKEN_INVALID))),
            Some(78)
        );
        assert_eq!(exit(classify(api(400, "INVALID_REQUEST"))), Some(1));
        assert!(matches!(
            classify(api(409, codes::SESSION_HELD)),
            Failure::Retry(Some(d), _) if d == Duration::from_secs(3)
        ));
        assert_eq!(exit(classify(api(429, "RATE_LIMITED"))), None);
        assert_eq!(exit(classify(api(503, codes::UNAVAILABLE))), None);
        assert_eq!(exit(classify(ClientError::Config("x".into()))), Some(78));
        assert!(matches!(
            classify(api(401, codes::CERTIFICATE_SUPERSEDED)),
            Failure::Stop(AgentError::Superseded(_))
        ));
        assert_eq!(
            exit(classify(api(401, codes::CERTIFICATE_SUPERSEDED))),
            Some(1)
        );
        assert!(matches!(
            classify(api(401, codes::CLIENT_CERT_EXPIRED)),
            Failure::Stop(AgentError::Revoked(_))
        ));
    }

    fn link() -> Link {
        Link {
            client: crate::link::client(
                "https://127.0.0.1:9",
                berth_client::Trust::CaFingerprint(format!("sha256:{}", "0".repeat(64))),
                None,
            )
            .unwrap(),
            key: std::sync::Arc::new(berth_crypto::AgentKey::generate().unwrap()),
            opener: std::sync::Arc::new(berth_crypto::hpke::RecipientKey::generate().unwrap()),
            at: 0,
        }
    }

    #[tokio::test]
    async fn a_call_superseded_by_the_renewal_is_sent_again_on_the_new_link() {
        let old = link();
        let shared = SharedLink::new(old.clone());
        let renewed = link();
        let mut used = Vec::new();
        let answer = with_link_retries("probe", Duration::from_secs(30), &shared, |l| {
            used.push(l.key.clone());
            let first = used.len() == 1;
            let (shared, renewed) = (shared.clone(), renewed.clone());
            async move {
                if first {
                    // The renewal completes after the server has refused the old certificate.
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        shared.replace(renewed);
                    });
                    Err(api(401, codes::CERTIFICATE_SUPERSEDED))
                } else {
                    Ok("accepted")
                }
            }
        })
        .await
        .unwrap();
        assert_eq!(answer, "accepted");
        assert_eq!(used.len(), 2);
        assert!(std::sync::Arc::ptr_eq(&used[0], &old.key));
        assert!(std::sync::Arc::ptr_eq(&used[1], &renewed.key));
    }

    #[tokio::test]
    async fn superseded_without_a_renewal_of_its_own_is_final() {
        let shared = SharedLink::new(link());
        let err = with_link_retries("probe", Duration::from_millis(100), &shared, |_| async {
            Err::<(), _>(api(401, codes::CERTIFICATE_SUPERSEDED))
        })
        .await
        .unwrap_err();
        assert!(matches!(err, AgentError::Revoked(_)), "{err}");
        let err = with_link_retries("probe", Duration::from_secs(30), &shared, |_| async {
            Err::<(), _>(api(401, codes::AGENT_REVOKED))
        })
        .await
        .unwrap_err();
        assert!(matches!(err, AgentError::Revoked(_)), "{err}");
    }

    #[tokio::test]
    async fn a_refused_connection_is_retried_until_the_budget_is_spent() {
        // Nothing listens on port 9 of localhost: a transport error, no certificate involved.
        let client = crate::link::client(
            "https://127.0.0.1:9",
            berth_client::Trust::CaFingerprint(format!("sha256:{}", "0".repeat(64))),
            None,
        )
        .unwrap();
        let request = berth_proto::agent::RegisterAgent {
            name: "n".into(),
            version: "v".into(),
            capabilities: vec![],
            labels: Default::default(),
            csr: String::new(),
        };
        let e = client.send(&request).await.unwrap_err();
        assert_eq!(e.tls_failure(), None);
        let err = with_retries("probe", Duration::from_millis(100), || {
            client.send(&request)
        })
        .await
        .unwrap_err();
        assert!(matches!(err, AgentError::Temporary(_)), "{err}");
        assert_eq!(err.exit_code(), 75);

        // With several servers the session's loops do not wait the outage out: they report it
        // at once, and `run` moves to the next server. A 5xx is an outage too; a refusal is not.
        let err = with_retries_or_fail_over("probe", Duration::from_secs(600), true, || {
            client.send(&request)
        })
        .await
        .unwrap_err();
        assert!(matches!(err, AgentError::ServerLost(_)), "{err}");
        let err = with_retries_or_fail_over("probe", Duration::from_secs(600), true, || async {
            Err::<(), _>(api(503, codes::UNAVAILABLE))
        })
        .await
        .unwrap_err();
        assert!(matches!(err, AgentError::ServerLost(_)), "{err}");
        let err = with_retries_or_fail_over("probe", Duration::from_secs(600), true, || async {
            Err::<(), _>(api(409, codes::FENCED))
        })
        .await
        .unwrap_err();
        assert!(matches!(err, AgentError::Fenced(_)), "{err}");
    }
}
