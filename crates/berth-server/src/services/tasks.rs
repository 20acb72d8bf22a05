//! The one way a task is created. Every origin — the task API, deployments, drift checks,
//! read-backs, readiness probes, and the tasks an SSH target's via agent runs — states its
//! intent as a [`TaskRequest`]; [`create`] routes it (capability, and for a selector cordon and
//! suspension), seals its credentials for the new task's id, and hands the store the only
//! `NewTask` built in the server, carrying the queue cap and the origin's idempotency key, so
//! that cordon, cap and idempotency are decided in the insert's transaction
//! (`berth_store::lifecycle::admit`). It never decides on HTTP status codes: each caller maps
//! a [`Refused`] to its own answer.

use std::collections::BTreeMap;

use berth_proto::agent::AgentStatus;
use berth_proto::audit::AuditActor;
use berth_proto::kind::TaskKind;
use berth_proto::{AgentId, DeploymentId, EnvironmentId, TaskId, TenantId};
use berth_store::{Agent, AgentFilter, CreateTaskOutcome, NewTask, StoreError, Task};
use time::OffsetDateTime;

use crate::SharedState;

/// Where a task may run.
pub(crate) enum Placement<'a> {
    /// This agent, whatever its status: an explicit `agentId`, a deployment's target, an SSH
    /// target's via agent, the agent an `unknown` task ran on. A suspended agent's task waits
    /// for it to be resumed; a cordoned one refuses it (in the insert's transaction).
    Agent(AgentId),
    /// Of the online (so not suspended), uncordoned agents carrying every label and the kind's
    /// capability, the one with the fewest open tasks (the first by id among equals).
    Selector(&'a BTreeMap<String, String>),
}

/// Who asks for the task: it decides the idempotency key, the audit actor and whether the task
/// is a read-back.
pub(crate) enum Origin {
    /// `POST /api/v1/tasks`: the client's own `Idempotency-Key` (never in the server's
    /// namespace) with the hash of the request body.
    Api {
        actor: AuditActor,
        idempotency_key: Option<String>,
        request_hash: String,
    },
    /// One part (a component, or `ssh`) of a deployment on one target, for `purpose`
    /// (`deploy` or `rollback`).
    /// `version` is the deployment's as the pass read it: the insert happens only while the
    /// deployment is still there, at that version, and not finished or cancelled (a cancel on
    /// another replica serialises with it on the deployment's row).
    Deployment {
        deployment: DeploymentId,
        version: i64,
        target: AgentId,
        purpose: String,
        part: String,
        requested_by: AuditActor,
    },
    /// The drift read-back of one target, due at `due`.
    Drift {
        environment: EnvironmentId,
        target: AgentId,
        due: OffsetDateTime,
    },
    /// The read-back of lost delivery number `attempts` of the `unknown` task `of`. The store
    /// lets a read-back past the cordon and the cap: it resolves work the agent already had.
    ReadBack { of: TaskId, attempts: u32 },
    /// A readiness pass's probe of one host.
    Readiness {
        environment: EnvironmentId,
        pass: uuid::Uuid,
        agent: AgentId,
    },
}

/// An origin's intent. Not `Debug`: `credentials` are in clear until [`create`] seals them.
pub(crate) struct TaskRequest<'a> {
    pub tenant: TenantId,
    pub kind: TaskKind,
    pub placement: Placement<'a>,
    pub payload: serde_json::Value,
    /// In clear; sealed under the master key for the new task's id only, never stored clear.
    pub credentials: Option<BTreeMap<String, String>>,
    pub variables: BTreeMap<String, String>,
    pub timeout_seconds: u32,
    pub priority: i32,
    pub origin: Origin,
}

/// A task the store holds for the request.
#[derive(Debug)]
pub(crate) enum Placed {
    Created(Task),
    /// The origin's idempotency key named this task already, for the same request.
    Existing(Task),
}

