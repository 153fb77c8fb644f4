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
//! - [`proxy`]: a TCP fault proxy that cuts a service off (Toxiproxy's `down`) and lets it
//!   through again.
#![forbid(unsafe_code)]

#[cfg(feature = "amqp")]
pub mod amqp;
pub mod conformance;
mod memory;
pub mod proxy;

pub use memory::MemoryStore;
