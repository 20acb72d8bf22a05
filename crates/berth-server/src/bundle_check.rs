//! The bundle checks of `berth-bundle` (`read_tar`, `sha`, same signatures), which the server
//! runs on a pushed bundle; this module is replaced by that crate when both are merged.

use std::collections::BTreeMap;
use std::io::Read;

/// Member name → content.
pub type Files = BTreeMap<String, Vec<u8>>;

pub struct Limits {
    pub max_members: usize,
    pub max_member_bytes: u64,
    pub max_total_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("member {0:?}: {1}")]
    Unsafe(String, &'static str),
    #[error("{0}")]
    TooLarge(String),
    #[error("{0}")]
    Invalid(String),
}

/// Reads a tar of flat, regular files: no links, devices, directories, absolute or `..`
/// names, duplicates; within `limits`; with a compose file.
pub fn read_tar(bytes: &[u8], limits: &Limits) -> Result<Files, BundleError> {
    let invalid = |e: std::io::Error| BundleError::Invalid(format!("not a readable tar: {e}"));
    let mut files = Files::new();
    let mut total = 0u64;
    for entry in tar::Archive::new(bytes).entries().map_err(invalid)? {
        let mut entry = entry.map_err(invalid)?;
        let raw = String::from_utf8_lossy(&entry.path_bytes()).into_owned();
        let name = raw.strip_prefix("./").unwrap_or(&raw).to_string();
        if !entry.header().entry_type().is_file() {
            return Err(BundleError::Unsafe(name, "not a regular file"));
        }
        if name.is_empty()
            || name.starts_with('/')
            || name.split('/').any(|s| s == ".." || s.is_empty())
        {
            return Err(BundleError::Unsafe(name, "absolute, empty or `..` path"));
        }
        let size = entry.size();
        total += size;
        if size > limits.max_member_bytes
            || total > limits.max_total_bytes
            || files.len() >= limits.max_members
        {
            return Err(BundleError::TooLarge(format!(
                "member {name:?} is over the bundle's limits"
            )));
        }
        let mut content = Vec::with_capacity(size as usize);
        entry.read_to_end(&mut content).map_err(invalid)?;
        if files.insert(name.clone(), content).is_some() {
            return Err(BundleError::Unsafe(name, "named twice"));
        }
    }
    if !files.contains_key("docker-compose.yml") && !files.contains_key("compose.yaml") {
        return Err(BundleError::Invalid(
            "no docker-compose.yml or compose.yaml".into(),
        ));
    }
    Ok(files)
}

/// Seed 001: `sha256( for name in sorted(files): name + "\0" + content + "\0" )`, hex.
pub fn sha(files: &Files) -> String {
    let mut input = Vec::with_capacity(files.iter().map(|(n, c)| n.len() + c.len() + 2).sum());
    for (name, content) in files {
        input.extend_from_slice(name.as_bytes());
        input.push(0);
        input.extend_from_slice(content);
        input.push(0);
    }
    berth_crypto::sha256_hex(&input)
}
