//! Notifications through the outbox (issue 14 item 3) against an in-process server and a
//! webhook receiver the test runs on loopback. One event fans out to one webhook per outcome:
//! 200; 500 three times, then 200; accepted and never answered (`unknown`, sent exactly once,
//! however long the test waits, until an operator's resend, which carries the same key); 404
//! (`failed`); a refused connection (`dead` after the schedule); and a Slack-format body.

mod common;

use std::time::Duration;

use berth_proto::notify::{
    CreateWebhook, DeleteWebhook, ListNotifications, ListWebhooks, NotificationState,
    NotificationView, ResendNotification, WebhookFormat,
};
use berth_proto::task::{CreateTask, TaskView};
use berth_server::NotifySettings;
use berth_test_utils::wait_until;
use berth_test_utils::webhook::{Behaviour, Receiver};

const PATIENCE: Duration = Duration::from_secs(60);

fn webhook(name: &str, url: String, format: WebhookFormat, secret: &str) -> CreateWebhook {
    CreateWebhook {
        name: name.into(),
        url,
        format,
        events: vec!["task.state".into()],
        secret: secret.into(),
    }
}

async fn notifications(admin: &berth_client::Client) -> Vec<NotificationView> {
    admin
        .send(&ListNotifications::default())
        .await
        .expect("list notifications")
}

fn of<'a>(all: &'a [NotificationView], webhook: &str) -> &'a NotificationView {
    all.iter()
        .find(|n| n.webhook == webhook)
        .unwrap_or_else(|| panic!("no notification for {webhook}: {all:?}"))
}

#[tokio::test]
async fn each_outcome_is_sent_once_as_the_seed_says_on_sqlite() {
    outcomes(None).await;
}

/// The same on PostgreSQL, where the outbox row is written as the event is numbered at commit.
#[tokio::test]
async fn each_outcome_is_sent_once_as_the_seed_says_on_postgres() {
    let Some(admin_url) = berth_test_utils::postgres::admin_url("notify on postgres") else {
        return;
    };
    let db = berth_test_utils::postgres::TestDatabase::create(&admin_url);
    outcomes(Some(db.url.clone())).await;
}

