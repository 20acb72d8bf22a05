//! ES256 JWTs: a round trip, and each way of getting a forged or stale token accepted.

use aws_lc_rs::hmac;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine as _;
use berth_crypto::{verify_jwt, CryptoError, JwtSigner, PublicJwk};
use serde_json::{json, Value};
use time::macros::datetime;
use time::OffsetDateTime;

const NOW: OffsetDateTime = datetime!(2025-06-01 12:00:00 UTC);
const AUD: &str = "berth-agent";

fn claims(exp_offset: i64) -> Value {
    json!({
        "iss": "https://berth.example",
        "aud": AUD,
        "sub": "agent:0b9e6f7e-6f0c-4f38-9d7c-3a3c0f1f1e2a",
        "env_id": "prod",
        "kind": "agent",
        "jti": "j1",
        "exp": NOW.unix_timestamp() + exp_offset,
    })
}

fn b64(v: &Value) -> String {
    URL_SAFE_NO_PAD.encode(serde_json::to_vec(v).unwrap())
}

fn parts(token: &str) -> (String, String, String) {
    let p: Vec<&str> = token.split('.').collect();
    assert_eq!(p.len(), 3);
    (p[0].into(), p[1].into(), p[2].into())
}

#[test]
fn round_trip() {
    let signer = JwtSigner::generate().unwrap();
    let token = signer.sign(&claims(3600)).unwrap();
    let (h, _, s) = parts(&token);
    let header: Value = serde_json::from_slice(&URL_SAFE_NO_PAD.decode(h).unwrap()).unwrap();
    assert_eq!(
        header,
        json!({"alg": "ES256", "typ": "JWT", "kid": signer.kid()})
    );
    assert_eq!(URL_SAFE_NO_PAD.decode(s).unwrap().len(), 64);

    let keys = vec![signer.public_jwk()];
    let got = verify_jwt(&token, &keys, AUD, NOW).unwrap();
    assert_eq!(got, claims(3600));

    // aud may be an array containing the audience.
    let mut c = claims(3600);
    c["aud"] = json!(["vault", AUD]);
    verify_jwt(&signer.sign(&c).unwrap(), &keys, AUD, NOW).unwrap();
}

#[test]
fn signer_pem_and_kid_are_stable() {
    let signer = JwtSigner::generate().unwrap();
    let reloaded = JwtSigner::from_pem(&signer.to_pem()).unwrap();
    assert_eq!(reloaded.kid(), signer.kid());
    assert_eq!(reloaded.public_jwk(), signer.public_jwk());
    let token = reloaded.sign(&claims(60)).unwrap();
    verify_jwt(&token, &[signer.public_jwk()], AUD, NOW).unwrap();

    let jwk = serde_json::to_value(signer.public_jwk()).unwrap();
    assert_eq!(jwk["kty"], "EC");
    assert_eq!(jwk["crv"], "P-256");
    assert_eq!(jwk["use"], "sig");
    assert_eq!(jwk["alg"], "ES256");
    assert_eq!(jwk["kid"], signer.kid());
    for c in ["x", "y"] {
        let s = jwk[c].as_str().unwrap();
        assert_eq!(URL_SAFE_NO_PAD.decode(s).unwrap().len(), 32);
    }
    let back: PublicJwk = serde_json::from_value(jwk).unwrap();
    assert_eq!(back, signer.public_jwk());

    assert_ne!(JwtSigner::generate().unwrap().kid(), signer.kid());
    assert!(JwtSigner::from_pem("garbage").is_err());
    assert!(format!("{signer:?}").contains(signer.kid()));
    assert!(!format!("{signer:?}").contains("PRIVATE"));
}

