//! What a session request can prove about this process: that the previous process of this
//! installation on this host is dead.
//!
//! The agent holds an exclusive `flock` on `<state-dir>/agent.lock` for its whole life (the
//! descriptor is close-on-exec, so task processes that outlive a kill -9 do not keep it). Only
//! while it holds the lock does it send the lock file's identity (`<device>:<inode>`) with the
//! host's boot id. The server records both with the session: a later process that presents the
//! same pair holds the very lock the holder held on the same boot, so the holder is dead, and it
//! takes the session back at once. A copied state dir has another lock file (another inode), a
//! copy on another host or a rebooted host another boot id, and a second live process on the
//! same state dir cannot take the lock: all of them still get `SESSION_HELD`.
//!
//! The boot id is read from `/proc/sys/kernel/random/boot_id`, or from the file that
//! `BERTH_AGENT_BOOT_ID_FILE` names: for tests (another "host") and for hosts without `/proc`.
//! Without a boot id nothing is proven and a restart waits for the old lease, as before.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;

use crate::state::StateDir;

pub const BOOT_ID_FILE_ENV: &str = "BERTH_AGENT_BOOT_ID_FILE";
const BOOT_ID_FILE: &str = "/proc/sys/kernel/random/boot_id";

/// This process's claim on its installation. Keep it alive for the process's whole life.
pub struct Installation {
    /// Held lock file (closing it releases the lock) and its identity.
    lock: Option<(File, String)>,
    pub boot_id: Option<String>,
}

impl Installation {
    /// Takes the installation lock if it is free; never blocks or fails (without the lock or a
    /// boot id the session request simply proves nothing).
    pub fn claim(state: &StateDir) -> Installation {
        let path = state.0.join("agent.lock");
        let lock = match try_lock(&path) {
            Ok(Some(held)) => Some(held),
            Ok(None) => {
                tracing::warn!(
                    lock = %path.display(),
                    "another live berth-agent process holds this state dir; the server refuses \
                     this one (SESSION_HELD) while that one holds the session"
                );
                None
            }
            Err(e) => {
                tracing::warn!(lock = %path.display(), error = %e, "cannot take the installation lock; a restart will wait for this session's lease");
                None
            }
        };
        Installation {
            lock,
            boot_id: boot_id(),
        }
    }

    /// The lock's identity, only while it is held.
    pub fn lock_id(&self) -> Option<String> {
        self.lock.as_ref().map(|(_, id)| id.clone())
    }
}

fn try_lock(path: &PathBuf) -> std::io::Result<Option<(File, String)>> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)?;
    // SAFETY: flock on a descriptor we own and keep open.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    let meta = file.metadata()?;
    let id = format!("{}:{}", meta.dev(), meta.ino());
    Ok(Some((file, id)))
}

fn boot_id() -> Option<String> {
    let path = std::env::var_os(BOOT_ID_FILE_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(BOOT_ID_FILE));
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let id = text.trim();
            (!id.is_empty() && id.len() <= 128 && !id.contains('/')).then(|| id.to_string())
        }
        Err(e) => {
            tracing::warn!(file = %path.display(), error = %e, "no boot id; a restart will wait for this session's lease");
            None
        }
    }
}
