//! `berth webhook add|ls|rm` and `berth notify ls|resend`: webhooks on deployment and approval
//! events, and the outbox of their notifications. A webhook's secret is read from a file or
//! stdin (never an argument, which every process list shows) and never printed.

use std::path::PathBuf;

use berth_client::Client;
use berth_proto::agent::Deleted;
use berth_proto::notify::{
    CreateWebhook, DeleteWebhook, ListNotifications, ListWebhooks, NotificationState,
    NotificationView, ResendNotification, WebhookFormat, WebhookView,
};

use crate::output::{rfc3339, table, Output};

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Format {
    Generic,
    Slack,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum State {
    Pending,
    Sending,
    Succeeded,
    Failed,
    Dead,
    Unknown,
}

#[derive(clap::Subcommand, Debug)]
pub enum WebhookCommand {
    /// Deliver events to a URL, signed with a secret (admin).
    Add {
        name: String,
        /// `http://` or `https://`.
        #[arg(long)]
        url: String,
        #[arg(long, value_enum, default_value = "generic")]
        format: Format,
        /// Event kinds, comma-separated: deployment.state, deployment.target,
        /// deployment.approval, environment.drift, task.state.
        #[arg(long, value_delimiter = ',', required = true)]
        events: Vec<String>,
        /// The HMAC-SHA256 secret: a file, or `-` for stdin.
        #[arg(long)]
        secret_file: PathBuf,
    },
    /// List webhooks (admin).
    #[command(alias = "list")]
    Ls,
    /// Remove a webhook and its notifications (admin).
    Rm { name: String },
}

#[derive(clap::Subcommand, Debug)]
pub enum NotifyCommand {
    /// The outbox: each notification, newest first.
    #[command(alias = "list")]
    Ls {
        #[arg(long, value_enum)]
        state: Option<State>,
        #[arg(long)]
        limit: Option<u32>,
    },
    /// Send an unknown, failed or dead notification again, with the same Idempotency-Key
    /// (admin). berth never does this by itself: the receiver may already have it.
    Resend { id: i64 },
}

fn state(s: State) -> NotificationState {
    match s {
        State::Pending => NotificationState::Pending,
        State::Sending => NotificationState::Sending,
        State::Succeeded => NotificationState::Succeeded,
        State::Failed => NotificationState::Failed,
        State::Dead => NotificationState::Dead,
        State::Unknown => NotificationState::Unknown,
    }
}

fn webhook_rows(hooks: &[WebhookView]) -> String {
    table(
        &["NAME", "URL", "FORMAT", "EVENTS", "CREATED"],
        &hooks
            .iter()
            .map(|w| {
                vec![
                    w.name.clone(),
                    w.url.clone(),
                    w.format.as_str().to_string(),
                    w.events.join(","),
                    rfc3339(w.created_at),
                ]
            })
            .collect::<Vec<_>>(),
    )
}

fn notification_rows(rows: &[NotificationView]) -> String {
    table(
        &[
            "ID", "WEBHOOK", "EVENT", "TYPE", "STATE", "ATTEMPTS", "NEXT", "ERROR",
        ],
        &rows
            .iter()
            .map(|n| {
                vec![
                    n.id.to_string(),
                    n.webhook.clone(),
                    n.event_id.to_string(),
                    n.event_type.clone(),
                    n.state.as_str().to_string(),
                    n.attempts.to_string(),
                    if n.state == NotificationState::Pending {
                        rfc3339(n.next_attempt_at)
                    } else {
                        "-".into()
                    },
                    n.last_error
                        .as_ref()
                        .map_or_else(|| "-".into(), |e| format!("{}: {}", e.code, e.message)),
                ]
            })
            .collect::<Vec<_>>(),
    )
}

pub async fn webhook(client: &Client, out: Output, cmd: WebhookCommand) -> anyhow::Result<()> {
    match cmd {
        WebhookCommand::Add {
            name,
            url,
            format,
            events,
            secret_file,
        } => {
            let secret = crate::secret::read_value(&secret_file)?;
            let created = client
                .send(&CreateWebhook {
                    name,
                    url,
                    format: match format {
                        Format::Generic => WebhookFormat::Generic,
                        Format::Slack => WebhookFormat::Slack,
                    },
                    events,
                    secret,
                })
                .await?;
            out.print(&created, || webhook_rows(std::slice::from_ref(&created)))
        }
        WebhookCommand::Ls => {
            let hooks = client.send(&ListWebhooks {}).await?;
            out.print(&hooks, || webhook_rows(&hooks))
        }
        WebhookCommand::Rm { name } => {
            let d: Deleted = client.send(&DeleteWebhook { name: name.clone() }).await?;
            out.print(&d, || format!("{name} removed"))
        }
    }
}

pub async fn notify(client: &Client, out: Output, cmd: NotifyCommand) -> anyhow::Result<()> {
    match cmd {
        NotifyCommand::Ls {
            state: filter,
            limit,
        } => {
            let rows = client
                .send(&ListNotifications {
                    state: filter.map(state),
                    limit,
                })
                .await?;
            out.print(&rows, || notification_rows(&rows))
        }
        NotifyCommand::Resend { id } => {
            let n = client.send(&ResendNotification { id }).await?;
            out.print(&n, || {
                format!(
                    "notification {} queued again (Idempotency-Key {})",
                    n.id, n.idempotency_key
                )
            })
        }
    }
}
