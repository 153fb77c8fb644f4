//! Serving a router on a listener with hyper directly, for the timeouts axum::serve lacks.
//!
//! hyper's header-read timeout only works with a timer set; without one it silently does
//! nothing. So every connection gets `TokioTimer` and `header_read_timeout`, which closes
//! slowloris connections; the body's own timeout lives in the ingest handler. With TLS
//! ([`ListenerTls`]) the handshake runs in the connection's own task, within the same
//! header timeout, so a client that never finishes it holds nothing but its socket for that
//! long. Shutdown stops accepting, lets open connections finish their request for up to the
//! grace period, then returns.

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
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use crate::listener_tls::ListenerTls;

/// Serves `router` on `listener` until `cancel`, then drains for up to `grace`; over TLS
/// when `tls` is given.
pub(crate) async fn serve(
    name: &'static str,
    listener: TcpListener,
    router: Router,
    header_timeout: Duration,
    tls: Option<std::sync::Arc<ListenerTls>>,
    cancel: CancellationToken,
    grace: Duration,
) {
    let graceful = GracefulShutdown::new();
    loop {
        let (stream, peer) = tokio::select! {
            _ = cancel.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(conn) => conn,
                Err(err) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(%err, listener = name, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = router
            .clone()
            .map_request(move |mut req: hyper::Request<Incoming>| {
                req.extensions_mut().insert(ConnectInfo::<SocketAddr>(peer));
                req
            });
        let ingest = name == "ingest";
        let watcher = graceful.watcher();
        let tls = tls.clone();
        tokio::spawn(async move {
            let service = TowerToHyperService::new(service);
            let http = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .keep_alive(true)
                .to_owned();
            let ended = match tls {
                None => {
                    let conn = Connection { stream, ingest };
                    watcher
                        .watch(http.serve_connection(TokioIo::new(conn), service))
                        .await
                }
                Some(tls) => {
                    let handshake = tls.acceptor().accept(stream);
                    let stream = match tokio::time::timeout(header_timeout, handshake).await {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(err)) => return refused(name, peer, &err.to_string()),
                        Err(_) => {
                            return refused(name, peer, "no handshake within the header timeout")
                        }
                    };
                    let conn = Connection { stream, ingest };
                    watcher
                        .watch(http.serve_connection(TokioIo::new(conn), service))
                        .await
                }
            };
            if let Err(err) = ended {
                tracing::debug!(%err, %peer, "connection ended with an error");
            }
        });
    }
    drop(listener);
    tokio::select! {
        _ = graceful.shutdown() => tracing::debug!(listener = name, "connections drained"),
        _ = tokio::time::sleep(grace) => {
            tracing::warn!(listener = name, "shutdown grace over; closing open connections")
        }
    }
}

/// A TLS handshake that did not complete (plain HTTP on the TLS port, a client that distrusts
/// the certificate, a scanner, a client that sent nothing): logged at debug and counted
/// (`hooklatch_tls_handshake_failures_total{listener}`); there is no request to answer or
/// record.
fn refused(listener: &'static str, peer: SocketAddr, why: &str) {
    tracing::debug!(%peer, listener, why, "TLS handshake failed");
    metrics::counter!("hooklatch_tls_handshake_failures_total", "listener" => listener)
        .increment(1);
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
