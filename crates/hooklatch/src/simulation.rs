//! T24, the deterministic simulation (RELIABILITY.md): whole gateways — the ingest router, the
//! delivery worker and its hand-off — with the providers that send to them, the application
//! they deliver to and the faults between, all on one thread under tokio's paused clock, on
//! the in-process store that the conformance suite holds to the real stores' contract.
//!
//! A seed draws everything the simulation decides: when each event is first sent and when its
//! provider retries it, which copies race each other, which requests are forged, which are
//! lost on the way, cut while the gateway works on them or answered into the void, when a
//! gateway crashes and how long it stays down, how the wall clock jumps, and what the
//! application answers and how late. The gateways' own code runs unchanged behind two seams:
//! the wall clock ([`hooklatch_core::time::simulate_clock`]) and the HTTP client ([`Post`]).
//! The gateways' retry jitter is set to none, so their retries fall where the seed puts them.
//!
//! Checked after every acknowledgement and every delivery the application takes, and at rest:
//! no acknowledged event lost (each has its outbox row the moment it is acknowledged), no
//! forged request acknowledged or delivered, at most one outbox row per event and destination,
//! every delivered body the one acknowledged, byte for byte, and at rest every acknowledged
//! event delivered or dead-lettered.
//!
//! `HOOKLATCH_SEED` (hex) sets the first seed and `HOOKLATCH_SIM_SEEDS` how many seeds run
//! (default 100, times `HOOKLATCH_SCALE`); a failing seed is printed with the command that
//! runs it alone.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::Router;
use bytes::Bytes;
use hooklatch_core::secret::sha256;
use hooklatch_core::store::{DeliveryDetail, DeliveryFilter, DeliveryState};
use hooklatch_core::{Secret, Store, Timestamp};
use hooklatch_http::Handoff;
use hooklatch_testkit::{Counting, Fault, MemoryStore};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::Notify;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{sleep, Instant};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::config::Settings;
use crate::delivery::{Post, Worker};
use crate::listen::ListenHub;

/// Events each seed's providers send, and forged requests beside them.
const EVENTS: usize = 30;
const FORGED: usize = 6;
/// Gateways sharing the store, as instances on PostgreSQL do.
const GATEWAYS: usize = 2;
/// Events are first sent within this window; faults come until a minute after it.
const WORKLOAD: Duration = Duration::from_secs(240);
const FAULTS_UNTIL: Duration = Duration::from_secs(300);
/// How often a provider sends one event before it gives up, and how long it waits for an
/// answer that never comes.
const PROVIDER_TRIES: u32 = 16;
const PROVIDER_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a run may take in simulated time before its rest counts as never reached.
const REST_DEADLINE: Duration = Duration::from_secs(6 * 3600);
/// The simulated wall clock at the start of every run: 2026-06-01T00:00:00Z.
const EPOCH_MS: i64 = 1_780_272_000_000;

const SECRET: &str = "whsec_simulated_provider_secret";
const SOURCE_URL: &str = "http://gateway.simulated/in/stripe";

/// The gateways' configuration: one Stripe source, one HTTP destination, retries without
/// jitter and short enough that a run dead-letters some events.
const CONFIG: &str = r#"
[server]
admin_token = "simulated-admin-token-0123456789"

[store]
url = "sqlite://not-opened-by-the-simulation.db"

[delivery]
concurrency = 4
poll_interval = "1s"
timeout = "5s"
max_attempts = 8
initial_backoff = "2s"
max_backoff = "2m"
jitter = 0.0

[[sources]]
name = "stripe"
provider = "stripe"
secrets = ["whsec_simulated_provider_secret"]
destinations = ["app"]

[[destinations]]
name = "app"
url = "http://app.simulated/webhooks"
"#;

thread_local! {
    /// When this thread's run started, in tokio's (paused) time.
    static STARTED: Cell<Option<Instant>> = const { Cell::new(None) };
    /// How far the faults have moved the wall clock, in milliseconds.
    static JUMPED_MS: Cell<i64> = const { Cell::new(0) };
}

