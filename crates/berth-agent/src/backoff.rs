//! Jittered exponential back-off ("full jitter"), so a fleet that lost its server does not
//! come back in lockstep.

use std::time::Duration;

pub struct Backoff {
    base: Duration,
    cap: Duration,
    attempt: u32,
}

impl Backoff {
    pub fn new(base: Duration, cap: Duration) -> Backoff {
        Backoff {
            base,
            cap,
            attempt: 0,
        }
    }

    /// The next delay: uniform in [ceiling/2, ceiling], ceiling = min(cap, base·2^attempt).
    pub fn next_delay(&mut self) -> Duration {
        let ceiling = self
            .base
            .saturating_mul(1u32 << self.attempt.min(16))
            .min(self.cap);
        self.attempt = self.attempt.saturating_add(1);
        let random = u64::from_le_bytes(berth_crypto::random_bytes::<8>());
        let half = ceiling / 2;
        let spread = half.as_millis().max(1) as u64;
        half + Duration::from_millis(random % spread)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_with_jitter_and_stays_under_the_cap() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
        let first = b.next_delay();
        assert!(first >= Duration::from_millis(50) && first <= Duration::from_millis(100));
        for _ in 0..20 {
            assert!(b.next_delay() <= Duration::from_secs(2));
        }
        let late = b.next_delay();
        assert!(late >= Duration::from_secs(1));
    }
}
