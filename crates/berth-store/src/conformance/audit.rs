//! The audit log: per-tenant hash chains, the result entry `complete_attempt` writes in its
//! own transaction, and one linear chain under concurrent appends.

use berth_proto::audit::{actions, AuditActor, AuditEntry, ResultEvidence};

use super::support::*;
use crate::NewAuditEvent;

fn event(tenant: TenantId, action: &'static str, subject: &str) -> NewAuditEvent {
    NewAuditEvent {
        tenant_id: tenant,
        actor: AuditActor::Token {
            id: uuid::Uuid::new_v4(),
            name: "ops".to_string(),
            role: Role::Admin,
        },
        action,
        subject: subject.to_string(),
        details: serde_json::json!({"name": subject}),
        at: now(),
    }
}

async fn entries(store: &DynStore, tenant: TenantId) -> Vec<AuditEntry> {
    store.list_audit(tenant, 0, 1000).await.expect("list audit")
}

/// Every entry links to the one before, its hash is the SHA-256 of its JCS without `hash`, and
/// `seq` counts 1, 2, 3 … without gaps: the one chain check (`berth_proto::audit::ChainCheck`).
pub fn assert_linear_chain(chain: &[AuditEntry]) {
    if let Err(fault) = berth_proto::audit::verify_chain(chain, 0) {
        panic!("the audit chain breaks at entry {}: {fault}", fault.seq());
    }
}

pub async fn audit_chain(store: &DynStore) {
    let (a, b) = (tenant(store).await, tenant(store).await);
    for subject in ["one", "two", "three"] {
        let appended = store
            .append_audit(event(a.id, actions::TASK_CREATE, subject))
            .await
            .expect("append");
        assert_eq!(appended.subject, subject);
    }
    store
        .append_audit(event(b.id, actions::AGENT_DELETE, "other"))
        .await
        .expect("append");
    // A tenant's chain starts with its creation, by the operator, in its own transaction.
    let chain = entries(store, a.id).await;
    assert_eq!(
        chain.iter().map(|e| e.subject.clone()).collect::<Vec<_>>(),
        [a.id.to_string(), "one".into(), "two".into(), "three".into()]
    );
    assert_eq!(chain[0].action, actions::TENANT_CREATE);
    assert_eq!(chain[0].actor, operator());
    assert_eq!(chain[0].details, serde_json::json!({"name": a.name}));
    assert_linear_chain(&chain);
    assert_eq!(
        chain[1].at,
        millis(chain[1].at),
        "stored at millisecond precision"
    );
    // Each tenant has a chain of its own, and sees only it.
    let other = entries(store, b.id).await;
    assert_eq!(other.len(), 2);
    assert_linear_chain(&other);
    // Paging: after a seq, at most limit.
    let page = store.list_audit(a.id, 1, 1).await.expect("page");
    assert_eq!(page, vec![chain[1].clone()]);
}

/// An operator's task create and cancel, and a recorded result with its envelope and
/// certificate, are in the chain, each written in its action's transaction; a duplicate
/// result, a create without an actor (the server's read-backs) and a cancel of a finished task
/// add nothing.
pub async fn audit_task_entries(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("audited")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    let by_operator = NewTask {
        created_by: Some(operator()),
        ..new_task(tenant.id, agent.id, t)
    };
    let task = create(store, by_operator).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    let result = completion(&agent, generation, &attempt, AttemptResult::Succeeded, t);
    recorded(store, result.clone()).await;
    assert!(matches!(
        complete(store, result.clone()).await,
        CompleteOutcome::Duplicate(_)
    ));
    let unaudited = create(store, new_task(tenant.id, agent.id, t)).await;
    for cancel in [unaudited.id, task.id] {
        store
            .cancel_task(tenant.id, cancel, operator(), t)
            .await
            .expect("cancel");
    }
    let mut chain = entries(store, tenant.id).await;
    assert_linear_chain(&chain);
    let kinds: Vec<&str> = chain.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(
        kinds,
        [
            actions::TENANT_CREATE,
            actions::TASK_CREATE,
            actions::TASK_RESULT,
            actions::TASK_CANCEL
        ],
        "{chain:?}"
    );
    chain.remove(0);
    assert_eq!(chain[0].subject, task.id.to_string());
    assert_eq!(chain[0].actor, operator());
    assert_eq!(chain[2].subject, unaudited.id.to_string());
    let entry = &chain[1];
    assert_eq!(entry.action, actions::TASK_RESULT);
    assert_eq!(entry.subject, task.id.to_string());
    assert_eq!(entry.actor, AuditActor::Agent { id: agent.id.0 });
    let evidence: ResultEvidence =
        serde_json::from_value(entry.details.clone()).expect("result evidence");
    assert_eq!(evidence.envelope, result.envelope);
    assert_eq!(evidence.state, TaskState::Succeeded);
    use base64::Engine as _;
    assert_eq!(
        base64::engine::general_purpose::STANDARD
            .decode(&evidence.certificate)
            .expect("base64"),
        result.certificate_der
    );
}