/// The simulated wall clock: [`EPOCH_MS`] plus the simulated time since the run started plus
/// every jump.
fn simulated_now() -> Timestamp {
    let started = STARTED
        .with(Cell::get)
        .expect("the simulated clock is read during a run");
    Timestamp(EPOCH_MS + started.elapsed().as_millis() as i64 + JUMPED_MS.with(Cell::get))
}

/// Sets the simulated clock on this thread for one run, and gives the wall clock back after.
struct ClockSet;

impl ClockSet {
    fn start() -> ClockSet {
        STARTED.with(|s| s.set(Some(Instant::now())));
        JUMPED_MS.with(|j| j.set(0));
        hooklatch_core::time::simulate_clock(Some(simulated_now));
        ClockSet
    }
}

impl Drop for ClockSet {
    fn drop(&mut self) {
        hooklatch_core::time::simulate_clock(None);
        STARTED.with(|s| s.set(None));
    }
}

/// What one run saw: its counts, its faults, and the promises it found broken.
#[derive(Default, Debug, Clone, PartialEq, Eq)]
struct Outcome {
    acked: usize,
    delivered: usize,
    dead_lettered: usize,
    /// Deliveries the application took more than once (at least once is the contract; the
    /// `Idempotency-Key` is what makes the second harmless).
    repeated: usize,
    /// Forged requests sent, all refused.
    forged_refused: usize,
    simulated_ms: u64,
    faults: BTreeMap<&'static str, usize>,
    violations: Vec<String>,
    /// Per event key: its delivery's state and how often the application took it; two runs of
    /// one seed must agree on all of it.
    trace: BTreeMap<String, (String, u32)>,
}

/// The state the providers, the gateways, the application and the checks share.
struct World {
    settings: Settings,
    /// The store the gateways share, failing as [`StoreFaults`] decide; the checks read the
    /// memory store inside it.
    store: Arc<Counting<MemoryStore>>,
    store_faults: Arc<Mutex<StoreFaults>>,
    app: Arc<App>,
    log: Arc<Mutex<Log>>,
    gateways: Mutex<Vec<Slot>>,
    seed: u64,
}

/// What the run has recorded so far.
#[derive(Default)]
struct Log {
    acked: BTreeSet<String>,
    /// The body each event's provider signs, by `Idempotency-Key` (`stripe:evt_…`).
    bodies: HashMap<String, Vec<u8>>,
    /// The SHA-256 of every forged body sent.
    forged: BTreeSet<[u8; 32]>,
    forged_refused: usize,
    faults: BTreeMap<&'static str, usize>,
    violations: Vec<String>,
}

impl Log {
    fn fault(&mut self, kind: &'static str) {
        *self.faults.entry(kind).or_default() += 1;
    }
}

/// One gateway's place: the instance running there, if it is up.
struct Slot {
    running: Option<Running>,
    generation: u32,
}

