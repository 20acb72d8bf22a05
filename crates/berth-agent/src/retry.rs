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
use crate::AgentError;

/// What to do about a failed call.
#[derive(Debug)]
pub(crate) enum Failure {
    /// Stop: the error is final.
    Stop(AgentError),
    /// Try again after this long (from `Retry-After`), or after the back-off delay.
    Retry(Option<Duration>, String),
}

pub(crate) fn classify(e: ClientError) -> Failure {
    match &e {
        ClientError::Api {
            status,
            body,
            retry_after,
        } => match (*status, body.code.as_str()) {
            (401, codes::AGENT_REVOKED)
            | (403, codes::CERT_BINDING_MISMATCH)
            | (401, codes::CLIENT_CERT_REQUIRED) => {
                Failure::Stop(AgentError::Revoked(e.to_string()))
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
            (s, _) if s >= 500 => Failure::Retry(*retry_after, e.to_string()),
            _ => Failure::Stop(AgentError::Fatal(e.to_string())),
        },
        ClientError::Transport { .. } => {
            let why = format!("{e}: {}", error_chain(&e));
            // Certificate failures do not heal by retrying: the server is not the one we pinned
            // (configuration), or it refuses our certificate (re-register).
            match e.tls_failure() {
                Some(TlsFailure::ServerNotTrusted) => Failure::Stop(AgentError::Config(why)),
                Some(TlsFailure::ClientCertificateRefused) => {
                    Failure::Stop(AgentError::Revoked(why))
                }
                None => Failure::Retry(None, why),
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
                Failure::Retry(after, why) => {
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
            Failure::Retry(..) => None,
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
    }
}
