//! Where deliveries may go: a real gateway refuses to dial loopback, private and link-local
//! addresses its destination's `allow` list does not hold.
//!
//! Proves that a destination named `localhost` (resolving to loopback) with no `allow` is
//! never dialled: a canary listening there accepts no TCP connection, the attempts fail with
//! "resolves only to blocked addresses" and the delivery is dead-lettered, while the same
//! gateway's allowed destination on 127.0.0.1 is delivered; and that a destination whose URL
//! holds a blocked address (the metadata endpoint, loopback in decimal, `[::1]`, 127.0.0.2)
//! stops `hooklatch check-config` with status 2 and the line to add; that an allowed
//! destination redirecting to a blocked address does not get the redirect followed; and the
//! same on IPv6 loopback (`[::1]`), where a destination allowed `::1` is delivered. And
//! `https://` destinations: delivered only with the CA and client certificate their server
//! asks for.

use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::{header, StatusCode};

use crate::support::{
    stripe_headers, stripe_invoice_paid, unique, wait_until, Behaviour, Gateway, Handler, Options,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_to_loopback_is_not_dialled_without_allow() {
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let (port, dialled) = canary("127.0.0.1").await;
    let gw = Gateway::start_with(
        &app,
        Options {
            extra_config: format!(
                r#"
[[sources]]
name = "probe"
provider = "stripe"
secrets = ["env:E2E_STRIPE_SECRET"]
destinations = ["internal"]

[[destinations]]
name = "internal"
url = "http://localhost:{port}/sink"
max_attempts = 2
initial_backoff = "100ms"
"#
            ),
            ..Options::default()
        },
    )
    .await;
    let key = gw.send_stripe_event("probe", "evt_outbound").await;

    let dead = gw.wait_for_delivery_state(&key, "dead").await;
    assert_eq!(dead["destination"], "internal", "{dead}");
    let error = dead["last_error"].as_str().unwrap_or_default();
    assert!(
        error.contains("localhost resolves only to blocked addresses"),
        "{error}"
    );
    assert!(error.contains("loopback"), "{error}");
    assert_eq!(dead["history"].as_array().map(Vec::len), Some(2), "{dead}");
    // The same gateway's destination on 127.0.0.1, allowed, is delivered.
    let allowed_id = unique("evt_outbound_allowed");
    let body = stripe_invoice_paid(&allowed_id, 5000);
    let (status, _) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!(status, 200);
    let allowed = format!("stripe:{allowed_id}");
    wait_until("the allowed destination gets its event", || {
        app.count_for(&allowed) == 1
    })
    .await;
    assert_eq!(
        dialled.load(Ordering::SeqCst),
        0,
        "TCP connections to the blocked destination"
    );
}

/// A listener on `ip` that counts TCP connections, not HTTP requests (a dial that sent
/// nothing counts): its port and the count.
async fn canary(ip: &str) -> (u16, Arc<AtomicUsize>) {
    let canary = tokio::net::TcpListener::bind((ip, 0))
        .await
        .expect("a canary port");
    let port = canary.local_addr().expect("its address").port();
    let dialled = Arc::new(AtomicUsize::new(0));
    let counter = dialled.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = canary.accept().await {
            counter.fetch_add(1, Ordering::SeqCst);
            drop(conn);
        }
    });
    (port, dialled)
}

/// An allowed destination (127.0.0.1) that answers every delivery with a redirect to a blocked
/// address (127.0.0.2, loopback but not in `allow`): the redirect is not followed, the canary
/// there accepts no connection, and the attempts fail as the 3xx they are until the delivery is
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_to_a_blocked_address_is_not_followed() {
    let (port, dialled) = canary("127.0.0.2").await;
    let (redirecting, redirected) = redirecting_to(format!("http://127.0.0.2:{port}/stolen")).await;
    let url = format!("http://{redirecting}/hook");

    let gw = Gateway::start_at(
        url,
        Options {
            max_attempts: 2,
            ..Options::default()
        },
    )
    .await;
    let id = unique("evt_redirect");
    let body = stripe_invoice_paid(&id, 5000);
    let (status, _) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!(status, 200);
    let dead = gw
        .wait_for_delivery_state(&format!("stripe:{id}"), "dead")
        .await;
    assert_eq!(dead["history"].as_array().map(Vec::len), Some(2), "{dead}");
    assert_eq!(
        redirected.load(Ordering::SeqCst),
        2,
        "one redirect per attempt"
    );
    assert_eq!(
        dialled.load(Ordering::SeqCst),
        0,
        "TCP connections to the address the redirect named"
    );
}

