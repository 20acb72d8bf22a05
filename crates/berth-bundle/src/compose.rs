//! The privilege check on the compose file: what would give a container the host. Run before
//! anything is written, unless `bundle.json` allows privileged services.

use std::collections::BTreeSet;

use berth_proto::error::codes;
use serde_yaml_ng::Value;

use crate::{BundleError, Files};

/// The compose file names the agent accepts, in the order it looks for them.
pub const COMPOSE_FILES: [&str; 4] = [
    "docker-compose.yml",
    "compose.yaml",
    "docker-compose.yaml",
    "compose.yml",
];

/// Why `service` would run with host privileges, if it would.
fn privileged_reason(service: &Value) -> Option<String> {
    let field = |key: &str| service.get(key);
    // A `${VAR}` in one of these fields is decided by the `.env` at `up` time, which the bundle
    // itself supplies: refused like the value it could become.
    let interpolated = |v: &Value| matches!(v, Value::String(s) if s.contains('$'));
    if let Some(v) = field("privileged") {
        let on = match v {
            Value::Bool(b) => *b,
            Value::String(s) => s.eq_ignore_ascii_case("true") || s.contains('$'),
            _ => false,
        };
        if on {
            return Some("privileged: true".into());
        }
    }
    if let Some(Value::Sequence(caps)) = field("cap_add") {
        for cap in caps {
            if let Value::String(c) = cap {
                let c = c.to_ascii_uppercase();
                let c = c.strip_prefix("CAP_").unwrap_or(&c);
                if c == "ALL" || c == "SYS_ADMIN" || interpolated(cap) {
                    return Some(format!("cap_add {c}"));
                }
            }
        }
    } else if field("cap_add").is_some_and(interpolated) {
        return Some("cap_add from a variable".into());
    }
    for key in ["pid", "network_mode"] {
        if let Some(Value::String(mode)) = field(key) {
            if mode.eq_ignore_ascii_case("host") || mode.contains('$') {
                return Some(format!("{key}: {mode}"));
            }
        }
    }
    None
}

/// `PRIVILEGED_FORBIDDEN` naming the first service that asks for host privileges, in the compose
/// file or in any file it pulls in (`include`, a service's `extends.file`). Those must be
/// members of the bundle: a reference to a file outside it could bring in anything, so it is
/// refused as well.
pub(crate) fn check(compose_file: &str, files: &Files) -> Result<(), BundleError> {
    let mut seen = BTreeSet::new();
    let mut queue = vec![compose_file.to_string()];
    while let Some(file) = queue.pop() {
        if !seen.insert(file.clone()) {
            continue;
        }
        let yaml = files.get(&file).map(Vec::as_slice).unwrap_or_default();
        queue.extend(check_one(&file, yaml, files)?);
    }
    Ok(())
}

fn forbidden(detail: String) -> BundleError {
    BundleError::new(codes::PRIVILEGED_FORBIDDEN, detail)
}

/// Checks one file's services; returns the bundle members it pulls in.
fn check_one(file: &str, yaml: &[u8], files: &Files) -> Result<Vec<String>, BundleError> {
    let mut doc: Value = serde_yaml_ng::from_slice(yaml)
        .map_err(|e| BundleError::new(codes::BUNDLE_INVALID, format!("{file} is not YAML: {e}")))?;
    // `<<: *anchor` would otherwise hide a privileged block from the check.
    doc.apply_merge()
        .map_err(|e| BundleError::new(codes::BUNDLE_INVALID, format!("{file}: merge keys: {e}")))?;
    let mut pulled = Vec::new();
    let mut reference = |what: &str, path: &Value| -> Result<(), BundleError> {
        let member = path
            .as_str()
            .and_then(|p| crate::name::normalise(p.as_bytes()).ok())
            .filter(|m| files.contains_key(m))
            .ok_or_else(|| {
                forbidden(format!(
                    "{file}: {what} {path:?} is not a file of the bundle"
                ))
            })?;
        pulled.push(member);
        Ok(())
    };
    match doc.get("include") {
        None | Some(Value::Null) => {}
        Some(Value::Sequence(items)) => {
            for item in items {
                match item.get("path") {
                    Some(Value::Sequence(paths)) => {
                        for p in paths {
                            reference("include", p)?;
                        }
                    }
                    Some(p) => reference("include", p)?,
                    None => reference("include", item)?,
                }
            }
        }
        Some(other) => reference("include", other)?,
    }
    let Some(Value::Mapping(services)) = doc.get("services") else {
        return Ok(pulled);
    };
    for (name, service) in services {
        let name = name.as_str().unwrap_or("?");
        if let Some(why) = privileged_reason(service) {
            return Err(forbidden(format!(
                "service {name}: {why}, and bundle.json does not allow_privileged"
            )));
        }
        if let Some(extends_file) = service.get("extends").and_then(|e| e.get("file")) {
            reference(&format!("service {name} extends"), extends_file)?;
        }
    }
    Ok(pulled)
}
