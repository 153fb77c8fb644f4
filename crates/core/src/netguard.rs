//! Where deliveries may go. An HTTP destination reaches public internet addresses; loopback,
//! private, link-local (the cloud metadata endpoint, `169.254.169.254`), carrier-grade NAT,
//! unique-local, multicast and reserved addresses only when its `allow` list holds them. So
//! a destination whose name resolves somewhere it should not (a DNS record changed, a typo, a
//! rebinding attack) reaches nothing inside the network the gateway runs in.
//!
//! An IPv6 address that carries an IPv4 one (IPv4-mapped `::ffff:a.b.c.d`, IPv4-compatible
//! `::a.b.c.d`, NAT64 `64:ff9b::/96`, 6to4 `2002::/16`) is judged by the IPv4 address it
//! carries, since that is where the packets end up. The check is on addresses, not names: the
//! gateway checks each address its resolver returns and dials only those (`hooklatch`'s
//! delivery client), so the address checked is the address dialled.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

pub use ipnet::IpNet;

/// The special range `ip` is in, named, or `None` for a public address.
pub fn special_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => v4_range(v4),
        IpAddr::V6(v6) => match embedded_v4(v6) {
            Some(v4) => v4_range(v4),
            None => v6_range(v6),
        },
    }
}

fn v4_range(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        (0, _, _) => "\"this network\" (0.0.0.0/8)",
        (10, _, _) => "private (10.0.0.0/8)",
        (100, 64..=127, _) => "carrier-grade NAT (100.64.0.0/10)",
        (127, _, _) => "loopback (127.0.0.0/8)",
        (169, 254, _) => "link-local, where cloud metadata answers (169.254.0.0/16)",
        (172, 16..=31, _) => "private (172.16.0.0/12)",
        (192, 0, 0) => "IETF protocol assignments (192.0.0.0/24)",
        (192, 168, _) => "private (192.168.0.0/16)",
        (198, 18..=19, _) => "benchmarking (198.18.0.0/15)",
        (224..=239, _, _) => "multicast (224.0.0.0/4)",
        (240..=255, _, _) => "reserved (240.0.0.0/4)",
        _ => return None,
    })
}

fn v6_range(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    Some(if ip.is_unspecified() {
        "unspecified (::)"
    } else if ip.is_loopback() {
        "loopback (::1)"
    } else if s[0] & 0xfe00 == 0xfc00 {
        "unique local (fc00::/7)"
    } else if s[0] & 0xffc0 == 0xfe80 {
        "link-local (fe80::/10)"
    } else if s[0] & 0xffc0 == 0xfec0 {
        "site-local (fec0::/10)"
    } else if s[0] & 0xff00 == 0xff00 {
        "multicast (ff00::/8)"
    } else if s[..4] == [0x100, 0, 0, 0] {
        "discard (100::/64)"
    } else {
        return None;
    })
}

/// The IPv4 address an IPv6 address carries, if it is of a form that carries one.
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let last =
        |hi: u16, lo: u16| Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8);
    match s {
        // IPv4-mapped and IPv4-compatible (not :: and ::1, which are IPv6's own).
        [0, 0, 0, 0, 0, 0xffff, hi, lo] => Some(last(hi, lo)),
        [0, 0, 0, 0, 0, 0, hi, lo] if (hi, lo) != (0, 0) && (hi, lo) != (0, 1) => {
            Some(last(hi, lo))
        }
        // NAT64's well-known prefix.
        [0x64, 0xff9b, 0, 0, 0, 0, hi, lo] => Some(last(hi, lo)),
        // 6to4: the IPv4 address follows the prefix.
        [0x2002, hi, lo, ..] => Some(last(hi, lo)),
        _ => None,
    }
}

/// A destination's `allow` list: the special addresses it may reach.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    allow: Vec<IpNet>,
}

/// An address a delivery may not reach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    /// The address.
    pub ip: IpAddr,
    /// Its range, named.
    pub range: &'static str,
}

impl fmt::Display for Blocked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is {} and not in the destination's allow list",
            self.ip, self.range
        )
    }
}

impl std::error::Error for Blocked {}

