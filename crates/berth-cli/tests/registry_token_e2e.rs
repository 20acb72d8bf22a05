//! berth as the token server of a real Debian `docker-registry` (distribution 2.8, `auth:
//! token` with berth's `registry-token.crt` as its `rootcertbundle`), end to end through real
//! processes: `berth server --registry-token-issuer`, a `berth-agent` on the host's Docker
//! engine, and the admin CLI.
//!
//! The test owns two registry processes on one storage directory: an open one it pushes the
//! image through, and the token one every deployment pulls from (the image is removed locally
//! after the push, so the deployment's pull must pass the registry's token check). Then the
//! agent's identity is driven by hand to receive a deployment task's assignment: its
//! credentials hold only a pull token, scoped to the release's repository, expiring with the
//! task's timeout; the same token is refused for another repository, for a push, and after its
//! expiry (distribution adds 60 s of leeway to `exp`).

#![cfg(unix)]

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use berth_proto::transport::{
    AcquireSession, AgentTaskPollRequest, CONTRACT_VERSION, GENERATION_HEADER,
};
use berth_proto::AgentId;
use berth_test_utils::docker::{self as fixtures, make_image, Cleanup, Variant};
use berth_test_utils::free_port;
use common::*;
use serde_json::{json, Value};

const DEPLOY: Duration = Duration::from_secs(180);
/// The registry's `auth.token.service`, the tokens' `aud`.
const SERVICE: &str = "berth-e2e-registry";
/// The short task timeout whose token the test watches expire.
const SHORT_TIMEOUT_SECS: i64 = 15;
/// distribution's `token.Leeway`.
const REGISTRY_LEEWAY_SECS: i64 = 60;

fn docker_agent(state_dir: &Path, args: &[&str]) -> Command {
    let mut cmd = command(BERTH_AGENT);
    cmd.arg("--state-dir").arg(state_dir).args(args);
    cmd
}

/// Starts `docker-registry` on `port` over `storage`, with `auth` (YAML lines under `auth:`,
/// or none), and waits until it answers `/v2/`.
fn registry(dir: &Path, port: u16, storage: &Path, auth: Option<&str>) -> Proc {
    let config = dir.join(format!("registry-{port}.yml"));
    let mut yaml = format!(
        "version: 0.1\nlog:\n  level: warn\n  accesslog:\n    disabled: true\n\
         storage:\n  filesystem:\n    rootdirectory: {}\n\
         http:\n  addr: 127.0.0.1:{port}\n  secret: berth-e2e-{port}\n",
        storage.display()
    );
    if let Some(auth) = auth {
        yaml.push_str("auth:\n");
        yaml.push_str(auth);
    }
    std::fs::write(&config, yaml).unwrap();
    let mut cmd = Command::new("/usr/bin/docker-registry");
    cmd.arg("serve").arg(&config);
    let mut proc = Proc::spawn(&format!("docker-registry :{port}"), cmd);
    wait_for(SETTLE, &format!("the registry on {port}"), || {
        proc.assert_running();
        match status(port, "GET", "/v2/", None) {
            200 | 401 => Ok(()),
            other => Err(format!("{other}")),
        }
    });
    proc
}

/// The HTTP status of `METHOD http://127.0.0.1:port/path`, with a bearer token if given.
fn status(port: u16, method: &str, path: &str, token: Option<&str>) -> u16 {
    let url = format!("http://127.0.0.1:{port}{path}");
    let mut cmd = Command::new("curl");
    cmd.args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "5"])
        .args(["-X", method])
        .args([
            "-H",
            "Accept: application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json",
        ]);
    if let Some(token) = token {
        cmd.args(["-H", &format!("Authorization: Bearer {token}")]);
    }
    let out = cmd.arg(&url).output().expect("curl");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

fn claims(token: &str) -> Value {
    let body = token.split('.').nth(1).expect("a compact JWS");
    serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(body)
            .unwrap(),
    )
    .unwrap()
}

