//! `berth-bench tasks`: task transport end to end. Simulated agents (registered like
//! `berth-agent --register`, each with its own P-256 key and mTLS connection) acquire a session
//! and long-poll; on an assignment they open its sealed payload with their key, then at once
//! sign a success envelope (its empty logs sealed to the server's key, JCS without `signature`,
//! ECDSA P-256, base64) and submit it with `X-Berth-Generation`. A creator loop
//! makes `inspect` tasks through the admin API, round-robin over the agents.
//!
//! `berth-bench verify`: result-signature verification per second on one thread: the server's
//! path (a `ResultVerifier` built once per agent certificate) next to the per-call certificate
//! parse of `verify_with_cert`.
//!
//! Like the heartbeat scenarios, the last line is `SUMMARY {json}` for `scripts/bench-tasks.sh`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context};
use base64::Engine;
use berth_client::Client;
use berth_crypto::hpke::{RecipientKey, RecipientPublicKey};
use berth_crypto::{AgentKey, ResultVerifier};
use berth_proto::kind::capability;
use berth_proto::result::TaskResult;
use berth_proto::task::{CreateTask, TaskState};
use berth_proto::transport::{
    self, AcquireSession, AgentTaskAssignment, AgentTaskPollRequest, AgentTaskResultEnvelope,
    SealedAssignment, SealedBox, SubmitResult, CONTRACT_VERSION, GENERATION_HEADER, LOGS_SEAL_INFO,
};
use berth_proto::{AgentId, TaskId};
use clap::Args;
use serde_json::json;
use time::OffsetDateTime;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant};

use crate::fleet::SimAgent;
use crate::stats::{micros, CpuTimes, Latencies};
use crate::Common;

/// The server holds a poll at most 25 s; allow a little more before calling it a failure.
const POLL_TIMEOUT: Duration = Duration::from_secs(40);

#[derive(Args, Debug)]
pub struct TasksArgs {
    #[command(flatten)]
    common: Common,
    /// Simulated agents that long-poll for tasks and answer each with a signed success.
    #[arg(long, default_value_t = 100)]
    agents: usize,
    /// Tasks created per second, open loop; 0 = as fast as `--concurrency` creators can.
    #[arg(long, default_value_t = 100.0)]
    rate: f64,
    /// Measured window: tasks created in it count for latencies and throughput.
    #[arg(long, default_value_t = 30)]
    duration_secs: u64,
    /// Tasks are created but not measured for this long first (connections, caches); with
    /// `--heartbeat-agents`, make it at least one heartbeat interval.
    #[arg(long, default_value_t = 5)]
    warmup_secs: u64,
    /// Creates in flight at most (open loop), or closed-loop creators (`--rate 0`).
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// After the last create, wait at most this long for outstanding tasks to finish.
    #[arg(long, default_value_t = 30)]
    drain_secs: u64,
    /// Extra agents that only heartbeat every `--heartbeat-interval-secs` and hold a long-poll
    /// open, on one HTTP/2 connection each, like `berth-agent`.
    #[arg(long, default_value_t = 0)]
    heartbeat_agents: usize,
    #[arg(long, default_value_t = 30)]
    heartbeat_interval_secs: u64,
    /// Write the id of every task whose create was acknowledged (2xx), one per line, when the
    /// creates end (`scripts/soak.sh` checks each one exists afterwards).
    #[arg(long)]
    created_log: Option<std::path::PathBuf>,
}

/// An agent with its session.
#[derive(Clone)]
pub(crate) struct Worker {
    pub id: AgentId,
    pub client: Client,
    pub key: Arc<AgentKey>,
    /// `key` as an HPKE recipient: opens the sealed assignments.
    pub opener: Arc<RecipientKey>,
    /// The server's sealing key from the session answer: results' logs are sealed to it.
    pub server_key: RecipientPublicKey,
    pub generation: i64,
}

/// What one task agent saw.
#[derive(Default)]
struct AgentLog {
    assigned: Vec<(TaskId, Instant)>,
    /// (task, when the ack arrived, the ack said `succeeded`).
    acked: Vec<(TaskId, Instant, bool)>,
    sign_us: Vec<u64>,
    submit_us: Vec<u64>,
    /// Polls that returned without an assignment.
    empty_polls: u64,
    errors: Vec<String>,
}

