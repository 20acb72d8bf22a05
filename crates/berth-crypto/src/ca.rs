//! The berth CA (ECDSA P-256): server certificates for the TLS listener and agent certificates
//! from CSRs. The server alone decides an agent certificate's identity; nothing from a CSR but
//! its verified public key may ever reach a certificate.

use std::fmt;
use std::net::IpAddr;

use aws_lc_rs::signature::{UnparsedPublicKey, ECDSA_P256_SHA256_ASN1};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber, SignatureAlgorithm,
    PKCS_ECDSA_P256_SHA256,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, CertificateSigningRequestDer};
use time::{Duration, OffsetDateTime};
use uuid::Uuid;
use x509_parser::certificate::X509Certificate;
use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::GeneralName;
use x509_parser::oid_registry::OID_SIG_ECDSA_WITH_SHA256;
use x509_parser::prelude::FromDer;

use crate::cert::{describe_key, key_kind, parse_cert, KeyKind};
use crate::error::{CryptoError, Result};
use crate::hash::{fingerprint, random_bytes};
use crate::pem;

/// URI SAN prefix that carries an agent's identity: `urn:berth:agent:<uuid>`.
pub const AGENT_URI_PREFIX: &str = "urn:berth:agent:";

/// How far back certificates are dated, so a peer whose clock runs a little behind still
/// accepts a certificate issued just now.
const CA_BACKDATE: Duration = Duration::hours(1);
const LEAF_BACKDATE: Duration = Duration::minutes(5);
const CA_VALIDITY: Duration = Duration::days(3650);

/// A P-256 certificate authority: its certificate plus the signing key.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
    cert_der: Vec<u8>,
    not_after: OffsetDateTime,
}

/// A freshly issued leaf certificate.
#[derive(Clone)]
pub struct IssuedCert {
    pub cert_pem: String,
    pub cert_der: Vec<u8>,
    /// PKCS#8 PEM of the fresh key; only set by [`Ca::issue_server_cert`] (agents keep their
    /// own keys and send CSRs).
    pub key_pem: Option<String>,
    /// `sha256:<hex>` of `cert_der`, the value stored as the agent's certificate binding.
    pub fingerprint: String,
    pub not_after: OffsetDateTime,
}

impl fmt::Debug for IssuedCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IssuedCert")
            .field("fingerprint", &self.fingerprint)
            .field("not_after", &self.not_after)
            .field("key_pem", &self.key_pem.as_ref().map(|_| "[elided]"))
            .finish()
    }
}

