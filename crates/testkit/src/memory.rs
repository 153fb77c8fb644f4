//! [`MemoryStore`]: the [`Store`] trait over plain maps, for tests of the layers above it.
//!
//! It follows the SQLite store's semantics rule for rule (claims, the outbox, leases, history,
//! purge, stats), and the conformance suite in [`crate::conformance`] holds both to the same
//! contract. Nothing here is durable: it is a test double, never a backend.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use hooklatch_core::store::{
    redelivery_key, verdict_of, AttemptNext, AttemptRecord, AttemptResult, AttemptToken, Claim,
    ConflictAction, ConflictDecision, DeliveryDetail, DeliveryFilter, DeliveryState,
    DisabledDestination, Dismissal, Ingest, IngestOutcome, KeyDecision, LeasedDelivery, NewEvent,
    Purged, Redelivery, Redrive, Rejected, RequestDetail, RequestFilter, RequestRecord,
    RequestSummary, StoreStats, Verdict, HELD,
};
use hooklatch_core::{DeliveryId, IdempotencyKey, RequestId, Store, StoreError, Timestamp};

/// An in-memory [`Store`]: the test double for everything above `core` (HTTP handlers,
/// delivery workers, maintenance).
///
/// Same contract as the SQLite store, checked by the same conformance suite: claims keyed by
/// source and key, replaced once expired; duplicate or conflict decided by the body's SHA-256;
/// one delivery per destination for each new event; leases that expire; history kept
/// byte-exact; purge and counts as SQLite does them. Ids start at 1 and grow, as SQLite's
/// `AUTOINCREMENT` rows do. Every call completes within its first poll, so a dropped future
/// has either done all of its work or none of it.
///
/// Build one with `MemoryStore::default()` and share it as an `Arc<dyn Store>`.
#[derive(Default)]
pub struct MemoryStore {
    // A std mutex, not tokio's: no call holds it across an await, and every critical section
    // is a few map operations, so blocking the executor thread for it is cheaper than the
    // bookkeeping of an async lock (the reasoning mini-redis gives for its `Db`).
    state: Mutex<State>,
}

/// Everything the store holds; the maps play the SQLite tables' parts.
#[derive(Default)]
struct State {
    last_request_id: i64,
    last_delivery_id: i64,
    /// By id, so iteration order is id order (newest last).
    requests: BTreeMap<i64, StoredRequest>,
    /// By `(source, key)`: the unique constraint that decides which copy of an event is first.
    claims: HashMap<(String, String), StoredClaim>,
    /// By id, newest last.
    deliveries: BTreeMap<i64, StoredDelivery>,
    /// By destination name.
    disabled: BTreeMap<String, DisabledDestination>,
}

struct StoredRequest {
    record: RequestRecord,
    verdict: Verdict,
    reason: Option<String>,
    status: u16,
    keys: Vec<String>,
    decision: Option<ConflictDecision>,
}

struct StoredClaim {
    body_sha256: [u8; 32],
    request_id: RequestId,
    claimed_at: Timestamp,
    expires_at: Timestamp,
}

struct StoredDelivery {
    request_id: RequestId,
    source: String,
    event_key: String,
    event_type: Option<String>,
    destination: String,
    idempotency_key: String,
    state: DeliveryState,
    /// Attempts in the current round (reset by a redrive).
    attempts: u32,
    round_started_at: Timestamp,
    next_attempt_at: Timestamp,
    lease: Option<Lease>,
    last_error: Option<String>,
    /// Every attempt over the delivery's life, numbered from 1.
    history: Vec<AttemptRecord>,
    /// The token of the last attempt recorded ([`AttemptToken`]).
    last_token: Option<AttemptToken>,
}

struct Lease {
    owner: String,
    until: Timestamp,
}

impl MemoryStore {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .expect("no code panics while holding the memory store's lock")
    }
}

impl State {
    fn insert_request(
        &mut self,
        record: RequestRecord,
        verdict: Verdict,
        reason: Option<String>,
        status: u16,
        keys: Vec<String>,
    ) -> RequestId {
        self.last_request_id += 1;
        let id = self.last_request_id;
        self.requests.insert(
            id,
            StoredRequest {
                record,
                verdict,
                reason,
                status,
                keys,
                decision: None,
            },
        );
        RequestId(id)
    }

