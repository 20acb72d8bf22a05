//! Webhooks and notifications on PostgreSQL. The outbox rows themselves are written by
//! migration 0019's trigger on `events`, when the event is numbered at commit.

use berth_proto::audit::{actions, AuditActor};
use berth_proto::notify::NotificationState;
use berth_proto::TenantId;
use sqlx::types::Json;
use time::OffsetDateTime;

use super::PostgresStore;
use crate::domain::notify::{outcome_columns, resend_event, webhook_event, INTERRUPTED};
use crate::rows::{
    self, db_error, delivery_columns, millis, notification_columns, webhook_columns,
};
use crate::{
    Delivery, NewWebhook, Notification, NotifyStore, Resend, Result, SendOutcome, Webhook,
};

const SELECT_NOTIFICATION: &str = concat!(
    "SELECT ",
    notification_columns!(),
    " FROM notifications n JOIN webhooks w ON w.id = n.webhook_id \
     WHERE n.tenant_id = $1 AND n.id = $2"
);

#[async_trait::async_trait]
impl NotifyStore for PostgresStore {
    async fn create_webhook(&self, webhook: NewWebhook, actor: AuditActor) -> Result<Webhook> {
        const OP: &str = "create webhook";
        let mut tx = self.begin(OP).await?;
        let row = sqlx::query(concat!(
            "INSERT INTO webhooks (tenant_id, name, url, format, events, secret_wrapped_key, \
             secret_ciphertext, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) RETURNING ",
            webhook_columns!()
        ))
        .bind(webhook.tenant_id.0)
        .bind(&webhook.name)
        .bind(&webhook.url)
        .bind(webhook.format.as_str())
        .bind(Json(&webhook.events))
        .bind(&webhook.secret_wrapped_key)
        .bind(&webhook.secret_ciphertext)
        .bind(millis(webhook.created_at))
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        let created = rows::read_webhook(&row)?;
        super::audit::append(
            &mut tx,
            webhook_event(&created, actions::WEBHOOK_CREATE, actor, created.created_at),
        )
        .await?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(created)
    }

    async fn list_webhooks(&self, tenant: TenantId) -> Result<Vec<Webhook>> {
        sqlx::query(concat!(
            "SELECT ",
            webhook_columns!(),
            " FROM webhooks WHERE tenant_id = $1 ORDER BY name"
        ))
        .bind(tenant.0)
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list webhooks"))?
        .iter()
        .map(rows::read_webhook)
        .collect()
    }

    async fn delete_webhook(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<bool> {
        const OP: &str = "delete webhook";
        let mut tx = self.begin(OP).await?;
        let deleted = sqlx::query(concat!(
            "DELETE FROM webhooks WHERE tenant_id = $1 AND name = $2 RETURNING ",
            webhook_columns!()
        ))
        .bind(tenant.0)
        .bind(name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_webhook(&row))
        .transpose()?;
        if let Some(webhook) = &deleted {
            super::audit::append(
                &mut tx,
                webhook_event(webhook, actions::WEBHOOK_DELETE, actor, now),
            )
            .await?;
        }
        tx.commit().await.map_err(db_error(OP))?;
        Ok(deleted.is_some())
    }

    async fn list_notifications(
        &self,
        tenant: TenantId,
        state: Option<NotificationState>,
        limit: u32,
    ) -> Result<Vec<Notification>> {
        // A notification is written when its event is numbered (migration 0019's trigger),
        // so every event committed before this call gets its id first.
        self.sequencer.flush().await?;
        sqlx::query(concat!(
            "SELECT ",
            notification_columns!(),
            " FROM notifications n JOIN webhooks w ON w.id = n.webhook_id \
             WHERE n.tenant_id = $1 AND ($2::TEXT IS NULL OR n.state = $2) \
             ORDER BY n.id DESC LIMIT $3"
        ))
        .bind(tenant.0)
        .bind(state.map(NotificationState::as_str))
        .bind(i64::from(limit.max(1)))
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("list notifications"))?
        .iter()
        .map(rows::read_notification)
        .collect()
    }

    async fn get_notification(&self, tenant: TenantId, id: i64) -> Result<Option<Notification>> {
        sqlx::query(SELECT_NOTIFICATION)
            .bind(tenant.0)
            .bind(id)
            .fetch_optional(&mut *self.conn().await?)
            .await
            .map_err(db_error("get notification"))?
            .map(|row| rows::read_notification(&row))
            .transpose()
    }

