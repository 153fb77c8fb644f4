//! Route handlers, one file per resource; the path follows the URL.

pub(crate) mod deliveries;
pub(crate) mod destinations;
pub(crate) mod health;
pub(crate) mod ingest;
pub(crate) mod requests;
pub(crate) mod ui;

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use hooklatch_core::secret::constant_time_eq;

use crate::{AdminState, ApiError};

pub(crate) fn admin_router(state: Arc<AdminState>) -> Router {
    let protected = Router::new()
        .route("/v1/requests", get(requests::list))
        .route("/v1/requests/{id}", get(requests::show))
        .route("/v1/requests/{id}/redeliver", post(requests::redeliver))
        .route("/v1/requests/{id}/dismiss", post(requests::dismiss))
        .route(
            "/v1/requests/import",
            post(requests::import).layer(DefaultBodyLimit::max(requests::IMPORT_LIMIT)),
        )
        .route("/v1/deliveries", get(deliveries::list))
        .route("/v1/deliveries/{id}/retry", post(deliveries::retry))
        .route("/v1/destinations", get(destinations::list))
        .route(
            "/v1/destinations/{name}/disable",
            post(destinations::disable),
        )
        .route("/v1/destinations/{name}/enable", post(destinations::enable))
        .route("/v1/openapi.json", get(openapi))
        .route("/metrics", get(health::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .merge(protected)
        .merge(ui::router())
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// The admin API's OpenAPI document, kept by hand beside the routes it describes; a test
/// checks that every route is in it.
pub(crate) const OPENAPI: &str = include_str!("../openapi.json");

async fn openapi() -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        OPENAPI,
    )
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError::not_found(crate::NO_ROUTE)
}

/// A route called with a method it does not take: 405 in JSON, as every refusal, with the
/// `Allow` header axum adds (found by the `admin` fuzz target: axum's own 405 had no body).
async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!("{method} is not accepted on this route: the Allow header lists what is"),
    )
}

/// Checks `Authorization: Bearer <token>` in constant time.
async fn require_token(State(state): State<Arc<AdminState>>, req: Request, next: Next) -> Response {
    match crate::bearer_token(req.headers()) {
        Some(token) if constant_time_eq(token.as_bytes(), state.token.expose()) => {
            next.run(req).await
        }
        _ => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "missing or wrong bearer token",
        )
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `.route("…")` in this file must be described in the OpenAPI document.
    #[test]
    fn openapi_lists_every_admin_route() {
        let doc: serde_json::Value = serde_json::from_str(OPENAPI).expect("openapi.json parses");
        let paths = doc["paths"].as_object().expect("paths");
        let file = include_str!("mod.rs");
        let source = &file[..file.find("#[cfg(test)]").unwrap_or(file.len())];
        let mut n = 0;
        for (at, _) in source.match_indices(".route(") {
            let rest = source[at + ".route(".len()..].trim_start();
            let Some(quoted) = rest.strip_prefix('"') else {
                continue;
            };
            let path = quoted.split('"').next().unwrap_or_default();
            assert!(
                paths.contains_key(path),
                "{path} is missing from openapi.json"
            );
            n += 1;
        }
        assert!(n >= 10, "found only {n} routes");
    }

    /// Every verdict history holds is one the document names, in the answer and as a filter;
    /// a field that may be null says its type beside `nullable` (OpenAPI 3.0 ignores
    /// `nullable` without one, so a validator refused every `"decision": null`).
    #[test]
    fn openapi_names_every_verdict_and_types_every_nullable_field() {
        use hooklatch_core::store::Verdict;
        let doc: serde_json::Value = serde_json::from_str(OPENAPI).expect("openapi.json parses");
        let listed = |enumeration: &serde_json::Value| -> Vec<String> {
            let names = enumeration.as_array().expect("an enum");
            names
                .iter()
                .map(|v| v.as_str().unwrap().to_owned())
                .collect()
        };
        let in_answers = listed(
            &doc["components"]["schemas"]["RequestSummary"]["properties"]["verdict"]["enum"],
        );
        let parameters = doc["paths"]["/v1/requests"]["get"]["parameters"]
            .as_array()
            .expect("parameters");
        let filter = parameters
            .iter()
            .find(|p| p["name"] == "verdict")
            .expect("a verdict filter");
        let as_filter = listed(&filter["schema"]["enum"]);
        for verdict in [
            Verdict::Accepted,
            Verdict::Duplicate,
            Verdict::Conflict,
            Verdict::Rejected,
            Verdict::Handshake,
            Verdict::Imported,
        ] {
            let name = verdict.as_str().to_owned();
            assert!(in_answers.contains(&name), "{name}");
            assert!(as_filter.contains(&name), "{name}");
        }
        let mut untyped = Vec::new();
        walk(&doc, "", &mut untyped);
        assert!(untyped.is_empty(), "nullable without a type: {untyped:?}");
    }

    /// The paths of every schema in `value` with `nullable` and no `type`.
    fn walk(value: &serde_json::Value, at: &str, found: &mut Vec<String>) {
        match value {
            serde_json::Value::Object(map) => {
                if map.contains_key("nullable") && !map.contains_key("type") {
                    found.push(at.to_owned());
                }
                for (key, inner) in map {
                    walk(inner, &format!("{at}/{key}"), found);
                }
            }
            serde_json::Value::Array(items) => {
                for (i, inner) in items.iter().enumerate() {
                    walk(inner, &format!("{at}/{i}"), found);
                }
            }
            _ => {}
        }
    }
}
