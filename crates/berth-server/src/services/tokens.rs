//! Admin API: tenants (operator only), API tokens and one-time agent registration tokens.

use axum::http::StatusCode;
use berth_proto::admin::{
    CreateAgentToken, CreateAgentTokenResponse, CreateApiToken, CreateApiTokenResponse,
    CreateTenant, CreateTenantResponse, Role,
};
use berth_proto::error::codes;
use berth_proto::{TenantId, TokenId};
use berth_store::{NewApiToken, NewRegistrationToken, StoreError};

use crate::infra::error::{ApiError, ApiResult};
use crate::services::caller::actor;
use crate::services::caller::Caller;
use crate::services::validate::{validate_labels, validate_name};
use crate::SharedState;

const DEFAULT_REGISTRATION_TTL_SECS: u64 = 3600;
const MAX_REGISTRATION_TTL_SECS: u64 = 30 * 24 * 3600;

/// Create a tenant and its first admin token (operator token only).
pub async fn create_tenant(
    state: &SharedState,
    caller: &Caller,
    req: CreateTenant,
) -> ApiResult<(StatusCode, CreateTenantResponse)> {
    caller.require_operator()?;
    validate_name("tenant name", &req.name)?;
    let now = state.config.clock.now();
    let tenant = match state
        .store
        .create_tenant(TenantId::new(), &req.name, actor(caller), now)
        .await
    {
        Ok(t) => t,
        Err(StoreError::Conflict { .. }) => {
            return Err(ApiError::conflict(
                codes::TENANT_NAME_TAKEN,
                format!("a tenant named {:?} exists", req.name),
            ))
        }
        Err(e) => return Err(e.into()),
    };
    let admin_token =
        issue_api_token(state, caller, tenant.id, "tenant-admin".into(), Role::Admin).await?;
    Ok((
        StatusCode::CREATED,
        CreateTenantResponse {
            tenant_id: tenant.id,
            admin_token,
        },
    ))
}

/// Create an API token in the caller's tenant.
pub async fn create_api_token(
    state: &SharedState,
    caller: &Caller,
    req: CreateApiToken,
) -> ApiResult<(StatusCode, CreateApiTokenResponse)> {
    caller.require_admin()?;
    let name = match req.name {
        Some(name) => {
            validate_name("token name", &name)?;
            name
        }
        None => format!("{}-token", req.role.as_str()),
    };
    let token = issue_api_token(state, caller, caller.tenant(), name, req.role).await?;
    Ok((
        StatusCode::CREATED,
        CreateApiTokenResponse {
            token,
            role: req.role,
        },
    ))
}

/// A new API token of `tenant`, issued by `caller` (recorded in the tenant's audit chain).
async fn issue_api_token(
    state: &SharedState,
    caller: &Caller,
    tenant: TenantId,
    name: String,
    role: Role,
) -> ApiResult<String> {
    let token = berth_crypto::random_token("bat_");
    state
        .store
        .create_api_token(NewApiToken {
            id: TokenId::new(),
            tenant_id: tenant,
            name,
            role,
            operator: false,
            token_hash: berth_crypto::hash_token(&token),
            created_at: state.config.clock.now(),
            created_by: Some(actor(caller)),
        })
        .await?;
    Ok(token)
}

/// Create a one-time agent registration token.
pub async fn create_agent_token(
    state: &SharedState,
    caller: &Caller,
    req: CreateAgentToken,
) -> ApiResult<(StatusCode, CreateAgentTokenResponse)> {
    caller.require_admin()?;
    let ttl = req
        .expires_in_seconds
        .unwrap_or(DEFAULT_REGISTRATION_TTL_SECS);
    if ttl == 0 || ttl > MAX_REGISTRATION_TTL_SECS {
        return Err(ApiError::bad_request(
            codes::INVALID_REQUEST,
            format!("expiresInSeconds must be between 1 and {MAX_REGISTRATION_TTL_SECS}"),
        ));
    }
    let labels = req.labels.unwrap_or_default();
    validate_labels(&labels)?;
    if let Some(env) = &req.environment {
        validate_name("environment", env)?;
    }
    let now = state.config.clock.now();
    let expires_at = now + time::Duration::seconds(ttl as i64);
    let token = berth_crypto::random_token("reg_");
    state
        .store
        .create_registration_token(NewRegistrationToken {
            id: TokenId::new(),
            tenant_id: caller.tenant(),
            token_hash: berth_crypto::hash_token(&token),
            labels,
            environment: req.environment,
            expires_at,
            created_at: now,
            created_by: Some(actor(caller)),
        })
        .await?;
    Ok((
        StatusCode::CREATED,
        CreateAgentTokenResponse {
            install_command: crate::infra::install::install_line(
                &state.config.public_url(),
                &state.ca.fingerprint(),
                &token,
            ),
            token,
            expires_at,
            ca_fingerprint: state.ca.fingerprint(),
        },
    ))
}
