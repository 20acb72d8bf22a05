//! `berth-bench checkins`: seed 001's `POST /v1/agent/checkin` at fleet scale. Every simulated
//! agent registers with the label `env=<its name>` and gets its own environment (selector
//! `env=<its name>`), as a fleet of one host per environment would. Then:
//!
//! 1. open loop: each agent checks in once per `--interval-secs` at a random phase (N/S per
//!    second offered), measured for `--duration-secs` after the first interval (which opens the
//!    connections);
//! 2. closed loop: `--concurrency` checkins in flight, each taking the next agent round-robin
//!    over all N, so each environment's bucket (6 a minute) is hit N times less often than
//!    the server is;
//! 3. the baseline, same run: the heartbeat closed loop (`throughput`'s code path) of the
//!    first `--concurrency` agents, each on its own connection.
//!
//! 429s (`RATE_LIMITED`) are counted apart from other errors. The SUMMARY line carries each
//! phase's wall-clock window so the script can attribute the server's CPU to it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use berth_client::Client;
use berth_proto::deploy::{CreateEnvironment, Tier};
use berth_proto::desired::{Checkin, HostFacts};
use clap::Args;
use serde_json::json;
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant as TokioInstant};

use crate::fleet::{SimAgent, Target};
use crate::stats::{micros, CpuTimes, Latencies};
use crate::{merge, progress, tasks, Common};

/// The label every simulated agent carries (`env=<name>`) and its environment selects by.
const LABEL_KEY: &str = "env";

#[derive(Args, Debug)]
pub struct CheckinsArgs {
    #[command(flatten)]
    common: Common,
    /// Agents, each in an environment of its own.
    #[arg(long, default_value_t = 10_000)]
    agents: usize,
    /// Seconds between one agent's checkins in the open loop (`checkin_interval_s`).
    #[arg(long, default_value_t = 60)]
    interval_secs: u64,
    /// Measured open-loop seconds, after the first interval. 0 skips the open loop.
    #[arg(long, default_value_t = 60)]
    duration_secs: u64,
    /// Requests in flight in the closed loops (checkins round-robin over all agents; the
    /// heartbeat baseline on this many agents).
    #[arg(long, default_value_t = 200)]
    concurrency: usize,
    /// Measured seconds of each closed loop.
    #[arg(long, default_value_t = 30)]
    closed_duration_secs: u64,
    /// Unmeasured seconds before each closed loop's measurement.
    #[arg(long, default_value_t = 5)]
    warmup_secs: u64,
    /// Environment creations in flight.
    #[arg(long, default_value_t = 16)]
    concurrency_env: usize,
}

/// What one checkin loop saw.
#[derive(Default)]
struct Tally {
    measured_us: Vec<u64>,
    first_us: Vec<u64>,
    rate_limited: usize,
    errors: BTreeMap<String, usize>,
}

impl Tally {
    fn absorb(&mut self, other: Tally) {
        self.measured_us.extend(other.measured_us);
        self.first_us.extend(other.first_us);
        self.rate_limited += other.rate_limited;
        for (e, n) in other.errors {
            *self.errors.entry(e).or_insert(0) += n;
        }
    }

    fn error_count(&self) -> usize {
        self.errors.values().sum()
    }

    fn print_errors(&self) {
        for (e, n) in self.errors.iter().take(10) {
            println!("  error ×{n}: {e}");
        }
    }
}

/// One agent's checkin: its client and the body it sends (a converged agent's: nothing
/// applied, no containers; the server records it and answers `none`).
#[derive(Clone)]
struct Checker {
    client: Client,
    body: Arc<Checkin>,
}

impl Checker {
    fn new(agent: &SimAgent) -> Checker {
        Checker {
            client: agent.client.clone(),
            body: Arc::new(Checkin {
                env_id: agent.name.clone(),
                agent_version: Some("bench".into()),
                applied_sha: None,
                host: HostFacts {
                    hostname: Some(agent.name.clone()),
                    agent_version: Some("bench".into()),
                    transport: Some("mtls".into()),
                    ..HostFacts::default()
                },
                containers: Vec::new(),
            }),
        }
    }

    /// `Ok(true)` answered, `Ok(false)` refused by the rate bucket, `Err` anything else.
    async fn check_in(&self) -> Result<bool, String> {
        match self.client.send(self.body.as_ref()).await {
            Ok(_) => Ok(true),
            Err(e) if e.status() == Some(429) => Ok(false),
            Err(e) => {
                let text = format!("{:#}", anyhow::Error::new(e));
                Err(text.chars().take(200).collect())
            }
        }
    }

