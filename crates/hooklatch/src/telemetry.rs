//! Every metric `/metrics` exposes: its `# HELP` line, and the series that exist from start.
//!
//! A counter that appears only at its first increment breaks the queries it is meant for:
//! `rate()` and `increase()` need a sample before the first event to see it, and an alert on
//! `hooklatch_requests_total{verdict="rejected"}` cannot tell "none yet" from "not scraped".
//! So [`register`] creates, at zero, each counter's series for the configured sources and
//! destinations and the label values that mean trouble; the rest appear as they happen.

use hooklatch_core::provider::TIMESTAMP_SIGNERS;

use crate::config::{DestinationKind, Settings};

/// A metric's kind, for its `# HELP` line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every metric hooklatch records, with its help text (README, "Metrics", says more).
pub(crate) const METRICS: &[(&str, Kind, &str)] = &[
    ("hooklatch_requests_total", Kind::Counter,
     "Ingest requests by source and verdict; reason: a rejection's code, or why the gateway failed for verdict=\"error\" (store_full, store_unavailable, key_store_unavailable)."),
    ("hooklatch_ack_seconds", Kind::Histogram,
     "Time from a request's arrival to its answer, by verdict."),
    ("hooklatch_conflicts_total", Kind::Counter,
     "Events whose key was claimed before with a different body, by source."),
    ("hooklatch_conflicts_undecided", Kind::Gauge,
     "Conflicts no operator has released or dismissed yet."),
    ("hooklatch_malformed_requests_total", Kind::Counter,
     "Request heads that did not parse, on either listener, by code."),
    ("hooklatch_outbox_pending", Kind::Gauge,
     "Deliveries waiting to be delivered."),
    ("hooklatch_dead_letter", Kind::Gauge,
     "Deliveries dead-lettered and not retried yet."),
    ("hooklatch_claims", Kind::Gauge,
     "Event keys remembered (refreshed every 60 s)."),
    ("hooklatch_delivery_attempts_total", Kind::Counter,
     "Delivery attempts by destination and outcome: delivered, retry, dead_letter, gone (a 410 that disabled the destination), wait."),
    ("hooklatch_delivery_seconds", Kind::Histogram,
     "Time of each delivery attempt, by destination."),
    ("hooklatch_delivery_waits_total", Kind::Counter,
     "Deliveries put back without an attempt (destination disabled, or no listener connected)."),
    ("hooklatch_delivery_handoffs_total", Kind::Counter,
     "Requests whose new deliveries went to this instance's worker in memory."),
    ("hooklatch_destination_disabled", Kind::Gauge,
     "1 while a destination is disabled (by its 410 or an operator) and its deliveries wait."),
    ("hooklatch_attempt_record_retries_total", Kind::Counter,
     "Delivery attempts whose record failed and was tried again: recorded, or gave_up."),
    ("hooklatch_amqp_returned_total", Kind::Counter,
     "Messages a RabbitMQ broker returned as unroutable, by destination."),
    ("hooklatch_listeners", Kind::Gauge,
     "`hooklatch listen` clients connected, by destination."),
    ("hooklatch_listen_refused_total", Kind::Counter,
     "`hooklatch listen` connections refused, by code."),
    ("hooklatch_ready", Kind::Gauge,
     "1 while the gateway takes traffic, as /readyz says (refreshed every 5 s); 0 while starting, shutting down, or with the store or key store not answering."),
    ("hooklatch_store_full", Kind::Gauge,
     "1 while the store refuses events because it is full."),
    ("hooklatch_store_group_commit_jobs", Kind::Histogram,
     "Jobs per group commit of the store's writer."),
    ("hooklatch_store_commit_seconds", Kind::Histogram,
     "SQLite: time of each group commit's COMMIT (its WAL written and fsynced)."),
    ("hooklatch_store_wal_restart_wait_seconds", Kind::Histogram,
     "SQLite: time the writer waited for the checkpointer so that the WAL starts over."),
    ("hooklatch_store_serialization_retries_total", Kind::Counter,
     "PostgreSQL: group commits tried again after a serialization failure."),
    ("hooklatch_unsafe_durability", Kind::Gauge,
     "PostgreSQL: 1 when started on settings that can lose acknowledged events."),
    ("hooklatch_key_store_may_forget", Kind::Gauge,
     "Redis key store: how many of the server's settings let it forget keys (0 is well)."),
    ("hooklatch_key_leases_lost_total", Kind::Counter,
     "Redis key store: keys whose in-flight lease ran out or could not be marked done, by source."),
    ("hooklatch_tls_handshake_failures_total", Kind::Counter,
     "TLS handshakes that did not complete, by listener."),
    ("hooklatch_tls_reloads_total", Kind::Counter,
     "TLS certificate reloads on SIGHUP, by result."),
    ("hooklatch_tls_certificate_expiry_timestamp_seconds", Kind::Gauge,
     "The served certificate's notAfter, in unix seconds."),
];

