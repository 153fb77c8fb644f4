//! Captures: one inbound request exactly as the gateway kept it, and the export file that
//! carries captures from a gateway to a laptop.
//!
//! A [`Capture`] is what `hooklatch replay` and `hooklatch check` send again: the body
//! byte-exact, the headers as received (byte-exact too; a value that is not UTF-8 travels as
//! base64), and the metadata needed to re-sign it (source, provider, event keys). Captures
//! come from the admin API (`GET /v1/requests/{id}`, through [`crate::admin`]) or from an
//! export file written by `hooklatch events export`.
//!
//! The export file is a JSON document, a stability promise like the config format:
//!
//! ```json
//! { "hooklatch_export": 1,
//!   "exported_at": "2026-05-02T10:00:00.000Z",
//!   "captures": [ { "request_id": "req_7", "source": "stripe", "provider": "stripe",
//!                   "method": "POST", "path": "/in/stripe", "received_at_ms": 1777716000000,
//!                   "keys": ["evt_1"],
//!                   "headers": [ { "name": "stripe-signature", "value": "t=…,v1=…" } ],
//!                   "body_base64": "eyJpZCI6…" } ] }
//! ```
//!
//! No secret is ever written: hooklatch never stores signing secrets with a request, and the
//! headers that carry credentials for the gateway's own endpoint ([`REDACTED_HEADERS`]) are
//! left out. So are the provider's signature headers (`Stripe-Signature`, …), unless
//! [`ExportOptions::keep_signatures`]: a signature is no secret (it signs that one body and
//! nothing else), but where the provider signs no timestamp (GitHub, Shopify, Twilio, …) it
//! never expires, and a file passed around could be re-sent to a gateway once its key has
//! expired, or to a handler that keeps no keys, and be taken as new. A capture without its
//! signature is replayed by re-signing it with the source's secret (`hooklatch replay
//! --resign`), which a laptop has for its own gateway anyway.

use std::path::Path;

use base64::Engine;
use hooklatch_core::Timestamp;
use serde::{Deserialize, Serialize};

use crate::config::SourceOutline;
pub use hooklatch_http::VERIFIED_REFUSALS;

/// The export format's version, written as `"hooklatch_export": 1`.
pub const EXPORT_VERSION: u32 = 1;

/// Headers never exported: credentials for the gateway's endpoint itself (a password in the
/// webhook URL, cookies), which are no part of the provider's signed request.
pub const REDACTED_HEADERS: &[&str] = &["authorization", "proxy-authorization", "cookie"];

/// One inbound request as the gateway kept it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capture {
    /// The gateway's id for it (`req_7`), when it came from a gateway.
    pub request_id: Option<String>,
    /// The source it was sent to (`/in/{source}`).
    pub source: String,
    /// The source's provider (`stripe`), when known (from the gateway's config at export).
    pub provider: Option<String>,
    /// The HTTP method.
    pub method: String,
    /// Path and query as received (`/in/stripe`).
    pub path: String,
    /// When the gateway received it, milliseconds since the epoch.
    pub received_at_ms: i64,
    /// The event key(s) the gateway extracted (empty for a refused request).
    pub keys: Vec<String>,
    /// The gateway's verdict on it (`accepted`, `rejected`, ...), when it came from a gateway
    /// (exports before this field have none).
    pub verdict: Option<String>,
    /// Why the gateway refused it (`invalid_signature`, `in_flight`, ...), when it did and the
    /// capture says (exports before this field do not).
    pub reason: Option<String>,
    /// Headers as received, in order, byte-exact values.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body, byte-exact.
    pub body: Vec<u8>,
}

/// Why captures could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// The file could not be read.
    #[error("reading {path}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The document is not a hooklatch export (or not a request from the admin API).
    #[error("{0}")]
    Format(String),
    /// The gateway did not keep the body whole (it refused it as too large).
    #[error(
        "{0}: the body was not kept whole (refused as too large, or refused with a body over \
         server.refused_body_limit), so it cannot be replayed"
    )]
    Truncated(String),
}

impl Capture {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// Whether the gateway refused it when it came (verdict `rejected`: a signature, key or
    /// body that did not pass), so nothing vouches for its body. A request refused only after
    /// its signature passed ([`VERIFIED_REFUSALS`]: another copy in flight, the key store
    /// down) is genuine and does not count. A capture without a verdict (an older export)
    /// counts as refused when it has a request id and no event key.
    pub fn was_refused(&self) -> bool {
        match self.verdict.as_deref() {
            Some(verdict) => {
                verdict == "rejected"
                    && !self
                        .reason
                        .as_deref()
                        .is_some_and(|reason| VERIFIED_REFUSALS.contains(&reason))
            }
            None => self.request_id.is_some() && self.keys.is_empty(),
        }
    }