    /// Claims one key unless a live claim holds it.
    fn claim(
        &mut self,
        ingest: &Ingest,
        event: &NewEvent,
        request_id: RequestId,
        now: Timestamp,
        expires_at: Timestamp,
    ) -> Claim {
        let claim_key = (
            ingest.source.as_str().to_owned(),
            event.key.as_str().to_owned(),
        );
        let held = self
            .claims
            .get(&claim_key)
            // A claim expired at or before now is as good as absent.
            .filter(|claim| claim.expires_at > now);
        let content = ingest.content_sha256(event);
        match held {
            Some(held) if held.body_sha256 == content => Claim::Duplicate {
                first_request: held.request_id,
                first_seen: held.claimed_at,
            },
            Some(held) => Claim::Conflict {
                first_request: held.request_id,
                first_body_sha256: held.body_sha256,
            },
            None => {
                self.claims.insert(
                    claim_key,
                    StoredClaim {
                        body_sha256: content,
                        request_id,
                        claimed_at: now,
                        expires_at,
                    },
                );
                Claim::New {
                    deliveries: self.queue(ingest, event, request_id, now),
                }
            }
        }
    }

    /// Queues one new event: a pending delivery per destination.
    fn queue(
        &mut self,
        ingest: &Ingest,
        event: &NewEvent,
        request_id: RequestId,
        now: Timestamp,
    ) -> Vec<DeliveryId> {
        let idempotency_key = IdempotencyKey::new(&ingest.source, &event.key);
        let mut deliveries = Vec::with_capacity(ingest.destinations.len());
        for destination in &ingest.destinations {
            self.last_delivery_id += 1;
            self.deliveries.insert(
                self.last_delivery_id,
                StoredDelivery {
                    request_id,
                    source: ingest.source.as_str().to_owned(),
                    event_key: event.key.as_str().to_owned(),
                    event_type: event.event_type.clone(),
                    destination: destination.clone(),
                    idempotency_key: idempotency_key.as_str().to_owned(),
                    state: DeliveryState::Pending,
                    attempts: 0,
                    round_started_at: now,
                    next_attempt_at: now,
                    lease: ingest.lease.as_ref().map(|l| Lease {
                        owner: l.owner.clone(),
                        until: l.until,
                    }),
                    last_error: None,
                    history: Vec::new(),
                    last_token: None,
                },
            );
            deliveries.push(DeliveryId(self.last_delivery_id));
        }
        deliveries
    }

    fn ingest(&mut self, ingest: Ingest) -> IngestOutcome {
        let now = ingest.request.received_at;
        let expires_at = now.plus(ingest.retention);
        let keys = ingest
            .events
            .iter()
            .map(|e| e.key.as_str().to_owned())
            .collect();
        // Accepted for now; corrected below once every claim is known, as SQLite does.
        let request_id =
            self.insert_request(ingest.request.clone(), Verdict::Accepted, None, 200, keys);
        let mut claims = Vec::with_capacity(ingest.events.len());
        for (i, event) in ingest.events.iter().enumerate() {
            let decided = match &ingest.keys {
                KeyDecision::Decided(decided) => decided.get(i).cloned(),
                KeyDecision::Store => None,
            };
            let claim = match decided {
                // An external key store decided: no claim of our own.
                Some(Claim::New { .. }) => Claim::New {
                    deliveries: self.queue(&ingest, event, request_id, now),
                },
                Some(earlier) => earlier,
                None => self.claim(&ingest, event, request_id, now, expires_at),
            };
            claims.push((event.key.clone(), claim));
        }
        let verdict = verdict_of(claims.iter().map(|(_, c)| c));
        if let Some(request) = self.requests.get_mut(&request_id.0) {
            request.verdict = verdict;
        }
        IngestOutcome { request_id, claims }
    }

