//! The web inspector in a real browser: headless Chromium driven through ChromeDriver (W3C
//! WebDriver over HTTP), against a real gateway.
//!
//! Proves that the page asks for the admin token and refuses a wrong one; lists the history;
//! shows a request's headers and body, a rejected request whose body is markup included, as
//! text (no element from it, no script run); retries a dead-lettered delivery, which then
//! reaches the handler; redelivers an event after a second click, with the same
//! `Idempotency-Key`; dismisses a conflict after a second click, with a reason; shows a banner
//! while a destination is disabled (by its 410) and enables it from the Destinations page;
//! and that the page's files carry a Content-Security-Policy.
//!
//! Needs `chromedriver` and `chromium` (Debian's `chromium-driver` and `chromium`; `.ci/run`
//! installs them). Without them the test prints `skipped:` and passes, except under CI, where
//! it fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::support::{
    free_port, stripe_headers, stripe_invoice_paid, unique, wait_until, Behaviour, Gateway,
    Handler, Options, ADMIN_TOKEN,
};

/// The W3C WebDriver key of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// How long the page may take to show something.
const PAGE_DEADLINE: Duration = Duration::from_secs(15);

/// A body that would run script if the page ever made it HTML.
const MARKUP: &str = r#"<img src=x onerror="window.__pwned=1;document.title='pwned'"><script>window.__pwned=2</script>"#;

fn which(env: &str, candidates: &[&str]) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(env) {
        return Some(PathBuf::from(path));
    }
    candidates.iter().map(PathBuf::from).find(|p| p.exists())
}

