//! The crate's one error type. Variants are distinct per refusal so callers can map each to its
//! own error code and metric; messages never contain key material or token contents.

/// Result alias used across berth-crypto.
pub type Result<T> = std::result::Result<T, CryptoError>;

#[derive(Debug, thiserror::Error)]
pub enum CryptoError {
    #[error("invalid pem: {0}")]
    InvalidPem(String),
    #[error("invalid certificate: {0}")]
    InvalidCertificate(String),
    #[error("invalid certificate signing request: {0}")]
    InvalidCsr(String),
    #[error("unsupported key: {0}")]
    UnsupportedKey(String),
    #[error("invalid private key: {0}")]
    InvalidKey(String),
    #[error("private key does not match the certificate")]
    KeyMismatch,
    #[error("invalid hostname {0:?}")]
    InvalidHostname(String),
    #[error("invalid validity: {0}")]
    InvalidValidity(&'static str),
    #[error("unsupported signature algorithm {0:?}")]
    UnsupportedAlgorithm(String),
    #[error("certificate key is {actual}, signature algorithm {algorithm} needs {expected}")]
    KeyAlgorithmMismatch {
        algorithm: String,
        expected: &'static str,
        actual: String,
    },
    #[error("signature does not verify")]
    BadSignature,
    #[error("signing failed: {0}")]
    Signing(&'static str),
    #[error("invalid jwt: {0}")]
    InvalidJwt(&'static str),
    #[error("jwt key id is not in the key set")]
    JwtUnknownKey,
    #[error("jwt has expired")]
    JwtExpired,
    #[error("jwt is not valid yet")]
    JwtNotYetValid,
    #[error("jwt audience does not match")]
    JwtAudienceMismatch,
    #[error("invalid master key: {0}")]
    InvalidMasterKey(&'static str),
    #[error("sealing failed")]
    Seal,
    #[error("sealed data could not be opened")]
    Open,
    #[error("{context}")]
    Rcgen {
        context: &'static str,
        #[source]
        source: rcgen::Error,
    },
    #[error("{context}")]
    Json {
        context: &'static str,
        #[source]
        source: serde_json::Error,
    },
}

impl CryptoError {
    pub(crate) fn rcgen(context: &'static str) -> impl FnOnce(rcgen::Error) -> CryptoError {
        move |source| CryptoError::Rcgen { context, source }
    }
}
