//! Conformance cases for history (rejections, listing and paging requests and deliveries, one
//! request in full), the purge, and the counts.

use std::time::Duration;

use hooklatch_core::store::{
    AttemptNext, DeliveryDetail, DeliveryFilter, DeliveryState, Purged, RequestFilter, StoreStats,
    Verdict,
};
use hooklatch_core::{DeliveryId, RequestId, Store, Timestamp};

use crate::conformance::fixture::{
    all_deliveries, all_requests, at, attempt, headers, idempotency_key, ingest, ingest_ok,
    new_deliveries, rejection, request, requests_with_key, DESTINATIONS, T0,
};

const SOURCE: &str = "stripe";
const BODY: &[u8] = b"{\"id\":\"evt_1\"}\xff";
const LEASE: Duration = Duration::from_secs(30);

async fn record<S: Store>(store: &S, id: DeliveryId, started_at: Timestamp, next: AttemptNext) {
    let (status, error) = match next {
        AttemptNext::Delivered => (Some(200), None),
        _ => (Some(500), Some("HTTP 500")),
    };
    store
        .record_attempt(attempt(id, started_at, status, error, next))
        .await
        .expect("record_attempt");
}

async fn lease_all<S: Store>(store: &S, now: Timestamp) {
    store
        .lease_due("worker-a", now, LEASE, 1000)
        .await
        .expect("lease_due");
}

/// A rejected request is kept in history byte-exact with its code and status, and touches
/// no claim and no delivery.
pub async fn rejections_are_recorded_in_history_and_claim_nothing<S: Store>(store: S) {
    let id = store
        .record_rejection(rejection(SOURCE, BODY, T0, "invalid_signature", 401))
        .await
        .expect("record_rejection");
    let mut oversized = rejection("nowhere", b"cut sho", at(1), "body_too_large", 413);
    oversized.request.body_truncated = true;
    let truncated_id = store
        .record_rejection(oversized)
        .await
        .expect("record_rejection");
    assert_ne!(id, truncated_id);

    let listed = store
        .list_requests(RequestFilter {
            verdict: Some(Verdict::Rejected),
            limit: 10,
            ..RequestFilter::default()
        })
        .await
        .expect("list_requests");
    let got: Vec<_> = listed
        .iter()
        .map(|r| {
            (
                r.id,
                r.source.as_str(),
                r.reason.as_deref(),
                r.status,
                r.received_at,
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (truncated_id, "nowhere", Some("body_too_large"), 413, at(1)),
            (id, SOURCE, Some("invalid_signature"), 401, T0),
        ]
    );
    assert!(listed.iter().all(|r| r.keys.is_empty()));

    let detail = store
        .get_request(id)
        .await
        .expect("get_request")
        .expect("the rejection is in history");
    assert_eq!(detail.summary.verdict, Verdict::Rejected);
    assert_eq!(detail.headers, headers());
    assert_eq!(&detail.body[..], BODY);
    assert!(!detail.body_truncated);
    assert!(detail.deliveries.is_empty());
    let truncated = store
        .get_request(truncated_id)
        .await
        .expect("get_request")
        .expect("the rejection is in history");
    assert!(truncated.body_truncated);
    assert_eq!(truncated.summary.body_len, 7);

    assert!(all_deliveries(&store).await.is_empty());
    assert_eq!(store.stats().await.expect("stats"), StoreStats::default());
    let later = ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, at(2))).await;
    assert_eq!(
        later.verdict(),
        Verdict::Accepted,
        "the rejection claimed nothing"
    );
}

/// One request as the model sees it.
struct Row {
    id: RequestId,
    source: &'static str,
    verdict: Verdict,
    keys: Vec<String>,
    received_at: Timestamp,
}

