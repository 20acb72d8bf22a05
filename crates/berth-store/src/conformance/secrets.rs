//! Conformance cases of builtin secrets and deploy grants: versions that only grow (a taken
//! version is a conflict, never an overwrite), deletion of every version, audit entries that
//! name the path and version only, and grants superseded, used once and served in the JWKS only
//! while live.

use berth_proto::audit::actions;

use super::deployments::{audit_actions, create_environment};
use super::support::*;
use crate::{Grant, GrantKind, GrantUse, SealedSecret, SecretMeta};

fn sealed(tenant: TenantId, key: &str, version: u32, marker: u8) -> SealedSecret {
    SealedSecret {
        meta: SecretMeta {
            tenant_id: tenant,
            key: key.to_string(),
            version,
            created_at: millis(now()),
            created_by: operator(),
            deleted_at: None,
        },
        wrapped_key: vec![marker; 60],
        ciphertext: vec![marker, 1, 2, 3],
    }
}

/// Puts the next version the way the server does: the head plus one.
async fn put_next(store: &DynStore, tenant: TenantId, key: &str, marker: u8) -> SecretMeta {
    let next = store.secret_head(tenant, key).await.expect("head") + 1;
    store
        .put_secret(sealed(tenant, key, next, marker))
        .await
        .expect("put secret")
}

pub async fn secret_versions_and_delete(store: &DynStore) {
    let t = tenant(store).await.id;
    let other = tenant(store).await.id;
    assert_eq!(store.secret_head(t, "qa/see/pg").await.unwrap(), 0);
    assert_eq!(put_next(store, t, "qa/see/pg", 1).await.version, 1);
    assert_eq!(put_next(store, t, "qa/see/pg", 2).await.version, 2);
    put_next(store, t, "qa/see/api", 3).await;
    put_next(store, t, "prod/see/pg", 4).await;

    let latest = store
        .get_secret(t, "qa/see/pg", None)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(latest.meta.version, 2);
    assert_eq!(latest.ciphertext, vec![2, 1, 2, 3]);
    let first = store
        .get_secret(t, "qa/see/pg", Some(1))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.wrapped_key, vec![1; 60]);
    assert!(store
        .get_secret(t, "qa/see/pg", Some(3))
        .await
        .unwrap()
        .is_none());
    // Another tenant sees none of it.
    assert!(store
        .get_secret(other, "qa/see/pg", None)
        .await
        .unwrap()
        .is_none());
    assert!(store.list_secrets(other, "").await.unwrap().is_empty());

    let listed: Vec<(String, u32)> = store
        .list_secrets(t, "qa/")
        .await
        .unwrap()
        .into_iter()
        .map(|m| (m.key, m.version))
        .collect();
    assert_eq!(
        listed,
        vec![("qa/see/api".to_string(), 1), ("qa/see/pg".to_string(), 2)]
    );
    assert_eq!(store.list_secrets(t, "").await.unwrap().len(), 3);
    // `_` and `%` in a prefix are characters, not patterns.
    assert!(store.list_secrets(t, "q_/").await.unwrap().is_empty());

    // A taken version is a conflict, never an overwrite.
    let again = store.put_secret(sealed(t, "qa/see/pg", 2, 9)).await;
    assert!(
        matches!(
            again,
            Err(StoreError::Conflict {
                constraint: "secret_version"
            })
        ),
        "{again:?}"
    );

    let gone = store
        .delete_secret(t, "qa/see/pg", operator(), now())
        .await
        .unwrap();
    assert_eq!(gone, 2);
    assert!(store
        .get_secret(t, "qa/see/pg", None)
        .await
        .unwrap()
        .is_none());
    assert!(store
        .get_secret(t, "qa/see/pg", Some(1))
        .await
        .unwrap()
        .is_none());
    let versions = store.secret_versions(t, "qa/see/pg").await.unwrap();
    assert_eq!(versions.len(), 2);
    assert!(versions.iter().all(|v| v.deleted_at.is_some()));
    assert_eq!(store.list_secrets(t, "qa/").await.unwrap().len(), 1);
    // Deleting again marks nothing and records nothing.
    assert_eq!(
        store
            .delete_secret(t, "qa/see/pg", operator(), now())
            .await
            .unwrap(),
        0
    );
    // Versions are never reused: the next put after a delete is 3.
    assert_eq!(put_next(store, t, "qa/see/pg", 5).await.version, 3);

    let audit: Vec<_> = audit_actions(store, t)
        .await
        .into_iter()
        .filter(|(a, _)| a.starts_with("secret."))
        .collect();
    assert_eq!(
        audit,
        vec![
            (actions::SECRET_PUT.to_string(), "qa/see/pg".to_string()),
            (actions::SECRET_PUT.to_string(), "qa/see/pg".to_string()),
            (actions::SECRET_PUT.to_string(), "qa/see/api".to_string()),
            (actions::SECRET_PUT.to_string(), "prod/see/pg".to_string()),
            (actions::SECRET_DELETE.to_string(), "qa/see/pg".to_string()),
            (actions::SECRET_PUT.to_string(), "qa/see/pg".to_string()),
        ]
    );
}

pub async fn secret_concurrent_put_conflicts(store: &DynStore) {
    let t = tenant(store).await.id;
    // Ten writers that all read head 0: exactly one gets version 1.
    let puts = (0..10u8).map(|i| {
        let store = store.clone();
        async move { store.put_secret(sealed(t, "qa/x", 1, i)).await }
    });
    let results = futures_join_all(puts).await;
    let won = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(won, 1, "{results:?}");
    assert!(results.iter().all(|r| matches!(
        r,
        Ok(_)
            | Err(StoreError::Conflict {
                constraint: "secret_version"
            })
    )));
}

