//! What hooklatch reads back or parses from text: the stored header blob (any bytes decode
//! without panicking; encoded headers decode to themselves), source names and event keys (a
//! parsed name prints as given; the idempotency key joins them), and the outbound allow list
//! (any entry parses or is refused, and a parsed network admits its own address).

#![no_main]

use std::net::IpAddr;

use arbitrary::Arbitrary;
use hooklatch_core::headers;
use hooklatch_core::netguard::AddressPolicy;
use hooklatch_core::{EventKey, IdempotencyKey, SourceName};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    blob: &'a [u8],
    headers: Vec<(String, Vec<u8>)>,
    source: &'a str,
    key: &'a str,
    allow_entry: &'a str,
    address: IpAddr,
}

fuzz_target!(|input: Input<'_>| {
    let _ = headers::decode(input.blob);
    let encoded = headers::encode(&input.headers);
    assert_eq!(
        headers::decode(&encoded),
        input.headers,
        "a header blob round trip"
    );

    let source = SourceName::parse(input.source);
    let key = EventKey::parse(input.key);
    if let Ok(source) = &source {
        assert_eq!(source.as_str(), input.source);
    }
    if let Ok(key) = &key {
        assert_eq!(key.as_str(), input.key);
    }
    if let (Ok(source), Ok(key)) = (&source, &key) {
        let joined = IdempotencyKey::new(source, key);
        assert_eq!(joined.as_str(), format!("{}:{}", input.source, input.key));
    }

    let default = AddressPolicy::default();
    let _ = default.check(input.address);
    if let Ok(net) = AddressPolicy::parse_entry(input.allow_entry) {
        let policy = AddressPolicy::new(vec![net]);
        let _ = policy.check(input.address);
        assert!(
            policy.check(net.addr()).is_ok(),
            "{net}: an allowed network admits its own address"
        );
    }
});
