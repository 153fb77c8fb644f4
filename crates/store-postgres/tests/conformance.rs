//! Runs the backend conformance suite on the PostgreSQL store, a new database per case (created
//! through `HOOKLATCH_TEST_POSTGRES_URL`, dropped at the end). Without the variable it prints a
//! `skipped:` line; in CI it fails.

mod support;

use std::sync::Mutex;
use std::time::Instant;

use hooklatch_testkit::conformance::store_suite;
use support::TestDb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_postgres_store_passes_the_store_conformance_suite() {
    let Some(base) = support::base_url("the postgres conformance suite") else {
        return;
    };
    let started = Instant::now();
    let handle = tokio::runtime::Handle::current();
    let dbs = Mutex::new(Vec::new());
    // `store_suite` makes stores synchronously; creating a database and connecting are async,
    // so the maker steps out of the runtime to wait for them.
    store_suite(|| {
        tokio::task::block_in_place(|| {
            handle.block_on(async {
                let db = TestDb::create(&base).await;
                let store = db.store().await;
                dbs.lock().expect("test databases").push(db);
                store
            })
        })
    })
    .await;
    let dbs = dbs.into_inner().expect("test databases");
    eprintln!(
        "conformance: {} cases on their own databases in {:.1?}",
        dbs.len(),
        started.elapsed()
    );
    let mut drops = tokio::task::JoinSet::new();
    for db in dbs {
        drops.spawn(db.destroy());
    }
    drops.join_all().await;
}
