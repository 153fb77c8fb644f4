//! The hand-off: new deliveries go from ingest to this instance's delivery worker in memory.
//!
//! Without it, a new event costs the store three writes: its ingest, the worker's lease, and
//! its attempt. With it, the ingest transaction writes the event's deliveries already leased
//! to the local worker ([`IngestLease`]), and once that transaction commits the deliveries,
//! as [`Ingest::leased`] builds them, wait here for the worker: two writes, and no read of the
//! request back from the store.
//!
//! The worker grants hand-offs only while it is caught up — its last look at the store found
//! no more due rows than it asked for — and while fewer than its concurrency wait here. So
//! deliveries already due (a backlog, retries coming due) are never passed by new events: the
//! worker's tasks keep asking the store first with every attempt they record, and turn to the
//! hand-off only when the store has nothing due.
//!
//! Nothing is lost when a hand-off does not happen: a delivery written leased but never
//! attempted (the process died, or the worker stopped first) becomes due when its lease ends
//! and is leased again like any other row, with the same `Idempotency-Key`. One that waited
//! here for half of its lease is dropped from the queue for the same reason: it is attempted
//! once its lease has run out, instead of racing another instance that may take it then.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use hooklatch_core::store::{Ingest, IngestLease, IngestOutcome, LeasedDelivery};
use hooklatch_core::Timestamp;
use tokio::sync::Notify;

/// The queue between ingest and the local delivery worker (see the module docs).
pub struct Handoff {
    owner: String,
    lease: Duration,
    capacity: usize,
    state: Mutex<Queue>,
    /// The worker's last look at the store found no more due rows than it asked for.
    caught_up: AtomicBool,
    /// The worker stopped: no more hand-offs.
    closed: AtomicBool,
    /// Wakes the worker's dispatcher when deliveries are handed over ([`Handoff::handed`]).
    wake: Arc<Notify>,
}

#[derive(Default)]
struct Queue {
    /// Deliveries leased at ingest, committed, waiting for a worker task; with each lease's end.
    waiting: VecDeque<(LeasedDelivery, Timestamp)>,
    /// Deliveries promised to ingests still in their transactions.
    reserved: usize,
}

impl Handoff {
    /// A hand-off to the worker `owner`, leasing for `lease`, holding at most `capacity`
    /// deliveries (waiting or reserved). It starts not caught up: the worker's first look at
    /// the store decides.
    pub fn new(owner: String, lease: Duration, capacity: usize) -> Handoff {
        Handoff {
            owner,
            lease,
            capacity: capacity.max(1),
            state: Mutex::new(Queue::default()),
            caught_up: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            wake: Arc::new(Notify::new()),
        }
    }

    /// Returns once deliveries were handed over since the last call (at once if some were
    /// meanwhile). The worker's dispatcher waits on it, apart from the signal for rows written
    /// due: a task of the worker may take a handed-over delivery first, and the dispatcher
    /// then has nothing to ask the store for.
    pub async fn handed(&self) {
        self.wake.notified().await;
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, Queue> {
        // The queue's state is a counter and a list; a panic elsewhere leaves both valid.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A lease for an ingest that queues at most `n` deliveries, if the worker is caught up
    /// and has room for them; `None` writes the ingest's deliveries due, as without a
    /// hand-off.
    pub fn reserve(self: &Arc<Self>, n: usize, now: Timestamp) -> Option<Reservation> {
        if n == 0 || !self.caught_up.load(Ordering::Relaxed) || self.closed.load(Ordering::Relaxed)
        {
            return None;
        }
        let mut queue = self.queue();
        if queue.waiting.len() + queue.reserved + n > self.capacity {
            return None;
        }
        queue.reserved += n;
        Some(Reservation {
            handoff: self.clone(),
            n,
            lease: IngestLease {
                owner: self.owner.clone(),
                until: now.plus(self.lease),
            },
        })
    }

    /// Up to `max` deliveries handed off, oldest first, each with at least half of its lease
    /// left at `now` (the others are left to run out, see the module docs).
    pub fn take(&self, max: usize, now: Timestamp) -> Vec<LeasedDelivery> {
        let half = self.lease / 2;
        let mut queue = self.queue();
        let mut taken = Vec::new();
        while taken.len() < max {
            let Some((delivery, until)) = queue.waiting.pop_front() else {
                break;
            };
            if now.plus(half) <= until {
                taken.push(delivery);
            }
        }
        taken
    }

    /// Tells whether the worker's last look at the store found no more due rows than it
    /// asked for.
    pub fn set_caught_up(&self, caught_up: bool) {
        self.caught_up.store(caught_up, Ordering::Relaxed);
    }

    /// Whether the worker's last look at the store found no more due rows than it asked for.
    pub fn caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Relaxed)
    }

    /// The worker stopped: no more reservations.
    pub fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
    }

    /// How many deliveries wait for the worker.
    pub fn waiting(&self) -> usize {
        self.queue().waiting.len()
    }
}

