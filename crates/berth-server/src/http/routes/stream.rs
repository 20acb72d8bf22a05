//! Seed 000's task push stream, `WS /api/v1/agents/{id}/task-stream`: the long-poll over one
//! WebSocket. It owns no delivery rule of its own: every claim is the poll's store call
//! (`claim_task`: generation, binding and claim order checked in its transaction), every
//! assignment is built by the poll's `assignment()`, and cancellations are the poll's
//! `pending_cancellations`. Start handshakes, results and heartbeats stay on their HTTP routes.
//!
//! It must never push more than the agent asked for: each `ready` message (the poll's body)
//! allows one claim, so the agent's limit on tasks at once holds as with polls. A push lost
//! with the connection is a lost poll answer: the lease runs out and the lost-lease rules apply.

use std::collections::BTreeSet;
use std::time::Duration;

use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use berth_proto::error::codes;
use berth_proto::transport::{
    stream_close_code, AgentTaskPollRequest, TaskStreamMessage, TaskStreamRequest,
};
use berth_proto::{AgentId, AssignmentId, ErrorBody};
use berth_store::ClaimOutcome;

use crate::http::auth::{binding_refused, AgentCaller, FencedAgent};
use crate::http::routes::transport::{assignment, check_poll, fenced, transport_enabled};
use crate::http::tls::{ConnectionHold, PeerCertificate};
use crate::infra::error::{ApiError, ApiResult};
use crate::SharedState;

/// How often a quiet stream is pinged and its session and certificate checked again, so a
/// stream of a process that was fenced, revoked or superseded is closed even with no work.
const CHECK_INTERVAL: Duration = Duration::from_secs(20);
/// The most `ready` messages the server holds for an agent (its tasks at once, at most).
const MAX_CREDIT: u32 = 256;
/// A client message is a poll body: small.
const MAX_MESSAGE_BYTES: usize = 64 * 1024;

/// Open the task stream (mTLS, with the generation). The upgrade is refused like a poll: no
/// certificate, another agent's, a revoked or superseded one, a stale generation. Once open, each
/// `{"type": "ready", …poll body}` the agent sends is answered, when its head task is claimable,
/// with `{"type": "task_assigned", "task": assignment}`; `{"type": "task_cancelled", taskId,
/// assignmentId}` comes whenever the operator cancels a running assignment. A refusal while open
/// closes the stream with code 4000 + the poll's HTTP status and the stable code as reason
/// (4409 `FENCED`, 4401 `CERTIFICATE_SUPERSEDED`/`AGENT_REVOKED`/`CLIENT_CERT_EXPIRED`,
/// 4422 for a bad message). A request without `Upgrade: websocket` is `426 UPGRADE_REQUIRED`.
#[utoipa::path(get, path = "/api/v1/agents/{id}/task-stream", tag = "agent-runtime",
    security(("agentCertificate" = [])),
    params(("id" = String, Path, format = Uuid), ("X-Berth-Generation" = i64, Header)),
    responses(
        (status = 101, description = "Switching to the WebSocket task stream"),
        (status = 401, body = ErrorBody, description = "CLIENT_CERT_REQUIRED, CLIENT_CERT_EXPIRED, AGENT_REVOKED, CERTIFICATE_SUPERSEDED"),
        (status = 403, body = ErrorBody, description = "CERT_BINDING_MISMATCH"),
        (status = 409, body = ErrorBody, description = "FENCED: stale or missing generation"),
        (status = 426, body = ErrorBody, description = "UPGRADE_REQUIRED: not a WebSocket upgrade request"),
        (status = 503, body = ErrorBody, description = "TRANSPORT_DISABLED"),
    ))]
