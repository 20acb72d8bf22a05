//! The Docker Engine API, as the executors use it: a lazily negotiated connection to the local
//! unix socket, pulls by digest with registry credentials, the mapping of engine and registry
//! failures to stable codes, container lookups, health judgement and the `inspect` listing.
//! It never reaches a remote engine (no TLS, no tcp://), and never logs credentials.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use berth_proto::payload::{HealthCheckConfig, HealthCheckKind, InspectedContainer};
use bollard::auth::DockerCredentials;
use bollard::errors::Error as BollardError;
use bollard::models::{
    ContainerInspectResponse, ContainerStateStatusEnum, HealthStatusEnum, ImageInspect,
};
use bollard::query_parameters::{CreateImageOptionsBuilder, ListContainersOptionsBuilder};
use bollard::Docker;
use futures_util::StreamExt;
use tokio::time::Instant;

use crate::error::ExecError;
use crate::probe;
use crate::reference::ImageRef;
use crate::run::{Log, Stop};

/// Credential keys of a task for registry logins.
pub const CREDENTIAL_REGISTRY_USERNAME: &str = "registryUsername";
pub const CREDENTIAL_REGISTRY_PASSWORD: &str = "registryPassword";
/// A registry bearer token instead of a username and password (berth's per-task pull token).
pub const CREDENTIAL_REGISTRY_TOKEN: &str = berth_proto::payload::REGISTRY_TOKEN_CREDENTIAL;
/// Optional: the registry host the login is for; defaults to the image's registry.
pub const CREDENTIAL_REGISTRY_SERVER: &str = "registryServer";

/// Label keys berth puts on the containers it creates.
pub const LABEL_RELEASE_ID: &str = "berth.release.id";
pub const LABEL_RELEASE_NAME: &str = "berth.release.name";
pub const LABEL_DIGEST: &str = "berth.digest";
pub const LABEL_DEPLOYED_AT: &str = "berth.deployed.at";
/// The repository (without digest) the container runs, so a `rollback` to a digest can find it.
pub const LABEL_IMAGE: &str = "berth.image";

/// Seconds to wait for health when the payload does not say.
pub const DEFAULT_HEALTH_TIMEOUT_SECS: u64 = 60;
/// Seconds between health checks when the payload does not say.
pub const DEFAULT_HEALTH_INTERVAL_SECS: u64 = 1;

/// A connection to the local engine, made on first use and kept once it worked. A failed
/// attempt is not kept, so an engine that comes up later is found by the next task.
#[derive(Debug, Default)]
pub(crate) struct Engine {
    docker: tokio::sync::OnceCell<Docker>,
}

impl Engine {
    pub fn new() -> Engine {
        Engine::default()
    }

    pub async fn docker(&self) -> Result<&Docker, ExecError> {
        self.docker.get_or_try_init(connect).await
    }
}

/// `DOCKER_HOST` (unix:// only) or `/var/run/docker.sock`, with the API version negotiated down
/// to what the engine speaks (Docker 20.10 speaks 1.41).
async fn connect() -> Result<Docker, ExecError> {
    if let Ok(host) = std::env::var("DOCKER_HOST") {
        if !host.is_empty() && !host.starts_with("unix://") {
            return Err(ExecError::DockerUnavailable(format!(
                "DOCKER_HOST={host} is not a unix:// socket; berth only drives the local engine"
            )));
        }
    }
    let docker = Docker::connect_with_unix_defaults()
        .map_err(|e| ExecError::DockerUnavailable(e.to_string()))?;
    let docker = tokio::time::timeout(Duration::from_secs(30), docker.negotiate_version())
        .await
        .map_err(|_| ExecError::DockerUnavailable("no answer within 30s".into()))?
        .map_err(|e| ExecError::DockerUnavailable(e.to_string()))?;
    Ok(docker)
}

