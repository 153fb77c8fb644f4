//! Several `hooklatch serve` processes on one PostgreSQL: the database is the only arbiter.
//!
//! - 1,000 events × 32 concurrent copies spread over three instances → exactly one claim, one
//!   outbox row and one forward per event, and no answer but 200 (a wait-limit 503 would be
//!   retried, as a provider does, and is counted).
//! - kill -9 of one of three instances during a burst, while its deliveries are in flight:
//!   every acknowledged event is forwarded; the dead instance's leased rows are taken over by
//!   the others once the lease runs out.
//!
//! Needs `HOOKLATCH_TEST_POSTGRES_URL` (a user that may create databases); each test makes a
//! database of its own and drops it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::Connection;

use crate::support::{
    eventually_within, one_claim_per_event, stripe_headers, stripe_invoice_paid, unique,
    wait_until_within, Behaviour, Gateway, Handler, Ingest, Options, Retry,
};

pub(crate) use crate::test_database::TestDatabase as Database;

async fn three_gateways(handler: &Handler, db: &Database, timeout: &'static str) -> Vec<Gateway> {
    gateways_on(handler, db, timeout, 3).await
}

/// `n` gateways on one database, delivering to `handler` with the destination `timeout`.
async fn gateways_on(
    handler: &Handler,
    db: &Database,
    timeout: &'static str,
    n: usize,
) -> Vec<Gateway> {
    let mut gateways = Vec::new();
    for _ in 0..n {
        let options = Options {
            store_url: Some(db.url()),
            timeout,
            ..Options::default()
        };
        gateways.push(Gateway::start_with(handler, options).await);
    }
    gateways
}

