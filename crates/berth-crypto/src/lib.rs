//! berth-crypto owns every cryptographic decision in berth: the CA and agent certificates, P-256
//! signatures, ES256 JWTs/JWKS, token hashing, AEAD envelopes and HPKE (RFC 9180) sealing, all on
//! aws-lc-rs.
//! It must never do I/O (callers pass PEM in and get PEM out) and never panic on input.

mod agent_key;
mod ca;
mod cert;
mod error;
mod hash;
pub mod hpke;
mod jwt;
mod master_key;
mod pem;
mod registry_token;
mod verify;

pub use agent_key::AgentKey;
pub use ca::{
    agent_id_from_cert, cert_not_after, cert_pem_to_der, verify_cert_issued_by, Ca, IssuedCert,
    AGENT_URI_PREFIX,
};
pub use error::{CryptoError, Result};
pub use hash::{
    fingerprint, hash_token, hmac_sha256, random_bytes, random_token, random_unit, sha256,
    sha256_hex, sha256_hex_reader,
};
pub use jwt::{verify_jwt, JwtSigner, PublicJwk};
pub use master_key::MasterKey;
pub use registry_token::{RegistryAccess, RegistryClaims, RegistryTokenKey};
pub use verify::{verify_with_cert, ResultVerifier, ALG_ECDSA_SHA256, ALG_RSA_SHA256};