impl Placed {
    pub fn task(&self) -> &Task {
        match self {
            Placed::Created(t) | Placed::Existing(t) => t,
        }
    }
}

/// Why no task was created. Nothing was inserted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The agent does not exist in the tenant (or was deleted during the create).
    AgentNotFound(AgentId),
    /// The agent is cordoned.
    Cordoned(AgentId),
    /// The agent does not report the capability the kind needs.
    CapabilityMissing { agent: AgentId, kind: TaskKind },
    /// No agent fits the selector.
    NoMatchingAgent { kind: TaskKind },
    /// The agent already holds `open` open tasks, at least `cap`.
    QueueFull { agent: AgentId, open: u64, cap: u32 },
    /// The idempotency key was used with another request.
    KeyConflict,
    /// A client's key in the server's namespace (`berth_store::is_internal_key`).
    KeyReserved,
    /// A deployment's task, for a deployment that moved on (cancelled, finished, or stepped by
    /// another replica) since the pass read it.
    Superseded,
}

/// What an origin stores on its task: the idempotency key, the request hash (the API's), the
/// task read back (a read-back's) and the audit actor.
struct OriginKeys {
    idempotency_key: Option<String>,
    request_hash: Option<String>,
    read_back_of: Option<TaskId>,
    created_by: Option<AuditActor>,
}

impl Origin {
    /// A deployment's task is inserted only while the deployment is at the version the pass
    /// read.
    fn guard(&self) -> Option<berth_store::DeploymentGuard> {
        match self {
            Origin::Deployment {
                deployment,
                version,
                ..
            } => Some(berth_store::DeploymentGuard {
                deployment_id: *deployment,
                expected_version: *version,
            }),
            _ => None,
        }
    }

    fn keys(self) -> OriginKeys {
        let key_only = |key| OriginKeys {
            idempotency_key: Some(key),
            request_hash: None,
            read_back_of: None,
            created_by: None,
        };
        match self {
            Origin::Api {
                actor,
                idempotency_key,
                request_hash,
            } => OriginKeys {
                idempotency_key,
                request_hash: Some(request_hash),
                read_back_of: None,
                created_by: Some(actor),
            },
            Origin::Deployment {
                deployment,
                target,
                purpose,
                part,
                requested_by,
                ..
            } => OriginKeys {
                created_by: Some(requested_by),
                ..key_only(berth_store::deployment_task_key(
                    deployment, target, &purpose, &part,
                ))
            },
            Origin::Drift {
                environment,
                target,
                due,
            } => key_only(berth_store::drift_check_key(
                environment,
                target,
                (due.unix_timestamp_nanos() / 1_000_000) as i64,
            )),
            Origin::ReadBack { of, attempts } => OriginKeys {
                read_back_of: Some(of),
                ..key_only(berth_store::read_back_key(of, attempts))
            },
            Origin::Readiness {
                environment,
                pass,
                agent,
            } => key_only(berth_store::readiness_probe_key(environment, pass, agent)),
        }
    }
}

