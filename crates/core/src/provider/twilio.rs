//! Twilio: `X-Twilio-Signature` is a base64 HMAC-SHA1 keyed by the account Auth Token, over
//! the full URL Twilio requested (scheme, host, optional port, path, query) followed, for a
//! form-encoded POST, by every POST parameter in ascending name order, each written as name
//! then value with no separators. Repeated parameters are handled as twilio-node does: their
//! values de-duplicated, sorted, and each appended as name + value.
//!
//! JSON bodies are covered differently: the URL carries `bodySHA256=<hex SHA-256 of the raw
//! body>`, the signature covers the URL alone, and the body must hash to that value (checked
//! in constant time). Whenever the query has a `bodySHA256` parameter this mode is used,
//! whatever the `Content-Type`, as twilio-node's middleware does. A body that is neither
//! form-encoded nor hashed that way would go unauthenticated, so it is refused.
//!
//! The URL: the gateway usually sits behind a proxy, so [`Twilio::public_url`] says what
//! Twilio called. A base (`https://hooks.example.com`) gets the request's `path_and_query`
//! appended; a URL with a path (`https://example.com/hooks/twilio`, for a proxy that maps
//! its own path to `/in/{source}`) is the URL itself, with the request's query appended.
//! Without it the URL is rebuilt from the `Host` header and the first `X-Forwarded-Proto`
//! value (default `http`); both are client-supplied, so set `public_url` in production. Like
//! twilio-node, the URL is tried without any port and with the port (the default `:443`/`:80`
//! added when none is written), because Twilio's signer is not consistent about it.
//! twilio-node's third variant, the query re-encoded the legacy way, is not tried: the
//! request target is used byte for byte as received.
//!
//! No timestamp is signed (the tolerance is unused): deduplication is the only replay defence.
//!
//! Event key: the `I-Twilio-Idempotency-Token` header when present and usable; otherwise
//! `MessageSid:{MessageStatus or SmsStatus}` for messaging, `CallSid:{CallStatus}` for voice,
//! or the bare SID when no status is sent. Parameters are read from the form body, from the
//! top-level string fields of a JSON body, or, for a request without a body (a voice webhook
//! configured as `GET`), from the query string.
//!
//! `GET`: Twilio sends voice webhooks as a GET when the number is configured so. The
//! parameters are then in the query, which the signed URL already covers, and no POST
//! parameters are appended: verified like a POST with an empty body.
//!
//! Event type: `message.status.{status}` for a message status callback (a `MessageStatus`, or
//! an `SmsStatus` other than `received`), `message.inbound` for an inbound message,
//! `call.{CallStatus}` (or `call`) for voice.

use std::time::Duration;

use base64::engine::general_purpose::STANDARD;
use base64::Engine;
use hmac::{Hmac, Mac};
use http::HeaderMap;
use sha1::Sha1;
use subtle::ConstantTimeEq;

use crate::id::EventKey;
use crate::provider::{
    event_key, header_str, malformed, signature_value, ExtractedEvent, InboundRequest,
    ProviderAdapter, ProviderReply, Rejection, SignRequest,
};
use crate::secret::{constant_time_eq, sha256, Secret};

const SIGNATURE_HEADER: &str = "X-Twilio-Signature";
const IDEMPOTENCY_HEADER: &str = "I-Twilio-Idempotency-Token";
const BODY_HASH_PARAM: &str = "bodySHA256";
const FORM_CONTENT_TYPE: &str = "application/x-www-form-urlencoded";
const EMPTY_TWIML: &[u8] = b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Response></Response>";

/// Twilio's webhook scheme (`provider = "twilio"`).
#[derive(Debug, Clone, Default)]
pub struct Twilio {
    /// The public URL Twilio calls: a base (`https://hooks.example.com`), to which the
    /// request's path and query are appended; or, with a path of its own
    /// (`https://example.com/hooks/twilio`), the URL of this source, to which the request's
    /// query is appended. `None`: rebuilt from the `Host` and `X-Forwarded-Proto` headers.
    pub public_url: Option<String>,
}

/// The URL Twilio called, for a request the gateway received at `path_and_query`, when the
/// gateway's public URL is `public` (see [`Twilio::public_url`]).
fn public_url_for(public: &str, path_and_query: &str) -> String {
    let after_scheme = public.split_once("://").map_or(public, |(_, rest)| rest);
    match after_scheme.find('/').map(|at| &after_scheme[at..]) {
        None | Some("/") => format!("{}{path_and_query}", public.trim_end_matches('/')),
        Some(_) => match path_and_query.split_once('?') {
            Some((_, query)) => format!("{public}?{query}"),
            None => public.to_owned(),
        },
    }
}

