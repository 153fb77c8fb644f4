//! The admin API against its own OpenAPI document: every documented operation refuses a
//! request without the token, and schemathesis (property-based requests generated from the
//! document, then stateful sequences following its links) finds no server error, no status
//! code, content type or response body the document does not describe, and no operation that
//! answers without authentication; run again without the token, every generated request to an
//! operation but the probes gets only the documented 401.
//!
//! The one check left out is `positive_data_acceptance`: a request can match the document and
//! still be refused with a 400 it names (an unknown destination, a capture that does not
//! decode), which the document cannot express.
//!
//! Needs schemathesis (`HOOKLATCH_SCHEMATHESIS`, its `st` command; `.ci/run` installs the
//! pinned `interop/requirements-schemathesis.txt`). Without it the fuzzing prints `skipped:`,
//! except under CI, where it fails; the token sweep runs either way.

use reqwest::Method;
use serde_json::Value;

use crate::support::{
    stripe_headers, stripe_invoice_paid, unique, Behaviour, Gateway, Handler, ADMIN_TOKEN,
};

/// Every operation of the OpenAPI document, with `{id}` filled in.
fn documented_operations() -> Vec<(Method, String)> {
    let doc: Value = serde_json::from_str(include_str!("../../../http/src/openapi.json"))
        .expect("the OpenAPI document is JSON");
    let mut ops = Vec::new();
    for (path, item) in doc["paths"].as_object().expect("paths") {
        for method in item.as_object().expect("a path item").keys() {
            let method = Method::from_bytes(method.to_uppercase().as_bytes()).expect("a method");
            ops.push((method, path.replace("{id}", "req_1")));
        }
    }
    ops
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_matches_its_document_under_generated_requests() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_api_fuzz");
    let body = stripe_invoice_paid(&event_id, 5000);
    let (status, _) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!(status, 200);

    // Without the token, every documented operation but the probes is refused, as documented.
    let ops = documented_operations();
    assert!(ops.len() >= 9, "{ops:?}");
    for (method, path) in &ops {
        let res = gw.admin_response(method.clone(), path, None).await;
        let status = res.status().as_u16();
        if path == "/healthz" || path == "/readyz" {
            assert_eq!(status, 200, "{method} {path}");
            continue;
        }
        assert_eq!(status, 401, "{method} {path} without the token");
        let body: Value = res.json().await.expect("a JSON error");
        assert_eq!(body["code"], "unauthorized", "{method} {path}");
    }
    // And nothing of the admin API answers on the public listener.
    let public = format!("http://{}", gw.ingest().addr());
    for (method, path) in &ops {
        let res = reqwest::Client::new()
            .request(method.clone(), format!("{public}{path}"))
            .bearer_auth(ADMIN_TOKEN)
            .send()
            .await
            .expect("the public listener answers");
        assert_eq!(res.status(), 404, "{method} {path} on the public listener");
    }

    // Malformed input is refused with a JSON error and its code, as every refusal is.
    let admin = reqwest::Client::new();
    let cases = [
        (
            Method::GET,
            "/v1/requests?bogus=1",
            None,
            400,
            "invalid_parameter",
        ),
        (
            Method::GET,
            "/v1/deliveries?limit=x",
            None,
            400,
            "invalid_parameter",
        ),
        (
            Method::POST,
            "/v1/requests/import",
            Some(("text/plain", "{}")),
            415,
            "unsupported_media_type",
        ),
        (
            Method::POST,
            "/v1/requests/import",
            Some(("application/json", "{")),
            400,
            "invalid_body",
        ),
        (
            Method::POST,
            "/v1/requests/req_1/redeliver",
            Some(("application/json", "{")),
            400,
            "invalid_body",
        ),
    ];
    for (method, path, body, status, code) in cases {
        let mut req = admin
            .request(method.clone(), format!("{}{path}", gw.admin_url()))
            .bearer_auth(ADMIN_TOKEN);
        if let Some((content_type, text)) = body {
            req = req.header("content-type", content_type).body(text);
        }
        let res = req.send().await.expect("the admin listener answers");
        assert_eq!(res.status().as_u16(), status, "{method} {path}");
        let answer: Value = res.json().await.expect("a JSON error");
        assert_eq!(answer["code"], code, "{method} {path}: {answer}");
        let message = answer["message"].as_str().unwrap_or_default();
        assert!(
            !message.starts_with("Failed to"),
            "in the API's words: {message}"
        );
    }
    let (_, answer) = gw.admin_get("/v1/deliveries?limit=x").await;
    assert_eq!(
        answer["message"], "the query string: limit: invalid digit found in string",
        "{answer}"
    );
    let (status, _) = gw.admin_get("/v1/deliveries?cursor=").await;
    assert_eq!(status, 200, "an empty cursor is the first page");

    let Some(st) = std::env::var_os("HOOKLATCH_SCHEMATHESIS") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but HOOKLATCH_SCHEMATHESIS is not: the admin API fuzzing must run"
        );
        println!("skipped: set HOOKLATCH_SCHEMATHESIS to schemathesis's st to fuzz the admin API");
        return;
    };
    let report = schemathesis(&st, &gw, Some(ADMIN_TOKEN), 25).await;
    assert!(!report.contains(ADMIN_TOKEN), "the report shows the token");
    println!("{report}");
    // Without the token: every generated request, valid or not, is refused as the document
    // says (401 with its error body), never a 5xx, never an answer.
    let report = schemathesis(&st, &gw, None, 10).await;
    let guarded = ops
        .iter()
        .filter(|(_, path)| path != "/healthz" && path != "/readyz")
        .count();
    assert!(
        report.contains(&format!("{guarded} operations returned only 401/403")),
        "every operation but the probes refused every request without the token:\n{report}"
    );
    println!("{report}");
}

/// Runs schemathesis over the gateway's OpenAPI document, with the bearer `token` or none,
/// `examples` requests per operation; its report, once it passed.
async fn schemathesis(
    st: &std::ffi::OsStr,
    gw: &Gateway,
    token: Option<&str>,
    examples: u32,
) -> String {
    // schemathesis keeps a cache where it runs: a temp dir, not the source tree.
    let workdir = tempfile::tempdir().expect("a temp dir");
    let mut command = tokio::process::Command::new(st);
    command.current_dir(workdir.path()).arg("run");
    match token {
        Some(token) => command
            .arg(format!("{}/v1/openapi.json", gw.admin_url()))
            .args(["-H", &format!("Authorization: Bearer {token}")]),
        // The document is behind the token too: read from the source tree, which is what
        // the gateway serves (`crates/http/src/openapi.json`).
        None => command
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../http/src/openapi.json"
            ))
            .args(["--url", &gw.admin_url()]),
    };
    let out = command
        .args([
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
        ])
        .args(["--max-examples", &examples.to_string(), "--seed", "1"])
        .args(["--workers", "2", "--request-timeout", "10"])
        .env("NO_COLOR", "1")
        .kill_on_drop(true)
        .output()
        .await
        .expect("running schemathesis");
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let with = if token.is_some() { "with" } else { "without" };
    assert!(
        out.status.success(),
        "schemathesis {with} the token failed:\n{report}"
    );
    report
}
