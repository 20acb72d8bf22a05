//! `GET /api/v1/events`: the tenant's events as Server-Sent Events, read from the store's
//! durable event table after a cursor (`Last-Event-ID`, or `?after=` / `?lastEventId=`), so a
//! client that reconnects with the last id it saw misses nothing and sees nothing twice — on
//! any replica, since the cursor is the database's commit-ordered sequence number. The web UI's
//! script reads it with its session cookie (`ui::session::ReadCaller`).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use berth_proto::error::codes;
use berth_proto::event::{EventMessage, EventQuery, EventView, LAST_EVENT_ID_HEADER};
use berth_proto::ErrorBody;
use berth_store::{DynStore, Event, EventFilter};
use futures_util::Stream;
use tokio::sync::watch;

use crate::http::extract::ApiQuery;
use crate::http::ui::session::ReadCaller;
use crate::infra::error::{ApiError, ApiResult};
use crate::SharedState;

/// A comment line this often keeps proxies (and clients' read timeouts) from closing a quiet
/// stream.
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// Rows per store read; a reader far behind catches up in pages of this many.
const PAGE: u32 = 500;

/// The tenant's task and agent events, oldest first after the cursor, then live as they
/// commit; with `follow=false`, the stored ones and the end of the response.
#[utoipa::path(get, path = "/api/v1/events", tag = "events", security(("bearer" = [])),
    params(EventQuery, ("Last-Event-ID" = Option<u64>, Header, description = "resume after this event id; wins over `after` and `lastEventId`")),
    responses(
        (status = 200, content_type = "text/event-stream", body = EventMessage,
         description = "SSE: `id: <seq>`, `event: <kind>`, `data: <EventView JSON>` per event, `: keep-alive` comments every 15 s"),
        (status = 400, body = ErrorBody, description = "INVALID_REQUEST: a Last-Event-ID that is not a non-negative integer"),
    ))]
pub async fn stream(
    State(state): State<SharedState>,
    ReadCaller(caller): ReadCaller,
    headers: HeaderMap,
    ApiQuery(query): ApiQuery<EventQuery>,
) -> ApiResult<Response> {
    caller.can_read()?;
    let header = match headers.get(LAST_EVENT_ID_HEADER) {
        None => None,
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    ApiError::bad_request(
                        codes::INVALID_REQUEST,
                        "Last-Event-ID must be an event id (a non-negative integer)",
                    )
                })?,
        ),
    };
    let after = header.or(query.after).or(query.last_event_id).unwrap_or(0);
    let follow = Follow {
        store: state.store.clone(),
        tenant: caller.tenant(),
        filter: EventFilter {
            task: query.task,
            agent: query.agent,
            deployment: query.deployment,
            environment: query.environment,
        },
        cursor: i64::try_from(after).unwrap_or(i64::MAX),
        // Subscribed before the first read: a commit between that read and the wait still
        // marks the receiver changed, so it is not missed.
        written: query
            .follow
            .unwrap_or(true)
            .then(|| state.store.events_written()),
        ready: VecDeque::new(),
        _open: state.metrics.event_stream_opened(),
        stopping: state.stopping.subscribe(),
    };
    let sse = Sse::new(follow.into_stream())
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE).text("keep-alive"));
    Ok(sse.into_response())
}

struct Follow {
    store: DynStore,
    tenant: berth_proto::TenantId,
    filter: EventFilter,
    /// The last id sent (or the client's).
    cursor: i64,
    /// `None`: not following; the stream ends once the stored events are sent.
    written: Option<watch::Receiver<u64>>,
    ready: VecDeque<Event>,
    _open: crate::infra::metrics::OpenEventStream,
    /// The server is stopping: the stream ends (cleanly; the client resumes elsewhere).
    stopping: watch::Receiver<bool>,
}

impl Follow {
    fn into_stream(self) -> impl Stream<Item = Result<SseEvent, Infallible>> + Send {
        futures_util::stream::unfold(self, |mut follow| async move {
            let event = follow.next().await?;
            Some((Ok(to_sse(event)), follow))
        })
    }

    /// The next event; `None` ends the response (not following and caught up, or the store
    /// failed: the client resumes from its last id).
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.ready.pop_front() {
                self.cursor = event.id;
                return Some(event);
            }
            if let Some(written) = &mut self.written {
                written.borrow_and_update();
            }
            match self
                .store
                .read_events(self.tenant, &self.filter, self.cursor, PAGE)
                .await
            {
                Ok(events) if !events.is_empty() => {
                    self.ready.extend(events);
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %berth_proto::error::ErrorChain(&e), "event stream read failed; ending the stream");
                    return None;
                }
            }
            // Caught up: wait for the next commit that wrote events; end when the store is
            // gone or the server stops.
            let written = self.written.as_mut()?;
            tokio::select! {
                changed = written.changed() => changed.ok()?,
                _ = self.stopping.wait_for(|stop| *stop) => return None,
            }
        }
    }
}

fn to_sse(event: Event) -> SseEvent {
    let view = EventView {
        id: u64::try_from(event.id).unwrap_or(0),
        kind: event.kind,
        task_id: event.task_id,
        agent_id: event.agent_id,
        deployment_id: event.deployment_id,
        environment_id: event.environment_id,
        created_at: event.created_at,
        data: event.data,
    };
    let data = serde_json::to_string(&view).unwrap_or_else(|_| "{}".to_string());
    SseEvent::default()
        .id(view.id.to_string())
        .event(&view.kind)
        .data(data)
}
