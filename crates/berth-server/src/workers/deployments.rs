//! The deployment reconciler: one unit per active deployment, stepped by
//! `services::deployments::advance`.

use berth_store::{DeploymentDetail, StoreError};

use super::reconciler::{Due, Pass, Reconciler, Schedule, Wake};
use crate::services::deployments;
use crate::SharedState;

/// The deployment reconciler: one unit per active deployment, a pass after every committed
/// change that may have written an event (a task result, a read-back, an approval) and at least
/// every second.
pub(crate) struct Deployments(pub SharedState);

impl Reconciler for Deployments {
    type Unit = DeploymentDetail;

    fn name(&self) -> &'static str {
        "deploy"
    }

    fn schedule(&self) -> Schedule {
        Schedule {
            wake: Wake::EventsWritten(self.0.store.events_written()),
            ..Schedule::every(deployments::IDLE_PASS)
        }
    }

    async fn due(
        &self,
        _pass: &Pass,
        _after: Option<&DeploymentDetail>,
    ) -> Result<Due<DeploymentDetail>, StoreError> {
        // At most a page per pass: the next pass (at most a second away) takes the rest.
        let active = self
            .0
            .store
            .active_deployments(deployments::ACTIVE_PAGE)
            .await?;
        Ok(Due::all(active))
    }

    fn key(&self, detail: &DeploymentDetail) -> String {
        detail.deployment.id.to_string()
    }

    async fn reconcile(&self, _pass: &Pass, detail: &DeploymentDetail) -> Result<(), StoreError> {
        match deployments::advance(&self.0, detail.clone()).await {
            // The deployment moved on since it was read (a cancel, another replica's step):
            // the next pass decides again, quietly.
            Err(StoreError::Conflict {
                constraint: deployments::SUPERSEDED,
            }) => Ok(()),
            other => other,
        }
    }
}
