//! Secrets stay secret and input is bounded.
//!
//! - With debug logging on, human or JSON, a gateway that has seen genuine, forged and
//!   unauthenticated traffic has written no signing secret, admin token, destination secret,
//!   provider signature or body to its log, its `/metrics` or its admin error bodies, and its
//!   history export holds no secret or signature (bodies it holds by design).
//! - A client that sends its headers too slowly is disconnected; one that sends its body too
//!   slowly gets 408; neither claims anything. 200 such clients at once are all disconnected,
//!   cost the gateway little memory, and do not keep a genuine event out.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{
    header, hooklatch, stripe_headers, unique, Behaviour, Gateway, Handler, Options, ADMIN_TOKEN,
    STRIPE_SECRET,
};

const DESTINATION_SECRET: &str = "whsec_ZGVzdGluYXRpb24tY2FuYXJ5LXNlY3JldA==";
const BODY_CANARY: &str = "body-canary-5b1e0c";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_signature_or_body_reaches_logs_metrics_errors_or_exports() {
    leaks_nothing("human").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_signature_or_body_reaches_json_logs_metrics_errors_or_exports() {
    leaks_nothing("json").await;
}

/// Genuine, forged, duplicate and unauthenticated traffic and a retried delivery, then every
/// surface read for the canaries: the log (in `log_format`, at debug level), `/metrics`, an
/// admin error body, and a history export (which holds bodies by design, but no signature).
async fn leaks_nothing(log_format: &'static str) {
    let handler = Handler::start(Behaviour::FailFirst(1)).await;
    let gateway = Gateway::start_with(
        &handler,
        Options {
            log_level: "debug",
            destination_secret: Some(DESTINATION_SECRET),
            log_format,
            ..Options::default()
        },
    )
    .await;
    let id = unique("evt_hygiene");
    let body = format!(
        r#"{{"id":"{id}","type":"invoice.payment_succeeded","data":{{"note":"{BODY_CANARY}"}}}}"#
    )
    .into_bytes();
    let headers = stripe_headers(&body);
    let signature = header(&headers, "stripe-signature").to_owned();
    let mut leaked_candidates = vec![
        STRIPE_SECRET.to_owned(),
        ADMIN_TOKEN.to_owned(),
        DESTINATION_SECRET.to_owned(),
        BODY_CANARY.to_owned(),
        signature
            .split("v1=")
            .nth(1)
            .expect("a v1 signature")
            .to_owned(),
    ];
    let (status, _) = gateway.post("stripe", &headers, body.clone()).await;
    assert_eq!(status, 200);
    // A forgery, a duplicate, an unauthenticated and a wrongly authenticated admin call.
    let forged = [("stripe-signature".to_owned(), "t=1,v1=00".to_owned())];
    gateway.post("stripe", &forged, body.clone()).await;
    gateway.post("stripe", &headers, body.clone()).await;
    let (status, unauthorized) = gateway
        .admin_request(reqwest::Method::GET, "/v1/requests", Some("not-the-token"))
        .await;
    assert_eq!(status, 401);
    // The delivery fails once (a retry is logged), then succeeds, signed with the secret.
    gateway
        .wait_for_delivery_state(&format!("stripe:{id}"), "delivered")
        .await;
    let delivered = &handler.received_for(&format!("stripe:{id}"))[1];
    leaked_candidates.push(delivered.header("webhook-signature").to_owned());

    let log = gateway.log();
    assert!(log.contains("DEBUG"), "the log runs at debug level");
    if log_format == "json" {
        let lines: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
        assert!(
            lines
                .iter()
                .all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok()),
            "every log line is JSON"
        );
        // Values a collector can use: no Rust debug text (`None`, a list's brackets).
        for line in &lines {
            let line: serde_json::Value = serde_json::from_str(line).expect("JSON");
            for (name, value) in line["fields"].as_object().into_iter().flatten() {
                let text = value.as_str().unwrap_or_default();
                assert!(
                    text != "None" && !text.starts_with("Some(") && !text.starts_with("[\""),
                    "{name}: {value} in {line}"
                );
            }
        }
    }
    let metrics = gateway.metrics().await;
    let export = hooklatch(
        &["events", "export", "--limit", "1000"],
        &gateway.admin_url(),
    );
    assert!(export.contains(&id), "the export holds the event's request");
    let surfaces = [
        ("log", log, true),
        ("metrics", metrics, true),
        ("admin error", unauthorized.to_string(), true),
        ("history export", export, false),
    ];
    for (surface, text, holds_no_body) in &surfaces {
        for canary in &leaked_candidates {
            if !holds_no_body && canary == BODY_CANARY {
                continue;
            }
            assert!(
                !text.contains(canary.as_str()),
                "{surface} contains a secret, signature or body ({canary:.8}…)"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_are_cut_off_and_a_slow_body_gets_408() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(
        &handler,
        Options {
            header_timeout: "1s",
            body_timeout: "1s",
            ..Options::default()
        },
    )
    .await;
    let addr = gateway.ingest().addr();

    // Slowloris: half a request line's headers, then silence. The server closes the socket.
    let mut slow = tokio::net::TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"POST /in/stripe HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), slow.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the slow-header connection was never closed");

    // A body that stalls after a few bytes: 408, recorded, nothing claimed.
    let mut stalled = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stalled
        .write_all(
            b"POST /in/stripe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"id\":",
        )
        .await
        .expect("write");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), async {
        let mut chunk = [0u8; 1024];
        loop {
            match stalled.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    answer.extend_from_slice(&chunk[..n]);
                    if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                        break;
                    }
                }
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no answer to the stalled body");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let rejected = gateway.requests("verdict=rejected").await;
    assert_eq!(rejected[0]["reason"].as_str(), Some("body_timeout"));
    assert!(gateway.deliveries("").await.is_empty(), "nothing queued");
}

/// The gateway's resident memory in KiB (`VmRSS`).
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status")
}

