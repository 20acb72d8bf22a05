//! Issue 16 item 1: adding a host is one command. Inside a network namespace that reaches only
//! the server, with no berth binary on its PATH, the line `berth token create` prints checks the
//! server's CA against its fingerprint, runs `/install.sh`, which downloads the agent (its
//! sha256 checked), installs it with the packaged unit below a fresh root, registers with the
//! one-time token and starts it: the agent comes online with the token's labels. Running the
//! line again is harmless (the same identity; the used token is not sent again). A line whose
//! fingerprint is not the server's CA installs nothing.

#![cfg(unix)]

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::netns::Netns;
use common::*;

/// The agent the script started in the background (its pid file): killed when the test ends.
struct Started(PathBuf);

impl Started {
    fn pid(&self) -> i32 {
        std::fs::read_to_string(&self.0)
            .ok()
            .and_then(|pid| pid.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        let pid = self.pid();
        if pid > 0 {
            // SAFETY: a plain syscall; the pid is the agent this test's script started.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    pid > 0 && unsafe { libc::kill(pid, 0) } == 0
}

/// `sh -c LINE` inside the namespace as a fresh host would run it: a bare PATH, nothing of
/// berth on it, installing below `root`. The exit code, and stdout and stderr together.
fn run_line(ns: &Netns, line: &str, root: &Path) -> (i32, String) {
    let mut cmd = ns.command("sh");
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .env("BERTH_INSTALL_ROOT", root)
        // The agent the script starts inherits these: no Docker (not what this is about) and
        // the harness's short stop.
        .env("DOCKER_HOST", "unix:///nonexistent/berth-e2e/docker.sock")
        .env("BERTH_AGENT_SHUTDOWN_GRACE_SECS", "10")
        .args(["-c", line]);
    let out = cmd.output().expect("running sh in the namespace");
    (
        out.status.code().expect("sh exited"),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn the_install_line_installs_registers_and_starts_an_agent_and_can_run_again() {
    let Some(ns) = Netns::create("install_e2e") else {
        return;
    };
    let tmp = tempdir();
    // The server offers a stripped copy of this build's agent (the debug binary is ~350 MB).
    let downloads = tmp.path().join("downloads");
    std::fs::create_dir(&downloads).unwrap();
    let offered = downloads.join(format!("berth-agent-linux-{}", std::env::consts::ARCH));
    let stripped = Command::new("strip")
        .arg("-o")
        .arg(&offered)
        .arg(BERTH_AGENT)
        .status()
        .expect("strip");
    assert!(stripped.success());

    let host = ns.host_ip.to_string();
    let listen = format!("{host}:{}", free_port());
    let downloads_arg = downloads.display().to_string();
    let server = Server::start_at(
        &tmp.path().join("data"),
        &listen,
        &[
            "--hostname",
            &host,
            "--heartbeat-interval-secs",
            "1",
            "--agent-downloads",
            &downloads_arg,
        ],
        None,
    );
    let created = server.cli(&["token", "create", "--labels", "via=install"]);
    let line = created["installCommand"].as_str().unwrap().to_string();
    assert!(
        line.contains(&format!("'https://{listen}/ca.crt'")),
        "{line}"
    );
    let token = created["token"].as_str().unwrap();
    assert!(
        !line.contains(&format!("--token {token}")),
        "the token is an argument: {line}"
    );

    let root = tmp.path().join("host");
    let (code, _) = run_line(&ns, "command -v berth-agent || command -v berth", &root);
    assert_ne!(code, 0, "a berth binary is on the namespace's PATH");

    let state = root.join("var/lib/berth-agent");
    let started = Started(state.join("agent.pid"));
    let (code, log) = run_line(&ns, &line, &root);
    assert_eq!(code, 0, "the install line failed:\n{log}");
    let bin = root.join("usr/local/bin/berth-agent");
    assert!(
        std::fs::read(&bin).unwrap() == std::fs::read(&offered).unwrap(),
        "the installed binary is not the one offered"
    );
    assert_eq!(
        std::fs::metadata(&bin).unwrap().permissions().mode() & 0o777,
        0o755
    );
    assert_eq!(
        std::fs::metadata(&state).unwrap().permissions().mode() & 0o777,
        0o700
    );
    let unit = std::fs::read_to_string(root.join("etc/systemd/system/berth-agent.service"))
        .expect("the unit");
    assert!(
        unit.contains("ExecStart=/usr/local/bin/berth-agent $BERTH_AGENT_OPTS"),
        "{unit}"
    );
    assert!(unit.contains("ProtectSystem=strict"), "{unit}");

    let id = identity_agent_id(&state).expect("registered");
    let online = |what: &str| {
        server.wait_agent(&id, what, |a| {
            matches!(a["status"].as_str(), Some("online" | "degraded"))
                && a["lastHeartbeat"].is_string()
        })
    };
    let agent = online("the installed agent online");
    assert_eq!(agent["labels"]["via"], "install", "{agent}");
    let first = started.pid();
    assert!(alive(first));

    // Again: the identity stays, the used token is not sent, the agent restarts.
    let (code, log) = run_line(&ns, &line, &root);
    assert_eq!(code, 0, "running the line again failed:\n{log}");
    assert!(log.contains("already registered"), "{log}");
    assert_eq!(identity_agent_id(&state).as_deref(), Some(id.as_str()));
    let second = started.pid();
    assert_ne!(second, first, "{log}");
    assert!(!alive(first), "the old agent process still runs");
    let agents = server.cli(&["agents", "list"]);
    assert_eq!(agents.as_array().map(Vec::len), Some(1), "{agents}");
    wait_for(
        Duration::from_secs(30),
        "the restarted agent online",
        || {
            let a = server.try_agent(&id)?;
            (a["status"] == "online" && alive(second))
                .then_some(())
                .ok_or_else(|| format!("{a}"))
        },
    );

    // A line whose fingerprint is not this server's CA installs nothing.
    let fingerprint = created["caFingerprint"].as_str().unwrap();
    let hex = fingerprint.strip_prefix("sha256:").unwrap();
    let forged = line.replace(hex, &"0".repeat(64));
    let elsewhere = tmp.path().join("elsewhere");
    let (code, log) = run_line(&ns, &forged, &elsewhere);
    assert_ne!(code, 0, "{log}");
    assert!(log.contains("does not match the fingerprint"), "{log}");
    assert!(!elsewhere.exists(), "something was installed: {log}");

    // A platform the server has no binary for: a stable code naming those it has.
    let out = Command::new("curl")
        .args(["-sS", "--cacert"])
        .arg(tmp.path().join("data/ca.crt"))
        .arg(format!("{}/downloads/berth-agent/plan9-mips", server.url))
        .output()
        .expect("curl");
    let refused: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(refused["code"], "NO_AGENT_DOWNLOAD", "{refused}");
    assert!(
        refused["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("linux-{}", std::env::consts::ARCH)),
        "{refused}"
    );
}
