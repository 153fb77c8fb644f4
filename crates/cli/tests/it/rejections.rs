//! Every way ingest refuses a request, and the conflict it holds instead of refusing.
//!
//! Proves, for each refusal, the HTTP status, the JSON `code`, that history recorded the
//! request as rejected with that code as its reason, and that nothing was claimed or queued:
//! no outbox row appears, and a genuine event with the same id sent afterwards is accepted as
//! new and delivered once. Oversized bodies are refused before they are read in full, whether
//! declared by Content-Length or streamed in chunks. A validly signed delivery reusing a key
//! with a different body is answered 2xx as a `conflict`, kept, counted, and not forwarded.
//! The admin API refuses every request without its bearer token.

use reqwest::Method;
use serde_json::{json, Value};

use crate::support::{
    eventually, github_headers, header, raw_post, stripe_headers, stripe_invoice_paid,
    stripe_invoice_paid_padded, unique, Behaviour, Gateway, Handler, Options, ADMIN_TOKEN,
};

/// Options with a 2 KiB body limit: a normal event fits, a padded one does not.
fn small_body_limit() -> Options {
    Options {
        body_limit: Some("2KiB"),
        ..Options::default()
    }
}

/// Checks a refusal: its status and code, its history record, and that nothing was queued.
async fn assert_refused(gw: &Gateway, reply: (u16, Value), status: u16, code: &str) {
    let (got_status, body) = reply;
    assert_eq!(got_status, status, "{body}");
    assert_eq!(body["code"], code, "{body}");
    assert!(body["message"].is_string(), "{body}");
    let rejected = gw.requests("verdict=rejected").await;
    let newest = rejected.first().expect("the refusal is in history");
    assert_eq!(newest["reason"], code, "{newest}");
    assert_eq!(newest["status"], status, "{newest}");
    assert_eq!(newest["keys"], json!([]), "{newest}");
    assert!(gw.deliveries("").await.is_empty(), "nothing was queued");
    assert!(
        gw.requests("verdict=accepted").await.is_empty(),
        "nothing was claimed"
    );
}

/// Sends the genuine Stripe event `event_id` and checks it is new, queued once and delivered.
async fn assert_genuine_event_is_accepted(gw: &Gateway, handler: &Handler, event_id: &str) {
    let key = format!("stripe:{event_id}");
    let body = stripe_invoice_paid(event_id, 5000);
    let (status, json) = gw
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "accepted", "{json}");
    assert_eq!(json["events"][0]["claim"], "new", "{json}");
    gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(
        gw.deliveries("").await.len(),
        1,
        "only the genuine event was queued"
    );
    assert_eq!(handler.count_for(&key), 1);
    assert_eq!(handler.received_for(&key)[0].body, body);
}

/// A provider's dashboard takes the URL as typed: `/in/stripe/` is the Stripe source too, not a
/// 404 that leaves the provider's retries nowhere in history.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ingest_url_with_a_trailing_slash_is_the_same_source() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_slash");
    let body = stripe_invoice_paid(&event_id, 5000);
    let (status, json) = gw
        .post("stripe/", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );
    let (status, json) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("duplicate")),
        "{json}"
    );
    gw.wait_for_delivery_state(&format!("stripe:{event_id}"), "delivered")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_source_is_refused_with_404_and_claims_nothing() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_nowhere");
    let body = stripe_invoice_paid(&event_id, 5000);

    let reply = gw.post("strype", &stripe_headers(&body), body).await;
    assert_refused(&gw, reply, 404, "unknown_source").await;
    assert_eq!(gw.requests("verdict=rejected").await[0]["source"], "strype");
    assert_genuine_event_is_accepted(&gw, &handler, &event_id).await;
}

