//! Long-poll wake-ups: one `Notify` per agent, woken by the store's task events (which, on
//! PostgreSQL, arrive from every replica through LISTEN/NOTIFY) and by local timers for tasks
//! that become claimable by time (`retry_wait`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use berth_proto::AgentId;
use tokio::sync::{broadcast, Notify};

#[derive(Clone)]
pub struct Wakeups {
    agents: Arc<Mutex<HashMap<AgentId, Arc<Notify>>>>,
}

impl Wakeups {
    pub fn spawn(mut events: broadcast::Receiver<AgentId>) -> Wakeups {
        let wakeups = Wakeups {
            agents: Arc::new(Mutex::new(HashMap::new())),
        };
        let forward = wakeups.clone();
        tokio::spawn(async move {
            loop {
                match events.recv().await {
                    // The nil id means "something may have been missed": wake everyone.
                    Ok(agent) if agent.0.is_nil() => forward.wake_all(),
                    Ok(agent) => forward.wake(agent),
                    Err(broadcast::error::RecvError::Lagged(_)) => forward.wake_all(),
                    Err(broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        wakeups
    }

    /// The agent's notifier; create the `notified()` future and `enable()` it before checking
    /// for work, so a wake-up between the check and the wait is not lost.
    pub fn notifier(&self, agent: AgentId) -> Arc<Notify> {
        let mut agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        agents.entry(agent).or_default().clone()
    }

    pub fn wake(&self, agent: AgentId) {
        let notify = self
            .agents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&agent)
            .cloned();
        if let Some(n) = notify {
            n.notify_waiters();
        }
    }

    fn wake_all(&self) {
        let all: Vec<Arc<Notify>> = self
            .agents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .cloned()
            .collect();
        for n in all {
            n.notify_waiters();
        }
    }

    /// Wakes the agent once `delay` has passed (a task in `retry_wait` becomes claimable).
    pub fn wake_after(&self, agent: AgentId, delay: Duration) {
        let this = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            this.wake(agent);
        });
    }
}
