//! The report card (RELIABILITY.md, "Report card"): one JSON line per reliability test run,
//! printed and appended to `$HOOKLATCH_REPORT` (default `target/reliability/report.jsonl`
//! beside the build). A test makes its [`Card`] when it starts and fills in its counts as it
//! learns them; the line is written when the card is dropped, with `"pass": false` if the test
//! is panicking then, so a failed run leaves its counts too.
//!
//! A test whose load or faults vary draws them from [`Card::seed`]: `$HOOKLATCH_SEED` (hex)
//! when set, to replay a run, else a fresh one. The seed is on the line (`null` for a test that
//! draws nothing), and a failing test prints it with the command that replays it.
//!
//! ```text
//! {"test":"T4","tier":"ci","backend":"sqlite","seed":null,"commit":"<sha>","ops":1000,
//!  "acked":300,"lost":0,"duplicates":11,"faults":{"kill9":1},"figures":{…},"pass":true}
//! ```

use std::io::Write;
use std::path::PathBuf;

use serde_json::{json, Map, Value};

/// One test's line on the report card.
pub struct Card {
    line: Map<String, Value>,
    faults: Map<String, Value>,
    figures: Map<String, Value>,
}

impl Card {
    /// A card for test `test` (`"T4"`) on `backend` (`"sqlite"`, `"postgres"`, `"redis"`).
    pub fn new(test: &str, backend: &str) -> Card {
        let mut line = Map::new();
        line.insert("test".into(), json!(test));
        line.insert(
            "tier".into(),
            json!(std::env::var("HOOKLATCH_TIER").unwrap_or_else(|_| "ci".to_owned())),
        );
        line.insert("backend".into(), json!(backend));
        // Until the test draws from one (`Card::seed`).
        line.insert("seed".into(), Value::Null);
        line.insert("commit".into(), json!(commit()));
        Card {
            line,
            faults: Map::new(),
            figures: Map::new(),
        }
    }

    /// Sets a count at the top level (`ops`, `acked`, `lost`, `duplicates`, `dlq`, …).
    pub fn count(&mut self, name: &str, n: usize) -> &mut Card {
        self.line.insert(name.into(), json!(n));
        self
    }

    /// Sets how many faults of a kind were injected (`kill9`, `sigterm`, `reset`, …).
    pub fn fault(&mut self, name: &str, n: usize) -> &mut Card {
        self.faults.insert(name.into(), json!(n));
        self
    }

    /// The seed the test's varying load and faults come from, put on the card:
    /// `$HOOKLATCH_SEED` (hex, with or without `0x`) to replay a run, else a fresh one.
    pub fn seed(&mut self) -> u64 {
        let seed = std::env::var("HOOKLATCH_SEED")
            .ok()
            .and_then(|s| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok())
            .unwrap_or_else(fresh_seed);
        self.line
            .insert("seed".into(), json!(format!("{seed:016x}")));
        seed
    }

    /// Sets one of the test's figures.
    pub fn figure(&mut self, name: &str, value: impl Into<Value>) -> &mut Card {
        self.figures.insert(name.into(), value.into());
        self
    }
}

impl Drop for Card {
    fn drop(&mut self) {
        let mut line = std::mem::take(&mut self.line);
        line.insert(
            "faults".into(),
            Value::Object(std::mem::take(&mut self.faults)),
        );
        line.insert(
            "figures".into(),
            Value::Object(std::mem::take(&mut self.figures)),
        );
        let pass = !std::thread::panicking();
        if let (false, Some(seed)) = (pass, line.get("seed").and_then(Value::as_str)) {
            eprintln!(
                "{} failed with seed {seed}: replay with HOOKLATCH_SEED={seed}",
                line["test"]
            );
        }
        line.insert("pass".into(), json!(pass));
        let text = Value::Object(line).to_string();
        println!("report: {text}");
        let path = report_path();
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut file| writeln!(file, "{text}"));
        if let Err(err) = written {
            eprintln!("could not append to {}: {err}", path.display());
        }
    }
}

/// A seed from the clock and the process: different for every run.
fn fresh_seed() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    mix(nanos ^ (u64::from(std::process::id()) << 32))
}

/// SplitMix64's finaliser: spreads any input over all 64 bits.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The `i`th number in `0..n` drawn from `seed`: the same for the same seed, whatever order
/// concurrent senders ask in.
pub fn draw(seed: u64, i: u64, n: u64) -> u64 {
    mix(seed ^ mix(i)) % n.max(1)
}

/// Where the lines go: `$HOOKLATCH_REPORT`, else `reliability/report.jsonl` in the build's
/// target directory (the parent of this test binary's temporary directory).
fn report_path() -> PathBuf {
    if let Some(path) = std::env::var_os("HOOKLATCH_REPORT") {
        return PathBuf::from(path);
    }
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent()
        .unwrap_or(&tmp)
        .join("reliability")
        .join("report.jsonl")
}

/// The commit under test: `$HOOKLATCH_COMMIT`, else what git says, else "unknown".
fn commit() -> String {
    if let Ok(commit) = std::env::var("HOOKLATCH_COMMIT") {
        return commit;
    }
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|sha| !sha.is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

/// A test's size for this run: its CI size `n` times `$HOOKLATCH_SCALE` (a whole number,
/// default 1; `scripts/soak` sets 10).
pub fn scaled(n: usize) -> usize {
    let scale = std::env::var("HOOKLATCH_SCALE")
        .ok()
        .and_then(|s| s.parse::<usize>().ok())
        .filter(|s| *s >= 1)
        .unwrap_or(1);
    n * scale
}

#[test]
fn a_draw_is_the_same_for_the_same_seed_and_index_and_within_its_range() {
    let seed = 0x85ab_0840_ea95_f47a;
    let draws: Vec<u64> = (0..1000).map(|i| draw(seed, i, 5_001)).collect();
    assert!(draws.iter().all(|d| *d < 5_001));
    assert_eq!(
        draws,
        (0..1000).map(|i| draw(seed, i, 5_001)).collect::<Vec<_>>()
    );
    assert_ne!(
        draws,
        (0..1000)
            .map(|i| draw(seed + 1, i, 5_001))
            .collect::<Vec<_>>()
    );
    // Spread over the range, not stuck in a corner of it.
    assert!(draws.iter().any(|d| *d < 500) && draws.iter().any(|d| *d > 4_500));
}
