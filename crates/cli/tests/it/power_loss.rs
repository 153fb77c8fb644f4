//! T5, power loss (RELIABILITY.md): the gateway's store on a file system that loses every
//! write not fsynced when the power goes (`hooklatch_testkit::lazyfs`, FUSE, what LazyFS does
//! for Jepsen) — the SQLite file, or a private PostgreSQL server's data directory. kill -9 alone
//! cannot show a wrong fsync policy: the kernel still writes its page cache out. Here, after
//! each cut, the disk holds only what was fsynced.
//!
//! A burst of distinct events from 16 senders; after a number of 2xx drawn from the card's
//! seed the gateway (and PostgreSQL) are killed, the power cut and the file system served
//! again; the store starts on what the disk kept, and every event acknowledged before the cut,
//! sent again as its provider would, must be answered `duplicate` — `accepted` would mean the
//! store forgot an event it had acknowledged. Three cuts on one store. Each store has a
//! control that must lose acknowledged events, or the test could not see a loss at all:
//! SQLite's with every fsync acknowledged and ignored, PostgreSQL's with
//! `synchronous_commit=off`.
//!
//! Needs `/dev/fuse` and root (the mount goes without `fusermount`), and for PostgreSQL its
//! programs and its `postgres` user; prints `skipped:` otherwise, under `CI` too (nothing
//! `.ci/run` installs can give a machine FUSE).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use hooklatch_testkit::lazyfs::{Fsync, LazyFs};
use tokio::task::JoinSet;

use crate::report::{draw, scaled, Card};
use crate::support::{
    kill_process_group, lazy_mount, stripe_headers, stripe_invoice_paid, system_user, unique,
    wait_until_within, Behaviour, Gateway, Handler, Options,
};

const SENDERS: usize = 16;
const EVENTS_PER_CUT: usize = 300;
const CUTS: usize = 3;

/// What the cuts left.
struct Cuts {
    /// Events answered 2xx `accepted` before a cut.
    acked: Vec<String>,
    /// Of those, the ones a retry after the cut found missing (answered `accepted`).
    lost: Vec<String>,
    /// Pages the cuts dropped, by file.
    dropped: std::collections::BTreeMap<String, usize>,
}

impl Cuts {
    /// Puts the cuts' counts and figures on the card.
    fn record(&self, card: &mut Card, cuts: usize, fs: &LazyFs) {
        card.count("ops", cuts * scaled(EVENTS_PER_CUT))
            .count("acked", self.acked.len())
            .count("lost", self.lost.len())
            .fault("power_cut", cuts)
            .figure("pages_dropped", serde_json::json!(self.dropped))
            .figure("fsyncs", fs.fsyncs());
    }

    /// What the store kept goes out: every acknowledged event it did not lose reaches the
    /// application.
    async fn wait_until_kept_are_delivered(&self, handler: &Handler) {
        wait_until_within(
            "every acknowledged event kept is delivered",
            std::time::Duration::from_secs(60),
            || {
                let seen = handler.distinct_keys();
                self.acked
                    .iter()
                    .filter(|id| !self.lost.contains(id))
                    .all(|id| seen.contains(&format!("stripe:{id}")))
            },
        )
        .await;
    }
}

