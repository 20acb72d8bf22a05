//! Webhooks (create, list, delete) and their notifications (list, resend). A webhook's secret
//! is sealed here, before the store sees it, and never answered; `notify.rs` sends.

use crate::http::auth::Caller;
use crate::http::extract::{ApiJson, ApiPath, ApiQuery};
use crate::infra::error::ApiResult;
use crate::services::webhooks;
use crate::SharedState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use berth_proto::agent::Deleted;
use berth_proto::notify::{CreateWebhook, ListNotifications, NotificationView, WebhookView};
use berth_proto::ErrorBody;

/// Register a webhook: every event of the listed kinds is delivered to `url`, signed with
/// `secret` (HMAC-SHA256), through the outbox. The secret is sealed at rest and never shown.
#[utoipa::path(post, path = "/api/v1/webhooks", tag = "notifications", request_body = CreateWebhook,
    security(("bearer" = [])),
    responses((status = 201, body = WebhookView, description = "created"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 409, body = ErrorBody, description = "WEBHOOK_EXISTS"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST (names the field)")))]
pub async fn create_webhook(
    State(state): State<SharedState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateWebhook>,
) -> ApiResult<(StatusCode, Json<WebhookView>)> {
    webhooks::create_webhook(&state, &caller, req)
        .await
        .map(|(status, body)| (status, Json(body)))
}

/// The tenant's webhooks, by name (admin: a URL may itself be a credential, as Slack's are).
#[utoipa::path(get, path = "/api/v1/webhooks", tag = "notifications", security(("bearer" = [])),
    responses((status = 200, body = [WebhookView]),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin")))]
pub async fn list_webhooks(
    State(state): State<SharedState>,
    caller: Caller,
) -> ApiResult<Json<Vec<WebhookView>>> {
    webhooks::list_webhooks(&state, &caller).await.map(Json)
}

/// Delete a webhook and its notifications; a send in flight still ends.
#[utoipa::path(delete, path = "/api/v1/webhooks/{name}", tag = "notifications", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = Deleted),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody, description = "WEBHOOK_NOT_FOUND")))]
pub async fn delete_webhook(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<Deleted>> {
    webhooks::delete_webhook(&state, &caller, name)
        .await
        .map(Json)
}

/// The tenant's notifications, newest first: the outbox and what each send did.
#[utoipa::path(get, path = "/api/v1/notifications", tag = "notifications", params(ListNotifications),
    security(("bearer" = [])),
    responses((status = 200, body = [NotificationView]),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: limit out of range")))]
pub async fn list_notifications(
    State(state): State<SharedState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<ListNotifications>,
) -> ApiResult<Json<Vec<NotificationView>>> {
    webhooks::list_notifications(&state, &caller, query)
        .await
        .map(Json)
}

/// Send an `unknown`, `failed` or `dead` notification again, now, with the same
/// `Idempotency-Key`: the operator's choice, never the sender's.
#[utoipa::path(post, path = "/api/v1/notifications/{id}/resend", tag = "notifications",
    security(("bearer" = [])), params(("id" = i64, Path)),
    responses((status = 200, body = NotificationView, description = "queued again"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody, description = "NOTIFICATION_NOT_FOUND"),
        (status = 409, body = ErrorBody, description = "NOTIFICATION_NOT_RESENDABLE: pending, sending or succeeded")))]
pub async fn resend(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<i64>,
) -> ApiResult<Json<NotificationView>> {
    webhooks::resend(&state, &caller, id).await.map(Json)
}
