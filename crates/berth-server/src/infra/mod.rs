//! Infrastructure every layer may use: configuration, errors, metrics, the clock, bootstrap of the
//! data dir, rate buckets, registry and OpenBao access, the heartbeat writer and wake-ups. Nothing
//! here calls `http`, `services` or `workers`.

pub mod bootstrap;
pub mod clock;
pub mod config;
pub mod envelope;
pub mod error;
pub mod fault;
pub mod grants;
pub mod heartbeat;
pub mod install;
pub mod metrics;
pub mod openbao;
pub mod rate;
pub mod registry;
pub mod registry_token;
pub mod wake;
