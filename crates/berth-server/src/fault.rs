//! Test-only crash points, for the end-to-end tests that kill the server between two steps of
//! work that must survive a crash. Off unless `BERTH_FAULT_CRASH_AFTER` names a point; read once,
//! at start. At that point the process aborts at once, like a `kill -9`: nothing after it runs.
//!
//! Points: `lease-expiry` (a lost lease made a task `unknown`, before its read-back is
//! scheduled), `read-back-result` (a read-back's result is recorded, before its verdict).

use std::sync::OnceLock;

pub const VAR: &str = "BERTH_FAULT_CRASH_AFTER";

static POINT: OnceLock<Option<String>> = OnceLock::new();

/// Reads the variable; called at start so a point is fixed for the life of the process.
pub fn init() {
    if let Some(point) = POINT.get_or_init(|| std::env::var(VAR).ok()) {
        tracing::warn!(point = %point, "{VAR} is set: this process will abort at that point");
    }
}

/// Aborts the process if `point` is the configured crash point.
pub fn crash_after(point: &str) {
    if POINT.get_or_init(|| std::env::var(VAR).ok()).as_deref() == Some(point) {
        eprintln!("{VAR}={point}: aborting");
        std::process::abort();
    }
}
