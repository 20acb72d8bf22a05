//! The admin task API: create (with `Idempotency-Key`), list, show with attempts and verified
//! results, cancel, retry. Credentials are sealed with the master key before they reach a row.

use std::collections::BTreeMap;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use berth_proto::error::codes;
use berth_proto::kind::TaskKind;
use berth_proto::task::{CreateTask, ListTasks, TaskList, TaskView};
use berth_proto::{AgentId, ErrorBody, TaskId, TenantId};
use berth_store::{CancelOutcome, CreateTaskOutcome, NewTask, RetryOutcome};

use crate::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::extract::{ApiPath, ApiQuery, LosslessJson};
use crate::services::caller::actor;
use crate::services::task_views::{self, to_view};
use crate::services::validate::validate_labels;
use crate::SharedState;

const DEFAULT_TIMEOUT_SECS: u32 = 300;
const MAX_TIMEOUT_SECS: u32 = 86_400;

fn unprocessable(detail: impl Into<String>) -> ApiError {
    ApiError::unprocessable(codes::INVALID_REQUEST, detail)
}

/// A task's credentials as its row keeps them: sealed under the master key for that task's id
/// only (`transport::assignment` opens them for its deliveries).
pub(crate) fn seal_credentials(
    master: &berth_crypto::MasterKey,
    credentials: &BTreeMap<String, String>,
    task: TaskId,
) -> Result<Vec<u8>, Box<dyn std::error::Error + Send + Sync>> {
    let clear = serde_json::to_vec(credentials)?;
    Ok(master.seal(&clear, task.0.as_bytes())?)
}

/// Whether the agent reports the capability the task kind needs (seed strings, by name).
pub(crate) fn can_run(agent: &berth_store::Agent, kind: TaskKind) -> bool {
    let names: Vec<&str> = agent.capabilities.iter().map(|c| c.name.as_str()).collect();
    kind.runs_on(&names)
}

/// The online, uncordoned, unsuspended agent of the tenant that carries every selector label and
/// the capability the kind needs, with the fewest open tasks (the first by id among equals).
async fn select_agent(
    state: &SharedState,
    tenant: TenantId,
    selector: &BTreeMap<String, String>,
    kind: TaskKind,
) -> ApiResult<AgentId> {
    let online = Some(berth_proto::agent::AgentStatus::Online);
    // `online` leaves out suspended agents (they show as `blocked`); a cordoned one is skipped.
    let mut candidates: Vec<AgentId> =
        crate::deploy::matching_agents(state, tenant, selector, online)
            .await?
            .iter()
            .filter(|a| !a.cordoned && can_run(a, kind))
            .map(|a| a.id)
            .collect();
    // Ties go to the first by id.
    candidates.sort();
    let counts = state.store.open_task_counts(&candidates).await?;
    counts
        .into_iter()
        .min_by_key(|(_, open)| *open)
        .map(|(agent, _)| agent)
        .ok_or_else(|| {
            ApiError::unprocessable(
                codes::NO_MATCHING_AGENT,
                format!(
                    "no online agent matches the selector and reports the {:?} capability",
                    kind.required_capability()
                ),
            )
        })
}

/// The per-task limits, each with its own code (see `berth_proto::task`).
fn check_limits(req: &CreateTask) -> ApiResult<()> {
    use berth_proto::task::{MAX_CREDENTIALS, MAX_VALUE_BYTES, MAX_VARIABLES, PRIORITY_RANGE};
    let refuse = |code: &'static str, detail: String| Err(ApiError::unprocessable(code, detail));
    if let Some(creds) = &req.credentials {
        if creds.len() > MAX_CREDENTIALS {
            return refuse(
                codes::TOO_MANY_CREDENTIALS,
                format!(
                    "at most {MAX_CREDENTIALS} credentials per task, not {}",
                    creds.len()
                ),
            );
        }
        if creds.contains_key(crate::registry_token::SCOPE_CREDENTIAL) {
            return refuse(
                codes::CREDENTIAL_RESERVED,
                format!(
                    "credential {:?} is set only by the server",
                    crate::registry_token::SCOPE_CREDENTIAL
                ),
            );
        }
        if let Some((k, _)) = creds.iter().find(|(_, v)| v.len() > MAX_VALUE_BYTES) {
            return refuse(
                codes::TOO_MANY_CREDENTIALS,
                format!("credential {k:?} is over {MAX_VALUE_BYTES} bytes"),
            );
        }
    }
    if let Some(vars) = &req.variables {
        if vars.len() > MAX_VARIABLES {
            return refuse(
                codes::TOO_MANY_VARIABLES,
                format!(
                    "at most {MAX_VARIABLES} variables per task, not {}",
                    vars.len()
                ),
            );
        }
    }
    if let Some(priority) = req.priority.filter(|p| !PRIORITY_RANGE.contains(p)) {
        return refuse(
            codes::PRIORITY_OUT_OF_RANGE,
            format!(
                "priority must be {}..={}, not {priority}; higher is reserved for read-backs",
                PRIORITY_RANGE.start(),
                PRIORITY_RANGE.end()
            ),
        );
    }
    Ok(())
}

