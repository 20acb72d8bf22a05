//! Desired-state environments (seed 001): the agent calls (checkin, bundle, report; each at the
//! seed's path and again under `/api`) and the admin calls around them (push a bundle, set the
//! desired sha, retire, read the state).
//!
//! Handlers stay thin: which action a checkin answers is [`checkin_answer`], pure. An agent
//! acts only for an environment of its tenant whose selector its labels satisfy; any other
//! `env_id`, existing or not, is the same `403 AGENT_ENV_MISMATCH`.

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_proto::desired::{
    paths, valid_sha, BundleView, Checkin, CheckinAction, CheckinResponse, DesiredAgentView,
    DesiredStateView, Report, ReportResponse, ReportResult, Retire, SetDesired, VaultInfo,
    AUDIT_LOG_TAIL_BYTES, BUILTIN_MOUNT, BUNDLE_CONTENT_TYPE, BUNDLE_SHA256_HEADER,
    BUNDLE_SHA_HEADER, MAX_LOG_TAIL_BYTES,
};
use berth_proto::error::codes;
use berth_proto::ErrorBody;
use berth_store::{
    Bundle, CheckinRecord, DesiredEnvironment, NewBundle, ReportRecord, SetDesiredOutcome,
};

use crate::http::auth::{Caller, DesiredCaller};
use crate::http::extract::{ApiJson, ApiPath};
use crate::infra::error::{ApiError, ApiResult};
use crate::infra::rate::{self};
use crate::services::desired::agent_environment;
use crate::SharedState;

/// A bundle's tar, as the OpenAPI document describes a push's body and a fetch's answer.
#[derive(utoipa::ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)] // Only documents the bytes.
pub struct BundleTar(Vec<u8>);

/// The largest bundle a push accepts.
pub const MAX_BUNDLE_BYTES: usize = 64 * 1024 * 1024;

/// What a checkin answers, from the environment and the sha the agent says it runs: `down`
/// once retired, `apply` while a desired sha is set and differs, else `none`.
pub(crate) fn checkin_answer(
    env: &DesiredEnvironment,
    applied: Option<&str>,
    vault: VaultInfo,
) -> CheckinResponse {
    let action = if env.retired {
        CheckinAction::Down
    } else if env.desired_sha.is_some() && env.desired_sha.as_deref() != applied {
        CheckinAction::Apply
    } else {
        CheckinAction::None
    };
    CheckinResponse {
        env_id: env.name.clone(),
        desired_sha: env.desired_sha.clone(),
        action,
        purge_volumes: action == CheckinAction::Down && env.purge_volumes,
        bundle_url: match (action, &env.desired_sha) {
            (CheckinAction::Apply, Some(sha)) => Some(paths::bundle(&env.name, sha)),
            _ => None,
        },
        checkin_interval_s: env.checkin_interval_secs,
        vault: Some(vault),
    }
}

/// Where the environment's secrets are: OpenBao's KV mount (the agent adopts `mount`), or
/// berth's own `builtin` store (read at `/v1/agent/kv/…` with a lease).
fn vault_info(state: &SharedState, env: &DesiredEnvironment) -> VaultInfo {
    let prefix = format!("{}/see", env.name);
    match &state.config.openbao {
        Some(bao) => VaultInfo {
            addr: bao.addr.clone(),
            mount: bao.kv_mount.clone(),
            prefix,
            auth_mount: bao.auth_mount.clone(),
            auth_role: bao.role.clone(),
        },
        None => VaultInfo {
            addr: state.config.public_url(),
            mount: BUILTIN_MOUNT.to_string(),
            prefix,
            auth_mount: BUILTIN_MOUNT.to_string(),
            auth_role: String::new(),
        },
    }
}

/// A report's text with every value of every version of the environment's `builtin` secrets
/// masked by the one rule (`berth_proto::redact`). OpenBao's values never reach berth; the
/// agent redacts those before it reports.
async fn redact_report(
    state: &SharedState,
    env: &DesiredEnvironment,
    texts: [&str; 2],
) -> ApiResult<[String; 2]> {
    let values = crate::services::desired::environment_values(state, env).await?;
    Ok(texts.map(|t| berth_proto::redact::redact(t, values.iter())))
}

