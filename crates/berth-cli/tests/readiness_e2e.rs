//! Readiness end to end (issue 14 items 1-2): `berth server`, a real `berth-agent` on the host's
//! Docker engine, a registry of the test's own (so stopping it and deleting a manifest leave the
//! shared one alone), a builtin secret in a desired bundle's manifest, and the CLI.
//!
//! One scenario, in order: the environment goes ready (and a `requireReady` deployment may
//! start); then each condition goes false for its own cause, one at a time, and `berth env
//! verify` exits 3 naming it: a secret removed, the Docker socket made unavailable, the
//! registry stopped, the agent stopped (and a deployment is refused `ENV_NOT_READY`), a
//! digest missing from the registry. A verify while the agent is suspended (SIGSTOP: its
//! probe cannot run) stays open until the agent runs again.
//!
//! A second scenario runs against the real OpenBao: the agent resolves the environment's
//! OpenBao-backed secrets, and a secret deleted there is named.

#![cfg(unix)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_test_utils::docker::{self as fixtures, make_image, Cleanup, Variant};
use berth_test_utils::free_port;
use berth_test_utils::openbao::OpenBaoEnv;
use common::*;
use serde_json::{json, Value};

const VERIFY: Duration = Duration::from_secs(300);

/// `berth env verify ENV`: its exit code and the conditions table.
fn verify(server: &Server, env: &str) -> (i32, String) {
    let (code, out, err) = server.run_with_input(&["env", "verify", env, "--timeout", "5m"], None);
    assert!(
        code == 0 || code == 3,
        "verify failed ({code}): {err}\n{out}"
    );
    (code, out)
}

/// The table's line of one condition.
fn line<'a>(table: &'a str, condition: &str) -> &'a str {
    table
        .lines()
        .find(|l| l.starts_with(&format!("{condition} ")))
        .unwrap_or_else(|| panic!("no {condition} line in\n{table}"))
}

/// Verifies until the environment is ready again (a restored cause may take a heartbeat or two
/// to be seen: an agent's capabilities, its session).
fn verify_ready(server: &Server, env: &str) -> String {
    wait_for(VERIFY, "the environment to verify ready", || {
        let (code, out) = verify(server, env);
        if code == 0 {
            Ok(out)
        } else {
            Err(out)
        }
    })
}

/// Verifies once and asserts the environment is not ready because `condition` is `False` with
/// `reason`, its message naming `names`.
fn verify_names(server: &Server, env: &str, condition: &str, reason: &str, names: &str) {
    let (code, out) = verify(server, env);
    eprintln!("{out}");
    assert_eq!(code, 3, "not ready exits 3:\n{out}");
    assert!(out.contains("OperationalReady False"), "{out}");
    let l = line(&out, condition);
    assert!(
        l.contains(" False ") && l.contains(reason) && l.contains(names),
        "{condition} should be False {reason} naming {names:?}:\n{out}"
    );
}

/// The test's own registry: `docker-registry` (as scripts/registry.sh runs it) on a free port,
/// deletes enabled, its storage in the test's temp dir, so it can be stopped and started again.
struct Registry {
    config: PathBuf,
    port: u16,
    proc: Option<Proc>,
}

