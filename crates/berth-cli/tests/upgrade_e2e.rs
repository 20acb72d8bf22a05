//! The previous release's agent against this server (issue 16 item 5): a real `berth-agent` built
//! from the commit of the newest release in `RELEASES` (`scripts/previous-agent.sh`, path in
//! `BERTH_TEST_PREVIOUS_AGENT`), next to this tree's `berth server`. It must register, hold its
//! session, heartbeat, report its own version, and run real tasks end to end with verified
//! signed results over the task stream and the long-poll; what it cannot do must be refused
//! with the stable codes; and this tree's agent must take over its state dir in place.
//!
//! Without `BERTH_TEST_PREVIOUS_AGENT` the test prints a SKIP line, except under `CI=true` or
//! `BERTH_REQUIRE_SERVICES=1` (`scripts/test.sh`, which builds it), where it fails. The Docker
//! deployment needs the engine and the registries of `scripts/registry.sh` likewise.

#![cfg(unix)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use berth_proto::transport::{
    AgentTaskPollRequest, AgentTaskResultEnvelope, SubmitResult, ALG_ECDSA_SHA256,
    CONTRACT_VERSION, GENERATION_HEADER,
};
use berth_proto::{AgentId, TaskId};
use berth_test_utils::deploy::http_check;
use berth_test_utils::docker::{self as fixtures, make_image, Cleanup, Variant};
use common::*;
use serde_json::{json, Value};

/// How long a task may take on a loaded 2-core host (a deployment pulls and health-checks).
const TASK: Duration = Duration::from_secs(120);

/// The newest release of `RELEASES` (the previous one: the workspace is the next).
fn previous_release() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../RELEASES");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let line = text
        .lines()
        .map(str::trim)
        .rfind(|l| !l.is_empty() && !l.starts_with('#'))
        .expect("RELEASES names a release");
    line.split_whitespace().next().unwrap().to_string()
}

/// `BIN --version`, as the binary prints it.
fn version_of(bin: &str) -> String {
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .unwrap_or_else(|e| panic!("{bin} --version: {e}"));
    assert!(out.status.success(), "{bin} --version: {out:?}");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// The previous release's agent binary, checked to be that release and not this tree's; `None`
/// (SKIP) when it was not built, a failure when services are required.
fn previous_agent(test: &str) -> Option<String> {
    let release = previous_release();
    let current = env!("CARGO_PKG_VERSION");
    assert_ne!(
        release, current,
        "the workspace is still at the newest release {release}: bump it (see RELEASES)"
    );
    let Some(bin) = std::env::var("BERTH_TEST_PREVIOUS_AGENT")
        .ok()
        .filter(|p| !p.is_empty())
    else {
        return berth_test_utils::require_service(
            test,
            "BERTH_TEST_PREVIOUS_AGENT is not set (run: export BERTH_TEST_PREVIOUS_AGENT=\"$(bash scripts/previous-agent.sh | tail -n 1)\")",
        );
    };
    assert!(
        Path::new(&bin).is_file(),
        "BERTH_TEST_PREVIOUS_AGENT={bin} does not exist: run scripts/previous-agent.sh"
    );
    assert_eq!(version_of(&bin), format!("berth-agent {release}"), "{bin}");
    // Building the old agent in the shared target dir links its binaries at target/debug until
    // cargo links this tree's back: this test must run this tree's server and upgraded agent.
    assert_eq!(
        version_of(BERTH_AGENT),
        format!("berth-agent {current}"),
        "{BERTH_AGENT} is not this tree's agent"
    );
    assert_eq!(
        version_of(BERTH),
        format!("berth {current}"),
        "{BERTH} is not this tree's server"
    );
    Some(bin)
}

/// A command for the previous release's agent, like [`agent_command`]: with the host's Docker
/// engine when `docker`, else pointed at none (so it reports no `docker` capability).
fn previous_command(bin: &str, docker: bool) -> impl Fn(&Path, &[&str]) -> Command + '_ {
    move |state_dir, args| {
        let mut cmd = command(bin);
        cmd.arg("--state-dir").arg(state_dir).args(args);
        if !docker {
            cmd.env("DOCKER_HOST", "unix:///nonexistent/berth-e2e/docker.sock");
        }
        cmd.env("BERTH_AGENT_SHUTDOWN_GRACE_SECS", "10");
        cmd
    }
}

/// Waits until the agent's row shows a heartbeat later than the one in `seen`.
fn wait_next_heartbeat(server: &Server, agent: &Agent, seen: &Value) -> Value {
    let before = timestamp(&seen["lastHeartbeat"]);
    server.wait_agent(&agent.id, "a later heartbeat", |a| {
        a["lastHeartbeat"].is_string() && timestamp(&a["lastHeartbeat"]) > before
    })
}

