//! [`Publisher`] against a real RabbitMQ broker, at `HOOKLATCH_TEST_AMQP_URL`
//! (e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`). Without it the tests print
//! `skipped: set HOOKLATCH_TEST_AMQP_URL` and pass — except under CI (`CI` set), where they
//! fail. Each test declares its own exchange and queue and deletes them afterwards.

use std::time::Duration;

use hooklatch_queue_rabbitmq::{Message, PublishError, Publisher, PublisherConfig};
use hooklatch_testkit::amqp::{broker_url, header, message_id, TestBroker};

/// Names unique to this process and call.
fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "hooklatch-test-{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

fn message<'a>(key: &'a str, body: &'a [u8]) -> Message<'a> {
    Message {
        body,
        idempotency_key: key,
        content_type: Some("application/json; charset=utf-8"),
        source: "stripe",
        provider: Some("stripe"),
        event_type: Some("payment_intent.succeeded"),
        delivery_id: "dlv_7",
        attempt: 3,
        timestamp: 1_733_140_800,
    }
}

fn config(url: &str, exchange: &str, queue: Option<&str>) -> PublisherConfig {
    let mut config = PublisherConfig::new(url, exchange, "payment.confirmed");
    config.declare = true;
    config.queue = queue.map(str::to_owned);
    config.timeout = Duration::from_secs(10);
    config
}

#[tokio::test]
async fn a_publish_arrives_persistent_with_its_key_and_headers() {
    let Some(url) = broker_url() else { return };
    let mut admin = TestBroker::connect(&url).await;
    let (exchange, queue) = (unique("x"), unique("q"));
    admin.owns(&exchange, &queue);
    let mut cfg = config(&url, &exchange, Some(&queue));
    cfg.quorum = true;
    let publisher = Publisher::new(cfg);

    let body = br#"{"id":"evt_1","type":"payment_intent.succeeded"}"#;
    publisher
        .publish(&message("stripe:evt_1", body))
        .await
        .expect("a routable publish is confirmed");

    let msg = admin.get(&queue).await;
    let props = &msg.delivery.properties;
    assert_eq!(msg.delivery.data, body);
    assert_eq!(
        props.message_id().as_ref().map(|s| s.to_string()),
        Some("stripe:evt_1".to_owned())
    );
    assert_eq!(*props.delivery_mode(), Some(2), "persistent");
    assert_eq!(
        props.content_type().as_ref().map(|s| s.to_string()),
        Some("application/json; charset=utf-8".to_owned())
    );
    assert_eq!(*props.timestamp(), Some(1_733_140_800));
    assert_eq!(header(&msg, "hooklatch-source"), "stripe");
    assert_eq!(header(&msg, "hooklatch-provider"), "stripe");
    assert_eq!(
        header(&msg, "hooklatch-event-type"),
        "payment_intent.succeeded"
    );
    assert_eq!(header(&msg, "hooklatch-delivery-id"), "dlv_7");
    assert_eq!(header(&msg, "hooklatch-attempt"), "3");
    assert_eq!(admin.depth(&queue).await, 0);

    publisher.disconnect().await;
    admin.clean_up().await;
}

