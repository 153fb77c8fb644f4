//! [`Counting`]: a [`Store`] or [`KeyStore`] wrapped so a test can tell which of its operations
//! a piece of code called, and how often (RELIABILITY.md T16: a forgery's only store call is its
//! history record). Every call is counted by the operation's name, then passed through.
//!
//! [`MemoryKeys`]: an in-memory [`KeyStore`] for the layers above it (Redis mode's ingest
//! without a Redis): claims with in-flight leases, all or none, done keys kept for good.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hooklatch_core::id::{EventKey, RequestId, SourceName};
use hooklatch_core::keys::{DoneKey, KeyClaim, KeyState, KeyStore, KeyStoreError};
use hooklatch_core::store::{
    AttemptResult, DeliveryDetail, DeliveryFilter, DisabledDestination, Dismissal, Ingest,
    IngestOutcome, LeasedDelivery, OutboxCounts, Purged, Redelivery, Redrive, Rejected,
    RequestDetail, RequestFilter, RequestRecord, RequestSummary, StoreStats,
};
use hooklatch_core::{DeliveryId, Store, StoreError, Timestamp};

/// `S` with every call counted by its operation's name, and, as a [`Store`], failing the calls
/// its faults pick ([`Counting::with_faults`]).
pub struct Counting<S> {
    inner: S,
    calls: Mutex<BTreeMap<&'static str, u64>>,
    faults: Option<Faults>,
}

/// Picks, by its operation's name, whether a store call fails and how.
pub type Faults = Box<dyn Fn(&'static str) -> Option<Fault> + Send + Sync>;

/// How a store call fails: before the store sees it, or after it did the work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Nothing reaches the store and nothing is done: the database away.
    Before,
    /// The store does the work, and its answer is lost: a connection cut after the commit.
    After,
}

impl<S> Counting<S> {
    /// Wraps `inner`; nothing counted yet.
    pub fn new(inner: S) -> Counting<S> {
        Counting {
            inner,
            calls: Mutex::default(),
            faults: None,
        }
    }

    /// Wraps `inner` with `faults` deciding, call by call, which store calls fail (each
    /// failure is [`StoreError::Unavailable`], as a lost database gives).
    pub fn with_faults(inner: S, faults: Faults) -> Counting<S> {
        Counting {
            faults: Some(faults),
            ..Counting::new(inner)
        }
    }

    /// Runs a store call's `work` unless the faults fail it first; fails it after if they say
    /// so.
    async fn call<T>(
        &self,
        operation: &'static str,
        work: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let fault = self.faults.as_ref().and_then(|faults| faults(operation));
        let lost =
            || StoreError::Unavailable(format!("{operation}: the store is away (a test's fault)"));
        match fault {
            None => work.await,
            Some(Fault::Before) => Err(lost()),
            Some(Fault::After) => {
                let _ = work.await;
                Err(lost())
            }
        }
    }

    /// Every operation called so far, with how many times.
    pub fn calls(&self) -> BTreeMap<&'static str, u64> {
        self.calls.lock().expect("calls lock").clone()
    }

    /// How many times `operation` was called.
    pub fn count(&self, operation: &str) -> u64 {
        self.calls().get(operation).copied().unwrap_or(0)
    }

    /// Forgets the counts so far.
    pub fn reset(&self) {
        self.calls.lock().expect("calls lock").clear();
    }

    /// The wrapped value.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    fn hit(&self, operation: &'static str) -> &S {
        *self
            .calls
            .lock()
            .expect("calls lock")
            .entry(operation)
            .or_default() += 1;
        &self.inner
    }
}

#[async_trait::async_trait]
impl<S: Store> Store for Counting<S> {
    async fn ingest(&self, ingest: Ingest) -> Result<IngestOutcome, StoreError> {
        self.call("ingest", self.hit("ingest").ingest(ingest)).await
    }

    async fn record_rejection(&self, rejected: Rejected) -> Result<RequestId, StoreError> {
        self.call(
            "record_rejection",
            self.hit("record_rejection").record_rejection(rejected),
        )
        .await
    }

    async fn record_import(
        &self,
        request: RequestRecord,
        keys: Vec<String>,
    ) -> Result<RequestId, StoreError> {
        self.call(
            "record_import",
            self.hit("record_import").record_import(request, keys),
        )
        .await
    }

    async fn record_handshake(
        &self,
        request: RequestRecord,
        status: u16,
    ) -> Result<RequestId, StoreError> {
        self.call(
            "record_handshake",
            self.hit("record_handshake")
                .record_handshake(request, status),
        )
        .await
    }

    async fn lease_due(
        &self,
        owner: &str,
        now: Timestamp,
        lease: Duration,
        limit: u32,
    ) -> Result<Vec<LeasedDelivery>, StoreError> {
        self.call(
            "lease_due",
            self.hit("lease_due").lease_due(owner, now, lease, limit),
        )
        .await
    }

