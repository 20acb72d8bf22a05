//! `agent-task-transport/v1` against an in-process server over real mTLS with real agent keys:
//! sessions and fencing, long-poll wake-ups, signed results and every way to get a result
//! refused, retries and dead letters, lost leases and read-back, cancellation, idempotency.

mod common;

use std::time::{Duration, Instant};

use berth_client::ClientError;
use berth_crypto::AgentKey;
use berth_proto::agent::{AgentStatus, GetAgent, Heartbeat, ResourceUsage};
use berth_proto::task::{CancelTask, CreateTask, GetTask, ListTasks, RetryTask, TaskState};
use berth_proto::transport::{AcquireSession, AgentTaskAssignment, GENERATION_HEADER};
use berth_proto::AgentId;
use berth_test_utils::wait_until;
use common::{create, failure, ok, show, sign_with, start, start_with, TestAgent, TestServer};
use serde_json::json;

fn code(e: &ClientError) -> (u16, String) {
    match e {
        ClientError::Api { status, body, .. } => (*status, body.code.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn task(agent: AgentId, task_type: &str, payload: serde_json::Value) -> CreateTask {
    CreateTask {
        task_type: task_type.into(),
        agent_id: Some(agent),
        payload,
        ..Default::default()
    }
}

async fn assignment(agent: &TestAgent, generation: i64) -> AgentTaskAssignment {
    agent
        .poll(generation)
        .await
        .expect("poll")
        .assignment
        .expect("an assignment")
}

/// The next assignment of a poll that promises the start handshake, as berth-agent polls.
async fn promised(agent: &TestAgent, generation: i64) -> AgentTaskAssignment {
    agent
        .poll_promising_start(generation)
        .await
        .expect("poll")
        .assignment
        .expect("an assignment")
}

#[tokio::test]
async fn sessions_fence_stale_and_missing_generations() {
    let server = start().await;
    let agent = server.agent("fenced").await;
    let first = agent.session().await;
    // A second live process with the same identity is refused, and the agent is flagged.
    let err = agent
        .client
        .send(&AcquireSession {
            agent_id: agent.id,
            instance_id: "clone".into(),
            boot_id: None,
            lock: None,
            version: None,
        })
        .await
        .unwrap_err();
    assert_eq!(code(&err), (409, "SESSION_HELD".into()));
    let shown = server
        .admin()
        .send(&GetAgent { id: agent.id })
        .await
        .unwrap();
    assert_eq!(shown.status, AgentStatus::Degraded);
    let metrics = server
        .client(None, None)
        .get_text("/metrics")
        .await
        .unwrap();
    assert!(
        metrics.contains("berth_session_conflicts_total 1"),
        "{metrics}"
    );

    // Every mutating call needs the current generation.
    // Each signed for the generation it is sent under, as a process signs its own.
    let hb = |generation: i64| {
        common::sign_heartbeat(
            Heartbeat {
                agent_id: agent.id,
                status: AgentStatus::Online,
                resource_usage: ResourceUsage::default(),
                capabilities: vec![],
                generation,
                sequence: common::next_sequence(),
                signature_algorithm: berth_proto::transport::ALG_ECDSA_SHA256.into(),
                signature: None,
            },
            &agent.key,
        )
    };
    let err = agent.client.send(&hb(first)).await.unwrap_err();
    assert_eq!(code(&err), (409, "FENCED".into()), "missing generation");
    let stale = (first - 1).to_string();
    let err = agent
        .client
        .send_with(&hb(first - 1), &[(GENERATION_HEADER, &stale)], None)
        .await
        .unwrap_err();
    assert_eq!(code(&err), (409, "FENCED".into()), "stale generation");
    let err = agent.poll(first - 1).await.unwrap_err();
    assert_eq!(code(&err), (409, "FENCED".into()));
    let current = first.to_string();
    agent
        .client
        .send_with(&hb(first), &[(GENERATION_HEADER, &current)], None)
        .await
        .expect("current generation");
    server.stop().await;
}

/// The version a session request names becomes the agent's (an agent upgraded in place shows
/// what it runs); a request without one (agents before 0.2.0) keeps the registered version; a
/// bad one is refused before anything changes.
#[tokio::test]
async fn a_session_request_records_the_version_the_agent_runs() {
    let server = start().await;
    let agent = server.agent("upgraded").await;
    let version = || async {
        server
            .admin()
            .send(&GetAgent { id: agent.id })
            .await
            .unwrap()
            .version
    };
    let registered = version().await;
    let acquire = |instance: &str, version: Option<&str>| AcquireSession {
        agent_id: agent.id,
        instance_id: instance.into(),
        boot_id: None,
        lock: None,
        version: version.map(str::to_owned),
    };
    let first = agent.client.send(&acquire("old", None)).await.unwrap();
    assert_eq!(version().await, registered, "nothing said, nothing changed");
    // Empty, too long, or not safe in a log line (a newline could forge one).
    for bad in [
        String::new(),
        "9".repeat(51),
        "1.0\nforged line".into(),
        "1.0 beta".into(),
    ] {
        let err = agent
            .client
            .send(&acquire("old", Some(&bad)))
            .await
            .unwrap_err();
        assert_eq!(code(&err), (422, "INVALID_REQUEST".into()), "{bad:?}");
    }
    assert_eq!(version().await, registered);
    let second = agent
        .client
        .send(&acquire("old", Some("99.1.0-new")))
        .await
        .unwrap();
    assert!(second.generation > first.generation);
    assert_eq!(version().await, "99.1.0-new");
    server.stop().await;
}

/// A restart of the same installation (same boot id, same held lock) takes a live session at
/// once and clears nothing it should not: no conflict, no degraded mark. Anything else waits.
#[tokio::test]
async fn a_restart_holding_the_installation_lock_takes_the_session_at_once() {
    let server = start().await;
    let agent = server.agent("phoenix").await;
    let acquire = |instance: &str, boot: Option<&str>, lock: Option<&str>| AcquireSession {
        agent_id: agent.id,
        instance_id: instance.into(),
        boot_id: boot.map(str::to_owned),
        lock: lock.map(str::to_owned),
        version: None,
    };
    let first = agent
        .client
        .send(&acquire("p1", Some("boot-a"), Some("8:42")))
        .await
        .expect("session")
        .generation;
    let restarted = agent
        .client
        .send(&acquire("p2", Some("boot-a"), Some("8:42")))
        .await
        .expect("the restart takes the live session");
    assert_eq!(restarted.generation, first + 1);
    let shown = server
        .admin()
        .send(&GetAgent { id: agent.id })
        .await
        .unwrap();
    assert_ne!(shown.status, AgentStatus::Degraded);

    for (boot, lock) in [
        (Some("boot-b"), Some("8:42")),
        (Some("boot-a"), Some("8:43")),
        (Some("boot-a"), None),
        (None, Some("8:42")),
    ] {
        let err = agent
            .client
            .send(&acquire("clone", boot, lock))
            .await
            .unwrap_err();
        assert_eq!(
            code(&err),
            (409, "SESSION_HELD".into()),
            "{boot:?} {lock:?}"
        );
    }
    let err = agent
        .client
        .send(&acquire("odd", Some("boot-a/x"), Some("8:42")))
        .await
        .unwrap_err();
    assert_eq!(code(&err), (422, "INVALID_REQUEST".into()));
    let shown = server
        .admin()
        .send(&GetAgent { id: agent.id })
        .await
        .unwrap();
    assert_eq!(shown.status, AgentStatus::Degraded);
    server.stop().await;
}

#[tokio::test]
async fn a_long_poll_answers_within_milliseconds_of_a_new_task() {
    let server = start().await;
    let agent = server.agent("waiter").await;
    let generation = agent.session().await;
    let admin = server.admin();
    let agent_id = agent.id;
    let poller = tokio::spawn(async move { agent.poll(generation).await.expect("poll") });
    // The poll has parked (the server says so), not merely been sent.
    wait_until(Duration::from_secs(10), "the poll to park", || async {
        metric(&server, "berth_long_polls_parked").await == 1.0
    })
    .await;
    let created_at = Instant::now();
    let task = admin
        .send(&task(agent_id, "inspect", json!({})))
        .await
        .unwrap();
    let response = poller.await.unwrap();
    let woke_after = created_at.elapsed();
    let a = response.assignment.expect("the new task");
    assert_eq!(a.task_id, task.id);
    assert_eq!(a.contract_version, "agent-task-transport/v1");
    assert_eq!(a.task_type, "inspect");
    assert_eq!(a.required_capability, "agent");
    assert!(!a.side_effects);
    assert_eq!(a.timeout, "00:05:00");
    // The task event woke the parked poll: it did not find the task by polling again later.
    assert_eq!(metric(&server, "berth_long_poll_wakeups_total").await, 1.0);
    assert_eq!(metric(&server, "berth_long_polls_parked").await, 0.0);
    // Generous bound for a loaded 2-core machine; the benchmark measures the real figure.
    assert!(
        woke_after < Duration::from_secs(2),
        "woke after {woke_after:?}"
    );
    server.stop().await;
}

/// One unlabelled sample from `/metrics`.
async fn metric(server: &TestServer, name: &str) -> f64 {
    let text = server
        .client(None, None)
        .get_text("/metrics")
        .await
        .expect("metrics");
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
}

#[tokio::test]
async fn a_signed_result_completes_the_task_and_is_stored_for_audit() {
    let server = start().await;
    let agent = server.agent("signer").await;
    let generation = agent.session().await;
    let t = create(
        &server,
        task(agent.id, "write-sticker", json!({"name": "web"})),
    )
    .await;
    assert_eq!(t.state, TaskState::Pending);
    assert!(t.side_effects);
    let a = assignment(&agent, generation).await;
    assert_eq!(show(&server, &t).await.state, TaskState::Leased);
    let envelope = agent.sign(agent.envelope(a.assignment_id, ok(t.id)));
    let ack = agent
        .submit(generation, envelope.clone())
        .await
        .expect("accepted");
    assert_eq!(
        (ack.accepted, ack.duplicate, ack.state.as_str()),
        (true, false, "succeeded")
    );
    // The same result again is answered idempotently.
    let again = agent
        .submit(generation, envelope.clone())
        .await
        .expect("duplicate accepted");
    assert!(again.duplicate);
    let shown = show(&server, &t).await;
    assert_eq!(shown.state, TaskState::Succeeded);
    assert!(!shown.read_back);
    assert_eq!(shown.attempts.len(), 1);
    assert_eq!(
        shown.attempts[0].result.as_ref().unwrap()["signature"],
        envelope["signature"]
    );
    // A different result for the ended assignment is refused.
    let other = agent.sign(agent.envelope(a.assignment_id, failure(t.id, "X", false)));
    let err = agent.submit(generation, other).await.unwrap_err();
    assert_eq!(code(&err), (409, "FENCED".into()));
    server.stop().await;
}

#[tokio::test]
async fn forged_and_malformed_results_fail_closed_with_distinct_codes() {
    let server = start().await;
    let agent = server.agent("victim").await;
    let other = server.agent("other").await;
    let generation = agent.session().await;
    let other_generation = other.session().await;
    let t = create(&server, task(agent.id, "inspect", json!({}))).await;
    let a = assignment(&agent, generation).await;
    let base = agent.envelope(a.assignment_id, ok(t.id));

    // Unsigned.
    let err = agent.submit(generation, base.clone()).await.unwrap_err();
    assert_eq!(code(&err), (422, "SIGNATURE_MISSING".into()));
    // One bit flipped in the signed content.
    let mut flipped = agent.sign(base.clone());
    flipped["message"] = "donf".into();
    let err = agent.submit(generation, flipped).await.unwrap_err();
    assert_eq!(code(&err), (422, "SIGNATURE_INVALID".into()));
    // One bit flipped in the signature.
    let mut bad_sig = agent.sign(base.clone());
    let mut raw = base64_decode(bad_sig["signature"].as_str().unwrap());
    let last = raw.len() - 1;
    raw[last] ^= 1;
    bad_sig["signature"] = base64_encode(&raw).into();
    let err = agent.submit(generation, bad_sig).await.unwrap_err();
    assert_eq!(code(&err), (422, "SIGNATURE_INVALID".into()));
    // Signed by another key (a valid signature, but not by the certificate's key).
    let mut stranger = base.clone();
    sign_with(&AgentKey::generate().unwrap(), &mut stranger);
    let err = agent.submit(generation, stranger).await.unwrap_err();
    assert_eq!(code(&err), (422, "SIGNATURE_INVALID".into()));
    // Claims RSA for an ECDSA signature.
    let mut rsa = base.clone();
    rsa["signatureAlgorithm"] = "rsa-sha256".into();
    let err = agent.submit(generation, agent.sign(rsa)).await.unwrap_err();
    assert_eq!(code(&err), (422, "SIGNATURE_INVALID".into()));
    let mut unknown_alg = base.clone();
    unknown_alg["signatureAlgorithm"] = "none".into();
    let err = agent
        .submit(generation, agent.sign(unknown_alg))
        .await
        .unwrap_err();
    assert_eq!(code(&err), (422, "UNSUPPORTED_SIGNATURE_ALGORITHM".into()));
    // Wrong contract version.
    let mut v2 = base.clone();
    v2["contractVersion"] = "agent-task-transport/v2".into();
    let err = agent.submit(generation, agent.sign(v2)).await.unwrap_err();
    assert_eq!(code(&err), (422, "UNSUPPORTED_CONTRACT_VERSION".into()));
    // The envelope names another task than the path (signed, sent to this task's path).
    let decoy = create(&server, task(agent.id, "inspect", json!({}))).await;
    let mut mismatched = base.clone();
    mismatched["taskId"] = decoy.id.to_string().into();
    let signed = agent.sign(mismatched);
    let g = generation.to_string();
    let path_override = common::RawResult(signed.clone());
    let response = server
        .raw(Some(&agent.identity()))
        .post(format!(
            "{}/api/v1/release-orchestrator/agent-runtime/agents/{}/tasks/{}/result",
            server.url, agent.id, t.id
        ))
        .header(GENERATION_HEADER, &g)
        .json(&path_override.0)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 422);
    assert_eq!(
        response.json::<serde_json::Value>().await.unwrap()["code"],
        "TASK_ID_MISMATCH"
    );
    // The envelope names another agent than the path.
    let mut wrong_agent = base.clone();
    wrong_agent["agentId"] = other.id.to_string().into();
    let response = server
        .raw(Some(&agent.identity()))
        .post(format!(
            "{}/api/v1/release-orchestrator/agent-runtime/agents/{}/tasks/{}/result",
            server.url, agent.id, t.id
        ))
        .header(GENERATION_HEADER, &g)
        .json(&agent.sign(wrong_agent))
        .send()
        .await
        .unwrap();
    assert_eq!(
        response.json::<serde_json::Value>().await.unwrap()["code"],
        "AGENT_ID_MISMATCH"
    );
    // Another agent's valid certificate, correctly signed by that agent, on this agent's path.
    let mut impersonation = base.clone();
    sign_with(&other.key, &mut impersonation);
    let err = other
        .submit(other_generation, impersonation)
        .await
        .unwrap_err();
    assert_eq!(code(&err), (403, "CERT_BINDING_MISMATCH".into()));
    // No client certificate.
    let err = server
        .client(None, None)
        .send_with(
            &common::RawResult(agent.sign(base.clone())),
            &[(GENERATION_HEADER, &g)],
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(code(&err), (401, "CLIENT_CERT_REQUIRED".into()));
    // None of it moved the task; the genuine result still counts.
    assert_eq!(show(&server, &t).await.state, TaskState::Leased);
    agent
        .submit(generation, agent.sign(base))
        .await
        .expect("genuine result");
    let metrics = server
        .client(None, None)
        .get_text("/metrics")
        .await
        .unwrap();
    for reason in [
        "no_signature",
        "bad_signature",
        "unsupported_contract_version",
        "task_id_mismatch",
        "agent_id_mismatch",
        "binding_mismatch",
    ] {
        assert!(
            metrics.contains(&format!(
                "berth_result_rejections_total{{reason=\"{reason}\"}}"
            )),
            "{reason}: {metrics}"
        );
    }
    server.stop().await;
}

fn base64_decode(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

fn base64_encode(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(b)
}

#[tokio::test]
async fn a_disabled_transport_fails_closed() {
    let server = start_with(|c| c.agent_transport_enabled = false).await;
    let agent = server.agent("idle").await;
    let generation = agent.session().await;
    let err = agent.poll(generation).await.unwrap_err();
    assert_eq!(code(&err), (503, "TRANSPORT_DISABLED".into()));
    let t = create(&server, task(agent.id, "inspect", json!({}))).await;
    let fake = agent.sign(agent.envelope(berth_proto::AssignmentId::new(), ok(t.id)));
    let err = agent.submit(generation, fake).await.unwrap_err();
    assert_eq!(code(&err), (503, "TRANSPORT_DISABLED".into()));
    let ready = server
        .raw(None)
        .get(format!("{}/readyz", server.url))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status().as_u16(), 503);
    assert_eq!(
        ready.json::<serde_json::Value>().await.unwrap()["checks"]["agentTaskTransport"],
        "disabled"
    );
    assert_eq!(
        show(&server, &t).await.state,
        TaskState::Pending,
        "nothing succeeds without the transport"
    );
    server.stop().await;
}

#[tokio::test]
async fn retriable_failures_back_off_then_dead_letter() {
    let server = start_with(|c| {
        c.retry_policy = berth_store::RetryPolicy {
            backoff: vec![Duration::from_millis(100), Duration::from_millis(200)],
            max_attempts: 5,
        }
    })
    .await;
    let agent = server.agent("flaky").await;
    let generation = agent.session().await;
    let t = create(
        &server,
        task(
            agent.id,
            "health-check",
            json!({"type": "tcp", "host": "127.0.0.1", "port": 1}),
        ),
    )
    .await;
    for attempt in 1..=5 {
        let a = assignment(&agent, generation).await;
        assert_eq!(a.task_id, t.id, "attempt {attempt}");
        let envelope =
            agent.sign(agent.envelope(a.assignment_id, failure(t.id, "HEALTH_CHECK_FAILED", true)));
        let ack = agent.submit(generation, envelope).await.unwrap();
        let expected = if attempt < 5 {
            TaskState::RetryWait
        } else {
            TaskState::DeadLetter
        };
        assert_eq!(ack.state, expected, "attempt {attempt}");
    }
    let shown = show(&server, &t).await;
    assert_eq!(
        (
            shown.state.as_str(),
            shown.attempt_count,
            shown.attempts.len()
        ),
        ("dead_letter", 5, 5)
    );
    let dead = server
        .admin()
        .send(&ListTasks {
            state: Some(TaskState::DeadLetter),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        dead.items.iter().map(|t| t.id).collect::<Vec<_>>(),
        vec![t.id]
    );
    // An operator can retry a dead letter; a succeeded task cannot be retried.
    let retried = server.admin().send(&RetryTask { id: t.id }).await.unwrap();
    assert_eq!(retried.state, TaskState::Pending);
    let a = assignment(&agent, generation).await;
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(a.assignment_id, ok(t.id))),
        )
        .await
        .unwrap();
    let err = server
        .admin()
        .send(&RetryTask { id: t.id })
        .await
        .unwrap_err();
    assert_eq!(code(&err), (409, "TASK_NOT_RETRIABLE".into()));
    server.stop().await;
}

#[tokio::test]
async fn a_lost_lease_requeues_read_only_work_and_fences_the_late_result() {
    let server = start_with(|c| c.lease_grace = Duration::ZERO).await;
    let agent = server.agent("slow").await;
    let generation = agent.session().await;
    let mut request = task(agent.id, "inspect", json!({}));
    request.timeout_seconds = Some(1);
    let t = create(&server, request).await;
    let first = assignment(&agent, generation).await;
    // The lease (1 s timeout, no grace) runs out; the task goes back to the queue.
    wait_until(Duration::from_secs(30), "the lease to expire", || async {
        matches!(
            show(&server, &t).await.state.as_str(),
            "retry_wait" | "pending"
        )
    })
    .await;
    let late = agent.sign(agent.envelope(first.assignment_id, ok(t.id)));
    let err = agent.submit(generation, late).await.unwrap_err();
    assert_eq!(
        code(&err),
        (409, "FENCED".into()),
        "a result for a lost assignment is refused"
    );
    let second = assignment(&agent, generation).await;
    assert_ne!(
        second.assignment_id, first.assignment_id,
        "each delivery has a fresh assignment id"
    );
    assert_eq!(
        second.idempotency_key, first.idempotency_key,
        "the journal key is stable"
    );
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(second.assignment_id, ok(t.id))),
        )
        .await
        .unwrap();
    assert_eq!(show(&server, &t).await.state, TaskState::Succeeded);
    server.stop().await;
}

