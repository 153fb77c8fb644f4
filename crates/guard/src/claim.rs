//! Claiming an idempotency key inside the application's own sqlx transaction.
//!
//! See [`claim`] for the pattern and what a concurrent duplicate does.

use std::future::Future;

use sqlx::{Acquire, Database, Transaction};

/// The name of the table [`ensure_table`] creates and [`claim`] writes to.
pub const TABLE: &str = "hooklatch_processed";

/// What [`claim`] found: match on it in the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "the work must run only on `Claim::First`"]
pub enum Claim {
    /// This transaction holds the key: do the work in it, then commit.
    First,
    /// A committed transaction already processed the key: skip the work, answer success.
    AlreadyDone,
}

/// A database [`claim`] and [`ensure_table`] work with: PostgreSQL (feature `postgres`) and
/// SQLite (feature `sqlite`). Sealed.
pub trait GuardBackend: Database + sealed::Sealed {
    #[doc(hidden)]
    fn create_table(
        conn: &mut Self::Connection,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send;

    #[doc(hidden)]
    fn insert_key<'c>(
        conn: &'c mut Self::Connection,
        key: &'c str,
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'c;
}

/// Creates `hooklatch_processed (key TEXT PRIMARY KEY, processed_at …)` if it does not exist.
///
/// Run it once at startup (or copy the statement into your migrations). Takes anything sqlx
/// acquires a connection from: `&pool`, `&mut conn`, `&mut tx`.
pub async fn ensure_table<'c, DB, A>(conn: A) -> Result<(), sqlx::Error>
where
    DB: GuardBackend,
    A: Acquire<'c, Database = DB>,
{
    let mut conn = conn.acquire().await?;
    DB::create_table(&mut conn).await
}

/// Claims `key` (the `Idempotency-Key`) inside `tx`, the transaction the business write uses.
///
/// [`Claim::First`]: do the work in `tx` and commit. [`Claim::AlreadyDone`]: skip it.
///
/// The pattern is a unique index in the same transaction as the business write:
///
/// 1. `BEGIN`;
/// 2. `INSERT INTO hooklatch_processed (key) VALUES ($1) ON CONFLICT DO NOTHING`;
/// 3. no row inserted → [`Claim::AlreadyDone`]: roll back (or just drop the transaction) and
///    answer success; one row inserted → [`Claim::First`]: do the business write in the
///    *same* transaction and commit.
///
/// The claim and the effect commit together or not at all, so a crash between them leaves the
/// key unclaimed and the redelivery does the work; a redelivery after the commit finds the key.
///
/// **A concurrent duplicate** (two deliveries of one key at the same moment):
/// - PostgreSQL: the second `INSERT` waits on the first transaction's uncommitted index entry.
///   It returns [`Claim::AlreadyDone`] once the first commits, or [`Claim::First`] if the first
///   rolls back — never both running the work.
/// - SQLite: one writer at a time. The second transaction waits for the write lock (sqlx's
///   `busy_timeout`, 5 s by default) and then sees the committed key. Make `claim` the first
///   statement of the transaction: a deferred transaction that read before it writes can get
///   `SQLITE_BUSY` instead of waiting.
///
/// Rows are kept: a key must outlive every redelivery (hooklatch keeps its own for 7 days by
/// default). Delete old rows by `processed_at` if the table grows too large, never sooner than
/// the longest redrive you might run.
pub async fn claim<DB: GuardBackend>(
    tx: &mut Transaction<'_, DB>,
    key: &str,
) -> Result<Claim, sqlx::Error> {
    let inserted = DB::insert_key(&mut **tx, key).await?;
    Ok(if inserted == 1 {
        Claim::First
    } else {
        Claim::AlreadyDone
    })
}

#[cfg(feature = "postgres")]
impl GuardBackend for sqlx::Postgres {
    async fn create_table(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS hooklatch_processed (\
                key TEXT PRIMARY KEY, \
                processed_at TIMESTAMPTZ NOT NULL DEFAULT now())",
        )
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn insert_key(conn: &mut sqlx::PgConnection, key: &str) -> Result<u64, sqlx::Error> {
        let res =
            sqlx::query("INSERT INTO hooklatch_processed (key) VALUES ($1) ON CONFLICT DO NOTHING")
                .bind(key)
                .execute(conn)
                .await?;
        Ok(res.rows_affected())
    }
}

#[cfg(feature = "sqlite")]
impl GuardBackend for sqlx::Sqlite {
    async fn create_table(conn: &mut sqlx::SqliteConnection) -> Result<(), sqlx::Error> {
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS hooklatch_processed (\
                key TEXT PRIMARY KEY NOT NULL, \
                processed_at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')))",
        )
        .execute(conn)
        .await?;
        Ok(())
    }

    async fn insert_key(conn: &mut sqlx::SqliteConnection, key: &str) -> Result<u64, sqlx::Error> {
        let res =
            sqlx::query("INSERT INTO hooklatch_processed (key) VALUES (?1) ON CONFLICT DO NOTHING")
                .bind(key)
                .execute(conn)
                .await?;
        Ok(res.rows_affected())
    }
}

mod sealed {
    pub trait Sealed {}
    #[cfg(feature = "postgres")]
    impl Sealed for sqlx::Postgres {}
    #[cfg(feature = "sqlite")]
    impl Sealed for sqlx::Sqlite {}
}
