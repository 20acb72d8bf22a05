//! The one rule for a member name, shared by `read_tar`, `build_dir` and `write_to`: relative,
//! '/'-separated, UTF-8, no `..`, no backslash, NUL or control character. Empty and `.`
//! components are harmless and dropped (`./a//b` is `a/b`); everything else is refused, never
//! repaired.

use berth_proto::error::codes;

use crate::BundleError;

/// Why a name that normalises to nothing is refused (a directory entry may be the root).
pub(crate) const EMPTY: &str = "name is empty";

/// The normal form of `raw`, or why it is unsafe (the caller names the member).
pub(crate) fn normalise(raw: &[u8]) -> Result<String, String> {
    let name = std::str::from_utf8(raw).map_err(|_| "name is not UTF-8".to_string())?;
    if name.contains('\0') {
        return Err("name contains NUL".into());
    }
    if name.contains('\\') {
        return Err("name contains a backslash".into());
    }
    if name.chars().any(|c| c.is_control()) {
        return Err("name contains a control character".into());
    }
    if name.starts_with('/') {
        return Err("absolute path".into());
    }
    let mut parts = Vec::new();
    for part in name.split('/') {
        match part {
            "" | "." => {}
            ".." => return Err("path has a `..` component".into()),
            p => parts.push(p),
        }
    }
    if parts.is_empty() {
        return Err(EMPTY.into());
    }
    Ok(parts.join("/"))
}

/// `normalise` as a `BUNDLE_UNSAFE` naming the member (lossily, since it may not be UTF-8).
pub(crate) fn checked(raw: &[u8]) -> Result<String, BundleError> {
    normalise(raw).map_err(|why| unsafe_member(&String::from_utf8_lossy(raw), &why))
}

pub(crate) fn unsafe_member(name: &str, why: &str) -> BundleError {
    BundleError::new(codes::BUNDLE_UNSAFE, format!("member {name:?}: {why}"))
}

#[cfg(test)]
mod tests {
    use super::normalise;

    #[test]
    fn harmless_forms_are_normalised_and_the_rest_refused() {
        assert_eq!(normalise(b"./a//b/.").unwrap(), "a/b");
        assert_eq!(normalise(b"dir/").unwrap(), "dir");
        for bad in [
            &b"/etc/passwd"[..],
            b"a/../../x",
            b"..",
            b"a\\b",
            b"a\0b",
            b"a\nb",
            b"",
            b"./",
            b"\xff",
        ] {
            assert!(normalise(bad).is_err(), "{bad:?} accepted");
        }
    }
}
