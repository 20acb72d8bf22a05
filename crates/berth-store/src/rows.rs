//! What both backends share about rows: timestamps at millisecond precision, reading a row into
//! a domain type, merging labels, and naming the unique constraint a write collided with.
//! It holds no SQL that runs and never touches a connection, so the backends cannot drift.

use std::collections::BTreeMap;

use berth_proto::admin::Role;
use berth_proto::agent::{AgentStatus, Capability, ResourceUsage};
use berth_proto::task::ListOrder;
use berth_proto::transport::ProgressPhase;
use berth_proto::{
    AgentId, AssignmentId, DeploymentId, EnvironmentId, ReleaseId, SshTargetId, TaskId, TenantId,
    TokenId,
};
use sqlx::error::ErrorKind;
use time::{Duration, OffsetDateTime, UtcOffset};
use uuid::Uuid;

use berth_proto::audit::AuditActor;
use berth_proto::deploy::{DeploymentKind, DeploymentState, Drift, TargetPhase, TargetType, Tier};

use crate::{
    Agent, ApiToken, Approval, Artifact, Attempt, AttemptState, Deployment, DeploymentTarget,
    Environment, Event, Grant, GrantKind, HeartbeatRecord, Page, PayloadKey, Release, ReleaseRef,
    SealedSecret, SecretMeta, SshTarget, StoreError, TargetObservation, Task, TaskState, Tenant,
};

/// The agent columns every `SELECT`/`RETURNING` reads, in the order [`read_agent`] expects.
/// A macro, not a const, so it can be `concat!`ed into `'static` query strings.
macro_rules! agent_columns {
    () => {
        "id, tenant_id, name, version, capabilities, labels, status, reported_status, \
         environment, last_heartbeat, resource_usage, certificate_fingerprint, \
         certificate_expires_at, previous_certificate_fingerprint, cordoned, suspended, \
         generation, created_at, updated_at"
    };
}
pub(crate) use agent_columns;

/// The task columns every `SELECT`/`RETURNING` reads, in the order [`read_task`] expects.
macro_rules! task_columns {
    () => {
        "id, tenant_id, task_type, agent_id, payload, credentials_sealed, variables, \
         timeout_seconds, priority, side_effects, idempotency_key, request_hash, read_back_of, \
         state, attempts, next_attempt_at, current_assignment, lease_expires_at, \
         cancel_requested, read_back, error_code, result, created_at, updated_at, finished_at"
    };
}
pub(crate) use task_columns;

/// The attempt columns, in the order [`read_attempt`] expects.
macro_rules! attempt_columns {
    () => {
        "assignment_id, task_id, agent_id, generation, state, assigned_at, lease_expires_at, \
         finished_at, envelope, error_code, start_handshake, started_at, phase"
    };
}
pub(crate) use attempt_columns;

/// Truncates to whole milliseconds in UTC: the precision both backends store, so a value reads
/// back equal to what was written on either.
pub(crate) fn millis(t: OffsetDateTime) -> OffsetDateTime {
    let t = t.to_offset(UtcOffset::UTC);
    // `nanosecond()` is the non-negative part within the second, also before 1970.
    t - Duration::nanoseconds(i64::from(t.nanosecond() % 1_000_000))
}

/// Unix milliseconds, as SQLite stores timestamps.
pub(crate) fn unix_millis(t: OffsetDateTime) -> i64 {
    // `time` is limited to ±9999 years, about ±3.2e14 ms, far inside i64.
    millis(t).unix_timestamp_nanos().div_euclid(1_000_000) as i64
}

pub(crate) fn from_unix_millis(column: &str, ms: i64) -> Result<OffsetDateTime, StoreError> {
    OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .map_err(|e| StoreError::Corrupt(format!("{column}: {ms} ms is out of range: {e}")))
}

