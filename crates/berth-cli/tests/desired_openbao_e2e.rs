//! Seed 001 with the `openbao` provider, end to end against the real OpenBao of
//! `scripts/openbao.sh`, configured as the seed's Terraform does (JWT mount whose `jwks_url` is
//! berth's JWKS, role `see-env`, KV v2, the templated per-environment policy):
//!
//! - a client written from the seed alone (`seed_client.py`, bearer-token mode) completes
//!   checkin, bundle, lease and report against berth;
//! - a used kit grant, and a superseded one, are refused at OpenBao's login; a token minted from
//!   a superseded grant gets `401 AGENT_UNAUTHENTICATED` from berth; a token naming another
//!   environment gets `403 AGENT_ENV_MISMATCH`;
//! - `berth-agent` in bearer mode (kit → `bootstrap.jwt` → OpenBao login) converges a real
//!   compose stack whose secret comes from OpenBao, in another environment.

#![cfg(unix)]

mod common;

use std::path::Path;
use std::time::Duration;

use berth_test_utils::docker::{self as fixtures, make_image, Cleanup, Variant};
use berth_test_utils::free_port;
use berth_test_utils::openbao::{OpenBaoEnv, SeedMounts};
use common::*;
use serde_json::{json, Value};

const TICK: Duration = Duration::from_secs(240);

/// A bundle of one `web` service whose page is the secret `GREETING`, read from OpenBao.
fn bundle(root: &Path, env: &str, image: &str, port: u16, secret_path: &str) -> std::path::PathBuf {
    let dir = root.join(format!("bundle-{env}"));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("docker-compose.yml"),
        format!(
            r#"version: "2.4"
services:
  web:
    image: {image}
    entrypoint: ["/bin/busybox", "sh", "-c", "echo -n \"$$GREETING\" > /www/index.html; trap 'exit 0' TERM; /bin/busybox httpd -f -p 8080 -h /www & wait"]
    environment:
      GREETING: "${{GREETING}}"
    ports:
      - "127.0.0.1:{port}:8080"
"#
        ),
    )
    .unwrap();
    std::fs::write(dir.join(".env.template"), "GREETING=\n").unwrap();
    std::fs::write(
        dir.join("secrets.manifest.json"),
        json!({"vault_mode": "openbao", "entries": [
            {"var": "GREETING", "path": secret_path, "kind": "supplied", "version": null}
        ]})
        .to_string(),
    )
    .unwrap();
    std::fs::write(
        dir.join("bundle.json"),
        json!({"env_id": env, "renderer": "compose", "secrets_provider": "openbao"}).to_string(),
    )
    .unwrap();
    dir
}

fn push(server: &Server, dir: &Path, env: &str) -> String {
    let (_, tar, sha) = berth_bundle::build_dir(dir).unwrap();
    let file = dir.with_extension("tar");
    std::fs::write(&file, tar).unwrap();
    let pushed = server.cli(&["bundle", "push", file.to_str().unwrap(), "--env", env]);
    assert_eq!(pushed["sha"], sha.as_str());
    server.cli(&["env", "set-desired", env, &sha]);
    sha
}

/// `POST path` on berth with an OpenBao token as the bearer: (status, body).
fn bearer_call(server: &Server, token: &str, path: &str, body: &Value) -> (u16, Value) {
    let client = berth_client::Client::new(berth_client::ClientConfig {
        server: server.url.clone(),
        trust: berth_client::Trust::CaPem(
            std::fs::read_to_string(server.data_dir.join("ca.crt")).unwrap(),
        ),
        identity: None,
        bearer: Some(token.to_string()),
        timeout: Duration::from_secs(30),
    })
    .unwrap();
    match block_on(client.post_value(path, body)) {
        Ok(v) => (200, v),
        Err(berth_client::ClientError::Api { status, body, .. }) => {
            (status, serde_json::to_value(body).unwrap())
        }
        Err(e) => panic!("{path}: {e}"),
    }
}

/// Waits until OpenBao refuses `grant` at login (the keyset reset runs in the background).
fn wait_login_refused(mounts: &SeedMounts, grant: &str, what: &str) {
    wait_for(Duration::from_secs(30), what, || {
        let (status, body) = block_on(mounts.login(grant));
        if status >= 400 {
            Ok(())
        } else {
            Err(format!("{status} {body}"))
        }
    });
}

