//! End-to-end tests with real processes: `berth server` on `127.0.0.1:0` with a temp data dir,
//! `berth-agent` with temp state dirs, and the admin CLI with `--output json`.
//!
//! Every process is owned by a [`Proc`] guard that kills and reaps it on every path (and the
//! kernel kills it if the test thread dies first). Waits poll a condition up to a generous
//! deadline, so the tests pass on a loaded 2-core machine and still finish fast when things work.

#![cfg(unix)]

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use tempfile::TempDir;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

const BERTH: &str = env!("CARGO_BIN_EXE_berth");
const BERTH_AGENT: &str = env!("CARGO_BIN_EXE_berth-agent");

/// How long a server may take to start, or an agent to show up or change state.
const SETTLE: Duration = Duration::from_secs(60);
/// How long a process may take to exit once it has been told to, or has reason to.
const EXIT: Duration = Duration::from_secs(60);

/// Variables of the test's own environment that would change what the binaries do.
const SCRUBBED_ENV: &[&str] = &[
    "BERTH_SERVER",
    "BERTH_TOKEN",
    "BERTH_CA_FILE",
    "BERTH_DATA_DIR",
    "BERTH_LISTEN",
    "BERTH_DATABASE",
    "BERTH_HOSTNAMES",
    "BERTH_HEARTBEAT_INTERVAL_SECS",
    "BERTH_AGENT_CERT_VALIDITY_SECS",
    "BERTH_REGISTRATION_TOKEN",
    "BERTH_CA_FINGERPRINT",
    "BERTH_AGENT_STATE_DIR",
    "RUST_LOG",
];

// ---------------------------------------------------------------------------------------------
// Harness
// ---------------------------------------------------------------------------------------------

/// A command for one of our binaries, without the test's own `BERTH_*` settings.
fn command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    for var in SCRUBBED_ENV {
        cmd.env_remove(var);
    }
    cmd
}

fn tempdir() -> TempDir {
    tempfile::Builder::new()
        .prefix("berth-e2e-")
        .tempdir()
        .expect("creating a temp dir")
}

