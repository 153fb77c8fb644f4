//! Conformance cases for the outbox: leasing due deliveries, lease expiry and release,
//! `next_due`, recording attempts and waits, waking a destination, and redriving the
//! dead-letter.

use std::collections::BTreeSet;
use std::time::Duration;

use hooklatch_core::store::AttemptNext::{self, DeadLetter, Delivered, RetryAt, Wait};
use hooklatch_core::store::{
    DeliveryState, DisabledDestination, Header, IngestLease, LeasedDelivery, Redelivery, Redrive,
    HELD,
};
use hooklatch_core::{DeliveryId, RequestId, Store, Timestamp};

use crate::conformance::fixture::{
    at, attempt, delivery, headers, idempotency_key, ingest, ingest_ok, new_deliveries,
    DESTINATIONS, EVENT_TYPE, T0, WORKER,
};

const SOURCE: &str = "stripe";
/// Not UTF-8 on purpose: bodies are bytes.
const BODY: &[u8] = b"{\"id\":\"evt_1\",\"note\":\"\xff\x00\xfe\"}";
const LEASE: Duration = Duration::from_secs(30);

fn ids(leased: &[LeasedDelivery]) -> BTreeSet<DeliveryId> {
    leased.iter().map(|d| d.id).collect()
}

async fn lease<S: Store>(
    store: &S,
    owner: &str,
    now: Timestamp,
    limit: u32,
) -> Vec<LeasedDelivery> {
    store
        .lease_due(owner, now, LEASE, limit)
        .await
        .expect("lease_due")
}

/// Records an attempt that delivered `id` (a 200).
async fn delivered<S: Store>(store: &S, id: DeliveryId, started_at: Timestamp) {
    let result = attempt(id, started_at, Some(200), None, Delivered);
    store.record_attempt(result).await.expect("record_attempt");
}

/// Records a failed attempt on `id` and what comes next. The status is read from an
/// `HTTP nnn` error, as workers write them; any other error got no response.
async fn failed<S: Store>(
    store: &S,
    id: DeliveryId,
    started_at: Timestamp,
    error: &str,
    next: AttemptNext,
) {
    let status = error
        .strip_prefix("HTTP ")
        .and_then(|code| code.parse().ok());
    let result = attempt(id, started_at, status, Some(error), next);
    store.record_attempt(result).await.expect("record_attempt");
}

/// Ingests one event at `received_at` and returns its deliveries.
async fn one_event<S: Store>(store: &S, key: &str, received_at: Timestamp) -> Vec<DeliveryId> {
    let outcome = ingest_ok(store, ingest(SOURCE, &[key], BODY, received_at)).await;
    new_deliveries(&outcome)
}

/// A leased delivery carries everything needed to send it: its event, destination,
/// `Idempotency-Key`, attempt count, round start, and the request's headers and body
/// byte-exact.
pub async fn lease_due_returns_due_deliveries_with_the_request_byte_exact<S: Store>(store: S) {
    let outcome = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    let leased = lease(&store, "worker-a", T0, 10).await;
    assert_eq!(ids(&leased), new_deliveries(&outcome).into_iter().collect());
    let destinations: BTreeSet<_> = leased.iter().map(|d| d.destination.as_str()).collect();
    assert_eq!(destinations, DESTINATIONS.into_iter().collect());
    for delivery in &leased {
        assert_eq!(delivery.request_id, outcome.request_id);
        assert_eq!(delivery.source, SOURCE);
        assert_eq!(delivery.event_key, "evt_1");
        assert_eq!(delivery.event_type.as_deref(), Some(EVENT_TYPE));
        assert_eq!(
            delivery.idempotency_key.as_str(),
            idempotency_key(SOURCE, "evt_1")
        );
        assert_eq!(delivery.attempts, 0);
        assert_eq!(delivery.round_started_at, T0);
        assert_eq!(
            (delivery.method.as_str(), delivery.path.as_str()),
            ("POST", format!("/in/{SOURCE}?attempt=1").as_str()),
            "the request line as received"
        );
        assert_eq!(delivery.headers, headers(), "headers byte-exact, in order");
        assert_eq!(&delivery.body[..], BODY, "body byte-exact");
    }
}

/// A leased delivery is not leased again, by its owner or anyone else, until its lease
/// expires; then another worker takes it over.
pub async fn a_leased_delivery_is_not_leased_again_until_its_lease_expires<S: Store>(store: S) {
    let rows: BTreeSet<_> = one_event(&store, "evt_1", T0).await.into_iter().collect();
    assert_eq!(ids(&lease(&store, "worker-a", T0, 10).await), rows);
    assert!(lease(&store, "worker-a", at(1), 10).await.is_empty());
    assert!(lease(&store, "worker-b", at(29), 10).await.is_empty());
    let taken_over = lease(&store, "worker-b", at(31), 10).await;
    assert_eq!(ids(&taken_over), rows, "an expired lease is taken over");
    assert!(taken_over.iter().all(|d| d.attempts == 0));
    assert!(
        lease(&store, "worker-a", at(32), 10).await.is_empty(),
        "the new lease holds"
    );
}

/// A delivery is leased from its due time on, not before.
pub async fn deliveries_not_yet_due_are_not_leased<S: Store>(store: S) {
    let rows = one_event(&store, "evt_1", at(10)).await;
    assert!(lease(&store, "worker-a", at(9), 10).await.is_empty());
    assert_eq!(
        lease(&store, "worker-a", at(10), 10).await.len(),
        rows.len()
    );
    failed(&store, rows[0], at(10), "HTTP 500", RetryAt(at(100))).await;
    delivered(&store, rows[1], at(10)).await;
    assert!(lease(&store, "worker-b", at(99), 10).await.is_empty());
    assert_eq!(
        ids(&lease(&store, "worker-b", at(100), 10).await),
        BTreeSet::from([rows[0]])
    );
}

/// `lease_due` takes at most `limit` rows, earliest due first, and never hands one row to two
/// workers.
pub async fn lease_due_takes_at_most_limit_deliveries_earliest_first<S: Store>(store: S) {
    let late = one_event(&store, "evt_late", at(5)).await;
    let early = one_event(&store, "evt_early", at(1)).await;
    let middle = one_event(&store, "evt_middle", at(3)).await;
    assert!(lease(&store, "worker-a", at(10), 0).await.is_empty());
    let first = lease(&store, "worker-a", at(10), 4).await;
    assert_eq!(
        ids(&first),
        early.iter().chain(&middle).copied().collect(),
        "earliest due first"
    );
    let second = lease(&store, "worker-b", at(10), 4).await;
    assert_eq!(ids(&second), late.iter().copied().collect());
    assert!(lease(&store, "worker-c", at(10), 4).await.is_empty());
}

/// Released leases are leasable again at once; releasing another owner's leases changes
/// nothing.
pub async fn released_leases_can_be_leased_again_at_once<S: Store>(store: S) {
    let rows: BTreeSet<_> = one_event(&store, "evt_1", T0).await.into_iter().collect();
    assert_eq!(ids(&lease(&store, "worker-a", T0, 10).await), rows);
    store
        .release_leases("worker-b", T0)
        .await
        .expect("release_leases");
    assert!(lease(&store, "worker-c", T0, 10).await.is_empty());
    store
        .release_leases("worker-a", T0)
        .await
        .expect("release_leases");
    assert_eq!(ids(&lease(&store, "worker-c", T0, 10).await), rows);
}

