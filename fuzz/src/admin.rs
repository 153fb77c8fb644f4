//! The admin API as anyone who reaches its listener can call it: any operation of its OpenAPI
//! document (so a route added to the document is fuzzed as it lands) or any path, any method,
//! path parameter, query, content type and body, with the right token, none, or a wrong one in
//! any shape, on the in-memory store holding an accepted event and its delivery.
//!
//! Checked: nothing panics; no answer is a 5xx; every 4xx is the JSON error body; without the
//! right token nothing but the probes and the inspector's static files answers 2xx, and the
//! store is left as it was (no import, redelivery, retry, dismissal or disabled destination).

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use arbitrary::Arbitrary;
use axum::body::Body;
use hooklatch_core::store::{DeliveryFilter, RequestFilter};
use hooklatch_core::{Secret, Store, Timestamp};
use hooklatch_http::{admin_router, AdminState, DisabledDestinations, Readiness};
use hooklatch_testkit::MemoryStore;
use http::{HeaderValue, Method, Request, Uri};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tower::ServiceExt;

use crate::ingest::{gateway, runtime};
use crate::{adapters, signed};

/// The admin token the fuzzed API is configured with.
const TOKEN: &str = "fuzz-admin-token-0123456789";

/// The document's operations: (method, path template).
fn operations() -> &'static [(Method, String)] {
    static OPERATIONS: OnceLock<Vec<(Method, String)>> = OnceLock::new();
    OPERATIONS.get_or_init(|| {
        let document: serde_json::Value =
            serde_json::from_str(include_str!("../../crates/http/src/openapi.json"))
                .expect("the OpenAPI document parses");
        let mut out = Vec::new();
        for (path, operations) in document["paths"].as_object().expect("paths") {
            for method in operations.as_object().expect("operations").keys() {
                let method =
                    Method::from_bytes(method.to_uppercase().as_bytes()).expect("a method");
                out.push((method, path.clone()));
            }
        }
        out
    })
}

/// Which credentials the request carries.
#[derive(Arbitrary, Debug)]
pub enum Credentials<'a> {
    /// `Authorization: Bearer <the token>`.
    Right,
    /// No `Authorization` header.
    None,
    /// `Authorization: Bearer` and any text.
    Bearer(&'a str),
    /// Any `Authorization` value.
    Any(&'a [u8]),
    /// The token with a byte changed (by index, wrapping) to another.
    Near(u8, u8),
}

/// Where the request goes.
#[derive(Arbitrary, Debug)]
pub enum Target<'a> {
    /// An operation of the document (by index, wrapping), with its method or another.
    Operation { index: u8, other_method: Option<u8> },
    /// Any path.
    Path(&'a str),
}

/// What fills a path parameter.
#[derive(Arbitrary, Debug)]
pub enum Param<'a> {
    /// One of the names the seeded store knows, or nearly (by index, wrapping).
    Known(u8),
    /// Any text, percent-encoded where a path segment cannot hold it as it is.
    Any(&'a str),
}

/// The ids and names the seeded store holds, and some it does not.
const KNOWN: &[&str] = &[
    "req_1", "1", "dlv_1", "app", "req_2", "dlv_2", "req_0", "other", "req_", "dlv_x",
];

/// One input.
#[derive(Arbitrary, Debug)]
pub struct Input<'a> {
    /// The route.
    pub target: Target<'a>,
    /// What replaces `{id}` and `{name}`.
    pub param: Param<'a>,
    /// The query string, if any.
    pub query: Option<&'a str>,
    /// The credentials.
    pub credentials: Credentials<'a>,
    /// The `Content-Type`, if any.
    pub content_type: Option<&'a str>,
    /// The body.
    pub body: &'a [u8],
}

/// What the store holds, to see that an unauthenticated call changed none of it.
async fn state_of(store: &MemoryStore) -> String {
    let requests = store
        .list_requests(RequestFilter {
            limit: 1000,
            ..RequestFilter::default()
        })
        .await
        .expect("history");
    let deliveries = store
        .list_deliveries(DeliveryFilter {
            limit: 1000,
            ..DeliveryFilter::default()
        })
        .await
        .expect("deliveries");
    let disabled = store.disabled_destinations().await.expect("disabled");
    format!(
        "{:?} {:?} {:?}",
        requests
            .iter()
            .map(|r| (r.id, r.verdict, r.decision.clone()))
            .collect::<Vec<_>>(),
        deliveries
            .iter()
            .map(|d| (d.id, d.state, d.next_attempt_at, d.attempts))
            .collect::<Vec<_>>(),
        disabled.iter().map(|d| &d.destination).collect::<Vec<_>>()
    )
}

