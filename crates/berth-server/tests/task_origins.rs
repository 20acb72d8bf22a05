//! Issue 29 item 2: every origin of a task goes through one path, so every origin honours an
//! operator's cordon and the per-agent queue cap. One real server, a registry of the
//! test's own images, and two test agents: `free`, which runs everything it gets, and `held`,
//! which is cordoned (or whose queue is filled to the cap) and then offered work by each origin:
//! the task API (by id and by selector), a deployment, a drift pass, a readiness probe, a
//! deployment to an SSH target whose via agent is `held`, and a read-back. Afterwards the only
//! task `held` got is the read-back of a task it already had (read-backs pass both holds by
//! design); a deployment waiting on the full queue gets its task once the queue has room.
//!
//! On SQLite, and on PostgreSQL with `BERTH_TEST_POSTGRES_URL`. Needs `BERTH_TEST_REGISTRY` (a plain-HTTP registry on the loopback); without it the tests
//! print SKIP, unless `BERTH_REQUIRE_SERVICES` is set.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use berth_client::{Client, ClientError};
use berth_proto::admin::{CreateApiToken, Role};
use berth_proto::agent::{AgentHold, AgentStatus, Capability, Heartbeat, HoldAgent, UpdateAgent};
use berth_proto::deploy::{
    ApproveDeployment, CreateDeployment, CreateEnvironment, DeploymentState, DeploymentView,
    GetDeployment, RolloutPolicy, TargetPhase, TargetType, Tier,
};
use berth_proto::payload::{HookConfig, SSH_PRIVATE_KEY_CREDENTIAL};
use berth_proto::readiness::{ConditionType, GetReadiness, VerifyEnvironment};
use berth_proto::release::{ComponentSpec, CreateRelease, SshRelease};
use berth_proto::ssh_target::CreateSshTarget;
use berth_proto::task::{CancelTask, CreateTask, ListTasks, TaskView};
use berth_proto::transport::GENERATION_HEADER;
use berth_proto::{AgentId, TaskId};
use berth_test_utils::wait_until;
use common::{next_sequence, ok, start_with, TestAgent, TestServer};
use serde_json::json;
use time::OffsetDateTime;

/// Room, once the fillers are cancelled, for every origin that waited on `held`.
const CAP: u32 = 8;
/// The SSH target's "private key": only carried, never used (nothing connects).
const SSH_KEY: &str =
    "-----BEGIN OPENSSH PRIVATE KEY-----\nnot a real key\n-----END OPENSSH PRIVATE KEY-----\n";
/// One repository for every run: its blobs and manifests are the same each time, so pushing
/// them again stores nothing new in the shared registry.
const REPO: &str = "berth-test/task-origins";
const DEADLINE: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, PartialEq)]
enum HoldKind {
    Cordon,
    QueueCap,
}

