//! End-to-end tests of `agent-task-transport/v1` with real processes: `berth server` (SQLite, or
//! two replicas on PostgreSQL), `berth-agent`s with temp state and sticker dirs, and the admin CLI
//! (`berth task … -o json`). Bulk work goes through the typed API client.
//!
//! Effects are counted on the agents' side: the `write-sticker` executor appends one JSON line
//! (with `taskId`) to `<sticker-dir>/history.log` per execution.

#![cfg(unix)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_client::{Client, ClientError};
use berth_proto::event::{EventQuery, EventView, TASK_STATE};
use berth_proto::task::{CreateTask, GetTask, ListTasks, TaskView};
use berth_proto::transport::{
    AcquireSession, AgentTaskAssignment, AgentTaskPollRequest, AgentTaskResultEnvelope,
    SealedAssignment, SealedBox, SubmitResult, ALG_ECDSA_SHA256, CONTRACT_VERSION,
    GENERATION_HEADER, LOGS_SEAL_INFO,
};
use berth_proto::{AgentId, TaskId};
use berth_test_utils::postgres::{self, TestDatabase};
use common::*;
use serde_json::{json, Value};

/// How long a task may take to reach a state that needs only the agent and the sweeper.
const TASK: Duration = Duration::from_secs(60);

fn count(history: &[String], task_id: &str) -> usize {
    history.iter().filter(|t| *t == task_id).count()
}

/// The generation of the agent process's latest session, once it has logged one.
fn wait_generation(agent: &mut Proc, at_least: i64) -> i64 {
    wait_for(
        SETTLE,
        &format!("{} to acquire a session", agent.name),
        || {
            if let Some(status) = agent.try_status() {
                return Err(format!("exited {status}"));
            }
            match acquired_generations(&agent.stderr()).last() {
                Some(&g) if g >= at_least => Ok(g),
                _ => Err(agent.stderr()),
            }
        },
    )
}

/// Runs an `inspect` task to completion. Afterwards the agent's long-poll is fresh: it polls
/// again the moment it receives an assignment.
fn round_trip(server: &Server, agent_id: &str) {
    let task = server.create_task(agent_id, "inspect", &json!({}), Some(30));
    server.wait_task_state(&id_of(&task), TASK, "succeeded");
}

/// Stops the agent (SIGSTOP) while its long-poll is held on the server, then creates a task
/// with `create`: the server claims it into that held poll, so the task is `leased` to a process
/// that cannot act on it. Returns the task id with the agent still stopped.
///
/// Deterministic except for one case: the agent stopped between two polls (a window of
/// microseconds every 25 s). Then nothing claims the task; the agent is resumed, the task is
/// left to finish, and the sequence is tried again with a fresh `create(attempt)`.
fn lease_into_stopped_agent(
    server: &Server,
    agent: &mut Proc,
    agent_id: &str,
    create: &dyn Fn(usize) -> Value,
) -> String {
    for attempt in 0..3 {
        round_trip(server, agent_id);
        agent.signal(libc::SIGSTOP);
        let id = id_of(&create(attempt));
        let leased = try_wait_for(Duration::from_secs(15), || {
            let task = server.try_task(&id)?;
            if task["state"] == "leased" {
                Ok(task)
            } else {
                Err(task.to_string())
            }
        });
        if leased.is_ok() {
            return id;
        }
        eprintln!("note: the agent was stopped between two polls; trying again");
        agent.signal(libc::SIGCONT);
        server.wait_task(&id, TASK, "finished", |t| {
            !matches!(t["state"].as_str(), Some("pending" | "leased"))
        });
    }
    panic!("could not lease a task into the stopped agent in 3 tries");
}

/// The read-back (`read-sticker`) task the server scheduled for `task_id`.
fn wait_read_back(
    server: &Server,
    task_id: &str,
    what: &str,
    check: impl Fn(&Value) -> bool,
) -> Value {
    wait_for(TASK, &format!("the read-back of {task_id}: {what}"), || {
        let tasks = server.try_cli(&["task", "ls", "--type", "read-sticker"])?;
        let found = tasks
            .as_array()
            .into_iter()
            .flatten()
            .find(|t| t["readBackOf"] == task_id)
            .cloned();
        match found {
            Some(t) if check(&t) => Ok(t),
            _ => Err(tasks.to_string()),
        }
    })
}

// ---------------------------------------------------------------------------------------------
// 1. a paused agent: late results are fenced; lost leases resolve by the task's kind
// ---------------------------------------------------------------------------------------------

#[test]
fn paused_agent_drops_stale_assignments_and_lost_leases_resolve() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1", "--lease-grace-secs", "1"],
    );
    let mut agent = Agent::register(
        &server,
        tmp.path(),
        "paused-1",
        &["--retry-budget-secs", "120"],
    );
    let agent_id = agent.id.clone();
    let generation = wait_generation(&mut agent.proc, 1);

    // (b) A read-only task whose lease is lost is requeued, and runs again after SIGCONT. The
    // agent stays stopped past the lease (1 s timeout + 1 s grace) and 3 heartbeat intervals.
    // Resumed, it finds the delivery it holds expired and drops it without running it.
    let id = lease_into_stopped_agent(&server, &mut agent.proc, &agent_id, &|_| {
        server.create_task(&agent_id, "inspect", &json!({}), Some(1))
    });
    let requeued = server.wait_task_state(&id, TASK, "retry_wait");
    assert_eq!(attempts(&requeued)[0]["state"], "expired", "{requeued}");
    server.wait_agent(&agent_id, "the stopped agent offline", |a| {
        a["status"] == "offline"
    });
    agent.proc.signal(libc::SIGCONT);
    let done = server.wait_task_state(&id, TASK, "succeeded");
    let tries = attempts(&done);
    assert_eq!(tries.len(), 2, "{done}");
    assert_eq!(tries[0]["state"], "expired", "{done}");
    assert_eq!(tries[1]["state"], "succeeded", "{done}");
    assert_eq!(done["readBack"], false, "{done}");
    // Nobody else took the identity: the resumed process keeps its session.
    assert_eq!(tries[1]["generation"], generation, "{done}");
    wait_in_log(&mut agent.proc, &id, NOT_RUN);
    agent.wait_online(&server);
    agent.proc.assert_running();

    // (a) A side-effecting task leased into the stopped agent: the agent never confirmed its
    // start, so the lost lease provably did nothing and the task is requeued, not `unknown`.
    // Resumed, the agent drops the stale delivery unwritten; the next delivery writes it once.
    let id = lease_into_stopped_agent(&server, &mut agent.proc, &agent_id, &|n| {
        server.create_task(
            &agent_id,
            "write-sticker",
            &json!({"name": format!("paused-{n}")}),
            Some(1),
        )
    });
    let requeued = server.wait_task_state(&id, TASK, "retry_wait");
    assert_eq!(attempts(&requeued)[0]["state"], "expired", "{requeued}");
    assert_eq!(
        attempts(&requeued)[0]["startedAt"],
        Value::Null,
        "{requeued}"
    );
    assert_eq!(count(&agent.history(), &id), 0, "the stopped agent wrote");
    agent.proc.signal(libc::SIGCONT);
    let done = server.wait_task_state(&id, TASK, "succeeded");
    assert_eq!(done["readBack"], false, "{done}");
    let tries = attempts(&done);
    assert_eq!(tries.len(), 2, "{done}");
    assert!(tries[1]["startedAt"].is_string(), "{done}");
    assert_eq!(count(&agent.history(), &id), 1, "executions of {id}");
    wait_in_log(&mut agent.proc, &id, NOT_RUN);
    assert!(
        server.tasks(&["--type", "read-sticker"]).is_empty(),
        "nothing was unknown, so nothing was read back"
    );

    // (a') The same, but the stopped process dies with its assignment (issue 9: 4 of 4 such
    // tasks stayed `unknown`): requeued, and the restarted process runs it once.
    let id = lease_into_stopped_agent(&server, &mut agent.proc, &agent_id, &|n| {
        server.create_task(
            &agent_id,
            "write-sticker",
            &json!({"name": format!("paused-lost-{n}")}),
            Some(1),
        )
    });
    server.wait_task_state(&id, TASK, "retry_wait");
    // Once it is offline its session lease has lapsed too, so a new process may start.
    server.wait_agent(&agent_id, "the stopped agent offline", |a| {
        a["status"] == "offline"
    });
    agent.proc.kill9();
    agent.proc = Agent::restart(
        &server.url,
        &agent.state_dir,
        &agent.sticker_dir,
        "paused-1 (restarted)",
        &["--retry-budget-secs", "120"],
    );
    let new_generation = wait_generation(&mut agent.proc, generation + 1);
    let done = server.wait_task_state(&id, TASK, "succeeded");
    assert_eq!(done["readBack"], false, "{done}");
    let tries = attempts(&done);
    assert_eq!(tries.len(), 2, "{done}");
    assert_eq!(tries[1]["generation"], new_generation, "{done}");
    assert_eq!(count(&agent.history(), &id), 1, "executions of {id}");
    agent.proc.assert_running();
}