/// `next_due` is the earliest time `lease_due` would return something: the earliest due time
/// of a pending delivery, a leased one counting from the end of its lease; `None` when
/// nothing is pending.
pub async fn next_due_reports_the_earliest_due_time<S: Store>(store: S) {
    assert_eq!(store.next_due().await.expect("next_due"), None);
    let later = one_event(&store, "evt_later", at(5)).await;
    let sooner = one_event(&store, "evt_sooner", at(2)).await;
    assert_eq!(store.next_due().await.expect("next_due"), Some(at(2)));

    assert_eq!(lease(&store, "worker-a", at(10), 10).await.len(), 4);
    assert_eq!(
        store.next_due().await.expect("next_due"),
        Some(at(40)),
        "every row is leased until at(40)"
    );
    for id in &sooner {
        failed(&store, *id, at(10), "timeout", RetryAt(at(20))).await;
    }
    assert_eq!(store.next_due().await.expect("next_due"), Some(at(20)));
    for id in &later {
        delivered(&store, *id, at(10)).await;
    }
    for id in &sooner {
        failed(&store, *id, at(20), "HTTP 410", DeadLetter).await;
    }
    assert_eq!(
        store.next_due().await.expect("next_due"),
        None,
        "delivered and dead rows are never due"
    );
}

/// A delivered attempt finishes the delivery: its attempt is recorded and it is never leased
/// again.
pub async fn a_delivered_attempt_finishes_the_delivery<S: Store>(store: S) {
    let rows = one_event(&store, "evt_1", T0).await;
    lease(&store, "worker-a", T0, 10).await;
    delivered(&store, rows[0], at(1)).await;

    let done = delivery(&store, rows[0]).await;
    assert_eq!(done.state, DeliveryState::Delivered);
    assert_eq!(done.attempts, 1);
    assert_eq!(done.next_attempt_at, None);
    assert_eq!(done.last_error, None);
    let history: Vec<_> = done
        .history
        .iter()
        .map(|a| {
            (
                a.number,
                a.started_at,
                a.status,
                a.latency_ms,
                a.error.clone(),
            )
        })
        .collect();
    assert_eq!(history, [(1, at(1), Some(200), 25, None)]);

    let much_later = lease(&store, "worker-b", at(100_000), 10).await;
    assert_eq!(
        ids(&much_later),
        BTreeSet::from([rows[1]]),
        "only the unfinished delivery, its lease long expired"
    );
    assert_eq!(store.stats().await.expect("stats").pending, 1);
}

/// A failed attempt with a retry time leaves the delivery pending, not due before that time,
/// with its attempt count and last error; attempts are numbered from 1 in both history views.
pub async fn a_failed_attempt_is_retried_no_sooner_than_asked<S: Store>(store: S) {
    let outcome = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    let rows = new_deliveries(&outcome);
    lease(&store, "worker-a", T0, 10).await;
    delivered(&store, rows[1], at(1)).await;
    failed(&store, rows[0], at(1), "HTTP 500", RetryAt(at(60))).await;

    let retrying = delivery(&store, rows[0]).await;
    assert_eq!(retrying.state, DeliveryState::Pending);
    assert_eq!(retrying.attempts, 1);
    assert_eq!(retrying.next_attempt_at, Some(at(60)));
    assert_eq!(retrying.last_error.as_deref(), Some("HTTP 500"));

    assert!(lease(&store, "worker-a", at(59), 10).await.is_empty());
    let again = lease(&store, "worker-a", at(60), 10).await;
    assert_eq!(ids(&again), BTreeSet::from([rows[0]]));
    assert_eq!(
        again[0].attempts, 1,
        "the worker sees the attempts made so far"
    );
    assert_eq!(again[0].round_started_at, T0);
    failed(&store, rows[0], at(60), "timeout", RetryAt(at(180))).await;

    let listed = delivery(&store, rows[0]).await;
    assert_eq!(listed.attempts, 2);
    assert_eq!(listed.last_error.as_deref(), Some("timeout"));
    let want = [
        (1, at(1), Some(500), Some("HTTP 500".to_owned())),
        (2, at(60), None, Some("timeout".to_owned())),
    ];
    let from_list: Vec<_> = listed
        .history
        .iter()
        .map(|a| (a.number, a.started_at, a.status, a.error.clone()))
        .collect();
    assert_eq!(from_list, want, "list_deliveries history");
    let detail = store
        .get_request(outcome.request_id)
        .await
        .expect("get_request")
        .expect("the request is in history");
    let in_detail = detail
        .deliveries
        .iter()
        .find(|d| d.id == rows[0])
        .expect("get_request shows the delivery");
    let from_detail: Vec<_> = in_detail
        .history
        .iter()
        .map(|a| (a.number, a.started_at, a.status, a.error.clone()))
        .collect();
    assert_eq!(from_detail, want, "get_request history");
}

/// A dead-lettered delivery is dead, never leased again, counted, and keeps its last error
/// (an attempt without an error of its own keeps the one before).
pub async fn a_dead_lettered_delivery_keeps_its_last_error<S: Store>(store: S) {
    let rows = one_event(&store, "evt_1", T0).await;
    lease(&store, "worker-a", T0, 10).await;
    failed(&store, rows[0], at(1), "HTTP 500", RetryAt(at(60))).await;
    failed(&store, rows[1], at(1), "HTTP 500", RetryAt(at(60))).await;
    lease(&store, "worker-a", at(60), 10).await;
    failed(&store, rows[0], at(60), "HTTP 503", DeadLetter).await;
    let quiet_death = attempt(rows[1], at(60), None, None, DeadLetter);
    store
        .record_attempt(quiet_death)
        .await
        .expect("record_attempt");

    let dead = delivery(&store, rows[0]).await;
    assert_eq!(dead.state, DeliveryState::Dead);
    assert_eq!(dead.attempts, 2);
    assert_eq!(dead.next_attempt_at, None);
    assert_eq!(dead.last_error.as_deref(), Some("HTTP 503"));
    let quiet = delivery(&store, rows[1]).await;
    assert_eq!(quiet.state, DeliveryState::Dead);
    assert_eq!(quiet.last_error.as_deref(), Some("HTTP 500"));

    assert!(lease(&store, "worker-b", at(100_000), 10).await.is_empty());
    let stats = store.stats().await.expect("stats");
    assert_eq!((stats.pending, stats.dead), (0, 2));
}

