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
//!
//! A `NOTIFY` is for the other instances: an instance wakes its own worker in memory. So the
//! ingest batches send one only while another instance listens ([`OtherListeners`]). Each
//! listener's connection carries a name of its own instance's ([`listener_name`]) as its
//! `application_name`, and [`watch_others`] looks for the other names in `pg_stat_activity`
//! every [`WATCH_INTERVAL`]. An instance that starts listening in between hears nothing of
//! the ingests committed before the others see it; it finds their deliveries at its start
//! (the listener wakes its worker once it listens) or at its worker's next poll.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPoolOptions};
use sqlx::PgPool;
use tokio::sync::{watch, Notify};

use crate::WORK_CHANNEL;

/// How the listeners' connections are named: this, then the instance's own token.
const LISTENER_PREFIX: &str = "hooklatch listener ";

/// How often an instance looks again whether another one listens.
pub(crate) const WATCH_INTERVAL: Duration = Duration::from_secs(1);

/// The `application_name` of this instance's listener: [`LISTENER_PREFIX`] and a random
/// token, so the instance can tell its own listener from the others'.
pub(crate) fn listener_name() -> String {
    format!("{LISTENER_PREFIX}{:016x}", rand::rng().random::<u64>())
}

/// Whether another instance's listener was connected to the database when this one last
/// looked. True until the first look, and after a look that failed: a `NOTIFY` too many
/// costs a round trip, one too few costs another instance's worker up to its poll interval.
#[derive(Clone)]
pub(crate) struct OtherListeners(Arc<AtomicBool>);

impl OtherListeners {
    pub(crate) fn new() -> OtherListeners {
        OtherListeners(Arc::new(AtomicBool::new(true)))
    }

    pub(crate) fn any(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    fn set(&self, any: bool) {
        if self.0.swap(any, Ordering::Relaxed) != any {
            tracing::debug!(
                other_listeners = any,
                "postgres: ingests notify other instances: {any}"
            );
        }
    }
}

/// Looks every [`WATCH_INTERVAL`] for a listener other than `own` (this instance's
/// [`listener_name`]) on the database, until `shutdown`'s sender is dropped.
pub(crate) async fn watch_others(
    pool: PgPool,
    own: String,
    others: OtherListeners,
    mut shutdown: watch::Receiver<()>,
) {
    loop {
        let seen = sqlx::query_scalar::<_, bool>(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
              WHERE datname = current_database()
                AND starts_with(application_name, $1) AND application_name <> $2)",
        )
        .bind(LISTENER_PREFIX)
        .bind(&own)
        .fetch_one(&pool);
        let seen = tokio::select! {
            _ = shutdown.changed() => return,
            seen = seen => seen,
        };
        match seen {
            Ok(any) => others.set(any),
            Err(err) => {
                tracing::debug!(err = %crate::map_err(err), "postgres: could not look for other listeners");
                others.set(true);
            }
        }
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tokio::time::sleep(WATCH_INTERVAL) => {}
        }
    }
}

/// The first pause after a failed connection; it doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Listens until `shutdown`'s sender is dropped (the store is gone) or the task is aborted.
/// `connect` names the connection (the instance's [`listener_name`]).
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
        tracing::warn!(err = %crate::map_err(err), retry_in_ms = backoff.as_millis() as u64, "postgres: listening for work failed");
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
