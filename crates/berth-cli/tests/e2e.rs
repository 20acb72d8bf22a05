//! End-to-end tests with real processes: `berth server` on `127.0.0.1:0` with a temp data dir,
//! `berth-agent` with temp state dirs, and the admin CLI with `--output json`.
//!
//! Every process is owned by a [`Proc`] guard that kills and reaps it on every path (and the
//! kernel kills it if the test thread dies first). Waits poll a condition up to a generous
//! deadline, so the tests pass on a loaded 2-core machine and still finish fast when things work.

#![cfg(unix)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;
use time::OffsetDateTime;

// ---------------------------------------------------------------------------------------------
// What only these tests need of the harness in `common`
// ---------------------------------------------------------------------------------------------

/// `berth agents list` and liveness by name, and a checked SIGTERM.
impl Server {
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

    /// Waits until an agent named `name` is listed `online` with a heartbeat (registration alone
    /// shows `registered`), and returns it.
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

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .permissions()
        .mode()
        & 0o777
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
    let token = server.registration_token_with(&["--labels", "role=web", "--env", "staging"]);
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
    assert_eq!(identity_agent_id(&state).as_deref(), Some(id.as_str()));

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
    // The token line follows the address the harness waited for: wait for it too.
    let announced = format!(
        "admin token (shown once; also in {}): {}",
        data.join("admin.token").display(),
        server.admin_token
    );
    berth_test_utils::wait_for(SETTLE, "the admin token line", || {
        let stderr = server.proc.stderr();
        if stderr.contains(&announced) {
            Ok(())
        } else {
            Err(stderr)
        }
    });
    let fingerprint = server.ca_fingerprint.clone();
    let admin_token = server.admin_token.clone();

    let token = server.registration_token_with(&[]);
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
        "sealing.key",
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
    let token = server.registration_token_with(&[]);
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
    let token = server.registration_token_with(&[]);
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
        &server.registration_token_with(&[]),
        &state,
        "lonely-1",
        &[],
    );
    server.wait_online_by_name("lonely-1");
    assert_eq!(agent.terminate(), 0, "{}", agent.stderr());

    // Running with a stored identity.
    let nowhere = format!("https://127.0.0.1:{}", free_port());
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
        &server.registration_token_with(&[]),
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
    let nowhere = format!("https://127.0.0.1:{}", free_port());
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
    let token = server.registration_token_with(&[]);
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
    let token = server.registration_token_with(&[]);
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
        &server.registration_token_with(&[]),
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
            let a = server.try_agent(&id)?;
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
            server.registration_token_with(&["--labels", "role=web,zone=z1", "--env", "staging"]);
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

// ---------------------------------------------------------------------------------------------
// berth dev
// ---------------------------------------------------------------------------------------------

/// The value after `prefix` on the first line of `text` that has it (leading spaces ignored).
fn printed<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.trim_start().strip_prefix(prefix))
        .map(str::trim)
}

/// Live processes whose command line names `path`, read from /proc.
fn processes_naming(path: &Path) -> Vec<libc::pid_t> {
    let needle = path.as_os_str().as_encoded_bytes();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<libc::pid_t>().ok())
        .filter(|pid| {
            let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
                return false;
            };
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let zombie = state
                .rfind(')')
                .is_some_and(|i| state[i + 1..].trim_start().starts_with(['Z', 'X']));
            !zombie && cmdline.windows(needle.len()).any(|w| w == needle)
        })
        .collect()
}

