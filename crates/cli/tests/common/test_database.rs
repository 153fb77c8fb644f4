//! A database of a test's own on the PostgreSQL server `HOOKLATCH_TEST_POSTGRES_URL` points
//! at: made by the test, dropped at its end. Shared by the test binaries (`#[path]`).
#![allow(dead_code)]

use sqlx::Connection;

pub struct TestDatabase {
    admin_url: String,
    name: String,
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
        }
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
    pub async fn drop_now(self) {
        if let Ok(mut conn) = sqlx::PgConnection::connect(&self.admin_url).await {
            let _ = sqlx::query(&format!(
                "DROP DATABASE IF EXISTS \"{}\" WITH (FORCE)",
                self.name
            ))
            .execute(&mut conn)
            .await;
        }
    }
}
