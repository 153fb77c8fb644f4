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
    pub outcome: Result<String, String>,
    /// Whether `serve` needs it to start.
    pub required: bool,
}

/// Contacts every service `settings` names: the store, the key store, each destination.
pub async fn contact(settings: &Settings) -> Vec<Contact> {
    let mut contacts = vec![store(settings).await];
    if let Some(keys) = &settings.store.keys {
        let outcome = match hooklatch_keys_redis::RedisKeys::connect_with_tls(
            &keys.url,
            &keys.prefix,
            &keys.tls,
        )
        .await
        {
            Ok(redis) => {
                let warnings = redis.check().await;
                Ok(if warnings.is_empty() {
                    "answers; its settings keep keys".to_owned()
                } else {
                    format!("answers, but {}", warnings.join("; "))
                })
            }
            Err(err) => Err(err.to_string()),
        };
        contacts.push(Contact {
            what: "keys".to_owned(),
            at: format!("redis {}", hooklatch_keys_redis::describe_url(&keys.url)),
            outcome,
            required: true,
        });
    }
    for d in &settings.destinations {
        contacts.push(destination(d).await);
    }
    contacts
}

async fn store(settings: &Settings) -> Contact {
    match &settings.store.backend {
        #[cfg(feature = "sqlite")]
        StoreBackend::Sqlite(opts) => Contact {
            what: "store".to_owned(),
            at: format!("sqlite {}", opts.path.display()),
            outcome: sqlite_file(&opts.path),
            required: true,
        },
        #[cfg(feature = "postgres")]
        StoreBackend::Postgres(opts) => {
            let outcome = match hooklatch_store_postgres::PostgresStore::probe(opts).await {
                Err(err) => Err(err.to_string()),
                Ok(probe)
                    if !probe.unsafe_durability.is_empty() && !opts.allow_unsafe_durability =>
                {
                    Err(format!(
                        "answers, but serve refuses its durability settings: {} \
                         (--allow-unsafe-durability for a throwaway database)",
                        probe.unsafe_durability.join(", ")
                    ))
                }
                Ok(probe) if probe.schema > probe.this_build => Err(format!(
                    "answers, but its schema is v{}, newer than this build's v{}: an older \
                     hooklatch would run on a newer gateway's tables",
                    probe.schema, probe.this_build
                )),
                Ok(probe) => Ok(format!(
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
                )),
            };
            Contact {
                what: "store".to_owned(),
                at: format!("postgres {}", opts.redacted_url()),
                outcome,
                required: true,
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
                    Ok(res) => Ok(format!("answers (HTTP {} to HEAD)", res.status().as_u16())),
                    Err(err) => Err(crate::delivery::describe(&err, TIMEOUT)),
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
    Contact {
        what: d.name.clone(),
        at,
        outcome,
        required: false,
    }
}