impl AddressPolicy {
    /// A policy allowing `allow` (networks like `127.0.0.0/8`, or single addresses).
    pub fn new(allow: Vec<IpNet>) -> AddressPolicy {
        AddressPolicy { allow }
    }

    /// Parses one `allow` entry: a network (`10.0.0.0/8`, `fd00::/8`) or an address.
    pub fn parse_entry(entry: &str) -> Result<IpNet, String> {
        let entry = entry.trim();
        IpNet::from_str(entry)
            .map(|net| net.trunc())
            .or_else(|_| IpAddr::from_str(entry).map(IpNet::from))
            .map_err(|_| format!("{entry:?} is not a network (10.0.0.0/8) or an address"))
    }

    /// The networks allowed.
    pub fn allowed(&self) -> &[IpNet] {
        &self.allow
    }

    /// `Ok` when a delivery may reach `ip`: a public address, or one the allow list holds (as
    /// written, or as the IPv4 address it carries).
    pub fn check(&self, ip: IpAddr) -> Result<(), Blocked> {
        let Some(range) = special_range(ip) else {
            return Ok(());
        };
        let carried = match ip {
            IpAddr::V6(v6) => embedded_v4(v6).map(IpAddr::V4),
            IpAddr::V4(_) => None,
        };
        let allowed = |addr: IpAddr| self.allow.iter().any(|net| net.contains(&addr));
        if allowed(ip) || carried.is_some_and(allowed) {
            Ok(())
        } else {
            Err(Blocked { ip, range })
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// The ranges svix's filter blocks, and the tricks that reach them.
    #[test]
    fn every_special_address_is_blocked_by_default() {
        let policy = AddressPolicy::default();
        for addr in [
            "127.0.0.1",
            "127.0.0.2",
            "::1",
            "::ffff:127.0.0.1",
            "::127.0.0.1",
            "169.254.169.254",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "100.64.0.1",
            "0.0.0.0",
            "::",
            "fe80::1",
            "fd00::1",
            "fc00::1",
            "64:ff9b::c0a8:1",
            "2002:c0a8:1::",
            "2002:7f00:1::1",
            "224.0.0.1",
            "255.255.255.255",
            "198.18.0.1",
            "ff02::1",
        ] {
            let err = policy.check(ip(addr)).unwrap_err();
            assert_eq!(err.ip, ip(addr));
            assert!(err.to_string().contains("allow list"), "{err}");
        }
    }

    #[test]
    fn public_addresses_pass() {
        let policy = AddressPolicy::default();
        for addr in [
            "93.184.215.14",
            "8.8.8.8",
            "172.32.0.1",
            "100.128.0.1",
            "2606:4700::1111",
            "64:ff9b::808:808",
            "::ffff:8.8.8.8",
        ] {
            assert_eq!(policy.check(ip(addr)), Ok(()), "{addr}");
        }
    }

    #[test]
    fn an_allow_list_admits_exactly_its_networks() {
        let allow = ["127.0.0.1", "10.20.0.0/16", "fd00::/8"]
            .iter()
            .map(|e| AddressPolicy::parse_entry(e).unwrap())
            .collect();
        let policy = AddressPolicy::new(allow);
        for ok in ["127.0.0.1", "::ffff:127.0.0.1", "10.20.3.4", "fd12::1"] {
            assert_eq!(policy.check(ip(ok)), Ok(()), "{ok}");
        }
        for blocked in [
            "127.0.0.2",
            "10.21.0.1",
            "169.254.169.254",
            "::1",
            "fe80::1",
        ] {
            assert!(policy.check(ip(blocked)).is_err(), "{blocked}");
        }
    }

    #[test]
    fn allow_entries_are_parsed_or_refused_with_the_entry() {
        assert_eq!(
            AddressPolicy::parse_entry("10.1.2.3/8")
                .unwrap()
                .to_string(),
            "10.0.0.0/8"
        );
        assert_eq!(
            AddressPolicy::parse_entry(" ::1 ").unwrap().to_string(),
            "::1/128"
        );
        let err = AddressPolicy::parse_entry("localhost").unwrap_err();
        assert!(err.contains("\"localhost\""), "{err}");
    }

    /// Every IPv6 form that carries `v4`: mapped, NAT64 and 6to4 always, IPv4-compatible
    /// unless it reads as `::` or `::1`.
    fn carriers(v4: Ipv4Addr) -> Vec<Ipv6Addr> {
        let [a, b, c, d] = v4.octets();
        let (hi, lo) = (u16::from_be_bytes([a, b]), u16::from_be_bytes([c, d]));
        let mut forms = vec![
            v4.to_ipv6_mapped(),
            Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, hi, lo),
            Ipv6Addr::new(0x2002, hi, lo, 0, 0, 0, 0, 1),
        ];
        if u32::from(v4) > 1 {
            forms.push(Ipv6Addr::new(0, 0, 0, 0, 0, 0, hi, lo));
        }
        forms
    }

    /// Networks for an allow list: IPv4 and IPv6, any prefix length.
    fn any_net() -> impl Strategy<Value = IpNet> {
        prop_oneof![
            (any::<u32>(), 0u8..=32)
                .prop_map(|(a, len)| IpNet::new(IpAddr::V4(a.into()), len).unwrap().trunc()),
            (any::<u128>(), 0u8..=128)
                .prop_map(|(a, len)| IpNet::new(IpAddr::V6(a.into()), len).unwrap().trunc()),
        ]
    }

    proptest! {
        /// The check on an address that carries an IPv4 one is the check on that IPv4
        /// address, whatever the allow list (when it lists no IPv6 network holding the carrier
        /// itself).
        #[test]
        fn an_ipv4_address_is_judged_alike_in_every_form_that_carries_it(
            v4 in any::<u32>().prop_map(Ipv4Addr::from),
            allow in proptest::collection::vec(any_net(), 0..4),
        ) {
            let v4_only: Vec<IpNet> = allow.into_iter().filter(|n| matches!(n, IpNet::V4(_))).collect();
            let policy = AddressPolicy::new(v4_only);
            let verdict = policy.check(IpAddr::V4(v4)).is_ok();
            for v6 in carriers(v4) {
                prop_assert_eq!(special_range(IpAddr::V6(v6)), special_range(IpAddr::V4(v4)), "{}", v6);
                prop_assert_eq!(policy.check(IpAddr::V6(v6)).is_ok(), verdict, "{} for {}", v6, v4);
            }
        }

        /// A delivery reaches an address exactly when it is public or the allow list holds it
        /// (or the IPv4 address it carries); a refusal names the address and its range.
        #[test]
        fn an_address_passes_only_when_public_or_allowed(
            addr in prop_oneof![
                any::<u32>().prop_map(|a| IpAddr::V4(a.into())),
                any::<u128>().prop_map(|a| IpAddr::V6(a.into())),
            ],
            allow in proptest::collection::vec(any_net(), 0..4),
        ) {
            let policy = AddressPolicy::new(allow.clone());
            let holds = |ip: IpAddr| allow.iter().any(|n| n.contains(&ip));
            let carried = match addr {
                IpAddr::V6(v6) => embedded_v4(v6).map(IpAddr::V4),
                IpAddr::V4(_) => None,
            };
            let expected = special_range(addr).is_none() || holds(addr) || carried.is_some_and(holds);
            match policy.check(addr) {
                Ok(()) => prop_assert!(expected, "{} passed", addr),
                Err(blocked) => {
                    prop_assert!(!expected, "{} blocked", addr);
                    prop_assert_eq!(blocked.ip, addr);
                    prop_assert_eq!(Some(blocked.range), special_range(addr));
                    prop_assert!(blocked.to_string().starts_with(&addr.to_string()));
                }
            }
        }

        /// Any `allow` entry is parsed or refused with the entry quoted, never a panic; what
        /// is parsed reads back as itself.
        #[test]
        fn any_allow_entry_is_parsed_or_refused_never_a_panic(entry in "\\PC{0,40}") {
            match AddressPolicy::parse_entry(&entry) {
                Ok(net) => {
                    let again = AddressPolicy::parse_entry(&net.to_string());
                    prop_assert_eq!(again, Ok(net));
                }
                Err(err) => prop_assert!(err.contains(&format!("{:?}", entry.trim())), "{}", err),
            }
        }
    }
}
