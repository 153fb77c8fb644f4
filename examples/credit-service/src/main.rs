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
//! - `guarded` claims the key with [`hooklatch_guard::claim`] (a row in `hooklatch_processed`,
//!   primary key, `ON CONFLICT DO NOTHING`) in the same transaction as the credit: the database
//!   lets exactly one claim win, the others get [`Claim::AlreadyDone`] and answer 200 without
//!   doing anything, and a crash rolls back both or neither.
//!
//! The key is the `Idempotency-Key` header when present (hooklatch sends one, the same on every
//! attempt), else the event id. With `--secret whsec_…` (a hooklatch destination's secret) every
//! request must carry hooklatch's Standard Webhooks signature (`webhook-id`,
//! `webhook-timestamp`, `webhook-signature`), checked by the guard's [`VerifiedDelivery`]
//! extractor, and the key is the verified `Idempotency-Key`.
//!
//! The first line on stdout is the address it listens on (`http://127.0.0.1:PORT`), so a
//! script or a test can start it on port 0.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Bytes;
use axum::extract::{FromRef, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hooklatch_core::Secret;
use hooklatch_guard::{claim, ensure_table, Claim, GuardConfig, VerifiedDelivery};
use serde_json::{json, Value};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

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
    /// Claim the key with hooklatch-guard in the credit's transaction.
    Guarded,
}

/// The application's database, through sqlx either way.
enum Db {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// Runs `$body` with `$pool` bound to whichever pool `$db` holds. The statements are the same
/// text on both (SQLite accepts `$1` too); expanding the body per pool type keeps each copy
/// concrete, instead of spelling out sqlx's generic bounds.
macro_rules! with_pool {
    ($db:expr, $pool:ident => $body:expr) => {
        match $db {
            Db::Sqlite($pool) => $body,
            Db::Postgres($pool) => $body,
        }
    };
}

struct App {
    db: Db,
    mode: Mode,
    work: Duration,
}

/// The state of the signed route: the app, and the secret the extractor verifies with.
#[derive(Clone)]
struct Signed {
    app: Arc<App>,
    guard: GuardConfig,
}

impl FromRef<Signed> for GuardConfig {
    fn from_ref(state: &Signed) -> GuardConfig {
        state.guard.clone()
    }
}

impl FromRef<Signed> for Arc<App> {
    fn from_ref(state: &Signed) -> Arc<App> {
        state.app.clone()
    }
}

/// One paid invoice, as the handler needs it.
struct Credit {
    key: String,
    event_id: String,
    amount: i64,
}

const INSERT_CREDIT: &str = "INSERT INTO credits (event_id, amount) VALUES ($1, $2)";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = <Args as clap::Parser>::parse();
    let db = open(&args.db).await?;
    let app = Arc::new(App {
        db,
        mode: args.mode,
        work: Duration::from_millis(args.work_ms),
    });
    let webhooks = match &args.secret {
        Some(secret) => Router::new()
            .route("/webhooks/stripe", post(signed_webhook))
            .with_state(Signed {
                app: app.clone(),
                guard: GuardConfig::new(Secret::from_text(secret)),
            }),
        None => Router::new()
            .route("/webhooks/stripe", post(webhook))
            .with_state(app.clone()),
    };
    let router = Router::new()
        .route("/balance", get(balance))
        .with_state(app)
        .merge(webhooks);
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
        // WAL lets `GET /balance` (and `hooklatch check` counting) read while a credit writes;
        // a concurrent writer waits up to busy_timeout for the lock instead of failing.
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(16)
            .connect_with(options)
            .await
            .with_context(|| format!("opening {path}"))?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS credits (
                 id INTEGER PRIMARY KEY, event_id TEXT NOT NULL, amount INTEGER NOT NULL)",
        )
        .execute(&pool)
        .await?;
        ensure_table(&pool).await?;
        return Ok(Db::Sqlite(pool));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = PgPoolOptions::new()
            .max_connections(20)
            .connect(url)
            .await
            .context("connecting to PostgreSQL")?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS credits (
                 id BIGSERIAL PRIMARY KEY, event_id TEXT NOT NULL, amount BIGINT NOT NULL)",
        )
        .execute(&pool)
        .await?;
        ensure_table(&pool).await?;
        return Ok(Db::Postgres(pool));
    }
    anyhow::bail!("--db must be sqlite://PATH or postgres://…")
}

