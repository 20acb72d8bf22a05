//! The UI's pages. Each reads through the JSON API's own handlers (`routes::*`), called with the
//! session's [`Caller`], so a page shows exactly what the API would answer that token, with the
//! same authorization and tenant scoping; only the rendering is here.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use berth_proto::agent::{Agent, AgentStatus, ListAgents, ResourceUsage};
use berth_proto::audit::{AuditActor, AuditEntry, ListAudit};
use berth_proto::deploy::{
    DeploymentPlan, DeploymentTargetEvent, DeploymentView, ListDeployments, TargetPhase,
    DEPLOYMENT_TARGET_EVENT,
};
use berth_proto::kind::TaskKind;
use berth_proto::readiness::{ConditionStatus, EnvironmentReadiness};
use berth_proto::sticker::Sticker;
use berth_proto::task::{ListOrder, ListTasks, TaskState, TaskView};
use berth_proto::{AgentId, DeploymentId, TaskId};
use berth_store::EventFilter;
use futures_util::{StreamExt, TryStreamExt};
use maud::{html, Markup};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use time::OffsetDateTime;

use super::layout::{self, badge, labels, page, status_badge, time, Live, Nav};
use super::layout::{error_page, page_response};
use super::session::UiCaller;
use crate::http::auth::Caller;
use crate::infra::error::ApiResult;
use crate::services;
use crate::SharedState;

/// Rows per list page.
const PAGE: u32 = 50;

pub(super) fn caller(ui: &UiCaller) -> Caller {
    Caller(ui.caller.0.clone())
}

/// The cursor of a live page, read before its data.
async fn live(state: &SharedState, ui: &UiCaller, filter: String) -> ApiResult<Live> {
    let cursor = state.store.latest_event_id(ui.caller.tenant()).await?;
    Ok(Live { filter, cursor })
}

/// A page, or the API's refusal as a page.
fn render(result: ApiResult<Markup>) -> Response {
    match result {
        Ok(markup) => page_response(StatusCode::OK, markup),
        Err(e) => error_page(&e),
    }
}

/// A form's select or text value: an empty field means no filter.
fn nonempty(v: &Option<String>) -> Option<String> {
    v.as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_string)
}

/// A wire enum from its string form (`online`, `dead_letter`, …).
fn parse<T: DeserializeOwned>(v: &Option<String>) -> Option<T> {
    nonempty(v).and_then(|s| serde_json::from_value(serde_json::Value::String(s)).ok())
}

async fn count_agents(
    state: &SharedState,
    ui: &UiCaller,
    status: AgentStatus,
) -> ApiResult<String> {
    let query = ListAgents {
        status: Some(status),
        limit: Some(1000),
        ..Default::default()
    };
    let list = services::agents::list(state, &caller(ui), query).await?;
    Ok(count_text(list.items.len(), list.next_cursor.is_some()))
}

async fn count_tasks(
    state: &SharedState,
    ui: &UiCaller,
    task_state: TaskState,
) -> ApiResult<String> {
    let list = services::task_views::list(
        state,
        &caller(ui),
        ListTasks {
            order: Some(ListOrder::Newest),
            state: Some(task_state),
            limit: Some(1000),
            ..Default::default()
        },
    )
    .await?;
    Ok(count_text(list.items.len(), list.next_cursor.is_some()))
}

fn count_text(n: usize, more: bool) -> String {
    if more {
        format!("{n}+")
    } else {
        n.to_string()
    }
}

pub async fn overview(State(state): State<SharedState>, ui: UiCaller) -> Response {
    render(overview_page(&state, &ui).await)
}

async fn overview_page(state: &SharedState, ui: &UiCaller) -> ApiResult<Markup> {
    let live = live(state, ui, String::new()).await?;
    let mut counts = Vec::new();
    for status in [
        AgentStatus::Online,
        AgentStatus::Degraded,
        AgentStatus::Offline,
    ] {
        counts.push((status, count_agents(state, ui, status).await?));
    }
    let dead = count_tasks(state, ui, TaskState::DeadLetter).await?;
    let unknown = count_tasks(state, ui, TaskState::Unknown).await?;
    let envs = services::environments::list_environments(state, &caller(ui)).await?;
    let recent = services::environments::list(
        state,
        &caller(ui),
        ListDeployments {
            order: Some(ListOrder::Newest),
            limit: Some(50),
            ..Default::default()
        },
    )
    .await?;
    let running: Vec<DeploymentView> = recent
        .items
        .into_iter()
        .filter(|d| d.state.is_active())
        .collect();
    let failed = services::task_views::list(
        state,
        &caller(ui),
        ListTasks {
            order: Some(ListOrder::Newest),
            state: Some(TaskState::Failed),
            limit: Some(10),
            ..Default::default()
        },
    )
    .await?;
    Ok(page(
        ui,
        Nav::Overview,
        "Overview",
        Some(live),
        html! {
            section aria-labelledby="fleet" {
                h2 #fleet { "Fleet" }
                ul.stats {
                    @for (status, n) in &counts {
                        li { a href={ "/agents?status=" (AgentStatus::as_str(*status)) } {
                            strong data-count=(AgentStatus::as_str(*status)) { (n) } " " (AgentStatus::as_str(*status))
                        } }
                    }
                    li { a href="/tasks?state=dead_letter" { strong { (dead) } " dead letter" } }
                    li { a href="/tasks?state=unknown" { strong { (unknown) } " unknown" } }
                }
            }
            section aria-labelledby="envs" {
                h2 #envs { "Environments" }
                @if envs.items.is_empty() {
                    p.muted { "No environments yet." }
                } @else {
                    div.table { table {
                        thead { tr { th { "Environment" } th { "Tier" } th { "Current release" } th { "Pinned" } } }
                        tbody { @for e in &envs.items { tr {
                            td { a href={ "/environments/" (e.name) } { (e.name) } }
                            td { (e.tier.as_str()) }
                            td { (opt(&e.current_release)) }
                            td { (opt(&e.pinned_release)) }
                        } } }
                    } }
                }
            }
            section aria-labelledby="running" {
                h2 #running { "Running deployments" }
                (deployment_table(&running))
            }
            section aria-labelledby="failures" {
                h2 #failures { "Recent failures" }
                (task_table(&failed.items))
            }
        },
    ))
}

