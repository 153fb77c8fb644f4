//! The load generator behind `hooklatch bench`: ingest throughput, latency and the server's
//! memory, side by side with the HTTP ceiling of the same machine, and end-to-end delivery.
//!
//! **The plan.** [`plan`] pre-signs `events` distinct test events of one provider (so signing
//! costs nothing during the run), each padded with a JSON field to `body_size` bytes, then
//! mixes in duplicates: byte-identical copies of earlier requests. `duplicates` is their share
//! of all requests (0.1 = one request in ten is a copy), so `round(events × F / (1 − F))`
//! copies; half of them are sent right behind their original (concurrently with it, under any
//! concurrency above one), half later (after the original has been answered, as a provider's
//! retry is).
//!
//! **The load.** [`Load::Concurrency`] is a closed loop: K requests in flight, the next sent
//! when one is answered. [`Load::Rate`] is an open loop: request *i* is due at `start + i/R`
//! whether or not earlier ones were answered, and its latency is measured from that due time,
//! so a stalled server shows up in the percentiles instead of quietly lowering the rate
//! (coordinated omission). Requests are paced by tokio's timer, which fires on whole
//! milliseconds: a request leaves up to 1 ms after its due time, in a burst with the others due
//! in that millisecond, and the lateness counts in its latency (at 500 requests/s the median
//! read 1.7–2.0 ms, against 0.64–0.68 ms with a thread that slept until each due time). That
//! thread was not kept: on 2 shared cores the smooth arrivals cost the gateway a quarter more
//! CPU per request and the bench two thirds more, and the p99 at half load came out no better
//! (BENCHMARKS.md). It keeps a fixed set of connections, as wrk2 does: by default the
//! requests of 10 ms at its rate ([`warm_connections`]), opened before its clock starts (by as
//! many `GET /` at once, which the gateway answers 404 without touching its store). A request
//! due while every connection is busy waits for one, and the wait counts in its latency.
//! Without a cap, a stall of a few milliseconds made the client open a connection for nearly
//! every request due meanwhile (570 to 890 at 9,500 requests/s, where about 25 are in
//! flight), and the connection storm, not the server, set the next 100–250 ms of latency.
//!
//! **The warm-up.** With `warmup`, an open loop first sends the same rate for that long, with
//! events of its own (and their share of copies), and counts none of it: the measured requests
//! follow on the same clock and connections without a pause. Over a 10 s run at half load,
//! the first 100–300 ms set the p99: a PostgreSQL gateway just started answers its first
//! requests in 30–70 ms (its new backends' first statements), so every connection is busy
//! and the requests due meanwhile wait for one (a packet capture on loopback showed it;
//! BENCHMARKS.md). wrk2 leaves out its first 10 s for the same reason.
//!
//! **Alongside.** [`baseline_server`] is a minimal hyper server answering 200 to anything: the
//! HTTP ceiling of the machine, run with the same plan and the same client. [`Sink`] is a
//! destination that records the first delivery of each `Idempotency-Key`, for delivery
//! throughput and the time from ack to first delivery attempt. [`RssSampler`] reads a
//! process's `VmRSS`/`VmHWM` from `/proc`, and [`CpuSpan`] the CPU time the server and the
//! whole machine spent during a run: a ratio to the ceiling reads differently when the cores
//! were saturated than when a third of them sat idle (a latency-bound server).

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use hooklatch_core::provider::SignRequest;
use hooklatch_core::{Secret, Timestamp};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

/// What a run does.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// The ingest base URL, e.g. `http://127.0.0.1:8080`.
    pub target: String,
    /// The source name: requests go to `{target}/in/{source}`.
    pub source: String,
    /// The provider whose test events are sent (see `fixtures::catalog`).
    pub provider: String,
    /// The source's signing secret.
    pub secret: Secret,
    /// Distinct events.
    pub events: u64,
    /// Share of all requests that are duplicates, 0.0 ≤ F ≤ 0.9.
    pub duplicates: f64,
    /// Pad each body to at least this many bytes (0: the fixture as it is).
    pub body_size: usize,
    /// Closed or open loop.
    pub load: Load,
    /// Stop sending new requests after this long (those in flight finish).
    pub duration: Option<Duration>,
    /// Time allowed for one request.
    pub timeout: Duration,
    /// Open loop only: the most connections it keeps (default [`warm_connections`] of the
    /// rate), all opened before its clock starts.
    pub connections: Option<usize>,
    /// Open loop only: send the same load for this long before the measured requests, with
    /// events of its own, and count none of it (see the module doc).
    pub warmup: Option<Duration>,
}

/// How requests are paced.
#[derive(Debug, Clone, Copy)]
pub enum Load {
    /// Closed loop: this many requests in flight at once.
    Concurrency(u32),
    /// Open loop: this many requests per second, each due at a fixed time.
    Rate(f64),
}

/// One pre-signed request.
#[derive(Debug)]
pub struct Prepared {
    /// The event key.
    pub key: String,
    /// Headers, signature included.
    pub headers: reqwest::header::HeaderMap,
    /// The body.
    pub body: bytes::Bytes,
}

/// The requests of a run, in sending order: indexes into `events`, with whether it is a copy.
#[derive(Debug)]
pub struct Plan {
    /// The distinct events, pre-signed: the warm-up's first, then the measured ones.
    pub events: Vec<Prepared>,
    /// Sending order: `(event index, is a duplicate)`; the first `warmup` are the warm-up's.
    pub order: Vec<(usize, bool)>,
    /// How many of `order` are the warm-up's, sent first and counted nowhere.
    pub warmup: usize,
}

impl Plan {
    /// Measured requests in all.
    pub fn len(&self) -> usize {
        self.order.len() - self.warmup
    }

    /// Whether there is nothing to measure.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Duplicates among the measured requests.
    pub fn duplicates(&self) -> usize {
        self.measured().iter().filter(|(_, dup)| *dup).count()
    }

    /// The measured requests, in sending order.
    pub fn measured(&self) -> &[(usize, bool)] {
        &self.order[self.warmup..]
    }

    /// The measured distinct events.
    pub fn measured_events(&self) -> usize {
        self.measured().iter().filter(|(_, dup)| !*dup).count()
    }
}

/// The number of duplicate copies for `events` distinct events at share `f` of all requests.
pub fn duplicate_count(events: u64, f: f64) -> u64 {
    if f <= 0.0 {
        return 0;
    }
    (events as f64 * f / (1.0 - f)).round() as u64
}

