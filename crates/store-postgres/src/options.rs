//! [`PgOptions`]: how to reach PostgreSQL and how the store behaves there, parsed from the
//! `[store] url` the operator writes.
//!
//! The URL is a libpq-style URL the driver understands (`sslmode`, `options`,
//! `application_name`, ...) plus a few query parameters of hooklatch's own, which are taken
//! out before the URL reaches the driver:
//!
//! ```text
//! postgres://hooklatch:secret@db:5432/hooklatch?sslmode=require&pool_size=32&lock_timeout=2s
//! ```
//!
//! The URL can hold a password, so nothing here prints it: errors never quote the URL, and
//! [`PgOptions`]'s `Debug` shows [`PgOptions::redacted_url`].

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::PgConnectOptions;

/// How to reach PostgreSQL and how the store behaves there.
///
/// Build it with [`PgOptions::from_url`] (or [`PgOptions::new`] and set fields).
#[derive(Clone)]
pub struct PgOptions {
    /// The connection URL as the driver gets it (`postgres://user:pass@host:port/db?sslmode=…`),
    /// without hooklatch's own parameters. It may hold a password: never log it (use
    /// [`PgOptions::redacted_url`]).
    pub url: String,
    /// Most connections the store keeps open (URL `pool_size`, default 16). The connection that
    /// listens for work ([`crate::PostgresStore::listen_for_work`]) and the two of the
    /// delivery attempts' lane come on top.
    pub pool_size: u32,
    /// The wait limit (URL `lock_timeout`, default 5 s): how long any statement of the store
    /// waits for a lock, above all an ingest waiting for another transaction's uncommitted
    /// claim of the same key. Past it the ingest fails with `StoreError::Unavailable` (the
    /// gateway answers 503 and the provider retries). Set as PostgreSQL's `lock_timeout` on
    /// every connection of the store.
    pub lock_timeout: Duration,
    /// Start even when PostgreSQL's durability settings are unsafe (URL
    /// `allow_unsafe_durability=true`, default false): the store then warns at every start and
    /// sets the gauge `hooklatch_unsafe_durability` to 1.
    pub allow_unsafe_durability: bool,
    /// Most jobs (ingests, rejections, handshakes) committed in one transaction (URL
    /// `max_batch`, default 64). A batch in which a job fails on its own runs again with a
    /// savepoint per job; PostgreSQL keeps up to 64 subtransactions per backend in shared
    /// memory and beyond that every other session's snapshots get slower, so larger values
    /// are rarely worth it.
    pub max_batch: usize,
    /// Tasks taking turns at committing the ingest path's batches (URL `writers`, default 4),
    /// each holding one connection while it commits. One batch commits at a time while
    /// batches are quick; the others start beside a batch that takes long (waiting on another
    /// instance's uncommitted claim), so such a wait does not hold up every other ingest.
    /// Delivery attempts commit in a lane of their own, with up to two more such tasks.
    pub writers: usize,
}

impl PgOptions {
    /// Options for a connection URL, with defaults for the rest. The URL is not checked here;
    /// [`PgOptions::from_url`] checks it.
    pub fn new(url: impl Into<String>) -> PgOptions {
        PgOptions {
            url: url.into(),
            pool_size: 16,
            lock_timeout: Duration::from_secs(5),
            allow_unsafe_durability: false,
            max_batch: 64,
            writers: 4,
        }
    }