    /// A short name for reports: the request id, else the first key, else the source.
    pub fn label(&self) -> String {
        match (&self.request_id, self.keys.first()) {
            (Some(id), Some(key)) => format!("{id} ({key})"),
            (Some(id), None) => id.clone(),
            (None, Some(key)) => key.clone(),
            (None, None) => self.source.clone(),
        }
    }

    /// Builds a capture from the admin API's `GET /v1/requests/{id}` answer.
    pub fn from_admin_json(value: &serde_json::Value) -> Result<Capture, CaptureError> {
        let raw: AdminRequest = serde_json::from_value(value.clone())
            .map_err(|e| CaptureError::Format(format!("unexpected request JSON: {e}")))?;
        if raw.body_truncated {
            return Err(CaptureError::Truncated(raw.id));
        }
        let label = raw.id.clone();
        Ok(Capture {
            request_id: Some(raw.id),
            source: raw.source,
            provider: None,
            method: raw.method,
            path: raw.path,
            received_at_ms: raw.received_at_ms,
            keys: raw.keys,
            verdict: raw.verdict,
            reason: raw.reason,
            headers: decode_headers(&raw.headers, &label)?,
            body: decode_b64(&raw.body_base64, &format!("{label}: body_base64"))?,
        })
    }
}

/// Fills in each capture's provider from the gateway's configuration (its source's provider).
pub fn fill_providers(captures: &mut [Capture], sources: &[SourceOutline]) {
    for capture in captures.iter_mut().filter(|c| c.provider.is_none()) {
        capture.provider = sources
            .iter()
            .find(|s| s.name == capture.source)
            .map(|s| s.provider.clone());
    }
}

/// Reads an export file.
pub fn load_file(path: &Path) -> Result<Vec<Capture>, CaptureError> {
    let bytes = std::fs::read(path).map_err(|source| CaptureError::Read {
        path: path.display().to_string(),
        source,
    })?;
    read_export(&bytes).map_err(|e| match e {
        CaptureError::Format(msg) => CaptureError::Format(format!("{}: {msg}", path.display())),
        other => other,
    })
}

/// Parses an export document.
pub fn read_export(bytes: &[u8]) -> Result<Vec<Capture>, CaptureError> {
    let version: VersionOnly = serde_json::from_slice(bytes).map_err(|e| {
        CaptureError::Format(format!(
            "not a hooklatch export (a JSON object with \"hooklatch_export\": 1): {e}"
        ))
    })?;
    if version.hooklatch_export != EXPORT_VERSION {
        return Err(CaptureError::Format(format!(
            "export format version {} is not supported (this hooklatch reads version {EXPORT_VERSION})",
            version.hooklatch_export
        )));
    }
    let doc: ExportDoc = serde_json::from_slice(bytes)
        .map_err(|e| CaptureError::Format(format!("malformed export: {e}")))?;
    doc.captures
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let label = format!("captures[{i}]");
            Ok(Capture {
                headers: decode_headers(&c.headers, &label)?,
                body: decode_b64(&c.body_base64, &format!("{label}.body_base64"))?,
                request_id: c.request_id,
                source: c.source,
                provider: c.provider,
                method: c.method,
                path: c.path,
                received_at_ms: c.received_at_ms,
                keys: c.keys,
                verdict: c.verdict,
                reason: c.reason,
            })
        })
        .collect()
}

/// What an export leaves out besides [`REDACTED_HEADERS`], always left out.
#[derive(Debug, Clone, Default)]
pub struct ExportOptions {
    /// Keep the providers' signature headers (`hooklatch events export --keep-signatures`);
    /// left out by default.
    pub keep_signatures: bool,
    /// Signature headers known from the gateway's configuration (every source's adapter's, a
    /// generic source's own name among them), besides the names [`is_signature_header`]
    /// recognises alone.
    pub signature_headers: Vec<String>,
}

impl ExportOptions {
    /// The options for an export, with the signature headers of every source in `sources`.
    pub fn new(keep_signatures: bool, sources: &[SourceOutline]) -> Self {
        let signature_headers = sources
            .iter()
            .flat_map(|source| source.signature_headers.iter().cloned())
            .collect();
        ExportOptions {
            keep_signatures,
            signature_headers,
        }
    }

    /// Whether header `name` is left out of the export.
    pub fn leaves_out(&self, name: &str) -> bool {
        is_redacted(name)
            || (!self.keep_signatures
                && (is_signature_header(name)
                    || self
                        .signature_headers
                        .iter()
                        .any(|h| h.eq_ignore_ascii_case(name))))
    }
}

/// Whether a header's name alone says it carries a signature: it holds `signature` or `hmac`
/// (every built-in provider's signature header does; a generic source's may not, which is
/// why [`ExportOptions`] also takes the configured names).
pub fn is_signature_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    name.contains("signature") || name.contains("hmac")
}