/// POSTs until an answer other than 503 comes (a provider retries a 503), counting the 503s.
async fn post_until_answered(
    ingest: &Ingest,
    body: &[u8],
    n_503: &AtomicUsize,
) -> Option<(u16, String)> {
    for _ in 0..20 {
        let headers = stripe_headers(body);
        match ingest.try_post("stripe", &headers, body.to_vec()).await {
            Ok((503, _)) => {
                n_503.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Ok((status, json)) => {
                let verdict = json["status"].as_str().unwrap_or_default().to_owned();
                return Some((status, verdict));
            }
            Err(_) => return None,
        }
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_one_postgres_make_one_claim_and_one_forward_per_event() {
    storm_on_postgres(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_on_postgres_makes_one_claim_and_one_forward_per_event() {
    storm_on_postgres(1).await;
}

/// T1 on PostgreSQL: 1,000 ids × 32 copies from 64 senders, each event's copies sent together
/// and spread over `instances` gateways on one database; a 503 (the wait limit) is retried as a
/// provider does, and counted.
async fn storm_on_postgres(instances: usize) {
    let mut card = crate::report::Card::new("T1", "postgres");
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateways = gateways_on(&handler, &db, "10s", instances).await;
    let ingests: Vec<Ingest> = gateways.iter().map(Gateway::ingest).collect();
    let retry = Retry {
        statuses: &[503],
        attempts: 20,
        backoff: Duration::from_millis(50),
    };
    let (ids, n_503) = one_claim_per_event(
        &ingests,
        &gateways[0],
        &handler,
        &mut card,
        "evt_pg_storm",
        32,
        retry,
    )
    .await;
    card.figure("instances", instances);
    println!(
        "T1 postgres×{instances}: ids={} copies=32 forwards={} 503s_retried={n_503}",
        ids.len(),
        handler.total(),
    );
    drop(gateways);
    db.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_one_of_three_instances_loses_no_acknowledged_event() {
    let mut card = crate::report::Card::new("T13", "postgres");
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    // Slow answers keep each instance's deliveries in flight, so the one killed holds leases.
    let handler = Handler::start(Behaviour::SlowOk(200)).await;
    let mut gateways = three_gateways(&handler, &db, "2s").await;
    let ingests: Vec<Ingest> = gateways.iter().map(Gateway::ingest).collect();
    let kill = gateways[0].kill_switch();

    let events = crate::report::scaled(1_000);
    let acked: Arc<Mutex<HashSet<String>>> = Arc::default();
    let n_acked = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let n_503 = Arc::new(AtomicUsize::new(0));
    let mut senders = Vec::new();
    for sender in 0..16 {
        let (acked, n_acked, next, ingests, kill, n_503) = (
            acked.clone(),
            n_acked.clone(),
            next.clone(),
            ingests.clone(),
            kill.clone(),
            n_503.clone(),
        );
        senders.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= events {
                    break;
                }
                let id = format!("evt_pg_kill_{i:04}");
                let body = stripe_invoice_paid(&id, 5000);
                // A load balancer sends to the next instance when one does not answer.
                for hop in 0..ingests.len() {
                    let ingest = &ingests[(i + sender + hop) % ingests.len()];
                    if let Some((200, _)) = post_until_answered(ingest, &body, &n_503).await {
                        acked.lock().expect("acked lock").insert(id.clone());
                        if n_acked.fetch_add(1, Ordering::Relaxed) + 1 == 300 {
                            kill.fire();
                        }
                        break;
                    }
                }
            }
        }));
    }
    for sender in senders {
        sender.await.expect("sender task");
    }
    let acked = acked.lock().expect("acked lock").clone();
    assert!(
        acked.len() > 300,
        "the kill came mid-burst ({} acked)",
        acked.len()
    );

    // The dead instance's leases expire after 2 × 2 s + 10 s; the others take its rows over.
    wait_until_within(
        "every acknowledged event forwarded",
        Duration::from_secs(120),
        || {
            let seen = handler.distinct_keys();
            acked
                .iter()
                .all(|id| seen.contains(&format!("stripe:{id}")))
        },
    )
    .await;
    let seen = handler.distinct_keys();
    let lost = acked
        .iter()
        .filter(|id| !seen.contains(&format!("stripe:{id}")))
        .count();
    assert_eq!(lost, 0);
    eventually_within(
        "no delivery left pending",
        Duration::from_secs(60),
        async || gateways[1].deliveries("state=pending").await.is_empty(),
    )
    .await;
    card.count("ops", events)
        .count("acked", acked.len())
        .count("lost", lost)
        .count("duplicates", handler.total() - seen.len())
        .fault("kill9", 1)
        .figure("forwards", handler.total())
        .figure("retried_503", n_503.load(Ordering::Relaxed));
    println!(
        "T13 postgres×3 kill -9: acked={} lost={lost} forwards={} duplicates={} 503s_retried={}",
        acked.len(),
        handler.total(),
        handler.total() - seen.len(),
        n_503.load(Ordering::Relaxed)
    );
    gateways[0].kill9();
    drop(gateways);
    db.drop_now().await;
}

/// A session holding an uncommitted claim of key X (as another gateway mid-transaction
/// would) makes the gateway's ingest of X wait on the unique index — visible in
/// `pg_stat_activity` as a lock wait — then answer `duplicate` once it commits, or claim X
/// (`accepted`) once it rolls back.
/// Another session's claim of Stripe event `id` (with `body`), inserted and not committed:
/// the session holding it open.
async fn hold_claim(db: &Database, id: &str, body: &[u8]) -> sqlx::PgConnection {
    let sha = hooklatch::core::secret::sha256(body);
    let now = hooklatch::core::Timestamp::now().as_millis();
    let mut holder = sqlx::PgConnection::connect(&db.url())
        .await
        .expect("a second session");
    sqlx::query("BEGIN")
        .execute(&mut holder)
        .await
        .expect("BEGIN");
    sqlx::query(
        "INSERT INTO claims (source, key, body_sha256, request_id, claimed_at, expires_at)
         VALUES ('stripe', $1, $2, 0, $3, $4)",
    )
    .bind(id)
    .bind(&sha[..])
    .bind(now)
    .bind(now + 7 * 86_400_000)
    .execute(&mut holder)
    .await
    .expect("the uncommitted claim");
    holder
}

/// T2, past the wait limit: a claim another session holds uncommitted for longer than the
/// store's `lock_timeout` (1 s here) makes the gateway answer 503 with `Retry-After` — never
/// 2xx, since it cannot know whether that claim will commit; once the
/// holder rolls back, the provider's retry is accepted and delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_held_past_the_wait_limit_is_503_never_2xx_then_the_retry_lands() {
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let mut card = crate::report::Card::new("T2", "postgres");
    let mut url = reqwest::Url::parse(&db.url()).expect("the database URL");
    url.query_pairs_mut().append_pair("lock_timeout", "1s");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(url.to_string()),
            ..Options::default()
        },
    )
    .await;
    let id = unique("evt_pg_wait_limit");
    let body = stripe_invoice_paid(&id, 5000);
    let holder = hold_claim(&db, &id, &body).await;

    let res = gateway
        .ingest()
        .send("stripe", &stripe_headers(&body), body.clone())
        .await
        .expect("an answer, not a hang");
    assert_eq!(
        res.status().as_u16(),
        503,
        "never 2xx while the claim is in doubt"
    );
    assert!(res.headers().contains_key("retry-after"));
    let json: serde_json::Value = res.json().await.expect("a JSON error");
    assert_eq!(json["code"], "store_unavailable", "{json}");

    drop(holder); // the session ends: its transaction rolls back
    let key = format!("stripe:{id}");
    eventually_within("the retry accepted", Duration::from_secs(30), async || {
        let (status, json) = gateway
            .post("stripe", &stripe_headers(&body), body.clone())
            .await;
        (status, json["status"].as_str()) == (200, Some("accepted"))
    })
    .await;
    gateway.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(handler.count_for(&key), 1);
    card.count("ops", 2)
        .count("acked", 1)
        .count("lost", 0)
        .count("duplicates", 0)
        .fault("held_claim", 1);
    drop(gateway);
    db.drop_now().await;
}

