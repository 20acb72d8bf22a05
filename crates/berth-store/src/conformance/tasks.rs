//! Conformance cases of tasks: idempotent creation, claim order, fencing, results, cancellation,
//! retry, lease expiry, the read-back sweep, deleted agents, tenant isolation, listing and wake-ups.

use super::support::*;
use berth_proto::task::ListOrder;

/// For a backend's own tests that drive the task path themselves (`tests/postgres_races.rs`):
/// an agent of a fresh tenant with its session acquired, and that session's generation.
pub async fn agent_in_session(store: &DynStore, name: &str) -> (Agent, i64) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent(name)).await;
    let generation = session(store, &agent, now()).await;
    (agent, generation)
}

/// A read-only task for `agent`, to be created: see [`agent_in_session`].
pub fn task_for(agent: &Agent) -> NewTask {
    new_task(agent.tenant_id, agent.id, now())
}

/// An operator's task (so with its `task.create` audit entry) whose payload holds `marker`, for
/// each backend's check that a payload is sealed at rest: that check reads the raw rows itself.
/// The task reads back with its payload clear.
pub async fn task_with_payload_marker(store: &DynStore, marker: &str) -> Task {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("sealed")).await;
    let mut spec = deploy_task(tenant.id, agent.id, now());
    spec.payload = serde_json::json!({"config": {"environment": {"SECRETISH": marker}}});
    spec.created_by = Some(operator());
    let created = create(store, spec.clone()).await;
    assert_eq!(created.payload, spec.payload);
    let (read, _) = store
        .get_task(tenant.id, spec.id)
        .await
        .expect("get")
        .expect("the task");
    assert_eq!(read.payload, spec.payload);
    created
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
            start_handshake: false,
            started_at: None,
            phase: None,
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
            .claim_task(
                agent.id,
                generation,
                &fingerprint(),
                &all_capabilities(),
                false,
                t,
                GRACE
            )
            .await
            .expect("claim"),
        ClaimOutcome::Revoked
    );
    assert_eq!(
        store
            .claim_task(
                AgentId::new(),
                generation,
                &bound(&agent),
                &all_capabilities(),
                false,
                t,
                GRACE
            )
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

/// A delivery belongs to the session that claimed it (seed 003: a lease is held by one
/// generation). A later session of the same agent, current as it is, can neither start nor
/// complete what the earlier one was handed, even while that lease is live: the earlier process
/// may still be running it. The delivery ends as a lost lease does.
pub async fn task_result_from_a_newer_session(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("newer-session")).await;
    let t = now();
    let older = session(store, &agent, t).await;
    let task = create(store, deploy_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, older, t).await;
    assert_eq!(attempt.generation, older);
    let newer = session(store, &agent, t).await;
    assert!(newer > older);

    let start = StartAttempt {
        agent_id: agent.id,
        generation: newer,
        certificate_fingerprint: bound(&agent),
        task_id: attempt.task_id,
        assignment_id: attempt.assignment_id,
        phase: None,
        now: t,
    };
    assert_eq!(
        store.start_attempt(start).await.expect("start"),
        StartOutcome::Fenced,
        "a newer session may not start an older session's delivery"
    );
    for result in [AttemptResult::Succeeded, failed(true), failed(false)] {
        assert_eq!(
            complete(store, completion(&agent, newer, &attempt, result, t)).await,
            CompleteOutcome::Fenced,
            "a newer session's result for an older session's lease"
        );
    }
    // Not naming the delivery changes nothing: the task's current one is still the older's.
    let unnamed = Completion {
        assignment_id: None,
        ..completion(&agent, newer, &attempt, AttemptResult::Succeeded, t)
    };
    assert_eq!(complete(store, unnamed).await, CompleteOutcome::Fenced);
    // The older session is fenced as before.
    assert_eq!(
        complete(
            store,
            completion(&agent, older, &attempt, AttemptResult::Succeeded, t)
        )
        .await,
        CompleteOutcome::Fenced
    );
    let (still, attempts) = task_now(store, &task).await;
    assert_eq!(
        still.state,
        TaskState::Leased,
        "the refused results changed nothing"
    );
    assert_eq!(still.current_assignment, Some(attempt.assignment_id));
    assert_eq!(attempts.len(), 1);
    assert_eq!(attempts[0].state, AttemptState::Leased);
    assert_eq!(attempts[0].started_at, None);
    assert_eq!(attempts[0].envelope, None);
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
                        .claim_task(
                            agent.id,
                            generation,
                            &bound(&agent),
                            &all_capabilities(),
                            false,
                            now(),
                            GRACE,
                        )
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
    // Nor may the newer session finish it: the delivery is the older session's (see
    // `task_result_from_a_newer_session`).
    let mut current = ok;
    current.generation = newer;
    assert_eq!(complete(store, current).await, CompleteOutcome::Fenced);
    assert_eq!(task_now(store, &task).await.0.state, TaskState::Leased);
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

/// The start handshake: a start is confirmed only for the live lease of the current generation's
/// delivery, once (a repeat answers the first time); a lost delivery that promised to start and
/// never did is requeued, one that started becomes `unknown`.
pub async fn task_start_handshake(store: &DynStore) {
    // Far-past epoch: see `sweep`.
    let t = datetime!(1996-05-01 00:00:00.000_321 UTC);
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("starting")).await;
    let generation = session(store, &agent, now()).await;
    let mut deploy = deploy_task(tenant.id, agent.id, t);
    deploy.timeout_seconds = 10;
    let deploy = create(store, deploy).await;
    let agent = &agent;
    let claim = |at| async move {
        match store
            .claim_task(
                agent.id,
                generation,
                &bound(agent),
                &all_capabilities(),
                true,
                at,
                GRACE,
            )
            .await
            .expect("claim")
        {
            ClaimOutcome::Claimed(_, attempt) => attempt,
            other => panic!("expected a claim, got {other:?}"),
        }
    };
    let start = |attempt: &Attempt, generation, fingerprint: String, at| StartAttempt {
        agent_id: agent.id,
        generation,
        certificate_fingerprint: fingerprint,
        task_id: attempt.task_id,
        assignment_id: attempt.assignment_id,
        phase: None,
        now: at,
    };
    let started = |outcome| match outcome {
        StartOutcome::Started(attempt) => attempt,
        other => panic!("expected a start, got {other:?}"),
    };

    // A delivery that promised the handshake and never started: its lost lease requeues it.
    let first = claim(t).await;
    assert!(first.start_handshake);
    assert_eq!(first.started_at, None);
    let swept = sweep(store, first.lease_expires_at).await;
    assert_eq!(swept.unknown, vec![], "it provably did nothing");
    let (waiting, _) = task_now(store, &deploy).await;
    assert_eq!(swept.requeued, vec![waiting.clone()]);
    assert_eq!(waiting.state, TaskState::RetryWait);
    assert_eq!(waiting.error_code.as_deref(), Some("LEASE_EXPIRED"));
    let late = store
        .start_attempt(start(&first, generation, bound(agent), t))
        .await
        .expect("start");
    assert_eq!(
        late,
        StartOutcome::Fenced,
        "the lost delivery may not start"
    );

    // The next delivery starts: refused for the wrong generation, another certificate, another
    // assignment or task, and after its lease; confirmed once otherwise.
    let due = waiting.next_attempt_at.expect("due");
    let second = claim(due).await;
    let ask = |s: StartAttempt| async move { store.start_attempt(s).await.expect("start") };
    assert_eq!(
        ask(start(&second, generation + 1, bound(agent), due)).await,
        StartOutcome::Fenced
    );
    assert_eq!(
        ask(start(&second, generation, fingerprint(), due)).await,
        StartOutcome::Revoked
    );
    assert_eq!(
        ask(StartAttempt {
            assignment_id: AssignmentId::new(),
            ..start(&second, generation, bound(agent), due)
        })
        .await,
        StartOutcome::Fenced
    );
    assert_eq!(
        ask(StartAttempt {
            task_id: TaskId::new(),
            ..start(&second, generation, bound(agent), due)
        })
        .await,
        StartOutcome::NotFound
    );
    let after_lease = second.lease_expires_at + Duration::milliseconds(1);
    assert_eq!(
        ask(start(&second, generation, bound(agent), after_lease)).await,
        StartOutcome::Fenced
    );
    let at = due + Duration::seconds(1);
    let confirmed = started(ask(start(&second, generation, bound(agent), at)).await);
    assert_eq!(confirmed.started_at, Some(millis(at)));
    let again = started(
        ask(start(
            &second,
            generation,
            bound(agent),
            at + Duration::seconds(1),
        ))
        .await,
    );
    assert_eq!(again.started_at, Some(millis(at)), "the first start counts");
    // A start may report the step it is about to take: the last report is kept, a start
    // without one leaves it, and a refused start records nothing.
    use berth_proto::transport::ProgressPhase;
    let pulling = started(
        ask(StartAttempt {
            phase: Some(ProgressPhase::Pulling),
            ..start(&second, generation, bound(agent), at)
        })
        .await,
    );
    assert_eq!(pulling.phase, Some(ProgressPhase::Pulling));
    assert_eq!(pulling.started_at, Some(millis(at)));
    assert_eq!(
        ask(StartAttempt {
            phase: Some(ProgressPhase::Health),
            ..start(&second, generation + 1, bound(agent), at)
        })
        .await,
        StartOutcome::Fenced
    );
    let kept = started(ask(start(&second, generation, bound(agent), at)).await);
    assert_eq!(kept.phase, Some(ProgressPhase::Pulling));
    // At the deadline itself the start still counts.
    let edge = started(
        ask(start(
            &second,
            generation,
            bound(agent),
            second.lease_expires_at,
        ))
        .await,
    );
    assert_eq!(edge.started_at, Some(millis(at)));

    // A started delivery that is lost may have run: unknown.
    let swept = sweep(store, second.lease_expires_at).await;
    assert_eq!(swept.requeued, vec![]);
    assert_eq!(swept.unknown.len(), 1);
    assert_eq!(swept.unknown[0].id, deploy.id);
    assert_eq!(swept.unknown[0].state, TaskState::Unknown);
    let (_, attempts) = task_now(store, &deploy).await;
    assert_eq!(
        attempts
            .iter()
            .map(|a| (a.state, a.start_handshake, a.started_at))
            .collect::<Vec<_>>(),
        vec![
            (AttemptState::Expired, true, None),
            (AttemptState::Expired, true, Some(millis(at))),
        ]
    );
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
            .cancel_task(intruder.id, leased.id, operator(), t)
            .await
            .expect("cancel"),
        None
    );
    assert_eq!(
        store
            .cancel_task(tenant.id, TaskId::new(), operator(), t)
            .await
            .expect("cancel"),
        None
    );

    let at = t + Duration::seconds(1);
    let Some(CancelOutcome::Requested(requested)) = store
        .cancel_task(tenant.id, leased.id, operator(), at)
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
            .cancel_task(tenant.id, leased.id, operator(), at)
            .await
            .expect("cancel"),
        Some(CancelOutcome::Requested(_))
    ));

    // Pending: cancelled at once.
    let Some(CancelOutcome::Cancelled(cancelled)) = store
        .cancel_task(tenant.id, pending.id, operator(), at)
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
            .cancel_task(tenant.id, leased.id, operator(), at)
            .await
            .expect("cancel"),
        Some(CancelOutcome::AlreadyFinished(reported))
    );

    // A requested cancellation is never requeued by a retriable failure.
    let flaky = create(store, new_task(tenant.id, agent.id, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    store
        .cancel_task(tenant.id, flaky.id, operator(), at)
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
            .cancel_task(tenant.id, waiting.id, operator(), at)
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
            .retry_task(intruder.id, dead.id, operator(), t)
            .await
            .expect("retry"),
        None
    );
    let at = t + Duration::seconds(3);
    let Some(RetryOutcome::Requeued(requeued)) = store
        .retry_task(tenant.id, dead.id, operator(), at)
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
            .retry_task(tenant.id, dead.id, operator(), at)
            .await
            .expect("retry"),
        Some(RetryOutcome::NotRetriable(requeued))
    );
    let (leased, attempt) = claimed(store, &agent, generation, at).await;
    assert_eq!((leased.id, leased.attempts), (dead.id, 1));
    assert!(matches!(
        store
            .retry_task(tenant.id, dead.id, operator(), at)
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
        store.retry_task(tenant.id, dead.id, operator(), at).await.expect("retry"),
        Some(RetryOutcome::NotRetriable(ref task)) if task.state == TaskState::Succeeded
    ));

    // Unknown (its agent vanished mid-deploy): an operator may run it again.
    let doomed = register(store, tenant.id, new_agent("doomed")).await;
    let doomed_generation = session(store, &doomed, t).await;
    let deploy = create(store, deploy_task(tenant.id, doomed.id, t)).await;
    claimed(store, &doomed, doomed_generation, t).await;
    assert!(store
        .delete_agent(tenant.id, doomed.id, operator(), now())
        .await
        .expect("delete"));
    assert_eq!(task_now(store, &deploy).await.0.state, TaskState::Unknown);
    assert!(matches!(
        store.retry_task(tenant.id, deploy.id, operator(), at).await.expect("retry"),
        Some(RetryOutcome::Requeued(ref task)) if task.state == TaskState::Pending
    ));
    // Each requeue is in the audit log, written in the retry's transaction; refusals are not.
    let retries: Vec<String> = store
        .list_audit(tenant.id, 0, 1000)
        .await
        .expect("audit")
        .into_iter()
        .filter(|e| e.action == berth_proto::audit::actions::TASK_RETRY)
        .map(|e| e.subject)
        .collect();
    assert_eq!(retries, [dead.id.to_string(), deploy.id.to_string()]);
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
        .cancel_task(tenant.id, cancel_me.id, operator(), t)
        .await
        .expect("cancel");
    let swept = sweep(store, attempt.lease_expires_at).await;
    assert_eq!(swept, LeaseSweep::default());
    assert_eq!(
        task_now(store, &cancel_me).await.0.state,
        TaskState::Cancelled
    );
}

