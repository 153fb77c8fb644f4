//! A store that runs out of space.
//!
//! Proves that when the SQLite file reaches its size cap (`?max_page_count=N`), ingest answers
//! 503 with a `store_full` (or `store_unavailable`) code and a `Retry-After`, never 2xx: every
//! event answered 2xx is in history and is delivered, and no event answered 503 left a trace
//! in history or reached the destination. And that a full store, SQLite or PostgreSQL, is not
//! ready until there is room again, then takes events without a restart.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::Command;

use hooklatch_core::Timestamp;
use serde_json::Value;
use sqlx::Connection;

use crate::postgres::Database;
use crate::support::{
    eventually, stripe_headers, stripe_headers_signed, stripe_invoice_paid_padded, unique,
    wait_until, Behaviour, Gateway, Handler, Options,
};
use crate::test_database::on_a_runtime_of_its_own;

/// Events sent before giving up on ever filling the store.
const MAX_EVENTS: usize = 200;
/// Events sent after the first 503, to see that a full store keeps refusing honestly.
const AFTER_FULL: usize = 5;

/// What each event sent to a filling store was answered: (event id, status, JSON body).
type Answered = Vec<(String, u16, Value)>;

/// A gateway on a SQLite file capped at the schema's size, measured rather than assumed, plus
/// 24 pages of 4 KiB: room for a handful of 8 KiB events. Returns it and the cap.
async fn capped_gateway(handler: &Handler, options: Options) -> (Gateway, u64) {
    let mut gw = Gateway::start_with(handler, options).await;
    gw.sigterm();
    assert!(gw.wait_exit().await.success());
    let cap = gw.database_pages() + 24;
    gw.reconfigure(|o| o.max_page_count = Some(cap));
    gw.restart().await;
    (gw, cap)
}

/// An 8 KiB event as every SQLite test here sends it.
fn padded(event_id: &str) -> Vec<u8> {
    stripe_invoice_paid_padded(event_id, 5000, 8 * 1024)
}

/// Sends events made by `body` until the store answers 503, and [`AFTER_FULL`] more: every
/// answer is a 200 or a 503 with a `Retry-After`. Returns the answers and the index of the
/// first 503.
async fn fill(
    gw: &Gateway,
    source: &str,
    run: &str,
    body: impl Fn(&str) -> Vec<u8>,
) -> (Answered, usize) {
    let ingest = gw.ingest();
    let mut answered = Vec::new();
    let mut first_full = None;
    for i in 0..MAX_EVENTS {
        let event_id = format!("{run}_{i:03}");
        let body = body(&event_id);
        let res = ingest
            .send(source, &stripe_headers(&body), body)
            .await
            .expect("the gateway answers");
        let status = res.status().as_u16();
        let retry_after = res.headers().get("retry-after").cloned();
        let json: Value = res.json().await.unwrap_or(Value::Null);
        assert!(
            status == 200 || status == 503,
            "{event_id}: {status} {json}"
        );
        if status == 503 {
            assert!(retry_after.is_some(), "a 503 says when to retry");
            first_full.get_or_insert(i);
        }
        answered.push((event_id, status, json));
        if first_full.is_some_and(|f| i >= f + AFTER_FULL) {
            break;
        }
    }
    let first_full = first_full.unwrap_or_else(|| panic!("no 503 after {MAX_EVENTS} events"));
    assert!(first_full > 0, "the store had room for at least one event");
    (answered, first_full)
}

/// Each answer against history: a 200 `accepted` with its one record, a 503 `store_full` (or
/// `store_unavailable`) with none. Returns the accepted events' delivery keys.
async fn check_history(gw: &Gateway, source: &str, answered: &Answered) -> Vec<String> {
    let mut accepted = Vec::new();
    for (event_id, status, json) in answered {
        let history = gw.requests(&format!("key={event_id}")).await;
        if *status == 200 {
            assert_eq!(json["status"], "accepted", "{json}");
            assert_eq!(history.len(), 1, "{event_id} answered 2xx: {history:#?}");
            assert_eq!(history[0]["verdict"], "accepted");
            accepted.push(format!("{source}:{event_id}"));
        } else {
            let code = json["code"].as_str().unwrap_or("");
            assert!(
                code == "store_full" || code == "store_unavailable",
                "{event_id}: {json}"
            );
            assert!(history.is_empty(), "{event_id} answered 503: {history:#?}");
        }
    }
    accepted
}

