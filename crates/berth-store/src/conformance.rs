//! The conformance suite every [`Store`] backend must pass: one public function per behaviour,
//! each panicking on failure. Each case makes its own tenant with a unique name, so cases can
//! share one database; none may assume an empty database or depend on another case.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;

use berth_proto::admin::Role;
use berth_proto::agent::{AgentStatus, Capability, ResourceUsage};
use berth_proto::{AgentId, AssignmentId, TaskId, TenantId, TokenId};
use time::macros::datetime;
use time::{Duration, OffsetDateTime};

use crate::rows::millis;
use crate::HeartbeatOutcome::{Applied, Fenced, Revoked};
use crate::{
    Agent, AgentFilter, AgentUpdate, Attempt, AttemptResult, AttemptState, CancelOutcome,
    ClaimOutcome, CompleteOutcome, Completion, CreateTaskOutcome, DynStore, HeartbeatOutcome,
    HeartbeatRecord, LeaseSweep, NewAgent, NewApiToken, NewRegistrationToken, NewTask, Page,
    RegisterError, RetryOutcome, RetryPolicy, SessionOutcome, StaleSweep, StoreError, Task,
    TaskFilter, TaskState, Tenant,
};

/// A conformance case: takes the store under test and panics on failure.
pub type Case = fn(DynStore) -> Pin<Box<dyn Future<Output = ()> + Send>>;

macro_rules! cases {
    ($($name:ident),* $(,)?) => {
        /// Every case, by name, in the order [`run_all`] runs them.
        pub const CASES: &[(&str, Case)] = &[
            $((stringify!($name), |store| Box::pin(async move { $name(&store).await }))),*
        ];
    };
}

cases!(
    ping_and_backend,
    tenants,
    api_tokens,
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
    delete_agent,
    rebind_certificate,
    heartbeats,
    sweep_stale_agents,
    timestamps_round_trip,
    session_lease,
    session_conflict_degrades,
    heartbeat_fencing,
    task_create_idempotency,
    task_claim_order,
    task_claim_head_of_line,
    task_claim_fencing,
    task_claim_concurrent,
    task_complete_transitions,
    task_stale_assignment,
    task_result_after_lease_deadline,
    task_cancel,
    task_retry,
    lease_expiry,
    delete_agent_tasks,
    task_tenant_isolation,
    list_tasks,
    task_events,
);

/// Runs every case in order, naming each on stderr so a failure is easy to place.
pub async fn run_all(store: DynStore) {
    for (name, case) in CASES {
        eprintln!("conformance [{}] {name}", store.backend());
        case(store.clone()).await;
    }
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
        .create_tenant(TenantId::new(), &unique("conformance"), now())
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

/// A heartbeat at generation 0: the generation of an agent that never acquired a session.
fn heartbeat(agent: &Agent, status: AgentStatus, at: OffsetDateTime) -> HeartbeatRecord {
    HeartbeatRecord {
        agent_id: agent.id,
        certificate_fingerprint: agent.certificate_fingerprint.clone().expect("bound agent"),
        generation: 0,
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

pub async fn tenants(store: &DynStore) {
    let name = unique("tenant");
    let at = now();
    let id = TenantId::new();
    let created = store
        .create_tenant(id, &name, at)
        .await
        .expect("create tenant");
    assert_eq!(
        created,
        Tenant {
            id,
            name: name.clone(),
            created_at: millis(at)
        }
    );
    assert_eq!(
        store.get_tenant(id).await.expect("get tenant"),
        Some(created.clone())
    );
    assert_eq!(
        store
            .get_tenant(TenantId::new())
            .await
            .expect("get unknown tenant"),
        None
    );

    assert_conflict(
        store.create_tenant(TenantId::new(), &name, now()).await,
        "tenant_name",
    );

    let ensured = store
        .ensure_tenant(&name, now())
        .await
        .expect("ensure existing tenant");
    assert_eq!(
        ensured, created,
        "ensure_tenant returns the existing tenant unchanged"
    );

    let fresh = unique("ensured");
    let first = store
        .ensure_tenant(&fresh, at)
        .await
        .expect("ensure new tenant");
    assert_eq!(first.name, fresh);
    assert_eq!(first.created_at, millis(at));
    let second = store
        .ensure_tenant(&fresh, now())
        .await
        .expect("ensure again");
    assert_eq!(first, second);
    assert_eq!(
        store.get_tenant(first.id).await.expect("get ensured"),
        Some(first)
    );
}

pub async fn api_tokens(store: &DynStore) {
    let tenant = tenant(store).await;
    let other = self::tenant(store).await;
    assert!(!store
        .has_operator_token(tenant.id)
        .await
        .expect("has operator"));

    let hash = token_hash();
    let at = now();
    let created = store
        .create_api_token(NewApiToken {
            id: TokenId::new(),
            tenant_id: tenant.id,
            name: "ci".to_string(),
            role: Role::Deployer,
            operator: false,
            token_hash: hash.clone(),
            created_at: at,
        })
        .await
        .expect("create api token");
    assert_eq!(created.tenant_id, tenant.id);
    assert_eq!(created.role, Role::Deployer);
    assert!(!created.operator);
    assert_eq!(created.created_at, millis(at));
    assert_eq!(
        store.api_token_by_hash(&hash).await.expect("lookup"),
        Some(created.clone())
    );
    assert_eq!(
        store
            .api_token_by_hash(&token_hash())
            .await
            .expect("lookup unknown"),
        None
    );
    assert!(!store
        .has_operator_token(tenant.id)
        .await
        .expect("has operator"));

    let duplicate = store
        .create_api_token(NewApiToken {
            id: TokenId::new(),
            tenant_id: other.id,
            name: "copy".to_string(),
            role: Role::Admin,
            operator: false,
            token_hash: hash.clone(),
            created_at: now(),
        })
        .await;
    assert_conflict(duplicate, "api_token_hash");

    for (role, operator) in [(Role::Admin, true), (Role::Viewer, false)] {
        let hash = token_hash();
        let token = store
            .create_api_token(NewApiToken {
                id: TokenId::new(),
                tenant_id: tenant.id,
                name: role.as_str().to_string(),
                role,
                operator,
                token_hash: hash.clone(),
                created_at: now(),
            })
            .await
            .expect("create api token");
        assert_eq!((token.role, token.operator), (role, operator));
        assert_eq!(
            store.api_token_by_hash(&hash).await.expect("lookup"),
            Some(token)
        );
    }
    assert!(store
        .has_operator_token(tenant.id)
        .await
        .expect("has operator"));
    assert!(!store
        .has_operator_token(other.id)
        .await
        .expect("other has operator"));
}

pub async fn registration_succeeds(store: &DynStore) {
    let tenant = tenant(store).await;
    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        now() + Duration::hours(1),
    )
    .await;
    let mut agent = new_agent("web-1");
    agent.labels = labels(&[("role", "web")]);
    agent.capabilities = vec![capability("docker"), capability("compose")];
    let at = now();
    let registered = store
        .register_agent(&hash, agent.clone(), at)
        .await
        .expect("register")
        .expect("accepted");
    let expected = Agent {
        id: agent.id,
        tenant_id: tenant.id,
        name: "web-1".to_string(),
        version: agent.version.clone(),
        capabilities: agent.capabilities.clone(),
        labels: agent.labels.clone(),
        status: AgentStatus::Online,
        reported_status: AgentStatus::Online,
        environment: None,
        last_heartbeat: None,
        resource_usage: None,
        certificate_fingerprint: Some(agent.certificate_fingerprint.clone()),
        certificate_expires_at: Some(millis(agent.certificate_expires_at)),
        created_at: millis(agent.created_at),
        updated_at: millis(agent.created_at),
    };
    assert_eq!(registered, expected);
    assert_eq!(
        store.get_agent(tenant.id, agent.id).await.expect("get"),
        Some(expected.clone())
    );
    assert_eq!(
        store
            .get_agent_for_runtime(agent.id)
            .await
            .expect("get runtime"),
        Some(expected)
    );
    assert_eq!(
        store
            .get_agent_for_runtime(AgentId::new())
            .await
            .expect("get unknown"),
        None
    );
}

pub async fn registration_token_is_single_use(store: &DynStore) {
    let tenant = tenant(store).await;
    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        now() + Duration::hours(1),
    )
    .await;
    store
        .register_agent(&hash, new_agent("first"), now())
        .await
        .expect("register")
        .expect("first use accepted");
    let again = store
        .register_agent(&hash, new_agent("second"), now())
        .await
        .expect("register");
    assert_eq!(again, Err(RegisterError::TokenInvalid));
    assert_eq!(
        list_all(store, tenant.id, &AgentFilter::default())
            .await
            .len(),
        1
    );
}

pub async fn registration_token_expired(store: &DynStore) {
    let tenant = tenant(store).await;
    let at = now();
    let expired = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        at - Duration::seconds(1),
    )
    .await;
    let result = store
        .register_agent(&expired, new_agent("late"), at)
        .await
        .expect("register");
    assert_eq!(result, Err(RegisterError::TokenInvalid));
    // A token is valid strictly before its expiry.
    let at_edge = registration_token(store, tenant.id, BTreeMap::new(), None, millis(at)).await;
    let result = store
        .register_agent(&at_edge, new_agent("edge"), millis(at))
        .await
        .expect("register");
    assert_eq!(result, Err(RegisterError::TokenInvalid));
    assert!(list_all(store, tenant.id, &AgentFilter::default())
        .await
        .is_empty());
}

