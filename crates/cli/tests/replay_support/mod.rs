//! Helpers for the replay and check tests: a real `hooklatch serve` ([`Gateway`]), the example
//! credit service as a real process ([`CreditService`]), an in-test handler that records and
//! verifies what it receives ([`Recorder`]), and [`hooklatch`] to run the CLI.
//!
//! **The credit-service binary.** It is its own package (`examples/credit-service`), and
//! `CARGO_BIN_EXE_*` only names binaries of the package under test, so [`credit_service_bin`]
//! builds it once per test run with `cargo build -p hooklatch-example-credit-service` into the
//! same target directory and profile as the `hooklatch` binary (found next to it). Cargo has
//! released its build lock by the time tests run, and the build is a no-op when it is fresh.

#![allow(dead_code)]

#[path = "../common/example_bin.rs"]
mod example_bin;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use bytes::Bytes;
use hooklatch_core::provider::{SignRequest, Stripe};
use hooklatch_core::{InboundRequest, ProviderAdapter, Secret, Timestamp};
use serde_json::Value;

/// The admin token of every test gateway.
pub const ADMIN_TOKEN: &str = "replay-admin-token-0123456789abcdef";
/// The Stripe source's secret.
pub const STRIPE_SECRET: &str = "whsec_replay_tests_stripe_secret_0123";
/// How long any awaited condition may take.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("binding an ephemeral port")
        .local_addr()
        .expect("local address")
        .port()
}

/// A process-unique suffix for ids and names.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{prefix}_{}_{}_{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed),
        Timestamp::now().as_millis()
    )
}

/// A Stripe `invoice.payment_succeeded` with bytes a re-serializer would change (spacing,
/// non-ASCII, a CRLF line end).
pub fn stripe_body(event_id: &str, amount: u64) -> Vec<u8> {
    format!(
        "{{\n  \"id\": \"{event_id}\",\r\n  \"type\": \"invoice.payment_succeeded\",\n  \"data\": {{ \"object\": {{ \"amount_paid\": {amount}, \"customer_name\": \"Zoë Müller — Café ☕\" }} }}\n}}\n"
    )
    .into_bytes()
}

/// Stripe's headers for `body`, signed at `at`.
pub fn stripe_headers(body: &[u8], at: Timestamp) -> Vec<(String, String)> {
    let secret = Secret::from_text(STRIPE_SECRET);
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    headers.extend(Stripe.sign(&SignRequest {
        body,
        secret: &secret,
        now: at,
        event_key: "",
        event_type: None,
        url: "",
    }));
    headers
}

// ---------------------------------------------------------------------------------------------
// The CLI

/// Runs `hooklatch args…` to completion (on a blocking thread) and returns its output.
pub async fn hooklatch(args: &[&str]) -> Output {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_hooklatch"))
            .args(&args)
            .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .output()
            .expect("running hooklatch")
    })
    .await
    .expect("the CLI thread")
}

/// The CLI's stdout as JSON, failing with its output when it is not.
pub fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}):\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The first report of a `replay --json` run that exited with `code`.
#[track_caller]
pub fn first_replay(out: &Output, code: i32) -> Value {
    assert_eq!(out.status.code(), Some(code), "{}", show(out));
    json_of(out)["replays"][0].clone()
}

