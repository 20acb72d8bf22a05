//! Seed 000's task stream (`WS /api/v1/agents/{id}/task-stream`) and the heartbeat's task list,
//! against an in-process server over real mTLS: the stream hands out what a poll would, only
//! when asked, under the same fencing; cancellations are pushed; a stream lost after a push is
//! a lost poll answer.

mod common;

use std::time::Duration;

use berth_client::{ClientError, WebSocket};
use berth_proto::task::{CancelTask, CreateTask, TaskState};
use berth_proto::transport::{
    self, AgentTaskAssignment, AgentTaskPollRequest, TaskStreamMessage, TaskStreamRequest,
    CONTRACT_VERSION, GENERATION_HEADER,
};
use berth_proto::AgentId;
use berth_test_utils::wait_until;
use common::{create, ok, show, start, start_with, TestAgent, TestServer};
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use tokio_tungstenite::tungstenite::Message;

/// How long a test waits for a message the server must send.
const PUSH: Duration = Duration::from_secs(20);

fn task(agent: AgentId, task_type: &str) -> CreateTask {
    CreateTask {
        task_type: task_type.into(),
        agent_id: Some(agent),
        payload: json!({}),
        ..Default::default()
    }
}

/// A session of a process that holds the installation's lock on this boot: each call takes the
/// session over at once (a restart), fencing the one before.
async fn restart(agent: &TestAgent) -> i64 {
    agent
        .client
        .send(&berth_proto::transport::AcquireSession {
            agent_id: agent.id,
            instance_id: uuid::Uuid::new_v4().to_string(),
            boot_id: Some("stream-test-boot".into()),
            lock: Some("1:1".into()),
            version: None,
        })
        .await
        .expect("session")
        .generation
}

async fn open(agent: &TestAgent, generation: i64) -> Result<WebSocket, ClientError> {
    let g = generation.to_string();
    agent
        .client
        .websocket(
            &transport::task_stream_path(agent.id),
            &[(GENERATION_HEADER, &g)],
        )
        .await
}

/// Asks for one delivery, as berth-agent does per free slot.
async fn ready(socket: &mut WebSocket, agent: &TestAgent) {
    let ready = TaskStreamRequest::Ready(AgentTaskPollRequest {
        contract_version: CONTRACT_VERSION.into(),
        agent_id: agent.id,
        capabilities: vec!["docker".into(), "compose".into(), "ssh".into()],
        start_handshake: true,
    });
    socket
        .send(Message::text(serde_json::to_string(&ready).unwrap()))
        .await
        .expect("send ready");
}

/// The next message the server sends: a stream message, or the close frame's (code, reason).
async fn next(socket: &mut WebSocket) -> Result<TaskStreamMessage, (u16, String)> {
    loop {
        let message = tokio::time::timeout(PUSH, socket.next())
            .await
            .expect("a message in time");
        match message {
            Some(Ok(Message::Text(text))) => {
                return Ok(serde_json::from_str(&text).expect("a task stream message"))
            }
            Some(Ok(Message::Close(frame))) => {
                return Err(frame.map_or((1005, String::new()), |f| {
                    (u16::from(f.code), f.reason.to_string())
                }))
            }
            Some(Ok(_)) => continue,
            other => panic!("the stream ended without a close frame: {other:?}"),
        }
    }
}

async fn assigned(socket: &mut WebSocket) -> AgentTaskAssignment {
    match next(socket).await {
        Ok(TaskStreamMessage::TaskAssigned { task }) => *task,
        other => panic!("expected an assignment, got {other:?}"),
    }
}