/// Every page of [`TaskStore::unknown_without_read_back`], one task per page (the paging is part
/// of the contract), as ids.
async fn unknown_without_read_back(store: &DynStore) -> Vec<TaskId> {
    let (mut ids, mut after) = (Vec::new(), None);
    loop {
        let page = store
            .unknown_without_read_back(after, 1)
            .await
            .expect("unknown without read-back");
        assert!(page.len() <= 1, "the limit holds");
        let Some(task) = page.first() else {
            return ids;
        };
        assert_eq!(task.state, TaskState::Unknown);
        ids.push(task.id);
        after = Some(task.id);
    }
}

/// Every page of [`TaskStore::finished_read_backs_of_unknown`], one read-back per page.
async fn finished_read_backs(store: &DynStore) -> Vec<Task> {
    let (mut all, mut after) = (Vec::new(), None);
    loop {
        let page = store
            .finished_read_backs_of_unknown(after, 1)
            .await
            .expect("finished read-backs");
        assert!(page.len() <= 1, "the limit holds");
        let Some(read_back) = page.first() else {
            return all;
        };
        assert_eq!(read_back.state, TaskState::Succeeded);
        after = read_back.read_back_of;
        all.push(read_back.clone());
    }
}

/// The read-back the server schedules for an `unknown` task.
fn read_back_task(parent: &Task, at: OffsetDateTime) -> NewTask {
    NewTask {
        task_type: "read-sticker".to_string(),
        payload: serde_json::json!({"name": "web"}),
        priority: i32::MAX,
        idempotency_key: Some(crate::read_back_key(parent.id, parent.attempts)),
        read_back_of: Some(parent.id),
        created_by: None,
        ..new_task(parent.tenant_id, parent.agent_id, at)
    }
}

