//! `berth agents drain`: cordon an agent, then wait until the tasks it has (pending, leased,
//! retry_wait) have ended, printing each change in what is left. The holds themselves are one
//! request each (`berth agents cordon|uncordon|suspend|resume`).

use std::time::Duration;

use anyhow::bail;
use berth_client::Client;
use berth_proto::agent::{AgentHold, HoldAgent};
use berth_proto::task::{ListTasks, TaskState};
use berth_proto::AgentId;

/// The states a drain waits out: what the agent still has to run or is running. `unknown`
/// tasks are not: a read-back or an operator decides them, not the agent's queue.
const DRAINED_STATES: [TaskState; 3] = TaskState::IN_FLIGHT;

/// How often the drain looks again.
const POLL: Duration = Duration::from_secs(1);

/// Cordons `agent` and waits until none of its tasks is in [`DRAINED_STATES`], or fails after
/// `timeout`. Prints a line whenever the counts change.
pub async fn drain(client: &Client, agent: AgentId, timeout: Duration) -> anyhow::Result<()> {
    client
        .send(&HoldAgent {
            id: agent,
            hold: AgentHold::Cordon,
        })
        .await?;
    println!("agent {agent} cordoned; waiting for its tasks to end");
    let deadline = tokio::time::Instant::now() + timeout;
    let mut last = None;
    loop {
        let counts = open_counts(client, agent).await?;
        if last.as_ref() != Some(&counts) {
            let parts: Vec<String> = DRAINED_STATES
                .iter()
                .zip(&counts)
                .map(|(state, n)| format!("{n} {}", state.as_str()))
                .collect();
            println!("{}", parts.join(", "));
        }
        if counts.iter().all(|n| *n == 0) {
            println!("agent {agent} drained");
            return Ok(());
        }
        last = Some(counts);
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "agent {agent} still has tasks after {}s; it stays cordoned",
                timeout.as_secs()
            );
        }
        tokio::time::sleep(POLL).await;
    }
}

/// How many of the agent's tasks are in each of [`DRAINED_STATES`].
async fn open_counts(client: &Client, agent: AgentId) -> anyhow::Result<Vec<usize>> {
    let mut counts = Vec::with_capacity(DRAINED_STATES.len());
    for state in DRAINED_STATES {
        let (mut n, mut cursor) = (0, None);
        loop {
            let page = client
                .send(&ListTasks {
                    state: Some(state),
                    agent_id: Some(agent),
                    task_type: None,
                    order: None,
                    cursor,
                    limit: Some(500),
                })
                .await?;
            n += page.items.len();
            match page.next_cursor {
                Some(next) => cursor = Some(next),
                None => break,
            }
        }
        counts.push(n);
    }
    Ok(counts)
}