fn opt(v: &Option<String>) -> Markup {
    match v {
        Some(v) => html! { (v) },
        None => html! { span.muted { "—" } },
    }
}

fn deployment_table(items: &[DeploymentView]) -> Markup {
    html! {
        @if items.is_empty() {
            p.muted { "None." }
        } @else {
            div.table { table {
                thead { tr { th { "Deployment" } th { "Environment" } th { "Release" } th { "State" } th { "Started" } } }
                tbody { @for d in items { tr {
                    td { a href={ "/deployments/" (d.id) } { code { (short(&d.id.to_string())) } } }
                    td { (d.environment) }
                    td { (d.release) }
                    td { (badge(d.state.as_str())) }
                    td { (time(Some(d.created_at))) }
                } } }
            } }
        }
    }
}

/// An id's last 8 characters, for display. berth's ids are UUIDv7, whose leading characters are
/// a timestamp shared by everything created in the same minute; the tail is random.
fn short(id: &str) -> &str {
    id.get(id.len().saturating_sub(8)..).unwrap_or(id)
}

#[derive(Deserialize, Default)]
pub struct AgentsQuery {
    status: Option<String>,
    label: Option<String>,
    cursor: Option<String>,
}

pub async fn agents(
    State(state): State<SharedState>,
    ui: UiCaller,
    Query(q): Query<AgentsQuery>,
) -> Response {
    let query = ListAgents {
        status: parse(&q.status),
        label: nonempty(&q.label),
        cursor: nonempty(&q.cursor),
        limit: Some(PAGE),
        ..Default::default()
    };
    let status = query.status;
    let label = query.label.clone();
    let live = match live(&state, &ui, String::new()).await {
        Ok(live) => live,
        Err(e) => return error_page(&e),
    };
    render(
        services::agents::list(&state, &caller(&ui), query)
            .await
            .map(|list| {
                let next = list.next_cursor.map(|c| {
                    let mut params = vec![("cursor", c)];
                    if let Some(s) = status {
                        params.push(("status", AgentStatus::as_str(s).to_string()));
                    }
                    if let Some(l) = &label {
                        params.push(("label", l.clone()));
                    }
                    format!("/agents?{}", encode(&params))
                });
                page(
                    &ui,
                    Nav::Agents,
                    "Agents",
                    Some(live),
                    html! {
                        form.filters method="get" action="/agents" {
                            label for="status" { "Status" }
                            select #status name="status" {
                                option value="" { "any" }
                                @for s in [AgentStatus::Registered, AgentStatus::Online, AgentStatus::Degraded, AgentStatus::Offline] {
                                    option value=(AgentStatus::as_str(s)) selected[status == Some(s)] { (AgentStatus::as_str(s)) }
                                }
                            }
                            label for="label" { "Label" }
                            input #label name="label" placeholder="key=value" value=[label.as_deref()];
                            button type="submit" { "Filter" }
                        }
                        (agent_table(&list.items))
                        @if let Some(next) = next {
                            nav.pager aria-label="Pages" { a href=(next) rel="next" { "Next page →" } }
                        }
                    },
                )
            }),
    )
}

fn encode(params: &[(&str, String)]) -> String {
    params
        .iter()
        .map(|(k, v)| format!("{k}={}", percent(v)))
        .collect::<Vec<_>>()
        .join("&")
}