async fn outcomes(database: Option<String>) {
    let server = common::start_with(|config| {
        config.database = database;
        config.notify = NotifySettings {
            retry_schedule: vec![Duration::from_millis(100); 4],
            timeout: Duration::from_secs(1),
            sweep_interval: Duration::from_millis(100),
        };
    })
    .await;
    let admin = server.admin();
    let receiver = Receiver::start(&[
        ("/ok", Behaviour::Ok, "s-ok"),
        ("/flaky", Behaviour::FailThenOk(3), "s-flaky"),
        ("/hang", Behaviour::HangOnce, "s-hang"),
        ("/gone", Behaviour::NotFound, "s-gone"),
        ("/slack", Behaviour::Ok, "s-slack"),
    ])
    .await;
    // A port nothing listens on: bound, then released.
    let refused = {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        l.local_addr().unwrap()
    };
    for (name, url, format, secret) in [
        ("ok", receiver.url("/ok"), WebhookFormat::Generic, "s-ok"),
        (
            "flaky",
            receiver.url("/flaky"),
            WebhookFormat::Generic,
            "s-flaky",
        ),
        (
            "hang",
            receiver.url("/hang"),
            WebhookFormat::Generic,
            "s-hang",
        ),
        (
            "gone",
            receiver.url("/gone"),
            WebhookFormat::Generic,
            "s-gone",
        ),
        (
            "slack",
            receiver.url("/slack"),
            WebhookFormat::Slack,
            "s-slack",
        ),
        (
            "refused",
            format!("http://{refused}/"),
            WebhookFormat::Generic,
            "s-x",
        ),
    ] {
        let created = admin
            .send(&webhook(name, url, format, secret))
            .await
            .expect("create webhook");
        assert_eq!(created.name, name);
    }
    // The secret is never answered.
    let listed = admin.send(&ListWebhooks::default()).await.expect("list");
    assert_eq!(listed.len(), 6);
    let raw = serde_json::to_string(&listed).unwrap();
    assert!(!raw.contains("s-ok") && !raw.contains("secret"), "{raw}");

    // One event: a task for an agent that never polls stays `pending`.
    let agent = server.agent("quiet").await;
    let task: TaskView = admin
        .send(&CreateTask {
            task_type: "health-check".into(),
            agent_id: Some(agent.id),
            payload: serde_json::json!({"type": "tcp", "host": "127.0.0.1", "port": 1}),
            ..Default::default()
        })
        .await
        .expect("create task");

    wait_until(PATIENCE, "every notification to settle", || {
        let admin = admin.clone();
        async move {
            let all = notifications(&admin).await;
            all.len() == 6
                && all.iter().all(|n| {
                    !matches!(
                        n.state,
                        NotificationState::Pending | NotificationState::Sending
                    )
                })
        }
    })
    .await;
    let all = notifications(&admin).await;
    let expect = [
        ("ok", NotificationState::Succeeded, 1),
        ("flaky", NotificationState::Succeeded, 4),
        ("hang", NotificationState::Unknown, 1),
        ("gone", NotificationState::Failed, 1),
        ("slack", NotificationState::Succeeded, 1),
        ("refused", NotificationState::Dead, 5),
    ];
    for (name, state, attempts) in expect {
        let n = of(&all, name);
        assert_eq!((n.state, n.attempts), (state, attempts), "{name}: {n:?}");
    }
    assert_eq!(
        of(&all, "hang").last_error.as_ref().unwrap().code,
        "TIMEOUT"
    );
    assert_eq!(
        of(&all, "gone").last_error.as_ref().unwrap().code,
        "HTTP_404"
    );
    assert_eq!(
        of(&all, "refused").last_error.as_ref().unwrap().code,
        "CONNECT_FAILED"
    );
    // A success clears the last error.
    assert_eq!(of(&all, "flaky").last_error, None);

    // Well past the whole schedule, the unknown one has still been sent exactly once.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let counts = |path: &str| receiver.counts(path);
    for (path, times) in [
        ("/ok", 1),
        ("/flaky", 4),
        ("/hang", 1),
        ("/gone", 1),
        ("/slack", 1),
    ] {
        let c = counts(path);
        assert_eq!(c.len(), 1, "{path}: one notification, one key: {c:?}");
        assert_eq!(c.values().copied().sum::<usize>(), times, "{path}: {c:?}");
    }
    assert_eq!(
        of(&notifications(&admin).await, "hang").state,
        NotificationState::Unknown
    );

    // Every delivery is signed with its webhook's secret and names its notification's key.
    let deliveries = receiver.deliveries();
    assert!(deliveries.iter().all(|d| d.signature_ok), "{deliveries:?}");
    let ok = deliveries.iter().find(|d| d.path == "/ok").unwrap();
    assert_eq!(ok.idempotency_key, of(&all, "ok").idempotency_key);
    assert_eq!(ok.body["id"], ok.idempotency_key.as_str());
    assert_eq!(ok.body["type"], "task.state");
    assert_eq!(ok.body["eventId"], of(&all, "ok").event_id);
    assert_eq!(ok.body["data"]["taskId"], task.id.to_string());
    assert_eq!(ok.body["data"]["state"], "pending");
    let slack = deliveries.iter().find(|d| d.path == "/slack").unwrap();
    assert_eq!(
        slack.body,
        serde_json::json!({"text": format!("berth: task.state taskId={} agentId={} state=pending", task.id, agent.id)})
    );

    // The operator resends the unknown one: the same key, delivered once more, now answered.
    let hang = of(&all, "hang").clone();
    let resent = admin
        .send(&ResendNotification { id: hang.id })
        .await
        .expect("resend");
    assert_eq!(resent.state, NotificationState::Pending);
    assert_eq!(resent.idempotency_key, hang.idempotency_key);
    wait_until(PATIENCE, "the resend to succeed", || {
        let admin = admin.clone();
        async move {
            of(&notifications(&admin).await, "hang").state == NotificationState::Succeeded
        }
    })
    .await;
    assert_eq!(
        counts("/hang").get(&hang.idempotency_key).copied(),
        Some(2),
        "the resend carries the same Idempotency-Key"
    );
    // A succeeded notification is not resent; an unknown id is not found.
    let err = admin
        .send(&ResendNotification { id: hang.id })
        .await
        .expect_err("succeeded");
    assert!(
        err.to_string().contains("NOTIFICATION_NOT_RESENDABLE"),
        "{err}"
    );
    let err = admin
        .send(&ResendNotification { id: hang.id + 1000 })
        .await
        .expect_err("missing");
    assert!(err.to_string().contains("NOTIFICATION_NOT_FOUND"), "{err}");
    // Filtered by state.
    let dead = admin
        .send(&ListNotifications {
            state: Some(NotificationState::Dead),
            limit: None,
        })
        .await
        .expect("by state");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].webhook, "refused");

    // Refusals: a duplicate name, a bad URL, an unknown event kind.
    let err = admin
        .send(&webhook(
            "ok",
            receiver.url("/ok"),
            WebhookFormat::Generic,
            "x",
        ))
        .await
        .expect_err("duplicate");
    assert!(err.to_string().contains("WEBHOOK_EXISTS"), "{err}");
    let err = admin
        .send(&webhook(
            "bad",
            "ftp://x/".into(),
            WebhookFormat::Generic,
            "x",
        ))
        .await
        .expect_err("bad url");
    assert!(err.to_string().contains("INVALID_REQUEST"), "{err}");
    let mut unknown_kind = webhook("kind", receiver.url("/ok"), WebhookFormat::Generic, "x");
    unknown_kind.events = vec!["agent.heartbeat".into()];
    let err = admin.send(&unknown_kind).await.expect_err("kind");
    assert!(err.to_string().contains("INVALID_REQUEST"), "{err}");

    // Deleting a webhook takes its notifications with it.
    admin
        .send(&DeleteWebhook {
            name: "gone".into(),
        })
        .await
        .expect("delete");
    assert_eq!(notifications(&admin).await.len(), 5);
    let err = admin
        .send(&DeleteWebhook {
            name: "gone".into(),
        })
        .await
        .expect_err("deleted");
    assert!(err.to_string().contains("WEBHOOK_NOT_FOUND"), "{err}");
    server.stop().await;
}