    /// One checkin into `tally`: measured or first (connection-opening) latency.
    async fn record(
        &self,
        tally: &mut Tally,
        measured: bool,
        done: &AtomicU64,
        failed: &AtomicU64,
    ) {
        let sent = TokioInstant::now();
        let result = self.check_in().await;
        let took = micros(sent.elapsed());
        match result {
            Ok(true) => {
                done.fetch_add(1, Ordering::Relaxed);
                if measured {
                    tally.measured_us.push(took);
                } else {
                    tally.first_us.push(took);
                }
            }
            Ok(false) => {
                failed.fetch_add(1, Ordering::Relaxed);
                tally.rate_limited += 1;
            }
            Err(e) => {
                failed.fetch_add(1, Ordering::Relaxed);
                *tally.errors.entry(e).or_insert(0) += 1;
            }
        }
    }
}

fn unix_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Creates one environment per agent, named and selecting by the agent's name.
async fn create_environments(
    target: &Target,
    agents: &[SimAgent],
    concurrency: usize,
) -> anyhow::Result<(Latencies, Duration, Vec<String>)> {
    let admin = target.client(Some(target.admin_token.clone()))?;
    let names: Arc<Vec<String>> = Arc::new(agents.iter().map(|a| a.name.clone()).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = JoinSet::new();
    for _ in 0..concurrency.clamp(1, names.len().max(1)) {
        let (admin, names, next) = (admin.clone(), names.clone(), next.clone());
        workers.spawn(async move {
            let (mut took, mut errors) = (Vec::new(), Vec::new());
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(name) = names.get(i) else { break };
                let request = CreateEnvironment {
                    name: name.clone(),
                    tier: Tier::Dev,
                    selector: BTreeMap::from([(LABEL_KEY.to_string(), name.clone())]),
                    target_type: Default::default(),
                    policy: Default::default(),
                    promote_from: None,
                    approvals: None,
                    auto_heal: false,
                    drift_interval_secs: None,
                };
                let t = Instant::now();
                match admin.send(&request).await {
                    Ok(_) => took.push(micros(t.elapsed())),
                    Err(e) => errors.push(format!("{name}: {e}")),
                }
            }
            (took, errors)
        });
    }
    let (mut took, mut errors) = (Vec::new(), Vec::new());
    while let Some(joined) = workers.join_next().await {
        let (t, e) = joined.context("environment worker panicked")?;
        took.extend(t);
        errors.extend(e);
    }
    Ok((Latencies::from_micros(took), started.elapsed(), errors))
}

pub async fn checkins(args: CheckinsArgs) -> anyhow::Result<()> {
    if args.interval_secs == 0 || args.closed_duration_secs == 0 {
        bail!("--interval-secs and --closed-duration-secs must be at least 1");
    }
    let (target, fleet, _) = crate::setup(&args.common, args.agents, Some(LABEL_KEY)).await?;
    let n = fleet.agents.len();
    println!(
        "creating {n} environments ({} in flight)",
        args.concurrency_env
    );
    let (env_latency, env_elapsed, env_errors) =
        create_environments(&target, &fleet.agents, args.concurrency_env).await?;
    println!(
        "created {} environments in {:.2} s ({:.0}/s); {} failed",
        env_latency.count,
        env_elapsed.as_secs_f64(),
        env_latency.count as f64 / env_elapsed.as_secs_f64().max(1e-9),
        env_errors.len()
    );
    println!("  create environment: {env_latency}");
    for e in env_errors.iter().take(5) {
        println!("  environment error: {e}");
    }
    if !env_errors.is_empty() {
        bail!("{} environments could not be created", env_errors.len());
    }
    let checkers: Arc<Vec<Checker>> = Arc::new(fleet.agents.iter().map(Checker::new).collect());

    let open = if args.duration_secs > 0 {
        Some(open_loop(&checkers, &args).await?)
    } else {
        None
    };
    let closed = closed_checkins(&checkers, &args).await?;
    let baseline = closed_heartbeats(&fleet.agents, &args).await?;
    println!(
        "closed loop, {} in flight: checkins {:.0}/s against heartbeats {:.0}/s (ratio {:.2})",
        args.concurrency,
        closed["throughput_per_sec"].as_f64().unwrap_or(0.0),
        baseline["throughput_per_sec"].as_f64().unwrap_or(0.0),
        closed["throughput_per_sec"].as_f64().unwrap_or(0.0)
            / baseline["throughput_per_sec"]
                .as_f64()
                .unwrap_or(1.0)
                .max(1.0),
    );
    println!(
        "SUMMARY {}",
        json!({
            "scenario": "checkins",
            "agents": n,
            "environments": env_latency.count,
            "registration": crate::registration_json(&fleet),
            "create_environment": {
                "seconds": (env_elapsed.as_secs_f64() * 100.0).round() / 100.0,
                "per_sec": (env_latency.count as f64 / env_elapsed.as_secs_f64().max(1e-9)).round(),
                "latency": env_latency.to_json(),
            },
            "open": open,
            "closed": closed,
            "heartbeat_baseline": baseline,
        })
    );
    Ok(())
}

