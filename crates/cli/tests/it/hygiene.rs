//! Secrets stay secret and input is bounded.
//!
//! - With debug logging on, a gateway that has seen genuine, forged and unauthenticated traffic
//!   has written no signing secret, admin token, destination secret, provider signature or body
//!   to its log, its `/metrics` or its admin error bodies.
//! - A client that sends its headers too slowly is disconnected; one that sends its body too
//!   slowly gets 408; neither claims anything.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{
    header, stripe_headers, unique, Behaviour, Gateway, Handler, Options, ADMIN_TOKEN,
    STRIPE_SECRET,
};

const DESTINATION_SECRET: &str = "whsec_ZGVzdGluYXRpb24tY2FuYXJ5LXNlY3JldA==";
const BODY_CANARY: &str = "body-canary-5b1e0c";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_signature_or_body_reaches_logs_metrics_or_errors() {
    let handler = Handler::start(Behaviour::FailFirst(1)).await;
    let gateway = Gateway::start_with(
        &handler,
        Options {
            log_level: "debug",
            destination_secret: Some(DESTINATION_SECRET),
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
    let metrics = gateway.metrics().await;
    let surfaces = [
        ("log", log),
        ("metrics", metrics),
        ("admin error", unauthorized.to_string()),
    ];
    for (surface, text) in &surfaces {
        for canary in &leaked_candidates {
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
