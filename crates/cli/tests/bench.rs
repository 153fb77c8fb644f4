//! A smoke run of `hooklatch bench` against a real `hooklatch serve`: it runs, and it counts
//! correctly. No timing is asserted (CI machines vary); the numbers live in BENCHMARKS.md.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const ADMIN_TOKEN: &str = "bench-smoke-admin-token-0123456789";
const SECRET: &str = "whsec_bench_smoke_0123456789";

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binding an ephemeral port");
    listener.local_addr().expect("local address").port()
}

/// Kills the gateway when the test ends, however it ends.
struct Gateway(Child);

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A config with one Stripe source delivering to the sink at `sink`; `deliver = false` makes an
/// ingest-only gateway whose events stay queued.
fn write_config(dir: &Path, (ingest, admin, sink): (u16, u16, u16), deliver: bool) -> PathBuf {
    let config = dir.join("hooklatch.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[server]
listen = "127.0.0.1:{ingest}"
admin_listen = "127.0.0.1:{admin}"
admin_token = "env:HOOKLATCH_ADMIN_TOKEN"

[store]
url = "sqlite://{db}"

[delivery]
enabled = {deliver}

[[sources]]
name = "stripe"
provider = "stripe"
secrets = ["{SECRET}"]
destinations = ["sink"]

[[destinations]]
name = "sink"
url = "http://127.0.0.1:{sink}/sink"
allow = ["127.0.0.1"]
"#,
            db = dir.join("hooklatch.db").display(),
        ),
    )
    .expect("writing the config");
    config
}

