//! Issue 16 item 3: the config files of `berth server` and `berth-agent`, through the real
//! binaries. A server started with `--config F` listens and keeps its data where F says; a flag
//! beats a variable, which beats the file; `--print-config` prints the effective settings with
//! the database password masked and starts nothing; an unknown key, a bad value or a missing
//! named file exits 78 naming what is wrong.

mod common;

use std::path::Path;
use std::process::Output;

use std::time::Duration;

use common::{command, free_port, tempdir, Proc, Server, BERTH, BERTH_AGENT};
use serde_json::Value;

fn run(mut cmd: std::process::Command) -> (i32, String, String) {
    let Output {
        status,
        stdout,
        stderr,
    } = cmd.output().expect("running the binary");
    (
        status.code().expect("exited, not killed"),
        String::from_utf8_lossy(&stdout).into_owned(),
        String::from_utf8_lossy(&stderr).into_owned(),
    )
}

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

#[test]
fn the_server_takes_its_listen_address_and_data_dir_from_the_file() {
    let dir = tempdir();
    let file = dir.path().join("server.toml");
    let from_file = dir.path().join("data-file");
    let port = free_port();
    write(
        &file,
        &format!(
            "data_dir = {:?}\nlisten = \"127.0.0.1:{port}\"\nretention_days = 0\n",
            from_file.display().to_string()
        ),
    );

    // The file over the defaults.
    let mut cmd = command(BERTH);
    cmd.arg("server").arg("--config").arg(&file);
    let server = Server::spawn_ready(cmd, &from_file, None);
    assert_eq!(server.url, format!("https://127.0.0.1:{port}"));
    assert!(from_file.join("ca.crt").is_file());
    server.cli(&["agents", "list"]);
    drop(server);

    // A flag over a variable over the file: --listen beats BERTH_LISTEN, BERTH_DATA_DIR beats
    // data_dir; the file is named by BERTH_CONFIG this time.
    let from_env = dir.path().join("data-env");
    let (env_port, flag_port) = (free_port(), free_port());
    let mut cmd = command(BERTH);
    cmd.env("BERTH_CONFIG", &file)
        .env("BERTH_LISTEN", format!("127.0.0.1:{env_port}"))
        .env("BERTH_DATA_DIR", &from_env)
        .args(["server", "--listen", &format!("127.0.0.1:{flag_port}")]);
    let server = Server::spawn_ready(cmd, &from_env, None);
    assert_eq!(server.url, format!("https://127.0.0.1:{flag_port}"));
    assert!(from_env.join("ca.crt").is_file());
    drop(server);
}

#[test]
fn print_config_shows_the_effective_settings_masks_the_password_and_starts_nothing() {
    let dir = tempdir();
    let file = dir.path().join("server.toml");
    let data = dir.path().join("data");
    write(
        &file,
        &format!(
            "data_dir = {:?}\nretention_days = 9\nheartbeat_interval_secs = 15\n\
             database = \"postgres://berth:hunter2-secret@127.0.0.1:1/berth\"\n\
             database_statement_timeout_secs = 5\ndatabase_max_connections = 4\n",
            data.display().to_string()
        ),
    );
    let mut cmd = command(BERTH);
    cmd.env("BERTH_HEARTBEAT_INTERVAL_SECS", "20")
        .env("BERTH_DATABASE_MAX_CONNECTIONS", "7")
        .args(["server", "--print-config", "--config"])
        .arg(&file);
    let (code, stdout, stderr) = run(cmd);
    assert_eq!(code, 0, "{stderr}");
    assert!(!stdout.contains("hunter2") && !stderr.contains("hunter2"));
    let printed: toml::Table = toml::from_str(&stdout).unwrap();
    assert_eq!(
        printed["database"].as_str(),
        Some("postgres://berth:***@127.0.0.1:1/berth")
    );
    assert_eq!(printed["retention_days"].as_integer(), Some(9), "file");
    assert_eq!(
        printed["heartbeat_interval_secs"].as_integer(),
        Some(20),
        "env"
    );
    assert_eq!(
        printed["listen"].as_str(),
        Some("127.0.0.1:8443"),
        "default"
    );
    // The PostgreSQL pool's settings: file, environment over file, default.
    assert_eq!(
        printed["database_statement_timeout_secs"].as_integer(),
        Some(5)
    );
    assert_eq!(printed["database_max_connections"].as_integer(), Some(7));
    assert_eq!(
        printed["database_acquire_timeout_secs"].as_integer(),
        Some(10)
    );
    assert!(!data.exists(), "--print-config started nothing");

    // The agent's: file and defaults, and no state dir made.
    let file = dir.path().join("agent.toml");
    let state = dir.path().join("state");
    write(
        &file,
        &format!(
            "state_dir = {:?}\nmax_concurrent_tasks = 2\nlabels = [\"role=web\"]\n",
            state.display().to_string()
        ),
    );
    let mut cmd = command(BERTH_AGENT);
    cmd.env("BERTH_AGENT_CONFIG", &file).arg("--print-config");
    let (code, stdout, stderr) = run(cmd);
    assert_eq!(code, 0, "{stderr}");
    let printed: toml::Table = toml::from_str(&stdout).unwrap();
    assert_eq!(printed["max_concurrent_tasks"].as_integer(), Some(2));
    assert_eq!(printed["retry_budget_secs"].as_integer(), Some(600));
    assert_eq!(printed["labels"].as_array().map(Vec::len), Some(1));
    assert!(!state.exists(), "--print-config started nothing");
}