/// Redriving a dead delivery queues it again: pending, due at the redrive time, a fresh round
/// (attempts 0, started now), the same `Idempotency-Key`, attempt numbers carrying on.
pub async fn redriving_a_dead_delivery_queues_it_again_with_the_same_key<S: Store>(store: S) {
    let rows = one_event(&store, "evt_1", T0).await;
    let id = rows[0];
    lease(&store, "worker-a", T0, 10).await;
    delivered(&store, rows[1], at(1)).await;
    failed(&store, id, at(1), "HTTP 500", RetryAt(at(60))).await;
    lease(&store, "worker-a", at(60), 10).await;
    failed(&store, id, at(60), "HTTP 410", DeadLetter).await;
    let before = delivery(&store, id).await;

    assert_eq!(
        store.redrive(id, at(3600)).await.expect("redrive"),
        Redrive::Queued
    );
    let queued = delivery(&store, id).await;
    assert_eq!(queued.state, DeliveryState::Pending);
    assert_eq!(queued.attempts, 0);
    assert_eq!(queued.next_attempt_at, Some(at(3600)));
    assert_eq!(queued.idempotency_key, before.idempotency_key);
    assert_eq!(queued.history.len(), 2, "past attempts are kept");
    let stats = store.stats().await.expect("stats");
    assert_eq!((stats.pending, stats.dead), (1, 0));

    let leased = lease(&store, "worker-b", at(3600), 10).await;
    assert_eq!(ids(&leased), BTreeSet::from([id]));
    assert_eq!(leased[0].attempts, 0);
    assert_eq!(leased[0].round_started_at, at(3600));
    assert_eq!(
        leased[0].idempotency_key.as_str(),
        idempotency_key(SOURCE, "evt_1")
    );
    delivered(&store, id, at(3600)).await;
    let numbers: Vec<_> = delivery(&store, id)
        .await
        .history
        .iter()
        .map(|a| a.number)
        .collect();
    assert_eq!(numbers, [1, 2, 3], "numbered over the delivery's life");
}

/// Redriving a delivery that is not dead changes nothing and says why.
pub async fn redriving_what_is_not_dead_changes_nothing<S: Store>(store: S) {
    let rows = one_event(&store, "evt_1", T0).await;
    lease(&store, "worker-a", T0, 10).await;
    delivered(&store, rows[1], at(1)).await;
    let cases = [
        (rows[0], Redrive::NotDead(DeliveryState::Pending)),
        (rows[1], Redrive::NotDead(DeliveryState::Delivered)),
        (DeliveryId(1_000_000), Redrive::NotFound),
    ];
    for (id, want) in cases {
        assert_eq!(
            store.redrive(id, at(10)).await.expect("redrive"),
            want,
            "{id}"
        );
    }
    assert_eq!(
        delivery(&store, rows[0]).await.state,
        DeliveryState::Pending
    );
    assert_eq!(
        delivery(&store, rows[1]).await.state,
        DeliveryState::Delivered
    );
    assert!(
        lease(&store, "worker-b", at(10), 10).await.is_empty(),
        "the pending row is still leased to worker-a"
    );
}

/// A worker whose lease expired and was taken over records its late attempt in history, but
/// never moves the delivery: the newer worker's outcome stands.
pub async fn a_late_worker_never_undoes_a_newer_outcome<S: Store>(store: S) {
    let outcome = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    let rows = new_deliveries(&outcome);
    assert_eq!(lease(&store, "worker-a", T0, 1).await.len(), 1);
    let expired = T0.plus(LEASE + Duration::from_secs(1));
    // Both rows are takeable now (the order among them is the backend's); worker-b takes both.
    let taken = lease(&store, "worker-b", expired, 10).await;
    assert_eq!(ids(&taken), rows.iter().copied().collect::<BTreeSet<_>>());
    let mut done = attempt(rows[0], expired, Some(200), None, Delivered);
    done.owner = "worker-b".to_owned();
    store.record_attempt(done).await.expect("record_attempt");
    // worker-a wakes up late and reports a failure.
    failed(&store, rows[0], at(40), "timeout", RetryAt(at(100))).await;
    // It also reports on the other row, still pending but leased to worker-b now: the attempt
    // is counted, the row stays as worker-b holds it.
    failed(&store, rows[1], at(40), "timeout", RetryAt(at(100))).await;
    let held = delivery(&store, rows[1]).await;
    assert_eq!(held.state, DeliveryState::Pending);
    assert_eq!(
        held.attempts, 0,
        "a stale owner's attempt does not move the row"
    );
    assert_eq!(held.last_error, None);
    let numbers: Vec<u32> = held.history.iter().map(|a| a.number).collect();
    assert_eq!(numbers, [1], "the stale attempt is kept in the history");
    assert!(
        lease(&store, "worker-c", expired, 10).await.is_empty(),
        "worker-b's lease still holds the row"
    );

    let row = delivery(&store, rows[0]).await;
    assert_eq!(row.state, DeliveryState::Delivered);
    let numbers: Vec<u32> = row.history.iter().map(|a| a.number).collect();
    assert_eq!(numbers, [1, 2], "both attempts are kept, numbered in order");
    assert!(lease(&store, "worker-c", at(200), 10)
        .await
        .iter()
        .all(|d| d.id != rows[0]));
}

/// A worker's late record — its lease ran out and the same worker leased the row again — does
/// not move the row: the attempt carries the end of the lease it was made under, and the row
/// is under a newer one (the owner's name alone cannot tell them apart), or under none once
/// the newer lease's attempt was recorded. Only each lease's own attempt moves the row; a wait
/// under the old lease moves nothing either. Each lease handed out names its end.
pub async fn a_record_under_a_lease_taken_again_by_its_own_worker_moves_nothing<S: Store>(
    store: S,
) {
    let rows = one_event(&store, "evt_1", T0).await;
    let first = lease(&store, WORKER, T0, 1).await;
    assert_eq!(ids(&first), BTreeSet::from([rows[0]]));
    assert_eq!(first[0].lease_until, Some(T0.plus(LEASE)));
    let expired = T0.plus(LEASE + Duration::from_secs(1));
    let again = lease(&store, WORKER, expired, 10).await;
    assert!(
        ids(&again).contains(&rows[0]),
        "the ended lease is taken again"
    );
    let newer = again.iter().find(|d| d.id == rows[0]).expect("taken again");
    assert_eq!(newer.lease_until, Some(expired.plus(LEASE)));

    // The first lease's attempts report late: a final failure (with the worker's next lease,
    // and alone), a failure to retry, and a wait.
    let mut late = attempt(rows[0], at(2), Some(500), Some("HTTP 500"), DeadLetter);
    late.lease_until = first[0].lease_until;
    let next = store
        .record_attempt_and_lease(late, at(2), LEASE)
        .await
        .expect("record_attempt_and_lease");
    assert!(next.is_none(), "nothing else is due: {next:?}");
    let mut late = attempt(rows[0], at(2), Some(500), Some("HTTP 500"), RetryAt(at(9)));
    late.lease_until = first[0].lease_until;
    store.record_attempt(late).await.expect("record_attempt");
    let mut late_wait = attempt(rows[0], at(3), None, None, Wait(at(7200)));
    late_wait.lease_until = first[0].lease_until;
    store
        .record_attempt(late_wait)
        .await
        .expect("record a wait");
    let held = delivery(&store, rows[0]).await;
    assert_eq!(
        held.state,
        DeliveryState::Pending,
        "not dead-lettered by the old lease"
    );
    assert_eq!(held.attempts, 0, "nor counted in its round");
    assert_eq!(held.history.len(), 2, "but kept in its history");
    assert!(
        lease(&store, "worker-b", expired, 10).await.is_empty(),
        "the newer lease still holds the row"
    );

    // The newer lease's attempt moves it: a retry, which leaves the row under no lease.
    let mut retry = attempt(
        rows[0],
        expired,
        Some(503),
        Some("HTTP 503"),
        RetryAt(at(50)),
    );
    retry.lease_until = newer.lease_until;
    let next = store
        .record_attempt_and_lease(retry, at(40), LEASE)
        .await
        .expect("record_attempt_and_lease");
    assert!(next.is_none(), "the other row is under the newer lease too");
    let row = delivery(&store, rows[0]).await;
    assert_eq!(row.state, DeliveryState::Pending);
    assert_eq!((row.attempts, row.next_attempt_at), (1, Some(at(50))));
    // The first lease's record, later still, finds the row under no lease: it names a lease
    // that is over, so it moves nothing either.
    let mut late = attempt(rows[0], at(2), Some(500), Some("HTTP 500"), DeadLetter);
    late.lease_until = first[0].lease_until;
    store.record_attempt(late).await.expect("record_attempt");
    let row = delivery(&store, rows[0]).await;
    assert_eq!(
        row.state,
        DeliveryState::Pending,
        "the newer outcome stands"
    );
    assert_eq!((row.attempts, row.next_attempt_at), (1, Some(at(50))));
    assert_eq!(row.history.len(), 4);

    // The retry's own lease delivers it.
    let third = lease(&store, WORKER, at(50), 10).await;
    let third = third.iter().find(|d| d.id == rows[0]).expect("due again");
    let mut done = attempt(rows[0], at(50), Some(200), None, Delivered);
    done.lease_until = third.lease_until;
    store.record_attempt(done).await.expect("record_attempt");
    let row = delivery(&store, rows[0]).await;
    assert_eq!(row.state, DeliveryState::Delivered);
    assert_eq!((row.attempts, row.history.len()), (2, 5));
}