async fn futures_join_all<F: std::future::Future + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output>
where
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.expect("task"));
    }
    out
}

fn grant(
    tenant: TenantId,
    env: berth_proto::EnvironmentId,
    kind: GrantKind,
    jti: &str,
    ttl: Duration,
) -> Grant {
    let at = millis(now());
    Grant {
        jti: jti.to_string(),
        tenant_id: tenant,
        environment_id: env,
        kind,
        public_jwk: format!(r#"{{"kid":"{jti}","kty":"EC"}}"#),
        issued_at: at,
        expires_at: at + ttl,
        superseded_at: None,
        used_at: None,
        token_accessor: None,
    }
}

fn kids(jwks: Vec<String>) -> Vec<String> {
    let mut kids: Vec<String> = jwks
        .iter()
        .map(|j| {
            serde_json::from_str::<serde_json::Value>(j).unwrap()["kid"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    kids.sort();
    kids
}

pub async fn grant_supersede_use_and_jwks(store: &DynStore) {
    let t = tenant(store).await.id;
    let other = tenant(store).await.id;
    let env = create_environment(store, t, "qa").await.id;
    let other_env = create_environment(store, t, "prod").await.id;
    let u = unique("g");
    let jti = |s: &str| format!("{u}-{s}");
    let hour = Duration::hours(1);

    store
        .record_grant(grant(t, env, GrantKind::Kit, &jti("kit1"), hour))
        .await
        .unwrap();
    store
        .record_grant(grant(t, env, GrantKind::Lease, &jti("lease1"), hour))
        .await
        .unwrap();
    store
        .record_grant(grant(t, other_env, GrantKind::Lease, &jti("prod"), hour))
        .await
        .unwrap();
    store
        .record_grant(grant(
            t,
            env,
            GrantKind::Lease,
            &jti("old"),
            Duration::seconds(-1),
        ))
        .await
        .unwrap();
    let dup = store
        .record_grant(grant(t, env, GrantKind::Lease, &jti("lease1"), hour))
        .await;
    assert!(
        matches!(
            dup,
            Err(StoreError::Conflict {
                constraint: "grant_jti"
            })
        ),
        "{dup:?}"
    );
    // Expired grants are not served.
    assert_eq!(
        kids(store.live_grant_jwks(Some(t), now()).await.unwrap()),
        vec![jti("kit1"), jti("lease1"), jti("prod")]
    );
    assert!(store
        .live_grant_jwks(Some(other), now())
        .await
        .unwrap()
        .is_empty());

    // A kit supersedes every earlier grant of its environment only, and names the OpenBao
    // tokens they were exchanged for.
    assert_eq!(
        store
            .mark_grant_used(&jti("lease1"), "acc-old", now())
            .await
            .unwrap(),
        GrantUse::First
    );
    let superseded = store
        .record_kit_grant(
            grant(t, env, GrantKind::Kit, &jti("kit2"), hour),
            operator(),
        )
        .await
        .unwrap();
    assert_eq!(superseded.count, 3);
    assert_eq!(superseded.token_accessors, vec!["acc-old".to_string()]);
    assert_eq!(
        kids(store.live_grant_jwks(Some(t), now()).await.unwrap()),
        vec![jti("kit2"), jti("prod")]
    );
    let old = store.grant(&jti("kit1")).await.unwrap().unwrap();
    assert!(old.superseded_at.is_some());
    assert_eq!(old.kind, GrantKind::Kit);
    let kit = store.grant(&jti("kit2")).await.unwrap().unwrap();
    assert_eq!(kit.superseded_at, None);
    assert_eq!(kit.environment_id, env);
    assert!(audit_actions(store, t)
        .await
        .contains(&(actions::ENVIRONMENT_KIT.to_string(), env.to_string())));

    // Used once: the first accessor wins, the same one again is a retry, another a replay.
    assert_eq!(
        store
            .mark_grant_used(&jti("kit2"), "acc-1", now())
            .await
            .unwrap(),
        GrantUse::First
    );
    assert_eq!(
        store
            .mark_grant_used(&jti("kit2"), "acc-1", now())
            .await
            .unwrap(),
        GrantUse::Again
    );
    assert_eq!(
        store
            .mark_grant_used(&jti("kit2"), "acc-2", now())
            .await
            .unwrap(),
        GrantUse::Replay
    );
    assert_eq!(
        store
            .mark_grant_used("no-such-jti", "acc-1", now())
            .await
            .unwrap(),
        GrantUse::Unknown
    );
    let used = store.grant(&jti("kit2")).await.unwrap().unwrap();
    assert_eq!(used.token_accessor.as_deref(), Some("acc-1"));
    assert!(used.used_at.is_some());
    assert_eq!(
        kids(store.live_grant_jwks(Some(t), now()).await.unwrap()),
        vec![jti("prod")]
    );
    assert!(kids(store.live_grant_jwks(None, now()).await.unwrap()).contains(&jti("prod")));

    assert_eq!(store.supersede_grants(other_env, now()).await.unwrap(), 1);
    assert!(store
        .live_grant_jwks(Some(t), now())
        .await
        .unwrap()
        .is_empty());
}
