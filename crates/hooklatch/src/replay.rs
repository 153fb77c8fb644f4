//! Replay: send a [`Capture`] again, N times, K at a time, and report what came back.
//!
//! A replay goes straight at a handler (`Target::Url`: does the application's guard hold?) or
//! through a gateway's ingest (`Target::Gateway`: `POST {gateway}{path}`, does hooklatch's
//! dedup hold?). Each request carries the captured body byte-exact and the captured headers,
//! less the transport ones (`host`, `content-length`, hop-by-hop) that the HTTP client writes
//! itself.
//!
//! **Signing.** A capture's signature is the provider's, made when it was sent; schemes that
//! sign a timestamp (Stripe, Standard Webhooks, Slack, Paddle, Discord) refuse it once it is
//! older than their tolerance. [`Signing::Resign`] signs each request afresh with the source's
//! secret — a fresh timestamp, the capture's own event key and type, the target URL (Twilio
//! signs it) — and puts the new signature headers in place of the old ones.
//! [`Signing::Original`] sends the headers as captured. The signer comes from the gateway's
//! config (the capture's source: its adapter and first secret) or from a provider name and a
//! secret ([`Signer::for_provider`]).
//!
//! The report ([`ReplayReport`]) counts status codes and, through a gateway, its answers
//! (`accepted`, `duplicate`, `conflict`, or the refusal's `code`), with latency percentiles
//! from an HDR histogram. Rendering is here too, as text and as JSON, so the CLI only prints.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use hooklatch_core::provider::{InboundRequest, SignRequest};
use hooklatch_core::{ProviderAdapter, Secret, Timestamp};
use serde_json::{json, Value};

use crate::capture::{is_redacted, Capture};
use crate::config::Settings;

/// Headers the HTTP client writes itself, never copied from a capture.
const TRANSPORT_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
    "expect",
];

/// Providers whose signature covers the URL the request was sent to.
const URL_SIGNERS: &[&str] = &["twilio"];

/// How much of a response body a report keeps (enough for an error's `code` and `message`).
const BODY_KEPT: usize = 512;

/// Why a replay could not run (a response that is not 2xx is a result, not an error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplayError {
    /// The capture's source is not in the configuration.
    #[error("source {0:?} is not in the configuration; pass --provider and --secret instead")]
    UnknownSource(String),
    /// No adapter signs for this provider without a source's settings.
    #[error("cannot sign for provider {0:?} without its source's settings; pass --config")]
    UnknownProvider(String),
    /// `--resign` without a secret to sign with.
    #[error("re-signing {0} needs its signing secret: pass --config (the gateway's config) or --provider and --secret")]
    NoSecret(String),
    /// A capture the gateway rejected when it came, to be re-signed without
    /// `--resign-rejected`.
    #[error(
        "{0} was rejected when it came (its signature, key or body did not pass), so nothing \
         vouches for its body and a fresh signature would: send it as captured with --original \
         (the receiver checks it again), or pass --resign-rejected if you know it is genuine \
         (refused while the source's secret was wrong)"
    )]
    Rejected(String),
    /// A captured header cannot be sent.
    #[error("header {0:?} cannot be sent as captured")]
    BadHeader(String),
    /// The target URL or method is not usable.
    #[error("{0}")]
    BadTarget(String),
    /// `--secret` cannot be the provider's (`crate::fixtures::secret_shape`).
    #[error("--secret: {0}")]
    BadSecret(String),
}

/// Where replayed requests go.
#[derive(Debug, Clone)]
pub enum Target {
    /// Straight at this URL (a handler).
    Url(String),
    /// Through a gateway's ingest: `{base}{captured path}` (`/in/{source}`).
    Gateway(String),
}

impl Target {
    /// The URL a capture is sent to. A URL target without a query of its own gets the
    /// capture's query: for a GET (Twilio's voice webhooks) the event's parameters are there.
    pub fn url_for(&self, capture: &Capture) -> String {
        match self {
            Target::Url(url) => match capture.path.split_once('?') {
                Some((_, query)) if !url.contains('?') && !query.is_empty() => {
                    match url.split_once('#') {
                        Some((before, fragment)) => format!("{before}?{query}#{fragment}"),
                        None => format!("{url}?{query}"),
                    }
                }
                _ => url.clone(),
            },
            Target::Gateway(base) => {
                let base = base.trim_end_matches('/');
                if capture.path.starts_with("/in/") {
                    format!("{base}{}", capture.path)
                } else {
                    format!("{base}/in/{}", capture.source)
                }
            }
        }
    }
}

/// A provider's signer and the secret it signs with.
#[derive(Debug, Clone)]
pub struct Signer {
    adapter: Arc<dyn ProviderAdapter>,
    secret: Secret,
}

/// Whether requests are re-signed.
#[derive(Debug, Clone)]
pub enum Signing {
    /// A fresh signature (and timestamp) on every request.
    Resign(Signer),
    /// The headers as captured.
    Original,
    /// Each request as the gateway delivers the event to a destination: the code the
    /// gateway's worker sends with, so `Idempotency-Key`, the `hooklatch-*` headers, and with
    /// a destination secret a Standard Webhooks signature a handler behind hooklatch verifies
    /// (`hooklatch_guard::VerifiedDelivery`).
    AsDelivered(AsDelivered),
}

