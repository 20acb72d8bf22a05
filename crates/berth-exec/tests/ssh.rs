//! `ssh.deploy` against the real sshd of `scripts/sshd.sh` (Debian's openssh-server on
//! 127.0.0.1:55022, user `berth-ssh-test`): the happy path, a failing deploy script and a failing
//! health check that both restore the deploy directory byte for byte, a host key that is not the
//! pinned one (through a relay, so sshd's log shows the connection ended before any
//! authentication request), a key the target does not know, an sshd that is not there, and
//! injection through the deploy directory and an artifact name. Each test deploys into its own temp dir below the user's work dir, removed on
//! drop. Without the `BERTH_TEST_SSH_*` variables a test prints SKIP, except under `CI=true` or
//! `BERTH_REQUIRE_SERVICES=1`, where it fails.

#![cfg(unix)]

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use berth_exec::{Executor, Outcome, SshExecutor};
use berth_proto::payload::SSH_PRIVATE_KEY_CREDENTIAL;
use berth_proto::result::error_types;
use berth_test_utils::docker::{assert_failed, assert_success, task};
use berth_test_utils::free_port;
use berth_test_utils::ssh::{self, chown, SshEnv};
use serde_json::{json, Value};

/// A valid ed25519 public key that is not the test sshd's.
const OTHER_HOST_KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG+Cwkx+Rk+oHFmybj/rgsw5LcYZbwdaZpDKIwH2VvKn";

/// Another secret of the task, which the happy path's hook prints on the target.
const TOKEN: &str = "tok-3f9a1c77e2";

async fn deploy(env: &SshEnv, payload: Value) -> Outcome {
    deploy_with_key(payload, env.private_key.trim()).await
}

async fn deploy_with_key(payload: Value, key: &str) -> Outcome {
    let mut t = task("ssh.deploy", payload);
    t.credentials
        .insert(SSH_PRIVATE_KEY_CREDENTIAL.into(), key.to_string());
    t.credentials.insert("deployToken".into(), TOKEN.into());
    let outcome = SshExecutor::default().execute(&t).await;
    assert!(
        !outcome.logs.contains("PRIVATE KEY") && !outcome.message.contains("PRIVATE KEY"),
        "the key leaked: {outcome:?}"
    );
    outcome
}

/// What a directory holds: path → (mode, bytes or link target), recursively.
fn snapshot(dir: &Path) -> BTreeMap<String, (u32, Vec<u8>)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let key = path.strip_prefix(dir).unwrap().display().to_string();
            let content = if meta.file_type().is_symlink() {
                std::fs::read_link(&path)
                    .unwrap()
                    .display()
                    .to_string()
                    .into_bytes()
            } else if meta.is_dir() {
                stack.push(path.clone());
                Vec::new()
            } else {
                std::fs::read(&path).unwrap()
            };
            out.insert(key, (meta.mode(), content));
        }
    }
    out
}

/// A deploy directory holding a previous deployment: text, binary bytes, a dotfile, a nested
/// directory, an executable and a symlink, all the SSH user's.
fn previous_deployment(env: &SshEnv, root: &Path) -> std::path::PathBuf {
    let dir = root.join("app");
    std::fs::create_dir_all(dir.join("conf/nested")).unwrap();
    std::fs::write(dir.join("app.txt"), "v1\n").unwrap();
    std::fs::write(dir.join("blob.bin"), (0..=255u8).collect::<Vec<_>>()).unwrap();
    std::fs::write(dir.join(".env"), "K=V\n").unwrap();
    std::fs::write(dir.join("conf/nested/x.yml"), "a: 1\n").unwrap();
    std::fs::write(dir.join("run.sh"), "#!/bin/sh\necho v1\n").unwrap();
    std::fs::set_permissions(dir.join("run.sh"), std::fs::Permissions::from_mode(0o750)).unwrap();
    std::os::unix::fs::symlink("app.txt", dir.join("current")).unwrap();
    let owner = std::fs::metadata(&env.workdir).unwrap();
    let mut stack = vec![dir.clone()];
    while let Some(d) = stack.pop() {
        std::os::unix::fs::lchown(&d, Some(owner.uid()), Some(owner.gid())).unwrap();
        if d.is_dir() && !d.is_symlink() {
            for e in std::fs::read_dir(&d).unwrap() {
                stack.push(e.unwrap().path());
            }
        }
    }
    chown(&dir, owner.uid(), owner.gid());
    dir
}

