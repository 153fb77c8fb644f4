//! Interoperability with each provider's official library, proved by `interop/check.py`.
//!
//! The script starts this build's `hooklatch serve`, signs deliveries with the official
//! Python libraries (stripe, standardwebhooks, slack-sdk, twilio, PyNaCl; razorpay and
//! paddle-python-sdk verify) and checks the gateway accepts them and refuses them tampered with;
//! then it checks what `hooklatch send` produces verifies with those libraries. GitHub, Shopify
//! and WhatsApp publish no Python library: their published test vectors stand in.
//!
//! It needs a Python with `interop/requirements.txt` installed, named by
//! `HOOKLATCH_INTEROP_PYTHON`. Without it the test is skipped, except under CI (`CI` set),
//! where it fails: `.ci/run` makes that Python.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PYTHON_VAR: &str = "HOOKLATCH_INTEROP_PYTHON";
const SKIPPED: &str =
    "skipped: set HOOKLATCH_INTEROP_PYTHON to a Python with interop/requirements.txt installed";
/// The script bounds every request itself; this only stops a hung interpreter.
const DEADLINE: Duration = Duration::from_secs(600);

/// Writes straight to the process's stdout, past the test harness's capture of `println!`, so
/// the script's lines are streamed as they come and stay in CI logs when the test passes.
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn under_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty() && v != "false" && v != "0")
}

#[test]
fn hooklatch_agrees_with_the_official_provider_libraries() {
    let python = match std::env::var_os(PYTHON_VAR) {
        Some(p) if !p.is_empty() => p,
        _ => {
            assert!(!under_ci(), "{SKIPPED}");
            say(SKIPPED);
            return;
        }
    };
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut child = Command::new(&python)
        .arg("interop/check.py")
        .arg(env!("CARGO_BIN_EXE_hooklatch"))
        .current_dir(&root)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {python:?} interop/check.py: {e}"));

    let stdout = child.stdout.take().expect("stdout is piped");
    let reader = std::thread::spawn(move || {
        let mut last = String::new();
        let mut failures = Vec::new();
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            say(&line);
            if line.starts_with("FAIL ") {
                failures.push(line.clone());
            }
            if !line.trim().is_empty() {
                last = line;
            }
        }
        (last, failures)
    });

    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for interop/check.py") {
            break Some(status);
        }
        if started.elapsed() > DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let (last, failures) = reader.join().expect("the output reader does not panic");

    let Some(status) = status else {
        panic!("interop/check.py did not finish within {DEADLINE:?}; it was killed");
    };
    assert!(
        status.success(),
        "interop/check.py exited with {status}: {last}\n{}",
        failures.join("\n")
    );
    assert!(
        last.ends_with(" passed, 0 failed"),
        "interop/check.py succeeded without its summary line; last line: {last:?}"
    );
}
