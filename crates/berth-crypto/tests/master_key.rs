//! The master key's AEAD envelope.

use berth_crypto::{CryptoError, MasterKey};

#[test]
fn seal_open_round_trip() {
    let key = MasterKey::generate();
    for plain in [&b""[..], b"x", &[7u8; 10_000]] {
        let sealed = key.seal(plain, b"tenant/default/secret/db@3").unwrap();
        assert_eq!(sealed.len(), 12 + plain.len() + 16);
        assert_eq!(
            key.open(&sealed, b"tenant/default/secret/db@3").unwrap(),
            plain
        );
    }
    // Fresh nonce each time.
    assert_ne!(
        key.seal(b"same", b"").unwrap(),
        key.seal(b"same", b"").unwrap()
    );

    let copy = MasterKey::from_bytes(key.as_bytes()).unwrap();
    let sealed = key.seal(b"secret", b"aad").unwrap();
    assert_eq!(copy.open(&sealed, b"aad").unwrap(), b"secret");
}

#[test]
fn wrong_aad_wrong_key_and_tampering_are_refused() {
    let key = MasterKey::generate();
    let sealed = key.seal(b"hunter2", b"secret/a@1").unwrap();
    assert!(matches!(
        key.open(&sealed, b"secret/b@1"),
        Err(CryptoError::Open)
    ));
    assert!(matches!(key.open(&sealed, b""), Err(CryptoError::Open)));
    assert!(matches!(
        MasterKey::generate().open(&sealed, b"secret/a@1"),
        Err(CryptoError::Open)
    ));
    for i in 0..sealed.len() {
        let mut t = sealed.clone();
        t[i] ^= 0x80;
        assert!(
            matches!(key.open(&t, b"secret/a@1"), Err(CryptoError::Open)),
            "byte {i}"
        );
    }
    for len in 0..sealed.len() {
        assert!(
            key.open(&sealed[..len], b"secret/a@1").is_err(),
            "len {len}"
        );
    }
    let mut longer = sealed.clone();
    longer.push(0);
    assert!(key.open(&longer, b"secret/a@1").is_err());
}

#[test]
fn key_length_is_enforced_and_debug_is_redacted() {
    assert!(MasterKey::from_bytes(&[0; 31]).is_err());
    assert!(MasterKey::from_bytes(&[0; 33]).is_err());
    assert!(MasterKey::from_bytes(&[]).is_err());
    let key = MasterKey::from_bytes(&[0xab; 32]).unwrap();
    assert_eq!(format!("{key:?}"), "MasterKey(..)");
    assert_ne!(
        MasterKey::generate().as_bytes(),
        MasterKey::generate().as_bytes()
    );
}
