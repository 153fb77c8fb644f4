//! End-to-end tests of `hooklatch replay`, `hooklatch check` and `hooklatch events export`:
//! real `hooklatch serve` processes, the example credit service as a real process (naive,
//! check-then-insert and guarded, on SQLite and PostgreSQL), and a recording handler, all on
//! 127.0.0.1. They prove the replay-and-check issue's "Proof" list. No fixed sleeps: every
//! wait polls with a deadline; nothing asserts on timing.
//!
//! PostgreSQL tests read `HOOKLATCH_TEST_POSTGRES_URL` (each creates its own database); without
//! it they print "skipped" — and fail when `CI` is set.

mod replay_support;
#[path = "common/test_database.rs"]
mod test_database;

use base64::Engine;
use hooklatch_core::Timestamp;
use serde_json::Value;

use replay_support::*;
use test_database::TestDatabase;

/// A gateway that has ingested one Stripe event; returns it with the body, the ingest answer.
async fn gateway_with_one_event(destination: Option<&str>) -> (Gateway, Vec<u8>, Value) {
    let gateway = Gateway::start(destination, &[]).await;
    let body = stripe_body(&unique("evt"), 5000);
    let mut headers = stripe_headers(&body, Timestamp::now());
    headers.push((
        "authorization".to_owned(),
        "Basic dXNlcjpzM2NyZXQ=".to_owned(),
    ));
    let (status, answer) = gateway.post_stripe(&headers, &body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(answer["status"], "accepted", "{answer}");
    (gateway, body, answer)
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_ten_times_ten_at_once_reports_every_status_and_the_exit_code() {
    let sink = Recorder::start().await;
    let (gateway, body, answer) = gateway_with_one_event(Some(&sink.url)).await;
    let delivery = answer["events"][0]["deliveries"][0]
        .as_str()
        .expect("a delivery id")
        .to_owned();
    let handler = Recorder::start().await;

    // By delivery id: the request behind it, re-signed for the handler, 10 at once.
    let args = [
        "replay",
        &delivery,
        "--admin",
        &gateway.admin,
        "--to",
        &handler.url,
        "--times",
        "10",
        "--concurrency",
        "10",
        "--provider",
        "stripe",
        "--secret",
        STRIPE_SECRET,
        "--json",
    ];
    let out = hooklatch(&args).await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let report = json_of(&out);
    let replay = &report["replays"][0];
    assert_eq!(replay["sent"], 10, "{report:#}");
    assert_eq!(replay["statuses"]["200"], 10, "{report:#}");
    assert_eq!(replay["concurrency"], 10);
    assert!(replay["latency_ms"]["p99"].as_f64().is_some(), "{report:#}");
    let received = handler.received();
    assert_eq!(received.len(), 10);
    assert!(received.iter().all(|r| r.signature_valid && r.body == body));

    // Some answers are 500: reported, and the exit status says so.
    handler.fail_every(5);
    let out = hooklatch(&args).await;
    let replay = &first_replay(&out, 1);
    assert_eq!(replay["statuses"]["200"], 8, "{replay:#}");
    assert_eq!(replay["statuses"]["500"], 2, "{replay:#}");
    assert_eq!(replay["ok"], false);

    // The human report: a table of statuses, latency, and the failures.
    let text_args = &args[..args.len() - 1];
    let out = hooklatch(text_args).await;
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("STATUS  COUNT"), "{text}");
    assert!(text.contains("p50") && text.contains("p99"), "{text}");
    assert!(text.contains("failures 2 of 10"), "{text}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_old_capture_replays_with_resign_and_is_refused_with_original() {
    let gateway = Gateway::start(None, &[]).await;
    // Captured two hours ago: its signature is far outside Stripe's 300 s tolerance.
    let signed_at = Timestamp::now().minus(std::time::Duration::from_secs(7200));
    let event_id = unique("evt_old");
    let body = stripe_body(&event_id, 5000);
    let b64 = base64::engine::general_purpose::STANDARD;
    let headers: Vec<Value> = stripe_headers(&body, signed_at)
        .into_iter()
        .map(|(name, value)| serde_json::json!({ "name": name, "value": value }))
        .collect();
    let export = serde_json::json!({
        "hooklatch_export": 1,
        "captures": [{
            "request_id": "req_1", "source": "stripe", "provider": "stripe", "method": "POST",
            "path": "/in/stripe", "received_at_ms": signed_at.as_millis(), "keys": [event_id],
            "headers": headers, "body_base64": b64.encode(&body),
        }]
    });
    let file = gateway.dir().join("old.json");
    std::fs::write(&file, serde_json::to_vec(&export).unwrap()).unwrap();
    let file = file.to_str().unwrap();
    let config = gateway.config();
    let config = config.to_str().unwrap();

    let out = hooklatch(&[
        "replay",
        file,
        "--via-gateway",
        "--config",
        config,
        "--original",
        "--json",
    ])
    .await;
    let replay = &first_replay(&out, 1);
    assert_eq!(replay["statuses"]["401"], 1, "{replay:#}");
    assert_eq!(replay["answers"]["stale_timestamp"], 1, "{replay:#}");

    // Re-signed with the source's secret from the config: accepted, then duplicates.
    let out = hooklatch(&[
        "replay",
        file,
        "--via-gateway",
        "--config",
        config,
        "--resign",
        "--times",
        "3",
        "--json",
    ])
    .await;
    let replay = &first_replay(&out, 0);
    assert_eq!(replay["statuses"]["200"], 3, "{replay:#}");
    assert_eq!(replay["answers"]["accepted"], 1, "{replay:#}");
    assert_eq!(replay["answers"]["duplicate"], 2, "{replay:#}");

    // The default with a secret at hand is to re-sign, and it says so.
    let out = hooklatch(&["replay", file, "--via-gateway", "--config", config]).await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("re-signing"),
        "{}",
        show(&out)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("duplicate"),
        "{}",
        show(&out)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn export_then_replay_round_trips_byte_exact_without_secrets() {
    let (gateway, body, answer) = gateway_with_one_event(None).await;
    let request_id = answer["request_id"].as_str().unwrap().to_owned();
    let export = |file: std::path::PathBuf, keep_signatures: bool| {
        let mut args = vec![
            "events".to_owned(),
            "export".to_owned(),
            request_id.clone(),
            "--admin".to_owned(),
            gateway.admin.clone(),
            "--config".to_owned(),
            gateway.config().to_str().unwrap().to_owned(),
            "--out".to_owned(),
            file.to_str().unwrap().to_owned(),
        ];
        if keep_signatures {
            args.push("--keep-signatures".to_owned());
        }
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = hooklatch(&args).await;
            assert_eq!(out.status.code(), Some(0), "{}", show(&out));
            std::fs::read_to_string(&file).unwrap()
        }
    };
    // By default the provider's signature is left out as well.
    let unsigned = export(gateway.dir().join("unsigned.json"), false).await;
    assert!(
        !unsigned.to_ascii_lowercase().contains("stripe-signature"),
        "{unsigned}"
    );
    let file = gateway.dir().join("export.json");
    let text = export(file.clone(), true).await;
    let doc: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(doc["hooklatch_export"], 1);
    let capture = &doc["captures"][0];
    assert_eq!(capture["request_id"], request_id.as_str());
    assert_eq!(capture["provider"], "stripe");
    assert_eq!(capture["source"], "stripe");
    let b64 = base64::engine::general_purpose::STANDARD;
    assert_eq!(
        b64.decode(capture["body_base64"].as_str().unwrap())
            .unwrap(),
        body
    );
    // Neither the source's secret, the admin token nor the endpoint's credentials.
    for secret in [STRIPE_SECRET, ADMIN_TOKEN, "dXNlcjpzM2NyZXQ="] {
        assert!(!text.contains(secret), "{secret} exported:\n{text}");
        assert!(!unsigned.contains(secret), "{secret} exported:\n{unsigned}");
    }
    let captured_signature = capture["headers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|h| h["name"] == "stripe-signature")
        .expect("--keep-signatures keeps the provider's signature")["value"]
        .as_str()
        .unwrap()
        .to_owned();

    // On "a laptop": no gateway needed, the file is the capture.
    let laptop = tempfile::tempdir().unwrap();
    let copy = laptop.path().join("prod.json");
    std::fs::copy(&file, &copy).unwrap();
    drop(gateway);
    let handler = Recorder::start().await;
    // Each file replayed twice: re-signed with the secret (which must pass), then as captured.
    let replay_twice = |file: std::path::PathBuf| {
        let url = handler.url.clone();
        async move {
            let file = file.to_str().unwrap();
            let resigned = hooklatch(&[
                "replay",
                file,
                "--to",
                &url,
                "--provider",
                "stripe",
                "--secret",
                STRIPE_SECRET,
            ])
            .await;
            assert_eq!(resigned.status.code(), Some(0), "{}", show(&resigned));
            hooklatch(&["replay", file, "--to", &url, "--original"]).await
        }
    };
    let out = replay_twice(copy).await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let received = handler.received();
    assert_eq!(received.len(), 2);

    // The unsigned export is re-signed as well; sent as captured, replay says what is missing.
    let unsigned_copy = laptop.path().join("unsigned.json");
    std::fs::write(&unsigned_copy, &unsigned).unwrap();
    let out = replay_twice(unsigned_copy).await;
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("holds no signature header"),
        "{}",
        show(&out)
    );
    let unsigned_received = handler.received();
    assert_eq!(unsigned_received.len(), 4);
    assert!(unsigned_received[2].signature_valid);
    assert!(!unsigned_received[3].signature_valid);
    assert!(unsigned_received[3]
        .headers
        .get("stripe-signature")
        .is_none());

    for r in &received {
        assert_eq!(r.body, body, "the handler saw different bytes");
        assert!(r.signature_valid, "the handler saw an invalid signature");
        assert_eq!(r.headers["content-type"], "application/json");
        assert!(r.headers.get("authorization").is_none());
    }
    // --original sends the provider's signature exactly as captured.
    assert_eq!(
        received[1].headers["stripe-signature"],
        captured_signature.as_str()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn replay_explains_what_it_cannot_do() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let out = hooklatch(&[
        "replay",
        missing.to_str().unwrap(),
        "--to",
        "http://127.0.0.1:9/",
    ])
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("reading"),
        "{}",
        show(&out)
    );

    let file = dir.path().join("bad.json");
    std::fs::write(&file, r#"{"hooklatch_export": 9, "captures": []}"#).unwrap();
    let out = hooklatch(&[
        "replay",
        file.to_str().unwrap(),
        "--to",
        "http://127.0.0.1:9/",
        "--resign",
    ])
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("version 9"),
        "{}",
        show(&out)
    );
}

/// A forgery the gateway rejected is not re-signed into an accepted event: `replay` refuses
/// it unless `--resign-rejected`, sends it `--original` (refused again), and `check` refuses it.
#[tokio::test(flavor = "multi_thread")]
async fn a_rejected_request_is_not_re_signed_unless_asked() {
    let gateway = Gateway::start(None, &[]).await;
    let body = stripe_body(&unique("evt_forged"), 9900);
    let mut headers = stripe_headers(&body, Timestamp::now());
    for (name, value) in &mut headers {
        if name.eq_ignore_ascii_case("stripe-signature") {
            *value = value.replace("v1=", "v1=00");
        }
    }
    let (status, answer) = gateway.post_stripe(&headers, &body).await;
    assert_eq!(
        (status, answer["code"].as_str()),
        (401, Some("invalid_signature")),
        "{answer}"
    );
    // Its history record, the newest request.
    let out = hooklatch(&[
        "events",
        "list",
        "--admin",
        &gateway.admin,
        "--verdict",
        "rejected",
        "--json",
    ])
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let listed = json_of(&out);
    // One JSON object a line; the only rejected request here.
    let id = listed["id"]
        .as_str()
        .unwrap_or_else(|| panic!("a history record: {listed:#}"))
        .to_owned();
    let config = gateway.config();
    let config = config.to_str().unwrap();
    let replay = |extra: &'static [&'static str]| {
        let mut args = vec!["replay", id.as_str(), "--via-gateway", "--config", config];
        args.extend(extra);
        args.push("--json");
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            hooklatch(&args).await
        }
    };
    let out = replay(&[]).await;
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("was rejected when it came"), "{stderr}");
    assert!(stderr.contains("--resign-rejected"), "{stderr}");

    let out = replay(&["--original"]).await;
    let replayed = &first_replay(&out, 1);
    assert_eq!(replayed["answers"]["invalid_signature"], 1, "{replayed:#}");

    // Asked for, as when a genuine event was refused under a wrong secret: accepted.
    let out = replay(&["--resign-rejected"]).await;
    let replayed = &first_replay(&out, 0);
    assert_eq!(replayed["answers"]["accepted"], 1, "{replayed:#}");

    let out = hooklatch(&[
        "check",
        "--capture",
        &id,
        "--admin",
        &gateway.admin,
        "--config",
        config,
        "--to",
        "http://127.0.0.1:9/",
    ])
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("was rejected when it came"),
        "{}",
        show(&out)
    );
}