#[tokio::test]
async fn a_lost_lease_with_side_effects_is_unknown_until_read_back_proves_it() {
    let server = start_with(|c| c.lease_grace = Duration::ZERO).await;
    let agent = server.agent("deployer").await;
    let generation = agent.session().await;
    let mut request = task(
        agent.id,
        "write-sticker",
        json!({"name": "web", "digest": "sha256:abc"}),
    );
    request.timeout_seconds = Some(1);
    let t = create(&server, request).await;
    let lost = assignment(&agent, generation).await;
    wait_until(
        Duration::from_secs(30),
        "the task to become unknown",
        || async { show(&server, &t).await.state == TaskState::Unknown },
    )
    .await;
    // Never re-run: the next delivery is a read-back of the sticker, not the task.
    let read_back = assignment(&agent, generation).await;
    assert_eq!(read_back.task_type, "read-sticker");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&agent.open(&read_back).unwrap().payload)
            .unwrap()["name"],
        "web"
    );
    // The agent did write the sticker before it lost its lease: read-back finds it.
    let mut evidence = ok(read_back.task_id);
    evidence.outputs.insert(
        "sticker".into(),
        json!({"name": "web", "taskId": t.id, "digest": "sha256:abc"}),
    );
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(read_back.assignment_id, evidence)),
        )
        .await
        .unwrap();
    let shown = show(&server, &t).await;
    assert_eq!(shown.state, TaskState::Succeeded);
    assert!(shown.read_back, "succeeded by read-back, not by a result");
    let late = agent.sign(agent.envelope(lost.assignment_id, ok(t.id)));
    assert_eq!(
        code(&agent.submit(generation, late).await.unwrap_err()),
        (409, "FENCED".into())
    );
    server.stop().await;
}

