//! Harness for end-to-end tests with real processes: `berth server` with a temp data dir,
//! `berth-agent` with temp state dirs, the admin CLI with `--output json`, and a typed API client
//! for bulk work.
//!
//! Every process is owned by a [`Proc`] guard that kills and reaps it on every path (and the
//! kernel kills it if the test thread dies first). Waits poll a condition every 100–250 ms up to a
//! generous deadline, so the tests pass on a loaded 2-core machine and finish fast when healthy.

#![allow(dead_code)]

pub mod machine;
pub mod netns;

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[allow(unused_imports)] // each test binary uses its own part
pub use berth_test_utils::{free_port, id_of, str_of, try_wait_for, wait_for};
use serde_json::Value;
use tempfile::TempDir;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

pub const BERTH: &str = env!("CARGO_BIN_EXE_berth");

/// Runs an async test utility (OpenBao's, the API client's) to completion on this thread.
pub fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}
pub const BERTH_AGENT: &str = env!("CARGO_BIN_EXE_berth-agent");

/// How long a server may take to start, or an agent to show up or change state.
pub const SETTLE: Duration = Duration::from_secs(60);
/// How long a process may take to exit once it has been told to, or has reason to.
pub const EXIT: Duration = Duration::from_secs(60);

/// Variables of the test's own environment that would change what the binaries do.
const SCRUBBED_ENV: &[&str] = &[
    "BERTH_AGENT_TASK_TRANSPORT",
    "BERTH_SERVER",
    "BERTH_TOKEN",
    "BERTH_CA_FILE",
    "BERTH_DATA_DIR",
    "BERTH_LISTEN",
    "BERTH_DATABASE",
    "BERTH_HOSTNAMES",
    "BERTH_HEARTBEAT_INTERVAL_SECS",
    "BERTH_AGENT_CERT_VALIDITY_SECS",
    "BERTH_AGENT_TRANSPORT",
    "BERTH_LEASE_GRACE_SECS",
    "BERTH_MAX_CONNECTIONS_PER_SOURCE",
    "BERTH_HEADER_READ_TIMEOUT_SECS",
    "BERTH_BODY_READ_TIMEOUT_SECS",
    "BERTH_REGISTRATION_TOKEN",
    "BERTH_CA_FINGERPRINT",
    "BERTH_AGENT_STATE_DIR",
    "BERTH_FAULT_CRASH_AFTER",
    "BERTH_CONFIG",
    "BERTH_AGENT_CONFIG",
    "RUST_LOG",
];

// ---------------------------------------------------------------------------------------------
// Processes and waiting
// ---------------------------------------------------------------------------------------------

/// A command for one of our binaries, without the test's own `BERTH_*` settings, logging
/// without colours so the tests can read it.
pub fn command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    cmd.env("NO_COLOR", "1");
    cmd
}

pub fn tempdir() -> TempDir {
    tempfile::Builder::new()
        .prefix("berth-e2e-")
        .tempdir()
        .expect("creating a temp dir")
}

/// Copies everything read from `from` into `buf`, and each complete line into `lines` while
/// someone listens. Keeps draining after the listener is gone, so the child never blocks.
fn drain(
    mut from: impl Read + Send + 'static,
    buf: Arc<Mutex<Vec<u8>>>,
    lines: Option<mpsc::Sender<String>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        let mut pending = Vec::new();
        loop {
            let n = match from.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            buf.lock().unwrap().extend_from_slice(&chunk[..n]);
            if let Some(tx) = &lines {
                pending.extend_from_slice(&chunk[..n]);
                while let Some(i) = pending.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = pending.drain(..=i).collect();
                    let _ = tx.send(String::from_utf8_lossy(&line).trim_end().to_string());
                }
            }
        }
    })
}

/// A child process that is killed and reaped when dropped, unless it has already been reaped.
/// Its stdout and stderr are captured; on a failing test the guard prints its stderr.
pub struct Proc {
    pub name: String,
    child: Child,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    readers: Vec<JoinHandle<()>>,
    stderr_lines: Option<mpsc::Receiver<String>>,
    status: Option<ExitStatus>,
    /// Set while we hold the process stopped (SIGSTOP), so the guard can kill it cleanly.
    stopped: bool,
}