/// `POST /webhooks/stripe` without `--secret`: the key is `Idempotency-Key`, else the event id.
async fn webhook(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    credit_event(&app, key, &body).await
}

/// `POST /webhooks/stripe` with `--secret`: only deliveries signed by hooklatch reach it (the
/// extractor answers 401 otherwise), and the key is the verified `Idempotency-Key`.
async fn signed_webhook(State(app): State<Arc<App>>, delivery: VerifiedDelivery) -> Response {
    credit_event(&app, Some(delivery.idempotency_key), &delivery.body).await
}

async fn credit_event(app: &App, key: Option<String>, body: &[u8]) -> Response {
    let Ok(event) = serde_json::from_slice::<Value>(body) else {
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_json",
            "the body is not JSON",
        );
    };
    let Some(event_id) = event["id"].as_str() else {
        return error(StatusCode::BAD_REQUEST, "missing_id", "the event has no id");
    };
    let credit = Credit {
        key: key.unwrap_or_else(|| event_id.to_owned()),
        event_id: event_id.to_owned(),
        amount: event["data"]["object"]["amount_paid"].as_i64().unwrap_or(0),
    };
    match credit_once(app, &credit).await {
        Ok(credited) => Json(json!({ "credited": credited })).into_response(),
        Err(err) => {
            // A real service logs this; the provider sees a 500 and retries.
            eprintln!("credit-service: crediting {}: {err}", credit.event_id);
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "could not credit",
            )
        }
    }
}

/// Credits as the mode says; true when this delivery did the work.
async fn credit_once(app: &App, credit: &Credit) -> Result<bool, sqlx::Error> {
    with_pool!(&app.db, pool => match app.mode {
        Mode::Naive => {
            tokio::time::sleep(app.work).await;
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
            // Between this check and the insert, a concurrent delivery checks too.
            tokio::time::sleep(app.work).await;
            sqlx::query(INSERT_CREDIT)
                .bind(&credit.event_id)
                .bind(credit.amount)
                .execute(pool)
                .await?;
            Ok(true)
        }
        Mode::Guarded => {
            let mut tx = pool.begin().await?;
            // The claim is the transaction's first statement. A concurrent claim of the same
            // key waits for this transaction (PostgreSQL: on the key's index entry; SQLite:
            // for the write lock), then finds the key: exactly one delivery gets `First`.
            if claim(&mut tx, &credit.key).await? == Claim::AlreadyDone {
                return Ok(false); // dropping `tx` rolls it back
            }
            tokio::time::sleep(app.work).await;
            sqlx::query(INSERT_CREDIT)
                .bind(&credit.event_id)
                .bind(credit.amount)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(true)
        }
    })
}

/// `GET /balance`: how many credits, and their total (in cents).
async fn balance(State(app): State<Arc<App>>) -> Response {
    const SQL: &str = "SELECT count(*), CAST(coalesce(sum(amount), 0) AS BIGINT) FROM credits";
    let totals: Result<(i64, i64), sqlx::Error> =
        with_pool!(&app.db, pool => sqlx::query_as(SQL).fetch_one(pool).await);
    match totals {
        Ok((credits, total)) => Json(json!({ "credits": credits, "total": total })).into_response(),
        Err(err) => {
            eprintln!("credit-service: reading the balance: {err}");
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "could not read the balance",
            )
        }
    }
}

/// An error answer: `{"code": …, "message": …}`.
fn error(status: StatusCode, code: &'static str, message: &str) -> Response {
    (status, Json(json!({ "code": code, "message": message }))).into_response()
}
