//! `rabbitmq::handle_once` against a real broker at `HOOKLATCH_TEST_AMQP_URL`
//! (e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`), with SQLite as the application's database.
//! Without it the tests print `skipped` (and fail when `CI` is set). Each test uses its own
//! queue and deletes it.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use hooklatch_guard::rabbitmq::{handle_once, HandleError, Handled};
use hooklatch_guard::{claim, ensure_table, Claim};
use hooklatch_testkit::amqp::broker_url;
use lapin::message::Delivery;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer};
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::SqlitePool;

async fn database(dir: &tempfile::TempDir) -> SqlitePool {
    let path = dir.path().join("app.db");
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
        .expect("sqlite url")
        .create_if_missing(true);
    let pool = SqlitePool::connect_with(options).await.expect("sqlite");
    ensure_table(&pool).await.expect("guard table");
    sqlx::query("CREATE TABLE credits (payload BLOB NOT NULL)")
        .execute(&pool)
        .await
        .expect("credits table");
    pool
}

async fn credits(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM credits")
        .fetch_one(pool)
        .await
        .expect("counting credits")
}

/// A channel with a fresh queue, and a consumer on it.
async fn queue(url: &str, name: &str) -> (Connection, Channel, Consumer) {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .expect("connecting to the test broker");
    let channel = connection.create_channel().await.expect("a channel");
    channel
        .queue_declare(name, QueueDeclareOptions::default(), FieldTable::default())
        .await
        .expect("declaring the queue");
    channel
        .basic_qos(1, BasicQosOptions::default())
        .await
        .expect("prefetch 1");
    let consumer = channel
        .basic_consume(
            name,
            "guard-test",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consuming");
    (connection, channel, consumer)
}

async fn publish(channel: &Channel, queue: &str, message_id: &str, payload: &[u8]) {
    channel
        .basic_publish(
            "",
            queue,
            BasicPublishOptions::default(),
            payload,
            BasicProperties::default().with_message_id(message_id.into()),
        )
        .await
        .expect("publishing")
        .await
        .expect("publisher confirm");
}

async fn next(consumer: &mut Consumer) -> Delivery {
    tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("a delivery within 10 s")
        .expect("the consumer is open")
        .expect("a delivery")
}

/// Messages still in the queue (ready), read on a new channel after `channel` closed.
async fn remaining(connection: &Connection, name: &str) -> u32 {
    let channel = connection.create_channel().await.expect("a channel");
    let queue = channel
        .queue_declare(
            name,
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("inspecting the queue");
    channel
        .queue_delete(name, QueueDeleteOptions::default())
        .await
        .expect("deleting the queue");
    queue.message_count()
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// The work: one credit row, and a count of how often it ran.
async fn credit(
    mut tx: sqlx::Transaction<'static, sqlx::Sqlite>,
    payload: Vec<u8>,
    runs: &AtomicUsize,
) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error> {
    runs.fetch_add(1, Ordering::SeqCst);
    sqlx::query("INSERT INTO credits (payload) VALUES (?1)")
        .bind(payload)
        .execute(&mut *tx)
        .await?;
    Ok(tx)
}

#[tokio::test]
async fn a_message_published_twice_runs_the_work_once_and_both_are_acked() {
    let Some(url) = broker_url() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = database(&dir).await;
    let name = unique("hooklatch-guard-twice");
    let (connection, channel, mut consumer) = queue(&url, &name).await;
    publish(&channel, &name, "stripe:evt_1", b"credit 500").await;
    publish(&channel, &name, "stripe:evt_1", b"credit 500").await;

    let runs = AtomicUsize::new(0);
    let mut outcomes = Vec::new();
    for _ in 0..2 {
        let delivery = next(&mut consumer).await;
        let payload = delivery.data.clone();
        let outcome = handle_once(&pool, &delivery, |tx| credit(tx, payload, &runs))
            .await
            .expect("handled");
        outcomes.push(outcome);
    }
    assert_eq!(outcomes, [Handled::Done, Handled::Duplicate]);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(credits(&pool).await, 1);

    channel.close(200, "done").await.expect("closing");
    assert_eq!(remaining(&connection, &name).await, 0, "both were acked");
}

#[tokio::test]
async fn a_crash_between_commit_and_ack_is_acked_as_a_duplicate() {
    let Some(url) = broker_url() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = database(&dir).await;
    let name = unique("hooklatch-guard-crash");
    let (connection, channel, mut consumer) = queue(&url, &name).await;
    publish(&channel, &name, "stripe:evt_2", b"credit 700").await;

    // The consumer claims and commits its work, then dies before acking.
    let delivery = next(&mut consumer).await;
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "stripe:evt_2").await.expect("claim"),
        Claim::First
    );
    let tx = credit(tx, delivery.data.clone(), &AtomicUsize::new(0))
        .await
        .expect("work");
    tx.commit().await.expect("commit");
    channel.close(200, "crash").await.expect("closing");

    // A new consumer gets the redelivery and acks it without running the work again.
    let (_connection, channel, mut consumer) = queue(&url, &name).await;
    let delivery = next(&mut consumer).await;
    assert!(delivery.redelivered);
    let runs = AtomicUsize::new(0);
    let payload = delivery.data.clone();
    let outcome = handle_once(&pool, &delivery, |tx| credit(tx, payload, &runs))
        .await
        .expect("handled");
    assert_eq!(outcome, Handled::Duplicate);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(credits(&pool).await, 1);

    channel.close(200, "done").await.expect("closing");
    assert_eq!(
        remaining(&connection, &name).await,
        0,
        "the duplicate was acked"
    );
}

#[tokio::test]
async fn failed_work_is_rolled_back_and_requeued() {
    let Some(url) = broker_url() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = database(&dir).await;
    let name = unique("hooklatch-guard-fail");
    let (connection, channel, mut consumer) = queue(&url, &name).await;
    publish(&channel, &name, "stripe:evt_3", b"credit 900").await;

    let delivery = next(&mut consumer).await;
    let outcome = handle_once(&pool, &delivery, |mut tx| async move {
        sqlx::query("INSERT INTO credits (payload) VALUES (x'00')")
            .execute(&mut *tx)
            .await?;
        Err::<sqlx::Transaction<'static, sqlx::Sqlite>, _>(sqlx::Error::RowNotFound)
    })
    .await;
    assert!(matches!(outcome, Err(HandleError::Work(_))), "{outcome:?}");
    assert_eq!(credits(&pool).await, 0, "rolled back with the claim");

    let delivery = next(&mut consumer).await;
    assert!(delivery.redelivered, "requeued");
    let runs = AtomicUsize::new(0);
    let payload = delivery.data.clone();
    let outcome = handle_once(&pool, &delivery, |tx| credit(tx, payload, &runs))
        .await
        .expect("handled");
    assert_eq!(
        outcome,
        Handled::Done,
        "the key was not claimed by the failure"
    );
    assert_eq!(credits(&pool).await, 1);

    channel.close(200, "done").await.expect("closing");
    assert_eq!(remaining(&connection, &name).await, 0);
}
