//! Webhooks and their notifications (issue 14 item 3): the outbox and the operation ledger in
//! one table. A notification row is written by a trigger on `events` (migration 0019) for every
//! webhook of the tenant subscribed to the event's kind, so it commits with the event, whichever
//! operation made it. The server's sender claims due rows (`sending`, committed before the
//! request leaves) and records each outcome; a row left `sending` past its lease becomes
//! `unknown` and is never claimed again without an operator's resend.

use berth_proto::audit::{actions, AuditActor};
use berth_proto::notify::{NotificationState, WebhookFormat};
use berth_proto::TenantId;
use time::OffsetDateTime;

use crate::Result;

#[derive(Debug, Clone, PartialEq)]
pub struct Webhook {
    pub id: i64,
    pub tenant_id: TenantId,
    pub name: String,
    pub url: String,
    pub format: WebhookFormat,
    pub events: Vec<String>,
    pub created_at: OffsetDateTime,
}

/// A webhook to create, its secret already sealed by the server.
#[derive(Debug, Clone)]
pub struct NewWebhook {
    pub tenant_id: TenantId,
    pub name: String,
    pub url: String,
    pub format: WebhookFormat,
    pub events: Vec<String>,
    pub secret_wrapped_key: Vec<u8>,
    pub secret_ciphertext: Vec<u8>,
    pub created_at: OffsetDateTime,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Notification {
    pub id: i64,
    pub tenant_id: TenantId,
    pub webhook_id: i64,
    /// The webhook's name.
    pub webhook: String,
    pub event_id: i64,
    pub event_kind: String,
    pub event_data: serde_json::Value,
    pub event_at: OffsetDateTime,
    pub idempotency_key: String,
    pub state: NotificationState,
    /// Sends so far, resends included.
    pub attempts: u32,
    /// Retryable failures since it was last queued: the place in the retry schedule.
    pub retries: u32,
    pub next_attempt_at: OffsetDateTime,
    pub error_code: Option<String>,
    pub error_message: Option<String>,
    pub created_at: OffsetDateTime,
    pub updated_at: OffsetDateTime,
}

/// A claimed notification with what sending it needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Delivery {
    pub notification: Notification,
    pub url: String,
    pub format: WebhookFormat,
    pub secret_wrapped_key: Vec<u8>,
    pub secret_ciphertext: Vec<u8>,
}

/// How one send ended; the sender decides (berth-server `notify.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SendOutcome {
    Succeeded,
    /// Permanent (a 4xx).
    Failed {
        code: String,
        message: String,
    },
    /// Retryable (refused, 5xx): pending again at `at`, one retry further in the schedule.
    Retry {
        at: OffsetDateTime,
        code: String,
        message: String,
    },
    /// Retryable, but the schedule is used up.
    Dead {
        code: String,
        message: String,
    },
    /// The request may have arrived: never sent again automatically.
    Unknown {
        code: String,
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub enum Resend {
    Queued(Notification),
    NotResendable(Notification),
    NotFound,
}

pub(crate) fn webhook_event(
    webhook: &Webhook,
    action: &'static str,
    actor: AuditActor,
    at: OffsetDateTime,
) -> crate::NewAuditEvent {
    crate::NewAuditEvent {
        tenant_id: webhook.tenant_id,
        actor,
        action,
        subject: webhook.name.clone(),
        // Never the secret.
        details: serde_json::json!({
            "id": webhook.id,
            "url": webhook.url,
            "format": webhook.format,
            "events": webhook.events,
        }),
        at,
    }
}

pub(crate) fn resend_event(
    n: &Notification,
    actor: AuditActor,
    at: OffsetDateTime,
) -> crate::NewAuditEvent {
    crate::NewAuditEvent {
        tenant_id: n.tenant_id,
        actor,
        action: actions::NOTIFICATION_RESEND,
        subject: n.id.to_string(),
        details: serde_json::json!({
            "webhook": n.webhook,
            "eventId": n.event_id,
            "idempotencyKey": n.idempotency_key,
            "state": n.state,
        }),
        at,
    }
}

/// The error columns an outcome writes.
pub(crate) fn outcome_columns(
    outcome: &SendOutcome,
) -> (NotificationState, Option<&str>, Option<&str>) {
    match outcome {
        SendOutcome::Succeeded => (NotificationState::Succeeded, None, None),
        SendOutcome::Failed { code, message } => {
            (NotificationState::Failed, Some(code), Some(message))
        }
        SendOutcome::Retry { code, message, .. } => {
            (NotificationState::Pending, Some(code), Some(message))
        }
        SendOutcome::Dead { code, message } => (NotificationState::Dead, Some(code), Some(message)),
        SendOutcome::Unknown { code, message } => {
            (NotificationState::Unknown, Some(code), Some(message))
        }
    }
}

/// The code and message of a send the server stopped in the middle of.
pub const INTERRUPTED: &str = "INTERRUPTED";

/// Part of [`crate::Store`].
#[async_trait::async_trait]
pub trait NotifyStore: Send + Sync {
    /// `Conflict { constraint: "webhook_name" }` when the tenant has one of that name. A
    /// `webhook.create` audit entry by `actor` in the same transaction.
    async fn create_webhook(&self, webhook: NewWebhook, actor: AuditActor) -> Result<Webhook>;
    /// The tenant's webhooks, by name.
    async fn list_webhooks(&self, tenant: TenantId) -> Result<Vec<Webhook>>;
    /// Whether it existed; its notifications go with it; a `webhook.delete` audit entry.
    async fn delete_webhook(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<bool>;
    /// The tenant's notifications, newest first, at most `limit`.
    async fn list_notifications(
        &self,
        tenant: TenantId,
        state: Option<NotificationState>,
        limit: u32,
    ) -> Result<Vec<Notification>>;
    async fn get_notification(&self, tenant: TenantId, id: i64) -> Result<Option<Notification>>;
    /// Up to `limit` `pending` rows due at `now` (every tenant's), oldest due first, each made
    /// `sending` with one more attempt and `next_attempt_at = lease_until`, committed before
    /// this returns. Two claimers never get the same row.
    async fn claim_notifications(
        &self,
        now: OffsetDateTime,
        lease_until: OffsetDateTime,
        limit: u32,
    ) -> Result<Vec<Delivery>>;
    /// Records how the send of attempt `attempt` ended; only while the row is still `sending`
    /// that attempt (false otherwise: its lease ran out and it is already `unknown`).
    async fn finish_notification(
        &self,
        id: i64,
        attempt: u32,
        outcome: SendOutcome,
        now: OffsetDateTime,
    ) -> Result<bool>;
    /// Rows still `sending` after their lease (the server stopped mid-send) become `unknown`
    /// with [`INTERRUPTED`]; how many.
    async fn expire_sending(&self, now: OffsetDateTime) -> Result<u64>;
    /// An `unknown`, `failed` or `dead` notification becomes `pending` now, at the start of the
    /// retry schedule, keeping its idempotency key; a `notification.resend` audit entry.
    async fn resend_notification(
        &self,
        tenant: TenantId,
        id: i64,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Resend>;
}
