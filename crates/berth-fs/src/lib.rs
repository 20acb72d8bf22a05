//! Durable file writes for the agent, the executors and the server's data dir.
//!
//! [`write_atomic`] is the one way berth replaces a file: a reader sees the old content or the
//! new one, never half of either, and once it returns the new content survives a crash (the file
//! and its directory entry are both fsynced). No dependency beyond `std`, so any crate that does
//! I/O can use it without new edges.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Replaces `path` with `bytes`, atomically and durably.
///
/// The content goes to a fresh temp file in the same directory, created with `mode` (so a key
/// written 0600 is never readable by others, not even for an instant), is written and fsynced,
/// renamed over `path`, and then the directory is fsynced so the rename itself is on disk. On an
/// error the temp file is removed and `path` is untouched. The directory must exist.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> io::Result<()> {
    let dir = parent(path);
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path names no file"))?;
    let tmp = dir.join(format!(
        ".{}.{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id(),
        unique()
    ));
    let written = (|| {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&tmp)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_dir(dir)
}

/// Fsyncs a directory, so entries created, renamed or removed in it are durable.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Distinct per call within a process, so concurrent writers of one path never share a temp file.
fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn writes_and_replaces_with_the_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key.pem");
        write_atomic(&path, b"one", 0o600).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"one");
        assert_eq!(mode(&path), 0o600);
        write_atomic(&path, b"two", 0o600).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"two");
        let public = dir.path().join("ca.crt");
        write_atomic(&public, b"ca", 0o644).unwrap();
        assert_eq!(mode(&public), 0o644 & !umask());
        // No temp files are left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.json");
        write_atomic(&path, b"old", 0o600).unwrap();
        // A directory where the file should go: the rename fails.
        let blocked = dir.path().join("blocked");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("x"), b"").unwrap();
        assert!(write_atomic(&blocked, b"new", 0o600).is_err());
        assert_eq!(std::fs::read(&path).unwrap(), b"old");
        let leftovers = std::fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".tmp")
            })
            .count();
        assert_eq!(leftovers, 0);
    }

    #[test]
    fn a_missing_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = write_atomic(&dir.path().join("nope/file"), b"x", 0o600).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_bare_file_name_lives_in_the_current_directory() {
        assert_eq!(parent(Path::new("file")), Path::new("."));
        assert_eq!(parent(Path::new("a/file")), Path::new("a"));
    }

    fn umask() -> u32 {
        // Read the process umask back from a file created with 0o777.
        let dir = tempfile::tempdir().unwrap();
        let probe = dir.path().join("probe");
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o777)
            .open(&probe)
            .unwrap();
        0o777 & !mode(&probe)
    }
}