/// Polls `probe` until it returns `Ok`, or panics at the deadline with the last `Err`.
fn wait_for<T>(timeout: Duration, what: &str, mut probe: impl FnMut() -> Result<T, String>) -> T {
    let started = Instant::now();
    let mut pause = Duration::from_millis(50);
    loop {
        match probe() {
            Ok(v) => return v,
            Err(last) => {
                if started.elapsed() >= timeout {
                    panic!(
                        "timed out after {timeout:?} waiting for {what}; last observation: {last}"
                    );
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(500));
            }
        }
    }
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
/// Its stdout and stderr are captured; on a failing test the guard prints them.
struct Proc {
    name: String,
    child: Child,
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
    readers: Vec<JoinHandle<()>>,
    stderr_lines: Option<mpsc::Receiver<String>>,
    status: Option<ExitStatus>,
}

struct Finished {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Proc {
    fn spawn(name: &str, mut cmd: Command) -> Proc {
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
        }
    }

    fn pid(&self) -> libc::pid_t {
        self.child.id() as libc::pid_t
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    fn signal(&self, sig: libc::c_int) {
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
    }

    /// The exit status, if the process has exited (and is now reaped).
    fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().expect("try_wait");
        }
        self.status
    }

    fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let what = format!("{} to exit", self.name);
        wait_for(timeout, &what, || {
            self.try_status().ok_or_else(|| "still running".to_string())
        })
    }

    /// Waits for the exit code; panics (with the output) if the process died of a signal.
    fn wait_code(&mut self, timeout: Duration) -> i32 {
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
    fn terminate(&mut self) -> i32 {
        self.signal(libc::SIGTERM);
        self.wait_code(EXIT)
    }

    /// SIGKILL (`kill -9`) and reap.
    fn kill9(&mut self) {
        self.signal(libc::SIGKILL);
        self.wait_exit(EXIT);
    }

    /// Waits for the exit and for all of the output.
    fn finish(mut self, timeout: Duration) -> Finished {
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

    fn assert_running(&mut self) {
        if let Some(status) = self.try_status() {
            panic!(
                "{} exited unexpectedly ({status}):\n{}",
                self.name,
                self.stderr()
            );
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
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

/// A running `berth server`.
struct Server {
    proc: Proc,
    url: String,
    ca_fingerprint: String,
    data_dir: PathBuf,
    admin_token: String,
}

impl Server {
    /// Starts `berth server` on `127.0.0.1:0` and waits for it to report its address.
    fn start(data_dir: &Path, args: &[&str]) -> Server {
        let mut cmd = command(BERTH);
        cmd.arg("server")
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--listen", "127.0.0.1:0"])
            .args(args);
        let mut proc = Proc::spawn("berth server", cmd);
        let lines = proc.stderr_lines.take().unwrap();
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
        assert!(url.starts_with("https://127.0.0.1:"), "listening on {url}");
        let admin_token = std::fs::read_to_string(data_dir.join("admin.token"))
            .expect("reading admin.token")
            .trim()
            .to_string();
        assert!(
            admin_token.starts_with("bat_"),
            "admin.token holds {admin_token:?}"
        );
        Server {
            proc,
            url,
            ca_fingerprint: ca_fingerprint.unwrap(),
            data_dir: data_dir.to_path_buf(),
            admin_token,
        }
    }

    /// `berth <args> --output json` with the given API token.
    fn try_cli_as(&self, token: &str, args: &[&str]) -> Result<Value, String> {
        let mut cmd = command(BERTH);
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

    fn try_cli(&self, args: &[&str]) -> Result<Value, String> {
        self.try_cli_as(&self.admin_token, args)
    }

    fn cli(&self, args: &[&str]) -> Value {
        self.try_cli(args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// A one-time registration token (`berth token create … -o json`).
    fn registration_token(&self, args: &[&str]) -> String {
        let mut full = vec!["token", "create"];
        full.extend_from_slice(args);
        let created = self.cli(&full);
        assert_eq!(
            created["caFingerprint"],
            self.ca_fingerprint.as_str(),
            "{created}"
        );
        let token = created["token"].as_str().expect("token").to_string();
        assert!(token.starts_with("reg_"), "{created}");
        token
    }

    fn try_agents(&self, filter: &[&str]) -> Result<Vec<Value>, String> {
        let mut args = vec!["agents", "list"];
        args.extend_from_slice(filter);
        match self.try_cli(&args)? {
            Value::Array(items) => Ok(items),
            other => Err(format!("agents list returned {other}")),
        }
    }

    fn agents(&self, filter: &[&str]) -> Vec<Value> {
        self.try_agents(filter).unwrap_or_else(|e| panic!("{e}"))
    }

    fn try_show(&self, id: &str) -> Result<Value, String> {
        self.try_cli(&["agents", "show", id])
    }

    /// Waits until `berth agents show ID` satisfies `check`, and returns that observation.
    fn wait_agent(&self, id: &str, what: &str, check: impl Fn(&Value) -> bool) -> Value {
        wait_for(SETTLE, what, || {
            let agent = self.try_show(id)?;
            if check(&agent) {
                Ok(agent)
            } else {
                Err(agent.to_string())
            }
        })
    }

    /// Waits until an agent named `name` is listed `online` with a heartbeat (registration alone
    /// also shows `online`, before the agent has entered its heartbeat loop), and returns it.
    fn wait_online_by_name(&self, name: &str) -> Value {
        wait_for(
            SETTLE,
            &format!("agent {name} online with a heartbeat"),
            || {
                let agents = self.try_agents(&[])?;
                match agents.iter().find(|a| a["name"] == name) {
                    Some(a) if a["status"] == "online" && a["lastHeartbeat"].is_string() => {
                        Ok(a.clone())
                    }
                    _ => Err(Value::Array(agents).to_string()),
                }
            },
        )
    }

    /// SIGTERM; the server must stop cleanly with exit code 0.
    fn stop(mut self) {
        let code = self.proc.terminate();
        assert_eq!(
            code,
            0,
            "berth server exit code on SIGTERM:\n{}",
            self.proc.stderr()
        );
        assert!(
            self.proc.stderr().contains("berth server stopped"),
            "{}",
            self.proc.stderr()
        );
    }
}

fn agent_command(state_dir: &Path, args: &[&str]) -> Command {
    let mut cmd = command(BERTH_AGENT);
    cmd.arg("--state-dir").arg(state_dir).args(args);
    // These tests are about identity and liveness, not Docker: without an engine socket the
    // agent reports no docker capability, so a slow engine on a loaded host cannot make it
    // `degraded`.
    cmd.env("DOCKER_HOST", "unix:///nonexistent/berth-e2e/docker.sock");
    cmd
}

/// `berth-agent --register …`; it keeps running once registered.
fn register_agent(
    server: &Server,
    token: &str,
    state_dir: &Path,
    name: &str,
    extra: &[&str],
) -> Proc {
    register_agent_pinned(
        server,
        token,
        &server.ca_fingerprint,
        state_dir,
        name,
        extra,
    )
}

fn register_agent_pinned(
    server: &Server,
    token: &str,
    ca_fingerprint: &str,
    state_dir: &Path,
    name: &str,
    extra: &[&str],
) -> Proc {
    let mut args = vec![
        "--register",
        "--token",
        token,
        "--server",
        &server.url,
        "--ca-fingerprint",
        ca_fingerprint,
        "--name",
        name,
    ];
    args.extend_from_slice(extra);
    Proc::spawn(
        &format!("berth-agent {name}"),
        agent_command(state_dir, &args),
    )
}

/// `berth-agent` with an existing identity.
fn run_agent(server_url: &str, state_dir: &Path, name: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["--server", server_url];
    args.extend_from_slice(extra);
    Proc::spawn(
        &format!("berth-agent {name}"),
        agent_command(state_dir, &args),
    )
}

fn identity_agent_id(state_dir: &Path) -> String {
    let text =
        std::fs::read_to_string(state_dir.join("identity.json")).expect("reading identity.json");
    let identity: Value = serde_json::from_str(&text).expect("identity.json is JSON");
    identity["agentId"].as_str().expect("agentId").to_string()
}

fn id_of(agent: &Value) -> String {
    agent["id"].as_str().expect("agent id").to_string()
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
}

fn timestamp(v: &Value) -> OffsetDateTime {
    OffsetDateTime::parse(
        v.as_str().unwrap_or_else(|| panic!("not a timestamp: {v}")),
        &Rfc3339,
    )
    .unwrap_or_else(|e| panic!("{v}: {e}"))
}

/// A localhost port where nothing listens (bound, then released).
fn dead_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

// ---------------------------------------------------------------------------------------------
// 1. online → offline
// ---------------------------------------------------------------------------------------------

#[test]
fn agent_goes_online_then_offline_after_three_missed_heartbeats() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let token = server.registration_token(&["--labels", "role=web", "--env", "staging"]);
    let state = tmp.path().join("agent");
    let mut agent = register_agent(&server, &token, &state, "web-1", &[]);

    let online = wait_for(
        SETTLE,
        "web-1 online with a heartbeat and resource usage",
        || {
            let agents = server.try_agents(&[])?;
            match agents.iter().find(|a| a["name"] == "web-1") {
                Some(a)
                    if a["status"] == "online"
                        && a["lastHeartbeat"].is_string()
                        && a["resourceUsage"].is_object() =>
                {
                    Ok(a.clone())
                }
                _ => Err(Value::Array(agents).to_string()),
            }
        },
    );
    assert_eq!(online["labels"]["role"], "web", "{online}");
    assert_eq!(online["environment"], "staging", "{online}");
    let usage = &online["resourceUsage"];
    assert!(usage["cpuCores"].as_u64().unwrap_or(0) >= 1, "{usage}");
    assert!(
        usage["memoryTotalBytes"].as_u64().unwrap_or(0) > 0,
        "{usage}"
    );
    assert!(usage["diskTotalBytes"].as_u64().unwrap_or(0) > 0, "{usage}");
    let id = id_of(&online);
    assert_eq!(identity_agent_id(&state), id);

    agent.kill9();
    let offline = server.wait_agent(&id, "web-1 offline after kill -9", |a| {
        a["status"] == "offline"
    });
    // Offline means no heartbeat for 3 intervals: never sooner.
    let silent = OffsetDateTime::now_utc() - timestamp(&offline["lastHeartbeat"]);
    assert!(
        silent >= time::Duration::seconds(3),
        "offline after only {silent} of silence: {offline}"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. restart reuses state
// ---------------------------------------------------------------------------------------------

#[test]
fn server_restart_keeps_ca_admin_token_and_agent_identity() {
    let tmp = tempdir();
    let data = tmp.path().join("data");
    let state = tmp.path().join("agent");
    let server = Server::start(&data, &["--heartbeat-interval-secs", "1"]);
    assert!(
        server.proc.stderr().contains(&format!(
            "admin token (shown once; also in {}",
            data.join("admin.token").display()
        )),
        "{}",
        server.proc.stderr()
    );
    assert!(
        server.proc.stderr().contains(&server.admin_token),
        "the printed token is the one in admin.token"
    );
    let fingerprint = server.ca_fingerprint.clone();
    let admin_token = server.admin_token.clone();

    let token = server.registration_token(&[]);
    let mut agent = register_agent(&server, &token, &state, "restart-1", &[]);
    let before = server.wait_online_by_name("restart-1");
    let id = id_of(&before);
    assert_eq!(
        agent.terminate(),
        0,
        "agent exit code on SIGTERM:\n{}",
        agent.stderr()
    );
    server.stop();

    let server = Server::start(&data, &["--heartbeat-interval-secs", "1"]);
    assert_eq!(
        server.ca_fingerprint, fingerprint,
        "the CA survives a restart"
    );
    assert_eq!(server.admin_token, admin_token, "admin.token is unchanged");
    assert!(
        !server.proc.stderr().contains("shown once"),
        "no new admin token on restart:\n{}",
        server.proc.stderr()
    );
    // The old admin token still works against the new process.
    let listed = server
        .try_cli_as(&admin_token, &["agents", "list"])
        .expect("admin token after restart");
    assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    assert_eq!(listed[0]["id"], id.as_str());

    // The agent comes back with its stored identity, no --register.
    let mut agent = run_agent(&server.url, &state, "restart-1", &[]);
    let last_before = timestamp(&before["lastHeartbeat"]);
    server.wait_agent(
        &id,
        "restart-1 online again after the server restart",
        |a| {
            a["status"] == "online"
                && a["lastHeartbeat"].is_string()
                && timestamp(&a["lastHeartbeat"]) > last_before
        },
    );
    agent.assert_running();

    for secret in [
        "ca.key",
        "server.key",
        "jwt.key",
        "master.key",
        "admin.token",
    ] {
        assert_eq!(mode(&data.join(secret)), 0o600, "{secret} mode");
    }
    assert_eq!(mode(&state.join("agent.pem")), 0o600, "agent.pem mode");
    assert_eq!(
        mode(&state.join("identity.json")),
        0o600,
        "identity.json mode"
    );
}

// ---------------------------------------------------------------------------------------------
// 3. agent exit codes
// ---------------------------------------------------------------------------------------------

#[test]
fn agent_with_an_unknown_registration_token_exits_78() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let state = tmp.path().join("agent");
    let bogus = "reg_AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
    let mut agent = register_agent(
        &server,
        bogus,
        &state,
        "bogus-1",
        &["--retry-budget-secs", "30"],
    );
    assert_eq!(agent.wait_code(EXIT), 78, "{}", agent.stderr());
    assert!(
        agent.stderr().contains("REGISTRATION_TOKEN_INVALID"),
        "{}",
        agent.stderr()
    );
    assert!(!state.join("identity.json").exists() && !state.join("agent.pem").exists());
    assert_eq!(server.agents(&[]), Vec::<Value>::new());
}

#[test]
fn agent_refuses_a_server_whose_ca_does_not_match_the_pin() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let token = server.registration_token(&[]);
    // Valid format, wrong value: the last hex digit changed.
    let mut wrong = server.ca_fingerprint.clone();
    let last = wrong.pop().unwrap();
    wrong.push(if last == '0' { '1' } else { '0' });

    let state = tmp.path().join("pinned-wrong");
    let mut agent = register_agent_pinned(
        &server,
        &token,
        &wrong,
        &state,
        "pin-1",
        &["--retry-budget-secs", "3"],
    );
    let code = agent.wait_code(EXIT);
    assert_ne!(code, 0, "{}", agent.stderr());
    assert!(
        agent.stderr().contains("did not present the pinned CA"),
        "refused for another reason:\n{}",
        agent.stderr()
    );
    for file in ["identity.json", "agent.pem", "ca.crt"] {
        assert!(
            !state.join(file).exists(),
            "{file} written despite the pin mismatch"
        );
    }
    assert_eq!(server.agents(&[]), Vec::<Value>::new());

    // The refused handshake never reached the registration endpoint: the token is unspent.
    let state = tmp.path().join("pinned-right");
    let _agent = register_agent(&server, &token, &state, "pin-1", &[]);
    server.wait_online_by_name("pin-1");
}

#[test]
fn deleted_agent_exits_1_and_its_identity_stays_revoked() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let token = server.registration_token(&[]);
    let state = tmp.path().join("agent");
    let mut agent = register_agent(&server, &token, &state, "doomed-1", &[]);
    let id = id_of(&server.wait_online_by_name("doomed-1"));

    let deleted = server.cli(&["agents", "rm", &id]);
    assert_eq!(deleted["deleted"], true, "{deleted}");
    assert_eq!(
        agent.wait_code(EXIT),
        1,
        "exit code after deletion:\n{}",
        agent.stderr()
    );
    assert_eq!(server.agents(&[]), Vec::<Value>::new());

    // Restarting it with the same identity does not bring it back.
    let mut again = run_agent(&server.url, &state, "doomed-1", &[]);
    assert_eq!(
        again.wait_code(EXIT),
        1,
        "restart of a deleted agent:\n{}",
        again.stderr()
    );
    assert_eq!(server.agents(&[]), Vec::<Value>::new());
}

#[test]
fn agent_exits_75_when_the_server_stays_unreachable() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let state = tmp.path().join("agent");
    let mut agent = register_agent(
        &server,
        &server.registration_token(&[]),
        &state,
        "lonely-1",
        &[],
    );
    server.wait_online_by_name("lonely-1");
    assert_eq!(agent.terminate(), 0, "{}", agent.stderr());

    // Running with a stored identity.
    let nowhere = format!("https://127.0.0.1:{}", dead_port());
    let mut agent = run_agent(&nowhere, &state, "lonely-1", &["--retry-budget-secs", "3"]);
    assert_eq!(agent.wait_code(EXIT), 75, "{}", agent.stderr());

    // Registering.
    let fresh = tmp.path().join("fresh");
    let mut args = vec!["--register", "--token", "reg_unused", "--server", &nowhere];
    args.extend([
        "--ca-fingerprint",
        &server.ca_fingerprint,
        "--name",
        "lonely-2",
        "--retry-budget-secs",
        "3",
    ]);
    let mut registering = Proc::spawn("berth-agent lonely-2", agent_command(&fresh, &args));
    assert_eq!(registering.wait_code(EXIT), 75, "{}", registering.stderr());
    assert!(!fresh.join("identity.json").exists());
}

#[test]
fn sigterm_stops_a_running_agent_with_exit_0() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let state = tmp.path().join("agent");
    let mut agent = register_agent(
        &server,
        &server.registration_token(&[]),
        &state,
        "calm-1",
        &[],
    );
    server.wait_online_by_name("calm-1");
    assert_eq!(agent.terminate(), 0, "{}", agent.stderr());
}

/// SIGTERM must stop the agent with exit 0 in every phase, including while registration is
/// retrying against a server that does not answer (here for up to 60 s).
#[test]
fn sigterm_while_registration_retries_exits_0() {
    let tmp = tempdir();
    let nowhere = format!("https://127.0.0.1:{}", dead_port());
    let fingerprint = format!("sha256:{}", "ab".repeat(32));
    let state = tmp.path().join("agent");
    let args = [
        "--register",
        "--token",
        "reg_unused",
        "--server",
        &nowhere,
        "--ca-fingerprint",
        &fingerprint,
        "--name",
        "early-1",
        "--retry-budget-secs",
        "60",
    ];
    let mut agent = Proc::spawn("berth-agent early-1", agent_command(&state, &args));
    wait_for(SETTLE, "the agent to retry its registration", || {
        agent.assert_running();
        if agent.stderr().contains("registration failed; retrying") {
            Ok(())
        } else {
            Err(agent.stderr())
        }
    });
    agent.signal(libc::SIGTERM);
    let status = agent.wait_exit(Duration::from_secs(20));
    assert_eq!(
        status.code(),
        Some(0),
        "SIGTERM during registration must stop the agent with exit 0, got {status}:\n{}",
        agent.stderr()
    );
}

// ---------------------------------------------------------------------------------------------
// 4. registration tokens are single-use
// ---------------------------------------------------------------------------------------------

#[test]
fn a_used_registration_token_cannot_register_a_second_agent() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let token = server.registration_token(&[]);
    let mut first = register_agent(&server, &token, &tmp.path().join("first"), "first", &[]);
    let registered = server.wait_online_by_name("first");

    let second_state = tmp.path().join("second");
    let mut second = register_agent(&server, &token, &second_state, "second", &[]);
    assert_eq!(second.wait_code(EXIT), 78, "{}", second.stderr());
    assert!(
        second.stderr().contains("REGISTRATION_TOKEN_INVALID"),
        "{}",
        second.stderr()
    );
    assert!(!second_state.join("identity.json").exists());

    let agents = server.agents(&[]);
    assert_eq!(agents.len(), 1, "{agents:?}");
    assert_eq!(agents[0]["id"], registered["id"]);
    first.assert_running();
}

#[test]
fn concurrent_registrations_with_one_token_admit_exactly_one_agent() {
    const RACERS: usize = 4;
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let token = server.registration_token(&[]);
    let mut racers: Vec<Proc> = (0..RACERS)
        .map(|i| {
            register_agent(
                &server,
                &token,
                &tmp.path().join(format!("racer-{i}")),
                &format!("racer-{i}"),
                &[],
            )
        })
        .collect();

    // All but one are refused as configuration errors; one registers and keeps running.
    let refused = wait_for(SETTLE, "all but one racer to exit", || {
        let exited: Vec<usize> = (0..RACERS)
            .filter(|&i| racers[i].try_status().is_some())
            .collect();
        if exited.len() >= RACERS - 1 {
            Ok(exited)
        } else {
            Err(format!("{} exited so far", exited.len()))
        }
    });
    assert_eq!(
        refused.len(),
        RACERS - 1,
        "every racer exited: nobody registered"
    );
    for &i in &refused {
        assert_eq!(
            racers[i].wait_code(EXIT),
            78,
            "racer-{i}:\n{}",
            racers[i].stderr()
        );
    }
    let winner = (0..RACERS).find(|i| !refused.contains(i)).unwrap();
    server.wait_online_by_name(&format!("racer-{winner}"));
    let agents = server.agents(&[]);
    assert_eq!(agents.len(), 1, "{agents:?}");
    racers[winner].assert_running();
}

// ---------------------------------------------------------------------------------------------
// 5. certificate renewal
// ---------------------------------------------------------------------------------------------

#[test]
fn agent_renews_its_certificate_after_two_thirds_of_its_life() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &[
            "--heartbeat-interval-secs",
            "1",
            "--agent-cert-validity-secs",
            "60",
        ],
    );
    let state = tmp.path().join("agent");
    let mut agent = register_agent(
        &server,
        &server.registration_token(&[]),
        &state,
        "renew-1",
        &[],
    );
    let before = server.wait_online_by_name("renew-1");
    let id = id_of(&before);
    let old_fingerprint = before["certificateFingerprint"]
        .as_str()
        .expect("certificateFingerprint")
        .to_string();
    let old_expiry = timestamp(&before["certificateExpiresAt"]);
    let old_pem = std::fs::read_to_string(state.join("agent.pem")).unwrap();

    // A copy of the identity as it is before the renewal.
    let stale = tmp.path().join("stale-copy");
    std::fs::create_dir(&stale).unwrap();
    std::fs::set_permissions(&stale, std::fs::Permissions::from_mode(0o700)).unwrap();
    for file in ["identity.json", "agent.pem", "ca.crt"] {
        std::fs::copy(state.join(file), stale.join(file)).unwrap();
    }

    // Renewal is due 40 s into the 60 s life; the agent must stay up and never go offline.
    let mut statuses = Vec::new();
    let renewed = wait_for(
        Duration::from_secs(100),
        "the certificate fingerprint to change",
        || {
            agent.assert_running();
            let a = server.try_show(&id)?;
            statuses.push(a["status"].as_str().unwrap_or("?").to_string());
            match a["certificateFingerprint"].as_str() {
                Some(fp) if fp != old_fingerprint => Ok(a),
                _ => Err(a.to_string()),
            }
        },
    );
    assert!(
        !statuses.iter().any(|s| s == "offline"),
        "went offline around the renewal: {statuses:?}"
    );
    assert!(
        timestamp(&renewed["certificateExpiresAt"]) > old_expiry,
        "{renewed}"
    );
    let new_fingerprint = renewed["certificateFingerprint"]
        .as_str()
        .unwrap()
        .to_string();
    server.wait_agent(&id, "renew-1 online with the new certificate", |a| {
        a["status"] == "online" && a["certificateFingerprint"] == new_fingerprint.as_str()
    });
    agent.assert_running();

    let new_pem = std::fs::read_to_string(state.join("agent.pem")).unwrap();
    assert_ne!(new_pem, old_pem, "agent.pem was not rewritten");
    let key_of = |pem: &str| {
        pem.split("-----BEGIN CERTIFICATE-----")
            .next()
            .unwrap()
            .to_string()
    };
    assert_ne!(
        key_of(&new_pem),
        key_of(&old_pem),
        "the renewal must use a new key"
    );
    assert_eq!(mode(&state.join("agent.pem")), 0o600);

    // The old certificate stopped working the moment the new one was bound. (Only while it is
    // unexpired: an expired one is refused in the handshake, which the agent retries.)
    if old_expiry - OffsetDateTime::now_utc() > time::Duration::seconds(10) {
        let mut stale_agent = run_agent(
            &server.url,
            &stale,
            "renew-1-stale",
            &["--retry-budget-secs", "10"],
        );
        assert_eq!(
            stale_agent.wait_code(EXIT),
            1,
            "an agent with the replaced certificate:\n{}",
            stale_agent.stderr()
        );
    } else {
        eprintln!(
            "note: skipped the replaced-certificate check; the old certificate is about to expire"
        );
    }
    let still = server.cli(&["agents", "show", &id]);
    assert_eq!(
        still["certificateFingerprint"],
        new_fingerprint.as_str(),
        "{still}"
    );
}

