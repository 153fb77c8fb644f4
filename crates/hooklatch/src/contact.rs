//! `hooklatch check-config --connect`: each service the configuration names, contacted once,
//! changing nothing, and what `serve` would make of it.
//!
//! The store and the key store must answer (`serve` does not start without them); a broker or
//! an application that does not answer is said, not failed on: `serve` starts without them and
//! its deliveries wait in the outbox.

use std::time::Duration;

use crate::config::{DestinationKind, Settings, StoreBackend};

/// How long a destination is waited for.
const TIMEOUT: Duration = Duration::from_secs(10);

/// One service contacted.
#[derive(Debug)]
pub struct Contact {
    /// What it is, as the configuration names it: `store`, `keys`, a destination's name.
    pub what: String,
    /// Where, with no credential.
    pub at: String,
    /// What it answered, or why nothing did.
    pub said: String,
    /// What that means for `serve`.
    pub state: State,
}

/// What a contact means for `serve`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// It answered as `serve` needs.
    Ok,
    /// `serve` starts, but would warn about it, or cannot reach it yet.
    Warn,
    /// `serve` would not start.
    Fail,
}

impl Contact {
    /// `outcome` of a service `serve` needs (`Err`: it would not start) or does not (`Err`: it
    /// would start, and say so).
    fn new(what: &str, at: String, outcome: Result<String, String>, required: bool) -> Contact {
        let (state, said) = match outcome {
            Ok(said) => (State::Ok, said),
            Err(said) if required => (State::Fail, said),
            Err(said) => (State::Warn, said),
        };
        Contact {
            what: what.to_owned(),
            at,
            said,
            state,
        }
    }

    /// A service that answered, but that `serve` would warn about.
    fn warn(what: &str, at: String, said: String) -> Contact {
        Contact {
            what: what.to_owned(),
            at,
            said,
            state: State::Warn,
        }
    }
}

/// Contacts every service `settings` names: the store, the key store, each destination.
pub async fn contact(settings: &Settings) -> Vec<Contact> {
    let mut contacts = vec![store(settings).await];
    if let Some(keys) = &settings.store.keys {
        let at = format!("redis {}", hooklatch_keys_redis::describe_url(&keys.url));
        let contact = match hooklatch_keys_redis::RedisKeys::connect_with_tls(
            &keys.url,
            &keys.prefix,
            &keys.tls,
        )
        .await
        {
            Ok(redis) => match redis.check().await {
                warnings if warnings.is_empty() => Contact::new(
                    "keys",
                    at,
                    Ok("answers; its settings keep keys".to_owned()),
                    true,
                ),
                // serve starts, warns, and counts them in hooklatch_key_store_may_forget.
                warnings => {
                    Contact::warn("keys", at, format!("answers, but {}", warnings.join("; ")))
                }
            },
            Err(err) => Contact::new("keys", at, Err(err.to_string()), true),
        };
        contacts.push(contact);
    }
    for d in &settings.destinations {
        contacts.push(destination(d).await);
    }
    contacts
}

