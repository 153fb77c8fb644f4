//! A small client of a running gateway's admin API, for the CLI verbs that read history
//! (`replay`, `check`, `events export`).
//!
//! It speaks only the public `/v1` API, with the bearer token: `GET /v1/requests` (history,
//! filtered and paged), `GET /v1/requests/{id}` (one request, byte-exact) and
//! `GET /v1/deliveries` (to find the request behind a `dlv_` id: there is no single-delivery
//! route, but the list's `cursor` is "ids below this", so `cursor=dlv_{N+1}&limit=1` answers
//! exactly delivery N when it exists).

use std::time::Duration;

use hooklatch_core::{DeliveryId, RequestId, Secret, Timestamp};
use serde_json::Value;

use crate::capture::{Capture, CaptureError};

/// The admin API's address when none is given (the default `server.admin_listen`).
pub const DEFAULT_ADMIN_URL: &str = "http://127.0.0.1:8081";

/// Why the admin API could not answer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The request did not get an answer.
    #[error("calling the admin API at {base}{hint}")]
    Transport {
        /// The admin base URL.
        base: String,
        /// What to check when nothing answered there (empty otherwise).
        hint: &'static str,
        /// Why.
        #[source]
        source: reqwest::Error,
    },
    /// The API answered with an error.
    #[error("the admin API answered {status}: {message}")]
    Status {
        /// HTTP status.
        status: u16,
        /// The error's `message` (or body).
        message: String,
    },
    /// No such request or delivery.
    #[error("{0} not found on the gateway")]
    NotFound(String),
    /// What answered has no such route, or answered it with something other than the API's
    /// JSON: not a gateway's admin API.
    #[error(
        "{base} did not answer {path} as hooklatch's admin API: is --admin the gateway's admin \
         listener ([server] admin_listen), not its ingest listener or another service?"
    )]
    NotTheAdminApi {
        /// The admin base URL.
        base: String,
        /// The route asked for.
        path: String,
    },
    /// The id is neither `req_N` nor `dlv_N`.
    #[error("{0:?} is not a request or delivery id (req_N or dlv_N)")]
    BadId(String),
    /// The answer was not what the API documents.
    #[error(transparent)]
    Capture(#[from] CaptureError),
}

/// Which history to select (`GET /v1/requests` filters).
#[derive(Debug, Clone, Default)]
pub struct HistoryFilter {
    /// Only this source.
    pub source: Option<String>,
    /// Only this verdict (`accepted`, `duplicate`, `conflict`, `rejected`).
    pub verdict: Option<String>,
    /// Only requests carrying this event key.
    pub key: Option<String>,
    /// Received at or after.
    pub since: Option<Timestamp>,
    /// Received before.
    pub until: Option<Timestamp>,
    /// At most this many (newest first).
    pub limit: usize,
}

/// One capture an import took ([`AdminClient::import`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Imported {
    /// Its id on the gateway it was imported into.
    pub id: String,
    /// Its id on the gateway it was exported from, when the file says.
    pub from: Option<String>,
    /// It was imported before: `id` is that import's, and nothing was stored again.
    pub before: bool,
}

/// A client of one gateway's admin API.
#[derive(Debug, Clone)]
pub struct AdminClient {
    base: String,
    /// `base` as messages show it: without a password.
    shown: String,
    token: Option<Secret>,
    client: reqwest::Client,
}

impl AdminClient {
    /// A client for the admin API at `base` (`http://127.0.0.1:8081`), with its bearer token.
    pub fn new(base: &str, token: Option<Secret>) -> AdminClient {
        let client = crate::trust::client_builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .timeout(Duration::from_secs(30))
            .build()
            .expect("a client without TLS roots to load builds");
        let base = base.trim_end_matches('/').to_owned();
        let shown = match reqwest::Url::parse(&base) {
            Ok(mut url) if url.password().is_some() => {
                let _ = url.set_password(Some("***"));
                url.as_str().trim_end_matches('/').to_owned()
            }
            Ok(_) => base.clone(),
            // Not a URL: the request fails before any message quotes it but this one.
            Err(_) if base.contains('@') => "the --admin URL".to_owned(),
            Err(_) => base.clone(),
        };
        AdminClient {
            base,
            shown,
            token,
            client,
        }
    }