/// Writes captures as an export document (pretty JSON, newline-terminated), leaving out what
/// `options` says.
pub fn write_export(
    captures: &[Capture],
    exported_at: Timestamp,
    options: &ExportOptions,
) -> Vec<u8> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let doc = ExportDoc {
        hooklatch_export: EXPORT_VERSION,
        exported_at: Some(exported_at.to_rfc3339()),
        captures: captures
            .iter()
            .map(|c| ExportCapture {
                request_id: c.request_id.clone(),
                source: c.source.clone(),
                provider: c.provider.clone(),
                method: c.method.clone(),
                path: c.path.clone(),
                received_at_ms: c.received_at_ms,
                keys: c.keys.clone(),
                verdict: c.verdict.clone(),
                reason: c.reason.clone(),
                headers: c
                    .headers
                    .iter()
                    .filter(|(name, _)| !options.leaves_out(name))
                    .map(|(name, value)| match std::str::from_utf8(value) {
                        Ok(text) => WireHeader {
                            name: name.clone(),
                            value: Some(text.to_owned()),
                            value_base64: None,
                        },
                        Err(_) => WireHeader {
                            name: name.clone(),
                            value: None,
                            value_base64: Some(b64.encode(value)),
                        },
                    })
                    .collect(),
                body_base64: b64.encode(&c.body),
            })
            .collect(),
    };
    let mut out = serde_json::to_vec_pretty(&doc).expect("an export document serializes");
    out.push(b'\n');
    out
}

/// Whether a header is left out of exports.
pub fn is_redacted(name: &str) -> bool {
    REDACTED_HEADERS
        .iter()
        .any(|r| r.eq_ignore_ascii_case(name))
}

fn decode_headers(
    headers: &[WireHeader],
    label: &str,
) -> Result<Vec<(String, Vec<u8>)>, CaptureError> {
    headers
        .iter()
        .map(|h| {
            let value = match (&h.value, &h.value_base64) {
                (Some(text), None) => text.as_bytes().to_vec(),
                (None, Some(b64)) => decode_b64(b64, &format!("{label}: header {}", h.name))?,
                _ => {
                    return Err(CaptureError::Format(format!(
                        "{label}: header {} needs exactly one of value and value_base64",
                        h.name
                    )))
                }
            };
            Ok((h.name.clone(), value))
        })
        .collect()
}

fn decode_b64(text: &str, what: &str) -> Result<Vec<u8>, CaptureError> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map_err(|e| CaptureError::Format(format!("{what} is not base64: {e}")))
}

#[derive(Deserialize)]
struct VersionOnly {
    hooklatch_export: u32,
}

#[derive(Serialize, Deserialize)]
struct ExportDoc {
    hooklatch_export: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    exported_at: Option<String>,
    captures: Vec<ExportCapture>,
}

#[derive(Serialize, Deserialize)]
struct ExportCapture {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    request_id: Option<String>,
    source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    provider: Option<String>,
    #[serde(default = "post")]
    method: String,
    path: String,
    #[serde(default)]
    received_at_ms: i64,
    #[serde(default)]
    keys: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    verdict: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
    headers: Vec<WireHeader>,
    body_base64: String,
}

/// A header as the admin API and the export file write it.
#[derive(Serialize, Deserialize)]
struct WireHeader {
    name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    value_base64: Option<String>,
}

/// The fields of `GET /v1/requests/{id}` a capture needs.
#[derive(Deserialize)]
struct AdminRequest {
    id: String,
    source: String,
    method: String,
    path: String,
    received_at_ms: i64,
    #[serde(default)]
    keys: Vec<String>,
    #[serde(default)]
    verdict: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    headers: Vec<WireHeader>,
    body_base64: String,
    #[serde(default)]
    body_truncated: bool,
}

