//! Replica loss and a PostgreSQL restart under load (issue 15, item 4), with real processes:
//! two `berth server` replicas on a PostgreSQL cluster of the test's own, 20 `berth-agent`
//! processes started with `--server A,B`, and a load generator creating tasks through both
//! replicas, each with an `Idempotency-Key`, recording every task a replica acknowledged.
//!
//! Replica A is killed with SIGKILL mid-load: every agent must hold a session on B within two
//! heartbeat intervals of the kill. A is started again, then PostgreSQL itself is stopped
//! (immediate mode: a crash, recovered from its WAL at restart) and started again: meanwhile
//! `/readyz` answers 503 on both replicas, which recover by themselves. Then every acknowledged
//! task must exist and be decided, and nothing with side effects may have run twice: counted
//! where it runs (a line per execution in a file for commands, the sticker history for
//! stickers), against each task's attempts and the agents' journals.
//!
//! The cluster is private (initdb in a temp dir, on a free port): stopping the shared test
//! cluster would break every other test running beside this one.

#![cfg(unix)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use berth_proto::agent::{AgentList, ListAgents};
use berth_proto::headers::IDEMPOTENCY_KEY_HEADER;
use berth_proto::task::CreateTask;
use berth_proto::AgentId;
use common::*;
use serde_json::{json, Value};
use tempfile::TempDir;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

const TEST: &str = "replica_loss_and_a_postgres_restart_lose_no_acknowledged_task";
const AGENTS: usize = 20;
/// The servers' heartbeat interval. The fail-over bound is two of them.
const HEARTBEAT_SECS: u64 = 2;
/// Every load task's timeout: a delivery lost with a replica (or fenced by the agent's new
/// session) settles when its lease runs out, this plus the lease grace after it was assigned.
const TASK_TIMEOUT_SECS: u32 = 15;
/// Pause between two creates of the load generator: about 7 tasks/s on a loaded 2-core host.
const PACE: Duration = Duration::from_millis(140);
/// How long the load generator keeps asking for one create to be acknowledged (through a
/// PostgreSQL outage each try may wait out the pool's 10 s acquire timeout).
const ACK_DEADLINE: Duration = Duration::from_secs(120);
/// How long every acknowledged task may take to be decided once the load stops.
const SETTLE_ALL: Duration = Duration::from_secs(150);