/// `/readyz` answers 503 "store full" three times running, and the gauge says full; and a
/// small forged request refused meanwhile (its record small enough to fit where an event does
/// not) changes neither: only an event kept, or the probe, says there is room.
async fn assert_full(gw: &Gateway) {
    let forged = br#"{"id":"evt_forged","type":"invoice.paid"}"#.to_vec();
    let headers = stripe_headers_signed(&forged, "whsec_not_the_sources_secret", Timestamp::now());
    let (status, answer) = gw.post("stripe", &headers, forged).await;
    assert!(status == 401 || status == 400, "{status} {answer}");
    for _ in 0..3 {
        let (status, ready) = gw.admin_get("/readyz").await;
        assert_eq!(
            (status, ready["reason"].as_str()),
            (503, Some("store full")),
            "{ready}"
        );
    }
    assert!(
        gw.metrics().await.contains("hooklatch_store_full 1"),
        "the gauge says full"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_answers_503_and_never_2xx_for_an_event_it_did_not_keep() {
    let mut card = crate::report::Card::new("T3", "sqlite");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let (gw, cap) = capped_gateway(&handler, Options::default()).await;
    let run = unique("evt_full");
    let (answered, first_full) = fill(&gw, "stripe", &run, padded).await;

    let accepted = check_history(&gw, "stripe", &answered).await;

    wait_until("every event answered 2xx is delivered", || {
        let seen = handler.distinct_keys();
        accepted.iter().all(|k| seen.contains(k))
    })
    .await;
    let seen = handler.distinct_keys();
    for (event_id, status, _) in &answered {
        if *status == 503 {
            assert!(!seen.contains(&format!("stripe:{event_id}")), "{event_id}");
        }
    }
    card.count("ops", answered.len())
        .count("acked", accepted.len())
        .count("lost", 0)
        .fault("disk_full", 1)
        .figure("cap_pages", cap)
        .figure("first_503_at_event", first_full);
    println!(
        "store full: cap {cap} pages, {} events accepted, first 503 at event {first_full}",
        accepted.len()
    );
}

/// A Stripe source whose keys are kept for a second, so the purge can make room.
const SHORT: &str = "stripe-short";

/// `/readyz` while the store is full, and after: 503 "store full" (and `hooklatch_store_full`
/// 1) from the first event the store could not keep, for as long as nothing makes room; ready
/// again, without a restart, once the purge removed expired keys and the delivered events'
/// history, and the next event is accepted. The destination is disabled while the store
/// fills, so every accepted event's delivery is held and nothing can be purged until it is
/// enabled: the not-ready state is watched with nothing racing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_is_not_ready_until_room_is_made_and_then_takes_events_again() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let (gw, _) = capped_gateway(
        &handler,
        Options {
            store_config: "history_retention = \"1s\"\npurge_interval = \"1s\"",
            extra_config: format!(
                "[[sources]]\nname = \"{SHORT}\"\nprovider = \"stripe\"\nsecrets = [\"env:E2E_STRIPE_SECRET\"]\nretention = \"1s\"\ndestinations = [\"app\"]\n"
            ),
            ..Options::default()
        },
    )
    .await;
    let (status, _) = gw.admin_post("/v1/destinations/app/disable").await;
    assert_eq!(status, 200);
    let (status, ready) = gw.admin_get("/readyz").await;
    assert_eq!(status, 200, "{ready}");

    let run = unique("evt_room");
    let (answered, _) = fill(&gw, SHORT, &run, padded).await;
    assert_full(&gw).await;

    let (status, _) = gw.admin_post("/v1/destinations/app/enable").await;
    assert_eq!(status, 200);
    let accepted: Vec<String> = answered
        .iter()
        .filter(|(_, status, _)| *status == 200)
        .map(|(id, _, _)| format!("{SHORT}:{id}"))
        .collect();
    wait_until("every accepted event is delivered", || {
        let seen = handler.distinct_keys();
        accepted.iter().all(|k| seen.contains(k))
    })
    .await;
    eventually("the purge made room and the gateway is ready", async || {
        gw.admin_get("/readyz").await.0 == 200
    })
    .await;
    let event_id = format!("{run}_after");
    let body = padded(&event_id);
    let (status, answer) = gw.post(SHORT, &stripe_headers(&body), body).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("accepted")));
    assert!(
        gw.metrics().await.contains("hooklatch_store_full 0"),
        "the gauge says there is room"
    );
    wait_until("the event after the purge is delivered", || {
        handler
            .distinct_keys()
            .contains(&format!("{SHORT}:{event_id}"))
    })
    .await;
}

