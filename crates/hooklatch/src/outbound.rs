//! The HTTP clients deliveries go out on: one per HTTP destination, each holding its
//! destination's [`AddressPolicy`], so a delivery reaches a loopback, private, link-local or
//! other special address only when the destination's `allow` list holds it
//! ([`hooklatch_core::netguard`]).
//!
//! A name is resolved by [`GuardedResolver`], which hands the connector only the addresses the
//! policy passes: what is checked is what is dialled, and a name that resolves to a blocked
//! address now and a public one later (DNS rebinding) is checked each time. An address
//! written in the URL is not resolved; [`check_literal`] checks it before the request is
//! made (the URL parser has already turned `http://2130706433/` and `http://0177.0.0.1/` into
//! `127.0.0.1`). Redirects are never followed, and no proxy from the environment is used.
//!
//! TLS (`https://`) is rustls's, trusting the Mozilla roots built in and the destination's
//! `ca_file`, presenting its `client_cert` when the server asks ([`TlsFiles`]).

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hooklatch_core::netguard::{AddressPolicy, Blocked};
use hooklatch_core::tls::TlsFiles;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;

/// Looks a name up: the system resolver, or a test's.
type Lookup = Arc<
    dyn Fn(String) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<SocketAddr>>> + Send>>
        + Send
        + Sync,
>;

/// Resolves names with the system resolver and keeps only the addresses the policy passes.
struct GuardedResolver {
    policy: AddressPolicy,
    lookup: Lookup,
}

impl GuardedResolver {
    fn new(policy: AddressPolicy) -> GuardedResolver {
        GuardedResolver {
            policy,
            lookup: Arc::new(|host: String| {
                Box::pin(
                    async move { Ok(tokio::net::lookup_host((host.as_str(), 0)).await?.collect()) },
                )
            }),
        }
    }
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        let host = name.as_str().to_owned();
        let lookup = (self.lookup)(host.clone());
        Box::pin(async move {
            let resolved: Vec<SocketAddr> = lookup.await?;
            let mut blocked = None;
            let passed: Vec<SocketAddr> = resolved
                .into_iter()
                .filter(|addr| match policy.check(addr.ip()) {
                    Ok(()) => true,
                    Err(why) => {
                        blocked.get_or_insert(why);
                        false
                    }
                })
                .collect();
            if passed.is_empty() {
                let why = match blocked {
                    Some(why) => format!("{host} resolves only to blocked addresses: {why}"),
                    None => format!("{host} resolves to no address"),
                };
                return Err(why.into());
            }
            Ok(Box::new(passed.into_iter()) as Addrs)
        })
    }
}

/// A delivery client for one destination: its policy and TLS files, no redirects, no proxy.
pub(crate) fn client(policy: AddressPolicy, tls: &TlsFiles) -> reqwest::Result<reqwest::Client> {
    client_with(GuardedResolver::new(policy), tls)
}

