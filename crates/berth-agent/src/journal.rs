//! The agent's journal of completed tasks, keyed by idempotency key: a redelivered task is
//! answered with the recorded outcome instead of being run again. Each entry is its own file,
//! written and fsynced before the result is sent, so a crash after the work never loses it.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use berth_exec::Outcome;

use crate::AgentError;

/// Entries older than this are pruned at start; redeliveries come within minutes, not weeks.
const KEEP: Duration = Duration::from_secs(14 * 24 * 3600);

pub struct Journal {
    dir: PathBuf,
}

impl Journal {
    pub fn open(dir: PathBuf) -> Result<Journal, AgentError> {
        std::fs::create_dir_all(&dir)
            .map_err(|e| AgentError::Config(format!("journal {}: {e}", dir.display())))?;
        let journal = Journal { dir };
        journal.prune();
        Ok(journal)
    }

    fn path(&self, key: &str) -> PathBuf {
        // Hashed: keys come from the server and must not become path components.
        self.dir
            .join(format!("{}.json", berth_crypto::sha256_hex(key.as_bytes())))
    }

    pub fn get(&self, key: &str) -> Option<Outcome> {
        let bytes = std::fs::read(self.path(key)).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// Records a completed outcome durably (temp file, fsync, rename, fsync of the directory).
    pub fn put(&self, key: &str, outcome: &Outcome) -> std::io::Result<()> {
        let bytes = serde_json::to_vec(outcome).map_err(std::io::Error::other)?;
        berth_fs::write_atomic(&self.path(key), &bytes, 0o600)
    }

    fn prune(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let cutoff = SystemTime::now() - KEEP;
        for entry in entries.flatten() {
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .map(|t| t < cutoff)
                .unwrap_or(false);
            if old {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_finds_outcomes_by_key() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path().join("journal")).unwrap();
        assert!(journal.get("k/../../etc").is_none());
        let outcome = Outcome::ok("done").with_output("n", 1);
        journal.put("k/../../etc", &outcome).unwrap();
        assert_eq!(journal.get("k/../../etc"), Some(outcome));
        let reopened = Journal::open(dir.path().join("journal")).unwrap();
        assert!(reopened.get("k/../../etc").is_some());
    }
}
