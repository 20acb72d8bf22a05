//! Prometheus metrics: typed recording functions, so names and label sets stay bounded and
//! consistent (`berth_<thing>_<unit>_total`, plus one `berth_errors_total{error_type}`).
//! The database pool's are the exception: sqlx owns the pool's state and the store counts its
//! waits, so [`DatabasePool`] reads them at each scrape rather than mirroring them here.

use std::sync::Arc;

use berth_store::DynStore;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

type Labels = Vec<(&'static str, &'static str)>;

#[derive(Clone)]
pub struct Metrics(Arc<Inner>);

struct Inner {
    registry: Registry,
    errors: Family<Labels, Counter>,
    agent_auth_refusals: Family<Labels, Counter>,
    registrations: Family<Labels, Counter>,
    heartbeats: Counter,
    heartbeat_batch_size: Histogram,
    agents_marked: Family<Labels, Counter>,
    result_rejections: Family<Labels, Counter>,
    results_accepted: Family<Labels, Counter>,
    tasks: Family<Labels, Counter>,
    sessions_held: Counter,
    polls_parked: Gauge,
    event_streams: Gauge,
    poll_wakeups: Counter,
    connections_closed: Family<Labels, Counter>,
    reconciler_passes: Family<Labels, Counter>,
    reconciler_units: Family<Labels, Counter>,
    reconciler_pass_seconds: Family<Labels, Histogram, fn() -> Histogram>,
}

/// Bounds of `berth_reconciler_pass_seconds`: a pass over an idle database takes about a
/// millisecond; a retention sweep of a backlog, seconds.
fn pass_seconds() -> Histogram {
    Histogram::new([0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0])
}

/// The reconciler driver's families: passes, units by outcome, and pass durations.
#[allow(clippy::type_complexity)]
fn register_reconcilers(
    registry: &mut Registry,
) -> (
    Family<Labels, Counter>,
    Family<Labels, Counter>,
    Family<Labels, Histogram, fn() -> Histogram>,
) {
    let reconciler_passes = Family::<Labels, Counter>::default();
    registry.register(
        "reconciler_passes",
        "Passes each reconciler ran (workers/driver.rs)",
        reconciler_passes.clone(),
    );
    let reconciler_units = Family::<Labels, Counter>::default();
    registry.register(
        "reconciler_units",
        "Units of work reconcilers took up, by outcome: done, failed, or held by another \
         replica's claim",
        reconciler_units.clone(),
    );
    let reconciler_pass_seconds =
        Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(pass_seconds);
    registry.register_with_unit(
        "reconciler_pass",
        "How long each reconciler's passes took",
        Unit::Seconds,
        reconciler_pass_seconds.clone(),
    );
    (reconciler_passes, reconciler_units, reconciler_pass_seconds)
}

impl Metrics {
    /// `store`'s connection pool is reported at each scrape (nothing for SQLite, which has
    /// none).
    pub fn new(store: DynStore) -> Metrics {
        let mut registry = Registry::with_prefix("berth");
        registry.register_collector(Box::new(DatabasePool(store)));
        let errors = Family::<Labels, Counter>::default();
        registry.register(
            "errors",
            "Refusals and failures by error type",
            errors.clone(),
        );
        let agent_auth_refusals = Family::<Labels, Counter>::default();
        registry.register(
            "agent_auth_refusals",
            "Agent-runtime calls refused by certificate binding",
            agent_auth_refusals.clone(),
        );
        let registrations = Family::<Labels, Counter>::default();
        registry.register(
            "agent_registrations",
            "Agent registrations by outcome",
            registrations.clone(),
        );
        let heartbeats = Counter::default();
        registry.register("heartbeats", "Heartbeats persisted", heartbeats.clone());
        let heartbeat_batch_size = Histogram::new([1.0, 4.0, 16.0, 64.0, 256.0, 1024.0]);
        registry.register(
            "heartbeat_batch_size",
            "Heartbeats committed per transaction",
            heartbeat_batch_size.clone(),
        );
        let agents_marked = Family::<Labels, Counter>::default();
        registry.register(
            "agent_status_transitions",
            "Agents moved to a status by the staleness sweep",
            agents_marked.clone(),
        );
        let result_rejections = Family::<Labels, Counter>::default();
        registry.register(
            "result_rejections",
            "Task results refused, by reason",
            result_rejections.clone(),
        );
        let results_accepted = Family::<Labels, Counter>::default();
        registry.register(
            "results_accepted",
            "Verified task results recorded, by the task's new state",
            results_accepted.clone(),
        );
        let tasks = Family::<Labels, Counter>::default();
        registry.register("task_events", "Task lifecycle events", tasks.clone());
        let sessions_held = Counter::default();
        registry.register(
            "session_conflicts",
            "Session acquisitions refused because another live process holds the identity",
            sessions_held.clone(),
        );
        let polls_parked = Gauge::default();
        registry.register(
            "long_polls_parked",
            "Task polls waiting for work right now",
            polls_parked.clone(),
        );
        let event_streams = Gauge::default();
        registry.register(
            "event_streams_open",
            "Clients following GET /api/v1/events right now",
            event_streams.clone(),
        );
        let poll_wakeups = Counter::default();
        registry.register(
            "long_poll_wakeups",
            "Parked task polls woken by a task event, before their hold ran out",
            poll_wakeups.clone(),
        );
        let connections_closed = Family::<Labels, Counter>::default();
        registry.register(
            "connections_closed",
            "Connections the listener closed or refused to protect itself, by reason",
            connections_closed.clone(),
        );
        let (reconciler_passes, reconciler_units, reconciler_pass_seconds) =
            register_reconcilers(&mut registry);
        Metrics(Arc::new(Inner {
            reconciler_passes,
            reconciler_units,
            reconciler_pass_seconds,
            connections_closed,
            polls_parked,
            event_streams,
            poll_wakeups,
            result_rejections,
            results_accepted,
            tasks,
            sessions_held,
            registry,
            errors,
            agent_auth_refusals,
            registrations,
            heartbeats,
            heartbeat_batch_size,
            agents_marked,
        }))
    }

