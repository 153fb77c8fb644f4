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

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use hooklatch_core::netguard::{AddressPolicy, Blocked};
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::Url;

/// Resolves names with the system resolver and keeps only the addresses the policy passes.
struct GuardedResolver {
    policy: AddressPolicy,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let policy = self.policy.clone();
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
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

/// A delivery client for one destination: its policy, no redirects, no proxy.
pub(crate) fn client(policy: AddressPolicy) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .no_proxy()
        .user_agent(concat!("hooklatch/", env!("CARGO_PKG_VERSION")))
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(30))
        .dns_resolver(Arc::new(GuardedResolver { policy }))
        .build()
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
        ] {
            let url = Url::parse(url).unwrap();
            assert!(check_literal(&url, &policy).is_err(), "{url}");
        }
        let public = Url::parse("https://93.184.215.14/hook").unwrap();
        assert_eq!(check_literal(&public, &policy), Ok(()));
        let name = Url::parse("http://localhost:3000/").unwrap();
        assert_eq!(
            check_literal(&name, &policy),
            Ok(()),
            "names are checked when resolved"
        );
    }

    #[tokio::test]
    async fn a_name_that_resolves_only_to_blocked_addresses_is_refused() {
        let resolver = GuardedResolver {
            policy: AddressPolicy::default(),
        };
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

        let allowed = GuardedResolver {
            policy: AddressPolicy::new(vec![
                AddressPolicy::parse_entry("127.0.0.0/8").unwrap(),
                AddressPolicy::parse_entry("::1").unwrap(),
            ]),
        };
        let addrs: Vec<_> = allowed
            .resolve("localhost".parse().unwrap())
            .await
            .expect("localhost, allowed")
            .collect();
        assert!(!addrs.is_empty());
        assert!(addrs.iter().all(|a| a.ip().is_loopback()), "{addrs:?}");
    }
}
