//! Builtin secrets and deploy grants over HTTP: the admin secret API (values go in, never out),
//! the install kit, the agent's lease and its `builtin` KV read (shaped like OpenBao's KV v2).
//!
//! A value is decrypted only for the KV read of an agent that proves its certificate, belongs
//! to the path's environment and presents a live lease of it; it is never logged.

use crate::infra::install::sh_word;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_proto::agent::Deleted;
use berth_proto::desired::{
    KitView, LeaseRequest, LeaseResponse, PutSecret, SecretPath, SecretVersionView, BUILTIN_MOUNT,
    GRANT_TTL_SECS, LEASE_HEADER,
};
use berth_proto::error::codes;
use berth_store::{DesiredEnvironment, GrantKind, SealedSecret, SecretMeta, StoreError};
use serde::Deserialize;

use crate::infra::envelope;
use crate::infra::error::{ApiError, ApiResult};
use crate::infra::grants::{self, LeaseRefusal};
use crate::infra::rate;
use crate::services::caller::{Caller, DesiredCaller};
use crate::services::desired::agent_environment;
use crate::SharedState;

/// The largest value a secret may hold.
pub const MAX_SECRET_BYTES: usize = 64 * 1024;
/// Where the install kit stages the grant on the host.
pub const BOOTSTRAP_FILE: &str = "/etc/berth-agent/bootstrap.jwt";

fn secret_not_found(key: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        codes::SECRET_NOT_FOUND,
        format!("no secret at {key:?}"),
    )
}

fn env_mismatch(detail: impl Into<String>) -> ApiError {
    ApiError::forbidden(codes::AGENT_ENV_MISMATCH, detail)
}

/// The admin path of a secret is its store key, `<env>/<rest>` (no mount: a mount names where
/// an agent reads, not what is stored). Its segments follow [`SecretPath::parse`]'s rules, and
/// an environment may not be called `data` (the doc-24 form's marker).
fn admin_key(path: &str) -> ApiResult<String> {
    match SecretPath::parse(&format!("{BUILTIN_MOUNT}/{path}")) {
        Some(p) if p.store_key() == path => Ok(p.store_key()),
        _ => Err(ApiError::unprocessable(
            codes::INVALID_REQUEST,
            format!(
                "{path:?} is not a secret path: `<env>/<name>[/…]`, each segment letters, \
                 digits or `-_.+@=`"
            ),
        )),
    }
}

fn view(meta: SecretMeta) -> SecretVersionView {
    SecretVersionView {
        path: meta.key,
        version: meta.version,
        created_at: meta.created_at,
        deleted: meta.deleted_at.is_some(),
    }
}

