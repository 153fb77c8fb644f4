//! Effect probes: how `hooklatch check` counts what a handler did for one event key.
//!
//! A probe is a SQL query against the application's database (`SELECT count(*) FROM credits
//! WHERE event_id = :key`) or a shell command printing a number. `:key` is a named bind
//! parameter, bound to the event's key as text — never pasted into the SQL. SQLite databases
//! (`sqlite://PATH`) are read through rusqlite, read-only; PostgreSQL (`postgres://…`) through
//! sqlx, where `:key` becomes `$1`. A command gets the key in the `HOOKLATCH_KEY` environment
//! variable (again, never pasted into the command line) and prints one integer.

use std::path::PathBuf;
use std::time::Duration;

/// Why an effect could not be counted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EffectError {
    /// The database URL's scheme is not supported.
    #[error("unsupported database URL {0:?}: expected sqlite://PATH or postgres://…")]
    UnsupportedDatabase(String),
    /// The query failed.
    #[error("running the effect query")]
    Sqlite(#[from] rusqlite::Error),
    /// The query failed.
    #[cfg(feature = "check-postgres")]
    #[error("running the effect query on PostgreSQL")]
    Postgres(#[from] sqlx::Error),
    /// The command could not run, or failed.
    #[error("running the effect command: {0}")]
    Command(String),
    /// The answer is not a number.
    #[error("the effect {0}")]
    NotANumber(String),
}

/// Where the effect count comes from.
#[derive(Debug, Clone)]
pub enum EffectProbe {
    /// A query on a SQLite file.
    Sqlite {
        /// The database file.
        path: PathBuf,
        /// The query; `:key` is bound.
        sql: String,
    },
    /// A query on PostgreSQL.
    #[cfg(feature = "check-postgres")]
    Postgres {
        /// The connection URL.
        url: String,
        /// The query; `:key` is bound.
        sql: String,
    },
    /// A shell command printing a number; the key is in `HOOKLATCH_KEY`.
    Command(String),
}

impl EffectProbe {
    /// A SQL probe on the database at `db` (`sqlite://PATH`, `postgres://…`).
    pub fn sql(db: &str, sql: &str) -> Result<EffectProbe, EffectError> {
        if let Some(rest) = db
            .strip_prefix("sqlite://")
            .or_else(|| db.strip_prefix("sqlite:"))
        {
            let path = rest.split('?').next().unwrap_or_default();
            if path.is_empty() {
                return Err(EffectError::UnsupportedDatabase(db.to_owned()));
            }
            return Ok(EffectProbe::Sqlite {
                path: PathBuf::from(path),
                sql: sql.to_owned(),
            });
        }
        #[cfg(feature = "check-postgres")]
        if db.starts_with("postgres://") || db.starts_with("postgresql://") {
            return Ok(EffectProbe::Postgres {
                url: db.to_owned(),
                sql: sql.to_owned(),
            });
        }
        Err(EffectError::UnsupportedDatabase(db.to_owned()))
    }

    /// A short description for reports, without credentials.
    pub fn describe(&self) -> String {
        match self {
            EffectProbe::Sqlite { sql, .. } => format!("SQLite: {sql}"),
            #[cfg(feature = "check-postgres")]
            EffectProbe::Postgres { sql, .. } => format!("PostgreSQL: {sql}"),
            EffectProbe::Command(cmd) => format!("command: {cmd}"),
        }
    }

    /// How many effects `key` has now.
    pub async fn count(&self, key: &str) -> Result<i64, EffectError> {
        match self {
            EffectProbe::Sqlite { path, sql } => {
                let (path, sql, key) = (path.clone(), sql.clone(), key.to_owned());
                tokio::task::spawn_blocking(move || sqlite_count(&path, &sql, &key))
                    .await
                    .map_err(|e| EffectError::Command(format!("the query task failed: {e}")))?
            }
            #[cfg(feature = "check-postgres")]
            EffectProbe::Postgres { url, sql } => postgres_count(url, sql, key).await,
            EffectProbe::Command(cmd) => command_count(cmd, key).await,
        }
    }
}

fn sqlite_count(path: &std::path::Path, sql: &str, key: &str) -> Result<i64, EffectError> {
    use rusqlite::types::ValueRef;
    use rusqlite::OpenFlags;
    let conn = rusqlite::Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )?;
    // The application may be writing: wait for its lock rather than fail.
    conn.busy_timeout(Duration::from_secs(10))?;
    let mut stmt = conn.prepare(sql)?;
    let key_index = stmt.parameter_index(":key")?;
    if stmt.parameter_count() > usize::from(key_index.is_some()) {
        return Err(EffectError::NotANumber(
            "query may have no parameter but :key".to_owned(),
        ));
    }
    if let Some(i) = key_index {
        stmt.raw_bind_parameter(i, key)?;
    }
    let mut rows = stmt.raw_query();
    let Some(row) = rows.next()? else {
        return Ok(0);
    };
    match row.get_ref(0)? {
        ValueRef::Null => Ok(0),
        ValueRef::Integer(n) => Ok(n),
        ValueRef::Real(f) if f.fract() == 0.0 => Ok(f as i64),
        ValueRef::Text(t) => parse_count(&String::from_utf8_lossy(t)),
        _ => Err(EffectError::NotANumber(
            "query's first column is not an integer".to_owned(),
        )),
    }
}

