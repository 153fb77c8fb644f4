//! Deliberate redelivery from history: it bypasses dedup on purpose, is recorded with its own
//! delivery id, and carries the original `Idempotency-Key`, so the handler's guard decides. A
//! second one is never swallowed. Through the admin API and through `hooklatch events
//! redeliver`.

use std::process::Command;

use crate::support::{
    eventually, hooklatch, stripe_headers, stripe_invoice_paid, stripe_invoice_paid_padded, unique,
    wait_until, Behaviour, Gateway, Handler, ADMIN_TOKEN,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redelivering_twice_makes_two_recorded_deliveries_with_the_original_key() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start(&handler).await;
    let id = unique("evt_redeliver");
    let key = format!("stripe:{id}");
    let body = stripe_invoice_paid(&id, 5000);
    let (status, answer) = gateway
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("accepted")));
    let request = answer["request_id"]
        .as_str()
        .expect("request_id")
        .to_owned();
    gateway.wait_for_delivery_state(&key, "delivered").await;

    // Once through the admin API…
    let (status, first) = gateway
        .admin_post(&format!("/v1/requests/{request}/redeliver"))
        .await;
    assert_eq!(status, 202, "{first}");
    // …and once through the CLI.
    let out = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args([
            "events",
            "redeliver",
            &request,
            "--admin",
            &gateway.admin_url(),
        ])
        .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("running hooklatch events redeliver");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(printed.contains("redelivery queued as dlv_"), "{printed}");

    wait_until("three deliveries of the event", || {
        handler.count_for(&key) == 3
    })
    .await;
    let received = handler.received_for(&key);
    assert!(
        received.iter().all(|r| r.body == body),
        "the same bytes every time"
    );
    let ids: Vec<&str> = received
        .iter()
        .map(|r| r.header("hooklatch-delivery-id"))
        .collect();
    let distinct: std::collections::HashSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), 3, "each redelivery has its own id: {ids:?}");
    assert!(ids.contains(&first["deliveries"][0].as_str().expect("id")));

    eventually(
        "the request lists its three delivered deliveries",
        async || {
            let (_, detail) = gateway.admin_get(&format!("/v1/requests/{request}")).await;
            let deliveries = detail["deliveries"].as_array().cloned().unwrap_or_default();
            deliveries.len() == 3
                && deliveries.iter().all(|d| {
                    d["state"] == "delivered" && d["idempotency_key"].as_str() == Some(key.as_str())
                })
        },
    )
    .await;

    // A refused request has nothing to redeliver; an unknown one is not found.
    let (status, _) = gateway.post("stripe", &[], body.clone()).await;
    assert_eq!(status, 401);
    let rejected = gateway.requests("verdict=rejected").await;
    let rejected_id = rejected[0]["id"].as_str().expect("id").to_owned();
    let (status, answer) = gateway
        .admin_post(&format!("/v1/requests/{rejected_id}/redeliver"))
        .await;
    assert_eq!(
        (status, answer["code"].as_str()),
        (409, Some("nothing_to_redeliver"))
    );
    // Nor has one refused for naming no source (which has no destination either).
    let (status, _) = gateway.post("nowhere", &[], body.clone()).await;
    assert_eq!(status, 404);
    let unknown = gateway.requests("source=nowhere").await;
    let unknown_id = unknown[0]["id"].as_str().expect("id").to_owned();
    let (status, answer) = gateway
        .admin_post(&format!("/v1/requests/{unknown_id}/redeliver"))
        .await;
    assert_eq!(
        (status, answer["code"].as_str()),
        (409, Some("nothing_to_redeliver")),
        "{answer}"
    );
    let (status, _) = gateway
        .admin_post("/v1/requests/req_999999/redeliver")
        .await;
    assert_eq!(status, 404);
}

/// Export from one gateway → import into another → redeliver there: the second gateway's
/// handler gets the identical bytes with the original `Idempotency-Key`, and the import itself
/// claims nothing (the same event arriving for real is still new there).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exported_capture_imported_elsewhere_redelivers_byte_exact() {
    let production = Handler::start(Behaviour::AlwaysOk).await;
    let prod = Gateway::start(&production).await;
    let id = unique("evt_import");
    let key = format!("stripe:{id}");
    let body = stripe_invoice_paid(&id, 5000);
    let (status, answer) = prod
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!(status, 200, "{answer}");
    let request = answer["request_id"]
        .as_str()
        .expect("request_id")
        .to_owned();

    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("captures.json");
    let file_arg = file.to_str().expect("utf-8 path");
    hooklatch(
        &["events", "export", &request, "--out", file_arg],
        &prod.admin_url(),
    );
    let exported = std::fs::read_to_string(&file).expect("the export file");
    assert!(!exported.contains(ADMIN_TOKEN), "no token in an export");
    assert!(
        !exported.contains("stripe-signature"),
        "no provider signature in an export by default"
    );

    let laptop_handler = Handler::start(Behaviour::AlwaysOk).await;
    let laptop = Gateway::start(&laptop_handler).await;
    let imported = hooklatch(&["events", "import", file_arg], &laptop.admin_url());
    let imported_id = imported
        .split_whitespace()
        .next()
        .expect("an imported id")
        .to_owned();
    assert!(imported_id.starts_with("req_"), "{imported}");
    let listed = laptop.requests("verdict=imported").await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["keys"][0].as_str(), Some(id.as_str()));
    // The same file again (a script run twice) leaves history as it was.
    assert_eq!(
        imported.trim(),
        format!("{imported_id} (from {request})"),
        "the id here, and the one it had where it was exported"
    );
    let again = hooklatch(&["events", "import", file_arg], &laptop.admin_url());
    assert_eq!(
        again.trim(),
        format!("{imported_id} (from {request}) (imported before)")
    );
    assert_eq!(laptop.requests("verdict=imported").await.len(), 1);
    assert!(
        laptop.deliveries("").await.is_empty(),
        "an import queues nothing"
    );

    hooklatch(&["events", "redeliver", &imported_id], &laptop.admin_url());
    wait_until("the laptop's handler got the event", || {
        laptop_handler.count_for(&key) == 1
    })
    .await;
    let got = &laptop_handler.received_for(&key)[0];
    assert_eq!(got.body, body, "byte-exact");
    // The export left the provider's signature out, so none is forwarded (a destination with
    // a `signing_secret` carries the laptop gateway's own signature instead).
    assert_eq!(got.header("stripe-signature"), "");

    // The import claimed nothing: the same event arriving for real is new on the laptop.
    let (status, answer) = laptop
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("accepted")));
}