#[test]
fn a_bad_config_file_exits_78_naming_the_problem() {
    let dir = tempdir();
    let server_file = dir.path().join("server.toml");
    let agent_file = dir.path().join("agent.toml");
    let missing = dir.path().join("missing.toml");
    let server = |args: &[&str]| {
        let mut cmd = command(BERTH);
        cmd.arg("server").args(args);
        run(cmd)
    };
    let agent = |args: &[&str]| {
        let mut cmd = command(BERTH_AGENT);
        cmd.args(args);
        run(cmd)
    };
    let path = |p: &Path| p.display().to_string();

    write(
        &server_file,
        "listen = \"127.0.0.1:0\"\nlisten_addr = \"x\"\n",
    );
    let (code, _, stderr) = server(&["--config", &path(&server_file)]);
    assert_eq!(code, 78, "{stderr}");
    assert!(stderr.contains("unknown key `listen_addr`"), "{stderr}");
    assert!(
        stderr.contains(&format!("{}:2", path(&server_file))),
        "{stderr}"
    );

    write(&server_file, "heartbeat_interval_secs = 0\n");
    let (code, _, stderr) = server(&["--print-config", "--config", &path(&server_file)]);
    assert_eq!(code, 78, "{stderr}");
    assert!(stderr.contains("heartbeat_interval_secs"), "{stderr}");

    let (code, _, stderr) = server(&["--config", &path(&missing)]);
    assert_eq!(code, 78, "{stderr}");
    assert!(stderr.contains("missing.toml"), "{stderr}");

    write(&agent_file, "allow_commands = [\"/bin/true\"]\n");
    let (code, _, stderr) = agent(&["--config", &path(&agent_file)]);
    assert_eq!(code, 78, "{stderr}");
    assert!(stderr.contains("unknown key `allow_commands`"), "{stderr}");
    assert!(stderr.contains(&path(&agent_file)), "{stderr}");

    let (code, _, stderr) = agent(&["--print-config", "--config", &path(&missing)]);
    assert_eq!(code, 78, "{stderr}");
    assert!(stderr.contains("missing.toml"), "{stderr}");
}

/// Issue 16 item 8: logs fit for log shippers. Off a terminal the text log has no escape codes;
/// with `--log-format json` (or `log_format = "json"` in the file) every line the server or the
/// agent writes to stderr is one JSON object.
#[test]
fn logs_are_plain_off_a_terminal_and_json_when_asked() {
    let dir = tempdir();
    let server = Server::start(&dir.path().join("text"), &[]);
    server.cli(&["agents", "list"]);
    let text = server.proc.raw_stderr();
    assert!(text.contains("INFO"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "escape codes in a piped log: {text:?}"
    );
    drop(server);

    fn json_lines(log: &str) -> Vec<Value> {
        log.lines()
            .filter(|l| !l.is_empty())
            .map(|line| {
                let v: Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line}"));
                assert!(
                    v["timestamp"].is_string() && v["level"].is_string(),
                    "{line}"
                );
                v
            })
            .collect()
    }

    let mut cmd = command(BERTH);
    cmd.args(["server", "--log-format", "json", "--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(dir.path().join("json"));
    let mut proc = Proc::spawn("berth server", cmd);
    let lines = proc.take_stderr_lines();
    let listening = loop {
        let line = lines
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|e| panic!("no `listening` line ({e:?}):\n{}", proc.stderr()));
        let v = json_lines(&line).remove(0);
        if v["fields"]["message"] == "berth server listening" {
            break v;
        }
    };
    let fields = &listening["fields"];
    assert!(
        fields["url"]
            .as_str()
            .unwrap()
            .starts_with("https://127.0.0.1:"),
        "{listening}"
    );
    assert!(
        fields["ca_fingerprint"]
            .as_str()
            .unwrap()
            .starts_with("sha256:"),
        "{listening}"
    );
    assert_eq!(proc.terminate(), 0);
    let log = proc.raw_stderr();
    let events = json_lines(&log);
    assert!(
        events
            .iter()
            .any(|v| v["fields"]["message"] == "berth server stopped"),
        "{log}"
    );
    assert!(
        !log.contains("bat_"),
        "the admin token reached the log: {log}"
    );

    // The agent, from its config file; with no identity it stops at once and says why.
    let file = dir.path().join("agent.toml");
    write(&file, "log_format = \"json\"\n");
    let mut cmd = command(BERTH_AGENT);
    cmd.arg("--config")
        .arg(&file)
        .arg("--state-dir")
        .arg(dir.path().join("no-identity"));
    let (code, _, stderr) = run(cmd);
    assert_ne!(code, 0, "{stderr}");
    let events = json_lines(&stderr);
    assert!(
        events
            .iter()
            .any(|v| v["level"] == "ERROR" && v["fields"]["message"] == "agent stopped"),
        "{stderr}"
    );
}