    /// Parses `postgres://…` (or `postgresql://…`): hooklatch's own query parameters
    /// (`pool_size`, `lock_timeout` such as `5s` or `500ms`, `allow_unsafe_durability`,
    /// `max_batch`, `writers`) are taken out; everything else is left for the driver and
    /// checked by it. Errors never quote the URL, which may hold a password.
    pub fn from_url(url: &str) -> Result<PgOptions, String> {
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(
                "not a postgres URL: it must start with postgres:// or postgresql://".into(),
            );
        }
        // Nothing after a `#` reaches the driver: a password holding one (unencoded) would cut
        // the URL there, and the host dialled would be a piece of the password.
        if url.contains('#') {
            return Err(
                "the URL holds a '#', which ends a URL: percent-encode it as %23 (in a \
                 password, say; '@' is %40, ':' is %3A, '/' is %2F)"
                    .into(),
            );
        }
        // A '/' or '?' in a password, unencoded, ends the host part early: the rest of the
        // password would be read as the path or the query, and named in an error.
        if raw_delimiter_in_userinfo(url) {
            return Err(
                "the URL's user or password holds a '/' or '?' that is not percent-encoded: \
                 '/' is %2F, '?' is %3F ('@' is %40, ':' is %3A, '#' is %23)"
                    .into(),
            );
        }
        let (base, query) = match url.split_once('?') {
            Some((base, query)) => (base, query),
            None => (url, ""),
        };
        let mut opts = PgOptions::new(base);
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = form_urlencoded::parse(pair.as_bytes())
                .next()
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .unwrap_or_default();
            let number =
                |what: &str| -> Result<u64, String> {
                    value.parse::<u64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                        format!("{what} must be a positive whole number, got {value:?}")
                    })
                };
            match key.as_str() {
                "pool_size" => {
                    opts.pool_size = u32::try_from(number("pool_size")?)
                        .map_err(|_| "pool_size is too large".to_owned())?;
                }
                "max_batch" => opts.max_batch = number("max_batch")? as usize,
                "writers" => opts.writers = number("writers")? as usize,
                "lock_timeout" => {
                    opts.lock_timeout = parse_duration(&value).ok_or_else(|| {
                        format!(
                            "lock_timeout must be a duration such as 5s or 500ms, got {value:?}"
                        )
                    })?;
                }
                "allow_unsafe_durability" => {
                    opts.allow_unsafe_durability = match value.as_str() {
                        "true" | "1" | "yes" => true,
                        "false" | "0" | "no" => false,
                        _ => {
                            return Err(format!(
                                "allow_unsafe_durability must be true or false, got {value:?}"
                            ))
                        }
                    };
                }
                driver if takes_driver_parameter(driver) => kept.push(pair),
                // The driver would only log a warning, value and all (a mistyped `password`
                // would put a secret in the log), and a mistyped `sslmode` would quietly leave
                // TLS as the driver's default.
                unknown => {
                    return Err(format!(
                        "unknown URL parameter {unknown:?}: hooklatch takes {} and the driver {}, \
                         options[NAME]",
                        OWN_PARAMETERS.join(", "),
                        DRIVER_PARAMETERS.join(", ")
                    ))
                }
            }
        }
        if !kept.is_empty() {
            opts.url = format!("{base}?{}", kept.join("&"));
        }
        if opts.writers as u64 >= u64::from(opts.pool_size) {
            return Err(format!(
                "writers ({}) must be fewer than pool_size ({}): reads and leases need connections \
                 too; raise pool_size or lower writers (both URL parameters)",
                opts.writers, opts.pool_size
            ));
        }
        opts.connect_options()?;
        Ok(opts)
    }

    /// The URL with its password replaced by `***`, for logs and `Debug`.
    pub fn redacted_url(&self) -> String {
        redact(&self.url)
    }

    /// The driver's options for [`PgOptions::url`], plus what every connection of the store
    /// gets: the wait limit as `lock_timeout`; `READ COMMITTED` as the default isolation (the
    /// leasing and claiming statements rely on its re-check of locked rows, and a server or
    /// role default of `SERIALIZABLE` would turn concurrent leases into errors); and
    /// `application_name=hooklatch` unless the URL names one.
    pub(crate) fn connect_options(&self) -> Result<PgConnectOptions, String> {
        // sqlx wraps its configuration errors, each layer starting "error with configuration: ".
        let parsed = PgConnectOptions::from_str(&self.url).map_err(|e| {
            let e = e.to_string();
            let mut reason = e.as_str();
            while let Some(inner) = reason.strip_prefix("error with configuration: ") {
                reason = inner;
            }
            format!("invalid postgres URL: {reason}")
        })?;
        let named = parsed.get_application_name().is_some();
        let mut res = parsed.options([
            (
                "lock_timeout",
                format!("{}ms", self.lock_timeout.as_millis().max(1)),
            ),
            // The space is escaped: startup options are separated by spaces.
            (
                "default_transaction_isolation",
                r"read\ committed".to_owned(),
            ),
        ]);
        if !named {
            res = res.application_name("hooklatch");
        }
        Ok(res)
    }
}

impl fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgOptions")
            .field("url", &self.redacted_url())
            .field("pool_size", &self.pool_size)
            .field("lock_timeout", &self.lock_timeout)
            .field("allow_unsafe_durability", &self.allow_unsafe_durability)
            .field("max_batch", &self.max_batch)
            .field("writers", &self.writers)
            .finish()
    }
}

