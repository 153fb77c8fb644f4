//! Conformance cases for [`Store::ingest`]: claiming keys, telling duplicates from conflicts,
//! queuing one delivery per destination, concurrency, cancellation and claim retention.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Waker};
use std::time::Duration;

use hooklatch_core::store::NewEvent;
use hooklatch_core::store::{DeliveryState, StoreStats, Verdict};
use hooklatch_core::{Claim, EventKey, KeyDecision, RequestId, Store, Timestamp};
use tokio::sync::Barrier;
use tokio::task::JoinSet;

use crate::conformance::fixture::{
    all_deliveries, all_requests, at, deliveries_with_key, idempotency_key, ingest, ingest_ok,
    new_deliveries, sha256, DESTINATIONS, T0,
};

const SOURCE: &str = "stripe";
const BODY: &[u8] = br#"{"id":"evt_1","type":"invoice.paid"}"#;
const OTHER_BODY: &[u8] = br#"{"id":"evt_1","type":"invoice.paid","amount":2}"#;

/// The first ingest of a key claims it and queues one pending delivery per destination,
/// carrying `{source}:{key}` as its `Idempotency-Key`; history records it as accepted.
pub async fn first_ingest_claims_the_key_and_queues_one_delivery_per_destination<S: Store>(
    store: S,
) {
    store.ping().await.expect("a fresh store answers ping");
    let outcome = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    assert_eq!(outcome.verdict(), Verdict::Accepted);
    assert_eq!(outcome.claims.len(), 1);
    let (key, claim) = &outcome.claims[0];
    assert_eq!(key.as_str(), "evt_1");
    let Claim::New { deliveries } = claim else {
        panic!("the first ingest of a key must be New, got {claim:?}");
    };
    assert_eq!(deliveries.len(), DESTINATIONS.len());

    let rows = all_deliveries(&store).await;
    let mut row_ids: Vec<_> = rows.iter().map(|d| d.id).collect();
    let mut claimed_ids = deliveries.clone();
    row_ids.sort();
    claimed_ids.sort();
    assert_eq!(
        row_ids, claimed_ids,
        "list_deliveries shows what ingest queued"
    );
    let mut destinations: Vec<_> = rows.iter().map(|d| d.destination.as_str()).collect();
    destinations.sort();
    assert_eq!(destinations, DESTINATIONS, "one delivery per destination");
    for row in &rows {
        assert_eq!(row.request_id, outcome.request_id);
        assert_eq!(row.idempotency_key, idempotency_key(SOURCE, "evt_1"));
        assert_eq!(row.state, DeliveryState::Pending);
        assert_eq!(row.attempts, 0);
        assert_eq!(
            row.next_attempt_at,
            Some(T0),
            "a new delivery is due at once"
        );
        assert_eq!(row.last_error, None);
        assert!(row.history.is_empty());
    }

    let history = all_requests(&store).await;
    assert_eq!(history.len(), 1);
    let summary = &history[0];
    assert_eq!(summary.id, outcome.request_id);
    assert_eq!(summary.verdict, Verdict::Accepted);
    assert_eq!(summary.source, SOURCE);
    assert_eq!(summary.keys, ["evt_1"]);
    assert_eq!(summary.received_at, T0);
    assert_eq!(summary.status, 200);
    assert_eq!(summary.reason, None);
    assert_eq!(summary.body_len, BODY.len() as u64);

    let stats = store.stats().await.expect("stats");
    assert_eq!(
        stats,
        StoreStats {
            pending: 2,
            dead: 0,
            claims: 1
        }
    );
}