/// Percent-encodes a query value (everything but unreserved characters).
pub(super) fn percent(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn agent_table(items: &[Agent]) -> Markup {
    html! {
        @if items.is_empty() {
            p.muted { "No agents match." }
        } @else {
            div.table { table {
                thead { tr { th { "Name" } th { "Status" } th { "Last heartbeat" } th { "Capabilities" } th { "Labels" } } }
                tbody { @for a in items { tr data-agent=(a.id) {
                    td { a href={ "/agents/" (a.id) } { (a.name) } }
                    td { (status_badge(a.status)) }
                    td { (time(a.last_heartbeat)) }
                    td { (capabilities(a)) }
                    td { (labels(&a.labels)) }
                } } }
            } }
        }
    }
}

fn capabilities(a: &Agent) -> Markup {
    html! {
        ul.chips { @for c in &a.capabilities {
            li.chip data-healthy=(if c.healthy { "yes" } else { "no" }) { (c.name) @if let Some(v) = &c.version { " " span.muted { (v) } } }
        } }
    }
}

pub async fn agent(
    State(state): State<SharedState>,
    ui: UiCaller,
    Path(id): Path<String>,
) -> Response {
    render(agent_page(&state, &ui, &id).await)
}

async fn agent_page(state: &SharedState, ui: &UiCaller, id: &str) -> ApiResult<Markup> {
    let id: AgentId = parse_id(id)?;
    let live = live(state, ui, format!("agent={id}")).await?;
    let a = services::agents::get(state, &caller(ui), id).await?;
    let recent = services::task_views::list(
        state,
        &caller(ui),
        ListTasks {
            order: Some(ListOrder::Newest),
            agent_id: Some(id),
            limit: Some(20),
            ..Default::default()
        },
    )
    .await?;
    let stickers = last_stickers(state, ui, id).await?;
    Ok(page(
        ui,
        Nav::Agents,
        &a.name,
        Some(live),
        html! {
            dl.facts {
                dt { "Status" } dd { (status_badge(a.status)) }
                dt { "Version" } dd { (a.version) }
                dt { "Last heartbeat" } dd { (time(a.last_heartbeat)) }
                dt { "Session generation" } dd { (a.session_generation) }
                dt { "Environment" } dd { (opt(&a.environment)) }
                dt { "Certificate expires" } dd { (time(a.certificate_expires_at)) }
                dt { "Certificate" } dd { code.wrap { (a.certificate_fingerprint.as_deref().unwrap_or("—")) } }
                dt { "Capabilities" } dd { (capabilities(&a)) }
                dt { "Labels" } dd { (labels(&a.labels)) }
            }
            section aria-labelledby="usage" {
                h2 #usage { "Resources at the last heartbeat" }
                @match &a.resource_usage {
                    Some(usage) => (usage_chart(usage)),
                    None => p.muted { "No heartbeat with resource usage yet." },
                }
            }
            section aria-labelledby="stickers" {
                h2 #stickers { "Stickers" }
                @match &stickers {
                    Some((task, list)) => {
                        p.muted { "As the last succeeded " code { "inspect" } " read them on the host: task "
                            a href={ "/tasks/" (task.id) } { code { (short(&task.id.to_string())) } } ", "
                            (time(task.finished_at)) ", its signed result verified." }
                        (sticker_table(list))
                    }
                    None => p.muted { "No " code { "inspect" } " has read this agent's stickers yet (drift checks run one for each environment's target)." },
                }
            }
            section aria-labelledby="recent" {
                h2 #recent { "Recent tasks" }
                (task_table(&recent.items))
                p { a href={ "/tasks?agent=" (a.id) } { "All of its tasks" } }
            }
        },
    ))
}

/// The stickers of the agent's last succeeded `inspect` (its result's `outputs.stickers`), with
/// that task. What the host said, not what berth meant to deploy.
async fn last_stickers(
    state: &SharedState,
    ui: &UiCaller,
    agent: AgentId,
) -> ApiResult<Option<(TaskView, Vec<Sticker>)>> {
    let list = services::task_views::list(
        state,
        &caller(ui),
        ListTasks {
            order: Some(ListOrder::Newest),
            agent_id: Some(agent),
            task_type: Some(TaskKind::Inspect.spec().name.to_string()),
            state: Some(TaskState::Succeeded),
            limit: Some(1),
            ..Default::default()
        },
    )
    .await?;
    Ok(list.items.into_iter().next().map(|task| {
        let stickers = task
            .result
            .as_ref()
            .and_then(|r| r.pointer("/outputs/stickers"))
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default();
        (task, stickers)
    }))
}

fn sticker_table(stickers: &[Sticker]) -> Markup {
    html! {
        @if stickers.is_empty() {
            p.muted { "No stickers on the host." }
        } @else {
            div.table { table {
                thead { tr { th { "Name" } th { "Release" } th { "Digest" } th { "Written" } th { "By task" } } }
                tbody { @for st in stickers { tr {
                    td { (st.name) }
                    td { (opt(&st.release_name)) }
                    td { code.wrap { (st.digest.as_deref().unwrap_or("—")) } }
                    td { (time(Some(st.written_at))) }
                    td { code { (short(&st.task_id)) } }
                } } }
            } }
        }
    }
}

fn parse_id<T: std::str::FromStr>(id: &str) -> ApiResult<T> {
    id.parse().map_err(|_| {
        crate::infra::error::ApiError::bad_request(
            berth_proto::error::codes::INVALID_ID,
            "not a UUID",
        )
    })
}

/// A bar chart (SVG, drawn here) of the last heartbeat's CPU, memory and disk use. The store
/// keeps only the latest sample, so this is a snapshot, not a history.
fn usage_chart(u: &ResourceUsage) -> Markup {
    let share = |used: u64, total: u64| {
        if total == 0 {
            0.0
        } else {
            used as f64 * 100.0 / total as f64
        }
    };
    let bars = [
        (
            "CPU",
            u.cpu_percent.clamp(0.0, 100.0),
            format!("{:.0} % of {} cores", u.cpu_percent, u.cpu_cores),
        ),
        (
            "Memory",
            share(u.memory_used_bytes, u.memory_total_bytes),
            format!(
                "{} of {}",
                bytes(u.memory_used_bytes),
                bytes(u.memory_total_bytes)
            ),
        ),
        (
            "Disk",
            share(
                u.disk_total_bytes.saturating_sub(u.disk_free_bytes),
                u.disk_total_bytes,
            ),
            format!(
                "{} free of {}",
                bytes(u.disk_free_bytes),
                bytes(u.disk_total_bytes)
            ),
        ),
    ];
    html! {
        svg.chart viewBox="0 0 400 96" role="img" aria-label="CPU, memory and disk use" {
            @for (i, (name, pct, text)) in bars.iter().enumerate() {
                @let y = i * 32;
                text x="0" y=(y + 14) class="axis" { (name) }
                rect x="70" y=(y + 2) width="320" height="16" rx="3" class="track" {}
                rect x="70" y=(y + 2) width=(format!("{:.1}", pct * 3.2)) height="16" rx="3" class="bar" {}
                text x="74" y=(y + 29) class="note" { (text) }
            }
        }
    }
}

fn bytes(n: u64) -> String {
    let gib = n as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.1} GiB")
    } else {
        format!("{:.0} MiB", n as f64 / (1u64 << 20) as f64)
    }
}