impl ProviderAdapter for Twilio {
    fn provider(&self) -> &'static str {
        "twilio"
    }

    fn public_url(&self) -> Option<&str> {
        self.public_url.as_deref()
    }

    fn signature_headers(&self) -> Vec<&str> {
        vec![SIGNATURE_HEADER]
    }

    fn verify(
        &self,
        req: &InboundRequest<'_>,
        secrets: &[Secret],
        _tolerance: Duration,
    ) -> Result<(), Rejection> {
        let value = signature_value(req.headers, SIGNATURE_HEADER)?;
        let received = STANDARD
            .decode(value.trim())
            .map_err(|_| malformed(SIGNATURE_HEADER, "is not base64"))?;

        let url = self.signed_url(req)?;
        let body_hash = query_param(query_of(&url), BODY_HASH_PARAM);
        let params = match body_hash {
            Some(_) => Vec::new(),
            None if is_form(req.headers) => sorted_params(req.body),
            None if req.body.is_empty() => Vec::new(),
            None => {
                return Err(malformed(
                    SIGNATURE_HEADER,
                    "cannot cover a body that is neither form-encoded nor hashed in a \
                     `bodySHA256` query parameter",
                ))
            }
        };

        let variants = url_variants(&url);
        let matched = secrets.iter().any(|secret| {
            variants.iter().any(|candidate| {
                Mac160::compute(secret.expose(), signed_data(candidate, &params).as_bytes())
                    .matches(&received)
            })
        });
        if !matched {
            return Err(Rejection::InvalidSignature);
        }
        if let Some(expected_hex) = body_hash {
            let body_matches = hex::decode(expected_hex.trim())
                .map(|expected| constant_time_eq(&expected, &sha256(req.body)))
                .unwrap_or(false);
            if !body_matches {
                return Err(Rejection::InvalidSignature);
            }
        }
        Ok(())
    }

    fn extract(&self, req: &InboundRequest<'_>) -> Result<Vec<ExtractedEvent>, Rejection> {
        let params = Params::of(req);
        let event_type = params.event_type();
        let token = header_str(req.headers, IDEMPOTENCY_HEADER)
            .map(str::trim)
            .filter(|token| EventKey::parse(token).is_ok());
        let key = match token {
            Some(token) => event_key(token, &format!("header {IDEMPOTENCY_HEADER}"))?,
            None => params.fallback_key()?,
        };
        Ok(vec![ExtractedEvent {
            key,
            event_type,
            fingerprint: None,
        }])
    }

    /// Signs over `req.url` (without its fragment, which never reaches the server) and the
    /// form parameters of `req.body`; when the URL has a `bodySHA256` query parameter, over the
    /// URL alone (the caller puts the right hash in it). `I-Twilio-Idempotency-Token` is set to
    /// the event key: Twilio sends that header on its webhooks, and [`Twilio::extract`] prefers
    /// it, so the key a test sender reports is the key the gateway deduplicates on.
    /// Signs the URL this adapter checks: with [`Twilio::public_url`], the URL Twilio calls
    /// for the path and query of `req.url` (the gateway behind its proxy); else `req.url` as
    /// given.
    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let given = req.url.split('#').next().unwrap_or_default();
        let url = match &self.public_url {
            Some(public) => public_url_for(public, path_and_query(given)),
            None => given.to_owned(),
        };
        let url = url.as_str();
        let params = match query_param(query_of(url), BODY_HASH_PARAM) {
            Some(_) => Vec::new(),
            None => sorted_params(req.body),
        };
        let mac = Mac160::compute(req.secret.expose(), signed_data(url, &params).as_bytes());
        vec![
            (SIGNATURE_HEADER.to_owned(), mac.to_base64()),
            (IDEMPOTENCY_HEADER.to_owned(), req.event_key.to_owned()),
        ]
    }

    /// 7 days: Twilio retries only at the connection level, within 15 seconds.
    fn default_retention(&self) -> Duration {
        Duration::from_secs(7 * 24 * 3600)
    }

    /// Empty TwiML: nothing said or sent back. Fine for status callbacks too (they only need a
    /// 2xx).
    fn ack_reply(&self, _req: &InboundRequest<'_>) -> Option<ProviderReply> {
        Some(ProviderReply {
            status: 200,
            content_type: "text/xml",
            body: EMPTY_TWIML.to_vec(),
        })
    }

    fn get_carries_events(&self) -> bool {
        true
    }
}

impl Twilio {
    /// The URL Twilio calls for a request the gateway receives at `path_and_query`: with
    /// [`Twilio::public_url`], as that field says; without, `path_and_query` alone.
    pub fn url_called(&self, path_and_query: &str) -> String {
        match &self.public_url {
            Some(public) => public_url_for(public, path_and_query),
            None => path_and_query.to_owned(),
        }
    }

    /// The full URL Twilio requested, as far as the gateway can tell.
    fn signed_url(&self, req: &InboundRequest<'_>) -> Result<String, Rejection> {
        let base = match &self.public_url {
            Some(public) => return Ok(public_url_for(public, req.path_and_query)),
            None => {
                let host = header_str(req.headers, "host")
                    .map(str::trim)
                    .filter(|host| !host.is_empty())
                    .ok_or_else(|| {
                        malformed(
                            SIGNATURE_HEADER,
                            "cannot be checked: no public URL and no Host header",
                        )
                    })?;
                let scheme = header_str(req.headers, "x-forwarded-proto")
                    .and_then(|proto| proto.split(',').next())
                    .map(str::trim)
                    .filter(|proto| !proto.is_empty())
                    .unwrap_or("http")
                    .to_ascii_lowercase();
                format!("{scheme}://{host}")
            }
        };
        Ok(format!("{base}{}", req.path_and_query))
    }
}

/// An HMAC-SHA1 value, like [`crate::secret::Mac256`]: no `PartialEq`, compare with
/// [`Mac160::matches`] (constant time).
struct Mac160([u8; 20]);

impl Mac160 {
    fn compute(key: &[u8], data: &[u8]) -> Mac160 {
        let mut mac = Hmac::<Sha1>::new_from_slice(key).expect("HMAC accepts keys of any length");
        mac.update(data);
        Mac160(mac.finalize().into_bytes().into())
    }

    fn matches(&self, received: &[u8]) -> bool {
        received.len() == self.0.len() && bool::from(self.0.ct_eq(received))
    }

    fn to_base64(&self) -> String {
        STANDARD.encode(self.0)
    }
}

