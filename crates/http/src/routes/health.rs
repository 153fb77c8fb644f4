//! `/healthz` (the process answers), `/readyz` (it can take traffic) and `/metrics`.
//!
//! The probes need no token: they reveal nothing but up or down, and orchestrators call them
//! without credentials. `/metrics` is behind the token like the API.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hooklatch_core::StoreError;
use serde_json::json;

use crate::AdminState;

pub(crate) async fn healthz() -> Json<serde_json::Value> {
    Json(json!({ "status": "ok" }))
}

pub(crate) async fn readyz(State(state): State<Arc<AdminState>>) -> Response {
    match not_ready_because(&state).await {
        Some(reason) => not_ready(reason),
        None => Json(json!({ "status": "ready" })).into_response(),
    }
}

/// Why the gateway cannot take traffic now, if it cannot: starting or shutting down, or the
/// store or key store not answering (what `/readyz` says, and `hooklatch_ready` counts).
pub(crate) async fn not_ready_because(state: &AdminState) -> Option<&'static str> {
    if let Some(reason) = state.readiness.not_ready_because() {
        return Some(reason);
    }
    match state.store.ping().await {
        Ok(()) => {}
        // Not logged here, on every check: the store logs once when it fills, and once when
        // it has room again.
        Err(StoreError::Full) => return Some("store full"),
        Err(err) => {
            tracing::warn!(%err, "readiness check: store failed");
            return Some("store unavailable");
        }
    }
    if let Some(keys) = &state.keys {
        if let Err(err) = keys.ping().await {
            tracing::warn!(%err, "readiness check: key store failed");
            return Some("key store unavailable");
        }
    }
    None
}

fn not_ready(reason: &str) -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        Json(json!({ "status": "not_ready", "reason": reason })),
    )
        .into_response()
}

pub(crate) async fn metrics(State(state): State<Arc<AdminState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        (state.metrics)(),
    )
        .into_response()
}
