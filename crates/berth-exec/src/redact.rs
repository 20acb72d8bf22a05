//! Redaction: secret values never leave an executor in logs, messages or outputs. The rule is
//! `berth_proto::redact`, shared with the server; executors pass a task's credential values.

pub use berth_proto::redact::{redact, MASK};