/// Issue 9's reproduction: an agent stopped (SIGSTOP) with a `write-sticker` of release r1
/// leased into its long-poll; a second process on the same state dir takes the session once the
/// first one's lapses, runs r1 (its lease lost unstarted, so requeued) and then r2. Resumed, the
/// first process must not write r1 over r2: its start is refused (or its lease has expired on
/// its own clock), and it exits fenced. The host runs what the server says: r2.
#[test]
fn a_paused_agent_fenced_by_a_newer_process_never_writes_over_it() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1", "--lease-grace-secs", "5"],
    );
    let mut old = Agent::register(
        &server,
        tmp.path(),
        "site-host",
        &["--retry-budget-secs", "120"],
    );
    let first = wait_generation(&mut old.proc, 1);
    let release = |r: &str| json!({"name": "site", "releaseId": r});
    let r1 = lease_into_stopped_agent(&server, &mut old.proc, &old.id, &|_| {
        server.create_task(&old.id, "write-sticker", &release("r1"), Some(5))
    });

    let state_dir = old.state_dir.clone();
    let mut new = Agent::restart(
        &server.url,
        &state_dir,
        &old.sticker_dir,
        "site-host (second process)",
        &["--retry-budget-secs", "120"],
    );
    let taken = wait_generation(&mut new, first + 1);
    let done = server.wait_task_state(&r1, TASK, "succeeded");
    let tries = attempts(&done);
    assert_eq!(tries.len(), 2, "{done}");
    assert_eq!(tries[0]["startedAt"], Value::Null, "{done}");
    assert_eq!(tries[1]["generation"], taken, "{done}");
    let r2 = id_of(&server.create_task(&old.id, "write-sticker", &release("r2"), Some(5)));
    server.wait_task_state(&r2, TASK, "succeeded");

    old.proc.signal(libc::SIGCONT);
    let code = old.proc.wait_code(EXIT);
    let log = old.proc.stderr();
    assert_eq!(code, 1, "the fenced process's exit code:\n{log}");
    // It wrote nothing: it dropped its stale delivery, or (sharing the state dir) answered it
    // from the journal entry the new process made.
    assert_eq!(
        old.history(),
        vec![r1.clone(), r2.clone()],
        "one write each, by the new process, in order"
    );
    let sticker: Value = serde_json::from_str(
        &std::fs::read_to_string(old.sticker_dir.join("site.json")).expect("the sticker"),
    )
    .unwrap();
    assert_eq!(sticker["releaseId"], "r2", "{sticker}");
    new.assert_running();
}

// ---------------------------------------------------------------------------------------------
// 2. kill -9 of the server while 1,000 tasks run
// ---------------------------------------------------------------------------------------------

const CRASH_TASKS: usize = 1000;
const CREATORS: usize = 16;

fn retriable(e: &ClientError) -> bool {
    match e {
        ClientError::Transport { .. } | ClientError::Connect { .. } | ClientError::Decode(_) => {
            true
        }
        ClientError::Api { status, .. } => *status >= 500,
        ClientError::Config(_) => false,
    }
}

/// Creates task `n` with `Idempotency-Key: crash-<n>`, retrying through the server's crash
/// until the server acknowledges it; returns the acknowledged id.
async fn create_until_acknowledged(
    api: &Client,
    n: usize,
    agent: AgentId,
) -> Result<TaskId, String> {
    let request = CreateTask {
        task_type: "write-sticker".into(),
        agent_id: Some(agent),
        payload: json!({ "name": format!("t-{n}") }),
        timeout_seconds: Some(5),
        ..Default::default()
    };
    let key = format!("crash-{n}");
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        match api
            .send_with(
                &request,
                &[("idempotency-key", &key)],
                Some(Duration::from_secs(15)),
            )
            .await
        {
            Ok(task) => return Ok(task.id),
            Err(e) if retriable(&e) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(format!("creating task {n}: {e}")),
        }
    }
}

async fn list_all(api: &Client, task_type: Option<&str>) -> Result<Vec<TaskView>, ClientError> {
    let mut all = Vec::new();
    let mut cursor = None;
    loop {
        let page = api
            .send(&ListTasks {
                task_type: task_type.map(str::to_string),
                cursor,
                limit: Some(1000),
                ..Default::default()
            })
            .await?;
        all.extend(page.items);
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return Ok(all),
        }
    }
}

#[test]
fn server_kill_9_loses_no_task_and_runs_none_twice() {
    let tmp = tempdir();
    let data = tmp.path().join("data");
    // The port is chosen up front so the restarted server comes back where the agents look.
    let listen = format!("127.0.0.1:{}", free_port());
    let server_args = ["--heartbeat-interval-secs", "2", "--lease-grace-secs", "3"];
    let mut server = Server::start_at(&data, &listen, &server_args, None);
    let mut agents: Vec<Agent> = (0..3)
        .map(|i| {
            Agent::register(
                &server,
                tmp.path(),
                &format!("crash-{i}"),
                &["--max-concurrent-tasks", "8", "--retry-budget-secs", "240"],
            )
        })
        .collect();
    let agent_ids: Vec<AgentId> = agents
        .iter()
        .map(|a| AgentId(a.id.parse().expect("agent id")))
        .collect();
    let executed = |agents: &[Agent]| agents.iter().map(|a| a.history().len()).sum::<usize>();

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let api = server.api();
    let acknowledged: Arc<Mutex<BTreeMap<usize, TaskId>>> = Arc::default();
    let next = Arc::new(AtomicUsize::new(0));
    let creators: Vec<_> = (0..CREATORS)
        .map(|_| {
            let (api, acknowledged, next, agent_ids) = (
                api.clone(),
                acknowledged.clone(),
                next.clone(),
                agent_ids.clone(),
            );
            rt.spawn(async move {
                loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    if n >= CRASH_TASKS {
                        return Ok::<(), String>(());
                    }
                    let id = create_until_acknowledged(&api, n, agent_ids[n % 3]).await?;
                    acknowledged.lock().unwrap().insert(n, id);
                }
            })
        })
        .collect();

    // kill -9 while tasks run (and, usually, while others are still being created), then
    // restart on the same data dir and port.
    wait_for(Duration::from_secs(180), "tasks to be running", || {
        let n = executed(&agents);
        if n >= 50 {
            Ok(())
        } else {
            Err(format!("{n} executed"))
        }
    });
    let started = Instant::now();
    server.proc.kill9();
    let at_kill = (acknowledged.lock().unwrap().len(), executed(&agents));
    server = Server::start_at(&data, &listen, &server_args, None);
    let downtime = started.elapsed();

    for creator in creators {
        rt.block_on(creator)
            .expect("creator task")
            .unwrap_or_else(|e| panic!("{e}"));
    }
    let acknowledged = acknowledged.lock().unwrap().clone();
    assert_eq!(acknowledged.len(), CRASH_TASKS);

    // Until nothing is queued, running or waiting to retry (read-backs included).
    let settled = wait_for(Duration::from_secs(240), "every task to settle", || {
        let all = rt
            .block_on(list_all(&api, None))
            .map_err(|e| e.to_string())?;
        let open = all
            .iter()
            .filter(|t| matches!(t.state.as_str(), "pending" | "leased" | "retry_wait"))
            .count();
        if open > 0 {
            return Err(format!("{open} of {} tasks open", all.len()));
        }
        // A read-back's verdict is recorded right after its result.
        let verdicts_due = all
            .iter()
            .filter(|rb| {
                rb.read_back_of.is_some() && rb.state == berth_proto::task::TaskState::Succeeded
            })
            .filter_map(|rb| all.iter().find(|t| Some(t.id) == rb.read_back_of))
            .filter(|parent| {
                parent.state == berth_proto::task::TaskState::Unknown && parent.result.is_none()
            })
            .count();
        if verdicts_due > 0 {
            return Err(format!("{verdicts_due} read-back verdicts pending"));
        }
        Ok(all)
    });
    server.proc.assert_running();
    for agent in &mut agents {
        agent.proc.assert_running();
    }

    let tasks: BTreeMap<TaskId, &TaskView> = settled
        .iter()
        .filter(|t| t.task_type == "write-sticker")
        .map(|t| (t.id, t))
        .collect();
    // Every acknowledged task exists; there is no other (the idempotency keys held).
    let acked_ids: BTreeSet<TaskId> = acknowledged.values().copied().collect();
    assert_eq!(
        acked_ids.len(),
        CRASH_TASKS,
        "two keys acknowledged one task"
    );
    let missing: Vec<_> = acked_ids
        .iter()
        .filter(|id| !tasks.contains_key(id))
        .collect();
    assert!(missing.is_empty(), "acknowledged tasks lost: {missing:?}");
    let extra: Vec<_> = tasks.keys().filter(|id| !acked_ids.contains(id)).collect();
    assert!(extra.is_empty(), "tasks nobody acknowledged: {extra:?}");

    // Executions, by task, with the agent that ran each.
    let mut runs: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for agent in &agents {
        for task_id in agent.history() {
            runs.entry(task_id).or_default().push(agent.id.clone());
        }
    }
    let twice: Vec<_> = runs.iter().filter(|(_, by)| by.len() > 1).collect();
    assert!(twice.is_empty(), "tasks executed more than once: {twice:?}");

    let (mut by_result, mut by_read_back, mut unknown, mut unknown_ran) = (0, 0, 0, 0);
    for task in tasks.values() {
        let id = task.id.to_string();
        let ran = runs.get(&id);
        if let Some(by) = ran {
            assert_eq!(
                by[0],
                task.agent_id.to_string(),
                "{id} ran on another agent"
            );
        }
        match (task.state.as_str(), task.read_back) {
            ("succeeded", false) => {
                by_result += 1;
                assert!(ran.is_some(), "{id} succeeded without running: {task:?}");
            }
            ("succeeded", true) => {
                by_read_back += 1;
                assert!(
                    ran.is_some(),
                    "{id} succeeded by read-back without running: {task:?}"
                );
                let result = task.result.as_ref().expect("read-back evidence");
                assert_eq!(result["sticker"]["taskId"], id.as_str(), "{task:?}");
            }
            ("unknown", false) => {
                unknown += 1;
                unknown_ran += usize::from(ran.is_some());
            }
            _ => panic!(
                "task {id} ended {} (readBack {}): {task:?}",
                task.state, task.read_back
            ),
        }
    }
    let read_backs = settled.iter().filter(|t| t.read_back_of.is_some()).count();
    println!(
        "crash test: {CRASH_TASKS} tasks acknowledged; killed after {} acknowledged / {} executed; \
         down {downtime:?}; succeeded by result {by_result}, by read-back {by_read_back}, \
         unknown {unknown} ({unknown_ran} of them ran); read-backs {read_backs}; \
         executions {} (none twice)",
        at_kill.0,
        at_kill.1,
        runs.len()
    );
    // Every execution the agents recorded is of an acknowledged task: nothing ran under an id
    // the server never acknowledged (a duplicate created behind a lost answer, say).
    let acknowledged_ids: BTreeSet<String> = tasks.keys().map(TaskId::to_string).collect();
    let foreign: Vec<_> = runs
        .keys()
        .filter(|id| !acknowledged_ids.contains(*id))
        .collect();
    assert!(
        foreign.is_empty(),
        "executions of tasks nobody acknowledged: {foreign:?}"
    );
    // The kill fell mid-run, and the restarted server carried the rest: tasks ran after it.
    assert!(
        at_kill.1 < CRASH_TASKS && runs.len() > at_kill.1,
        "{} executions at the kill, {} in all: the kill did not interrupt running work",
        at_kill.1,
        runs.len()
    );
}

