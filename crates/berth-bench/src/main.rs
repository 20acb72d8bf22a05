//! `berth-bench`: load generators for `BENCHMARKS.md`. Simulated agents register like
//! `berth-agent --register` and heartbeat over their own mTLS connections against a real
//! server. It measures; it never changes server state beyond the agents it registers.
//!
//! The last line of every run is `SUMMARY {json}`, which `scripts/bench-heartbeats.sh`
//! collects.

mod checkins;
mod events;
mod fleet;
mod retention;
mod seal;
mod soak;
mod stats;
mod tasks;
mod ui;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use berth_client::Client;
use berth_proto::agent::{AgentStatus, Heartbeat, ResourceUsage};
use berth_proto::AgentId;
use clap::{Args, Parser, Subcommand};
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant as TokioInstant};

use crate::fleet::{Fleet, Target};
use crate::stats::{micros, rss_kib, BatchHistogram, CpuTimes, Latencies};

#[derive(Parser, Debug)]
#[command(
    name = "berth-bench",
    about = "Simulated agents against a real berth server"
)]
struct Cli {
    /// Tokio worker threads (default: one per core).
    #[arg(long, global = true)]
    worker_threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Open loop: N agents each heartbeat every S seconds at a random phase (N/S per second).
    Heartbeats(HeartbeatArgs),
    /// Closed loop: K agents each send the next heartbeat as soon as the previous one is
    /// answered, to find the server's maximum heartbeat throughput.
    Throughput(ThroughputArgs),
    /// Task transport end to end: agents long-poll, sign and submit results while tasks are
    /// created through the admin API (pickup and end-to-end latency, throughput).
    Tasks(tasks::TasksArgs),
    /// Result-signature verification per second on one thread (JCS + ECDSA P-256).
    Verify(tasks::VerifyArgs),
    /// HPKE sealing per task on one thread: an assignment's payload and credentials sealed and
    /// opened, its result log sealed and opened (medians, against a task's end-to-end time).
    Seal(seal::SealArgs),
    /// Retention on the store's clock: simulated days of a fleet's tasks, each followed by the
    /// retention prune, and the SQLite file's size after each day.
    RetentionSim(retention::RetentionArgs),
    /// Event delivery over SSE: N clients follow `/api/v1/events` while tasks are created at
    /// a steady rate; latency from commit to each client, against a baseline of fewer clients.
    Events(events::EventsArgs),
    /// Seed 001 checkins: N agents, each in its own environment, check in every S seconds
    /// (open loop), then the closed-loop maximum, side by side with the heartbeat maximum of
    /// the same agents.
    Checkins(checkins::CheckinsArgs),
    /// The web UI in headless Chromium: the agents page's first byte with N agents against the
    /// same page of the JSON API, and the time from a task's event to its row in the DOM
    /// against the event reaching an EventSource in the same page.
    Ui(ui::UiArgs),
    /// The verdict of a `scripts/soak.sh` run: acknowledged creates lost, side effects run
    /// twice, tasks stuck leased or unknown, from the database and the agents' state dirs.
    SoakCheck(soak::SoakCheckArgs),
}

#[derive(Args, Debug)]
struct Common {
    /// The server, e.g. https://127.0.0.1:8443.
    #[arg(long)]
    server: String,
    /// The server's CA certificate (ca.crt in its data dir).
    #[arg(long)]
    ca_file: PathBuf,
    /// An admin API token (admin.token in the server's data dir).
    #[arg(long, env = "BERTH_TOKEN", hide_env_values = true)]
    admin_token: String,
    /// Registrations in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency_register: usize,
    /// Prefix of the simulated agents' names.
    #[arg(long, default_value = "bench")]
    name_prefix: String,
}