/// A fresh database, a handler answering 200, and a gateway on that database with `options`
/// (its `store_url` set to it); `None` where the PostgreSQL tests do not run.
pub(crate) async fn gateway_on_fresh_database(
    options: Options,
) -> Option<(Database, Handler, Gateway)> {
    let db = Database::create(&unique("hooklatch_e2e")).await?;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let options = Options {
        store_url: Some(db.url()),
        ..options
    };
    let gateway = Gateway::start_with(&handler, options).await;
    Some((db, handler, gateway))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncommitted_claim_elsewhere_makes_the_gateway_wait_then_answer() {
    let Some((db, _handler, gateway)) = gateway_on_fresh_database(Options::default()).await else {
        return;
    };
    for (finish, expected) in [("COMMIT", "duplicate"), ("ROLLBACK", "accepted")] {
        let id = unique("evt_pg_wait");
        let body = stripe_invoice_paid(&id, 5000);
        let mut holder = hold_claim(&db, &id, &body).await;

        let ingest = gateway.ingest();
        let post = tokio::spawn({
            let body = body.clone();
            async move { ingest.post("stripe", &stripe_headers(&body), body).await }
        });
        let mut watcher = sqlx::PgConnection::connect(&db.url())
            .await
            .expect("a watching session");
        eventually_within(
            "the gateway's ingest waits on a lock",
            Duration::from_secs(30),
            async || {
                let waiting: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = current_database() AND wait_event_type = 'Lock'",
                )
                .fetch_one(&mut watcher)
                .await
                .expect("pg_stat_activity");
                waiting > 0
            },
        )
        .await;
        assert!(!post.is_finished(), "no answer while the claim is in doubt");

        sqlx::query(finish)
            .execute(&mut holder)
            .await
            .expect(finish);
        let (status, answer) = post.await.expect("the ingest task");
        assert_eq!(status, 200, "{finish}: {answer}");
        assert_eq!(
            answer["status"].as_str(),
            Some(expected),
            "{finish}: {answer}"
        );
    }
    drop(gateway);
    db.drop_now().await;
}

/// Ingest and delivery on separate instances: one with `[delivery] enabled = false` verifies,
/// claims and queues, and attempts nothing; a second instance on the same database delivers
/// what the first queued, each event once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_only_instance_queues_and_another_instance_delivers() {
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let front = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(db.url()),
            deliver: false,
            ..Options::default()
        },
    )
    .await;
    const EVENTS: usize = 40;
    let ids: Vec<String> = (0..EVENTS).map(|_| unique("evt_pg_split")).collect();
    for id in &ids {
        let body = stripe_invoice_paid(id, 1200);
        let (status, json) = front.post("stripe", &stripe_headers(&body), body).await;
        assert_eq!((status, json["status"].as_str()), (200, Some("accepted")));
    }
    // Bounded look for a delivery that must not happen: the ingest-only instance's workers
    // would have taken these within its 100 ms poll interval.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert_eq!(handler.total(), 0, "an ingest-only instance delivered");
    let pending = front.deliveries("state=pending").await;
    assert_eq!(pending.len(), EVENTS);
    assert!(pending.iter().all(|d| d["attempts"] == 0), "{pending:?}");

    let back = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(db.url()),
            ..Options::default()
        },
    )
    .await;
    wait_until_within(
        "the other instance delivers",
        Duration::from_secs(60),
        || handler.distinct_keys().len() == EVENTS,
    )
    .await;
    eventually_within(
        "nothing left pending",
        Duration::from_secs(30),
        async || front.deliveries("state=pending").await.is_empty(),
    )
    .await;
    for id in &ids {
        assert_eq!(handler.count_for(&format!("stripe:{id}")), 1, "{id}");
    }
    drop((front, back));
    db.drop_now().await;
}

/// `hooklatch migrate` on PostgreSQL says which database and what it did: it creates the
/// schema in a database hooklatch never used, then finds it up to date.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_on_postgres_creates_then_finds_the_schema_up_to_date() {
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("hooklatch.toml");
    std::fs::write(&config, format!("[store]\nurl = \"{}\"\n", db.url())).unwrap();
    let migrate = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"))
            .args(["migrate", "--config", config.to_str().unwrap()])
            .output()
            .expect("running hooklatch migrate");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let first = migrate();
    assert!(first.starts_with("postgres postgres://"), "{first}");
    assert!(first.contains(db.name()), "{first}");
    let (_, version) = first
        .trim()
        .split_once(": created, schema version ")
        .unwrap_or_else(|| panic!("{first}"));
    let again = migrate();
    assert!(
        again
            .trim()
            .ends_with(&format!(": up to date, schema version {version}")),
        "{again}"
    );
    db.drop_now().await;
}

