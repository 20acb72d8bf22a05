//! The kinds that reach an SSH target besides `ssh.deploy`'s happy path, against the real sshd of
//! `scripts/sshd.sh`: artifacts by reference (fetched from an in-test source, digest checked
//! before anything is written), `upload-files` over SFTP (and its injection canary),
//! `read-sticker`, `inspect` and `health-check` over SSH, RSA client keys in OpenSSH, PKCS#1 and
//! PKCS#8 form with a pinned RSA host key, and `scan_host_key`. Without the `BERTH_TEST_SSH_*`
//! variables a test prints SKIP, except under `CI=true` or `BERTH_REQUIRE_SERVICES=1`, where it
//! fails.

#![cfg(unix)]

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use berth_exec::artifact::sha256_hex;
use berth_exec::builtin::{Capabilities, HealthCheck, Inspect, Stickers};
use berth_exec::sticker::StickerStore;
use berth_exec::{
    scan_host_key, ArtifactSource, Executor, FetchError, Outcome, SshExecutor, UploadFiles,
};
use berth_proto::payload::SSH_PRIVATE_KEY_CREDENTIAL;
use berth_proto::result::error_types;
use berth_test_utils::docker::{assert_failed, assert_success, task};
use berth_test_utils::free_port;
use berth_test_utils::ssh::{self, SshEnv};
use serde_json::{json, Value};

/// The server's artifacts, by SHA-256; `lie` answers a reference with other bytes.
#[derive(Default)]
struct Source {
    artifacts: HashMap<String, Vec<u8>>,
    lie: Option<(String, Vec<u8>)>,
}

impl Source {
    fn with(blobs: &[&[u8]]) -> Source {
        Source {
            artifacts: blobs.iter().map(|b| (sha256_hex(b), b.to_vec())).collect(),
            lie: None,
        }
    }
}

#[async_trait::async_trait]
impl ArtifactSource for Source {
    async fn fetch(&self, sha256: &str) -> Result<Vec<u8>, FetchError> {
        if let Some((sha, bytes)) = &self.lie {
            if sha == sha256 {
                return Ok(bytes.clone());
            }
        }
        self.artifacts
            .get(sha256)
            .cloned()
            .ok_or_else(|| FetchError::NotFound(sha256.to_string()))
    }
}

async fn run(executor: &dyn Executor, kind: &str, payload: Value, key: &str) -> Outcome {
    let mut t = task(kind, payload);
    t.credentials
        .insert(SSH_PRIVATE_KEY_CREDENTIAL.into(), key.to_string());
    let o = executor.execute(&t).await;
    assert!(
        !o.logs.contains("PRIVATE KEY") && !o.message.contains("PRIVATE KEY"),
        "the key leaked: {o:?}"
    );
    o
}

fn deploy_payload(env: &SshEnv, dir: &Path, artifacts: Value) -> Value {
    json!({
        "target": env.target(),
        "deployDirectory": dir.display().to_string(),
        "artifacts": artifacts,
        "sticker": {"name": "app", "releaseId": "r7"}
    })
}

/// Binary bytes, so a lossy UTF-8 path anywhere would show.
fn blob() -> Vec<u8> {
    (0..=255u8).cycle().take(300_000).collect()
}