#[derive(Args, Debug)]
struct HeartbeatArgs {
    #[command(flatten)]
    common: Common,
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    #[arg(long, default_value_t = 30)]
    interval_secs: u64,
    /// Length of the measured steady state. It starts one interval after the first heartbeats,
    /// once every agent has opened its connection.
    #[arg(long, default_value_t = 60)]
    duration_secs: u64,
    /// Write one line per measured heartbeat, `<unix ms when sent> <latency µs>`, to find out
    /// when the slow ones happen (and line them up with server-side traces).
    #[arg(long)]
    latency_log: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct ThroughputArgs {
    #[command(flatten)]
    common: Common,
    /// Agents heartbeating concurrently, each on its own connection.
    #[arg(long, default_value_t = 200)]
    agents: usize,
    #[arg(long, default_value_t = 30)]
    duration_secs: u64,
    /// Unmeasured time before the measurement (connections, caches).
    #[arg(long, default_value_t = 5)]
    warmup_secs: u64,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let (before, after, hard) = raise_nofile_limit().context("raising RLIMIT_NOFILE")?;
    println!("RLIMIT_NOFILE: soft limit {before} -> {after} (hard limit {hard})");
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(n) = cli.worker_threads {
        runtime.worker_threads(n);
    }
    let runtime = runtime.build().context("starting the runtime")?;
    runtime.block_on(async {
        match cli.command {
            Command::Heartbeats(args) => heartbeats(args).await,
            Command::Throughput(args) => throughput(args).await,
            Command::Tasks(args) => tasks::tasks(args).await,
            Command::Verify(args) => tasks::verify(&args),
            Command::Seal(args) => seal::seal(&args),
            Command::RetentionSim(args) => retention::retention(args).await,
            Command::Events(args) => events::events(args).await,
            Command::Checkins(args) => checkins::checkins(args).await,
            Command::Ui(args) => ui::ui(args).await,
            Command::SoakCheck(args) => soak::soak_check(args).await,
        }
    })
}

/// Sets the soft open-file limit to the hard limit: every simulated agent holds a socket.
fn raise_nofile_limit() -> anyhow::Result<(u64, u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own, nothing else.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let before = limit.rlim_cur;
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: setrlimit only reads the struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    Ok((before, limit.rlim_cur, limit.rlim_max))
}

/// Registers `agents` agents (labelled `<label_key>=<name>` with a key); the target, the
/// fleet and this process's RSS before registration.
async fn setup(
    common: &Common,
    agents: usize,
    label_key: Option<&str>,
) -> anyhow::Result<(Target, Fleet, u64)> {
    let ca_pem = std::fs::read_to_string(&common.ca_file)
        .with_context(|| format!("reading {}", common.ca_file.display()))?;
    let target = Target {
        server: common.server.trim_end_matches('/').to_string(),
        ca_pem,
        admin_token: common.admin_token.trim().to_string(),
    };
    let rss_before = rss_kib();
    println!(
        "registering {agents} agents against {} ({} in flight)",
        target.server, common.concurrency_register
    );
    let fleet = fleet::register(
        &target,
        &common.name_prefix,
        agents,
        common.concurrency_register,
        label_key,
    )
    .await?;
    fleet.print(agents);
    if fleet.agents.is_empty() {
        bail!("no agent registered");
    }
    Ok((target, fleet, rss_before))
}

/// The heartbeat an agent sends under `generation`, before its sequence and signature.
fn heartbeat_for(agent: AgentId, generation: i64) -> Heartbeat {
    Heartbeat {
        agent_id: agent,
        status: AgentStatus::Online,
        resource_usage: ResourceUsage {
            cpu_percent: 3.5,
            cpu_cores: 4,
            memory_used_bytes: 2_147_483_648,
            memory_total_bytes: 8_589_934_592,
            disk_free_bytes: 42_949_672_960,
            disk_total_bytes: 107_374_182_400,
        },
        capabilities: fleet::capabilities(),
        generation,
        sequence: 0,
        signature_algorithm: berth_proto::transport::ALG_ECDSA_SHA256.into(),
        signature: None,
    }
}

/// Sends one heartbeat under the agent's session generation; `Err` carries a short
/// description for the error tally.
async fn beat(
    client: &Client,
    heartbeat: &anyhow::Result<Heartbeat>,
    generation: &str,
) -> Result<(), String> {
    let heartbeat = heartbeat
        .as_ref()
        .map_err(|e| format!("signing the heartbeat: {e:#}"))?;
    let headers = [(berth_proto::transport::GENERATION_HEADER, generation)];
    match client.send_with(heartbeat, &headers, None).await {
        Ok(r) if r.acknowledged => Ok(()),
        Ok(_) => Err("not acknowledged".into()),
        Err(e) => {
            let text = format!("{:#}", anyhow::Error::new(e));
            Err(text.chars().take(200).collect())
        }
    }
}

/// What one simulated agent saw.
#[derive(Default)]
struct AgentReport {
    /// The first heartbeat, which opens the connection (TLS handshake included).
    first_us: Option<u64>,
    /// Successful heartbeats inside the measured window.
    measured_us: Vec<u64>,
    errors: Vec<String>,
    /// Latest start of a heartbeat after its scheduled time: is the load generator keeping up?
    max_lag_us: u64,
    /// `(unix ms when sent, latency µs)` of measured heartbeats, with `--latency-log` only.
    timeline: Vec<(u64, u64)>,
}

struct Totals {
    first: Latencies,
    measured: Latencies,
    errors: BTreeMap<String, usize>,
    error_count: usize,
    max_lag_us: u64,
    timeline: Vec<(u64, u64)>,
}

fn merge(reports: Vec<AgentReport>) -> Totals {
    let mut first = Vec::new();
    let mut measured = Vec::new();
    let mut errors = BTreeMap::new();
    let mut error_count = 0;
    let mut max_lag_us = 0;
    let mut timeline = Vec::new();
    for r in reports {
        timeline.extend(r.timeline);
        first.extend(r.first_us);
        measured.extend(r.measured_us);
        error_count += r.errors.len();
        for e in r.errors {
            *errors.entry(e).or_insert(0) += 1;
        }
        max_lag_us = max_lag_us.max(r.max_lag_us);
    }
    Totals {
        first: Latencies::from_micros(first),
        measured: Latencies::from_micros(measured),
        errors,
        error_count,
        max_lag_us,
        timeline,
    }
}

fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn write_timeline(path: &std::path::Path, mut timeline: Vec<(u64, u64)>) -> anyhow::Result<()> {
    use std::io::Write;
    timeline.sort_unstable();
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = std::io::BufWriter::new(file);
    for (sent_ms, latency_us) in timeline {
        writeln!(out, "{sent_ms} {latency_us}")?;
    }
    out.flush()?;
    Ok(())
}

fn print_errors(totals: &Totals) {
    for (e, n) in totals.errors.iter().take(10) {
        println!("  error ×{n}: {e}");
    }
}

async fn batch_snapshot(client: &Client) -> Option<BatchHistogram> {
    match client.get_text("/metrics").await {
        Ok(text) => Some(BatchHistogram::parse(&text)),
        Err(e) => {
            println!("warning: cannot read /metrics: {e}");
            None
        }
    }
}

/// Prints progress every 10 s so a long run shows it is alive.
fn progress(done: Arc<AtomicU64>, errors: Arc<AtomicU64>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let started = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(10));
        tick.tick().await;
        let mut last = 0;
        loop {
            tick.tick().await;
            let now = done.load(Ordering::Relaxed);
            println!(
                "  t={:>4.0} s  {:>8.1} heartbeats/s  ({} ok, {} errors, rss {} MiB)",
                started.elapsed().as_secs_f64(),
                (now - last) as f64 / 10.0,
                now,
                errors.load(Ordering::Relaxed),
                rss_kib() / 1024
            );
            last = now;
        }
    })
}

