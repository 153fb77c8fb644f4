//! The Redis key store against a real Redis (`HOOKLATCH_TEST_REDIS_URL`): all-or-nothing
//! claims, in-flight leases, token-checked completion and release, retention TTLs, and
//! concurrent claims of one key. Each test writes under a prefix of its own and deletes it.

use std::sync::Arc;
use std::time::Duration;

use hooklatch_core::keys::{DoneKey, KeyClaim, KeyState, KeyStore};
use hooklatch_core::tls::TlsFiles;
use hooklatch_core::{EventKey, RequestId, SourceName, Timestamp};
use hooklatch_keys_redis::RedisKeys;

struct Fixture {
    keys: RedisKeys,
    url: String,
    prefix: String,
}

impl Fixture {
    async fn open(name: &str) -> Option<Fixture> {
        let Ok(url) = std::env::var("HOOKLATCH_TEST_REDIS_URL") else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set but HOOKLATCH_TEST_REDIS_URL is not: the Redis tests must run"
            );
            println!("skipped: set HOOKLATCH_TEST_REDIS_URL to run the Redis key store tests");
            return None;
        };
        let prefix = format!(
            "hl_test_{name}_{}_{}:",
            std::process::id(),
            Timestamp::now().as_millis()
        );
        let keys = RedisKeys::connect(&url, &prefix)
            .await
            .expect("connecting to HOOKLATCH_TEST_REDIS_URL");
        Some(Fixture { keys, url, prefix })
    }

    async fn raw(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .expect("url")
            .get_multiplexed_async_connection()
            .await
            .expect("connect")
    }

    async fn pttl(&self, key: &str) -> i64 {
        redis::cmd("PTTL")
            .arg(key)
            .query_async(&mut self.raw().await)
            .await
            .expect("PTTL")
    }

    async fn clean_up(self) {
        let mut conn = self.raw().await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        if !keys.is_empty() {
            let _: i64 = redis::cmd("DEL")
                .arg(keys)
                .query_async(&mut conn)
                .await
                .expect("DEL");
        }
    }
}

fn source() -> SourceName {
    SourceName::parse("stripe").expect("a valid name")
}

fn keys(names: &[&str]) -> Vec<EventKey> {
    names
        .iter()
        .map(|n| EventKey::parse(n).expect("a valid key"))
        .collect()
}

fn done(request: i64) -> DoneKey {
    DoneKey {
        first_request: RequestId(request),
        first_seen: Timestamp(1_700_000_000_000 + request),
        body_sha256: [request as u8; 32],
    }
}

const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(3600);

#[tokio::test]
async fn a_request_claims_all_its_keys_or_none_and_completes_them_for_the_retention() {
    let Some(f) = Fixture::open("claim").await else {
        return;
    };
    let both = keys(&["evt_a", "evt_b"]);
    let KeyClaim::Decided {
        token,
        keys: states,
    } = f.keys.claim(&source(), &both, LEASE).await.expect("claim")
    else {
        panic!("fresh keys are claimed");
    };
    assert_eq!(states, [KeyState::Claimed, KeyState::Claimed]);
    let lease_ttl = f.pttl(&f.keys.redis_key(&source(), &both[0])).await;
    assert!(
        lease_ttl > 0 && lease_ttl <= 30_000,
        "lease TTL {lease_ttl}"
    );

    // While in flight, a request naming any of them claims nothing, not even its new keys.
    let overlapping = keys(&["evt_b", "evt_c"]);
    let claim = f
        .keys
        .claim(&source(), &overlapping, LEASE)
        .await
        .expect("claim");
    let KeyClaim::InFlight { retry_after } = claim else {
        panic!("evt_b is in flight: {claim:?}");
    };
    assert!(retry_after <= LEASE && retry_after > Duration::ZERO);
    let c_key = f.keys.redis_key(&source(), &overlapping[1]);
    assert_eq!(f.pttl(&c_key).await, -2, "evt_c was not claimed");

    // Only the token that claimed can complete.
    let kept = f
        .keys
        .complete(&source(), &both, "not-the-token", done(1), RETENTION)
        .await
        .expect("complete");
    assert_eq!(kept, 0);
    let kept = f
        .keys
        .complete(&source(), &both, &token, done(7), RETENTION)
        .await
        .expect("complete");
    assert_eq!(kept, 2);
    let ttl = f.pttl(&f.keys.redis_key(&source(), &both[0])).await;
    assert!(ttl > 30_000 && ttl <= 3_600_000, "retention TTL {ttl}");

    // Now a request naming evt_b and evt_c: evt_b is done (pointing at request 7), evt_c new.
    let KeyClaim::Decided { keys: states, .. } = f
        .keys
        .claim(&source(), &overlapping, LEASE)
        .await
        .expect("claim")
    else {
        panic!("nothing is in flight any more");
    };
    assert_eq!(states, [KeyState::Done(done(7)), KeyState::Claimed]);
    f.clean_up().await;
}