/// Whether the engine itself could not be reached (as opposed to it refusing something).
fn is_transport(e: &BollardError) -> bool {
    matches!(
        e,
        BollardError::IOError { .. }
            | BollardError::HyperResponseError { .. }
            | BollardError::HyperLegacyError { .. }
            | BollardError::HttpClientError { .. }
            | BollardError::SocketNotFoundError(_)
            | BollardError::RequestTimeoutError
    )
}

fn engine_message(e: &BollardError) -> String {
    match e {
        BollardError::DockerResponseServerError { message, .. } => message.clone(),
        BollardError::DockerStreamError { error } => error.clone(),
        other => other.to_string(),
    }
}

/// An engine call failed: unreachable engine → retriable `DOCKER_UNAVAILABLE`, else `DOCKER_ERROR`.
pub(crate) fn engine_error(action: &'static str, target: &str, e: BollardError) -> ExecError {
    if is_transport(&e) {
        ExecError::DockerUnavailable(e.to_string())
    } else {
        ExecError::Engine {
            action,
            target: target.to_string(),
            detail: engine_message(&e),
        }
    }
}

fn is_not_found(e: &BollardError) -> bool {
    matches!(
        e,
        BollardError::DockerResponseServerError {
            status_code: 404,
            ..
        }
    )
}

/// The task's registry login for `image`, if it carries one: a bearer token
/// (`registryToken`, berth's short-lived pull token, handed to the engine as `X-Registry-Auth`'s
/// `registrytoken`) or a username and password (both keys or neither), never both.
pub(crate) fn registry_credentials(
    credentials: &BTreeMap<String, String>,
    registry: &str,
) -> Result<Option<DockerCredentials>, ExecError> {
    let user = credentials.get(CREDENTIAL_REGISTRY_USERNAME);
    let password = credentials.get(CREDENTIAL_REGISTRY_PASSWORD);
    let server = || {
        Some(
            credentials
                .get(CREDENTIAL_REGISTRY_SERVER)
                .cloned()
                .unwrap_or_else(|| registry.to_string()),
        )
    };
    if let Some(token) = credentials.get(CREDENTIAL_REGISTRY_TOKEN) {
        if user.is_some() || password.is_some() {
            return Err(ExecError::InvalidPayload(format!(
                "credentials carry {CREDENTIAL_REGISTRY_TOKEN} and a username or password; one login only"
            )));
        }
        return Ok(Some(DockerCredentials {
            registrytoken: Some(token.clone()),
            serveraddress: server(),
            ..Default::default()
        }));
    }
    match (user, password) {
        (None, None) => Ok(None),
        (Some(user), Some(password)) => Ok(Some(DockerCredentials {
            username: Some(user.clone()),
            password: Some(password.clone()),
            serveraddress: Some(
                credentials
                    .get(CREDENTIAL_REGISTRY_SERVER)
                    .cloned()
                    .unwrap_or_else(|| registry.to_string()),
            ),
            ..Default::default()
        })),
        _ => Err(ExecError::InvalidPayload(format!(
            "credentials must carry both {CREDENTIAL_REGISTRY_USERNAME} and {CREDENTIAL_REGISTRY_PASSWORD}, or neither"
        ))),
    }
}

/// Maps what the engine (or `docker compose pull`) said about a failed pull to a code. The
/// texts are the engine's (distribution client) messages; anything unknown is a retriable
/// `PULL_FAILED`.
pub(crate) fn classify_pull_failure(image: &str, detail: &str) -> ExecError {
    let d = detail.to_ascii_lowercase();
    let has = |needles: &[&str]| needles.iter().any(|n| d.contains(n));
    let image = image.to_string();
    let detail = detail.trim().to_string();
    if has(&[
        "manifest verification failed",
        "digest did not match",
        "does not match digest",
        "digest mismatch",
    ]) {
        ExecError::DigestMismatch(format!(
            "the registry served content for {image} that does not match its digest: possible tampering ({detail})"
        ))
    } else if has(&[
        "unauthorized",
        "authentication required",
        "no basic auth credentials",
        "incorrect username or password",
        "denied: requested access",
    ]) {
        ExecError::RegistryAuthFailed { image, detail }
    } else if has(&[
        "manifest unknown",
        "not found",
        "pull access denied",
        "repository does not exist",
        "name unknown",
    ]) {
        ExecError::ImageNotFound { image, detail }
    } else if has(&[
        "connection refused",
        "no such host",
        "i/o timeout",
        "dial tcp",
        "connection reset",
        "tls handshake timeout",
        "network is unreachable",
        "timeout exceeded",
        "toomanyrequests",
        "unexpected http status: 5",
        "service unavailable",
        "bad gateway",
        "unexpected eof",
        ": eof",
    ]) {
        ExecError::RegistryUnavailable { image, detail }
    } else {
        ExecError::PullFailed { image, detail }
    }
}

