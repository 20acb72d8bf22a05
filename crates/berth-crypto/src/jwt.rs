//! ES256 JWTs for agent tokens and deploy grants, and the JWKS entries that verify them.
//! Verification accepts exactly one algorithm (ES256) and fails closed on anything unexpected;
//! it never trusts a key or algorithm named by the token itself.

use std::fmt;

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{
    EcdsaKeyPair, KeyPair as _, UnparsedPublicKey, ECDSA_P256_SHA256_FIXED,
    ECDSA_P256_SHA256_FIXED_SIGNING,
};
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use time::OffsetDateTime;

use crate::error::{CryptoError, Result};
use crate::hash::sha256;
use crate::pem;

/// Tokens larger than this are refused before any parsing (ours are a few hundred bytes).
const MAX_TOKEN_LEN: usize = 16 * 1024;

/// A public key in JWK form, as served at `/.well-known/agent-jwks.json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicJwk {
    pub kty: String,
    pub crv: String,
    pub x: String,
    pub y: String,
    pub kid: String,
    #[serde(rename = "use")]
    pub use_: String,
    pub alg: String,
}

/// ES256 signer; the key is P-256 PKCS#8.
pub struct JwtSigner {
    key: EcdsaKeyPair,
    pkcs8: Vec<u8>,
    kid: String,
}

impl fmt::Debug for JwtSigner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JwtSigner")
            .field("kid", &self.kid)
            .finish_non_exhaustive()
    }
}

impl JwtSigner {
    pub fn generate() -> Result<JwtSigner> {
        let doc =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &SystemRandom::new())
                .map_err(|_| CryptoError::Signing("generating the jwt key failed"))?;
        JwtSigner::from_pkcs8(doc.as_ref())
    }

    pub fn from_pem(pkcs8_pem: &str) -> Result<JwtSigner> {
        let der = pem::decode_pkcs8(pkcs8_pem)?;
        JwtSigner::from_pkcs8(der.secret_pkcs8_der())
    }

    fn from_pkcs8(der: &[u8]) -> Result<JwtSigner> {
        let key = EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, der)
            .map_err(|_| CryptoError::InvalidKey("jwt key is not a P-256 PKCS#8 key".into()))?;
        let point = key.public_key().as_ref();
        if point.len() != 65 {
            return Err(CryptoError::InvalidKey(
                "jwt public key is not an uncompressed P-256 point".into(),
            ));
        }
        // The kid is derived from the key so it is stable across restarts and replicas.
        let kid = URL_SAFE_NO_PAD.encode(&sha256(point)[..16]);
        Ok(JwtSigner {
            key,
            pkcs8: der.to_vec(),
            kid,
        })
    }

    pub(crate) fn pkcs8_der(&self) -> &[u8] {
        &self.pkcs8
    }

    /// The uncompressed public point, `0x04 || x || y`.
    pub(crate) fn public_point(&self) -> &[u8] {
        self.key.public_key().as_ref()
    }

    /// PKCS#8 PEM.
    pub fn to_pem(&self) -> String {
        pem::encode("PRIVATE KEY", &self.pkcs8)
    }

    /// base64url of the first 16 bytes of SHA-256 over the uncompressed public key.
    pub fn kid(&self) -> &str {
        &self.kid
    }

    pub fn public_jwk(&self) -> PublicJwk {
        // Invariant checked in from_pkcs8: the point is 0x04 || x(32) || y(32).
        let point = self.key.public_key().as_ref();
        PublicJwk {
            kty: "EC".into(),
            crv: "P-256".into(),
            x: URL_SAFE_NO_PAD.encode(&point[1..33]),
            y: URL_SAFE_NO_PAD.encode(&point[33..65]),
            kid: self.kid.clone(),
            use_: "sig".into(),
            alg: "ES256".into(),
        }
    }

    /// Compact JWS with header `{"alg":"ES256","typ":"JWT","kid":…}` over `claims` (a JSON
    /// object). The signature is the fixed 64-byte r||s form JWS requires, not DER.
    pub fn sign(&self, claims: &Value) -> Result<String> {
        self.sign_with_header(
            &json!({"alg": "ES256", "typ": "JWT", "kid": self.kid}),
            claims,
        )
    }

    /// The compact JWS of `claims` under `header` (which must say `"alg":"ES256"`), for tokens
    /// whose verifier names keys its own way (the registry token's libtrust key id).
    pub(crate) fn sign_with_header(&self, header: &Value, claims: &Value) -> Result<String> {
        if !claims.is_object() {
            return Err(CryptoError::InvalidJwt("claims must be a json object"));
        }
        if header.get("alg").and_then(Value::as_str) != Some("ES256") {
            return Err(CryptoError::InvalidJwt("alg must be ES256"));
        }
        let header = serde_json::to_vec(header).map_err(|source| CryptoError::Json {
            context: "serializing the jwt header",
            source,
        })?;
        let payload = serde_json::to_vec(claims).map_err(|source| CryptoError::Json {
            context: "serializing the jwt claims",
            source,
        })?;
        let mut token = URL_SAFE_NO_PAD.encode(header);
        token.push('.');
        token.push_str(&URL_SAFE_NO_PAD.encode(payload));
        let sig = self
            .key
            .sign(&SystemRandom::new(), token.as_bytes())
            .map_err(|_| CryptoError::Signing("es256 signing failed"))?;
        token.push('.');
        token.push_str(&URL_SAFE_NO_PAD.encode(sig.as_ref()));
        Ok(token)
    }
}