#[test]
fn replica_loss_and_a_postgres_restart_lose_no_acknowledged_task() {
    // Declared first, dropped last: after every process using it has been killed.
    let Some(mut pg) = PrivatePostgres::create(TEST) else {
        return;
    };
    let tmp = tempdir();
    let heartbeat = HEARTBEAT_SECS.to_string();
    let args = [
        "--heartbeat-interval-secs",
        &heartbeat,
        "--lease-grace-secs",
        "1",
        "--database",
        &pg.url,
    ];
    let (mut a, b) = two_replicas(tmp.path(), &args);
    let rt = runtime();
    let api_b = b.api();

    // 20 agents, registered through A (the first of `--server A --server B`): all of them are
    // on A when it dies. The retry budget outlasts the PostgreSQL outage.
    let sh = program(&["/bin/sh", "/usr/bin/sh"]);
    let extra = [
        "--server",
        &b.url,
        "--retry-budget-secs",
        "300",
        "--allow-command",
        &sh,
    ];
    let mut agents: Vec<Agent> = (0..AGENTS)
        .map(|i| {
            Agent::spawn_registered(
                &a,
                tmp.path(),
                &format!("agent-{i:02}"),
                &extra,
                agent_command,
            )
        })
        .collect();
    let ids: Vec<AgentId> = agents.iter().map(|a| a.id.parse().unwrap()).collect();
    let started = wait_for(SETTLE, "every agent online with a heartbeat", || {
        let list = list_agents(&rt, &api_b)?;
        let online = ids
            .iter()
            .filter(|id| {
                list.get(id)
                    .is_some_and(|a| a.0 == "online" && a.2.is_some())
            })
            .count();
        if online == AGENTS {
            Ok(list)
        } else {
            Err(format!("{online} of {AGENTS} online"))
        }
    });
    for agent in &mut agents {
        agent.proc.assert_running();
    }

    // The load: creates through both replicas (alternately first), every one acknowledged
    // recorded with the task id the replica answered.
    let runs = tmp.path().join("runs.log");
    let load = Load::start(
        [(&a.url, "A"), (&b.url, "B")],
        &std::fs::read_to_string(b.data_dir.join("ca.crt")).unwrap(),
        &b.admin_token,
        ids.clone(),
        sh.clone(),
        runs.clone(),
    );
    load.wait_running(&rt, &api_b, 60, "before the kill");

    // ---- 1. kill -9 replica A mid-load --------------------------------------------------
    let generations: Vec<u64> = ids.iter().map(|id| started[id].1).collect();
    let killed_at = OffsetDateTime::now_utc();
    a.proc.kill9();
    let acked_at_kill = load.acked();

    // When each agent holds its new session: the agent's own log line, stamped by the agent
    // when B granted it, measured from the instant just before SIGKILL was sent.
    let reconnects: Vec<Duration> = agents
        .iter_mut()
        .map(|agent| failed_over_after(agent, killed_at))
        .collect();
    let mut sorted = reconnects.clone();
    sorted.sort();
    let (p50, max) = (sorted[sorted.len() / 2], sorted[sorted.len() - 1]);
    eprintln!(
        "FAILOVER: {AGENTS} agents back on B after the kill of A: p50 {p50:?}, max {max:?} \
         (heartbeat interval {HEARTBEAT_SECS} s; each: {reconnects:?})"
    );
    // B saw each of them take a new session: the generation incremented there.
    wait_for(SETTLE, "every agent's new session on B", || {
        let list = list_agents(&rt, &api_b)?;
        let behind: Vec<_> = ids
            .iter()
            .zip(&generations)
            .filter(|(id, g)| list.get(*id).is_none_or(|a| a.1 <= **g))
            .map(|(id, _)| id.to_string())
            .collect();
        if behind.is_empty() {
            Ok(())
        } else {
            Err(format!("no new generation on B yet: {behind:?}"))
        }
    });
    // The bound. Detection costs no heartbeat here: the agents' task streams and
    // connections to A are reset by the kernel when A dies, so the agent learns of the loss at
    // once; what follows is the fail-over pause (1 s for a session younger than a minute) and
    // the session request on B.
    let bound = Duration::from_secs(2 * HEARTBEAT_SECS);
    assert!(
        max <= bound,
        "an agent took {max:?} to be back on B, over two heartbeat intervals ({bound:?}): \
         {reconnects:?}"
    );
    load.wait_running(&rt, &api_b, 40, "with A dead");
    assert!(load.acked() > acked_at_kill, "no create acknowledged by B");

    // A comes back (same address, same data dir) for the PostgreSQL part: both replicas must
    // ride out the restart. The agents stay where they are, on B.
    let listen = a.url.trim_start_matches("https://").to_string();
    let a = Server::start_at(&a.data_dir.clone(), &listen, &args, Some(&b.admin_token));
    let api_a = a.api();
    load.wait_running(&rt, &api_b, 20, "with A back");

    // ---- 2. PostgreSQL restarted mid-load -----------------------------------------------
    let failed_before = load.failed_tries();
    let stopped = Instant::now();
    pg.stop();
    // `/readyz` says not ready on both replicas while the database is down (both asked at
    // once: each answer may wait on its pool).
    let mut not_ready: [Option<(Duration, Duration)>; 2] = [None, None];
    wait_for(SETTLE, "both replicas' /readyz to answer 503", || {
        let asked = Instant::now();
        let answers = readyz_both(&rt, [&api_a, &api_b]);
        for (seen, answer) in not_ready.iter_mut().zip(answers) {
            if seen.is_none() && answer.0 == Some(503) {
                *seen = Some((stopped.elapsed(), answer.1));
            }
        }
        if not_ready.iter().all(Option::is_some) {
            Ok(())
        } else {
            Err(format!(
                "readyz answered {answers:?} (asked {:?} ago)",
                asked.elapsed()
            ))
        }
    });
    for (name, seen) in ["A", "B"].iter().zip(not_ready) {
        let (after, took) = seen.unwrap();
        eprintln!(
            "POSTGRES DOWN: replica {name} not ready {after:?} after the stop (that answer took \
             {took:?})"
        );
    }
    // The load generator meets the outage too (its creates fail and are tried again with the
    // same key): the outage lasts until it has.
    wait_for(SETTLE, "a create refused during the outage", || {
        if load.failed_tries() > failed_before {
            Ok(())
        } else {
            Err("no create failed yet".into())
        }
    });
    let outage = stopped.elapsed();
    pg.start();
    let restarted = Instant::now();
    let restarted_at = OffsetDateTime::now_utc();
    // No berth process is restarted: each replica reconnects by itself.
    for (name, api) in [("A", &api_a), ("B", &api_b)] {
        let back = wait_for(
            SETTLE,
            &format!("replica {name}'s /readyz to answer 200 again"),
            || match readyz(&rt, api) {
                Some(200) => Ok(restarted.elapsed()),
                other => Err(format!("readyz: {other:?}")),
            },
        );
        eprintln!("POSTGRES BACK: replica {name} ready {back:?} after PostgreSQL started (it was down {outage:?})");
    }
    // Every agent heartbeats again, on whichever replica it holds its session.
    let heartbeating = wait_for(SETTLE, "every agent heartbeating after the restart", || {
        let list = list_agents(&rt, &api_b)?;
        let behind: Vec<_> = ids
            .iter()
            .filter(|id| {
                list.get(*id)
                    .and_then(|a| a.2)
                    .is_none_or(|at| at <= restarted_at)
            })
            .map(ToString::to_string)
            .collect();
        if behind.is_empty() {
            Ok(restarted.elapsed())
        } else {
            Err(format!("no heartbeat since the restart: {behind:?}"))
        }
    });
    eprintln!(
        "POSTGRES BACK: all {AGENTS} agents heartbeating {heartbeating:?} after PostgreSQL started"
    );
    load.wait_running(&rt, &api_b, 40, "after the PostgreSQL restart");

    // ---- 3. every acknowledged task decided, none lost, none run twice ------------------
    let report = load.stop();
    assert!(
        report.refused.is_empty(),
        "creates refused outright: {:?}",
        report.refused
    );
    assert!(
        report.unacknowledged.is_empty(),
        "creates never acknowledged within {ACK_DEADLINE:?}: {:?}",
        report.unacknowledged
    );
    let decided = settle(&rt, &api_b, &report.acked);
    let tenant = tenant_id(&rt, &api_b);
    let executions = Executions::read(&agents, &runs);
    let mut tally: BTreeMap<String, usize> = BTreeMap::new();
    let mut problems = Vec::new();
    for acked in &report.acked {
        let task = &decided[&acked.id];
        let state = task["state"].as_str().unwrap_or("?");
        let read_back = task["readBack"] == true;
        *tally
            .entry(format!(
                "{} {state}{}",
                acked.work.kind(),
                if read_back { " (read back)" } else { "" }
            ))
            .or_default() += 1;
        let started = attempts(task)
            .iter()
            .filter(|a| a["startedAt"].is_string())
            .count();
        if task["idempotencyKey"] != acked.key.as_str() {
            problems.push(format!(
                "{}: not the task of key {}: {task}",
                acked.id, acked.key
            ));
        }
        let ran = match acked.work {
            Work::Inspect => None,
            Work::Sticker => Some(executions.stickers.get(&acked.id).copied().unwrap_or(0)),
            Work::Command => Some(executions.commands.get(&acked.key).copied().unwrap_or(0)),
        };
        let agent = &agents[acked.agent];
        let journaled = agent
            .state_dir
            .join("journal")
            .join(format!(
                "{}.json",
                berth_crypto::sha256_hex(format!("{tenant}/{}", acked.id).as_bytes())
            ))
            .exists();
        match (acked.work, state) {
            (Work::Inspect, "succeeded") => {}
            (Work::Sticker | Work::Command, "succeeded") => {
                // Exactly once: by its result (journaled before it was sent), or proven by
                // read-back (the sticker names the task, so it ran).
                if ran != Some(1) {
                    problems.push(format!("{} succeeded but ran {ran:?} times", acked.id));
                }
                if !read_back && !journaled {
                    problems.push(format!(
                        "{} succeeded by a result the agent never journaled",
                        acked.id
                    ));
                }
            }
            // A command whose start was confirmed and whose result was lost (sent to the dead
            // replica, or fenced by the agent's new session): no read-back can prove a
            // command, so it stays `unknown`, run at most once.
            (Work::Command, "unknown") if started == 1 => {}
            _ => problems.push(format!(
                "{} ({}) ended {state}: {task:#}",
                acked.id,
                acked.work.kind()
            )),
        }
        if acked.work != Work::Inspect {
            if started > 1 {
                problems.push(format!("{} started {started} times: {task:#}", acked.id));
            }
            if ran.unwrap_or(0) > 1 {
                problems.push(format!("{} ran {ran:?} times", acked.id));
            }
        }
    }
    let unknown_commands_run = report
        .acked
        .iter()
        .filter(|t| t.work == Work::Command && decided[&t.id]["state"] == "unknown")
        .map(|t| executions.commands.get(&t.key).copied().unwrap_or(0))
        .collect::<Vec<_>>();
    eprintln!(
        "TASKS: {} acknowledged ({} through A, {} through B; {} needed more than one try), {} \
         create tries failed; outcome: {tally:?}; unknown commands ran {unknown_commands_run:?} \
         times",
        report.acked.len(),
        report.acked.iter().filter(|t| t.by == "A").count(),
        report.acked.iter().filter(|t| t.by == "B").count(),
        report.acked.iter().filter(|t| t.tries > 1).count(),
        report.failed_tries,
    );
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );

    for agent in &mut agents {
        agent.proc.assert_running();
    }
}

