//! Conformance cases of environments and deployments: names unique per tenant, one active
//! deployment per environment (also under concurrent creates), approvals counted once per
//! token, cancellation by state, steps by compare-and-set with the environment's release
//! bookkeeping, drift observations, their events and audit entries, and tenant isolation.

use berth_proto::audit::{actions, AuditActor};
use berth_proto::deploy::{
    DeploymentKind, DeploymentState, Drift, ObservedComponent, RolloutPolicy, TargetPhase, Tier,
};
use berth_proto::task::ListOrder;
use berth_proto::{DeploymentId, EnvironmentId, ReleaseId};

use super::support::*;
use crate::{
    ApproveOutcome, Deployment, DeploymentDetail, DeploymentStep, DeploymentTarget, Environment,
    Event, EventFilter, NewDeployment, Release, ReleaseRef, TargetObservation,
};

pub(super) fn token(name: &str) -> AuditActor {
    AuditActor::Token {
        id: uuid::Uuid::new_v4(),
        name: name.to_string(),
        role: Role::Deployer,
    }
}

fn environment(tenant: TenantId, name: &str, tier: Tier) -> Environment {
    let at = millis(now());
    Environment {
        id: EnvironmentId::new(),
        tenant_id: tenant,
        name: name.to_string(),
        tier,
        selector: labels(&[("env", name), ("role", "web")]),
        target_type: Default::default(),
        policy: RolloutPolicy {
            max_parallel: 2,
            stop_on_failure: true,
            auto_rollback: false,
            health_timeout_secs: 45,
            task_timeout_secs: 300,
            require_ready: false,
        },
        promote_from: (tier == Tier::Prod).then(|| "staging".to_string()),
        approvals: tier.default_approvals(),
        auto_heal: tier == Tier::Prod,
        drift_interval_secs: 120,
        current_release: None,
        previous_release: None,
        pinned_release: None,
        created_by: operator(),
        created_at: at,
        updated_at: at,
    }
}

pub(super) async fn create_environment(
    store: &DynStore,
    tenant: TenantId,
    name: &str,
) -> Environment {
    store
        .create_environment(environment(tenant, name, Tier::Qa), operator())
        .await
        .expect("create environment")
}

pub(super) async fn release(store: &DynStore, tenant: TenantId, name: &str) -> ReleaseRef {
    let created = store
        .create_release(
            Release {
                id: ReleaseId::new(),
                tenant_id: tenant,
                name: name.to_string(),
                components: Vec::new(),
                compose_lock: Some("services: {}\n".to_string()),
                ssh: None,
                created_at: now(),
            },
            operator(),
        )
        .await
        .expect("create release");
    ReleaseRef {
        id: created.id,
        name: created.name,
    }
}

fn target(deployment: DeploymentId, wave: u32, name: &str) -> DeploymentTarget {
    DeploymentTarget {
        deployment_id: deployment,
        agent_id: AgentId::new(),
        agent_name: name.to_string(),
        wave,
        phase: TargetPhase::Waiting,
        tasks: Vec::new(),
        rollback_tasks: Vec::new(),
        error_code: None,
        detail: None,
        started_at: None,
        finished_at: None,
    }
}

/// A deployment of `release` into `env` with two targets in wave 0 and one in wave 1, as the
/// server would create it.
pub(super) fn new_deployment(
    env: &Environment,
    release: &ReleaseRef,
    state: DeploymentState,
) -> NewDeployment {
    let at = millis(now());
    let id = DeploymentId::new();
    NewDeployment {
        deployment: Deployment {
            id,
            tenant_id: env.tenant_id,
            environment_id: env.id,
            environment_name: env.name.clone(),
            release: release.clone(),
            kind: DeploymentKind::Deploy,
            state,
            rolling_back: false,
            requested_by: token("requester"),
            rollback_release: env.current_release.clone(),
            approvals_required: if state == DeploymentState::AwaitingApproval {
                2
            } else {
                0
            },
            cancel_requested: false,
            current_wave: 0,
            error_code: None,
            detail: None,
            version: 0,
            created_at: at,
            updated_at: at,
            finished_at: None,
        },
        targets: vec![
            target(id, 1, "c-host"),
            target(id, 0, "b-host"),
            target(id, 0, "a-host"),
        ],
        pin: false,
    }
}

pub(super) async fn deploy(store: &DynStore, new: NewDeployment) -> DeploymentDetail {
    store
        .create_deployment(new)
        .await
        .expect("create deployment")
}

async fn deployment_now(store: &DynStore, d: &Deployment) -> DeploymentDetail {
    store
        .get_deployment(d.tenant_id, d.id)
        .await
        .expect("get deployment")
        .expect("deployment exists")
}

/// The step the reconciler would write from `from`: `state`, with `targets` replaced.
fn step(
    from: &Deployment,
    state: DeploymentState,
    targets: Vec<DeploymentTarget>,
) -> DeploymentStep {
    DeploymentStep {
        tenant_id: from.tenant_id,
        id: from.id,
        expected_version: from.version,
        state,
        rolling_back: false,
        current_wave: from.current_wave,
        error_code: None,
        detail: None,
        targets,
        now: now(),
    }
}

async fn apply(store: &DynStore, step: DeploymentStep) -> DeploymentDetail {
    store
        .record_deployment_step(step)
        .await
        .expect("record step")
        .expect("step applied")
}

/// Runs `d` to `succeeded` in two steps, every target succeeded.
async fn succeed(store: &DynStore, d: &DeploymentDetail) -> DeploymentDetail {
    let running = apply(
        store,
        step(&d.deployment, DeploymentState::Running, Vec::new()),
    )
    .await;
    let done: Vec<_> = running
        .targets
        .iter()
        .map(|t| DeploymentTarget {
            phase: TargetPhase::Succeeded,
            ..t.clone()
        })
        .collect();
    apply(
        store,
        step(&running.deployment, DeploymentState::Succeeded, done),
    )
    .await
}

pub(super) async fn audit_actions(store: &DynStore, tenant: TenantId) -> Vec<(String, String)> {
    store
        .list_audit(tenant, 0, 1000)
        .await
        .expect("list audit")
        .into_iter()
        .map(|e| (e.action, e.subject))
        .collect()
}

