//! The ingest listener as a provider, a scanner or an attacker reaches it: any method, path,
//! query, headers and body against a gateway with one source per adapter, in process, over a
//! store the target chooses. Nothing may panic; no answer is a 5xx; every refusal (4xx) is the
//! JSON error body clients rely on (`{"code": …, "message": …}`); and a request signed as the
//! provider signs, once accepted, is a duplicate when it comes again.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use arbitrary::Arbitrary;
use axum::body::Body;
use hooklatch_core::{RequestId, SourceName, Store, Timestamp};
use hooklatch_http::{ingest_router, IngestState, Source, REQUEST_ID_HEADER, VERDICT_HEADER};
use http::{HeaderMap, Method, Request, Response, Uri};
use http_body_util::BodyExt;
use tokio::sync::Notify;
use tower::ServiceExt;

use crate::{adapters, headers, secrets, sendable, signed, Name};

/// The body limit the gateway is given: small, so that inputs can reach it.
const BODY_LIMIT: usize = 2048;

/// The `{source}` a request names.
#[derive(Arbitrary, Debug)]
pub enum SourceChoice<'a> {
    /// One of the configured sources (by index, wrapping): `s0`, `s1`, …
    Configured(u8),
    /// Any text as the `{source}` path segment (and whatever else it makes of the path).
    Other(&'a str),
}

/// One input: a request, and whether to send a signed copy of its body twice after it.
#[derive(Arbitrary, Debug)]
pub struct Input<'a> {
    /// The source in the path.
    pub source: SourceChoice<'a>,
    /// POST (half the time), GET, PUT, DELETE or HEAD.
    pub method: u8,
    /// The query string, if any.
    pub query: Option<&'a str>,
    /// The headers (see [`Name`]).
    pub headers: Vec<(Name<'a>, &'a [u8])>,
    /// The body.
    pub body: &'a [u8],
    /// Whether to sign the body as the source's provider does, send it, and send it again.
    pub sign: bool,
    /// The event key signing uses where the provider carries it in a header.
    pub event_key: &'a str,
}

/// The one runtime every input runs on (current-thread, with time for the body timeout).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
    })
}

/// A gateway's ingest router with one source per adapter (`s0`, `s1`, …) over `store`.
pub(crate) fn gateway(store: Arc<dyn Store>) -> axum::Router {
    let sources = adapters()
        .into_iter()
        .enumerate()
        .map(|(i, fuzzed)| {
            let name = format!("s{i}");
            let source = Source {
                name: SourceName::parse(&name).expect("a source name"),
                adapter: Arc::from(fuzzed.adapter),
                secrets: secrets(),
                tolerance: Duration::from_secs(300),
                retention: Duration::from_secs(3600),
                destinations: vec!["app".to_owned()],
            };
            (name, source)
        })
        .collect::<HashMap<_, _>>();
    ingest_router(Arc::new(IngestState {
        store,
        sources,
        body_limit: BODY_LIMIT,
        // Every refused body kept whole, so each answer's history is checked byte for byte.
        refused_body_limit: BODY_LIMIT,
        body_timeout: Duration::from_secs(5),
        enqueued: Arc::new(Notify::new()),
        keys: None,
        handoff: None,
    }))
}

/// Sends one request; its status, its verdict (the header, or the JSON answer's `status`) and
/// its body. An answer that names the request's id in history (`hooklatch-request-id`, or the
/// JSON answer's `request_id`) must find there the request as it was sent, byte for byte.
async fn send(
    router: &axum::Router,
    store: &dyn Store,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: &[u8],
) -> (u16, Option<String>, Vec<u8>) {
    let mut request = Request::builder()
        .method(method.clone())
        .uri(uri.clone())
        .body(Body::from(body.to_vec()))
        .expect("a request from parts that parsed");
    *request.headers_mut() = headers.clone();
    let response: Response<Body> = router
        .clone()
        .oneshot(request)
        .await
        .expect("routers do not fail");
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (header_verdict, header_id) = (header(VERDICT_HEADER), header(REQUEST_ID_HEADER));
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("an in-memory body")
        .to_bytes()
        .to_vec();
    let json = serde_json::from_slice::<serde_json::Value>(&bytes).ok();
    let field = |name: &str| {
        json.as_ref()
            .and_then(|j| j.get(name)?.as_str().map(str::to_owned))
    };
    let verdict = header_verdict.or_else(|| field("status"));
    if let Some(id) = header_id.or_else(|| field("request_id")) {
        let id = RequestId::parse(&id).expect("an answer names a request id history can parse");
        let kept = store
            .get_request(id)
            .await
            .expect("the store reads back")
            .expect("the request the answer names is in history");
        assert_eq!(kept.body.as_ref(), body, "the body kept for {id:?}");
        assert!(!kept.body_truncated);
        let sent: Vec<(String, Vec<u8>)> = headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect();
        assert_eq!(kept.headers, sent, "the headers kept for {id:?}");
        assert_eq!(kept.method, method.as_str());
        assert_eq!(
            Some(kept.path.as_str()),
            uri.path_and_query().map(|p| p.as_str())
        );
    }
    (status, verdict, bytes)
}

