//! Seed 001 bundles (`GET /v1/agent/bundle/{env_id}/{sha}`): the sha, the deterministic tar
//! `berth bundle build` writes, the in-memory unpacking the agent trusts, the secrets manifest,
//! `bundle.json`, the privilege check and the `.env` render.
//!
//! Owns "a bundle's sha and what unpacking refuses". It must never write a member outside the
//! directory it is given, never hold a secret value in an error, and never depend on the server
//! (the agent uses it; std I/O only, no async).

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Component, Path, PathBuf};

use berth_proto::error::codes;
use sha2::{Digest, Sha256};

mod compose;
mod env;
mod meta;
mod name;
mod tar;

pub use compose::COMPOSE_FILES;
pub use env::TEMPLATE_FILE;
pub use meta::{
    valid_env_var, BundleMeta, ManifestEntry, SecretsManifest, MANIFEST_FILE, META_FILE,
};
pub use tar::{read_tar, to_tar};

/// A bundle's files: '/'-separated relative name → content.
pub type Files = BTreeMap<String, Vec<u8>>;

/// The rendered `.env`: never part of a bundle, never written by [`Bundle::write_to`].
pub const ENV_FILE: &str = ".env";

/// A refusal with its stable code (`berth_proto::error::codes`). Shown as `CODE: detail`, the
/// form the agent reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BundleError {
    pub code: &'static str,
    pub detail: String,
}

impl BundleError {
    pub fn new(code: &'static str, detail: impl Into<String>) -> Self {
        BundleError {
            code,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for BundleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.detail)
    }
}

impl std::error::Error for BundleError {}

/// How much a bundle tar may unpack to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_member_bytes: u64,
    pub max_total_bytes: u64,
    pub max_members: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_member_bytes: 8 << 20,
            max_total_bytes: 64 << 20,
            max_members: 512,
        }
    }
}

/// The seed's bundle sha: lowercase hex of
/// `sha256( for name in sorted(files): name + "\0" + content + "\0" )`.
pub fn sha(files: &Files) -> String {
    let mut hasher = Sha256::new();
    for (name, content) in files {
        hasher.update(name.as_bytes());
        hasher.update([0u8]);
        hasher.update(content);
        hasher.update([0u8]);
    }
    hex::encode(hasher.finalize())
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> BundleError {
    BundleError::new(codes::INTERNAL, format!("{what} {}: {e}", path.display()))
}

/// Reads every regular file under `dir` (names relative, '/'-separated) and returns the files,
/// their tar and its sha. A symlink, device, fifo or socket anywhere is `BUNDLE_UNSAFE`; a name
/// that unpacking would refuse is refused here too, so a built bundle always unpacks.
pub fn build_dir(dir: &Path) -> Result<(Files, Vec<u8>, String), BundleError> {
    let mut files = Files::new();
    walk(dir, "", &mut files)?;
    tar::check_file_prefixes(&files)?;
    let tar = to_tar(&files);
    let sha = sha(&files);
    Ok((files, tar, sha))
}

fn walk(dir: &Path, prefix: &str, files: &mut Files) -> Result<(), BundleError> {
    let entries = std::fs::read_dir(dir).map_err(|e| io_error("reading", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| io_error("reading", dir, e))?;
        let raw = entry.file_name();
        let raw = raw.as_encoded_bytes();
        let mut joined = prefix.as_bytes().to_vec();
        joined.extend_from_slice(raw);
        let name = name::checked(&joined)?;
        let path = entry.path();
        // symlink_metadata: a link is judged as a link, never followed.
        let kind = std::fs::symlink_metadata(&path)
            .map_err(|e| io_error("reading", &path, e))?
            .file_type();
        if kind.is_dir() {
            walk(&path, &format!("{name}/"), files)?;
        } else if kind.is_file() {
            let content = std::fs::read(&path).map_err(|e| io_error("reading", &path, e))?;
            files.insert(name, content);
        } else {
            let why = if kind.is_symlink() {
                "symbolic link"
            } else {
                "not a regular file or directory"
            };
            return Err(name::unsafe_member(&name, why));
        }
    }
    Ok(())
}

/// An unpacked, checked bundle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bundle {
    pub files: Files,
    pub sha: String,
    /// The compose file's member name, one of [`COMPOSE_FILES`].
    pub compose_file: String,
    pub manifest: SecretsManifest,
    pub meta: BundleMeta,
}

