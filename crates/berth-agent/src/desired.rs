//! Seed 001's converge loop: checkin → (bundle → lease → secrets → apply | down) → report.
//!
//! Each tick asks the server what the environment should run. `apply` fetches the bundle, trusts
//! only the sha it computes itself, refuses anything unsafe before the host changes, resolves the
//! manifest's secrets (berth's `builtin` store or OpenBao, through a fresh lease), renders `.env`
//! (0600) and brings the stack up with compose; a failed apply leaves the previous release
//! running and reports `failed`. `down` removes the stack. Secret values are redacted from every
//! log line and report, and are never logged.
//!
//! Two ways to authenticate: the agent's mTLS identity (a registered berth agent), or
//! `Authorization: Bearer <OpenBao token>` (a kit-installed agent: `bootstrap.jwt` → OpenBao
//! login → `bao.token`). Exit codes (`--once`, or when the loop gives up): 0, 1 (credentials
//! gone, no bootstrap grant: re-run the install kit), 75 (temporary), 78 (configuration,
//! `AGENT_ENV_MISMATCH`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_client::{Client, ClientError, Trust};
use berth_exec::stack::{Release, StackRunner, ENV_FILE};
use berth_proto::desired::{
    paths, Checkin, CheckinAction, CheckinResponse, HostFacts, LeaseRequest, LeaseResponse, Report,
    ReportResult, SecretPath, LEASE_HEADER, MAX_LOG_TAIL_BYTES,
};
use berth_proto::error::codes;
use serde::{Deserialize, Serialize};

use crate::openbao::{self, BaoToken, OpenBao, Upkeep};
use crate::state::StateDir;
use crate::AgentError;

/// The bootstrap grant a kit stages (0600), consumed by the first login.
pub const BOOTSTRAP_FILE: &str = "bootstrap.jwt";

const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// What `berth-agent --env E` runs with.
#[derive(Debug, Clone)]
pub struct DesiredConfig {
    pub env_id: String,
    pub state_dir: PathBuf,
    /// The server; required in bearer mode, an override in mTLS mode.
    pub server: Option<String>,
    /// Bearer mode's trust in the server: the CA PEM file, or its fingerprint.
    pub server_ca_file: Option<PathBuf>,
    pub server_ca_fingerprint: Option<String>,
    /// One tick, then exit with its code.
    pub once: bool,
    /// OpenBao: the address to log in at (else the lease's `addr`), its CA, and the JWT mount
    /// and role a bootstrap grant logs in with (a lease names its own).
    pub openbao_addr: Option<String>,
    pub openbao_ca_file: Option<PathBuf>,
    pub openbao_auth_mount: String,
    pub openbao_role: String,
    /// `["docker-compose"]` or `["docker", "compose"]`; detected when empty.
    pub compose_command: Vec<String>,
    pub health_timeout: Duration,
}

impl DesiredConfig {
    /// How long every service has after `up` to be running and healthy, unless configured.
    pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(120);
}

/// The environment's state on this host: `<state>/desired/<env>/state.json`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct LocalState {
    applied_sha: Option<String>,
    release_dir: Option<PathBuf>,
    compose_file: Option<String>,
    /// The last `down` completed; further `down` answers change nothing.
    down: bool,
    /// The shas applied here, oldest first (the last [`HISTORY`]): going back to one of them
    /// is a rollback, which a bundle must allow.
    #[serde(default)]
    history: Vec<String>,
}

/// How many applied shas the state remembers.
const HISTORY: usize = 50;

impl LocalState {
    fn release(&self) -> Option<Release> {
        Some(Release {
            dir: self.release_dir.clone()?,
            compose_file: self.compose_file.clone()?,
        })
    }
}

/// How this agent proves itself to the server.
enum Auth {
    Mtls,
    /// The OpenBao token (`bao.token`) is the bearer.
    Bearer(String),
}

/// A tick's own log: the lines that become the report's `log_tail` (after redaction).
#[derive(Default)]
struct TickLog(Vec<String>);