/// How the gateway delivers to the destination a capture is sent to ([`Signing::AsDelivered`]).
#[derive(Debug, Clone, Default)]
pub struct AsDelivered {
    /// The destination's `secret`: a Standard Webhooks signature of each request.
    pub secret: Option<Secret>,
    /// The source's signer: the provider's timestamped signature made again for each request,
    /// as the gateway does (`provider_signature = "fresh"`), when the capture's signature is
    /// its secret's.
    pub signer: Option<Signer>,
}

impl Signing {
    /// A short description for reports: `re-signed (stripe, as sent)` or `original headers`
    /// (whatever signature they hold, if any).
    pub fn describe(&self) -> String {
        match self {
            // "As sent": each request is signed as it goes, with the time then where the
            // provider signs one (GitHub signs none).
            Signing::Resign(s) => format!("re-signed ({}, as sent)", s.provider()),
            Signing::Original => "original headers".to_owned(),
            Signing::AsDelivered(AsDelivered {
                secret: Some(_), ..
            }) => {
                "as the gateway delivers (Standard Webhooks, the destination's secret)".to_owned()
            }
            Signing::AsDelivered(AsDelivered { secret: None, .. }) => {
                "as the gateway delivers (Idempotency-Key, no destination secret)".to_owned()
            }
        }
    }
}

impl Signer {
    /// A signer from an adapter and a secret.
    pub fn new(adapter: Arc<dyn ProviderAdapter>, secret: Secret) -> Signer {
        Signer { adapter, secret }
    }

    /// The signer of a provider by name (every provider but `generic`); for Discord the
    /// secret is the private key seed (64 hex characters).
    pub fn for_provider(provider: &str, secret: Secret) -> Result<Signer, ReplayError> {
        let adapter = crate::fixtures::signer(provider, &secret)
            .ok_or_else(|| ReplayError::UnknownProvider(provider.to_owned()))?;
        crate::fixtures::secret_shape(provider, &secret).map_err(ReplayError::BadSecret)?;
        Ok(Signer {
            adapter: Arc::from(adapter),
            secret,
        })
    }

    /// The signer of the configured source `source`: its adapter and first secret. `None` when
    /// the source has no secret hooklatch can sign with (Discord holds only a public key).
    pub fn from_settings(settings: &Settings, source: &str) -> Result<Option<Signer>, ReplayError> {
        let configured = settings
            .sources
            .iter()
            .find(|s| s.name.as_str() == source)
            .ok_or_else(|| ReplayError::UnknownSource(source.to_owned()))?;
        Ok(configured.secrets.first().map(|secret| Signer {
            adapter: configured.adapter.clone(),
            secret: secret.clone(),
        }))
    }

    /// This signer for requests sent straight at a handler: a provider that signs the URL
    /// (Twilio) signs the URL the request is sent to, not the gateway's `public_url` — the
    /// handler checks the address it was called at, which is not the gateway's.
    pub fn straight(self) -> Signer {
        if !URL_SIGNERS.contains(&self.provider()) {
            return self;
        }
        match crate::fixtures::signer(self.provider(), &self.secret) {
            Some(adapter) => Signer {
                adapter: Arc::from(adapter),
                secret: self.secret,
            },
            None => self,
        }
    }

    /// The provider's name.
    pub fn provider(&self) -> &'static str {
        self.adapter.provider()
    }

    /// The adapter.
    pub fn adapter(&self) -> &dyn ProviderAdapter {
        &*self.adapter
    }

    /// The event key(s) and first type the provider's adapter finds in these headers and body.
    pub fn extract(
        &self,
        headers: &[(String, Vec<u8>)],
        body: &[u8],
    ) -> Option<(Vec<String>, Option<String>)> {
        let map = header_map(headers);
        let req = InboundRequest {
            path_and_query: "/",
            headers: &map,
            body,
            now: Timestamp::now(),
        };
        let events = self.adapter.extract(&req).ok()?;
        let event_type = events.first().and_then(|e| e.event_type.clone());
        Some((
            events.iter().map(|e| e.key.to_string()).collect(),
            event_type,
        ))
    }

    /// The capture's headers with a fresh signature for `url` at `now`: every header the
    /// provider's signer writes replaces the captured header of that name (or is added). The
    /// event key and type signed are the ones the adapter finds in the capture itself, so key
    /// headers (`X-GitHub-Delivery`, `webhook-id`) keep their values.
    pub fn sign(&self, capture: &Capture, url: &str, now: Timestamp) -> Vec<(String, Vec<u8>)> {
        let (keys, event_type) = self
            .extract(&capture.headers, &capture.body)
            .unwrap_or_else(|| (capture.keys.clone(), None));
        let key = keys.first().cloned().unwrap_or_default();
        let signed = self.adapter.sign(&SignRequest {
            body: &capture.body,
            secret: &self.secret,
            now,
            event_key: &key,
            event_type: event_type.as_deref(),
            url,
        });
        // A Standard Webhooks capture sent with Svix's header names is verified by those names.
        let svix = self.adapter.provider() == "standard-webhooks"
            && capture.header("svix-signature").is_some();
        let mut headers = capture.headers.clone();
        for (name, value) in signed {
            let name = match name.strip_prefix("webhook-") {
                Some(rest) if svix => format!("svix-{rest}"),
                _ => name,
            };
            // In place of the captured header, under its captured name; else appended.
            match headers
                .iter()
                .position(|(n, _)| n.eq_ignore_ascii_case(&name))
            {
                Some(at) => {
                    headers[at].1 = value.into_bytes();
                    let kept = headers[at].0.clone();
                    let mut seen = false;
                    headers.retain(|(n, _)| {
                        let same = n.eq_ignore_ascii_case(&kept);
                        let keep = !same || !seen;
                        seen |= same;
                        keep
                    });
                }
                None => headers.push((name, value.into_bytes())),
            }
        }
        headers
    }
}

