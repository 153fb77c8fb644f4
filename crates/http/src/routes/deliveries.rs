//! `/v1/deliveries`: the outbox and the dead-letter; redrive a dead-lettered delivery.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use hooklatch_core::store::{DeliveryFilter, DeliveryState, Redrive};
use hooklatch_core::{DeliveryId, Timestamp};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::extract::{ApiQuery, PathText};
use crate::routes::requests::{delivery_json, page_limit};
use crate::{AdminState, ApiError};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    state: Option<String>,
    destination: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
}

pub(crate) async fn list(
    State(state): State<Arc<AdminState>>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let filter_state = q
        .state
        .as_deref()
        .map(|s| {
            DeliveryState::parse(s).ok_or_else(|| {
                ApiError::bad_parameter("state must be one of pending, delivered, dead")
            })
        })
        .transpose()?;
    let before = q
        .cursor
        .as_deref()
        .filter(|c| !c.is_empty())
        .map(|c| DeliveryId::parse(c).ok_or_else(|| ApiError::bad_parameter("cursor is not valid")))
        .transpose()?;
    let limit = page_limit(q.limit)?;
    let items = state
        .store
        .list_deliveries(DeliveryFilter {
            state: filter_state,
            destination: q.destination,
            before,
            limit,
        })
        .await?;
    let next_cursor = (items.len() == limit as usize)
        .then(|| items.last().map(|d| d.id.to_string()))
        .flatten();
    Ok(Json(json!({
        "items": items.iter().map(delivery_json).collect::<Vec<_>>(),
        "next_cursor": next_cursor,
    })))
}

/// Moves a dead-lettered delivery back to the queue; it keeps its `Idempotency-Key`.
pub(crate) async fn retry(
    State(state): State<Arc<AdminState>>,
    PathText(id): PathText,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    let id = DeliveryId::parse(&id).ok_or_else(|| ApiError::not_found("no such delivery"))?;
    match state.store.redrive(id, Timestamp::now()).await? {
        Redrive::Queued => {
            state.enqueued.notify_one();
            tracing::info!(delivery = %id, "dead-lettered delivery queued again");
            Ok((
                StatusCode::ACCEPTED,
                Json(json!({ "id": id.to_string(), "state": "pending" })),
            ))
        }
        Redrive::NotFound => Err(ApiError::not_found("no such delivery")),
        Redrive::NotDead(current) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_dead_lettered",
            format!("delivery is {}, not in the dead-letter", current.as_str()),
        )),
    }
}
