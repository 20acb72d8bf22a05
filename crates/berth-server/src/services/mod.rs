//! The application layer: what the HTTP routes and the reconcilers ask for, decided once and
//! written to the store. Nothing here knows about HTTP; nothing here calls a route or a worker.

pub(crate) mod tasks;