/// `list_requests` filters by source, verdict, key and time, newest first, and pages with
/// the `before` cursor without overlap or gaps; checked against a plain list as the model.
pub async fn list_requests_filters_and_pages_newest_first<S: Store>(store: S) {
    use Verdict::{Accepted, Conflict, Duplicate, Rejected};
    // (source, keys, body, verdict); an empty key list means a rejection.
    let script: [(&str, &[&str], &[u8], Verdict); 10] = [
        ("stripe", &["evt_a"], b"a", Accepted),
        ("github", &["evt_a"], b"a", Accepted),
        ("stripe", &["evt_a"], b"a", Duplicate),
        ("stripe", &[], b"forged", Rejected),
        ("stripe", &["evt_a"], b"a2", Conflict),
        ("github", &["evt_b"], b"b", Accepted),
        ("stripe", &["evt_b", "evt_c"], b"bc", Accepted),
        ("github", &[], b"forged", Rejected),
        ("stripe", &["evt_d"], b"d", Accepted),
        ("stripe", &["evt_d"], b"d", Duplicate),
    ];
    let mut model = Vec::new();
    for (i, (source, keys, body, verdict)) in script.into_iter().enumerate() {
        let received_at = at(10 * i as i64);
        let id = if keys.is_empty() {
            store
                .record_rejection(rejection(
                    source,
                    body,
                    received_at,
                    "invalid_signature",
                    401,
                ))
                .await
                .expect("record_rejection")
        } else {
            let outcome = ingest_ok(&store, ingest(source, keys, body, received_at)).await;
            assert_eq!(outcome.verdict(), verdict, "script line {i}");
            outcome.request_id
        };
        model.push(Row {
            id,
            source,
            verdict,
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            received_at,
        });
    }

    let everything = all_requests(&store).await;
    let got: Vec<_> = everything
        .iter()
        .map(|r| {
            (
                r.id,
                r.source.as_str(),
                r.verdict,
                r.keys.clone(),
                r.received_at,
            )
        })
        .collect();
    let want: Vec<_> = model
        .iter()
        .rev()
        .map(|r| (r.id, r.source, r.verdict, r.keys.clone(), r.received_at))
        .collect();
    assert_eq!(got, want, "everything, newest first");

    let filter = |f: fn(&mut RequestFilter)| {
        let mut filter = RequestFilter {
            limit: 100,
            ..RequestFilter::default()
        };
        f(&mut filter);
        filter
    };
    let fifth = model[4].id;
    let checks = [
        filter(|_| {}),
        filter(|f| f.source = Some("stripe".to_owned())),
        filter(|f| f.source = Some("github".to_owned())),
        filter(|f| f.source = Some("nowhere".to_owned())),
        filter(|f| f.verdict = Some(Accepted)),
        filter(|f| f.verdict = Some(Duplicate)),
        filter(|f| f.verdict = Some(Conflict)),
        filter(|f| f.verdict = Some(Rejected)),
        filter(|f| f.key = Some("evt_a".to_owned())),
        filter(|f| f.key = Some("evt_c".to_owned())),
        filter(|f| f.key = Some("evt_none".to_owned())),
        filter(|f| f.since = Some(at(30))),
        filter(|f| f.until = Some(at(30))),
        filter(|f| {
            f.since = Some(at(20));
            f.until = Some(at(60));
        }),
        filter(|f| {
            f.source = Some("stripe".to_owned());
            f.verdict = Some(Accepted);
        }),
        filter(|f| {
            f.source = Some("github".to_owned());
            f.key = Some("evt_a".to_owned());
        }),
        filter(|f| f.limit = 3),
        filter(|f| f.limit = 0),
    ];
    for filter in checks {
        check_list(&store, &model, filter).await;
    }
    let mut before_fifth = RequestFilter {
        limit: 100,
        ..RequestFilter::default()
    };
    before_fifth.before = Some(fifth);
    check_list(&store, &model, before_fifth).await;

    for (source, limit) in [(None, 3), (None, 1), (Some("stripe"), 2), (None, 100)] {
        let mut pages = Vec::new();
        let mut before = None;
        loop {
            let page = store
                .list_requests(RequestFilter {
                    source: source.map(str::to_owned),
                    before,
                    limit,
                    ..RequestFilter::default()
                })
                .await
                .expect("list_requests");
            assert!(page.len() <= limit as usize);
            let Some(last) = page.last() else { break };
            before = Some(last.id);
            pages.extend(page.iter().map(|r| r.id));
        }
        let want: Vec<_> = model
            .iter()
            .rev()
            .filter(|r| source.is_none_or(|s| r.source == s))
            .map(|r| r.id)
            .collect();
        assert_eq!(
            pages, want,
            "pages of {limit} on {source:?}: no overlap, no gap"
        );
    }
}

