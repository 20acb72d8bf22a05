//! A desired-state stack (seed 001): one compose project per environment, brought up from an
//! unpacked bundle's directory with its rendered `.env`, and taken down on `down`.
//!
//! `up` never leaves a half-applied stack behind: when `up` or the health wait fails, the
//! previous release's directory is brought up again and waited for (or, with no previous
//! release, the new stack is taken down). Compose runs as an argument vector with
//! `-p <project> -f <compose file> --env-file <.env>`, never through a shell, and every line of
//! the log is redacted with the secret values before it leaves this module.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use berth_proto::desired::ContainerState;
use bollard::query_parameters::ListContainersOptionsBuilder;
use bollard::Docker;

use crate::compose::{detect_compose, wait_project_healthy, Compose, ComposeDoc, LABEL_PROJECT};
use crate::engine::Engine;
use crate::error::ExecError;
use crate::redact::redact;
use crate::run::{Log, Stop};

/// The rendered environment file inside a release directory (mode 0600).
pub const ENV_FILE: &str = ".env";

/// Budget for one `up` (pull included) and its health wait.
const APPLY_BUDGET: Duration = Duration::from_secs(600);

/// One release on disk: the directory a bundle was unpacked into, and its compose file's name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub dir: PathBuf,
    pub compose_file: String,
}

impl Release {
    fn compose<'a>(&'a self, command: &'a [String], project: &'a str) -> Compose<'a> {
        Compose {
            command,
            project,
            dir: &self.dir,
            lock: self.dir.join(&self.compose_file),
            config_dir: None,
            // A bundle without secrets may have no `.env`; compose refuses a missing --env-file.
            env_file: Some(self.dir.join(ENV_FILE)).filter(|p| p.exists()),
        }
    }

    fn services(&self) -> Result<Vec<String>, ExecError> {
        let path = self.dir.join(&self.compose_file);
        let text = std::fs::read_to_string(&path).map_err(|source| ExecError::Io {
            what: "cannot read",
            path: path.display().to_string(),
            source,
        })?;
        let doc: ComposeDoc = serde_yaml_ng::from_str(&text)
            .map_err(|e| ExecError::ComposeLockInvalid(format!("{}: {e}", self.compose_file)))?;
        Ok(doc.services.into_keys().collect())
    }
}

/// What an `up` or a `down` did: its result, whether the previous release runs again after a
/// failure, and the redacted log.
#[derive(Debug)]
pub struct StackOutcome {
    pub result: Result<(), ExecError>,
    pub rolled_back: bool,
    pub log: String,
}

/// Runs desired-state stacks with the host's compose.
pub struct StackRunner {
    engine: Engine,
    forced_command: Option<Vec<String>>,
    health_timeout: Duration,
}

impl Default for StackRunner {
    fn default() -> Self {
        StackRunner::new()
    }
}

impl StackRunner {
    pub fn new() -> StackRunner {
        StackRunner {
            engine: Engine::new(),
            forced_command: None,
            health_timeout: Duration::from_secs(crate::engine::DEFAULT_HEALTH_TIMEOUT_SECS),
        }
    }

    /// Uses this compose command (e.g. `["docker-compose"]`) instead of detecting one.
    pub fn with_compose_command(mut self, argv: Vec<String>) -> StackRunner {
        self.forced_command = Some(argv).filter(|a| !a.is_empty());
        self
    }

    /// How long every service has to run and be healthy after `up`.
    pub fn with_health_timeout(mut self, timeout: Duration) -> StackRunner {
        self.health_timeout = timeout;
        self
    }

    async fn command(&self) -> Result<Vec<String>, ExecError> {
        match &self.forced_command {
            Some(c) => Ok(c.clone()),
            None => detect_compose().await,
        }
    }

    /// Brings `release` up as `project` and waits until every service is healthy. On failure,
    /// brings `previous` up again (or takes the new stack down when there is none).
    pub async fn up(
        &self,
        project: &str,
        release: &Release,
        previous: Option<&Release>,
        secrets: &BTreeMap<String, String>,
    ) -> StackOutcome {
        let mut log = Log::new();
        let mut rolled_back = false;
        let result = async {
            let command = self.command().await?;
            let docker = self.engine.docker().await?;
            let stop = Stop::cleanup(APPLY_BUDGET);
            let applied = self
                .apply(docker, &command, project, release, &stop, &mut log)
                .await;
            if let Err(e) = &applied {
                log.line(format!("apply failed: {}", e.chain()));
                rolled_back = self
                    .restore(docker, &command, project, release, previous, &mut log)
                    .await;
            }
            applied
        }
        .await;
        StackOutcome {
            result,
            rolled_back,
            log: redact(log.text(), secrets.values()),
        }
    }