#[tokio::test]
async fn artifacts_by_reference_are_fetched_checked_and_written() {
    let Some(env) = ssh::env("artifacts_by_reference_are_fetched_checked_and_written") else {
        return;
    };
    let key = env.private_key.trim();
    let bytes = blob();
    let sha = sha256_hex(&bytes);
    let source: Arc<dyn ArtifactSource> = Arc::new(Source::with(&[&bytes]));
    let root = env.tempdir();

    // ssh.deploy: one artifact inline, one by reference.
    let dir = root.path().join("app");
    let deployer = SshExecutor::with_artifacts(source.clone());
    let o = run(
        &deployer,
        "ssh.deploy",
        deploy_payload(
            &env,
            &dir,
            json!([{"name": "app.bin", "sha256": sha, "executable": true},
                   {"name": "conf.txt", "content": "c\n"}]),
        ),
        key,
    )
    .await;
    assert_success(&o);
    assert_eq!(std::fs::read(dir.join("app.bin")).unwrap(), bytes);
    assert_eq!(
        std::fs::metadata(dir.join("app.bin")).unwrap().mode() & 0o777,
        0o755
    );
    assert_eq!(o.outputs["uploadedBytes"], json!(bytes.len() + 2));

    // upload-files over SFTP: the same, into a directory it creates.
    let up = root.path().join("uploads/nested");
    let uploader = UploadFiles::new(root.path().join("unused-root")).with_artifacts(source);
    let o = run(
        &uploader,
        "upload-files",
        json!({"directory": up.display().to_string(), "sshTarget": env.target(),
               "files": [{"name": "app.bin", "sha256": sha},
                         {"name": "run.sh", "content": "#!/bin/sh\n", "executable": true}]}),
        key,
    )
    .await;
    assert_success(&o);
    assert_eq!(std::fs::read(up.join("app.bin")).unwrap(), bytes);
    let owner = std::fs::metadata(&env.workdir).unwrap().uid();
    assert_eq!(std::fs::metadata(up.join("app.bin")).unwrap().uid(), owner);
    assert_eq!(
        std::fs::metadata(up.join("run.sh")).unwrap().mode() & 0o777,
        0o755
    );
    assert_eq!(
        std::fs::metadata(up.join("app.bin")).unwrap().mode() & 0o777,
        0o644
    );
    assert_eq!(
        o.outputs["files"],
        json!([{"name": "app.bin", "size": bytes.len(), "sha256": sha},
               {"name": "run.sh", "size": 10, "sha256": sha256_hex(b"#!/bin/sh\n")}])
    );
    // No temporary file is left beside them.
    let mut names: Vec<String> = std::fs::read_dir(&up)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["app.bin", "run.sh"]);

    // Again over what is there, a symlink at one name: replaced, not followed.
    let outside = root.path().join("outside.txt");
    std::fs::write(&outside, "untouched").unwrap();
    std::fs::remove_file(up.join("run.sh")).unwrap();
    std::os::unix::fs::symlink(&outside, up.join("run.sh")).unwrap();
    let o = run(
        &uploader,
        "upload-files",
        json!({"directory": up.display().to_string(), "sshTarget": env.target(),
               "files": [{"name": "run.sh", "content": "v2"}]}),
        key,
    )
    .await;
    assert_success(&o);
    assert_eq!(std::fs::read_to_string(&outside).unwrap(), "untouched");
    assert_eq!(std::fs::read_to_string(up.join("run.sh")).unwrap(), "v2");
    assert!(!std::fs::symlink_metadata(up.join("run.sh"))
        .unwrap()
        .file_type()
        .is_symlink());
}

