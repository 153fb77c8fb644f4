//! ticket-consumer: the end of a payment → ticket flow. hooklatch receives the provider's
//! payment webhook and publishes it to RabbitMQ; this consumer reads the queue and issues one
//! ticket per paid order — exactly one, although the message may arrive more than once.
//!
//! ```sh
//! ticket-consumer --amqp amqp://guest:guest@127.0.0.1:5672/%2f --queue payments \
//!   --db postgres://postgres@127.0.0.1:5432/tickets
//! ```
//!
//! **The order id** is the Stripe event's `data.object.id` (the paid invoice, e.g. `in_1Q…`).
//! **The idempotency key** is the message's `message_id`, which hooklatch sets to the
//! `Idempotency-Key` (`stripe:evt_…`): the same for every copy of one payment event.
//!
//! For each message, [`handle_once`] opens a transaction, claims the key in
//! `hooklatch_processed`, and only if the claim is new calls our work, which inserts the ticket
//! in that same transaction. It commits, then acks. So:
//!
//! - a duplicate (the provider retried, or the gateway published twice) is acked, no ticket;
//! - a crash after the commit but before the ack makes the broker redeliver the message
//!   (`redelivered = true`): the key is already claimed, so it is acked as a duplicate;
//! - a crash before the commit rolls back the claim and the ticket together: the redelivery
//!   issues it.
//!
//! One line per message on stdout, for scripts and tests to count:
//! `new <key>` or `duplicate <key>`, followed by ` redelivered` when the broker says so.
//!
//! The consumer outlives the broker: when the connection or channel is lost (a broker restart,
//! a network cut) it connects and consumes again, waiting 200 ms, then twice as long after each
//! failed attempt, up to 5 s. The messages it had not acked come back `redelivered`.
//!
//! `--exit-after-commit` simulates that crash: the first new message is committed, its line
//! printed, and the process exits with status 3 without acking.
#![forbid(unsafe_code)]

use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use futures::StreamExt;
use hooklatch_guard::ensure_table;
use hooklatch_guard::rabbitmq::{handle_once, HandleError, Handled};
use lapin::options::BasicRejectOptions;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, Consumer};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};

/// The exit status of `--exit-after-commit`.
const CRASH_EXIT_CODE: i32 = 3;

/// The first wait before reconnecting to RabbitMQ, doubled after each failed attempt.
const INITIAL_BACKOFF: Duration = Duration::from_millis(200);

/// The longest wait between reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