async fn heartbeats(args: HeartbeatArgs) -> anyhow::Result<()> {
    if args.interval_secs == 0 || args.duration_secs == 0 {
        bail!("--interval-secs and --duration-secs must be at least 1");
    }
    let (target, fleet, rss_before) = setup(&args.common, args.agents, None).await?;
    let n = fleet.agents.len();
    let rss_clients = rss_kib();
    let interval = Duration::from_secs(args.interval_secs);
    let measured = Duration::from_secs(args.duration_secs);
    let offered = n as f64 / interval.as_secs_f64();
    println!(
        "open loop: {n} agents every {} s = {offered:.1} heartbeats/s offered; \
         first interval opens the connections, then {} s measured",
        args.interval_secs, args.duration_secs
    );

    let start = TokioInstant::now() + Duration::from_millis(200);
    let measure_from = start + interval;
    let end = measure_from + measured;
    let metrics_client = target.client(None)?;
    let observer = {
        let metrics_client = metrics_client.clone();
        tokio::spawn(async move {
            sleep_until(measure_from).await;
            let cpu = CpuTimes::now();
            (rss_kib(), cpu, batch_snapshot(&metrics_client).await)
        })
    };
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let ticker = progress(done.clone(), failed.clone());
    let keep_timeline = args.latency_log.is_some();
    let mut tasks = JoinSet::new();
    // Heartbeats need a session generation, as a real agent's do.
    let workers = tasks::sessions(&fleet.agents, args.common.concurrency_register).await?;
    for agent in workers.iter() {
        let phase = interval.mul_f64(berth_crypto::random_unit());
        let (client, template) = (
            agent.client.clone(),
            heartbeat_for(agent.id, agent.generation),
        );
        let (key, generation) = (agent.key.clone(), agent.generation.to_string());
        let (done, failed) = (done.clone(), failed.clone());
        tasks.spawn(async move {
            let mut report = AgentReport::default();
            let mut scheduled = start + phase;
            let mut sequence = 0;
            while scheduled < end {
                sleep_until(scheduled).await;
                // Signed before the clock starts: the latency is the server's answer.
                sequence += 1;
                let heartbeat = fleet::signed_heartbeat(&template, sequence, &key);
                let sent = TokioInstant::now();
                let sent_ms = if keep_timeline { unix_millis() } else { 0 };
                report.max_lag_us = report.max_lag_us.max(micros(sent - scheduled));
                let result = beat(&client, &heartbeat, &generation).await;
                let took = micros(sent.elapsed());
                match result {
                    Ok(()) => {
                        done.fetch_add(1, Ordering::Relaxed);
                        if scheduled < measure_from {
                            report.first_us = Some(took);
                        } else {
                            report.measured_us.push(took);
                            if keep_timeline {
                                report.timeline.push((sent_ms, took));
                            }
                        }
                    }
                    Err(e) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        report.errors.push(e);
                    }
                }
                scheduled += interval;
            }
            report
        });
    }
    let reports = collect(tasks).await?;
    let cpu = CpuTimes::now();
    ticker.abort();
    let (rss_connected, cpu_from, batches_from) = observer.await.context("observer panicked")?;
    let cpu = cpu.since(&cpu_from);
    let batches_to = batch_snapshot(&metrics_client).await;
    let mut totals = merge(reports);
    if let Some(path) = &args.latency_log {
        write_timeline(path, std::mem::take(&mut totals.timeline))?;
        println!("latency log: {}", path.display());
    }
    let achieved = totals.measured.count as f64 / measured.as_secs_f64();

    println!(
        "first heartbeat per agent (opens its mTLS connection): {}",
        totals.first
    );
    println!(
        "steady state, {} s: offered {offered:.1}/s, achieved {achieved:.1}/s, {} errors",
        args.duration_secs, totals.error_count
    );
    println!("  heartbeat latency: {}", totals.measured);
    println!(
        "  load generator lag (start after schedule), max: {:.1} ms",
        totals.max_lag_us as f64 / 1000.0
    );
    println!("  cpu during the steady state: {cpu}");
    print_errors(&totals);
    let per_agent_kib = rss_connected.saturating_sub(rss_before) as f64 / n as f64;
    println!(
        "bench process RSS: {} MiB before registration, {} MiB with {n} clients, {} MiB with {n} open connections ({per_agent_kib:.1} KiB per simulated agent)",
        rss_before / 1024,
        rss_clients / 1024,
        rss_connected / 1024
    );
    let batches = match (batches_from, batches_to) {
        (Some(from), Some(to)) => {
            let delta = to.since(&from);
            println!("server heartbeat commits during the steady state: {delta}");
            Some(delta)
        }
        _ => None,
    };
    println!(
        "SUMMARY {}",
        json!({
            "scenario": "heartbeats",
            "agents": n,
            "interval_secs": args.interval_secs,
            "duration_secs": args.duration_secs,
            "registration": registration_json(&fleet),
            "first_heartbeat": totals.first.to_json(),
            "offered_per_sec": (offered * 10.0).round() / 10.0,
            "achieved_per_sec": (achieved * 10.0).round() / 10.0,
            "latency": totals.measured.to_json(),
            "errors": totals.error_count,
            "max_lag_ms": totals.max_lag_us as f64 / 1000.0,
            "cpu": cpu.to_json(),
            "bench_rss_kib_per_agent": (per_agent_kib * 10.0).round() / 10.0,
            "batches": batches.map(|b| b.to_json()),
        })
    );
    Ok(())
}

