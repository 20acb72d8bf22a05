//! `docker.run` and `rollback` on the real engine, with images pulled from the local registries
//! of `scripts/registry.sh`. Each test owns names with a unique `berth-test-…` prefix and
//! removes them at the end, even on failure.

use std::time::Duration;

use berth_exec::sticker::StickerStore;
use berth_exec::{DockerExecutor, Executor};
use berth_test_utils::deploy::{docker_check, http_check};
use berth_test_utils::docker::*;
use berth_test_utils::{free_port, wait_until};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An executor whose hooks may run the programs these tests' hooks name.
fn executor(dir: &tempfile::TempDir) -> DockerExecutor {
    DockerExecutor::new(StickerStore::new(dir.path().join("stickers"))).with_allowed_hooks(
        ["docker", "touch", "echo", "sh", "false"]
            .map(|p| program(p).into())
            .to_vec(),
    )
}

/// The absolute path of `name` in `PATH`: hooks name programs by absolute path.
fn program(name: &str) -> String {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} is not in PATH"))
        .display()
        .to_string()
}

/// A `docker.run` payload for `image` as container `name`, published on `port`, with an
/// environment and resource limits (checked by the first test).
fn deploy(image: &Image, name: &str, port: u16, health: serde_json::Value) -> serde_json::Value {
    let mut payload = image.deploy(name, port, health);
    let config = &mut payload["config"];
    config["environment"] = json!({"GREETING": "hello"});
    config["memoryLimit"] = json!(64 * 1024 * 1024);
    config["cpuLimit"] = json!(50000);
    payload
}

#[tokio::test]
async fn deploys_serves_labels_and_writes_the_sticker() {
    let Some(env) = env("deploys_serves_labels_and_writes_the_sticker") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(&dir);
    let name = format!("{prefix}-web");
    let port = free_port();

    let mut payload = deploy(&v1, &name, port, http_check(port, 30));
    payload["config"]["volumes"] = json!([format!("{prefix}-data:/data:ro")]);
    let outcome = exec.execute(&task("docker.run", payload)).await;
    assert_success(&outcome);
    assert_eq!(http_body(port).await.as_deref(), Some("v1"));

    let id = container_id(&name).unwrap();
    assert_eq!(outcome.outputs["containerId"], json!(id));
    assert_eq!(outcome.outputs["previousDigest"], json!(null));
    assert!(outcome.metrics.pull_duration_ms.is_some());
    assert!(outcome.metrics.deploy_duration_ms.is_some());
    assert!(outcome.metrics.health_check_duration_ms.is_some());
    assert!(outcome.logs.contains("digest verified"), "{}", outcome.logs);

    let (_, labels) = docker(&["inspect", "--format", "{{json .Config.Labels}}", &name]);
    let labels: serde_json::Value = serde_json::from_str(labels.trim()).unwrap();
    assert_eq!(labels["berth.digest"], json!(v1.digest));
    assert_eq!(labels["berth.release.id"], json!(format!("{name}-release")));
    assert_eq!(labels["berth.release.name"], json!(format!("{name}-1")));
    assert!(labels["berth.deployed.at"]
        .as_str()
        .is_some_and(|t| t.contains('T')));
    let (_, image) = docker(&["inspect", "--format", "{{.Config.Image}}", &name]);
    assert_eq!(
        image.trim(),
        v1.reference(),
        "containers run the digest, never a tag"
    );
    let (_, limits) = docker(&[
        "inspect",
        "--format",
        "{{.HostConfig.Memory}} {{.HostConfig.CpuQuota}} {{.HostConfig.RestartPolicy.Name}} {{json .Config.Env}}",
        &name,
    ]);
    assert!(limits.starts_with("67108864 50000 no "), "{limits}");
    assert!(limits.contains("GREETING=hello"), "{limits}");

    let sticker = StickerStore::new(dir.path().join("stickers"))
        .read(&name)
        .unwrap()
        .unwrap();
    assert_eq!(sticker.digest.as_deref(), Some(v1.digest.as_str()));
    assert_eq!(
        sticker.release_id.as_deref(),
        Some(format!("{name}-release").as_str())
    );

    let listed = exec.inspect_containers().await.unwrap();
    let mine = listed
        .iter()
        .find(|c| c.name == name)
        .expect("inspect lists the container");
    assert_eq!(mine.state, "running");
    assert_eq!(mine.digest.as_deref(), Some(v1.digest.as_str()));
    assert!(mine.labels.keys().all(|k| k.starts_with("berth.")));
}

