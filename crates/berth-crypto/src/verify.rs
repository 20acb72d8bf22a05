//! Signature verification with a certificate's public key, for signed task results.
//! It checks only the key and the signature; whether the certificate is the agent's current
//! binding, or still valid, is the caller's decision and must be made before calling this.

use aws_lc_rs::signature::{self, ParsedPublicKey, VerificationAlgorithm};

use crate::cert::{describe_key, key_kind, parse_cert, KeyKind};
use crate::error::{CryptoError, Result};

/// `signatureAlgorithm` value for ECDSA P-256 over SHA-256, ASN.1 DER signature.
pub const ALG_ECDSA_SHA256: &str = "ecdsa-sha256";
/// `signatureAlgorithm` value for RSASSA-PKCS1-v1_5 over SHA-256 (2048..8192-bit keys).
pub const ALG_RSA_SHA256: &str = "rsa-sha256";

/// The key kind a `signatureAlgorithm` name requires.
fn kind_for(algorithm: &str) -> Result<KeyKind> {
    match algorithm {
        ALG_ECDSA_SHA256 => Ok(KeyKind::EcP256),
        ALG_RSA_SHA256 => Ok(KeyKind::Rsa),
        other => Err(CryptoError::UnsupportedAlgorithm(truncate(other))),
    }
}

/// The one aws-lc-rs algorithm a key kind verifies with, so a key can be parsed for it before
/// any signature arrives.
fn verification_for(kind: KeyKind) -> Option<&'static dyn VerificationAlgorithm> {
    match kind {
        KeyKind::EcP256 => Some(&signature::ECDSA_P256_SHA256_ASN1),
        KeyKind::Rsa => Some(&signature::RSA_PKCS1_2048_8192_SHA256),
        KeyKind::Other => None,
    }
}

/// The public key of one certificate, parsed once, for verifying any number of result
/// signatures: the certificate is parsed (x509-parser) and the key loaded (aws-lc-rs) in
/// [`ResultVerifier::from_cert`], and [`ResultVerifier::verify`] only checks signatures.
///
/// Like [`verify_with_cert`], it checks only the key and the signature. It says nothing about
/// whether the certificate is an agent's current binding or still valid; a verifier must only
/// ever be used for the certificate it was built from (keyed by that certificate, never by an
/// agent id), and the binding check stays the caller's.
pub struct ResultVerifier {
    kind: KeyKind,
    /// `describe_key` of the certificate's key, for `KeyAlgorithmMismatch`.
    key_description: String,
    /// The key parsed for the one algorithm its kind supports. `None` when the kind is
    /// unsupported, or when aws-lc-rs rejects the key bytes; the one-shot
    /// `UnparsedPublicKey::verify` parses the same bytes the same way and would fail on every
    /// call, so then every signature is `BadSignature`, as it always was. (RSA key sizes are
    /// checked at verification in both forms.)
    key: Option<ParsedPublicKey>,
}

impl ResultVerifier {
    /// Parses the X.509 certificate `cert_der` and loads its public key.
    ///
    /// Fails only when the certificate itself does not parse (`InvalidCertificate`). A key of a
    /// kind berth does not verify with (e.g. P-384) still yields a verifier, whose `verify`
    /// refuses every algorithm with `KeyAlgorithmMismatch`, exactly like [`verify_with_cert`].
    pub fn from_cert(cert_der: &[u8]) -> Result<Self> {
        let cert = parse_cert(cert_der)?;
        let spki = cert.public_key();
        let kind = key_kind(spki);
        let key = verification_for(kind)
            .and_then(|alg| ParsedPublicKey::new(alg, &spki.subject_public_key.data).ok());
        Ok(ResultVerifier {
            kind,
            key_description: describe_key(spki),
            key,
        })
    }

    /// Verifies `signature` over `message` with the certificate's key.
    ///
    /// `algorithm` is `ecdsa-sha256` (ECDSA P-256/SHA-256, DER signature) or `rsa-sha256`
    /// (RSASSA-PKCS1-v1_5/SHA-256, 2048..8192 bits); anything else is `UnsupportedAlgorithm`.
    /// The key must be of the kind the algorithm names (`KeyAlgorithmMismatch` otherwise): a
    /// result cannot pick a weaker interpretation of the agent's key. A signature that does not
    /// verify is `BadSignature`.
    pub fn verify(&self, algorithm: &str, message: &[u8], signature: &[u8]) -> Result<()> {
        let expected = kind_for(algorithm)?;
        if self.kind != expected {
            return Err(CryptoError::KeyAlgorithmMismatch {
                algorithm: algorithm.to_string(),
                expected: match expected {
                    KeyKind::EcP256 => "ECDSA P-256",
                    _ => "RSA",
                },
                actual: self.key_description.clone(),
            });
        }
        // `self.key` was parsed with `verification_for(self.kind)`: the algorithm just named.
        match &self.key {
            Some(key) => key
                .verify_sig(message, signature)
                .map_err(|_| CryptoError::BadSignature),
            None => Err(CryptoError::BadSignature),
        }
    }
}

impl std::fmt::Debug for ResultVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResultVerifier")
            .field("key", &self.key_description)
            .field("loaded", &self.key.is_some())
            .finish()
    }
}

/// Verify `signature` over `message` with the public key of the X.509 certificate `cert_der`.
///
/// One-shot form of [`ResultVerifier`]: parses the certificate on every call. Callers verifying
/// several signatures with one certificate should build a `ResultVerifier` once instead.
/// `algorithm` is `ecdsa-sha256` (ECDSA P-256/SHA-256, DER signature) or `rsa-sha256`
/// (RSASSA-PKCS1-v1_5/SHA-256, 2048+ bits). The certificate's key must be of the kind the
/// algorithm names: a result cannot pick a weaker interpretation of the agent's key.
pub fn verify_with_cert(
    cert_der: &[u8],
    algorithm: &str,
    message: &[u8],
    signature: &[u8],
) -> Result<()> {
    // Same refusal order as always: an unknown algorithm name is refused before the certificate
    // is looked at.
    kind_for(algorithm)?;
    ResultVerifier::from_cert(cert_der)?.verify(algorithm, message, signature)
}

/// Algorithm names come from the network; keep error messages bounded.
fn truncate(s: &str) -> String {
    s.chars().take(64).collect()
}
