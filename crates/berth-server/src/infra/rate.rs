//! Per-environment rate buckets of the desired-state calls (seed 001: checkin 6/min, bundle
//! 10/min, report 30/min, lease 5/h), keyed by (tenant, environment, bucket).
//!
//! GCRA on the injected [`crate::Clock`], so tests move time instead of sleeping: each key keeps
//! one instant, its theoretical arrival time. A key whose instant has passed is idle (a fresh
//! key would behave the same), so sweeping those keeps memory bounded by the keys in use.
//! Each replica counts on its own.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use axum::http::StatusCode;
use berth_proto::desired::rate;
use berth_proto::error::codes;
use berth_proto::{EnvironmentId, TenantId};
use time::OffsetDateTime;

use crate::infra::error::ApiError;

/// One bucket: `limit` requests per `period`, all of them usable at once; over it, `code`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bucket {
    pub name: &'static str,
    pub limit: u32,
    pub period: Duration,
    pub code: &'static str,
}

const MINUTE: Duration = Duration::from_secs(60);

pub const CHECKIN: Bucket = Bucket {
    name: "checkin",
    limit: rate::CHECKIN_PER_MINUTE,
    period: MINUTE,
    code: codes::RATE_LIMITED,
};
pub const BUNDLE: Bucket = Bucket {
    name: "bundle",
    limit: rate::BUNDLE_PER_MINUTE,
    period: MINUTE,
    code: codes::RATE_LIMITED,
};
pub const REPORT: Bucket = Bucket {
    name: "report",
    limit: rate::REPORT_PER_MINUTE,
    period: MINUTE,
    code: codes::RATE_LIMITED,
};
#[allow(dead_code)] // The lease route (the secrets work) takes it.
pub const LEASE: Bucket = Bucket {
    name: "lease",
    limit: rate::LEASE_PER_HOUR,
    period: Duration::from_secs(3600),
    code: codes::LEASE_RATE_LIMITED,
};

type Key = (TenantId, EnvironmentId, &'static str);

/// Keys above this many trigger a sweep of idle ones (then the threshold doubles past the live
/// ones, so a sweep costs O(1) per request amortised).
const SWEEP_AT: usize = 4096;

#[derive(Debug)]
pub struct RateLimiter {
    inner: Mutex<Keys>,
}

#[derive(Debug)]
struct Keys {
    arrivals: HashMap<Key, OffsetDateTime>,
    sweep_at: usize,
}

impl Default for RateLimiter {
    fn default() -> RateLimiter {
        RateLimiter {
            inner: Mutex::new(Keys {
                arrivals: HashMap::new(),
                sweep_at: SWEEP_AT,
            }),
        }
    }
}

impl RateLimiter {
    /// Counts one request; `Err` is the wait before the next one is allowed.
    pub fn check(
        &self,
        tenant: TenantId,
        env: EnvironmentId,
        bucket: Bucket,
        now: OffsetDateTime,
    ) -> Result<(), Duration> {
        let interval = bucket.period / bucket.limit.max(1);
        let tolerance = bucket.period.saturating_sub(interval);
        let mut keys = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let key = (tenant, env, bucket.name);
        let arrival = keys.arrivals.get(&key).copied().unwrap_or(now).max(now);
        let ahead: Duration = (arrival - now).try_into().unwrap_or_default();
        if ahead > tolerance {
            return Err(ahead - tolerance);
        }
        keys.arrivals.insert(key, arrival + interval);
        if keys.arrivals.len() > keys.sweep_at {
            keys.arrivals.retain(|_, at| *at > now);
            keys.sweep_at = (keys.arrivals.len() * 2).max(SWEEP_AT);
        }
        Ok(())
    }

    /// [`Self::check`] as the answer a handler returns: `429` with the bucket's code and a
    /// `Retry-After` of whole seconds, at least 1.
    pub fn admit(
        &self,
        tenant: TenantId,
        env: EnvironmentId,
        bucket: Bucket,
        now: OffsetDateTime,
    ) -> Result<(), ApiError> {
        self.check(tenant, env, bucket, now).map_err(|wait| {
            let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
            let secs = secs.max(1);
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                bucket.code,
                format!(
                    "at most {} {} calls per {} s for this environment; retry in {secs} s",
                    bucket.limit,
                    bucket.name,
                    bucket.period.as_secs()
                ),
            );
            e.retry_after = Some(secs);
            e
        })
    }

    #[cfg(test)]
    fn keys(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .arrivals
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_the_limit_then_one_per_interval() {
        let limiter = RateLimiter::default();
        let (t, e) = (TenantId::new(), EnvironmentId::new());
        let mut now = OffsetDateTime::now_utc();
        for _ in 0..6 {
            assert_eq!(limiter.check(t, e, CHECKIN, now), Ok(()));
        }
        let wait = limiter.check(t, e, CHECKIN, now).unwrap_err();
        assert_eq!(wait, Duration::from_secs(10));
        // Another bucket and another environment count apart.
        assert_eq!(limiter.check(t, e, REPORT, now), Ok(()));
        assert_eq!(limiter.check(t, EnvironmentId::new(), CHECKIN, now), Ok(()));
        now += Duration::from_secs(10);
        assert_eq!(limiter.check(t, e, CHECKIN, now), Ok(()));
        assert!(limiter.check(t, e, CHECKIN, now).is_err());
        let refused = limiter.admit(t, e, LEASE, now);
        assert!(refused.is_ok());
    }

    #[test]
    fn retry_after_is_whole_seconds_at_least_one() {
        let limiter = RateLimiter::default();
        let (t, e) = (TenantId::new(), EnvironmentId::new());
        let now = OffsetDateTime::now_utc();
        for _ in 0..5 {
            limiter.admit(t, e, LEASE, now).unwrap();
        }
        let refused = limiter.admit(t, e, LEASE, now).unwrap_err();
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.code, codes::LEASE_RATE_LIMITED);
        assert_eq!(refused.retry_after, Some(720));
        let refused = limiter
            .admit(t, e, LEASE, now + Duration::from_millis(719_500))
            .unwrap_err();
        assert_eq!(refused.retry_after, Some(1));
    }

    #[test]
    fn idle_keys_are_swept() {
        let limiter = RateLimiter::default();
        let t = TenantId::new();
        let start = OffsetDateTime::now_utc();
        for _ in 0..SWEEP_AT {
            limiter
                .check(t, EnvironmentId::new(), CHECKIN, start)
                .unwrap();
        }
        assert_eq!(limiter.keys(), SWEEP_AT);
        // A minute later every one of them is idle: the next new key sweeps them.
        let later = start + Duration::from_secs(61);
        limiter
            .check(t, EnvironmentId::new(), CHECKIN, later)
            .unwrap();
        assert_eq!(limiter.keys(), 1);
    }
}
