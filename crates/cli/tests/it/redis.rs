//! Redis mode (`[store] keys = "redis://…"`) with a real `hooklatch serve` and a real Redis:
//!
//! - 1,000 events × 32 concurrent copies → exactly one claim (one `accepted`, one forward) per
//!   event; copies that arrive while the first is in flight get 409 `in_flight` with
//!   `Retry-After` and are retried as a provider would; no copy is ever answered 2xx before
//!   the first is queued;
//! - an event held in flight by another instance → 409 with `Retry-After`, kept in history;
//!   once the holder gives up, the next copy is accepted;
//! - done keys carry the source's retention as their TTL and expire with it;
//! - the start-up check warns about the server's persistence and eviction settings;
//! - an unreachable Redis stops `serve` at start with a message that hides the password.
//!
//! Needs `HOOKLATCH_TEST_REDIS_URL`; each test writes under a key prefix of its own and
//! deletes it afterwards.

use std::time::Duration;

use redis::AsyncCommands;

use crate::support::{
    eventually_within, one_claim_per_event, stripe_headers, stripe_invoice_paid, unique,
    wait_until_within, Behaviour, Gateway, Handler, Options, Retry,
};

/// A key prefix of the test's own on the Redis `HOOKLATCH_TEST_REDIS_URL` points at.
struct Keys {
    url: String,
    prefix: String,
    conn: redis::aio::MultiplexedConnection,
}