/// A gateway that is up: its ingest router, its worker, and what cuts both when it crashes.
struct Running {
    ingest: Router,
    worker: JoinHandle<()>,
    crashed: CancellationToken,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A random-number stream of its own for each part of the run, so what one part draws does
/// not depend on how often another drew before it.
fn stream(seed: u64, part: u64, index: u64) -> StdRng {
    StdRng::seed_from_u64(seed ^ part.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (index << 20))
}

const PROVIDER: u64 = 1;
const COPY: u64 = 2;
const FORGER: u64 = 3;
const CHAOS: u64 = 4;
const APPLICATION: u64 = 5;
const STORE: u64 = 6;

/// When the gateways' store calls fail: every call while the database is away, and now and
/// then a write whose answer is lost after it committed.
struct StoreFaults {
    rng: StdRng,
    away_until: Option<Instant>,
    /// After the faults: nothing fails.
    calm: bool,
    seen: BTreeMap<&'static str, usize>,
}

impl StoreFaults {
    fn decide(&mut self, operation: &'static str) -> Option<Fault> {
        if self.calm {
            return None;
        }
        let fault = if self.away_until.is_some_and(|t| Instant::now() < t) {
            Some((Fault::Before, "store_call_refused"))
        } else {
            let writes = matches!(
                operation,
                "ingest" | "lease_due" | "record_attempt" | "record_attempt_and_lease"
            );
            (writes && self.rng.random_bool(0.03)).then_some((Fault::After, "store_answer_lost"))
        };
        fault.map(|(fault, kind)| {
            *self.seen.entry(kind).or_default() += 1;
            fault
        })
    }
}

impl World {
    /// Starts the gateway in `slot`, with a new name (a restarted process is a new owner).
    fn start(self: &Arc<World>, slot: usize) {
        let mut gateways = lock(&self.gateways);
        let place = &mut gateways[slot];
        if place.running.is_some() {
            return;
        }
        place.generation += 1;
        let settings = &self.settings;
        let store: Arc<dyn Store> = self.store.clone();
        let enqueued = Arc::new(Notify::new());
        let owner = format!("gateway-{slot}-{}", place.generation);
        let lease = crate::lease_for(settings);
        let concurrency = settings.delivery.concurrency;
        let handoff = Arc::new(Handoff::new(owner.clone(), lease, concurrency));
        let crashed = CancellationToken::new();
        let listen = Arc::new(ListenHub::new(
            store.clone(),
            enqueued.clone(),
            &settings.destinations,
            crashed.clone(),
            true,
        ));
        let ingest = hooklatch_http::ingest_router(Arc::new(crate::ingest_state(
            settings,
            store.clone(),
            enqueued.clone(),
            None,
            Some(handoff.clone()),
        )));
        let worker = Worker {
            store,
            destinations: settings
                .destinations
                .iter()
                .map(|d| (d.name.clone(), Arc::new(d.clone())))
                .collect(),
            publishers: HashMap::new(),
            providers: crate::providers_of(settings),
            signers: crate::signers_of(settings),
            under_way: Default::default(),
            clients: settings
                .destinations
                .iter()
                .map(|d| (d.name.clone(), self.app.clone() as Arc<dyn Post>))
                .collect(),
            owner,
            concurrency,
            poll_interval: settings.delivery.poll_interval,
            lease,
            enqueued,
            handoff,
            listen,
            disabled: Default::default(),
            retry_scheduled: AtomicBool::new(false),
        };
        let worker = tokio::spawn(worker.run(crashed.clone(), Duration::from_secs(5)));
        place.running = Some(Running {
            ingest,
            worker,
            crashed,
        });
    }

    /// Kills the gateway in `slot` as `kill -9` would: its worker's tasks stop where they
    /// are, the requests it was answering are cut, its leases stay behind in the store.
    fn crash(&self, slot: usize) -> bool {
        let Some(running) = lock(&self.gateways)[slot].running.take() else {
            return false;
        };
        running.worker.abort();
        running.crashed.cancel();
        true
    }

    fn fault(&self, kind: &'static str) {
        lock(&self.log).fault(kind);
    }

    fn violation(&self, what: String) {
        lock(&self.log).violations.push(what);
    }

    /// Sends one request to a gateway that is up, through the seed's faults; the status the
    /// provider saw, if it saw one.
    async fn send(
        &self,
        rng: &mut StdRng,
        headers: &[(String, String)],
        body: Vec<u8>,
    ) -> Option<u16> {
        let up: Vec<(Router, CancellationToken)> = lock(&self.gateways)
            .iter()
            .filter_map(|g| g.running.as_ref())
            .map(|r| (r.ingest.clone(), r.crashed.clone()))
            .collect();
        if up.is_empty() {
            self.fault("refused_while_all_down");
            return None;
        }
        let (ingest, crashed) = up[rng.random_range(0..up.len())].clone();
        let fate = rng.random_range(0..100u32);
        if fate < 4 {
            // Lost on the way: the gateway never sees it, the provider times out.
            self.fault("request_lost");
            sleep(PROVIDER_TIMEOUT).await;
            return None;
        }
        let mut request = http::Request::post("/in/stripe");
        for (name, value) in headers {
            request = request.header(name.as_str(), value.as_str());
        }
        let mut request = request
            .body(Body::from(body))
            .expect("a fixture's headers are valid");
        request
            .extensions_mut()
            .insert(ConnectInfo(SocketAddr::from(([192, 0, 2, 1], 40_000))));
        // The provider hangs up after the handler has been polled this often.
        let polls = (fate < 12).then(|| rng.random_range(0..3u32));
        let call = Cut {
            inner: Box::pin(ingest.oneshot(request)),
            polls_left: polls,
        };
        let answer = tokio::select! {
            biased;
            _ = crashed.cancelled() => {
                self.fault("request_cut_by_crash");
                return None;
            }
            answer = call => answer,
        };
        let Some(Ok(response)) = answer else {
            self.fault("provider_hung_up");
            return None;
        };
        if (12..18).contains(&fate) {
            // Answered, but the answer is lost on the way back.
            self.fault("answer_lost");
            return None;
        }
        Some(response.status().as_u16())
    }

