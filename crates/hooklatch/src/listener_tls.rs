//! TLS on the public listener (`[server] tls_cert`, `tls_key`): rustls on ring, HTTP/1.1 by
//! ALPN, TLS 1.2 and 1.3. The certificate is held behind a lock and read again from its files
//! on `SIGHUP`, so a renewal (certbot's deploy hook, `kill -HUP`) takes effect for the next
//! handshake without a restart or a dropped connection; files that do not load leave the
//! certificate in use as it was, and say why. Each certificate loaded sets
//! `hooklatch_tls_certificate_expiry_timestamp_seconds` (its leaf's `notAfter`) and, within 14
//! days of it or past it, logs a warning or an error: a renewal that did not happen shows
//! before providers start failing their handshakes.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;

use crate::config::ServerTls;

/// The certificate every handshake gets, replaced whole on reload.
#[derive(Debug)]
struct CurrentCert(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for CurrentCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.0
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .clone(),
        )
    }
}

/// A listener's TLS: the acceptor and where its certificate comes from.
pub(crate) struct ListenerTls {
    settings: ServerTls,
    current: Arc<CurrentCert>,
    acceptor: TlsAcceptor,
}

impl ListenerTls {
    /// Reads the certificate and key (the process environment for an `env:` key).
    pub(crate) fn new(settings: ServerTls) -> anyhow::Result<ListenerTls> {
        let loaded = load(&settings)?;
        report_expiry(&loaded);
        let current = Arc::new(CurrentCert(RwLock::new(Arc::new(loaded))));
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_cert_resolver(current.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(ListenerTls {
            settings,
            current,
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// The acceptor, for each accepted connection.
    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Reads the files again and, if they load, serves them from the next handshake on.
    pub(crate) fn reload(&self) -> anyhow::Result<()> {
        let fresh = Arc::new(load(&self.settings)?);
        let in_use = self
            .current
            .0
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let now = hooklatch_core::Timestamp::now().as_millis() / 1000;
        if expired_replacement(not_after(&fresh), not_after(&in_use), now) {
            anyhow::bail!(
                "the certificate in {} has expired, and the one in use has not",
                self.settings.cert_file.display()
            );
        }
        report_expiry(&fresh);
        *self
            .current
            .0
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
        Ok(())
    }

    /// Reloads on every `SIGHUP` until the process ends, logging and counting each outcome
    /// (`hooklatch_tls_reloads_total{result}`).
    pub(crate) fn reload_on_sighup(self: Arc<Self>) -> anyhow::Result<()> {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hangups = signal(SignalKind::hangup())?;
        tokio::spawn(async move {
            while hangups.recv().await.is_some() {
                let result = match self.reload() {
                    Ok(()) => {
                        tracing::info!(
                            cert_file = %self.settings.cert_file.display(),
                            "TLS certificate reloaded"
                        );
                        "ok"
                    }
                    Err(err) => {
                        tracing::error!(
                            error = %format!("{err:#}"),
                            "TLS certificate not reloaded; the one in use stays"
                        );
                        "error"
                    }
                };
                metrics::counter!("hooklatch_tls_reloads_total", "result" => result).increment(1);
            }
        });
        Ok(())
    }
}

/// The leaf certificate's `notAfter` (unix seconds), when it parses.
fn not_after(key: &CertifiedKey) -> Option<i64> {
    let leaf = key.cert.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
    Some(cert.validity().not_after.timestamp())
}

/// Whether a reload would swap a certificate still valid at `now` for one already expired
/// (an old file put back by mistake): refused, the one in use stays.
fn expired_replacement(fresh: Option<i64>, in_use: Option<i64>, now: i64) -> bool {
    matches!((fresh, in_use), (Some(fresh), Some(in_use)) if fresh <= now && in_use > now)
}

/// How long before its certificate's expiry the gateway starts warning.
const EXPIRY_WARNING: i64 = 14 * 86_400;

/// Sets the expiry gauge from the leaf certificate's `notAfter`, warns near the expiry or
/// past it, and warns about a leaf that is a CA certificate (what `openssl req -x509` makes
/// alone), which rustls clients refuse as a server's.
fn report_expiry(key: &CertifiedKey) {
    let Some(leaf) = key.cert.first() else {
        return;
    };
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(leaf.as_ref()) else {
        return;
    };
    if cert.is_ca() {
        tracing::warn!(
            "the TLS certificate is a CA certificate (basicConstraints CA:TRUE): clients built on \
             rustls refuse it as a server's (CaUsedAsEndEntity); serve one your CA signs"
        );
    }
    let expiry = cert.validity().not_after.timestamp();
    metrics::gauge!("hooklatch_tls_certificate_expiry_timestamp_seconds").set(expiry as f64);
    let now = hooklatch_core::Timestamp::now().as_millis() / 1000;
    let left = expiry - now;
    if left <= 0 {
        tracing::error!(
            expired_s_ago = -left,
            "the TLS certificate has expired: providers refuse it; renew it and send SIGHUP"
        );
    } else if left < EXPIRY_WARNING {
        tracing::warn!(
            days_left = left / 86_400,
            "the TLS certificate expires soon; renew it and send SIGHUP"
        );
    }
}

/// The certificate and key `settings` name, as rustls serves them.
fn load(settings: &ServerTls) -> anyhow::Result<CertifiedKey> {
    let env: HashMap<String, String> = std::env::vars().collect();
    Ok(settings.certified_key(&env)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expired_certificate_does_not_replace_a_valid_one() {
        let now = 1_800_000_000;
        assert!(expired_replacement(Some(now - 1), Some(now + 86_400), now));
        assert!(
            !expired_replacement(Some(now + 3_600), Some(now + 86_400), now),
            "renewed"
        );
        assert!(
            !expired_replacement(Some(now - 1), Some(now - 86_400), now),
            "both expired"
        );
        assert!(
            !expired_replacement(None, Some(now + 86_400), now),
            "unparsed: loaded as before"
        );
    }
}