// ---------------------------------------------------------------------------------------------
// The load
// ---------------------------------------------------------------------------------------------

/// What a load task does: read-only, or with a side effect counted where it happens.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Work {
    Inspect,
    /// `write-sticker`: each execution appends the task id to the sticker history.
    Sticker,
    /// `execute-command`: each execution appends the task's key to `runs.log`.
    Command,
}

impl Work {
    const CYCLE: [Work; 3] = [Work::Inspect, Work::Sticker, Work::Command];

    fn kind(self) -> &'static str {
        match self {
            Work::Inspect => "inspect",
            Work::Sticker => "write-sticker",
            Work::Command => "execute-command",
        }
    }
}

/// A create a replica acknowledged (200 or 201).
#[derive(Debug, Clone)]
struct Acked {
    key: String,
    work: Work,
    /// Index into the test's agents.
    agent: usize,
    id: String,
    /// The replica that answered.
    by: &'static str,
    tries: u32,
}

struct LoadReport {
    acked: Vec<Acked>,
    /// Creates answered with a final refusal (4xx): none is expected.
    refused: Vec<String>,
    /// Creates no replica acknowledged within [`ACK_DEADLINE`].
    unacknowledged: Vec<String>,
    failed_tries: usize,
}

/// The load generator: a thread creating tasks until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<Acked>>>,
    failed_tries: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<(Vec<String>, Vec<String>)>>,
}