/// The signed string: the URL, then each parameter as name + value.
fn signed_data(url: &str, params: &[(String, String)]) -> String {
    let mut data = url.to_owned();
    for (name, value) in params {
        data.push_str(name);
        data.push_str(value);
    }
    data
}

/// The form parameters of a body, sorted by name then value, exact duplicates removed
/// (twilio-node: `Array.from(new Set(values)).sort()`). Sorting compares UTF-16 code units,
/// as JavaScript's `sort` does.
fn sorted_params(body: &[u8]) -> Vec<(String, String)> {
    let mut params: Vec<(String, String)> = form_urlencoded::parse(body).into_owned().collect();
    params.sort_by(|a, b| {
        a.0.encode_utf16()
            .cmp(b.0.encode_utf16())
            .then_with(|| a.1.encode_utf16().cmp(b.1.encode_utf16()))
    });
    params.dedup();
    params
}

fn is_form(headers: &HeaderMap) -> bool {
    header_str(headers, "content-type").is_some_and(|value| {
        value
            .split(';')
            .next()
            .is_some_and(|mime| mime.trim().eq_ignore_ascii_case(FORM_CONTENT_TYPE))
    })
}

fn is_json(headers: &HeaderMap) -> bool {
    header_str(headers, "content-type").is_some_and(|value| {
        value
            .split(';')
            .next()
            .is_some_and(|mime| mime.trim().to_ascii_lowercase().ends_with("json"))
    })
}

/// The query string of a URL or request target (after `?`, before `#`).
/// The path and query of an absolute URL (`/in/twilio?a=1` of `http://h:8080/in/twilio?a=1`);
/// a URL that is already a path is returned as it is.
fn path_and_query(url: &str) -> &str {
    match url.split_once("://") {
        Some((_, rest)) => rest.find('/').map_or("/", |at| &rest[at..]),
        None => url,
    }
}

fn query_of(url: &str) -> &str {
    let without_fragment = url.split('#').next().unwrap_or_default();
    without_fragment
        .split_once('?')
        .map_or("", |(_, query)| query)
}

/// The first value of a query parameter, percent-decoded.
fn query_param(query: &str, name: &str) -> Option<String> {
    form_urlencoded::parse(query.as_bytes())
        .find(|(key, _)| key == name)
        .map(|(_, value)| value.into_owned())
}

/// The URL as given, without any port, and with its port (the scheme's default added when none
/// is written), de-duplicated: twilio-node's `removePort` and `addPort`.
fn url_variants(url: &str) -> Vec<String> {
    let mut variants = vec![url.to_owned()];
    let Some((scheme, rest)) = url.split_once("://") else {
        return variants;
    };
    let (authority, tail) = rest.split_at(rest.find(['/', '?', '#']).unwrap_or(rest.len()));
    let (userinfo, host_port) = authority.split_at(authority.rfind('@').map_or(0, |at| at + 1));
    let (host, port) = split_port(host_port);
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "https" => Some("443"),
        "http" => Some("80"),
        _ => None,
    };
    variants.push(format!("{scheme}://{userinfo}{host}{tail}"));
    if let Some(port) = port.or(default_port) {
        variants.push(format!("{scheme}://{userinfo}{host}:{port}{tail}"));
    }
    let mut unique = Vec::with_capacity(variants.len());
    for variant in variants {
        if !unique.contains(&variant) {
            unique.push(variant);
        }
    }
    unique
}

/// Splits `host:port` (or `[v6]:port`); an empty port (`host:`) counts as none.
fn split_port(host_port: &str) -> (&str, Option<&str>) {
    match host_port.rsplit_once(':') {
        Some((host, port))
            if port.bytes().all(|b| b.is_ascii_digit())
                && (!host.contains(':') || (host.starts_with('[') && host.ends_with(']'))) =>
        {
            (host, Some(port).filter(|port| !port.is_empty()))
        }
        _ => (host_port, None),
    }
}

/// The request's parameters: the form body, a JSON body's top-level string fields, or the
/// query of a request without a body (a GET).
struct Params(Vec<(String, String)>);

impl Params {
    fn of(req: &InboundRequest<'_>) -> Params {
        if req.body.is_empty() {
            let query = query_of(req.path_and_query);
            return Params(
                form_urlencoded::parse(query.as_bytes())
                    .into_owned()
                    .collect(),
            );
        }
        if is_json(req.headers) {
            let fields = serde_json::from_slice::<serde_json::Value>(req.body)
                .ok()
                .and_then(|body| match body {
                    serde_json::Value::Object(map) => Some(
                        map.into_iter()
                            .filter_map(|(name, value)| match value {
                                serde_json::Value::String(text) => Some((name, text)),
                                _ => None,
                            })
                            .collect(),
                    ),
                    _ => None,
                })
                .unwrap_or_default();
            return Params(fields);
        }
        Params(form_urlencoded::parse(req.body).into_owned().collect())
    }

    /// The first non-blank value of a parameter.
    fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(key, value)| key == name && !value.trim().is_empty())
            .map(|(_, value)| value.as_str())
    }

    fn message_sid(&self) -> Option<&str> {
        self.get("MessageSid").or_else(|| self.get("SmsSid"))
    }

    fn message_status(&self) -> Option<&str> {
        self.get("MessageStatus").or_else(|| self.get("SmsStatus"))
    }

    fn fallback_key(&self) -> Result<EventKey, Rejection> {
        let (sid, status, place) = if let Some(sid) = self.message_sid() {
            (sid, self.message_status(), "parameter MessageSid")
        } else if let Some(sid) = self.get("CallSid") {
            (sid, self.get("CallStatus"), "parameter CallSid")
        } else {
            return Err(Rejection::MissingKey {
                detail: format!("header {IDEMPOTENCY_HEADER} or parameter MessageSid or CallSid"),
            });
        };
        match status {
            Some(status) => event_key(&format!("{sid}:{status}"), place),
            None => event_key(sid, place),
        }
    }

    fn event_type(&self) -> Option<String> {
        if self.message_sid().is_some() {
            return Some(match self.message_status() {
                Some(status) if status != "received" => format!("message.status.{status}"),
                _ => "message.inbound".to_owned(),
            });
        }
        if self.get("CallSid").is_some() {
            return Some(match self.get("CallStatus") {
                Some(status) => format!("call.{status}"),
                None => "call".to_owned(),
            });
        }
        None
    }
}

