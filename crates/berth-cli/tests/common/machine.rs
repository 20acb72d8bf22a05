//! A throwaway host with a real systemd as PID 1, for tests of what runs under systemd (the
//! install script's systemd branch): `systemd-nspawn --boot` (Debian's `systemd-container`) of
//! this machine's own root, read-only below a tmpfs overlay (`--volatile=overlay`), so whatever
//! a test installs (binaries, units, users) lands in the overlay and vanishes with the machine.
//! It joins a [`Netns`], so it reaches the server on the namespace's host end and nothing else.
//!
//! It boots `sysinit.target` only (journald, tmpfiles, sysusers), not the host's default target:
//! none of the host's own services (Docker, PostgreSQL, timers) start inside it; units the test
//! starts pull in what they need.
//!
//! Nothing is left on the host. nspawn runs in a mount namespace of its own (`unshare`) whose
//! /run and /tmp are fresh tmpfs (nspawn's lock, propagation and overlay scratch dirs go there),
//! with / bind-mounted read-only at /run/berth-root (nspawn refuses `--directory=/` itself). It
//! runs in a cgroup of the test's (`berth-e2e-<pid>-<n>-machine`, beside each hierarchy's cgroup
//! of this process), so that everything in the machine can be found and killed: dropping the
//! guard powers the machine off (SIGTERM to nspawn), kills what is left through `cgroup.kill`
//! (nspawn's own death does not end the machine), and removes the cgroups. A test process that
//! dies without its guard sends nspawn SIGTERM (its parent-death signal), which powers the machine
//! off; the empty cgroups it leaves (its pid gone) are removed at the next boot.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::netns::Netns;
use super::{live_children, Proc};

const PREFIX: &str = "berth-e2e-";
const SUFFIX: &str = "-machine";
/// A bare PATH, as on a fresh host.
const PATH: &str = "/usr/sbin:/usr/bin:/sbin:/bin";

/// Runs in the mount namespace `unshare` made: `$1` the network namespace, `$2` the machine's
/// name, the rest the cgroups to run in. Every word reaches nspawn as an argument, none through
/// the shell's parsing.
const BOOT: &str = r#"set -eu
netns=$1 name=$2
shift 2
for cgroup in "$@"; do echo $$ >"$cgroup/cgroup.procs"; done
exec 3<"$netns"
mount -n -t tmpfs -o mode=0755 tmpfs /run
mount -n -t tmpfs -o mode=1777 tmpfs /tmp
mkdir /run/berth-root
mount -n --bind / /run/berth-root
mount -n -o remount,bind,ro /run/berth-root
# If the test dies without its guard, nspawn is told to power the machine off: nspawn's own death
# would leave the machine running.
exec setpriv --pdeathsig SIGTERM systemd-nspawn --quiet --directory=/run/berth-root --volatile=overlay \
    --register=no --keep-unit --network-namespace-path=/proc/self/fd/3 \
    --machine="$name" --boot systemd.unit=sysinit.target \
    systemd.mask=docker.socket systemd.mask=docker.service systemd.mask=containerd.service
"#;

/// A cgroup hierarchy this process is in: the directory of its own cgroup there, and whether it
/// is cgroup v2 (which has `cgroup.kill`).
struct Hierarchy {
    own: PathBuf,
    v2: bool,
}

/// The cgroup2 hierarchy and the named `systemd` v1 one (hybrid hosts), as mounted here.
fn hierarchies() -> Result<Vec<Hierarchy>, String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    let membership = std::fs::read_to_string("/proc/self/cgroup")
        .map_err(|e| format!("/proc/self/cgroup: {e}"))?;
    let own_path = |v2: bool| {
        membership.lines().find_map(|line| {
            // "0::/path" (v2) or "N:name=systemd:/path" (v1)
            let mut parts = line.splitn(3, ':');
            let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
            let wanted = if v2 { "" } else { "name=systemd" };
            (controllers == wanted).then(|| path.to_string())
        })
    };
    let mut found: Vec<Hierarchy> = Vec::new();
    for line in mountinfo.lines() {
        // "id parent major:minor root mountpoint options … - fstype source superoptions"
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(mountpoint), Some(fstype)) =
            (left.get(3), left.get(4), right.first())
        else {
            continue;
        };
        let v2 = match *fstype {
            "cgroup2" => true,
            "cgroup"
                if right
                    .get(2)
                    .is_some_and(|o| o.split(',').any(|o| o == "name=systemd")) =>
            {
                false
            }
            _ => continue,
        };
        if found.iter().any(|h| h.v2 == v2) {
            continue;
        }
        let Some(path) = own_path(v2) else { continue };
        // Below a cgroup namespace the mount's root is a prefix of the path.
        let relative = path.strip_prefix(root).unwrap_or(&path);
        found.push(Hierarchy {
            own: Path::new(mountpoint).join(relative.trim_start_matches('/')),
            v2,
        });
    }
    if !found.iter().any(|h| h.v2) {
        return Err("no cgroup2 hierarchy is mounted (its cgroup.kill ends the machine)".into());
    }
    Ok(found)
}

