//! `/metrics` from the first scrape: every metric with its `# HELP` line, and each counter's
//! series for the configured sources and destinations at zero, so that `rate()` and alerts
//! see the first event instead of a series that appears with it.

use crate::support::{
    stripe_headers_signed, stripe_invoice_paid, unique, Behaviour, Gateway, Handler,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_gateway_describes_its_metrics_and_counts_from_zero() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let text = gw.metrics().await;
    for (name, kind) in [
        ("hooklatch_requests_total", "counter"),
        ("hooklatch_delivery_attempts_total", "counter"),
        ("hooklatch_destination_disabled", "gauge"),
    ] {
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "no help for {name}:\n{text}"
        );
        assert!(
            text.contains(&format!("# TYPE {name} {kind}")),
            "no type for {name}:\n{text}"
        );
    }
    let rejected = |source: &str, reason: &str| {
        format!(
            r#"hooklatch_requests_total{{source="{source}",verdict="rejected",reason="{reason}"}}"#
        )
    };
    for series in [
        r#"hooklatch_requests_total{source="stripe",verdict="accepted"}"#.to_owned(),
        r#"hooklatch_requests_total{source="github",verdict="duplicate"}"#.to_owned(),
        r#"hooklatch_requests_total{source="stripe",verdict="error",reason="store_full"}"#
            .to_owned(),
        rejected("stripe", "invalid_signature"),
        rejected("stripe", "stale_timestamp"),
        rejected("github", "missing_signature"),
        r#"hooklatch_delivery_attempts_total{destination="app",outcome="delivered"}"#.to_owned(),
        r#"hooklatch_delivery_attempts_total{destination="app",outcome="gone"}"#.to_owned(),
        r#"hooklatch_conflicts_total{source="github"}"#.to_owned(),
    ] {
        assert!(
            text.contains(&format!("{series} 0\n")),
            "no {series} 0:\n{text}"
        );
    }
    assert!(
        text.contains("hooklatch_ready 1\n"),
        "ready once started:\n{text}"
    );
    assert!(text.contains("hooklatch_store_full 0\n"), "{text}");
    // GitHub signs no timestamp: no series for a refusal it cannot make.
    assert!(
        !text.contains(&rejected("github", "stale_timestamp")),
        "{text}"
    );

    // A forgery moves its series from 0 to 1.
    let body = stripe_invoice_paid(&unique("evt_forged"), 100);
    let forged = stripe_headers_signed(
        &body,
        "whsec_not_the_secret",
        hooklatch::core::Timestamp::now(),
    );
    let (status, _) = gw.post("stripe", &forged, body).await;
    assert_eq!(status, 401);
    assert_eq!(
        gw.metric(&rejected("stripe", "invalid_signature")).await,
        1.0
    );
}