/// Reads the columns whose native types differ between backends (ids, timestamps, JSON), so
/// one function per domain type can read a row from either.
pub(crate) trait ColumnReader {
    fn uuid(&self, column: &'static str) -> Result<Uuid, StoreError>;
    fn time(&self, column: &'static str) -> Result<OffsetDateTime, StoreError>;
    fn time_opt(&self, column: &'static str) -> Result<Option<OffsetDateTime>, StoreError>;
    fn text(&self, column: &'static str) -> Result<String, StoreError>;
    fn text_opt(&self, column: &'static str) -> Result<Option<String>, StoreError>;
    fn flag(&self, column: &'static str) -> Result<bool, StoreError>;
    fn json(&self, column: &'static str) -> Result<serde_json::Value, StoreError>;
    fn json_opt(&self, column: &'static str) -> Result<Option<serde_json::Value>, StoreError>;
    fn uuid_opt(&self, column: &'static str) -> Result<Option<Uuid>, StoreError>;
    /// Every integer column is 64-bit on both backends (`BIGINT` / `INTEGER`).
    fn int(&self, column: &'static str) -> Result<i64, StoreError>;
    fn bytes_opt(&self, column: &'static str) -> Result<Option<Vec<u8>>, StoreError>;
}

/// `Row::try_get` with a decode failure reported as a corrupt row, naming the column.
pub(crate) fn get<'r, R, T>(row: &'r R, column: &'static str) -> Result<T, StoreError>
where
    R: sqlx::Row,
    &'static str: sqlx::ColumnIndex<R>,
    T: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
{
    row.try_get(column)
        .map_err(|e| StoreError::Corrupt(format!("column {column}: {e}")))
}

fn status(column: &str, s: &str) -> Result<AgentStatus, StoreError> {
    AgentStatus::parse(s)
        .ok_or_else(|| StoreError::Corrupt(format!("{column}: unknown status {s:?}")))
}

fn labels(column: &str, v: serde_json::Value) -> Result<BTreeMap<String, String>, StoreError> {
    serde_json::from_value(v).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

/// The release columns every `SELECT`/`RETURNING` reads.
macro_rules! release_columns {
    () => {
        "id, tenant_id, name, components, compose_lock, ssh, created_at"
    };
}
pub(crate) use release_columns;

pub(crate) fn read_release(row: &impl ColumnReader) -> Result<Release, StoreError> {
    Ok(Release {
        id: ReleaseId(row.uuid("id")?),
        tenant_id: TenantId(row.uuid("tenant_id")?),
        name: row.text("name")?,
        components: serde_json::from_value(row.json("components")?)
            .map_err(|e| StoreError::Corrupt(format!("releases.components: {e}")))?,
        compose_lock: row.text_opt("compose_lock")?,
        ssh: row
            .json_opt("ssh")?
            .map(|v| from_json("releases.ssh", v))
            .transpose()?,
        created_at: row.time("created_at")?,
    })
}

pub(crate) fn read_tenant(row: &impl ColumnReader) -> Result<Tenant, StoreError> {
    Ok(Tenant {
        id: TenantId(row.uuid("id")?),
        name: row.text("name")?,
        created_at: row.time("created_at")?,
    })
}

pub(crate) fn read_api_token(row: &impl ColumnReader) -> Result<ApiToken, StoreError> {
    let role = row.text("role")?;
    Ok(ApiToken {
        id: TokenId(row.uuid("id")?),
        tenant_id: TenantId(row.uuid("tenant_id")?),
        name: row.text("name")?,
        role: Role::parse(&role).ok_or_else(|| {
            StoreError::Corrupt(format!("api_tokens.role: unknown role {role:?}"))
        })?,
        operator: row.flag("operator")?,
        created_at: row.time("created_at")?,
    })
}

/// What a consumed registration token hands on to the agent it admits.
pub(crate) struct ConsumedToken {
    pub tenant_id: TenantId,
    pub labels: BTreeMap<String, String>,
    pub environment: Option<String>,
}

pub(crate) fn read_consumed_token(row: &impl ColumnReader) -> Result<ConsumedToken, StoreError> {
    Ok(ConsumedToken {
        tenant_id: TenantId(row.uuid("tenant_id")?),
        labels: labels("registration_tokens.labels", row.json("labels")?)?,
        environment: row.text_opt("environment")?,
    })
}

pub(crate) fn read_agent(row: &impl ColumnReader) -> Result<Agent, StoreError> {
    let capabilities: Vec<Capability> = serde_json::from_value(row.json("capabilities")?)
        .map_err(|e| StoreError::Corrupt(format!("agents.capabilities: {e}")))?;
    let resource_usage: Option<ResourceUsage> = row
        .json_opt("resource_usage")?
        .map(serde_json::from_value)
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("agents.resource_usage: {e}")))?;
    Ok(Agent {
        id: AgentId(row.uuid("id")?),
        tenant_id: TenantId(row.uuid("tenant_id")?),
        name: row.text("name")?,
        version: row.text("version")?,
        capabilities,
        labels: labels("agents.labels", row.json("labels")?)?,
        status: status("agents.status", &row.text("status")?)?,
        reported_status: status("agents.reported_status", &row.text("reported_status")?)?,
        environment: row.text_opt("environment")?,
        last_heartbeat: row.time_opt("last_heartbeat")?,
        resource_usage,
        certificate_fingerprint: row.text_opt("certificate_fingerprint")?,
        certificate_expires_at: row.time_opt("certificate_expires_at")?,
        previous_certificate_fingerprint: row.text_opt("previous_certificate_fingerprint")?,
        cordoned: row.flag("cordoned")?,
        suspended: row.flag("suspended")?,
        generation: row.int("generation")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
    })
}

/// Which page of a list by id: the ids past the cursor `after` (the previous page's last id), in
/// `order`, at most `limit`.
pub(crate) struct PageRequest {
    pub after: Option<Uuid>,
    pub order: ListOrder,
    pub limit: u32,
}

/// A paged list's SQL by id for `order`: the condition after the cursor (followed by the cursor's
/// bound id) and the `ORDER BY`. The same on both backends.
pub(crate) fn order_sql(order: ListOrder) -> (&'static str, &'static str) {
    match order {
        ListOrder::Oldest => (" AND id > ", " ORDER BY id"),
        ListOrder::Newest => (" AND id < ", " ORDER BY id DESC"),
    }
}

fn narrow<T: TryFrom<i64>>(column: &str, v: i64) -> Result<T, StoreError> {
    T::try_from(v).map_err(|_| StoreError::Corrupt(format!("{column}: {v} is out of range")))
}

/// A task row, its payload opened with `key`.
pub(crate) fn read_task(row: &impl ColumnReader, key: &PayloadKey) -> Result<Task, StoreError> {
    let state = row.text("state")?;
    let id = TaskId(row.uuid("id")?);
    Ok(Task {
        id,
        tenant_id: TenantId(row.uuid("tenant_id")?),
        task_type: row.text("task_type")?,
        agent_id: AgentId(row.uuid("agent_id")?),
        payload: key.open(id, row.json("payload")?)?,
        credentials_sealed: row.bytes_opt("credentials_sealed")?,
        variables: labels("tasks.variables", row.json("variables")?)?,
        timeout_seconds: narrow("tasks.timeout_seconds", row.int("timeout_seconds")?)?,
        priority: narrow("tasks.priority", row.int("priority")?)?,
        side_effects: row.flag("side_effects")?,
        idempotency_key: row.text_opt("idempotency_key")?,
        read_back_of: row.uuid_opt("read_back_of")?.map(TaskId),
        state: TaskState::parse(&state)
            .ok_or_else(|| StoreError::Corrupt(format!("tasks.state: unknown state {state:?}")))?,
        attempts: narrow("tasks.attempts", row.int("attempts")?)?,
        next_attempt_at: row.time_opt("next_attempt_at")?,
        current_assignment: row.uuid_opt("current_assignment")?.map(AssignmentId),
        lease_expires_at: row.time_opt("lease_expires_at")?,
        cancel_requested: row.flag("cancel_requested")?,
        read_back: row.flag("read_back")?,
        error_code: row.text_opt("error_code")?,
        result: row.json_opt("result")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
        finished_at: row.time_opt("finished_at")?,
    })
}

pub(crate) fn read_attempt(row: &impl ColumnReader) -> Result<Attempt, StoreError> {
    let state = row.text("state")?;
    Ok(Attempt {
        assignment_id: AssignmentId(row.uuid("assignment_id")?),
        task_id: TaskId(row.uuid("task_id")?),
        agent_id: AgentId(row.uuid("agent_id")?),
        generation: row.int("generation")?,
        state: AttemptState::parse(&state).ok_or_else(|| {
            StoreError::Corrupt(format!("task_attempts.state: unknown state {state:?}"))
        })?,
        assigned_at: row.time("assigned_at")?,
        lease_expires_at: row.time("lease_expires_at")?,
        finished_at: row.time_opt("finished_at")?,
        envelope: row.json_opt("envelope")?,
        error_code: row.text_opt("error_code")?,
        start_handshake: row.flag("start_handshake")?,
        started_at: row.time_opt("started_at")?,
        phase: match row.text_opt("phase")? {
            None => None,
            Some(p) => Some(ProgressPhase::parse(&p).ok_or_else(|| {
                StoreError::Corrupt(format!("task_attempts.phase: unknown phase {p:?}"))
            })?),
        },
    })
}

/// The agent's own labels with the token's laid over them: the admin who minted the token
/// decides placement labels, not the host that presents it.
pub(crate) fn merge_labels(
    mut agent: BTreeMap<String, String>,
    token: BTreeMap<String, String>,
) -> BTreeMap<String, String> {
    agent.extend(token);
    agent
}

/// Batch positions in agent-id order (stable, so repeats keep their batch order). Every writer
/// takes row locks in this one order, so two concurrent batches cannot deadlock each other.
pub(crate) fn lock_order(batch: &[HeartbeatRecord]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..batch.len()).collect();
    order.sort_by_key(|&i| batch[i].agent_id);
    order
}

/// A full page may have a successor; its last id is the cursor for it.
pub(crate) fn page<T>(items: Vec<T>, limit: u32, id: impl Fn(&T) -> Uuid) -> Page<T> {
    let full = items.len() >= limit as usize;
    let next = if full { items.last().map(id) } else { None };
    Page { items, next }
}

/// Unique constraints by their PostgreSQL name, the columns SQLite's message names
/// ("UNIQUE constraint failed: <columns>"), and the name `StoreError::Conflict` reports.
const UNIQUE_CONSTRAINTS: &[(&str, &str, &str)] = &[
    ("tenants_pkey", "tenants.id", "tenant_id"),
    ("tenants_name_key", "tenants.name", "tenant_name"),
    ("api_tokens_pkey", "api_tokens.id", "api_token_id"),
    (
        "api_tokens_token_hash_key",
        "api_tokens.token_hash",
        "api_token_hash",
    ),
    (
        "registration_tokens_pkey",
        "registration_tokens.id",
        "registration_token_id",
    ),
    (
        "registration_tokens_token_hash_key",
        "registration_tokens.token_hash",
        "registration_token_hash",
    ),
    ("agents_pkey", "agents.id", "agent_id"),
    (
        "agents_tenant_id_name_key",
        "agents.tenant_id, agents.name",
        "agent_name",
    ),
    (
        "agents_certificate_fingerprint_key",
        "agents.certificate_fingerprint",
        "agent_certificate",
    ),
    ("tasks_pkey", "tasks.id", "task_id"),
    (
        "tasks_tenant_id_idempotency_key_key",
        "tasks.tenant_id, tasks.idempotency_key",
        "task_idempotency_key",
    ),
    (
        "task_attempts_pkey",
        "task_attempts.assignment_id",
        "assignment_id",
    ),
    ("releases_pkey", "releases.id", "release_id"),
    (
        "releases_tenant_id_name_key",
        "releases.tenant_id, releases.name",
        "release_name",
    ),
    ("environments_pkey", "environments.id", "environment_id"),
    (
        "environments_tenant_id_name_key",
        "environments.tenant_id, environments.name",
        "environment_name",
    ),
    ("deployments_pkey", "deployments.id", "deployment_id"),
    // The partial unique index: one pending, awaiting or running deployment per environment.
    (
        "deployments_one_active",
        "deployments.environment_id",
        "deployment_in_progress",
    ),
    (
        "deployment_targets_pkey",
        "deployment_targets.deployment_id, deployment_targets.agent_id",
        "deployment_target",
    ),
    (
        "secrets_pkey",
        "secrets.tenant_id, secrets.key, secrets.version",
        "secret_version",
    ),
    ("grants_pkey", "grants.jti", "grant_jti"),
    (
        "ssh_targets_tenant_id_name_key",
        "ssh_targets.tenant_id, ssh_targets.name",
        "ssh_target_name",
    ),
    (
        "webhooks_tenant_id_name_key",
        "webhooks.tenant_id, webhooks.name",
        "webhook_name",
    ),
];

/// The `Conflict` name of the unique constraint `err` violated, if it is a known one.
pub(crate) fn unique_violation(err: &sqlx::Error) -> Option<&'static str> {
    let sqlx::Error::Database(db) = err else {
        return None;
    };
    if db.kind() != ErrorKind::UniqueViolation {
        return None;
    }
    if let Some(constraint) = db.constraint() {
        return UNIQUE_CONSTRAINTS
            .iter()
            .find(|(pg, _, _)| *pg == constraint)
            .map(|(_, _, name)| *name);
    }
    sqlite_unique_violation(db.message())
}

/// The `Conflict` name for SQLite's message about a unique violation, which names columns.
pub(crate) fn sqlite_unique_violation(message: &str) -> Option<&'static str> {
    let columns = message.strip_prefix("UNIQUE constraint failed: ")?;
    UNIQUE_CONSTRAINTS
        .iter()
        .find(|(_, sqlite, _)| *sqlite == columns)
        .map(|(_, _, name)| *name)
}

/// Maps a failed statement: a known unique violation becomes `Conflict`, a timeout `Timeout`,
/// anything else keeps its source under the name of the operation.
pub(crate) fn db_error(operation: &'static str) -> impl FnOnce(sqlx::Error) -> StoreError {
    move |source| match unique_violation(&source) {
        Some(constraint) => StoreError::Conflict { constraint },
        None if is_timeout(&source) => StoreError::Timeout { operation, source },
        None => StoreError::Database { operation, source },
    }
}

/// PostgreSQL's `query_canceled`: what a statement past `statement_timeout` fails with. berth
/// never cancels a statement itself, so here it means the timeout.
const QUERY_CANCELED: &str = "57014";

/// A statement cancelled by `statement_timeout`, or no pooled connection within the acquire
/// timeout: the database was too slow or too busy, not the request wrong.
fn is_timeout(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => db.code().as_deref() == Some(QUERY_CANCELED),
        _ => false,
    }
}

/// An environment with its releases' names: a derived table, so callers append conditions on
/// its plain column names (`WHERE tenant_id = … AND id > …`) without ambiguity.
macro_rules! environment_rows {
    () => {
        "SELECT * FROM (SELECT e.id, e.tenant_id, e.name, e.tier, e.selector, e.target_type, \
         e.policy, \
         e.promote_from, e.approvals, e.auto_heal, e.drift_interval_secs, \
         e.current_release_id, cr.name AS current_release_name, \
         e.previous_release_id, pr.name AS previous_release_name, \
         e.pinned_release_id, pn.name AS pinned_release_name, \
         e.created_by, e.created_at, e.updated_at \
         FROM environments e \
         LEFT JOIN releases cr ON cr.id = e.current_release_id \
         LEFT JOIN releases pr ON pr.id = e.previous_release_id \
         LEFT JOIN releases pn ON pn.id = e.pinned_release_id) AS environment WHERE "
    };
}
pub(crate) use environment_rows;

/// A deployment with its environment's and releases' names, as [`environment_rows`].
macro_rules! deployment_rows {
    () => {
        "SELECT * FROM (SELECT d.id, d.tenant_id, d.environment_id, \
         e.name AS environment_name, d.release_id, r.name AS release_name, d.kind, d.state, \
         d.rolling_back, d.requested_by, d.rollback_release_id, \
         rr.name AS rollback_release_name, d.approvals_required, d.cancel_requested, \
         d.current_wave, d.error_code, d.detail, d.version, d.created_at, d.updated_at, \
         d.finished_at \
         FROM deployments d \
         JOIN environments e ON e.id = d.environment_id \
         JOIN releases r ON r.id = d.release_id \
         LEFT JOIN releases rr ON rr.id = d.rollback_release_id) AS deployment WHERE "
    };
}
pub(crate) use deployment_rows;

/// The deployment target columns, in the order [`read_deployment_target`] reads.
macro_rules! target_columns {
    () => {
        "deployment_id, agent_id, agent_name, wave, phase, tasks, rollback_tasks, error_code, \
         detail, started_at, finished_at"
    };
}
pub(crate) use target_columns;

macro_rules! observation_columns {
    () => {
        "environment_id, agent_id, tenant_id, check_task_id, next_check_at, drift, \
         running_release, components, verified_at"
    };
}
pub(crate) use observation_columns;

fn from_json<T: serde::de::DeserializeOwned>(
    column: &str,
    v: serde_json::Value,
) -> Result<T, StoreError> {
    serde_json::from_value(v).map_err(|e| StoreError::Corrupt(format!("{column}: {e}")))
}

fn unknown(column: &str, value: &str) -> StoreError {
    StoreError::Corrupt(format!("{column}: unknown value {value:?}"))
}

/// A release id column and its joined name column.
fn release_ref(
    row: &impl ColumnReader,
    id: &'static str,
    name: &'static str,
) -> Result<Option<ReleaseRef>, StoreError> {
    let Some(release) = row.uuid_opt(id)? else {
        return Ok(None);
    };
    let name = row
        .text_opt(name)?
        .ok_or_else(|| StoreError::Corrupt(format!("{id}: no such release")))?;
    Ok(Some(ReleaseRef {
        id: ReleaseId(release),
        name,
    }))
}

pub(crate) fn read_environment(row: &impl ColumnReader) -> Result<Environment, StoreError> {
    let tier = row.text("tier")?;
    Ok(Environment {
        id: EnvironmentId(row.uuid("id")?),
        tenant_id: TenantId(row.uuid("tenant_id")?),
        name: row.text("name")?,
        tier: Tier::parse(&tier).ok_or_else(|| unknown("environments.tier", &tier))?,
        selector: labels("environments.selector", row.json("selector")?)?,
        target_type: {
            let t = row.text("target_type")?;
            TargetType::parse(&t).ok_or_else(|| unknown("environments.target_type", &t))?
        },
        policy: from_json("environments.policy", row.json("policy")?)?,
        promote_from: row.text_opt("promote_from")?,
        approvals: narrow("environments.approvals", row.int("approvals")?)?,
        auto_heal: row.flag("auto_heal")?,
        drift_interval_secs: narrow(
            "environments.drift_interval_secs",
            row.int("drift_interval_secs")?,
        )?,
        current_release: release_ref(row, "current_release_id", "current_release_name")?,
        previous_release: release_ref(row, "previous_release_id", "previous_release_name")?,
        pinned_release: release_ref(row, "pinned_release_id", "pinned_release_name")?,
        created_by: from_json("environments.created_by", row.json("created_by")?)?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
    })
}

pub(crate) fn read_deployment(row: &impl ColumnReader) -> Result<Deployment, StoreError> {
    let kind = row.text("kind")?;
    let state = row.text("state")?;
    Ok(Deployment {
        id: DeploymentId(row.uuid("id")?),
        tenant_id: TenantId(row.uuid("tenant_id")?),
        environment_id: EnvironmentId(row.uuid("environment_id")?),
        environment_name: row.text("environment_name")?,
        release: release_ref(row, "release_id", "release_name")?
            .ok_or_else(|| StoreError::Corrupt("deployments.release_id: missing".into()))?,
        kind: DeploymentKind::parse(&kind).ok_or_else(|| unknown("deployments.kind", &kind))?,
        state: DeploymentState::parse(&state)
            .ok_or_else(|| unknown("deployments.state", &state))?,
        rolling_back: row.flag("rolling_back")?,
        requested_by: from_json("deployments.requested_by", row.json("requested_by")?)?,
        rollback_release: release_ref(row, "rollback_release_id", "rollback_release_name")?,
        approvals_required: narrow(
            "deployments.approvals_required",
            row.int("approvals_required")?,
        )?,
        cancel_requested: row.flag("cancel_requested")?,
        current_wave: narrow("deployments.current_wave", row.int("current_wave")?)?,
        error_code: row.text_opt("error_code")?,
        detail: row.text_opt("detail")?,
        version: row.int("version")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
        finished_at: row.time_opt("finished_at")?,
    })
}

pub(crate) fn read_deployment_target(
    row: &impl ColumnReader,
) -> Result<DeploymentTarget, StoreError> {
    let phase = row.text("phase")?;
    Ok(DeploymentTarget {
        deployment_id: DeploymentId(row.uuid("deployment_id")?),
        agent_id: AgentId(row.uuid("agent_id")?),
        agent_name: row.text("agent_name")?,
        wave: narrow("deployment_targets.wave", row.int("wave")?)?,
        phase: TargetPhase::parse(&phase)
            .ok_or_else(|| unknown("deployment_targets.phase", &phase))?,
        tasks: from_json("deployment_targets.tasks", row.json("tasks")?)?,
        rollback_tasks: from_json(
            "deployment_targets.rollback_tasks",
            row.json("rollback_tasks")?,
        )?,
        error_code: row.text_opt("error_code")?,
        detail: row.text_opt("detail")?,
        started_at: row.time_opt("started_at")?,
        finished_at: row.time_opt("finished_at")?,
    })
}

pub(crate) fn read_approval(row: &impl ColumnReader) -> Result<Approval, StoreError> {
    Ok(Approval {
        deployment_id: DeploymentId(row.uuid("deployment_id")?),
        token_id: TokenId(row.uuid("token_id")?),
        actor: from_json("deployment_approvals.actor", row.json("actor")?)?,
        approved_at: row.time("approved_at")?,
    })
}

pub(crate) fn read_observation(row: &impl ColumnReader) -> Result<TargetObservation, StoreError> {
    let drift = row.text("drift")?;
    Ok(TargetObservation {
        tenant_id: TenantId(row.uuid("tenant_id")?),
        environment_id: EnvironmentId(row.uuid("environment_id")?),
        agent_id: AgentId(row.uuid("agent_id")?),
        check_task_id: row.uuid_opt("check_task_id")?.map(TaskId),
        next_check_at: row.time("next_check_at")?,
        drift: Drift::parse(&drift).ok_or_else(|| unknown("target_observations.drift", &drift))?,
        running_release: row.text_opt("running_release")?,
        components: from_json("target_observations.components", row.json("components")?)?,
        verified_at: row.time_opt("verified_at")?,
    })
}

/// The token id an approval is recorded under: approvals come from API tokens only.
pub(crate) fn approver_token(actor: &AuditActor) -> Result<TokenId, StoreError> {
    match actor {
        AuditActor::Token { id, .. } => Ok(TokenId(*id)),
        AuditActor::Agent { .. } | AuditActor::OpenbaoToken { .. } => Err(StoreError::Conflict {
            constraint: "approval_token",
        }),
    }
}

pub(crate) fn read_event(row: &impl ColumnReader) -> Result<Event, StoreError> {
    Ok(Event {
        id: row.int("id")?,
        tenant_id: TenantId(row.uuid("tenant_id")?),
        kind: row.text("kind")?,
        task_id: row.uuid_opt("task_id")?.map(TaskId),
        agent_id: row.uuid_opt("agent_id")?.map(AgentId),
        deployment_id: row.uuid_opt("deployment_id")?.map(DeploymentId),
        environment_id: row.uuid_opt("environment_id")?.map(EnvironmentId),
        data: row.json("data")?,
        created_at: row.time("created_at")?,
    })
}

/// The secret columns listings read, in the order [`read_secret_meta`] expects.
macro_rules! secret_meta_columns {
    () => {
        "tenant_id, key, version, created_at, created_by, deleted_at"
    };
}
pub(crate) use secret_meta_columns;

pub(crate) fn read_secret_meta(row: &impl ColumnReader) -> Result<SecretMeta, StoreError> {
    let version = row.int("version")?;
    Ok(SecretMeta {
        tenant_id: TenantId(row.uuid("tenant_id")?),
        key: row.text("key")?,
        version: u32::try_from(version)
            .map_err(|_| StoreError::Corrupt(format!("secrets.version: {version}")))?,
        created_at: row.time("created_at")?,
        created_by: from_json("secrets.created_by", row.json("created_by")?)?,
        deleted_at: row.time_opt("deleted_at")?,
    })
}

pub(crate) fn read_sealed_secret(row: &impl ColumnReader) -> Result<SealedSecret, StoreError> {
    let missing = |c: &str| StoreError::Corrupt(format!("secrets.{c} is null"));
    Ok(SealedSecret {
        meta: read_secret_meta(row)?,
        wrapped_key: row
            .bytes_opt("wrapped_key")?
            .ok_or_else(|| missing("wrapped_key"))?,
        ciphertext: row
            .bytes_opt("ciphertext")?
            .ok_or_else(|| missing("ciphertext"))?,
    })
}

macro_rules! grant_columns {
    () => {
        "jti, tenant_id, environment_id, kind, public_jwk, issued_at, expires_at, \
         superseded_at, used_at, token_accessor"
    };
}
pub(crate) use grant_columns;

pub(crate) fn read_grant(row: &impl ColumnReader) -> Result<Grant, StoreError> {
    let kind = row.text("kind")?;
    Ok(Grant {
        jti: row.text("jti")?,
        tenant_id: TenantId(row.uuid("tenant_id")?),
        environment_id: EnvironmentId(row.uuid("environment_id")?),
        kind: GrantKind::parse(&kind).ok_or_else(|| unknown("grants.kind", &kind))?,
        public_jwk: row.json("public_jwk")?.to_string(),
        issued_at: row.time("issued_at")?,
        expires_at: row.time("expires_at")?,
        superseded_at: row.time_opt("superseded_at")?,
        used_at: row.time_opt("used_at")?,
        token_accessor: row.text_opt("token_accessor")?,
    })
}

macro_rules! ssh_target_columns {
    () => {
        "id, tenant_id, name, host, port, user_name, via_agent, via_selector, host_key, \
         key_secret, labels, created_at"
    };
}
pub(crate) use ssh_target_columns;

pub(crate) fn read_ssh_target(row: &impl ColumnReader) -> Result<SshTarget, StoreError> {
    Ok(SshTarget {
        id: SshTargetId(row.uuid("id")?),
        tenant_id: TenantId(row.uuid("tenant_id")?),
        name: row.text("name")?,
        host: row.text("host")?,
        port: narrow("ssh_targets.port", row.int("port")?)?,
        user: row.text("user_name")?,
        via_agent: row.text_opt("via_agent")?,
        via_selector: labels("ssh_targets.via_selector", row.json("via_selector")?)?,
        host_key: row.text("host_key")?,
        key_secret: row.text("key_secret")?,
        labels: labels("ssh_targets.labels", row.json("labels")?)?,
        created_at: row.time("created_at")?,
    })
}

macro_rules! artifact_columns {
    () => {
        "tenant_id, sha256, size, created_at"
    };
}
pub(crate) use artifact_columns;

pub(crate) fn read_artifact(row: &impl ColumnReader) -> Result<Artifact, StoreError> {
    Ok(Artifact {
        tenant_id: TenantId(row.uuid("tenant_id")?),
        sha256: row.text("sha256")?,
        size: narrow("artifacts.size", row.int("size")?)?,
        created_at: row.time("created_at")?,
    })
}

/// The webhook columns, in the order [`read_webhook`] expects.
macro_rules! webhook_columns {
    () => {
        "id, tenant_id, name, url, format, events, created_at"
    };
}
pub(crate) use webhook_columns;

pub(crate) fn read_webhook(row: &impl ColumnReader) -> Result<crate::Webhook, StoreError> {
    let format = row.text("format")?;
    Ok(crate::Webhook {
        id: row.int("id")?,
        tenant_id: TenantId(row.uuid("tenant_id")?),
        name: row.text("name")?,
        url: row.text("url")?,
        format: berth_proto::notify::WebhookFormat::parse(&format)
            .ok_or_else(|| StoreError::Corrupt(format!("webhooks.format: {format:?}")))?,
        events: serde_json::from_value(row.json("events")?)
            .map_err(|e| StoreError::Corrupt(format!("webhooks.events: {e}")))?,
        created_at: row.time("created_at")?,
    })
}

/// A notification with its webhook's name (`n`: notifications, `w`: webhooks), in the order
/// [`read_notification`] expects; `delivery_columns!` adds what a send needs.
macro_rules! notification_columns {
    () => {
        "n.id, n.tenant_id, n.webhook_id, w.name AS webhook, n.event_id, n.event_kind, \
         n.event_data, n.event_at, n.idempotency_key, n.state, n.attempts, n.retries, \
         n.next_attempt_at, n.error_code, n.error_message, n.created_at, n.updated_at"
    };
}
pub(crate) use notification_columns;

macro_rules! delivery_columns {
    () => {
        concat!(
            crate::rows::notification_columns!(),
            ", w.url, w.format, w.secret_wrapped_key, w.secret_ciphertext"
        )
    };
}
pub(crate) use delivery_columns;

fn count(column: &'static str, n: i64) -> Result<u32, StoreError> {
    u32::try_from(n).map_err(|_| StoreError::Corrupt(format!("{column}: {n}")))
}

pub(crate) fn read_notification(
    row: &impl ColumnReader,
) -> Result<crate::Notification, StoreError> {
    let state = row.text("state")?;
    Ok(crate::Notification {
        id: row.int("id")?,
        tenant_id: TenantId(row.uuid("tenant_id")?),
        webhook_id: row.int("webhook_id")?,
        webhook: row.text("webhook")?,
        event_id: row.int("event_id")?,
        event_kind: row.text("event_kind")?,
        event_data: row.json("event_data")?,
        event_at: row.time("event_at")?,
        idempotency_key: row.text("idempotency_key")?,
        state: berth_proto::notify::NotificationState::parse(&state)
            .ok_or_else(|| StoreError::Corrupt(format!("notifications.state: {state:?}")))?,
        attempts: count("attempts", row.int("attempts")?)?,
        retries: count("retries", row.int("retries")?)?,
        next_attempt_at: row.time("next_attempt_at")?,
        error_code: row.text_opt("error_code")?,
        error_message: row.text_opt("error_message")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
    })
}

macro_rules! readiness_columns {
    () => {
        "environment_id, tenant_id, generation, spec, conditions, operational_ready, pass, \
         verify_request, verify_observed, version, updated_at"
    };
}
pub(crate) use readiness_columns;

pub(crate) fn read_readiness(row: &impl ColumnReader) -> Result<crate::Readiness, StoreError> {
    Ok(crate::Readiness {
        environment_id: EnvironmentId(row.uuid("environment_id")?),
        tenant_id: TenantId(row.uuid("tenant_id")?),
        generation: row.int("generation")?,
        spec: row.text("spec")?,
        conditions: from_json("environment_readiness.conditions", row.json("conditions")?)?,
        operational_ready: row.flag("operational_ready")?,
        pass: from_json("environment_readiness.pass", row.json("pass")?)?,
        verify_request: row.text_opt("verify_request")?,
        verify_observed: row.text_opt("verify_observed")?,
        version: row.int("version")?,
        updated_at: row.time("updated_at")?,
    })
}

pub(crate) fn read_delivery(row: &impl ColumnReader) -> Result<crate::Delivery, StoreError> {
    let format = row.text("format")?;
    let blob = |column| {
        row.bytes_opt(column)?
            .ok_or_else(|| StoreError::Corrupt(format!("webhooks.{column} is null")))
    };
    Ok(crate::Delivery {
        notification: read_notification(row)?,
        url: row.text("url")?,
        format: berth_proto::notify::WebhookFormat::parse(&format)
            .ok_or_else(|| StoreError::Corrupt(format!("webhooks.format: {format:?}")))?,
        secret_wrapped_key: blob("secret_wrapped_key")?,
        secret_ciphertext: blob("secret_ciphertext")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    #[test]
    fn millis_truncates_and_converts_to_utc() {
        let t = datetime!(2024-02-29 12:34:56.789_654_321 +02:00);
        assert_eq!(millis(t), datetime!(2024-02-29 10:34:56.789 UTC));
        let before_epoch = datetime!(1969-12-31 23:59:59.999_999 UTC);
        assert_eq!(millis(before_epoch), datetime!(1969-12-31 23:59:59.999 UTC));
        assert_eq!(
            from_unix_millis("t", unix_millis(before_epoch)).ok(),
            Some(millis(before_epoch))
        );
        assert_eq!(
            unix_millis(t),
            from_unix_millis("t", unix_millis(t))
                .map(unix_millis)
                .unwrap()
        );
    }

    #[test]
    fn token_labels_win() {
        let agent = BTreeMap::from([("a".to_string(), "1".to_string()), ("b".into(), "2".into())]);
        let token = BTreeMap::from([("b".to_string(), "3".to_string())]);
        let merged = merge_labels(agent, token);
        assert_eq!(merged["a"], "1");
        assert_eq!(merged["b"], "3");
    }
}
