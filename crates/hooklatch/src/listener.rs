//! The `hooklatch listen` client: connects to a gateway's `listen` destination, sends each
//! delivery on to a local URL byte-exact, and answers with the local status. See
//! [`crate::listen`] for the protocol and the gateway's side.
//!
//! The connection is kept: a refused or dropped connection is tried again after 1 s, doubling
//! up to 30 s, and a stream silent for three ping intervals counts as dropped. Deliveries that
//! arrive while the listener is away wait in the gateway's outbox and come on reconnect. A
//! wrong token or an unknown destination ends the run at once (nothing would change by
//! retrying), and so does another listener taking the destination over.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use base64::Engine as _;
use hooklatch_core::Secret;
use reqwest::{StatusCode, Url};
use tokio_util::sync::CancellationToken;

use crate::delivery::describe;
use crate::listen::{Frame, ListenDelivery, ListenResult, PING_EVERY};

/// What `hooklatch listen` needs.
#[derive(Debug, Clone)]
pub struct ListenOptions {
    /// The gateway's public base URL (where `/in/…` is served).
    pub gateway: Url,
    /// The `listen` destination's name.
    pub destination: String,
    /// Its `listen_token`.
    pub token: Secret,
    /// Where each delivery is POSTed, on this machine.
    pub forward_to: Url,
}

/// One line of what the listener did, for its output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenEvent {
    /// Connected; deliveries follow.
    Connected,
    /// Lost the connection or could not make it; trying again after the given time.
    Reconnecting {
        /// Why.
        reason: String,
        /// When.
        after: Duration,
    },
    /// A delivery was sent on and answered (or failed).
    Forwarded {
        /// The delivery's id (`dlv_…`).
        delivery: i64,
        /// Its attempt number.
        attempt: u32,
        /// The `Idempotency-Key` it carried.
        key: String,
        /// The provider's event type, if the gateway knew it.
        event_type: Option<String>,
        /// The local status, or the error.
        outcome: Result<u16, String>,
        /// How long the local URL took.
        elapsed: Duration,
    },
    /// The answer for a delivery could not be given to the gateway (it retries the delivery).
    AnswerLost {
        /// The delivery.
        delivery: i64,
        /// Why.
        reason: String,
    },
}

impl std::fmt::Display for ListenEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenEvent::Connected => write!(f, "connected; waiting for events"),
            ListenEvent::Reconnecting { reason, after } => {
                write!(f, "{reason}; reconnecting in {} s", after.as_secs())
            }
            ListenEvent::Forwarded {
                delivery,
                attempt,
                key,
                event_type,
                outcome,
                elapsed,
            } => {
                // The columns first, as for a status; why it failed at the end of the line.
                let (status, why) = match outcome {
                    Ok(status) => (status.to_string(), String::new()),
                    Err(error) => ("ERR".to_owned(), format!("  {error}")),
                };
                write!(
                    f,
                    "{status}  dlv_{delivery} #{attempt}  {key}  {}  {} ms{why}",
                    event_type.as_deref().unwrap_or("-"),
                    elapsed.as_millis()
                )
            }
            ListenEvent::AnswerLost { delivery, reason } => write!(
                f,
                "could not report dlv_{delivery} to the gateway ({reason}); it will come again"
            ),
        }
    }
}

/// How long a stream may stay silent before it counts as dropped.
const SILENCE: Duration = Duration::from_secs(PING_EVERY.as_secs() * 3);

