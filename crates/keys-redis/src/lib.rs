//! Redis as hooklatch's idempotency key store (`[store] keys = "redis://…"`, or `rediss://`
//! for TLS: rustls, the Mozilla roots built in, or only the CA given in [`TlsFiles`], and a
//! client certificate for servers that ask for one).
//!
//! Each event key is one Redis string, `{prefix}{{source}}:{key}`; the `{source}` hash tag
//! keeps one request's keys in one slot. Its value is either
//!
//! - `i:{token}` — claimed and in flight, with a short lease (`PX`), while the gateway writes
//!   the request and its outbox rows to the store; or
//! - `d:{request}:{first_seen_ms}:{sha256 hex}` — done, kept for the source's retention (`PX`),
//!   so a later copy is a duplicate (same body) or a conflict (another body) of that request.
//!
//! Claiming, completing and releasing are Lua scripts, so each is atomic on the server: a
//! request claims all its keys or none, and a claim is completed or released only by the
//! token that made it (a lease that ran out and was claimed again is never overwritten).
//!
//! What this mode does not promise, next to the SQL mode, is spelled out in the README
//! ("Redis key store"): keys live only as long as Redis keeps them (eviction, a restart without
//! persistence, a failover that loses writes all forget keys), and a gateway that dies between
//! the store's commit and marking its keys done lets a copy arriving after the lease be
//! queued again. The application's own guard stays the last line.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hooklatch_core::keys::{DoneKey, KeyClaim, KeyState, KeyStore, KeyStoreError};
use hooklatch_core::tls::TlsFiles;
use hooklatch_core::{EventKey, RequestId, SourceName, Timestamp};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::Script;

/// How long one Redis call may take before the gateway answers 503.
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

const CLAIM: &str = r"
for _, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if value and string.sub(value, 1, 2) == 'i:' then
    return {'inflight', tostring(redis.call('PTTL', key))}
  end
end
local out = {'decided'}
for _, key in ipairs(KEYS) do
  local value = redis.call('GET', key)
  if value then
    out[#out + 1] = value
  else
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
    out[#out + 1] = ''
  end
end
return out
";

const COMPLETE: &str = r"
local kept = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('SET', key, ARGV[2], 'PX', ARGV[3])
    kept = kept + 1
  end
end
return kept
";

const RELEASE: &str = r"
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
  end
end
return 0
";

/// The Redis key store.
#[derive(Clone)]
pub struct RedisKeys {
    conn: ConnectionManager,
    prefix: String,
    scripts: &'static Scripts,
}

struct Scripts {
    claim: Script,
    complete: Script,
    release: Script,
}

fn scripts() -> &'static Scripts {
    static SCRIPTS: std::sync::OnceLock<Scripts> = std::sync::OnceLock::new();
    SCRIPTS.get_or_init(|| Scripts {
        claim: Script::new(CLAIM),
        complete: Script::new(COMPLETE),
        release: Script::new(RELEASE),
    })
}

/// A short description of a Redis URL for messages: scheme, host and port, never a password.
pub fn describe_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        // No scheme: what was written, up to anything that could hold a password.
        let host = url.rsplit_once('@').map_or(url, |(_, host)| host);
        return host.split(['/', '?']).next().unwrap_or_default().to_owned();
    };
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let mut parts = host.split('?').next().unwrap_or_default().splitn(2, '/');
    let host = parts.next().unwrap_or_default();
    // The database number says which of the server's databases holds the keys.
    match parts
        .next()
        .filter(|db| !db.is_empty() && db.bytes().all(|b| b.is_ascii_digit()))
    {
        Some(db) => format!("{scheme}://{host}/{db}"),
        None => format!("{scheme}://{host}"),
    }
}

