//! Agents as the API and the UI read them: the list with its filters, and one agent.

use berth_proto::agent::{Agent, AgentList, AgentStatus, ListAgents};
use berth_proto::error::codes;
use berth_proto::AgentId;
use berth_store::AgentFilter;

use crate::infra::error::{ApiError, ApiResult};
use crate::services::caller::Caller;
use crate::SharedState;

const DEFAULT_PAGE: u32 = 100;
const MAX_PAGE: u32 = 1000;

/// An agent as the API shows it.
pub fn to_wire(a: berth_store::Agent) -> Agent {
    Agent {
        id: a.id,
        name: a.name,
        version: a.version,
        capabilities: a.capabilities,
        labels: a.labels,
        status: if a.suspended {
            AgentStatus::Blocked
        } else {
            a.status
        },
        cordoned: a.cordoned,
        suspended: a.suspended,
        environment: a.environment,
        last_heartbeat: a.last_heartbeat,
        resource_usage: a.resource_usage,
        certificate_fingerprint: a.certificate_fingerprint,
        certificate_expires_at: a.certificate_expires_at,
        // Never negative: the store starts at 0 and only increments.
        session_generation: u64::try_from(a.generation).unwrap_or(0),
        created_at: a.created_at,
        updated_at: a.updated_at,
    }
}

/// The application side of `http/routes/agents.rs`'s `list`.
pub async fn list(state: &SharedState, caller: &Caller, query: ListAgents) -> ApiResult<AgentList> {
    caller.can_read()?;
    let label = match &query.label {
        None => None,
        Some(l) => match l.split_once('=') {
            Some((k, v)) if !k.is_empty() => Some((k.to_string(), v.to_string())),
            _ => {
                return Err(ApiError::bad_request(
                    codes::INVALID_REQUEST,
                    "label must be key=value",
                ))
            }
        },
    };
    let after: Option<AgentId> = crate::services::validate::cursor(query.cursor.as_deref())?;
    let limit = query.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE);
    let filter = AgentFilter {
        status: query.status,
        capability: query.capability.clone(),
        label,
    };
    let page = state
        .store
        .list_agents(caller.tenant(), &filter, after, limit)
        .await?;
    Ok(AgentList {
        items: page.items.into_iter().map(to_wire).collect(),
        next_cursor: page.next.map(|id| id.to_string()),
    })
}

/// The application side of `http/routes/agents.rs`'s `get`.
pub async fn get(state: &SharedState, caller: &Caller, id: AgentId) -> ApiResult<Agent> {
    caller.can_read()?;
    match state.store.get_agent(caller.tenant(), id).await? {
        Some(a) => Ok(to_wire(a)),
        None => Err(ApiError::not_found("agent")),
    }
}