fn payload(env: &SshEnv, dir: &Path, extra: Value) -> Value {
    let mut p = json!({
        "target": env.target(),
        "deployDirectory": dir.display().to_string(),
        "artifacts": [
            {"name": "app.txt", "content": "v2\n"},
            {"name": "deploy.sh", "content": "#!/bin/sh\nset -e\necho deploying \"$@\"\ncp app.txt served.txt\n", "executable": true}
        ],
        "script": {"command": ["./deploy.sh", "now"], "timeout": 30},
        "sticker": {"name": "app", "releaseId": "r2", "releaseName": "app-2"}
    });
    for (k, v) in extra.as_object().unwrap() {
        p[k] = v.clone();
    }
    p
}

#[tokio::test]
async fn happy_path_uploads_runs_checks_and_writes_the_sticker() {
    let Some(env) = ssh::env("happy_path_uploads_runs_checks_and_writes_the_sticker") else {
        return;
    };
    let root = env.tempdir();
    let dir = root.path().join("app");
    let o = deploy(
        &env,
        payload(
            &env,
            &dir,
            json!({
                "hooks": {"preDeploy": {"command": ["touch", "pre-ran"]},
                          "postDeploy": {"command": ["sh", "-c", format!("test -f served.txt && touch post-ran && echo token {TOKEN}")]}},
                "healthCheck": {"type": "command", "command": ["grep", "-q", "v2", "served.txt"], "timeout": 10}
            }),
        ),
    )
    .await;
    assert_success(&o);
    assert_eq!(
        std::fs::read_to_string(dir.join("served.txt")).unwrap(),
        "v2\n"
    );
    assert_eq!(
        std::fs::metadata(dir.join("deploy.sh")).unwrap().mode() & 0o777,
        0o755
    );
    assert_eq!(
        std::fs::metadata(dir.join("app.txt")).unwrap().mode() & 0o777,
        0o644
    );
    assert!(dir.join("pre-ran").exists() && dir.join("post-ran").exists());
    assert!(!dir.join(".berth-backup").exists(), "the backup is removed");
    assert!(o.logs.contains("deploying now"), "{}", o.logs);
    // The target's output is redacted like everything else.
    assert!(
        o.logs.contains("token ***") && !o.logs.contains(TOKEN),
        "{}",
        o.logs
    );
    let sticker: Value =
        serde_json::from_slice(&std::fs::read(dir.join(".berth-sticker.json")).unwrap()).unwrap();
    assert_eq!(sticker["name"], "app");
    assert_eq!(sticker["releaseId"], "r2");
    assert_eq!(
        sticker["extra"]["deployDirectory"],
        dir.display().to_string()
    );
    let m = &o.metrics;
    assert!(
        m.upload_duration_ms.is_some()
            && m.deploy_duration_ms.is_some()
            && m.health_check_duration_ms.is_some(),
        "{m:?}"
    );
    assert!(!o.outputs.contains_key("rolledBack"), "{:?}", o.outputs);
}

#[tokio::test]
async fn a_failing_deploy_script_restores_the_backup_byte_for_byte() {
    let Some(env) = ssh::env("a_failing_deploy_script_restores_the_backup_byte_for_byte") else {
        return;
    };
    let root = env.tempdir();
    let dir = previous_deployment(&env, root.path());
    let before = snapshot(&dir);
    let o = deploy(
        &env,
        payload(
            &env,
            &dir,
            json!({
                "artifacts": [{"name": "app.txt", "content": "v2-broken\n"},
                              {"name": "new-file", "content": "x"}],
                "script": {"command": ["sh", "-c", "rm -rf conf; echo garbage > blob.bin; echo boom >&2; exit 3"]}
            }),
        ),
    )
    .await;
    assert_failed(&o, error_types::DEPLOY_SCRIPT_FAILED);
    assert!(!o.retriable);
    assert_eq!(o.outputs["rolledBack"], json!(true), "{:?}", o.outputs);
    assert!(o.message.contains("exit status 3"), "{}", o.message);
    assert!(o.logs.contains("boom"), "{}", o.logs);
    assert_eq!(
        snapshot(&dir),
        before,
        "the deploy directory is not as it was"
    );
}

#[tokio::test]
async fn a_deploy_script_past_its_timeout_is_killed_and_rolled_back() {
    let Some(env) = ssh::env("a_deploy_script_past_its_timeout_is_killed_and_rolled_back") else {
        return;
    };
    let root = env.tempdir();
    let dir = previous_deployment(&env, root.path());
    let before = snapshot(&dir);
    let started = std::time::Instant::now();
    let o = deploy(
        &env,
        payload(
            &env,
            &dir,
            json!({"script": {"command": ["sleep", "60"], "timeout": 1}}),
        ),
    )
    .await;
    assert_failed(&o, error_types::DEPLOY_SCRIPT_FAILED);
    assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
    assert_eq!(o.outputs["rolledBack"], json!(true));
    assert_eq!(snapshot(&dir), before);
}

