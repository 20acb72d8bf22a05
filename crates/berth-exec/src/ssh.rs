//! `ssh.deploy` (seed 000, module agent-ssh, `SSHRemoteExecutor.deploy`): the agent deploys to a
//! host that runs no agent, over ONE SSH connection (russh, pure Rust) opened for the task and
//! closed at its end.
//!
//! Order: resolve every artifact (those given by reference fetched through the executor's
//! [`ArtifactSource`] and checked against their SHA-256; any failure here leaves the target
//! untouched) → connect, and check the host key against the payload's pin during the key exchange,
//! before authenticating (a mismatch is `HOST_KEY_MISMATCH` and nothing of ours is sent) →
//! authenticate with the `sshPrivateKey` credential → confirm the lease → create the deploy
//! directory and copy its contents into `.berth-backup` → upload the artifacts over SFTP →
//! pre-deploy hook → deploy script under its timeout → post-deploy hook → health check (an HTTP
//! or TCP probe from the agent, or a command on the target) → write `.berth-sticker.json` over
//! SFTP → remove the backup. A failure after the backup was taken puts the backup back (output
//! `rolledBack`) and keeps its own code: `DEPLOY_SCRIPT_FAILED`, `HEALTH_CHECK_FAILED`, ….
//!
//! SSH runs every remote command through the target user's login shell, so no remote command
//! line is ever built from task data by formatting: the fixed scripts below take the deploy
//! directory and the payload's argument vectors as positional parameters, and every argument is
//! single-quoted by [`sh_quote`], the one quoting function. File contents and names travel over
//! SFTP. The login shell must be a POSIX shell (sh, dash, bash, zsh).
//!
//! The other kinds that reach an SSH target (`read-sticker`, `inspect` and `health-check` with an
//! `sshTarget`, `upload-files` with one) run through the functions below from their own
//! executors, over the same connect / host-key / authentication path. [`scan_host_key`] reads a
//! host's key for a person to confirm (`berth ssh-target scan`).

use std::borrow::Cow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_proto::kind::TaskKind;
use berth_proto::payload::{
    CheckPayload, HealthCheckPayload, HookConfig, SshDeployPayload, SshHealthCheck,
    SshHealthCheckKind, SshTarget, SSH_PRIVATE_KEY_CREDENTIAL,
};
use berth_proto::result::error_types;
use russh::keys::{
    Algorithm, HashAlg, PrivateKey, PrivateKeyWithHashAlg, PublicKey, PublicKeyOrCertificate,
};
use russh::{client, ChannelMsg, Disconnect, Sig};
use russh_sftp::client::SftpSession;
use russh_sftp::protocol::{FileAttributes, OpenFlags, StatusCode};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use crate::artifact::{self, ArtifactSource, Resolved};
use crate::error::ExecError;
use crate::probe;
use crate::run::{millis_since, Run, Stop};
use crate::sticker::Sticker;
use crate::{parse_payload, Executor, Outcome, Task};
/// The copy of the deploy directory's contents, inside it, while a deployment runs.
pub const BACKUP_DIR: &str = ".berth-backup";
/// The sticker, inside the deploy directory.
pub const STICKER_FILE: &str = ".berth-sticker.json";
/// A sticker larger than this is not one `ssh.deploy` wrote.
const MAX_STICKER_BYTES: u64 = 1024 * 1024;

const DEFAULT_CONNECT_TIMEOUT_SECS: u64 = 15;
/// Scripts and hooks that name no timeout.
const DEFAULT_COMMAND_TIMEOUT_SECS: u64 = 300;
/// berth's own remote steps (backup, restore, rename): copying a large directory takes time.
const STEP_TIMEOUT: Duration = Duration::from_secs(300);
/// Restoring the backup after a failure: not cancellable, only bounded.
const RESTORE_BUDGET: Duration = Duration::from_secs(300);
/// How much of a command's output the log keeps (its tail).
const MAX_OUTPUT: usize = 64 * 1024;

/// `cd` into `$1` and run the rest of the arguments there, as an argument vector.
const RUN_IN_DIR: &str = r#"cd -- "$1" && shift && exec "$@""#;
/// Creates `$1` and copies its contents (every entry but the backup itself) into the backup.
const PREPARE: &str = r#"set -e
mkdir -p -- "$1"
cd -- "$1"
rm -rf -- .berth-backup
mkdir -- .berth-backup
for f in .[!.]* ..?* *; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  [ "$f" = .berth-backup ] && continue
  cp -pPR -- "$f" .berth-backup/
done"#;
/// Makes `$1` hold exactly what its backup holds, then removes the backup.
const RESTORE: &str = r#"set -e
cd -- "$1"
[ -d .berth-backup ]
for f in .[!.]* ..?* *; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  [ "$f" = .berth-backup ] && continue
  rm -rf -- "$f"
