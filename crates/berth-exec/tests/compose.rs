//! `compose.up` on the real engine with the host's compose (v2 when present, else v1), images
//! from the local registry of `scripts/registry.sh`. Projects are named `berth-test-…` and
//! taken down at the end, even on failure.

use std::collections::BTreeMap;
use std::time::Duration;

use berth_exec::compose::{sweep_credentials, BACKUP_FILE, DOCKER_CONFIG_PREFIX, LOCK_FILE};
use berth_exec::sticker::StickerStore;
use berth_exec::{ComposeExecutor, Executor};
use berth_test_utils::docker::*;
use berth_test_utils::{files_containing, free_port, wait_until};
use serde_json::json;

fn lock(services: &[(&str, &Image, u16)]) -> String {
    let mut out = String::from("version: \"3.7\"\nservices:\n");
    for (name, image, port) in services {
        out.push_str(&format!(
            "  {name}:\n    image: {}\n    ports:\n      - \"127.0.0.1:{port}:8080\"\n",
            image.reference()
        ));
    }
    out
}

fn payload(
    project: &str,
    dir: &std::path::Path,
    content: &str,
    services: &[(&str, &Image)],
) -> serde_json::Value {
    let expected: BTreeMap<&str, &str> = services
        .iter()
        .map(|(s, i)| (*s, i.digest.as_str()))
        .collect();
    json!({
        "artifacts": [{"type": "compose_lock", "name": "compose.yml", "content": content}],
        "config": {
            "projectName": project,
            "deploymentDirectory": dir.display().to_string(),
            "expectedDigests": expected,
            "healthCheck": {"type": "docker", "timeout": 40, "interval": 1},
            "releaseName": "shop-1",
        },
    })
}

#[tokio::test]
async fn two_services_up_then_an_unhealthy_upgrade_restores_the_backup() {
    let Some(env) = env("two_services_up_then_an_unhealthy_upgrade_restores_the_backup") else {
        return;
    };
    let prefix = unique("berth-test");
    let mut cleanup = Cleanup::new(&prefix);
    let web1 = make_image(
        &env.registry,
        &prefix,
        "web",
        Variant::Healthy,
        "web v1",
        None,
    );
    let api1 = make_image(
        &env.registry,
        &prefix,
        "api",
        Variant::Healthy,
        "api v1",
        None,
    );
    let web2 = make_image(
        &env.registry,
        &prefix,
        "web",
        Variant::Unhealthy,
        "web v2",
        None,
    );
    let state = tempfile::tempdir().unwrap();
    let exec = ComposeExecutor::new(
        StickerStore::new(state.path().join("stickers")),
        state.path().join("tmp"),
    );
    let command = exec
        .compose_command()
        .await
        .expect("docker compose or docker-compose");
    let dir = state.path().join("deploy");
    let project = prefix.clone();
    cleanup.compose_project(&command, &project, &dir);
    let (web_port, api_port) = (free_port(), free_port());

    let v1 = lock(&[("web", &web1, web_port), ("api", &api1, api_port)]);
    let outcome = exec
        .execute(&task(
            "compose.up",
            payload(&project, &dir, &v1, &[("web", &web1), ("api", &api1)]),
        ))
        .await;
    assert_success(&outcome);
    assert_eq!(http_body(web_port).await.as_deref(), Some("web v1"));
    assert_eq!(http_body(api_port).await.as_deref(), Some("api v1"));
    assert_eq!(std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap(), v1);
    assert!(
        outcome.metrics.pull_duration_ms.is_some()
            && outcome.metrics.health_check_duration_ms.is_some()
    );
    assert_eq!(outcome.outputs["services"]["web"], json!(web1.digest));
    let sticker = StickerStore::new(state.path().join("stickers"))
        .read(&project)
        .unwrap()
        .unwrap();
    assert_eq!(sticker.release_name.as_deref(), Some("shop-1"));
    assert_eq!(sticker.extra["services"]["api"], json!(api1.digest));

    // web v2's HEALTHCHECK fails: the v1 lock comes back and serves again.
    let v2 = lock(&[("web", &web2, web_port), ("api", &api1, api_port)]);
    let outcome = exec
        .execute(&task(
            "compose.up",
            payload(&project, &dir, &v2, &[("web", &web2), ("api", &api1)]),
        ))
        .await;
    assert_failed(&outcome, "HEALTH_CHECK_FAILED");
    assert!(
        outcome.message.contains("service web"),
        "{}",
        outcome.message
    );
    assert_eq!(
        outcome.outputs["rolledBack"],
        json!(true),
        "{}",
        outcome.logs
    );
    assert_eq!(
        outcome.outputs["previousDigests"]["web"],
        json!(web1.digest)
    );
    assert_eq!(
        std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap(),
        v1,
        "the backup is restored"
    );
    assert!(dir.join(BACKUP_FILE).exists());
    wait_until(
        Duration::from_secs(20),
        "the old stack to serve again",
        || async {
            http_body(web_port).await.as_deref() == Some("web v1")
                && http_body(api_port).await.as_deref() == Some("api v1")
        },
    )
    .await;
}