// ---------------------------------------------------------------------------------------------
// 2b. kill -9 of the server between the steps of a read-back
// ---------------------------------------------------------------------------------------------

/// Waits until the server has killed itself at its crash point (`BERTH_FAULT_CRASH_AFTER`).
fn wait_crashed(server: &mut Server, point: &str) {
    use std::os::unix::process::ExitStatusExt;
    let status = server.proc.wait_exit(TASK);
    let log = server.proc.stderr();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}:\n{log}");
    assert!(
        log.contains(&format!("BERTH_FAULT_CRASH_AFTER={point}: kill -9")),
        "not killed at {point}:\n{log}"
    );
}

/// Read-back is a reconciler: each of its steps survives a kill -9 of the server right after
/// the step before it committed. The server is killed (1) right after a lost lease made a
/// write-sticker `unknown`, before its read-back was scheduled, and (2) right after the
/// read-back's result was recorded, before the verdict. Each restart completes the work, and
/// only the read-back sweep can: the calls right after those commits never ran, and the agent
/// is gone before the last start. The agent that held the assignment dies with it, so the
/// sticker is not there: the verdict keeps the task `unknown`, with the read-back as evidence.
#[test]
fn read_back_completes_after_kill_9_of_the_server_between_its_steps() {
    let tmp = tempdir();
    let data = tmp.path().join("data");
    // The port is chosen up front so each restarted server comes back where the agent looks.
    let listen = format!("127.0.0.1:{}", free_port());
    let args = ["--heartbeat-interval-secs", "1", "--lease-grace-secs", "1"];
    let crashing = |point: &str| {
        Server::start_with_env(
            &data,
            &listen,
            &args,
            None,
            &[("BERTH_FAULT_CRASH_AFTER", point)],
        )
    };
    let agent_args = ["--retry-budget-secs", "240"];

    // (1) The lease of a write-sticker runs out (1 s timeout + 1 s grace) in a seed 000 agent:
    // one that does not promise the start handshake, so its lost delivery may have run and the
    // task becomes `unknown` (berth-agent's never-started deliveries are requeued instead). The
    // agent's identity, driven by hand once berth-agent is killed; the server dies as the task
    // becomes `unknown`.
    let mut server = crashing("lease-expiry");
    let mut agent = Agent::register(&server, tmp.path(), "crash-read-back", &agent_args);
    let agent_id = agent.id.clone();
    wait_generation(&mut agent.proc, 1);
    agent.proc.kill9();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let seed_agent = agent_client(&server, &agent.state_dir);
    let typed_id = AgentId(agent_id.parse().unwrap());
    let acquire = AcquireSession {
        agent_id: typed_id,
        instance_id: "seed-000-agent".into(),
        boot_id: None,
        lock: None,
        version: None,
    };
    // Held until the killed process's session lease (3 intervals) lapses.
    let generation = wait_for(TASK, "the seed agent's session", || {
        rt.block_on(seed_agent.send(&acquire))
            .map(|s| s.generation)
            .map_err(|e| e.to_string())
    });
    let id = id_of(&server.create_task(
        &agent_id,
        "write-sticker",
        &json!({"name": "crash-read-back"}),
        Some(1),
    ));
    let poll = AgentTaskPollRequest {
        contract_version: CONTRACT_VERSION.into(),
        agent_id: typed_id,
        capabilities: vec![],
        start_handshake: false,
    };
    let header = generation.to_string();
    let leased = rt
        .block_on(seed_agent.send_with(&poll, &[(GENERATION_HEADER, &header)], None))
        .expect("poll")
        .assignment
        .expect("the write-sticker");
    assert_eq!(leased.task_id.to_string(), id);
    wait_crashed(&mut server, "lease-expiry");

    // (2) Restarted, the sweep schedules the read-back; a new agent process runs it and finds
    // no sticker; the server dies as the read-back's result is recorded, before the verdict.
    server = crashing("read-back-result");
    agent.proc = Agent::restart(
        &server.url,
        &agent.state_dir,
        &agent.sticker_dir,
        "crash-read-back (restarted)",
        &agent_args,
    );
    wait_generation(&mut agent.proc, generation + 1);
    wait_crashed(&mut server, "read-back-result");
    // Without the agent, only the restarted server can decide the task.
    agent.proc.kill9();

    server = Server::start_at(&data, &listen, &args, None);
    let decided = server.wait_task(&id, TASK, "the read-back's verdict", |t| {
        t["result"]["found"].is_boolean()
    });
    assert_eq!(decided["state"], "unknown", "{decided}");
    assert_eq!(decided["readBack"], false, "{decided}");
    assert_eq!(decided["result"]["found"], false, "{decided}");
    let read_back = wait_read_back(&server, &id, "succeeded", |t| t["state"] == "succeeded");
    assert_eq!(
        decided["result"]["readBackTaskId"], read_back["id"],
        "{decided}"
    );
    let read_backs = server
        .tasks(&["--type", "read-sticker"])
        .into_iter()
        .filter(|t| t["readBackOf"] == id.as_str())
        .count();
    assert_eq!(
        read_backs, 1,
        "one read-back per lost delivery, across restarts"
    );
    assert_eq!(
        attempts(&decided).len(),
        1,
        "re-run automatically: {decided}"
    );
    assert_eq!(count(&agent.history(), &id), 0, "the lost assignment ran");
    let log = server.proc.stderr();
    assert!(
        log.contains("read-back finished without a verdict"),
        "the verdict came from the sweep:\n{log}"
    );
    server.proc.assert_running();
}

