//! `agent-task-transport/v1`: the session lease, the long-poll and the signed result.
//!
//! Fails closed everywhere: a result counts only when the connection's certificate is the agent's
//! binding, the signature verifies with that certificate's key over the JCS of the envelope, the
//! contract version, task id and agent id match, and — in the same transaction that records it —
//! the agent's generation is current and the assignment is the task's live lease.

mod dispatch;
mod gate;
mod results;
mod session;

pub use dispatch::*;
pub use results::*;
pub use session::*;

pub use gate::{fenced, transport_enabled};