impl fmt::Debug for Ca {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ca")
            .field("fingerprint", &self.fingerprint())
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl Ca {
    /// A new self-signed CA valid from `now - 1h` to `now + 10y`: CA:true with pathlen 0 (it
    /// issues leaves only), key usages keyCertSign and cRLSign.
    pub fn generate(common_name: &str, now: OffsetDateTime) -> Result<Ca> {
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .map_err(CryptoError::rcgen("generating the ca key"))?;
        let mut params = CertificateParams::default();
        params.distinguished_name = common_name_dn(common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        params.not_before = x509_time(now.checked_sub(CA_BACKDATE))?;
        params.not_after = x509_time(now.checked_add(CA_VALIDITY))?;
        params.serial_number = Some(random_serial());
        let cert = params
            .self_signed(&key)
            .map_err(CryptoError::rcgen("self-signing the ca certificate"))?;
        Ca::assemble(cert.der().to_vec(), key)
    }

    /// Reload a CA from its PEM files' contents. The certificate must be a CA certificate with a
    /// P-256 key, and `key_pem` (PKCS#8) must be the private half of that key.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Ca> {
        let der = pem::decode_cert(cert_pem)?;
        let cert = parse_cert(&der)?;
        if !is_ca_cert(&cert) {
            return Err(CryptoError::InvalidCertificate(
                "not a ca certificate (basicConstraints cA is not set)".into(),
            ));
        }
        let spki = cert.public_key();
        if key_kind(spki) != KeyKind::EcP256 {
            return Err(CryptoError::UnsupportedKey(format!(
                "ca key is {}, need ECDSA P-256",
                describe_key(spki)
            )));
        }
        let pkcs8 = pem::decode_pkcs8(key_pem)?;
        let key = KeyPair::from_pkcs8_der_and_sign_algo(&pkcs8, &PKCS_ECDSA_P256_SHA256)
            .map_err(|_| CryptoError::InvalidKey("ca key is not a P-256 PKCS#8 key".into()))?;
        if key.public_key_raw() != spki.subject_public_key.data.as_ref() {
            return Err(CryptoError::KeyMismatch);
        }
        Ca::assemble(der, key)
    }

    /// Build the issuer from the certificate itself, so a generated and a reloaded CA sign with
    /// exactly the same issuer name and authority key identifier.
    fn assemble(cert_der: Vec<u8>, key: KeyPair) -> Result<Ca> {
        let not_after = cert_not_after(&cert_der)?;
        let issuer = Issuer::from_ca_cert_der(&CertificateDer::from(cert_der.as_slice()), key)
            .map_err(CryptoError::rcgen("reading the ca certificate"))?;
        Ok(Ca {
            issuer,
            cert_pem: pem::encode("CERTIFICATE", &cert_der),
            cert_der,
            not_after,
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    pub fn cert_der(&self) -> &[u8] {
        &self.cert_der
    }

    /// The CA private key as PKCS#8 PEM, for the caller to write with mode 0600.
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// `sha256:<hex>` of the CA certificate: what agents pin.
    pub fn fingerprint(&self) -> String {
        fingerprint(&self.cert_der)
    }

    pub fn not_after(&self) -> OffsetDateTime {
        self.not_after
    }

    /// Server certificate for the TLS listener: SANs = each hostname (IP addresses as IP SANs,
    /// else DNS), EKU serverAuth, a fresh P-256 key. Validity `now - 5min .. now + validity`,
    /// cut at the CA's own notAfter (a leaf outliving its CA would be rejected anyway).
    pub fn issue_server_cert(
        &self,
        hostnames: &[String],
        now: OffsetDateTime,
        validity: Duration,
    ) -> Result<IssuedCert> {
        let first = hostnames
            .first()
            .ok_or(CryptoError::InvalidHostname(String::new()))?;
        let mut params = self.leaf_params(now, validity)?;
        params.distinguished_name = common_name_dn(first);
        params.subject_alt_names = hostnames
            .iter()
            .map(|h| san_for_hostname(h))
            .collect::<Result<_>>()?;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .map_err(CryptoError::rcgen("generating the server key"))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(CryptoError::rcgen("signing the server certificate"))?;
        issued(cert.der().to_vec(), Some(key.serialize_pem()))
    }

    /// Agent certificate from a CSR.
    ///
    /// The CSR's self-signature must verify (ecdsa-with-SHA256) and its key must be ECDSA P-256.
    /// Only that public key is used: the CSR's subject, SANs and extensions are ignored, so an
    /// agent cannot ask for someone else's identity. Subject CN = agent id, SAN URI
    /// `urn:berth:agent:<id>`, EKU clientAuth, CA:false, random serial, validity
    /// `now - 5min .. now + validity` (cut at the CA's notAfter).
    pub fn sign_agent_csr(
        &self,
        csr_pem: &str,
        agent_id: Uuid,
        now: OffsetDateTime,
        validity: Duration,
    ) -> Result<IssuedCert> {
        let public_key = verified_csr_key(csr_pem)?;
        let id = agent_id.hyphenated().to_string();
        let mut params = self.leaf_params(now, validity)?;
        params.distinguished_name = common_name_dn(&id);
        let uri = format!("{AGENT_URI_PREFIX}{id}")
            .try_into()
            .map_err(CryptoError::rcgen("encoding the agent uri"))?;
        params.subject_alt_names = vec![SanType::URI(uri)];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params
            .signed_by(&public_key, &self.issuer)
            .map_err(CryptoError::rcgen("signing the agent certificate"))?;
        issued(cert.der().to_vec(), None)
    }

    /// Parameters shared by every leaf: not a CA, digitalSignature only, random serial, AKI.
    fn leaf_params(&self, now: OffsetDateTime, validity: Duration) -> Result<CertificateParams> {
        if !validity.is_positive() {
            return Err(CryptoError::InvalidValidity("validity must be positive"));
        }
        let not_after = now.checked_add(validity).map(|t| t.min(self.not_after));
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.not_before = x509_time(now.checked_sub(LEAF_BACKDATE))?;
        params.not_after = x509_time(not_after)?;
        if params.not_after <= params.not_before {
            return Err(CryptoError::InvalidValidity("ca has expired"));
        }
        params.serial_number = Some(random_serial());
        params.use_authority_key_identifier_extension = true;
        Ok(params)
    }
}

/// An agent's P-256 public key, taken from a verified CSR (uncompressed SEC1 point).
struct CsrPublicKey(Vec<u8>);

impl PublicKeyData for CsrPublicKey {
    fn der_bytes(&self) -> &[u8] {
        &self.0
    }

    fn algorithm(&self) -> &'static SignatureAlgorithm {
        &PKCS_ECDSA_P256_SHA256
    }
}

/// Parse a CSR, require a P-256 key and a valid ecdsa-with-SHA256 self-signature (proof that
/// the requester holds the private key), and return only the public key.
fn verified_csr_key(csr_pem: &str) -> Result<CsrPublicKey> {
    let der = CertificateSigningRequestDer::from_pem_slice(csr_pem.as_bytes())
        .map_err(|e| CryptoError::InvalidCsr(format!("not a pem certificate request: {e}")))?;
    let (rest, csr) = X509CertificationRequest::from_der(der.as_ref())
        .map_err(|e| CryptoError::InvalidCsr(format!("malformed der: {e}")))?;
    if !rest.is_empty() {
        return Err(CryptoError::InvalidCsr(
            "trailing bytes after the request".into(),
        ));
    }
    let info = &csr.certification_request_info;
    let spki = &info.subject_pki;
    if key_kind(spki) != KeyKind::EcP256 {
        return Err(CryptoError::UnsupportedKey(format!(
            "csr key is {}, need ECDSA P-256",
            describe_key(spki)
        )));
    }
    let point = spki.subject_public_key.data.as_ref();
    // Uncompressed form only: it is what every TLS stack accepts in a certificate.
    if point.len() != 65 || point[0] != 0x04 {
        return Err(CryptoError::UnsupportedKey(
            "csr key is not an uncompressed P-256 point".into(),
        ));
    }
    if csr.signature_algorithm.algorithm != OID_SIG_ECDSA_WITH_SHA256 {
        return Err(CryptoError::InvalidCsr(format!(
            "signature algorithm {} is not ecdsa-with-SHA256",
            csr.signature_algorithm.algorithm
        )));
    }
    UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, point)
        .verify(info.raw, &csr.signature_value.data)
        .map_err(|_| CryptoError::InvalidCsr("self-signature does not verify".into()))?;
    Ok(CsrPublicKey(point.to_vec()))
}

fn issued(cert_der: Vec<u8>, key_pem: Option<String>) -> Result<IssuedCert> {
    Ok(IssuedCert {
        cert_pem: pem::encode("CERTIFICATE", &cert_der),
        fingerprint: fingerprint(&cert_der),
        not_after: cert_not_after(&cert_der)?,
        cert_der,
        key_pem,
    })
}

fn common_name_dn(cn: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    dn
}

fn san_for_hostname(host: &str) -> Result<SanType> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(ip));
    }
    let valid = !host.is_empty()
        && host.len() <= 253
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'*'));
    if !valid {
        return Err(CryptoError::InvalidHostname(
            host.chars().take(64).collect(),
        ));
    }
    host.try_into()
        .map(SanType::DnsName)
        .map_err(|_| CryptoError::InvalidHostname(host.to_string()))
}