fn kit(server: &Server, env: &str) -> String {
    let kit = server.cli(&["env", "kit", env]);
    let cmd = kit["installCommand"].as_str().unwrap();
    assert!(cmd.contains("--env") && !cmd.contains(" echo "), "{cmd}");
    kit["grant"].as_str().unwrap().to_string()
}

#[test]
fn seed_client_and_bearer_agent_against_real_openbao() {
    let Some(bao) = block_on(OpenBaoEnv::from_env("seed_client_and_bearer_agent")) else {
        return;
    };
    let Some(registry) = fixtures::env("seed_client_and_bearer_agent") else {
        return;
    };
    let root = tempdir();
    let (server, mounts) = Server::start_with_openbao(root.path(), &bao, &[]);
    let data = server.data_dir.clone();

    let prefix = fixtures::unique("e2e");
    let (a, b) = (format!("{prefix}-a"), format!("{prefix}-b"));
    for env in [&a, &b] {
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
    let secret_a = format!("bao-a-{}", uuid::Uuid::new_v4().simple());
    let secret_b = format!("bao-b-{}", uuid::Uuid::new_v4().simple());
    block_on(mounts.put_secret(&a, "greeting", &secret_a));
    block_on(mounts.put_secret(&b, "greeting", &secret_b));
    let _images = Cleanup::new(&prefix);
    let _stack = Cleanup::new(&format!("berth-{b}"));
    let image = make_image(
        &registry.registry,
        &prefix,
        "web",
        Variant::Healthy,
        "x",
        None,
    );

    // --- The seed-only client, bearer mode, environment A. ---
    let sha_a = push(
        &server,
        &bundle(
            root.path(),
            &a,
            &image.reference(),
            free_port(),
            &mounts.manifest_path(&a, "greeting"),
        ),
        &a,
    );
    let grant_a = kit(&server, &a);
    let bootstrap = root.path().join("bootstrap-a.jwt");
    std::fs::write(&bootstrap, &grant_a).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/seed_client.py");
    let mut cmd = std::process::Command::new("python3");
    cmd.arg(&script).args([
        server.url.as_str(),
        data.join("ca.crt").to_str().unwrap(),
        bao.addr.as_str(),
        mounts.auth_mount.as_str(),
        mounts.role.as_str(),
        a.as_str(),
        bootstrap.to_str().unwrap(),
    ]);
    let out = Proc::spawn("seed_client.py", cmd).finish(TICK);
    assert!(
        out.status.success(),
        "seed client: {}\n{}",
        out.stdout,
        out.stderr
    );
    let seen: Value = serde_json::from_str(out.stdout.trim()).expect(&out.stdout);
    assert_eq!(seen["action"], "apply", "{seen}");
    assert_eq!(seen["content_type"], "application/x-tar", "{seen}");
    assert_eq!(seen["cache_control"], "no-store", "{seen}");
    assert_eq!(seen["sha_verified"], true, "{seen}");
    assert_eq!(seen["resolved"], json!(["GREETING"]), "{seen}");
    assert_eq!(
        seen["value_sha256"]["GREETING"],
        berth_crypto::sha256_hex(secret_a.as_bytes()),
        "{seen}"
    );
    assert_eq!(
        seen["lease_keys"],
        json!(["addr", "env_id", "login_jwt", "mount", "role", "ttl_s"])
    );
    assert_eq!(seen["reported"], true);
    let view = server.cli(&["env", "desired", &a]);
    let agent = &view["agents"][0];
    assert_eq!(agent["agent"], format!("token:{a}"), "{view}");
    assert_eq!(agent["appliedSha"], sha_a.as_str(), "{view}");

    // The kit grant was used: OpenBao refuses it now (single use).
    wait_login_refused(
        &mounts,
        &grant_a,
        "the used kit grant to be refused at login",
    );

    // --- Second reveal: the earlier grant is superseded, and so is its token. ---
    let grant_a2 = kit(&server, &a);
    let (status, body) = block_on(mounts.login(&grant_a2));
    assert_eq!(status, 200, "{body}");
    let token = body["auth"]["client_token"].as_str().unwrap().to_string();
    let checkin = json!({"env_id": a, "applied_sha": sha_a});
    let (status, body) = bearer_call(&server, &token, "/v1/agent/checkin", &checkin);
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["action"], "none", "{body}");
    assert_eq!(body["vault"]["mount"], mounts.kv_mount.as_str(), "{body}");
    // Naming another environment: 403, never retried.
    let (status, body) = bearer_call(&server, &token, "/v1/agent/checkin", &json!({"env_id": b}));
    assert_eq!(
        (status, body["code"].as_str()),
        (403, Some("AGENT_ENV_MISMATCH")),
        "{body}"
    );
    let grant_a3 = kit(&server, &a);
    let (status, body) = bearer_call(&server, &token, "/api/v1/agent/checkin", &checkin);
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("AGENT_UNAUTHENTICATED")),
        "{body}"
    );
    wait_login_refused(
        &mounts,
        &grant_a2,
        "the superseded grant to be refused at login",
    );
    // The live kit still logs in.
    assert_eq!(block_on(mounts.login(&grant_a3)).0, 200);

    // --- berth-agent, bearer mode, environment B: a real stack, its secret from OpenBao. ---
    let port_b = free_port();
    let sha_b = push(
        &server,
        &bundle(
            root.path(),
            &b,
            &image.reference(),
            port_b,
            &mounts.manifest_path(&b, "greeting"),
        ),
        &b,
    );
    let grant_b = kit(&server, &b);
    let grant_file = root.path().join("kit-b.jwt");
    std::fs::write(&grant_file, &grant_b).unwrap();
    let state_dir = root.path().join("agent-b");
    let tick_b = |extra: &[&str]| {
        let mut cmd = std::process::Command::new(BERTH_AGENT);
        cmd.arg("--state-dir")
            .arg(&state_dir)
            .args(["--server", &server.url, "--env", &b, "--once"])
            .arg("--ca-file")
            .arg(data.join("ca.crt"))
            .args([
                "--openbao-addr",
                &bao.addr,
                "--openbao-auth-mount",
                &mounts.auth_mount,
                "--openbao-role",
                &mounts.role,
            ])
            .args(extra);
        Proc::spawn("berth-agent --env b", cmd).finish(TICK)
    };
    let out = tick_b(&["--bootstrap-file", grant_file.to_str().unwrap()]);
    assert!(out.status.success(), "bearer agent: {}", out.stderr);
    assert!(!grant_file.exists(), "the kit file is consumed");
    assert!(
        !state_dir.join("bootstrap.jwt").exists(),
        "the grant is deleted once used"
    );
    let token_mode = std::fs::metadata(state_dir.join("bao.token")).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&token_mode.permissions()) & 0o777,
        0o600
    );
    let body = block_on(fixtures::http_body(port_b));
    assert_eq!(body.as_deref(), Some(secret_b.as_str()));
    let view = server.cli(&["env", "desired", &b]);
    assert_eq!(view["agents"][0]["appliedSha"], sha_b.as_str(), "{view}");
    assert!(
        !out.stderr.contains(&secret_b),
        "the agent logged the secret"
    );
    assert!(!server.proc.stderr().contains(&secret_b) && !server.proc.stderr().contains(&secret_a));

    // The next tick converged: a heartbeat with the stored token.
    let out = tick_b(&[]);
    assert!(out.status.success(), "second tick: {}", out.stderr);

    // A new kit supersedes the agent's grant: its token is refused (401), the agent deletes
    // it and, with no bootstrap grant on disk, exits 1 saying to re-run the install.
    let grant_b2 = kit(&server, &b);
    let out = tick_b(&[]);
    assert_eq!(out.status.code(), Some(1), "{}", out.stderr);
    assert!(
        out.stderr.contains("re-run the install kit"),
        "{}",
        out.stderr
    );
    assert!(
        !state_dir.join("bao.token").exists(),
        "the dead token is deleted"
    );
    // With the new kit's grant on disk, it bootstraps again within the same tick.
    std::fs::write(&grant_file, &grant_b2).unwrap();
    let out = tick_b(&["--bootstrap-file", grant_file.to_str().unwrap()]);
    assert!(out.status.success(), "re-bootstrap: {}", out.stderr);
    assert!(state_dir.join("bao.token").exists());

    // Take B down, then leave OpenBao as it was.
    server.cli(&["env", "retire", &b]);
    let out = tick_b(&[]);
    assert!(out.status.success(), "down tick: {}", out.stderr);
    assert!(fixtures::container_names(&format!("berth-{b}")).is_empty());
    block_on(mounts.teardown());
}