#[tokio::test]
async fn a_failing_health_check_restores_the_target() {
    let Some(env) = ssh::env("a_failing_health_check_restores_the_target") else {
        return;
    };
    let root = env.tempdir();
    let dir = previous_deployment(&env, root.path());
    let before = snapshot(&dir);
    let nobody = free_port();
    let o = deploy(
        &env,
        payload(
            &env,
            &dir,
            json!({"healthCheck": {"type": "http", "url": format!("http://127.0.0.1:{nobody}/"),
                                   "timeout": 2, "interval": 1}}),
        ),
    )
    .await;
    assert_failed(&o, error_types::HEALTH_CHECK_FAILED);
    assert_eq!(o.outputs["rolledBack"], json!(true));
    assert!(o.metrics.health_check_duration_ms.is_some());
    assert_eq!(snapshot(&dir), before);

    // A command on the target as the check, failing the same way.
    let o = deploy(
        &env,
        payload(
            &env,
            &dir,
            json!({"healthCheck": {"type": "command", "command": ["false"], "timeout": 1}}),
        ),
    )
    .await;
    assert_failed(&o, error_types::HEALTH_CHECK_FAILED);
    assert_eq!(snapshot(&dir), before);
}

/// Relays one connection from a loopback listener to the sshd. Returns the listener's port and,
/// once the connection ends, the local port of the relay's own connection to sshd: the port
/// sshd's log names that connection by.
async fn relay(env: &SshEnv) -> (u16, tokio::task::JoinHandle<u16>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (host, sshd) = (env.host.clone(), env.port);
    let relayed = tokio::spawn(async move {
        let (mut inbound, _) = listener.accept().await.unwrap();
        let mut outbound = tokio::net::TcpStream::connect((host.as_str(), sshd))
            .await
            .unwrap();
        let local = outbound.local_addr().unwrap().port();
        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        local
    });
    (port, relayed)
}

/// sshd's log of the connection from `port`, once it logged the connection's end.
async fn sshd_log_of(env: &SshEnv, port: u16) -> Vec<String> {
    let mut lines = Vec::new();
    for _ in 0..100 {
        lines = env.log_of_connection(port);
        if lines
            .iter()
            .any(|l| l.starts_with("Connection closed") || l.starts_with("Disconnected"))
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    lines
}

#[tokio::test]
async fn a_host_key_that_is_not_the_pin_is_refused_before_authentication() {
    let Some(env) = ssh::env("a_host_key_that_is_not_the_pin_is_refused_before_authentication")
    else {
        return;
    };
    assert_ne!(env.host_key, OTHER_HOST_KEY, "regenerate OTHER_HOST_KEY");
    let root = env.tempdir();
    let dir = root.path().join("app");

    // Control: with the right pin, sshd logs the connection's authentication.
    let (port, relayed) = relay(&env).await;
    let mut p = payload(&env, &dir, json!({}));
    p["target"]["port"] = json!(port);
    assert_success(&deploy(&env, p).await);
    let seen = sshd_log_of(&env, relayed.await.unwrap()).await;
    assert!(
        seen.iter().any(|l| l.starts_with("Accepted publickey")),
        "{seen:#?}"
    );

    std::fs::remove_dir_all(&dir).unwrap();
    let (port, relayed) = relay(&env).await;
    let mut p = payload(&env, &dir, json!({}));
    p["target"]["port"] = json!(port);
    p["target"]["hostKey"] = json!(OTHER_HOST_KEY);
    let o = deploy(&env, p).await;
    assert_failed(&o, error_types::HOST_KEY_MISMATCH);
    assert!(!o.retriable);
    assert!(o.message.contains("nothing was sent"), "{}", o.message);
    assert!(!o.logs.contains("authenticated"), "{}", o.logs);
    assert!(!dir.exists(), "something ran on the target");
    // sshd saw the connection end before any authentication request.
    let seen = sshd_log_of(&env, relayed.await.unwrap()).await;
    assert!(
        seen.iter().any(|l| l.starts_with("Connection from")),
        "{seen:#?}"
    );
    assert!(
        !seen
            .iter()
            .any(|l| l.contains("publickey") || l.contains("Accepted") || l.contains("Failed")),
        "{seen:#?}"
    );
}

#[tokio::test]
async fn a_key_the_target_does_not_know_is_refused() {
    let Some(env) = ssh::env("a_key_the_target_does_not_know_is_refused") else {
        return;
    };
    let keys = tempfile::tempdir().unwrap();
    let path = keys.path().join("id");
    let made = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&path)
        .status()
        .expect("ssh-keygen (openssh-client)");
    assert!(made.success());
    let stranger = std::fs::read_to_string(&path).unwrap();
    let root = env.tempdir();
    let dir = root.path().join("app");
    let o = deploy_with_key(payload(&env, &dir, json!({})), stranger.trim()).await;
    assert_failed(&o, error_types::SSH_AUTH_FAILED);
    assert!(!o.retriable);
    assert!(!dir.exists());
}