fn pair(action: &str, subject: impl ToString) -> (String, String) {
    (action.to_string(), subject.to_string())
}

// --- cases ---

pub async fn environment_create_get_list(store: &DynStore) {
    let t = tenant(store).await;
    let wanted = environment(t.id, "prod", Tier::Prod);
    let created = store
        .create_environment(wanted.clone(), operator())
        .await
        .expect("create environment");
    assert_eq!(created, wanted, "the environment reads back as written");
    assert_eq!(
        store.get_environment(t.id, "prod").await.expect("get"),
        Some(wanted.clone())
    );
    assert_eq!(store.get_environment(t.id, "qa").await.expect("get"), None);
    let staging = create_environment(store, t.id, "staging").await;
    let dev = create_environment(store, t.id, "dev").await;
    let listed = store.list_environments(t.id).await.expect("list");
    assert_eq!(listed, vec![dev, wanted.clone(), staging], "by name");

    // The name is unique per tenant, whatever else differs; the first stays as it was.
    assert_conflict(
        store
            .create_environment(environment(t.id, "prod", Tier::Dev), operator())
            .await,
        "environment_name",
    );
    assert_eq!(
        store.get_environment(t.id, "prod").await.expect("get"),
        Some(wanted.clone())
    );
    let audit = audit_actions(store, t.id).await;
    let creates = audit
        .iter()
        .filter(|(action, _)| action == actions::ENVIRONMENT_CREATE)
        .count();
    assert_eq!(
        creates, 3,
        "one entry per environment created, none for the refusal"
    );
    assert!(audit.contains(&pair(actions::ENVIRONMENT_CREATE, wanted.id)));

    // Another tenant may use the name.
    let other = tenant(store).await;
    create_environment(store, other.id, "prod").await;
}

pub async fn deployment_create_round_trip(store: &DynStore) {
    let t = tenant(store).await;
    let env = create_environment(store, t.id, "qa").await;
    let r1 = release(store, t.id, "r1").await;
    let new = new_deployment(&env, &r1, DeploymentState::Pending);
    let created = deploy(store, new.clone()).await;
    let mut targets = new.targets.clone();
    targets.sort_by(|a, b| (a.wave, &a.agent_name).cmp(&(b.wave, &b.agent_name)));
    let wanted = DeploymentDetail {
        deployment: new.deployment.clone(),
        targets,
        approvals: Vec::new(),
    };
    assert_eq!(created, wanted, "by wave, then agent name");
    assert_eq!(deployment_now(store, &created.deployment).await, wanted);
    assert_eq!(created.deployment.version, 0);
    assert!(audit_actions(store, t.id)
        .await
        .contains(&pair(actions::DEPLOYMENT_CREATE, created.deployment.id)));

    // Listing: by id, per environment, in pages.
    succeed(store, &created).await;
    let other_env = create_environment(store, t.id, "dev").await;
    let second = deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;
    let elsewhere = deploy(
        store,
        new_deployment(&other_env, &r1, DeploymentState::Pending),
    )
    .await;
    let all = store
        .list_deployments(t.id, None, None, ListOrder::Oldest, 100)
        .await
        .expect("list");
    let ids: Vec<_> = all.items.iter().map(|d| d.id).collect();
    assert_eq!(
        ids,
        vec![
            created.deployment.id,
            second.deployment.id,
            elsewhere.deployment.id
        ]
    );
    assert_eq!(all.next, None);
    let first_page = store
        .list_deployments(t.id, Some(env.id), None, ListOrder::Oldest, 1)
        .await
        .expect("list");
    assert_eq!(first_page.items.len(), 1);
    assert_eq!(first_page.items[0].id, created.deployment.id);
    assert_eq!(first_page.items[0].state, DeploymentState::Succeeded);
    let after = first_page.next.map(DeploymentId).expect("a next page");
    let second_page = store
        .list_deployments(t.id, Some(env.id), Some(after), ListOrder::Oldest, 1)
        .await
        .expect("list");
    assert_eq!(second_page.items, vec![second.deployment.clone()]);
    let last = store
        .list_deployments(
            t.id,
            Some(env.id),
            Some(second.deployment.id),
            ListOrder::Oldest,
            1,
        )
        .await
        .expect("list");
    assert_eq!(last.items, Vec::new());
    assert_eq!(last.next, None);
    // Newest first: the environment's latest deployment, then the one before.
    let newest = store
        .list_deployments(t.id, Some(env.id), None, ListOrder::Newest, 1)
        .await
        .expect("list");
    assert_eq!(newest.items, vec![second.deployment.clone()]);
    let before = newest.next.map(DeploymentId).expect("a next page");
    let older = store
        .list_deployments(t.id, Some(env.id), Some(before), ListOrder::Newest, 1)
        .await
        .expect("list");
    assert_eq!(older.items[0].id, created.deployment.id);
}

pub async fn deployment_one_active_per_environment(store: &DynStore) {
    let t = tenant(store).await;
    let env = create_environment(store, t.id, "qa").await;
    let r1 = release(store, t.id, "r1").await;
    let first = deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;
    for state in [DeploymentState::Pending, DeploymentState::AwaitingApproval] {
        assert_conflict(
            store
                .create_deployment(new_deployment(&env, &r1, state))
                .await,
            "deployment_in_progress",
        );
    }
    // A running one holds the environment too; a finished one frees it.
    let running = apply(
        store,
        step(&first.deployment, DeploymentState::Running, Vec::new()),
    )
    .await;
    assert_conflict(
        store
            .create_deployment(new_deployment(&env, &r1, DeploymentState::Pending))
            .await,
        "deployment_in_progress",
    );
    apply(
        store,
        step(&running.deployment, DeploymentState::Failed, Vec::new()),
    )
    .await;
    let next = deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;
    let listed = store
        .list_deployments(t.id, Some(env.id), None, ListOrder::Oldest, 100)
        .await
        .expect("list");
    assert_eq!(listed.items.len(), 2, "the refused creates wrote nothing");
    let refused = audit_actions(store, t.id)
        .await
        .iter()
        .filter(|(action, _)| action == actions::DEPLOYMENT_CREATE)
        .count();
    assert_eq!(refused, 2, "no audit entry for a refused create");
    // Another environment is not held.
    let other = create_environment(store, t.id, "dev").await;
    deploy(store, new_deployment(&other, &r1, DeploymentState::Pending)).await;
    assert_eq!(next.deployment.state, DeploymentState::Pending);

    // Concurrent creates in a fresh environment: exactly one wins.
    let race = create_environment(store, t.id, "race").await;
    let attempts = (0..8).map(|_| {
        let store = store.clone();
        let new = new_deployment(&race, &r1, DeploymentState::Pending);
        tokio::spawn(async move { store.create_deployment(new).await })
    });
    let mut won = 0;
    for attempt in attempts {
        match attempt.await.expect("join") {
            Ok(_) => won += 1,
            Err(StoreError::Conflict { constraint }) => {
                assert_eq!(constraint, "deployment_in_progress")
            }
            Err(e) => panic!("unexpected error: {e:?}"),
        }
    }
    assert_eq!(won, 1, "exactly one concurrent create wins");
    let listed = store
        .list_deployments(t.id, Some(race.id), None, ListOrder::Oldest, 100)
        .await
        .expect("list");
    assert_eq!(listed.items.len(), 1);
}