#[tokio::test]
async fn upgrade_keeps_previous_until_healthy_then_rolls_back_on_request() {
    let Some(env) = env("upgrade_keeps_previous_until_healthy_then_rolls_back_on_request") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let v2 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v2", None);
    let v3 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v3", None);
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(&dir);
    let name = format!("{prefix}-web");
    let port = free_port();

    assert_success(
        &exec
            .execute(&task(
                "docker.run",
                deploy(&v1, &name, port, docker_check(30)),
            ))
            .await,
    );
    assert_eq!(http_body(port).await.as_deref(), Some("v1"));

    // The post-deploy hook runs after the health check and before the previous container is
    // removed: its output proves `<name>-previous-<ts>` existed while v2 was being checked.
    let mut payload = deploy(&v2, &name, port, docker_check(30));
    payload["hooks"] = json!({"postDeploy": {"command": [
        program("docker"), "ps", "-a", "--format", "seen {{.Names}}", "--filter", format!("name={name}-previous-")
    ], "timeout": 30}});
    let outcome = exec.execute(&task("docker.run", payload)).await;
    assert_success(&outcome);
    assert!(
        outcome.logs.contains(&format!("seen {name}-previous-")),
        "{}",
        outcome.logs
    );
    assert_eq!(outcome.outputs["previousDigest"], json!(v1.digest));
    assert_eq!(http_body(port).await.as_deref(), Some("v2"));
    assert!(
        container_names(&format!("{name}-previous-")).is_empty(),
        "the previous container is removed"
    );

    // v3 keeping its predecessor; then `rollback` brings v2 back under the name.
    let mut payload = deploy(&v3, &name, port, docker_check(30));
    payload["config"]["cleanupPrevious"] = json!(false);
    assert_success(&exec.execute(&task("docker.run", payload)).await);
    assert_eq!(http_body(port).await.as_deref(), Some("v3"));
    assert_eq!(container_names(&format!("{name}-previous-")).len(), 1);

    let outcome = exec
        .execute(&task(
            "rollback",
            json!({"containerName": name, "config": {"healthCheck": http_check(port, 30)}}),
        ))
        .await;
    assert_success(&outcome);
    assert_eq!(http_body(port).await.as_deref(), Some("v2"));
    assert_eq!(outcome.outputs["digest"], json!(v2.digest));
    assert_eq!(container_names(&format!("{name}-failed-")).len(), 1);
    let sticker = StickerStore::new(dir.path().join("stickers"))
        .read(&name)
        .unwrap()
        .unwrap();
    assert_eq!(sticker.digest.as_deref(), Some(v2.digest.as_str()));

    // With no `-previous-` left, a rollback has nowhere to go.
    let outcome = exec
        .execute(&task("rollback", json!({"containerName": name})))
        .await;
    assert_failed(&outcome, "NO_PREVIOUS_CONTAINER");

    // A rollback to a digest is a redeploy of it (the image comes from the berth.image label).
    let outcome = exec
        .execute(&task(
            "rollback",
            json!({"containerName": name, "targetDigest": v1.digest,
                   "config": {"ports": [format!("127.0.0.1:{port}:8080")], "healthCheck": docker_check(30)}}),
        ))
        .await;
    assert_success(&outcome);
    assert_eq!(http_body(port).await.as_deref(), Some("v1"));
}

