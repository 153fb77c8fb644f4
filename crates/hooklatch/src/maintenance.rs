//! Background upkeep: purge expired claims and old history, refresh store gauges.

use std::sync::Arc;
use std::time::Duration;

use hooklatch_core::{Store, Timestamp};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

use crate::config::StoreSettings;

/// How often gauges are refreshed.
const GAUGE_INTERVAL: Duration = Duration::from_secs(5);

pub(crate) async fn run(
    store: Arc<dyn Store>,
    settings: StoreSettings,
    metrics: PrometheusHandle,
    cancel: CancellationToken,
) {
    let mut gauges = tokio::time::interval(GAUGE_INTERVAL);
    let mut purge = tokio::time::interval(settings.purge_interval);
    gauges.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    purge.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = gauges.tick() => {
                metrics.run_upkeep();
                match store.stats().await {
                    Ok(stats) => {
                        metrics::gauge!("hooklatch_outbox_pending").set(stats.pending as f64);
                        metrics::gauge!("hooklatch_dead_letter").set(stats.dead as f64);
                        metrics::gauge!("hooklatch_claims").set(stats.claims as f64);
                    }
                    Err(err) => tracing::warn!(%err, "could not read store counts"),
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
