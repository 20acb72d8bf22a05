//! The conformance suite every [`Store`](crate::Store) backend must pass: one public function
//! per behaviour, each panicking on failure, in a module per domain (`tenants.rs`, `agents.rs`,
//! `tasks.rs`, `releases.rs`, `deployments.rs`, …; this file holds the fixtures and the cases
//! that span domains). Each case makes its own tenant with a unique name, so cases can share one
//! database; none may assume an empty database or depend on another case. [`conformance_cases!`](crate::conformance_cases) lists
//! them all. Compiled only with the `conformance` feature: the shipping library carries none
//! of it.

use std::collections::BTreeMap;

use berth_proto::admin::Role;
use berth_proto::agent::{AgentStatus, Capability, ResourceUsage};
use berth_proto::{AgentId, AssignmentId, TaskId, TenantId, TokenId};
use time::macros::datetime;
use time::{Duration, OffsetDateTime};

use crate::rows::millis;
use crate::HeartbeatOutcome::{Applied, Fenced, Replayed, Revoked};
use crate::{
    Agent, AgentFilter, AgentUpdate, Attempt, AttemptResult, AttemptState, CancelOutcome,
    ClaimOutcome, CompleteOutcome, Completion, CreateTaskOutcome, DynStore, HeartbeatOutcome,
    HeartbeatRecord, LeaseSweep, NewAgent, NewApiToken, NewRegistrationToken, NewTask, Page,
    RegisterError, RetryOutcome, RetryPolicy, SessionOutcome, StaleSweep, StartAttempt,
    StartOutcome, StoreError, Task, TaskFilter, TaskState, Tenant,
};

mod agents;
mod audit;
mod claims;
mod deployments;
mod desired;
mod events;
mod notify;
mod readiness;
mod releases;
mod secrets;
mod ssh_targets;
mod tasks;
mod tenants;

pub use agents::*;
pub use audit::*;
pub use claims::*;
pub use deployments::*;
pub use desired::*;
pub use events::*;
pub use notify::*;
pub use readiness::*;
pub use releases::*;
pub use secrets::*;
pub use ssh_targets::*;
pub use tasks::*;
pub use tenants::*;

/// Calls `$callback! { case, case, … }` with the name of every case, each a function
/// `berth_store::conformance::<case>(&DynStore)`. A test harness turns each into one test per
/// backend, so one failing case never hides another; a case added here reaches every harness.
#[macro_export]
macro_rules! conformance_cases {
    ($callback:ident) => {
        $callback! {
            ping_and_backend,
            tenants,
            api_tokens,
            ui_sessions,
            events_latest_id,
            registration_succeeds,
            registration_token_is_single_use,
            registration_token_expired,
            registration_token_unknown,
            registration_name_taken_keeps_token,
            registration_concurrent_single_use,
            registration_token_labels_and_environment,
            tenant_isolation,
            list_filters,
            list_pagination,
            update_agent,
            agent_holds,
            delete_agent,
            rebind_certificate,
            heartbeats,
            sweep_stale_agents,
            timestamps_round_trip,
            session_lease,
            session_conflict_degrades,
            session_restart_takeover,
            session_records_version,
            heartbeat_fencing,
            heartbeat_replay,
            task_create_idempotency,
            task_queue_cap,
            task_queue_cap_concurrent,
            task_claim_order,
            task_claim_unrunnable_heads_fail,
            open_task_counts,
            queued_tasks,
            task_claim_head_of_line,
            task_claim_fencing,
            task_result_after_lease_deadline,
            task_claim_concurrent,
            task_path_concurrent,
            task_complete_transitions,
            task_stale_assignment,
            task_start_handshake,
            task_cancel,
            task_retry,
            lease_expiry,
            read_back_sweep,
            retention_prunes_what_finished_long_ago,
            retention_keeps_the_store_bounded,
            delete_agent_tasks,
            task_tenant_isolation,
            list_tasks,
            task_events,
            release_create_get,
            release_create_concurrent,
            list_releases,
            audit_chain,
            audit_task_entries,
            audit_admin_entries,
            audit_concurrent_appends,
            events_of_task_and_agent_states,
            events_tenant_isolation,
            events_wake_readers,
            events_cursor_never_skips,
            environment_create_get_list,
            readiness_round_trip,
            readiness_verify_nonce,
            readiness_environments_listed,
            deployment_create_round_trip,
            deployment_one_active_per_environment,
            deployment_approvals,
            deployment_cancel,
            deployment_step_compare_and_set,
            environment_pin_and_unpin,
            secret_versions_and_delete,
            secret_concurrent_put_conflicts,
            grant_supersede_use_and_jwks,
            active_deployments_and_released_environments,
            target_observations_upsert,
            deployment_events,
            deployment_tenant_isolation,
            desired_bundles_and_set_desired,
            desired_checkins_and_reports,
            ssh_targets_create_get_delete,
            artifacts_content_addressed,
            notifications_written_with_events,
            notification_claims_and_outcomes,
            reconciler_claims,
        }
    };
}