    fn lease_due(
        &mut self,
        owner: &str,
        now: Timestamp,
        lease: Duration,
        limit: u32,
    ) -> Vec<LeasedDelivery> {
        let mut due: Vec<(Timestamp, i64)> = self
            .deliveries
            .iter()
            .filter(|(_, d)| {
                d.state == DeliveryState::Pending
                    && d.next_attempt_at <= now
                    && d.lease.as_ref().is_none_or(|l| l.until <= now)
            })
            .map(|(id, d)| (d.next_attempt_at, *id))
            .collect();
        due.sort_unstable();
        due.truncate(limit as usize);
        let until = now.plus(lease);
        let mut leased = Vec::with_capacity(due.len());
        for (_, id) in due {
            let delivery = self
                .deliveries
                .get_mut(&id)
                .expect("the id was just read from the map");
            delivery.lease = Some(Lease {
                owner: owner.to_owned(),
                until,
            });
            // A pending delivery's request is never purged, so it is always there.
            let (method, path, headers, body) = self
                .requests
                .get(&delivery.request_id.0)
                .map(|r| {
                    let record = &r.record;
                    let (method, path) = (record.method.clone(), record.path.clone());
                    (method, path, record.headers.clone(), record.body.clone())
                })
                .unwrap_or_default();
            leased.push(LeasedDelivery {
                id: DeliveryId(id),
                request_id: delivery.request_id,
                source: delivery.source.clone(),
                event_key: delivery.event_key.clone(),
                event_type: delivery.event_type.clone(),
                destination: delivery.destination.clone(),
                idempotency_key: IdempotencyKey::from_stored(delivery.idempotency_key.clone()),
                attempts: delivery.attempts,
                round_started_at: delivery.round_started_at,
                method,
                path,
                headers,
                body,
                lease_until: Some(until),
            });
        }
        leased
    }

    fn record_attempt(&mut self, result: AttemptResult) {
        // An unknown delivery (purged meanwhile) has nothing to move on.
        let Some(delivery) = self.deliveries.get_mut(&result.delivery.0) else {
            return;
        };
        // Under the attempt's own lease; an attempt that names none compares the owner alone.
        let movable = delivery.state == DeliveryState::Pending
            && match (&delivery.lease, result.lease_until) {
                (Some(lease), Some(until)) => lease.owner == result.owner && lease.until == until,
                (Some(lease), None) => lease.owner == result.owner,
                (None, until) => until.is_none(),
            };
        let (state, next_attempt_at) = match result.next {
            AttemptNext::Delivered => (DeliveryState::Delivered, None),
            AttemptNext::RetryAt(at) => (DeliveryState::Pending, Some(at)),
            AttemptNext::DeadLetter => (DeliveryState::Dead, None),
            AttemptNext::Wait(until) => {
                // Not attempted: no number, no history, no count; only the row is put off.
                if movable {
                    delivery.next_attempt_at = until;
                    delivery.lease = None;
                }
                return;
            }
        };
        // A repeat of the last attempt recorded (its first record's answer was lost).
        if delivery.last_token == Some(result.token) {
            return;
        }
        delivery.last_token = Some(result.token);
        delivery.history.push(AttemptRecord {
            number: delivery.history.len() as u32 + 1,
            started_at: result.started_at,
            status: result.status,
            latency_ms: result.latency.as_millis() as u64,
            error: result.error.clone(),
        });
        if !movable {
            return;
        }
        delivery.attempts += 1;
        delivery.lease = None;
        if result.error.is_some() {
            delivery.last_error = result.error;
        }
        delivery.state = state;
        if let Some(at) = next_attempt_at {
            delivery.next_attempt_at = at;
        }
    }

    fn wake_destination(&mut self, destination: &str, now: Timestamp) -> u64 {
        let mut moved = 0;
        for delivery in self.deliveries.values_mut() {
            if delivery.state == DeliveryState::Pending
                && delivery.destination == destination
                && delivery.next_attempt_at > now
                && delivery.lease.as_ref().is_none_or(|l| l.until <= now)
            {
                delivery.next_attempt_at = now;
                moved += 1;
            }
        }
        moved
    }

    fn release_leases(&mut self, owner: &str, now: Timestamp) {
        for delivery in self.deliveries.values_mut() {
            if delivery.state == DeliveryState::Pending
                && delivery
                    .lease
                    .as_ref()
                    .is_some_and(|l| l.owner == owner && l.until > now)
            {
                delivery.lease = None;
            }
        }
    }

