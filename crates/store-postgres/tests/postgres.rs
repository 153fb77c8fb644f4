//! What only a real, shared PostgreSQL shows: an ingest waits on the unique index for another
//! session's uncommitted claim of its key (then a duplicate, or the claim after a rollback),
//! the wait limit turns into `Unavailable`, unsafe durability settings are refused, several
//! instances (separate pools, as separate gateway processes) make one claim per key, wake each
//! other's workers, and share the outbox through leases without ever handing a row to two
//! live leases. Each test has its own database; without `HOOKLATCH_TEST_POSTGRES_URL` each
//! prints a `skipped:` line (and fails when `CI` is set).

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hooklatch_core::store::{
    AttemptNext, AttemptResult, DeliveryFilter, DeliveryState, RequestFilter, Verdict,
};
use hooklatch_core::{Claim, DeliveryId, RequestId, Store, StoreError};
use hooklatch_store_postgres::{schema, PgOptions, PostgresStore};
use hooklatch_testkit::conformance::fixture::{
    all_deliveries, all_requests, at, attempt, deliveries_with_key, delivery, idempotency_key,
    ingest, new_deliveries, rejection, requests_with_key, sha256, ALL, DESTINATIONS, RETENTION, T0,
    WORKER,
};
use sqlx::postgres::PgListener;
use sqlx::{Executor, PgConnection, Row};
use support::{with_param, TestDb};
use tokio::sync::{Barrier, Notify};
use tokio::task::JoinSet;

const SOURCE: &str = "stripe";
const BODY: &[u8] = br#"{"id":"evt_x","type":"invoice.paid"}"#;
/// Long enough that no lock wait in these tests gives up by itself.
const PATIENT: Duration = Duration::from_secs(60);
/// How long a test waits for something that should happen soon (never a timing assertion).
const BOUND: Duration = Duration::from_secs(30);

/// A store that waits for locks up to `lock_timeout`.
async fn store_waiting(db: &TestDb, lock_timeout: Duration) -> PostgresStore {
    let mut opts = db.options();
    opts.lock_timeout = lock_timeout;
    db.store_with(opts).await
}

/// A store with one writer task (so jobs queued while it waits share its next batch) that
/// waits for locks as long as a test needs.
async fn one_patient_writer(db: &TestDb) -> PostgresStore {
    let mut opts = db.options();
    opts.writers = 1;
    opts.lock_timeout = PATIENT;
    db.store_with(opts).await
}

/// A fresh database and a [`one_patient_writer`] store on it holding `n` events
/// (`{prefix}{i}`), each queued for delivery.
async fn patient_writer_with_events(base: &str, prefix: &str, n: usize) -> (TestDb, PostgresStore) {
    let db = TestDb::create(base).await;
    let store = one_patient_writer(&db).await;
    for i in 0..n {
        store
            .ingest(ingest(SOURCE, &[&format!("{prefix}{i}")], BODY, at(1)))
            .await
            .expect("ingest");
    }
    (db, store)
}

/// The one writer of a [`one_patient_writer`] store, waiting on another session's uncommitted
/// claim: the jobs sent meanwhile queue up for its next batch.
struct HeldWriter {
    raw: PgConnection,
    blocked: tokio::task::JoinHandle<Result<hooklatch_core::store::IngestOutcome, StoreError>>,
}

impl HeldWriter {
    async fn hold(db: &TestDb, store: &PostgresStore) -> HeldWriter {
        HeldWriter::hold_on(db, store, "evt_x").await
    }

    /// [`HeldWriter::hold`] on the claim of `key` (a writer held twice needs two keys: the
    /// first ingest it blocked claims its key once let go).
    async fn hold_on(db: &TestDb, store: &PostgresStore, key: &str) -> HeldWriter {
        let raw = hold_claim(db, key, BODY, 777).await;
        let blocked = spawn_ingest(store, key);
        assert_eq!(lock_wait(db).await.0, "Lock");
        HeldWriter { raw, blocked }
    }

    /// Lets the writer go after the jobs sent meanwhile had time to queue (were one late, it
    /// would only run in a batch of its own: the tests' assertions hold either way).
    async fn release(mut self) {
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.raw.execute("ROLLBACK").await.expect("ROLLBACK");
        self.blocked
            .await
            .expect("ingest task")
            .expect("the blocked ingest");
    }
}