/// Builds and signs the plan (see the module docs).
pub fn plan(opts: &BenchOptions) -> anyhow::Result<Plan> {
    anyhow::ensure!(opts.events > 0, "--events must be at least 1");
    anyhow::ensure!(
        (0.0..=0.9).contains(&opts.duplicates),
        "--duplicates is a share of all requests between 0.0 and 0.9"
    );
    let warmup_events = match (opts.warmup, opts.load) {
        (None, _) => 0,
        (Some(w), _) if w.is_zero() => 0,
        (Some(w), Load::Rate(rate)) => {
            // Requests due during the warm-up, of which the duplicates' share are copies.
            let requests = (rate * w.as_secs_f64()).round();
            ((requests * (1.0 - opts.duplicates)).ceil() as u64).max(1)
        }
        (Some(_), Load::Concurrency(_)) => {
            anyhow::bail!("--warmup goes with an open loop (--rate), not --concurrency")
        }
    };
    let url = format!("{}/in/{}", opts.target.trim_end_matches('/'), opts.source);
    let adapter = crate::fixtures::signer(&opts.provider, &opts.secret)
        .ok_or_else(|| anyhow::anyhow!("no test events for provider {:?}", opts.provider))?;
    let now = Timestamp::now();
    let total = warmup_events + opts.events;
    let mut events = Vec::with_capacity(total as usize);
    for i in 0..total {
        let ev = crate::fixtures::build(&opts.provider, None, None, &opts.secret, &url, now)?;
        let body = pad(&ev.body, opts.body_size, i);
        let content_type = ev
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("content-type"))
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| "application/json".to_owned());
        let mut pairs = vec![("content-type".to_owned(), content_type)];
        pairs.extend(adapter.sign(&SignRequest {
            url: &url,
            body: &body,
            secret: &opts.secret,
            now,
            event_key: &ev.key,
            event_type: Some(&ev.event_type),
        }));
        let mut headers = reqwest::header::HeaderMap::new();
        for (name, value) in pairs {
            headers.insert(
                reqwest::header::HeaderName::from_bytes(name.as_bytes())?,
                reqwest::header::HeaderValue::from_str(&value)?,
            );
        }
        events.push(Prepared {
            key: ev.key,
            headers,
            body: body.into(),
        });
    }
    let lag = match opts.load {
        Load::Concurrency(k) => 2 * k as usize + 1,
        Load::Rate(r) => (r as usize).max(1),
    };
    let mut order = mix(0, warmup_events as usize, opts.duplicates, lag);
    let warmup = order.len();
    order.extend(mix(
        warmup_events as usize,
        opts.events as usize,
        opts.duplicates,
        lag,
    ));
    Ok(Plan {
        events,
        order,
        warmup,
    })
}

/// The sending order of events `first..first + n` with the duplicates' share `f` mixed in.
/// Copy j duplicates event (j × n / dups) mod n: spread evenly. Even j go right behind their
/// original, odd j `lag` originals later (or at the end).
fn mix(first: usize, n: usize, f: f64, lag: usize) -> Vec<(usize, bool)> {
    let dups = duplicate_count(n as u64, f) as usize;
    let mut behind: HashMap<usize, usize> = HashMap::new();
    let mut later_events: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for j in 0..dups {
        let ev = (j * n / dups.max(1) + j / n.max(1)) % n;
        if j % 2 == 0 {
            *behind.entry(ev).or_default() += 1;
        } else {
            later_events.entry(ev + lag).or_default().push(ev);
        }
    }
    let mut order = Vec::with_capacity(n + dups);
    for i in 0..n {
        if let Some(evs) = later_events.remove(&i) {
            order.extend(evs.into_iter().map(|e| (first + e, true)));
        }
        order.push((first + i, false));
        for _ in 0..behind.get(&i).copied().unwrap_or(0) {
            order.push((first + i, true));
        }
    }
    for (_, evs) in later_events {
        order.extend(evs.into_iter().map(|e| (first + e, true)));
    }
    order
}

/// Pads a JSON object body with `"bench_padding":"…"` to at least `size` bytes; other bodies
/// (form-encoded) get `&bench_padding=…`. Index `i` keeps bodies distinct, and [`filler`]
/// makes the padding compress about as well as a provider's JSON does, not better.
fn pad(body: &[u8], size: usize, i: u64) -> Vec<u8> {
    if body.len() >= size {
        return body.to_vec();
    }
    let trimmed = body.trim_ascii_end();
    if trimmed.last() == Some(&b'}') {
        let head = &trimmed[..trimmed.len() - 1];
        let prefix = format!(",\"bench_padding\":\"{i}-");
        let fill = size.saturating_sub(head.len() + prefix.len() + 2);
        let mut out = head.to_vec();
        out.extend_from_slice(prefix.as_bytes());
        out.extend(filler(i, fill));
        out.extend_from_slice(b"\"}");
        out
    } else {
        let prefix = format!("&bench_padding={i}-");
        let fill = size.saturating_sub(body.len() + prefix.len());
        let mut out = body.to_vec();
        out.extend_from_slice(prefix.as_bytes());
        out.extend(filler(i, fill));
        out
    }
}

/// `len` bytes of text shaped like a webhook payload's fields: names from a small vocabulary,
/// then an object id (random), an amount or a time (random digits) or a word from a short
/// list, as a provider's JSON repeats its names and enums but not its ids. Deterministic in
/// `seed`. Only `[A-Za-z0-9_.:-]`, so it needs no escaping in JSON nor in a form.
///
/// Repeated bytes would compress to almost nothing, and a store that compresses bodies would
/// then look faster than it is with real payloads.
fn filler(seed: u64, len: usize) -> Vec<u8> {
    const NAMES: &[&str] = &[
        "id",
        "object",
        "amount",
        "amount_paid",
        "currency",
        "customer",
        "description",
        "invoice",
        "line_item",
        "period_start",
        "period_end",
        "price",
        "product",
        "quantity",
        "subscription",
        "unit_amount",
        "livemode",
        "proration",
        "discountable",
        "created",
        "status",
        "metadata",
        "tax_rates",
        "billing_reason",
    ];
    const WORDS: &[&str] = &[
        "usd",
        "eur",
        "gbp",
        "false",
        "true",
        "null",
        "paid",
        "open",
        "recurring",
        "licensed",
        "per_unit",
        "subscription_cycle",
        "automatic",
        "charge_automatically",
        "exclusive",
    ];
    const PREFIXES: &[&str] = &[
        "cus_", "in_", "il_", "price_", "prod_", "sub_", "ch_", "pi_",
    ];
    const BASE62: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    let mut rng = StdRng::seed_from_u64(seed);
    let mut next = move || rng.random::<u64>();
    let mut out = Vec::with_capacity(len + 32);
    while out.len() < len {
        let r = next();
        out.extend_from_slice(NAMES[(r % NAMES.len() as u64) as usize].as_bytes());
        out.push(b':');
        match (r >> 8) % 3 {
            0 => {
                out.extend_from_slice(
                    PREFIXES[((r >> 16) % PREFIXES.len() as u64) as usize].as_bytes(),
                );
                let mut bits = next();
                for _ in 0..10 {
                    out.push(BASE62[(bits % 62) as usize]);
                    bits /= 62;
                }
            }
            1 => out.extend_from_slice(((r >> 16) % 10_000_000_000).to_string().as_bytes()),
            _ => out.extend_from_slice(WORDS[((r >> 16) % WORDS.len() as u64) as usize].as_bytes()),
        }
        out.push(b'.');
    }
    out.truncate(len);
    out
}