pub async fn registration_token_unknown(store: &DynStore) {
    let result = store
        .register_agent(&token_hash(), new_agent("nobody"), now())
        .await
        .expect("register");
    assert_eq!(result, Err(RegisterError::TokenInvalid));
}

pub async fn registration_name_taken_keeps_token(store: &DynStore) {
    let tenant = tenant(store).await;
    register(store, tenant.id, new_agent("taken")).await;
    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        now() + Duration::hours(1),
    )
    .await;
    let clash = store
        .register_agent(&hash, new_agent("taken"), now())
        .await
        .expect("register");
    assert_eq!(clash, Err(RegisterError::NameTaken));
    let retry = store
        .register_agent(&hash, new_agent("free"), now())
        .await
        .expect("register")
        .expect("the token survived the name clash");
    assert_eq!(retry.name, "free");

    // The same name in another tenant is no clash.
    let other = self::tenant(store).await;
    let elsewhere = register(store, other.id, new_agent("taken")).await;
    assert_eq!(elsewhere.tenant_id, other.id);
}

pub async fn registration_concurrent_single_use(store: &DynStore) {
    const CALLERS: usize = 20;
    let tenant = tenant(store).await;
    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        now() + Duration::hours(1),
    )
    .await;
    let tasks: Vec<_> = (0..CALLERS)
        .map(|i| {
            let store = store.clone();
            let hash = hash.clone();
            tokio::spawn(async move {
                store
                    .register_agent(&hash, new_agent(&format!("racer-{i}")), now())
                    .await
            })
        })
        .collect();
    let mut accepted = 0;
    for task in tasks {
        match task
            .await
            .expect("task ran")
            .expect("no database error, no SQLITE_BUSY")
        {
            Ok(_) => accepted += 1,
            Err(e) => assert_eq!(e, RegisterError::TokenInvalid),
        }
    }
    assert_eq!(accepted, 1, "exactly one concurrent registration wins");
    assert_eq!(
        list_all(store, tenant.id, &AgentFilter::default())
            .await
            .len(),
        1
    );
}

pub async fn registration_token_labels_and_environment(store: &DynStore) {
    let tenant = tenant(store).await;
    let hash = registration_token(
        store,
        tenant.id,
        labels(&[("env", "prod"), ("team", "payments")]),
        Some("prod"),
        now() + Duration::hours(1),
    )
    .await;
    let mut agent = new_agent("db-1");
    agent.labels = labels(&[("team", "hobby"), ("role", "db")]);
    let registered = store
        .register_agent(&hash, agent, now())
        .await
        .expect("register")
        .expect("accepted");
    assert_eq!(
        registered.labels,
        labels(&[("env", "prod"), ("team", "payments"), ("role", "db")]),
        "token labels win over the agent's"
    );
    assert_eq!(registered.environment.as_deref(), Some("prod"));
}

pub async fn tenant_isolation(store: &DynStore) {
    let owner = tenant(store).await;
    let intruder = tenant(store).await;
    let agent = register(store, owner.id, new_agent("private")).await;

    assert_eq!(
        store.get_agent(intruder.id, agent.id).await.expect("get"),
        None
    );
    assert!(list_all(store, intruder.id, &AgentFilter::default())
        .await
        .is_empty());
    let update = AgentUpdate {
        labels: Some(labels(&[("owned", "yes")])),
        capabilities: Some(vec![]),
    };
    assert_eq!(
        store
            .update_agent(intruder.id, agent.id, update, now())
            .await
            .expect("update"),
        None
    );
    assert!(!store
        .delete_agent(intruder.id, agent.id)
        .await
        .expect("delete"));

    assert_eq!(
        store.get_agent(owner.id, agent.id).await.expect("get"),
        Some(agent.clone())
    );
    assert_eq!(
        list_all(store, owner.id, &AgentFilter::default()).await,
        vec![agent]
    );
}

pub async fn list_filters(store: &DynStore) {
    let tenant = tenant(store).await;
    // Keys and values with quotes, dots and SQL/JSON-path punctuation must match literally.
    let odd_key = "we\"ird.$key' --";
    let odd_value = "it's \"quoted\"";

    let mut docker = new_agent("docker-only");
    docker.capabilities = vec![capability("docker")];
    docker.labels = labels(&[("tier", "web"), (odd_key, odd_value)]);
    let docker = register(store, tenant.id, docker).await;

    let mut both = new_agent("docker-and-ssh");
    both.capabilities = vec![capability("docker"), capability("ssh")];
    both.labels = labels(&[("tier", "db")]);
    let both = register(store, tenant.id, both).await;

    let mut bare = new_agent("bare");
    bare.capabilities = vec![];
    bare.labels = labels(&[("tier", "web")]);
    let bare = register(store, tenant.id, bare).await;

    let applied = store
        .record_heartbeats(&[heartbeat(&both, AgentStatus::Degraded, now())])
        .await
        .expect("heartbeat");
    assert_eq!(applied, vec![Applied]);
    let both = store
        .get_agent(tenant.id, both.id)
        .await
        .expect("get")
        .expect("exists");

    let ids = |agents: Vec<Agent>| agents.into_iter().map(|a| a.id).collect::<Vec<_>>();
    let filter = |status, capability: Option<&str>, label: Option<(&str, &str)>| AgentFilter {
        status,
        capability: capability.map(str::to_string),
        label: label.map(|(k, v)| (k.to_string(), v.to_string())),
    };

    let all = list_all(store, tenant.id, &AgentFilter::default()).await;
    assert_eq!(
        ids(all),
        vec![docker.id, both.id, bare.id],
        "ordered by id, i.e. creation"
    );

    let cases: Vec<(AgentFilter, Vec<AgentId>)> = vec![
        (
            filter(Some(AgentStatus::Online), None, None),
            vec![docker.id, bare.id],
        ),
        (
            filter(Some(AgentStatus::Degraded), None, None),
            vec![both.id],
        ),
        (filter(Some(AgentStatus::Offline), None, None), vec![]),
        (filter(None, Some("docker"), None), vec![docker.id, both.id]),
        (filter(None, Some("ssh"), None), vec![both.id]),
        (filter(None, Some("dock"), None), vec![]),
        (filter(None, Some("docker' OR '1'='1"), None), vec![]),
        (
            filter(None, None, Some(("tier", "web"))),
            vec![docker.id, bare.id],
        ),
        (filter(None, None, Some(("tier", "we"))), vec![]),
        (filter(None, None, Some(("tie", "web"))), vec![]),
        (
            filter(None, None, Some((odd_key, odd_value))),
            vec![docker.id],
        ),
        (filter(None, None, Some((odd_key, "it's"))), vec![]),
        (
            filter(None, Some("docker"), Some(("tier", "web"))),
            vec![docker.id],
        ),
        (
            filter(
                Some(AgentStatus::Online),
                Some("docker"),
                Some(("tier", "db")),
            ),
            vec![],
        ),
        (
            filter(
                Some(AgentStatus::Degraded),
                Some("ssh"),
                Some(("tier", "db")),
            ),
            vec![both.id],
        ),
    ];
    for (filter, expected) in cases {
        let got = list_all(store, tenant.id, &filter).await;
        assert_eq!(ids(got), expected, "filter {filter:?}");
    }
    let degraded = list_all(
        store,
        tenant.id,
        &filter(Some(AgentStatus::Degraded), None, None),
    )
    .await;
    assert_eq!(degraded, vec![both]);
}

pub async fn list_pagination(store: &DynStore) {
    let tenant = tenant(store).await;
    let mut expected = Vec::new();
    for i in 0..5 {
        expected.push(
            register(store, tenant.id, new_agent(&format!("page-{i}")))
                .await
                .id,
        );
    }
    let mut sorted = expected.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "v7 ids are creation-ordered");

    let everything = AgentFilter::default();
    let mut seen = Vec::new();
    let mut after = None;
    let mut pages = Vec::new();
    loop {
        let page = store
            .list_agents(tenant.id, &everything, after, 2)
            .await
            .expect("list page");
        pages.push(page.items.len());
        seen.extend(page.items.iter().map(|a| a.id));
        match page.next {
            Some(next) => {
                assert_eq!(
                    Some(AgentId(next)),
                    page.items.last().map(|a| a.id),
                    "next is the last id"
                );
                after = Some(AgentId(next));
            }
            None => break,
        }
        assert!(pages.len() <= 5, "pagination terminates");
    }
    assert_eq!(seen, expected);
    assert_eq!(pages, vec![2, 2, 1]);

    // A page that ends exactly at the last row still offers `next`; the page after is empty.
    let first = store
        .list_agents(tenant.id, &everything, None, 5)
        .await
        .expect("list");
    assert_eq!(first.items.len(), 5);
    let last = store
        .list_agents(tenant.id, &everything, first.next.map(AgentId), 5)
        .await
        .expect("list");
    assert_eq!(
        last,
        crate::Page {
            items: vec![],
            next: None
        }
    );

    // `after` is exclusive and need not name a row of the page set.
    let tail = store
        .list_agents(tenant.id, &everything, Some(expected[2]), 10)
        .await
        .expect("list");
    assert_eq!(
        tail.items.iter().map(|a| a.id).collect::<Vec<_>>(),
        expected[3..].to_vec()
    );
    assert_eq!(tail.next, None);
    // A limit of 0 is treated as 1.
    let one = store
        .list_agents(tenant.id, &everything, None, 0)
        .await
        .expect("list");
    assert_eq!(one.items.len(), 1);
    assert_eq!(one.next, Some(expected[0].0));
}