/// The start handshake: a lost delivery with side effects that its agent promised to start, and
/// never started, provably did nothing and runs again; once started it may have run, and only
/// read-back can tell. A start is confirmed only for the live lease of the current generation.
#[tokio::test]
async fn a_lost_side_effect_that_never_started_runs_again_and_a_started_one_is_unknown() {
    let server = start_with(|c| c.lease_grace = Duration::ZERO).await;
    let agent = server.agent("starter").await;
    let generation = agent.session().await;
    let mut request = task(agent.id, "write-sticker", json!({"name": "web"}));
    request.timeout_seconds = Some(1);
    let t = create(&server, request).await;
    // Never started: requeued with its error, not unknown.
    let first = promised(&agent, generation).await;
    wait_until(
        Duration::from_secs(30),
        "the lost delivery to be requeued",
        || async { show(&server, &t).await.state == TaskState::RetryWait },
    )
    .await;
    assert_eq!(
        show(&server, &t).await.error_code.as_deref(),
        Some("LEASE_EXPIRED")
    );
    let late = agent
        .start(generation, t.id, first.assignment_id)
        .await
        .unwrap_err();
    assert_eq!(
        code(&late),
        (409, "FENCED".into()),
        "a lost delivery may not start"
    );

    // The next delivery: refused for another generation or task, confirmed (once) otherwise.
    let second = promised(&agent, generation).await;
    assert_eq!(second.task_id, t.id);
    let stale = agent
        .start(generation + 1, t.id, second.assignment_id)
        .await
        .unwrap_err();
    assert_eq!(code(&stale), (409, "FENCED".into()));
    let missing = agent
        .start(generation, berth_proto::TaskId::new(), second.assignment_id)
        .await
        .unwrap_err();
    assert_eq!(code(&missing), (404, "NOT_FOUND".into()));
    let started = agent
        .start(generation, t.id, second.assignment_id)
        .await
        .expect("start");
    assert_eq!(started.assignment_id, second.assignment_id);
    assert_eq!(started.expires_at, second.expires_at);
    let again = agent
        .start(generation, t.id, second.assignment_id)
        .await
        .expect("start again");
    assert_eq!(
        again.started_at, started.started_at,
        "the first start counts"
    );

    // Started, then lost: it may have run, so unknown, and read back instead of re-run.
    wait_until(
        Duration::from_secs(30),
        "the started delivery to become unknown",
        || async { show(&server, &t).await.state == TaskState::Unknown },
    )
    .await;
    assert_eq!(
        assignment(&agent, generation).await.task_type,
        "read-sticker"
    );
    server.stop().await;
}

