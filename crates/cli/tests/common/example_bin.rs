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
    let mut command = Command::new(cargo);
    // `cargo test` gives this process its package's variables (CARGO_MANIFEST_DIR, CARGO_PKG_*,
    // …). Passed on, they would change the fingerprint of build scripts that watch them (ring's
    // does): the build here and a build from a shell would each rebuild what the other built.
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        let from_cargo_test = text.starts_with("CARGO_PKG_")
            || matches!(
                &*text,
                "CARGO_MANIFEST_DIR"
                    | "CARGO_MANIFEST_PATH"
                    | "CARGO_CRATE_NAME"
                    | "CARGO_PRIMARY_PACKAGE"
                    | "CARGO_TARGET_TMPDIR"
            );
        if from_cargo_test {
            command.env_remove(&name);
        }
    }
    let status = command
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