/// Unpacks `tar` in memory and checks it: its sha is `expected_sha` (`BUNDLE_SHA_MISMATCH`),
/// `bundle.json` and the manifest read, one compose file present, and no privileged service
/// unless allowed. Nothing is written.
pub fn open(tar: &[u8], expected_sha: &str, limits: &Limits) -> Result<Bundle, BundleError> {
    let files = read_tar(tar, limits)?;
    let sha = sha(&files);
    if sha != expected_sha {
        return Err(BundleError::new(
            codes::BUNDLE_SHA_MISMATCH,
            format!("expected {expected_sha}, the bundle's files hash to {sha}"),
        ));
    }
    let meta = meta::parse_meta(files.get(META_FILE).map(Vec::as_slice))?;
    let manifest = meta::parse_manifest(files.get(MANIFEST_FILE).map(Vec::as_slice))?;
    let present: Vec<&str> = COMPOSE_FILES
        .into_iter()
        .filter(|f| files.contains_key(*f))
        .collect();
    let compose_file = match present.as_slice() {
        [one] => one.to_string(),
        [] => {
            return Err(BundleError::new(
                codes::BUNDLE_INVALID,
                format!("no compose file (one of {})", COMPOSE_FILES.join(", ")),
            ))
        }
        many => {
            return Err(BundleError::new(
                codes::BUNDLE_INVALID,
                format!("more than one compose file: {}", many.join(", ")),
            ))
        }
    };
    let bundle = Bundle {
        files,
        sha,
        compose_file,
        manifest,
        meta,
    };
    bundle.check_privileged()?;
    Ok(bundle)
}

impl Bundle {
    /// `DISK_INSUFFICIENT` when `free_bytes` is below `bundle.json`'s `disk_need_bytes`.
    pub fn check_disk(&self, free_bytes: u64) -> Result<(), BundleError> {
        match self.meta.disk_need_bytes {
            Some(need) if free_bytes < need => Err(BundleError::new(
                codes::DISK_INSUFFICIENT,
                format!("{free_bytes} bytes free, the bundle needs {need}"),
            )),
            _ => Ok(()),
        }
    }

    /// `PRIVILEGED_FORBIDDEN` naming the service, unless `bundle.json` allows privileged ones.
    ///
    /// A prod bundle (`tier == "prod"`) never runs privileged: `allow_privileged` is not
    /// honoured there.
    pub fn check_privileged(&self) -> Result<(), BundleError> {
        if self.meta.allow_privileged && !self.meta.prod {
            return Ok(());
        }
        compose::check(&self.compose_file, &self.files)
    }

    /// The `.env` content: `.env.template` with every manifest var filled from `values`
    /// (`${VAR}` anywhere, or a `VAR=` line), and the ones the template does not mention
    /// appended as `VAR=value`. `ENV_INCOMPLETE: unresolved: A, B` when values are missing.
    pub fn render_env(&self, values: &BTreeMap<String, String>) -> Result<String, BundleError> {
        env::render(
            self.files.get(TEMPLATE_FILE).map(Vec::as_slice),
            &self.manifest,
            values,
        )
    }

    /// Writes every member but `.env` under `dir` (created if missing), 0644, each with
    /// `berth_fs::write_atomic`. A member whose path would leave `dir` (a `..`, or a symlink
    /// already in `dir`) is `BUNDLE_UNSAFE`. Other files in `dir` are left alone.
    pub fn write_to(&self, dir: &Path) -> Result<(), BundleError> {
        std::fs::create_dir_all(dir).map_err(|e| io_error("creating", dir, e))?;
        let root = dir
            .canonicalize()
            .map_err(|e| io_error("resolving", dir, e))?;
        for (name, content) in &self.files {
            if name == ENV_FILE {
                continue;
            }
            let target = contained_path(&root, name)?;
            berth_fs::write_atomic(&target, content, 0o644)
                .map_err(|e| io_error("writing", &target, e))?;
        }
        Ok(())
    }
}

/// `root/name`, with every directory on the way created and proven to be a real directory
/// inside `root` (defence in depth: `read_tar` already refused `..` and absolute names).
fn contained_path(root: &Path, name: &str) -> Result<PathBuf, BundleError> {
    let normal = name::checked(name.as_bytes())?;
    let relative = Path::new(&normal);
    if !relative
        .components()
        .all(|c| matches!(c, Component::Normal(_)))
    {
        return Err(name::unsafe_member(name, "path leaves the directory"));
    }
    let mut parent = root.to_path_buf();
    let mut parts: Vec<&str> = normal.split('/').collect();
    let file = parts.pop().unwrap_or_default();
    for part in parts {
        parent.push(part);
        match std::fs::symlink_metadata(&parent) {
            Ok(m) if m.file_type().is_dir() => {}
            Ok(m) if m.file_type().is_symlink() => {
                return Err(name::unsafe_member(
                    name,
                    &format!("{} is a symbolic link", parent.display()),
                ))
            }
            Ok(_) => {
                return Err(name::unsafe_member(
                    name,
                    &format!("{} exists and is not a directory", parent.display()),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&parent).map_err(|e| io_error("creating", &parent, e))?;
            }
            Err(e) => return Err(io_error("reading", &parent, e)),
        }
    }
    let resolved = parent
        .canonicalize()
        .map_err(|e| io_error("resolving", &parent, e))?;
    if !resolved.starts_with(root) {
        return Err(name::unsafe_member(name, "path leaves the directory"));
    }
    Ok(resolved.join(file))
}