pub async fn read_back_sweep(store: &DynStore) {
    // Far-past epoch: see `sweep`.
    let t = datetime!(1997-07-01 00:00:00 UTC);
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("read-back")).await;
    let doomed = register(store, tenant.id, new_agent("read-back-doomed")).await;
    let generation = session(store, &agent, now()).await;
    let doomed_generation = session(store, &doomed, now()).await;

    // Three side-effecting tasks lose their lease: unknown, none read back yet.
    let mut lost = Vec::new();
    for owner in [&agent, &agent, &doomed] {
        create(store, deploy_task(tenant.id, owner.id, t)).await;
    }
    // One side-effecting task of an agent at a time: the second is claimed after the first
    // lease was lost.
    let (_, first) = claimed(store, &agent, generation, t).await;
    claimed(store, &doomed, doomed_generation, t).await;
    let swept = sweep(store, first.lease_expires_at).await;
    assert_eq!(swept.unknown.len(), 2);
    lost.extend(swept.unknown);
    let (_, second) = claimed(store, &agent, generation, first.lease_expires_at).await;
    let swept = sweep(store, second.lease_expires_at).await;
    assert_eq!(swept.unknown.len(), 1);
    lost.extend(swept.unknown);
    lost.sort_by_key(|task| task.id);
    let ids: Vec<TaskId> = lost.iter().map(|task| task.id).collect();
    assert_eq!(unknown_without_read_back(store).await, ids, "by id, paged");
    assert!(finished_read_backs(store).await.is_empty());

    // A deleted agent's unknown task cannot be read back: it is not listed.
    let orphan = lost
        .iter()
        .position(|task| task.agent_id == doomed.id)
        .expect("the doomed agent's task");
    let orphan = lost.remove(orphan);
    assert!(store
        .delete_agent(tenant.id, doomed.id, operator(), now())
        .await
        .expect("delete agent"));
    assert_eq!(task_now(store, &orphan).await.0.state, TaskState::Unknown);
    let (a, b) = (lost[0].clone(), lost[1].clone());
    assert_eq!(unknown_without_read_back(store).await, vec![a.id, b.id]);

    // A read-back under another delivery's key is not the read-back of this loss.
    let mut stale = read_back_task(&a, t);
    stale.idempotency_key = Some(crate::read_back_key(a.id, a.attempts + 1));
    let stale = create(store, stale).await;
    assert_eq!(unknown_without_read_back(store).await, vec![a.id, b.id]);
    store
        .cancel_task(tenant.id, stale.id, operator(), t)
        .await
        .expect("cancel");

    // Scheduled: no longer listed, whatever becomes of the read-back; the key makes a second
    // schedule return the same read-back.
    let read_back = create(store, read_back_task(&a, t)).await;
    assert_eq!(unknown_without_read_back(store).await, vec![b.id]);
    match store
        .create_task(read_back_task(&a, t + Duration::seconds(5)))
        .await
        .expect("schedule again")
    {
        CreateTaskOutcome::Existing(existing) => assert_eq!(existing.id, read_back.id),
        other => panic!("expected the existing read-back, got {other:?}"),
    }
    assert!(finished_read_backs(store).await.is_empty(), "still open");

    // It succeeds: finished, until the parent's result names it.
    let (claimed_back, attempt) = claimed(store, &agent, generation, t).await;
    assert_eq!(claimed_back.id, read_back.id, "read-backs come first");
    recorded(
        store,
        completion(&agent, generation, &attempt, AttemptResult::Succeeded, t),
    )
    .await;
    let finished = finished_read_backs(store).await;
    assert_eq!(
        finished.iter().map(|rb| rb.id).collect::<Vec<_>>(),
        vec![read_back.id]
    );
    assert_eq!(finished[0].read_back_of, Some(a.id));
    // Some other evidence does not apply it.
    store
        .resolve_read_back(a.id, false, serde_json::json!({"found": false}), t)
        .await
        .expect("read back")
        .expect("unknown task");
    assert_eq!(finished_read_backs(store).await.len(), 1);
    let evidence = serde_json::json!({"readBackTaskId": read_back.id, "found": false});
    store
        .resolve_read_back(a.id, false, evidence, t)
        .await
        .expect("read back")
        .expect("unknown task");
    assert!(finished_read_backs(store).await.is_empty(), "applied");
    assert_eq!(
        unknown_without_read_back(store).await,
        vec![b.id],
        "one read-back per lost delivery: the undecided task waits for an operator"
    );

    // A read-back that ends without deciding (it failed) is never finished, and not redone.
    let failing = create(store, read_back_task(&b, t)).await;
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    assert_eq!(attempt.task_id, failing.id);
    recorded(
        store,
        completion(&agent, generation, &attempt, failed(false), t),
    )
    .await;
    assert!(unknown_without_read_back(store).await.is_empty());
    assert!(finished_read_backs(store).await.is_empty());

    // Retried, and lost again on its first delivery after the retry: `attempts` counts from 1
    // again, and the retry released the earlier read-back's key, so this loss gets its own.
    store
        .retry_task(tenant.id, b.id, operator(), t)
        .await
        .expect("retry");
    assert_eq!(task_now(store, &failing).await.0.idempotency_key, None);
    let (_, first) = claimed(store, &agent, generation, t).await;
    assert_eq!(first.task_id, b.id);
    let swept = sweep(store, first.lease_expires_at).await;
    assert_eq!(swept.unknown.len(), 1);
    let b = swept.unknown[0].clone();
    assert_eq!(b.attempts, 1);
    assert_eq!(unknown_without_read_back(store).await, vec![b.id]);
    let again = create(store, read_back_task(&b, t)).await;
    assert_ne!(again.id, failing.id);
    assert!(unknown_without_read_back(store).await.is_empty());
    // The earlier read-back, keyless now, is never taken for this loss's.
    let (_, attempt) = claimed(store, &agent, generation, t).await;
    assert_eq!(attempt.task_id, again.id);
    recorded(
        store,
        completion(&agent, generation, &attempt, AttemptResult::Succeeded, t),
    )
    .await;
    let finished = finished_read_backs(store).await;
    assert_eq!(
        finished.iter().map(|rb| rb.id).collect::<Vec<_>>(),
        vec![again.id]
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
        .delete_agent(tenant.id, agent.id, operator(), now())
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
            .cancel_task(intruder.id, task.id, operator(), now())
            .await
            .expect("cancel"),
        None
    );
    assert_eq!(
        store
            .retry_task(intruder.id, task.id, operator(), now())
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
        ..TaskFilter::default()
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

    // Newest first (the web UI's lists): the same pages from the other end.
    let newest = TaskFilter {
        order: ListOrder::Newest,
        ..TaskFilter::default()
    };
    let page = store
        .list_tasks(tenant.id, &newest, None, 3)
        .await
        .expect("list");
    assert_eq!(ids(page.clone()), vec![fourth.id, third.id, second.id]);
    assert_eq!(page.next, Some(second.id.0));
    let rest = store
        .list_tasks(tenant.id, &newest, page.next.map(TaskId), 3)
        .await
        .expect("list");
    assert_eq!(ids(rest.clone()), vec![first.id]);
    assert_eq!(rest.next, None);
    let newest_of_b = TaskFilter {
        agent_id: Some(b.id),
        order: ListOrder::Newest,
        ..TaskFilter::default()
    };
    assert_eq!(ids(list(newest_of_b).await), vec![fourth.id, third.id]);
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
        .cancel_task(tenant.id, task.id, operator(), t)
        .await
        .expect("cancel");
    woken(&mut events, agent.id).await;
}

