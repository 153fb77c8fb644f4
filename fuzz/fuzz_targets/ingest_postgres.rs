//! The ingest listener on the real PostgreSQL store, what [`hooklatch_fuzz::ingest`] checks.
//! The database is `HOOKLATCH_FUZZ_POSTGRES_URL`'s, which `scripts/fuzz` creates for the run
//! and drops after it; every input shares it (the checks hold on a store that already holds
//! earlier inputs' events).

#![no_main]

use std::sync::{Arc, OnceLock};

use hooklatch_core::Store;
use hooklatch_fuzz::ingest::{run, runtime, Input};
use hooklatch_store_postgres::{PgOptions, PostgresStore};
use libfuzzer_sys::fuzz_target;

fn store() -> Arc<dyn Store> {
    static STORE: OnceLock<Arc<PostgresStore>> = OnceLock::new();
    STORE
        .get_or_init(|| {
            let url = std::env::var("HOOKLATCH_FUZZ_POSTGRES_URL")
                .expect("HOOKLATCH_FUZZ_POSTGRES_URL: a database of the run's own (scripts/fuzz)");
            let opts = PgOptions::from_url(&url).expect("a store URL");
            let store = runtime()
                .block_on(PostgresStore::connect(&opts))
                .expect("the fuzz database");
            Arc::new(store)
        })
        .clone()
}

fuzz_target!(|input: Input<'_>| run(&input, store()));