/// Compares one `list_requests` answer with the model's.
async fn check_list<S: Store>(store: &S, model: &[Row], filter: RequestFilter) {
    let want: Vec<_> = model
        .iter()
        .rev()
        .filter(|r| {
            filter.source.as_deref().is_none_or(|s| r.source == s)
                && filter.verdict.is_none_or(|v| r.verdict == v)
                && filter.key.as_ref().is_none_or(|k| r.keys.contains(k))
                && filter.since.is_none_or(|t| r.received_at >= t)
                && filter.until.is_none_or(|t| r.received_at < t)
                && filter.before.is_none_or(|b| r.id < b)
        })
        .take(filter.limit as usize)
        .map(|r| r.id)
        .collect();
    let got: Vec<_> = store
        .list_requests(filter.clone())
        .await
        .expect("list_requests")
        .iter()
        .map(|r| r.id)
        .collect();
    assert_eq!(got, want, "{filter:?}");
}

/// `get_request` returns the request byte-exact (method, path, peer, headers, body) with
/// its deliveries and their attempts; an unknown id is `None`.
pub async fn get_request_returns_the_request_byte_exact_with_its_deliveries<S: Store>(store: S) {
    let outcome = ingest_ok(&store, ingest(SOURCE, &["evt_1", "evt_2"], BODY, T0)).await;
    let rows = new_deliveries(&outcome);
    assert_eq!(rows.len(), 2 * DESTINATIONS.len());
    lease_all(&store, T0).await;
    record(&store, rows[0], at(1), AttemptNext::Delivered).await;
    record(&store, rows[1], at(1), AttemptNext::RetryAt(at(60))).await;

    let detail = store
        .get_request(outcome.request_id)
        .await
        .expect("get_request")
        .expect("the request is in history");
    assert_eq!(detail.summary.id, outcome.request_id);
    assert_eq!(detail.summary.verdict, Verdict::Accepted);
    assert_eq!(detail.summary.keys, ["evt_1", "evt_2"]);
    assert_eq!(detail.summary.body_len, BODY.len() as u64);
    assert_eq!(detail.summary.status, 200);
    assert_eq!(detail.method, "POST");
    assert_eq!(detail.path, "/in/stripe?attempt=1");
    assert_eq!(detail.peer.as_deref(), Some("192.0.2.7:54321"));
    assert_eq!(detail.headers, headers(), "headers byte-exact, in order");
    assert_eq!(&detail.body[..], BODY, "body byte-exact");
    assert!(!detail.body_truncated);

    let mut shown: Vec<_> = detail.deliveries.iter().map(summarize).collect();
    shown.sort_by_key(|d| d.0);
    let mut listed: Vec<_> = all_deliveries(&store).await.iter().map(summarize).collect();
    listed.sort_by_key(|d| d.0);
    assert_eq!(shown, listed, "the same deliveries as list_deliveries");
    let mut keys: Vec<_> = detail
        .deliveries
        .iter()
        .map(|d| d.idempotency_key.clone())
        .collect();
    keys.sort();
    keys.dedup();
    assert_eq!(
        keys,
        [
            idempotency_key(SOURCE, "evt_1"),
            idempotency_key(SOURCE, "evt_2")
        ]
    );

    assert!(store
        .get_request(RequestId(1_000_000))
        .await
        .expect("get_request")
        .is_none());
}

/// The fields of a delivery that two views of it must agree on.
type DeliverySummary = (
    DeliveryId,
    RequestId,
    String,
    DeliveryState,
    u32,
    Option<Timestamp>,
    Vec<(u32, Option<u16>)>,
);

fn summarize(d: &DeliveryDetail) -> DeliverySummary {
    (
        d.id,
        d.request_id,
        d.destination.clone(),
        d.state,
        d.attempts,
        d.next_attempt_at,
        d.history.iter().map(|a| (a.number, a.status)).collect(),
    )
}