/// Describes every metric and creates, at zero, the series [`settings`](Settings) makes known.
/// Call after the recorder is installed.
pub(crate) fn register(settings: &Settings) {
    for &(name, kind, help) in METRICS {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
    for source in &settings.sources {
        let name = source.name.to_string();
        for verdict in ["accepted", "duplicate", "conflict"] {
            metrics::counter!("hooklatch_requests_total",
                "source" => name.clone(), "verdict" => verdict)
            .absolute(0);
        }
        let mut refusals = vec!["missing_signature", "invalid_signature"];
        if TIMESTAMP_SIGNERS.contains(&source.adapter.provider()) {
            refusals.push("stale_timestamp");
        }
        for reason in refusals {
            metrics::counter!("hooklatch_requests_total",
                "source" => name.clone(), "verdict" => "rejected", "reason" => reason)
            .absolute(0);
        }
        let mut errors = vec!["store_full", "store_unavailable"];
        if settings.store.keys.is_some() {
            errors.push(hooklatch_http::KEY_STORE_UNAVAILABLE);
        }
        for reason in errors {
            metrics::counter!("hooklatch_requests_total",
                "source" => name.clone(), "verdict" => "error", "reason" => reason)
            .absolute(0);
        }
        metrics::counter!("hooklatch_conflicts_total", "source" => name.clone()).absolute(0);
        if settings.store.keys.is_some() {
            metrics::counter!("hooklatch_key_leases_lost_total", "source" => name).absolute(0);
        }
    }
    for dest in &settings.destinations {
        let mut outcomes = vec!["delivered", "retry", "dead_letter"];
        match &dest.kind {
            DestinationKind::Http { .. } if dest.disable_on_gone => outcomes.push("gone"),
            DestinationKind::Listen { .. } => {
                metrics::gauge!("hooklatch_listeners", "destination" => dest.name.clone()).set(0.0);
            }
            DestinationKind::Amqp(_) => {
                metrics::counter!("hooklatch_amqp_returned_total",
                    "destination" => dest.name.clone())
                .absolute(0);
            }
            DestinationKind::Http { .. } => {}
        }
        for outcome in outcomes {
            metrics::counter!("hooklatch_delivery_attempts_total",
                "destination" => dest.name.clone(), "outcome" => outcome)
            .absolute(0);
        }
        metrics::counter!("hooklatch_delivery_waits_total", "destination" => dest.name.clone())
            .absolute(0);
    }
    for code in ["malformed_request", "headers_too_large", "uri_too_long"] {
        metrics::counter!("hooklatch_malformed_requests_total", "code" => code).absolute(0);
    }
    metrics::gauge!("hooklatch_store_full").set(0.0);
    metrics::gauge!("hooklatch_ready").set(0.0);
    metrics::counter!("hooklatch_delivery_handoffs_total").absolute(0);
    for outcome in ["recorded", "gave_up"] {
        metrics::counter!("hooklatch_attempt_record_retries_total", "outcome" => outcome)
            .absolute(0);
    }
    if settings.tls.is_some() {
        let mut listeners = vec!["ingest"];
        if settings.admin_tls {
            listeners.push("admin");
        }
        for listener in listeners {
            metrics::counter!("hooklatch_tls_handshake_failures_total", "listener" => listener)
                .absolute(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every metric name the workspace's sources record is in [`METRICS`], so none goes out
    /// without its `# HELP` line; and every name there is recorded somewhere.
    #[test]
    fn every_metric_recorded_is_described() {
        let crates = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut recorded = std::collections::BTreeSet::new();
        let mut stack = vec![crates];
        while let Some(dir) = stack.pop() {
            for entry in std::fs::read_dir(&dir)
                .expect("reading a source dir")
                .flatten()
            {
                let path = entry.path();
                if path.is_dir() {
                    stack.push(path);
                } else if path.extension().is_some_and(|e| e == "rs")
                    && !path.ends_with("telemetry.rs")
                {
                    let text = std::fs::read_to_string(&path).expect("reading a source file");
                    for macro_ in ["counter!(", "gauge!(", "histogram!("] {
                        for (at, _) in text.match_indices(macro_) {
                            let rest = text[at + macro_.len()..].trim_start();
                            let Some(rest) = rest.strip_prefix("\"hooklatch_") else {
                                continue;
                            };
                            let name: String = rest
                                .chars()
                                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                                .collect();
                            recorded.insert(format!("hooklatch_{name}"));
                        }
                    }
                }
            }
        }
        let described: std::collections::BTreeSet<String> =
            METRICS.iter().map(|(name, ..)| name.to_string()).collect();
        assert!(recorded.len() >= 20, "found only {recorded:?}");
        let undescribed: Vec<_> = recorded.difference(&described).collect();
        assert!(
            undescribed.is_empty(),
            "recorded without help: {undescribed:?}"
        );
        let unused: Vec<_> = described.difference(&recorded).collect();
        assert!(unused.is_empty(), "described, never recorded: {unused:?}");
    }

    /// The alerting rules in `deploy/` and the README's advice name metrics that exist (a
    /// histogram by its `_bucket`, `_sum` or `_count` too).
    #[test]
    fn the_alerting_rules_and_the_readme_name_real_metrics() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for file in [
            "deploy/prometheus/hooklatch-alerts.yml",
            "deploy/prometheus/hooklatch-alerts.test.yml",
            "README.md",
        ] {
            let text = std::fs::read_to_string(root.join(file)).expect("reading the file");
            let mut named = 0;
            for (at, _) in text.match_indices("hooklatch_") {
                let preceded = text[..at]
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
                if preceded {
                    continue;
                }
                let name: String = text[at..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                    .collect();
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(&name);
                if METRICS.iter().any(|(m, ..)| *m == name || *m == base) {
                    named += 1;
                } else {
                    assert!(
                        !name.ends_with("_total") && !name.ends_with("_seconds"),
                        "{file} names {name}, which hooklatch does not record"
                    );
                }
            }
            assert!(named >= 5, "{file} names only {named} metrics");
        }
    }
}