#[derive(Deserialize, Default)]
pub struct TasksQuery {
    state: Option<String>,
    #[serde(rename = "type")]
    task_type: Option<String>,
    agent: Option<String>,
    cursor: Option<String>,
}

pub async fn tasks(
    State(state): State<SharedState>,
    ui: UiCaller,
    Query(q): Query<TasksQuery>,
) -> Response {
    let agent = match nonempty(&q.agent)
        .map(|a| parse_id::<AgentId>(&a))
        .transpose()
    {
        Ok(a) => a,
        Err(e) => return error_page(&e),
    };
    let query = ListTasks {
        order: Some(ListOrder::Newest),
        state: parse(&q.state),
        agent_id: agent,
        task_type: nonempty(&q.task_type),
        cursor: nonempty(&q.cursor),
        limit: Some(PAGE),
    };
    let (task_state, task_type) = (query.state, query.task_type.clone());
    let live = match live(&state, &ui, String::new()).await {
        Ok(live) => live,
        Err(e) => return error_page(&e),
    };
    render(
        services::task_views::list(&state, &caller(&ui), query)
            .await
            .map(|list| {
                let next = list.next_cursor.map(|c| {
                    let mut params = vec![("cursor", c)];
                    if let Some(s) = task_state {
                        params.push(("state", s.as_str().to_string()));
                    }
                    if let Some(t) = &task_type {
                        params.push(("type", t.clone()));
                    }
                    if let Some(a) = agent {
                        params.push(("agent", a.to_string()));
                    }
                    format!("/tasks?{}", encode(&params))
                });
                page(
                    &ui,
                    Nav::Tasks,
                    "Tasks",
                    Some(live),
                    html! {
                        form.filters method="get" action="/tasks" {
                            label for="state" { "State" }
                            select #state name="state" {
                                option value="" { "any" }
                                @for s in TaskState::ALL {
                                    option value=(s.as_str()) selected[task_state == Some(s)] { (s.as_str()) }
                                }
                            }
                            label for="type" { "Type" }
                            input #type name="type" placeholder="docker.run" value=[task_type.as_deref()];
                            label for="agent" { "Agent id" }
                            input #agent name="agent" value=[agent.map(|a| a.to_string())];
                            button type="submit" { "Filter" }
                        }
                        (task_table(&list.items))
                        @if let Some(next) = next {
                            nav.pager aria-label="Pages" { a href=(next) rel="next" { "Next page →" } }
                        }
                    },
                )
            }),
    )
}

fn task_table(items: &[TaskView]) -> Markup {
    html! {
        @if items.is_empty() {
            p.muted { "None." }
        } @else {
            div.table { table {
                thead { tr { th { "Task" } th { "Type" } th { "State" } th { "Agent" } th { "Error" } th { "Updated" } } }
                tbody { @for t in items { tr data-task=(t.id) {
                    td { a href={ "/tasks/" (t.id) } { code { (short(&t.id.to_string())) } } }
                    td { (t.task_type) }
                    td { (badge(t.state.as_str())) @if t.read_back { " " span.badge data-state="read_back" { "read back" } } }
                    td { a href={ "/agents/" (t.agent_id) } { code { (short(&t.agent_id.to_string())) } } }
                    td { (opt(&t.error_code)) }
                    td { (time(Some(t.updated_at))) }
                } } }
            } }
        }
    }
}

pub async fn task(
    State(state): State<SharedState>,
    ui: UiCaller,
    Path(id): Path<String>,
) -> Response {
    let id: TaskId = match parse_id(&id) {
        Ok(id) => id,
        Err(e) => return error_page(&e),
    };
    let live = match live(&state, &ui, format!("task={id}")).await {
        Ok(live) => live,
        Err(e) => return error_page(&e),
    };
    render(
        services::task_views::get(&state, &caller(&ui), id)
            .await
            .map(|t| task_page(&ui, &t, live)),
    )
}

fn task_page(ui: &UiCaller, t: &TaskView, live: Live) -> Markup {
    let proof = if t.read_back {
        "read back: a read-sticker on the host named this task"
    } else if t.state == TaskState::Succeeded || t.state == TaskState::Failed {
        "verified: the agent's signature, its bound certificate and the session generation were checked when the result was recorded"
    } else if t.state == TaskState::Unknown {
        "unknown: the lease was lost after the task may have run; a read-back is pending"
    } else {
        "no result yet"
    };
    page(
        ui,
        Nav::Tasks,
        &format!("Task {}", short(&t.id.to_string())),
        Some(live),
        html! {
            dl.facts {
                dt { "Id" } dd { code { (t.id) } }
                dt { "Type" } dd { (t.task_type) }
                dt { "State" } dd { (badge(t.state.as_str())) }
                dt { "Proof" } dd { (proof) }
                dt { "Agent" } dd { a href={ "/agents/" (t.agent_id) } { code { (t.agent_id) } } }
                dt { "Error" } dd { (opt(&t.error_code)) }
                dt { "Created" } dd { (time(Some(t.created_at))) }
                dt { "Finished" } dd { (time(t.finished_at)) }
                @if let Some(of) = t.read_back_of {
                    dt { "Reads back" } dd { a href={ "/tasks/" (of) } { code { (of) } } }
                }
            }
            h2 { "Attempts" }
            @if t.attempts.is_empty() {
                p.muted { "Not delivered yet." }
            }
            @for (i, a) in t.attempts.iter().enumerate() {
                section.card {
                    h3 { "Attempt " (i + 1) " " (badge(a.state.as_str())) }
                    dl.facts {
                        dt { "Assignment" } dd { code { (a.assignment_id) } }
                        dt { "Generation" } dd { (a.generation) }
                        dt { "Assigned" } dd { (time(Some(a.assigned_at))) }
                        dt { "Started" } dd { (time(a.started_at)) }
                        dt { "Finished" } dd { (time(a.finished_at)) }
                        dt { "Error" } dd { (opt(&a.error_code)) }
                    }
                    @if let Some(result) = &a.result {
                        details {
                            summary { "Signed result as received" }
                            pre { code { (serde_json::to_string_pretty(result).unwrap_or_default()) } }
                        }
                    }
                }
            }
        },
    )
}

