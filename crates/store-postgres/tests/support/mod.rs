//! Shared by the PostgreSQL tests: where PostgreSQL is (`HOOKLATCH_TEST_POSTGRES_URL`), a
//! fresh database per test, dropped again afterwards, and stores and raw sessions on it.
//!
//! Without the variable each test prints one `skipped:` line and passes, so a plain
//! `cargo test` works on a laptop without PostgreSQL; with `CI` set, a missing variable fails.

#![allow(dead_code)] // each test binary uses its own part of this module

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hooklatch_store_postgres::{PgOptions, PostgresStore};
use sqlx::{Connection, Executor, PgConnection, Row};

/// Where the tests find PostgreSQL: a URL whose user may create databases, e.g.
/// `postgres://postgres@127.0.0.1:5432/postgres`.
pub const URL_VAR: &str = "HOOKLATCH_TEST_POSTGRES_URL";

/// Every test database's name starts with this, followed by its creation time.
const PREFIX: &str = "hooklatch_t_";

/// Databases left by a killed run are dropped once they are this old.
const STALE_AFTER: Duration = Duration::from_secs(3600);

/// The base URL, or `None` after printing the skip line. Panics when `CI` is set: CI must
/// never skip these tests silently.
pub fn base_url(test: &str) -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "{URL_VAR} is not set, and CI is: the PostgreSQL tests must run in CI \
                 (e.g. {URL_VAR}=postgres://postgres@127.0.0.1:5432/postgres)"
            );
            eprintln!(
                "skipped: set {URL_VAR} (e.g. postgres://postgres@127.0.0.1:5432/postgres) to run {test}"
            );
            None
        }
    }
}

/// A database of its own for one test (or one conformance case), dropped when this is.
pub struct TestDb {
    /// The database's name.
    pub name: String,
    /// A URL for it (the base URL with its database replaced).
    pub url: String,
    admin_url: String,
    /// Set once [`TestDb::destroy`] dropped it.
    dropped: bool,
}

impl TestDb {
    /// Creates an empty database through the base URL's database.
    pub async fn create(base: &str) -> TestDb {
        static SWEPT: AtomicBool = AtomicBool::new(false);
        static N: AtomicUsize = AtomicUsize::new(0);
        let mut admin = PgConnection::connect(base)
            .await
            .unwrap_or_else(|e| panic!("connecting to {URL_VAR}: {e}"));
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_secs();
        if !SWEPT.swap(true, Ordering::Relaxed) {
            sweep_stale(&mut admin, now).await;
        }
        let name = format!(
            "{PREFIX}{now}_{}_{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await
            .unwrap_or_else(|e| panic!("creating database {name}: {e}"));
        TestDb {
            url: with_database(base, &name),
            name,
            admin_url: base.to_owned(),
            dropped: false,
        }
    }

    /// Options for a store on this database: small pools, as several stores share one server.
    pub fn options(&self) -> PgOptions {
        let mut opts = PgOptions::from_url(&self.url).expect("a valid test URL");
        opts.pool_size = 4;
        opts.writers = 2;
        opts
    }

    /// A store on this database with [`TestDb::options`].
    pub async fn store(&self) -> PostgresStore {
        self.store_with(self.options()).await
    }

    /// A store on this database with the given options.
    pub async fn store_with(&self, opts: PgOptions) -> PostgresStore {
        PostgresStore::connect(&opts)
            .await
            .unwrap_or_else(|e| panic!("opening the postgres store: {e}"))
    }

    /// A plain session on this database, outside any store.
    pub async fn raw(&self) -> PgConnection {
        PgConnection::connect(&self.url)
            .await
            .unwrap_or_else(|e| panic!("connecting to {}: {e}", self.name))
    }
}

impl TestDb {
    /// Drops the database now, without waiting for `Drop` (which must block a thread).
    pub async fn destroy(mut self) {
        if drop_database(&self.admin_url, &self.name).await.is_ok() {
            self.dropped = true;
        }
    }
}

async fn drop_database(admin_url: &str, name: &str) -> Result<(), sqlx::Error> {
    let mut admin = PgConnection::connect(admin_url).await?;
    admin
        .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
        .await
        .map(|_| ())
}

impl Drop for TestDb {
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        // Drop may run on a runtime thread, where blocking on async work is not allowed: a
        // thread of its own with a small runtime drops the database.
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime to drop the test database");
            rt.block_on(drop_database(&admin_url, &name))
        })
        .join();
        if !matches!(dropped, Ok(Ok(()))) {
            eprintln!("could not drop test database {}", self.name);
        }
    }
}

/// Drops test databases older than [`STALE_AFTER`], left behind by runs that were killed.
async fn sweep_stale(admin: &mut PgConnection, now: u64) {
    let Ok(rows) = sqlx::query("SELECT datname FROM pg_database WHERE datname LIKE $1")
        .bind(format!("{PREFIX}%"))
        .fetch_all(&mut *admin)
        .await
    else {
        return;
    };
    for row in rows {
        let Ok(name) = row.try_get::<String, _>(0) else {
            continue;
        };
        let created = name
            .strip_prefix(PREFIX)
            .and_then(|rest| rest.split('_').next())
            .and_then(|secs| secs.parse::<u64>().ok());
        if created.is_some_and(|t| t + STALE_AFTER.as_secs() < now) {
            let _ = admin
                .execute(format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)").as_str())
                .await;
        }
    }
}

/// `url` with its database (the path) replaced by `database`.
pub fn with_database(url: &str, database: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("a URL with a scheme");
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let query = tail.find('?').map(|i| &tail[i..]).unwrap_or("");
    format!("{scheme}://{authority}/{database}{query}")
}

/// `url` with one more query parameter (already encoded).
pub fn with_param(url: &str, param: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{param}")
}
