//! hooklatch-core: the part of hooklatch that does no I/O.
//!
//! A webhook arrives, its provider adapter verifies it and extracts the provider's stable
//! event key(s); a [`Store`] then claims each key and queues its deliveries in one durable
//! transaction; workers deliver with a [`RetryPolicy`]. This crate holds the types those steps
//! speak in and the traits the backends implement. It takes "now" as an argument everywhere,
//! so expiry and backoff are testable without sleeping.
//!
//! Layout:
//! - [`headers`]: the byte-exact encoding stores keep request headers in.
//! - [`id`]: validated newtypes for names, keys and row ids.
//! - [`time`]: [`Timestamp`], milliseconds since the Unix epoch.
//! - [`secret`]: [`Secret`], a signing key that never prints, and constant-time MAC checks.
//! - [`provider`]: the [`ProviderAdapter`] trait and the Stripe, GitHub, Standard Webhooks and
//!   generic adapters (verify, extract keys, sign test events).
//! - [`retry`]: [`RetryPolicy`], exponential backoff with jitter and `Retry-After`.
//! - [`store`]: the [`Store`] trait and the records it takes and returns, including [`Claim`].
//! - [`tls`]: the TLS files (a CA, a client certificate) of the gateway's connections to its
//!   broker and key store.
//!
//! Meant for reuse: embedders verify provider webhooks with [`provider`] alone.
#![forbid(unsafe_code)]

pub mod crash;
pub mod headers;
pub mod id;
pub mod keys;
pub mod netguard;
pub mod provider;
pub mod retry;
pub mod secret;
pub mod store;
pub mod time;
pub mod tls;

pub use id::{DeliveryId, EventKey, IdempotencyKey, NameError, RequestId, SourceName};
pub use keys::{KeyStore, KeyStoreError};
pub use provider::{ExtractedEvent, InboundRequest, ProviderAdapter, ProviderReply, Rejection};
pub use retry::RetryPolicy;
pub use secret::Secret;
pub use store::{Claim, KeyDecision, Store, StoreError};
pub use time::Timestamp;
