//! Conformance cases of webhooks and notifications: the outbox row commits with its event (a
//! trigger, whichever operation wrote the event), only for subscribed kinds of the tenant's own
//! webhooks; a claim takes each due row once; outcomes move it by the attempt that was sent; a
//! row left `sending` becomes `unknown` and is never claimed again until resent.

use berth_proto::audit::actions;
use berth_proto::deploy::{DeploymentState, DEPLOYMENT_APPROVAL_EVENT, DEPLOYMENT_STATE_EVENT};
use berth_proto::notify::{NotificationState, WebhookFormat};

use super::deployments::{
    audit_actions, create_environment, deploy, new_deployment, release, token,
};
use super::support::*;
use crate::{ApproveOutcome, EventFilter, NewWebhook, Resend, SendOutcome, Webhook};

fn new_webhook(tenant: TenantId, name: &str, events: &[&str]) -> NewWebhook {
    NewWebhook {
        tenant_id: tenant,
        name: name.to_string(),
        url: "http://127.0.0.1:9/hook".to_string(),
        format: WebhookFormat::Generic,
        events: events.iter().map(|e| e.to_string()).collect(),
        secret_wrapped_key: vec![1, 2, 3],
        secret_ciphertext: vec![4, 5, 6],
        created_at: millis(now()),
    }
}

async fn webhook(store: &DynStore, tenant: TenantId, name: &str, events: &[&str]) -> Webhook {
    store
        .create_webhook(new_webhook(tenant, name, events), operator())
        .await
        .expect("create webhook")
}

pub async fn notifications_written_with_events(store: &DynStore) {
    let t = tenant(store).await;
    let other = tenant(store).await;
    let hook = webhook(
        store,
        t.id,
        "ops",
        &[DEPLOYMENT_STATE_EVENT, DEPLOYMENT_APPROVAL_EVENT],
    )
    .await;
    assert_eq!(hook.events.len(), 2);
    assert_eq!(hook.format, WebhookFormat::Generic);
    // Subscribed to another kind; and another tenant's webhook for the same kinds.
    webhook(store, t.id, "targets", &["deployment.target"]).await;
    webhook(store, other.id, "ops", &[DEPLOYMENT_STATE_EVENT]).await;
    assert_conflict(
        store
            .create_webhook(new_webhook(t.id, "ops", &["task.state"]), operator())
            .await,
        "webhook_name",
    );
    let names: Vec<String> = store
        .list_webhooks(t.id)
        .await
        .expect("list")
        .into_iter()
        .map(|w| w.name)
        .collect();
    assert_eq!(names, ["ops", "targets"]);

    let env = create_environment(store, t.id, "prod").await;
    let r1 = release(store, t.id, "r1").await;
    let d = deploy(
        store,
        new_deployment(&env, &r1, DeploymentState::AwaitingApproval),
    )
    .await;
    let ApproveOutcome::Approved(_) = store
        .approve_deployment(t.id, d.deployment.id, token("alice"), now())
        .await
        .expect("approve")
        .expect("exists")
    else {
        panic!("approved");
    };

    // Exactly one row per subscribed event, keyed `<webhook>:<event>`, with the event's data.
    let events = store
        .read_events(
            t.id,
            &EventFilter {
                deployment: Some(d.deployment.id),
                ..EventFilter::default()
            },
            0,
            100,
        )
        .await
        .expect("events");
    let wanted: Vec<_> = events
        .iter()
        .filter(|e| e.kind == DEPLOYMENT_STATE_EVENT || e.kind == DEPLOYMENT_APPROVAL_EVENT)
        .collect();
    assert_eq!(wanted.len(), 2, "created and approved: {events:?}");
    assert_eq!(wanted[1].kind, DEPLOYMENT_APPROVAL_EVENT);
    assert_eq!(wanted[1].data["approvedBy"]["name"], "alice");
    let mut rows = store
        .list_notifications(t.id, None, 100)
        .await
        .expect("list");
    rows.reverse();
    assert_eq!(rows.len(), 2, "{rows:?}");
    for (row, event) in rows.iter().zip(&wanted) {
        assert_eq!(row.webhook, "ops");
        assert_eq!(row.webhook_id, hook.id);
        assert_eq!(row.event_id, event.id);
        assert_eq!(row.event_kind, event.kind);
        assert_eq!(row.event_data, event.data);
        assert_eq!(row.idempotency_key, format!("{}:{}", hook.id, event.id));
        assert_eq!(row.state, NotificationState::Pending);
        assert_eq!(row.attempts, 0);
        assert_eq!(
            store.get_notification(t.id, row.id).await.expect("get"),
            Some(row.clone())
        );
        assert_eq!(
            store.get_notification(other.id, row.id).await.expect("get"),
            None
        );
    }
    let pending = store
        .list_notifications(t.id, Some(NotificationState::Pending), 100)
        .await
        .expect("by state");
    assert_eq!(pending.len(), 2);
    assert!(store
        .list_notifications(t.id, Some(NotificationState::Unknown), 100)
        .await
        .expect("by state")
        .is_empty());
    assert!(store
        .list_notifications(other.id, None, 100)
        .await
        .expect("other")
        .is_empty());

    // Deleting the webhook takes its notifications; both ends are audited, never a secret.
    assert!(store
        .delete_webhook(t.id, "ops", operator(), now())
        .await
        .expect("delete"));
    assert!(!store
        .delete_webhook(t.id, "ops", operator(), now())
        .await
        .expect("delete again"));
    assert!(store
        .list_notifications(t.id, None, 100)
        .await
        .expect("list")
        .is_empty());
    let audit = audit_actions(store, t.id).await;
    assert!(audit.contains(&(actions::WEBHOOK_CREATE.to_string(), "ops".to_string())));
    assert!(audit.contains(&(actions::WEBHOOK_DELETE.to_string(), "ops".to_string())));
    let entries = store.list_audit(t.id, 0, 1000).await.expect("audit");
    for entry in entries {
        assert!(entry.details.get("secret").is_none());
        assert!(!entry.details.to_string().contains("secret"));
    }
}