/// A heartbeat's list: the agent's queued tasks (pending, retry_wait) in claim order, capped;
/// leased and finished tasks and other agents' tasks are not listed, and listing claims nothing.
pub async fn queued_tasks(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("queued")).await;
    let other = register(store, tenant.id, new_agent("other")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    assert!(store
        .queued_tasks(agent.id, 16)
        .await
        .expect("none")
        .is_empty());
    let leased = create(store, new_task(tenant.id, agent.id, t)).await;
    claimed(store, &agent, generation, t).await;
    let low = create(store, new_task(tenant.id, agent.id, t)).await;
    let mut high = new_task(tenant.id, agent.id, t);
    high.priority = 10;
    let high = create(store, high).await;
    let last = create(store, new_task(tenant.id, agent.id, t)).await;
    create(store, new_task(tenant.id, other.id, t)).await;
    let ids = |tasks: Vec<Task>| tasks.into_iter().map(|t| t.id).collect::<Vec<_>>();
    let listed = store.queued_tasks(agent.id, 16).await.expect("queued");
    assert!(listed.iter().all(|t| t.state == TaskState::Pending));
    assert_eq!(ids(listed), vec![high.id, low.id, last.id]);
    assert!(!ids(store.queued_tasks(agent.id, 16).await.unwrap()).contains(&leased.id));
    assert_eq!(
        ids(store.queued_tasks(agent.id, 2).await.expect("capped")),
        vec![high.id, low.id]
    );
    // Listing twice claimed nothing: the head is still the one to claim.
    assert_eq!(claimed(store, &agent, generation, t).await.0.id, high.id);
    assert_eq!(
        ids(store.queued_tasks(agent.id, 16).await.unwrap()),
        vec![low.id, last.id]
    );
}