// ---------------------------------------------------------------------------------------------
// check

/// An export file with several captures: `check --request req_N` picks one (as `replay`
/// does); without it the error says how to name one.
#[tokio::test(flavor = "multi_thread")]
async fn check_picks_one_capture_of_an_export_with_request() {
    let (gateway, _, first) = gateway_with_one_event(None).await;
    let body = stripe_body(&unique("evt"), 700);
    let (status, second) = gateway
        .post_stripe(&stripe_headers(&body, Timestamp::now()), &body)
        .await;
    assert_eq!(status, 200, "{second}");
    let file = gateway.dir().join("two.json");
    let ids = [
        first["request_id"].as_str().unwrap(),
        second["request_id"].as_str().unwrap(),
    ];
    let out = hooklatch(&[
        "events",
        "export",
        ids[0],
        ids[1],
        "--admin",
        &gateway.admin,
        "--config",
        gateway.config().to_str().unwrap(),
        "--out",
        file.to_str().unwrap(),
    ])
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let check = |request: Option<&str>| {
        let mut args = vec![
            "check",
            "--capture",
            file.to_str().unwrap(),
            "--secret",
            STRIPE_SECRET,
            "--to",
            "http://127.0.0.1:9/",
        ];
        if let Some(id) = request {
            args.extend(["--request", id]);
        }
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        async move {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let out = hooklatch(&args).await;
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        }
    };
    let (code, stderr) = check(None).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("holds 2 captures") && stderr.contains("--request"),
        "{stderr}"
    );
    let (code, stderr) = check(Some("req_999999")).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("holds no capture req_999999"), "{stderr}");
    // The one named is checked: it goes as far as the handler (none runs here).
    let (code, stderr) = check(Some(ids[1])).await;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("no answer from the handler"), "{stderr}");
}

