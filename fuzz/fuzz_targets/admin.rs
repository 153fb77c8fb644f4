//! The admin API as anyone who reaches its listener can call it: what
//! [`hooklatch_fuzz::admin`] checks, on the in-memory store.

#![no_main]

use hooklatch_fuzz::admin::{run, Input};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: Input<'_>| run(&input));
