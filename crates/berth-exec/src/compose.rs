//! `compose.up` (seed 000, module agent-compose): a compose stack from a lock file whose every
//! image is pinned by digest.
//!
//! Order: verify the lock (every service `@sha256:` and equal to `expectedDigests`, every
//! expected service present) before anything is written, pulled or changed → write
//! `compose.berth.lock.yml`, keeping the previous one as `compose.berth.lock.yml.bak` →
//! pre-deploy hook → pull → `up -d --remove-orphans --force-recreate` → wait until every
//! service's containers run and are healthy → post-deploy hook → sticker. A failure after `up`
//! restores the backup and brings it up again.
//!
//! Compose runs as `docker compose` (v2) when `docker compose version` works, else
//! `docker-compose` (v1), always as an argument vector with `-p <project> -f <lock>`; the
//! project name and directory are validated first. Never a shell.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_proto::kind::TaskKind;
use berth_proto::payload::{DeployTaskPayload, HealthCheckConfig, ARTIFACT_COMPOSE_LOCK};
use berth_proto::result::error_types;
use bollard::query_parameters::ListContainersOptionsBuilder;
use bollard::Docker;
use serde::Deserialize;
use tokio::time::Instant;

use crate::engine::{self, engine_error, Engine, Judgement};
use crate::error::ExecError;
use crate::hooks::{self, AllowedHooks};
use crate::process::{self, Ended, Spec};
use crate::reference::{self, ImageRef};
use crate::run::{millis_since, Log, Run, Stop};
use crate::sticker::{Sticker, StickerStore};
use crate::{parse_payload, Executor, Outcome, Task};

/// The lock file berth writes in the deployment directory.
pub const LOCK_FILE: &str = "compose.berth.lock.yml";
/// The previous lock, kept to restore on failure.
pub const BACKUP_FILE: &str = "compose.berth.lock.yml.bak";

/// Compose labels the engine carries for every service container (v1 and v2 alike).
pub(crate) const LABEL_PROJECT: &str = "com.docker.compose.project";
const LABEL_SERVICE: &str = "com.docker.compose.service";
const LABEL_ONEOFF: &str = "com.docker.compose.oneoff";

/// Budget for restoring the previous stack after a failure; not cancellable.
const RESTORE_BUDGET: Duration = Duration::from_secs(300);

/// Runs `compose.up` with the host's compose (v2 plugin, else v1).
///
/// Like [`DockerExecutor`](crate::docker::DockerExecutor), it reaches the engine lazily (to find
/// the stack's containers and their health). Registry credentials (`registryUsername`,
/// `registryPassword`, optional `registryServer`) are handed to compose through a private
/// `DOCKER_CONFIG` directory, `docker-config-<uuid>` (0700) inside `credentials_dir` (made 0700),
/// removed when the task ends on every path; [`sweep_credentials`] removes what a killed agent
/// left. Hooks run only programs on
/// [`with_allowed_hooks`](ComposeExecutor::with_allowed_hooks)' list (none by default).
pub struct ComposeExecutor {
    stickers: StickerStore,
    engine: Engine,
    forced_command: Option<Vec<String>>,
    detected: tokio::sync::OnceCell<Vec<String>>,
    allowed_hooks: AllowedHooks,
    credentials_dir: PathBuf,
}

impl ComposeExecutor {
    /// `credentials_dir` holds the temporary registry logins: the agent passes
    /// `<state-dir>/tmp`, never a shared directory such as `/tmp`.
    pub fn new(sticker_store: StickerStore, credentials_dir: PathBuf) -> ComposeExecutor {
        ComposeExecutor {
            stickers: sticker_store,
            engine: Engine::new(),
            forced_command: None,
            detected: tokio::sync::OnceCell::new(),
            allowed_hooks: AllowedHooks::default(),
            credentials_dir,
        }
    }

    /// The programs pre- and post-deploy hooks may run (absolute paths, matched exactly).
    pub fn with_allowed_hooks(mut self, programs: Vec<PathBuf>) -> ComposeExecutor {
        self.allowed_hooks = AllowedHooks::new(programs);
        self
    }

    /// Uses this compose command (e.g. `["docker-compose"]`) instead of detecting one.
    pub fn with_compose_command(mut self, argv: Vec<String>) -> ComposeExecutor {
        self.forced_command = Some(argv).filter(|a| !a.is_empty());
        self
    }

    /// The compose command this executor uses: `["docker", "compose"]` or `["docker-compose"]`.
    pub async fn compose_command(&self) -> Result<Vec<String>, ExecError> {
        if let Some(c) = &self.forced_command {
            return Ok(c.clone());
        }
        self.detected.get_or_try_init(detect_compose).await.cloned()
    }
}