impl Load {
    fn start(
        replicas: [(&String, &'static str); 2],
        ca_pem: &str,
        token: &str,
        agents: Vec<AgentId>,
        sh: String,
        runs: PathBuf,
    ) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(Mutex::new(Vec::new()));
        let failed_tries = Arc::new(AtomicUsize::new(0));
        let replicas: Vec<(String, &'static str)> =
            replicas.iter().map(|(u, n)| (u.to_string(), *n)).collect();
        let (ca_pem, token) = (ca_pem.to_string(), token.to_string());
        let thread = {
            let (stop, acked, failed_tries) = (stop.clone(), acked.clone(), failed_tries.clone());
            std::thread::spawn(move || {
                runtime().block_on(generate(
                    replicas,
                    ca_pem,
                    token,
                    agents,
                    sh,
                    runs,
                    stop,
                    acked,
                    failed_tries,
                ))
            })
        };
        Load {
            stop,
            acked,
            failed_tries,
            thread: Some(thread),
        }
    }

    fn acked(&self) -> usize {
        self.acked.lock().unwrap().len()
    }

    fn failed_tries(&self) -> usize {
        self.failed_tries.load(Ordering::Relaxed)
    }

    /// Waits until `at_least` more creates have been acknowledged and tasks acknowledged from
    /// now on are being run: one of each kind, created after this call, has succeeded.
    fn wait_running(
        &self,
        rt: &tokio::runtime::Runtime,
        api: &berth_client::Client,
        at_least: usize,
        when: &str,
    ) {
        let from = self.acked();
        wait_for(SETTLE, &format!("the load to run {when}"), || {
            let fresh: Vec<Acked> = self.acked.lock().unwrap()[from..].to_vec();
            let mut missing = Vec::new();
            for work in Work::CYCLE {
                let done = fresh.iter().filter(|t| t.work == work).any(|t| {
                    get_task(rt, api, &t.id)
                        .is_ok_and(|v| v.is_some_and(|v| v["state"] == "succeeded"))
                });
                if !done {
                    missing.push(work.kind());
                }
            }
            if missing.is_empty() && fresh.len() >= at_least {
                Ok(())
            } else {
                Err(format!(
                    "{} acknowledged since (waiting for {at_least}); none succeeded yet of {missing:?}",
                    fresh.len()
                ))
            }
        });
    }

    fn stop(mut self) -> LoadReport {
        self.stop.store(true, Ordering::Relaxed);
        let (refused, unacknowledged) = self.thread.take().unwrap().join().expect("load thread");
        LoadReport {
            acked: self.acked.lock().unwrap().clone(),
            refused,
            unacknowledged,
            failed_tries: self.failed_tries(),
        }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Creates one task every [`PACE`], round-robin over the agents and [`Work::CYCLE`], each
/// first through one replica and then the other (alternately), every try of one create with the
/// same key and body: a create whose answer was lost (a replica killed after committing, a
/// 5xx) is answered by the next replica with the task the first one made.
#[allow(clippy::too_many_arguments)]
async fn generate(
    replicas: Vec<(String, &'static str)>,
    ca_pem: String,
    token: String,
    agents: Vec<AgentId>,
    sh: String,
    runs: PathBuf,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Vec<Acked>>>,
    failed_tries: Arc<AtomicUsize>,
) -> (Vec<String>, Vec<String>) {
    // One client per replica, so the generator itself decides which replica it asks: a client
    // with fallbacks sticks to the one that answered last.
    let clients: Vec<berth_client::Client> = replicas
        .iter()
        .map(|(url, _)| admin_client(url, &ca_pem, &token))
        .collect();
    let runs = runs.display().to_string();
    let (mut refused, mut unacknowledged) = (Vec::new(), Vec::new());
    let mut n = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let agent = n % agents.len();
        let work = Work::CYCLE[n % Work::CYCLE.len()];
        let key = format!("load-{n:05}");
        let payload = match work {
            Work::Inspect => json!({}),
            Work::Sticker => json!({ "name": key }),
            // `$1` and `$2` are arguments, not text in the script: nothing to quote. The
            // command then runs on for a second, so some are running when a replica or the
            // database goes away.
            Work::Command => json!({
                "command": [sh, "-c", "echo \"$1\" >> \"$2\"; sleep 1", "sh", key, runs],
            }),
        };
        let create = CreateTask {
            task_type: work.kind().into(),
            agent_id: Some(agents[agent]),
            selector: None,
            payload,
            credentials: None,
            variables: None,
            timeout_seconds: Some(TASK_TIMEOUT_SECS),
            priority: None,
        };
        let first = n % 2;
        let deadline = Instant::now() + ACK_DEADLINE;
        let mut tries = 0u32;
        loop {
            let at = (first + tries as usize) % clients.len();
            tries += 1;
            let answer = clients[at]
                .send_with(&create, &[(IDEMPOTENCY_KEY_HEADER, &key)], None)
                .await;
            match answer {
                Ok(task) => {
                    acked.lock().unwrap().push(Acked {
                        key: key.clone(),
                        work,
                        agent,
                        id: task.id.to_string(),
                        by: replicas[at].1,
                        tries,
                    });
                    break;
                }
                // Not connected, no answer, or a 5xx: try again, with the same key.
                Err(e) if e.status().is_none_or(|s| s >= 500) => {
                    failed_tries.fetch_add(1, Ordering::Relaxed);
                    if Instant::now() >= deadline {
                        unacknowledged.push(format!("{key}: {e}"));
                        break;
                    }
                    if at != first {
                        // Both replicas failed this round: pace the retries.
                        tokio::time::sleep(Duration::from_millis(250)).await;
                    }
                }
                Err(e) => {
                    refused.push(format!("{key}: {e}"));
                    break;
                }
            }
        }
        n += 1;
        tokio::time::sleep(PACE).await;
    }
    (refused, unacknowledged)
}

/// Waits until every acknowledged task is decided: `succeeded`, `failed` and the other final
/// states, or `unknown` for a command (which nothing reads back). A task a replica acknowledged
/// and the database no longer knows is lost: the test fails at once.
fn settle(
    rt: &tokio::runtime::Runtime,
    api: &berth_client::Client,
    acked: &[Acked],
) -> HashMap<String, Value> {
    let mut decided = HashMap::new();
    wait_for(SETTLE_ALL, "every acknowledged task decided", || {
        let mut open = Vec::new();
        let undecided: Vec<&Acked> = acked
            .iter()
            .filter(|t| !decided.contains_key(&t.id))
            .collect();
        for task in undecided {
            let view = match get_task(rt, api, &task.id)? {
                Some(view) => view,
                None => panic!(
                    "task {} (key {}) was acknowledged and is lost",
                    task.id, task.key
                ),
            };
            let state = view["state"].as_str().unwrap_or("?");
            let is_decided = match state {
                "pending" | "leased" | "retry_wait" => false,
                // Read back (a sticker) or left for an operator (a command).
                "unknown" => task.work == Work::Command,
                _ => true,
            };
            if is_decided {
                decided.insert(task.id.clone(), view);
            } else {
                open.push(format!("{} {} {state}", task.id, task.work.kind()));
            }
        }
        if open.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "{} open: {:?}",
                open.len(),
                &open[..open.len().min(10)]
            ))
        }
    });
    decided
}

/// Every execution with a side effect, counted on the host.
struct Executions {
    /// Task id → lines in its agent's sticker history.
    stickers: HashMap<String, usize>,
    /// Load key → lines in `runs.log`.
    commands: HashMap<String, usize>,
}

impl Executions {
    fn read(agents: &[Agent], runs: &Path) -> Executions {
        let mut stickers = HashMap::new();
        for agent in agents {
            for id in agent.history() {
                *stickers.entry(id).or_default() += 1;
            }
        }
        let mut commands = HashMap::new();
        let text = match std::fs::read_to_string(runs) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => panic!("{}: {e}", runs.display()),
        };
        for line in text.lines().filter(|l| !l.is_empty()) {
            *commands.entry(line.to_string()).or_default() += 1;
        }
        Executions { stickers, commands }
    }
}