// ---------------------------------------------------------------------------------------------
// 3. a cloned identity
// ---------------------------------------------------------------------------------------------

#[test]
fn cloned_identity_is_refused_then_takes_over_and_fences_the_original() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let mut original = Agent::register(&server, tmp.path(), "twin", &[]);
    let first = wait_generation(&mut original.proc, 1);

    // A copied state dir: the same key, certificate and agent id in a second process.
    let copy = tmp.path().join("twin-copy");
    std::fs::create_dir(&copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o700)).unwrap();
    for file in ["identity.json", "agent.pem", "ca.crt"] {
        std::fs::copy(original.state_dir.join(file), copy.join(file)).unwrap();
    }
    let mut clone = Agent::restart(
        &server.url,
        &copy,
        &tmp.path().join("twin-copy-stickers"),
        "twin (clone)",
        &["--retry-budget-secs", "120"],
    );

    // Refused while the original holds the session, and it keeps trying.
    wait_for(
        SETTLE,
        "the clone to be refused twice with SESSION_HELD",
        || {
            let log = clone.stderr();
            if let Some(status) = clone.try_status() {
                panic!("the clone gave up ({status}) instead of retrying:\n{log}");
            }
            let refusals = log.matches("SESSION_HELD").count();
            if refusals >= 2 {
                Ok(())
            } else {
                Err(format!("{refusals} refusals: {log}"))
            }
        },
    );
    server.wait_agent(
        &original.id,
        "the agent degraded while a clone contends",
        |a| a["status"] == "degraded",
    );
    original.proc.assert_running();
    assert!(
        acquired_generations(&clone.stderr()).is_empty(),
        "the clone acquired a held session:\n{}",
        clone.stderr()
    );

    // The original stops past its session lease (3 intervals): the clone takes over.
    original.proc.signal(libc::SIGSTOP);
    let taken = wait_generation(&mut clone, first + 1);
    let task = server.create_task(&original.id, "inspect", &json!({}), Some(30));
    let done = server.wait_task_state(&id_of(&task), TASK, "succeeded");
    assert_eq!(attempts(&done)[0]["generation"], taken, "{done}");

    // Resumed, the original finds it was fenced and exits 1.
    original.proc.signal(libc::SIGCONT);
    let resumed = Instant::now();
    let code = original.proc.wait_code(EXIT);
    let took = resumed.elapsed();
    let log = original.proc.stderr();
    assert_eq!(code, 1, "exit code of the fenced original:\n{log}");
    assert!(log.contains("FENCED"), "{log}");
    assert!(took < Duration::from_secs(15), "fenced exit took {took:?}");
    clone.assert_running();
    server.wait_agent(&original.id, "the agent online with the clone", |a| {
        a["status"] == "online"
    });
}

/// A started agent process on `state_dir` (this agent's sticker dir), with the host's boot id
/// read from `boot_id_file` instead of `/proc` when one is given (another "host").
fn agent_on(
    server: &Server,
    agent: &Agent,
    state_dir: &Path,
    name: &str,
    boot_id_file: Option<&Path>,
) -> Proc {
    let sticker_arg = agent.sticker_dir.display().to_string();
    let mut cmd = agent_command(
        state_dir,
        &[
            "--server",
            &server.url,
            "--sticker-dir",
            &sticker_arg,
            "--retry-budget-secs",
            "120",
        ],
    );
    if let Some(file) = boot_id_file {
        cmd.env("BERTH_AGENT_BOOT_ID_FILE", file);
    }
    Proc::spawn(&format!("berth-agent {name}"), cmd)
}

/// The distinct contender instances the server's ALERT lines name.
fn alerted_contenders(server_log: &str) -> BTreeSet<String> {
    server_log
        .lines()
        .filter(|l| l.contains("ALERT"))
        .filter_map(|l| {
            let rest = &l[l.find("contender=")? + "contender=".len()..];
            rest.split_whitespace().next().map(str::to_string)
        })
        .collect()
}

/// Waits until `contender` has been refused with SESSION_HELD (and keeps trying) and the server
/// has logged an ALERT naming a contender beyond the first `alerted` ones.
fn wait_refused_with_alert(server: &Server, contender: &mut Proc, alerted: usize) {
    wait_for(
        SETTLE,
        &format!(
            "{} to be refused with SESSION_HELD and an ALERT",
            contender.name
        ),
        || {
            let log = contender.stderr();
            if let Some(status) = contender.try_status() {
                panic!(
                    "{} gave up ({status}) instead of retrying:\n{log}",
                    contender.name
                );
            }
            let contenders = alerted_contenders(&server.proc.stderr());
            if log.contains("SESSION_HELD") && contenders.len() > alerted {
                Ok(())
            } else {
                Err(format!("alerts for {contenders:?}; contender log:\n{log}"))
            }
        },
    )
}

#[test]
fn restart_after_kill9_takes_the_session_back_at_once_without_an_alert() {
    let tmp = tempdir();
    // Lease: 3 intervals = 15 s. A kill -9 leaves at least 10 s of it; waiting that out is the
    // old behaviour.
    let mut server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "5"],
    );
    let mut agent = Agent::register(&server, tmp.path(), "phoenix", &[]);
    let first = wait_generation(&mut agent.proc, 1);

    for round in 1..=2 {
        agent.proc.kill9();
        let killed = Instant::now();
        agent.proc = agent_on(
            &server,
            &agent,
            &agent.state_dir.clone(),
            &format!("phoenix (restart {round})"),
            None,
        );
        let generation = wait_generation(&mut agent.proc, first + round);
        let took = killed.elapsed();
        assert_eq!(generation, first + round);
        assert!(
            took < Duration::from_secs(10),
            "the restart waited {took:?} for the dead process's lease:\n{}",
            agent.proc.stderr()
        );
        let log = agent.proc.stderr();
        assert!(
            !log.contains("SESSION_HELD"),
            "restart {round} was refused:\n{log}"
        );
        server.wait_agent(&agent.id, "the restarted agent online", |a| {
            a["status"] == "online" && a["lastHeartbeat"].is_string()
        });
    }
    round_trip(&server, &agent.id);
    let log = server.proc.stderr();
    assert!(
        !log.contains("ALERT"),
        "a restart raised a clone alert:\n{log}"
    );
    agent.proc.assert_running();
    server.proc.assert_running();
}

#[test]
fn a_copy_on_another_host_and_a_second_process_on_the_same_state_dir_are_refused() {
    let tmp = tempdir();
    let mut server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "5"],
    );
    let mut original = Agent::register(&server, tmp.path(), "solo", &[]);
    let first = wait_generation(&mut original.proc, 1);

    // The state dir copied to another host: another directory and another boot id.
    let copy = tmp.path().join("solo-copy");
    std::fs::create_dir(&copy).unwrap();
    std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o700)).unwrap();
    for entry in std::fs::read_dir(&original.state_dir).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
        }
    }
    let other_boot = tmp.path().join("other-boot-id");
    std::fs::write(&other_boot, "0f0e0d0c-0b0a-4908-8706-050403020100\n").unwrap();
    let mut elsewhere = agent_on(
        &server,
        &original,
        &copy,
        "solo (copy elsewhere)",
        Some(&other_boot),
    );
    wait_refused_with_alert(&server, &mut elsewhere, 0);
    server.wait_agent(
        &original.id,
        "the agent degraded while a copy contends",
        |a| a["status"] == "degraded",
    );
    elsewhere.kill9();

    // A second live process on the same state dir, on the same host: it cannot take the lock.
    let state_dir = original.state_dir.clone();
    let mut second = agent_on(&server, &original, &state_dir, "solo (second)", None);
    wait_refused_with_alert(&server, &mut second, 1);
    assert!(
        acquired_generations(&second.stderr()).is_empty()
            && acquired_generations(&elsewhere.stderr()).is_empty(),
        "a contender acquired a held session"
    );
    original.proc.assert_running();
    assert_eq!(acquired_generations(&original.proc.stderr()), vec![first]);
    server.proc.assert_running();
}

// ---------------------------------------------------------------------------------------------
// 4. executors that must refuse, and commands as argument vectors
// ---------------------------------------------------------------------------------------------