/// Store a new version of a secret: the given `value`, or 32 random bytes (`generate`). The
/// answer is the version's metadata, never the value.
pub async fn put_secret(
    state: &SharedState,
    caller: &Caller,
    path: String,
    req: PutSecret,
) -> ApiResult<SecretVersionView> {
    caller.require_deployer()?;
    let key = admin_key(&path)?;
    let value = match (req.value, req.generate) {
        (Some(value), false) => value,
        (None, true) => envelope::generate_value(),
        _ => {
            return Err(ApiError::unprocessable(
                codes::INVALID_REQUEST,
                "give exactly one of `value` and `generate: true`",
            ))
        }
    };
    if value.len() > MAX_SECRET_BYTES {
        return Err(ApiError::unprocessable(
            codes::INVALID_REQUEST,
            format!("a secret holds at most {MAX_SECRET_BYTES} bytes"),
        ));
    }
    let tenant = caller.tenant();
    // The version is part of the associated data, so the value is sealed for the version it
    // will have; a concurrent put that took it first makes this one seal again for the next.
    let mut attempts = 0;
    let meta = loop {
        attempts += 1;
        let version = state.store.secret_head(tenant, &key).await? + 1;
        let sealed = envelope::seal(&state.master_key, tenant, &key, version, value.as_bytes())
            .map_err(|e| ApiError::internal(&e))?;
        let secret = SealedSecret {
            meta: SecretMeta {
                tenant_id: tenant,
                key: key.clone(),
                version,
                created_at: state.config.clock.now(),
                created_by: crate::services::caller::actor(caller),
                deleted_at: None,
            },
            wrapped_key: sealed.wrapped_key,
            ciphertext: sealed.ciphertext,
        };
        match state.store.put_secret(secret).await {
            Err(StoreError::Conflict {
                constraint: "secret_version",
            }) if attempts < 2 => continue,
            other => break other?,
        }
    };
    Ok(view(meta))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ListSecrets {
    /// Only paths that start with this (`qa/` for one environment's).
    #[serde(default)]
    pub prefix: Option<String>,
}

/// The latest live version of every secret (metadata only).
pub async fn list_secrets(
    state: &SharedState,
    caller: &Caller,
    query: ListSecrets,
) -> ApiResult<Vec<SecretVersionView>> {
    caller.can_read()?;
    let items = state
        .store
        .list_secrets(caller.tenant(), query.prefix.as_deref().unwrap_or(""))
        .await?;
    Ok(items.into_iter().map(view).collect())
}

/// Every version of a secret, deleted ones too (metadata only). The path ends in `/versions`:
/// `GET /api/v1/secrets/qa/see/pg/versions`.
pub async fn secret_versions(
    state: &SharedState,
    caller: &Caller,
    path: String,
) -> ApiResult<Vec<SecretVersionView>> {
    caller.can_read()?;
    let Some(path) = path.strip_suffix("/versions") else {
        return Err(ApiError::not_found("route"));
    };
    let key = admin_key(path)?;
    let versions = state.store.secret_versions(caller.tenant(), &key).await?;
    if versions.is_empty() {
        return Err(secret_not_found(&key));
    }
    Ok(versions.into_iter().map(view).collect())
}

/// Mark every version of a secret deleted: agents' reads of it answer `404 SECRET_NOT_FOUND`.
pub async fn delete_secret(
    state: &SharedState,
    caller: &Caller,
    path: String,
) -> ApiResult<Deleted> {
    caller.require_deployer()?;
    let key = admin_key(&path)?;
    let marked = state
        .store
        .delete_secret(
            caller.tenant(),
            &key,
            crate::services::caller::actor(caller),
            state.config.clock.now(),
        )
        .await?;
    if marked == 0 {
        return Err(secret_not_found(&key));
    }
    Ok(Deleted { deleted: true })
}

/// The one-line install command. The grant reaches the file through a bash here-string, never
/// through a command's arguments (so it shows in no process list); `umask 077` and `install -m
/// 0600` keep it private from creation.
fn install_command(
    server: &str,
    ca_fingerprint: &str,
    openbao: Option<&crate::OpenBaoSettings>,
    env: &str,
    grant: &str,
) -> String {
    let mut agent = vec![
        "berth-agent".to_string(),
        "--server".into(),
        sh_word(server),
        "--ca-fingerprint".into(),
        sh_word(ca_fingerprint),
        "--env".into(),
        sh_word(env),
        "--bootstrap-file".into(),
        BOOTSTRAP_FILE.into(),
    ];
    if let Some(bao) = openbao {
        agent.extend([
            "--openbao-addr".into(),
            sh_word(&bao.addr),
            "--openbao-auth-mount".into(),
            sh_word(&bao.auth_mount),
            "--openbao-role".into(),
            sh_word(&bao.role),
        ]);
    }
    format!(
        "umask 077 && install -D -m 0600 /dev/stdin {BOOTSTRAP_FILE} <<< {} && {}",
        sh_word(grant),
        agent.join(" ")
    )
}

/// Reveal an install kit: a bootstrap deploy grant for the environment. Every earlier grant of
/// the environment (kits and leases) is superseded in the same transaction, so an older kit
/// stops working. The grant is in this answer only.
pub async fn kit(state: &SharedState, caller: &Caller, name: String) -> ApiResult<KitView> {
    caller.require_admin()?;
    let env = state
        .store
        .desired_environment(caller.tenant(), &name)
        .await?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                codes::ENVIRONMENT_NOT_FOUND,
                format!("no environment named {name:?}"),
            )
        })?;
    let now = state.config.clock.now();
    let minted = grants::mint(state, &env, GrantKind::Kit, now, grants::GRANT_TTL)?;
    let (jti, expires_at) = (minted.grant.jti.clone(), minted.grant.expires_at);
    let superseded = state
        .store
        .record_kit_grant(minted.grant, crate::services::caller::actor(caller))
        .await?;
    // The superseded grants leave the JWKS, and OpenBao must forget their keys too; the tokens
    // they were exchanged for are revoked (berth refuses them either way).
    grants::supersede_in_openbao(state, superseded.token_accessors);
    Ok(KitView {
        install_command: install_command(
            &state.config.public_url(),
            &state.ca.fingerprint(),
            state.config.openbao.as_ref(),
            &env.name,
            &minted.jwt,
        ),
        environment: env.name,
        grant: minted.jwt,
        jti,
        expires_at,
    })
}