    fn next_due(&self) -> Option<Timestamp> {
        // A leased row becomes leasable again when its lease ends, so it counts from then.
        self.deliveries
            .values()
            .filter(|d| d.state == DeliveryState::Pending)
            .map(|d| match &d.lease {
                Some(lease) => d.next_attempt_at.max(lease.until),
                None => d.next_attempt_at,
            })
            .min()
    }

    fn summary(id: i64, request: &StoredRequest) -> RequestSummary {
        RequestSummary {
            id: RequestId(id),
            received_at: request.record.received_at,
            source: request.record.source.clone(),
            verdict: request.verdict,
            reason: request.reason.clone(),
            status: request.status,
            keys: request.keys.clone(),
            body_len: request.record.body.len() as u64,
            decision: request.decision.clone(),
        }
    }

    fn list_requests(&self, filter: &RequestFilter) -> Vec<RequestSummary> {
        self.requests
            .iter()
            .rev()
            .filter(|(id, r)| {
                filter.source.as_ref().is_none_or(|s| r.record.source == *s)
                    && filter.verdict.is_none_or(|v| r.verdict == v)
                    && filter.key.as_ref().is_none_or(|k| r.keys.contains(k))
                    && filter.since.is_none_or(|t| r.record.received_at >= t)
                    && filter.until.is_none_or(|t| r.record.received_at < t)
                    && filter.before.is_none_or(|b| **id < b.0)
            })
            .take(filter.limit as usize)
            .map(|(id, r)| State::summary(*id, r))
            .collect()
    }

    fn delivery_detail(id: i64, delivery: &StoredDelivery) -> DeliveryDetail {
        DeliveryDetail {
            id: DeliveryId(id),
            request_id: delivery.request_id,
            destination: delivery.destination.clone(),
            idempotency_key: delivery.idempotency_key.clone(),
            state: delivery.state,
            attempts: delivery.attempts,
            next_attempt_at: (delivery.state == DeliveryState::Pending)
                .then_some(delivery.next_attempt_at),
            last_error: delivery.last_error.clone(),
            history: delivery.history.clone(),
        }
    }

    fn get_request(&self, id: RequestId) -> Option<RequestDetail> {
        let request = self.requests.get(&id.0)?;
        Some(RequestDetail {
            summary: State::summary(id.0, request),
            method: request.record.method.clone(),
            path: request.record.path.clone(),
            peer: request.record.peer.clone(),
            headers: request.record.headers.clone(),
            body: request.record.body.clone(),
            body_truncated: request.record.body_truncated,
            deliveries: self
                .deliveries
                .iter()
                .filter(|(_, d)| d.request_id == id)
                .map(|(id, d)| State::delivery_detail(*id, d))
                .collect(),
        })
    }

    fn list_deliveries(&self, filter: &DeliveryFilter) -> Vec<DeliveryDetail> {
        self.deliveries
            .iter()
            .rev()
            .filter(|(id, d)| {
                filter.state.is_none_or(|s| d.state == s)
                    && filter
                        .destination
                        .as_ref()
                        .is_none_or(|dest| d.destination == *dest)
                    && filter.before.is_none_or(|b| **id < b.0)
            })
            .take(filter.limit as usize)
            .map(|(id, d)| State::delivery_detail(*id, d))
            .collect()
    }

