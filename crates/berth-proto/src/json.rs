//! Numbers that survive the trip: berth parses JSON into `serde_json::Value` without
//! `arbitrary_precision` (which would change number handling everywhere, signing included), so
//! an integer outside `i64`/`u64` becomes a float and a float with more digits than an `f64`
//! holds is rounded. [`check_numbers`] reads the request's text and names the first number whose
//! parsed value would not print back as the same number, so the server can refuse it instead of
//! handing the host a different one. [`jcs_without`] is the canonical form a result signature
//! and an audit hash cover.

/// RFC 8785 (JCS) bytes of `value` without its member `member`: what a signature or a hash
/// covers when it travels inside the object it covers.
pub(crate) fn jcs_without(
    value: &serde_json::Value,
    member: &str,
) -> Result<Vec<u8>, serde_json::Error> {
    let mut rest = value.clone();
    if let Some(object) = rest.as_object_mut() {
        object.remove(member);
    }
    serde_jcs::to_vec(&rest)
}

/// The bytes a signature covers: JCS of the signed object without its `signature` member (a
/// task result's envelope, a signed heartbeat).
pub fn signing_input(envelope: &serde_json::Value) -> Result<Vec<u8>, serde_json::Error> {
    jcs_without(envelope, "signature")
}

/// Checks every number in `text`, which must already have parsed as JSON (anything else passes
/// here and is the parser's to refuse). The error names the number's JSON pointer.
pub fn check_numbers(text: &str) -> Result<(), String> {
    let mut scan = Scan {
        bytes: text.as_bytes(),
        at: 0,
        path: Vec::new(),
    };
    scan.value()
}

struct Scan<'a> {
    bytes: &'a [u8],
    at: usize,
    path: Vec<String>,
}

impl Scan<'_> {
    fn skip_ws(&mut self) {
        while self.at < self.bytes.len() && self.bytes[self.at].is_ascii_whitespace() {
            self.at += 1;
        }
    }

    fn pointer(&self) -> String {
        if self.path.is_empty() {
            return "/".into();
        }
        self.path
            .iter()
            .map(|p| format!("/{}", p.replace('~', "~0").replace('/', "~1")))
            .collect()
    }

    fn value(&mut self) -> Result<(), String> {
        self.skip_ws();
        match self.bytes.get(self.at) {
            Some(b'{') => {
                self.at += 1;
                loop {
                    self.skip_ws();
                    match self.bytes.get(self.at) {
                        Some(b'}') | None => {
                            self.at += 1;
                            return Ok(());
                        }
                        Some(b',') => self.at += 1,
                        Some(b'"') => {
                            let key = self.string();
                            self.skip_ws();
                            self.at += 1; // ':'
                            self.path.push(key);
                            self.value()?;
                            self.path.pop();
                        }
                        Some(_) => return Ok(()),
                    }
                }
            }
            Some(b'[') => {
                self.at += 1;
                let mut index = 0usize;
                loop {
                    self.skip_ws();
                    match self.bytes.get(self.at) {
                        Some(b']') | None => {
                            self.at += 1;
                            return Ok(());
                        }
                        Some(b',') => self.at += 1,
                        Some(_) => {
                            self.path.push(index.to_string());
                            let before = self.at;
                            self.value()?;
                            self.path.pop();
                            if self.at == before {
                                return Ok(()); // not JSON: the parser refuses it
                            }
                            index += 1;
                        }
                    }
                }
            }
            Some(b'"') => {
                self.string();
                Ok(())
            }
            Some(b'-' | b'0'..=b'9') => {
                let start = self.at;
                while self.at < self.bytes.len()
                    && matches!(
                        self.bytes[self.at],
                        b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'
                    )
                {
                    self.at += 1;
                }
                let token = std::str::from_utf8(&self.bytes[start..self.at]).unwrap_or("");
                if lossless(token) {
                    Ok(())
                } else {
                    Err(format!(
                        "the number at {} ({}) cannot be carried exactly: integers must fit 64 bits \
                         and decimals an f64; send it as a string",
                        self.pointer(),
                        token.chars().take(40).collect::<String>()
                    ))
                }
            }
            Some(_) => {
                // true, false, null
                while self.at < self.bytes.len() && self.bytes[self.at].is_ascii_alphabetic() {
                    self.at += 1;
                }
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Reads a string at `"`, returning its text (escapes decoded well enough to name a key).
    fn string(&mut self) -> String {
        let start = self.at;
        self.at += 1;
        while self.at < self.bytes.len() {
            match self.bytes[self.at] {
                b'\\' => self.at += 2,
                b'"' => {
                    self.at += 1;
                    break;
                }
                _ => self.at += 1,
            }
        }
        let raw = &self.bytes[start..self.at.min(self.bytes.len())];
        serde_json::from_slice::<String>(raw)
            .unwrap_or_else(|_| String::from_utf8_lossy(raw).into_owned())
    }
}

/// Whether serde_json's value for `token` prints back as the same number.
fn lossless(token: &str) -> bool {
    if !token.contains(['.', 'e', 'E']) {
        return token.parse::<i64>().is_ok() || token.parse::<u64>().is_ok();
    }
    let Ok(value) = serde_json::from_str::<f64>(token) else {
        return false;
    };
    if !value.is_finite() {
        return false;
    }
    let Ok(printed) = serde_json::to_string(&value) else {
        return false;
    };
    matches!((decimal(token), decimal(&printed)), (Some(a), Some(b)) if a == b)
}

/// `token` as (negative, significant digits, exponent of the last digit); zero is
/// `(false, "", 0)`.
fn decimal(token: &str) -> Option<(bool, String, i64)> {
    let (mantissa, exp) = match token.find(['e', 'E']) {
        Some(i) => (&token[..i], token[i + 1..].parse::<i64>().ok()?),
        None => (token, 0),
    };
    let (negative, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let mut exp = exp.checked_sub(i64::try_from(frac.len()).ok()?)?;
    let all = format!("{int}{frac}");
    let trimmed = all.trim_start_matches('0');
    let digits = trimmed.trim_end_matches('0');
    if digits.is_empty() {
        return Some((false, String::new(), 0));
    }
    exp = exp.checked_add(i64::try_from(trimmed.len() - digits.len()).ok()?)?;
    Some((negative, digits.to_string(), exp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_numbers_pass() {
        let ok = r#"{"a": [1, -2, 0, -0, 0.1, 1.5e3, 1E2, 2.50, 9223372036854775807,
            18446744073709551615, -9223372036854775808, 1e-7, 268435456, 3.141592653589793],
            "s": "123456789012345678901234567890 \" 1e999", "t": true, "n": null}"#;
        assert_eq!(check_numbers(ok), Ok(()));
    }

    #[test]
    fn inexact_numbers_are_named_by_pointer() {
        let cases = [
            (
                r#"{"payload": {"n": 123456789012345678901234567890}}"#,
                "/payload/n",
            ),
            (r#"{"a": [1, 18446744073709551616]}"#, "/a/1"),
            (r#"{"a": -9223372036854775809}"#, "/a"),
            (r#"{"x/y": 0.1000000000000000000001}"#, "/x~1y"),
            (
                r#"{"a": {"b": [[], {"c": 1.00000000000000000001}]}}"#,
                "/a/b/1/c",
            ),
            ("123456789012345678901234567890", "/"),
        ];
        for (text, pointer) in cases {
            assert!(
                serde_json::from_str::<serde_json::Value>(text).is_ok(),
                "{text}"
            );
            let err = check_numbers(text).unwrap_err();
            assert!(err.contains(&format!("at {pointer} (")), "{text}: {err}");
        }
    }
}