    pub fn error(&self, error_type: &'static str) {
        self.0
            .errors
            .get_or_create(&vec![("error_type", error_type)])
            .inc();
    }

    pub fn agent_auth_refused(&self, reason: &'static str) {
        self.0
            .agent_auth_refusals
            .get_or_create(&vec![("reason", reason)])
            .inc();
        self.error("agent_auth");
    }

    pub fn registration(&self, outcome: &'static str) {
        self.0
            .registrations
            .get_or_create(&vec![("outcome", outcome)])
            .inc();
    }

    pub fn heartbeat_batch(&self, size: usize) {
        self.0.heartbeats.inc_by(size as u64);
        self.0.heartbeat_batch_size.observe(size as f64);
    }

    pub fn agents_marked(&self, status: &'static str, count: u64) {
        if count > 0 {
            self.0
                .agents_marked
                .get_or_create(&vec![("status", status)])
                .inc_by(count);
        }
    }

    pub fn result_rejected(&self, reason: &'static str) {
        self.0
            .result_rejections
            .get_or_create(&vec![("reason", reason)])
            .inc();
        self.error("result_rejected");
    }

    pub fn result_accepted(&self, state: &'static str) {
        self.0
            .results_accepted
            .get_or_create(&vec![("state", state)])
            .inc();
    }

    fn task_event(&self, event: &'static str, count: u64) {
        if count > 0 {
            self.0
                .tasks
                .get_or_create(&vec![("event", event)])
                .inc_by(count);
        }
    }

    pub fn task_created(&self) {
        self.task_event("created", 1);
    }

    pub fn task_assigned(&self) {
        self.task_event("assigned", 1);
    }

    pub fn leases_expired(&self, unknown: u64, requeued: u64, dead_lettered: u64) {
        self.task_event("lease_lost_unknown", unknown);
        self.task_event("lease_lost_requeued", requeued);
        self.task_event("dead_lettered", dead_lettered);
    }

    /// `idle`: no request within the header read timeout; `source_cap`: refused at accept
    /// because its source address already holds the most connections allowed.
    pub fn connection_closed(&self, reason: &'static str) {
        self.0
            .connections_closed
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }

    pub fn session_held(&self) {
        self.0.sessions_held.inc();
        self.error("session_held");
    }

    /// A poll parks until work or its deadline; the guard unparks it however the wait ends.
    pub fn poll_parked(&self) -> ParkedPoll {
        self.0.polls_parked.inc();
        ParkedPoll(self.clone())
    }

    /// An event stream is open; the guard closes it however the response ends.
    pub fn event_stream_opened(&self) -> OpenEventStream {
        self.0.event_streams.inc();
        OpenEventStream(self.clone())
    }

    /// One pass of the reconciler `name` ended after `seconds`.
    pub fn reconciler_pass(&self, name: &'static str, seconds: f64) {
        let labels = vec![("name", name)];
        self.0.reconciler_passes.get_or_create(&labels).inc();
        self.0
            .reconciler_pass_seconds
            .get_or_create(&labels)
            .observe(seconds);
    }

    /// A unit of the reconciler `name` ended as `outcome` (`done`, `failed`, `held`).
    pub fn reconciler_unit(&self, name: &'static str, outcome: &'static str) {
        self.0
            .reconciler_units
            .get_or_create(&vec![("name", name), ("outcome", outcome)])
            .inc();
    }

