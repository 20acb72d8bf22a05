//! Environments and deployments end to end: `berth server` (SQLite, temp data dir), four real
//! `berth-agent`s on the host's Docker engine (three in `qa`, one in `prod`), releases of
//! busybox images pushed to the local registry, and the admin CLI. Each target gets its own
//! container name and port from its labels (`{{target.name}}`, `{{target.labels.port}}` in the
//! release's config), since all agents share one engine.
//!
//! One scenario, in order, because each step starts from the state the previous one left:
//! happy rollout (r1, then r2 with a dry run first), SSE resume, a failed rollout (r3 unhealthy
//! on the second target only) with its rollback and audit trail, rollback and pin, promotion
//! gate and approvals into prod, drift, and an agent killed mid-wave. Bad input has its own test.

#![cfg(unix)]

mod common;

use std::path::Path;
use std::time::Duration;

use berth_proto::event::EventQuery;
use berth_test_utils::docker::{self as fixtures, make_image, Cleanup, Image, Variant};
use berth_test_utils::free_port;
use common::*;
use serde_json::{json, Value};

/// A deployment of one target (pull, start, health) on a loaded 2-core host, times targets.
const ROLLOUT: Duration = Duration::from_secs(240);

fn http_body(port: u16) -> Option<String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(fixtures::http_body(port))
}

fn wait_serving(port: u16, body: &str) {
    wait_for(
        ROLLOUT,
        &format!("port {port} to serve {body:?}"),
        || match http_body(port) {
            Some(b) if b == body => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
}

fn docker_agent(state_dir: &Path, args: &[&str]) -> std::process::Command {
    let mut cmd = command(BERTH_AGENT);
    cmd.arg("--state-dir").arg(state_dir).args(args);
    cmd
}

struct Target {
    /// Runs while the target is in use; dropped (killed) with it.
    _agent: Agent,
    port: u16,
}

/// Registers a Docker agent named `name` with `labels` and waits until it is online.
fn target(server: &Server, root: &Path, name: &str, labels: &[String]) -> Agent {
    let agent = Agent::spawn_registered(server, root, name, &[], docker_agent);
    let mut args = vec!["agents", "label", agent.id.as_str()];
    args.extend(labels.iter().map(String::as_str));
    server.cli(&args);
    server.wait_agent(&agent.id, "online with docker", |a| {
        a["status"] == "online"
            && a["capabilities"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["name"] == "docker"))
    });
    agent
}

/// `berth <args>` to its end: (exit code, stdout, stderr).
/// Creates release `name` of one component `web` from `image`; the container name and the
/// ports come from each target's labels, the health check URL from its label `health`.
fn release(server: &Server, prefix: &str, name: &str, image: &Image) -> Value {
    release_checked_on(server, prefix, name, image, "health")
}

/// Like [`release`], with the health check URL's port from the label `health_label`.
fn release_checked_on(
    server: &Server,
    prefix: &str,
    name: &str,
    image: &Image,
    health_label: &str,
) -> Value {
    let config = json!({
        "containerName": format!("{prefix}-{{{{target.name}}}}"),
        "ports": ["127.0.0.1:{{target.labels.port}}:8080/tcp"],
        "restartPolicy": "no",
        "healthCheck": {"type": "http", "interval": 1,
                        "url": format!("http://127.0.0.1:{{{{target.labels.{health_label}}}}}/")},
    });
    server.cli(&[
        "release",
        "create",
        name,
        "--image",
        &format!("web={}", image.reference()),
        "--config",
        &format!("web={config}"),
    ])
}

fn deployment(server: &Server, id: &str) -> Value {
    server.cli(&["deployment", "show", id])
}

fn wait_deployment(server: &Server, id: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
    wait_for(ROLLOUT, what, || {
        let d = deployment(server, id);
        if check(&d) {
            Ok(d)
        } else {
            Err(d.to_string())
        }
    })
}

fn target_of<'a>(d: &'a Value, name: &str) -> &'a Value {
    d["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["agentName"] == name)
        .unwrap_or_else(|| panic!("no target {name} in {d}"))
}

/// `berth deploy RELEASE --env ENV --wait`: its exit code and output.
fn deploy_wait(server: &Server, release: &str, env: &str) -> (i32, String, String) {
    server.run_as(
        &server.admin_token,
        &["deploy", release, "--env", env, "--wait"],
        ROLLOUT,
    )
}