#[derive(Deserialize, Default)]
pub struct AuditQuery {
    after: Option<u64>,
}

pub async fn audit(
    State(state): State<SharedState>,
    ui: UiCaller,
    Query(q): Query<AuditQuery>,
) -> Response {
    let after = q.after.unwrap_or(0);
    let query = ListAudit {
        after,
        limit: Some(PAGE),
    };
    render(
        services::audit::list(&state, &caller(&ui), query)
            .await
            .map(|page_| {
                let chain = verify_chain(&page_.items, after);
                page(
                    &ui,
                    Nav::Audit,
                    "Audit log",
                    None,
                    html! {
                        p {
                            @match &chain {
                                Ok(n) => { span.badge data-state="succeeded" { "chain verified" } " " (n) " entries on this page: each hash is its entry's, each links to the previous one." }
                                Err(why) => { span.badge data-state="failed" { "chain broken" } " " (why) }
                            }
                        }
                        p { a href="/audit/export" download="berth-audit.jsonl" { "Export the whole log" } " (JSON lines, as " code { "berth audit export" } " writes them): " code { "berth audit verify FILE" } " checks it offline, with every result's signature." }
                        div.table { table {
                            thead { tr { th { "#" } th { "Time" } th { "Actor" } th { "Action" } th { "Subject" } } }
                            tbody { @for e in &page_.items { tr {
                                td { (e.seq) }
                                td { (time(Some(e.at))) }
                                td { (actor(&e.actor)) }
                                td { code { (e.action) } }
                                td { code.wrap { (e.subject) } }
                            } } }
                        } }
                        @if let Some(next) = page_.next {
                            nav.pager aria-label="Pages" { a href={ "/audit?after=" (next) } rel="next" { "Next page →" } }
                        }
                    },
                )
            }),
    )
}

/// `/audit/export`: the whole log as JSON lines, the format of `berth audit export`, so the
/// download checks offline with `berth audit verify`. Read a page of 1000 at a time through the
/// API's handler and streamed, so a long log is never held in memory whole.
pub async fn audit_export(State(state): State<SharedState>, ui: UiCaller) -> Response {
    let token = ui.caller.0.clone();
    let read = move |after: u64| {
        let state = state.clone();
        let caller = Caller(token.clone());
        async move {
            let query = ListAudit {
                after,
                limit: Some(1000),
            };
            let page = services::audit::list(&state, &caller, query).await?;
            let mut lines = Vec::new();
            for entry in &page.items {
                serde_json::to_writer(&mut lines, entry)
                    .map_err(|e| crate::infra::error::ApiError::internal(&e))?;
                lines.push(b'\n');
            }
            ApiResult::Ok((lines, page.next))
        }
    };
    // The first page is read before the response starts, so a viewer gets the API's refusal as
    // a page rather than an empty download.
    let (first, next) = match read(0).await {
        Ok(page) => page,
        Err(e) => return error_page(&e),
    };
    let rest = futures_util::stream::try_unfold(next, move |next| {
        let read = read.clone();
        async move {
            match next {
                Some(after) => read(after).await.map(|(lines, next)| Some((lines, next))),
                None => Ok(None),
            }
        }
    });
    let body = futures_util::stream::once(async { Ok(first) }).chain(rest);
    (
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (
                header::CONTENT_DISPOSITION,
                "attachment; filename=\"berth-audit.jsonl\"",
            ),
        ],
        Body::from_stream(body.map_err(|e: crate::infra::error::ApiError| {
            std::io::Error::other(format!("{}: {}", e.code, e.detail))
        })),
    )
        .into_response()
}

fn actor(a: &AuditActor) -> String {
    match a {
        AuditActor::Token { name, role, .. } => format!("{name} ({})", role.as_str()),
        AuditActor::Agent { id } => format!("agent {id}"),
        AuditActor::OpenbaoToken { environment, .. } => format!("OpenBao token of {environment}"),
    }
}

/// Checks the page's part of the chain with the same check as `berth audit verify` (without
/// the signatures, which need the CA); a page after the first cannot check its first link.
fn verify_chain(items: &[AuditEntry], after: u64) -> Result<u64, String> {
    berth_proto::audit::verify_chain(items, after).map_err(|f| format!("entry {}: {f}", f.seq()))
}