#[cfg(feature = "check-postgres")]
async fn postgres_count(url: &str, sql: &str, key: &str) -> Result<i64, EffectError> {
    use sqlx::{Connection, Row};
    let (sql, binds_key) = postgres_placeholders(sql);
    let mut conn = sqlx::PgConnection::connect(url).await?;
    let mut query = sqlx::query(&sql);
    if binds_key {
        query = query.bind(key);
    }
    let row = query.fetch_optional(&mut conn).await?;
    let _ = conn.close().await;
    let Some(row) = row else {
        return Ok(0);
    };
    if let Ok(n) = row.try_get::<Option<i64>, _>(0) {
        return Ok(n.unwrap_or(0));
    }
    if let Ok(n) = row.try_get::<Option<i32>, _>(0) {
        return Ok(n.map_or(0, i64::from));
    }
    if let Ok(text) = row.try_get::<Option<String>, _>(0) {
        return text.map_or(Ok(0), |t| parse_count(&t));
    }
    Err(EffectError::NotANumber(
        "query's first column is not an integer (cast it: count(*)::bigint, sum(x)::bigint)"
            .to_owned(),
    ))
}

async fn command_count(cmd: &str, key: &str) -> Result<i64, EffectError> {
    let (cmd, key) = (cmd.to_owned(), key.to_owned());
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(&cmd)
            .env("HOOKLATCH_KEY", &key)
            .stdin(std::process::Stdio::null())
            .output()
    })
    .await
    .map_err(|e| EffectError::Command(format!("the command task failed: {e}")))?
    .map_err(|e| EffectError::Command(e.to_string()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(EffectError::Command(format!(
            "{}: {}",
            output.status,
            stderr.trim()
        )));
    }
    parse_count(&String::from_utf8_lossy(&output.stdout))
}

fn parse_count(text: &str) -> Result<i64, EffectError> {
    let text = text.trim();
    text.parse::<i64>()
        .map_err(|_| EffectError::NotANumber(format!("answer {text:?} is not an integer")))
}

/// Rewrites `:key` to PostgreSQL's `$1` outside string literals, quoted identifiers, comments
/// and `::` casts; says whether there was one.
pub fn postgres_placeholders(sql: &str) -> (String, bool) {
    let bytes = sql.as_bytes();
    let mut out = String::with_capacity(sql.len());
    let mut found = false;
    let mut i = 0;
    let is_ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    while i < bytes.len() {
        let rest = &sql[i..];
        let skip_to = |end: Option<usize>| end.map_or(sql.len(), |e| i + e);
        let next = match bytes[i] {
            b'\'' => skip_to(rest[1..].find('\'').map(|e| e + 2)),
            b'"' => skip_to(rest[1..].find('"').map(|e| e + 2)),
            b'-' if rest.starts_with("--") => skip_to(rest.find('\n')),
            b':' if rest.starts_with("::") => i + 2,
            b':' if rest.starts_with(":key")
                && !bytes.get(i + 4).copied().is_some_and(is_ident)
                && !(i > 0 && bytes[i - 1] == b':') =>
            {
                out.push_str("$1");
                found = true;
                i += 4;
                continue;
            }
            _ => i + rest.chars().next().map_or(1, char::len_utf8),
        };
        out.push_str(&sql[i..next]);
        i = next;
    }
    (out, found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(sql: &str, expect: &str, found: bool) {
        assert_eq!(postgres_placeholders(sql), (expect.to_owned(), found));
    }

    #[test]
    fn key_becomes_dollar_one_outside_quotes_and_casts() {
        check(
            "SELECT count(*) FROM credits WHERE event_id = :key",
            "SELECT count(*) FROM credits WHERE event_id = $1",
            true,
        );
        check("SELECT :key::text", "SELECT $1::text", true);
        check("SELECT ':key', \":key\"", "SELECT ':key', \":key\"", false);
        check("SELECT 1 -- :key\n", "SELECT 1 -- :key\n", false);
        check("SELECT :keys", "SELECT :keys", false);
        check("SELECT x::key", "SELECT x::key", false);
        check("SELECT 'é' || :key", "SELECT 'é' || $1", true);
    }

    #[test]
    fn sqlite_counts_with_the_key_bound() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("app.db");
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "CREATE TABLE credits (event_id TEXT); INSERT INTO credits VALUES ('a'), ('a'), ('b');",
        )
        .unwrap();
        let count = |sql: &str, key: &str| sqlite_count(&path, sql, key);
        let sql = "SELECT count(*) FROM credits WHERE event_id = :key";
        assert_eq!(count(sql, "a").unwrap(), 2);
        assert_eq!(count(sql, "a' OR 1=1 --").unwrap(), 0);
        assert_eq!(count("SELECT count(*) FROM credits", "x").unwrap(), 3);
        assert!(count("SELECT ?1", "x").is_err());
    }

    #[test]
    fn database_urls_pick_the_backend() {
        assert!(matches!(
            EffectProbe::sql("sqlite://app.db", "x").unwrap(),
            EffectProbe::Sqlite { .. }
        ));
        assert!(EffectProbe::sql("mysql://x", "x").is_err());
    }
}