/// Pulls `repository@digest`, so the engine checks the content against the digest.
pub(crate) async fn pull(
    docker: &Docker,
    image: &ImageRef,
    digest: &str,
    credentials: Option<DockerCredentials>,
    log: &mut Log,
) -> Result<(), ExecError> {
    let reference = format!("{}@{digest}", image.repository);
    let options = CreateImageOptionsBuilder::default()
        .from_image(&reference)
        .build();
    let mut stream = docker.create_image(Some(options), None, credentials);
    let mut last_status = String::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(info) => {
                if let Some(status) = info.status {
                    // Per-layer progress is noise; keep the summary lines.
                    if info.id.is_none()
                        || status.starts_with("Digest")
                        || status.starts_with("Status")
                    {
                        last_status = status;
                    }
                }
            }
            Err(e) if is_transport(&e) => return Err(ExecError::DockerUnavailable(e.to_string())),
            Err(e) => return Err(classify_pull_failure(&reference, &engine_message(&e))),
        }
    }
    if !last_status.is_empty() {
        log.line(format!("pull: {last_status}"));
    }
    Ok(())
}

/// Checks that the local image for `repository@digest` lists that digest among its
/// `RepoDigests`; the engine already refuses content that does not hash to the digest, and
/// this makes sure that what we are about to run is what was asked for.
pub(crate) async fn verify_digest(
    docker: &Docker,
    image: &ImageRef,
    digest: &str,
) -> Result<ImageInspect, ExecError> {
    let reference = format!("{}@{digest}", image.repository);
    let inspect = docker
        .inspect_image(&reference)
        .await
        .map_err(|e| engine_error("inspect image", &reference, e))?;
    let digests: Vec<&str> = inspect
        .repo_digests
        .iter()
        .flatten()
        .filter_map(|rd| {
            let (repo, d) = rd.rsplit_once('@')?;
            (repo == image.repository || repo == image.familiar()).then_some(d)
        })
        .collect();
    if digests.contains(&digest) {
        Ok(inspect)
    } else {
        Err(ExecError::DigestMismatch(format!(
            "expected digest {digest} for {}, the engine has {digests:?}: possible tampering",
            image.repository
        )))
    }
}

/// The container named exactly `name`, if any.
pub(crate) async fn find_container(
    docker: &Docker,
    name: &str,
) -> Result<Option<ContainerInspectResponse>, ExecError> {
    match docker.inspect_container(name, None).await {
        Ok(c) => {
            // The engine also matches id prefixes; only an exact name counts.
            let exact = c.name.as_deref().map(|n| n.trim_start_matches('/')) == Some(name);
            Ok(exact.then_some(c))
        }
        Err(e) if is_not_found(&e) => Ok(None),
        Err(e) => Err(engine_error("inspect container", name, e)),
    }
}

/// Names (without the leading `/`) of every container whose name contains `fragment`.
pub(crate) async fn container_names_like(
    docker: &Docker,
    fragment: &str,
) -> Result<Vec<(String, String)>, ExecError> {
    let filters = HashMap::from([("name", vec![fragment])]);
    let options = ListContainersOptionsBuilder::default()
        .all(true)
        .filters(&filters)
        .build();
    let list = docker
        .list_containers(Some(options))
        .await
        .map_err(|e| engine_error("list containers", fragment, e))?;
    Ok(list
        .into_iter()
        .filter_map(|c| {
            let id = c.id?;
            let name = c.names?.into_iter().next()?;
            Some((id, name.trim_start_matches('/').to_string()))
        })
        .collect())
}

