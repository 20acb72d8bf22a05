//! HPKE (RFC 9180) base mode, single shot: DHKEM(P-256, HKDF-SHA256), HKDF-SHA256, and
//! AES-256-GCM (AES-128-GCM too, only so the RFC's P-256 test vector can be checked). Built on
//! aws-lc-rs's ECDH, HMAC and AEAD; no PSK or auth modes, no exporter, one message per context.
//! What a sealed box means (which key, which `info`, which AAD) is the caller's contract.

use std::fmt;

use aws_lc_rs::aead::{self, Aad, LessSafeKey, Nonce, UnboundKey};
use aws_lc_rs::agreement::{self, PrivateKey, UnparsedPublicKey, ECDH_P256};
use aws_lc_rs::encoding::{AsDer, Pkcs8V1Der};
use aws_lc_rs::hmac;
use x509_parser::oid_registry::{OID_EC_P256, OID_KEY_TYPE_EC_PUBLIC_KEY};

use crate::cert::parse_cert;
use crate::error::{CryptoError, Result};
use crate::pem;

/// `kem_id` of DHKEM(P-256, HKDF-SHA256).
const KEM_ID: u16 = 0x0010;
/// `kdf_id` of HKDF-SHA256.
const KDF_ID: u16 = 0x0001;
/// `Nsecret`, `Nh`: HKDF-SHA256's output length.
const N_SECRET: usize = 32;
/// `Npk`, `Nenc`: an uncompressed SEC1 P-256 point.
pub const PUBLIC_KEY_LEN: usize = 65;
/// `Nn` of both AES-GCM ids.
const N_NONCE: usize = 12;
const MODE_BASE: u8 = 0x00;

/// The AEAD of a suite. berth seals with [`Aead::Aes256Gcm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Aead {
    /// `aead_id` 0x0001: only for RFC 9180's published P-256 vector.
    Aes128Gcm,
    /// `aead_id` 0x0002.
    Aes256Gcm,
}

impl Aead {
    fn id(self) -> u16 {
        match self {
            Aead::Aes128Gcm => 0x0001,
            Aead::Aes256Gcm => 0x0002,
        }
    }

    fn algorithm(self) -> &'static aead::Algorithm {
        match self {
            Aead::Aes128Gcm => &aead::AES_128_GCM,
            Aead::Aes256Gcm => &aead::AES_256_GCM,
        }
    }
}

/// One sealed message: the encapsulated ephemeral key and the AEAD output (ciphertext and tag).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sealed {
    pub enc: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

impl Sealed {
    /// `(enc, ciphertext)` as standard base64, the wire form.
    pub fn to_base64(&self) -> (String, String) {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        (b64.encode(&self.enc), b64.encode(&self.ciphertext))
    }

    /// The wire form back; text that is not standard base64 is `Open`, like any other box that
    /// does not open.
    pub fn from_base64(enc: &str, ciphertext: &str) -> Result<Sealed> {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::STANDARD;
        Ok(Sealed {
            enc: b64.decode(enc).map_err(|_| CryptoError::Open)?,
            ciphertext: b64.decode(ciphertext).map_err(|_| CryptoError::Open)?,
        })
    }
}

/// A recipient's public key: an uncompressed P-256 point, checked on the curve when built.
#[derive(Clone, PartialEq, Eq)]
pub struct RecipientPublicKey([u8; PUBLIC_KEY_LEN]);

impl fmt::Debug for RecipientPublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RecipientPublicKey(..)")
    }
}

impl RecipientPublicKey {
    /// An uncompressed SEC1 point (`0x04 || x || y`) on P-256; anything else is refused.
    pub fn from_sec1(bytes: &[u8]) -> Result<RecipientPublicKey> {
        let point: [u8; PUBLIC_KEY_LEN] = bytes
            .try_into()
            .map_err(|_| CryptoError::UnsupportedKey("not an uncompressed P-256 point".into()))?;
        if point[0] != 0x04
            || agreement::ParsedPublicKey::try_from(&UnparsedPublicKey::new(&ECDH_P256, &point[..]))
                .is_err()
        {
            return Err(CryptoError::UnsupportedKey(
                "not an uncompressed P-256 point".into(),
            ));
        }
        Ok(RecipientPublicKey(point))
    }