/// A handler that is not running is no handler to judge: `check` says it could not reach it
/// and exits 2 ("could not run"), instead of failing every phase with "the handler refused
/// the event".
#[tokio::test(flavor = "multi_thread")]
async fn check_against_no_handler_could_not_run() {
    let out = hooklatch(&[
        "check",
        "--provider",
        "stripe",
        "--secret",
        STRIPE_SECRET,
        "--to",
        "http://127.0.0.1:9/",
        "--times",
        "2",
    ])
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no answer from the handler at http://127.0.0.1:9/"),
        "{}",
        show(&out)
    );
    assert!(!stderr.contains("refused the event"), "{}", show(&out));
}

/// `hooklatch check` of a Stripe event against `service`, effects counted with `db`.
async fn check(service: &CreditService, db: &str, extra: &[&str]) -> std::process::Output {
    let url = service.url();
    let mut args = vec![
        "check",
        "--provider",
        "stripe",
        "--secret",
        STRIPE_SECRET,
        "--to",
        &url,
        "--times",
        "10",
        "--concurrency",
        "10",
        "--effects-sql",
        "SELECT count(*) FROM credits WHERE event_id = :key",
        "--db",
        db,
    ];
    args.extend_from_slice(extra);
    hooklatch(&args).await
}

/// The proof on one database: the naive handler fails with its count, the guarded one passes.
async fn naive_fails_and_guarded_passes(db: &str) {
    let naive = CreditService::start(db, "naive", 0).await;
    let out = check(&naive, db, &["--json"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let report = json_of(&out);
    let sequential = &report["phases"][0];
    assert_eq!(sequential["name"], "sequential");
    assert_eq!(sequential["ok"], false, "{report:#}");
    assert_eq!(sequential["before"], 0);
    assert_eq!(sequential["after"], 10, "{report:#}");
    let failure = sequential["failures"][0].as_str().unwrap();
    assert!(
        failure.contains("10 deliveries produced 10 effects: no dedup at all"),
        "{failure}"
    );
    assert_eq!(report["phases"][1]["after"], 10, "{report:#}");
    assert_eq!(report["phases"][2]["name"], "late replay");
    assert_eq!(report["phases"][2]["after"], 11, "{report:#}");
    // The later phases point at phase 1 rather than guess at a guard that is not there.
    for phase in [1, 2] {
        let failure = report["phases"][phase]["failures"][0].as_str().unwrap();
        assert!(
            failure.ends_with("no dedup at all (see phase 1)"),
            "{failure}"
        );
    }
    // The human report names the phase and the count.
    let out = check(&naive, db, &[]).await;
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("FAIL  1. sequential"), "{text}");
    assert!(text.contains("0 → 10"), "{text}");
    assert!(text.contains("FAILED"), "{text}");
    drop(naive);

    let guarded = CreditService::start(db, "guarded", 0).await;
    let out = check(&guarded, db, &["--conflict", "--json"]).await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let report = json_of(&out);
    assert_eq!(report["ok"], true, "{report:#}");
    let names: Vec<&str> = report["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        ["sequential", "concurrent", "late replay", "conflict"]
    );
    for phase in report["phases"].as_array().unwrap() {
        assert_eq!(phase["after"], 1, "{phase:#}");
        assert!(
            phase["failures"].as_array().unwrap().is_empty(),
            "{phase:#}"
        );
    }
    assert_eq!(report["phases"][0]["statuses"]["200"], 10);
    assert_eq!(report["phases"][1]["statuses"]["200"], 10);
}

/// `replay --as-delivered` sends a capture as the gateway delivers it to a destination without
/// a secret: `Idempotency-Key` and the `hooklatch-*` headers, which a handler keyed on the
/// key needs, no Standard Webhooks signature, and Stripe's signature made again as it is sent
/// with `--config`'s secret (the capture's own is four minutes old).
#[tokio::test(flavor = "multi_thread")]
async fn replay_as_delivered_carries_the_idempotency_key_and_a_fresh_provider_signature() {
    let gateway = Gateway::start(None, &[]).await;
    let event = unique("evt_as_delivered");
    let body = stripe_body(&event, 5000);
    let signed_at = Timestamp::from_secs(Timestamp::now().as_secs() - 250);
    let (status, answer) = gateway
        .post_stripe(&stripe_headers(&body, signed_at), &body)
        .await;
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("accepted")),
        "{answer}"
    );
    let request = answer["request_id"]
        .as_str()
        .expect("a request id")
        .to_owned();
    let handler = Recorder::start().await;
    let config = gateway.config();
    let out = hooklatch(&[
        "replay",
        &request,
        "--config",
        config.to_str().expect("a UTF-8 path"),
        "--to",
        &handler.url,
        "--as-delivered",
        "--json",
    ])
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let received = handler.received();
    assert_eq!(received.len(), 1);
    let got = &received[0];
    let header = |name: &str| {
        got.headers
            .get(name)
            .map(|v| v.to_str().unwrap_or_default().to_owned())
    };
    assert_eq!(header("idempotency-key"), Some(format!("stripe:{event}")));
    assert_eq!(header("hooklatch-attempt").as_deref(), Some("1"));
    assert_eq!(header("webhook-signature"), None);
    assert!(got.signature_valid && got.body == body);
    let signature = header("stripe-signature").unwrap_or_default();
    let t: i64 = signature
        .strip_prefix("t=")
        .and_then(|rest| rest.split(',').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("a Stripe signature: {signature}"));
    assert!(
        t >= signed_at.as_secs() + 250,
        "made as it was sent: {signature}"
    );
}