// ---------------------------------------------------------------------------------------------
// Agents, replicas and the API
// ---------------------------------------------------------------------------------------------

/// How long after `killed_at` the agent logged its fail-over session ("failed over; session
/// acquired"), by the timestamp the agent wrote on that line.
fn failed_over_after(agent: &mut Agent, killed_at: OffsetDateTime) -> Duration {
    wait_for(SETTLE, &format!("{} to fail over", agent.proc.name), || {
        agent.proc.assert_running();
        let log = agent.proc.stderr();
        log.lines()
            .filter(|l| l.contains("failed over; session acquired"))
            .filter_map(|l| OffsetDateTime::parse(l.split_whitespace().next()?, &Rfc3339).ok())
            .find(|at| *at >= killed_at)
            .map(|at| Duration::try_from(at - killed_at).unwrap())
            .ok_or(log)
    })
}

/// Each agent's status, session generation and last heartbeat, as the replica lists them.
type AgentRow = (String, u64, Option<OffsetDateTime>);

fn list_agents(
    rt: &tokio::runtime::Runtime,
    api: &berth_client::Client,
) -> Result<HashMap<AgentId, AgentRow>, String> {
    let list: AgentList = rt
        .block_on(api.send(&ListAgents {
            limit: Some(100),
            ..Default::default()
        }))
        .map_err(|e| e.to_string())?;
    Ok(list
        .items
        .into_iter()
        .map(|a| {
            let status = serde_json::to_value(a.status).unwrap();
            (
                a.id,
                (
                    status.as_str().unwrap_or("?").to_string(),
                    a.session_generation,
                    a.last_heartbeat,
                ),
            )
        })
        .collect())
}