pub async fn deployment_approvals(store: &DynStore) {
    let t = tenant(store).await;
    let env = create_environment(store, t.id, "prod").await;
    let r1 = release(store, t.id, "r1").await;
    let d = deploy(
        store,
        new_deployment(&env, &r1, DeploymentState::AwaitingApproval),
    )
    .await;
    let id = d.deployment.id;
    assert_eq!(d.deployment.approvals_required, 2);
    let (alice, bob) = (token("alice"), token("bob"));

    let approve = |actor: AuditActor| {
        let store = store.clone();
        async move {
            store
                .approve_deployment(t.id, id, actor, now())
                .await
                .expect("approve")
                .expect("deployment exists")
        }
    };
    let ApproveOutcome::Approved(once) = approve(alice.clone()).await else {
        panic!("the first approval is recorded");
    };
    assert_eq!(once.deployment.state, DeploymentState::AwaitingApproval);
    assert_eq!(once.approvals.len(), 1);
    assert_eq!(once.approvals[0].actor, alice);
    let AuditActor::Token { id: alice_id, .. } = &alice else {
        unreachable!()
    };
    assert_eq!(once.approvals[0].token_id, TokenId(*alice_id));
    // The same token again counts once.
    let ApproveOutcome::Approved(twice) = approve(alice.clone()).await else {
        panic!("a repeated approval is still approved");
    };
    assert_eq!(twice.approvals, once.approvals);
    assert_eq!(twice.deployment.state, DeploymentState::AwaitingApproval);
    assert_eq!(twice.deployment.version, d.deployment.version);
    // The second token reaches the count: pending, for the reconciler.
    let ApproveOutcome::Approved(enough) = approve(bob.clone()).await else {
        panic!("the second approval is recorded");
    };
    assert_eq!(enough.deployment.state, DeploymentState::Pending);
    assert_eq!(enough.approvals.len(), 2);
    assert_eq!(enough.deployment.version, d.deployment.version + 1);
    assert_eq!(deployment_now(store, &d.deployment).await, enough);
    // Not awaiting any more: nothing written.
    let ApproveOutcome::NotAwaiting(after) = approve(token("carol")).await else {
        panic!("a pending deployment awaits no approval");
    };
    assert_eq!(after, enough);
    let approvals = audit_actions(store, t.id)
        .await
        .into_iter()
        .filter(|(action, _)| action == actions::DEPLOYMENT_APPROVE)
        .collect::<Vec<_>>();
    assert_eq!(
        approvals,
        vec![
            pair(actions::DEPLOYMENT_APPROVE, id),
            pair(actions::DEPLOYMENT_APPROVE, id)
        ],
        "one entry per token that approved"
    );

    // No such deployment; an agent cannot approve.
    assert_eq!(
        store
            .approve_deployment(t.id, DeploymentId::new(), token("x"), now())
            .await
            .expect("approve"),
        None
    );
    assert!(store
        .approve_deployment(
            t.id,
            id,
            AuditActor::Agent {
                id: uuid::Uuid::new_v4()
            },
            now()
        )
        .await
        .is_err());

    // Concurrent approvals by distinct tokens queue: the second moves it to pending, the rest
    // find it no longer awaiting.
    let env2 = create_environment(store, t.id, "prod-2").await;
    let d2 = deploy(
        store,
        new_deployment(&env2, &r1, DeploymentState::AwaitingApproval),
    )
    .await;
    let approvals = (0..4).map(|i| {
        let store = store.clone();
        let id = d2.deployment.id;
        tokio::spawn(async move {
            store
                .approve_deployment(t.id, id, token(&format!("t{i}")), now())
                .await
                .expect("approve")
                .expect("exists")
        })
    });
    let mut approved = 0;
    for outcome in approvals {
        if let ApproveOutcome::Approved(_) = outcome.await.expect("join") {
            approved += 1;
        }
    }
    let d2 = deployment_now(store, &d2.deployment).await;
    assert_eq!(d2.deployment.state, DeploymentState::Pending);
    assert_eq!(
        d2.approvals.len(),
        approved,
        "every recorded approval is kept"
    );
    assert_eq!(
        approved, 2,
        "the approvals after the second find it pending"
    );
}