impl Registry {
    fn start(root: &Path) -> Registry {
        let port = free_port();
        let config = root.join("registry.yml");
        std::fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n  secret: berth-readiness-{port}\n",
                root.join("registry-data").display()
            ),
        )
        .unwrap();
        let mut r = Registry {
            config,
            port,
            proc: None,
        };
        r.resume();
        r
    }

    fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn resume(&mut self) {
        let mut cmd = command("/usr/bin/docker-registry");
        cmd.arg("serve").arg(&self.config);
        self.proc = Some(Proc::spawn("docker-registry", cmd));
        let port = self.port;
        wait_for(SETTLE, "the test registry to answer", || {
            std::net::TcpStream::connect(("127.0.0.1", port))
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
    }

    fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill9();
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `berth-agent` with its stored identity, talking to Docker through `socket` (a symlink the
/// test removes to make the engine unavailable to this agent only).
fn agent_process(server: &Server, agent: &Agent, socket: &Path, name: &str) -> Proc {
    let mut cmd = command(BERTH_AGENT);
    cmd.arg("--state-dir")
        .arg(&agent.state_dir)
        .args(["--server", &server.url, "--sticker-dir"])
        .arg(&agent.sticker_dir)
        .env("DOCKER_HOST", format!("unix://{}", socket.display()));
    Proc::spawn(&format!("berth-agent {name}"), cmd)
}

fn readiness(server: &Server, env: &str) -> Value {
    server.cli(&["env", "readiness", env])
}

/// Builds a desired bundle of one service whose `GREETING` is the manifest's one secret
/// (`vault_mode`, `path`), pushes it to `env` and makes it the desired state.
fn desire(server: &Server, root: &Path, env: &str, image: &str, vault_mode: &str, path: &str) {
    let dir = root.join(format!("bundle-{env}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("docker-compose.yml"),
        format!(
            "services:\n  web:\n    image: {image}\n    environment:\n      GREETING: \"${{GREETING}}\"\n"
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("secrets.manifest.json"),
        json!({"vault_mode": vault_mode, "entries": [
            {"var": "GREETING", "path": path, "kind": "supplied", "version": null}
        ]})
        .to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("bundle.json"),
        json!({"env_id": env, "tier": "qa", "renderer": "compose"}).to_string(),
    )
    .unwrap();
    let file = root.join(format!("bundle-{env}.tar"));
    let (code, sha, err) = server.run_with_input(
        &[
            "bundle",
            "build",
            dir.to_str().unwrap(),
            "--out",
            file.to_str().unwrap(),
        ],
        None,
    );
    assert_eq!(code, 0, "bundle build: {err}");
    server.cli(&["bundle", "push", file.to_str().unwrap(), "--env", env]);
    server.cli(&["env", "set-desired", env, sha.trim()]);
}

#[test]
fn verify_names_each_cause_of_unreadiness() {
    let Some(_fixtures) = fixtures::env("verify_names_each_cause_of_unreadiness") else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-ready"));
    let prefix = cleanup.prefix.clone();
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "3"],
    );
    let mut registry = Registry::start(tmp.path());
    let image = make_image(
        &registry.host(),
        &prefix,
        "web",
        Variant::Healthy,
        "ready",
        None,
    );

    // One Docker agent whose engine socket is a symlink the test controls.
    let socket = tmp.path().join("docker.sock");
    std::os::unix::fs::symlink("/var/run/docker.sock", &socket).unwrap();
    let docker_host = format!("unix://{}", socket.display());
    let mut agent = Agent::spawn_registered(&server, tmp.path(), "ready-1", &[], |dir, args| {
        let mut cmd = command(BERTH_AGENT);
        cmd.arg("--state-dir").arg(dir).args(args);
        cmd.env("DOCKER_HOST", &docker_host);
        cmd
    });
    let port = free_port();
    server.cli(&[
        "agents",
        "label",
        &agent.id,
        "env=rdy",
        &format!("port={port}"),
    ]);
    server.wait_agent(&agent.id, "online with docker", |a| {
        a["status"] == "online"
            && a["capabilities"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["name"] == "docker"))
    });

    server.cli(&[
        "env",
        "create",
        "rdy",
        "--tier",
        "qa",
        "--selector",
        "env=rdy",
        "--require-ready",
    ]);
    let config = json!({
        "containerName": format!("{prefix}-{{{{target.name}}}}"),
        "ports": ["127.0.0.1:{{target.labels.port}}:8080/tcp"],
        "restartPolicy": "no",
        "healthCheck": {"type": "http", "interval": 1,
                        "url": "http://127.0.0.1:{{target.labels.port}}/"},
    });
    server.cli(&[
        "release",
        "create",
        "r1",
        "--image",
        &format!("web={}", image.reference()),
        "--config",
        &format!("web={config}"),
    ]);

    // Nothing deployed yet: ready with nothing to check, so the first deployment may start.
    let out = verify_ready(&server, "rdy");
    let order: Vec<&str> = out
        .lines()
        .skip(2)
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        order,
        [
            "Configured",
            "TargetsReachable",
            "CapabilitiesMatch",
            "SecretsResolvable",
            "RegistryReachable",
            "RoutesExecutable",
            "Healthy"
        ],
        "{out}"
    );
    let (code, _, err) = server.run_with_input(&["deploy", "r1", "--env", "rdy", "--wait"], None);
    assert_eq!(code, 0, "deploy r1: {err}");

    // A desired bundle whose manifest names a builtin secret that exists.
    let (code, _, err) = server.run_with_input(
        &["secret", "put", "rdy/see/greeting", "--from-file", "-"],
        Some("hello"),
    );
    assert_eq!(code, 0, "secret put: {err}");
    desire(
        &server,
        tmp.path(),
        "rdy",
        &image.reference(),
        "builtin",
        "berth/rdy/see/greeting",
    );

    // Ready: every condition True, each with its own evidence.
    let out = verify_ready(&server, "rdy");
    assert!(out.contains("OperationalReady True"), "{out}");
    assert!(
        line(&out, "Configured").contains("1 digest(s) found"),
        "{out}"
    );
    assert!(
        line(&out, "SecretsResolvable").contains("1 secret(s) exist"),
        "{out}"
    );
    assert!(line(&out, "Healthy").contains(" OK "), "{out}");
    let r = readiness(&server, "rdy");
    assert_eq!(r["operationalReady"], true, "{r}");
    assert_eq!(r["verifyObserved"], r["verifyRequest"], "{r}");
    assert_eq!(r["conditions"].as_array().unwrap().len(), 7, "{r}");

    // 1. A secret removed.
    let (code, _, err) = server.run_with_input(&["secret", "rm", "rdy/see/greeting"], None);
    assert_eq!(code, 0, "secret rm: {err}");
    verify_names(
        &server,
        "rdy",
        "SecretsResolvable",
        "SECRET_NOT_FOUND",
        "berth/rdy/see/greeting",
    );
    let (code, _, err) = server.run_with_input(
        &["secret", "put", "rdy/see/greeting", "--from-file", "-"],
        Some("hello again"),
    );
    assert_eq!(code, 0, "secret put: {err}");
    verify_ready(&server, "rdy");

    // 2. The Docker socket made unavailable to the agent.
    std::fs::remove_file(&socket).unwrap();
    verify_names(&server, "rdy", "Healthy", "DOCKER_UNAVAILABLE", "ready-1");
    std::os::unix::fs::symlink("/var/run/docker.sock", &socket).unwrap();
    verify_ready(&server, "rdy");

    // 3. The registry stopped.
    registry.stop();
    verify_names(
        &server,
        "rdy",
        "RegistryReachable",
        "REGISTRY_UNREACHABLE",
        &registry.host(),
    );
    registry.resume();
    verify_ready(&server, "rdy");

    // 4. A verify while the agent cannot run its probe stays open until it can.
    agent.proc.signal(libc::SIGSTOP);
    let mut cmd = command(BERTH);
    cmd.args(["env", "verify", "rdy"])
        .env("BERTH_SERVER", &server.url)
        .env("BERTH_TOKEN", &server.admin_token)
        .env("BERTH_CA_FILE", server.data_dir.join("ca.crt"));
    let mut pending = Proc::spawn("berth env verify (transient)", cmd);
    let open = wait_for(SETTLE, "the pass waiting on the probe", || {
        let r = readiness(&server, "rdy");
        let routes = r["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "RoutesExecutable").cloned())
            .unwrap_or_default();
        if r["verifyRequest"].is_string() && routes["reason"] == "PROBE_PENDING" {
            Ok(r)
        } else {
            Err(r.to_string())
        }
    });
    assert_ne!(open["verifyObserved"], open["verifyRequest"], "{open}");
    pending.assert_running();
    agent.proc.signal(libc::SIGCONT);
    let done = pending.finish(VERIFY);
    assert_eq!(
        done.status.code(),
        Some(0),
        "{}\n{}",
        done.stdout,
        done.stderr
    );
    assert!(
        done.stdout.contains("OperationalReady True"),
        "{}",
        done.stdout
    );

    // 5. The agent stopped: not reachable, and a requireReady deployment is refused.
    agent.proc.kill9();
    server.wait_agent(&agent.id, "offline", |a| a["status"] == "offline");
    verify_names(
        &server,
        "rdy",
        "TargetsReachable",
        "TARGET_OFFLINE",
        "ready-1",
    );
    let (code, _, err) = server.run_with_input(&["deploy", "r1", "--env", "rdy"], None);
    assert_ne!(code, 0);
    assert!(
        err.contains("ENV_NOT_READY") && err.contains("TargetsReachable"),
        "{err}"
    );
    let mut restarted = agent_process(&server, &agent, &socket, "ready-1");
    server.wait_agent(&agent.id, "online again", |a| a["status"] == "online");
    verify_ready(&server, "rdy");

    // 6. A digest the registry no longer has.
    let (repository, digest) = (image.repository.clone(), image.digest.clone());
    let path = repository.split_once('/').unwrap().1;
    let status = std::process::Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "DELETE",
            &format!("http://{}/v2/{path}/manifests/{digest}", registry.host()),
        ])
        .output()
        .expect("curl");
    assert_eq!(String::from_utf8_lossy(&status.stdout), "202");
    verify_names(&server, "rdy", "Configured", "DIGEST_NOT_FOUND", &digest);

    restarted.terminate();
    drop(cleanup);
}