#[tokio::test]
async fn the_stream_hands_out_what_a_poll_would_one_per_ready() {
    let server = start().await;
    let agent = server.agent("streamer").await;
    let generation = agent.session().await;
    let mut socket = open(&agent, generation).await.expect("stream opens");
    let mut high = task(agent.id, "inspect");
    high.priority = Some(10);
    let low = create(&server, task(agent.id, "inspect")).await;
    let high = create(&server, high).await;
    ready(&mut socket, &agent).await;
    let first = assigned(&mut socket).await;
    assert_eq!(first.task_id, high.id, "claim order, as the poll's");
    assert_eq!(first.agent_id, agent.id);
    // One ready, one push: the second task waits for the next ready.
    let view = show(&server, &high).await;
    assert_eq!(view.state, TaskState::Leased);
    assert_eq!(view.attempts[0].assignment_id, first.assignment_id);
    assert_eq!(view.attempts[0].generation, generation);
    assert_eq!(show(&server, &low).await.state, TaskState::Pending);
    ready(&mut socket, &agent).await;
    let second = assigned(&mut socket).await;
    assert_eq!(second.task_id, low.id);
    // A ready with nothing queued is answered when work arrives (the poll's wake-up).
    ready(&mut socket, &agent).await;
    let later = create(&server, task(agent.id, "inspect")).await;
    assert_eq!(assigned(&mut socket).await.task_id, later.id);
    // Results stay on the signed HTTP route.
    for a in [&first, &second] {
        agent
            .submit(
                generation,
                agent.sign(agent.envelope(a.assignment_id, ok(a.task_id))),
            )
            .await
            .expect("signed result");
    }
    assert_eq!(show(&server, &high).await.state, TaskState::Succeeded);
    // A ready that is not the poll's body closes the stream as the poll refuses it.
    socket
        .send(Message::text(
            json!({"type": "ready", "contractVersion": "agent-task-transport/v9", "agentId": agent.id})
                .to_string(),
        ))
        .await
        .unwrap();
    assert_eq!(
        next(&mut socket).await.unwrap_err(),
        (4422, "UNSUPPORTED_CONTRACT_VERSION".into())
    );
    server.stop().await;
}

#[tokio::test]
async fn the_upgrade_is_refused_like_a_poll() {
    let server = start().await;
    let agent = server.agent("refused").await;
    let other = server.agent("other").await;
    let old = restart(&agent).await;
    let current = restart(&agent).await;
    let code = |e: ClientError| match e {
        ClientError::Api { status, body, .. } => (status, body.code),
        other => panic!("expected a refusal, got {other:?}"),
    };
    assert_eq!(
        code(open(&agent, old).await.unwrap_err()),
        (409, "FENCED".into())
    );
    // Another agent's certificate for this path.
    let g = current.to_string();
    let err = other
        .client
        .websocket(
            &transport::task_stream_path(agent.id),
            &[(GENERATION_HEADER, &g)],
        )
        .await
        .unwrap_err();
    assert_eq!(code(err), (403, "CERT_BINDING_MISMATCH".into()));
    // No certificate at all.
    let err = server
        .client(None, None)
        .websocket(
            &transport::task_stream_path(agent.id),
            &[(GENERATION_HEADER, &g)],
        )
        .await
        .unwrap_err();
    assert_eq!(code(err), (401, "CLIENT_CERT_REQUIRED".into()));
    // A plain GET (no Upgrade) is told what the route is.
    let response = server
        .raw(Some(&agent.identity()))
        .get(format!(
            "{}{}",
            server.url,
            transport::task_stream_path(agent.id)
        ))
        .header(GENERATION_HEADER, g)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 426);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["code"], "UPGRADE_REQUIRED");
    server.stop().await;
}

/// A process fenced by a newer session gets nothing more on its open stream: the next claim
/// is refused in the store's transaction and the stream is closed with the poll's code.
#[tokio::test]
async fn a_fenced_stream_gets_nothing_after_a_new_session() {
    let server = start().await;
    let agent = server.agent("fenced").await;
    let old = restart(&agent).await;
    let mut socket = open(&agent, old).await.expect("stream opens");
    ready(&mut socket, &agent).await;
    let current = restart(&agent).await;
    let t = create(&server, task(agent.id, "inspect")).await;
    assert_eq!(
        next(&mut socket).await.unwrap_err(),
        (4409, "FENCED".into())
    );
    assert_eq!(show(&server, &t).await.state, TaskState::Pending);
    // The current process gets it.
    let mut socket = open(&agent, current).await.expect("stream opens");
    ready(&mut socket, &agent).await;
    assert_eq!(assigned(&mut socket).await.task_id, t.id);
    server.stop().await;
}