pub async fn deployment_cancel(store: &DynStore) {
    let t = tenant(store).await;
    let r1 = release(store, t.id, "r1").await;
    let cancel = |d: Deployment| {
        let store = store.clone();
        async move {
            store
                .cancel_deployment(d.tenant_id, d.id, operator(), now())
                .await
                .expect("cancel")
                .expect("deployment exists")
        }
    };

    // Pending and awaiting approval: cancelled at once, the waiting targets skipped.
    for (name, state) in [
        ("a", DeploymentState::Pending),
        ("b", DeploymentState::AwaitingApproval),
    ] {
        let env = create_environment(store, t.id, name).await;
        let d = deploy(store, new_deployment(&env, &r1, state)).await;
        let cancelled = cancel(d.deployment.clone()).await;
        assert_eq!(cancelled.deployment.state, DeploymentState::Cancelled);
        assert!(cancelled.deployment.finished_at.is_some());
        assert_eq!(cancelled.deployment.version, d.deployment.version + 1);
        assert!(cancelled
            .targets
            .iter()
            .all(|t| t.phase == TargetPhase::Skipped && t.finished_at.is_some()));
        assert_eq!(deployment_now(store, &d.deployment).await, cancelled);
        // It no longer holds the environment.
        deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;
    }

    // Running: asked to stop after the running wave; the targets are the reconciler's.
    let env = create_environment(store, t.id, "c").await;
    let d = deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;
    let mut queued = d.targets.clone();
    queued[0].phase = TargetPhase::Queued;
    let running = apply(
        store,
        step(
            &d.deployment,
            DeploymentState::Running,
            vec![queued[0].clone()],
        ),
    )
    .await;
    let requested = cancel(running.deployment.clone()).await;
    assert_eq!(requested.deployment.state, DeploymentState::Running);
    assert!(requested.deployment.cancel_requested);
    assert_eq!(requested.deployment.finished_at, None);
    assert_eq!(requested.targets, running.targets);
    // Asking again changes nothing.
    assert_eq!(cancel(running.deployment.clone()).await, requested);
    // A step decided before the request was read loses the race.
    assert_eq!(
        store
            .record_deployment_step(step(
                &running.deployment,
                DeploymentState::Running,
                Vec::new()
            ))
            .await
            .expect("step"),
        None
    );

    // Terminal: unchanged.
    let failed = apply(
        store,
        step(&requested.deployment, DeploymentState::Failed, Vec::new()),
    )
    .await;
    assert_eq!(cancel(failed.deployment.clone()).await, failed);

    let cancels = audit_actions(store, t.id)
        .await
        .into_iter()
        .filter(|(action, _)| action == actions::DEPLOYMENT_CANCEL)
        .count();
    assert_eq!(cancels, 3, "one entry per cancel that changed something");
    assert_eq!(
        store
            .cancel_deployment(t.id, DeploymentId::new(), operator(), now())
            .await
            .expect("cancel"),
        None
    );
}

pub async fn deployment_step_compare_and_set(store: &DynStore) {
    let t = tenant(store).await;
    let env = create_environment(store, t.id, "qa").await;
    let r1 = release(store, t.id, "r1").await;
    let d = deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;

    let mut started = d.targets[0].clone();
    started.phase = TargetPhase::Queued;
    started.tasks = vec![TaskId::new(), TaskId::new()];
    started.started_at = Some(millis(now()));
    let mut first = step(
        &d.deployment,
        DeploymentState::Running,
        vec![started.clone()],
    );
    first.detail = Some("wave 0".to_string());
    let running = apply(store, first.clone()).await;
    assert_eq!(running.deployment.state, DeploymentState::Running);
    assert_eq!(running.deployment.version, 1);
    assert_eq!(running.deployment.detail.as_deref(), Some("wave 0"));
    assert_eq!(running.deployment.updated_at, millis(first.now));
    assert_eq!(running.deployment.finished_at, None);
    assert_eq!(running.targets[0], started);
    assert_eq!(
        running.targets[1..],
        d.targets[1..],
        "untouched targets stay"
    );

    // The same step again is stale: nothing written.
    let mut stale = first.clone();
    stale.state = DeploymentState::Failed;
    stale.targets[0].phase = TargetPhase::Failed;
    assert_eq!(
        store.record_deployment_step(stale).await.expect("step"),
        None
    );
    assert_eq!(deployment_now(store, &d.deployment).await, running);
    // Another tenant's step, or none such, writes nothing either.
    let mut foreign = step(&running.deployment, DeploymentState::Failed, Vec::new());
    foreign.tenant_id = tenant(store).await.id;
    assert_eq!(
        store.record_deployment_step(foreign).await.expect("step"),
        None
    );
    assert_eq!(deployment_now(store, &d.deployment).await, running);

    // Two concurrent steps from one version: exactly one applies.
    let steps = (0..4).map(|i| {
        let store = store.clone();
        let mut s = step(&running.deployment, DeploymentState::Running, Vec::new());
        s.current_wave = i;
        tokio::spawn(async move { store.record_deployment_step(s).await.expect("step") })
    });
    let mut applied = 0;
    for s in steps {
        if s.await.expect("join").is_some() {
            applied += 1;
        }
    }
    assert_eq!(applied, 1, "one step per version");
    let now_d = deployment_now(store, &d.deployment).await;
    assert_eq!(now_d.deployment.version, 2);

    // Success makes the release current.
    let done = succeed(store, &now_d).await;
    assert_eq!(done.deployment.state, DeploymentState::Succeeded);
    assert!(done.deployment.finished_at.is_some());
    assert!(done
        .targets
        .iter()
        .all(|t| t.phase == TargetPhase::Succeeded));
    let env_now = store
        .get_environment(t.id, "qa")
        .await
        .expect("get")
        .expect("env");
    assert_eq!(env_now.current_release, Some(r1.clone()));
    assert_eq!(env_now.previous_release, None);
    assert!(store.succeeded_in(t.id, "qa", r1.id).await.expect("check"));

    // The next release: current moves to previous.
    let r2 = release(store, t.id, "r2").await;
    assert!(!store.succeeded_in(t.id, "qa", r2.id).await.expect("check"));
    let d2 = deploy(
        store,
        new_deployment(&env_now, &r2, DeploymentState::Pending),
    )
    .await;
    assert_eq!(d2.deployment.rollback_release, Some(r1.clone()));
    succeed(store, &d2).await;
    let env_now = store
        .get_environment(t.id, "qa")
        .await
        .expect("get")
        .expect("env");
    assert_eq!(env_now.current_release, Some(r2.clone()));
    assert_eq!(env_now.previous_release, Some(r1.clone()));
    assert!(store.succeeded_in(t.id, "qa", r2.id).await.expect("check"));
    assert!(!store.succeeded_in(t.id, "dev", r2.id).await.expect("check"));

    // The same release again (a heal) keeps the previous one.
    let d3 = deploy(
        store,
        new_deployment(&env_now, &r2, DeploymentState::Pending),
    )
    .await;
    succeed(store, &d3).await;
    let env_now = store
        .get_environment(t.id, "qa")
        .await
        .expect("get")
        .expect("env");
    assert_eq!(env_now.current_release, Some(r2.clone()));
    assert_eq!(env_now.previous_release, Some(r1.clone()));

    // A failed deployment leaves the environment as it was.
    let r3 = release(store, t.id, "r3").await;
    let d4 = deploy(
        store,
        new_deployment(&env_now, &r3, DeploymentState::Pending),
    )
    .await;
    let failed = apply(
        store,
        step(&d4.deployment, DeploymentState::RolledBack, Vec::new()),
    )
    .await;
    assert!(failed.deployment.finished_at.is_some());
    let after = store
        .get_environment(t.id, "qa")
        .await
        .expect("get")
        .expect("env");
    assert_eq!(after.current_release, Some(r2));
    assert_eq!(after.previous_release, Some(r1));
    assert!(!store.succeeded_in(t.id, "qa", r3.id).await.expect("check"));
    let no_step_audit = audit_actions(store, t.id)
        .await
        .iter()
        .all(|(action, _)| !action.starts_with("deployment.") || action == "deployment.create");
    assert!(no_step_audit, "steps write no audit entry");
}