/// The longest prefix of `text` of at most `max` bytes that ends on a char boundary.
fn cut(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

async fn checkin(
    state: SharedState,
    caller: DesiredCaller,
    req: Checkin,
) -> ApiResult<Json<CheckinResponse>> {
    let env = agent_environment(&state, &caller, &req.env_id, Some(rate::CHECKIN)).await?;
    state
        .store
        .record_checkin(CheckinRecord {
            environment_id: env.id,
            agent_key: caller.agent_key(),
            applied_sha: req.applied_sha.clone(),
            host: req.host,
            containers: req.containers,
            at: state.config.clock.now(),
        })
        .await?;
    let vault = vault_info(&state, &env);
    Ok(Json(checkin_answer(
        &env,
        req.applied_sha.as_deref(),
        vault,
    )))
}

async fn bundle(
    state: SharedState,
    caller: DesiredCaller,
    env_id: String,
    sha: String,
) -> ApiResult<Response> {
    let env = agent_environment(&state, &caller, &env_id, Some(rate::BUNDLE)).await?;
    let not_found = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            codes::BUNDLE_NOT_FOUND,
            format!("no bundle {sha} is published for {env_id}"),
        )
    };
    if !valid_sha(&sha) {
        return Err(not_found());
    }
    let content = state
        .store
        .get_bundle(env.id, &sha)
        .await?
        .ok_or_else(not_found)?;
    let sha_value = HeaderValue::from_str(&sha).map_err(|e| ApiError::internal(&e))?;
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(BUNDLE_CONTENT_TYPE),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(BUNDLE_SHA_HEADER, sha_value.clone());
    headers.insert(BUNDLE_SHA256_HEADER, sha_value);
    Ok((headers, content).into_response())
}

async fn report(
    state: SharedState,
    caller: DesiredCaller,
    req: Report,
) -> ApiResult<Json<ReportResponse>> {
    let env = agent_environment(&state, &caller, &req.env_id, Some(rate::REPORT)).await?;
    match (&req.sha, req.result) {
        (Some(sha), _) if !valid_sha(sha) => {
            return Err(ApiError::unprocessable(
                codes::INVALID_REQUEST,
                "sha must be 64 lowercase hex digits",
            ))
        }
        (None, ReportResult::Applied) => {
            return Err(ApiError::unprocessable(
                codes::INVALID_REQUEST,
                "an applied report names the sha it applied",
            ))
        }
        _ => {}
    }
    // Redacted whole, then cut: a cut first could split a secret and leave its head.
    let [log_tail, detail] = redact_report(
        &state,
        &env,
        [&req.log_tail, req.detail.as_deref().unwrap_or_default()],
    )
    .await?;
    let log_tail = cut(&log_tail, MAX_LOG_TAIL_BYTES).to_string();
    let detail = req.detail.is_some().then_some(detail);
    state
        .store
        .record_report(ReportRecord {
            tenant_id: env.tenant_id,
            environment_id: env.id,
            agent_key: caller.agent_key(),
            sha: req.sha,
            result: req.result,
            detail,
            audit_log_tail: cut(&log_tail, AUDIT_LOG_TAIL_BYTES).to_string(),
            log_tail,
            containers: req.containers,
            actor: caller.actor(),
            at: state.config.clock.now(),
        })
        .await?;
    Ok(Json(ReportResponse {
        env_id: env.name,
        recorded: true,
    }))
}

/// The agent's checkin (seed 001): records host, containers and the applied sha; answers
/// `apply` (with `bundle_url`), `none` or `down`. 6 per minute per environment.
#[utoipa::path(post, path = "/v1/agent/checkin", tag = "desired", request_body = Checkin,
    security(("agentCertificate" = [])),
    responses((status = 200, body = CheckinResponse),
        (status = 401, body = ErrorBody, description = "AGENT_UNAUTHENTICATED: the certificate is not bound to an agent"),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH: not an environment this agent may act for"),
        (status = 429, body = ErrorBody, description = "RATE_LIMITED, with Retry-After")))]
pub async fn agent_checkin(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    ApiJson(req): ApiJson<Checkin>,
) -> ApiResult<Json<CheckinResponse>> {
    checkin(state, caller, req).await
}

/// [`agent_checkin`] under the API prefix.
#[utoipa::path(post, path = "/api/v1/agent/checkin", tag = "desired", request_body = Checkin,
    security(("agentCertificate" = [])),
    responses((status = 200, body = CheckinResponse),
        (status = 401, body = ErrorBody, description = "AGENT_UNAUTHENTICATED: the certificate is not bound to an agent"),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH: not an environment this agent may act for"),
        (status = 429, body = ErrorBody, description = "RATE_LIMITED, with Retry-After")))]
pub async fn api_agent_checkin(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    ApiJson(req): ApiJson<Checkin>,
) -> ApiResult<Json<CheckinResponse>> {
    checkin(state, caller, req).await
}