#[tokio::test]
async fn read_back_without_proof_leaves_the_task_unknown_for_an_operator() {
    let server = start_with(|c| c.lease_grace = Duration::ZERO).await;
    let agent = server.agent("lost").await;
    let generation = agent.session().await;
    let mut request = task(agent.id, "write-sticker", json!({"name": "api"}));
    request.timeout_seconds = Some(1);
    let t = create(&server, request).await;
    assignment(&agent, generation).await;
    wait_until(Duration::from_secs(30), "unknown", || async {
        show(&server, &t).await.state == TaskState::Unknown
    })
    .await;
    let read_back = assignment(&agent, generation).await;
    let mut nothing = ok(read_back.task_id);
    nothing
        .outputs
        .insert("sticker".into(), serde_json::Value::Null);
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(read_back.assignment_id, nothing)),
        )
        .await
        .unwrap();
    assert_eq!(show(&server, &t).await.state, TaskState::Unknown);
    // The operator abandons it.
    let cancelled = server.admin().send(&CancelTask { id: t.id }).await.unwrap();
    assert_eq!(cancelled.state, TaskState::Cancelled);
    server.stop().await;
}

#[tokio::test]
async fn a_lost_rollback_that_names_its_container_only_in_its_config_is_read_back() {
    let server = start_with(|c| c.lease_grace = Duration::ZERO).await;
    let agent = server.agent("rolling-back").await;
    equip(&server, &agent, &["docker"], "web").await;
    let generation = agent.session().await;
    let mut request = task(
        agent.id,
        "rollback",
        json!({"config": {"containerName": "shop"}}),
    );
    request.timeout_seconds = Some(1);
    let t = create(&server, request).await;
    let lost = assignment(&agent, generation).await;
    assert_eq!(lost.task_type, "rollback");
    wait_until(Duration::from_secs(30), "unknown", || async {
        show(&server, &t).await.state == TaskState::Unknown
    })
    .await;
    let read_back = assignment(&agent, generation).await;
    assert_eq!(read_back.task_type, "read-sticker");
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&agent.open(&read_back).unwrap().payload)
            .unwrap()["name"],
        "shop",
        "the sticker named by config.containerName"
    );
    let mut evidence = ok(read_back.task_id);
    evidence
        .outputs
        .insert("sticker".into(), json!({"name": "shop", "taskId": t.id}));
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(read_back.assignment_id, evidence)),
        )
        .await
        .unwrap();
    let shown = show(&server, &t).await;
    assert_eq!(shown.state, TaskState::Succeeded);
    assert!(shown.read_back);
    server.stop().await;
}

#[tokio::test]
async fn cancellation_reaches_a_running_task_through_the_poll() {
    let server = start().await;
    let agent = server.agent("canceller").await;
    let generation = agent.session().await;
    let queued = create(&server, task(agent.id, "inspect", json!({}))).await;
    let running = create(&server, task(agent.id, "inspect", json!({}))).await;
    // A queued task is cancelled at once... (the first is taken first, so cancel the second
    // after the first is leased)
    let a = assignment(&agent, generation).await;
    assert_eq!(a.task_id, queued.id, "tasks run in order");
    let pending_cancel = server
        .admin()
        .send(&CancelTask { id: running.id })
        .await
        .unwrap();
    assert_eq!(pending_cancel.state, TaskState::Cancelled);
    // ...a leased one is signalled to the agent, which reports cancelled.
    let requested = server
        .admin()
        .send(&CancelTask { id: queued.id })
        .await
        .unwrap();
    assert!(requested.cancel_requested);
    assert_eq!(requested.state, TaskState::Leased);
    let response = agent.poll(generation).await.unwrap();
    assert_eq!(response.cancellations.len(), 1);
    assert_eq!(response.cancellations[0].assignment_id, a.assignment_id);
    let envelope =
        agent.sign(agent.envelope(a.assignment_id, failure(queued.id, "CANCELLED", false)));
    assert_eq!(
        agent.submit(generation, envelope).await.unwrap().state,
        TaskState::Cancelled
    );
    server.stop().await;
}

