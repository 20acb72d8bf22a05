//! Seed 001's desired-state loop over real TLS: an admin pushes a bundle and sets it desired,
//! an agent (client certificate) checks in, fetches the bundle and reports; environments of
//! other selectors or tenants are refused alike; rate buckets per environment on the injected
//! clock.

mod common;

use std::sync::Arc;
use std::time::Duration;

use berth_client::Identity;
use berth_proto::admin::{CreateAgentToken, CreateTenant};
use berth_proto::agent::DeleteAgent;
use berth_proto::audit::{actions, ListAudit};
use berth_proto::desired::{AUDIT_LOG_TAIL_BYTES, MAX_LOG_TAIL_BYTES};
use berth_server::ManualClock;
use serde_json::{json, Value};

use common::{TestAgent, TestServer};

const ENV: &str = "env-qa-02";

fn tar(files: &[(&str, &str)]) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    for (name, content) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(content.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        builder
            .append_data(&mut header, name, content.as_bytes())
            .expect("append");
    }
    builder.into_inner().expect("tar")
}

/// The seed's sha, computed here independently of the server.
fn seed_sha(files: &[(&str, &str)]) -> String {
    let mut sorted = files.to_vec();
    sorted.sort();
    let mut input = Vec::new();
    for (name, content) in sorted {
        input.extend_from_slice(name.as_bytes());
        input.push(0);
        input.extend_from_slice(content.as_bytes());
        input.push(0);
    }
    berth_crypto::sha256_hex(&input)
}

const BUNDLE: &[(&str, &str)] = &[
    (
        "docker-compose.yml",
        "services:\n  web:\n    image: nginx\n",
    ),
    (".env.template", "A=${A}\n"),
    (
        "secrets.manifest.json",
        "{\"vault_mode\":\"builtin\",\"entries\":[]}",
    ),
    (
        "bundle.json",
        "{\"env_id\":\"env-qa-02\",\"renderer\":\"compose\"}",
    ),
];

async fn start(clock: &Arc<ManualClock>) -> TestServer {
    let clock = clock.clone();
    common::start_with(move |c| c.clock = clock).await
}

async fn agent_labelled(server: &TestServer, bearer: &str, name: &str, env: &str) -> TestAgent {
    let token = server
        .client(Some(bearer), None)
        .send(&CreateAgentToken {
            labels: Some([("env".to_string(), env.to_string())].into()),
            environment: None,
            expires_in_seconds: None,
        })
        .await
        .expect("token");
    server
        .agent_with_token(name, &token.token)
        .await
        .expect("register")
}

async fn create_env(server: &TestServer, bearer: &str, name: &str, selector: &str) {
    let r = server
        .raw(None)
        .post(format!("{}/api/v1/environments", server.url))
        .bearer_auth(bearer)
        .json(&json!({"name": name, "tier": "qa", "selector": {"env": selector}}))
        .send()
        .await
        .expect("create env");
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap_or_default());
}

/// (status, body, headers) of an agent call.
async fn agent_call(
    server: &TestServer,
    identity: &Identity,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value, reqwest::header::HeaderMap) {
    let mut request = server
        .raw(Some(identity))
        .request(method, format!("{}{path}", server.url));
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    let headers = response.headers().clone();
    let bytes = response.bytes().await.expect("body");
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, body, headers)
}

