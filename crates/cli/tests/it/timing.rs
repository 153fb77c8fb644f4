//! T18's timing half (RELIABILITY.md, soak tier): a dudect-style test that the signature and
//! token comparisons take the same time wherever the received bytes first differ from the
//! expected ones. A remote attacker who could see that time would learn a valid signature byte
//! by byte; the comparisons go through `subtle`, and this measures that they stay so.
//!
//! For each comparison, `scaled(100_000)` measurements (10⁶ in the soak tier) of two classes
//! drawn at random per measurement: the received value equal to the expected one but for its
//! last byte, or a random one (see [`received`] for what else keeps the two alike). Welch's
//! t-test between the classes, on all measurements and on
//! the ones under each of 100 percentiles of the pooled times (dudect's crops: a preempted
//! measurement is a huge outlier that would hide a small difference); the figure is the
//! largest |t|, and more than 4.5 fails the test (dudect's bound for "probably leaks").
//!
//! A test that cannot fail proves nothing, so a deliberately leaky comparison (an early-exit
//! byte loop) runs through the same harness, alone and after the same HMAC as Stripe's check:
//! its |t| must be over 10, or the harness is declared unable to see a leak of that size on
//! this machine and the test fails.
//!
//! Timing depends on the machine, so CI does not run it (CI asserts counts, never time):
//! `scripts/soak` does, on a release build (`cargo test --release -p hooklatch-cli --test it
//! -- --include-ignored timing::` by hand).

use std::hint::black_box;
use std::time::{Duration, Instant};

use hooklatch_core::provider::{InboundRequest, ProviderAdapter, SignRequest, Stripe};
use hooklatch_core::secret::{constant_time_eq, Mac256, Secret};
use hooklatch_core::Timestamp;
use http::{HeaderMap, HeaderValue};

use crate::report::{draw, mix, scaled, Card};

/// dudect's bound: over it, the two classes' times differ.
const LEAK: f64 = 4.5;
/// What the leaky control must reach for the harness to count as able to see a leak.
const CONTROL_SEEN: f64 = 10.0;
/// Calls timed together in one measurement of a comparison alone (a few ns each, under the
/// clock's resolution on its own).
const REPS: usize = 64;

/// One measurement: which class, and how long the operation took.
type Sample = (bool, u64);

/// Times `op` on `scaled(100_000)` inputs, each of a class drawn from `seed`: `prepare`
/// makes the input (untimed), `op` is what is timed. The first 1 % warms caches and the
/// branch predictors and is dropped.
fn measure<I>(
    seed: u64,
    mut prepare: impl FnMut(bool, u64) -> I,
    mut op: impl FnMut(&I),
) -> Vec<Sample> {
    let n = scaled(100_000) as u64;
    let warmup = n / 100;
    let mut samples = Vec::with_capacity(n as usize);
    for i in 0..n + warmup {
        let class = draw(seed, i, 2) == 1;
        let input = prepare(class, i);
        let started = Instant::now();
        op(&input);
        let took = started.elapsed();
        if i >= warmup {
            samples.push((class, took.as_nanos() as u64));
        }
    }
    samples
}

/// Welch's t between the two classes of the samples under `limit` ns; `None` with fewer than
/// 1,000 of either.
fn welch(samples: &[Sample], limit: u64) -> Option<f64> {
    // Welford's running mean and sum of squares, per class.
    let mut n = [0f64; 2];
    let mut mean = [0f64; 2];
    let mut m2 = [0f64; 2];
    for &(class, nanos) in samples.iter().filter(|(_, nanos)| *nanos < limit) {
        let c = usize::from(class);
        let x = nanos as f64;
        n[c] += 1.0;
        let delta = x - mean[c];
        mean[c] += delta / n[c];
        m2[c] += delta * (x - mean[c]);
    }
    if n[0] < 1000.0 || n[1] < 1000.0 {
        return None;
    }
    let var = [m2[0] / (n[0] - 1.0), m2[1] / (n[1] - 1.0)];
    let spread = (var[0] / n[0] + var[1] / n[1]).sqrt();
    Some(if spread == 0.0 {
        0.0
    } else {
        (mean[0] - mean[1]) / spread
    })
}

