//! The admin verbs (`events`, `dlq`, `destinations`) and `migrate`: against something that is
//! not a gateway's admin API, an error and exit status 2, never an empty answer; with
//! `--config`, only the secrets they use are read.

use std::process::Command;

use crate::support::{Behaviour, Gateway, Handler, ADMIN_TOKEN};

/// `--admin` pointed at the ingest listener (an easy slip: the two ports sit side by side)
/// answers every admin route with 404. Read as "nothing there", `dlq list` reported an empty
/// dead-letter with exit status 0; each verb now names the mistake and fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_verbs_pointed_at_the_ingest_listener_fail_and_say_so() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let ingest = gw.ingest_url();
    let verbs: [&[&str]; 5] = [
        &["dlq", "list"],
        &["events", "list"],
        &["events", "export"],
        &["destinations", "list"],
        &["dlq", "retry", "--all"],
    ];
    for verb in verbs {
        let (code, stderr) = run(verb, &ingest);
        assert_eq!(code, Some(2), "{verb:?}: {stderr}");
        assert!(
            stderr.contains("is --admin the gateway's admin listener"),
            "{verb:?}: {stderr}"
        );
    }
    // The admin listener itself still answers "nothing there" for an empty dead-letter.
    let (code, stderr) = run(&["dlq", "list"], &gw.admin_url());
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stderr.contains("0 dead-lettered deliveries"), "{stderr}");
    // Nothing listening at all: the error says what to check.
    let (code, stderr) = run(&["dlq", "list"], "http://127.0.0.1:9");
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("nothing answers there: is the gateway running"),
        "{stderr}"
    );
    // A destination that is not there is said to be missing, not the address wrong: the
    // gateway's "no" (exit status 1), as for any verb about something that is not there.
    for verb in ["disable", "enable"] {
        let (code, stderr) = run(&["destinations", verb, "nope"], &gw.admin_url());
        assert_eq!(code, Some(1), "{verb}: {stderr}");
        assert!(
            stderr.contains("destination \"nope\" not found on the gateway"),
            "{verb}: {stderr}"
        );
    }
    // A delivery or request that is not there is named once.
    let missing: [(&[&str], &str); 3] = [
        (
            &["dlq", "retry", "dlv_999"],
            "dlv_999 not found on the gateway",
        ),
        (
            &["events", "redeliver", "req_999"],
            "req_999 not found on the gateway",
        ),
        (
            &["events", "dismiss", "req_999", "--reason", "test"],
            "req_999 not found on the gateway",
        ),
    ];
    for (verb, said) in missing {
        let (code, stderr) = run(verb, &gw.admin_url());
        assert_eq!(code, Some(1), "{verb:?}: {stderr}");
        assert_eq!(stderr.trim_end(), said, "{verb:?}");
    }
    // Nothing to ask: 2, not a refusal.
    let (code, stderr) = run(&["dlq", "retry", "dlv_1"], "http://127.0.0.1:9");
    assert_eq!(code, Some(2), "{stderr}");

    // Something that answers 200 to anything (a proxy's login page, another service) is
    // not an empty history nor a done retry; a password in --admin is never shown.
    let anything = handler.url().trim_end_matches("/webhooks").to_owned();
    let verbs: [&[&str]; 4] = [
        &["events", "list"],
        &["dlq", "retry", "dlv_1"],
        &["events", "redeliver", "req_1"],
        &["destinations", "disable", "app"],
    ];
    for verb in verbs {
        let (code, stderr) = run(verb, &anything);
        assert_eq!(code, Some(2), "{verb:?}: {stderr}");
        assert!(
            stderr.contains("as hooklatch's admin API"),
            "{verb:?}: {stderr}"
        );
    }
    let with_password = "http://operator:pa55-in-url@127.0.0.1:9";
    let (code, stderr) = run(&["events", "list"], with_password);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(!stderr.contains("pa55-in-url"), "{stderr}");
    assert!(stderr.contains("operator:***@127.0.0.1:9"), "{stderr}");

    // The gateway's "no": 1 — an export of a request that is not there, a destination the
    // request's source does not have; a --limit of 0 is no listing at all (2).
    let (code, stderr) = run(&["events", "export", "req_999"], &gw.admin_url());
    assert_eq!(code, Some(1), "{stderr}");
    assert_eq!(stderr.trim_end(), "req_999 not found on the gateway");
    let request = gw.send_stripe_event("stripe", "evt_admin_cli").await;
    let id = gw.requests("verdict=accepted").await[0]["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let (code, stderr) = run(
        &["events", "redeliver", &id, "--destination", "nope"],
        &gw.admin_url(),
    );
    assert_eq!(code, Some(1), "{request}: {stderr}");
    let (code, stderr) = run(&["events", "list", "--limit", "0"], &gw.admin_url());
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("must be at least 1"), "{stderr}");

    // A reason someone wrote with terminal escapes in it is shown escaped, never run.
    let res = reqwest::Client::new()
        .post(format!("{}/v1/destinations/app/disable", gw.admin_url()))
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({ "reason": "maint\u{1b}]0;pwned\u{7}\u{1b}[2J" }))
        .send()
        .await
        .expect("disabling the destination");
    assert_eq!(res.status().as_u16(), 200);
    let out = crate::support::hooklatch_output(&["destinations", "list"], &gw.admin_url());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains('\u{1b}') && !stdout.contains('\u{7}'),
        "{stdout:?}"
    );
    assert!(stdout.contains("maint\\u{1b}]0;pwned\\u{7}"), "{stdout}");
}

