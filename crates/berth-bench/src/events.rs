//! `berth-bench events`: event delivery latency over `GET /api/v1/events` (SSE). N clients,
//! each an admin client on its own connection, follow the stream while one creator makes
//! `inspect` tasks through the admin API at a steady rate; the `task.state` event of each new
//! task is written by a trigger in the same commit as the task. A baseline with fewer clients
//! (default 1) runs in the same invocation against the same server, alternating round by round.
//!
//! "From commit": the commit happens after the create request is sent and before its 201 is
//! received, so the delivery latency from commit lies between `t1 - received` (reported as
//! "from 201", a lower bound, 0 for events that beat the response) and `t1 - sent` (an upper
//! bound), where `t1` is when a client has parsed the event. Both are reported over every
//! (client, event) pair. Every client must receive every created task's event exactly once and
//! event ids in increasing order; otherwise the run fails.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use berth_client::{Client, EventStream};
use berth_proto::event::EventQuery;
use berth_proto::{AgentId, TaskId};
use clap::Args;
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{sleep_until, Instant};

use crate::fleet::Target;
use crate::stats::{median, micros, CpuTimes, CpuUsage, Latencies};
use crate::Common;

#[derive(Args, Debug)]
pub struct EventsArgs {
    #[command(flatten)]
    common: Common,
    /// SSE clients of the measured case, each on its own connection.
    #[arg(long, default_value_t = 100)]
    clients: usize,
    /// SSE clients of the baseline case.
    #[arg(long, default_value_t = 1)]
    baseline_clients: usize,
    /// Tasks (so `task.state` events) created per second, open loop, one at a time.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Creating time per case and round.
    #[arg(long, default_value_t = 20)]
    duration_secs: u64,
    /// Rounds of (baseline, measured); figures are the medians over the rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// After the last create, wait at most this long for every client to see every event.
    #[arg(long, default_value_t = 15)]
    drain_secs: u64,
}

/// One case of one round.
struct Case {
    clients: usize,
    created: usize,
    from_response: Latencies,
    from_sent: Latencies,
    /// (client, event) pairs parsed before the create's 201 arrived.
    early: usize,
    create: Latencies,
    max_lag_us: u64,
    cpu: CpuUsage,
}

/// What one client saw.
#[derive(Default)]
struct ClientLog {
    /// `task.state` events: (task, when parsed).
    tasks: Vec<(TaskId, Instant)>,
    /// Ids not above the one before: a repeat or a reordering.
    out_of_order: usize,
    last_id: u64,
}

pub async fn events(args: EventsArgs) -> anyhow::Result<()> {
    if args.clients == 0 || args.baseline_clients == 0 || args.rounds == 0 {
        bail!("--clients, --baseline-clients and --rounds must be at least 1");
    }
    if args.rate <= 0.0 || !args.rate.is_finite() || args.duration_secs == 0 {
        bail!("--rate and --duration-secs must be positive");
    }
    // Tasks need an agent that can run them; it never polls, so they stay queued and write
    // no further events.
    let (target, fleet, _) = crate::setup(&args.common, 1, None).await?;
    let agent = fleet.agents[0].id;
    let admin = target.client(Some(target.admin_token.clone()))?;
    let mut cursor = catch_up(&admin, 0).await?;
    let mut cases: [Vec<Case>; 2] = [Vec::new(), Vec::new()];
    for round in 1..=args.rounds {
        for (i, clients) in [args.baseline_clients, args.clients]
            .into_iter()
            .enumerate()
        {
            let case = run_case(&args, &target, &admin, agent, clients, cursor).await?;
            println!(
                "round {round}, {clients} client(s), {} events:\n  from sent {}\n  from 201  {} ({} before it)\n  create    {}\n  {}",
                case.created, case.from_sent, case.from_response, case.early, case.create, case.cpu
            );
            cases[i].push(case);
            cursor = catch_up(&admin, cursor).await?;
        }
    }
    report(&args, &cases);
    Ok(())
}

/// The id of the last stored event after `after` (`follow=false`), so the next case's clients
/// start at the present instead of replaying the past.
async fn catch_up(admin: &Client, after: u64) -> anyhow::Result<u64> {
    let query = EventQuery {
        follow: Some(false),
        ..Default::default()
    };
    let mut stream = admin
        .events(&query, Some(after), Duration::from_secs(60))
        .await?;
    let mut last = after;
    while let Some(event) = stream.next().await? {
        last = event.id;
    }
    Ok(last)
}

