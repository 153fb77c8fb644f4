//! TLS on the public listener (`[server] tls_cert`, `tls_key`) with a real `hooklatch serve`:
//! a provider's signed event over HTTPS is accepted, then a duplicate, and delivered; plain
//! HTTP on the TLS port and a client that never starts its handshake get nothing and are
//! counted; a renewed certificate is served after `SIGHUP` without a restart, and a renewal
//! whose files do not load leaves the certificate in use serving; `hooklatch send` and
//! `hooklatch listen` reach it with `--ca-file`.

use std::io::Read;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use hooklatch_testkit::tls::{Issued, TestCa};

use crate::support::{
    eventually, stripe_headers, stripe_invoice_paid, unique, wait_until, Behaviour, Gateway,
    Handler, Options, STRIPE_SECRET,
};

/// Writes `issued`'s certificate and key where the gateway's configuration points.
fn install(dir: &Path, issued: &Issued) {
    std::fs::write(dir.join("cert.pem"), issued.cert_pem()).expect("writing the certificate");
    std::fs::write(dir.join("key.pem"), issued.key_pem()).expect("writing the key");
}

/// The `[server]` lines serving what [`install`] wrote in `dir`.
fn tls_lines(dir: &Path) -> String {
    format!(
        "tls_cert = \"{}\"\ntls_key = \"file:{}\"",
        dir.join("cert.pem").display(),
        dir.join("key.pem").display()
    )
}

/// An HTTPS client trusting `ca` only, reaching `localhost` at `addr`.
fn trusting(ca: &TestCa, addr: SocketAddr) -> reqwest::Client {
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem().as_bytes()).expect("PEM"))
        .resolve("localhost", addr)
        .timeout(Duration::from_secs(10))
        .build()
        .expect("an HTTPS client")
}

/// Posts `body` as a signed Stripe event over `client`; the status and the JSON's `status`.
async fn post(client: &reqwest::Client, port: u16, body: &[u8]) -> reqwest::Result<(u16, String)> {
    let mut req = client
        .post(format!("https://localhost:{port}/in/stripe"))
        .body(body.to_vec());
    for (name, value) in stripe_headers(body) {
        req = req.header(name, value);
    }
    let res = req.send().await?;
    let status = res.status().as_u16();
    let json: serde_json::Value = res.json().await?;
    Ok((status, json["status"].as_str().unwrap_or("").to_owned()))
}