pub async fn task_stream(
    State(state): State<SharedState>,
    FencedAgent {
        id,
        peer,
        generation,
    }: FencedAgent,
    hold: Option<axum::Extension<ConnectionHold>>,
    upgrade: Result<WebSocketUpgrade, axum::extract::ws::rejection::WebSocketUpgradeRejection>,
) -> ApiResult<Response> {
    transport_enabled(&state)?;
    // Refused before upgrading, as a poll would be; the store checks again on every claim.
    let agent = AgentCaller {
        id,
        peer: peer.clone(),
    }
    .bound(&state)
    .await?;
    if agent.generation != generation {
        return Err(fenced("this process's generation is no longer current"));
    }
    let upgrade = upgrade.map_err(|_| {
        ApiError::new(
            StatusCode::UPGRADE_REQUIRED,
            codes::UPGRADE_REQUIRED,
            "the task stream is a WebSocket: send GET with Upgrade: websocket over HTTP/1.1",
        )
    })?;
    Ok(upgrade
        .max_message_size(MAX_MESSAGE_BYTES)
        .on_upgrade(move |socket| async move {
            // The upgraded connection keeps its slot in the listener's connection budget.
            let _hold = hold;
            tracing::info!(agent_id = %id, generation, "task stream opened");
            let why = Stream {
                state,
                id,
                peer,
                generation,
                socket,
            }
            .serve()
            .await;
            tracing::info!(agent_id = %id, generation, %why, "task stream closed");
        }))
}

struct Stream {
    state: SharedState,
    id: AgentId,
    peer: PeerCertificate,
    generation: i64,
    socket: WebSocket,
}

/// Why a stream ended, for the log line.
enum End {
    ClientGone,
    Stopping,
    Refused(&'static str),
}

impl std::fmt::Display for End {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            End::ClientGone => f.write_str("the agent went away"),
            End::Stopping => f.write_str("the server is stopping"),
            End::Refused(code) => write!(f, "refused: {code}"),
        }
    }
}

