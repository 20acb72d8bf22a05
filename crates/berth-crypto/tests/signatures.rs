//! Result signatures: AgentKey signs; ResultVerifier (and its one-shot form verify_with_cert)
//! checks with the agent certificate's key.

use berth_crypto::{verify_with_cert, AgentKey, Ca, CryptoError, ResultVerifier};
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

#[test]
fn one_result_verifier_checks_many_results() {
    let key = AgentKey::generate().unwrap();
    let cert = agent_cert(&key);
    let verifier = ResultVerifier::from_cert(&cert).unwrap();
    let messages: Vec<Vec<u8>> = (0..50)
        .map(|i| format!(r#"{{"agentId":"a","message":"result {i}"}}"#).into_bytes())
        .collect();
    let sigs: Vec<Vec<u8>> = messages.iter().map(|m| key.sign(m).unwrap()).collect();
    // Twice over, in two orders: the verifier holds no per-message state.
    for _ in 0..2 {
        for (m, s) in messages.iter().zip(&sigs) {
            verifier.verify("ecdsa-sha256", m, s).unwrap();
        }
        for (m, s) in messages.iter().zip(&sigs).rev() {
            verifier.verify("ecdsa-sha256", m, s).unwrap();
        }
    }
    // Another message's signature, a flipped bit in the message or the signature.
    assert!(matches!(
        verifier.verify("ecdsa-sha256", &messages[0], &sigs[1]),
        Err(CryptoError::BadSignature)
    ));
    let mut flipped = messages[3].clone();
    flipped[7] ^= 0x01;
    assert!(matches!(
        verifier.verify("ecdsa-sha256", &flipped, &sigs[3]),
        Err(CryptoError::BadSignature)
    ));
    let mut bad_sig = sigs[3].clone();
    let last = bad_sig.len() - 1;
    bad_sig[last] ^= 0x80;
    assert!(verifier
        .verify("ecdsa-sha256", &messages[3], &bad_sig)
        .is_err());
    // The wrong algorithm for this key, and names that are not algorithms.
    assert!(matches!(
        verifier.verify("rsa-sha256", &messages[0], &sigs[0]),
        Err(CryptoError::KeyAlgorithmMismatch { .. })
    ));
    for alg in ["", "none", "ECDSA-SHA256", "es256", "ecdsa-sha256 "] {
        assert!(
            matches!(
                verifier.verify(alg, &messages[0], &sigs[0]),
                Err(CryptoError::UnsupportedAlgorithm(_))
            ),
            "{alg:?}"
        );
    }
    // A refusal leaves the verifier as it was.
    verifier
        .verify("ecdsa-sha256", &messages[0], &sigs[0])
        .unwrap();
}

#[test]
fn result_verifier_agrees_with_verify_with_cert() {
    let key = AgentKey::generate().unwrap();
    let ec_cert = agent_cert(&key);
    let ec_sig = key.sign(MSG).unwrap();
    let rsa = KeyPair::generate_rsa_for(&PKCS_RSA_SHA256, RsaKeySize::_2048).unwrap();
    let rsa_cert = CertificateParams::new(vec!["rsa-agent".to_string()])
        .unwrap()
        .self_signed(&rsa)
        .unwrap()
        .der()
        .to_vec();
    let rsa_sig = rsa.sign(MSG).unwrap();
    let p384 = KeyPair::generate_for(&PKCS_ECDSA_P384_SHA384).unwrap();
    let p384_cert = CertificateParams::new(vec!["x".to_string()])
        .unwrap()
        .self_signed(&p384)
        .unwrap()
        .der()
        .to_vec();
    let p384_sig = p384.sign(MSG).unwrap();

    let outcome = |r: Result<(), CryptoError>| match r {
        Ok(()) => "ok".to_string(),
        Err(e) => e.to_string(),
    };
    for cert in [&ec_cert, &rsa_cert, &p384_cert] {
        let verifier = ResultVerifier::from_cert(cert).unwrap();
        for alg in ["ecdsa-sha256", "rsa-sha256", "ecdsa-sha384"] {
            for sig in [&ec_sig, &rsa_sig, &p384_sig] {
                for msg in [MSG, b"other message"] {
                    assert_eq!(
                        outcome(verifier.verify(alg, msg, sig)),
                        outcome(verify_with_cert(cert, alg, msg, sig)),
                        "{alg} {verifier:?}"
                    );
                }
            }
        }
    }
    let rsa_verifier = ResultVerifier::from_cert(&rsa_cert).unwrap();
    rsa_verifier.verify("rsa-sha256", MSG, &rsa_sig).unwrap();
    assert!(matches!(
        rsa_verifier.verify("ecdsa-sha256", MSG, &rsa_sig),
        Err(CryptoError::KeyAlgorithmMismatch { .. })
    ));
    let p384_verifier = ResultVerifier::from_cert(&p384_cert).unwrap();
    assert!(matches!(
        p384_verifier.verify("ecdsa-sha256", MSG, &p384_sig),
        Err(CryptoError::KeyAlgorithmMismatch { .. })
    ));
}

#[test]
fn result_verifier_refuses_garbage_certificates_and_is_shareable() {
    for cert in [&b""[..], b"junk", &[0x30, 0x82, 0xff, 0xff]] {
        assert!(matches!(
            ResultVerifier::from_cert(cert),
            Err(CryptoError::InvalidCertificate(_))
        ));
    }
    // verify_with_cert still names an unknown algorithm before looking at the certificate.
    assert!(matches!(
        verify_with_cert(b"junk", "none", MSG, b"sig"),
        Err(CryptoError::UnsupportedAlgorithm(_))
    ));
    fn send_sync<T: Send + Sync>() {}
    send_sync::<ResultVerifier>();
}