#[test]
fn tampered_payload_is_refused() {
    let signer = JwtSigner::generate().unwrap();
    let keys = [signer.public_jwk()];
    let (h, _, s) = parts(&signer.sign(&claims(3600)).unwrap());
    let mut forged = claims(3600);
    forged["env_id"] = json!("other-env");
    let token = format!("{h}.{}.{s}", b64(&forged));
    assert!(matches!(
        verify_jwt(&token, &keys, AUD, NOW),
        Err(CryptoError::BadSignature)
    ));
    // A flipped signature bit.
    let token = signer.sign(&claims(3600)).unwrap();
    let (h, p, s) = parts(&token);
    let mut sig = URL_SAFE_NO_PAD.decode(s).unwrap();
    sig[5] ^= 0x01;
    let token = format!("{h}.{p}.{}", URL_SAFE_NO_PAD.encode(sig));
    assert!(matches!(
        verify_jwt(&token, &keys, AUD, NOW),
        Err(CryptoError::BadSignature)
    ));
}

#[test]
fn wrong_kid_is_refused() {
    let trusted = JwtSigner::generate().unwrap();
    let attacker = JwtSigner::generate().unwrap();
    let keys = [trusted.public_jwk()];
    let token = attacker.sign(&claims(3600)).unwrap();
    assert!(matches!(
        verify_jwt(&token, &keys, AUD, NOW),
        Err(CryptoError::JwtUnknownKey)
    ));
    // Attacker's token relabelled with the trusted kid.
    let (_, p, s) = parts(&token);
    let h = b64(&json!({"alg": "ES256", "typ": "JWT", "kid": trusted.kid()}));
    assert!(matches!(
        verify_jwt(&format!("{h}.{p}.{s}"), &keys, AUD, NOW),
        Err(CryptoError::BadSignature)
    ));
    // No kid at all.
    let h = b64(&json!({"alg": "ES256", "typ": "JWT"}));
    assert!(matches!(
        verify_jwt(&format!("{h}.{p}.{s}"), &keys, AUD, NOW),
        Err(CryptoError::InvalidJwt(_))
    ));
    // Empty key set.
    assert!(verify_jwt(&token, &[], AUD, NOW).is_err());
}

#[test]
fn alg_none_is_refused() {
    let signer = JwtSigner::generate().unwrap();
    let keys = [signer.public_jwk()];
    let p = b64(&claims(3600));
    for alg in ["none", "None", "NONE"] {
        let h = b64(&json!({"alg": alg, "typ": "JWT", "kid": signer.kid()}));
        for token in [format!("{h}.{p}."), format!("{h}.{p}")] {
            assert!(matches!(
                verify_jwt(&token, &keys, AUD, NOW),
                Err(CryptoError::InvalidJwt(_))
            ));
        }
    }
}

#[test]
fn hs256_with_the_public_key_as_secret_is_refused() {
    let signer = JwtSigner::generate().unwrap();
    let jwk = signer.public_jwk();
    let keys = [jwk.clone()];
    let h = b64(&json!({"alg": "HS256", "typ": "JWT", "kid": signer.kid()}));
    let p = b64(&claims(3600));
    // The classic key-confusion attack: HMAC keyed with public key material.
    for secret in [
        jwk.x.as_bytes(),
        serde_json::to_string(&jwk).unwrap().as_bytes(),
    ] {
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let tag = hmac::sign(&key, format!("{h}.{p}").as_bytes());
        let token = format!("{h}.{p}.{}", URL_SAFE_NO_PAD.encode(tag.as_ref()));
        assert!(matches!(
            verify_jwt(&token, &keys, AUD, NOW),
            Err(CryptoError::InvalidJwt(_))
        ));
    }
    // Other near-misses of ES256, with a genuine ES256 signature.
    let (_, p, s) = parts(&signer.sign(&claims(3600)).unwrap());
    for header in [
        json!({"alg": "es256", "kid": signer.kid()}),
        json!({"alg": "ES384", "kid": signer.kid()}),
        json!({"alg": ["ES256"], "kid": signer.kid()}),
        json!({"kid": signer.kid()}),
        json!({"alg": "ES256", "kid": signer.kid(), "crit": ["exp"]}),
    ] {
        let token = format!("{}.{p}.{s}", b64(&header));
        assert!(
            matches!(
                verify_jwt(&token, &keys, AUD, NOW),
                Err(CryptoError::InvalidJwt(_))
            ),
            "{header}"
        );
    }
}