/// Runs `task_type` with `payload` on `agent` to success and checks that the result was the
/// agent's signed envelope for this task under `agent-task-transport/v1`; returns the task.
fn run_verified(server: &Server, agent: &Agent, task_type: &str, payload: &Value) -> Value {
    let created = server.create_task(&agent.id, task_type, payload, Some(90));
    let id = id_of(&created);
    let task = server.wait_task(&id, TASK, "a decided state", |t| {
        !matches!(t["state"].as_str(), Some("pending" | "leased"))
    });
    assert_eq!(task["state"], "succeeded", "{task:#}");
    let tries = attempts(&task);
    assert_eq!(tries.len(), 1, "{task:#}");
    let envelope = &tries[0]["result"];
    assert!(
        envelope["signature"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "the verified, signed envelope: {task:#}"
    );
    assert_eq!(envelope["contractVersion"], CONTRACT_VERSION, "{task:#}");
    assert_eq!(envelope["taskId"], id.as_str(), "{task:#}");
    assert_eq!(envelope["agentId"], agent.id.as_str(), "{task:#}");
    assert_eq!(envelope["signatureAlgorithm"], ALG_ECDSA_SHA256, "{task:#}");
    task
}

/// The previous release's agent, registered against this server twice (one on the task stream,
/// one on the long-poll), runs `execute-command`, `write-sticker` and `inspect` with verified
/// signed results, and, with Docker, a `docker.run` by digest; the server shows its version; a
/// task needing a capability it does not report, and a contract version this server does not
/// speak, are refused with their codes; and this tree's agent takes its state dir over in place.
#[test]
fn the_previous_release_agent_works_against_this_server() {
    let test = "the_previous_release_agent_works_against_this_server";
    let Some(previous) = previous_agent(test) else {
        return;
    };
    let release = previous_release();
    let docker = fixtures::env(test);
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let echo = program(&["/bin/echo", "/usr/bin/echo"]);

    // Registration, session and heartbeats, over each task transport.
    let mut agents = Vec::new();
    for (name, transport, with_docker) in [
        ("previous-stream", "stream", docker.is_some()),
        ("previous-poll", "poll", false),
    ] {
        let mut agent = Agent::spawn_registered(
            &server,
            tmp.path(),
            name,
            &["--task-transport", transport, "--allow-command", &echo],
            previous_command(&previous, with_docker),
        );
        let row = wait_for(SETTLE, "online with a heartbeat and a session", || {
            agent.proc.assert_running();
            let row = server.try_agent(&agent.id)?;
            let up = matches!(row["status"].as_str(), Some("online" | "degraded"))
                && row["lastHeartbeat"].is_string()
                && row["sessionGeneration"].as_i64() >= Some(1);
            up.then_some(row.clone()).ok_or_else(|| row.to_string())
        });
        assert_eq!(row["version"], release.as_str(), "{row:#}");
        assert_eq!(row["name"], name, "{row:#}");
        wait_next_heartbeat(&server, &agent, &row);
        agents.push(agent);
    }
    let [mut streaming, mut polling]: [Agent; 2] = agents.try_into().ok().unwrap();

    // Real tasks, end to end, on both.
    for agent in [&streaming, &polling] {
        let marker = format!("from-{}", agent.id);
        let task = run_verified(
            &server,
            agent,
            "execute-command",
            &json!({"command": [echo, marker]}),
        );
        assert_eq!(task["result"]["outputs"]["exitCode"], 0, "{task:#}");
        assert_eq!(
            task["result"]["outputs"]["stdout"],
            format!("{marker}\n"),
            "{task:#}"
        );
        let task = run_verified(&server, agent, "write-sticker", &json!({"name": "web"}));
        assert_eq!(agent.history(), vec![id_of(&task)], "one execution");
        let task = run_verified(&server, agent, "inspect", &json!({}));
        assert!(task["result"]["outputs"].is_object(), "{task:#}");
    }
    let streamed = streaming.proc.stderr();
    assert!(
        streamed.contains("task stream open"),
        "the stream agent did not use the stream:\n{streamed}"
    );
    let polled = polling.proc.stderr();
    assert!(
        !polled.contains("task stream open"),
        "the poll agent opened the stream:\n{polled}"
    );

    // A deployment by digest through the real engine and registry.
    if let Some(env) = &docker {
        let image = make_image(
            &env.registry,
            &cleanup.prefix,
            "web",
            Variant::Healthy,
            "v1",
            None,
        );
        let name = format!("{}-web", cleanup.prefix);
        let port = free_port();
        let task = run_verified(
            &server,
            &streaming,
            "docker.run",
            &image.deploy(&name, port, http_check(port, 60)),
        );
        assert_eq!(task["result"]["success"], true, "{task:#}");
        let body = block_on(fixtures::http_body(port));
        assert_eq!(body.as_deref(), Some("v1"), "{task:#}");
        let sticker: Value = serde_json::from_str(
            &std::fs::read_to_string(streaming.sticker_dir.join(format!("{name}.json")))
                .expect("the deployment's sticker"),
        )
        .unwrap();
        assert_eq!(sticker["digest"], image.digest.as_str(), "{sticker:#}");
        assert_eq!(sticker["taskId"], task["id"], "{sticker:#}");
    }

    // What it lacks is not given to it: the poll agent reports no docker capability.
    let refused = server
        .try_cli(&[
            "task",
            "create",
            "--agent",
            &polling.id,
            "--type",
            "docker.run",
            "--payload",
            r#"{"image": "127.0.0.1:1/none", "digest": "sha256:0000000000000000000000000000000000000000000000000000000000000000", "config": {"containerName": "none"}}"#,
        ])
        .unwrap_err();
    assert!(
        refused.contains("422") && refused.contains("CAPABILITY_MISSING"),
        "{refused}"
    );

    // A contract version this server does not speak is refused with its code, on a poll and on
    // a result, for the old agent's own identity and live generation.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let as_old = agent_client(&server, &polling.state_dir);
    let agent_id = AgentId(polling.id.parse().unwrap());
    let generation = server.try_agent(&polling.id).unwrap()["sessionGeneration"]
        .as_i64()
        .unwrap()
        .to_string();
    let refused = rt
        .block_on(as_old.send_with(
            &AgentTaskPollRequest {
                contract_version: "agent-task-transport/v2".into(),
                agent_id,
                capabilities: vec![],
                start_handshake: true,
            },
            &[(GENERATION_HEADER, &generation)],
            None,
        ))
        .expect_err("a v2 poll");
    assert_eq!(
        (refused.status(), refused.code()),
        (Some(422), Some("UNSUPPORTED_CONTRACT_VERSION")),
        "{refused}"
    );
    let task_id = TaskId(uuid::Uuid::new_v4());
    let mut envelope = AgentTaskResultEnvelope {
        contract_version: "agent-task-transport/v2".into(),
        agent_id,
        task_id,
        assignment_id: None,
        success: true,
        message: None,
        result_data: None,
        duration: "00:00:01".into(),
        completed_at: time::OffsetDateTime::now_utc(),
        signature_algorithm: ALG_ECDSA_SHA256.into(),
        signature: None,
    };
    let pem = std::fs::read_to_string(polling.state_dir.join("agent.pem")).unwrap();
    let key = berth_crypto::AgentKey::from_pem(&pem).unwrap();
    envelope.signature = Some(key.sign_base64(&envelope.signing_input().unwrap()).unwrap());
    let refused = rt
        .block_on(as_old.send_with(
            &SubmitResult::new(envelope),
            &[(GENERATION_HEADER, &generation)],
            None,
        ))
        .expect_err("a v2 result");
    assert_eq!(
        (refused.status(), refused.code()),
        (Some(422), Some("UNSUPPORTED_CONTRACT_VERSION")),
        "{refused}"
    );
    polling.proc.assert_running();
    streaming.proc.assert_running();

    // Upgrading in place: this tree's agent takes the old one's state dir (identity, journal,
    // stickers) over, with the same id and a newer session.
    let old_generation: i64 = generation.parse().unwrap();
    assert_eq!(polling.proc.terminate(), 0, "{}", polling.proc.stderr());
    let upgraded = Agent::restart(
        &server.url,
        &polling.state_dir,
        &polling.sticker_dir,
        "upgraded",
        &["--allow-command", &echo],
    );
    polling.proc = upgraded;
    let row = server.wait_agent(&polling.id, "the upgraded agent online", |a| {
        a["status"] == "online" && a["sessionGeneration"].as_i64() > Some(old_generation)
    });
    assert_eq!(
        row["version"],
        env!("CARGO_PKG_VERSION"),
        "the row shows what the agent now runs: {row:#}"
    );
    wait_next_heartbeat(&server, &polling, &row);
    let task = run_verified(
        &server,
        &polling,
        "execute-command",
        &json!({"command": [echo, "upgraded"]}),
    );
    assert_eq!(
        task["result"]["outputs"]["stdout"], "upgraded\n",
        "{task:#}"
    );
    polling.proc.assert_running();
    streaming.proc.assert_running();
    drop((streaming, polling, server));
    drop(cleanup);
}
