//! berth as the token server of the registries in `--registry-token-issuer` (issue 17 item 3):
//! a deployment's `docker.run` of an image on one of them pulls with a token that allows
//! `repository:<its repository>:pull` and nothing else, and expires with the task's timeout.
//! No registry password is ever handed to a host for those registries.
//!
//! The token is minted when a delivery is built, not when the task is created: the agent's
//! timeout counts from the delivery (`assigned_at`), and a task may wait in the queue longer
//! than its timeout. So the task row holds only the scope (sealed, under
//! [`SCOPE_CREDENTIAL`], decided by the deployment reconciler from the release), and each
//! delivery turns it into a fresh token with `exp = assigned_at + timeout` — the lease's grace
//! is not added. The scope key never leaves the server; a client may not set it.

use std::collections::BTreeMap;

use berth_crypto::{RegistryAccess, RegistryClaims};
use berth_proto::payload::REGISTRY_TOKEN_CREDENTIAL;
use berth_proto::reference::ImageRef;
use berth_store::{Attempt, Task};

use crate::SharedState;

/// The sealed credential of a deployment task that names the image repository
/// (`host[:port]/path`) its delivery gets a pull token for. Server-side only.
pub(crate) const SCOPE_CREDENTIAL: &str = "registryTokenScope";

/// Mirrors `berth_exec::engine::CREDENTIAL_REGISTRY_SERVER`: the registry the token is for.
const REGISTRY_SERVER_CREDENTIAL: &str = "registryServer";

/// How long the server's own token for resolving a release's digest lives.
const RESOLVE_TOKEN_SECS: i64 = 60;

/// The registry's `service` and the repository's path on it, when berth issues tokens for the
/// registry of `image`.
fn issued_for<'a>(state: &'a SharedState, image: &ImageRef) -> Option<(&'a str, String)> {
    let host = image.registry();
    let service = state.config.registry_tokens.registries.get(host)?;
    let path = image
        .repository
        .strip_prefix(&format!("{host}/"))
        .unwrap_or(&image.repository)
        .to_string();
    Some((service.as_str(), path))
}

/// The credentials a deployment task for `image` is created with: the scope its deliveries
/// mint a token for, or none when berth does not issue for its registry.
pub(crate) fn task_credentials(
    state: &SharedState,
    image: &ImageRef,
) -> Option<BTreeMap<String, String>> {
    issued_for(state, image)?;
    Some(BTreeMap::from([(
        SCOPE_CREDENTIAL.to_string(),
        image.repository.clone(),
    )]))
}

/// One pull token for `path` on the registry whose service is `service`.
fn mint(
    state: &SharedState,
    service: &str,
    path: &str,
    subject: String,
    jti: String,
    expires_at: time::OffsetDateTime,
) -> Result<String, berth_crypto::CryptoError> {
    let now = state.config.clock.now();
    state.registry_token_key.sign(&RegistryClaims {
        issuer: state.config.registry_tokens.issuer.clone(),
        subject,
        audience: service.to_string(),
        issued_at: now,
        expires_at,
        id: jti,
        access: vec![RegistryAccess::pull(path)],
    })
}

/// Replaces a delivery's scope credential with its pull token (`registryToken`, and
/// `registryServer` = the registry host). Credentials without a scope are left as they are.
/// A scope whose registry berth no longer issues for delivers no token: the pull is refused by
/// the registry, and the task fails as any unauthorized pull does.
pub(crate) fn mint_for_delivery(
    state: &SharedState,
    task: &Task,
    attempt: &Attempt,
    credentials: &mut BTreeMap<String, String>,
) -> Result<(), berth_crypto::CryptoError> {
    let Some(repository) = credentials.remove(SCOPE_CREDENTIAL) else {
        return Ok(());
    };
    let image = match berth_proto::reference::parse_image(&repository) {
        Ok(image) => image,
        Err(e) => {
            tracing::warn!(task_id = %task.id, error = %e, "registry token scope is not an image");
            return Ok(());
        }
    };
    let Some((service, path)) = issued_for(state, &image) else {
        tracing::warn!(
            task_id = %task.id,
            registry = image.registry(),
            "berth no longer issues registry tokens for this registry; the task gets none"
        );
        return Ok(());
    };
    let expires_at = attempt.assigned_at + time::Duration::seconds(i64::from(task.timeout_seconds));
    let token = mint(
        state,
        service,
        &path,
        format!("task:{}", task.id),
        attempt.assignment_id.to_string(),
        expires_at,
    )?;
    credentials.insert(REGISTRY_TOKEN_CREDENTIAL.to_string(), token);
    credentials.insert(
        REGISTRY_SERVER_CREDENTIAL.to_string(),
        image.registry().to_string(),
    );
    Ok(())
}

/// The server's own short pull token for reading `image`'s manifest (release creation), when
/// berth issues for its registry.
pub(crate) fn resolve_token(state: &SharedState, image: &ImageRef) -> Option<String> {
    let (service, path) = issued_for(state, image)?;
    let expires_at = state.config.clock.now() + time::Duration::seconds(RESOLVE_TOKEN_SECS);
    match mint(
        state,
        service,
        &path,
        "berth-server".into(),
        uuid::Uuid::new_v4().to_string(),
        expires_at,
    ) {
        Ok(token) => Some(token),
        Err(e) => {
            tracing::warn!(error = %e, "minting a registry token for a release failed");
            None
        }
    }
}
