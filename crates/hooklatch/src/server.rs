//! Serving a router on a listener with hyper directly, for the timeouts axum::serve lacks.
//!
//! hyper's header-read timeout only works with a timer set; without one it silently does
//! nothing. So every connection gets `TokioTimer` and `header_read_timeout`, which closes
//! slowloris connections; the body's own timeout lives in the ingest handler. Shutdown stops
//! accepting, lets open connections finish their request for up to the grace period, then
//! returns.

use std::net::SocketAddr;
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// Serves `router` on `listener` until `cancel`, then drains for up to `grace`.
pub(crate) async fn serve(
    name: &'static str,
    listener: TcpListener,
    router: Router,
    header_timeout: Duration,
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
        let conn = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(header_timeout)
            .keep_alive(true)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(err) = conn.await {
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