/// A handler behind hooklatch that verifies the gateway's signature (`VerifiedDelivery`):
/// `check --destination-secret` sends as the gateway delivers, and it passes; without it
/// every request is refused, and `check` says so.
#[tokio::test(flavor = "multi_thread")]
async fn check_sends_as_the_gateway_delivers_to_a_handler_that_verifies_it() {
    const DESTINATION_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("app.db").display());
    let service =
        CreditService::start_with(&db, "guarded", 0, &["--secret", DESTINATION_SECRET]).await;
    let out = check(
        &service,
        &db,
        &[
            "--destination-secret",
            DESTINATION_SECRET,
            "--conflict",
            "--json",
        ],
    )
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let report = json_of(&out);
    assert_eq!(report["ok"], true, "{report:#}");
    assert!(
        report["signing"]
            .as_str()
            .is_some_and(|s| s.starts_with("as the gateway delivers")),
        "{report:#}"
    );
    for phase in report["phases"].as_array().unwrap() {
        assert_eq!(phase["after"], 1, "{phase:#}");
    }

    // Signed as the provider signs, the handler refuses every request.
    let out = check(&service, &db, &["--json"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let failure = json_of(&out)["phases"][0]["failures"][0]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        failure.starts_with("the handler refused the event (401"),
        "{failure}"
    );

    // A destination secret that cannot be one is refused before anything is sent.
    let out = check(
        &service,
        &db,
        &["--destination-secret", "whsec_not base64!"],
    )
    .await;
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
}