    /// Checks what an acknowledgement promises: the event is claimed and queued, one outbox
    /// row for it.
    async fn check_acked(&self, key: &str) {
        let rows = all_deliveries(self.store.inner()).await;
        let n = rows.iter().filter(|d| d.idempotency_key == key).count();
        if n != 1 {
            self.violation(format!("{key} acknowledged with {n} outbox rows"));
        }
    }
}

/// Polls `inner` at most `polls_left` times (all of them with `None`), then drops it: a
/// client hanging up while the handler is at that point.
struct Cut<F> {
    inner: Pin<Box<F>>,
    polls_left: Option<u32>,
}

impl<F: Future> Future for Cut<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Some(left) = self.polls_left.as_mut() {
            if *left == 0 {
                return Poll::Ready(None);
            }
            *left -= 1;
        }
        self.inner.as_mut().poll(cx).map(Some)
    }
}

/// Every delivery in the store, newest first.
async fn all_deliveries(store: &dyn Store) -> Vec<DeliveryDetail> {
    let mut all = Vec::new();
    let mut before = None;
    loop {
        let page = store
            .list_deliveries(DeliveryFilter {
                state: None,
                destination: None,
                before,
                limit: 500,
            })
            .await
            .expect("the memory store lists its deliveries");
        let Some(last) = page.last() else {
            return all;
        };
        before = Some(last.id);
        all.extend(page);
    }
}

/// The application behind the gateways: it answers what the seed says, when the seed says,
/// and counts what it took. An attempt it took but whose answer never reached the gateway
/// (its timeout, a 500 after the work) is taken again later: that is the contract.
struct App {
    log: Arc<Mutex<Log>>,
    state: Mutex<AppState>,
}

struct AppState {
    seed: u64,
    /// Every call fails to connect until then.
    unreachable_until: Option<Instant>,
    /// Every call outlasts the attempt's timeout until then.
    slow_until: Option<Instant>,
    /// After the faults: every call answered 200 at once.
    calm: bool,
    /// How often each `Idempotency-Key` was taken.
    taken: BTreeMap<String, u32>,
}

/// What the application does with one call.
enum Answer {
    Unreachable,
    /// Outlasts the timeout; the work done or not.
    TooSlow {
        worked: bool,
    },
    /// Answers `status` after `after`; the work done or not.
    Status {
        status: u16,
        after: Duration,
        worked: bool,
        retry_after: Option<String>,
    },
}

impl App {
    /// What the application does with attempt `attempt` of `key`'s delivery: drawn from the
    /// seed, the key and the attempt, so the same attempt meets the same answer in every run
    /// of a seed, whatever was called before it.
    fn decide(&self, key: &str, attempt: u64) -> Answer {
        let state = lock(&self.state);
        let now = Instant::now();
        if state.calm {
            return Answer::Status {
                status: 200,
                after: Duration::from_millis(3),
                worked: true,
                retry_after: None,
            };
        }
        if state.unreachable_until.is_some_and(|t| now < t) {
            return Answer::Unreachable;
        }
        let slow = state.slow_until.is_some_and(|t| now < t);
        let digest = sha256(key.as_bytes());
        let key = u64::from_be_bytes(digest[..8].try_into().expect("8 of 32 bytes"));
        let rng = &mut stream(state.seed, APPLICATION, key ^ attempt);
        let roll = rng.random_range(0..100u32);
        let worked = rng.random_bool(0.5);
        let after = Duration::from_millis(rng.random_range(1..400));
        if slow || roll < 5 {
            return Answer::TooSlow { worked };
        }
        let (status, worked, retry_after) = match roll {
            5..=9 => (500, false, None),
            // The work done, then the handler failed before its 2xx.
            10..=12 => (500, true, None),
            13..=15 => (503, false, None),
            16..=18 => (429, false, Some(rng.random_range(1..20u32).to_string())),
            _ => (200, true, None),
        };
        Answer::Status {
            status,
            after,
            worked,
            retry_after,
        }
    }