#[derive(Debug, Parser)]
#[command(
    name = "ticket-consumer",
    about = "An example RabbitMQ consumer: one ticket per paid order, however often it is delivered."
)]
struct Args {
    /// The broker: amqp://user:password@host:5672/%2f
    #[arg(long)]
    amqp: String,
    /// The queue to consume (bound to hooklatch's exchange).
    #[arg(long)]
    queue: String,
    /// The PostgreSQL database: postgres://…
    #[arg(long)]
    db: String,
    /// Exit (status 3) right after the first committed ticket, before acking: a simulated crash.
    #[arg(long)]
    exit_after_commit: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();

    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&args.db)
        .await
        .context("connecting to PostgreSQL")?;
    // `hooklatch_processed (key PRIMARY KEY, …)`: the guard's table of claimed keys.
    ensure_table(&pool).await?;
    // No unique constraint on `order_id` on purpose: the guard alone keeps tickets single.
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS tickets (\
            order_id TEXT NOT NULL, \
            idempotency_key TEXT NOT NULL, \
            issued_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )
    .execute(&pool)
    .await?;

    // The broker may restart, or the network drop: consume again on a new connection, waiting
    // a backoff (doubled after each failure, reset once consuming) between attempts. Unacked
    // messages of the lost connection are redelivered, and the guard acks them as duplicates
    // if their ticket committed.
    let mut backoff = INITIAL_BACKOFF;
    loop {
        let lost = consume(&args, &pool, &mut backoff).await;
        let why = match lost {
            Ok(()) => "the broker ended the consumer".to_owned(),
            Err(err) => format!("{err:#}"),
        };
        eprintln!(
            "ticket-consumer: {why}; reconnecting in {}ms",
            backoff.as_millis()
        );
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One connection's life: connects, consumes `--queue` and handles each message, until the
/// connection or the channel is lost. Resets `backoff` once consuming.
async fn consume(args: &Args, pool: &PgPool, backoff: &mut Duration) -> anyhow::Result<()> {
    let connection = Connection::connect(&args.amqp, ConnectionProperties::default())
        .await
        .context("connecting to RabbitMQ")?;
    let consumed = async {
        let channel = connection.create_channel().await?;
        // One unacked message at a time: simple to reason about, enough for an example.
        channel.basic_qos(1, BasicQosOptions::default()).await?;
        let consumer = channel
            .basic_consume(
                &args.queue,
                "ticket-consumer",
                BasicConsumeOptions::default(), // manual acks: handle_once acks after the commit
                FieldTable::default(),
            )
            .await
            .with_context(|| format!("consuming {}", args.queue))?;
        eprintln!("ticket-consumer: consuming {}", args.queue);
        *backoff = INITIAL_BACKOFF;
        handle_all(args, pool, consumer).await
    }
    .await;
    let _ = connection.close(200, "reconnecting").await;
    consumed
}

/// Handles the messages of `consumer` until it ends or fails.
async fn handle_all(args: &Args, pool: &PgPool, mut consumer: Consumer) -> anyhow::Result<()> {
    while let Some(delivery) = consumer.next().await {
        let delivery = delivery.context("receiving a message")?;
        let key = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string())
            .unwrap_or_default();
        let redelivered = if delivery.redelivered {
            " redelivered"
        } else {
            ""
        };
        let order_id = match order_id(&delivery.data) {
            Ok(order_id) => order_id,
            Err(err) => {
                // Not a payment we understand: reject without requeue (dead-lettered if the
                // queue has a dead-letter exchange), rather than redeliver it forever.
                eprintln!("ticket-consumer: {key}: {err:#}");
                delivery
                    .acker
                    .reject(BasicRejectOptions { requeue: false })
                    .await?;
                continue;
            }
        };
        let (key_ref, crash) = (key.as_str(), args.exit_after_commit);

        // Runs only when the key is claimed for the first time, inside the claim's transaction.
        let work = |mut tx: Transaction<'static, Postgres>| async move {
            sqlx::query("INSERT INTO tickets (order_id, idempotency_key) VALUES ($1, $2)")
                .bind(&order_id)
                .bind(key_ref)
                .execute(&mut *tx)
                .await?;
            if crash {
                // handle_once commits and acks back to back, with no hook in between, so the
                // simulated crash commits the claim and the ticket itself, then dies unacked.
                tx.commit().await?;
                println!("new {key_ref}{redelivered}");
                eprintln!("ticket-consumer: committed {key_ref}, exiting before the ack");
                std::process::exit(CRASH_EXIT_CODE);
            }
            Ok::<_, sqlx::Error>(tx)
        };

        match handle_once(pool, &delivery, work).await {
            Ok(Handled::Done) => println!("new {key}{redelivered}"),
            Ok(Handled::Duplicate) => println!("duplicate {key}{redelivered}"),
            // Rejected without requeue: not a hooklatch message.
            Err(HandleError::MissingMessageId) => eprintln!("ticket-consumer: no message_id"),
            // Nacked and requeued, or the ack failed with the connection: either way the
            // broker delivers it again, and a committed ticket makes that a duplicate.
            Err(err) => eprintln!("ticket-consumer: {key}: {:#}", anyhow::Error::new(err)),
        }
    }
    Ok(())
}

/// The order a payment event is for: the Stripe object's id (`data.object.id`).
fn order_id(body: &[u8]) -> anyhow::Result<String> {
    let event: serde_json::Value = serde_json::from_slice(body).context("the body is not JSON")?;
    event["data"]["object"]["id"]
        .as_str()
        .map(str::to_owned)
        .context("the event has no data.object.id")
}
