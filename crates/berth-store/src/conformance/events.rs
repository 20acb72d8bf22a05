//! Conformance cases of the event stream: every task and agent state change is an event, read
//! in id order after a cursor, per tenant, with filters; writers wake readers; concurrent
//! writers never let a reader's cursor pass an event it has not seen.

use super::support::*;
use crate::{Event, EventFilter};

async fn events(
    store: &DynStore,
    tenant: TenantId,
    filter: &EventFilter,
    after: i64,
) -> Vec<Event> {
    store
        .read_events(tenant, filter, after, 1000)
        .await
        .expect("read events")
}

/// `(kind, state or status)` of each event.
fn summary(events: &[Event]) -> Vec<(String, String)> {
    events
        .iter()
        .map(|e| {
            let state = e.data.get("state").or_else(|| e.data.get("status"));
            let state = state.and_then(|s| s.as_str()).unwrap_or("").to_string();
            (e.kind.clone(), state)
        })
        .collect()
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(k, s)| (k.to_string(), s.to_string()))
        .collect()
}

pub async fn events_of_task_and_agent_states(store: &DynStore) {
    let owner = tenant(store).await;
    let agent = register(store, owner.id, new_agent("evented")).await;
    store
        .record_heartbeats(&[heartbeat(&agent, AgentStatus::Online, now())])
        .await
        .expect("heartbeat");
    let generation = session(store, &agent, now()).await;
    let task = create(store, new_task(owner.id, agent.id, now())).await;
    let (_, attempt) = claimed(store, &agent, generation, now()).await;
    recorded(
        store,
        completion(
            &agent,
            generation,
            &attempt,
            AttemptResult::Succeeded,
            now(),
        ),
    )
    .await;

    let all = events(store, owner.id, &EventFilter::default(), 0).await;
    assert_eq!(
        summary(&all),
        pairs(&[
            ("agent.registered", "registered"),
            ("agent.status", "online"),
            ("task.state", "pending"),
            ("task.state", "leased"),
            ("task.state", "succeeded"),
        ])
    );
    assert!(all.windows(2).all(|w| w[0].id < w[1].id), "ids ascend");
    assert!(all.iter().all(|e| e.tenant_id == owner.id));
    let last = all.last().expect("events");
    assert_eq!(last.task_id, Some(task.id));
    assert_eq!(last.agent_id, Some(agent.id));
    assert_eq!(last.data["taskId"], task.id.to_string());
    assert_eq!(last.data["attempts"], 1);
    assert_eq!(last.data["readBack"], false);

    // After a cursor: only what follows it; a limit cuts the page.
    let after = events(store, owner.id, &EventFilter::default(), all[2].id).await;
    assert_eq!(after, all[3..].to_vec());
    let page = store
        .read_events(owner.id, &EventFilter::default(), 0, 2)
        .await
        .expect("read a page");
    assert_eq!(page, all[..2].to_vec());

    // Filters: a task's events; an agent's own and its tasks'.
    let by_task = EventFilter {
        task: Some(task.id),
        ..EventFilter::default()
    };
    assert_eq!(
        events(store, owner.id, &by_task, 0).await,
        all[2..].to_vec()
    );
    let other = register(store, owner.id, new_agent("quiet")).await;
    let by_agent = EventFilter {
        agent: Some(agent.id),
        ..EventFilter::default()
    };
    assert_eq!(events(store, owner.id, &by_agent, 0).await, all);

    // Cancelling and deleting are events too.
    let cancelled = create(store, new_task(owner.id, other.id, now())).await;
    store
        .cancel_task(owner.id, cancelled.id, operator(), now())
        .await
        .expect("cancel")
        .expect("task exists");
    assert!(store
        .delete_agent(owner.id, other.id, operator(), now())
        .await
        .expect("delete"));
    let by_other = EventFilter {
        agent: Some(other.id),
        ..EventFilter::default()
    };
    assert_eq!(
        summary(&events(store, owner.id, &by_other, 0).await),
        pairs(&[
            ("agent.registered", "registered"),
            ("task.state", "pending"),
            ("task.state", "cancelled"),
            ("agent.deleted", ""),
        ])
    );
}

