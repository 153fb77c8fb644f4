//! The application side of [hooklatch](https://github.com/hooklatch/hooklatch): effects once,
//! although delivery is at least once.
//!
//! hooklatch delivers every event with `Idempotency-Key: {source}:{event key}`, the same on
//! every attempt and redrive, and (with a destination `secret`) a Standard Webhooks signature.
//! A crash after your handler answered delivers again, so the handler must make its effect
//! once. This crate is that guard:
//!
//! - [`claim`] the key inside the transaction that does your business write (PostgreSQL and
//!   SQLite, through sqlx): [`Claim::First`] → do the work and commit; [`Claim::AlreadyDone`]
//!   → skip it and answer 200. The key and the effect commit together or not at all.
//! - [`VerifiedDelivery`] (feature `axum`), an extractor that checks the gateway's signature
//!   and yields the `Idempotency-Key` and the raw body, or answers 401.
//! - [`rabbitmq::handle_once`] (feature `rabbitmq`) runs a consumer's work once per
//!   `message_id` and acknowledges a redelivered duplicate without running it again.
//!
//! Features (all on by default): `postgres`, `sqlite`, `axum`, `rabbitmq`.
//!
//! # Claim in your own transaction
//!
//! ```
//! use hooklatch_guard::{claim, ensure_table, Claim};
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), sqlx::Error> {
//! let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
//! ensure_table(&pool).await?;
//! sqlx::query("CREATE TABLE credits (invoice TEXT, cents INTEGER)").execute(&pool).await?;
//!
//! for _attempt in 0..3 {
//!     let mut tx = pool.begin().await?;
//!     match claim(&mut tx, "stripe:evt_1").await? {
//!         Claim::First => {
//!             sqlx::query("INSERT INTO credits VALUES ('in_1', 500)").execute(&mut *tx).await?;
//!             tx.commit().await?;
//!         }
//!         Claim::AlreadyDone => {} // dropping `tx` rolls it back; answer 200
//!     }
//! }
//! let credits: i64 = sqlx::query_scalar("SELECT count(*) FROM credits").fetch_one(&pool).await?;
//! assert_eq!(credits, 1);
//! # Ok(())
//! # }
//! ```
//!
//! # Verify the gateway's signature (axum)
//!
//! ```
//! # #[cfg(feature = "axum")] {
//! use axum::{routing::post, Router};
//! use hooklatch_core::Secret;
//! use hooklatch_guard::{GuardConfig, VerifiedDelivery};
//!
//! async fn webhook(delivery: VerifiedDelivery) -> &'static str {
//!     // claim(&mut tx, &delivery.idempotency_key), then parse `delivery.body`.
//!     let _ = (delivery.idempotency_key, delivery.body);
//!     "ok"
//! }
//!
//! // The destination's `secret` in hooklatch's config.
//! let config = GuardConfig::new(Secret::from_text("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"));
//! let app: Router = Router::new().route("/webhooks", post(webhook)).with_state(config);
//! # let _ = app; }
//! ```
//!
//! The state can be your own struct, as long as `GuardConfig: FromRef<YourState>`
//! (`#[derive(FromRef)]` or a manual impl).
//!
//! # RabbitMQ
//!
//! See [`rabbitmq`] (feature `rabbitmq`): hooklatch sets each message's `message_id` to the
//! `Idempotency-Key`, and [`rabbitmq::handle_once`] claims it around your work.
#![warn(missing_docs)]
#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_auto_cfg))]

mod claim;
#[cfg(feature = "axum")]
pub mod delivery;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;

pub use claim::{claim, ensure_table, Claim, GuardBackend, TABLE};
#[cfg(feature = "axum")]
pub use delivery::{GuardConfig, GuardRejection, VerifiedDelivery};