    async fn apply(
        &self,
        docker: &Docker,
        command: &[String],
        project: &str,
        release: &Release,
        stop: &Stop,
        log: &mut Log,
    ) -> Result<(), ExecError> {
        let services = release.services()?;
        let compose = release.compose(command, project);
        compose
            .run(&["up", "-d", "--remove-orphans"], stop, log)
            .await
            .map_err(|(e, _)| e)?;
        let health = self.health_check();
        wait_project_healthy(docker, project, &services, Some(&health), stop, log).await?;
        log.line(format!(
            "{project}: {} service(s) running and healthy",
            services.len()
        ));
        Ok(())
    }

    fn health_check(&self) -> berth_proto::payload::HealthCheckConfig {
        berth_proto::payload::HealthCheckConfig {
            kind: berth_proto::payload::HealthCheckKind::Docker,
            url: None,
            host: None,
            port: None,
            timeout: Some(self.health_timeout.as_secs().max(1)),
            interval: Some(1),
        }
    }

    /// After a failed apply: the previous release up again and healthy (`true`), or, without
    /// one, the failed stack taken down (`false`). Not cancellable; bounded in time.
    async fn restore(
        &self,
        docker: &Docker,
        command: &[String],
        project: &str,
        failed: &Release,
        previous: Option<&Release>,
        log: &mut Log,
    ) -> bool {
        let stop = Stop::cleanup(APPLY_BUDGET);
        let Some(previous) = previous else {
            log.line("rollback: no previous release; taking the failed stack down");
            if let Err((e, _)) = failed
                .compose(command, project)
                .run(&["down", "--remove-orphans"], &stop, log)
                .await
            {
                log.line(format!("rollback: {}", e.chain()));
            }
            return false;
        };
        log.line(format!(
            "rollback: bringing {} up again",
            previous.dir.display()
        ));
        match self
            .apply(docker, command, project, previous, &stop, log)
            .await
        {
            Ok(()) => {
                log.line("rollback: the previous release is healthy again");
                true
            }
            Err(e) => {
                log.line(format!("rollback: {}", e.chain()));
                false
            }
        }
    }

    /// Takes the stack down, its named volumes too when `purge_volumes`.
    pub async fn down(
        &self,
        project: &str,
        release: &Release,
        purge_volumes: bool,
        secrets: &BTreeMap<String, String>,
    ) -> StackOutcome {
        let mut log = Log::new();
        let result = async {
            let command = self.command().await?;
            let mut args = vec!["down", "--remove-orphans"];
            if purge_volumes {
                args.push("--volumes");
            }
            release
                .compose(&command, project)
                .run(&args, &Stop::cleanup(APPLY_BUDGET), &mut log)
                .await
                .map_err(|(e, _)| e)?;
            log.line(format!(
                "{project}: down{}",
                if purge_volumes {
                    ", volumes purged"
                } else {
                    ""
                }
            ));
            Ok(())
        }
        .await;
        StackOutcome {
            result,
            rolled_back: false,
            log: redact(log.text(), secrets.values()),
        }
    }

    /// The project's containers as the seed reports them: name, state, health.
    pub async fn containers(&self, project: &str) -> Result<Vec<ContainerState>, ExecError> {
        let docker = self.engine.docker().await?;
        let label = format!("{LABEL_PROJECT}={project}");
        let filters = HashMap::from([("label", vec![label.as_str()])]);
        let options = ListContainersOptionsBuilder::default()
            .all(true)
            .filters(&filters)
            .build();
        let list = docker
            .list_containers(Some(options))
            .await
            .map_err(|e| crate::engine::engine_error("list containers of", project, e))?;
        let mut out: Vec<ContainerState> = list
            .into_iter()
            .map(|c| {
                let name = c
                    .names
                    .and_then(|n| n.first().cloned())
                    .unwrap_or_default()
                    .trim_start_matches('/')
                    .to_string();
                let status = c.status.unwrap_or_default();
                let health = ["(healthy)", "(unhealthy)", "(health: starting)"]
                    .iter()
                    .find(|h| status.contains(*h))
                    .map(|h| {
                        h.trim_matches(|c| c == '(' || c == ')')
                            .trim_start_matches("health: ")
                            .to_string()
                    });
                ContainerState {
                    name,
                    state: c.state.map(|s| s.to_string()).unwrap_or_default(),
                    health,
                }
            })
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
}
