//! Runs the backend conformance suite on the SQLite store, a new database file per case, plus
//! what only a real file shows: a returned ingest is in the file, a full file refuses an
//! ingest whole, committed pages are checkpointed into the file beside the writer, and a
//! serving open takes the file alone and gives back a dead gateway's leases.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use hooklatch_core::store::AttemptNext;
use hooklatch_core::{Claim, Store, StoreError};
use hooklatch_store_sqlite::{SqliteOptions, SqliteStore};
use hooklatch_testkit::conformance::fixture::{
    all_deliveries, all_requests, at, attempt, idempotency_key, ingest, ALL, DESTINATIONS, T0,
    WORKER,
};
use hooklatch_testkit::conformance::store_suite;
use tokio::task::JoinSet;

const BODY: &[u8] = br#"{"id":"evt_1","type":"invoice.paid"}"#;

fn open(path: &Path) -> SqliteStore {
    SqliteStore::open(&SqliteOptions::new(path)).expect("opening the sqlite store")
}

/// Counts rows in the file through a plain connection, not through any store.
fn count(path: &Path, sql: &str) -> i64 {
    let conn = rusqlite::Connection::open(path).expect("opening the file directly");
    conn.query_row(sql, [], |r| r.get(0)).expect(sql)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sqlite_store_passes_the_store_conformance_suite() {
    let dir = tempfile::tempdir().expect("tempdir");
    let n_cases = AtomicUsize::new(0);
    store_suite(|| {
        let n = n_cases.fetch_add(1, Ordering::Relaxed);
        open(&dir.path().join(format!("case-{n}.db")))
    })
    .await;
}

/// When ingest returns, the claim and its deliveries are in the file: a copy of the database
/// and its WAL taken at that moment (what a crash would leave) has them, and so does a fresh
/// store on the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returned_ingest_is_in_the_file_not_just_in_the_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hooklatch.db");
    let store = open(&path);
    let outcome = store
        .ingest(ingest("stripe", &["evt_1"], BODY, T0))
        .await
        .expect("ingest");

    // What a crash right now would leave on disk: the database file and its WAL.
    let crashed = dir.path().join("crashed");
    std::fs::create_dir(&crashed).expect("mkdir");
    for suffix in ["", "-wal"] {
        let from = format!("{}{suffix}", path.display());
        let to = format!("{}{suffix}", crashed.join("hooklatch.db").display());
        std::fs::copy(&from, &to).expect("copying the database files");
    }
    let copy = crashed.join("hooklatch.db");
    assert_eq!(
        count(&copy, "SELECT count(*) FROM claims WHERE key = 'evt_1'"),
        1
    );
    let deliveries = format!(
        "SELECT count(*) FROM deliveries WHERE request_id = {}",
        outcome.request_id.0
    );
    assert_eq!(count(&copy, &deliveries), DESTINATIONS.len() as i64);

    // A fresh store on the copy, and one on the original file once the first store is gone,
    // both see the claim and its deliveries.
    drop(store);
    for reopened in [open(&copy), open(&path)] {
        let again = reopened
            .ingest(ingest("stripe", &["evt_1"], BODY, at(1)))
            .await
            .expect("ingest");
        assert_eq!(
            again.claims[0].1,
            Claim::Duplicate {
                first_request: outcome.request_id,
                first_seen: T0
            }
        );
        let rows = all_deliveries(&reopened).await;
        assert_eq!(rows.len(), DESTINATIONS.len());
        assert!(rows.iter().all(|d| d.request_id == outcome.request_id
            && d.idempotency_key == idempotency_key("stripe", "evt_1")));
    }
}

/// `len` bytes that compression cannot shrink (the store compresses bodies at rest), from a
/// fixed xorshift sequence.
fn incompressible(len: usize) -> Vec<u8> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A store capped at `max_page_count` pages: room for the schema and small requests only.
fn open_capped(path: &Path) -> SqliteStore {
    let mut opts = SqliteOptions::new(path);
    // 64 pages of 4 KiB: the schema takes about 16; a 1 MiB body never fits.
    opts.max_page_count = Some(64);
    SqliteStore::open(&opts).expect("opening the capped sqlite store")
}

/// Past `max_page_count` an ingest is refused as full: never `Ok`, and nothing of it stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_refuses_an_ingest_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hooklatch.db");
    let store = open_capped(&path);
    let big = incompressible(1 << 20);
    let res = store.ingest(ingest("stripe", &["evt_1"], &big, T0)).await;
    assert!(matches!(res, Err(StoreError::Full)), "got {res:?}");

    assert!(all_requests(&store).await.is_empty(), "no request row left");
    assert!(all_deliveries(&store).await.is_empty(), "no delivery left");
    assert_eq!(store.stats().await.expect("stats").claims, 0);
    assert_eq!(count(&path, "SELECT count(*) FROM claims"), 0);

    let retried = store
        .ingest(ingest("stripe", &["evt_1"], BODY, at(1)))
        .await
        .expect("a small request still fits");
    assert!(
        matches!(retried.claims[0].1, Claim::New { .. }),
        "the refused ingest claimed nothing, got {:?}",
        retried.claims[0].1
    );
}