#[tokio::test]
async fn unhealthy_or_crashing_upgrade_rolls_back_to_the_serving_version() {
    let Some(env) = env("unhealthy_or_crashing_upgrade_rolls_back_to_the_serving_version") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let sick = make_image(
        &env.registry,
        &prefix,
        "web",
        Variant::Unhealthy,
        "sick",
        None,
    );
    let crash = make_image(&env.registry, &prefix, "web", Variant::Crash, "crash", None);
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(&dir);
    let name = format!("{prefix}-web");
    let port = free_port();

    assert_success(
        &exec
            .execute(&task(
                "docker.run",
                deploy(&v1, &name, port, docker_check(30)),
            ))
            .await,
    );
    let v1_id = container_id(&name).unwrap();

    let outcome = exec
        .execute(&task(
            "docker.run",
            deploy(&sick, &name, port, docker_check(30)),
        ))
        .await;
    assert_failed(&outcome, "HEALTH_CHECK_FAILED");
    assert!(!outcome.retriable);
    assert_eq!(
        outcome.outputs["rolledBack"],
        json!(true),
        "{}",
        outcome.logs
    );
    assert!(outcome.message.contains("unhealthy"), "{}", outcome.message);
    assert_eq!(
        container_id(&name),
        Some(v1_id.clone()),
        "v1 is back under its name"
    );
    wait_until(Duration::from_secs(10), "v1 to serve again", || async {
        http_body(port).await.as_deref() == Some("v1")
    })
    .await;
    assert_eq!(
        container_names(&name),
        vec![name.clone()],
        "no new or previous container is left"
    );

    // A container that exits at once fails fast, even with an http probe and a long timeout.
    let started = std::time::Instant::now();
    let mut payload = deploy(&crash, &name, port, http_check(port, 60));
    payload["config"]["restartPolicy"] = json!("unless-stopped");
    let outcome = exec.execute(&task("docker.run", payload)).await;
    assert_failed(&outcome, "HEALTH_CHECK_FAILED");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "a crash is noticed before the timeout"
    );
    assert_eq!(
        outcome.outputs["rolledBack"],
        json!(true),
        "{}",
        outcome.logs
    );
    assert_eq!(container_id(&name), Some(v1_id));
    wait_until(Duration::from_secs(10), "v1 to serve again", || async {
        http_body(port).await.as_deref() == Some("v1")
    })
    .await;
}

/// A registry that answers every manifest request with a manifest that does not hash to the
/// digest asked for: what a tampered or man-in-the-middled registry looks like to the engine.
async fn tampering_registry() -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "size": 2,
                       "digest": format!("sha256:{}", "0".repeat(64))},
            "layers": []
        })
        .to_string();
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let manifest = manifest.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let request = String::from_utf8_lossy(&buf[..n]).into_owned();
                let head = request.starts_with("HEAD ");
                let (ct, body) = if request.contains("/manifests/") {
                    (
                        "application/vnd.docker.distribution.manifest.v2+json",
                        manifest,
                    )
                } else {
                    ("application/json", "{}".to_string())
                };
                let response = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nDocker-Distribution-API-Version: registry/2.0\r\nConnection: close\r\n\r\n{}",
                    body.len(),
                    if head { "" } else { body.as_str() }
                );
                let _ = s.write_all(response.as_bytes()).await;
            });
        }
    });
    port
}

#[tokio::test]
async fn digest_mismatch_leaves_the_running_container_untouched() {
    let Some(env) = env("digest_mismatch_leaves_the_running_container_untouched") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(&dir);
    let name = format!("{prefix}-web");
    let port = free_port();
    assert_success(
        &exec
            .execute(&task(
                "docker.run",
                deploy(&v1, &name, port, docker_check(30)),
            ))
            .await,
    );
    let id = container_id(&name).unwrap();

    let fake = tampering_registry().await;
    let marker = dir.path().join("pre-deploy-ran");
    let forged = Image {
        repository: format!("127.0.0.1:{fake}/{prefix}/web"),
        digest: format!(
            "sha256:{}",
            uuid::Uuid::new_v4().simple().to_string().repeat(2)
        ),
    };
    let mut payload = deploy(&forged, &name, port, docker_check(30));
    payload["hooks"] =
        json!({"preDeploy": {"command": [program("touch"), marker.display().to_string()]}});
    let outcome = exec.execute(&task("docker.run", payload)).await;
    assert_failed(&outcome, "DIGEST_MISMATCH");
    assert!(!outcome.retriable);
    assert!(
        outcome.message.contains("possible tampering"),
        "{}",
        outcome.message
    );
    assert!(
        !marker.exists(),
        "nothing runs after a digest mismatch, not even the pre-deploy hook"
    );
    assert_eq!(container_id(&name), Some(id), "same container");
    assert_eq!(
        http_body(port).await.as_deref(),
        Some("v1"),
        "still serving"
    );
    assert!(container_names(&format!("{name}-previous-")).is_empty());
}

