//! Agents and admin clients fail over between replicas (issue 15, item 3), with real processes:
//! two `berth server` replicas on one PostgreSQL database, agents started with `--server A,B`,
//! and the admin CLI with `BERTH_SERVER=A,B`. Replica A is killed with SIGKILL while one agent
//! runs a task and another holds a leased one it has not acted on yet.
//!
//! What must hold: each agent moves to B and acquires a new session there (its generation
//! incremented); new tasks run on B under it; a result sent under the old generation is refused
//! as `FENCED`; no task runs twice (counted where it runs: a line per execution in a file, the
//! sticker history), and each ends decided: `succeeded` (by its result or by read-back), or
//! `unknown` for a command no read-back can prove. The CLI keeps working with A dead.

#![cfg(unix)]

mod common;

use std::time::Duration;

use berth_test_utils::postgres::{self, TestDatabase};
use common::*;
use serde_json::{json, Value};

/// How long a task may take to reach a state that needs only the agent and the sweeper.
const TASK: Duration = Duration::from_secs(120);

/// The generation of the agent process's latest session, once it is at least `at_least`.
fn wait_generation(agent: &mut Proc, at_least: i64) -> i64 {
    wait_for(
        SETTLE,
        &format!(
            "{} to hold a session of generation {at_least} or later",
            agent.name
        ),
        || {
            if let Some(status) = agent.try_status() {
                return Err(format!("exited {status}: {}", agent.stderr()));
            }
            match acquired_generations(&agent.stderr()).last() {
                Some(&g) if g >= at_least => Ok(g),
                _ => Err(agent.stderr()),
            }
        },
    )
}

/// `berth ARGS -o json` as the admin with `BERTH_SERVER=servers` (several, comma separated).
fn cli_on(servers: &str, b: &Server, args: &[&str]) -> Result<Value, String> {
    let mut cmd = command(BERTH);
    cmd.args(args)
        .args(["--output", "json"])
        .env("BERTH_SERVER", servers)
        .env("BERTH_TOKEN", &b.admin_token)
        .env("BERTH_CA_FILE", b.data_dir.join("ca.crt"));
    let out = Proc::spawn(&format!("berth {}", args.join(" ")), cmd).finish(EXIT);
    if !out.status.success() {
        return Err(format!("berth {} failed: {}", args.join(" "), out.stderr));
    }
    serde_json::from_str(&out.stdout).map_err(|e| format!("{e}: {}", out.stdout))
}

/// The attempts of `task` whose start handshake the server confirmed.
fn started(task: &Value) -> usize {
    task["attempts"].as_array().map_or(0, |attempts| {
        attempts
            .iter()
            .filter(|a| a["startedAt"].is_string())
            .count()
    })
}

/// The generation of the task's last delivery.
fn last_generation(task: &Value) -> i64 {
    attempts(task)
        .last()
        .and_then(|a| a["generation"].as_i64())
        .unwrap_or_else(|| panic!("no generation in {task}"))
}