/// What the user asked for: `--resign`, `--original`, or neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignMode {
    /// Re-sign when a secret is known, else send the original signature.
    Auto,
    /// Re-sign; an error without a secret.
    Resign,
    /// Send the captured headers.
    Original,
}

/// The signer for `capture` sent to `target`: the one given (`--provider`/`--secret`), else
/// its source's in the gateway's `settings` ([`Signer::straight`] when the target is a
/// handler, not the gateway). `None` when neither knows a secret for it.
pub fn signer_for(
    capture: &Capture,
    given: Option<&Signer>,
    settings: Option<&Settings>,
    target: &Target,
) -> Result<Option<Signer>, ReplayError> {
    if let Some(signer) = given {
        return Ok(Some(signer.clone()));
    }
    let configured = match settings {
        Some(settings) => Signer::from_settings(settings, &capture.source)?,
        None => None,
    };
    Ok(match target {
        Target::Url(_) => configured.map(Signer::straight),
        Target::Gateway(_) => configured,
    })
}

/// Resolves `mode` for one capture, with a line saying what was chosen and why. A capture
/// the gateway rejected ([`Capture::was_refused`]) is re-signed only with `resign_rejected`.
pub fn choose_signing(
    mode: SignMode,
    signer: Option<Signer>,
    capture: &Capture,
    resign_rejected: bool,
    now: Timestamp,
) -> Result<(Signing, String), ReplayError> {
    let label = capture.label();
    match (mode, signer) {
        (SignMode::Original, _) | (SignMode::Auto, None) => {
            let mut note = match mode {
                SignMode::Original => format!("{label}: sending the captured headers (--original)"),
                _ => format!(
                    "{label}: no signing secret (--config, or --provider and --secret): sending the captured headers"
                ),
            };
            let age = now.since(Timestamp(capture.received_at_ms));
            let signs_time = capture
                .provider
                .as_deref()
                .is_some_and(|p| hooklatch_core::provider::TIMESTAMP_SIGNERS.contains(&p));
            if !capture
                .headers
                .iter()
                .any(|(name, _)| crate::capture::is_signature_header(name))
            {
                note.push_str(
                    "; it holds no signature header (an export leaves them out unless --keep-signatures), so a receiver that checks one refuses it",
                );
            } else if signs_time && age > Duration::from_secs(300) {
                let _ = write!(
                    note,
                    "; it is {} min old, and {} refuses a signed timestamp older than its tolerance (300 s by default)",
                    age.as_secs() / 60,
                    capture.provider.as_deref().unwrap_or_default()
                );
            }
            Ok((Signing::Original, note))
        }
        (SignMode::Resign, None) => Err(ReplayError::NoSecret(label)),
        (_, Some(_)) if capture.was_refused() && !resign_rejected => {
            Err(ReplayError::Rejected(label))
        }
        (_, Some(signer)) => {
            let mut note = format!(
                "{label}: re-signing with the {} secret as each request is sent",
                signer.provider()
            );
            // `--provider github` on a Stripe capture: signed as asked, but the receiver
            // expects the capture's provider's scheme.
            if let Some(from) = capture
                .provider
                .as_deref()
                .filter(|p| *p != signer.provider())
            {
                note.push_str(&format!(
                    " (warning: the capture came from {from}; a receiver of {from} webhooks \
                     checks {from}'s signature, not {}'s)",
                    signer.provider()
                ));
            }
            Ok((Signing::Resign(signer), note))
        }
    }
}

/// How to replay.
#[derive(Debug, Clone)]
pub struct ReplayOptions {
    /// Where to.
    pub target: Target,
    /// How many requests in all.
    pub times: u32,
    /// At most this many in flight.
    pub concurrency: u32,
    /// The time between the starts of consecutive requests.
    pub delay: Duration,
    /// Re-signed or as captured.
    pub signing: Signing,
    /// Time allowed for one request.
    pub timeout: Duration,
}

/// One response (or transport failure).
#[derive(Debug, Clone)]
pub struct Response {
    /// 1-based position in the replay.
    pub n: u32,
    /// HTTP status, when one came back.
    pub status: Option<u16>,
    /// The transport error, when none did.
    pub error: Option<String>,
    /// Time to the response head.
    pub latency: Duration,
    /// The gateway's answer: its `status` (`accepted`, `duplicate`, `conflict`) or refusal
    /// `code` (`stale_timestamp`), when the body is hooklatch's JSON.
    pub answer: Option<String>,
    /// The start of the response body.
    pub body: Vec<u8>,
}

impl Response {
    /// A 2xx came back.
    pub fn is_success(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }

    /// `200`, `401 stale_timestamp`, or the transport error.
    pub fn describe(&self) -> String {
        match (self.status, &self.answer, &self.error) {
            (Some(s), Some(a), _) => format!("{s} {a}"),
            (Some(s), None, _) => s.to_string(),
            (None, _, Some(e)) => e.clone(),
            (None, _, None) => "no response".to_owned(),
        }
    }
}