/// What the creators saw: (task, request sent, response received).
#[derive(Default)]
struct CreateLog {
    created: Vec<(TaskId, Instant, Instant)>,
    errors: Vec<String>,
    max_lag_us: u64,
}

fn short(e: impl Into<anyhow::Error>) -> String {
    format!("{:#}", e.into()).chars().take(200).collect()
}

pub async fn tasks(args: TasksArgs) -> anyhow::Result<()> {
    if args.agents == 0 || args.duration_secs == 0 {
        bail!("--agents and --duration-secs must be at least 1");
    }
    if args.rate < 0.0 || !args.rate.is_finite() {
        bail!("--rate must be 0 (closed loop) or positive");
    }
    let total = args.agents + args.heartbeat_agents;
    let (target, fleet, _) = crate::setup(&args.common, total, None).await?;
    if fleet.agents.len() < total {
        bail!("only {} of {total} agents registered", fleet.agents.len());
    }
    let t = std::time::Instant::now();
    let workers = sessions(&fleet.agents, args.common.concurrency_register).await?;
    println!(
        "{} sessions acquired in {:.2} s",
        workers.len(),
        t.elapsed().as_secs_f64()
    );
    let (task_agents, hb_agents) = workers.split_at(args.agents);

    let admin = target.client(Some(target.admin_token.clone()))?;
    let metrics_client = target.client(None)?;
    let interval = Duration::from_secs(args.heartbeat_interval_secs.max(1));
    let start = Instant::now() + Duration::from_millis(200);
    let measure_from = start + Duration::from_secs(args.warmup_secs);
    let create_end = measure_from + Duration::from_secs(args.duration_secs);
    let (stop_tx, stop_rx) = watch::channel(false);
    let created = Arc::new(AtomicU64::new(0));
    let completed = Arc::new(AtomicU64::new(0));

    // Task agents: poll → sign → submit, until told to stop.
    let mut agents = JoinSet::new();
    for w in task_agents.iter().cloned() {
        let (stop, completed) = (stop_rx.clone(), completed.clone());
        agents.spawn(task_agent(w, stop, completed));
    }
    // Heartbeats: every agent heartbeats (task agents too, to keep their session lease), at a
    // random phase; latencies are kept for all but each agent's first (it opens a connection).
    let heartbeats: Arc<Mutex<Vec<(Instant, u64)>>> = Arc::default();
    let hb_errors: Arc<Mutex<Vec<String>>> = Arc::default();
    let mut background = JoinSet::new();
    for w in workers.iter().cloned() {
        let phase = interval.mul_f64(berth_crypto::random_unit());
        let (stop, log, errs) = (stop_rx.clone(), heartbeats.clone(), hb_errors.clone());
        background.spawn(heartbeat_loop(w, start + phase, interval, stop, log, errs));
    }
    // Heartbeat-only agents also hold a long-poll open, like an idle berth-agent.
    let idle_polls = Arc::new(AtomicU64::new(0));
    for w in hb_agents.iter().cloned() {
        let (stop, errs, polls) = (stop_rx.clone(), hb_errors.clone(), idle_polls.clone());
        background.spawn(idle_poll_loop(w, stop, errs, polls));
    }

    let cpu_observer = tokio::spawn(async move {
        sleep_until(measure_from).await;
        CpuTimes::now()
    });
    let ticker = progress(created.clone(), completed.clone());
    let ids: Arc<Vec<AgentId>> = Arc::new(task_agents.iter().map(|w| w.id).collect());
    let creates = create_loop(&args, admin, ids, start, create_end, created.clone()).await;
    if let Some(path) = &args.created_log {
        let lines: String = creates
            .created
            .iter()
            .map(|(id, _, _)| format!("{id}\n"))
            .collect();
        std::fs::write(path, lines).with_context(|| format!("writing {}", path.display()))?;
    }
    let cpu_to = CpuTimes::now();
    let cpu = cpu_to.since(&cpu_observer.await.context("cpu observer panicked")?);

    // Drain: let the agents finish what was created.
    let want = creates.created.len() as u64;
    let drain_deadline = Instant::now() + Duration::from_secs(args.drain_secs);
    while completed.load(Ordering::Relaxed) < want && Instant::now() < drain_deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop_tx.send(true);
    ticker.abort();
    let metrics = metrics_client.get_text("/metrics").await.ok();
    let mut logs = Vec::new();
    while let Some(joined) = agents.join_next().await {
        logs.push(joined.context("a simulated agent panicked")?);
    }
    background.abort_all();
    while background.join_next().await.is_some() {}

    report(
        &args,
        &fleet,
        creates,
        logs,
        &heartbeats.lock().unwrap_or_else(|e| e.into_inner()),
        &hb_errors.lock().unwrap_or_else(|e| e.into_inner()),
        idle_polls.load(Ordering::Relaxed),
        (measure_from, create_end),
        cpu,
        metrics,
    );
    Ok(())
}