impl Keys {
    /// `None` (after printing why) when no server is configured outside CI.
    async fn open() -> Option<Keys> {
        let Ok(url) = std::env::var("HOOKLATCH_TEST_REDIS_URL") else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set but HOOKLATCH_TEST_REDIS_URL is not: the Redis tests must run"
            );
            println!("skipped: set HOOKLATCH_TEST_REDIS_URL to run the Redis key store tests");
            return None;
        };
        let client = redis::Client::open(url.as_str()).expect("HOOKLATCH_TEST_REDIS_URL parses");
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("connecting to HOOKLATCH_TEST_REDIS_URL");
        Some(Keys {
            url,
            prefix: format!("{}:", unique("hl_e2e")),
            conn,
        })
    }

    /// Gateway options keeping keys in this Redis under this prefix.
    fn options(&self, extra_config: &str) -> Options {
        Options {
            extra_env: vec![
                ("HOOKLATCH_STORE__KEYS".to_owned(), self.url.clone()),
                (
                    "HOOKLATCH_STORE__KEY_PREFIX".to_owned(),
                    self.prefix.clone(),
                ),
            ],
            extra_config: extra_config.to_owned(),
            log_level: "info",
            ..Options::default()
        }
    }

    /// A handler answering 200 and a gateway keeping keys here through a fault proxy.
    async fn behind_proxy(&self) -> (hooklatch_testkit::proxy::FaultProxy, Handler, Gateway) {
        let (proxy, url) = crate::support::proxied(&self.url, 6379).await;
        let handler = Handler::start(Behaviour::AlwaysOk).await;
        let mut options = self.options("");
        options.extra_env[0].1 = url;
        let gateway = Gateway::start_with(&handler, options).await;
        (proxy, handler, gateway)
    }

    fn key(&self, source: &str, event: &str) -> String {
        format!("{}{{{source}}}:{event}", self.prefix)
    }

    async fn get(&self, key: &str) -> Option<String> {
        self.conn.clone().get(key).await.expect("GET")
    }

    async fn pttl(&self, key: &str) -> i64 {
        self.conn.clone().pttl(key).await.expect("PTTL")
    }

    async fn all(&self) -> Vec<String> {
        let mut conn = self.conn.clone();
        let mut keys: Vec<String> = Vec::new();
        let mut iter: redis::AsyncIter<'_, String> = conn
            .scan_match(format!("{}*", self.prefix))
            .await
            .expect("SCAN");
        while let Some(key) = iter.next_item().await {
            keys.push(key.expect("a key name"));
        }
        keys
    }

    async fn clean_up(self) {
        let keys = self.all().await;
        let mut conn = self.conn.clone();
        for chunk in keys.chunks(500) {
            let _: redis::RedisResult<i64> = conn.del(chunk).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_mode_makes_one_claim_per_event_under_32_concurrent_copies() {
    let mut card = crate::report::Card::new("T1", "redis");
    let Some(keys) = Keys::open().await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, keys.options("")).await;
    // 64 senders; each event's 32 copies go out together. A copy meeting the first in flight
    // gets 409 and is retried as a provider would (so is a 503), and counted.
    let retry = Retry {
        statuses: &[409, 503],
        attempts: 200,
        backoff: Duration::from_millis(20),
    };
    let (ids, retried) = one_claim_per_event(
        &[gateway.ingest()],
        &gateway,
        &handler,
        &mut card,
        "evt_redis",
        32,
        retry,
    )
    .await;
    let ids_n = ids.len();

    // Every key is done, pointing at an accepted request, for the source's retention.
    let stored = keys.all().await;
    assert_eq!(stored.len(), ids_n, "one Redis key per event");
    let first = keys
        .get(&keys.key("stripe", &ids[0]))
        .await
        .expect("the key is there");
    assert!(first.starts_with("d:"), "done, not in flight: {first}");
    let ttl = keys.pttl(&keys.key("stripe", &ids[0])).await;
    let retention_ms = 35 * 86_400 * 1000;
    assert!(
        ttl > retention_ms - 600_000 && ttl <= retention_ms,
        "TTL {ttl} ms ≈ Stripe's 35-day retention"
    );
    println!(
        "redis mode: ids={ids_n} copies=32 forwards={} in_flight_or_503_retried={retried}",
        handler.total()
    );
    keys.clean_up().await;
}

/// T3b in Redis mode: providers hanging up anywhere in their requests (`hangups.rs`). The
/// claim, the queueing and the key's "done" run in a task of their own, so a hang-up cannot
/// cut them apart: every event is delivered once, and every key left in Redis is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn providers_hanging_up_anywhere_lose_no_event_in_redis_mode() {
    let mut card = crate::report::Card::new("T3b", "redis");
    let Some(keys) = Keys::open().await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, keys.options("")).await;
    let n = crate::report::scaled(1_000);
    crate::hangups::hang_ups_lose_nothing(&gateway, &handler, &mut card, n).await;
    let stored = keys.all().await;
    assert_eq!(stored.len(), n, "one Redis key per event");
    for key in &stored {
        let value = keys.get(key).await.unwrap_or_default();
        assert!(value.starts_with("d:"), "{key} is not done: {value}");
    }
    keys.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_arriving_while_another_holds_the_key_gets_409_with_retry_after() {
    let Some(keys) = Keys::open().await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, keys.options("")).await;
    let id = "evt_in_flight_1";
    // Another instance claimed the key and is writing its request right now.
    let held = keys.key("stripe", id);
    let _: () = keys
        .conn
        .clone()
        .set_ex(&held, "i:another-instance", 30)
        .await
        .expect("SET");

    let body = stripe_invoice_paid(id, 5000);
    let response = gateway
        .ingest()
        .send("stripe", &stripe_headers(&body), body.clone())
        .await
        .expect("POST");
    assert_eq!(response.status().as_u16(), 409);
    assert_eq!(
        response.headers()["retry-after"].to_str().expect("ascii"),
        "1"
    );
    let json: serde_json::Value = response.json().await.expect("a JSON body");
    assert_eq!(json["code"], "in_flight", "{json}");
    assert!(json["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert_eq!(
        keys.get(&held).await.as_deref(),
        Some("i:another-instance"),
        "the holder's claim is untouched"
    );
    let rejected = gateway.requests("verdict=rejected").await;
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(rejected[0]["reason"], "in_flight");
    assert_eq!(rejected[0]["status"], 409);
    assert!(handler.received().is_empty(), "nothing queued");

    // The holder gave up (its store failed and it released the key): the next copy is ours.
    let _: i64 = keys.conn.clone().del(&held).await.expect("DEL");
    let (status, json) = gateway
        .ingest()
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!((status, json["status"].as_str()), (200, Some("accepted")));
    wait_until_within("forwarded once", Duration::from_secs(30), || {
        handler.count_for(&format!("stripe:{id}")) == 1
    })
    .await;
    let done = keys.get(&held).await.expect("the key is done");
    assert!(
        done.starts_with(&format!(
            "d:{}:",
            json["request_id"]
                .as_str()
                .and_then(|r| r.strip_prefix("req_"))
                .expect("req_N")
        )),
        "the done key points at the accepted request: {done}"
    );
    keys.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn done_keys_expire_after_the_sources_retention() {
    let Some(keys) = Keys::open().await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let extra = r#"
[[sources]]
name = "short"
provider = "stripe"
secrets = ["env:E2E_STRIPE_SECRET"]
destinations = ["app"]
retention = "2s"
"#;
    let gateway = Gateway::start_with(&handler, keys.options(extra)).await;
    let id = "evt_short_lived";
    let body = stripe_invoice_paid(id, 5000);
    let post = async || {
        let (status, json) = gateway
            .ingest()
            .post("short", &stripe_headers(&body), body.clone())
            .await;
        (
            status,
            json["status"].as_str().unwrap_or_default().to_owned(),
        )
    };
    assert_eq!(post().await, (200, "accepted".to_owned()));
    assert_eq!(post().await, (200, "duplicate".to_owned()));
    let key = keys.key("short", id);
    let ttl = keys.pttl(&key).await;
    assert!(ttl > 0 && ttl <= 2_000, "TTL {ttl} ms = the 2 s retention");
    eventually_within(
        "the key expires with the retention",
        Duration::from_secs(15),
        async || keys.get(&key).await.is_none(),
    )
    .await;
    assert_eq!(
        post().await,
        (200, "accepted".to_owned()),
        "past the retention the event is new again"
    );
    wait_until_within("forwarded twice", Duration::from_secs(30), || {
        handler.count_for(&format!("short:{id}")) == 2
    })
    .await;
    keys.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_up_warns_about_settings_that_forget_keys() {
    let Some(keys) = Keys::open().await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, keys.options("")).await;
    let config = async |name: &str| -> String {
        let pair: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query_async(&mut keys.conn.clone())
            .await
            .expect("CONFIG GET");
        pair.get(1).cloned().unwrap_or_default()
    };
    let policy = config("maxmemory-policy").await;
    let persistent = config("appendonly").await == "yes" || !config("save").await.is_empty();
    let log = gateway.log();
    assert!(
        log.contains("idempotency keys live in Redis"),
        "{}",
        gateway.log_tail(20)
    );
    assert_eq!(
        log.contains("persistence is off"),
        !persistent,
        "{}",
        gateway.log_tail(20)
    );
    assert_eq!(
        log.contains("maxmemory-policy is"),
        policy != "noeviction",
        "{}",
        gateway.log_tail(20)
    );
    let expected = usize::from(!persistent) + usize::from(policy != "noeviction");
    assert_eq!(
        gateway.metric("hooklatch_key_store_may_forget").await,
        expected as f64,
        "the gauge counts the warnings"
    );
    keys.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_redis_stops_the_gateway_at_start_without_showing_its_password() {
    let port = crate::support::free_port();
    let text = serve_refused(&format!("redis://:hunter2secret@127.0.0.1:{port}/0")).await;
    assert!(text.contains("key store"), "{text}");
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(!text.contains("hunter2secret"), "{text}");
}

/// Runs `hooklatch serve` with its keys at `keys` (a URL Redis cannot be used at), which must
/// stop it at start rather than hang; returns what it printed.
async fn serve_refused(keys: &str) -> String {
    let dir = tempfile::tempdir().expect("a temp dir");
    let config = dir.path().join("hooklatch.toml");
    std::fs::write(
        &config,
        format!(
            r#"[server]
listen = "127.0.0.1:0"
admin_listen = "127.0.0.1:0"
admin_token = "a-token-long-enough-for-the-admin-api"

[store]
url = "sqlite://{db}"
keys = "{keys}"
"#,
            db = dir.path().join("hooklatch.db").display()
        ),
    )
    .expect("writing the config");
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(["serve", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(60), child)
        .await
        .expect("serve gives up on a Redis it cannot use instead of hanging")
        .expect("running hooklatch serve");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!output.status.success(), "{text}");
    text
}

/// `rediss://` end to end: a real `hooklatch serve` keeping its keys in the real Redis through
/// TLS (a TLS-terminating proxy in front of it, its certificate from a private CA given as
/// `store.keys_ca_file`): an event sent twice is accepted then a duplicate, and its done key
/// is in Redis. Without the CA, `serve` does not start: the key store cannot be trusted, and
/// it says why, without the password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_over_tls_claim_once_and_an_untrusted_server_stops_the_start() {
    let Some(keys) = Keys::open().await else {
        return;
    };
    let (ca, tls, secure) = crate::support::behind_tls(&keys.url, 6379, "rediss").await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let ca_file = dir.path().join("redis-ca.pem");
    std::fs::write(&ca_file, ca.pem()).expect("writing the CA");

    let mut options = keys.options("");
    options.extra_env = vec![
        ("HOOKLATCH_STORE__KEYS".to_owned(), secure.clone()),
        (
            "HOOKLATCH_STORE__KEY_PREFIX".to_owned(),
            keys.prefix.clone(),
        ),
        (
            "HOOKLATCH_STORE__KEYS_CA_FILE".to_owned(),
            ca_file.display().to_string(),
        ),
    ];
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, options).await;
    let id = unique("evt_rediss");
    let body = stripe_invoice_paid(&id, 5000);
    let mut verdicts = Vec::new();
    for _ in 0..2 {
        let (status, json) = gateway
            .ingest()
            .post("stripe", &stripe_headers(&body), body.clone())
            .await;
        verdicts.push((status, json["status"].as_str().unwrap_or("").to_owned()));
    }
    assert_eq!(
        verdicts,
        [(200, "accepted".to_owned()), (200, "duplicate".to_owned())]
    );
    let done = keys.get(&keys.key("stripe", &id)).await;
    assert!(done.is_some_and(|v| v.starts_with("d:")), "the key is done");
    assert!(tls.handshakes() >= 1 && tls.upstream_connections() >= 1);
    drop(gateway);

    let mut with_password = reqwest::Url::parse(&secure).expect("the rediss URL");
    with_password
        .set_password(Some("hunter2secret"))
        .expect("a password");
    let upstream_before = tls.upstream_connections();
    let text = serve_refused(with_password.as_str()).await;
    assert!(text.contains("UnknownIssuer"), "{text}");
    assert!(!text.contains("hunter2secret"), "{text}");
    assert_eq!(tls.upstream_connections(), upstream_before);
    keys.clean_up().await;
}