/// How much the image's own HEALTHCHECK counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DockerHealth {
    /// `healthCheck.type: docker`: the HEALTHCHECK decides, and must exist.
    Require,
    /// Compose services: a HEALTHCHECK, where there is one, must be healthy.
    IfPresent,
    /// `http`/`tcp` probes decide; the container only has to keep running.
    Ignore,
}

/// What one look at a container says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Judgement {
    Healthy,
    /// Not there yet (starting, health check pending); the reason, for the log.
    Waiting(String),
    /// It will not get better: exited, restarting, or its HEALTHCHECK says unhealthy.
    Failed(String),
}

pub(crate) fn judge(c: &ContainerInspectResponse, docker_health: DockerHealth) -> Judgement {
    let Some(state) = &c.state else {
        return Judgement::Waiting("the engine reports no state yet".into());
    };
    let exit = state.exit_code.unwrap_or_default();
    let restarts = c.restart_count.unwrap_or_default();
    match state.status {
        Some(ContainerStateStatusEnum::EXITED | ContainerStateStatusEnum::DEAD) => {
            let error = state.error.as_deref().filter(|e| !e.is_empty());
            return Judgement::Failed(match error {
                Some(e) => format!("the container exited with code {exit}: {e}"),
                None => format!("the container exited with code {exit}"),
            });
        }
        _ if restarts > 0 || state.restarting == Some(true) => {
            return Judgement::Failed(format!(
                "the container crashed and was restarted ({restarts} restarts, last exit code {exit})"
            ));
        }
        _ if state.running != Some(true) => {
            let status = state.status.map(|s| s.to_string()).unwrap_or_default();
            return Judgement::Waiting(format!("the container is {status}"));
        }
        _ => {}
    }
    if docker_health == DockerHealth::Ignore {
        return Judgement::Healthy;
    }
    let health = state.health.as_ref();
    match health.and_then(|h| h.status) {
        Some(HealthStatusEnum::HEALTHY) => Judgement::Healthy,
        Some(HealthStatusEnum::UNHEALTHY) => {
            let last = health
                .and_then(|h| h.log.as_ref())
                .and_then(|l| l.last())
                .and_then(|r| r.output.as_deref())
                .map(|o| o.trim().chars().take(500).collect::<String>())
                .unwrap_or_default();
            Judgement::Failed(format!(
                "its HEALTHCHECK reports unhealthy (last output: {last:?})"
            ))
        }
        Some(HealthStatusEnum::STARTING) => {
            Judgement::Waiting("its HEALTHCHECK is starting".into())
        }
        _ if docker_health == DockerHealth::Require => {
            Judgement::Failed("the image defines no HEALTHCHECK".into())
        }
        _ => Judgement::Healthy,
    }
}

/// Health-check timing from the payload, with defaults.
pub(crate) fn health_timing(check: Option<&HealthCheckConfig>) -> (Duration, Duration) {
    let timeout = check
        .and_then(|c| c.timeout)
        .unwrap_or(DEFAULT_HEALTH_TIMEOUT_SECS);
    let interval = check
        .and_then(|c| c.interval)
        .unwrap_or(DEFAULT_HEALTH_INTERVAL_SECS)
        .max(1);
    (Duration::from_secs(timeout), Duration::from_secs(interval))
}