#[tokio::test(flavor = "multi_thread")]
async fn check_fails_on_the_naive_handler_and_passes_on_the_guarded_one_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("app.db").display());
    naive_fails_and_guarded_passes(&db).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn check_fails_on_the_naive_handler_and_passes_on_the_guarded_one_postgres() {
    let Some(db) = TestDatabase::create(&unique("hooklatch_replay")).await else {
        return;
    };
    naive_fails_and_guarded_passes(&db.url()).await;
    db.drop_now().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn check_names_the_race_of_a_check_then_insert_handler() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("app.db").display());
    // Work between the check and the insert keeps the race window open wide enough for ten
    // simultaneous deliveries to all pass the check (how wide it is changes nothing else).
    let service = CreditService::start(&db, "check-then-insert", 300).await;
    let out = check(&service, &db, &["--json"]).await;
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let report = json_of(&out);
    assert_eq!(report["phases"][0]["ok"], true, "{report:#}");
    let concurrent = &report["phases"][1];
    assert_eq!(concurrent["ok"], false, "{report:#}");
    let failure = concurrent["failures"][0].as_str().unwrap();
    assert!(
        failure.contains("the check-then-insert races under concurrency"),
        "{failure}"
    );
    assert!(failure.starts_with("10 deliveries produced"), "{failure}");
}