impl TickLog {
    fn info(&mut self, line: impl Into<String>) {
        let line = line.into();
        tracing::info!("{line}");
        self.0.push(format!("INFO {line}"));
    }
    fn error(&mut self, line: impl Into<String>) {
        let line = line.into();
        tracing::warn!("{line}");
        self.0.push(format!("ERROR {line}"));
    }
}

/// Runs the loop (or one tick with `once`) until shutdown or a final error.
pub async fn run_desired(
    config: DesiredConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), AgentError> {
    let mut agent = DesiredAgent::new(config)?;
    if agent.config.once {
        return agent.tick().await.map(|_| ());
    }
    tokio::pin!(shutdown);
    loop {
        let wait = match agent.tick().await {
            Ok(interval) => jitter(interval),
            Err(AgentError::Temporary(why)) => {
                tracing::warn!(why, "temporary failure; trying again later");
                agent.retry_after.take().unwrap_or(jitter(agent.interval))
            }
            Err(e) => return Err(e),
        };
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// ±10 % so a fleet does not check in in lockstep.
fn jitter(interval: Duration) -> Duration {
    let r = uuid::Uuid::new_v4().as_u128() % 2001; // 0..=2000
    let factor = 0.9 + (r as f64) / 10_000.0; // 0.9..=1.1
    interval.mul_f64(factor).max(Duration::from_secs(1))
}

struct DesiredAgent {
    config: DesiredConfig,
    state_dir: StateDir,
    dir: PathBuf,
    runner: StackRunner,
    interval: Duration,
    /// From the last 429's `Retry-After`.
    retry_after: Option<Duration>,
    /// The KV mount, adopted from checkin's `vault.mount`.
    kv_mount: Option<String>,
}

impl DesiredAgent {
    fn new(config: DesiredConfig) -> Result<DesiredAgent, AgentError> {
        if !berth_proto::deploy::valid_environment_name(&config.env_id) {
            return Err(AgentError::Config(format!(
                "--env {:?} is not an environment name",
                config.env_id
            )));
        }
        let state_dir = StateDir(config.state_dir.clone());
        state_dir.ensure()?;
        let dir = config.state_dir.join("desired").join(&config.env_id);
        create_private_dir(&dir)?;
        let runner = StackRunner::new()
            .with_compose_command(config.compose_command.clone())
            .with_health_timeout(config.health_timeout);
        Ok(DesiredAgent {
            state_dir,
            dir,
            runner,
            interval: Duration::from_secs(berth_proto::desired::DEFAULT_CHECKIN_INTERVAL_SECS),
            retry_after: None,
            kv_mount: None,
            config,
        })
    }

    fn project(&self) -> String {
        project_name(&self.config.env_id)
    }

    fn bao(&self, addr: &str) -> Result<OpenBao, AgentError> {
        let ca = match &self.config.openbao_ca_file {
            Some(p) => Some(std::fs::read(p).map_err(|e| {
                AgentError::Config(format!("--openbao-ca-file {}: {e}", p.display()))
            })?),
            None => None,
        };
        OpenBao::new(addr, ca.as_deref())
            .map_err(|e| AgentError::Config(format!("OpenBao at {addr}: {e}")))
    }

    /// The configured OpenBao address; bearer mode cannot work without one.
    fn bao_addr(&self) -> Result<String, AgentError> {
        self.config
            .openbao_addr
            .clone()
            .ok_or_else(|| AgentError::Config("bearer mode needs --openbao-addr".into()))
    }

    /// mTLS when this state dir holds a registered identity; else the OpenBao bearer token,
    /// logging in with the staged bootstrap grant first when there is no token yet.
    async fn auth(&self, log: &mut TickLog) -> Result<Auth, AgentError> {
        if self.state_dir.is_registered() {
            return Ok(Auth::Mtls);
        }
        if let Some(token) = openbao::load_token(&self.config.state_dir)
            .map_err(|e| AgentError::Fatal(format!("reading bao.token: {e}")))?
        {
            return Ok(Auth::Bearer(token));
        }
        self.bootstrap(log).await.map(|t| Auth::Bearer(t.token))
    }

    /// `bootstrap.jwt` → OpenBao login → `bao.token` (0600); the grant is deleted once used.
    async fn bootstrap(&self, log: &mut TickLog) -> Result<BaoToken, AgentError> {
        let grant_path = self.config.state_dir.join(BOOTSTRAP_FILE);
        let grant = match std::fs::read_to_string(&grant_path) {
            Ok(g) => g.trim().to_string(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(AgentError::Fatal(
                    "no credentials and no bootstrap.jwt: re-run the install kit".into(),
                ))
            }
            Err(e) => return Err(AgentError::Fatal(format!("reading bootstrap.jwt: {e}"))),
        };
        let bao = self.bao(&self.bao_addr()?)?;
        let token = bao
            .login_jwt(
                &self.config.openbao_auth_mount,
                &self.config.openbao_role,
                &grant,
            )
            .await
            .map_err(|e| bao_failure("bootstrap login", e))?;
        openbao::save_token(&self.config.state_dir, &token)
            .map_err(|e| AgentError::Fatal(format!("saving bao.token: {e}")))?;
        let _ = std::fs::remove_file(&grant_path);
        log.info("bootstrap: logged in to OpenBao with the kit's grant; the grant is deleted");
        Ok(token)
    }

    fn client(&self, auth: &Auth) -> Result<Client, AgentError> {
        match auth {
            Auth::Mtls => {
                let identity = self.state_dir.load()?;
                let server = self
                    .config
                    .server
                    .clone()
                    .unwrap_or_else(|| identity.file.server.clone());
                Ok(crate::link::Link::new(&server, &identity)?.client)
            }
            Auth::Bearer(token) => {
                let server =
                    self.config.server.clone().ok_or_else(|| {
                        AgentError::Config("bearer mode needs --server".to_string())
                    })?;
                let trust = match (
                    &self.config.server_ca_file,
                    &self.config.server_ca_fingerprint,
                ) {
                    (Some(file), _) => {
                        Trust::CaPem(std::fs::read_to_string(file).map_err(|e| {
                            AgentError::Config(format!("--ca-file {}: {e}", file.display()))
                        })?)
                    }
                    (None, Some(fp)) => Trust::CaFingerprint(fp.clone()),
                    (None, None) => {
                        return Err(AgentError::Config(
                            "bearer mode needs --ca-file or --ca-fingerprint".into(),
                        ))
                    }
                };
                Client::new(berth_client::ClientConfig {
                    server,
                    trust,
                    identity: None,
                    bearer: Some(token.clone()),
                    timeout: REQUEST_TIMEOUT,
                })
                .map_err(|e| AgentError::Config(e.to_string()))
            }
        }
    }

    /// One tick. `Ok` carries the interval until the next one.
    async fn tick(&mut self) -> Result<Duration, AgentError> {
        let mut log = TickLog::default();
        let mut auth = self.auth(&mut log).await?;
        let mut state = self.load_state()?;
        let checkin = self.checkin_body(&state).await;
        let mut client = self.client(&auth)?;
        let answer = match client.send(&checkin).await {
            Err(e) if is_unauthenticated(&e) => {
                // A removed agent or a superseded grant: the credentials are dead.
                if let Auth::Bearer(_) = auth {
                    let _ = openbao::delete_token(&self.config.state_dir);
                    tracing::warn!("the server refused the OpenBao token; it is deleted");
                    auth = Auth::Bearer(self.bootstrap(&mut log).await?.token);
                    client = self.client(&auth)?;
                    client.send(&checkin).await.map_err(|e| self.failure(e))?
                } else {
                    return Err(AgentError::Fatal(format!(
                        "{e}: this agent was removed; re-run the install"
                    )));
                }
            }
            other => other.map_err(|e| self.failure(e))?,
        };
        self.interval = Duration::from_secs(answer.checkin_interval_s.max(1));
        if let Some(vault) = &answer.vault {
            if self.kv_mount.as_deref() != Some(vault.mount.as_str()) {
                log.info(format!(
                    "adopting the KV mount {:?} from checkin",
                    vault.mount
                ));
                self.kv_mount = Some(vault.mount.clone());
            }
        }
        log.info(format!(
            "checkin: action={} desired={}",
            action_name(answer.action),
            answer.desired_sha.as_deref().map(short).unwrap_or("-")
        ));
        match answer.action {
            CheckinAction::None => {
                if let Auth::Bearer(token) = &auth {
                    self.upkeep(&client, token, &mut log).await?;
                }
            }
            CheckinAction::Apply => {
                self.apply(&client, &mut auth, &answer, &mut state, &mut log)
                    .await?
            }
            CheckinAction::Down => {
                self.down(&client, &answer, &mut state, &mut log).await?;
            }
        }
        Ok(self.interval)
    }

    fn failure(&mut self, e: ClientError) -> AgentError {
        classify(e, &mut self.retry_after)
    }

    async fn checkin_body(&self, state: &LocalState) -> Checkin {
        let containers = self
            .runner
            .containers(&self.project())
            .await
            .unwrap_or_default();
        Checkin {
            env_id: self.config.env_id.clone(),
            agent_version: Some(crate::VERSION.to_string()),
            applied_sha: state.applied_sha.clone(),
            host: host_facts(&self.config.state_dir, self.state_dir.is_registered()),
            containers,
        }
    }

    /// The seed's token upkeep: renew under 12 h of TTL; past 28 days, a new lease and login
    /// whose token replaces this one (which is then revoked).
    async fn upkeep(
        &mut self,
        client: &Client,
        token: &str,
        log: &mut TickLog,
    ) -> Result<(), AgentError> {
        let bao = self.bao(&self.bao_addr()?)?;
        let now = time::OffsetDateTime::now_utc().unix_timestamp().max(0) as u64;
        match openbao::upkeep(&bao, token, now).await {
            Ok(Upkeep::Fine) => Ok(()),
            Ok(Upkeep::Renewed(info)) => {
                log.info(format!("upkeep: token renewed, ttl {}s", info.ttl_s));
                Ok(())
            }
            Ok(Upkeep::Release) => {
                let lease = self.lease(client, "renew").await?;
                let lease = lease
                    .map_err(|(code, detail)| AgentError::Temporary(format!("{code}: {detail}")))?;
                self.replace_token(&bao, &lease, token, log)
                    .await
                    .map(|_| ())
            }
            Err(e) => Err(bao_failure("token upkeep", e)),
        }
    }

    /// Logs in with a lease; in bearer mode the new token becomes the bearer and the one it
    /// replaces is revoked.
    async fn replace_token(
        &self,
        bao: &OpenBao,
        lease: &LeaseResponse,
        old: &str,
        log: &mut TickLog,
    ) -> Result<BaoToken, AgentError> {
        let token = bao
            .login_jwt(&lease.mount, &lease.role, &lease.login_jwt)
            .await
            .map_err(|e| bao_failure("lease login", e))?;
        openbao::save_token(&self.config.state_dir, &token)
            .map_err(|e| AgentError::Fatal(format!("saving bao.token: {e}")))?;
        if let Err(e) = bao.revoke_self(old).await {
            log.error(format!("revoking the replaced token failed: {e}"));
        }
        log.info("lease: logged in with a fresh grant; the previous token is revoked");
        Ok(token)
    }

    /// `POST /lease`. The inner `Err` is a refusal of the answer's shape (`LEASE_SHAPE`),
    /// reported as `failed`; the outer one ends the tick.
    async fn lease(
        &mut self,
        client: &Client,
        reason: &str,
    ) -> Result<Result<LeaseResponse, (&'static str, String)>, AgentError> {
        let body = LeaseRequest {
            env_id: self.config.env_id.clone(),
            reason: Some(reason.to_string()),
        };
        let answer = client
            .post_value(paths::LEASE, &body)
            .await
            .map_err(|e| self.failure(e))?;
        Ok(openbao::parse_lease(&answer))
    }

    async fn apply(
        &mut self,
        client: &Client,
        auth: &mut Auth,
        answer: &CheckinResponse,
        state: &mut LocalState,
        log: &mut TickLog,
    ) -> Result<(), AgentError> {
        let (Some(sha), Some(url)) = (answer.desired_sha.clone(), answer.bundle_url.clone()) else {
            return Err(AgentError::Fatal(
                "checkin said apply without a sha and a bundle_url".into(),
            ));
        };
        let (_, tar) = client
            .get_bytes(&url, &[])
            .await
            .map_err(|e| self.failure(e))?;
        let mut secrets = BTreeMap::new();
        let result = self
            .prepare_and_apply(client, auth, &sha, &tar, state, &mut secrets, log)
            .await?;
        // In bearer mode the lease's login replaced the token (and revoked the old one): the
        // report goes out with the new one.
        let client = match auth {
            Auth::Bearer(_) => &self.client(auth)?,
            Auth::Mtls => client,
        };
        let report = match result {
            Ok(()) => Report {
                env_id: self.config.env_id.clone(),
                sha: Some(sha.clone()),
                result: ReportResult::Applied,
                log_tail: String::new(),
                containers: Vec::new(),
                detail: None,
            },
            Err(detail) => {
                log.error(format!("apply of {} failed: {detail}", short(&sha)));
                Report {
                    env_id: self.config.env_id.clone(),
                    sha: Some(sha.clone()),
                    result: ReportResult::Failed,
                    log_tail: String::new(),
                    containers: Vec::new(),
                    detail: Some(detail),
                }
            }
        };
        self.report(client, report, &secrets, log).await
    }

    /// Everything between the bundle and the report. The inner `Err` is the report's `detail`
    /// (`CODE: …`); the outer one ends the tick (transport, configuration).
    #[allow(clippy::too_many_arguments)]
    async fn prepare_and_apply(
        &mut self,
        client: &Client,
        auth: &mut Auth,
        sha: &str,
        tar: &[u8],
        state: &mut LocalState,
        secrets: &mut BTreeMap<String, String>,
        log: &mut TickLog,
    ) -> Result<Result<(), String>, AgentError> {
        let refused = |e: berth_bundle::BundleError| Ok(Err(format!("{}: {}", e.code, e.detail)));
        let bundle = match berth_bundle::open(tar, sha, &berth_bundle::Limits::default()) {
            Ok(b) => b,
            Err(e) => return refused(e),
        };
        log.info(format!(
            "bundle {} verified: {} file(s)",
            short(sha),
            bundle.files.len()
        ));
        let rollback =
            state.applied_sha.as_deref() != Some(sha) && state.history.iter().any(|h| h == sha);
        if rollback && !bundle.meta.allow_rollback {
            return Ok(Err(format!(
                "{}: {} was applied here before and its bundle.json does not allow_rollback",
                codes::ROLLBACK_FORBIDDEN,
                short(sha)
            )));
        }
        let free = crate::resources::disk_space(&self.config.state_dir)
            .map(|(free, _)| free)
            .unwrap_or(0);
        if let Err(e) = bundle.check_disk(free) {
            return refused(e);
        }
        match self.resolve(client, auth, &bundle.manifest, log).await? {
            Ok(values) => *secrets = values,
            Err(detail) => return Ok(Err(detail)),
        }
        let env = match bundle.render_env(secrets) {
            Ok(env) => env,
            Err(e) => return refused(e),
        };
        // A fresh directory per release; the previous one stays until this one is healthy.
        let release_dir = self.dir.join("releases").join(sha);
        let _ = std::fs::remove_dir_all(&release_dir);
        create_private_dir(&release_dir)?;
        if let Err(e) = bundle.write_to(&release_dir) {
            return refused(e);
        }
        berth_fs::write_atomic(&release_dir.join(ENV_FILE), env.as_bytes(), 0o600)
            .map_err(|e| AgentError::Fatal(format!("writing .env: {e}")))?;
        let release = Release {
            dir: release_dir.clone(),
            compose_file: bundle.compose_file.clone(),
        };
        let previous = state.release().filter(|p| p.dir != release.dir);
        let outcome = self
            .runner
            .up(&self.project(), &release, previous.as_ref(), secrets)
            .await;
        for line in outcome.log.lines() {
            log.0.push(line.to_string());
        }
        if let Err(e) = outcome.result {
            let _ = std::fs::remove_dir_all(&release_dir);
            let kept = if outcome.rolled_back {
                "; the previous release runs again"
            } else {
                ""
            };
            return Ok(Err(format!("{}: {}{kept}", codes::APPLY_FAILED, e.chain())));
        }
        let mut history = std::mem::take(&mut state.history);
        history.retain(|h| h != sha);
        history.push(sha.to_string());
        let excess = history.len().saturating_sub(HISTORY);
        history.drain(..excess);
        *state = LocalState {
            applied_sha: Some(sha.to_string()),
            release_dir: Some(release_dir),
            compose_file: Some(bundle.compose_file.clone()),
            down: false,
            history,
        };
        self.save_state(state)?;
        self.prune_releases(&release.dir);
        log.info(format!("applied {} ({})", short(sha), self.project()));
        Ok(Ok(()))
    }

    /// The manifest's values, by variable. `Err` is `ENV_INCOMPLETE: unresolved: A, B`, or a
    /// lease refusal (`LEASE_SHAPE: …`).
    async fn resolve(
        &mut self,
        client: &Client,
        auth: &mut Auth,
        manifest: &berth_bundle::SecretsManifest,
        log: &mut TickLog,
    ) -> Result<Result<BTreeMap<String, String>, String>, AgentError> {
        let mut values = BTreeMap::new();
        if manifest.entries.is_empty() {
            return Ok(Ok(values));
        }
        let lease = match self.lease(client, "apply").await? {
            Ok(l) => l,
            Err((code, detail)) => return Ok(Err(format!("{code}: {detail}"))),
        };
        let mut unresolved = Vec::new();
        if manifest.vault_mode == "openbao" {
            let addr = self
                .config
                .openbao_addr
                .clone()
                .unwrap_or_else(|| lease.addr.clone());
            let bao = self.bao(&addr)?;
            let token = match auth {
                Auth::Bearer(old) => {
                    let new = self.replace_token(&bao, &lease, old, log).await?;
                    *auth = Auth::Bearer(new.token.clone());
                    new
                }
                Auth::Mtls => bao
                    .login_jwt(&lease.mount, &lease.role, &lease.login_jwt)
                    .await
                    .map_err(|e| bao_failure("lease login", e))?,
            };
            let kv_mount = self.kv_mount.clone();
            for entry in &manifest.entries {
                let Some(path) = self.own_path(&entry.path) else {
                    unresolved.push(entry.var.clone());
                    continue;
                };
                let mount = kv_mount.clone().unwrap_or_else(|| path.mount.clone());
                match bao
                    .kv_read(&token.token, &mount, &path, entry.version)
                    .await
                {
                    Ok(Some(v)) => {
                        values.insert(entry.var.clone(), v);
                    }
                    Ok(None) => unresolved.push(entry.var.clone()),
                    Err(openbao::BaoError::Unreachable(e)) => {
                        return Err(AgentError::Temporary(format!("OpenBao: {e}")))
                    }
                    Err(e) => {
                        log.error(format!("reading {}: {e}", entry.var));
                        unresolved.push(entry.var.clone());
                    }
                }
            }
            if let Auth::Mtls = auth {
                // Used for this apply only.
                let _ = bao.revoke_self(&token.token).await;
            }
        } else {
            for entry in &manifest.entries {
                let Some(path) = self.own_path(&entry.path) else {
                    unresolved.push(entry.var.clone());
                    continue;
                };
                let mut url = format!("{}/{}", paths::BUILTIN_KV_PREFIX, path.kv_data_path());
                if let Some(v) = entry.version {
                    url.push_str(&format!("?version={v}"));
                }
                match client
                    .get_value(&url, &[(LEASE_HEADER, lease.login_jwt.as_str())])
                    .await
                {
                    Ok(doc) => match doc.pointer("/data/data/value").and_then(|v| v.as_str()) {
                        Some(v) => {
                            values.insert(entry.var.clone(), v.to_string());
                        }
                        None => unresolved.push(entry.var.clone()),
                    },
                    Err(e) if e.status() == Some(404) => unresolved.push(entry.var.clone()),
                    Err(e) => return Err(self.failure(e)),
                }
            }
        }
        if unresolved.is_empty() {
            log.info(format!("resolved {} secret(s)", values.len()));
            Ok(Ok(values))
        } else {
            unresolved.sort();
            Ok(Err(format!(
                "{}: unresolved: {}",
                codes::ENV_INCOMPLETE,
                unresolved.join(", ")
            )))
        }
    }

    /// A manifest path this environment may read: both seed forms, its env segment ours.
    fn own_path(&self, path: &str) -> Option<SecretPath> {
        SecretPath::parse(path).filter(|p| p.env == self.config.env_id)
    }

    async fn down(
        &mut self,
        client: &Client,
        answer: &CheckinResponse,
        state: &mut LocalState,
        log: &mut TickLog,
    ) -> Result<(), AgentError> {
        if state.down {
            return Ok(());
        }
        let secrets = BTreeMap::new();
        let mut report = Report {
            env_id: self.config.env_id.clone(),
            sha: state.applied_sha.clone(),
            result: ReportResult::Down,
            log_tail: String::new(),
            containers: Vec::new(),
            detail: None,
        };
        if let Some(release) = state.release() {
            let outcome = self
                .runner
                .down(&self.project(), &release, answer.purge_volumes, &secrets)
                .await;
            log.0.extend(outcome.log.lines().map(str::to_string));
            if let Err(e) = outcome.result {
                report.result = ReportResult::Failed;
                report.detail = Some(format!("{}: down: {}", codes::APPLY_FAILED, e.chain()));
                return self.report(client, report, &secrets, log).await;
            }
        }
        let _ = std::fs::remove_dir_all(self.dir.join("releases"));
        *state = LocalState {
            down: true,
            history: std::mem::take(&mut state.history),
            ..LocalState::default()
        };
        self.save_state(state)?;
        log.info(format!(
            "down: {} removed{}",
            self.project(),
            if answer.purge_volumes {
                " with its volumes"
            } else {
                ""
            }
        ));
        self.report(client, report, &secrets, log).await
    }

    async fn report(
        &mut self,
        client: &Client,
        mut report: Report,
        secrets: &BTreeMap<String, String>,
        log: &TickLog,
    ) -> Result<(), AgentError> {
        report.containers = self
            .runner
            .containers(&self.project())
            .await
            .unwrap_or_default();
        report.log_tail = tail(
            &berth_proto::redact::redact(&log.0.join("\n"), secrets.values()),
            MAX_LOG_TAIL_BYTES,
        );
        report.detail = report
            .detail
            .map(|d| berth_proto::redact::redact(&d, secrets.values()));
        client.send(&report).await.map_err(|e| self.failure(e))?;
        Ok(())
    }

    fn state_path(&self) -> PathBuf {
        self.dir.join("state.json")
    }

    fn load_state(&self) -> Result<LocalState, AgentError> {
        match std::fs::read(self.state_path()) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map_err(|e| AgentError::Fatal(format!("desired state.json is unreadable: {e}"))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(LocalState::default()),
            Err(e) => Err(AgentError::Fatal(format!("reading state.json: {e}"))),
        }
    }

    fn save_state(&self, state: &LocalState) -> Result<(), AgentError> {
        let bytes = serde_json::to_vec_pretty(state)
            .map_err(|e| AgentError::Fatal(format!("encoding state.json: {e}")))?;
        berth_fs::write_atomic(&self.state_path(), &bytes, 0o600)
            .map_err(|e| AgentError::Fatal(format!("writing state.json: {e}")))
    }

    /// Keeps only the release now applied.
    fn prune_releases(&self, keep: &Path) {
        let Ok(entries) = std::fs::read_dir(self.dir.join("releases")) else {
            return;
        };
        for entry in entries.flatten() {
            if entry.path() != keep {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

fn create_private_dir(dir: &Path) -> Result<(), AgentError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)))
        .map_err(|e| AgentError::Fatal(format!("{}: {e}", dir.display())))
}

/// The compose project of an environment: `berth-<env>`, in compose's alphabet.
pub fn project_name(env_id: &str) -> String {
    let cleaned: String = env_id
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '-' | '_') => c,
            _ => '-',
        })
        .collect();
    format!("berth-{cleaned}")
}

