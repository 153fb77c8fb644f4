//! Serving a router on a listener with hyper directly, for the timeouts axum::serve lacks.
//!
//! Each accepted connection is served by [`hooklatch_http::wire::serve_connection`] (hyper
//! with a timer, so that its header-read timeout closes slowloris connections; the body's own
//! timeout lives in the ingest handler) in a task of its own. With TLS
//! ([`ListenerTls`]) the handshake runs in the connection's own task, within the same
//! header timeout, so a client that never finishes it holds nothing but its socket for that
//! long. Shutdown stops accepting, lets open connections finish their request for up to the
//! grace period, then returns.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use hooklatch_http::wire::serve_connection;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

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
        let router = router.clone();
        let ingest = name == "ingest";
        let watcher = graceful.watcher();
        let tls = tls.clone();
        tokio::spawn(async move {
            let ended = match tls {
                None => {
                    let conn = serve_connection(stream, peer, router, header_timeout, ingest);
                    watcher.watch(conn).await
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
                    let conn = serve_connection(stream, peer, router, header_timeout, ingest);
                    watcher.watch(conn).await
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
