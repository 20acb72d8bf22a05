//! Redaction: secret values never leave an executor in logs, messages or outputs.

use std::collections::BTreeMap;

const MASK: &str = "***";

/// Replaces every occurrence of every credential value (of 4 or more characters, so that short
/// values do not shred the log) with `***`.
pub fn redact(text: &str, credentials: &BTreeMap<String, String>) -> String {
    let mut secrets: Vec<&str> = credentials
        .values()
        .map(String::as_str)
        .filter(|v| v.len() >= 4)
        .collect();
    // Longest first, so a secret that contains another is masked whole.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    let mut out = text.to_string();
    for secret in secrets {
        if out.contains(secret) {
            out = out.replace(secret, MASK);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_every_occurrence_longest_first() {
        let creds = BTreeMap::from([
            ("password".to_string(), "hunter22".to_string()),
            ("token".to_string(), "hunter22-extended".to_string()),
            ("short".to_string(), "ab".to_string()),
        ]);
        let text = "login hunter22 then hunter22-extended; ab stays";
        assert_eq!(redact(text, &creds), "login *** then ***; ab stays");
    }
}