/// A store filled to its cap by new requests still delivers what it accepted: the last pages
/// are kept for leases and attempts. Without the reserve, the attempts below ran out of pages
/// with every accepted event still waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_full_of_requests_still_leases_and_records_attempts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hooklatch.db");
    let store = open_capped(&path);
    let body = incompressible(3 * 1024);
    let mut accepted = 0;
    for i in 0.. {
        let key = format!("evt_{i}");
        match store
            .ingest(ingest("stripe", &[key.as_str()], &body, T0))
            .await
        {
            Ok(_) => accepted += 1,
            Err(StoreError::Full) => break,
            Err(err) => panic!("{key}: {err}"),
        }
    }
    assert!(accepted > 0, "the store had room for some requests");
    let lease = std::time::Duration::from_secs(60);
    // Every delivery fails and is retried, round after round: an attempt row each time.
    for round in 0..5 {
        let now = at(10 + round);
        let leased = store
            .lease_due(WORKER, now, lease, ALL)
            .await
            .unwrap_or_else(|err| panic!("round {round}: leasing on a full store: {err}"));
        assert_eq!(
            leased.len(),
            2 * accepted,
            "round {round}: every delivery is due"
        );
        for d in leased {
            store
                .record_attempt(attempt(
                    d.id,
                    now,
                    Some(500),
                    Some("HTTP 500"),
                    AttemptNext::RetryAt(now),
                ))
                .await
                .unwrap_or_else(|err| panic!("round {round}: recording an attempt: {err}"));
        }
    }
    let attempts = count(&path, "SELECT count(*) FROM attempts");
    assert_eq!(attempts, 10 * accepted as i64);
    // New requests are still refused.
    let res = store
        .ingest(ingest("stripe", &["evt_late"], &body, at(100)))
        .await;
    assert!(matches!(res, Err(StoreError::Full)), "got {res:?}");
}

/// A full database makes SQLite roll back the whole group-commit transaction, not just the
/// failed statement. The writer used to carry on with the batch's later jobs outside any
/// transaction (each committed by its own savepoint release) and then tell every caller the
/// final COMMIT failed: stored claims answered with errors, and the refused ingest itself got
/// "unavailable" instead of "full".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_ingest_in_a_group_commit_leaves_its_neighbors_whole() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hooklatch.db");
    let store = Arc::new(open_capped(&path));
    let big = incompressible(1 << 20);
    // Concurrent ingests share group commits: some too big to fit, the rest small.
    let mut tasks = JoinSet::new();
    for i in 0..24 {
        let key = format!("evt_{i}");
        let oversized = i % 3 == 0;
        let body = if oversized {
            big.clone()
        } else {
            BODY.to_vec()
        };
        let store = store.clone();
        tasks.spawn(async move {
            let res = store
                .ingest(ingest("stripe", &[key.as_str()], &body, T0))
                .await;
            (key, oversized, res)
        });
    }
    let mut results = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        results.push(joined.expect("an ingest task panicked"));
    }
    // Every oversized ingest is refused; a small one may be too, when a refusal in its group
    // commit undid it. Either way, what a caller hears matches what is in the file.
    for (key, oversized, res) in results {
        let claims = count(
            &path,
            &format!("SELECT count(*) FROM claims WHERE key = '{key}'"),
        );
        let deliveries = count(
            &path,
            &format!("SELECT count(*) FROM deliveries WHERE idempotency_key = 'stripe:{key}'"),
        );
        match res {
            Ok(outcome) => {
                assert!(!oversized, "{key}: an oversized ingest was stored");
                assert!(matches!(outcome.claims[0].1, Claim::New { .. }), "{key}");
                assert_eq!((claims, deliveries), (1, 2), "{key}: committed whole");
            }
            Err(err) => {
                assert!(matches!(err, StoreError::Full), "{key}: {err}");
                assert_eq!(
                    (claims, deliveries),
                    (0, 0),
                    "{key}: nothing after an error"
                );
            }
        }
    }
}

