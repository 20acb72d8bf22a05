//! The berth agent: enrolls with a one-time token and a locally generated key, then proves
//! itself with its certificate on every call, heartbeats, runs tasks, and renews its
//! certificate in time.
//!
//! One job per module, imports only downwards: `run` (the lifetime) starts `heartbeat` (which
//! uses `renew`), `tasks` (which uses `report`, `journal`) and `idle` (which gives back the
//! pages only start-up used); all of them reach the server through `link` and `retry`; `enroll`
//! is the first run. Exit codes come from typed errors (`retry` → `error`).
//!
//! Invariant: this crate never depends on the store or the server. It talks to the control plane
//! only through `berth-client` and the wire types in `berth-proto`.

mod artifacts;
mod backoff;
mod capabilities;
mod config;
pub mod desired;
mod enroll;
mod error;
mod heartbeat;
mod idle;
mod installation;
mod journal;
mod link;
pub mod openbao;
mod probe;
mod renew;
mod report;
mod resources;
mod retry;
mod run;
mod start;
mod state;
mod tasks;

pub use config::{AgentConfig, TaskTransport};
pub use enroll::{register, RegisterOptions, Registered};
pub use error::AgentError;
pub use run::run;
pub use state::StateDir;

/// The agent's version, reported at registration.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