#[tokio::test]
async fn a_tag_without_digest_is_refused_before_anything_happens() {
    // No engine needed: the payload is refused before the executor connects to one.
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(&dir);
    for (image, digest) in [
        ("127.0.0.1:55000/web:latest", None),
        ("127.0.0.1:55000/web", None),
        ("127.0.0.1:55000/web", Some("latest")),
    ] {
        let payload = json!({"image": image, "digest": digest, "config": {"containerName": "berth-test-never"}});
        let outcome = exec.execute(&task("docker.run", payload)).await;
        assert_failed(&outcome, "DIGEST_REQUIRED");
        assert!(!outcome.retriable);
    }
    let outcome = exec.execute(&task("docker.run", json!({"image": 5}))).await;
    assert_failed(&outcome, "INVALID_PAYLOAD");
    let outcome = exec.execute(&task("docker.exec", json!({}))).await;
    assert_failed(&outcome, "UNSUPPORTED_TASK_TYPE");
}

#[tokio::test]
async fn registry_down_is_retriable_and_unknown_images_are_not() {
    let Some(env) = env("registry_down_is_retriable_and_unknown_images_are_not") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(&dir);
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let digest = format!("sha256:{}", "1".repeat(64));
    let name = format!("{prefix}-web");
    let down = Image {
        repository: format!("127.0.0.1:{}/{prefix}/web", free_port()),
        digest: digest.clone(),
    };
    let outcome = exec
        .execute(&task(
            "docker.run",
            deploy(&down, &name, free_port(), docker_check(5)),
        ))
        .await;
    assert_failed(&outcome, "REGISTRY_UNAVAILABLE");
    assert!(outcome.retriable);

    let missing = Image {
        repository: format!("{}/{prefix}/nothing-here", env.registry),
        digest,
    };
    let outcome = exec
        .execute(&task(
            "docker.run",
            deploy(&missing, &name, free_port(), docker_check(5)),
        ))
        .await;
    assert_failed(&outcome, "IMAGE_NOT_FOUND");
    assert!(!outcome.retriable);
    assert!(container_id(&name).is_none());
}

#[tokio::test]
async fn registry_credentials_work_are_checked_and_never_logged() {
    let Some(env) = env("registry_credentials_work_are_checked_and_never_logged") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let v1 = make_image(
        &env.auth_registry,
        &prefix,
        "web",
        Variant::Healthy,
        "v1",
        Some((&env.user, &env.password)),
    );
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(&dir);
    let name = format!("{prefix}-web");
    let port = free_port();

    let wrong = "not-the-password-9f3a";
    let outcome = exec
        .execute(&with_login(
            task("docker.run", deploy(&v1, &name, port, docker_check(30))),
            &env.user,
            wrong,
        ))
        .await;
    assert_failed(&outcome, "REGISTRY_AUTH_FAILED");
    assert!(!outcome.retriable);
    assert!(
        outcome.message.contains("registryPassword"),
        "says what to fix: {}",
        outcome.message
    );
    assert!(!serde_json::to_string(&outcome).unwrap().contains(wrong));

    let outcome = exec
        .execute(&task(
            "docker.run",
            deploy(&v1, &name, port, docker_check(30)),
        ))
        .await;
    assert_failed(&outcome, "REGISTRY_AUTH_FAILED");

    // The right password, and a hook that prints it: the outcome carries it nowhere.
    let mut payload = deploy(&v1, &name, port, docker_check(30));
    payload["hooks"] =
        json!({"preDeploy": {"command": [program("echo"), "token is", env.password]}});
    let outcome = exec
        .execute(&with_login(
            task("docker.run", payload),
            &env.user,
            &env.password,
        ))
        .await;
    assert_success(&outcome);
    assert!(outcome.logs.contains("token is ***"), "{}", outcome.logs);
    assert!(!serde_json::to_string(&outcome)
        .unwrap()
        .contains(&env.password));
    assert_eq!(http_body(port).await.as_deref(), Some("v1"));
}

