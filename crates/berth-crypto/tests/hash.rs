//! Digests, fingerprints and tokens.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use berth_crypto::{fingerprint, hash_token, random_bytes, random_token, sha256, sha256_hex};

#[test]
fn sha256_known_answers() {
    assert_eq!(
        sha256_hex(b""),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    assert_eq!(
        sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    assert_eq!(hex::encode(sha256(b"abc")), sha256_hex(b"abc"));
    assert_eq!(
        fingerprint(b"abc"),
        "sha256:ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
}

#[test]
fn tokens_are_prefixed_random_and_hashed() {
    let a = random_token("reg_");
    let b = random_token("reg_");
    assert_ne!(a, b);
    let body = a.strip_prefix("reg_").unwrap();
    assert_eq!(URL_SAFE_NO_PAD.decode(body).unwrap().len(), 32);
    assert_eq!(body.len(), 43);
    assert!(random_token("bat_").starts_with("bat_"));
    assert_eq!(hash_token(&a), sha256_hex(a.as_bytes()));
    assert_ne!(hash_token(&a), hash_token(&b));
    let x: [u8; 16] = random_bytes();
    let y: [u8; 16] = random_bytes();
    assert_ne!(x, y);
    let empty: [u8; 0] = random_bytes();
    assert!(empty.is_empty());
}
