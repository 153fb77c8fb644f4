//! The crash matrix (RELIABILITY.md T3): the gateway aborted at each crash point of ingest and
//! delivery (`hooklatch_core::crash`), on SQLite and on PostgreSQL, then started again.
//!
//! The binary these tests run is built with the `failpoints` feature (the CLI's
//! dev-dependency turns it on), and `FAILPOINTS=<point>=return` makes the process abort there,
//! as a power cut or kill -9 would: no answer, no destructor. For each point: the provider's
//! retry after the restart gets the answer the point implies (`accepted` when the crash came
//! before the commit, `duplicate` after it), the event is delivered with one outbox row and
//! one `Idempotency-Key`, and the application sees it once — twice only when the crash came
//! after it was sent and before the attempt was recorded (always for the 2xx point; sometimes
//! for the point after ingest's commit, whose hand-off to the local worker can send it first),
//! and then with the same key. A failure that is final, cut before its move to the
//! dead-letter is recorded, is made once more after the restart and then dead-lettered.
//!
//! Ingest's points also fail instead of aborting (`<point>=1*return(error)`, once): the
//! provider hears 503 `store_unavailable`, never 2xx, and its retry lands the event once. And
//! they pause (`<point>=1*return(pause:1500)`) while the provider hangs up: the request is
//! dropped there, keeping nothing before the commit and everything after it.

use hooklatch_core::crash;
use serde_json::Value;

use crate::support::{
    eventually, stripe_headers, stripe_invoice_paid, unique, Behaviour, Gateway, Handler, Options,
};

/// What a crash at a point leaves, as the provider and the application see it.
struct Case {
    point: &'static str,
    /// Whether the first request is answered: never when the crash comes before the answer;
    /// `None` when the crash is the worker's, which can come before or after the answer has
    /// been written (the commit hands the delivery to the worker at once).
    answered: Option<bool>,
    /// The answer to the provider's retry after the restart, when the first had none.
    retry_answer: &'static str,
    /// How many times the application receives the event.
    deliveries: std::ops::RangeInclusive<usize>,
    app: App,
}

/// The application behind the destination.
#[derive(Clone, Copy)]
enum App {
    /// Answers 2xx: the event is delivered.
    Healthy,
    /// Answers 500, and the destination allows one attempt: the event is dead-lettered.
    FailingWithOneAttempt,
}

impl App {
    fn behaviour(self) -> Behaviour {
        match self {
            App::Healthy => Behaviour::AlwaysOk,
            App::FailingWithOneAttempt => Behaviour::AlwaysFail,
        }
    }

    fn max_attempts(self) -> u32 {
        match self {
            App::Healthy => Options::default().max_attempts,
            App::FailingWithOneAttempt => 1,
        }
    }

    /// The delivery's state in the end.
    fn settles_as(self) -> &'static str {
        match self {
            App::Healthy => "delivered",
            App::FailingWithOneAttempt => "dead",
        }
    }
}