/// Percent-encodes what a path segment cannot hold as it is.
fn segment(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Sends `input` to a new admin API over a store holding one accepted Stripe event, then
/// checks the answer (the module's doc says what).
pub fn run(input: &Input<'_>) {
    let store = Arc::new(MemoryStore::default());
    let admin = admin_router(Arc::new(AdminState {
        store: store.clone(),
        token: Secret::from_text(TOKEN),
        metrics: Arc::new(String::new),
        readiness: {
            let readiness = Arc::new(Readiness::default());
            readiness.set_ready();
            readiness
        },
        enqueued: Arc::new(Notify::new()),
        destinations: HashMap::from([("s0".to_owned(), vec!["app".to_owned()])]),
        destination_kinds: vec![("app".to_owned(), "http")],
        disabled: Arc::new(DisabledDestinations::default()),
        keys: None,
        body_limit: 1 << 20,
    }));

    let (method, path) = match &input.target {
        Target::Operation {
            index,
            other_method,
        } => {
            let (method, template) = &operations()[usize::from(*index) % operations().len()];
            let method = match other_method {
                None => method.clone(),
                Some(m) => [
                    Method::GET,
                    Method::POST,
                    Method::PUT,
                    Method::DELETE,
                    Method::HEAD,
                ][usize::from(*m) % 5]
                    .clone(),
            };
            let param = match input.param {
                Param::Known(i) => KNOWN[usize::from(i) % KNOWN.len()].to_owned(),
                Param::Any(text) => segment(text),
            };
            let path = template.replace("{id}", &param).replace("{name}", &param);
            (method, path)
        }
        Target::Path(path) => (Method::GET, (*path).to_owned()),
    };
    let path = match input.query {
        Some(query) => format!("{path}?{query}"),
        None => path,
    };
    let Ok(uri) = path.parse::<Uri>() else {
        return;
    };
    let mut request = Request::builder()
        .method(method.clone())
        .uri(uri.clone())
        .body(Body::from(input.body.to_vec()))
        .expect("a request from parts that parsed");
    let authorization = match &input.credentials {
        Credentials::Right => Some(format!("Bearer {TOKEN}").into_bytes()),
        Credentials::None => None,
        Credentials::Bearer(text) => Some(format!("Bearer {text}").into_bytes()),
        Credentials::Any(bytes) => Some(bytes.to_vec()),
        Credentials::Near(at, to) => {
            let mut token = TOKEN.as_bytes().to_vec();
            let at = usize::from(*at) % token.len();
            token[at] = if token[at] == *to {
                to.wrapping_add(1)
            } else {
                *to
            };
            Some([b"Bearer ".as_slice(), &token].concat())
        }
    };
    if let Some(value) = authorization.and_then(|a| HeaderValue::from_bytes(&a).ok()) {
        request
            .headers_mut()
            .insert(http::header::AUTHORIZATION, value);
    }
    if let Some(value) = input
        .content_type
        .and_then(|c| HeaderValue::from_str(c).ok())
    {
        request
            .headers_mut()
            .insert(http::header::CONTENT_TYPE, value);
    }
    // The harness may compare plainly; the API's own check is the constant-time one.
    let authorized = hooklatch_http::bearer_token(request.headers()) == Some(TOKEN);

    runtime().block_on(async {
        // One accepted event (request `req_1`, delivery 1) for the operations to find.
        let ingest = gateway(store.clone());
        let body = br#"{"id":"evt_admin","type":"invoice.paid"}"#.to_vec();
        let headers = signed(
            &*adapters()[0].adapter,
            &body,
            "evt_admin",
            Timestamp::now(),
            "",
        );
        let mut event = Request::post("/in/s0")
            .body(Body::from(body))
            .expect("a request");
        *event.headers_mut() = headers;
        let accepted = ingest.oneshot(event).await.expect("routers do not fail");
        assert_eq!(accepted.status(), 200, "the seeded event");

        let before = state_of(&store).await;
        let response = admin.oneshot(request).await.expect("routers do not fail");
        let status = response.status().as_u16();
        let bytes = response
            .into_body()
            .collect()
            .await
            .expect("an in-memory body")
            .to_bytes();
        let text = String::from_utf8_lossy(&bytes);
        assert!(status < 500, "{method} {uri}: a {status} answer: {text}");
        if status >= 400 && method != Method::HEAD {
            let json: serde_json::Value = serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| panic!("{method} {uri}: a {status} answer not JSON: {text}"));
            assert!(
                json["code"].is_string() && json["message"].is_string(),
                "{method} {uri}: a {status} answer without a code and a message: {json}"
            );
        }
        if !authorized {
            let public = [
                "/healthz",
                "/readyz",
                "/",
                "/ui",
                "/ui/",
                "/ui/app.js",
                "/ui/app.css",
            ]
            .contains(&uri.path());
            assert!(
                public || !(200..300).contains(&status),
                "{method} {uri} answered {status} without the token: {text}"
            );
            assert_eq!(
                state_of(&store).await,
                before,
                "{method} {uri} without the token changed the store"
            );
        }
    });
}