#[tokio::test]
async fn an_unroutable_publish_fails_and_without_mandatory_the_broker_confirms_it_anyway() {
    let Some(url) = broker_url() else { return };
    let mut admin = TestBroker::connect(&url).await;
    let exchange = unique("unbound");
    admin.exchange(&exchange).await;

    let mut cfg = config(&url, &exchange, None);
    cfg.declare = false;
    let publisher = Publisher::new(cfg.clone());
    let err = publisher
        .publish(&message("stripe:evt_lost", b"{}"))
        .await
        .expect_err("an unroutable mandatory publish must fail");
    assert!(
        matches!(err, PublishError::Returned { code: 312, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("unroutable"), "{err}");

    // The trap: without `mandatory`, the broker drops the message and acks it.
    cfg.mandatory = false;
    let careless = Publisher::new(cfg);
    careless
        .publish(&message("stripe:evt_lost", b"{}"))
        .await
        .expect("the broker confirms a message it dropped");

    publisher.disconnect().await;
    careless.disconnect().await;
    admin.clean_up().await;
}

#[tokio::test]
async fn a_broken_connection_is_replaced_on_the_next_publish() {
    let Some(url) = broker_url() else { return };
    let mut admin = TestBroker::connect(&url).await;
    let (exchange, queue) = (unique("x"), unique("q"));
    admin.owns(&exchange, &queue);
    let publisher = Publisher::new(config(&url, &exchange, Some(&queue)));

    publisher
        .publish(&message("stripe:evt_a", b"a"))
        .await
        .expect("first publish");
    publisher.break_connection().await;
    // The first publish after the break may fail (and would be retried); within a few
    // attempts one must go through, on a new connection.
    let mut delivered = false;
    for _ in 0..5 {
        match publisher.publish(&message("stripe:evt_b", b"b")).await {
            Ok(()) => {
                delivered = true;
                break;
            }
            Err(err) => eprintln!("publish after the break: {err}"),
        }
    }
    assert!(delivered, "no publish succeeded after the connection broke");
    assert_eq!(admin.get(&queue).await.delivery.data, b"a");
    assert_eq!(admin.get(&queue).await.delivery.data, b"b");

    publisher.disconnect().await;
    admin.clean_up().await;
}

#[tokio::test]
async fn an_unreachable_broker_is_a_connect_error_without_the_password() {
    // No broker needed: nothing listens on port 1.
    let mut cfg = PublisherConfig::new("amqp://guest:hunter2@127.0.0.1:1/%2f", "x", "k");
    cfg.timeout = Duration::from_secs(5);
    let publisher = Publisher::new(cfg);
    let err = publisher
        .publish(&message("k", b"{}"))
        .await
        .expect_err("nothing listens there");
    assert!(
        matches!(err, PublishError::Connect(_) | PublishError::Timeout(_)),
        "{err:?}"
    );
    assert!(!err.to_string().contains("hunter2"), "{err}");
}

/// A cluster's other nodes (`fallback_urls`): when the first URL cannot be reached, the
/// publisher connects to the next that answers and publishes there; with none answering the
/// error names no password.
#[tokio::test]
async fn an_unreachable_node_is_passed_over_for_the_next_that_answers() {
    let Some(url) = broker_url() else { return };
    let mut admin = TestBroker::connect(&url).await;
    let (exchange, queue) = (unique("x"), unique("q"));
    admin.owns(&exchange, &queue);
    // Nothing listens on port 1.
    let mut cfg = config(
        "amqp://guest:hunter2@127.0.0.1:1/%2f",
        &exchange,
        Some(&queue),
    );
    cfg.fallback_urls = vec![
        "amqp://guest:hunter2@127.0.0.1:2/%2f".to_owned(),
        url.clone(),
    ];
    let publisher = Publisher::new(cfg);
    for key in ["stripe:evt_a", "stripe:evt_b"] {
        publisher
            .publish(&message(key, b"{}"))
            .await
            .expect("published through the node that answers");
    }
    for key in ["stripe:evt_a", "stripe:evt_b"] {
        let msg = admin.get(&queue).await;
        assert_eq!(message_id(&msg), Some(key.to_owned()));
    }
    admin.clean_up().await;

    let mut cfg = PublisherConfig::new("amqp://guest:hunter2@127.0.0.1:1/%2f", "x", "k");
    cfg.fallback_urls = vec!["amqp://guest:hunter2@127.0.0.1:2/%2f".to_owned()];
    cfg.timeout = Duration::from_secs(5);
    let err = Publisher::new(cfg)
        .publish(&message("k", b"{}"))
        .await
        .expect_err("no node answers");
    assert!(!err.to_string().contains("hunter2"), "{err}");
}

/// `url` with its scheme and its host and port replaced: `amqp://guest:guest@127.0.0.1:5672/%2f`
/// through `amqps` and `localhost:5999` is `amqps://guest:guest@localhost:5999/%2f`.
fn through(url: &str, scheme: &str, host_port: &str) -> String {
    let rest = url.split_once("://").expect("a URL").1;
    let (userinfo, after) = rest.rsplit_once('@').unwrap_or(("", rest));
    let tail = after.find('/').map_or("", |at| &after[at..]);
    let userinfo = if userinfo.is_empty() {
        String::new()
    } else {
        format!("{userinfo}@")
    };
    format!("{scheme}://{userinfo}{host_port}{tail}")
}

/// The broker's plain AMQP address, from its URL.
fn broker_addr(url: &str) -> std::net::SocketAddr {
    let uri: lapin::uri::AMQPUri = url.parse().expect("the broker's URL parses");
    let host = match uri.authority.host.as_str() {
        "localhost" => "127.0.0.1",
        host => host,
    };
    format!("{host}:{}", uri.authority.port)
        .parse()
        .expect("the broker is named by an IP address or localhost")
}

/// `amqps://`: the publisher speaks TLS to a TLS-terminating proxy in front of the real
/// broker, trusting the proxy's private CA (`tls.ca_pem`); the message arrives, and the proxy
/// saw a completed handshake before it connected to the broker.
#[tokio::test]
async fn an_amqps_publish_arrives_through_tls_trusting_a_private_ca() {
    use hooklatch_testkit::tls::{TestCa, TlsTerminator};
    let Some(url) = broker_url() else { return };
    let mut admin = TestBroker::connect(&url).await;
    let (exchange, queue) = (unique("x"), unique("q"));
    admin.owns(&exchange, &queue);
    let ca = TestCa::new("hooklatch test CA");
    let tls = TlsTerminator::start(
        broker_addr(&url),
        &ca.server(&["localhost", "127.0.0.1"]),
        None,
    )
    .await
    .expect("the TLS proxy listens");
    let port = tls.addr().port();

    let mut cfg = config(
        &through(&url, "amqps", &format!("localhost:{port}")),
        &exchange,
        Some(&queue),
    );
    cfg.tls.ca_pem = Some(ca.pem().to_owned());
    let publisher = Publisher::new(cfg);
    publisher
        .publish(&message("stripe:evt_tls", br#"{"id":"evt_tls"}"#))
        .await
        .expect("published over TLS");
    let msg = admin.get(&queue).await;
    assert_eq!(message_id(&msg), Some("stripe:evt_tls".to_owned()));
    assert_eq!(msg.delivery.data, br#"{"id":"evt_tls"}"#);
    assert_eq!((tls.handshakes(), tls.refused()), (1, 0));
    assert_eq!(tls.upstream_connections(), 1);

    // By IP address: the certificate names 127.0.0.1 too.
    let mut cfg = config(
        &through(&url, "amqps", &format!("127.0.0.1:{port}")),
        &exchange,
        Some(&queue),
    );
    cfg.tls.ca_pem = Some(ca.pem().to_owned());
    Publisher::new(cfg)
        .publish(&message("stripe:evt_tls_ip", b"{}"))
        .await
        .expect("published over TLS to an address the certificate names");
    assert_eq!(
        message_id(&admin.get(&queue).await),
        Some("stripe:evt_tls_ip".to_owned())
    );
    admin.clean_up().await;
}

/// A broker whose certificate is not trusted (a private CA not configured), or does not name
/// the host connected to, is refused during the handshake: a connect error that says why and
/// shows no password, and nothing — no credentials, no message — ever reaches the broker.
#[tokio::test]
async fn an_untrusted_or_misnamed_certificate_is_refused_before_anything_reaches_the_broker() {
    use hooklatch_testkit::tls::{TestCa, TlsTerminator};
    let Some(url) = broker_url() else { return };
    let ca = TestCa::new("hooklatch test CA");
    let tls = TlsTerminator::start(broker_addr(&url), &ca.server(&["localhost"]), None)
        .await
        .expect("the TLS proxy listens");
    let port = tls.addr().port();
    let amqps = through(
        "amqp://guest:hunter2@x/%2f",
        "amqps",
        &format!("localhost:{port}"),
    );

    // The built-in roots only: the private CA is unknown.
    let untrusted = Publisher::new(config(&amqps, "x", None));
    let err = untrusted
        .publish(&message("k", b"{}"))
        .await
        .expect_err("an unknown CA is not trusted");
    let text = err.to_string();
    assert!(matches!(err, PublishError::Connect(_)), "{err:?}");
    assert!(text.contains("UnknownIssuer"), "{text}");
    assert!(!text.contains("hunter2"), "{text}");

    // Trusted CA, wrong name: the certificate names localhost, not 127.0.0.1.
    let mut cfg = config(
        &through(&amqps, "amqps", &format!("127.0.0.1:{port}")),
        "x",
        None,
    );
    cfg.tls.ca_pem = Some(ca.pem().to_owned());
    let err = Publisher::new(cfg)
        .publish(&message("k", b"{}"))
        .await
        .expect_err("a certificate for another name is refused");
    assert!(err.to_string().contains("not valid for name"), "{err}");

    assert_eq!(tls.refused_at_least(2, Duration::from_secs(10)).await, 2);
    assert_eq!(tls.handshakes(), 0);
    assert_eq!(tls.upstream_connections(), 0);
}

/// Mutual TLS: a broker that asks for a client certificate refuses a publisher without one,
/// and takes the one configured (`tls.client`), issued by the CA it trusts.
#[tokio::test]
async fn a_broker_asking_for_a_client_certificate_gets_the_configured_one() {
    use hooklatch_queue_rabbitmq::ClientIdentity;
    use hooklatch_testkit::tls::{TestCa, TlsTerminator};
    let Some(url) = broker_url() else { return };
    let mut admin = TestBroker::connect(&url).await;
    let (exchange, queue) = (unique("x"), unique("q"));
    admin.owns(&exchange, &queue);
    let ca = TestCa::new("hooklatch test CA");
    let tls = TlsTerminator::start(broker_addr(&url), &ca.server(&["localhost"]), Some(&ca))
        .await
        .expect("the TLS proxy listens");
    let amqps = through(&url, "amqps", &format!("localhost:{}", tls.addr().port()));

    let mut cfg = config(&amqps, &exchange, Some(&queue));
    cfg.tls.ca_pem = Some(ca.pem().to_owned());
    let err = Publisher::new(cfg.clone())
        .publish(&message("stripe:evt_anon", b"{}"))
        .await
        .expect_err("no client certificate, no connection");
    assert!(
        matches!(err, PublishError::Connect(_) | PublishError::Channel(_)),
        "{err:?}"
    );
    assert_eq!(tls.upstream_connections(), 0);

    let client = ca.client("hooklatch");
    cfg.tls.client = Some(ClientIdentity {
        cert_pem: client.cert_pem().to_owned(),
        key_pem: hooklatch_core::Secret::from_text(client.key_pem()),
    });
    Publisher::new(cfg)
        .publish(&message("stripe:evt_mtls", b"{}"))
        .await
        .expect("published with a client certificate");
    assert_eq!(
        message_id(&admin.get(&queue).await),
        Some("stripe:evt_mtls".to_owned())
    );
    assert_eq!(tls.upstream_connections(), 1);
    admin.clean_up().await;
}