/// ChromeDriver and one headless Chromium session; both end when dropped.
struct Browser {
    driver: Child,
    base: String,
    session: String,
    http: reqwest::Client,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// `None` (after printing why) when ChromeDriver or Chromium is missing outside CI.
    async fn start() -> Option<Browser> {
        let driver_bin = which("HOOKLATCH_TEST_CHROMEDRIVER", &["/usr/bin/chromedriver"]);
        let chromium = which("HOOKLATCH_TEST_CHROMIUM", &["/usr/bin/chromium"]);
        let (Some(driver_bin), Some(chromium)) = (driver_bin, chromium) else {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI is set but chromedriver or chromium is missing: the browser test must run \
                 (apt-get install chromium chromium-driver)"
            );
            println!("skipped: install chromium and chromium-driver to run the browser test");
            return None;
        };
        let port = free_port();
        let driver = Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::new();
        let started = Instant::now();
        loop {
            let ready = http.get(format!("{base}/status")).send().await;
            if let Ok(res) = ready {
                let status: Value = res.json().await.unwrap_or_default();
                if status["value"]["ready"] == true {
                    break;
                }
            }
            assert!(
                started.elapsed() < PAGE_DEADLINE,
                "chromedriver did not start"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let profile = tempfile::tempdir().expect("a profile dir");
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu",
                    "--disable-dev-shm-usage", "--window-size=1280,900",
                    format!("--user-data-dir={}", profile.path().display())],
            },
        }}});
        let res: Value = http
            .post(format!("{base}/session"))
            .json(&caps)
            .send()
            .await
            .expect("creating a session")
            .json()
            .await
            .expect("a session");
        let session = res["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {res}"))
            .to_owned();
        Some(Browser {
            driver,
            base,
            session,
            http,
            _profile: profile,
        })
    }

    async fn command(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let url = format!("{}/session/{}{path}", self.base, self.session);
        let mut req = self.http.request(method, url);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let res: Value = req
            .send()
            .await
            .expect("a WebDriver command")
            .json()
            .await
            .expect("a WebDriver answer");
        if let Some(error) = res["value"]["error"].as_str() {
            panic!("WebDriver {path}: {error}: {}", res["value"]["message"]);
        }
        res["value"].clone()
    }

    async fn goto(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", Some(json!({ "url": url })))
            .await;
    }

    /// Runs `script` (a function body; `arguments` holds `args`) and returns its value.
    async fn eval(&self, script: &str, args: Value) -> Value {
        self.command(
            reqwest::Method::POST,
            "/execute/sync",
            Some(json!({ "script": script, "args": args })),
        )
        .await
    }

    /// Waits until `script` returns something truthy; returns it.
    async fn until(&self, what: &str, script: &str) -> Value {
        let started = Instant::now();
        loop {
            let value = self.eval(script, json!([])).await;
            let truthy = match &value {
                Value::Null | Value::Bool(false) => false,
                Value::String(s) => !s.is_empty(),
                Value::Number(n) => n.as_f64() != Some(0.0),
                _ => true,
            };
            if truthy {
                return value;
            }
            if started.elapsed() > PAGE_DEADLINE {
                let page = self.eval("return document.body.innerText", json!([])).await;
                panic!("the page did not show {what} within {PAGE_DEADLINE:?}; it shows:\n{page}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn element(&self, css: &str) -> String {
        let found = self
            .command(
                reqwest::Method::POST,
                "/element",
                Some(json!({ "using": "css selector", "value": css })),
            )
            .await;
        found[ELEMENT]
            .as_str()
            .unwrap_or_else(|| panic!("no element {css}: {found}"))
            .to_owned()
    }

    /// Clicks the element as a user would (WebDriver's click: scrolled into view, hit-tested).
    async fn click(&self, css: &str) {
        let id = self.element(css).await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{id}/click"),
            Some(json!({})),
        )
        .await;
    }

    async fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css).await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{id}/clear"),
            Some(json!({})),
        )
        .await;
        self.command(
            reqwest::Method::POST,
            &format!("/element/{id}/value"),
            Some(json!({ "text": text })),
        )
        .await;
    }

    /// Saves a screenshot when `HOOKLATCH_TEST_SCREENSHOTS` names a directory.
    async fn screenshot(&self, name: &str) {
        let Some(dir) = std::env::var_os("HOOKLATCH_TEST_SCREENSHOTS") else {
            return;
        };
        use base64::Engine as _;
        let png = self
            .command(reqwest::Method::GET, "/screenshot", None)
            .await;
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(png.as_str().unwrap_or_default())
            .expect("a base64 screenshot");
        std::fs::write(Path::new(&dir).join(format!("{name}.png")), bytes)
            .expect("writing a screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // Ending the session ends its Chromium; a killed driver would leave it running. A
        // blocking request: this runs outside the runtime's reach, panicking tests included.
        use std::io::{Read as _, Write as _};
        let addr = self.base.trim_start_matches("http://");
        if let Ok(mut conn) = std::net::TcpStream::connect(addr) {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(10)));
            let request = format!(
                "DELETE /session/{} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n",
                self.session
            );
            if conn.write_all(request.as_bytes()).is_ok() {
                let _ = conn.read_to_end(&mut Vec::new());
            }
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inspector_shows_history_as_text_and_retries_and_redelivers() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysFail).await;
    let gw = Gateway::start_with(
        &handler,
        Options {
            max_attempts: 1,
            ..Options::default()
        },
    )
    .await;

    // History: an accepted event (dead-lettered after its one attempt fails), its duplicate,
    // and a forged request whose body is markup.
    let event_id = unique("evt_inspector");
    let key = format!("stripe:{event_id}");
    let body = stripe_invoice_paid(&event_id, 5000);
    let headers = stripe_headers(&body);
    for expected in ["accepted", "duplicate"] {
        let (status, json) = gw.post("stripe", &headers, body.clone()).await;
        assert_eq!((status, json["status"].as_str()), (200, Some(expected)));
    }
    let forged = vec![
        ("content-type".to_owned(), "text/html".to_owned()),
        (
            "stripe-signature".to_owned(),
            format!(
                "t={},v1={}",
                hooklatch_core::Timestamp::now().as_secs(),
                "0".repeat(64)
            ),
        ),
    ];
    let (status, json) = gw.post("stripe", &forged, MARKUP.as_bytes().to_vec()).await;
    assert_eq!(
        (status, json["code"].as_str()),
        (401, Some("invalid_signature")),
        "{json}"
    );
    gw.wait_for_delivery_state(&key, "dead").await;
    let rows = gw.requests("").await;
    let id_of = |verdict: &str| {
        rows.iter()
            .find(|r| r["verdict"] == verdict)
            .and_then(|r| r["id"].as_str())
            .unwrap_or_else(|| panic!("no {verdict} request in {rows:?}"))
            .to_owned()
    };
    let (accepted, rejected) = (id_of("accepted"), id_of("rejected"));

    // The page's files carry the policy that keeps them to their own origin.
    let page = reqwest::get(format!("{}/ui/", gw.admin_url()))
        .await
        .expect("GET /ui/");
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(csp.contains("script-src 'self'"), "{csp}");
    assert!(!csp.contains("unsafe-inline"), "{csp}");

    // `/` leads to the page, which asks for the token and refuses a wrong one.
    browser.goto(&format!("{}/", gw.admin_url())).await;
    browser
        .until(
            "the token form",
            "return !document.getElementById('login').hidden",
        )
        .await;
    browser.type_into("#token", "not-the-admin-token").await;
    browser.click("#login-submit").await;
    browser
        .until(
            "the refusal",
            "return document.getElementById('login-error').textContent",
        )
        .await;
    browser.screenshot("1-refused").await;
    browser.type_into("#token", ADMIN_TOKEN).await;
    browser.click("#login-submit").await;
    let listed = browser
        .until(
            "three requests",
            "const rows = document.querySelectorAll('#request-rows tr');
             return rows.length === 3 && [...rows].map(r => r.dataset.id);",
        )
        .await;
    assert!(
        listed.as_array().unwrap().contains(&json!(rejected)),
        "{listed}"
    );
    let token_in_url = browser.eval("return location.href", json!([])).await;
    assert!(!token_in_url.to_string().contains(ADMIN_TOKEN));
    browser.screenshot("2-requests").await;

    // The forged request: its markup body is text on the page, and nothing of it ran.
    browser
        .click(&format!("#request-rows tr[data-id='{rejected}'] a"))
        .await;
    let shown = browser
        .until(
            "the rejected request's body",
            "return !document.getElementById('detail').hidden &&
                    document.getElementById('detail-body').textContent",
        )
        .await;
    assert_eq!(shown, json!(MARKUP), "the body, byte for byte, as text");
    let ran = browser
        .eval(
            "return [document.querySelectorAll('main img, main script').length,
                     window.__pwned === undefined, document.title]",
            json!([]),
        )
        .await;
    assert_eq!(ran, json!([0, true, "hooklatch inspector"]));
    let verdict = browser
        .eval(
            "return document.getElementById('detail-facts').textContent",
            json!([]),
        )
        .await;
    assert!(
        verdict.as_str().unwrap().contains("invalid_signature"),
        "{verdict}"
    );
    browser.screenshot("3-rejected").await;

    // The dead letter: retried from the page, the delivery reaches the handler.
    handler.set_behaviour(Behaviour::AlwaysOk);
    browser.goto(&format!("{}/ui/#/dead", gw.admin_url())).await;
    browser
        .until(
            "the dead-lettered delivery",
            "return document.querySelectorAll('#dead-rows button[data-retry]').length === 1",
        )
        .await;
    browser.screenshot("4-dead").await;
    browser.click("#dead-rows button[data-retry]").await;
    gw.wait_for_delivery_state(&key, "delivered").await;
    wait_until("the retried delivery reaches the handler with 200", || {
        handler.count_for(&key) == 2
    })
    .await;
    browser
        .until(
            "an empty dead letter",
            "return !document.getElementById('dead-empty').hidden",
        )
        .await;

    // The accepted event: headers shown, and a redelivery after the second click.
    browser
        .goto(&format!("{}/ui/#/requests/{accepted}", gw.admin_url()))
        .await;
    browser
        .until(
            "the accepted request's deliveries",
            "return document.querySelectorAll('#detail-deliveries .state-delivered').length === 1",
        )
        .await;
    let headers_shown = browser
        .eval(
            "return document.getElementById('detail-headers').textContent",
            json!([]),
        )
        .await;
    assert!(
        headers_shown.as_str().unwrap().contains("stripe-signature"),
        "{headers_shown}"
    );
    let raw = browser
        .eval(
            "document.getElementById('body-view').click();
             return document.getElementById('detail-body').textContent",
            json!([]),
        )
        .await;
    assert_eq!(
        raw.as_str().map(str::as_bytes),
        Some(body.as_slice()),
        "the raw view is the body as received"
    );
    browser.click("#redeliver").await;
    browser
        .until(
            "the armed button",
            "return document.getElementById('redeliver').dataset.armed === 'yes'",
        )
        .await;
    assert_eq!(handler.count_for(&key), 2, "one click redelivers nothing");
    browser.click("#redeliver").await;
    wait_until("the redelivery reaches the handler", || {
        handler.count_for(&key) == 3
    })
    .await;
    browser
        .until(
            "two deliveries on the page",
            "return document.querySelectorAll('#detail-deliveries .delivery').length === 2",
        )
        .await;
    browser.screenshot("5-redelivered").await;
    // Live: a request sent now appears on the list without a click.
    browser
        .goto(&format!("{}/ui/#/requests", gw.admin_url()))
        .await;
    browser
        .until(
            "the list",
            "return document.querySelectorAll('#request-rows tr').length === 3",
        )
        .await;
    let live_id = unique("evt_inspector_live");
    let live_body = stripe_invoice_paid(&live_id, 100);
    let (status, live) = gw
        .post("stripe", &stripe_headers(&live_body), live_body)
        .await;
    assert_eq!(status, 200);
    let live_request = live["request_id"]
        .as_str()
        .expect("a request id")
        .to_owned();
    browser
        .until(
            "the new request at the top, without a click",
            &format!(
                "const first = document.querySelector('#request-rows tr');
                 return first && first.dataset.id === '{live_request}'"
            ),
        )
        .await;
    let keys: Vec<_> = handler
        .received_for(&key)
        .iter()
        .map(|r| r.header("idempotency-key").to_owned())
        .collect();
    assert!(keys.iter().all(|k| *k == key), "{keys:?}");

    // A conflict, dismissed from its page after a second click, with a reason.
    let altered = stripe_invoice_paid(&event_id, 6000);
    let (status, json) = gw.post("stripe", &stripe_headers(&altered), altered).await;
    assert_eq!((status, json["status"].as_str()), (200, Some("conflict")));
    let conflict = json["request_id"].as_str().expect("its id").to_owned();
    browser
        .goto(&format!("{}/ui/#/requests/{conflict}", gw.admin_url()))
        .await;
    browser
        .until(
            "the conflict's Dismiss",
            "return !document.getElementById('dismiss-box').hidden",
        )
        .await;
    browser.type_into("#dismiss-reason", "a test resend").await;
    browser.click("#dismiss").await;
    browser
        .until(
            "the armed Dismiss",
            "return document.getElementById('dismiss').dataset.armed === 'yes'",
        )
        .await;
    let (_, shown) = gw.admin_get(&format!("/v1/requests/{conflict}")).await;
    assert!(
        shown["decision"].is_null(),
        "one click dismisses nothing: {shown}"
    );
    browser.click("#dismiss").await;
    browser
        .until(
            "the decision on the page",
            "return document.getElementById('detail-facts').textContent.includes('dismissed at')",
        )
        .await;
    let (_, shown) = gw.admin_get(&format!("/v1/requests/{conflict}")).await;
    assert_eq!(shown["decision"]["action"], "dismissed", "{shown}");
    assert_eq!(shown["decision"]["reason"], "a test resend", "{shown}");
    let hidden = browser
        .eval(
            "return [document.getElementById('redeliver').hidden,
                     document.getElementById('dismiss-box').hidden]",
            json!([]),
        )
        .await;
    assert_eq!(
        hidden,
        json!([true, true]),
        "no release, no second dismissal"
    );
    browser.screenshot("6-dismissed").await;

    // A destination disabled by its 410: a banner on the list, enabled from its page, and
    // what waited goes out — the event the 410 answered too, though its one attempt is used.
    handler.set_behaviour(Behaviour::Gone);
    let gone = gw.send_stripe_event("stripe", "evt_inspector_gone").await;
    crate::support::eventually("the 410 recorded", async || {
        gw.deliveries_for(&gone)
            .await
            .first()
            .is_some_and(|row| row["attempts"] == 1 && row["state"] == "pending")
    })
    .await;
    let held = gw.send_stripe_event("stripe", "evt_inspector_held").await;
    handler.set_behaviour(Behaviour::AlwaysOk);
    browser
        .goto(&format!("{}/ui/#/requests", gw.admin_url()))
        .await;
    let banner = browser
        .until(
            "the disabled destination's banner",
            "const b = document.getElementById('disabled-banner');
             return !b.hidden && b.textContent",
        )
        .await;
    assert!(
        banner
            .as_str()
            .unwrap()
            .contains("Destination app is disabled since"),
        "{banner}"
    );
    browser
        .goto(&format!("{}/ui/#/destinations", gw.admin_url()))
        .await;
    browser
        .until(
            "the Enable button",
            "return document.querySelector('#destination-rows button[data-action=enable]')",
        )
        .await;
    browser.screenshot("7-destinations").await;
    assert_eq!(handler.count_for(&held), 0, "held while disabled");
    browser
        .click("#destination-rows button[data-action=enable]")
        .await;
    browser
        .until(
            "the enable's answer",
            "return document.getElementById('destinations-result').textContent.includes('app enabled')",
        )
        .await;
    gw.wait_for_delivery_state(&held, "delivered").await;
    assert_eq!(handler.count_for(&held), 1);
    gw.wait_for_delivery_state(&gone, "delivered").await;
    assert_eq!(handler.count_for(&gone), 2, "the 410, then the delivery");
    browser
        .until(
            "no banner",
            "return document.getElementById('disabled-banner').hidden",
        )
        .await;
}
