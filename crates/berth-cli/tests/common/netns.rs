//! A network namespace joined to the host by a veth pair on a private /30, for partition tests:
//! an agent runs inside it (`ip netns exec`), the server listens on the host end, and the test
//! cuts and heals the link by taking the host end down and up.
//!
//! Cutting the host end is a black hole for the agent: its own interface stays up, its packets
//! vanish, new connections time out, and established TCP connections are not reset, so both
//! sides see a real partition rather than a closed socket. The host end's address stays local
//! to the host, so the test's admin CLI keeps reaching the server while the agent cannot.
//!
//! Namespaces are named `berth-e2e-<pid>-<n>`; the host end is `brt<n>h`, and `n` also picks the
//! subnet inside 10.203.0.0/16. Interface names are unique on the host, so creating the veth
//! pair is what claims `n`: a concurrent test that picked the same `n` fails there and tries
//! another. Dropping the guard deletes the namespace, which removes the pair; namespaces left by
//! a dead test process (its pid gone) are deleted at the next creation.

use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::process::{Command, Stdio};

const PREFIX: &str = "berth-e2e-";
/// /30 subnets in 10.203.0.0/16.
const SUBNETS: u32 = 1 << 14;

/// Runs `ip args…`; the error names the command and carries its stderr.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Deletes the `berth-e2e-<pid>-<n>` namespaces whose process is gone.
fn remove_leftovers() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "name" or "name (id: N)"
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

pub struct Netns {
    pub name: String,
    host_if: String,
    ns_if: String,
    /// The host end: where the server listens for the agent.
    pub host_ip: Ipv4Addr,
    /// The namespace end.
    pub ns_ip: Ipv4Addr,
}

impl Netns {
    /// A fresh namespace linked to the host, or `None` (SKIP) when namespaces cannot be made
    /// here; a failure instead when services are required (`CI=true`, `BERTH_REQUIRE_SERVICES=1`).
    pub fn create(test: &str) -> Option<Netns> {
        match Netns::try_create() {
            Ok(ns) => Some(ns),
            Err(why) => berth_test_utils::require_service(
                test,
                &format!("cannot create a network namespace (root and iproute2 needed): {why}"),
            ),
        }
    }

    fn try_create() -> Result<Netns, String> {
        remove_leftovers();
        let start = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish() as u32;
        let mut last = String::new();
        for k in 0..8 {
            let n = start.wrapping_add(k) % SUBNETS;
            let name = format!("{PREFIX}{}-{n}", std::process::id());
            let base = u32::from(Ipv4Addr::new(10, 203, 0, 0)) + n * 4;
            let ns = Netns {
                host_if: format!("brt{n}h"),
                ns_if: format!("brt{n}n"),
                host_ip: Ipv4Addr::from(base + 1),
                ns_ip: Ipv4Addr::from(base + 2),
                name,
            };
            ip(&["netns", "add", &ns.name])?;
            // From here on the guard deletes the namespace (and the pair with it) on every path.
            match ns.link() {
                Ok(()) => return Ok(ns),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn link(&self) -> Result<(), String> {
        let host_cidr = format!("{}/30", self.host_ip);
        let ns_cidr = format!("{}/30", self.ns_ip);
        let name = self.name.as_str();
        ip(&[
            "link",
            "add",
            &self.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &self.ns_if,
            "netns",
            name,
        ])?;
        ip(&["addr", "add", &host_cidr, "dev", &self.host_if])?;
        ip(&["link", "set", &self.host_if, "up"])?;
        ip(&["-n", name, "addr", "add", &ns_cidr, "dev", &self.ns_if])?;
        ip(&["-n", name, "link", "set", &self.ns_if, "up"])?;
        ip(&["-n", name, "link", "set", "lo", "up"])
    }

    /// Cuts the link: the host end goes down.
    pub fn cut(&self) {
        ip(&["link", "set", &self.host_if, "down"]).unwrap_or_else(|e| panic!("{e}"));
    }

    /// Heals the link: the host end comes back up, with its address and route.
    pub fn heal(&self) {
        ip(&["link", "set", &self.host_if, "up"]).unwrap_or_else(|e| panic!("{e}"));
    }

    /// `program` run inside the namespace, with the harness's scrubbed environment. `ip netns
    /// exec` execs it, so the child's pid is the program's own.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = super::command("ip");
        cmd.args(["netns", "exec", &self.name, program]);
        cmd
    }

    /// A listener on `127.0.0.1:0` inside the namespace, served from any thread of the test:
    /// a socket belongs to the namespace it was created in.
    pub fn listen_loopback(&self) -> TcpListener {
        let path = format!("/run/netns/{}", self.name);
        std::thread::spawn(move || {
            let ns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
            // SAFETY: setns on this short-lived thread only, with a namespace fd we own.
            let rc = unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) };
            assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
            TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).expect("binding")
        })
        .join()
        .expect("the setns thread")
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Err(e) = ip(&["netns", "del", &self.name]) {
            eprintln!("cleanup: {e}");
        }
    }
}