async fn admin_call(
    server: &TestServer,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut request = server
        .raw(None)
        .request(method, format!("{}{path}", server.url))
        .bearer_auth(&server.admin_token);
    if let Some(body) = body {
        request = request.json(&body);
    }
    let response = request.send().await.expect("send");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

async fn push(server: &TestServer, env: &str, bytes: Vec<u8>) -> (u16, Value) {
    let response = server
        .raw(None)
        .post(format!("{}/api/v1/environments/{env}/bundles", server.url))
        .bearer_auth(&server.admin_token)
        .header("content-type", "application/x-tar")
        .body(bytes)
        .send()
        .await
        .expect("push");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

fn checkin(env: &str, applied: Option<&str>) -> Value {
    json!({"env_id": env, "agent_version": "0.1.0", "applied_sha": applied,
           "host": {"hostname": "h1", "docker": "28.3.0", "future_field": 1},
           "containers": [{"name": "web", "state": "running", "health": "healthy"}],
           "unknown": true})
}

#[tokio::test]
async fn the_desired_state_loop() {
    let clock = Arc::new(ManualClock::new());
    let server = start(&clock).await;
    let admin_token = server.admin_token.clone();
    create_env(&server, &admin_token, ENV, ENV).await;
    let agent = agent_labelled(&server, &admin_token, "qa-host", ENV).await;
    let id = agent.identity();
    let post = reqwest::Method::POST;
    let get = reqwest::Method::GET;

    // Nothing desired yet: a heartbeat.
    let (status, body, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/checkin",
        Some(checkin(ENV, None)),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["action"], "none");
    assert_eq!(body["desired_sha"], Value::Null);
    assert_eq!(body["checkin_interval_s"], 60);
    assert_eq!(body["env_id"], ENV);

    // Push: the server computes the seed's sha; again is idempotent.
    let sha = seed_sha(BUNDLE);
    let (status, view) = push(&server, ENV, tar(BUNDLE)).await;
    assert_eq!(status, 201, "{view}");
    assert_eq!(view["sha"], sha.as_str());
    let (status, again) = push(&server, ENV, tar(BUNDLE)).await;
    assert_eq!((status, &again["sha"]), (200, &view["sha"]));
    let (status, list) = admin_call(
        &server,
        get.clone(),
        &format!("/api/v1/environments/{ENV}/bundles"),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(list.as_array().map(Vec::len), Some(1));
    let (status, refused) = push(&server, ENV, tar(&[("README", "no compose")])).await;
    assert_eq!(
        (status, refused["code"].as_str()),
        (422, Some("BUNDLE_INVALID"))
    );

    // Only a pushed sha can be desired.
    let (status, err) = admin_call(
        &server,
        reqwest::Method::PUT,
        &format!("/api/v1/environments/{ENV}/desired"),
        Some(json!({"sha": "f".repeat(64)})),
    )
    .await;
    assert_eq!(
        (status, err["code"].as_str()),
        (404, Some("BUNDLE_NOT_FOUND"))
    );
    let (status, state) = admin_call(
        &server,
        reqwest::Method::PUT,
        &format!("/api/v1/environments/{ENV}/desired"),
        Some(json!({"sha": sha})),
    )
    .await;
    assert_eq!(status, 200, "{state}");
    assert_eq!(state["desiredSha"], sha.as_str());

    // Checkin (the /api prefix this time): apply, with the bundle's URL.
    let (status, body, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/api/v1/agent/checkin",
        Some(checkin(ENV, None)),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["action"], "apply");
    assert_eq!(body["bundle_url"], format!("/v1/agent/bundle/{ENV}/{sha}"));

    // The bundle, at both prefixes, with the seed's headers.
    for prefix in ["", "/api"] {
        let response = server
            .raw(Some(&id))
            .get(format!(
                "{}{prefix}/v1/agent/bundle/{ENV}/{sha}",
                server.url
            ))
            .send()
            .await
            .expect("bundle");
        assert_eq!(response.status(), 200);
        let h = response.headers();
        assert_eq!(h["content-type"], "application/x-tar");
        assert_eq!(h["cache-control"], "no-store");
        assert_eq!(h["x-bundle-sha"], sha.as_str());
        assert_eq!(h["x-bundle-sha256"], sha.as_str());
        assert_eq!(response.bytes().await.expect("bytes").to_vec(), tar(BUNDLE));
    }
    for missing in ["e".repeat(64), "not-a-sha".to_string()] {
        let (status, err, _) = agent_call(
            &server,
            &id,
            get.clone(),
            &format!("/v1/agent/bundle/{ENV}/{missing}"),
            None,
        )
        .await;
        assert_eq!(
            (status, err["code"].as_str()),
            (404, Some("BUNDLE_NOT_FOUND"))
        );
    }

    // Reports: applied sets the sha, failed keeps it, down clears it.
    let report = |result: &str, log_tail: String, detail: Option<&str>| {
        json!({"env_id": ENV, "sha": sha, "result": result, "log_tail": log_tail,
               "containers": [{"name": "web", "state": "running"}], "detail": detail, "x": 1})
    };
    let (status, body, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/report",
        Some(report("applied", "INFO applied".into(), None)),
    )
    .await;
    assert_eq!((status, &body["recorded"]), (200, &json!(true)), "{body}");
    let (_, state) = admin_call(
        &server,
        get.clone(),
        &format!("/api/v1/environments/{ENV}/desired"),
        None,
    )
    .await;
    let agent_key = format!("agent:{}", agent.id);
    assert_eq!(state["agents"][0]["agent"], agent_key.as_str());
    assert_eq!(state["agents"][0]["appliedSha"], sha.as_str());
    assert_eq!(state["agents"][0]["lastResult"], "applied");
    assert_eq!(state["agents"][0]["host"]["hostname"], "h1");
    let (_, body, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/checkin",
        Some(checkin(ENV, Some(&sha))),
    )
    .await;
    assert_eq!(body["action"], "none", "converged");

    // A long log tail: cut to 16 KiB at a char boundary, its first 2 KiB audited.
    let long = format!("{}{}", "é".repeat(MAX_LOG_TAIL_BYTES / 2), "x".repeat(100));
    let (status, body, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/api/v1/agent/report",
        Some(report(
            "failed",
            format!("a{long}"),
            Some("ENV_INCOMPLETE: unresolved: A"),
        )),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let (_, state) = admin_call(
        &server,
        get.clone(),
        &format!("/api/v1/environments/{ENV}/desired"),
        None,
    )
    .await;
    assert_eq!(
        state["agents"][0]["appliedSha"],
        sha.as_str(),
        "failed keeps the applied sha"
    );
    assert_eq!(
        state["agents"][0]["detail"],
        "ENV_INCOMPLETE: unresolved: A"
    );
    // Only the audit log is read here: any key opens the store.
    let key = berth_store::PayloadKey::new(berth_crypto::MasterKey::generate());
    let store = berth_store::open(
        &server.dir.path().join("data/berth.db").to_string_lossy(),
        key,
    )
    .await
    .expect("open the server's store");
    let tenant = server
        .admin()
        .send(&ListAudit::default())
        .await
        .expect("audit")
        .items[0]
        .tenant_id;
    let env = store
        .desired_environment(tenant, ENV)
        .await
        .expect("read")
        .expect("env");
    let rows = store.desired_agents(env.id).await.expect("agents");
    let stored = rows[0].log_tail.clone().expect("log tail");
    assert_eq!(
        stored.len(),
        MAX_LOG_TAIL_BYTES - 1,
        "cut before the split 'é'"
    );
    assert!(stored.starts_with("aé"));

    let (status, _, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/report",
        Some(report("down", String::new(), None)),
    )
    .await;
    assert_eq!(status, 200);
    let (_, state) = admin_call(
        &server,
        get.clone(),
        &format!("/api/v1/environments/{ENV}/desired"),
        None,
    )
    .await;
    assert_eq!(
        state["agents"][0]["appliedSha"],
        Value::Null,
        "down clears it"
    );
    let (status, err, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/report",
        Some(json!({"env_id": ENV, "result": "applied"})),
    )
    .await;
    assert_eq!(
        (status, err["code"].as_str()),
        (422, Some("INVALID_REQUEST"))
    );
    let (status, err, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/report",
        Some(json!({"env_id": ENV})),
    )
    .await;
    assert!(matches!(status, 400 | 422), "{status} {err}");
    assert!(err["code"].is_string());

    // Environments this agent may not act for, existing or not, of its tenant or another's:
    // one answer.
    create_env(&server, &admin_token, "env-prod-01", "env-prod-01").await;
    let acme = server
        .admin()
        .send(&CreateTenant {
            name: "acme".into(),
        })
        .await
        .expect("tenant");
    create_env(&server, &acme.admin_token, "acme-env", ENV).await;
    for other in ["env-prod-01", "no-such-env", "acme-env"] {
        let (status, err, _) = agent_call(
            &server,
            &id,
            post.clone(),
            "/v1/agent/checkin",
            Some(checkin(other, None)),
        )
        .await;
        assert_eq!(
            (status, err["code"].as_str()),
            (403, Some("AGENT_ENV_MISMATCH")),
            "{other}"
        );
    }
    let prod_agent = agent_labelled(&server, &admin_token, "prod-host", "env-prod-01").await;
    let (status, err, _) = agent_call(
        &server,
        &prod_agent.identity(),
        post.clone(),
        "/v1/agent/checkin",
        Some(checkin(ENV, None)),
    )
    .await;
    assert_eq!(
        (status, err["code"].as_str()),
        (403, Some("AGENT_ENV_MISMATCH"))
    );

    // Retired: down, with purge_volumes.
    let (status, state) = admin_call(
        &server,
        post.clone(),
        &format!("/api/v1/environments/{ENV}/retire"),
        Some(json!({"purgeVolumes": true})),
    )
    .await;
    assert_eq!((status, &state["retired"]), (200, &json!(true)), "{state}");
    let (_, body, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/checkin",
        Some(checkin(ENV, Some(&sha))),
    )
    .await;
    assert_eq!(
        (&body["action"], &body["purge_volumes"]),
        (&json!("down"), &json!(true))
    );

    // Every write is in the audit chain.
    let audit = server
        .admin()
        .send(&ListAudit::default())
        .await
        .expect("audit");
    let of = |action: &str| {
        audit
            .items
            .iter()
            .filter(|e| e.action == action)
            .collect::<Vec<_>>()
    };
    assert_eq!(of(actions::ENVIRONMENT_SET_DESIRED).len(), 1);
    assert_eq!(of(actions::ENVIRONMENT_RETIRE).len(), 1);
    let reports = of(actions::DESIRED_REPORT);
    assert_eq!(reports.len(), 3);
    assert_eq!(reports[1].details["result"], "failed");
    assert_eq!(reports[1].details["sha"], sha.as_str());
    assert_eq!(
        reports[1].details["detail"],
        "ENV_INCOMPLETE: unresolved: A"
    );
    let audited = reports[1].details["logTail"].as_str().expect("log tail");
    assert!(audited.len() <= AUDIT_LOG_TAIL_BYTES && audited.len() > AUDIT_LOG_TAIL_BYTES - 4);
    assert_eq!(
        serde_json::to_value(&reports[1].actor).expect("actor"),
        json!({"kind": "agent", "id": agent.id})
    );

    // A removed agent is refused.
    server
        .admin()
        .send(&DeleteAgent { id: agent.id })
        .await
        .expect("delete");
    let (status, err, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/checkin",
        Some(checkin(ENV, None)),
    )
    .await;
    assert_eq!(
        (status, err["code"].as_str()),
        (401, Some("AGENT_UNAUTHENTICATED"))
    );
    drop(store);
    server.stop().await;
}

#[tokio::test]
async fn checkins_are_rate_limited_per_environment() {
    let clock = Arc::new(ManualClock::new());
    let server = start(&clock).await;
    let admin_token = server.admin_token.clone();
    create_env(&server, &admin_token, ENV, ENV).await;
    let agent = agent_labelled(&server, &admin_token, "qa-host", ENV).await;
    let id = agent.identity();
    let post = reqwest::Method::POST;
    for n in 0..6 {
        let (status, body, _) = agent_call(
            &server,
            &id,
            post.clone(),
            "/v1/agent/checkin",
            Some(checkin(ENV, None)),
        )
        .await;
        assert_eq!(status, 200, "checkin {n}: {body}");
    }
    let (status, err, headers) = agent_call(
        &server,
        &id,
        post.clone(),
        "/api/v1/agent/checkin",
        Some(checkin(ENV, None)),
    )
    .await;
    assert_eq!((status, err["code"].as_str()), (429, Some("RATE_LIMITED")));
    assert_eq!(headers["retry-after"], "10");
    // Reports have a bucket of their own.
    let (status, _, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/report",
        Some(json!({"env_id": ENV, "result": "down"})),
    )
    .await;
    assert_eq!(status, 200);
    // The typed requests the CLI sends.
    let admin = server.admin();
    let pushed: berth_proto::desired::BundleView = admin
        .post_bytes(
            &berth_proto::desired::bundles_path(ENV),
            "application/x-tar",
            tar(BUNDLE),
        )
        .await
        .expect("push");
    let state = admin
        .send(&berth_proto::desired::PutDesired {
            environment: ENV.into(),
            sha: pushed.sha.clone(),
        })
        .await
        .expect("set desired");
    assert_eq!(state.desired_sha.as_deref(), Some(pushed.sha.as_str()));
    let state = admin
        .send(&berth_proto::desired::RetireEnvironment {
            environment: ENV.into(),
            purge_volumes: false,
        })
        .await
        .expect("retire");
    assert!(state.retired && !state.purge_volumes);
    let state = admin
        .send(&berth_proto::desired::GetDesiredState {
            environment: ENV.into(),
        })
        .await
        .expect("state");
    assert_eq!(state.agents.len(), 1);
    assert_eq!(state.agents[0].last_result.as_deref(), Some("down"));
    clock.advance(Duration::from_secs(10));
    let (status, _, _) = agent_call(
        &server,
        &id,
        post.clone(),
        "/v1/agent/checkin",
        Some(checkin(ENV, None)),
    )
    .await;
    assert_eq!(status, 200, "one more after the interval");
    server.stop().await;
}