async fn throughput(args: ThroughputArgs) -> anyhow::Result<()> {
    if args.duration_secs == 0 {
        bail!("--duration-secs must be at least 1");
    }
    let (target, fleet, _) = setup(&args.common, args.agents, None).await?;
    let n = fleet.agents.len();
    let measured = Duration::from_secs(args.duration_secs);
    println!(
        "closed loop: {n} agents, {} s warm-up, {} s measured",
        args.warmup_secs, args.duration_secs
    );
    let measure_from = TokioInstant::now() + Duration::from_secs(args.warmup_secs);
    let end = measure_from + measured;
    let metrics_client = target.client(None)?;
    let observer = {
        let metrics_client = metrics_client.clone();
        tokio::spawn(async move {
            sleep_until(measure_from).await;
            let cpu = CpuTimes::now();
            (cpu, batch_snapshot(&metrics_client).await)
        })
    };
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let ticker = progress(done.clone(), failed.clone());
    let workers = tasks::sessions(&fleet.agents, args.common.concurrency_register).await?;
    let tasks = closed_heartbeat_loops(&workers, measure_from, end, &done, &failed);
    let reports = collect(tasks).await?;
    let cpu = CpuTimes::now();
    ticker.abort();
    let (cpu_from, batches_from) = observer.await.context("observer panicked")?;
    let cpu = cpu.since(&cpu_from);
    let batches_to = batch_snapshot(&metrics_client).await;
    let totals = merge(reports);
    let rate = totals.measured.count as f64 / measured.as_secs_f64();
    println!(
        "first heartbeat per agent (opens its mTLS connection): {}",
        totals.first
    );
    println!(
        "max throughput with {n} agents in a closed loop: {rate:.0} heartbeats/s, {} errors",
        totals.error_count
    );
    println!("  heartbeat latency: {}", totals.measured);
    println!("  cpu during the measurement: {cpu}");
    print_errors(&totals);
    let batches = match (batches_from, batches_to) {
        (Some(from), Some(to)) => {
            let delta = to.since(&from);
            println!("server heartbeat commits during the measurement: {delta}");
            Some(delta)
        }
        _ => None,
    };
    println!(
        "SUMMARY {}",
        json!({
            "scenario": "throughput",
            "agents": n,
            "duration_secs": args.duration_secs,
            "registration": registration_json(&fleet),
            "throughput_per_sec": rate.round(),
            "cpu": cpu.to_json(),
            "latency": totals.measured.to_json(),
            "errors": totals.error_count,
            "batches": batches.map(|b| b.to_json()),
        })
    );
    Ok(())
}

