//! The ingest listener from the bytes on the wire: what a client writes to the socket, in
//! pieces and with pauses, goes through the connection code every listener runs
//! ([`hooklatch_http::wire::serve_connection`]: hyper's HTTP/1.1 parser with its header-read
//! timeout, keep-alive and pipelining, then the router), on an in-memory stream and the
//! in-memory store, under a paused clock (a pause or a timeout costs no real time).
//!
//! Checked: nothing panics; the connection ends by itself, whatever the client does (a
//! client that goes quiet is closed by the header timeout, a stalled body by the body
//! timeout); what the server writes parses as HTTP/1.1 answers; none is a 5xx but hyper's own
//! `505` to a version it does not speak; every answer with a body to a refusal (4xx) is the
//! JSON error body (`{"code": …, "message": …}`); and when the client sent only well-formed
//! requests (the [`Piece::Request`] pieces, framed by `Content-Length` or chunked), every
//! refusal has that body (none of them is a `HEAD`, whose answers carry none), and the answer
//! to each names a request that history keeps with the method, path and body it was sent.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arbitrary::Arbitrary;
use hooklatch_core::{RequestId, Store, Timestamp};
use hooklatch_http::wire::serve_connection;
use hooklatch_http::REQUEST_ID_HEADER;
use hooklatch_testkit::MemoryStore;
use http::HeaderName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::ingest::gateway;
use crate::{adapters, signed, Name};

/// The listener's header timeout in this target (the default is 10 s; the clock is paused).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a connection may stay open after the client's last write: the header timeout and
/// the body timeout, with room to spare. Longer is a connection a client holds for ever.
const ENDS_WITHIN: Duration = Duration::from_secs(600);

/// One input: what the client writes, and whether it closes its side after.
#[derive(Arbitrary, Debug)]
pub struct Input<'a> {
    /// What the client writes, piece by piece.
    pub writes: Vec<Write<'a>>,
    /// Whether the client shuts its side after the last piece (otherwise it goes quiet and
    /// waits for the server to close).
    pub close: bool,
}

/// A piece of what the client writes, after a pause.
#[derive(Arbitrary, Debug)]
pub struct Write<'a> {
    /// The pause before it, in steps of 100 ms of the paused clock (up to 25.5 s: over the
    /// header timeout).
    pub pause: u8,
    /// What is written.
    pub piece: Piece<'a>,
}

/// Bytes as they are, or a request made well-formed.
#[derive(Arbitrary, Debug)]
pub enum Piece<'a> {
    /// Any bytes.
    Raw(&'a [u8]),
    /// A well-formed request to a configured source.
    Request(Request<'a>),
}

/// A well-formed request: a valid request line (HTTP/1.1 or 1.0, or now and then
/// `HTTP/2.0`, which hyper's parser refuses with a 400), only valid header names and
/// values (none that frames the message), and a body framed as `chunked` says.
#[derive(Arbitrary, Debug)]
pub struct Request<'a> {
    /// Which configured source (`s0`, `s1`, …, wrapping).
    pub source: u8,
    /// POST (most of the time), GET, PUT or DELETE.
    pub method: u8,
    /// Headers; the ones that are not valid, and any framing header, are left out.
    pub headers: Vec<(Name<'a>, &'a [u8])>,
    /// The body.
    pub body: &'a [u8],
    /// How the body is framed: by its length, or chunked in chunks of this size.
    pub chunked: Option<u8>,
    /// A body that stops short: declared this many bytes (and one) longer than it is, or,
    /// chunked, without its last chunk. The body timeout ends it, or the client's close.
    pub short: Option<u8>,
    /// Whether to sign the body as the source's provider does (as a provider sends it).
    pub sign: bool,
    /// The event key signing uses where the provider carries it in a header.
    pub event_key: &'a str,
    /// The protocol version on the request line: HTTP/1.1 (most of the time), HTTP/1.0 (no
    /// keep-alive unless asked; hyper closes after the answer), or `HTTP/2.0`.
    pub version: u8,
}

/// What a well-formed request was, to check history against.
struct Sent {
    method: &'static str,
    path: String,
    body: Vec<u8>,
    /// Whether the whole body was sent.
    complete: bool,
}

