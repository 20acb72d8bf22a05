//! `ssh.deploy` end to end: `berth server` (SQLite), a `berth-agent` that offers the `ssh`
//! capability, and the real sshd of `scripts/sshd.sh` as the agentless target. The private key
//! travels as the task's sealed credential (`--credential sshPrivateKey=…`) and must not be left
//! in plain text in the server's data dir, the agent's state dir or the task's view.
//!
//! Without the `BERTH_TEST_SSH_*` variables the test prints SKIP, except under `CI=true` or
//! `BERTH_REQUIRE_SERVICES=1`, where it fails.

#![cfg(unix)]

mod common;

use std::time::Duration;

use berth_test_utils::files_containing;
use berth_test_utils::ssh;
use common::*;
use serde_json::json;

#[test]
fn ssh_deploy_through_a_server_and_an_agent() {
    let Some(env) = ssh::env("ssh_deploy_through_a_server_and_an_agent") else {
        return;
    };
    let tmp = tempdir();
    let server = Server::start(&tmp.path().join("data"), &[]);
    let agent = Agent::register(&server, tmp.path(), "ssh-runner", &[]);
    server.wait_agent(&agent.id, "the ssh capability", |a| {
        a["capabilities"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["name"] == "ssh"))
    });

    let target = env.tempdir();
    let dir = target.path().join("site");
    let payload = json!({
        "target": env.target(),
        "deployDirectory": dir.display().to_string(),
        "artifacts": [
            {"name": "index.html", "content": "<h1>v1</h1>\n"},
            {"name": "deploy.sh", "content": "#!/bin/sh\nset -e\ncp index.html live.html\n", "executable": true}
        ],
        "script": {"command": ["./deploy.sh"], "timeout": 30},
        "healthCheck": {"type": "command", "command": ["test", "-s", "live.html"], "timeout": 10},
        "sticker": {"name": "site", "releaseId": "site-r1", "releaseName": "site-1"}
    });
    let key = env.private_key.trim().to_string();
    let credential = format!("sshPrivateKey={key}");
    let payload_text = payload.to_string();
    let created = server.cli(&[
        "task",
        "create",
        "--type",
        "ssh.deploy",
        "--agent",
        &agent.id,
        "--payload",
        &payload_text,
        "--timeout-secs",
        "120",
        "--credential",
        &credential,
    ]);
    let id = id_of(&created);
    let task = server.wait_task(&id, Duration::from_secs(120), "a decided state", |t| {
        !matches!(t["state"].as_str(), Some("pending" | "leased"))
    });
    assert_eq!(task["state"], "succeeded", "{task:#}");
    assert_eq!(task["sideEffects"], true, "{task:#}");
    let result = &task["result"];
    for metric in [
        "uploadDurationMs",
        "deployDurationMs",
        "healthCheckDurationMs",
    ] {
        assert!(result["metrics"][metric].is_u64(), "{metric}: {task:#}");
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("live.html")).unwrap(),
        "<h1>v1</h1>\n"
    );
    let sticker: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(".berth-sticker.json")).unwrap()).unwrap();
    assert_eq!(sticker["releaseId"], "site-r1");
    assert_eq!(sticker["taskId"], task["id"], "{sticker:#}");
    assert!(!dir.join(".berth-backup").exists());

    // The key: sealed at rest, redacted everywhere, never in a view.
    let body = key
        .lines()
        .nth(1)
        .expect("a multi-line OpenSSH key")
        .to_string();
    assert!(!task.to_string().contains(&body), "{task:#}");
    for root in [tmp.path().join("data"), agent.state_dir.clone()] {
        let found = files_containing(&root, body.as_bytes());
        assert!(found.is_empty(), "the private key in plain text: {found:?}");
    }
}