/// Verify an ES256 JWT against `keys` and return its claims.
///
/// Refused: a header alg other than exactly `ES256` (so `none` and HS256 never get near a key),
/// a `crit` header, a kid not in `keys`, a bad signature, a missing or past `exp` (`exp <= now`),
/// an `nbf` in the future, and an `aud` that is not `expected_audience` (or an array holding it).
pub fn verify_jwt(
    token: &str,
    keys: &[PublicJwk],
    expected_audience: &str,
    now: OffsetDateTime,
) -> Result<Value> {
    if token.len() > MAX_TOKEN_LEN {
        return Err(CryptoError::InvalidJwt("token too large"));
    }
    let mut parts = token.split('.');
    let (Some(header_b64), Some(payload_b64), Some(sig_b64), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(CryptoError::InvalidJwt("not a three-part compact jws"));
    };

    let header = decode_json_object(
        header_b64,
        "header is not base64url",
        "header is not a json object",
    )?;
    if header.get("alg").and_then(Value::as_str) != Some("ES256") {
        return Err(CryptoError::InvalidJwt("alg must be ES256"));
    }
    // We understand no critical extensions, so RFC 7515 says we must refuse any.
    if header.contains_key("crit") {
        return Err(CryptoError::InvalidJwt("crit header is not supported"));
    }
    let kid = header
        .get("kid")
        .and_then(Value::as_str)
        .ok_or(CryptoError::InvalidJwt("missing kid"))?;
    let jwk = keys
        .iter()
        .find(|k| k.kid == kid)
        .ok_or(CryptoError::JwtUnknownKey)?;
    let point = jwk_point(jwk)?;

    let sig = URL_SAFE_NO_PAD
        .decode(sig_b64)
        .map_err(|_| CryptoError::InvalidJwt("signature is not base64url"))?;
    if sig.len() != 64 {
        return Err(CryptoError::InvalidJwt("signature is not 64 bytes"));
    }
    // The signing input is `header.payload` exactly as received; both parts and the dot
    // between them are a prefix of `token`, so this length is always in bounds.
    let signing_input_len = header_b64.len() + 1 + payload_b64.len();
    UnparsedPublicKey::new(&ECDSA_P256_SHA256_FIXED, &point)
        .verify(&token.as_bytes()[..signing_input_len], &sig)
        .map_err(|_| CryptoError::BadSignature)?;

    let claims = decode_json_object(
        payload_b64,
        "payload is not base64url",
        "payload is not a json object",
    )?;
    let now_ts = now.unix_timestamp() as f64;
    let exp = claims
        .get("exp")
        .ok_or(CryptoError::InvalidJwt("missing exp"))?
        .as_f64()
        .ok_or(CryptoError::InvalidJwt("exp is not a number"))?;
    if exp <= now_ts {
        return Err(CryptoError::JwtExpired);
    }
    if let Some(nbf) = claims.get("nbf") {
        let nbf = nbf
            .as_f64()
            .ok_or(CryptoError::InvalidJwt("nbf is not a number"))?;
        if nbf > now_ts {
            return Err(CryptoError::JwtNotYetValid);
        }
    }
    let aud_ok = match claims.get("aud") {
        Some(Value::String(aud)) => aud == expected_audience,
        Some(Value::Array(auds)) => auds.iter().any(|a| a.as_str() == Some(expected_audience)),
        _ => false,
    };
    if !aud_ok {
        return Err(CryptoError::JwtAudienceMismatch);
    }
    Ok(Value::Object(claims))
}

fn decode_json_object(
    b64: &str,
    not_base64: &'static str,
    not_object: &'static str,
) -> Result<serde_json::Map<String, Value>> {
    let bytes = URL_SAFE_NO_PAD
        .decode(b64)
        .map_err(|_| CryptoError::InvalidJwt(not_base64))?;
    match serde_json::from_slice(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err(CryptoError::InvalidJwt(not_object)),
    }
}

/// The uncompressed point of a P-256 ES256 JWK; any other key shape is refused.
fn jwk_point(jwk: &PublicJwk) -> Result<Vec<u8>> {
    if jwk.kty != "EC" || jwk.crv != "P-256" || jwk.alg != "ES256" {
        return Err(CryptoError::InvalidJwt("key is not an ES256 P-256 jwk"));
    }
    let x = URL_SAFE_NO_PAD
        .decode(&jwk.x)
        .map_err(|_| CryptoError::InvalidJwt("jwk x is not base64url"))?;
    let y = URL_SAFE_NO_PAD
        .decode(&jwk.y)
        .map_err(|_| CryptoError::InvalidJwt("jwk y is not base64url"))?;
    if x.len() != 32 || y.len() != 32 {
        return Err(CryptoError::InvalidJwt("jwk coordinates are not 32 bytes"));
    }
    let mut point = Vec::with_capacity(65);
    point.push(0x04);
    point.extend_from_slice(&x);
    point.extend_from_slice(&y);
    Ok(point)
}
