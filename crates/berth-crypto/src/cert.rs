//! Reading certificates: a whole DER certificate parsed strictly, and what kind of key it holds.
//! Shared by the CA (which issues and checks certificates) and signature verification; it
//! decides nothing about trust.

use x509_parser::certificate::X509Certificate;
use x509_parser::oid_registry::{
    OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY, OID_NIST_EC_P384, OID_PKCS1_RSAENCRYPTION,
};
use x509_parser::prelude::FromDer;
use x509_parser::x509::SubjectPublicKeyInfo;

use crate::error::{CryptoError, Result};

/// Parse a whole DER certificate (trailing bytes are refused).
pub(crate) fn parse_cert(der: &[u8]) -> Result<X509Certificate<'_>> {
    let (rest, cert) = X509Certificate::from_der(der)
        .map_err(|e| CryptoError::InvalidCertificate(format!("malformed der: {e}")))?;
    if !rest.is_empty() {
        return Err(CryptoError::InvalidCertificate(
            "trailing bytes after the certificate".into(),
        ));
    }
    Ok(cert)
}

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