/// 200 slowloris connections at once (half a request head each, then silence) are all closed
/// by the header timeout, while a genuine event is still accepted beside them; the gateway's
/// memory grows by less than 10 MiB. A body trickling in at 5 bytes a second, never quite
/// stalled, still gets 408 once the body timeout has passed: the timeout is on the whole
/// body, not on the silence between its bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_slow_connections_are_cut_off_and_a_trickling_body_gets_408() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(
        &handler,
        Options {
            header_timeout: "2s",
            body_timeout: "1s",
            ..Options::default()
        },
    )
    .await;
    let addr = gateway.ingest().addr();
    // Warmed up first: the first event's work (the store's cache, the delivery client) is
    // not the slow connections' cost.
    let warm_up = unique("evt_warm_up");
    let body = crate::support::stripe_invoice_paid(&warm_up, 5000);
    gateway.post("stripe", &stripe_headers(&body), body).await;
    gateway
        .wait_for_delivery_state(&format!("stripe:{warm_up}"), "delivered")
        .await;
    let before = rss_kib(gateway.pid());

    let mut slow = Vec::new();
    for _ in 0..200 {
        let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
        conn.write_all(b"POST /in/stripe HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            .await
            .expect("write");
        slow.push(conn);
    }
    let event = unique("evt_beside_slowloris");
    let body = crate::support::stripe_invoice_paid(&event, 5000);
    let (status, json) = gateway
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!(
        (status, &json["status"]),
        (200, &"accepted".into()),
        "{json}"
    );
    let peak = rss_kib(gateway.pid());
    let closing = slow.into_iter().map(|mut conn| {
        tokio::spawn(async move {
            let mut buf = Vec::new();
            tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut buf))
                .await
                .is_ok()
        })
    });
    let mut closed = 0;
    for done in closing.collect::<Vec<_>>() {
        closed += usize::from(done.await.expect("a slow connection's task"));
    }
    assert_eq!(closed, 200, "slow connections the gateway closed");
    let after = rss_kib(gateway.pid());
    println!("slowloris ×200: RSS {before} KiB before, {peak} KiB with them open, {after} after");
    assert!(
        peak.max(after).saturating_sub(before) < 10 * 1024,
        "RSS grew from {before} KiB to {peak} / {after} KiB"
    );
    gateway
        .wait_for_delivery_state(&format!("stripe:{event}"), "delivered")
        .await;

    // 5 bytes a second of a 100-byte body: 408 after the 1 s body timeout, not after 20 s.
    let mut trickle = tokio::net::TcpStream::connect(addr).await.expect("connect");
    trickle
        .write_all(
            b"POST /in/stripe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n",
        )
        .await
        .expect("write");
    let (mut reader, mut writer) = trickle.into_split();
    let dripping = tokio::spawn(async move {
        for byte in std::iter::repeat_n(b'x', 100) {
            if writer.write_all(&[byte]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    });
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(15), async {
        let mut chunk = [0u8; 1024];
        while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
            match reader.read(&mut chunk).await {
                Ok(0) | Err(_) => break,
                Ok(n) => answer.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    dripping.abort();
    assert!(read.is_ok(), "no answer within 15 s to a body trickling in");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    let rejected = gateway.requests("verdict=rejected").await;
    assert_eq!(rejected[0]["reason"].as_str(), Some("body_timeout"));
}
