//! The agent's OpenBao client against the real `bao` (scripts/openbao.sh) set up as seed 001's
//! Terraform does (berth_test_utils::openbao::SeedMounts), with grants signed like berth's and
//! served from an in-test JWKS.

use berth_agent::openbao::{upkeep, BaoError, OpenBao, Upkeep, RELEASE_AFTER_S};
use berth_crypto::JwtSigner;
use berth_proto::desired::SecretPath;
use berth_test_utils::openbao::{grant_claims, JwksServer, OpenBaoEnv, SeedMounts};

struct Setup {
    env: OpenBaoEnv,
    jwks: JwksServer,
    mounts: SeedMounts,
    bao: OpenBao,
}

async fn setup(test: &str) -> Option<Setup> {
    let env = OpenBaoEnv::from_env(test).await?;
    let jwks = JwksServer::start().await;
    let mounts = SeedMounts::configure(&env, &jwks.url, None).await;
    let bao = OpenBao::new(&env.addr, None).unwrap();
    Some(Setup {
        env,
        jwks,
        mounts,
        bao,
    })
}

/// A grant for `env_id` signed by a key of its own (berth: one key per grant), listed in the
/// JWKS besides the keys already there.
fn grant(
    jwks: &JwksServer,
    listed: &mut Vec<berth_crypto::PublicJwk>,
    claims: &serde_json::Value,
) -> String {
    let signer = JwtSigner::generate().unwrap();
    listed.push(signer.public_jwk());
    jwks.set_keys(listed.clone());
    signer.sign(claims).unwrap()
}

