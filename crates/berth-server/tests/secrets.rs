//! Builtin secrets and deploy grants over real TLS: the admin API never echoes a value and never
//! stores one in clear; the kit supersedes earlier grants (the JWKS shrinks); the lease and the
//! `builtin` KV read, and every way past them tried: no lease, a superseded, expired or foreign
//! one, another environment's path.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use berth_proto::agent::UpdateAgent;
use berth_proto::deploy::{CreateEnvironment, Tier};
use berth_proto::desired::{KitView, LeaseResponse, SecretVersionView, LEASE_HEADER};
use serde_json::{json, Value};

const VALUE: &str = "correct-horse-battery-staple-7f3a";
const VALUE_2: &str = "second-version-value-9c1e";

struct Http {
    client: reqwest::Client,
    url: String,
    bearer: Option<String>,
}

impl Http {
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> (u16, String) {
        let mut req = self.client.request(method, format!("{}{path}", self.url));
        if let Some(b) = &self.bearer {
            req = req.bearer_auth(b);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req.send().await.expect("send");
        let status = resp.status().as_u16();
        (status, resp.text().await.expect("body"))
    }
}

fn code(body: &str) -> String {
    serde_json::from_str::<Value>(body).expect("json")["code"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn admin(server: &common::TestServer) -> Http {
    Http {
        client: server.raw(None),
        url: server.url.clone(),
        bearer: Some(server.admin_token.clone()),
    }
}

async fn environment(server: &common::TestServer, name: &str) {
    server
        .admin()
        .send(&CreateEnvironment {
            name: name.to_string(),
            tier: Tier::Qa,
            selector: BTreeMap::from([("env".to_string(), name.to_string())]),
            target_type: Default::default(),
            policy: Default::default(),
            promote_from: None,
            approvals: None,
            auto_heal: false,
            drift_interval_secs: None,
        })
        .await
        .expect("create environment");
}

/// An agent carrying the label of environment `env`, with a raw mTLS client.
async fn agent_in(server: &common::TestServer, name: &str, env: &str) -> Http {
    let agent = server.agent(name).await;
    server
        .admin()
        .send(&UpdateAgent {
            id: agent.id,
            labels: Some(BTreeMap::from([("env".to_string(), env.to_string())])),
            capabilities: None,
        })
        .await
        .expect("label agent");
    Http {
        client: server.raw(Some(&agent.identity())),
        url: server.url.clone(),
        bearer: None,
    }
}

async fn put(http: &Http, path: &str, body: Value) -> (u16, String) {
    http.call(
        reqwest::Method::PUT,
        &format!("/api/v1/secrets/{path}"),
        Some(body),
        &[],
    )
    .await
}

async fn jwks_kids(http: &Http) -> Vec<String> {
    let (status, body) = http
        .call(
            reqwest::Method::GET,
            "/.well-known/agent-jwks.json",
            None,
            &[],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    doc["keys"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["kid"].as_str().unwrap().to_string())
        .collect()
}

fn claims(jwt: &str) -> Value {
    let payload = jwt.split('.').nth(1).unwrap();
    serde_json::from_slice(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(payload)
            .unwrap(),
    )
    .unwrap()
}

fn grep_files(dir: &std::path::Path, needle: &str) -> Vec<String> {
    let mut hits = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            let bytes = std::fs::read(&path).unwrap();
            if bytes.windows(needle.len()).any(|w| w == needle.as_bytes()) {
                hits.push(path.display().to_string());
            }
        }
    }
    hits
}

#[tokio::test]
async fn secret_admin_api_never_echoes_or_stores_a_value() {
    let server = common::start().await;
    let http = admin(&server);

    let (status, body) = put(&http, "qa/see/pg", json!({"value": VALUE})).await;
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains(VALUE));
    let v: SecretVersionView = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v.path.as_str(), v.version, v.deleted),
        ("qa/see/pg", 1, false)
    );

    let (status, body) = put(&http, "qa/see/pg", json!({"generate": true})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<SecretVersionView>(&body)
            .unwrap()
            .version,
        2
    );
    put(&http, "qa/see/api", json!({"value": VALUE_2})).await;

    // Exactly one of value and generate; a path that is not `<env>/<name>`.
    for bad in [json!({}), json!({"value": "x", "generate": true})] {
        let (status, body) = put(&http, "qa/see/x", bad).await;
        assert_eq!(
            (status, code(&body).as_str()),
            (422, "INVALID_REQUEST"),
            "{body}"
        );
    }
    let (status, _) = put(&http, "data/qa/x", json!({"value": "x"})).await;
    assert_eq!(status, 422);

    let (status, body) = http
        .call(
            reqwest::Method::GET,
            "/api/v1/secrets?prefix=qa/see/",
            None,
            &[],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let listed: Vec<SecretVersionView> = serde_json::from_str(&body).unwrap();
    let listed: Vec<_> = listed
        .iter()
        .map(|v| (v.path.as_str(), v.version))
        .collect();
    assert_eq!(listed, vec![("qa/see/api", 1), ("qa/see/pg", 2)]);

    let (status, body) = http
        .call(
            reqwest::Method::GET,
            "/api/v1/secrets/qa/see/pg/versions",
            None,
            &[],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        serde_json::from_str::<Vec<SecretVersionView>>(&body)
            .unwrap()
            .len(),
        2
    );

    // The audit log names paths and versions, never values.
    let (_, audit) = http
        .call(reqwest::Method::GET, "/api/v1/audit", None, &[])
        .await;
    assert!(audit.contains("secret.put"), "{audit}");
    assert!(!audit.contains(VALUE) && !audit.contains(VALUE_2));

    // Nothing on disk holds a value in clear: the database, its WAL, anything in the data dir.
    let data = server.dir.path().join("data");
    assert!(grep_files(&data, VALUE).is_empty());
    assert!(grep_files(&data, VALUE_2).is_empty());
    assert!(
        !grep_files(&data, "qa/see/pg").is_empty(),
        "the path itself is stored"
    );

    let (status, _) = http
        .call(
            reqwest::Method::DELETE,
            "/api/v1/secrets/qa/see/pg",
            None,
            &[],
        )
        .await;
    assert_eq!(status, 200);
    let (status, body) = http
        .call(
            reqwest::Method::DELETE,
            "/api/v1/secrets/qa/see/pg",
            None,
            &[],
        )
        .await;
    assert_eq!((status, code(&body).as_str()), (404, "SECRET_NOT_FOUND"));
    let (_, body) = http
        .call(
            reqwest::Method::GET,
            "/api/v1/secrets/qa/see/pg/versions",
            None,
            &[],
        )
        .await;
    let versions: Vec<SecretVersionView> = serde_json::from_str(&body).unwrap();
    assert!(versions.iter().all(|v| v.deleted));
    server.stop().await;
}