/// The largest |t| over all samples and dudect's 100 crops (the samples under the pooled
/// times' percentile 1 − 0.5^(10·(k+1)/100), k = 0…99).
fn max_t(samples: &[Sample]) -> f64 {
    let mut sorted: Vec<u64> = samples.iter().map(|(_, nanos)| *nanos).collect();
    sorted.sort_unstable();
    let mut limits = vec![u64::MAX];
    for k in 0..100 {
        let p = 1.0 - 0.5f64.powf(10.0 * f64::from(k + 1) / 100.0);
        limits.push(sorted[((p * sorted.len() as f64) as usize).min(sorted.len() - 1)]);
    }
    limits
        .into_iter()
        .filter_map(|limit| welch(samples, limit))
        .map(f64::abs)
        .fold(0.0, f64::max)
}

/// 32 bytes drawn from `seed` and `i`.
fn random_bytes(seed: u64, i: u64) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (j, chunk) in out.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&mix(seed ^ mix(i << 2 | j as u64)).to_le_bytes());
    }
    out
}

/// What is received for pool entry `j` in measurement `i`: `expected` (class true) or a
/// random value fixed for `j` (class false), its last byte changed either way. The two classes
/// differ only in whether all but the last byte match the expected value: the same lengths,
/// the same allocation (both copies, changed in place), and as much repetition (each pool
/// entry's value comes back every time it is drawn, in both classes; with fresh random bytes
/// in one class only, code that branches on the received bytes, such as hex decoding, ran
/// measurably faster on the class the CPU had seen before, which says nothing of the secret).
fn received(expected: &[u8], class: bool, seed: u64, i: u64, j: usize) -> Vec<u8> {
    // Both values are made every time and one is dropped, so that what runs before the clock
    // starts is the same for both classes too.
    let near = expected.to_vec();
    let mut far = expected.to_vec();
    for (block, chunk) in far.chunks_mut(32).enumerate() {
        let random = random_bytes(seed ^ 0xFA2, (j as u64) ^ ((block as u64) << 40));
        chunk.copy_from_slice(&random[..chunk.len()]);
    }
    let mut got = if class { near } else { far };
    let last = got.len() - 1;
    got[last] ^= 1 + (mix(seed ^ i) % 255) as u8;
    got
}

/// The comparison a careless implementation writes: stops at the first differing byte.
fn leaky_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| black_box(*x) == black_box(*y))
}

/// Lowercase hex of `bytes`, as Stripe writes a signature.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Stripe's signature header for `body` as the provider signs it, at `at`.
fn stripe_signature(body: &[u8], secret: &Secret, at: Timestamp) -> String {
    Stripe
        .sign(&SignRequest {
            body,
            secret,
            now: at,
            event_key: "",
            event_type: None,
            url: "",
        })
        .into_iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("stripe-signature"))
        .map(|(_, value)| value)
        .expect("Stripe signs with Stripe-Signature")
}

/// How many different expected values the measurements share. Each measurement takes one at
/// random (see [`received`]); with 65,536 of them, each comes back about 15 times in 10⁶
/// measurements, too seldom for the CPU's branch predictors to learn any, in either class.
/// With 1,024, Stripe's check ran about 1 ns (of 1,900) faster on one class's fixed set of
/// values than on the other's (|t| 5–8 at 10⁶ measurements; the "near" class faster, where a
/// leak would make it slower), most likely from how the two sets' hex digits happened to
/// branch in decoding.
const POOL: u64 = 65_536;