/// Room taken in a [`Handoff`] for one ingest's deliveries; given back when dropped.
pub struct Reservation {
    handoff: Arc<Handoff>,
    n: usize,
    /// What the ingest writes its deliveries with ([`Ingest::lease`]).
    pub lease: IngestLease,
}

impl Reservation {
    /// The ingest committed: its deliveries (as `outcome` says) wait for the worker, which is
    /// woken.
    pub fn fulfil(self, ingest: &Ingest, outcome: &IngestOutcome) {
        let leased = ingest.leased(outcome);
        if leased.is_empty() {
            return;
        }
        {
            let mut queue = self.handoff.queue();
            let until = self.lease.until;
            queue
                .waiting
                .extend(leased.into_iter().take(self.n).map(|d| (d, until)));
        }
        metrics::counter!("hooklatch_delivery_handoffs_total").increment(1);
        self.handoff.wake.notify_one();
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut queue = self.handoff.queue();
        queue.reserved = queue.reserved.saturating_sub(self.n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handoff(capacity: usize) -> Arc<Handoff> {
        Arc::new(Handoff::new(
            "w1".to_owned(),
            Duration::from_secs(60),
            capacity,
        ))
    }

    #[test]
    fn no_reservation_until_the_worker_is_caught_up_nor_after_it_stopped() {
        let h = handoff(4);
        let now = Timestamp(1_000_000);
        assert!(h.reserve(1, now).is_none(), "not caught up yet");
        h.set_caught_up(true);
        let r = h.reserve(1, now).expect("caught up, with room");
        assert_eq!(r.lease.owner, "w1");
        assert_eq!(r.lease.until, Timestamp(1_060_000));
        h.set_caught_up(false);
        assert!(h.reserve(1, now).is_none(), "a backlog: no hand-off");
        h.set_caught_up(true);
        h.close();
        assert!(h.reserve(1, now).is_none(), "stopped");
    }

    #[test]
    fn reservations_count_against_the_capacity_until_dropped() {
        let h = handoff(3);
        h.set_caught_up(true);
        let now = Timestamp(0);
        let a = h.reserve(2, now).expect("room for 2");
        assert!(h.reserve(2, now).is_none(), "2 + 2 > 3");
        let b = h.reserve(1, now).expect("room for 1 more");
        drop(a);
        let c = h.reserve(2, now).expect("room again");
        drop((b, c));
        assert!(h.reserve(0, now).is_none(), "nothing to hand off");
    }

    /// One event, new, queued for two destinations.
    fn accepted(received_at: Timestamp) -> (Ingest, IngestOutcome) {
        use hooklatch_core::store::{Claim, KeyDecision, NewEvent, RequestRecord};
        use hooklatch_core::{DeliveryId, EventKey, RequestId, SourceName};
        let ingest = Ingest {
            source: SourceName::parse("stripe").unwrap(),
            request: RequestRecord {
                received_at,
                source: "stripe".to_owned(),
                method: "POST".to_owned(),
                path: "/in/stripe".to_owned(),
                peer: None,
                headers: vec![("content-type".to_owned(), b"application/json".to_vec())],
                body: bytes::Bytes::from_static(b"{}"),
                body_truncated: false,
            },
            body_sha256: [0; 32],
            events: vec![NewEvent {
                key: EventKey::parse("evt_1").unwrap(),
                event_type: None,
                content_sha256: None,
            }],
            destinations: vec!["app".to_owned(), "audit".to_owned()],
            retention: Duration::from_secs(3600),
            keys: KeyDecision::Store,
            lease: None,
        };
        let outcome = IngestOutcome {
            request_id: RequestId(5),
            claims: vec![(
                EventKey::parse("evt_1").unwrap(),
                Claim::New {
                    deliveries: vec![DeliveryId(7), DeliveryId(8)],
                },
            )],
        };
        (ingest, outcome)
    }

    #[test]
    fn fulfilled_deliveries_are_taken_in_order_until_half_their_lease_is_gone() {
        let h = handoff(4);
        h.set_caught_up(true);
        let now = Timestamp(1_000_000);
        let (ingest, outcome) = accepted(now);
        let r = h.reserve(ingest.most_deliveries(), now).unwrap();
        r.fulfil(&ingest, &outcome);
        assert_eq!(h.waiting(), 2);
        let first = h.take(1, now);
        assert_eq!(first.len(), 1);
        assert_eq!(
            (
                first[0].id.0,
                first[0].destination.as_str(),
                first[0].attempts
            ),
            (7, "app", 0)
        );
        assert_eq!(first[0].idempotency_key.as_str(), "stripe:evt_1");
        assert!(
            h.take(4, now.plus(Duration::from_secs(31))).is_empty(),
            "less than half of the lease left: left to run out"
        );
        assert_eq!(h.waiting(), 0);
        assert!(h.reserve(4, now).is_some(), "the room came back");
    }
}