/// The same key with the same body again is a duplicate of the first request: recorded in
/// history as such, nothing queued.
pub async fn the_same_body_again_is_a_duplicate_and_queues_nothing<S: Store>(store: S) {
    let first = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    let second = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, at(10))).await;
    assert_ne!(
        second.request_id, first.request_id,
        "every request gets its own id"
    );
    assert_eq!(
        second.claims[0].1,
        Claim::Duplicate {
            first_request: first.request_id,
            first_seen: T0
        }
    );
    assert_eq!(second.verdict(), Verdict::Duplicate);

    let rows = all_deliveries(&store).await;
    assert_eq!(rows.len(), DESTINATIONS.len(), "a duplicate queues nothing");
    assert!(rows.iter().all(|d| d.request_id == first.request_id));

    let history: Vec<_> = all_requests(&store)
        .await
        .iter()
        .map(|r| (r.id, r.verdict))
        .collect();
    assert_eq!(
        history,
        [
            (second.request_id, Verdict::Duplicate),
            (first.request_id, Verdict::Accepted)
        ]
    );
    let detail = store
        .get_request(second.request_id)
        .await
        .expect("get_request")
        .expect("the duplicate is in history");
    assert!(detail.deliveries.is_empty());
    assert_eq!(detail.summary.keys, ["evt_1"]);
    assert_eq!(store.stats().await.expect("stats").claims, 1);
}

/// The same key with a different body is a conflict: the first body's hash is reported, the
/// request is kept in history as a conflict, nothing is queued, and the claim still belongs to
/// the first body.
pub async fn another_body_under_the_same_key_is_a_conflict_and_queues_nothing<S: Store>(store: S) {
    let first = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    let second = ingest_ok(&store, ingest(SOURCE, &["evt_1"], OTHER_BODY, at(10))).await;
    assert_eq!(
        second.claims[0].1,
        Claim::Conflict {
            first_request: first.request_id,
            first_body_sha256: sha256(BODY)
        }
    );
    assert_eq!(second.verdict(), Verdict::Conflict);
    assert_eq!(all_deliveries(&store).await.len(), DESTINATIONS.len());

    let detail = store
        .get_request(second.request_id)
        .await
        .expect("get_request")
        .expect("the conflict is in history");
    assert_eq!(detail.summary.verdict, Verdict::Conflict);
    assert_eq!(&detail.body[..], OTHER_BODY, "the conflicting body is kept");
    assert!(detail.deliveries.is_empty());

    let third = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, at(20))).await;
    assert_eq!(
        third.claims[0].1,
        Claim::Duplicate {
            first_request: first.request_id,
            first_seen: T0
        },
        "a conflict does not take the claim over"
    );
}

/// An event with a content hash of its own (an item of a batch, `NewEvent::content_sha256`)
/// is told duplicate or conflict by that hash, not the body's: the same item regrouped with
/// others into another body is a duplicate, another item under its key a conflict. Each
/// event of one request is judged by its own.
pub async fn an_event_with_its_own_content_hash_is_judged_by_it<S: Store>(store: S) {
    // A request of `body` at `at`, carrying the items `(key, content)`.
    let send = |body: &'static [u8], at: Timestamp, items: &[(&str, &[u8])]| {
        let mut request = ingest(SOURCE, &[], body, at);
        request.events = items
            .iter()
            .map(|(key, content)| {
                NewEvent::new(EventKey::parse(key).expect("a key"), None)
                    .with_content(Some(sha256(content)))
            })
            .collect();
        ingest_ok(&store, request)
    };
    let first = send(b"[A, B]", T0, &[("wamid.a", b"A"), ("wamid.b", b"B")]).await;
    assert_eq!(first.verdict(), Verdict::Accepted);
    let duplicate_of_first = Claim::Duplicate {
        first_request: first.request_id,
        first_seen: T0,
    };

    // B again beside a new C, in a body of their own: B a duplicate, C new.
    let second = send(b"[B, C]", at(10), &[("wamid.b", b"B"), ("wamid.c", b"C")]).await;
    assert_eq!(second.claims[0].1, duplicate_of_first);
    assert!(
        matches!(second.claims[1].1, Claim::New { .. }),
        "{second:?}"
    );

    // B alone (a request of one event, which a store may batch with others): a duplicate.
    let fourth = send(b"[B] again", at(15), &[("wamid.b", b"B")]).await;
    assert_eq!(fourth.claims[0].1, duplicate_of_first);
    // History says so too.
    for (outcome, verdict) in [(&second, Verdict::Accepted), (&fourth, Verdict::Duplicate)] {
        let detail = store
            .get_request(outcome.request_id)
            .await
            .expect("get_request")
            .expect("in history");
        assert_eq!(detail.summary.verdict, verdict);
    }

    // A under its key with other content: a conflict, reported with A's hash.
    let third = send(b"[A']", at(20), &[("wamid.a", b"A'")]).await;
    assert_eq!(
        third.claims[0].1,
        Claim::Conflict {
            first_request: first.request_id,
            first_body_sha256: sha256(b"A")
        }
    );
}