fn code(e: &ClientError) -> (u16, String) {
    match e {
        ClientError::Api { status, body, .. } => (*status, body.code.clone()),
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The loopback registry the services provide, or `None` (SKIP) when it is not configured.
fn registry() -> Option<String> {
    match std::env::var("BERTH_TEST_REGISTRY") {
        Ok(r) if !r.is_empty() => Some(r),
        _ => {
            assert!(
                std::env::var_os("BERTH_REQUIRE_SERVICES").is_none(),
                "BERTH_REQUIRE_SERVICES is set but BERTH_TEST_REGISTRY is not"
            );
            eprintln!("SKIP: BERTH_TEST_REGISTRY is not set");
            None
        }
    }
}

/// Pushes a one-layer image (its bytes need not be a real file system: nothing runs it) to
/// `registry` as `repo:tag`, so a release can resolve it to a digest.
async fn push_image(http: &reqwest::Client, registry: &str, repo: &str, tag: &str) {
    let base = format!("http://{registry}/v2/{repo}");
    let blob = |content: Vec<u8>| {
        let http = http.clone();
        let base = base.clone();
        async move {
            let digest = format!("sha256:{}", berth_crypto::sha256_hex(&content));
            let started = http
                .post(format!("{base}/blobs/uploads/"))
                .send()
                .await
                .expect("start upload");
            assert_eq!(started.status().as_u16(), 202, "start upload");
            let location = started.headers()["location"]
                .to_str()
                .expect("location")
                .to_string();
            let url = if location.starts_with("http") {
                location
            } else {
                format!("http://{registry}{location}")
            };
            let sep = if url.contains('?') { '&' } else { '?' };
            let put = http
                .put(format!("{url}{sep}digest={digest}"))
                .header("content-type", "application/octet-stream")
                .body(content.clone())
                .send()
                .await
                .expect("upload");
            assert_eq!(put.status().as_u16(), 201, "upload blob");
            (digest, content.len())
        }
    };
    let config = serde_json::to_vec(&json!({
        "architecture": "amd64", "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": []}, "config": {}
    }))
    .expect("config");
    let (config_digest, config_size) = blob(config).await;
    let (layer_digest, layer_size) = blob(format!("layer of {repo}:{tag}").into_bytes()).await;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": config_digest, "size": config_size},
        "layers": [{"mediaType": "application/vnd.docker.image.rootfs.diff.tar.gzip",
                    "digest": layer_digest, "size": layer_size}],
    });
    let put = http
        .put(format!("{base}/manifests/{tag}"))
        .header(
            "content-type",
            "application/vnd.docker.distribution.manifest.v2+json",
        )
        .body(serde_json::to_vec(&manifest).expect("manifest"))
        .send()
        .await
        .expect("put manifest");
    assert_eq!(put.status().as_u16(), 201, "put manifest");
}

/// Heartbeats every 300 ms reporting `docker` and `ssh`, so the agent stays online and
/// capable (a heartbeat replaces what the agent reports).
fn keep_alive(agent: Arc<TestAgent>, generation: i64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let beat = common::sign_heartbeat(
                Heartbeat {
                    agent_id: agent.id,
                    status: AgentStatus::Online,
                    resource_usage: Default::default(),
                    capabilities: vec![Capability::named("docker"), Capability::named("ssh")],
                    generation,
                    sequence: next_sequence(),
                    signature_algorithm: berth_proto::transport::ALG_ECDSA_SHA256.into(),
                    signature: None,
                },
                &agent.key,
            );
            let g = generation.to_string();
            let _ = agent
                .client
                .send_with(&beat, &[(GENERATION_HEADER, &g)], None)
                .await;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    })
}

/// Runs everything the agent is given, each with a signed success.
fn work(agent: Arc<TestAgent>, generation: i64) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match agent.poll(generation).await {
                Ok(response) => {
                    if let Some(a) = response.assignment {
                        let envelope = agent.sign(agent.envelope(a.assignment_id, ok(a.task_id)));
                        let _ = agent.submit(generation, envelope).await;
                    }
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    })
}

async fn tasks_of(admin: &Client, agent: AgentId) -> Vec<TaskView> {
    admin
        .send(&ListTasks {
            agent_id: Some(agent),
            limit: Some(1000),
            ..Default::default()
        })
        .await
        .expect("list tasks")
        .items
}

async fn deployment(admin: &Client, d: &DeploymentView) -> DeploymentView {
    admin
        .send(&GetDeployment { id: d.id })
        .await
        .expect("deployment")
}

fn environment(name: &str, selector: BTreeMap<String, String>) -> CreateEnvironment {
    CreateEnvironment {
        name: name.into(),
        tier: Tier::Qa,
        selector,
        target_type: TargetType::Agents,
        // One wave: a pass that starts one target has tried every target.
        policy: RolloutPolicy {
            max_parallel: 10,
            ..Default::default()
        },
        promote_from: None,
        approvals: Some(0),
        auto_heal: false,
        drift_interval_secs: Some(1),
    }
}

struct Fleet {
    server: TestServer,
    admin: Client,
    free: Arc<TestAgent>,
    held: Arc<TestAgent>,
    held_generation: i64,
    background: Vec<tokio::task::JoinHandle<()>>,
}

