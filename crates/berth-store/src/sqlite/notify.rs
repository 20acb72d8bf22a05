//! Webhooks and notifications on SQLite. The outbox rows themselves are written by migration
//! 0019's trigger on `events`.

use berth_proto::audit::{actions, AuditActor};
use berth_proto::notify::NotificationState;
use berth_proto::TenantId;
use rusqlite::params;
use time::OffsetDateTime;

use super::{id_text, json_text, SqliteStore};
use crate::domain::notify::{outcome_columns, resend_event, webhook_event, INTERRUPTED};
use crate::rows::{self, delivery_columns, notification_columns, unix_millis, webhook_columns};
use crate::{
    Delivery, NewWebhook, Notification, NotifyStore, Resend, Result, SendOutcome, Webhook,
};

impl SqliteStore {
    /// Whether a notification in `state` has `next_attempt_at` at or before `at`.
    async fn any_notification(&self, state: &'static str, at: i64) -> Result<bool> {
        self.readers
            .read("notifications due", move |db| {
                db.one(
                    "SELECT EXISTS (SELECT 1 FROM notifications \
                     WHERE state = ?1 AND next_attempt_at <= ?2) AS due",
                    params![state, at],
                    |row| rows::ColumnReader::int(row, "due"),
                )
            })
            .await
            .map(|due| due == 1)
    }
}

#[async_trait::async_trait]
impl NotifyStore for SqliteStore {
    async fn create_webhook(&self, webhook: NewWebhook, actor: AuditActor) -> Result<Webhook> {
        let events = json_text("webhooks.events", &webhook.events)?;
        self.writer
            .write("create webhook", move |tx| {
                let created = tx.one(
                    concat!(
                        "INSERT INTO webhooks (tenant_id, name, url, format, events, \
                         secret_wrapped_key, secret_ciphertext, created_at) \
                         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) RETURNING ",
                        webhook_columns!()
                    ),
                    params![
                        id_text(webhook.tenant_id.0),
                        webhook.name,
                        webhook.url,
                        webhook.format.as_str(),
                        events,
                        webhook.secret_wrapped_key,
                        webhook.secret_ciphertext,
                        unix_millis(webhook.created_at),
                    ],
                    |row| rows::read_webhook(row),
                )?;
                super::audit::append(
                    tx,
                    webhook_event(&created, actions::WEBHOOK_CREATE, actor, created.created_at),
                )?;
                Ok(created)
            })
            .await
    }