/// A deliberate redelivery queues new deliveries, each with its own id and the event's
/// original `Idempotency-Key` and body; a second one queues again (never swallowed); a
/// request without a verified event has nothing to redeliver.
pub async fn a_deliberate_redelivery_queues_anew_with_the_original_key<S: Store>(store: S) {
    let outcome = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    let original = new_deliveries(&outcome);
    for id in lease(&store, "worker-a", T0, 10).await.iter().map(|d| d.id) {
        delivered(&store, id, at(1)).await;
    }
    let dest = vec![DESTINATIONS[0].to_owned()];
    let mut seen = BTreeSet::new();
    for round in 0..2 {
        let Redelivery::Queued(queued) = store
            .redeliver(outcome.request_id, dest.clone(), at(10 + round))
            .await
            .expect("redeliver")
        else {
            panic!("redelivery of an accepted request must queue");
        };
        assert_eq!(queued.len(), 1, "one event, one destination");
        assert!(
            !original.contains(&queued[0]),
            "a redelivery has its own id"
        );
        assert!(seen.insert(queued[0]), "a second redelivery is new too");
        let leased = lease(&store, "worker-a", at(10 + round), 10).await;
        assert_eq!(ids(&leased), BTreeSet::from([queued[0]]));
        assert_eq!(
            leased[0].idempotency_key.as_str(),
            idempotency_key(SOURCE, "evt_1")
        );
        assert_eq!(&leased[0].body[..], BODY);
        assert_eq!(leased[0].destination, DESTINATIONS[0]);
        delivered(&store, queued[0], at(10 + round)).await;
    }
    let rejected = store
        .record_rejection(crate::conformance::fixture::rejection(
            SOURCE,
            BODY,
            at(20),
            "invalid_signature",
            401,
        ))
        .await
        .expect("record_rejection");
    assert_eq!(
        store
            .redeliver(rejected, dest.clone(), at(21))
            .await
            .expect("redeliver"),
        Redelivery::NothingToRedeliver(hooklatch_core::store::Verdict::Rejected)
    );
    assert_eq!(
        store
            .redeliver(hooklatch_core::RequestId(9_999), dest, at(21))
            .await
            .expect("redeliver"),
        Redelivery::NotFound
    );
}

/// A conflict — a different body under a known key — is redelivered as the new event an
/// operator releases it as: its own body, under `{source}:{key}:{req_N}`, which the
/// application's guard has not seen (the event's own key would be swallowed as done).
pub async fn a_redelivered_conflict_goes_out_under_a_key_of_its_own<S: Store>(store: S) {
    const OTHER: &[u8] = br#"{"id":"evt_1","type":"invoice.paid","amount":2}"#;
    let first = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    for id in lease(&store, "worker-a", T0, 10).await.iter().map(|d| d.id) {
        delivered(&store, id, at(1)).await;
    }
    let conflict = ingest_ok(&store, ingest(SOURCE, &["evt_1"], OTHER, at(2))).await;
    assert_eq!(conflict.verdict(), hooklatch_core::store::Verdict::Conflict);
    assert!(
        new_deliveries(&conflict).is_empty(),
        "a conflict queues nothing"
    );
    let dest = vec![DESTINATIONS[0].to_owned()];
    let Redelivery::Queued(queued) = store
        .redeliver(conflict.request_id, dest.clone(), at(3))
        .await
        .expect("redeliver")
    else {
        panic!("a conflict can be released");
    };
    assert_eq!(queued.len(), 1);
    let leased = lease(&store, "worker-a", at(3), 10).await;
    assert_eq!(ids(&leased), BTreeSet::from([queued[0]]));
    assert_eq!(
        leased[0].idempotency_key.as_str(),
        format!(
            "{}:{}",
            idempotency_key(SOURCE, "evt_1"),
            conflict.request_id
        )
    );
    assert_eq!(&leased[0].body[..], OTHER, "the conflicting body goes out");
    // The accepted request is redelivered under the event's own key, as before.
    let Redelivery::Queued(again) = store
        .redeliver(first.request_id, dest, at(4))
        .await
        .expect("redeliver")
    else {
        panic!("an accepted request can be redelivered");
    };
    let leased = lease(&store, "worker-a", at(4), 10).await;
    assert_eq!(ids(&leased), BTreeSet::from([again[0]]));
    assert_eq!(
        leased[0].idempotency_key.as_str(),
        idempotency_key(SOURCE, "evt_1")
    );
}

/// An operator decides a conflict once: released by its first redelivery (recorded in the same
/// write; a second release queues again) or dismissed (with a reason), after which a release
/// is refused and nothing is queued. A decided conflict is not decided again; only a conflict
/// is dismissed; the history shows each decision, and the undecided conflicts are counted.
pub async fn a_conflict_is_released_or_dismissed_once_and_a_dismissed_one_is_not_released<
    S: Store,