fn is_unauthenticated(e: &ClientError) -> bool {
    e.status() == Some(401) && e.code() == Some(codes::AGENT_UNAUTHENTICATED)
}

/// A refused or failed call → the tick's end: 403 `AGENT_ENV_MISMATCH` is configuration (78,
/// never retried); 429, 5xx and transport failures are temporary (75; the loop waits);
/// anything else is fatal.
fn classify(e: ClientError, retry_after: &mut Option<Duration>) -> AgentError {
    match &e {
        ClientError::Api {
            status,
            body,
            retry_after: after,
        } => match (*status, body.code.as_str()) {
            (403, codes::AGENT_ENV_MISMATCH) => AgentError::Config(e.to_string()),
            (401, codes::AGENT_UNAUTHENTICATED) => {
                AgentError::Fatal(format!("{e}: re-run the install"))
            }
            (429, _) => {
                *retry_after = *after;
                AgentError::Temporary(e.to_string())
            }
            (s, _) if s >= 500 => AgentError::Temporary(e.to_string()),
            _ => AgentError::Fatal(e.to_string()),
        },
        ClientError::Transport { .. } | ClientError::Connect { .. } => {
            AgentError::Temporary(e.to_string())
        }
        ClientError::Decode(_) => AgentError::Temporary(e.to_string()),
        ClientError::Config(_) => AgentError::Config(e.to_string()),
    }
}

