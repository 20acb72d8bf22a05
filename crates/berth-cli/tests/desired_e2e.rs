//! Seed 001's desired-state loop end to end: `berth server` (SQLite), real `berth-agent --env E
//! --once` ticks over mTLS, bundles built and pushed with the CLI, secrets from the `builtin`
//! store, stacks brought up by the host's compose from busybox images in the local registry.
//!
//! Each tick is one `--once` process, so every step is observed after it ends: the stack
//! serving (the page is the planted secret, rendered into the container from `.env`), the
//! server's view of the agent, the exit code.

#![cfg(unix)]

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_test_utils::docker::{self as fixtures, make_image, Cleanup, Image, Variant};
use berth_test_utils::free_port;
use common::*;
use serde_json::Value;

/// One tick: checkin, bundle, lease, secrets, compose up and its health wait, report.
const TICK: Duration = Duration::from_secs(240);

fn http_body(port: u16) -> Option<String> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(fixtures::http_body(port))
}

/// A registered agent's state dir (registered by a first `--register … --env E --once` tick).
struct Host {
    state_dir: PathBuf,
    env: String,
    log: PathBuf,
}

impl Host {
    /// One `berth-agent --env E --once` tick; its exit code. Its stderr is appended to the
    /// host's log file (searched for secrets at the end).
    fn tick(&self, server: &Server, extra: &[&str]) -> i32 {
        let mut cmd = std::process::Command::new(BERTH_AGENT);
        cmd.arg("--state-dir")
            .arg(&self.state_dir)
            .args(["--server", &server.url, "--env", &self.env, "--once"])
            .args(["--compose-command", &compose_command().join(" ")])
            .args(["--health-timeout-secs", "60"])
            .args(extra)
            .env("RUST_LOG", "info");
        let out = Proc::spawn(&format!("berth-agent --env {}", self.env), cmd).finish(TICK);
        let mut log = std::fs::read_to_string(&self.log).unwrap_or_default();
        log.push_str(&out.stderr);
        std::fs::write(&self.log, log).unwrap();
        out.status.code().unwrap_or(-1)
    }

    /// A tick as a supervisor runs it: exit 75 (temporary: here, the environment's checkin
    /// bucket of 6 a minute) means try again a little later.
    fn tick_patiently(&self, server: &Server) -> i32 {
        for _ in 0..6 {
            match self.tick(server, &[]) {
                75 => std::thread::sleep(Duration::from_secs(11)),
                code => return code,
            }
        }
        75
    }
}

