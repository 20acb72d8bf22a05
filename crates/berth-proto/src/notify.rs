//! Notifications through an outbox (issue 14 item 3; seed 003's "Outbox" and "Gateway and
//! operation ledger"). A webhook subscribes to event kinds; every matching event writes one
//! notification row in the event's own transaction, and the server's sender delivers it:
//! `pending` → `sending` (committed before the request leaves) → `succeeded` (2xx), `failed`
//! (4xx, permanent), `pending` again (refused connection or 5xx, after the retry schedule's next
//! delay) or `dead` (the schedule used up), or `unknown` (the request may have arrived and no
//! answer came: never sent again automatically; `berth notify resend ID` is the operator's
//! choice). Every send of one notification carries the same `Idempotency-Key`.

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::agent::Deleted;
use crate::url::{encode_query_value, with_query};
use crate::{Method, Request};

/// The header signing a delivery: `sha256=<hex HMAC-SHA256(secret, timestamp + "." + body)>`.
pub const SIGNATURE_HEADER: &str = "x-berth-signature";
/// The Unix seconds the signature covers, so a receiver can refuse old replays.
pub const TIMESTAMP_HEADER: &str = "x-berth-timestamp";
/// The same on every send of one notification: `<webhookId>:<eventId>`.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// The event kinds a webhook may subscribe to: deployments, their targets, approvals, drift.
pub const WEBHOOK_EVENTS: &[&str] = &[
    crate::deploy::DEPLOYMENT_STATE_EVENT,
    crate::deploy::DEPLOYMENT_TARGET_EVENT,
    crate::deploy::DEPLOYMENT_APPROVAL_EVENT,
    crate::deploy::ENVIRONMENT_DRIFT_EVENT,
    crate::event::TASK_STATE,
];

/// At most this many bytes of secret.
pub const MAX_WEBHOOK_SECRET_BYTES: usize = 1024;

/// Webhook names follow the release name rules: one URL path segment as they are.
pub use crate::release::valid_release_name as valid_webhook_name;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum WebhookFormat {
    /// `{id, eventId, type, tenantId, occurredAt, data}`.
    Generic,
    /// A Slack incoming-webhook body: `{"text": "<one readable line>"}`.
    Slack,
}

impl WebhookFormat {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Generic => "generic",
            Self::Slack => "slack",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "generic" => Some(Self::Generic),
            "slack" => Some(Self::Slack),
            _ => None,
        }
    }
}

/// `POST /api/v1/webhooks` (admin). The secret is write-only: sealed at rest, never answered.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateWebhook {
    pub name: String,
    /// `http://` or `https://`.
    pub url: String,
    pub format: WebhookFormat,
    /// Event kinds, each one of [`WEBHOOK_EVENTS`]; at least one.
    pub events: Vec<String>,
    /// The HMAC-SHA256 key of `X-Berth-Signature`, 1-1024 bytes.
    pub secret: String,
}

impl Request for CreateWebhook {
    type Response = WebhookView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        "/api/v1/webhooks".into()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct WebhookView {
    pub id: i64,
    pub name: String,
    pub url: String,
    pub format: WebhookFormat,
    pub events: Vec<String>,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
}

/// `GET /api/v1/webhooks`: the tenant's webhooks, by name.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ListWebhooks {}

impl Request for ListWebhooks {
    type Response = Vec<WebhookView>;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        "/api/v1/webhooks".into()
    }
}

/// `DELETE /api/v1/webhooks/{name}` (admin): its notifications go with it.
#[derive(Debug, Clone, Serialize)]
pub struct DeleteWebhook {
    #[serde(skip)]
    pub name: String,
}

impl Request for DeleteWebhook {
    type Response = Deleted;
    const METHOD: Method = Method::Delete;
    fn path(&self) -> String {
        format!("/api/v1/webhooks/{}", encode_query_value(&self.name))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NotificationState {
    /// Waiting for its first send or its next retry (`nextAttemptAt`).
    Pending,
    /// A send is in flight (committed before the request left).
    Sending,
    /// The receiver answered 2xx.
    Succeeded,
    /// The receiver answered 4xx: permanent.
    Failed,
    /// Refused or 5xx on every send of the retry schedule.
    Dead,
    /// The request may have arrived and no answer came; never resent automatically.
    Unknown,
}

impl NotificationState {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Sending => "sending",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Dead => "dead",
            Self::Unknown => "unknown",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [
            Self::Pending,
            Self::Sending,
            Self::Succeeded,
            Self::Failed,
            Self::Dead,
            Self::Unknown,
        ]
        .into_iter()
        .find(|state| state.as_str() == s)
    }

    /// The states `resend` accepts: the sender will not send them again by itself.
    pub fn resendable(self) -> bool {
        matches!(self, Self::Failed | Self::Dead | Self::Unknown)
    }
}

/// Why the last send did not succeed: a code and a short message, never a secret or a body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct NotificationError {
    /// `HTTP_<status>`, `CONNECT_FAILED`, `TIMEOUT`, `SEND_FAILED` or `INTERRUPTED` (the server
    /// stopped mid-send).
    pub code: String,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "camelCase")]