#[tokio::test]
async fn kit_lease_and_builtin_reads() {
    let clock = Arc::new(berth_server::ManualClock::new());
    let server = {
        let clock = clock.clone();
        common::start_with(move |c| c.clock = clock).await
    };
    let http = admin(&server);
    environment(&server, "qa").await;
    environment(&server, "prod").await;
    let agent = agent_in(&server, "qa-1", "qa").await;
    put(&http, "qa/see/pg", json!({"value": VALUE})).await;
    put(&http, "qa/see/pg", json!({"value": VALUE_2})).await;
    put(&http, "prod/see/pg", json!({"value": "prod-value"})).await;

    // The kit: one grant, its key in the JWKS; a second kit supersedes the first.
    let server_keys = jwks_kids(&http).await.len();
    let (status, body) = http
        .call(
            reqwest::Method::POST,
            "/api/v1/environments/qa/kit",
            None,
            &[],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let kit1: KitView = serde_json::from_str(&body).unwrap();
    let c = claims(&kit1.grant);
    assert_eq!(c["aud"], "openbao-see-env");
    assert_eq!(c["kind"], "deploy-grant");
    assert_eq!(c["sub"], "agent:qa");
    assert_eq!(c["env_id"], "qa");
    assert_eq!(c["jti"], kit1.jti.as_str());
    assert_eq!(c["iss"], "berth");
    assert_eq!(
        c["exp"].as_i64().unwrap() - c["iat"].as_i64().unwrap(),
        3600
    );
    assert!(!kit1.install_command.contains('\n'));
    assert!(kit1
        .install_command
        .contains("--bootstrap-file /etc/berth-agent/bootstrap.jwt"));
    assert!(kit1.install_command.contains("<<< '"));
    assert!(jwks_kids(&http).await.contains(&kit1.jti));
    let (_, body) = http
        .call(
            reqwest::Method::POST,
            "/api/v1/environments/qa/kit",
            None,
            &[],
        )
        .await;
    let kit2: KitView = serde_json::from_str(&body).unwrap();
    let kids = jwks_kids(&http).await;
    assert!(kids.contains(&kit2.jti) && !kids.contains(&kit1.jti));
    assert_eq!(kids.len(), server_keys + 1);
    let (_, audit) = http
        .call(reqwest::Method::GET, "/api/v1/audit", None, &[])
        .await;
    assert!(audit.contains("environment.kit") && !audit.contains(&kit2.grant));

    // The lease: builtin shape; not for another environment.
    let (status, body) = agent
        .call(
            reqwest::Method::POST,
            "/v1/agent/lease",
            Some(json!({"env_id": "qa", "reason": "apply", "future": 1})),
            &[],
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let lease: LeaseResponse = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (
            lease.env_id.as_str(),
            lease.mount.as_str(),
            lease.role.as_str(),
            lease.ttl_s
        ),
        ("qa", "builtin", "", 3600)
    );
    assert_eq!(
        lease.addr,
        format!("https://localhost:{}", server.addr.port())
    );
    let (status, body) = agent
        .call(
            reqwest::Method::POST,
            "/api/v1/agent/lease",
            Some(json!({"env_id": "prod"})),
            &[],
        )
        .await;
    assert_eq!((status, code(&body).as_str()), (403, "AGENT_ENV_MISMATCH"));

    let read = |path: String, lease: Option<String>| {
        let agent = &agent;
        async move {
            let headers: Vec<(&str, &str)> = lease
                .as_deref()
                .map(|l| vec![(LEASE_HEADER, l)])
                .unwrap_or_default();
            agent
                .call(reqwest::Method::GET, &path, None, &headers)
                .await
        }
    };
    let value_of = |body: &str| {
        let doc: Value = serde_json::from_str(body).unwrap();
        (
            doc["data"]["data"]["value"].as_str().unwrap().to_string(),
            doc["data"]["metadata"]["version"].as_u64().unwrap(),
        )
    };
    let jwt = Some(lease.login_jwt.clone());
    // Both path forms, latest and a version, under both prefixes.
    let (status, body) = read("/v1/agent/kv/monky/qa/see/pg".into(), jwt.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(value_of(&body), (VALUE_2.to_string(), 2));
    let (status, body) = read(
        "/api/v1/agent/kv/monky/data/qa/see/pg?version=1".into(),
        jwt.clone(),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(value_of(&body), (VALUE.to_string(), 1));
    let (status, body) = read("/v1/agent/kv/monky/data/qa/see/nope".into(), jwt.clone()).await;
    assert_eq!((status, code(&body).as_str()), (404, "SECRET_NOT_FOUND"));

    // Another environment's path, even with a valid lease.
    let (status, body) = read("/v1/agent/kv/monky/prod/see/pg".into(), jwt.clone()).await;
    assert_eq!((status, code(&body).as_str()), (403, "AGENT_ENV_MISMATCH"));

    // No lease; the kit grant instead of a lease; a JWT signed by a foreign key, under the
    // lease's own kid and claims.
    let (status, body) = read("/v1/agent/kv/monky/qa/see/pg".into(), None).await;
    assert_eq!((status, code(&body).as_str()), (401, "LEASE_REQUIRED"));
    let (status, body) = read(
        "/v1/agent/kv/monky/qa/see/pg".into(),
        Some(kit2.grant.clone()),
    )
    .await;
    assert_eq!((status, code(&body).as_str()), (401, "LEASE_REQUIRED"));
    let forged = forge(&lease.login_jwt);
    let (status, body) = read("/v1/agent/kv/monky/qa/see/pg".into(), Some(forged)).await;
    assert_eq!((status, code(&body).as_str()), (401, "LEASE_REQUIRED"));
    let (status, _) = read("/v1/agent/kv/monky/qa/see/pg".into(), Some("x.y.z".into())).await;
    assert_eq!(status, 401);

    // A new kit supersedes the lease.
    http.call(
        reqwest::Method::POST,
        "/api/v1/environments/qa/kit",
        None,
        &[],
    )
    .await;
    let (status, body) = read("/v1/agent/kv/monky/qa/see/pg".into(), jwt.clone()).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (401, "LEASE_REQUIRED"),
        "{body}"
    );
    assert!(!jwks_kids(&http).await.contains(
        &claims(&lease.login_jwt)["jti"]
            .as_str()
            .unwrap()
            .to_string()
    ));

    // A fresh lease works until it expires.
    let (_, body) = agent
        .call(
            reqwest::Method::POST,
            "/v1/agent/lease",
            Some(json!({"env_id": "qa"})),
            &[],
        )
        .await;
    let fresh: LeaseResponse = serde_json::from_str(&body).unwrap();
    let fresh = Some(fresh.login_jwt);
    let (status, _) = read("/v1/agent/kv/monky/qa/see/pg".into(), fresh.clone()).await;
    assert_eq!(status, 200);
    clock.advance(Duration::from_secs(3601));
    let (status, body) = read("/v1/agent/kv/monky/qa/see/pg".into(), fresh).await;
    assert_eq!((status, code(&body).as_str()), (401, "LEASE_REQUIRED"));
    server.stop().await;
}

/// The lease's header and claims, signed by a key berth never saw.
fn forge(jwt: &str) -> String {
    let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header: Value =
        serde_json::from_slice(&engine.decode(jwt.split('.').next().unwrap()).unwrap()).unwrap();
    let signed = berth_crypto::JwtSigner::generate()
        .unwrap()
        .sign(&claims(jwt))
        .unwrap();
    let mut parts = signed.split('.');
    let _ = parts.next();
    format!(
        "{}.{}.{}",
        engine.encode(serde_json::to_vec(&header).unwrap()),
        parts.next().unwrap(),
        parts.next().unwrap()
    )
}
