//! End-to-end deployments through real processes: `berth server` (SQLite, temp data dir), a
//! `berth-agent` that talks to the real Docker engine, the admin CLI (`berth … -o json`), and
//! images pulled by digest from the local registries of `scripts/registry.sh`.
//!
//! The image and cleanup fixtures are the executor tests' own (`berth_test_utils::docker`): images
//! made `FROM scratch` with busybox via `docker import`, pushed, and removed locally so every
//! deployment pulls. Every name a test creates starts with its `berth-e2e-<random>` prefix and a
//! [`Cleanup`] guard removes those containers, images, volumes and networks on every path; the
//! agent and server are killed (guards) before that.
//!
//! Without an engine or the `BERTH_TEST_REGISTRY*` variables a test prints a SKIP line, except
//! under `CI=true` or `BERTH_REQUIRE_SERVICES=1` (`scripts/test.sh`), where it fails.

#![cfg(unix)]

mod common;

use std::path::Path;
use std::time::Duration;

use berth_test_utils::deploy::{docker_check, http_check};
use berth_test_utils::docker::{
    self as fixtures, container_id, container_names, make_image, Cleanup, Env, Image, Variant,
};
use berth_test_utils::files_containing;
use common::*;
use serde_json::{json, Value};

/// How long a deployment (pull, create, health check) may take on a loaded 2-core host.
const DEPLOY: Duration = Duration::from_secs(120);

/// The registries and the engine, or `None` (SKIP; a failure when services are required).
fn docker_env(test: &str) -> Option<Env> {
    fixtures::env(test)
}

/// The body `GET /` answers on `127.0.0.1:port` with 200, if it does.
fn http_body(port: u16) -> Option<String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(fixtures::http_body(port))
}