/// Acquires a session for every agent, `concurrency` at a time.
pub(crate) async fn sessions(
    agents: &[SimAgent],
    concurrency: usize,
) -> anyhow::Result<Vec<Worker>> {
    let permits = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut set = JoinSet::new();
    for (i, a) in agents.iter().enumerate() {
        let (id, client, key) = (a.id, a.client.clone(), a.key.clone());
        let permits = permits.clone();
        set.spawn(async move {
            let _permit = permits.acquire_owned().await?;
            let session = client
                .send(&AcquireSession {
                    agent_id: id,
                    instance_id: uuid::Uuid::new_v4().to_string(),
                    boot_id: None,
                    lock: None,
                    version: None,
                })
                .await
                .with_context(|| format!("acquiring the session of agent {id}"))?;
            let opener = Arc::new(RecipientKey::from_pkcs8_pem(&key.to_pem())?);
            let server_key = RecipientPublicKey::from_sec1(
                &base64::engine::general_purpose::STANDARD.decode(&session.sealing_key)?,
            )?;
            anyhow::Ok((
                i,
                Worker {
                    id,
                    client,
                    key,
                    opener,
                    server_key,
                    generation: session.generation,
                },
            ))
        });
    }
    let mut out = Vec::with_capacity(agents.len());
    while let Some(joined) = set.join_next().await {
        out.push(joined.context("session task panicked")??);
    }
    out.sort_by_key(|(i, _)| *i);
    Ok(out.into_iter().map(|(_, w)| w).collect())
}

fn poll_request(w: &Worker) -> AgentTaskPollRequest {
    AgentTaskPollRequest {
        contract_version: CONTRACT_VERSION.into(),
        agent_id: w.id,
        // Seed capability strings, as berth-agent offers them on a host with Docker.
        capabilities: vec![capability::AGENT.into(), capability::DOCKER.into()],
        // `inspect` is read-only: there is no start to confirm.
        start_handshake: false,
    }
}