    pub fn poll_woken(&self) {
        self.0.poll_wakeups.inc();
    }

    /// The OpenMetrics 1.0 text exposition (`application/openmetrics-text`).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.0.registry).is_err() {
            out.clear();
        }
        out
    }

    /// The classic Prometheus text format (0.0.4), what a scraper gets unless it asks for
    /// OpenMetrics: [`classic_text`] of [`Metrics::encode`].
    pub fn encode_classic(&self) -> String {
        classic_text(&self.encode())
    }
}

/// OpenMetrics text as the classic Prometheus format (0.0.4) reads it. The two differ where a
/// counter is concerned: OpenMetrics names the family `x` and its sample `x_total`, the classic
/// format names both `x_total`; and the classic format has no `# UNIT` and no `# EOF`.
pub fn classic_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let name = if counters.contains(name) && !name.ends_with("_total") {
                    format!("{name}_total")
                } else {
                    name.to_string()
                };
                out.push_str(prefix);
                out.push_str(&name);
                if !tail.is_empty() {
                    out.push(' ');
                    out.push_str(tail);
                }
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Counts one parked poll in `berth_long_polls_parked` while it lives.
pub struct ParkedPoll(Metrics);

impl Drop for ParkedPoll {
    fn drop(&mut self) {
        self.0 .0.polls_parked.dec();
    }
}

/// Counts one response of `GET /api/v1/events` in `berth_event_streams_open` while it lives.
pub struct OpenEventStream(Metrics);

impl Drop for OpenEventStream {
    fn drop(&mut self) {
        self.0 .0.event_streams.dec();
    }
}

/// `berth_database_pool_*`: the PostgreSQL pool's connections (open, idle, the most it opens),
/// how long store operations waited for one (a histogram; a transaction's wait includes its
/// `BEGIN`), and how many gave up after the acquire timeout. `berth_database_batch*`: the task
/// path's batches by operation, and their calls decided or declined; a declined call ran again
/// alone, the store's only retry (a conflict is answered, not retried).
struct DatabasePool(DynStore);

impl std::fmt::Debug for DatabasePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DatabasePool")
            .field(&self.0.backend())
            .finish()
    }
}

impl Collector for DatabasePool {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(stats) = self.0.pool_stats() else {
            return Ok(());
        };
        for (name, help, value) in [
            (
                "database_pool_connections",
                "Connections the database pool holds open, idle or in use",
                stats.size,
            ),
            (
                "database_pool_idle_connections",
                "Open pooled connections no operation is using",
                stats.idle,
            ),
            (
                "database_pool_max_connections",
                "Most connections the database pool opens (--database-max-connections)",
                stats.max,
            ),
        ] {
            let gauge = ConstGauge::new(i64::from(value));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        let bounds = berth_store::ACQUIRE_WAIT_BOUNDS
            .iter()
            .copied()
            .chain([f64::MAX]);
        let buckets: Vec<(f64, u64)> = bounds.zip(stats.acquire_wait_buckets).collect();
        let count = stats.acquire_wait_buckets.iter().sum();
        encoder
            .encode_descriptor(
                "database_pool_acquire_wait",
                "How long store operations waited for a pooled connection",
                Some(&Unit::Seconds),
                MetricType::Histogram,
            )?
            .encode_histogram::<prometheus_client::encoding::NoLabelSet>(
                stats.acquire_wait_sum.as_secs_f64(),
                count,
                &buckets,
                None,
            )?;
        let timeouts = ConstCounter::new(stats.acquire_timeouts);
        timeouts.encode(encoder.encode_descriptor(
            "database_pool_acquire_timeouts",
            "Store operations that got no pooled connection within --database-acquire-timeout-secs",
            None,
            timeouts.metric_type(),
        )?)?;
        let mut batches = encoder.encode_descriptor(
            "database_batches",
            "Batches the task path ran on PostgreSQL, by store operation",
            None,
            MetricType::Counter,
        )?;
        for batch in &stats.batches {
            ConstCounter::new(batch.batches)
                .encode(batches.encode_family(&[("operation", batch.operation)])?)?;
        }
        let mut calls = encoder.encode_descriptor(
            "database_batch_calls",
            "Store calls a batch decided, or declined to run alone (what it could not decide, \
             or all of a batch that failed)",
            None,
            MetricType::Counter,
        )?;
        for batch in &stats.batches {
            for (outcome, count) in [("decided", batch.decided), ("declined", batch.declined)] {
                let labels = [("operation", batch.operation), ("outcome", outcome)];
                ConstCounter::new(count).encode(calls.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}