pub async fn environments(State(state): State<SharedState>, ui: UiCaller) -> Response {
    render(
        services::environments::list_environments(&state, &caller(&ui))
            .await
            .map(|list| {
                page(
                    &ui,
                    Nav::Environments,
                    "Environments",
                    None,
                    html! {
                        @if list.items.is_empty() {
                            p.muted { "No environments yet: " code { "berth env create" } "." }
                        } @else {
                            div.table { table {
                                thead { tr { th { "Environment" } th { "Tier" } th { "Selector" } th { "Current" } th { "Previous" } th { "Approvals" } } }
                                tbody { @for e in &list.items { tr {
                                    td { a href={ "/environments/" (e.name) } { (e.name) } }
                                    td { (e.tier.as_str()) }
                                    td { (labels(&e.selector)) }
                                    td { (opt(&e.current_release)) }
                                    td { (opt(&e.previous_release)) }
                                    td { (e.approvals) }
                                } } }
                            } }
                        }
                    },
                )
            }),
    )
}

pub async fn environment(
    State(state): State<SharedState>,
    ui: UiCaller,
    Path(name): Path<String>,
) -> Response {
    render(environment_page(&state, &ui, &name, None, None).await)
}

/// The environment with its targets; with `plan`, the dry run of a deploy and its confirm form;
/// with `notice`, a refusal of the last action.
pub(super) async fn environment_page(
    state: &SharedState,
    ui: &UiCaller,
    name: &str,
    plan: Option<&DeploymentPlan>,
    notice: Option<&crate::infra::error::ApiError>,
) -> ApiResult<Markup> {
    let cursor = state.store.latest_event_id(ui.caller.tenant()).await?;
    let status =
        services::environments::environment_status(state, &caller(ui), name.to_string()).await?;
    let history = services::environments::list(
        state,
        &caller(ui),
        ListDeployments {
            order: Some(ListOrder::Newest),
            environment: Some(name.to_string()),
            limit: Some(10),
            ..Default::default()
        },
    )
    .await?;
    let readiness =
        services::environments::get_readiness(state, &caller(ui), name.to_string()).await?;
    let env = &status.environment;
    let can_deploy = ui.caller.require_deployer().is_ok();
    let live = Live {
        filter: format!("environment={}", env.id),
        cursor,
    };
    let base = format!("/environments/{}", percent(&env.name));
    Ok(page(
        ui,
        Nav::Environments,
        &env.name,
        Some(live),
        html! {
            @if let Some(e) = notice {
                p.error role="alert" { code { (e.code) } ": " (e.detail) }
            }
            dl.facts {
                dt { "Tier" } dd { (env.tier.as_str()) }
                dt { "Selector" } dd { (labels(&env.selector)) }
                dt { "Current release" } dd { (opt(&env.current_release)) }
                dt { "Previous release" } dd { (opt(&env.previous_release)) }
                dt { "Pinned" } dd { (opt(&env.pinned_release)) }
                dt { "Approvals required" } dd { (env.approvals) }
            }
            h2 { "Targets" }
            @if status.targets.is_empty() {
                p.muted { "No agent matches the selector." }
            } @else {
                div.table { table {
                    thead { tr { th { "Agent" } th { "Desired" } th { "Running" } th { "Drift" } th { "Verified" } } }
                    tbody { @for t in &status.targets { tr {
                        td { a href={ "/agents/" (t.agent_id) } { (t.agent_name) } }
                        td { (opt(&t.desired_release)) }
                        td { (opt(&t.running_release)) }
                        td { (badge(t.drift.as_str())) }
                        td { (time(t.verified_at)) }
                    } } }
                } }
            }
            (readiness_view(&readiness, can_deploy.then_some((ui, base.as_str()))))
            @if can_deploy {
                section aria-labelledby="deploy" {
                    h2 #deploy { "Deploy" }
                    @if let Some(plan) = plan {
                        (plan_view(plan))
                        form.inline method="post" action={ (base) "/deploy" } {
                            (layout::csrf(ui))
                            input type="hidden" name="release" value=(plan.release);
                            button.primary type="submit" data-action="deploy" { "Deploy " (plan.release) " to " (plan.environment) }
                            " "
                            a href=(base) { "Cancel" }
                        }
                    } @else {
                        form.inline method="post" action={ (base) "/plan" } {
                            (layout::csrf(ui))
                            label for="release" { "Release" }
                            input #release name="release" required;
                            button type="submit" data-action="plan" { "Show the plan" }
                        }
                    }
                    @if env.previous_release.is_some() {
                        form.inline method="post" action={ (base) "/rollback" } {
                            (layout::csrf(ui))
                            button.danger type="submit" data-action="rollback" { "Roll back to " (opt(&env.previous_release)) }
                        }
                    }
                }
            }
            h2 { "Deployments" }
            (deployment_table(&history.items))
        },
    ))
}

/// The environment's conditions, as `berth env verify` prints them; with `verify` (a deployer's
/// session and the environment's path), the form that asks for a fresh pass.
fn readiness_view(r: &EnvironmentReadiness, verify: Option<(&UiCaller, &str)>) -> Markup {
    let pending = r.verify_request.is_some() && r.verify_request != r.verify_observed;
    html! {
        section aria-labelledby="readiness" {
            h2 #readiness { "Readiness" }
            p {
                @if r.operational_ready { span.badge data-state="succeeded" { "operational ready" } }
                @else { span.badge data-state="failed" { "not ready" } }
                " for generation " (r.generation)
                @if pending { " · " span.badge data-state="running" { "verifying" } " a fresh pass is running" }
                @else if r.verify_request.is_some() { " · the last verify was answered" }
            }
            @if r.conditions.is_empty() {
                p.muted { "No pass has run yet." }
            } @else {
                div.table { table.conditions {
                    thead { tr { th { "Condition" } th { "Status" } th { "Reason" } th { "Detail" } th { "Observed" } } }
                    tbody { @for c in &r.conditions { tr data-condition=(c.kind.as_str()) {
                        td { (c.kind.as_str()) }
                        td { span.badge data-state=(condition_state(c.status)) { (c.status.as_str()) } }
                        td { code { (c.reason) } }
                        td { (c.message) }
                        td { (time(Some(c.observed_at))) }
                    } } }
                } }
            }
            @if let Some((ui, base)) = verify {
                form.inline method="post" action={ (base) "/verify" } {
                    (layout::csrf(ui))
                    button type="submit" data-action="verify" { "Verify now" }
                    " " span.muted { "a completely fresh pass; nothing from earlier passes is reused" }
                }
            }
        }
    }
}