/// Refuses a health check that cannot work, before anything is touched.
pub(crate) fn validate_health_check(check: &HealthCheckConfig) -> Result<(), ExecError> {
    match check.kind {
        HealthCheckKind::Http => {
            let url = check.url.as_deref().ok_or_else(|| {
                ExecError::InvalidPayload("healthCheck type http needs a url".into())
            })?;
            probe::parse_http_url(url).map_err(ExecError::InvalidPayload)?;
        }
        HealthCheckKind::Tcp => {
            if check.host.as_deref().is_none_or(str::is_empty) || check.port.is_none() {
                return Err(ExecError::InvalidPayload(
                    "healthCheck type tcp needs host and port".into(),
                ));
            }
        }
        HealthCheckKind::Docker => {}
    }
    if check.timeout == Some(0) {
        return Err(ExecError::InvalidPayload(
            "healthCheck timeout must be at least 1 second".into(),
        ));
    }
    Ok(())
}

/// One http/tcp probe, for the kinds that have one; `Ok` for `docker`.
pub(crate) async fn run_probe(check: &HealthCheckConfig, timeout: Duration) -> Result<(), String> {
    match check.kind {
        HealthCheckKind::Http => {
            let url = check.url.as_deref().unwrap_or_default();
            probe::http(url, timeout).await.map(|_| ())
        }
        HealthCheckKind::Tcp => {
            let host = check.host.as_deref().unwrap_or_default();
            probe::tcp_connect(host, check.port.unwrap_or_default(), timeout).await
        }
        HealthCheckKind::Docker => Ok(()),
    }
}

/// Waits until the container is healthy by `check`, fails as soon as it cannot become healthy
/// (exited, crash-looping, HEALTHCHECK unhealthy), or when the check's timeout passes.
pub(crate) async fn wait_container_healthy(
    docker: &Docker,
    container_id: &str,
    check: &HealthCheckConfig,
    stop: &Stop,
    log: &mut Log,
) -> Result<(), ExecError> {
    let (timeout, interval) = health_timing(Some(check));
    let docker_health = match check.kind {
        HealthCheckKind::Docker => DockerHealth::Require,
        _ => DockerHealth::Ignore,
    };
    let deadline = Instant::now() + timeout;
    let mut last;
    loop {
        let c = stop
            .guard(async {
                docker
                    .inspect_container(container_id, None)
                    .await
                    .map_err(|e| engine_error("inspect container", container_id, e))
            })
            .await?;
        match judge(&c, docker_health) {
            Judgement::Failed(why) => return Err(ExecError::HealthCheckFailed(why)),
            Judgement::Waiting(why) => last = why,
            Judgement::Healthy => {
                let probe_timeout = interval.clamp(Duration::from_secs(1), Duration::from_secs(5));
                match stop
                    .guard(async { Ok(run_probe(check, probe_timeout).await) })
                    .await?
                {
                    Ok(()) => return Ok(()),
                    Err(why) => last = why,
                }
            }
        }
        if Instant::now() + interval > deadline {
            return Err(ExecError::HealthCheckFailed(format!(
                "not healthy within {}s: {last}",
                timeout.as_secs()
            )));
        }
        log.line(format!("health: waiting ({last})"));
        stop.guard(async {
            tokio::time::sleep(interval).await;
            Ok(())
        })
        .await?;
    }
}

