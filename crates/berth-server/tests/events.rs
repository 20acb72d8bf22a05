//! `GET /api/v1/events` against an in-process server over real TLS: resume with
//! `Last-Event-ID` delivers every event exactly once, tenants see only their own events, and a
//! quiet stream is not closed as an idle connection.

mod common;

use std::time::Duration;

use berth_client::Client;
use berth_proto::admin::CreateTenant;
use berth_proto::event::{EventQuery, EventView, TaskStateEvent, TASK_STATE};
use berth_proto::task::{CancelTask, CreateTask, TaskState, TaskView};
use berth_proto::AgentId;

/// A generous upper bound for anything that should take milliseconds.
const PATIENCE: Duration = Duration::from_secs(60);

fn health_check(agent: AgentId) -> CreateTask {
    CreateTask {
        task_type: "health-check".into(),
        agent_id: Some(agent),
        payload: serde_json::json!({"type": "tcp", "host": "127.0.0.1", "port": 1}),
        ..Default::default()
    }
}

/// Every stored event of the query, through `follow=false`.
async fn backlog(client: &Client, mut query: EventQuery) -> Vec<EventView> {
    query.follow = Some(false);
    let mut stream = client
        .events(&query, None, PATIENCE)
        .await
        .expect("open backlog");
    let mut events = Vec::new();
    while let Some(event) = stream.next().await.expect("read backlog") {
        events.push(event);
    }
    events
}

#[tokio::test]
async fn a_client_that_reconnects_with_last_event_id_gets_every_event_exactly_once() {
    let server = common::start().await;
    let agent = server.agent("evented").await;
    agent.go_online().await;
    let admin = server.admin();

    // A burst of tasks, each created and cancelled, from several concurrent writers; then one
    // task for a second agent, which commits after all of them and tells the follower to stop.
    let last_agent = server.agent("last").await;
    const WRITERS: usize = 4;
    const TASKS: usize = 15;
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let admin = admin.clone();
            let agent = agent.id;
            tokio::spawn(async move {
                for _ in 0..TASKS {
                    let task: TaskView = admin.send(&health_check(agent)).await.expect("create");
                    admin
                        .send(&CancelTask { id: task.id })
                        .await
                        .expect("cancel");
                }
            })
        })
        .collect();
    let last_task = {
        let admin = admin.clone();
        tokio::spawn(async move {
            for writer in writers {
                writer.await.expect("writer");
            }
            let task: TaskView = admin
                .send(&health_check(last_agent.id))
                .await
                .expect("create the last task");
            task.id
        })
    };

    // The follower drops its connection every 7 events and resumes from the last id it saw.
    let mut seen: Vec<EventView> = Vec::new();
    let follow = tokio::time::timeout(PATIENCE, async {
        loop {
            let last = seen.last().map(|e| e.id);
            let mut stream = admin
                .events(&EventQuery::default(), last, PATIENCE)
                .await
                .expect("open stream");
            for _ in 0..7 {
                let event = stream.next().await.expect("read").expect("stream open");
                let done = event.kind == TASK_STATE && event.agent_id == Some(last_agent.id);
                seen.push(event);
                if done {
                    return;
                }
            }
        }
    })
    .await;
    follow.expect("caught up in time");
    let last_task = last_task.await.expect("writers");

    let stored = backlog(&admin, EventQuery::default()).await;
    let end = stored
        .iter()
        .position(|e| e.task_id == Some(last_task))
        .expect("the last task's event");
    assert_eq!(seen, stored[..=end], "every event once, in order");
    let task_events = stored.iter().filter(|e| e.kind == TASK_STATE).count();
    assert_eq!(task_events, 2 * WRITERS * TASKS + 1);
    // `?after=` resumes like the header.
    let middle = stored[stored.len() / 2].id;
    let after = backlog(
        &admin,
        EventQuery {
            after: Some(middle),
            ..EventQuery::default()
        },
    )
    .await;
    assert_eq!(after, stored[stored.len() / 2 + 1..].to_vec());
    server.stop().await;
}

#[tokio::test]
async fn events_are_filtered_by_task_and_never_cross_tenants() {
    let server = common::start().await;
    let agent = server.agent("private").await;
    let admin = server.admin();
    let task: TaskView = admin.send(&health_check(agent.id)).await.expect("create");
    admin
        .send(&CancelTask { id: task.id })
        .await
        .expect("cancel");
    admin
        .send(&health_check(agent.id))
        .await
        .expect("another task");

    let by_task = backlog(
        &admin,
        EventQuery {
            task: Some(task.id),
            ..EventQuery::default()
        },
    )
    .await;
    let states: Vec<TaskState> = by_task
        .iter()
        .map(|e| {
            assert_eq!(e.task_id, Some(task.id));
            serde_json::from_value::<TaskStateEvent>(e.data.clone())
                .expect("task.state data")
                .state
        })
        .collect();
    assert_eq!(states, [TaskState::Pending, TaskState::Cancelled]);

    let other = admin
        .send(&CreateTenant {
            name: "acme".into(),
        })
        .await
        .expect("tenant");
    let acme = server.client(Some(&other.admin_token), None);
    for query in [
        EventQuery::default(),
        EventQuery {
            task: Some(task.id),
            ..EventQuery::default()
        },
        EventQuery {
            agent: Some(agent.id),
            ..EventQuery::default()
        },
    ] {
        assert_eq!(backlog(&acme, query).await, []);
    }

    let err = server
        .raw(None)
        .get(format!("{}/api/v1/events?follow=false", server.url))
        .bearer_auth(&server.admin_token)
        .header("last-event-id", "soon")
        .send()
        .await
        .expect("send");
    assert_eq!(err.status(), 400);
    server.stop().await;
}

/// The listener closes connections with no request in flight after the header read timeout;
/// a stream that is still being answered is a request in flight, however quiet.
#[tokio::test]
async fn a_quiet_stream_outlives_the_idle_connection_timeout() {
    let server = common::start_with(|config| {
        config.header_read_timeout = Duration::from_secs(1);
    })
    .await;
    let agent = server.agent("later").await;
    let admin = server.admin();
    let stored = backlog(&admin, EventQuery::default()).await;
    let mut stream = admin
        .events(
            &EventQuery::default(),
            stored.last().map(|e| e.id),
            PATIENCE,
        )
        .await
        .expect("open stream");
    // With nothing to send, past the idle limit of a connection that has made a request (3
    // heartbeat intervals of 1 s) and the 2 s grace of an idle close.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let task: TaskView = admin.send(&health_check(agent.id)).await.expect("create");
    // The agent's own events (it goes offline, never having sent a heartbeat) may come first.
    let found = tokio::time::timeout(PATIENCE, async {
        loop {
            let event = stream
                .next()
                .await
                .expect("stream still open")
                .expect("not ended");
            if event.task_id == Some(task.id) {
                return event;
            }
        }
    })
    .await
    .expect("event in time");
    assert_eq!(found.kind, TASK_STATE);
    drop(stream);
    server.stop().await;
}

/// A stopping server ends its event streams cleanly instead of holding its drain on them.
#[tokio::test]
async fn a_stopping_server_ends_its_streams() {
    let server = common::start().await;
    let admin = server.admin();
    let mut stream = admin
        .events(&EventQuery::default(), Some(u64::MAX >> 1), PATIENCE)
        .await
        .expect("open stream");
    let reader = tokio::spawn(async move { stream.next().await });
    server.stop().await;
    let ended = reader.await.expect("reader");
    assert!(
        matches!(ended, Ok(None)),
        "the stream ends cleanly: {ended:?}"
    );
}
