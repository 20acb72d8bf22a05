//! Deploy grants (seed 001): ES256 JWTs that an agent exchanges at OpenBao's JWT mount for a
//! token, or presents to berth's own `builtin` KV read. The one place grants are minted (the
//! kit and the lease) and verified (the KV read).
//!
//! Each grant is signed by a fresh P-256 key of its own whose `kid` is the grant's `jti`; only
//! the public JWK is recorded and the private key is dropped as soon as the JWT is signed, so a
//! superseded or used grant stops verifying once the JWKS stops serving its key. A grant is
//! never logged or stored.

use berth_crypto::{verify_jwt, JwtSigner, PublicJwk};
use berth_proto::desired::{GRANT_AUDIENCE, GRANT_KIND, GRANT_TTL_SECS};
use berth_store::{DesiredEnvironment, Grant, GrantKind};
use serde_json::json;
use time::OffsetDateTime;

use crate::infra::error::ApiError;
use crate::SharedState;

/// Seed 001's grant lifetime (1 h).
pub const GRANT_TTL: time::Duration = time::Duration::seconds(GRANT_TTL_SECS as i64);

/// A minted grant: the JWT (for the caller only) and its record (for the store).
pub struct Minted {
    pub jwt: String,
    pub grant: Grant,
}

/// Signs a grant for `env` with a key of its own. The claims are exactly seed 001's: `iss`,
/// `aud`, `sub` = `agent:<env>`, `env_id`, `kind`, `jti`, `iat`, `exp` = now + `ttl` (a kit or
/// a lease: [`GRANT_TTL`]).
pub fn mint(
    state: &SharedState,
    env: &DesiredEnvironment,
    kind: GrantKind,
    now: OffsetDateTime,
    ttl: time::Duration,
) -> Result<Minted, ApiError> {
    // The kid is derived from the fresh key's public point (random, unique), and is the jti.
    let signer = JwtSigner::generate().map_err(|e| ApiError::internal(&e))?;
    let jti = signer.kid().to_string();
    let expires_at = now + ttl;
    let claims = json!({
        "iss": state.config.jwt_issuer,
        "aud": GRANT_AUDIENCE,
        "sub": format!("agent:{}", env.name),
        "env_id": env.name,
        "kind": GRANT_KIND,
        "jti": jti,
        "iat": now.unix_timestamp(),
        "exp": expires_at.unix_timestamp(),
    });
    let jwt = signer.sign(&claims).map_err(|e| ApiError::internal(&e))?;
    let public_jwk =
        serde_json::to_string(&signer.public_jwk()).map_err(|e| ApiError::internal(&e))?;
    drop(signer);
    Ok(Minted {
        jwt,
        grant: Grant {
            jti,
            tenant_id: env.tenant_id,
            environment_id: env.id,
            kind,
            public_jwk,
            issued_at: now,
            expires_at,
            superseded_at: None,
            used_at: None,
            token_accessor: None,
        },
    })
}

/// Why a presented lease was refused. Every variant is `401 LEASE_REQUIRED` to the caller; the
/// reason is for the log line (it never contains the JWT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseRefusal {
    Malformed,
    UnknownGrant,
    NotALease,
    WrongEnvironment,
    Superseded,
    Expired,
    BadSignatureOrClaims,
}

impl LeaseRefusal {
    pub fn as_str(self) -> &'static str {
        match self {
            LeaseRefusal::Malformed => "malformed",
            LeaseRefusal::UnknownGrant => "unknown grant",
            LeaseRefusal::NotALease => "not a lease grant",
            LeaseRefusal::WrongEnvironment => "grant of another environment",
            LeaseRefusal::Superseded => "grant superseded",
            LeaseRefusal::Expired => "grant expired",
            LeaseRefusal::BadSignatureOrClaims => "signature or claims invalid",
        }
    }
}

/// The `kid` of a compact JWS header, read before any verification only to find the grant's
/// key (the signature is then checked with that key alone).
fn kid_of(token: &str) -> Option<String> {
    use base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine as _;
    let header = token.split('.').next()?;
    let bytes = URL_SAFE_NO_PAD.decode(header).ok()?;
    let header: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    header.get("kid")?.as_str().map(str::to_string)
}

/// Verifies a lease presented for a `builtin` read of `env`: the grant exists, is a lease of
/// `env` (of the agent's tenant), is neither superseded nor expired, and the JWT verifies with
/// the grant's own recorded key, with seed 001's audience, kind and `env_id`.
pub async fn verify_lease(
    state: &SharedState,
    token: &str,
    env: &DesiredEnvironment,
    now: OffsetDateTime,
) -> Result<Result<Grant, LeaseRefusal>, ApiError> {
    let Some(jti) = kid_of(token) else {
        return Ok(Err(LeaseRefusal::Malformed));
    };
    let Some(grant) = state.store.grant(&jti).await? else {
        return Ok(Err(LeaseRefusal::UnknownGrant));
    };
    if grant.kind != GrantKind::Lease {
        return Ok(Err(LeaseRefusal::NotALease));
    }
    if grant.tenant_id != env.tenant_id || grant.environment_id != env.id {
        return Ok(Err(LeaseRefusal::WrongEnvironment));
    }
    if grant.superseded_at.is_some() {
        return Ok(Err(LeaseRefusal::Superseded));
    }
    if grant.expires_at <= now {
        return Ok(Err(LeaseRefusal::Expired));
    }
    let Ok(jwk) = serde_json::from_str::<PublicJwk>(&grant.public_jwk) else {
        return Ok(Err(LeaseRefusal::BadSignatureOrClaims));
    };
    let claims = match verify_jwt(token, std::slice::from_ref(&jwk), GRANT_AUDIENCE, now) {
        Ok(claims) => claims,
        Err(berth_crypto::CryptoError::JwtExpired) => return Ok(Err(LeaseRefusal::Expired)),
        Err(_) => return Ok(Err(LeaseRefusal::BadSignatureOrClaims)),
    };
    let claim = |name: &str| claims.get(name).and_then(|v| v.as_str());
    if claim("kind") != Some(GRANT_KIND)
        || claim("env_id") != Some(env.name.as_str())
        || claim("jti") != Some(grant.jti.as_str())
    {
        return Ok(Err(LeaseRefusal::BadSignatureOrClaims));
    }
    Ok(Ok(grant))
}

/// After a grant was used or superseded it is out of the JWKS; OpenBao forgets its cached key
/// only when the JWT mount's keyset is reset, so reset it (in the background: the caller's
/// answer does not wait on OpenBao). Without OpenBao configured, nothing to do.
pub fn reset_keyset(state: &SharedState) {
    supersede_in_openbao(state, Vec::new());
}

/// [`reset_keyset`], and revokes the OpenBao tokens of superseded grants by their accessors.
pub fn supersede_in_openbao(state: &SharedState, token_accessors: Vec<String>) {
    let (Some(verifier), Some(settings)) = (state.bao.clone(), state.config.openbao.clone()) else {
        return;
    };
    tokio::spawn(async move {
        for accessor in token_accessors {
            if let Err(e) = verifier.revoke_accessor(&accessor).await {
                tracing::warn!(error = %e, "could not revoke a superseded grant's OpenBao token");
            }
        }
        if let Err(e) = verifier.reset_keyset(&settings.auth_mount).await {
            tracing::warn!(error = %e, mount = settings.auth_mount, "could not reset OpenBao's JWT keyset");
        }
    });
}