/// A capture whose body is over the importing gateway's `body_limit` is refused, naming the
/// limit, and nothing of the file is stored: ingest would have refused that body, and a
/// redelivery would send the application what the gateway never takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_over_the_body_limit_is_refused_whole() {
    use base64::Engine;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(
        &handler,
        crate::support::Options {
            body_limit: Some("1KiB"),
            ..crate::support::Options::default()
        },
    )
    .await;
    let capture = |id: &str, size: usize| {
        let body = stripe_invoice_paid_padded(id, 100, size);
        serde_json::json!({
            "source": "stripe",
            "keys": [id],
            "body_base64": base64::engine::general_purpose::STANDARD.encode(body),
        })
    };
    let doc = serde_json::json!({
        "hooklatch_export": 1,
        "captures": [capture("evt_small", 0), capture("evt_large", 2048)],
    });
    let dir = tempfile::tempdir().expect("temp dir");
    let file = dir.path().join("captures.json");
    std::fs::write(&file, doc.to_string()).expect("writing the file");
    let out = crate::support::hooklatch_output(
        &["events", "import", file.to_str().expect("utf-8 path")],
        &gateway.admin_url(),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The gateway's "no" to the file: exit status 1, as for any refusal.
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("captures[1]: its body is") && stderr.contains("body_limit of 1024 bytes"),
        "{stderr}"
    );
    assert!(gateway.requests("verdict=imported").await.is_empty());

    // A header no request can carry is refused at import, not on every delivery after it.
    let mut bad_header = capture("evt_bad_header", 0);
    bad_header["headers"] =
        serde_json::json!([{ "name": "bad name\r\nx-injected: 1", "value": "1" }]);
    let import = |captures: serde_json::Value| {
        let doc = serde_json::json!({ "hooklatch_export": 1, "captures": captures });
        std::fs::write(&file, doc.to_string()).expect("writing the file");
        crate::support::hooklatch_output(
            &["events", "import", file.to_str().expect("utf-8 path")],
            &gateway.admin_url(),
        )
    };
    let out = import(serde_json::json!([bad_header]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("is not an HTTP header name"), "{stderr}");
    assert!(gateway.requests("verdict=imported").await.is_empty());

    // An export holds the requests the gateway refused too (no event key): skipped, said,
    // and the rest imported.
    let mut refused = capture("evt_refused", 0);
    refused["keys"] = serde_json::json!([]);
    refused["request_id"] = serde_json::json!("req_41");
    let out = import(serde_json::json!([refused, capture("evt_small", 0)]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(
        stderr.contains("skipped req_41: refused when it came"),
        "{stderr}"
    );
    assert_eq!(gateway.requests("verdict=imported").await.len(), 1);
}

/// `hooklatch events list`: the history newest first, one line per request with its verdict
/// and the refusal's code, filtered as the admin API filters, and as JSON lines for scripts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_list_shows_the_history_with_verdicts_and_filters() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start(&handler).await;
    let id = unique("evt_list");
    let body = stripe_invoice_paid(&id, 5000);
    for _ in 0..2 {
        let (status, _) = gateway
            .post("stripe", &stripe_headers(&body), body.clone())
            .await;
        assert_eq!(status, 200);
    }
    let forged = vec![("stripe-signature".to_owned(), "t=1,v1=00".to_owned())];
    let (status, _) = gateway.post("stripe", &forged, body.clone()).await;
    assert!(status >= 400);

    let list = |args: &[&str]| {
        let args: Vec<&str> = ["events", "list"].iter().chain(args).copied().collect();
        hooklatch(&args, &gateway.admin_url())
    };
    let all = list(&[]);
    let mut lines: Vec<&str> = all.lines().collect();
    assert!(
        lines
            .first()
            .is_some_and(|h| h.starts_with("ID") && h.contains("VERDICT")),
        "a header row first: {all}"
    );
    lines.remove(0);
    assert_eq!(lines.len(), 3, "{all}");
    assert!(
        lines[0].contains("rejected (invalid_signature)"),
        "newest first: {all}"
    );
    assert!(
        lines[1].contains("duplicate") && lines[1].contains(&id),
        "{all}"
    );
    assert!(
        lines[2].contains("accepted") && lines[2].contains(&id),
        "{all}"
    );

    let json = list(&["--verdict", "duplicate", "--json"]);
    let items: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(items.len(), 1, "{json}");
    assert_eq!(items[0]["verdict"], "duplicate");
    assert_eq!(items[0]["keys"][0], id.as_str());
    assert_eq!(list(&["--key", &id, "--limit", "1"]).lines().count(), 2);
}