#[test]
fn unsupported_types_and_commands_off_the_allow_list_fail_closed() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let echo = program(&["/bin/echo", "/usr/bin/echo"]);
    let plain = Agent::register(&server, tmp.path(), "plain", &[]);
    let allowed = Agent::register(&server, tmp.path(), "allowed", &["--allow-command", &echo]);
    let marker = tmp.path().join("pwned");
    let touch = format!("touch {}", marker.display());

    // A type no agent runs is refused at create, before anything is queued.
    let refused = server
        .try_cli(&[
            "task",
            "create",
            "--agent",
            &plain.id,
            "--type",
            "docker.whatever",
            "--payload",
            "{}",
        ])
        .unwrap_err();
    assert!(
        refused.contains("422") && refused.contains("UNSUPPORTED_TASK_TYPE"),
        "{refused}"
    );
    let off = server.create_task(
        &plain.id,
        "execute-command",
        &json!({"command": [echo, "hi"]}),
        None,
    );
    let not_listed = server.create_task(
        &allowed.id,
        "execute-command",
        &json!({"command": ["/bin/sh", "-c", touch]}),
        None,
    );
    let literal_args = [
        "a;b".to_string(),
        format!("$({touch})"),
        format!("`{touch}`"),
        format!("x && {touch}"),
        "'q' \"d\" \\n".to_string(),
        "$HOME".to_string(),
        "|".to_string(),
        "*".to_string(),
    ];
    let mut argv = vec![echo.clone()];
    argv.extend(literal_args.iter().cloned());
    let echoed = server.create_task(
        &allowed.id,
        "execute-command",
        &json!({ "command": argv }),
        None,
    );

    for (task, code) in [
        (&off, "COMMAND_NOT_ALLOWED"),
        (&not_listed, "COMMAND_NOT_ALLOWED"),
    ] {
        let done = server.wait_task(&id_of(task), TASK, "finished", |t| {
            !matches!(t["state"].as_str(), Some("pending" | "leased"))
        });
        assert_eq!(done["state"], "failed", "{done}");
        assert_eq!(done["errorCode"], code, "{done}");
        assert_eq!(done["result"]["errorType"], code, "{done}");
        assert_eq!(done["attemptCount"], 1, "a refusal is not retried: {done}");
    }
    let done = server.wait_task(&id_of(&echoed), TASK, "finished", |t| {
        !matches!(t["state"].as_str(), Some("pending" | "leased"))
    });
    assert_eq!(done["state"], "succeeded", "{done}");
    let outputs = &done["result"]["outputs"];
    assert_eq!(outputs["exitCode"], 0, "{done}");
    assert_eq!(
        outputs["stdout"],
        format!("{}\n", literal_args.join(" ")),
        "arguments must reach the program verbatim: {done}"
    );
    assert!(!marker.exists(), "a shell ran: {} exists", marker.display());
}

// ---------------------------------------------------------------------------------------------
// 5 and 6. a timeout and a cancellation stop the process
// ---------------------------------------------------------------------------------------------

/// Starts a server and an agent allowed to run `sleep`; returns them with the sleep path.
fn sleepy(tmp: &Path, name: &str) -> (Server, Agent, String) {
    let sleep = program(&["/bin/sleep", "/usr/bin/sleep"]);
    let server = Server::start(&tmp.join("data"), &["--heartbeat-interval-secs", "1"]);
    let agent = Agent::register(&server, tmp, name, &["--allow-command", &sleep]);
    (server, agent, sleep)
}

fn wait_sleep_running(agent: &Agent) {
    wait_for(Duration::from_secs(30), "the agent's sleep child", || {
        if live_children(agent.proc.pid(), "sleep").is_empty() {
            Err("no sleep child".into())
        } else {
            Ok(())
        }
    });
}

fn wait_sleep_gone(agent: &Agent) {
    wait_for(
        Duration::from_secs(15),
        "the sleep child to be gone",
        || {
            let left = live_children(agent.proc.pid(), "sleep");
            if left.is_empty() {
                Ok(())
            } else {
                Err(format!("still running: {left:?}"))
            }
        },
    );
}

#[test]
fn a_command_past_its_timeout_is_killed_and_fails_with_timeout() {
    let tmp = tempdir();
    let (server, mut agent, sleep) = sleepy(tmp.path(), "timeout-1");
    let started = Instant::now();
    let task = server.create_task(
        &agent.id,
        "execute-command",
        &json!({"command": [sleep, "30"]}),
        Some(2),
    );
    wait_sleep_running(&agent);
    let done = server.wait_task(&id_of(&task), Duration::from_secs(40), "finished", |t| {
        !matches!(t["state"].as_str(), Some("pending" | "leased"))
    });
    let took = started.elapsed();
    assert_eq!(done["state"], "failed", "{done}");
    assert_eq!(done["errorCode"], "TIMEOUT", "{done}");
    assert_eq!(attempts(&done)[0]["state"], "failed", "{done}");
    assert!(
        took < Duration::from_secs(20),
        "a 2 s timeout ended after {took:?}"
    );
    wait_sleep_gone(&agent);
    agent.proc.assert_running();
    println!("timeout: task failed with TIMEOUT {took:?} after creation");
}

#[test]
fn cancelling_a_running_command_stops_it() {
    let tmp = tempdir();
    let (server, mut agent, sleep) = sleepy(tmp.path(), "cancel-1");
    let task = server.create_task(
        &agent.id,
        "execute-command",
        &json!({"command": [sleep, "30"]}),
        Some(120),
    );
    let id = id_of(&task);
    server.wait_task_state(&id, TASK, "leased");
    wait_sleep_running(&agent);

    let started = Instant::now();
    let requested = server.cli(&["task", "cancel", &id]);
    assert_eq!(requested["state"], "leased", "{requested}");
    assert_eq!(requested["cancelRequested"], true, "{requested}");
    let done = server.wait_task(&id, Duration::from_secs(40), "finished", |t| {
        !matches!(t["state"].as_str(), Some("pending" | "leased"))
    });
    let took = started.elapsed();
    assert_eq!(done["state"], "cancelled", "{done}");
    assert_eq!(attempts(&done)[0]["state"], "cancelled", "{done}");
    assert!(took < Duration::from_secs(20), "cancellation took {took:?}");
    wait_sleep_gone(&agent);
    agent.proc.assert_running();
    assert_transport(&mut agent);
    println!("cancel: task cancelled {took:?} after `berth task cancel`");
}

/// SIGTERM: the agent takes no new work, keeps its session (heartbeats) while the running task
/// finishes, then releases the session; a successor takes the queued task at once.
#[test]
fn sigterm_lets_a_running_task_finish_then_releases_the_session() {
    let tmp = tempdir();
    let sleep = program(&["/bin/sleep", "/usr/bin/sleep"]);
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let grace = [
        "--allow-command",
        sleep.as_str(),
        "--shutdown-grace-secs",
        "60",
    ];
    let mut agent = Agent::register(&server, tmp.path(), "graceful-1", &grace);
    let running = server.create_task(
        &agent.id,
        "execute-command",
        &json!({"command": [sleep, "6"]}),
        Some(120),
    );
    let running = id_of(&running);
    server.wait_task_state(&running, TASK, "leased");
    wait_sleep_running(&agent);

    agent.proc.signal(libc::SIGTERM);
    let stopping = Instant::now();
    let queued = server.create_task(
        &agent.id,
        "execute-command",
        &json!({"command": [sleep, "0"]}),
        Some(120),
    );
    let queued = id_of(&queued);
    // Past three heartbeat intervals the session would have lapsed without heartbeats.
    std::thread::sleep(Duration::from_secs(4).saturating_sub(stopping.elapsed()));
    assert!(
        !live_children(agent.proc.pid(), "sleep").is_empty(),
        "the running task was not given its grace"
    );
    let seen = server.wait_agent(&agent.id, "online", |a| a["status"].is_string());
    assert_eq!(seen["status"], "online", "heartbeats stopped: {seen}");

    assert_eq!(agent.proc.wait_code(Duration::from_secs(60)), 0);
    let done = server.task(&running);
    assert_eq!(done["state"], "succeeded", "{done}");
    assert_eq!(
        server.task(&queued)["state"],
        "pending",
        "a stopping agent took new work"
    );
    let log = agent.proc.stderr();
    assert!(log.contains("waiting for running tasks"), "{log}");
    assert!(log.contains("session released"), "{log}");

    // The released session is taken at once, not after its lease runs out.
    let mut successor = Agent::restart(
        &server.url,
        &agent.state_dir,
        &agent.sticker_dir,
        "graceful-1",
        &grace,
    );
    let took = Instant::now();
    server.wait_task(&queued, TASK, "succeeded", |t| t["state"] == "succeeded");
    println!(
        "graceful stop: successor ran the queued task {:?} after it started",
        took.elapsed()
    );
    assert!(
        !successor.stderr().contains("SESSION_HELD"),
        "{}",
        successor.stderr()
    );
    assert_eq!(successor.terminate(), 0);
}