/// `list_deliveries` filters by state and destination, newest first, and pages with the
/// `before` cursor without overlap or gaps.
pub async fn list_deliveries_filters_and_pages_newest_first<S: Store>(store: S) {
    let outcome = ingest_ok(
        &store,
        ingest(SOURCE, &["evt_1", "evt_2", "evt_3"], BODY, T0),
    )
    .await;
    let mut created = new_deliveries(&outcome);
    assert_eq!(created.len(), 3 * DESTINATIONS.len());
    lease_all(&store, T0).await;
    record(&store, created[0], at(1), AttemptNext::Delivered).await;
    record(&store, created[1], at(1), AttemptNext::DeadLetter).await;
    record(&store, created[2], at(1), AttemptNext::Delivered).await;

    let all = all_deliveries(&store).await;
    let ids: Vec<_> = all.iter().map(|d| d.id).collect();
    created.sort_by(|a, b| b.cmp(a));
    assert_eq!(ids, created, "every delivery, newest first");

    let filters = [
        (Some(DeliveryState::Pending), None, 100),
        (Some(DeliveryState::Delivered), None, 100),
        (Some(DeliveryState::Dead), None, 100),
        (None, Some("app"), 100),
        (None, Some("nowhere"), 100),
        (Some(DeliveryState::Pending), Some("audit"), 100),
        (None, None, 2),
    ];
    for (state, destination, limit) in filters {
        let want: Vec<_> = all
            .iter()
            .filter(|d| state.is_none_or(|s| d.state == s))
            .filter(|d| destination.is_none_or(|dest| d.destination == dest))
            .take(limit as usize)
            .map(|d| d.id)
            .collect();
        let got: Vec<_> = store
            .list_deliveries(DeliveryFilter {
                state,
                destination: destination.map(str::to_owned),
                before: None,
                limit,
            })
            .await
            .expect("list_deliveries")
            .iter()
            .map(|d| d.id)
            .collect();
        assert_eq!(
            got, want,
            "state {state:?}, destination {destination:?}, limit {limit}"
        );
    }
    let dead = store
        .list_deliveries(DeliveryFilter {
            state: Some(DeliveryState::Dead),
            limit: 10,
            ..DeliveryFilter::default()
        })
        .await
        .expect("list_deliveries");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].last_error.as_deref(), Some("HTTP 500"));

    let mut pages = Vec::new();
    let mut before = None;
    loop {
        let page = store
            .list_deliveries(DeliveryFilter {
                before,
                limit: 4,
                ..DeliveryFilter::default()
            })
            .await
            .expect("list_deliveries");
        let Some(last) = page.last() else { break };
        before = Some(last.id);
        pages.extend(page.iter().map(|d| d.id));
    }
    assert_eq!(pages, created, "pages of 4: no overlap, no gap");
}

/// The purge removes claims expired at or before now (and only those), after which the key
/// is new again.
pub async fn purge_removes_claims_expired_at_or_before_now<S: Store>(store: S) {
    let hour = Duration::from_secs(3600);
    let mut first = ingest(SOURCE, &["evt_a"], BODY, T0);
    first.retention = hour;
    ingest_ok(&store, first).await;
    let mut second = ingest(SOURCE, &["evt_b"], BODY, at(1800));
    second.retention = hour;
    ingest_ok(&store, second).await;

    let long_ago = at(-1_000_000);
    let purged = store.purge(at(3600), long_ago).await.expect("purge");
    assert_eq!(
        purged,
        Purged {
            claims: 1,
            requests: 0
        }
    );
    assert_eq!(store.stats().await.expect("stats").claims, 1);
    let purged = store.purge(at(3600), long_ago).await.expect("purge");
    assert_eq!(purged, Purged::default(), "a second purge finds nothing");

    let a = ingest_ok(&store, ingest(SOURCE, &["evt_a"], BODY, at(3601))).await;
    assert_eq!(a.verdict(), Verdict::Accepted);
    let b = ingest_ok(&store, ingest(SOURCE, &["evt_b"], BODY, at(3601))).await;
    assert_eq!(
        b.verdict(),
        Verdict::Duplicate,
        "an unexpired claim survives the purge"
    );
}