/// Creates the task `req` asks for, or says why not. `Err` only when the store fails or the
/// credentials cannot be sealed.
pub(crate) async fn create(
    state: &SharedState,
    req: TaskRequest<'_>,
) -> Result<Result<Placed, Refused>, StoreError> {
    if let Origin::Api {
        idempotency_key: Some(key),
        ..
    } = &req.origin
    {
        if berth_store::is_internal_key(key) {
            return Ok(Err(Refused::KeyReserved));
        }
    }
    let agent_id = match route(state, req.tenant, &req.placement, req.kind).await? {
        Ok(agent) => agent,
        Err(refused) => return Ok(Err(refused)),
    };
    let id = TaskId::new();
    let credentials_sealed = match &req.credentials {
        Some(creds) if !creds.is_empty() => Some(
            seal_credentials(&state.master_key, creds, id)
                .map_err(|e| StoreError::Corrupt(format!("sealing task credentials: {e}")))?,
        ),
        _ => None,
    };
    let guard = req.origin.guard();
    let keys = req.origin.keys();
    let cap = state.config.max_open_tasks_per_agent;
    let task = NewTask {
        id,
        tenant_id: req.tenant,
        task_type: req.kind.name().into(),
        agent_id,
        payload: req.payload,
        credentials_sealed,
        variables: req.variables,
        timeout_seconds: req.timeout_seconds,
        priority: req.priority,
        side_effects: req.kind.side_effects(),
        idempotency_key: keys.idempotency_key,
        request_hash: keys.request_hash,
        read_back_of: keys.read_back_of,
        // Every origin counts against the cap; the store exempts read-backs (`queue_cap`).
        queue_cap: Some(cap),
        created_at: state.config.clock.now(),
        created_by: keys.created_by,
    };
    let outcome = match insert(state, guard, task).await? {
        Ok(outcome) => outcome,
        Err(refused) => return Ok(Err(refused)),
    };
    Ok(match outcome {
        CreateTaskOutcome::Created(t) => {
            state.metrics.task_created();
            Ok(Placed::Created(t))
        }
        CreateTaskOutcome::Existing(t) => Ok(Placed::Existing(t)),
        CreateTaskOutcome::KeyConflict => Err(Refused::KeyConflict),
        CreateTaskOutcome::AgentCordoned => Err(Refused::Cordoned(agent_id)),
        CreateTaskOutcome::QueueFull { open } => Err(Refused::QueueFull {
            agent: agent_id,
            open,
            cap,
        }),
    })
}

/// Hands the store the task (under the deployment's `guard`, for a deployment's): a deleted
/// agent or a moved-on deployment is a refusal, not an error.
async fn insert(
    state: &SharedState,
    guard: Option<berth_store::DeploymentGuard>,
    task: NewTask,
) -> Result<Result<CreateTaskOutcome, Refused>, StoreError> {
    let agent_id = task.agent_id;
    let created = match guard {
        None => state.store.create_task(task).await,
        Some(guard) => match state.store.create_deployment_task(guard, task).await {
            Ok(berth_store::DeploymentTaskOutcome::Decided(outcome)) => Ok(outcome),
            Ok(berth_store::DeploymentTaskOutcome::Superseded) => {
                return Ok(Err(Refused::Superseded))
            }
            Err(e) => Err(e),
        },
    };
    match created {
        Ok(outcome) => Ok(Ok(outcome)),
        // The agent was deleted between the routing and the insert.
        Err(StoreError::Conflict {
            constraint: "task_agent",
        }) => Ok(Err(Refused::AgentNotFound(agent_id))),
        Err(e) => Err(e),
    }
}

/// The agent the task goes to. Cordon is left to the insert's transaction, which is the only
/// place it can be decided without a race; a selector also skips cordoned agents.
async fn route(
    state: &SharedState,
    tenant: TenantId,
    placement: &Placement<'_>,
    kind: TaskKind,
) -> Result<Result<AgentId, Refused>, StoreError> {
    match placement {
        Placement::Agent(id) => {
            let Some(agent) = state.store.get_agent(tenant, *id).await? else {
                return Ok(Err(Refused::AgentNotFound(*id)));
            };
            if !can_run(&agent, kind) {
                return Ok(Err(Refused::CapabilityMissing { agent: *id, kind }));
            }
            Ok(Ok(*id))
        }
        Placement::Selector(selector) => {
            let mut ids: Vec<AgentId> = candidates(state, tenant, selector, kind)
                .await?
                .iter()
                .map(|a| a.id)
                .collect();
            // Ties go to the first by id.
            ids.sort();
            let counts = state.store.open_task_counts(&ids).await?;
            Ok(counts
                .into_iter()
                .min_by_key(|(_, open)| *open)
                .map(|(agent, _)| agent)
                .ok_or(Refused::NoMatchingAgent { kind }))
        }
    }
}