#[tokio::test]
async fn a_lock_that_does_not_match_is_refused_before_anything_is_written() {
    // No engine needed: the lock is checked before compose is even looked for.
    let state = tempfile::tempdir().unwrap();
    let exec = ComposeExecutor::new(
        StickerStore::new(state.path().join("stickers")),
        state.path().join("tmp"),
    );
    let dir = state.path().join("deploy");
    let d = |c: char| format!("sha256:{}", c.to_string().repeat(64));
    let web = Image {
        repository: "127.0.0.1:55000/berth-test-never/web".into(),
        digest: d('a'),
    };
    let content = lock(&[("web", &web, 1)]);

    let mut p = payload("berth-test-never", &dir, &content, &[("web", &web)]);
    p["config"]["expectedDigests"]["web"] = json!(d('b'));
    assert_failed(
        &exec.execute(&task("compose.up", p)).await,
        "DIGEST_MISMATCH",
    );

    let mut p = payload("berth-test-never", &dir, &content, &[("web", &web)]);
    p["config"]["expectedDigests"]["db"] = json!(d('c'));
    assert_failed(
        &exec.execute(&task("compose.up", p)).await,
        "SERVICE_NOT_FOUND",
    );

    let tagged = "services:\n  web:\n    image: 127.0.0.1:55000/web:latest\n";
    let p = payload("berth-test-never", &dir, tagged, &[("web", &web)]);
    assert_failed(
        &exec.execute(&task("compose.up", p)).await,
        "DIGEST_REQUIRED",
    );

    let mut p = payload("berth-test-never", &dir, &content, &[("web", &web)]);
    p["artifacts"] = json!([]);
    assert_failed(
        &exec.execute(&task("compose.up", p)).await,
        "COMPOSE_LOCK_MISSING",
    );

    for bad_project in ["Bad Name", "../x", "-x"] {
        let p = payload(bad_project, &dir, &content, &[("web", &web)]);
        assert_failed(
            &exec.execute(&task("compose.up", p)).await,
            "INVALID_PAYLOAD",
        );
    }
    let p = payload(
        "berth-test-never",
        std::path::Path::new("/tmp/../etc"),
        &content,
        &[("web", &web)],
    );
    assert_failed(
        &exec.execute(&task("compose.up", p)).await,
        "INVALID_PAYLOAD",
    );

    assert!(!dir.exists(), "nothing was written");
}

