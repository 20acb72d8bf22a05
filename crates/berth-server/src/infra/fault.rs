//! Test-only crash points, for the end-to-end tests that kill the server between two steps of
//! work that must survive a crash. Off unless `BERTH_FAULT_CRASH_AFTER` names a point; read once,
//! at start. At that point the process sends itself SIGKILL (`kill -9`): nothing after it runs,
//! and the test sees the same death as from outside, only at a chosen instant.
//!
//! Points: `lease-expiry` (a lost lease made a task `unknown`, before its read-back is
//! scheduled), `read-back-result` (a read-back's result is recorded, before its verdict).

use std::sync::OnceLock;

pub const VAR: &str = "BERTH_FAULT_CRASH_AFTER";

static POINT: OnceLock<Option<String>> = OnceLock::new();

/// Reads the variable; called at start so a point is fixed for the life of the process.
pub fn init() {
    if let Some(point) = POINT.get_or_init(|| std::env::var(VAR).ok()) {
        tracing::warn!(point = %point, "{VAR} is set: this process kills itself (SIGKILL) at that point");
    }
}

/// Kills the process (SIGKILL) if `point` is the configured crash point.
pub fn crash_after(point: &str) {
    if POINT.get_or_init(|| std::env::var(VAR).ok()).as_deref() == Some(point) {
        eprintln!("{VAR}={point}: kill -9");
        // SAFETY: a plain syscall on our own pid; SIGKILL cannot be caught.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        std::process::abort();
    }
}
