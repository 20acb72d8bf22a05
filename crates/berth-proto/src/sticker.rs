//! A version sticker as the agent writes it on a target and a read-back returns it (`read-sticker`'s
//! `sticker`, `inspect`'s `stickers`): which release is there, written by which task. The agent's
//! sticker store (`berth_exec::sticker`) writes it; the server and the web UI read it from results.

use serde::{Deserialize, Serialize};

/// What a sticker says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sticker {
    /// The target: a container name, a compose project, or any name the task chose.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// The task that wrote it.
    pub task_id: String,
    #[serde(with = "crate::rfc3339")]
    pub written_at: time::OffsetDateTime,
    /// Anything else the task wants recorded.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: serde_json::Map<String, serde_json::Value>,
}
