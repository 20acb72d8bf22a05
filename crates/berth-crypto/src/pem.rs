//! PEM encode/decode helpers shared by the key and certificate types, so every type emits the
//! same format (64-column base64, LF line endings).

use base64::engine::general_purpose::STANDARD;
use base64::Engine as _;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivatePkcs8KeyDer};

use crate::error::{CryptoError, Result};

pub(crate) fn encode(label: &str, der: &[u8]) -> String {
    let b64 = STANDARD.encode(der);
    let mut out = String::with_capacity(b64.len() + b64.len() / 64 + 2 * label.len() + 40);
    out.push_str("-----BEGIN ");
    out.push_str(label);
    out.push_str("-----\n");
    // base64 output is ASCII, so splitting on byte boundaries is always on char boundaries.
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str("-----END ");
    out.push_str(label);
    out.push_str("-----\n");
    out
}

/// The first `CERTIFICATE` block.
pub(crate) fn decode_cert(pem: &str) -> Result<Vec<u8>> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .map(|der| der.to_vec())
        .map_err(|e| CryptoError::InvalidPem(format!("certificate: {e}")))
}

/// The first `PRIVATE KEY` (PKCS#8) block.
pub(crate) fn decode_pkcs8(pem: &str) -> Result<PrivatePkcs8KeyDer<'static>> {
    PrivatePkcs8KeyDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| CryptoError::InvalidPem(format!("pkcs#8 private key: {e}")))
}