/// Many appends at once (on PostgreSQL over several connections) still make one chain.
pub async fn audit_concurrent_appends(store: &DynStore) {
    let tenant = tenant(store).await;
    let appends = (0..40).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .append_audit(event(tenant.id, actions::TASK_CANCEL, &format!("task-{i}")))
                .await
                .expect("append")
        })
    });
    for append in appends.collect::<Vec<_>>() {
        append.await.expect("append task");
    }
    let chain = entries(store, tenant.id).await;
    assert_eq!(chain.len(), 41, "tenant.create and 40 appends");
    assert_linear_chain(&chain);
}

/// Token creation, agent update and delete are recorded by the store method itself, in the
/// action's transaction; what did nothing (an unknown agent) records nothing; no secret or
/// secret hash enters the log.
pub async fn audit_admin_entries(store: &DynStore) {
    let tenant = tenant(store).await;
    let t = now();
    let api_hash = token_hash();
    store
        .create_api_token(NewApiToken {
            id: TokenId::new(),
            tenant_id: tenant.id,
            name: "ci".to_string(),
            role: Role::Deployer,
            operator: false,
            token_hash: api_hash.clone(),
            created_at: t,
            created_by: Some(operator()),
        })
        .await
        .expect("api token");
    let registration_hash = token_hash();
    store
        .create_registration_token(NewRegistrationToken {
            id: TokenId::new(),
            tenant_id: tenant.id,
            token_hash: registration_hash.clone(),
            labels: labels(&[("tier", "qa")]),
            environment: None,
            expires_at: t + Duration::hours(1),
            created_at: t,
            created_by: Some(operator()),
        })
        .await
        .expect("registration token");
    let agent = register(store, tenant.id, new_agent("audited-admin")).await;
    let update = |id| {
        store.update_agent(
            tenant.id,
            id,
            AgentUpdate {
                labels: Some(labels(&[("tier", "prod")])),
                capabilities: None,
                updated_by: Some(operator()),
            },
            t,
        )
    };
    assert!(update(agent.id).await.expect("update").is_some());
    assert!(update(AgentId::new()).await.expect("update").is_none());
    for id in [agent.id, AgentId::new()] {
        store
            .delete_agent(tenant.id, id, operator(), t)
            .await
            .expect("delete");
    }
    let chain = entries(store, tenant.id).await;
    assert_linear_chain(&chain);
    let kinds: Vec<(&str, &str)> = chain
        .iter()
        .map(|e| (e.action.as_str(), e.subject.as_str()))
        .collect();
    let agent_id = agent.id.to_string();
    assert_eq!(
        kinds[3..],
        [
            (actions::AGENT_UPDATE, agent_id.as_str()),
            (actions::AGENT_DELETE, agent_id.as_str())
        ],
        "{chain:?}"
    );
    assert_eq!(
        kinds[..3].iter().map(|k| k.0).collect::<Vec<_>>(),
        [
            actions::TENANT_CREATE,
            actions::API_TOKEN_CREATE,
            actions::AGENT_TOKEN_CREATE
        ]
    );
    assert_eq!(
        chain[1].details,
        serde_json::json!({"name": "ci", "role": "deployer"})
    );
    let text = serde_json::to_string(&chain).expect("json");
    assert!(!text.contains(&api_hash) && !text.contains(&registration_hash));
}