/// The URL's query parameters hooklatch reads itself.
const OWN_PARAMETERS: [&str; 5] = [
    "pool_size",
    "lock_timeout",
    "allow_unsafe_durability",
    "max_batch",
    "writers",
];

/// The URL's query parameters the driver reads (besides `options[NAME]`, one server setting
/// each), under their libpq names; it also takes a few spellings of its own (`ssl-mode`).
const DRIVER_PARAMETERS: [&str; 13] = [
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "application_name",
    "options",
    "statement-cache-capacity",
];

/// Whether the driver reads the query parameter `key`.
fn takes_driver_parameter(key: &str) -> bool {
    DRIVER_PARAMETERS.contains(&key)
        || matches!(
            key,
            "ssl-mode" | "ssl-root-cert" | "ssl-ca" | "ssl-cert" | "ssl-key"
        )
        || (key.starts_with("options[") && key.ends_with(']'))
}

/// `5s`, `500ms`, `2m`; a bare number is milliseconds, as PostgreSQL reads `lock_timeout`.
fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let res = match unit.trim() {
        "" | "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" | "min" => Duration::from_secs(n.checked_mul(60)?),
        _ => return None,
    };
    (!res.is_zero()).then_some(res)
}

/// Whether an '@' comes after the host part ends (at the first '/' or '?') and before any
/// query parameter's '=': the sign of a user or password holding an unencoded '/' or '?'
/// (`postgres://u:pa?ss@host/db`), not of an '@' in a parameter's value.
fn raw_delimiter_in_userinfo(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let Some(end) = rest.find(['/', '?']) else {
        return false;
    };
    if rest[..end].contains('@') {
        return false;
    }
    let after = &rest[end..];
    match (after.find('@'), after.find('=')) {
        (Some(at), Some(eq)) => at < eq,
        (Some(_), None) => true,
        (None, _) => false,
    }
}