/// A rolling deploy that adds a destination: an instance still on the old configuration
/// leases a delivery to it and puts it back, uncounted, instead of dead-lettering it; an
/// instance that has the destination delivers it, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_without_a_destination_leaves_its_deliveries_to_one_that_has_it() {
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let newer = format!(
        r#"
[[sources]]
name = "stripe_new"
provider = "stripe"
secrets = ["env:E2E_STRIPE_SECRET"]
destinations = ["added"]

[[destinations]]
name = "added"
url = "{}"
allow = ["127.0.0.1"]
"#,
        handler.url()
    );
    let front = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(db.url()),
            deliver: false,
            extra_config: newer.clone(),
            ..Options::default()
        },
    )
    .await;
    let id = unique("evt_pg_added");
    let body = stripe_invoice_paid(&id, 1300);
    let (status, json) = front.post("stripe_new", &stripe_headers(&body), body).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );

    // The old configuration: no "added" destination.
    let old = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(db.url()),
            ..Options::default()
        },
    )
    .await;
    wait_until_within(
        "the old instance leased the delivery and put it back",
        Duration::from_secs(30),
        || {
            old.log()
                .contains("a destination this instance does not have")
        },
    )
    .await;
    let key = format!("stripe_new:{id}");
    let rows = front.deliveries_for(&key).await;
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0]["state"], "pending", "{rows:#?}");
    assert_eq!(rows[0]["attempts"], 0, "{rows:#?}");
    assert_eq!(handler.total(), 0);

    let new = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(db.url()),
            extra_config: newer,
            ..Options::default()
        },
    )
    .await;
    new.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(handler.count_for(&key), 1);
    drop((front, old, new));
    db.drop_now().await;
}

/// The same text for an event type in every attempt on PostgreSQL, whose `TEXT` cannot hold
/// the NUL the request carried (`retries::event_type_of_each_attempt`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_type_with_a_nul_reaches_every_attempt_alike_on_postgres() {
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let types = crate::retries::event_type_of_each_attempt(Options {
        store_url: Some(db.url()),
        ..Options::default()
    })
    .await;
    let kept = Some("invoice.\u{fffd}paid".to_owned());
    assert_eq!(types, vec![kept.clone(), kept]);
    db.drop_now().await;
}

/// A server setting that can lose acknowledged events (`synchronous_commit=off`, seen by the
/// gateway's own connections through the URL's `options`) stops `serve` at start, naming it;
/// `--allow-unsafe-durability` (here its variable) lets it start with a warning and the gauge
/// `hooklatch_unsafe_durability` at 1, which a safe gateway keeps at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsafe_durability_stops_serve_unless_allowed_and_then_warns_and_sets_the_gauge() {
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let safe = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(db.url()),
            ..Options::default()
        },
    )
    .await;
    assert_eq!(safe.metric("hooklatch_unsafe_durability").await, 0.0);
    drop(safe);

    let off = format!("{}?options=-c%20synchronous_commit%3Doff", db.url());
    let mut allowed = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(off),
            extra_env: vec![(
                "HOOKLATCH_ALLOW_UNSAFE_DURABILITY".to_owned(),
                "true".to_owned(),
            )],
            ..Options::default()
        },
    )
    .await;
    assert_eq!(allowed.metric("hooklatch_unsafe_durability").await, 1.0);
    let log = allowed.log();
    assert!(
        log.contains("UNSAFE durability settings") && log.contains("synchronous_commit=off"),
        "{}",
        allowed.log_tail(20)
    );
    let key = allowed.send_stripe_event("stripe", "evt_unsafe").await;
    allowed.wait_for_delivery_state(&key, "delivered").await;

    // The same config without the switch: refused at start, naming the setting.
    allowed.reconfigure(|o| o.extra_env.clear());
    let (status, output) = allowed.serve_beside().await;
    let status = status.expect("serve exits by itself");
    assert!(!status.success(), "{output}");
    assert!(output.contains("synchronous_commit=off"), "{output}");
    assert!(!output.contains("hooklatch is ready"), "{output}");
    drop(allowed);
    db.drop_now().await;
}

/// PostgreSQL over verified TLS: the store URL's `sslmode=verify-full` with `sslrootcert` set
/// to the server's own certificate (as a private CA's would be) serves, and the gateway's
/// connections are encrypted (`pg_stat_ssl`); the same URL trusting another CA stops `serve`
/// at start, saying why. Skips (saying so) when the server has no TLS or its certificate file
/// cannot be read, which the machines this runs on do not do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_over_verified_tls_serves_and_another_ca_stops_the_start() {
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let mut conn = sqlx::PgConnection::connect(&db.url())
        .await
        .expect("connecting to the test database");
    let show = async |conn: &mut sqlx::PgConnection, what: &str| -> String {
        sqlx::query_scalar(&format!("SHOW {what}"))
            .fetch_one(conn)
            .await
            .expect("SHOW")
    };
    let (ssl, cert) = (
        show(&mut conn, "ssl").await,
        show(&mut conn, "ssl_cert_file").await,
    );
    let cert_readable = std::path::Path::new(&cert).is_absolute()
        && std::fs::read_to_string(&cert).is_ok_and(|pem| pem.contains("BEGIN CERTIFICATE"));
    if ssl != "on" || !cert_readable {
        println!("skipped: the PostgreSQL server has no TLS (ssl = {ssl}) or its certificate {cert:?} cannot be read");
        let _ = conn.close().await;
        db.drop_now().await;
        return;
    }
    // By the name the certificate holds (Debian's own names `localhost`): the driver checks
    // it even under `verify-ca` (README, "Several instances on PostgreSQL").
    let by_name = db.url().replacen("@127.0.0.1:", "@localhost:", 1);
    let verified = |root: &str| format!("{by_name}?sslmode=verify-full&sslrootcert={root}");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(verified(&cert)),
            ..Options::default()
        },
    )
    .await;
    let key = gw.send_stripe_event("stripe", "evt_pg_tls").await;
    gw.wait_for_delivery_state(&key, "delivered").await;
    let encrypted: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
         WHERE a.datname = $1 AND s.ssl AND a.pid <> pg_backend_pid()",
    )
    .bind(db.name())
    .fetch_one(&mut conn)
    .await
    .expect("pg_stat_ssl");
    assert!(encrypted > 0, "the gateway's connections use TLS");
    let _ = conn.close().await;

    let other = hooklatch_testkit::tls::TestCa::new("not the database's CA");
    let other_file = tempfile::NamedTempFile::new().expect("a temp file");
    std::fs::write(other_file.path(), other.pem()).expect("writing the CA");
    let other_root = other_file.path().display().to_string();
    gw.reconfigure(|o| o.store_url = Some(verified(&other_root)));
    let (status, output) = gw.serve_beside().await;
    let status = status.expect("serve exits by itself");
    assert!(!status.success(), "{output}");
    assert!(output.contains("certificate"), "{output}");
    drop(gw);
    db.drop_now().await;
}