const CASES: &[Case] = &[
    Case {
        point: crash::INGEST_BEFORE_COMMIT,
        answered: Some(false),
        retry_answer: "accepted",
        deliveries: 1..=1,
        app: App::Healthy,
    },
    Case {
        point: crash::INGEST_AFTER_COMMIT_BEFORE_ANSWER,
        answered: Some(false),
        retry_answer: "duplicate",
        // The commit hands the new delivery to the local worker before the crash point; its
        // attempt may reach the application before the process dies, unrecorded, and then it
        // comes again after the restart with the same key.
        deliveries: 1..=2,
        app: App::Healthy,
    },
    Case {
        point: crash::MID_RESPONSE_WRITE,
        // The provider reads `HTTP/1.1 200` and then the end of the connection: a cut answer,
        // which it retries; the commit came before, so as above.
        answered: Some(false),
        retry_answer: "duplicate",
        deliveries: 1..=2,
        app: App::Healthy,
    },
    Case {
        point: crash::WORKER_AFTER_LEASE_BEFORE_SEND,
        answered: None,
        retry_answer: "duplicate",
        deliveries: 1..=1,
        app: App::Healthy,
    },
    Case {
        point: crash::WORKER_AFTER_2XX_BEFORE_RECORD,
        answered: None,
        retry_answer: "duplicate",
        deliveries: 2..=2,
        app: App::Healthy,
    },
    // `WORKER_AFTER_PUBLISH_BEFORE_RECORD` is RabbitMQ's (`tests/amqp.rs`), the `KEYS_…`
    // points Redis-keys mode's (`redis.rs`).
    Case {
        point: crash::WORKER_BEFORE_DEAD_LETTER,
        answered: None,
        retry_answer: "duplicate",
        // The failed attempt was cut before its move to the dead-letter was recorded: it is
        // made again after the restart, fails again, and this time lands there.
        deliveries: 2..=2,
        app: App::FailingWithOneAttempt,
    },
    Case {
        point: crash::WORKER_RECORD_BEFORE_STORE,
        answered: None,
        retry_answer: "duplicate",
        // As after the 2xx: sent, and its record never reached the store.
        deliveries: 2..=2,
        app: App::Healthy,
    },
    Case {
        point: crash::WORKER_RECORD_AFTER_STORE,
        answered: None,
        retry_answer: "duplicate",
        // The record committed before the crash: nothing is attempted again.
        deliveries: 1..=1,
        app: App::Healthy,
    },
];

/// Runs every case on a fresh gateway whose store `store_url` gives (a SQLite file of its own
/// when `None`).
async fn crash_matrix(backend: &str, store_url: impl Fn() -> Option<String>) {
    let points: Vec<&str> = crash::POINTS
        .iter()
        .copied()
        .filter(|p| {
            ![
                crash::WORKER_AFTER_PUBLISH_BEFORE_RECORD,
                crash::KEYS_AFTER_CLAIM_BEFORE_STORE,
                crash::KEYS_AFTER_STORE_BEFORE_DONE,
            ]
            .contains(p)
        })
        .collect();
    assert_eq!(
        CASES.iter().map(|c| c.point).collect::<Vec<_>>(),
        points,
        "a case for every crash point"
    );
    let mut card = crate::report::Card::new("T3", backend);
    let mut acked = 0;
    let mut duplicates = 0;
    let mut dead_lettered = 0;
    for case in CASES {
        let point = case.point;
        let handler = Handler::start(case.app.behaviour()).await;
        let mut gw = Gateway::start_with(
            &handler,
            Options {
                store_url: store_url(),
                extra_env: vec![("FAILPOINTS".to_owned(), format!("{point}=return"))],
                // A crashed PostgreSQL instance's leases run out (2 × timeout + 10 s) before
                // another takes them; SQLite gives them back at the restart.
                timeout: "1s",
                max_attempts: case.app.max_attempts(),
                ..Options::default()
            },
        )
        .await;
        let event_id = unique("evt_crash");
        let key = format!("stripe:{event_id}");
        let body = stripe_invoice_paid(&event_id, 5000);
        let headers = stripe_headers(&body);

        let first = gw.ingest().try_post("stripe", &headers, body.clone()).await;
        match (case.answered, first) {
            (Some(false) | None, Err(_)) => {}
            (Some(false), Ok(answer)) => panic!("{point}: answered before the crash: {answer:?}"),
            (_, Ok((status, json))) => assert_eq!(
                (status, json["status"].as_str()),
                (200, Some("accepted")),
                "{point}"
            ),
            (Some(true), Err(err)) => panic!("{point}: no answer: {err}"),
        }
        let status = gw.wait_exit().await;
        assert!(!status.success(), "{point}: the process aborted: {status}");

        // Started again without the crash point; the provider sends its retry.
        gw.reconfigure(|o| o.extra_env.clear());
        gw.restart().await;
        let (status, json) = gw.post("stripe", &headers, body.clone()).await;
        assert_eq!(
            (status, json["status"].as_str()),
            (200, Some(case.retry_answer)),
            "{point}: {json}"
        );
        acked += 1;

        let row = gw
            .wait_for_delivery_state(&key, case.app.settles_as())
            .await;
        assert_eq!(
            gw.deliveries_for(&key).await.len(),
            1,
            "{point}: one outbox row"
        );
        let received = handler.received_for(&key);
        assert!(
            case.deliveries.contains(&received.len()),
            "{point}: received {} times, expected {:?}",
            received.len(),
            case.deliveries
        );
        duplicates += received.len() - 1;
        dead_lettered += usize::from(case.app.settles_as() == "dead");
        assert!(
            received
                .iter()
                .all(|r| r.body == body && r.header("idempotency-key") == key),
            "{point}: the same body and key every time"
        );
        // An attempt the crash cut was never recorded.
        assert_eq!(row["attempts"], 1, "{point}: {row:#}");
        let requests: Vec<Value> = gw.requests(&format!("key={event_id}")).await;
        let verdicts: Vec<&str> = requests
            .iter()
            .filter_map(|r| r["verdict"].as_str())
            .collect();
        let expected: &[&str] = match case.retry_answer {
            "accepted" => &["accepted"],
            _ => &["duplicate", "accepted"],
        };
        assert_eq!(verdicts, expected, "{point}: history, newest first");
        card.fault(point, 1);
    }
    card.count("ops", CASES.len())
        .count("acked", acked)
        .count("lost", 0)
        .count("duplicates", duplicates)
        .count("dlq", dead_lettered);
}