#[tokio::test]
async fn idempotency_keys_return_the_same_task_or_conflict() {
    let server = start().await;
    let agent = server.agent("idem").await;
    let admin = server.admin();
    let request = task(agent.id, "inspect", json!({"a": 1}));
    let first = admin
        .send_with(
            &request,
            &[(berth_proto::headers::IDEMPOTENCY_KEY_HEADER, "deploy-42")],
            None,
        )
        .await
        .unwrap();
    let again = admin
        .send_with(
            &request,
            &[(berth_proto::headers::IDEMPOTENCY_KEY_HEADER, "deploy-42")],
            None,
        )
        .await
        .unwrap();
    assert_eq!(first.id, again.id);
    let different = task(agent.id, "inspect", json!({"a": 2}));
    let err = admin
        .send_with(
            &different,
            &[(berth_proto::headers::IDEMPOTENCY_KEY_HEADER, "deploy-42")],
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(code(&err), (409, "CONFLICT".into()));
    let list = admin.send(&ListTasks::default()).await.unwrap();
    assert_eq!(list.items.len(), 1);
    server.stop().await;
}

#[tokio::test]
async fn tasks_for_one_agent_run_in_order_with_one_side_effect_at_a_time() {
    let server = start_with(|c| c.long_poll = Duration::from_millis(500)).await;
    let agent = server.agent("ordered").await;
    let generation = agent.session().await;
    let deploy_a = create(
        &server,
        task(agent.id, "write-sticker", json!({"name": "a"})),
    )
    .await;
    let deploy_b = create(
        &server,
        task(agent.id, "write-sticker", json!({"name": "b"})),
    )
    .await;
    let first = assignment(&agent, generation).await;
    assert_eq!(first.task_id, deploy_a.id);
    // B has side effects and A is still running: nothing is handed out.
    let response = tokio::time::timeout(Duration::from_secs(60), agent.poll(generation))
        .await
        .unwrap()
        .unwrap();
    assert!(
        response.assignment.is_none(),
        "a second side-effecting task must wait"
    );
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(first.assignment_id, ok(deploy_a.id))),
        )
        .await
        .unwrap();
    assert_eq!(assignment(&agent, generation).await.task_id, deploy_b.id);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_polls_never_receive_the_same_assignment() {
    let server = start_with(|c| c.long_poll = Duration::from_millis(500)).await;
    let mut agents = Vec::new();
    for i in 0..3 {
        let agent = server.agent(&format!("poller-{i}")).await;
        let generation = agent.session().await;
        agents.push((agent, generation));
    }
    let mut expected = std::collections::HashSet::new();
    for (agent, _) in &agents {
        for _ in 0..10 {
            expected.insert((
                agent.id,
                create(&server, task(agent.id, "inspect", json!({})))
                    .await
                    .id,
            ));
        }
    }
    let mut pollers = tokio::task::JoinSet::new();
    for (agent, generation) in agents {
        // Two concurrent pollers per agent: the same agent's polls race each other too.
        let agent = std::sync::Arc::new(agent);
        for _ in 0..2 {
            let agent = agent.clone();
            pollers.spawn(async move {
                let mut got = Vec::new();
                loop {
                    let response = agent.poll(generation).await.expect("poll");
                    let Some(a) = response.assignment else { break };
                    assert_eq!(a.agent_id, agent.id, "a task reached another agent");
                    got.push((a.agent_id, a.task_id, a.assignment_id));
                    let envelope = agent.sign(agent.envelope(a.assignment_id, ok(a.task_id)));
                    agent.submit(generation, envelope).await.expect("result");
                }
                got
            });
        }
    }
    let delivered: Vec<_> = pollers.join_all().await.into_iter().flatten().collect();
    let assignments: std::collections::HashSet<_> = delivered.iter().map(|d| d.2).collect();
    let tasks: std::collections::HashSet<_> = delivered.iter().map(|d| (d.0, d.1)).collect();
    assert_eq!(
        assignments.len(),
        delivered.len(),
        "an assignment was delivered twice"
    );
    assert_eq!(tasks.len(), delivered.len(), "a task was delivered twice");
    assert_eq!(tasks, expected);
    server.stop().await;
}

#[tokio::test]
async fn viewers_cannot_create_tasks_and_tenants_cannot_see_each_others() {
    let server = start().await;
    let agent = server.agent("private").await;
    let admin = server.admin();
    let viewer = admin
        .send(&berth_proto::admin::CreateApiToken {
            role: berth_proto::admin::Role::Viewer,
            name: None,
        })
        .await
        .unwrap();
    let err = server
        .client(Some(&viewer.token), None)
        .send(&task(agent.id, "inspect", json!({})))
        .await
        .unwrap_err();
    assert_eq!(code(&err), (403, "FORBIDDEN".into()));
    let t = create(&server, task(agent.id, "inspect", json!({}))).await;
    let acme = admin
        .send(&berth_proto::admin::CreateTenant {
            name: "acme-tasks".into(),
        })
        .await
        .unwrap();
    let acme = server.client(Some(&acme.admin_token), None);
    assert_eq!(
        code(&acme.send(&GetTask { id: t.id }).await.unwrap_err()),
        (404, "NOT_FOUND".into())
    );
    assert_eq!(
        code(&acme.send(&CancelTask { id: t.id }).await.unwrap_err()),
        (404, "NOT_FOUND".into())
    );
    assert_eq!(
        code(
            &acme
                .send(&task(agent.id, "inspect", json!({})))
                .await
                .unwrap_err()
        ),
        (404, "NOT_FOUND".into())
    );
    assert!(acme
        .send(&ListTasks::default())
        .await
        .unwrap()
        .items
        .is_empty());
    // Credentials go in and never come back out.
    let mut with_secret = task(agent.id, "inspect", json!({}));
    with_secret.credentials =
        Some([("registryPassword".to_string(), "s3cr3t-value".to_string())].into());
    let created = admin.send(&with_secret).await.unwrap();
    let shown =
        serde_json::to_string(&admin.send(&GetTask { id: created.id }).await.unwrap()).unwrap();
    assert!(!shown.contains("s3cr3t-value"));
    server.stop().await;
}

/// Seed 000's capability strings, set by an admin as an agent could report them.
async fn equip(server: &TestServer, agent: &TestAgent, capabilities: &[&str], role: &str) {
    server
        .admin()
        .send(&berth_proto::agent::UpdateAgent {
            id: agent.id,
            labels: Some([("role".to_string(), role.to_string())].into()),
            capabilities: Some(
                capabilities
                    .iter()
                    .map(|c| berth_proto::agent::Capability::named(*c))
                    .collect(),
            ),
        })
        .await
        .expect("update agent");
}

#[tokio::test]
async fn create_refuses_unknown_types_bad_payloads_and_missing_capabilities() {
    let server = start().await;
    let plain = server.agent("plain").await;
    equip(&server, &plain, &[], "web").await;
    let cases = [
        (task(plain.id, "deploy", json!({})), "UNSUPPORTED_TASK_TYPE"),
        (task(plain.id, "", json!({})), "UNSUPPORTED_TASK_TYPE"),
        (
            task(plain.id, "write-sticker", json!({})),
            "INVALID_PAYLOAD",
        ),
        (
            task(plain.id, "read-sticker", json!({"name": "a", "extra": 1})),
            "INVALID_PAYLOAD",
        ),
        (
            task(plain.id, "execute-command", json!({"command": "sh -c id"})),
            "INVALID_PAYLOAD",
        ),
        (
            task(
                plain.id,
                "docker.run",
                json!({"config": {"containerName": "web"}}),
            ),
            "CAPABILITY_MISSING",
        ),
        (
            task(plain.id, "compose.up", json!({})),
            "CAPABILITY_MISSING",
        ),
        (
            CreateTask {
                task_type: "docker.run".into(),
                selector: Some([("role".to_string(), "web".to_string())].into()),
                ..Default::default()
            },
            "NO_MATCHING_AGENT",
        ),
    ];
    for (request, expected) in cases {
        let err = server.admin().send(&request).await.unwrap_err();
        assert_eq!(code(&err), (422, expected.into()), "{request:?}");
    }
    let queued = server
        .admin()
        .send(&ListTasks::default())
        .await
        .expect("list");
    assert!(queued.items.is_empty(), "a refused create queued nothing");
    // The same kinds pass once the agent reports the capability.
    equip(&server, &plain, &["docker", "compose"], "web").await;
    for kind in ["docker.run", "compose.up"] {
        create(&server, task(plain.id, kind, json!({}))).await;
    }
    server.stop().await;
}

