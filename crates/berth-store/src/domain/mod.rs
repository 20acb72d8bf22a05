//! The domains of the store, one module each: its types and the trait of its operations.
//! A backend implements every domain trait; [`crate::Store`] is all of them together.

pub mod agents;
pub mod audit;
pub mod claims;
pub mod deployments;
pub mod desired;
pub mod events;
pub mod notify;
pub mod readiness;
pub mod releases;
pub mod secrets;
pub mod ssh_targets;
pub mod tasks;
pub mod tenants;