#[test]
fn environments_roll_out_roll_back_and_prove_it() {
    let Some(env) = fixtures::env("environments_roll_out_roll_back_and_prove_it") else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let prefix = cleanup.prefix.clone();
    let tmp = tempdir();
    let server = Server::start(&tmp.path().join("data"), &[]);

    // Three qa targets and a prod target. r3 checks its health on the port of the label
    // `r3health`, which on qa-2 is a port nobody serves: r3 is unhealthy there only.
    let dead_port = free_port();
    let mut targets = Vec::new();
    for name in ["qa-1", "qa-2", "qa-3"] {
        let port = free_port();
        let r3_health = if name == "qa-2" { dead_port } else { port };
        let labels = vec![
            "env=qa".to_string(),
            format!("port={port}"),
            format!("health={port}"),
            format!("r3health={r3_health}"),
        ];
        let agent = target(&server, tmp.path(), name, &labels);
        targets.push(Target {
            _agent: agent,
            port,
        });
    }
    let prod_port = free_port();
    let _prod = target(
        &server,
        tmp.path(),
        "prod-1",
        &[
            "env=prod".into(),
            format!("port={prod_port}"),
            format!("health={prod_port}"),
        ],
    );

    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let v2 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v2", None);
    let v3 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v3", None);
    release(&server, &prefix, "r1", &v1);
    release(&server, &prefix, "r2", &v2);
    release_checked_on(&server, &prefix, "r3", &v3, "r3health");

    server.cli(&[
        "env",
        "create",
        "qa",
        "--tier",
        "qa",
        "--selector",
        "env=qa",
        "--max-parallel",
        "1",
        "--health-timeout",
        "15",
        "--drift-interval",
        "2s",
    ]);

    // --- Happy rollout: r1, then r2; each target serves the new version. ---
    let (code, out, err) = deploy_wait(&server, "r1", "qa");
    assert_eq!(code, 0, "deploy r1: {out}\n{err}");
    for t in &targets {
        wait_serving(t.port, "v1");
    }
    // The plan changes nothing and shows one target per wave with the new digest.
    let plan = server.cli(&["deploy", "r2", "--env", "qa", "--dry-run"]);
    assert_eq!(plan["waves"].as_array().unwrap().len(), 3, "{plan}");
    assert_eq!(
        plan["waves"][0]["targets"][0]["components"][0]["newDigest"],
        v2.digest.as_str()
    );
    assert_eq!(plan["rollbackRelease"], "r1");
    let listed = server.cli(&["deployment", "ls", "--env", "qa"]);
    assert_eq!(
        listed.as_array().unwrap().len(),
        1,
        "a dry run created a deployment"
    );

    let (code, out, err) = deploy_wait(&server, "r2", "qa");
    assert_eq!(code, 0, "deploy r2: {out}\n{err}");
    assert!(out.contains("succeeded"), "{out}");
    for t in &targets {
        wait_serving(t.port, "v2");
    }
    let qa = server.cli(&["env", "show", "qa"]);
    assert_eq!(qa["currentRelease"], "r2");
    assert_eq!(qa["previousRelease"], "r1");

    // --- SSE resume: the r2 deployment's events, read in two halves with Last-Event-ID, are
    // the whole stream exactly once. ---
    let r2_id = server.cli(&["deployment", "ls", "--env", "qa"])[1]["id"]
        .as_str()
        .unwrap()
        .to_string();
    sse_resume_sees_every_event_once(&server, &r2_id);
    // Each target went through the steps its agent reported, in order. A pass sees each
    // state it runs on, so a step shorter than a pass may not show; the order always holds.
    let order = [
        "queued",
        "deploying",
        "pulling",
        "starting",
        "health",
        "succeeded",
    ];
    for target in ["qa-1", "qa-2", "qa-3"] {
        let phases = target_phases(&server, &r2_id, target);
        let ranks: Vec<usize> = phases
            .iter()
            .map(|p| order.iter().position(|o| o == p).expect("a known phase"))
            .collect();
        assert!(
            ranks.windows(2).all(|w| w[0] < w[1])
                && phases.first().map(String::as_str) == Some("queued")
                && phases.last().map(String::as_str) == Some("succeeded")
                && phases
                    .iter()
                    .any(|p| ["pulling", "starting", "health"].contains(&p.as_str())),
            "{target}'s phases: {phases:?}"
        );
    }

    // --- Failed rollout: r3 is unhealthy on qa-2 only. qa-1 goes back to r2, qa-3 is never
    // touched. ---
    let (code, out, err) = deploy_wait(&server, "r3", "qa");
    assert_ne!(code, 0, "r3 must fail: {out}");
    assert!(
        err.contains("qa-2") && err.contains("HEALTH_CHECK_FAILED"),
        "{err}"
    );
    let failed_id = server.cli(&["deployment", "ls", "--env", "qa"])[2]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let failed = deployment(&server, &failed_id);
    assert_eq!(failed["state"], "rolled_back", "{failed}");
    assert_eq!(failed["rollbackRelease"], "r2");
    assert_eq!(target_of(&failed, "qa-1")["phase"], "rolled_back");
    assert_eq!(target_of(&failed, "qa-3")["phase"], "skipped");
    assert!(target_of(&failed, "qa-3")["tasks"]
        .as_array()
        .unwrap()
        .is_empty());
    wait_serving(targets[0].port, "v2");
    wait_serving(targets[2].port, "v2");
    assert_eq!(server.cli(&["env", "show", "qa"])["currentRelease"], "r2");
    // The audit log holds the sequence: the deployment, qa-1's r3 result, qa-2's failure, and
    // qa-1's rollback result, in that order.
    audit_shows_the_failed_rollout(&server, &failed);

    // --- Rollback and pin: back to the previous successful release (r1), pinned. ---
    let (code, out, err) = server.run_as(
        &server.admin_token,
        &["rollback", "--env", "qa", "--wait"],
        ROLLOUT,
    );
    assert_eq!(code, 0, "rollback: {out}\n{err}");
    for t in &targets {
        wait_serving(t.port, "v1");
    }
    let qa = server.cli(&["env", "show", "qa"]);
    assert_eq!(qa["pinnedRelease"], "r1", "{qa}");
    let refused = server
        .try_cli(&["deploy", "r3", "--env", "qa"])
        .expect_err("a pinned environment refuses another release");
    assert!(refused.contains("ENVIRONMENT_PINNED"), "{refused}");
    server.cli(&["env", "unpin", "qa"]);
    let (code, out, err) = deploy_wait(&server, "r2", "qa");
    assert_eq!(code, 0, "deploy r2 after unpin: {out}\n{err}");

    // --- Promotion gate and approvals into prod. ---
    server.cli(&[
        "env",
        "create",
        "prod",
        "--tier",
        "prod",
        "--selector",
        "env=prod",
        "--promote-from",
        "qa",
        "--health-timeout",
        "15",
    ]);
    let refused = server
        .try_cli(&["deploy", "r3", "--env", "prod"])
        .expect_err("r3 never succeeded in qa");
    assert!(refused.contains("PROMOTION_REQUIRED"), "{refused}");
    let waiting = server.cli(&["deploy", "r2", "--env", "prod"]);
    assert_eq!(waiting["state"], "awaiting_approval", "{waiting}");
    let prod_id = waiting["id"].as_str().unwrap().to_string();
    let second = server
        .try_cli(&["deploy", "r2", "--env", "prod"])
        .expect_err("one active deployment per environment");
    assert!(second.contains("DEPLOYMENT_IN_PROGRESS"), "{second}");
    let own = server
        .try_cli(&["deployment", "approve", &prod_id])
        .expect_err("self-approval");
    assert!(own.contains("SELF_APPROVAL"), "{own}");
    let approver = server.cli(&[
        "api-token",
        "create",
        "--role",
        "deployer",
        "--name",
        "approver",
    ])["token"]
        .as_str()
        .unwrap()
        .to_string();
    let approved = server
        .try_cli_as(&approver, &["deployment", "approve", &prod_id])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(approved["approvals"].as_array().unwrap().len(), 1);
    wait_deployment(&server, &prod_id, "the prod deployment to succeed", |d| {
        d["state"] == "succeeded"
    });
    wait_serving(prod_port, "v2");

    // --- Drift: qa-3's container replaced by hand is reported within a read-back period. ---
    let name = format!("{prefix}-qa-3");
    let (ok, out) = fixtures::docker(&["rm", "-f", &name]);
    assert!(ok, "{out}");
    let (ok, out) = fixtures::docker(&[
        "run",
        "-d",
        "--name",
        &name,
        "-p",
        &format!("127.0.0.1:{}:8080", targets[2].port),
        &v3.reference(),
    ]);
    assert!(ok, "docker run by hand: {out}");
    wait_for(ROLLOUT, "qa-3 reported drifted", || {
        let status = server.cli(&["env", "status", "qa"]);
        let t = status["targets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["agentName"] == "qa-3")
            .cloned()
            .unwrap();
        if t["drift"] == "drifted" {
            Ok(())
        } else {
            Err(status.to_string())
        }
    });
    let status = server.cli(&["env", "status", "qa"]);
    for t in status["targets"].as_array().unwrap() {
        if t["agentName"] != "qa-3" {
            assert_eq!(t["drift"], "in_sync", "{status}");
        }
    }
    // Reported, not corrected: qa has no autoHeal, so no deployment was started.
    assert_eq!(
        server
            .cli(&["deployment", "ls", "--env", "qa"])
            .as_array()
            .unwrap()
            .len(),
        5
    );

    // --- Cancel: a running deployment stops after its running wave. ---
    let running = server.cli(&["deploy", "r1", "--env", "qa"]);
    let id = running["id"].as_str().unwrap().to_string();
    wait_deployment(&server, &id, "wave 0 to start", |d| {
        !matches!(
            target_of(d, "qa-1")["phase"].as_str(),
            Some("waiting" | "queued")
        )
    });
    let cancelling = server.cli(&["deployment", "cancel", &id]);
    assert_eq!(cancelling["cancelRequested"], true, "{cancelling}");
    let cancelled = wait_deployment(&server, &id, "the deployment to stop", |d| {
        d["state"] != "running"
    });
    assert_eq!(cancelled["state"], "cancelled", "{cancelled}");
    assert_eq!(target_of(&cancelled, "qa-1")["phase"], "succeeded");
    for later in ["qa-2", "qa-3"] {
        assert_eq!(
            target_of(&cancelled, later)["phase"],
            "skipped",
            "{cancelled}"
        );
    }
    wait_serving(targets[0].port, "v1");
    wait_serving(targets[1].port, "v2");
    // A cancelled deployment does not become the environment's release.
    assert_eq!(server.cli(&["env", "show", "qa"])["currentRelease"], "r2");
    drop(targets);
}

/// Reads the deployment's events with `follow=false` in one go, then in two halves (the second
/// resuming with `Last-Event-ID`), and compares.
fn sse_resume_sees_every_event_once(server: &Server, deployment: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = server.api();
    let query = EventQuery {
        deployment: Some(deployment.parse().unwrap()),
        follow: Some(false),
        ..EventQuery::default()
    };
    let read = |after: Option<u64>, max: usize| {
        rt.block_on(async {
            let mut stream = client
                .events(&query, after, Duration::from_secs(30))
                .await
                .unwrap();
            let mut ids = Vec::new();
            while ids.len() < max {
                match stream.next().await.unwrap() {
                    Some(e) => ids.push(e.id),
                    None => break,
                }
            }
            ids
        })
    };
    let all = read(None, usize::MAX);
    assert!(
        all.len() >= 7,
        "a 3-target deployment has its states and phases: {all:?}"
    );
    let first = read(None, 3);
    let rest = read(first.last().copied(), usize::MAX);
    let resumed: Vec<u64> = first.into_iter().chain(rest).collect();
    assert_eq!(resumed, all, "resume lost or repeated events");
}

/// The phases one target's `deployment.target` events carried, in order.
fn target_phases(server: &Server, deployment: &str, target: &str) -> Vec<String> {
    let agent = server.cli(&["deployment", "show", deployment])["targets"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["agentName"] == target)
        .unwrap()["agentId"]
        .as_str()
        .unwrap()
        .to_string();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let client = server.api();
    let query = EventQuery {
        deployment: Some(deployment.parse().unwrap()),
        follow: Some(false),
        ..EventQuery::default()
    };
    rt.block_on(async {
        let mut stream = client
            .events(&query, None, Duration::from_secs(30))
            .await
            .unwrap();
        let mut phases = Vec::new();
        while let Some(e) = stream.next().await.unwrap() {
            if e.kind == "deployment.target" && e.data["agentId"] == agent.as_str() {
                phases.push(e.data["phase"].as_str().unwrap().to_string());
            }
        }
        phases
    })
}

fn audit_shows_the_failed_rollout(server: &Server, failed: &Value) {
    let tmp = tempdir();
    let file = tmp.path().join("audit.jsonl");
    let (code, out, err) = server.run_as(&server.admin_token, &["audit", "export"], EXIT);
    assert_eq!(code, 0, "{err}");
    std::fs::write(&file, &out).unwrap();
    let entries: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let id = failed["id"].as_str().unwrap();
    let qa1 = target_of(failed, "qa-1");
    let qa2 = target_of(failed, "qa-2");
    let seq = |pred: &dyn Fn(&Value) -> bool, what: &str| -> u64 {
        entries
            .iter()
            .find(|e| pred(e))
            .unwrap_or_else(|| panic!("no audit entry for {what}"))["seq"]
            .as_u64()
            .unwrap()
    };
    let result_of = |task: &Value| {
        let task = task.as_str().unwrap().to_string();
        move |e: &Value| e["action"] == "task.result" && e["subject"] == task.as_str()
    };
    let created = seq(
        &|e| e["action"] == "deployment.create" && e["subject"] == id,
        "deployment.create",
    );
    let qa1_deployed = seq(&result_of(&qa1["tasks"][0]), "qa-1's r3 result");
    let qa2_failed = seq(&result_of(&qa2["tasks"][0]), "qa-2's failure");
    let qa1_rolled_back = seq(&result_of(&qa1["rollbackTasks"][0]), "qa-1's rollback");
    assert!(
        created < qa1_deployed && qa1_deployed < qa2_failed && qa2_failed < qa1_rolled_back,
        "{created} {qa1_deployed} {qa2_failed} {qa1_rolled_back}"
    );
    let (code, out, err) = server.run_as(
        &server.admin_token,
        &["audit", "verify", file.to_str().unwrap()],
        EXIT,
    );
    assert_eq!(code, 0, "audit verify: {out}\n{err}");
}

/// Every refusal names its code: an unknown release or environment, an environment that
/// selects no agent, targets without Docker, and a tag that does not resolve.
#[test]
fn deployments_refuse_bad_input_with_codes() {
    let Some(env) = fixtures::env("deployments_refuse_bad_input_with_codes") else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let tmp = tempdir();
    let server = Server::start(&tmp.path().join("data"), &[]);
    // The shared harness's agents see no Docker engine.
    let plain = Agent::register(&server, tmp.path(), "plain", &[]);
    server.cli(&["agents", "label", plain.id.as_str(), "env=nodocker"]);
    let image = make_image(
        &env.registry,
        &cleanup.prefix,
        "web",
        Variant::Healthy,
        "x",
        None,
    );
    server.cli(&[
        "release",
        "create",
        "r1",
        "--image",
        &format!("web={}", image.reference()),
    ]);
    for (name, selector) in [("empty", "env=nobody"), ("nodocker", "env=nodocker")] {
        server.cli(&[
            "env",
            "create",
            name,
            "--tier",
            "dev",
            "--selector",
            selector,
        ]);
    }
    let refused = |args: &[&str], code: &str| {
        let err = server.try_cli(args).expect_err("must be refused");
        assert!(err.contains(code), "expected {code}: {err}");
    };
    refused(&["deploy", "nope", "--env", "empty"], "RELEASE_NOT_FOUND");
    refused(&["deploy", "r1", "--env", "nope"], "ENVIRONMENT_NOT_FOUND");
    refused(&["deploy", "r1", "--env", "empty"], "NO_TARGETS");
    refused(&["deploy", "r1", "--env", "nodocker"], "CAPABILITY_MISSING");
    refused(
        &["deploy", "r1", "--env", "empty", "--dry-run"],
        "NO_TARGETS",
    );
    refused(
        &[
            "release",
            "create",
            "r2",
            "--image",
            &format!("web={}:no-such-tag", image.repository),
        ],
        "DIGEST_UNRESOLVABLE",
    );
    refused(
        &[
            "env",
            "create",
            "bad",
            "--tier",
            "dev",
            "--selector",
            "a=b",
            "--max-parallel",
            "0",
        ],
        "INVALID_REQUEST",
    );
    refused(&["rollback", "--env", "empty"], "NO_PREVIOUS_RELEASE");
    // No deployment was created by any of them.
    assert!(server
        .cli(&["deployment", "ls"])
        .as_array()
        .unwrap()
        .is_empty());
}

/// Answers every request on `port` with 200 until the test ends: a health endpoint the test
/// switches on.
fn serve_ok(port: u16) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            let _ = conn
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok");
        }
    });
}

