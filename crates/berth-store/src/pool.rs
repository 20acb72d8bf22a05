//! How the PostgreSQL backend's connection pool is bounded ([`PostgresPoolConfig`], whose
//! `Default` is the one place its defaults are written) and what it reports about itself
//! ([`PoolStats`], read by the server's `/metrics` at each scrape). It never opens a connection;
//! `postgres/mod.rs` applies the settings and records the waits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The PostgreSQL pool's bounds. SQLite ignores them: it runs on connection threads it owns
/// (`sqlite/threads.rs`), one writer and a fixed set of readers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PostgresPoolConfig {
    /// Most connections the pool holds open at once. The LISTEN connection and the
    /// sequencer's are two more, each in a pool of its own, so every replica takes up to this
    /// plus two of PostgreSQL's `max_connections`.
    pub max_connections: u32,
    /// Longest an operation waits for a pooled connection before it fails
    /// ([`crate::StoreError::Timeout`]), so a saturated pool answers "retry" instead of queueing
    /// requests without bound.
    pub acquire_timeout: Duration,
    /// `statement_timeout` of every pooled connection: a statement running longer is cancelled
    /// by PostgreSQL and fails as [`crate::StoreError::Timeout`]. `None`: no limit. Migrations
    /// run without it (a migration, or waiting for another replica's, may take longer).
    pub statement_timeout: Option<Duration>,
}

impl Default for PostgresPoolConfig {
    fn default() -> PostgresPoolConfig {
        PostgresPoolConfig {
            // What one replica's handlers, heartbeat writer and reconcilers keep busy; a
            // default PostgreSQL (`max_connections = 100`) fits several replicas.
            max_connections: 16,
            // Well under a client's patience (the CLI and agents retry a 5xx), well over a
            // healthy wait (milliseconds).
            acquire_timeout: Duration::from_secs(10),
            // No statement of berth's runs this long on a healthy database (retention prunes
            // in batches of 500 rows); one that does is stuck and holds a connection and locks.
            statement_timeout: Some(Duration::from_secs(30)),
        }
    }
}

/// The upper bounds (seconds) of [`PoolStats::acquire_wait_buckets`]: from a connection that
/// was idle (well under a millisecond) to one that came free just before the acquire timeout.
pub const ACQUIRE_WAIT_BOUNDS: [f64; 9] = [0.0005, 0.001, 0.005, 0.025, 0.1, 0.5, 1.0, 2.5, 10.0];

/// A snapshot of a pool, for metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolStats {
    /// Connections open now, idle or in use.
    pub size: u32,
    /// Of those, the idle ones.
    pub idle: u32,
    /// [`PostgresPoolConfig::max_connections`].
    pub max: u32,
    /// Acquires that got a connection, by how long they waited: `[i]` counts the waits of at
    /// most [`ACQUIRE_WAIT_BOUNDS`]`[i]` seconds and above the bound before it; the last counts
    /// the waits above every bound. Not cumulative.
    pub acquire_wait_buckets: [u64; ACQUIRE_WAIT_BOUNDS.len() + 1],
    /// The sum of those waits.
    pub acquire_wait_sum: Duration,
    /// Acquires that gave up after [`PostgresPoolConfig::acquire_timeout`].
    pub acquire_timeouts: u64,
    /// The task path's batches, one entry per operation (`postgres/batch.rs`).
    pub batches: Vec<BatchStats>,
}

/// What one operation's batcher did so far (`postgres/batch.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// The store operation, as `/metrics` labels it (`create tasks`, `complete attempts`, …).
    pub operation: &'static str,
    /// Batches run.
    pub batches: u64,
    /// Calls a batch decided.
    pub decided: u64,
    /// Calls a batch declined, which then ran alone in a transaction of their own: what the
    /// batch could not decide (a taken idempotency key, a second poll of one agent, …) and
    /// every call of a batch that failed as a whole.
    pub declined: u64,
}

/// How long operations waited for a pooled connection; lock-free, recorded by every acquire.
#[derive(Debug, Default)]
pub(crate) struct AcquireWaits {
    buckets: [AtomicU64; ACQUIRE_WAIT_BOUNDS.len() + 1],
    sum_nanos: AtomicU64,
    timeouts: AtomicU64,
}

impl AcquireWaits {
    pub(crate) fn acquired(&self, waited: Duration) {
        let secs = waited.as_secs_f64();
        let bucket = ACQUIRE_WAIT_BOUNDS
            .iter()
            .position(|bound| secs <= *bound)
            .unwrap_or(ACQUIRE_WAIT_BOUNDS.len());
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        // A wait is at most the acquire timeout; u64 nanoseconds last 584 years of them.
        let nanos = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    pub(crate) fn timed_out(&self) {
        self.timeouts.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stats(&self, size: u32, idle: u32, max: u32) -> PoolStats {
        PoolStats {
            size,
            idle,
            max,
            acquire_wait_buckets: std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            acquire_wait_sum: Duration::from_nanos(self.sum_nanos.load(Ordering::Relaxed)),
            acquire_timeouts: self.timeouts.load(Ordering::Relaxed),
            batches: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_fall_into_their_buckets() {
        let waits = AcquireWaits::default();
        waits.acquired(Duration::from_micros(100));
        waits.acquired(Duration::from_millis(1));
        waits.acquired(Duration::from_millis(30));
        waits.acquired(Duration::from_secs(11));
        waits.timed_out();
        let stats = waits.stats(3, 1, 4);
        assert_eq!(stats.acquire_wait_buckets, [1, 1, 0, 0, 1, 0, 0, 0, 0, 1]);
        assert_eq!(
            stats.acquire_wait_sum,
            Duration::from_micros(100 + 1_000 + 30_000 + 11_000_000)
        );
        assert_eq!((stats.size, stats.idle, stats.max), (3, 1, 4));
        assert_eq!(stats.acquire_timeouts, 1);
    }
}