/// A stream with no ready outstanding is still closed once its process is fenced (checked on
/// every wake-up), so it does not linger as a stale process's socket.
#[tokio::test]
async fn an_idle_fenced_stream_is_closed() {
    let server = start().await;
    let agent = server.agent("idle").await;
    let old = restart(&agent).await;
    let mut socket = open(&agent, old).await.expect("stream opens");
    restart(&agent).await;
    create(&server, task(agent.id, "inspect")).await;
    assert_eq!(
        next(&mut socket).await.unwrap_err(),
        (4409, "FENCED".into())
    );
    server.stop().await;
}

#[tokio::test]
async fn a_cancelled_running_task_is_cancelled_over_the_stream() {
    let server = start().await;
    let agent = server.agent("cancelled").await;
    let generation = agent.session().await;
    let mut socket = open(&agent, generation).await.expect("stream opens");
    let t = create(&server, task(agent.id, "inspect")).await;
    ready(&mut socket, &agent).await;
    let a = assigned(&mut socket).await;
    server
        .admin()
        .send(&CancelTask { id: t.id })
        .await
        .expect("cancel");
    match next(&mut socket).await {
        Ok(TaskStreamMessage::TaskCancelled {
            task_id,
            assignment_id,
        }) => assert_eq!((task_id, assignment_id), (t.id, a.assignment_id)),
        other => panic!("expected the cancellation, got {other:?}"),
    }
    let cancelled = common::failure(t.id, "CANCELLED", false);
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(a.assignment_id, cancelled)),
        )
        .await
        .expect("cancelled result");
    assert_eq!(show(&server, &t).await.state, TaskState::Cancelled);
    server.stop().await;
}

/// A stream lost right after a push is a lost poll answer: the delivery stays leased to that
/// assignment (a new stream gets nothing for it), its lease runs out, the task is handed out
/// again under a fresh assignment, and the lost assignment can no longer record a result.
#[tokio::test]
async fn a_stream_lost_after_a_push_never_delivers_twice() {
    let server = start_with(|c| c.lease_grace = Duration::ZERO).await;
    let agent = server.agent("lost").await;
    let generation = agent.session().await;
    let mut request = task(agent.id, "inspect");
    request.timeout_seconds = Some(1);
    let t = create(&server, request).await;
    let mut socket = open(&agent, generation).await.expect("stream opens");
    ready(&mut socket, &agent).await;
    let first = assigned(&mut socket).await;
    drop(socket);
    let mut socket = open(&agent, generation).await.expect("stream opens again");
    ready(&mut socket, &agent).await;
    // The first delivery's lease (1 s, no grace) runs out; the stream, still asking, gets the
    // task again once it is claimable.
    wait_until(Duration::from_secs(30), "the lease to expire", || async {
        let view = show(&server, &t).await;
        view.state != TaskState::Leased || view.attempts.len() == 2
    })
    .await;
    let second = assigned(&mut socket).await;
    assert_eq!(second.task_id, t.id);
    assert_ne!(second.assignment_id, first.assignment_id);
    let late = agent.sign(agent.envelope(first.assignment_id, ok(t.id)));
    let err = agent.submit(generation, late).await.unwrap_err();
    assert!(
        matches!(&err, ClientError::Api { status: 409, body, .. } if body.code == "FENCED"),
        "{err:?}"
    );
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(second.assignment_id, ok(t.id))),
        )
        .await
        .expect("the live assignment's result");
    let done = show(&server, &t).await;
    assert_eq!(done.state, TaskState::Succeeded);
    assert_eq!(done.attempts.len(), 2);
    server.stop().await;
}

