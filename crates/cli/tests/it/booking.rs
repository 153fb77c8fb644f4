//! The WhatsApp booking flow end to end (`examples/whatsapp-booking`): a real gateway with a
//! WhatsApp source whose destination is the booking service, run as a real process on its own
//! SQLite file (and, with `HOOKLATCH_TEST_POSTGRES_URL`, on a PostgreSQL database of its own).
//!
//! One signed WhatsApp POST carrying a booking message and a status update of an earlier
//! outbound message is sent to the gateway 10 times in a row and 32 times at once; then the
//! delivery is sent straight to the service again and again, as the gateway's own retries
//! would be (same `Idempotency-Key`, fresh Standard Webhooks signature), in a row and at once.
//! Exactly one booking row, keyed by the message id; the status is acknowledged and ignored.
//!
//! The service is its own package, and `CARGO_BIN_EXE_*` only names this package's binaries,
//! so [`booking_bin`] builds it once per run with `cargo build -p
//! hooklatch-example-whatsapp-booking` into this run's target dir and profile.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;

use hooklatch::core::provider::standard_webhooks::{decode_secret, sign_v1};
use hooklatch::core::provider::{SignRequest, WhatsApp};
use hooklatch::core::{ProviderAdapter, Secret, Timestamp};
use serde_json::Value;
use sqlx::Connection;

use crate::example_bin;
use crate::postgres::Database;
use crate::support::{unique, Behaviour, Gateway, Handler, Options};

/// The WhatsApp source's name in the gateway's config.
const SOURCE: &str = "wa-booking";
/// The Meta App Secret the WhatsApp source verifies `X-Hub-Signature-256` with.
const APP_SECRET: &str = "e2e meta app secret for bookings";
/// The booking destination's secret: hooklatch signs its deliveries with it.
const DESTINATION_SECRET: &str = "whsec_ZTJlIGJvb2tpbmcgZGVzdGluYXRpb24gc2VjcmV0";
/// The guest's message, in the service's booking format.
const BOOKING_TEXT: &str = "book 2026-12-24 19:00";

/// Builds the whatsapp-booking binary once; its path.
fn booking_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| example_bin::build("hooklatch-example-whatsapp-booking", "whatsapp-booking"))
}

/// A running booking service.
struct BookingService {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    base: String,
    client: reqwest::Client,
}

impl BookingService {
    async fn start(db: &str) -> BookingService {
        let bin = booking_bin().to_path_buf();
        let db = db.to_owned();
        let (child, base) = tokio::task::spawn_blocking(move || {
            let mut child = Command::new(bin)
                .args(["--listen", "127.0.0.1:0", "--db", &db])
                .args(["--secret", DESTINATION_SECRET])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawning whatsapp-booking");
            // The first line is the address; read_line returns at EOF if it dies first.
            let mut line = String::new();
            BufReader::new(child.stdout.take().expect("piped stdout"))
                .read_line(&mut line)
                .expect("reading whatsapp-booking's address");
            let base = line.trim().to_owned();
            assert!(
                base.starts_with("http://127.0.0.1:"),
                "whatsapp-booking said {base:?}"
            );
            (child, base)
        })
        .await
        .expect("starting whatsapp-booking");
        let client = reqwest::Client::builder()
            .no_proxy()
            .timeout(crate::support::DEADLINE)
            .build()
            .expect("building a reqwest client");
        BookingService {
            child,
            base,
            client,
        }
    }

    fn webhook_url(&self) -> String {
        format!("{}/webhooks/whatsapp", self.base)
    }

    /// POSTs a delivery straight to the service; the status and JSON body.
    async fn deliver(&self, headers: &[(String, String)], body: &[u8]) -> (u16, Value) {
        let mut req = self.client.post(self.webhook_url()).body(body.to_vec());
        for (name, value) in headers {
            req = req.header(name.as_str(), value.as_str());
        }
        let res = req.send().await.expect("delivering to whatsapp-booking");
        let status = res.status().as_u16();
        let bytes = res.bytes().await.expect("reading the service's answer");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// `GET /bookings`.
    async fn bookings(&self) -> Vec<Value> {
        let res = self
            .client
            .get(format!("{}/bookings", self.base))
            .send()
            .await
            .expect("GET /bookings");
        assert_eq!(res.status().as_u16(), 200, "GET /bookings");
        let body: Value = res.json().await.expect("GET /bookings is JSON");
        body["bookings"].as_array().expect("bookings").clone()
    }
}

impl Drop for BookingService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One WhatsApp Cloud API POST, as Meta sends it (non-ASCII escaped): an inbound text message
/// `wamid` and a `delivered` status of the outbound message `outbound`.
fn whatsapp_post(wamid: &str, outbound: &str) -> Vec<u8> {
    format!(
        r#"{{
  "object": "whatsapp_business_account",
  "entry": [
    {{
      "id": "102290129340398",
      "changes": [
        {{
          "field": "messages",
          "value": {{
            "messaging_product": "whatsapp",
            "metadata": {{ "display_phone_number": "15550783881", "phone_number_id": "106540352242922" }},
            "contacts": [ {{ "profile": {{ "name": "Ren\u00e9e Lef\u00e8vre" }}, "wa_id": "16505551234" }} ],
            "messages": [
              {{
                "from": "16505551234",
                "id": "{wamid}",
                "timestamp": "1798135200",
                "type": "text",
                "text": {{ "body": "{BOOKING_TEXT}" }}
              }}
            ],
            "statuses": [
              {{
                "id": "{outbound}",
                "status": "delivered",
                "timestamp": "1798135201",
                "recipient_id": "16505551234"
              }}
            ]
          }}
        }}
      ]
    }}
  ]
}}
"#
    )
    .into_bytes()
}