/// What came back, and how fast.
#[derive(Debug, Clone)]
pub struct BenchReport {
    /// What ran against (`target` or `baseline`).
    pub label: String,
    /// Requests sent (distinct events plus duplicates, fewer if `--duration` cut it short).
    pub sent: u64,
    /// Of them, duplicates.
    pub duplicates_sent: u64,
    /// Responses by status code (`"error"`: no response: connect error or timeout).
    pub statuses: BTreeMap<String, u64>,
    /// Answers by what they said: a 200 by the gateway's `status` (accepted, duplicate,
    /// conflict; `other` for a body that is not the gateway's, such as the baseline's), a
    /// refusal by its `code` (`invalid_signature`), a request that got none by why (`no
    /// answer: connection failed (Connection refused …)`).
    pub answers: BTreeMap<String, u64>,
    /// Wall time of the run.
    pub elapsed: Duration,
    /// Latency histogram, microseconds.
    pub latency: Histogram<u64>,
    /// When each accepted event's ack arrived (for the sink's ack → delivery latency).
    pub acks: HashMap<String, Instant>,
    /// When the run started.
    pub started: Instant,
}

impl BenchReport {
    /// Responses per second.
    pub fn throughput(&self) -> f64 {
        self.sent as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// Whether every request was answered 200.
    pub fn all_ok(&self) -> bool {
        self.statuses.iter().all(|(s, _)| s == "200")
    }

    /// Latency at a quantile, milliseconds.
    pub fn latency_ms(&self, q: f64) -> f64 {
        if self.latency.is_empty() {
            return 0.0;
        }
        self.latency.value_at_quantile(q) as f64 / 1000.0
    }

    /// The report as JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "label": self.label,
            "sent": self.sent,
            "duplicates_sent": self.duplicates_sent,
            "statuses": self.statuses,
            "answers": self.answers,
            "elapsed_s": self.elapsed.as_secs_f64(),
            "throughput_rps": self.throughput(),
            "latency_ms": {
                "p50": self.latency_ms(0.5),
                "p90": self.latency_ms(0.9),
                "p99": self.latency_ms(0.99),
                "p999": self.latency_ms(0.999),
                "max": self.latency.max() as f64 / 1000.0,
            },
        })
    }

    /// The report as text.
    pub fn render(&self) -> String {
        let statuses: Vec<String> = self
            .statuses
            .iter()
            .map(|(s, n)| format!("{s}×{n}"))
            .collect();
        let answers: Vec<String> = self
            .answers
            .iter()
            .map(|(s, n)| format!("{s}×{n}"))
            .collect();
        format!(
            "{label}: {sent} requests ({dups} duplicates) in {secs:.2}s = {rps:.0} req/s\n  \
             latency ms: p50 {p50:.2}  p90 {p90:.2}  p99 {p99:.2}  p99.9 {p999:.2}  max {max:.2}\n  \
             statuses: {statuses}\n  answers: {answers}\n",
            label = self.label,
            sent = self.sent,
            dups = self.duplicates_sent,
            secs = self.elapsed.as_secs_f64(),
            rps = self.throughput(),
            p50 = self.latency_ms(0.5),
            p90 = self.latency_ms(0.9),
            p99 = self.latency_ms(0.99),
            p999 = self.latency_ms(0.999),
            max = self.latency.max() as f64 / 1000.0,
            statuses = statuses.join(" "),
            answers = answers.join(" "),
        )
    }
}

/// Why a request got no answer, for the report's `answers`: timed out, or the connection's
/// own reason (the innermost error: `Connection refused (os error 111)`).
fn no_answer(err: &reqwest::Error) -> String {
    if err.is_timeout() {
        return "no answer: timed out".to_owned();
    }
    let mut cause: &dyn std::error::Error = err;
    while let Some(inner) = cause.source() {
        cause = inner;
    }
    let kind = if err.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    format!("no answer: {kind} ({cause})")
}

/// Shared tallies while a run is going.
struct Tally {
    statuses: Mutex<BTreeMap<String, u64>>,
    answers: Mutex<BTreeMap<String, u64>>,
    latency: Mutex<Histogram<u64>>,
    acks: Mutex<HashMap<String, Instant>>,
    sent: AtomicU64,
    dups: AtomicU64,
}

fn histogram() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds")
}

/// An HTTP client for loopback load: no proxy, no redirects, a large idle pool.
pub fn client(timeout: Duration) -> anyhow::Result<reqwest::Client> {
    Ok(crate::trust::client_builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .pool_max_idle_per_host(4096)
        .tcp_nodelay(true)
        .build()?)
}

/// How many connections an open loop at `rate` requests/s keeps unless told: the requests of
/// 10 ms at that rate, at least 8 and at most 512. That carries the rate while requests take
/// up to 10 ms, the ack latency's p99 target (about four times what a server answering in
/// 2–3 ms keeps in flight); past it, requests wait for a connection, and that shows in their
/// latency.
pub fn warm_connections(rate: f64) -> usize {
    ((rate / 100.0).ceil() as usize).clamp(8, 512)
}

/// Opens up to `n` connections to `base` into `client`'s pool with `n` simultaneous `GET /`
/// (answered 404 by the gateway, without a history record), their answers ignored.
async fn open_connections(client: &reqwest::Client, base: &str, n: usize) {
    let url = format!("{}/", base.trim_end_matches('/'));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let request = client.get(&url).send();
        tasks.spawn(async move {
            if let Ok(res) = request.await {
                let _ = res.bytes().await;
            }
        });
    }
    while tasks.join_next().await.is_some() {}
}