/// The purge removes requests received before `history_before` with no pending delivery and
/// no live claim, together with their deliveries and attempts, and keeps everything else.
pub async fn purge_removes_old_finished_history_with_its_deliveries<S: Store>(store: S) {
    let hour = Duration::from_secs(3600);
    let short = |key: &str, received_at| {
        let mut res = ingest(SOURCE, &[key], BODY, received_at);
        res.retention = hour;
        res
    };
    // Delivered and its claim expires: purged.
    let finished = ingest_ok(&store, short("evt_finished", T0)).await;
    // Dead-lettered (one delivered, one dead), its claim expires: kept, for an operator.
    let dead = ingest_ok(&store, short("evt_dead", T0)).await;
    // Still pending, its claim expires: kept for its delivery.
    let pending = ingest_ok(&store, short("evt_pending", T0)).await;
    let rejected = store
        .record_rejection(rejection(SOURCE, BODY, T0, "invalid_signature", 401))
        .await
        .expect("record_rejection");
    // Finished but its claim lives on: kept, the claim points at it.
    let claimed = ingest_ok(&store, ingest(SOURCE, &["evt_claimed"], BODY, T0)).await;
    // A duplicate: no delivery, no claim of its own: purged.
    let duplicate = ingest_ok(&store, ingest(SOURCE, &["evt_claimed"], BODY, at(1))).await;
    assert_eq!(duplicate.verdict(), Verdict::Duplicate);
    // Received after the cut-off: kept.
    let recent = ingest_ok(&store, short("evt_recent", at(7200))).await;

    let finished_rows = new_deliveries(&finished);
    let dead_rows = new_deliveries(&dead);
    let claimed_rows = new_deliveries(&claimed);
    lease_all(&store, at(2)).await;
    for id in &finished_rows {
        record(&store, *id, at(3), AttemptNext::Delivered).await;
    }
    record(&store, dead_rows[0], at(3), AttemptNext::Delivered).await;
    record(&store, dead_rows[1], at(3), AttemptNext::DeadLetter).await;
    for id in &claimed_rows {
        record(&store, *id, at(3), AttemptNext::Delivered).await;
    }
    store
        .release_leases("worker-a", at(3))
        .await
        .expect("release_leases");

    let purged = store.purge(at(7200), at(3600)).await.expect("purge");
    assert_eq!(
        purged,
        Purged {
            claims: 3,
            requests: 3
        },
        "claims of evt_finished, evt_dead and evt_pending; the finished, rejected and duplicate \
         requests"
    );
    for (id, kept) in [
        (finished.request_id, false),
        (dead.request_id, true),
        (pending.request_id, true),
        (rejected, false),
        (claimed.request_id, true),
        (duplicate.request_id, false),
        (recent.request_id, true),
    ] {
        let found = store.get_request(id).await.expect("get_request").is_some();
        assert_eq!(found, kept, "{id} kept");
    }
    let remaining: Vec<_> = all_deliveries(&store).await.iter().map(|d| d.id).collect();
    for id in &finished_rows {
        assert!(!remaining.contains(id), "{id} went with its request");
    }
    for id in &dead_rows {
        assert!(
            remaining.contains(id),
            "{id} stayed with its dead-lettered sibling"
        );
    }
    assert_eq!(remaining.len(), 4 * DESTINATIONS.len());
    let stats = store.stats().await.expect("stats");
    assert_eq!(
        stats,
        StoreStats {
            pending: 4,
            dead: 1,
            claims: 2
        }
    );
    let detail = store
        .get_request(claimed.request_id)
        .await
        .expect("get_request")
        .expect("kept");
    assert!(
        detail.deliveries.iter().all(|d| d.history.len() == 1),
        "a kept request keeps its attempts"
    );
    assert_eq!(
        store.purge(at(7200), at(3600)).await.expect("purge"),
        Purged::default()
    );
}

/// The counts follow ingests, attempts and redrives: pending and dead deliveries, claims held;
/// the outbox's counts alone say the same as the whole.
pub async fn stats_count_pending_dead_and_claims<S: Store>(store: S) {
    async fn counts<S: Store>(store: &S) -> StoreStats {
        let stats = store.stats().await.expect("stats");
        let outbox = store.outbox_counts().await.expect("outbox_counts");
        assert_eq!(
            (outbox.pending, outbox.dead),
            (stats.pending, stats.dead),
            "outbox_counts and stats disagree"
        );
        stats
    }
    let stats = |pending, dead, claims| StoreStats {
        pending,
        dead,
        claims,
    };
    assert_eq!(counts(&store).await, stats(0, 0, 0));
    let outcome = ingest_ok(&store, ingest(SOURCE, &["evt_1", "evt_2"], BODY, T0)).await;
    assert_eq!(counts(&store).await, stats(4, 0, 2));
    ingest_ok(&store, ingest(SOURCE, &["evt_1"], BODY, at(1))).await;
    store
        .record_rejection(rejection(SOURCE, BODY, at(2), "invalid_signature", 401))
        .await
        .expect("record_rejection");
    assert_eq!(counts(&store).await, stats(4, 0, 2));

    let rows = new_deliveries(&outcome);
    lease_all(&store, at(3)).await;
    assert_eq!(
        counts(&store).await,
        stats(4, 0, 2),
        "leased rows are still pending"
    );
    record(&store, rows[0], at(4), AttemptNext::Delivered).await;
    record(&store, rows[1], at(4), AttemptNext::DeadLetter).await;
    assert_eq!(counts(&store).await, stats(2, 1, 2));
    store.redrive(rows[1], at(5)).await.expect("redrive");
    assert_eq!(counts(&store).await, stats(3, 0, 2));
}