impl Request<'_> {
    /// The request's bytes, and what it was.
    fn render(&self) -> (Vec<u8>, Sent) {
        let adapters = adapters();
        let index = usize::from(self.source) % adapters.len();
        let adapter = &*adapters[index].adapter;
        let method = match self.method % 8 {
            0..=4 => "POST",
            5 => "GET",
            6 => "PUT",
            _ => "DELETE",
        };
        let path = format!("/in/s{index}");
        let mut headers = crate::headers(adapter, &self.headers);
        if self.sign {
            let url = format!("http://127.0.0.1:8080{path}");
            let now = Timestamp::now();
            for (name, value) in &signed(adapter, self.body, self.event_key, now, &url) {
                headers.insert(name.clone(), value.clone());
            }
        }
        let version = match self.version % 8 {
            0..=4 => "HTTP/1.1",
            5 | 6 => "HTTP/1.0",
            _ => "HTTP/2.0",
        };
        let mut out = format!("{method} {path} {version}\r\nhost: 127.0.0.1:8080\r\n").into_bytes();
        for (name, value) in &headers {
            if is_framing(name) {
                continue;
            }
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        let missing = self.short.map_or(0, |n| usize::from(n) + 1);
        match self.chunked {
            None => {
                let declared = self.body.len() + missing;
                out.extend_from_slice(format!("content-length: {declared}\r\n\r\n").as_bytes());
                out.extend_from_slice(self.body);
            }
            Some(size) => {
                out.extend_from_slice(b"transfer-encoding: chunked\r\n\r\n");
                for chunk in self.body.chunks(usize::from(size).max(1)) {
                    out.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
                    out.extend_from_slice(chunk);
                    out.extend_from_slice(b"\r\n");
                }
                if missing == 0 {
                    out.extend_from_slice(b"0\r\n\r\n");
                }
            }
        }
        let sent = Sent {
            method,
            path,
            body: self.body.to_vec(),
            complete: missing == 0,
        };
        (out, sent)
    }
}

/// Headers that say where a message ends or whether the connection lasts: the request's
/// rendering writes its own.
fn is_framing(name: &HeaderName) -> bool {
    [
        http::header::CONTENT_LENGTH,
        http::header::TRANSFER_ENCODING,
        http::header::CONNECTION,
        http::header::HOST,
        http::header::UPGRADE,
        http::header::EXPECT,
        http::header::TE,
    ]
    .contains(name)
}

/// One answer read back from the wire.
struct Answer {
    status: u16,
    request_id: Option<String>,
    body: Vec<u8>,
}

/// Reads what the server wrote as a run of HTTP/1.1 answers. An answer to `HEAD` says its
/// length but carries no body: one followed at once by the next status line, or by nothing,
/// is taken as such (no body here starts with `HTTP/`).
fn answers(mut wire: &[u8]) -> Vec<Answer> {
    let mut out = Vec::new();
    while !wire.is_empty() {
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut response = httparse::Response::new(&mut headers);
        let head = match response.parse(wire) {
            Ok(httparse::Status::Complete(head)) => head,
            other => panic!(
                "the server wrote what is not an HTTP/1.1 answer ({other:?}): {:?}",
                String::from_utf8_lossy(wire)
            ),
        };
        let header = |name: &str| {
            response
                .headers
                .iter()
                .find(|h| h.name.eq_ignore_ascii_case(name))
                .map(|h| String::from_utf8_lossy(h.value).into_owned())
        };
        let status = response.code.expect("a status");
        if (100..200).contains(&status) {
            // `100 Continue`, to a client that asked for it: a head alone.
            wire = &wire[head..];
            continue;
        }
        let length: usize = header("content-length")
            .expect("every answer says its length")
            .parse()
            .expect("a length");
        let request_id = header(REQUEST_ID_HEADER);
        let rest = &wire[head..];
        let body_len = if rest.is_empty() || rest.starts_with(b"HTTP/") {
            0
        } else {
            assert!(rest.len() >= length, "an answer cut short: {rest:?}");
            length
        };
        out.push(Answer {
            status,
            request_id,
            body: rest[..body_len].to_vec(),
        });
        wire = &rest[body_len..];
    }
    out
}