pub async fn environment_pin_and_unpin(store: &DynStore) {
    let t = tenant(store).await;
    let env = create_environment(store, t.id, "qa").await;
    let r1 = release(store, t.id, "r1").await;
    let mut rollback = new_deployment(&env, &r1, DeploymentState::Pending);
    rollback.deployment.kind = DeploymentKind::Rollback;
    rollback.pin = true;
    let d = deploy(store, rollback).await;
    assert_eq!(d.deployment.kind, DeploymentKind::Rollback);
    let pinned = store
        .get_environment(t.id, "qa")
        .await
        .expect("get")
        .expect("env");
    assert_eq!(pinned.pinned_release, Some(r1.clone()));

    let at = millis(now());
    let unpinned = store
        .unpin_environment(t.id, "qa", token("ops"), at)
        .await
        .expect("unpin")
        .expect("env");
    assert_eq!(unpinned.pinned_release, None);
    assert_eq!(unpinned.updated_at, at);
    assert_eq!(
        store.get_environment(t.id, "qa").await.expect("get"),
        Some(unpinned)
    );
    assert!(audit_actions(store, t.id)
        .await
        .contains(&pair(actions::ENVIRONMENT_UNPIN, env.id)));
    assert_eq!(
        store
            .unpin_environment(t.id, "nope", operator(), now())
            .await
            .expect("unpin"),
        None
    );
}

pub async fn active_deployments_and_released_environments(store: &DynStore) {
    let t = tenant(store).await;
    let r1 = release(store, t.id, "r1").await;
    let mut mine = Vec::new();
    for (name, state) in [
        ("a", DeploymentState::Pending),
        ("b", DeploymentState::AwaitingApproval),
        ("c", DeploymentState::Pending),
        ("d", DeploymentState::Pending),
    ] {
        let env = create_environment(store, t.id, name).await;
        mine.push((
            env.clone(),
            deploy(store, new_deployment(&env, &r1, state)).await,
        ));
    }
    // c runs, d finishes.
    apply(
        store,
        step(&mine[2].1.deployment, DeploymentState::Running, Vec::new()),
    )
    .await;
    succeed(store, &mine[3].1).await;

    let active: Vec<_> = store
        .active_deployments(10_000)
        .await
        .expect("active")
        .into_iter()
        .filter(|d| d.deployment.tenant_id == t.id)
        .collect();
    let ids: Vec<_> = active.iter().map(|d| d.deployment.id).collect();
    assert_eq!(
        ids,
        vec![mine[0].1.deployment.id, mine[2].1.deployment.id],
        "pending and running, oldest first"
    );
    assert_eq!(active[0], mine[0].1, "with targets");

    // Only d's environment has a current release; paging by id reaches it.
    let mut seen = Vec::new();
    let mut after = None;
    loop {
        let page = store
            .environments_with_release(after, 2)
            .await
            .expect("environments with a release");
        assert!(page.len() <= 2);
        assert!(page.windows(2).all(|w| w[0].id < w[1].id));
        assert!(page.iter().all(|e| e.current_release.is_some()));
        let Some(last) = page.last() else { break };
        after = Some(last.id);
        seen.extend(page.into_iter().filter(|e| e.tenant_id == t.id));
    }
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].id, mine[3].0.id);
    assert_eq!(seen[0].current_release, Some(r1));
}

fn observation(env: &Environment, agent: AgentId, drift: Drift) -> TargetObservation {
    TargetObservation {
        tenant_id: env.tenant_id,
        environment_id: env.id,
        agent_id: agent,
        check_task_id: Some(TaskId::new()),
        next_check_at: millis(now() + Duration::seconds(120)),
        drift,
        running_release: Some("r1".to_string()),
        components: vec![ObservedComponent {
            name: "web".to_string(),
            digest: Some(format!("sha256:{}", "ab".repeat(32))),
            release: Some("r1".to_string()),
            state: Some("running".to_string()),
        }],
        verified_at: Some(millis(now())),
    }
}