/// The headers Meta sends with `body`: `X-Hub-Signature-256` with the app secret.
fn meta_headers(body: &[u8]) -> Vec<(String, String)> {
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    headers.extend(WhatsApp::default().sign(&SignRequest {
        body,
        secret: &Secret::from_text(APP_SECRET),
        now: Timestamp::now(),
        event_key: "",
        event_type: None,
        url: "",
    }));
    headers
}

/// The headers of one gateway attempt at delivering `body` under `key`, signed now.
fn gateway_headers(key: &str, body: &[u8]) -> Vec<(String, String)> {
    let secret = decode_secret(&Secret::from_text(DESTINATION_SECRET)).expect("a whsec_ secret");
    let timestamp = Timestamp::now().as_millis() / 1000;
    vec![
        ("content-type".to_owned(), "application/json".to_owned()),
        ("idempotency-key".to_owned(), key.to_owned()),
        ("webhook-id".to_owned(), key.to_owned()),
        ("webhook-timestamp".to_owned(), timestamp.to_string()),
        (
            "webhook-signature".to_owned(),
            sign_v1(&secret, key, timestamp, body),
        ),
    ]
}

/// A gateway whose WhatsApp source delivers to `service`, signed with the destination secret.
async fn gateway_for(handler: &Handler, service: &BookingService) -> Gateway {
    let extra_config = format!(
        r#"[[sources]]
name = "{SOURCE}"
provider = "whatsapp"
secrets = ["{APP_SECRET}"]
destinations = ["booking"]

[[destinations]]
name = "booking"
url = "{url}"
allow = ["127.0.0.1"]
secret = "{DESTINATION_SECRET}"
"#,
        url = service.webhook_url()
    );
    let options = Options {
        extra_config,
        ..Options::default()
    };
    Gateway::start_with(handler, options).await
}