    /// The application's work for one delivery: counted, and checked against what was
    /// acknowledged and what was forged.
    fn work(&self, key: &str, body: &[u8]) {
        let mut log = lock(&self.log);
        if log.forged.contains(&sha256(body)) {
            log.violations
                .push(format!("a forged body was delivered under {key}"));
        }
        match log.bodies.get(key) {
            None => log
                .violations
                .push(format!("{key} delivered but never sent by its provider")),
            Some(sent) if sent.as_slice() != body => log.violations.push(format!(
                "{key} delivered with a body other than the one sent"
            )),
            Some(_) => {}
        }
        drop(log);
        *lock(&self.state).taken.entry(key.to_owned()).or_default() += 1;
    }
}

#[async_trait::async_trait]
impl Post for App {
    async fn post(
        &self,
        _url: &url::Url,
        timeout: Duration,
        body: Bytes,
        headers: Vec<(String, Vec<u8>)>,
    ) -> Result<(u16, Option<String>), String> {
        let key = headers
            .iter()
            .find(|(name, _)| name == "idempotency-key")
            .map(|(_, value)| String::from_utf8_lossy(value).into_owned())
            .unwrap_or_default();
        let attempt = headers
            .iter()
            .find(|(name, _)| name == "hooklatch-attempt")
            .and_then(|(_, value)| std::str::from_utf8(value).ok()?.parse().ok())
            .unwrap_or(0);
        match self.decide(&key, attempt) {
            Answer::Unreachable => {
                lock(&self.log).fault("app_unreachable");
                Err("error sending request: connection refused".to_owned())
            }
            Answer::TooSlow { worked } => {
                lock(&self.log).fault("app_too_slow");
                sleep(timeout).await;
                if worked {
                    self.work(&key, &body);
                }
                Err(format!("timed out after {}s", timeout.as_secs()))
            }
            Answer::Status {
                status,
                after,
                worked,
                retry_after,
            } => {
                sleep(after).await;
                if worked {
                    self.work(&key, &body);
                }
                if status != 200 {
                    lock(&self.log).fault("app_error");
                }
                Ok((status, retry_after))
            }
        }
    }
}

/// One provider's event: first sent at a time the seed picks, sent again after each try that
/// saw no 2xx, with a copy racing the first try now and then.
async fn provide(world: Arc<World>, event: usize) {
    let mut rng = stream(world.seed, PROVIDER, event as u64);
    let id = format!("evt_sim_{event:04}");
    let secret = Secret::new(SECRET.as_bytes().to_vec());
    sleep(Duration::from_millis(
        rng.random_range(0..WORKLOAD.as_millis() as u64),
    ))
    .await;
    let mut copies = JoinSet::new();
    if rng.random_bool(0.15) {
        world.fault("concurrent_copy");
        let (world, id, secret) = (world.clone(), id.clone(), secret.clone());
        let mut rng = stream(world.seed, COPY, event as u64);
        copies.spawn(async move { send_event(&world, &mut rng, &id, &secret).await });
    }
    for attempt in 0..PROVIDER_TRIES {
        if send_event(&world, &mut rng, &id, &secret).await {
            break;
        }
        // Backoff as providers do it: doubling from 5 s, capped at 10 minutes, jittered.
        let base = 5_000u64 << attempt.min(7);
        let wait = base.min(600_000) / 2 + rng.random_range(0..base.min(600_000) / 2);
        sleep(Duration::from_millis(wait)).await;
    }
    while copies.join_next().await.is_some() {}
}