/// The promises every answer keeps (the module's doc).
fn check(answer: &Answer) {
    let text = String::from_utf8_lossy(&answer.body);
    assert!(
        answer.status < 500 || (answer.status == 505 && answer.body.is_empty()),
        "a {} answer: {text}",
        answer.status
    );
    if answer.status >= 400 && !answer.body.is_empty() {
        let json: serde_json::Value = serde_json::from_slice(&answer.body)
            .unwrap_or_else(|_| panic!("a {} answer that is not JSON: {text}", answer.status));
        assert!(
            json.get("code").and_then(|c| c.as_str()).is_some()
                && json.get("message").and_then(|m| m.as_str()).is_some(),
            "a {} answer without a code and a message: {json}",
            answer.status
        );
    }
}

/// The answer's request id, from its header or its JSON body.
fn request_id(answer: &Answer) -> Option<RequestId> {
    let id = answer.request_id.clone().or_else(|| {
        let json: serde_json::Value = serde_json::from_slice(&answer.body).ok()?;
        json.get("request_id")?.as_str().map(str::to_owned)
    })?;
    Some(RequestId::parse(&id).expect("an answer names a request id history can parse"))
}

/// The runtime the target runs on: one thread, its clock paused (it jumps to the next timer
/// whenever every task waits).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .expect("a runtime")
}

/// Writes `input` to one connection of a new gateway, then checks what came back.
pub fn run(input: &Input<'_>) {
    let store = Arc::new(MemoryStore::default());
    let router = gateway(store.clone());
    let mut pieces = Vec::with_capacity(input.writes.len());
    let mut sent = Vec::new();
    for write in &input.writes {
        let bytes = match &write.piece {
            Piece::Raw(bytes) => bytes.to_vec(),
            Piece::Request(request) => {
                let (bytes, what) = request.render();
                sent.push(what);
                bytes
            }
        };
        pieces.push((Duration::from_millis(100 * u64::from(write.pause)), bytes));
    }
    let well_formed = input
        .writes
        .iter()
        .all(|w| matches!(w.piece, Piece::Request(_)));

    runtime().block_on(async {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let peer: SocketAddr = "127.0.0.1:40000".parse().expect("an address");
        let connection = tokio::spawn(serve_connection(server, peer, router, HEADER_TIMEOUT, true));
        let (mut from_server, mut to_server) = tokio::io::split(client);
        let reader = tokio::spawn(async move {
            let mut wire = Vec::new();
            let _ = from_server.read_to_end(&mut wire).await;
            wire
        });
        for (pause, bytes) in &pieces {
            tokio::time::sleep(*pause).await;
            if to_server.write_all(bytes).await.is_err() {
                break;
            }
        }
        if input.close {
            let _ = to_server.shutdown().await;
        }
        let Ok(ended) = tokio::time::timeout(ENDS_WITHIN, connection).await else {
            panic!("the connection was still open {ENDS_WITHIN:?} after the client's last write");
        };
        // A connection's own error (a malformed request, a timeout) is an answer or a close,
        // not a failure; a panic in it is.
        if let Err(join) = ended {
            std::panic::resume_unwind(join.into_panic());
        }
        drop(to_server);
        let wire = reader.await.expect("the reader");
        let answers = answers(&wire);
        for answer in &answers {
            check(answer);
        }
        if well_formed {
            assert!(answers.len() <= sent.len(), "more answers than requests");
            // None of these requests is a HEAD, so every refusal carries its JSON body,
            // hyper's own answer to an `HTTP/2.0` request line included.
            for answer in answers.iter().filter(|a| a.status >= 400) {
                assert!(!answer.body.is_empty(), "an empty {} answer", answer.status);
            }
            for (answer, sent) in answers.iter().zip(&sent) {
                let Some(id) = request_id(answer).filter(|_| sent.complete) else {
                    continue;
                };
                let kept = store
                    .get_request(id)
                    .await
                    .expect("the store reads back")
                    .expect("the request the answer names is in history");
                assert_eq!(kept.method, sent.method, "the method kept for {id:?}");
                assert_eq!(kept.path, sent.path, "the path kept for {id:?}");
                assert_eq!(
                    kept.body.as_ref(),
                    &sent.body[..],
                    "the body kept for {id:?}"
                );
            }
        }
    });
}
