//! The start-up check of PostgreSQL's durability settings, as the store's own connections see
//! them (so settings made per role, per database or in the URL's `options` count).
//!
//! Refused unless explicitly allowed:
//! - `fsync = off`: commits are never forced to disk; a crash of the machine can lose or
//!   corrupt anything.
//! - `full_page_writes = off`: a page torn by a crash cannot be repaired from the WAL, so the
//!   database can be corrupt after a power loss (safe only on storage with atomic page writes,
//!   which is why it is an explicit opt-in rather than always refused).
//! - `synchronous_commit = off`: COMMIT returns before its WAL is flushed; the last few
//!   hundred milliseconds of acknowledged ingests vanish in a crash — exactly what promise 2
//!   (a 2xx means durable) rules out.
//!
//! Accepted: `synchronous_commit = local`, `remote_write`, `on` and `remote_apply`. Every one
//! of them waits for the local WAL flush before COMMIT returns, which is what makes a 2xx
//! durable on this server. `local` only skips waiting for synchronous standbys: whether a
//! failover may lose the last commits is a replication policy the operator chooses, not an
//! unsafe local setting, and refusing it would refuse every primary without a synchronous
//! standby (where `on` behaves as `local` anyway).

use sqlx::{PgConnection, Row};

/// Settings as read from a connection, checked by [`unsafe_settings`].
const QUERY: &str = "SELECT current_setting('fsync'), current_setting('full_page_writes'),
    current_setting('synchronous_commit')";

/// Reads the durability settings on `conn` and returns the unsafe ones as `name=value`.
pub(crate) async fn check(conn: &mut PgConnection) -> Result<Vec<String>, sqlx::Error> {
    let row = sqlx::query(QUERY).fetch_one(conn).await?;
    let settings = [
        ("fsync", row.try_get::<String, _>(0)?),
        ("full_page_writes", row.try_get::<String, _>(1)?),
        ("synchronous_commit", row.try_get::<String, _>(2)?),
    ];
    Ok(unsafe_settings(
        settings.iter().map(|(name, value)| (*name, value.as_str())),
    ))
}

/// The unsafe settings among `(name, value)` pairs, as `name=value`.
pub(crate) fn unsafe_settings<'a>(
    settings: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Vec<String> {
    settings
        .into_iter()
        .filter(|(name, value)| is_unsafe(name, value))
        .map(|(name, value)| format!("{name}={value}"))
        .collect()
}

fn is_unsafe(name: &str, value: &str) -> bool {
    let value = value.trim().to_ascii_lowercase();
    // PostgreSQL shows `off`, but reads every boolean spelling of it (`synchronous_commit`
    // too); the other `synchronous_commit` values all wait for the local flush.
    let off = matches!(value.as_str(), "off" | "false" | "no" | "0");
    off && matches!(name, "fsync" | "full_page_writes" | "synchronous_commit")
}

/// The error that refuses to start, naming each unsafe setting.
pub(crate) fn refusal(found: &[String]) -> String {
    format!(
        "unsafe PostgreSQL durability setting: {} (an acknowledged event could be lost in a \
         crash); fix it on the server, role or database, or start with unsafe durability \
         explicitly allowed",
        found.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(name: &str, value: &str, unsafe_: bool) {
        let got = unsafe_settings([(name, value)]);
        let want: Vec<String> = if unsafe_ {
            vec![format!("{name}={value}")]
        } else {
            Vec::new()
        };
        assert_eq!(got, want, "{name}={value}");
    }

    #[test]
    fn fsync() {
        check("fsync", "on", false);
        check("fsync", "off", true);
    }

    #[test]
    fn full_page_writes() {
        check("full_page_writes", "on", false);
        check("full_page_writes", "off", true);
    }

    #[test]
    fn synchronous_commit() {
        check("synchronous_commit", "on", false);
        check("synchronous_commit", "remote_apply", false);
        check("synchronous_commit", "remote_write", false);
        check("synchronous_commit", "local", false);
        check("synchronous_commit", "off", true);
        check("synchronous_commit", "OFF", true);
    }

    #[test]
    fn the_refusal_names_every_unsafe_setting() {
        let found = unsafe_settings([
            ("fsync", "off"),
            ("full_page_writes", "on"),
            ("synchronous_commit", "off"),
        ]);
        assert_eq!(found, ["fsync=off", "synchronous_commit=off"]);
        let msg = refusal(&found);
        assert!(msg.contains("fsync=off, synchronous_commit=off"), "{msg}");
    }
}
