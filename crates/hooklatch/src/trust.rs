//! CA certificates the command-line clients trust besides the Mozilla roots built in: a
//! gateway, an admin API or a local application on a certificate from a private CA (a staging
//! gateway's own `tls_cert`, say). `hooklatch --ca-file FILE <verb>` (or `HOOKLATCH_CA_FILE`)
//! sets them once for the process; every HTTPS client the verbs build then adds them
//! ([`client_builder`]). The gateway's deliveries do not read them: each destination has its
//! own `ca_file`.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::Context;

/// The extra roots, set at most once.
static EXTRA_ROOTS: OnceLock<Vec<reqwest::Certificate>> = OnceLock::new();

/// Reads `path` (PEM, one or more certificates), checks each certificate, and has every
/// client built after this call trust them. Returns how many there are.
pub fn trust_ca_file(path: &Path) -> anyhow::Result<usize> {
    let pem =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let n = crate::tls_files::check_ca_pem(&pem)
        .map_err(|e| anyhow::anyhow!("--ca-file {}: {e}", path.display()))?;
    let certs = reqwest::Certificate::from_pem_bundle(pem.as_bytes())
        .with_context(|| format!("--ca-file {}", path.display()))?;
    EXTRA_ROOTS
        .set(certs)
        .map_err(|_| anyhow::anyhow!("--ca-file is read once per process"))?;
    Ok(n)
}

/// A reqwest client builder trusting the built-in roots and the `--ca-file` certificates.
pub fn client_builder() -> reqwest::ClientBuilder {
    let mut builder = reqwest::Client::builder();
    for cert in EXTRA_ROOTS.get().into_iter().flatten() {
        builder = builder.add_root_certificate(cert.clone());
    }
    builder
}
