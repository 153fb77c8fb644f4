//! Background upkeep: purge expired claims and old history, refresh store gauges (the outbox,
//! the conflicts no operator decided, the claims), fold the metrics recorded since the last
//! pass into their histograms.

use std::sync::Arc;
use std::time::Duration;

use hooklatch_core::{Store, Timestamp};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

use crate::config::StoreSettings;

/// How often the outbox gauges are refreshed.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

/// How often the samples recorded since the last pass are folded into the histograms. The
/// exporter keeps every sample until then (one per request and more), and folding those of
/// 20,000–30,000 requests took 8–9 ms of one core, measured. It runs on a blocking thread,
/// not on one of the runtime's two workers, where every request that worker held waited.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(1);

/// How often the claims gauge is refreshed: counting claims reads every claim held, which
/// grows with the store (0.17 s warm, 5.9 s cold on ten million SQLite claims).
const CLAIMS_GAUGE_INTERVAL: Duration = Duration::from_secs(60);

pub(crate) async fn run(
    store: Arc<dyn Store>,
    settings: StoreSettings,
    metrics: PrometheusHandle,
    admin: Arc<hooklatch_http::AdminState>,
    cancel: CancellationToken,
) {
    let mut upkeep = tokio::time::interval(UPKEEP_INTERVAL);
    let mut gauges = tokio::time::interval(GAUGE_INTERVAL);
    let mut claims = tokio::time::interval(CLAIMS_GAUGE_INTERVAL);
    let mut purge = tokio::time::interval(settings.purge_interval);
    for interval in [&mut upkeep, &mut gauges, &mut claims, &mut purge] {
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    }
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = upkeep.tick() => {
                let metrics = metrics.clone();
                if let Err(err) = tokio::task::spawn_blocking(move || metrics.run_upkeep()).await {
                    tracing::warn!(%err, "metrics upkeep failed");
                }
            }
            _ = gauges.tick() => {
                // What /readyz would say, for an alert that needs no prober: a store or key
                // store down with no traffic coming in shows here.
                let ready = hooklatch_http::not_ready_because(&admin).await.is_none();
                metrics::gauge!("hooklatch_ready").set(if ready { 1.0 } else { 0.0 });
                match store.outbox_counts().await {
                    Ok(counts) => {
                        metrics::gauge!("hooklatch_outbox_pending").set(counts.pending as f64);
                        metrics::gauge!("hooklatch_dead_letter").set(counts.dead as f64);
                    }
                    Err(err) => tracing::warn!(%err, "could not read outbox counts"),
                }
                // Conflicts waiting for an operator: read through the index of verdicts.
                match store.undecided_conflicts().await {
                    Ok(n) => metrics::gauge!("hooklatch_conflicts_undecided").set(n as f64),
                    Err(err) => tracing::warn!(%err, "could not count undecided conflicts"),
                }
            }
            _ = claims.tick() => {
                match store.stats().await {
                    Ok(stats) => metrics::gauge!("hooklatch_claims").set(stats.claims as f64),
                    Err(err) => tracing::warn!(%err, "could not count claims"),
                }
            }
            _ = purge.tick() => {
                let now = Timestamp::now();
                match store.purge(now, now.minus(settings.history_retention)).await {
                    Ok(purged) if purged.claims + purged.requests > 0 => tracing::info!(
                        claims = purged.claims, requests = purged.requests, "purged expired claims and old history"),
                    Ok(_) => {}
                    Err(err) => tracing::warn!(%err, "purge failed; will try again"),
                }
            }
        }
    }
}
