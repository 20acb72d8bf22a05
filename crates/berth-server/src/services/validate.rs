//! Input rules shared by every service: names, labels and agent versions, each refused with a
//! stable code before anything is stored.
use std::collections::BTreeMap;

use berth_proto::error::codes;

use crate::infra::error::{ApiError, ApiResult};

/// Names of tenants, agents, environments and tokens: 1–63 of `[A-Za-z0-9._-]`, starting with
/// a letter or digit, so they are safe in URLs, file names and log lines.
pub fn validate_name(what: &str, name: &str) -> ApiResult<()> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if ok {
        Ok(())
    } else {
        Err(ApiError::unprocessable(codes::INVALID_REQUEST,
            format!("{what} must be 1-63 characters of A-Z a-z 0-9 . _ - starting with a letter or digit"),
        ))
    }
}

/// The version an agent reports (at registration and with each session): 1–50 printable ASCII
/// characters, no spaces, so it is safe in a log line.
pub fn validate_agent_version(version: &str) -> ApiResult<()> {
    if !version.is_empty() && version.len() <= 50 && version.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(())
    } else {
        Err(ApiError::unprocessable(
            codes::INVALID_REQUEST,
            "version must be 1-50 printable ASCII characters without spaces",
        ))
    }
}

/// At most 64 labels; keys like names (plus `/`), values up to 255 printable characters.
pub fn validate_labels(labels: &BTreeMap<String, String>) -> ApiResult<()> {
    let invalid = |detail: String| ApiError::unprocessable(codes::INVALID_REQUEST, detail);
    if labels.len() > 64 {
        return Err(invalid("at most 64 labels".into()));
    }
    for (k, v) in labels {
        let key_ok = !k.is_empty()
            && k.len() <= 63
            && k.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'));
        if !key_ok {
            return Err(invalid(format!(
                "label key {k:?} must be 1-63 of A-Z a-z 0-9 . _ - /"
            )));
        }
        if v.len() > 255 {
            return Err(invalid(format!("label {k:?} has a value over 255 bytes")));
        }
        if let Some(c) = v.chars().find(|c| berth_proto::task::is_deceptive_char(*c)) {
            return Err(ApiError::unprocessable(codes::INVALID_LABEL,
                format!(
                    "label {k:?} has a control, bidi-override or zero-width character (U+{:04X}) in its value",
                    u32::from(c)
                ),
            ));
        }
    }
    Ok(())
}

/// A list's `cursor` query parameter: the last id of the previous page. Anything else is
/// `400 INVALID_REQUEST`, as every malformed query parameter is.
pub fn cursor<T: std::str::FromStr>(
    cursor: Option<&str>,
) -> crate::infra::error::ApiResult<Option<T>> {
    cursor
        .map(|c| {
            c.parse().map_err(|_| {
                crate::infra::error::ApiError::bad_request(
                    berth_proto::error::codes::INVALID_REQUEST,
                    "invalid cursor",
                )
            })
        })
        .transpose()
}