pub async fn update_agent(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("mutable")).await;

    let t1 = agent.created_at + Duration::seconds(5);
    let relabelled = store
        .update_agent(
            tenant.id,
            agent.id,
            AgentUpdate {
                labels: Some(labels(&[("zone", "a")])),
                capabilities: None,
            },
            t1,
        )
        .await
        .expect("update")
        .expect("found");
    assert_eq!(relabelled.labels, labels(&[("zone", "a")]));
    assert_eq!(
        relabelled.capabilities, agent.capabilities,
        "capabilities untouched"
    );
    assert_eq!(relabelled.updated_at, millis(t1));

    let t2 = t1 + Duration::seconds(5);
    let caps = vec![
        capability("compose"),
        Capability {
            name: "ssh".to_string(),
            version: None,
            healthy: false,
            detail: Some("no key".to_string()),
        },
    ];
    let recapped = store
        .update_agent(
            tenant.id,
            agent.id,
            AgentUpdate {
                labels: None,
                capabilities: Some(caps.clone()),
            },
            t2,
        )
        .await
        .expect("update")
        .expect("found");
    assert_eq!(recapped.capabilities, caps);
    assert_eq!(
        recapped.labels,
        labels(&[("zone", "a")]),
        "labels untouched"
    );
    assert_eq!(recapped.updated_at, millis(t2));
    assert_eq!(
        store.get_agent(tenant.id, agent.id).await.expect("get"),
        Some(recapped.clone())
    );

    let cleared = store
        .update_agent(
            tenant.id,
            agent.id,
            AgentUpdate {
                labels: Some(BTreeMap::new()),
                capabilities: Some(vec![]),
            },
            t2,
        )
        .await
        .expect("update")
        .expect("found");
    assert!(cleared.labels.is_empty() && cleared.capabilities.is_empty());

    let missing = store
        .update_agent(
            tenant.id,
            AgentId::new(),
            AgentUpdate {
                labels: None,
                capabilities: None,
            },
            t2,
        )
        .await
        .expect("update");
    assert_eq!(missing, None);
}

pub async fn delete_agent(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("doomed")).await;
    let keep = register(store, tenant.id, new_agent("kept")).await;

    assert!(store
        .delete_agent(tenant.id, agent.id)
        .await
        .expect("delete"));
    assert!(!store
        .delete_agent(tenant.id, agent.id)
        .await
        .expect("delete again"));
    assert_eq!(
        store.get_agent(tenant.id, agent.id).await.expect("get"),
        None
    );
    assert_eq!(
        store
            .get_agent_for_runtime(agent.id)
            .await
            .expect("get runtime"),
        None
    );
    assert_eq!(
        list_all(store, tenant.id, &AgentFilter::default()).await,
        vec![keep]
    );

    // The binding went with the agent: its certificate no longer heartbeats anything.
    let applied = store
        .record_heartbeats(&[heartbeat(&agent, AgentStatus::Online, now())])
        .await
        .expect("heartbeat");
    assert_eq!(applied, vec![Revoked]);
    // And the name is free again.
    register(store, tenant.id, new_agent("doomed")).await;
}

pub async fn rebind_certificate(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("rotating")).await;
    let other = register(store, tenant.id, new_agent("bystander")).await;
    let old = agent.certificate_fingerprint.clone().expect("bound");
    let new = fingerprint();
    let expires = now() + Duration::days(60);
    let at = now();

    assert!(!store
        .rebind_certificate(agent.id, &fingerprint(), &new, expires, at)
        .await
        .expect("rebind"));
    assert!(!store
        .rebind_certificate(AgentId::new(), &old, &new, expires, at)
        .await
        .expect("rebind"));
    assert!(store
        .rebind_certificate(agent.id, &old, &new, expires, at)
        .await
        .expect("rebind"));
    let rebound = store
        .get_agent(tenant.id, agent.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(
        rebound.certificate_fingerprint.as_deref(),
        Some(new.as_str())
    );
    assert_eq!(rebound.certificate_expires_at, Some(millis(expires)));
    assert_eq!(rebound.updated_at, millis(at));

    // The old certificate is dead at once: neither rebinding nor heartbeats accept it.
    assert!(!store
        .rebind_certificate(agent.id, &old, &fingerprint(), expires, at)
        .await
        .expect("rebind"));
    let applied = store
        .record_heartbeats(&[heartbeat(&agent, AgentStatus::Online, now())])
        .await
        .expect("heartbeat");
    assert_eq!(applied, vec![Revoked]);

    // One certificate binds one agent.
    let theirs = other.certificate_fingerprint.clone().expect("bound");
    assert_conflict(
        store
            .rebind_certificate(agent.id, &new, &theirs, expires, at)
            .await,
        "agent_certificate",
    );
}