#[tokio::test]
async fn a_digest_mismatch_or_a_missing_artifact_writes_nothing() {
    let Some(env) = ssh::env("a_digest_mismatch_or_a_missing_artifact_writes_nothing") else {
        return;
    };
    let key = env.private_key.trim();
    let good = blob();
    let sha = sha256_hex(&good);
    let mut tampered = good.clone();
    tampered[7] ^= 1;
    let source: Arc<dyn ArtifactSource> = Arc::new(Source {
        lie: Some((sha.clone(), tampered)),
        ..Source::default()
    });
    let root = env.tempdir();
    let dir = root.path().join("app");
    let files = json!([{"name": "first.txt", "content": "inline, listed first"},
                       {"name": "app.bin", "sha256": sha}]);

    let o = run(
        &SshExecutor::with_artifacts(source.clone()),
        "ssh.deploy",
        deploy_payload(&env, &dir, files.clone()),
        key,
    )
    .await;
    assert_failed(&o, error_types::ARTIFACT_DIGEST_MISMATCH);
    assert!(!o.retriable);
    assert!(!dir.exists(), "the target was touched");
    assert!(!o.logs.contains("connected to"), "{}", o.logs);

    let local_root = tempfile::tempdir().unwrap();
    let uploader = UploadFiles::new(local_root.path()).with_artifacts(source);
    for target in [Some(env.target()), None] {
        let directory = match target {
            Some(_) => dir.clone(),
            None => local_root.path().join("x"),
        };
        let mut p = json!({"directory": directory.display().to_string(), "files": files});
        if let Some(t) = target {
            p["sshTarget"] = t;
        }
        let o = run(&uploader, "upload-files", p, key).await;
        assert_failed(&o, error_types::ARTIFACT_DIGEST_MISMATCH);
        assert!(!directory.exists(), "{} was written", directory.display());
    }

    // A reference the server does not know: final, nothing written.
    let missing = sha256_hex(b"never stored");
    let o = run(
        &SshExecutor::with_artifacts(Arc::new(Source::with(&[&good]))),
        "ssh.deploy",
        deploy_payload(&env, &dir, json!([{"name": "a", "sha256": missing}])),
        key,
    )
    .await;
    assert_failed(&o, error_types::ARTIFACT_NOT_FOUND);
    assert!(!o.retriable, "{o:?}");
    assert!(!dir.exists());

    // An executor without a source refuses a reference.
    let o = run(
        &SshExecutor::default(),
        "ssh.deploy",
        deploy_payload(&env, &dir, json!([{"name": "a", "sha256": sha}])),
        key,
    )
    .await;
    assert_eq!(
        o.error_type.as_deref(),
        Some("ARTIFACT_UNAVAILABLE"),
        "{o:?}"
    );
    assert!(!dir.exists());
}

#[tokio::test]
async fn hostile_upload_names_do_nothing_outside_the_directory() {
    let Some(env) = ssh::env("hostile_upload_names_do_nothing_outside_the_directory") else {
        return;
    };
    let root = env.tempdir();
    let r = root.path().display().to_string();
    let canary = root.path().join("canary");
    std::fs::write(&canary, "alive").unwrap();
    let hostile = |n: u32, at: &str| {
        format!(
            "x y'; rm -f {at}canary; touch {at}pwned-{n}a; '\" $(touch {at}pwned-{n}b) `touch {at}pwned-{n}c`\n; touch {at}pwned-{n}d #"
        )
    };
    let dir = root.path().join(hostile(1, &format!("{r}/")));
    let name = hostile(2, "");
    let o = run(
        &UploadFiles::new("/nonexistent-root"),
        "upload-files",
        json!({"directory": dir.display().to_string(), "sshTarget": env.target(),
               "files": [{"name": name, "content": "payload"}]}),
        env.private_key.trim(),
    )
    .await;
    assert_success(&o);
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), "alive");
    assert_eq!(std::fs::read_to_string(dir.join(&name)).unwrap(), "payload");
    let entries: Vec<String> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        entries.len(),
        2,
        "only the canary and the directory: {entries:?}"
    );
    let inside: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(inside, std::slice::from_ref(&name));
    let home = std::path::PathBuf::from(format!("/home/{}", env.user));
    assert!(!home.join("pwned-2a").exists() && !home.join("canary").exists());

    // A name that leaves the directory is refused before anything is touched.
    let o = run(
        &UploadFiles::new("/nonexistent-root"),
        "upload-files",
        json!({"directory": format!("{r}/ok"), "sshTarget": env.target(),
               "files": [{"name": "../pwned", "content": "x"}]}),
        env.private_key.trim(),
    )
    .await;
    assert_failed(&o, error_types::INVALID_PAYLOAD);
    assert!(!root.path().join("ok").exists() && !root.path().join("pwned").exists());
}