/// Keys are scoped by source: the same key on another source is a claim of its own.
pub async fn the_same_key_on_another_source_is_a_new_claim<S: Store>(store: S) {
    ingest_ok(&store, ingest("stripe", &["evt_1"], BODY, T0)).await;
    let other = ingest_ok(&store, ingest("github", &["evt_1"], BODY, at(1))).await;
    assert!(
        matches!(other.claims[0].1, Claim::New { .. }),
        "got {:?}",
        other.claims[0].1
    );
    let rows = deliveries_with_key(&store, &idempotency_key("github", "evt_1")).await;
    assert_eq!(rows.len(), DESTINATIONS.len());
    assert!(rows.iter().all(|d| d.request_id == other.request_id));
    assert_eq!(all_deliveries(&store).await.len(), 2 * DESTINATIONS.len());
    assert_eq!(store.stats().await.expect("stats").claims, 2);

    let again = ingest_ok(&store, ingest("github", &["evt_1"], BODY, at(2))).await;
    assert_eq!(
        again.claims[0].1,
        Claim::Duplicate {
            first_request: other.request_id,
            first_seen: at(1)
        }
    );
}

/// What one event's claim should come out as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    New,
    Duplicate,
    Conflict,
}

/// A request carrying several events is claimed event by event: it is accepted when any event
/// is new, and only the new events are queued.
#[rustfmt::skip]
pub async fn a_request_is_accepted_when_any_of_its_events_is_new<S: Store>(store: S) {
    use Expect::{Conflict, Duplicate, New};
    const X: &[u8] = b"batch x";
    const Y: &[u8] = b"batch y";
    let store = &store;
    // Each check runs on its own source, so their claims cannot meet.
    check_claims(store, "s1", &[(&["a"], X)], (&["a", "b"], X), &[Duplicate, New], Verdict::Accepted).await;
    check_claims(store, "s2", &[(&["a"], X)], (&["a", "b"], Y), &[Conflict, New], Verdict::Accepted).await;
    check_claims(store, "s3", &[(&["a", "b"], X)], (&["a", "b"], X), &[Duplicate, Duplicate], Verdict::Duplicate).await;
    check_claims(store, "s4", &[(&["a"], X), (&["b"], Y)], (&["a", "b"], Y), &[Conflict, Duplicate], Verdict::Conflict).await;
    check_claims(store, "s5", &[], (&["a", "b"], X), &[New, New], Verdict::Accepted).await;
}

