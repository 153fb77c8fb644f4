//! The deployment files in `deploy/` are checked by the tools that read them: the systemd
//! unit by `systemd-analyze verify` (with its `ExecStart` on the binary under test), and the
//! Prometheus alerting rules by `promtool check rules` and by their own unit tests
//! (`promtool test rules`), which feed series shaped as `/metrics` shows them and say which
//! alerts fire. Without the tools the tests print `skipped:` and pass, except under CI, where
//! `.ci/run` installs them.

use std::path::{Path, PathBuf};
use std::process::Command;

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// Whether `tool` runs; under CI its absence is a failure.
fn have(tool: &str) -> bool {
    let found = Command::new(tool).arg("--version").output().is_ok();
    if !found {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but {tool} is missing: .ci/run installs it"
        );
        eprintln!("skipped: {tool} is not installed");
    }
    found
}

#[test]
fn the_systemd_unit_verifies_and_outlasts_the_shutdown() {
    if !have("systemd-analyze") {
        return;
    }
    let unit = std::fs::read_to_string(deploy_dir().join("systemd/hooklatch.service"))
        .expect("reading the unit");
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("hooklatch.service");
    let here = unit.replace("/usr/local/bin/hooklatch", env!("CARGO_BIN_EXE_hooklatch"));
    std::fs::write(&path, here).expect("writing the unit");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("running systemd-analyze");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Any line is a complaint: an unknown key is only a warning, but a setting that does
    // nothing.
    assert!(out.status.success() && said.trim().is_empty(), "{said}");

    // systemd's stop timeout leaves the gateway its default delay and grace.
    let seconds = |text: &str, key: &str| -> u64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("{key} =")) || l.starts_with(&format!("{key}=")))
            .unwrap_or_else(|| panic!("no {key}"));
        let value = line
            .split('=')
            .nth(1)
            .expect("a value")
            .trim()
            .trim_matches('"');
        value.trim_end_matches('s').parse().expect("whole seconds")
    };
    let defaults = std::fs::read_to_string(deploy_dir().join("../config.default.toml"))
        .expect("reading the defaults");
    let needed = seconds(&defaults, "shutdown_delay") + seconds(&defaults, "shutdown_grace");
    assert!(
        seconds(&unit, "TimeoutStopSec") > needed,
        "TimeoutStopSec ≤ {needed}"
    );
}

#[test]
fn the_alerting_rules_load_and_fire_on_what_they_say() {
    if !have("promtool") {
        return;
    }
    let rules = deploy_dir().join("prometheus");
    for args in [
        &["check", "rules", "hooklatch-alerts.yml"][..],
        &["test", "rules", "hooklatch-alerts.test.yml"][..],
    ] {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(&rules)
            .output()
            .expect("running promtool");
        assert!(
            out.status.success(),
            "promtool {args:?}:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