>(
    store: S,
) {
    use hooklatch_core::store::{ConflictAction, Dismissal, Verdict};
    const OTHER: &[u8] = br#"{"id":"evt_1","type":"invoice.paid","amount":2}"#;
    const THIRD: &[u8] = br#"{"id":"evt_1","type":"invoice.paid","amount":3}"#;
    let first = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    let released = ingest_ok(&store, ingest(SOURCE, &["evt_1"], OTHER, at(1))).await;
    let dismissed = ingest_ok(&store, ingest(SOURCE, &["evt_1"], THIRD, at(2))).await;
    async fn undecided<S: Store>(store: &S) -> u64 {
        store
            .undecided_conflicts()
            .await
            .expect("undecided_conflicts")
    }
    async fn summary_of<S: Store>(
        store: &S,
        id: RequestId,
    ) -> hooklatch_core::store::RequestSummary {
        store
            .get_request(id)
            .await
            .expect("get_request")
            .expect("the request")
            .summary
    }
    assert_eq!(undecided(&store).await, 2);
    assert_eq!(summary_of(&store, released.request_id).await.decision, None);

    let dest = vec![DESTINATIONS[0].to_owned()];
    let Redelivery::Queued(_) = store
        .redeliver(released.request_id, dest.clone(), at(3))
        .await
        .expect("redeliver")
    else {
        panic!("a conflict can be released");
    };
    let decision = summary_of(&store, released.request_id)
        .await
        .decision
        .expect("a decision");
    assert_eq!(
        (decision.action, decision.at),
        (ConflictAction::Released, at(3))
    );
    let Redelivery::Queued(again) = store
        .redeliver(released.request_id, dest.clone(), at(4))
        .await
        .expect("redeliver")
    else {
        panic!("a released conflict can be released again");
    };
    assert_eq!(again.len(), 1);
    assert_eq!(
        summary_of(&store, released.request_id)
            .await
            .decision
            .map(|d| d.at),
        Some(at(3)),
        "the first release stands"
    );
    assert_eq!(undecided(&store).await, 1);

    let Dismissal::Dismissed(d) = store
        .dismiss_conflict(
            dismissed.request_id,
            Some("a test charge".to_owned()),
            at(5),
        )
        .await
        .expect("dismiss")
    else {
        panic!("an undecided conflict is dismissed");
    };
    assert_eq!(
        (d.action, d.at, d.reason.as_deref()),
        (ConflictAction::Dismissed, at(5), Some("a test charge"))
    );
    assert_eq!(undecided(&store).await, 0);
    let queued_before = store.outbox_counts().await.expect("counts").pending;
    match store
        .redeliver(dismissed.request_id, dest, at(6))
        .await
        .expect("redeliver")
    {
        Redelivery::Dismissed(d) => assert_eq!(d.at, at(5)),
        other => panic!("a dismissed conflict is not released: {other:?}"),
    }
    assert_eq!(
        store.outbox_counts().await.expect("counts").pending,
        queued_before,
        "nothing queued"
    );
    for (id, action) in [
        (dismissed.request_id, ConflictAction::Dismissed),
        (released.request_id, ConflictAction::Released),
    ] {
        match store
            .dismiss_conflict(id, None, at(7))
            .await
            .expect("dismiss")
        {
            Dismissal::Decided(d) => assert_eq!(d.action, action, "{id}"),
            other => panic!("{id} was decided: {other:?}"),
        }
    }
    assert_eq!(
        store
            .dismiss_conflict(first.request_id, None, at(7))
            .await
            .expect("dismiss"),
        Dismissal::NotAConflict(Verdict::Accepted)
    );
    assert_eq!(
        store
            .dismiss_conflict(hooklatch_core::RequestId(999_999), None, at(7))
            .await
            .expect("dismiss"),
        Dismissal::NotFound
    );
    let listed = store
        .list_requests(hooklatch_core::store::RequestFilter {
            verdict: Some(Verdict::Conflict),
            limit: 10,
            ..Default::default()
        })
        .await
        .expect("list_requests");
    let actions: Vec<_> = listed
        .iter()
        .map(|r| r.decision.as_ref().map(|d| d.action))
        .collect();
    assert_eq!(
        actions,
        vec![
            Some(ConflictAction::Dismissed),
            Some(ConflictAction::Released)
        ],
        "newest first, each with its decision"
    );
    assert_eq!(summary_of(&store, first.request_id).await.decision, None);
}

/// Recording an attempt and leasing the next due delivery in one call: the attempt is
/// recorded as `record_attempt` records it, the next due delivery (never the one just
/// recorded while it waits for its retry) is leased to the same owner, and nothing is
/// returned once nothing is due.
pub async fn recording_an_attempt_can_lease_the_next_due_delivery<S: Store>(store: S) {
    let first = one_event(&store, "evt_1", T0).await;
    let second = one_event(&store, "evt_2", at(1)).await;
    let leased = lease(&store, WORKER, at(2), 1).await;
    assert_eq!(ids(&leased), BTreeSet::from([first[0]]));

    let result = attempt(
        first[0],
        at(3),
        Some(500),
        Some("HTTP 500"),
        RetryAt(at(600)),
    );
    let next = store
        .record_attempt_and_lease(result, at(4), LEASE)
        .await
        .expect("record_attempt_and_lease")
        .expect("other deliveries are due");
    assert_eq!(
        next.id, first[1],
        "the earliest due delivery is leased next"
    );
    let retrying = delivery(&store, first[0]).await;
    assert_eq!(retrying.state, DeliveryState::Pending);
    assert_eq!(retrying.attempts, 1);
    assert_eq!(retrying.next_attempt_at, Some(at(600)));

    let mut leased_ids = BTreeSet::from([next.id]);
    let mut current = next;
    while let Some(next) = store
        .record_attempt_and_lease(
            attempt(current.id, at(5), Some(200), None, Delivered),
            at(5),
            LEASE,
        )
        .await
        .expect("record_attempt_and_lease")
    {
        assert!(leased_ids.insert(next.id), "{:?} leased twice", next.id);
        current = next;
    }
    assert_eq!(
        leased_ids,
        BTreeSet::from([first[1], second[0], second[1]]),
        "every due delivery once, and not the one waiting for its retry"
    );
    for id in [first[1], second[0], second[1]] {
        assert_eq!(delivery(&store, id).await.state, DeliveryState::Delivered);
    }
    assert!(
        lease(&store, "worker-b", at(6), 10).await.is_empty(),
        "nothing else is due"
    );
}

/// An attempt recorded again with its token — the worker did not hear whether its first
/// record committed, and sent it again — changes nothing: no second count, number or history
/// entry, no second move. Recorded with the worker's next lease, the repeat still leases.
/// Another attempt, with a token of its own, counts as ever.
pub async fn an_attempt_recorded_again_with_its_token_changes_nothing<S: Store>(store: S) {
    let rows = one_event(&store, "evt_1", T0).await;
    let leased = lease(&store, WORKER, T0, 1).await;
    assert_eq!(ids(&leased), BTreeSet::from([rows[0]]));

    let failed = attempt(
        rows[0],
        at(1),
        Some(500),
        Some("HTTP 500"),
        RetryAt(at(600)),
    );
    store
        .record_attempt(failed.clone())
        .await
        .expect("record_attempt");
    store
        .record_attempt(failed.clone())
        .await
        .expect("the same record again");
    let retrying = delivery(&store, rows[0]).await;
    assert_eq!(retrying.state, DeliveryState::Pending);
    assert_eq!(retrying.attempts, 1, "the repeat is not counted");
    assert_eq!(retrying.history.len(), 1, "nor kept");
    assert_eq!(retrying.next_attempt_at, Some(at(600)));

    let done = attempt(rows[0], at(601), Some(200), None, Delivered);
    assert_ne!(done.token, failed.token, "each attempt draws its own token");
    store
        .record_attempt(done.clone())
        .await
        .expect("record_attempt");
    // The last record again, this time with the worker's next lease.
    let next = store
        .record_attempt_and_lease(done.clone(), at(602), LEASE)
        .await
        .expect("the repeat with a lease");
    assert_eq!(
        next.map(|d| (d.id, d.lease_until)),
        Some((rows[1], Some(at(602).plus(LEASE)))),
        "a repeat's lease half still leases the next due delivery, naming the lease's end"
    );
    let delivered = delivery(&store, rows[0]).await;
    assert_eq!(delivered.state, DeliveryState::Delivered);
    assert_eq!(delivered.attempts, 2);
    let numbers: Vec<_> = delivered
        .history
        .iter()
        .map(|a| (a.number, a.status))
        .collect();
    assert_eq!(numbers, [(1, Some(500)), (2, Some(200))]);
}