#[tokio::test]
async fn pulls_with_registry_credentials_and_refuses_a_wrong_password() {
    let Some(env) = env("pulls_with_registry_credentials_and_refuses_a_wrong_password") else {
        return;
    };
    let prefix = unique("berth-test");
    let mut cleanup = Cleanup::new(&prefix);
    let login = Some((env.user.as_str(), env.password.as_str()));
    let web = make_image(
        &env.auth_registry,
        &prefix,
        "web",
        Variant::Healthy,
        "private",
        login,
    );
    let state = tempfile::tempdir().unwrap();
    let exec = ComposeExecutor::new(
        StickerStore::new(state.path().join("stickers")),
        state.path().join("tmp"),
    );
    let command = exec
        .compose_command()
        .await
        .expect("docker compose or docker-compose");
    let dir = state.path().join("deploy");
    cleanup.compose_project(&command, &prefix, &dir);
    let port = free_port();
    let content = lock(&[("web", &web, port)]);
    let p = payload(&prefix, &dir, &content, &[("web", &web)]);

    let wrong = "not-the-password-77c1";
    let outcome = exec
        .execute(&with_login(task("compose.up", p.clone()), &env.user, wrong))
        .await;
    assert_failed(&outcome, "REGISTRY_AUTH_FAILED");
    eprintln!("wrong password: {}", outcome.message);
    assert!(!outcome.retriable);
    assert!(!serde_json::to_string(&outcome).unwrap().contains(wrong));
    assert!(!dir.join(LOCK_FILE).exists(), "the new lock is taken back");
    assert!(container_names(&prefix).is_empty(), "nothing was started");

    let outcome = exec
        .execute(&with_login(task("compose.up", p), &env.user, &env.password))
        .await;
    assert_success(&outcome);
    assert!(!serde_json::to_string(&outcome)
        .unwrap()
        .contains(&env.password));
    assert_eq!(http_body(port).await.as_deref(), Some("private"));
}

/// The registry login directories in `credentials_dir`.
fn logins(credentials_dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    std::fs::read_dir(credentials_dir)
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    e.file_name()
                        .to_string_lossy()
                        .starts_with(DOCKER_CONFIG_PREFIX)
                })
                .map(|e| e.path())
                .collect()
        })
        .unwrap_or_default()
}

/// Issue 9 item 6: while compose pulls, the registry login lives in a 0700 directory under the
/// credentials dir the agent names (not in /tmp), and it is gone after success, failure and
/// cancellation alike.
#[tokio::test]
async fn the_registry_login_lives_in_the_private_credentials_dir_and_is_always_removed() {
    use base64::Engine as _;
    use std::os::unix::fs::PermissionsExt;
    let Some(env) =
        env("the_registry_login_lives_in_the_private_credentials_dir_and_is_always_removed")
    else {
        return;
    };
    let prefix = unique("berth-test");
    let mut cleanup = Cleanup::new(&prefix);
    let login = Some((env.user.as_str(), env.password.as_str()));
    let web = make_image(
        &env.auth_registry,
        &prefix,
        "web",
        Variant::Healthy,
        "private",
        login,
    );
    let state = tempfile::tempdir().unwrap();
    let credentials = state.path().join("tmp");
    let sh = "/bin/sh";
    let exec = ComposeExecutor::new(
        StickerStore::new(state.path().join("stickers")),
        credentials.clone(),
    )
    .with_allowed_hooks(vec![sh.into()]);
    let command = exec
        .compose_command()
        .await
        .expect("docker compose or docker-compose");
    let dir = state.path().join("deploy");
    cleanup.compose_project(&command, &prefix, &dir);
    let port = free_port();
    let content = lock(&[("web", &web, port)]);
    let auth =
        base64::engine::general_purpose::STANDARD.encode(format!("{}:{}", env.user, env.password));
    let secrets = [env.password.as_bytes(), auth.as_bytes()];

    // A wrong password fails the pull (first, while the image is not local yet): removed.
    let wrong = with_login(
        task(
            "compose.up",
            payload(&prefix, &dir, &content, &[("web", &web)]),
        ),
        &env.user,
        "not-the-password-41d2",
    );
    assert_failed(&exec.execute(&wrong).await, "REGISTRY_AUTH_FAILED");
    assert!(logins(&credentials).is_empty(), "removed after a failure");

    // The pre-deploy hook runs while the login exists: it signals, then waits for the test.
    let started = state.path().join("hook-started");
    let release = state.path().join("hook-release");
    let mut p = payload(&prefix, &dir, &content, &[("web", &web)]);
    p["hooks"] = json!({"preDeploy": {"command": [sh, "-c", format!(
        "touch {}; while [ ! -e {} ]; do sleep 0.1; done",
        started.display(), release.display()
    )], "timeout": 120}});
    let deploy = with_login(task("compose.up", p.clone()), &env.user, &env.password);
    let watch = async {
        wait_until(
            Duration::from_secs(60),
            "the pre-deploy hook to start",
            || {
                let started = started.clone();
                async move { started.exists() }
            },
        )
        .await;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&credentials), 0o700, "the credentials dir is private");
        let held = logins(&credentials);
        assert_eq!(
            held.len(),
            1,
            "one login, under the credentials dir: {held:?}"
        );
        assert_eq!(mode(&held[0]), 0o700);
        assert!(
            !files_containing(&held[0], auth.as_bytes()).is_empty(),
            "the login is the one compose uses"
        );
        std::fs::write(&release, b"").unwrap();
    };
    let (outcome, ()) = tokio::join!(exec.execute(&deploy), watch);
    assert_success(&outcome);
    assert_eq!(http_body(port).await.as_deref(), Some("private"));
    assert!(logins(&credentials).is_empty(), "removed after success");

    // Cancelled while the login exists: removed as well.
    std::fs::remove_file(&started).unwrap();
    std::fs::remove_file(&release).unwrap();
    let cancelled = with_login(task("compose.up", p), &env.user, &env.password);
    let cancel = cancelled.cancel.clone();
    let watch = async {
        wait_until(
            Duration::from_secs(60),
            "the pre-deploy hook to start",
            || {
                let started = started.clone();
                async move { started.exists() }
            },
        )
        .await;
        assert_eq!(logins(&credentials).len(), 1);
        cancel.cancel();
    };
    let (outcome, ()) = tokio::join!(exec.execute(&cancelled), watch);
    assert_failed(&outcome, "CANCELLED");
    assert!(
        logins(&credentials).is_empty(),
        "removed after cancellation"
    );

    for secret in secrets {
        let left = files_containing(state.path(), secret);
        assert!(left.is_empty(), "credentials left on disk: {left:?}");
    }
}