// --- fixtures ---

fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// A fresh secret's stand-in: the store only ever sees hashes.
fn token_hash() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

fn fingerprint() -> String {
    format!("sha256:{}", token_hash())
}

/// The current time with sub-millisecond digits, so truncation is exercised everywhere.
fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

fn capability(name: &str) -> Capability {
    Capability {
        name: name.to_string(),
        version: Some("1.0".to_string()),
        healthy: true,
        detail: None,
    }
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn usage() -> ResourceUsage {
    ResourceUsage {
        cpu_percent: 37.5,
        cpu_cores: 4,
        memory_used_bytes: 1 << 30,
        memory_total_bytes: 8 << 30,
        disk_free_bytes: 100 << 30,
        disk_total_bytes: 250 << 30,
    }
}

async fn tenant(store: &DynStore) -> Tenant {
    store
        .create_tenant(TenantId::new(), &unique("conformance"), operator(), now())
        .await
        .expect("create tenant")
}

async fn registration_token(
    store: &DynStore,
    tenant: TenantId,
    labels: BTreeMap<String, String>,
    environment: Option<&str>,
    expires_at: OffsetDateTime,
) -> String {
    let hash = token_hash();
    store
        .create_registration_token(NewRegistrationToken {
            created_by: None,
            id: TokenId::new(),
            tenant_id: tenant,
            token_hash: hash.clone(),
            labels,
            environment: environment.map(str::to_string),
            expires_at,
            created_at: now(),
        })
        .await
        .expect("create registration token");
    hash
}

fn new_agent(name: &str) -> NewAgent {
    NewAgent {
        id: AgentId::new(),
        name: name.to_string(),
        version: "0.1.0".to_string(),
        capabilities: vec![capability("docker")],
        labels: BTreeMap::new(),
        certificate_fingerprint: fingerprint(),
        certificate_expires_at: now() + Duration::days(30),
        created_at: now(),
    }
}

/// Mints a token and registers `agent` with it, expecting success.
async fn register(store: &DynStore, tenant: TenantId, agent: NewAgent) -> Agent {
    let hash = registration_token(
        store,
        tenant,
        BTreeMap::new(),
        None,
        now() + Duration::hours(1),
    )
    .await;
    store
        .register_agent(&hash, agent, now())
        .await
        .expect("register agent")
        .expect("registration accepted")
}

/// A heartbeat at generation 0: the generation of an agent that never acquired a session. Its
/// sequence is above every one made before, as an agent's are.
fn heartbeat(agent: &Agent, status: AgentStatus, at: OffsetDateTime) -> HeartbeatRecord {
    static SEQUENCE: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(1);
    HeartbeatRecord {
        agent_id: agent.id,
        certificate_fingerprint: agent.certificate_fingerprint.clone().expect("bound agent"),
        generation: 0,
        sequence: SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        session_expires_at: at + Duration::seconds(90),
        reported_status: status,
        resource_usage: usage(),
        capabilities: agent.capabilities.clone(),
        at,
    }
}

async fn list_all(store: &DynStore, tenant: TenantId, filter: &AgentFilter) -> Vec<Agent> {
    store
        .list_agents(tenant, filter, None, 1000)
        .await
        .expect("list agents")
        .items
}

fn assert_conflict(result: Result<impl std::fmt::Debug, StoreError>, expected: &str) {
    match result {
        Err(StoreError::Conflict { constraint }) => assert_eq!(constraint, expected),
        other => panic!("expected conflict on {expected}, got {other:?}"),
    }
}

// --- cases ---

pub async fn ping_and_backend(store: &DynStore) {
    store.ping().await.expect("ping");
    assert!(matches!(store.backend(), "sqlite" | "postgres"));
}

pub async fn timestamps_round_trip(store: &DynStore) {
    // Sub-millisecond digits and a non-UTC offset: both backends must return the same instant,
    // truncated to the millisecond, in UTC.
    let at = datetime!(2024-02-29 12:34:56.789_654_321 +02:00);
    let expected = datetime!(2024-02-29 10:34:56.789 UTC);
    assert_eq!(millis(at), expected);

    let tenant = store
        .create_tenant(TenantId::new(), &unique("timestamps"), operator(), at)
        .await
        .expect("create tenant");
    assert_eq!(tenant.created_at, expected);
    assert!(tenant.created_at.offset().is_utc());
    let read = store
        .get_tenant(tenant.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(read.created_at, expected);

    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        at + Duration::hours(1),
    )
    .await;
    let mut agent = new_agent("clock");
    agent.created_at = at;
    agent.certificate_expires_at = at + Duration::days(30);
    let registered = store
        .register_agent(&hash, agent, at)
        .await
        .expect("register")
        .expect("accepted");
    assert_eq!(registered.created_at, expected);
    assert_eq!(registered.updated_at, expected);
    assert_eq!(
        registered.certificate_expires_at,
        Some(expected + Duration::days(30))
    );

    let beat_at = at + Duration::microseconds(300);
    assert_eq!(
        store
            .record_heartbeats(&[heartbeat(&registered, AgentStatus::Online, beat_at)])
            .await
            .expect("hb"),
        vec![Applied]
    );
    let read = store
        .get_agent(tenant.id, registered.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(
        read.last_heartbeat,
        Some(expected),
        "300 µs later is the same millisecond"
    );
    assert!(read.last_heartbeat.is_some_and(|t| t.offset().is_utc()));
    assert_eq!(read.updated_at, expected);
    assert_eq!(read.created_at, expected);

    let hash = token_hash();
    let token = store
        .create_api_token(NewApiToken {
            created_by: None,
            id: TokenId::new(),
            tenant_id: tenant.id,
            name: "clock".to_string(),
            role: Role::Viewer,
            operator: false,
            token_hash: hash.clone(),
            created_at: at,
        })
        .await
        .expect("create api token");
    assert_eq!(token.created_at, expected);
    assert_eq!(
        store
            .api_token_by_hash(&hash)
            .await
            .expect("lookup")
            .map(|t| t.created_at),
        Some(expected)
    );
}

// --- fixtures of sessions, tasks and delivery (seed 003) ---

const GRACE: std::time::Duration = std::time::Duration::from_secs(30);

fn bound(agent: &Agent) -> String {
    agent.certificate_fingerprint.clone().expect("bound agent")
}

/// (Re-)acquires the session of `agent`'s one process instance and returns its generation.
async fn session(store: &DynStore, agent: &Agent, at: OffsetDateTime) -> i64 {
    let instance = format!("instance-{}", agent.id);
    match store
        .acquire_session(
            agent.id,
            &bound(agent),
            &instance,
            None,
            at,
            at + Duration::seconds(30),
        )
        .await
        .expect("acquire session")
    {
        SessionOutcome::Acquired { generation, .. } => generation,
        other => panic!("expected the session, got {other:?}"),
    }
}

/// A read-only task for `agent`, as the server would hand it over.
fn new_task(tenant: TenantId, agent: AgentId, at: OffsetDateTime) -> NewTask {
    let id = TaskId::new();
    NewTask {
        id,
        tenant_id: tenant,
        task_type: "health-check".to_string(),
        agent_id: agent,
        payload: serde_json::json!({"url": "http://127.0.0.1:18080/", "task": id.to_string()}),
        credentials_sealed: None,
        variables: labels(&[("K", "V")]),
        timeout_seconds: 60,
        priority: 0,
        side_effects: false,
        idempotency_key: None,
        request_hash: None,
        read_back_of: None,
        queue_cap: None,
        created_by: None,
        created_at: at,
    }
}

/// The operator the cases act as, in the audit log.
fn operator() -> berth_proto::audit::AuditActor {
    berth_proto::audit::AuditActor::Token {
        id: uuid::Uuid::nil(),
        name: "operator".to_string(),
        role: Role::Admin,
    }
}

fn deploy_task(tenant: TenantId, agent: AgentId, at: OffsetDateTime) -> NewTask {
    NewTask {
        task_type: "docker.run".to_string(),
        side_effects: true,
        ..new_task(tenant, agent, at)
    }
}

async fn create(store: &DynStore, task: NewTask) -> Task {
    match store.create_task(task).await.expect("create task") {
        CreateTaskOutcome::Created(task) => task,
        other => panic!("expected a new task, got {other:?}"),
    }
}

/// What the test agents poll with: every capability a task kind needs.
fn all_capabilities() -> Vec<String> {
    ["docker", "compose", "ssh"].map(String::from).to_vec()
}

async fn claim(
    store: &DynStore,
    agent: &Agent,
    generation: i64,
    at: OffsetDateTime,
) -> ClaimOutcome {
    store
        .claim_task(
            agent.id,
            generation,
            &bound(agent),
            &all_capabilities(),
            false,
            at,
            GRACE,
        )
        .await
        .expect("claim task")
}

async fn claimed(
    store: &DynStore,
    agent: &Agent,
    generation: i64,
    at: OffsetDateTime,
) -> (Task, Attempt) {
    match claim(store, agent, generation, at).await {
        ClaimOutcome::Claimed(task, attempt) => (task, attempt),
        other => panic!("expected a claim, got {other:?}"),
    }
}

async fn task_now(store: &DynStore, task: &Task) -> (Task, Vec<Attempt>) {
    store
        .get_task(task.tenant_id, task.id)
        .await
        .expect("get task")
        .expect("task exists")
}

/// A result for `attempt` as the server hands it over once the envelope verified.
fn completion(
    agent: &Agent,
    generation: i64,
    attempt: &Attempt,
    result: AttemptResult,
    at: OffsetDateTime,
) -> Completion {
    let envelope = serde_json::json!({
        "contractVersion": "agent-task-transport/v1",
        "taskId": attempt.task_id.to_string(),
        "assignmentId": attempt.assignment_id.to_string(),
        "result": format!("{result:?}"),
        "signature": token_hash(),
    });
    Completion {
        agent_id: agent.id,
        generation,
        certificate_fingerprint: bound(agent),
        certificate_der: b"certificate of the agent".to_vec(),
        task_id: attempt.task_id,
        assignment_id: Some(attempt.assignment_id),
        result,
        result_data: Some(serde_json::json!({"ok": true})),
        envelope,
        now: at,
    }
}

async fn complete(store: &DynStore, completion: Completion) -> CompleteOutcome {
    store
        .complete_attempt(completion, &RetryPolicy::default())
        .await
        .expect("complete attempt")
}

async fn recorded(store: &DynStore, completion: Completion) -> Task {
    match complete(store, completion).await {
        CompleteOutcome::Recorded(task) => task,
        other => panic!("expected the result recorded, got {other:?}"),
    }
}

fn failed(retriable: bool) -> AttemptResult {
    AttemptResult::Failed {
        error_code: "HEALTH_CHECK_FAILED".to_string(),
        retriable,
    }
}

/// The lease sweep is global; cases that run it use their own far-past epoch (before anything
/// the other cases lease) and leave nothing of theirs leased, so exact counts stay exact.
async fn sweep(store: &DynStore, at: OffsetDateTime) -> LeaseSweep {
    store
        .expire_leases(at, &RetryPolicy::default())
        .await
        .expect("expire leases")
}