/// Signs and sends `id` once; whether the provider saw a 2xx (and so stops).
async fn send_event(world: &World, rng: &mut StdRng, id: &str, secret: &Secret) -> bool {
    let event = crate::fixtures::build(
        "stripe",
        None,
        Some(id),
        secret,
        SOURCE_URL,
        Timestamp::now(),
    )
    .expect("a Stripe fixture with a plain id");
    let key = format!("stripe:{id}");
    lock(&world.log)
        .bodies
        .entry(key.clone())
        .or_insert_with(|| event.body.clone());
    let status = world.send(rng, &event.headers, event.body).await;
    let acked = status.is_some_and(|s| (200..300).contains(&s));
    if acked {
        lock(&world.log).acked.insert(key.clone());
        world.check_acked(&key).await;
    }
    acked
}

/// Forged requests: new ids signed with a secret that is not the source's, and real events
/// with a byte added after they were signed. None may be acknowledged or delivered.
async fn forge(world: Arc<World>) {
    let mut rng = stream(world.seed, FORGER, 0);
    let wrong = Secret::new(b"whsec_not_the_sources_secret".to_vec());
    let right = Secret::new(SECRET.as_bytes().to_vec());
    for n in 0..FORGED {
        sleep(Duration::from_millis(
            rng.random_range(0..WORKLOAD.as_millis() as u64 / FORGED as u64),
        ))
        .await;
        let event = if n % 2 == 0 {
            let id = format!("evt_forged_{n:02}");
            crate::fixtures::build(
                "stripe",
                None,
                Some(&id),
                &wrong,
                SOURCE_URL,
                Timestamp::now(),
            )
        } else {
            let id = format!("evt_sim_{:04}", rng.random_range(0..EVENTS));
            crate::fixtures::build(
                "stripe",
                None,
                Some(&id),
                &right,
                SOURCE_URL,
                Timestamp::now(),
            )
            .map(|mut e| {
                e.body.push(b' ');
                e
            })
        }
        .expect("a Stripe fixture with a plain id");
        lock(&world.log).forged.insert(sha256(&event.body));
        match world.send(&mut rng, &event.headers, event.body).await {
            Some(status) if (200..300).contains(&status) => {
                world.violation(format!("a forged request was acknowledged with {status}"))
            }
            Some(_) => lock(&world.log).forged_refused += 1,
            None => {}
        }
    }
}

/// The faults beside the traffic: crashes and restarts, clock jumps, the application away or
/// too slow; then everything healed.
async fn chaos(world: Arc<World>) {
    let mut rng = stream(world.seed, CHAOS, 0);
    let started = Instant::now();
    let mut restarts = JoinSet::new();
    loop {
        sleep(Duration::from_millis(rng.random_range(3_000..30_000))).await;
        if started.elapsed() >= FAULTS_UNTIL {
            break;
        }
        match rng.random_range(0..5u32) {
            0 => {
                let slot = rng.random_range(0..GATEWAYS);
                if world.crash(slot) {
                    world.fault("gateway_crash");
                    let down = Duration::from_millis(rng.random_range(1_000..45_000));
                    let world = world.clone();
                    restarts.spawn(async move {
                        sleep(down).await;
                        world.start(slot);
                    });
                }
            }
            1 => {
                let by =
                    rng.random_range(1_000..120_000i64) * if rng.random_bool(0.5) { 1 } else { -1 };
                JUMPED_MS.with(|j| j.set(j.get() + by));
                world.fault(if by > 0 {
                    "clock_jump_forward"
                } else {
                    "clock_jump_back"
                });
            }
            2 => {
                let until = Instant::now() + Duration::from_millis(rng.random_range(1_000..60_000));
                lock(&world.app.state).unreachable_until = Some(until);
                world.fault("app_partition");
            }
            3 => {
                let until = Instant::now() + Duration::from_millis(rng.random_range(1_000..30_000));
                lock(&world.app.state).slow_until = Some(until);
                world.fault("app_slow_window");
            }
            _ => {
                let until = Instant::now() + Duration::from_millis(rng.random_range(500..20_000));
                lock(&world.store_faults).away_until = Some(until);
                world.fault("store_away");
            }
        }
    }
    restarts.abort_all();
    for slot in 0..GATEWAYS {
        world.start(slot);
    }
    lock(&world.store_faults).calm = true;
    let mut app = lock(&world.app.state);
    app.calm = true;
    app.unreachable_until = None;
    app.slow_until = None;
}