/// A published bundle: the tar, `Cache-Control: no-store`, its sha in `X-Bundle-Sha` and
/// `X-Bundle-Sha256`. 10 per minute per environment.
#[utoipa::path(get, path = "/v1/agent/bundle/{env_id}/{sha}", tag = "desired",
    security(("agentCertificate" = [])), params(("env_id" = String, Path), ("sha" = String, Path)),
    responses((status = 200, content_type = "application/x-tar", body = BundleTar, description = "the bundle"),
        (status = 401, body = ErrorBody, description = "AGENT_UNAUTHENTICATED"),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH"),
        (status = 404, body = ErrorBody, description = "BUNDLE_NOT_FOUND"),
        (status = 429, body = ErrorBody, description = "RATE_LIMITED, with Retry-After")))]
pub async fn agent_bundle(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    ApiPath((env_id, sha)): ApiPath<(String, String)>,
) -> ApiResult<Response> {
    bundle(state, caller, env_id, sha).await
}

/// [`agent_bundle`] under the API prefix.
#[utoipa::path(get, path = "/api/v1/agent/bundle/{env_id}/{sha}", tag = "desired",
    security(("agentCertificate" = [])), params(("env_id" = String, Path), ("sha" = String, Path)),
    responses((status = 200, content_type = "application/x-tar", body = BundleTar, description = "the bundle"),
        (status = 401, body = ErrorBody, description = "AGENT_UNAUTHENTICATED"),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH"),
        (status = 404, body = ErrorBody, description = "BUNDLE_NOT_FOUND"),
        (status = 429, body = ErrorBody, description = "RATE_LIMITED, with Retry-After")))]
pub async fn api_agent_bundle(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    ApiPath((env_id, sha)): ApiPath<(String, String)>,
) -> ApiResult<Response> {
    bundle(state, caller, env_id, sha).await
}

/// The agent's report: `applied` sets its applied sha, `failed` keeps it and stores `detail`,
/// `down` clears it. `log_tail` is redacted and cut to 16 KiB; an audit entry keeps its first
/// 2 KiB. 30 per minute per environment.
#[utoipa::path(post, path = "/v1/agent/report", tag = "desired", request_body = Report,
    security(("agentCertificate" = [])),
    responses((status = 200, body = ReportResponse),
        (status = 401, body = ErrorBody, description = "AGENT_UNAUTHENTICATED"),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: a malformed sha, or `applied` without one"),
        (status = 429, body = ErrorBody, description = "RATE_LIMITED, with Retry-After")))]
pub async fn agent_report(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    ApiJson(req): ApiJson<Report>,
) -> ApiResult<Json<ReportResponse>> {
    report(state, caller, req).await
}

/// [`agent_report`] under the API prefix.
#[utoipa::path(post, path = "/api/v1/agent/report", tag = "desired", request_body = Report,
    security(("agentCertificate" = [])),
    responses((status = 200, body = ReportResponse),
        (status = 401, body = ErrorBody, description = "AGENT_UNAUTHENTICATED"),
        (status = 403, body = ErrorBody, description = "AGENT_ENV_MISMATCH"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST: a malformed sha, or `applied` without one"),
        (status = 429, body = ErrorBody, description = "RATE_LIMITED, with Retry-After")))]
pub async fn api_agent_report(
    State(state): State<SharedState>,
    caller: DesiredCaller,
    ApiJson(req): ApiJson<Report>,
) -> ApiResult<Json<ReportResponse>> {
    report(state, caller, req).await
}

// ---- Admin ----

async fn environment(
    state: &SharedState,
    caller: &Caller,
    name: &str,
) -> ApiResult<DesiredEnvironment> {
    state
        .store
        .desired_environment(caller.tenant(), name)
        .await?
        .ok_or_else(|| environment_not_found(name))
}

fn environment_not_found(name: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        codes::ENVIRONMENT_NOT_FOUND,
        format!("no environment named {name:?}"),
    )
}

fn bundle_view(env: &DesiredEnvironment, b: Bundle) -> BundleView {
    BundleView {
        environment: env.name.clone(),
        sha: b.sha,
        size_bytes: b.size_bytes,
        created_at: b.created_at,
    }
}

fn actor(caller: &Caller) -> berth_proto::audit::AuditActor {
    berth_proto::audit::AuditActor::Token {
        id: caller.0.id.0,
        name: caller.0.name.clone(),
        role: caller.0.role,
    }
}

