//! The bundle checks of `berth-bundle` (`read_tar`, `sha`, same signatures), run on a pushed
//! bundle; this module is replaced by that crate when both are merged.

use std::collections::BTreeMap;
use std::io::Read;

/// Member name → content.
pub type Files = BTreeMap<String, Vec<u8>>;

pub struct Limits {
    pub max_members: usize,
    pub max_total_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("member {0:?}: {1}")]
    Unsafe(String, &'static str),
    #[error("over the bundle's limits at member {0:?}")]
    TooLarge(String),
    #[error("{0}")]
    Invalid(String),
}

/// A tar of regular files only (no links, devices, directories, absolute or `..` names,
/// duplicates), within `limits`, with a compose file.
pub fn read_tar(bytes: &[u8], limits: &Limits) -> Result<Files, BundleError> {
    let invalid = |e: std::io::Error| BundleError::Invalid(format!("not a readable tar: {e}"));
    let (mut files, mut total) = (Files::new(), 0u64);
    for entry in tar::Archive::new(bytes).entries().map_err(invalid)? {
        let mut entry = entry.map_err(invalid)?;
        let raw = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let name = raw.strip_prefix("./").unwrap_or(&raw).to_string();
        let bad_path = name.starts_with('/') || name.split('/').any(|s| s.is_empty() || s == "..");
        if bad_path || !entry.header().entry_type().is_file() {
            return Err(BundleError::Unsafe(name, "not a relative regular file"));
        }
        total += entry.size();
        if total > limits.max_total_bytes || files.len() >= limits.max_members {
            return Err(BundleError::TooLarge(name));
        }
        let mut content = Vec::new();
        entry.read_to_end(&mut content).map_err(invalid)?;
        if files.insert(name.clone(), content).is_some() {
            return Err(BundleError::Unsafe(name, "named twice"));
        }
    }
    let compose = files.contains_key("docker-compose.yml") || files.contains_key("compose.yaml");
    let missing = || BundleError::Invalid("no docker-compose.yml or compose.yaml".into());
    compose.then_some(files).ok_or_else(missing)
}

/// Seed 001: `sha256( for name in sorted(files): name + "\0" + content + "\0" )`, hex.
pub fn sha(files: &Files) -> String {
    let mut input = Vec::new();
    for (name, content) in files {
        input.extend([name.as_bytes(), b"\0", content, b"\0"].concat());
    }
    berth_crypto::sha256_hex(&input)
}