pub struct Finished {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command) -> Proc {
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        #[cfg(target_os = "linux")]
        // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
        unsafe {
            cmd.pre_exec(|| {
                // If the test thread dies without running the guard, the kernel kills the child.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("starting {name}: {e}"));
        let stdout = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = mpsc::channel();
        let readers = vec![
            drain(child.stdout.take().unwrap(), stdout.clone(), None),
            drain(child.stderr.take().unwrap(), stderr.clone(), Some(tx)),
        ];
        Proc {
            name: name.to_string(),
            child,
            stdout,
            stderr,
            readers,
            stderr_lines: Some(rx),
            status: None,
            stopped: false,
        }
    }

    pub fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }

    /// Everything the process wrote to stdout so far, without terminal escapes.
    pub fn stdout(&self) -> String {
        strip_ansi(&String::from_utf8_lossy(&self.stdout.lock().unwrap()))
    }

    /// Everything the process wrote to stderr so far, as written (escapes included).
    pub fn raw_stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    /// Everything the process wrote to stderr so far, without terminal escapes.
    pub fn stderr(&self) -> String {
        strip_ansi(&String::from_utf8_lossy(&self.stderr.lock().unwrap()))
    }

    pub fn signal(&mut self, sig: libc::c_int) {
        assert!(self.status.is_none(), "{} has already exited", self.name);
        // SAFETY: plain syscall on the pid of our own, not yet reaped, child.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(
            rc,
            0,
            "kill({}, {sig}): {}",
            self.name,
            std::io::Error::last_os_error()
        );
        match sig {
            libc::SIGSTOP => self.stopped = true,
            libc::SIGCONT => self.stopped = false,
            _ => {}
        }
    }

    /// The exit status, if the process has exited (and is now reaped).
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("try_wait");
        }
        self.status
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let what = format!("{} to exit", self.name);
        wait_for(timeout, &what, || {
            self.try_status().ok_or_else(|| "still running".to_string())
        })
    }

    /// Waits for the exit code; panics (with the output) if the process died of a signal.
    pub fn wait_code(&mut self, timeout: Duration) -> i32 {
        let status = self.wait_exit(timeout);
        status.code().unwrap_or_else(|| {
            panic!(
                "{} ended without an exit code ({status}):\n{}",
                self.name,
                self.stderr()
            )
        })
    }

    /// SIGTERM, then the exit code.
    pub fn terminate(&mut self) -> i32 {
        self.signal(libc::SIGTERM);
        self.wait_code(EXIT)
    }

    /// SIGKILL (`kill -9`) and reap.
    pub fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        self.wait_exit(EXIT);
    }

    /// Waits for the exit and for all of the output.
    pub fn finish(mut self, timeout: Duration) -> Finished {
        let status = self.wait_exit(timeout);
        for reader in std::mem::take(&mut self.readers) {
            let _ = reader.join();
        }
        Finished {
            status,
            stdout: String::from_utf8_lossy(&self.stdout.lock().unwrap()).into_owned(),
            stderr: self.stderr(),
        }
    }

    pub fn assert_running(&mut self) {
        if let Some(status) = self.try_status() {
            panic!(
                "{} exited unexpectedly ({status}):\n{}",
                self.name,
                self.stderr()
            );
        }
    }

    /// Takes the line-by-line view of stderr (only once).
    pub fn take_stderr_lines(&mut self) -> mpsc::Receiver<String> {
        self.stderr_lines
            .take()
            .expect("stderr lines already taken")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            if self.stopped {
                // SAFETY: our own unreaped child; SIGKILL ends a stopped process too, this only
                // makes sure nothing waits on it.
                unsafe { libc::kill(self.pid(), libc::SIGCONT) };
            }
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "----- {} (pid {}) stderr -----\n{}",
                self.name,
                self.child.id(),
                self.stderr()
            );
        }
    }
}

/// Removes ANSI escape sequences (`ESC [ … letter`).
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' && chars.peek() == Some(&'[') {
            chars.next();
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Live (non-zombie) children of `pid` whose command name is `comm`, read from /proc.
pub fn live_children(pid: libc::pid_t, comm: &str) -> Vec<libc::pid_t> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<libc::pid_t>().ok())
        .filter(|child| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
                return false;
            };
            // "pid (comm) state ppid …"; comm may hold spaces and parentheses.
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                return false;
            };
            let name = &stat[open + 1..close];
            let mut rest = stat[close + 1..].split_whitespace();
            let state = rest.next().unwrap_or("?");
            let ppid = rest.next().and_then(|p| p.parse::<libc::pid_t>().ok());
            name == comm && ppid == Some(pid) && state != "Z" && state != "X"
        })
        .collect()
}