/// A JSON body is compressed in the file and comes back byte-exact in history and to a
/// delivery worker, with its length as received; a body compression cannot shrink is stored
/// as it came.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_compressed_in_the_file_and_come_back_byte_exact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hooklatch.db");
    let store = open(&path);
    let lines: Vec<String> = (0..60)
        .map(|i| format!(r#"{{"id":"il_{i:06}","object":"line_item","currency":"usd"}}"#))
        .collect();
    let json = format!(r#"{{"id":"evt_1","lines":[{}]}}"#, lines.join(","));
    let noise = incompressible(3000);
    let mut ids = Vec::new();
    for (key, body) in [("evt_1", json.as_bytes()), ("evt_2", &noise[..])] {
        let outcome = store
            .ingest(ingest("stripe", &[key], body, T0))
            .await
            .expect("ingest");
        ids.push(outcome.request_id);
    }

    let stored = |id: hooklatch_core::RequestId| {
        let conn = rusqlite::Connection::open(&path).expect("opening the file directly");
        conn.query_row(
            "SELECT body_codec, length(body), body_length FROM requests WHERE id = ?1",
            [id.0],
            |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, i64>(1)?,
                    r.get::<_, i64>(2)?,
                ))
            },
        )
        .expect("the request row")
    };
    let (codec, on_disk, length) = stored(ids[0]);
    assert_eq!((codec, length), (1, json.len() as i64));
    assert!(
        on_disk * 3 < length,
        "{length} bytes of JSON take {on_disk} in the file"
    );
    assert_eq!(stored(ids[1]), (0, 3000, 3000));

    for (id, body) in ids.iter().zip([json.as_bytes(), &noise[..]]) {
        let detail = store
            .get_request(*id)
            .await
            .expect("get_request")
            .expect("the request");
        assert_eq!(detail.body, body);
        assert_eq!(detail.summary.body_len, body.len() as u64);
    }
    let leased = store
        .lease_due("worker", at(1), std::time::Duration::from_secs(30), 100)
        .await
        .expect("lease");
    assert_eq!(leased.len(), 2 * DESTINATIONS.len());
    for delivery in &leased {
        let want: &[u8] = if delivery.request_id == ids[0] {
            json.as_bytes()
        } else {
            &noise
        };
        assert_eq!(delivery.body, want, "delivery {:?}", delivery.id);
    }
}

/// Committed pages reach the database file while the gateway runs, copied by the background
/// checkpointer: the writer's own threshold (1,000 WAL pages) is above what this writes
/// (about 400 pages), so without that thread the file would keep its empty size until the
/// WAL grew that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn committed_pages_reach_the_database_file_beside_the_writer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hooklatch.db");
    let store = open(&path);
    let empty = std::fs::metadata(&path).expect("the database file").len();
    let body = incompressible(4000);
    for i in 0..200 {
        let key = format!("evt_{i}");
        store
            .ingest(ingest("stripe", &[key.as_str()], &body, at(i)))
            .await
            .expect("ingest");
    }
    let want = empty + 200 * 4000;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let mut size = empty;
    while std::time::Instant::now() < deadline {
        size = std::fs::metadata(&path).expect("the database file").len();
        if size >= want {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(
        size >= want,
        "the database file is {size} bytes (empty: {empty}); 200 × 4 KB requests were committed"
    );
    drop(store);
}

/// A serving gateway takes the file for itself, and every lease it finds there is a dead
/// process's: they are given back at once, while a retry scheduled for later stays where it
/// is. A second serving open of the same file is refused while the first lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serving_open_gives_back_the_leases_a_dead_gateway_left() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("hooklatch.db");
    let now = hooklatch_core::Timestamp::now();
    let hour = std::time::Duration::from_secs(3600);
    {
        // The gateway that dies: it leases all four deliveries of two events for an hour and
        // attempts one of them, which fails and is scheduled again an hour later.
        let store = open(&path);
        store
            .ingest(ingest("stripe", &["evt_1", "evt_2"], BODY, T0))
            .await
            .expect("ingest");
        let leased = store
            .lease_due(WORKER, now, hour, ALL)
            .await
            .expect("lease");
        assert_eq!(leased.len(), 2 * DESTINATIONS.len());
        store
            .record_attempt(attempt(
                leased[0].id,
                now,
                Some(500),
                Some("HTTP 500"),
                AttemptNext::RetryAt(now.plus(hour)),
            ))
            .await
            .expect("attempt");
    }
    {
        // A plain open (no serving lock) leaves the leases alone.
        let store = open(&path);
        let leased = store
            .lease_due("worker-b", now, hour, ALL)
            .await
            .expect("lease");
        assert!(leased.is_empty(), "{leased:?}");
    }
    let (store, released) =
        SqliteStore::open_serving(&SqliteOptions::new(&path)).expect("a serving open");
    assert_eq!(released, 2 * DESTINATIONS.len() - 1);
    let err = SqliteStore::open_serving(&SqliteOptions::new(&path))
        .err()
        .expect("a second serving open is refused")
        .to_string();
    assert!(
        err.contains("one `hooklatch serve` per SQLite file"),
        "{err}"
    );
    let leased = store
        .lease_due("worker-b", now, 2 * hour, ALL)
        .await
        .expect("lease");
    assert_eq!(leased.len(), 2 * DESTINATIONS.len() - 1, "{leased:?}");
    let retried = store.lease_due("worker-b", now.plus(hour), hour, ALL).await;
    assert_eq!(
        retried.expect("lease").len(),
        1,
        "the retry comes due at its time"
    );
}