async fn task_agent(
    w: Worker,
    mut stop: watch::Receiver<bool>,
    completed: Arc<AtomicU64>,
) -> AgentLog {
    let mut log = AgentLog::default();
    let generation = w.generation.to_string();
    let headers = [(GENERATION_HEADER, generation.as_str())];
    let request = poll_request(&w);
    loop {
        let polled = tokio::select! {
            _ = stop.wait_for(|s| *s) => break,
            r = w.client.send_with(&request, &headers, Some(POLL_TIMEOUT)) => r,
        };
        let assignment = match polled {
            Ok(response) => match response.assignment {
                Some(a) => a,
                None => {
                    log.empty_polls += 1;
                    continue;
                }
            },
            Err(e) => {
                log.errors.push(format!("poll: {}", short(e)));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let assigned = Instant::now();
        log.assigned.push((assignment.task_id, assigned));
        // As berth-agent does before it runs anything: the payload opens with this key.
        if let Err(e) = open_assignment(&w.opener, &assignment) {
            log.errors.push(format!("open: {}", short(e)));
            continue;
        }
        let envelope = match signed_envelope(&w, &assignment, assigned.elapsed()) {
            Ok(e) => e,
            Err(e) => {
                log.errors.push(format!("sign: {}", short(e)));
                continue;
            }
        };
        log.sign_us.push(micros(assigned.elapsed()));
        let sent = Instant::now();
        match w
            .client
            .send_with(&SubmitResult::new(envelope), &headers, None)
            .await
        {
            Ok(ack) => {
                let now = Instant::now();
                log.submit_us.push(micros(now - sent));
                let ok = ack.state == TaskState::Succeeded;
                if ok {
                    completed.fetch_add(1, Ordering::Relaxed);
                }
                log.acked.push((assignment.task_id, now, ok));
            }
            Err(e) => log.errors.push(format!("result: {}", short(e))),
        }
    }
    log
}

/// What an `inspect` on a host without containers reports.
fn inspected(task_id: TaskId, at: OffsetDateTime) -> TaskResult {
    TaskResult {
        task_id,
        success: true,
        started_at: at,
        completed_at: at,
        outputs: serde_json::Map::from_iter([(
            "containers".to_string(),
            serde_json::Value::Array(Vec::new()),
        )]),
        artifacts: Vec::new(),
        error: None,
        error_type: None,
        retriable: false,
        logs: String::new(),
        sealed_logs: None,
        metrics: Default::default(),
    }
}

/// The payload and credentials of `a`, opened as berth-agent opens them.
pub(crate) fn open_assignment(
    key: &RecipientKey,
    a: &AgentTaskAssignment,
) -> anyhow::Result<SealedAssignment> {
    berth_client::sealing::open_assignment(a, key).map_err(anyhow::Error::msg)
}

/// `text` sealed to `to` under `info` for the assignment `aad`, in its wire form.
pub(crate) fn seal_box(
    to: &RecipientPublicKey,
    info: &[u8],
    aad: berth_proto::AssignmentId,
    text: &[u8],
) -> anyhow::Result<SealedBox> {
    berth_client::sealing::seal_box(to, info, aad, text).map_err(anyhow::Error::msg)
}

/// A success envelope for `assignment`, signed with the agent's key like berth-agent does.
fn signed_envelope(
    w: &Worker,
    assignment: &AgentTaskAssignment,
    took: Duration,
) -> anyhow::Result<AgentTaskResultEnvelope> {
    let now = OffsetDateTime::now_utc();
    let mut envelope = AgentTaskResultEnvelope {
        contract_version: CONTRACT_VERSION.into(),
        agent_id: w.id,
        task_id: assignment.task_id,
        assignment_id: Some(assignment.assignment_id),
        success: true,
        message: Some("inspected".into()),
        result_data: Some(serde_json::to_string(&TaskResult {
            sealed_logs: Some(seal_box(
                &w.server_key,
                LOGS_SEAL_INFO,
                assignment.assignment_id,
                b"",
            )?),
            ..inspected(assignment.task_id, now)
        })?),
        duration: transport::format_timespan(took),
        completed_at: now,
        signature_algorithm: transport::ALG_ECDSA_SHA256.into(),
        signature: None,
    };
    let signature = w.key.sign(&envelope.signing_input()?)?;
    envelope.signature = Some(base64::engine::general_purpose::STANDARD.encode(signature));
    Ok(envelope)
}

fn heartbeat_body(w: &Worker) -> berth_proto::agent::Heartbeat {
    berth_proto::agent::Heartbeat {
        agent_id: w.id,
        status: berth_proto::agent::AgentStatus::Online,
        resource_usage: berth_proto::agent::ResourceUsage {
            cpu_percent: 3.5,
            cpu_cores: 4,
            memory_used_bytes: 2_147_483_648,
            memory_total_bytes: 8_589_934_592,
            disk_free_bytes: 42_949_672_960,
            disk_total_bytes: 107_374_182_400,
        },
        capabilities: crate::fleet::capabilities(),
        generation: w.generation,
        sequence: 0,
        signature_algorithm: transport::ALG_ECDSA_SHA256.into(),
        signature: None,
    }
}

async fn heartbeat_loop(
    w: Worker,
    first: Instant,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
    log: Arc<Mutex<Vec<(Instant, u64)>>>,
    errors: Arc<Mutex<Vec<String>>>,
) {
    let generation = w.generation.to_string();
    let headers = [(GENERATION_HEADER, generation.as_str())];
    let body = heartbeat_body(&w);
    let mut scheduled = first;
    let mut n = 0u64;
    loop {
        tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            _ = sleep_until(scheduled) => {}
        }
        // n + 1: the sequence starts at 1 and rises with every heartbeat of this session.
        let signed = match crate::fleet::signed_heartbeat(&body, n + 1, &w.key) {
            Ok(signed) => signed,
            Err(e) => {
                errors
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(format!("signing the heartbeat: {e:#}"));
                return;
            }
        };
        let sent = Instant::now();
        match w.client.send_with(&signed, &headers, None).await {
            Ok(r) if r.acknowledged => {
                if n > 0 {
                    let took = micros(sent.elapsed());
                    log.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push((sent, took));
                }
            }
            Ok(_) => errors
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push("heartbeat not acknowledged".into()),
            Err(e) => errors
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(format!("heartbeat: {}", short(e))),
        }
        n += 1;
        scheduled += interval;
    }
}

async fn idle_poll_loop(
    w: Worker,
    mut stop: watch::Receiver<bool>,
    errors: Arc<Mutex<Vec<String>>>,
    polls: Arc<AtomicU64>,
) {
    let generation = w.generation.to_string();
    let headers = [(GENERATION_HEADER, generation.as_str())];
    let request = poll_request(&w);
    loop {
        let polled = tokio::select! {
            _ = stop.wait_for(|s| *s) => return,
            r = w.client.send_with(&request, &headers, Some(POLL_TIMEOUT)) => r,
        };
        match polled {
            Ok(_) => {
                polls.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                errors
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(format!("idle poll: {}", short(e)));
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }
}

pub(crate) fn create_request(agent: AgentId) -> CreateTask {
    CreateTask {
        task_type: "inspect".into(),
        agent_id: Some(agent),
        payload: json!({}),
        ..Default::default()
    }
}

/// Open loop at `rate`/s (at most `concurrency` creates in flight; lateness is reported), or
/// `concurrency` closed-loop creators with `rate == 0`.
async fn create_loop(
    args: &TasksArgs,
    admin: Client,
    ids: Arc<Vec<AgentId>>,
    start: Instant,
    end: Instant,
    created: Arc<AtomicU64>,
) -> CreateLog {
    let log = Arc::new(Mutex::new(CreateLog::default()));
    let next = Arc::new(AtomicUsize::new(0));
    let one = |admin: Client,
               ids: Arc<Vec<AgentId>>,
               log: Arc<Mutex<CreateLog>>,
               created: Arc<AtomicU64>,
               i: usize| async move {
        let agent = ids[i % ids.len()];
        let sent = Instant::now();
        let r = admin.send(&create_request(agent)).await;
        let now = Instant::now();
        let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
        match r {
            Ok(task) => {
                created.fetch_add(1, Ordering::Relaxed);
                log.created.push((task.id, sent, now));
            }
            Err(e) => log.errors.push(format!("create: {}", short(e))),
        }
    };
    let mut set = JoinSet::new();
    sleep_until(start).await;
    if args.rate > 0.0 {
        let permits = Arc::new(Semaphore::new(args.concurrency.max(1)));
        let mut max_lag_us = 0;
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            let scheduled = start + Duration::from_secs_f64(i as f64 / args.rate);
            if scheduled >= end {
                break;
            }
            sleep_until(scheduled).await;
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            max_lag_us = max_lag_us.max(micros(Instant::now() - scheduled));
            let f = one(admin.clone(), ids.clone(), log.clone(), created.clone(), i);
            set.spawn(async move {
                f.await;
                drop(permit);
            });
            // Reap finished creates now and then so the set stays small.
            while set.try_join_next().is_some() {}
        }
        log.lock().unwrap_or_else(|e| e.into_inner()).max_lag_us = max_lag_us;
    } else {
        for _ in 0..args.concurrency.max(1) {
            let (admin, ids, log, created, next) = (
                admin.clone(),
                ids.clone(),
                log.clone(),
                created.clone(),
                next.clone(),
            );
            set.spawn(async move {
                while Instant::now() < end {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    one(admin.clone(), ids.clone(), log.clone(), created.clone(), i).await;
                }
            });
        }
    }
    while set.join_next().await.is_some() {}
    let mut log = log.lock().unwrap_or_else(|e| e.into_inner());
    std::mem::take(&mut *log)
}

fn progress(created: Arc<AtomicU64>, completed: Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        tick.tick().await;
        let (mut last_c, mut last_d) = (0, 0);
        loop {
            tick.tick().await;
            let (c, d) = (
                created.load(Ordering::Relaxed),
                completed.load(Ordering::Relaxed),
            );
            println!(
                "  {:>8.1} created/s  {:>8.1} succeeded/s  ({c} created, {d} succeeded)",
                (c - last_c) as f64 / 10.0,
                (d - last_d) as f64 / 10.0
            );
            (last_c, last_d) = (c, d);
        }
    })
}