struct Fenced;

#[async_trait::async_trait]
impl berth_exec::LeaseCheck for Fenced {
    async fn confirm(
        &self,
        _phase: Option<berth_proto::transport::ProgressPhase>,
    ) -> Result<(), String> {
        Err("FENCED".into())
    }
}

#[tokio::test]
async fn without_its_lease_nothing_changes_on_the_target() {
    let Some(env) = ssh::env("without_its_lease_nothing_changes_on_the_target") else {
        return;
    };
    let root = env.tempdir();
    let dir = root.path().join("app");
    let mut t = task("ssh.deploy", payload(&env, &dir, json!({})));
    t.credentials.insert(
        SSH_PRIVATE_KEY_CREDENTIAL.into(),
        env.private_key.trim().to_string(),
    );
    t.lease = berth_exec::Lease::new(std::sync::Arc::new(Fenced));
    let o = SshExecutor::default().execute(&t).await;
    assert_failed(&o, error_types::LEASE_LOST);
    assert!(o.retriable, "not journaled: a later delivery runs it");
    assert!(!dir.exists(), "the target changed without a lease");
}

#[tokio::test]
async fn an_sshd_that_is_not_there_is_a_retriable_failure() {
    let Some(env) = ssh::env("an_sshd_that_is_not_there_is_a_retriable_failure") else {
        return;
    };
    let mut p = payload(&env, Path::new("/srv/never"), json!({}));
    p["target"]["port"] = json!(free_port());
    let o = deploy(&env, p).await;
    assert_failed(&o, error_types::SSH_UNREACHABLE);
    assert!(o.retriable, "{o:?}");
}

#[tokio::test]
async fn hostile_names_do_nothing_outside_the_deploy_directory() {
    let Some(env) = ssh::env("hostile_names_do_nothing_outside_the_deploy_directory") else {
        return;
    };
    let root = env.tempdir();
    let r = root.path().display().to_string();
    let canary = root.path().join("canary");
    std::fs::write(&canary, "alive").unwrap();
    // Every trick that breaks out of naive interpolation, each aimed at the canary or at a
    // `pwned-N` file: by absolute path beside the canary, or (in a file name, which has no `/`)
    // relative, in whatever directory a command would run.
    let hostile = |n: u32, at: &str| {
        format!(
            "x y'; rm -f {at}canary; touch {at}pwned-{n}a; '\" $(touch {at}pwned-{n}b) `touch {at}pwned-{n}c`\n; touch {at}pwned-{n}d #"
        )
    };
    let dir = root.path().join(hostile(1, &format!("{r}/")));
    let artifact = hostile(2, "");
    let o = deploy(
        &env,
        payload(
            &env,
            &dir,
            json!({
                "artifacts": [{"name": artifact, "content": "payload"},
                              {"name": "deploy.sh", "content": "#!/bin/sh\nexit 0\n", "executable": true}],
                "script": {"command": ["./deploy.sh", hostile(3, &format!("{r}/"))]},
                "healthCheck": {"type": "command", "command": ["test", "-f", artifact]}
            }),
        ),
    )
    .await;
    assert_success(&o);
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), "alive");
    // The names were taken literally: the directory and the file exist under them.
    assert_eq!(
        std::fs::read_to_string(dir.join(&artifact)).unwrap(),
        "payload"
    );
    assert!(dir.join(".berth-sticker.json").exists());
    let entries: Vec<String> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        entries.len(),
        2,
        "only the canary and the deploy dir: {entries:?}"
    );
    let mut deployed: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    deployed.sort();
    let mut expected = vec![
        artifact.clone(),
        "deploy.sh".into(),
        ".berth-sticker.json".into(),
    ];
    expected.sort();
    assert_eq!(deployed, expected);
    let home = std::path::PathBuf::from(format!("/home/{}", env.user));
    assert!(!home.join("canary").exists() && !home.join("pwned-2a").exists());

    // A name that leaves the directory is refused before anything is touched.
    for (field, bad) in [
        (
            "artifacts",
            json!([{"name": format!("../../{}", "pwned"), "content": "x"}]),
        ),
        ("deployDirectory", json!(format!("{r}/../{}", "pwned"))),
    ] {
        let mut p = payload(&env, &root.path().join("ok"), json!({}));
        p[field] = bad;
        let o = deploy(&env, p).await;
        assert_failed(&o, error_types::INVALID_PAYLOAD);
    }
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), "alive");
    assert!(!root.path().join("ok").exists());
}