/// T3, an outage: PostgreSQL cut off by a fault proxy between the gateway and the server,
/// which closes every connection and refuses new ones (`down`), resets them (`reset_peer`),
/// or holds every byte and closes them after a limit (`timeout`). A new event is answered 503 `store_unavailable` with `Retry-After`, never
/// 2xx, and `/readyz` says 503; once the server is reachable again the gateway is ready without
/// a restart, the provider's retry is accepted, and both events are delivered once.
async fn postgres_outage(fault: &str, cut: impl FnOnce(&hooklatch_testkit::proxy::FaultProxy)) {
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let mut card = crate::report::Card::new("T3", "postgres");
    let (proxy, url) = crate::support::proxied(&db.url(), 5432).await;
    let mut url = reqwest::Url::parse(&url).expect("the proxied URL");
    // A short wait limit: connecting through the cut proxy fails after it plus 5 s.
    url.query_pairs_mut().append_pair("lock_timeout", "1s");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(url.to_string()),
            ..Options::default()
        },
    )
    .await;
    let before = gw.send_stripe_event("stripe", "evt_before_outage").await;
    gw.wait_for_delivery_state(&before, "delivered").await;

    cut(&proxy);
    let answered_in =
        crate::support::outage_then_recovery(&gw, &handler, &proxy, &before, "store_unavailable")
            .await;
    card.count("ops", 3)
        .count("acked", 2)
        .count("lost", 0)
        .count("duplicates", 0)
        .fault(fault, 1)
        .figure("answered_503_in_ms", answered_in.as_millis() as u64)
        .figure("proxied_connections", proxy.accepted());
    drop(gw);
    drop(proxy);
    db.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_is_503_and_not_ready_never_2xx_then_recovers() {
    postgres_outage("down", |proxy| proxy.down()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_connections_reset_are_503_and_not_ready_never_2xx_then_recover() {
    postgres_outage("reset_peer", |proxy| proxy.reset_peer()).await;
}

/// Toxiproxy's `timeout` with a limit: PostgreSQL silent, and every connection closed after
/// 1 s of it (new ones the gateway opens included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_silent_then_cut_off_is_503_and_not_ready_never_2xx_then_recovers() {
    postgres_outage("timeout", |proxy| proxy.timeout(Duration::from_secs(1))).await;
}

/// A database of its own, a handler answering 200, and a gateway whose store URL goes
/// through a fault proxy; `None` without PostgreSQL.
async fn through_proxy() -> Option<(
    Database,
    hooklatch_testkit::proxy::FaultProxy,
    Handler,
    Gateway,
)> {
    let db = Database::create(&unique("hooklatch_e2e")).await?;
    let (proxy, url) = crate::support::proxied(&db.url(), 5432).await;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        Options {
            store_url: Some(url),
            ..Options::default()
        },
    )
    .await;
    Some((db, proxy, handler, gw))
}