/// Push a bundle: the tar as the body (`Content-Type: application/x-tar`, at most 64 MiB). The
/// server checks its members and computes the seed's sha; pushing the same bundle again
/// changes nothing (200).
#[utoipa::path(post, path = "/api/v1/environments/{name}/bundles", tag = "desired",
    security(("bearer" = [])), params(("name" = String, Path)),
    request_body(content = BundleTar, content_type = "application/x-tar"),
    responses((status = 201, body = BundleView, description = "stored"),
        (status = 200, body = BundleView, description = "already stored"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND"),
        (status = 413, body = ErrorBody, description = "PAYLOAD_TOO_LARGE: over 64 MiB"),
        (status = 415, body = ErrorBody, description = "UNSUPPORTED_MEDIA_TYPE: not application/x-tar"),
        (status = 422, body = ErrorBody, description = "BUNDLE_INVALID, BUNDLE_UNSAFE or BUNDLE_TOO_LARGE")))]
pub async fn push_bundle(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<(StatusCode, Json<BundleView>)> {
    caller.require_deployer()?;
    let env = environment(&state, &caller, &name).await?;
    let tar = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(';').next().map(str::trim) == Some(BUNDLE_CONTENT_TYPE));
    if !tar {
        return Err(ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            codes::UNSUPPORTED_MEDIA_TYPE,
            format!("a bundle is pushed as {BUNDLE_CONTENT_TYPE}"),
        ));
    }
    let bytes = axum::body::to_bytes(body, MAX_BUNDLE_BYTES)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                codes::PAYLOAD_TOO_LARGE,
                format!("a bundle is at most {MAX_BUNDLE_BYTES} bytes"),
            )
        })?;
    // The whole agent-side check (safe members, sha, manifest, bundle.json, compose file,
    // privileges) already at push: a bundle no agent would accept is refused here.
    let refused = |e: berth_bundle::BundleError| ApiError::unprocessable(e.code, e.detail);
    let limits = berth_bundle::Limits::default();
    let files = berth_bundle::read_tar(&bytes, &limits).map_err(refused)?;
    let sha = berth_bundle::sha(&files);
    berth_bundle::open(&bytes, &sha, &limits).map_err(refused)?;
    let (stored, created) = state
        .store
        .put_bundle(NewBundle {
            tenant_id: env.tenant_id,
            environment_id: env.id,
            sha,
            content: bytes.to_vec(),
            created_at: state.config.clock.now(),
            created_by: actor(&caller),
        })
        .await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(bundle_view(&env, stored))))
}