pub async fn heartbeats(store: &DynStore) {
    assert_eq!(
        store.record_heartbeats(&[]).await.expect("empty batch"),
        Vec::<HeartbeatOutcome>::new()
    );

    let tenant = tenant(store).await;
    let live = register(store, tenant.id, new_agent("live")).await;
    let sick = register(store, tenant.id, new_agent("sick")).await;
    let gone = register(store, tenant.id, new_agent("gone")).await;
    let rotated = register(store, tenant.id, new_agent("rotated")).await;
    assert!(store
        .delete_agent(tenant.id, gone.id)
        .await
        .expect("delete"));
    let rotated_fp = rotated.certificate_fingerprint.clone().expect("bound");
    assert!(store
        .rebind_certificate(
            rotated.id,
            &rotated_fp,
            &fingerprint(),
            now() + Duration::days(30),
            now()
        )
        .await
        .expect("rebind"));

    let at = now() + Duration::seconds(1);
    let mut sick_beat = heartbeat(&sick, AgentStatus::Degraded, at);
    sick_beat.capabilities = vec![Capability {
        name: "docker".to_string(),
        version: Some("27.1".to_string()),
        healthy: false,
        detail: Some("engine not answering".to_string()),
    }];
    // Batch order is deliberately not id order: results must come back in batch order.
    let batch = vec![
        heartbeat(&rotated, AgentStatus::Online, at),
        sick_beat.clone(),
        heartbeat(&gone, AgentStatus::Online, at),
        heartbeat(&live, AgentStatus::Online, at),
    ];
    let applied = store.record_heartbeats(&batch).await.expect("heartbeats");
    assert_eq!(applied, vec![Revoked, Applied, Revoked, Applied]);

    let live_now = store
        .get_agent(tenant.id, live.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(live_now.status, AgentStatus::Online);
    assert_eq!(live_now.reported_status, AgentStatus::Online);
    assert_eq!(live_now.last_heartbeat, Some(millis(at)));
    assert_eq!(live_now.resource_usage, Some(usage()));
    assert_eq!(live_now.updated_at, millis(at));

    let sick_now = store
        .get_agent(tenant.id, sick.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(sick_now.status, AgentStatus::Degraded);
    assert_eq!(sick_now.reported_status, AgentStatus::Degraded);
    assert_eq!(sick_now.capabilities, sick_beat.capabilities);
    assert_eq!(sick_now.last_heartbeat, Some(millis(at)));

    let rotated_now = store
        .get_agent(tenant.id, rotated.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(
        rotated_now.last_heartbeat, None,
        "a stale certificate changes nothing"
    );
    assert_eq!(rotated_now.resource_usage, None);

    // A later heartbeat in the same batch wins; recovery is reported as online again.
    let later = at + Duration::seconds(30);
    let batch = vec![
        heartbeat(&sick, AgentStatus::Degraded, at),
        heartbeat(&sick, AgentStatus::Online, later),
    ];
    assert_eq!(
        store.record_heartbeats(&batch).await.expect("heartbeats"),
        vec![Applied, Applied]
    );
    let sick_now = store
        .get_agent(tenant.id, sick.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(sick_now.status, AgentStatus::Online);
    assert_eq!(sick_now.last_heartbeat, Some(millis(later)));
}

/// Uses fixed timestamps in 2001, long before anything else the suite writes, so the global
/// sweep only ever finds this case's agents and its counts stay exact on a shared database.
pub async fn sweep_stale_agents(store: &DynStore) {
    let t = datetime!(2001-01-01 00:00:00 UTC);
    let degraded_before = t;
    let offline_before = t - Duration::seconds(90);
    let tenant = tenant(store).await;

    let make = |name: &str, created_at: OffsetDateTime| {
        let mut agent = new_agent(name);
        agent.created_at = created_at;
        agent
    };
    let old = t - Duration::seconds(200);
    let mut agents = BTreeMap::new();
    for (name, created_at) in [
        ("fresh", old),
        ("late", old),
        ("late-reported-degraded", old),
        ("gone", old),
        ("silent-old", old),
        ("silent-new", t + Duration::seconds(5)),
        ("already-offline", old),
    ] {
        agents.insert(
            name,
            register(store, tenant.id, make(name, created_at)).await,
        );
    }
    let beats = [
        ("fresh", AgentStatus::Online, t + Duration::seconds(1)),
        ("late", AgentStatus::Online, t - Duration::seconds(60)),
        (
            "late-reported-degraded",
            AgentStatus::Degraded,
            t - Duration::seconds(60),
        ),
        ("gone", AgentStatus::Online, t - Duration::seconds(120)),
        (
            "already-offline",
            AgentStatus::Offline,
            t - Duration::seconds(120),
        ),
    ];
    let batch: Vec<_> = beats
        .iter()
        .map(|(name, status, at)| heartbeat(&agents[name], *status, *at))
        .collect();
    assert!(store
        .record_heartbeats(&batch)
        .await
        .expect("heartbeats")
        .iter()
        .all(|a| *a == Applied));

    let swept = store
        .sweep_stale_agents(degraded_before, offline_before)
        .await
        .expect("sweep");
    assert_eq!(
        swept,
        StaleSweep {
            degraded: 1,
            offline: 2
        }
    );

    let expected = [
        ("fresh", AgentStatus::Online, AgentStatus::Online),
        ("late", AgentStatus::Degraded, AgentStatus::Online),
        (
            "late-reported-degraded",
            AgentStatus::Degraded,
            AgentStatus::Degraded,
        ),
        ("gone", AgentStatus::Offline, AgentStatus::Online),
        ("silent-old", AgentStatus::Offline, AgentStatus::Online),
        ("silent-new", AgentStatus::Online, AgentStatus::Online),
        (
            "already-offline",
            AgentStatus::Offline,
            AgentStatus::Offline,
        ),
    ];
    for (name, status, reported) in expected {
        let agent = store
            .get_agent(tenant.id, agents[name].id)
            .await
            .expect("get")
            .expect("exists");
        assert_eq!(
            (agent.status, agent.reported_status),
            (status, reported),
            "agent {name}"
        );
    }

    let again = store
        .sweep_stale_agents(degraded_before, offline_before)
        .await
        .expect("sweep");
    assert_eq!(
        again,
        StaleSweep::default(),
        "only rows that change are counted"
    );

    // A heartbeat brings a swept agent back.
    let back = heartbeat(
        &agents["gone"],
        AgentStatus::Online,
        t + Duration::seconds(2),
    );
    assert_eq!(
        store.record_heartbeats(&[back]).await.expect("heartbeat"),
        vec![Applied]
    );
    let gone = store
        .get_agent(tenant.id, agents["gone"].id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(gone.status, AgentStatus::Online);
}

pub async fn timestamps_round_trip(store: &DynStore) {
    // Sub-millisecond digits and a non-UTC offset: both backends must return the same instant,
    // truncated to the millisecond, in UTC.
    let at = datetime!(2024-02-29 12:34:56.789_654_321 +02:00);
    let expected = datetime!(2024-02-29 10:34:56.789 UTC);
    assert_eq!(millis(at), expected);

    let tenant = store
        .create_tenant(TenantId::new(), &unique("timestamps"), at)
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

// --- sessions, tasks and delivery (seed 003) ---

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
        created_at: at,
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

async fn claim(
    store: &DynStore,
    agent: &Agent,
    generation: i64,
    at: OffsetDateTime,
) -> ClaimOutcome {
    store
        .claim_task(agent.id, generation, &bound(agent), at, GRACE)
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

pub async fn session_lease(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("sessions")).await;
    let fp = bound(&agent);
    let t = now();
    let ttl = Duration::seconds(30);

    let first = store
        .acquire_session(agent.id, &fp, "instance-a", t, t + ttl)
        .await
        .expect("acquire");
    assert_eq!(
        first,
        SessionOutcome::Acquired {
            generation: 1,
            lease_expires_at: millis(t + ttl)
        }
    );
    // A second live process with the same identity is refused and told who holds it.
    let held = store
        .acquire_session(
            agent.id,
            &fp,
            "instance-b",
            t + Duration::seconds(1),
            t + ttl,
        )
        .await
        .expect("acquire");
    assert_eq!(
        held,
        SessionOutcome::Held {
            holder_instance: "instance-a".to_string(),
            lease_expires_at: millis(t + ttl)
        }
    );
    // The holder itself may re-acquire (a restart of the same instance): a new generation.
    let again = store
        .acquire_session(
            agent.id,
            &fp,
            "instance-a",
            t + Duration::seconds(2),
            t + Duration::seconds(40),
        )
        .await
        .expect("acquire");
    assert_eq!(
        again,
        SessionOutcome::Acquired {
            generation: 2,
            lease_expires_at: millis(t + Duration::seconds(40))
        }
    );
    // Expired (the lease ends at its instant): anyone takes it over.
    let takeover = store
        .acquire_session(
            agent.id,
            &fp,
            "instance-b",
            t + Duration::seconds(40),
            t + Duration::seconds(70),
        )
        .await
        .expect("acquire");
    assert_eq!(
        takeover,
        SessionOutcome::Acquired {
            generation: 3,
            lease_expires_at: millis(t + Duration::seconds(70))
        }
    );

    // Release: only with the current generation; then the lease is free at once.
    assert!(!store
        .release_session(agent.id, 2, t)
        .await
        .expect("release"));
    assert!(store
        .release_session(agent.id, 3, t)
        .await
        .expect("release"));
    assert!(!store
        .release_session(agent.id, 3, t)
        .await
        .expect("release twice"));
    let after_release = store
        .acquire_session(
            agent.id,
            &fp,
            "instance-c",
            t + Duration::seconds(41),
            t + Duration::seconds(71),
        )
        .await
        .expect("acquire");
    assert!(matches!(
        after_release,
        SessionOutcome::Acquired { generation: 4, .. }
    ));

    // A certificate that is not the binding, an unknown or a deleted agent: revoked.
    assert_eq!(
        store
            .acquire_session(agent.id, &fingerprint(), "instance-a", t, t + ttl)
            .await
            .expect("acquire"),
        SessionOutcome::Revoked
    );
    assert_eq!(
        store
            .acquire_session(AgentId::new(), &fp, "instance-a", t, t + ttl)
            .await
            .expect("acquire"),
        SessionOutcome::Revoked
    );
    let doomed = register(store, tenant.id, new_agent("doomed-session")).await;
    assert!(store
        .delete_agent(tenant.id, doomed.id)
        .await
        .expect("delete"));
    assert_eq!(
        store
            .acquire_session(doomed.id, &bound(&doomed), "instance-a", t, t + ttl)
            .await
            .expect("acquire"),
        SessionOutcome::Revoked
    );
}

/// A refused second process marks the agent degraded for a while: the holder's heartbeats in
/// that window record what it reports but leave the status degraded; after it, or after a
/// takeover, heartbeats set the status again.
pub async fn session_conflict_degrades(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("cloned")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    let status = |a: &Agent| (a.status, a.reported_status);
    let read = || async {
        store
            .get_agent(tenant.id, agent.id)
            .await
            .expect("get")
            .expect("exists")
    };
    let beat = |at: OffsetDateTime| {
        let record = HeartbeatRecord {
            generation,
            ..heartbeat(&agent, AgentStatus::Online, at)
        };
        async move { store.record_heartbeats(&[record]).await.expect("heartbeat") }
    };

    store
        .mark_agent_degraded(agent.id, t + Duration::seconds(90))
        .await
        .expect("mark degraded");
    assert_eq!(
        status(&read().await),
        (AgentStatus::Degraded, AgentStatus::Online)
    );
    assert_eq!(
        beat(t + Duration::seconds(30)).await,
        vec![HeartbeatOutcome::Applied]
    );
    let during = read().await;
    assert_eq!(
        status(&during),
        (AgentStatus::Degraded, AgentStatus::Online)
    );
    assert_eq!(
        during.last_heartbeat,
        Some(millis(t + Duration::seconds(30)))
    );
    // The window has passed: the holder's report stands again.
    beat(t + Duration::seconds(91)).await;
    assert_eq!(
        status(&read().await),
        (AgentStatus::Online, AgentStatus::Online)
    );

    // A takeover ends the conflict at once.
    store
        .mark_agent_degraded(agent.id, t + Duration::seconds(300))
        .await
        .expect("mark degraded");
    let taken = match store
        .acquire_session(
            agent.id,
            &bound(&agent),
            "instance-clone",
            t + Duration::seconds(200),
            t + Duration::seconds(230),
        )
        .await
        .expect("acquire")
    {
        SessionOutcome::Acquired { generation, .. } => generation,
        other => panic!("takeover refused: {other:?}"),
    };
    let record = HeartbeatRecord {
        generation: taken,
        ..heartbeat(&agent, AgentStatus::Online, t + Duration::seconds(201))
    };
    store.record_heartbeats(&[record]).await.expect("heartbeat");
    assert_eq!(
        status(&read().await),
        (AgentStatus::Online, AgentStatus::Online)
    );
}

pub async fn heartbeat_fencing(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("fenced")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    assert_eq!(generation, 1);

    let mut stale = heartbeat(&agent, AgentStatus::Online, t + Duration::seconds(1));
    stale.generation = 0;
    let mut current = heartbeat(&agent, AgentStatus::Degraded, t + Duration::seconds(2));
    current.generation = generation;
    current.session_expires_at = t + Duration::seconds(300);
    let mut rotated = current.clone();
    rotated.certificate_fingerprint = fingerprint();
    assert_eq!(
        store
            .record_heartbeats(&[stale, rotated, current])
            .await
            .expect("heartbeats"),
        vec![Fenced, Revoked, Applied]
    );
    let read = store
        .get_agent(tenant.id, agent.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(read.reported_status, AgentStatus::Degraded);
    assert_eq!(read.last_heartbeat, Some(millis(t + Duration::seconds(2))));

    // The heartbeat renewed the lease: another instance is held off until the new expiry.
    let probe = store
        .acquire_session(
            agent.id,
            &bound(&agent),
            "intruder",
            t + Duration::seconds(60),
            t + Duration::seconds(90),
        )
        .await
        .expect("acquire");
    assert!(
        matches!(probe, SessionOutcome::Held { lease_expires_at, .. } if lease_expires_at == millis(t + Duration::seconds(300))),
        "{probe:?}"
    );
}

pub async fn task_create_idempotency(store: &DynStore) {
    let tenant = tenant(store).await;
    let other = self::tenant(store).await;
    let agent = register(store, tenant.id, new_agent("idem")).await;
    let elsewhere = register(store, other.id, new_agent("idem")).await;
    let at = now();

    let mut spec = deploy_task(tenant.id, agent.id, at);
    spec.credentials_sealed = Some(vec![0, 1, 2, 255]);
    spec.priority = -3;
    spec.timeout_seconds = 600;
    spec.idempotency_key = Some("deploy-42".to_string());
    spec.request_hash = Some("hash-a".to_string());
    let created = create(store, spec.clone()).await;
    let expected = Task {
        id: spec.id,
        tenant_id: tenant.id,
        task_type: "docker.run".to_string(),
        agent_id: agent.id,
        payload: spec.payload.clone(),
        credentials_sealed: Some(vec![0, 1, 2, 255]),
        variables: spec.variables.clone(),
        timeout_seconds: 600,
        priority: -3,
        side_effects: true,
        idempotency_key: Some("deploy-42".to_string()),
        read_back_of: None,
        state: TaskState::Pending,
        attempts: 0,
        next_attempt_at: None,
        current_assignment: None,
        lease_expires_at: None,
        cancel_requested: false,
        read_back: false,
        error_code: None,
        result: None,
        created_at: millis(at),
        updated_at: millis(at),
        finished_at: None,
    };
    assert_eq!(created, expected);
    assert_eq!(
        store.get_task(tenant.id, spec.id).await.expect("get"),
        Some((expected.clone(), vec![]))
    );

    // Same key, same request: the existing task, not a second one.
    let mut replay = spec.clone();
    replay.id = TaskId::new();
    assert_eq!(
        store.create_task(replay.clone()).await.expect("create"),
        CreateTaskOutcome::Existing(expected.clone())
    );
    // Same key, another request: a conflict.
    let mut clash = replay.clone();
    clash.request_hash = Some("hash-b".to_string());
    assert_eq!(
        store.create_task(clash).await.expect("create"),
        CreateTaskOutcome::KeyConflict
    );
    assert_eq!(
        store.get_task(tenant.id, replay.id).await.expect("get"),
        None
    );
    // Keys are per tenant.
    let mut theirs = replay.clone();
    theirs.id = TaskId::new();
    theirs.tenant_id = other.id;
    theirs.agent_id = elsewhere.id;
    let theirs = create(store, theirs).await;
    assert_eq!(theirs.tenant_id, other.id);
    // Tasks without a key never collide.
    create(store, new_task(tenant.id, agent.id, at)).await;
    create(store, new_task(tenant.id, agent.id, at)).await;

    // A read-back task points at the task it checks.
    let mut read_back = new_task(tenant.id, agent.id, at);
    read_back.task_type = "read-sticker".to_string();
    read_back.read_back_of = Some(created.id);
    assert_eq!(
        create(store, read_back).await.read_back_of,
        Some(created.id)
    );

    // Only the tenant's own agents take tasks.
    assert_conflict(
        store
            .create_task(new_task(tenant.id, elsewhere.id, at))
            .await,
        "task_agent",
    );
    assert_conflict(
        store
            .create_task(new_task(tenant.id, AgentId::new(), at))
            .await,
        "task_agent",
    );
}

pub async fn task_claim_order(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("ordered")).await;
    let bystander = register(store, tenant.id, new_agent("bystander")).await;
    let t = now();
    let generation = session(store, &agent, t).await;

    let low = create(store, new_task(tenant.id, agent.id, t)).await;
    let mut high_first = new_task(tenant.id, agent.id, t);
    high_first.priority = 10;
    let high_first = create(store, high_first).await;
    // Created in the same millisecond as far as timestamps go: order is still creation order.
    let mut high_second = new_task(tenant.id, agent.id, t);
    high_second.priority = 10;
    let high_second = create(store, high_second).await;
    let mut middle = new_task(tenant.id, agent.id, t);
    middle.priority = 5;
    let middle = create(store, middle).await;
    create(store, new_task(tenant.id, bystander.id, t)).await;

    let at = t + Duration::seconds(1);
    let (task, attempt) = claimed(store, &agent, generation, at).await;
    assert_eq!(task.id, high_first.id);
    assert_eq!(task.state, TaskState::Leased);
    assert_eq!(task.attempts, 1);
    assert_eq!(task.current_assignment, Some(attempt.assignment_id));
    let deadline = millis(at + Duration::seconds(60) + GRACE);
    assert_eq!(task.lease_expires_at, Some(deadline));
    assert_eq!(task.updated_at, millis(at));
    assert_eq!(
        attempt,
        Attempt {
            assignment_id: attempt.assignment_id,
            task_id: high_first.id,
            agent_id: agent.id,
            generation,
            state: AttemptState::Leased,
            assigned_at: millis(at),
            lease_expires_at: deadline,
            finished_at: None,
            envelope: None,
            error_code: None,
        }
    );
    assert_eq!(task_now(store, &task).await, (task.clone(), vec![attempt]));

    let mut order = vec![];
    for _ in 0..3 {
        order.push(claimed(store, &agent, generation, at).await.0.id);
    }
    assert_eq!(order, vec![high_second.id, middle.id, low.id]);
    assert_eq!(
        claim(store, &agent, generation, at).await,
        ClaimOutcome::Empty
    );
    assert!(store
        .pending_cancellations(agent.id)
        .await
        .expect("pending cancellations")
        .is_empty());
}

pub async fn task_claim_head_of_line(store: &DynStore) {
    let tenant = tenant(store).await;
    let t = now();

    // A retry_wait head blocks the queue until its next attempt is due.
    let agent = register(store, tenant.id, new_agent("retrying")).await;
    let generation = session(store, &agent, t).await;
    let flaky = create(store, new_task(tenant.id, agent.id, t)).await;
    let behind = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    let waiting = recorded(
        store,
        completion(&agent, generation, &attempt, failed(true), t),
    )
    .await;
    assert_eq!(waiting.state, TaskState::RetryWait);
    let due = waiting.next_attempt_at.expect("next attempt");
    assert_eq!(due, millis(t + Duration::seconds(1)));
    assert_eq!(
        claim(store, &agent, generation, due - Duration::milliseconds(1)).await,
        ClaimOutcome::Empty,
        "the head waits, and nothing overtakes it"
    );
    let (again, second) = claimed(store, &agent, generation, due).await;
    assert_eq!(again.id, flaky.id);
    assert_eq!(again.attempts, 2);
    assert_eq!(again.next_attempt_at, None);
    assert_ne!(second.assignment_id, attempt.assignment_id);
    assert_eq!(
        claimed(store, &agent, generation, due).await.0.id,
        behind.id
    );

    // At most one side-effecting task per agent at a time; read-only ones are not held up.
    let target = register(store, tenant.id, new_agent("target")).await;
    let generation = session(store, &target, t).await;
    let deploy_a = create(store, deploy_task(tenant.id, target.id, t)).await;
    let (leased_a, attempt_a) = claimed(store, &target, generation, t).await;
    assert_eq!(leased_a.id, deploy_a.id);
    let inspect = create(store, new_task(tenant.id, target.id, t)).await;
    assert_eq!(
        claimed(store, &target, generation, t).await.0.id,
        inspect.id
    );
    let deploy_b = create(store, deploy_task(tenant.id, target.id, t)).await;
    let inspect_later = create(store, new_task(tenant.id, target.id, t)).await;
    assert_eq!(
        claim(store, &target, generation, t).await,
        ClaimOutcome::Empty,
        "a side-effecting head waits for the leased one, and blocks what is behind it"
    );
    recorded(
        store,
        completion(&target, generation, &attempt_a, AttemptResult::Succeeded, t),
    )
    .await;
    assert_eq!(
        claimed(store, &target, generation, t).await.0.id,
        deploy_b.id
    );
    assert_eq!(
        claimed(store, &target, generation, t).await.0.id,
        inspect_later.id
    );
}

pub async fn task_claim_fencing(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("claim-fencing")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    create(store, new_task(tenant.id, agent.id, t)).await;

    assert_eq!(
        claim(store, &agent, generation - 1, t).await,
        ClaimOutcome::Fenced
    );
    assert_eq!(
        store
            .claim_task(agent.id, generation, &fingerprint(), t, GRACE)
            .await
            .expect("claim"),
        ClaimOutcome::Revoked
    );
    assert_eq!(
        store
            .claim_task(AgentId::new(), generation, &bound(&agent), t, GRACE)
            .await
            .expect("claim"),
        ClaimOutcome::Revoked
    );
    // A newer session fences the older one.
    let newer = session(store, &agent, t).await;
    assert_eq!(
        claim(store, &agent, generation, t).await,
        ClaimOutcome::Fenced
    );
    let (_, attempt) = claimed(store, &agent, newer, t).await;
    assert_eq!(attempt.generation, newer);
}

/// A result that arrives after its lease ran out is refused even though no sweep has moved the
/// task yet: being on time must not depend on the sweeper's pace.
pub async fn task_result_after_lease_deadline(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("lease-deadline")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    let task = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    let late = attempt.lease_expires_at + time::Duration::milliseconds(1);
    let outcome = store
        .complete_attempt(
            completion(&agent, generation, &attempt, AttemptResult::Succeeded, late),
            &RetryPolicy::default(),
        )
        .await
        .expect("complete");
    assert_eq!(outcome, CompleteOutcome::Fenced);
    let (still, _) = task_now(store, &task).await;
    assert_eq!(
        still.state,
        TaskState::Leased,
        "the refused result changed nothing"
    );
    // At the deadline itself the result still counts.
    let on_time = store
        .complete_attempt(
            completion(
                &agent,
                generation,
                &attempt,
                AttemptResult::Succeeded,
                attempt.lease_expires_at,
            ),
            &RetryPolicy::default(),
        )
        .await
        .expect("complete");
    assert!(
        matches!(on_time, CompleteOutcome::Recorded(ref t) if t.state == TaskState::Succeeded),
        "{on_time:?}"
    );
}

pub async fn task_claim_concurrent(store: &DynStore) {
    const TASKS: usize = 12;
    const CLAIMERS: usize = 4;
    let tenant = tenant(store).await;
    let t = now();
    let mut agents = vec![];
    let mut expected = BTreeMap::new();
    for name in ["racer-a", "racer-b"] {
        let agent = register(store, tenant.id, new_agent(name)).await;
        let generation = session(store, &agent, t).await;
        let mut ids = vec![];
        for _ in 0..TASKS {
            ids.push(create(store, new_task(tenant.id, agent.id, t)).await.id);
        }
        expected.insert(agent.id, ids);
        agents.push((agent, generation));
    }
    let mut handles = vec![];
    for (agent, generation) in &agents {
        for _ in 0..CLAIMERS {
            let store = store.clone();
            let agent = agent.clone();
            let generation = *generation;
            handles.push(tokio::spawn(async move {
                let mut got = vec![];
                loop {
                    match store
                        .claim_task(agent.id, generation, &bound(&agent), now(), GRACE)
                        .await
                        .expect("claim without a database error")
                    {
                        ClaimOutcome::Claimed(task, attempt) => {
                            assert_eq!(task.agent_id, agent.id, "claims never cross agents");
                            assert_eq!(attempt.task_id, task.id);
                            got.push((agent.id, task.id));
                        }
                        ClaimOutcome::Empty => return got,
                        other => panic!("unexpected {other:?}"),
                    }
                }
            }));
        }
    }
    let mut seen: BTreeMap<AgentId, Vec<TaskId>> = BTreeMap::new();
    for handle in handles {
        for (agent, task) in handle.await.expect("claimer ran") {
            seen.entry(agent).or_default().push(task);
        }
    }
    for (agent, ids) in &expected {
        let mut got = seen.remove(agent).unwrap_or_default();
        got.sort();
        let mut want = ids.clone();
        want.sort();
        assert_eq!(got, want, "each task claimed exactly once");
    }
    assert!(seen.is_empty());
}

pub async fn task_complete_transitions(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("completing")).await;
    let t = now();
    let generation = session(store, &agent, t).await;

    // Success: the result and the envelope are kept; a replay is a duplicate, never a change.
    let task = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    let done_at = t + Duration::seconds(5);
    let success = completion(
        &agent,
        generation,
        &attempt,
        AttemptResult::Succeeded,
        done_at,
    );
    let done = recorded(store, success.clone()).await;
    assert_eq!(done.id, task.id);
    assert_eq!(done.state, TaskState::Succeeded);
    assert_eq!(done.result, Some(serde_json::json!({"ok": true})));
    assert_eq!(done.finished_at, Some(millis(done_at)));
    assert_eq!(
        (done.current_assignment, done.lease_expires_at),
        (None, None)
    );
    let (_, attempts) = task_now(store, &done).await;
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].state, AttemptState::Succeeded);
    assert_eq!(attempts[0].envelope.as_ref(), Some(&success.envelope));
    assert_eq!(attempts[0].finished_at, Some(millis(done_at)));
    assert_eq!(
        complete(store, success.clone()).await,
        CompleteOutcome::Duplicate(done.clone())
    );
    let mut without_id = success.clone();
    without_id.assignment_id = None;
    assert_eq!(
        complete(store, without_id).await,
        CompleteOutcome::Duplicate(done.clone())
    );
    let mut altered = success.clone();
    altered.envelope["result"] = serde_json::json!("Failed");
    assert_eq!(complete(store, altered).await, CompleteOutcome::Fenced);

    // A failure that is not retriable is final; no assignment id means the current one.
    create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    let mut fail = completion(&agent, generation, &attempt, failed(false), t);
    fail.assignment_id = None;
    let final_failure = recorded(store, fail).await;
    assert_eq!(final_failure.state, TaskState::Failed);
    assert_eq!(
        final_failure.error_code.as_deref(),
        Some("HEALTH_CHECK_FAILED")
    );
    assert!(final_failure.finished_at.is_some());

    // Reported cancelled.
    create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    let cancelled = recorded(
        store,
        completion(&agent, generation, &attempt, AttemptResult::Cancelled, t),
    )
    .await;
    assert_eq!(cancelled.state, TaskState::Cancelled);

    // Retriable failures back off per the policy; the fifth delivery's failure dead-letters.
    let policy = RetryPolicy::default();
    let task = create(store, new_task(tenant.id, agent.id, t)).await;
    let mut at = t;
    for delivery in 1..=policy.max_attempts {
        let (leased, attempt) = claimed(store, &agent, generation, at).await;
        assert_eq!((leased.id, leased.attempts), (task.id, delivery));
        let after = recorded(
            store,
            completion(&agent, generation, &attempt, failed(true), at),
        )
        .await;
        assert_eq!(after.error_code.as_deref(), Some("HEALTH_CHECK_FAILED"));
        if delivery < policy.max_attempts {
            assert_eq!(after.state, TaskState::RetryWait);
            assert_eq!(
                after.next_attempt_at,
                Some(millis(at + policy.delay_after(delivery)))
            );
            assert_eq!(after.finished_at, None);
            at = after.next_attempt_at.expect("next attempt");
        } else {
            assert_eq!(after.state, TaskState::DeadLetter);
            assert_eq!(after.next_attempt_at, None);
            assert_eq!(after.finished_at, Some(millis(at)));
        }
    }
    let (dead, attempts) = task_now(store, &task).await;
    assert_eq!(dead.attempts, policy.max_attempts);
    assert_eq!(attempts.len(), policy.max_attempts as usize);
    assert!(attempts.iter().all(|a| a.state == AttemptState::Failed));
    assert_eq!(
        claim(store, &agent, generation, at).await,
        ClaimOutcome::Empty
    );

    // Stale generation, another certificate, another agent's or an unknown task.
    let task = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, at).await;
    let ok = completion(&agent, generation, &attempt, AttemptResult::Succeeded, at);
    let mut wrong_cert = ok.clone();
    wrong_cert.certificate_fingerprint = fingerprint();
    assert_eq!(complete(store, wrong_cert).await, CompleteOutcome::Revoked);
    let mut unknown = ok.clone();
    unknown.task_id = TaskId::new();
    assert_eq!(complete(store, unknown).await, CompleteOutcome::NotFound);
    let stranger = register(store, tenant.id, new_agent("stranger")).await;
    let stranger_generation = session(store, &stranger, t).await;
    let mut theirs = completion(
        &stranger,
        stranger_generation,
        &attempt,
        AttemptResult::Succeeded,
        at,
    );
    theirs.task_id = task.id;
    assert_eq!(complete(store, theirs).await, CompleteOutcome::NotFound);
    let mut bogus = ok.clone();
    bogus.assignment_id = Some(AssignmentId::new());
    assert_eq!(complete(store, bogus).await, CompleteOutcome::Fenced);
    let newer = session(store, &agent, at).await;
    assert_eq!(complete(store, ok.clone()).await, CompleteOutcome::Fenced);
    assert_eq!(
        task_now(store, &task).await.0.state,
        TaskState::Leased,
        "fenced changes nothing"
    );
    // The current generation may finish the delivery that is still current.
    let mut current = ok;
    current.generation = newer;
    assert_eq!(recorded(store, current).await.state, TaskState::Succeeded);
}

pub async fn task_stale_assignment(store: &DynStore) {
    // Far-past epoch: see `sweep`.
    let t = datetime!(1999-06-01 00:00:00.123_456 UTC);
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("redelivered")).await;
    let generation = session(store, &agent, now()).await;
    let task = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, first) = claimed(store, &agent, generation, t).await;
    let swept = sweep(store, first.lease_expires_at).await;
    let (waiting, _) = task_now(store, &task).await;
    assert_eq!(
        swept,
        LeaseSweep {
            unknown: vec![],
            requeued: vec![waiting.clone()],
            dead_lettered: 0
        }
    );
    assert_eq!(waiting.state, TaskState::RetryWait);
    let (_, second) = claimed(
        store,
        &agent,
        generation,
        waiting.next_attempt_at.expect("due"),
    )
    .await;
    // The lost delivery reports late: fenced, whatever it says.
    assert_eq!(
        complete(
            store,
            completion(&agent, generation, &first, AttemptResult::Succeeded, t)
        )
        .await,
        CompleteOutcome::Fenced
    );
    let done = recorded(
        store,
        completion(&agent, generation, &second, AttemptResult::Succeeded, t),
    )
    .await;
    assert_eq!(done.state, TaskState::Succeeded);
    let (_, attempts) = task_now(store, &task).await;
    assert_eq!(
        attempts
            .iter()
            .map(|a| (a.assignment_id, a.state))
            .collect::<Vec<_>>(),
        vec![
            (first.assignment_id, AttemptState::Expired),
            (second.assignment_id, AttemptState::Succeeded)
        ]
    );
    assert_eq!(attempts[0].error_code.as_deref(), Some("LEASE_EXPIRED"));
}

