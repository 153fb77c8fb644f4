//! `/v1/destinations`: the configured destinations and whether each is disabled; disable one
//! (its deliveries wait, uncounted) or enable it (they are due at once).
//!
//! A destination is disabled by an operator here, or by the delivery worker when it answers
//! `410 Gone`. The store keeps the state for every instance and across restarts; the change
//! runs in a task of its own, so a client hanging up cannot leave this instance's copy and the
//! store telling different stories.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use hooklatch_core::store::DisabledDestination;
use hooklatch_core::Timestamp;
use serde_json::{json, Value};

use crate::extract::{optional_reason, ApiBytes, PathText};
use crate::{AdminState, ApiError};

fn destination_json(name: &str, kind: &str, disabled: Option<&DisabledDestination>) -> Value {
    json!({
        "name": name,
        "kind": kind,
        "enabled": disabled.is_none(),
        "disabled_at": disabled.map(|d| d.disabled_at.to_rfc3339()),
        "disabled_reason": disabled.map(|d| d.reason.as_str()),
    })
}

/// The kind of a configured destination, or 404.
fn kind_of<'a>(state: &'a AdminState, name: &str) -> Result<&'a str, ApiError> {
    state
        .destination_kinds
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, kind)| *kind)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_destination",
                format!("no destination {name:?} is configured"),
            )
        })
}

pub(crate) async fn list(State(state): State<Arc<AdminState>>) -> Result<Json<Value>, ApiError> {
    // The store's list, not this instance's copy: another instance may have changed it.
    let disabled = state.store.disabled_destinations().await?;
    let items: Vec<Value> = state
        .destination_kinds
        .iter()
        .map(|(name, kind)| {
            destination_json(name, kind, disabled.iter().find(|d| &d.destination == name))
        })
        .collect();
    Ok(Json(json!({ "items": items })))
}

pub(crate) async fn disable(
    State(state): State<Arc<AdminState>>,
    PathText(name): PathText,
    ApiBytes(body): ApiBytes,
) -> Result<Json<Value>, ApiError> {
    let reason = optional_reason(&body)?;
    let kind = kind_of(&state, &name)?;
    let reason = reason.unwrap_or_else(|| "disabled by an operator".to_owned());
    let disabled = DisabledDestination {
        destination: name.clone(),
        disabled_at: Timestamp::now(),
        reason,
    };
    let (copy, store) = (state.disabled.clone(), state.store.clone());
    let added = tokio::spawn(async move { copy.disable(store.as_ref(), disabled).await })
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "disabling the destination failed",
            )
        })??;
    if added {
        tracing::warn!(destination = %name, "destination disabled by an operator: its deliveries wait");
        metrics::gauge!("hooklatch_destination_disabled", "destination" => name.clone()).set(1.0);
    }
    Ok(Json(destination_json(
        &name,
        kind,
        state.disabled.get(&name).as_ref(),
    )))
}

pub(crate) async fn enable(
    State(state): State<Arc<AdminState>>,
    PathText(name): PathText,
) -> Result<Json<Value>, ApiError> {
    let kind = kind_of(&state, &name)?;
    let (copy, store, who) = (state.disabled.clone(), state.store.clone(), name.clone());
    let woken =
        tokio::spawn(async move { copy.enable(store.as_ref(), &who, Timestamp::now()).await })
            .await
            .map_err(|_| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "enabling the destination failed",
                )
            })??;
    let Some(woken) = woken else {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_disabled",
            format!("destination {name:?} is not disabled"),
        ));
    };
    state.enqueued.notify_one();
    metrics::gauge!("hooklatch_destination_disabled", "destination" => name.clone()).set(0.0);
    tracing::info!(destination = %name, woken, "destination enabled: its deliveries are due");
    let mut body = destination_json(&name, kind, None);
    body["woken"] = json!(woken);
    Ok(Json(body))
}