#[tokio::test]
async fn read_sticker_inspect_and_health_check_reach_the_target() {
    let Some(env) = ssh::env("read_sticker_inspect_and_health_check_reach_the_target") else {
        return;
    };
    let key = env.private_key.trim();
    let root = env.tempdir();
    let dir = root.path().join("app");
    let d = dir.display().to_string();
    let local = tempfile::tempdir().unwrap();
    let stickers = Stickers(StickerStore::new(local.path()));
    let inspect = Inspect {
        stickers: StickerStore::new(local.path()),
        capabilities: Capabilities::default(),
        docker: None,
    };

    // Nothing deployed yet: no sticker is a success with a null sticker, not an error.
    let o = run(
        &stickers,
        "read-sticker",
        json!({"name": "app", "sshTarget": env.target(), "deployDirectory": d}),
        key,
    )
    .await;
    assert_success(&o);
    assert_eq!(o.outputs["sticker"], Value::Null);
    let o = run(
        &inspect,
        "inspect",
        json!({"sshTarget": env.target(), "deployDirectory": d}),
        key,
    )
    .await;
    assert_success(&o);
    assert_eq!(o.outputs["sticker"], Value::Null);
    assert_eq!(o.outputs["files"], json!([]));

    let mut deploy = task(
        "ssh.deploy",
        deploy_payload(
            &env,
            &dir,
            json!([{"name": "b.txt", "content": "bee"}, {"name": "a.txt", "content": "a"}]),
        ),
    );
    deploy
        .credentials
        .insert(SSH_PRIVATE_KEY_CREDENTIAL.into(), key.into());
    assert_success(&SshExecutor::default().execute(&deploy).await);
    std::os::unix::fs::symlink("a.txt", dir.join("link")).unwrap();

    // The sticker as written, in the shape the local read-sticker reports.
    let o = run(
        &stickers,
        "read-sticker",
        json!({"name": "app", "sshTarget": env.target(), "deployDirectory": d}),
        key,
    )
    .await;
    assert_success(&o);
    let written: Value =
        serde_json::from_slice(&std::fs::read(dir.join(".berth-sticker.json")).unwrap()).unwrap();
    assert_eq!(o.outputs["sticker"], written);
    assert_eq!(o.outputs["sticker"]["taskId"], deploy.task_id.to_string());
    assert_eq!(o.outputs["sticker"]["releaseId"], "r7");
    // Another target's name reads as none.
    let o = run(
        &stickers,
        "read-sticker",
        json!({"name": "other", "sshTarget": env.target(), "deployDirectory": d}),
        key,
    )
    .await;
    assert_success(&o);
    assert_eq!(o.outputs["sticker"], Value::Null);

    let o = run(
        &inspect,
        "inspect",
        json!({"sshTarget": env.target(), "deployDirectory": d}),
        key,
    )
    .await;
    assert_success(&o);
    assert_eq!(o.outputs["sticker"], written);
    assert_eq!(
        o.outputs["files"],
        json!([{"name": "a.txt", "size": 1, "sha256": sha256_hex(b"a")},
               {"name": "b.txt", "size": 3, "sha256": sha256_hex(b"bee")}])
    );

    // health-check of type command, run on the target.
    let check = |command: Value| json!({"type": "command", "command": command, "sshTarget": env.target(), "timeout": 5});
    let o = run(
        &HealthCheck,
        "health-check",
        check(json!(["test", "-f", format!("{d}/a.txt")])),
        key,
    )
    .await;
    assert_success(&o);
    assert_eq!(o.outputs["probe"], json!({"exitStatus": 0}));
    assert!(o.metrics.health_check_duration_ms.is_some());
    let o = run(
        &HealthCheck,
        "health-check",
        check(json!(["sh", "-c", "exit 4"])),
        key,
    )
    .await;
    assert_failed(&o, error_types::HEALTH_CHECK_FAILED);
    assert!(o.retriable, "read-only: may pass later");
    assert_eq!(o.outputs["probe"], json!({"exitStatus": 4}));
    let o = run(
        &HealthCheck,
        "health-check",
        check(json!(["sleep", "30"])),
        key,
    )
    .await;
    assert_failed(&o, error_types::HEALTH_CHECK_FAILED);
    assert!(o.message.contains("timed out"), "{}", o.message);

    // The same routes refuse a wrong pin before authenticating.
    let mut target = env.target();
    target["hostKey"] =
        json!("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIG+Cwkx+Rk+oHFmybj/rgsw5LcYZbwdaZpDKIwH2VvKn");
    let o = run(
        &stickers,
        "read-sticker",
        json!({"name": "app", "sshTarget": target, "deployDirectory": d}),
        key,
    )
    .await;
    assert_failed(&o, error_types::HOST_KEY_MISMATCH);
}