// ---------------------------------------------------------------------------------------------
// 6. labels
// ---------------------------------------------------------------------------------------------

#[test]
fn labels_are_set_removed_and_filtered_from_the_cli() {
    let tmp = tempdir();
    let server = Server::start(
        &tmp.path().join("data"),
        &["--heartbeat-interval-secs", "1"],
    );
    let mut agents = Vec::new();
    for name in ["lab-a", "lab-b"] {
        let token =
            server.registration_token(&["--labels", "role=web,zone=z1", "--env", "staging"]);
        agents.push(register_agent(
            &server,
            &token,
            &tmp.path().join(name),
            name,
            &[],
        ));
    }
    let a = id_of(&server.wait_online_by_name("lab-a"));
    let b = id_of(&server.wait_online_by_name("lab-b"));

    let updated = server.cli(&["agents", "label", &a, "k=v", "--remove", "role"]);
    assert_eq!(updated["id"], a.as_str());
    let expected = serde_json::json!({"k": "v", "zone": "z1"});
    assert_eq!(updated["labels"], expected, "{updated}");
    assert_eq!(server.cli(&["agents", "show", &a])["labels"], expected);
    assert_eq!(
        server.cli(&["agents", "show", &a])["environment"],
        "staging"
    );

    let ids = |filter: &str| -> Vec<String> {
        let mut ids: Vec<String> = server
            .agents(&["--label", filter])
            .iter()
            .map(id_of)
            .collect();
        ids.sort();
        ids
    };
    let mut both = vec![a.clone(), b.clone()];
    both.sort();
    assert_eq!(ids("k=v"), vec![a.clone()]);
    assert_eq!(ids("role=web"), vec![b.clone()]);
    assert_eq!(ids("zone=z1"), both);
    assert_eq!(ids("k=other"), Vec::<String>::new());
    for agent in &mut agents {
        agent.assert_running();
    }
}