/// Checks the path of a `redis://` URL: nothing, or the number of the server's database that
/// holds the keys (`/5`). The client would refuse anything else only as "invalid client
/// config".
pub fn check_database(url: &str) -> Result<(), String> {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.split(['?', '#']).next().unwrap_or_default();
    let host_end = rest.rfind('@').map_or(0, |at| at + 1);
    match rest[host_end..].split_once('/') {
        Some((_, db)) if !db.is_empty() && !db.bytes().all(|b| b.is_ascii_digit()) => Err(
            "the URL's path is the database's number (redis://host:6379/5), and this one is not a number"
                .to_owned(),
        ),
        _ => Ok(()),
    }
}

impl RedisKeys {
    /// Connects to `url` (`redis://[user:password@]host:port[/db]`, or `rediss://` for TLS
    /// trusting the built-in roots), keys under `prefix`. Reconnects by itself afterwards;
    /// calls made while Redis is away fail (the gateway answers 503) rather than wait.
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisKeys, KeyStoreError> {
        RedisKeys::connect_with_tls(url, prefix, &TlsFiles::default()).await
    }

    /// [`RedisKeys::connect`] with TLS files for a `rediss://` URL: with `tls.ca_pem`, the
    /// server's certificate must chain to one of those CAs (they replace the built-in roots,
    /// as the redis client does); with `tls.client`, that certificate is presented when the
    /// server asks. TLS files with a `redis://` URL are refused: it would send them nowhere
    /// and everything in plain text.
    pub async fn connect_with_tls(
        url: &str,
        prefix: &str,
        tls: &TlsFiles,
    ) -> Result<RedisKeys, KeyStoreError> {
        let shown = describe_url(url);
        let secure = url.starts_with("rediss://");
        if !secure && !url.starts_with("redis://") {
            return Err(KeyStoreError(format!(
                "{shown}: expected a redis:// or rediss:// URL"
            )));
        }
        if !secure && tls.is_set() {
            return Err(KeyStoreError(format!(
                "{shown}: TLS files are for rediss:// URLs; this one sends everything in plain text"
            )));
        }
        check_database(url).map_err(|why| KeyStoreError(format!("{shown}: {why}")))?;
        let invalid = |err: redis::RedisError| {
            KeyStoreError(format!("{shown}: invalid URL ({:?})", err.kind()))
        };
        let client = if secure && tls.is_set() {
            let certificates = redis::TlsCertificates {
                client_tls: tls.client.as_ref().map(|c| redis::ClientTlsConfig {
                    client_cert: c.cert_pem.clone().into_bytes(),
                    client_key: c.key_pem.expose().to_vec(),
                }),
                root_cert: tls.ca_pem.as_ref().map(|pem| pem.clone().into_bytes()),
            };
            // The files were checked when the configuration was loaded; the kind of error is
            // enough here, and the message could quote a line of the key.
            redis::Client::build_with_tls(url, certificates).map_err(|err| {
                KeyStoreError(format!(
                    "{shown}: the TLS files cannot be used ({:?})",
                    err.kind()
                ))
            })?
        } else {
            redis::Client::open(url).map_err(invalid)?
        };
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(RESPONSE_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
            .set_number_of_retries(2)
            .set_max_delay(Duration::from_secs(1));
        let conn = client
            .get_connection_manager_with_config(config)
            .await
            .map_err(|err| KeyStoreError(format!("{shown}: cannot connect: {err}")))?;
        Ok(RedisKeys {
            conn,
            prefix: prefix.to_owned(),
            scripts: scripts(),
        })
    }

    /// The Redis key of an event key.
    pub fn redis_key(&self, source: &SourceName, key: &EventKey) -> String {
        format!("{}{{{}}}:{}", self.prefix, source.as_str(), key.as_str())
    }

    /// Reads the server's eviction policy and persistence and returns a warning for each
    /// setting under which keys can be forgotten (empty when all is well).
    pub async fn check(&self) -> Vec<String> {
        let settings = async {
            Ok::<_, redis::RedisError>((
                self.config_get("maxmemory-policy").await?,
                self.config_get("appendonly").await?,
                self.config_get("save").await?,
            ))
        };
        match settings.await {
            Ok((policy, appendonly, save)) => warnings(&policy, &appendonly, &save),
            Err(_) => vec![
                "could not read the Redis server's settings (CONFIG GET refused): make sure \
                 maxmemory-policy is noeviction and persistence (appendonly or save) is on, or \
                 keys can be forgotten and duplicates queued"
                    .to_owned(),
            ],
        }
    }

    async fn config_get(&self, name: &str) -> redis::RedisResult<String> {
        let mut conn = self.conn.clone();
        let pair: Vec<String> = redis::cmd("CONFIG")
            .arg("GET")
            .arg(name)
            .query_async(&mut conn)
            .await?;
        Ok(pair.get(1).cloned().unwrap_or_default())
    }

    async fn redis<T: redis::FromRedisValue>(
        &self,
        invocation: redis::ScriptInvocation<'_>,
    ) -> Result<T, KeyStoreError> {
        let mut conn = self.conn.clone();
        invocation
            .invoke_async(&mut conn)
            .await
            .map_err(|err| KeyStoreError(format!("redis: {err}")))
    }
}

/// The warnings for a server's settings (see [`RedisKeys::check`]).
pub fn warnings(maxmemory_policy: &str, appendonly: &str, save: &str) -> Vec<String> {
    let mut out = Vec::new();
    if maxmemory_policy != "noeviction" {
        out.push(format!(
            "Redis maxmemory-policy is {maxmemory_policy:?}: under memory pressure Redis may evict \
             idempotency keys and a provider's retry would be queued again; set it to noeviction"
        ));
    }
    if appendonly != "yes" && save.trim().is_empty() {
        out.push(
            "Redis persistence is off (appendonly no, no save points): a Redis restart forgets \
             every idempotency key; turn on appendonly (appendfsync everysec or always)"
                .to_owned(),
        );
    }
    out
}

/// A token unique to one claim: random, plus a counter so two claims in one process never
/// share one even with a poor random source.
fn token() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{:016x}{n:x}", rand::random::<u64>())
}

