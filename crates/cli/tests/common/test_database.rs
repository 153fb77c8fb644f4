//! A database of a test's own on the PostgreSQL server `HOOKLATCH_TEST_POSTGRES_URL` points
//! at: made by the test, dropped at its end — by [`TestDatabase::drop_now`], or, when the test
//! panicked before it, as the value is dropped. Shared by the test binaries (`#[path]`).
#![allow(dead_code)]

use sqlx::Connection;

pub struct TestDatabase {
    admin_url: String,
    name: String,
    /// Set by [`TestDatabase::drop_now`]: nothing left for `Drop` to do.
    dropped: bool,
}

impl TestDatabase {
    /// A database called `name` (lowercased) on the server of `HOOKLATCH_TEST_POSTGRES_URL`;
    /// `None` (after printing why) when that is not set outside CI, a failure under CI.
    pub async fn create(name: &str) -> Option<TestDatabase> {
        let Ok(admin_url) = std::env::var("HOOKLATCH_TEST_POSTGRES_URL") else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set but HOOKLATCH_TEST_POSTGRES_URL is not: the PostgreSQL tests must run"
            );
            println!("skipped: set HOOKLATCH_TEST_POSTGRES_URL to run the PostgreSQL tests");
            return None;
        };
        Some(TestDatabase::create_on(&admin_url, name).await)
    }

    /// A database called `name` (lowercased) on the server at `admin_url`.
    pub async fn create_on(admin_url: &str, name: &str) -> TestDatabase {
        let name = name.to_lowercase();
        let mut conn = sqlx::PgConnection::connect(admin_url)
            .await
            .expect("connecting to HOOKLATCH_TEST_POSTGRES_URL");
        sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(&mut conn)
            .await
            .expect("creating the test database");
        let _ = conn.close().await;
        TestDatabase {
            admin_url: admin_url.to_owned(),
            name,
            dropped: false,
        }
    }

    /// The database's name (lowercased, as created).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The admin URL with its database name replaced by this one.
    pub fn url(&self) -> String {
        let (base, query) = match self.admin_url.split_once('?') {
            Some((b, q)) => (b, Some(q)),
            None => (self.admin_url.as_str(), None),
        };
        let server = base.rsplit_once('/').map_or(base, |(s, _)| s);
        match query {
            Some(q) => format!("{server}/{}?{q}", self.name),
            None => format!("{server}/{}", self.name),
        }
    }

    /// Drops the database, so runs do not leave one each behind.
    pub async fn drop_now(mut self) {
        self.dropped = true;
        drop_database(&self.admin_url, &self.name).await;
    }
}

impl Drop for TestDatabase {
    /// A test that panicked before [`TestDatabase::drop_now`] still drops its database: on a
    /// thread of its own with a runtime of its own, as the test's runtime may be the one
    /// unwinding.
    fn drop(&mut self) {
        if self.dropped {
            return;
        }
        let (admin_url, name) = (self.admin_url.clone(), self.name.clone());
        on_a_runtime_of_its_own(async move { drop_database(&admin_url, &name).await });
    }
}

/// Runs `work` to its end on a thread with a runtime of its own: what a `Drop` needs, as the
/// test's runtime may be the one unwinding.
pub fn on_a_runtime_of_its_own(work: impl std::future::Future<Output = ()> + Send + 'static) {
    let _ = std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        runtime.block_on(work);
    })
    .join();
}

/// `DROP DATABASE … WITH (FORCE)`: the gateways a test started may still be connected.
async fn drop_database(admin_url: &str, name: &str) {
    if let Ok(mut conn) = sqlx::PgConnection::connect(admin_url).await {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
            .execute(&mut conn)
            .await;
    }
}
