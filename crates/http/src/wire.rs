//! One HTTP/1.1 connection as the gateway's listeners serve it, from the bytes on the wire to
//! the router: hyper with a timer (its header-read timeout silently does nothing without one,
//! and that timeout is what closes a slowloris connection), keep-alive, the peer's address
//! handed to the handlers, and the ingest listener's `mid_response_write` crash point. The
//! accept loop (`hooklatch`'s `server`) runs one per accepted TCP or TLS stream; the `wire`
//! fuzz target runs it on an in-memory stream, so what it reaches is what a socket reaches.
//!
//! A request head hyper cannot parse never reaches the router: hyper answers it itself, with
//! an empty 400, 414 or 431, and closes the connection. `Connection` puts the JSON error
//! every other refusal carries in place of that empty answer (`automatic_answer`), so a
//! client reads why, with a stable `code`, as from any other refusal. Such a request is not
//! kept in history, as a request to a path that names no source is not: nothing in a head
//! that does not parse can be trusted to name one.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::http::StatusCode;
use axum::Router;
use hooklatch_core::crash;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tower::ServiceExt;

use crate::ApiError;

/// Serves `router` on `stream`, a connection from `peer`, until the client closes it, it
/// fails, or it sends no whole request head within `header_timeout`; `ingest` arms the
/// ingest listener's crash point (test builds only). The future is what a graceful shutdown
/// watches.
pub fn serve_connection<S>(
    stream: S,
    peer: SocketAddr,
    router: Router,
    header_timeout: Duration,
    ingest: bool,
) -> impl GracefulConnection<Error = hyper::Error> + Send
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let calls = Arc::new(AtomicU64::new(0));
    let counted = calls.clone();
    let service = router.map_request(move |mut req: hyper::Request<Incoming>| {
        counted.fetch_add(1, Ordering::SeqCst);
        req.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
        req
    });
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true)
        .serve_connection(
            TokioIo::new(Connection {
                stream,
                ingest,
                calls,
                answered: 0,
                replacing: None,
            }),
            TowerToHyperService::new(service),
        )
}

/// A served connection: reads and writes pass through to its stream, but for hyper's own
/// answer to a head it could not parse, which is replaced by a JSON one. On the ingest
/// listener, with the `mid_response_write` crash point armed (test builds only; otherwise the
/// check compiles to nothing), a 2xx answer's status line is sent alone and the process
/// aborts: the provider hears a cut answer, never a whole 2xx, after the request was
/// committed.
struct Connection<S> {
    stream: S,
    ingest: bool,
    /// Requests hyper has handed to the router on this connection.
    calls: Arc<AtomicU64>,
    /// Answers to them whose head has been written (1xx interim answers not counted).
    answered: u64,
    /// The JSON answer written in place of hyper's own, and how much of it is written; hyper's
    /// bytes are taken and dropped from then on (it closes the connection after them).
    replacing: Option<(Vec<u8>, usize)>,
}

/// The status of the final answer whose head `head` starts (a 1xx interim answer, or any
/// other write, is `None`).
fn final_status(head: &[u8]) -> Option<&[u8]> {
    let status = head.strip_prefix(b"HTTP/1.")?.get(2..5)?;
    (status.first() != Some(&b'1')).then_some(status)
}

/// Whether `head` is a whole answer with no body, as hyper writes its own answers: a head
/// alone, ending at its blank line, with `content-length: 0`.
fn bodiless(head: &[u8]) -> bool {
    let end = head.windows(4).position(|w| w == b"\r\n\r\n");
    end == head.len().checked_sub(4)
        && head
            .windows(19)
            .any(|w| w.eq_ignore_ascii_case(b"\r\ncontent-length: 0"))
}

/// The JSON answer to write in place of hyper's own empty answer with `status` to a request
/// head it could not parse; `None` for a status hyper does not answer so.
fn automatic_answer(status: &[u8]) -> Option<Vec<u8>> {
    let error = match status {
        b"400" => ApiError::new(
            StatusCode::BAD_REQUEST,
            "malformed_request",
            "the request could not be read as HTTP/1.1: its method, target, version or a header \
             is malformed",
        ),
        b"414" => ApiError::new(
            StatusCode::URI_TOO_LONG,
            "uri_too_long",
            "the request target is longer than the gateway reads",
        ),
        b"431" => ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            "the request's head is larger than the gateway reads, or has more than 100 headers",
        ),
        _ => return None,
    };
    metrics::counter!("hooklatch_malformed_requests_total", "code" => error.code).increment(1);
    tracing::debug!(code = error.code, "a request head that does not parse");
    let body = error.body_bytes();
    let mut answer = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n",
        error.status.as_u16(),
        error.status.canonical_reason().unwrap_or(""),
        body.len()
    )
    .into_bytes();
    answer.extend_from_slice(&body);
    Some(answer)
}