/// Runs one seed to rest and checks it.
fn run(seed: u64) -> Outcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .expect("a current-thread runtime");
    runtime.block_on(async move {
        let _clock = ClockSet::start();
        let started = Instant::now();
        let dir = tempfile::tempdir().expect("a temporary directory");
        let path = dir.path().join("hooklatch.toml");
        std::fs::write(&path, CONFIG).expect("writing the configuration");
        let settings =
            crate::config::load(Some(&path), &HashMap::new()).expect("the configuration loads");
        let log = Arc::new(Mutex::new(Log::default()));
        let app = Arc::new(App {
            log: log.clone(),
            state: Mutex::new(AppState {
                seed,
                unreachable_until: None,
                slow_until: None,
                calm: false,
                taken: BTreeMap::new(),
            }),
        });
        let store_faults = Arc::new(Mutex::new(StoreFaults {
            rng: stream(seed, STORE, 0),
            away_until: None,
            calm: false,
            seen: BTreeMap::new(),
        }));
        let faults = store_faults.clone();
        let store = Counting::with_faults(
            MemoryStore::default(),
            Box::new(move |operation| lock(&faults).decide(operation)),
        );
        let world = Arc::new(World {
            settings,
            store: Arc::new(store),
            store_faults,
            app,
            log,
            gateways: Mutex::new(
                (0..GATEWAYS)
                    .map(|_| Slot {
                        running: None,
                        generation: 0,
                    })
                    .collect(),
            ),
            seed,
        });
        for slot in 0..GATEWAYS {
            world.start(slot);
        }
        let mut traffic = JoinSet::new();
        for event in 0..EVENTS {
            traffic.spawn(provide(world.clone(), event));
        }
        traffic.spawn(forge(world.clone()));
        traffic.spawn(chaos(world.clone()));
        let at_rest = async {
            while traffic.join_next().await.is_some() {}
            // Every provider is done: wait for the outbox to settle.
            loop {
                let rows = all_deliveries(world.store.inner()).await;
                if rows.iter().all(|d| d.state != DeliveryState::Pending) {
                    return;
                }
                sleep(Duration::from_secs(10)).await;
            }
        };
        if tokio::time::timeout(REST_DEADLINE, at_rest).await.is_err() {
            world.violation(format!(
                "deliveries still pending {} h after the start",
                REST_DEADLINE.as_secs() / 3600
            ));
        }
        for slot in 0..GATEWAYS {
            world.crash(slot);
        }
        outcome(&world, started.elapsed()).await
    })
}

/// How long one seed may take in real time. Simulated time passes only when every task
/// waits; a task that loops without waiting stops it, and the run with it.
const WATCHDOG: Duration = Duration::from_secs(120);

/// [`run`] on a thread of its own, given up with a violation when it outlasts [`WATCHDOG`]
/// (the thread is left to spin until the test process ends).
fn run_watched(seed: u64) -> Outcome {
    let (sent, received) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sent.send(run(seed));
    });
    received.recv_timeout(WATCHDOG).unwrap_or_else(|err| {
        let what = match err {
            std::sync::mpsc::RecvTimeoutError::Timeout => format!(
                "no rest after {} s of real time: a task loops without letting simulated \
                 time pass",
                WATCHDOG.as_secs()
            ),
            std::sync::mpsc::RecvTimeoutError::Disconnected => {
                "the run panicked (its message is above)".to_owned()
            }
        };
        Outcome {
            violations: vec![what],
            ..Outcome::default()
        }
    })
}