fn wait_serving(port: u16, body: &str) {
    wait_for(
        DEPLOY,
        &format!("port {port} to serve {body:?}"),
        || match http_body(port) {
            Some(b) if b == body => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
}

// ---------------------------------------------------------------------------------------------
// An agent with the host's Docker engine (the shared harness points agents at no engine)
// ---------------------------------------------------------------------------------------------

fn docker_agent_command(state_dir: &Path, args: &[&str]) -> std::process::Command {
    let mut cmd = command(BERTH_AGENT);
    cmd.arg("--state-dir").arg(state_dir).args(args);
    cmd
}

fn wait_agent_up(server: &Server, id: &str) -> Value {
    server.wait_agent(id, "the agent online with a heartbeat", |a| {
        matches!(a["status"].as_str(), Some("online" | "degraded"))
            && a["lastHeartbeat"].is_string()
    })
}

/// Registers and runs `name` like [`Agent::register`], but with the host's Docker engine.
fn register_docker_agent(server: &Server, root: &Path, name: &str, extra: &[&str]) -> Agent {
    let agent = Agent::spawn_registered(server, root, name, extra, docker_agent_command);
    wait_agent_up(server, &agent.id);
    agent
}

/// Another process with the agent's identity and sticker dir (no `--register`).
fn restart_docker_agent(server: &Server, agent: &Agent, name: &str, extra: &[&str]) -> Proc {
    let sticker_arg = agent.sticker_dir.display().to_string();
    let mut args = vec!["--server", &server.url, "--sticker-dir", &sticker_arg];
    args.extend_from_slice(extra);
    Proc::spawn(name, docker_agent_command(&agent.state_dir, &args))
}

/// A server and a Docker agent; dropped in field order: agent, server, then the Docker
/// objects, then the temp dir.
struct World {
    agent: Agent,
    server: Server,
    cleanup: Cleanup,
    env: Env,
    _tmp: tempfile::TempDir,
}

impl World {
    fn start(test: &str, server_args: &[&str], agent_args: &[&str]) -> Option<World> {
        let env = docker_env(test)?;
        let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
        let tmp = tempdir();
        let server = Server::start(&tmp.path().join("data"), server_args);
        let agent = register_docker_agent(&server, tmp.path(), "deployer", agent_args);
        Some(World {
            agent,
            server,
            cleanup,
            env,
            _tmp: tmp,
        })
    }

    fn prefix(&self) -> &str {
        &self.cleanup.prefix
    }

    fn image(&self, variant: Variant, content: &str) -> Image {
        make_image(
            &self.env.registry,
            self.prefix(),
            "web",
            variant,
            content,
            None,
        )
    }

    /// `berth task create --type T --agent ID --payload JSON [--timeout-secs N] [--credential k=v…]`.
    fn create(&self, task_type: &str, payload: &Value, timeout: u32, creds: &[String]) -> String {
        let payload = payload.to_string();
        let timeout = timeout.to_string();
        let mut args = vec![
            "task",
            "create",
            "--type",
            task_type,
            "--agent",
            &self.agent.id,
            "--payload",
            &payload,
            "--timeout-secs",
            &timeout,
        ];
        for c in creds {
            args.extend(["--credential", c]);
        }
        id_of(&self.server.cli(&args))
    }

    /// Waits until the task reaches a final (or `retry_wait`/`unknown`) state.
    fn settle(&self, id: &str) -> Value {
        self.server.wait_task(id, DEPLOY, "a decided state", |t| {
            !matches!(t["state"].as_str(), Some("pending" | "leased"))
        })
    }

    fn run_ok(&self, payload: &Value) -> Value {
        let id = self.create("docker.run", payload, 120, &[]);
        let task = self.settle(&id);
        assert_eq!(task["state"], "succeeded", "{task:#}");
        task
    }
}

fn sticker(agent: &Agent, name: &str) -> Option<Value> {
    let text = std::fs::read_to_string(agent.sticker_dir.join(format!("{name}.json"))).ok()?;
    serde_json::from_str(&text).ok()
}

// ---------------------------------------------------------------------------------------------
// 1. the happy path through the server
// ---------------------------------------------------------------------------------------------

#[test]
fn docker_run_by_digest_succeeds_serves_and_is_inspected() {
    let Some(w) = World::start(
        "docker_run_by_digest_succeeds_serves_and_is_inspected",
        &[],
        &[],
    ) else {
        return;
    };
    let v1 = w.image(Variant::Healthy, "v1");
    let name = format!("{}-web", w.prefix());
    let port = free_port();

    let task = w.run_ok(&v1.deploy(&name, port, http_check(port, 60)));
    assert_eq!(task["readBack"], false, "{task:#}");
    assert_eq!(task["sideEffects"], true, "{task:#}");
    let tries = attempts(&task);
    assert_eq!(tries.len(), 1, "{task:#}");
    assert_eq!(tries[0]["state"], "succeeded", "{task:#}");
    let envelope = &tries[0]["result"];
    assert!(
        envelope["signature"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "the verified, signed envelope: {task:#}"
    );
    assert_eq!(envelope["taskId"], task["id"], "{task:#}");

    let result = &task["result"];
    assert_eq!(result["success"], true, "{task:#}");
    let id = container_id(&name).expect("the container exists");
    assert_eq!(result["outputs"]["containerId"], id.as_str(), "{task:#}");
    for metric in [
        "pullDurationMs",
        "deployDurationMs",
        "healthCheckDurationMs",
    ] {
        assert!(
            result["metrics"][metric].is_u64(),
            "{metric} in {:#}",
            result["metrics"]
        );
    }
    assert_eq!(http_body(port).as_deref(), Some("v1"));
    let written = sticker(&w.agent, &name).expect("the sticker");
    assert_eq!(written["digest"], v1.digest.as_str());
    assert_eq!(written["taskId"], task["id"]);

    let inspect = w.create("inspect", &json!({}), 60, &[]);
    let inspect = w.settle(&inspect);
    assert_eq!(inspect["state"], "succeeded", "{inspect:#}");
    let containers = inspect["result"]["outputs"]["containers"]
        .as_array()
        .unwrap_or_else(|| panic!("no containers in {inspect:#}"));
    let mine = containers
        .iter()
        .find(|c| c["name"] == name.as_str())
        .unwrap_or_else(|| panic!("{name} not listed: {inspect:#}"));
    assert_eq!(mine["id"], id.as_str(), "{mine:#}");
    assert_eq!(mine["state"], "running", "{mine:#}");
    assert_eq!(mine["digest"], v1.digest.as_str(), "{mine:#}");
    assert_eq!(mine["releaseId"], format!("{name}-release").as_str());
    assert_eq!(
        mine["labels"]["berth.digest"],
        v1.digest.as_str(),
        "{mine:#}"
    );
    assert_eq!(
        mine["labels"]["berth.release.name"],
        format!("{name}-1").as_str()
    );
    assert!(mine["labels"]
        .as_object()
        .unwrap()
        .keys()
        .all(|k| k.starts_with("berth.")));
}

// ---------------------------------------------------------------------------------------------
// 2. upgrade, then an unhealthy upgrade that rolls back
// ---------------------------------------------------------------------------------------------

#[test]
fn upgrade_then_unhealthy_upgrade_rolls_back() {
    let Some(w) = World::start("upgrade_then_unhealthy_upgrade_rolls_back", &[], &[]) else {
        return;
    };
    let v1 = w.image(Variant::Healthy, "v1");
    let v2 = w.image(Variant::Healthy, "v2");
    let v3 = w.image(Variant::Unhealthy, "v3");
    let name = format!("{}-web", w.prefix());
    let port = free_port();

    w.run_ok(&v1.deploy(&name, port, docker_check(60)));
    assert_eq!(http_body(port).as_deref(), Some("v1"));

    let task = w.run_ok(&v2.deploy(&name, port, docker_check(60)));
    assert_eq!(
        task["result"]["outputs"]["previousDigest"],
        v1.digest.as_str()
    );
    wait_serving(port, "v2");
    let v2_id = container_id(&name).unwrap();
    assert_eq!(container_names(&name), vec![name.clone()], "v1 is removed");

    let id = w.create(
        "docker.run",
        &v3.deploy(&name, port, docker_check(60)),
        120,
        &[],
    );
    let task = w.settle(&id);
    assert_eq!(task["state"], "failed", "{task:#}");
    assert_eq!(task["errorCode"], "HEALTH_CHECK_FAILED", "{task:#}");
    assert_eq!(task["result"]["retriable"], false, "{task:#}");
    assert_eq!(task["result"]["outputs"]["rolledBack"], true, "{task:#}");
    assert_eq!(attempts(&task).len(), 1, "not retried: {task:#}");
    assert_eq!(
        container_id(&name),
        Some(v2_id),
        "v2 is back under its name"
    );
    wait_serving(port, "v2");
    assert_eq!(
        container_names(&name),
        vec![name.clone()],
        "nothing of v3 is left"
    );
    let written = sticker(&w.agent, &name).expect("the sticker");
    assert_eq!(
        written["digest"],
        v2.digest.as_str(),
        "the sticker still says v2"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. registry failures: a wrong password is final, a registry that is down is retried
// ---------------------------------------------------------------------------------------------

#[test]
fn wrong_registry_password_fails_and_registry_down_is_retried() {
    let Some(w) = World::start(
        "wrong_registry_password_fails_and_registry_down_is_retried",
        &[],
        &[],
    ) else {
        return;
    };
    let v1 = make_image(
        &w.env.auth_registry,
        w.prefix(),
        "web",
        Variant::Healthy,
        "v1",
        Some((&w.env.user, &w.env.password)),
    );
    let name = format!("{}-web", w.prefix());
    let port = free_port();
    let wrong = "not-the-password-e2e-7c1d";
    let id = w.create(
        "docker.run",
        &v1.deploy(&name, port, docker_check(30)),
        120,
        &[
            format!("registryUsername={}", w.env.user),
            format!("registryPassword={wrong}"),
        ],
    );
    let task = w.settle(&id);
    assert_eq!(task["state"], "failed", "{task:#}");
    assert_eq!(task["errorCode"], "REGISTRY_AUTH_FAILED", "{task:#}");
    assert_eq!(task["result"]["retriable"], false, "{task:#}");
    assert!(
        task["result"]["error"]
            .as_str()
            .is_some_and(|m| m.contains("registryPassword")),
        "says what to fix: {task:#}"
    );
    assert!(!task.to_string().contains(wrong), "the password leaked");
    assert_eq!(attempts(&task).len(), 1, "{task:#}");
    assert!(container_id(&name).is_none());

    // The right password works through the server too.
    let id = w.create(
        "docker.run",
        &v1.deploy(&name, port, docker_check(60)),
        120,
        &[
            format!("registryUsername={}", w.env.user),
            format!("registryPassword={}", w.env.password),
        ],
    );
    let task = w.settle(&id);
    assert_eq!(task["state"], "succeeded", "{task:#}");
    assert!(!task.to_string().contains(&w.env.password));
    wait_serving(port, "v1");

    // Registry down: retriable. docker.run has side effects, yet the server puts a retriable
    // failure into retry_wait like any other (store complete_attempt → completion_transition).
    let down = Image {
        repository: format!("127.0.0.1:{}/{}/web", free_port(), w.prefix()),
        digest: v1.digest.clone(),
    };
    let other = format!("{}-other", w.prefix());
    let id = w.create(
        "docker.run",
        &down.deploy(&other, free_port(), docker_check(10)),
        120,
        &[],
    );
    let task = w.settle(&id);
    assert_eq!(task["state"], "retry_wait", "{task:#}");
    assert_eq!(task["errorCode"], "REGISTRY_UNAVAILABLE", "{task:#}");
    assert_eq!(task["result"]["retriable"], true, "{task:#}");
    assert!(task["nextAttemptAt"].is_string(), "{task:#}");
    w.server.cli(&["task", "cancel", &id]);
    let cancelled = w.server.wait_task(&id, DEPLOY, "cancelled", |t| {
        t["state"] == "cancelled" || t["state"] == "failed"
    });
    assert_eq!(cancelled["state"], "cancelled", "{cancelled:#}");
    assert!(container_id(&other).is_none());
    // v1 is untouched by all of this.
    assert_eq!(http_body(port).as_deref(), Some("v1"));
}

// ---------------------------------------------------------------------------------------------
// 4. a lost lease mid-deploy: `unknown`, never re-run; read-back decides
// ---------------------------------------------------------------------------------------------

/// (a) `kill -9` of the agent once the new container exists, while the deploy waits for a
/// health check that cannot pass before the task's 15 s timeout. The lease (15 s + 1 s grace)
/// runs out with the agent dead: `unknown`. The restarted agent's read-back finds no sticker
/// (the deploy never reached step 9), so the task stays `unknown` and nothing deploys again.
#[test]
fn agent_killed_mid_deploy_leaves_the_task_unknown_and_never_reruns_it() {
    let Some(mut w) = World::start(
        "agent_killed_mid_deploy_leaves_the_task_unknown_and_never_reruns_it",
        &["--heartbeat-interval-secs", "1", "--lease-grace-secs", "1"],
        &[],
    ) else {
        return;
    };
    let v1 = w.image(Variant::Healthy, "v1");
    let name = format!("{}-web", w.prefix());
    let never = free_port();
    let id = w.create(
        "docker.run",
        &v1.deploy(&name, free_port(), http_check(never, 120)),
        15,
        &[],
    );
    let created = wait_for(DEPLOY, "the new container", || {
        container_id(&name).ok_or_else(|| w.server.task(&id).to_string())
    });
    w.agent.proc.kill9();
    let task = w.server.task(&id);
    assert_eq!(
        task["state"], "leased",
        "killed before it finished: {task:#}"
    );

    let unknown = w.server.wait_task_state(&id, DEPLOY, "unknown");
    assert_eq!(attempts(&unknown)[0]["state"], "expired", "{unknown:#}");
    assert!(sticker(&w.agent, &name).is_none(), "no sticker was written");

    w.agent.proc = restart_docker_agent(&w.server, &w.agent, "berth-agent (restarted)", &[]);
    let resolved = w.server.wait_task(&id, DEPLOY, "read-back evidence", |t| {
        t["result"]["found"].is_boolean()
    });
    assert_eq!(resolved["state"], "unknown", "{resolved:#}");
    assert_eq!(resolved["readBack"], false, "{resolved:#}");
    assert_eq!(resolved["result"]["found"], false, "{resolved:#}");
    assert_eq!(resolved["result"]["sticker"], Value::Null, "{resolved:#}");
    assert_eq!(attempts(&resolved).len(), 1, "re-run: {resolved:#}");
    let read_backs = w.server.tasks(&["--type", "read-sticker"]);
    assert!(
        read_backs
            .iter()
            .any(|t| t["readBackOf"] == id.as_str() && t["state"] == "succeeded"),
        "{read_backs:?}"
    );
    // Nothing deployed again: the one container is the one the killed agent created.
    assert_eq!(container_names(&name), vec![name.clone()]);
    assert_eq!(container_id(&name), Some(created));
    assert!(sticker(&w.agent, &name).is_none());
    wait_agent_up(&w.server, &w.agent.id);
    w.agent.proc.assert_running();
}

/// (b) A `docker.run` leased into a stopped agent (SIGSTOP while its long-poll is held) never
/// started: the agent confirms a start before it touches the host, so the lost lease (15 s + 1 s
/// grace) provably did nothing and the task is requeued, not `unknown`. Resumed, the agent finds
/// the delivery it holds stale and drops it; the next delivery deploys once.
#[test]
fn a_docker_run_leased_into_a_stopped_agent_is_requeued_and_deploys_once() {
    let Some(mut w) = World::start(
        "a_docker_run_leased_into_a_stopped_agent_is_requeued_and_deploys_once",
        &["--heartbeat-interval-secs", "1", "--lease-grace-secs", "1"],
        &["--max-concurrent-tasks", "1"],
    ) else {
        return;
    };
    let v1 = w.image(Variant::Healthy, "v1");
    let name = format!("{}-web", w.prefix());
    let port = free_port();
    let payload = v1.deploy(&name, port, http_check(port, 14));

    let mut leased = None;
    for _ in 0..3 {
        // A round trip first: afterwards the agent's long-poll is fresh.
        let rt = w.create("inspect", &json!({}), 30, &[]);
        w.server.wait_task_state(&rt, DEPLOY, "succeeded");
        w.agent.proc.signal(libc::SIGSTOP);
        let id = w.create("docker.run", &payload, 15, &[]);
        let got = try_wait_for(Duration::from_secs(15), || {
            let t = w.server.try_task(&id)?;
            if t["state"] == "leased" {
                Ok(())
            } else {
                Err(t.to_string())
            }
        });
        if got.is_ok() {
            leased = Some(id);
            break;
        }
        eprintln!("note: the agent was stopped between two polls; trying again");
        w.agent.proc.signal(libc::SIGCONT);
        w.settle(&id);
        // Start the next try from nothing.
        fixtures::docker(&["rm", "-f", &name]);
    }
    let id = leased.expect("a docker.run leased into the stopped agent");
    let requeued = w.server.wait_task_state(&id, DEPLOY, "retry_wait");
    assert_eq!(attempts(&requeued)[0]["state"], "expired", "{requeued:#}");
    assert_eq!(attempts(&requeued)[0]["startedAt"], Value::Null);
    assert!(container_id(&name).is_none(), "the stopped agent deployed");

    w.agent.proc.signal(libc::SIGCONT);
    let done = w.server.wait_task_state(&id, DEPLOY, "succeeded");
    assert_eq!(done["readBack"], false, "{done:#}");
    assert_eq!(attempts(&done).len(), 2, "{done:#}");
    assert!(attempts(&done)[1]["startedAt"].is_string(), "{done:#}");
    wait_in_log(&mut w.agent.proc, &id, NOT_RUN);
    assert_eq!(http_body(port).as_deref(), Some("v1"));
    assert_eq!(container_names(&name), vec![name.clone()], "deployed once");
    w.agent.proc.assert_running();
}

/// (c) A process fenced after its start does not swap containers. The `docker.run` starts (the
/// server records it), then runs a 6 s pre-deploy hook; meanwhile the agent is stopped and a
/// second process on its state dir takes the session. Resumed, the first process leaves the host
/// alone: its lease check right before the swap is refused (or its fenced heartbeat cancels the
/// work first), no container is created, and it exits. The delivery started, so its lost lease
/// makes the task `unknown`, and read-back (by the new process) finds nothing deployed.
#[test]
fn a_process_fenced_after_its_start_does_not_swap_containers() {
    let Some(mut w) = World::start(
        "a_process_fenced_after_its_start_does_not_swap_containers",
        &["--heartbeat-interval-secs", "1", "--lease-grace-secs", "1"],
        &["--max-concurrent-tasks", "1", "--allow-hook", "/bin/sleep"],
    ) else {
        return;
    };
    let v1 = w.image(Variant::Healthy, "v1");
    let name = format!("{}-web", w.prefix());
    let port = free_port();
    let mut payload = v1.deploy(&name, port, http_check(port, 14));
    payload["hooks"] = json!({"preDeploy": {"command": ["/bin/sleep", "6"]}});
    let id = w.create("docker.run", &payload, 20, &[]);
    wait_for(DEPLOY, "the delivery to start", || {
        let t = w.server.task(&id);
        match attempts(&t).first() {
            Some(a) if a["startedAt"].is_string() => Ok(()),
            _ => Err(t.to_string()),
        }
    });
    w.agent.proc.signal(libc::SIGSTOP);
    let mut second = restart_docker_agent(&w.server, &w.agent, "berth-agent (second)", &[]);
    wait_for(DEPLOY, "the second process to take the session", || {
        let log = second.stderr();
        if log.contains("session acquired") {
            Ok(())
        } else {
            Err(log)
        }
    });
    w.agent.proc.signal(libc::SIGCONT);
    let code = w.agent.proc.wait_code(EXIT);
    let log = w.agent.proc.stderr();
    assert_eq!(code, 1, "the fenced process's exit code:\n{log}");
    // Whichever noticed first stopped it before the swap: the executor's lease check
    // (LEASE_LOST), or the fenced heartbeat, which cancels the running work (CANCELLED).
    assert!(
        log.lines()
            .any(|l| l.contains(&id) && (l.contains("LEASE_LOST") || l.contains("CANCELLED"))),
        "the task went on after the fence:\n{log}"
    );
    assert!(container_id(&name).is_none(), "the fenced process deployed");

    let resolved = w.server.wait_task(&id, DEPLOY, "read-back evidence", |t| {
        t["result"]["found"].is_boolean()
    });
    assert_eq!(resolved["state"], "unknown", "{resolved:#}");
    assert_eq!(resolved["result"]["found"], false, "{resolved:#}");
    assert!(container_id(&name).is_none(), "deployed after all");
    second.assert_running();
}

// ---------------------------------------------------------------------------------------------
// 5. capabilities in the heartbeat
// ---------------------------------------------------------------------------------------------

#[test]
fn heartbeat_reports_docker_and_compose_capabilities() {
    let Some(w) = World::start(
        "heartbeat_reports_docker_and_compose_capabilities",
        &["--heartbeat-interval-secs", "1"],
        &[],
    ) else {
        return;
    };
    let (ok, version) = fixtures::docker(&["version", "--format", "{{.Server.Version}}"]);
    assert!(ok, "{version}");
    let agent = w
        .server
        .wait_agent(&w.agent.id, "docker and compose capabilities", |a| {
            let caps = a["capabilities"].as_array().cloned().unwrap_or_default();
            ["docker", "compose"]
                .iter()
                .all(|n| caps.iter().any(|c| c["name"] == *n))
        });
    let caps = agent["capabilities"].as_array().unwrap();
    let docker = caps.iter().find(|c| c["name"] == "docker").unwrap();
    assert_eq!(docker["version"], version.trim(), "{agent:#}");
    assert_eq!(docker["healthy"], true, "{agent:#}");
    let compose = caps.iter().find(|c| c["name"] == "compose").unwrap();
    assert!(
        compose["version"].as_str().is_some_and(|v| !v.is_empty()),
        "{agent:#}"
    );
    assert_eq!(agent["status"], "online", "{agent:#}");
}

/// Standard base64, as docker's `config.json` stores `user:password`.
fn base64(bytes: &[u8]) -> String {
    const ABC: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The `docker-config-*` registry logins in the agent's credentials dir.
fn logins(agent: &Agent) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(agent.state_dir.join("tmp"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("docker-config-")
        })
        .map(|e| e.path())
        .collect()
}

/// Issue 9 item 6: an agent killed -9 while a compose task holds a registry login leaves it in
/// its own 0700 state dir (never in /tmp), and the restarted agent removes it before anything
/// else; no file under the test's directories holds the password afterwards.
#[test]
fn a_registry_login_left_by_a_killed_agent_is_in_its_state_dir_and_swept_at_restart() {
    let Some(mut w) = World::start(
        "a_registry_login_left_by_a_killed_agent_is_in_its_state_dir_and_swept_at_restart",
        &[],
        &["--allow-hook", "/bin/sh"],
    ) else {
        return;
    };
    let login = Some((w.env.user.as_str(), w.env.password.as_str()));
    let web = make_image(
        &w.env.auth_registry,
        w.prefix(),
        "web",
        Variant::Healthy,
        "private",
        login,
    );
    let root = w.agent.state_dir.parent().unwrap().to_path_buf();
    let (started, release) = (root.join("hook-started"), root.join("hook-release"));
    // The pre-deploy hook holds the task (and so the login) until the test releases it; bounded,
    // since nothing kills it once its agent is gone.
    let hook = format!(
        "touch {}; i=0; while [ ! -e {} ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done",
        started.display(),
        release.display()
    );
    let payload = json!({
        "artifacts": [{"type": "compose_lock", "name": "compose.yml",
                       "content": format!("services:\n  web:\n    image: {}\n", web.reference())}],
        "config": {"projectName": w.prefix(), "deploymentDirectory": root.join("deploy").display().to_string(),
                   "expectedDigests": {"web": web.digest}},
        "hooks": {"preDeploy": {"command": ["/bin/sh", "-c", hook]}},
    });
    let creds = [
        format!("registryUsername={}", w.env.user),
        format!("registryPassword={}", w.env.password),
    ];
    let id = w.create("compose.up", &payload, 120, &creds);
    wait_for(DEPLOY, "the pre-deploy hook to run", || {
        if started.exists() {
            Ok(())
        } else {
            Err(w.server.task(&id).to_string())
        }
    });
    w.agent.proc.kill9();
    std::fs::write(&release, b"").unwrap();

    let auth = base64(format!("{}:{}", w.env.user, w.env.password).as_bytes());
    let left = logins(&w.agent);
    assert_eq!(
        left.len(),
        1,
        "the killed agent's login, in its state dir: {left:?}"
    );
    assert!(!files_containing(&left[0], auth.as_bytes()).is_empty());
    use std::os::unix::fs::PermissionsExt;
    for dir in [w.agent.state_dir.join("tmp"), left[0].clone()] {
        let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", dir.display());
    }

    w.agent.proc = restart_docker_agent(&w.server, &w.agent, "berth-agent (restarted)", &[]);
    // Nothing else removes it now: only the restarted agent's start-up sweep can.
    wait_for(DEPLOY, "the restarted agent to sweep the login", || {
        w.agent.proc.assert_running();
        let left = logins(&w.agent);
        if left.is_empty() {
            Ok(())
        } else {
            Err(format!("{left:?}"))
        }
    });
    wait_agent_up(&w.server, &w.agent.id);
    for secret in [w.env.password.as_bytes(), auth.as_bytes()] {
        let found = files_containing(&root, secret);
        assert!(found.is_empty(), "credentials left on disk: {found:?}");
    }
    w.agent.proc.assert_running();
}

/// Issue 9 item 5 through the agent binary: a hook runs only a program the agent was started
/// with (`--allow-hook`); a deployer's `/bin/sh -c` fails `HOOK_NOT_ALLOWED`, once, with the host
/// untouched. `--allow-command` does not allow hooks.
#[test]
fn a_hook_runs_only_when_the_agent_allows_its_program() {
    let Some(w) = World::start(
        "a_hook_runs_only_when_the_agent_allows_its_program",
        &[],
        &["--allow-hook", "/bin/touch", "--allow-command", "/bin/sh"],
    ) else {
        return;
    };
    let v1 = w.image(Variant::Healthy, "v1");
    let name = format!("{}-web", w.prefix());
    let port = free_port();
    let marker = w.agent.state_dir.parent().unwrap().join("hook-ran");
    let touch = format!("touch {}", marker.display());

    let mut payload = v1.deploy(&name, port, docker_check(60));
    payload["hooks"] = json!({"preDeploy": {"command": ["/bin/sh", "-c", touch]}});
    let id = w.create("docker.run", &payload, 120, &[]);
    let task = w.settle(&id);
    assert_eq!(task["state"], "failed", "{task:#}");
    assert_eq!(task["errorCode"], "HOOK_NOT_ALLOWED", "{task:#}");
    assert_eq!(task["result"]["retriable"], false, "{task:#}");
    assert_eq!(attempts(&task).len(), 1, "{task:#}");
    assert!(!marker.exists(), "the shell never ran");
    assert!(container_id(&name).is_none(), "nothing was deployed");

    payload["hooks"] =
        json!({"preDeploy": {"command": ["/bin/touch", marker.display().to_string()]}});
    let id = w.create("docker.run", &payload, 120, &[]);
    let task = w.settle(&id);
    assert_eq!(task["state"], "succeeded", "{task:#}");
    assert!(marker.exists(), "the allowed hook ran");
    wait_serving(port, "v1");
}