/// Ingests `earlier` on `source`, then `last`, and checks the last request's claims (in event
/// order), its verdict (returned and in history) and that it queued exactly its new events.
async fn check_claims<S: Store>(
    store: &S,
    source: &str,
    earlier: &[(&[&str], &[u8])],
    last: (&[&str], &[u8]),
    expect: &[Expect],
    verdict: Verdict,
) {
    let mut claimed_by: Vec<(&str, RequestId, &[u8])> = Vec::new();
    for (i, (keys, body)) in earlier.iter().enumerate() {
        let outcome = ingest_ok(store, ingest(source, keys, body, at(i as i64))).await;
        for key in *keys {
            claimed_by.push((key, outcome.request_id, body));
        }
    }
    let (keys, body) = last;
    let outcome = ingest_ok(store, ingest(source, keys, body, at(100))).await;
    let got: Vec<_> = outcome
        .claims
        .iter()
        .map(|(key, claim)| {
            let kind = match claim {
                Claim::New { .. } => Expect::New,
                Claim::Duplicate { .. } => Expect::Duplicate,
                Claim::Conflict { .. } => Expect::Conflict,
            };
            (key.as_str(), kind)
        })
        .collect();
    let want: Vec<_> = keys.iter().copied().zip(expect.iter().copied()).collect();
    assert_eq!(got, want, "claims on {source}");
    for (key, claim) in &outcome.claims {
        let first = claimed_by.iter().find(|(k, ..)| *k == key.as_str());
        match (claim, first) {
            (Claim::Duplicate { first_request, .. }, Some((_, id, _))) => {
                assert_eq!(first_request, id, "{source}: duplicate of {key}");
            }
            (
                Claim::Conflict {
                    first_request,
                    first_body_sha256,
                },
                Some((_, id, first_body)),
            ) => {
                assert_eq!(first_request, id, "{source}: conflict on {key}");
                assert_eq!(*first_body_sha256, sha256(first_body));
            }
            (Claim::New { .. }, None) => {}
            (claim, first) => panic!("{source}: {key} claimed as {claim:?}, earlier {first:?}"),
        }
    }
    assert_eq!(outcome.verdict(), verdict, "verdict on {source}");
    let detail = store
        .get_request(outcome.request_id)
        .await
        .expect("get_request")
        .expect("the request is in history");
    assert_eq!(
        detail.summary.verdict, verdict,
        "verdict in history on {source}"
    );
    assert_eq!(detail.summary.keys, keys);

    let mut queued: Vec<_> = detail
        .deliveries
        .iter()
        .map(|d| (d.idempotency_key.clone(), d.destination.clone()))
        .collect();
    queued.sort();
    let mut want_queued: Vec<_> = keys
        .iter()
        .zip(expect)
        .filter(|(_, e)| **e == Expect::New)
        .flat_map(|(key, _)| {
            DESTINATIONS
                .iter()
                .map(|d| (idempotency_key(source, key), (*d).to_owned()))
        })
        .collect();
    want_queued.sort();
    assert_eq!(queued, want_queued, "deliveries queued on {source}");
    let mut new_ids = new_deliveries(&outcome);
    let mut detail_ids: Vec<_> = detail.deliveries.iter().map(|d| d.id).collect();
    new_ids.sort();
    detail_ids.sort();
    assert_eq!(new_ids, detail_ids);
}

/// Many concurrent deliveries of one event make exactly one claim: one `New`, every other
/// copy a duplicate of it, one delivery per destination.
pub async fn concurrent_ingests_of_one_key_make_exactly_one_claim<S: Store>(store: S) {
    const N: usize = 32;
    let store = Arc::new(store);
    let barrier = Arc::new(Barrier::new(N));
    let mut tasks = JoinSet::new();
    for _ in 0..N {
        let store = store.clone();
        let barrier = barrier.clone();
        tasks.spawn(async move {
            barrier.wait().await;
            store.ingest(ingest(SOURCE, &["evt_race"], BODY, T0)).await
        });
    }
    let mut outcomes = Vec::with_capacity(N);
    while let Some(joined) = tasks.join_next().await {
        outcomes.push(joined.expect("an ingest task panicked").expect("ingest"));
    }
    let winners: Vec<_> = outcomes
        .iter()
        .filter(|o| matches!(o.claims[0].1, Claim::New { .. }))
        .collect();
    assert_eq!(winners.len(), 1, "exactly one copy claims the key");
    let winner = winners[0].request_id;
    for outcome in &outcomes {
        if outcome.request_id != winner {
            assert_eq!(
                outcome.claims[0].1,
                Claim::Duplicate {
                    first_request: winner,
                    first_seen: T0
                }
            );
        }
    }
    let rows = deliveries_with_key(&*store, &idempotency_key(SOURCE, "evt_race")).await;
    assert_eq!(
        rows.len(),
        DESTINATIONS.len(),
        "one delivery per destination"
    );
    assert!(rows.iter().all(|d| d.request_id == winner));
    assert_eq!(store.stats().await.expect("stats").claims, 1);

    let history = all_requests(&*store).await;
    assert_eq!(history.len(), N, "every copy is in history");
    let n_duplicates = history
        .iter()
        .filter(|r| r.verdict == Verdict::Duplicate)
        .count();
    assert_eq!(n_duplicates, N - 1);
}

