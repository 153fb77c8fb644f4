//! T5, power loss (RELIABILITY.md): the gateway's SQLite store on a file system that loses
//! every write not fsynced when the power goes (`hooklatch_testkit::lazyfs`, FUSE, what LazyFS
//! does for Jepsen). kill -9 alone cannot show a wrong fsync policy: the kernel still writes
//! its page cache out. Here, after each cut, the disk holds only what was fsynced.
//!
//! A burst of distinct events from 16 senders; after a number of 2xx drawn from the card's
//! seed the gateway is killed, the power cut and the file system served again; the gateway
//! starts on what the disk kept, and every event acknowledged before the cut, sent again as
//! its provider would, must be answered `duplicate` — `accepted` would mean the store forgot
//! an event it had acknowledged. Three cuts on one store, then every acknowledged event must
//! reach the application. The control runs the same with every fsync acknowledged and
//! ignored: it must lose acknowledged events, or this test could not see a loss at all.
//!
//! Needs `/dev/fuse` and root (the mount goes without `fusermount`); prints `skipped:` otherwise,
//! under `CI` too (nothing `.ci/run` installs can give a machine FUSE).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hooklatch_testkit::lazyfs::{available, Fsync, LazyFs};
use tokio::task::JoinSet;

use crate::report::{draw, scaled, Card};
use crate::support::{
    stripe_headers, stripe_invoice_paid, unique, wait_until_within, Behaviour, Gateway, Handler,
    Options,
};

const SENDERS: usize = 16;
const EVENTS_PER_CUT: usize = 300;
const CUTS: usize = 3;

/// A lazy file system over a backing directory, both in a temp dir; `None` (the test skips)
/// where it cannot be mounted, outside CI.
fn mounted(fsync: Fsync) -> Option<(tempfile::TempDir, LazyFs)> {
    // Not asserted under CI: a machine without FUSE cannot be given it by `.ci/run`. Where it
    // is there, a mount that fails fails the test.
    if let Err(why) = available() {
        println!("skipped: the lazy file system needs /dev/fuse and root ({why})");
        return None;
    }
    let dir = tempfile::tempdir().expect("a temp dir");
    let (backing, mnt) = (dir.path().join("disk"), dir.path().join("mnt"));
    std::fs::create_dir_all(&backing).expect("the backing directory");
    std::fs::create_dir_all(&mnt).expect("the mount point");
    let fs = LazyFs::mount(&backing, &mnt, fsync).expect("mounting the lazy file system");
    Some((dir, fs))
}

/// What the cuts left.
struct Cuts {
    /// Events answered 2xx `accepted` before a cut.
    acked: Vec<String>,
    /// Of those, the ones a retry after the cut found missing (answered `accepted`).
    lost: Vec<String>,
    /// Pages the cuts dropped, by file.
    dropped: std::collections::BTreeMap<String, usize>,
}

/// Runs `cuts` bursts on one gateway over `fs`, each ended by kill -9 and a power cut after a
/// number of acknowledgements drawn from `seed`.
async fn power_cuts(gw: &mut Gateway, fs: &mut LazyFs, seed: u64, cuts: usize) -> Cuts {
    let mut result = Cuts {
        acked: Vec::new(),
        lost: Vec::new(),
        dropped: Default::default(),
    };
    let events = scaled(EVENTS_PER_CUT);
    for cut in 0..cuts {
        let run = unique(&format!("evt_power_{cut}"));
        let ids: Arc<Vec<String>> =
            Arc::new((0..events).map(|i| format!("{run}_{i:04}")).collect());
        // Killed after a third to two thirds of the burst is acknowledged.
        let kill_after = events / 3 + draw(seed, cut as u64, (events / 3) as u64) as usize;
        let acked = burst(gw, &ids, kill_after).await;
        gw.kill9();
        for (file, pages) in fs.power_cut().by_file {
            *result.dropped.entry(file).or_default() += pages;
        }
        fs.mount_again().expect("serving the disk again");
        gw.restart().await;

        for id in &acked {
            let body = stripe_invoice_paid(id, 5000);
            let (status, json) = gw.post("stripe", &stripe_headers(&body), body).await;
            assert_eq!(status, 200, "{id}: {json}");
            if json["status"] == "accepted" {
                result.lost.push(id.clone());
            }
        }
        result.acked.extend(acked);
    }
    result
}