/// Issue 9 item 9: path-like payload fields, the per-task limits and label characters are
/// refused at create with their own codes, where they used to be queued and fail on the agent.
#[tokio::test]
async fn create_refuses_unsafe_names_limits_and_deceptive_labels() {
    let server = start().await;
    let plain = server.agent("plain").await;
    equip(&server, &plain, &["docker", "compose"], "web").await;
    let many = |n: usize| -> std::collections::BTreeMap<String, String> {
        (0..n).map(|i| (format!("K{i}"), "v".to_string())).collect()
    };
    let cases = [
        (
            task(plain.id, "write-sticker", json!({"name": "../../tmp/pwn"})),
            "INVALID_PAYLOAD",
        ),
        (
            task(plain.id, "read-sticker", json!({"name": "a/b"})),
            "INVALID_PAYLOAD",
        ),
        (
            task(
                plain.id,
                "docker.run",
                json!({"config": {"containerName": "../x"}}),
            ),
            "INVALID_PAYLOAD",
        ),
        (
            task(plain.id, "rollback", json!({"containerName": "x/../y"})),
            "INVALID_PAYLOAD",
        ),
        (
            task(
                plain.id,
                "compose.up",
                json!({"config": {"projectName": "../app"}}),
            ),
            "INVALID_PAYLOAD",
        ),
        (
            task(
                plain.id,
                "compose.up",
                json!({"config": {"projectName": "app", "deploymentDirectory": "../../tmp/pwn"}}),
            ),
            "INVALID_PAYLOAD",
        ),
        (
            CreateTask {
                credentials: Some(many(65)),
                ..task(plain.id, "inspect", json!({}))
            },
            "TOO_MANY_CREDENTIALS",
        ),
        (
            CreateTask {
                credentials: Some([("K".to_string(), "x".repeat(64 * 1024 + 1))].into()),
                ..task(plain.id, "inspect", json!({}))
            },
            "TOO_MANY_CREDENTIALS",
        ),
        (
            CreateTask {
                variables: Some(many(65)),
                ..task(plain.id, "inspect", json!({}))
            },
            "TOO_MANY_VARIABLES",
        ),
        (
            CreateTask {
                priority: Some(i32::MAX),
                ..task(plain.id, "inspect", json!({}))
            },
            "PRIORITY_OUT_OF_RANGE",
        ),
        (
            CreateTask {
                priority: Some(-1001),
                ..task(plain.id, "inspect", json!({}))
            },
            "PRIORITY_OUT_OF_RANGE",
        ),
        (
            CreateTask {
                variables: Some([("K".to_string(), "admin\u{202E}txt.exe".to_string())].into()),
                ..task(plain.id, "inspect", json!({}))
            },
            "INVALID_LABEL",
        ),
        (
            CreateTask {
                task_type: "inspect".into(),
                selector: Some([("role".to_string(), "w\u{200B}eb".to_string())].into()),
                ..Default::default()
            },
            "INVALID_LABEL",
        ),
    ];
    for (request, expected) in cases {
        let err = server.admin().send(&request).await.unwrap_err();
        assert_eq!(code(&err), (422, expected.into()), "{request:?}");
    }
    // A label value on the agent itself, too.
    let err = server
        .admin()
        .send(&berth_proto::agent::UpdateAgent {
            id: plain.id,
            labels: Some([("role".to_string(), "we\u{0007}b".to_string())].into()),
            capabilities: None,
        })
        .await
        .unwrap_err();
    assert_eq!(code(&err), (422, "INVALID_LABEL".into()));
    let queued = server.admin().send(&ListTasks::default()).await.unwrap();
    assert!(queued.items.is_empty(), "a refused create queued nothing");
    // The limits themselves, a safe name and exact numbers pass, and read back unchanged.
    let ok = create(
        &server,
        CreateTask {
            credentials: Some(many(64)),
            variables: Some(many(64)),
            priority: Some(1000),
            ..task(
                plain.id,
                "write-sticker",
                json!({"name": "site.v1", "extra": {"n": 18446744073709551615u64, "f": 0.1}}),
            )
        },
    )
    .await;
    assert_eq!(ok.priority, 1000);
    create(
        &server,
        task(
            plain.id,
            "compose.up",
            json!({"config": {"projectName": "app", "deploymentDirectory": "/srv/app"}}),
        ),
    )
    .await;
    server.stop().await;
}

/// Issue 9 item 9: `123456789012345678901234567890` in a payload reached the host as
/// `1.2345678901234568e+29`; it is refused at create, naming where it is.
#[tokio::test]
async fn create_refuses_a_number_the_host_would_not_receive_exactly() {
    let server = start().await;
    let plain = server.agent("plain").await;
    // A number the host would see as a different number is refused, naming where it is.
    let response = server
        .raw(None)
        .post(format!("{}/api/v1/tasks", server.url))
        .header("authorization", format!("Bearer {}", server.admin_token))
        .header("content-type", "application/json")
        .body(format!(
            r#"{{"type": "write-sticker", "agentId": "{}",
                "payload": {{"name": "n", "extra": {{"big": 123456789012345678901234567890}}}}}}"#,
            plain.id
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 422);
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["code"], "INVALID_PAYLOAD", "{body}");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains("/payload/extra/big"),
        "{body}"
    );
    let queued = server.admin().send(&ListTasks::default()).await.unwrap();
    assert!(queued.items.is_empty(), "a refused create queued nothing");
    server.stop().await;
}

#[tokio::test]
async fn a_selector_picks_the_capable_agent_with_the_fewest_open_tasks() {
    let server = start().await;
    let busy = server.agent("busy").await;
    let idle = server.agent("idle").await;
    let incapable = server.agent("incapable").await;
    let registered = server.agent("registered").await;
    for agent in [&busy, &idle, &incapable] {
        agent.go_online().await;
    }
    // Never heartbeated: capable and labelled, but not online, so never selected.
    equip(&server, &registered, &["docker"], "web").await;
    for agent in [&busy, &idle] {
        equip(&server, agent, &["docker"], "web").await;
    }
    equip(&server, &incapable, &[], "web").await;
    for _ in 0..2 {
        create(&server, task(busy.id, "inspect", json!({}))).await;
    }
    create(&server, task(idle.id, "inspect", json!({}))).await;
    let by_selector = || CreateTask {
        task_type: "docker.run".into(),
        selector: Some([("role".to_string(), "web".to_string())].into()),
        ..Default::default()
    };
    // idle has 1 open task, busy 2, incapable none but no Docker.
    assert_eq!(create(&server, by_selector()).await.agent_id, idle.id);
    // Now both have 2; the next goes to either, and never to the incapable agent.
    for _ in 0..4 {
        let chosen = create(&server, by_selector()).await.agent_id;
        assert!(chosen == idle.id || chosen == busy.id);
    }
    let open = |agent: AgentId| {
        let server = &server;
        async move {
            server
                .admin()
                .send(&ListTasks {
                    agent_id: Some(agent),
                    ..Default::default()
                })
                .await
                .unwrap()
                .items
                .len()
        }
    };
    assert_eq!(
        (open(busy.id).await, open(idle.id).await),
        (4, 4),
        "spread evenly"
    );
    assert_eq!(open(incapable.id).await, 0);
    server.stop().await;
}

#[tokio::test]
async fn a_poll_without_the_capability_fails_the_task_closed_instead_of_running_it() {
    let server = start().await;
    let agent = server.agent("lost-docker").await;
    equip(&server, &agent, &["docker"], "web").await;
    let generation = agent.session().await;
    let deploy = create(
        &server,
        task(
            agent.id,
            "docker.run",
            json!({"config": {"containerName": "web"}}),
        ),
    )
    .await;
    let check = create(&server, task(agent.id, "inspect", json!({}))).await;
    // The agent's poll no longer lists docker (its engine was removed since the create).
    let a = agent
        .poll_offering(generation, &[])
        .await
        .expect("poll")
        .assignment
        .expect("an assignment");
    assert_eq!(a.task_id, check.id, "the next runnable task is handed out");
    let shown = show(&server, &deploy).await;
    assert_eq!(shown.state, TaskState::Failed);
    assert_eq!(shown.error_code.as_deref(), Some("CAPABILITY_MISSING"));
    assert!(shown.attempts.is_empty(), "never delivered");
    server.stop().await;
}