pub async fn notification_claims_and_outcomes(store: &DynStore) {
    let t = tenant(store).await;
    let hook = webhook(store, t.id, "ops", &[DEPLOYMENT_STATE_EVENT]).await;
    let env = create_environment(store, t.id, "prod").await;
    let r1 = release(store, t.id, "r1").await;
    deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;
    let start = now() + Duration::seconds(1);
    let lease = |at: OffsetDateTime| at + Duration::seconds(30);

    // Claimed once: `sending`, one attempt, with what the send needs.
    let claimed = store
        .claim_notifications(start, lease(start), 10)
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1, "{claimed:?}");
    let n = &claimed[0].notification;
    assert_eq!(n.state, NotificationState::Sending);
    assert_eq!(n.attempts, 1);
    assert_eq!(claimed[0].url, hook.url);
    assert_eq!(claimed[0].secret_ciphertext, vec![4, 5, 6]);
    assert!(store
        .claim_notifications(start, lease(start), 10)
        .await
        .expect("claim again")
        .is_empty());

    // A retry: pending again at its time, one retry further; not due before it.
    let retry_at = start + Duration::seconds(8);
    assert!(store
        .finish_notification(
            n.id,
            1,
            SendOutcome::Retry {
                at: retry_at,
                code: "HTTP_500".into(),
                message: "500 Internal Server Error".into(),
            },
            start,
        )
        .await
        .expect("finish"));
    let row = store
        .get_notification(t.id, n.id)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(row.state, NotificationState::Pending);
    assert_eq!(row.retries, 1);
    assert_eq!(row.next_attempt_at, millis(retry_at));
    assert_eq!(row.error_code.as_deref(), Some("HTTP_500"));
    assert!(store
        .claim_notifications(retry_at - Duration::seconds(1), lease(start), 10)
        .await
        .expect("claim early")
        .is_empty());
    let second = store
        .claim_notifications(retry_at, lease(retry_at), 10)
        .await
        .expect("claim due");
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].notification.attempts, 2);
    // The outcome of an earlier attempt changes nothing.
    assert!(!store
        .finish_notification(n.id, 1, SendOutcome::Succeeded, retry_at)
        .await
        .expect("stale finish"));

    // Unknown: never claimed again, however late.
    assert!(store
        .finish_notification(
            n.id,
            2,
            SendOutcome::Unknown {
                code: "TIMEOUT".into(),
                message: "no answer".into(),
            },
            retry_at,
        )
        .await
        .expect("finish unknown"));
    let far = retry_at + Duration::days(1);
    assert!(store
        .claim_notifications(far, lease(far), 10)
        .await
        .expect("claim late")
        .is_empty());

    // The operator's resend: pending now, the schedule from its start, the same key.
    let resent = match store
        .resend_notification(t.id, n.id, operator(), far)
        .await
        .expect("resend")
    {
        Resend::Queued(n) => n,
        other => panic!("resent, got {other:?}"),
    };
    assert_eq!(resent.state, NotificationState::Pending);
    assert_eq!(resent.retries, 0);
    assert_eq!(resent.idempotency_key, n.idempotency_key);
    assert!(audit_actions(store, t.id)
        .await
        .contains(&(actions::NOTIFICATION_RESEND.to_string(), n.id.to_string())));
    let third = store
        .claim_notifications(far, lease(far), 10)
        .await
        .expect("claim resent");
    assert_eq!(third.len(), 1);
    assert_eq!(third[0].notification.attempts, 3);
    assert!(store
        .finish_notification(n.id, 3, SendOutcome::Succeeded, far)
        .await
        .expect("succeed"));
    let done = store
        .get_notification(t.id, n.id)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(done.state, NotificationState::Succeeded);
    assert!(matches!(
        store
            .resend_notification(t.id, n.id, operator(), far)
            .await
            .expect("resend succeeded"),
        Resend::NotResendable(_)
    ));
    assert!(matches!(
        store
            .resend_notification(t.id, n.id + 1_000_000, operator(), far)
            .await
            .expect("resend missing"),
        Resend::NotFound
    ));

    // A send the server never finished: `unknown` once its lease passes, and stays so.
    deploy(
        store,
        new_deployment(
            &create_environment(store, t.id, "qa").await,
            &r1,
            DeploymentState::Pending,
        ),
    )
    .await;
    let at = now() + Duration::seconds(1);
    let claimed = store
        .claim_notifications(at, lease(at), 10)
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1);
    assert_eq!(store.expire_sending(at).await.expect("expire early"), 0);
    assert_eq!(
        store
            .expire_sending(lease(at))
            .await
            .expect("expire at lease end"),
        1
    );
    let lost = store
        .get_notification(t.id, claimed[0].notification.id)
        .await
        .expect("get")
        .expect("row");
    assert_eq!(lost.state, NotificationState::Unknown);
    assert_eq!(lost.error_code.as_deref(), Some(crate::INTERRUPTED));
    assert!(!store
        .finish_notification(lost.id, 1, SendOutcome::Succeeded, lease(at))
        .await
        .expect("late finish"));
    let later = lease(at) + Duration::days(1);
    assert!(store
        .claim_notifications(later, lease(later), 10)
        .await
        .expect("claim")
        .is_empty());
}