    async fn claim_notifications(
        &self,
        now: OffsetDateTime,
        lease_until: OffsetDateTime,
        limit: u32,
    ) -> Result<Vec<Delivery>> {
        // As in `list_notifications`: the events committed so far have their notifications.
        self.sequencer.flush().await?;
        // SKIP LOCKED: replicas sweeping at once each take other rows, none waits.
        let mut claimed = sqlx::query(concat!(
            "WITH due AS (SELECT id FROM notifications \
                          WHERE state = 'pending' AND next_attempt_at <= $1 \
                          ORDER BY next_attempt_at, id LIMIT $3 FOR UPDATE SKIP LOCKED), \
             n AS (UPDATE notifications SET state = 'sending', attempts = attempts + 1, \
                   next_attempt_at = $2, updated_at = $1 \
                   FROM due WHERE notifications.id = due.id RETURNING notifications.*) \
             SELECT ",
            delivery_columns!(),
            " FROM n JOIN webhooks w ON w.id = n.webhook_id"
        ))
        .bind(millis(now))
        .bind(millis(lease_until))
        .bind(i64::from(limit.max(1)))
        .fetch_all(&mut *self.conn().await?)
        .await
        .map_err(db_error("claim notifications"))?
        .iter()
        .map(rows::read_delivery)
        .collect::<Result<Vec<_>>>()?;
        claimed.sort_by_key(|d| d.notification.id);
        Ok(claimed)
    }

    async fn finish_notification(
        &self,
        id: i64,
        attempt: u32,
        outcome: SendOutcome,
        now: OffsetDateTime,
    ) -> Result<bool> {
        let (state, code, message) = outcome_columns(&outcome);
        let (next, retry) = match &outcome {
            SendOutcome::Retry { at, .. } => (*at, 1_i64),
            _ => (now, 0),
        };
        let changed = sqlx::query(
            "UPDATE notifications SET state = $3, error_code = $4, error_message = $5, \
             next_attempt_at = $6, retries = retries + $7, updated_at = $8 \
             WHERE id = $1 AND attempts = $2 AND state = 'sending'",
        )
        .bind(id)
        .bind(i64::from(attempt))
        .bind(state.as_str())
        .bind(code)
        .bind(message)
        .bind(millis(next))
        .bind(retry)
        .bind(millis(now))
        .execute(&mut *self.conn().await?)
        .await
        .map_err(db_error("finish notification"))?
        .rows_affected();
        Ok(changed == 1)
    }

    async fn expire_sending(&self, now: OffsetDateTime) -> Result<u64> {
        Ok(sqlx::query(
            "UPDATE notifications SET state = 'unknown', error_code = $2, \
             error_message = 'the server stopped before the send ended', updated_at = $1 \
             WHERE state = 'sending' AND next_attempt_at <= $1",
        )
        .bind(millis(now))
        .bind(INTERRUPTED)
        .execute(&mut *self.conn().await?)
        .await
        .map_err(db_error("expire sending notifications"))?
        .rows_affected())
    }

    async fn resend_notification(
        &self,
        tenant: TenantId,
        id: i64,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Resend> {
        const OP: &str = "resend notification";
        let mut tx = self.begin(OP).await?;
        // FOR UPDATE OF n: a concurrent sender's finish waits, and so does a second resend.
        let before = sqlx::query(concat!(
            "SELECT ",
            notification_columns!(),
            " FROM notifications n JOIN webhooks w ON w.id = n.webhook_id \
             WHERE n.tenant_id = $1 AND n.id = $2 FOR UPDATE OF n"
        ))
        .bind(tenant.0)
        .bind(id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error(OP))?
        .map(|row| rows::read_notification(&row))
        .transpose()?;
        let Some(before) = before else {
            return Ok(Resend::NotFound);
        };
        if !before.state.resendable() {
            return Ok(Resend::NotResendable(before));
        }
        sqlx::query(
            "UPDATE notifications SET state = 'pending', retries = 0, next_attempt_at = $2, \
             updated_at = $2 WHERE id = $1",
        )
        .bind(id)
        .bind(millis(now))
        .execute(&mut *tx)
        .await
        .map_err(db_error(OP))?;
        super::audit::append(&mut tx, resend_event(&before, actor, now)).await?;
        let after = sqlx::query(SELECT_NOTIFICATION)
            .bind(tenant.0)
            .bind(id)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error(OP))?;
        let after = rows::read_notification(&after)?;
        tx.commit().await.map_err(db_error(OP))?;
        Ok(Resend::Queued(after))
    }
}
