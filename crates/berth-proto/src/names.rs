//! Names that are one URL path segment as they are: releases and environments follow one rule.
//! Kept apart from both so neither module has to reach into the other for it.

/// Release names: 1-128 of `A-Z a-z 0-9 . _ -`, starting with a letter or digit, so a name is
/// one URL path segment as it is (`/api/v1/releases/{name}`).
pub fn valid_release_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}
