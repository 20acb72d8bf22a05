//! Fixtures shared by the test suites of the workspace. Used only as a dev-dependency.
//!
//! - [`services_required`] and [`require_service`]: the one rule for a missing service (a
//!   PostgreSQL URL, the Docker engine, the local registries, the sshd, OpenBao): a failure under `CI=true` or
//!   `BERTH_REQUIRE_SERVICES=1` (which `scripts/test.sh` sets), a `SKIP` line otherwise.
//! - [`wait_for`], [`try_wait_for`] and [`wait_until`]: polling a condition up to a deadline.
//! - [`id_of`] and [`str_of`]: fields of the CLI's JSON output.
//! - [`postgres`]: a throwaway database per test.
//! - [`deploy`]: `docker.run` payloads and health-check configs.
//! - [`ssh`]: the sshd of `scripts/sshd.sh` (`BERTH_TEST_SSH_*`) for the `ssh.deploy` tests.
//! - [`openbao`]: the OpenBao of `scripts/openbao.sh` (`BERTH_TEST_OPENBAO_*`) and seed 001's
//!   mounts, role and policy under unique names ([`openbao::SeedMounts`]).
//! - [`docker`] (feature `exec`): the registry/engine environment, test images, cleanup guards
//!   and executor helpers.

use std::future::Future;
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod deploy;
#[cfg(feature = "exec")]
pub mod docker;
pub mod openbao;
pub mod postgres;
pub mod ssh;
pub mod webhook;

// ---------------------------------------------------------------------------------------------
// Services
// ---------------------------------------------------------------------------------------------

/// Whether a missing service fails the test instead of skipping it: under `CI=true` or
/// `BERTH_REQUIRE_SERVICES=1` (set by `scripts/test.sh`, which provisions every service).
pub fn services_required() -> bool {
    services_required_by(|k| std::env::var(k).ok())
}

fn services_required_by(var: impl Fn(&str) -> Option<String>) -> bool {
    var("CI").as_deref() == Some("true") || var("BERTH_REQUIRE_SERVICES").as_deref() == Some("1")
}

/// `test` cannot run because a service is missing (`why`). Panics when services are required
/// ([`services_required`]); otherwise prints `SKIP test: why` and returns `None`, so a caller
/// writes `let Some(x) = found.or_else(|| require_service(test, why)) else { return };`.
pub fn require_service<T>(test: &str, why: &str) -> Option<T> {
    if services_required() {
        panic!("{test}: {why}; services are required here (CI=true or BERTH_REQUIRE_SERVICES=1)");
    }
    eprintln!("SKIP {test}: {why}");
    None
}

// ---------------------------------------------------------------------------------------------
// Waiting
// ---------------------------------------------------------------------------------------------

/// Polls `probe` (every 100 ms, backing off to 250 ms) until it returns `Ok`, or returns the
/// last `Err` at the deadline.
pub fn try_wait_for<T>(
    timeout: Duration,
    mut probe: impl FnMut() -> Result<T, String>,
) -> Result<T, String> {
    let started = Instant::now();
    let mut pause = Duration::from_millis(100);
    loop {
        match probe() {
            Ok(v) => return Ok(v),
            Err(last) => {
                if started.elapsed() >= timeout {
                    return Err(last);
                }
                std::thread::sleep(pause);
                pause = (pause + Duration::from_millis(50)).min(Duration::from_millis(250));
            }
        }
    }
}

/// Like [`try_wait_for`], but panics at the deadline with `what` and the last observation.
pub fn wait_for<T>(timeout: Duration, what: &str, probe: impl FnMut() -> Result<T, String>) -> T {
    try_wait_for(timeout, probe).unwrap_or_else(|last| {
        panic!("timed out after {timeout:?} waiting for {what}; last observation: {last}")
    })
}

/// Awaits `check` every 100 ms until it holds; panics with `what` after `timeout`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// JSON and ports
// ---------------------------------------------------------------------------------------------

/// The string field `field` of `v`; panics with `v` when it is missing.
pub fn str_of<'a>(v: &'a Value, field: &str) -> &'a str {
    v[field]
        .as_str()
        .unwrap_or_else(|| panic!("{field} missing in {v}"))
}

/// The `id` of a task, agent or token as the CLI prints it.
pub fn id_of(v: &Value) -> String {
    str_of(v, "id").to_string()
}

/// A localhost port where nothing listens right now (bound, then released).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding 127.0.0.1:0")
        .port()
}

/// Every file under `root` whose bytes contain `needle` (a secret that must not be left on disk).
pub fn files_containing(root: &std::path::Path, needle: &[u8]) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(path),
                Ok(t)
                    if t.is_file()
                        && std::fs::read(&path)
                            .is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle)) =>
                {
                    found.push(path)
                }
                _ => {}
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn services_are_required_under_ci_or_berth_require_services() {
        let with = |pairs: &'static [(&'static str, &'static str)]| {
            services_required_by(move |k| {
                pairs
                    .iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| v.to_string())
            })
        };
        assert!(!with(&[]));
        assert!(with(&[("CI", "true")]));
        assert!(with(&[("BERTH_REQUIRE_SERVICES", "1")]));
        assert!(!with(&[("CI", "false"), ("BERTH_REQUIRE_SERVICES", "0")]));
    }

    #[test]
    fn try_wait_for_returns_the_last_observation_at_the_deadline() {
        let mut n = 0;
        let last = try_wait_for(Duration::from_millis(300), || -> Result<(), String> {
            n += 1;
            Err(format!("try {n}"))
        });
        assert_eq!(last, Err(format!("try {n}")));
        assert!(n >= 2, "polled {n} times");
    }

    #[test]
    fn id_of_reads_the_id() {
        assert_eq!(id_of(&serde_json::json!({"id": "a-1"})), "a-1");
    }
}