/// `GET /api/v1/tasks/{id}`: `None` when the replica answers 404.
fn get_task(
    rt: &tokio::runtime::Runtime,
    api: &berth_client::Client,
    id: &str,
) -> Result<Option<Value>, String> {
    match rt.block_on(api.get_value(&format!("/api/v1/tasks/{id}"), &[])) {
        Ok(task) => Ok(Some(task)),
        Err(e) if e.status() == Some(404) => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

/// The status `/readyz` answers, `None` without an answer.
fn readyz(rt: &tokio::runtime::Runtime, api: &berth_client::Client) -> Option<u16> {
    match rt.block_on(api.get_text("/readyz")) {
        Ok(_) => Some(200),
        Err(e) => e.status(),
    }
}

/// What `/readyz` answers on each replica, asked at once, and how long each answer took.
fn readyz_both(
    rt: &tokio::runtime::Runtime,
    apis: [&berth_client::Client; 2],
) -> [(Option<u16>, Duration); 2] {
    let ask = |api: &berth_client::Client| {
        let api = api.clone();
        async move {
            let asked = Instant::now();
            let status = match api.get_text("/readyz").await {
                Ok(_) => Some(200),
                Err(e) => e.status(),
            };
            (status, asked.elapsed())
        }
    };
    let (a, b) = rt.block_on(async { tokio::join!(ask(apis[0]), ask(apis[1])) });
    [a, b]
}

/// The admin's tenant, which names the agents' journal entries (`<tenant>/<task>`): from the
/// audit log's first entry.
fn tenant_id(rt: &tokio::runtime::Runtime, api: &berth_client::Client) -> String {
    let page = rt
        .block_on(api.get_value("/api/v1/audit?limit=1", &[]))
        .expect("reading the audit log");
    str_of(&page["items"][0], "tenantId").to_string()
}

fn admin_client(url: &str, ca_pem: &str, token: &str) -> berth_client::Client {
    berth_client::Client::new(berth_client::ClientConfig {
        server: url.to_string(),
        trust: berth_client::Trust::CaPem(ca_pem.to_string()),
        identity: None,
        bearer: Some(token.to_string()),
        timeout: Duration::from_secs(30),
    })
    .expect("API client")
}

/// The test thread's runtime: its clients' connections live in it, so every call on them
/// goes through this one runtime.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// A PostgreSQL cluster of the test's own
// ---------------------------------------------------------------------------------------------

/// A PostgreSQL cluster in a temp dir on a free loopback port, stopped when dropped. Run as
/// the `postgres` user when the test runs as root (PostgreSQL refuses to run as root), as the
/// test's own user otherwise.
struct PrivatePostgres {
    /// Owned by the cluster's user: the data dir, its socket, the log, the password file.
    root: TempDir,
    bin: PathBuf,
    user: Option<&'static str>,
    running: bool,
    url: String,
}

impl PrivatePostgres {
    /// Creates and starts the cluster; `None` (a SKIP) when PostgreSQL is not installed and
    /// services are not required, a failure when they are.
    fn create(test: &str) -> Option<PrivatePostgres> {
        let Some(bin) = postgres_bin() else {
            return berth_test_utils::require_service(
                test,
                "no PostgreSQL server binaries (initdb, pg_ctl) in /usr/lib/postgresql/*/bin or \
                 at `pg_config --bindir` (Debian: apt-get install postgresql; scripts/postgres.sh \
                 installs it)",
            );
        };
        // SAFETY: geteuid has no preconditions.
        let user = (unsafe { libc::geteuid() } == 0).then_some("postgres");
        let root = tempfile::Builder::new()
            .prefix("berth-e2e-pg-")
            .tempdir()
            .expect("creating a temp dir");
        let owner = user.map(|name| {
            let (uid, gid) = user_ids(name).unwrap_or_else(|| {
                panic!(
                    "running as root, PostgreSQL must run as {name:?}, and there is no such user"
                )
            });
            std::os::unix::fs::chown(root.path(), Some(uid), Some(gid)).unwrap();
            (uid, gid)
        });
        let password = uuid::Uuid::new_v4().simple().to_string();
        let pwfile = root.path().join("pwfile");
        berth_fs::write_atomic(&pwfile, password.as_bytes(), 0o600).unwrap();
        if let Some((uid, gid)) = owner {
            std::os::unix::fs::chown(&pwfile, Some(uid), Some(gid)).unwrap();
        }
        let port = free_port();
        let mut pg = PrivatePostgres {
            root,
            bin,
            user,
            running: false,
            url: format!("postgres://berth:{password}@127.0.0.1:{port}/postgres"),
        };
        let data = pg.data();
        pg.run(
            "initdb",
            &[
                "-D",
                data.to_str().unwrap(),
                "-U",
                "berth",
                &format!("--pwfile={}", pwfile.display()),
                "-E",
                "UTF8",
                "--no-locale",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
            ],
        );
        // Loopback only, the socket in our own dir. No fsync: the cluster is thrown away, and
        // the stop below kills PostgreSQL, not the host, so what it wrote is in the page cache.
        // synchronous_commit stays on: a commit is in the WAL before the client hears of it,
        // so an immediate stop (a crash) loses nothing a replica acknowledged.
        let conf = format!(
            "\n# replica_loss_e2e\nlisten_addresses = '127.0.0.1'\nport = {port}\n\
             unix_socket_directories = '{}'\nmax_connections = 100\nfsync = off\n\
             full_page_writes = off\n",
            pg.root.path().display()
        );
        use std::io::Write;
        std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .and_then(|mut f| f.write_all(conf.as_bytes()))
            .expect("appending to postgresql.conf");
        pg.start();
        Some(pg)
    }

    fn data(&self) -> PathBuf {
        self.root.path().join("data")
    }

    fn start(&mut self) {
        let data = self.data();
        let log = self.root.path().join("postgresql.log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
        self.running = true;
    }

    /// Stops the cluster in immediate mode: every backend is killed at once, as in a crash,
    /// and the next start recovers from the WAL.
    fn stop(&mut self) {
        let data = self.data();
        self.running = false;
        self.run(
            "pg_ctl",
            &[
                "-D",
                data.to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "-t",
                "60",
                "stop",
            ],
        );
    }

    /// Runs one of the cluster's programs as its user; panics with its output on failure.
    fn run(&self, program: &str, args: &[&str]) {
        let program = self.bin.join(program);
        let mut cmd = match self.user {
            Some(user) => {
                let mut cmd = Command::new("runuser");
                cmd.args(["-u", user, "--"]).arg(&program);
                cmd
            }
            None => Command::new(&program),
        };
        // The cluster's user may not be able to enter the test's working directory.
        cmd.args(args).current_dir("/");
        let out = Proc::spawn(&program.display().to_string(), cmd).finish(EXIT);
        let log =
            std::fs::read_to_string(self.root.path().join("postgresql.log")).unwrap_or_default();
        assert!(
            out.status.success(),
            "{} {args:?}: {}\n{}\n{}\n{log}",
            program.display(),
            out.status,
            out.stdout,
            out.stderr
        );
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        if self.running {
            // Not `stop`: a failure here must not panic inside a panic.
            let data = self.data();
            let program = self.bin.join("pg_ctl");
            let mut cmd = match self.user {
                Some(user) => {
                    let mut cmd = Command::new("runuser");
                    cmd.args(["-u", user, "--"]).arg(&program);
                    cmd
                }
                None => Command::new(&program),
            };
            cmd.arg("-D")
                .arg(&data)
                .args(["-m", "immediate", "-w", "stop"])
                .current_dir("/");
            if let Err(e) = cmd.output() {
                eprintln!("warning: could not stop the private PostgreSQL: {e}");
            }
        }
    }
}

/// The newest installed PostgreSQL's `bin` dir: Debian's `/usr/lib/postgresql/<major>/bin`,
/// else what `pg_config --bindir` says.
fn postgres_bin() -> Option<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let major = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((major, bin))
        })
        .collect();
    found.sort();
    if let Some((_, bin)) = found.pop() {
        return Some(bin);
    }
    let out = Command::new("pg_config").arg("--bindir").output().ok()?;
    let bin = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (bin.join("initdb").exists() && bin.join("pg_ctl").exists()).then_some(bin)
}

/// The uid and gid of the user `name`.
fn user_ids(name: &str) -> Option<(u32, u32)> {
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: getpwnam reads the passwd database into static storage; the test reads the two
    // fields at once, and no other thread of this test binary calls it.
    unsafe {
        let entry = libc::getpwnam(name.as_ptr());
        if entry.is_null() {
            None
        } else {
            Some(((*entry).pw_uid, (*entry).pw_gid))
        }
    }
}