/// A fresh gateway on the store `store_url` gives, whose `point` fails once
/// (`<point>=1*return(error)`), and the application behind it, answering 2xx.
async fn failing_once(point: &str, store_url: Option<String>) -> (Handler, Gateway) {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        Options {
            store_url,
            extra_env: vec![("FAILPOINTS".to_owned(), format!("{point}=1*return(error)"))],
            ..Options::default()
        },
    )
    .await;
    (handler, gw)
}

/// Each of ingest's points failing once on a fresh gateway whose store `store_url` gives.
async fn ingest_failures(backend: &str, store_url: impl Fn() -> Option<String>) {
    let mut card = crate::report::Card::new("T3", backend);
    for &point in crash::FALLIBLE_POINTS {
        let (handler, gw) = failing_once(point, store_url()).await;
        let event_id = unique("evt_fail");
        let body = stripe_invoice_paid(&event_id, 5000);
        let headers = stripe_headers(&body);

        let (status, json) = gw.post("stripe", &headers, body.clone()).await;
        assert_eq!(
            (status, json["code"].as_str()),
            (503, Some("store_unavailable")),
            "{point}: {json}"
        );
        // Only a failure after the commit has written anything: its retry is a duplicate.
        let retry_answer = if point == crash::INGEST_BEFORE_COMMIT {
            "accepted"
        } else {
            "duplicate"
        };
        the_retry_lands_once(&gw, &handler, point, (&headers, &body), retry_answer).await;
        card.fault(&format!("{point}_error"), 1);
    }
    one_retry_each(&mut card);
}

/// The provider's retry of `request` after a fault at `point` is answered 200 `answer`, and
/// the event is delivered once, with one outbox row.
async fn the_retry_lands_once(
    gw: &Gateway,
    handler: &Handler,
    point: &str,
    (headers, body): (&[(String, String)], &[u8]),
    answer: &str,
) {
    let (status, json) = gw.post("stripe", headers, body.to_vec()).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some(answer)),
        "{point}: {json}"
    );
    let id = serde_json::from_slice::<Value>(body).expect("a JSON body")["id"]
        .as_str()
        .expect("an event id")
        .to_owned();
    let key = format!("stripe:{id}");
    gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(gw.deliveries_for(&key).await.len(), 1, "{point}");
    assert_eq!(handler.count_for(&key), 1, "{point}: delivered once");
}