pub(crate) async fn detect_compose() -> Result<Vec<String>, ExecError> {
    let mut why = Vec::new();
    for candidate in [vec!["docker", "compose"], vec!["docker-compose"]] {
        let mut argv: Vec<String> = candidate.iter().map(|s| s.to_string()).collect();
        argv.push("version".into());
        let spec = Spec {
            argv: &argv,
            ..Default::default()
        };
        let stop = Stop::cleanup(Duration::from_secs(30));
        match process::run(&spec, Duration::from_secs(20), &stop).await {
            Ok(f) if f.success() => {
                return Ok(candidate.iter().map(|s| s.to_string()).collect());
            }
            Ok(f) => why.push(format!(
                "{}: {}",
                candidate.join(" "),
                first_line(&f.output())
            )),
            Err(e) => why.push(format!("{}: {e}", candidate.join(" "))),
        }
    }
    Err(ExecError::ComposeUnavailable(why.join("; ")))
}

fn first_line(s: &str) -> String {
    s.lines()
        .next()
        .unwrap_or_default()
        .chars()
        .take(200)
        .collect()
}

#[async_trait::async_trait]
impl Executor for ComposeExecutor {
    fn task_types(&self) -> &'static [TaskKind] {
        &[TaskKind::ComposeUp]
    }

    async fn execute(&self, task: &Task) -> Outcome {
        if TaskKind::parse(&task.task_type) != Some(TaskKind::ComposeUp) {
            return Outcome::failed(
                error_types::UNSUPPORTED_TASK_TYPE,
                format!("the compose executor does not run {}", task.task_type),
                false,
            );
        }
        let payload: DeployTaskPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        let mut run = Run::new(task);
        let result = self.deploy(&mut run, &payload).await;
        run.finish(result)
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct ComposeDoc {
    #[serde(default)]
    pub services: BTreeMap<String, ComposeService>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ComposeService {
    #[serde(default)]
    image: Option<String>,
    #[serde(default)]
    build: Option<serde_yaml_ng::Value>,
}

/// Checks the lock against `expected` (service → digest): every service pinned `@sha256:` to
/// exactly its expected digest, no service missing, none extra. Returns each service's image.
pub(crate) fn verify_lock(
    content: &str,
    expected: &BTreeMap<String, String>,
) -> Result<BTreeMap<String, ImageRef>, ExecError> {
    // Through `Value` first: it refuses duplicate keys, which YAML parsers resolve differently
    // (a lock whose services we read one way and compose another must not pass).
    let doc: ComposeDoc = serde_yaml_ng::from_str::<serde_yaml_ng::Value>(content)
        .and_then(serde_yaml_ng::from_value)
        .map_err(|e| ExecError::ComposeLockInvalid(e.to_string()))?;
    if doc.services.is_empty() {
        return Err(ExecError::ComposeLockInvalid(
            "it defines no services".into(),
        ));
    }
    if expected.is_empty() {
        return Err(ExecError::InvalidPayload(
            "config.expectedDigests must name the digest of every service".into(),
        ));
    }
    for (service, digest) in expected {
        if !reference::is_sha256_digest(digest) {
            return Err(ExecError::InvalidPayload(format!(
                "expectedDigests.{service} {digest:?} is not a sha256 digest"
            )));
        }
        if !doc.services.contains_key(service) {
            return Err(ExecError::ServiceNotFound(format!(
                "service {service} is expected but not in the compose lock"
            )));
        }
    }
    let mut images = BTreeMap::new();
    for (service, def) in &doc.services {
        if def.build.is_some() {
            return Err(ExecError::DigestRequired(format!(
                "service {service} builds its image; only images pinned by digest are deployed"
            )));
        }
        let Some(image) = def.image.as_deref() else {
            return Err(ExecError::DigestRequired(format!(
                "service {service} has no image"
            )));
        };
        if !image.contains("@sha256:") {
            return Err(ExecError::DigestRequired(format!(
                "service {service} image {image} is not pinned to a digest"
            )));
        }
        let parsed = reference::parse_image(image)
            .map_err(|e| ExecError::ComposeLockInvalid(format!("service {service}: {e}")))?;
        let actual = parsed.digest.as_deref().unwrap_or_default();
        match expected.get(service) {
            None => {
                return Err(ExecError::DigestMismatch(format!(
                    "service {service} is in the compose lock but has no expected digest"
                )))
            }
            Some(want) if want != actual => {
                return Err(ExecError::DigestMismatch(format!(
                    "service {service}: expected {want}, the compose lock pins {actual}: possible tampering"
                )))
            }
            Some(_) => {}
        }
        images.insert(service.clone(), parsed);
    }
    Ok(images)
}

/// An absolute, normalized directory that is not `/`.
fn validate_directory(dir: &str) -> Result<PathBuf, ExecError> {
    // The rule is `berth_proto::payload`'s, so create refuses what this does.
    if berth_proto::payload::valid_directory(dir) {
        Ok(PathBuf::from(dir))
    } else {
        Err(ExecError::InvalidPayload(format!(
            "config.deploymentDirectory {dir:?} must be an absolute path other than /, without . or .."
        )))
    }
}

/// A validated `compose.up` payload.
#[derive(Debug)]
struct Plan {
    project: String,
    dir: PathBuf,
    content: String,
    images: BTreeMap<String, ImageRef>,
    health: Option<HealthCheckConfig>,
    release_id: Option<String>,
    release_name: Option<String>,
}

fn plan(p: &DeployTaskPayload, allowed_hooks: &AllowedHooks) -> Result<Plan, ExecError> {
    let c = &p.config;
    let project = c
        .project_name
        .clone()
        .ok_or_else(|| ExecError::InvalidPayload("config.projectName is required".into()))?;
    if !reference::valid_project_name(&project) {
        return Err(ExecError::InvalidPayload(format!(
            "project name {project:?} must be 1-64 of a-z 0-9 _ - starting with a letter or digit"
        )));
    }
    let dir = validate_directory(c.deployment_directory.as_deref().ok_or_else(|| {
        ExecError::InvalidPayload("config.deploymentDirectory is required".into())
    })?)?;
    // Fail closed: no inline lock, no deployment.
    let content = p
        .artifacts
        .iter()
        .find(|a| a.kind == ARTIFACT_COMPOSE_LOCK)
        .and_then(|a| a.content.clone())
        .ok_or(ExecError::ComposeLockMissing)?;
    let images = verify_lock(&content, &c.expected_digests)?;
    if let Some(h) = &c.health_check {
        engine::validate_health_check(h)?;
    }
    hooks::validate_all(&p.hooks, allowed_hooks)?;
    Ok(Plan {
        project,
        dir,
        content,
        images,
        health: c.health_check.clone(),
        release_id: c.release_id.clone(),
        release_name: c.release_name.clone(),
    })
}

/// Writes `bytes` to `path` with [`berth_fs::write_atomic`], 0600 (a compose file may carry
/// environment values), so a crash never leaves half a lock.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ExecError> {
    berth_fs::write_atomic(path, bytes, 0o600).map_err(|source| ExecError::Io {
        what: "cannot write",
        path: path.display().to_string(),
        source,
    })
}

/// The name prefix of a registry login directory inside the credentials directory.
pub const DOCKER_CONFIG_PREFIX: &str = "docker-config-";

/// Removes every `docker-config-*` left in `credentials_dir` by an agent that was killed while a
/// compose task held a registry login. The agent calls it at start, before any task runs.
/// Returns how many it removed; a missing directory is nothing to sweep.
pub fn sweep_credentials(credentials_dir: &Path) -> std::io::Result<usize> {
    let entries = match std::fs::read_dir(credentials_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut removed = 0;
    for entry in entries {
        let entry = entry?;
        if !entry
            .file_name()
            .to_string_lossy()
            .starts_with(DOCKER_CONFIG_PREFIX)
        {
            continue;
        }
        let path = entry.path();
        if entry.file_type()?.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
        removed += 1;
    }
    Ok(removed)
}

/// Creates `dir` if needed and makes it 0700, refusing a symlink or a non-directory.
fn private_dir(dir: &Path) -> Result<(), ExecError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let io = |what: &'static str| {
        move |source| ExecError::Io {
            what,
            path: dir.display().to_string(),
            source,
        }
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(io("cannot create"))?;
    let meta = std::fs::symlink_metadata(dir).map_err(io("cannot inspect"))?;
    if !meta.is_dir() {
        return Err(io("is not a directory")(std::io::Error::other(
            "the credentials directory must be a real directory",
        )));
    }
    if meta.permissions().mode() & 0o777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io("cannot make 0700"))?;
    }
    Ok(())
}

