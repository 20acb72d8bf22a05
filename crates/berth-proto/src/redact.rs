//! The one redaction rule: secret values never leave an executor or the server's report rows
//! in logs, messages or outputs. The agent's executors mask a task's credentials with it, the
//! server masks a desired-state report with an environment's secrets.

/// What a secret value becomes.
pub const MASK: &str = "***";

/// Replaces every occurrence of every secret value with [`MASK`], whatever its length: a short
/// secret is still a secret (issue 11 item 8). Empty values mask nothing.
pub fn redact<S: AsRef<str>>(text: &str, secrets: impl IntoIterator<Item = S>) -> String {
    let secrets: Vec<S> = secrets
        .into_iter()
        .filter(|s| !s.as_ref().is_empty())
        .collect();
    let mut secrets: Vec<&str> = secrets.iter().map(AsRef::as_ref).collect();
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
    fn masks_every_occurrence_longest_first_short_ones_too() {
        let secrets = ["hunter22", "hunter22-extended", "ab", ""];
        let text = "login hunter22 then hunter22-extended; ab is masked too";
        assert_eq!(
            redact(text, secrets),
            "login *** then ***; *** is masked too"
        );
    }

    #[test]
    fn no_secrets_changes_nothing() {
        assert_eq!(redact("as is", Vec::<String>::new()), "as is");
    }
}
