//! The readiness reconciler: one unit per environment, its pass stepped by
//! `services::readiness::reconcile`.

use berth_store::{Environment, StoreError};

use super::reconciler::{Due, Pass, Reconciler, Schedule};
use crate::services::readiness;
use crate::SharedState;

/// The readiness reconciler: one unit per environment. The claim on it is what keeps two
/// replicas from starting the same pass at once, and so from each minting the pass's OpenBao
/// grant (the probe task's idempotency key keeps one task, not one grant).
pub(crate) struct ReadinessPasses(pub SharedState);

impl Reconciler for ReadinessPasses {
    type Unit = Environment;

    fn name(&self) -> &'static str {
        "readiness"
    }

    fn schedule(&self) -> Schedule {
        Schedule::every(readiness::SWEEP_EVERY)
    }

    async fn due(
        &self,
        _pass: &Pass,
        after: Option<&Environment>,
    ) -> Result<Due<Environment>, StoreError> {
        let page = self
            .0
            .store
            .readiness_environments(after.map(|e| e.id), readiness::PAGE)
            .await?;
        Ok(Due::page(page, readiness::PAGE))
    }

    fn key(&self, env: &Environment) -> String {
        env.id.to_string()
    }

    async fn reconcile(&self, pass: &Pass, env: &Environment) -> Result<(), StoreError> {
        readiness::reconcile(&self.0, env, pass.now).await
    }
}
