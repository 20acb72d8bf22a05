//! berth as the token server of the Docker registry's token authentication (distribution's
//! `auth: token`): a dedicated P-256 key, its self-signed certificate (what an operator puts in
//! the registry's `rootcertbundle`), and ES256 JWTs naming that key by its libtrust key id, the
//! `kid` the registry looks up among the bundle's keys. No I/O: the server keeps the PEM files.

use std::fmt;
use std::time::Duration;

use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, PKCS_ECDSA_P256_SHA256};
use serde::Serialize;
use serde_json::json;
use time::OffsetDateTime;

use crate::ca::cert_not_after;
use crate::cert::parse_cert;
use crate::error::{CryptoError, Result};
use crate::hash::sha256;
use crate::jwt::JwtSigner;
use crate::pem;

/// The signing certificate is long-lived: the registry trusts it as configured, and berth
/// replaces it only when the operator deletes the key files.
const CERT_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
const CERT_BACKDATE: Duration = Duration::from_secs(3600);

/// DER SubjectPublicKeyInfo of a P-256 key, up to the uncompressed point: SEQUENCE { SEQUENCE {
/// id-ecPublicKey, prime256v1 }, BIT STRING (65 bytes + the unused-bits byte) }.
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];

/// The key that signs registry tokens, with its certificate.
pub struct RegistryTokenKey {
    signer: JwtSigner,
    key_id: String,
    cert_pem: String,
}

impl fmt::Debug for RegistryTokenKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistryTokenKey")
            .field("key_id", &self.key_id)
            .finish_non_exhaustive()
    }
}

/// One `access` entry: `repository:<name>:<actions>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RegistryAccess {
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    pub actions: Vec<String>,
}

impl RegistryAccess {
    /// Pull, and nothing else, of one repository (its path on the registry, without the host).
    pub fn pull(repository: &str) -> RegistryAccess {
        RegistryAccess {
            kind: "repository".into(),
            name: repository.into(),
            actions: vec!["pull".into()],
        }
    }
}

/// The claims of one registry token (the registry's token spec).
#[derive(Debug, Clone)]
pub struct RegistryClaims {
    /// `iss`: the registry's configured `issuer`.
    pub issuer: String,
    /// `sub`: who the token is for (berth names the task).
    pub subject: String,
    /// `aud`: the registry's configured `service`.
    pub audience: String,
    pub issued_at: OffsetDateTime,
    pub expires_at: OffsetDateTime,
    /// `jti`: unique per token.
    pub id: String,
    pub access: Vec<RegistryAccess>,
}

impl RegistryTokenKey {
    /// A new key and its self-signed certificate (CN `common_name`), valid from an hour before
    /// `now` for ten years.
    pub fn generate(common_name: &str, now: OffsetDateTime) -> Result<RegistryTokenKey> {
        let signer = JwtSigner::generate()?;
        let key = KeyPair::from_pkcs8_der_and_sign_algo(
            &signer.pkcs8_der().to_vec().into(),
            &PKCS_ECDSA_P256_SHA256,
        )
        .map_err(CryptoError::rcgen("loading the registry token key"))?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, common_name);
        params.distinguished_name = dn;
        let whole_seconds = |t: Option<OffsetDateTime>| {
            t.and_then(|t| OffsetDateTime::from_unix_timestamp(t.unix_timestamp()).ok())
                .ok_or(CryptoError::InvalidValidity("time out of range"))
        };
        params.not_before = whole_seconds(
            now.checked_sub(
                CERT_BACKDATE
                    .try_into()
                    .map_err(|_| CryptoError::InvalidValidity("time out of range"))?,
            ),
        )?;
        params.not_after = whole_seconds(
            now.checked_add(
                CERT_VALIDITY
                    .try_into()
                    .map_err(|_| CryptoError::InvalidValidity("time out of range"))?,
            ),
        )?;
        let cert = params.self_signed(&key).map_err(CryptoError::rcgen(
            "self-signing the registry token certificate",
        ))?;
        RegistryTokenKey::assemble(signer, pem::encode("CERTIFICATE", cert.der()))
    }

    /// Reloads the key (PKCS#8 PEM) and its certificate, which must hold the key's public half.
    pub fn from_pem(key_pem: &str, cert_pem: &str) -> Result<RegistryTokenKey> {
        let signer = JwtSigner::from_pem(key_pem)?;
        let der = pem::decode_cert(cert_pem)?;
        let cert = parse_cert(&der)?;
        if cert.public_key().subject_public_key.data.as_ref() != signer.public_point() {
            return Err(CryptoError::KeyMismatch);
        }
        cert_not_after(&der)?;
        RegistryTokenKey::assemble(signer, pem::encode("CERTIFICATE", &der))
    }

    fn assemble(signer: JwtSigner, cert_pem: String) -> Result<RegistryTokenKey> {
        let key_id = libtrust_key_id(signer.public_point());
        Ok(RegistryTokenKey {
            signer,
            key_id,
            cert_pem,
        })
    }

    /// PKCS#8 PEM, for the caller to write with mode 0600.
    pub fn key_pem(&self) -> String {
        self.signer.to_pem()
    }

    /// The certificate, PEM: the registry's `rootcertbundle`.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The libtrust key id the tokens carry as `kid`.
    pub fn key_id(&self) -> &str {
        &self.key_id
    }

    /// The token: header `{"typ":"JWT","alg":"ES256","kid":<libtrust key id>}`.
    pub fn sign(&self, claims: &RegistryClaims) -> Result<String> {
        if claims.expires_at <= claims.issued_at {
            return Err(CryptoError::InvalidValidity(
                "a registry token must expire after it is issued",
            ));
        }
        let body = json!({
            "iss": claims.issuer,
            "sub": claims.subject,
            "aud": claims.audience,
            "exp": claims.expires_at.unix_timestamp(),
            "nbf": claims.issued_at.unix_timestamp(),
            "iat": claims.issued_at.unix_timestamp(),
            "jti": claims.id,
            "access": claims.access,
        });
        self.signer.sign_with_header(
            &json!({"typ": "JWT", "alg": "ES256", "kid": self.key_id}),
            &body,
        )
    }
}

