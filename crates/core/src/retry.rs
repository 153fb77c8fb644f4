//! When to try a failed delivery again, and when to give up.
//!
//! Exponential backoff with jitter, never earlier than the destination's `Retry-After`,
//! capped at `max_backoff`; after `max_attempts` attempts or once the event is older than
//! `max_age`, the delivery is dead-lettered. Time is an argument, so tests need no clock.

use std::time::Duration;

use rand::Rng;

use crate::time::Timestamp;

/// A destination's retry schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Delay before the second attempt; doubled for each one after.
    pub initial_backoff: Duration,
    /// The longest delay between two attempts.
    pub max_backoff: Duration,
    /// Attempts in all (the first included) before dead-lettering.
    pub max_attempts: u32,
    /// How long after the event was received attempts may go on.
    pub max_age: Duration,
    /// Share of each delay drawn at random, in `0.0..=1.0`: a delay `d` becomes a value in
    /// `[d·(1−jitter), d]`, so no attempt comes later than the schedule says.
    pub jitter: f64,
}

impl Default for RetryPolicy {
    /// 5 s doubling to 1 h, 12 attempts (about 2.4 hours in all), give up after 3 days.
    fn default() -> RetryPolicy {
        RetryPolicy {
            initial_backoff: Duration::from_secs(5),
            max_backoff: Duration::from_secs(3600),
            max_attempts: 12,
            max_age: Duration::from_secs(3 * 24 * 3600),
            jitter: 0.2,
        }
    }
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NextAttempt {
    /// Try again at this time.
    At(Timestamp),
    /// Stop: move the delivery to the dead-letter.
    GiveUp,
}

impl RetryPolicy {
    /// The delay after failed attempt number `attempt` (1-based), before jitter.
    pub fn backoff(&self, attempt: u32) -> Duration {
        let exp = attempt.saturating_sub(1).min(32);
        let factor = 1u64 << exp;
        let millis = (self.initial_backoff.as_millis() as u64).saturating_mul(factor);
        Duration::from_millis(millis).min(self.max_backoff)
    }

    /// Decides the next step after failed attempt `attempt` (1-based) of an event received at
    /// `received_at`; `retry_after` is the destination's own request, honoured as a floor.
    pub fn next(
        &self,
        attempt: u32,
        received_at: Timestamp,
        now: Timestamp,
        retry_after: Option<Duration>,
        rng: &mut impl Rng,
    ) -> NextAttempt {
        if attempt >= self.max_attempts {
            return NextAttempt::GiveUp;
        }
        let base = self.backoff(attempt);
        let jitter = self.jitter.clamp(0.0, 1.0);
        let cut = if jitter > 0.0 {
            rng.random_range(0.0..=jitter)
        } else {
            0.0
        };
        let mut delay = base.mul_f64(1.0 - cut);
        if let Some(floor) = retry_after {
            delay = delay.max(floor);
        }
        let at = now.plus(delay);
        if at > received_at.plus(self.max_age) {
            return NextAttempt::GiveUp;
        }
        NextAttempt::At(at)
    }
}

/// Parses a `Retry-After` value: delay-seconds or an HTTP date, relative to `now`.
pub fn parse_retry_after(value: &str, now: Timestamp) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = parse_http_date(value)?;
    Some(at.since(now))
}

/// Parses an IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`), the only form senders must use.
fn parse_http_date(value: &str) -> Option<Timestamp> {
    let rest = value.split_once(", ")?.1;
    let mut parts = rest.split(' ');
    let day: i64 = parts.next()?.parse().ok()?;
    let month = match parts.next()? {
        "Jan" => 1,
        "Feb" => 2,
        "Mar" => 3,
        "Apr" => 4,
        "May" => 5,
        "Jun" => 6,
        "Jul" => 7,
        "Aug" => 8,
        "Sep" => 9,
        "Oct" => 10,
        "Nov" => 11,
        "Dec" => 12,
        _ => return None,
    };
    let year: i64 = parts.next()?.parse().ok()?;
    let mut hms = parts.next()?.split(':');
    let h: i64 = hms.next()?.parse().ok()?;
    let m: i64 = hms.next()?.parse().ok()?;
    let s: i64 = hms.next()?.parse().ok()?;
    if parts.next()? != "GMT" || !(1..=31).contains(&day) || h > 23 || m > 59 || s > 60 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    Some(Timestamp::from_secs(days * 86_400 + h * 3600 + m * 60 + s))
}

/// Days since 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;

    fn policy() -> RetryPolicy {
        RetryPolicy {
            initial_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(60),
            max_attempts: 5,
            max_age: Duration::from_secs(3600),
            jitter: 0.2,
        }
    }

    #[test]
    fn backoff_doubles_and_caps() {
        let p = policy();
        let secs: Vec<u64> = (1..=8).map(|n| p.backoff(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60, 60]);
    }

    #[test]
    fn jitter_only_shortens_within_its_bound() {
        let p = policy();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let now = Timestamp(1_000_000);
        for attempt in 1..4 {
            for _ in 0..200 {
                let NextAttempt::At(at) = p.next(attempt, now, now, None, &mut rng) else {
                    panic!("gave up early");
                };
                let delay = at.since(now);
                let base = p.backoff(attempt);
                assert!(
                    delay <= base && delay >= base.mul_f64(0.8),
                    "{delay:?} vs {base:?}"
                );
            }
        }
    }

    #[test]
    fn retry_after_is_a_floor() {
        let p = policy();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let now = Timestamp(0);
        let next = p.next(1, now, now, Some(Duration::from_secs(30)), &mut rng);
        assert_eq!(next, NextAttempt::At(Timestamp(30_000)));
    }

    #[test]
    fn gives_up_after_max_attempts_or_max_age() {
        let p = policy();
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let t0 = Timestamp(0);
        assert_eq!(p.next(5, t0, t0, None, &mut rng), NextAttempt::GiveUp);
        let late = t0.plus(Duration::from_secs(3599));
        assert_eq!(p.next(2, t0, late, None, &mut rng), NextAttempt::GiveUp);
    }

    #[test]
    fn retry_after_parses_seconds_and_dates() {
        let now = Timestamp::from_secs(784_111_777); // Sun, 06 Nov 1994 08:49:37 GMT
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:50:37 GMT", now),
            Some(Duration::from_secs(60))
        );
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(
            parse_retry_after("Sun, 06 Foo 1994 08:50:37 GMT", now),
            None
        );
    }
}
