//! One HTTP/1.1 connection as the gateway's listeners serve it, from the bytes on the wire to
//! the router: hyper with a timer (its header-read timeout silently does nothing without one,
//! and that timeout is what closes a slowloris connection), keep-alive, the peer's address
//! handed to the handlers, and the ingest listener's `mid_response_write` crash point. The
//! accept loop (`hooklatch`'s `server`) runs one per accepted TCP or TLS stream; the `wire`
//! fuzz target runs it on an in-memory stream, so what it reaches is what a socket reaches.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hooklatch_core::crash;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tower::ServiceExt;

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
    let service = router.map_request(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
        req
    });
    hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .keep_alive(true)
        .serve_connection(
            TokioIo::new(Connection { stream, ingest }),
            TowerToHyperService::new(service),
        )
}

/// A served connection: reads and writes pass through to its stream. On the ingest listener,
/// with the `mid_response_write` crash point armed (test builds only; otherwise the check
/// compiles to nothing), a 2xx answer's status line is sent alone and the process aborts: the
/// provider hears a cut answer, never a whole 2xx, after the request was committed.
struct Connection<S> {
    stream: S,
    ingest: bool,
}

impl<S: AsyncWrite + Unpin> Connection<S> {
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
        Pin::new(&mut this.stream).poll_write(cx, buf)
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
        Pin::new(&mut this.stream).poll_write_vectored(cx, bufs)
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
