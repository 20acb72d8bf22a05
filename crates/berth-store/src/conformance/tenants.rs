//! Conformance cases of tenants and their API tokens.

use super::support::*;

pub async fn tenants(store: &DynStore) {
    let name = unique("tenant");
    let at = now();
    let id = TenantId::new();
    let created = store
        .create_tenant(id, &name, operator(), at)
        .await
        .expect("create tenant");
    assert_eq!(
        created,
        Tenant {
            id,
            name: name.clone(),
            created_at: millis(at)
        }
    );
    assert_eq!(
        store.get_tenant(id).await.expect("get tenant"),
        Some(created.clone())
    );
    assert_eq!(
        store
            .get_tenant(TenantId::new())
            .await
            .expect("get unknown tenant"),
        None
    );

    assert_conflict(
        store
            .create_tenant(TenantId::new(), &name, operator(), now())
            .await,
        "tenant_name",
    );

    let ensured = store
        .ensure_tenant(&name, now())
        .await
        .expect("ensure existing tenant");
    assert_eq!(
        ensured, created,
        "ensure_tenant returns the existing tenant unchanged"
    );

    let fresh = unique("ensured");
    let first = store
        .ensure_tenant(&fresh, at)
        .await
        .expect("ensure new tenant");
    assert_eq!(first.name, fresh);
    assert_eq!(first.created_at, millis(at));
    let second = store
        .ensure_tenant(&fresh, now())
        .await
        .expect("ensure again");
    assert_eq!(first, second);
    assert_eq!(
        store.get_tenant(first.id).await.expect("get ensured"),
        Some(first)
    );
}

pub async fn api_tokens(store: &DynStore) {
    let tenant = tenant(store).await;
    let other = self::tenant(store).await;
    assert!(!store
        .has_operator_token(tenant.id)
        .await
        .expect("has operator"));

    let hash = token_hash();
    let at = now();
    let created = store
        .create_api_token(NewApiToken {
            created_by: None,
            id: TokenId::new(),
            tenant_id: tenant.id,
            name: "ci".to_string(),
            role: Role::Deployer,
            operator: false,
            token_hash: hash.clone(),
            created_at: at,
        })
        .await
        .expect("create api token");
    assert_eq!(created.tenant_id, tenant.id);
    assert_eq!(created.role, Role::Deployer);
    assert!(!created.operator);
    assert_eq!(created.created_at, millis(at));
    assert_eq!(
        store.api_token_by_hash(&hash).await.expect("lookup"),
        Some(created.clone())
    );
    assert_eq!(
        store
            .api_token_by_hash(&token_hash())
            .await
            .expect("lookup unknown"),
        None
    );
    assert!(!store
        .has_operator_token(tenant.id)
        .await
        .expect("has operator"));

    let duplicate = store
        .create_api_token(NewApiToken {
            created_by: None,
            id: TokenId::new(),
            tenant_id: other.id,
            name: "copy".to_string(),
            role: Role::Admin,
            operator: false,
            token_hash: hash.clone(),
            created_at: now(),
        })
        .await;
    assert_conflict(duplicate, "api_token_hash");

    for (role, operator) in [(Role::Admin, true), (Role::Viewer, false)] {
        let hash = token_hash();
        let token = store
            .create_api_token(NewApiToken {
                created_by: None,
                id: TokenId::new(),
                tenant_id: tenant.id,
                name: role.as_str().to_string(),
                role,
                operator,
                token_hash: hash.clone(),
                created_at: now(),
            })
            .await
            .expect("create api token");
        assert_eq!((token.role, token.operator), (role, operator));
        assert_eq!(
            store.api_token_by_hash(&hash).await.expect("lookup"),
            Some(token)
        );
    }
    assert!(store
        .has_operator_token(tenant.id)
        .await
        .expect("has operator"));
    assert!(!store
        .has_operator_token(other.id)
        .await
        .expect("other has operator"));
}

/// Web UI sessions: found by the hash only while unexpired, acting as their token (tenant and
/// role), gone once deleted; creating one sweeps the expired.
pub async fn ui_sessions(store: &DynStore) {
    let tenant = tenant(store).await;
    let token = store
        .create_api_token(NewApiToken {
            created_by: None,
            id: TokenId::new(),
            tenant_id: tenant.id,
            name: "browser".to_string(),
            role: Role::Viewer,
            operator: false,
            token_hash: token_hash(),
            created_at: now(),
        })
        .await
        .expect("create api token");
    let at = now();
    let (live, old) = (token_hash(), token_hash());
    store
        .create_ui_session(crate::NewUiSession {
            id_hash: old.clone(),
            token_id: token.id,
            created_at: at - Duration::hours(13),
            expires_at: at - Duration::hours(1),
        })
        .await
        .expect("create an old session");
    assert_eq!(
        store.ui_session(&old, at).await.expect("look up expired"),
        None,
        "an expired session is not found"
    );
    store
        .create_ui_session(crate::NewUiSession {
            id_hash: live.clone(),
            token_id: token.id,
            created_at: at,
            expires_at: at + Duration::hours(12),
        })
        .await
        .expect("create session");
    let found = store
        .ui_session(&live, at + Duration::hours(1))
        .await
        .expect("look up")
        .expect("the live session is found");
    assert_eq!(found.token, token);
    assert_eq!(found.expires_at, millis(at + Duration::hours(12)));
    assert_eq!(
        store
            .ui_session(&live, at + Duration::hours(12))
            .await
            .expect("look up at expiry"),
        None,
        "a session ends at its expiry"
    );
    assert_eq!(
        store.ui_session(&token_hash(), at).await.expect("unknown"),
        None
    );
    // The old one was swept by the second create: deleting it finds nothing.
    assert!(!store.delete_ui_session(&old).await.expect("delete swept"));
    assert!(store.delete_ui_session(&live).await.expect("sign out"));
    assert_eq!(store.ui_session(&live, at).await.expect("after"), None);
    assert!(!store.delete_ui_session(&live).await.expect("again"));
}