/// The agents a selector may route `kind` to, by name: online (a suspended agent shows as
/// `blocked`, so it is left out), not cordoned, carrying every label and the kind's capability.
pub(crate) async fn candidates(
    state: &SharedState,
    tenant: TenantId,
    selector: &BTreeMap<String, String>,
    kind: TaskKind,
) -> Result<Vec<Agent>, StoreError> {
    let mut agents = matching_agents(state, tenant, selector, Some(AgentStatus::Online)).await?;
    agents.retain(|a| !a.cordoned && can_run(a, kind));
    Ok(agents)
}

/// Agents of the tenant carrying every selector label (and `status`, when given), by name.
pub(crate) async fn matching_agents(
    state: &SharedState,
    tenant: TenantId,
    selector: &BTreeMap<String, String>,
    status: Option<AgentStatus>,
) -> Result<Vec<Agent>, StoreError> {
    let filter = AgentFilter {
        status,
        capability: None,
        label: selector.iter().next().map(|(k, v)| (k.clone(), v.clone())),
    };
    let mut agents = Vec::new();
    let mut after = None;
    loop {
        let page = state.store.list_agents(tenant, &filter, after, 500).await?;
        agents.extend(
            page.items
                .into_iter()
                .filter(|a| selector.iter().all(|(k, v)| a.labels.get(k) == Some(v))),
        );
        match page.next {
            Some(next) => after = Some(AgentId(next)),
            None => break,
        }
    }
    agents.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(agents)
}

/// Whether the agent reports the capability the task kind needs (seed strings, by name).
pub(crate) fn can_run(agent: &Agent, kind: TaskKind) -> bool {
    let names: Vec<&str> = agent.capabilities.iter().map(|c| c.name.as_str()).collect();
    kind.runs_on(&names)
}

/// A task's credentials as its row keeps them: sealed under the master key for that task's id
/// only (`transport::assignment` opens them for its deliveries).
fn seal_credentials(
    master: &berth_crypto::MasterKey,
    credentials: &BTreeMap<String, String>,
    task: TaskId,
) -> Result<Vec<u8>, Box<dyn std::error::Error + Send + Sync>> {
    let clear = serde_json::to_vec(credentials)?;
    Ok(master.seal(&clear, task.0.as_bytes())?)
}

/// A task's credentials in clear, from its row (sealed for `task` only): what a read-back
/// carries again, sealed for its own id.
pub(crate) fn open_credentials(
    master: &berth_crypto::MasterKey,
    sealed: &[u8],
    task: TaskId,
) -> Result<BTreeMap<String, String>, Box<dyn std::error::Error + Send + Sync>> {
    let clear = master.open(sealed, task.0.as_bytes())?;
    Ok(serde_json::from_slice(&clear)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Credentials are sealed for one task id: they open for that task only, and a read-back
    /// carries them by opening its parent's and sealing them again for itself.
    #[test]
    fn credentials_open_only_for_the_task_they_were_sealed_for() {
        let master = berth_crypto::MasterKey::generate();
        let creds = BTreeMap::from([("sshPrivateKey".to_string(), "secret".to_string())]);
        let (parent, read_back) = (TaskId::new(), TaskId::new());
        let sealed = seal_credentials(&master, &creds, parent).expect("seal");
        assert!(
            !sealed.windows(6).any(|w| w == b"secret"),
            "sealed in clear"
        );
        assert_eq!(
            open_credentials(&master, &sealed, parent).expect("open"),
            creds
        );
        assert!(open_credentials(&master, &sealed, read_back).is_err());
        let resealed = seal_credentials(&master, &creds, read_back).expect("reseal");
        assert_eq!(
            open_credentials(&master, &resealed, read_back).expect("open"),
            creds
        );
        assert!(open_credentials(&master, &resealed, parent).is_err());
        let other = berth_crypto::MasterKey::generate();
        assert!(open_credentials(&other, &sealed, parent).is_err());
    }
}
