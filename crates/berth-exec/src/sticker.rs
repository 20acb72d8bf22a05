//! Version stickers: a small JSON file per deployment target saying which release is there, so
//! the control plane can read back what a lost task really did. Written atomically and durably
//! (`berth_fs::write_atomic`) without a shell, and every write is appended to `history.log`, one
//! JSON line, so repeated executions are visible.

use std::io::Write;
use std::path::{Path, PathBuf};

pub use berth_proto::sticker::Sticker;

#[derive(Debug, thiserror::Error)]
pub enum StickerError {
    #[error(
        "sticker name {0:?} must be 1-128 characters of A-Z a-z 0-9 . _ - and not start with a dot"
    )]
    InvalidName(String),
    #[error("sticker {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sticker {path} is not valid JSON: {source}")]
    Corrupt {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

/// Where stickers live: one directory, one `<name>.json` each.
#[derive(Debug, Clone)]
pub struct StickerStore {
    dir: PathBuf,
}

impl StickerStore {
    pub fn new(dir: impl Into<PathBuf>) -> StickerStore {
        StickerStore { dir: dir.into() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, name: &str) -> Result<PathBuf, StickerError> {
        if berth_proto::payload::valid_sticker_name(name) {
            Ok(self.dir.join(format!("{name}.json")))
        } else {
            Err(StickerError::InvalidName(name.to_string()))
        }
    }

    fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StickerError + '_ {
        move |source| StickerError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// Writes the sticker atomically and appends it to the history.
    pub fn write(&self, sticker: &Sticker) -> Result<PathBuf, StickerError> {
        let path = self.path(&sticker.name)?;
        std::fs::create_dir_all(&self.dir).map_err(Self::io(&self.dir))?;
        let json = serde_json::to_vec_pretty(sticker).map_err(|source| StickerError::Corrupt {
            path: path.clone(),
            source,
        })?;
        berth_fs::write_atomic(&path, &json, 0o644).map_err(Self::io(&path))?;
        let history = self.dir.join("history.log");
        let line = serde_json::to_string(sticker).map_err(|source| StickerError::Corrupt {
            path: history.clone(),
            source,
        })?;
        let append = || -> std::io::Result<()> {
            let created = !history.exists();
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&history)?;
            f.write_all(format!("{line}\n").as_bytes())?;
            f.sync_all()?;
            if created {
                // The new file's directory entry must be durable too.
                berth_fs::sync_dir(&self.dir)?;
            }
            Ok(())
        };
        append().map_err(Self::io(&history))?;
        Ok(path)
    }

    /// `None` when there is no sticker of that name.
    pub fn read(&self, name: &str) -> Result<Option<Sticker>, StickerError> {
        let path = self.path(name)?;
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|source| StickerError::Corrupt { path, source }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(StickerError::Io { path, source: e }),
        }
    }

    /// Every sticker, by name.
    pub fn list(&self) -> Result<Vec<Sticker>, StickerError> {
        let entries = match std::fs::read_dir(&self.dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(Self::io(&self.dir)(e)),
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                e.file_name()
                    .to_str()
                    .and_then(|n| n.strip_suffix(".json"))
                    .filter(|n| !n.starts_with('.'))
                    .map(str::to_string)
            })
            .collect();
        names.sort();
        let mut out = Vec::new();
        for name in names {
            if let Some(s) = self.read(&name)? {
                out.push(s);
            }
        }
        Ok(out)
    }
}

/// Stickers in named Docker volumes, through the engine.
pub mod volume;

#[cfg(test)]
mod tests {
    use super::*;

    fn sticker(name: &str, digest: &str) -> Sticker {
        Sticker {
            name: name.into(),
            release_id: Some("r1".into()),
            release_name: None,
            image: None,
            digest: Some(digest.into()),
            task_id: "t".into(),
            written_at: time::OffsetDateTime::UNIX_EPOCH,
            extra: Default::default(),
        }
    }

    #[test]
    fn writes_reads_lists_and_keeps_history() {
        let dir = tempfile::tempdir().unwrap();
        let store = StickerStore::new(dir.path().join("stickers"));
        assert_eq!(store.read("web").unwrap(), None);
        store.write(&sticker("web", "sha256:a")).unwrap();
        store.write(&sticker("web", "sha256:b")).unwrap();
        assert_eq!(
            store.read("web").unwrap().unwrap().digest.as_deref(),
            Some("sha256:b")
        );
        assert_eq!(store.list().unwrap().len(), 1);
        let history = std::fs::read_to_string(dir.path().join("stickers/history.log")).unwrap();
        assert_eq!(history.lines().count(), 2);
    }

    #[test]
    fn refuses_names_that_escape_the_directory() {
        let store = StickerStore::new("/tmp/none");
        for bad in ["../x", "a/b", "", ".hidden", "x\0y", &"a".repeat(129)] {
            assert!(
                matches!(
                    store.write(&sticker(bad, "d")),
                    Err(StickerError::InvalidName(_))
                ),
                "{bad:?}"
            );
        }
    }
}
