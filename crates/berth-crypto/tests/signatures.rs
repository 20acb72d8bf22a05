//! Result signatures: AgentKey signs, verify_with_cert checks with the agent certificate's key.

use berth_crypto::{verify_with_cert, AgentKey, Ca, CryptoError};
use rcgen::{
    CertificateParams, KeyPair, RsaKeySize, SigningKey, PKCS_ECDSA_P384_SHA384, PKCS_RSA_SHA256,
};
use time::macros::datetime;
use time::Duration;
use uuid::Uuid;

const MSG: &[u8] = br#"{"agentId":"a","contractVersion":"agent-task-transport/v1","signatureAlgorithm":"ecdsa-sha256"}"#;

fn agent_cert(key: &AgentKey) -> Vec<u8> {
    let now = datetime!(2025-06-01 12:00 UTC);
    let ca = Ca::generate("ca", now).unwrap();
    ca.sign_agent_csr(
        &key.csr_pem("agent").unwrap(),
        Uuid::new_v4(),
        now,
        Duration::days(30),
    )
    .unwrap()
    .cert_der
}

#[test]
fn agent_signature_verifies_with_its_certificate() {
    let key = AgentKey::generate().unwrap();
    let cert = agent_cert(&key);
    let sig = key.sign(MSG).unwrap();
    // ASN.1 DER: a SEQUENCE of two INTEGERs.
    assert_eq!(sig[0], 0x30);
    verify_with_cert(&cert, "ecdsa-sha256", MSG, &sig).unwrap();
}

#[test]
fn agent_key_round_trips_through_pem() {
    let key = AgentKey::generate().unwrap();
    let cert = agent_cert(&key);
    let reloaded = AgentKey::from_pem(&key.to_pem()).unwrap();
    assert_eq!(reloaded.to_pem(), key.to_pem());
    verify_with_cert(&cert, "ecdsa-sha256", MSG, &reloaded.sign(MSG).unwrap()).unwrap();
    assert!(matches!(
        AgentKey::from_pem("garbage"),
        Err(CryptoError::InvalidPem(_))
    ));
    let p384 = KeyPair::generate_for(&PKCS_ECDSA_P384_SHA384).unwrap();
    assert!(matches!(
        AgentKey::from_pem(&p384.serialize_pem()),
        Err(CryptoError::InvalidKey(_))
    ));
    assert_eq!(format!("{key:?}"), "AgentKey(..)");
}

#[test]
fn every_flipped_bit_is_refused() {
    let key = AgentKey::generate().unwrap();
    let cert = agent_cert(&key);
    let sig = key.sign(MSG).unwrap();
    for i in 0..MSG.len() * 8 {
        let mut msg = MSG.to_vec();
        msg[i / 8] ^= 1 << (i % 8);
        assert!(matches!(
            verify_with_cert(&cert, "ecdsa-sha256", &msg, &sig),
            Err(CryptoError::BadSignature)
        ));
    }
    for i in 0..sig.len() * 8 {
        let mut s = sig.clone();
        s[i / 8] ^= 1 << (i % 8);
        assert!(
            verify_with_cert(&cert, "ecdsa-sha256", MSG, &s).is_err(),
            "bit {i} of the signature"
        );
    }
    assert!(verify_with_cert(&cert, "ecdsa-sha256", MSG, &[]).is_err());
    assert!(verify_with_cert(&cert, "ecdsa-sha256", MSG, &sig[..sig.len() - 1]).is_err());
}

#[test]
fn signature_by_another_key_is_refused() {
    let key = AgentKey::generate().unwrap();
    let cert = agent_cert(&key);
    let other = AgentKey::generate().unwrap();
    assert!(matches!(
        verify_with_cert(&cert, "ecdsa-sha256", MSG, &other.sign(MSG).unwrap()),
        Err(CryptoError::BadSignature)
    ));
}

#[test]
fn unknown_algorithm_names_are_refused() {
    let key = AgentKey::generate().unwrap();
    let cert = agent_cert(&key);
    let sig = key.sign(MSG).unwrap();
    for alg in [
        "",
        "none",
        "ECDSA-SHA256",
        "ecdsa-sha384",
        "ecdsa",
        "es256",
        "ecdsa-sha256 ",
    ] {
        assert!(
            matches!(
                verify_with_cert(&cert, alg, MSG, &sig),
                Err(CryptoError::UnsupportedAlgorithm(_))
            ),
            "{alg:?}"
        );
    }
}

#[test]
fn rsa_sha256_verifies_with_an_rsa_certificate() {
    let rsa = KeyPair::generate_rsa_for(&PKCS_RSA_SHA256, RsaKeySize::_2048).unwrap();
    let cert = CertificateParams::new(vec!["rsa-agent".to_string()])
        .unwrap()
        .self_signed(&rsa)
        .unwrap();
    let cert = cert.der().to_vec();
    // rcgen signs with RSASSA-PKCS1-v1_5 / SHA-256 for PKCS_RSA_SHA256.
    let sig = rsa.sign(MSG).unwrap();
    verify_with_cert(&cert, "rsa-sha256", MSG, &sig).unwrap();

    let mut bad = sig.clone();
    bad[10] ^= 0x01;
    assert!(matches!(
        verify_with_cert(&cert, "rsa-sha256", MSG, &bad),
        Err(CryptoError::BadSignature)
    ));
    assert!(matches!(
        verify_with_cert(&cert, "rsa-sha256", b"other message", &sig),
        Err(CryptoError::BadSignature)
    ));
    // The RSA key cannot be used under the ECDSA name and vice versa.
    assert!(matches!(
        verify_with_cert(&cert, "ecdsa-sha256", MSG, &sig),
        Err(CryptoError::KeyAlgorithmMismatch { .. })
    ));
    let key = AgentKey::generate().unwrap();
    let ec_cert = agent_cert(&key);
    assert!(matches!(
        verify_with_cert(&ec_cert, "rsa-sha256", MSG, &key.sign(MSG).unwrap()),
        Err(CryptoError::KeyAlgorithmMismatch { .. })
    ));
}

#[test]
fn p384_certificate_is_not_ecdsa_sha256() {
    let p384 = KeyPair::generate_for(&PKCS_ECDSA_P384_SHA384).unwrap();
    let cert = CertificateParams::new(vec!["x".to_string()])
        .unwrap()
        .self_signed(&p384)
        .unwrap();
    let sig = p384.sign(MSG).unwrap();
    assert!(matches!(
        verify_with_cert(cert.der(), "ecdsa-sha256", MSG, &sig),
        Err(CryptoError::KeyAlgorithmMismatch { .. })
    ));
}

#[test]
fn garbage_certificates_are_refused() {
    let key = AgentKey::generate().unwrap();
    let sig = key.sign(MSG).unwrap();
    for cert in [&b""[..], b"junk", &[0x30, 0x82, 0xff, 0xff]] {
        assert!(matches!(
            verify_with_cert(cert, "ecdsa-sha256", MSG, &sig),
            Err(CryptoError::InvalidCertificate(_))
        ));
    }
}