/// `len` hex digits of a xorshift sequence seeded from `seed`: padding no compressor shrinks
/// much, so an event takes its size on disk (PostgreSQL compresses what it stores out of line).
fn noise(seed: &str, len: usize) -> String {
    let mut x = seed.bytes().fold(0x9e37_79b9_7f4a_7c15_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    }) | 1;
    let mut out = String::with_capacity(len);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.push_str(&format!("{x:016x}"));
    }
    out.truncate(len);
    out
}

/// An event of about 8 KiB whose padding does not compress.
fn incompressible(event_id: &str) -> Vec<u8> {
    let body = String::from_utf8(stripe_invoice_paid_padded(event_id, 5000, 0)).expect("UTF-8");
    body.replacen(
        r#""note": """#,
        &format!(r#""note": "{}""#, noise(event_id, 8 * 1024)),
        1,
    )
    .into_bytes()
}

/// A PostgreSQL tablespace on a tmpfs of its own (mounted for the server's OS user), and the
/// test database moved into it, so the database's files can fill while the server's WAL and
/// every other database keep their room. Dropped in order, even after a panic: the database,
/// the tablespace, the mount.
struct SmallTablespace {
    admin_url: String,
    name: String,
    dir: PathBuf,
    db: Option<Database>,
}

impl SmallTablespace {
    /// Mounts the tmpfs (64 MiB until [`SmallTablespace::shrink`]), makes the tablespace and
    /// moves `db` into it. `None`, after printing why, where the server's data directory is
    /// not on this machine or this process may not mount a file system.
    async fn create(db: Database) -> Option<SmallTablespace> {
        let admin_url = std::env::var("HOOKLATCH_TEST_POSTGRES_URL").ok()?;
        let mut admin = sqlx::PgConnection::connect(&admin_url)
            .await
            .expect("connecting to HOOKLATCH_TEST_POSTGRES_URL");
        let data_dir: String = sqlx::query_scalar("SELECT current_setting('data_directory')")
            .fetch_one(&mut admin)
            .await
            .expect("the server's data directory");
        let Ok(owner) = std::fs::metadata(&data_dir) else {
            println!("skipped: PostgreSQL's data directory {data_dir} is not on this machine");
            return None;
        };
        let name = unique("hooklatch_small");
        let dir = std::env::temp_dir().join(&name);
        std::fs::create_dir_all(&dir).expect("a mount point");
        let options = format!("size=64m,mode=0700,uid={},gid={}", owner.uid(), owner.gid());
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &options, "hooklatch-test"])
            .arg(&dir)
            .output()
            .expect("running mount");
        if !mounted.status.success() {
            let _ = std::fs::remove_dir(&dir);
            println!(
                "skipped: mounting a tmpfs for a small tablespace: {}",
                String::from_utf8_lossy(&mounted.stderr).trim()
            );
            return None;
        }
        let db_name = db.name().to_owned();
        let ts = SmallTablespace {
            admin_url,
            name,
            dir,
            db: Some(db),
        };
        let location = ts.dir.to_str().expect("a UTF-8 temp dir");
        sqlx::query(&format!(
            "CREATE TABLESPACE \"{}\" LOCATION '{location}'",
            ts.name
        ))
        .execute(&mut admin)
        .await
        .expect("creating the tablespace");
        sqlx::query(&format!(
            "ALTER DATABASE \"{db_name}\" SET TABLESPACE \"{}\"",
            ts.name
        ))
        .execute(&mut admin)
        .await
        .expect("moving the test database into the tablespace");
        let _ = admin.close().await;
        Some(ts)
    }

    fn url(&self) -> String {
        self.db.as_ref().expect("the database").url()
    }

    /// Bytes used on the tmpfs.
    fn used(&self) -> u64 {
        let out = Command::new("df")
            .args(["-B1", "--output=used"])
            .arg(&self.dir)
            .output()
            .expect("running df");
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .nth(1)
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("df's answer: {text}"))
    }

    /// Sets the tmpfs's size (`mount -o remount,size=…`).
    fn resize(&self, bytes: u64) {
        let status = Command::new("mount")
            .args(["-o", &format!("remount,size={bytes}")])
            .arg(&self.dir)
            .status()
            .expect("running mount");
        assert!(status.success(), "resizing the tmpfs to {bytes} bytes");
    }
}

