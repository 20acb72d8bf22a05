//! The environment and deployment API: thin adapters over `services::environments`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use berth_proto::deploy::{
    CreateDeployment, CreateEnvironment, DeploymentList, DeploymentPlan, DeploymentView,
    EnvironmentList, EnvironmentStatus, EnvironmentView, ListDeployments,
};
use berth_proto::{DeploymentId, ErrorBody};

use crate::http::auth::Caller;
use crate::http::extract::{ApiJson, ApiPath, ApiQuery};
use crate::infra::error::ApiResult;
use crate::services::environments;
use crate::SharedState;

/// Create an environment: its tier, the agent labels that select its targets, its rollout
/// policy, promotion rule, approvals (default one for prod) and drift read-back period.
#[utoipa::path(post, path = "/api/v1/environments", tag = "environments", request_body = CreateEnvironment, security(("bearer" = [])),
    responses(
        (status = 201, body = EnvironmentView, description = "created"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: not an admin"),
        (status = 409, body = ErrorBody, description = "ENVIRONMENT_EXISTS"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST (names the field) or ENVIRONMENT_NOT_FOUND (`promoteFrom`)"),
    ))]
pub async fn create_environment(
    State(state): State<SharedState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateEnvironment>,
) -> ApiResult<(StatusCode, Json<EnvironmentView>)> {
    environments::create_environment(&state, &caller, req)
        .await
        .map(|(status, body)| (status, Json(body)))
}

/// Every environment of the tenant, by name.
#[utoipa::path(get, path = "/api/v1/environments", tag = "environments", security(("bearer" = [])),
    responses((status = 200, body = EnvironmentList)))]
pub async fn list_environments(
    State(state): State<SharedState>,
    caller: Caller,
) -> ApiResult<Json<EnvironmentList>> {
    environments::list_environments(&state, &caller)
        .await
        .map(Json)
}

/// One environment.
#[utoipa::path(get, path = "/api/v1/environments/{name}", tag = "environments", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = EnvironmentView),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn get_environment(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<EnvironmentView>> {
    environments::get_environment(&state, &caller, name)
        .await
        .map(Json)
}

/// Each target's desired release against what its last verified read-back found, and when.
#[utoipa::path(get, path = "/api/v1/environments/{name}/status", tag = "environments", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = EnvironmentStatus),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn environment_status(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<EnvironmentStatus>> {
    environments::environment_status(&state, &caller, name)
        .await
        .map(Json)
}

/// Lift the pin a rollback set: any release may be deployed again.
#[utoipa::path(post, path = "/api/v1/environments/{name}/unpin", tag = "environments", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = EnvironmentView),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn unpin_environment(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<EnvironmentView>> {
    environments::unpin_environment(&state, &caller, name)
        .await
        .map(Json)
}

/// Deploy the environment's previous successful release to every target and pin the
/// environment to it, so the bad release cannot come back until `unpin`. No approval: it
/// returns to a release the environment already ran.
#[utoipa::path(post, path = "/api/v1/environments/{name}/rollback", tag = "environments", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 201, body = DeploymentView),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND"),
        (status = 409, body = ErrorBody, description = "NO_PREVIOUS_RELEASE or DEPLOYMENT_IN_PROGRESS"),
        (status = 422, body = ErrorBody, description = "NO_TARGETS or CAPABILITY_MISSING")))]
pub async fn rollback_environment(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<(StatusCode, Json<DeploymentView>)> {
    environments::rollback_environment(&state, &caller, name)
        .await
        .map(|(status, body)| (status, Json(body)))
}

/// Deploy a release into an environment: one `docker.run` task per component per target, in
/// waves of the environment's `maxParallel`. It waits in `awaiting_approval` when the
/// environment needs approvals.
#[utoipa::path(post, path = "/api/v1/deployments", tag = "deployments", request_body = CreateDeployment, security(("bearer" = [])),
    responses(
        (status = 201, body = DeploymentView, description = "created"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND or RELEASE_NOT_FOUND"),
        (status = 409, body = ErrorBody, description = "DEPLOYMENT_IN_PROGRESS, ENVIRONMENT_PINNED, PROMOTION_REQUIRED or ENV_NOT_READY (`policy.requireReady`: names the conditions that are not True)"),
        (status = 422, body = ErrorBody, description = "NO_TARGETS, CAPABILITY_MISSING or INVALID_REQUEST"),
    ))]