/// A raw session holding `BEGIN; INSERT` of the claim of `key`, as request `request_id`
/// with `body`'s hash, uncommitted.
async fn hold_claim(db: &TestDb, key: &str, body: &[u8], request_id: i64) -> PgConnection {
    let mut raw = db.raw().await;
    raw.execute("BEGIN").await.expect("BEGIN");
    sqlx::query(
        "INSERT INTO claims (source, key, body_sha256, request_id, claimed_at, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(SOURCE)
    .bind(key)
    .bind(&sha256(body)[..])
    .bind(request_id)
    .bind(T0.0)
    .bind(T0.plus(RETENTION).0)
    .execute(&mut raw)
    .await
    .expect("inserting the claim in the raw session");
    raw
}

/// Waits (bounded) until a session on the test database waits for a lock, and returns its
/// `(wait_event_type, wait_event)`.
async fn lock_wait(db: &TestDb) -> (String, String) {
    let mut observer = db.raw().await;
    let started = Instant::now();
    loop {
        let row = sqlx::query(
            "SELECT wait_event_type, wait_event FROM pg_stat_activity
             WHERE datname = $1 AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()",
        )
        .bind(&db.name)
        .fetch_optional(&mut observer)
        .await
        .expect("reading pg_stat_activity");
        if let Some(row) = row {
            return (row.get(0), row.get(1));
        }
        assert!(
            started.elapsed() < BOUND,
            "no session of {} ever waited for a lock",
            db.name
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn spawn_ingest(
    store: &PostgresStore,
    key: &str,
) -> tokio::task::JoinHandle<Result<hooklatch_core::store::IngestOutcome, StoreError>> {
    let store = store.clone();
    let ingest = ingest(SOURCE, &[key], BODY, at(1));
    tokio::spawn(async move { store.ingest(ingest).await })
}

/// Three ingests of keys nobody holds commit (bounded wait), in spite of `waiting`.
async fn free_keys_commit(store: &PostgresStore, waiting: &str) {
    for i in 0..3 {
        let key = format!("evt_free{i}");
        let outcome = tokio::time::timeout(BOUND, spawn_ingest(store, &key))
            .await
            .unwrap_or_else(|_| panic!("{key} was held back by {waiting}"))
            .expect("ingest task")
            .expect("ingest");
        assert!(matches!(outcome.claims[0].1, Claim::New { .. }));
    }
}

/// Delivery attempts commit in a lane of their own: with one writer task for the ingest path,
/// an attempt stuck on a row lock does not hold back acknowledgements.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_waiting_on_a_lock_does_not_hold_back_ingests() {
    let Some(base) = support::base_url("the attempts lane test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = one_patient_writer(&db).await;
    let queued = spawn_ingest(&store, "evt_queued")
        .await
        .expect("ingest task")
        .expect("ingest");
    assert!(matches!(queued.claims[0].1, Claim::New { .. }));
    let leased = store
        .lease_due(WORKER, at(2), Duration::from_secs(60), 10)
        .await
        .expect("lease");
    let id = leased[0].id;

    // Another session holds the delivery row: the attempt's update waits for it.
    let mut raw = db.raw().await;
    raw.execute("BEGIN").await.expect("BEGIN");
    sqlx::query("SELECT id FROM deliveries WHERE id = $1 FOR UPDATE")
        .bind(id.0)
        .execute(&mut raw)
        .await
        .expect("locking the delivery row");
    let attempting = {
        let store = store.clone();
        let result = attempt(id, at(3), Some(200), None, AttemptNext::Delivered);
        tokio::spawn(async move { store.record_attempt(result).await })
    };
    assert_eq!(lock_wait(&db).await.0, "Lock");

    free_keys_commit(&store, "the attempt waiting on a lock").await;
    assert!(!attempting.is_finished(), "the attempt still waits");

    raw.execute("ROLLBACK").await.expect("ROLLBACK");
    attempting
        .await
        .expect("attempt task")
        .expect("the attempt");
    let delivered = store
        .list_deliveries(DeliveryFilter {
            state: Some(DeliveryState::Delivered),
            destination: None,
            before: None,
            limit: ALL,
        })
        .await
        .expect("list");
    assert_eq!(
        delivered.len(),
        1,
        "the attempt was recorded once it could be"
    );
}

/// A writer whose turn it is waits for the batch in flight before it starts its own, but not
/// for a batch waiting on another session's lock: the other keys commit meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_waiting_on_a_lock_does_not_hold_back_the_next() {
    let Some(base) = support::base_url("the held-back batch test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let mut opts = db.options();
    opts.writers = 2;
    opts.lock_timeout = PATIENT;
    let store = db.store_with(opts).await;
    let mut raw = hold_claim(&db, "evt_x", BODY, 777).await;
    let blocked = spawn_ingest(&store, "evt_x");
    lock_wait(&db).await;

    free_keys_commit(&store, "the batch waiting on a lock").await;
    assert!(!blocked.is_finished(), "the held key's ingest still waits");

    raw.execute("ROLLBACK").await.expect("ROLLBACK");
    let outcome = blocked.await.expect("ingest task").expect("ingest");
    assert!(matches!(outcome.claims[0].1, Claim::New { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_waits_for_an_uncommitted_claim_of_its_key_then_is_a_duplicate_after_commit() {
    let Some(base) = support::base_url("the uncommitted-claim commit test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = store_waiting(&db, PATIENT).await;
    let mut raw = hold_claim(&db, "evt_x", BODY, 777).await;

    let started = Instant::now();
    let task = spawn_ingest(&store, "evt_x");
    let wait = lock_wait(&db).await;
    assert_eq!(
        wait,
        ("Lock".to_owned(), "transactionid".to_owned()),
        "the ingest waits on the other transaction, as PostgreSQL's index uniqueness checks do"
    );
    assert!(
        !task.is_finished(),
        "the ingest answers only after the other session ends"
    );
    raw.execute("COMMIT").await.expect("COMMIT");

    let outcome = task.await.expect("ingest task").expect("ingest");
    eprintln!(
        "figure: waited {:?} for the other session's commit",
        started.elapsed()
    );
    assert_eq!(
        outcome.claims[0].1,
        Claim::Duplicate {
            first_request: RequestId(777),
            first_seen: T0
        }
    );
    assert_eq!(outcome.verdict(), Verdict::Duplicate);
    assert!(
        deliveries_with_key(&store, &idempotency_key(SOURCE, "evt_x"))
            .await
            .is_empty(),
        "a duplicate queues nothing"
    );
    // A lone ingest runs first as one statement without a transaction, which must not commit
    // a request whose key it could not read: that run fails and commits nothing, and the
    // batch runs again in a transaction that settles the copy.
    let recorded: Vec<(i64, String)> = sqlx::query_as("SELECT id, verdict FROM requests")
        .fetch_all(&mut db.raw().await)
        .await
        .expect("requests");
    assert_eq!(
        recorded,
        vec![(outcome.request_id.0, "duplicate".to_owned())],
        "the copy is recorded once, with its verdict"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_waits_for_an_uncommitted_claim_of_its_key_then_claims_it_after_rollback() {
    let Some(base) = support::base_url("the uncommitted-claim rollback test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = store_waiting(&db, PATIENT).await;
    let mut raw = hold_claim(&db, "evt_x", BODY, 777).await;

    let task = spawn_ingest(&store, "evt_x");
    assert_eq!(lock_wait(&db).await.0, "Lock");
    assert!(!task.is_finished());
    raw.execute("ROLLBACK").await.expect("ROLLBACK");

    let outcome = task.await.expect("ingest task").expect("ingest");
    let Claim::New { deliveries } = &outcome.claims[0].1 else {
        panic!(
            "after a rollback the key is ours, got {:?}",
            outcome.claims[0].1
        );
    };
    assert_eq!(deliveries.len(), DESTINATIONS.len());
    let rows = deliveries_with_key(&store, &idempotency_key(SOURCE, "evt_x")).await;
    assert!(rows.iter().all(|d| d.request_id == outcome.request_id));
    assert_eq!(store.stats().await.expect("stats").claims, 1);
}

/// A batch runs without savepoints first; a job failing on its own (here a trigger refuses its
/// claim, as a full disk or a broken constraint would) sends the batch round again with a
/// savepoint per job: that job fails alone and every other job of its group commit commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_fails_on_its_own_fails_alone_and_its_batch_commits() {
    let Some(base) = support::base_url("the lone-failure test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = one_patient_writer(&db).await;
    db.raw()
        .await
        .execute(
            "CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.key = 'evt_poison' THEN RAISE EXCEPTION 'this key is refused'; END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_poison BEFORE INSERT ON claims
                 FOR EACH ROW EXECUTE FUNCTION refuse_poison();",
        )
        .await
        .expect("the refusing trigger");

    // The one writer waits on another session's uncommitted claim, so the ingests sent
    // meanwhile queue up for the same next batch.
    let mut raw = hold_claim(&db, "evt_x", BODY, 777).await;
    let blocked = spawn_ingest(&store, "evt_x");
    assert_eq!(lock_wait(&db).await.0, "Lock");
    let neighbours: Vec<_> = (0..8)
        .map(|i| spawn_ingest(&store, &format!("evt_n{i}")))
        .collect();
    let poisoned = spawn_ingest(&store, "evt_poison");
    // Time for the tasks to queue their jobs (were one late, it would only run in a batch of
    // its own: the assertions hold either way).
    tokio::time::sleep(Duration::from_millis(300)).await;
    raw.execute("ROLLBACK").await.expect("ROLLBACK");

    let blocked = blocked
        .await
        .expect("ingest task")
        .expect("the blocked ingest");
    let mut committed = vec![blocked.request_id];
    for neighbour in neighbours {
        let outcome = neighbour
            .await
            .expect("ingest task")
            .expect("a neighbour of the refused job commits");
        assert!(matches!(outcome.claims[0].1, Claim::New { .. }));
        committed.push(outcome.request_id);
    }
    let refused = poisoned.await.expect("ingest task");
    assert!(
        matches!(&refused, Err(StoreError::Unavailable(msg)) if msg.contains("refused")),
        "{refused:?}"
    );
    let mut history: Vec<_> = all_requests(&store).await.iter().map(|r| r.id).collect();
    history.sort();
    committed.sort();
    assert_eq!(history, committed, "nothing of the refused job stays");
    assert_eq!(store.stats().await.expect("stats").claims, 9);
}

/// One-event ingests queued together run as one statement (requests, claims, keys and
/// deliveries for the whole batch). Copies of one key inside that batch still make one claim:
/// the other copies answer duplicate (same body) or conflict (another body) pointing at it, and
/// history lists every copy under the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_inside_one_batched_statement_make_one_claim_each_key() {
    copies_inside_one_batch_make_one_claim_each_key(0).await;
}

/// The same with bodies large enough that the batch is split over several statements (at most
/// 256 KiB of bodies each): copies of one key in different statements of one transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_across_the_statements_of_one_batch_make_one_claim_each_key() {
    copies_inside_one_batch_make_one_claim_each_key(100 << 10).await;
}

async fn copies_inside_one_batch_make_one_claim_each_key(pad: usize) {
    let Some(base) = support::base_url("the batched-ingest test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = one_patient_writer(&db).await;
    let padded = |v: u8| {
        let mut body = format!("{{\"id\":\"evt\",\"v\":{v},\"pad\":\"").into_bytes();
        body.resize(body.len() + pad, b'p');
        body.extend_from_slice(b"\"}");
        body
    };
    let (one, two) = (padded(1), padded(2));
    // An expired claim of another request: the copy in the batch replaces it.
    db.raw()
        .await
        .execute(
            "INSERT INTO claims (source, key, body_sha256, request_id, claimed_at, expires_at)
             VALUES ('stripe', 'evt_old', '\\x00', 555, 0, 1)",
        )
        .await
        .expect("an expired claim");

    let held = HeldWriter::hold(&db, &store).await;
    let send = |key: &str, body: &[u8]| {
        let store = store.clone();
        let ingest = ingest(SOURCE, &[key], body, at(2));
        tokio::spawn(async move { store.ingest(ingest).await })
    };
    let same = [
        send("evt_a", &one),
        send("evt_a", &one),
        send("evt_a", &one),
    ];
    let other = [send("evt_b", &one), send("evt_b", &two)];
    let mut fresh: Vec<_> = (0..4).map(|i| send(&format!("evt_f{i}"), &one)).collect();
    fresh.push(send("evt_old", &one));
    held.release().await;

    let mut outcomes = Vec::new();
    for task in same.into_iter().chain(other) {
        outcomes.push(task.await.expect("ingest task").expect("ingest"));
    }
    let (a, b) = outcomes.split_at(3);
    for (copies, key) in [(a, "evt_a"), (b, "evt_b")] {
        let first: Vec<_> = copies
            .iter()
            .filter(|o| matches!(o.claims[0].1, Claim::New { .. }))
            .collect();
        assert_eq!(first.len(), 1, "{key}: one claim");
        let first = first[0];
        for copy in copies.iter().filter(|o| o.request_id != first.request_id) {
            match &copy.claims[0].1 {
                Claim::Duplicate { first_request, .. } | Claim::Conflict { first_request, .. } => {
                    assert_eq!(*first_request, first.request_id, "{key}")
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        let mut listed: Vec<_> = requests_with_key(&store, key)
            .await
            .iter()
            .map(|r| r.id)
            .collect();
        listed.sort();
        let mut want: Vec<_> = copies.iter().map(|o| o.request_id).collect();
        want.sort();
        assert_eq!(listed, want, "{key}: every copy is listed under its key");
        let queued = deliveries_with_key(&store, &idempotency_key(SOURCE, key)).await;
        assert_eq!(queued.len(), DESTINATIONS.len(), "{key}: queued once");
    }
    for task in fresh {
        let outcome = task.await.expect("ingest task").expect("ingest");
        let Claim::New { deliveries } = &outcome.claims[0].1 else {
            panic!("a fresh key is new: {:?}", outcome.claims[0].1);
        };
        assert_eq!(deliveries.len(), DESTINATIONS.len());
        let key = outcome.claims[0].0.as_str();
        let mut stored: Vec<DeliveryId> =
            deliveries_with_key(&store, &idempotency_key(SOURCE, key))
                .await
                .iter()
                .map(|d| d.id)
                .collect();
        stored.sort();
        assert_eq!(
            &stored, deliveries,
            "the answer names the stored deliveries"
        );
    }
    // evt_x, evt_a, evt_b, the four fresh keys and evt_old.
    assert_eq!(store.stats().await.expect("stats").claims, 8);
    let verdicts: BTreeMap<String, usize> =
        all_requests(&store)
            .await
            .iter()
            .fold(BTreeMap::new(), |mut m, r| {
                *m.entry(r.verdict.as_str().to_owned()).or_default() += 1;
                m
            });
    assert_eq!(verdicts.get("accepted"), Some(&8), "{verdicts:?}");
    assert_eq!(
        verdicts.get("duplicate").copied().unwrap_or(0)
            + verdicts.get("conflict").copied().unwrap_or(0),
        3,
        "{verdicts:?}"
    );
}

/// A batch's copies of keys already claimed read each claim by its key, on the primary key:
/// never by a scan of the claims table. Sessions here may not plan a nested loop, so a plain
/// join of the batch's keys with `claims` would hash (and scan) the whole table; the lookup
/// per key has no other plan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_copies_are_read_by_key_never_by_scanning_the_claims() {
    let Some(base) = support::base_url("the held-copies plan test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    db.raw()
        .await
        .execute(format!("ALTER DATABASE {} SET enable_nestloop = off", db.name).as_str())
        .await
        .expect("ALTER DATABASE");
    let store = one_patient_writer(&db).await;
    let keys: Vec<String> = (0..5).map(|i| format!("evt_k{i}")).collect();
    for key in &keys {
        store
            .ingest(ingest(SOURCE, &[key], BODY, at(1)))
            .await
            .expect("first copy");
    }
    let scans_before = counted(&db, keys.len() as i64).await;

    let held = HeldWriter::hold(&db, &store).await;
    let copies: Vec<_> = keys
        .iter()
        .map(|key| {
            let store = store.clone();
            let ingest = ingest(SOURCE, &[key], BODY, at(2));
            tokio::spawn(async move { store.ingest(ingest).await })
        })
        .collect();
    held.release().await;
    for copy in copies {
        let outcome = copy.await.expect("ingest task").expect("ingest");
        assert!(
            matches!(outcome.claims[0].1, Claim::Duplicate { .. }),
            "{:?}",
            outcome.claims[0].1
        );
    }

    let after = counted(&db, keys.len() as i64 * 2 + 1).await;
    assert_eq!(
        after.claims_seq_scans, scans_before.claims_seq_scans,
        "the held claims were read by scanning the table"
    );
}

/// Attempts find their deliveries by id and their next leases by the ready index, never by
/// scanning the deliveries table, even where a scan looks cheapest to the planner: as it did
/// on a new database, where a connection's plan made while the table was a few pages went on
/// scanning it as it grew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_never_scan_the_deliveries_table() {
    let Some(base) = support::base_url("the attempts plan test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    db.raw()
        .await
        .execute(
            format!(
                "ALTER DATABASE {name} SET seq_page_cost = 0;
                 ALTER DATABASE {name} SET random_page_cost = 1000",
                name = db.name
            )
            .as_str(),
        )
        .await
        .expect("ALTER DATABASE");
    let store = db.store().await;
    let mut ids = Vec::new();
    for i in 0..5 {
        let outcome = store
            .ingest(ingest(SOURCE, &[&format!("evt_k{i}")], BODY, at(1)))
            .await
            .expect("ingest");
        match &outcome.claims[0].1 {
            Claim::New { deliveries } => ids.extend(deliveries.iter().copied()),
            other => panic!("{other:?}"),
        }
    }
    let before = counted(&db, 5).await;

    // Together (one batched statement) and one at a time.
    let together: Vec<_> = ids[..6]
        .iter()
        .map(|id| {
            let store = store.clone();
            let result = attempt(*id, at(2), Some(200), None, AttemptNext::Delivered);
            tokio::spawn(async move {
                store
                    .record_attempt_and_lease(result, at(2), Duration::from_secs(60))
                    .await
            })
        })
        .collect();
    for task in together {
        task.await.expect("attempt task").expect("attempt");
    }
    for id in &ids[6..] {
        let result = attempt(*id, at(3), Some(200), None, AttemptNext::Delivered);
        store
            .record_attempt_and_lease(result, at(3), Duration::from_secs(60))
            .await
            .expect("attempt");
    }

    let after = counted_when(&db, |c| c.attempts_inserted >= ids.len() as i64).await;
    assert_eq!(
        after.deliveries_seq_scans, before.deliveries_seq_scans,
        "an attempt scanned the deliveries table"
    );
}

/// The history's filters by state and by verdict, the outbox counts and an instance's release
/// of its leases each have an index to read. Schema 5 took the index of leased rows and the
/// index of every row by state off the deliveries (every lease and every attempt wrote an
/// entry into each), and the accepted requests out of the index by verdict. Sessions here may
/// plan a sequential scan only where nothing else serves, so a scan counted here is a query
/// left without an index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_filters_counts_and_releases_read_an_index() {
    let Some(base) = support::base_url("the history plan test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    db.raw()
        .await
        .execute(format!("ALTER DATABASE {} SET enable_seqscan = off", db.name).as_str())
        .await
        .expect("ALTER DATABASE");
    let store = db.store().await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let outcome = store
            .ingest(ingest(SOURCE, &[&format!("evt_k{i}")], BODY, at(1)))
            .await
            .expect("ingest");
        ids.extend(new_deliveries(&outcome));
    }
    store
        .record_rejection(rejection(SOURCE, BODY, at(1), "invalid_signature", 401))
        .await
        .expect("record_rejection");
    let leased = store
        .lease_due(WORKER, at(2), Duration::from_secs(60), 100)
        .await
        .expect("lease_due");
    assert_eq!(leased.len(), ids.len());
    let delivered = attempt(ids[0], at(3), Some(200), None, AttemptNext::Delivered);
    let dead = attempt(
        ids[1],
        at(3),
        Some(500),
        Some("HTTP 500"),
        AttemptNext::DeadLetter,
    );
    for result in [delivered, dead] {
        store.record_attempt(result).await.expect("record_attempt");
    }
    let before = counted_when(&db, |c| {
        c.requests_inserted >= 4 && c.attempts_inserted >= 2
    })
    .await;

    let listed = |state| DeliveryFilter {
        state: Some(state),
        limit: 10,
        ..DeliveryFilter::default()
    };
    let pending: Vec<DeliveryId> = ids[2..].to_vec();
    for (state, expected) in [
        (DeliveryState::Dead, vec![ids[1]]),
        (DeliveryState::Delivered, vec![ids[0]]),
        (
            DeliveryState::Pending,
            pending.iter().rev().copied().collect(),
        ),
    ] {
        let found = store.list_deliveries(listed(state)).await.expect("list");
        let found: Vec<DeliveryId> = found.iter().map(|d| d.id).collect();
        assert_eq!(found, expected, "{state:?}, newest first");
    }
    let counts = store.outbox_counts().await.expect("outbox_counts");
    assert_eq!((counts.pending, counts.dead), (pending.len() as u64, 1));
    store
        .release_leases(WORKER, at(3))
        .await
        .expect("release_leases");
    let taken = store
        .lease_due("worker-b", at(3), Duration::from_secs(60), 10)
        .await
        .expect("lease_due");
    assert_eq!(
        taken.iter().map(|d| d.id).collect::<Vec<_>>(),
        pending,
        "the released leases are due at once"
    );
    for (verdict, n) in [(Verdict::Rejected, 1), (Verdict::Accepted, 3)] {
        let filter = RequestFilter {
            verdict: Some(verdict),
            limit: 10,
            ..RequestFilter::default()
        };
        let found = store.list_requests(filter).await.expect("list_requests");
        assert_eq!(found.len(), n, "{verdict:?}");
    }

    // At least one index scan each: three lists, two counts, the release and the lease
    // of deliveries; two lists of requests (and the lease's read of its request).
    let after = counted_when(&db, |c| {
        c.deliveries_index_scans >= before.deliveries_index_scans + 7
            && c.requests_index_scans >= before.requests_index_scans + 3
    })
    .await;
    assert_eq!(
        (after.deliveries_seq_scans, after.requests_seq_scans),
        (before.deliveries_seq_scans, before.requests_seq_scans),
        "a query scanned the deliveries or the requests table"
    );
}

/// Copies whose keys are held by a claim the batched statement can see (an earlier copy in
/// the same statement, or a live claim committed before it) get their verdicts in that
/// statement: duplicate or conflict as the bodies say, and no request row written twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_the_batched_statement_can_see_are_settled_in_it() {
    let Some(base) = support::base_url("the in-statement verdicts test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = one_patient_writer(&db).await;
    let (one, two) = (&br#"{"v":1}"#[..], &br#"{"v":2}"#[..]);
    let committed = store
        .ingest(ingest(SOURCE, &["evt_c"], one, at(1)))
        .await
        .expect("the first copy");

    let held = HeldWriter::hold(&db, &store).await;
    let send = |key: &str, body: &[u8]| {
        let store = store.clone();
        let ingest = ingest(SOURCE, &[key], body, at(2));
        tokio::spawn(async move { store.ingest(ingest).await })
    };
    let copies = [
        send("evt_c", one),
        send("evt_c", two),
        send("evt_n", one),
        send("evt_n", one),
        send("evt_n", two),
    ];
    held.release().await;
    let mut outcomes = Vec::new();
    for task in copies {
        outcomes.push(task.await.expect("ingest task").expect("ingest"));
    }

    let kinds: Vec<(&str, Option<RequestId>)> = outcomes
        .iter()
        .map(|o| match &o.claims[0].1 {
            Claim::New { .. } => ("new", None),
            Claim::Duplicate { first_request, .. } => ("duplicate", Some(*first_request)),
            Claim::Conflict { first_request, .. } => ("conflict", Some(*first_request)),
        })
        .collect();
    let c = Some(committed.request_id);
    assert_eq!(&kinds[..2], &[("duplicate", c), ("conflict", c)]);
    // The copies of evt_n reach the writer in any order: whichever comes first claims the
    // key, and each other copy is a duplicate of it when their bodies match.
    let bodies = [one, one, two];
    let claimers: Vec<usize> = (0..3).filter(|&i| kinds[2 + i].0 == "new").collect();
    assert_eq!(claimers.len(), 1, "one copy of evt_n claims it: {kinds:?}");
    let first = claimers[0];
    let first_n = Some(outcomes[2 + first].request_id);
    for i in (0..3).filter(|&i| i != first) {
        let want = if bodies[i] == bodies[first] {
            "duplicate"
        } else {
            "conflict"
        };
        assert_eq!(
            kinds[2 + i],
            (want, first_n),
            "copy {i} of evt_n: {kinds:?}"
        );
    }
    let history = all_requests(&store).await;
    for outcome in &outcomes {
        let stored = history
            .iter()
            .find(|r| r.id == outcome.request_id)
            .expect("recorded");
        assert_eq!(stored.verdict, outcome.verdict(), "{:?}", outcome.claims);
    }
    // evt_c, evt_x (the held writer's) and the five copies.
    let after = counted(&db, 7).await;
    assert_eq!(
        after.requests_updated, 0,
        "a verdict was written after its request"
    );
}

/// What PostgreSQL's statistics say about this database's tables.
#[derive(Debug)]
struct TableCounts {
    claims_seq_scans: i64,
    requests_inserted: i64,
    deliveries_seq_scans: i64,
    attempts_inserted: i64,
    requests_updated: i64,
    requests_seq_scans: i64,
    deliveries_index_scans: i64,
    requests_index_scans: i64,
}

/// The counts once `requests` inserted PostgreSQL's statistics hold: the writer's sessions
/// report their counts when idle, all tables at once, so any scan of the claims made with
/// those requests is counted too.
async fn counted(db: &TestDb, requests: i64) -> TableCounts {
    counted_when(db, |c| c.requests_inserted >= requests).await
}

/// The counts once `arrived` holds of them (the sessions whose work it names have reported).
async fn counted_when(db: &TestDb, arrived: impl Fn(&TableCounts) -> bool) -> TableCounts {
    let deadline = Instant::now() + BOUND;
    loop {
        let now = table_counts(db).await;
        if arrived(&now) {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "the writer's statistics never arrived: {now:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn table_counts(db: &TestDb) -> TableCounts {
    let row = sqlx::query(
        "SELECT COALESCE((SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'claims'), 0),
                COALESCE((SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'requests'), 0),
                COALESCE((SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'deliveries'), 0),
                COALESCE((SELECT n_tup_ins FROM pg_stat_user_tables WHERE relname = 'attempts'), 0),
                COALESCE((SELECT n_tup_upd FROM pg_stat_user_tables WHERE relname = 'requests'), 0),
                COALESCE((SELECT seq_scan FROM pg_stat_user_tables WHERE relname = 'requests'), 0),
                COALESCE((SELECT idx_scan FROM pg_stat_user_tables WHERE relname = 'deliveries'), 0),
                COALESCE((SELECT idx_scan FROM pg_stat_user_tables WHERE relname = 'requests'), 0)",
    )
    .fetch_one(&mut db.raw().await)
    .await
    .expect("pg_stat_user_tables");
    TableCounts {
        claims_seq_scans: row.get(0),
        requests_inserted: row.get(1),
        deliveries_seq_scans: row.get(2),
        attempts_inserted: row.get(3),
        requests_updated: row.get(4),
        requests_seq_scans: row.get(5),
        deliveries_index_scans: row.get(6),
        requests_index_scans: row.get(7),
    }
}

/// Delivery attempts queued together run as one statement: each is recorded and moves its
/// delivery, and each worker gets a next lease of its own — never a delivery just attempted,
/// never one another worker got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_in_one_batched_statement_each_record_and_lease_a_row_of_their_own() {
    let Some(base) = support::base_url("the batched-attempt test") else {
        return;
    };
    let (db, store) = patient_writer_with_events(&base, "evt_d", 8).await;
    let lease = Duration::from_secs(60);
    let mut first = Vec::new();
    for w in 0..4 {
        let leased = store
            .lease_due(&format!("w{w}"), at(2), lease, 1)
            .await
            .expect("lease");
        first.push(leased.into_iter().next().expect("a due delivery"));
    }

    let results: Vec<_> = first
        .iter()
        .enumerate()
        .map(|(w, leased)| attempt_by(&format!("w{w}"), leased.id, at(3), AttemptNext::Delivered))
        .collect();
    let held = HeldWriter::hold(&db, &store).await;
    let tasks: Vec<_> = results
        .iter()
        .map(|result| {
            let (store, result) = (store.clone(), result.clone());
            tokio::spawn(async move { store.record_attempt_and_lease(result, at(4), lease).await })
        })
        .collect();
    held.release().await;

    let attempted: BTreeSet<DeliveryId> = first.iter().map(|d| d.id).collect();
    let mut next = BTreeSet::new();
    for task in tasks {
        let leased = task
            .await
            .expect("attempt task")
            .expect("attempt")
            .expect("a next lease: 12 deliveries are still due");
        assert!(
            !attempted.contains(&leased.id),
            "{:?} was just attempted",
            leased.id
        );
        assert!(next.insert(leased.id), "{:?} leased twice", leased.id);
    }
    let deliveries = all_deliveries(&store).await;
    for d in &deliveries {
        if attempted.contains(&d.id) {
            assert_eq!(d.state, DeliveryState::Delivered, "{:?}", d.id);
            assert_eq!((d.attempts, d.history.len()), (1, 1), "{:?}", d.id);
        } else {
            assert_eq!(d.state, DeliveryState::Pending, "{:?}", d.id);
        }
    }
    // The next leases are held: another worker is leased everything else and none of them.
    let rest = store
        .lease_due("w9", at(5), lease, 100)
        .await
        .expect("lease the rest");
    let rest: BTreeSet<DeliveryId> = rest.iter().map(|d| d.id).collect();
    assert!(rest.is_disjoint(&next), "{rest:?} / {next:?}");
    assert_eq!(rest.len(), deliveries.len() - attempted.len() - next.len());

    // The same four records again, in one statement (workers that did not hear whether their
    // first committed): their tokens make them repeats, which count and move nothing; the
    // lease half still runs (what it finds due is the held writer's own ingest, evt_y).
    let held = HeldWriter::hold_on(&db, &store, "evt_y").await;
    let repeats: Vec<_> = results
        .iter()
        .map(|result| {
            let (store, result) = (store.clone(), result.clone());
            tokio::spawn(async move { store.record_attempt_and_lease(result, at(6), lease).await })
        })
        .collect();
    held.release().await;
    let mut again = BTreeSet::new();
    for task in repeats {
        if let Some(leased) = task.await.expect("repeat task").expect("a repeat") {
            assert!(
                !attempted.contains(&leased.id),
                "{:?} was attempted",
                leased.id
            );
            assert!(again.insert(leased.id), "{:?} leased twice", leased.id);
        }
    }
    for d in all_deliveries(&store).await {
        if attempted.contains(&d.id) {
            assert_eq!(d.state, DeliveryState::Delivered, "{:?}", d.id);
            assert_eq!(
                (d.attempts, d.history.len()),
                (1, 1),
                "{:?}: a repeat is not counted",
                d.id
            );
        }
    }
}

/// Waits ([`AttemptNext::Wait`]) in a batch of attempts, in the batched statement and, when
/// two attempts of the batch name one delivery, one by one: each puts its row off and
/// releases its lease without counting or recording an attempt, and its error is ignored; a
/// stale owner's wait moves nothing; the attempts beside them are counted and recorded; and
/// every worker's next lease is a row of its own, never one just waited on or attempted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_in_a_batch_of_attempts_count_nothing_and_lease_other_rows() {
    let Some(base) = support::base_url("the batched-wait test") else {
        return;
    };
    let (db, store) = patient_writer_with_events(&base, "evt_w", 12).await;
    let lease = Duration::from_secs(60);
    let mut touched = BTreeSet::new();
    // Phase 0: distinct deliveries, one statement. Phase 1: a stale owner's wait on a row of
    // the batch too, so its attempts run one statement each.
    for phase in 0..2 {
        let mut owned = Vec::new();
        for w in 0..4 {
            let owner = format!("w{w}");
            let leased = store
                .lease_due(&owner, at(2), lease, 1)
                .await
                .expect("lease");
            owned.push((owner, leased[0].id));
        }
        let mut results: Vec<AttemptResult> = owned
            .iter()
            .enumerate()
            .map(|(k, (owner, id))| {
                let next = if k % 2 == 0 {
                    AttemptNext::Wait(at(3600))
                } else {
                    AttemptNext::Delivered
                };
                attempt_by(owner, *id, at(3), next)
            })
            .collect();
        // A row another worker holds throughout.
        let held = store
            .lease_due("holder", at(2), lease, 1)
            .await
            .expect("lease")[0]
            .id;
        if phase == 1 {
            // On a row its owner delivers in the same batch (before or after: it stays
            // delivered), and on the held row.
            for id in [owned[1].1, held] {
                results.push(attempt_by("stale", id, at(3), AttemptNext::Wait(at(7200))));
            }
        }
        touched.extend(owned.iter().map(|(_, id)| *id));
        touched.insert(held);

        // The attempts lane's one writer waits on a row lock meanwhile: the results queue
        // up for its next batch (a late one runs in a batch of its own; the assertions hold
        // either way).
        let blocker = store
            .lease_due("blocker", at(2), lease, 1)
            .await
            .expect("lease")[0]
            .id;
        touched.insert(blocker);
        let mut raw = db.raw().await;
        raw.execute("BEGIN").await.expect("BEGIN");
        sqlx::query("SELECT 1 FROM deliveries WHERE id = $1 FOR UPDATE")
            .bind(blocker.0)
            .execute(&mut raw)
            .await
            .expect("locking the blocker's row");
        let blocked = {
            let store = store.clone();
            let result = attempt_by("blocker", blocker, at(3), AttemptNext::Delivered);
            tokio::spawn(async move { store.record_attempt(result).await })
        };
        assert_eq!(lock_wait(&db).await.0, "Lock");
        let tasks: Vec<_> = results
            .iter()
            .cloned()
            .map(|result| {
                let store = store.clone();
                tokio::spawn(
                    async move { store.record_attempt_and_lease(result, at(4), lease).await },
                )
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        raw.execute("ROLLBACK").await.expect("ROLLBACK");
        blocked
            .await
            .expect("blocker task")
            .expect("blocker attempt");

        let mut next = BTreeSet::new();
        for (result, task) in results.iter().zip(tasks) {
            let leased = task.await.expect("attempt task").expect("attempt");
            let leased = match (result.owner.as_str(), leased) {
                // The stale owner's lease may find nothing left: the others took it.
                ("stale", None) => continue,
                (_, leased) => leased.expect("a next lease: rows are still due"),
            };
            assert!(
                !touched.contains(&leased.id),
                "{:?} was just waited on or attempted",
                leased.id
            );
            assert_eq!(leased.attempts, 0);
            assert!(next.insert(leased.id), "{:?} leased twice", leased.id);
        }
        for (k, (_, id)) in owned.iter().enumerate() {
            let row = delivery(&store, *id).await;
            if k % 2 == 0 {
                assert_eq!(row.state, DeliveryState::Pending, "{id:?}");
                assert_eq!(row.next_attempt_at, Some(at(3600)), "{id:?}");
                assert_eq!((row.attempts, row.history.len()), (0, 0), "{id:?}");
                assert_eq!(row.last_error, None, "a wait's error is ignored");
            } else {
                assert_eq!(row.state, DeliveryState::Delivered, "{id:?}");
                assert_eq!((row.attempts, row.history.len()), (1, 1), "{id:?}");
            }
        }
        let still_held = delivery(&store, held).await;
        assert_eq!(
            still_held.next_attempt_at,
            Some(at(1)),
            "a stale wait moves nothing"
        );
        assert!(still_held.history.is_empty());
        // The next leases are released again: the rows are for the next phase.
        for w in 0..4 {
            store
                .release_leases(&format!("w{w}"), at(4))
                .await
                .expect("release_leases");
        }
        store
            .release_leases("stale", at(4))
            .await
            .expect("release_leases");
    }
    // The waited rows' leases were released: due at the wait's end, and not before.
    let waited: BTreeSet<DeliveryId> = all_deliveries(&store)
        .await
        .iter()
        .filter(|d| d.next_attempt_at == Some(at(3600)))
        .map(|d| d.id)
        .collect();
    assert_eq!(waited.len(), 4);
    let late = store
        .lease_due("w9", at(3600), lease, 100)
        .await
        .expect("lease the rest");
    let late: BTreeSet<DeliveryId> = late.iter().map(|d| d.id).collect();
    assert!(waited.is_subset(&late), "{waited:?} / {late:?}");
}

/// Waking a destination reads the ready index (never the whole table), moves only that
/// destination's rows due later, and `NOTIFY`s the workers when it moved any (not when it
/// moved none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waking_a_destination_reads_an_index_and_notifies_the_workers() {
    let Some(base) = support::base_url("the destination wake test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    db.raw()
        .await
        .execute(format!("ALTER DATABASE {} SET enable_seqscan = off", db.name).as_str())
        .await
        .expect("ALTER DATABASE");
    let store = db.store().await;
    let mut observer = PgListener::connect(&db.url).await.expect("observer");
    observer
        .listen(hooklatch_store_postgres::WORK_CHANNEL)
        .await
        .expect("observer listens");
    let mut ids = Vec::new();
    for i in 0..3 {
        let outcome = store
            .ingest(ingest(SOURCE, &[&format!("evt_k{i}")], BODY, at(1)))
            .await
            .expect("ingest");
        ids.extend(new_deliveries(&outcome));
    }
    let leased = store
        .lease_due(WORKER, at(2), Duration::from_secs(60), 100)
        .await
        .expect("lease_due");
    assert_eq!(leased.len(), ids.len());
    for d in &leased {
        let result = attempt(d.id, at(3), None, None, AttemptNext::Wait(at(3600)));
        store.record_attempt(result).await.expect("record_attempt");
    }
    let before = counted_when(&db, |c| c.requests_inserted >= 3).await;

    let mut raw = db.raw().await;
    let marker = format!(
        "NOTIFY {}, 'marker'",
        hooklatch_store_postgres::WORK_CHANNEL
    );
    let [app, audit] = DESTINATIONS;
    assert_eq!(
        store
            .wake_destination("nobody", at(4))
            .await
            .expect("wake_destination"),
        0
    );
    raw.execute(marker.as_str()).await.expect("marker");
    assert_eq!(
        next_notification(&mut observer).await,
        "marker",
        "no NOTIFY when nothing moved"
    );
    assert_eq!(
        store
            .wake_destination(app, at(4))
            .await
            .expect("wake_destination"),
        3
    );
    assert_eq!(
        next_notification(&mut observer).await,
        "",
        "the workers are woken"
    );
    let due: BTreeSet<DeliveryId> = store
        .lease_due("worker-b", at(4), Duration::from_secs(60), 100)
        .await
        .expect("lease_due")
        .iter()
        .map(|d| d.id)
        .collect();
    let woken: BTreeSet<DeliveryId> = all_deliveries(&store)
        .await
        .iter()
        .filter(|d| d.destination == app)
        .map(|d| d.id)
        .collect();
    assert_eq!(due, woken, "{app}'s rows, not {audit}'s");

    let after = counted_when(&db, |c| {
        c.deliveries_index_scans >= before.deliveries_index_scans + 3
    })
    .await;
    assert_eq!(
        after.deliveries_seq_scans, before.deliveries_seq_scans,
        "a query scanned the deliveries table"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_waiting_past_the_wait_limit_is_unavailable_never_ok() {
    let Some(base) = support::base_url("the wait-limit test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = store_waiting(&db, Duration::from_millis(300)).await;
    let mut raw = hold_claim(&db, "evt_x", BODY, 777).await;

    // A neighbour that may share the blocked job's group commit.
    let neighbour = spawn_ingest(&store, "evt_other");
    let res = spawn_ingest(&store, "evt_x").await.expect("ingest task");
    match &res {
        Err(StoreError::Unavailable(msg)) => {
            assert!(msg.contains("lock_timeout"), "{msg}");
        }
        other => panic!("past the wait limit an ingest must be Unavailable, got {other:?}"),
    }
    let neighbour = neighbour
        .await
        .expect("ingest task")
        .expect("the neighbour commits");
    assert!(matches!(neighbour.claims[0].1, Claim::New { .. }));
    // Nothing of the refused ingest stays: only the neighbour is in history.
    let history = all_requests(&store).await;
    assert_eq!(
        history.iter().map(|r| r.id).collect::<Vec<_>>(),
        [neighbour.request_id]
    );

    raw.execute("ROLLBACK").await.expect("ROLLBACK");
    let retried = spawn_ingest(&store, "evt_x")
        .await
        .expect("ingest task")
        .expect("the provider's retry succeeds");
    assert!(matches!(retried.claims[0].1, Claim::New { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_durability_is_refused_naming_the_setting_unless_allowed() {
    let Some(base) = support::base_url("the durability test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let off = with_param(&db.url, "options=-c%20synchronous_commit%3Doff");

    let refused = PostgresStore::connect(&PgOptions::from_url(&off).expect("url")).await;
    match refused {
        Err(StoreError::Unavailable(msg)) => {
            assert!(msg.contains("synchronous_commit=off"), "{msg}");
        }
        other => panic!("synchronous_commit=off must be refused, got {other:?}"),
    }

    let mut allowed =
        PgOptions::from_url(&with_param(&off, "allow_unsafe_durability=true")).expect("url");
    allowed.pool_size = 4;
    allowed.writers = 2;
    let store = PostgresStore::connect(&allowed)
        .await
        .expect("allowed explicitly, it opens");
    assert_eq!(store.unsafe_durability(), ["synchronous_commit=off"]);
    let outcome = store
        .ingest(ingest(SOURCE, &["evt_1"], BODY, T0))
        .await
        .expect("ingest");
    assert_eq!(outcome.verdict(), Verdict::Accepted);

    let mut local = PgOptions::from_url(&with_param(
        &db.url,
        "options=-c%20synchronous_commit%3Dlocal",
    ))
    .expect("url");
    local.pool_size = 4;
    local.writers = 2;
    let store = PostgresStore::connect(&local)
        .await
        .expect("local waits for the local flush: safe");
    assert!(store.unsafe_durability().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_copies_on_two_instances_make_exactly_one_claim() {
    let Some(base) = support::base_url("the two-instance claim test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    copies_on_two_instances_make_one_claim(&db, 20).await;
}

/// `rounds` events, each as 32 copies at once on two instances: one claim each, the other
/// copies duplicates of it, never an error.
async fn copies_on_two_instances_make_one_claim(db: &TestDb, rounds: usize) {
    const COPIES: usize = 32;
    // Two stores, two pools: as two gateway processes behind a load balancer.
    let instances = [db.store().await, db.store().await];
    let started = Instant::now();
    for round in 0..rounds {
        let key = format!("evt_{round}");
        let barrier = Arc::new(Barrier::new(COPIES));
        let mut tasks = JoinSet::new();
        for copy in 0..COPIES {
            let store = instances[copy % 2].clone();
            let barrier = barrier.clone();
            let ingest = ingest(SOURCE, &[key.as_str()], BODY, at(round as i64));
            tasks.spawn(async move {
                barrier.wait().await;
                store.ingest(ingest).await
            });
        }
        let mut outcomes = Vec::new();
        while let Some(joined) = tasks.join_next().await {
            outcomes.push(joined.expect("ingest task").expect("never a 503 or 500"));
        }
        let winners: Vec<_> = outcomes
            .iter()
            .filter(|o| matches!(o.claims[0].1, Claim::New { .. }))
            .map(|o| o.request_id)
            .collect();
        assert_eq!(winners.len(), 1, "{key}: exactly one copy claims");
        for outcome in &outcomes {
            if outcome.request_id != winners[0] {
                assert_eq!(
                    outcome.claims[0].1,
                    Claim::Duplicate {
                        first_request: winners[0],
                        first_seen: at(round as i64)
                    },
                    "{key}"
                );
            }
        }
        let rows = deliveries_with_key(&instances[0], &idempotency_key(SOURCE, &key)).await;
        assert_eq!(
            rows.len(),
            DESTINATIONS.len(),
            "{key}: one delivery per destination"
        );
    }
    eprintln!(
        "figure: {} copies of {rounds} events on two instances in {:.1?}",
        rounds * COPIES,
        started.elapsed()
    );
    let stats = instances[1].stats().await.expect("stats");
    assert_eq!(stats.claims, rounds as u64);
    assert_eq!(all_requests(&instances[1]).await.len(), rounds * COPIES);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_batched_deliveries_on_two_instances_never_fail_and_claim_each_key_once() {
    let Some(base) = support::base_url("the overlapping-keys test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    overlapping_keys_on_two_instances_claim_each_once(&db).await;
}

/// Requests carrying two keys each, in both orders, from two instances at once: the lock
/// orders that deadlock unless keys are claimed in one order (and the deadlocks that remain
/// are retried inside). Never an error; each key claimed once.
async fn overlapping_keys_on_two_instances_claim_each_once(db: &TestDb) {
    const KEYS: usize = 8;
    const REQUESTS: usize = 64;
    let instances = [db.store().await, db.store().await];
    let barrier = Arc::new(Barrier::new(REQUESTS));
    let mut tasks = JoinSet::new();
    for i in 0..REQUESTS {
        let (a, b) = (i % KEYS, (i + 1) % KEYS);
        let keys = if i % 2 == 0 {
            [format!("evt_{a}"), format!("evt_{b}")]
        } else {
            [format!("evt_{b}"), format!("evt_{a}")]
        };
        let store = instances[i % 2].clone();
        let barrier = barrier.clone();
        tasks.spawn(async move {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let ingest = ingest(SOURCE, &keys, BODY, T0);
            barrier.wait().await;
            store.ingest(ingest).await
        });
    }
    let mut new_per_key: BTreeMap<String, usize> = BTreeMap::new();
    while let Some(joined) = tasks.join_next().await {
        let outcome = joined.expect("ingest task").expect("never an error");
        for (key, claim) in &outcome.claims {
            if matches!(claim, Claim::New { .. }) {
                *new_per_key.entry(key.as_str().to_owned()).or_default() += 1;
            }
        }
    }
    assert_eq!(new_per_key.len(), KEYS, "every key claimed");
    assert!(
        new_per_key.values().all(|n| *n == 1),
        "each key claimed once: {new_per_key:?}"
    );
    assert_eq!(
        all_deliveries(&instances[0]).await.len(),
        KEYS * DESTINATIONS.len()
    );
}

/// T2: a database (or a role) whose default isolation is `REPEATABLE READ` or `SERIALIZABLE`,
/// where concurrent claims and leases would fail with SQLSTATE 40001 instead of waiting. The
/// store's sessions run `READ COMMITTED` whatever the default (`PgOptions`): on such a
/// database, with the default checked in a plain session, the two-instance storms above never
/// fail and claim each key once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stricter_default_isolation_changes_nothing() {
    let Some(base) = support::base_url("the default-isolation test") else {
        return;
    };
    for isolation in ["repeatable read", "serializable"] {
        let db = strict_db(&base, isolation).await;
        copies_on_two_instances_make_one_claim(&db, 5).await;
        db.destroy().await;
        let db = strict_db(&base, isolation).await;
        overlapping_keys_on_two_instances_claim_each_once(&db).await;
        db.destroy().await;
    }
}

/// A fresh database whose sessions default to `isolation`, checked in a plain session.
async fn strict_db(base: &str, isolation: &str) -> TestDb {
    let db = TestDb::create(base).await;
    let mut raw = db.raw().await;
    raw.execute(
        format!(
            "ALTER DATABASE {} SET default_transaction_isolation TO '{isolation}'",
            db.name
        )
        .as_str(),
    )
    .await
    .expect("setting the database's default isolation");
    drop(raw);
    let shown: String = sqlx::query_scalar("SHOW default_transaction_isolation")
        .fetch_one(&mut db.raw().await)
        .await
        .expect("SHOW");
    assert_eq!(
        shown, isolation,
        "a plain session gets the stricter default"
    );
    db
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instances_ingest_wakes_a_listening_worker() {
    let Some(base) = support::base_url("the LISTEN/NOTIFY test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let listening = db.store().await;
    let (notify, listener) = started_listener(&listening).await;
    // The other instance notifies once it has seen the listener (it looks once a second).
    let _other = ingest_elsewhere(&db).await;
    woken(&notify, "the other instance's ingest wakes the worker").await;

    drop(listening);
    tokio::time::timeout(BOUND, listener)
        .await
        .expect("the listener stops when its store is dropped")
        .expect("the listener task ends cleanly");
}

/// `store`'s listener for work, once it listens (it wakes its worker as it starts), and what
/// it wakes.
async fn started_listener(store: &PostgresStore) -> (Arc<Notify>, tokio::task::JoinHandle<()>) {
    let notify = Arc::new(Notify::new());
    let listener = store.listen_for_work(notify.clone());
    woken(&notify, "the listener wakes the worker once it listens").await;
    (notify, listener)
}

/// Waits until `notify` wakes its worker, for at most [`BOUND`].
async fn woken(notify: &Notify, what: &str) {
    if tokio::time::timeout(BOUND, notify.notified())
        .await
        .is_err()
    {
        panic!("timed out waiting until {what}");
    }
}

/// An ingest by another instance of the store, once that instance has seen a listener on
/// the database (it looks once a second): its batch then notifies, after its reply. The
/// instance is returned, to be kept until the notification has arrived.
async fn ingest_elsewhere(db: &TestDb) -> PostgresStore {
    let other = db.store().await;
    ingest_once_it_sees_a_listener(&other, "evt_1").await;
    other
}

/// Ingests `key` once `store` has seen another instance's listener, so that its batch
/// notifies.
async fn ingest_once_it_sees_a_listener(store: &PostgresStore, key: &str) {
    eventually(
        || store.notifies_others(),
        "the store sees another instance's listener",
    )
    .await;
    store
        .ingest(ingest(SOURCE, &[key], BODY, T0))
        .await
        .expect("ingest");
}

/// Polls `cond` every 50 ms until it holds, for at most [`BOUND`].
async fn eventually(cond: impl Fn() -> bool, what: &str) {
    let deadline = Instant::now() + BOUND;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The next notification on `observer`'s channel, with its payload.
async fn next_notification(observer: &mut PgListener) -> String {
    tokio::time::timeout(BOUND, observer.recv())
        .await
        .expect("a notification in time")
        .expect("the observer's connection holds")
        .payload()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ingests_notify_only_while_another_instance_listens() {
    let Some(base) = support::base_url("the NOTIFY-only-for-others test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    // One writer task: it sends a batch's NOTIFY before it takes the next batch.
    let store = one_patient_writer(&db).await;
    let _own = started_listener(&store).await;
    // Something listening on the channel that is not an instance: it sees every NOTIFY.
    let mut observer = PgListener::connect(&db.url).await.expect("observer");
    observer
        .listen(hooklatch_store_postgres::WORK_CHANNEL)
        .await
        .expect("observer listens");

    // Alone with its own listener, the store does not notify: the first notification the
    // observer sees is the marker sent after the ingests. The second ingest is answered only
    // after the one writer sent whatever the first batch would have notified.
    eventually(
        || !store.notifies_others(),
        "the store sees only its own listener",
    )
    .await;
    for key in ["evt_alone", "evt_alone_2"] {
        store
            .ingest(ingest(SOURCE, &[key], BODY, T0))
            .await
            .expect("ingest");
    }
    let mut raw = db.raw().await;
    raw.execute(
        format!(
            "NOTIFY {}, 'marker'",
            hooklatch_store_postgres::WORK_CHANNEL
        )
        .as_str(),
    )
    .await
    .expect("marker");
    assert_eq!(
        next_notification(&mut observer).await,
        "marker",
        "no NOTIFY for an ingest while no other instance listens"
    );

    // Another instance starts listening: once the store has seen it, ingests notify.
    let other = db.store().await;
    let (other_notify, _other_listener) = started_listener(&other).await;
    ingest_once_it_sees_a_listener(&store, "evt_shared").await;
    assert_eq!(
        next_notification(&mut observer).await,
        "",
        "the ingest notifies while another instance listens"
    );
    woken(&other_notify, "the other instance's worker is woken").await;

    // It stops again once the other instance is gone.
    drop(other);
    eventually(
        || !store.notifies_others(),
        "the store sees the other listener go",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_whose_connection_is_killed_reconnects_and_keeps_waking() {
    let Some(base) = support::base_url("the listener reconnect test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = db.store().await;
    let (notify, _listener) = started_listener(&store).await;

    let mut raw = db.raw().await;
    let killed: i64 = sqlx::query(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = $1 AND query LIKE 'LISTEN%'",
    )
    .bind(&db.name)
    .fetch_one(&mut raw)
    .await
    .expect("terminating the listener's session")
    .get(0);
    assert_eq!(killed, 1, "one listening session");
    woken(
        &notify,
        "woken after reconnecting, as notifications may have been missed",
    )
    .await;

    // Another instance's ingest (an instance's own wake its worker in memory, not by NOTIFY),
    // once that instance sees the reconnected listener under the same name.
    let _other = ingest_elsewhere(&db).await;
    woken(&notify, "the reconnected listener still wakes the worker").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_connection_dies_fails_as_unavailable_and_the_store_recovers() {
    let Some(base) = support::base_url("the dead-connection test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = store_waiting(&db, PATIENT).await;
    let mut raw = hold_claim(&db, "evt_x", BODY, 777).await;
    let task = spawn_ingest(&store, "evt_x");
    lock_wait(&db).await;

    // Kill the store's session while its batch waits for the claim.
    let mut observer = db.raw().await;
    let killed: i64 = sqlx::query(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = $1 AND wait_event_type = 'Lock'",
    )
    .bind(&db.name)
    .fetch_one(&mut observer)
    .await
    .expect("terminating the waiting session")
    .get(0);
    assert_eq!(killed, 1);
    match task.await.expect("ingest task") {
        Err(StoreError::Unavailable(_)) => {}
        other => panic!("a batch on a dead connection must be Unavailable, got {other:?}"),
    }

    raw.execute("ROLLBACK").await.expect("ROLLBACK");
    let retried = spawn_ingest(&store, "evt_x")
        .await
        .expect("ingest task")
        .expect("the store recovers on a new connection");
    assert!(matches!(retried.claims[0].1, Claim::New { .. }));
    assert_eq!(
        all_requests(&store).await.len(),
        1,
        "nothing of the killed batch"
    );
}

/// An attempt by `owner` on `id` at `started_at`.
fn attempt_by(
    owner: &str,
    id: DeliveryId,
    started_at: hooklatch_core::Timestamp,
    next: AttemptNext,
) -> AttemptResult {
    AttemptResult {
        delivery: id,
        owner: owner.to_owned(),
        started_at,
        latency: Duration::from_millis(10),
        status: Some(if next == AttemptNext::Delivered {
            200
        } else {
            500
        }),
        error: (next != AttemptNext::Delivered).then(|| "HTTP 500".to_owned()),
        next,
        lease_until: None,
        token: hooklatch_core::store::AttemptToken::random(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_instances_leases_are_taken_over_by_another_after_expiry() {
    let Some(base) = support::base_url("the lease takeover test") else {
        return;
    };
    const LEASE: Duration = Duration::from_secs(30);
    let db = TestDb::create(&base).await;
    let (a, b) = (db.store().await, db.store().await);
    let mut rows = BTreeSet::new();
    for i in 0..10 {
        let key = format!("evt_{i}");
        let outcome = a
            .ingest(ingest(SOURCE, &[key.as_str()], BODY, T0))
            .await
            .expect("ingest");
        rows.extend(new_deliveries(&outcome));
    }
    let leased_by_a: BTreeSet<_> = a
        .lease_due("instance-a", T0, LEASE, 100)
        .await
        .expect("lease_due")
        .iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(leased_by_a, rows);
    // Instance a dies here, holding every lease.
    assert!(b
        .lease_due("instance-b", at(29), LEASE, 100)
        .await
        .expect("lease_due")
        .is_empty());
    let taken: BTreeSet<_> = b
        .lease_due("instance-b", at(31), LEASE, 100)
        .await
        .expect("lease_due")
        .iter()
        .map(|d| d.id)
        .collect();
    assert_eq!(taken, rows, "every expired lease is taken over");

    let first = *rows.first().expect("rows");
    b.record_attempt(attempt_by(
        "instance-b",
        first,
        at(31),
        AttemptNext::Delivered,
    ))
    .await
    .expect("record_attempt");
    // Instance a comes back late and reports a failure: kept in history, moves nothing.
    a.record_attempt(attempt_by(
        "instance-a",
        first,
        at(32),
        AttemptNext::RetryAt(at(100)),
    ))
    .await
    .expect("record_attempt");
    let row = delivery(&a, first).await;
    assert_eq!(row.state, DeliveryState::Delivered);
    assert_eq!(row.history.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_leasers_on_several_instances_lease_every_row_exactly_once() {
    let Some(base) = support::base_url("the SKIP LOCKED test") else {
        return;
    };
    const EVENTS: usize = 100;
    const LEASERS: usize = 4;
    const LEASE: Duration = Duration::from_secs(30);
    let db = TestDb::create(&base).await;
    let instances: Vec<PostgresStore> = vec![db.store().await, db.store().await];
    let mut rows = BTreeSet::new();
    let mut tasks = JoinSet::new();
    for i in 0..EVENTS {
        let store = instances[i % 2].clone();
        let key = format!("evt_{i}");
        tasks.spawn(async move {
            store
                .ingest(ingest(SOURCE, &[key.as_str()], BODY, T0))
                .await
        });
    }
    while let Some(joined) = tasks.join_next().await {
        rows.extend(new_deliveries(&joined.expect("task").expect("ingest")));
    }
    assert_eq!(rows.len(), EVENTS * DESTINATIONS.len());

    let started = Instant::now();
    let barrier = Arc::new(Barrier::new(LEASERS));
    let mut leasers = JoinSet::new();
    for n in 0..LEASERS {
        let store = instances[n % 2].clone();
        let barrier = barrier.clone();
        leasers.spawn(async move {
            let owner = format!("worker-{n}");
            let mut mine = Vec::new();
            barrier.wait().await;
            loop {
                let batch = store
                    .lease_due(&owner, at(1), LEASE, 7)
                    .await
                    .expect("lease_due");
                if batch.is_empty() {
                    return mine;
                }
                mine.extend(batch.iter().map(|d| d.id));
            }
        });
    }
    let mut leased: BTreeMap<DeliveryId, usize> = BTreeMap::new();
    let mut per_leaser = Vec::new();
    while let Some(joined) = leasers.join_next().await {
        let mine = joined.expect("leaser task");
        per_leaser.push(mine.len());
        for id in mine {
            *leased.entry(id).or_default() += 1;
        }
    }
    eprintln!(
        "figure: {LEASERS} leasers took {} rows in {:.1?}, {per_leaser:?} each",
        rows.len(),
        started.elapsed()
    );
    let twice: Vec<_> = leased.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "rows leased twice: {twice:?}");
    assert_eq!(
        leased.keys().copied().collect::<BTreeSet<_>>(),
        rows,
        "every row leased"
    );
    assert!(instances[0]
        .lease_due("late", at(1), LEASE, 1000)
        .await
        .expect("lease_due")
        .is_empty());
    assert_eq!(
        instances[1]
            .lease_due("late", at(40), LEASE, 1000)
            .await
            .expect("lease_due")
            .len(),
        rows.len(),
        "after expiry every row is taken over"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_starting_at_once_migrate_once_and_a_newer_schema_is_refused() {
    let Some(base) = support::base_url("the migration test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let mut starts = JoinSet::new();
    for _ in 0..4 {
        let opts = db.options();
        starts.spawn(async move { PostgresStore::connect(&opts).await });
    }
    let mut stores = Vec::new();
    while let Some(joined) = starts.join_next().await {
        stores.push(joined.expect("start task").expect("every instance starts"));
    }
    stores[0]
        .migrate()
        .await
        .expect("migrating again finds nothing to do");
    let mut raw = db.raw().await;
    let versions: Vec<i64> =
        sqlx::query("SELECT version FROM hooklatch_schema_version ORDER BY version")
            .fetch_all(&mut raw)
            .await
            .expect("schema versions")
            .iter()
            .map(|r| r.get(0))
            .collect();
    assert_eq!(versions, (1..=schema::VERSION).collect::<Vec<_>>());

    sqlx::query("INSERT INTO hooklatch_schema_version (version) VALUES ($1)")
        .bind(schema::VERSION + 1)
        .execute(&mut raw)
        .await
        .expect("pretending a newer hooklatch migrated");
    match PostgresStore::connect(&db.options()).await {
        Err(StoreError::Unavailable(msg)) => assert!(msg.contains("newer"), "{msg}"),
        other => panic!("a newer schema must be refused, got {other:?}"),
    }
}

/// Bodies are stored compressed with lz4 where the server has it (the default method, pglz,
/// costs several times the CPU), and read back byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_are_stored_with_lz4_where_the_server_has_it() {
    let Some(base) = support::base_url("the compression test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = db.store().await;
    let mut body = br#"{"id":"evt_big","type":"invoice.paid","lines":["#.to_vec();
    while body.len() < 16 << 10 {
        body.extend_from_slice(br#"{"amount":5000,"currency":"usd"},"#);
    }
    body.extend_from_slice(br#"{}]}"#);
    let outcome = store
        .ingest(ingest(SOURCE, &["evt_big"], &body, at(1)))
        .await
        .expect("ingest");

    let mut raw = db.raw().await;
    let has_lz4: bool = sqlx::query_scalar(
        "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name = 'default_toast_compression'",
    )
    .fetch_optional(&mut raw)
    .await
    .expect("pg_settings")
    .unwrap_or(false);
    // `pg_column_compression` is as old as lz4 in PostgreSQL (14).
    if has_lz4 {
        let (compression, stored): (Option<String>, i32) = sqlx::query_as(
            "SELECT pg_column_compression(body), pg_column_size(body) FROM requests
             WHERE id = $1",
        )
        .bind(outcome.request_id.0)
        .fetch_one(&mut raw)
        .await
        .expect("the stored body");
        assert_eq!(compression.as_deref(), Some("lz4"));
        assert!(
            (stored as usize) < body.len() / 4,
            "{stored} bytes stored for {}",
            body.len()
        );
    }
    let read = store
        .get_request(outcome.request_id)
        .await
        .expect("request")
        .expect("stored");
    assert_eq!(read.body[..], body[..], "read back byte for byte");
}

/// A request refused on a path segment holding NUL (percent-decoded `%00`) is still recorded:
/// PostgreSQL text cannot hold NUL, and failing the write would answer 503 to a request
/// already judged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_with_nul_in_its_source_is_still_recorded() {
    let Some(base) = support::base_url("the NUL test") else {
        return;
    };
    let db = TestDb::create(&base).await;
    let store = db.store().await;
    let rejected = hooklatch_testkit::conformance::fixture::rejection(
        "bad\0source",
        BODY,
        T0,
        "unknown_source",
        404,
    );
    let id = store
        .record_rejection(rejected)
        .await
        .expect("recorded, not 503");
    let detail = store
        .get_request(id)
        .await
        .expect("get_request")
        .expect("in history");
    assert_eq!(detail.summary.source, "bad\u{fffd}source");
    assert_eq!(&detail.body[..], BODY, "the body is kept byte-exact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_concurrent_ingests_all_commit() {
    let Some(base) = support::base_url("the burst test") else {
        return;
    };
    const N: usize = 400;
    let db = TestDb::create(&base).await;
    let store = db.store().await;
    let started = Instant::now();
    let mut tasks = JoinSet::new();
    for i in 0..N {
        let store = store.clone();
        let key = format!("evt_{i}");
        tasks.spawn(async move {
            store
                .ingest(ingest(SOURCE, &[key.as_str()], BODY, T0))
                .await
        });
    }
    while let Some(joined) = tasks.join_next().await {
        let outcome = joined.expect("task").expect("ingest");
        assert_eq!(outcome.verdict(), Verdict::Accepted);
    }
    let elapsed = started.elapsed();
    eprintln!(
        "figure: {N} concurrent ingests on one instance (2 writers) in {elapsed:.1?} ({:.0}/s)",
        N as f64 / elapsed.as_secs_f64()
    );
    assert_eq!(store.stats().await.expect("stats").claims, N as u64);
    assert_eq!(all_deliveries(&store).await.len(), N * DESTINATIONS.len());
}