impl Stream {
    async fn serve(mut self) -> End {
        let state = self.state.clone();
        let notify = state.wakeups.notifier(self.id);
        let mut stopping = state.stopping.subscribe();
        // Asked for and not yet answered; the capabilities and handshake of the latest ask.
        let mut credit: u32 = 0;
        let mut ask: Option<AgentTaskPollRequest> = None;
        // Cancellations pushed on this stream (kept while they are pending).
        let mut told: BTreeSet<AssignmentId> = BTreeSet::new();
        let mut check = tokio::time::interval(CHECK_INTERVAL);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let notified = notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();

            if let Err(refusal) = self.work(&mut credit, ask.as_ref(), &mut told).await {
                return self.close(refusal).await;
            }
            tokio::select! {
                _ = &mut notified => {}
                _ = check.tick() => {
                    if self.socket.send(Message::Ping(Default::default())).await.is_err() {
                        return End::ClientGone;
                    }
                }
                // (The guard `wait_for` returns is not `Send`: dropped inside.)
                _ = async { stopping.wait_for(|stop| *stop).await.is_ok() } => {
                    close_handshake(&mut self.socket, CloseFrame {
                        code: 1001,
                        reason: "the server is stopping".into(),
                    }).await;
                    return End::Stopping;
                }
                message = self.socket.recv() => match message {
                    Some(Ok(Message::Text(text))) => {
                        match self.ready(text.as_str()) {
                            Ok(request) => {
                                credit = (credit + 1).min(MAX_CREDIT);
                                ask = Some(request);
                            }
                            Err(refusal) => return self.close(refusal).await,
                        }
                    }
                    Some(Ok(Message::Binary(_))) => {
                        return self.close(ApiError::unprocessable(
                            codes::INVALID_REQUEST,
                            "task stream messages are JSON text",
                        )).await
                    }
                    // Pongs are answered by the WebSocket layer itself.
                    Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                    Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return End::ClientGone,
                },
            }
        }
    }

    /// A `ready` message: the poll's body, checked as a poll's is.
    fn ready(&self, text: &str) -> ApiResult<AgentTaskPollRequest> {
        let TaskStreamRequest::Ready(request) = serde_json::from_str(text).map_err(|e| {
            ApiError::unprocessable(
                codes::INVALID_REQUEST,
                format!("not a task stream message: {e}"),
            )
        })?;
        check_poll(&self.state, self.id, &request, &self.peer)?;
        Ok(request)
    }

    /// Claims while the agent has asked for more, then pushes new cancellations. With nothing
    /// asked for it still checks that the session and certificate are current, so a fenced or
    /// revoked stream is closed rather than left open.
    async fn work(
        &mut self,
        credit: &mut u32,
        ask: Option<&AgentTaskPollRequest>,
        told: &mut BTreeSet<AssignmentId>,
    ) -> ApiResult<()> {
        let state = self.state.clone();
        if state.config.clock.now() > self.peer.not_after {
            return Err(ApiError::unauthenticated(
                codes::CLIENT_CERT_EXPIRED,
                "the client certificate has expired; connect again with a current one",
            ));
        }
        match ask {
            Some(ask) if *credit > 0 => {
                while *credit > 0 {
                    let claim = state
                        .store
                        .claim_task(
                            self.id,
                            self.generation,
                            &self.peer.fingerprint,
                            &ask.capabilities,
                            ask.start_handshake,
                            state.config.clock.now(),
                            state.config.lease_grace,
                        )
                        .await?;
                    match claim {
                        ClaimOutcome::Fenced => {
                            return Err(fenced("this process's generation is no longer current"))
                        }
                        ClaimOutcome::Revoked => {
                            return Err(binding_refused(&state, self.id, &self.peer).await)
                        }
                        ClaimOutcome::Empty => break,
                        ClaimOutcome::Claimed(task, attempt) => {
                            state.metrics.task_assigned();
                            tracing::info!(
                                agent_id = %self.id, generation = self.generation,
                                task_id = %task.id, assignment_id = %attempt.assignment_id,
                                task_type = %task.task_type, expires_at = %attempt.lease_expires_at,
                                "task assigned (stream)"
                            );
                            let task = assignment(&state, &task, attempt, &self.peer)?;
                            *credit -= 1;
                            // A failed send is a lost poll answer: the lease runs out.
                            self.push(&TaskStreamMessage::TaskAssigned {
                                task: Box::new(task),
                            })
                            .await?;
                        }
                    }
                }
            }
            _ => {
                let agent = AgentCaller {
                    id: self.id,
                    peer: self.peer.clone(),
                }
                .bound(&state)
                .await?;
                if agent.generation != self.generation {
                    return Err(fenced("this process's generation is no longer current"));
                }
            }
        }
        let pending = state.store.pending_cancellations(self.id).await?;
        told.retain(|a| pending.iter().any(|(_, p)| p == a));
        for (task_id, assignment_id) in pending {
            if told.insert(assignment_id) {
                self.push(&TaskStreamMessage::TaskCancelled {
                    task_id,
                    assignment_id,
                })
                .await?;
            }
        }
        Ok(())
    }

    async fn push(&mut self, message: &TaskStreamMessage) -> ApiResult<()> {
        let text = serde_json::to_string(message).map_err(|e| ApiError::internal(&e))?;
        self.socket
            .send(Message::Text(text.into()))
            .await
            .map_err(|_| ApiError::new(StatusCode::GONE, "STREAM_CLOSED", "the agent went away"))
    }

    /// Closes with the refusal a poll would have answered: code 4000 + its status, reason its
    /// stable code (a close reason holds at most 123 bytes; the code always fits).
    async fn close(mut self, refusal: ApiError) -> End {
        if refusal.code == "STREAM_CLOSED" {
            return End::ClientGone;
        }
        tracing::warn!(
            agent_id = %self.id, generation = self.generation, code = refusal.code,
            detail = %refusal.detail, "task stream refused"
        );
        close_handshake(
            &mut self.socket,
            CloseFrame {
                code: stream_close_code(refusal.status.as_u16()),
                reason: refusal.code.into(),
            },
        )
        .await;
        End::Refused(refusal.code)
    }
}

/// How long a closed stream waits for the agent's answering Close.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Sends `frame` and waits (briefly) for the agent's Close before the connection is dropped, as
/// RFC 6455's closing handshake has it. Dropped at once, a connection the agent still writes to
/// (the Pong to our first Ping, say) is reset, and a reset can discard the Close frame before
/// the agent reads it: the agent would see a broken pipe instead of the refusal's code.
async fn close_handshake(socket: &mut WebSocket, frame: CloseFrame) {
    if socket.send(Message::Close(Some(frame))).await.is_err() {
        return;
    }
    let _ = tokio::time::timeout(CLOSE_GRACE, async {
        while let Some(Ok(message)) = socket.recv().await {
            if matches!(message, Message::Close(_)) {
                break;
            }
        }
    })
    .await;
}
