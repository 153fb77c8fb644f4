//! A RabbitMQ consumer helper: the work runs once per `message_id`, however often the broker
//! redelivers the message.
//!
//! hooklatch publishes each delivery with `message_id` set to the `Idempotency-Key`. A consumer
//! killed between its work and its ack gets the message again (`redelivered = true`).
//! [`handle_once`] claims the `message_id` in a transaction, runs the work in that same
//! transaction, commits, and only then acknowledges:
//!
//! | what happens | the work | the message |
//! |---|---|---|
//! | first delivery, work succeeds | runs, committed with the claim | acked after the commit |
//! | redelivered duplicate ([`Claim::AlreadyDone`]) | skipped | acked |
//! | the work or the database fails | rolled back with the claim | nacked, requeued |
//! | no `message_id` | skipped | rejected without requeue (dead-lettered if configured) |
//!
//! A crash after the commit and before the ack redelivers the message, which is then a
//! duplicate: acked, not run again.
//!
//! ```no_run
//! use futures::StreamExt;
//! use hooklatch_guard::rabbitmq::handle_once;
//! use lapin::options::BasicConsumeOptions;
//! use lapin::types::FieldTable;
//!
//! # async fn run(channel: lapin::Channel, pool: sqlx::PgPool) -> Result<(), Box<dyn std::error::Error>> {
//! let mut consumer = channel
//!     .basic_consume("credits", "credit-service", BasicConsumeOptions::default(), FieldTable::default())
//!     .await?;
//! while let Some(delivery) = consumer.next().await {
//!     let delivery = delivery?;
//!     let body = delivery.data.clone();
//!     let outcome = handle_once(&pool, &delivery, |mut tx| async move {
//!         sqlx::query("INSERT INTO credits (payload) VALUES ($1)")
//!             .bind(body)
//!             .execute(&mut *tx)
//!             .await?;
//!         Ok::<_, sqlx::Error>(tx)
//!     })
//!     .await;
//!     if let Err(err) = outcome {
//!         eprintln!("message requeued: {err}");
//!     }
//! }
//! # Ok(())
//! # }
//! ```

use std::future::Future;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicRejectOptions};
use sqlx::{Pool, Transaction};

use crate::claim::{claim, Claim, GuardBackend};

/// What [`handle_once`] did with a message that it acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handled {
    /// The work ran and committed; the message was acked.
    Done,
    /// A duplicate: the work was skipped; the message was acked.
    Duplicate,
}

/// Why [`handle_once`] did not acknowledge a message (or could not).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandleError<E> {
    /// The message has no `message_id`: it was rejected without requeue.
    #[error("message has no message_id")]
    MissingMessageId,
    /// Claiming or committing failed: rolled back, the message was nacked and requeued.
    #[error("claiming message id in the database")]
    Database(#[source] sqlx::Error),
    /// The work failed: rolled back, the message was nacked and requeued.
    #[error("running the work")]
    Work(#[source] E),
    /// Acknowledging (or nacking) failed; the broker redelivers the message once the channel
    /// closes, and the redelivery is a duplicate if the work committed.
    #[error("acknowledging the message")]
    Ack(#[source] lapin::Error),
}

/// Runs `work` once per `message_id`: claims the id in a transaction from `pool`, hands the
/// transaction to `work` (which does its writes in it and gives it back), commits, then acks.
/// A duplicate is acked without calling `work`; a failure is nacked with requeue.
pub async fn handle_once<DB, F, Fut, E>(
    pool: &Pool<DB>,
    delivery: &Delivery,
    work: F,
) -> Result<Handled, HandleError<E>>
where
    DB: GuardBackend,
    F: FnOnce(Transaction<'static, DB>) -> Fut,
    Fut: Future<Output = Result<Transaction<'static, DB>, E>>,
{
    let Some(key) = delivery.properties.message_id().as_ref() else {
        let requeue = BasicRejectOptions { requeue: false };
        delivery
            .acker
            .reject(requeue)
            .await
            .map_err(HandleError::Ack)?;
        return Err(HandleError::MissingMessageId);
    };
    match run(pool, key.as_str(), work).await {
        Ok(handled) => {
            delivery
                .acker
                .ack(BasicAckOptions::default())
                .await
                .map_err(HandleError::Ack)?;
            Ok(handled)
        }
        Err(err) => {
            let requeue = BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            };
            delivery
                .acker
                .nack(requeue)
                .await
                .map_err(HandleError::Ack)?;
            Err(err)
        }
    }
}

/// The claim, the work and the commit, without touching the broker.
async fn run<DB, F, Fut, E>(pool: &Pool<DB>, key: &str, work: F) -> Result<Handled, HandleError<E>>
where
    DB: GuardBackend,
    F: FnOnce(Transaction<'static, DB>) -> Fut,
    Fut: Future<Output = Result<Transaction<'static, DB>, E>>,
{
    let mut tx = pool.begin().await.map_err(HandleError::Database)?;
    match claim(&mut tx, key).await.map_err(HandleError::Database)? {
        Claim::AlreadyDone => Ok(Handled::Duplicate),
        Claim::First => {
            let tx = work(tx).await.map_err(HandleError::Work)?;
            tx.commit().await.map_err(HandleError::Database)?;
            Ok(Handled::Done)
        }
    }
}