/// SIGTERM with a task that outlives the grace: it is interrupted, reports `AGENT_STOPPED`
/// (not an operator's cancel), and the agent exits 0 soon after the grace.
#[test]
fn sigterm_past_the_grace_interrupts_the_task_and_reports_it() {
    let tmp = tempdir();
    let sleep = program(&["/bin/sleep", "/usr/bin/sleep"]);
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let mut agent = Agent::register(
        &server,
        tmp.path(),
        "graceful-2",
        &["--allow-command", &sleep, "--shutdown-grace-secs", "2"],
    );
    let task = server.create_task(
        &agent.id,
        "execute-command",
        &json!({"command": [sleep, "60"]}),
        Some(120),
    );
    let id = id_of(&task);
    server.wait_task_state(&id, TASK, "leased");
    wait_sleep_running(&agent);

    let stopping = Instant::now();
    agent.proc.signal(libc::SIGTERM);
    assert_eq!(agent.proc.wait_code(Duration::from_secs(40)), 0);
    let took = stopping.elapsed();
    assert!(
        took >= Duration::from_secs(2),
        "the grace was not given: {took:?}"
    );
    let done = server.wait_task(&id, TASK, "finished", |t| {
        !matches!(t["state"].as_str(), Some("pending" | "leased"))
    });
    assert_eq!(done["state"], "failed", "{done}");
    assert_eq!(done["errorCode"], "AGENT_STOPPED", "{done}");
    let log = agent.proc.stderr();
    assert!(log.contains("interrupted running tasks"), "{log}");
    assert!(
        log.contains(&id),
        "the interrupted task is not named: {log}"
    );
    assert!(log.contains("session released"), "{log}");
    println!("graceful stop: interrupted after the 2 s grace, exited {took:?} after SIGTERM");
}

/// The agent took its work, and this cancellation, over the transport this run names
/// (`BERTH_E2E_TASK_TRANSPORT`; unset: auto, which takes the stream berth offers).
fn assert_transport(agent: &mut Agent) {
    let log = agent.proc.stderr();
    let streamed = log.contains("task stream open");
    let fell_back = log.contains("long-polling");
    match std::env::var("BERTH_E2E_TASK_TRANSPORT").as_deref() {
        Ok("poll") => assert!(!streamed, "a polling agent opened the stream:\n{log}"),
        _ => assert!(
            streamed && !fell_back,
            "the agent did not use the stream:\n{log}"
        ),
    }
}

// ---------------------------------------------------------------------------------------------
// 7. two replicas on one PostgreSQL database
// ---------------------------------------------------------------------------------------------

fn api_wait_succeeded(rt: &tokio::runtime::Runtime, api: &Client, id: TaskId) -> TaskView {
    wait_for(TASK, &format!("task {id} to succeed"), || {
        let task = rt
            .block_on(api.send(&GetTask { id }))
            .map_err(|e| e.to_string())?;
        match task.state.as_str() {
            "succeeded" => Ok(task),
            "pending" | "leased" | "retry_wait" => Err(format!("{task:?}")),
            other => panic!("task {id} ended {other}: {task:?}"),
        }
    })
}

/// Two `berth server` replicas on one database (`args` name it). Replicas share nothing but
/// the database — and the key material, which is not in the database: the CA (agents pin it,
/// and each replica issues its server certificate from it), the JWT key, the master key
/// (credentials sealed by one replica are opened by another) and the sealing key (logs sealed
/// to the key one replica's session answer named are opened by another). So replica 2's data
/// dir starts as a copy of those five files of replica 1's.
fn two_replicas(root: &Path, args: &[&str]) -> (Server, Server) {
    let dir_1 = root.join("replica-1");
    let dir_2 = root.join("replica-2");
    let replica_1 = Server::start(&dir_1, args);
    std::fs::create_dir(&dir_2).unwrap();
    std::fs::set_permissions(&dir_2, std::fs::Permissions::from_mode(0o700)).unwrap();
    for file in ["ca.crt", "ca.key", "jwt.key", "master.key", "sealing.key"] {
        std::fs::copy(dir_1.join(file), dir_2.join(file)).unwrap();
    }
    let replica_2 = Server::start_at(&dir_2, "127.0.0.1:0", args, Some(&replica_1.admin_token));
    assert_eq!(replica_2.ca_fingerprint, replica_1.ca_fingerprint);
    assert!(
        !dir_2.join("admin.token").exists(),
        "the second replica minted another bootstrap token"
    );
    (replica_1, replica_2)
}

#[test]
fn two_replicas_on_postgres_wake_across_replicas_and_fence_together() {
    let Some(admin_url) =
        postgres::admin_url("two_replicas_on_postgres_wake_across_replicas_and_fence_together")
    else {
        return;
    };
    // Declared first, dropped last: after every server has been killed.
    let database = TestDatabase::create(&admin_url);
    let tmp = tempdir();
    let args = [
        "--heartbeat-interval-secs",
        "1",
        "--database",
        &database.url,
    ];

    let (replica_1, replica_2) = two_replicas(tmp.path(), &args);

    // The agent registers (and holds its first session) through replica 1, then runs against
    // replica 2: a new session, a new generation.
    let mut agent = Agent::register(&replica_1, tmp.path(), "pg-1", &[]);
    let stale = wait_generation(&mut agent.proc, 1);
    assert_eq!(agent.proc.terminate(), 0, "{}", agent.proc.stderr());
    agent.proc = Agent::restart(
        &replica_2.url,
        &agent.state_dir,
        &agent.sticker_dir,
        "pg-1 (on replica 2)",
        &["--retry-budget-secs", "60"],
    );
    let current = wait_generation(&mut agent.proc, stale + 1);
    agent.wait_online(&replica_1);

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    // Fencing holds across replicas: the generation replaced on replica 2 is refused by replica 1.
    let as_agent = agent_client(&replica_1, &agent.state_dir);
    let agent_id = AgentId(agent.id.parse().unwrap());
    let poll = AgentTaskPollRequest {
        contract_version: CONTRACT_VERSION.into(),
        agent_id,
        capabilities: vec![],
        start_handshake: false,
    };
    let stale_header = stale.to_string();
    let refused = rt
        .block_on(as_agent.send_with(&poll, &[(GENERATION_HEADER, &stale_header)], None))
        .expect_err("a poll with the replaced generation");
    assert_eq!(
        (refused.status(), refused.code()),
        (Some(409), Some("FENCED")),
        "{refused}"
    );

    // A task created through replica 1 is handed to the long-poll held on replica 2.
    let api = replica_1.api();
    let create = || CreateTask {
        task_type: "inspect".into(),
        agent_id: Some(agent_id),
        payload: json!({}),
        timeout_seconds: Some(30),
        ..Default::default()
    };
    let warm_up = rt.block_on(api.send(&create())).expect("create");
    api_wait_succeeded(&rt, &api, warm_up.id);
    let mut latencies = Vec::new();
    for _ in 0..5 {
        let created = rt.block_on(api.send(&create())).expect("create");
        let done = api_wait_succeeded(&rt, &api, created.id);
        let attempt = done.attempts.first().expect("an attempt");
        assert_eq!(attempt.generation, current, "{done:?}");
        let latency: Duration = (attempt.assigned_at - done.created_at)
            .try_into()
            .unwrap_or_default();
        latencies.push(latency);
    }
    latencies.sort();
    println!(
        "cross-replica wake (created on replica 1 → assigned on replica 2): min {:?}, median {:?}, max {:?}",
        latencies[0],
        latencies[latencies.len() / 2],
        latencies[latencies.len() - 1]
    );
    assert!(
        latencies[latencies.len() - 1] < Duration::from_secs(2),
        "a long-poll on replica 2 was not woken by a task created on replica 1: {latencies:?}"
    );
    agent.proc.assert_running();
}

// ---------------------------------------------------------------------------------------------
// Journal keys are the server's
// ---------------------------------------------------------------------------------------------

