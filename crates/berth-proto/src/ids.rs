//! Newtype ids, so an agent id can never be passed where a tenant id is expected.

use std::fmt;
use std::str::FromStr;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
        #[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(value_type = String, format = Uuid))]
        #[serde(transparent)]
        pub struct $name(pub uuid::Uuid);

        impl $name {
            /// A new time-ordered (v7) id, so listing by id lists by creation.
            pub fn new() -> Self {
                Self(uuid::Uuid::now_v7())
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                uuid::Uuid::parse_str(s).map(Self)
            }
        }
    };
}

id_type!(
    /// A tenant: every row and query is scoped by one.
    TenantId
);
id_type!(
    /// An agent, also the subject of its certificate (`urn:berth:agent:<id>`).
    AgentId
);
id_type!(
    /// An API or registration token's row id (never the secret itself).
    TokenId
);
id_type!(
    /// A task: one unit of work for one agent.
    TaskId
);
id_type!(
    /// One delivery of a task to an agent; a fresh one per delivery.
    AssignmentId
);
id_type!(
    /// A release: an immutable set of components pinned by digest.
    ReleaseId
);
id_type!(
    /// An environment: a named set of targets with a rollout policy.
    EnvironmentId
);
id_type!(
    /// A deployment: one release rolled out to one environment.
    DeploymentId
);
id_type!(
    /// An SSH target: a host without an agent, deployed to through one. As a deployment target
    /// (`deployment_targets.agent_id`, drift observations) its id stands where an agent's would.
    SshTargetId
);