pub async fn task_cancel(store: &DynStore) {
    let tenant = tenant(store).await;
    let intruder = self::tenant(store).await;
    let agent = register(store, tenant.id, new_agent("cancelling")).await;
    let t = now();
    let generation = session(store, &agent, t).await;

    // Leased: requested, delivered with the next poll, ended by the agent's report.
    let leased = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    let pending = create(store, new_task(tenant.id, agent.id, t)).await;

    assert_eq!(
        store
            .cancel_task(intruder.id, leased.id, t)
            .await
            .expect("cancel"),
        None
    );
    assert_eq!(
        store
            .cancel_task(tenant.id, TaskId::new(), t)
            .await
            .expect("cancel"),
        None
    );

    let at = t + Duration::seconds(1);
    let Some(CancelOutcome::Requested(requested)) = store
        .cancel_task(tenant.id, leased.id, at)
        .await
        .expect("cancel")
    else {
        panic!("a leased task is only asked to cancel");
    };
    assert!(requested.cancel_requested);
    assert_eq!(requested.state, TaskState::Leased);
    assert_eq!(requested.updated_at, millis(at));
    assert_eq!(
        store
            .pending_cancellations(agent.id)
            .await
            .expect("pending"),
        vec![(leased.id, attempt.assignment_id)]
    );
    assert!(matches!(
        store
            .cancel_task(tenant.id, leased.id, at)
            .await
            .expect("cancel"),
        Some(CancelOutcome::Requested(_))
    ));

    // Pending: cancelled at once.
    let Some(CancelOutcome::Cancelled(cancelled)) = store
        .cancel_task(tenant.id, pending.id, at)
        .await
        .expect("cancel")
    else {
        panic!("a pending task is cancelled at once");
    };
    assert_eq!(cancelled.state, TaskState::Cancelled);
    assert_eq!(cancelled.finished_at, Some(millis(at)));

    let reported = recorded(
        store,
        completion(&agent, generation, &attempt, AttemptResult::Cancelled, at),
    )
    .await;
    assert_eq!(reported.state, TaskState::Cancelled);
    assert!(store
        .pending_cancellations(agent.id)
        .await
        .expect("pending")
        .is_empty());

    // Terminal: unchanged.
    assert_eq!(
        store
            .cancel_task(tenant.id, leased.id, at)
            .await
            .expect("cancel"),
        Some(CancelOutcome::AlreadyFinished(reported))
    );

    // A requested cancellation is never requeued by a retriable failure.
    let flaky = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    store
        .cancel_task(tenant.id, flaky.id, at)
        .await
        .expect("cancel");
    let ended = recorded(
        store,
        completion(&agent, generation, &attempt, failed(true), at),
    )
    .await;
    assert_eq!(ended.state, TaskState::Cancelled);

    // retry_wait: cancelled at once, and the queue behind it is free.
    let waiting = create(store, new_task(tenant.id, agent.id, t)).await;
    let behind = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    recorded(
        store,
        completion(&agent, generation, &attempt, failed(true), t),
    )
    .await;
    assert!(matches!(
        store
            .cancel_task(tenant.id, waiting.id, at)
            .await
            .expect("cancel"),
        Some(CancelOutcome::Cancelled(_))
    ));
    assert_eq!(claimed(store, &agent, generation, t).await.0.id, behind.id);
}

