//! The drift reconciler: one unit per environment with a current release, checked by
//! `services::drift::check_environment`.

use berth_store::{Environment, StoreError};

use super::reconciler::{Due, Pass, Reconciler, Schedule};
use crate::services::drift;
use crate::SharedState;

/// The drift reconciler: one unit per environment with a current release.
pub(crate) struct DriftChecks(pub SharedState);

impl Reconciler for DriftChecks {
    type Unit = Environment;

    fn name(&self) -> &'static str {
        "drift"
    }

    fn schedule(&self) -> Schedule {
        Schedule::every(drift::SWEEP_EVERY)
    }

    async fn due(
        &self,
        _pass: &Pass,
        after: Option<&Environment>,
    ) -> Result<Due<Environment>, StoreError> {
        let page = self
            .0
            .store
            .environments_with_release(after.map(|e| e.id), drift::PAGE)
            .await?;
        Ok(Due::page(page, drift::PAGE))
    }

    fn key(&self, env: &Environment) -> String {
        env.id.to_string()
    }

    async fn reconcile(&self, pass: &Pass, env: &Environment) -> Result<(), StoreError> {
        drift::check_environment(&self.0, env, pass.now).await
    }
}
