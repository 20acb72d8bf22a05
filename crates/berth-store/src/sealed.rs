//! Task payloads sealed at rest (issue 17 item 2): the `payload` column of a task row holds
//! `"sealed:v1:<base64>"`, AES-256-GCM under the server's master key with the associated data
//! `payload:<task id>`, so a database dump, a backup or a replica's disk shows ciphertext, and a
//! sealed payload moved to another row (or into `credentials_sealed`, sealed under the same key
//! with the bare task id) does not open. Every row a backend writes is sealed here and every row
//! it reads is opened here: the rest of berth only sees clear payloads. A row written before
//! payloads were sealed is still a JSON object and reads as it is; it ages out with retention.

use std::sync::Arc;

use base64::Engine as _;
use berth_crypto::MasterKey;
use berth_proto::TaskId;
use serde_json::Value;

use crate::StoreError;

const PREFIX: &str = "sealed:v1:";

/// The key task payloads are sealed with; cheap to clone.
#[derive(Clone)]
pub struct PayloadKey(Arc<MasterKey>);

impl std::fmt::Debug for PayloadKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PayloadKey(***)")
    }
}

impl PayloadKey {
    pub fn new(key: MasterKey) -> PayloadKey {
        PayloadKey(Arc::new(key))
    }

    fn aad(task: TaskId) -> Vec<u8> {
        format!("payload:{}", task.0).into_bytes()
    }

    /// What the task row stores for `payload`.
    pub(crate) fn seal(&self, task: TaskId, payload: &Value) -> Result<Value, StoreError> {
        let clear = serde_json::to_vec(payload)
            .map_err(|e| StoreError::Corrupt(format!("tasks.payload: {e}")))?;
        let sealed = self
            .0
            .seal(&clear, &Self::aad(task))
            .map_err(|e| StoreError::Corrupt(format!("tasks.payload: cannot seal: {e}")))?;
        let text = base64::engine::general_purpose::STANDARD.encode(sealed);
        Ok(Value::String(format!("{PREFIX}{text}")))
    }

    /// The clear payload of the row `stored` was read from. A row that is not sealed (written
    /// before payloads were) is returned as it is; one that does not open is corrupt.
    pub(crate) fn open(&self, task: TaskId, stored: Value) -> Result<Value, StoreError> {
        let Some(text) = stored.as_str().and_then(|s| s.strip_prefix(PREFIX)) else {
            return Ok(stored);
        };
        let corrupt =
            |why: &str| StoreError::Corrupt(format!("tasks.payload of task {}: {why}", task.0));
        let sealed = base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(|_| corrupt("not base64"))?;
        let clear = self
            .0
            .open(&sealed, &Self::aad(task))
            .map_err(|_| corrupt("does not open under this server's master key"))?;
        serde_json::from_slice(&clear).map_err(|_| corrupt("not JSON once opened"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_opens_only_in_its_own_row() {
        let key = PayloadKey::new(MasterKey::generate());
        let task = TaskId::new();
        let payload = serde_json::json!({"image": "web", "config": {"environment": {"K": "v"}}});
        let sealed = key.seal(task, &payload).unwrap();
        assert!(!sealed.to_string().contains("web"), "{sealed}");
        assert_eq!(key.open(task, sealed.clone()).unwrap(), payload);
        // Another row, another key, a flipped byte: corrupt, never a wrong payload.
        assert!(key.open(TaskId::new(), sealed.clone()).is_err());
        let other = PayloadKey::new(MasterKey::generate());
        assert!(other.open(task, sealed.clone()).is_err());
        let mut text = sealed.as_str().unwrap().to_string();
        let last = text.pop().unwrap();
        text.push(if last == 'A' { 'B' } else { 'A' });
        assert!(key.open(task, Value::String(text)).is_err());
        // A row written before sealing reads as it is.
        assert_eq!(key.open(task, payload.clone()).unwrap(), payload);
    }
}
