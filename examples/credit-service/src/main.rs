//! credit-service: a tiny webhook handler that credits a customer for each paid Stripe invoice,
//! written three ways, so `hooklatch check` has something to catch and something to pass.
//!
//! ```sh
//! credit-service --db sqlite://app.db --mode naive     --listen 127.0.0.1:3000
//! hooklatch check --provider stripe --secret whsec_x --to http://127.0.0.1:3000/webhooks/stripe \
//!   --effects-sql "SELECT count(*) FROM credits WHERE event_id = :key" --db sqlite://app.db
//! ```
//!
//! `POST /webhooks/stripe` reads the event's `id` and `data.object.amount_paid` and credits the
//! amount (one row in `credits`). The modes:
//!
//! - `naive` credits on every delivery: a retried $50 invoice becomes $100 — the bug providers'
//!   at-least-once delivery turns into money.
//! - `check-then-insert` first looks for an earlier credit, then does the work and writes. It
//!   survives retries one after another, but two deliveries at once both find nothing and both
//!   credit: the check and the insert are not one atomic step.
//! - `guarded` claims the key in `processed_webhooks` (primary key, `ON CONFLICT DO NOTHING`) in
//!   the same transaction as the credit: the database lets exactly one claim win, the losers see
//!   "0 rows" and answer 200 without doing anything, and a crash rolls back both or neither.
//!
//! The key is the `Idempotency-Key` header when present (hooklatch sends one, the same on every
//! attempt), else the event id. With `--secret whsec_…` (a hooklatch destination's secret) every
//! request must carry hooklatch's Standard Webhooks signature (`webhook-id`,
//! `webhook-timestamp`, `webhook-signature`).
//!
//! The first line on stdout is the address it listens on (`http://127.0.0.1:PORT`), so a
//! script or a test can start it on port 0.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hooklatch_core::provider::StandardWebhooks;
use hooklatch_core::{InboundRequest, ProviderAdapter, Secret, Timestamp};
use serde_json::{json, Value};