    /// The capture behind `id`: a request (`req_N`) or the request a delivery delivers (`dlv_N`).
    pub async fn capture(&self, id: &str) -> Result<Capture, AdminError> {
        let request = if id.starts_with(DeliveryId::PREFIX) {
            let delivery = DeliveryId::parse(id).ok_or_else(|| AdminError::BadId(id.to_owned()))?;
            self.request_of(delivery).await?
        } else if id.starts_with(RequestId::PREFIX) {
            RequestId::parse(id).ok_or_else(|| AdminError::BadId(id.to_owned()))?
        } else {
            return Err(AdminError::BadId(id.to_owned()));
        };
        self.request(request).await
    }

    /// One request, byte-exact.
    pub async fn request(&self, id: RequestId) -> Result<Capture, AdminError> {
        let value = self
            .get(&format!("/v1/requests/{id}"), &[])
            .await?
            .ok_or_else(|| AdminError::NotFound(id.to_string()))?;
        Ok(Capture::from_admin_json(&value)?)
    }

    /// The request a delivery belongs to.
    pub async fn request_of(&self, id: DeliveryId) -> Result<RequestId, AdminError> {
        let cursor = DeliveryId(id.0 + 1).to_string();
        let page = self
            .get(
                "/v1/deliveries",
                &[("cursor", cursor), ("limit", "1".to_owned())],
            )
            .await?
            .unwrap_or(Value::Null);
        let item = page["items"]
            .as_array()
            .and_then(|items| items.first())
            .filter(|item| item["id"].as_str() == Some(&id.to_string()))
            .ok_or_else(|| AdminError::NotFound(id.to_string()))?;
        item["request_id"]
            .as_str()
            .and_then(RequestId::parse)
            .ok_or_else(|| {
                AdminError::Capture(CaptureError::Format(format!(
                    "delivery {id} has no request_id"
                )))
            })
    }

    /// Request ids matching `filter`, newest first, following `next_cursor` up to its limit.
    pub async fn list(&self, filter: &HistoryFilter) -> Result<Vec<RequestId>, AdminError> {
        Ok(self
            .summaries(filter)
            .await?
            .iter()
            .filter_map(|item| item["id"].as_str().and_then(RequestId::parse))
            .collect())
    }