/// A verified handshake is kept in history with verdict `handshake` and its status, and
/// touches no claim and no delivery.
pub async fn handshakes_are_recorded_in_history_and_claim_nothing<S: Store>(store: S) {
    let id = store
        .record_handshake(
            request("slack", b"{\"type\":\"url_verification\"}", T0),
            200,
        )
        .await
        .expect("record_handshake");
    let listed = store
        .list_requests(RequestFilter {
            verdict: Some(Verdict::Handshake),
            limit: 10,
            ..RequestFilter::default()
        })
        .await
        .expect("list_requests");
    assert_eq!(listed.len(), 1);
    assert_eq!((listed[0].id, listed[0].status), (id, 200));
    assert_eq!(listed[0].reason, None);
    let detail = store
        .get_request(id)
        .await
        .expect("get_request")
        .expect("kept");
    assert!(detail.deliveries.is_empty());
    assert_eq!(store.stats().await.expect("stats").claims, 0);
}

/// An imported capture is kept byte-exact with verdict `imported` and its keys, claims
/// nothing, and can be redelivered with its events' `Idempotency-Key`s.
pub async fn imports_are_kept_and_redeliverable_but_claim_nothing<S: Store>(store: S) {
    let id = store
        .record_import(request(SOURCE, BODY, T0), vec!["evt_imported".to_owned()])
        .await
        .expect("record_import");
    let listed = requests_with_key(&store, "evt_imported").await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, id);
    assert_eq!(listed[0].verdict, Verdict::Imported);
    assert_eq!(listed[0].keys, ["evt_imported"]);
    let detail = store
        .get_request(id)
        .await
        .expect("get_request")
        .expect("kept");
    assert_eq!(&detail.body[..], BODY);
    assert_eq!(store.stats().await.expect("stats").claims, 0);
    // The same key arriving for real is new: an import claims nothing.
    let outcome = ingest_ok(&store, ingest(SOURCE, &["evt_imported"], BODY, at(1))).await;
    assert_eq!(outcome.verdict(), Verdict::Accepted);

    let dest = vec![DESTINATIONS[0].to_owned()];
    let queued = store.redeliver(id, dest, at(2)).await.expect("redeliver");
    let hooklatch_core::store::Redelivery::Queued(queued) = queued else {
        panic!("an imported capture is redeliverable: {queued:?}");
    };
    assert_eq!(queued.len(), 1);
    let all = all_deliveries(&store).await;
    let row = all.iter().find(|d| d.id == queued[0]).expect("queued row");
    assert_eq!(row.idempotency_key, idempotency_key(SOURCE, "evt_imported"));
    assert_eq!(row.request_id, id);
}

/// Listing by key finds every request that carried the key, on every source, also once the
/// claim that pointed at the first one was replaced (retention over, the key claimed again)
/// or purged.
pub async fn the_key_finds_every_request_that_carried_it_after_claims_are_replaced_or_purged<
    S: Store,
>(
    store: S,
) {
    let hour = Duration::from_secs(3600);
    let short = |received_at| {
        let mut res = ingest(SOURCE, &["evt_r"], BODY, received_at);
        res.retention = hour;
        res
    };
    let keyed = || async {
        let found = requests_with_key(&store, "evt_r").await;
        found.into_iter().map(|r| r.id).collect::<Vec<_>>()
    };
    let first = ingest_ok(&store, short(T0)).await;
    let duplicate = ingest_ok(&store, short(at(10))).await;
    assert_eq!(duplicate.verdict(), Verdict::Duplicate);
    let conflict = ingest_ok(&store, ingest(SOURCE, &["evt_r"], b"other", at(20))).await;
    assert_eq!(conflict.verdict(), Verdict::Conflict);
    let mut want = vec![conflict.request_id, duplicate.request_id, first.request_id];
    assert_eq!(keyed().await, want);

    let again = ingest_ok(&store, short(at(3601))).await;
    assert_eq!(
        again.verdict(),
        Verdict::Accepted,
        "the expired claim is taken again"
    );
    want.insert(0, again.request_id);
    assert_eq!(keyed().await, want, "after the claim was replaced");

    let purged = store
        .purge(at(2 * 3600 + 10), at(-1_000_000))
        .await
        .expect("purge");
    assert_eq!(purged.claims, 1);
    assert_eq!(keyed().await, want, "after the claim was purged");

    let elsewhere = ingest_ok(&store, ingest("github", &["evt_r"], BODY, at(3 * 3600))).await;
    assert_eq!(elsewhere.verdict(), Verdict::Accepted);
    want.insert(0, elsewhere.request_id);
    assert_eq!(keyed().await, want, "the same key on another source");
}
