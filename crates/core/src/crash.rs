//! Crash points: places where the end-to-end crash matrix (`crates/cli/tests/it/failpoints.rs`)
//! stops the process as a power cut or `kill -9` would, at a chosen moment.
//!
//! With the `failpoints` feature (on only in the binary the tests build) a point named in the
//! `FAILPOINTS` environment variable as `name=return` aborts the process there: no destructor,
//! no flush, no answer. Without the feature, [`point`] compiles to nothing and `FAILPOINTS` is
//! not read.

/// The points, in the order a request meets them.
pub const POINTS: &[&str] = &[
    INGEST_BEFORE_COMMIT,
    INGEST_AFTER_COMMIT_BEFORE_ANSWER,
    WORKER_AFTER_LEASE_BEFORE_SEND,
    WORKER_AFTER_2XX_BEFORE_RECORD,
];

/// Ingest verified the request and is about to write it.
pub const INGEST_BEFORE_COMMIT: &str = "ingest_before_commit";
/// Ingest's transaction committed; the provider has not been answered.
pub const INGEST_AFTER_COMMIT_BEFORE_ANSWER: &str = "ingest_after_commit_before_answer";
/// A worker holds a delivery's lease and has not sent it.
pub const WORKER_AFTER_LEASE_BEFORE_SEND: &str = "worker_after_lease_before_send";
/// The destination answered 2xx; the attempt is not recorded.
pub const WORKER_AFTER_2XX_BEFORE_RECORD: &str = "worker_after_2xx_before_record";

/// Aborts the process here when `FAILPOINTS` names `name` (with the `failpoints` feature).
#[inline]
#[cfg_attr(not(feature = "failpoints"), allow(unused_variables))]
pub fn point(name: &str) {
    fail::fail_point!(name, |_| std::process::abort());
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
