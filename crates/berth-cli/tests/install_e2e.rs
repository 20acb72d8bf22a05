//! Issue 16 item 1: adding a host is one command. Inside a network namespace that reaches only
//! the server, with no berth binary on its PATH, the line `berth token create` prints checks the
//! server's CA against its fingerprint, runs `/install.sh`, which downloads the agent (its
//! sha256 checked), installs it with the packaged unit below a fresh root, registers with the
//! one-time token and starts it: the agent comes online with the token's labels. Running the
//! line again is harmless (the same identity; the used token is not sent again). A line whose
//! fingerprint is not the server's CA installs nothing.
//!
//! The script's systemd branch runs in a booted systemd container in the same kind of namespace
//! ([`Machine`]), as root on a real host would run it: the berth-agent user, the hardened unit
//! enabled and running as that user, the agent online, and a second run restarting the unit.

#![cfg(unix)]

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::machine::Machine;
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

/// A server on the namespace's host end that offers a stripped copy of this build's agent (the
/// debug binary is ~350 MB), and that copy.
fn offering_server(ns: &Netns, tmp: &Path) -> (Server, PathBuf) {
    let downloads = tmp.join("downloads");
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
        &tmp.join("data"),
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
    (server, offered)
}

#[test]
fn the_install_line_installs_registers_and_starts_an_agent_and_can_run_again() {
    let Some(ns) = Netns::create("install_e2e") else {
        return;
    };
    let tmp = tempdir();
    let (server, offered) = offering_server(&ns, tmp.path());
    let created = server.cli(&["token", "create", "--labels", "via=install"]);
    let line = created["installCommand"].as_str().unwrap().to_string();
    assert!(line.contains(&format!("'{}/ca.crt'", server.url)), "{line}");
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

const UNDER_SYSTEMD: &str = "install_e2e::under_systemd";

/// What the host itself has where the script writes on a real host: the same after the test, so
/// it touched none of them.
fn host_paths() -> Vec<(&'static str, Option<Vec<u8>>, bool)> {
    [
        "/etc/passwd",
        "/etc/group",
        "/usr/local/bin/berth-agent",
        "/etc/systemd/system/berth-agent.service",
        "/etc/systemd/system/multi-user.target.wants/berth-agent.service",
        "/var/lib/berth-agent",
    ]
    .into_iter()
    .map(|p| (p, std::fs::read(p).ok(), Path::new(p).exists()))
    .collect()
}

/// The unit as systemd runs it: enabled, active (running), its main process the installed agent
/// as `uid`:`gid`, confined as the hardened unit says (systemd's settings, and the kernel's view of
/// the process). Returns the main pid (in the machine) and the unit's invocation id.
fn running_service(machine: &Machine, uid: u32, gid: u32) -> (u32, String) {
    let unit = machine.show("berth-agent.service");
    let prop = |k: &str| unit.get(k).map(String::as_str).unwrap_or_default();
    let summary = || {
        let (_, status) = machine.sh("systemctl status --no-pager --full berth-agent");
        status
    };
    assert_eq!(prop("UnitFileState"), "enabled", "{}", summary());
    assert_eq!(
        (prop("ActiveState"), prop("SubState")),
        ("active", "running"),
        "{}",
        summary()
    );
    assert!(summary().contains("active (running)"), "{}", summary());
    for (setting, value) in [
        ("User", "berth-agent"),
        ("Group", "berth-agent"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("PrivateDevices", "yes"),
        ("NoNewPrivileges", "yes"),
        ("RestrictNamespaces", "yes"),
        ("CapabilityBoundingSet", ""),
        ("UMask", "0077"),
    ] {
        assert_eq!(prop(setting), value, "{setting}");
    }
    assert!(
        prop("ExecStart").contains("argv[]=/usr/local/bin/berth-agent $BERTH_AGENT_OPTS ;"),
        "ExecStart={}",
        prop("ExecStart")
    );
    let pid: u32 = prop("MainPID").parse().unwrap();
    assert!(pid > 0, "{}", summary());

    // The kernel's view of the process: the machine's /proc, read from the host.
    let proc_dir = machine.root().join(format!("proc/{pid}"));
    let status = std::fs::read_to_string(proc_dir.join("status")).unwrap();
    for line in [
        format!("Uid:\t{uid}\t{uid}\t{uid}\t{uid}"),
        format!("Gid:\t{gid}\t{gid}\t{gid}\t{gid}"),
        "NoNewPrivs:\t1".to_string(),
        "CapEff:\t0000000000000000".to_string(),
        "CapBnd:\t0000000000000000".to_string(),
        "Seccomp:\t2".to_string(),
    ] {
        assert!(status.lines().any(|l| l == line), "no {line:?}:\n{status}");
    }
    let (_, exe) = machine.sh(&format!("readlink /proc/{pid}/exe"));
    assert_eq!(exe.trim(), "/usr/local/bin/berth-agent");
    // ProtectSystem=strict: / read-only for the agent, its state dir the one place it writes.
    let mountinfo = std::fs::read_to_string(proc_dir.join("mountinfo")).unwrap();
    let options = |mountpoint: &str| {
        mountinfo
            .lines()
            .rfind(|l| l.split(' ').nth(4) == Some(mountpoint))
            .and_then(|l| l.split(' ').nth(5))
            .unwrap_or_else(|| panic!("{mountpoint} is not mounted:\n{mountinfo}"))
            .split(',')
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    assert!(options("/").contains(&"ro".into()), "{mountinfo}");
    assert!(
        options("/var/lib/berth-agent").contains(&"rw".into()),
        "{mountinfo}"
    );
    (pid, prop("InvocationID").to_string())
}

/// On a host that runs systemd, as root, without BERTH_INSTALL_ROOT: the line creates the
/// berth-agent system user and installs, enables and starts the hardened unit; the agent runs as
/// that user, registers and comes online with the token's labels. Running it again restarts the
/// unit with the same identity. The host is a booted systemd container that reaches only the
/// server ([`Machine`]).
#[test]
fn under_systemd_the_install_line_runs_the_hardened_unit_as_berth_agent_and_can_run_again() {
    let Some(ns) = Netns::create(UNDER_SYSTEMD) else {
        return;
    };
    let tmp = tempdir();
    let (server, offered) = offering_server(&ns, tmp.path());
    let created = server.cli(&["token", "create", "--labels", "via=systemd"]);
    let line = created["installCommand"].as_str().unwrap().to_string();
    let host_before = host_paths();
    let Some(machine) = Machine::boot(UNDER_SYSTEMD, &ns) else {
        return;
    };

    // A fresh host that runs systemd: no berth on its PATH, no berth-agent user.
    let (code, out) = machine.sh(
        "[ -d /run/systemd/system ] && ! command -v berth-agent && ! command -v berth \
         && ! id berth-agent",
    );
    assert_eq!(code, 0, "not a fresh systemd host: {out}");

    let (code, log) = machine.sh(&line);
    assert_eq!(code, 0, "the install line failed:\n{log}");
    assert!(
        log.contains("berth-agent is running: systemctl status berth-agent"),
        "the script did not take its systemd branch:\n{log}"
    );
    let root = machine.root();
    let state = root.join("var/lib/berth-agent");
    assert!(!state.join("agent.pid").exists(), "started by nohup: {log}");
    assert!(
        std::fs::read(root.join("usr/local/bin/berth-agent")).unwrap()
            == std::fs::read(&offered).unwrap(),
        "the installed binary is not the one offered"
    );

    // The system user the unit runs as.
    let (code, passwd) = machine.sh("getent passwd berth-agent");
    assert_eq!(code, 0, "no berth-agent user: {passwd}");
    let fields: Vec<&str> = passwd.trim().split(':').collect();
    let (uid, gid): (u32, u32) = (fields[2].parse().unwrap(), fields[3].parse().unwrap());
    assert!(uid < 1000, "not a system user: {passwd}");
    assert_eq!(fields[5..], ["/var/lib/berth-agent", "/usr/sbin/nologin"]);

    let (first_pid, first_run) = running_service(&machine, uid, gid);

    let id = identity_agent_id(&state).expect("registered");
    let online = |what: &str| {
        server.wait_agent(&id, what, |a| {
            matches!(a["status"].as_str(), Some("online" | "degraded"))
                && a["lastHeartbeat"].is_string()
        })
    };
    let agent = online("the agent under systemd online");
    assert_eq!(agent["labels"]["via"], "systemd", "{agent}");

    // The state dir: the agent's alone, everything in it the agent's, its key private.
    let meta = std::fs::metadata(&state).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o700);
    assert_eq!((meta.uid(), meta.gid()), (uid, gid));
    for entry in std::fs::read_dir(&state).unwrap() {
        let path = entry.unwrap().path();
        assert_eq!(std::fs::metadata(&path).unwrap().uid(), uid, "{path:?}");
    }
    for private in ["agent.pem", "identity.json"] {
        let mode = std::fs::metadata(state.join(private))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{private}");
    }

    // Again: the identity stays, the used token is not sent, the unit restarts.
    let (code, log) = machine.sh(&line);
    assert_eq!(code, 0, "running the line again failed:\n{log}");
    assert!(log.contains("already registered"), "{log}");
    assert!(log.contains("berth-agent is running"), "{log}");
    assert_eq!(identity_agent_id(&state).as_deref(), Some(id.as_str()));
    let (second_pid, second_run) = running_service(&machine, uid, gid);
    assert_ne!(second_run, first_run, "the unit was not restarted");
    assert_ne!(second_pid, first_pid, "the unit was not restarted");
    let agents = server.cli(&["agents", "list"]);
    assert_eq!(agents.as_array().map(Vec::len), Some(1), "{agents}");
    let restarted_after = timestamp(&agent["lastHeartbeat"]);
    let again = server.wait_agent(&id, "the restarted agent online", |a| {
        a["status"] == "online"
            && a["lastHeartbeat"].is_string()
            && timestamp(&a["lastHeartbeat"]) > restarted_after
    });
    assert_eq!(again["labels"]["via"], "systemd", "{again}");

    drop(machine);
    assert_eq!(host_paths(), host_before, "the test changed the host");
}
