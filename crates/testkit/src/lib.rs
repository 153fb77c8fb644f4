//! hooklatch-testkit: test helpers shared by hooklatch's crates. Not published; not meant for
//! reuse outside this workspace.
//!
//! Layout:
//! - [`MemoryStore`]: an in-memory [`Store`](hooklatch_core::Store), the test double for the
//!   layers above `core` (HTTP handlers, delivery workers, maintenance).
//! - [`conformance`]: the backend conformance suite, [`conformance::store_suite`], which every
//!   `Store` implementation runs (the SQLite store and [`MemoryStore`] included), and the
//!   [`conformance::fixture`] builders its cases use.
//! - `amqp` (feature `amqp`): a test's own RabbitMQ connection and the broker URL the tests
//!   share.
//! - [`counting`]: a `Store` or `KeyStore` wrapped to count each operation called, and
//!   [`MemoryKeys`], an in-memory `KeyStore`.
//! - [`proxy`]: a TCP fault proxy that cuts a service off (Toxiproxy's `down`, `reset_peer`,
//!   `timeout`), slows it (`latency`) and lets it through again.
//! - `lazyfs` (feature `lazyfs`): a FUSE file system that loses what was not fsynced, for
//!   power-loss tests.
//! - `tls` (feature `tls`): a private CA made at run time and a TLS-terminating proxy in front
//!   of a plain TCP server, for tests of TLS clients (`amqps://`).
#![forbid(unsafe_code)]

#[cfg(feature = "amqp")]
pub mod amqp;
pub mod conformance;
pub mod counting;
#[cfg(feature = "lazyfs")]
pub mod lazyfs;
mod memory;
pub mod proxy;
#[cfg(feature = "tls")]
pub mod tls;

pub use counting::{Counting, Fault, Faults, MemoryKeys};
pub use memory::MemoryStore;