pub async fn task_retry(store: &DynStore) {
    let tenant = tenant(store).await;
    let intruder = self::tenant(store).await;
    let agent = register(store, tenant.id, new_agent("retried")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    let once = RetryPolicy {
        backoff: vec![std::time::Duration::from_secs(1)],
        max_attempts: 1,
    };

    let dead = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    let outcome = store
        .complete_attempt(
            completion(&agent, generation, &attempt, failed(true), t),
            &once,
        )
        .await
        .expect("complete");
    assert!(
        matches!(outcome, CompleteOutcome::Recorded(ref task) if task.state == TaskState::DeadLetter)
    );

    assert_eq!(
        store
            .retry_task(intruder.id, dead.id, t)
            .await
            .expect("retry"),
        None
    );
    let at = t + Duration::seconds(3);
    let Some(RetryOutcome::Requeued(requeued)) = store
        .retry_task(tenant.id, dead.id, at)
        .await
        .expect("retry")
    else {
        panic!("dead_letter is retriable");
    };
    assert_eq!(requeued.state, TaskState::Pending);
    assert_eq!(requeued.attempts, 0, "a fresh attempt budget");
    assert_eq!(
        (requeued.finished_at, requeued.next_attempt_at),
        (None, None)
    );
    assert_eq!(requeued.updated_at, millis(at));
    // Pending is not retriable; neither is leased nor succeeded.
    assert_eq!(
        store
            .retry_task(tenant.id, dead.id, at)
            .await
            .expect("retry"),
        Some(RetryOutcome::NotRetriable(requeued))
    );
    let (leased, attempt) = claimed(store, &agent, generation, at).await;
    assert_eq!((leased.id, leased.attempts), (dead.id, 1));
    assert!(matches!(
        store
            .retry_task(tenant.id, dead.id, at)
            .await
            .expect("retry"),
        Some(RetryOutcome::NotRetriable(_))
    ));
    recorded(
        store,
        completion(&agent, generation, &attempt, AttemptResult::Succeeded, at),
    )
    .await;
    assert!(matches!(
        store.retry_task(tenant.id, dead.id, at).await.expect("retry"),
        Some(RetryOutcome::NotRetriable(ref task)) if task.state == TaskState::Succeeded
    ));

    // Unknown (its agent vanished mid-deploy): an operator may run it again.
    let doomed = register(store, tenant.id, new_agent("doomed")).await;
    let doomed_generation = session(store, &doomed, t).await;
    let deploy = create(store, deploy_task(tenant.id, doomed.id, t)).await;
    claimed(store, &doomed, doomed_generation, t).await;
    assert!(store
        .delete_agent(tenant.id, doomed.id)
        .await
        .expect("delete"));
    assert_eq!(task_now(store, &deploy).await.0.state, TaskState::Unknown);
    assert!(matches!(
        store.retry_task(tenant.id, deploy.id, at).await.expect("retry"),
        Some(RetryOutcome::Requeued(ref task)) if task.state == TaskState::Pending
    ));
}

pub async fn lease_expiry(store: &DynStore) {
    // Far-past epoch, earlier than task_stale_assignment's: see `sweep`.
    let t = datetime!(1998-03-01 00:00:00 UTC);
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("expiring")).await;
    let generation = session(store, &agent, now()).await;
    let policy = RetryPolicy::default();

    let mut deploy = deploy_task(tenant.id, agent.id, t);
    deploy.timeout_seconds = 10;
    let deploy = create(store, deploy).await;
    let mut inspect = new_task(tenant.id, agent.id, t);
    inspect.timeout_seconds = 10;
    let inspect = create(store, inspect).await;
    let (_, deploy_attempt) = claimed(store, &agent, generation, t).await;
    let (_, inspect_attempt) = claimed(store, &agent, generation, t).await;
    let deadline = millis(t + Duration::seconds(10) + GRACE);
    assert_eq!(inspect_attempt.lease_expires_at, deadline);

    assert_eq!(
        sweep(store, deadline - Duration::milliseconds(1)).await,
        LeaseSweep::default()
    );
    let swept = sweep(store, deadline).await;
    assert_eq!(swept.requeued.len(), 1);
    assert_eq!(swept.dead_lettered, 0);
    assert_eq!(swept.unknown.len(), 1);
    let unknown = &swept.unknown[0];
    assert_eq!(unknown.id, deploy.id);
    assert_eq!(unknown.state, TaskState::Unknown);
    assert_eq!(unknown.error_code.as_deref(), Some("LEASE_EXPIRED"));
    assert_eq!(
        (unknown.current_assignment, unknown.lease_expires_at),
        (None, None)
    );
    let (_, attempts) = task_now(store, unknown).await;
    assert_eq!(attempts[0].assignment_id, deploy_attempt.assignment_id);
    assert_eq!(attempts[0].state, AttemptState::Expired);
    assert_eq!(attempts[0].finished_at, Some(deadline));
    assert_eq!(
        sweep(store, deadline).await,
        LeaseSweep::default(),
        "nothing twice"
    );

    // The read-only task goes round the backoff and dead-letters after max_attempts.
    let mut due = deadline;
    for delivery in 1..=policy.max_attempts {
        let (task, _) = task_now(store, &inspect).await;
        assert_eq!(task.attempts, delivery);
        assert_eq!(task.error_code.as_deref(), Some("LEASE_EXPIRED"));
        if delivery == policy.max_attempts {
            assert_eq!(task.state, TaskState::DeadLetter);
            break;
        }
        assert_eq!(task.state, TaskState::RetryWait);
        assert_eq!(
            task.next_attempt_at,
            Some(due + policy.delay_after(delivery))
        );
        due = task.next_attempt_at.expect("due");
        let (_, attempt) = claimed(store, &agent, generation, due).await;
        due = attempt.lease_expires_at;
        let swept = sweep(store, due).await;
        let last = delivery + 1 == policy.max_attempts;
        assert_eq!(
            (
                swept.requeued.len() as u64,
                swept.dead_lettered,
                swept.unknown.len()
            ),
            if last { (0, 1, 0) } else { (1, 0, 0) }
        );
    }

    // Read-back: not found keeps it unknown with the evidence; found makes it succeed.
    let evidence = serde_json::json!({"sticker": null});
    let still = store
        .resolve_read_back(deploy.id, false, evidence.clone(), t)
        .await
        .expect("read back")
        .expect("unknown task");
    assert_eq!(still.state, TaskState::Unknown);
    assert_eq!(still.result, Some(evidence));
    assert!(!still.read_back);
    let sticker = serde_json::json!({"sticker": {"releaseId": "r-1"}});
    let found = store
        .resolve_read_back(deploy.id, true, sticker.clone(), t + Duration::seconds(1))
        .await
        .expect("read back")
        .expect("unknown task");
    assert_eq!(found.state, TaskState::Succeeded);
    assert!(found.read_back);
    assert_eq!(found.result, Some(sticker.clone()));
    assert_eq!(found.finished_at, Some(millis(t + Duration::seconds(1))));
    assert_eq!(
        store
            .resolve_read_back(deploy.id, true, sticker.clone(), t)
            .await
            .expect("read back"),
        None,
        "only an unknown task is read back"
    );
    assert_eq!(
        store
            .resolve_read_back(TaskId::new(), true, sticker, t)
            .await
            .expect("read back"),
        None
    );

    // A requested cancellation is honoured when the lease of a read-only task runs out.
    let cancel_me = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    store
        .cancel_task(tenant.id, cancel_me.id, t)
        .await
        .expect("cancel");
    let swept = sweep(store, attempt.lease_expires_at).await;
    assert_eq!(swept, LeaseSweep::default());
    assert_eq!(
        task_now(store, &cancel_me).await.0.state,
        TaskState::Cancelled
    );
}