/// Replaces the password in `scheme://user:password@host/…` (and a `password=` query
/// parameter) with `***`.
fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    // The user info ends at the last '@': a password written without percent-encoding may
    // hold '/' or '?', and none of it may show (a '@' later in the URL masks more, not less).
    let (authority, tail) = match rest.rsplit_once('@') {
        Some((userinfo, after)) => {
            let host_end = after.find(['/', '?']).unwrap_or(after.len());
            let (host, tail) = after.split_at(host_end);
            let authority = match userinfo.split_once(':') {
                Some((user, _password)) => format!("{user}:***@{host}"),
                None => format!("{userinfo}@{host}"),
            };
            (authority, tail)
        }
        None => {
            let host_end = rest.find(['/', '?']).unwrap_or(rest.len());
            let (host, tail) = rest.split_at(host_end);
            (host.to_owned(), tail)
        }
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<&str> = query
                .split('&')
                .map(|pair| {
                    if pair.starts_with("password=") {
                        "password=***"
                    } else {
                        pair
                    }
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{authority}{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(url: &str, expect: &str) {
        let got = match PgOptions::from_url(url) {
            Ok(o) => format!(
                "{} pool={} wait={:?} unsafe={} batch={} writers={}",
                o.url,
                o.pool_size,
                o.lock_timeout,
                o.allow_unsafe_durability,
                o.max_batch,
                o.writers
            ),
            Err(e) => format!("error: {e}"),
        };
        assert_eq!(got, expect, "{url}");
    }

    #[test]
    fn defaults() {
        check(
            "postgres://h/db",
            "postgres://h/db pool=16 wait=5s unsafe=false batch=64 writers=4",
        );
    }

    #[test]
    fn own_parameters_are_taken_out_and_the_rest_kept() {
        check(
            "postgresql://u@h:5433/db?sslmode=disable&pool_size=8&lock_timeout=250ms&writers=2&options=-c%20search_path%3Dx&max_batch=16&allow_unsafe_durability=true",
            "postgresql://u@h:5433/db?sslmode=disable&options=-c%20search_path%3Dx pool=8 wait=250ms unsafe=true batch=16 writers=2",
        );
        check(
            "postgres://h/db?lock_timeout=2s",
            "postgres://h/db pool=16 wait=2s unsafe=false batch=64 writers=4",
        );
        check(
            "postgres://h/db?lock_timeout=1500",
            "postgres://h/db pool=16 wait=1.5s unsafe=false batch=64 writers=4",
        );
    }

    #[test]
    fn bad_values_are_refused_without_quoting_the_url() {
        check(
            "sqlite://x.db",
            "error: not a postgres URL: it must start with postgres:// or postgresql://",
        );
        check(
            "postgres://u:hunter2@h/db?pool_size=0",
            "error: pool_size must be a positive whole number, got \"0\"",
        );
        check(
            "postgres://u:hunter2@h/db?lock_timeout=soon",
            "error: lock_timeout must be a duration such as 5s or 500ms, got \"soon\"",
        );
        check(
            "postgres://u:hunter2@h/db?allow_unsafe_durability=maybe",
            "error: allow_unsafe_durability must be true or false, got \"maybe\"",
        );
        check(
            "postgres://u:hunter2@h/db?pool_size=4&writers=4",
            "error: writers (4) must be fewer than pool_size (4): reads and leases need connections too; raise pool_size or lower writers (both URL parameters)",
        );
        check(
            "postgres://h/db?sslmode=bogus",
            "error: invalid postgres URL: unknown value \"bogus\" for `ssl_mode`",
        );
        // A '#' in a password: the driver would dial "ss" (the rest a fragment).
        let err = PgOptions::from_url("postgres://u:p@ss#Secret2@127.0.0.1:5432/db").unwrap_err();
        assert!(err.starts_with("the URL holds a '#'"), "{err}");
        assert!(!err.contains("Secret2"), "{err}");
        let err = PgOptions::from_url("postgres://u:hunter2@h:notaport/db").unwrap_err();
        assert!(!err.contains("hunter2"), "{err}");
        // A '?' or '/' in a password: the rest of it would be read as a parameter or a path.
        for url in [
            "postgres://postgres:abc?defSECRET@127.0.0.1:5432/db",
            "postgres://postgres:s3c/r?3tSECRET@127.0.0.1:5432/db",
            "postgres://postgres:s3c/rSECRET@127.0.0.1:5432/db",
        ] {
            let err = PgOptions::from_url(url).unwrap_err();
            assert!(err.contains("is %3F"), "{err}");
            assert!(!err.contains("SECRET"), "{err}");
        }
        // An '@' in a parameter's value is no such sign.
        assert!(PgOptions::from_url("postgres://u:p@h/db?application_name=a@b").is_ok());
    }

    #[test]
    fn an_unknown_parameter_is_refused_by_name_without_its_value() {
        // A mistyped sslmode would leave TLS as the driver's default; a mistyped password
        // would reach the driver's log with its value.
        for (url, name) in [
            ("postgres://h/db?sslmod=require", "sslmod"),
            ("postgres://u@h/db?pasword=hunter2", "pasword"),
            ("postgres://h/db?pool_size=4&poolsize=8", "poolsize"),
        ] {
            let err = PgOptions::from_url(url).unwrap_err();
            assert!(
                err.starts_with(&format!(
                    "unknown URL parameter {name:?}: hooklatch takes pool_size"
                )),
                "{err}"
            );
            assert!(err.contains("sslmode"), "{err}");
            assert!(
                !err.contains("hunter2") && !err.contains("require"),
                "{err}"
            );
        }
        // The driver's own spellings and per-setting options pass through.
        check(
            "postgres://h/db?ssl-mode=disable&options[search_path]=x&application_name=a&statement-cache-capacity=10",
            "postgres://h/db?ssl-mode=disable&options[search_path]=x&application_name=a&statement-cache-capacity=10 pool=16 wait=5s unsafe=false batch=64 writers=4",
        );
    }

    #[test]
    fn debug_and_redacted_url_hide_the_password() {
        let opts = PgOptions::from_url("postgres://app:hunter2@db:5432/hl?sslmode=require")
            .expect("valid");
        assert_eq!(
            opts.redacted_url(),
            "postgres://app:***@db:5432/hl?sslmode=require"
        );
        assert!(!format!("{opts:?}").contains("hunter2"));
        let opts = PgOptions::new("postgres://db/hl?user=app&password=hunter2");
        assert_eq!(
            opts.redacted_url(),
            "postgres://db/hl?user=app&password=***"
        );
        assert_eq!(
            PgOptions::new("postgres://app@db/hl").redacted_url(),
            "postgres://app@db/hl"
        );
        // A password holding '/' or '?' unencoded is masked whole.
        assert_eq!(
            PgOptions::new("postgres://app:p/a?s@db:5432/hl?sslmode=require").redacted_url(),
            "postgres://app:***@db:5432/hl?sslmode=require"
        );
    }
}