async fn run_case(
    args: &EventsArgs,
    target: &Target,
    admin: &Client,
    agent: AgentId,
    clients: usize,
    after: u64,
) -> anyhow::Result<Case> {
    // Opened before any create: once `events` returns, the server has subscribed this stream
    // to commits, so nothing created afterwards can be missed. Each `Client` has its own
    // connection pool, so each stream its own connection.
    let lifetime = Duration::from_secs(args.duration_secs + args.drain_secs + 60);
    let mut opening = JoinSet::new();
    for _ in 0..clients {
        let client = target.client(Some(target.admin_token.clone()))?;
        opening.spawn(async move {
            let stream = client
                .events(&EventQuery::default(), Some(after), lifetime)
                .await?;
            anyhow::Ok(stream)
        });
    }
    let (stop_tx, stop_rx) = watch::channel(false);
    let seen = Arc::new(AtomicU64::new(0));
    let mut readers = JoinSet::new();
    while let Some(opened) = opening.join_next().await {
        let stream = opened.context("opening task panicked")??;
        readers.spawn(read(stream, after, stop_rx.clone(), seen.clone()));
    }

    let cpu_from = CpuTimes::now();
    let created = create_loop(args, admin, agent).await?;
    let cpu = CpuTimes::now().since(&cpu_from);
    let want = (created.tasks.len() * clients) as u64;
    let deadline = Instant::now() + Duration::from_secs(args.drain_secs);
    while seen.load(Ordering::Relaxed) < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop_tx.send(true);
    let mut logs = Vec::with_capacity(clients);
    while let Some(joined) = readers.join_next().await {
        logs.push(joined.context("an SSE client panicked")??);
    }

    let index: HashMap<TaskId, (Instant, Instant)> = created
        .tasks
        .iter()
        .map(|(t, sent, received)| (*t, (*sent, *received)))
        .collect();
    let (mut from_response, mut from_sent, mut early) = (Vec::new(), Vec::new(), 0);
    let mut failures = Vec::new();
    for (c, log) in logs.iter().enumerate() {
        let mut count: HashMap<TaskId, usize> = HashMap::new();
        for (task, at) in &log.tasks {
            *count.entry(*task).or_default() += 1;
            let Some((sent, received)) = index.get(task) else {
                continue;
            };
            if at < received {
                early += 1;
            }
            from_response.push(micros(at.saturating_duration_since(*received)));
            from_sent.push(micros(at.saturating_duration_since(*sent)));
        }
        let missing = index.keys().filter(|t| !count.contains_key(t)).count();
        let repeated = count.values().filter(|n| **n > 1).count();
        let foreign = count.keys().filter(|t| !index.contains_key(t)).count();
        if missing + repeated + foreign + log.out_of_order > 0 {
            failures.push(format!(
                "client {c}: {missing} missing, {repeated} repeated, {foreign} of unknown tasks, {} out of order (last id {})",
                log.out_of_order, log.last_id
            ));
        }
    }
    if !failures.is_empty() {
        for f in failures.iter().take(10) {
            println!("  DELIVERY FAILURE {f}");
        }
        bail!(
            "{} of {clients} clients did not receive each of the {} events exactly once",
            failures.len(),
            index.len()
        );
    }
    Ok(Case {
        clients,
        created: index.len(),
        from_response: Latencies::from_micros(from_response),
        from_sent: Latencies::from_micros(from_sent),
        early,
        create: Latencies::from_micros(
            created
                .tasks
                .iter()
                .map(|(_, s, r)| micros(*r - *s))
                .collect(),
        ),
        max_lag_us: created.max_lag_us,
        cpu,
    })
}

