//! T7, the idempotency contract, property-based: random sequences of provider sends (two
//! sources, four event ids, three bodies), forgeries refused before the store, deliberate
//! redeliveries, conflict dismissals and worker drains, clock moves past the keys' retention and purges, run against the SQLite
//! store (a new file per case) and the in-memory store, and checked after every step against
//! a model of what the contract says.
//!
//! The model: the first body of a (source, key) is accepted and queues one delivery per
//! destination under `{source}:{key}`; the same body again is a duplicate and the first
//! request's; another body is a conflict, kept, queuing nothing. A redelivery queues anew
//! under the event's key (a conflict: under `{source}:{key}:req_N`, recorded released the first
//! time), except for a dismissed conflict; only an undecided conflict is dismissed. A claim
//! whose retention has passed (from the second it reaches it) no longer counts: the next send
//! of its key is new and replaces it; a purge removes exactly the expired ones. Counted
//! after every step: claims, pending deliveries, undecided conflicts; on each drain, every
//! leased delivery carries the key and the body the model expects.

use std::collections::HashMap;

use hooklatch_core::store::{AttemptNext, ConflictAction, Dismissal, Redelivery, Verdict};
use hooklatch_core::Timestamp;
use hooklatch_core::{Claim, DeliveryId, RequestId, Store};
use hooklatch_store_sqlite::{SqliteOptions, SqliteStore};
use hooklatch_testkit::conformance::fixture::{
    attempt, ingest, rejection, DESTINATIONS, RETENTION, T0,
};
use hooklatch_testkit::MemoryStore;
use proptest::prelude::*;

const SOURCES: [&str; 2] = ["stripe", "github"];
const BODIES: [&[u8]; 3] = [
    br#"{"amount":1}"#,
    br#"{"amount":2}"#,
    b"\xff\x00 not utf-8",
];

#[derive(Debug, Clone)]
enum Op {
    /// A provider sends event `key` of `source` with body `body`, `after` seconds later.
    Send {
        source: usize,
        key: u8,
        body: usize,
        after: u16,
    },
    /// A forgery sent to `source` with body `body`: refused before the store (its signature
    /// is wrong), which keeps only its history record.
    Forged { source: usize, body: usize },
    /// An operator redelivers the `pick`-th request (modulo how many there are).
    Redeliver { pick: usize },
    /// An operator dismisses the `pick`-th request.
    Dismiss { pick: usize },
    /// A worker leases everything due and delivers it.
    Drain,
    /// The clock moves on by the keys' retention, less a second, exactly, or plus an hour
    /// (`by` 0, 1, 2): claims that old are expired, and the next send of their key is new.
    Wait { by: u8 },
    /// The upkeep purges expired claims (history is kept).
    Purge,
}

/// How far [`Op::Wait`] moves the clock.
fn wait(by: u8) -> std::time::Duration {
    match by {
        0 => RETENTION - std::time::Duration::from_secs(1),
        1 => RETENTION,
        _ => RETENTION + std::time::Duration::from_secs(3600),
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..SOURCES.len(), 0u8..4, 0..BODIES.len(), 0u16..600)
            .prop_map(|(source, key, body, after)| Op::Send { source, key, body, after }),
        1 => (0..SOURCES.len(), 0..BODIES.len())
            .prop_map(|(source, body)| Op::Forged { source, body }),
        2 => any::<usize>().prop_map(|pick| Op::Redeliver { pick }),
        2 => any::<usize>().prop_map(|pick| Op::Dismiss { pick }),
        1 => Just(Op::Drain),
        1 => (0u8..3).prop_map(|by| Op::Wait { by }),
        1 => Just(Op::Purge),
    ]
}

/// One request as the model knows it.
struct Sent {
    id: RequestId,
    source: &'static str,
    key: String,
    body: &'static [u8],
    verdict: Verdict,
    decision: Option<ConflictAction>,
}