fn bao_failure(what: &str, e: openbao::BaoError) -> AgentError {
    match e {
        openbao::BaoError::Unreachable(_) => AgentError::Temporary(format!("{what}: {e}")),
        _ => AgentError::Fatal(format!("{what}: {e}")),
    }
}

fn action_name(action: CheckinAction) -> &'static str {
    match action {
        CheckinAction::Apply => "apply",
        CheckinAction::None => "none",
        CheckinAction::Down => "down",
    }
}

fn short(sha: &str) -> &str {
    &sha[..sha.len().min(12)]
}

/// The last `max` bytes, cut at a char boundary.
fn tail(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut start = text.len() - max;
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_string()
}

fn host_facts(state_dir: &Path, mtls: bool) -> HostFacts {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let os = read("/etc/os-release").and_then(|text| {
        text.lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME="))
            .map(|v| v.trim_matches('"').to_string())
    });
    HostFacts {
        hostname: read("/proc/sys/kernel/hostname"),
        os,
        kernel: read("/proc/sys/kernel/osrelease"),
        docker: None,
        compose: None,
        free_bytes: crate::resources::disk_space(state_dir).map(|(free, _)| free),
        agent_version: Some(crate::VERSION.to_string()),
        transport: Some(if mtls { "mtls" } else { "bearer" }.to_string()),
        site: None,
        laptop_mode: Some(false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn project_names_are_composes_alphabet() {
        assert_eq!(project_name("env-qa-02"), "berth-env-qa-02");
        assert_eq!(project_name("Prod.EU"), "berth-prod-eu");
    }

    #[test]
    fn tail_cuts_at_a_char_boundary() {
        let text = "é".repeat(10);
        let t = tail(&text, 5);
        assert!(t.len() <= 5 && text.ends_with(&t));
    }

    #[test]
    fn jitter_stays_within_ten_percent() {
        for _ in 0..100 {
            let j = jitter(Duration::from_secs(60));
            assert!(
                j >= Duration::from_secs(54) && j <= Duration::from_secs(66),
                "{j:?}"
            );
        }
    }

    #[test]
    fn refusals_map_to_the_seeds_exit_codes() {
        let api = |status, code: &str| ClientError::Api {
            status,
            body: berth_proto::ErrorBody {
                code: code.into(),
                detail: String::new(),
            },
            retry_after: Some(Duration::from_secs(7)),
        };
        let mut after = None;
        assert_eq!(
            classify(api(403, codes::AGENT_ENV_MISMATCH), &mut after).exit_code(),
            78
        );
        assert_eq!(
            classify(api(401, codes::AGENT_UNAUTHENTICATED), &mut after).exit_code(),
            1
        );
        assert_eq!(
            classify(api(429, codes::RATE_LIMITED), &mut after).exit_code(),
            75
        );
        assert_eq!(after, Some(Duration::from_secs(7)));
        assert_eq!(classify(api(503, "X"), &mut after).exit_code(), 75);
    }
}
