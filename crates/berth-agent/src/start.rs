//! The start handshake: before a delivery with side effects touches the host, and again right
//! before each irreversible step, the agent asks the server whether the delivery is still its to
//! run (`POST …/tasks/{taskId}/start` with the generation). A process that was paused or cut off
//! while its lease lapsed, or that a newer process fenced, is told no and does nothing; and the
//! server, which records the first yes, knows that a lost delivery it never said yes to did
//! nothing, so it hands it out again instead of making it `unknown`.

use std::time::Duration;

use berth_exec::LeaseCheck;
use berth_proto::headers::GENERATION_HEADER;
use berth_proto::transport::{AgentTaskAssignment, ProgressPhase, StartTask};
use berth_proto::AgentId;
use time::OffsetDateTime;

use crate::link::SharedLink;
use crate::retry::with_link_retries;

/// One delivery's lease, confirmed with the server on every [`LeaseCheck::confirm`].
pub(crate) struct DeliveryLease {
    pub link: SharedLink,
    pub generation: String,
    pub request: StartTask,
    /// The assignment's `expiresAt`, on the server's clock.
    pub expires_at: OffsetDateTime,
}

impl DeliveryLease {
    pub fn new(
        link: SharedLink,
        generation: &str,
        agent_id: AgentId,
        a: &AgentTaskAssignment,
    ) -> DeliveryLease {
        DeliveryLease {
            link,
            generation: generation.to_string(),
            request: StartTask {
                agent_id,
                task_id: a.task_id,
                assignment_id: a.assignment_id,
                phase: None,
            },
            expires_at: a.expires_at,
        }
    }
}

/// `Err` once `expires_at` has passed on this host's clock: whatever the server would say, the
/// lease is not worth acting on. A paused process finds its assignments stale here before it
/// asks anyone.
pub(crate) fn check_expiry(expires_at: OffsetDateTime) -> Result<(), String> {
    let now = OffsetDateTime::now_utc();
    if now >= expires_at {
        return Err(format!("the lease expired at {expires_at} (now {now})"));
    }
    Ok(())
}

#[async_trait::async_trait]
impl LeaseCheck for DeliveryLease {
    async fn confirm(&self, phase: Option<ProgressPhase>) -> Result<(), String> {
        check_expiry(self.expires_at)?;
        // Retries while the server is unreachable, but never past the lease: a yes after it
        // could not be acted on.
        let budget = (self.expires_at - OffsetDateTime::now_utc())
            .try_into()
            .unwrap_or(Duration::ZERO);
        let headers = [(GENERATION_HEADER, self.generation.as_str())];
        let headers = &headers;
        let request = &StartTask {
            phase,
            ..self.request.clone()
        };
        with_link_retries("task start", budget, &self.link, |link| async move {
            link.client.send_with(request, headers, None).await
        })
        .await
        .map_err(|e| format!("the server did not confirm the lease: {e}"))?;
        // The answer may have waited in a socket while this process was stopped.
        check_expiry(self.expires_at)
    }
}
