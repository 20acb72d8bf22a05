//! Digests, fingerprints and random tokens. Tokens are shown once and stored only as
//! `hash_token` output; nothing here keeps or logs a token.

use aws_lc_rs::digest;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;

/// SHA-256 of `data`.
pub fn sha256(data: &[u8]) -> [u8; 32] {
    let d = digest::digest(&digest::SHA256, data);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// HMAC-SHA256 of `data` under `key`: how the server signs a webhook delivery.
pub fn hmac_sha256(key: &[u8], data: &[u8]) -> [u8; 32] {
    use aws_lc_rs::hmac;
    let tag = hmac::sign(&hmac::Key::new(hmac::HMAC_SHA256, key), data);
    let mut out = [0u8; 32];
    out.copy_from_slice(tag.as_ref());
    out
}

/// Lowercase hex SHA-256 of `data`.
pub fn sha256_hex(data: &[u8]) -> String {
    hex::encode(sha256(data))
}

/// Lowercase hex SHA-256 of everything `reader` yields (a file of any size, read in chunks).
pub fn sha256_hex_reader(mut reader: impl std::io::Read) -> std::io::Result<String> {
    let mut context = digest::Context::new(&digest::SHA256);
    let mut buf = vec![0u8; 256 * 1024];
    loop {
        match reader.read(&mut buf)? {
            0 => return Ok(hex::encode(context.finish().as_ref())),
            n => context.update(&buf[..n]),
        }
    }
}

/// `sha256:<lowercase hex>` of a DER certificate: the form pinned by agents and stored as the
/// certificate binding.
pub fn fingerprint(der: &[u8]) -> String {
    format!("sha256:{}", sha256_hex(der))
}

/// `prefix` + base64url (no padding) of 32 random bytes, e.g. `reg_…`, `bat_…`.
pub fn random_token(prefix: &str) -> String {
    let bytes: [u8; 32] = random_bytes();
    format!("{prefix}{}", URL_SAFE_NO_PAD.encode(bytes))
}

/// What the database stores for a token: lowercase hex SHA-256 of its bytes. Tokens carry 256
/// bits of entropy, so an unsalted fast hash is enough and keeps lookups by hash possible.
pub fn hash_token(token: &str) -> String {
    sha256_hex(token.as_bytes())
}

#[cfg(test)]
#[test]
fn hmac_sha256_matches_rfc_4231_case_2() {
    assert_eq!(
        hex::encode(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    );
}

/// `N` bytes from the system CSPRNG.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    // Invariant: aws-lc's RNG only fails when the OS entropy source is gone; no caller can do
    // anything sensible with weak or missing randomness, so stopping is the safe outcome.
    #[allow(clippy::expect_used)]
    aws_lc_rs::rand::fill(&mut out).expect("system random number generator failed");
    out
}

/// A uniform random number in [0, 1), for jitter: 53 random bits, a double's precision.
pub fn random_unit() -> f64 {
    (u64::from_le_bytes(random_bytes::<8>()) >> 11) as f64 / (1u64 << 53) as f64
}
