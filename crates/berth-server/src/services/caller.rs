//! Who asks the application layer for something, and what their role lets them do. The HTTP layer
//! proves the caller (`http::auth`); the services decide with it and name it in the audit log.

use berth_proto::admin::Role;
use berth_proto::audit::AuditActor;
use berth_proto::error::codes;
use berth_proto::TenantId;
use berth_store::{Agent, ApiToken};

use crate::infra::error::{ApiError, ApiResult};

/// An authenticated API token holder.
pub struct Caller(pub ApiToken);

impl Caller {
    pub fn tenant(&self) -> TenantId {
        self.0.tenant_id
    }

    /// Read access: every role.
    pub fn can_read(&self) -> ApiResult<()> {
        Ok(())
    }

    /// Changing agents, issuing tokens: admins only.
    pub fn require_admin(&self) -> ApiResult<()> {
        match self.0.role {
            Role::Admin => Ok(()),
            role => Err(ApiError::forbidden(
                codes::FORBIDDEN,
                format!("the {} role cannot do this; it needs admin", role.as_str()),
            )),
        }
    }

    /// Creating and steering tasks: admins and deployers.
    pub fn require_deployer(&self) -> ApiResult<()> {
        match self.0.role {
            Role::Admin | Role::Deployer => Ok(()),
            Role::Viewer => Err(ApiError::forbidden(
                codes::FORBIDDEN,
                "the viewer role cannot do this; it needs deployer or admin",
            )),
        }
    }

    /// Creating tenants: the bootstrap admin token of the `default` tenant only.
    pub fn require_operator(&self) -> ApiResult<()> {
        if self.0.operator {
            Ok(())
        } else {
            Err(ApiError::forbidden(
                codes::OPERATOR_ONLY,
                "only the operator token may manage tenants",
            ))
        }
    }
}

/// The caller as the audit log names it: by token id, name and role, never the secret.
pub fn actor(caller: &Caller) -> AuditActor {
    AuditActor::Token {
        id: caller.0.id.0,
        name: caller.0.name.clone(),
        role: caller.0.role,
    }
}

/// A caller of the desired-state routes (seed 001: checkin, bundle, lease, report, the builtin
/// KV read). Those paths name no agent, so the caller is found from its credential alone.
pub enum DesiredCaller {
    /// An enrolled berth agent, proven by its client certificate: the SAN's agent id, whose
    /// current binding must be the certificate's fingerprint (expiry and the previous-
    /// certificate rule as on every agent route).
    Agent(Box<Agent>),
    /// `Authorization: Bearer <OpenBao token>`: verified by OpenBao's `auth/token/lookup`
    /// (cached 60 s), pinned to the token's `meta.env_id`, and minted from a deploy grant of
    /// that environment (`meta.grant_jti`) that is not superseded and was used by no other
    /// token.
    Token {
        tenant_id: TenantId,
        environment_id: berth_proto::EnvironmentId,
        env_id: String,
        grant_jti: String,
    },
}

impl DesiredCaller {
    pub fn tenant(&self) -> TenantId {
        match self {
            DesiredCaller::Agent(agent) => agent.tenant_id,
            DesiredCaller::Token { tenant_id, .. } => *tenant_id,
        }
    }

    /// The key of its `desired_agents` row: `agent:<uuid>` or `token:<env>`.
    pub fn agent_key(&self) -> String {
        match self {
            DesiredCaller::Agent(agent) => format!("agent:{}", agent.id),
            DesiredCaller::Token { env_id, .. } => format!("token:{env_id}"),
        }
    }

    pub fn actor(&self) -> berth_proto::audit::AuditActor {
        match self {
            DesiredCaller::Agent(agent) => berth_proto::audit::AuditActor::Agent { id: agent.id.0 },
            DesiredCaller::Token {
                env_id, grant_jti, ..
            } => berth_proto::audit::AuditActor::OpenbaoToken {
                environment: env_id.clone(),
                grant_jti: grant_jti.clone(),
            },
        }
    }

    /// Whether the caller may act for the environment: an agent whose labels satisfy every
    /// label of its selector, or a token minted for it.
    pub fn may_use(&self, env: &berth_store::DesiredEnvironment) -> bool {
        match self {
            DesiredCaller::Agent(agent) => env
                .selector
                .iter()
                .all(|(k, v)| agent.labels.get(k) == Some(v)),
            DesiredCaller::Token {
                environment_id,
                env_id,
                ..
            } => env.id == *environment_id && env.name == *env_id,
        }
    }
}