#[cfg(test)]
mod tests {

    use proptest::prelude::*;

    use super::*;
    use crate::provider::test_support::headers;
    use crate::time::Timestamp;

    const TOKEN: &str = "12345";
    const OLD: &str = "old auth token";
    const NEW: &str = "new auth token";
    const FORM: &str = "application/x-www-form-urlencoded";

    /// twilio-node `spec/validation.spec.js`, as listed in providers.md.
    const VECTOR_BASE: &str = "https://mycompany.com";
    const VECTOR_PATH: &str = "/myapp.php?foo=1&bar=2";
    const VECTOR_PARAMS: &[(&str, &str)] = &[
        ("CallSid", "CA1234567890ABCDE"),
        ("Caller", "+14158675309"),
        ("Digits", "1234"),
        ("From", "+14158675309"),
        ("To", "+18005551212"),
    ];
    const VECTOR_SIGNED: &str = "https://mycompany.com/myapp.php?foo=1&bar=2CallSidCA1234567890ABCDECaller+14158675309Digits1234From+14158675309To+18005551212";
    const VECTOR_SIGNATURE: &str = "RSOYDt4T1cUTdK1PDd93/VVr8B8=";
    const JSON_BODY: &[u8] = br#"{"property": "value", "boolean": true}"#;
    const JSON_BODY_SHA256: &str =
        "0a1ff7634d9ab3b95db5c9a2dfe9416e41502b283a80c7cf19632632f96e6620";
    const JSON_PATH: &str = "/myapp.php?foo=1&bar=2&bodySHA256=0a1ff7634d9ab3b95db5c9a2dfe9416e41502b283a80c7cf19632632f96e6620";
    const JSON_SIGNATURE: &str = "a9nBmqA0ju/hNViExpshrM61xv4=";

    fn form(pairs: &[(&str, &str)]) -> Vec<u8> {
        form_urlencoded::Serializer::new(String::new())
            .extend_pairs(pairs)
            .finish()
            .into_bytes()
    }

