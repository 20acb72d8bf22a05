//! The reconcilers: background passes that sweep the database and call the application layer.

pub mod reconcile;
pub mod retention;