async fn fleet(registry: &str, database: Option<String>) -> Fleet {
    let server = start_with(|c| {
        c.database = database;
        c.long_poll = Duration::from_millis(300);
        c.lease_grace = Duration::ZERO;
        c.max_open_tasks_per_agent = CAP;
    })
    .await;
    let admin = server.admin();
    let free = Arc::new(server.agent("free").await);
    let held = Arc::new(server.agent("held").await);
    let free_generation = free.go_online().await;
    let held_generation = held.go_online().await;
    let background = vec![
        keep_alive(free.clone(), free_generation),
        keep_alive(held.clone(), held_generation),
        work(free.clone(), free_generation),
    ];
    let repo = REPO;
    // Plain HTTP to the registry; the client's TLS settings are unused.
    push_image(&server.raw(None), registry, repo, "1").await;
    admin
        .send(&CreateRelease {
            name: "web-1".into(),
            components: vec![ComponentSpec {
                name: "web".into(),
                image: format!("{registry}/{repo}:1"),
                config: None,
            }],
            ..Default::default()
        })
        .await
        .expect("release");
    Fleet {
        server,
        admin,
        free,
        held,
        held_generation,
        background,
    }
}

async fn label(admin: &Client, agent: AgentId, l: BTreeMap<String, String>) {
    admin
        .send(&UpdateAgent {
            id: agent,
            labels: Some(l),
            capabilities: None,
        })
        .await
        .expect("label");
}