fn unique(prefix: &str) -> String {
    format!(
        "{prefix}-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

#[tokio::test]
async fn a_token_reads_its_own_environment_only() {
    let Some(s) = setup("a_token_reads_its_own_environment_only").await else {
        return;
    };
    let (env_a, env_b) = (unique("env-a"), unique("env-b"));
    let v1 = s.mounts.put_secret(&env_a, "pg_password", "first").await;
    let v2 = s.mounts.put_secret(&env_a, "pg_password", "second").await;
    assert_eq!((v1, v2), (1, 2));
    s.mounts.put_secret(&env_b, "pg_password", "theirs").await;

    let mut keys = Vec::new();
    let jti = uuid::Uuid::new_v4().to_string();
    let jwt = grant(&s.jwks, &mut keys, &grant_claims(&env_a, &jti));
    let token = s
        .bao
        .login_jwt(&s.mounts.auth_mount, &s.mounts.role, &jwt)
        .await
        .unwrap();
    assert_eq!(token.meta.get("env_id"), Some(&env_a));
    assert_eq!(token.meta.get("grant_jti"), Some(&jti));
    assert!(token.ttl_s > 0 && token.ttl_s <= 86_400, "{}", token.ttl_s);
    assert!(!format!("{token:?}").contains(&token.token));

    // Both manifest forms, under the seed's mount name: the agent reads from its adopted mount.
    let ours = SecretPath::parse(&format!("monky/{env_a}/see/pg_password")).unwrap();
    let ours_doc24 = SecretPath::parse(&format!("monky/data/{env_a}/see/pg_password")).unwrap();
    let kv = &s.mounts.kv_mount;
    let read = |path: SecretPath, version: Option<u32>| {
        let (bao, token) = (s.bao.clone(), token.token.clone());
        async move { bao.kv_read(&token, kv, &path, version).await }
    };
    assert_eq!(
        read(ours.clone(), Some(1)).await.unwrap().as_deref(),
        Some("first")
    );
    assert_eq!(
        read(ours.clone(), None).await.unwrap().as_deref(),
        Some("second")
    );
    assert_eq!(
        read(ours_doc24, Some(2)).await.unwrap().as_deref(),
        Some("second")
    );
    assert_eq!(read(ours, Some(7)).await.unwrap(), None, "no such version");
    let missing = SecretPath::parse(&format!("monky/{env_a}/see/nothing")).unwrap();
    assert_eq!(read(missing, None).await.unwrap(), None);

    // env-B's secret: the templated policy names the token's own env only.
    let theirs = SecretPath::parse(&format!("monky/{env_b}/see/pg_password")).unwrap();
    let err = read(theirs, None).await.unwrap_err();
    assert!(matches!(err, BaoError::Denied(_)), "{err}");
    assert!(!err.to_string().contains(&token.token), "{err}");
    // Outside `see/`: denied too.
    s.env
        .must(
            "POST",
            &format!("{kv}/data/{env_a}/other/x"),
            Some(&serde_json::json!({"data": {"value": "v"}})),
        )
        .await;
    let other = SecretPath::parse(&format!("monky/{env_a}/other/x")).unwrap();
    assert!(matches!(read(other, None).await, Err(BaoError::Denied(_))));

    s.mounts.teardown().await;
}

#[tokio::test]
async fn grants_for_another_audience_or_kind_are_refused() {
    let Some(s) = setup("grants_for_another_audience_or_kind_are_refused").await else {
        return;
    };
    let env_id = unique("env");
    let mut keys = Vec::new();
    let mut wrong_aud = grant_claims(&env_id, "jti-aud");
    wrong_aud["aud"] = "berth-agents".into();
    let mut wrong_kind = grant_claims(&env_id, "jti-kind");
    wrong_kind["kind"] = "agent-token".into();
    let mut expired = grant_claims(&env_id, "jti-exp");
    expired["exp"] = (expired["iat"].as_u64().unwrap() - 600).into();
    expired["nbf"] = (expired["iat"].as_u64().unwrap() - 1200).into();
    for (what, claims) in [
        ("audience", wrong_aud),
        ("kind", wrong_kind),
        ("expired", expired),
    ] {
        let jwt = grant(&s.jwks, &mut keys, &claims);
        let err = s
            .bao
            .login_jwt(&s.mounts.auth_mount, &s.mounts.role, &jwt)
            .await
            .expect_err(what);
        assert!(matches!(err, BaoError::Denied(_)), "{what}: {err}");
    }
    // A key OpenBao cannot find in the JWKS.
    let stranger = JwtSigner::generate()
        .unwrap()
        .sign(&grant_claims(&env_id, "jti-stranger"))
        .unwrap();
    let err = s
        .bao
        .login_jwt(&s.mounts.auth_mount, &s.mounts.role, &stranger)
        .await
        .unwrap_err();
    assert!(matches!(err, BaoError::Denied(_)), "{err}");
    // The right grant still works.
    let jwt = grant(&s.jwks, &mut keys, &grant_claims(&env_id, "jti-ok"));
    s.bao
        .login_jwt(&s.mounts.auth_mount, &s.mounts.role, &jwt)
        .await
        .unwrap();
    s.mounts.teardown().await;
}

#[tokio::test]
async fn upkeep_renews_a_short_token_and_releases_an_old_one() {
    let Some(s) = setup("upkeep_renews_a_short_token_and_releases_an_old_one").await else {
        return;
    };
    let env_id = unique("env");
    let mut keys = Vec::new();
    let now = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs()
    };

    // Seed lifetimes (24 h): nothing to do.
    let jwt = grant(&s.jwks, &mut keys, &grant_claims(&env_id, "jti-1"));
    let long = s
        .bao
        .login_jwt(&s.mounts.auth_mount, &s.mounts.role, &jwt)
        .await
        .unwrap();
    assert_eq!(
        upkeep(&s.bao, &long.token, now()).await.unwrap(),
        Upkeep::Fine
    );

    // A 30 s token is below 12 h: renewed (back to the role's ttl, inside its max).
    s.mounts.set_token_ttl(30, 3600).await;
    let jwt = grant(&s.jwks, &mut keys, &grant_claims(&env_id, "jti-2"));
    let short = s
        .bao
        .login_jwt(&s.mounts.auth_mount, &s.mounts.role, &jwt)
        .await
        .unwrap();
    assert!(short.ttl_s <= 30, "{}", short.ttl_s);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let before = s.bao.lookup_self(&short.token).await.unwrap();
    assert!(before.ttl_s < 30, "{before:?}");
    match upkeep(&s.bao, &short.token, now()).await.unwrap() {
        Upkeep::Renewed(info) => {
            assert!(info.ttl_s > before.ttl_s, "{info:?} after {before:?}");
            assert_eq!(info.accessor, short.accessor);
            assert_eq!(info.meta.get("env_id"), Some(&env_id));
        }
        other => panic!("expected a renewal, got {other:?}"),
    }

    // Older than 30 d − 2 d: re-lease, whatever its ttl.
    let created = s.bao.lookup_self(&long.token).await.unwrap().creation_time;
    assert!(created > 0);
    assert_eq!(
        upkeep(&s.bao, &long.token, created + RELEASE_AFTER_S + 1)
            .await
            .unwrap(),
        Upkeep::Release
    );
    assert_eq!(
        upkeep(&s.bao, &long.token, created + RELEASE_AFTER_S - 60)
            .await
            .unwrap(),
        Upkeep::Fine
    );

    // The caller then revokes the old token: it is gone.
    s.bao.revoke_self(&long.token).await.unwrap();
    let err = s.bao.lookup_self(&long.token).await.unwrap_err();
    assert!(matches!(err, BaoError::Denied(_)), "{err}");
    let err = upkeep(&s.bao, &long.token, now()).await.unwrap_err();
    assert!(matches!(err, BaoError::Denied(_)), "{err}");
    s.mounts.teardown().await;
}

#[tokio::test]
async fn an_unreachable_openbao_is_temporary() {
    // A port nothing listens on: bind one, learn it, close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let bao = OpenBao::new(&format!("http://127.0.0.1:{port}"), None).unwrap();
    let err = bao.lookup_self("s.secret-token").await.unwrap_err();
    assert!(err.is_temporary(), "{err}");
    assert!(!err.to_string().contains("secret-token"), "{err}");
    assert!(OpenBao::new("http://bao.example:8200", None).is_err());
}
