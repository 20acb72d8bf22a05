//! The task path's races that only PostgreSQL has (issue 29 item 2's cordon race, item 4's
//! abandoned claim), on a real server: a throwaway database on `BERTH_TEST_POSTGRES_URL`'s
//! server, stores of this crate on it, and a raw connection that holds row locks to make a batch
//! busy exactly when the test needs it. Without the variable they skip, except where services
//! are required (`CI=true`, `BERTH_REQUIRE_SERVICES=1`), where they fail.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use berth_proto::admin::Role;
use berth_proto::agent::AgentHold;
use berth_proto::audit::AuditActor;
use berth_proto::AgentId;
use berth_store::conformance::{agent_in_session, task_for};
use berth_store::{
    Agent, ClaimOutcome, CreateTaskOutcome, DynStore, PayloadKey, PostgresStore, Task,
};
use berth_test_utils::postgres::{admin_url, TestDatabase};
use sqlx::{Connection, PgConnection};
use time::OffsetDateTime;

const GRACE: Duration = Duration::from_secs(30);
/// Generous for a loaded 2-core machine; every wait ends as soon as its condition holds.
const DEADLINE: Duration = Duration::from_secs(30);

fn key() -> PayloadKey {
    static KEY: std::sync::LazyLock<PayloadKey> =
        std::sync::LazyLock::new(|| PayloadKey::new(berth_crypto::MasterKey::generate()));
    KEY.clone()
}

async fn replica(database: &TestDatabase) -> DynStore {
    Arc::new(
        PostgresStore::connect(&database.url, key())
            .await
            .expect("connect postgres"),
    )
}

/// A wait on a condition: the caller checks it in a loop and ticks between checks; a tick past
/// the deadline panics with what was awaited.
struct Deadline(tokio::time::Instant);

impl Deadline {
    fn start() -> Deadline {
        Deadline(tokio::time::Instant::now() + DEADLINE)
    }

    async fn tick(&self, what: &str) {
        assert!(
            tokio::time::Instant::now() < self.0,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Backends of `database` waiting for a lock, seen from the server's own database.
async fn lock_waiters(admin: &mut PgConnection, database: &TestDatabase) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
    )
    .bind(&database.name)
    .fetch_one(admin)
    .await
    .expect("count lock waiters")
}

async fn claim(store: &DynStore, agent: &Agent, generation: i64) -> ClaimOutcome {
    store
        .claim_task(
            agent.id,
            generation,
            agent.certificate_fingerprint.as_deref().expect("bound"),
            &[
                "docker".to_string(),
                "compose".to_string(),
                "ssh".to_string(),
            ],
            false,
            OffsetDateTime::now_utc(),
            GRACE,
        )
        .await
        .expect("claim task")
}

async fn created(store: &DynStore, agent: &Agent) -> Task {
    match store.create_task(task_for(agent)).await.expect("create") {
        CreateTaskOutcome::Created(task) => task,
        other => panic!("expected a new task, got {other:?}"),
    }
}

/// The agent's tasks, counted in a statement of its own (a fresh snapshot).
async fn tasks_of(reader: &mut PgConnection, agent: AgentId) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM tasks WHERE agent_id = $1")
        .bind(agent.0)
        .fetch_one(reader)
        .await
        .expect("count tasks")
}

/// The states the task went through, from its `task.state` events.
async fn states_of(conn: &mut PgConnection, task: &Task) -> Vec<String> {
    sqlx::query_scalar(
        "SELECT data->>'state' FROM events WHERE task_id = $1 AND kind = 'task.state' ORDER BY id",
    )
    .bind(task.id.0)
    .fetch_all(conn)
    .await
    .expect("task events")
}

/// Holds `agents`' rows `FOR UPDATE` on `conn` until the returned transaction ends: a claim of
/// one of them blocks in its batch, under its agent-row lock, with its worker.
async fn hold_rows<'c>(
    conn: &'c mut PgConnection,
    agents: &[AgentId],
) -> sqlx::Transaction<'c, sqlx::Postgres> {
    let mut tx = conn.begin().await.expect("begin");
    let ids: Vec<uuid::Uuid> = agents.iter().map(|a| a.0).collect();
    sqlx::query("SELECT 1 FROM agents WHERE id = ANY($1) FOR UPDATE")
        .bind(&ids)
        .execute(&mut *tx)
        .await
        .expect("lock agent rows");
    tx
}

