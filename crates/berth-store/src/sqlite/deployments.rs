//! Environments and deployments on sqlite: placeholder until the store work lands.

use berth_proto::audit::AuditActor;
use berth_proto::{DeploymentId, EnvironmentId, ReleaseId, TenantId};
use time::OffsetDateTime;

use super::SqliteStore;
use crate::*;

#[async_trait::async_trait]
impl DeploymentStore for SqliteStore {
    #[allow(unused_variables)]
    async fn create_environment(&self, env: Environment, actor: AuditActor) -> Result<Environment> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn get_environment(&self, tenant: TenantId, name: &str) -> Result<Option<Environment>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn list_environments(&self, tenant: TenantId) -> Result<Vec<Environment>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn environments_with_release(
        &self,
        after: Option<EnvironmentId>,
        limit: u32,
    ) -> Result<Vec<Environment>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn unpin_environment(
        &self,
        tenant: TenantId,
        name: &str,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<Environment>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn create_deployment(&self, new: NewDeployment) -> Result<DeploymentDetail> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn get_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
    ) -> Result<Option<DeploymentDetail>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn list_deployments(
        &self,
        tenant: TenantId,
        environment: Option<EnvironmentId>,
        after: Option<DeploymentId>,
        limit: u32,
    ) -> Result<crate::Page<Deployment>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn succeeded_in(
        &self,
        tenant: TenantId,
        environment: &str,
        release: ReleaseId,
    ) -> Result<bool> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn approve_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<ApproveOutcome>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn cancel_deployment(
        &self,
        tenant: TenantId,
        id: DeploymentId,
        actor: AuditActor,
        now: OffsetDateTime,
    ) -> Result<Option<DeploymentDetail>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn active_deployments(&self, limit: u32) -> Result<Vec<DeploymentDetail>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn record_deployment_step(
        &self,
        step: DeploymentStep,
    ) -> Result<Option<DeploymentDetail>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn target_observations(
        &self,
        environment: EnvironmentId,
    ) -> Result<Vec<TargetObservation>> {
        todo!("deployment store")
    }
    #[allow(unused_variables)]
    async fn put_target_observation(&self, observation: TargetObservation) -> Result<()> {
        todo!("deployment store")
    }
}
