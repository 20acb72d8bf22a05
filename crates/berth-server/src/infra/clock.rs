//! Time, injected: handlers and reconcilers read "now" from the one [`Clock`] in the server's
//! config, never from the system directly, so a test moves time instead of sleeping through it.
//! The store already takes every "now" as an argument; this is where those arguments come from.
//! Timers (long-poll holds, sweep intervals) stay on tokio's clock.
//!
//! Reconcilers are the exception: what is due is judged by the database's clock, which every
//! replica shares, not by this one (a replica's wall clock may be wrong). A test that moves a
//! [`ManualClock`] moves the reconcilers' time by as much ([`Clock::advanced`]).

use std::sync::Mutex;
use std::time::Duration;

use time::OffsetDateTime;

pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> OffsetDateTime;

    /// How far a test moved this clock on purpose: added to the database's clock where a
    /// reconciler decides what is due. Zero for a wall clock, however wrong it is.
    fn advanced(&self) -> Duration {
        Duration::ZERO
    }
}

/// The system's wall clock: what a server runs on.
#[derive(Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> OffsetDateTime {
        OffsetDateTime::now_utc()
    }
}

/// A clock that moves only when told to: for tests of expiry, staleness and leases.
#[derive(Debug)]
pub struct ManualClock(Mutex<(OffsetDateTime, Duration)>);

impl ManualClock {
    /// Starts at the system time.
    pub fn new() -> ManualClock {
        ManualClock(Mutex::new((OffsetDateTime::now_utc(), Duration::ZERO)))
    }

    pub fn advance(&self, by: Duration) {
        let mut clock = self.0.lock().unwrap_or_else(|e| e.into_inner());
        clock.0 += by;
        clock.1 += by;
    }
}

impl Default for ManualClock {
    fn default() -> ManualClock {
        ManualClock::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> OffsetDateTime {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    fn advanced(&self) -> Duration {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_advanced() {
        let clock = ManualClock::new();
        let start = clock.now();
        assert_eq!(clock.now(), start);
        clock.advance(Duration::from_secs(90));
        assert_eq!(clock.now() - start, time::Duration::seconds(90));
        assert_eq!(clock.advanced(), Duration::from_secs(90));
        assert_eq!(SystemClock.advanced(), Duration::ZERO);
    }
}
