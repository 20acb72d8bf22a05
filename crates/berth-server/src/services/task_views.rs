//! Tasks as the API and the UI read them: the filtered list, and one task with its attempts and
//! signed results.

use berth_proto::task::{AttemptView, ListTasks, TaskList, TaskView};
use berth_proto::TaskId;
use berth_store::{Attempt, Task, TaskFilter};

use crate::infra::error::{ApiError, ApiResult};
use crate::services::caller::Caller;
use crate::SharedState;

pub fn to_view(task: Task, attempts: Vec<Attempt>) -> TaskView {
    TaskView {
        id: task.id,
        task_type: task.task_type,
        state: task.state,
        agent_id: task.agent_id,
        read_back: task.read_back,
        side_effects: task.side_effects,
        priority: task.priority,
        timeout_seconds: task.timeout_seconds,
        attempt_count: task.attempts,
        attempts: attempts
            .into_iter()
            .map(|a| AttemptView {
                assignment_id: a.assignment_id,
                agent_id: a.agent_id,
                state: a.state,
                generation: a.generation,
                assigned_at: a.assigned_at,
                lease_expires_at: a.lease_expires_at,
                started_at: a.started_at,
                phase: a.phase,
                finished_at: a.finished_at,
                error_code: a.error_code,
                result: a.envelope,
            })
            .collect(),
        result: task.result,
        error_code: task.error_code,
        cancel_requested: task.cancel_requested,
        idempotency_key: task.idempotency_key,
        read_back_of: task.read_back_of,
        next_attempt_at: task.next_attempt_at,
        created_at: task.created_at,
        updated_at: task.updated_at,
        finished_at: task.finished_at,
    }
}

/// The application side of `http/routes/tasks.rs`'s `list`.
pub async fn list(state: &SharedState, caller: &Caller, query: ListTasks) -> ApiResult<TaskList> {
    caller.can_read()?;
    let after: Option<TaskId> = crate::services::validate::cursor(query.cursor.as_deref())?;
    let filter = TaskFilter {
        state: query.state,
        agent_id: query.agent_id,
        task_type: query.task_type.clone(),
        order: query.order.unwrap_or_default(),
    };
    let page = state
        .store
        .list_tasks(
            caller.tenant(),
            &filter,
            after,
            query.limit.unwrap_or(100).clamp(1, 1000),
        )
        .await?;
    Ok(TaskList {
        items: page.items.into_iter().map(|t| to_view(t, vec![])).collect(),
        next_cursor: page.next.map(|id| id.to_string()),
    })
}

/// The application side of `http/routes/tasks.rs`'s `get`.
pub async fn get(state: &SharedState, caller: &Caller, id: TaskId) -> ApiResult<TaskView> {
    caller.can_read()?;
    match state.store.get_task(caller.tenant(), id).await? {
        Some((task, attempts)) => Ok(to_view(task, attempts)),
        None => Err(ApiError::not_found("task")),
    }
}