    fn redeliver(
        &mut self,
        request: RequestId,
        destinations: &[String],
        now: Timestamp,
    ) -> Redelivery {
        let Some(stored) = self.requests.get(&request.0) else {
            return Redelivery::NotFound;
        };
        if stored.keys.is_empty()
            || matches!(stored.verdict, Verdict::Rejected | Verdict::Handshake)
        {
            return Redelivery::NothingToRedeliver(stored.verdict);
        }
        if let Some(d) = stored
            .decision
            .as_ref()
            .filter(|d| d.action == ConflictAction::Dismissed)
        {
            return Redelivery::Dismissed(d.clone());
        }
        let source = stored.record.source.clone();
        let keys = stored.keys.clone();
        let verdict = stored.verdict;
        if verdict == Verdict::Conflict {
            let stored = self.requests.get_mut(&request.0).expect("found above");
            stored.decision.get_or_insert(ConflictDecision {
                action: ConflictAction::Released,
                at: now,
                reason: None,
            });
        }
        let mut queued = Vec::new();
        for key in keys {
            // The event type as the first delivery of this event recorded it.
            let event_type = self
                .deliveries
                .values()
                .find(|d| d.source == source && d.event_key == key)
                .and_then(|d| d.event_type.clone());
            for destination in destinations {
                self.last_delivery_id += 1;
                self.deliveries.insert(
                    self.last_delivery_id,
                    StoredDelivery {
                        request_id: request,
                        source: source.clone(),
                        event_key: key.clone(),
                        event_type: event_type.clone(),
                        destination: destination.clone(),
                        idempotency_key: redelivery_key(&source, &key, verdict, request),
                        state: DeliveryState::Pending,
                        attempts: 0,
                        round_started_at: now,
                        next_attempt_at: now,
                        lease: None,
                        last_error: None,
                        history: Vec::new(),
                        last_token: None,
                    },
                );
                queued.push(DeliveryId(self.last_delivery_id));
            }
        }
        Redelivery::Queued(queued)
    }

    fn redrive(&mut self, id: DeliveryId, now: Timestamp) -> Redrive {
        let Some(delivery) = self.deliveries.get_mut(&id.0) else {
            return Redrive::NotFound;
        };
        if delivery.state != DeliveryState::Dead {
            return Redrive::NotDead(delivery.state);
        }
        delivery.state = DeliveryState::Pending;
        delivery.attempts = 0;
        delivery.next_attempt_at = now;
        delivery.round_started_at = now;
        delivery.lease = None;
        Redrive::Queued
    }

    fn purge(&mut self, now: Timestamp, history_before: Timestamp) -> Purged {
        let n_claims = self.claims.len();
        self.claims.retain(|_, claim| claim.expires_at > now);
        let purged_claims = (n_claims - self.claims.len()) as u64;

        // Kept: requests still pointed at by a claim, and those with a delivery still to make
        // or dead-lettered (it stays until an operator retries it).
        let mut kept: HashSet<RequestId> = self.claims.values().map(|c| c.request_id).collect();
        kept.extend(
            self.deliveries
                .values()
                .filter(|d| matches!(d.state, DeliveryState::Pending | DeliveryState::Dead))
                .map(|d| d.request_id),
        );
        let purged: HashSet<i64> = self
            .requests
            .iter()
            .filter(|(id, r)| {
                r.record.received_at < history_before && !kept.contains(&RequestId(**id))
            })
            .map(|(id, _)| *id)
            .collect();
        for id in &purged {
            self.requests.remove(id);
        }
        self.deliveries
            .retain(|_, d| !purged.contains(&d.request_id.0));
        Purged {
            claims: purged_claims,
            requests: purged.len() as u64,
        }
    }

    fn stats(&self) -> StoreStats {
        let count = |state| {
            self.deliveries
                .values()
                .filter(|d| d.state == state)
                .count() as u64
        };
        StoreStats {
            pending: count(DeliveryState::Pending),
            dead: count(DeliveryState::Dead),
            claims: self.claims.len() as u64,
        }
    }
}

#[async_trait::async_trait]
impl Store for MemoryStore {
    async fn ingest(&self, ingest: Ingest) -> Result<IngestOutcome, StoreError> {
        Ok(self.state().ingest(ingest))
    }

    async fn record_rejection(&self, rejected: Rejected) -> Result<RequestId, StoreError> {
        Ok(self.state().insert_request(
            rejected.request,
            Verdict::Rejected,
            Some(rejected.code),
            rejected.status,
            Vec::new(),
        ))
    }

    async fn record_import(
        &self,
        request: RequestRecord,
        keys: Vec<String>,
    ) -> Result<RequestId, StoreError> {
        Ok(self
            .state()
            .insert_request(request, Verdict::Imported, None, 202, keys))
    }

    async fn record_handshake(
        &self,
        request: RequestRecord,
        status: u16,
    ) -> Result<RequestId, StoreError> {
        Ok(self
            .state()
            .insert_request(request, Verdict::Handshake, None, status, Vec::new()))
    }

    async fn lease_due(
        &self,
        owner: &str,
        now: Timestamp,
        lease: Duration,
        limit: u32,
    ) -> Result<Vec<LeasedDelivery>, StoreError> {
        Ok(self.state().lease_due(owner, now, lease, limit))
    }