#[test]
fn expired_is_refused() {
    let signer = JwtSigner::generate().unwrap();
    let keys = [signer.public_jwk()];
    for offset in [-3600, -1, 0] {
        let token = signer.sign(&claims(offset)).unwrap();
        assert!(
            matches!(
                verify_jwt(&token, &keys, AUD, NOW),
                Err(CryptoError::JwtExpired)
            ),
            "exp offset {offset}"
        );
    }
    verify_jwt(&signer.sign(&claims(1)).unwrap(), &keys, AUD, NOW).unwrap();

    let mut c = claims(3600);
    c.as_object_mut().unwrap().remove("exp");
    assert!(matches!(
        verify_jwt(&signer.sign(&c).unwrap(), &keys, AUD, NOW),
        Err(CryptoError::InvalidJwt(_))
    ));
    c["exp"] = json!("9999999999");
    assert!(matches!(
        verify_jwt(&signer.sign(&c).unwrap(), &keys, AUD, NOW),
        Err(CryptoError::InvalidJwt(_))
    ));
    let mut c = claims(3600);
    c["nbf"] = json!(NOW.unix_timestamp() + 60);
    assert!(matches!(
        verify_jwt(&signer.sign(&c).unwrap(), &keys, AUD, NOW),
        Err(CryptoError::JwtNotYetValid)
    ));
}

#[test]
fn wrong_audience_is_refused() {
    let signer = JwtSigner::generate().unwrap();
    let keys = [signer.public_jwk()];
    let token = signer.sign(&claims(3600)).unwrap();
    assert!(matches!(
        verify_jwt(&token, &keys, "vault", NOW),
        Err(CryptoError::JwtAudienceMismatch)
    ));
    for aud in [
        json!(null),
        json!(["vault"]),
        json!([]),
        json!(1),
        json!("berth-agent2"),
    ] {
        let mut c = claims(3600);
        c["aud"] = aud.clone();
        assert!(
            matches!(
                verify_jwt(&signer.sign(&c).unwrap(), &keys, AUD, NOW),
                Err(CryptoError::JwtAudienceMismatch)
            ),
            "{aud}"
        );
    }
    let mut c = claims(3600);
    c.as_object_mut().unwrap().remove("aud");
    assert!(matches!(
        verify_jwt(&signer.sign(&c).unwrap(), &keys, AUD, NOW),
        Err(CryptoError::JwtAudienceMismatch)
    ));
}

#[test]
fn malformed_tokens_are_refused_without_panicking() {
    let signer = JwtSigner::generate().unwrap();
    let keys = [signer.public_jwk()];
    let token = signer.sign(&claims(3600)).unwrap();
    let (h, p, s) = parts(&token);
    let der_like = URL_SAFE_NO_PAD.encode([0x30u8; 70]);
    let huge = "a".repeat(20_000);
    let cases = [
        String::new(),
        ".".into(),
        "..".into(),
        "...".into(),
        format!("{token}.{s}"),
        format!("{h}.{p}.{s}="),
        format!("{h}=.{p}.{s}"),
        format!("{h}.{p}.{der_like}"),
        format!("{}.{p}.{s}", URL_SAFE_NO_PAD.encode("not json")),
        format!("{}.{p}.{s}", b64(&json!(["ES256"]))),
        format!("{h}.{}.{s}", URL_SAFE_NO_PAD.encode("[]")),
        huge,
    ];
    for t in &cases {
        assert!(verify_jwt(t, &keys, AUD, NOW).is_err(), "{t:?}");
    }
    // Bad keys in the set.
    let mut bad = signer.public_jwk();
    bad.x = "AAAA".into();
    assert!(verify_jwt(&token, &[bad], AUD, NOW).is_err());
    let mut bad = signer.public_jwk();
    bad.crv = "P-384".into();
    assert!(verify_jwt(&token, &[bad], AUD, NOW).is_err());
    // Claims must be an object.
    assert!(signer.sign(&json!([1, 2])).is_err());
}