/// The lease of an agent already known to be in `env`: a new `lease` grant (recorded; it
/// supersedes nothing), and where to use it.
pub(crate) async fn lease_for(
    state: &SharedState,
    env: &DesiredEnvironment,
) -> ApiResult<LeaseResponse> {
    let now = state.config.clock.now();
    let minted = grants::mint(state, env, GrantKind::Lease, now, grants::GRANT_TTL)?;
    state.store.record_grant(minted.grant).await?;
    let (mount, role, addr) = match &state.config.openbao {
        Some(bao) => (bao.auth_mount.clone(), bao.role.clone(), bao.addr.clone()),
        None => (
            BUILTIN_MOUNT.to_string(),
            String::new(),
            state.config.public_url(),
        ),
    };
    Ok(LeaseResponse {
        env_id: env.name.clone(),
        login_jwt: minted.jwt,
        ttl_s: GRANT_TTL_SECS,
        mount,
        role,
        addr,
    })
}

pub async fn lease(
    state: SharedState,
    caller: DesiredCaller,
    req: LeaseRequest,
) -> ApiResult<Response> {
    // The bucket (5/h, 429 LEASE_RATE_LIMITED) is counted before anything is minted.
    let env = agent_environment(&state, &caller, &req.env_id, Some(rate::LEASE)).await?;
    let lease = lease_for(&state, &env).await?;
    Ok(([(header::CACHE_CONTROL, "no-store")], Json(lease)).into_response())
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct KvQuery {
    /// The version to read; latest when absent.
    #[serde(default)]
    pub version: Option<u32>,
}

pub async fn kv_read(
    state: SharedState,
    caller: DesiredCaller,
    headers: HeaderMap,
    path: String,
    version: Option<u32>,
) -> ApiResult<Response> {
    let Some(path) = SecretPath::parse(&path) else {
        return Err(ApiError::unprocessable(
            codes::INVALID_REQUEST,
            "not a secret path: `<mount>/<env>/<name>` or `<mount>/data/<env>/<name>`",
        ));
    };
    let env = agent_environment(&state, &caller, &path.env, None).await?;
    let lease_required = |why: &str| {
        ApiError::unauthenticated(
            codes::LEASE_REQUIRED,
            format!(
                "reading a secret needs a live lease of this environment in {LEASE_HEADER}: {why}"
            ),
        )
    };
    let Some(token) = headers.get(LEASE_HEADER).and_then(|v| v.to_str().ok()) else {
        return Err(lease_required("none was presented"));
    };
    let now = state.config.clock.now();
    let grant = match grants::verify_lease(&state, token.trim(), &env, now).await? {
        Ok(grant) => grant,
        Err(LeaseRefusal::WrongEnvironment) => {
            return Err(env_mismatch(format!(
                "the lease is not one of environment {:?}",
                env.name
            )))
        }
        Err(refusal) => {
            tracing::info!(
                caller = caller.agent_key(),
                reason = refusal.as_str(),
                "lease refused"
            );
            return Err(lease_required(refusal.as_str()));
        }
    };
    let key = path.store_key();
    let Some(sealed) = state.store.get_secret(env.tenant_id, &key, version).await? else {
        return Err(secret_not_found(&key));
    };
    let version = sealed.meta.version;
    let value =
        envelope::open_sealed(&state.master_key, sealed).map_err(|e| ApiError::internal(&e))?;
    let value = String::from_utf8(value).map_err(|e| ApiError::internal(&e.utf8_error()))?;
    tracing::debug!(caller = caller.agent_key(), jti = %grant.jti, key, version, "builtin secret read");
    let body = serde_json::json!({
        "data": { "data": { "value": value }, "metadata": { "version": version } }
    });
    Ok(([(header::CACHE_CONTROL, "no-store")], Json(body)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admin_paths_are_store_keys() {
        assert_eq!(admin_key("qa/see/pg").unwrap(), "qa/see/pg");
        for bad in ["", "qa", "data/qa/x", "qa//x", "qa/../x", "qa/x y", "/qa/x"] {
            assert!(admin_key(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_install_command_is_one_line_and_quotes_its_words() {
        let bao = crate::OpenBaoSettings::new("https://bao:8200", "kv");
        let c = install_command(
            "https://b:8443",
            "sha256:ab",
            Some(&bao),
            "qa",
            "aaa.bbb.ccc",
        );
        assert!(!c.contains('\n'));
        assert_eq!(c, "umask 077 && install -D -m 0600 /dev/stdin /etc/berth-agent/bootstrap.jwt <<< 'aaa.bbb.ccc' && berth-agent --server 'https://b:8443' --ca-fingerprint 'sha256:ab' --env 'qa' --bootstrap-file /etc/berth-agent/bootstrap.jwt --openbao-addr 'https://bao:8200' --openbao-auth-mount 'jwt-berth' --openbao-role 'see-env'");
        assert_eq!(sh_word("it's"), r"'it'\''s'");
    }
}
