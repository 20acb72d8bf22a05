//! The master key that wraps per-secret data keys, and its AES-256-GCM envelope.
//! It must never print, log or serialize the key implicitly: Debug is redacted, and bytes leave
//! only through `as_bytes` for the caller to store with mode 0600.

use std::fmt;

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};

use crate::error::{CryptoError, Result};
use crate::hash::random_bytes;

const TAG_LEN: usize = 16;

/// 32-byte AES-256-GCM key.
pub struct MasterKey([u8; 32]);

impl fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl Drop for MasterKey {
    fn drop(&mut self) {
        // Best-effort wipe without `unsafe`: black_box keeps the store from being optimised away.
        self.0.fill(0);
        std::hint::black_box(&mut self.0);
    }
}

impl MasterKey {
    pub fn generate() -> MasterKey {
        MasterKey(random_bytes())
    }

    /// Exactly 32 bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<MasterKey> {
        let key: [u8; 32] = bytes
            .try_into()
            .map_err(|_| CryptoError::InvalidMasterKey("must be exactly 32 bytes"))?;
        Ok(MasterKey(key))
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    fn aead_key(&self) -> Result<LessSafeKey> {
        UnboundKey::new(&AES_256_GCM, &self.0)
            .map(LessSafeKey::new)
            .map_err(|_| CryptoError::InvalidMasterKey("rejected by aes-256-gcm"))
    }

    /// AES-256-GCM with a fresh random 96-bit nonce: output is `nonce || ciphertext || tag`.
    /// `aad` binds the context (e.g. tenant, secret path and version) so a sealed value cannot
    /// be moved to another row and still open.
    pub fn seal(&self, plaintext: &[u8], aad: &[u8]) -> Result<Vec<u8>> {
        // Random nonces are safe here: far fewer than 2^32 seals per key are expected.
        let nonce_bytes: [u8; NONCE_LEN] = random_bytes();
        let mut out = Vec::with_capacity(NONCE_LEN + plaintext.len() + TAG_LEN);
        out.extend_from_slice(&nonce_bytes);
        let mut body = plaintext.to_vec();
        self.aead_key()?
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce_bytes),
                Aad::from(aad),
                &mut body,
            )
            .map_err(|_| CryptoError::Seal)?;
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Inverse of [`MasterKey::seal`]; a wrong key, wrong `aad` or any modified byte → `Open`.
    pub fn open(&self, sealed: &[u8], aad: &[u8]) -> Result<Vec<u8>> {
        if sealed.len() < NONCE_LEN + TAG_LEN {
            return Err(CryptoError::Open);
        }
        let (nonce, body) = sealed.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| CryptoError::Open)?;
        let mut body = body.to_vec();
        let plain_len = self
            .aead_key()?
            .open_in_place(nonce, Aad::from(aad), &mut body)
            .map_err(|_| CryptoError::Open)?
            .len();
        body.truncate(plain_len);
        Ok(body)
    }
}