/// IPv6 loopback, end to end: an allowed destination on 127.0.0.1 answering every delivery
/// with a redirect to `[::1]` does not get it followed (a canary listening on `[::1]` accepts no
/// connection), while a destination on `[::1]` whose `allow` holds `::1` is delivered. Skipped
/// where the machine cannot listen on `::1` (IPv6 turned off in its kernel).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_loopback_is_dialled_only_where_allowed() {
    if tokio::net::TcpListener::bind(("::1", 0)).await.is_err() {
        println!("skipped: this machine cannot listen on [::1]");
        return;
    }
    let (port, dialled) = canary("::1").await;
    let (redirecting, redirected) = redirecting_to(format!("http://[::1]:{port}/stolen")).await;
    let received = Arc::new(AtomicUsize::new(0));
    let v6_app = serve_on("::1", counting(received.clone(), || StatusCode::OK)).await;

    let gw = Gateway::start_at(
        format!("http://{redirecting}/hook"),
        Options {
            max_attempts: 2,
            extra_config: format!(
                r#"
[[sources]]
name = "v6"
provider = "stripe"
secrets = ["env:E2E_STRIPE_SECRET"]
destinations = ["v6"]

[[destinations]]
name = "v6"
url = "http://{v6_app}/sink"
allow = ["::1"]
"#
            ),
            ..Options::default()
        },
    )
    .await;
    let redirect_key = gw.send_stripe_event("stripe", "evt_redirect_v6").await;
    let dead = gw.wait_for_delivery_state(&redirect_key, "dead").await;
    assert_eq!(dead["history"].as_array().map(Vec::len), Some(2), "{dead}");
    assert_eq!(
        redirected.load(Ordering::SeqCst),
        2,
        "one redirect per attempt"
    );

    let allowed_key = gw.send_stripe_event("v6", "evt_allowed_v6").await;
    let delivered = gw.wait_for_delivery_state(&allowed_key, "delivered").await;
    assert_eq!(delivered["destination"], "v6", "{delivered}");
    assert_eq!(received.load(Ordering::SeqCst), 1, "requests at [::1]");
    assert_eq!(
        dialled.load(Ordering::SeqCst),
        0,
        "TCP connections to [::1] that a redirect named"
    );
}

/// A destination on 127.0.0.1 answering every request 302 to `location`: its address and how
/// many requests it answered.
async fn redirecting_to(location: String) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let redirected = Arc::new(AtomicUsize::new(0));
    let app = counting(redirected.clone(), move || {
        (
            StatusCode::FOUND,
            [(header::LOCATION, location.clone())],
            "",
        )
    });
    (serve_on("127.0.0.1", app).await, redirected)
}

/// A router answering every request with `answer()`, counting them in `count`.
fn counting<R>(
    count: Arc<AtomicUsize>,
    answer: impl Fn() -> R + Clone + Send + Sync + 'static,
) -> axum::Router
where
    R: axum::response::IntoResponse + Send + 'static,
{
    axum::Router::new().fallback(move || {
        count.fetch_add(1, Ordering::SeqCst);
        let response = answer();
        async move { response }
    })
}

