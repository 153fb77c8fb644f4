//! The admin verbs (`events`, `dlq`, `destinations`) against something that is not a gateway's
//! admin API: an error and exit status 2, never an empty answer.

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
}

/// Runs `hooklatch ARGS --admin ADMIN` with the admin token: its exit status and standard
/// error.
fn run(args: &[&str], admin: &str) -> (Option<i32>, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(args)
        .args(["--admin", admin])
        .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("running hooklatch");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