/// Open tasks are the ones an agent still has to run: pending, leased and retry_wait.
pub async fn open_task_counts(store: &DynStore) {
    let tenant = tenant(store).await;
    let busy = register(store, tenant.id, new_agent("busy")).await;
    let idle = register(store, tenant.id, new_agent("idle")).await;
    let t = now();
    let generation = session(store, &busy, t).await;
    for _ in 0..4 {
        create(store, new_task(tenant.id, busy.id, t)).await;
    }
    // One leased, one finished, two pending: three open.
    let (_, attempt) = claimed(store, &busy, generation, t).await;
    recorded(
        store,
        completion(&busy, generation, &attempt, AttemptResult::Succeeded, t),
    )
    .await;
    claimed(store, &busy, generation, t).await;
    let counts = store
        .open_task_counts(&[idle.id, busy.id])
        .await
        .expect("counts");
    assert_eq!(counts, vec![(idle.id, 0), (busy.id, 3)]);
    assert_eq!(store.open_task_counts(&[]).await.expect("none"), vec![]);
}

/// A head the polling agent cannot run fails at once, and the next task is handed out: a kind
/// whose capability the poll does not list, or a type no agent runs.
pub async fn task_claim_unrunnable_heads_fail(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("plain")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    let deploy = create(store, deploy_task(tenant.id, agent.id, t)).await;
    let mut legacy = new_task(tenant.id, agent.id, t);
    legacy.task_type = "deploy".into();
    let legacy = create(store, legacy).await;
    let check = create(store, new_task(tenant.id, agent.id, t)).await;
    let outcome = store
        .claim_task(
            agent.id,
            generation,
            &bound(&agent),
            &["compose".to_string()],
            false,
            t,
            GRACE,
        )
        .await
        .expect("claim");
    let ClaimOutcome::Claimed(task, _) = outcome else {
        panic!("the runnable task is handed out: {outcome:?}");
    };
    assert_eq!(task.id, check.id);
    for (lost, code) in [
        (&deploy, "CAPABILITY_MISSING"),
        (&legacy, "UNSUPPORTED_TASK_TYPE"),
    ] {
        let (task, attempts) = task_now(store, lost).await;
        assert_eq!(task.state, TaskState::Failed);
        assert_eq!(task.error_code.as_deref(), Some(code));
        assert!(task.finished_at.is_some());
        assert!(attempts.is_empty(), "never delivered");
    }
    // With nothing runnable left, the poll is empty, and the failures stay.
    assert_eq!(
        store
            .claim_task(agent.id, generation, &bound(&agent), &[], false, t, GRACE)
            .await
            .expect("claim"),
        ClaimOutcome::Empty
    );
}