/// libtrust's key id (docker/libtrust `keyIDFromCryptoKey`): SHA-256 of the DER
/// SubjectPublicKeyInfo, its first 240 bits in base32 (48 characters, no padding), in twelve
/// groups of four joined by `:`.
fn libtrust_key_id(point: &[u8]) -> String {
    let mut spki = P256_SPKI_PREFIX.to_vec();
    spki.extend_from_slice(point);
    let digest = sha256(&spki);
    let encoded = base32(&digest[..30]);
    encoded
        .as_bytes()
        .chunks(4)
        .map(|c| std::str::from_utf8(c).unwrap_or_default())
        .collect::<Vec<_>>()
        .join(":")
}

/// RFC 4648 base32, without padding (30 bytes make exactly 48 characters).
fn base32(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::new();
    let (mut buffer, mut bits) = (0u32, 0u32);
    for &b in bytes {
        buffer = (buffer << 8) | u32::from(b);
        bits += 8;
        while bits >= 5 {
            bits -= 5;
            out.push(ALPHABET[((buffer >> bits) & 31) as usize] as char);
        }
        buffer &= (1 << bits) - 1;
    }
    if bits > 0 {
        out.push(ALPHABET[((buffer << (5 - bits)) & 31) as usize] as char);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine as _;

    #[test]
    fn base32_matches_rfc_4648() {
        assert_eq!(base32(b""), "");
        assert_eq!(base32(b"f"), "MY");
        assert_eq!(base32(b"fooba"), "MZXW6YTB");
        assert_eq!(base32(b"foobar"), "MZXW6YTBOI");
    }

    #[test]
    fn key_id_is_libtrusts_of_the_certificates_key() {
        let now = OffsetDateTime::now_utc();
        let key = RegistryTokenKey::generate("berth registry tokens", now).unwrap();
        let id = key.key_id();
        assert_eq!(id.len(), 48 + 11);
        assert!(id.split(':').all(|g| g.len() == 4));
        // The SPKI berth hashes is the certificate's own.
        let der = pem::decode_cert(key.cert_pem()).unwrap();
        let cert = parse_cert(&der).unwrap();
        let spki = cert.public_key().raw;
        let expected = base32(&sha256(spki)[..30]);
        assert_eq!(id.replace(':', ""), expected);
        let again = RegistryTokenKey::from_pem(&key.key_pem(), key.cert_pem()).unwrap();
        assert_eq!(again.key_id(), id);
        let other = RegistryTokenKey::generate("x", now).unwrap();
        assert!(matches!(
            RegistryTokenKey::from_pem(&other.key_pem(), key.cert_pem()),
            Err(CryptoError::KeyMismatch)
        ));
    }

    #[test]
    fn token_carries_the_claims_and_verifies_with_the_certificates_key() {
        let now = OffsetDateTime::from_unix_timestamp(1_700_000_000).unwrap();
        let key = RegistryTokenKey::generate("berth", now).unwrap();
        let claims = RegistryClaims {
            issuer: "berth".into(),
            subject: "task:1".into(),
            audience: "registry".into(),
            issued_at: now,
            expires_at: now + time::Duration::seconds(60),
            id: "j1".into(),
            access: vec![RegistryAccess::pull("team/web")],
        };
        let token = key.sign(&claims).unwrap();
        let parts: Vec<&str> = token.split('.').collect();
        let header: serde_json::Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[0]).unwrap()).unwrap();
        assert_eq!(header["kid"], key.key_id());
        assert_eq!(header["alg"], "ES256");
        let body: serde_json::Value =
            serde_json::from_slice(&URL_SAFE_NO_PAD.decode(parts[1]).unwrap()).unwrap();
        assert_eq!(
            body["access"],
            json!([{"type": "repository", "name": "team/web", "actions": ["pull"]}])
        );
        assert_eq!(body["exp"], 1_700_000_060);
        assert_eq!(body["aud"], "registry");
        // The signature verifies with the public key in the certificate.
        let der = pem::decode_cert(key.cert_pem()).unwrap();
        let cert = parse_cert(&der).unwrap();
        let point = cert.public_key().subject_public_key.data.to_vec();
        let sig = URL_SAFE_NO_PAD.decode(parts[2]).unwrap();
        aws_lc_rs::signature::UnparsedPublicKey::new(
            &aws_lc_rs::signature::ECDSA_P256_SHA256_FIXED,
            &point,
        )
        .verify(format!("{}.{}", parts[0], parts[1]).as_bytes(), &sig)
        .unwrap();
        let expired = RegistryClaims {
            expires_at: now,
            ..claims
        };
        assert!(key.sign(&expired).is_err());
    }
}
