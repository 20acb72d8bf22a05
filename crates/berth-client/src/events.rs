//! Reading `GET /api/v1/events`: a Server-Sent Events stream of [`EventView`]s.

use std::time::Duration;

use berth_proto::event::{EventQuery, EventView, LAST_EVENT_ID_HEADER};

use crate::{Client, ClientError};

/// The longest line accepted from the stream: the server's events are far smaller.
const MAX_LINE: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The connection broke or the stream timed out: resume from the last id seen.
    #[error("event stream interrupted")]
    Transport(#[source] reqwest::Error),
    #[error("malformed event stream: {0}")]
    Malformed(String),
}

/// An open event stream. Events come in id order; remember the last id to resume after it.
pub struct EventStream {
    response: reqwest::Response,
    pending: Vec<u8>,
    data: Option<String>,
}

impl Client {
    /// Opens the event stream after `last_event_id` (sent as `Last-Event-ID`). `timeout`
    /// bounds the whole stream, not just its first byte.
    pub async fn events(
        &self,
        query: &EventQuery,
        last_event_id: Option<u64>,
        timeout: Duration,
    ) -> Result<EventStream, ClientError> {
        let path = query.path();
        let build = |server: &str| {
            let builder = self
                .http
                .get(format!("{server}{path}"))
                .header(reqwest::header::ACCEPT, "text/event-stream")
                .timeout(timeout);
            match last_event_id {
                Some(id) => builder.header(LAST_EVENT_ID_HEADER, id.to_string()),
                None => builder,
            }
        };
        Ok(EventStream {
            response: self.execute(build).await?,
            pending: Vec::new(),
            data: None,
        })
    }
}

impl EventStream {
    /// The next event; `None` when the server ended the response (`follow=false`). Comments
    /// (keep-alives) and fields other than `data` are skipped: the data carries id and kind.
    pub async fn next(&mut self) -> Result<Option<EventView>, StreamError> {
        loop {
            while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                let line = std::str::from_utf8(&line[..end])
                    .map_err(|e| StreamError::Malformed(e.to_string()))?
                    .trim_end_matches('\r');
                if line.is_empty() {
                    if let Some(data) = self.data.take() {
                        return serde_json::from_str(&data)
                            .map(Some)
                            .map_err(|e| StreamError::Malformed(format!("event data: {e}")));
                    }
                } else if let Some(value) = line.strip_prefix("data:") {
                    let value = value.strip_prefix(' ').unwrap_or(value);
                    match &mut self.data {
                        Some(data) => {
                            data.push('\n');
                            data.push_str(value);
                        }
                        None => self.data = Some(value.to_string()),
                    }
                }
            }
            if self.pending.len() > MAX_LINE {
                return Err(StreamError::Malformed("line too long".to_string()));
            }
            match self
                .response
                .chunk()
                .await
                .map_err(StreamError::Transport)?
            {
                Some(chunk) => self.pending.extend_from_slice(&chunk),
                None => return Ok(None),
            }
        }
    }
}
