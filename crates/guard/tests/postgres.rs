//! `claim` on PostgreSQL. Reads `HOOKLATCH_TEST_POSTGRES_URL` and creates (then drops) its own
//! database per test; without it the tests print `skipped` (and fail when `CI` is set).

#![cfg(feature = "postgres")]

use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};

use hooklatch_guard::{claim, ensure_table, Claim};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgConnection, PgPool};

/// A fresh database and a pool on it, or `None` (skipped; a failure in CI).
struct TestDb {
    pool: PgPool,
    admin: PgConnectOptions,
    name: String,
}

impl TestDb {
    async fn create() -> Option<TestDb> {
        let Ok(base) = std::env::var("HOOKLATCH_TEST_POSTGRES_URL") else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must set HOOKLATCH_TEST_POSTGRES_URL"
            );
            println!("skipped: set HOOKLATCH_TEST_POSTGRES_URL");
            return None;
        };
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "hooklatch_guard_{}_{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let admin = PgConnectOptions::from_str(&base).expect("HOOKLATCH_TEST_POSTGRES_URL");
        let mut conn = PgConnection::connect_with(&admin)
            .await
            .expect("connecting to HOOKLATCH_TEST_POSTGRES_URL");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .expect("creating a test database");
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .connect_with(admin.clone().database(&name))
            .await
            .expect("connecting to the test database");
        ensure_table(&pool).await.expect("creating the table");
        ensure_table(&pool)
            .await
            .expect("ensure_table is idempotent");
        sqlx::query("CREATE TABLE credits (key TEXT NOT NULL)")
            .execute(&pool)
            .await
            .expect("creating credits");
        Some(TestDb { pool, admin, name })
    }

    async fn credits(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM credits")
            .fetch_one(&self.pool)
            .await
            .expect("counting credits")
    }

    async fn drop_database(self) {
        self.pool.close().await;
        let mut conn = PgConnection::connect_with(&self.admin)
            .await
            .expect("connecting to drop the test database");
        sqlx::query(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
            .execute(&mut conn)
            .await
            .expect("dropping the test database");
    }
}

#[tokio::test]
async fn first_then_already_done() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let mut tx = db.pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "src:evt_1").await.expect("claim"),
        Claim::First
    );
    tx.commit().await.expect("commit");

    let mut tx = db.pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "src:evt_1").await.expect("claim"),
        Claim::AlreadyDone
    );
    assert_eq!(
        claim(&mut tx, "src:evt_2").await.expect("claim"),
        Claim::First
    );
    drop(tx);
    db.drop_database().await;
}

#[tokio::test]
async fn a_rolled_back_claim_leaves_the_key_unclaimed() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let mut tx = db.pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "src:evt_1").await.expect("claim"),
        Claim::First
    );
    sqlx::query("INSERT INTO credits VALUES ('src:evt_1')")
        .execute(&mut *tx)
        .await
        .expect("business write");
    tx.rollback().await.expect("rollback");

    let mut tx = db.pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut tx, "src:evt_1").await.expect("claim"),
        Claim::First
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(db.credits().await, 0);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_claims_apply_the_effect_once() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    // All 16 transactions are open before any claims, so they really overlap.
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(16));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let pool = db.pool.clone();
            let barrier = barrier.clone();
            tokio::spawn(async move {
                let mut tx = pool.begin().await?;
                barrier.wait().await;
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
    assert_eq!(db.credits().await, 1);
    db.drop_database().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_claims_after_the_first_rolls_back() {
    let Some(db) = TestDb::create().await else {
        return;
    };
    let mut first = db.pool.begin().await.expect("begin");
    assert_eq!(
        claim(&mut first, "src:evt_1").await.expect("claim"),
        Claim::First
    );

    let pool = db.pool.clone();
    let second = tokio::spawn(async move {
        let mut tx = pool.begin().await.expect("begin");
        claim(&mut tx, "src:evt_1").await.expect("claim")
    });
    // Wait (bounded) until the duplicate is seen waiting on a lock, not for a fixed time.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&db.pool)
        .await
        .expect("pg_stat_activity");
        if waiting > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the duplicate never waited on the unique index"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(!second.is_finished(), "the duplicate waits on the index");
    first.rollback().await.expect("rollback");
    assert_eq!(second.await.expect("task"), Claim::First);
    db.drop_database().await;
}