fn compose_command() -> Vec<String> {
    // Debian's docker-compose (v1) is what the test script installs; v2 when it is there.
    if std::process::Command::new("docker")
        .args(["compose", "version"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        vec!["docker".into(), "compose".into()]
    } else {
        vec!["docker-compose".into()]
    }
}

/// Registers an agent labelled `env=<env>` and runs its first tick.
fn host(server: &Server, root: &Path, env: &str) -> Host {
    let token = server.registration_token();
    let host = Host {
        state_dir: root.join(format!("agent-{env}")),
        env: env.to_string(),
        log: root.join(format!("agent-{env}.log")),
    };
    let code = host.tick(
        server,
        &[
            "--register",
            "--token",
            &token,
            "--ca-fingerprint",
            &server.ca_fingerprint,
            "--name",
            &format!("host-{env}"),
            "--labels",
            &format!("env={env}"),
        ],
    );
    assert_eq!(code, 0, "first tick of {env}");
    host
}

/// A bundle directory: one `web` service of `image` on `port`, whose page is the secret
/// `greeting` (the manifest's `GREETING`, rendered into `.env` and from there into the
/// container's environment).
fn bundle_dir(root: &Path, name: &str, env: &str, image: &Image, port: u16) -> PathBuf {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let compose = format!(
        r#"version: "2.4"
services:
  web:
    image: {image}
    entrypoint: ["/bin/busybox", "sh", "-c", "echo -n \"$$GREETING\" > /www/index.html; trap 'exit 0' TERM; /bin/busybox httpd -f -p 8080 -h /www & wait"]
    environment:
      GREETING: "${{GREETING}}"
    ports:
      - "127.0.0.1:${{PORT}}:8080"
"#,
        image = image.reference()
    );
    std::fs::write(dir.join("docker-compose.yml"), compose).unwrap();
    std::fs::write(
        dir.join(".env.template"),
        format!("PORT={port}\nGREETING=\n"),
    )
    .unwrap();
    std::fs::write(
        dir.join("secrets.manifest.json"),
        serde_json::json!({"vault_mode": "builtin", "entries": [
            {"var": "GREETING", "path": format!("berth/{env}/see/greeting"), "kind": "supplied", "version": null}
        ]})
        .to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("bundle.json"),
        serde_json::json!({"env_id": env, "tier": "dev", "renderer": "compose"}).to_string(),
    )
    .unwrap();
    dir
}

/// `berth bundle build` then `berth bundle push`; the sha.
fn push(server: &Server, dir: &Path, env: &str) -> String {
    let file = dir.with_extension("tar");
    let (code, out, err) = server.run_with_input(
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
    let sha = out.trim().to_string();
    assert_eq!(sha.len(), 64, "{out}");
    let pushed = server.cli(&["bundle", "push", file.to_str().unwrap(), "--env", env]);
    assert_eq!(pushed["sha"], sha.as_str(), "{pushed}");
    sha
}

fn put_secret(server: &Server, path: &str, value: &str) {
    let (code, out, err) =
        server.run_with_input(&["secret", "put", path, "--from-file", "-"], Some(value));
    assert_eq!(code, 0, "secret put {path}: {err}");
    assert!(!out.contains(value) && !err.contains(value));
}

fn desired(server: &Server, env: &str) -> Value {
    server.cli(&["env", "desired", env])
}

fn agent_view(server: &Server, env: &str) -> Value {
    let view = desired(server, env);
    let agents = view["agents"].as_array().cloned().unwrap_or_default();
    assert_eq!(agents.len(), 1, "{view}");
    agents[0].clone()
}

fn create_env(server: &Server, env: &str) {
    server.cli(&[
        "env",
        "create",
        env,
        "--tier",
        "dev",
        "--selector",
        &format!("env={env}"),
    ]);
}

/// Every file under `dir` (recursively) except those named `.env`.
fn files_except_env(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_except_env(&path));
        } else if path.file_name().is_some_and(|n| n != ".env") {
            out.push(path);
        }
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn converges_with_secrets_keeps_the_old_stack_on_failure_and_goes_down() {
    let Some(env) = fixtures::env("converges_with_secrets") else {
        return;
    };
    let prefix = fixtures::unique("e2e");
    let root = tempdir();
    let data = root.path().join("server");
    let server = Server::start(&data, &[]);
    let (qa, dev) = (format!("{prefix}-qa"), format!("{prefix}-dev"));
    let _cleanup_qa = Cleanup::new(&format!("berth-{qa}"));
    let _cleanup_dev = Cleanup::new(&format!("berth-{dev}"));
    let _images = Cleanup::new(&prefix);
    create_env(&server, &qa);
    create_env(&server, &dev);
    let qa_host = host(&server, root.path(), &qa);
    let dev_host = host(&server, root.path(), &dev);

    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let bad = make_image(&env.registry, &prefix, "bad", Variant::Unhealthy, "x", None);
    // Planted: a value unique to this run, searched for everywhere at the end; and one shorter
    // than 4 characters, which must be redacted too.
    let secret = format!("planted-{}", uuid::Uuid::new_v4().simple());
    let short = "Zq7";
    put_secret(&server, &format!("{qa}/see/greeting"), &secret);
    put_secret(&server, &format!("{dev}/see/greeting"), short);

    // --- Converge: set-desired, one tick, the stack serves the secret. ---
    let (qa_port, dev_port) = (free_port(), free_port());
    let sha1 = push(
        &server,
        &bundle_dir(root.path(), "qa1", &qa, &v1, qa_port),
        &qa,
    );
    server.cli(&["env", "set-desired", &qa, &sha1]);
    assert_eq!(qa_host.tick_patiently(&server), 0);
    assert_eq!(http_body(qa_port).as_deref(), Some(secret.as_str()));
    let view = agent_view(&server, &qa);
    assert_eq!(view["appliedSha"], sha1.as_str(), "{view}");
    assert_eq!(view["lastResult"], "applied", "{view}");
    // Converged: the next tick is a heartbeat and changes nothing.
    assert_eq!(qa_host.tick_patiently(&server), 0);
    assert_eq!(agent_view(&server, &qa)["appliedSha"], sha1.as_str());

    // --- The other environment converges on its own. ---
    let dev_sha = push(
        &server,
        &bundle_dir(root.path(), "dev1", &dev, &v1, dev_port),
        &dev,
    );
    server.cli(&["env", "set-desired", &dev, &dev_sha]);
    assert_eq!(dev_host.tick_patiently(&server), 0);
    assert_eq!(http_body(dev_port).as_deref(), Some(short));
    assert_eq!(agent_view(&server, &qa)["appliedSha"], sha1.as_str());

    // --- A new sha converges again: a new port, the same secret. ---
    let qa_port2 = free_port();
    let sha2 = push(
        &server,
        &bundle_dir(root.path(), "qa2", &qa, &v1, qa_port2),
        &qa,
    );
    server.cli(&["env", "set-desired", &qa, &sha2]);
    assert_eq!(qa_host.tick_patiently(&server), 0);
    assert_eq!(http_body(qa_port2).as_deref(), Some(secret.as_str()));
    assert_eq!(agent_view(&server, &qa)["appliedSha"], sha2.as_str());

    // --- A missing secret: failed with ENV_INCOMPLETE; the running stack keeps serving. ---
    let dir = bundle_dir(root.path(), "qa3", &qa, &v1, free_port());
    let manifest = serde_json::json!({"vault_mode": "builtin", "entries": [
        {"var": "GREETING", "path": format!("berth/{qa}/see/greeting"), "kind": "supplied", "version": null},
        {"var": "ADMIN_TOKEN", "path": format!("berth/{qa}/see/admin_token"), "kind": "generated", "version": 1}
    ]});
    std::fs::write(dir.join("secrets.manifest.json"), manifest.to_string()).unwrap();
    let sha3 = push(&server, &dir, &qa);
    server.cli(&["env", "set-desired", &qa, &sha3]);
    assert_eq!(qa_host.tick_patiently(&server), 0);
    let view = agent_view(&server, &qa);
    assert_eq!(view["lastResult"], "failed", "{view}");
    assert_eq!(
        view["detail"], "ENV_INCOMPLETE: unresolved: ADMIN_TOKEN",
        "{view}"
    );
    assert_eq!(view["appliedSha"], sha2.as_str());
    assert_eq!(http_body(qa_port2).as_deref(), Some(secret.as_str()));

    // --- An apply that fails its health wait: failed, and the previous release serves again. ---
    let sha4 = push(
        &server,
        &bundle_dir(root.path(), "qa4", &qa, &bad, qa_port2),
        &qa,
    );
    server.cli(&["env", "set-desired", &qa, &sha4]);
    assert_eq!(qa_host.tick_patiently(&server), 0);
    let view = agent_view(&server, &qa);
    assert_eq!(view["lastResult"], "failed", "{view}");
    assert!(
        view["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("APPLY_FAILED")),
        "{view}"
    );
    assert_eq!(view["appliedSha"], sha2.as_str());
    wait_for(
        TICK,
        "the previous release to serve again",
        || match http_body(qa_port2) {
            Some(b) if b == secret => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );

    // --- Back to an older sha: a rollback, which that bundle does not allow. ---
    server.cli(&["env", "set-desired", &qa, &sha1]);
    assert_eq!(qa_host.tick_patiently(&server), 0);
    let view = agent_view(&server, &qa);
    assert!(
        view["detail"]
            .as_str()
            .is_some_and(|d| d.starts_with("ROLLBACK_FORBIDDEN")),
        "{view}"
    );
    assert_eq!(view["appliedSha"], sha2.as_str());
    assert_eq!(http_body(qa_port2).as_deref(), Some(secret.as_str()));

    // --- Retire: down removes the stack (and reports it). ---
    server.cli(&["env", "retire", &qa]);
    assert_eq!(qa_host.tick_patiently(&server), 0);
    let view = agent_view(&server, &qa);
    assert_eq!(view["lastResult"], "down", "{view}");
    assert!(view["appliedSha"].is_null(), "{view}");
    assert!(
        fixtures::container_names(&format!("berth-{qa}")).is_empty(),
        "the stack is gone"
    );
    assert_eq!(http_body(dev_port).as_deref(), Some(short), "dev untouched");
    server.cli(&["env", "retire", &dev, "--purge-volumes"]);
    assert_eq!(dev_host.tick_patiently(&server), 0);

    // --- Redaction: the planted values appear nowhere but in `.env`. ---
    let export = {
        let (code, out, err) = server.run_with_input(&["audit", "export"], None);
        assert_eq!(code, 0, "{err}");
        out
    };
    assert!(export.contains("desired.report"), "reports are audited");
    let mut places: Vec<(String, Vec<u8>)> = vec![
        ("audit export".into(), export.into_bytes()),
        ("server log".into(), server.proc.stderr().into_bytes()),
    ];
    for name in ["berth.db", "berth.db-wal"] {
        if let Ok(bytes) = std::fs::read(data.join(name)) {
            places.push((name.into(), bytes));
        }
    }
    for host in [&qa_host, &dev_host] {
        places.push((
            host.log.display().to_string(),
            std::fs::read(&host.log).unwrap(),
        ));
        for file in files_except_env(&host.state_dir) {
            places.push((file.display().to_string(), std::fs::read(&file).unwrap()));
        }
    }
    let reports = server.cli(&["env", "desired", &qa]).to_string();
    places.push(("desired view".into(), reports.into_bytes()));
    for (place, bytes) in &places {
        assert!(
            !contains(bytes, secret.as_bytes()),
            "the planted secret leaked into {place}"
        );
    }
    // The short value: not in the logs and reports. A 3-byte string may occur by chance in a
    // binary database page or in base64 key material (about 1 % of runs found "Zq7" in an
    // agent's PEM), so the database files and the agents' key and certificate files are not
    // searched for it; the long value above is searched for everywhere.
    let random_bytes = |p: &str| {
        p.starts_with("berth.db")
            || [".pem", ".crt", "identity.json"]
                .iter()
                .any(|end| p.ends_with(end))
    };
    for (place, bytes) in places.iter().filter(|(p, _)| !random_bytes(p)) {
        assert!(
            !contains(bytes, short.as_bytes()),
            "the short secret leaked into {place}"
        );
    }
}

#[test]
fn a_tampered_bundle_hostile_members_and_too_little_disk_are_refused_with_their_codes() {
    let Some(env) = fixtures::env("desired_refusals") else {
        return;
    };
    let prefix = fixtures::unique("e2e");
    let root = tempdir();
    let data = root.path().join("server");
    let server = Server::start(&data, &[]);
    // One environment per case, all selecting the one agent by its `group` label: each case
    // starts with full rate buckets (6 checkins a minute per environment).
    let group = format!("group={prefix}");
    let token = server.registration_token();
    let agent = Host {
        state_dir: root.path().join("agent"),
        env: format!("{prefix}-c0"),
        log: root.path().join("agent.log"),
    };
    server.cli(&[
        "env",
        "create",
        &agent.env,
        "--tier",
        "dev",
        "--selector",
        &group,
    ]);
    assert_eq!(
        agent.tick(
            &server,
            &[
                "--register",
                "--token",
                &token,
                "--ca-fingerprint",
                &server.ca_fingerprint,
                "--name",
                "refusals",
                "--labels",
                &group,
            ],
        ),
        0
    );
    let mut cleanups = Vec::new();
    let mut cases = 0;
    let mut case = || {
        cases += 1;
        let name = format!("{prefix}-c{cases}");
        server.cli(&[
            "env",
            "create",
            &name,
            "--tier",
            "dev",
            "--selector",
            &group,
        ]);
        cleanups.push(Cleanup::new(&format!("berth-{name}")));
        name
    };
    let _images = Cleanup::new(&prefix);
    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);

    // The server refuses unsafe bundles at push already; the agent refuses them again. Its
    // copy of the bundle comes from the server's store, so the store is tampered with here.
    let db = rusqlite::Connection::open(data.join("berth.db")).unwrap();
    let replace = |sha: &str, tar: &[u8]| {
        db.execute(
            "UPDATE bundles SET content = ?1 WHERE sha = ?2",
            rusqlite::params![tar, sha],
        )
        .unwrap();
    };
    let refusal = |name: &str, sha: &str| {
        server.cli(&["env", "set-desired", name, sha]);
        let host = Host {
            env: name.to_string(),
            state_dir: agent.state_dir.clone(),
            log: agent.log.clone(),
        };
        assert_eq!(host.tick(&server, &[]), 0);
        let view = agent_view(&server, name);
        assert_eq!(view["lastResult"], "failed", "{view}");
        view["detail"].as_str().unwrap_or_default().to_string()
    };

    // Tampered: the content no longer hashes to its sha.
    let name = case();
    let dir = bundle_dir(root.path(), "base", &name, &v1, free_port());
    let sha = push(&server, &dir, &name);
    let mut files = berth_bundle::build_dir(&dir).unwrap().0;
    files.insert("docker-compose.yml".into(), b"services: {}\n".to_vec());
    replace(&sha, &berth_bundle::to_tar(&files));
    let detail = refusal(&name, &sha);
    assert!(detail.starts_with("BUNDLE_SHA_MISMATCH"), "{detail}");

    // Hostile members, one per kind: each refused before anything is written.
    for (kind, tar) in hostile_tars() {
        let name = case();
        let dir = bundle_dir(root.path(), &format!("h-{kind}"), &name, &v1, free_port());
        let sha = push(&server, &dir, &name);
        replace(&sha, &tar);
        let detail = refusal(&name, &sha);
        assert!(
            detail.starts_with("BUNDLE_UNSAFE") || detail.starts_with("BUNDLE_TOO_LARGE"),
            "{kind}: {detail}"
        );
        assert!(
            !Path::new("/tmp/berth-escaped").exists() && !tree_has(root.path(), "berth-escaped"),
            "{kind} wrote outside"
        );
    }

    // A manifest entry carrying a value: refused at push, and by the agent.
    let name = case();
    let dir = bundle_dir(root.path(), "valued", &name, &v1, free_port());
    let valued = serde_json::json!({"vault_mode": "builtin", "entries": [
        {"var": "GREETING", "path": format!("berth/{name}/see/greeting"), "kind": "supplied", "version": null, "value": "inline"}
    ]});
    std::fs::write(dir.join("secrets.manifest.json"), valued.to_string()).unwrap();
    let file = dir.with_extension("tar");
    let (files, tar, sha) = berth_bundle::build_dir(&dir).unwrap();
    std::fs::write(&file, &tar).unwrap();
    let pushed = server.try_cli(&["bundle", "push", file.to_str().unwrap(), "--env", &name]);
    assert!(
        pushed.as_ref().is_err_and(|e| e.contains("BUNDLE_INVALID")),
        "{pushed:?}"
    );
    let good = push(
        &server,
        &bundle_dir(root.path(), "carrier", &name, &v1, free_port()),
        &name,
    );
    db.execute(
        "UPDATE bundles SET content = ?1, sha = ?2 WHERE sha = ?3",
        rusqlite::params![tar, sha, good],
    )
    .unwrap();
    assert_eq!(berth_bundle::sha(&files), sha);
    let detail = refusal(&name, &sha);
    assert!(detail.starts_with("BUNDLE_INVALID"), "{detail}");

    // Not enough disk for the bundle's own need.
    let name = case();
    let dir = bundle_dir(root.path(), "huge", &name, &v1, free_port());
    std::fs::write(
        dir.join("bundle.json"),
        serde_json::json!({"env_id": name, "renderer": "compose", "agent": {"disk_need_bytes": u64::MAX / 2}})
            .to_string(),
    )
    .unwrap();
    let sha = push(&server, &dir, &name);
    let detail = refusal(&name, &sha);
    assert!(detail.starts_with("DISK_INSUFFICIENT"), "{detail}");
    drop(cleanups);
    assert!(fixtures::container_names(&format!("berth-{prefix}")).is_empty());
}

/// Whether a file or directory named `name` is anywhere under `dir`.
fn tree_has(dir: &Path, name: &str) -> bool {
    std::fs::read_dir(dir).is_ok_and(|entries| {
        entries
            .flatten()
            .any(|e| e.file_name() == name || (e.path().is_dir() && tree_has(&e.path(), name)))
    })
}

/// `(kind, tar)`: raw ustar archives with one unsafe member each.
fn hostile_tars() -> Vec<(&'static str, Vec<u8>)> {
    fn header(name: &str, typeflag: u8, size: u64, link: &str) -> [u8; 512] {
        let mut h = [0u8; 512];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[100..107].copy_from_slice(b"0000644");
        h[108..115].copy_from_slice(b"0000000");
        h[116..123].copy_from_slice(b"0000000");
        let size = format!("{size:011o}");
        h[124..135].copy_from_slice(size.as_bytes());
        h[136..147].copy_from_slice(b"00000000000");
        h[156] = typeflag;
        h[157..157 + link.len()].copy_from_slice(link.as_bytes());
        h[257..263].copy_from_slice(b"ustar\0");
        h[263..265].copy_from_slice(b"00");
        h[148..156].copy_from_slice(b"        ");
        let sum: u32 = h.iter().map(|b| *b as u32).sum();
        h[148..155].copy_from_slice(format!("{sum:06o}\0").as_bytes());
        h
    }
    fn tar(members: &[([u8; 512], &[u8])]) -> Vec<u8> {
        let mut out = Vec::new();
        for (h, body) in members {
            out.extend_from_slice(h);
            out.extend_from_slice(body);
            out.resize(out.len().div_ceil(512) * 512, 0);
        }
        out.extend_from_slice(&[0u8; 1024]);
        out
    }
    let compose = b"services: {}\n";
    let ok = header("docker-compose.yml", b'0', compose.len() as u64, "");
    let body = b"x";
    vec![
        (
            "absolute",
            tar(&[
                (ok, compose),
                (header("/tmp/berth-escaped", b'0', 1, ""), body),
            ]),
        ),
        (
            "dotdot",
            tar(&[
                (ok, compose),
                (header("../berth-escaped", b'0', 1, ""), body),
            ]),
        ),
        (
            "symlink",
            tar(&[(ok, compose), (header("link", b'2', 0, "/etc/passwd"), b"")]),
        ),
        (
            "hardlink",
            tar(&[(ok, compose), (header("hard", b'1', 0, "/etc/passwd"), b"")]),
        ),
        (
            "char-device",
            tar(&[(ok, compose), (header("dev", b'3', 0, ""), b"")]),
        ),
        (
            "block-device",
            tar(&[(ok, compose), (header("blk", b'4', 0, ""), b"")]),
        ),
        (
            "fifo",
            tar(&[(ok, compose), (header("fifo", b'6', 0, ""), b"")]),
        ),
        ("duplicate", tar(&[(ok, compose), (ok, compose)])),
        (
            "oversize",
            tar(&[(ok, compose), (header("big", b'0', 1 << 32, ""), b"")]),
        ),
    ]
}

#[test]
fn checkins_over_the_bucket_get_429_and_the_tick_exits_75() {
    let root = tempdir();
    let server = Server::start(&root.path().join("server"), &[]);
    let name = fixtures::unique("e2e");
    create_env(&server, &name);
    let agent = host(&server, root.path(), &name);
    // The first tick was one checkin; the bucket holds 6 a minute.
    let codes: Vec<i32> = (0..6).map(|_| agent.tick(&server, &[])).collect();
    assert_eq!(codes[..5], [0, 0, 0, 0, 0], "{codes:?}");
    assert_eq!(codes[5], 75, "the 7th checkin within a minute: {codes:?}");
    let log = std::fs::read_to_string(&agent.log).unwrap();
    assert!(log.contains("RATE_LIMITED"), "{log}");
}

#[test]
fn another_environment_is_refused_and_the_tick_exits_78() {
    let root = tempdir();
    let server = Server::start(&root.path().join("server"), &[]);
    let name = fixtures::unique("e2e");
    create_env(&server, &name);
    create_env(&server, &format!("{name}-other"));
    let agent = host(&server, root.path(), &name);
    let other = Host {
        state_dir: agent.state_dir.clone(),
        env: format!("{name}-other"),
        log: agent.log.clone(),
    };
    assert_eq!(other.tick(&server, &[]), 78);
    let log = std::fs::read_to_string(&agent.log).unwrap();
    assert!(log.contains("AGENT_ENV_MISMATCH"), "{log}");
}