/// A task created with another task's id as its `Idempotency-Key` must run: the agent's
/// journal is keyed by the server, so it cannot be made to answer the new task with the old
/// task's recorded result.
#[test]
fn a_client_key_naming_another_task_does_not_replay_its_journal_entry() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let agent = Agent::register(&server, tmp.path(), "journaled", &[]);
    let first = server.create_task(&agent.id, "write-sticker", &json!({"name": "one"}), None);
    let first_id = id_of(&first);
    server.wait_task_state(&first_id, TASK, "succeeded");
    let second = server.cli(&[
        "task",
        "create",
        "--agent",
        &agent.id,
        "--type",
        "write-sticker",
        "--payload",
        r#"{"name": "two"}"#,
        "--idempotency-key",
        &first_id,
    ]);
    let second_id = id_of(&second);
    assert_ne!(second_id, first_id);
    let done = server.wait_task_state(&second_id, TASK, "succeeded");
    assert_eq!(
        done["result"]["outputs"]["sticker"]["name"], "two",
        "answered with another task's result: {done}"
    );
    let history = agent.history();
    assert_eq!(count(&history, &first_id), 1, "{history:?}");
    assert_eq!(
        count(&history, &second_id),
        1,
        "the second task ran: {history:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// Certificate renewal under load
// ---------------------------------------------------------------------------------------------

/// How many times the agent process has logged a completed renewal.
fn renewals(agent: &Agent) -> usize {
    agent
        .proc
        .stderr()
        .lines()
        .filter(|l| l.contains("certificate renewed"))
        .count()
}

/// Creates `inspect` tasks for one agent, one after the other, until `stop`; returns every
/// task as it ended.
async fn steady_traffic(
    api: Client,
    agent: AgentId,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> Result<Vec<TaskView>, String> {
    let mut done = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        let request = CreateTask {
            task_type: "inspect".into(),
            agent_id: Some(agent),
            payload: json!({}),
            timeout_seconds: Some(30),
            ..Default::default()
        };
        let id = api
            .send(&request)
            .await
            .map_err(|e| format!("creating a task for {agent}: {e}"))?
            .id;
        let deadline = Instant::now() + TASK;
        loop {
            let task = api
                .send(&GetTask { id })
                .await
                .map_err(|e| format!("reading task {id}: {e}"))?;
            if !task.state.is_in_flight() {
                done.push(task);
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("task {id} did not end: {task:?}"));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Ok(done)
}

/// Three renewals each for three agents under steady task traffic: no agent exits and every
/// task succeeds on its first delivery. A poll parked on the connection of the certificate a
/// renewal just replaced, or a result sent on it, is refused as superseded and sent again on
/// the new link; it must not be taken for a revoked identity.
#[test]
fn busy_agents_renew_their_certificates_without_exiting_or_losing_a_task() {
    let tmp = tempdir();
    // 60 s is the shortest validity the server takes: a renewal every ~40 s.
    let server = Server::start(
        &tmp.path().join("data"),
        &[
            "--heartbeat-interval-secs",
            "1",
            "--agent-cert-validity-secs",
            "60",
        ],
    );
    let mut agents: Vec<Agent> = (0..3)
        .map(|i| Agent::register(&server, tmp.path(), &format!("busy-{i}"), &[]))
        .collect();
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let api = server.api();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic: Vec<_> = agents
        .iter()
        .map(|a| {
            let id = AgentId(a.id.parse().expect("agent id"));
            rt.spawn(steady_traffic(api.clone(), id, stop.clone()))
        })
        .collect();

    wait_for(
        Duration::from_secs(240),
        "three renewals of every agent",
        || {
            let mut counts = Vec::new();
            for agent in &mut agents {
                agent.proc.assert_running();
                counts.push(renewals(agent));
            }
            if counts.iter().all(|&n| n >= 3) {
                Ok(())
            } else {
                Err(format!("renewals so far: {counts:?}"))
            }
        },
    );
    stop.store(true, Ordering::SeqCst);
    for (agent, traffic) in agents.iter_mut().zip(traffic) {
        let tasks = rt
            .block_on(traffic)
            .expect("traffic task")
            .unwrap_or_else(|e| panic!("{e}"));
        agent.proc.assert_running();
        let resent = agent
            .proc
            .stderr()
            .lines()
            .filter(|l| l.contains("sent with the certificate just renewed"))
            .count();
        println!(
            "{}: {} tasks, {resent} calls sent again after a renewal",
            agent.proc.name,
            tasks.len()
        );
        assert!(
            tasks.len() >= 30,
            "{}: only {} tasks around its renewals",
            agent.proc.name,
            tasks.len()
        );
        for task in &tasks {
            assert!(
                task.state == berth_proto::task::TaskState::Succeeded && task.attempt_count == 1,
                "{}: task {} ended {} after {} deliveries: {task:?}\n{}",
                agent.proc.name,
                task.id,
                task.state,
                task.attempt_count,
                agent.proc.stderr()
            );
        }
    }

    // A renewed agent that is deleted still stops for good.
    let deleted = server.cli(&["agents", "rm", &agents[0].id]);
    assert_eq!(deleted["deleted"], true, "{deleted}");
    assert_eq!(
        agents[0].proc.wait_code(EXIT),
        1,
        "exit code after deletion:\n{}",
        agents[0].proc.stderr()
    );
}

/// Events written through two replicas at once, followed by a client that reconnects to the
/// other replica every few events with `Last-Event-ID`: it gets every event exactly once, in
/// the order of the database's event ids.
#[test]
fn two_replicas_on_postgres_stream_every_event_once_across_reconnects() {
    let Some(admin_url) =
        postgres::admin_url("two_replicas_on_postgres_stream_every_event_once_across_reconnects")
    else {
        return;
    };
    let database = TestDatabase::create(&admin_url);
    let tmp = tempdir();
    let args = ["--database", &database.url];
    let (replica_1, replica_2) = two_replicas(tmp.path(), &args);
    let mut agent = Agent::register(&replica_1, tmp.path(), "pg-events", &[]);
    let last = Agent::register(&replica_1, tmp.path(), "pg-last", &[]);
    // Their tasks stay pending (and are cancelled): nothing needs to run.
    agent.proc.kill9();
    let agent_id = AgentId(agent.id.parse().unwrap());
    let last_id = AgentId(last.id.parse().unwrap());

    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let apis = [replica_1.api(), replica_2.api()];
    let task = |agent| CreateTask {
        task_type: "inspect".into(),
        agent_id: Some(agent),
        payload: json!({}),
        ..Default::default()
    };
    let writers: Vec<_> = (0..4)
        .map(|i| {
            let api = apis[i % 2].clone();
            rt.spawn(async move {
                for _ in 0..15 {
                    let created: TaskView = api.send(&task(agent_id)).await.expect("create");
                    api.send(&berth_proto::task::CancelTask { id: created.id })
                        .await
                        .expect("cancel");
                }
            })
        })
        .collect();
    let last_task = {
        let api = apis[1].clone();
        rt.spawn(async move {
            for writer in writers {
                writer.await.expect("writer");
            }
            let created: TaskView = api.send(&task(last_id)).await.expect("create");
            created.id
        })
    };

    let mut seen: Vec<EventView> = Vec::new();
    rt.block_on(async {
        tokio::time::timeout(TASK, async {
            for replica in (0..2).cycle() {
                let mut stream = apis[replica]
                    .events(&EventQuery::default(), seen.last().map(|e| e.id), TASK)
                    .await
                    .expect("open stream");
                for _ in 0..5 {
                    let event = stream.next().await.expect("read").expect("stream open");
                    let done = event.kind == TASK_STATE && event.agent_id == Some(last_id);
                    seen.push(event);
                    if done {
                        return;
                    }
                }
            }
        })
        .await
        .expect("caught up in time")
    });
    let last_task = rt.block_on(last_task).expect("writers");
    let query = EventQuery {
        follow: Some(false),
        ..EventQuery::default()
    };
    let stored = rt.block_on(async {
        let mut stream = apis[0].events(&query, None, TASK).await.expect("backlog");
        let mut all = Vec::new();
        while let Some(event) = stream.next().await.expect("read backlog") {
            all.push(event);
        }
        all
    });
    let end = stored
        .iter()
        .position(|e| e.task_id == Some(last_task))
        .expect("the last task's event");
    assert_eq!(seen, stored[..=end], "every event once, in order");
    assert_eq!(
        seen.iter().filter(|e| e.kind == TASK_STATE).count(),
        2 * 4 * 15 + 1
    );
}

// ---------------------------------------------------------------------------------------------
// Sealed assignments and logs (issue 17)
// ---------------------------------------------------------------------------------------------

/// A poll whose answer is kept as the JSON that came over the wire: a typed answer would drop a
/// field it does not know, and a clear payload could hide there.
#[derive(Debug, serde::Serialize)]
#[serde(transparent)]
struct RawPoll(AgentTaskPollRequest);

impl berth_proto::Request for RawPoll {
    type Response = Value;
    const METHOD: berth_proto::Method = berth_proto::Method::Post;
    fn path(&self) -> String {
        berth_proto::Request::path(&self.0)
    }
}

/// The P-256 key in an agent state dir's `agent.pem`, as an HPKE recipient.
fn agent_opener(state_dir: &Path) -> berth_crypto::hpke::RecipientKey {
    let pem = std::fs::read_to_string(state_dir.join("agent.pem")).expect("agent.pem");
    berth_crypto::hpke::RecipientKey::from_pkcs8_pem(&pem).expect("agent key")
}

/// Opens `a`'s sealed payload and credentials with `key`, as berth-agent does.
fn open_sealed(
    key: &berth_crypto::hpke::RecipientKey,
    a: &AgentTaskAssignment,
) -> Result<SealedAssignment, String> {
    berth_client::sealing::open_assignment(a, key)
}

/// The payload and credentials cross the wire only sealed to the agent's certificate key: a
/// raw mTLS poll as the agent sees no clear text, only that agent's key opens the box, and a box
/// moved into another assignment or changed in one byte opens for nobody. Result logs go the
/// other way, sealed to the server's key from the session answer; a box that does not open is
/// refused with its own code and changes nothing. A real berth-agent still runs a task end to
/// end.
#[test]
fn assignments_and_logs_travel_sealed_end_to_end() {
    use base64::Engine;
    use berth_crypto::hpke;
    let b64 = base64::engine::general_purpose::STANDARD;
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let echo = program(&["/bin/echo", "/usr/bin/echo"]);
    let runner = Agent::register(
        &server,
        tmp.path(),
        "sealed-runner",
        &["--allow-command", &echo],
    );
    let mut raw = Agent::register(&server, tmp.path(), "sealed-raw", &[]);
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let api = server.api();
    let create = |agent: &str, payload: Value, credentials: &[(&str, &str)]| {
        let request: CreateTask = serde_json::from_value(json!({
            "agentId": agent,
            "type": "execute-command",
            "payload": payload,
            "credentials": credentials.iter().cloned().collect::<BTreeMap<_, _>>(),
        }))
        .expect("create request");
        rt.block_on(api.send(&request)).expect("create").id
    };

    // (1) A real agent opens its assignment, runs it, and seals its logs to the server.
    let ran = create(
        &runner.id,
        json!({"command": [echo, "sealed-marker-1"]}),
        &[("token", "s3cr3t-credential-1")],
    );
    let done = server.wait_task_state(&ran.to_string(), TASK, "succeeded");
    assert_eq!(
        done["result"]["outputs"]["stdout"], "sealed-marker-1\n",
        "{done}"
    );
    assert!(done["result"]["logs"].is_string(), "{done}");
    assert!(
        done["result"].get("sealedLogs").is_none(),
        "recorded opened: {done}"
    );

    // (2) The same wire as the raw agent's identity, driven by hand once its process is gone.
    wait_generation(&mut raw.proc, 1);
    raw.proc.kill9();
    let as_raw = agent_client(&server, &raw.state_dir);
    let raw_id = AgentId(raw.id.parse().unwrap());
    let session = wait_for(TASK, "the raw agent's session", || {
        rt.block_on(as_raw.send(&AcquireSession {
            agent_id: raw_id,
            instance_id: "sealed-raw-by-hand".into(),
            boot_id: None,
            lock: None,
            version: None,
        }))
        .map_err(|e| e.to_string())
    });
    let server_key = hpke::RecipientKey::from_pkcs8_pem(
        &std::fs::read_to_string(server.data_dir.join("sealing.key")).expect("sealing.key"),
    )
    .expect("the server's sealing key");
    assert_eq!(
        session.sealing_key,
        b64.encode(server_key.public_key().as_bytes()),
        "the session answer names the data dir's sealing key"
    );
    let header = session.generation.to_string();
    let poll = || -> Value {
        rt.block_on(as_raw.send_with(
            &RawPoll(AgentTaskPollRequest {
                contract_version: CONTRACT_VERSION.into(),
                agent_id: raw_id,
                capabilities: vec![],
                start_handshake: false,
            }),
            &[(GENERATION_HEADER, &header)],
            None,
        ))
        .expect("poll")
    };
    let first = create(
        &raw.id,
        json!({"command": [echo, "sealed-marker-2"]}),
        &[("token", "s3cr3t-credential-2")],
    );
    let wire = poll();
    let text = wire.to_string();
    assert!(
        !text.contains("sealed-marker-2") && !text.contains("s3cr3t-credential-2"),
        "clear text on the wire: {text}"
    );
    let wired = &wire["assignment"];
    assert_eq!(wired["payload"], "", "{text}");
    assert_eq!(wired["credentials"], json!({}), "{text}");
    assert_eq!(wired["sealed"]["alg"], "HPKE-P256-SHA256-A256GCM", "{text}");
    let a: AgentTaskAssignment = serde_json::from_value(wired.clone()).expect("an assignment");
    assert_eq!(a.task_id, first);

    let mine = agent_opener(&raw.state_dir);
    let opened = open_sealed(&mine, &a).expect("the agent's own key opens it");
    assert!(opened.payload.contains("sealed-marker-2"), "{opened:?}");
    assert_eq!(opened.credentials["token"], "s3cr3t-credential-2");
    // Another agent's key does not.
    assert!(open_sealed(&agent_opener(&runner.state_dir), &a).is_err());
    // A changed byte does not.
    let mut tampered = a.clone();
    let boxed = tampered.sealed.as_mut().unwrap();
    let mut ct = b64.decode(&boxed.ciphertext).unwrap();
    ct[0] ^= 1;
    boxed.ciphertext = b64.encode(ct);
    assert!(open_sealed(&mine, &tampered).is_err());

    // (3) Logs sealed for another assignment, to another key, or changed are refused with
    // LOGS_UNSEALABLE, and the task stays leased; sealed right, they are recorded opened.
    let submit = |logs: SealedBox| {
        let now = time::OffsetDateTime::now_utc();
        let result = berth_proto::result::TaskResult {
            task_id: a.task_id,
            success: true,
            started_at: now,
            completed_at: now,
            outputs: Default::default(),
            artifacts: vec![],
            error: None,
            error_type: None,
            retriable: false,
            logs: String::new(),
            sealed_logs: Some(logs),
            metrics: Default::default(),
        };
        let mut envelope = AgentTaskResultEnvelope {
            contract_version: CONTRACT_VERSION.into(),
            agent_id: raw_id,
            task_id: a.task_id,
            assignment_id: Some(a.assignment_id),
            success: true,
            message: Some("done".into()),
            result_data: Some(serde_json::to_string(&result).unwrap()),
            duration: "00:00:01".into(),
            completed_at: now,
            signature_algorithm: ALG_ECDSA_SHA256.into(),
            signature: None,
        };
        let pem = std::fs::read_to_string(raw.state_dir.join("agent.pem")).unwrap();
        let key = berth_crypto::AgentKey::from_pem(&pem).unwrap();
        envelope.signature = Some(key.sign_base64(&envelope.signing_input().unwrap()).unwrap());
        rt.block_on(as_raw.send_with(
            &SubmitResult::new(envelope),
            &[(GENERATION_HEADER, &header)],
            None,
        ))
    };
    let seal_logs = |to: &hpke::RecipientPublicKey, aad: String, text: &str| {
        let (enc, ciphertext) = hpke::seal(
            hpke::Aead::Aes256Gcm,
            to,
            LOGS_SEAL_INFO,
            aad.as_bytes(),
            text.as_bytes(),
        )
        .unwrap()
        .to_base64();
        SealedBox {
            alg: "HPKE-P256-SHA256-A256GCM".into(),
            enc,
            ciphertext,
        }
    };
    let other_assignment = berth_proto::AssignmentId(uuid::Uuid::new_v4()).to_string();
    let stranger = hpke::RecipientKey::generate().unwrap();
    let mut changed = seal_logs(server_key.public_key(), a.assignment_id.to_string(), "log");
    let mut ct = b64.decode(&changed.ciphertext).unwrap();
    ct[1] ^= 1;
    changed.ciphertext = b64.encode(ct);
    for (what, logs) in [
        (
            "another assignment",
            seal_logs(server_key.public_key(), other_assignment, "log"),
        ),
        (
            "another key",
            seal_logs(stranger.public_key(), a.assignment_id.to_string(), "log"),
        ),
        ("a changed byte", changed),
    ] {
        let refused = submit(logs).expect_err(what);
        assert_eq!(
            (refused.status(), refused.code()),
            (Some(422), Some("LOGS_UNSEALABLE")),
            "{what}: {refused}"
        );
    }
    assert_eq!(server.task(&first.to_string())["state"], "leased");
    let ack = submit(seal_logs(
        server_key.public_key(),
        a.assignment_id.to_string(),
        "ran by hand",
    ))
    .expect("sealed logs for this assignment");
    assert!(ack.accepted);
    let recorded = server.task(&first.to_string());
    assert_eq!(recorded["result"]["logs"], "ran by hand", "{recorded}");

    // (4) A box moved into another assignment opens for nobody, not even the right agent.
    create(&raw.id, json!({"command": [echo, "sealed-marker-3"]}), &[]);
    let second: AgentTaskAssignment =
        serde_json::from_value(poll()["assignment"].clone()).expect("the second assignment");
    assert!(open_sealed(&mine, &second).is_ok());
    let replayed = AgentTaskAssignment {
        sealed: a.sealed.clone(),
        ..second
    };
    assert!(open_sealed(&mine, &replayed).is_err());
}