#[tokio::test]
async fn a_release_frees_only_its_own_claim_and_an_expired_lease_frees_itself() {
    let Some(f) = Fixture::open("release").await else {
        return;
    };
    let one = keys(&["evt_r"]);
    let KeyClaim::Decided { token, .. } =
        f.keys.claim(&source(), &one, LEASE).await.expect("claim")
    else {
        panic!("claimed");
    };
    f.keys
        .release(&source(), &one, "someone-else")
        .await
        .expect("release");
    assert!(matches!(
        f.keys.claim(&source(), &one, LEASE).await.expect("claim"),
        KeyClaim::InFlight { .. }
    ));
    f.keys
        .release(&source(), &one, &token)
        .await
        .expect("release");
    let KeyClaim::Decided { token: second, .. } = f
        .keys
        .claim(&source(), &one, Duration::from_millis(300))
        .await
        .expect("claim")
    else {
        panic!("released keys can be claimed again");
    };

    // A holder that never finishes: its lease runs out and the key is free again; its late
    // completion then finds the key taken by someone else and leaves it alone.
    let mut third = None;
    for _ in 0..100 {
        if let KeyClaim::Decided { token, .. } =
            f.keys.claim(&source(), &one, LEASE).await.expect("claim")
        {
            third = Some(token);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let third = third.expect("the 300 ms lease ran out within 5 s");
    let kept = f
        .keys
        .complete(&source(), &one, &second, done(2), RETENTION)
        .await
        .expect("complete");
    assert_eq!(kept, 0, "a lapsed claim does not overwrite the new holder");
    let kept = f
        .keys
        .complete(&source(), &one, &third, done(3), RETENTION)
        .await
        .expect("complete");
    assert_eq!(kept, 1);
    f.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claims_of_one_key_make_exactly_one_claim() {
    let Some(f) = Fixture::open("race").await else {
        return;
    };
    let store = Arc::new(f.keys.clone());
    for round in 0..50 {
        let key = keys(&[&format!("evt_race_{round}")]);
        let mut tasks = Vec::new();
        for _ in 0..32 {
            let (store, key) = (store.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                store.claim(&source(), &key, LEASE).await.expect("claim")
            }));
        }
        let mut claimed = 0;
        for task in tasks {
            match task.await.expect("task") {
                KeyClaim::Decided { keys, .. } => {
                    assert_eq!(keys, [KeyState::Claimed]);
                    claimed += 1;
                }
                KeyClaim::InFlight { .. } => {}
            }
        }
        assert_eq!(claimed, 1, "round {round}");
    }
    f.clean_up().await;
}

#[tokio::test]
async fn a_foreign_value_under_the_prefix_is_an_error_not_a_guess() {
    let Some(f) = Fixture::open("foreign").await else {
        return;
    };
    let one = keys(&["evt_f"]);
    let _: () = redis::cmd("SET")
        .arg(f.keys.redis_key(&source(), &one[0]))
        .arg("something else")
        .query_async(&mut f.raw().await)
        .await
        .expect("SET");
    let err = f
        .keys
        .claim(&source(), &one, LEASE)
        .await
        .expect_err("an unknown value is refused");
    assert!(err.to_string().contains("is not hooklatch's"), "{err}");
    f.keys.ping().await.expect("ping");
    f.clean_up().await;
}

#[tokio::test]
async fn other_schemes_and_tls_files_on_plain_text_are_refused_without_echoing_the_password() {
    let Err(err) = RedisKeys::connect("http://:pw-secret@127.0.0.1", "p:").await else {
        panic!("http:// must be refused");
    };
    assert!(
        err.to_string()
            .contains("expected a redis:// or rediss:// URL"),
        "{err}"
    );
    assert!(!err.to_string().contains("pw-secret"), "{err}");
    let ca = hooklatch_testkit::tls::TestCa::new("redis CA");
    let tls = TlsFiles {
        ca_pem: Some(ca.pem().to_owned()),
        client: None,
    };
    let Err(err) = RedisKeys::connect_with_tls("redis://:pw-secret@127.0.0.1", "p:", &tls).await
    else {
        panic!("TLS files with redis:// must be refused");
    };
    assert!(err.to_string().contains("plain text"), "{err}");
    assert!(!err.to_string().contains("pw-secret"), "{err}");
}

/// The Redis behind a TLS-terminating proxy (the testkit's, its certificate for `localhost`
/// from `ca`), and the test URL rewritten to reach it: `rediss://[userinfo@]localhost:<port>[/db]`.
async fn behind_tls(
    url: &str,
    ca: &hooklatch_testkit::tls::TestCa,
    clients: Option<&hooklatch_testkit::tls::TestCa>,
) -> (hooklatch_testkit::tls::TlsTerminator, String) {
    let rest = url.strip_prefix("redis://").expect("a redis:// test URL");
    let (userinfo, after) = match rest.rsplit_once('@') {
        Some((userinfo, after)) => (format!("{userinfo}@"), after),
        None => (String::new(), rest),
    };
    let (host_port, db) = after.split_at(after.find('/').unwrap_or(after.len()));
    let host_port = host_port.replace("localhost", "127.0.0.1");
    let upstream = if host_port.contains(':') {
        host_port
    } else {
        format!("{host_port}:6379")
    };
    let upstream = upstream
        .parse()
        .expect("the test Redis is named by an IP address");
    let tls =
        hooklatch_testkit::tls::TlsTerminator::start(upstream, &ca.server(&["localhost"]), clients)
            .await
            .expect("the TLS proxy listens");
    let port = tls.addr().port();
    (tls, format!("rediss://{userinfo}localhost:{port}{db}"))
}

/// `rediss://`: claims go through TLS to the real Redis (behind a TLS-terminating proxy whose
/// certificate comes from a private CA given as `ca_pem`) and are the same keys a plain
/// connection sees; without that CA the built-in roots do not trust the server and the
/// connection is refused before anything reaches Redis, with the reason.
#[tokio::test]
async fn rediss_claims_go_through_tls_to_a_server_the_given_ca_vouches_for() {
    use hooklatch_testkit::tls::TestCa;
    let Some(f) = Fixture::open("tls").await else {
        return;
    };
    let ca = TestCa::new("redis CA");
    let (tls, rediss) = behind_tls(&f.url, &ca, None).await;

    let files = TlsFiles {
        ca_pem: Some(ca.pem().to_owned()),
        client: None,
    };
    let secure = RedisKeys::connect_with_tls(&rediss, &f.prefix, &files)
        .await
        .expect("connecting over TLS");
    let one = keys(&["evt_tls"]);
    let KeyClaim::Decided { keys: states, .. } =
        secure.claim(&source(), &one, LEASE).await.expect("claim")
    else {
        panic!("a fresh key is claimed");
    };
    assert_eq!(states, [KeyState::Claimed]);
    let claim = f.keys.claim(&source(), &one, LEASE).await.expect("claim");
    assert!(
        matches!(claim, KeyClaim::InFlight { .. }),
        "the plain connection sees the claim made over TLS: {claim:?}"
    );
    assert!(tls.handshakes() >= 1 && tls.upstream_connections() >= 1);

    let upstream_before = tls.upstream_connections();
    let Err(err) = RedisKeys::connect(&rediss, &f.prefix).await else {
        panic!("the built-in roots do not know the private CA");
    };
    assert!(err.to_string().contains("cannot connect"), "{err}");
    assert!(err.to_string().contains("UnknownIssuer"), "{err}");
    assert!(tls.refused_at_least(1, Duration::from_secs(10)).await >= 1);
    assert_eq!(tls.upstream_connections(), upstream_before);
    f.clean_up().await;
}

/// Mutual TLS: a server that asks for a client certificate refuses a connection without one
/// and takes the one given (`client`), issued by the CA it trusts.
#[tokio::test]
async fn a_redis_asking_for_a_client_certificate_gets_the_given_one() {
    use hooklatch_core::tls::ClientIdentity;
    use hooklatch_testkit::tls::TestCa;
    let Some(f) = Fixture::open("mtls").await else {
        return;
    };
    let ca = TestCa::new("redis CA");
    let (tls, rediss) = behind_tls(&f.url, &ca, Some(&ca)).await;
    let mut files = TlsFiles {
        ca_pem: Some(ca.pem().to_owned()),
        client: None,
    };
    let anonymous = RedisKeys::connect_with_tls(&rediss, &f.prefix, &files).await;
    let refused = match anonymous {
        Err(err) => err.to_string(),
        // TLS 1.3: the client may finish its side of the handshake before the server's
        // refusal arrives; then the first call fails.
        Ok(keys) => keys
            .ping()
            .await
            .expect_err("no client certificate")
            .to_string(),
    };
    assert!(!refused.is_empty());
    assert_eq!(tls.upstream_connections(), 0);

    let client = ca.client("hooklatch");
    files.client = Some(ClientIdentity {
        cert_pem: client.cert_pem().to_owned(),
        key_pem: hooklatch_core::Secret::from_text(client.key_pem()),
    });
    let keys_tls = RedisKeys::connect_with_tls(&rediss, &f.prefix, &files)
        .await
        .expect("connecting with a client certificate");
    keys_tls.ping().await.expect("ping over mutual TLS");
    assert!(tls.upstream_connections() >= 1);
    f.clean_up().await;
}