/// The whole scenario; `hold` is what is done to `held` once the origins are set up. On
/// `database` (PostgreSQL), or SQLite.
async fn every_origin_honours(hold: HoldKind, database: Option<String>) {
    let Some(registry) = registry() else { return };
    let f = fleet(&registry, database).await;
    let admin = &f.admin;
    // A second token approves (the requester cannot approve its own deployment).
    let approver = f.server.client(
        Some(
            &admin
                .send(&CreateApiToken {
                    role: Role::Deployer,
                    name: None,
                })
                .await
                .expect("token")
                .token,
        ),
        None,
    );

    // `drift` gets a current release on `free` alone; `held` joins it after the hold.
    label(admin, f.free.id, labels(&[("drift", "y"), ("gated", "y")])).await;
    label(admin, f.held.id, labels(&[("gated", "y")])).await;
    admin
        .send(&environment("drift", labels(&[("drift", "y")])))
        .await
        .expect("env drift");
    admin
        .send(&CreateEnvironment {
            approvals: Some(1),
            ..environment("gated", labels(&[("gated", "y")]))
        })
        .await
        .expect("env gated");
    let first = admin
        .send(&CreateDeployment {
            release: "web-1".into(),
            environment: "drift".into(),
        })
        .await
        .expect("deploy drift");
    wait_until(DEADLINE, "the first deployment to succeed", || async {
        deployment(admin, &first).await.state == DeploymentState::Succeeded
    })
    .await;
    // `gated` is planned with both agents and waits for its approval until after the hold.
    let gated = admin
        .send(&CreateDeployment {
            release: "web-1".into(),
            environment: "gated".into(),
        })
        .await
        .expect("deploy gated");
    assert_eq!(gated.targets.len(), 2, "{gated:?}");

    // An SSH target acted for by `held`, with its key in a builtin secret.
    admin
        .send(&CreateEnvironment {
            target_type: TargetType::Ssh,
            ..environment("edge", labels(&[("ssh", "y")]))
        })
        .await
        .expect("env edge");
    let put = f
        .server
        .raw(None)
        .put(format!("{}/api/v1/secrets/edge/key", f.server.url))
        .bearer_auth(&f.server.admin_token)
        .json(&json!({ "value": SSH_KEY }))
        .send()
        .await
        .expect("put secret");
    assert!(put.status().is_success(), "put secret: {}", put.status());
    admin
        .send(&CreateSshTarget {
            name: "edge-1".into(),
            host: "127.0.0.1".into(),
            port: Some(1),
            user: "deploy".into(),
            via_agent: Some("held".into()),
            via_selector: BTreeMap::new(),
            host_key:
                "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEqAzdac8f6mZEIUIb2aoeXCJmFtaT+i+67/3UeoqzJy"
                    .into(),
            key_secret: "edge/key".into(),
            labels: labels(&[("ssh", "y")]),
        })
        .await
        .expect("ssh target");
    admin
        .send(&CreateRelease {
            name: "site-1".into(),
            ssh: Some(SshRelease {
                deploy_directory: "/srv/site".into(),
                artifacts: vec![],
                script: Some(HookConfig {
                    command: vec!["/bin/true".into()],
                    timeout: Some(30),
                }),
                hooks: Default::default(),
                health_check: None,
            }),
            ..Default::default()
        })
        .await
        .expect("ssh release");

    // A side-effecting task `held` starts and then loses (5 s timeout, no grace): `unknown`
    // after the hold, so its read-back is asked for after the hold.
    let lost = admin
        .send(&CreateTask {
            timeout_seconds: Some(5),
            ..task(
                f.held.id,
                "write-sticker",
                json!({"name": "web", "digest": "sha256:abc"}),
            )
        })
        .await
        .expect("write-sticker");
    // (Readiness passes of the new environments may have probed `held` first: done.)
    let assignment = loop {
        let polled = f
            .held
            .poll_promising_start(f.held_generation)
            .await
            .expect("poll");
        match polled.assignment {
            Some(a) if a.task_id == lost.id => break a,
            Some(other) => {
                let done = f
                    .held
                    .sign(f.held.envelope(other.assignment_id, ok(other.task_id)));
                f.held
                    .submit(f.held_generation, done)
                    .await
                    .expect("submit");
            }
            None => {}
        }
    };
    f.held
        .start(f.held_generation, lost.id, assignment.assignment_id)
        .await
        .expect("start");

    // The hold.
    let fillers = match hold {
        HoldKind::Cordon => {
            admin
                .send(&HoldAgent {
                    id: f.held.id,
                    hold: AgentHold::Cordon,
                })
                .await
                .expect("cordon");
            Vec::new()
        }
        HoldKind::QueueCap => fill(admin, f.held.id).await,
    };
    let held_at = OffsetDateTime::now_utc();
    let refused = match hold {
        HoldKind::Cordon => (409, "AGENT_CORDONED".to_string()),
        HoldKind::QueueCap => (429, "QUEUE_FULL".to_string()),
    };

    // 1. The task API: by id refused; a selector that matches both goes to `free`.
    let err = admin
        .send(&task(f.held.id, "inspect", json!({})))
        .await
        .unwrap_err();
    assert_eq!(code(&err), refused);
    let picked = admin
        .send(&CreateTask {
            agent_id: None,
            selector: Some(labels(&[("gated", "y")])),
            ..task(f.held.id, "inspect", json!({}))
        })
        .await
        .expect("selector");
    assert_eq!(picked.agent_id, f.free.id);

    // 2. A deployment planned before the hold: `free` gets its task in the same pass that
    // refuses `held` (one wave).
    approver
        .send(&ApproveDeployment { id: gated.id })
        .await
        .expect("approve");
    let target = |d: &DeploymentView, agent: AgentId| {
        d.targets
            .iter()
            .find(|t| t.agent_id == agent)
            .cloned()
            .expect("target")
    };
    wait_until(DEADLINE, "free's target to get its task", || async {
        !target(&deployment(admin, &gated).await, f.free.id)
            .tasks
            .is_empty()
    })
    .await;
    let seen = deployment(admin, &gated).await;
    let held_target = target(&seen, f.held.id);
    assert!(held_target.tasks.is_empty(), "{held_target:?}");
    match hold {
        HoldKind::Cordon => {
            assert_eq!(held_target.phase, TargetPhase::Skipped, "{held_target:?}");
            assert_eq!(held_target.error_code.as_deref(), Some("AGENT_CORDONED"));
        }
        // Waits for room; never failed for it.
        HoldKind::QueueCap => {
            assert_eq!(held_target.phase, TargetPhase::Waiting, "{held_target:?}")
        }
    }

    // 3. An SSH target's deployment: its task would go to `held`.
    let edge = admin
        .send(&CreateDeployment {
            release: "site-1".into(),
            environment: "edge".into(),
        })
        .await
        .expect("deploy edge");
    wait_until(DEADLINE, "the edge deployment's first pass", || async {
        let d = deployment(admin, &edge).await;
        match hold {
            HoldKind::Cordon => d.targets[0].phase == TargetPhase::Skipped,
            // The first pass records `running`, having tried the target.
            HoldKind::QueueCap => d.state == DeploymentState::Running,
        }
    })
    .await;
    let edge_target = deployment(admin, &edge).await.targets[0].clone();
    assert!(edge_target.tasks.is_empty(), "{edge_target:?}");
    if hold == HoldKind::Cordon {
        assert_eq!(edge_target.error_code.as_deref(), Some("AGENT_CORDONED"));
    } else {
        assert_eq!(edge_target.phase, TargetPhase::Waiting, "{edge_target:?}");
    }

    // 4. Drift: `held` joins `drift`; its passes go on checking `free` (two checks created
    // after the hold prove two passes ran with `held` as a target).
    label(admin, f.held.id, labels(&[("drift", "y"), ("gated", "y")])).await;
    let joined_at = OffsetDateTime::now_utc();
    wait_until(DEADLINE, "two drift checks of free", || async {
        tasks_of(admin, f.free.id)
            .await
            .iter()
            .filter(|t| t.task_type == "inspect" && t.created_at > joined_at)
            .count()
            >= 2
    })
    .await;

    // 5. Readiness: a verify probes every reachable host; `held`'s probe is not queued.
    admin
        .send(&VerifyEnvironment {
            name: "drift".into(),
        })
        .await
        .expect("verify");
    wait_until(DEADLINE, "held's probe reported not queued", || async {
        let r = admin
            .send(&GetReadiness {
                name: "drift".into(),
            })
            .await
            .expect("readiness");
        r.conditions.iter().any(|c| {
            c.kind == ConditionType::RoutesExecutable
                && c.message.contains("held: the probe could not be queued")
        })
    })
    .await;
    assert!(
        tasks_of(admin, f.free.id)
            .await
            .iter()
            .any(|t| t.task_type == "readiness-probe"),
        "free was probed"
    );

    // 6. The read-back of the lost task passes the hold: it resolves work `held` already had.
    wait_until(DEADLINE, "the read-back of the lost task", || async {
        tasks_of(admin, f.held.id)
            .await
            .iter()
            .any(|t| t.read_back_of == Some(lost.id))
    })
    .await;

    // Everything `held` got after the hold is that read-back.
    let after: Vec<TaskView> = tasks_of(admin, f.held.id)
        .await
        .into_iter()
        .filter(|t| t.created_at >= held_at && !fillers.contains(&t.id))
        .collect();
    assert_eq!(after.len(), 1, "held got work after the hold: {after:#?}");
    assert_eq!(after[0].read_back_of, Some(lost.id));
    assert_eq!(after[0].task_type, "read-sticker");

    if hold == HoldKind::QueueCap {
        // With room in the queue, the waiting targets get their tasks.
        for id in &fillers {
            admin.send(&CancelTask { id: *id }).await.expect("cancel");
        }
        wait_until(DEADLINE, "the waiting targets' tasks", || async {
            let gated = deployment(admin, &gated).await;
            let edge = deployment(admin, &edge).await;
            !target(&gated, f.held.id).tasks.is_empty() && !edge.targets[0].tasks.is_empty()
        })
        .await;
        // The SSH target's task carries its key, sealed for that task by the one path.
        let ssh_task = deployment(admin, &edge).await.targets[0].tasks[0];
        let delivered = deliver(&f.held, f.held_generation, ssh_task).await;
        let opened = f.held.open(&delivered).expect("the assignment opens");
        assert_eq!(
            opened
                .credentials
                .get(SSH_PRIVATE_KEY_CREDENTIAL)
                .map(String::as_str),
            Some(SSH_KEY)
        );
    }

    for task in f.background {
        task.abort();
    }
    f.server.stop().await;
}