pub fn timestamp(v: &Value) -> OffsetDateTime {
    OffsetDateTime::parse(
        v.as_str().unwrap_or_else(|| panic!("not a timestamp: {v}")),
        &Rfc3339,
    )
    .unwrap_or_else(|e| panic!("{v}: {e}"))
}

/// The first program of `candidates` that exists (e.g. `/bin/echo`, `/usr/bin/echo`).
pub fn program(candidates: &[&str]) -> String {
    candidates
        .iter()
        .find(|p| Path::new(p).exists())
        .unwrap_or_else(|| panic!("none of {candidates:?} exists"))
        .to_string()
}

// ---------------------------------------------------------------------------------------------
// berth server
// ---------------------------------------------------------------------------------------------

/// A running `berth server`.
pub struct Server {
    pub proc: Proc,
    pub url: String,
    pub ca_fingerprint: String,
    pub data_dir: PathBuf,
    pub admin_token: String,
}

impl Server {
    /// Starts `berth server` on `127.0.0.1:0` and waits for it to report its address.
    pub fn start(data_dir: &Path, args: &[&str]) -> Server {
        Server::start_at(data_dir, "127.0.0.1:0", args, None)
    }

    /// Starts `berth server --listen LISTEN`. The admin token is read from `admin.token` in the
    /// data dir unless given (a second replica on a shared database has none of its own).
    pub fn start_at(
        data_dir: &Path,
        listen: &str,
        args: &[&str],
        admin_token: Option<&str>,
    ) -> Server {
        Server::start_with_env(data_dir, listen, args, admin_token, &[])
    }

    /// `berth server` on `<root>/server` using the test's OpenBao as the seed's Terraform sets it
    /// up (its JWT mount's `jwks_url` is this server's JWKS, role `see-env`, KV v2, the templated
    /// policy), with `args`. OpenBao fetches the JWKS when the mount is configured, so a first
    /// server serves it; then the server starts again on the same data dir and port knowing the
    /// mounts and holding a token of its own (`auth/token/lookup`, …).
    pub fn start_with_openbao(
        root: &Path,
        bao: &berth_test_utils::openbao::OpenBaoEnv,
        args: &[&str],
    ) -> (Server, berth_test_utils::openbao::SeedMounts) {
        let data = root.join("server");
        let listen = format!("127.0.0.1:{}", free_port());
        let first = Server::start_at(&data, &listen, &[], None);
        let ca_pem = std::fs::read_to_string(data.join("ca.crt")).unwrap();
        let mounts = block_on(berth_test_utils::openbao::SeedMounts::configure(
            bao,
            &format!("{}/.well-known/agent-jwks.json", first.url),
            Some(&ca_pem),
        ));
        drop(first);
        let token_file = root.join("bao-server.token");
        berth_fs::write_atomic(
            &token_file,
            block_on(mounts.server_token()).as_bytes(),
            0o600,
        )
        .unwrap();
        let mut all = vec![
            "--openbao-addr",
            &bao.addr,
            "--openbao-kv-mount",
            &mounts.kv_mount,
            "--openbao-auth-mount",
            &mounts.auth_mount,
            "--openbao-role",
            &mounts.role,
            "--openbao-token-file",
            token_file.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        let server = Server::start_at(&data, &listen, &all, None);
        (server, mounts)
    }

    /// [`Server::start_at`] with extra environment variables (e.g. `BERTH_FAULT_CRASH_AFTER`).
    pub fn start_with_env(
        data_dir: &Path,
        listen: &str,
        args: &[&str],
        admin_token: Option<&str>,
        env: &[(&str, &str)],
    ) -> Server {
        let mut cmd = command(BERTH);
        cmd.envs(env.iter().copied());
        Server::start_command(cmd, data_dir, listen, args, admin_token)
    }

    /// Starts `berth server` from `cmd`: [`command`]`(BERTH)` plus whatever the test set on it
    /// (environment, a resource limit in `pre_exec`).
    pub fn start_command(
        mut cmd: Command,
        data_dir: &Path,
        listen: &str,
        args: &[&str],
        admin_token: Option<&str>,
    ) -> Server {
        cmd.arg("server")
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--listen", listen])
            .args(args);
        let server = Server::spawn_ready(cmd, data_dir, admin_token);
        let host = listen.rsplit_once(':').map_or(listen, |(host, _)| host);
        assert!(
            server.url.starts_with(&format!("https://{host}:")),
            "listening on {}",
            server.url
        );
        server
    }

    /// Spawns `cmd`, a complete `berth server …` command line (data dir and listen address
    /// from wherever it sets them, e.g. a config file), and waits for it to report its address.
    pub fn spawn_ready(cmd: Command, data_dir: &Path, admin_token: Option<&str>) -> Server {
        let mut proc = Proc::spawn("berth server", cmd);
        let lines = proc.take_stderr_lines();
        let deadline = Instant::now() + SETTLE;
        let (mut url, mut ca_fingerprint) = (None, None);
        while url.is_none() || ca_fingerprint.is_none() {
            match lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(line) => {
                    if let Some(rest) = line.strip_prefix("berth server listening on ") {
                        url = Some(rest.trim().to_string());
                    } else if let Some(rest) = line.strip_prefix("CA fingerprint: ") {
                        ca_fingerprint = Some(rest.trim().to_string());
                    }
                }
                Err(e) => panic!(
                    "berth server did not report its address ({e:?}):\n{}",
                    proc.stderr()
                ),
            }
        }
        let url = url.unwrap();
        let admin_token = match admin_token {
            Some(t) => t.to_string(),
            None => std::fs::read_to_string(data_dir.join("admin.token"))
                .expect("reading admin.token")
                .trim()
                .to_string(),
        };
        assert!(
            admin_token.starts_with("bat_"),
            "admin token {admin_token:?}"
        );
        Server {
            proc,
            url,
            ca_fingerprint: ca_fingerprint.unwrap(),
            data_dir: data_dir.to_path_buf(),
            admin_token,
        }
    }

