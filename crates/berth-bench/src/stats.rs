//! Latency summaries from a sorted `Vec` of microseconds, process RSS from `/proc`, and the
//! server's heartbeat batch histogram parsed from `/metrics`. No histogram library: a run keeps
//! at most a few hundred thousand samples, which sort in milliseconds.

use std::fmt;
use std::time::Duration;

use serde_json::{json, Value};

/// Nearest-rank percentiles over one set of latencies.
#[derive(Debug, Clone, Copy, Default)]
pub struct Latencies {
    pub count: usize,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p95_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

impl Latencies {
    pub fn from_micros(mut samples: Vec<u64>) -> Latencies {
        if samples.is_empty() {
            return Latencies::default();
        }
        samples.sort_unstable();
        let rank = |p: f64| {
            let idx = ((p / 100.0) * samples.len() as f64).ceil() as usize;
            samples[idx.clamp(1, samples.len()) - 1]
        };
        Latencies {
            count: samples.len(),
            p50_us: rank(50.0),
            p90_us: rank(90.0),
            p95_us: rank(95.0),
            p99_us: rank(99.0),
            max_us: samples[samples.len() - 1],
        }
    }

    pub fn to_json(self) -> Value {
        json!({
            "count": self.count,
            "p50_ms": ms(self.p50_us),
            "p90_ms": ms(self.p90_us),
            "p95_ms": ms(self.p95_us),
            "p99_ms": ms(self.p99_us),
            "max_ms": ms(self.max_us),
        })
    }
}

impl fmt::Display for Latencies {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "n={} p50={:.2} ms p90={:.2} ms p95={:.2} ms p99={:.2} ms max={:.2} ms",
            self.count,
            ms(self.p50_us),
            ms(self.p90_us),
            ms(self.p95_us),
            ms(self.p99_us),
            ms(self.max_us)
        )
    }
}

fn ms(us: u64) -> f64 {
    (us as f64 / 1000.0 * 100.0).round() / 100.0
}

/// The median of repeated measurements (the upper one of an even count); NaN for none.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// This process's resident set, in KiB (`VmRSS`), or 0 where `/proc` is missing.
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// CPU time of this process and of the whole machine, from `/proc`, to say who used the cores
/// during a measurement (the load generator shares them with the server).
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTimes {
    at: Option<std::time::Instant>,
    /// utime + stime of this process, in clock ticks.
    process_ticks: u64,
    /// Busy and total jiffies over all cores (`cpu` line of `/proc/stat`).
    machine_busy: u64,
    machine_total: u64,
}

/// What a window of [`CpuTimes`] amounts to.
#[derive(Debug, Clone, Copy)]
pub struct CpuUsage {
    /// Percent of one core used by this process.
    pub process_pct_of_core: f64,
    /// Percent of all cores busy, whoever used them.
    pub machine_busy_pct: f64,
    pub cores: usize,
}

impl CpuTimes {
    pub fn now() -> CpuTimes {
        let process_ticks = std::fs::read_to_string("/proc/self/stat")
            .ok()
            .and_then(|stat| {
                // Fields after the parenthesised command name: state is field 3, utime 14, stime 15.
                let rest = stat.rsplit_once(") ")?.1;
                let fields: Vec<&str> = rest.split_whitespace().collect();
                Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
            })
            .unwrap_or(0);
        let (machine_busy, machine_total) = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|stat| {
                let line = stat.lines().find(|l| l.starts_with("cpu "))?;
                let v: Vec<u64> = line
                    .split_whitespace()
                    .skip(1)
                    .filter_map(|x| x.parse().ok())
                    .collect();
                let total: u64 = v.iter().take(8).sum();
                // idle + iowait are not busy.
                let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
                Some((total.saturating_sub(idle), total))
            })
            .unwrap_or((0, 0));
        CpuTimes {
            at: Some(std::time::Instant::now()),
            process_ticks,
            machine_busy,
            machine_total,
        }
    }

    pub fn since(&self, earlier: &CpuTimes) -> CpuUsage {
        // SAFETY: sysconf only reads a configuration value.
        let ticks_per_sec = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let wall = match (self.at, earlier.at) {
            (Some(now), Some(then)) => now.duration_since(then).as_secs_f64(),
            _ => 0.0,
        };
        let process_secs =
            self.process_ticks.saturating_sub(earlier.process_ticks) as f64 / ticks_per_sec;
        let total = self.machine_total.saturating_sub(earlier.machine_total) as f64;
        let busy = self.machine_busy.saturating_sub(earlier.machine_busy) as f64;
        CpuUsage {
            process_pct_of_core: if wall > 0.0 {
                process_secs / wall * 100.0
            } else {
                0.0
            },
            machine_busy_pct: if total > 0.0 {
                busy / total * 100.0
            } else {
                0.0
            },
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl CpuUsage {
    pub fn to_json(self) -> Value {
        json!({
            "bench_pct_of_core": (self.process_pct_of_core * 10.0).round() / 10.0,
            "machine_busy_pct": (self.machine_busy_pct * 10.0).round() / 10.0,
            "cores": self.cores,
        })
    }
}

impl fmt::Display for CpuUsage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "berth-bench used {:.1} % of one core; the machine's {} cores were {:.1} % busy (everything, this process included)",
            self.process_pct_of_core, self.cores, self.machine_busy_pct
        )
    }
}

