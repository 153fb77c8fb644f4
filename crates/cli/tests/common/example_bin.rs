//! Building an example's binary from a test: `CARGO_BIN_EXE_*` only names binaries of the
//! package under test, so the examples are built with `cargo build -p …` into this run's
//! target directory and profile (found from the `hooklatch` binary's path). Cargo has released
//! its build lock by the time tests run, and the build does nothing when it is fresh.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds `package` and returns the path of its binary `bin`.
pub fn build(package: &str, bin: &str) -> PathBuf {
    // target/<profile>/hooklatch → the target dir and profile of this test run.
    let hooklatch = Path::new(env!("CARGO_BIN_EXE_hooklatch"));
    let profile_dir = hooklatch.parent().expect("the binary's directory");
    let target_dir = profile_dir.parent().expect("the target directory");
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(other) => other.to_owned(),
    };
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.toml");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "-p", package])
        .arg("--manifest-path")
        .arg(&manifest)
        .arg("--target-dir")
        .arg(target_dir)
        .arg("--profile")
        .arg(&profile)
        .status()
        .unwrap_or_else(|e| panic!("running cargo build -p {package}: {e}"));
    assert!(status.success(), "building {package} failed");
    let path = profile_dir.join(format!("{bin}{}", std::env::consts::EXE_SUFFIX));
    assert!(path.exists(), "no {bin} binary at {}", path.display());
    path
}
