//! `--probe-listen ADDR`: plain HTTP `GET /healthz` (200 while the process runs) and
//! `GET /readyz` (200 only while the agent holds a live session and every executor it offered
//! at start is healthy; else 503 with the reason), for systemd or a load balancer. It answers
//! those two paths only, reveals nothing but readiness, and never reaches the server.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use berth_exec::Capabilities;
use berth_proto::agent::ProbeStatus;
use berth_proto::kind::capability;

use crate::capabilities;
use crate::AgentError;

/// What `/readyz` decides from: until when the session lease holds, as this process last saw
/// it renewed, and why it does not when it was lost.
#[derive(Clone, Default)]
pub(crate) struct Readiness(Arc<Mutex<Session>>);

#[derive(Default)]
struct Session {
    held_until: Option<Instant>,
    lost: Option<String>,
}

/// The server renews a session lease to three heartbeat intervals from each heartbeat it
/// applies (and grants it so); the agent counts from when it sent the heartbeat, so it never
/// believes in a lease the server has already let go.
pub(crate) fn lease_after(interval: Duration) -> Duration {
    interval * 3
}

impl Readiness {
    /// The server granted or renewed the session at or after `sent`, for `lease`.
    pub(crate) fn renewed(&self, sent: Instant, lease: Duration) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.held_until = Some(sent + lease);
    }

    /// The session is gone for good (fenced, revoked, stopping): not ready until the process
    /// ends.
    pub(crate) fn lost(&self, why: String) {
        let mut s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        s.held_until = None;
        s.lost = Some(why);
    }

    fn session(&self, now: Instant) -> Result<(), String> {
        let s = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match (&s.lost, s.held_until) {
            (Some(why), _) => Err(format!("session lost: {why}")),
            (None, None) => Err("no session yet".into()),
            (None, Some(until)) if until <= now => {
                Err("session lapsed: no heartbeat reached the server in time".into())
            }
            (None, Some(_)) => Ok(()),
        }
    }
}

/// Binds `addr` (exit 78 when it cannot).
pub(crate) async fn bind(addr: SocketAddr) -> Result<tokio::net::TcpListener, AgentError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| AgentError::Config(format!("--probe-listen {addr}: {e}")))
}

/// Serves the probes on `listener` until the task is dropped. `offered` is what the agent
/// offered at start: an executor that was there must still be there and healthy.
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    readiness: Readiness,
    offered: Capabilities,
) {
    let expected: Vec<String> = offered.get().into_iter().map(|c| c.name).collect();
    let app = Router::new()
        .route(
            "/healthz",
            get(|| async {
                Json(ProbeStatus {
                    ready: true,
                    reason: None,
                })
            }),
        )
        .route(
            "/readyz",
            get(move || {
                let (readiness, offered, expected) =
                    (readiness.clone(), offered.clone(), expected.clone());
                async move {
                    match ready(&readiness, &offered, &expected).await {
                        Ok(()) => (
                            StatusCode::OK,
                            Json(ProbeStatus {
                                ready: true,
                                reason: None,
                            }),
                        ),
                        Err(reason) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            Json(ProbeStatus {
                                ready: false,
                                reason: Some(reason),
                            }),
                        ),
                    }
                }
            }),
        );
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "the probe listener stopped");
    }
}

/// Ready: a live session, and each executor offered at start healthy. Docker is asked now (its
/// `/version`, a few milliseconds); the others as the last heartbeat found them.
async fn ready(
    readiness: &Readiness,
    offered: &Capabilities,
    expected: &[String],
) -> Result<(), String> {
    readiness.session(Instant::now())?;
    let mut now = offered.get();
    if expected.iter().any(|name| name == capability::DOCKER) {
        now.retain(|c| c.name != capability::DOCKER);
        now.extend(capabilities::docker().await);
    }
    for name in expected {
        match now.iter().find(|c| &c.name == name) {
            None => return Err(format!("executor {name} is gone")),
            Some(c) if !c.healthy => {
                return Err(format!(
                    "executor {name} is unhealthy: {}",
                    c.detail.as_deref().unwrap_or("no detail")
                ))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_states() {
        let r = Readiness::default();
        let t = Instant::now();
        assert_eq!(r.session(t), Err("no session yet".into()));
        r.renewed(t, Duration::from_secs(3));
        assert_eq!(r.session(t + Duration::from_secs(2)), Ok(()));
        assert!(r
            .session(t + Duration::from_secs(3))
            .unwrap_err()
            .starts_with("session lapsed"));
        r.renewed(t + Duration::from_secs(3), Duration::from_secs(3));
        assert_eq!(r.session(t + Duration::from_secs(4)), Ok(()));
        r.lost("fenced".into());
        assert_eq!(
            r.session(t + Duration::from_secs(4)),
            Err("session lost: fenced".into())
        );
        // A lost session is not brought back by a late renewal's answer.
        r.renewed(t + Duration::from_secs(4), Duration::from_secs(3));
        assert!(r.session(t + Duration::from_secs(5)).is_err());
    }
}