pub async fn delete_agent_tasks(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("retiring")).await;
    let keep = register(store, tenant.id, new_agent("staying")).await;
    let t = now();
    let generation = session(store, &agent, t).await;

    let inspect = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, inspect_attempt) = claimed(store, &agent, generation, t).await;
    let deploy = create(store, deploy_task(tenant.id, agent.id, t)).await;
    let (_, deploy_attempt) = claimed(store, &agent, generation, t).await;
    let waiting = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    recorded(
        store,
        completion(&agent, generation, &attempt, failed(true), t),
    )
    .await;
    let pending = create(store, new_task(tenant.id, agent.id, t)).await;
    let finished = create(store, new_task(tenant.id, keep.id, t)).await;
    let other = create(store, new_task(tenant.id, keep.id, t)).await;
    let _ = finished;

    assert!(store
        .delete_agent(tenant.id, agent.id)
        .await
        .expect("delete"));

    let state = |task: Task| (task.state, task.error_code);
    let deleted = Some("AGENT_DELETED".to_string());
    let (task, attempts) = task_now(store, &inspect).await;
    assert_eq!(state(task), (TaskState::Expired, deleted.clone()));
    assert_eq!(attempts[0].assignment_id, inspect_attempt.assignment_id);
    assert_eq!(attempts[0].state, AttemptState::Expired);
    let (task, attempts) = task_now(store, &deploy).await;
    assert_eq!(task.current_assignment, None);
    assert_eq!(task.finished_at, None, "unknown is not final");
    assert_eq!(state(task), (TaskState::Unknown, deleted.clone()));
    assert_eq!(attempts[0].assignment_id, deploy_attempt.assignment_id);
    assert_eq!(attempts[0].state, AttemptState::Expired);
    let (task, _) = task_now(store, &waiting).await;
    assert!(task.finished_at.is_some());
    assert_eq!(state(task), (TaskState::Expired, deleted.clone()));
    assert_eq!(
        state(task_now(store, &pending).await.0),
        (TaskState::Expired, deleted)
    );
    // Another agent's tasks are untouched; the history of the deleted one is still listed.
    assert_eq!(task_now(store, &other).await.0.state, TaskState::Pending);
    let listed = store
        .list_tasks(
            tenant.id,
            &TaskFilter {
                agent_id: Some(agent.id),
                ..TaskFilter::default()
            },
            None,
            100,
        )
        .await
        .expect("list");
    assert_eq!(listed.items.len(), 4);
}