impl Drop for SmallTablespace {
    fn drop(&mut self) {
        // The database first: a tablespace that holds one cannot be dropped.
        drop(self.db.take());
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        on_a_runtime_of_its_own(async move {
            if let Ok(mut conn) = sqlx::PgConnection::connect(&admin_url).await {
                let _ = sqlx::query(&format!("DROP TABLESPACE IF EXISTS \"{name}\""))
                    .execute(&mut conn)
                    .await;
            }
        });
        let _ = Command::new("umount").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The same as SQLite's full store, on PostgreSQL: the test database lives in a tablespace on
/// a small tmpfs. From the first event that could not be written (PostgreSQL's `53100`,
/// "could not extend file"), ingest answers 503 `store_full` and never 2xx for an event it did
/// not keep, `/readyz` answers 503 "store full" and `hooklatch_store_full` is 1; once the
/// file system has room again (the tmpfs grown), the gateway is ready without a restart and
/// the next event is accepted. Deliveries are held (the destination disabled) so nothing but
/// ingest writes while the database fills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_postgres_database_is_not_ready_until_there_is_room_and_then_takes_events_again() {
    let Some(db) = Database::create(&unique("hooklatch_full")).await else {
        return;
    };
    let Some(ts) = SmallTablespace::create(db).await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(ts.url()),
            ..Options::default()
        },
    )
    .await;
    let (status, _) = gw.admin_post("/v1/destinations/app/disable").await;
    assert_eq!(status, 200);
    // Room for a handful of events beyond what the schema and the catalog take now.
    ts.resize(ts.used() + 192 * 1024);

    let run = unique("evt_pg_full");
    let (answered, first_full) = fill(&gw, "stripe", &run, incompressible).await;
    let accepted = check_history(&gw, "stripe", &answered).await;
    assert_full(&gw).await;
    // Another instance probing the same database at this moment holds `room_probe`: this one
    // answers what it knows, "store full", instead of queueing behind it until `lock_timeout`
    // and answering "store unavailable".
    let mut other = sqlx::PgConnection::connect(&ts.url())
        .await
        .expect("a session of another instance");
    sqlx::raw_sql("BEGIN; LOCK TABLE room_probe IN ACCESS EXCLUSIVE MODE")
        .execute(&mut other)
        .await
        .expect("holding room_probe");
    let (status, ready) = gw.admin_get("/readyz").await;
    assert_eq!(
        (status, ready["reason"].as_str()),
        (503, Some("store full")),
        "{ready}"
    );
    other.close().await.expect("ending that session");

    ts.resize(64 * 1024 * 1024);
    eventually(
        "the database has room and the gateway is ready",
        async || gw.admin_get("/readyz").await.0 == 200,
    )
    .await;
    let event_id = format!("{run}_after");
    let body = incompressible(&event_id);
    let (status, answer) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("accepted")));
    assert!(
        gw.metrics().await.contains("hooklatch_store_full 0"),
        "the gauge says there is room"
    );
    let (status, _) = gw.admin_post("/v1/destinations/app/enable").await;
    assert_eq!(status, 200);
    wait_until(
        "every accepted event, and the one after room came back, is delivered",
        || {
            let seen = handler.distinct_keys();
            seen.contains(&format!("stripe:{event_id}"))
                && accepted.iter().all(|k| seen.contains(k))
        },
    )
    .await;
    println!(
        "postgres full: {} events accepted, first 503 at event {first_full}",
        accepted.len()
    );
    drop(gw);
    drop(ts);
}