#[test]
fn berth_dev_starts_a_server_and_an_agent_that_runs_a_task() {
    let tmp = tempdir();
    let data = tmp.path().join("dev");
    let mut cmd = command(BERTH);
    cmd.arg("dev")
        .arg("--data-dir")
        .arg(&data)
        .args(["--listen", "127.0.0.1:0", "--heartbeat-interval-secs", "1"])
        // As for the harness's agents: no engine, so a slow engine cannot make it degraded.
        .env("DOCKER_HOST", "unix:///nonexistent/berth-e2e/docker.sock");
    let mut proc = Proc::spawn("berth dev", cmd);

    // What it prints for the operator: the URL, the admin token and the CA file to use.
    let (url, admin_token, ca_fingerprint, ca_file) = wait_for(
        SETTLE,
        "berth dev to print its URL, admin token and CA file",
        || {
            proc.assert_running();
            let out = proc.stdout();
            match (
                printed(&out, "export BERTH_SERVER="),
                printed(&out, "export BERTH_TOKEN="),
                printed(&out, "CA fingerprint:"),
                printed(&out, "export BERTH_CA_FILE="),
            ) {
                (Some(url), Some(token), Some(fingerprint), Some(ca)) => Ok((
                    url.to_string(),
                    token.to_string(),
                    fingerprint.to_string(),
                    std::path::PathBuf::from(ca),
                )),
                _ => Err(out),
            }
        },
    );
    let stdout = proc.stdout();
    assert!(url.starts_with("https://127.0.0.1:"), "{stdout}");
    assert_eq!(printed(&stdout, "URL:"), Some(url.as_str()), "{stdout}");
    assert!(admin_token.starts_with("bat_"), "{stdout}");
    assert!(ca_file.is_file(), "{stdout}");
    assert!(
        ca_file.starts_with(&data),
        "the CA is kept in the data dir: {stdout}"
    );
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    // The harness's CLI helpers read the CA from `<data_dir>/ca.crt`.
    let dev = Server {
        proc,
        url,
        ca_fingerprint,
        data_dir: ca_file.parent().unwrap().to_path_buf(),
        admin_token,
    };

    // Its local agent comes online with a heartbeat, labelled as the dev agent.
    let agent = wait_for(SETTLE, "the local agent online with a heartbeat", || {
        let agents = dev.try_agents(&[])?;
        match agents.as_slice() {
            [a] if a["status"] == "online" && a["lastHeartbeat"].is_string() => Ok(a.clone()),
            _ => Err(Value::Array(agents).to_string()),
        }
    });
    assert_eq!(agent["labels"]["berth.dev"], "true", "{agent}");
    let agent_id = id_of(&agent);

    // A task runs on it and succeeds with a verified, signed result.
    let task = dev.cli(&[
        "task",
        "create",
        "--type",
        "inspect",
        "--agent",
        &agent_id,
        "--payload",
        "{}",
        "--timeout-secs",
        "60",
        "--wait",
    ]);
    assert_eq!(task["state"], "succeeded", "{task:#}");
    assert_eq!(task["agentId"], agent_id.as_str(), "{task:#}");
    assert_eq!(task["readBack"], false, "{task:#}");
    let attempts = task["attempts"].as_array().expect("attempts");
    assert_eq!(attempts.len(), 1, "{task:#}");
    assert_eq!(attempts[0]["state"], "succeeded", "{task:#}");
    let envelope = &attempts[0]["result"];
    assert!(
        envelope["signature"]
            .as_str()
            .is_some_and(|s| !s.is_empty()),
        "the stored envelope is signed: {task:#}"
    );
    assert_eq!(envelope["taskId"], task["id"], "{task:#}");
    assert_eq!(envelope["agentId"], agent_id.as_str(), "{task:#}");
    assert_eq!(task["result"]["success"], true, "{task:#}");

    // SIGTERM stops the server and the agent: exit 0, nothing left behind, the port closed.
    let mut proc = dev.proc;
    assert_eq!(
        processes_naming(&data),
        vec![proc.pid()],
        "berth dev is the one process running on its data dir"
    );
    let code = proc.terminate();
    let stderr = proc.stderr();
    assert_eq!(code, 0, "berth dev exit code on SIGTERM:\n{stderr}");
    assert!(
        !stderr.contains("the agent stopped"),
        "the agent failed on shutdown:\n{stderr}"
    );
    assert_eq!(
        processes_naming(&data),
        Vec::<libc::pid_t>::new(),
        "berth dev left processes behind"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} still accepts connections after berth dev exited"
    );
}

/// `--allow-hook` (or `BERTH_AGENT_ALLOW_HOOKS`) takes absolute, clean paths only: anything else
/// is a configuration error (78), never a name looked up in `PATH`.
#[test]
fn agent_with_a_relative_allow_hook_exits_78() {
    let tmp = tempdir();
    let state = tmp.path().join("agent");
    let server = "https://127.0.0.1:9";
    let mut flag = Proc::spawn(
        "berth-agent --allow-hook sh",
        agent_command(&state, &["--server", server, "--allow-hook", "sh"]),
    );
    assert_eq!(flag.wait_code(EXIT), 78, "{}", flag.stderr());
    assert!(
        flag.stderr().contains("--allow-hook sh"),
        "{}",
        flag.stderr()
    );

    let mut cmd = agent_command(&state, &["--server", server]);
    cmd.env("BERTH_AGENT_ALLOW_HOOKS", "/bin/true,/usr/bin/../bin/sh");
    let mut env = Proc::spawn("berth-agent BERTH_AGENT_ALLOW_HOOKS", cmd);
    assert_eq!(env.wait_code(EXIT), 78, "{}", env.stderr());
    assert!(
        env.stderr().contains("/usr/bin/../bin/sh"),
        "{}",
        env.stderr()
    );
}

/// `berth task create --wait` follows the task's events instead of polling: while it waits, the
/// server counts its open event stream, and it returns when the task settles.
#[test]
fn task_create_wait_follows_the_event_stream() {
    let tmp = tempdir();
    let server = Server::start(&tmp.path().join("data"), &[]);
    let mut agent = Agent::register(&server, tmp.path(), "waited-on", &[]);
    // Its task stays pending: nothing polls for it.
    agent.proc.kill9();

    let mut cmd = command(BERTH);
    cmd.args([
        "task",
        "create",
        "--type",
        "health-check",
        "--agent",
        &agent.id,
        "--payload",
        r#"{"type": "tcp", "host": "127.0.0.1", "port": 1}"#,
        "--wait",
        "--output",
        "json",
    ])
    .env("BERTH_SERVER", &server.url)
    .env("BERTH_TOKEN", &server.admin_token)
    .env("BERTH_CA_FILE", server.data_dir.join("ca.crt"));
    let waiting = Proc::spawn("berth task create --wait", cmd);

    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let api = server.api();
    wait_for(SETTLE, "the CLI's event stream open", || {
        let metrics = runtime
            .block_on(api.get_text("/metrics"))
            .map_err(|e| e.to_string())?;
        match metrics
            .lines()
            .find(|l| l.starts_with("berth_event_streams_open "))
        {
            Some(line) if line.ends_with(" 1") => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    let task = wait_for(SETTLE, "the task listed", || {
        match server.tasks(&["--agent", &agent.id]).as_slice() {
            [task] => Ok(task.clone()),
            other => Err(format!("{other:?}")),
        }
    });
    assert_eq!(task["state"], "pending", "{task}");
    server.cli(&["task", "cancel", task["id"].as_str().expect("id")]);

    let out = waiting.finish(EXIT);
    assert!(out.status.success(), "{}", out.stderr);
    let waited: Value = serde_json::from_str(&out.stdout).expect("JSON");
    assert_eq!(waited["id"], task["id"], "{waited}");
    assert_eq!(waited["state"], "cancelled", "{waited}");
}