/// Serves `app` on a new port of `ip`; the address as a URL's authority (`[::1]:port` for IPv6).
async fn serve_on(ip: &str, app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind((ip, 0))
        .await
        .expect("a port for a destination");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[test]
fn a_blocked_address_in_a_url_stops_the_configuration() {
    let dir = tempfile::tempdir().unwrap();
    for url in [
        "http://169.254.169.254/latest/meta-data/",
        "http://2130706433:3000/",
        "http://[::1]:3000/",
        "http://127.0.0.2:3000/",
        "http://[::ffff:10.0.0.1]/",
    ] {
        let config = dir.path().join("hooklatch.toml");
        std::fs::write(
            &config,
            format!(
                "[store]\nurl = \"sqlite://x.db\"\n\n[[destinations]]\nname = \"app\"\nurl = \"{url}\"\n"
            ),
        )
        .unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
            .args(["check-config", "--config"])
            .arg(&config)
            .env("HOOKLATCH_ADMIN_TOKEN", "outbound-admin-token-0123456789")
            .output()
            .expect("running check-config");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        assert!(stderr.contains("destinations[0].url: "), "{url}: {stderr}");
        assert!(stderr.contains("allow = [\""), "{url}: {stderr}");
    }
}

/// `https://` destinations: the handler behind a TLS-terminating proxy (the testkit's, its
/// certificate for `localhost` from a private CA) that also asks for a client certificate.
/// The destination given the CA (`ca_file`) and a client certificate (`client_cert`,
/// `client_key`) is delivered; the one with the CA and no client certificate is refused by the
/// server, the one without the CA refuses the server (`UnknownIssuer`): both are retried then
/// dead-lettered with the reason, and neither reached the handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_destination_is_delivered_only_with_its_ca_and_client_certificate() {
    use hooklatch_testkit::tls::{TestCa, TlsTerminator};
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let ca = TestCa::new("hooklatch e2e CA");
    let tls = TlsTerminator::start(
        crate::support::service_addr(&app.url(), 80),
        &ca.server(&["localhost"]),
        Some(&ca),
    )
    .await
    .expect("the TLS proxy listens");
    let dir = tempfile::tempdir().expect("a temp dir");
    let client = ca.client("hooklatch");
    let files = [
        ("ca.pem", ca.pem()),
        ("client.pem", client.cert_pem()),
        ("client.key", client.key_pem()),
    ];
    for (name, text) in files {
        std::fs::write(dir.path().join(name), text).expect("writing a TLS file");
    }
    let path = |name: &str| dir.path().join(name).display().to_string();
    let https = format!("https://localhost:{}/webhooks", tls.addr().port());
    let mut extra = String::new();
    for (name, tls_lines) in [
        (
            "trusted",
            format!(
                "ca_file = \"{}\"\nclient_cert = \"{}\"\nclient_key = \"file:{}\"",
                path("ca.pem"),
                path("client.pem"),
                path("client.key")
            ),
        ),
        ("anonymous", format!("ca_file = \"{}\"", path("ca.pem"))),
        ("untrusted", String::new()),
    ] {
        extra.push_str(&format!(
            r#"
[[sources]]
name = "{name}"
provider = "stripe"
secrets = ["env:E2E_STRIPE_SECRET"]
destinations = ["{name}"]

[[destinations]]
name = "{name}"
url = "{https}"
allow = ["127.0.0.1"]
max_attempts = 2
initial_backoff = "100ms"
max_backoff = "100ms"
jitter = 0.0
{tls_lines}
"#
        ));
    }
    let gw = Gateway::start_with(
        &app,
        Options {
            extra_config: extra,
            ..Options::default()
        },
    )
    .await;

    let event = unique("evt_https");
    let body = stripe_invoice_paid(&event, 4200);
    for source in ["trusted", "anonymous", "untrusted"] {
        let (status, json) = gw.post(source, &stripe_headers(&body), body.clone()).await;
        assert_eq!(status, 200, "{source}: {json}");
    }
    gw.wait_for_delivery_state(&format!("trusted:{event}"), "delivered")
        .await;
    assert_eq!(app.count_for(&format!("trusted:{event}")), 1);
    for (source, reason) in [
        ("anonymous", "CertificateRequired"),
        ("untrusted", "UnknownIssuer"),
    ] {
        let dead = gw
            .wait_for_delivery_state(&format!("{source}:{event}"), "dead")
            .await;
        let error = dead["last_error"].as_str().unwrap_or("");
        assert!(error.contains(reason), "{source}: {dead:#}");
        assert!(!error.contains("PRIVATE KEY"), "{error}");
        assert_eq!(app.count_for(&format!("{source}:{event}")), 0);
    }
    assert_eq!(
        tls.upstream_connections(),
        1,
        "only the trusted destination got through"
    );
}