/// Seed 000's heartbeat answer `{tasks}`: the agent's queued tasks in claim order, without
/// credentials and without claiming them.
#[tokio::test]
async fn the_heartbeat_answer_lists_queued_tasks() {
    let server = start().await;
    let agent = server.agent("beating").await;
    let generation = agent.session().await;
    let answer = agent
        .heartbeat(generation, common::next_sequence())
        .await
        .expect("heartbeat");
    assert!(answer.tasks.is_empty());
    let mut secret = task(agent.id, "inspect");
    secret.credentials = Some([("token".to_string(), "s3cr3t-value".to_string())].into());
    secret.payload = json!({"note": "first"});
    let first = create(&server, secret).await;
    let second = create(&server, task(agent.id, "inspect")).await;
    let raw = agent
        .heartbeat(generation, common::next_sequence())
        .await
        .expect("heartbeat");
    let ids: Vec<_> = raw.tasks.iter().map(|t| t.id).collect();
    assert_eq!(ids, vec![first.id, second.id]);
    let listed = &raw.tasks[0];
    assert_eq!(listed.task_type, "inspect");
    assert_eq!(listed.target_id, agent.id);
    // Payload and credentials leave only sealed, inside an assignment.
    assert_eq!(
        listed.payload,
        serde_json::Value::Null,
        "payload never listed"
    );
    assert!(listed.credentials.is_empty(), "credentials never listed");
    assert!(listed.assigned_at.is_none() && listed.expires_at.is_none());
    let text = serde_json::to_string(&raw.tasks).unwrap();
    assert!(
        !text.contains("s3cr3t-value") && !text.contains("first"),
        "{text}"
    );
    // Listing claimed nothing.
    assert_eq!(show(&server, &first).await.state, TaskState::Pending);
    let a = agent
        .poll(generation)
        .await
        .expect("poll")
        .assignment
        .expect("assignment");
    assert_eq!(a.task_id, first.id);
    let after = agent
        .heartbeat(generation, common::next_sequence())
        .await
        .expect("heartbeat");
    assert_eq!(
        after.tasks.iter().map(|t| t.id).collect::<Vec<_>>(),
        vec![second.id]
    );
    server.stop().await;
}

/// Seed 000's unsigned `complete` records nothing at all: not the task, not its attempt, and
/// no audit entry (`transport.rs` checks the code, the named endpoint and the refusals).
#[tokio::test]
async fn the_legacy_complete_appends_no_audit_entry() {
    use berth_proto::audit::ListAudit;
    let server = start().await;
    let agent = server.agent("legacy").await;
    let generation = agent.session().await;
    let t = create(&server, task(agent.id, "inspect")).await;
    let a = agent
        .poll(generation)
        .await
        .expect("poll")
        .assignment
        .expect("assignment");
    let audit = |server: &TestServer| {
        let admin = server.admin();
        async move {
            admin
                .send(&ListAudit {
                    after: 0,
                    limit: Some(1000),
                })
                .await
                .expect("audit")
                .items
                .len()
        }
    };
    let (before, entries) = (show(&server, &t).await, audit(&server).await);
    let response = server
        .raw(Some(&agent.identity()))
        .post(format!(
            "{}/api/v1/agents/{}/tasks/{}/complete",
            server.url, agent.id, t.id
        ))
        .header(GENERATION_HEADER, generation.to_string())
        .json(&json!({"success": true, "result": {}, "logs": "done"}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["code"], "SIGNED_RESULT_REQUIRED");
    let after = show(&server, &t).await;
    assert_eq!(after.state, TaskState::Leased);
    assert_eq!(
        serde_json::to_value(&after.attempts).unwrap(),
        serde_json::to_value(&before.attempts).unwrap()
    );
    assert_eq!(audit(&server).await, entries, "no audit entry");
    assert_eq!(a.task_id, t.id);
    server.stop().await;
}