/// The per-agent queue cap (issue 14 item 5): at the cap a create is `QueueFull` and inserts
/// nothing; a repeated idempotency key still gets its task; a read-back is never refused; a
/// task that ends makes room; `unknown` counts as open.
pub async fn task_queue_cap(store: &DynStore) {
    const CAP: u32 = 3;
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("capped")).await;
    let t = now();
    let capped = |key: Option<&str>| NewTask {
        queue_cap: Some(CAP),
        idempotency_key: key.map(String::from),
        request_hash: key.map(|_| "h".to_string()),
        ..new_task(tenant.id, agent.id, t)
    };
    let first = create(store, capped(Some("cap-1"))).await;
    create(store, capped(None)).await;
    create(store, capped(None)).await;
    assert_eq!(
        store.create_task(capped(None)).await.expect("create"),
        CreateTaskOutcome::QueueFull { open: 3 }
    );
    match store
        .create_task(capped(Some("cap-1")))
        .await
        .expect("create")
    {
        CreateTaskOutcome::Existing(task) => assert_eq!(task.id, first.id),
        other => panic!("a repeated key gets its task even at the cap, not {other:?}"),
    }
    let read_back = NewTask {
        read_back_of: Some(first.id),
        ..capped(None)
    };
    create(store, read_back).await;
    // No cap: the server's own tasks.
    create(store, new_task(tenant.id, agent.id, t)).await;
    assert_eq!(
        store.create_task(capped(None)).await.expect("create"),
        CreateTaskOutcome::QueueFull { open: 5 }
    );
    let open = |store: DynStore| async move {
        store
            .list_tasks(tenant.id, &TaskFilter::default(), None, 100)
            .await
            .expect("list")
            .items
            .iter()
            .filter(|t| !t.state.is_terminal())
            .count()
    };
    assert_eq!(
        open(store.clone()).await,
        5,
        "a refused create inserts nothing"
    );
    // Cancelling three of the five leaves two open: room for one more below the cap.
    let all = store
        .list_tasks(tenant.id, &TaskFilter::default(), None, 100)
        .await
        .expect("list")
        .items;
    for task in all.iter().take(3) {
        store
            .cancel_task(tenant.id, task.id, operator(), t)
            .await
            .expect("cancel");
    }
    create(store, capped(None)).await;
    assert_eq!(
        store.create_task(capped(None)).await.expect("create"),
        CreateTaskOutcome::QueueFull { open: 3 }
    );
}

