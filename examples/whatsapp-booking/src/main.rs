//! whatsapp-booking: a table-booking service behind hooklatch. Guests write to a WhatsApp
//! Business number; Meta posts each message to hooklatch, which forwards it here. A text
//! message `book 2026-12-24 19:00` books that slot — once, however often the message arrives.
//!
//! ```sh
//! whatsapp-booking --db sqlite://bookings.db --secret whsec_… --listen 127.0.0.1:3001
//! ```
//!
//! **What arrives.** hooklatch verifies Meta's `X-Hub-Signature-256`, then delivers the
//! provider's body byte-exact to `POST /webhooks/whatsapp`, signed with the destination's
//! secret (Standard Webhooks headers) and with `Idempotency-Key: {source}:{item key}`. One
//! WhatsApp POST can batch several messages and statuses; hooklatch makes each item its own
//! event, so the same body is delivered once per item, each time with that item's key: a
//! message's id (`wamid.…`), or `{wamid}:{status}` for a status update.
//!
//! **What it does with a delivery.** The [`VerifiedDelivery`] extractor checks the signature
//! (401 otherwise) and yields the key. The item key is the part after the source name; the
//! service looks it up among the body's `entry[].changes[].value.messages[]`:
//!
//! - an inbound text message in the booking format: in one transaction,
//!   [`claim`] the `Idempotency-Key`, and only on [`Claim::First`] insert the booking (keyed by
//!   the message id) and commit. A repeated delivery finds the key claimed and books nothing.
//! - a status update (`sent`, `delivered`, `read`, …), another message type, a text that is not
//!   a booking, or any other item: answered 200 and ignored.
//!
//! Every answer is JSON: `{"outcome": "booked" | "duplicate" | "ignored", …}` with 200, or
//! `{"code", "message"}` with 400 (the body is not JSON, the message is malformed), 401 (the
//! extractor) or 500 (the database; hooklatch retries).
//!
//! `GET /bookings` lists the bookings. The first line on stdout is the address it listens on
//! (`http://127.0.0.1:PORT`), so a script or a test can start it on port 0.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{FromRef, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use hooklatch_core::Secret;
use hooklatch_guard::{claim, ensure_table, Claim, GuardConfig, VerifiedDelivery};
use serde_json::{json, Value};
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

const EXAMPLE: &str = "\
The booking format (one text message; the keyword is case-insensitive):
  book YYYY-MM-DD HH:MM        e.g. \"book 2026-12-24 19:00\"

Example:
  whatsapp-booking --db sqlite://bookings.db --secret whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw

  # hooklatch.toml: Meta posts to /in/whatsapp, hooklatch forwards here, signed
  [[sources]]
  name = \"whatsapp\"
  provider = \"whatsapp\"
  secrets = [\"env:META_APP_SECRET\"]
  verify_token = \"env:META_VERIFY_TOKEN\"
  destinations = [\"booking\"]

  [[destinations]]
  name = \"booking\"
  url = \"http://127.0.0.1:3001/webhooks/whatsapp\"
  allow = [\"127.0.0.1\"]
  secret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"

  curl http://127.0.0.1:3001/bookings";

#[derive(Debug, Parser)]
#[command(
    name = "whatsapp-booking",
    about = "An example WhatsApp booking service behind hooklatch: one booking per message, however often it is delivered.",
    after_help = EXAMPLE
)]
struct Args {
    /// Where to listen; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:3001")]
    listen: SocketAddr,
    /// The database: sqlite://PATH (created if missing) or postgres://…
    #[arg(long)]
    db: String,
    /// The hooklatch destination's `secret` (whsec_…): deliveries must be signed with it.
    #[arg(long, env = "WHATSAPP_BOOKING_SECRET", hide_env_values = true)]
    secret: String,
}

/// The bookings database, through sqlx either way.
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

/// The router's state: the database, and the secret the extractor verifies with.
#[derive(Clone)]
struct App {
    db: Arc<Db>,
    guard: GuardConfig,
}

impl FromRef<App> for GuardConfig {
    fn from_ref(app: &App) -> GuardConfig {
        app.guard.clone()
    }
}

/// A requested slot, as parsed from `book YYYY-MM-DD HH:MM`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Slot {
    year: u16,
    month: u8,
    day: u8,
    hour: u8,
    minute: u8,
}