pub struct NotificationView {
    pub id: i64,
    /// The webhook's name.
    pub webhook: String,
    pub event_id: i64,
    pub event_type: String,
    pub state: NotificationState,
    /// Sends so far (resends included).
    pub attempts: u32,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub next_attempt_at: OffsetDateTime,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<NotificationError>,
    pub idempotency_key: String,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub created_at: OffsetDateTime,
    #[serde(with = "crate::rfc3339")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = DateTime))]
    pub updated_at: OffsetDateTime,
}

/// `GET /api/v1/notifications?state=&limit=`: newest first.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::IntoParams), into_params(parameter_in = Query))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListNotifications {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<NotificationState>,
    /// 1-500, default 100.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

impl Request for ListNotifications {
    type Response = Vec<NotificationView>;
    const METHOD: Method = Method::Get;
    fn path(&self) -> String {
        let limit = self.limit.map(|l| l.to_string());
        with_query(
            "/api/v1/notifications",
            &[
                ("state", self.state.map(NotificationState::as_str)),
                ("limit", limit.as_deref()),
            ],
        )
    }
}

/// `POST /api/v1/notifications/{id}/resend` (admin): an `unknown`, `failed` or `dead`
/// notification is queued again, now, with the same idempotency key.
#[derive(Debug, Clone, Serialize)]
pub struct ResendNotification {
    #[serde(skip)]
    pub id: i64,
}

impl Request for ResendNotification {
    type Response = NotificationView;
    const METHOD: Method = Method::Post;
    fn path(&self) -> String {
        format!("/api/v1/notifications/{}/resend", self.id)
    }
}

/// The generic body: the notification's idempotency key as `id`, then the event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GenericBody {
    pub id: String,
    pub event_id: i64,
    #[serde(rename = "type")]
    pub kind: String,
    pub tenant_id: crate::TenantId,
    #[serde(with = "crate::rfc3339")]
    pub occurred_at: OffsetDateTime,
    pub data: serde_json::Value,
}

/// The Slack-compatible body.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlackBody {
    pub text: String,
}

/// One readable line for `kind`'s `data`: the fields people look for, by name.
pub fn slack_text(kind: &str, data: &serde_json::Value) -> String {
    let field = |name: &str| {
        data.get(name)
            .and_then(|v| match v {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Null => None,
                other => Some(other.to_string()),
            })
            .filter(|s| !s.is_empty())
    };
    let mut line = format!("berth: {kind}");
    for name in [
        "deploymentId",
        "taskId",
        "agentId",
        "state",
        "phase",
        "drift",
        "errorCode",
    ] {
        if let Some(value) = field(name) {
            line.push_str(&format!(" {name}={value}"));
        }
    }
    if let Some(by) = data
        .get("approvedBy")
        .and_then(|a| a.get("name"))
        .and_then(|n| n.as_str())
    {
        line.push_str(&format!(" approvedBy={by}"));
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slack_text_names_the_fields_people_look_for() {
        let data = serde_json::json!({"deploymentId": "d1", "state": "running",
            "errorCode": null, "approvedBy": {"name": "ops"}});
        assert_eq!(
            slack_text("deployment.state", &data),
            "berth: deployment.state deploymentId=d1 state=running approvedBy=ops"
        );
    }

    #[test]
    fn states_round_trip() {
        for s in [
            "pending",
            "sending",
            "succeeded",
            "failed",
            "dead",
            "unknown",
        ] {
            assert_eq!(NotificationState::parse(s).map(|s| s.as_str()), Some(s));
        }
        assert!(NotificationState::Unknown.resendable());
        assert!(!NotificationState::Pending.resendable());
    }
}