/// `ssh-keygen -p -m FORMAT` of `key` into a temp file: the same RSA key in PEM (PKCS#1) or
/// PKCS8 form.
fn converted(key: &str, format: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("id");
    std::fs::write(&path, format!("{}\n", key.trim())).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let out = std::process::Command::new("ssh-keygen")
        .args(["-q", "-p", "-N", "", "-P", "", "-m", format, "-f"])
        .arg(&path)
        .output()
        .expect("ssh-keygen (openssh-client)");
    assert!(out.status.success(), "{out:?}");
    std::fs::read_to_string(&path).unwrap()
}

#[tokio::test]
async fn rsa_client_keys_in_every_format_and_a_pinned_rsa_host_key() {
    let test = "rsa_client_keys_in_every_format_and_a_pinned_rsa_host_key";
    let (Some(env), Some(rsa)) = (ssh::env(test), ssh::rsa(test)) else {
        return;
    };
    let openssh = rsa.private_key.trim().to_string();
    let pkcs1 = converted(&openssh, "PEM");
    let pkcs8 = converted(&openssh, "PKCS8");
    assert!(pkcs1.contains("BEGIN RSA PRIVATE KEY"), "{}", &pkcs1[..40]);
    assert!(pkcs8.contains("BEGIN PRIVATE KEY"), "{}", &pkcs8[..40]);
    let root = env.tempdir();
    for (format, key) in [("openssh", &openssh), ("pkcs1", &pkcs1), ("pkcs8", &pkcs8)] {
        for host_key in [&env.host_key, &rsa.host_key] {
            let mut target = env.target();
            target["hostKey"] = json!(host_key);
            let dir = root.path().join(format!("{format}-{}", &host_key[..7]));
            let o = run(
                &UploadFiles::new("/nonexistent-root"),
                "upload-files",
                json!({"directory": dir.display().to_string(), "sshTarget": target,
                       "files": [{"name": "f", "content": format}]}),
                key.trim(),
            )
            .await;
            assert_success(&o);
            assert!(o.logs.contains("matches the pin"), "{}", o.logs);
            assert_eq!(std::fs::read_to_string(dir.join("f")).unwrap(), format);
        }
    }
    // The sshd let the RSA key in; Debian 12's OpenSSH takes no SHA-1 `ssh-rsa` signatures, so
    // the signatures were rsa-sha2-*.
    let log = std::fs::read_to_string(&env.log).unwrap();
    assert!(log.contains("Accepted publickey") && log.contains(": RSA SHA256:"));
}

#[tokio::test]
async fn scan_host_key_reads_the_key_to_pin() {
    let Some(env) = ssh::env("scan_host_key_reads_the_key_to_pin") else {
        return;
    };
    let line = scan_host_key(&env.host, env.port, Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(line, env.host_key);
    let e = scan_host_key("127.0.0.1", free_port(), Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(e.code(), error_types::SSH_UNREACHABLE);
    assert!(e.retriable());
}