fn done_value(done: &DoneKey) -> String {
    format!(
        "d:{}:{}:{}",
        done.first_request.0,
        done.first_seen.as_millis(),
        hex::encode(done.body_sha256)
    )
}

fn parse_done(value: &str) -> Option<DoneKey> {
    let mut parts = value.strip_prefix("d:")?.splitn(3, ':');
    let first_request = RequestId(parts.next()?.parse().ok()?);
    let first_seen = Timestamp(parts.next()?.parse().ok()?);
    let mut body_sha256 = [0u8; 32];
    hex::decode_to_slice(parts.next()?, &mut body_sha256).ok()?;
    Some(DoneKey {
        first_request,
        first_seen,
        body_sha256,
    })
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

#[async_trait::async_trait]
impl KeyStore for RedisKeys {
    async fn claim(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        lease: Duration,
    ) -> Result<KeyClaim, KeyStoreError> {
        let token = token();
        let mut invocation = self.scripts.claim.prepare_invoke();
        for key in keys {
            invocation.key(self.redis_key(source, key));
        }
        invocation.arg(format!("i:{token}")).arg(millis(lease));
        let reply: Vec<String> = self.redis(invocation).await?;
        match reply.first().map(String::as_str) {
            Some("inflight") => {
                let pttl: i64 = reply.get(1).and_then(|s| s.parse().ok()).unwrap_or(-1);
                let retry_after = if pttl > 0 {
                    Duration::from_millis(pttl as u64)
                } else {
                    lease
                };
                Ok(KeyClaim::InFlight { retry_after })
            }
            Some("decided") if reply.len() == keys.len() + 1 => {
                let mut states = Vec::with_capacity(keys.len());
                for (key, value) in keys.iter().zip(&reply[1..]) {
                    if value.is_empty() {
                        states.push(KeyState::Claimed);
                        continue;
                    }
                    let done = parse_done(value).ok_or_else(|| {
                        KeyStoreError(format!(
                            "the value at {} is not hooklatch's; is another program writing \
                             under this key_prefix?",
                            self.redis_key(source, key)
                        ))
                    })?;
                    states.push(KeyState::Done(done));
                }
                Ok(KeyClaim::Decided {
                    token,
                    keys: states,
                })
            }
            _ => Err(KeyStoreError(
                "unexpected reply from the claim script".to_owned(),
            )),
        }
    }

    async fn complete(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        token: &str,
        done: DoneKey,
        retention: Duration,
    ) -> Result<usize, KeyStoreError> {
        let mut invocation = self.scripts.complete.prepare_invoke();
        for key in keys {
            invocation.key(self.redis_key(source, key));
        }
        invocation
            .arg(format!("i:{token}"))
            .arg(done_value(&done))
            .arg(millis(retention));
        let kept: i64 = self.redis(invocation).await?;
        Ok(usize::try_from(kept).unwrap_or(0))
    }

    async fn release(
        &self,
        source: &SourceName,
        keys: &[EventKey],
        token: &str,
    ) -> Result<(), KeyStoreError> {
        let mut invocation = self.scripts.release.prepare_invoke();
        for key in keys {
            invocation.key(self.redis_key(source, key));
        }
        invocation.arg(format!("i:{token}"));
        let _: i64 = self.redis(invocation).await?;
        Ok(())
    }

    async fn ping(&self) -> Result<(), KeyStoreError> {
        let mut conn = self.conn.clone();
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .map_err(|err| KeyStoreError(format!("redis: {err}")))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_values_round_trip_and_foreign_values_do_not_parse() {
        let done = DoneKey {
            first_request: RequestId(42),
            first_seen: Timestamp(1_700_000_000_123),
            body_sha256: [7; 32],
        };
        assert_eq!(parse_done(&done_value(&done)), Some(done));
        for foreign in ["", "i:abc", "d:", "d:1:2", "d:x:2:00", "d:1:2:zz", "hello"] {
            assert_eq!(parse_done(foreign), None, "{foreign:?}");
        }
    }

    #[test]
    fn settings_that_forget_keys_are_warned_about() {
        assert!(warnings("noeviction", "yes", "").is_empty());
        assert!(warnings("noeviction", "no", "3600 1 300 100").is_empty());
        let evicting = warnings("allkeys-lru", "yes", "");
        assert_eq!(evicting.len(), 1);
        assert!(evicting[0].contains("allkeys-lru") && evicting[0].contains("noeviction"));
        let volatile = warnings("volatile-ttl", "no", "");
        assert_eq!(volatile.len(), 2, "{volatile:?}");
        assert!(volatile[1].contains("persistence is off"));
    }

    #[test]
    fn urls_are_described_without_their_password() {
        assert_eq!(
            describe_url("redis://user:s3cret@127.0.0.1:6379/2"),
            "redis://127.0.0.1:6379/2"
        );
        assert_eq!(describe_url("redis://:p@ss@host:1?x=1"), "redis://host:1");
        assert_eq!(describe_url("rediss://h:1/abc"), "rediss://h:1");
        assert_eq!(describe_url("nonsense"), "nonsense");
        assert_eq!(describe_url("u:pw@127.0.0.1:6379/5"), "127.0.0.1:6379");
    }

    #[test]
    fn the_path_is_a_database_number_or_nothing() {
        for good in [
            "redis://127.0.0.1:6379",
            "redis://127.0.0.1:6379/",
            "redis://127.0.0.1:6379/5",
            "rediss://u:p/w@h:1/12?protocol=resp3",
        ] {
            assert_eq!(check_database(good), Ok(()), "{good}");
        }
        for bad in ["redis://127.0.0.1:6379/abc", "redis://u:pw@h/0x"] {
            let err = check_database(bad).unwrap_err();
            assert!(err.contains("database's number"), "{err}");
        }
    }

    #[test]
    fn tokens_are_distinct() {
        let a = token();
        let b = token();
        assert_ne!(a, b);
    }
}