async fn open_loop(
    checkers: &Arc<Vec<Checker>>,
    args: &CheckinsArgs,
) -> anyhow::Result<serde_json::Value> {
    let n = checkers.len();
    let interval = Duration::from_secs(args.interval_secs);
    let measured = Duration::from_secs(args.duration_secs);
    let offered = n as f64 / interval.as_secs_f64();
    println!(
        "open loop: {n} agents check in every {} s = {offered:.1} checkins/s offered; \
         the first interval opens the connections, then {} s measured",
        args.interval_secs, args.duration_secs
    );
    let start = TokioInstant::now() + Duration::from_millis(200);
    let measure_from = start + interval;
    let end = measure_from + measured;
    let window_start = unix_secs() + 0.2 + interval.as_secs_f64();
    let cpu_from = tokio::spawn(async move {
        sleep_until(measure_from).await;
        CpuTimes::now()
    });
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let ticker = progress(done.clone(), failed.clone());
    let mut set = JoinSet::new();
    for i in 0..n {
        let phase = interval.mul_f64(berth_crypto::random_unit());
        let (checkers, done, failed) = (checkers.clone(), done.clone(), failed.clone());
        set.spawn(async move {
            let checker = &checkers[i];
            let mut tally = Tally::default();
            let mut max_lag_us = 0;
            let mut scheduled = start + phase;
            while scheduled < end {
                sleep_until(scheduled).await;
                max_lag_us = max_lag_us.max(micros(TokioInstant::now() - scheduled));
                checker
                    .record(&mut tally, scheduled >= measure_from, &done, &failed)
                    .await;
                scheduled += interval;
            }
            (tally, max_lag_us)
        });
    }
    let mut tally = Tally::default();
    let mut max_lag_us = 0;
    while let Some(joined) = set.join_next().await {
        let (t, lag) = joined.context("a simulated agent panicked")?;
        tally.absorb(t);
        max_lag_us = max_lag_us.max(lag);
    }
    let cpu = CpuTimes::now().since(&cpu_from.await.context("cpu observer panicked")?);
    let window_end = unix_secs();
    ticker.abort();
    let first = Latencies::from_micros(std::mem::take(&mut tally.first_us));
    let latency = Latencies::from_micros(std::mem::take(&mut tally.measured_us));
    let achieved = latency.count as f64 / measured.as_secs_f64();
    println!("first checkin per agent (opens its mTLS connection): {first}");
    println!(
        "steady state, {} s: offered {offered:.1}/s, achieved {achieved:.1}/s, {} rate-limited (429), {} other errors",
        args.duration_secs,
        tally.rate_limited,
        tally.error_count()
    );
    println!("  checkin latency: {latency}");
    println!(
        "  load generator lag (start after schedule), max: {:.1} ms",
        max_lag_us as f64 / 1000.0
    );
    println!("  cpu during the steady state: {cpu}");
    tally.print_errors();
    Ok(json!({
        "interval_secs": args.interval_secs,
        "duration_secs": args.duration_secs,
        "offered_per_sec": (offered * 10.0).round() / 10.0,
        "achieved_per_sec": (achieved * 10.0).round() / 10.0,
        "first_checkin": first.to_json(),
        "latency": latency.to_json(),
        "rate_limited": tally.rate_limited,
        "errors": tally.error_count(),
        "max_lag_ms": max_lag_us as f64 / 1000.0,
        "cpu": cpu.to_json(),
        "window": [window_start, window_end],
    }))
}