fn task(agent: AgentId, task_type: &str, payload: serde_json::Value) -> CreateTask {
    CreateTask {
        task_type: task_type.into(),
        agent_id: Some(agent),
        payload,
        timeout_seconds: Some(3600),
        ..Default::default()
    }
}

/// Fills the agent's queue to the cap with tasks nobody runs; their ids.
async fn fill(admin: &Client, agent: AgentId) -> Vec<TaskId> {
    let mut ids = Vec::new();
    loop {
        match admin.send(&task(agent, "inspect", json!({}))).await {
            Ok(t) => ids.push(t.id),
            Err(e) => {
                assert_eq!(code(&e), (429, "QUEUE_FULL".into()));
                break;
            }
        }
        assert!(ids.len() <= CAP as usize, "the cap did not hold");
    }
    ids
}

/// Polls `agent` until it is given `wanted`, completing whatever else comes first.
async fn deliver(
    agent: &TestAgent,
    generation: i64,
    wanted: TaskId,
) -> berth_proto::transport::AgentTaskAssignment {
    loop {
        let polled = agent.poll(generation).await.expect("poll");
        match polled.assignment {
            Some(a) if a.task_id == wanted => return a,
            Some(other) => {
                let done = agent.sign(agent.envelope(other.assignment_id, ok(other.task_id)));
                agent.submit(generation, done).await.expect("submit");
            }
            None => {}
        }
    }
}