/// An ingest whose future is dropped (the provider hung up) leaves its claim and its
/// deliveries both stored or neither, whenever it is dropped: never a claim no worker will
/// deliver.
pub async fn a_dropped_ingest_leaves_its_claim_and_deliveries_together_or_not_at_all<S: Store>(
    store: S,
) {
    let store = Arc::new(store);
    let mut keys = Vec::new();

    // Polled once, then dropped.
    {
        let mut fut = pin!(store.ingest(ingest(SOURCE, &["evt_polled"], BODY, T0)));
        let _ = fut.as_mut().poll(&mut Context::from_waker(Waker::noop()));
    }
    keys.push("evt_polled".to_owned());

    // Timed out at once (tokio polls the inner future once first).
    let _ = tokio::time::timeout(
        Duration::ZERO,
        store.ingest(ingest(SOURCE, &["evt_timed_out"], BODY, T0)),
    )
    .await;
    keys.push("evt_timed_out".to_owned());

    // Never polled.
    drop(store.ingest(ingest(SOURCE, &["evt_unpolled"], BODY, T0)));
    keys.push("evt_unpolled".to_owned());

    // Spawned, then aborted after a varying number of scheduler turns.
    for i in 0..16 {
        let key = format!("evt_aborted_{i}");
        let task = tokio::spawn({
            let store = store.clone();
            let ingest = ingest(SOURCE, &[key.as_str()], BODY, T0);
            async move { store.ingest(ingest).await }
        });
        for _ in 0..i % 4 {
            tokio::task::yield_now().await;
        }
        task.abort();
        let _ = task.await;
        keys.push(key);
    }

    for key in &keys {
        check_all_or_nothing(&*store, key).await;
    }
}

/// Ingests `key` again and checks that its claim and deliveries go together.
async fn check_all_or_nothing<S: Store>(store: &S, key: &str) {
    let again = ingest_ok(store, ingest(SOURCE, &[key], BODY, at(1))).await;
    let rows = deliveries_with_key(store, &idempotency_key(SOURCE, key)).await;
    assert_eq!(
        rows.len(),
        DESTINATIONS.len(),
        "{key}: one delivery per destination, whichever request claimed it"
    );
    match &again.claims[0].1 {
        Claim::Duplicate { first_request, .. } => {
            // The dropped ingest committed: its deliveries committed with it.
            assert!(
                rows.iter().all(|d| d.request_id == *first_request),
                "{key}: the claim's deliveries belong to the dropped request"
            );
        }
        Claim::New { deliveries } => {
            // Nothing of the dropped ingest was left behind.
            let mut row_ids: Vec<_> = rows.iter().map(|d| d.id).collect();
            let mut new_ids = deliveries.clone();
            row_ids.sort();
            new_ids.sort();
            assert_eq!(row_ids, new_ids, "{key}: only the new claim's deliveries");
        }
        claim => panic!("{key}: the same body again cannot be {claim:?}"),
    }
}