/// PostgreSQL on a slow link (the fault proxy's `latency`, then its `slicer`, then its
/// `bandwidth` at 256 KiB/s each way): 100 events under each, every one sent twice at once by
/// 16 senders. Each is answered 200, one copy `accepted` and the other `duplicate` (never a
/// 5xx: the store's waits and timeouts are not tripped by a slow network), and delivered
/// exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_on_a_slow_link_claims_each_event_once_and_delivers_it_once() {
    const EVENTS: usize = 100;
    let Some((db, proxy, handler, gw)) = through_proxy().await else {
        return;
    };
    let mut card = crate::report::Card::new("T3", "postgres");
    let mut keys = Vec::new();
    for fault in ["latency", "slicer", "bandwidth"] {
        match fault {
            "latency" => proxy.set_latency(Duration::from_millis(10)),
            "slicer" => {
                proxy.set_latency(Duration::ZERO);
                proxy.set_slicer(32, Duration::from_millis(1));
            }
            _ => {
                proxy.set_slicer(0, Duration::ZERO);
                proxy.set_bandwidth(256 * 1024);
            }
        }
        let ids: Vec<String> = (0..EVENTS)
            .map(|i| format!("{}_{i:03}", unique(&format!("evt_{fault}"))))
            .collect();
        let mut senders = tokio::task::JoinSet::new();
        for chunk in ids.chunks(EVENTS.div_ceil(8)) {
            for _copy in 0..2 {
                let (ingest, chunk) = (gw.ingest(), chunk.to_vec());
                senders.spawn(async move {
                    let mut verdicts = Vec::new();
                    for id in chunk {
                        let body = stripe_invoice_paid(&id, 5000);
                        let (status, json) =
                            ingest.post("stripe", &stripe_headers(&body), body).await;
                        assert_eq!(status, 200, "{id}: {json}");
                        verdicts.push((id, json["status"].as_str().unwrap_or("").to_owned()));
                    }
                    verdicts
                });
            }
        }
        let mut answers: HashMap<String, Vec<String>> = HashMap::new();
        for (id, verdict) in senders.join_all().await.into_iter().flatten() {
            answers.entry(id).or_default().push(verdict);
        }
        for (id, mut verdicts) in answers {
            verdicts.sort();
            assert_eq!(verdicts, ["accepted", "duplicate"], "{id} under {fault}");
            keys.push(format!("stripe:{id}"));
        }
        card.fault(fault, 1);
    }
    proxy.set_bandwidth(0);
    wait_until_within("every event delivered", Duration::from_secs(120), || {
        keys.iter().all(|k| handler.count_for(k) >= 1)
    })
    .await;
    let repeated: usize = keys.iter().map(|k| handler.count_for(k) - 1).sum();
    assert_eq!(repeated, 0, "no event delivered twice");
    card.count("ops", 6 * EVENTS)
        .count("acked", 3 * EVENTS)
        .count("lost", 0)
        .count("duplicates", repeated)
        .figure("proxied_connections", proxy.accepted());
    drop(gw);
    drop(proxy);
    db.drop_now().await;
}

