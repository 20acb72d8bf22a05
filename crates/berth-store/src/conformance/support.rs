//! The fixtures every conformance case builds on: tenants, agents, sessions, tasks and
//! their deliveries, made through the [`Store`](crate::Store) API only. Shared by the cases'
//! modules, which import it and nothing of each other's parent, so the suite has no import cycle.

pub(super) use std::collections::BTreeMap;

pub(super) use berth_proto::admin::Role;
pub(super) use berth_proto::agent::{AgentStatus, Capability, ResourceUsage};
pub(super) use berth_proto::{AgentId, AssignmentId, TaskId, TenantId, TokenId};
pub(super) use time::macros::datetime;
pub(super) use time::{Duration, OffsetDateTime};

pub(super) use crate::rows::millis;
pub(super) use crate::HeartbeatOutcome::{Applied, Fenced, Replayed, Revoked};
pub(super) use crate::{
    Agent, AgentFilter, AgentUpdate, Attempt, AttemptResult, AttemptState, CancelOutcome,
    ClaimOutcome, CompleteOutcome, Completion, CreateTaskOutcome, DynStore, HeartbeatOutcome,
    HeartbeatRecord, LeaseSweep, NewAgent, NewApiToken, NewRegistrationToken, NewTask, Page,
    RegisterError, RetryOutcome, RetryPolicy, SessionOutcome, StaleSweep, StartAttempt,
    StartOutcome, StoreError, Task, TaskFilter, TaskState, Tenant,
};

// --- fixtures ---

pub(super) fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
}

/// A fresh secret's stand-in: the store only ever sees hashes.
pub(super) fn token_hash() -> String {
    format!(
        "{}{}",
        uuid::Uuid::new_v4().simple(),
        uuid::Uuid::new_v4().simple()
    )
}

pub(super) fn fingerprint() -> String {
    format!("sha256:{}", token_hash())
}

/// The current time with sub-millisecond digits, so truncation is exercised everywhere.
pub(super) fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

pub(super) fn capability(name: &str) -> Capability {
    Capability {
        name: name.to_string(),
        version: Some("1.0".to_string()),
        healthy: true,
        detail: None,
    }
}

pub(super) fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub(super) fn usage() -> ResourceUsage {
    ResourceUsage {
        cpu_percent: 37.5,
        cpu_cores: 4,
        memory_used_bytes: 1 << 30,
        memory_total_bytes: 8 << 30,
        disk_free_bytes: 100 << 30,
        disk_total_bytes: 250 << 30,
    }
}

pub(super) async fn tenant(store: &DynStore) -> Tenant {
    store
        .create_tenant(TenantId::new(), &unique("conformance"), operator(), now())
        .await
        .expect("create tenant")
}

pub(super) async fn registration_token(
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

pub(super) fn new_agent(name: &str) -> NewAgent {
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
pub(super) async fn register(store: &DynStore, tenant: TenantId, agent: NewAgent) -> Agent {
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
pub(super) fn heartbeat(agent: &Agent, status: AgentStatus, at: OffsetDateTime) -> HeartbeatRecord {
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

pub(super) async fn list_all(
    store: &DynStore,
    tenant: TenantId,
    filter: &AgentFilter,
) -> Vec<Agent> {
    store
        .list_agents(tenant, filter, None, 1000)
        .await
        .expect("list agents")
        .items
}

pub(super) fn assert_conflict(result: Result<impl std::fmt::Debug, StoreError>, expected: &str) {
    match result {
        Err(StoreError::Conflict { constraint }) => assert_eq!(constraint, expected),
        other => panic!("expected conflict on {expected}, got {other:?}"),
    }
}

// --- fixtures of sessions, tasks and delivery (seed 003) ---

pub(super) const GRACE: std::time::Duration = std::time::Duration::from_secs(30);

pub(super) fn bound(agent: &Agent) -> String {
    agent.certificate_fingerprint.clone().expect("bound agent")
}

/// (Re-)acquires the session of `agent`'s one process instance and returns its generation.
pub(super) async fn session(store: &DynStore, agent: &Agent, at: OffsetDateTime) -> i64 {
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
pub(super) fn new_task(tenant: TenantId, agent: AgentId, at: OffsetDateTime) -> NewTask {
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
pub(super) fn operator() -> berth_proto::audit::AuditActor {
    berth_proto::audit::AuditActor::Token {
        id: uuid::Uuid::nil(),
        name: "operator".to_string(),
        role: Role::Admin,
    }
}

pub(super) fn deploy_task(tenant: TenantId, agent: AgentId, at: OffsetDateTime) -> NewTask {
    NewTask {
        task_type: "docker.run".to_string(),
        side_effects: true,
        ..new_task(tenant, agent, at)
    }
}

pub(super) async fn create(store: &DynStore, task: NewTask) -> Task {
    match store.create_task(task).await.expect("create task") {
        CreateTaskOutcome::Created(task) => task,
        other => panic!("expected a new task, got {other:?}"),
    }
}

/// What the test agents poll with: every capability a task kind needs.
pub(super) fn all_capabilities() -> Vec<String> {
    ["docker", "compose", "ssh"].map(String::from).to_vec()
}

pub(super) async fn claim(
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

pub(super) async fn claimed(
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

pub(super) async fn task_now(store: &DynStore, task: &Task) -> (Task, Vec<Attempt>) {
    store
        .get_task(task.tenant_id, task.id)
        .await
        .expect("get task")
        .expect("task exists")
}

/// A result for `attempt` as the server hands it over once the envelope verified.
pub(super) fn completion(
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

pub(super) async fn complete(store: &DynStore, completion: Completion) -> CompleteOutcome {
    store
        .complete_attempt(completion, &RetryPolicy::default())
        .await
        .expect("complete attempt")
}

pub(super) async fn recorded(store: &DynStore, completion: Completion) -> Task {
    match complete(store, completion).await {
        CompleteOutcome::Recorded(task) => task,
        other => panic!("expected the result recorded, got {other:?}"),
    }
}

pub(super) fn failed(retriable: bool) -> AttemptResult {
    AttemptResult::Failed {
        error_code: "HEALTH_CHECK_FAILED".to_string(),
        retriable,
    }
}

/// The lease sweep is global; cases that run it use their own far-past epoch (before anything
/// the other cases lease) and leave nothing of theirs leased, so exact counts stay exact.
pub(super) async fn sweep(store: &DynStore, at: OffsetDateTime) -> LeaseSweep {
    store
        .expire_leases(at, &RetryPolicy::default())
        .await
        .expect("expire leases")
}