/// The agent journals a delivery under the assignment's `idempotencyKey` and answers a
/// redelivery from it. That key is the server's: a client naming another task's id (or a
/// read-back's key) in `Idempotency-Key` reaches neither that task's journal entry nor the
/// server's own keys.
#[tokio::test]
async fn journal_keys_are_the_servers_and_clients_cannot_write_internal_keys() {
    let server = start().await;
    let agent = server.agent("journal").await;
    let generation = agent.session().await;
    let admin = server.admin();
    let first = create(&server, task(agent.id, "inspect", json!({}))).await;
    let a1 = assignment(&agent, generation).await;
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(a1.assignment_id, ok(first.id))),
        )
        .await
        .expect("first result");
    let second = admin
        .send_with(
            &task(agent.id, "inspect", json!({})),
            &[(
                berth_proto::headers::IDEMPOTENCY_KEY_HEADER,
                &first.id.to_string(),
            )],
            None,
        )
        .await
        .expect("created with another task's id as its key");
    assert_ne!(second.id, first.id);
    let a2 = assignment(&agent, generation).await;
    assert_eq!(a2.task_id, second.id);
    assert_ne!(a2.idempotency_key, a1.idempotency_key);
    assert_ne!(a2.idempotency_key, first.id.to_string());
    assert!(a2.idempotency_key.contains(&second.id.to_string()));
    // The read-back namespace is the server's.
    let err = admin
        .send_with(
            &task(agent.id, "inspect", json!({})),
            &[(
                berth_proto::headers::IDEMPOTENCY_KEY_HEADER,
                &format!("read-back:{}:1", first.id),
            )],
            None,
        )
        .await
        .unwrap_err();
    assert_eq!(code(&err), (422, "IDEMPOTENCY_KEY_RESERVED".into()));
    server.stop().await;
}

/// What a heartbeat changes, as an operator sees it.
async fn heartbeat_state(
    server: &TestServer,
    agent: &TestAgent,
) -> (
    AgentStatus,
    Option<time::OffsetDateTime>,
    Option<ResourceUsage>,
    serde_json::Value,
) {
    let shown = server
        .admin()
        .send(&GetAgent { id: agent.id })
        .await
        .expect("get agent");
    (
        shown.status,
        shown.last_heartbeat,
        shown.resource_usage,
        serde_json::to_value(&shown.capabilities).unwrap(),
    )
}

/// Signed heartbeats fail closed: a missing signature, a bad one, one by another agent's key, a
/// replayed sequence and a body signed for another generation are each refused with their own
/// code, and none changes the agent's status, last heartbeat, resources or capabilities.
#[tokio::test]
async fn unsigned_forged_and_replayed_heartbeats_are_refused_and_change_nothing() {
    let server = start().await;
    let agent = server.agent("beater").await;
    let other = server.agent("other").await;
    let generation = agent.go_online().await;
    let g = generation.to_string();
    // Everything a heartbeat can change, changed: were any of these applied, it would show.
    let body = |sequence: u64, generation: i64| Heartbeat {
        agent_id: agent.id,
        status: AgentStatus::Degraded,
        resource_usage: ResourceUsage {
            cpu_percent: 99.0,
            cpu_cores: 64,
            ..Default::default()
        },
        capabilities: vec![berth_proto::agent::Capability {
            name: "docker".into(),
            version: None,
            healthy: false,
            detail: Some("forged".into()),
        }],
        generation,
        sequence,
        signature_algorithm: berth_proto::transport::ALG_ECDSA_SHA256.into(),
        signature: None,
    };
    let send = |heartbeat: serde_json::Value| {
        let (client, g) = (server.raw(Some(&agent.identity())), g.clone());
        let path = format!("{}/api/v1/agents/{}/heartbeat", server.url, agent.id);
        async move {
            let response = client
                .post(path)
                .header(GENERATION_HEADER, g)
                .json(&heartbeat)
                .send()
                .await
                .expect("send");
            let status = response.status().as_u16();
            let body: serde_json::Value = response.json().await.expect("json");
            (status, body["code"].as_str().unwrap_or("").to_string())
        }
    };
    let signed = |h: Heartbeat, key: &AgentKey| {
        serde_json::to_value(common::sign_heartbeat(h, key)).unwrap()
    };
    let before = heartbeat_state(&server, &agent).await;
    assert_eq!(before.0, AgentStatus::Online);

    let seq = common::next_sequence();
    let mut tampered = signed(body(seq, generation), &agent.key);
    tampered["resourceUsage"]["cpuCores"] = json!(65);
    let mut algorithm_swapped = signed(body(seq, generation), &agent.key);
    algorithm_swapped["signatureAlgorithm"] = json!("rsa-sha256");
    let mut not_base64 = signed(body(seq, generation), &agent.key);
    not_base64["signature"] = json!("***");
    let mut empty = signed(body(seq, generation), &agent.key);
    empty["signature"] = json!("");
    let cases: Vec<(&str, serde_json::Value, (u16, &str))> = vec![
        (
            "unsigned",
            serde_json::to_value(body(seq, generation)).unwrap(),
            (422, "SIGNATURE_MISSING"),
        ),
        ("empty signature", empty, (422, "SIGNATURE_MISSING")),
        (
            // Seed 000's heartbeat as an older agent sends it: no sequence, no signature.
            "seed-style",
            json!({"status": "degraded", "resourceUsage": {"cpuPercent": 99.0, "cpuCores": 64,
                "memoryUsedBytes": 0, "memoryTotalBytes": 0, "diskFreeBytes": 0,
                "diskTotalBytes": 0}, "capabilities": []}),
            (422, "SIGNATURE_MISSING"),
        ),
        (
            "tampered after signing",
            tampered,
            (422, "SIGNATURE_INVALID"),
        ),
        (
            "algorithm swapped",
            algorithm_swapped,
            (422, "SIGNATURE_INVALID"),
        ),
        ("not base64", not_base64, (422, "SIGNATURE_INVALID")),
        (
            "another agent's key",
            signed(body(seq, generation), &other.key),
            (422, "SIGNATURE_INVALID"),
        ),
        (
            "a key nobody holds a certificate for",
            signed(body(seq, generation), &AgentKey::generate().unwrap()),
            (422, "SIGNATURE_INVALID"),
        ),
        (
            // Stored as a signed 64-bit integer: above it is refused, never wrapped.
            "sequence above 2^63-1",
            signed(body(u64::MAX, generation), &agent.key),
            (422, "INVALID_REQUEST"),
        ),
        (
            "signed for an earlier generation",
            signed(body(seq, generation - 1), &agent.key),
            (409, "HEARTBEAT_REPLAYED"),
        ),
    ];
    for (name, heartbeat, (status, code)) in cases {
        assert_eq!(send(heartbeat).await, (status, code.to_string()), "{name}");
        assert_eq!(
            heartbeat_state(&server, &agent).await,
            before,
            "{name} changed the agent"
        );
    }

    // A valid heartbeat applies; the same bytes again, and a properly signed lower sequence,
    // are replays and change nothing (not even the last heartbeat time).
    let valid = signed(body(seq, generation), &agent.key);
    assert_eq!(send(valid.clone()).await, (200, String::new()));
    let applied = heartbeat_state(&server, &agent).await;
    assert_eq!(applied.0, AgentStatus::Degraded);
    assert_ne!(applied, before);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut lower = body(seq - 1, generation);
    lower.status = AgentStatus::Online;
    for (name, heartbeat) in [("same bytes", valid), ("lower", signed(lower, &agent.key))] {
        assert_eq!(
            send(heartbeat).await,
            (409, "HEARTBEAT_REPLAYED".to_string()),
            "{name}"
        );
        assert_eq!(
            heartbeat_state(&server, &agent).await,
            applied,
            "{name} changed"
        );
    }
    // Concurrent copies of one new heartbeat: exactly one applies.
    let next = signed(body(common::next_sequence(), generation), &agent.key);
    let answers = futures_util::future::join_all((0..8).map(|_| send(next.clone()))).await;
    let ok = answers.iter().filter(|a| a.0 == 200).count();
    assert_eq!(ok, 1, "{answers:?}");
    assert!(answers
        .iter()
        .all(|a| a.0 == 200 || *a == (409, "HEARTBEAT_REPLAYED".to_string())));
    // The agent goes on with higher sequences.
    agent
        .heartbeat(generation, common::next_sequence())
        .await
        .expect("the next heartbeat applies");
    assert_eq!(
        heartbeat_state(&server, &agent).await.0,
        AgentStatus::Online
    );
    server.stop().await;
}