/// 16 random bytes, positive and without a leading zero byte, so the DER INTEGER is always
/// exactly 16 bytes (RFC 5280 allows up to 20).
fn random_serial() -> SerialNumber {
    let mut bytes: [u8; 16] = random_bytes();
    bytes[0] = (bytes[0] & 0x7f) | 0x40;
    SerialNumber::from_slice(&bytes)
}

/// Whole seconds in UTC (what X.509 stores), within the range X.509 times can encode.
/// `None` means the caller's arithmetic overflowed.
fn x509_time(t: Option<OffsetDateTime>) -> Result<OffsetDateTime> {
    let t = t.ok_or(CryptoError::InvalidValidity("time out of range"))?;
    let t = OffsetDateTime::from_unix_timestamp(t.unix_timestamp())
        .map_err(|_| CryptoError::InvalidValidity("time out of range"))?;
    if !(1950..=9999).contains(&t.year()) {
        return Err(CryptoError::InvalidValidity(
            "time outside the x.509 range (1950..9999)",
        ));
    }
    Ok(t)
}

fn is_ca_cert(cert: &X509Certificate<'_>) -> bool {
    matches!(cert.basic_constraints(), Ok(Some(bc)) if bc.value.ca)
}

/// The agent id in an agent certificate's `urn:berth:agent:<uuid>` URI SAN.
///
/// This only reads the certificate: the caller must already have verified the chain (the TLS
/// handshake does) and the fingerprint binding before trusting the id.
pub fn agent_id_from_cert(der: &[u8]) -> Result<Uuid> {
    let cert = parse_cert(der)?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| CryptoError::InvalidCertificate(format!("malformed subjectAltName: {e}")))?
        .ok_or_else(|| CryptoError::InvalidCertificate("no subjectAltName".into()))?;
    let mut ids = san
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::URI(uri) => uri.strip_prefix(AGENT_URI_PREFIX),
            _ => None,
        });
    let raw = ids
        .next()
        .ok_or_else(|| CryptoError::InvalidCertificate("no agent uri in subjectAltName".into()))?;
    if ids.next().is_some() {
        return Err(CryptoError::InvalidCertificate(
            "more than one agent uri in subjectAltName".into(),
        ));
    }
    let id = Uuid::try_parse(raw)
        .map_err(|_| CryptoError::InvalidCertificate("agent uri does not hold a uuid".into()))?;
    // Only the exact form the CA writes, so one agent has exactly one spelling.
    if id.hyphenated().to_string() != raw {
        return Err(CryptoError::InvalidCertificate(
            "agent uri uuid is not in canonical form".into(),
        ));
    }
    Ok(id)
}

