//! `hooklatch check-config --connect` against real services: the store and the key store must
//! answer as `serve` needs them (exit status 1 otherwise), a destination that does not answer
//! is a warning, and nothing is changed — a fresh PostgreSQL database is left without tables,
//! a SQLite file is not created.

use std::process::Command;

use crate::support::{Behaviour, Handler, ADMIN_TOKEN};
use crate::test_database::TestDatabase;

/// Runs `check-config --connect` on a config of one Stripe source delivering to `destinations`
/// (TOML `[[destinations]]` tables) over `store` (the `[store]` table's lines); its exit status
/// and output.
fn check(store: &str, destinations: &str, names: &[&str]) -> (Option<i32>, String) {
    check_with(store, destinations, names, &[])
}

/// [`check`] with `env` set for it.
fn check_with(
    store: &str,
    destinations: &str,
    names: &[&str],
    env: &[(&str, &str)],
) -> (Option<i32>, String) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("hooklatch.toml");
    let names: Vec<String> = names.iter().map(|n| format!("\"{n}\"")).collect();
    let config = format!(
        "[store]\n{store}\n\n[[sources]]\nname = \"stripe\"\nprovider = \"stripe\"\n\
         secrets = [\"whsec_check\"]\ndestinations = [{}]\n\n{destinations}",
        names.join(", ")
    );
    std::fs::write(&path, config).expect("writing the config");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_hooklatch"));
    for (name, _) in std::env::vars_os() {
        if name.to_string_lossy().starts_with("HOOKLATCH_") {
            cmd.env_remove(name);
        }
    }
    let out = cmd
        .args(["check-config", "--connect", "--config"])
        .arg(&path)
        .current_dir(dir.path())
        .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
        .envs(env.iter().copied())
        .output()
        .expect("running hooklatch check-config");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), said)
}

/// A destination nothing answers at: a warning, never a failure.
const DOWN: &str =
    "[[destinations]]\nname = \"down\"\nurl = \"http://127.0.0.1:9/x\"\nallow = [\"127.0.0.1\"]\n";