pub async fn task_tenant_isolation(store: &DynStore) {
    let owner = tenant(store).await;
    let intruder = tenant(store).await;
    let agent = register(store, owner.id, new_agent("private")).await;
    let task = create(store, new_task(owner.id, agent.id, now())).await;

    assert_eq!(
        store.get_task(intruder.id, task.id).await.expect("get"),
        None
    );
    let everything = TaskFilter::default();
    assert!(store
        .list_tasks(intruder.id, &everything, None, 100)
        .await
        .expect("list")
        .items
        .is_empty());
    let by_agent = TaskFilter {
        agent_id: Some(agent.id),
        ..TaskFilter::default()
    };
    assert!(store
        .list_tasks(intruder.id, &by_agent, None, 100)
        .await
        .expect("list")
        .items
        .is_empty());
    assert_eq!(
        store
            .cancel_task(intruder.id, task.id, now())
            .await
            .expect("cancel"),
        None
    );
    assert_eq!(
        store
            .retry_task(intruder.id, task.id, now())
            .await
            .expect("retry"),
        None
    );
    assert_eq!(task_now(store, &task).await.0, task, "unchanged");
}

pub async fn list_tasks(store: &DynStore) {
    let tenant = tenant(store).await;
    let a = register(store, tenant.id, new_agent("list-a")).await;
    let b = register(store, tenant.id, new_agent("list-b")).await;
    let t = now();
    let generation = session(store, &a, t).await;
    let first = create(store, new_task(tenant.id, a.id, t)).await;
    let second = create(store, deploy_task(tenant.id, a.id, t)).await;
    let third = create(store, new_task(tenant.id, b.id, t)).await;
    let fourth = create(store, deploy_task(tenant.id, b.id, t)).await;
    claimed(store, &a, generation, t).await;

    let ids = |page: Page<Task>| page.items.into_iter().map(|t| t.id).collect::<Vec<_>>();
    let list = |filter: TaskFilter| async move {
        store
            .list_tasks(tenant.id, &filter, None, 100)
            .await
            .expect("list")
    };
    assert_eq!(
        ids(list(TaskFilter::default()).await),
        vec![first.id, second.id, third.id, fourth.id]
    );
    let leased = TaskFilter {
        state: Some(TaskState::Leased),
        ..TaskFilter::default()
    };
    assert_eq!(ids(list(leased).await), vec![first.id]);
    let of_b = TaskFilter {
        agent_id: Some(b.id),
        ..TaskFilter::default()
    };
    assert_eq!(ids(list(of_b).await), vec![third.id, fourth.id]);
    let deploys = TaskFilter {
        task_type: Some("docker.run".to_string()),
        ..TaskFilter::default()
    };
    assert_eq!(ids(list(deploys).await), vec![second.id, fourth.id]);
    let pending_deploys_of_a = TaskFilter {
        state: Some(TaskState::Pending),
        agent_id: Some(a.id),
        task_type: Some("docker.run".to_string()),
    };
    assert_eq!(ids(list(pending_deploys_of_a).await), vec![second.id]);

    // Pages of 3: the cursor is the last id, and a short page ends the listing.
    let page = store
        .list_tasks(tenant.id, &TaskFilter::default(), None, 3)
        .await
        .expect("list");
    assert_eq!(page.next, Some(third.id.0));
    let rest = store
        .list_tasks(tenant.id, &TaskFilter::default(), page.next.map(TaskId), 3)
        .await
        .expect("list");
    assert_eq!(ids(rest.clone()), vec![fourth.id]);
    assert_eq!(rest.next, None);
}

pub async fn task_events(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("woken")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    let mut events = store.task_events();

    // Other writers may share the channel: wait for this agent's event, with a deadline.
    async fn woken(events: &mut tokio::sync::broadcast::Receiver<AgentId>, agent: AgentId) {
        let deadline = std::time::Duration::from_secs(10);
        tokio::time::timeout(deadline, async {
            loop {
                match events.recv().await {
                    Ok(id) if id == agent || id.0.is_nil() => return,
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(e) => panic!("task events closed: {e}"),
                }
            }
        })
        .await
        .expect("a task event for the agent in time");
    }

    let task = create(store, new_task(tenant.id, agent.id, t)).await;
    woken(&mut events, agent.id).await;
    claimed(store, &agent, generation, t).await;
    store
        .cancel_task(tenant.id, task.id, t)
        .await
        .expect("cancel");
    woken(&mut events, agent.id).await;
}