/// The fields of a leased delivery, to compare two of them whole.
#[allow(clippy::type_complexity)]
fn fields(
    d: &LeasedDelivery,
) -> (
    DeliveryId,
    RequestId,
    (&str, &str, Option<&str>, &str, &str),
    (u32, Timestamp, &str, &str),
    (&[Header], &[u8]),
) {
    (
        d.id,
        d.request_id,
        (
            d.source.as_str(),
            d.event_key.as_str(),
            d.event_type.as_deref(),
            d.destination.as_str(),
            d.idempotency_key.as_str(),
        ),
        (
            d.attempts,
            d.round_started_at,
            d.method.as_str(),
            d.path.as_str(),
        ),
        (&d.headers[..], &d.body[..]),
    )
}

/// An ingest with a lease (the hand-off to the local worker) writes its new deliveries leased
/// to that worker: nobody else leases them before the lease ends, the worker's attempts move
/// them, and what [`Ingest::leased`](hooklatch_core::store::Ingest::leased) builds in memory
/// is what `lease_due` hands out once the lease has run out. A duplicate event in the same
/// request hands nothing over.
pub async fn an_ingest_with_a_lease_writes_its_deliveries_leased_to_its_worker<S: Store>(store: S) {
    ingest_ok(&store, ingest(SOURCE, &["evt_0"], BODY, T0)).await;
    lease(&store, "worker-b", T0, 10).await;
    let mut leasing = ingest(SOURCE, &["evt_0", "evt_1"], BODY, at(1));
    leasing.lease = Some(IngestLease {
        owner: WORKER.to_owned(),
        until: at(31),
    });
    let outcome = ingest_ok(&store, leasing.clone()).await;
    let handed = leasing.leased(&outcome);
    let rows = new_deliveries(&outcome);
    assert_eq!(rows.len(), DESTINATIONS.len(), "evt_0 is a duplicate");
    assert_eq!(ids(&handed), rows.iter().copied().collect());
    assert!(handed
        .iter()
        .all(|d| d.event_key == "evt_1" && d.lease_until == Some(at(31))));

    assert!(
        lease(&store, WORKER, at(2), 10).await.is_empty(),
        "leased at ingest: not due"
    );
    // evt_0's deliveries, whose lease from T0 ran out, and nothing of the hand-off.
    assert_eq!(
        lease(&store, "worker-b", at(30), 10).await.len(),
        DESTINATIONS.len()
    );
    delivered(&store, handed[0].id, at(2)).await;
    assert_eq!(
        delivery(&store, handed[0].id).await.state,
        DeliveryState::Delivered,
        "the lease's worker moves it"
    );

    let taken_over = lease(&store, "worker-b", at(31), 10).await;
    assert_eq!(
        ids(&taken_over),
        BTreeSet::from([handed[1].id]),
        "the lease ran out: due like any other row"
    );
    assert_eq!(
        fields(&taken_over[0]),
        fields(&handed[1]),
        "built in memory as the store hands it out"
    );

    // A one-event request (the common case, which some stores write in a shorter way).
    let mut one = ingest(SOURCE, &["evt_2"], BODY, at(40));
    one.lease = leasing.lease.map(|lease| IngestLease {
        until: at(70),
        ..lease
    });
    let outcome = ingest_ok(&store, one.clone()).await;
    let handed = one.leased(&outcome);
    assert_eq!(handed.len(), DESTINATIONS.len());
    // The earlier rows, whose leases ran out, and nothing of this hand-off.
    let earlier = ids(&lease(&store, "worker-b", at(69), 10).await);
    assert!(
        earlier.is_disjoint(&ids(&handed)),
        "leased at ingest: not due"
    );
    let taken_over = lease(&store, "worker-b", at(70), 10).await;
    assert_eq!(
        taken_over.iter().map(fields).collect::<Vec<_>>(),
        handed.iter().map(fields).collect::<Vec<_>>()
    );
}

/// Records `next` for `id` as `owner`'s outcome (no status, no error of its own).
async fn record_as<S: Store>(
    store: &S,
    owner: &str,
    id: DeliveryId,
    started_at: Timestamp,
    next: AttemptNext,
) {
    let mut result = attempt(id, started_at, None, None, next);
    result.owner = owner.to_owned();
    store.record_attempt(result).await.expect("record_attempt");
}

/// A delivery that was not attempted ([`Wait`]: nothing could take it) is put off and its
/// lease released, and nothing else: it stays pending, its attempt count and last error as
/// they were, nothing in its history; it is not due before the time asked, then it is, and
/// the next real attempt is numbered 1.
pub async fn wait_counts_no_attempt<S: Store>(store: S) {
    let outcome = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, T0)).await;
    let rows = new_deliveries(&outcome);
    assert_eq!(lease(&store, WORKER, T0, 10).await.len(), rows.len());
    // An error given with a wait is ignored.
    let waited = attempt(rows[0], at(1), None, Some("no listener"), Wait(at(3600)));
    store.record_attempt(waited).await.expect("record_attempt");

    let waiting = delivery(&store, rows[0]).await;
    assert_eq!(waiting.state, DeliveryState::Pending);
    assert_eq!(waiting.attempts, 0, "a wait is not an attempt");
    assert_eq!(waiting.next_attempt_at, Some(at(3600)));
    assert_eq!(waiting.last_error, None);
    assert!(waiting.history.is_empty(), "{:?}", waiting.history);
    let detail = store
        .get_request(outcome.request_id)
        .await
        .expect("get_request")
        .expect("the request is in history");
    assert!(detail
        .deliveries
        .iter()
        .all(|d| d.id != rows[0] || d.history.is_empty()));

    // The lease is released: a wait shorter than the lease is due when it ends, not when the
    // lease would have.
    record_as(&store, WORKER, rows[1], at(1), Wait(at(5))).await;
    assert!(lease(&store, "worker-b", at(4), 10).await.is_empty());
    assert_eq!(
        ids(&lease(&store, "worker-b", at(5), 10).await),
        BTreeSet::from([rows[1]])
    );
    record_as(&store, "worker-b", rows[1], at(6), Delivered).await;

    assert!(
        lease(&store, "worker-b", at(3599), 10).await.is_empty(),
        "not due before the time asked"
    );
    let again = lease(&store, "worker-b", at(3600), 10).await;
    assert_eq!(ids(&again), BTreeSet::from([rows[0]]));
    assert_eq!(again[0].attempts, 0);
    let mut failing = attempt(
        rows[0],
        at(3600),
        Some(500),
        Some("HTTP 500"),
        RetryAt(at(7200)),
    );
    failing.owner = "worker-b".to_owned();
    store.record_attempt(failing).await.expect("record_attempt");
    let failed_once = delivery(&store, rows[0]).await;
    assert_eq!(failed_once.attempts, 1);
    assert_eq!(failed_once.last_error.as_deref(), Some("HTTP 500"));
    let numbers: Vec<u32> = failed_once.history.iter().map(|a| a.number).collect();
    assert_eq!(numbers, [1], "the first real attempt is numbered 1");
    let delivered_once = delivery(&store, rows[1]).await;
    assert_eq!(delivered_once.attempts, 1);
    assert_eq!(delivered_once.history.len(), 1);
}

