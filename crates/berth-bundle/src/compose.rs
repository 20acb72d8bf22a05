//! The privilege check on the compose file: what would give a container the host. Run before
//! anything is written, unless `bundle.json` allows privileged services.

use berth_proto::error::codes;
use serde_yaml_ng::Value;

use crate::BundleError;

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

/// `PRIVILEGED_FORBIDDEN` naming the first service that asks for host privileges.
pub(crate) fn check(compose_file: &str, yaml: &[u8]) -> Result<(), BundleError> {
    let mut doc: Value = serde_yaml_ng::from_slice(yaml).map_err(|e| {
        BundleError::new(
            codes::BUNDLE_INVALID,
            format!("{compose_file} is not YAML: {e}"),
        )
    })?;
    // `<<: *anchor` would otherwise hide a privileged block from the check.
    doc.apply_merge().map_err(|e| {
        BundleError::new(
            codes::BUNDLE_INVALID,
            format!("{compose_file}: merge keys: {e}"),
        )
    })?;
    let Some(Value::Mapping(services)) = doc.get("services") else {
        return Ok(());
    };
    for (name, service) in services {
        if let Some(why) = privileged_reason(service) {
            let name = name.as_str().unwrap_or("?");
            return Err(BundleError::new(
                codes::PRIVILEGED_FORBIDDEN,
                format!("service {name}: {why}, and bundle.json does not allow_privileged"),
            ));
        }
    }
    Ok(())
}