pub async fn events_tenant_isolation(store: &DynStore) {
    let owner = tenant(store).await;
    let intruder = tenant(store).await;
    let agent = register(store, owner.id, new_agent("private")).await;
    let task = create(store, new_task(owner.id, agent.id, now())).await;

    assert!(!events(store, owner.id, &EventFilter::default(), 0)
        .await
        .is_empty());
    for filter in [
        EventFilter::default(),
        EventFilter {
            task: Some(task.id),
            ..EventFilter::default()
        },
        EventFilter {
            agent: Some(agent.id),
            ..EventFilter::default()
        },
    ] {
        assert!(
            events(store, intruder.id, &filter, 0).await.is_empty(),
            "{filter:?}"
        );
    }
}

pub async fn events_latest_id(store: &DynStore) {
    let owner = tenant(store).await;
    let other = tenant(store).await;
    assert_eq!(store.latest_event_id(owner.id).await.expect("latest"), 0);
    let agent = register(store, owner.id, new_agent("latest")).await;
    let latest = store.latest_event_id(owner.id).await.expect("latest");
    let seen = events(store, owner.id, &EventFilter::default(), 0).await;
    assert_eq!(seen.last().map(|e| e.id), Some(latest));
    assert!(events(store, owner.id, &EventFilter::default(), latest)
        .await
        .is_empty());
    create(store, new_task(owner.id, agent.id, now())).await;
    let after = events(store, owner.id, &EventFilter::default(), latest).await;
    assert!(
        !after.is_empty(),
        "a change after the cursor is read after it"
    );
    assert_eq!(store.latest_event_id(other.id).await.expect("other"), 0);
}

pub async fn events_wake_readers(store: &DynStore) {
    let owner = tenant(store).await;
    let agent = register(store, owner.id, new_agent("waking")).await;
    let seen = events(store, owner.id, &EventFilter::default(), 0).await;
    let cursor = seen.last().expect("registered").id;
    let mut written = store.events_written();
    written.borrow_and_update();
    let task = create(store, new_task(owner.id, agent.id, now())).await;
    tokio::time::timeout(std::time::Duration::from_secs(30), written.changed())
        .await
        .expect("woken within 30 s")
        .expect("store alive");
    let new = events(store, owner.id, &EventFilter::default(), cursor).await;
    assert_eq!(new.len(), 1);
    assert_eq!(new[0].task_id, Some(task.id));
}

/// Concurrent writers and a reader that follows with a cursor: the reader ends up with every
/// event exactly once. On PostgreSQL a sequence value taken by a transaction that commits later
/// than a higher one would be skipped; ids are numbered at commit for this.
pub async fn events_cursor_never_skips(store: &DynStore) {
    let owner = tenant(store).await;
    let agent = register(store, owner.id, new_agent("busy")).await;
    const WRITERS: usize = 8;
    const TASKS: usize = 25;
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                for _ in 0..TASKS {
                    create(&store, new_task(owner.id, agent.id, now())).await;
                }
            })
        })
        .collect();
    let filter = EventFilter::default();
    let mut seen: Vec<i64> = Vec::new();
    let mut cursor = 0;
    let expected = 1 + WRITERS * TASKS;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while seen.len() < expected {
        assert!(
            std::time::Instant::now() < deadline,
            "saw {} events",
            seen.len()
        );
        let batch = store
            .read_events(owner.id, &filter, cursor, 7)
            .await
            .expect("read");
        if let Some(last) = batch.last() {
            cursor = last.id;
        } else {
            tokio::task::yield_now().await;
        }
        seen.extend(batch.iter().map(|e| e.id));
    }
    for writer in writers {
        writer.await.expect("writer");
    }
    let all: Vec<i64> = events(store, owner.id, &filter, 0)
        .await
        .iter()
        .map(|e| e.id)
        .collect();
    assert_eq!(seen, all, "the follower saw every event once, in order");
}