/// An inbound message that asks for a booking.
#[derive(Debug)]
struct BookingRequest {
    message_id: String,
    phone: String,
    slot: Slot,
}

/// What a delivery's item is, found by its key in the delivered body.
enum Item<'a> {
    /// An inbound message with this id.
    Message(&'a Value),
    /// A status update of an outbound message.
    Status,
    /// Nothing in this body has the key (another webhook field, keyed by the body's hash).
    Other,
}

/// A client error, answered 400 `{code, message}`.
#[derive(Debug)]
struct BadRequest {
    code: &'static str,
    message: String,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let db = open(&args.db).await?;
    let app = App {
        db: Arc::new(db),
        guard: GuardConfig::new(Secret::from_text(&args.secret)),
    };
    let router = Router::new()
        .route("/webhooks/whatsapp", post(webhook))
        .route("/bookings", get(bookings))
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
        // WAL lets `GET /bookings` read while a booking writes; a concurrent delivery waits up
        // to busy_timeout for the write lock instead of failing.
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .busy_timeout(Duration::from_secs(10));
        let pool = SqlitePoolOptions::new()
            .max_connections(8)
            .connect_with(options)
            .await
            .with_context(|| format!("opening {path}"))?;
        // No unique constraint on `message_id` on purpose: the guard alone keeps bookings single.
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS bookings (\
                id INTEGER PRIMARY KEY, \
                message_id TEXT NOT NULL, \
                phone TEXT NOT NULL, \
                slot TEXT NOT NULL, \
                idempotency_key TEXT NOT NULL)",
        )
        .execute(&pool)
        .await
        .context("creating the bookings table")?;
        ensure_table(&pool)
            .await
            .context("creating the guard's table")?;
        return Ok(Db::Sqlite(pool));
    }
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .connect(url)
            .await
            .context("connecting to PostgreSQL")?;
        sqlx::query(
            "CREATE TABLE IF NOT EXISTS bookings (\
                id BIGSERIAL PRIMARY KEY, \
                message_id TEXT NOT NULL, \
                phone TEXT NOT NULL, \
                slot TEXT NOT NULL, \
                idempotency_key TEXT NOT NULL)",
        )
        .execute(&pool)
        .await
        .context("creating the bookings table")?;
        ensure_table(&pool)
            .await
            .context("creating the guard's table")?;
        return Ok(Db::Postgres(pool));
    }
    anyhow::bail!("--db must be sqlite://PATH or postgres://…")
}