/// Runs `hooklatch ARGS --admin ADMIN` with the admin token: its exit status and standard
/// error.
fn run(args: &[&str], admin: &str) -> (Option<i32>, String) {
    let out = crate::support::hooklatch_output(args, admin);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `migrate` reads `[store]` alone, and an admin verb given `--token` (`events export` too,
/// which reads the sources' providers) reads no secret of the file: the signing secrets and the admin token, set in the gateway's environment, need not
/// be set where an operator migrates or lists the dead-letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_and_admin_verbs_need_no_secret_they_do_not_use() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("migrated.db");
    let admin = gw.admin_url();
    let config = dir.path().join("hooklatch.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[server]
admin_listen = "{}"
admin_token = "env:HOOKLATCH_TEST_UNSET_ADMIN_TOKEN"

[store]
url = "sqlite://{}"

[[sources]]
name = "stripe"
provider = "stripe"
secrets = ["env:HOOKLATCH_TEST_UNSET_STRIPE_SECRET"]
"#,
            admin.trim_start_matches("http://"),
            db.display()
        ),
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let hooklatch = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_hooklatch"))
            .args(args)
            .env_remove("HOOKLATCH_ADMIN_TOKEN")
            .output()
            .expect("running hooklatch")
    };
    let out = hooklatch(&["migrate", "--config", config]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(db.exists(), "migrate made the store");
    // It says which store and what it did: made it, then found it up to date.
    let said = String::from_utf8_lossy(&out.stdout).into_owned();
    let made = format!("sqlite {}: created, schema version ", db.display());
    assert!(said.starts_with(&made), "{said}");
    let version = said[made.len()..].trim().to_owned();
    let out = hooklatch(&["migrate", "--config", config]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!(
            "sqlite {}: up to date, schema version {version}",
            db.display()
        )
    );
    let out = hooklatch(&["dlq", "list", "--config", config, "--token", ADMIN_TOKEN]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("0 dead-lettered deliveries"), "{stderr}");
    // An export reads the sources' providers from the file, not their secrets.
    let key = gw.send_stripe_event("stripe", "evt_export_").await;
    let out = hooklatch(&[
        "events",
        "export",
        "--config",
        config,
        "--token",
        ADMIN_TOKEN,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("exported 1 capture"), "{stderr}");
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).expect("an export");
    let capture = &doc["captures"][0];
    assert_eq!(capture["provider"], "stripe", "{doc}");
    assert!(
        capture["keys"][0]
            .as_str()
            .is_some_and(|k| key.ends_with(k)),
        "{doc}"
    );
    assert!(
        !capture["headers"]
            .to_string()
            .to_ascii_lowercase()
            .contains("stripe-signature"),
        "{doc}"
    );
    // Without --token the file's token is read, and its absence is the error.
    let out = hooklatch(&["dlq", "list", "--config", config]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("HOOKLATCH_TEST_UNSET_ADMIN_TOKEN is not set"),
        "{stderr}"
    );
}

/// Output into a pipe whose reader is gone (`hooklatch send --list | head -1` once `head` has
/// its line) ends the process quietly with SIGPIPE's status, 141, not with a panic.
#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let out = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(["send", "--list"])
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("running hooklatch");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
}
