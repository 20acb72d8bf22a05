//! Notifications end to end (issue 14 item 3), with a real `berth server` and the CLI: webhooks
//! added with a secret from a file, a receiver on loopback that accepts one request and never
//! answers it (the send becomes `unknown` and is sent exactly once, however long we wait), the
//! operator's `berth notify resend` (the same Idempotency-Key, delivered once more), and a
//! Slack-format webhook that answers 200. Every delivery's signature is checked.

#![cfg(unix)]

mod common;

use std::time::Duration;

use berth_test_utils::webhook::{Behaviour, Receiver};
use common::*;
use serde_json::{json, Value};

fn notifications(server: &Server, args: &[&str]) -> Vec<Value> {
    let mut all = vec!["notify", "ls"];
    all.extend_from_slice(args);
    server.cli(&all).as_array().expect("a list").clone()
}

fn of(rows: &[Value], webhook: &str) -> Value {
    rows.iter()
        .find(|n| n["webhook"] == webhook)
        .cloned()
        .unwrap_or_else(|| panic!("no notification for {webhook}: {rows:?}"))
}

// Multi-threaded: the receiver answers on the runtime while the test blocks on processes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_send_is_unknown_once_until_the_operator_resends_it() {
    let dir = tempdir();
    let server = Server::start(
        &dir.path().join("data"),
        &[
            "--notify-retry-schedule",
            "100ms,100ms,100ms,100ms",
            "--notify-timeout-secs",
            "1",
        ],
    );
    let receiver = Receiver::start(&[
        ("/hang", Behaviour::HangOnce, "hang-secret"),
        ("/chat", Behaviour::Ok, "chat-secret"),
    ])
    .await;
    for (name, secret) in [("hang", "hang-secret"), ("chat", "chat-secret")] {
        std::fs::write(dir.path().join(name), format!("{secret}\n")).unwrap();
    }
    let secret_file = |name: &str| dir.path().join(name).display().to_string();
    let hook = server.cli(&[
        "webhook",
        "add",
        "hang",
        "--url",
        &receiver.url("/hang"),
        "--events",
        "task.state,deployment.state",
        "--secret-file",
        &secret_file("hang"),
    ]);
    assert_eq!(hook["events"], json!(["deployment.state", "task.state"]));
    assert!(hook.get("secret").is_none(), "{hook}");
    server.cli(&[
        "webhook",
        "add",
        "chat",
        "--url",
        &receiver.url("/chat"),
        "--format",
        "slack",
        "--events",
        "task.state",
        "--secret-file",
        &secret_file("chat"),
    ]);
    let listed = server.cli(&["webhook", "ls"]);
    assert_eq!(listed.as_array().unwrap().len(), 2);
    assert!(!listed.to_string().contains("secret"), "{listed}");

    // One event: a task for an agent that is registered and then stopped stays `pending`.
    let mut agent = Agent::register(&server, dir.path(), "quiet", &[]);
    agent.proc.terminate();
    let task = server.create_task(
        &agent.id,
        "health-check",
        &json!({"type": "tcp", "host": "127.0.0.1", "port": 1}),
        None,
    );

    let rows = wait_for(
        Duration::from_secs(60),
        "both notifications to settle",
        || {
            let rows = notifications(&server, &[]);
            let settled = rows.len() == 2
                && rows
                    .iter()
                    .all(|n| n["state"] != "pending" && n["state"] != "sending");
            if settled {
                Ok(rows)
            } else {
                Err(format!("{rows:?}"))
            }
        },
    );
    let hang = of(&rows, "hang");
    assert_eq!(hang["state"], "unknown", "{hang}");
    assert_eq!(hang["attempts"], 1);
    assert_eq!(hang["lastError"]["code"], "TIMEOUT");
    assert_eq!(of(&rows, "chat")["state"], "succeeded");
    assert_eq!(
        notifications(&server, &["--state", "unknown"]),
        vec![hang.clone()]
    );

    // Past every retry the schedule could make: still sent exactly once.
    std::thread::sleep(Duration::from_secs(2));
    let key = hang["idempotencyKey"].as_str().unwrap().to_string();
    assert_eq!(receiver.counts("/hang").get(&key).copied(), Some(1));
    assert_eq!(of(&notifications(&server, &[]), "hang")["state"], "unknown");
    let chat = receiver.deliveries();
    let chat = chat
        .iter()
        .find(|d| d.path == "/chat")
        .expect("chat delivery");
    assert_eq!(
        chat.body["text"].as_str().unwrap(),
        format!(
            "berth: task.state taskId={} agentId={} state=pending",
            str_of(&task, "id"),
            agent.id
        )
    );

    // The operator's choice: the same key, once more, and this time answered.
    let id = hang["id"].as_i64().unwrap().to_string();
    let resent = server.cli(&["notify", "resend", &id]);
    assert_eq!(resent["idempotencyKey"], key.as_str());
    wait_for(Duration::from_secs(60), "the resend to succeed", || {
        let hang = of(&notifications(&server, &[]), "hang");
        if hang["state"] == "succeeded" {
            Ok(())
        } else {
            Err(hang.to_string())
        }
    });
    assert_eq!(receiver.counts("/hang").get(&key).copied(), Some(2));
    let err = server
        .try_cli(&["notify", "resend", &id])
        .expect_err("a succeeded notification is not resent");
    assert!(err.contains("NOTIFICATION_NOT_RESENDABLE"), "{err}");

    // Every delivery was signed with its webhook's secret (the file's trailing newline dropped).
    let deliveries = receiver.deliveries();
    assert_eq!(deliveries.len(), 3, "{deliveries:?}");
    assert!(deliveries.iter().all(|d| d.signature_ok), "{deliveries:?}");

    server.cli(&["webhook", "rm", "chat"]);
    assert_eq!(notifications(&server, &[]).len(), 1);
    let mut cmd = command(BERTH);
    cmd.args(["audit", "export"])
        .env("BERTH_SERVER", &server.url)
        .env("BERTH_TOKEN", &server.admin_token)
        .env("BERTH_CA_FILE", server.data_dir.join("ca.crt"));
    let out = Proc::spawn("berth audit export", cmd).finish(EXIT);
    assert!(out.status.success(), "export failed: {}", out.stderr);
    let text = out.stdout;
    for action in ["webhook.create", "webhook.delete", "notification.resend"] {
        assert!(text.contains(action), "{action} audited");
    }
    assert!(!text.contains("hang-secret") && !text.contains("chat-secret"));
}

