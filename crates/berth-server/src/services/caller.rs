//! Who asks the application layer for something, and what their role lets them do. The HTTP layer
//! proves the caller (`http::auth`); the services decide with it and name it in the audit log.

use berth_proto::admin::Role;
use berth_proto::audit::AuditActor;
use berth_proto::error::codes;
use berth_proto::TenantId;
use berth_store::ApiToken;

use crate::error::{ApiError, ApiResult};

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