/// Starts `hooklatch serve` with `config` and waits until its ingest port listens.
fn start(dir: &Path, config: &Path, ingest: u16) -> Gateway {
    let log = std::fs::File::create(dir.join("gateway.log")).expect("a log file");
    let mut gw = Gateway(
        Command::new(env!("CARGO_BIN_EXE_hooklatch"))
            .args(["serve", "--config"])
            .arg(config)
            .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting hooklatch serve"),
    );
    let started = Instant::now();
    loop {
        if std::net::TcpStream::connect(("127.0.0.1", ingest)).is_ok() {
            return gw;
        }
        assert!(
            gw.0.try_wait().expect("gateway status").is_none(),
            "the gateway exited: {}",
            std::fs::read_to_string(dir.join("gateway.log")).unwrap_or_default()
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the gateway never listened"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs `hooklatch bench --json` with `args` against the gateway on `ingest`, and returns
/// its JSON.
fn bench_json(ingest: u16, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(["bench", "--target"])
        .arg(format!("http://127.0.0.1:{ingest}"))
        .args(["--secret", SECRET, "--json"])
        .args(args)
        .output()
        .expect("running hooklatch bench");
    assert!(
        out.status.success(),
        "bench failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    serde_json::from_slice(&out.stdout).expect("bench --json prints JSON")
}

/// Nothing listening, or a wrong secret: the report says why each request failed (before, a
/// closed port gave `statuses: error×N` and an empty `answers`).
#[test]
fn bench_names_why_requests_failed() {
    let closed = free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(["bench", "--target"])
        .arg(format!("http://127.0.0.1:{closed}"))
        .args([
            "--secret",
            SECRET,
            "--json",
            "--events",
            "5",
            "--concurrency",
            "1",
        ])
        .output()
        .expect("running hooklatch bench");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).expect("bench --json prints JSON");
    let answers = doc["hooklatch"]["answers"]
        .as_object()
        .expect("answers")
        .clone();
    assert_eq!(answers.len(), 1, "{doc:#}");
    let (why, n) = answers.into_iter().next().unwrap();
    assert!(why.starts_with("no answer: connection failed ("), "{why}");
    assert!(why.contains("refused"), "{why}");
    assert_eq!(n, 5, "{doc:#}");
}

#[test]
fn bench_sends_every_event_and_duplicate_and_counts_the_answers() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let (ingest, admin, sink) = (free_port(), free_port(), free_port());
    let config = write_config(dir.path(), (ingest, admin, sink), true);
    let gw = start(dir.path(), &config, ingest);

    let (sink, pid) = (format!("127.0.0.1:{sink}"), gw.0.id().to_string());
    let doc = bench_json(
        ingest,
        &[
            "--events",
            "200",
            "--duplicates",
            "0.1",
            "--concurrency",
            "8",
            "--baseline",
            "--sink-wait",
            "30s",
            "--body-size",
            "2048",
            "--sink-listen",
            &sink,
            "--pid",
            &pid,
        ],
    );

    // 200 distinct events, and duplicates = round(200 × 0.1 / 0.9) = 22 byte-identical copies.
    let run = &doc["hooklatch"];
    assert_eq!(run["sent"], 222, "{doc:#}");
    assert_eq!(run["duplicates_sent"], 22, "{doc:#}");
    assert_eq!(run["statuses"], serde_json::json!({"200": 222}), "{doc:#}");
    assert_eq!(run["answers"]["accepted"], 200, "{doc:#}");
    assert_eq!(run["answers"]["duplicate"], 22, "{doc:#}");
    assert!(run["answers"].get("conflict").is_none(), "{doc:#}");
    assert!(doc["body_bytes"].as_u64().unwrap() >= 2048, "{doc:#}");

    // The ceiling got the same requests.
    assert_eq!(doc["baseline"]["sent"], 222, "{doc:#}");
    assert_eq!(doc["baseline"]["statuses"]["200"], 222, "{doc:#}");
    assert!(doc["ratio_to_ceiling"].as_f64().is_some(), "{doc:#}");

    // Every accepted event reached the sink.
    assert_eq!(doc["delivery"]["accepted"], 200, "{doc:#}");
    assert_eq!(doc["delivery"]["delivered"], 200, "{doc:#}");

    // The server's memory was sampled.
    assert!(doc["memory"]["vm_hwm_kib"].as_u64().unwrap() > 0, "{doc:#}");

    // And its CPU time: 222 signed requests cost a debug build well over one 10 ms tick.
    let cpu = &run["cpu"];
    assert!(cpu["server_cpu_s"].as_f64().unwrap() > 0.0, "{doc:#}");
    assert!(
        cpu["server_cpu_us_per_request"].as_f64().unwrap() > 0.0,
        "{doc:#}"
    );
    let busy = cpu["machine_busy_share"].as_f64().unwrap();
    assert!(busy > 0.0 && busy <= 1.0, "{doc:#}");
    let steal = cpu["machine_steal_share"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&steal), "{doc:#}");
    assert!(cpu["cores"].as_u64().unwrap() >= 1, "{doc:#}");
    assert!(cpu["bench_cpu_s"].as_f64().unwrap() > 0.0, "{doc:#}");
    assert!(cpu["other_cpu_s"].as_f64().unwrap() >= 0.0, "{doc:#}");
    // The ceiling runs inside the bench: only the machine is measured for it.
    assert!(doc["baseline"]["cpu"]["server_cpu_s"].is_null(), "{doc:#}");
    assert!(
        doc["baseline"]["cpu"]["machine_busy_share"]
            .as_f64()
            .is_some(),
        "{doc:#}"
    );
}

#[test]
fn an_open_loop_keeps_its_connections_and_counts_every_answer() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let ports = (free_port(), free_port(), free_port());
    let (ingest, admin, _) = ports;
    let config = write_config(dir.path(), ports, false);
    let _gw = start(dir.path(), &config, ingest);

    let doc = bench_json(
        ingest,
        &[
            "--events",
            "100",
            "--duplicates",
            "0.1",
            "--rate",
            "400",
            "--connections",
            "4",
        ],
    );
    assert_eq!(
        doc["load"],
        serde_json::json!({"rate": 400.0, "connections": 4, "warmup_s": 0.0}),
        "{doc:#}"
    );
    let run = &doc["hooklatch"];
    assert_eq!(run["sent"], 111, "{doc:#}");
    assert_eq!(run["statuses"], serde_json::json!({"200": 111}), "{doc:#}");
    assert_eq!(run["answers"]["accepted"], 100, "{doc:#}");
    assert_eq!(run["answers"]["duplicate"], 11, "{doc:#}");

    // The connections it opened before its clock started (GET /, a 404) left no history:
    // the gateway holds the 111 requests of the run and nothing else.
    assert_eq!(captures(admin), 111);

    // After a warm-up of 100 ms at 400/s (40 requests, of their own events) the run counts
    // only its own 50; the gateway got all 90.
    let doc = bench_json(
        ingest,
        &[
            "--events",
            "50",
            "--rate",
            "400",
            "--connections",
            "4",
            "--warmup",
            "100ms",
        ],
    );
    assert_eq!(doc["load"]["warmup_s"], 0.1, "{doc:#}");
    let run = &doc["hooklatch"];
    assert_eq!(run["sent"], 50, "{doc:#}");
    assert_eq!(run["statuses"], serde_json::json!({"200": 50}), "{doc:#}");
    assert_eq!(
        run["answers"],
        serde_json::json!({"accepted": 50}),
        "{doc:#}"
    );
    assert_eq!(captures(admin), 111 + 40 + 50);
}

