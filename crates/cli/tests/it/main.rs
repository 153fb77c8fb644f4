//! End-to-end tests of the `hooklatch` binary: each test runs a real `hooklatch serve` process
//! on loopback, with its own temp dir, SQLite file and ports, delivering to a real HTTP handler
//! inside the test. Together they prove the foundation issue's "Proof" list.
//!
//! `booking` also runs an example service (`examples/whatsapp-booking`) as a real process
//! behind the gateway.
//!
//! One test binary (one link step); helpers live in `support`, scenarios in one module each.
//! `TEST_LOG=1` shows the gateways' logs; otherwise a failing test prints its gateway's log tail.

#[path = "../common/example_bin.rs"]
mod example_bin;
mod report;
mod support;
#[path = "../common/test_database.rs"]
mod test_database;

mod admin_cli;
mod api_fuzz;
mod booking;
mod check_config;
mod crash;
mod deploy;
mod failpoints;
mod forgery;
mod gone;
mod hangups;
mod hygiene;
mod ingest_tls;
mod inspector;
mod listen;
mod metrics;
mod outbound;
mod postgres;
mod power_loss;
mod providers;
mod redeliver;
mod redis;
mod rejections;
mod retries;
mod rotation;
mod scoping;
mod seed;
mod shutdown;
mod store_full;
mod timing;
