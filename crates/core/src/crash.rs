//! Crash points: places where the end-to-end crash matrix (`crates/cli/tests/it/failpoints.rs`)
//! stops the process as a power cut or `kill -9` would, at a chosen moment.
//!
//! With the `failpoints` feature (on only in the binary the tests build) a point named in the
//! `FAILPOINTS` environment variable as `name=return` aborts the process there: no destructor,
//! no flush, no answer. The ingest points and the worker's record points ([`fallible`]) also
//! take `name=return(error)`: the request (or the record) then fails there as it would with
//! the store away; they and the Redis-keys points ([`paused`]) take `name=return(pause:MS)`:
//! the request waits there MS milliseconds at an await, where a provider hanging up drops it
//! (the `fail` crate's `sleep` blocks the thread instead, so nothing is dropped during it). The `fail` crate's own actions work on every
//! point too, and a count (`name=1*return`) fires it only that many times. Without the
//! feature, the points compile to nothing and `FAILPOINTS` is not read.

/// The points, in the order a request meets them.
pub const POINTS: &[&str] = &[
    INGEST_BEFORE_COMMIT,
    KEYS_AFTER_CLAIM_BEFORE_STORE,
    KEYS_AFTER_STORE_BEFORE_DONE,
    INGEST_AFTER_COMMIT_BEFORE_ANSWER,
    MID_RESPONSE_WRITE,
    WORKER_AFTER_LEASE_BEFORE_SEND,
    WORKER_AFTER_2XX_BEFORE_RECORD,
    WORKER_AFTER_PUBLISH_BEFORE_RECORD,
    WORKER_BEFORE_DEAD_LETTER,
    WORKER_RECORD_BEFORE_STORE,
    WORKER_RECORD_AFTER_STORE,
];

/// Ingest's points that take `return(error)` as well as `return` ([`fallible`]).
pub const FALLIBLE_POINTS: &[&str] = &[INGEST_BEFORE_COMMIT, INGEST_AFTER_COMMIT_BEFORE_ANSWER];

/// The worker's points that take `return(error)` as well as `return` ([`fallible`]): an
/// attempt's record failing before it reaches the store, or after it committed.
pub const WORKER_FALLIBLE_POINTS: &[&str] =
    &[WORKER_RECORD_BEFORE_STORE, WORKER_RECORD_AFTER_STORE];

/// Ingest verified the request and is about to write it.
pub const INGEST_BEFORE_COMMIT: &str = "ingest_before_commit";
/// Redis-keys mode: the request's keys are leased in Redis; nothing is in the store.
pub const KEYS_AFTER_CLAIM_BEFORE_STORE: &str = "keys_after_claim_before_store";
/// Redis-keys mode: the store committed the request; its keys are not marked done in Redis.
pub const KEYS_AFTER_STORE_BEFORE_DONE: &str = "keys_after_store_before_done";
/// Ingest's transaction committed; the provider has not been answered.
pub const INGEST_AFTER_COMMIT_BEFORE_ANSWER: &str = "ingest_after_commit_before_answer";
/// Ingest's 2xx answer is being written: its status line is sent, the rest is not (the
/// connection then closes with the process). Checked where the ingest listener writes
/// ([`armed`]), not in the handler.
pub const MID_RESPONSE_WRITE: &str = "mid_response_write";
/// A worker holds a delivery's lease and has not sent it.
pub const WORKER_AFTER_LEASE_BEFORE_SEND: &str = "worker_after_lease_before_send";
/// The destination answered 2xx; the attempt is not recorded.
pub const WORKER_AFTER_2XX_BEFORE_RECORD: &str = "worker_after_2xx_before_record";
/// RabbitMQ confirmed the publish; the attempt is not recorded.
pub const WORKER_AFTER_PUBLISH_BEFORE_RECORD: &str = "worker_after_publish_before_record";
/// An attempt failed for good; its move to the dead-letter is not recorded.
pub const WORKER_BEFORE_DEAD_LETTER: &str = "worker_before_dead_letter";
/// An attempt's record is about to be sent to the store.
pub const WORKER_RECORD_BEFORE_STORE: &str = "worker_record_before_store";
/// The store committed an attempt's record; the worker has not heard its answer.
pub const WORKER_RECORD_AFTER_STORE: &str = "worker_record_after_store";

/// Aborts the process here when `FAILPOINTS` names `name` (with the `failpoints` feature).
#[inline]
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
pub fn point(name: &str) {
    fail::fail_point!(name, |_| std::process::abort());
}

/// Whether `FAILPOINTS` names `name` as `name=return` (with the `failpoints` feature; always
/// `false` without it, so a caller's branch compiles away): for a point whose abort must come
/// after the caller did something first ([`MID_RESPONSE_WRITE`]), then [`abort`].
#[inline]
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
pub fn armed(name: &str) -> bool {
    fail::fail_point!(name, |_| true);
    false
}