/// A poll that goes away while its claim waits in a PostgreSQL batch must not leave its task
/// leased to nobody until the lease runs out (the task's timeout plus the grace): whether it
/// went while queued behind busy workers (the call is withdrawn) or while its own batch ran (the
/// lease is released at once), another poll claims the task right away, and the lost claim
/// spent no attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_claim_leaves_its_task_claimable_at_once() {
    let Some(admin) = admin_url("postgres abandoned claim") else {
        return;
    };
    let database = TestDatabase::create(&admin);
    let mut watcher = PgConnection::connect(&admin).await.expect("admin");
    let mut locker = PgConnection::connect(&database.url).await.expect("locker");
    let store = replica(&database).await;

    // Queued while both claim workers are busy: each blocked on a row this test holds.
    let mut busy = Vec::new();
    for name in ["busy-1", "busy-2"] {
        let (agent, generation) = agent_in_session(&store, name).await;
        created(&store, &agent).await;
        busy.push((agent, generation));
    }
    let (target, generation) = agent_in_session(&store, "target").await;
    let task = created(&store, &target).await;
    let held = hold_rows(&mut locker, &[busy[0].0.id, busy[1].0.id]).await;
    let mut blocked = Vec::new();
    for (n, (agent, generation)) in busy.iter().cloned().enumerate() {
        let store = store.clone();
        // One at a time, so each is a batch of its own on a worker of its own.
        blocked.push(tokio::spawn(async move {
            claim(&store, &agent, generation).await
        }));
        let deadline = Deadline::start();
        while lock_waiters(&mut watcher, &database).await != n as i64 + 1 {
            deadline
                .tick("a claim batch blocked on its agent row")
                .await;
        }
    }
    let gone = tokio::time::timeout(
        Duration::from_millis(200),
        claim(&store, &target, generation),
    )
    .await;
    assert!(gone.is_err(), "the poll queued behind the busy workers");
    held.rollback().await.expect("release the rows");
    for claim in blocked {
        assert!(matches!(
            claim.await.expect("join"),
            ClaimOutcome::Claimed(..)
        ));
    }
    match claim(&store, &target, generation).await {
        ClaimOutcome::Claimed(claimed, _) => {
            assert_eq!(claimed.id, task.id);
            assert_eq!(claimed.attempts, 1, "the withdrawn claim spent no attempt");
        }
        other => panic!("the task is claimable at once, got {other:?}"),
    }
    // Withdrawn, not run and undone: the task was leased once, by the poll that is still there.
    assert_eq!(
        states_of(&mut locker, &task).await,
        ["pending", "leased"],
        "the withdrawn call never ran"
    );

    // Gone while its own batch ran: the batch commits the lease, and it is released at once.
    let (target, generation) = agent_in_session(&store, "target-running").await;
    let task = created(&store, &target).await;
    let held = hold_rows(&mut locker, &[target.id]).await;
    let running = tokio::spawn({
        let store = store.clone();
        let target = target.clone();
        async move { claim(&store, &target, generation).await }
    });
    let deadline = Deadline::start();
    while lock_waiters(&mut watcher, &database).await != 1 {
        deadline
            .tick("the claim's batch blocked on its agent row")
            .await;
    }
    running.abort();
    assert!(running.await.is_err_and(|e| e.is_cancelled()));
    held.rollback().await.expect("release the row");
    let deadline = Deadline::start();
    let reclaimed = loop {
        if let ClaimOutcome::Claimed(claimed, _) = claim(&store, &target, generation).await {
            break claimed;
        }
        deadline.tick("the undelivered lease released").await;
    };
    assert_eq!(reclaimed.id, task.id);
    assert_eq!(
        reclaimed.attempts, 1,
        "the undelivered claim spent no attempt"
    );
    let (_, attempts) = store
        .get_task(task.tenant_id, task.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(attempts.len(), 1, "only the delivery that was handed out");
    assert_eq!(
        states_of(&mut locker, &task).await,
        ["pending", "leased", "pending", "leased"],
        "leased by the batch, released, leased again"
    );
    drop(store);
    drop(database);
}

/// A cordon and a stream of creates for its agent on two replicas of one database: once the
/// cordon's call has returned, no create that starts later lands on the agent, and no create
/// commits after the cordon did (a snapshot taken just after the cordon's answer sees every
/// task the agent will ever get). Several rounds, as the race is a window of milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cordon_admits_no_create_that_commits_after_it() {
    const ROUNDS: usize = 8;
    const CREATORS_PER_REPLICA: usize = 8;
    let Some(admin) = admin_url("postgres cordon race") else {
        return;
    };
    let database = TestDatabase::create(&admin);
    let replicas = [replica(&database).await, replica(&database).await];
    let mut reader = PgConnection::connect(&database.url).await.expect("reader");
    let actor = AuditActor::Token {
        id: uuid::Uuid::nil(),
        name: "operator".to_string(),
        role: Role::Admin,
    };
    let mut late = Vec::new();
    for round in 0..ROUNDS {
        let (agent, _) = agent_in_session(&replicas[0], &format!("cordoned-{round}")).await;
        let answered = Arc::new(AtomicBool::new(false));
        let created = Arc::new(AtomicUsize::new(0));
        let mut creators = Vec::new();
        for i in 0..2 * CREATORS_PER_REPLICA {
            let store = replicas[i % 2].clone();
            let (agent, answered, created) = (agent.clone(), answered.clone(), created.clone());
            creators.push(tokio::spawn(async move {
                loop {
                    let after_cordon = answered.load(Ordering::SeqCst);
                    match store.create_task(task_for(&agent)).await.expect("create") {
                        CreateTaskOutcome::Created(task) => {
                            assert!(
                                !after_cordon,
                                "a create that started after the cordon's answer landed: {}",
                                task.id
                            );
                            created.fetch_add(1, Ordering::SeqCst);
                        }
                        CreateTaskOutcome::AgentCordoned if after_cordon => return,
                        CreateTaskOutcome::AgentCordoned => {}
                        other => panic!("unexpected create outcome {other:?}"),
                    }
                }
            }));
        }
        let deadline = Deadline::start();
        while created.load(Ordering::SeqCst) < 10 {
            deadline.tick("creates under way").await;
        }
        let cordoned = replicas[round % 2]
            .set_agent_hold(
                agent.tenant_id,
                agent.id,
                AgentHold::Cordon,
                actor.clone(),
                OffsetDateTime::now_utc(),
            )
            .await
            .expect("cordon")
            .expect("agent");
        assert!(cordoned.cordoned);
        // A statement of its own: its snapshot is taken after the cordon committed.
        let at_cordon = tasks_of(&mut reader, agent.id).await;
        answered.store(true, Ordering::SeqCst);
        for creator in creators {
            creator.await.expect("creator");
        }
        let in_the_end = tasks_of(&mut reader, agent.id).await;
        if in_the_end != at_cordon {
            late.push((round, in_the_end - at_cordon));
        }
    }
    assert_eq!(
        late,
        vec![],
        "(round, creates committed after the cordon's commit)"
    );
    drop(replicas);
    drop(database);
}