/// What a replay of one capture did.
#[derive(Debug, Clone)]
pub struct ReplayReport {
    /// The capture's label.
    pub capture: String,
    /// Where it was sent.
    pub url: String,
    /// How it was signed.
    pub signing: String,
    /// The concurrency used.
    pub concurrency: u32,
    /// Every response, in completion order.
    pub responses: Vec<Response>,
}

impl ReplayReport {
    /// Every response was a 2xx.
    pub fn ok(&self) -> bool {
        self.responses.iter().all(Response::is_success)
    }

    /// Count per status code (`"200"`), transport failures under `"error"`.
    pub fn statuses(&self) -> BTreeMap<String, u32> {
        let mut res = BTreeMap::new();
        for r in &self.responses {
            let k = r.status.map_or("error".to_owned(), |s| s.to_string());
            *res.entry(k).or_insert(0) += 1;
        }
        res
    }

    /// Count per gateway answer (`accepted`, `duplicate`, …), when the target answered with
    /// hooklatch's JSON.
    pub fn answers(&self) -> BTreeMap<String, u32> {
        let mut res = BTreeMap::new();
        for a in self.responses.iter().filter_map(|r| r.answer.clone()) {
            *res.entry(a).or_insert(0) += 1;
        }
        res
    }

    /// Latency at `quantile` (0.5, 0.99, 1.0) over the responses that came back, in ms.
    pub fn latency_ms(&self, quantile: f64) -> Option<f64> {
        latency_ms(&self.responses, quantile)
    }

    /// The report as text: a summary table and the failures.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "replay {} → {}", self.capture, self.url);
        let _ = writeln!(
            out,
            "  {}, concurrency {}, {}",
            crate::counted(self.responses.len() as u64, "request", "requests"),
            self.concurrency,
            self.signing
        );
        out.push_str(&status_table(&self.responses));
        let _ = writeln!(out, "  latency  {}", latency_line(&self.responses));
        out.push_str(&failures(&self.responses));
        out
    }

    /// The report as JSON, for scripts.
    pub fn to_json(&self) -> Value {
        json!({
            "capture": self.capture,
            "url": self.url,
            "signing": self.signing,
            "concurrency": self.concurrency,
            "sent": self.responses.len(),
            "ok": self.ok(),
            "statuses": self.statuses(),
            "answers": self.answers(),
            "latency_ms": {
                "p50": self.latency_ms(0.5),
                "p99": self.latency_ms(0.99),
                "max": self.latency_ms(1.0),
            },
            "responses": self.responses.iter().map(response_json).collect::<Vec<_>>(),
        })
    }
}

/// Replays `capture` as `opts` says, calling `on_response` as each response comes back (for a
/// progress bar).
pub async fn replay(
    capture: &Capture,
    opts: &ReplayOptions,
    on_response: &(dyn Fn(&Response) + Sync),
) -> Result<ReplayReport, ReplayError> {
    let url = opts.target.url_for(capture);
    let responses = send_many(capture, &url, opts, on_response).await?;
    Ok(ReplayReport {
        capture: capture.label(),
        url,
        signing: opts.signing.describe(),
        concurrency: opts.concurrency.max(1),
        responses,
    })
}

/// Sends `capture` to `url` `opts.times` times; the responses in completion order.
pub(crate) async fn send_many(
    capture: &Capture,
    url: &str,
    opts: &ReplayOptions,
    on_response: &(dyn Fn(&Response) + Sync),
) -> Result<Vec<Response>, ReplayError> {
    let client = http_client(opts.timeout);
    let method = match &opts.signing {
        // A delivery is a POST (a GET's query becomes its form body).
        Signing::AsDelivered(_) => reqwest::Method::POST,
        _ => reqwest::Method::from_bytes(capture.method.as_bytes()).map_err(|_| {
            ReplayError::BadTarget(format!("method {:?} is not valid", capture.method))
        })?,
    };
    if matches!(opts.signing, Signing::AsDelivered(_)) && matches!(opts.target, Target::Gateway(_))
    {
        return Err(ReplayError::BadTarget(
            "a request made as the gateway delivers goes to the handler behind it (--to), not \
             through the gateway's ingest"
                .to_owned(),
        ));
    }
    reqwest::Url::parse(url).map_err(|e| ReplayError::BadTarget(format!("{url}: {e}")))?;
    // Checked once up front, so a bad header fails the replay instead of every request.
    headers_for(capture, &opts.signing, url, Timestamp::now(), 1)?;
    let started = tokio::time::Instant::now();
    let mut stream = futures::stream::iter(0..opts.times)
        .map(|i| {
            let (client, method) = (client.clone(), method.clone());
            async move {
                tokio::time::sleep_until(started + opts.delay * i).await;
                // Signed at send time: a slow replay keeps every timestamp fresh.
                let (headers, body) =
                    headers_for(capture, &opts.signing, url, Timestamp::now(), i + 1)
                        .expect("headers were checked before the first request");
                send_one(&client, method, url, headers, body, i + 1).await
            }
        })
        .buffer_unordered(opts.concurrency.max(1) as usize);
    let mut res = Vec::with_capacity(opts.times as usize);
    while let Some(response) = stream.next().await {
        on_response(&response);
        res.push(response);
    }
    Ok(res)
}