/// A wait from a worker whose lease expired and was taken over moves nothing, as a late
/// attempt does not: the row keeps its due time and its new owner's lease. On a delivery
/// already finished it changes nothing either.
pub async fn wait_by_a_late_worker_moves_nothing<S: Store>(store: S) {
    let rows = one_event(&store, "evt_1", T0).await;
    assert_eq!(lease(&store, WORKER, T0, 10).await.len(), rows.len());
    let expired = T0.plus(LEASE + Duration::from_secs(1));
    let taken = lease(&store, "worker-b", expired, 10).await;
    assert_eq!(ids(&taken), rows.iter().copied().collect::<BTreeSet<_>>());
    record_as(&store, "worker-b", rows[1], at(32), Delivered).await;

    // The late worker reports a wait on both, one of them with its next lease.
    let late = attempt(rows[0], at(40), None, None, Wait(at(3600)));
    let next = store
        .record_attempt_and_lease(late, at(40), LEASE)
        .await
        .expect("record_attempt_and_lease");
    assert!(next.is_none(), "nothing is due: {next:?}");
    record_as(&store, WORKER, rows[1], at(40), Wait(at(3600))).await;

    let held = delivery(&store, rows[0]).await;
    assert_eq!(held.state, DeliveryState::Pending);
    assert_eq!(held.next_attempt_at, Some(T0), "the due time stays");
    assert_eq!(held.attempts, 0);
    assert!(held.history.is_empty());
    let done = delivery(&store, rows[1]).await;
    assert_eq!(done.state, DeliveryState::Delivered);
    assert_eq!(done.history.len(), 1);

    let held_until = expired.plus(LEASE);
    assert!(
        lease(&store, "worker-c", Timestamp(held_until.0 - 1), 10)
            .await
            .is_empty(),
        "worker-b's lease still holds the row"
    );
    assert_eq!(
        ids(&lease(&store, "worker-c", held_until, 10).await),
        BTreeSet::from([rows[0]]),
        "due when worker-b's lease ends, not put off"
    );
}

/// Waking a destination makes its pending deliveries due now where they were due later
/// (waiting, or backing off before a retry), counting them, their attempts untouched; another
/// destination's, a delivery under a running lease and a delivery already due are not moved.
/// A second wake finds nothing to move.
pub async fn wake_destination_makes_waiting_rows_due<S: Store>(store: S) {
    let [app, audit] = DESTINATIONS;
    let e1 = one_event(&store, "evt_1", T0).await;
    let e2 = one_event(&store, "evt_2", T0).await;
    let e3 = one_event(&store, "evt_3", T0).await;
    for (rows, name) in [(&e1, app), (&e2, app), (&e3, app)] {
        assert_eq!(delivery(&store, rows[0]).await.destination, name);
    }
    assert_eq!(lease(&store, WORKER, T0, 10).await.len(), 6);
    record_as(&store, WORKER, e1[0], at(1), Wait(at(3600))).await;
    record_as(&store, WORKER, e1[1], at(1), Wait(at(3600))).await;
    failed(&store, e2[0], at(1), "HTTP 500", RetryAt(at(3600))).await;
    delivered(&store, e2[1], at(1)).await;
    record_as(&store, WORKER, e3[0], at(1), Wait(at(7200))).await;
    delivered(&store, e3[1], at(1)).await;
    // Due already at the wake.
    let e5 = one_event(&store, "evt_5", at(5)).await;
    // Due after the wake, but leased until then (a hand-off).
    let mut handed = ingest(SOURCE, &["evt_6"], BODY, at(20));
    handed.lease = Some(IngestLease {
        owner: "worker-h".to_owned(),
        until: at(50),
    });
    let e6 = new_deliveries(&ingest_ok(&store, handed).await);

    let woken = store
        .wake_destination(app, at(10))
        .await
        .expect("wake_destination");
    assert_eq!(woken, 3, "the waiting and the retrying rows of {app}");
    assert_eq!(
        store
            .wake_destination(app, at(10))
            .await
            .expect("wake_destination"),
        0,
        "a second wake moves nothing"
    );
    for (id, attempts, next) in [
        (e1[0], 0, at(10)),
        (e2[0], 1, at(10)),
        (e3[0], 0, at(10)),
        (e1[1], 0, at(3600)),
        (e5[0], 0, at(5)),
        (e6[0], 0, at(20)),
    ] {
        let row = delivery(&store, id).await;
        assert_eq!(row.state, DeliveryState::Pending, "{id}");
        assert_eq!(row.next_attempt_at, Some(next), "{id}");
        assert_eq!(
            (row.attempts, row.history.len()),
            (attempts, attempts as usize),
            "{id}"
        );
    }
    assert_eq!(
        delivery(&store, e2[0]).await.last_error.as_deref(),
        Some("HTTP 500")
    );

    let leased = lease(&store, "worker-b", at(10), 100).await;
    assert_eq!(
        ids(&leased),
        BTreeSet::from([e1[0], e2[0], e3[0], e5[0], e5[1]]),
        "{app}'s woken rows and what was due; not {audit}'s, not the hand-off"
    );
    for d in &leased {
        let want = if d.id == e2[0] { 1 } else { 0 };
        assert_eq!(d.attempts, want, "{}", d.id);
    }
    assert_eq!(
        store
            .wake_destination(app, at(11))
            .await
            .expect("wake_destination"),
        0,
        "rows under a running lease are not moved"
    );
    assert_eq!(
        store
            .wake_destination(audit, at(11))
            .await
            .expect("wake_destination"),
        1
    );
    assert_eq!(
        ids(&lease(&store, "worker-c", at(11), 100).await),
        BTreeSet::from([e1[1]])
    );
}

/// Recording a wait can lease the worker's next due delivery, as recording an attempt can:
/// every due delivery once, never the one just put off, and none is counted an attempt.
pub async fn a_wait_leases_the_next_due_delivery_not_the_waited_one<S: Store>(store: S) {
    let first = one_event(&store, "evt_1", T0).await;
    let second = one_event(&store, "evt_2", at(1)).await;
    let leased = lease(&store, WORKER, at(2), 1).await;
    assert_eq!(ids(&leased), BTreeSet::from([first[0]]));

    let mut waited = BTreeSet::new();
    let mut current = leased[0].id;
    loop {
        assert!(waited.insert(current), "{current} leased twice");
        let result = attempt(current, at(3), None, None, Wait(at(3600)));
        let Some(next) = store
            .record_attempt_and_lease(result, at(4), LEASE)
            .await
            .expect("record_attempt_and_lease")
        else {
            break;
        };
        if current == first[0] {
            assert_eq!(next.id, first[1], "the earliest due delivery is next");
        }
        assert_eq!(next.attempts, 0);
        current = next.id;
    }
    let all: BTreeSet<_> = first.iter().chain(&second).copied().collect();
    assert_eq!(waited, all, "every due delivery once, none waited twice");
    for id in &all {
        let row = delivery(&store, *id).await;
        assert_eq!(row.state, DeliveryState::Pending);
        assert_eq!(row.next_attempt_at, Some(at(3600)));
        assert_eq!((row.attempts, row.history.len()), (0, 0), "{id}");
    }
    assert!(lease(&store, "worker-b", at(3599), 10).await.is_empty());
    assert_eq!(ids(&lease(&store, "worker-b", at(3600), 10).await), all);
}