/// The agent's start-up sweep: a login left by a killed agent goes; nothing else is touched.
#[test]
fn the_sweep_removes_leftover_logins_only() {
    let state = tempfile::tempdir().unwrap();
    let credentials = state.path().join("tmp");
    assert_eq!(
        sweep_credentials(&credentials).unwrap(),
        0,
        "no dir: nothing to do"
    );
    let leftover = credentials.join(format!("{DOCKER_CONFIG_PREFIX}0b5e"));
    std::fs::create_dir_all(&leftover).unwrap();
    std::fs::write(
        leftover.join("config.json"),
        r#"{"auths":{"r":{"auth":"c2VjcmV0"}}}"#,
    )
    .unwrap();
    std::fs::write(credentials.join("unrelated"), "keep").unwrap();
    assert_eq!(sweep_credentials(&credentials).unwrap(), 1);
    assert!(!leftover.exists());
    assert!(credentials.join("unrelated").exists());
}

/// Issue 9 item 5 for compose: a hook off the allow-list fails before the lock file is written.
#[tokio::test]
async fn a_compose_hook_not_on_the_allow_list_fails_before_anything_is_written() {
    let state = tempfile::tempdir().unwrap();
    let dir = state.path().join("deploy");
    let digest = format!("sha256:{}", "4".repeat(64));
    let web = Image {
        repository: "127.0.0.1:9/berth-test-never/web".into(),
        digest: digest.clone(),
    };
    let content = lock(&[("web", &web, 9)]);
    let marker = state.path().join("hook-ran");
    let exec = ComposeExecutor::new(
        StickerStore::new(state.path().join("stickers")),
        state.path().join("tmp"),
    )
    .with_allowed_hooks(vec!["/bin/true".into()])
    .with_compose_command(vec!["/bin/false".into()]);
    for hook in ["preDeploy", "postDeploy"] {
        let mut p = payload("berth-test-never", &dir, &content, &[("web", &web)]);
        p["hooks"] =
            json!({hook: {"command": ["/bin/sh", "-c", format!("touch {}", marker.display())]}});
        let outcome = exec.execute(&task("compose.up", p)).await;
        assert_failed(&outcome, "HOOK_NOT_ALLOWED");
        assert!(!outcome.retriable);
        assert!(!marker.exists());
        assert!(!dir.exists(), "nothing was written");
    }
}
