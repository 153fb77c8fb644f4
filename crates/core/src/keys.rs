//! The [`KeyStore`] trait: an external home for idempotency keys (Redis mode).
//!
//! In the default SQL mode the store claims each key in the ingest transaction and nothing here
//! is used. A deployment that chooses an external key store claims keys there first, with a
//! short in-flight lease; only when every key of a request is claimed (or already done) does
//! the gateway write the request and its outbox rows to the store
//! ([`KeyDecision::Decided`](crate::store::KeyDecision)); then it marks the claimed keys done
//! for the source's retention. A copy that arrives while a key is still in flight is refused
//! with 409 and `Retry-After`, never answered 2xx before the first copy is safely queued.
//!
//! The gateway runs claim → ingest → complete in a task of its own, so a provider hanging up
//! mid-request cannot stop it between the commit and marking the key done.

use std::time::Duration;

use crate::id::{EventKey, RequestId, SourceName};
use crate::time::Timestamp;

/// The key store could not answer; the gateway answers 503 and the provider retries.
#[derive(Debug, Clone, thiserror::Error)]
#[error("key store unavailable: {0}")]
pub struct KeyStoreError(pub String);

/// What an earlier, finished claim recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoneKey {
    /// The request that queued the event.
    pub first_request: RequestId,
    /// When that request arrived.
    pub first_seen: Timestamp,
    /// The SHA-256 of that request's body, to tell a duplicate from a conflict.
    pub body_sha256: [u8; 32],
}

/// One key's state after [`KeyStore::claim`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    /// Claimed by this call, with its in-flight lease.
    Claimed,
    /// Finished earlier: a duplicate or a conflict of that request.
    Done(DoneKey),
}

/// The outcome of claiming the keys of one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyClaim {
    /// Another request holds at least one of the keys in flight: nothing was claimed.
    InFlight {
        /// When the holder's lease runs out, if it never finishes.
        retry_after: Duration,
    },
    /// Every key is claimed by this call or done earlier, one state per key in order.
    Decided {
        /// This claim's lease token, for [`KeyStore::complete`] and [`KeyStore::release`].
        token: String,
        /// One state per key.
        keys: Vec<KeyState>,
    },
}

/// Where idempotency keys live when they do not live in the store.
#[async_trait::async_trait]
pub trait KeyStore: Send + Sync + 'static {
    /// Claims every key of one request on `source` for `lease`, all or none: if any key is
    /// held in flight by another request nothing is claimed. Keys must be distinct.
    async fn claim(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        lease: Duration,
    ) -> Result<KeyClaim, KeyStoreError>;

    /// Marks keys this `token` claimed as done for `retention`. Returns how many were still
    /// held by the token (fewer means a lease ran out before the request was queued).
    async fn complete(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        token: &str,
        done: DoneKey,
        retention: Duration,
    ) -> Result<usize, KeyStoreError>;

    /// Gives up keys this `token` claimed (the request could not be queued).
    async fn release(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        token: &str,
    ) -> Result<(), KeyStoreError>;

    /// Answers when reachable.
    async fn ping(&self) -> Result<(), KeyStoreError>;
}