/// `SecretsResolvable` for OpenBao-backed secrets: the pass's probe logs in to the real OpenBao
/// with a grant minted for it and reads each manifest entry on the agent; the server hears only
/// which did not resolve. A secret deleted in OpenBao is named, and no value reaches the server.
#[test]
fn an_agent_resolves_the_openbao_secrets() {
    let test = "an_agent_resolves_the_openbao_secrets";
    let Some(bao) = block_on(OpenBaoEnv::from_env(test)) else {
        return;
    };
    let Some(fixtures) = fixtures::env(test) else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-ready-bao"));
    let tmp = tempdir();
    let (server, mounts) =
        Server::start_with_openbao(tmp.path(), &bao, &["--heartbeat-interval-secs", "3"]);
    let image = make_image(
        &fixtures.registry,
        &cleanup.prefix,
        "web",
        Variant::Healthy,
        "bao",
        None,
    );
    let env = format!("{}-env", fixtures::unique("rdy"));
    let mut agent = Agent::spawn_registered(&server, tmp.path(), "bao-probe", &[], |dir, args| {
        let mut cmd = command(BERTH_AGENT);
        cmd.arg("--state-dir").arg(dir).args(args);
        cmd
    });
    server.cli(&["agents", "label", &agent.id, &format!("env={env}")]);
    server.wait_agent(&agent.id, "online", |a| a["status"] == "online");
    server.cli(&[
        "env",
        "create",
        &env,
        "--tier",
        "qa",
        "--selector",
        &format!("env={env}"),
    ]);
    let value = format!("bao-{}", uuid::Uuid::new_v4().simple());
    block_on(mounts.put_secret(&env, "greeting", &value));
    let path = mounts.manifest_path(&env, "greeting");
    desire(
        &server,
        tmp.path(),
        &env,
        &image.reference(),
        "openbao",
        &path,
    );

    let out = verify_ready(&server, &env);
    assert!(
        line(&out, "SecretsResolvable").contains("1 secret(s) resolve at OpenBao from bao-probe"),
        "{out}"
    );

    // Deleted in OpenBao (every version): named, never its value.
    block_on(bao.must(
        "DELETE",
        &format!("{}/metadata/{env}/see/greeting", mounts.kv_mount),
        None,
    ));
    verify_names(
        &server,
        &env,
        "SecretsResolvable",
        "SECRET_NOT_FOUND",
        &path,
    );
    let r = readiness(&server, &env);
    assert!(!r.to_string().contains(&value), "{r}");

    agent.proc.terminate();
    block_on(mounts.teardown());
    drop(cleanup);
}
