//! T9, source scoping, through a real gateway: the same event id on two Stripe accounts (two
//! sources, two secrets) and on GitHub is three events, claimed and delivered three times
//! under three `Idempotency-Key`s; a provider's retry on one source is a duplicate of that
//! source's own request, never answered from another's. In SQL mode and in Redis-keys mode.

use serde_json::Value;

use crate::support::{
    github_headers, stripe_headers, stripe_headers_signed, stripe_invoice_paid, unique, wait_until,
    Behaviour, Gateway, Handler, Options,
};

/// The second Stripe account's signing secret.
const EU_SECRET: &str = "whsec_e2e_second_stripe_account_0456";

/// Sends `ids` to `stripe`, to `stripe-eu` and to `github` (as a delivery id), then each a
/// second time; checks every answer and every delivery.
async fn scoped(backend: &str, options: Options) {
    let mut card = crate::report::Card::new("T9", backend);
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut options = options;
    options.extra_config.push_str(
        "[[sources]]\nname = \"stripe-eu\"\nprovider = \"stripe\"\nsecrets = [\"env:E2E_STRIPE_EU_SECRET\"]\ndestinations = [\"app\"]\n",
    );
    options
        .extra_env
        .push(("E2E_STRIPE_EU_SECRET".to_owned(), EU_SECRET.to_owned()));
    let gw = Gateway::start_with(&handler, options).await;
    let ids: Vec<String> = (0..crate::report::scaled(100))
        .map(|i| format!("{}_{i:03}", unique("evt_scope")))
        .collect();
    let send = async |source: &str, id: &str| -> Value {
        let (headers, body) = match source {
            "stripe-eu" => {
                let body = stripe_invoice_paid(id, 7000);
                (
                    stripe_headers_signed(&body, EU_SECRET, hooklatch_core::Timestamp::now()),
                    body,
                )
            }
            "github" => {
                let body = br#"{"ref":"refs/heads/main","commits":[]}"#.to_vec();
                (github_headers(&body, id), body)
            }
            _ => {
                let body = stripe_invoice_paid(id, 5000);
                (stripe_headers(&body), body)
            }
        };
        let (status, json) = gw.post(source, &headers, body).await;
        assert_eq!(status, 200, "{source} {id}: {json}");
        json
    };
    let number = |v: &Value| {
        v.as_str()
            .unwrap_or_default()
            .trim_start_matches("req_")
            .to_owned()
    };
    let sources = ["stripe", "stripe-eu", "github"];
    for id in &ids {
        let mut firsts = Vec::new();
        for source in sources {
            let first = send(source, id).await;
            assert_eq!(first["status"], "accepted", "{source} {id}: {first}");
            firsts.push(number(&first["request_id"]));
        }
        for (source, first) in sources.iter().zip(&firsts) {
            let again = send(source, id).await;
            assert_eq!(again["status"], "duplicate", "{source} {id}: {again}");
            assert_eq!(
                &number(&again["events"][0]["first_request"]),
                first,
                "{source} {id}: a duplicate of its own source's request"
            );
        }
    }
    let keys: Vec<String> = ids
        .iter()
        .flat_map(|id| sources.map(|source| format!("{source}:{id}")))
        .collect();
    wait_until("every event of every source delivered", || {
        keys.iter().all(|k| handler.count_for(k) >= 1)
    })
    .await;
    assert!(
        keys.iter().all(|k| handler.count_for(k) == 1),
        "each source's event delivered once, under its own key"
    );
    card.count("ops", 2 * keys.len())
        .count("acked", keys.len())
        .count("duplicates", 0)
        .figure("cross_source_hits", 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_event_id_on_three_sources_is_three_events_in_sql_mode() {
    scoped("sqlite", Options::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_event_id_on_three_sources_is_three_events_in_redis_mode() {
    let Ok(url) = std::env::var("HOOKLATCH_TEST_REDIS_URL") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but HOOKLATCH_TEST_REDIS_URL is not: the Redis tests must run"
        );
        println!("skipped: set HOOKLATCH_TEST_REDIS_URL to run source scoping in Redis mode");
        return;
    };
    let prefix = format!("hooklatch-e2e:{}:", unique("scope"));
    scoped(
        "redis",
        Options {
            extra_env: vec![
                ("HOOKLATCH_STORE__KEYS".to_owned(), url.clone()),
                ("HOOKLATCH_STORE__KEY_PREFIX".to_owned(), prefix.clone()),
            ],
            ..Options::default()
        },
    )
    .await;
    // The keys this test wrote (three per id, each kept for its source's retention).
    assert_eq!(
        crate::support::delete_redis_keys(&url, &prefix).await,
        3 * crate::report::scaled(100),
        "a key per source and id"
    );
}
