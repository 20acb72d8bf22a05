//! Readiness through the API with a test agent (issue 14 items 1-2): `verify` answers a nonce,
//! the reconciler's pass queues a `readiness-probe` for the target, the pass stays open (the
//! nonce not echoed) while the probe is not done, and the signed result closes it: every
//! condition terminal, `verifyObserved` the nonce, `operationalReady` true. A second verify is
//! a fresh pass with a probe of its own.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use berth_client::ClientError;
use berth_proto::agent::UpdateAgent;
use berth_proto::deploy::{CreateEnvironment, Tier};
use berth_proto::readiness::{
    ConditionStatus, ConditionType, EnvironmentReadiness, GetReadiness, VerifyEnvironment,
};
use berth_proto::transport::AgentTaskAssignment;
use berth_test_utils::wait_until;
use common::{next_sequence, ok, start, TestAgent};

fn code(e: &ClientError) -> (u16, String) {
    match e {
        ClientError::Api { status, body, .. } => (*status, body.code.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn probe_assignment(agent: &TestAgent, generation: i64) -> AgentTaskAssignment {
    for _ in 0..3 {
        if let Some(a) = agent.poll(generation).await.expect("poll").assignment {
            return a;
        }
    }
    panic!("no probe assignment");
}

async fn readiness(client: &berth_client::Client) -> EnvironmentReadiness {
    client
        .send(&GetReadiness { name: "qa".into() })
        .await
        .expect("readiness")
}

#[tokio::test]
async fn verify_waits_for_the_probe_and_echoes_the_nonce() {
    let server = start().await;
    let admin = server.admin();
    admin
        .send(&CreateEnvironment {
            name: "qa".into(),
            tier: Tier::Qa,
            selector: BTreeMap::from([("env".to_string(), "qa".to_string())]),
            target_type: Default::default(),
            policy: Default::default(),
            promote_from: None,
            approvals: None,
            auto_heal: false,
            drift_interval_secs: None,
        })
        .await
        .expect("create environment");
    let missing = admin
        .send(&VerifyEnvironment {
            name: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(code(&missing), (404, "ENVIRONMENT_NOT_FOUND".into()));

    let agent = std::sync::Arc::new(server.agent("qa-1").await);
    let generation = agent.go_online().await;
    // The test server's heartbeat interval is 1 s; a target is reachable for three of them.
    let beating = agent.clone();
    let heartbeats = tokio::spawn(async move {
        loop {
            let _ = beating.heartbeat(generation, next_sequence()).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    admin
        .send(&UpdateAgent {
            id: agent.id,
            labels: Some(BTreeMap::from([("env".to_string(), "qa".to_string())])),
            capabilities: None,
        })
        .await
        .expect("label");

    let nonce = admin
        .send(&VerifyEnvironment { name: "qa".into() })
        .await
        .expect("verify")
        .nonce;
    let probe = probe_assignment(&agent, generation).await;
    assert_eq!(probe.task_type, "readiness-probe");
    // The pass waits for the probe: Unknown, the nonce not echoed. (The probe can reach the
    // agent before the pass that queued it is written.)
    wait_until(Duration::from_secs(30), "the pass written", || async {
        !readiness(&admin).await.conditions.is_empty()
    })
    .await;
    let open = readiness(&admin).await;
    assert_eq!(open.verify_request.as_deref(), Some(nonce.as_str()));
    assert_ne!(open.verify_observed.as_deref(), Some(nonce.as_str()));
    assert!(!open.operational_ready);
    let routes = open
        .conditions
        .iter()
        .find(|c| c.kind == ConditionType::RoutesExecutable)
        .expect("RoutesExecutable");
    assert_eq!(routes.status, ConditionStatus::Unknown, "{open:?}");
    assert_eq!(routes.reason, "PROBE_PENDING");

    let result = ok(probe.task_id);
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(probe.assignment_id, result)),
        )
        .await
        .expect("submit");
    wait_until(Duration::from_secs(30), "the nonce echoed", || async {
        readiness(&admin).await.verify_observed.as_deref() == Some(nonce.as_str())
    })
    .await;
    let done = readiness(&admin).await;
    assert!(done.operational_ready, "{done:?}");
    let kinds: Vec<ConditionType> = done.conditions.iter().map(|c| c.kind).collect();
    assert_eq!(kinds, ConditionType::ALL);
    assert!(done
        .conditions
        .iter()
        .all(|c| c.status == ConditionStatus::True && c.generation == done.generation));

    // A second verify runs a fresh pass: a new probe, nothing reused.
    let again = admin
        .send(&VerifyEnvironment { name: "qa".into() })
        .await
        .expect("verify")
        .nonce;
    assert_ne!(again, nonce);
    let second = probe_assignment(&agent, generation).await;
    assert_ne!(second.task_id, probe.task_id);
    agent
        .submit(
            generation,
            agent.sign(agent.envelope(second.assignment_id, ok(second.task_id))),
        )
        .await
        .expect("submit");
    wait_until(
        Duration::from_secs(30),
        "the second nonce echoed",
        || async { readiness(&admin).await.verify_observed.as_deref() == Some(again.as_str()) },
    )
    .await;
    heartbeats.abort();
    server.stop().await;
}