/// T3, a PostgreSQL connection cut at any byte (the fault proxy's `limit_data`). The test
/// first measures the bytes each way of one ingest on fresh connections (the most one
/// connection carried), then sweeps a data limit across that span and half as far again,
/// upstream and then downstream, each cut at a point of its step drawn from the card's seed:
/// every connection the gateway opens is closed once that many bytes have passed that way on
/// it — inside its start-up, a statement, or the answer to one, a commit's included — while
/// one new event is sent. The answer is 200 or 503 `store_unavailable` with `Retry-After`, nothing else; once the limit
/// is lifted, the provider's retry is 200, and `duplicate` whenever the first answer was 200
/// (an acknowledged event is stored). At the end each event has one claim and one outbox row
/// in the database and is delivered. A 503 whose retry says `duplicate` is the cut that fell
/// after the commit and before its answer reached the gateway: counted on the card.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_connection_cut_at_any_byte_loses_nothing_and_claims_once() {
    use hooklatch_testkit::proxy::Direction;
    // Finer downstream, where the answer to the commit is (times `HOOKLATCH_SCALE`).
    const STEPS: [usize; 2] = [16, 40];
    let Some((db, proxy, handler, gw)) = through_proxy().await else {
        return;
    };
    let mut card = crate::report::Card::new("T3", "postgres");
    let seed = card.seed();
    let before = gw.send_stripe_event("stripe", "evt_before_cuts").await;
    gw.wait_for_delivery_state(&before, "delivered").await;

    // One ingest's conversation on fresh connections, each way: the most any one of them
    // carried.
    proxy.close_open();
    proxy.reset_counts();
    let measured = gw.send_stripe_event("stripe", "evt_measured").await;
    let span = |d: Direction| proxy.most_on_one(d).max(64);
    let spans = [
        (Direction::Upstream, span(Direction::Upstream), STEPS[0]),
        (Direction::Downstream, span(Direction::Downstream), STEPS[1]),
    ]
    .map(|(direction, span, steps)| (direction, span, crate::report::scaled(steps) as u64));

    let mut keys = vec![before, measured];
    let (mut first_ok, mut first_503, mut committed_unanswered) = (0usize, 0usize, 0usize);
    let mut sends = keys.len();
    for (direction, span, steps) in spans {
        for step in 0..=steps {
            // Up to half as far again as the measured span: connections that carry a little
            // more than the one measured (a reconnect, a ping) are cut too, and the last
            // steps let the whole ingest through. Each step lands at a point of its stretch
            // drawn from the seed, so runs with other seeds cut at other bytes.
            let stretch = span * 3 / (2 * steps);
            let limit = stretch * step
                + crate::report::draw(seed, step + 1000 * (direction as u64), stretch);
            proxy.set_limit_data(direction, Some(limit));
            proxy.close_open();
            let id = format!("{}_{limit:06}", unique(&format!("evt_{direction:?}")));
            let body = stripe_invoice_paid(&id, 5000);
            let res = gw
                .ingest()
                .send("stripe", &stripe_headers(&body), body.clone())
                .await
                .expect("an answer, not a hang");
            sends += 1;
            let acked = match res.status().as_u16() {
                200 => {
                    first_ok += 1;
                    true
                }
                503 => {
                    assert!(res.headers().contains_key("retry-after"), "{id}");
                    let json: serde_json::Value = res.json().await.expect("a JSON error");
                    assert_eq!(json["code"], "store_unavailable", "{id}: {json}");
                    first_503 += 1;
                    false
                }
                status => panic!("{id}, {direction:?} cut at {limit} B: {status}"),
            };
            proxy.set_limit_data(direction, None);
            proxy.close_open();
            // The provider's retry, as often as it takes while the gateway reconnects.
            let mut verdict = String::new();
            eventually_within(
                "the retry answered 200",
                Duration::from_secs(60),
                async || {
                    let (status, json) = gw
                        .post("stripe", &stripe_headers(&body), body.clone())
                        .await;
                    sends += 1;
                    assert!(status == 200 || status == 503, "{id}: {status} {json}");
                    verdict = json["status"].as_str().unwrap_or("").to_owned();
                    status == 200
                },
            )
            .await;
            match (acked, verdict.as_str()) {
                (true, "duplicate") | (false, "accepted") => {}
                (false, "duplicate") => committed_unanswered += 1,
                (_, other) => panic!(
                    "{id}, {direction:?} cut at {limit} B: acknowledged {acked}, then {other}"
                ),
            }
            keys.push(format!("stripe:{id}"));
        }
        card.fault(
            match direction {
                Direction::Upstream => "limit_data_upstream",
                Direction::Downstream => "limit_data_downstream",
            },
            steps as usize + 1,
        );
    }
    assert!(
        first_ok > 0 && first_503 > 0,
        "the sweep cut before the work and after it: {first_ok} answered 200 at once, {first_503} 503"
    );

    wait_until_within("every event delivered", Duration::from_secs(120), || {
        keys.iter().all(|k| handler.count_for(k) >= 1)
    })
    .await;
    let mut conn = sqlx::PgConnection::connect(&db.url())
        .await
        .expect("a session");
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM claims")
        .fetch_one(&mut conn)
        .await
        .expect("counting claims");
    assert_eq!(claims as usize, keys.len(), "one claim per event");
    let doubled: Vec<(String, i64)> = sqlx::query_as(
        "SELECT event_key, count(*) FROM deliveries GROUP BY source, event_key HAVING count(*) <> 1",
    )
    .fetch_all(&mut conn)
    .await
    .expect("counting outbox rows");
    assert!(doubled.is_empty(), "one outbox row per event: {doubled:?}");
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM deliveries")
        .fetch_one(&mut conn)
        .await
        .expect("counting outbox rows");
    assert_eq!(rows as usize, keys.len());
    let _ = conn.close().await;
    let repeated: usize = keys.iter().map(|k| handler.count_for(k) - 1).sum();
    // Each repeat's row with its attempts, for whoever reads a run's log: when each attempt
    // started tells which lease ran out.
    for k in &keys {
        if handler.count_for(k) > 1 {
            eprintln!(
                "REPEATED {k}: {:#}",
                serde_json::Value::Array(gw.deliveries_for(k).await)
            );
        }
    }
    let records_again = r#"hooklatch_attempt_record_retries_total{outcome="recorded"}"#;
    let recorded_again = gw.metric(records_again).await as usize;
    let gave_up = r#"hooklatch_attempt_record_retries_total{outcome="gave_up"}"#;
    let gave_up = gw.metric(gave_up).await as usize;
    card.count("ops", sends)
        .count("acked", keys.len())
        .count("lost", 0)
        .count("duplicates", repeated)
        .figure("records_made_again", recorded_again)
        .figure("records_given_up", gave_up)
        .figure("first_answer_200", first_ok)
        .figure("first_answer_503", first_503)
        .figure("committed_unanswered", committed_unanswered)
        .figure("upstream_span_bytes", spans[0].1)
        .figure("downstream_span_bytes", spans[1].1)
        .figure("proxied_connections", proxy.accepted());
    drop(gw);
    drop(proxy);
    db.drop_now().await;
}

/// A test that panics before `drop_now` leaves no database behind: dropping the value drops
/// it (the path unwinding takes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_test_database_dropped_without_drop_now_is_dropped_on_the_server() {
    let name = unique("hooklatch_e2e");
    let Some(db) = Database::create(&name).await else {
        return;
    };
    let exists = async || {
        let admin = std::env::var("HOOKLATCH_TEST_POSTGRES_URL").expect("set: created one");
        let mut conn = sqlx::PgConnection::connect(&admin).await.expect("admin");
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_database WHERE datname = $1")
            .bind(name.to_lowercase())
            .fetch_one(&mut conn)
            .await
            .expect("pg_database")
            == 1
    };
    assert!(exists().await);
    drop(db);
    assert!(!exists().await, "dropped with the value");
}