fn certificate(server: &Server) -> String {
    let out = Command::new("curl")
        .args(["-sf", "--cacert"])
        .arg(server.data_dir.join("ca.crt"))
        .arg(format!("{}/api/v1/registry-token/certificate", server.url))
        .output()
        .expect("curl");
    assert!(out.status.success(), "GET the registry token certificate");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn deployments_pull_with_a_task_scoped_token_that_allows_nothing_else() {
    let Some(env) =
        fixtures::env("deployments_pull_with_a_task_scoped_token_that_allows_nothing_else")
    else {
        return;
    };
    let cleanup = Cleanup::new(&fixtures::unique("berth-e2e"));
    let prefix = cleanup.prefix.clone();
    let tmp = tempdir();
    let storage = tmp.path().join("registry-data");
    std::fs::create_dir_all(&storage).unwrap();

    // The image, pushed through an open registry on the shared storage.
    let open_port = free_port();
    let open = registry(tmp.path(), open_port, &storage, None);
    let pushed = make_image(
        &format!("127.0.0.1:{open_port}"),
        &prefix,
        "web",
        Variant::Healthy,
        "from the token registry",
        None,
    );
    drop(open);
    let _ = env;

    let token_port = free_port();
    let host = format!("127.0.0.1:{token_port}");
    let issuer = format!("{host}={SERVICE}");
    let server = Server::start(
        &tmp.path().join("data"),
        &[
            "--registry-token-issuer",
            &issuer,
            "--heartbeat-interval-secs",
            "1",
            "--lease-grace-secs",
            "1",
        ],
    );
    // The certificate the server serves is the data dir's, and it is what the registry trusts.
    let cert = certificate(&server);
    assert_eq!(
        cert,
        std::fs::read_to_string(server.data_dir.join("registry-token.crt")).unwrap()
    );
    let key_mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(server.data_dir.join("registry-token.key"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(key_mode & 0o777, 0o600);
    let bundle = tmp.path().join("berth-registry-token.crt");
    std::fs::write(&bundle, &cert).unwrap();
    let _registry = registry(
        tmp.path(),
        token_port,
        &storage,
        Some(&format!(
            "  token:\n    realm: https://127.0.0.1:9/unused\n    service: {SERVICE}\n    \
             issuer: berth\n    rootcertbundle: {}\n",
            bundle.display()
        )),
    );
    let repo_path = format!("{prefix}/web");
    let manifest = format!("/v2/{repo_path}/manifests/{}", pushed.digest);
    assert_eq!(status(token_port, "GET", &manifest, None), 401, "no token");

    // --- A real deployment pulls with its task's token (the server resolves the release with
    // a token of its own). ---
    let agent = Agent::spawn_registered(&server, tmp.path(), "puller", &[], docker_agent);
    server.cli(&["agents", "label", agent.id.as_str(), "env=tok"]);
    server.wait_agent(&agent.id, "online with docker", |a| {
        a["status"] == "online"
            && a["capabilities"]
                .as_array()
                .is_some_and(|c| c.iter().any(|c| c["name"] == "docker"))
    });
    let port = free_port();
    let image = format!("{host}/{repo_path}@{}", pushed.digest);
    let config = json!({
        "containerName": format!("{prefix}-web"),
        "ports": [format!("127.0.0.1:{port}:8080/tcp")],
        "restartPolicy": "no",
        "healthCheck": {"type": "http", "interval": 1, "url": format!("http://127.0.0.1:{port}/")},
    });
    let release = server.cli(&[
        "release",
        "create",
        "r1",
        "--image",
        &format!("web={image}"),
        "--config",
        &format!("web={config}"),
    ]);
    assert_eq!(
        release["components"][0]["digest"],
        pushed.digest.as_str(),
        "{release}"
    );
    server.cli(&[
        "env",
        "create",
        "tok",
        "--tier",
        "qa",
        "--selector",
        "env=tok",
    ]);
    let (code, out, err) = server.run_as(
        &server.admin_token,
        &["deploy", "r1", "--env", "tok", "--wait"],
        DEPLOY,
    );
    assert_eq!(code, 0, "deploy r1: {out}\n{err}");
    wait_for(DEPLOY, "the deployed container to serve", || {
        let body = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(fixtures::http_body(port));
        match body.as_deref() {
            Some("from the token registry") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });

    // --- The agent's identity driven by hand receives a deployment task: its credentials. ---
    let mut agent = agent;
    agent.proc.kill9();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let as_agent = agent_client(&server, &agent.state_dir);
    let agent_id = AgentId(agent.id.parse().unwrap());
    let acquire = AcquireSession {
        agent_id,
        instance_id: "registry-token-e2e".into(),
        boot_id: None,
        lock: None,
        version: None,
    };
    let generation = wait_for(SETTLE, "the hand-driven session", || {
        rt.block_on(as_agent.send(&acquire))
            .map(|s| s.generation)
            .map_err(|e| e.to_string())
    });
    server.cli(&[
        "env",
        "create",
        "short",
        "--tier",
        "qa",
        "--selector",
        "env=tok",
        "--health-timeout",
        "5",
        "--task-timeout",
        &SHORT_TIMEOUT_SECS.to_string(),
    ]);
    server.cli(&["deploy", "r1", "--env", "short"]);
    let poll = AgentTaskPollRequest {
        contract_version: CONTRACT_VERSION.into(),
        agent_id,
        capabilities: vec!["docker".into()],
        start_handshake: false,
    };
    let header = generation.to_string();
    let assignment = wait_for(SETTLE, "the short deployment's task", || {
        rt.block_on(as_agent.send_with(&poll, &[(GENERATION_HEADER, &header)], None))
            .map_err(|e| e.to_string())?
            .assignment
            .filter(|a| a.task_type == "docker.run")
            .ok_or_else(|| "no docker.run yet".to_string())
    });
    // The credentials travel sealed to the agent's key (issue 17 item 2): only it opens them.
    assert!(assignment.credentials.is_empty());
    let agent_key = berth_crypto::hpke::RecipientKey::from_pkcs8_pem(
        &std::fs::read_to_string(agent.state_dir.join("agent.pem")).unwrap(),
    )
    .unwrap();
    let credentials = berth_client::sealing::open_assignment(&assignment, &agent_key)
        .unwrap()
        .credentials;
    let keys: Vec<&str> = credentials.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        ["registryServer", "registryToken"],
        "a pull token and its registry, no password"
    );
    assert_eq!(credentials["registryServer"], host);
    let token = credentials["registryToken"].clone();
    let c = claims(&token);
    assert_eq!(
        c["access"],
        json!([{"type": "repository", "name": repo_path, "actions": ["pull"]}])
    );
    assert_eq!(c["aud"], SERVICE);
    assert_eq!(c["iss"], "berth");
    let exp = c["exp"].as_i64().unwrap();
    assert_eq!(
        exp,
        assignment.assigned_at.unix_timestamp() + SHORT_TIMEOUT_SECS,
        "the token expires with the task's timeout, counted from the delivery"
    );

    // --- The same token at the registry: pull of the repository only. ---
    assert_eq!(status(token_port, "GET", &manifest, Some(&token)), 200);
    let other = format!("/v2/{prefix}/other/manifests/{}", pushed.digest);
    let refused = status(token_port, "GET", &other, Some(&token));
    assert!(
        matches!(refused, 401 | 403),
        "another repository: {refused}"
    );
    let upload = format!("/v2/{repo_path}/blobs/uploads/");
    let refused = status(token_port, "POST", &upload, Some(&token));
    assert!(matches!(refused, 401 | 403), "a push: {refused}");

    // After the timeout (plus the registry's leeway) the token is refused.
    let after = exp + REGISTRY_LEEWAY_SECS + 2;
    let wait = (after - time::OffsetDateTime::now_utc().unix_timestamp()).max(0) as u64;
    wait_for(
        Duration::from_secs(wait + 60),
        "the registry to refuse the expired token",
        || {
            if time::OffsetDateTime::now_utc().unix_timestamp() < after {
                return Err("not expired yet".into());
            }
            match status(token_port, "GET", &manifest, Some(&token)) {
                401 | 403 => Ok(()),
                other => Err(format!("{other}")),
            }
        },
    );
    // A client may not ask for a scope itself: only the server sets it.
    let refused = server.try_cli(&[
        "task",
        "create",
        "--type",
        "docker.run",
        "--agent",
        agent.id.as_str(),
        "--payload",
        &json!({"image": format!("{host}/{prefix}/other"), "digest": pushed.digest,
                "config": {"containerName": format!("{prefix}-other")}})
        .to_string(),
        "--credential",
        &format!("registryTokenScope={host}/{prefix}/other"),
    ]);
    let err = refused.expect_err("a client-set scope");
    assert!(err.contains("CREDENTIAL_RESERVED"), "{err}");
    drop(cleanup);
}