/// Seed 000's unsigned `complete` is refused with `SIGNED_RESULT_REQUIRED`, naming the signed
/// result endpoint, and records nothing; it still needs the agent's own bound certificate.
#[tokio::test]
async fn the_legacy_unsigned_complete_is_refused_and_records_nothing() {
    let server = start().await;
    let agent = server.agent("legacy").await;
    let other = server.agent("someone-else").await;
    let generation = agent.session().await;
    let t = create(&server, task(agent.id, "inspect", json!({}))).await;
    let a = assignment(&agent, generation).await;
    assert_eq!(a.task_id, t.id);
    let before = show(&server, &t).await;
    let path = format!(
        "{}/api/v1/agents/{}/tasks/{}/complete",
        server.url, agent.id, t.id
    );
    let seed_body = json!({"success": true, "result": {"healthy": true}, "logs": "ok"});
    let post = |identity: Option<berth_client::Identity>| {
        let client = server.raw(identity.as_ref());
        let (path, body) = (path.clone(), seed_body.clone());
        async move {
            let response = client
                .post(path)
                .header(GENERATION_HEADER, generation.to_string())
                .json(&body)
                .send()
                .await
                .expect("send");
            let status = response.status().as_u16();
            let body: serde_json::Value = response.json().await.expect("json");
            (status, body)
        }
    };
    let (status, body) = post(Some(agent.identity())).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (422, Some("SIGNED_RESULT_REQUIRED"))
    );
    let endpoint = format!(
        "/api/v1/release-orchestrator/agent-runtime/agents/{}/tasks/{}/result",
        agent.id, t.id
    );
    assert!(
        body["detail"].as_str().unwrap().contains(&endpoint),
        "{body}"
    );
    // Without the agent's certificate, or with another agent's, the usual refusals.
    let (status, body) = post(None).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (401, Some("CLIENT_CERT_REQUIRED"))
    );
    let (status, body) = post(Some(other.identity())).await;
    assert_eq!(
        (status, body["code"].as_str()),
        (403, Some("CERT_BINDING_MISMATCH"))
    );
    let after = show(&server, &t).await;
    assert_eq!(after.state, TaskState::Leased);
    assert_eq!(
        serde_json::to_value(&after.attempts).unwrap(),
        serde_json::to_value(&before.attempts).unwrap(),
        "nothing recorded"
    );
    // The signed path still takes the result.
    let envelope = agent.sign(agent.envelope(a.assignment_id, ok(t.id)));
    agent
        .submit(generation, envelope)
        .await
        .expect("signed result");
    assert_eq!(show(&server, &t).await.state, TaskState::Succeeded);
    server.stop().await;
}

/// Issue 14 items 4 and 5 over the API: holds are admin-only; a cordoned agent gets no task
/// (409 AGENT_CORDONED) but still runs what it has; a suspended agent's poll gets nothing until
/// it is resumed; the queue cap answers 429 QUEUE_FULL with Retry-After.
#[tokio::test]
async fn holds_and_the_queue_cap() {
    use berth_proto::admin::{CreateApiToken, Role};
    use berth_proto::agent::{AgentHold, HoldAgent};
    let server = start_with(|c| {
        c.long_poll = Duration::from_millis(300);
        c.max_open_tasks_per_agent = 2;
    })
    .await;
    let admin = server.admin();
    let agent = server.agent("held").await;
    let generation = agent.go_online().await;
    let hold = |h| HoldAgent {
        id: agent.id,
        hold: h,
    };

    let deployer = admin
        .send(&CreateApiToken {
            role: Role::Deployer,
            name: None,
        })
        .await
        .unwrap();
    let err = server
        .client(Some(&deployer.token), None)
        .send(&hold(AgentHold::Cordon))
        .await
        .unwrap_err();
    assert_eq!(code(&err), (403, "FORBIDDEN".into()));

    let queued = create(&server, task(agent.id, "inspect", json!({}))).await;
    let cordoned = admin.send(&hold(AgentHold::Cordon)).await.unwrap();
    assert!(cordoned.cordoned);
    let err = admin
        .send(&task(agent.id, "inspect", json!({})))
        .await
        .unwrap_err();
    assert_eq!(code(&err), (409, "AGENT_CORDONED".into()));
    let got = agent
        .poll(generation)
        .await
        .unwrap()
        .assignment
        .expect("its queue still runs");
    assert_eq!(got.task_id, queued.id);
    admin.send(&hold(AgentHold::Uncordon)).await.unwrap();

    let suspended = admin.send(&hold(AgentHold::Suspend)).await.unwrap();
    assert_eq!(suspended.status, AgentStatus::Blocked);
    // `blocked` is the server's word for a suspension; an agent cannot claim it of itself.
    let g = generation.to_string();
    let blocked = common::sign_heartbeat(
        Heartbeat {
            agent_id: agent.id,
            status: AgentStatus::Blocked,
            resource_usage: ResourceUsage::default(),
            capabilities: vec![],
            generation,
            sequence: common::next_sequence(),
            signature_algorithm: berth_proto::transport::ALG_ECDSA_SHA256.into(),
            signature: None,
        },
        &agent.key,
    );
    let err = agent
        .client
        .send_with(&blocked, &[(GENERATION_HEADER, &g)], None)
        .await
        .unwrap_err();
    assert_eq!(code(&err), (422, "INVALID_REQUEST".into()));
    agent
        .heartbeat(generation, common::next_sequence())
        .await
        .expect("a suspended agent keeps heartbeating");
    let waiting = create(&server, task(agent.id, "inspect", json!({}))).await;
    assert!(
        agent.poll(generation).await.unwrap().assignment.is_none(),
        "a suspended agent claims nothing"
    );
    admin.send(&hold(AgentHold::Resume)).await.unwrap();

    // Two open (the leased one and the waiting one): the cap of 2 is reached.
    let raw = server
        .raw(None)
        .post(format!("{}/api/v1/tasks", server.url))
        .bearer_auth(&server.admin_token)
        .json(&json!({"type": "inspect", "agentId": agent.id, "payload": {}}))
        .send()
        .await
        .unwrap();
    assert_eq!(raw.status().as_u16(), 429);
    assert_eq!(
        raw.headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok()),
        Some("10")
    );
    let body: serde_json::Value = raw.json().await.unwrap();
    assert_eq!(body["code"], "QUEUE_FULL");

    let got = agent
        .poll(generation)
        .await
        .unwrap()
        .assignment
        .expect("resumed");
    assert_eq!(got.task_id, waiting.id);
}
