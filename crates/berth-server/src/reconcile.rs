//! Reconcilers: idempotent loops that move derived state toward the truth. For now, agent
//! staleness: late heartbeats make an agent `degraded` (2 intervals), missing ones `offline` (3).

use std::time::Duration;

use time::OffsetDateTime;
use tokio::sync::watch;

use crate::SharedState;

pub async fn run(state: SharedState, mut stop: watch::Receiver<bool>) {
    let interval = state.config.heartbeat_interval;
    let tick = (interval / 2).clamp(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tokio::time::sleep(tick) => {}
        }
        let now = OffsetDateTime::now_utc();
        let degraded_before = now - interval * 2;
        let offline_before = now - interval * 3;
        match state
            .store
            .sweep_stale_agents(degraded_before, offline_before)
            .await
        {
            Ok(sweep) => {
                state.metrics.agents_marked("degraded", sweep.degraded);
                state.metrics.agents_marked("offline", sweep.offline);
                if sweep.offline > 0 || sweep.degraded > 0 {
                    tracing::info!(
                        offline = sweep.offline,
                        degraded = sweep.degraded,
                        "agent status swept"
                    );
                }
            }
            Err(e) => {
                state.metrics.error("reconcile_store");
                tracing::warn!(error = %e, "agent staleness sweep failed");
            }
        }
    }
}