/// `berth_heartbeat_batch_size` as exposed on `/metrics`: cumulative buckets, sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BatchHistogram {
    /// `(le, cumulative count)`, in exposition order (`+Inf` last).
    pub buckets: Vec<(String, u64)>,
    pub sum: f64,
    pub count: u64,
}

const BATCH_METRIC: &str = "berth_heartbeat_batch_size";

impl BatchHistogram {
    pub fn parse(exposition: &str) -> BatchHistogram {
        let mut h = BatchHistogram::default();
        for line in exposition.lines() {
            let Some(rest) = line.strip_prefix(BATCH_METRIC) else {
                continue;
            };
            if let Some(rest) = rest.strip_prefix("_bucket{le=\"") {
                if let Some((le, value)) = rest.split_once("\"} ") {
                    h.buckets.push((le.to_string(), parse_count(value)));
                }
            } else if let Some(value) = rest.strip_prefix("_sum ") {
                h.sum = value.trim().parse().unwrap_or(0.0);
            } else if let Some(value) = rest.strip_prefix("_count ") {
                h.count = parse_count(value);
            }
        }
        h
    }

    /// What happened between `earlier` and `self` (both from the same server process).
    pub fn since(&self, earlier: &BatchHistogram) -> BatchHistogram {
        let before = |le: &str| {
            earlier
                .buckets
                .iter()
                .find(|(l, _)| l == le)
                .map_or(0, |(_, c)| *c)
        };
        BatchHistogram {
            buckets: self
                .buckets
                .iter()
                .map(|(le, c)| (le.clone(), c.saturating_sub(before(le))))
                .collect(),
            sum: self.sum - earlier.sum,
            count: self.count.saturating_sub(earlier.count),
        }
    }

    /// Non-cumulative counts per bucket, labelled `≤le`.
    pub fn per_bucket(&self) -> Vec<(String, u64)> {
        let mut previous = 0;
        self.buckets
            .iter()
            .map(|(le, cumulative)| {
                let n = cumulative.saturating_sub(previous);
                previous = *cumulative;
                (le.clone(), n)
            })
            .collect()
    }

    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum / self.count as f64
        }
    }

    pub fn to_json(&self) -> Value {
        json!({
            "batches": self.count,
            "heartbeats": self.sum,
            "mean_batch": (self.mean() * 100.0).round() / 100.0,
            "per_bucket": self
                .per_bucket()
                .into_iter()
                .map(|(le, n)| json!({"le": le, "batches": n}))
                .collect::<Vec<_>>(),
        })
    }
}

impl fmt::Display for BatchHistogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} commits for {} heartbeats (mean batch {:.2}); batches per size bucket:",
            self.count,
            self.sum,
            self.mean()
        )?;
        for (le, n) in self.per_bucket() {
            write!(f, " ≤{le}: {n}")?;
        }
        Ok(())
    }
}

fn parse_count(value: &str) -> u64 {
    // OpenMetrics may print counts as floats; a trailing exemplar starts with `#`.
    let value = value.split('#').next().unwrap_or("").trim();
    value
        .parse::<u64>()
        .or_else(|_| value.parse::<f64>().map(|f| f as u64))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_nearest_rank() {
        let l = Latencies::from_micros((1..=100).rev().collect());
        assert_eq!(
            (l.count, l.p50_us, l.p90_us, l.p95_us, l.p99_us, l.max_us),
            (100, 50, 90, 95, 99, 100)
        );
        let one = Latencies::from_micros(vec![7]);
        assert_eq!((one.p50_us, one.p99_us, one.max_us), (7, 7, 7));
        assert_eq!(Latencies::from_micros(Vec::new()).count, 0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn batch_histogram_parses_and_subtracts() {
        let before = BatchHistogram::parse(
            "# TYPE berth_heartbeat_batch_size histogram\n\
             berth_heartbeat_batch_size_sum 10.0\n\
             berth_heartbeat_batch_size_count 10\n\
             berth_heartbeat_batch_size_bucket{le=\"1.0\"} 10\n\
             berth_heartbeat_batch_size_bucket{le=\"4.0\"} 10\n\
             berth_heartbeat_batch_size_bucket{le=\"+Inf\"} 10\n\
             berth_heartbeats_total 10\n",
        );
        let after = BatchHistogram::parse(
            "berth_heartbeat_batch_size_sum 30.0\n\
             berth_heartbeat_batch_size_count 15\n\
             berth_heartbeat_batch_size_bucket{le=\"1.0\"} 12\n\
             berth_heartbeat_batch_size_bucket{le=\"4.0\"} 14\n\
             berth_heartbeat_batch_size_bucket{le=\"+Inf\"} 15\n",
        );
        let delta = after.since(&before);
        assert_eq!(delta.count, 5);
        assert_eq!(delta.sum, 20.0);
        assert_eq!(
            delta.per_bucket(),
            vec![("1.0".into(), 2), ("4.0".into(), 2), ("+Inf".into(), 1)]
        );
        assert_eq!(delta.mean(), 4.0);
    }
}