pub async fn target_observations_upsert(store: &DynStore) {
    let t = tenant(store).await;
    let env = create_environment(store, t.id, "qa").await;
    let other_env = create_environment(store, t.id, "dev").await;
    let (a, b) = (AgentId::new(), AgentId::new());
    let mut first = observation(&env, a, Drift::Unverified);
    first.check_task_id = None;
    first.verified_at = None;
    first.components = Vec::new();
    first.running_release = None;
    store
        .put_target_observation(first.clone())
        .await
        .expect("put");
    let second = observation(&env, b, Drift::InSync);
    store
        .put_target_observation(second.clone())
        .await
        .expect("put");
    store
        .put_target_observation(observation(&other_env, a, Drift::InSync))
        .await
        .expect("put");
    let mut wanted = vec![first, second.clone()];
    wanted.sort_by_key(|o| o.agent_id);
    assert_eq!(
        store.target_observations(env.id).await.expect("read"),
        wanted,
        "as written, by agent id"
    );
    // Replaced whole.
    let drifted = observation(&env, a, Drift::Drifted);
    store
        .put_target_observation(drifted.clone())
        .await
        .expect("put");
    let mut wanted = vec![drifted.clone(), second];
    wanted.sort_by_key(|o| o.agent_id);
    assert_eq!(
        store.target_observations(env.id).await.expect("read"),
        wanted
    );
    assert_eq!(
        store
            .target_observations(other_env.id)
            .await
            .expect("read")
            .len(),
        1
    );

    // A change of drift is an event of the environment; the same drift again is not.
    store
        .put_target_observation(drifted.clone())
        .await
        .expect("put");
    let by_env = EventFilter {
        environment: Some(env.id),
        ..EventFilter::default()
    };
    let events = store
        .read_events(t.id, &by_env, 0, 1000)
        .await
        .expect("events");
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].kind, "environment.drift");
    assert_eq!(events[0].agent_id, Some(a));
    assert_eq!(events[0].environment_id, Some(env.id));
    assert_eq!(events[0].data["drift"], "drifted");
    // A first observation that is already drifted is an event too.
    store
        .put_target_observation(observation(&other_env, b, Drift::Drifted))
        .await
        .expect("put");
    let by_other = EventFilter {
        environment: Some(other_env.id),
        ..EventFilter::default()
    };
    assert_eq!(
        store
            .read_events(t.id, &by_other, 0, 1000)
            .await
            .expect("events")
            .len(),
        1
    );
}

fn kinds(events: &[Event]) -> Vec<(&str, &str)> {
    events
        .iter()
        .map(|e| {
            let what = e.data.get("state").or_else(|| e.data.get("phase"));
            (e.kind.as_str(), what.and_then(|s| s.as_str()).unwrap_or(""))
        })
        .collect()
}

pub async fn deployment_events(store: &DynStore) {
    let t = tenant(store).await;
    let env = create_environment(store, t.id, "qa").await;
    let r1 = release(store, t.id, "r1").await;
    let d = deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;
    let by_deployment = EventFilter {
        deployment: Some(d.deployment.id),
        ..EventFilter::default()
    };
    let read = |filter: EventFilter| {
        let store = store.clone();
        async move {
            store
                .read_events(t.id, &filter, 0, 1000)
                .await
                .expect("read events")
        }
    };
    let created = read(by_deployment.clone()).await;
    assert_eq!(kinds(&created), vec![("deployment.state", "pending")]);

    // One step: the state changes, one target's phase changes, another target is rewritten
    // as it was: one event each for what changed.
    let mut queued = d.targets[0].clone();
    queued.phase = TargetPhase::Queued;
    let unchanged = d.targets[1].clone();
    let running = apply(
        store,
        step(
            &d.deployment,
            DeploymentState::Running,
            vec![queued.clone(), unchanged],
        ),
    )
    .await;
    let events = read(by_deployment.clone()).await;
    assert_eq!(
        kinds(&events),
        vec![
            ("deployment.state", "pending"),
            ("deployment.state", "running"),
            ("deployment.target", "queued"),
        ]
    );
    assert!(events
        .iter()
        .all(|e| e.deployment_id == Some(d.deployment.id) && e.environment_id == Some(env.id)));
    let target_event = &events[2];
    assert_eq!(target_event.agent_id, Some(queued.agent_id));
    assert_eq!(
        target_event.data["deploymentId"],
        d.deployment.id.to_string()
    );
    assert_eq!(events[1].data["rollingBack"], false);
    assert_eq!(events[1].data["cancelRequested"], false);

    // A step that changes only the detail is no event.
    let mut quiet = step(&running.deployment, DeploymentState::Running, Vec::new());
    quiet.detail = Some("still going".into());
    apply(store, quiet).await;
    assert_eq!(read(by_deployment.clone()).await, events);

    // The environment's filter selects them, the agent's the target's, and another
    // deployment's filter none.
    let by_env = EventFilter {
        environment: Some(env.id),
        ..EventFilter::default()
    };
    assert_eq!(read(by_env).await, events);
    let by_agent = EventFilter {
        agent: Some(queued.agent_id),
        ..EventFilter::default()
    };
    assert_eq!(read(by_agent).await, vec![target_event.clone()]);
    let both = EventFilter {
        deployment: Some(d.deployment.id),
        environment: Some(EnvironmentId::new()),
        ..EventFilter::default()
    };
    assert_eq!(read(both).await, Vec::new(), "every filter set must match");
    let elsewhere = EventFilter {
        deployment: Some(DeploymentId::new()),
        ..EventFilter::default()
    };
    assert_eq!(read(elsewhere).await, Vec::new());
    // Unfiltered, the tenant's stream has them in order after its other events.
    let all = read(EventFilter::default()).await;
    assert!(all.ends_with(&events));
}

pub async fn deployment_tenant_isolation(store: &DynStore) {
    let owner = tenant(store).await;
    let env = create_environment(store, owner.id, "qa").await;
    let r1 = release(store, owner.id, "r1").await;
    let d = deploy(
        store,
        new_deployment(&env, &r1, DeploymentState::AwaitingApproval),
    )
    .await;
    store
        .put_target_observation(observation(&env, AgentId::new(), Drift::Drifted))
        .await
        .expect("put");
    let id = d.deployment.id;

    let other = tenant(store).await.id;
    assert_eq!(store.get_environment(other, "qa").await.expect("get"), None);
    assert_eq!(
        store.list_environments(other).await.expect("list"),
        Vec::new()
    );
    assert_eq!(store.get_deployment(other, id).await.expect("get"), None);
    assert_eq!(
        store
            .list_deployments(other, None, None, ListOrder::Oldest, 100)
            .await
            .expect("list")
            .items,
        Vec::new()
    );
    assert_eq!(
        store
            .list_deployments(other, Some(env.id), None, ListOrder::Oldest, 100)
            .await
            .expect("list")
            .items,
        Vec::new()
    );
    assert!(!store.succeeded_in(other, "qa", r1.id).await.expect("check"));
    assert_eq!(
        store
            .approve_deployment(other, id, token("intruder"), now())
            .await
            .expect("approve"),
        None
    );
    assert_eq!(
        store
            .cancel_deployment(other, id, operator(), now())
            .await
            .expect("cancel"),
        None
    );
    assert_eq!(
        store
            .unpin_environment(other, "qa", operator(), now())
            .await
            .expect("unpin"),
        None
    );
    let filters = [
        EventFilter::default(),
        EventFilter {
            deployment: Some(id),
            ..EventFilter::default()
        },
        EventFilter {
            environment: Some(env.id),
            ..EventFilter::default()
        },
    ];
    for filter in filters {
        assert_eq!(
            store
                .read_events(other, &filter, 0, 1000)
                .await
                .expect("events"),
            Vec::new()
        );
    }
    // Nothing the intruder tried changed the owner's deployment.
    assert_eq!(deployment_now(store, &d.deployment).await, d);
}