    async fn list_webhooks(&self, tenant: TenantId) -> Result<Vec<Webhook>> {
        self.readers
            .read("list webhooks", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        webhook_columns!(),
                        " FROM webhooks WHERE tenant_id = ?1 ORDER BY name"
                    ),
                    params![id_text(tenant.0)],
                    |row| rows::read_webhook(row),
                )
            })
            .await
    }

    async fn delete_webhook(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<bool> {
        let name = name.to_owned();
        self.writer
            .write("delete webhook", move |tx| {
                let deleted = tx.optional(
                    concat!(
                        "DELETE FROM webhooks WHERE tenant_id = ?1 AND name = ?2 RETURNING ",
                        webhook_columns!()
                    ),
                    params![id_text(tenant.0), name],
                    |row| rows::read_webhook(row),
                )?;
                if let Some(webhook) = &deleted {
                    super::audit::append(
                        tx,
                        webhook_event(webhook, actions::WEBHOOK_DELETE, actor, now),
                    )?;
                }
                Ok(deleted.is_some())
            })
            .await
    }

    async fn list_notifications(
        &self,
        tenant: TenantId,
        state: Option<NotificationState>,
        limit: u32,
    ) -> Result<Vec<Notification>> {
        self.readers
            .read("list notifications", move |db| {
                db.all(
                    concat!(
                        "SELECT ",
                        notification_columns!(),
                        " FROM notifications n JOIN webhooks w ON w.id = n.webhook_id \
                         WHERE n.tenant_id = ?1 AND (?2 IS NULL OR n.state = ?2) \
                         ORDER BY n.id DESC LIMIT ?3"
                    ),
                    params![
                        id_text(tenant.0),
                        state.map(NotificationState::as_str),
                        i64::from(limit.max(1))
                    ],
                    |row| rows::read_notification(row),
                )
            })
            .await
    }

    async fn get_notification(&self, tenant: TenantId, id: i64) -> Result<Option<Notification>> {
        self.readers
            .read("get notification", move |db| {
                db.optional(
                    concat!(
                        "SELECT ",
                        notification_columns!(),
                        " FROM notifications n JOIN webhooks w ON w.id = n.webhook_id \
                         WHERE n.tenant_id = ?1 AND n.id = ?2"
                    ),
                    params![id_text(tenant.0), id],
                    |row| rows::read_notification(row),
                )
            })
            .await
    }

    async fn claim_notifications(
        &self,
        now: OffsetDateTime,
        lease_until: OffsetDateTime,
        limit: u32,
    ) -> Result<Vec<Delivery>> {
        // Idle sweeps never take the write lock: a reader answers "nothing due" first.
        if !self.any_notification("pending", unix_millis(now)).await? {
            return Ok(Vec::new());
        }
        self.writer
            .write("claim notifications", move |tx| {
                // The one writer runs this whole, so no other claim can interleave.
                let ids = tx.all(
                    "UPDATE notifications SET state = 'sending', attempts = attempts + 1, \
                     next_attempt_at = ?2, updated_at = ?1 \
                     WHERE id IN (SELECT id FROM notifications \
                                  WHERE state = 'pending' AND next_attempt_at <= ?1 \
                                  ORDER BY next_attempt_at, id LIMIT ?3) \
                     RETURNING id",
                    params![
                        unix_millis(now),
                        unix_millis(lease_until),
                        i64::from(limit.max(1))
                    ],
                    |row| rows::ColumnReader::int(row, "id"),
                )?;
                let mut claimed = Vec::with_capacity(ids.len());
                for id in ids {
                    claimed.push(tx.one(
                        concat!(
                            "SELECT ",
                            delivery_columns!(),
                            " FROM notifications n JOIN webhooks w ON w.id = n.webhook_id \
                             WHERE n.id = ?1"
                        ),
                        params![id],
                        |row| rows::read_delivery(row),
                    )?);
                }
                claimed.sort_by_key(|d| (d.notification.next_attempt_at, d.notification.id));
                Ok(claimed)
            })
            .await
    }

    async fn finish_notification(
        &self,
        id: i64,
        attempt: u32,
        outcome: SendOutcome,
        now: OffsetDateTime,
    ) -> Result<bool> {
        self.writer
            .write("finish notification", move |tx| {
                let (state, code, message) = outcome_columns(&outcome);
                let (next, retry) = match &outcome {
                    SendOutcome::Retry { at, .. } => (unix_millis(*at), 1),
                    _ => (unix_millis(now), 0),
                };
                let changed = tx.execute(
                    "UPDATE notifications SET state = ?3, error_code = ?4, error_message = ?5, \
                     next_attempt_at = ?6, retries = retries + ?7, updated_at = ?8 \
                     WHERE id = ?1 AND attempts = ?2 AND state = 'sending'",
                    params![
                        id,
                        i64::from(attempt),
                        state.as_str(),
                        code,
                        message,
                        next,
                        retry,
                        unix_millis(now)
                    ],
                )?;
                Ok(changed == 1)
            })
            .await
    }

    async fn expire_sending(&self, now: OffsetDateTime) -> Result<u64> {
        if !self.any_notification("sending", unix_millis(now)).await? {
            return Ok(0);
        }
        self.writer
            .write("expire sending notifications", move |tx| {
                let changed = tx.execute(
                    "UPDATE notifications SET state = 'unknown', error_code = ?2, \
                     error_message = 'the server stopped before the send ended', \
                     updated_at = ?1 \
                     WHERE state = 'sending' AND next_attempt_at <= ?1",
                    params![unix_millis(now), INTERRUPTED],
                )?;
                Ok(changed as u64)
            })
            .await
    }

    async fn resend_notification(
        &self,
        tenant: TenantId,
        id: i64,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Resend> {
        self.writer
            .write("resend notification", move |tx| {
                let select = concat!(
                    "SELECT ",
                    notification_columns!(),
                    " FROM notifications n JOIN webhooks w ON w.id = n.webhook_id \
                     WHERE n.tenant_id = ?1 AND n.id = ?2"
                );
                let Some(before) = tx.optional(select, params![id_text(tenant.0), id], |row| {
                    rows::read_notification(row)
                })?
                else {
                    return Ok(Resend::NotFound);
                };
                if !before.state.resendable() {
                    return Ok(Resend::NotResendable(before));
                }
                tx.execute(
                    "UPDATE notifications SET state = 'pending', retries = 0, \
                     next_attempt_at = ?2, updated_at = ?2 WHERE id = ?1",
                    params![id, unix_millis(now)],
                )?;
                super::audit::append(tx, resend_event(&before, actor, now))?;
                let after = tx.one(select, params![id_text(tenant.0), id], |row| {
                    rows::read_notification(row)
                })?;
                Ok(Resend::Queued(after))
            })
            .await
    }
}