/// Create a task. The same `Idempotency-Key` with the same body returns the same task; with a
/// different body it is `409 CONFLICT`.
#[utoipa::path(post, path = "/api/v1/tasks", tag = "tasks", request_body = CreateTask, security(("bearer" = [])),
    params(("Idempotency-Key" = Option<String>, Header)),
    responses(
        (status = 201, body = TaskView, description = "created"),
        (status = 200, body = TaskView, description = "the task this Idempotency-Key created before"),
        (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 409, body = ErrorBody, description = "CONFLICT: the Idempotency-Key was used with another body; AGENT_CORDONED: agentId names a cordoned agent"),
        (status = 429, body = ErrorBody, description = "QUEUE_FULL, with Retry-After: the agent already holds the server's --max-open-tasks-per-agent open tasks"),
        (status = 422, body = ErrorBody, description = "INVALID_REQUEST, UNSUPPORTED_TASK_TYPE, INVALID_PAYLOAD (also a number that would not arrive exactly), TOO_MANY_CREDENTIALS, TOO_MANY_VARIABLES, PRIORITY_OUT_OF_RANGE, INVALID_LABEL, CAPABILITY_MISSING, IDEMPOTENCY_KEY_RESERVED or NO_MATCHING_AGENT"),
    ))]
pub async fn create(
    State(state): State<SharedState>,
    caller: Caller,
    headers: HeaderMap,
    LosslessJson(body): LosslessJson,
) -> ApiResult<(StatusCode, Json<TaskView>)> {
    caller.require_deployer()?;
    let request_hash =
        berth_crypto::sha256_hex(&serde_jcs::to_vec(&body).map_err(|e| ApiError::internal(&e))?);
    let req: CreateTask = serde_json::from_value(body).map_err(|e| unprocessable(e.to_string()))?;
    let idempotency_key = match headers.get(berth_proto::headers::IDEMPOTENCY_KEY_HEADER) {
        None => None,
        Some(v) => {
            let key = v.to_str().ok().filter(|k| !k.is_empty() && k.len() <= 255);
            Some(
                key.ok_or_else(|| {
                    unprocessable("Idempotency-Key must be 1-255 visible ASCII characters")
                })?
                .to_string(),
            )
        }
    };
    if idempotency_key
        .as_deref()
        .is_some_and(berth_store::is_internal_key)
    {
        return Err(ApiError::unprocessable(
            codes::IDEMPOTENCY_KEY_RESERVED,
            "Idempotency-Key may not start with \"read-back:\", the server's own namespace",
        ));
    }
    let kind = TaskKind::parse(&req.task_type).ok_or_else(|| {
        ApiError::unprocessable(
            codes::UNSUPPORTED_TASK_TYPE,
            format!(
                "no agent runs tasks of type {:?}; the types are {}",
                req.task_type.chars().take(64).collect::<String>(),
                TaskKind::ALL.map(TaskKind::name).join(", ")
            ),
        )
    })?;
    kind.check_payload(&req.payload).map_err(|e| {
        ApiError::unprocessable(
            codes::INVALID_PAYLOAD,
            format!("the {kind} payload is invalid: {e}"),
        )
    })?;
    let timeout_seconds = req.timeout_seconds.unwrap_or(DEFAULT_TIMEOUT_SECS);
    if timeout_seconds == 0 || timeout_seconds > MAX_TIMEOUT_SECS {
        return Err(unprocessable(format!(
            "timeoutSeconds must be 1-{MAX_TIMEOUT_SECS}"
        )));
    }
    check_limits(&req)?;
    if let Some(vars) = &req.variables {
        validate_labels(vars)?;
    }
    let tenant = caller.tenant();
    let agent_id = match (req.agent_id, &req.selector) {
        (Some(id), None) => {
            let agent = state
                .store
                .get_agent(tenant, id)
                .await?
                .ok_or_else(|| ApiError::not_found("agent"))?;
            if agent.cordoned {
                return Err(cordoned(id));
            }
            if !can_run(&agent, kind) {
                return Err(ApiError::unprocessable(
                    codes::CAPABILITY_MISSING,
                    format!(
                        "agent {id} does not report the {:?} capability that {kind} needs",
                        kind.required_capability()
                    ),
                ));
            }
            id
        }
        (None, Some(selector)) if !selector.is_empty() => {
            validate_labels(selector)?;
            select_agent(&state, tenant, selector, kind).await?
        }
        _ => {
            return Err(unprocessable(
                "give exactly one of agentId and a non-empty selector",
            ))
        }
    };
    let id = TaskId::new();
    let credentials_sealed = match &req.credentials {
        Some(creds) if !creds.is_empty() => Some(
            seal_credentials(&state.master_key, creds, id).map_err(|e| ApiError::internal(&*e))?,
        ),
        _ => None,
    };
    let outcome = state
        .store
        .create_task(NewTask {
            id,
            tenant_id: tenant,
            side_effects: kind.side_effects(),
            task_type: kind.name().into(),
            agent_id,
            payload: req.payload,
            credentials_sealed,
            variables: req.variables.unwrap_or_default(),
            timeout_seconds,
            priority: req.priority.unwrap_or(0),
            idempotency_key,
            request_hash: Some(request_hash),
            read_back_of: None,
            queue_cap: Some(state.config.max_open_tasks_per_agent),
            created_at: state.config.clock.now(),
            created_by: Some(actor(&caller)),
        })
        .await?;
    match outcome {
        CreateTaskOutcome::Created(task) => {
            state.metrics.task_created();
            Ok((StatusCode::CREATED, Json(to_view(task, vec![]))))
        }
        CreateTaskOutcome::Existing(task) => Ok((StatusCode::OK, Json(to_view(task, vec![])))),
        CreateTaskOutcome::KeyConflict => Err(ApiError::conflict(
            codes::CONFLICT,
            "this Idempotency-Key was used with a different request",
        )),
        // Cordoned between the check above and the insert.
        CreateTaskOutcome::AgentCordoned => Err(cordoned(agent_id)),
        CreateTaskOutcome::QueueFull { open } => Err(ApiError {
            retry_after: Some(QUEUE_FULL_RETRY_AFTER_SECS),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                codes::QUEUE_FULL,
                format!(
                    "agent {agent_id} already has {open} open tasks (at most {}); try again \
                     when some have finished",
                    state.config.max_open_tasks_per_agent
                ),
            )
        }),
    }
}