/// A condition status as a badge state: the badge colours are the task states'.
fn condition_state(status: ConditionStatus) -> &'static str {
    match status {
        ConditionStatus::True => "succeeded",
        ConditionStatus::False => "failed",
        ConditionStatus::Unknown => "running",
    }
}

fn plan_view(plan: &DeploymentPlan) -> Markup {
    html! {
        div.card {
            p { "Plan: " strong { (plan.release) } " to " strong { (plan.environment) }
                @if plan.approvals > 0 { ", then " (plan.approvals) " approval(s)" }
                @if let Some(r) = &plan.rollback_release { "; on failure back to " (r) } "." }
            ol.waves { @for w in &plan.waves { li {
                "Wave " (w.wave) ": "
                @for (i, t) in w.targets.iter().enumerate() {
                    @if i > 0 { ", " }
                    (t.agent_name) " (now " (t.current_release.as_deref().unwrap_or("unknown")) ")"
                }
            } } }
        }
    }
}

pub async fn deployment(
    State(state): State<SharedState>,
    ui: UiCaller,
    Path(id): Path<String>,
) -> Response {
    render(deployment_page(&state, &ui, &id, None).await)
}

pub(super) async fn deployment_page(
    state: &SharedState,
    ui: &UiCaller,
    id: &str,
    notice: Option<&crate::infra::error::ApiError>,
) -> ApiResult<Markup> {
    let id: DeploymentId = parse_id(id)?;
    let live = live(state, ui, format!("deployment={id}")).await?;
    let d = services::environments::get(state, &caller(ui), id).await?;
    // The requester cannot approve its own deployment (the API's SELF_APPROVAL), nor can a
    // token approve twice: neither sees the button.
    let token = ui.caller.0.id.0;
    let is_token =
        |actor: &AuditActor| matches!(actor, AuditActor::Token { id, .. } if *id == token);
    let can_approve = ui.caller.require_deployer().is_ok()
        && d.state == berth_proto::deploy::DeploymentState::AwaitingApproval
        && !is_token(&d.requested_by)
        && !d.approvals.iter().any(|a| is_token(&a.by));
    let timeline = phase_history(state, ui, &d).await?;
    let failed = failed_tasks(state, ui, &d).await?;
    let mut waves: BTreeMap<u32, Vec<_>> = BTreeMap::new();
    for t in &d.targets {
        waves.entry(t.wave).or_default().push(t);
    }
    Ok(page(
        ui,
        Nav::Environments,
        &format!("Deployment {}", short(&d.id.to_string())),
        Some(live),
        html! {
            @if let Some(e) = notice {
                p.error role="alert" { code { (e.code) } ": " (e.detail) }
            }
            dl.facts {
                dt { "Environment" } dd { a href={ "/environments/" (percent(&d.environment)) } { (d.environment) } }
                dt { "Release" } dd { (d.release) }
                dt { "State" } dd { (badge(d.state.as_str())) @if d.rolling_back && d.state.is_active() { " " (badge("rolling_back")) } }
                dt { "Requested by" } dd { (actor(&d.requested_by)) }
                dt { "Approvals" } dd { (d.approvals.len()) " of " (d.approvals_required) }
                dt { "Error" } dd { (opt(&d.error_code)) @if let Some(detail) = &d.detail { " " span.muted { (detail) } } }
            }
            @if can_approve {
                form.inline method="post" action={ "/deployments/" (d.id) "/approve" } {
                    (layout::csrf(ui))
                    button.primary type="submit" data-action="approve" { "Approve" }
                }
            }
            @if !timeline.is_empty() {
                section aria-labelledby="timeline" {
                    h2 #timeline { "Timeline" }
                    (timeline_chart(&timeline))
                }
            }
            @for (wave, targets) in &waves {
                section.card {
                    h2 { "Wave " (wave) @if *wave == d.current_wave { " " span.muted { "(current)" } } }
                    ul.targets { @for t in targets {
                        li data-agent=(t.agent_id) {
                            a href={ "/agents/" (t.agent_id) } { (t.agent_name) } " "
                            (badge(t.phase.as_str()))
                            @if let Some(code) = &t.error_code { " " code { (code) } }
                            @if let Some(detail) = &t.detail { " " span.muted { (detail) } }
                            @for task in failed.get(&t.agent_id).into_iter().flatten() {
                                details.log {
                                    summary {
                                        "Task " a href={ "/tasks/" (task.id) } { code { (short(&task.id.to_string())) } }
                                        " failed" @if let Some(code) = &task.error_code { ": " code.failure { (code) } }
                                    }
                                    @if task.tail.is_empty() { p.muted { "Its log is empty." } } @else { pre { code { (task.tail) } } }
                                }
                            }
                        }
                    } }
                }
            }
        },
    ))
}

