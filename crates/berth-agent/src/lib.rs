//! The berth agent: enrolls with a one-time token and a locally generated key, then proves
//! itself with its certificate on every call, heartbeats, and renews its certificate in time.
//!
//! Invariant: this crate never depends on the store or the server. It talks to the control plane
//! only through `berth-client` and the wire types in `berth-proto`.

mod backoff;
mod capabilities;
mod error;
mod journal;
mod resources;
mod run;
mod state;
mod tasks;

pub use error::AgentError;
pub use run::{register, run, AgentConfig, RegisterOptions, Registered};
pub use state::StateDir;

/// The agent's version, reported at registration.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
