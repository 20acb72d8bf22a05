//! Desired state as the agents' calls need it: the caller's environment (rate-limited per bucket)
//! and the secret values a report from it must never carry.

use berth_proto::error::codes;
use berth_store::DesiredEnvironment;

use crate::infra::envelope;
use crate::infra::error::{ApiError, ApiResult};
use crate::infra::rate::Bucket;
use crate::services::caller::DesiredCaller;
use crate::SharedState;

/// The caller's environment named `env_id`, counted against `bucket` when it has one.
pub async fn agent_environment(
    state: &SharedState,
    caller: &DesiredCaller,
    env_id: &str,
    bucket: Option<Bucket>,
) -> ApiResult<DesiredEnvironment> {
    let env = state
        .store
        .desired_environment(caller.tenant(), env_id)
        .await?
        .filter(|env| caller.may_use(env))
        .ok_or_else(|| {
            ApiError::forbidden(
                codes::AGENT_ENV_MISMATCH,
                format!("this agent may not act for environment {env_id:?}"),
            )
        })?;
    if let Some(bucket) = bucket {
        state
            .rate
            .admit(env.tenant_id, env.id, bucket, state.config.clock.now())?;
    }
    Ok(env)
}

/// Every value of every live version of the environment's `builtin` secrets: what a report
/// from it must never carry.
pub async fn environment_values(
    state: &SharedState,
    env: &DesiredEnvironment,
) -> ApiResult<Vec<String>> {
    let mut values = Vec::new();
    let prefix = format!("{}/", env.name);
    for latest in state.store.list_secrets(env.tenant_id, &prefix).await? {
        for meta in state
            .store
            .secret_versions(env.tenant_id, &latest.key)
            .await?
        {
            let Some(sealed) = state
                .store
                .get_secret(env.tenant_id, &meta.key, Some(meta.version))
                .await?
            else {
                continue;
            };
            let value = envelope::open_sealed(&state.master_key, sealed)
                .map_err(|e| ApiError::internal(&e))?;
            values.push(String::from_utf8_lossy(&value).into_owned());
        }
    }
    Ok(values)
}