#[derive(Debug, clap::Parser)]
#[command(
    name = "credit-service",
    about = "An example webhook handler: naive, check-then-insert or guarded."
)]
struct Args {
    /// Where to listen; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:3000")]
    listen: SocketAddr,
    /// The database: sqlite://PATH or postgres://…
    #[arg(long)]
    db: String,
    /// How duplicates are handled.
    #[arg(long, value_enum)]
    mode: Mode,
    /// Verify hooklatch's Standard Webhooks signature with this destination secret (whsec_…).
    #[arg(long)]
    secret: Option<String>,
    /// Simulated slow work (calling a payment API, say) between the check and the write.
    #[arg(long, default_value_t = 0)]
    work_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Mode {
    /// Credit on every delivery.
    Naive,
    /// Look for an earlier credit, then credit: races under concurrency.
    CheckThenInsert,
    /// Claim the key under a unique constraint in the credit's transaction.
    Guarded,
}

/// The application's database.
enum Db {
    /// A SQLite file: one connection per request, like a pool would give.
    Sqlite(PathBuf),
    /// PostgreSQL through a pool.
    Postgres(sqlx::PgPool),
}

struct App {
    db: Db,
    mode: Mode,
    secret: Option<Secret>,
    work: Duration,
}

/// One paid invoice, as the handler needs it.
struct Credit {
    key: String,
    event_id: String,
    amount: i64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let db = open(&args.db).await?;
    let app = Arc::new(App {
        db,
        mode: args.mode,
        secret: args.secret.as_deref().map(Secret::from_text),
        work: Duration::from_millis(args.work_ms),
    });
    let router = Router::new()
        .route("/webhooks/stripe", post(webhook))
        .route("/balance", get(balance))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    println!("http://{}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

async fn open(url: &str) -> anyhow::Result<Db> {
    if let Some(path) = url.strip_prefix("sqlite://") {
        let path = PathBuf::from(path);
        let conn = rusqlite::Connection::open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        conn.execute_batch(
            "PRAGMA journal_mode = WAL;
             CREATE TABLE IF NOT EXISTS credits (
                 id INTEGER PRIMARY KEY, event_id TEXT NOT NULL, amount INTEGER NOT NULL);
             CREATE TABLE IF NOT EXISTS processed_webhooks (key TEXT PRIMARY KEY);",
        )?;
        return Ok(Db::Sqlite(path));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(20)
            .connect(url)
            .await
            .context("connecting to PostgreSQL")?;
        for statement in [
            "CREATE TABLE IF NOT EXISTS credits (
                 id BIGSERIAL PRIMARY KEY, event_id TEXT NOT NULL, amount BIGINT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS processed_webhooks (key TEXT PRIMARY KEY)",
        ] {
            sqlx::query(statement).execute(&pool).await?;
        }
        return Ok(Db::Postgres(pool));
    }
    anyhow::bail!("--db must be sqlite://PATH or postgres://…")
}

/// `POST /webhooks/stripe`.
async fn webhook(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Some(secret) = &app.secret {
        let req = InboundRequest {
            path_and_query: "/webhooks/stripe",
            headers: &headers,
            body: &body,
            now: Timestamp::now(),
        };
        if let Err(rejection) =
            StandardWebhooks.verify(&req, std::slice::from_ref(secret), Duration::from_secs(300))
        {
            return (StatusCode::UNAUTHORIZED, rejection.message()).into_response();
        }
    }
    let Ok(event) = serde_json::from_slice::<Value>(&body) else {
        return (StatusCode::BAD_REQUEST, "body is not JSON").into_response();
    };
    let Some(event_id) = event["id"].as_str() else {
        return (StatusCode::BAD_REQUEST, "event has no id").into_response();
    };
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or(event_id);
    let credit = Credit {
        key: key.to_owned(),
        event_id: event_id.to_owned(),
        amount: event["data"]["object"]["amount_paid"].as_i64().unwrap_or(0),
    };
    match credit_once(&app, credit).await {
        Ok(credited) => Json(json!({ "credited": credited })).into_response(),
        Err(err) => {
            // A real service logs this; the provider sees a 500 and retries.
            eprintln!("credit-service: {err:#}");
            (StatusCode::INTERNAL_SERVER_ERROR, "could not credit").into_response()
        }
    }
}

/// Credits as the mode says; true when this delivery did the work.
async fn credit_once(app: &App, credit: Credit) -> anyhow::Result<bool> {
    match &app.db {
        Db::Sqlite(path) => {
            let (path, mode, work) = (path.clone(), app.mode, app.work);
            tokio::task::spawn_blocking(move || sqlite_credit(&path, mode, work, &credit)).await?
        }
        Db::Postgres(pool) => postgres_credit(pool, app.mode, app.work, &credit).await,
    }
}

fn sqlite_credit(
    path: &std::path::Path,
    mode: Mode,
    work: Duration,
    credit: &Credit,
) -> anyhow::Result<bool> {
    use rusqlite::params;
    let mut conn = rusqlite::Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(10))?;
    match mode {
        Mode::Naive => {
            std::thread::sleep(work);
            conn.execute(
                "INSERT INTO credits (event_id, amount) VALUES (?1, ?2)",
                params![credit.event_id, credit.amount],
            )?;
            Ok(true)
        }
        Mode::CheckThenInsert => {
            let seen: i64 = conn.query_row(
                "SELECT count(*) FROM credits WHERE event_id = ?1",
                params![credit.event_id],
                |row| row.get(0),
            )?;
            if seen > 0 {
                return Ok(false);
            }
            // Between this check and the insert, a concurrent delivery checks too.
            std::thread::sleep(work);
            conn.execute(
                "INSERT INTO credits (event_id, amount) VALUES (?1, ?2)",
                params![credit.event_id, credit.amount],
            )?;
            Ok(true)
        }
        Mode::Guarded => {
            // IMMEDIATE takes SQLite's write lock at BEGIN, so a concurrent delivery waits
            // (busy_timeout) instead of failing at its first write.
            let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
            let claimed = tx.execute(
                "INSERT INTO processed_webhooks (key) VALUES (?1) ON CONFLICT DO NOTHING",
                params![credit.key],
            )?;
            if claimed == 0 {
                return Ok(false); // already done: the transaction rolls back on drop
            }
            std::thread::sleep(work);
            tx.execute(
                "INSERT INTO credits (event_id, amount) VALUES (?1, ?2)",
                params![credit.event_id, credit.amount],
            )?;
            tx.commit()?;
            Ok(true)
        }
    }
}

async fn postgres_credit(
    pool: &sqlx::PgPool,
    mode: Mode,
    work: Duration,
    credit: &Credit,
) -> anyhow::Result<bool> {
    const INSERT_CREDIT: &str = "INSERT INTO credits (event_id, amount) VALUES ($1, $2)";
    match mode {
        Mode::Naive => {
            tokio::time::sleep(work).await;
            sqlx::query(INSERT_CREDIT)
                .bind(&credit.event_id)
                .bind(credit.amount)
                .execute(pool)
                .await?;
            Ok(true)
        }
        Mode::CheckThenInsert => {
            let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM credits WHERE event_id = $1")
                .bind(&credit.event_id)
                .fetch_one(pool)
                .await?;
            if seen > 0 {
                return Ok(false);
            }
            tokio::time::sleep(work).await;
            sqlx::query(INSERT_CREDIT)
                .bind(&credit.event_id)
                .bind(credit.amount)
                .execute(pool)
                .await?;
            Ok(true)
        }
        Mode::Guarded => {
            let mut tx = pool.begin().await?;
            // A concurrent claim of the same key waits here for this transaction, then
            // inserts nothing: exactly one delivery gets 1 row.
            let claimed = sqlx::query(
                "INSERT INTO processed_webhooks (key) VALUES ($1) ON CONFLICT DO NOTHING",
            )
            .bind(&credit.key)
            .execute(&mut *tx)
            .await?
            .rows_affected();
            if claimed == 0 {
                return Ok(false);
            }
            tokio::time::sleep(work).await;
            sqlx::query(INSERT_CREDIT)
                .bind(&credit.event_id)
                .bind(credit.amount)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(true)
        }
    }
}

/// `GET /balance`: how many credits, and their total (in cents).
async fn balance(State(app): State<Arc<App>>) -> Response {
    const SQL: &str = "SELECT count(*), CAST(coalesce(sum(amount), 0) AS BIGINT) FROM credits";
    let totals = match &app.db {
        Db::Sqlite(path) => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || -> anyhow::Result<(i64, i64)> {
                let conn = rusqlite::Connection::open(path)?;
                Ok(conn.query_row(SQL, [], |row| Ok((row.get(0)?, row.get(1)?)))?)
            })
            .await
            .map_err(anyhow::Error::from)
            .and_then(|r| r)
        }
        Db::Postgres(pool) => sqlx::query_as::<_, (i64, i64)>(SQL)
            .fetch_one(pool)
            .await
            .map_err(anyhow::Error::from),
    };
    match totals {
        Ok((credits, total)) => Json(json!({ "credits": credits, "total": total })).into_response(),
        Err(err) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{err:#}")).into_response(),
    }
}
