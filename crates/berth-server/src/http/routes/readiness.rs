//! An environment's readiness (issue 14): its conditions, and `verify`, which asks for a fresh
//! pass and answers with the nonce the pass will echo. The passes are `crate::readiness`'s.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use berth_proto::readiness::{EnvironmentReadiness, VerifyResponse};
use berth_proto::ErrorBody;

use crate::auth::Caller;
use crate::error::ApiResult;
use crate::extract::ApiPath;
use crate::routes::audit::actor;
use crate::routes::deployments::environment;
use crate::SharedState;

/// The environment's readiness conditions as its last pass left them, in evaluation order.
/// `operationalReady` is true only while every condition is `True` for the environment's
/// current generation; `verifyObserved` equals `verifyRequest` once a verification is done.
#[utoipa::path(get, path = "/api/v1/environments/{name}/readiness", tag = "environments", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = EnvironmentReadiness),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn get_readiness(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<EnvironmentReadiness>> {
    caller.can_read()?;
    let env = environment(&state, &caller, &name).await?;
    Ok(Json(view(&state, &env).await?))
}

pub(crate) async fn view(
    state: &SharedState,
    env: &berth_store::Environment,
) -> Result<EnvironmentReadiness, berth_store::StoreError> {
    let stored = state.store.get_readiness(env.tenant_id, env.id).await?;
    // Ready only for the spec the environment has now (a release moved since: not yet).
    let current = crate::readiness::current(state, env).await?.is_some();
    Ok(match stored {
        None => EnvironmentReadiness {
            environment: env.name.clone(),
            generation: 0,
            operational_ready: false,
            conditions: Vec::new(),
            verify_request: None,
            verify_observed: None,
        },
        Some(r) => EnvironmentReadiness {
            environment: env.name.clone(),
            generation: r.generation,
            operational_ready: r.operational_ready && current,
            conditions: r.conditions,
            verify_request: r.verify_request,
            verify_observed: r.verify_observed,
        },
    })
}

/// Ask for a completely fresh readiness pass (no result of an earlier pass is reused). The
/// answer's nonce becomes `verifyObserved` once every condition of that pass is terminal.
#[utoipa::path(post, path = "/api/v1/environments/{name}/verify", tag = "environments", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 202, body = VerifyResponse),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn verify(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<(StatusCode, Json<VerifyResponse>)> {
    caller.require_deployer()?;
    let env = environment(&state, &caller, &name).await?;
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    state
        .store
        .request_verify(&env, &nonce, actor(&caller), state.config.clock.now())
        .await?;
    Ok((StatusCode::ACCEPTED, Json(VerifyResponse { nonce })))
}