/// A Twilio voice webhook sent as GET, behind a proxy (`public_url`): replayed through the
/// gateway it is signed for the URL the gateway checks, and straight at a handler it keeps
/// its query, where its parameters are.
#[tokio::test(flavor = "multi_thread")]
async fn a_twilio_get_replays_through_the_gateway_and_to_a_handler_with_its_query() {
    use hooklatch_core::provider::Twilio;
    use hooklatch_core::ProviderAdapter;
    const TOKEN: &str = "twilio-replay-auth-token";
    const PUBLIC: &str = "https://hooks.example.com";
    let source = format!(
        "[[sources]]\nname = \"twilio\"\nprovider = \"twilio\"\nsecrets = [\"{TOKEN}\"]\npublic_url = \"{PUBLIC}\"\n"
    );
    let gateway = Gateway::start_with(None, &[], &source).await;
    let query = format!(
        "CallSid={}&CallStatus=ringing&From=%2B14158675309",
        unique("CA")
    );
    let path = format!("/in/twilio?{query}");
    // Twilio's signature of a GET to `url`.
    let twilio_signs = |url: &str| {
        let signed = Twilio::default().sign(&hooklatch_core::provider::SignRequest {
            url,
            body: b"",
            secret: &hooklatch_core::Secret::from_text(TOKEN),
            now: Timestamp::now(),
            event_key: "",
            event_type: None,
        });
        signed[0].1.clone()
    };
    // As Twilio signs it: the public URL it calls.
    let client = reqwest::Client::new();
    let res = client
        .get(format!("{}{path}", gateway.ingest))
        .header(
            "x-twilio-signature",
            twilio_signs(&format!("{PUBLIC}{path}")),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let listed: Value = client
        .get(format!("{}/v1/requests?source=twilio", gateway.admin))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let request_id = listed["items"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("one request: {listed}"))
        .to_owned();
    let config = gateway.config();
    let config = config.to_str().unwrap();

    // Through the gateway, re-signed from its config: checked against the public URL and
    // answered as the duplicate it is.
    let out = hooklatch(&[
        "replay",
        &request_id,
        "--config",
        config,
        "--admin",
        &gateway.admin,
        "--via-gateway",
        "--gateway",
        &gateway.ingest,
        "--times",
        "3",
        "--json",
    ])
    .await;
    let replay = &first_replay(&out, 0);
    assert_eq!(replay["answers"]["duplicate"], 3, "{replay:#}");

    // Straight at a handler: a GET with the captured query.
    let handler = Recorder::start().await;
    let out = hooklatch(&[
        "replay",
        &request_id,
        "--admin",
        &gateway.admin,
        "--to",
        &handler.url,
        "--provider",
        "twilio",
        "--secret",
        TOKEN,
    ])
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let received = handler.received();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].method, "GET");
    assert_eq!(received[0].uri, format!("/webhooks/stripe?{query}"));

    // Straight at a handler, re-signed from the gateway's config: signed for the URL it was
    // sent to (what the handler checks), not for the gateway's public URL.
    let handler = Recorder::start().await;
    let out = hooklatch(&[
        "replay",
        &request_id,
        "--config",
        config,
        "--admin",
        &gateway.admin,
        "--to",
        &handler.url,
    ])
    .await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let sent_to = format!("{}?{query}", handler.url);
    let received = handler.received();
    assert_eq!(received.len(), 1);
    assert_eq!(
        received[0]
            .headers
            .get("x-twilio-signature")
            .map(|v| v.as_bytes()),
        Some(twilio_signs(&sent_to).as_bytes()),
        "signed for {sent_to}"
    );
}