/// A private `DOCKER_CONFIG` with one registry login for compose, removed by
/// [`remove`](DockerConfigDir::remove) or, on any other path (error, cancellation, panic), on drop.
pub(crate) struct DockerConfigDir(PathBuf);

impl DockerConfigDir {
    fn create(
        parent: &Path,
        server: &str,
        login: &bollard::auth::DockerCredentials,
    ) -> Result<DockerConfigDir, ExecError> {
        use base64::Engine as _;
        use std::os::unix::fs::DirBuilderExt;
        private_dir(parent)?;
        let dir = parent.join(format!("{DOCKER_CONFIG_PREFIX}{}", uuid::Uuid::new_v4()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(|source| ExecError::Io {
                what: "cannot create",
                path: dir.display().to_string(),
                source,
            })?;
        let guard = DockerConfigDir(dir);
        // A bearer token is the CLI's `registrytoken`, which it hands to the engine as is.
        let entry = match &login.registrytoken {
            Some(token) => serde_json::json!({"registrytoken": token}),
            None => {
                let user = login.username.as_deref().unwrap_or_default();
                let password = login.password.as_deref().unwrap_or_default();
                let auth =
                    base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
                serde_json::json!({"auth": auth})
            }
        };
        let config = serde_json::json!({"auths": {server: entry}});
        write_atomic(&guard.0.join("config.json"), config.to_string().as_bytes())?;
        Ok(guard)
    }

    /// Removes the login now, saying so in the log when it cannot.
    fn remove(self, log: &mut Log) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            log.line(format!(
                "warning: could not remove the registry login {}: {e}",
                self.0.display()
            ));
        }
        // Drop tries again, and finds nothing.
    }
}