#[test]
fn agents_and_the_cli_fail_over_to_the_next_replica() {
    let Some(admin_url) = postgres::admin_url("agents_and_the_cli_fail_over_to_the_next_replica")
    else {
        return;
    };
    // Declared first, dropped last: after every process has been killed.
    let database = TestDatabase::create(&admin_url);
    let tmp = tempdir();
    let args = [
        "--heartbeat-interval-secs",
        "1",
        "--lease-grace-secs",
        "1",
        "--database",
        &database.url,
    ];
    let (mut a, b) = two_replicas(tmp.path(), &args);
    let both = format!("{},{}", a.url, b.url);

    // Registered through A (the first server); each runs with `--server A --server B`.
    let extra = [
        "--server",
        &b.url,
        "--retry-budget-secs",
        "120",
        "--allow-command",
        "/bin/sh",
    ];
    let mut runner = Agent::register(&a, tmp.path(), "runner", &extra);
    let mut held = Agent::register(&a, tmp.path(), "held", &extra);
    let runner_before = wait_generation(&mut runner.proc, 1);
    let held_before = wait_generation(&mut held.proc, 1);
    for agent in [&runner, &held] {
        let warm = a.create_task(&agent.id, "write-sticker", &json!({"name": "warm"}), None);
        b.wait_task_state(&id_of(&warm), TASK, "succeeded");
    }

    // The runner is running a command (its start confirmed by A) when A dies.
    let runs = tmp.path().join("runs.log");
    let script = format!("echo run >> {}; sleep 15", runs.display());
    let running = a.create_task(
        &runner.id,
        "execute-command",
        &json!({"command": ["/bin/sh", "-c", script]}),
        Some(30),
    );
    let running_id = id_of(&running);
    b.wait_task(&running_id, TASK, "started", |t| {
        t["state"] == "leased" && started(t) == 1
    });
    wait_for(SETTLE, "the command to run", || {
        std::fs::read_to_string(&runs).map_err(|e| e.to_string())
    });

    // The other agent holds a leased write-sticker it has not acted on: stopped while its
    // poll (or stream) waits on A, it is handed the task there.
    let leased_id = lease_into_stopped_agent(&a, &b, &mut held);

    a.proc.kill9();
    held.proc.signal(libc::SIGCONT);

    // Both move to B with a new session: the generation increments.
    let runner_after = wait_generation(&mut runner.proc, runner_before + 1);
    let held_after = wait_generation(&mut held.proc, held_before + 1);
    for agent in [&mut runner.proc, &mut held.proc] {
        let log = agent.stderr();
        assert!(log.contains("failing over"), "{log}");
    }

    // New tasks run on B under the new generation. (`inspect` is read-only, so it runs beside
    // the runner's lease that is still live.)
    let fresh = b.create_task(&runner.id, "inspect", &json!({}), Some(30));
    let fresh = b.wait_task_state(&id_of(&fresh), TASK, "succeeded");
    assert_eq!(last_generation(&fresh), runner_after, "{fresh:#}");

    // The command's result went out under the old generation: B refuses it as fenced, the
    // lease runs out with the start confirmed, and the task is `unknown` (no read-back proves
    // a command). It ran once.
    wait_fenced_in_log(&mut runner.proc, &running_id);
    let lost = b.wait_task(&running_id, TASK, "no longer leased", |t| {
        t["state"] != "leased"
    });
    assert_eq!(lost["state"], "unknown", "{lost:#}");
    assert_eq!(attempts(&lost).len(), 1, "{lost:#}");
    assert_eq!(last_generation(&lost), runner_before, "{lost:#}");
    let runs_text = std::fs::read_to_string(&runs).unwrap();
    assert_eq!(
        runs_text.lines().count(),
        1,
        "the command ran again: {runs_text}"
    );

    // The held write-sticker ends succeeded: by its result, by its redelivery on B (a delivery
    // whose start was never confirmed did nothing), or by read-back. It ran once.
    let done = b.wait_task(&leased_id, TASK, "decided", |t| {
        !matches!(
            t["state"].as_str(),
            Some("pending" | "leased" | "retry_wait" | "unknown")
        )
    });
    assert_eq!(done["state"], "succeeded", "{done:#}");
    assert!(started(&done) <= 1, "started twice: {done:#}");
    let history = held.history();
    assert_eq!(
        history.iter().filter(|t| **t == leased_id).count(),
        1,
        "the held task ran {history:?}"
    );
    let after = b.create_task(&held.id, "write-sticker", &json!({"name": "after"}), None);
    let after = b.wait_task_state(&id_of(&after), TASK, "succeeded");
    assert_eq!(last_generation(&after), held_after, "{after:#}");

    // The CLI with A dead: A refuses the connection, B answers.
    let shown = cli_on(&both, &b, &["task", "show", &leased_id]).expect("task show on A,B");
    assert_eq!(shown["id"], leased_id.as_str(), "{shown}");
    let created = cli_on(
        &both,
        &b,
        &[
            "task",
            "create",
            "--agent",
            &runner.id,
            "--type",
            "inspect",
            "--payload",
            "{}",
        ],
    )
    .expect("task create on A,B");
    b.wait_task_state(&id_of(&created), TASK, "succeeded");
    assert!(
        cli_on(&a.url, &b, &["task", "show", &leased_id]).is_err(),
        "replica A still answers"
    );

    runner.proc.assert_running();
    held.proc.assert_running();
}

/// Stops `agent` (SIGSTOP) while its long-poll or task stream waits on `a`, then creates a
/// write-sticker for it: `a` claims it into that wait, so the task is `leased` to a process that
/// cannot act on it. Returns the task id with the agent still stopped. If the agent was stopped
/// between two polls (nothing claimed the task), it is resumed and the sequence tried again.
fn lease_into_stopped_agent(a: &Server, b: &Server, agent: &mut Agent) -> String {
    for attempt in 0..3 {
        let warm = a.create_task(&agent.id, "inspect", &json!({}), Some(30));
        b.wait_task_state(&id_of(&warm), TASK, "succeeded");
        agent.proc.signal(libc::SIGSTOP);
        let name = format!("held-{attempt}");
        let id = id_of(&a.create_task(
            &agent.id,
            "write-sticker",
            &json!({ "name": name }),
            Some(10),
        ));
        let leased = try_wait_for(Duration::from_secs(15), || {
            let task = b.try_task(&id)?;
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
        agent.proc.signal(libc::SIGCONT);
        b.wait_task_state(&id, TASK, "succeeded");
    }
    panic!("could not lease a task into the stopped agent in 3 tries");
}