    async fn record_attempt(&self, result: AttemptResult) -> Result<(), StoreError> {
        self.state().record_attempt(result);
        Ok(())
    }

    async fn release_leases(&self, owner: &str, now: Timestamp) -> Result<(), StoreError> {
        self.state().release_leases(owner, now);
        Ok(())
    }

    async fn wake_destination(&self, destination: &str, now: Timestamp) -> Result<u64, StoreError> {
        Ok(self.state().wake_destination(destination, now))
    }

    async fn disable_destination(&self, disabled: DisabledDestination) -> Result<bool, StoreError> {
        let mut state = self.state();
        if state.disabled.contains_key(&disabled.destination) {
            return Ok(false);
        }
        state
            .disabled
            .insert(disabled.destination.clone(), disabled);
        Ok(true)
    }

    async fn enable_destination(
        &self,
        destination: &str,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        let mut state = self.state();
        if state.disabled.remove(destination).is_none() {
            return Ok(None);
        }
        Ok(Some(state.wake_destination(destination, now)))
    }

    async fn disabled_destinations(&self) -> Result<Vec<DisabledDestination>, StoreError> {
        Ok(self.state().disabled.values().cloned().collect())
    }

    async fn wake_held(&self, now: Timestamp) -> Result<u64, StoreError> {
        let mut state = self.state();
        let state = &mut *state;
        let mut moved = 0;
        for delivery in state.deliveries.values_mut() {
            if delivery.state == DeliveryState::Pending
                && delivery.next_attempt_at >= HELD
                && delivery.lease.as_ref().is_none_or(|l| l.until <= now)
                && !state.disabled.contains_key(&delivery.destination)
            {
                delivery.next_attempt_at = now;
                moved += 1;
            }
        }
        Ok(moved)
    }

    async fn next_due(&self) -> Result<Option<Timestamp>, StoreError> {
        Ok(self.state().next_due())
    }

    async fn list_requests(
        &self,
        filter: RequestFilter,
    ) -> Result<Vec<RequestSummary>, StoreError> {
        Ok(self.state().list_requests(&filter))
    }

    async fn get_request(&self, id: RequestId) -> Result<Option<RequestDetail>, StoreError> {
        Ok(self.state().get_request(id))
    }

    async fn list_deliveries(
        &self,
        filter: DeliveryFilter,
    ) -> Result<Vec<DeliveryDetail>, StoreError> {
        Ok(self.state().list_deliveries(&filter))
    }

    async fn redeliver(
        &self,
        request: RequestId,
        destinations: Vec<String>,
        now: Timestamp,
    ) -> Result<Redelivery, StoreError> {
        Ok(self.state().redeliver(request, &destinations, now))
    }

    async fn dismiss_conflict(
        &self,
        request: RequestId,
        reason: Option<String>,
        now: Timestamp,
    ) -> Result<Dismissal, StoreError> {
        let mut state = self.state();
        let Some(stored) = state.requests.get_mut(&request.0) else {
            return Ok(Dismissal::NotFound);
        };
        if stored.verdict != Verdict::Conflict {
            return Ok(Dismissal::NotAConflict(stored.verdict));
        }
        if let Some(earlier) = &stored.decision {
            return Ok(Dismissal::Decided(earlier.clone()));
        }
        let decision = ConflictDecision {
            action: ConflictAction::Dismissed,
            at: now,
            reason,
        };
        stored.decision = Some(decision.clone());
        Ok(Dismissal::Dismissed(decision))
    }

    async fn undecided_conflicts(&self) -> Result<u64, StoreError> {
        Ok(self
            .state()
            .requests
            .values()
            .filter(|r| r.verdict == Verdict::Conflict && r.decision.is_none())
            .count() as u64)
    }

    async fn redrive(&self, id: DeliveryId, now: Timestamp) -> Result<Redrive, StoreError> {
        Ok(self.state().redrive(id, now))
    }

    async fn purge(&self, now: Timestamp, history_before: Timestamp) -> Result<Purged, StoreError> {
        Ok(self.state().purge(now, history_before))
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        Ok(self.state().stats())
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
