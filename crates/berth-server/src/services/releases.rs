//! The release API: create (every image resolved to its digest by the server, through the
//! registry, before anything is written), list, show by name. Releases never change.

use std::collections::BTreeSet;

use axum::http::StatusCode;
use berth_proto::error::codes;
use berth_proto::reference::parse_image;
use berth_proto::release::{
    valid_component_name, valid_release_name, Component, CreateRelease, ListReleases, ReleaseList,
    ReleaseView, MAX_COMPONENTS, MAX_COMPOSE_BYTES,
};
use berth_proto::ReleaseId;
use berth_store::{Release, StoreError};

use crate::infra::error::{ApiError, ApiResult};
use crate::infra::registry::{Credentials, ResolveError};
use crate::services::caller::Caller;
use crate::SharedState;

fn invalid(detail: impl Into<String>) -> ApiError {
    ApiError::unprocessable(codes::INVALID_REQUEST, detail)
}

fn to_view(r: Release) -> ReleaseView {
    ReleaseView {
        id: r.id,
        name: r.name,
        components: r.components,
        compose_lock: r.compose_lock,
        ssh: r.ssh,
        created_at: r.created_at,
    }
}

/// Resolves one component's image, naming the component in any refusal.
async fn resolve(
    state: &SharedState,
    component: &str,
    image: &str,
    credentials: Option<&Credentials>,
) -> ApiResult<Component> {
    let parsed = parse_image(image).map_err(|e| invalid(format!("component {component}: {e}")))?;
    // A registry berth is the token server of is read with berth's own short pull token,
    // unless the request brings credentials of its own.
    let token = match credentials {
        None => crate::infra::registry_token::resolve_token(state, &parsed),
        Some(_) => None,
    };
    let resolved = match &token {
        Some(token) => state.registries.resolve_with_token(&parsed, token).await,
        None => state.registries.resolve(&parsed, credentials).await,
    };
    let digest = resolved.map_err(|e| match e {
        ResolveError::Unauthorized(why) => ApiError::unprocessable(
            codes::REGISTRY_UNAUTHORIZED,
            format!("component {component} ({image}): {why}"),
        ),
        ResolveError::NotFound(why) | ResolveError::Unresolvable(why) => ApiError::unprocessable(
            codes::DIGEST_UNRESOLVABLE,
            format!("component {component} ({image}) has no resolvable digest: {why}"),
        ),
    })?;
    Ok(Component {
        name: component.to_string(),
        image: parsed.repository,
        digest,
        resolved_from: parsed.tag,
        config: None,
    })
}

/// Pins every service of a compose file by digest: the lock, and a component per service.
async fn lock_compose(
    state: &SharedState,
    compose: &str,
    credentials: Option<&Credentials>,
) -> ApiResult<(String, Vec<Component>)> {
    if compose.len() > MAX_COMPOSE_BYTES {
        return Err(invalid(format!(
            "the compose file is over {MAX_COMPOSE_BYTES} bytes"
        )));
    }
    // A `Value` refuses duplicate keys, which YAML parsers resolve differently.
    let mut doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(compose)
        .map_err(|e| invalid(format!("the compose file is not YAML: {e}")))?;
    let services = doc
        .get_mut("services")
        .and_then(|s| s.as_mapping_mut())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| invalid("the compose file defines no services"))?;
    let mut components = Vec::new();
    for (name, service) in services.iter_mut() {
        let name = name
            .as_str()
            .filter(|n| valid_component_name(n))
            .ok_or_else(|| {
                invalid(format!(
                    "compose service name {name:?} is not a valid component name (a-z 0-9 _ -)"
                ))
            })?
            .to_string();
        let image = service
            .get("image")
            .and_then(|i| i.as_str())
            .ok_or_else(|| {
                ApiError::unprocessable(
                    codes::DIGEST_UNRESOLVABLE,
                    format!("compose service {name} has no image to pin by digest"),
                )
            })?
            .to_string();
        let component = resolve(state, &name, &image, credentials).await?;
        service
            .as_mapping_mut()
            .ok_or_else(|| invalid(format!("compose service {name} is not a mapping")))?
            .insert("image".into(), component.pinned().into());
        components.push(component);
    }
    let lock = serde_yaml_ng::to_string(&doc).map_err(|e| ApiError::internal(&e))?;
    Ok((lock, components))
}