#[tokio::test]
async fn hook_timeout_and_cancellation_clean_up() {
    let Some(env) = env("hook_timeout_and_cancellation_clean_up") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(&dir);
    let name = format!("{prefix}-web");
    let port = free_port();

    // A pre-deploy hook that outlives its timeout is killed, with what it started.
    let started = std::time::Instant::now();
    let mut payload = deploy(&v1, &name, port, docker_check(30));
    payload["hooks"] = json!({"preDeploy": {"command": [program("sh"), "-c", "echo started; sleep 60 & sleep 60"], "timeout": 1}});
    let outcome = exec.execute(&task("docker.run", payload)).await;
    assert_failed(&outcome, "HOOK_TIMEOUT");
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "killed, not waited for"
    );
    assert!(outcome.logs.contains("started"), "{}", outcome.logs);
    assert!(container_id(&name).is_none(), "nothing was created");

    // A post-deploy hook that fails undoes the deployment.
    let mut payload = deploy(&v1, &name, port, docker_check(30));
    payload["hooks"] = json!({"postDeploy": {"command": [program("false")]}});
    let outcome = exec.execute(&task("docker.run", payload)).await;
    assert_failed(&outcome, "HOOK_FAILED");
    assert!(
        container_id(&name).is_none(),
        "the new container is removed"
    );

    // Cancelled while waiting for health: cleaned up like a failure.
    let never = free_port();
    let task = task(
        "docker.run",
        deploy(&v1, &name, port, http_check(never, 60)),
    );
    let cancel = task.cancel.clone();
    let watched = name.clone();
    tokio::spawn(async move {
        wait_until(Duration::from_secs(60), "the container to exist", || {
            let n = watched.clone();
            async move { container_id(&n).is_some() }
        })
        .await;
        cancel.cancel();
    });
    let outcome = exec.execute(&task).await;
    assert_failed(&outcome, "CANCELLED");
    assert_eq!(
        outcome.outputs["rolledBack"],
        json!(false),
        "there was nothing to go back to"
    );
    assert!(
        container_id(&name).is_none(),
        "the new container is removed: {}",
        outcome.logs
    );
}

/// Issue 9 item 5: a hook is a program on the agent's host, so it runs only when the agent
/// allows that program; anything else fails closed before the host changes at all.
#[tokio::test]
async fn a_hook_not_on_the_allow_list_fails_closed_before_anything_changes() {
    let Some(env) = env("a_hook_not_on_the_allow_list_fails_closed_before_anything_changes") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let v2 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v2", None);
    let dir = tempfile::tempdir().unwrap();
    // The agent's default: no --allow-hook, so no hook may run.
    let exec = DockerExecutor::new(StickerStore::new(dir.path().join("stickers")));
    let name = format!("{prefix}-web");
    let port = free_port();
    assert_success(
        &exec
            .execute(&task(
                "docker.run",
                deploy(&v1, &name, port, docker_check(30)),
            ))
            .await,
    );
    let id = container_id(&name).unwrap();

    // A shell as the pre-deploy hook: refused, nothing pulled, renamed or started.
    let marker = dir.path().join("pre-deploy-ran");
    let touch = format!("touch {}", marker.display());
    for hooks in [
        json!({"preDeploy": {"command": ["/bin/sh", "-c", touch]}}),
        json!({"postDeploy": {"command": ["/bin/sh", "-c", touch]}}),
        // A bare name or a relative path is never looked up.
        json!({"preDeploy": {"command": ["touch", marker.display().to_string()]}}),
        json!({"preDeploy": {"command": ["../../bin/touch", marker.display().to_string()]}}),
    ] {
        let mut payload = deploy(&v2, &name, port, docker_check(30));
        payload["hooks"] = hooks.clone();
        let outcome = exec.execute(&task("docker.run", payload)).await;
        assert_failed(&outcome, "HOOK_NOT_ALLOWED");
        assert!(!outcome.retriable, "{hooks}");
        assert!(!marker.exists(), "the hook did not run: {hooks}");
        assert_eq!(container_id(&name), Some(id.clone()), "same container");
        assert!(container_names(&format!("{name}-previous-")).is_empty());
        assert_eq!(
            http_body(port).await.as_deref(),
            Some("v1"),
            "still serving"
        );
        assert!(
            !outcome.logs.contains("pulling"),
            "refused before the pull: {}",
            outcome.logs
        );

        // The same hook in a rollback to v2 is refused just as early.
        let outcome = exec
            .execute(&task(
                "rollback",
                json!({"containerName": name, "targetDigest": v2.digest, "hooks": hooks}),
            ))
            .await;
        assert_failed(&outcome, "HOOK_NOT_ALLOWED");
        assert!(!marker.exists());
        assert_eq!(container_id(&name), Some(id.clone()));
    }

    // A program on the list runs.
    let allowed = DockerExecutor::new(StickerStore::new(dir.path().join("stickers")))
        .with_allowed_hooks(vec![program("touch").into()]);
    let mut payload = deploy(&v2, &name, port, docker_check(30));
    payload["hooks"] =
        json!({"preDeploy": {"command": [program("touch"), marker.display().to_string()]}});
    assert_success(&allowed.execute(&task("docker.run", payload)).await);
    assert!(marker.exists(), "the allowed hook ran");
    assert_eq!(http_body(port).await.as_deref(), Some("v2"));
}