/// The card of a test that sent each fallible point's event twice, the retry landing once.
fn one_retry_each(card: &mut crate::report::Card) {
    let n = crash::FALLIBLE_POINTS.len();
    card.count("ops", 2 * n)
        .count("acked", n)
        .count("lost", 0)
        .count("duplicates", 0);
}

/// Each of the worker's record points failing once on a fresh gateway whose store
/// `store_url` gives: before the record reached the store (the store
/// away), or after it committed (its answer lost). The worker records the attempt again, and
/// the token it carries makes a record that did commit count once: the event is delivered
/// once, recorded delivered with one attempt, and the gateway counts one record made again —
/// without the later tries, the delivery would stay leased and go out again when its lease
/// ran out; without the token, the repeat would keep a second attempt in its history.
async fn record_failures(backend: &str, store_url: impl Fn() -> Option<String>) {
    let mut card = crate::report::Card::new("T3", backend);
    for &point in crash::WORKER_FALLIBLE_POINTS {
        let (handler, gw) = failing_once(point, store_url()).await;
        let key = gw.send_stripe_event("stripe", "evt_record").await;
        gw.wait_for_delivery_state(&key, "delivered").await;
        assert_eq!(handler.count_for(&key), 1, "{point}: delivered once");
        // After a record that committed, the delivery reads delivered before the record is
        // made again: wait for that, then look.
        eventually(&format!("{point}: the record made again"), async || {
            gw.metric(r#"hooklatch_attempt_record_retries_total{outcome="recorded"}"#)
                .await
                == 1.0
        })
        .await;
        let rows = gw.deliveries_for(&key).await;
        assert_eq!(rows.len(), 1, "{point}: one outbox row");
        assert_eq!(rows[0]["state"], "delivered", "{point}: {:#}", rows[0]);
        let history = rows[0]["history"].as_array().expect("the attempts");
        assert_eq!(
            (rows[0]["attempts"].as_u64(), history.len()),
            (Some(1), 1),
            "{point}: one attempt counted and kept: {:#}",
            rows[0]
        );
        assert_eq!(handler.count_for(&key), 1, "{point}: and no more");
        card.fault(&format!("{point}_error"), 1);
    }
    let n = crash::WORKER_FALLIBLE_POINTS.len();
    card.count("ops", n)
        .count("acked", n)
        .count("lost", 0)
        .count("duplicates", 0);
}

/// How long an ingest point pauses in [`hang_ups_at_paused_points`]; its provider gives up
/// after [`GIVES_UP_AFTER`].
const PAUSE: std::time::Duration = std::time::Duration::from_millis(1500);
const GIVES_UP_AFTER: std::time::Duration = std::time::Duration::from_millis(300);

/// Each of ingest's points paused once (`<point>=1*return(pause:1500)`) while its provider
/// hangs up after 300 ms, on a fresh gateway whose store `store_url` gives: the request is
/// dropped at that await, as any request whose client hangs up. Before the commit, nothing
/// of it is kept (no history record, no claim) and the provider's retry is `accepted`; after
/// the commit, the event is kept and the retry is a `duplicate`. Either way the event is
/// delivered once, with one outbox row: T3b's hang-ups, at a named line instead of a drawn
/// moment.
async fn hang_ups_at_paused_points(backend: &str, store_url: impl Fn() -> Option<String>) {
    let mut card = crate::report::Card::new("T3", backend);
    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(GIVES_UP_AFTER)
        .build()
        .expect("an HTTP client");
    for &point in crash::FALLIBLE_POINTS {
        let handler = Handler::start(Behaviour::AlwaysOk).await;
        let gw = Gateway::start_with(
            &handler,
            Options {
                store_url: store_url(),
                extra_env: vec![(
                    "FAILPOINTS".to_owned(),
                    format!("{point}=1*return(pause:{})", PAUSE.as_millis()),
                )],
                ..Options::default()
            },
        )
        .await;
        let event_id = unique("evt_pause");
        let body = stripe_invoice_paid(&event_id, 5000);
        let headers = stripe_headers(&body);
        let mut request = impatient
            .post(format!("http://{}/in/stripe", gw.ingest().addr()))
            .body(body.clone());
        for (name, value) in &headers {
            request = request.header(name.as_str(), value.as_str());
        }
        let sent = request.send().await;
        assert!(
            sent.as_ref().is_err_and(reqwest::Error::is_timeout),
            "{point}: the provider gave up waiting: {sent:?}"
        );
        // Pacing, not a wait for a condition: the pause's own length, after which a request
        // that was not dropped would have gone on.
        tokio::time::sleep(PAUSE + std::time::Duration::from_millis(500)).await;
        let kept = gw.requests(&format!("key={event_id}")).await;
        let retry_answer = if point == crash::INGEST_BEFORE_COMMIT {
            assert!(
                kept.is_empty(),
                "{point}: dropped before its commit: {kept:#?}"
            );
            "accepted"
        } else {
            assert_eq!(
                kept.len(),
                1,
                "{point}: committed before the pause: {kept:#?}"
            );
            "duplicate"
        };
        the_retry_lands_once(&gw, &handler, point, (&headers, &body), retry_answer).await;
        card.fault(&format!("{point}_pause_hang_up"), 1);
    }
    one_retry_each(&mut card);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_hanging_up_while_a_point_pauses_loses_nothing_sqlite() {
    hang_ups_at_paused_points("sqlite", || None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_hanging_up_while_a_point_pauses_loses_nothing_postgres() {
    let Some(databases) = FreshDatabases::create(crash::FALLIBLE_POINTS.len()).await else {
        return;
    };
    hang_ups_at_paused_points("postgres", || databases.next_url()).await;
    databases.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_point_that_fails_answers_503_and_the_retry_lands_once_sqlite() {
    ingest_failures("sqlite", || None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_point_that_fails_answers_503_and_the_retry_lands_once_postgres() {
    let Some(databases) = FreshDatabases::create(crash::FALLIBLE_POINTS.len()).await else {
        return;
    };
    ingest_failures("postgres", || databases.next_url()).await;
    databases.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_record_that_fails_is_made_again_and_counts_once_sqlite() {
    record_failures("sqlite", || None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_record_that_fails_is_made_again_and_counts_once_postgres() {
    let Some(databases) = FreshDatabases::create(crash::WORKER_FALLIBLE_POINTS.len()).await else {
        return;
    };
    record_failures("postgres", || databases.next_url()).await;
    databases.drop_all().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_each_point_loses_nothing_and_repeats_only_the_cut_attempt_sqlite() {
    crash_matrix("sqlite", || None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_at_each_point_loses_nothing_and_repeats_only_the_cut_attempt_postgres() {
    let Some(databases) = FreshDatabases::create(CASES.len()).await else {
        return;
    };
    crash_matrix("postgres", || databases.next_url()).await;
    databases.drop_all().await;
}

/// A fresh PostgreSQL database for each gateway a test starts, handed out in turn.
struct FreshDatabases {
    databases: Vec<crate::postgres::Database>,
    next: std::sync::atomic::AtomicUsize,
}

impl FreshDatabases {
    /// `n` databases; `None` (the test skips) without PostgreSQL.
    async fn create(n: usize) -> Option<FreshDatabases> {
        let mut databases = Vec::with_capacity(n);
        for _ in 0..n {
            databases.push(crate::postgres::Database::create(&unique("hooklatch_e2e")).await?);
        }
        Some(FreshDatabases {
            databases,
            next: Default::default(),
        })
    }

    /// The next database's URL.
    fn next_url(&self) -> Option<String> {
        let i = self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Some(self.databases[i].url())
    }

    async fn drop_all(self) {
        for db in self.databases {
            db.drop_now().await;
        }
    }
}