fn client_with(resolver: GuardedResolver, tls: &TlsFiles) -> reqwest::Result<reqwest::Client> {
    let mut builder = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .user_agent(concat!("hooklatch/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(30))
        .dns_resolver(Arc::new(resolver));
    if let Some(pem) = &tls.ca_pem {
        for cert in reqwest::Certificate::from_pem_bundle(pem.as_bytes())? {
            builder = builder.add_root_certificate(cert);
        }
    }
    if let Some(client) = &tls.client {
        // reqwest reads the certificates and one key from one PEM text, and refuses any other
        // section (`EC PARAMETERS`, which OpenSSL writes before an EC key): give it the key's
        // own block only.
        let key = client
            .key_pem
            .expose_text()
            .and_then(private_key_block)
            .unwrap_or_default();
        let identity = format!("{}\n{key}\n", client.cert_pem.trim_end());
        builder = builder.identity(reqwest::Identity::from_pem(identity.as_bytes())?);
    }
    builder.build()
}

/// The first `-----BEGIN … PRIVATE KEY-----` … `-----END … PRIVATE KEY-----` block of `pem`.
fn private_key_block(pem: &str) -> Option<&str> {
    let mut offset = 0;
    for line in pem.split_inclusive('\n') {
        let text = line.trim_end();
        if text.starts_with("-----BEGIN ") && text.ends_with("PRIVATE KEY-----") {
            let end_marker = text.replacen("BEGIN", "END", 1);
            let end = offset + pem[offset..].find(&end_marker)? + end_marker.len();
            return Some(&pem[offset..end]);
        }
        offset += line.len();
    }
    None
}

/// Checks an address written in `url` (no resolver sees it); a name passes here and is
/// checked when it is resolved.
pub fn check_literal(url: &Url, policy: &AddressPolicy) -> Result<(), Blocked> {
    match url.host() {
        Some(url::Host::Ipv4(v4)) => policy.check(IpAddr::V4(v4)),
        Some(url::Host::Ipv6(v6)) => policy.check(IpAddr::V6(v6)),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_block_is_taken_alone_from_what_openssl_writes_around_it() {
        let openssl_ec =
            "-----BEGIN EC PARAMETERS-----\nBggqhkjOPQMBBw==\n-----END EC PARAMETERS-----\n\
             -----BEGIN EC PRIVATE KEY-----\nMHcCAQEE\n-----END EC PRIVATE KEY-----\n";
        assert_eq!(
            private_key_block(openssl_ec),
            Some("-----BEGIN EC PRIVATE KEY-----\nMHcCAQEE\n-----END EC PRIVATE KEY-----")
        );
        let pkcs8 = "-----BEGIN PRIVATE KEY-----\r\nMIGH\r\n-----END PRIVATE KEY-----";
        assert_eq!(private_key_block(pkcs8), Some(pkcs8));
        assert_eq!(
            private_key_block("-----BEGIN PRIVATE KEY-----\nMIGH\n"),
            None
        );
        assert_eq!(private_key_block("no key here"), None);
    }

    #[test]
    fn other_ways_to_write_loopback_are_loopback_to_the_check() {
        let policy = AddressPolicy::default();
        for url in [
            "http://2130706433/",
            "http://0177.0.0.1/",
            "http://127.1/",
            "http://0x7f000001/",
            "http://[::ffff:127.0.0.1]/",
            "http://[::1]:8080/",
            "http://169.254.169.254/latest/meta-data/",
            // What comes before `@` is credentials, not the host.
            "http://93.184.215.14@127.0.0.1/",
            "http://user:pass@127.0.0.1:8080/",
            "http://127.0.0.1:80@169.254.169.254/",
            "http://example.com@[::1]/",
            "http://93.184.215.14:443@10.0.0.1/",
        ] {
            let url = Url::parse(url).unwrap();
            assert!(check_literal(&url, &policy).is_err(), "{url}");
        }
        for public in [
            "https://93.184.215.14/hook",
            "http://127.0.0.1@93.184.215.14/",
            "http://localhost:80@93.184.215.14/",
        ] {
            let url = Url::parse(public).unwrap();
            assert_eq!(check_literal(&url, &policy), Ok(()), "{public}");
        }
        let name = Url::parse("http://localhost:3000/").unwrap();
        assert_eq!(
            check_literal(&name, &policy),
            Ok(()),
            "names are checked when resolved"
        );
    }

    #[tokio::test]
    async fn a_name_that_resolves_only_to_blocked_addresses_is_refused() {
        let resolver = GuardedResolver::new(AddressPolicy::default());
        let name: Name = "localhost".parse().unwrap();
        let err = match resolver.resolve(name).await {
            Ok(addrs) => panic!("resolved to {:?}", addrs.collect::<Vec<_>>()),
            Err(err) => err.to_string(),
        };
        assert!(
            err.starts_with("localhost resolves only to blocked addresses: "),
            "{err}"
        );
        assert!(err.contains("loopback"), "{err}");

        let allowed = GuardedResolver::new(AddressPolicy::new(vec![
            AddressPolicy::parse_entry("127.0.0.0/8").unwrap(),
            AddressPolicy::parse_entry("::1").unwrap(),
        ]));
        let addrs: Vec<_> = allowed
            .resolve("localhost".parse().unwrap())
            .await
            .expect("localhost, allowed")
            .collect();
        assert!(!addrs.is_empty());
        assert!(addrs.iter().all(|a| a.ip().is_loopback()), "{addrs:?}");
    }

    /// A listener on `ip:port` (0: any port) counting the TCP connections it accepts and
    /// answering each with a 200; its port and the count. `None` when the port is taken.
    async fn counting_listener(
        ip: &str,
        port: u16,
    ) -> Option<(u16, Arc<std::sync::atomic::AtomicUsize>)> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind((ip, port)).await.ok()?;
        let port = listener.local_addr().unwrap().port();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = [0u8; 4096];
                    let _ = conn.read(&mut buf).await;
                    let answer =
                        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
                    let _ = conn.write_all(answer.as_bytes()).await;
                });
            }
        });
        Some((port, accepted))
    }

    /// DNS rebinding: a name whose answers change between lookups — the blocked address alone,
    /// the allowed one alone, both — is checked at every lookup, and the blocked address is
    /// never dialled (a listener on it counts TCP connections, not HTTP requests).
    #[tokio::test]
    async fn a_name_whose_answers_change_never_has_its_blocked_address_dialled() {
        // One port for both: the canary on 127.0.0.1, the destination on 127.0.0.2.
        let (port, canary, allowed) = loop {
            let (port, canary) = counting_listener("127.0.0.1", 0).await.unwrap();
            if let Some((_, allowed)) = counting_listener("127.0.0.2", port).await {
                break (port, canary, allowed);
            }
        };
        let canary_addr = SocketAddr::from(([127, 0, 0, 1], 0));
        let allowed_addr = SocketAddr::from(([127, 0, 0, 2], 0));
        let lookups = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = lookups.clone();
        let resolver = GuardedResolver {
            policy: AddressPolicy::new(vec![AddressPolicy::parse_entry("127.0.0.2").unwrap()]),
            lookup: Arc::new(move |_host: String| {
                let n = counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let answer = match n % 3 {
                    0 => vec![canary_addr],
                    1 => vec![allowed_addr],
                    _ => vec![canary_addr, allowed_addr],
                };
                Box::pin(async move { Ok(answer) })
            }),
        };
        let client = client_with(resolver, &TlsFiles::default()).unwrap();
        let (mut sent, mut refused) = (0, 0);
        for _ in 0..30 {
            // A fresh connection each time (the answer says `close`), so a fresh lookup.
            match client
                .post(format!("http://rebinding.test:{port}/hook"))
                .send()
                .await
            {
                Ok(res) => {
                    assert_eq!(res.status(), 200);
                    sent += 1;
                }
                Err(err) => {
                    let chain = format!("{err:?}");
                    assert!(
                        chain.contains("resolves only to blocked addresses"),
                        "{chain}"
                    );
                    refused += 1;
                }
            }
        }
        let dialled = canary.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(dialled, 0, "TCP connections to the blocked address");
        assert_eq!((sent, refused), (20, 10));
        assert_eq!(allowed.load(std::sync::atomic::Ordering::SeqCst), 20);
        assert_eq!(lookups.load(std::sync::atomic::Ordering::SeqCst), 30);
    }
}