/// The task a deployment step creates for one part of one target (`purpose` as the server's),
/// run by `agent` (a deployment target's own id need not be an agent: an SSH target's task runs
/// on its via agent).
fn step_task(
    d: &Deployment,
    target: &DeploymentTarget,
    agent: &Agent,
    purpose: &str,
    part: &str,
) -> NewTask {
    NewTask {
        idempotency_key: Some(crate::deployment_task_key(
            d.id,
            target.agent_id,
            purpose,
            part,
        )),
        created_by: Some(d.requested_by.clone()),
        ..deploy_task(d.tenant_id, agent.id, now())
    }
}

/// Creates `task` for a step decided from `read` (the deployment as the step read it).
async fn create_for_step(
    store: &DynStore,
    read: &Deployment,
    task: NewTask,
) -> crate::DeploymentTaskOutcome {
    store
        .create_deployment_task(
            crate::DeploymentGuard {
                deployment_id: read.id,
                expected_version: read.version,
            },
            task,
        )
        .await
        .expect("create deployment task")
}

async fn created_for_step(store: &DynStore, read: &Deployment, task: NewTask) -> Task {
    match create_for_step(store, read, task).await {
        crate::DeploymentTaskOutcome::Decided(CreateTaskOutcome::Created(task)) => task,
        other => panic!("expected a new task, got {other:?}"),
    }
}

/// Issue 29: a cancel committing while a step creates tasks. A create decided from a version
/// the cancel moved is refused (`Superseded`, nothing inserted), and the tasks a step created
/// before the cancel for targets it stops (still `waiting`) are cancelled by the cancel itself
/// (pending at once, leased by request), so nothing stays queued for a cancelled deployment
/// or a wave that will not run. The running wave's tasks and rollback tasks are left alone.
pub async fn deployment_cancel_stops_a_racing_step(store: &DynStore) {
    let t = tenant(store).await;
    let agent = register(store, t.id, new_agent("deploy-host")).await;
    let generation = session(store, &agent, now()).await;
    let r1 = release(store, t.id, "r1").await;
    let cancel = |d: Deployment| {
        let store = store.clone();
        async move {
            store
                .cancel_deployment(d.tenant_id, d.id, operator(), now())
                .await
                .expect("cancel")
                .expect("deployment exists")
        }
    };
    let state_of = |task: Task| async move { task_now(store, &task).await.0 };

    // Pending: the step read it, created one target's tasks (one already leased), then the
    // cancel committed, then the step went on.
    let env = create_environment(store, t.id, "a").await;
    let d = deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;
    let read = d.deployment.clone();
    let (a, b) = (&d.targets[0], &d.targets[1]);
    let leased = created_for_step(store, &read, step_task(&read, a, &agent, "deploy", "web")).await;
    let (claimed_task, _) = claimed(store, &agent, generation, now()).await;
    assert_eq!(claimed_task.id, leased.id);
    // A task of no deployment on the same agent: never a cancel's business.
    let bystander = create(store, new_task(t.id, agent.id, now())).await;
    let queued = created_for_step(store, &read, step_task(&read, a, &agent, "deploy", "db")).await;
    let cancelled = cancel(read.clone()).await;
    assert_eq!(cancelled.deployment.state, DeploymentState::Cancelled);
    let queued_now = state_of(queued.clone()).await;
    assert_eq!(queued_now.state, TaskState::Cancelled, "{queued_now:?}");
    let leased_now = state_of(leased.clone()).await;
    assert_eq!(leased_now.state, TaskState::Leased);
    assert!(leased_now.cancel_requested, "the agent is told to stop");
    assert_eq!(
        store
            .pending_cancellations(agent.id)
            .await
            .expect("pending cancellations"),
        vec![(
            leased.id,
            leased_now.current_assignment.expect("assignment")
        )]
    );
    // The step goes on: refused, nothing inserted, and its record fails.
    let late = step_task(&read, b, &agent, "deploy", "web");
    let late_key = late.idempotency_key.clone();
    assert_eq!(
        create_for_step(store, &read, late).await,
        crate::DeploymentTaskOutcome::Superseded
    );
    assert_eq!(
        store
            .record_deployment_step(step(&read, DeploymentState::Running, Vec::new()))
            .await
            .expect("step"),
        None
    );
    let all = store
        .list_tasks(t.id, &TaskFilter::default(), None, 100)
        .await
        .expect("list tasks")
        .items;
    assert!(all.iter().all(|task| task.idempotency_key != late_key));
    assert_eq!(state_of(bystander.clone()).await.state, TaskState::Pending);
    let cancels: Vec<String> = audit_actions(store, t.id)
        .await
        .into_iter()
        .filter(|(action, _)| action == actions::TASK_CANCEL)
        .map(|(_, subject)| subject)
        .collect();
    for task in [&queued, &leased] {
        assert!(cancels.contains(&task.id.to_string()), "{cancels:?}");
    }

    // Running, wave 0 started by a recorded step; a step of another replica recorded since is
    // also a reason to refuse.
    let env = create_environment(store, t.id, "b").await;
    let d = deploy(store, new_deployment(&env, &r1, DeploymentState::Pending)).await;
    let read = d.deployment.clone();
    let mut wave0: Vec<DeploymentTarget> =
        d.targets.iter().filter(|t| t.wave == 0).cloned().collect();
    for target in &mut wave0 {
        let task = created_for_step(
            store,
            &read,
            step_task(&read, target, &agent, "deploy", "web"),
        )
        .await;
        target.tasks = vec![task.id];
        target.phase = TargetPhase::Queued;
    }
    let running = apply(store, step(&read, DeploymentState::Running, wave0.clone())).await;
    let stale = step_task(&read, &wave0[0], &agent, "deploy", "db");
    assert_eq!(
        create_for_step(store, &read, stale).await,
        crate::DeploymentTaskOutcome::Superseded,
        "decided from a version another step moved"
    );
    // The next step (wave 0 done, on to wave 1) creates wave 1's task and a rollback task
    // is created by another (as after a failure); then the cancel commits.
    let read = running.deployment.clone();
    let wave1 = d
        .targets
        .iter()
        .find(|t| t.wave == 1)
        .expect("wave 1")
        .clone();
    let next_wave = created_for_step(
        store,
        &read,
        step_task(&read, &wave1, &agent, "deploy", "web"),
    )
    .await;
    let rollback = created_for_step(
        store,
        &read,
        step_task(&read, &wave0[0], &agent, "rollback", "web"),
    )
    .await;
    let requested = cancel(read.clone()).await;
    assert!(requested.deployment.cancel_requested);
    assert_eq!(
        state_of(next_wave.clone()).await.state,
        TaskState::Cancelled
    );
    for target in &wave0 {
        let task = Task {
            id: target.tasks[0],
            ..next_wave.clone()
        };
        assert_eq!(
            state_of(task).await.state,
            TaskState::Pending,
            "the running wave runs to its end"
        );
    }
    assert_eq!(state_of(rollback.clone()).await.state, TaskState::Pending);
    // A step decided after the cancel finds its rollback task again.
    match create_for_step(
        store,
        &requested.deployment,
        step_task(&requested.deployment, &wave0[0], &agent, "rollback", "web"),
    )
    .await
    {
        crate::DeploymentTaskOutcome::Decided(CreateTaskOutcome::Existing(task)) => {
            assert_eq!(task.id, rollback.id)
        }
        other => panic!("expected the rollback task again, got {other:?}"),
    }

    // Finished: refused.
    let failed = apply(
        store,
        step(&requested.deployment, DeploymentState::Failed, Vec::new()),
    )
    .await;
    assert_eq!(
        create_for_step(
            store,
            &failed.deployment,
            step_task(&failed.deployment, &wave1, &agent, "deploy", "other")
        )
        .await,
        crate::DeploymentTaskOutcome::Superseded
    );
    assert_eq!(state_of(bystander).await.state, TaskState::Pending);
}