/// `POST /webhooks/whatsapp`: one delivery from hooklatch, about one item of the body.
async fn webhook(State(app): State<App>, delivery: VerifiedDelivery) -> Response {
    let key = delivery.idempotency_key;
    let request = match booking_request(&key, &delivery.body) {
        Ok(Ok(request)) => request,
        Ok(Err(reason)) => return ok(json!({ "outcome": "ignored", "reason": reason })),
        Err(bad) => {
            let body = json!({ "code": bad.code, "message": bad.message });
            return (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
    };
    match book_once(&app.db, &key, &request).await {
        Ok(Claim::First) => ok(json!({
            "outcome": "booked",
            "message_id": request.message_id,
            "slot": request.slot.to_string(),
        })),
        Ok(Claim::AlreadyDone) => ok(json!({
            "outcome": "duplicate",
            "message_id": request.message_id,
        })),
        Err(err) => {
            // Logged here only; hooklatch sees a 500 and delivers again later.
            eprintln!("whatsapp-booking: booking {key}: {err}");
            let body = json!({ "code": "internal", "message": "could not book" });
            (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response()
        }
    }
}

/// The booking a delivery asks for; `Ok(Err(reason))` when it asks for none.
fn booking_request(
    key: &str,
    body: &[u8],
) -> Result<Result<BookingRequest, &'static str>, BadRequest> {
    let body: Value = serde_json::from_slice(body).map_err(|err| BadRequest {
        code: "invalid_json",
        message: format!("the body is not JSON: {err}"),
    })?;
    // `{source}:{item key}`; source names never contain ':'.
    let Some((_source, item_key)) = key.split_once(':') else {
        return Err(BadRequest {
            code: "invalid_idempotency_key",
            message: "the Idempotency-Key is not `{source}:{key}`".to_owned(),
        });
    };
    let message = match find_item(&body, item_key) {
        Item::Message(message) => message,
        Item::Status => return Ok(Err("a status update")),
        Item::Other => return Ok(Err("not an inbound message")),
    };
    if message.get("type").and_then(Value::as_str) != Some("text") {
        return Ok(Err("not a text message"));
    }
    let Some(text) = message.pointer("/text/body").and_then(Value::as_str) else {
        return Err(BadRequest {
            code: "invalid_message",
            message: format!("text message {item_key} has no text.body"),
        });
    };
    let Some(phone) = message.get("from").and_then(Value::as_str) else {
        return Err(BadRequest {
            code: "invalid_message",
            message: format!("message {item_key} has no `from`"),
        });
    };
    let Some(slot) = parse_booking(text) else {
        return Ok(Err("not a booking: the format is `book YYYY-MM-DD HH:MM`"));
    };
    Ok(Ok(BookingRequest {
        message_id: item_key.to_owned(),
        phone: phone.to_owned(),
        slot,
    }))
}

/// The item `item_key` names among the body's `entry[].changes[].value` messages and statuses.
fn find_item<'a>(body: &'a Value, item_key: &str) -> Item<'a> {
    let values = items(body.get("entry"))
        .iter()
        .flat_map(|entry| items(entry.get("changes")))
        .filter_map(|change| change.get("value"));
    for value in values {
        if let Some(message) = items(value.get("messages"))
            .iter()
            .find(|m| text_field(m, "id") == Some(item_key))
        {
            return Item::Message(message);
        }
        // A status's key is `{id}:{status}`: the same outbound message reports each status.
        let is_status = items(value.get("statuses")).iter().any(|s| {
            let (id, state) = (text_field(s, "id"), text_field(s, "status"));
            id.zip(state)
                .is_some_and(|(id, state)| item_key == format!("{id}:{state}"))
        });
        if is_status {
            return Item::Status;
        }
    }
    Item::Other
}

/// A string field of a JSON object.
fn text_field<'v>(item: &'v Value, field: &str) -> Option<&'v str> {
    item.get(field).and_then(Value::as_str)
}

/// The elements of a JSON array, or none.
fn items(value: Option<&Value>) -> &[Value] {
    value.and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

/// `book YYYY-MM-DD HH:MM` (any case, any spacing between the three words), a real date and time.
fn parse_booking(text: &str) -> Option<Slot> {
    let mut words = text.split_whitespace();
    let (keyword, date, time) = (words.next()?, words.next()?, words.next()?);
    if !keyword.eq_ignore_ascii_case("book") || words.next().is_some() {
        return None;
    }
    let number = |s: &str, len: usize| -> Option<u16> {
        (s.len() == len && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse().ok())
            .flatten()
    };
    let mut ymd = date.split('-');
    let year = number(ymd.next()?, 4)?;
    let month = u8::try_from(number(ymd.next()?, 2)?).ok()?;
    let day = u8::try_from(number(ymd.next()?, 2)?).ok()?;
    let (hour, minute) = time.split_once(':')?;
    let hour = u8::try_from(number(hour, 2)?).ok()?;
    let minute = u8::try_from(number(minute, 2)?).ok()?;
    let valid = ymd.next().is_none()
        && (1..=12).contains(&month)
        && (1..=days_in_month(year, month)).contains(&day)
        && hour < 24
        && minute < 60;
    valid.then_some(Slot {
        year,
        month,
        day,
        hour,
        minute,
    })
}

fn days_in_month(year: u16, month: u8) -> u8 {
    let leap = year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400));
    match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

impl std::fmt::Display for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04}-{:02}-{:02} {:02}:{:02}",
            self.year, self.month, self.day, self.hour, self.minute
        )
    }
}