/// The client replays use: no redirects followed, no proxy from the environment.
pub(crate) fn http_client(timeout: Duration) -> reqwest::Client {
    crate::trust::client_builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .timeout(timeout)
        .user_agent(concat!("hooklatch-replay/", env!("CARGO_PKG_VERSION")))
        .build()
        .expect("a client without TLS roots to load builds")
}

/// The headers and body of request `n`: captured, less transport and credential headers,
/// re-signed or not, or as the gateway would deliver the capture ([`as_delivered`]).
fn headers_for(
    capture: &Capture,
    signing: &Signing,
    url: &str,
    now: Timestamp,
    n: u32,
) -> Result<(reqwest::header::HeaderMap, Vec<u8>), ReplayError> {
    let (headers, body) = match signing {
        Signing::Resign(signer) => (signer.sign(capture, url, now), capture.body.clone()),
        Signing::Original => (capture.headers.clone(), capture.body.clone()),
        Signing::AsDelivered(how) => as_delivered(capture, how, n, now)?,
    };
    let mut map = reqwest::header::HeaderMap::new();
    for (name, value) in headers {
        let lower = name.to_ascii_lowercase();
        if TRANSPORT_HEADERS.contains(&lower.as_str()) || is_redacted(&lower) {
            continue;
        }
        let header_name = reqwest::header::HeaderName::from_bytes(lower.as_bytes())
            .map_err(|_| ReplayError::BadHeader(name.clone()))?;
        let header_value = reqwest::header::HeaderValue::from_bytes(&value)
            .map_err(|_| ReplayError::BadHeader(name.clone()))?;
        map.append(header_name, header_value);
    }
    Ok((map, body))
}

/// A request's headers, in order, byte-exact values.
pub type Headers = Vec<(String, Vec<u8>)>;

/// What the gateway's worker would send for attempt `attempt` of `capture`'s event to a
/// destination as `how` says, at `now` (by the same code the worker sends with): the headers
/// — the original ones (the provider's timestamped signature made again when `how` has the
/// source's signer), `Idempotency-Key: {source}:{first key}`, the `hooklatch-*` headers and,
/// with a destination secret, the Standard Webhooks signature — and the body as delivered.
pub fn as_delivered(
    capture: &Capture,
    how: &AsDelivered,
    attempt: u32,
    now: Timestamp,
) -> Result<(Headers, Vec<u8>), ReplayError> {
    let key = capture.keys.first().ok_or_else(|| {
        ReplayError::BadTarget(format!(
            "{} has no event key to deliver it under",
            capture.label()
        ))
    })?;
    let request_id = capture
        .request_id
        .as_deref()
        .and_then(hooklatch_core::RequestId::parse)
        .unwrap_or(hooklatch_core::RequestId(0));
    let delivery = hooklatch_core::store::LeasedDelivery {
        id: hooklatch_core::DeliveryId(0),
        request_id,
        source: capture.source.clone(),
        event_key: key.clone(),
        event_type: None,
        destination: String::new(),
        idempotency_key: hooklatch_core::IdempotencyKey::from_stored(format!(
            "{}:{key}",
            capture.source
        )),
        attempts: attempt.saturating_sub(1),
        round_started_at: now,
        method: capture.method.clone(),
        path: capture.path.clone(),
        headers: capture.headers.clone(),
        body: bytes::Bytes::from(capture.body.clone()),
        lease_until: None,
    };
    let signer = how
        .signer
        .as_ref()
        .and_then(|s| crate::delivery::ProviderSigner::from_adapter(s.adapter.clone(), &s.secret));
    let (body, headers) = crate::delivery::outgoing(
        &delivery,
        attempt,
        how.secret.as_ref(),
        signer.as_ref(),
        now,
    );
    Ok((headers, body.to_vec()))
}

async fn send_one(
    client: &reqwest::Client,
    method: reqwest::Method,
    url: &str,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
    n: u32,
) -> Response {
    let clock = Instant::now();
    let sent = client
        .request(method, url)
        .headers(headers)
        .body(body)
        .send()
        .await;
    let latency = clock.elapsed();
    match sent {
        Ok(res) => {
            let status = res.status().as_u16();
            // A gateway's answer in a provider's own format (Twilio's TwiML) carries its
            // verdict in a header instead of the JSON body.
            let verdict = res
                .headers()
                .get(hooklatch_http::VERDICT_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let mut body = res.bytes().await.map(|b| b.to_vec()).unwrap_or_default();
            let answer = verdict.or_else(|| {
                serde_json::from_slice::<Value>(&body).ok().and_then(|v| {
                    let text = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
                    text("status").or_else(|| text("code"))
                })
            });
            body.truncate(BODY_KEPT);
            Response {
                n,
                status: Some(status),
                error: None,
                latency,
                answer,
                body,
            }
        }
        Err(err) => Response {
            n,
            status: None,
            error: Some(describe_error(&err)),
            latency,
            answer: None,
            body: Vec::new(),
        },
    }
}

/// A transport error as one line, its causes included.
fn describe_error(err: &reqwest::Error) -> String {
    let mut msg = if err.is_timeout() {
        "timed out".to_owned()
    } else if err.is_connect() {
        "connection failed".to_owned()
    } else {
        "request failed".to_owned()
    };
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        let _ = write!(msg, ": {s}");
        source = s.source();
    }
    msg
}