/// stdout and stderr, for assertion messages.
pub fn show(out: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

// ---------------------------------------------------------------------------------------------
// The gateway

/// A running `hooklatch serve` with one Stripe source, its own temp dir, database and ports.
pub struct Gateway {
    dir: tempfile::TempDir,
    child: Child,
    /// `http://127.0.0.1:PORT` of ingest.
    pub ingest: String,
    /// `http://127.0.0.1:PORT` of the admin API.
    pub admin: String,
}

impl Gateway {
    /// Starts a gateway whose `stripe` source delivers to `destination` (if any), with
    /// `extra_env` (e.g. a tolerance override); waits for `/readyz`.
    pub async fn start(destination: Option<&str>, extra_env: &[(&str, &str)]) -> Gateway {
        Gateway::start_with(destination, extra_env, "").await
    }

    /// As [`Gateway::start`], with `more_sources` (TOML `[[sources]]` tables) after the Stripe
    /// source.
    pub async fn start_with(
        destination: Option<&str>,
        extra_env: &[(&str, &str)],
        more_sources: &str,
    ) -> Gateway {
        let dir = tempfile::Builder::new()
            .prefix("hooklatch-replay-")
            .tempdir()
            .expect("temp dir");
        for _ in 0..5 {
            let (ingest_port, admin_port) = (free_port(), free_port());
            let destinations = match destination {
                Some(url) => format!(
                    "destinations = [\"app\"]\n\n[[destinations]]\nname = \"app\"\nurl = \"{url}\"\nallow = [\"127.0.0.1\"]\ninitial_backoff = \"100ms\"\nmax_backoff = \"200ms\"\n"
                ),
                None => String::new(),
            };
            let config = format!(
                "[server]\nlisten = \"127.0.0.1:{ingest_port}\"\nadmin_listen = \"127.0.0.1:{admin_port}\"\n\n\
                 [store]\nurl = \"sqlite://{}\"\n\n\
                 [[sources]]\nname = \"stripe\"\nprovider = \"stripe\"\nsecrets = [\"{STRIPE_SECRET}\"]\n{destinations}\n{more_sources}",
                dir.path().join("hooklatch.db").display()
            );
            std::fs::write(dir.path().join("hooklatch.toml"), config).expect("writing config");
            let log = std::fs::File::create(dir.path().join("gateway.log")).expect("log file");
            let mut cmd = Command::new(env!("CARGO_BIN_EXE_hooklatch"));
            cmd.arg("serve")
                .arg("--config")
                .arg(dir.path().join("hooklatch.toml"))
                .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(log.try_clone().expect("log"))
                .stderr(log);
            for (k, v) in extra_env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("spawning hooklatch serve");
            let admin = format!("http://127.0.0.1:{admin_port}");
            let client = reqwest::Client::new();
            let started = Instant::now();
            let ready = loop {
                if let Ok(Some(_)) = child.try_wait() {
                    break false; // a port clash: try others
                }
                let ok = client
                    .get(format!("{admin}/readyz"))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                if ok {
                    break true;
                }
                assert!(started.elapsed() < DEADLINE, "gateway never became ready");
                tokio::time::sleep(Duration::from_millis(25)).await;
            };
            if ready {
                return Gateway {
                    dir,
                    child,
                    ingest: format!("http://127.0.0.1:{ingest_port}"),
                    admin,
                };
            }
        }
        panic!("the gateway did not start; see its log");
    }

    /// Its config file.
    pub fn config(&self) -> PathBuf {
        self.dir.path().join("hooklatch.toml")
    }

    /// Its temp dir.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// POSTs to `/in/stripe`; the status and JSON answer.
    pub async fn post_stripe(&self, headers: &[(String, String)], body: &[u8]) -> (u16, Value) {
        let mut req = reqwest::Client::new()
            .post(format!("{}/in/stripe", self.ingest))
            .body(body.to_vec());
        for (n, v) in headers {
            req = req.header(n.as_str(), v.as_str());
        }
        let res = req.send().await.expect("posting to ingest");
        let status = res.status().as_u16();
        (status, res.json().await.unwrap_or(Value::Null))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// The example credit service

/// Builds the credit-service binary once; its path.
pub fn credit_service_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| example_bin::build("hooklatch-example-credit-service", "credit-service"))
}

/// A running credit service.
pub struct CreditService {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub base: String,
}

impl CreditService {
    /// Starts the example in `mode` (`naive`, `check-then-insert`, `guarded`) on `db`, with
    /// `work_ms` of simulated work between its check and its write.
    pub async fn start(db: &str, mode: &str, work_ms: u64) -> CreditService {
        CreditService::start_with(db, mode, work_ms, &[]).await
    }

    /// [`CreditService::start`] with more arguments (`--secret whsec_…`).
    pub async fn start_with(db: &str, mode: &str, work_ms: u64, extra: &[&str]) -> CreditService {
        let bin = credit_service_bin().to_path_buf();
        let (db, mode) = (db.to_owned(), mode.to_owned());
        let extra: Vec<String> = extra.iter().map(|a| (*a).to_owned()).collect();
        tokio::task::spawn_blocking(move || {
            let mut child = Command::new(bin)
                .args(["--listen", "127.0.0.1:0", "--db", &db, "--mode", &mode])
                .arg("--work-ms")
                .arg(work_ms.to_string())
                .args(&extra)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("spawning credit-service");
            // The first line is the address; read_line returns at EOF if it dies first.
            let mut line = String::new();
            BufReader::new(child.stdout.take().expect("piped stdout"))
                .read_line(&mut line)
                .expect("reading credit-service's address");
            let base = line.trim().to_owned();
            assert!(
                base.starts_with("http://127.0.0.1:"),
                "credit-service said {base:?}"
            );
            CreditService { child, base }
        })
        .await
        .expect("starting credit-service")
    }

    /// The webhook URL.
    pub fn url(&self) -> String {
        format!("{}/webhooks/stripe", self.base)
    }
}

impl Drop for CreditService {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// A recording handler

/// One request the recorder received.
#[derive(Debug, Clone)]
pub struct Received {
    /// The method.
    pub method: String,
    /// The path and query.
    pub uri: String,
    /// Headers as received.
    pub headers: HeaderMap,
    /// The body, byte-exact.
    pub body: Bytes,
    /// The Stripe signature verified with [`STRIPE_SECRET`] at arrival.
    pub signature_valid: bool,
}

struct RecorderState {
    received: Mutex<Vec<Received>>,
    /// Answer 500 to every request whose 1-based arrival number is a multiple of this.
    fail_every: Mutex<Option<usize>>,
}

/// An HTTP handler on 127.0.0.1 that records every request and checks its Stripe signature.
pub struct Recorder {
    state: Arc<RecorderState>,
    task: tokio::task::JoinHandle<()>,
    /// Its URL.
    pub url: String,
}

impl Recorder {
    /// Starts one on an ephemeral port, answering 200.
    pub async fn start() -> Recorder {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the recorder");
        let url = format!(
            "http://{}/webhooks/stripe",
            listener.local_addr().expect("address")
        );
        let state = Arc::new(RecorderState {
            received: Mutex::new(Vec::new()),
            fail_every: Mutex::new(None),
        });
        let app = Router::new().fallback(record).with_state(state.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("recorder server");
        });
        Recorder { state, task, url }
    }

    /// From now on, answer 500 to every `n`th request.
    pub fn fail_every(&self, n: usize) {
        *self.state.fail_every.lock().expect("lock") = Some(n);
    }

    /// Everything received so far.
    pub fn received(&self) -> Vec<Received> {
        self.state.received.lock().expect("lock").clone()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn record(
    State(state): State<Arc<RecorderState>>,
    method: axum::http::Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let req = InboundRequest {
        path_and_query: "/webhooks/stripe",
        headers: &headers,
        body: &body,
        now: Timestamp::now(),
    };
    let signature_valid = Stripe
        .verify(
            &req,
            &[Secret::from_text(STRIPE_SECRET)],
            Duration::from_secs(300),
        )
        .is_ok();
    let n = {
        let mut received = state.received.lock().expect("lock");
        received.push(Received {
            method: method.to_string(),
            uri: uri.to_string(),
            headers,
            body,
            signature_valid,
        });
        received.len()
    };
    match *state.fail_every.lock().expect("lock") {
        Some(every) if n % every == 0 => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        _ => StatusCode::OK.into_response(),
    }
}