/// The bytes of a lowercase hex string.
fn unhex(text: &str) -> Vec<u8> {
    (0..text.len() / 2)
        .map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

#[test]
#[ignore = "timing depends on the machine: the soak tier runs it (scripts/soak)"]
fn signatures_and_tokens_are_compared_in_the_same_time_wherever_they_first_differ() {
    let mut card = Card::new("T18", "none");
    let seed = card.seed();
    let mut figures = Vec::new();
    let pick = |i: u64| draw(seed ^ 0x5EED, i, POOL) as usize;

    // The comparisons alone: a MAC (the providers' HMAC checks) and a token (the admin API's
    // and `listen`'s bearer tokens, Twilio's and WhatsApp's digests), one of `POOL` each.
    let secret = Secret::from_text("whsec_timing_test_secret_0123456789");
    let macs: Vec<(Mac256, Vec<u8>)> = (0..POOL)
        .map(|j| {
            let mac = Mac256::compute(secret.expose(), &[format!("body {j}").as_bytes()]);
            let bytes = unhex(&mac.to_hex());
            (mac, bytes)
        })
        .collect();
    let tokens: Vec<Vec<u8>> = (0..POOL)
        .map(|j| format!("hl_admin_{}", hex(&random_bytes(seed ^ 0x70C, j))).into_bytes())
        .collect();

    let leaky = measure(
        seed,
        |class, i| {
            let j = pick(i);
            (j, received(&macs[j].1, class, seed, i, j))
        },
        |(j, got)| {
            for _ in 0..REPS {
                black_box(leaky_eq(black_box(got), black_box(&macs[*j].1)));
            }
        },
    );
    figures.push(("leaky_control", max_t(&leaky)));
    let matches = measure(
        seed ^ 1,
        |class, i| {
            let j = pick(i);
            (j, received(&macs[j].1, class, seed, i, j))
        },
        |(j, got)| {
            for _ in 0..REPS {
                black_box(black_box(&macs[*j].0).matches(black_box(got)));
            }
        },
    );
    figures.push(("mac256_matches", max_t(&matches)));
    let token_checks = measure(
        seed ^ 2,
        |class, i| {
            let j = pick(i);
            (j, received(&tokens[j], class, seed, i, j))
        },
        |(j, got)| {
            for _ in 0..REPS {
                black_box(constant_time_eq(black_box(got), black_box(&tokens[*j])));
            }
        },
    );
    figures.push(("constant_time_eq", max_t(&token_checks)));

    // Stripe's whole check, as a request meets it: the header parsed, the MAC computed over a
    // 2 KB body and compared with the `v1` hex, the one at the end near or far from the right
    // one. And the same HMAC followed by the leaky comparison of the hex, for the harness's
    // power at this size.
    let now = Timestamp::now();
    let mut body = br#"{"id":"evt_timing"}"#.to_vec();
    body.resize(2048, b' ');
    // Each pool entry signed at another second (Stripe signs `t.body`): as many different
    // signatures, one body.
    let signatures: Vec<(String, Vec<u8>)> = (0..POOL)
        .map(|j| {
            let at = Timestamp::from_secs(now.as_secs() - j as i64);
            let header = stripe_signature(&body, &secret, at);
            let (prefix, v1) = header.rsplit_once("v1=").expect("a v1 signature");
            (prefix.to_owned(), unhex(v1))
        })
        .collect();
    let header_for = |class, i| {
        let j = pick(i);
        let (prefix, good) = &signatures[j];
        let v1 = hex(&received(good, class, seed, i, j));
        let mut headers = HeaderMap::new();
        headers.insert(
            "stripe-signature",
            HeaderValue::from_str(&format!("{prefix}v1={v1}")).expect("a header value"),
        );
        (j, headers, v1)
    };
    let secrets = [secret.clone()];
    let verify = measure(seed ^ 3, header_for, |(_, headers, _)| {
        let req = InboundRequest {
            path_and_query: "/in/stripe",
            headers,
            body: &body,
            now,
        };
        let refused = Stripe.verify(black_box(&req), &secrets, Duration::from_secs(300));
        assert!(refused.is_err(), "a changed signature never verifies");
    });
    figures.push(("stripe_verify", max_t(&verify)));
    let leaky_verify = measure(seed ^ 4, header_for, |(j, _, v1)| {
        let signed = format!("{}.", now.as_secs() - *j as i64);
        let mac = Mac256::compute(secret.expose(), &[signed.as_bytes(), &body]);
        black_box(leaky_eq(mac.to_hex().as_bytes(), v1.as_bytes()));
    });
    figures.push(("leaky_control_after_hmac", max_t(&leaky_verify)));

    card.count("ops", scaled(100_000) * figures.len());
    for (name, t) in &figures {
        card.figure(&format!("t_{name}"), (t * 100.0).round() / 100.0);
        println!("|t| {name}: {t:.2}");
    }
    let t = |name: &str| figures.iter().find(|(n, _)| *n == name).map(|(_, t)| *t);
    for control in ["leaky_control", "leaky_control_after_hmac"] {
        let t = t(control).expect("measured");
        assert!(
            t > CONTROL_SEEN,
            "the harness did not see a known leak ({control}: |t| {t:.2}): its other figures say nothing on this machine"
        );
    }
    for name in ["mac256_matches", "constant_time_eq", "stripe_verify"] {
        let t = t(name).expect("measured");
        assert!(
            t < LEAK,
            "{name}: |t| {t:.2} over {LEAK}: its time depends on where the bytes differ"
        );
    }
}
