//! Envelope encryption of builtin secrets: every version gets a fresh random 32-byte data key;
//! the value is sealed (AES-256-GCM) under the data key and the data key under the master key,
//! both with the associated data `<tenant>/<key>#<version>`, so a ciphertext moved to another
//! row or version never opens. A value never reaches a log, an error, a row in clear or an
//! audit entry: errors here say only that sealing or opening failed.

use berth_crypto::{random_bytes, MasterKey};
use berth_proto::TenantId;

/// A value sealed for one `(tenant, key, version)`.
pub struct Envelope {
    pub wrapped_key: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum EnvelopeError {
    #[error("sealing the secret failed")]
    Seal,
    /// Wrong master key, or bytes from another row or version, or tampered bytes.
    #[error("the stored secret does not open under its path and version")]
    Open,
}

/// The associated data binding both layers to where they are stored.
fn aad(tenant: TenantId, key: &str, version: u32) -> Vec<u8> {
    format!("{tenant}/{key}#{version}").into_bytes()
}

pub fn seal(
    master: &MasterKey,
    tenant: TenantId,
    key: &str,
    version: u32,
    value: &[u8],
) -> Result<Envelope, EnvelopeError> {
    let aad = aad(tenant, key, version);
    let data_key = MasterKey::from_bytes(&random_bytes::<32>()).map_err(|_| EnvelopeError::Seal)?;
    let ciphertext = data_key
        .seal(value, &aad)
        .map_err(|_| EnvelopeError::Seal)?;
    let wrapped_key = master
        .seal(data_key.as_bytes(), &aad)
        .map_err(|_| EnvelopeError::Seal)?;
    Ok(Envelope {
        wrapped_key,
        ciphertext,
    })
}

pub fn open(
    master: &MasterKey,
    tenant: TenantId,
    key: &str,
    version: u32,
    envelope: &Envelope,
) -> Result<Vec<u8>, EnvelopeError> {
    let aad = aad(tenant, key, version);
    let raw = master
        .open(&envelope.wrapped_key, &aad)
        .map_err(|_| EnvelopeError::Open)?;
    let data_key = MasterKey::from_bytes(&raw).map_err(|_| EnvelopeError::Open)?;
    data_key
        .open(&envelope.ciphertext, &aad)
        .map_err(|_| EnvelopeError::Open)
}

/// The value of a stored version: [`open`] with the row's own tenant, key and version.
pub fn open_sealed(
    master: &MasterKey,
    sealed: berth_store::SealedSecret,
) -> Result<Vec<u8>, EnvelopeError> {
    open(
        master,
        sealed.meta.tenant_id,
        &sealed.meta.key,
        sealed.meta.version,
        &Envelope {
            wrapped_key: sealed.wrapped_key,
            ciphertext: sealed.ciphertext,
        },
    )
}

/// A generated value: 32 random bytes, URL-safe base64 without padding.
pub fn generate_value() -> String {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine as _;
    URL_SAFE_NO_PAD.encode(random_bytes::<32>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_swap_fails() {
        let master = MasterKey::generate();
        let t = TenantId::new();
        let a1 = seal(&master, t, "qa/see/a", 1, b"alpha").unwrap();
        let a2 = seal(&master, t, "qa/see/a", 2, b"alpha-2").unwrap();
        let b1 = seal(&master, t, "qa/see/b", 1, b"bravo").unwrap();
        assert_eq!(open(&master, t, "qa/see/a", 1, &a1).unwrap(), b"alpha");
        assert_eq!(open(&master, t, "qa/see/a", 2, &a2).unwrap(), b"alpha-2");
        // The same bytes under another version, key or tenant do not open.
        assert!(open(&master, t, "qa/see/a", 2, &a1).is_err());
        assert!(open(&master, t, "qa/see/b", 1, &a1).is_err());
        assert!(open(&master, TenantId::new(), "qa/see/a", 1, &a1).is_err());
        // Ciphertext from one row with the wrapped key of another does not open either.
        let mixed = Envelope {
            wrapped_key: b1.wrapped_key.clone(),
            ciphertext: a1.ciphertext.clone(),
        };
        assert!(open(&master, t, "qa/see/b", 1, &mixed).is_err());
        assert!(open(&master, t, "qa/see/a", 1, &mixed).is_err());
        // Nor under another master key.
        assert!(open(&MasterKey::generate(), t, "qa/see/a", 1, &a1).is_err());
        // Each version has its own data key: the sealed bytes share nothing visible.
        assert_ne!(a1.wrapped_key, a2.wrapped_key);
    }

    #[test]
    fn generated_values_are_32_bytes_url_safe() {
        let v = generate_value();
        assert_eq!(v.len(), 43);
        assert!(v
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
        assert_ne!(v, generate_value());
    }
}