done
for f in .berth-backup/.[!.]* .berth-backup/..?* .berth-backup/*; do
  [ -e "$f" ] || [ -L "$f" ] || continue
  mv -- "$f" .
done
rmdir -- .berth-backup"#;
/// Renames `$1` to `$2`, replacing a file or symlink there; never into a directory of that name
/// (which `mv` would do).
const REPLACE: &str = r#"set -e
if [ -d "$2" ]; then echo "$2 is a directory" >&2; exit 1; fi
exec mv -f -- "$1" "$2""#;

/// `arg` as one single-quoted POSIX shell word: `'…'`, with each `'` written as `'\''`. Inside
/// single quotes a POSIX shell gives no character a meaning (`$`, backticks, `\`, `;`, newlines
/// stay as they are), so the shell reads back exactly `arg`. The one way task data enters a
/// remote command line; `arg` must not contain NUL (payload checks refuse it: no shell word can).
pub fn sh_quote(arg: &str) -> String {
    let mut out = String::with_capacity(arg.len() + 2);
    out.push('\'');
    for c in arg.chars() {
        if c == '\'' {
            out.push_str(r"'\''");
        } else {
            out.push(c);
        }
    }
    out.push('\'');
    out
}

/// An argument vector as a remote command line: every argument through [`sh_quote`].
pub fn command_line<S: AsRef<str>>(argv: &[S]) -> String {
    argv.iter()
        .map(|a| sh_quote(a.as_ref()))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `sh -c SCRIPT berth ARGS…`: a fixed script with the task's data as its positional parameters.
fn script_line<S: AsRef<str>>(script: &str, args: &[S]) -> String {
    let mut argv = vec!["sh", "-c", script, "berth"];
    argv.extend(args.iter().map(|a| a.as_ref()));
    command_line(&argv)
}

/// Runs `ssh.deploy`. Reported as the agent's `ssh` capability: it needs nothing on the host.
/// Without an artifact source, artifacts given by reference fail (`ARTIFACT_UNAVAILABLE`).
#[derive(Default, Clone)]
pub struct SshExecutor {
    artifacts: Option<Arc<dyn ArtifactSource>>,
}

impl SshExecutor {
    /// Fetches artifacts given by reference from `source`.
    pub fn with_artifacts(source: Arc<dyn ArtifactSource>) -> SshExecutor {
        SshExecutor {
            artifacts: Some(source),
        }
    }
}

#[async_trait::async_trait]
impl Executor for SshExecutor {
    fn task_types(&self) -> &'static [TaskKind] {
        &[TaskKind::SshDeploy]
    }

    async fn execute(&self, task: &Task) -> Outcome {
        if TaskKind::parse(&task.task_type) != Some(TaskKind::SshDeploy) {
            return Outcome::failed(
                error_types::UNSUPPORTED_TASK_TYPE,
                format!("the ssh executor does not run {}", task.task_type),
                false,
            );
        }
        let payload: SshDeployPayload = match parse_payload(task) {
            Ok(p) => p,
            Err(o) => return *o,
        };
        let mut run = Run::new(task);
        let result = match payload.check() {
            Ok(()) => deploy(&mut run, &payload, self.artifacts.as_ref()).await,
            Err(e) => Err(ExecError::InvalidPayload(e)),
        };
        run.finish(result)
    }
}

/// How a task reaches its target: the client key and the pinned host key.
struct Access {
    key: PrivateKey,
    pinned: PublicKey,
}

/// The `sshPrivateKey` credential (OpenSSH, PKCS#8 or PKCS#1 PEM, unencrypted; Ed25519, ECDSA or
/// RSA) and the target's pin.
fn access(task: &Task, target: &SshTarget) -> Result<Access, ExecError> {
    let key = task
        .credentials
        .get(SSH_PRIVATE_KEY_CREDENTIAL)
        .ok_or_else(|| {
            ExecError::InvalidPayload(format!(
                "the task carries no {SSH_PRIVATE_KEY_CREDENTIAL} credential"
            ))
        })?;
    // The decoder's message names no key material, and the outcome is redacted anyway.
    let key = russh::keys::decode_secret_key(key, None).map_err(|e| {
        ExecError::InvalidPayload(format!(
            "the {SSH_PRIVATE_KEY_CREDENTIAL} credential is not an unencrypted private key \
             (OpenSSH, PKCS#8 or PKCS#1 PEM): {e}"
        ))
    })?;
    Ok(Access {
        key,
        pinned: parse_host_key(&target.host_key)?,
    })
}

/// Everything checked before a connection is opened.
struct Plan {
    access: Access,
    dir: String,
    http: Option<probe::HttpTarget>,
}

fn plan(run: &Run<'_>, p: &SshDeployPayload) -> Result<Plan, ExecError> {
    let access = access(run.task, &p.target)?;
    let http = match &p.health_check {
        Some(h) if h.kind == SshHealthCheckKind::Http => Some(
            probe::parse_http_url(h.url.as_deref().unwrap_or_default())
                .map_err(ExecError::InvalidPayload)?,
        ),
        _ => None,
    };
    Ok(Plan {
        access,
        dir: p.deploy_directory.trim_end_matches('/').to_string(),
        http,
    })
}

/// The pin: an OpenSSH public key line, `ssh-ed25519 AAAA… [comment]`.
fn parse_host_key(line: &str) -> Result<PublicKey, ExecError> {
    let mut parts = line.split_ascii_whitespace();
    let (algorithm, base64) = (parts.next(), parts.next());
    let key = base64
        .and_then(|b| russh::keys::parse_public_key_base64(b).ok())
        .ok_or_else(|| {
            ExecError::InvalidPayload(format!(
                "target.hostKey is not an OpenSSH public key line: {line:?}"
            ))
        })?;
    if algorithm != Some(key.algorithm().as_str()) {
        return Err(ExecError::InvalidPayload(format!(
            "target.hostKey says {algorithm:?} but holds a {} key",
            key.algorithm().as_str()
        )));
    }
    Ok(key)
}

fn fingerprint(key: &PublicKey) -> String {
    format!(
        "{} {}",
        key.algorithm().as_str(),
        key.fingerprint(HashAlg::Sha256)
    )
}

async fn deploy(
    run: &mut Run<'_>,
    p: &SshDeployPayload,
    source: Option<&Arc<dyn ArtifactSource>>,
) -> Result<String, ExecError> {
    let plan = plan(run, p)?;
    let t = &p.target;
    run.output("host", t.host.clone());
    run.output("deployDirectory", plan.dir.clone());
    let stop = run.stop.clone();
    // Every artifact is in hand, its digest checked, before the target is touched.
    let files = artifact::resolve(&p.artifacts, source, &stop).await?;
    let remote = stop
        .guard(Remote::connect(t, &plan.access, &mut run.log))
        .await?;
    let result = steps(run, &remote, p, &plan, &files).await;
    remote.close(&mut run.log).await;
    result
}

/// The deployment over an open connection; the backup is put back on any failure after it
/// was taken.
async fn steps(
    run: &mut Run<'_>,
    remote: &Remote,
    p: &SshDeployPayload,
    plan: &Plan,
    files: &[Resolved],
) -> Result<String, ExecError> {
    let dir = plan.dir.as_str();
    run.confirm_lease("changing the deploy directory").await?;
    let stop = run.stop.clone();
    let prepared = remote
        .exec(&script_line(PREPARE, &[dir]), STEP_TIMEOUT, &stop)
        .await?;
    if !prepared.success() {
        return Err(ExecError::Ssh(format!(
            "cannot create or back up {dir:?}: {}",
            prepared.summary()
        )));
    }
    run.log
        .line(format!("{dir}: contents backed up to {BACKUP_DIR}"));

    if let Err(failed) = apply(run, remote, p, plan, files).await {
        let restore = Stop::cleanup(RESTORE_BUDGET);
        let restored = remote
            .exec(&script_line(RESTORE, &[dir]), STEP_TIMEOUT, &restore)
            .await;
        let rolled_back = match restored {
            Ok(r) if r.success() => {
                run.log.line(format!("{dir}: restored from {BACKUP_DIR}"));
                true
            }
            Ok(r) => {
                run.log.line(format!(
                    "error: restoring {dir} from {BACKUP_DIR} failed: {}",
                    r.summary()
                ));
                false
            }
            Err(e) => {
                run.log.line(format!(
                    "error: restoring {dir} from {BACKUP_DIR} failed: {}",
                    e.chain()
                ));
                false
            }
        };
        run.output("rolledBack", rolled_back);
        return Err(failed);
    }

    let removed = remote
        .exec(
            &command_line(&["rm", "-rf", "--", &format!("{dir}/{BACKUP_DIR}")]),
            STEP_TIMEOUT,
            &Stop::cleanup(STEP_TIMEOUT),
        )
        .await;
    match removed {
        Ok(r) if r.success() => run.log.line(format!("{dir}: backup removed")),
        Ok(r) => run.log.line(format!(
            "warning: could not remove {dir}/{BACKUP_DIR}: {}",
            r.summary()
        )),
        Err(e) => run.log.line(format!(
            "warning: could not remove {dir}/{BACKUP_DIR}: {}",
            e.chain()
        )),
    }
    Ok(format!(
        "deployed {} artifact(s) to {}@{}:{dir}",
        p.artifacts.len(),
        p.target.user,
        p.target.host
    ))
}

async fn apply(
    run: &mut Run<'_>,
    remote: &Remote,
    p: &SshDeployPayload,
    plan: &Plan,
    files: &[Resolved],
) -> Result<(), ExecError> {
    let dir = plan.dir.as_str();
    let stop = run.stop.clone();

    // 1. Artifacts, over SFTP.
    let started = Instant::now();
    let mut bytes = 0usize;
    for a in files {
        let path = format!("{dir}/{}", a.name);
        stop.guard(remote.upload(&path, &a.bytes, a.mode)).await?;
        bytes += a.bytes.len();
        run.log.line(format!(
            "uploaded {:?} ({} bytes, sha256 {}, mode {:o})",
            a.name,
            a.bytes.len(),
            a.sha256,
            a.mode
        ));
    }
    run.metrics.upload_duration_ms = Some(millis_since(started));
    run.output("uploadedBytes", bytes);

    // 2. Hooks and the script, on the target, in the deploy directory.
    let started = Instant::now();
    if let Some(hook) = &p.hooks.pre_deploy {
        remote_command(run, remote, dir, hook, Step::Hook("pre-deploy")).await?;
    }
    if let Some(script) = &p.script {
        run.confirm_lease("running the deploy script").await?;
        remote_command(run, remote, dir, script, Step::Script).await?;
    }
    if let Some(hook) = &p.hooks.post_deploy {
        remote_command(run, remote, dir, hook, Step::Hook("post-deploy")).await?;
    }
    run.metrics.deploy_duration_ms = Some(millis_since(started));

    // 3. Health.
    if let Some(h) = &p.health_check {
        let started = Instant::now();
        let healthy = health_check(run, remote, dir, h, plan.http.as_ref()).await;
        run.metrics.health_check_duration_ms = Some(millis_since(started));
        healthy?;
    }

    // 4. The sticker: written beside, then renamed over the old one.
    let s = &p.sticker;
    let mut extra = s.extra.clone();
    extra.insert("host".into(), p.target.host.clone().into());
    extra.insert("deployDirectory".into(), dir.into());
    let sticker = Sticker {
        name: s.name.clone(),
        release_id: s.release_id.clone(),
        release_name: s.release_name.clone(),
        image: s.image.clone(),
        digest: s.digest.clone(),
        task_id: run.task.task_id.to_string(),
        written_at: time::OffsetDateTime::now_utc(),
        extra,
    };
    let json = serde_json::to_vec_pretty(&sticker)
        .map_err(|e| ExecError::Ssh(format!("cannot encode the sticker: {e}")))?;
    let tmp = format!("{dir}/{STICKER_FILE}.tmp");
    let path = format!("{dir}/{STICKER_FILE}");
    stop.guard(remote.upload(&tmp, &json, 0o644)).await?;
    remote.replace(&tmp, &path, &stop).await?;
    run.log.line(format!("sticker written to {path}"));
    Ok(())
}

#[derive(Debug, Clone, Copy)]
enum Step {
    Script,
    Hook(&'static str),
}

/// Runs the deploy script or a hook on the target: its argument vector in the deploy directory.
async fn remote_command(
    run: &mut Run<'_>,
    remote: &Remote,
    dir: &str,
    command: &HookConfig,
    step: Step,
) -> Result<(), ExecError> {
    let name = match step {
        Step::Script => "deploy script",
        Step::Hook(h) => h,
    };
    let seconds = command.timeout.unwrap_or(DEFAULT_COMMAND_TIMEOUT_SECS);
    run.log.line(format!(
        "{name}: running {:?} on the target (timeout {seconds}s)",
        command.command
    ));
    let mut args = vec![dir];
    args.extend(command.command.iter().map(String::as_str));
    let started = Instant::now();
    let stop = run.stop.clone();
    let done = remote
        .exec(
            &script_line(RUN_IN_DIR, &args),
            Duration::from_secs(seconds),
            &stop,
        )
        .await?;
    if !done.output.is_empty() {
        run.log.line(format!("{name} output:\n{}", done.output));
    }
    let took = started.elapsed().as_millis();
    if done.success() {
        run.log.line(format!("{name}: exit 0 after {took} ms"));
        return Ok(());
    }
    Err(match (step, done.timed_out) {
        (Step::Script, true) => ExecError::DeployScriptFailed(format!(
            "the deploy script ran past its timeout of {seconds}s and was killed"
        )),
        (Step::Script, false) => {
            ExecError::DeployScriptFailed(format!("the deploy script failed: {}", done.summary()))
        }
        (Step::Hook(hook), true) => ExecError::HookTimeout { hook, seconds },
        (Step::Hook(hook), false) => ExecError::HookFailed {
            hook,
            detail: done.summary(),
        },
    })
}

/// Probes until healthy or out of time: `timeout` seconds in all (default 30), every
/// `interval` seconds (default 1).
async fn health_check(
    run: &mut Run<'_>,
    remote: &Remote,
    dir: &str,
    h: &SshHealthCheck,
    http: Option<&probe::HttpTarget>,
) -> Result<(), ExecError> {
    let total = Duration::from_secs(h.timeout.unwrap_or(30).max(1));
    let interval = Duration::from_secs(h.interval.unwrap_or(1).max(1));
    let deadline = Instant::now() + total;
    let stop = run.stop.clone();
    let mut tries = 0u32;
    loop {
        tries += 1;
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1));
        let attempt = match (h.kind, http) {
            (SshHealthCheckKind::Http, Some(target)) => {
                stop.guard(async {
                    Ok(probe::http_get(target, left.min(Duration::from_secs(5)))
                        .await
                        .map(|s| format!("HTTP {s}")))
                })
                .await?
            }
            (SshHealthCheckKind::Tcp, _) => {
                let (host, port) = (
                    h.host.clone().unwrap_or_default(),
                    h.port.unwrap_or_default(),
                );
                stop.guard(async {
                    Ok(
                        probe::tcp_connect(&host, port, left.min(Duration::from_secs(5)))
                            .await
                            .map(|_| format!("{host}:{port} accepts connections")),
                    )
                })
                .await?
            }
            (SshHealthCheckKind::Command, _) => {
                let mut args = vec![dir];
                args.extend(h.command.iter().map(String::as_str));
                let done = remote
                    .exec(&script_line(RUN_IN_DIR, &args), left, &stop)
                    .await?;
                if done.success() {
                    Ok(format!("{:?} exited 0", h.command))
                } else {
                    Err(done.summary())
                }
            }
            (SshHealthCheckKind::Http, None) => {
                return Err(ExecError::InvalidPayload(
                    "healthCheck of type http needs a url".into(),
                ))
            }
        };
        match attempt {
            Ok(detail) => {
                run.log
                    .line(format!("health check passed (try {tries}): {detail}"));
                return Ok(());
            }
            Err(why) => {
                if Instant::now() + interval >= deadline {
                    return Err(ExecError::HealthCheckFailed(format!(
                        "not healthy within {}s ({tries} tries): {why}",
                        total.as_secs()
                    )));
                }
                run.log
                    .line(format!("health check try {tries} failed: {why}"));
                stop.guard(async {
                    tokio::time::sleep(interval).await;
                    Ok(())
                })
                .await?;
            }
        }
    }
}

/// What a remote command did.
#[derive(Debug, Default)]
struct Done {
    exit_status: Option<u32>,
    signal: Option<String>,
    timed_out: bool,
    /// stdout and stderr as they arrived, the tail of at most [`MAX_OUTPUT`] bytes.
    output: String,
}

impl Done {
    fn success(&self) -> bool {
        !self.timed_out && self.exit_status == Some(0)
    }

    fn summary(&self) -> String {
        let how = match (self.timed_out, self.exit_status, &self.signal) {
            (true, _, _) => "timed out and was killed".to_string(),
            (_, Some(code), _) => format!("exit status {code}"),
            (_, None, Some(sig)) => format!("killed by signal {sig}"),
            _ => "ended without an exit status".to_string(),
        };
        let tail: Vec<&str> = self.output.lines().collect();
        let tail = tail[tail.len().saturating_sub(5)..].join("\n");
        if tail.is_empty() {
            how
        } else {
            format!("{how}: {tail}")
        }
    }
}

/// Checks the server's key against the pin; remembers what it saw for the error.
struct PinnedHostKey {
    pinned: PublicKey,
    refused: Arc<Mutex<Option<String>>>,
}

impl client::Handler for PinnedHostKey {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        presented: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let seen = match presented {
            PublicKeyOrCertificate::PublicKey { key, .. }
                if key.key_data() == self.pinned.key_data() =>
            {
                return Ok(true)
            }
            PublicKeyOrCertificate::PublicKey { key, .. } => fingerprint(key),
            PublicKeyOrCertificate::Certificate(_) => "a host certificate".to_string(),
        };
        if let Ok(mut refused) = self.refused.lock() {
            *refused = Some(seen);
        }
        Ok(false)
    }
}

/// The task's one SSH connection and its SFTP session.
struct Remote {
    handle: client::Handle<PinnedHostKey>,
    sftp: SftpSession,
}

impl Remote {
    async fn connect(
        t: &SshTarget,
        access: &Access,
        log: &mut crate::run::Log,
    ) -> Result<Remote, ExecError> {
        let port = t.port.unwrap_or(22);
        let seconds = t.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT_SECS);
        let deadline = Instant::now() + Duration::from_secs(seconds);
        let target = format!("{}@{}:{port}", t.user, t.host);
        let unreachable = |detail: String| ExecError::SshUnreachable {
            target: format!("{}:{port}", t.host),
            detail,
        };
        let timed_out = || unreachable(format!("no answer within {seconds}s"));

        let tcp = tokio::time::timeout_at(
            deadline,
            tokio::net::TcpStream::connect((t.host.as_str(), port)),
        )
        .await
        .map_err(|_| timed_out())?
        .map_err(|e| unreachable(e.to_string()))?;
        let _ = tcp.set_nodelay(true);

        // Offer only the pinned key's algorithm family, so the server presents that key.
        let config = client_config(Some(&access.pinned.algorithm()));
        let refused = Arc::new(Mutex::new(None));
        let handler = PinnedHostKey {
            pinned: access.pinned.clone(),
            refused: refused.clone(),
        };
        let handshake = tokio::time::timeout_at(
            deadline,
            client::connect_stream(Arc::new(config), tcp, handler),
        )
        .await
        .map_err(|_| timed_out())?;
        let mut handle = match handshake {
            Ok(h) => h,
            Err(e) => {
                if let Some(seen) = refused.lock().ok().and_then(|r| r.clone()) {
                    return Err(ExecError::HostKeyMismatch {
                        target,
                        pinned: fingerprint(&access.pinned),
                        presented: seen,
                    });
                }
                return Err(match e {
                    // The server went away during the handshake (overloaded, restarting).
                    russh::Error::IO(_) | russh::Error::Disconnect => unreachable(e.to_string()),
                    e => ExecError::Ssh(format!("SSH handshake with {target} failed: {e}")),
                });
            }
        };
        log.line(format!(
            "connected to {target}; host key {} matches the pin",
            fingerprint(&access.pinned)
        ));

        let rsa = matches!(access.key.algorithm(), Algorithm::Rsa { .. });
        let key = Arc::new(access.key.clone());
        let auth = tokio::time::timeout_at(deadline, async {
            // An RSA key signs with rsa-sha2-512 or -256, never SHA-1 `ssh-rsa`: the server's
            // best, or SHA-256 when it names none (OpenSSH ≥ 7.2 takes both).
            let hash = if rsa {
                Some(
                    handle
                        .best_supported_rsa_hash()
                        .await?
                        .flatten()
                        .unwrap_or(HashAlg::Sha256),
                )
            } else {
                None
            };
            handle
                .authenticate_publickey(t.user.clone(), PrivateKeyWithHashAlg::new(key, hash))
                .await
        })
        .await
        .map_err(|_| timed_out())?
        .map_err(|e| ExecError::Ssh(format!("authenticating to {target}: {e}")))?;
        if !auth.success() {
            let _ = handle.disconnect(Disconnect::ByApplication, "", "en").await;
            return Err(ExecError::SshAuthFailed(format!(
                "{target} refused the key of the {SSH_PRIVATE_KEY_CREDENTIAL} credential"
            )));
        }
        log.line(format!("authenticated as {}", t.user));

        let sftp = tokio::time::timeout_at(deadline, async {
            let channel = handle
                .channel_open_session()
                .await
                .map_err(|e| e.to_string())?;
            channel
                .request_subsystem(true, "sftp")
                .await
                .map_err(|e| e.to_string())?;
            SftpSession::new(channel.into_stream())
                .await
                .map_err(|e| e.to_string())
        })
        .await
        .map_err(|_| timed_out())?
        .map_err(|e| ExecError::Ssh(format!("opening SFTP on {target}: {e}")))?;
        sftp.set_timeout(60);
        Ok(Remote { handle, sftp })
    }

    /// Runs one command line (built by [`command_line`] or [`script_line`]), killing it once
    /// `timeout` passes or the run stops.
    async fn exec(&self, line: &str, timeout: Duration, stop: &Stop) -> Result<Done, ExecError> {
        let mut channel = self
            .handle
            .channel_open_session()
            .await
            .map_err(|e| ExecError::Ssh(format!("opening a channel: {e}")))?;
        channel
            .exec(true, line)
            .await
            .map_err(|e| ExecError::Ssh(format!("starting a remote command: {e}")))?;
        let mut done = Done::default();
        let mut output: Vec<u8> = Vec::new();
        let deadline = Instant::now() + timeout;
        let stopped = loop {
            tokio::select! {
                msg = channel.wait() => match msg {
                    Some(ChannelMsg::Data { data }) | Some(ChannelMsg::ExtendedData { data, .. }) => {
                        output.extend_from_slice(&data);
                        if output.len() > 2 * MAX_OUTPUT {
                            output.drain(..output.len() - MAX_OUTPUT);
                        }
                    }
                    Some(ChannelMsg::ExitStatus { exit_status }) => done.exit_status = Some(exit_status),
                    Some(ChannelMsg::ExitSignal { signal_name, .. }) => {
                        done.signal = Some(format!("{signal_name:?}"))
                    }
                    Some(_) => {}
                    None => break None,
                },
                _ = tokio::time::sleep_until(deadline) => {
                    done.timed_out = true;
                    break None;
                }
                e = stop.stopped() => break Some(e),
            }
        };
        if done.timed_out || stopped.is_some() {
            // The command must not outlive its step: a KILL signal (OpenSSH ≥ 7.9), then the
            // channel goes.
            let _ = channel.signal(Sig::KILL).await;
            let _ = channel.close().await;
        }
        let start = output.len().saturating_sub(MAX_OUTPUT);
        done.output = String::from_utf8_lossy(&output[start..])
            .trim_end()
            .to_string();
        match stopped {
            Some(e) => Err(e),
            None => Ok(done),
        }
    }

    /// Writes `bytes` to `path` with `mode`. An existing entry is removed first, so a symlink
    /// left there is replaced, never followed.
    async fn upload(&self, path: &str, bytes: &[u8], mode: u32) -> Result<(), ExecError> {
        let failed = |e: russh_sftp::client::error::Error| {
            ExecError::Ssh(format!("SFTP upload of {path:?} failed: {e}"))
        };
        match self.sftp.remove_file(path).await {
            Ok(()) => {}
            Err(russh_sftp::client::error::Error::Status(s))
                if s.status_code == StatusCode::NoSuchFile => {}
            Err(e) => return Err(failed(e)),
        }
        let attrs = FileAttributes {
            permissions: Some(mode),
            ..FileAttributes::empty()
        };
        let mut file = self
            .sftp
            .open_with_flags_and_attributes(
                path,
                OpenFlags::CREATE | OpenFlags::EXCLUDE | OpenFlags::WRITE,
                attrs.clone(),
            )
            .await
            .map_err(failed)?;
        file.write_all(bytes)
            .await
            .map_err(|e| ExecError::Ssh(format!("SFTP upload of {path:?} failed: {e}")))?;
        file.shutdown()
            .await
            .map_err(|e| ExecError::Ssh(format!("SFTP upload of {path:?} failed: {e}")))?;
        // The server applies its umask at create; the mode is set exactly afterwards.
        self.sftp.set_metadata(path, attrs).await.map_err(failed)
    }

    /// Renames `tmp` over `path` (see [`REPLACE`]).
    async fn replace(&self, tmp: &str, path: &str, stop: &Stop) -> Result<(), ExecError> {
        let moved = self
            .exec(&script_line(REPLACE, &[tmp, path]), STEP_TIMEOUT, stop)
            .await?;
        if !moved.success() {
            return Err(ExecError::Ssh(format!(
                "cannot put {path:?} in place: {}",
                moved.summary()
            )));
        }
        Ok(())
    }

    /// `None` when nothing is at `path`.
    async fn read_sticker(&self, path: &str) -> Result<Option<Sticker>, ExecError> {
        let unreadable = |e: String| ExecError::StickerUnreadable(format!("{path}: {e}"));
        let meta = match self.sftp.metadata(path).await {
            Ok(m) => m,
            Err(russh_sftp::client::error::Error::Status(s))
                if s.status_code == StatusCode::NoSuchFile =>
            {
                return Ok(None)
            }
            Err(e) => return Err(unreadable(e.to_string())),
        };
        if meta.size.unwrap_or(0) > MAX_STICKER_BYTES {
            return Err(unreadable(format!("larger than {MAX_STICKER_BYTES} bytes")));
        }
        let bytes = self
            .sftp
            .read(path)
            .await
            .map_err(|e| unreadable(e.to_string()))?;
        serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| unreadable(format!("not a sticker: {e}")))
    }

    /// The size and lowercase hex SHA-256 of the file at `path`, read in chunks.
    async fn hash_file(&self, path: &str) -> Result<(u64, String), ExecError> {
        let failed =
            |e: &dyn std::fmt::Display| ExecError::Ssh(format!("reading {path:?} failed: {e}"));
        let mut file = self.sftp.open(path).await.map_err(|e| failed(&e))?;
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = file.read(&mut buf).await.map_err(|e| failed(&e))?;
            if n == 0 {
                break;
            }
            size += n as u64;
            hasher.update(&buf[..n]);
        }
        Ok((size, hex::encode(hasher.finalize())))
    }

    /// Ends the SFTP session and the connection.
    async fn close(self, log: &mut crate::run::Log) {
        let _ = self.sftp.close().await;
        match tokio::time::timeout(
            Duration::from_secs(5),
            self.handle
                .disconnect(Disconnect::ByApplication, "berth: task done", "en"),
        )
        .await
        {
            Ok(Ok(())) => log.line("connection closed"),
            Ok(Err(e)) => log.line(format!("warning: closing the connection: {e}")),
            Err(_) => log.line("warning: closing the connection timed out"),
        }
    }
}

/// The client's configuration: russh's defaults without SHA-1 `ssh-rsa` host key signatures,
/// and with `pinned`, only the host key algorithms of the pinned key's type (an RSA key signs
/// with rsa-sha2-512 or -256).
fn client_config(pinned: Option<&Algorithm>) -> client::Config {
    let preferred = russh::Preferred::default();
    let keys: Vec<Algorithm> = preferred
        .key
        .iter()
        .filter(|a| !matches!(a, Algorithm::Rsa { hash: None }))
        .filter(|a| pinned.is_none_or(|p| same_key_type(a, p)))
        .cloned()
        .collect();
    client::Config {
        inactivity_timeout: None,
        keepalive_interval: Some(Duration::from_secs(15)),
        keepalive_max: 4,
        preferred: russh::Preferred {
            key: if keys.is_empty() {
                preferred.key.clone()
            } else {
                Cow::Owned(keys)
            },
            ..preferred
        },
        ..Default::default()
    }
}

/// Whether a host key algorithm the client offers belongs to the pinned key's type.
fn same_key_type(offered: &Algorithm, pinned: &Algorithm) -> bool {
    match (offered, pinned) {
        (Algorithm::Rsa { .. }, Algorithm::Rsa { .. }) => true,
        (a, b) => a == b,
    }
}

/// Opens the task's connection to `target`, or says why not.
async fn open(run: &mut Run<'_>, target: &SshTarget) -> Result<Remote, ExecError> {
    let access = access(run.task, target)?;
    let stop = run.stop.clone();
    stop.guard(Remote::connect(target, &access, &mut run.log))
        .await
}

/// `read-sticker` with `sshTarget`: `outputs.sticker` is the sticker in `dir` as written, or null
/// when there is none or it names another target than `name`.
pub(crate) async fn read_sticker(
    task: &Task,
    name: &str,
    target: &SshTarget,
    dir: &str,
) -> Outcome {
    let mut run = Run::new(task);
    let dir = dir.trim_end_matches('/');
    let result = match open(&mut run, target).await {
        Err(e) => Err(e),
        Ok(remote) => {
            let path = format!("{dir}/{STICKER_FILE}");
            let read = remote.read_sticker(&path).await;
            remote.close(&mut run.log).await;
            read.map(|found| match found {
                Some(s) if s.name == name => {
                    run.output("sticker", serde_json::json!(s));
                    format!("sticker {name} found in {}:{dir}", target.host)
                }
                Some(s) => {
                    run.output("sticker", serde_json::Value::Null);
                    format!(
                        "the sticker in {}:{dir} is {:?}'s, not {name:?}'s",
                        target.host, s.name
                    )
                }
                None => {
                    run.output("sticker", serde_json::Value::Null);
                    format!("no sticker in {}:{dir}", target.host)
                }
            })
        }
    };
    run.finish(result)
}

/// `inspect` with `sshTarget`: the sticker of `dir` (or null) and its regular files, each with
/// size and SHA-256, berth's own `.berth-*` left out. A missing directory holds nothing.
pub(crate) async fn inspect(task: &Task, target: &SshTarget, dir: &str) -> Outcome {
    let mut run = Run::new(task);
    let dir = dir.trim_end_matches('/');
    let result = match open(&mut run, target).await {
        Err(e) => Err(e),
        Ok(remote) => {
            let listed = list_files(&remote, dir, &run.stop).await;
            let sticker = remote.read_sticker(&format!("{dir}/{STICKER_FILE}")).await;
            remote.close(&mut run.log).await;
            match (listed, sticker) {
                (Ok(files), Ok(sticker)) => {
                    let n = files.len();
                    run.output("sticker", serde_json::json!(sticker));
                    run.output("files", serde_json::Value::Array(files));
                    Ok(format!("inspected {}:{dir}: {n} file(s)", target.host))
                }
                (Err(e), _) | (_, Err(e)) => Err(e),
            }
        }
    };
    run.finish(result)
}

async fn list_files(
    remote: &Remote,
    dir: &str,
    stop: &Stop,
) -> Result<Vec<serde_json::Value>, ExecError> {
    let entries = match remote.sftp.read_dir(dir).await {
        Ok(entries) => entries,
        Err(russh_sftp::client::error::Error::Status(s))
            if s.status_code == StatusCode::NoSuchFile =>
        {
            return Ok(vec![])
        }
        Err(e) => return Err(ExecError::Ssh(format!("listing {dir:?} failed: {e}"))),
    };
    // The server lists with lstat: a symlink is not a regular file here.
    let mut names: Vec<String> = entries
        .filter(|e| e.file_type().is_file() && !e.file_name().starts_with(".berth-"))
        .map(|e| e.file_name())
        .collect();
    names.sort();
    let mut files = Vec::with_capacity(names.len());
    for name in names {
        let (size, sha256) = stop
            .guard(remote.hash_file(&format!("{dir}/{name}")))
            .await?;
        files.push(serde_json::json!({"name": name, "size": size, "sha256": sha256}));
    }
    Ok(files)
}

/// `health-check` of type `command` with `sshTarget`: the argument vector run on the target
/// (in the user's home directory); healthy when it exits 0 within `timeout` (default 5 s).
pub(crate) async fn health_command(task: &Task, p: &HealthCheckPayload) -> Outcome {
    let mut run = Run::new(task);
    let started = Instant::now();
    let result = match &p.ssh_target {
        None => Err(ExecError::InvalidPayload(
            "a health-check of type command needs an sshTarget".into(),
        )),
        Some(target) => match open(&mut run, target).await {
            Err(e) => Err(e),
            Ok(remote) => {
                let seconds = p.timeout.unwrap_or(5).clamp(1, 300);
                let stop = run.stop.clone();
                let done = remote
                    .exec(
                        &command_line(&p.command),
                        Duration::from_secs(seconds),
                        &stop,
                    )
                    .await;
                remote.close(&mut run.log).await;
                done.and_then(|done| {
                    if !done.output.is_empty() {
                        run.log.line(format!("output:\n{}", done.output));
                    }
                    run.output("probe", serde_json::json!({"exitStatus": done.exit_status}));
                    if done.success() {
                        Ok(format!(
                            "healthy: {:?} exited 0 on {}",
                            p.command, target.host
                        ))
                    } else {
                        Err(ExecError::HealthCheckFailed(format!(
                            "{:?} on {}: {}",
                            p.command,
                            target.host,
                            done.summary()
                        )))
                    }
                })
            }
        },
    };
    run.metrics.health_check_duration_ms = Some(millis_since(started));
    let mut outcome = run.finish(result);
    if outcome.error_type.as_deref() == Some(error_types::HEALTH_CHECK_FAILED) {
        // As for a probe from the agent: the task is read-only and may pass later.
        outcome.retriable = true;
    }
    outcome
}

/// `upload-files` with `sshTarget`: creates `dir` on the target, sends every file under a
/// temporary name beside its final one, then renames each into place. A failure removes the
/// temporary files it left.
pub(crate) async fn upload_files(
    run: &mut Run<'_>,
    target: &SshTarget,
    dir: &str,
    files: &[Resolved],
) -> Result<String, ExecError> {
    let remote = open(run, target).await?;
    let result = upload_steps(run, &remote, dir, files)
        .await
        .map(|n| format!("wrote {n} file(s) to {}@{}:{dir}", target.user, target.host));
    remote.close(&mut run.log).await;
    result
}

async fn upload_steps(
    run: &mut Run<'_>,
    remote: &Remote,
    dir: &str,
    files: &[Resolved],
) -> Result<usize, ExecError> {
    run.confirm_lease("writing the files").await?;
    let stop = run.stop.clone();
    let made = remote
        .exec(
            &command_line(&["mkdir", "-p", "--", dir]),
            STEP_TIMEOUT,
            &stop,
        )
        .await?;
    if !made.success() {
        return Err(ExecError::Ssh(format!(
            "cannot create {dir:?}: {}",
            made.summary()
        )));
    }
    let temps: Vec<String> = (0..files.len())
        .map(|i| format!("{dir}/.berth-upload-{}-{i}.tmp", run.task.task_id))
        .collect();
    let sent = async {
        for (f, tmp) in files.iter().zip(&temps) {
            stop.guard(remote.upload(tmp, &f.bytes, f.mode)).await?;
        }
        for (f, tmp) in files.iter().zip(&temps) {
            remote
                .replace(tmp, &format!("{dir}/{}", f.name), &stop)
                .await?;
        }
        Ok::<(), ExecError>(())
    }
    .await;
    if let Err(e) = &sent {
        let mut argv = vec!["rm", "-f", "--"];
        argv.extend(temps.iter().map(String::as_str));
        let _ = remote
            .exec(
                &command_line(&argv),
                STEP_TIMEOUT,
                &Stop::cleanup(STEP_TIMEOUT),
            )
            .await;
        run.log.line(format!("upload failed: {}", e.chain()));
    }
    sent?;
    for f in files {
        run.log.line(format!(
            "wrote {:?} ({} bytes, sha256 {}, mode {:o})",
            f.name,
            f.bytes.len(),
            f.sha256,
            f.mode
        ));
    }
    Ok(files.len())
}

/// Connects to `host:port`, completes the key exchange (the server proves it holds the key) and
/// returns the server's host key as an OpenSSH line, `ssh-ed25519 AAAA…`, for a person to confirm
/// before pinning it. Authenticates nothing and runs nothing. The key offered is the server's
/// first in russh's order of preference (Ed25519, ECDSA, then RSA).
pub async fn scan_host_key(host: &str, port: u16, timeout: Duration) -> Result<String, ExecError> {
    let unreachable = |detail: String| ExecError::SshUnreachable {
        target: format!("{host}:{port}"),
        detail,
    };
    let deadline = Instant::now() + timeout;
    let timed_out = || unreachable(format!("no answer within {}s", timeout.as_secs()));
    let tcp = tokio::time::timeout_at(deadline, tokio::net::TcpStream::connect((host, port)))
        .await
        .map_err(|_| timed_out())?
        .map_err(|e| unreachable(e.to_string()))?;
    let seen = Arc::new(Mutex::new(None));
    let handler = RecordHostKey(seen.clone());
    let handle = tokio::time::timeout_at(
        deadline,
        client::connect_stream(Arc::new(client_config(None)), tcp, handler),
    )
    .await
    .map_err(|_| timed_out())?
    .map_err(|e| match e {
        russh::Error::IO(_) | russh::Error::Disconnect => unreachable(e.to_string()),
        e => ExecError::Ssh(format!("SSH handshake with {host}:{port} failed: {e}")),
    })?;
    let _ = tokio::time::timeout(
        Duration::from_secs(5),
        handle.disconnect(Disconnect::ByApplication, "berth: host key scanned", "en"),
    )
    .await;
    let key = seen
        .lock()
        .ok()
        .and_then(|k| k.clone())
        .ok_or_else(|| ExecError::Ssh(format!("{host}:{port} presented no host key")))?;
    let line = key
        .to_openssh()
        .map_err(|e| ExecError::Ssh(format!("cannot encode the host key: {e}")))?;
    // Without the comment: the pin is `<algorithm> <base64>`.
    Ok(line
        .split_ascii_whitespace()
        .take(2)
        .collect::<Vec<_>>()
        .join(" "))
}

/// Accepts and remembers the server's plain host key (a certificate is refused: scanning pins
/// keys, not certificate authorities).
struct RecordHostKey(Arc<Mutex<Option<PublicKey>>>);

impl client::Handler for RecordHostKey {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        presented: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        match presented {
            PublicKeyOrCertificate::PublicKey { key, .. } => {
                if let Ok(mut seen) = self.0.lock() {
                    *seen = Some(key.clone());
                }
                Ok(true)
            }
            PublicKeyOrCertificate::Certificate(_) => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `sh` makes of a command line: each argument printed between `<` and `>`.
    fn shell_words(line: &str) -> String {
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("for a in {line}; do printf '<%s>' \"$a\"; done"))
            .output()
            .unwrap();
        assert!(out.status.success(), "{line}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    #[test]
    fn quoting_examples() {
        assert_eq!(sh_quote(""), "''");
        assert_eq!(sh_quote("abc"), "'abc'");
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
        assert_eq!(sh_quote("'"), r"''\'''");
        assert_eq!(
            command_line(&["mkdir", "-p", "--", "/srv/a b"]),
            "'mkdir' '-p' '--' '/srv/a b'"
        );
        let nasty = "x'; touch /tmp/pwn; echo '$(id) `id` \\ \" \n;|&<>*?~#";
        assert_eq!(
            shell_words(&command_line(&[nasty, "b"])),
            format!("<{nasty}><b>")
        );
    }

    #[test]
    fn script_lines_pass_data_as_positional_parameters() {
        let line = script_line(r#"printf '<%s>' "$@""#, &["a b", "it's", "$(x)"]);
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(&line)
            .output()
            .unwrap();
        assert_eq!(String::from_utf8(out.stdout).unwrap(), "<a b><it's><$(x)>");
    }

    #[test]
    fn host_key_pins_parse_and_must_name_their_own_algorithm() {
        let line =
            "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEurclYvUHl3FBdASRMaprhB9Vn1t45AFUujJ907m2wd";
        assert!(parse_host_key(line).is_ok());
        assert!(parse_host_key(&format!("{line} a comment")).is_ok());
        let lying = line.replace("ssh-ed25519", "ecdsa-sha2-nistp256");
        assert!(parse_host_key(&lying).is_err());
        assert!(parse_host_key("ssh-ed25519 AAAA").is_err());
        assert!(parse_host_key("").is_err());
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(200))]
        /// Any NUL-free argument, quoted, is read back by a real POSIX shell as exactly itself.
        #[test]
        fn sh_reads_back_every_quoted_argument(a in "[^\u{0}]{0,40}", b in "[ -~\n\t'\"$`\\\\]{0,40}") {
            let got = shell_words(&command_line(&[a.as_str(), b.as_str()]));
            proptest::prop_assert_eq!(got, format!("<{a}><{b}>"));
        }
    }
}