/// The cap holds under 20 concurrent creators: exactly `CAP` are created, every other one is
/// refused, and the agent's queue holds `CAP` tasks.
pub async fn task_queue_cap_concurrent(store: &DynStore) {
    const CAP: u32 = 5;
    const CREATORS: usize = 20;
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("crowded")).await;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(CREATORS));
    let mut handles = vec![];
    for _ in 0..CREATORS {
        let store = store.clone();
        let barrier = barrier.clone();
        let task = NewTask {
            queue_cap: Some(CAP),
            ..new_task(tenant.id, agent.id, now())
        };
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            store
                .create_task(task)
                .await
                .expect("create without a database error")
        }));
    }
    let (mut created, mut full) = (0, 0);
    for handle in handles {
        match handle.await.expect("creator") {
            CreateTaskOutcome::Created(_) => created += 1,
            CreateTaskOutcome::QueueFull { open } => {
                assert_eq!(open, u64::from(CAP));
                full += 1
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((created, full), (CAP as usize, CREATORS - CAP as usize));
    let page = store
        .list_tasks(tenant.id, &TaskFilter::default(), None, 100)
        .await
        .expect("list");
    assert_eq!(page.items.len(), CAP as usize);
}

pub async fn retention_prunes_what_finished_long_ago(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("retention")).await;
    let recent = now();
    let old = recent - time::Duration::days(40);
    let cutoff = recent - time::Duration::days(30);
    let finished = |at| async move {
        let task = create(store, new_task(tenant.id, agent.id, at)).await;
        store
            .cancel_task(tenant.id, task.id, operator(), at)
            .await
            .expect("cancel");
        task
    };
    let gone = finished(old).await;
    let kept_recent = finished(recent).await;
    let kept_open = create(store, new_task(tenant.id, agent.id, old)).await;
    // A parent and the read-back naming it, both finished long ago: the read-back goes first.
    let parent = finished(old).await;
    let read_back = create(store, read_back_task(&parent, old)).await;
    store
        .cancel_task(tenant.id, read_back.id, operator(), old)
        .await
        .expect("cancel the read-back");

    assert_eq!(
        store
            .prune_finished_tasks(cutoff, 100)
            .await
            .expect("prune"),
        2
    );
    let exists = |id| async move { store.get_task(tenant.id, id).await.expect("get").is_some() };
    assert!(!exists(gone.id).await && !exists(read_back.id).await);
    assert!(exists(parent.id).await, "a read-back still named it");
    assert_eq!(
        store
            .prune_finished_tasks(cutoff, 100)
            .await
            .expect("prune"),
        1
    );
    assert!(!exists(parent.id).await);
    assert_eq!(
        store
            .prune_finished_tasks(cutoff, 100)
            .await
            .expect("prune"),
        0
    );
    assert!(exists(kept_recent.id).await && exists(kept_open.id).await);

    // Events: only those created before the cutoff, in batches.
    let all = |store: &DynStore| {
        let store = store.clone();
        async move {
            store
                .read_events(tenant.id, &crate::EventFilter::default(), 0, 1000)
                .await
                .expect("events")
        }
    };
    let before = all(store).await;
    let old_events = before.iter().filter(|e| e.created_at < cutoff).count() as u64;
    assert!(old_events >= 4, "{before:?}");
    assert_eq!(store.prune_events(cutoff, 1).await.expect("prune"), 1);
    assert_eq!(
        store.prune_events(cutoff, 1000).await.expect("prune"),
        old_events - 1
    );
    let after = all(store).await;
    assert!(after.iter().all(|e| e.created_at >= cutoff));
    assert_eq!(after.len() as u64, before.len() as u64 - old_events);
    // The audit log keeps every cancel.
    let audit = store.list_audit(tenant.id, 0, 1000).await.expect("audit");
    assert!(audit.iter().filter(|e| e.action == "task.cancel").count() >= 4);
}

/// One simulated day of [`retention_simulation`], after its prune.
#[derive(Debug, Clone, Copy)]
pub struct RetentionDay {
    pub day: u32,
    /// Tasks the store holds once the day's prune ran.
    pub tasks_kept: u64,
    /// Tasks and events the day's prune deleted.
    pub tasks_pruned: u64,
    pub events_pruned: u64,
}

/// Issue 16 item 6, on the store's clock: `days` days in which each of `agents` agents runs
/// `per_day` tasks (created, claimed under that day's session, its result recorded, all at that
/// day's time), each day followed by the retention sweep's prune of what finished more than
/// `keep_days` before (batches of 500, as `retention.rs` deletes). `each_day` sees every day.
/// Nothing waits: the days are timestamps.
pub async fn retention_simulation(
    store: &DynStore,
    agents: usize,
    per_day: usize,
    days: u32,
    keep_days: u32,
    mut each_day: impl FnMut(RetentionDay),
) -> Vec<RetentionDay> {
    let tenant = tenant(store).await;
    let mut fleet = Vec::with_capacity(agents);
    for n in 0..agents {
        fleet.push(register(store, tenant.id, new_agent(&format!("sim-{n}"))).await);
    }
    let start = now() - Duration::days(i64::from(days));
    let mut seen = Vec::new();
    for day in 0..days {
        let at = start + Duration::days(i64::from(day));
        let runs = fleet.iter().map(|agent| async move {
            let generation = session(store, agent, at).await;
            for _ in 0..per_day {
                create(store, new_task(tenant.id, agent.id, at)).await;
                let (_, attempt) = claimed(store, agent, generation, at).await;
                recorded(
                    store,
                    completion(agent, generation, &attempt, AttemptResult::Succeeded, at),
                )
                .await;
            }
        });
        futures_util::future::join_all(runs).await;
        let cutoff = at - Duration::days(i64::from(keep_days));
        let (mut tasks_pruned, mut events_pruned) = (0, 0);
        loop {
            let t = store
                .prune_finished_tasks(cutoff, 500)
                .await
                .expect("prune");
            let e = store.prune_events(cutoff, 500).await.expect("prune");
            tasks_pruned += t;
            events_pruned += e;
            if t < 500 && e < 500 {
                break;
            }
        }
        let tasks_kept = count_tasks(store, tenant.id).await;
        let seen_day = RetentionDay {
            day,
            tasks_kept,
            tasks_pruned,
            events_pruned,
        };
        each_day(seen_day);
        seen.push(seen_day);
    }
    seen
}

async fn count_tasks(store: &DynStore, tenant: TenantId) -> u64 {
    let (mut n, mut after) = (0, None);
    loop {
        let page = store
            .list_tasks(tenant, &TaskFilter::default(), after, 1000)
            .await
            .expect("list");
        n += page.items.len() as u64;
        match page.next {
            Some(next) => after = Some(TaskId(next)),
            None => return n,
        }
    }
}

/// A small [`retention_simulation`]: the store holds at most the last `keep_days` + 1 days of
/// tasks, and from then on exactly that many: bounded, however long it runs.
pub async fn retention_keeps_the_store_bounded(store: &DynStore) {
    const AGENTS: usize = 4;
    const PER_DAY: usize = 3;
    const KEEP: u32 = 3;
    let days = retention_simulation(store, AGENTS, PER_DAY, 10, KEEP, |_| {}).await;
    let per_day = (AGENTS * PER_DAY) as u64;
    for d in &days {
        let expected = per_day * u64::from(d.day.min(KEEP) + 1);
        assert_eq!(d.tasks_kept, expected, "{d:?}");
        if d.day > KEEP {
            assert_eq!(d.tasks_pruned, per_day, "{d:?}");
            assert!(d.events_pruned > 0, "{d:?}");
        }
    }
}

/// The task path under concurrency, as a busy server drives it: 16 creators at once (with
/// the operator's audit entry, a queue cap and, for some, an idempotency key sent twice), then
/// two claimers per agent at once, each completing what it claims, and every result sent
/// twice at once. Every task is created once, claimed once and succeeds once; each repeat is
/// answered as one; and the audit log holds one `task.create` and one `task.result` per task.
/// On PostgreSQL this is the batched path (`postgres/task_batches.rs`) with many calls per
/// batch.
pub async fn task_path_concurrent(store: &DynStore) {
    const AGENTS: usize = 8;
    const CREATORS: usize = 16;
    const PER_CREATOR: usize = 10;
    let tenant = tenant(store).await;
    let t = now();
    let mut agents = vec![];
    for i in 0..AGENTS {
        let agent = register(store, tenant.id, new_agent(&format!("busy-{i}"))).await;
        let generation = session(store, &agent, t).await;
        agents.push((agent, generation));
    }
    let mut creators = vec![];
    for c in 0..CREATORS {
        let store = store.clone();
        let agents: Vec<AgentId> = agents.iter().map(|(a, _)| a.id).collect();
        creators.push(tokio::spawn(async move {
            let mut created = vec![];
            for i in 0..PER_CREATOR {
                let key = (i % 5 == 0).then(|| format!("key-{c}-{i}"));
                let task = NewTask {
                    queue_cap: Some(1_000),
                    created_by: Some(operator()),
                    idempotency_key: key.clone(),
                    request_hash: key.as_ref().map(|_| "same request".to_string()),
                    ..new_task(tenant.id, agents[(c + i) % agents.len()], now())
                };
                let (first, again) = tokio::join!(
                    store.create_task(task.clone()),
                    store.create_task(NewTask {
                        id: TaskId::new(),
                        ..task.clone()
                    }),
                );
                let first = first.expect("create");
                let again = again.expect("create");
                match (first, again, &key) {
                    (CreateTaskOutcome::Created(a), CreateTaskOutcome::Existing(b), Some(_))
                    | (CreateTaskOutcome::Existing(b), CreateTaskOutcome::Created(a), Some(_)) => {
                        assert_eq!(a.id, b.id, "the key's task is the one created");
                        created.push(a.id);
                    }
                    (CreateTaskOutcome::Created(a), CreateTaskOutcome::Created(b), None) => {
                        created.extend([a.id, b.id]);
                    }
                    other => panic!("unexpected creations {other:?}"),
                }
            }
            created
        }));
    }
    let mut created = std::collections::BTreeSet::new();
    for creator in creators {
        for id in creator.await.expect("creator ran") {
            assert!(created.insert(id), "a task created twice");
        }
    }
    let expected = CREATORS * PER_CREATOR * 2 - CREATORS * PER_CREATOR / 5;
    assert_eq!(created.len(), expected);

    let mut claimers = vec![];
    for (agent, generation) in &agents {
        for _ in 0..2 {
            let store = store.clone();
            let (agent, generation) = (agent.clone(), *generation);
            claimers.push(tokio::spawn(async move {
                let mut done = vec![];
                loop {
                    let (task, attempt) = match claim(&store, &agent, generation, now()).await {
                        ClaimOutcome::Claimed(task, attempt) => (task, attempt),
                        ClaimOutcome::Empty => return done,
                        other => panic!("unexpected {other:?}"),
                    };
                    assert_eq!(task.agent_id, agent.id);
                    let result = completion(
                        &agent,
                        generation,
                        &attempt,
                        AttemptResult::Succeeded,
                        now(),
                    );
                    let policy = RetryPolicy::default();
                    let (a, b) = tokio::join!(
                        store.complete_attempt(result.clone(), &policy),
                        store.complete_attempt(result, &policy),
                    );
                    match (a.expect("complete"), b.expect("complete")) {
                        (CompleteOutcome::Recorded(task), CompleteOutcome::Duplicate(_))
                        | (CompleteOutcome::Duplicate(_), CompleteOutcome::Recorded(task)) => {
                            assert_eq!(task.state, TaskState::Succeeded);
                            done.push(task.id);
                        }
                        other => panic!("one result recorded, its repeat a duplicate: {other:?}"),
                    }
                }
            }));
        }
    }
    let mut done = std::collections::BTreeSet::new();
    for claimer in claimers {
        for id in claimer.await.expect("claimer ran") {
            assert!(done.insert(id), "a task claimed and completed twice");
        }
    }
    assert_eq!(done, created, "every task claimed and completed once");
    let mut after = None;
    loop {
        let page = store
            .list_tasks(tenant.id, &TaskFilter::default(), after, 100)
            .await
            .expect("list");
        for task in &page.items {
            assert_eq!((task.state, task.attempts), (TaskState::Succeeded, 1));
        }
        match page.next {
            Some(next) => after = Some(TaskId(next)),
            None => break,
        }
    }
    let entries = store
        .list_audit(tenant.id, 0, 10_000)
        .await
        .expect("list audit");
    let count = |action: &str| entries.iter().filter(|e| e.action == action).count();
    assert_eq!(count(berth_proto::audit::actions::TASK_CREATE), expected);
    assert_eq!(count(berth_proto::audit::actions::TASK_RESULT), expected);
}

pub async fn retention_keeps_an_unknown_tasks_read_back(store: &DynStore) {
    retention_keeps_an_unknown_tasks_read_back_on(store, store).await;
}

/// Issue 29: retention (on `pruner`) never deletes the read-back an `unknown` task's dedupe
/// rests on, so the read-back sweep (on `sweeper`) schedules no second read-back of the same
/// loss. The task stays `unknown` (the read-back did not prove it) long past the retention
/// window. Once the task leaves `unknown` (retried: the read-back loses its key), the
/// read-back is retention's again. Two stores on one database are two replicas.
pub async fn retention_keeps_an_unknown_tasks_read_back_on(sweeper: &DynStore, pruner: &DynStore) {
    // Far-past epoch: every timestamp here is far outside any retention window.
    let t = datetime!(1997-07-01 00:00:00 UTC);
    let tenant = tenant(sweeper).await;
    let agent = register(sweeper, tenant.id, new_agent("retention-read-back")).await;
    let generation = session(sweeper, &agent, now()).await;
    create(sweeper, deploy_task(tenant.id, agent.id, t)).await;
    let (_, lost) = claimed(sweeper, &agent, generation, t).await;
    let swept = sweep(sweeper, lost.lease_expires_at).await;
    assert_eq!(swept.unknown.len(), 1);
    let parent = swept.unknown[0].clone();

    // Read back: the sticker does not prove the task, so it stays unknown for an operator.
    let read_back = create(sweeper, read_back_task(&parent, t)).await;
    let (_, attempt) = claimed(sweeper, &agent, generation, t).await;
    assert_eq!(attempt.task_id, read_back.id);
    recorded(
        sweeper,
        completion(&agent, generation, &attempt, AttemptResult::Succeeded, t),
    )
    .await;
    let evidence = serde_json::json!({"readBackTaskId": read_back.id, "found": false});
    sweeper
        .resolve_read_back(parent.id, false, evidence, t)
        .await
        .expect("read back")
        .expect("unknown task");
    assert!(unknown_without_read_back(sweeper).await.is_empty());

    // Retention on the other replica, long after: the read-back stays, and so does its key.
    let later = now();
    while pruner
        .prune_finished_tasks(later, 100)
        .await
        .expect("prune")
        > 0
    {}
    let kept = task_now(sweeper, &read_back).await.0;
    assert_eq!(
        kept.idempotency_key,
        Some(crate::read_back_key(parent.id, parent.attempts))
    );
    assert!(
        unknown_without_read_back(sweeper).await.is_empty(),
        "the loss was read back already: no second read-back"
    );
    match sweeper
        .create_task(read_back_task(&parent, later))
        .await
        .expect("schedule again")
    {
        CreateTaskOutcome::Existing(existing) => assert_eq!(existing.id, read_back.id),
        other => panic!("expected the existing read-back, got {other:?}"),
    }

    // Retried: the read-back is history (no key), and retention takes it.
    sweeper
        .retry_task(tenant.id, parent.id, operator(), later)
        .await
        .expect("retry");
    assert_eq!(
        pruner
            .prune_finished_tasks(later, 100)
            .await
            .expect("prune"),
        1
    );
    assert!(sweeper
        .get_task(tenant.id, read_back.id)
        .await
        .expect("get")
        .is_none());
}