/// A claim holds for its retention: a copy just before the end is a duplicate, a copy after it
/// (or exactly at it, as purge also counts a claim expired at its end) is new and queued again.
pub async fn a_claim_is_kept_for_its_retention_then_replaced<S: Store>(store: S) {
    const R: i64 = 3600;
    let with_retention = |key: &str, secs: i64| {
        let mut ingest = ingest(SOURCE, &[key], BODY, at(secs));
        ingest.retention = Duration::from_secs(R as u64);
        ingest
    };
    let first = ingest_ok(&store, with_retention("evt_1", 0)).await;
    let before_end = ingest_ok(&store, with_retention("evt_1", R - 1)).await;
    assert_eq!(
        before_end.claims[0].1,
        Claim::Duplicate {
            first_request: first.request_id,
            first_seen: T0
        }
    );
    let after_end = ingest_ok(&store, with_retention("evt_1", R + 1)).await;
    assert!(
        matches!(after_end.claims[0].1, Claim::New { .. }),
        "an expired claim is replaced, got {:?}",
        after_end.claims[0].1
    );
    assert_eq!(after_end.verdict(), Verdict::Accepted);
    let rows = deliveries_with_key(&store, &idempotency_key(SOURCE, "evt_1")).await;
    assert_eq!(rows.len(), 2 * DESTINATIONS.len(), "queued again");
    let mut new_ids = new_deliveries(&after_end);
    new_ids.sort();
    let mut replaced_rows: Vec<_> = rows
        .iter()
        .filter(|d| d.request_id == after_end.request_id)
        .map(|d| d.id)
        .collect();
    replaced_rows.sort();
    assert_eq!(replaced_rows, new_ids);

    let later = ingest_ok(&store, with_retention("evt_1", R + 2)).await;
    assert_eq!(
        later.claims[0].1,
        Claim::Duplicate {
            first_request: after_end.request_id,
            first_seen: at(R + 1)
        },
        "the replacing request holds the claim now"
    );

    ingest_ok(&store, with_retention("evt_2", 0)).await;
    let at_end = ingest_ok(&store, with_retention("evt_2", R)).await;
    assert!(
        matches!(at_end.claims[0].1, Claim::New { .. }),
        "a claim has expired at the end of its retention, got {:?}",
        at_end.claims[0].1
    );
}

/// When an external key store (Redis mode) has already decided, the store follows it: the
/// events it calls new are queued, the others are recorded as it said, and no claim row is
/// written — the same key can still be claimed by the store itself afterwards.
pub async fn an_external_decision_is_followed_and_writes_no_claim<S: Store>(store: S) {
    let earlier = RequestId(4242);
    let mut decided = ingest(SOURCE, &["evt_1", "evt_2", "evt_3"], BODY, T0);
    decided.keys = KeyDecision::Decided(vec![
        Claim::New {
            deliveries: Vec::new(),
        },
        Claim::Duplicate {
            first_request: earlier,
            first_seen: at(-5),
        },
        Claim::Conflict {
            first_request: earlier,
            first_body_sha256: sha256(OTHER_BODY),
        },
    ]);
    let outcome = ingest_ok(&store, decided).await;
    assert_eq!(outcome.verdict(), Verdict::Accepted);
    let Claim::New { deliveries } = &outcome.claims[0].1 else {
        panic!("evt_1 was decided new: {:?}", outcome.claims[0]);
    };
    assert_eq!(
        deliveries.len(),
        DESTINATIONS.len(),
        "the new event is queued"
    );
    assert_eq!(
        outcome.claims[1].1,
        Claim::Duplicate {
            first_request: earlier,
            first_seen: at(-5)
        }
    );
    assert!(
        matches!(outcome.claims[2].1, Claim::Conflict { first_request, .. } if first_request == earlier)
    );
    let rows = all_deliveries(&store).await;
    assert_eq!(
        rows.len(),
        DESTINATIONS.len(),
        "only the new event is queued"
    );
    assert!(rows
        .iter()
        .all(|d| d.idempotency_key == idempotency_key(SOURCE, "evt_1")));
    assert_eq!(
        store.stats().await.expect("stats").claims,
        0,
        "an external decision writes no claim"
    );

    // Decided as duplicates only: recorded as a duplicate, nothing queued.
    let mut again = ingest(SOURCE, &["evt_1"], BODY, at(1));
    again.keys = KeyDecision::Decided(vec![Claim::Duplicate {
        first_request: outcome.request_id,
        first_seen: T0,
    }]);
    let again = ingest_ok(&store, again).await;
    assert_eq!(again.verdict(), Verdict::Duplicate);
    assert_eq!(all_deliveries(&store).await.len(), DESTINATIONS.len());

    // The store's own claim on the same key is still free.
    let own = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, at(2))).await;
    assert_eq!(own.verdict(), Verdict::Accepted);
    assert_eq!(store.stats().await.expect("stats").claims, 1);
}