/// Claims `key` and inserts the booking in one transaction; `First` when this delivery booked.
async fn book_once(db: &Db, key: &str, request: &BookingRequest) -> Result<Claim, sqlx::Error> {
    with_pool!(db, pool => {
        let mut tx = pool.begin().await?;
        // The claim is the transaction's first statement. A concurrent delivery of the same
        // key waits for this transaction (PostgreSQL: on the key's index entry; SQLite: for
        // the write lock), then finds the key claimed.
        let claimed = claim(&mut tx, key).await?;
        if claimed == Claim::First {
            sqlx::query(
                "INSERT INTO bookings (message_id, phone, slot, idempotency_key) \
                 VALUES ($1, $2, $3, $4)",
            )
            .bind(&request.message_id)
            .bind(&request.phone)
            .bind(request.slot.to_string())
            .bind(key)
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
        }
        // On `AlreadyDone`, dropping `tx` rolls it back: nothing was written.
        Ok(claimed)
    })
}

/// `GET /bookings`: every booking, oldest first.
async fn bookings(State(app): State<App>) -> Response {
    const SQL: &str = "SELECT id, message_id, phone, slot FROM bookings ORDER BY id";
    let rows: Result<Vec<(i64, String, String, String)>, sqlx::Error> =
        with_pool!(&*app.db, pool => sqlx::query_as(SQL).fetch_all(pool).await);
    match rows {
        Ok(rows) => {
            let bookings: Vec<Value> = rows
                .into_iter()
                .map(|(id, message_id, phone, slot)| {
                    json!({ "id": id, "message_id": message_id, "phone": phone, "slot": slot })
                })
                .collect();
            ok(json!({ "bookings": bookings }))
        }
        Err(err) => {
            eprintln!("whatsapp-booking: listing bookings: {err}");
            let body = json!({ "code": "internal", "message": "could not list the bookings" });
            (StatusCode::INTERNAL_SERVER_ERROR, Json(body)).into_response()
        }
    }
}

fn ok(body: Value) -> Response {
    (StatusCode::OK, Json(body)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(text: &str, expect: Option<&str>) {
        let slot = parse_booking(text).map(|s| s.to_string());
        assert_eq!(slot.as_deref(), expect, "{text:?}");
    }

    #[test]
    fn the_booking_format() {
        check("book 2026-12-24 19:00", Some("2026-12-24 19:00"));
        check("  Book   2026-12-24\t19:00 ", Some("2026-12-24 19:00"));
        check("BOOK 2028-02-29 00:00", Some("2028-02-29 00:00"));
    }

    #[test]
    fn what_is_not_a_booking() {
        check("Is my table for four still booked for 8pm?", None);
        check("book", None);
        check("book 2026-12-24", None);
        check("book 2026-12-24 19:00 please", None);
        check("reserve 2026-12-24 19:00", None);
        check("book 2026-13-01 19:00", None);
        check("book 2027-02-29 19:00", None);
        check("book 2026-04-31 19:00", None);
        check("book 2026-12-24 24:00", None);
        check("book 2026-12-24 19:60", None);
        check("book 26-12-24 19:00", None);
        check("book 2026-12-24 7:00", None);
        check("book +026-12-24 19:00", None);
        check("book 2026-12-24-01 19:00", None);
    }

    #[test]
    fn a_delivery_is_about_the_item_its_key_names() {
        let body = json!({"entry": [{"changes": [{"value": {
            "messages": [
                {"id": "wamid.A", "from": "15550001", "type": "text", "text": {"body": "book 2026-12-24 19:00"}},
                {"id": "wamid.B", "from": "15550002", "type": "image", "image": {}}
            ],
            "statuses": [{"id": "wamid.OUT", "status": "delivered"}]
        }}]}]});
        let body = serde_json::to_vec(&body).unwrap();
        let request = booking_request("wa:wamid.A", &body).unwrap().unwrap();
        assert_eq!(
            (request.message_id.as_str(), request.phone.as_str()),
            ("wamid.A", "15550001")
        );
        let ignored = |key| booking_request(key, &body).unwrap().err();
        assert_eq!(ignored("wa:wamid.B"), Some("not a text message"));
        assert_eq!(ignored("wa:wamid.OUT:delivered"), Some("a status update"));
        assert_eq!(ignored("wa:body:00ff"), Some("not an inbound message"));
        let bad = |key, body: &[u8]| booking_request(key, body).err().map(|b| b.code);
        assert_eq!(bad("wa:wamid.A", b"{not json"), Some("invalid_json"));
        assert_eq!(bad("no-source", &body), Some("invalid_idempotency_key"));
    }
}