/// The requests the gateway on `admin` holds in its history (`hooklatch events export`).
fn captures(admin: u16) -> usize {
    let export = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(["events", "export", "--limit", "1000", "--admin"])
        .arg(format!("http://127.0.0.1:{admin}"))
        .args(["--token", ADMIN_TOKEN])
        .output()
        .expect("running hooklatch events export");
    assert!(
        export.status.success(),
        "{}",
        String::from_utf8_lossy(&export.stderr)
    );
    let captures: Value = serde_json::from_slice(&export.stdout).expect("an export");
    captures["captures"]
        .as_array()
        .map(Vec::len)
        .unwrap_or_else(|| panic!("no captures in {captures:#}"))
}

#[test]
fn bench_drain_counts_a_backlog_delivered_after_a_restart() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let ports = (free_port(), free_port(), free_port());
    let (ingest, _, sink) = ports;

    // 50 events queued by a gateway that does not deliver.
    let config = write_config(dir.path(), ports, false);
    let gw = start(dir.path(), &config, ingest);
    bench_json(
        ingest,
        &["--events", "50", "--concurrency", "4", "--sink-wait", "0s"],
    );
    drop(gw);

    // The sink first, then a gateway on the same store that delivers.
    let drain = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args([
            "bench",
            "--drain",
            "50",
            "--sink-wait",
            "60s",
            "--json",
            "--sink-listen",
        ])
        .arg(format!("127.0.0.1:{sink}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running hooklatch bench --drain");
    let started = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", sink)).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the drain's sink never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let config = write_config(dir.path(), ports, true);
    let _gw = start(dir.path(), &config, ingest);
    let out = drain.wait_with_output().expect("waiting for the drain");
    assert!(
        out.status.success(),
        "drain failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    let doc: Value = serde_json::from_slice(&out.stdout).expect("bench --drain --json prints JSON");
    assert_eq!(doc["drain"]["expected"], 50, "{doc:#}");
    assert_eq!(doc["drain"]["delivered"], 50, "{doc:#}");
    assert!(doc["drain"]["attempts"].as_u64().unwrap() >= 50, "{doc:#}");
    assert!(
        doc["drain"]["events_per_s"].as_f64().unwrap() > 0.0,
        "{doc:#}"
    );
}

#[test]
fn bench_drain_needs_a_sink_address_and_at_least_one_event() {
    let out = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(["bench", "--drain", "10"])
        .output()
        .expect("running hooklatch bench");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--sink-listen"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(["bench", "--drain", "0", "--sink-listen", "127.0.0.1:9"])
        .output()
        .expect("running hooklatch bench");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--drain"), "{err}");
}