/// Headers as an `http::HeaderMap`, leaving out a name or value it cannot hold.
pub(crate) fn header_map(headers: &[(String, Vec<u8>)]) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    for (name, value) in headers {
        if let (Ok(n), Ok(v)) = (
            http::HeaderName::from_bytes(name.as_bytes()),
            http::HeaderValue::from_bytes(value),
        ) {
            map.append(n, v);
        }
    }
    map
}

pub(crate) fn latency_ms(responses: &[Response], quantile: f64) -> Option<f64> {
    let mut histogram = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)
        .expect("bounds are valid");
    for r in responses.iter().filter(|r| r.status.is_some()) {
        let micros = (r.latency.as_micros() as u64).clamp(1, 3_600_000_000);
        histogram.saturating_record(micros);
    }
    (!histogram.is_empty()).then(|| histogram.value_at_quantile(quantile) as f64 / 1000.0)
}

pub(crate) fn latency_line(responses: &[Response]) -> String {
    match (
        latency_ms(responses, 0.5),
        latency_ms(responses, 0.99),
        latency_ms(responses, 1.0),
    ) {
        (Some(p50), Some(p99), Some(max)) => {
            format!("p50 {p50:.1} ms   p99 {p99:.1} ms   max {max:.1} ms")
        }
        _ => "no responses".to_owned(),
    }
}

/// `  STATUS  COUNT  ANSWER` rows, one per (status, answer).
pub(crate) fn status_table(responses: &[Response]) -> String {
    let mut rows: BTreeMap<(String, String), u32> = BTreeMap::new();
    for r in responses {
        let status = r.status.map_or("error".to_owned(), |s| s.to_string());
        let answer = match (&r.answer, &r.error) {
            (Some(a), _) => a.clone(),
            (None, Some(e)) => e.clone(),
            (None, None) => String::new(),
        };
        *rows.entry((status, answer)).or_insert(0) += 1;
    }
    let mut out = String::from("  STATUS  COUNT  ANSWER\n");
    for ((status, answer), count) in rows {
        let _ = writeln!(out, "  {status:<6}  {count:>5}  {answer}");
    }
    out
}

/// The first few responses that were not 2xx, with the start of their bodies.
pub(crate) fn failures(responses: &[Response]) -> String {
    let failed: Vec<&Response> = responses.iter().filter(|r| !r.is_success()).collect();
    if failed.is_empty() {
        return "  failures none\n".to_owned();
    }
    let mut out = format!("  failures {} of {}\n", failed.len(), responses.len());
    let mut sorted = failed.clone();
    sorted.sort_by_key(|r| r.n);
    for r in sorted.iter().take(5) {
        let body = String::from_utf8_lossy(&r.body);
        let body: String = body.trim().chars().take(160).collect();
        let _ = writeln!(out, "    #{}: {} {}", r.n, r.describe(), body);
    }
    if sorted.len() > 5 {
        let _ = writeln!(out, "    … and {} more", sorted.len() - 5);
    }
    out
}

pub(crate) fn response_json(r: &Response) -> Value {
    json!({
        "n": r.n,
        "status": r.status,
        "answer": r.answer,
        "error": r.error,
        "latency_ms": r.latency.as_secs_f64() * 1000.0,
        "body": String::from_utf8_lossy(&r.body),
    })
}

