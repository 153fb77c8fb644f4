//! Route handlers, one file per resource; the path follows the URL.

pub(crate) mod deliveries;
pub(crate) mod health;
pub(crate) mod ingest;
pub(crate) mod requests;

use std::sync::Arc;

use axum::extract::{Request, State};
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
        .route("/v1/deliveries", get(deliveries::list))
        .route("/v1/deliveries/{id}/retry", post(deliveries::retry))
        .route("/metrics", get(health::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_token));
    Router::new()
        .merge(protected)
        .route("/healthz", get(health::healthz))
        .route("/readyz", get(health::readyz))
        .fallback(not_found)
        .with_state(state)
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

/// Checks `Authorization: Bearer <token>` in constant time.
async fn require_token(State(state): State<Arc<AdminState>>, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
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
