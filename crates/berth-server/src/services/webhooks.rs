//! Webhooks (create, list, delete) and their notifications (list, resend). A webhook's secret
//! is sealed here, before the store sees it, and never answered; `notify.rs` sends.

use axum::http::StatusCode;
use berth_proto::agent::Deleted;
use berth_proto::error::codes;
use berth_proto::notify::{
    valid_webhook_name, CreateWebhook, ListNotifications, NotificationError, NotificationView,
    WebhookView, MAX_WEBHOOK_SECRET_BYTES, WEBHOOK_EVENTS,
};
use berth_store::{NewWebhook, Notification, Resend, StoreError, Webhook};

use crate::infra::envelope;
use crate::infra::error::{ApiError, ApiResult};
use crate::services::caller::actor;
use crate::services::caller::Caller;
use crate::services::notify::secret_key;
use crate::SharedState;

fn invalid(detail: impl Into<String>) -> ApiError {
    ApiError::unprocessable(codes::INVALID_REQUEST, detail)
}

fn webhook_view(w: Webhook) -> WebhookView {
    WebhookView {
        id: w.id,
        name: w.name,
        url: w.url,
        format: w.format,
        events: w.events,
        created_at: w.created_at,
    }
}

pub(crate) fn notification_view(n: Notification) -> NotificationView {
    NotificationView {
        id: n.id,
        webhook: n.webhook,
        event_id: n.event_id,
        event_type: n.event_kind,
        state: n.state,
        attempts: n.attempts,
        next_attempt_at: n.next_attempt_at,
        last_error: n.error_code.map(|code| NotificationError {
            code,
            message: n.error_message.unwrap_or_default(),
        }),
        idempotency_key: n.idempotency_key,
        created_at: n.created_at,
        updated_at: n.updated_at,
    }
}

/// `http://` or `https://` with a host, nothing else.
fn check_url(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("url: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err("url must be http:// or https://".into());
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err("url has no host".into());
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err("url must not carry credentials; use the secret".into());
    }
    Ok(())
}

/// Register a webhook: every event of the listed kinds is delivered to `url`, signed with
/// `secret` (HMAC-SHA256), through the outbox. The secret is sealed at rest and never shown.
pub async fn create_webhook(
    state: &SharedState,
    caller: &Caller,
    req: CreateWebhook,
) -> ApiResult<(StatusCode, WebhookView)> {
    caller.require_admin()?;
    if !valid_webhook_name(&req.name) {
        return Err(invalid(
            "name must be 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit",
        ));
    }
    check_url(&req.url).map_err(invalid)?;
    if req.events.is_empty() {
        return Err(invalid("events: name at least one event kind"));
    }
    let mut events = req.events;
    events.sort();
    events.dedup();
    if let Some(bad) = events
        .iter()
        .find(|e| !WEBHOOK_EVENTS.contains(&e.as_str()))
    {
        return Err(invalid(format!(
            "events: {bad:?} is not one of {}",
            WEBHOOK_EVENTS.join(", ")
        )));
    }
    if req.secret.is_empty() || req.secret.len() > MAX_WEBHOOK_SECRET_BYTES {
        return Err(invalid(format!(
            "secret must be 1-{MAX_WEBHOOK_SECRET_BYTES} bytes"
        )));
    }
    let sealed = envelope::seal(
        &state.master_key,
        caller.tenant(),
        &secret_key(&req.name),
        1,
        req.secret.as_bytes(),
    )
    .map_err(|e| ApiError::internal(&e))?;
    let new = NewWebhook {
        tenant_id: caller.tenant(),
        name: req.name,
        url: req.url,
        format: req.format,
        events,
        secret_wrapped_key: sealed.wrapped_key,
        secret_ciphertext: sealed.ciphertext,
        created_at: state.config.clock.now(),
    };
    match state.store.create_webhook(new, actor(caller)).await {
        Ok(w) => Ok((StatusCode::CREATED, webhook_view(w))),
        Err(StoreError::Conflict {
            constraint: "webhook_name",
        }) => Err(ApiError::conflict(
            codes::WEBHOOK_EXISTS,
            "the tenant has a webhook of that name",
        )),
        Err(e) => Err(e.into()),
    }
}

/// The tenant's webhooks, by name (admin: a URL may itself be a credential, as Slack's are).
pub async fn list_webhooks(state: &SharedState, caller: &Caller) -> ApiResult<Vec<WebhookView>> {
    caller.require_admin()?;
    let hooks = state.store.list_webhooks(caller.tenant()).await?;
    Ok(hooks.into_iter().map(webhook_view).collect())
}

/// Delete a webhook and its notifications; a send in flight still ends.
pub async fn delete_webhook(
    state: &SharedState,
    caller: &Caller,
    name: String,
) -> ApiResult<Deleted> {
    caller.require_admin()?;
    let deleted = state
        .store
        .delete_webhook(
            caller.tenant(),
            &name,
            actor(caller),
            state.config.clock.now(),
        )
        .await?;
    if !deleted {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            codes::WEBHOOK_NOT_FOUND,
            format!("no webhook named {name:?}"),
        ));
    }
    Ok(Deleted { deleted })
}

/// The tenant's notifications, newest first: the outbox and what each send did.
pub async fn list_notifications(
    state: &SharedState,
    caller: &Caller,
    query: ListNotifications,
) -> ApiResult<Vec<NotificationView>> {
    caller.can_read()?;
    let limit = query.limit.unwrap_or(100);
    if !(1..=500).contains(&limit) {
        return Err(invalid("limit must be 1-500"));
    }
    let rows = state
        .store
        .list_notifications(caller.tenant(), query.state, limit)
        .await?;
    Ok(rows.into_iter().map(notification_view).collect())
}

/// Send an `unknown`, `failed` or `dead` notification again, now, with the same
/// `Idempotency-Key`: the operator's choice, never the sender's.
pub async fn resend(state: &SharedState, caller: &Caller, id: i64) -> ApiResult<NotificationView> {
    caller.require_admin()?;
    match state
        .store
        .resend_notification(caller.tenant(), id, actor(caller), state.config.clock.now())
        .await?
    {
        Resend::Queued(n) => {
            state.notify_wake.notify_one();
            Ok(notification_view(n))
        }
        Resend::NotResendable(n) => Err(ApiError::conflict(
            codes::NOTIFICATION_NOT_RESENDABLE,
            format!(
                "notification {id} is {}; only unknown, failed or dead ones are resent",
                n.state.as_str()
            ),
        )),
        Resend::NotFound => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            codes::NOTIFICATION_NOT_FOUND,
            format!("no notification {id}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::check_url;

    #[test]
    fn only_http_urls_with_a_host() {
        assert!(check_url("https://hooks.slack.com/services/T/B/x").is_ok());
        assert!(check_url("http://127.0.0.1:8080/hook").is_ok());
        assert!(check_url("ftp://example.com/").is_err());
        assert!(check_url("file:///etc/passwd").is_err());
        assert!(check_url("https://user:pw@example.com/").is_err());
        assert!(check_url("not a url").is_err());
    }
}