/// Sends every event in `ids` once from 16 senders and kills the gateway as the
/// `kill_after`th is acknowledged; returns the ids answered `accepted`.
async fn burst(gw: &Gateway, ids: &Arc<Vec<String>>, kill_after: usize) -> Vec<String> {
    let next = Arc::new(AtomicUsize::new(0));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let kill_switch = gw.kill_switch();
    let mut senders = JoinSet::new();
    for _ in 0..SENDERS {
        let (ingest, ids, next, acked, kill_switch) = (
            gw.ingest(),
            ids.clone(),
            next.clone(),
            acked.clone(),
            kill_switch.clone(),
        );
        senders.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(id) = ids.get(i) else { return };
                let body = stripe_invoice_paid(id, 5000);
                // A transport error (the gateway died) is not an acknowledgement.
                let Ok((status, json)) = ingest
                    .try_post("stripe", &stripe_headers(&body), body)
                    .await
                else {
                    continue;
                };
                if status == 200 && json["status"] == "accepted" {
                    let mut acked = acked.lock().expect("acked lock");
                    acked.push(id.clone());
                    if acked.len() == kill_after {
                        kill_switch.fire();
                    }
                }
            }
        });
    }
    senders.join_all().await;
    Arc::try_unwrap(acked)
        .map(|m| m.into_inner().expect("acked lock"))
        .unwrap_or_else(|shared| shared.lock().expect("acked lock").clone())
}

fn options(fs: &LazyFs) -> Options {
    Options {
        store_url: Some(format!(
            "sqlite://{}",
            fs.path().join("hooklatch.db").display()
        )),
        ..Options::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_acknowledged_before_a_power_cut_is_kept_through_it() {
    let mut card = Card::new("T5", "sqlite");
    let seed = card.seed();
    let Some((_dir, mut fs)) = mounted(Fsync::Honoured) else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start_with(&handler, options(&fs)).await;
    let cuts = scaled(CUTS);
    let result = power_cuts(&mut gw, &mut fs, seed, cuts).await;
    card.count("ops", cuts * scaled(EVENTS_PER_CUT))
        .count("acked", result.acked.len())
        .count("lost", result.lost.len())
        .fault("power_cut", cuts)
        .figure("pages_dropped", serde_json::json!(result.dropped))
        .figure("fsyncs", fs.fsyncs());
    assert!(
        result.lost.is_empty(),
        "{} of {} acknowledged events forgotten after a power cut: {:?}",
        result.lost.len(),
        result.acked.len(),
        &result.lost[..result.lost.len().min(10)]
    );
    // A cut that lands between two commits drops only the shared-memory index (which SQLite
    // rebuilds); one inside a commit drops WAL frames written and not yet fsynced. Which one a
    // cut gets is the kill's timing, so only "something was dropped" is asserted.
    assert!(
        !result.dropped.is_empty(),
        "the cuts dropped nothing: they came when nothing was in flight"
    );
    wait_until_within(
        "every acknowledged event delivered",
        std::time::Duration::from_secs(60),
        || {
            let seen = handler.distinct_keys();
            result
                .acked
                .iter()
                .all(|id| seen.contains(&format!("stripe:{id}")))
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fsyncs_ignored_the_power_cut_test_sees_acknowledged_events_lost() {
    let mut card = Card::new("T5", "sqlite-fsync-ignored");
    let seed = card.seed();
    let Some((_dir, mut fs)) = mounted(Fsync::Ignored) else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start_with(&handler, options(&fs)).await;
    let result = power_cuts(&mut gw, &mut fs, seed, 1).await;
    card.count("ops", scaled(EVENTS_PER_CUT))
        .count("acked", result.acked.len())
        .count("lost", result.lost.len())
        .fault("power_cut", 1)
        .figure("control", true);
    assert!(
        !result.lost.is_empty(),
        "with every fsync ignored, a power cut lost none of {} acknowledged events: the test is \
         blind",
        result.acked.len()
    );
}