/// The promises every answer keeps: no 5xx, and a 4xx is `{"code": …, "message": …}` (but to
/// `HEAD`, whose answers carry no body).
fn check_answer(method: &Method, status: u16, body: &[u8]) {
    assert!(
        status < 500,
        "a {status} answer: {}",
        String::from_utf8_lossy(body)
    );
    if status >= 400 && method != Method::HEAD {
        let json: serde_json::Value = serde_json::from_slice(body).unwrap_or_else(|_| {
            panic!(
                "a {status} answer that is not JSON: {}",
                String::from_utf8_lossy(body)
            )
        });
        assert!(
            json.get("code").and_then(|c| c.as_str()).is_some()
                && json.get("message").and_then(|m| m.as_str()).is_some(),
            "a {status} answer without a code and a message: {json}"
        );
    }
}

/// Sends `input` to a new ingest router over `store`, then checks the answers (the module's
/// doc says what).
pub fn run(input: &Input<'_>, store: Arc<dyn Store>) {
    let adapters = adapters();
    let name = match &input.source {
        SourceChoice::Configured(i) => format!("s{}", usize::from(*i) % adapters.len()),
        SourceChoice::Other(name) => (*name).to_owned(),
    };
    // The source the path names, if it is a configured one (any text may spell `s3`).
    let configured = name
        .strip_prefix('s')
        .and_then(|i| i.parse::<usize>().ok())
        .filter(|&i| i < adapters.len() && name == format!("s{i}"));
    let fuzzed = &adapters[configured.unwrap_or(0)];
    let adapter = &*fuzzed.adapter;
    let method = match input.method % 8 {
        0..=3 => Method::POST,
        4 => Method::GET,
        5 => Method::PUT,
        6 => Method::DELETE,
        _ => Method::HEAD,
    };
    let path = match input.query {
        Some(query) => format!("/in/{name}?{query}"),
        None => format!("/in/{name}"),
    };
    let Ok(uri) = path.parse::<Uri>() else {
        return;
    };
    let headers = headers(adapter, &input.headers);
    let router = gateway(store.clone());
    runtime().block_on(async {
        let (status, _, body) = send(&router, &*store, &method, &uri, &headers, input.body).await;
        check_answer(&method, status, &body);

        if input.sign && method == Method::POST {
            let url = format!("http://127.0.0.1:8080{path}");
            let signed = signed(adapter, input.body, input.event_key, Timestamp::now(), &url);
            let (first, verdict, first_body) =
                send(&router, &*store, &method, &uri, &signed, input.body).await;
            check_answer(&method, first, &first_body);
            let (again, again_verdict, again_body) =
                send(&router, &*store, &method, &uri, &signed, input.body).await;
            check_answer(&method, again, &again_body);
            if verdict.as_deref() == Some("accepted") {
                assert_eq!(
                    (again, again_verdict.as_deref()),
                    (first, Some("duplicate")),
                    "the same signed request again: {}",
                    String::from_utf8_lossy(&again_body)
                );
            }
            // Signed as the provider signs, within the body limit, the only refusals left are
            // the body's own (no key, not JSON), never the signature's (401).
            let round_trips = sendable(&signed) && fuzzed.round_trips;
            if configured.is_some() && round_trips && input.body.len() <= BODY_LIMIT {
                assert_ne!(
                    first,
                    401,
                    "{}: a signed request refused: {}",
                    adapter.provider(),
                    String::from_utf8_lossy(&first_body)
                );
            }
        }
    });
}