/// Runs `cuts` bursts on one gateway over `fs`, each ended by kill -9 and a power cut after a
/// number of acknowledgements drawn from `seed`.
async fn power_cuts(
    gw: &mut Gateway,
    fs: &mut LazyFs,
    mut postgres: Option<&mut PrivatePostgres>,
    seed: u64,
    cuts: usize,
) -> Cuts {
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
        if let Some(pg) = postgres.as_deref_mut() {
            pg.kill9();
        }
        for (file, pages) in fs.power_cut().by_file {
            // PostgreSQL's files by kind: `base/…`, `pg_wal/…`, `global/…`.
            let kind = file.split('/').take(2).collect::<Vec<_>>().join("/");
            *result.dropped.entry(kind).or_default() += pages;
        }
        fs.mount_again().expect("serving the disk again");
        if let Some(pg) = postgres.as_deref_mut() {
            pg.start().await;
        }
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

/// A gateway whose SQLite file is on a lazy file system (`fsync` says what its fsyncs do), put
/// through `cuts` power cuts; what the store kept is delivered before it returns.
async fn sqlite_power_cuts(card: &mut Card, fsync: Fsync, cuts: usize) -> Option<Cuts> {
    let seed = card.seed();
    let (_dir, mut fs) = lazy_mount(fsync)?;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let options = Options {
        store_url: Some(format!(
            "sqlite://{}",
            fs.path().join("hooklatch.db").display()
        )),
        ..Options::default()
    };
    let mut gw = Gateway::start_with(&handler, options).await;
    let result = power_cuts(&mut gw, &mut fs, None, seed, cuts).await;
    result.wait_until_kept_are_delivered(&handler).await;
    result.record(card, cuts, &fs);
    drop(gw);
    Some(result)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_acknowledged_before_a_power_cut_is_kept_through_it() {
    let mut card = Card::new("T5", "sqlite");
    let Some(result) = sqlite_power_cuts(&mut card, Fsync::Honoured, scaled(CUTS)).await else {
        return;
    };
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
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_fsyncs_ignored_the_power_cut_test_sees_acknowledged_events_lost() {
    let mut card = Card::new("T5", "sqlite-fsync-ignored");
    let Some(result) = sqlite_power_cuts(&mut card, Fsync::Ignored, 1).await else {
        return;
    };
    card.figure("control", true);
    assert!(
        !result.lost.is_empty(),
        "with every fsync ignored, a power cut lost none of {} acknowledged events: the test is \
         blind",
        result.acked.len()
    );
}

/// A PostgreSQL server of the test's own, its data directory on the lazy file system, run as
/// the `postgres` user (it refuses root) in a process group of its own, so that kill -9 takes
/// every backend with the postmaster.
struct PrivatePostgres {
    data: std::path::PathBuf,
    log: std::path::PathBuf,
    port: u16,
    uid: u32,
    gid: u32,
    settings: Vec<String>,
    child: Option<std::process::Child>,
}

impl PrivatePostgres {
    /// `initdb` into `data` (made here, on the mount), with `settings` (`name=value`) for
    /// every start. `None` (after printing why) without PostgreSQL's programs or its user.
    fn init(data: &std::path::Path, log: &std::path::Path, settings: &[&str]) -> Option<Self> {
        use std::os::unix::process::CommandExt;
        let Some((uid, gid)) = system_user("postgres") else {
            println!("skipped: no postgres user to run a private PostgreSQL as");
            return None;
        };
        std::fs::create_dir(data).expect("the data directory");
        std::os::unix::fs::chown(data, Some(uid), Some(gid)).expect("giving it to postgres");
        let initdb = std::process::Command::new("initdb")
            .args(["-D", &data.display().to_string(), "-U", "postgres"])
            .args(["--auth=trust", "--encoding=UTF8", "--locale=C"])
            .uid(uid)
            .gid(gid)
            .env("HOME", data)
            .output();
        let out = match initdb {
            Ok(out) => out,
            Err(err) => {
                println!("skipped: initdb did not run ({err})");
                return None;
            }
        };
        assert!(
            out.status.success(),
            "initdb on the lazy file system: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        Some(PrivatePostgres {
            data: data.to_owned(),
            log: log.to_owned(),
            port,
            uid,
            gid,
            settings: settings.iter().map(|s| (*s).to_owned()).collect(),
            child: None,
        })
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Starts the server (recovering from a crash if there was one) and waits until it
    /// accepts connections.
    async fn start(&mut self) {
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .expect("the server's log");
        let mut cmd = std::process::Command::new("postgres");
        cmd.args(["-D", &self.data.display().to_string()])
            .args(["-p", &self.port.to_string()])
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "unix_socket_directories=",
            ]);
        for setting in &self.settings {
            cmd.args(["-c", setting]);
        }
        let child = cmd
            .uid(self.uid)
            .gid(self.gid)
            .process_group(0)
            .stdout(log.try_clone().expect("the log"))
            .stderr(log)
            .spawn()
            .expect("starting postgres");
        self.child = Some(child);
        let url = self.url();
        crate::support::eventually_within(
            "the private PostgreSQL accepts connections",
            std::time::Duration::from_secs(60),
            async || {
                use sqlx::Connection;
                sqlx::PgConnection::connect(&url).await.is_ok()
            },
        )
        .await;
    }

    /// kill -9 of the postmaster and every backend; returns once all of them are gone.
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_process_group(&mut child);
        }
    }

    /// The server's log, for a failing test.
    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A gateway on a private PostgreSQL whose data directory is on a lazy file system, put
/// through `cuts` power cuts; `settings` go to the server, `unsafe_ok` lets the gateway start
/// on settings it would refuse.
async fn postgres_power_cuts(
    card: &mut Card,
    fsync: Fsync,
    settings: &[&str],
    unsafe_ok: bool,
    cuts: usize,
) -> Option<Cuts> {
    let seed = card.seed();
    let (dir, mut fs) = lazy_mount(fsync)?;
    let mut pg = PrivatePostgres::init(
        &fs.path().join("pgdata"),
        &dir.path().join("postgres.log"),
        settings,
    )?;
    pg.start().await;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut options = Options {
        store_url: Some(pg.url()),
        ..Options::default()
    };
    if unsafe_ok {
        options.extra_env.push((
            "HOOKLATCH_ALLOW_UNSAFE_DURABILITY".to_owned(),
            "true".to_owned(),
        ));
    }
    let mut gw = Gateway::start_with(&handler, options).await;
    let result = power_cuts(&mut gw, &mut fs, Some(&mut pg), seed, cuts).await;
    if !result.lost.is_empty() {
        println!("postgres log:\n{}", pg.log_tail());
    }
    result.wait_until_kept_are_delivered(&handler).await;
    result.record(card, cuts, &fs);
    drop(gw);
    drop(pg);
    drop(fs);
    Some(result)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_every_event_acknowledged_before_a_power_cut_is_kept_through_it() {
    let mut card = Card::new("T5", "postgres");
    let Some(result) =
        postgres_power_cuts(&mut card, Fsync::Honoured, &[], false, scaled(CUTS)).await
    else {
        return;
    };
    assert!(
        result.lost.is_empty(),
        "{} of {} acknowledged events forgotten after a power cut: {:?}",
        result.lost.len(),
        result.acked.len(),
        &result.lost[..result.lost.len().min(10)]
    );
}

/// The control on PostgreSQL is the setting the plan names: `synchronous_commit=off` (the WAL
/// writer flushes commits later, here at most every 10 s), which the gateway refuses unless
/// told to start anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_with_synchronous_commit_off_the_power_cut_test_sees_events_lost() {
    let mut card = Card::new("T5", "postgres-synchronous-commit-off");
    let settings = ["synchronous_commit=off", "wal_writer_delay=10000"];
    let Some(result) = postgres_power_cuts(&mut card, Fsync::Honoured, &settings, true, 1).await
    else {
        return;
    };
    card.figure("control", true);
    assert!(
        !result.lost.is_empty(),
        "with synchronous_commit=off, a power cut lost none of {} acknowledged events: the \
         test is blind",
        result.acked.len()
    );
}