    /// The key of an X.509 certificate. Only P-256 keys can receive: an RSA (or any other)
    /// certificate key is `UnsupportedKey`, and nothing is sealed to it.
    pub fn from_cert(cert_der: &[u8]) -> Result<RecipientPublicKey> {
        let cert = parse_cert(cert_der)?;
        let spki = cert.public_key();
        let alg = &spki.algorithm;
        let curve = alg.parameters.as_ref().and_then(|p| p.as_oid().ok());
        if alg.algorithm != OID_KEY_TYPE_EC_PUBLIC_KEY || curve.as_ref() != Some(&OID_EC_P256) {
            return Err(CryptoError::UnsupportedKey(format!(
                "{} cannot receive sealed data; only P-256 keys can",
                crate::cert::describe_key(spki)
            )));
        }
        RecipientPublicKey::from_sec1(&spki.subject_public_key.data)
    }

    pub fn as_bytes(&self) -> &[u8; PUBLIC_KEY_LEN] {
        &self.0
    }
}

/// A recipient's private P-256 key: opens what was sealed to its public key.
pub struct RecipientKey {
    private: PrivateKey,
    public: RecipientPublicKey,
}

impl fmt::Debug for RecipientKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RecipientKey(..)")
    }
}

impl RecipientKey {
    pub fn generate() -> Result<RecipientKey> {
        let private = PrivateKey::generate(&ECDH_P256)
            .map_err(|_| CryptoError::InvalidKey("generating a P-256 key failed".into()))?;
        RecipientKey::new(private)
    }

    /// A P-256 key in PKCS#8 PEM: the server's sealing key, or the agent's own key (the one in
    /// `agent.pem`, which also signs). Other key types are refused.
    pub fn from_pkcs8_pem(pkcs8_pem: &str) -> Result<RecipientKey> {
        let der = pem::decode_pkcs8(pkcs8_pem)?;
        let private = PrivateKey::from_private_key_der(&ECDH_P256, der.secret_pkcs8_der())
            .map_err(|_| CryptoError::InvalidKey("not a P-256 PKCS#8 key".into()))?;
        RecipientKey::new(private)
    }

    /// The private scalar, big endian (RFC 9180's `skRm` form).
    pub fn from_scalar(scalar: &[u8]) -> Result<RecipientKey> {
        let private = PrivateKey::from_private_key(&ECDH_P256, scalar)
            .map_err(|_| CryptoError::InvalidKey("not a P-256 scalar".into()))?;
        RecipientKey::new(private)
    }

    fn new(private: PrivateKey) -> Result<RecipientKey> {
        let public = private
            .compute_public_key()
            .map_err(|_| CryptoError::InvalidKey("no public key for the P-256 key".into()))?;
        let public = RecipientPublicKey::from_sec1(public.as_ref())?;
        Ok(RecipientKey { private, public })
    }

    /// PKCS#8 PEM, for the caller to store (0600).
    pub fn to_pkcs8_pem(&self) -> Result<String> {
        let der: Pkcs8V1Der<'static> = self
            .private
            .as_der()
            .map_err(|_| CryptoError::InvalidKey("encoding the P-256 key failed".into()))?;
        Ok(pem::encode("PRIVATE KEY", der.as_ref()))
    }

    pub fn public_key(&self) -> &RecipientPublicKey {
        &self.public
    }

    /// Opens `sealed` (made by [`seal`] for this key with the same `info` and `aad`). A wrong
    /// key, `info` or `aad`, or any changed byte, is `Open`: nothing of the plaintext is
    /// returned.
    pub fn open(&self, suite: Aead, sealed: &Sealed, info: &[u8], aad: &[u8]) -> Result<Vec<u8>> {
        // Decap: DH(skR, pkE), with the KEM context enc || pkRm.
        let dh = dh(&self.private, &sealed.enc).map_err(|_| CryptoError::Open)?;
        let shared = extract_and_expand(&dh, &sealed.enc, self.public.as_bytes());
        let (key, nonce) = key_schedule(suite, &shared, info);
        let key = LessSafeKey::new(
            UnboundKey::new(suite.algorithm(), &key).map_err(|_| CryptoError::Open)?,
        );
        let mut in_out = sealed.ciphertext.clone();
        let clear = key
            .open_in_place(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                &mut in_out,
            )
            .map_err(|_| CryptoError::Open)?;
        Ok(clear.to_vec())
    }
}

/// Seals `plaintext` to `recipient` under a fresh ephemeral key (RFC 9180 `SealBase`).
pub fn seal(
    suite: Aead,
    recipient: &RecipientPublicKey,
    info: &[u8],
    aad: &[u8],
    plaintext: &[u8],
) -> Result<Sealed> {
    let ephemeral = PrivateKey::generate(&ECDH_P256).map_err(|_| CryptoError::Seal)?;
    seal_with_ephemeral(suite, &ephemeral, recipient, info, aad, plaintext)
}