/// The gateway's base URL from its config's `server.listen` (an unspecified address becomes
/// loopback; `https://` with `tls_cert`), else `http://127.0.0.1:8080`.
pub fn gateway_base(settings: Option<&Settings>) -> String {
    match settings {
        Some(s) => {
            let mut addr = s.listen;
            if addr.ip().is_unspecified() {
                addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
            }
            let scheme = if s.tls.is_some() { "https" } else { "http" };
            format!("{scheme}://{addr}")
        }
        None => "http://127.0.0.1:8080".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use hooklatch_core::provider::Stripe;

    use super::*;

    fn stripe_capture(signed_at: Timestamp) -> (Capture, Secret) {
        let secret = Secret::from_text("whsec_test");
        let body = br#"{"id":"evt_1","type":"invoice.payment_succeeded"}"#.to_vec();
        let signature = Stripe.sign(&SignRequest {
            body: &body,
            secret: &secret,
            now: signed_at,
            event_key: "evt_1",
            event_type: None,
            url: "",
        });
        let mut headers = vec![
            ("host".to_owned(), b"gw:8080".to_vec()),
            ("content-type".to_owned(), b"application/json".to_vec()),
        ];
        headers.extend(signature.into_iter().map(|(n, v)| (n, v.into_bytes())));
        headers.push(("user-agent".to_owned(), b"Stripe/1.0".to_vec()));
        let capture = Capture {
            request_id: Some("req_1".to_owned()),
            source: "stripe".to_owned(),
            provider: Some("stripe".to_owned()),
            method: "POST".to_owned(),
            path: "/in/stripe".to_owned(),
            received_at_ms: signed_at.as_millis(),
            keys: vec!["evt_1".to_owned()],
            verdict: None,
            reason: None,
            headers,
            body,
        };
        (capture, secret)
    }

    fn verifies(
        capture: &Capture,
        headers: &[(String, Vec<u8>)],
        secret: &Secret,
        now: Timestamp,
    ) -> bool {
        let map = header_map(headers);
        let req = InboundRequest {
            path_and_query: "/in/stripe",
            headers: &map,
            body: &capture.body,
            now,
        };
        Stripe
            .verify(&req, std::slice::from_ref(secret), Duration::from_secs(300))
            .is_ok()
    }

    /// A capture sent as the gateway delivers it carries what a handler behind hooklatch
    /// verifies: the Idempotency-Key, and a Standard Webhooks signature of the body under it
    /// with the destination's secret, fresh at each send.
    #[test]
    fn as_delivered_is_signed_as_the_gateway_signs_a_delivery() {
        let now = Timestamp::from_secs(1_780_000_000);
        let (capture, _) = stripe_capture(now);
        let secret = Secret::from_text("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD");
        let how = AsDelivered {
            secret: Some(secret.clone()),
            signer: None,
        };
        let (headers, body) = as_delivered(&capture, &how, 2, now).unwrap();
        assert_eq!(body, capture.body);
        let value = |name: &str| {
            headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| String::from_utf8(v.clone()).unwrap())
        };
        assert_eq!(value("idempotency-key").as_deref(), Some("stripe:evt_1"));
        assert_eq!(value("webhook-id").as_deref(), Some("stripe:evt_1"));
        assert_eq!(value("hooklatch-attempt").as_deref(), Some("2"));
        // The provider's own signature goes along, as the gateway forwards it.
        assert!(value("stripe-signature").is_some());
        let map = header_map(&headers);
        let req = InboundRequest {
            path_and_query: "/webhooks",
            headers: &map,
            body: &body,
            now,
        };
        hooklatch_core::provider::StandardWebhooks
            .verify(
                &req,
                std::slice::from_ref(&secret),
                Duration::from_secs(300),
            )
            .expect("verifies as a Standard Webhooks delivery");
        let mut keyless = capture;
        keyless.keys.clear();
        assert!(as_delivered(&keyless, &how, 1, now).is_err());
    }

    /// Re-signing a capture as another provider than its own is done as asked, with a
    /// warning: its receiver checks the capture's provider's signature.
    #[test]
    fn re_signing_as_another_provider_warns() {
        let now = Timestamp::from_secs(1_780_000_000);
        let (capture, secret) = stripe_capture(now);
        let github = Signer::for_provider("github", secret.clone()).unwrap();
        let (_, note) =
            choose_signing(SignMode::Resign, Some(github), &capture, false, now).unwrap();
        assert!(
            note.contains("warning: the capture came from stripe"),
            "{note}"
        );
        let stripe = Signer::for_provider("stripe", secret).unwrap();
        let (_, note) =
            choose_signing(SignMode::Resign, Some(stripe), &capture, false, now).unwrap();
        assert!(!note.contains("warning"), "{note}");
    }

    /// A request the gateway rejected is not re-signed unless asked: a fresh signature would
    /// vouch for a body nothing verified. Sent as captured, the receiver checks it again.
    #[test]
    fn a_rejected_capture_is_re_signed_only_when_asked() {
        let now = Timestamp::from_secs(1_780_000_000);
        let (mut capture, secret) = stripe_capture(now);
        let stripe = Signer::for_provider("stripe", secret).unwrap();
        let sign = |capture: &Capture, mode, resign_rejected| {
            choose_signing(mode, Some(stripe.clone()), capture, resign_rejected, now)
                .map(|(signing, _)| matches!(signing, Signing::Resign(_)))
                .map_err(|e| e.to_string())
        };
        assert_eq!(sign(&capture, SignMode::Auto, false), Ok(true));
        capture.verdict = Some("rejected".to_owned());
        for mode in [SignMode::Auto, SignMode::Resign] {
            let err = sign(&capture, mode, false).unwrap_err();
            assert!(
                err.starts_with("req_1 (evt_1) was rejected when it came")
                    && err.contains("--original"),
                "{err}"
            );
            assert_eq!(sign(&capture, mode, true), Ok(true));
        }
        assert_eq!(sign(&capture, SignMode::Original, false), Ok(false));
        // Refused only after its signature passed (another copy in flight, the key store
        // down): genuine, re-signed as an accepted one is.
        capture.reason = Some("invalid_signature".to_owned());
        assert!(sign(&capture, SignMode::Auto, false).is_err());
        for reason in ["in_flight", "key_store_unavailable"] {
            capture.reason = Some(reason.to_owned());
            assert_eq!(sign(&capture, SignMode::Auto, false), Ok(true), "{reason}");
        }
        capture.reason = None;
        // An older export has no verdict: a gateway's request with no event key was refused.
        capture.verdict = None;
        capture.keys.clear();
        assert!(sign(&capture, SignMode::Auto, false).is_err());
        capture.verdict = Some("handshake".to_owned());
        assert_eq!(sign(&capture, SignMode::Auto, false), Ok(true));
    }

    #[test]
    fn an_old_capture_verifies_once_re_signed_and_keeps_its_other_headers() {
        let old = Timestamp::from_secs(1_700_000_000);
        let now = old.plus(Duration::from_secs(86_400));
        let (capture, secret) = stripe_capture(old);
        assert!(!verifies(&capture, &capture.headers, &secret, now));
        let signer = Signer::for_provider("stripe", secret.clone()).unwrap();
        let headers = signer.sign(&capture, "http://127.0.0.1:3000/webhooks", now);
        assert!(verifies(&capture, &headers, &secret, now));
        let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            ["host", "content-type", "Stripe-Signature", "user-agent"]
        );
    }

    /// Twilio signs the URL it calls. Through the gateway, that is the gateway's public URL;
    /// straight at a handler, the URL the request goes to.
    #[test]
    fn a_url_signer_signs_the_public_url_through_the_gateway_and_the_url_sent_to_a_handler() {
        use hooklatch_core::provider::Twilio;
        let secret = Secret::from_text("twilio-token");
        let behind_proxy = Signer::new(
            Arc::new(Twilio {
                public_url: Some("https://hooks.example.com".to_owned()),
            }),
            secret.clone(),
        );
        let capture = Capture {
            request_id: None,
            source: "twilio".to_owned(),
            provider: Some("twilio".to_owned()),
            method: "GET".to_owned(),
            path: "/in/twilio?CallSid=CA1".to_owned(),
            received_at_ms: 0,
            keys: vec!["CA1".to_owned()],
            verdict: None,
            reason: None,
            headers: Vec::new(),
            body: Vec::new(),
        };
        let signature = |signer: &Signer, url: &str| {
            let headers = signer.sign(&capture, url, Timestamp(0));
            let found = headers.iter().find(|(n, _)| n == "X-Twilio-Signature");
            found.map(|(_, v)| v.clone()).expect("a signature")
        };
        let as_twilio_signs = |url: &str| {
            let signed = Twilio::default().sign(&SignRequest {
                url,
                body: b"",
                secret: &secret,
                now: Timestamp(0),
                event_key: "",
                event_type: None,
            });
            signed[0].1.clone().into_bytes()
        };
        let gateway = "http://127.0.0.1:8080/in/twilio?CallSid=CA1";
        assert_eq!(
            signature(&behind_proxy, gateway),
            as_twilio_signs("https://hooks.example.com/in/twilio?CallSid=CA1")
        );
        let handler = "http://127.0.0.1:3000/voice?CallSid=CA1";
        assert_eq!(
            signature(&behind_proxy.clone().straight(), handler),
            as_twilio_signs(handler)
        );
        // Other providers do not sign the URL: kept as they are.
        let stripe = Signer::for_provider("stripe", secret.clone()).unwrap();
        assert_eq!(stripe.straight().provider(), "stripe");
    }

    #[test]
    fn a_gateway_target_keeps_the_captured_path() {
        let (mut capture, _) = stripe_capture(Timestamp(0));
        let gateway = Target::Gateway("http://127.0.0.1:9/".to_owned());
        assert_eq!(gateway.url_for(&capture), "http://127.0.0.1:9/in/stripe");
        capture.path = "/webhooks".to_owned();
        assert_eq!(gateway.url_for(&capture), "http://127.0.0.1:9/in/stripe");
    }

    #[test]
    fn a_url_target_gets_the_captured_query_unless_it_has_its_own() {
        let (mut capture, _) = stripe_capture(Timestamp(0));
        let app = Target::Url("http://127.0.0.1:9/voice".to_owned());
        assert_eq!(app.url_for(&capture), "http://127.0.0.1:9/voice");
        capture.path = "/in/twilio?CallSid=CA1&CallStatus=ringing".to_owned();
        assert_eq!(
            app.url_for(&capture),
            "http://127.0.0.1:9/voice?CallSid=CA1&CallStatus=ringing"
        );
        let own = Target::Url("http://127.0.0.1:9/voice?debug=1".to_owned());
        assert_eq!(own.url_for(&capture), "http://127.0.0.1:9/voice?debug=1");
        let gateway = Target::Gateway("http://127.0.0.1:9".to_owned());
        assert_eq!(
            gateway.url_for(&capture),
            "http://127.0.0.1:9/in/twilio?CallSid=CA1&CallStatus=ringing"
        );
    }

    #[test]
    fn transport_and_credential_headers_are_not_sent() {
        let (mut capture, _) = stripe_capture(Timestamp(0));
        capture
            .headers
            .push(("authorization".to_owned(), b"Basic x".to_vec()));
        let (map, _) =
            headers_for(&capture, &Signing::Original, "http://x/", Timestamp(0), 1).unwrap();
        assert!(map.get("host").is_none() && map.get("authorization").is_none());
        assert!(map.get("stripe-signature").is_some());
    }

    #[test]
    fn svix_header_names_are_kept_when_re_signing() {
        let secret = Secret::from_text("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw");
        let body = b"{\"a\":1}".to_vec();
        let capture = Capture {
            request_id: None,
            source: "sw".to_owned(),
            provider: None,
            method: "POST".to_owned(),
            path: "/in/sw".to_owned(),
            received_at_ms: 0,
            keys: vec!["msg_1".to_owned()],
            verdict: None,
            reason: None,
            headers: vec![
                ("svix-id".to_owned(), b"msg_1".to_vec()),
                ("svix-timestamp".to_owned(), b"1".to_vec()),
                ("svix-signature".to_owned(), b"v1,old".to_vec()),
            ],
            body,
        };
        let signer = Signer::for_provider("standard-webhooks", secret).unwrap();
        let headers = signer.sign(&capture, "http://x/", Timestamp::from_secs(99));
        let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["svix-id", "svix-timestamp", "svix-signature"]);
        assert_eq!(headers[1].1, b"99");
    }
}