async fn store(settings: &Settings) -> Contact {
    match &settings.store.backend {
        #[cfg(feature = "sqlite")]
        StoreBackend::Sqlite(opts) => {
            let at = format!("sqlite {}", opts.path.display());
            match hooklatch_store_sqlite::serving::ServingLock::holder(&opts.path) {
                // The file is fine (a gateway serves it); a second serve would not start.
                Some(pid) => Contact::warn(
                    "store",
                    at,
                    format!(
                        "served now by {}: a second serve on this file would not start \
                         (one serve per SQLite file)",
                        if pid.is_empty() {
                            "another process".to_owned()
                        } else {
                            format!("process {pid}")
                        }
                    ),
                ),
                None => Contact::new("store", at, sqlite_file(&opts.path), true),
            }
        }
        #[cfg(feature = "postgres")]
        StoreBackend::Postgres(opts) => {
            // Unsafe settings let through: serve starts, and warns at every start.
            let mut allowed_unsafe = false;
            let outcome = match hooklatch_store_postgres::PostgresStore::probe(opts).await {
                Err(err) => Err(err.to_string()),
                Ok(probe)
                    if !probe.unsafe_durability.is_empty() && !opts.allow_unsafe_durability =>
                {
                    Err(format!(
                        "answers, but serve refuses its durability settings: {} (unless \
                         started with --allow-unsafe-durability, or the URL says \
                         allow_unsafe_durability=true: for a throwaway database only; \
                         check-config takes the same flag)",
                        probe.unsafe_durability.join(", ")
                    ))
                }
                Ok(probe) if probe.schema > probe.this_build => Err(format!(
                    "answers, but its schema is v{}, newer than this build's v{}: an older \
                     hooklatch would run on a newer gateway's tables",
                    probe.schema, probe.this_build
                )),
                Ok(probe) => {
                    allowed_unsafe = !probe.unsafe_durability.is_empty();
                    Ok(format!(
                        "answers; durability settings {}; schema {}",
                        if probe.unsafe_durability.is_empty() {
                            "safe".to_owned()
                        } else {
                            format!("UNSAFE, allowed ({})", probe.unsafe_durability.join(", "))
                        },
                        match probe.schema {
                            0 => format!("none yet (serve creates v{})", probe.this_build),
                            v if v == probe.this_build => format!("v{v}, up to date"),
                            v => format!("v{v} (serve migrates it to v{})", probe.this_build),
                        }
                    ))
                }
            };
            let at = format!("postgres {}", opts.redacted_url());
            match outcome {
                Ok(said) if allowed_unsafe => Contact::warn("store", at, said),
                outcome => Contact::new("store", at, outcome, true),
            }
        }
    }
}

/// A SQLite file: there, or creatable in its directory (a file made and removed there).
fn sqlite_file(path: &std::path::Path) -> Result<String, String> {
    if let Ok(meta) = std::fs::metadata(path) {
        if !meta.is_file() {
            return Err("is not a file".to_owned());
        }
        let writable = std::fs::OpenOptions::new().append(true).open(path);
        return match writable {
            Ok(_) => Ok(format!(
                "the file is there ({} bytes), writable",
                meta.len()
            )),
            Err(err) => Err(format!("the file is there but not writable: {err}")),
        };
    }
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let probe = dir.join(format!(".hooklatch-check-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(format!(
                "no file yet: serve creates it in {}",
                dir.display()
            ))
        }
        Err(err) => Err(format!(
            "no file yet, and none can be made in {}: {err}",
            dir.display()
        )),
    }
}

async fn destination(d: &crate::config::Destination) -> Contact {
    let (at, outcome) = match &d.kind {
        DestinationKind::Http {
            url, allow, tls, ..
        } => {
            let outcome = match crate::outbound::client(allow.clone(), tls) {
                Err(err) => Err(err.to_string()),
                // HEAD: an answer of any status says the address, the TLS and the allow list
                // work; nothing is delivered.
                Ok(client) => match client.head(url.clone()).timeout(TIMEOUT).send().await {
                    // Nothing at that path, most likely: a delivery would get the same.
                    Ok(res) if res.status() == reqwest::StatusCode::NOT_FOUND => {
                        Err("answers, but HTTP 404 to HEAD: is the path right?".to_owned())
                    }
                    Ok(res) => Ok(format!("answers (HTTP {} to HEAD)", res.status().as_u16())),
                    Err(err) => {
                        let said = crate::delivery::describe(&err, TIMEOUT);
                        Err(
                            if url.scheme() == "https" && said.contains("InvalidContentType") {
                                format!("{said} (is it a TLS server? the url says https)")
                            } else {
                                said
                            },
                        )
                    }
                },
            };
            (format!("http {}", crate::loggable(url)), outcome)
        }
        DestinationKind::Amqp(a) => {
            let publisher = hooklatch_queue_rabbitmq::Publisher::new(crate::publisher_config(d, a));
            let outcome = match tokio::time::timeout(TIMEOUT, publisher.connect_now()).await {
                Ok(Ok(())) => Ok("connected".to_owned()),
                Ok(Err(err)) => Err(err.to_string()),
                Err(_) => Err(format!("no connection within {} s", TIMEOUT.as_secs())),
            };
            publisher.disconnect().await;
            (format!("amqp {}", a.redacted_url()), outcome)
        }
        DestinationKind::Listen { .. } => (
            "listen".to_owned(),
            Ok("nothing to contact: hooklatch listen connects to the gateway".to_owned()),
        ),
    };
    Contact::new(&d.name, at, outcome, false)
}