/// A lease that no longer holds: what the agent's start handshake answers once the server has
/// fenced the delivery.
struct Fenced;

#[async_trait::async_trait]
impl berth_exec::LeaseCheck for Fenced {
    async fn confirm(
        &self,
        _phase: Option<berth_proto::transport::ProgressPhase>,
    ) -> Result<(), String> {
        Err("FENCED by the server".into())
    }
}

/// Issue 9 item 1: an executor asks for its lease right before the irreversible step, and
/// without it leaves the running container alone: no swap on `docker.run` or `rollback`, and no
/// pre-deploy hook. The failure is retriable (a later delivery runs the task for real).
#[tokio::test]
async fn without_its_lease_a_deploy_swaps_nothing() {
    let Some(env) = env("without_its_lease_a_deploy_swaps_nothing") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let v1 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let v2 = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v2", None);
    let dir = tempfile::tempdir().unwrap();
    let exec = executor(&dir);
    let name = format!("{prefix}-web");
    let port = free_port();
    assert_success(
        &exec
            .execute(&task(
                "docker.run",
                deploy(&v1, &name, port, docker_check(30)),
            ))
            .await,
    );
    let id = container_id(&name).unwrap();
    let fenced = |mut task: berth_exec::Task| {
        task.lease = berth_exec::Lease::new(std::sync::Arc::new(Fenced));
        task
    };

    let marker = dir.path().join("pre-deploy-ran");
    let mut payload = deploy(&v2, &name, port, docker_check(30));
    payload["hooks"] =
        json!({"preDeploy": {"command": [program("touch"), marker.display().to_string()]}});
    let outcome = exec.execute(&fenced(task("docker.run", payload))).await;
    assert_failed(&outcome, "LEASE_LOST");
    assert!(outcome.retriable, "{outcome:?}");
    assert!(
        !marker.exists(),
        "the pre-deploy hook ran without the lease"
    );
    assert_eq!(container_id(&name), Some(id.clone()), "same container");
    assert!(container_names(&format!("{name}-previous-")).is_empty());
    assert_eq!(http_body(port).await.as_deref(), Some("v1"));

    // A rollback (to the kept predecessor) is refused at its swap just the same.
    let mut payload = deploy(&v2, &name, port, docker_check(30));
    payload["config"]["cleanupPrevious"] = json!(false);
    assert_success(&exec.execute(&task("docker.run", payload)).await);
    assert_eq!(container_names(&format!("{name}-previous-")).len(), 1);
    let current = container_id(&name).unwrap();
    let outcome = exec
        .execute(&fenced(task("rollback", json!({"containerName": name}))))
        .await;
    assert_failed(&outcome, "LEASE_LOST");
    assert_eq!(container_id(&name), Some(current), "no rollback swap");
    assert_eq!(container_names(&format!("{name}-previous-")).len(), 1);
    assert_eq!(http_body(port).await.as_deref(), Some("v2"));
}