async fn closed_checkins(
    checkers: &Arc<Vec<Checker>>,
    args: &CheckinsArgs,
) -> anyhow::Result<serde_json::Value> {
    let n = checkers.len();
    let k = args.concurrency.max(1);
    println!(
        "closed loop: {k} checkins in flight, round-robin over {n} agents/environments, \
         {} s warm-up, {} s measured",
        args.warmup_secs, args.closed_duration_secs
    );
    let (tallies, window, cpu) = closed_window(args, |measure_from, end, done, failed| {
        let next = Arc::new(AtomicUsize::new(0));
        let mut set = JoinSet::new();
        for _ in 0..k {
            let (checkers, next, done, failed) =
                (checkers.clone(), next.clone(), done.clone(), failed.clone());
            set.spawn(async move {
                let mut tally = Tally::default();
                loop {
                    let now = TokioInstant::now();
                    if now >= end {
                        break;
                    }
                    let checker = &checkers[next.fetch_add(1, Ordering::Relaxed) % n];
                    checker
                        .record(&mut tally, now >= measure_from, &done, &failed)
                        .await;
                }
                tally
            });
        }
        set
    })
    .await?;
    let mut tally = Tally::default();
    for t in tallies {
        tally.absorb(t);
    }
    let latency = Latencies::from_micros(std::mem::take(&mut tally.measured_us));
    let rate = latency.count as f64 / args.closed_duration_secs as f64;
    println!(
        "max checkins with {k} in flight: {rate:.0}/s, {} rate-limited (429), {} other errors",
        tally.rate_limited,
        tally.error_count()
    );
    println!("  checkin latency: {latency}");
    println!("  cpu during the measurement: {cpu}");
    tally.print_errors();
    Ok(json!({
        "concurrency": k,
        "duration_secs": args.closed_duration_secs,
        "throughput_per_sec": rate.round(),
        "latency": latency.to_json(),
        "rate_limited": tally.rate_limited,
        "errors": tally.error_count(),
        "cpu": cpu.to_json(),
        "window": window,
    }))
}

/// Runs the loops `spawn` starts over `--warmup-secs` + `--closed-duration-secs`: what each
/// returned, the measured wall-clock window (unix seconds) and this machine's CPU in it.
async fn closed_window<T, F>(
    args: &CheckinsArgs,
    spawn: F,
) -> anyhow::Result<(Vec<T>, [f64; 2], crate::stats::CpuUsage)>
where
    T: Send + 'static,
    F: FnOnce(TokioInstant, TokioInstant, Arc<AtomicU64>, Arc<AtomicU64>) -> JoinSet<T>,
{
    let warmup = Duration::from_secs(args.warmup_secs);
    let measure_from = TokioInstant::now() + warmup;
    let end = measure_from + Duration::from_secs(args.closed_duration_secs);
    let window_start = unix_secs() + warmup.as_secs_f64();
    let cpu_from = tokio::spawn(async move {
        sleep_until(measure_from).await;
        CpuTimes::now()
    });
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let ticker = progress(done.clone(), failed.clone());
    let mut set = spawn(measure_from, end, done, failed);
    let mut out = Vec::with_capacity(set.len());
    while let Some(joined) = set.join_next().await {
        out.push(joined.context("a closed-loop worker panicked")?);
    }
    let cpu = CpuTimes::now().since(&cpu_from.await.context("cpu observer panicked")?);
    ticker.abort();
    Ok((out, [window_start, unix_secs()], cpu))
}

/// The baseline: `throughput`'s heartbeat closed loop on the first `--concurrency` agents.
async fn closed_heartbeats(
    agents: &[SimAgent],
    args: &CheckinsArgs,
) -> anyhow::Result<serde_json::Value> {
    let k = args.concurrency.clamp(1, agents.len());
    let workers = tasks::sessions(&agents[..k], args.common.concurrency_register).await?;
    println!(
        "baseline: heartbeat closed loop, {k} agents on their own connections, {} s warm-up, {} s measured",
        args.warmup_secs, args.closed_duration_secs
    );
    let (reports, window, cpu) = closed_window(args, |measure_from, end, done, failed| {
        crate::closed_heartbeat_loops(&workers, measure_from, end, &done, &failed)
    })
    .await?;
    let totals = merge(reports);
    let rate = totals.measured.count as f64 / args.closed_duration_secs as f64;
    println!(
        "max heartbeats with {k} agents in a closed loop: {rate:.0}/s, {} errors",
        totals.error_count
    );
    println!("  heartbeat latency: {}", totals.measured);
    println!("  cpu during the measurement: {cpu}");
    crate::print_errors(&totals);
    Ok(json!({
        "agents": k,
        "duration_secs": args.closed_duration_secs,
        "throughput_per_sec": rate.round(),
        "latency": totals.measured.to_json(),
        "errors": totals.error_count,
        "cpu": cpu.to_json(),
        "window": window,
    }))
}