    fn request<'a>(path: &'a str, headers: &'a HeaderMap, body: &'a [u8]) -> InboundRequest<'a> {
        InboundRequest {
            path_and_query: path,
            headers,
            body,
            now: Timestamp::from_secs(1_700_000_000),
        }
    }

    fn twilio(public_url: Option<&str>) -> Twilio {
        Twilio {
            public_url: public_url.map(str::to_owned),
        }
    }

    fn signature(secret: &str, url: &str, body: &[u8]) -> String {
        let secret = Secret::from_text(secret);
        let signed = Twilio::default().sign(&SignRequest {
            url,
            body,
            secret: &secret,
            now: Timestamp::from_secs(0),
            event_key: "tok-1",
            event_type: None,
        });
        assert_eq!(signed[0].0, SIGNATURE_HEADER);
        signed[0].1.clone()
    }

    /// A delivery to `path` with `headers` (a form body unless a content type is given).
    struct Delivery<'a> {
        public_url: Option<&'a str>,
        path: &'a str,
        headers: Vec<(&'a str, &'a str)>,
        body: &'a [u8],
    }

    impl<'a> Delivery<'a> {
        fn form(path: &'a str, body: &'a [u8], signature: &'a str) -> Delivery<'a> {
            Delivery {
                public_url: Some(VECTOR_BASE),
                path,
                headers: vec![("content-type", FORM), (SIGNATURE_HEADER, signature)],
                body,
            }
        }

        fn verify(&self, secrets: &[&str]) -> Result<(), Rejection> {
            let headers = headers(&self.headers);
            let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
            twilio(self.public_url).verify(
                &request(self.path, &headers, self.body),
                &secrets,
                Duration::ZERO,
            )
        }
    }

    #[track_caller]
    fn check(delivery: &Delivery<'_>, secrets: &[&str], expect: Result<(), &str>) {
        let got = delivery.verify(secrets);
        assert_eq!(
            got.as_ref().map_err(Rejection::code).copied(),
            expect,
            "{got:?}"
        );
    }

    fn extract(headers: &[(&str, &str)], body: &[u8]) -> Result<Vec<ExtractedEvent>, Rejection> {
        let headers = self::headers(headers);
        Twilio::default().extract(&request("/in/twilio", &headers, body))
    }

    #[track_caller]
    fn check_key(params: &[(&str, &str)], key: &str, event_type: &str) {
        let events = extract(&[("content-type", FORM)], &form(params)).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].key.as_str(), key);
        assert_eq!(events[0].event_type.as_deref(), Some(event_type));
    }

    /// A voice webhook configured as GET: the parameters ride in the query, which the signed
    /// URL covers; nothing is appended after the URL.
    #[test]
    fn a_get_voice_webhook_is_verified_over_its_url_and_keyed_from_its_query() {
        let path = "/in/twilio?CallSid=CA1234567890ABCDE&CallStatus=ringing&From=%2B14158675309";
        let url = format!("{VECTOR_BASE}{path}");
        let sig = signature(TOKEN, &url, b"");
        let get = |path: &'static str, sig: &str| {
            let headers = headers(&[(SIGNATURE_HEADER, sig)]);
            let req = request(path, &headers, b"");
            (
                twilio(Some(VECTOR_BASE)).verify(&req, &[Secret::from_text(TOKEN)], Duration::ZERO),
                Twilio::default().extract(&req),
            )
        };
        let (verified, events) = get(path, &sig);
        assert_eq!(verified, Ok(()));
        let events = events.expect("an event");
        assert_eq!(events[0].key.as_str(), "CA1234567890ABCDE:ringing");
        assert_eq!(events[0].event_type.as_deref(), Some("call.ringing"));
        assert!(Twilio::default().get_carries_events());

        let (tampered, _) = get(
            "/in/twilio?CallSid=CA1234567890ABCDE&CallStatus=completed&From=%2B14158675309",
            &sig,
        );
        assert_eq!(tampered.map_err(|r| r.code()), Err("invalid_signature"));
    }

    /// Replaying through a gateway behind a proxy: the request goes to the gateway's own
    /// address, but the adapter checks `public_url` + path and query, so that is what it signs.
    #[test]
    fn with_a_public_url_the_signer_signs_the_url_the_gateway_checks() {
        let secret = Secret::from_text(TOKEN);
        let path = "/in/twilio?CallSid=CA1&CallStatus=ringing";
        let body = form(&[("CallSid", "CA1"), ("CallStatus", "ringing")]);
        for sent_to in [format!("http://127.0.0.1:8080{path}"), path.to_owned()] {
            let signed = twilio(Some(VECTOR_BASE)).sign(&SignRequest {
                url: &sent_to,
                body: &body,
                secret: &secret,
                now: Timestamp::from_secs(0),
                event_key: "tok-1",
                event_type: None,
            });
            let headers = headers(&[
                ("content-type", FORM),
                ("host", "127.0.0.1:8080"),
                (SIGNATURE_HEADER, &signed[0].1),
            ]);
            let req = request(path, &headers, &body);
            let verify = |adapter: Twilio| {
                adapter.verify(&req, std::slice::from_ref(&secret), Duration::ZERO)
            };
            assert_eq!(
                verify(twilio(Some(VECTOR_BASE))),
                Ok(()),
                "sent to {sent_to}"
            );
            // Not the URL it was sent to: without the public URL the check fails.
            assert_eq!(
                verify(Twilio::default()).map_err(|r| r.code()),
                Err("invalid_signature")
            );
        }
        assert_eq!(path_and_query("https://h.example:8443/a/b?c=d"), "/a/b?c=d");
        assert_eq!(path_and_query("https://h.example"), "/");
    }

    /// A proxy that maps its own path to the gateway's: Twilio signs the proxy's URL, path
    /// and all, and the gateway sees `/in/twilio` with the same query.
    #[test]
    fn a_public_url_with_a_path_is_the_url_twilio_called() {
        let secret = Secret::from_text(TOKEN);
        let public = "https://example.com/hooks/twilio-calls";
        let body = form(&[("CallSid", "CA1"), ("CallStatus", "ringing")]);
        for query in ["", "?tenant=7"] {
            let called = format!("{public}{query}");
            let sig = signature(TOKEN, &called, &body);
            let headers = headers(&[("content-type", FORM), (SIGNATURE_HEADER, &sig)]);
            let received = format!("/in/twilio{query}");
            let req = request(&received, &headers, &body);
            let verify = |public: &str| {
                twilio(Some(public)).verify(&req, std::slice::from_ref(&secret), Duration::ZERO)
            };
            assert_eq!(verify(public), Ok(()), "query {query:?}");
            // The same URL taken as a base would append the gateway's own path.
            assert_eq!(
                verify("https://example.com").map_err(|r| r.code()),
                Err("invalid_signature")
            );
            // The signer signs what the gateway checks, whatever address it sends to.
            let signed = twilio(Some(public)).sign(&SignRequest {
                url: &format!("http://127.0.0.1:8080{received}"),
                body: &body,
                secret: &secret,
                now: Timestamp::from_secs(0),
                event_key: "tok-1",
                event_type: None,
            });
            assert_eq!(signed[0].1, sig, "query {query:?}");
        }
        assert_eq!(
            public_url_for("https://example.com/", "/in/twilio?a=1"),
            "https://example.com/in/twilio?a=1"
        );
        assert_eq!(
            public_url_for("https://example.com/t/", "/in/twilio/?a=1"),
            "https://example.com/t/?a=1"
        );
    }

    #[test]
    fn the_signed_string_is_the_url_then_sorted_names_and_values() {
        let body = form(&[
            ("To", "+18005551212"),
            ("Digits", "1234"),
            ("CallSid", "CA1234567890ABCDE"),
            ("From", "+14158675309"),
            ("Caller", "+14158675309"),
        ]);
        let url = format!("{VECTOR_BASE}{VECTOR_PATH}");
        assert_eq!(signed_data(&url, &sorted_params(&body)), VECTOR_SIGNED);
    }

    #[test]
    fn the_twilio_node_form_vector_signs_and_verifies() {
        let body = form(VECTOR_PARAMS);
        let url = format!("{VECTOR_BASE}{VECTOR_PATH}");
        assert_eq!(signature(TOKEN, &url, &body), VECTOR_SIGNATURE);
        check(
            &Delivery::form(VECTOR_PATH, &body, VECTOR_SIGNATURE),
            &[TOKEN],
            Ok(()),
        );
    }

    #[test]
    fn the_twilio_node_json_vector_signs_and_verifies() {
        assert_eq!(hex::encode(sha256(JSON_BODY)), JSON_BODY_SHA256);
        let url = format!("{VECTOR_BASE}{JSON_PATH}");
        assert_eq!(signature(TOKEN, &url, JSON_BODY), JSON_SIGNATURE);
        for content_type in ["application/json", "application/json; charset=utf-8", FORM] {
            let delivery = Delivery {
                public_url: Some(VECTOR_BASE),
                path: JSON_PATH,
                headers: vec![
                    ("content-type", content_type),
                    (SIGNATURE_HEADER, JSON_SIGNATURE),
                ],
                body: JSON_BODY,
            };
            check(&delivery, &[TOKEN], Ok(()));
        }
    }

    #[test]
    fn a_json_body_that_does_not_match_body_sha256_is_an_invalid_signature() {
        let tampered = br#"{"property": "value", "boolean": false}"#;
        let delivery = Delivery {
            public_url: Some(VECTOR_BASE),
            path: JSON_PATH,
            headers: vec![
                ("content-type", "application/json"),
                (SIGNATURE_HEADER, JSON_SIGNATURE),
            ],
            body: tampered,
        };
        check(&delivery, &[TOKEN], Err("invalid_signature"));

        // A URL whose `bodySHA256` is not hex is signed fine but can match no body.
        let path = "/myapp.php?bodySHA256=not-hex";
        let sig = signature(TOKEN, &format!("{VECTOR_BASE}{path}"), JSON_BODY);
        let delivery = Delivery {
            path,
            headers: vec![
                ("content-type", "application/json"),
                (SIGNATURE_HEADER, &sig),
            ],
            ..delivery
        };
        check(&delivery, &[TOKEN], Err("invalid_signature"));
    }

    #[test]
    fn a_wrong_token_or_a_tampered_parameter_is_an_invalid_signature() {
        let body = form(VECTOR_PARAMS);
        check(
            &Delivery::form(VECTOR_PATH, &body, VECTOR_SIGNATURE),
            &[NEW],
            Err("invalid_signature"),
        );
        let mut tampered = VECTOR_PARAMS.to_vec();
        tampered[2] = ("Digits", "9999");
        let tampered = form(&tampered);
        check(
            &Delivery::form(VECTOR_PATH, &tampered, VECTOR_SIGNATURE),
            &[TOKEN],
            Err("invalid_signature"),
        );
        // The query is signed too.
        check(
            &Delivery::form("/myapp.php?foo=1&bar=3", &body, VECTOR_SIGNATURE),
            &[TOKEN],
            Err("invalid_signature"),
        );
        check(
            &Delivery::form(VECTOR_PATH, &body, VECTOR_SIGNATURE),
            &[],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn parameter_order_and_encoding_in_the_body_do_not_matter() {
        let reordered = b"To=%2B18005551212&From=%2B14158675309&Digits=1234&Caller=%2B14158675309&CallSid=CA1234567890ABCDE";
        check(
            &Delivery::form(VECTOR_PATH, reordered, VECTOR_SIGNATURE),
            &[TOKEN],
            Ok(()),
        );
    }

    #[test]
    fn repeated_parameters_are_deduplicated_and_sorted_by_value() {
        let body = b"b=2&a=1&a=0&a=1";
        let params = sorted_params(body);
        assert_eq!(signed_data("https://h/p", &params), "https://h/pa0a1b2");
        let url = "https://h/p";
        let sig = signature(TOKEN, url, body);
        let expected = Mac160::compute(TOKEN.as_bytes(), b"https://h/pa0a1b2").to_base64();
        assert_eq!(sig, expected);
    }

    #[test]
    fn the_default_port_is_optional_on_either_side() {
        let body = form(VECTOR_PARAMS);
        let with_port = signature(
            TOKEN,
            &format!("https://mycompany.com:443{VECTOR_PATH}"),
            &body,
        );
        // Signed with `:443`, received at a URL without it.
        check(
            &Delivery::form(VECTOR_PATH, &body, &with_port),
            &[TOKEN],
            Ok(()),
        );
        // Signed without the port, received at a URL with `:443`.
        for public_url in ["https://mycompany.com:443", "https://mycompany.com:443/"] {
            let delivery = Delivery {
                public_url: Some(public_url),
                ..Delivery::form(VECTOR_PATH, &body, VECTOR_SIGNATURE)
            };
            check(&delivery, &[TOKEN], Ok(()));
        }
        // Plain http: `:80`.
        let http = signature(TOKEN, "http://example.com:80/in/twilio", &body);
        let delivery = Delivery {
            public_url: Some("http://example.com"),
            ..Delivery::form("/in/twilio", &body, &http)
        };
        check(&delivery, &[TOKEN], Ok(()));
        // Another host is another URL.
        let other = signature(TOKEN, &format!("https://other.example{VECTOR_PATH}"), &body);
        check(
            &Delivery::form(VECTOR_PATH, &body, &other),
            &[TOKEN],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn url_variants_drop_any_port_and_add_the_default_one() {
        assert_eq!(
            url_variants("https://h.example/p?q=1"),
            ["https://h.example/p?q=1", "https://h.example:443/p?q=1"]
        );
        assert_eq!(
            url_variants("http://h.example:80/p"),
            ["http://h.example:80/p", "http://h.example/p"]
        );
        assert_eq!(
            url_variants("https://h.example:8443"),
            ["https://h.example:8443", "https://h.example"]
        );
        assert_eq!(
            url_variants("https://u:pw@[::1]/p"),
            ["https://u:pw@[::1]/p", "https://u:pw@[::1]:443/p"]
        );
        assert_eq!(url_variants("not a url"), ["not a url"]);
    }

    #[test]
    fn without_a_public_url_the_url_is_rebuilt_from_host_and_forwarded_proto() {
        let body = form(VECTOR_PARAMS);
        let delivery = |headers: Vec<(&'static str, &'static str)>| Delivery {
            public_url: None,
            path: VECTOR_PATH,
            headers: [
                vec![("content-type", FORM), (SIGNATURE_HEADER, VECTOR_SIGNATURE)],
                headers,
            ]
            .concat(),
            body: &body,
        };
        check(
            &delivery(vec![
                ("host", "mycompany.com"),
                ("x-forwarded-proto", "https"),
            ]),
            &[TOKEN],
            Ok(()),
        );
        check(
            &delivery(vec![
                ("host", "mycompany.com:443"),
                ("x-forwarded-proto", "HTTPS, http"),
            ]),
            &[TOKEN],
            Ok(()),
        );
        // Without X-Forwarded-Proto the scheme is http, which Twilio did not call.
        check(
            &delivery(vec![("host", "mycompany.com")]),
            &[TOKEN],
            Err("invalid_signature"),
        );
        check(&delivery(vec![]), &[TOKEN], Err("malformed_signature"));
    }

    #[test]
    fn a_public_url_wins_over_the_host_header() {
        let body = form(VECTOR_PARAMS);
        let delivery = Delivery {
            headers: vec![
                ("content-type", FORM),
                (SIGNATURE_HEADER, VECTOR_SIGNATURE),
                ("host", "internal:8080"),
            ],
            ..Delivery::form(VECTOR_PATH, &body, VECTOR_SIGNATURE)
        };
        check(&delivery, &[TOKEN], Ok(()));

        let internal = signature(TOKEN, &format!("http://internal:8080{VECTOR_PATH}"), &body);
        let delivery = Delivery {
            headers: vec![
                ("content-type", FORM),
                (SIGNATURE_HEADER, &internal),
                ("host", "internal:8080"),
            ],
            ..delivery
        };
        check(&delivery, &[TOKEN], Err("invalid_signature"));
        check(
            &Delivery {
                public_url: None,
                ..delivery
            },
            &[TOKEN],
            Ok(()),
        );
    }

    /// A proxy that strips a prefix (`/hooks/in/twilio` → `/in/twilio`) is configured with the
    /// whole URL, as any proxy with a path: a path is never a prefix.
    #[test]
    fn a_public_url_with_a_path_is_never_a_prefix() {
        let body = form(VECTOR_PARAMS);
        let sig = signature(TOKEN, "https://example.com/hooks/in/twilio", &body);
        for (public_url, expect) in [
            ("https://example.com/hooks/in/twilio", Ok(())),
            ("https://example.com/hooks/", Err("invalid_signature")),
        ] {
            let delivery = Delivery {
                public_url: Some(public_url),
                ..Delivery::form("/in/twilio", &body, &sig)
            };
            check(&delivery, &[TOKEN], expect);
        }
    }

    #[test]
    fn rotation_accepts_either_configured_token() {
        let body = form(VECTOR_PARAMS);
        let url = format!("{VECTOR_BASE}{VECTOR_PATH}");
        let old = signature(OLD, &url, &body);
        let new = signature(NEW, &url, &body);
        check(
            &Delivery::form(VECTOR_PATH, &body, &old),
            &[OLD, NEW],
            Ok(()),
        );
        check(
            &Delivery::form(VECTOR_PATH, &body, &new),
            &[OLD, NEW],
            Ok(()),
        );
        check(
            &Delivery::form(VECTOR_PATH, &body, &old),
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn a_missing_header_is_a_missing_signature() {
        let body = form(VECTOR_PARAMS);
        let delivery = Delivery {
            headers: vec![("content-type", FORM)],
            ..Delivery::form(VECTOR_PATH, &body, "")
        };
        assert_eq!(
            delivery.verify(&[TOKEN]),
            Err(Rejection::MissingSignature {
                header: "X-Twilio-Signature".to_owned()
            })
        );
    }

    #[test]
    fn a_signature_that_is_not_base64_is_malformed_and_never_echoed() {
        let body = form(VECTOR_PARAMS);
        for bad in [
            "RSOYDt4T1cUTdK1PDd93/VVr8B8",
            "not base64!",
            "RSOYDt4T1c==UTdK",
        ] {
            let got = Delivery::form(VECTOR_PATH, &body, bad).verify(&[TOKEN]);
            let Err(Rejection::MalformedSignature { detail }) = got else {
                panic!("{bad}: {got:?}");
            };
            assert!(!detail.contains(bad), "{detail}");
        }
        check(
            &Delivery::form(VECTOR_PATH, &body, ""),
            &[TOKEN],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn a_body_neither_form_nor_hashed_is_refused() {
        let sig = signature(TOKEN, &format!("{VECTOR_BASE}/in/twilio"), b"");
        let delivery = Delivery {
            public_url: Some(VECTOR_BASE),
            path: "/in/twilio",
            headers: vec![
                ("content-type", "application/json"),
                (SIGNATURE_HEADER, &sig),
            ],
            body: JSON_BODY,
        };
        check(&delivery, &[TOKEN], Err("malformed_signature"));
        // An empty body needs no parameters (e.g. a bodiless POST).
        check(
            &Delivery {
                body: b"",
                ..delivery
            },
            &[TOKEN],
            Ok(()),
        );
    }

    #[test]
    fn signing_adds_the_idempotency_token_and_ignores_the_fragment() {
        let secret = Secret::from_text(TOKEN);
        let body = form(VECTOR_PARAMS);
        let signed = Twilio::default().sign(&SignRequest {
            url: "https://mycompany.com/myapp.php?foo=1&bar=2#rc=2&ct=1000",
            body: &body,
            secret: &secret,
            now: Timestamp::from_secs(0),
            event_key: "idem-1",
            event_type: None,
        });
        assert_eq!(
            signed,
            [
                (SIGNATURE_HEADER.to_owned(), VECTOR_SIGNATURE.to_owned()),
                (IDEMPOTENCY_HEADER.to_owned(), "idem-1".to_owned()),
            ]
        );
        let pairs: Vec<(&str, &str)> = signed
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .chain([("content-type", FORM)])
            .collect();
        let headers = headers(&pairs);
        let req = request(VECTOR_PATH, &headers, &body);
        let adapter = twilio(Some(VECTOR_BASE));
        assert_eq!(adapter.verify(&req, &[secret], Duration::ZERO), Ok(()));
        assert_eq!(adapter.extract(&req).unwrap()[0].key.as_str(), "idem-1");
    }

    #[test]
    fn the_idempotency_token_is_the_key_when_present() {
        let body = form(&[("MessageSid", "SM1"), ("MessageStatus", "sent")]);
        let events = extract(
            &[("content-type", FORM), (IDEMPOTENCY_HEADER, "tok-42")],
            &body,
        )
        .unwrap();
        assert_eq!(events[0].key.as_str(), "tok-42");
        assert_eq!(events[0].event_type.as_deref(), Some("message.status.sent"));
        // A blank token falls back to the parameters.
        let events = extract(&[("content-type", FORM), (IDEMPOTENCY_HEADER, " ")], &body).unwrap();
        assert_eq!(events[0].key.as_str(), "SM1:sent");
    }

    #[test]
    fn without_a_token_the_key_is_the_sid_and_status() {
        check_key(
            &[
                ("SmsSid", "SM1"),
                ("SmsStatus", "received"),
                ("MessageSid", "SM1"),
            ],
            "SM1:received",
            "message.inbound",
        );
        check_key(
            &[
                ("SmsStatus", "delivered"),
                ("MessageStatus", "delivered"),
                ("MessageSid", "SM2"),
            ],
            "SM2:delivered",
            "message.status.delivered",
        );
        check_key(&[("MessageSid", "SM3")], "SM3", "message.inbound");
        check_key(
            &[("SmsSid", "SM4"), ("SmsStatus", "failed")],
            "SM4:failed",
            "message.status.failed",
        );
        check_key(
            &[("CallSid", "CA1"), ("CallStatus", "ringing")],
            "CA1:ringing",
            "call.ringing",
        );
        check_key(&[("CallSid", "CA2")], "CA2", "call");
    }

    #[test]
    fn a_json_body_supplies_the_parameters() {
        let body = br#"{"MessageSid":"SM9","MessageStatus":"read","Count":3}"#;
        let events = extract(&[("content-type", "application/json")], body).unwrap();
        assert_eq!(events[0].key.as_str(), "SM9:read");
        assert_eq!(events[0].event_type.as_deref(), Some("message.status.read"));
    }

    #[test]
    fn no_token_and_no_sid_is_a_missing_key() {
        for (content_type, body) in [
            (FORM, &b"Body=hello&From=%2B1"[..]),
            (FORM, b""),
            ("application/json", b"[1,2]"),
            ("application/json", b"{not json"),
        ] {
            assert_eq!(
                extract(&[("content-type", content_type)], body).map_err(|r| r.code()),
                Err("missing_event_key")
            );
        }
    }

    #[test]
    fn the_acknowledgement_is_empty_twiml() {
        let headers = HeaderMap::new();
        let reply = Twilio::default()
            .ack_reply(&request("/in/twilio", &headers, b""))
            .unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.content_type, "text/xml");
        assert_eq!(
            reply.body,
            b"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Response></Response>"
        );
    }

    #[test]
    fn retention_is_seven_days_and_there_is_no_handshake() {
        assert_eq!(
            Twilio::default().default_retention(),
            Duration::from_secs(7 * 86_400)
        );
        assert_eq!(Twilio::default().handle_get("a=1"), None);
    }

    proptest! {
        #[test]
        fn arbitrary_headers_paths_and_bodies_never_panic(
            signature in "[ -~]{0,40}",
            host in "[ -~]{0,30}",
            proto in "[ -~]{0,10}",
            path in "[ -~]{0,40}",
            public_url in proptest::option::of("[ -~]{0,30}"),
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let headers = headers(&[
                (SIGNATURE_HEADER, &signature),
                ("host", &host),
                ("x-forwarded-proto", &proto),
                ("content-type", FORM),
            ]);
            let adapter = Twilio { public_url };
            let req = request(&path, &headers, &body);
            let _ = adapter.verify(&req, &[Secret::from_text(TOKEN)], Duration::ZERO);
            let _ = adapter.extract(&req);
            let _ = url_variants(&format!("https://{host}{path}"));
        }

        #[test]
        fn arbitrary_signatures_never_verify(
            sig in proptest::collection::vec(any::<u8>(), 0..32),
        ) {
            let body = form(VECTOR_PARAMS);
            let encoded = STANDARD.encode(&sig);
            let got = Delivery::form(VECTOR_PATH, &body, &encoded).verify(&[TOKEN]);
            prop_assert_eq!(got, Err(Rejection::InvalidSignature));
        }
    }
}