/// Issue 29 on two replicas (two stores on one PostgreSQL): `steps` runs deployment steps that
/// create wave 0's tasks and record them, `cancels` cancels each deployment at a moment that
/// moves across the step. Whatever the interleaving, no task stays queued for a cancelled
/// deployment, and every open task of a deployment is named by a target that started.
pub async fn deployment_cancel_races_steps_on(steps: &DynStore, cancels: &DynStore, rounds: u32) {
    let t = tenant(steps).await;
    let agent = register(steps, t.id, new_agent("race-host")).await;
    let r1 = release(steps, t.id, "r1").await;
    for round in 0..rounds {
        let env = create_environment(steps, t.id, &format!("race-{round}")).await;
        let d = deploy(steps, new_deployment(&env, &r1, DeploymentState::Pending)).await;
        let step_store = steps.clone();
        let (detail, host) = (d.clone(), agent.clone());
        let pass = tokio::spawn(async move {
            let read = detail.deployment.clone();
            let mut targets = Vec::new();
            for target in detail.targets.iter().filter(|t| t.wave == 0) {
                let mut started = target.clone();
                for part in ["web", "db"] {
                    let task = step_task(&read, target, &host, "deploy", part);
                    match create_for_step(&step_store, &read, task).await {
                        crate::DeploymentTaskOutcome::Decided(
                            CreateTaskOutcome::Created(task) | CreateTaskOutcome::Existing(task),
                        ) => started.tasks.push(task.id),
                        crate::DeploymentTaskOutcome::Superseded => return,
                        other => panic!("unexpected {other:?}"),
                    }
                }
                started.phase = TargetPhase::Queued;
                targets.push(started);
            }
            // Refused (None) when the cancel committed first.
            step_store
                .record_deployment_step(step(&read, DeploymentState::Running, targets))
                .await
                .expect("record step");
        });
        let cancel_store = cancels.clone();
        let cancelled = d.deployment.clone();
        let cancel = tokio::spawn(async move {
            // From before the step's first create to after its record, round by round.
            tokio::time::sleep(std::time::Duration::from_micros(u64::from(round % 8) * 700)).await;
            cancel_store
                .cancel_deployment(cancelled.tenant_id, cancelled.id, operator(), now())
                .await
                .expect("cancel")
                .expect("deployment exists")
        });
        pass.await.expect("step");
        cancel.await.expect("cancel");
        let after = deployment_now(steps, &d.deployment).await;
        let named: Vec<TaskId> = after
            .targets
            .iter()
            .filter(|t| !matches!(t.phase, TargetPhase::Waiting | TargetPhase::Skipped))
            .flat_map(|t| t.tasks.clone())
            .collect();
        let open: Vec<Task> = steps
            .list_tasks(t.id, &TaskFilter::default(), None, 1000)
            .await
            .expect("list tasks")
            .items
            .into_iter()
            .filter(|task| {
                task.state == TaskState::Pending
                    && task.idempotency_key.as_deref().is_some_and(|key| {
                        key.starts_with(&format!("deployment:{}:", d.deployment.id))
                    })
            })
            .collect();
        match after.deployment.state {
            DeploymentState::Cancelled => assert!(open.is_empty(), "round {round}: {open:?}"),
            DeploymentState::Running => {
                assert!(after.deployment.cancel_requested, "round {round}");
                assert!(
                    open.iter().all(|task| named.contains(&task.id)),
                    "round {round}: {open:?} not in {named:?}"
                );
            }
            other => panic!("round {round}: {other:?}"),
        }
    }
}