fn post() -> String {
    "POST".to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn capture() -> Capture {
        Capture {
            request_id: Some("req_3".to_owned()),
            source: "stripe".to_owned(),
            provider: Some("stripe".to_owned()),
            method: "POST".to_owned(),
            path: "/in/stripe".to_owned(),
            received_at_ms: 1_700_000_000_123,
            keys: vec!["evt_1".to_owned()],
            verdict: Some("rejected".to_owned()),
            reason: Some("in_flight".to_owned()),
            headers: vec![
                ("content-type".to_owned(), b"application/json".to_vec()),
                ("stripe-signature".to_owned(), b"t=1,v1=ab".to_vec()),
                ("x-auth-mac".to_owned(), b"generic-mac".to_vec()),
                ("x-latin1".to_owned(), vec![b'a', 0xe9]),
                ("authorization".to_owned(), b"Basic dXNlcjpwYXNz".to_vec()),
            ],
            body: b"{\"id\": \"evt_1\",\n \"amount\": 5000}\r\n\xff".to_vec(),
        }
    }

    #[test]
    fn an_export_round_trips_byte_exact_without_credentials_or_signatures() {
        let original = capture();
        // As exported with the gateway's config, which names a generic source's header.
        let options = ExportOptions {
            keep_signatures: false,
            signature_headers: vec!["X-Auth-Mac".to_owned()],
        };
        let bytes = write_export(std::slice::from_ref(&original), Timestamp(0), &options);
        let text = String::from_utf8(bytes.clone()).unwrap();
        assert!(text.contains("\"hooklatch_export\": 1"), "{text}");
        for left_out in ["dXNlcjpwYXNz", "stripe-signature", "x-auth-mac"] {
            assert!(!text.contains(left_out), "{left_out} exported: {text}");
        }
        let back = read_export(&bytes).unwrap();
        let mut expected = original.clone();
        expected.headers.retain(|(n, _)| {
            !["authorization", "stripe-signature", "x-auth-mac"].contains(&n.as_str())
        });
        assert_eq!(back, vec![expected]);

        // Kept on request; credentials never.
        let keep = ExportOptions {
            keep_signatures: true,
            ..options
        };
        let back = read_export(&write_export(
            std::slice::from_ref(&original),
            Timestamp(0),
            &keep,
        ))
        .unwrap();
        let mut expected = original;
        expected.headers.retain(|(n, _)| n != "authorization");
        assert_eq!(back, vec![expected]);
    }

    #[test]
    fn signature_headers_are_known_by_name_or_from_the_configuration() {
        for name in [
            "Stripe-Signature",
            "X-HUB-SIGNATURE-256",
            "X-Shopify-Hmac-Sha256",
        ] {
            assert!(is_signature_header(name), "{name}");
        }
        for name in [
            "content-type",
            "X-GitHub-Delivery",
            "webhook-id",
            "x-auth-mac",
        ] {
            assert!(!is_signature_header(name), "{name}");
        }
        let configured = ExportOptions {
            keep_signatures: false,
            signature_headers: vec!["X-Auth-Mac".to_owned()],
        };
        assert!(configured.leaves_out("x-auth-mac"));
        assert!(configured.leaves_out("Cookie"));
        assert!(!configured.leaves_out("x-github-delivery"));
    }

    #[test]
    fn the_admin_api_answer_is_a_capture() {
        let value = serde_json::json!({
            "id": "req_9", "source": "github", "method": "POST", "path": "/in/github",
            "received_at_ms": 5, "keys": ["d-1"], "verdict": "rejected",
            "reason": "key_store_unavailable", "status": 503,
            "headers": [{"name": "x-github-delivery", "value": "d-1"},
                        {"name": "x-bin", "value_base64": "/w=="}],
            "body_base64": "e30=", "body": "{}", "body_truncated": false, "deliveries": []
        });
        let c = Capture::from_admin_json(&value).unwrap();
        assert_eq!(c.request_id.as_deref(), Some("req_9"));
        assert_eq!(c.header("X-GitHub-Delivery"), Some(&b"d-1"[..]));
        assert_eq!(c.header("x-bin"), Some(&[0xffu8][..]));
        assert_eq!(c.body, b"{}");
        // Refused only after its signature passed: nothing stops a re-signed replay.
        assert_eq!(c.reason.as_deref(), Some("key_store_unavailable"));
        assert!(!c.was_refused());
    }

    #[track_caller]
    fn check_refused(doc: &str, expect: &str) {
        let msg = read_export(doc.as_bytes()).unwrap_err().to_string();
        assert!(msg.contains(expect), "{msg:?} lacks {expect:?}");
    }

    #[test]
    fn malformed_exports_are_refused_with_a_reason() {
        check_refused("[]", "not a hooklatch export");
        check_refused(
            r#"{"hooklatch_export": 2, "captures": []}"#,
            "version 2 is not supported",
        );
        check_refused(
            r#"{"hooklatch_export": 1, "captures": [{"source": "s", "path": "/", "headers": [], "body_base64": "!"}]}"#,
            "captures[0].body_base64 is not base64",
        );
        check_refused(
            r#"{"hooklatch_export": 1, "captures": [{"source": "s", "path": "/", "headers": [{"name": "a"}], "body_base64": ""}]}"#,
            "header a needs exactly one",
        );
    }

    #[test]
    fn a_truncated_body_cannot_become_a_capture() {
        let value = serde_json::json!({
            "id": "req_1", "source": "s", "method": "POST", "path": "/in/s",
            "received_at_ms": 0, "keys": [], "headers": [], "body_base64": "",
            "body_truncated": true
        });
        let msg = Capture::from_admin_json(&value).unwrap_err().to_string();
        assert!(
            msg.starts_with("req_1: the body was not kept whole"),
            "{msg}"
        );
    }
}
