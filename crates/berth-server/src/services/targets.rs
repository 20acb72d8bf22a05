//! Deployment targets: what an environment's selector picks. An agent is its own target; an
//! SSH target (issue 12) is a host without an agent, reached through one (`via`). Deployments,
//! drift read-backs and `berth env status` see both as a [`Target`]: an id (the agent's, or the
//! SSH target's in the same place), a name and labels. Only building a target's tasks differs:
//! an SSH target's go to its via agent, with the target's address and pinned host key in the
//! payload and its private key sealed in the task's credentials, never in a row in clear.

use std::collections::BTreeMap;

use berth_proto::deploy::TargetType;
use berth_proto::kind::TaskKind;
use berth_proto::payload::{self, SSH_PRIVATE_KEY_CREDENTIAL};
use berth_proto::{AgentId, SshTargetId, TenantId};
use berth_store::{Agent, Environment, SshTarget, StoreError};

use crate::infra::envelope;
use crate::SharedState;

#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The agent's id, or the SSH target's (as an [`AgentId`]: deployment targets and drift
    /// observations hold either).
    pub id: AgentId,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub kind: TargetKind,
}

#[derive(Debug, Clone)]
pub(crate) enum TargetKind {
    Agent(Box<Agent>),
    Ssh(Box<SshTarget>),
}

impl Target {
    pub fn agent(agent: Agent) -> Target {
        Target {
            id: agent.id,
            name: agent.name.clone(),
            labels: agent.labels.clone(),
            kind: TargetKind::Agent(Box::new(agent)),
        }
    }

    /// An agent cordoned by an operator: deployments leave it out. (An SSH target has no cordon
    /// of its own; its via agent's is checked when its task is queued.)
    pub fn cordoned(&self) -> bool {
        match &self.kind {
            TargetKind::Agent(agent) => agent.cordoned,
            TargetKind::Ssh(_) => false,
        }
    }

    pub fn ssh(target: SshTarget) -> Target {
        Target {
            id: AgentId(target.id.0),
            name: target.name.clone(),
            labels: target.labels.clone(),
            kind: TargetKind::Ssh(Box::new(target)),
        }
    }
}

/// The environment's targets, by name: agents or SSH targets carrying every selector label.
pub(crate) async fn matching(
    state: &SharedState,
    env: &Environment,
) -> Result<Vec<Target>, StoreError> {
    Ok(match env.target_type {
        TargetType::Agents => {
            crate::services::tasks::matching_agents(state, env.tenant_id, &env.selector, None)
                .await?
                .into_iter()
                .map(Target::agent)
                .collect()
        }
        TargetType::Ssh => state
            .store
            .list_ssh_targets(env.tenant_id)
            .await?
            .into_iter()
            .filter(|t| env.selector.iter().all(|(k, v)| t.labels.get(k) == Some(v)))
            .map(Target::ssh)
            .collect(),
    })
}

/// The target with this id, whichever kind it is; `None` once it was deleted.
pub(crate) async fn get(
    state: &SharedState,
    tenant: TenantId,
    id: AgentId,
) -> Result<Option<Target>, StoreError> {
    if let Some(agent) = state.store.get_agent(tenant, id).await? {
        return Ok(Some(Target::agent(agent)));
    }
    Ok(state
        .store
        .get_ssh_target_by_id(tenant, SshTargetId(id.0))
        .await?
        .map(Target::ssh))
}

/// The agent that acts for an SSH target: the one it names (whatever its status: its tasks
/// wait for it), or the first by name of the online, uncordoned agents carrying its via labels
/// that can run `ssh`. `None`: no such agent.
pub(crate) async fn via_agent(
    state: &SharedState,
    target: &SshTarget,
) -> Result<Option<Agent>, StoreError> {
    if let Some(id) = &target.via_agent {
        let Ok(id) = id.parse() else {
            return Ok(None);
        };
        return state.store.get_agent(target.tenant_id, AgentId(id)).await;
    }
    // The same routing rule as any selector's (`services::tasks::candidates`), first by name.
    let candidates = crate::services::tasks::candidates(
        state,
        target.tenant_id,
        &target.via_selector,
        TaskKind::SshDeploy,
    )
    .await?;
    Ok(candidates.into_iter().next())
}

/// Where a task for the target connects, as its payload says.
pub(crate) fn payload_target(target: &SshTarget) -> payload::SshTarget {
    payload::SshTarget {
        host: target.host.clone(),
        port: Some(target.port),
        user: target.user.clone(),
        host_key: target.host_key.clone(),
        connect_timeout: None,
    }
}

/// Why an SSH target's task cannot be built.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SshTaskError {
    #[error("the key secret {0:?} of the ssh target has no live version")]
    KeyMissing(String),
    #[error("opening the ssh target's key failed")]
    Seal,
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// The credentials of a task for the target: its private key from its builtin secret (the
/// latest live version), in clear for `services::tasks::create`, which seals them for the task.
pub(crate) async fn key_credentials(
    state: &SharedState,
    target: &SshTarget,
) -> Result<BTreeMap<String, String>, SshTaskError> {
    let key = &target.key_secret;
    let sealed = state
        .store
        .get_secret(target.tenant_id, key, None)
        .await?
        .ok_or_else(|| SshTaskError::KeyMissing(key.clone()))?;
    let value = envelope::open_sealed(&state.master_key, sealed).map_err(|_| SshTaskError::Seal)?;
    let value = String::from_utf8(value).map_err(|_| SshTaskError::Seal)?;
    Ok(BTreeMap::from([(
        SSH_PRIVATE_KEY_CREDENTIAL.to_string(),
        value,
    )]))
}