/// The line about `what`, which must be there.
fn line<'a>(said: &'a str, what: &str) -> &'a str {
    said.lines()
        .find(|l| {
            l.get(5..)
                .is_some_and(|rest| rest.starts_with(&format!("{what} ")))
        })
        .unwrap_or_else(|| panic!("no line about {what}:\n{said}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sqlite_the_store_and_each_destination_are_checked_and_nothing_is_made() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let db = dir.path().join("hooklatch.db");
    let destinations = format!(
        "[[destinations]]\nname = \"app\"\nurl = \"{}\"\nallow = [\"127.0.0.1\"]\n\n\
         [[destinations]]\nname = \"down\"\nurl = \"http://127.0.0.1:9/x\"\nallow = [\"127.0.0.1\"]\n\n\
         [[destinations]]\nname = \"mq\"\namqp = \"amqp://guest:guest@127.0.0.1:9/%2f\"\n\
         exchange = \"x\"\nrouting_key = \"k\"\n",
        handler.url()
    );
    let store = format!("url = \"sqlite://{}\"", db.display());
    let (code, said) = check(&store, &destinations, &["app", "down", "mq"]);
    assert_eq!(code, Some(0), "{said}");
    assert!(line(&said, "store").starts_with("ok   "), "{said}");
    assert!(
        line(&said, "store").contains("no file yet: serve creates it"),
        "{said}"
    );
    assert!(!db.exists(), "check-config made the SQLite file");
    assert!(line(&said, "app").starts_with("ok   "), "{said}");
    assert!(line(&said, "app").contains("answers (HTTP "), "{said}");
    // A HEAD, not a delivery: no key, no body.
    let received = handler.received();
    assert_eq!(received.len(), 1, "one contact");
    assert!(
        received[0].key.is_none() && received[0].body.is_empty(),
        "a HEAD carries nothing to deliver"
    );
    assert!(line(&said, "down").starts_with("warn "), "{said}");
    assert!(line(&said, "mq").starts_with("warn "), "{said}");
    assert!(!said.contains("guest:guest"), "no password shown: {said}");

    // A file a gateway serves now: a warning naming it (a second serve would not start).
    let gateway = crate::support::Gateway::start(&handler).await;
    let store = format!("url = \"sqlite://{}\"", gateway.database_path().display());
    let (code, said) = check(&store, DOWN, &["down"]);
    assert_eq!(code, Some(0), "{said}");
    let served = line(&said, "store");
    assert!(served.starts_with("warn "), "{said}");
    assert!(
        served.contains(&format!("served now by process {}", gateway.pid())),
        "{said}"
    );

    // A directory that is not there: serve could not make the file.
    let store = "url = \"sqlite:///nonexistent-dir-for-hooklatch/h.db\"";
    let (code, said) = check(store, DOWN, &["down"]);
    assert_eq!(code, Some(1), "{said}");
    assert!(line(&said, "store").starts_with("FAIL "), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_the_store_is_read_not_migrated_and_one_that_does_not_answer_fails() {
    let Some(db) = TestDatabase::create("hl_check_config").await else {
        return;
    };
    let store = format!("url = \"{}\"", db.url());
    let (code, said) = check(&store, DOWN, &["down"]);
    assert_eq!(code, Some(0), "{said}");
    let store_line = line(&said, "store");
    assert!(store_line.starts_with("ok   "), "{said}");
    assert!(store_line.contains("durability settings safe"), "{said}");
    assert!(store_line.contains("schema none yet"), "{said}");
    // Read, not migrated: the database still has no table of hooklatch's.
    let (code, said) = check(&store, DOWN, &["down"]);
    assert!(
        line(&said, "store").contains("schema none yet"),
        "{code:?} {said}"
    );

    let (code, said) = check(
        "url = \"postgres://postgres@127.0.0.1:9/nothing\"",
        DOWN,
        &["down"],
    );
    assert_eq!(code, Some(1), "{said}");
    assert!(line(&said, "store").starts_with("FAIL "), "{said}");

    // Settings that can lose acknowledged events (here the gateway's own connections', set
    // through the URL): a failure naming the setting and the way out, as serve refuses them;
    // a warning with serve's --allow-unsafe-durability (here its variable), as serve warns.
    let unsafe_store = format!(
        "url = \"{}?options=-c%20synchronous_commit%3Doff\"",
        db.url()
    );
    let (code, said) = check(&unsafe_store, "", &[]);
    assert_eq!(code, Some(1), "{said}");
    let store_line = line(&said, "store");
    assert!(store_line.starts_with("FAIL "), "{said}");
    assert!(store_line.contains("synchronous_commit=off"), "{said}");
    assert!(
        store_line.contains("check-config takes the same flag"),
        "{said}"
    );
    let allow = [("HOOKLATCH_ALLOW_UNSAFE_DURABILITY", "true")];
    let (code, said) = check_with(&unsafe_store, "", &[], &allow);
    assert_eq!(code, Some(0), "{said}");
    let store_line = line(&said, "store");
    assert!(store_line.starts_with("warn "), "{said}");
    assert!(
        store_line.contains("UNSAFE, allowed (synchronous_commit=off)"),
        "{said}"
    );
    db.drop_now().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_store_must_answer() {
    let Ok(url) = std::env::var("HOOKLATCH_TEST_REDIS_URL") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but HOOKLATCH_TEST_REDIS_URL is not: the Redis tests must run"
        );
        println!("skipped: set HOOKLATCH_TEST_REDIS_URL to run the Redis key store tests");
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let sqlite = format!("url = \"sqlite://{}/h.db\"", dir.path().display());
    let (code, said) = check(&format!("{sqlite}\nkeys = \"{url}\""), DOWN, &["down"]);
    assert_eq!(code, Some(0), "{said}");
    // "warn" when the server's settings can forget keys (serve warns of those too).
    let keys = line(&said, "keys");
    assert!(keys.contains(": answers"), "{said}");
    assert!(!keys.starts_with("FAIL"), "{said}");
    let (code, said) = check(
        &format!("{sqlite}\nkeys = \"redis://127.0.0.1:9\""),
        DOWN,
        &["down"],
    );
    assert_eq!(code, Some(1), "{said}");
    assert!(line(&said, "keys").starts_with("FAIL "), "{said}");
}