/// Delivers `task` to `agent` and answers it with a signed success or failure.
async fn settle(agent: &TestAgent, generation: i64, task: TaskId, success: bool) {
    let a = deliver(agent, generation, task).await;
    let result = if success {
        ok(task)
    } else {
        common::failure(task, "BOOM", false)
    };
    let signed = agent.sign(agent.envelope(a.assignment_id, result));
    agent.submit(generation, signed).await.expect("submit");
}

/// A rollback is not a read-back: at the cap it is refused like any new work. `good`'s deploy
/// succeeds, its queue is then filled, and `bad`'s fails: the rollback reaches `bad`, and
/// `good`'s target ends `rollback_failed` with `QUEUE_FULL` instead of queueing over the cap.
#[tokio::test]
async fn a_rollback_at_the_cap_fails_the_target_instead_of_queueing_over_it() {
    let Some(registry) = registry() else { return };
    let server = start_with(|c| {
        c.long_poll = Duration::from_millis(300);
        c.max_open_tasks_per_agent = 3;
    })
    .await;
    let admin = server.admin();
    let good = Arc::new(server.agent("good").await);
    let bad = Arc::new(server.agent("bad").await);
    let good_generation = good.go_online().await;
    let bad_generation = bad.go_online().await;
    let beating = [
        keep_alive(good.clone(), good_generation),
        keep_alive(bad.clone(), bad_generation),
    ];
    for agent in [good.id, bad.id] {
        label(&admin, agent, labels(&[("roll", "y")])).await;
    }
    let repo = REPO;
    for tag in ["1", "2"] {
        push_image(&server.raw(None), &registry, repo, tag).await;
        admin
            .send(&CreateRelease {
                name: format!("web-{tag}"),
                components: vec![ComponentSpec {
                    name: "web".into(),
                    image: format!("{registry}/{repo}:{tag}"),
                    config: None,
                }],
                ..Default::default()
            })
            .await
            .expect("release");
    }
    admin
        .send(&CreateEnvironment {
            drift_interval_secs: Some(3600),
            ..environment("roll", labels(&[("roll", "y")]))
        })
        .await
        .expect("env");
    let deploy = |release: &str| CreateDeployment {
        release: release.into(),
        environment: "roll".into(),
    };
    let task_of = |d: DeploymentView, agent: AgentId| {
        let admin = admin.clone();
        async move {
            let tasks = || async {
                deployment(&admin, &d)
                    .await
                    .targets
                    .into_iter()
                    .find(|t| t.agent_id == agent)
                    .expect("target")
                    .tasks
            };
            wait_until(DEADLINE, "the target's task", || async {
                !tasks().await.is_empty()
            })
            .await;
            tasks().await[0]
        }
    };
    let first = admin.send(&deploy("web-1")).await.expect("deploy web-1");
    settle(
        &good,
        good_generation,
        task_of(first.clone(), good.id).await,
        true,
    )
    .await;
    settle(
        &bad,
        bad_generation,
        task_of(first.clone(), bad.id).await,
        true,
    )
    .await;
    wait_until(DEADLINE, "web-1 to succeed", || async {
        deployment(&admin, &first).await.state == DeploymentState::Succeeded
    })
    .await;

    let second = admin.send(&deploy("web-2")).await.expect("deploy web-2");
    settle(
        &good,
        good_generation,
        task_of(second.clone(), good.id).await,
        true,
    )
    .await;
    let fillers = fill(&admin, good.id).await;
    settle(
        &bad,
        bad_generation,
        task_of(second.clone(), bad.id).await,
        false,
    )
    .await;
    let rolling = |agent: AgentId| {
        let admin = admin.clone();
        let second = second.clone();
        async move {
            deployment(&admin, &second)
                .await
                .targets
                .into_iter()
                .find(|t| t.agent_id == agent)
                .expect("target")
        }
    };
    wait_until(DEADLINE, "bad's rollback task", || async {
        !rolling(bad.id).await.rollback_tasks.is_empty()
    })
    .await;
    let refused = rolling(good.id).await;
    assert_eq!(refused.phase, TargetPhase::RollbackFailed, "{refused:?}");
    assert_eq!(
        refused.error_code.as_deref(),
        Some("QUEUE_FULL"),
        "{refused:?}"
    );
    assert!(refused.rollback_tasks.is_empty(), "{refused:?}");
    // Full, not over: the fillers and whatever was queued before them (a readiness probe).
    let good_tasks = tasks_of(&admin, good.id).await;
    let open = good_tasks.iter().filter(|t| !t.state.is_terminal()).count();
    assert_eq!(open, 3, "{good_tasks:#?}");
    assert!(fillers
        .iter()
        .all(|f| good_tasks.iter().any(|t| t.id == *f)));
    assert_eq!(
        good_tasks
            .iter()
            .filter(|t| t.task_type == "docker.run")
            .count(),
        2,
        "no rollback task on good: {good_tasks:#?}"
    );
    // bad rolls back; the deployment ends failed, naming good.
    let rollback = rolling(bad.id).await.rollback_tasks[0];
    settle(&bad, bad_generation, rollback, true).await;
    wait_until(DEADLINE, "the deployment to end", || async {
        deployment(&admin, &second).await.state == DeploymentState::Failed
    })
    .await;
    let ended = deployment(&admin, &second).await;
    assert!(
        ended.detail.as_deref().unwrap_or("").contains("good"),
        "{ended:?}"
    );
    for b in beating {
        b.abort();
    }
    server.stop().await;
}

#[tokio::test]
async fn every_origin_honours_a_cordon() {
    every_origin_honours(HoldKind::Cordon, None).await;
}

#[tokio::test]
async fn every_origin_honours_the_queue_cap() {
    every_origin_honours(HoldKind::QueueCap, None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_origin_honours_a_cordon_on_postgres() {
    let Some(admin_url) = berth_test_utils::postgres::admin_url("task origins on postgres") else {
        return;
    };
    let db = berth_test_utils::postgres::TestDatabase::create(&admin_url);
    every_origin_honours(HoldKind::Cordon, Some(db.url.clone())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_origin_honours_the_queue_cap_on_postgres() {
    let Some(admin_url) = berth_test_utils::postgres::admin_url("task origins on postgres") else {
        return;
    };
    let db = berth_test_utils::postgres::TestDatabase::create(&admin_url);
    every_origin_honours(HoldKind::QueueCap, Some(db.url.clone())).await;
}