/// Runs `plan` against `{base}/in/{source}`; `progress` is called once per answered request
/// that counts, and `at_start` once, just before the first of them is due (after the
/// warm-up, if any).
pub async fn run(
    plan: Arc<Plan>,
    base: &str,
    opts: &BenchOptions,
    label: &str,
    progress: Arc<dyn Fn() + Send + Sync>,
    at_start: Box<dyn FnOnce() + Send>,
) -> anyhow::Result<BenchReport> {
    let url: Arc<str> = format!("{}/in/{}", base.trim_end_matches('/'), opts.source).into();
    let client = client(opts.timeout)?;
    let tally = Arc::new(Tally {
        statuses: Mutex::new(BTreeMap::new()),
        answers: Mutex::new(BTreeMap::new()),
        latency: Mutex::new(histogram()),
        // Sized for every distinct event up front: growing it under its lock, while every
        // answer waits to record, stalled the open loop for tens of milliseconds each time
        // it doubled (its own pause, measured as the server's latency).
        acks: Mutex::new(HashMap::with_capacity(plan.events.len())),
        sent: AtomicU64::new(0),
        dups: AtomicU64::new(0),
    });
    // An open loop's connections: opened now, then a permit per request in flight.
    let connections = match opts.load {
        Load::Rate(rate) => {
            let n = opts
                .connections
                .unwrap_or_else(|| warm_connections(rate))
                .max(1);
            open_connections(&client, base, n).await;
            Some(Arc::new(tokio::sync::Semaphore::new(n)))
        }
        Load::Concurrency(_) => None,
    };
    let clock = Instant::now();
    // The measured requests' clock: after the warm-up's requests (open loop only).
    let (started, interval) = match opts.load {
        Load::Rate(rate) => {
            anyhow::ensure!(rate > 0.0, "--rate must be above 0");
            let interval = Duration::from_secs_f64(1.0 / rate);
            (clock + interval.mul_f64(plan.warmup as f64), interval)
        }
        Load::Concurrency(_) => (clock, Duration::ZERO),
    };
    let deadline = opts.duration.map(|d| started + d);
    let warmup = plan.warmup;
    let send_one = {
        let (client, url, tally, plan, progress) = (
            client.clone(),
            url.clone(),
            tally.clone(),
            plan.clone(),
            progress.clone(),
        );
        move |i: usize, due: Instant| {
            let (client, url, tally, plan, progress) = (
                client.clone(),
                url.clone(),
                tally.clone(),
                plan.clone(),
                progress.clone(),
            );
            async move {
                let (ev, dup) = plan.order[i];
                let event = &plan.events[ev];
                let counted = i >= warmup;
                if counted {
                    tally.sent.fetch_add(1, Ordering::Relaxed);
                    if dup {
                        tally.dups.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let res = client
                    .post(&*url)
                    .headers(event.headers.clone())
                    .body(event.body.clone())
                    .send()
                    .await;
                let (status, answer) = match res {
                    Ok(res) => {
                        let status = res.status().as_u16().to_string();
                        let body = res.bytes().await.unwrap_or_default();
                        // A 200's `status`, a refusal's `code` (`invalid_signature`).
                        let field = if status == "200" { "status" } else { "code" };
                        let answer = serde_json::from_slice::<Value>(&body)
                            .ok()
                            .and_then(|v| v[field].as_str().map(str::to_owned))
                            .or_else(|| (status == "200").then(|| "other".to_owned()));
                        (status, answer)
                    }
                    Err(err) => ("error".to_owned(), Some(no_answer(&err))),
                };
                if !counted {
                    return;
                }
                let done = Instant::now();
                let micros = done.saturating_duration_since(due).as_micros() as u64;
                tally
                    .latency
                    .lock()
                    .unwrap()
                    .saturating_record(micros.max(1));
                *tally.statuses.lock().unwrap().entry(status).or_default() += 1;
                if let Some(answer) = answer {
                    if answer == "accepted" {
                        tally.acks.lock().unwrap().insert(event.key.clone(), done);
                    }
                    *tally.answers.lock().unwrap().entry(answer).or_default() += 1;
                }
                progress();
            }
        }
    };
    let mut at_start = Some(at_start);
    match opts.load {
        Load::Concurrency(k) => {
            if let Some(at_start) = at_start.take() {
                at_start();
            }
            let next = Arc::new(AtomicUsize::new(0));
            let mut workers = tokio::task::JoinSet::new();
            for _ in 0..k.max(1) {
                let (next, plan, send_one) = (next.clone(), plan.clone(), send_one.clone());
                workers.spawn(async move {
                    loop {
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            break;
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= plan.order.len() {
                            break;
                        }
                        send_one(i, Instant::now()).await;
                    }
                });
            }
            while workers.join_next().await.is_some() {}
        }
        Load::Rate(_) => {
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..plan.order.len() {
                let due = clock + interval.mul_f64(i as f64);
                if deadline.is_some_and(|d| due >= d) {
                    break;
                }
                tokio::time::sleep_until(due.into()).await;
                if i == warmup {
                    if let Some(at_start) = at_start.take() {
                        at_start();
                    }
                }
                let request = send_one(i, due);
                let connections = connections.clone();
                tasks.spawn(async move {
                    // Waiting for a free connection is part of the request's latency.
                    let _free = match connections {
                        Some(connections) => connections.acquire_owned().await.ok(),
                        None => None,
                    };
                    request.await;
                });
                // Reap finished tasks so the set stays small.
                while tasks.try_join_next().is_some() {}
            }
            while tasks.join_next().await.is_some() {}
        }
    }
    if let Some(at_start) = at_start.take() {
        at_start();
    }
    let elapsed = started.elapsed();
    drop(send_one);
    let tally = Arc::try_unwrap(tally).map_err(|_| anyhow::anyhow!("requests still running"))?;
    Ok(BenchReport {
        label: label.to_owned(),
        sent: tally.sent.into_inner(),
        duplicates_sent: tally.dups.into_inner(),
        statuses: tally.statuses.into_inner().unwrap(),
        answers: tally.answers.into_inner().unwrap(),
        elapsed,
        latency: tally.latency.into_inner().unwrap(),
        acks: tally.acks.into_inner().unwrap(),
        started,
    })
}

// ---------------------------------------------------------------------------------------------
// The HTTP ceiling

type Body = String;

async fn serve_loop<F, Fut>(listener: tokio::net::TcpListener, handle: F)
where
    F: Fn(http::Request<hyper::body::Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = http::Response<Body>> + Send + 'static,
{
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        let handle = handle.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req| {
                let fut = handle(req);
                async move { Ok::<_, std::convert::Infallible>(fut.await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                .await;
        });
    }
}

/// Reads a request body to the end (the gateway reads it too, so the ceiling does).
async fn drain(body: hyper::body::Incoming) -> usize {
    use http_body_util::BodyExt;
    body.collect()
        .await
        .map(|b| b.to_bytes().len())
        .unwrap_or(0)
}

/// A minimal hyper server on `127.0.0.1:0` answering 200 `{"status":"ok"}` to every request,
/// on a runtime of its own (two worker threads, like a separate server process).
pub struct Baseline {
    /// Its address.
    pub addr: SocketAddr,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Drop for Baseline {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Starts the HTTP ceiling server.
pub fn baseline_server() -> anyhow::Result<Baseline> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bench-baseline")
        .enable_all()
        .build()?;
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    std_listener.set_nonblocking(true)?;
    let addr = std_listener.local_addr()?;
    runtime.spawn(async move {
        let Ok(listener) = tokio::net::TcpListener::from_std(std_listener) else {
            return;
        };
        serve_loop(
            listener,
            |req: http::Request<hyper::body::Incoming>| async move {
                drain(req.into_body()).await;
                http::Response::builder()
                    .header("content-type", "application/json")
                    .body(r#"{"status":"ok"}"#.to_owned())
                    .expect("a valid response")
            },
        )
        .await
    });
    Ok(Baseline {
        addr,
        runtime: Some(runtime),
    })
}

// ---------------------------------------------------------------------------------------------
// The delivery sink

/// A destination recording the first delivery of each `Idempotency-Key` (`{source}:{key}`).
pub struct Sink {
    /// Its address (`http://{addr}/sink` is a destination URL).
    pub addr: SocketAddr,
    state: Arc<SinkState>,
    task: tokio::task::JoinHandle<()>,
}

struct SinkState {
    first: Mutex<HashMap<String, Instant>>,
    deliveries: AtomicU64,
}

impl Drop for Sink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Sink {
    /// Starts a sink on `listen` (`127.0.0.1:0` for any port); each answer waits `delay`.
    /// `keys` is how many distinct keys it expects: its record is sized for them up front,
    /// so it does not grow (under its lock) while deliveries arrive.
    pub async fn start(listen: SocketAddr, delay: Duration, keys: usize) -> anyhow::Result<Sink> {
        let listener = tokio::net::TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(SinkState {
            first: Mutex::new(HashMap::with_capacity(keys)),
            deliveries: AtomicU64::new(0),
        });
        let st = state.clone();
        let task = tokio::spawn(serve_loop(
            listener,
            move |req: http::Request<hyper::body::Incoming>| {
                let st = st.clone();
                async move {
                    let key = req
                        .headers()
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned);
                    drain(req.into_body()).await;
                    let now = Instant::now();
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    st.deliveries.fetch_add(1, Ordering::Relaxed);
                    if let Some(key) = key {
                        st.first.lock().unwrap().entry(key).or_insert(now);
                    }
                    http::Response::builder()
                        .body(String::new())
                        .expect("a valid response")
                }
            },
        ));
        Ok(Sink { addr, state, task })
    }

    /// Deliveries received (every attempt).
    pub fn deliveries(&self) -> u64 {
        self.state.deliveries.load(Ordering::Relaxed)
    }

    /// Distinct keys delivered.
    pub fn distinct(&self) -> usize {
        self.state.first.lock().unwrap().len()
    }

    /// Waits until every acked key of `report` was delivered at least once, or `timeout`;
    /// then measures delivery throughput and ack → first delivery latency.
    pub async fn wait_and_measure(
        &self,
        report: &BenchReport,
        source: &str,
        timeout: Duration,
    ) -> DeliveryReport {
        let want = report.acks.len();
        let until = Instant::now() + timeout;
        while self.distinct() < want && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let first = self.state.first.lock().unwrap().clone();
        let mut latency = histogram();
        let mut before_ack = 0u64;
        let mut last = report.started;
        let mut delivered = 0u64;
        for (key, ack) in &report.acks {
            let Some(at) = first.get(&format!("{source}:{key}")) else {
                continue;
            };
            delivered += 1;
            last = last.max(*at);
            if *at < *ack {
                before_ack += 1;
            }
            let micros = at.saturating_duration_since(*ack).as_micros() as u64;
            latency.saturating_record(micros.max(1));
        }
        let span = last.saturating_duration_since(report.started);
        DeliveryReport {
            accepted: want as u64,
            delivered,
            attempts: self.deliveries(),
            before_ack,
            span,
            latency,
        }
    }

    /// Waits until `want` distinct keys have arrived, or `timeout`; then measures how fast
    /// they came: a backlog the gateway already held, delivered with nothing else to do.
    pub async fn wait_for_drain(&self, want: usize, timeout: Duration) -> DrainReport {
        let until = Instant::now() + timeout;
        while self.distinct() < want && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let first = self.state.first.lock().unwrap();
        let span = match (first.values().min(), first.values().max()) {
            (Some(a), Some(b)) => b.saturating_duration_since(*a),
            _ => Duration::ZERO,
        };
        DrainReport {
            want: want as u64,
            delivered: first.len() as u64,
            attempts: self.deliveries(),
            span,
        }
    }
}

/// A backlog's delivery through the sink ([`Sink::wait_for_drain`]).
#[derive(Debug, Clone)]
pub struct DrainReport {
    /// Distinct events expected.
    pub want: u64,
    /// Distinct events delivered within the wait.
    pub delivered: u64,
    /// Delivery attempts the sink saw (retries included).
    pub attempts: u64,
    /// From the first event's arrival to the last's.
    pub span: Duration,
}

impl DrainReport {
    /// Events per second, over the time between the first arrival and the last.
    pub fn throughput(&self) -> f64 {
        self.delivered.saturating_sub(1) as f64 / self.span.as_secs_f64().max(1e-9)
    }

    /// Whether every expected event arrived.
    pub fn complete(&self) -> bool {
        self.delivered >= self.want
    }

    /// As JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "expected": self.want,
            "delivered": self.delivered,
            "attempts": self.attempts,
            "span_s": self.span.as_secs_f64(),
            "events_per_s": self.throughput(),
        })
    }

    /// As text.
    pub fn render(&self) -> String {
        format!(
            "drain: {d}/{w} events delivered ({att} attempts) in {s:.2}s from the first to the last = {eps:.0} events/s\n",
            d = self.delivered,
            w = self.want,
            att = self.attempts,
            s = self.span.as_secs_f64(),
            eps = self.throughput(),
        )
    }
}

/// End-to-end delivery through the sink.
#[derive(Debug, Clone)]
pub struct DeliveryReport {
    /// Events the gateway accepted.
    pub accepted: u64,
    /// Of them, delivered to the sink at least once (within the wait).
    pub delivered: u64,
    /// Delivery attempts the sink saw (retries included).
    pub attempts: u64,
    /// First deliveries that arrived before the client had read the ack.
    pub before_ack: u64,
    /// From the run's start to the last first delivery.
    pub span: Duration,
    /// Ack → first delivery attempt, microseconds (0 when it came first).
    pub latency: Histogram<u64>,
}

impl DeliveryReport {
    /// Delivered events per second, from the start of ingest to the last first delivery.
    pub fn throughput(&self) -> f64 {
        self.delivered as f64 / self.span.as_secs_f64().max(1e-9)
    }

    fn ms(&self, q: f64) -> f64 {
        if self.latency.is_empty() {
            return 0.0;
        }
        self.latency.value_at_quantile(q) as f64 / 1000.0
    }

    /// As JSON.
    pub fn to_json(&self) -> Value {
        json!({
            "accepted": self.accepted,
            "delivered": self.delivered,
            "attempts": self.attempts,
            "delivered_before_ack_read": self.before_ack,
            "span_s": self.span.as_secs_f64(),
            "events_per_s": self.throughput(),
            "ack_to_first_attempt_ms": { "p50": self.ms(0.5), "p99": self.ms(0.99), "max": self.latency.max() as f64 / 1000.0 },
        })
    }

    /// As text.
    pub fn render(&self) -> String {
        format!(
            "delivery: {d}/{a} accepted events delivered ({att} attempts) in {s:.2}s = {eps:.0} events/s\n  \
             ack → first attempt ms: p50 {p50:.2}  p99 {p99:.2}  ({b} arrived before the ack was read)\n",
            d = self.delivered,
            a = self.accepted,
            att = self.attempts,
            s = self.span.as_secs_f64(),
            eps = self.throughput(),
            p50 = self.ms(0.5),
            p99 = self.ms(0.99),
            b = self.before_ack,
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Memory

/// Samples a process's resident memory from `/proc/{pid}/status` every 100 ms.
pub struct RssSampler {
    pid: u32,
    peak_rss_kib: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

/// `VmRSS` and `VmHWM` of a process, KiB.
pub fn read_rss(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

impl RssSampler {
    /// Starts sampling.
    pub fn start(pid: u32) -> anyhow::Result<RssSampler> {
        let (rss, _) = read_rss(pid)
            .ok_or_else(|| anyhow::anyhow!("cannot read /proc/{pid}/status (no such process?)"))?;
        let peak = Arc::new(AtomicU64::new(rss));
        let p = peak.clone();
        let task = tokio::spawn(async move {
            loop {
                if let Some((rss, _)) = read_rss(pid) {
                    p.fetch_max(rss, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Ok(RssSampler {
            pid,
            peak_rss_kib: peak,
            task,
        })
    }

    /// The highest `VmRSS` sampled, KiB.
    pub fn peak(&self) -> u64 {
        self.peak_rss_kib.load(Ordering::Relaxed)
    }

    /// The current `VmRSS` and `VmHWM`, KiB.
    pub fn now(&self) -> Option<(u64, u64)> {
        read_rss(self.pid)
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ---------------------------------------------------------------------------------------------
// CPU

/// Clock ticks per second of the CPU times in `/proc` (`USER_HZ`: 100 on Linux's x86 and
/// arm64 ABIs, whatever the kernel's own tick rate).
const USER_HZ: f64 = 100.0;

/// User plus system CPU time of a process, in clock ticks, from `/proc/{pid}/stat`.
pub fn process_cpu_ticks(pid: u32) -> Option<u64> {
    parse_process_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Fields 14 and 15 (`utime`, `stime`) of a `/proc/{pid}/stat` line. The command name (field
/// 2) is in parentheses and may hold spaces and parentheses itself, so the fields are counted
/// from the last `)`.
fn parse_process_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Busy, stolen and total clock ticks of all CPUs together, from the `cpu` line of
/// `/proc/stat`. Idle and I/O wait are not busy; steal (time the hypervisor gave to another
/// guest while this one wanted to run) is counted on its own, neither busy nor idle: on a VM
/// it is what makes a run slow while the machine looks half idle.
pub fn machine_cpu_ticks() -> Option<MachineTicks> {
    parse_machine_ticks(&std::fs::read_to_string("/proc/stat").ok()?)
}

/// See [`machine_cpu_ticks`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MachineTicks {
    /// Neither idle, waiting on I/O, nor stolen.
    pub busy: u64,
    /// Given by the hypervisor to another guest.
    pub steal: u64,
    /// All of it.
    pub total: u64,
}

fn parse_machine_ticks(stat: &str) -> Option<MachineTicks> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    // user nice system idle iowait irq softirq steal (guest time is already within user).
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    if ticks.len() < 5 {
        return None;
    }
    let total: u64 = ticks.iter().sum();
    let idle = ticks[3] + ticks[4];
    let steal = ticks.get(7).copied().unwrap_or(0);
    Some(MachineTicks {
        busy: total - idle - steal,
        steal,
        total,
    })
}

/// CPU time spent between [`CpuSpan::start`] and [`CpuSpan::finish`]: by the server process
/// (when its pid is known), by this process (the load generator, and the ceiling and the
/// delivery sink when they run), and by the whole machine.
pub struct CpuSpan {
    pid: Option<u32>,
    server: Option<u64>,
    bench: Option<u64>,
    machine: Option<MachineTicks>,
}

/// What a [`CpuSpan`] measured, in CPU seconds (user + system).
#[derive(Debug, Clone, PartialEq)]
pub struct CpuUse {
    /// The server process; `None` without a pid.
    pub server_seconds: Option<f64>,
    /// This process: the load generator (and the ceiling or the sink, when they run).
    pub bench_seconds: Option<f64>,
    /// Every CPU of the machine, busy.
    pub machine_busy_seconds: Option<f64>,
    /// Of the machine's CPU time in the span, the share that was busy (0–1).
    pub machine_busy_share: Option<f64>,
    /// Of the machine's CPU time in the span, the share the hypervisor gave to others (0–1).
    pub machine_steal_share: Option<f64>,
    /// CPUs the machine has.
    pub cores: usize,
}

fn ticks_since(before: Option<u64>, after: Option<u64>) -> Option<f64> {
    Some(after?.saturating_sub(before?) as f64 / USER_HZ)
}

impl CpuSpan {
    /// Starts measuring; `pid` is the server's process, if it runs on this machine.
    pub fn start(pid: Option<u32>) -> CpuSpan {
        CpuSpan {
            pid,
            server: pid.and_then(process_cpu_ticks),
            bench: process_cpu_ticks(std::process::id()),
            machine: machine_cpu_ticks(),
        }
    }

    /// What was spent since [`CpuSpan::start`].
    pub fn finish(&self) -> CpuUse {
        let server = ticks_since(self.server, self.pid.and_then(process_cpu_ticks));
        let bench = ticks_since(self.bench, process_cpu_ticks(std::process::id()));
        let machine = match (self.machine, machine_cpu_ticks()) {
            (Some(before), Some(after)) if after.total > before.total => {
                let busy = after.busy.saturating_sub(before.busy) as f64;
                let steal = after.steal.saturating_sub(before.steal) as f64;
                let total = (after.total - before.total) as f64;
                Some((busy / USER_HZ, busy / total, steal / total))
            }
            _ => None,
        };
        CpuUse {
            server_seconds: server,
            bench_seconds: bench,
            machine_busy_seconds: machine.map(|m| m.0),
            machine_busy_share: machine.map(|m| m.1),
            machine_steal_share: machine.map(|m| m.2),
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

impl CpuUse {
    /// The machine's busy time that was neither the server's nor this process's: a database
    /// on the same machine, and anything else running.
    pub fn other_seconds(&self) -> Option<f64> {
        let rest =
            self.machine_busy_seconds? - self.bench_seconds? - self.server_seconds.unwrap_or(0.0);
        Some(rest.max(0.0))
    }

    /// The measurement as JSON; `requests` (those the span covered) gives the server's CPU
    /// time per request.
    pub fn to_json(&self, requests: u64) -> Value {
        json!({
            "server_cpu_s": self.server_seconds,
            "server_cpu_us_per_request": self.per_request_us(requests),
            "bench_cpu_s": self.bench_seconds,
            "other_cpu_s": self.other_seconds(),
            "machine_busy_share": self.machine_busy_share,
            "machine_steal_share": self.machine_steal_share,
            "cores": self.cores,
        })
    }

    fn per_request_us(&self, requests: u64) -> Option<f64> {
        self.server_seconds
            .filter(|_| requests > 0)
            .map(|s| s * 1e6 / requests as f64)
    }

    /// One line for the text report.
    pub fn render(&self, requests: u64) -> String {
        let mut parts = vec![match (self.machine_busy_share, self.machine_steal_share) {
            (Some(b), Some(st)) => format!(
                "machine {:.0} % busy of {} CPUs, {:.0} % stolen",
                100.0 * b,
                self.cores,
                100.0 * st
            ),
            _ => "machine: unknown".to_owned(),
        }];
        if let (Some(s), Some(us)) = (self.server_seconds, self.per_request_us(requests)) {
            parts.push(format!("server {s:.2} s = {us:.0} µs per request"));
        }
        if let Some(b) = self.bench_seconds {
            parts.push(format!("bench {b:.2} s"));
        }
        if let Some(o) = self.other_seconds() {
            parts.push(format!("the rest {o:.2} s"));
        }
        format!("  cpu: {}\n", parts.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_loop_warms_ten_milliseconds_of_its_requests_within_bounds() {
        assert_eq!(warm_connections(9_500.0), 95);
        assert_eq!(warm_connections(2_000.0), 20);
        assert_eq!(warm_connections(10.0), 8);
        assert_eq!(warm_connections(1_000_000.0), 512);
    }

    #[tokio::test]
    async fn warming_up_opens_as_many_connections_as_asked_and_they_serve_the_run() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A server counting its connections, whose first answers (a 404) wait until eight
        // requests have arrived: the warm-up's eight are all in flight at once.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let counting = accepted.clone();
        let first_eight = Arc::new(tokio::sync::Barrier::new(8));
        let arrived = Arc::new(AtomicUsize::new(0));
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                counting.fetch_add(1, Ordering::SeqCst);
                let (first_eight, arrived) = (first_eight.clone(), arrived.clone());
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    while let Ok(n) = conn.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                        if arrived.fetch_add(1, Ordering::SeqCst) < 8 {
                            first_eight.wait().await;
                        }
                        let answer = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
                        if conn.write_all(answer).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        let client = client(Duration::from_secs(30)).unwrap();
        tokio::time::timeout(Duration::from_secs(30), open_connections(&client, &base, 8))
            .await
            .expect("eight requests in flight at once, on eight connections");
        assert_eq!(accepted.load(Ordering::SeqCst), 8);
        // Eight requests at once afterwards find them idle in the pool: no new connection.
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..8 {
            tasks.spawn(client.get(format!("{base}/")).send());
        }
        while let Some(res) = tasks.join_next().await {
            assert_eq!(res.unwrap().unwrap().status(), 404);
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 8);
    }

    #[test]
    fn a_process_s_cpu_time_is_read_past_a_command_name_with_spaces_and_parentheses() {
        let line = "4242 (tokio (x) w) S 1 4242 4242 0 -1 4194560 1523 0 0 0 \
                    731 269 0 0 20 0 9 0 123456 1000000 2000 18446744073709551615";
        assert_eq!(parse_process_ticks(line), Some(731 + 269));
        assert_eq!(parse_process_ticks("4242 (short) S 1 2"), None);
    }

    #[test]
    fn the_machine_s_busy_time_leaves_out_idle_io_wait_and_steal() {
        let stat = "cpu  100 5 50 800 40 3 2 7 0 0\ncpu0 50 2 25 400 20 1 1 3 0 0\nintr 1\n";
        // busy: user 100 + nice 5 + system 50 + irq 3 + softirq 2; total includes all eight.
        let ticks = parse_machine_ticks(stat).expect("the cpu line");
        assert_eq!(
            ticks,
            MachineTicks {
                busy: 160,
                steal: 7,
                total: 1007
            }
        );
        assert_eq!(parse_machine_ticks("intr 1\n"), None);
    }

    #[test]
    fn a_span_counts_the_cpu_this_process_spends() {
        let pid = std::process::id();
        let span = CpuSpan::start(Some(pid));
        // Spin until this process has spent 12 ticks (120 ms at the usual 100 Hz) of CPU,
        // however long a busy machine takes to give them (a test beside it, a build), or 10 s.
        let ticks = || process_cpu_ticks(pid).expect("this process's ticks");
        let (from, until) = (ticks(), Instant::now() + Duration::from_secs(10));
        let mut x = 0u64;
        while ticks() < from + 12 && Instant::now() < until {
            for _ in 0..100_000 {
                x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
            }
        }
        let used = span.finish();
        let server = used.server_seconds.expect("this process's CPU time");
        // At least 120 ms of spinning, counted in 10 ms ticks; the machine was busy for it.
        assert!(server >= 0.05, "{used:?}");
        let busy = used.machine_busy_share.expect("the machine's CPU time");
        assert!(busy > 0.0 && busy <= 1.0, "{used:?}");
        let steal = used.machine_steal_share.expect("the machine's stolen time");
        assert!(
            (0.0..=1.0).contains(&steal) && busy + steal <= 1.0,
            "{used:?}"
        );
        let json = used.to_json(100);
        let per_request = json["server_cpu_us_per_request"]
            .as_f64()
            .expect("a number");
        assert!((per_request - server * 1e4).abs() < 1e-6, "{json}");
        // The server here is this process, so it is counted twice: as the server and as
        // the bench (read a moment apart: a tick may fall between). The rest is what the
        // machine did beside them, never below zero.
        let bench = used.bench_seconds.expect("this process's CPU time");
        assert!((bench - server).abs() <= 0.02, "{used:?}");
        assert!(used.other_seconds().expect("the rest") >= 0.0, "{used:?}");
    }

    fn opts(events: u64, dups: f64, size: usize) -> BenchOptions {
        BenchOptions {
            target: "http://127.0.0.1:1".into(),
            source: "stripe".into(),
            provider: "stripe".into(),
            secret: Secret::from_text("whsec_test"),
            events,
            duplicates: dups,
            body_size: size,
            load: Load::Concurrency(4),
            duration: None,
            timeout: Duration::from_secs(1),
            connections: None,
            warmup: None,
        }
    }

    #[test]
    fn a_warm_up_comes_first_with_events_of_its_own_and_counts_nowhere() {
        let warm = BenchOptions {
            load: Load::Rate(1_000.0),
            warmup: Some(Duration::from_millis(500)),
            ..opts(200, 0.1, 0)
        };
        let p = plan(&warm).unwrap();
        // 500 requests due in the warm-up's 0.5 s: 450 events and 50 copies of them.
        assert_eq!(p.warmup, 500);
        assert_eq!(p.events.len(), 450 + 200);
        assert!(p.order[..p.warmup].iter().all(|(e, _)| *e < 450));
        // What is measured is what the same options without a warm-up measure.
        assert_eq!(
            (p.len(), p.duplicates(), p.measured_events()),
            (222, 22, 200)
        );
        assert!(p.measured().iter().all(|(e, _)| *e >= 450));
        let cold = plan(&BenchOptions {
            warmup: None,
            ..warm.clone()
        })
        .unwrap();
        assert_eq!(cold.warmup, 0);
        let shifted: Vec<(usize, bool)> = cold.order.iter().map(|(e, d)| (e + 450, *d)).collect();
        assert_eq!(p.measured(), &shifted[..]);
        // A closed loop has no due times to warm up at.
        let closed = BenchOptions {
            warmup: Some(Duration::from_secs(1)),
            ..opts(10, 0.0, 0)
        };
        let err = plan(&closed).unwrap_err().to_string();
        assert!(err.contains("--rate"), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_warm_up_is_sent_but_only_the_requests_after_it_are_counted() {
        // A server counting the requests it answers.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let answered = Arc::new(AtomicUsize::new(0));
        let counting = answered.clone();
        tokio::spawn(serve_loop(
            listener,
            move |req: http::Request<hyper::body::Incoming>| {
                let counting = counting.clone();
                async move {
                    let ingest = req.method() == http::Method::POST;
                    drain(req.into_body()).await;
                    if ingest {
                        counting.fetch_add(1, Ordering::SeqCst);
                    }
                    http::Response::builder()
                        .body(r#"{"status":"accepted"}"#.to_owned())
                        .expect("a valid response")
                }
            },
        ));
        let warm = BenchOptions {
            target: base.clone(),
            load: Load::Rate(400.0),
            warmup: Some(Duration::from_millis(100)),
            connections: Some(4),
            ..opts(20, 0.0, 0)
        };
        let plan = Arc::new(plan(&warm).unwrap());
        assert_eq!((plan.warmup, plan.len()), (40, 20));
        let ticks = Arc::new(AtomicUsize::new(0));
        let tick = ticks.clone();
        let starts = Arc::new(AtomicUsize::new(0));
        let start = starts.clone();
        let answered_at_start = Arc::new(AtomicUsize::new(usize::MAX));
        let (seen, at) = (answered.clone(), answered_at_start.clone());
        let report = run(
            plan,
            &base,
            &warm,
            "warm",
            Arc::new(move || {
                tick.fetch_add(1, Ordering::SeqCst);
            }),
            Box::new(move || {
                start.fetch_add(1, Ordering::SeqCst);
                at.store(seen.load(Ordering::SeqCst), Ordering::SeqCst);
            }),
        )
        .await
        .unwrap();
        // The server answered all 60 ingests (and the connections' four `GET /`); the
        // report and the progress count the 20 measured ones.
        assert_eq!(answered.load(Ordering::SeqCst), 60);
        assert_eq!(report.sent, 20);
        assert_eq!(report.latency.len(), 20);
        assert_eq!(report.acks.len(), 20);
        assert_eq!(report.statuses.get("200"), Some(&20));
        assert_eq!(ticks.load(Ordering::SeqCst), 20);
        // `at_start` ran once, before any measured request was answered.
        assert_eq!(starts.load(Ordering::SeqCst), 1);
        assert!(answered_at_start.load(Ordering::SeqCst) <= 40);
    }

    #[test]
    fn a_drain_counts_the_intervals_between_its_first_and_last_arrival() {
        let report = DrainReport {
            want: 1001,
            delivered: 1001,
            attempts: 1003,
            span: Duration::from_millis(500),
        };
        // 1,001 arrivals over 0.5 s are 1,000 intervals: 2,000 events/s.
        assert!((report.throughput() - 2000.0).abs() < 1e-6, "{report:?}");
        assert!(report.complete());
        let short = DrainReport {
            delivered: 1000,
            ..report.clone()
        };
        assert!(!short.complete());
        let none = DrainReport {
            delivered: 0,
            span: Duration::ZERO,
            ..report
        };
        assert_eq!(none.throughput(), 0.0);
    }

    #[test]
    fn the_plan_holds_every_event_once_plus_the_duplicates() {
        let p = plan(&opts(200, 0.1, 0)).unwrap();
        assert_eq!(p.duplicates(), 22);
        assert_eq!(p.len(), 222);
        let originals: std::collections::HashSet<usize> = p
            .order
            .iter()
            .filter(|(_, d)| !d)
            .map(|(e, _)| *e)
            .collect();
        assert_eq!(originals.len(), 200);
        // Every copy comes after its original.
        for (pos, (ev, dup)) in p.order.iter().enumerate() {
            if *dup {
                let orig = p.order.iter().position(|(e, d)| e == ev && !d).unwrap();
                assert!(orig < pos);
            }
        }
    }

    #[test]
    fn bodies_are_padded_and_still_json() {
        let p = plan(&opts(3, 0.0, 2048)).unwrap();
        for ev in &p.events {
            assert!(ev.body.len() >= 2048, "{}", ev.body.len());
            assert!(ev.body.len() < 2048 + 16);
            serde_json::from_slice::<Value>(&ev.body).expect("json");
        }
        assert_eq!(duplicate_count(100, 0.5), 100);
        assert_eq!(duplicate_count(100, 0.0), 0);
    }

    #[test]
    fn padding_compresses_like_a_payload_not_like_repeated_bytes() {
        for size in [2048, 65536] {
            let body = pad(b"{\"id\":\"evt_1\"}", size, 7);
            assert_eq!(body.len(), size);
            let compressed = lz4_flex::block::compress(&body).len();
            // With lz4, a provider's pretty-printed JSON compresses to about 35–40 % of its
            // size, compact JSON to about half; the padding must not compress better.
            assert!(
                compressed * 100 > size * 40,
                "{size} bytes compress to {compressed}"
            );
        }
        assert_ne!(filler(1, 64), filler(2, 64));
        assert_eq!(filler(3, 64), filler(3, 64));
    }
}