/// The run's counts, and the promises checked at rest.
async fn outcome(world: &World, took: Duration) -> Outcome {
    let rows = all_deliveries(world.store.inner()).await;
    let log = lock(&world.log);
    let store_faults = lock(&world.store_faults).seen.clone();
    let taken = lock(&world.app.state).taken.clone();
    let mut violations = log.violations.clone();
    let mut per_key: BTreeMap<&str, Vec<&DeliveryDetail>> = BTreeMap::new();
    for row in &rows {
        per_key.entry(&row.idempotency_key).or_default().push(row);
    }
    for (key, rows) in &per_key {
        if rows.len() > 1 {
            violations.push(format!("{key} has {} outbox rows", rows.len()));
        }
        if key.starts_with("stripe:evt_forged") {
            violations.push(format!("forged {key} was queued"));
        }
    }
    for key in &log.acked {
        match per_key.get(key.as_str()).and_then(|rows| rows.first()) {
            None => violations.push(format!("{key} was acknowledged and is lost")),
            Some(row) if row.state == DeliveryState::Pending => {
                violations.push(format!("{key} was acknowledged and never settled"))
            }
            Some(row) if row.state == DeliveryState::Delivered && !taken.contains_key(key) => {
                violations.push(format!(
                    "{key} is recorded delivered but the application never took it"
                ))
            }
            Some(_) => {}
        }
    }
    let count = |state| rows.iter().filter(|d| d.state == state).count();
    Outcome {
        acked: log.acked.len(),
        delivered: count(DeliveryState::Delivered),
        dead_lettered: count(DeliveryState::Dead),
        repeated: taken.values().map(|n| n.saturating_sub(1) as usize).sum(),
        forged_refused: log.forged_refused,
        simulated_ms: took.as_millis() as u64,
        faults: log.faults.clone().into_iter().chain(store_faults).collect(),
        violations,
        trace: per_key
            .iter()
            .map(|(key, rows)| {
                (
                    (*key).to_owned(),
                    (
                        rows[0].state.as_str().to_owned(),
                        taken.get(*key).copied().unwrap_or(0),
                    ),
                )
            })
            .collect(),
    }
}

#[test]
fn t24_simulated_gateways_lose_nothing_and_deliver_nothing_forged() {
    let first = std::env::var("HOOKLATCH_SEED")
        .ok()
        .and_then(|s| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok())
        .unwrap_or(0x7024);
    let scale = std::env::var("HOOKLATCH_SCALE")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(1);
    let seeds = std::env::var("HOOKLATCH_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(100 * scale.max(1));
    let mut total = Outcome::default();
    let mut failed = Vec::new();
    for seed in first..first + seeds {
        let outcome = run_watched(seed);
        if !outcome.violations.is_empty() {
            eprintln!(
                "seed {seed:x}: {:?}\n  run it alone: HOOKLATCH_SEED={seed:x} HOOKLATCH_SIM_SEEDS=1 \
                 cargo test -p hooklatch --lib simulation",
                outcome.violations
            );
            failed.push(seed);
        }
        total.acked += outcome.acked;
        total.delivered += outcome.delivered;
        total.dead_lettered += outcome.dead_lettered;
        total.repeated += outcome.repeated;
        total.forged_refused += outcome.forged_refused;
        total.simulated_ms += outcome.simulated_ms;
        for (kind, n) in outcome.faults {
            *total.faults.entry(kind).or_default() += n;
        }
    }
    println!(
        "T24: {seeds} seeds from {first:x}, {:.1} simulated hours, {} acknowledged, {} delivered, \
         {} dead-lettered, {} taken again, {} forged refused, faults {:?}, {} seeds with violations",
        total.simulated_ms as f64 / 3_600_000.0,
        total.acked,
        total.delivered,
        total.dead_lettered,
        total.repeated,
        total.forged_refused,
        total.faults,
        failed.len()
    );
    assert!(failed.is_empty(), "seeds with violations: {failed:x?}");
}

/// A seed is a run: the same seed twice gives the same sends, faults, deliveries and counts,
/// so a failing seed can be run again, alone, to find what broke.
#[test]
fn a_seed_runs_the_same_twice() {
    for seed in 0x7024..0x7030 {
        let first = run(seed);
        assert!(first.acked > 0 && !first.faults.is_empty());
        assert_eq!(first, run(seed), "seed {seed:x} ran two ways");
    }
    assert_ne!(run(0x7024), run(0x7025));
}