    async fn record_attempt(&self, result: AttemptResult) -> Result<(), StoreError> {
        self.call(
            "record_attempt",
            self.hit("record_attempt").record_attempt(result),
        )
        .await
    }

    async fn record_attempt_and_lease(
        &self,
        result: AttemptResult,
        now: Timestamp,
        lease: Duration,
    ) -> Result<Option<LeasedDelivery>, StoreError> {
        self.call(
            "record_attempt_and_lease",
            self.hit("record_attempt_and_lease")
                .record_attempt_and_lease(result, now, lease),
        )
        .await
    }

    async fn release_leases(&self, owner: &str, now: Timestamp) -> Result<(), StoreError> {
        self.call(
            "release_leases",
            self.hit("release_leases").release_leases(owner, now),
        )
        .await
    }

    async fn wake_destination(&self, destination: &str, now: Timestamp) -> Result<u64, StoreError> {
        self.call(
            "wake_destination",
            self.hit("wake_destination")
                .wake_destination(destination, now),
        )
        .await
    }

    async fn disable_destination(&self, disabled: DisabledDestination) -> Result<bool, StoreError> {
        self.call(
            "disable_destination",
            self.hit("disable_destination")
                .disable_destination(disabled),
        )
        .await
    }

    async fn enable_destination(
        &self,
        destination: &str,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.call(
            "enable_destination",
            self.hit("enable_destination")
                .enable_destination(destination, now),
        )
        .await
    }

    async fn disabled_destinations(&self) -> Result<Vec<DisabledDestination>, StoreError> {
        self.call(
            "disabled_destinations",
            self.hit("disabled_destinations").disabled_destinations(),
        )
        .await
    }

    async fn wake_held(&self, now: Timestamp) -> Result<u64, StoreError> {
        self.call("wake_held", self.hit("wake_held").wake_held(now))
            .await
    }

    async fn next_due(&self) -> Result<Option<Timestamp>, StoreError> {
        self.call("next_due", self.hit("next_due").next_due()).await
    }

    async fn list_requests(
        &self,
        filter: RequestFilter,
    ) -> Result<Vec<RequestSummary>, StoreError> {
        self.call(
            "list_requests",
            self.hit("list_requests").list_requests(filter),
        )
        .await
    }

    async fn get_request(&self, id: RequestId) -> Result<Option<RequestDetail>, StoreError> {
        self.call("get_request", self.hit("get_request").get_request(id))
            .await
    }

    async fn list_deliveries(
        &self,
        filter: DeliveryFilter,
    ) -> Result<Vec<DeliveryDetail>, StoreError> {
        self.call(
            "list_deliveries",
            self.hit("list_deliveries").list_deliveries(filter),
        )
        .await
    }

    async fn redrive(&self, id: DeliveryId, now: Timestamp) -> Result<Redrive, StoreError> {
        self.call("redrive", self.hit("redrive").redrive(id, now))
            .await
    }

    async fn redeliver(
        &self,
        request: RequestId,
        destinations: Vec<String>,
        now: Timestamp,
    ) -> Result<Redelivery, StoreError> {
        self.call(
            "redeliver",
            self.hit("redeliver").redeliver(request, destinations, now),
        )
        .await
    }

    async fn dismiss_conflict(
        &self,
        request: RequestId,
        reason: Option<String>,
        now: Timestamp,
    ) -> Result<Dismissal, StoreError> {
        self.call(
            "dismiss_conflict",
            self.hit("dismiss_conflict")
                .dismiss_conflict(request, reason, now),
        )
        .await
    }

    async fn undecided_conflicts(&self) -> Result<u64, StoreError> {
        self.call(
            "undecided_conflicts",
            self.hit("undecided_conflicts").undecided_conflicts(),
        )
        .await
    }

    async fn purge(&self, now: Timestamp, history_before: Timestamp) -> Result<Purged, StoreError> {
        self.call("purge", self.hit("purge").purge(now, history_before))
            .await
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        self.call("stats", self.hit("stats").stats()).await
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError> {
        self.call("outbox_counts", self.hit("outbox_counts").outbox_counts())
            .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call("ping", self.hit("ping").ping()).await
    }
}

#[async_trait::async_trait]
impl<K: KeyStore> KeyStore for Counting<K> {
    async fn claim(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        lease: Duration,
    ) -> Result<KeyClaim, KeyStoreError> {
        self.hit("claim").claim(source, keys, lease).await
    }

    async fn complete(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        token: &str,
        done: DoneKey,
        retention: Duration,
    ) -> Result<usize, KeyStoreError> {
        self.hit("complete")
            .complete(source, keys, token, done, retention)
            .await
    }