    /// `berth <args> --output json` with the admin token.
    pub fn try_cli(&self, args: &[&str]) -> Result<Value, String> {
        self.try_cli_as(&self.admin_token, args)
    }

    /// `berth <args> --output json` with the given API token.
    pub fn try_cli_as(&self, token: &str, args: &[&str]) -> Result<Value, String> {
        self.try_cli_env(token, args, &[])
    }

    /// Like [`Server::try_cli_as`], with extra environment variables (secrets stay out of the
    /// argument list, which failures print).
    pub fn try_cli_env(
        &self,
        token: &str,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Value, String> {
        let mut cmd = command(BERTH);
        cmd.envs(env.iter().copied());
        cmd.args(args)
            .args(["--output", "json"])
            .env("BERTH_SERVER", &self.url)
            .env("BERTH_TOKEN", token)
            .env("BERTH_CA_FILE", self.data_dir.join("ca.crt"));
        let out = Proc::spawn(&format!("berth {}", args.join(" ")), cmd).finish(EXIT);
        if !out.status.success() {
            return Err(format!(
                "berth {} failed ({}): {}",
                args.join(" "),
                out.status,
                out.stderr.trim()
            ));
        }
        serde_json::from_str(&out.stdout).map_err(|e| {
            format!(
                "berth {}: stdout is not JSON ({e}): {}",
                args.join(" "),
                out.stdout
            )
        })
    }

    pub fn cli(&self, args: &[&str]) -> Value {
        self.try_cli(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// `berth ARGS` as the admin, as a person runs it, with `stdin` fed to it: its exit code,
    /// stdout and stderr (colours stripped).
    pub fn run_with_input(&self, args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
        use std::io::Write;
        let mut cmd = Command::new(BERTH);
        cmd.args(args)
            .env("BERTH_SERVER", &self.url)
            .env("BERTH_TOKEN", &self.admin_token)
            .env("BERTH_CA_FILE", self.data_dir.join("ca.crt"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("berth");
        if let Some(input) = stdin {
            child
                .stdin
                .take()
                .unwrap()
                .write_all(input.as_bytes())
                .unwrap();
        }
        drop(child.stdin.take());
        let out = child.wait_with_output().unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            strip_ansi(&String::from_utf8_lossy(&out.stderr)),
        )
    }

    /// `berth ARGS` as `token`, as a person runs it (no `--output json`): its exit code, stdout
    /// and stderr (colours stripped).
    pub fn run_as(&self, token: &str, args: &[&str], timeout: Duration) -> (i32, String, String) {
        let mut cmd = command(BERTH);
        cmd.args(args)
            .env("BERTH_SERVER", &self.url)
            .env("BERTH_TOKEN", token)
            .env("BERTH_CA_FILE", self.data_dir.join("ca.crt"));
        let out = Proc::spawn(&format!("berth {}", args.join(" ")), cmd).finish(timeout);
        (
            out.status.code().unwrap_or(-1),
            out.stdout,
            strip_ansi(&out.stderr),
        )
    }

    /// A one-time registration token (`berth token create -o json`).
    pub fn registration_token(&self) -> String {
        self.registration_token_with(&[])
    }

    /// A one-time registration token (`berth token create <args> -o json`).
    pub fn registration_token_with(&self, args: &[&str]) -> String {
        let mut full = vec!["token", "create"];
        full.extend_from_slice(args);
        let created = self.cli(&full);
        assert_eq!(
            created["caFingerprint"],
            self.ca_fingerprint.as_str(),
            "{created}"
        );
        let token = str_of(&created, "token").to_string();
        assert!(token.starts_with("reg_"), "{created}");
        token
    }

    pub fn try_agent(&self, id: &str) -> Result<Value, String> {
        self.try_cli(&["agents", "show", id])
    }

    /// Waits until `berth agents show ID` satisfies `check`, and returns that observation.
    pub fn wait_agent(&self, id: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        wait_for(SETTLE, what, || {
            let agent = self.try_agent(id)?;
            if check(&agent) {
                Ok(agent)
            } else {
                Err(agent.to_string())
            }
        })
    }

    /// `berth task create --agent ID --type T --payload JSON [--timeout-secs N] -o json`.
    pub fn create_task(
        &self,
        agent: &str,
        task_type: &str,
        payload: &Value,
        timeout_secs: Option<u32>,
    ) -> Value {
        let payload = payload.to_string();
        let timeout = timeout_secs.map(|t| t.to_string());
        let mut args = vec![
            "task",
            "create",
            "--agent",
            agent,
            "--type",
            task_type,
            "--payload",
            &payload,
        ];
        if let Some(t) = &timeout {
            args.extend(["--timeout-secs", t]);
        }
        let task = self.cli(&args);
        assert!(task["id"].is_string(), "{task}");
        task
    }

    /// `berth task show ID -o json`.
    pub fn try_task(&self, id: &str) -> Result<Value, String> {
        self.try_cli(&["task", "show", id])
    }

    pub fn task(&self, id: &str) -> Value {
        self.try_task(id).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Waits until the task satisfies `check`; returns that observation.
    pub fn wait_task(
        &self,
        id: &str,
        timeout: Duration,
        what: &str,
        check: impl Fn(&Value) -> bool,
    ) -> Value {
        wait_for(timeout, &format!("task {id}: {what}"), || {
            let task = self.try_task(id)?;
            if check(&task) {
                Ok(task)
            } else {
                Err(task.to_string())
            }
        })
    }

    /// Waits until the task is in `state`.
    pub fn wait_task_state(&self, id: &str, timeout: Duration, state: &str) -> Value {
        self.wait_task(id, timeout, &format!("state {state}"), |t| {
            t["state"] == state
        })
    }

    /// `berth task ls [filter…] -o json`.
    pub fn tasks(&self, filter: &[&str]) -> Vec<Value> {
        let mut args = vec!["task", "ls"];
        args.extend_from_slice(filter);
        match self.cli(&args) {
            Value::Array(items) => items,
            other => panic!("task ls returned {other}"),
        }
    }

    /// The typed API client, as the admin.
    pub fn api(&self) -> berth_client::Client {
        let ca = std::fs::read_to_string(self.data_dir.join("ca.crt")).expect("reading ca.crt");
        berth_client::Client::new(berth_client::ClientConfig {
            server: self.url.clone(),
            trust: berth_client::Trust::CaPem(ca),
            identity: None,
            bearer: Some(self.admin_token.clone()),
            timeout: Duration::from_secs(30),
        })
        .expect("API client")
    }
}

/// Two replicas on one database: B's data dir starts as a copy of A's key material (the CA, so
/// agents keep their pin; the JWT, master and sealing keys), as README's "Several replicas"
/// says.
pub fn two_replicas(root: &Path, args: &[&str]) -> (Server, Server) {
    let dir_a = root.join("replica-a");
    let dir_b = root.join("replica-b");
    let a = Server::start(&dir_a, args);
    std::fs::create_dir(&dir_b).unwrap();
    std::fs::set_permissions(&dir_b, std::fs::Permissions::from_mode(0o700)).unwrap();
    for file in [
        "ca.crt",
        "ca.key",
        "jwt.key",
        "master.key",
        "sealing.key",
        "registry-token.key",
        "registry-token.crt",
    ] {
        std::fs::copy(dir_a.join(file), dir_b.join(file)).unwrap();
    }
    let b = Server::start_at(&dir_b, "127.0.0.1:0", args, Some(&a.admin_token));
    assert_eq!(a.ca_fingerprint, b.ca_fingerprint);
    (a, b)
}

// ---------------------------------------------------------------------------------------------
// berth-agent
// ---------------------------------------------------------------------------------------------

pub fn agent_command(state_dir: &Path, args: &[&str]) -> Command {
    let mut cmd = command(BERTH_AGENT);
    cmd.arg("--state-dir").arg(state_dir).args(args);
    // Not about Docker: without an engine socket the agent reports no docker capability, so a
    // slow engine on a loaded host cannot make it `degraded`.
    cmd.env("DOCKER_HOST", "unix:///nonexistent/berth-e2e/docker.sock");
    // A stopped agent gives running tasks 240 s by default; the suites stop agents mid-task
    // and need no more than a few seconds. The graceful-stop tests pass --shutdown-grace-secs.
    cmd.env("BERTH_AGENT_SHUTDOWN_GRACE_SECS", "10");
    // The suites run over either task transport: `BERTH_E2E_TASK_TRANSPORT=poll|stream|auto`
    // (unset: the agent's default, auto, which takes the stream berth offers).
    if let Ok(mode) = std::env::var("BERTH_E2E_TASK_TRANSPORT") {
        cmd.env("BERTH_AGENT_TASK_TRANSPORT", mode);
    }
    cmd
}

/// A registered, running agent process.
pub struct Agent {
    pub proc: Proc,
    pub id: String,
    pub state_dir: PathBuf,
    pub sticker_dir: PathBuf,
}

impl Agent {
    /// Registers `name` with a fresh one-time token (`--register`), keeps it running, and waits
    /// until the server lists it online with a heartbeat. Stickers go to `<root>/<name>-stickers`.
    pub fn register(server: &Server, root: &Path, name: &str, extra: &[&str]) -> Agent {
        let agent = Agent::spawn_registered(server, root, name, extra, agent_command);
        agent.wait_online(server);
        agent
    }

    /// Starts `berth-agent --register` for `name` as `command` builds it, and returns once the
    /// agent has stored its identity; whether it is online is the caller's wait.
    pub fn spawn_registered(
        server: &Server,
        root: &Path,
        name: &str,
        extra: &[&str],
        command: impl Fn(&Path, &[&str]) -> Command,
    ) -> Agent {
        let token = server.registration_token();
        let state_dir = root.join(name);
        let sticker_dir = root.join(format!("{name}-stickers"));
        let sticker_arg = sticker_dir.display().to_string();
        let mut args = vec![
            "--register",
            "--token",
            &token,
            "--server",
            &server.url,
            "--ca-fingerprint",
            &server.ca_fingerprint,
            "--name",
            name,
            "--sticker-dir",
            &sticker_arg,
        ];
        args.extend_from_slice(extra);
        let mut proc = Proc::spawn(&format!("berth-agent {name}"), command(&state_dir, &args));
        let id = wait_for(SETTLE, &format!("{name} to register"), || {
            proc.assert_running();
            identity_agent_id(&state_dir).ok_or_else(|| "no identity.json yet".to_string())
        });
        Agent {
            proc,
            id,
            state_dir,
            sticker_dir,
        }
    }

    /// Runs another process with this agent's stored identity and sticker dir.
    pub fn restart(
        server_url: &str,
        state_dir: &Path,
        sticker_dir: &Path,
        name: &str,
        extra: &[&str],
    ) -> Proc {
        let sticker_arg = sticker_dir.display().to_string();
        let mut args = vec!["--server", server_url, "--sticker-dir", &sticker_arg];
        args.extend_from_slice(extra);
        Proc::spawn(
            &format!("berth-agent {name}"),
            agent_command(state_dir, &args),
        )
    }

    pub fn wait_online(&self, server: &Server) -> Value {
        server.wait_agent(&self.id, "the agent online with a heartbeat", |a| {
            a["status"] == "online" && a["lastHeartbeat"].is_string()
        })
    }

    /// The task ids in this agent's sticker history, one per write-sticker execution.
    pub fn history(&self) -> Vec<String> {
        sticker_history(&self.sticker_dir)
    }
}

pub fn identity_agent_id(state_dir: &Path) -> Option<String> {
    let text = std::fs::read_to_string(state_dir.join("identity.json")).ok()?;
    let identity: Value = serde_json::from_str(&text).ok()?;
    identity["agentId"].as_str().map(str::to_string)
}

/// `taskId` of every line of `<dir>/history.log` (empty when there is none).
pub fn sticker_history(dir: &Path) -> Vec<String> {
    let text = match std::fs::read_to_string(dir.join("history.log")) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return vec![],
        Err(e) => panic!("{}: {e}", dir.display()),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("history line {l:?}: {e}"));
            str_of(&v, "taskId").to_string()
        })
        .collect()
}

/// The attempts (deliveries) of a task as `berth task show` prints them.
pub fn attempts(task: &Value) -> &Vec<Value> {
    task["attempts"]
        .as_array()
        .unwrap_or_else(|| panic!("no attempts in {task}"))
}

/// Waits until read-back decides the `unknown` task `id`, and checks that it proved the task's
/// one delivery ran: `succeeded` by read-back, found the sticker naming the task, and never ran
/// the task again. Returns the task.
pub fn wait_proven_by_read_back(server: &Server, id: &str, timeout: Duration) -> Value {
    let done = server.wait_task(id, timeout, "decided by read-back", |t| {
        t["state"] != "unknown"
    });
    assert_eq!(done["state"], "succeeded", "{done:#}");
    assert_eq!(done["readBack"], true, "{done:#}");
    assert_eq!(done["result"]["found"], true, "{done:#}");
    assert_eq!(done["result"]["sticker"]["taskId"], id, "{done:#}");
    assert_eq!(attempts(&done).len(), 1, "re-run: {done:#}");
    done
}

/// Waits until a line of the agent's own log about `task_id` contains `what`.
pub fn wait_in_log(agent: &mut Proc, task_id: &str, what: &str) {
    wait_for(
        SETTLE,
        &format!("{} to log {what:?} for task {task_id}", agent.name),
        || {
            let log = agent.stderr();
            if log.lines().any(|l| l.contains(task_id) && l.contains(what)) {
                Ok(())
            } else {
                Err(log)
            }
        },
    );
}

/// Waits until the agent's own log shows the server refused a result for `task_id` as FENCED.
pub fn wait_fenced_in_log(agent: &mut Proc, task_id: &str) {
    wait_in_log(agent, task_id, "FENCED")
}

/// What the agent logs when it drops a delivery that is no longer its to run.
pub const NOT_RUN: &str = "not running the task";

/// The session generations an agent process logged ("session acquired … generation=N").
pub fn acquired_generations(stderr: &str) -> Vec<i64> {
    stderr
        .lines()
        .filter(|l| l.contains("session acquired"))
        .filter_map(|l| {
            let rest = &l[l.find("generation=")? + "generation=".len()..];
            rest.split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// An mTLS client holding the agent's identity from its state dir.
pub fn agent_client(server: &Server, state_dir: &Path) -> berth_client::Client {
    let pem = std::fs::read_to_string(state_dir.join("agent.pem")).expect("agent.pem");
    let split = pem
        .find("-----BEGIN CERTIFICATE-----")
        .expect("certificate in agent.pem");
    let ca = std::fs::read_to_string(server.data_dir.join("ca.crt")).expect("ca.crt");
    berth_client::Client::new(berth_client::ClientConfig {
        server: server.url.clone(),
        trust: berth_client::Trust::CaPem(ca),
        identity: Some(berth_client::Identity {
            key_pem: pem[..split].trim().to_string(),
            cert_pem: pem[split..].trim().to_string(),
        }),
        bearer: None,
        timeout: Duration::from_secs(30),
    })
    .expect("agent client")
}