/// Lines of a task's log shown on the deployment page.
const LOG_TAIL_LINES: usize = 20;

/// A failed task of a deployment target: its id, its error code and the last lines of its log.
struct FailedTask {
    id: TaskId,
    error_code: Option<String>,
    tail: String,
}

/// The failed tasks among each target's last deployment task and last rollback task, for the
/// targets that went wrong (`TargetPhase::is_failure`: failed, rolled back, or whose rollback
/// failed too; a rolled-back target's own code is cleared by its rollback; the failure stays in
/// its task). The agent redacts a log before it signs the result
/// (every credential and secret value becomes `***`): the page shows that log as received.
async fn failed_tasks(
    state: &SharedState,
    ui: &UiCaller,
    d: &DeploymentView,
) -> ApiResult<BTreeMap<AgentId, Vec<FailedTask>>> {
    let mut failed: BTreeMap<AgentId, Vec<FailedTask>> = BTreeMap::new();
    let ended_badly = d.targets.iter().filter(|t| t.phase.is_failure());
    for t in ended_badly.take(PAGE as usize) {
        for id in [t.tasks.last(), t.rollback_tasks.last()]
            .into_iter()
            .flatten()
        {
            let task = services::task_views::get(state, &caller(ui), *id).await?;
            if task.state != TaskState::Failed {
                continue;
            }
            let logs = task.result.as_ref().and_then(|r| r.pointer("/logs"));
            let lines: Vec<&str> = logs
                .and_then(|l| l.as_str())
                .unwrap_or("")
                .lines()
                .collect();
            failed.entry(t.agent_id).or_default().push(FailedTask {
                id: *id,
                error_code: task.error_code,
                tail: lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n"),
            });
        }
    }
    Ok(failed)
}

/// Each target's phases with the time each began, from the deployment's `deployment.target`
/// events (the store's event log: the same rows the stream sends), in the targets' order.
type Timeline = Vec<(String, Vec<(OffsetDateTime, TargetPhase)>)>;

async fn phase_history(
    state: &SharedState,
    ui: &UiCaller,
    d: &DeploymentView,
) -> ApiResult<Timeline> {
    let filter = EventFilter {
        deployment: Some(d.id),
        ..Default::default()
    };
    let events = state
        .store
        .read_events(ui.caller.tenant(), &filter, 0, 1000)
        .await?;
    let mut timeline: Timeline = d
        .targets
        .iter()
        .map(|t| (t.agent_name.clone(), Vec::new()))
        .collect();
    for e in events.iter().filter(|e| e.kind == DEPLOYMENT_TARGET_EVENT) {
        let Ok(data) = serde_json::from_value::<DeploymentTargetEvent>(e.data.clone()) else {
            continue;
        };
        if let Some(i) = d.targets.iter().position(|t| t.agent_id == data.agent_id) {
            timeline[i].1.push((e.created_at, data.phase));
        }
    }
    timeline.retain(|(_, phases)| !phases.is_empty());
    Ok(timeline)
}

/// The timeline as an SVG: a row per target, a bar per phase from its start to the next one's
/// (the last one to the latest event), coloured by phase; time runs from the first phase change.
fn timeline_chart(timeline: &Timeline) -> Markup {
    let times = || timeline.iter().flat_map(|(_, p)| p.iter().map(|(t, _)| *t));
    let (Some(start), Some(end)) = (times().min(), times().max()) else {
        return html! {};
    };
    let span = (end - start).as_seconds_f64().max(1.0);
    let (label_w, bar_w, row_h) = (110.0, 480.0, 26.0);
    let x = |t: OffsetDateTime| label_w + (t - start).as_seconds_f64().max(0.0) / span * bar_w;
    let height = timeline.len() as f64 * row_h + 18.0;
    html! {
        svg.timeline viewBox={ "0 0 600 " (height) } role="img" aria-label="Each target's phases over time" {
            @for (row, (name, phases)) in timeline.iter().enumerate() {
                @let y = row as f64 * row_h;
                text x="0" y=(y + 16.0) class="axis" { (name) }
                @for (i, (at, phase)) in phases.iter().enumerate() {
                    @let x0 = x(*at);
                    @let x1 = phases.get(i + 1).map_or(label_w + bar_w, |(next, _)| x(*next));
                    // A phase that began at the last event has no length yet: a visible stub.
                    rect x=(format!("{x0:.1}")) y=(y + 4.0) width=(format!("{:.1}", (x1 - x0).max(6.0))) height="16" data-phase=(phase.as_str()) data-tone=(tone(*phase)) {
                        title { (phase.as_str()) " from " (at.time().to_string()) }
                    }
                }
            }
            text x=(label_w) y=(height - 2.0) class="note" { "0 s" }
            text x=(label_w + bar_w) y=(height - 2.0) class="note" text-anchor="end" { (format!("{span:.0} s")) }
        }
        ul.legend aria-label="Phases" {
            @for phase in TargetPhase::ALL.iter().filter(|p| timeline.iter().any(|(_, ps)| ps.iter().any(|(_, q)| q == *p))) {
                li { i data-tone=(tone(*phase)) {} (phase.as_str()) }
            }
        }
    }
}

/// A phase's colour on the timeline: working, done, in doubt or undoing, failed, or waiting.
fn tone(phase: TargetPhase) -> &'static str {
    use TargetPhase::*;
    match phase {
        Deploying | Pulling | Starting | Health => "working",
        Succeeded => "ok",
        RollingBack | Unknown => "warn",
        Failed | RolledBack | RollbackFailed => "bad",
        Waiting | Queued | Skipped => "idle",
    }
}
