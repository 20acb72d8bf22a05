//! The `.env` render: `.env.template` with the manifest's secrets filled in. Values go in as
//! they are, in one pass (a value is never scanned again), and never into an error.

use std::collections::BTreeMap;

use berth_proto::error::codes;

use crate::{BundleError, SecretsManifest};

pub const TEMPLATE_FILE: &str = ".env.template";

pub(crate) fn render(
    template: Option<&[u8]>,
    manifest: &SecretsManifest,
    values: &BTreeMap<String, String>,
) -> Result<String, BundleError> {
    let missing: Vec<&str> = manifest
        .entries
        .iter()
        .map(|e| e.var.as_str())
        .filter(|v| !values.contains_key(*v))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    if !missing.is_empty() {
        return Err(BundleError::new(
            codes::ENV_INCOMPLETE,
            format!("unresolved: {}", missing.join(", ")),
        ));
    }
    let secret: BTreeMap<&str, &str> = manifest
        .entries
        .iter()
        .map(|e| (e.var.as_str(), values[&e.var].as_str()))
        .collect();
    for (var, value) in &secret {
        if value.contains(['\n', '\r', '\0']) {
            return Err(BundleError::new(
                codes::BUNDLE_INVALID,
                format!("the value of {var} contains a line break or NUL"),
            ));
        }
    }
    let template = match template {
        None => "",
        Some(bytes) => std::str::from_utf8(bytes).map_err(|_| {
            BundleError::new(
                codes::BUNDLE_INVALID,
                format!("{TEMPLATE_FILE} is not UTF-8"),
            )
        })?,
    };
    let mut used = std::collections::BTreeSet::new();
    let mut out = String::with_capacity(template.len());
    for line in template.split_inclusive('\n') {
        let (body, ending) = match line.strip_suffix("\r\n") {
            Some(b) => (b, "\r\n"),
            None => match line.strip_suffix('\n') {
                Some(b) => (b, "\n"),
                None => (line, ""),
            },
        };
        if let Some(var) = body.strip_suffix('=') {
            if let Some(value) = secret.get(var) {
                used.insert(var.to_string());
                out.push_str(body);
                out.push_str(value);
                out.push_str(ending);
                continue;
            }
        }
        substitute(body, &secret, &mut used, &mut out);
        out.push_str(ending);
    }
    for entry in &manifest.entries {
        if !used.contains(&entry.var) {
            if !out.is_empty() && !out.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(&entry.var);
            out.push('=');
            out.push_str(secret[entry.var.as_str()]);
            out.push('\n');
        }
    }
    Ok(out)
}

/// `line` with each `${VAR}` of a manifest var replaced, left to right, once.
fn substitute(
    line: &str,
    secret: &BTreeMap<&str, &str>,
    used: &mut std::collections::BTreeSet<String>,
    out: &mut String,
) {
    let mut rest = line;
    while let Some(start) = rest.find("${") {
        let after = &rest[start + 2..];
        match after.find('}').map(|end| (&after[..end], end)) {
            Some((var, end)) if secret.contains_key(var) => {
                out.push_str(&rest[..start]);
                out.push_str(secret[var]);
                used.insert(var.to_string());
                rest = &after[end + 1..];
            }
            _ => {
                out.push_str(&rest[..start + 2]);
                rest = after;
            }
        }
    }
    out.push_str(rest);
}