impl Drop for DockerConfigDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What the deployment changed so far, so a failure can undo it.
#[derive(Debug, Default)]
struct Touched {
    /// The lock file was replaced (and `had_previous` says whether there was one to back up).
    lock_written: bool,
    had_previous: bool,
    /// `up` ran, so containers changed.
    up_ran: bool,
}

/// Runs compose for one project; keeps the argument vector and its environment together.
pub(crate) struct Compose<'a> {
    pub command: &'a [String],
    pub project: &'a str,
    pub dir: &'a Path,
    /// The compose file (`-f`).
    pub lock: PathBuf,
    pub config_dir: Option<&'a DockerConfigDir>,
    /// `--env-file` (a desired-state stack's rendered `.env`).
    pub env_file: Option<PathBuf>,
}

impl Compose<'_> {
    pub(crate) async fn run(
        &self,
        args: &[&str],
        stop: &Stop,
        log: &mut Log,
    ) -> Result<String, (ExecError, String)> {
        let mut argv: Vec<String> = self.command.to_vec();
        argv.extend(["-p".to_string(), self.project.to_string(), "-f".to_string()]);
        argv.push(self.lock.display().to_string());
        if let Some(env_file) = &self.env_file {
            argv.extend(["--env-file".to_string(), env_file.display().to_string()]);
        }
        argv.extend(args.iter().map(|a| a.to_string()));
        log.line(format!("running {argv:?}"));
        let mut env = Vec::new();
        if let Some(dir) = self.config_dir {
            env.push(("DOCKER_CONFIG".to_string(), dir.0.display().to_string()));
        }
        let spec = Spec {
            argv: &argv,
            cwd: Some(self.dir),
            env,
            // -p and -f say it all; the agent's own environment must not add files or profiles.
            env_remove: &["COMPOSE_FILE", "COMPOSE_PROJECT_NAME", "COMPOSE_PROFILES"],
        };
        let action = args.first().copied().unwrap_or("compose");
        let finished = process::run(&spec, stop.remaining(), stop)
            .await
            .map_err(|e| {
                (
                    ExecError::ComposeUnavailable(format!("cannot start {:?}: {e}", self.command)),
                    String::new(),
                )
            })?;
        let output = finished.output();
        let tail = tail_lines(&output, 30);
        if !tail.is_empty() {
            log.line(format!("compose {action} output:\n{tail}"));
        }
        match finished.ended {
            Ended::Exited(s) if s.success() => Ok(output),
            Ended::Exited(s) => Err((
                ExecError::Compose {
                    action: static_action(action),
                    detail: format!(
                        "exit status {}: {}",
                        s.code().unwrap_or(-1),
                        tail_lines(&output, 5)
                    ),
                },
                output,
            )),
            Ended::TimedOut => Err((ExecError::TimedOut, output)),
            Ended::Stopped(e) => Err((e, output)),
        }
    }
}

fn static_action(action: &str) -> &'static str {
    match action {
        "pull" => "pull",
        "up" => "up",
        "down" => "down",
        _ => "command",
    }
}