/// Aborts the process: no destructor, no flush, no answer (an armed point's end).
pub fn abort() -> ! {
    std::process::abort()
}

/// A point that can pause as well as abort: `Some(pause)` when `FAILPOINTS` names it as
/// `name=return(pause:MS)`, which the caller waits out at an await; aborts on `name=return`
/// as [`point`] does. `None` otherwise (always, without the `failpoints` feature).
#[inline]
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
pub fn paused(name: &str) -> Option<std::time::Duration> {
    fail::fail_point!(name, |action: Option<String>| {
        match action
            .as_deref()
            .and_then(|a| a.strip_prefix("pause:"))
            .map(str::parse::<u64>)
        {
            Some(Ok(ms)) => Some(std::time::Duration::from_millis(ms)),
            _ => std::process::abort(),
        }
    });
    None
}

/// A point that can fail or pause as well as abort: `Err` with a message naming the point
/// when `FAILPOINTS` names it as `name=return(error)`; `Ok(Some(pause))` for
/// `name=return(pause:MS)`, which the caller waits out at an await; aborts on `name=return`
/// as [`point`] does. `Ok(None)` otherwise (always, without the `failpoints` feature).
#[inline]
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
pub fn fallible(name: &str) -> Result<Option<std::time::Duration>, String> {
    fail::fail_point!(name, |action: Option<String>| {
        let action = action.unwrap_or_default();
        if action == "error" {
            return Err(format!("a failure injected at {name}"));
        }
        match action.strip_prefix("pause:").map(str::parse::<u64>) {
            Some(Ok(ms)) => Ok(Some(std::time::Duration::from_millis(ms))),
            _ => std::process::abort(),
        }
    });
    Ok(None)
}

/// Reads `FAILPOINTS` (with the `failpoints` feature; otherwise does nothing). Keep the
/// returned guard for the process's life.
pub fn setup() -> Option<fail::FailScenario<'static>> {
    #[cfg(feature = "failpoints")]
    {
        Some(fail::FailScenario::setup())
    }
    #[cfg(not(feature = "failpoints"))]
    {
        None
    }
}

#[cfg(all(test, feature = "failpoints"))]
mod tests {
    use super::*;

    #[test]
    fn a_fallible_point_fails_as_configured_and_only_as_often_as_its_count() {
        let scenario = fail::FailScenario::setup();
        assert_eq!(fallible(INGEST_BEFORE_COMMIT), Ok(None), "off by default");
        fail::cfg(INGEST_BEFORE_COMMIT, "2*return(error)").unwrap();
        for _ in 0..2 {
            let err = fallible(INGEST_BEFORE_COMMIT).unwrap_err();
            assert!(err.contains(INGEST_BEFORE_COMMIT), "{err}");
        }
        assert_eq!(fallible(INGEST_BEFORE_COMMIT), Ok(None), "after its count");
        assert_eq!(fallible(INGEST_AFTER_COMMIT_BEFORE_ANSWER), Ok(None));
        fail::cfg(INGEST_AFTER_COMMIT_BEFORE_ANSWER, "1*return(pause:1500)").unwrap();
        assert_eq!(
            fallible(INGEST_AFTER_COMMIT_BEFORE_ANSWER),
            Ok(Some(std::time::Duration::from_millis(1500)))
        );
        assert_eq!(fallible(INGEST_AFTER_COMMIT_BEFORE_ANSWER), Ok(None));
        assert_eq!(
            paused(KEYS_AFTER_CLAIM_BEFORE_STORE),
            None,
            "off by default"
        );
        fail::cfg(KEYS_AFTER_CLAIM_BEFORE_STORE, "1*return(pause:250)").unwrap();
        assert_eq!(
            paused(KEYS_AFTER_CLAIM_BEFORE_STORE),
            Some(std::time::Duration::from_millis(250))
        );
        assert_eq!(
            paused(KEYS_AFTER_CLAIM_BEFORE_STORE),
            None,
            "after its count"
        );
        scenario.teardown();
    }

    #[test]
    fn a_point_is_armed_only_while_configured_and_only_as_often_as_its_count() {
        let scenario = fail::FailScenario::setup();
        assert!(!armed(MID_RESPONSE_WRITE), "off by default");
        fail::cfg(MID_RESPONSE_WRITE, "1*return").unwrap();
        assert!(armed(MID_RESPONSE_WRITE));
        assert!(!armed(MID_RESPONSE_WRITE), "after its count");
        assert!(!armed(INGEST_BEFORE_COMMIT));
        scenario.teardown();
    }
}
