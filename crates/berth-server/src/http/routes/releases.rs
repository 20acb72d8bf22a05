//! The release API: create (every image resolved to its digest by the server, through the
//! registry, before anything is written), list, show by name. Releases never change.

use crate::http::auth::Caller;
use crate::http::extract::{ApiJson, ApiPath, ApiQuery};
use crate::infra::error::ApiResult;
use crate::services::releases;
use crate::SharedState;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use berth_proto::release::{CreateRelease, ListReleases, ReleaseList, ReleaseView};
use berth_proto::ErrorBody;

/// Create a release. Every image is resolved to its digest through its registry now, and only
/// digests are stored; registry credentials serve this request only and are never stored.
#[utoipa::path(post, path = "/api/v1/releases", tag = "releases", request_body = CreateRelease, security(("bearer" = [])),
    responses(
        (status = 201, body = ReleaseView, description = "created"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 409, body = ErrorBody, description = "RELEASE_EXISTS: the tenant has a release of that name"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST, DIGEST_UNRESOLVABLE (names the component and why), REGISTRY_UNAUTHORIZED or ARTIFACT_NOT_FOUND (the ssh part names an artifact never pushed)"),
    ))]
pub async fn create(
    State(state): State<SharedState>,
    caller: Caller,
    ApiJson(req): ApiJson<CreateRelease>,
) -> ApiResult<(StatusCode, Json<ReleaseView>)> {
    releases::create(&state, &caller, req)
        .await
        .map(|(status, body)| (status, Json(body)))
}

/// List the tenant's releases, oldest first.
#[utoipa::path(get, path = "/api/v1/releases", tag = "releases", params(ListReleases), security(("bearer" = [])),
    responses((status = 200, body = ReleaseList)))]
pub async fn list(
    State(state): State<SharedState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<ListReleases>,
) -> ApiResult<Json<ReleaseList>> {
    releases::list(&state, &caller, query).await.map(Json)
}

/// One release by name.
#[utoipa::path(get, path = "/api/v1/releases/{name}", tag = "releases", security(("bearer" = [])),
    params(("name" = String, Path)),
    responses((status = 200, body = ReleaseView), (status = 404, body = ErrorBody, description = "RELEASE_NOT_FOUND")))]
pub async fn get(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(name): ApiPath<String>,
) -> ApiResult<Json<ReleaseView>> {
    releases::get(&state, &caller, name).await.map(Json)
}