pub(crate) fn tail_lines(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

impl ComposeExecutor {
    async fn deploy(
        &self,
        run: &mut Run<'_>,
        payload: &DeployTaskPayload,
    ) -> Result<String, ExecError> {
        let plan = plan(payload, &self.allowed_hooks)?;
        run.output("projectName", plan.project.clone());
        run.output(
            "services",
            plan.images
                .iter()
                .map(|(s, i)| (s.clone(), i.digest.clone().unwrap_or_default().into()))
                .collect::<serde_json::Map<_, _>>(),
        );
        run.log.line(format!(
            "compose lock verified: {} service(s) pinned to their expected digests",
            plan.images.len()
        ));
        let config_dir = self.registry_login(run, &plan)?;
        let command = run.stop.guard(self.compose_command()).await?;
        run.log.line(format!("compose command: {command:?}"));
        let docker = run.stop.guard(self.engine.docker()).await?;
        run.stop.check()?;

        std::fs::create_dir_all(&plan.dir).map_err(|source| ExecError::Io {
            what: "cannot create",
            path: plan.dir.display().to_string(),
            source,
        })?;
        let compose = Compose {
            command: &command,
            project: &plan.project,
            dir: &plan.dir,
            lock: plan.dir.join(LOCK_FILE),
            config_dir: config_dir.as_ref(),
            env_file: None,
        };
        let mut touched = Touched::default();
        let result = self
            .apply(run, docker, &plan, &compose, &mut touched, payload)
            .await;
        if result.is_err() {
            if touched.up_ran {
                let rolled_back = restore(docker, &plan, &compose, &touched, &mut run.log).await;
                run.output("rolledBack", rolled_back);
            } else if touched.lock_written {
                // Nothing running changed: put the lock file back as it was.
                restore_lock_file(&plan.dir, touched.had_previous, &mut run.log);
            }
        }
        // The login is needed no longer: gone before the sticker, whatever happened.
        drop(compose);
        if let Some(login) = config_dir {
            login.remove(&mut run.log);
        }
        result?;

        let sticker = Sticker {
            name: plan.project.clone(),
            release_id: plan.release_id.clone(),
            release_name: plan.release_name.clone(),
            image: None,
            digest: None,
            task_id: run.task.task_id.to_string(),
            written_at: time::OffsetDateTime::now_utc(),
            extra: serde_json::Map::from_iter([
                (
                    "services".to_string(),
                    run.outputs.get("services").cloned().unwrap_or_default(),
                ),
                (
                    "deploymentDirectory".to_string(),
                    plan.dir.display().to_string().into(),
                ),
            ]),
        };
        let path = self.stickers.write(&sticker).map_err(ExecError::Sticker)?;
        run.log
            .line(format!("sticker written to {}", path.display()));
        Ok(format!(
            "deployed compose project {} ({} services)",
            plan.project,
            plan.images.len()
        ))
    }

    /// The temporary `DOCKER_CONFIG` for the task's registry login, if it carries one.
    fn registry_login(
        &self,
        run: &mut Run<'_>,
        plan: &Plan,
    ) -> Result<Option<DockerConfigDir>, ExecError> {
        let creds = &run.task.credentials;
        let registries: std::collections::BTreeSet<&str> =
            plan.images.values().map(ImageRef::registry).collect();
        let server = match creds.get(engine::CREDENTIAL_REGISTRY_SERVER) {
            Some(s) => s.clone(),
            None if registries.len() == 1 => registries
                .iter()
                .next()
                .map(|s| s.to_string())
                .unwrap_or_default(),
            None => String::new(),
        };
        let Some(login) = engine::registry_credentials(creds, &server)? else {
            return Ok(None);
        };
        if server.is_empty() {
            // One password for several registries would hand it to all of them.
            return Err(ExecError::InvalidPayload(format!(
                "the images come from several registries ({registries:?}): credentials need {}",
                engine::CREDENTIAL_REGISTRY_SERVER
            )));
        }
        run.log
            .line(format!("using registry credentials for {server}"));
        DockerConfigDir::create(&self.credentials_dir, &server, &login).map(Some)
    }

    async fn apply(
        &self,
        run: &mut Run<'_>,
        docker: &Docker,
        plan: &Plan,
        compose: &Compose<'_>,
        touched: &mut Touched,
        payload: &DeployTaskPayload,
    ) -> Result<(), ExecError> {
        // 1. Lock file, with the previous one kept as the backup.
        run.confirm_lease("writing the lock file").await?;
        let lock = plan.dir.join(LOCK_FILE);
        match std::fs::read(&lock) {
            Ok(previous) => {
                write_atomic(&plan.dir.join(BACKUP_FILE), &previous)?;
                touched.had_previous = true;
                if let Ok(text) = std::str::from_utf8(&previous) {
                    run.output("previousDigests", previous_digests(text));
                }
                run.log
                    .line(format!("kept the previous lock as {BACKUP_FILE}"));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(ExecError::Io {
                    what: "cannot read",
                    path: lock.display().to_string(),
                    source,
                })
            }
        }
        write_atomic(&lock, plan.content.as_bytes())?;
        touched.lock_written = true;
        run.log.line(format!("wrote {}", lock.display()));

        // 2. Pre-deploy hook.
        let hook_env = vec![
            ("BERTH_PROJECT_NAME".to_string(), plan.project.clone()),
            (
                "BERTH_DEPLOYMENT_DIRECTORY".to_string(),
                plan.dir.display().to_string(),
            ),
        ];
        if let Some(hook) = &payload.hooks.pre_deploy {
            hooks::run_hook(
                run,
                hook,
                "pre-deploy",
                Some(&plan.dir),
                hook_env.clone(),
                &self.allowed_hooks,
            )
            .await?;
        }

        // 3. Pull, then check what the engine now has against the digests.
        let stop = run.stop.clone();
        let started = Instant::now();
        let pulled = compose.run(&["pull"], &stop, &mut run.log).await;
        run.metrics.pull_duration_ms = Some(millis_since(started));
        if let Err((e, output)) = pulled {
            return Err(match e {
                ExecError::Compose { .. } => {
                    let failing = plan
                        .images
                        .values()
                        .next()
                        .map(|i| i.repository.clone())
                        .unwrap_or_default();
                    classify_compose_pull(&failing, &output)
                }
                other => other,
            });
        }
        for image in plan.images.values() {
            let digest = image.digest.as_deref().unwrap_or_default();
            stop.guard(engine::verify_digest(docker, image, digest))
                .await?;
        }
        run.log.line("pulled images verified against their digests");

        // 4. Up.
        run.confirm_lease("compose up").await?;
        let started = Instant::now();
        touched.up_ran = true;
        let up = compose
            .run(
                &["up", "-d", "--remove-orphans", "--force-recreate"],
                &stop,
                &mut run.log,
            )
            .await;
        run.metrics.deploy_duration_ms = Some(millis_since(started));
        up.map_err(|(e, _)| e)?;

        // 5. Health.
        let started = Instant::now();
        let services: Vec<String> = plan.images.keys().cloned().collect();
        let healthy = wait_project_healthy(
            docker,
            &plan.project,
            &services,
            plan.health.as_ref(),
            &stop,
            &mut run.log,
        )
        .await;
        run.metrics.health_check_duration_ms = Some(millis_since(started));
        let ids = healthy?;
        run.output(
            "containerIds",
            serde_json::to_value(&ids).unwrap_or_default(),
        );
        run.log
            .line(format!("all services of {} are healthy", plan.project));

        // 6. Post-deploy hook.
        if let Some(hook) = &payload.hooks.post_deploy {
            hooks::run_hook(
                run,
                hook,
                "post-deploy",
                Some(&plan.dir),
                hook_env,
                &self.allowed_hooks,
            )
            .await?;
        }
        Ok(())
    }
}

/// `compose pull` failed: the output says why, in the engine's words. The image named is the
/// one the output mentions, when it mentions one of ours.
fn classify_compose_pull(fallback_image: &str, output: &str) -> ExecError {
    let detail = tail_lines(output, 5);
    engine::classify_pull_failure(fallback_image, &detail)
}

/// `{service: digest}` of a previous lock, best effort (it was verified when it was deployed).
fn previous_digests(content: &str) -> serde_json::Value {
    let Ok(doc) = serde_yaml_ng::from_str::<ComposeDoc>(content) else {
        return serde_json::Value::Null;
    };
    doc.services
        .into_iter()
        .filter_map(|(s, d)| {
            let digest = reference::parse_image(d.image.as_deref()?).ok()?.digest?;
            Some((s, serde_json::Value::from(digest)))
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

fn restore_lock_file(dir: &Path, had_previous: bool, log: &mut Log) {
    let lock = dir.join(LOCK_FILE);
    let result = if had_previous {
        std::fs::read(dir.join(BACKUP_FILE))
            .map_err(|e| e.to_string())
            .and_then(|b| write_atomic(&lock, &b).map_err(|e| e.chain()))
    } else {
        std::fs::remove_file(&lock).map_err(|e| e.to_string())
    };
    match result {
        Ok(()) if had_previous => log.line(format!("restored the previous {LOCK_FILE}")),
        Ok(()) => log.line(format!("removed the new {LOCK_FILE}")),
        Err(e) => log.line(format!("warning: could not restore {LOCK_FILE}: {e}")),
    }
}

/// Undoes a failed `up`: with a backup, restore it, bring it up again and wait for it to be
/// healthy (`true` when it is); without one, take the new stack down (`false`: there was
/// nothing to roll back to). Not cancellable; bounded by [`RESTORE_BUDGET`].
async fn restore(
    docker: &Docker,
    plan: &Plan,
    compose: &Compose<'_>,
    touched: &Touched,
    log: &mut Log,
) -> bool {
    let stop = Stop::cleanup(RESTORE_BUDGET);
    restore_lock_file(&plan.dir, touched.had_previous, log);
    if !touched.had_previous {
        // The lock file is gone; take the stack down with the new lock's content.
        let tmp = plan
            .dir
            .join(format!(".berth-down-{}.yml", uuid::Uuid::new_v4()));
        if write_atomic(&tmp, plan.content.as_bytes()).is_ok() {
            let down = Compose {
                command: compose.command,
                project: compose.project,
                dir: compose.dir,
                lock: tmp.clone(),
                config_dir: compose.config_dir,
                env_file: None,
            };
            if let Err((e, _)) = down.run(&["down", "--remove-orphans"], &stop, log).await {
                log.line(format!("rollback: {}", e.chain()));
            }
            let _ = std::fs::remove_file(&tmp);
        }
        log.line("rollback: there was no previous stack to restore");
        return false;
    }
    log.line("rollback: bringing the previous stack up again");
    if let Err((e, _)) = compose
        .run(
            &["up", "-d", "--remove-orphans", "--force-recreate"],
            &stop,
            log,
        )
        .await
    {
        log.line(format!("rollback: {}", e.chain()));
        return false;
    }
    let services: Vec<String> = match std::fs::read_to_string(&compose.lock)
        .ok()
        .and_then(|c| serde_yaml_ng::from_str::<ComposeDoc>(&c).ok())
    {
        Some(doc) => doc.services.into_keys().collect(),
        None => return false,
    };
    match wait_project_healthy(
        docker,
        &plan.project,
        &services,
        plan.health.as_ref(),
        &stop,
        log,
    )
    .await
    {
        Ok(_) => {
            log.line("rollback: the previous stack is healthy again");
            true
        }
        Err(e) => {
            log.line(format!("rollback: {}", e.chain()));
            false
        }
    }
}

/// Waits until every service has at least one container, all of them running (and healthy
/// where they have a HEALTHCHECK), plus the payload's http/tcp probe when it has one. Fails as
/// soon as a container exits, crash-loops or turns unhealthy. Returns the container ids.
pub(crate) async fn wait_project_healthy(
    docker: &Docker,
    project: &str,
    services: &[String],
    check: Option<&HealthCheckConfig>,
    stop: &Stop,
    log: &mut Log,
) -> Result<BTreeMap<String, Vec<String>>, ExecError> {
    let (timeout, interval) = engine::health_timing(check);
    let deadline = Instant::now() + timeout;
    let project_label = format!("{LABEL_PROJECT}={project}");
    let filters = HashMap::from([("label", vec![project_label.as_str()])]);
    loop {
        let options = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let list = stop
            .guard(async {
                docker
                    .list_containers(Some(options))
                    .await
                    .map_err(|e| engine_error("list containers of", project, e))
            })
            .await?;
        let mut by_service: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for c in list {
            let labels = c.labels.unwrap_or_default();
            if labels
                .get(LABEL_ONEOFF)
                .is_some_and(|v| v.eq_ignore_ascii_case("true"))
            {
                continue;
            }
            if let (Some(service), Some(id)) = (labels.get(LABEL_SERVICE), c.id) {
                by_service.entry(service.clone()).or_default().push(id);
            }
        }
        let mut waiting = None;
        for service in services {
            let Some(ids) = by_service.get(service) else {
                waiting.get_or_insert_with(|| format!("service {service} has no container yet"));
                continue;
            };
            for id in ids {
                let c = stop
                    .guard(async {
                        docker
                            .inspect_container(id, None)
                            .await
                            .map_err(|e| engine_error("inspect container", id, e))
                    })
                    .await?;
                match engine::judge(&c, engine::DockerHealth::IfPresent) {
                    Judgement::Healthy => {}
                    Judgement::Waiting(why) => {
                        waiting.get_or_insert_with(|| format!("service {service}: {why}"));
                    }
                    Judgement::Failed(why) => {
                        return Err(ExecError::HealthCheckFailed(format!(
                            "service {service} of {project} failed its health check: {why}"
                        )))
                    }
                }
            }
        }
        if waiting.is_none() {
            if let Some(check) = check {
                let probe_timeout = interval.clamp(Duration::from_secs(1), Duration::from_secs(5));
                if let Err(why) = stop
                    .guard(async { Ok(engine::run_probe(check, probe_timeout).await) })
                    .await?
                {
                    waiting = Some(why);
                }
            }
        }
        let Some(why) = waiting else {
            let services: std::collections::BTreeSet<&String> = services.iter().collect();
            by_service.retain(|s, _| services.contains(s));
            return Ok(by_service);
        };
        if Instant::now() + interval > deadline {
            return Err(ExecError::HealthCheckFailed(format!(
                "{project} not healthy within {}s: {why}",
                timeout.as_secs()
            )));
        }
        log.line(format!("health: waiting ({why})"));
        stop.guard(async {
            tokio::time::sleep(interval).await;
            Ok(())
        })
        .await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(c: char) -> String {
        format!("sha256:{}", c.to_string().repeat(64))
    }

    fn lock(web: &str, db: &str) -> String {
        format!("services:\n  web:\n    image: 127.0.0.1:5000/web@{web}\n  db:\n    image: 127.0.0.1:5000/db@{db}\n")
    }

    #[test]
    fn accepts_a_lock_that_matches() {
        let expected = BTreeMap::from([("web".into(), d('a')), ("db".into(), d('b'))]);
        let images = verify_lock(&lock(&d('a'), &d('b')), &expected).unwrap();
        assert_eq!(images["web"].digest.as_deref(), Some(d('a').as_str()));
    }

    #[test]
    fn refuses_every_way_around_the_digests() {
        let expected = BTreeMap::from([("web".into(), d('a')), ("db".into(), d('b'))]);
        let cases = [
            (lock(&d('a'), &d('c')), "DIGEST_MISMATCH"),
            (
                format!("services:\n  web:\n    image: 127.0.0.1:5000/web:latest\n  db:\n    image: x@{}\n", d('b')),
                "DIGEST_REQUIRED",
            ),
            (format!("services:\n  web:\n    image: 127.0.0.1:5000/web@{}\n", d('a')), "SERVICE_NOT_FOUND"),
            (
                format!("{}  extra:\n    image: 127.0.0.1:5000/x@{}\n", lock(&d('a'), &d('b')), d('e')),
                "DIGEST_MISMATCH",
            ),
            (
                format!("services:\n  web:\n    build: .\n    image: 127.0.0.1:5000/web@{}\n  db:\n    image: x@{}\n", d('a'), d('b')),
                "DIGEST_REQUIRED",
            ),
            (
                format!("services:\n  web:\n    image: \"${{IMG:-127.0.0.1:5000/web@{}}}\"\n  db:\n    image: x@{}\n", d('a'), d('b')),
                "COMPOSE_LOCK_INVALID",
            ),
            ("services: [".to_string(), "COMPOSE_LOCK_INVALID"),
            ("services: {}\n".to_string(), "COMPOSE_LOCK_INVALID"),
            (
                format!("services:\n  web:\n    image: a@{}\n  web:\n    image: b@{}\n  db:\n    image: x@{}\n", d('a'), d('a'), d('b')),
                "COMPOSE_LOCK_INVALID",
            ),
        ];
        for (content, code) in cases {
            let err = verify_lock(&content, &expected).unwrap_err();
            assert_eq!(err.code(), code, "{content}\n{err}");
        }
        assert_eq!(
            verify_lock(&lock(&d('a'), &d('b')), &BTreeMap::new())
                .unwrap_err()
                .code(),
            "INVALID_PAYLOAD"
        );
    }

    #[test]
    fn the_registry_login_lives_only_as_long_as_its_guard() {
        let parent = tempfile::tempdir().unwrap();
        let login = bollard::auth::DockerCredentials {
            username: Some("u".into()),
            password: Some("secret".into()),
            ..Default::default()
        };
        let guard =
            DockerConfigDir::create(&parent.path().join("tmp"), "127.0.0.1:5000", &login).unwrap();
        let path = guard.0.clone();
        assert_eq!(path.parent(), Some(parent.path().join("tmp").as_path()));
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["auths"]["127.0.0.1:5000"]["auth"], "dTpzZWNyZXQ=");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        drop(guard);
        assert!(!path.exists());
    }

    #[test]
    fn refuses_bad_directories() {
        assert!(validate_directory("/srv/app").is_ok());
        for bad in ["", "/", "srv/app", "/srv/../etc", "/srv/./x"] {
            assert!(validate_directory(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_missing_lock_fails_closed() {
        let p = DeployTaskPayload {
            config: berth_proto::payload::DeployConfig {
                project_name: Some("app".into()),
                deployment_directory: Some("/srv/app".into()),
                expected_digests: BTreeMap::from([("web".into(), d('a'))]),
                ..Default::default()
            },
            ..Default::default()
        };
        assert_eq!(
            plan(&p, &AllowedHooks::default()).unwrap_err().code(),
            "COMPOSE_LOCK_MISSING"
        );
    }
}
