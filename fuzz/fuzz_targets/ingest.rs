//! The ingest listener on the in-memory store, a new one per input: what
//! [`hooklatch_fuzz::ingest`] checks, as fast as it goes (the stores' own behaviour is the
//! conformance suite's; `ingest_sqlite` runs the same on the real SQLite store).

#![no_main]

use std::sync::Arc;

use hooklatch_fuzz::ingest::{run, Input};
use hooklatch_testkit::MemoryStore;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: Input<'_>| run(&input, Arc::new(MemoryStore::default())));