/// [`seal`] with a given ephemeral key: only the RFC's test vectors, whose `skEm` is fixed, need
/// it.
fn seal_with_ephemeral(
    suite: Aead,
    ephemeral: &PrivateKey,
    recipient: &RecipientPublicKey,
    info: &[u8],
    aad: &[u8],
    plaintext: &[u8],
) -> Result<Sealed> {
    // Encap: DH(skE, pkR); enc is pkE; the KEM context is enc || pkRm.
    let enc = ephemeral
        .compute_public_key()
        .map_err(|_| CryptoError::Seal)?;
    let enc = enc.as_ref().to_vec();
    let dh = dh(ephemeral, recipient.as_bytes()).map_err(|_| CryptoError::Seal)?;
    let shared = extract_and_expand(&dh, &enc, recipient.as_bytes());
    let (key, nonce) = key_schedule(suite, &shared, info);
    let key =
        LessSafeKey::new(UnboundKey::new(suite.algorithm(), &key).map_err(|_| CryptoError::Seal)?);
    let mut in_out = plaintext.to_vec();
    // Single shot: sequence number 0, so the nonce is `base_nonce` itself.
    key.seal_in_place_append_tag(
        Nonce::assume_unique_for_key(nonce),
        Aad::from(aad),
        &mut in_out,
    )
    .map_err(|_| CryptoError::Seal)?;
    Ok(Sealed {
        enc,
        ciphertext: in_out,
    })
}

/// The x coordinate of `private` times the point `public` (RFC 9180's `DH` for P-256). A
/// point that is not on the curve fails.
fn dh(private: &PrivateKey, public: &[u8]) -> std::result::Result<Vec<u8>, ()> {
    agreement::agree(
        private,
        UnparsedPublicKey::new(&ECDH_P256, public),
        (),
        |shared| Ok(shared.to_vec()),
    )
}

fn kem_suite_id() -> Vec<u8> {
    let mut id = b"KEM".to_vec();
    id.extend_from_slice(&KEM_ID.to_be_bytes());
    id
}

fn hpke_suite_id(suite: Aead) -> Vec<u8> {
    let mut id = b"HPKE".to_vec();
    id.extend_from_slice(&KEM_ID.to_be_bytes());
    id.extend_from_slice(&KDF_ID.to_be_bytes());
    id.extend_from_slice(&suite.id().to_be_bytes());
    id
}

/// DHKEM's `ExtractAndExpand`: the KEM shared secret.
fn extract_and_expand(dh: &[u8], enc: &[u8], recipient: &[u8]) -> Vec<u8> {
    let suite_id = kem_suite_id();
    let eae_prk = labeled_extract(&suite_id, b"", b"eae_prk", dh);
    let context = [enc, recipient].concat();
    labeled_expand(&suite_id, &eae_prk, b"shared_secret", &context, N_SECRET)
}

/// `KeySchedule` of mode_base (empty PSK and PSK id): the AEAD key and the base nonce.
fn key_schedule(suite: Aead, shared_secret: &[u8], info: &[u8]) -> (Vec<u8>, [u8; N_NONCE]) {
    let suite_id = hpke_suite_id(suite);
    let psk_id_hash = labeled_extract(&suite_id, b"", b"psk_id_hash", b"");
    let info_hash = labeled_extract(&suite_id, b"", b"info_hash", info);
    let context = [&[MODE_BASE][..], &psk_id_hash, &info_hash].concat();
    let secret = labeled_extract(&suite_id, shared_secret, b"secret", b"");
    let key = labeled_expand(
        &suite_id,
        &secret,
        b"key",
        &context,
        suite.algorithm().key_len(),
    );
    let mut nonce = [0u8; N_NONCE];
    nonce.copy_from_slice(&labeled_expand(
        &suite_id,
        &secret,
        b"base_nonce",
        &context,
        N_NONCE,
    ));
    (key, nonce)
}

/// `LabeledExtract(salt, label, ikm)`: HKDF-Extract over `"HPKE-v1" || suite_id || label || ikm`.
fn labeled_extract(suite_id: &[u8], salt: &[u8], label: &[u8], ikm: &[u8]) -> Vec<u8> {
    // HMAC pads a key shorter than the block with zeros, so an empty salt is HKDF's default
    // salt of `Nh` zero bytes.
    let key = hmac::Key::new(hmac::HMAC_SHA256, salt);
    let mut ctx = hmac::Context::with_key(&key);
    for part in [&b"HPKE-v1"[..], suite_id, label, ikm] {
        ctx.update(part);
    }
    ctx.sign().as_ref().to_vec()
}