/// A certificate's notAfter.
pub fn cert_not_after(der: &[u8]) -> Result<OffsetDateTime> {
    Ok(parse_cert(der)?.validity().not_after.to_datetime())
}

/// DER of the first `CERTIFICATE` block in `pem`.
pub fn cert_pem_to_der(pem: &str) -> Result<Vec<u8>> {
    pem::decode_cert(pem)
}

/// Check that `cert_der` names `issuer_der`'s subject as its issuer and carries a valid
/// ecdsa-with-SHA256 signature by the issuer's P-256 key, and that the issuer is a CA.
/// Validity dates are not checked here. The agent uses this to check the certificate it was
/// given against the CA it pinned.
pub fn verify_cert_issued_by(cert_der: &[u8], issuer_der: &[u8]) -> Result<()> {
    let cert = parse_cert(cert_der)?;
    let issuer = parse_cert(issuer_der)?;
    if !is_ca_cert(&issuer) {
        return Err(CryptoError::InvalidCertificate(
            "issuer is not a ca certificate".into(),
        ));
    }
    if cert.issuer().as_raw() != issuer.subject().as_raw() {
        return Err(CryptoError::InvalidCertificate(
            "issuer name does not match the ca subject".into(),
        ));
    }
    let spki = issuer.public_key();
    if key_kind(spki) != KeyKind::EcP256 {
        return Err(CryptoError::UnsupportedKey(format!(
            "issuer key is {}, need ECDSA P-256",
            describe_key(spki)
        )));
    }
    if cert.signature_algorithm.algorithm != OID_SIG_ECDSA_WITH_SHA256 {
        return Err(CryptoError::UnsupportedAlgorithm(
            cert.signature_algorithm.algorithm.to_id_string(),
        ));
    }
    UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, &spki.subject_public_key.data)
        .verify(cert.tbs_certificate.as_ref(), &cert.signature_value.data)
        .map_err(|_| CryptoError::BadSignature)
}