/// The server is killed while a send is in flight: the row was committed `sending` before the
/// request left, so the restarted server finds it there, makes it `unknown` once its lease
/// ends (`INTERRUPTED`), and never sends it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_cut_by_a_crash_is_unknown_and_never_resent() {
    let dir = tempdir();
    let data = dir.path().join("data");
    let args = [
        "--notify-retry-schedule",
        "100ms",
        // Long enough that the send is surely still in flight when the test kills the server.
        "--notify-timeout-secs",
        "10",
    ];
    let mut server = Server::start(&data, &args);
    let receiver = Receiver::start(&[("/hang", Behaviour::HangOnce, "s")]).await;
    std::fs::write(dir.path().join("secret"), "s").unwrap();
    server.cli(&[
        "webhook",
        "add",
        "hang",
        "--url",
        &receiver.url("/hang"),
        "--events",
        "task.state",
        "--secret-file",
        &dir.path().join("secret").display().to_string(),
    ]);
    let mut agent = Agent::register(&server, dir.path(), "quiet", &[]);
    agent.proc.terminate();
    server.create_task(
        &agent.id,
        "health-check",
        &json!({"type": "tcp", "host": "127.0.0.1", "port": 1}),
        None,
    );
    wait_for(Duration::from_secs(60), "the request to arrive", || {
        if receiver.deliveries().is_empty() {
            Err("no delivery yet".to_string())
        } else {
            Ok(())
        }
    });
    // In flight: the receiver holds it, and the row says so.
    assert_eq!(notifications(&server, &[])[0]["state"], "sending");
    server.proc.kill9();

    let server = Server::start(&data, &args);
    let row = wait_for(
        Duration::from_secs(60),
        "the cut send to be unknown",
        || {
            let row = notifications(&server, &[])[0].clone();
            if row["state"] == "unknown" {
                Ok(row)
            } else {
                Err(row.to_string())
            }
        },
    );
    assert_eq!(row["lastError"]["code"], "INTERRUPTED");
    assert_eq!(row["attempts"], 1);
    // Past the schedule: still the one delivery.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(receiver.deliveries().len(), 1);
    assert_eq!(notifications(&server, &[])[0]["state"], "unknown");
}