async fn read(
    mut stream: EventStream,
    after: u64,
    mut stop: watch::Receiver<bool>,
    seen: Arc<AtomicU64>,
) -> anyhow::Result<ClientLog> {
    let mut log = ClientLog {
        last_id: after,
        ..Default::default()
    };
    loop {
        let next = tokio::select! {
            _ = stop.wait_for(|s| *s) => return Ok(log),
            next = stream.next() => next,
        };
        let at = Instant::now();
        let Some(event) = next.context("reading the event stream")? else {
            bail!("the server ended the event stream");
        };
        if event.id <= log.last_id {
            log.out_of_order += 1;
        }
        log.last_id = event.id;
        if let (berth_proto::event::TASK_STATE, Some(task)) = (event.kind.as_str(), event.task_id) {
            log.tasks.push((task, at));
            seen.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[derive(Default)]
struct Created {
    /// (task, request sent, 201 received).
    tasks: Vec<(TaskId, Instant, Instant)>,
    max_lag_us: u64,
}

/// One create at a time on a fixed schedule; a slow create makes the next ones late (the
/// lateness is reported), never skipped.
async fn create_loop(args: &EventsArgs, admin: &Client, agent: AgentId) -> anyhow::Result<Created> {
    let mut out = Created::default();
    let start = Instant::now() + Duration::from_millis(100);
    let end = start + Duration::from_secs(args.duration_secs);
    for i in 0u32.. {
        let scheduled = start + Duration::from_secs_f64(f64::from(i) / args.rate);
        if scheduled >= end {
            break;
        }
        sleep_until(scheduled).await;
        let sent = Instant::now();
        out.max_lag_us = out.max_lag_us.max(micros(sent - scheduled));
        let task = admin
            .send(&crate::tasks::create_request(agent))
            .await
            .context("creating a task")?;
        out.tasks.push((task.id, sent, Instant::now()));
    }
    Ok(out)
}

fn report(args: &EventsArgs, cases: &[Vec<Case>; 2]) {
    // Median over the rounds of one figure of one case.
    let med = |i: usize, f: &dyn Fn(&Case) -> f64| median(cases[i].iter().map(f).collect());
    let ms = |us: u64| (us as f64 / 10.0).round() / 100.0;
    let lat = |i: usize, pick: fn(&Case) -> &Latencies| {
        json!({
            "p50_ms": med(i, &|c| ms(pick(c).p50_us)),
            "p95_ms": med(i, &|c| ms(pick(c).p95_us)),
            "p99_ms": med(i, &|c| ms(pick(c).p99_us)),
            "max_ms": med(i, &|c| ms(pick(c).max_us)),
        })
    };
    let figures = |i: usize| {
        json!({
            "clients": cases[i][0].clients,
            "events_per_round": med(i, &|c| c.created as f64),
            "pairs": med(i, &|c| c.from_response.count as f64),
            "from_sent": lat(i, |c| &c.from_sent),
            "from_201": lat(i, |c| &c.from_response),
            "early_pairs": med(i, &|c| c.early as f64),
            "create": lat(i, |c| &c.create),
            "creator_max_lag_ms": med(i, &|c| ms(c.max_lag_us)),
            "machine_busy_pct": med(i, &|c| c.cpu.machine_busy_pct.round()),
            "bench_pct_of_core": med(i, &|c| c.cpu.process_pct_of_core.round()),
        })
    };
    let (base, measured) = (figures(0), figures(1));
    let get = |f: &serde_json::Value, a: &str, b: &str| f[a][b].as_f64().unwrap_or(f64::NAN);
    // NaN (printed as such) where the baseline is 0.
    let ratio = |a: &str, b: &str| {
        let r = get(&measured, a, b) / get(&base, a, b);
        if r.is_finite() {
            (r * 100.0).round() / 100.0
        } else {
            f64::NAN
        }
    };
    println!(
        "events: {} rounds of {} s at {}/s each, baseline and measured alternating; medians over the rounds; \
         every client received every event exactly once, in id order",
        args.rounds, args.duration_secs, args.rate
    );
    for (name, f) in [("baseline", &base), ("measured", &measured)] {
        println!(
            "  {name}, {} client(s), {} (client, event) pairs per round:",
            f["clients"], f["pairs"]
        );
        for (key, what) in [
            ("from_sent", "create sent → parsed (upper bound)"),
            ("from_201", "201 received → parsed (lower bound)"),
            ("create", "create request (sent → 201)"),
        ] {
            println!(
                "    {what:38} p50 {:7.2}  p95 {:7.2}  p99 {:7.2}  max {:7.2} ms",
                get(f, key, "p50_ms"),
                get(f, key, "p95_ms"),
                get(f, key, "p99_ms"),
                get(f, key, "max_ms")
            );
        }
        println!(
            "    {} pairs parsed before the 201; creator late by up to {} ms; machine {} % busy, berth-bench {} % of a core",
            f["early_pairs"], f["creator_max_lag_ms"], f["machine_busy_pct"], f["bench_pct_of_core"]
        );
    }
    let ratios = json!({
        "from_sent_p50": ratio("from_sent", "p50_ms"),
        "from_sent_p99": ratio("from_sent", "p99_ms"),
        "from_201_p99": ratio("from_201", "p99_ms"),
    });
    println!(
        "  measured / baseline: from sent p50 {}×, p99 {}×; from 201 p99 {}×",
        ratios["from_sent_p50"], ratios["from_sent_p99"], ratios["from_201_p99"]
    );
    println!(
        "SUMMARY {}",
        json!({
            "scenario": "events",
            "rounds": args.rounds,
            "rate": args.rate,
            "duration_secs": args.duration_secs,
            "baseline": base,
            "measured": measured,
            "ratio": ratios,
        })
    );
}