/// The value of the metric line starting with `prefix`, or 0.
fn metric(metrics: &str, prefix: &str) -> f64 {
    metrics
        .lines()
        .find(|line| line.starts_with(prefix))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_public_listener_serves_tls_and_a_renewed_certificate_after_sighup() {
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let first = TestCa::new("first CA");
    install(dir.path(), &first.server(&["localhost"]));
    let gw = Gateway::start_with(
        &app,
        Options {
            server_config: tls_lines(dir.path()),
            header_timeout: "1s",
            ..Options::default()
        },
    )
    .await;
    let addr = gw.ingest().addr();
    let port = addr.port();

    // A provider's event over HTTPS: accepted, then a duplicate; delivered once.
    let event = unique("evt_tls_ingest");
    let body = stripe_invoice_paid(&event, 1200);
    let client = trusting(&first, addr);
    let first_post = post(&client, port, &body).await.expect("HTTPS");
    let second_post = post(&client, port, &body).await.expect("HTTPS");
    assert_eq!(
        [first_post, second_post],
        [(200, "accepted".to_owned()), (200, "duplicate".to_owned())]
    );
    wait_until("delivered once", || {
        app.count_for(&format!("stripe:{event}")) == 1
    })
    .await;

    // Plain HTTP on the TLS port gets no answer, and is counted.
    let plain = reqwest::Client::new()
        .post(format!("http://127.0.0.1:{port}/in/stripe"))
        .body(body.clone())
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP on the TLS port: {plain:?}");

    // A client that connects and never starts its handshake is closed after the header
    // timeout (1 s), not kept.
    let silent = tokio::task::spawn_blocking(move || {
        let mut stream = std::net::TcpStream::connect(addr).expect("connecting");
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .expect("a read timeout");
        let mut buf = [0u8; 16];
        stream.read(&mut buf)
    })
    .await
    .expect("the silent client's thread");
    assert!(
        matches!(silent, Ok(0)),
        "the server closed the silent connection: {silent:?}"
    );
    eventually("both refusals counted", async || {
        metric(
            &gw.metrics().await,
            "hooklatch_tls_handshake_failures_total{listener=\"ingest\"}",
        ) >= 2.0
    })
    .await;

    // The command-line clients: `hooklatch send` to the HTTPS listener fails on the private
    // CA's certificate, and succeeds trusting it with `--ca-file`.
    std::fs::write(dir.path().join("first-ca.pem"), first.pem()).expect("writing the CA");
    let send = |ca_file: Option<&Path>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"));
        if let Some(path) = ca_file {
            cmd.arg("--ca-file").arg(path);
        }
        cmd.args([
            "send",
            "stripe",
            "--id",
            "evt_tls_cli",
            "--secret",
            STRIPE_SECRET,
        ])
        .arg("--to")
        .arg(format!("https://localhost:{port}/in/stripe"))
        .env_remove("HOOKLATCH_CA_FILE")
        .output()
        .expect("running hooklatch send")
    };
    let refused = send(None);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("UnknownIssuer") || stderr.contains("certificate"),
        "{stderr}"
    );
    let sent = send(Some(&dir.path().join("first-ca.pem")));
    let out = format!(
        "{}{}",
        String::from_utf8_lossy(&sent.stdout),
        String::from_utf8_lossy(&sent.stderr)
    );
    assert!(sent.status.success(), "{out}");
    assert!(out.contains("accepted"), "{out}");

    // Renewal: new files, SIGHUP, and the next handshake presents the new certificate.
    let second = TestCa::new("second CA");
    install(dir.path(), &second.server(&["localhost"]));
    hangup(gw.pid());
    let renewed = trusting(&second, addr);
    eventually("the renewed certificate is served", async || {
        renewed
            .get(format!("https://localhost:{port}/healthz"))
            .send()
            .await
            .is_ok()
    })
    .await;
    let fresh = trusting(&first, addr);
    assert!(
        post(&fresh, port, &body).await.is_err(),
        "the old certificate is no longer served"
    );
    let event = unique("evt_tls_renewed");
    let body = stripe_invoice_paid(&event, 1300);
    assert_eq!(
        post(&renewed, port, &body).await.expect("HTTPS"),
        (200, "accepted".to_owned())
    );

    // A renewal whose files do not load: the certificate in use stays, and the log says why.
    std::fs::write(dir.path().join("cert.pem"), "not a certificate").expect("writing");
    hangup(gw.pid());
    eventually("the failed reload is counted", async || {
        metric(
            &gw.metrics().await,
            "hooklatch_tls_reloads_total{result=\"error\"}",
        ) >= 1.0
    })
    .await;
    assert!(
        gw.log().contains("TLS certificate not reloaded"),
        "{}",
        gw.log()
    );
    let again = trusting(&second, addr);
    let event = unique("evt_tls_kept");
    let body = stripe_invoice_paid(&event, 1400);
    assert_eq!(
        post(&again, port, &body).await.expect("HTTPS"),
        (200, "accepted".to_owned())
    );
    let metrics = gw.metrics().await;
    assert_eq!(
        metric(&metrics, "hooklatch_tls_reloads_total{result=\"ok\"}"),
        1.0,
        "{metrics}"
    );
}

/// Sends `SIGHUP` to `pid`.
fn hangup(pid: u32) {
    let status = std::process::Command::new("kill")
        .args(["-HUP", &pid.to_string()])
        .status()
        .expect("running kill");
    assert!(status.success(), "kill -HUP {pid}");
}

/// `hooklatch listen` to a gateway serving HTTPS on a private CA's certificate: refused
/// without `--ca-file` (it says why and keeps trying), connected with it, and an event sent
/// over HTTPS reaches the laptop's app once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_connects_to_an_https_gateway_trusting_its_ca() {
    use crate::listen::{options, Listener, LISTEN_TOKEN};
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let laptop = Handler::start(Behaviour::AlwaysOk).await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let ca = TestCa::new("gateway CA");
    install(dir.path(), &ca.server(&["localhost"]));
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).expect("writing the CA");
    let gw = Gateway::start_with(
        &app,
        Options {
            server_config: tls_lines(dir.path()),
            ..options(3)
        },
    )
    .await;
    let addr = gw.ingest().addr();
    let gateway = format!("https://localhost:{}", addr.port());

    let untrusting = Listener::start_at(&gateway, &[], LISTEN_TOKEN, &laptop.url());
    eventually("the listener says why it cannot connect", async || {
        untrusting.output().contains("certificate")
    })
    .await;
    drop(untrusting);

    let ca_arg = ca_file.display().to_string();
    let listener = Listener::start_at(
        &gateway,
        &["--ca-file", &ca_arg],
        LISTEN_TOKEN,
        &laptop.url(),
    );
    let event = unique("evt_listen_tls");
    let body = stripe_invoice_paid(&event, 900);
    let client = trusting(&ca, addr);
    eventually(
        "the event is accepted once the listener is connected",
        async || {
            let mut req = client
                .post(format!("https://localhost:{}/in/dev", addr.port()))
                .body(body.clone());
            for (name, value) in stripe_headers(&body) {
                req = req.header(name, value);
            }
            req.send().await.is_ok_and(|r| r.status() == 200)
        },
    )
    .await;
    wait_until("the laptop's app got the event", || {
        laptop.count_for(&format!("dev:{event}")) == 1
    })
    .await;
    assert!(
        !listener.output().contains("certificate"),
        "{}",
        listener.output()
    );
}

