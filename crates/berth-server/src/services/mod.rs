//! The application layer: the decisions of tasks, deployments, environments, readiness, drift,
//! read-back, secrets, targets and notifications. `http` and `workers` call it; it calls the store
//! and `infra`, never upward.

pub mod agents;
pub mod audit;
pub mod caller;
pub mod deployments;
pub mod desired;
pub mod drift;
pub mod environments;
pub mod notify;
pub mod readback;
pub mod readiness;
pub mod releases;
pub mod secrets;
pub mod ssh_targets;
pub mod targets;
pub mod task_views;
pub mod tasks;
pub mod tokens;
pub mod validate;
pub mod webhooks;
