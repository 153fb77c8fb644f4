//! The ingest listener on the real SQLite store (WAL, `synchronous = FULL`), what
//! [`hooklatch_fuzz::ingest`] checks. One store serves a thousand inputs, then a new file
//! takes its place (so a run's files stay small); it lives in `/dev/shm` where there is one,
//! so that its fsyncs cost little.

#![no_main]

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hooklatch_core::Store;
use hooklatch_fuzz::ingest::{run, runtime, Input};
use hooklatch_store_sqlite::{SqliteOptions, SqliteStore};
use libfuzzer_sys::fuzz_target;

/// Inputs one store file serves.
const INPUTS_PER_STORE: usize = 1000;

/// The store in use, its directory, and how many inputs it has served.
struct Current {
    store: Arc<SqliteStore>,
    dir: PathBuf,
    served: usize,
}

static CURRENT: Mutex<Option<Current>> = Mutex::new(None);

fn open(generation: usize) -> Current {
    let base = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!(
        "hooklatch-fuzz-{}-{generation}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("a directory for the store");
    let url = format!("sqlite://{}", dir.join("hooklatch.db").display());
    let opts = SqliteOptions::from_url(&url).expect("a store URL");
    let _runtime = runtime().enter();
    let store = SqliteStore::open(&opts).expect("a new SQLite store");
    Current {
        store: Arc::new(store),
        dir,
        served: 0,
    }
}

/// The store for the next input: the current one, or a new file once it has served its share
/// (the old one closed and removed).
fn store() -> Arc<dyn Store> {
    static GENERATION: AtomicUsize = AtomicUsize::new(0);
    let mut current = CURRENT.lock().expect("no input panics while holding it");
    if current
        .as_ref()
        .is_none_or(|c| c.served >= INPUTS_PER_STORE)
    {
        if let Some(old) = current.take() {
            drop(old.store);
            let _ = std::fs::remove_dir_all(&old.dir);
        }
        *current = Some(open(GENERATION.fetch_add(1, Ordering::Relaxed)));
    }
    let current = current.as_mut().expect("a store was just opened");
    current.served += 1;
    current.store.clone()
}

fuzz_target!(|input: Input<'_>| run(&input, store()));