/// `admin_tls = true`: the admin listener serves the same certificate; the admin verbs reach
/// it over HTTPS with `--ca-file` (the default admin URL from the configuration is
/// `https://`), and plain HTTP there gets no answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_serves_tls_when_asked_and_the_admin_verbs_reach_it() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let ca = TestCa::new("admin CA");
    install(dir.path(), &ca.server(&["localhost", "127.0.0.1"]));
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, ca.pem()).expect("writing the CA");
    let (ingest, admin) = (crate::support::free_port(), crate::support::free_port());
    let config = dir.path().join("hooklatch.toml");
    std::fs::write(
        &config,
        format!(
            r#"[server]
listen = "127.0.0.1:{ingest}"
admin_listen = "127.0.0.1:{admin}"
admin_token = "a-token-long-enough-for-the-admin-api"
admin_tls = true
{tls}

[store]
url = "sqlite://{db}"
"#,
            tls = tls_lines(dir.path()),
            db = dir.path().join("hooklatch.db").display()
        ),
    )
    .expect("writing the config");
    let _serve = KilledOnDrop(
        std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"))
            .args(["serve", "--config"])
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starting hooklatch serve"),
    );
    let admin_verb = |ca: bool| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"));
        if ca {
            cmd.arg("--ca-file").arg(&ca_file);
        }
        cmd.args(["destinations", "list", "--config"])
            .arg(&config)
            .env_remove("HOOKLATCH_CA_FILE")
            .output()
            .expect("running hooklatch destinations list")
    };
    eventually("the admin API answers over HTTPS", async || {
        admin_verb(true).status.success()
    })
    .await;
    let untrusted = admin_verb(false);
    assert_eq!(untrusted.status.code(), Some(2));
    // It says the certificate is the trouble, not that nothing answers.
    let said = String::from_utf8_lossy(&untrusted.stderr);
    assert!(said.contains("--ca-file FILE names the CA"), "{said}");
    assert!(!said.contains("nothing answers there"), "{said}");
    let plain = reqwest::Client::new()
        .get(format!("http://127.0.0.1:{admin}/healthz"))
        .timeout(Duration::from_secs(10))
        .send()
        .await;
    assert!(
        plain.is_err(),
        "plain HTTP on the admin TLS port: {plain:?}"
    );
    let https = trusting(
        &ca,
        format!("127.0.0.1:{admin}").parse().expect("an address"),
    );
    eventually("the refused plain request is counted", async || {
        let Ok(res) = https
            .get(format!("https://localhost:{admin}/metrics"))
            .bearer_auth("a-token-long-enough-for-the-admin-api")
            .send()
            .await
        else {
            return false;
        };
        res.text().await.is_ok_and(|metrics| {
            metrics.contains("hooklatch_tls_handshake_failures_total{listener=\"admin\"}")
        })
    })
    .await;
}

/// A child process killed (and reaped) when dropped, however the test ends.
struct KilledOnDrop(std::process::Child);

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A certificate near its expiry: the gateway sets
/// `hooklatch_tls_certificate_expiry_timestamp_seconds` to its `notAfter` and warns at start;
/// a CA certificate loaded on `SIGHUP` is warned about; a renewal moves the gauge to the new
/// certificate's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_near_its_expiry_is_warned_about_and_its_expiry_is_a_metric() {
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let ca = TestCa::new("expiring CA");
    install(dir.path(), &ca.server_expiring_in(&["localhost"], 3));
    let gw = Gateway::start_with(
        &app,
        Options {
            server_config: tls_lines(dir.path()),
            log_level: "info",
            ..Options::default()
        },
    )
    .await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64();
    let expiry = gw
        .metric("hooklatch_tls_certificate_expiry_timestamp_seconds")
        .await;
    let days = (expiry - now) / 86_400.0;
    assert!((2.0..=4.0).contains(&days), "expires in {days} days");
    assert!(
        gw.log().contains("the TLS certificate expires soon"),
        "{}",
        gw.log_tail(20)
    );

    // A CA certificate served by mistake: loaded (OpenSSL clients take it), and warned about.
    install(dir.path(), &ca.itself());
    hangup(gw.pid());
    eventually(
        "a CA certificate as the server's is warned about",
        async || gw.log().contains("the TLS certificate is a CA certificate"),
    )
    .await;

    install(dir.path(), &ca.server_expiring_in(&["localhost"], 90));
    hangup(gw.pid());
    eventually(
        "the renewed certificate's expiry is the gauge's",
        async || {
            let expiry = gw
                .metric("hooklatch_tls_certificate_expiry_timestamp_seconds")
                .await;
            (expiry - now) / 86_400.0 > 80.0
        },
    )
    .await;
}