/// A Redis server of the test's own on a free port (no persistence), killed on drop.
struct OwnRedis {
    child: std::process::Child,
    port: u16,
}

impl OwnRedis {
    async fn start(port: u16) -> OwnRedis {
        OwnRedis::start_with(port, &[]).await
    }

    /// Started with more `redis-server` arguments (`--maxmemory 4mb`).
    async fn start_with(port: u16, args: &[&str]) -> OwnRedis {
        let child = std::process::Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .args(args)
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("redis-server runs (it comes with Redis; .ci/run installs it)");
        let url = format!("redis://127.0.0.1:{port}");
        eventually_within(
            "the test's Redis answers",
            Duration::from_secs(20),
            async || {
                let Ok(client) = redis::Client::open(url.as_str()) else {
                    return false;
                };
                client.get_multiplexed_async_connection().await.is_ok()
            },
        )
        .await;
        OwnRedis { child, port }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url())
            .expect("a Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("connecting to the test's Redis")
    }

    /// Sets `maxmemory` 256 KiB under what the server uses now, so every write is refused
    /// (under `noeviction`) until that much is freed. A write refused for want of memory frees
    /// its own arguments, so a server that just refused a big value still takes small ones:
    /// this leaves no such gap.
    async fn over_the_limit(&self) {
        let used = self.stat("memory", "used_memory").await;
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg(used.saturating_sub(256 * 1024))
            .query_async(&mut self.connection().await)
            .await
            .expect("CONFIG SET maxmemory");
    }