pub async fn create(
    State(state): State<SharedState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateDeployment>,
) -> ApiResult<(StatusCode, Json<DeploymentView>)> {
    environments::create(&state, &caller, req)
        .await
        .map(|(status, body)| (status, Json(body)))
}

/// What a deployment would do, per wave and target: each target's release and digests as its
/// last verified read-back found them, and the new digest per component; and the selected
/// agents it would skip (cordoned). Changes nothing.
#[utoipa::path(post, path = "/api/v1/deployments/plan", tag = "deployments", request_body = CreateDeployment, security(("bearer" = [])),
    responses(
        (status = 200, body = DeploymentPlan),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND or RELEASE_NOT_FOUND"),
        (status = 409, body = ErrorBody, description = "ENVIRONMENT_PINNED or PROMOTION_REQUIRED"),
        (status = 422, body = ErrorBody, description = "NO_TARGETS, CAPABILITY_MISSING or INVALID_REQUEST"),
    ))]
pub async fn plan(
    State(state): State<SharedState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateDeployment>,
) -> ApiResult<Json<DeploymentPlan>> {
    environments::plan(&state, &caller, req).await.map(Json)
}

/// The tenant's deployments, oldest first unless `order=newest`, optionally of one environment.
#[utoipa::path(get, path = "/api/v1/deployments", tag = "deployments", params(ListDeployments), security(("bearer" = [])),
    responses((status = 200, body = DeploymentList),
        (status = 400, body = ErrorBody, description = "INVALID_REQUEST: a cursor that is not a deployment id"),
        (status = 404, body = ErrorBody, description = "ENVIRONMENT_NOT_FOUND")))]
pub async fn list(
    State(state): State<SharedState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<ListDeployments>,
) -> ApiResult<Json<DeploymentList>> {
    environments::list(&state, &caller, query).await.map(Json)
}

/// One deployment: its state, waves and targets (phase, tasks, failure codes), approvals.
#[utoipa::path(get, path = "/api/v1/deployments/{id}", tag = "deployments", security(("bearer" = [])),
    params(("id" = DeploymentId, Path)),
    responses((status = 200, body = DeploymentView),
        (status = 404, body = ErrorBody, description = "DEPLOYMENT_NOT_FOUND")))]
pub async fn get(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<DeploymentId>,
) -> ApiResult<Json<DeploymentView>> {
    environments::get(&state, &caller, id).await.map(Json)
}

/// Approve a deployment that awaits approval. The requester's own token cannot; once enough
/// other tokens approved, it starts.
#[utoipa::path(post, path = "/api/v1/deployments/{id}/approve", tag = "deployments", security(("bearer" = [])),
    params(("id" = DeploymentId, Path)),
    responses((status = 200, body = DeploymentView),
        (status = 403, body = ErrorBody, description = "FORBIDDEN (a viewer token) or SELF_APPROVAL"),
        (status = 404, body = ErrorBody, description = "DEPLOYMENT_NOT_FOUND"),
        (status = 409, body = ErrorBody, description = "DEPLOYMENT_STATE: it is not awaiting approval")))]
pub async fn approve(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<DeploymentId>,
) -> ApiResult<Json<DeploymentView>> {
    environments::approve(&state, &caller, id).await.map(Json)
}

/// Cancel a deployment: one that waits ends at once; a running one stops after its running
/// wave (the targets it already updated keep the new release). A finished one is unchanged.
#[utoipa::path(post, path = "/api/v1/deployments/{id}/cancel", tag = "deployments", security(("bearer" = [])),
    params(("id" = DeploymentId, Path)),
    responses((status = 200, body = DeploymentView),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody, description = "DEPLOYMENT_NOT_FOUND")))]
pub async fn cancel(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<DeploymentId>,
) -> ApiResult<Json<DeploymentView>> {
    environments::cancel(&state, &caller, id).await.map(Json)
}
