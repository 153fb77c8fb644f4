//! `claim` on SQLite, in a temporary database file.

#![cfg(feature = "sqlite")]

use std::str::FromStr;

use hooklatch_guard::{claim, ensure_table, Claim};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::SqlitePool;

async fn pool(dir: &tempfile::TempDir) -> SqlitePool {
    let path = dir.path().join("app.db");
    let options = SqliteConnectOptions::from_str(&format!("sqlite://{}", path.display()))
        .expect("sqlite url")
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal);
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .expect("opening the sqlite file");
    ensure_table(&pool).await.expect("creating the table");
    ensure_table(&pool)
        .await
        .expect("ensure_table is idempotent");
    sqlx::query("CREATE TABLE credits (key TEXT NOT NULL)")
        .execute(&pool)
        .await
        .expect("creating credits");
    pool
}

async fn credits(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM credits")
        .fetch_one(pool)
        .await
        .expect("counting credits")
}

#[tokio::test]
async fn first_then_already_done() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool(&dir).await;

    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "src:evt_1").await.expect("claim"),
        Claim::First
    );
    tx.commit().await.expect("commit");

    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "src:evt_1").await.expect("claim"),
        Claim::AlreadyDone
    );
    assert_eq!(
        claim(&mut tx, "src:evt_2").await.expect("claim"),
        Claim::First,
        "another key is independent"
    );
}

#[tokio::test]
async fn a_rolled_back_claim_leaves_the_key_unclaimed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool(&dir).await;

    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "src:evt_1").await.expect("claim"),
        Claim::First
    );
    sqlx::query("INSERT INTO credits VALUES ('src:evt_1')")
        .execute(&mut *tx)
        .await
        .expect("business write");
    tx.rollback().await.expect("rollback");

    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "src:evt_1").await.expect("claim"),
        Claim::First
    );
    drop(tx); // dropping rolls back too
    let mut tx = pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "src:evt_1").await.expect("claim"),
        Claim::First
    );
    assert_eq!(credits(&pool).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_claims_apply_the_effect_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = pool(&dir).await;

    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let pool = pool.clone();
            tokio::spawn(async move {
                let mut tx = pool.begin().await?;
                let outcome = claim(&mut tx, "src:evt_race").await?;
                if outcome == Claim::First {
                    sqlx::query("INSERT INTO credits VALUES ('src:evt_race')")
                        .execute(&mut *tx)
                        .await?;
                    tx.commit().await?;
                }
                Ok::<_, sqlx::Error>(outcome)
            })
        })
        .collect();
    let mut firsts = 0;
    for task in tasks {
        if task.await.expect("task").expect("claim") == Claim::First {
            firsts += 1;
        }
    }
    assert_eq!(firsts, 1);
    assert_eq!(credits(&pool).await, 1);
}