/// Disabling a destination is kept, once: a second disable changes nothing and keeps the first
/// reason; it moves no delivery. Enabling it removes it from the list and, in the same write,
/// makes its waiting rows due as a wake does (not another destination's); enabling what is not
/// disabled changes nothing.
pub async fn a_disabled_destination_is_kept_until_enabled_which_wakes_its_rows<S: Store>(store: S) {
    let [app, audit] = DESTINATIONS;
    assert_eq!(
        store.disabled_destinations().await.expect("list"),
        Vec::new()
    );
    let gone = DisabledDestination {
        destination: app.to_owned(),
        disabled_at: at(1),
        reason: "HTTP 410 Gone".to_owned(),
    };
    assert!(store
        .disable_destination(gone.clone())
        .await
        .expect("disable"));
    assert!(
        !store
            .disable_destination(DisabledDestination {
                destination: app.to_owned(),
                disabled_at: at(2),
                reason: "by an operator".to_owned(),
            })
            .await
            .expect("disable again"),
        "disabled already"
    );
    assert_eq!(
        store.disabled_destinations().await.expect("list"),
        vec![gone.clone()],
        "the first reason and time are kept"
    );

    let e1 = one_event(&store, "evt_1", T0).await;
    let e2 = one_event(&store, "evt_2", T0).await;
    assert_eq!(
        ids(&lease(&store, WORKER, at(3), 10).await),
        BTreeSet::from([e1[0], e1[1], e2[0], e2[1]]),
        "disabling moves no delivery: workers put them back"
    );
    record_as(&store, WORKER, e1[0], at(3), Wait(at(3600))).await;
    record_as(&store, WORKER, e1[1], at(3), Wait(at(3600))).await;
    delivered(&store, e2[1], at(3)).await;
    // e2[0] stays leased by the worker until at(33).

    assert_eq!(
        store
            .enable_destination(audit, at(10))
            .await
            .expect("enable"),
        None,
        "{audit} was not disabled"
    );
    assert_eq!(
        delivery(&store, e1[1]).await.next_attempt_at,
        Some(at(3600)),
        "enabling what is not disabled wakes nothing"
    );
    assert_eq!(
        store.enable_destination(app, at(10)).await.expect("enable"),
        Some(1),
        "{app}'s waiting row; not its leased one, not {audit}'s"
    );
    assert_eq!(
        store.disabled_destinations().await.expect("list"),
        Vec::new()
    );
    assert_eq!(
        store.enable_destination(app, at(11)).await.expect("enable"),
        None,
        "enabled already"
    );
    let row = delivery(&store, e1[0]).await;
    assert_eq!(
        (row.next_attempt_at, row.attempts),
        (Some(at(10)), 0),
        "due at the enable, no attempt counted"
    );
    assert_eq!(
        ids(&lease(&store, "worker-b", at(10), 10).await),
        BTreeSet::from([e1[0]])
    );

    // Each destination is its own entry.
    for name in [audit, app] {
        assert!(store
            .disable_destination(DisabledDestination {
                destination: name.to_owned(),
                disabled_at: at(20),
                reason: "by an operator".to_owned(),
            })
            .await
            .expect("disable"));
    }
    let names: Vec<String> = store
        .disabled_destinations()
        .await
        .expect("list")
        .into_iter()
        .map(|d| d.destination)
        .collect();
    assert_eq!(names, vec![app.to_owned(), audit.to_owned()], "by name");
}

/// A delivery held for a disabled destination ([`HELD`]) is never due, whatever the time, and
/// is not read again until something wakes it. `wake_held` wakes the held rows of every
/// destination the store has enabled (put back by a worker that heard of the enable late), not
/// a disabled one's, and no row waiting out a retry; a second sweep moves nothing. Enabling
/// the destination wakes the rest.
pub async fn held_deliveries_wait_until_their_destination_is_enabled<S: Store>(store: S) {
    let [app, audit] = DESTINATIONS;
    assert!(store
        .disable_destination(DisabledDestination {
            destination: app.to_owned(),
            disabled_at: at(1),
            reason: "HTTP 410 Gone".to_owned(),
        })
        .await
        .expect("disable"));
    let e1 = one_event(&store, "evt_1", T0).await;
    let e2 = one_event(&store, "evt_2", T0).await;
    for (rows, name) in [(&e1, app), (&e2, app)] {
        assert_eq!(delivery(&store, rows[0]).await.destination, name);
        assert_eq!(delivery(&store, rows[1]).await.destination, audit);
    }
    assert_eq!(lease(&store, WORKER, at(3), 10).await.len(), 4);
    record_as(&store, WORKER, e1[0], at(3), Wait(HELD)).await;
    // A 410's own attempt is counted, and held the same way.
    failed(&store, e2[0], at(3), "HTTP 410", RetryAt(HELD)).await;
    // Held by an instance that had not heard yet that `audit` is enabled.
    record_as(&store, WORKER, e1[1], at(3), Wait(HELD)).await;
    failed(&store, e2[1], at(3), "HTTP 500", RetryAt(at(3600))).await;

    assert_eq!(delivery(&store, e1[0]).await.next_attempt_at, Some(HELD));
    assert_eq!(
        store.next_due().await.expect("next_due"),
        Some(at(3600)),
        "a held row is never the next due"
    );
    // The year 8307.
    let late = at(200_000_000_000);
    assert_eq!(
        ids(&lease(&store, WORKER, late, 10).await),
        BTreeSet::from([e2[1]]),
        "held rows are not due, however late"
    );
    failed(&store, e2[1], late, "HTTP 500", RetryAt(at(3600))).await;

    assert_eq!(
        store.wake_held(at(10)).await.expect("wake_held"),
        1,
        "{audit}'s held row; not {app}'s, not the retry"
    );
    assert_eq!(
        store.wake_held(at(11)).await.expect("wake_held"),
        0,
        "a second sweep moves nothing"
    );
    for (id, attempts, next) in [
        (e1[1], 0, at(10)),
        (e1[0], 0, HELD),
        (e2[0], 1, HELD),
        (e2[1], 2, at(3600)),
    ] {
        let row = delivery(&store, id).await;
        assert_eq!(row.state, DeliveryState::Pending, "{id}");
        assert_eq!(
            (row.next_attempt_at, row.attempts),
            (Some(next), attempts),
            "{id}"
        );
    }
    assert_eq!(
        ids(&lease(&store, "worker-c", at(12), 10).await),
        BTreeSet::from([e1[1]])
    );

    assert_eq!(
        store.enable_destination(app, at(20)).await.expect("enable"),
        Some(2),
        "both of {app}'s held rows"
    );
    assert_eq!(store.wake_held(at(21)).await.expect("wake_held"), 0);
    let leased = lease(&store, "worker-d", at(20), 10).await;
    assert_eq!(ids(&leased), BTreeSet::from([e1[0], e2[0]]));
    for d in &leased {
        let want = if d.id == e2[0] { 1 } else { 0 };
        assert_eq!(
            d.attempts, want,
            "{}: the 410 counted, the put-back not",
            d.id
        );
    }
}
