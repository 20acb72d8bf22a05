//! The admin task API: create (with `Idempotency-Key`), list, show with attempts and verified
//! results, cancel, retry. A create is validated here and made by `services::tasks`.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::Json;
use berth_proto::error::codes;
use berth_proto::kind::TaskKind;
use berth_proto::task::{CreateTask, ListTasks, TaskList, TaskView};
use berth_proto::{ErrorBody, TaskId};
use berth_store::{CancelOutcome, RetryOutcome};

use crate::http::auth::Caller;
use crate::http::extract::{ApiPath, ApiQuery, LosslessJson};
use crate::infra::error::{ApiError, ApiResult};
use crate::services::caller::actor;
use crate::services::task_views::{self, to_view};
use crate::services::tasks::{self, Origin, Placed, Placement, Refused, TaskRequest};
use crate::services::validate::validate_labels;
use crate::SharedState;

const DEFAULT_TIMEOUT_SECS: u32 = 300;
const MAX_TIMEOUT_SECS: u32 = 86_400;

fn unprocessable(detail: impl Into<String>) -> ApiError {
    ApiError::unprocessable(codes::INVALID_REQUEST, detail)
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
        if creds.contains_key(crate::infra::registry_token::SCOPE_CREDENTIAL) {
            return refuse(
                codes::CREDENTIAL_RESERVED,
                format!(
                    "credential {:?} is set only by the server",
                    crate::infra::registry_token::SCOPE_CREDENTIAL
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
    let placement = match (req.agent_id, &req.selector) {
        (Some(id), None) => Placement::Agent(id),
        (None, Some(selector)) if !selector.is_empty() => {
            validate_labels(selector)?;
            Placement::Selector(selector)
        }
        _ => {
            return Err(unprocessable(
                "give exactly one of agentId and a non-empty selector",
            ))
        }
    };
    let placed = tasks::create(
        &state,
        TaskRequest {
            tenant: caller.tenant(),
            kind,
            placement,
            payload: req.payload,
            credentials: req.credentials,
            variables: req.variables.unwrap_or_default(),
            timeout_seconds,
            priority: req.priority.unwrap_or(0),
            origin: Origin::Api {
                actor: actor(&caller),
                idempotency_key,
                request_hash,
            },
        },
    )
    .await?
    .map_err(refusal)?;
    Ok(match placed {
        Placed::Created(task) => (StatusCode::CREATED, Json(to_view(task, vec![]))),
        Placed::Existing(task) => (StatusCode::OK, Json(to_view(task, vec![]))),
    })
}

/// The API's answer to a refused create, each with its own code.
fn refusal(refused: Refused) -> ApiError {
    match refused {
        Refused::AgentNotFound(_) => ApiError::not_found("agent"),
        Refused::Cordoned(agent) => ApiError::conflict(
            codes::AGENT_CORDONED,
            format!(
                "agent {agent} is cordoned: no new work is routed to it until it is uncordoned"
            ),
        ),
        Refused::CapabilityMissing { agent, kind } => ApiError::unprocessable(
            codes::CAPABILITY_MISSING,
            format!(
                "agent {agent} does not report the {:?} capability that {kind} needs",
                kind.required_capability()
            ),
        ),
        Refused::NoMatchingAgent { kind } => ApiError::unprocessable(
            codes::NO_MATCHING_AGENT,
            format!(
                "no online agent matches the selector and reports the {:?} capability",
                kind.required_capability()
            ),
        ),
        Refused::QueueFull { agent, open, cap } => ApiError {
            retry_after: Some(QUEUE_FULL_RETRY_AFTER_SECS),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                codes::QUEUE_FULL,
                format!(
                    "agent {agent} already has {open} open tasks (at most {cap}); try again \
                     when some have finished"
                ),
            )
        },
        Refused::KeyConflict => ApiError::conflict(
            codes::CONFLICT,
            "this Idempotency-Key was used with a different request",
        ),
        Refused::KeyReserved => ApiError::unprocessable(
            codes::IDEMPOTENCY_KEY_RESERVED,
            "Idempotency-Key may not start with \"read-back:\", the server's own namespace",
        ),
        // Only a deployment's own tasks carry a deployment guard.
        Refused::Superseded => ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            codes::INTERNAL,
            "an API task was refused as a deployment's; see the server log",
        ),
    }
}

/// How long a client is asked to wait after `QUEUE_FULL`: about how long a queue of short tasks
/// takes to move.
const QUEUE_FULL_RETRY_AFTER_SECS: u64 = 10;

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