/// Every container with berth labels (running or not), with its state and health, for the
/// agent's `inspect` task.
pub(crate) async fn inspect_containers(
    docker: &Docker,
) -> Result<Vec<InspectedContainer>, ExecError> {
    let filters = HashMap::from([("label", vec![LABEL_DIGEST])]);
    let options = ListContainersOptionsBuilder::default()
        .all(true)
        .filters(&filters)
        .build();
    let list = docker
        .list_containers(Some(options))
        .await
        .map_err(|e| engine_error("list containers", "with berth labels", e))?;
    let mut out = Vec::new();
    for summary in list {
        let Some(id) = summary.id else { continue };
        let c = match docker.inspect_container(&id, None).await {
            Ok(c) => c,
            // Removed between the listing and now.
            Err(e) if is_not_found(&e) => continue,
            Err(e) => return Err(engine_error("inspect container", &id, e)),
        };
        let labels: BTreeMap<String, String> = c
            .config
            .as_ref()
            .and_then(|cfg| cfg.labels.clone())
            .unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| k.starts_with("berth."))
            .collect();
        let state = c.state.as_ref();
        out.push(InspectedContainer {
            id: id.clone(),
            name: c
                .name
                .as_deref()
                .unwrap_or_default()
                .trim_start_matches('/')
                .to_string(),
            image: c
                .config
                .as_ref()
                .and_then(|cfg| cfg.image.clone())
                .unwrap_or_default(),
            state: state
                .and_then(|s| s.status)
                .map(|s| s.to_string())
                .unwrap_or_default(),
            health: state
                .and_then(|s| s.health.as_ref())
                .and_then(|h| h.status)
                .filter(|s| !matches!(s, HealthStatusEnum::EMPTY | HealthStatusEnum::NONE))
                .map(|s| s.to_string()),
            restart_count: c.restart_count.unwrap_or_default(),
            release_id: labels.get(LABEL_RELEASE_ID).cloned(),
            release_name: labels.get(LABEL_RELEASE_NAME).cloned(),
            digest: labels.get(LABEL_DIGEST).cloned(),
            deployed_at: labels.get(LABEL_DEPLOYED_AT).cloned(),
            labels,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_what_the_engine_says() {
        let cases = [
            ("unauthorized: authentication required", "REGISTRY_AUTH_FAILED"),
            (
                "Get \"http://127.0.0.1:55001/v2/x/manifests/sha256:ab\": no basic auth credentials",
                "REGISTRY_AUTH_FAILED",
            ),
            (
                "Get \"http://127.0.0.1:59999/v2/\": dial tcp 127.0.0.1:59999: connect: connection refused",
                "REGISTRY_UNAVAILABLE",
            ),
            (
                "manifest for 127.0.0.1:55000/x@sha256:ab not found: manifest unknown: manifest unknown",
                "IMAGE_NOT_FOUND",
            ),
            ("manifest verification failed for digest sha256:ab", "DIGEST_MISMATCH"),
            ("something new", "PULL_FAILED"),
        ];
        for (detail, code) in cases {
            let e = classify_pull_failure("img", detail);
            assert_eq!(e.code(), code, "{detail}");
        }
        assert!(classify_pull_failure("i", "dial tcp: connection refused").retriable());
        assert!(!classify_pull_failure("i", "unauthorized").retriable());
    }

    #[test]
    fn credentials_come_in_pairs() {
        let none = BTreeMap::new();
        assert!(registry_credentials(&none, "r").unwrap().is_none());
        let half = BTreeMap::from([(CREDENTIAL_REGISTRY_USERNAME.to_string(), "u".to_string())]);
        assert!(registry_credentials(&half, "r").is_err());
        let both = BTreeMap::from([
            (CREDENTIAL_REGISTRY_USERNAME.to_string(), "u".to_string()),
            (CREDENTIAL_REGISTRY_PASSWORD.to_string(), "p".to_string()),
        ]);
        let c = registry_credentials(&both, "127.0.0.1:55001")
            .unwrap()
            .unwrap();
        assert_eq!(c.serveraddress.as_deref(), Some("127.0.0.1:55001"));
    }

    #[test]
    fn a_token_is_the_engines_registrytoken_and_never_comes_with_a_password() {
        let token = BTreeMap::from([(CREDENTIAL_REGISTRY_TOKEN.to_string(), "t".to_string())]);
        let c = registry_credentials(&token, "127.0.0.1:55002")
            .unwrap()
            .unwrap();
        assert_eq!(c.registrytoken.as_deref(), Some("t"));
        assert_eq!(c.username, None);
        assert_eq!(c.password, None);
        assert_eq!(c.serveraddress.as_deref(), Some("127.0.0.1:55002"));
        let mixed = BTreeMap::from([
            (CREDENTIAL_REGISTRY_TOKEN.to_string(), "t".to_string()),
            (CREDENTIAL_REGISTRY_PASSWORD.to_string(), "p".to_string()),
        ]);
        assert!(registry_credentials(&mixed, "r").is_err());
    }
}