    /// The history lines matching `filter` (`GET /v1/requests` items: id, received_at, source,
    /// verdict, reason, status, keys, body_len), newest first, up to its limit.
    pub async fn summaries(&self, filter: &HistoryFilter) -> Result<Vec<Value>, AdminError> {
        let mut res = Vec::new();
        let mut cursor: Option<String> = None;
        while res.len() < filter.limit {
            let mut query: Vec<(&str, String)> = Vec::new();
            let mut add = |name: &'static str, value: Option<String>| {
                if let Some(v) = value {
                    query.push((name, v));
                }
            };
            add("source", filter.source.clone());
            add("verdict", filter.verdict.clone());
            add("key", filter.key.clone());
            add("since", filter.since.map(|t| t.as_millis().to_string()));
            add("until", filter.until.map(|t| t.as_millis().to_string()));
            add("cursor", cursor.take());
            add(
                "limit",
                Some((filter.limit - res.len()).min(500).to_string()),
            );
            let page = self
                .get("/v1/requests", &query)
                .await?
                .unwrap_or(Value::Null);
            let items = page["items"].as_array().cloned().unwrap_or_default();
            res.extend(items.iter().cloned());
            match page["next_cursor"].as_str() {
                Some(next) if !items.is_empty() => cursor = Some(next.to_owned()),
                _ => break,
            }
        }
        res.truncate(filter.limit);
        Ok(res)
    }

    /// GETs a JSON document; `None` on 404.
    async fn get(&self, path: &str, query: &[(&str, String)]) -> Result<Option<Value>, AdminError> {
        self.call(reqwest::Method::GET, path, query, None).await
    }

    /// Calls the API; `Ok(None)` for a 404, the JSON answer for a 2xx, an error otherwise.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Value>,
    ) -> Result<Option<Value>, AdminError> {
        let mut req = self
            .client
            .request(method, format!("{}{path}", self.base))
            .query(query);
        if let Some(body) = body {
            req = req.json(&body);
        }
        if let Some(token) = &self.token {
            req = req.bearer_auth(String::from_utf8_lossy(token.expose()));
        }
        let transport = |source: reqwest::Error| AdminError::Transport {
            base: self.shown.clone(),
            hint: match (source.is_connect(), untrusted(&source)) {
                (_, true) => {
                    " (its TLS certificate is not one this command trusts: --ca-file FILE \
                     names the CA that signed it)"
                }
                (true, false) => {
                    " (nothing answers there: is the gateway running, and is that its \
                     server.admin_listen? --config FILE reads it, --admin URL names it)"
                }
                (false, false) => "",
            },
            // Its message would quote the URL, password and all: `base` says where.
            source: source.without_url(),
        };
        let res = req.send().await.map_err(transport)?;
        let status = res.status().as_u16();
        let bytes = res.bytes().await.map_err(transport)?;
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status == 404 {
            // The API's own "no such request, delivery or destination" is an answer. Any other
            // 404 — a route this server does not have — means `--admin` names something else:
            // the ingest listener, another service. Reading that as "nothing there" would
            // report an empty dead-letter to a monitoring script.
            let message = value["message"].as_str().unwrap_or_default();
            let answered = match value["code"].as_str() {
                Some("not_found") => !message.starts_with(hooklatch_http::NO_ROUTE),
                Some(_) => true,
                None => false,
            };
            if answered {
                return Ok(None);
            }
            return Err(AdminError::NotTheAdminApi {
                base: self.shown.clone(),
                path: path.to_owned(),
            });
        }
        if !(200..300).contains(&status) {
            let message = value["message"]
                .as_str()
                .map(str::to_owned)
                .unwrap_or_else(|| String::from_utf8_lossy(&bytes).chars().take(200).collect());
            let hint = if status == 401 {
                " (set --token or HOOKLATCH_ADMIN_TOKEN)"
            } else {
                ""
            };
            return Err(AdminError::Status {
                status,
                message: format!("{message}{hint}"),
            });
        }
        // Every answer of the API is a JSON object: a page that says 200 to anything (a proxy's
        // login page, another service) is not an empty history or a done retry.
        if !value.is_object() {
            return Err(AdminError::NotTheAdminApi {
                base: self.shown.clone(),
                path: path.to_owned(),
            });
        }
        Ok(Some(value))
    }

    /// Deliberately delivers a request's events again (to one destination, or all of its
    /// source's); returns the new deliveries' ids.
    pub async fn redeliver(
        &self,
        id: RequestId,
        destination: Option<&str>,
    ) -> Result<Vec<String>, AdminError> {
        let body = destination.map(|d| serde_json::json!({ "destination": d }));
        let answer = self
            .call(
                reqwest::Method::POST,
                &format!("/v1/requests/{id}/redeliver"),
                &[],
                body,
            )
            .await?
            .ok_or_else(|| AdminError::NotFound(id.to_string()))?;
        Ok(answer["deliveries"]
            .as_array()
            .map(|ids| {
                ids.iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Dismisses a conflict, with an optional reason.
    pub async fn dismiss_conflict(
        &self,
        id: RequestId,
        reason: Option<&str>,
    ) -> Result<(), AdminError> {
        let body = reason.map(|r| serde_json::json!({ "reason": r }));
        self.call(
            reqwest::Method::POST,
            &format!("/v1/requests/{id}/dismiss"),
            &[],
            body,
        )
        .await?
        .ok_or_else(|| AdminError::NotFound(id.to_string()))?;
        Ok(())
    }

    /// Imports an export file's captures into the gateway's history (verdict `imported`);
    /// returns each capture's request id there and where it came from ([`Imported`]).
    pub async fn import(&self, export: Value) -> Result<Vec<Imported>, AdminError> {
        let answer = self
            .call(
                reqwest::Method::POST,
                "/v1/requests/import",
                &[],
                Some(export),
            )
            .await?
            .unwrap_or(Value::Null);
        Ok(answer["imported"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter_map(|i| {
                        Some(Imported {
                            id: i["request_id"].as_str()?.to_owned(),
                            from: i["original_request_id"].as_str().map(str::to_owned),
                            before: i["already_imported"].as_bool().unwrap_or(false),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Puts a dead-lettered delivery back in the queue.
    pub async fn retry_delivery(&self, id: DeliveryId) -> Result<(), AdminError> {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/deliveries/{id}/retry"),
            &[],
            None,
        )
        .await?
        .ok_or_else(|| AdminError::NotFound(id.to_string()))?;
        Ok(())
    }

    /// Every configured destination, with whether it is disabled (`GET /v1/destinations`).
    pub async fn destinations(&self) -> Result<Vec<Value>, AdminError> {
        let answer = self
            .get("/v1/destinations", &[])
            .await?
            .unwrap_or(Value::Null);
        Ok(answer["items"].as_array().cloned().unwrap_or_default())
    }

    /// Disables a destination (its deliveries wait); answers the destination as it is now.
    pub async fn disable_destination(
        &self,
        name: &str,
        reason: Option<&str>,
    ) -> Result<Value, AdminError> {
        let body = reason.map(|r| serde_json::json!({ "reason": r }));
        self.call(
            reqwest::Method::POST,
            &format!("/v1/destinations/{}/disable", path_segment(name)),
            &[],
            body,
        )
        .await?
        .ok_or_else(|| AdminError::NotFound(format!("destination {name:?}")))
    }

    /// Enables a disabled destination; answers it with `woken`, the deliveries made due.
    pub async fn enable_destination(&self, name: &str) -> Result<Value, AdminError> {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/destinations/{}/enable", path_segment(name)),
            &[],
            None,
        )
        .await?
        .ok_or_else(|| AdminError::NotFound(format!("destination {name:?}")))
    }

    /// Deliveries in `state` (`pending`, `delivered`, `dead`), newest first, up to `limit`.
    pub async fn deliveries(
        &self,
        state: &str,
        destination: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Value>, AdminError> {
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        while items.len() < limit {
            let mut query = vec![
                ("state", state.to_owned()),
                ("limit", (limit - items.len()).min(500).to_string()),
            ];
            if let Some(d) = destination {
                query.push(("destination", d.to_owned()));
            }
            if let Some(c) = &cursor {
                query.push(("cursor", c.clone()));
            }
            let page = self
                .get("/v1/deliveries", &query)
                .await?
                .unwrap_or(Value::Null);
            items.extend(page["items"].as_array().cloned().unwrap_or_default());
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => break,
            }
        }
        Ok(items)
    }
}

/// `name` as one URL path segment: unreserved characters as they are, every other byte
/// percent-encoded.
fn path_segment(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl AdminClient {
    /// The captures named by a CLI argument: a `req_N`/`dlv_N` id (fetched from the gateway)
    /// or the path of an export file.
    pub async fn resolve(&self, arg: &str) -> Result<Vec<Capture>, AdminError> {
        let looks_like_id = [RequestId::PREFIX, DeliveryId::PREFIX].iter().any(|p| {
            arg.strip_prefix(p)
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        });
        if looks_like_id && !std::path::Path::new(arg).exists() {
            return Ok(vec![self.capture(arg).await?]);
        }
        Ok(crate::capture::load_file(std::path::Path::new(arg))?)
    }

    /// The captures to export: the ids given, else the history matching `filter`. Requests
    /// whose body was not kept whole are skipped and named in the second list.
    pub async fn collect(
        &self,
        ids: &[String],
        filter: &HistoryFilter,
    ) -> Result<(Vec<Capture>, Vec<String>), AdminError> {
        let mut captures = Vec::new();
        let mut skipped = Vec::new();
        let mut add = |res: Result<Capture, AdminError>, id: String| match res {
            Ok(c) => {
                captures.push(c);
                Ok(())
            }
            Err(AdminError::Capture(CaptureError::Truncated(_))) => {
                skipped.push(id);
                Ok(())
            }
            Err(e) => Err(e),
        };
        if ids.is_empty() {
            for id in self.list(filter).await? {
                add(self.request(id).await, id.to_string())?;
            }
        } else {
            for id in ids {
                add(self.capture(id).await, id.clone())?;
            }
        }
        Ok((captures, skipped))
    }
}
/// Whether `err` (or what it wraps) is a certificate the client refused.
fn untrusted(err: &reqwest::Error) -> bool {
    let mut source: Option<&dyn std::error::Error> = Some(err);
    while let Some(e) = source {
        if e.to_string().contains("certificate") {
            return true;
        }
        source = e.source();
    }
    false
}