/// The environment's bundles, newest first.
#[utoipa::path(get, path = "/api/v1/environments/{name}/bundles", tag = "desired",
    security(("bearer" = [])), params(("name" = String, Path)),
    responses((status = 200, body = Vec<BundleView>),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn list_bundles(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<Vec<BundleView>>> {
    caller.can_read()?;
    let env = environment(&state, &caller, &name).await?;
    let bundles = state.store.list_bundles(env.id).await?;
    Ok(Json(
        bundles.into_iter().map(|b| bundle_view(&env, b)).collect(),
    ))
}

async fn state_view(state: &SharedState, env: DesiredEnvironment) -> ApiResult<DesiredStateView> {
    let agents = state.store.desired_agents(env.id).await?;
    Ok(DesiredStateView {
        environment: env.name,
        desired_sha: env.desired_sha,
        retired: env.retired,
        purge_volumes: env.purge_volumes,
        agents: agents
            .into_iter()
            .map(|a| DesiredAgentView {
                agent: a.agent_key,
                applied_sha: a.applied_sha,
                last_result: a.last_result.map(|r| r.as_str().to_string()),
                detail: a.detail,
                host: a.host,
                containers: a.containers,
                last_checkin_at: a.last_checkin_at,
            })
            .collect(),
    })
}

/// Point the environment at a pushed bundle: its agents apply it at their next checkin.
#[utoipa::path(put, path = "/api/v1/environments/{name}/desired", tag = "desired",
    security(("bearer" = [])), params(("name" = String, Path)), request_body = SetDesired,
    responses((status = 200, body = DesiredStateView),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND or BUNDLE_NOT_FOUND: no bundle of that sha was pushed")))]
pub async fn set_desired(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<SetDesired>,
) -> ApiResult<Json<DesiredStateView>> {
    caller.require_deployer()?;
    let not_pushed = || {
        ApiError::new(
            StatusCode::NOT_FOUND,
            codes::BUNDLE_NOT_FOUND,
            format!("no bundle {} was pushed to {name}", req.sha),
        )
    };
    if !valid_sha(&req.sha) {
        return Err(not_pushed());
    }
    let now = state.config.clock.now();
    match state
        .store
        .set_desired(caller.tenant(), &name, &req.sha, actor(&caller), now)
        .await?
    {
        SetDesiredOutcome::Set(env) => Ok(Json(state_view(&state, env).await?)),
        SetDesiredOutcome::NoSuchEnvironment => Err(environment_not_found(&name)),
        SetDesiredOutcome::BundleNotFound => Err(not_pushed()),
    }
}

/// Retire the environment: every checkin answers `down` (removing volumes only with
/// `purgeVolumes`). Admins only.
#[utoipa::path(post, path = "/api/v1/environments/{name}/retire", tag = "desired",
    security(("bearer" = [])), params(("name" = String, Path)), request_body = Retire,
    responses((status = 200, body = DesiredStateView),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn retire(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
    ApiJson(req): ApiJson<Retire>,
) -> ApiResult<Json<DesiredStateView>> {
    caller.require_admin()?;
    let now = state.config.clock.now();
    let env = state
        .store
        .retire_environment(
            caller.tenant(),
            &name,
            req.purge_volumes,
            actor(&caller),
            now,
        )
        .await?
        .ok_or_else(|| environment_not_found(&name))?;
    Ok(Json(state_view(&state, env).await?))
}

/// The desired sha, whether retired, and what each agent last said.
#[utoipa::path(get, path = "/api/v1/environments/{name}/desired", tag = "desired",
    security(("bearer" = [])), params(("name" = String, Path)),
    responses((status = 200, body = DesiredStateView),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn desired_state(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<DesiredStateView>> {
    caller.can_read()?;
    let env = environment(&state, &caller, &name).await?;
    Ok(Json(state_view(&state, env).await?))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use berth_proto::{EnvironmentId, TenantId};

    use super::*;

    fn env(desired: Option<&str>, retired: bool, purge: bool) -> DesiredEnvironment {
        DesiredEnvironment {
            id: EnvironmentId::new(),
            tenant_id: TenantId::new(),
            name: "env-qa-02".into(),
            selector: BTreeMap::new(),
            desired_sha: desired.map(str::to_string),
            retired,
            purge_volumes: purge,
            checkin_interval_secs: 60,
        }
    }

    #[test]
    fn the_action_follows_desired_applied_and_retired() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        let cases = [
            // (desired, retired, purge, applied) → (action, bundle_url, purge_volumes)
            (None, false, false, None, CheckinAction::None, false, false),
            (
                None,
                false,
                false,
                Some(&a),
                CheckinAction::None,
                false,
                false,
            ),
            (
                Some(&a),
                false,
                false,
                None,
                CheckinAction::Apply,
                true,
                false,
            ),
            (
                Some(&a),
                false,
                false,
                Some(&b),
                CheckinAction::Apply,
                true,
                false,
            ),
            (
                Some(&a),
                false,
                true,
                Some(&a),
                CheckinAction::None,
                false,
                false,
            ),
            (
                Some(&a),
                true,
                false,
                Some(&a),
                CheckinAction::Down,
                false,
                false,
            ),
            (Some(&a), true, true, None, CheckinAction::Down, false, true),
        ];
        for (desired, retired, purge, applied, action, url, purge_out) in cases {
            let e = env(desired.map(String::as_str), retired, purge);
            let vault = VaultInfo {
                addr: "https://berth.test".into(),
                mount: BUILTIN_MOUNT.into(),
                prefix: "env-qa-02/see".into(),
                auth_mount: BUILTIN_MOUNT.into(),
                auth_role: String::new(),
            };
            let answer = checkin_answer(&e, applied.map(String::as_str), vault.clone());
            assert_eq!(answer.vault, Some(vault));
            assert_eq!(answer.action, action, "{desired:?} {retired} {applied:?}");
            assert_eq!(answer.purge_volumes, purge_out);
            assert_eq!(
                answer.bundle_url,
                url.then(|| format!("/v1/agent/bundle/env-qa-02/{a}"))
            );
            assert_eq!(answer.checkin_interval_s, 60);
            assert_eq!(answer.desired_sha.as_deref(), desired.map(String::as_str));
        }
    }

    #[test]
    fn cut_keeps_char_boundaries() {
        assert_eq!(cut("abc", 2), "ab");
        assert_eq!(cut("aé", 2), "a");
        assert_eq!(cut("aé", 3), "aé");
        assert_eq!(cut("", 5), "");
    }
}
