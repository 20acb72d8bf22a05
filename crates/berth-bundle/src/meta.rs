//! `secrets.manifest.json` (which secrets, by path and version; never a value) and `bundle.json`
//! (what the agent honours: tier, renderer, privileged/rollback/disk needs). Both are read as
//! JSON values so unknown fields are ignored and a wrong type names the field.

use berth_proto::desired::SecretPath;
use berth_proto::error::codes;
use serde_json::{Map, Value};

use crate::BundleError;

pub const MANIFEST_FILE: &str = "secrets.manifest.json";
pub const META_FILE: &str = "bundle.json";

/// One secret the `.env` needs: the variable, where the secret lives, and which version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ManifestEntry {
    pub var: String,
    pub path: String,
    /// `supplied` or `generated` in the seed; `supplied` when absent.
    pub kind: String,
    /// `None`: the latest version.
    pub version: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretsManifest {
    /// `openbao` or `builtin`; `builtin` when absent.
    pub vault_mode: String,
    pub entries: Vec<ManifestEntry>,
}

impl Default for SecretsManifest {
    fn default() -> Self {
        SecretsManifest {
            vault_mode: "builtin".into(),
            entries: Vec::new(),
        }
    }
}

/// What the agent honours of `bundle.json`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BundleMeta {
    pub env_id: Option<String>,
    pub tier: Option<String>,
    /// `tier == "prod"`.
    pub prod: bool,
    pub allow_privileged: bool,
    pub allow_rollback: bool,
    pub disk_need_bytes: Option<u64>,
    /// Always `compose`: any other is refused when read.
    pub renderer: String,
}

impl Default for BundleMeta {
    fn default() -> Self {
        BundleMeta {
            env_id: None,
            tier: None,
            prod: false,
            allow_privileged: false,
            allow_rollback: false,
            disk_need_bytes: None,
            renderer: "compose".into(),
        }
    }
}

fn invalid(detail: impl Into<String>) -> BundleError {
    BundleError::new(codes::BUNDLE_INVALID, detail)
}

fn object(file: &str, bytes: &[u8]) -> Result<Map<String, Value>, BundleError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(invalid(format!("{file} is not a JSON object"))),
        Err(e) => Err(invalid(format!("{file} is not JSON: {e}"))),
    }
}

/// An optional string field (`null` counts as absent).
fn opt_str(map: &Map<String, Value>, key: &str, file: &str) -> Result<Option<String>, BundleError> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(invalid(format!("{file}: {key} must be a string"))),
    }
}

/// A valid environment variable name: `[A-Za-z_][A-Za-z0-9_]*`.
pub fn valid_env_var(name: &str) -> bool {
    let mut chars = name.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

pub(crate) fn parse_manifest(bytes: Option<&[u8]>) -> Result<SecretsManifest, BundleError> {
    let Some(bytes) = bytes else {
        return Ok(SecretsManifest::default());
    };
    let file = MANIFEST_FILE;
    let map = object(file, bytes)?;
    let vault_mode = opt_str(&map, "vault_mode", file)?.unwrap_or_else(|| "builtin".into());
    let raw_entries = match map.get("entries") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(invalid(format!("{file}: entries must be an array"))),
    };
    let mut entries: Vec<ManifestEntry> = Vec::with_capacity(raw_entries.len());
    for (i, raw) in raw_entries.iter().enumerate() {
        let Value::Object(entry) = raw else {
            return Err(invalid(format!("{file}: entry {i} is not an object")));
        };
        let var = opt_str(entry, "var", file)?
            .ok_or_else(|| invalid(format!("{file}: entry {i} has no var")))?;
        if !valid_env_var(&var) {
            return Err(invalid(format!(
                "{file}: entry {i}: var {var:?} is not an environment variable name"
            )));
        }
        // The bundle is public to whoever holds its sha: a secret in it would leak. Refused
        // whatever the value is, even null, so a renderer that writes values fails loudly.
        if entry.contains_key("value") {
            return Err(invalid(format!("manifest entry {var} carries a value")));
        }
        let path = opt_str(entry, "path", file)?
            .ok_or_else(|| invalid(format!("{file}: entry {var} has no path")))?;
        if SecretPath::parse(&path).is_none() {
            return Err(invalid(format!(
                "{file}: entry {var}: path {path:?} is not a secret path"
            )));
        }
        let kind = opt_str(entry, "kind", file)?.unwrap_or_else(|| "supplied".into());
        let version =
            match entry.get("version") {
                None | Some(Value::Null) => None,
                Some(v) => Some(v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(
                    || {
                        invalid(format!(
                            "{file}: entry {var}: version must be a u32 or null"
                        ))
                    },
                )?),
            };
        if entries.iter().any(|e| e.var == var) {
            return Err(invalid(format!("{file}: var {var} appears twice")));
        }
        entries.push(ManifestEntry {
            var,
            path,
            kind,
            version,
        });
    }
    Ok(SecretsManifest {
        vault_mode,
        entries,
    })
}

pub(crate) fn parse_meta(bytes: Option<&[u8]>) -> Result<BundleMeta, BundleError> {
    let Some(bytes) = bytes else {
        return Ok(BundleMeta::default());
    };
    let file = META_FILE;
    let map = object(file, bytes)?;
    let agent = match map.get("agent") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(a)) => a.clone(),
        Some(_) => return Err(invalid(format!("{file}: agent must be an object"))),
    };
    // The top level wins over `agent`, field by field.
    let either = |key: &str| match map.get(key) {
        None | Some(Value::Null) => agent.get(key).filter(|v| !v.is_null()),
        v => v,
    };
    let flag = |key: &str| match either(key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(invalid(format!("{file}: {key} must be true or false"))),
    };
    let disk_need_bytes = match either("disk_need_bytes") {
        None => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            invalid(format!(
                "{file}: disk_need_bytes must be a non-negative integer"
            ))
        })?),
    };
    let renderer = opt_str(&map, "renderer", file)?.unwrap_or_else(|| "compose".into());
    if renderer != "compose" {
        return Err(BundleError::new(
            codes::RENDERER_UNSUPPORTED,
            format!("renderer {renderer:?}: only compose is supported"),
        ));
    }
    let tier = opt_str(&map, "tier", file)?;
    Ok(BundleMeta {
        env_id: opt_str(&map, "env_id", file)?,
        prod: tier.as_deref() == Some("prod"),
        tier,
        allow_privileged: flag("allow_privileged")?,
        allow_rollback: flag("allow_rollback")?,
        disk_need_bytes,
        renderer,
    })
}