/// How long the T13 handler holds each delivery before answering 200.
const HOLD_MS: u64 = 50;

/// T13: three instances on one database, four delivery workers each, 5,000 rows queued at
/// once (`HOOKLATCH_SCALE` times more in the soak tier); while they drain, one instance is
/// killed -9, another stopped with SIGTERM, a third killed -9, then the first again, each
/// started again at once.
/// Every row ends delivered, nothing pending; a killed instance's rows are taken over once its
/// leases run out (twice the 1 s destination timeout plus 10 s), a stopped one's at once; and
/// no row is ever under two live leases: no event reaches the handler while another delivery
/// of it is still being answered (each is held 50 ms). Repeated deliveries are counted: only
/// the attempts a kill cut off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_drain_5000_rows_through_three_kills_and_a_sigterm() {
    let mut card = crate::report::Card::new("T13", "postgres");
    let Some(db) = Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let handler = Handler::start(Behaviour::SlowOk(HOLD_MS)).await;
    let mut gateways = Vec::new();
    for _ in 0..3 {
        let options = Options {
            store_url: Some(db.url()),
            timeout: "1s",
            extra_env: vec![("HOOKLATCH_DELIVERY__CONCURRENCY".to_owned(), "4".to_owned())],
            ..Options::default()
        };
        gateways.push(Gateway::start_with(&handler, options).await);
    }
    let rows = crate::report::scaled(5_000);
    let ids: Vec<String> = (0..rows)
        .map(|i| format!("{}_{i:05}", unique("evt_t13")))
        .collect();
    // Queued through all three; 16 senders, so the backlog is there before it is drained.
    let ingests: Vec<Ingest> = gateways.iter().map(Gateway::ingest).collect();
    let mut senders = tokio::task::JoinSet::new();
    for (n, chunk) in ids.chunks(rows.div_ceil(16)).enumerate() {
        let (ingest, chunk) = (ingests[n % 3].clone(), chunk.to_vec());
        senders.spawn(async move {
            for id in chunk {
                let body = stripe_invoice_paid(&id, 5000);
                let (status, json) = ingest.post("stripe", &stripe_headers(&body), body).await;
                assert_eq!(status, 200, "{id}: {json}");
            }
        });
    }
    senders.join_all().await;

    // The stops, at a fifth, two, three and four fifths of the rows delivered.
    let stops = [(0, false), (1, true), (2, false), (0, false)];
    for (i, (instance, sigterm)) in stops.into_iter().enumerate() {
        let at = rows * (i + 1) / 5;
        crate::support::wait_until_within(
            "the deliveries before the next stop",
            Duration::from_secs(120),
            || handler.distinct_keys().len() >= at,
        )
        .await;
        let gw = &mut gateways[instance];
        if sigterm {
            gw.sigterm();
            assert!(gw.wait_exit().await.success(), "SIGTERM ends serve cleanly");
        } else {
            gw.kill9();
        }
        gw.restart().await;
    }
    let all: HashSet<String> = ids.iter().map(|id| format!("stripe:{id}")).collect();
    crate::support::wait_until_within(
        "every row delivered, the killed instances' after their leases ran out",
        Duration::from_secs(120),
        || handler.distinct_keys() == all,
    )
    .await;
    eventually_within("nothing pending", Duration::from_secs(60), async || {
        gateways[0].deliveries("state=pending").await.is_empty()
    })
    .await;

    // Never two live leases on one row: a second delivery of an event only after the first
    // was answered.
    let received = handler.received();
    let mut by_key: HashMap<String, Vec<std::time::Instant>> = HashMap::new();
    for r in &received {
        by_key
            .entry(r.key.clone().unwrap_or_default())
            .or_default()
            .push(r.at);
    }
    let mut repeated = 0;
    for (key, mut arrivals) in by_key {
        arrivals.sort();
        repeated += arrivals.len() - 1;
        for pair in arrivals.windows(2) {
            let gap = pair[1].duration_since(pair[0]);
            assert!(
                gap >= Duration::from_millis(HOLD_MS),
                "{key}: a second delivery {gap:?} after the first, which was held {HOLD_MS} ms"
            );
        }
    }
    // A kill repeats only the attempts it cut: at most two leases per delivery task of the
    // killed instance (an attempt being recorded carries its task's next lease), 4 tasks.
    assert!(
        repeated <= 3 * 2 * 4,
        "{repeated} repeated deliveries for 3 kills"
    );
    card.count("ops", rows)
        .count("acked", rows)
        .count("lost", 0)
        .count("duplicates", repeated)
        .fault("kill9", 3)
        .fault("sigterm", 1)
        .figure("overlapping_leases", 0);
    println!("T13: {rows} rows on 3 instances × 4 workers, 3 kills and a SIGTERM: 0 lost, {repeated} repeated deliveries, no overlapping lease");
    drop(gateways);
    db.drop_now().await;
}