#[allow(clippy::too_many_arguments)]
fn report(
    args: &TasksArgs,
    fleet: &crate::fleet::Fleet,
    creates: CreateLog,
    logs: Vec<AgentLog>,
    heartbeats: &[(Instant, u64)],
    hb_errors: &[String],
    idle_polls: u64,
    (from, to): (Instant, Instant),
    cpu: crate::stats::CpuUsage,
    metrics: Option<String>,
) {
    let window = (to - from).as_secs_f64();
    let mut assigned: HashMap<TaskId, Instant> = HashMap::new();
    let mut acked: HashMap<TaskId, (Instant, bool)> = HashMap::new();
    let (mut sign, mut submit, mut errors) = (Vec::new(), Vec::new(), Vec::new());
    let mut empty_polls = 0;
    for l in logs {
        // A redelivery keeps its first assignment time.
        for (t, at) in l.assigned {
            assigned.entry(t).or_insert(at);
        }
        for (t, at, ok) in l.acked {
            acked.insert(t, (at, ok));
        }
        sign.extend(l.sign_us);
        submit.extend(l.submit_us);
        errors.extend(l.errors);
        empty_polls += l.empty_polls;
    }
    errors.extend(creates.errors.iter().cloned());
    let (mut pickup, mut pickup_from_sent, mut e2e, mut create_us) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut early = 0usize;
    let (mut measured, mut measured_done) = (0usize, 0usize);
    for (task, sent, created) in &creates.created {
        if *sent < from || *sent >= to {
            continue;
        }
        measured += 1;
        create_us.push(micros(*created - *sent));
        if let Some(at) = assigned.get(task) {
            if at < created {
                early += 1;
            }
            pickup.push(micros(at.saturating_duration_since(*created)));
            pickup_from_sent.push(micros(*at - *sent));
        }
        if let Some((at, true)) = acked.get(task) {
            measured_done += 1;
            e2e.push(micros(at.saturating_duration_since(*created)));
        }
    }
    let succeeded_total = acked.values().filter(|(_, ok)| *ok).count();
    let succeeded_in_window = acked
        .values()
        .filter(|(at, ok)| *ok && *at >= from && *at < to)
        .count();
    let throughput = succeeded_in_window as f64 / window;
    let create_rate = measured as f64 / window;
    let hb: Vec<u64> = heartbeats
        .iter()
        .filter(|(at, _)| *at >= from && *at < to)
        .map(|(_, us)| *us)
        .collect();
    let (pickup, pickup_from_sent, e2e, create_lat, hb) = (
        Latencies::from_micros(pickup),
        Latencies::from_micros(pickup_from_sent),
        Latencies::from_micros(e2e),
        Latencies::from_micros(create_us),
        Latencies::from_micros(hb),
    );
    let (sign, submit) = (Latencies::from_micros(sign), Latencies::from_micros(submit));
    let mode = if args.rate > 0.0 {
        format!("open loop {} tasks/s", args.rate)
    } else {
        format!("closed loop, {} creators", args.concurrency)
    };
    println!(
        "tasks: {} agents, {mode}; {} s warm-up, {} s measured; {} heartbeat-only agents",
        args.agents, args.warmup_secs, args.duration_secs, args.heartbeat_agents
    );
    println!(
        "created {} ({} in the window = {create_rate:.1}/s), succeeded {succeeded_total} ({measured_done} of the window's), {} errors",
        creates.created.len(),
        measured,
        errors.len() + hb_errors.len()
    );
    println!("  end-to-end throughput (succeeded acks in the window): {throughput:.1} tasks/s");
    println!("  create (admin POST /api/v1/tasks): {create_lat}");
    println!("  pickup (create response → assignment at the agent): {pickup}");
    println!("  pickup (create request sent → assignment): {pickup_from_sent}");
    println!("  assignments that arrived before the create response: {early}");
    println!("  end-to-end (create response → result acked): {e2e}");
    println!("  agent: sign {sign}");
    println!("  agent: submit result: {submit}");
    println!("  empty task polls {empty_polls}, idle long-polls answered {idle_polls}");
    println!("  heartbeats in the window (not each agent's first): {hb}");
    println!(
        "  creator lateness max {:.1} ms",
        creates.max_lag_us as f64 / 1000.0
    );
    println!("  cpu during the window: {cpu}");
    let mut tally: HashMap<&str, usize> = HashMap::new();
    for e in errors.iter().chain(hb_errors.iter()) {
        *tally.entry(e.as_str()).or_default() += 1;
    }
    let mut tally: Vec<_> = tally.into_iter().collect();
    tally.sort_by_key(|b| std::cmp::Reverse(b.1));
    for (e, n) in tally.iter().take(10) {
        println!("  error ×{n}: {e}");
    }
    if let Some(text) = &metrics {
        for line in text.lines().filter(|l| {
            !l.starts_with('#')
                && (l.starts_with("berth_tasks")
                    || l.starts_with("berth_results")
                    || l.starts_with("berth_result_rejections")
                    || l.starts_with("berth_errors"))
        }) {
            println!("  server metric: {line}");
        }
    }
    println!(
        "SUMMARY {}",
        json!({
            "scenario": "tasks",
            "agents": args.agents,
            "heartbeat_agents": args.heartbeat_agents,
            "rate": args.rate,
            "concurrency": args.concurrency,
            "duration_secs": args.duration_secs,
            "registration": crate::registration_json(fleet),
            "created": creates.created.len(),
            "created_in_window": measured,
            "create_per_sec": (create_rate * 10.0).round() / 10.0,
            "succeeded": succeeded_total,
            "succeeded_of_window": measured_done,
            "throughput_per_sec": (throughput * 10.0).round() / 10.0,
            "errors": errors.len(),
            "heartbeat_errors": hb_errors.len(),
            "create": create_lat.to_json(),
            "pickup": pickup.to_json(),
            "pickup_from_sent": pickup_from_sent.to_json(),
            "early_assignments": early,
            "end_to_end": e2e.to_json(),
            "sign": sign.to_json(),
            "submit": submit.to_json(),
            "heartbeat": hb.to_json(),
            "max_lag_ms": creates.max_lag_us as f64 / 1000.0,
            "cpu": cpu.to_json(),
        })
    );
}