/// Kills every process in the cgroup tree `dir` (v2) and removes it, deepest first. Best effort,
/// for a guard: returns what went wrong.
fn kill_and_remove(dir: &Path, v2: bool) -> Result<(), String> {
    if !dir.exists() {
        return Ok(());
    }
    if v2 {
        let _ = std::fs::write(dir.join("cgroup.kill"), "1");
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::fs::read_to_string(dir.join("cgroup.events"))
            .is_ok_and(|events| events.lines().any(|l| l == "populated 1"))
        {
            if Instant::now() > deadline {
                return Err(format!("{}: processes are left", dir.display()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    remove_tree(dir)
}

fn remove_tree(dir: &Path) -> Result<(), String> {
    // cgroupfs directories hold only control files (removed with the directory) and children.
    for entry in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
        if entry.file_type().is_ok_and(|t| t.is_dir()) {
            remove_tree(&entry.path())?;
        }
    }
    // A v1 cgroup empties when its last process is reaped, which may lag a little.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if Instant::now() > deadline => {
                return Err(format!("removing {}: {e}", dir.display()))
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

/// Removes the `berth-e2e-<pid>-…-machine` cgroups whose process is gone.
fn remove_leftovers(hierarchies: &[Hierarchy]) {
    // v2 first: its cgroup.kill ends the processes the v1 cgroups hold too.
    let mut ordered: Vec<&Hierarchy> = hierarchies.iter().collect();
    ordered.sort_by_key(|h| !h.v2);
    for h in ordered {
        let Ok(entries) = std::fs::read_dir(&h.own) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_suffix(SUFFIX)
                .and_then(|rest| rest.strip_prefix(PREFIX))
                .and_then(|rest| rest.split('-').next())
            else {
                continue;
            };
            if !Path::new(&format!("/proc/{pid}")).exists() {
                if let Err(e) = kill_and_remove(&entry.path(), h.v2) {
                    eprintln!("cleanup of a leftover machine: {e}");
                }
            }
        }
    }
}

pub struct Machine {
    nspawn: Option<Proc>,
    /// The machine's PID 1 (systemd), as the host numbers it.
    pub pid1: libc::pid_t,
    /// The machine's cgroups, v2 first.
    cgroups: Vec<(PathBuf, bool)>,
}

impl Machine {
    /// A booted machine in `ns`, or `None` (SKIP) when none can be booted here; a failure instead
    /// when services are required (`CI=true`, `BERTH_REQUIRE_SERVICES=1`).
    pub fn boot(test: &str, ns: &Netns) -> Option<Machine> {
        match Machine::try_boot(ns) {
            Ok(machine) => Some(machine),
            Err(why) => berth_test_utils::require_service(
                test,
                &format!(
                    "cannot boot systemd in a container (root, cgroup2 and systemd-nspawn from \
                     Debian's systemd-container needed): {why}"
                ),
            ),
        }
    }

    fn try_boot(ns: &Netns) -> Result<Machine, String> {
        for program in ["systemd-nspawn", "unshare", "nsenter", "setpriv"] {
            let found = Command::new("sh")
                .args(["-c", "command -v \"$1\"", "sh", program])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !found {
                return Err(format!("{program} is not installed"));
            }
        }
        if !Path::new("/run/netns").join(&ns.name).exists() {
            return Err(format!("/run/netns/{} is missing", ns.name));
        }
        let hierarchies = hierarchies()?;
        remove_leftovers(&hierarchies);
        // From here on the guard removes whatever exists of the machine on every path.
        let mut machine = Machine {
            nspawn: None,
            pid1: 0,
            cgroups: Vec::new(),
        };
        let cgroup = format!("{}{SUFFIX}", ns.name);
        debug_assert!(cgroup.starts_with(PREFIX));
        let mut ordered: Vec<&Hierarchy> = hierarchies.iter().collect();
        ordered.sort_by_key(|h| !h.v2);
        for h in ordered {
            let dir = h.own.join(&cgroup);
            std::fs::create_dir(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
            machine.cgroups.push((dir, h.v2));
        }

        let mut cmd = Command::new("unshare");
        cmd.env_clear()
            .env("PATH", PATH)
            .current_dir("/")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                BOOT,
                "sh",
            ])
            .arg(Path::new("/run/netns").join(&ns.name))
            .arg(&ns.name)
            .args(machine.cgroups.iter().map(|(dir, _)| dir));
        let nspawn = machine.nspawn.insert(Proc::spawn("systemd-nspawn", cmd));
        let pid = nspawn.pid();

        let deadline = Instant::now() + Duration::from_secs(60);
        machine.pid1 = loop {
            if let Some(status) = nspawn.try_status() {
                return Err(format!(
                    "systemd-nspawn exited ({status}):\n{}\n{}",
                    nspawn.stdout(),
                    nspawn.stderr()
                ));
            }
            if let Some(&pid1) = live_children(pid, "systemd").first() {
                break pid1;
            }
            if Instant::now() > deadline {
                return Err(format!("no systemd under nspawn:\n{}", nspawn.stderr()));
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        // Waits for the boot transaction: "running", or "degraded" if some unit of the host's
        // failed in here. Until systemd has made /run/systemd/system, systemctl says "offline";
        // until it listens on its socket, it cannot connect.
        loop {
            let (code, state) = machine.sh("timeout 120 systemctl is-system-running --wait");
            match state.trim() {
                "running" | "degraded" => return Ok(machine),
                state
                    if (state == "offline" || state.contains("Failed to connect"))
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100))
                }
                state => return Err(format!("the machine did not boot ({code}: {state})")),
            }
        }
    }

    /// `program` run inside the machine (all of its namespaces) as root, with a bare
    /// environment: only `PATH`.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.env_clear()
            .env("PATH", PATH)
            .arg(format!("--target={}", self.pid1))
            .args(["--all", "--", "env", "-i"])
            .arg(format!("PATH={PATH}"))
            .arg(program)
            .stdin(Stdio::null());
        cmd
    }

    /// `sh -c script` inside the machine: the exit code, and stdout and stderr together.
    pub fn sh(&self, script: &str) -> (i32, String) {
        let out = self
            .command("sh")
            .args(["-c", script])
            .output()
            .expect("running sh in the machine");
        (
            out.status.code().unwrap_or(-1),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }

    /// The machine's root directory as the host sees it (`/proc/<pid1>/root`).
    pub fn root(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root", self.pid1))
    }

    /// The `systemctl show` properties of `unit`, `name=value` each.
    pub fn show(&self, unit: &str) -> std::collections::HashMap<String, String> {
        let out = self
            .command("systemctl")
            .args(["show", "--", unit])
            .output()
            .expect("systemctl show");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

impl Drop for Machine {
    fn drop(&mut self) {
        if std::thread::panicking() && self.pid1 > 0 {
            let (_, journal) = self.sh("timeout 10 journalctl --no-pager -n 200");
            eprintln!("----- the machine's journal -----\n{journal}");
        }
        if let Some(nspawn) = self.nspawn.as_mut() {
            // SIGTERM: nspawn asks the machine's systemd to power off (SIGRTMIN+3).
            if nspawn.try_status().is_none() {
                // SAFETY: a plain syscall on our own, not yet reaped, child.
                unsafe { libc::kill(nspawn.pid(), libc::SIGTERM) };
                let deadline = Instant::now() + Duration::from_secs(20);
                while nspawn.try_status().is_none() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
        // Kills and reaps nspawn if it did not exit.
        drop(self.nspawn.take());
        for (dir, v2) in &self.cgroups {
            if let Err(e) = kill_and_remove(dir, *v2) {
                eprintln!("cleanup: {e}");
            }
        }
    }
}
