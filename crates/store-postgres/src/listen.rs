//! Waking idle workers: a task holding a dedicated `LISTEN hooklatch_work` connection.
//!
//! Ingests that queue deliveries, redrives, redeliveries and released leases `NOTIFY
//! hooklatch_work` in their transaction; PostgreSQL delivers the notification at commit to
//! every listening session, on every instance. The listener turns each into
//! `Notify::notify_one`, so a worker waiting for its next due time wakes up at once instead
//! of polling. Notifications are a hint, never the source of truth: a worker still asks the
//! store what is due, and a lost notification only delays work until the worker's next poll.
//! For the same reason the listener also wakes the worker after every (re)connection, since
//! notifications sent while it was away are lost.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use tokio::sync::{watch, Notify};

use crate::WORK_CHANNEL;

/// The first pause after a failed connection; it doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Listens until `shutdown`'s sender is dropped (the store is gone) or the task is aborted.
pub(crate) async fn run(
    connect: PgConnectOptions,
    notify: Arc<Notify>,
    mut shutdown: watch::Receiver<()>,
) {
    let mut backoff = MIN_BACKOFF;
    loop {
        let err = tokio::select! {
            _ = shutdown.changed() => return,
            err = listen(&connect, &notify, &mut backoff) => err,
        };
        tracing::warn!(err = %crate::map_err(err), retry_in = ?backoff, "postgres: listening for work failed");
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// One listening session; returns only on an error.
async fn listen(
    connect: &PgConnectOptions,
    notify: &Notify,
    backoff: &mut Duration,
) -> sqlx::Error {
    // Its own one-connection pool, outside the store's: the listener's connection lives as
    // long as the listener, and the pool is how PgListener reconnects.
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_lazy_with(connect.clone());
    let mut listener = match PgListener::connect_with(&pool).await {
        Ok(listener) => listener,
        Err(err) => return err,
    };
    if let Err(err) = listener.listen(WORK_CHANNEL).await {
        return err;
    }
    *backoff = MIN_BACKOFF;
    tracing::debug!("postgres: listening for work");
    // Work may have been queued while nobody listened.
    notify.notify_one();
    loop {
        match listener.try_recv().await {
            Ok(Some(_)) => notify.notify_one(),
            // The connection dropped and was made again; anything sent meanwhile is lost.
            Ok(None) => notify.notify_one(),
            Err(err) => return err,
        }
    }
}