/// Create a release. Every image is resolved to its digest through its registry now, and only
/// digests are stored; registry credentials serve this request only and are never stored.
pub async fn create(
    state: &SharedState,
    caller: &Caller,
    req: CreateRelease,
) -> ApiResult<(StatusCode, ReleaseView)> {
    caller.require_deployer()?;
    if !valid_release_name(&req.name) {
        return Err(invalid(
            "name must be 1-128 of A-Z a-z 0-9 . _ -, starting with a letter or digit",
        ));
    }
    if req.components.is_empty() && req.compose.is_none() && req.ssh.is_none() {
        return Err(invalid(
            "give components, a compose file, an ssh part, or several of them",
        ));
    }
    if let Some(ssh) = &req.ssh {
        ssh.check().map_err(|e| invalid(format!("ssh: {e}")))?;
        for a in &ssh.artifacts {
            let sha = a.sha256.as_deref().unwrap_or_default();
            if state
                .store
                .get_artifact(caller.tenant(), sha)
                .await?
                .is_none()
            {
                return Err(ApiError::unprocessable(
                    codes::ARTIFACT_NOT_FOUND,
                    format!("ssh: artifact {:?}: no artifact {sha} was pushed", a.name),
                ));
            }
        }
    }
    if req.components.len() > MAX_COMPONENTS {
        return Err(invalid(format!(
            "at most {MAX_COMPONENTS} components per release"
        )));
    }
    let mut names = BTreeSet::new();
    for c in &req.components {
        if !valid_component_name(&c.name) {
            return Err(invalid(format!(
                "component name {:?} must be 1-63 of a-z 0-9 _ -",
                c.name.chars().take(64).collect::<String>()
            )));
        }
        if !names.insert(c.name.clone()) {
            return Err(invalid(format!("component {} is named twice", c.name)));
        }
        if c.config.as_ref().is_some_and(|v| !v.is_object()) {
            return Err(invalid(format!(
                "component {}: config must be a JSON object",
                c.name
            )));
        }
    }
    let credentials = match (req.registry_username, req.registry_password) {
        (Some(username), Some(password)) => Some(Credentials { username, password }),
        (None, None) => None,
        _ => {
            return Err(invalid(
                "give both registryUsername and registryPassword, or neither",
            ))
        }
    };
    let mut components = Vec::with_capacity(req.components.len());
    for spec in req.components {
        let mut component = resolve(state, &spec.name, &spec.image, credentials.as_ref()).await?;
        component.config = spec.config;
        components.push(component);
    }
    let compose_lock = match &req.compose {
        Some(compose) => {
            let (lock, services) = lock_compose(state, compose, credentials.as_ref()).await?;
            for service in services {
                if !names.insert(service.name.clone()) {
                    return Err(invalid(format!(
                        "compose service {} has the name of a component",
                        service.name
                    )));
                }
                components.push(service);
            }
            Some(lock)
        }
        None => None,
    };
    let created = state
        .store
        .create_release(
            Release {
                id: ReleaseId::new(),
                tenant_id: caller.tenant(),
                name: req.name.clone(),
                components,
                compose_lock,
                ssh: req.ssh,
                created_at: state.config.clock.now(),
            },
            crate::services::caller::actor(caller),
        )
        .await
        .map_err(|e| match e {
            StoreError::Conflict {
                constraint: "release_name",
            } => ApiError::conflict(
                codes::RELEASE_EXISTS,
                format!(
                    "release {} exists; releases are immutable, create one with a new name",
                    req.name
                ),
            ),
            e => e.into(),
        })?;
    Ok((StatusCode::CREATED, to_view(created)))
}

/// List the tenant's releases, oldest first.
pub async fn list(
    state: &SharedState,
    caller: &Caller,
    query: ListReleases,
) -> ApiResult<ReleaseList> {
    caller.can_read()?;
    let after: Option<ReleaseId> = crate::services::validate::cursor(query.cursor.as_deref())?;
    let page = state
        .store
        .list_releases(
            caller.tenant(),
            after,
            query.limit.unwrap_or(100).clamp(1, 1000),
        )
        .await?;
    Ok(ReleaseList {
        items: page.items.into_iter().map(to_view).collect(),
        next_cursor: page.next.map(|id| id.to_string()),
    })
}

/// One release by name.
pub async fn get(state: &SharedState, caller: &Caller, name: String) -> ApiResult<ReleaseView> {
    caller.can_read()?;
    match state.store.get_release(caller.tenant(), &name).await? {
        Some(r) => Ok(to_view(r)),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            codes::RELEASE_NOT_FOUND,
            format!(
                "no release named {:?}",
                name.chars().take(128).collect::<String>()
            ),
        )),
    }
}