/// The whole flow against a service on `db`; returns the message id that was booked.
async fn one_booking_however_often_delivered(db: &str) -> String {
    // The stripe and github sources deliver to this handler; nothing is sent to them here.
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let service = BookingService::start(db).await;
    let gateway = gateway_for(&handler, &service).await;
    let wamid = format!("wamid.{}", unique("booking"));
    let outbound = format!("wamid.{}", unique("outbound"));
    let message_key = format!("{SOURCE}:{wamid}");
    let status_key = format!("{SOURCE}:{outbound}:delivered");
    let body = whatsapp_post(&wamid, &outbound);

    // Meta's retries: 10 in a row, then 32 at once, each freshly signed.
    let mut verdicts = Vec::new();
    for _ in 0..10 {
        let (code, answer) = gateway
            .post(SOURCE, &meta_headers(&body), body.clone())
            .await;
        assert_eq!(code, 200, "{answer}");
        verdicts.push(answer["status"].as_str().unwrap_or("").to_owned());
    }
    let ingest = gateway.ingest();
    let concurrent: Vec<_> = (0..32)
        .map(|_| {
            let (ingest, body) = (ingest.clone(), body.clone());
            tokio::spawn(async move { ingest.post(SOURCE, &meta_headers(&body), body).await })
        })
        .collect();
    for task in concurrent {
        let (code, answer) = task.await.expect("a sender task");
        assert_eq!(code, 200, "{answer}");
        verdicts.push(answer["status"].as_str().unwrap_or("").to_owned());
    }
    let accepted = verdicts.iter().filter(|v| *v == "accepted").count();
    let duplicates = verdicts.iter().filter(|v| *v == "duplicate").count();
    assert_eq!((accepted, duplicates), (1, 41), "{verdicts:?}");

    // One outbox row per item, each delivered (the service answered 200 to both).
    gateway
        .wait_for_delivery_state(&message_key, "delivered")
        .await;
    gateway
        .wait_for_delivery_state(&status_key, "delivered")
        .await;
    let bookings = service.bookings().await;
    assert_eq!(bookings.len(), 1, "{bookings:#?}");
    assert_eq!(bookings[0]["message_id"], wamid.as_str());
    assert_eq!(bookings[0]["phone"], "16505551234");
    assert_eq!(bookings[0]["slot"], "2026-12-24 19:00");

    // The gateway's own retries, straight at the service: same key, fresh signature.
    for _ in 0..10 {
        let (code, answer) = service
            .deliver(&gateway_headers(&message_key, &body), &body)
            .await;
        assert_eq!(
            (code, &answer["outcome"]),
            (200, &"duplicate".into()),
            "{answer}"
        );
    }
    let concurrent: Vec<_> = (0..16)
        .map(|_| {
            let headers = gateway_headers(&message_key, &body);
            let (url, body) = (service.webhook_url(), body.clone());
            let client = service.client.clone();
            tokio::spawn(async move {
                let mut req = client.post(url).body(body);
                for (name, value) in &headers {
                    req = req.header(name.as_str(), value.as_str());
                }
                let res = req.send().await.expect("delivering to whatsapp-booking");
                let status = res.status().as_u16();
                let answer: Value = res.json().await.unwrap_or(Value::Null);
                (status, answer)
            })
        })
        .collect();
    for task in concurrent {
        let (code, answer) = task.await.expect("a delivery task");
        assert_eq!(
            (code, &answer["outcome"]),
            (200, &"duplicate".into()),
            "{answer}"
        );
    }
    // The status delivery again: acknowledged, ignored.
    let (code, answer) = service
        .deliver(&gateway_headers(&status_key, &body), &body)
        .await;
    assert_eq!(code, 200, "{answer}");
    assert_eq!(answer["outcome"], "ignored", "{answer}");

    // Not from the gateway: refused before anything is read; not JSON: 400 with a code.
    let (code, answer) = service.deliver(&meta_headers(&body), &body).await;
    assert_eq!((code, &answer["code"]), (401, &"missing_signature".into()));
    let garbage = b"{\"entry\": [".to_vec();
    let (code, answer) = service
        .deliver(
            &gateway_headers(&format!("{SOURCE}:wamid.x"), &garbage),
            &garbage,
        )
        .await;
    assert_eq!(
        (code, &answer["code"]),
        (400, &"invalid_json".into()),
        "{answer}"
    );
    assert!(answer["message"].is_string(), "{answer}");

    let bookings = service.bookings().await;
    assert_eq!(bookings.len(), 1, "{bookings:#?}");
    assert_eq!(bookings[0]["message_id"], wamid.as_str());
    // Nothing went to the other destination.
    assert_eq!(handler.total(), 0);
    wamid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whatsapp_message_delivered_42_times_plus_retries_books_once_sqlite() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let db = format!("sqlite://{}", dir.path().join("bookings.db").display());
    one_booking_however_often_delivered(&db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whatsapp_message_delivered_42_times_plus_retries_books_once_postgres() {
    let Some(database) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let wamid = one_booking_however_often_delivered(&database.url()).await;
    // Counted in the database itself, not through the service.
    let mut conn = sqlx::PgConnection::connect(&database.url())
        .await
        .expect("connecting to the test database");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM bookings WHERE message_id = $1")
        .bind(&wamid)
        .fetch_one(&mut conn)
        .await
        .expect("counting bookings");
    assert_eq!(rows, 1);
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM hooklatch_processed")
        .fetch_one(&mut conn)
        .await
        .expect("counting claims");
    assert_eq!(claims, 1);
    drop(conn);
    database.drop_now().await;
}

/// The README's `check` of the booking service: `send`'s booking test event, sent as the
/// gateway delivers it (signed with the destination's secret), passes all four phases with one
/// booking per message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_as_the_gateway_delivers_books_each_message_once() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let db = format!("sqlite://{}", dir.path().join("bookings.db").display());
    let service = BookingService::start(&db).await;
    let url = service.webhook_url();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_hooklatch"))
            .args([
                "check",
                "--provider",
                "whatsapp",
                "--event",
                "message.booking",
            ])
            .args([
                "--secret",
                APP_SECRET,
                "--destination-secret",
                DESTINATION_SECRET,
            ])
            .args(["--to", &url, "--conflict", "--json", "--db", &db])
            .args([
                "--effects-sql",
                "SELECT count(*) FROM bookings WHERE message_id = :key",
            ])
            .output()
            .expect("running hooklatch check")
    })
    .await
    .unwrap();
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|_| {
        panic!("{}", String::from_utf8_lossy(&out.stderr));
    });
    assert_eq!(out.status.code(), Some(0), "{report:#}");
    for phase in report["phases"].as_array().expect("phases") {
        assert_eq!(phase["after"], 1, "{phase:#}");
    }
    assert_eq!(
        service.bookings().await.len(),
        2,
        "one per message, A and B"
    );
}
