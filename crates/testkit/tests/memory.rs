//! Runs the backend conformance suite on [`MemoryStore`], so the test double keeps the
//! contract the real backends keep.

use hooklatch_testkit::conformance::store_suite;
use hooklatch_testkit::MemoryStore;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_store_passes_the_store_conformance_suite() {
    store_suite(MemoryStore::default).await;
}
