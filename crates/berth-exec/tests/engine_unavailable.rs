//! An engine that cannot be reached fails retriably (`DOCKER_UNAVAILABLE`) and touches nothing.
//! Its own test binary: it points `DOCKER_HOST` at nowhere for the whole process.

use berth_exec::sticker::StickerStore;
use berth_exec::{ComposeExecutor, DockerExecutor, Executor};
use berth_test_utils::docker::*;
use serde_json::json;

#[tokio::test]
async fn an_unreachable_engine_is_a_retriable_failure() {
    let dir = tempfile::tempdir().unwrap();
    let payload = json!({
        "image": "127.0.0.1:55000/berth-test-never/web",
        "digest": format!("sha256:{}", "2".repeat(64)),
        "config": {"containerName": "berth-test-never"},
    });
    for host in [
        "unix:///nonexistent/berth-test.sock",
        "tcp://127.0.0.1:2375",
    ] {
        // Edition 2021: no other thread of this test binary reads the environment now.
        std::env::set_var("DOCKER_HOST", host);
        let exec = DockerExecutor::new(StickerStore::new(dir.path().join("stickers")));
        let outcome = exec.execute(&task("docker.run", payload.clone())).await;
        assert_failed(&outcome, "DOCKER_UNAVAILABLE");
        assert!(outcome.retriable, "{host}");
        assert!(exec.inspect_containers().await.is_err());
    }

    let digest = format!("sha256:{}", "3".repeat(64));
    let compose = json!({
        "artifacts": [{"type": "compose_lock", "name": "compose.yml",
                       "content": format!("services:\n  web:\n    image: 127.0.0.1:55000/web@{digest}\n")}],
        "config": {"projectName": "berth-test-never", "deploymentDirectory": dir.path().join("deploy").display().to_string(),
                   "expectedDigests": {"web": digest}},
    });
    let exec = ComposeExecutor::new(
        StickerStore::new(dir.path().join("stickers")),
        dir.path().join("tmp"),
    )
    .with_compose_command(vec!["true".into()]);
    let outcome = exec.execute(&task("compose.up", compose)).await;
    assert_failed(&outcome, "DOCKER_UNAVAILABLE");
    assert!(outcome.retriable);
    assert!(!dir.path().join("deploy").exists(), "nothing was written");
}