#[derive(Args, Debug)]
pub struct VerifyArgs {
    /// Length of each timed run, per measurement.
    #[arg(long, default_value_t = 3.0)]
    seconds: f64,
    /// Distinct signed envelopes, verified round-robin.
    #[arg(long, default_value_t = 1000)]
    envelopes: usize,
    #[arg(long, default_value_t = 3)]
    runs: usize,
}

/// Result-signature verification on this thread only. The server's path (`signing_input` +
/// `ResultVerifier::verify`, the verifier built once per agent certificate, i.e. per
/// connection) next to the old per-call parse (`signing_input` + `verify_with_cert`), then each
/// part alone, and building a verifier. Medians of `runs`.
pub fn verify(args: &VerifyArgs) -> anyhow::Result<()> {
    if args.envelopes == 0 || args.runs == 0 || args.seconds <= 0.0 {
        bail!("--envelopes, --runs and --seconds must be positive");
    }
    let now = OffsetDateTime::now_utc();
    let ca = berth_crypto::Ca::generate("berth-bench CA", now)?;
    let key = AgentKey::generate()?;
    let agent = uuid::Uuid::new_v4();
    let cert = ca.sign_agent_csr(&key.csr_pem("bench")?, agent, now, time::Duration::days(1))?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut envelopes = Vec::with_capacity(args.envelopes);
    for i in 0..args.envelopes {
        let task_id = TaskId(uuid::Uuid::new_v4());
        let mut e = AgentTaskResultEnvelope {
            contract_version: CONTRACT_VERSION.into(),
            agent_id: AgentId(agent),
            task_id,
            assignment_id: Some(berth_proto::AssignmentId(uuid::Uuid::new_v4())),
            success: true,
            message: Some(format!("inspected {i}")),
            result_data: Some(serde_json::to_string(&inspected(task_id, now))?),
            duration: "00:00:00.0012000".into(),
            completed_at: now,
            signature_algorithm: transport::ALG_ECDSA_SHA256.into(),
            signature: None,
        };
        let sig = key.sign(&e.signing_input()?)?;
        e.signature = Some(b64.encode(&sig));
        // The server verifies the JSON it received, parsed: measure on that form.
        envelopes.push((serde_json::to_value(&e)?, sig));
    }
    let inputs: Vec<Vec<u8>> = envelopes
        .iter()
        .map(|(e, _)| transport::signing_input(e))
        .collect::<Result<_, _>>()?;
    let der = &cert.cert_der;
    // Built once for the agent's certificate, as the server does once per connection.
    let verifier = ResultVerifier::from_cert(der)?;
    let mut full = |i: usize| -> anyhow::Result<()> {
        let (e, sig) = &envelopes[i];
        let input = transport::signing_input(e)?;
        berth_crypto::verify_with_cert(der, transport::ALG_ECDSA_SHA256, &input, sig)?;
        Ok(())
    };
    let mut server = |i: usize| -> anyhow::Result<()> {
        let (e, sig) = &envelopes[i];
        let input = transport::signing_input(e)?;
        verifier.verify(transport::ALG_ECDSA_SHA256, &input, sig)?;
        Ok(())
    };
    let mut jcs = |i: usize| -> anyhow::Result<()> {
        std::hint::black_box(transport::signing_input(&envelopes[i].0)?);
        Ok(())
    };
    let mut verify_only = |i: usize| -> anyhow::Result<()> {
        berth_crypto::verify_with_cert(
            der,
            transport::ALG_ECDSA_SHA256,
            &inputs[i],
            &envelopes[i].1,
        )?;
        Ok(())
    };
    let mut verifier_only = |i: usize| -> anyhow::Result<()> {
        verifier.verify(transport::ALG_ECDSA_SHA256, &inputs[i], &envelopes[i].1)?;
        Ok(())
    };
    let mut from_cert = |_: usize| -> anyhow::Result<()> {
        std::hint::black_box(ResultVerifier::from_cert(std::hint::black_box(der))?);
        Ok(())
    };
    // Run r of every measurement before run r + 1 of any, so that load drifting on a shared
    // machine reaches all of them alike; each result is the median of its runs.
    let measurements: &mut [&mut dyn FnMut(usize) -> anyhow::Result<()>] = &mut [
        &mut full,
        &mut server,
        &mut jcs,
        &mut verify_only,
        &mut verifier_only,
        &mut from_cert,
    ];
    let mut rates = vec![Vec::with_capacity(args.runs); measurements.len()];
    for _ in 0..args.runs {
        for (f, rates) in measurements.iter_mut().zip(&mut rates) {
            let started = std::time::Instant::now();
            let mut n = 0usize;
            loop {
                f(n % args.envelopes)?;
                n += 1;
                if n.is_multiple_of(64) && started.elapsed().as_secs_f64() >= args.seconds {
                    break;
                }
            }
            rates.push(n as f64 / started.elapsed().as_secs_f64());
        }
    }
    let medians: Vec<f64> = rates.into_iter().map(crate::stats::median).collect();
    let [full, server, jcs, verify_only, verifier_only, from_cert] = medians[..] else {
        unreachable!("one median per measurement");
    };
    println!(
        "one thread, median of {} × {} s, {} distinct envelopes ({} bytes signed each):",
        args.runs,
        args.seconds,
        args.envelopes,
        inputs[0].len()
    );
    println!(
        "  server path, signing_input + ResultVerifier::verify: {server:.0}/s ({:.2}× per-call parse)",
        server / full
    );
    println!("  per-call parse, signing_input + verify_with_cert:    {full:.0}/s");
    println!("  signing_input (JCS) only:                            {jcs:.0}/s");
    println!("  ResultVerifier::verify only:                         {verifier_only:.0}/s");
    println!("  verify_with_cert only:                               {verify_only:.0}/s");
    println!("  ResultVerifier::from_cert (once per connection):     {from_cert:.0}/s");
    println!(
        "SUMMARY {}",
        json!({
            "scenario": "verify",
            "runs": args.runs,
            "seconds": args.seconds,
            "full_per_sec": full.round(),
            "server_per_sec": server.round(),
            "jcs_per_sec": jcs.round(),
            "verify_per_sec": verify_only.round(),
            "verifier_verify_per_sec": verifier_only.round(),
            "from_cert_per_sec": from_cert.round(),
        })
    );
    Ok(())
}