/// What anyone can send unsigned costs the store little: a refused request's body is kept up
/// to `refused_body_limit` (64 KiB by default), marked cut short — a bad signature and an
/// unknown source alike — while a body within it is kept whole, and an accepted event of any
/// size within `body_limit` byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_body_is_kept_up_to_the_refused_body_limit() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_large_refused");
    let large = stripe_invoice_paid_padded(&event_id, 5000, 200 << 10);
    let forged = vec![("stripe-signature".to_owned(), "t=1,v1=00".to_owned())];
    let detail = async |source: &str, body: &[u8]| -> Value {
        let (status, answer) = gw.post(source, &forged, body.to_vec()).await;
        assert!(status == 401 || status == 404, "{status} {answer}");
        let listed = gw.requests(&format!("source={source}")).await;
        let id = listed[0]["id"].as_str().expect("an id").to_owned();
        gw.admin_get(&format!("/v1/requests/{id}")).await.1
    };
    for source in ["stripe", "scanner"] {
        let kept = detail(source, &large).await;
        assert_eq!(kept["body_truncated"], true, "{source}");
        assert_eq!(kept["body_len"], 64 << 10, "{source}");
    }
    let small = stripe_invoice_paid(&event_id, 5000);
    let kept = detail("stripe", &small).await;
    assert_eq!(kept["body_truncated"], false);
    assert_eq!(kept["body_len"], small.len());

    let (status, answer) = gw
        .post("stripe", &stripe_headers(&large), large.clone())
        .await;
    assert_eq!(
        (status, answer["status"].as_str()),
        (200, Some("accepted")),
        "{answer}"
    );
    let (_, accepted) = gw
        .admin_get(&format!(
            "/v1/requests/{}",
            answer["request_id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(accepted["body_truncated"], false);
    assert_eq!(accepted["body_len"], large.len());
}

/// A `{source}` whose percent-decoded bytes are not UTF-8 (found by `scripts/fuzz`): refused
/// as the unknown source it is, in JSON and recorded, as any other name; before, axum's path
/// extractor answered a plain-text 400 and nothing was recorded. The admin API's ids likewise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_name_that_is_not_utf8_is_refused_as_unknown_in_json_and_recorded() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let (status, _, body) = gw
        .ingest()
        .request(Method::POST, "/in/stri%FFpe", "{\"id\":\"evt_x\"}")
        .await;
    assert_refused(&gw, (status, body), 404, "unknown_source").await;
    assert_eq!(
        gw.requests("verdict=rejected").await[0]["source"],
        "stri\u{FFFD}pe"
    );
    for path in ["/v1/requests/%FF", "/v1/deliveries/%C3%28"] {
        let (status, body) = gw.admin_get(path).await;
        assert_eq!(status, 404, "{path}: {body}");
        assert!(body["code"].is_string(), "{path}: {body}");
        assert!(body["message"].is_string(), "{path}: {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_method_on_a_source_is_refused_with_405_in_json_and_recorded_with_its_body() {
    // GET is a method of its own here (subscription checks, Twilio's voice webhooks); the GET
    // case was found by the `wire` fuzz target: its body was dropped unread, and history said
    // the request had none. No provider sends one; the record must still be what came.
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    for method in [Method::PUT, Method::GET] {
        let (status, allow, body) = gw
            .ingest()
            .request(method.clone(), "/in/stripe", "{\"id\":\"evt_put\"}")
            .await;
        // A Stripe source answers no GET at all: POST is all it allows.
        assert_eq!(allow.as_deref(), Some("POST"), "{method}");
        assert_refused(&gw, (status, body), 405, "method_not_allowed").await;
        // Recorded with its method and its body, newest first.
        let recorded = gw.requests("verdict=rejected").await;
        assert_eq!(recorded[0]["body_len"], 16, "{method}: {}", recorded[0]);
        let id = recorded[0]["id"].as_str().expect("an id");
        let (_, detail) = gw.admin_get(&format!("/v1/requests/{id}")).await;
        assert_eq!(detail["method"], method.as_str(), "{detail}");
        assert_eq!(detail["body"], "{\"id\":\"evt_put\"}", "{detail}");
        assert_eq!(detail["body_truncated"], false, "{detail}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_other_path_is_answered_404_in_json_and_left_out_of_history() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    for (method, path) in [
        (reqwest::Method::GET, "/"),
        (reqwest::Method::POST, "/wp-login.php"),
        (reqwest::Method::POST, "/in"),
        (reqwest::Method::POST, "/in/stripe/extra"),
    ] {
        let (status, _, body) = gw.ingest().request(method, path, "").await;
        assert_eq!(status, 404, "{path}: {body}");
        assert_eq!(body["code"], "not_found", "{path}: {body}");
        assert!(body["message"].is_string(), "{path}: {body}");
    }
    assert!(gw.requests("").await.is_empty(), "nothing in history");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_declared_over_the_limit_is_refused_with_413_before_it_is_sent() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(&handler, small_body_limit()).await;
    let event_id = unique("evt_large");
    let large = stripe_invoice_paid_padded(&event_id, 5000, 64 * 1024);
    let signature = header(&stripe_headers(&large), "stripe-signature").to_owned();

    // Content-Length says 64 KiB; only the first 100 bytes are ever sent, and the answer
    // must come anyway (the gateway's body timeout is 60 s, the wait 30 s).
    let head = format!(
        "POST /in/stripe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Stripe-Signature: {signature}\r\nContent-Length: {}",
        large.len()
    );
    let reply = raw_post(gw.ingest().addr(), &head, &[&large[..100]]).await;
    assert_refused(&gw, reply, 413, "body_too_large").await;

    // An ordinary client sending the whole body gets the same answer.
    let reply = gw.post("stripe", &stripe_headers(&large), large).await;
    assert_refused(&gw, reply, 413, "body_too_large").await;

    let rejected = gw.requests("verdict=rejected").await;
    let (_, detail) = gw
        .admin_get(&format!(
            "/v1/requests/{}",
            rejected[0]["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(detail["body_truncated"], true, "{detail}");
    assert_genuine_event_is_accepted(&gw, &handler, &event_id).await;
}

/// The default limit, 1 MiB, end to end: a body one byte over it is refused with 413, and so
/// is one declared at 64 MiB of which nothing is sent (at once: the test waits 30 s at most,
/// the body timeout is 60 s); a body of exactly 1 MiB under the same id is then accepted and
/// delivered byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_limit_takes_exactly_1_mib_and_refuses_one_byte_more() {
    const MIB: usize = 1024 * 1024;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_mib");
    let sized = |len: usize| {
        let bare = stripe_invoice_paid_padded(&event_id, 5000, 0).len();
        let body = stripe_invoice_paid_padded(&event_id, 5000, len - bare);
        assert_eq!(body.len(), len);
        body
    };

    let over = sized(MIB + 1);
    let reply = gw.post("stripe", &stripe_headers(&over), over).await;
    assert_refused(&gw, reply, 413, "body_too_large").await;

    let declared = sized(MIB);
    let signature = header(&stripe_headers(&declared), "stripe-signature").to_owned();
    let head = format!(
        "POST /in/stripe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Stripe-Signature: {signature}\r\nContent-Length: {}",
        64 * MIB
    );
    let reply = raw_post(gw.ingest().addr(), &head, &[]).await;
    assert_refused(&gw, reply, 413, "body_too_large").await;

    let body = sized(MIB);
    let key = format!("stripe:{event_id}");
    let (status, json) = gw
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "accepted", "{json}");
    gw.wait_for_delivery_state(&key, "delivered").await;
    let received = handler.received_for(&key);
    assert_eq!(received.len(), 1);
    assert!(
        received[0].body == body,
        "the 1 MiB body delivered byte-exact"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_crossing_the_limit_is_refused_with_413_without_reading_the_rest() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(&handler, small_body_limit()).await;
    let event_id = unique("evt_chunked");
    let large = stripe_invoice_paid_padded(&event_id, 5000, 64 * 1024);
    let signature = header(&stripe_headers(&large), "stripe-signature").to_owned();

    // Six 512-byte chunks (3 KiB, past the 2 KiB limit) and never the end of the body.
    let chunks: Vec<Vec<u8>> = large
        .chunks(512)
        .take(6)
        .map(|c| [format!("{:x}\r\n", c.len()).as_bytes(), c, b"\r\n"].concat())
        .collect();
    let parts: Vec<&[u8]> = chunks.iter().map(Vec::as_slice).collect();
    let head = format!(
        "POST /in/stripe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Stripe-Signature: {signature}\r\nTransfer-Encoding: chunked"
    );
    let reply = raw_post(gw.ingest().addr(), &head, &parts).await;
    assert_refused(&gw, reply, 413, "body_too_large").await;
    assert_genuine_event_is_accepted(&gw, &handler, &event_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validly_signed_stripe_body_that_is_not_json_is_refused_with_400() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_form");
    let body =
        format!("id={event_id}&type=invoice.payment_succeeded&amount_paid=5000").into_bytes();

    let reply = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_refused(&gw, reply, 400, "invalid_json").await;
    assert_genuine_event_is_accepted(&gw, &handler, &event_id).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validly_signed_stripe_event_without_an_id_is_refused_with_400() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let body = br#"{"object":"event","type":"invoice.payment_succeeded","data":{"object":{"amount_paid":5000}}}"#;

    let reply = gw
        .post("stripe", &stripe_headers(body), body.to_vec())
        .await;
    assert_refused(&gw, reply, 400, "missing_event_key").await;
    assert_genuine_event_is_accepted(&gw, &handler, &unique("evt_keyed")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_validly_signed_github_delivery_without_its_delivery_id_is_refused_with_400() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let delivery_id = unique("72d3162e-cc78-11e3-81ab");
    let body = br#"{"ref":"refs/heads/main","before":"6113728f","after":"59b20b8d","repository":{"full_name":"octo/hello"}}"#;
    let signed = github_headers(body, &delivery_id);
    let without_id: Vec<(String, String)> = signed
        .iter()
        .filter(|(name, _)| !name.eq_ignore_ascii_case("x-github-delivery"))
        .cloned()
        .collect();
    assert_eq!(without_id.len(), signed.len() - 1);

    let reply = gw.post("github", &without_id, body.to_vec()).await;
    assert_refused(&gw, reply, 400, "missing_event_key").await;

    // The same delivery with its id is new and forwarded under github:<delivery id>.
    let (status, json) = gw.post("github", &signed, body.to_vec()).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );
    let key = format!("github:{delivery_id}");
    gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(handler.count_for(&key), 1);
    assert_eq!(
        handler.received_for(&key)[0].header("x-github-event"),
        "push"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_a_different_body_is_held_as_a_conflict_and_not_forwarded() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_conflict");
    let key = format!("stripe:{event_id}");
    let original = stripe_invoice_paid(&event_id, 5000);
    let altered = stripe_invoice_paid(&event_id, 6000);

    let (status, first) = gw
        .post("stripe", &stripe_headers(&original), original.clone())
        .await;
    assert_eq!((status, first["status"].as_str()), (200, Some("accepted")));
    gw.wait_for_delivery_state(&key, "delivered").await;

    let (status, json) = gw
        .post("stripe", &stripe_headers(&altered), altered.clone())
        .await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "conflict", "{json}");
    assert_eq!(json["events"][0]["claim"], "conflict", "{json}");
    assert_eq!(json["events"][0]["first_request"], first["request_id"]);

    let conflicts = gw.requests("verdict=conflict").await;
    assert_eq!(conflicts.len(), 1, "{conflicts:#?}");
    assert_eq!(conflicts[0]["keys"], json!([event_id]));
    assert_eq!(conflicts[0]["id"], json["request_id"]);
    let metrics = gw.metrics().await;
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("hooklatch_conflicts_total{") && l.contains("source=\"stripe\"")),
        "no hooklatch_conflicts_total in /metrics:\n{metrics}"
    );
    // Each answer's latency lands in the histogram of its verdict (the recorder's upkeep runs
    // beside the runtime, on a blocking thread).
    assert!(
        metrics
            .lines()
            .any(|l| l == "hooklatch_ack_seconds_count{verdict=\"conflict\"} 1"),
        "no conflict in hooklatch_ack_seconds:\n{metrics}"
    );

    // No outbox row for the conflict; a later event is delivered and the conflict still is not.
    assert_eq!(gw.deliveries_for(&key).await.len(), 1);
    let later_id = unique("evt_after_conflict");
    let later = stripe_invoice_paid(&later_id, 100);
    let (status, _) = gw.post("stripe", &stripe_headers(&later), later).await;
    assert_eq!(status, 200);
    gw.wait_for_delivery_state(&format!("stripe:{later_id}"), "delivered")
        .await;
    assert_eq!(handler.count_for(&key), 1, "the conflict was not forwarded");
    assert_eq!(handler.received_for(&key)[0].body, original);

    // An operator releases it: redelivered, its own body goes out as a new event, under a
    // key of its own that the application's guard has not seen.
    let conflict_id = json["request_id"].as_str().expect("the conflict's id");
    let (status, queued) = gw
        .admin_post(&format!("/v1/requests/{conflict_id}/redeliver"))
        .await;
    assert_eq!(status, 202, "{queued}");
    let released = format!("{key}:{conflict_id}");
    gw.wait_for_delivery_state(&released, "delivered").await;
    let got = handler.received_for(&released);
    assert_eq!(got.len(), 1, "the released conflict arrived once");
    assert_eq!(got[0].body, altered, "with the conflicting body");
    assert_eq!(
        handler.count_for(&key),
        1,
        "the original event was not sent again"
    );
    let listed = gw.requests("verdict=conflict").await;
    assert_eq!(listed[0]["decision"]["action"], "released", "{listed:#?}");
    assert_eq!(gw.metric("hooklatch_conflicts_undecided").await, 0.0);

    // A third body under the key: a conflict the operator dismisses, with a reason.
    let third = stripe_invoice_paid(&event_id, 7000);
    let (status, json) = gw.post("stripe", &stripe_headers(&third), third).await;
    assert_eq!(
        (status, &json["status"]),
        (200, &json!("conflict")),
        "{json}"
    );
    let dismissed = json["request_id"].as_str().expect("its id").to_owned();
    eventually("the gauge counts the undecided conflict", async || {
        gw.metric("hooklatch_conflicts_undecided").await == 1.0
    })
    .await;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(["events", "dismiss", &dismissed, "--reason", "a test resend"])
        .args(["--admin", &gw.admin_url()])
        .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("running hooklatch events dismiss");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (status, shown) = gw.admin_get(&format!("/v1/requests/{dismissed}")).await;
    assert_eq!(status, 200);
    assert_eq!(shown["decision"]["action"], "dismissed", "{shown:#}");
    assert_eq!(shown["decision"]["reason"], "a test resend", "{shown:#}");
    eventually("the gauge counts none", async || {
        gw.metric("hooklatch_conflicts_undecided").await == 0.0
    })
    .await;
    // A dismissed conflict is not released; decided conflicts are not decided again; only a
    // conflict is dismissed. Each refusal has its code, and nothing is sent.
    for (path, code) in [
        (
            format!("/v1/requests/{dismissed}/redeliver"),
            "conflict_dismissed",
        ),
        (
            format!("/v1/requests/{dismissed}/dismiss"),
            "conflict_decided",
        ),
        (
            format!("/v1/requests/{conflict_id}/dismiss"),
            "conflict_decided",
        ),
        (
            format!(
                "/v1/requests/{}/dismiss",
                first["request_id"].as_str().expect("id")
            ),
            "not_a_conflict",
        ),
    ] {
        let (status, json) = gw.admin_post(&path).await;
        assert_eq!(
            (status, json["code"].as_str()),
            (409, Some(code)),
            "{path}: {json}"
        );
    }
    let (status, json) = gw.admin_post("/v1/requests/req_999999/dismiss").await;
    assert_eq!(
        (status, json["code"].as_str()),
        (404, Some("not_found")),
        "{json}"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(["events", "dismiss", &dismissed, "--admin", &gw.admin_url()])
        .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("running hooklatch events dismiss");
    assert_eq!(out.status.code(), Some(1), "decided before");
    assert!(String::from_utf8_lossy(&out.stderr).contains("was dismissed at"));
    assert_eq!(
        gw.deliveries_for(&format!("{key}:{dismissed}")).await.len(),
        0,
        "nothing queued for the dismissed conflict"
    );
    assert_eq!(
        handler.total(),
        3,
        "the original, the later event, the released conflict"
    );
}

/// Every operation the admin API documents (its OpenAPI document, so a new route is covered
/// as it is added) refuses every credential but its token: none, a wrong one, an empty one, a
/// prefix of the token, the token and one more character, the token in another case, under
/// another scheme or under none, and bytes that are not text — each 401 `unauthorized` with
/// `WWW-Authenticate: Bearer`, never a 400 or a 5xx, and none changes anything. The probes
/// need no token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_refuses_every_request_without_its_bearer_token() {
    use base64::Engine;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;

    let (status, document) = gw.admin_get("/v1/openapi.json").await;
    assert_eq!(status, 200);
    let mut protected = Vec::new();
    for (path, operations) in document["paths"].as_object().expect("paths") {
        for (method, operation) in operations.as_object().expect("operations") {
            if operation["security"] == json!([]) {
                continue;
            }
            let path = path
                .replace(
                    "{id}",
                    if path.contains("deliveries") {
                        "dlv_1"
                    } else {
                        "req_1"
                    },
                )
                .replace("{name}", "app");
            let method = Method::from_bytes(method.to_uppercase().as_bytes()).expect("a method");
            protected.push((method, path));
        }
    }
    assert!(protected.len() >= 12, "{protected:?}");

    let basic = base64::engine::general_purpose::STANDARD.encode(format!("admin:{ADMIN_TOKEN}"));
    let credentials: Vec<Option<Vec<u8>>> = vec![
        None,
        Some(b"Bearer e2e-wrong-token-0123456789abcdef".to_vec()),
        Some(b"Bearer ".to_vec()),
        Some(format!("Bearer {}", &ADMIN_TOKEN[..ADMIN_TOKEN.len() - 1]).into_bytes()),
        Some(format!("Bearer {ADMIN_TOKEN}x").into_bytes()),
        Some(format!("Bearer {}", ADMIN_TOKEN.to_uppercase()).into_bytes()),
        Some(format!("Basic {basic}").into_bytes()),
        Some(ADMIN_TOKEN.as_bytes().to_vec()),
        Some([b"Bearer ".as_slice(), &[0xff, 0xfe, 0x80]].concat()),
    ];
    let client = reqwest::Client::new();
    for (method, path) in &protected {
        for credential in &credentials {
            let mut req = client
                .request(method.clone(), format!("{}{path}", gw.admin_url()))
                .header("content-type", "application/json")
                .body("{}");
            if let Some(value) = credential {
                let value = reqwest::header::HeaderValue::from_bytes(value).expect("a header");
                req = req.header("authorization", value);
            }
            let res = req.send().await.expect("an admin request");
            let shown = credential.as_deref().map(String::from_utf8_lossy);
            assert_eq!(res.status(), 401, "{method} {path} with {shown:?}");
            assert_eq!(
                res.headers().get("www-authenticate").map(|v| v.as_bytes()),
                Some(&b"Bearer"[..]),
                "{method} {path} with {shown:?}"
            );
            let body: Value = res.json().await.expect("a JSON error");
            assert_eq!(body["code"], "unauthorized", "{method} {path}: {body}");
            assert!(body["message"].is_string(), "{body}");
        }
    }
    // Nothing changed: nothing imported, nothing disabled.
    assert!(gw.requests("").await.is_empty(), "nothing in history");
    let (_, destinations) = gw.admin_get("/v1/destinations").await;
    assert_eq!(destinations["items"][0]["enabled"], true, "{destinations}");

    // The right token opens them, its scheme in any case; the probes need none.
    let (status, _) = gw.admin_get("/v1/deliveries").await;
    assert_eq!(status, 200);
    let res = client
        .get(format!("{}/v1/deliveries", gw.admin_url()))
        .header("authorization", format!("bearer {ADMIN_TOKEN}"))
        .send()
        .await
        .expect("an admin request");
    assert_eq!(res.status(), 200, "the scheme is case-insensitive");
    for probe in ["/healthz", "/readyz"] {
        let res = gw.admin_response(Method::GET, probe, None).await;
        assert_eq!(res.status(), 200, "{probe}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_route_answers_a_method_it_does_not_take_with_405_in_json() {
    // Found by the `admin` fuzz target: axum's own 405 had an empty body.
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let (_, document) = gw.admin_get("/v1/openapi.json").await;
    let mut checked = 0;
    for (path, operations) in document["paths"].as_object().expect("paths") {
        let path = path.replace("{id}", "req_1").replace("{name}", "app");
        let taken: Vec<String> = operations
            .as_object()
            .expect("operations")
            .keys()
            .map(|m| m.to_uppercase())
            .collect();
        for method in [
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::DELETE,
            Method::PATCH,
        ] {
            if taken.contains(&method.to_string()) {
                continue;
            }
            let res = gw
                .admin_response(method.clone(), &path, Some(ADMIN_TOKEN))
                .await;
            assert_eq!(res.status(), 405, "{method} {path}");
            let allow = res
                .headers()
                .get("allow")
                .map(|v| v.to_str().unwrap_or("").to_owned());
            let allow = allow.unwrap_or_else(|| panic!("{method} {path}: no Allow header"));
            for taken in &taken {
                assert!(
                    allow.contains(taken.as_str()),
                    "{method} {path}: Allow {allow}"
                );
            }
            let body: Value = res.json().await.expect("a JSON error");
            assert_eq!(
                body["code"], "method_not_allowed",
                "{method} {path}: {body}"
            );
            assert!(body["message"].is_string(), "{body}");
            checked += 1;
        }
    }
    assert!(checked >= 50, "checked {checked}");
}

/// A request head hyper cannot parse, on either listener, as a client writes it to the
/// socket: garbage, a header line without a colon, a control byte in the path, more than 100
/// headers. hyper refuses each before the router sees it; the answer is the JSON error every
/// refusal carries (`malformed_request` 400, `headers_too_large` 431), the connection is
/// closed, and the gateway goes on serving: the same event sent right after is accepted. Such
/// a request names no source to file it under and is not kept in history (as a request to a
/// path outside `/in/{source}` is not); the metric counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_does_not_parse_is_answered_in_json_on_both_listeners() {
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let admin: std::net::SocketAddr = reqwest::Url::parse(&gw.admin_url())
        .expect("the admin URL")
        .socket_addrs(|| None)
        .expect("the admin address")[0];
    let mut many = b"POST /in/stripe HTTP/1.1\r\nhost: x\r\n".to_vec();
    for i in 0..101 {
        many.extend_from_slice(format!("x-header-{i}: v\r\n").as_bytes());
    }
    many.extend_from_slice(b"\r\n");
    let cases: [(&[u8], &str, &str); 4] = [
        (b"GARBAGE\r\n\r\n", "400", "malformed_request"),
        (
            b"POST /in/stripe HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n",
            "400",
            "malformed_request",
        ),
        (
            b"POST /in/\x01 HTTP/1.1\r\nhost: x\r\n\r\n",
            "400",
            "malformed_request",
        ),
        (&many, "431", "headers_too_large"),
    ];
    for addr in [gw.ingest().addr(), admin] {
        for (request, status, code) in &cases {
            let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
            conn.write_all(request).await.expect("write");
            let mut answer = Vec::new();
            tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut answer))
                .await
                .expect("the connection is closed after the answer")
                .expect("read");
            let answer = String::from_utf8_lossy(&answer);
            assert!(
                answer.starts_with(&format!("HTTP/1.1 {status} ")),
                "{answer}"
            );
            let (head, body) = answer.split_once("\r\n\r\n").expect("a whole answer");
            assert!(
                head.to_ascii_lowercase()
                    .contains("content-type: application/json"),
                "{head}"
            );
            let json: Value = serde_json::from_str(body).expect("a JSON body");
            assert_eq!(json["code"], *code, "{answer}");
            assert!(json["message"].is_string(), "{json}");
        }
    }
    assert!(gw.requests("").await.is_empty(), "nothing kept in history");
    let metric = "hooklatch_malformed_requests_total{code=\"malformed_request\"}";
    assert_eq!(gw.metric(metric).await, 6.0);
    let id = unique("evt_after_bad_heads");
    let body = stripe_invoice_paid(&id, 5000);
    let (status, json) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );
}