impl<S: AsyncWrite + Unpin> Connection<S> {
    /// Writes what hyper writes now (`bufs`, whose first bytes are `head`, `len` in all), or
    /// the JSON answer in its place when it is hyper's own answer to a head it could not
    /// parse: a final answer's head alone, without a body, written when every request handed
    /// to the router has had its answer's head written already. Counts the answers' heads as
    /// they go out.
    fn poll_write_or_replace(
        &mut self,
        cx: &mut Context<'_>,
        head: &[u8],
        len: usize,
        write: impl FnOnce(Pin<&mut S>, &mut Context<'_>) -> Poll<io::Result<usize>>,
    ) -> Poll<io::Result<usize>> {
        let status = final_status(head);
        if self.replacing.is_none()
            && status.is_some()
            && self.answered >= self.calls.load(Ordering::SeqCst)
            && bodiless(head)
        {
            self.replacing = status.and_then(automatic_answer).map(|answer| (answer, 0));
        }
        let Some((answer, written)) = self.replacing.as_mut() else {
            let wrote = write(Pin::new(&mut self.stream), cx);
            if status.is_some() && matches!(wrote, Poll::Ready(Ok(n)) if n > 0) {
                self.answered += 1;
            }
            return wrote;
        };
        while *written < answer.len() {
            match Pin::new(&mut self.stream).poll_write(cx, &answer[*written..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => *written += n,
                Poll::Ready(Err(err)) => return Poll::Ready(Err(err)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(len))
    }

    fn cut_here(&self, head: &[u8]) -> bool {
        self.ingest && head.starts_with(b"HTTP/1.1 2") && crash::armed(crash::MID_RESPONSE_WRITE)
    }

    /// Sends `HTTP/1.1 2xx` of `head` and aborts.
    fn cut(&mut self, cx: &mut Context<'_>, head: &[u8]) -> ! {
        let status_line = &head[..head.len().min(12)];
        let _ = Pin::new(&mut self.stream).poll_write(cx, status_line);
        crash::abort()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Connection<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Connection<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.cut_here(buf) {
            this.cut(cx, buf);
        }
        this.poll_write_or_replace(cx, buf, buf.len(), |stream, cx| stream.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(head) = bufs.first().filter(|head| this.cut_here(head)) {
            let head = head.to_vec();
            this.cut(cx, &head);
        }
        let head = bufs
            .iter()
            .find(|b| !b.is_empty())
            .map_or(&[][..], |b| &b[..]);
        let len = bufs.iter().map(|b| b.len()).sum();
        this.poll_write_or_replace(cx, head, len, |stream, cx| {
            stream.poll_write_vectored(cx, bufs)
        })
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use axum::routing::post;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// Writes `request` to a connection served by a router that answers `POST /in/x` with
    /// 200 `ok`, and reads everything the server writes until it closes.
    async fn exchange(request: Vec<u8>) -> String {
        let router = Router::new().route("/in/x", post(|| async { "ok" }));
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let peer: SocketAddr = "127.0.0.1:40000".parse().expect("an address");
        let conn = serve_connection(server, peer, router, Duration::from_secs(5), false);
        let served = tokio::spawn(conn);
        client.write_all(&request).await.expect("writing");
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.expect("reading");
        let _ = served.await;
        String::from_utf8_lossy(&answer).into_owned()
    }

    /// The JSON body of the one answer in `answer`, checked to be `status` and closed.
    fn json_answer(answer: &str, status: &str) -> serde_json::Value {
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status} ")),
            "{answer}"
        );
        let (head, body) = answer.split_once("\r\n\r\n").expect("a head");
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(head.contains("connection: close"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        serde_json::from_str(body).expect("a JSON body")
    }

    #[tokio::test]
    async fn a_head_that_does_not_parse_is_answered_400_in_json() {
        for bad in [
            &b"GARBAGE\r\n\r\n"[..],
            b"POST /in/x HTTP/1.1\r\nbad header\r\n\r\n",
            b"POST /in/\x01 HTTP/1.1\r\n\r\n",
            b"POST /in/x HTTP/9.9\r\n\r\n",
        ] {
            let answer = exchange(bad.to_vec()).await;
            let json = json_answer(&answer, "400");
            assert_eq!(json["code"], "malformed_request", "{answer}");
            assert!(json["message"].as_str().is_some_and(|m| !m.is_empty()));
        }
    }

    #[test]
    fn only_a_head_alone_with_no_body_is_taken_for_hyper_s_own() {
        assert!(bodiless(
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\ndate: x\r\n\r\n"
        ));
        assert!(!bodiless(
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\n{}"
        ));
        assert!(!bodiless(
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\nmore"
        ));
        assert!(!bodiless(
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n"
        ));
    }

    #[tokio::test]
    async fn a_head_too_large_is_answered_431_in_json() {
        let mut request = b"POST /in/x HTTP/1.1\r\n".to_vec();
        for i in 0..101 {
            request.extend_from_slice(format!("x-h{i}: v\r\n").as_bytes());
        }
        request.extend_from_slice(b"\r\n");
        let answer = exchange(request).await;
        assert_eq!(json_answer(&answer, "431")["code"], "headers_too_large");
    }

    #[tokio::test]
    async fn a_target_too_long_is_answered_414_in_json() {
        let mut request = b"POST /in/".to_vec();
        request.extend(std::iter::repeat_n(b'x', 70_000));
        request.extend_from_slice(b" HTTP/1.1\r\n\r\n");
        let answer = exchange(request).await;
        assert_eq!(json_answer(&answer, "414")["code"], "uri_too_long");
    }

    #[tokio::test]
    async fn an_answered_request_then_a_bad_head_keeps_the_first_answer_as_it_was() {
        let answer =
            exchange(b"POST /in/x HTTP/1.1\r\ncontent-length: 0\r\n\r\nGARBAGE\r\n\r\n".to_vec())
                .await;
        let (first, second) = answer
            .split_once("okHTTP/1.1")
            .map(|(a, b)| (format!("{a}ok"), format!("HTTP/1.1{b}")))
            .unwrap_or_else(|| panic!("two answers: {answer}"));
        assert!(first.starts_with("HTTP/1.1 200 OK\r\n"), "{first}");
        assert_eq!(json_answer(&second, "400")["code"], "malformed_request");
    }
}
