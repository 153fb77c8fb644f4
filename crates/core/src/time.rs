//! Time as the core sees it: a plain number passed in by the caller.
//!
//! Nothing in `core` reads a clock. Callers pass a [`Timestamp`], so tests move time by hand.
//! The one clock callers at the edge read, [`Timestamp::now`], is the wall clock unless a
//! deterministic simulation runs the gateway on its thread under a clock of its own
//! ([`simulate_clock`]).

use std::cell::Cell;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

thread_local! {
    /// This thread's simulated clock, if a simulation set one.
    static SIMULATED: Cell<Option<fn() -> Timestamp>> = const { Cell::new(None) };
}

/// Makes [`Timestamp::now`] on this thread read `clock` instead of the wall clock; `None` gives
/// the wall clock back. For simulations that run the whole gateway on one thread under a
/// virtual clock (RELIABILITY.md, T24): the server never sets it.
pub fn simulate_clock(clock: Option<fn() -> Timestamp>) {
    SIMULATED.with(|c| c.set(clock));
}

/// Milliseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(pub i64);

impl Timestamp {
    /// The wall clock, for callers at the edge (the server, the CLI); a simulation's clock on
    /// a thread it set one on ([`simulate_clock`]).
    pub fn now() -> Timestamp {
        if let Some(clock) = SIMULATED.with(Cell::get) {
            return clock();
        }
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        Timestamp(since.as_millis() as i64)
    }

    /// From whole seconds since the epoch.
    pub fn from_secs(secs: i64) -> Timestamp {
        Timestamp(secs.saturating_mul(1000))
    }

    /// Whole seconds since the epoch (rounded down).
    pub fn as_secs(self) -> i64 {
        self.0.div_euclid(1000)
    }

    /// Milliseconds since the epoch.
    pub fn as_millis(self) -> i64 {
        self.0
    }

    /// This time plus `d`, saturating.
    pub fn plus(self, d: Duration) -> Timestamp {
        Timestamp(
            self.0
                .saturating_add(d.as_millis().min(i64::MAX as u128) as i64),
        )
    }

    /// This time minus `d`, saturating.
    pub fn minus(self, d: Duration) -> Timestamp {
        Timestamp(
            self.0
                .saturating_sub(d.as_millis().min(i64::MAX as u128) as i64),
        )
    }

    /// How long after `earlier` this is; zero if it is not after it.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0).max(0) as u64)
    }
}

/// The proleptic Gregorian date (year, month, day) `days` after 1970-01-01 (Howard Hinnant's
/// algorithm).
pub fn civil_date(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(month <= 2), month, day)
}

impl Timestamp {
    /// RFC 3339 in UTC with milliseconds (`2026-12-02T13:04:05.123Z`), for people and JSON.
    pub fn to_rfc3339(self) -> String {
        let secs = self.0.div_euclid(1000);
        let millis = self.0.rem_euclid(1000);
        let sod = secs.rem_euclid(86_400);
        let (year, month, day) = civil_date(secs.div_euclid(86_400));
        format!(
            "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{millis:03}Z",
            sod / 3600,
            sod % 3600 / 60,
            sod % 60
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339() {
        assert_eq!(Timestamp(0).to_rfc3339(), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            Timestamp(784_111_777_042).to_rfc3339(),
            "1994-11-06T08:49:37.042Z"
        );
        assert_eq!(
            Timestamp(1_709_251_200_000).to_rfc3339(),
            "2024-03-01T00:00:00.000Z"
        );
    }

    #[test]
    fn civil_dates_from_day_numbers() {
        assert_eq!(civil_date(0), (1970, 1, 1));
        assert_eq!(civil_date(59), (1970, 3, 1));
        assert_eq!(civil_date(11_016), (2000, 2, 29));
        assert_eq!(civil_date(20_793), (2026, 12, 6));
        assert_eq!(civil_date(-1), (1969, 12, 31));
    }
}