/// `LabeledExpand(prk, label, info, L)`: HKDF-Expand with the info
/// `I2OSP(L, 2) || "HPKE-v1" || suite_id || label || info`. `len` is at most 255 × 32.
fn labeled_expand(suite_id: &[u8], prk: &[u8], label: &[u8], info: &[u8], len: usize) -> Vec<u8> {
    // Callers ask for 12, 16 or 32 bytes; the cast cannot truncate.
    let labeled = [
        &(len as u16).to_be_bytes()[..],
        b"HPKE-v1",
        suite_id,
        label,
        info,
    ]
    .concat();
    let key = hmac::Key::new(hmac::HMAC_SHA256, prk);
    let mut out = Vec::with_capacity(len);
    let mut previous: Vec<u8> = Vec::new();
    let mut counter = 1u8;
    while out.len() < len {
        let mut ctx = hmac::Context::with_key(&key);
        ctx.update(&previous);
        ctx.update(&labeled);
        ctx.update(&[counter]);
        previous = ctx.sign().as_ref().to_vec();
        out.extend_from_slice(&previous);
        counter = counter.wrapping_add(1);
    }
    out.truncate(len);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        ::hex::decode(s).unwrap()
    }

    // RFC 9180 Appendix A.3.1: DHKEM(P-256, HKDF-SHA256), HKDF-SHA256, AES-128-GCM, mode_base.
    const INFO: &str = "4f6465206f6e2061204772656369616e2055726e";
    const SK_EM: &str = "4995788ef4b9d6132b249ce59a77281493eb39af373d236a1fe415cb0c2d7beb";
    const PK_EM: &str = "04a92719c6195d5085104f469a8b9814d5838ff72b60501e2c4466e5e67b325ac98536d7b61a1af4b78e5b7f951c0900be863c403ce65c9bfcb9382657222d18c4";
    const SK_RM: &str = "f3ce7fdae57e1a310d87f1ebbde6f328be0a99cdbcadf4d6589cf29de4b8ffd2";
    const PK_RM: &str = "04fe8c19ce0905191ebc298a9245792531f26f0cece2460639e8bc39cb7f706a826a779b4cf969b8a0e539c7f62fb3d30ad6aa8f80e30f1d128aafd68a2ce72ea0";
    const SHARED_SECRET: &str = "c0d26aeab536609a572b07695d933b589dcf363ff9d93c93adea537aeabb8cb8";
    const KEY: &str = "868c066ef58aae6dc589b6cfdd18f97e";
    const BASE_NONCE: &str = "4e0bc5018beba4bf004cca59";
    const PT: &str = "4265617574792069732074727574682c20747275746820626561757479";
    const AAD: &str = "436f756e742d30";
    const CT: &str = "5ad590bb8baa577f8619db35a36311226a896e7342a6d836d8b7bcd2f20b6c7f9076ac232e3ab2523f39513434";

    #[test]
    fn rfc9180_a3_base_vector_seals_and_opens() {
        let recipient = RecipientKey::from_scalar(&hex(SK_RM)).unwrap();
        assert_eq!(recipient.public_key().as_bytes().to_vec(), hex(PK_RM));
        let ephemeral = PrivateKey::from_private_key(&ECDH_P256, &hex(SK_EM)).unwrap();

        // The intermediate values, so a mismatch says which step is wrong.
        let dh = dh(&ephemeral, &hex(PK_RM)).unwrap();
        let shared = extract_and_expand(&dh, &hex(PK_EM), &hex(PK_RM));
        assert_eq!(shared, hex(SHARED_SECRET));
        let (key, nonce) = key_schedule(Aead::Aes128Gcm, &shared, &hex(INFO));
        assert_eq!(key, hex(KEY));
        assert_eq!(nonce.to_vec(), hex(BASE_NONCE));

        let sealed = seal_with_ephemeral(
            Aead::Aes128Gcm,
            &ephemeral,
            recipient.public_key(),
            &hex(INFO),
            &hex(AAD),
            &hex(PT),
        )
        .unwrap();
        assert_eq!(sealed.enc, hex(PK_EM));
        assert_eq!(sealed.ciphertext, hex(CT));
        let opened = recipient
            .open(Aead::Aes128Gcm, &sealed, &hex(INFO), &hex(AAD))
            .unwrap();
        assert_eq!(opened, hex(PT));
    }

    fn sealed_for(recipient: &RecipientKey) -> Sealed {
        seal(
            Aead::Aes256Gcm,
            recipient.public_key(),
            b"berth test",
            b"assignment-1",
            b"{\"secret\":\"s3cr3t\"}",
        )
        .unwrap()
    }

    #[test]
    fn aes256_round_trips_and_never_carries_the_clear_text() {
        let recipient = RecipientKey::generate().unwrap();
        let sealed = sealed_for(&recipient);
        assert!(!sealed.ciphertext.windows(6).any(|w| w == b"s3cr3t"));
        let opened = recipient
            .open(Aead::Aes256Gcm, &sealed, b"berth test", b"assignment-1")
            .unwrap();
        assert_eq!(opened, b"{\"secret\":\"s3cr3t\"}");
    }

    #[test]
    fn another_key_cannot_open() {
        let sealed = sealed_for(&RecipientKey::generate().unwrap());
        let other = RecipientKey::generate().unwrap();
        assert!(matches!(
            other.open(Aead::Aes256Gcm, &sealed, b"berth test", b"assignment-1"),
            Err(CryptoError::Open)
        ));
    }

    #[test]
    fn any_changed_byte_fails_closed() {
        let recipient = RecipientKey::generate().unwrap();
        let sealed = sealed_for(&recipient);
        for i in 0..sealed.ciphertext.len() {
            let mut tampered = sealed.clone();
            tampered.ciphertext[i] ^= 1;
            assert!(recipient
                .open(Aead::Aes256Gcm, &tampered, b"berth test", b"assignment-1")
                .is_err());
        }
        let mut tampered = sealed.clone();
        tampered.enc[40] ^= 1;
        assert!(recipient
            .open(Aead::Aes256Gcm, &tampered, b"berth test", b"assignment-1")
            .is_err());
        let mut short = sealed.clone();
        short.ciphertext.truncate(10);
        assert!(recipient
            .open(Aead::Aes256Gcm, &short, b"berth test", b"assignment-1")
            .is_err());
    }

    #[test]
    fn another_aad_or_info_or_suite_cannot_open() {
        let recipient = RecipientKey::generate().unwrap();
        let sealed = sealed_for(&recipient);
        for (suite, info, aad) in [
            (Aead::Aes256Gcm, &b"berth test"[..], &b"assignment-2"[..]),
            (Aead::Aes256Gcm, b"berth other", b"assignment-1"),
            (Aead::Aes128Gcm, b"berth test", b"assignment-1"),
        ] {
            assert!(recipient.open(suite, &sealed, info, aad).is_err());
        }
    }

    #[test]
    fn a_certificate_key_that_is_not_p256_cannot_receive() {
        // berth's CA signs only P-256 CSRs; a certificate with another key (here P-384, as an
        // RSA one would be) is refused rather than sealed to in some other way.
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let cert = rcgen::CertificateParams::new(vec!["other.test".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let refused = RecipientPublicKey::from_cert(cert.der()).unwrap_err();
        assert!(
            matches!(&refused, CryptoError::UnsupportedKey(why) if why.contains("P-384")),
            "{refused}"
        );
    }

    #[test]
    fn keys_round_trip_through_pkcs8_and_certificates() {
        let key = RecipientKey::generate().unwrap();
        let again = RecipientKey::from_pkcs8_pem(&key.to_pkcs8_pem().unwrap()).unwrap();
        assert_eq!(again.public_key(), key.public_key());
        assert!(RecipientPublicKey::from_sec1(&[4u8; 65]).is_err());

        // The agent's signing key opens what is sealed to its certificate.
        let now = time::OffsetDateTime::now_utc();
        let ca = crate::Ca::generate("test CA", now).unwrap();
        let agent = crate::AgentKey::generate().unwrap();
        let cert = ca
            .sign_agent_csr(
                &agent.csr_pem("a").unwrap(),
                uuid::Uuid::new_v4(),
                now,
                time::Duration::days(1),
            )
            .unwrap();
        let public = RecipientPublicKey::from_cert(&cert.cert_der).unwrap();
        let opener = RecipientKey::from_pkcs8_pem(&agent.to_pem()).unwrap();
        assert_eq!(&public, opener.public_key());
        let sealed = seal(Aead::Aes256Gcm, &public, b"i", b"a", b"clear").unwrap();
        assert_eq!(
            opener.open(Aead::Aes256Gcm, &sealed, b"i", b"a").unwrap(),
            b"clear"
        );
    }
}