/// How long a client is asked to wait after `QUEUE_FULL`: about how long a queue of short tasks
/// takes to move.
const QUEUE_FULL_RETRY_AFTER_SECS: u64 = 10;

fn cordoned(agent: AgentId) -> ApiError {
    ApiError::conflict(
        codes::AGENT_CORDONED,
        format!("agent {agent} is cordoned: no new work is routed to it until it is uncordoned"),
    )
}

/// List tasks, filtered by state (e.g. `dead_letter`), agent or type.
#[utoipa::path(get, path = "/api/v1/tasks", tag = "tasks", params(ListTasks), security(("bearer" = [])),
    responses((status = 200, body = TaskList)))]
pub async fn list(
    State(state): State<SharedState>,
    caller: Caller,
    ApiQuery(query): ApiQuery<ListTasks>,
) -> ApiResult<Json<TaskList>> {
    task_views::list(&state, &caller, query).await.map(Json)
}

/// One task with its attempts and the verified, signed results.
#[utoipa::path(get, path = "/api/v1/tasks/{id}", tag = "tasks", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = TaskView), (status = 404, body = ErrorBody)))]
pub async fn get(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<TaskId>,
) -> ApiResult<Json<TaskView>> {
    task_views::get(&state, &caller, id).await.map(Json)
}

/// Cancel: a queued task at once; a running one is signalled to its agent, which reports
/// `cancelled`; an `unknown` one is abandoned.
#[utoipa::path(post, path = "/api/v1/tasks/{id}/cancel", tag = "tasks", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = TaskView), (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody)))]
pub async fn cancel(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<TaskId>,
) -> ApiResult<Json<TaskView>> {
    caller.require_deployer()?;
    match state
        .store
        .cancel_task(
            caller.tenant(),
            id,
            actor(&caller),
            state.config.clock.now(),
        )
        .await?
    {
        Some(
            CancelOutcome::Cancelled(t)
            | CancelOutcome::Requested(t)
            | CancelOutcome::AlreadyFinished(t),
        ) => Ok(Json(to_view(t, vec![]))),
        None => Err(ApiError::not_found("task")),
    }
}

/// Retry an `unknown` or `dead_letter` task.
#[utoipa::path(post, path = "/api/v1/tasks/{id}/retry", tag = "tasks", security(("bearer" = [])),
    params(("id" = String, Path, format = Uuid)),
    responses((status = 200, body = TaskView), (status = 403, body = ErrorBody, description = "FORBIDDEN: a viewer token"),
        (status = 404, body = ErrorBody), (status = 409, body = ErrorBody, description = "TASK_NOT_RETRIABLE")))]
pub async fn retry(
    State(state): State<SharedState>,
    caller: Caller,
    ApiPath(id): ApiPath<TaskId>,
) -> ApiResult<Json<TaskView>> {
    caller.require_deployer()?;
    match state
        .store
        .retry_task(
            caller.tenant(),
            id,
            actor(&caller),
            state.config.clock.now(),
        )
        .await?
    {
        Some(RetryOutcome::Requeued(t)) => Ok(Json(to_view(t, vec![]))),
        Some(RetryOutcome::NotRetriable(t)) => Err(ApiError::conflict(
            codes::TASK_NOT_RETRIABLE,
            format!(
                "a {} task cannot be retried; only unknown and dead_letter ones",
                t.state.as_str()
            ),
        )),
        None => Err(ApiError::not_found("task")),
    }
}
