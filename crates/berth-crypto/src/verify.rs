//! Signature verification with a certificate's public key, for signed task results.
//! It checks only the key and the signature; whether the certificate is the agent's current
//! binding, or still valid, is the caller's decision and must be made before calling this.

use aws_lc_rs::signature::{self, UnparsedPublicKey, VerificationAlgorithm};
use x509_parser::oid_registry::{
    OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_NIST_EC_P384, OID_PKCS1_RSAENCRYPTION,
};
use x509_parser::x509::SubjectPublicKeyInfo;

use crate::ca::parse_cert;
use crate::error::{CryptoError, Result};

/// `signatureAlgorithm` value for ECDSA P-256 over SHA-256, ASN.1 DER signature.
pub const ALG_ECDSA_SHA256: &str = "ecdsa-sha256";
/// `signatureAlgorithm` value for RSASSA-PKCS1-v1_5 over SHA-256 (2048..8192-bit keys).
pub const ALG_RSA_SHA256: &str = "rsa-sha256";

/// The kind of key in a SubjectPublicKeyInfo, as far as berth cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyKind {
    EcP256,
    Rsa,
    Other,
}

pub(crate) fn key_kind(spki: &SubjectPublicKeyInfo<'_>) -> KeyKind {
    let alg = &spki.algorithm;
    if alg.algorithm == OID_KEY_TYPE_EC_PUBLIC_KEY {
        let curve = alg.parameters.as_ref().and_then(|p| p.as_oid().ok());
        if curve.as_ref() == Some(&OID_EC_P256) {
            return KeyKind::EcP256;
        }
        KeyKind::Other
    } else if alg.algorithm == OID_PKCS1_RSAENCRYPTION {
        KeyKind::Rsa
    } else {
        KeyKind::Other
    }
}

/// Human-readable key description for error messages.
pub(crate) fn describe_key(spki: &SubjectPublicKeyInfo<'_>) -> String {
    let alg = &spki.algorithm;
    if alg.algorithm == OID_KEY_TYPE_EC_PUBLIC_KEY {
        match alg.parameters.as_ref().and_then(|p| p.as_oid().ok()) {
            Some(c) if c == OID_EC_P256 => "ECDSA P-256".to_string(),
            Some(c) if c == OID_NIST_EC_P384 => "ECDSA P-384".to_string(),
            Some(c) => format!("ECDSA curve {c}"),
            None => "ECDSA without curve".to_string(),
        }
    } else if alg.algorithm == OID_PKCS1_RSAENCRYPTION {
        "RSA".to_string()
    } else {
        format!("key algorithm {}", alg.algorithm)
    }
}

/// Verify `signature` over `message` with the public key of the X.509 certificate `cert_der`.
///
/// `algorithm` is `ecdsa-sha256` (ECDSA P-256/SHA-256, DER signature) or `rsa-sha256`
/// (RSASSA-PKCS1-v1_5/SHA-256, 2048+ bits). The certificate's key must be of the kind the
/// algorithm names: a result cannot pick a weaker interpretation of the agent's key.
pub fn verify_with_cert(
    cert_der: &[u8],
    algorithm: &str,
    message: &[u8],
    signature: &[u8],
) -> Result<()> {
    let (expected, verification): (KeyKind, &'static dyn VerificationAlgorithm) = match algorithm {
        ALG_ECDSA_SHA256 => (KeyKind::EcP256, &signature::ECDSA_P256_SHA256_ASN1),
        ALG_RSA_SHA256 => (KeyKind::Rsa, &signature::RSA_PKCS1_2048_8192_SHA256),
        other => return Err(CryptoError::UnsupportedAlgorithm(truncate(other))),
    };
    let cert = parse_cert(cert_der)?;
    let spki = cert.public_key();
    if key_kind(spki) != expected {
        return Err(CryptoError::KeyAlgorithmMismatch {
            algorithm: algorithm.to_string(),
            expected: match expected {
                KeyKind::EcP256 => "ECDSA P-256",
                _ => "RSA",
            },
            actual: describe_key(spki),
        });
    }
    UnparsedPublicKey::new(verification, &spki.subject_public_key.data)
        .verify(message, signature)
        .map_err(|_| CryptoError::BadSignature)
}

/// Algorithm names come from the network; keep error messages bounded.
fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}
