//! berth's OpenBao client (token verification, keyset reset, accessor revocation) against the
//! real `bao` (scripts/openbao.sh) set up as seed 001's Terraform does, with a server token that
//! has only the permissions the module documents.

use std::time::Duration;

use berth_crypto::{JwtSigner, PublicJwk};
use berth_server::openbao::{TokenVerifier, VerifyError};
use berth_server::OpenBaoSettings;
use berth_test_utils::openbao::{grant_claims, JwksServer, OpenBaoEnv, SeedMounts};
use serde_json::Value;

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

fn client_token(login: &(u16, Value)) -> String {
    assert_eq!(login.0, 200, "login: {}", login.1);
    login.1["auth"]["client_token"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn verify_names_the_env_and_grant_and_caches() {
    let test = "verify_names_the_env_and_grant_and_caches";
    let Some(env) = OpenBaoEnv::from_env(test).await else {
        return;
    };
    let jwks = JwksServer::start().await;
    let mounts = SeedMounts::configure(&env, &jwks.url, None).await;
    let signer = JwtSigner::generate().unwrap();
    jwks.set_keys(vec![signer.public_jwk()]);

    // The server's token comes from a file, as configured.
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("bao-server.token");
    std::fs::write(&token_file, format!("{}\n", mounts.server_token().await)).unwrap();
    let settings = OpenBaoSettings {
        addr: env.addr.clone(),
        auth_mount: mounts.auth_mount.clone(),
        role: mounts.role.clone(),
        kv_mount: mounts.kv_mount.clone(),
        ca_pem: None,
        token_file: Some(token_file),
    };
    let verifier = TokenVerifier::new(&settings)
        .unwrap()
        .with_cache_ttl(Duration::from_secs(2));

    let env_id = unique("env");
    let jti = uuid::Uuid::new_v4().to_string();
    let login = mounts
        .login(&signer.sign(&grant_claims(&env_id, &jti)).unwrap())
        .await;
    let token = client_token(&login);
    let accessor = login.1["auth"]["accessor"].as_str().unwrap().to_string();

    let meta = verifier.verify(&token).await.unwrap();
    assert_eq!(meta.env_id, env_id);
    assert_eq!(meta.grant_jti, jti);
    assert_eq!(meta.accessor, accessor);
    assert_eq!(verifier.lookups(), 1);
    assert_eq!(verifier.verify(&token).await.unwrap(), meta);
    assert_eq!(
        verifier.lookups(),
        1,
        "the second verify is answered from the cache"
    );

    // Revoked: still the cached answer until the cache expires, then unknown.
    let (status, body) = env
        .call_as(&token, "POST", "auth/token/revoke-self", None)
        .await
        .unwrap();
    assert_eq!(status, 204, "{body}");
    assert_eq!(verifier.verify(&token).await.unwrap(), meta);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let err = verifier.verify(&token).await.unwrap_err();
    assert!(matches!(err, VerifyError::Unknown(_)), "{err}");
    assert!(!err.to_string().contains(&token), "{err}");
    assert_eq!(verifier.lookups(), 2);

    // Garbage, an empty bearer (which OpenBao would answer with the server's own token), and a
    // token not minted from a grant (the root token) are unknown.
    for bearer in ["s.garbage", "", "  "] {
        let err = verifier.verify(bearer).await.unwrap_err();
        assert!(matches!(err, VerifyError::Unknown(_)), "{bearer:?}: {err}");
    }
    let err = verifier.verify(&env.root_token).await.unwrap_err();
    assert!(matches!(err, VerifyError::Unknown(_)), "{err}");

    // The server's own token refused, or OpenBao down: unavailable, not the agent's fault.
    let bad_own = TokenVerifier::with_token(&env.addr, None, "s.not-ours".into()).unwrap();
    let other = mounts
        .login(&signer.sign(&grant_claims(&env_id, "jti-2")).unwrap())
        .await;
    let err = bad_own.verify(&client_token(&other)).await.unwrap_err();
    assert!(matches!(err, VerifyError::Unavailable(_)), "{err}");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let down =
        TokenVerifier::with_token(&format!("http://127.0.0.1:{port}"), None, "s.x".into()).unwrap();
    let err = down.verify("s.some-token").await.unwrap_err();
    assert!(matches!(err, VerifyError::Unavailable(_)), "{err}");

    // A superseded grant's token: revoked by accessor, forgotten by the cache.
    let third = client_token(
        &mounts
            .login(&signer.sign(&grant_claims(&env_id, "jti-3")).unwrap())
            .await,
    );
    let meta = verifier.verify(&third).await.unwrap();
    verifier.revoke_accessor(&meta.accessor).await.unwrap();
    verifier.revoke_accessor(&meta.accessor).await.unwrap();
    verifier.forget_grant("jti-3");
    assert!(matches!(
        verifier.verify(&third).await,
        Err(VerifyError::Unknown(_))
    ));

    mounts.teardown().await;
}

#[tokio::test]
async fn a_grant_whose_key_left_the_jwks_fails_after_the_keyset_reset() {
    let test = "a_grant_whose_key_left_the_jwks_fails_after_the_keyset_reset";
    let Some(env) = OpenBaoEnv::from_env(test).await else {
        return;
    };
    let jwks = JwksServer::start().await;
    let mounts = SeedMounts::configure(&env, &jwks.url, None).await;
    let verifier = TokenVerifier::with_token(&env.addr, None, mounts.server_token().await).unwrap();
    let env_id = unique("env");
    // One key per grant (berth's JWKS lists the live grants' keys only).
    let (old, new) = (
        JwtSigner::generate().unwrap(),
        JwtSigner::generate().unwrap(),
    );
    let keys: Vec<PublicJwk> = vec![old.public_jwk(), new.public_jwk()];
    jwks.set_keys(keys);
    let old_grant = old.sign(&grant_claims(&env_id, "jti-old")).unwrap();
    let new_grant = new.sign(&grant_claims(&env_id, "jti-new")).unwrap();
    client_token(&mounts.login(&old_grant).await);
    client_token(&mounts.login(&new_grant).await);

    // The old grant is superseded: berth stops listing its key. OpenBao keeps the keys it has
    // cached and only refetches for a kid it does not know, so the grant still logs in…
    jwks.set_keys(vec![new.public_jwk()]);
    let replay = mounts.login(&old_grant).await;
    assert_eq!(
        replay.0, 200,
        "OpenBao now refetches the JWKS on every login; the keyset reset may be unnecessary: {}",
        replay.1
    );

    // …until the server resets the mount's keyset.
    let fetches = jwks.fetches();
    verifier.reset_keyset(&mounts.auth_mount).await.unwrap();
    let refused = mounts.login(&old_grant).await;
    assert!(
        refused.0 == 400 || refused.0 == 403,
        "a superseded grant must fail at login: {} {}",
        refused.0,
        refused.1
    );
    assert!(jwks.fetches() > fetches, "OpenBao fetched the keys again");
    // The live grant still works, and the config is what it was.
    client_token(&mounts.login(&new_grant).await);
    let config = env
        .must("GET", &format!("auth/{}/config", mounts.auth_mount), None)
        .await;
    assert_eq!(config["data"]["jwks_url"], jwks.url.as_str());

    // Resetting twice is harmless; an unknown mount is an error, not a panic.
    verifier.reset_keyset(&mounts.auth_mount).await.unwrap();
    client_token(&mounts.login(&new_grant).await);
    assert!(verifier.reset_keyset("no-such-mount").await.is_err());
    assert!(verifier.reset_keyset("../sys").await.is_err());

    mounts.teardown().await;
}