/// How long a request to the gateway may take (an answer; the stream has its own limit).
const GATEWAY_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest wait between two connection tries.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Runs until `cancel`, or until the gateway refuses the listener for good (`Err`).
/// `report` is called with every [`ListenEvent`].
pub async fn run(
    options: ListenOptions,
    cancel: CancellationToken,
    report: impl Fn(ListenEvent) + Send + Sync + Clone + 'static,
) -> anyhow::Result<()> {
    let stream_url = endpoint(&options.gateway, &options.destination, false)?;
    let results_url = endpoint(&options.gateway, &options.destination, true)?;
    let gateway = crate::trust::client_builder()
        .no_proxy()
        .connect_timeout(Duration::from_secs(10))
        .user_agent(concat!("hooklatch-listen/", env!("CARGO_PKG_VERSION")))
        .build()
        .context("building the HTTP client")?;
    let local = crate::trust::client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .user_agent(concat!("hooklatch/", env!("CARGO_PKG_VERSION")))
        .build()
        .context("building the HTTP client")?;
    let token = options
        .token
        .expose_text()
        .context("the listen token is not UTF-8")?
        .to_owned();
    let mut backoff = Duration::from_secs(1);
    loop {
        let ended = tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            ended = listen_once(&gateway, &stream_url, &token, &report, |delivery| {
                let forward = Forward {
                    gateway: gateway.clone(),
                    local: local.clone(),
                    results: results_url.clone(),
                    token: token.clone(),
                    forward_to: options.forward_to.clone(),
                };
                let report = report.clone();
                tokio::spawn(async move { forward.run(delivery, report).await });
            }) => ended,
        };
        let reason = match ended {
            Ended::Refused(message) => bail!("{message}"),
            Ended::Replaced => bail!(
                "another listener connected for destination {:?}; this one stops",
                options.destination
            ),
            Ended::Dropped { reason, connected } => {
                if connected {
                    backoff = Duration::from_secs(1);
                }
                reason
            }
        };
        report(ListenEvent::Reconnecting {
            reason,
            after: backoff,
        });
        tokio::select! {
            _ = cancel.cancelled() => return Ok(()),
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// `{gateway}/listen/{destination}` or `…/results`, keeping any path the gateway's URL has.
fn endpoint(gateway: &Url, destination: &str, results: bool) -> anyhow::Result<Url> {
    let mut url = gateway.clone();
    {
        let mut segments = url
            .path_segments_mut()
            .map_err(|()| anyhow::anyhow!("--gateway {gateway} cannot take a path"))?;
        segments.pop_if_empty().push("listen").push(destination);
        if results {
            segments.push("results");
        }
    }
    Ok(url)
}

/// How one connection ended.
enum Ended {
    /// 401 or 404: a wrong token or an unknown destination.
    Refused(String),
    /// Another listener took the destination.
    Replaced,
    /// The connection failed, dropped, went silent, or the gateway shut down.
    Dropped { reason: String, connected: bool },
}

/// One connection: reads frames until it ends, handing each delivery to `deliver`.
async fn listen_once(
    gateway: &reqwest::Client,
    url: &Url,
    token: &str,
    report: &impl Fn(ListenEvent),
    deliver: impl Fn(ListenDelivery),
) -> Ended {
    let dropped = |reason: String, connected| Ended::Dropped { reason, connected };
    let mut res = match gateway.get(url.clone()).bearer_auth(token).send().await {
        Ok(res) => res,
        Err(err) => {
            return dropped(
                format!(
                    "cannot reach the gateway: {}",
                    describe(&err, GATEWAY_TIMEOUT)
                ),
                false,
            )
        }
    };
    match res.status() {
        StatusCode::OK => {}
        status @ (StatusCode::UNAUTHORIZED | StatusCode::NOT_FOUND) => {
            let body = res.text().await.unwrap_or_default();
            let json = serde_json::from_str::<serde_json::Value>(&body).ok();
            let code = json.as_ref().and_then(|v| v["code"].as_str());
            let message = json
                .as_ref()
                .and_then(|v| v["message"].as_str())
                .unwrap_or(&body);
            // The gateway says no more than that no listen destination has the name (its
            // listener is public); what to look at is said here.
            let hint = match (status, code) {
                (StatusCode::NOT_FOUND, Some("unknown_destination")) => {
                    "; a listen destination has listen_token where others have url or amqp \
                     (examples/listen.toml)"
                }
                (StatusCode::NOT_FOUND, _) => {
                    "; is --gateway the gateway's ingest listener (server.listen), not its \
                     admin API?"
                }
                _ => "",
            };
            return Ended::Refused(format!(
                "the gateway refused the listener ({status}): {message}{hint}"
            ));
        }
        status => return dropped(format!("the gateway answered {status}"), false),
    }
    let mut buffer: Vec<u8> = Vec::new();
    let mut connected = false;
    loop {
        let chunk = match tokio::time::timeout(SILENCE, res.chunk()).await {
            Err(_) => {
                return dropped(
                    format!("no word from the gateway for {} s", SILENCE.as_secs()),
                    connected,
                )
            }
            Ok(Err(err)) => {
                return dropped(
                    format!("connection lost: {}", describe(&err, GATEWAY_TIMEOUT)),
                    connected,
                )
            }
            Ok(Ok(None)) => return dropped("the gateway closed the stream".to_owned(), connected),
            Ok(Ok(Some(chunk))) => chunk,
        };
        buffer.extend_from_slice(&chunk);
        while let Some(end) = buffer.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = buffer.drain(..=end).collect();
            let frame = match serde_json::from_slice::<Frame>(&line) {
                Ok(frame) => frame,
                // A frame of a newer gateway: skipped.
                Err(err) => {
                    tracing::debug!(%err, "skipping a line the listener does not know");
                    continue;
                }
            };
            match frame {
                Frame::Ready { .. } => {
                    connected = true;
                    report(ListenEvent::Connected);
                }
                Frame::Delivery(delivery) => deliver(delivery),
                Frame::Ping => {}
                Frame::Replaced => return Ended::Replaced,
                Frame::Shutdown => {
                    return dropped("the gateway is shutting down".to_owned(), connected)
                }
            }
        }
    }
}

/// What sending one delivery on needs.
struct Forward {
    gateway: reqwest::Client,
    local: reqwest::Client,
    results: Url,
    token: String,
    forward_to: Url,
}

impl Forward {
    /// Sends `delivery` to the local URL, then reports the outcome to the gateway.
    async fn run(self, delivery: ListenDelivery, report: impl Fn(ListenEvent)) {
        let started = Instant::now();
        let outcome = self.send(&delivery).await;
        let elapsed = started.elapsed();
        let header = |name: &str| {
            delivery
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .and_then(|h| h.value.clone())
        };
        report(ListenEvent::Forwarded {
            delivery: delivery.delivery,
            attempt: delivery.attempt,
            key: header("idempotency-key").unwrap_or_default(),
            event_type: header("hooklatch-event-type"),
            outcome: outcome.clone(),
            elapsed,
        });
        let result = match outcome {
            Ok(status) => ListenResult {
                delivery: delivery.delivery,
                status: Some(status),
                error: None,
            },
            Err(error) => ListenResult {
                delivery: delivery.delivery,
                status: None,
                error: Some(error),
            },
        };
        // One retry on a connection error: the gateway retries the delivery anyway.
        let mut last = String::new();
        for _ in 0..2 {
            let sent = self
                .gateway
                .post(self.results.clone())
                .bearer_auth(&self.token)
                .timeout(GATEWAY_TIMEOUT)
                .json(&result)
                .send()
                .await;
            match sent {
                Ok(res) if res.status().is_success() => return,
                Ok(res) => {
                    last = format!("the gateway answered {}", res.status());
                    break;
                }
                Err(err) => last = describe(&err, GATEWAY_TIMEOUT),
            }
        }
        report(ListenEvent::AnswerLost {
            delivery: delivery.delivery,
            reason: last,
        });
    }

    /// POSTs the delivery to the local URL; its status, or why there is none.
    async fn send(&self, delivery: &ListenDelivery) -> Result<u16, String> {
        let body = base64::engine::general_purpose::STANDARD
            .decode(&delivery.body_base64)
            .map_err(|err| format!("the gateway sent a body that is not base64: {err}"))?;
        let mut req = self
            .local
            .post(self.forward_to.clone())
            .timeout(Duration::from_millis(delivery.timeout_ms.max(1)))
            .body(body);
        for header in &delivery.headers {
            if let Some(value) = header.bytes() {
                req = req.header(header.name.as_str(), value);
            }
        }
        // The error goes to the gateway's history: it names no URL (one may hold credentials).
        match req.send().await {
            Ok(res) => Ok(res.status().as_u16()),
            Err(err) if err.is_timeout() => Err(format!(
                "the local URL did not answer within {} ms",
                delivery.timeout_ms
            )),
            Err(err) => Err(format!(
                "the local URL: {}",
                describe(&err, Duration::from_millis(delivery.timeout_ms))
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failure's line has a success's columns, its reason after them.
    #[test]
    fn a_failed_forward_keeps_the_columns_of_a_status() {
        let line = |outcome| {
            ListenEvent::Forwarded {
                delivery: 3,
                attempt: 1,
                key: "stripe:evt_1".to_owned(),
                event_type: Some("invoice.paid".to_owned()),
                outcome,
                elapsed: Duration::from_millis(7),
            }
            .to_string()
        };
        assert_eq!(
            line(Ok(200)),
            "200  dlv_3 #1  stripe:evt_1  invoice.paid  7 ms"
        );
        assert_eq!(
            line(Err("the local URL: connection refused".to_owned())),
            "ERR  dlv_3 #1  stripe:evt_1  invoice.paid  7 ms  the local URL: connection refused"
        );
    }

    #[test]
    fn endpoints_keep_the_gateways_path() {
        let at = |base: &str, results| {
            endpoint(&base.parse().unwrap(), "laptop", results)
                .unwrap()
                .to_string()
        };
        assert_eq!(
            at("http://127.0.0.1:8080", false),
            "http://127.0.0.1:8080/listen/laptop"
        );
        assert_eq!(
            at("https://hooks.example.com/gw/", true),
            "https://hooks.example.com/gw/listen/laptop/results"
        );
    }

    #[tokio::test]
    async fn a_local_failure_sent_to_the_gateway_names_no_url() {
        // A port nothing listens on, behind a URL holding credentials.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = closed.local_addr().unwrap().port();
        drop(closed);
        let forward = Forward {
            gateway: reqwest::Client::new(),
            local: reqwest::Client::new(),
            results: "http://127.0.0.1:9/listen/laptop/results".parse().unwrap(),
            token: String::new(),
            forward_to: format!("http://user:s3cr3t@127.0.0.1:{port}/hooks?token=t0k3n")
                .parse()
                .unwrap(),
        };
        let delivery = ListenDelivery {
            delivery: 1,
            attempt: 1,
            timeout_ms: 5_000,
            headers: Vec::new(),
            body_base64: String::new(),
        };
        let err = forward.send(&delivery).await.unwrap_err();
        assert!(err.starts_with("the local URL: "), "{err}");
        for secret in ["s3cr3t", "t0k3n", "/hooks"] {
            assert!(!err.contains(secret), "{err}");
        }
    }

    #[test]
    fn a_forwarded_line_names_the_event_and_the_outcome() {
        let line = ListenEvent::Forwarded {
            delivery: 7,
            attempt: 2,
            key: "stripe:evt_1".to_owned(),
            event_type: Some("invoice.paid".to_owned()),
            outcome: Ok(200),
            elapsed: Duration::from_millis(12),
        }
        .to_string();
        assert_eq!(line, "200  dlv_7 #2  stripe:evt_1  invoice.paid  12 ms");
    }
}