/// Closed loop: each of `workers` heartbeats back to back until `end`; latencies from
/// `measure_from` on (the first heartbeat, which opens the connection, apart).
fn closed_heartbeat_loops(
    workers: &[tasks::Worker],
    measure_from: TokioInstant,
    end: TokioInstant,
    done: &Arc<AtomicU64>,
    failed: &Arc<AtomicU64>,
) -> JoinSet<AgentReport> {
    let mut tasks = JoinSet::new();
    for agent in workers.iter() {
        let (client, template) = (
            agent.client.clone(),
            heartbeat_for(agent.id, agent.generation),
        );
        let (key, generation) = (agent.key.clone(), agent.generation.to_string());
        let (done, failed) = (done.clone(), failed.clone());
        tasks.spawn(async move {
            let mut report = AgentReport::default();
            let mut sequence = 0;
            loop {
                sequence += 1;
                let heartbeat = fleet::signed_heartbeat(&template, sequence, &key);
                let sent = TokioInstant::now();
                if sent >= end {
                    break;
                }
                let result = beat(&client, &heartbeat, &generation).await;
                let took = micros(sent.elapsed());
                match result {
                    Ok(()) => {
                        done.fetch_add(1, Ordering::Relaxed);
                        if report.first_us.is_none() {
                            report.first_us = Some(took);
                        } else if sent >= measure_from {
                            report.measured_us.push(took);
                        }
                    }
                    Err(e) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        report.errors.push(e);
                        // A refused or broken call must not turn into a busy loop.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
            report
        });
    }
    tasks
}

async fn collect(mut tasks: JoinSet<AgentReport>) -> anyhow::Result<Vec<AgentReport>> {
    let mut reports = Vec::with_capacity(tasks.len());
    while let Some(joined) = tasks.join_next().await {
        reports.push(joined.context("a simulated agent panicked")?);
    }
    Ok(reports)
}

fn registration_json(fleet: &Fleet) -> serde_json::Value {
    json!({
        "registered": fleet.agents.len(),
        "failed": fleet.errors.len(),
        "seconds": (fleet.elapsed.as_secs_f64() * 100.0).round() / 100.0,
        "per_sec": fleet.rate().round(),
        "create_token": fleet.token_latency.to_json(),
        "register": fleet.register_latency.to_json(),
    })
}
