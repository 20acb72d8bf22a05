//! The agent's own P-256 key: CSRs for enrolment/renewal and result signatures.
//! The caller stores the PEM (mode 0600); this type never exposes the key except via `to_pem`.

use std::fmt;

use rcgen::{
    CertificateParams, DistinguishedName, DnType, KeyPair, SigningKey, PKCS_ECDSA_P256_SHA256,
};

use crate::cert::parse_cert;
use crate::error::{CryptoError, Result};
use crate::pem;

pub struct AgentKey {
    // rcgen's KeyPair wraps an aws-lc-rs ECDSA_P256_SHA256_ASN1_SIGNING key, so one type serves
    // both CSR generation and DER result signatures.
    key: KeyPair,
}

impl fmt::Debug for AgentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AgentKey(..)")
    }
}

impl AgentKey {
    pub fn generate() -> Result<AgentKey> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .map_err(CryptoError::rcgen("generating the agent key"))?;
        Ok(AgentKey { key })
    }

    /// Load a P-256 PKCS#8 PEM key; other key types are refused.
    pub fn from_pem(pkcs8_pem: &str) -> Result<AgentKey> {
        let pkcs8 = pem::decode_pkcs8(pkcs8_pem)?;
        let key = KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &PKCS_ECDSA_P256_SHA256)
            .map_err(|_| CryptoError::InvalidKey("agent key is not a P-256 PKCS#8 key".into()))?;
        Ok(AgentKey { key })
    }

    /// PKCS#8 PEM.
    pub fn to_pem(&self) -> String {
        self.key.serialize_pem()
    }

    /// A CSR with CN=`name`. The server ignores everything in it but the public key; the name
    /// only helps a human reading the request.
    pub fn csr_pem(&self, name: &str) -> Result<String> {
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, name);
        params.distinguished_name = dn;
        params
            .serialize_request(&self.key)
            .and_then(|csr| csr.pem())
            .map_err(CryptoError::rcgen("building the csr"))
    }

    /// ECDSA P-256 / SHA-256 signature over `message`, ASN.1 DER encoded (`ecdsa-sha256`).
    pub fn sign(&self, message: &[u8]) -> Result<Vec<u8>> {
        self.key
            .sign(message)
            .map_err(|_| CryptoError::Signing("ecdsa p-256 signing failed"))
    }

    /// [`AgentKey::sign`] as standard base64: the `signature` member of every signed body an
    /// agent sends (a task result, a heartbeat), over that body's signing input.
    pub fn sign_base64(&self, message: &[u8]) -> Result<String> {
        use base64::Engine;
        Ok(base64::engine::general_purpose::STANDARD.encode(self.sign(message)?))
    }

    /// Whether `cert_der` certifies this key, so the agent never stores a certificate it cannot
    /// use.
    pub fn matches_cert(&self, cert_der: &[u8]) -> Result<bool> {
        let cert = parse_cert(cert_der)?;
        Ok(cert.public_key().subject_public_key.data.as_ref() == self.key.public_key_raw())
    }
}
