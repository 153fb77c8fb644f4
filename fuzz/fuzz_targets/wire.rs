//! The ingest listener from the bytes on the wire: what [`hooklatch_fuzz::wire`] checks,
//! through hyper's parser and the connection code every listener runs, on the in-memory store.

#![no_main]

use hooklatch_fuzz::wire::{run, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: Input<'_>| run(&input));