    async fn release(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        token: &str,
    ) -> Result<(), KeyStoreError> {
        self.hit("release").release(source, keys, token).await
    }

    async fn ping(&self) -> Result<(), KeyStoreError> {
        self.hit("ping").ping().await
    }
}

/// One key in [`MemoryKeys`].
enum Held {
    InFlight { token: String, until: Instant },
    Done(DoneKey),
}

/// An in-memory [`KeyStore`]: all-or-none claims with in-flight leases, as Redis mode's are;
/// done keys are kept for good (retention is not modelled).
#[derive(Default)]
pub struct MemoryKeys {
    keys: Mutex<HashMap<(String, String), Held>>,
    tokens: AtomicU64,
}

fn slot(source: &SourceName, key: &EventKey) -> (String, String) {
    (source.to_string(), key.to_string())
}

#[async_trait::async_trait]
impl KeyStore for MemoryKeys {
    async fn claim(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        lease: Duration,
    ) -> Result<KeyClaim, KeyStoreError> {
        let now = Instant::now();
        let mut held = self.keys.lock().expect("keys lock");
        for key in keys {
            if let Some(Held::InFlight { until, .. }) = held.get(&slot(source, key)) {
                if *until > now {
                    return Ok(KeyClaim::InFlight {
                        retry_after: *until - now,
                    });
                }
            }
        }
        let token = format!("t{}", self.tokens.fetch_add(1, Ordering::Relaxed));
        let states = keys
            .iter()
            .map(|key| match held.get(&slot(source, key)) {
                Some(Held::Done(done)) => KeyState::Done(*done),
                _ => {
                    let claim = Held::InFlight {
                        token: token.clone(),
                        until: now + lease,
                    };
                    held.insert(slot(source, key), claim);
                    KeyState::Claimed
                }
            })
            .collect();
        Ok(KeyClaim::Decided {
            token,
            keys: states,
        })
    }

    async fn complete(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        token: &str,
        done: DoneKey,
        _retention: Duration,
    ) -> Result<usize, KeyStoreError> {
        let mut held = self.keys.lock().expect("keys lock");
        let mut completed = 0;
        for key in keys {
            let slot = slot(source, key);
            if matches!(held.get(&slot), Some(Held::InFlight { token: t, .. }) if t == token) {
                held.insert(slot, Held::Done(done));
                completed += 1;
            }
        }
        Ok(completed)
    }

    async fn release(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        token: &str,
    ) -> Result<(), KeyStoreError> {
        let mut held = self.keys.lock().expect("keys lock");
        for key in keys {
            let slot = slot(source, key);
            if matches!(held.get(&slot), Some(Held::InFlight { token: t, .. }) if t == token) {
                held.remove(&slot);
            }
        }
        Ok(())
    }

    async fn ping(&self) -> Result<(), KeyStoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn source() -> SourceName {
        SourceName::parse("stripe").expect("a source name")
    }

    fn key(k: &str) -> EventKey {
        EventKey::parse(k).expect("an event key")
    }

    /// Claims are all or none, a held key refuses another claim until its lease runs out, a
    /// completed key is done for every later claim, and each call is counted.
    #[tokio::test]
    async fn memory_keys_claim_all_or_none_and_every_call_is_counted() {
        let keys = Counting::new(MemoryKeys::default());
        let lease = Duration::from_secs(30);
        let KeyClaim::Decided { token, keys: got } =
            keys.claim(&source(), &[key("a")], lease).await.unwrap()
        else {
            panic!("the first claim decides");
        };
        assert_eq!(got, vec![KeyState::Claimed]);
        assert!(matches!(
            keys.claim(&source(), &[key("b"), key("a")], lease)
                .await
                .unwrap(),
            KeyClaim::InFlight { .. }
        ));
        // Nothing was claimed by the refused call: "b" is free.
        let KeyClaim::Decided { keys: got, .. } =
            keys.claim(&source(), &[key("b")], lease).await.unwrap()
        else {
            panic!("b is free");
        };
        assert_eq!(got, vec![KeyState::Claimed]);
        let done = DoneKey {
            first_request: RequestId(7),
            first_seen: Timestamp(1),
            body_sha256: [0; 32],
        };
        assert_eq!(
            keys.complete(&source(), &[key("a")], &token, done, lease)
                .await
                .unwrap(),
            1
        );
        let KeyClaim::Decided { keys: got, .. } =
            keys.claim(&source(), &[key("a")], lease).await.unwrap()
        else {
            panic!("a is done");
        };
        assert_eq!(got, vec![KeyState::Done(done)]);
        assert_eq!(keys.count("claim"), 4);
        assert_eq!(keys.count("complete"), 1);
        assert_eq!(keys.count("release"), 0);
        keys.reset();
        assert!(keys.calls().is_empty());
    }
}
