//! The `VerifiedDelivery` extractor against requests signed the way hooklatch signs them.

#![cfg(feature = "axum")]

use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::FromRef;
use axum::routing::post;
use axum::Router;
use hooklatch_core::provider::standard_webhooks::{decode_secret, sign_v1};
use hooklatch_core::Secret;
use hooklatch_guard::{GuardConfig, VerifiedDelivery};
use http::{Request, StatusCode};
use tower::ServiceExt;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const OTHER_SECRET: &str = "whsec_c2VjcmV0LW9mLWFub3RoZXItZGVzdGluYXRpb24=";
const KEY: &str = "stripe:evt_1";
const BODY: &str = r#"{"type":"invoice.paid","id":"evt_1"}"#;

/// An application state that holds the config among other things.
#[derive(Clone)]
struct AppState {
    guard: GuardConfig,
}

impl FromRef<AppState> for GuardConfig {
    fn from_ref(state: &AppState) -> GuardConfig {
        state.guard.clone()
    }
}

async fn handler(delivery: VerifiedDelivery) -> String {
    format!(
        "{} {}",
        delivery.idempotency_key,
        String::from_utf8_lossy(&delivery.body)
    )
}

fn app(config: GuardConfig) -> Router {
    Router::new()
        .route("/webhooks", post(handler))
        .with_state(AppState { guard: config })
}

fn now() -> i64 {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs();
    i64::try_from(secs).expect("fits")
}

/// A delivery as hooklatch sends it: signed with `secret` at `ts` over `signed_body`.
fn delivery(secret: &str, ts: i64, signed_body: &str) -> http::request::Builder {
    let key = decode_secret(&Secret::from_text(secret)).expect("whsec secret");
    Request::post("/webhooks")
        .header("content-type", "application/json")
        .header("idempotency-key", KEY)
        .header("webhook-id", KEY)
        .header("webhook-timestamp", ts.to_string())
        .header(
            "webhook-signature",
            sign_v1(&key, KEY, ts, signed_body.as_bytes()),
        )
}

async fn send(config: GuardConfig, req: Request<Body>) -> (StatusCode, String) {
    let res = app(config).oneshot(req).await.expect("infallible");
    let status = res.status();
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .expect("response body");
    (status, String::from_utf8(body.to_vec()).expect("utf-8"))
}

fn config() -> GuardConfig {
    GuardConfig::new(Secret::from_text(SECRET))
}

/// The rejection's `code`, after checking it is a 401 with `{code, message}`.
async fn rejected(req: Request<Body>) -> String {
    let (status, body) = send(config(), req).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{body}");
    let json: serde_json::Value = serde_json::from_str(&body).expect("a JSON rejection");
    assert!(json["message"].is_string(), "{json}");
    json["code"].as_str().expect("a code").to_owned()
}

#[tokio::test]
async fn a_valid_delivery_yields_the_key_and_the_raw_body() {
    let req = delivery(SECRET, now(), BODY)
        .body(Body::from(BODY))
        .expect("request");
    let (status, body) = send(config(), req).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, format!("{KEY} {BODY}"));
}

#[tokio::test]
async fn any_configured_secret_and_any_v1_entry_matches() {
    let config =
        GuardConfig::new(Secret::from_text(OTHER_SECRET)).with_secret(Secret::from_text(SECRET));
    let ts = now();
    let good = decode_secret(&Secret::from_text(SECRET)).expect("secret");
    let signature = format!(
        "v1a,ignored v1,AAAA {}",
        sign_v1(&good, KEY, ts, BODY.as_bytes())
    );
    let mut req = delivery(SECRET, ts, BODY)
        .body(Body::from(BODY))
        .expect("request");
    req.headers_mut()
        .insert("webhook-signature", signature.parse().expect("value"));
    let (status, body) = send(config, req).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

#[tokio::test]
async fn a_wrong_secret_is_rejected() {
    let req = delivery(OTHER_SECRET, now(), BODY)
        .body(Body::from(BODY))
        .expect("request");
    assert_eq!(rejected(req).await, "invalid_signature");
}

#[tokio::test]
async fn a_tampered_body_is_rejected() {
    let req = delivery(SECRET, now(), BODY)
        .body(Body::from(BODY.replace("evt_1", "evt_2")))
        .expect("request");
    assert_eq!(rejected(req).await, "invalid_signature");
}

#[tokio::test]
async fn a_stale_or_future_timestamp_is_rejected() {
    for skew in [-301, 301] {
        let req = delivery(SECRET, now() + skew, BODY)
            .body(Body::from(BODY))
            .expect("request");
        assert_eq!(rejected(req).await, "stale_timestamp", "skew {skew}");
    }
    // Inside the window both ways.
    for skew in [-290, 290] {
        let req = delivery(SECRET, now() + skew, BODY)
            .body(Body::from(BODY))
            .expect("request");
        let (status, body) = send(config(), req).await;
        assert_eq!(status, StatusCode::OK, "skew {skew}: {body}");
    }
}

#[tokio::test]
async fn an_idempotency_key_that_differs_from_webhook_id_is_rejected() {
    let mut req = delivery(SECRET, now(), BODY)
        .body(Body::from(BODY))
        .expect("request");
    req.headers_mut().insert(
        "idempotency-key",
        "stripe:evt_other".parse().expect("value"),
    );
    assert_eq!(rejected(req).await, "idempotency_key_mismatch");

    let mut req = delivery(SECRET, now(), BODY)
        .body(Body::from(BODY))
        .expect("request");
    req.headers_mut().remove("idempotency-key");
    assert_eq!(rejected(req).await, "missing_idempotency_key");
}

#[tokio::test]
async fn missing_or_malformed_headers_are_rejected() {
    for header in ["webhook-id", "webhook-timestamp", "webhook-signature"] {
        let mut req = delivery(SECRET, now(), BODY)
            .body(Body::from(BODY))
            .expect("request");
        req.headers_mut().remove(header);
        assert_eq!(rejected(req).await, "missing_signature", "without {header}");
    }
    let mut req = delivery(SECRET, now(), BODY)
        .body(Body::from(BODY))
        .expect("request");
    req.headers_mut()
        .insert("webhook-timestamp", "yesterday".parse().expect("value"));
    assert_eq!(rejected(req).await, "malformed_signature");

    let req = Request::post("/webhooks")
        .body(Body::from(BODY))
        .expect("request");
    assert_eq!(rejected(req).await, "missing_signature");
}