    /// A field of an `INFO` section as a number (`stats`, `evicted_keys`).
    async fn stat(&self, section: &str, field: &str) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg(section)
            .query_async(&mut self.connection().await)
            .await
            .expect("INFO");
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {field} in INFO {section}"))
    }

    /// Writes 16 KiB values under `filler:N` until Redis refuses one (`noeviction`) or `most`
    /// are written; returns how many it took.
    async fn fill(&self, most: usize) -> usize {
        let mut conn = self.connection().await;
        let value = vec![b'x'; 16 * 1024];
        for i in 0..most {
            let set: redis::RedisResult<()> = conn.set(format!("filler:{i}"), &value).await;
            if let Err(err) = set {
                assert!(err.to_string().contains("OOM"), "{err}");
                return i;
            }
        }
        most
    }

    /// How many keys hold `pattern` (SCAN, so a full server answers it too).
    async fn count(&self, pattern: &str) -> usize {
        let mut conn = self.connection().await;
        let mut keys = conn.scan_match::<_, String>(pattern).await.expect("SCAN");
        let mut n = 0;
        while let Some(key) = keys.next_item().await {
            key.expect("a key");
            n += 1;
        }
        n
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_going_away_is_503_key_store_unavailable_and_never_2xx_then_recovers() {
    // Needs only the redis-server binary, but runs with the other Redis tests.
    if Keys::open().await.is_none() {
        return;
    }
    let port = crate::support::free_port();
    let mut own = OwnRedis::start(port).await;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let options = Options {
        extra_env: vec![(
            "HOOKLATCH_STORE__KEYS".to_owned(),
            format!("redis://127.0.0.1:{}", own.port),
        )],
        ..Options::default()
    };
    let gateway = Gateway::start_with(&handler, options).await;
    let post = async |id: &str| {
        let body = stripe_invoice_paid(id, 5000);
        let res = gateway
            .ingest()
            .send("stripe", &stripe_headers(&body), body)
            .await
            .expect("POST");
        let status = res.status().as_u16();
        let retry_after = res
            .headers()
            .get("retry-after")
            .map(|v| v.to_str().unwrap_or_default().to_owned());
        let json: serde_json::Value = res.json().await.unwrap_or_default();
        (status, retry_after, json)
    };
    let (status, _, json) = post("evt_before_outage").await;
    assert_eq!((status, json["status"].as_str()), (200, Some("accepted")));

    own.stop();
    let (status, retry_after, json) = post("evt_during_outage").await;
    assert_eq!(status, 503, "{json}");
    assert_eq!(json["code"], "key_store_unavailable", "{json}");
    assert!(retry_after.is_some(), "a 503 says when to retry");
    let (status, _) = gateway.admin_get("/readyz").await;
    assert_eq!(status, 503, "/readyz reports the key store");
    eventually_within(
        "hooklatch_ready says it too, with nothing probing /readyz",
        Duration::from_secs(30),
        async || gateway.metric("hooklatch_ready").await == 0.0,
    )
    .await;
    let rejected = gateway.requests("verdict=rejected").await;
    assert_eq!(rejected.len(), 1, "{rejected:?}");
    assert_eq!(rejected[0]["reason"], "key_store_unavailable");
    assert_eq!(rejected[0]["status"], 503);
    let refused = rejected[0]["id"].as_str().expect("its id").to_owned();
    // Counted as the gateway's failure, not as a refusal of the request.
    let source = r#"hooklatch_requests_total{source="stripe","#;
    let error = format!(r#"{source}verdict="error",reason="key_store_unavailable"}}"#);
    let rejected = format!(r#"{source}verdict="rejected",reason="key_store_unavailable"}}"#);
    assert_eq!(
        (
            gateway.metric(&error).await,
            gateway.metric(&rejected).await
        ),
        (1.0, 0.0)
    );

    // Redis is back (empty: it kept nothing): the provider's retry is accepted.
    let _own = OwnRedis::start(port).await;
    eventually_within(
        "the retry is accepted once Redis is back",
        Duration::from_secs(30),
        async || post("evt_during_outage").await.0 == 200,
    )
    .await;
    wait_until_within("both events forwarded", Duration::from_secs(30), || {
        handler.count_for("stripe:evt_before_outage") == 1
            && handler.count_for("stripe:evt_during_outage") == 1
    })
    .await;

    // The refused copy passed its signature before the key store failed: `replay` re-signs
    // it without `--resign-rejected`, and the gateway answers it as the duplicate it now is.
    let out = gateway.cli("replay", &[&refused, "--via-gateway", "--json"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("replay --json");
    assert_eq!(
        report["replays"][0]["answers"]["duplicate"], 1,
        "{report:#}"
    );
    assert_eq!(handler.count_for("stripe:evt_during_outage"), 1);
}

/// T3, Redis cut off by the fault proxy: it stops answering (`stall`: no reset, no close,
/// every byte held; or `timeout`, the same until a limit, then closed) or its connections are
/// reset (`reset_peer`). A new event is answered 503
/// `key_store_unavailable` — after the key store's 2 s response timeout when stalled — never
/// 2xx, never a hang, and `/readyz` says 503; once Redis answers again, the provider's retry is
/// accepted and the event delivered once.
async fn redis_outage(fault: &str, cut: impl FnOnce(&hooklatch_testkit::proxy::FaultProxy)) {
    let Some(keys) = Keys::open().await else {
        return;
    };
    let mut card = crate::report::Card::new("T3", "redis");
    let (proxy, handler, gateway) = keys.behind_proxy().await;
    let before = gateway
        .send_stripe_event("stripe", "evt_before_outage")
        .await;
    gateway.wait_for_delivery_state(&before, "delivered").await;

    cut(&proxy);
    let answered_in = crate::support::outage_then_recovery(
        &gateway,
        &handler,
        &proxy,
        &before,
        "key_store_unavailable",
    )
    .await;
    card.count("ops", 3)
        .count("acked", 2)
        .count("lost", 0)
        .count("duplicates", 0)
        .fault(fault, 1)
        .figure("answered_503_in_ms", answered_in.as_millis() as u64);
    drop(gateway);
    keys.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_stops_answering_is_503_never_2xx_then_recovers() {
    redis_outage("stall", |proxy| proxy.stall()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_connections_reset_are_503_never_2xx_then_recover() {
    redis_outage("reset_peer", |proxy| proxy.reset_peer()).await;
}

/// Toxiproxy's `timeout` with a limit: Redis silent, and every connection closed after 1 s of
/// it (new ones the gateway opens included).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_silent_then_cut_off_is_503_never_2xx_then_recovers() {
    redis_outage("timeout", |proxy| proxy.timeout(Duration::from_secs(1))).await;
}

/// T3, Redis on a slow link (the fault proxy's `latency`, 10 ms each way, then its `slicer`,
/// 16-byte slices with 1 ms after each): 50 events under each, each sent twice in turn by 8
/// senders at once. The first copy is `accepted` and the second `duplicate`, never a 5xx (the
/// key store's 2 s response timeout is not tripped by a slow link), and each event is
/// delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_on_a_slow_link_claims_each_event_once_and_delivers_it_once() {
    const EVENTS: usize = 50;
    let Some(keys) = Keys::open().await else {
        return;
    };
    let mut card = crate::report::Card::new("T3", "redis");
    let (proxy, handler, gateway) = keys.behind_proxy().await;
    let mut delivered = Vec::new();
    for fault in ["latency", "slicer"] {
        if fault == "latency" {
            proxy.set_latency(Duration::from_millis(10));
        } else {
            proxy.set_latency(Duration::ZERO);
            proxy.set_slicer(16, Duration::from_millis(1));
        }
        let ids: Vec<String> = (0..EVENTS)
            .map(|i| format!("{}_{i:03}", unique(&format!("evt_{fault}"))))
            .collect();
        let mut senders = tokio::task::JoinSet::new();
        for chunk in ids.chunks(EVENTS.div_ceil(8)) {
            let (ingest, chunk) = (gateway.ingest(), chunk.to_vec());
            senders.spawn(async move {
                for id in chunk {
                    let body = stripe_invoice_paid(&id, 5000);
                    for expected in ["accepted", "duplicate"] {
                        let (status, json) = ingest
                            .post("stripe", &stripe_headers(&body), body.clone())
                            .await;
                        assert_eq!(
                            (status, json["status"].as_str()),
                            (200, Some(expected)),
                            "{id} under {fault}: {json}"
                        );
                    }
                }
            });
        }
        senders.join_all().await;
        delivered.extend(ids.iter().map(|id| format!("stripe:{id}")));
        card.fault(fault, 1);
    }
    proxy.set_slicer(0, Duration::ZERO);
    wait_until_within("every event delivered", Duration::from_secs(120), || {
        delivered.iter().all(|k| handler.count_for(k) >= 1)
    })
    .await;
    let repeated: usize = delivered.iter().map(|k| handler.count_for(k) - 1).sum();
    assert_eq!(repeated, 0, "no event delivered twice");
    card.count("ops", 2 * delivered.len())
        .count("acked", delivered.len())
        .count("lost", 0)
        .count("duplicates", repeated)
        .figure("proxied_connections", proxy.accepted());
    drop(gateway);
    keys.clean_up().await;
}

/// T2 and T3 in Redis-keys mode: a gateway that dies mid-claim, at the crash points
/// `keys_after_claim_before_store` (its keys leased in Redis, nothing in the store) and
/// `keys_after_store_before_done` (queued in the store, the keys not marked done), with a 3 s
/// key lease. Started again, the provider's retries meet the dead gateway's lease (409
/// `in_flight`, `Retry-After`) until it runs out — never a 2xx while the event is in doubt —
/// and then one is accepted. Died before the store: the event is delivered once. Died after:
/// it is queued again and delivered twice, with the same `Idempotency-Key`, as README's "Redis
/// key store" table says (`gateway dies after queuing, before marking done`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_keys_gateway_dying_mid_claim_leaves_a_lease_the_retry_waits_out() {
    use hooklatch_core::crash;
    let Some(keys) = Keys::open().await else {
        return;
    };
    let mut card = crate::report::Card::new("T2", "redis");
    let mut in_flight = 0;
    for (point, deliveries) in [
        (crash::KEYS_AFTER_CLAIM_BEFORE_STORE, 1),
        (crash::KEYS_AFTER_STORE_BEFORE_DONE, 2),
    ] {
        let handler = Handler::start(Behaviour::AlwaysOk).await;
        let mut options = keys.options("");
        options
            .extra_env
            .push(("HOOKLATCH_STORE__KEY_LEASE".to_owned(), "3s".to_owned()));
        options
            .extra_env
            .push(("FAILPOINTS".to_owned(), format!("{point}=return")));
        let mut gw = Gateway::start_with(&handler, options).await;
        let event_id = unique("evt_redis_crash");
        let key = format!("stripe:{event_id}");
        let body = stripe_invoice_paid(&event_id, 5000);

        let first = gw
            .ingest()
            .try_post("stripe", &stripe_headers(&body), body.clone())
            .await;
        assert!(
            first.is_err(),
            "{point}: answered before the crash: {first:?}"
        );
        let status = gw.wait_exit().await;
        assert!(!status.success(), "{point}: the process aborted: {status}");
        gw.reconfigure(|o| o.extra_env.retain(|(name, _)| name != "FAILPOINTS"));
        gw.restart().await;

        // The provider retries until it hears 2xx; before the lease runs out it hears 409.
        eventually_within(
            "a retry accepted once the lease runs out",
            Duration::from_secs(30),
            async || {
                let (status, json) = gw
                    .post("stripe", &stripe_headers(&body), body.clone())
                    .await;
                match (status, json["status"].as_str(), json["code"].as_str()) {
                    (200, Some("accepted"), _) => true,
                    (409, _, Some("in_flight")) => {
                        in_flight += 1;
                        false
                    }
                    _ => panic!("{point}: {status} {json}"),
                }
            },
        )
        .await;
        wait_until_within("the deliveries", Duration::from_secs(30), || {
            handler.count_for(&key) >= deliveries
        })
        .await;
        let received = handler.received_for(&key);
        assert_eq!(received.len(), deliveries, "{point}");
        assert!(
            received.iter().all(|r| r.header("idempotency-key") == key),
            "{point}: one key"
        );
        card.fault(point, 1);
    }
    card.count("ops", 4)
        .count("acked", 2)
        .count("lost", 0)
        .count("duplicates", 1)
        .figure("in_flight_answers", in_flight as u64);
    keys.clean_up().await;
}

/// Sends each of `ids` once as a signed Stripe event: (id, status, `status` or `code` field).
async fn send_each(gateway: &Gateway, ids: &[String]) -> Vec<(String, u16, String)> {
    let mut answers = Vec::new();
    for id in ids {
        let body = stripe_invoice_paid(id, 5000);
        let (status, json) = gateway.post("stripe", &stripe_headers(&body), body).await;
        let said = json["status"].as_str().or(json["code"].as_str());
        answers.push((id.clone(), status, said.unwrap_or_default().to_owned()));
    }
    answers
}

/// A private Redis of 4 MiB under `policy`, and a gateway keeping its keys there. `None` (the
/// test skipped) where the Redis tests do not run: it needs only the `redis-server` binary,
/// but runs with the other Redis tests.
async fn small_redis(policy: &str) -> Option<(OwnRedis, Handler, Gateway)> {
    Keys::open().await?;
    let own = OwnRedis::start_with(
        crate::support::free_port(),
        &["--maxmemory", "4mb", "--maxmemory-policy", policy],
    )
    .await;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let options = Options {
        extra_env: vec![("HOOKLATCH_STORE__KEYS".to_owned(), own.url())],
        ..Options::default()
    };
    let gateway = Gateway::start_with(&handler, options).await;
    Some((own, handler, gateway))
}

/// T8, a full Redis under `noeviction` (the setting README asks for): with its memory taken
/// by other keys, every new event is answered 503 `key_store_unavailable`, never 2xx, and
/// nothing is evicted — the keys of the events accepted before are all still there. Once
/// memory is freed, the providers' retries are accepted and every event is delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_redis_under_noeviction_answers_503_and_evicts_nothing() {
    let Some((own, handler, gateway)) = small_redis("noeviction").await else {
        return;
    };
    let mut card = crate::report::Card::new("T8", "redis");
    let run = unique("evt_full_redis");
    let before: Vec<String> = (0..20).map(|i| format!("{run}_a{i:02}")).collect();
    let during: Vec<String> = (0..20).map(|i| format!("{run}_b{i:02}")).collect();
    for (id, status, said) in send_each(&gateway, &before).await {
        assert_eq!((status, said.as_str()), (200, "accepted"), "{id}");
    }
    let claims = own.count("*stripe*").await;
    assert_eq!(claims, before.len(), "one key per event");

    let fillers = own.fill(10_000).await;
    assert!(fillers < 10_000, "Redis never refused a write");
    own.over_the_limit().await;
    for (id, status, said) in send_each(&gateway, &during).await {
        assert_eq!(
            (status, said.as_str()),
            (503, "key_store_unavailable"),
            "{id} while Redis is full"
        );
    }
    // A provider's retry of an accepted event is never 2xx as new, full or not.
    for (id, status, said) in send_each(&gateway, &before[..5]).await {
        assert!(
            (status, said.as_str()) == (200, "duplicate") || status == 503,
            "{id}: {status} {said}"
        );
    }
    assert_eq!(
        own.stat("stats", "evicted_keys").await,
        0,
        "nothing evicted"
    );
    assert_eq!(own.count("*stripe*").await, claims, "every key still there");

    // Memory freed (the other keys removed), the providers' retries are accepted.
    let mut conn = own.connection().await;
    for i in 0..fillers {
        let _: () = conn.del(format!("filler:{i}")).await.expect("DEL");
    }
    for (id, status, said) in send_each(&gateway, &during).await {
        assert_eq!(
            (status, said.as_str()),
            (200, "accepted"),
            "{id} after room was made"
        );
    }
    let all: Vec<String> = before
        .iter()
        .chain(&during)
        .map(|id| format!("stripe:{id}"))
        .collect();
    wait_until_within("every event delivered", Duration::from_secs(30), || {
        all.iter().all(|k| handler.count_for(k) >= 1)
    })
    .await;
    assert!(all.iter().all(|k| handler.count_for(k) == 1), "each once");
    card.count("ops", 2 * during.len() + before.len() + 5)
        .count("acked", all.len())
        .count("lost", 0)
        .count("duplicates", 0)
        .figure("fillers_before_full", fillers as u64)
        .figure("evicted_claims", 0);
}

/// T8's control: the same with `allkeys-lru`, the policy README warns against. Filling Redis
/// evicts event keys, and the providers' retries of those events are accepted again: extra
/// deliveries (under the same `Idempotency-Key`, for the application's guard), never a lost
/// event. What `noeviction` prevents, shown happening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicting_redis_turns_evictions_into_extra_deliveries_never_losses() {
    let Some((own, handler, gateway)) = small_redis("allkeys-lru").await else {
        return;
    };
    let mut card = crate::report::Card::new("T8", "redis");
    let run = unique("evt_lru");
    let ids: Vec<String> = (0..50).map(|i| format!("{run}_{i:02}")).collect();
    for (id, status, said) in send_each(&gateway, &ids).await {
        assert_eq!((status, said.as_str()), (200, "accepted"), "{id}");
    }
    let keys: Vec<String> = ids.iter().map(|id| format!("stripe:{id}")).collect();
    wait_until_within("every event delivered", Duration::from_secs(30), || {
        keys.iter().all(|k| handler.count_for(k) == 1)
    })
    .await;

    // 8 MiB of other keys in a 4 MiB Redis: it evicts, the event keys among them.
    assert_eq!(
        own.fill(512).await,
        512,
        "an evicting Redis refuses no write"
    );
    let evicted = own.stat("stats", "evicted_keys").await;
    let kept = own.count("*stripe*").await;
    assert!(
        kept < ids.len(),
        "no event key was evicted ({evicted} keys were)"
    );

    let answers = send_each(&gateway, &ids).await;
    let again = answers
        .iter()
        .filter(|(_, _, said)| said == "accepted")
        .count();
    for (id, status, said) in &answers {
        assert_eq!(*status, 200, "{id}: {said}");
        assert!(said == "accepted" || said == "duplicate", "{id}: {said}");
    }
    assert_eq!(
        again,
        ids.len() - kept,
        "each evicted key's event is taken as new"
    );
    wait_until_within(
        "the extra deliveries arrive",
        Duration::from_secs(30),
        || keys.iter().map(|k| handler.count_for(k)).sum::<usize>() == ids.len() + again,
    )
    .await;
    assert!(keys.iter().all(|k| handler.count_for(k) >= 1), "none lost");
    card.count("ops", 2 * ids.len())
        .count("acked", ids.len())
        .count("lost", 0)
        .count("duplicates", again)
        .figure("evicted_keys", evicted)
        .figure("evicted_claims", (ids.len() - kept) as u64);
}

/// T1's order check in Redis-keys mode: no copy is answered 2xx before the first copy's work
/// is queued and its key marked done. The first copy of an event pauses at each of the two
/// points between its claim and the end (`keys_after_claim_before_store`: claimed in Redis,
/// nothing in the store; `keys_after_store_before_done`: queued, the key not yet done), 1.5 s
/// at an await; while it waits, other copies are answered 409 `in_flight` with `Retry-After`,
/// never 2xx. Once the first is answered `accepted`, the next copy is a `duplicate`;
/// delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_copy_is_answered_2xx_before_the_first_is_queued_and_marked_done() {
    use hooklatch_core::crash;
    let Some(keys) = Keys::open().await else {
        return;
    };
    for point in [
        crash::KEYS_AFTER_CLAIM_BEFORE_STORE,
        crash::KEYS_AFTER_STORE_BEFORE_DONE,
    ] {
        let handler = Handler::start(Behaviour::AlwaysOk).await;
        let mut options = keys.options("");
        options.extra_env.push((
            "FAILPOINTS".to_owned(),
            format!("{point}=1*return(pause:1500)"),
        ));
        let gw = Gateway::start_with(&handler, options).await;
        let event_id = unique("evt_redis_order");
        let key = format!("stripe:{event_id}");
        let body = stripe_invoice_paid(&event_id, 5000);
        let first = tokio::spawn({
            let (ingest, body) = (gw.ingest(), body.clone());
            async move { ingest.post("stripe", &stripe_headers(&body), body).await }
        });
        let redis_key = keys.key("stripe", &event_id);
        eventually_within(
            "the first copy holds the key in flight",
            Duration::from_secs(10),
            async || {
                keys.get(&redis_key)
                    .await
                    .is_some_and(|v| v.starts_with("i:"))
            },
        )
        .await;
        let mut refused = 0;
        while !first.is_finished() {
            let res = gw
                .ingest()
                .send("stripe", &stripe_headers(&body), body.clone())
                .await
                .expect("an answer");
            let status = res.status().as_u16();
            if first.is_finished() {
                break; // this copy may have come after the first was answered
            }
            assert_eq!(
                status, 409,
                "{point}: a copy answered while the first waits"
            );
            assert!(res.headers().contains_key("retry-after"), "{point}");
            refused += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (status, json) = first.await.expect("the first copy's task");
        assert_eq!(
            (status, json["status"].as_str()),
            (200, Some("accepted")),
            "{point}: {json}"
        );
        assert!(
            refused >= 3,
            "{point}: only {refused} copies came while the first waited"
        );
        let (status, json) = gw
            .post("stripe", &stripe_headers(&body), body.clone())
            .await;
        assert_eq!(
            (status, json["status"].as_str()),
            (200, Some("duplicate")),
            "{point}: {json}"
        );
        gw.wait_for_delivery_state(&key, "delivered").await;
        assert_eq!(handler.count_for(&key), 1, "{point}: delivered once");
        println!("{point}: {refused} copies answered 409 while the first waited");
    }
    keys.clean_up().await;
}
