//! Every provider adapter, fed what a stranger could send to `POST /in/{source}` (and `GET`):
//! any headers, path, query and body. Nothing may panic, and a request signed the way the
//! provider signs must verify, whatever its body.

#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use hooklatch_core::{InboundRequest, Timestamp};
use hooklatch_fuzz::{adapters, headers, secrets, sendable, signed, Name};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    provider: u8,
    headers: Vec<(Name<'a>, &'a [u8])>,
    path_and_query: &'a str,
    body: &'a [u8],
    now: u32,
    /// Whether to also sign the body as the provider does and check that it verifies.
    sign: bool,
    event_key: &'a str,
}

fuzz_target!(|input: Input<'_>| {
    let adapters = adapters();
    let fuzzed = &adapters[usize::from(input.provider) % adapters.len()];
    let adapter = &*fuzzed.adapter;
    let headers = headers(adapter, &input.headers);
    let secrets = secrets();
    let now = Timestamp::from_secs(1_700_000_000 + i64::from(input.now));
    let tolerance = Duration::from_secs(300);
    let req = InboundRequest {
        path_and_query: input.path_and_query,
        headers: &headers,
        body: input.body,
        now,
    };
    let _ = adapter.handshake(&req);
    let _ = adapter.unsigned_probe(&req);
    let _ = adapter.verify(&req, &secrets, tolerance);
    let _ = adapter.extract(&req);
    let query = input.path_and_query.split_once('?').map_or("", |(_, q)| q);
    let _ = adapter.handle_get(query);
    let _ = adapter.get_carries_events();
    let _ = adapter.default_retention();

    if input.sign {
        // The URL `send` is given: the gateway's own; Twilio's adapter puts its public URL in front.
        let url = "http://127.0.0.1:8080/in/fuzz";
        let headers = signed(adapter, input.body, input.event_key, now, url);
        let req = InboundRequest {
            path_and_query: "/in/fuzz",
            headers: &headers,
            body: input.body,
            now,
        };
        let verified = adapter.verify(&req, &secrets, tolerance);
        if sendable(&headers) && fuzzed.round_trips {
            assert!(
                verified.is_ok(),
                "{}: a request signed as the provider signs did not verify: {:?}; body {:?}",
                adapter.provider(),
                verified.err().map(|r| r.code()),
                String::from_utf8_lossy(input.body)
            );
        }
        let _ = adapter.extract(&req);
    }
});