#[derive(Default)]
struct Model {
    /// By (source, key): the first body, the request that claimed it, and when; kept until a
    /// purge once expired (a claim is expired once its retention has passed).
    claims: HashMap<(&'static str, String), (&'static [u8], RequestId, Timestamp)>,
    requests: Vec<Sent>,
    /// Queued and not yet delivered: the key and body each must carry.
    pending: HashMap<DeliveryId, (String, &'static [u8])>,
}

/// Whether a claim made at `at` has expired by `now`.
fn expired(at: Timestamp, now: Timestamp) -> bool {
    now >= at.plus(RETENTION)
}

impl Model {
    fn undecided(&self) -> u64 {
        self.requests
            .iter()
            .filter(|r| r.verdict == Verdict::Conflict && r.decision.is_none())
            .count() as u64
    }
}

async fn run<S: Store>(store: &S, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut model = Model::default();
    let mut now = T0;
    for (step, op) in ops.iter().enumerate() {
        match *op {
            Op::Send {
                source,
                key,
                body,
                after,
            } => {
                now = now.plus(std::time::Duration::from_secs(u64::from(after)));
                let (source, body) = (SOURCES[source], BODIES[body]);
                let key = format!("evt_{key}");
                let outcome = store
                    .ingest(ingest(source, &[&key], body, now))
                    .await
                    .map_err(|e| TestCaseError::fail(format!("step {step}: ingest: {e}")))?;
                let claim = &outcome.claims[0].1;
                let live = model
                    .claims
                    .get(&(source, key.clone()))
                    .filter(|(_, _, at)| !expired(*at, now));
                let verdict = match live {
                    None => {
                        let Claim::New { deliveries } = claim else {
                            return Err(TestCaseError::fail(format!(
                                "step {step}: {source}:{key} is new, got {claim:?}"
                            )));
                        };
                        prop_assert_eq!(deliveries.len(), DESTINATIONS.len());
                        for id in deliveries {
                            model.pending.insert(*id, (format!("{source}:{key}"), body));
                        }
                        // An expired claim is replaced: still one claim for the key.
                        model
                            .claims
                            .insert((source, key.clone()), (body, outcome.request_id, now));
                        Verdict::Accepted
                    }
                    Some((first_body, first, _)) if *first_body == body => {
                        prop_assert!(
                            matches!(claim, Claim::Duplicate { first_request, .. } if first_request == first),
                            "step {step}: a duplicate of {first}, got {claim:?}"
                        );
                        Verdict::Duplicate
                    }
                    Some((_, first, _)) => {
                        prop_assert!(
                            matches!(claim, Claim::Conflict { first_request, .. } if first_request == first),
                            "step {step}: a conflict with {first}, got {claim:?}"
                        );
                        Verdict::Conflict
                    }
                };
                prop_assert_eq!(outcome.verdict(), verdict, "step {}", step);
                model.requests.push(Sent {
                    id: outcome.request_id,
                    source,
                    key,
                    body,
                    verdict,
                    decision: None,
                });
            }
            Op::Redeliver { pick } => {
                if model.requests.is_empty() {
                    continue;
                }
                let r = pick % model.requests.len();
                let dest: Vec<String> = DESTINATIONS.iter().map(|d| (*d).to_owned()).collect();
                let answer = store
                    .redeliver(model.requests[r].id, dest, now)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("step {step}: redeliver: {e}")))?;
                let sent = &mut model.requests[r];
                if sent.decision == Some(ConflictAction::Dismissed) {
                    prop_assert!(
                        matches!(answer, Redelivery::Dismissed(_)),
                        "step {step}: a dismissed conflict is not released: {answer:?}"
                    );
                    continue;
                }
                let Redelivery::Queued(ids) = answer else {
                    return Err(TestCaseError::fail(format!(
                        "step {step}: {} queues again, got {answer:?}",
                        sent.id
                    )));
                };
                prop_assert_eq!(ids.len(), DESTINATIONS.len());
                let key = if sent.verdict == Verdict::Conflict {
                    sent.decision.get_or_insert(ConflictAction::Released);
                    format!("{}:{}:{}", sent.source, sent.key, sent.id)
                } else {
                    format!("{}:{}", sent.source, sent.key)
                };
                for id in ids {
                    model.pending.insert(id, (key.clone(), sent.body));
                }
            }
            Op::Dismiss { pick } => {
                if model.requests.is_empty() {
                    continue;
                }
                let r = pick % model.requests.len();
                let sent = &mut model.requests[r];
                let answer = store
                    .dismiss_conflict(sent.id, None, now)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("step {step}: dismiss: {e}")))?;
                match (sent.verdict, sent.decision) {
                    (Verdict::Conflict, None) => {
                        prop_assert!(
                            matches!(answer, Dismissal::Dismissed(_)),
                            "step {step}: {answer:?}"
                        );
                        sent.decision = Some(ConflictAction::Dismissed);
                    }
                    (Verdict::Conflict, Some(action)) => prop_assert!(
                        matches!(&answer, Dismissal::Decided(d) if d.action == action),
                        "step {step}: decided as {action:?} before: {answer:?}"
                    ),
                    (verdict, _) => prop_assert_eq!(answer, Dismissal::NotAConflict(verdict)),
                }
            }
            Op::Forged { source, body } => {
                // Nothing of the model changes: no claim, no delivery, and the key's next
                // genuine send is answered as if the forgery had never come.
                let code = "invalid_signature";
                store
                    .record_rejection(rejection(SOURCES[source], BODIES[body], now, code, 401))
                    .await
                    .map_err(|e| TestCaseError::fail(format!("step {step}: rejection: {e}")))?;
            }
            Op::Wait { by } => now = now.plus(wait(by)),
            Op::Purge => {
                let purged = store
                    .purge(now, T0)
                    .await
                    .map_err(|e| TestCaseError::fail(format!("step {step}: purge: {e}")))?;
                let before = model.claims.len();
                model.claims.retain(|_, (_, _, at)| !expired(*at, now));
                prop_assert_eq!(
                    purged.claims,
                    (before - model.claims.len()) as u64,
                    "step {}: expired claims purged",
                    step
                );
                prop_assert_eq!(purged.requests, 0, "step {}: history is kept", step);
            }
            Op::Drain => {
                let leased = store
                    .lease_due(
                        "contract-worker",
                        now,
                        std::time::Duration::from_secs(60),
                        10_000,
                    )
                    .await
                    .map_err(|e| TestCaseError::fail(format!("step {step}: lease: {e}")))?;
                prop_assert_eq!(
                    leased.len(),
                    model.pending.len(),
                    "step {}: every pending row is due",
                    step
                );
                for d in leased {
                    let Some((key, body)) = model.pending.remove(&d.id) else {
                        return Err(TestCaseError::fail(format!(
                            "step {step}: {} was not queued",
                            d.id
                        )));
                    };
                    prop_assert_eq!(d.idempotency_key.as_str(), key.as_str(), "step {}", step);
                    prop_assert_eq!(&d.body[..], body, "step {}", step);
                    let mut done = attempt(d.id, now, Some(200), None, AttemptNext::Delivered);
                    done.owner = "contract-worker".to_owned();
                    store
                        .record_attempt(done)
                        .await
                        .map_err(|e| TestCaseError::fail(format!("step {step}: record: {e}")))?;
                }
            }
        }
        let stats = store
            .stats()
            .await
            .map_err(|e| TestCaseError::fail(format!("step {step}: stats: {e}")))?;
        prop_assert_eq!(
            stats.claims,
            model.claims.len() as u64,
            "step {}: claims",
            step
        );
        prop_assert_eq!(
            stats.pending,
            model.pending.len() as u64,
            "step {}: pending",
            step
        );
        let undecided = store
            .undecided_conflicts()
            .await
            .map_err(|e| TestCaseError::fail(format!("step {step}: undecided: {e}")))?;
        prop_assert_eq!(
            undecided,
            model.undecided(),
            "step {}: undecided conflicts",
            step
        );
    }
    Ok(())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
}

/// 64 cases per store and run, times `$HOOKLATCH_SCALE` (`scripts/soak`).
fn cases() -> u32 {
    let scale = std::env::var("HOOKLATCH_SCALE")
        .ok()
        .and_then(|s| s.parse::<u32>().ok())
        .filter(|s| *s >= 1)
        .unwrap_or(1);
    64 * scale
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn the_sqlite_store_keeps_the_idempotency_contract(ops in proptest::collection::vec(op(), 1..40)) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SqliteStore::open(&SqliteOptions::new(dir.path().join("contract.db")))
            .expect("opening the store");
        runtime().block_on(run(&store, &ops))?;
    }

    #[test]
    fn the_memory_store_keeps_the_idempotency_contract(ops in proptest::collection::vec(op(), 1..40)) {
        runtime().block_on(run(&MemoryStore::default(), &ops))?;
    }
}