/// The agent dies while its target is health-checking: the task becomes `unknown` when its lease
/// ends, its read-back finds no sticker, and the deployment holds in `running` with the target
/// `unknown` (never counted as success) until an operator retries the task, which then succeeds
/// and lets the deployment finish. Then, with `autoHeal`, a container removed by hand comes back.
#[test]
fn an_agent_killed_mid_wave_holds_the_deployment_on_unknown() {
    let Some(env) = fixtures::env("an_agent_killed_mid_wave_holds_the_deployment_on_unknown")
    else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let prefix = cleanup.prefix.clone();
    let tmp = tempdir();
    // A lost delivery is noticed when its lease (the task timeout plus this grace) ends.
    let server = Server::start(&tmp.path().join("data"), &["--lease-grace-secs", "1"]);
    let port = free_port();
    let health = free_port();
    let mut agent = target(
        &server,
        tmp.path(),
        "k1",
        &[
            "env=k".into(),
            format!("port={port}"),
            format!("health={health}"),
        ],
    );
    let image = make_image(&env.registry, &prefix, "web", Variant::Healthy, "k", None);
    release(&server, &prefix, "r1", &image);
    server.cli(&[
        "env",
        "create",
        "k",
        "--tier",
        "dev",
        "--selector",
        "env=k",
        "--health-timeout",
        "15",
        "--task-timeout",
        "20",
        "--auto-heal",
        "--drift-interval",
        "2s",
    ]);
    let id = server.cli(&["deploy", "r1", "--env", "k"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let d = wait_deployment(&server, &id, "k1 to wait for its health check", |d| {
        target_of(d, "k1")["phase"] == "health"
    });
    let task = target_of(&d, "k1")["tasks"][0]
        .as_str()
        .unwrap()
        .to_string();
    // The container is up and the agent waits for health: kill it there.
    wait_for(ROLLOUT, "the container to serve", || {
        http_body(port).ok_or_else(|| "not yet".to_string())
    });
    agent.proc.kill9();
    let stickers = agent.sticker_dir.display().to_string();
    agent.proc = Proc::spawn(
        "berth-agent k1 (restarted)",
        docker_agent(
            &agent.state_dir,
            &["--server", &server.url, "--sticker-dir", &stickers],
        ),
    );
    let decided = wait_for(ROLLOUT, "the read-back to decide the lost task", || {
        let t = server.task(&task);
        match (t["state"].as_str(), t["result"]["found"].as_bool()) {
            (Some("unknown"), Some(false)) => Ok(t),
            _ => Err(t.to_string()),
        }
    });
    assert!(decided["result"]["readBackTaskId"].is_string(), "{decided}");
    let held = deployment(&server, &id);
    assert_eq!(held["state"], "running", "{held}");
    assert_eq!(target_of(&held, "k1")["phase"], "unknown", "{held}");

    serve_ok(health);
    server.cli(&["task", "retry", &task]);
    let done = wait_deployment(&server, &id, "the deployment to succeed", |d| {
        d["state"] == "succeeded"
    });
    assert_eq!(target_of(&done, "k1")["phase"], "succeeded");
    wait_serving(port, "k");

    // `autoHeal`: a container removed by hand is put back by a `heal` deployment of the
    // current release.
    let (ok, out) = fixtures::docker(&["rm", "-f", &format!("{prefix}-k1")]);
    assert!(ok, "{out}");
    let healed = wait_for(ROLLOUT, "a heal deployment to succeed", || {
        let list = server.cli(&["deployment", "ls", "--env", "k"]);
        match list
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["kind"] == "heal")
        {
            Some(d) if d["state"] == "succeeded" => Ok(d.clone()),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(healed["release"], "r1");
    wait_serving(port, "k");
}

/// Issue 14 against deployments: a cordoned target is left out of the plan (`skipped`) and of
/// the deployment; a suspended target holds a running deployment (its task stays queued, the
/// agent keeps heartbeating) until it is resumed; a drain waits for the deployment's task.
#[test]
fn cordoned_targets_are_skipped_and_a_suspended_one_holds_the_wave() {
    let Some(env) =
        fixtures::env("cordoned_targets_are_skipped_and_a_suspended_one_holds_the_wave")
    else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let prefix = cleanup.prefix.clone();
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let mut ports = Vec::new();
    let mut agents = Vec::new();
    for name in ["c1", "c2"] {
        let port = free_port();
        let labels = vec![
            "env=c".to_string(),
            format!("port={port}"),
            format!("health={port}"),
        ];
        agents.push(target(&server, tmp.path(), name, &labels));
        ports.push(port);
    }
    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "c1", None);
    let v2 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "c2", None);
    release(&server, &prefix, "r1", &v1);
    release(&server, &prefix, "r2", &v2);
    server.cli(&[
        "env",
        "create",
        "c",
        "--tier",
        "dev",
        "--selector",
        "env=c",
        "--health-timeout",
        "15",
    ]);

    // Cordoned: in no wave of the plan, named under `skipped`, and not deployed to.
    server.cli(&["agents", "cordon", &agents[1].id]);
    let plan = server.cli(&["deploy", "r1", "--env", "c", "--dry-run"]);
    assert_eq!(plan["skipped"][0]["agentName"], "c2", "{plan}");
    assert_eq!(plan["skipped"][0]["reason"], "AGENT_CORDONED", "{plan}");
    let waved: Vec<&Value> = plan["waves"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["targets"].as_array().unwrap())
        .collect();
    assert_eq!(waved.len(), 1, "{plan}");
    assert_eq!(waved[0]["agentName"], "c1", "{plan}");
    let (code, out, err) = deploy_wait(&server, "r1", "c");
    assert_eq!(code, 0, "{out}\n{err}");
    wait_serving(ports[0], "c1");
    assert!(
        http_body(ports[1]).is_none(),
        "the cordoned target got nothing"
    );
    let d = server.cli(&["deployment", "ls", "--env", "c"]);
    let id = d[0]["id"].as_str().unwrap().to_string();
    let d = deployment(&server, &id);
    assert_eq!(d["targets"].as_array().unwrap().len(), 1, "{d}");

    // Suspended mid-deployment: its task is queued and stays queued while it heartbeats.
    let suspended = server.cli(&["agents", "suspend", &agents[0].id]);
    assert_eq!(suspended["status"], "blocked", "{suspended}");
    let id = server.cli(&["deploy", "r2", "--env", "c"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let d = wait_deployment(&server, &id, "c1's task queued", |d| {
        target_of(d, "c1")["phase"] == "queued"
    });
    let task = target_of(&d, "c1")["tasks"][0]
        .as_str()
        .unwrap()
        .to_string();
    let before = str_of(&suspended, "lastHeartbeat").to_string();
    server.wait_agent(&agents[0].id, "heartbeats while suspended", |a| {
        a["lastHeartbeat"].as_str().is_some_and(|h| h != before)
    });
    assert_eq!(server.task(&task)["state"], "pending");
    assert_eq!(deployment(&server, &id)["state"], "running");

    // Drain while the deployment waits on it, then resume: the drain ends with the wave.
    let mut cmd = command(BERTH);
    cmd.args(["agents", "drain", &agents[0].id, "--timeout", "200"])
        .env("BERTH_SERVER", &server.url)
        .env("BERTH_TOKEN", &server.admin_token)
        .env("BERTH_CA_FILE", server.data_dir.join("ca.crt"));
    let drain = Proc::spawn("berth agents drain", cmd);
    server.wait_agent(&agents[0].id, "the drain's cordon", |a| {
        a["cordoned"] == true
    });
    server.cli(&["agents", "resume", &agents[0].id]);
    wait_deployment(&server, &id, "the deployment to succeed", |d| {
        d["state"] == "succeeded"
    });
    wait_serving(ports[0], "c2");
    let out = drain.finish(ROLLOUT);
    assert!(out.status.success(), "drain: {}", out.stderr);
    assert!(out.stdout.contains("drained"), "{}", out.stdout);
}
