//! T3b: providers hanging up mid-request, through a real `hooklatch serve`.
//!
//! Each of N signed events is first sent by a client that hangs up at a point drawn from the
//! card's seed: inside the request head, inside the body, or after the whole request, 0–2 ms
//! later, with a FIN or a reset — wherever the gateway's handler then is (reading, verifying,
//! claiming and queueing, answering), it is dropped there. Every event is then sent again,
//! whole, as the provider's retry. What must hold:
//!
//! - a request cut before its last byte claimed nothing: its retry is `accepted`;
//! - a request sent whole either committed its claim *and* its delivery (the retry is a
//!   `duplicate`) or neither (`accepted`): never a claim without its outbox row, which would
//!   leave the event undelivered behind a duplicate;
//! - every event reaches the application, once.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use crate::report::{draw, Card};
use crate::support::{
    storm, stripe_headers, stripe_invoice_paid, unique, Behaviour, Gateway, Handler, Options,
    DEADLINE,
};

/// Where a client hangs up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cut {
    /// After `n` bytes of the request head.
    InHead(usize),
    /// After the head and `n` bytes of the body (fewer than it declared).
    InBody(usize),
    /// After the whole request, `micros` later, with a reset (`SO_LINGER` 0) or a FIN.
    AfterRequest { micros: u64, reset: bool },
}

impl Cut {
    /// The cut for event `i` of a run with `seed`, for a request of this head and body.
    fn draw(seed: u64, i: u64, head: usize, body: usize) -> Cut {
        let pick = |salt: u64, n: u64| draw(seed, i.wrapping_mul(4).wrapping_add(salt), n);
        match pick(0, 4) {
            0 => Cut::InHead(pick(1, head as u64) as usize),
            1 => Cut::InBody(pick(1, body as u64) as usize),
            kind => Cut::AfterRequest {
                micros: pick(1, 2_001),
                reset: kind == 2,
            },
        }
    }

    fn name(self) -> &'static str {
        match self {
            Cut::InHead(_) => "hang_up_in_head",
            Cut::InBody(_) => "hang_up_in_body",
            Cut::AfterRequest { reset: true, .. } => "reset_after_request",
            Cut::AfterRequest { reset: false, .. } => "close_after_request",
        }
    }

    fn whole(self) -> bool {
        matches!(self, Cut::AfterRequest { .. })
    }
}

/// The signed request for event `id`, as bytes on the wire: its head and its body.
fn request(addr: SocketAddr, id: &str) -> (Vec<u8>, Vec<u8>) {
    let body = stripe_invoice_paid(id, 5000);
    let mut head = format!(
        "POST /in/stripe HTTP/1.1\r\nhost: {addr}\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (name, value) in stripe_headers(&body) {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    (head.into_bytes(), body)
}

/// Sends the request for `id` and hangs up at `cut`, reading nothing.
async fn hang_up(addr: SocketAddr, id: &str, cut: Cut) {
    let (head, body) = request(addr, id);
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connecting to the gateway");
    let sent: Vec<u8> = match cut {
        Cut::InHead(n) => head[..n].to_vec(),
        Cut::InBody(n) => [&head[..], &body[..n]].concat(),
        Cut::AfterRequest { .. } => [head, body].concat(),
    };
    // The gateway may have closed first (a bad head): the hang-up happened either way.
    let _ = stream.write_all(&sent).await;
    if let Cut::AfterRequest { micros, reset } = cut {
        tokio::time::sleep(Duration::from_micros(micros)).await;
        if reset {
            let _ = stream.set_zero_linger();
        }
    }
    drop(stream);
}

/// Runs T3b against `gw` (its handler `handler`) with `n` events and fills in `card`.
pub(crate) async fn hang_ups_lose_nothing(
    gw: &Gateway,
    handler: &Handler,
    card: &mut Card,
    n: usize,
) {
    let seed = card.seed();
    let addr = gw.ingest().addr();
    let prefix = unique("evt_hangup");
    let ids: Vec<String> = (0..n).map(|i| format!("{prefix}_{i:05}")).collect();
    let cuts: Vec<Cut> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            let (head, body) = request(addr, id);
            Cut::draw(seed, i as u64, head.len(), body.len())
        })
        .collect();

    // 64 clients at a time, each hanging up once per event.
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients = Vec::new();
    for _ in 0..64 {
        let (ids, cuts, next) = (ids.clone(), cuts.clone(), next.clone());
        clients.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(id) = ids.get(i) else { break };
                hang_up(addr, id, cuts[i]).await;
            }
        }));
    }
    for client in clients {
        client.await.expect("a hanging-up client");
    }

    // The provider's retries, whole; a copy meeting its hung-up twin still in flight may be
    // told to come back (409 in Redis mode, 503 when the store is busy), as a provider is.
    let (answers, retried) = storm(
        &[gw.ingest()],
        &ids,
        1,
        &[409, 503],
        200,
        Duration::from_millis(20),
        seed,
    )
    .await;
    let mut committed = 0;
    for (id, cut) in ids.iter().zip(&cuts) {
        let got = &answers[id];
        let verdict = got[0].1.as_str();
        assert_eq!(got.len(), 1, "{id}: {got:?}");
        assert_eq!(got[0].0, 200, "{id} after {cut:?}: {got:?}");
        match verdict {
            "accepted" => {}
            "duplicate" => {
                assert!(
                    cut.whole(),
                    "{id}: a request cut at {cut:?} claimed its event"
                );
                committed += 1;
            }
            other => panic!("{id} after {cut:?}: {other}"),
        }
    }

    // Bounded; what is missing after it is counted lost on the card, then fails the test.
    let started = std::time::Instant::now();
    while handler.distinct_keys().len() < n && started.elapsed() < DEADLINE * 4 {
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let delivered = handler.distinct_keys();
    let lost = ids
        .iter()
        .filter(|id| !delivered.contains(&format!("stripe:{id}")))
        .count();
    let extra = handler.total() - delivered.len();
    for kind in [
        "hang_up_in_head",
        "hang_up_in_body",
        "reset_after_request",
        "close_after_request",
    ] {
        card.fault(kind, cuts.iter().filter(|c| c.name() == kind).count());
    }
    card.count("ops", n)
        .count("acked", n)
        .count("lost", lost)
        .count("duplicates", extra)
        .figure("committed_before_the_hang_up", committed)
        .figure("retries_told_to_come_back", retried);
    println!(
        "T3b: {n} hang-ups, {committed} committed before it, {retried} retries told to come \
         back, {lost} lost, {extra} extra deliveries"
    );
    assert_eq!(lost, 0, "events never delivered");
    assert_eq!(extra, 0, "events delivered more than once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn providers_hanging_up_anywhere_lose_no_event_on_sqlite() {
    let mut card = Card::new("T3b", "sqlite");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    hang_ups_lose_nothing(&gw, &handler, &mut card, crate::report::scaled(1_000)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn providers_hanging_up_anywhere_lose_no_event_on_postgres() {
    let mut card = Card::new("T3b", "postgres");
    let Some(db) = crate::postgres::Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let options = Options {
        store_url: Some(db.url()),
        ..Options::default()
    };
    let gw = Gateway::start_with(&handler, options).await;
    hang_ups_lose_nothing(&gw, &handler, &mut card, crate::report::scaled(1_000)).await;
}
