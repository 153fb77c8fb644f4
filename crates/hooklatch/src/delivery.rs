//! Delivery workers: take due deliveries from the outbox and hand them to their destinations:
//! an HTTP POST, or a publish to RabbitMQ.
//!
//! One dispatcher loop leases due rows (up to the free concurrency), spawns one task per
//! delivery, and sleeps until woken by a new event, the next due time, a finished task or the
//! poll interval. A task that finishes an attempt records it and leases its next due row in
//! one store write, and goes on while there is work, so a busy worker costs one store round
//! trip per delivery. That write runs while the task attempts the row it leased one write
//! earlier (each task holds one row ahead), so a busy task is not idle while its attempt
//! commits. Each attempt sends the original body byte-exact with the original headers,
//! plus `Idempotency-Key` (the same on every attempt) and, when the destination has a secret,
//! a Standard Webhooks signature. 2xx is success; anything else, a redirect included, is a
//! failure retried by the destination's [`RetryPolicy`](hooklatch_core::RetryPolicy).
//!
//! An AMQP destination publishes through its shared [`Publisher`]: persistent, `mandatory`,
//! `message_id` = the Idempotency-Key. Success is the broker's publisher confirm of a routed
//! message; a returned (unroutable) message, a nack, a timeout or a connection error is a
//! failure (no HTTP status), retried and dead-lettered by the same policy.
//!
//! A worker that dies holding leases loses them when they expire, and the rows are delivered
//! again with the same key: delivery is at least once, and the key lets the application's
//! guard make the effect once. On shutdown, in-flight attempts get the grace period, then the
//! worker gives its leases back.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hooklatch_core::provider::standard_webhooks::{decode_secret, sign_v1};
use hooklatch_core::provider::{InboundRequest, ProviderAdapter, SignRequest};
use hooklatch_core::retry::{parse_retry_after, NextAttempt};
use hooklatch_core::store::{
    AttemptNext, AttemptResult, AttemptToken, DisabledDestination, LeasedDelivery, HELD,
};
use hooklatch_core::{crash, DeliveryId, Secret, Store, StoreError, Timestamp};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use hooklatch_http::{DisabledDestinations, Handoff};
use reqwest::header::HeaderValue;

use hooklatch_queue_rabbitmq::{Message, PublishError, Publisher};

use crate::config::{Destination, DestinationKind, ProviderSignature};
use crate::listen::{Forwarded, ListenHub};
use crate::outbound::check_literal;

/// Request headers never forwarded: hop-by-hop headers, ones the HTTP client sets itself, and
/// `Idempotency-Key`, which hooklatch writes.
const DROPPED_HEADERS: &[&str] = &[
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
    "expect",
    "idempotency-key",
];

/// The Standard Webhooks headers (and Svix's names for them) a signing destination gets from
/// hooklatch: a standard-webhooks source's own are left out there, so the application's
/// library finds the gateway's signature and no other. Without a destination secret they go
/// through like any provider's signature.
const SIGNATURE_HEADERS: &[&str] = &[
    "webhook-id",
    "webhook-timestamp",
    "webhook-signature",
    "svix-id",
    "svix-timestamp",
    "svix-signature",
];

/// An attempt being recorded with the task's next lease ([`Worker::record_and_lease`]).
type Recording<'a> = Pin<Box<dyn Future<Output = Recorded> + Send + 'a>>;

/// What recording an attempt came to.
enum Recorded {
    /// The store's answer to the first try: recorded, with the task's next lease if a
    /// delivery was due.
    Leased(Option<Box<LeasedDelivery>>),
    /// Recorded by a later try, without a lease (or found recorded already: the first try's
    /// commit happened and its answer was lost). Whether more is due is not known.
    Again,
    /// Every try failed (logged): the lease runs out and the delivery is attempted again, with
    /// the same key.
    Failed,
}

/// The pause before the `n`th new try (from 0) to record an attempt whose record failed (a
/// connection that broke, the store briefly away): 100 ms, doubling up to 5 s.
fn record_again_after(n: u32) -> Duration {
    const FIRST: Duration = Duration::from_millis(100);
    const MOST: Duration = Duration::from_secs(5);
    FIRST.saturating_mul(1 << n.min(16)).min(MOST)
}

/// The first try to record an attempt: the store `write` (not started until awaited), between
/// the record's two failpoints (tests only; without the `failpoints` feature, the write
/// alone): one fails before the write as a store away would, the other after it, as an
/// answer lost after the commit would.
async fn first_try<T>(write: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
    let pause =
        crash::fallible(crash::WORKER_RECORD_BEFORE_STORE).map_err(StoreError::Unavailable)?;
    if let Some(pause) = pause {
        tokio::time::sleep(pause).await;
    }
    let answer = write.await?;
    crash::fallible(crash::WORKER_RECORD_AFTER_STORE).map_err(StoreError::Unavailable)?;
    Ok(answer)
}

/// The dispatcher's settings.
pub struct Worker {
    pub(crate) store: Arc<dyn Store>,
    pub(crate) destinations: HashMap<String, Arc<Destination>>,
    /// One publisher per AMQP destination, by destination name.
    pub(crate) publishers: HashMap<String, Arc<Publisher>>,
    /// Each source's provider, by source name (the `hooklatch-provider` AMQP header).
    pub(crate) providers: HashMap<String, &'static str>,
    /// The sources whose provider's signature is signed again at each attempt
    /// ([`ProviderSigner`]), by source name.
    pub(crate) signers: HashMap<String, ProviderSigner>,
    /// One client per HTTP destination, by name, each with its destination's address policy
    /// (`crate::outbound`).
    pub(crate) clients: HashMap<String, Arc<dyn Post>>,
    pub(crate) owner: String,
    pub(crate) concurrency: usize,
    pub(crate) poll_interval: Duration,
    pub(crate) lease: Duration,
    pub(crate) enqueued: Arc<Notify>,
    /// New deliveries handed over by ingest, leased to this worker already.
    pub(crate) handoff: Arc<Handoff>,
    /// The listeners connected for `listen` destinations.
    pub(crate) listen: Arc<ListenHub>,
    /// The destinations whose deliveries are held ([`HELD`]).
    pub(crate) disabled: Arc<DisabledDestinations>,
    /// Set by a task whose attempt scheduled a retry: the store's next due time may now be
    /// earlier than the one the dispatcher last heard ([`NextDue`]).
    pub(crate) retry_scheduled: AtomicBool,
    /// The attempts sent and not yet answered, by delivery: what a shutdown whose grace ran
    /// out records as abandoned ([`Worker::record_abandoned`]).
    pub(crate) under_way: std::sync::Mutex<HashMap<DeliveryId, UnderWay>>,
}

/// An attempt sent and not yet answered ([`Worker::under_way`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct UnderWay {
    started_at: Timestamp,
    lease_until: Option<Timestamp>,
    clock: Instant,
}

/// What an attempt abandoned at shutdown records as its error.
pub const ABANDONED: &str = "abandoned: the gateway stopped before an answer came (shutdown_grace \
     ran out); the destination may have received it";

/// How long the dispatcher goes on using the store's answer to "when is the next row due?"
/// while that time is still ahead: between two answers, a row due sooner can only come from
/// this worker's own retries (which make it ask again at once, [`Worker::retry_scheduled`]),
/// from new events (which wake it through the hand-off or the `enqueued` signal whatever the
/// answer), or from elsewhere — a lease run out on another instance, a redrive — found this
/// much later at most. Asking after every task, as before, was one more store query for every
/// event delivered through the hand-off (PostgreSQL, 500 events/s: 1,988 of the 8,251
/// statements of 2,222 requests).
const NEXT_DUE_REUSE: Duration = Duration::from_millis(250);

/// How often a gateway looks for deliveries held ([`HELD`]) for a destination that is enabled
/// by now ([`Store::wake_held`]), beside the look it takes as it starts. A disabled
/// destination's delivery is put back until it is enabled ([`AttemptNext::Wait`]`(HELD)`, no
/// attempt counted), once; enabling the destination wakes its rows (the store's enable, and a
/// worker that put one back just before looks again after, see `hooklatch_http::disabled`).
/// The sweep is for the rest: a worker that stopped between its put-back and that look, or an
/// instance that heard of the enable late and then went away. It reads the held rows alone.
pub const HELD_SWEEP: Duration = Duration::from_secs(600);

/// Wakes the deliveries held for destinations enabled since ([`HELD_SWEEP`]): now, then every
/// `every`, until `cancel`; tells the worker (`enqueued`) when it moved any.
pub(crate) async fn sweep_held(
    store: Arc<dyn Store>,
    enqueued: Arc<Notify>,
    every: Duration,
    cancel: CancellationToken,
) {
    loop {
        match store.wake_held(Timestamp::now()).await {
            Ok(0) => {}
            Ok(woken) => {
                // A wake was lost: an instance stopped, or heard of an enable late.
                tracing::warn!(
                    woken,
                    "deliveries held for a destination enabled since are due"
                );
                enqueued.notify_one();
            }
            Err(err) => tracing::warn!(%err, "could not look for held deliveries to wake"),
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
    }
}

/// How often a gateway on a store other instances share reloads the disabled destinations
/// (`follow_disabled`): another instance's disable takes this long at most to hold
/// deliveries here, and its enable to wake what this one put back.
pub const DISABLED_RELOAD: Duration = Duration::from_secs(5);

/// Keeps `disabled` in step with a store other instances share: reloads it every `every`, and
/// wakes each destination another instance enabled (a row this instance put back just before
/// it heard is due again at once). Runs until `cancel`.
pub(crate) async fn follow_disabled(
    disabled: Arc<DisabledDestinations>,
    store: Arc<dyn Store>,
    every: Duration,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(every) => {}
        }
        match disabled.reload(store.as_ref()).await {
            Ok(changed) => {
                for d in changed.disabled {
                    metrics::gauge!("hooklatch_destination_disabled",
                        "destination" => d.destination.clone())
                    .set(1.0);
                    tracing::warn!(destination = %d.destination, reason = %d.reason,
                        "destination disabled by another instance: its deliveries wait");
                }
                for name in changed.enabled {
                    metrics::gauge!("hooklatch_destination_disabled", "destination" => name.clone())
                        .set(0.0);
                    if let Err(err) = store.wake_destination(&name, Timestamp::now()).await {
                        tracing::warn!(%err, destination = %name, "could not wake an enabled destination");
                    }
                }
            }
            Err(err) => tracing::debug!(%err, "could not reload the disabled destinations"),
        }
    }
}

/// The store's last answer to [`Store::next_due`], and when it was given.
#[derive(Clone, Copy)]
struct NextDue {
    asked: Instant,
    due: Option<Timestamp>,
}

impl Worker {
    /// Runs until `cancel`, then lets in-flight attempts finish for up to `grace` and releases
    /// the leases it still holds.
    pub async fn run(self, cancel: CancellationToken, grace: Duration) {
        let this = Arc::new(self);
        let mut in_flight = JoinSet::new();
        // Whether to look at the store for due rows in this turn: not when a task finishing
        // woke the dispatcher while the store had nothing due at its last look (new events
        // come through the hand-off then, and a wasted lease is a write).
        let mut look = true;
        let mut next_due: Option<NextDue> = None;
        loop {
            if cancel.is_cancelled() {
                break;
            }
            let mut free = this.concurrency.saturating_sub(in_flight.len());
            // Deliveries ingest handed over first: they are leased to this worker already.
            // Their tasks look at the store for due rows with every attempt they record, so
            // the store is not asked here as well (an empty lease is a write, too).
            let handed = this.handoff.take(free, Timestamp::now());
            let any_handed = !handed.is_empty();
            for delivery in handed {
                let (this, cancel) = (this.clone(), cancel.clone());
                in_flight.spawn(async move { this.work(delivery, None, cancel).await });
                free -= 1;
            }
            let mut leased_all = false;
            let mut lease_failed = false;
            if free > 0 && !any_handed && look {
                // Up to two rows per free task: the second is the task's next, ready while
                // the first one's attempt is recorded.
                let limit = free * 2;
                match this
                    .store
                    .lease_due(&this.owner, Timestamp::now(), this.lease, limit as u32)
                    .await
                {
                    Ok(batch) => {
                        // Fewer than asked: nothing else is due, and new events may be
                        // handed over without passing anything.
                        this.handoff.set_caught_up(batch.len() < limit);
                        leased_all = batch.len() >= free;
                        let mut rows = batch.into_iter();
                        let firsts: Vec<_> = rows.by_ref().take(free).collect();
                        for first in firsts {
                            let next = rows.next();
                            let (this, cancel) = (this.clone(), cancel.clone());
                            in_flight.spawn(async move { this.work(first, next, cancel).await });
                        }
                    }
                    Err(err) => {
                        tracing::warn!(%err, "could not lease deliveries");
                        lease_failed = true;
                    }
                }
            }
            if (leased_all || this.handoff.waiting() > 0) && in_flight.len() < this.concurrency {
                continue;
            }
            // With every task busy there is nothing to lease until one finishes (and a busy
            // task leases its own next delivery): no need to ask the store when work is due.
            // After a failed lease (a full store, a lost connection) the due rows are still due:
            // the next try waits the poll interval instead of following at once.
            let sleep = this
                .time_to_next_due(
                    leased_all || free == 0 || lease_failed || any_handed,
                    &mut next_due,
                )
                .await;
            // In this order, not at random: a task that finished frees its place before
            // anything else is looked at, and a wake left unread here stays stored for the
            // next turn (`Notify` keeps its permit). One order also makes a run repeat itself
            // under the deterministic simulation (RELIABILITY.md, T24).
            look = tokio::select! {
                biased;
                _ = cancel.cancelled() => break,
                Some(joined) = in_flight.join_next(), if !in_flight.is_empty() => {
                    if let Err(err) = joined {
                        tracing::error!(%err, "a delivery task panicked");
                    }
                    !this.handoff.caught_up()
                }
                // Rows written due (an ingest not handed over, another instance's, a
                // redrive): ask the store.
                _ = this.enqueued.notified() => true,
                // Handed over: taken at the top of the loop, by the dispatcher or by a task
                // that got there first; the store has nothing new for a caught-up worker.
                _ = this.handoff.handed() => !this.handoff.caught_up(),
                _ = tokio::time::sleep(sleep) => true,
            };
        }
        this.handoff.close();
        let drained = tokio::time::timeout(grace, async {
            while in_flight.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                n = in_flight.len(),
                "shutdown grace over; abandoning attempts in flight"
            );
            in_flight.abort_all();
            while in_flight.join_next().await.is_some() {}
            this.record_abandoned().await;
        }
        if let Err(err) = this
            .store
            .release_leases(&this.owner, Timestamp::now())
            .await
        {
            tracing::warn!(%err, "could not release leases; they expire by themselves");
        }
    }

    /// Records each attempt a shutdown abandoned ([`Worker::under_way`]) as a failed attempt
    /// ([`ABANDONED`]), due again at once: the destination may have received it and acted, so
    /// history shows why it comes again, and the next attempt carries the next number.
    async fn record_abandoned(&self) {
        let abandoned: Vec<(DeliveryId, UnderWay)> = match self.under_way.lock() {
            Ok(mut under_way) => under_way.drain().collect(),
            Err(poisoned) => poisoned.into_inner().drain().collect(),
        };
        for (delivery, under_way) in abandoned {
            let result = AttemptResult {
                delivery,
                owner: self.owner.clone(),
                started_at: under_way.started_at,
                latency: under_way.clock.elapsed(),
                status: None,
                error: Some(ABANDONED.to_owned()),
                next: AttemptNext::RetryAt(Timestamp::now()),
                lease_until: under_way.lease_until,
                token: AttemptToken::random(),
            };
            // A store that does not answer now leaves the lease to run out, as after a crash.
            let recorded =
                tokio::time::timeout(Duration::from_secs(5), self.store.record_attempt(result))
                    .await;
            if !matches!(recorded, Ok(Ok(()))) {
                tracing::warn!(%delivery, "could not record an abandoned attempt; it goes out again when its lease runs out");
            }
        }
    }

    /// Notes (`Some`) or forgets (`None`) an attempt sent and not yet answered.
    fn under_way(&self, delivery: DeliveryId, attempt: Option<UnderWay>) {
        let mut under_way = match self.under_way.lock() {
            Ok(under_way) => under_way,
            Err(poisoned) => poisoned.into_inner(),
        };
        match attempt {
            Some(attempt) => under_way.insert(delivery, attempt),
            None => under_way.remove(&delivery),
        };
    }

    /// How long the dispatcher may sleep: the poll interval, or less when the store holds a
    /// row due sooner. The store's answer is used again while it is recent, the time it gave
    /// is still ahead, and no task has scheduled a retry since ([`NEXT_DUE_REUSE`]).
    async fn time_to_next_due(&self, busy: bool, known: &mut Option<NextDue>) -> Duration {
        if busy {
            return self.poll_interval;
        }
        let now = Timestamp::now();
        let retried = self.retry_scheduled.swap(false, Ordering::Relaxed);
        let reusable = known.filter(|k| {
            !retried && k.asked.elapsed() < NEXT_DUE_REUSE && k.due.is_none_or(|at| at.0 > now.0)
        });
        let due = match reusable {
            Some(k) => k.due,
            None => match self.store.next_due().await {
                Ok(due) => {
                    *known = Some(NextDue {
                        asked: Instant::now(),
                        due,
                    });
                    due
                }
                Err(_) => {
                    *known = None;
                    None
                }
            },
        };
        due.map_or(self.poll_interval, |at| {
            at.since(Timestamp::now()).min(self.poll_interval)
        })
    }

    /// One delivery task: attempts its delivery, then goes on while there is work. Each
    /// attempt is recorded together with the lease of the task's next delivery but one, in
    /// one store call that runs while the task attempts the delivery it already holds: a busy
    /// task waits for the slower of its attempt and the store's commit, not for both one after
    /// the other. A task holds at most two leases, the one in flight and the next; the next
    /// waits at most one attempt, well within its lease (twice the longest timeout and more).
    async fn work(
        &self,
        first: LeasedDelivery,
        next: Option<LeasedDelivery>,
        cancel: CancellationToken,
    ) {
        let mut ready: VecDeque<LeasedDelivery> = std::iter::once(first).chain(next).collect();
        let mut recording: Option<Recording<'_>> = None;
        loop {
            // Nothing in hand: a delivery ingest handed over, if one waits.
            if ready.is_empty() {
                ready.extend(self.handoff.take(1, Timestamp::now()));
            }
            let Some(delivery) = ready.pop_front() else {
                match recording.take() {
                    // Nothing in hand: the attempt being recorded may bring the next lease.
                    Some(recorded) => {
                        ready.extend(self.next_lease(recorded.await));
                        continue;
                    }
                    None => break,
                }
            };
            // A delivery held because its destination is disabled is looked at again once put
            // back: if the destination was enabled meanwhile, it is woken ([`HELD_SWEEP`]).
            let held = self
                .disabled
                .any()
                .then(|| delivery.destination.clone())
                .filter(|name| self.disabled.is_disabled(name));
            let result = match recording.take() {
                Some(recorded) => {
                    let (result, recorded) = tokio::join!(self.deliver(delivery), recorded);
                    ready.extend(self.next_lease(recorded));
                    result
                }
                None => self.deliver(delivery).await,
            };
            if cancel.is_cancelled() {
                // A lease still in hand is given back with the others at shutdown.
                self.record(result).await;
                break;
            }
            // A retry, once committed, may be due before the dispatcher's last answer from
            // the store: it asks again.
            let retry = matches!(result.next, AttemptNext::RetryAt(_));
            let held = held.filter(|_| matches!(result.next, AttemptNext::Wait(_)));
            let record = self.record_and_lease(result);
            recording = Some(Box::pin(async move {
                let recorded = record.await;
                if retry {
                    self.retry_scheduled.store(true, Ordering::Relaxed);
                }
                if let Some(name) = held.filter(|name| !self.disabled.is_disabled(name)) {
                    match self.store.wake_destination(&name, Timestamp::now()).await {
                        Ok(0) => {}
                        Ok(_) => self.enqueued.notify_one(),
                        Err(err) => {
                            tracing::warn!(%err, destination = %name, "could not wake an enabled destination")
                        }
                    }
                }
                recorded
            }));
        }
    }

    /// The lease a recorded attempt brought, if any. The store answering with none tells
    /// that nothing else is due: new events may be handed over; answering with one, that
    /// there may be more.
    fn next_lease(&self, recorded: Recorded) -> Option<LeasedDelivery> {
        match recorded {
            Recorded::Leased(next) => {
                self.handoff.set_caught_up(next.is_none());
                next.map(|next| *next)
            }
            Recorded::Again | Recorded::Failed => None,
        }
    }

    /// Records an attempt with the task's next lease in one store write; if that write fails,
    /// records the attempt alone, again, until the store takes it ([`Worker::record_again`]).
    async fn record_and_lease(&self, result: AttemptResult) -> Recorded {
        let again = result.clone();
        let write = self
            .store
            .record_attempt_and_lease(result, Timestamp::now(), self.lease);
        match first_try(write).await {
            Ok(next) => Recorded::Leased(next.map(Box::new)),
            Err(err) => self.record_again(again, err).await,
        }
    }

    /// Records an attempt alone, as the task's last (shutdown), trying again as
    /// [`Worker::record_and_lease`] does.
    async fn record(&self, result: AttemptResult) {
        let again = result.clone();
        if let Err(err) = first_try(self.store.record_attempt(result)).await {
            self.record_again(again, err).await;
        }
    }

    /// The tries after a failed record, each after its pause ([`record_again_after`]), until
    /// the lease the attempt was made under runs out ([`AttemptResult::lease_until`]; a lease
    /// from the attempt's start when it names none): no try starts later. A try that lands
    /// after that (one waiting on the store for a connection, say) moves the row only if
    /// nobody leased it again meanwhile, and is otherwise only counted. Each try carries the
    /// attempt's token ([`AttemptToken`]), so a try whose first did commit changes nothing. If
    /// none is answered, the delivery goes out again once its lease has run out, as it would
    /// without them.
    async fn record_again(&self, result: AttemptResult, err: StoreError) -> Recorded {
        tracing::warn!(%err, delivery = %result.delivery, "could not record a delivery attempt; trying again");
        let deadline = result
            .lease_until
            .unwrap_or_else(|| result.started_at.plus(self.lease));
        let mut last = err;
        for n in 0.. {
            let pause = record_again_after(n);
            if Timestamp::now().plus(pause) >= deadline {
                break;
            }
            tokio::time::sleep(pause).await;
            if Timestamp::now() >= deadline {
                break;
            }
            match self.store.record_attempt(result.clone()).await {
                Ok(()) => {
                    metrics::counter!("hooklatch_attempt_record_retries_total", "outcome" => "recorded")
                        .increment(1);
                    tracing::info!(delivery = %result.delivery, "delivery attempt recorded on a later try");
                    return Recorded::Again;
                }
                Err(err) => last = err,
            }
        }
        metrics::counter!("hooklatch_attempt_record_retries_total", "outcome" => "gave_up")
            .increment(1);
        // The lease runs out and the delivery is attempted again, with the same key.
        tracing::warn!(err = %last, delivery = %result.delivery, "could not record a delivery attempt; it will be attempted again when its lease runs out");
        Recorded::Failed
    }

    /// One attempt; returns what to record.
    async fn deliver(&self, delivery: LeasedDelivery) -> AttemptResult {
        let attempt = delivery.attempts + 1;
        let span = tracing::debug_span!("delivery", id = %delivery.id, destination = %delivery.destination, attempt);
        let _enter = span.enter();
        let started_at = Timestamp::now();
        let clock = Instant::now();
        let Some(dest) = self.destinations.get(&delivery.destination).cloned() else {
            // On a shared store another instance may have the destination (one started from a
            // newer configuration, in a rolling deploy): put the row back uncounted, as for a
            // listener connected elsewhere, rather than spend its attempts here.
            if self.listen.shared() {
                tracing::warn!(
                    destination = %delivery.destination,
                    "a delivery to a destination this instance does not have: put back for an \
                     instance that has it"
                );
                let next = AttemptNext::Wait(self.listen.wait_until(&delivery, started_at));
                return self.unsent(&delivery, started_at, None, next);
            }
            let error = format!(
                "destination {:?} is no longer configured",
                delivery.destination
            );
            return self.unsent(&delivery, started_at, Some(error), AttemptNext::DeadLetter);
        };
        drop(_enter);
        if self.disabled.is_disabled(&dest.name) {
            metrics::counter!("hooklatch_delivery_waits_total",
                "destination" => dest.name.clone())
            .increment(1);
            return self.unsent(&delivery, started_at, None, AttemptNext::Wait(HELD));
        }
        crash::point(crash::WORKER_AFTER_LEASE_BEFORE_SEND);
        self.under_way(
            delivery.id,
            Some(UnderWay {
                started_at,
                lease_until: delivery.lease_until,
                clock,
            }),
        );
        let outcome = match &dest.kind {
            DestinationKind::Http { .. } => self
                .send(&dest, &delivery, attempt, started_at)
                .await
                .map(|(status, retry_after)| (Some(status), retry_after)),
            DestinationKind::Amqp(_) => self
                .publish(&dest, &delivery, attempt, started_at)
                .await
                .map(|()| (None, None)),
            DestinationKind::Listen { secret, .. } => match self
                .listen
                .forward(
                    &dest,
                    secret.as_ref(),
                    self.signer(&dest, &delivery),
                    &delivery,
                    attempt,
                    started_at,
                )
                .await
            {
                Forwarded::Answered(status) => Ok((Some(status), None)),
                Forwarded::Failed(error) => Err(error),
                Forwarded::Away => {
                    metrics::counter!("hooklatch_delivery_waits_total",
                        "destination" => dest.name.clone())
                    .increment(1);
                    self.under_way(delivery.id, None);
                    let until = self.listen.wait_until(&delivery, started_at);
                    return self.unsent(&delivery, started_at, None, AttemptNext::Wait(until));
                }
            },
        };
        self.under_way(delivery.id, None);
        let latency = clock.elapsed();
        match outcome {
            Ok((Some(200..=299), _)) => crash::point(crash::WORKER_AFTER_2XX_BEFORE_RECORD),
            Ok((None, _)) => crash::point(crash::WORKER_AFTER_PUBLISH_BEFORE_RECORD),
            _ => {}
        }
        let now = Timestamp::now();
        let gone = matches!(outcome, Ok((Some(410), _))) && dest.disable_on_gone;
        let (status, error, retry_after) = match outcome {
            // A confirmed publish: no HTTP status.
            Ok((None, _)) => (None, None, None),
            Ok((Some(status), _)) if (200..300).contains(&status) => (Some(status), None, None),
            Ok((Some(status), retry_after)) => {
                let error = if (300..400).contains(&status) {
                    format!("HTTP {status}: redirects are not followed")
                } else if gone {
                    self.disable_gone(&dest, now).await;
                    format!(
                        "HTTP 410: the destination is gone; delivery to it is disabled until \
                         it is enabled (hooklatch destinations enable {})",
                        dest.name
                    )
                } else {
                    format!("HTTP {status}")
                };
                (
                    Some(status),
                    Some(error),
                    retry_after.and_then(|v| parse_retry_after(&v, now)),
                )
            }
            Err(error) => (None, Some(error), None),
        };
        let next = if error.is_none() {
            AttemptNext::Delivered
        } else if gone {
            // The 410 is recorded as an attempt, but it never dead-letters the event: it waits
            // with the rest of the destination's backlog until the destination is enabled,
            // which wakes it (RELIABILITY.md T14: "its events stay queued").
            AttemptNext::RetryAt(HELD)
        } else {
            match dest.retry.next(
                attempt,
                delivery.round_started_at,
                now,
                retry_after,
                &mut rand::rng(),
            ) {
                NextAttempt::At(at) => AttemptNext::RetryAt(at),
                NextAttempt::GiveUp => AttemptNext::DeadLetter,
            }
        };
        if matches!(next, AttemptNext::DeadLetter) {
            crash::point(crash::WORKER_BEFORE_DEAD_LETTER);
        }
        let outcome_label = match next {
            AttemptNext::Delivered => "delivered",
            _ if gone => "gone",
            AttemptNext::RetryAt(_) => "retry",
            AttemptNext::DeadLetter => "dead_letter",
            AttemptNext::Wait(_) => "wait",
        };
        metrics::counter!("hooklatch_delivery_attempts_total",
            "destination" => dest.name.clone(), "outcome" => outcome_label)
        .increment(1);
        metrics::histogram!("hooklatch_delivery_seconds", "destination" => dest.name.clone())
            .record(latency.as_secs_f64());
        match (&next, &error) {
            (AttemptNext::DeadLetter, Some(e)) => {
                tracing::warn!(id = %delivery.id, destination = %dest.name, attempt, error = %e, "delivery dead-lettered")
            }
            (AttemptNext::RetryAt(_), Some(e)) => {
                tracing::debug!(id = %delivery.id, destination = %dest.name, attempt, error = %e, "delivery failed, will retry")
            }
            _ => tracing::debug!(id = %delivery.id, destination = %dest.name, attempt, "delivered"),
        }
        AttemptResult {
            delivery: delivery.id,
            owner: self.owner.clone(),
            started_at,
            latency,
            status,
            error,
            next,
            lease_until: delivery.lease_until,
            token: AttemptToken::random(),
        }
    }

    /// Disables a destination that answered `410 Gone` (Standard Webhooks: the endpoint is
    /// gone; stop sending). Its other deliveries wait, uncounted, until it is enabled.
    async fn disable_gone(&self, dest: &Destination, now: Timestamp) {
        let gone = DisabledDestination {
            destination: dest.name.clone(),
            disabled_at: now,
            reason: "HTTP 410 Gone from the destination".to_owned(),
        };
        match self.disabled.disable(self.store.as_ref(), gone).await {
            Ok(true) => {
                metrics::gauge!("hooklatch_destination_disabled",
                    "destination" => dest.name.clone())
                .set(1.0);
                tracing::warn!(destination = %dest.name,
                    "the destination answered 410 Gone: disabled; its deliveries wait until \
                     it is enabled (hooklatch destinations enable NAME)");
            }
            Ok(false) => {}
            Err(err) => tracing::warn!(%err, destination = %dest.name,
                "the destination answered 410 Gone: disabled here, but the store could not \
                 keep it; other instances and a restart do not know"),
        }
    }

    /// The result of an attempt that sent nothing: its destination is gone, or nobody is
    /// there to take it.
    fn unsent(
        &self,
        delivery: &LeasedDelivery,
        started_at: Timestamp,
        error: Option<String>,
        next: AttemptNext,
    ) -> AttemptResult {
        AttemptResult {
            delivery: delivery.id,
            owner: self.owner.clone(),
            started_at,
            latency: Duration::ZERO,
            status: None,
            error,
            next,
            lease_until: delivery.lease_until,
            token: AttemptToken::random(),
        }
    }

    /// Sends one attempt; returns the status and any `Retry-After`, or a safe error message.
    async fn send(
        &self,
        dest: &Destination,
        delivery: &LeasedDelivery,
        attempt: u32,
        now: Timestamp,
    ) -> Result<(u16, Option<String>), String> {
        let DestinationKind::Http {
            url, secret, allow, ..
        } = &dest.kind
        else {
            return Err(format!(
                "destination {:?} is not an HTTP destination",
                dest.name
            ));
        };
        // Start-up refuses a blocked address in the URL; this keeps the rule where it is used.
        check_literal(url, allow).map_err(|blocked| format!("not sent: {blocked}"))?;
        let client = self
            .clients
            .get(&dest.name)
            .ok_or_else(|| format!("no HTTP client for destination {:?}", dest.name))?;
        let signer = self.signer(dest, delivery);
        let (body, headers) = outgoing(delivery, attempt, secret.as_ref(), signer, now);
        client.post(url, dest.timeout, body, headers).await
    }
}

impl Worker {
    /// The signer that signs `delivery`'s provider signature again for `dest`, if any: when
    /// the destination asks for it (`provider_signature = "fresh"`) and the source's provider
    /// signs a timestamp with a secret the gateway holds.
    fn signer(&self, dest: &Destination, delivery: &LeasedDelivery) -> Option<&ProviderSigner> {
        match dest.provider_signature {
            ProviderSignature::Fresh => self.signers.get(&delivery.source),
            ProviderSignature::Original => None,
        }
    }
}

/// A source's provider scheme and secrets, to sign its events again at each attempt
/// ([`ProviderSignature::Fresh`]). Only for providers whose signature covers a timestamp that
/// the application's library holds to a tolerance, and whose secret the gateway holds (HMAC:
/// Stripe, Slack, Paddle, Standard Webhooks; not Discord, signed with a private key only
/// Discord has). A provider that signs no timestamp needs nothing: its signature never
/// expires.
#[derive(Clone)]
pub(crate) struct ProviderSigner {
    adapter: Arc<dyn ProviderAdapter>,
    secrets: Vec<Secret>,
}

/// How late a signature may be when a delivery checks which secret made it: any time. Its
/// age is what is being made good; whether it was genuine, ingest decided.
const ANY_AGE: Duration = Duration::MAX;

impl ProviderSigner {
    /// The signer of a source, if its provider's signatures expire and it has a secret.
    pub(crate) fn of(source: &hooklatch_http::Source) -> Option<ProviderSigner> {
        Self::new(source.adapter.clone(), source.secrets.clone())
    }

    /// The signer of `adapter` with one `secret` (`replay` and `check` as the gateway
    /// delivers), if its provider's signatures expire.
    pub(crate) fn from_adapter(
        adapter: Arc<dyn ProviderAdapter>,
        secret: &Secret,
    ) -> Option<ProviderSigner> {
        Self::new(adapter, vec![secret.clone()])
    }

    fn new(adapter: Arc<dyn ProviderAdapter>, secrets: Vec<Secret>) -> Option<ProviderSigner> {
        let provider = adapter.provider();
        (hooklatch_core::provider::TIMESTAMP_SIGNERS.contains(&provider)
            && provider != "discord"
            && !secrets.is_empty())
        .then_some(ProviderSigner { adapter, secrets })
    }

    /// The provider's signature headers for `delivery`, made at `now` with the secret that
    /// made the original (checked at any age). `None` when no secret of the source made it (a
    /// capture imported without its signature): the headers then go as received.
    fn sign(&self, delivery: &LeasedDelivery, now: Timestamp) -> Option<Vec<(String, String)>> {
        let map = crate::replay::header_map(&delivery.headers);
        let req = InboundRequest {
            path_and_query: &delivery.path,
            headers: &map,
            body: &delivery.body,
            now,
        };
        let secret = self.secrets.iter().find(|secret| {
            self.adapter
                .verify(&req, std::slice::from_ref(*secret), ANY_AGE)
                .is_ok()
        })?;
        Some(self.adapter.sign(&SignRequest {
            body: &delivery.body,
            secret,
            now,
            event_key: &delivery.event_key,
            event_type: delivery.event_type.as_deref(),
            url: "",
        }))
    }
}

/// Sends an HTTP destination's attempts: in the gateway a `reqwest::Client` holding the
/// destination's address policy and TLS settings ([`crate::outbound::client`]); in the
/// deterministic simulation (RELIABILITY.md, T24) the simulated application.
#[async_trait::async_trait]
pub(crate) trait Post: Send + Sync {
    /// POSTs `body` with `headers` to `url`, giving up after `timeout`: the answer's status
    /// and any `Retry-After`, or an error message that holds no secret.
    async fn post(
        &self,
        url: &url::Url,
        timeout: Duration,
        body: bytes::Bytes,
        headers: Vec<(String, Vec<u8>)>,
    ) -> Result<(u16, Option<String>), String>;
}

#[async_trait::async_trait]
impl Post for reqwest::Client {
    async fn post(
        &self,
        url: &url::Url,
        timeout: Duration,
        body: bytes::Bytes,
        headers: Vec<(String, Vec<u8>)>,
    ) -> Result<(u16, Option<String>), String> {
        let mut req = reqwest::Client::post(self, url.clone())
            .timeout(timeout)
            .body(body);
        for (name, value) in &headers {
            req = req.header(name.as_str(), value.as_slice());
        }
        match req.send().await {
            Ok(res) => {
                let retry_after = res
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                Ok((res.status().as_u16(), retry_after))
            }
            Err(err) => Err(describe(&err, timeout)),
        }
    }
}

/// What an attempt sends to an HTTP endpoint or a `listen` client: the body, byte-exact (see
/// [`LeasedDelivery::payload`]), and the headers: the original ones but those in
/// [`DROPPED_HEADERS`] and any `hooklatch-*`, with the provider's signature made again at
/// `now` when `signer` is given ([`ProviderSigner`]), then `Idempotency-Key`, the
/// `hooklatch-*` delivery headers and, when the destination has a secret, a Standard Webhooks
/// signature made at `now` in place of any the provider sent ([`SIGNATURE_HEADERS`]).
pub(crate) fn outgoing(
    delivery: &LeasedDelivery,
    attempt: u32,
    secret: Option<&hooklatch_core::Secret>,
    signer: Option<&ProviderSigner>,
    now: Timestamp,
) -> (bytes::Bytes, Vec<(String, Vec<u8>)>) {
    let (body, content_type) = delivery.payload();
    let signing_key = secret.and_then(decode_secret);
    // The gateway's own Standard Webhooks signature takes the place of a standard-webhooks
    // provider's: nothing to sign again then.
    let resigned = signer
        .filter(|s| signing_key.is_none() || s.adapter.provider() != "standard-webhooks")
        .and_then(|s| s.sign(delivery, now))
        .unwrap_or_default();
    // A header the fresh signature writes replaces the one received (`webhook-*` replaces the
    // `svix-*` header of the same part too).
    let resigns = |name: &str| {
        let svix_part = name
            .get(..5)
            .filter(|prefix| prefix.eq_ignore_ascii_case("svix-"))
            .map(|_| &name[5..]);
        resigned.iter().any(|(n, _)| {
            n.eq_ignore_ascii_case(name)
                || svix_part.is_some_and(|part| {
                    n.get(8..)
                        .is_some_and(|rest| rest.eq_ignore_ascii_case(part))
                        && n[..8].eq_ignore_ascii_case("webhook-")
                })
        })
    };
    let mut headers: Vec<(String, Vec<u8>)> = Vec::with_capacity(delivery.headers.len() + 8);
    for (name, value) in &delivery.headers {
        let replaced = (content_type.is_some() && name.eq_ignore_ascii_case("content-type"))
            || (signing_key.is_some() && SIGNATURE_HEADERS.contains(&name.as_str()))
            || resigns(name);
        if replaced || DROPPED_HEADERS.contains(&name.as_str()) || name.starts_with("hooklatch-") {
            continue;
        }
        headers.push((name.clone(), value.clone()));
    }
    for (name, value) in &resigned {
        headers.push((name.to_ascii_lowercase(), value.as_bytes().to_vec()));
    }
    let mut add = |name: &str, value: &[u8]| headers.push((name.to_owned(), value.to_vec()));
    if let Some(content_type) = content_type {
        add("content-type", content_type.as_bytes());
    }
    let key = delivery.idempotency_key.as_str();
    add("idempotency-key", key.as_bytes());
    add("hooklatch-delivery-id", delivery.id.to_string().as_bytes());
    add("hooklatch-attempt", attempt.to_string().as_bytes());
    add("hooklatch-source", delivery.source.as_bytes());
    // An event type no header can carry (a control character from the provider's JSON) is
    // left out rather than failing every attempt; history keeps it.
    let event_type = delivery.event_type.as_deref();
    if let Some(value) = event_type.and_then(|t| HeaderValue::from_str(t).ok()) {
        add("hooklatch-event-type", value.as_bytes());
    }
    if let Some(key_bytes) = signing_key {
        let ts = now.as_secs();
        add("webhook-id", key.as_bytes());
        add("webhook-timestamp", ts.to_string().as_bytes());
        add(
            "webhook-signature",
            sign_v1(&key_bytes, key, ts, &body).as_bytes(),
        );
    }
    (body, headers)
}

impl Worker {
    /// Publishes one attempt to the destination's broker and waits for its confirm; `Ok` only
    /// once the broker has confirmed a routed message.
    async fn publish(
        &self,
        dest: &Destination,
        delivery: &LeasedDelivery,
        attempt: u32,
        now: Timestamp,
    ) -> Result<(), String> {
        let publisher = self
            .publishers
            .get(&dest.name)
            .ok_or_else(|| format!("no publisher for destination {:?}", dest.name))?;
        let (body, made_content_type) = delivery.payload();
        let content_type = made_content_type.or_else(|| {
            delivery
                .headers
                .iter()
                .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
                .and_then(|(_, value)| std::str::from_utf8(value).ok())
        });
        let delivery_id = delivery.id.to_string();
        let message = Message {
            body: &body,
            idempotency_key: delivery.idempotency_key.as_str(),
            content_type,
            source: delivery.source.as_str(),
            provider: self.providers.get(&delivery.source).copied(),
            event_type: delivery.event_type.as_deref(),
            delivery_id: &delivery_id,
            attempt,
            timestamp: u64::try_from(now.as_secs()).unwrap_or(0),
        };
        publisher.publish(&message).await.map_err(|e| {
            if matches!(e, PublishError::Returned { .. }) {
                metrics::counter!("hooklatch_amqp_returned_total", "destination" => dest.name.clone())
                    .increment(1);
            }
            e.to_string()
        })
    }
}

/// A reqwest error as a short message without the URL (which may carry credentials).
pub(crate) fn describe(err: &reqwest::Error, timeout: Duration) -> String {
    if err.is_timeout() {
        return format!("timed out after {}ms", timeout.as_millis());
    }
    let kind = if err.is_connect() {
        "connection failed"
    } else if err.is_request() || err.is_body() {
        "sending the request failed"
    } else {
        "request failed"
    };
    let mut msg = kind.to_owned();
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::routing::post;
    use hooklatch_core::store::{
        DeliveryDetail, DeliveryFilter, DisabledDestination, Dismissal, Ingest, IngestOutcome,
        Purged, Redrive, Rejected, RequestDetail, RequestFilter, RequestRecord, RequestSummary,
        StoreStats,
    };
    use hooklatch_core::{DeliveryId, IdempotencyKey, RequestId, RetryPolicy, Secret};
    use hooklatch_testkit::conformance::fixture;
    use hooklatch_testkit::MemoryStore;
    use tokio::sync::Semaphore;

    use super::*;

    /// The tries to record an attempt again are 100 ms apart, then twice as far each time, up
    /// to 5 s.
    #[test]
    fn a_failed_record_is_tried_again_ever_further_apart() {
        let ms: Vec<u128> = (0..9).map(|n| record_again_after(n).as_millis()).collect();
        assert_eq!(ms, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert_eq!(record_again_after(u32::MAX), Duration::from_secs(5));
    }

    /// A record the store never takes, each try slow (a store waiting for a connection): the
    /// tries stop by the end of the attempt's lease, however long each took; the record is
    /// given up.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tries_to_record_again_stop_when_the_lease_ends() {
        let store = Arc::new(slow_commits(false, &[]).await);
        *store.failing_records.lock().unwrap() = Some(Duration::from_millis(300));
        let worker = worker(
            store.clone(),
            "http://127.0.0.1:9/",
            1,
            Duration::from_secs(1),
        );
        let started_at = Timestamp::now();
        // Far enough for a second try on a loaded machine: the first takes 300 ms, the pause
        // after it 100 ms.
        let deadline = started_at.plus(Duration::from_secs(3));
        let mut result = fixture::attempt(
            DeliveryId(1),
            started_at,
            Some(200),
            None,
            AttemptNext::Delivered,
        );
        result.lease_until = Some(deadline);
        assert!(matches!(
            worker.record_and_lease(result).await,
            Recorded::Failed
        ));
        let tries = store.record_tries.lock().unwrap().clone();
        assert!(tries.len() >= 2, "tried again: {tries:?}");
        assert!(
            tries.iter().all(|t| *t < deadline),
            "every try started before {deadline:?}: {tries:?}"
        );
    }

    /// A [`MemoryStore`] whose `record_attempt_and_lease` commits only when the test lets it:
    /// a store whose commit is slow.
    struct SlowCommits {
        inner: MemoryStore,
        commits: Semaphore,
        recording: AtomicUsize,
        /// Every lease fails as a full store would, when set.
        full: bool,
        leases: AtomicUsize,
        next_dues: AtomicUsize,
        /// Every record fails after this long, when set (a store that takes no write).
        failing_records: std::sync::Mutex<Option<Duration>>,
        /// When each failing record started.
        record_tries: std::sync::Mutex<Vec<Timestamp>>,
    }

    impl SlowCommits {
        /// Fails a record after [`SlowCommits::failing_records`]' wait, noting its start;
        /// `None` when records do not fail.
        async fn failing_record(&self) -> Option<StoreError> {
            let wait = (*self.failing_records.lock().unwrap())?;
            self.record_tries.lock().unwrap().push(Timestamp::now());
            tokio::time::sleep(wait).await;
            Some(StoreError::Unavailable("no connection".to_owned()))
        }
    }

    #[async_trait::async_trait]
    impl Store for SlowCommits {
        async fn ingest(&self, ingest: Ingest) -> Result<IngestOutcome, StoreError> {
            self.inner.ingest(ingest).await
        }
        async fn record_rejection(&self, rejected: Rejected) -> Result<RequestId, StoreError> {
            self.inner.record_rejection(rejected).await
        }
        async fn record_import(
            &self,
            request: RequestRecord,
            keys: Vec<String>,
        ) -> Result<RequestId, StoreError> {
            self.inner.record_import(request, keys).await
        }
        async fn record_handshake(
            &self,
            request: RequestRecord,
            status: u16,
        ) -> Result<RequestId, StoreError> {
            self.inner.record_handshake(request, status).await
        }
        async fn lease_due(
            &self,
            owner: &str,
            now: Timestamp,
            lease: Duration,
            limit: u32,
        ) -> Result<Vec<LeasedDelivery>, StoreError> {
            self.leases.fetch_add(1, Ordering::SeqCst);
            if self.full {
                return Err(StoreError::Full);
            }
            self.inner.lease_due(owner, now, lease, limit).await
        }
        async fn record_attempt(&self, result: AttemptResult) -> Result<(), StoreError> {
            if let Some(err) = self.failing_record().await {
                return Err(err);
            }
            self.inner.record_attempt(result).await
        }
        async fn record_attempt_and_lease(
            &self,
            result: AttemptResult,
            now: Timestamp,
            lease: Duration,
        ) -> Result<Option<LeasedDelivery>, StoreError> {
            if let Some(err) = self.failing_record().await {
                return Err(err);
            }
            self.recording.fetch_add(1, Ordering::SeqCst);
            self.commits.acquire().await.expect("never closed").forget();
            self.inner
                .record_attempt_and_lease(result, now, lease)
                .await
        }
        async fn release_leases(&self, owner: &str, now: Timestamp) -> Result<(), StoreError> {
            self.inner.release_leases(owner, now).await
        }
        async fn wake_destination(
            &self,
            destination: &str,
            now: Timestamp,
        ) -> Result<u64, StoreError> {
            self.inner.wake_destination(destination, now).await
        }
        async fn disable_destination(
            &self,
            disabled: DisabledDestination,
        ) -> Result<bool, StoreError> {
            self.inner.disable_destination(disabled).await
        }
        async fn enable_destination(
            &self,
            destination: &str,
            now: Timestamp,
        ) -> Result<Option<u64>, StoreError> {
            self.inner.enable_destination(destination, now).await
        }
        async fn disabled_destinations(&self) -> Result<Vec<DisabledDestination>, StoreError> {
            self.inner.disabled_destinations().await
        }
        async fn wake_held(&self, now: Timestamp) -> Result<u64, StoreError> {
            self.inner.wake_held(now).await
        }
        async fn dismiss_conflict(
            &self,
            request: RequestId,
            reason: Option<String>,
            now: Timestamp,
        ) -> Result<Dismissal, StoreError> {
            self.inner.dismiss_conflict(request, reason, now).await
        }
        async fn undecided_conflicts(&self) -> Result<u64, StoreError> {
            self.inner.undecided_conflicts().await
        }
        async fn next_due(&self) -> Result<Option<Timestamp>, StoreError> {
            self.next_dues.fetch_add(1, Ordering::SeqCst);
            self.inner.next_due().await
        }
        async fn list_requests(
            &self,
            filter: RequestFilter,
        ) -> Result<Vec<RequestSummary>, StoreError> {
            self.inner.list_requests(filter).await
        }
        async fn get_request(&self, id: RequestId) -> Result<Option<RequestDetail>, StoreError> {
            self.inner.get_request(id).await
        }
        async fn list_deliveries(
            &self,
            filter: DeliveryFilter,
        ) -> Result<Vec<DeliveryDetail>, StoreError> {
            self.inner.list_deliveries(filter).await
        }
        async fn redrive(&self, id: DeliveryId, now: Timestamp) -> Result<Redrive, StoreError> {
            self.inner.redrive(id, now).await
        }
        async fn purge(&self, now: Timestamp, before: Timestamp) -> Result<Purged, StoreError> {
            self.inner.purge(now, before).await
        }
        async fn stats(&self) -> Result<StoreStats, StoreError> {
            self.inner.stats().await
        }
        async fn ping(&self) -> Result<(), StoreError> {
            self.inner.ping().await
        }
    }

    /// How many deliveries `store` holds as delivered (the memory store answers at once).
    fn delivered(store: &MemoryStore) -> usize {
        let filter = DeliveryFilter {
            state: Some(hooklatch_core::store::DeliveryState::Delivered),
            destination: None,
            before: None,
            limit: 100,
        };
        futures::executor::block_on(store.list_deliveries(filter))
            .unwrap()
            .len()
    }

    /// Disables `app` (its 410) in the worker's store and copy; returns the copy.
    async fn disable_app(worker: &Worker) -> Arc<DisabledDestinations> {
        let gone = DisabledDestination {
            destination: "app".to_owned(),
            disabled_at: Timestamp::now(),
            reason: "HTTP 410 Gone from the destination".to_owned(),
        };
        let disabled = worker.disabled.clone();
        assert!(disabled.disable(worker.store.as_ref(), gone).await.unwrap());
        disabled
    }

    /// How many deliveries are held for a disabled destination ([`HELD`]).
    fn held(store: &MemoryStore) -> usize {
        let filter = DeliveryFilter {
            state: Some(hooklatch_core::store::DeliveryState::Pending),
            destination: None,
            before: None,
            limit: 100,
        };
        futures::executor::block_on(store.list_deliveries(filter))
            .unwrap()
            .iter()
            .filter(|d| d.next_attempt_at == Some(HELD))
            .count()
    }

    /// Waits (a few seconds at most) until `done` holds.
    async fn eventually(what: &str, done: impl Fn() -> bool) {
        for _ in 0..500 {
            if done() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting until {what}");
    }

    /// One event for the destination `app`, received now.
    fn app_ingest(key: &str) -> Ingest {
        let mut ingest = fixture::ingest("stripe", &[key], b"{}", Timestamp::now());
        ingest.destinations = vec!["app".to_owned()];
        // The fixture's headers include bytes no HTTP request may carry.
        ingest.request.headers = vec![("content-type".to_owned(), b"application/json".to_vec())];
        ingest
    }

    /// A [`SlowCommits`] holding one due event per key for the destination `app`.
    async fn slow_commits(full: bool, keys: &[&str]) -> SlowCommits {
        let store = SlowCommits {
            inner: MemoryStore::default(),
            commits: Semaphore::new(0),
            recording: AtomicUsize::new(0),
            full,
            leases: AtomicUsize::new(0),
            next_dues: AtomicUsize::new(0),
            failing_records: Default::default(),
            record_tries: Default::default(),
        };
        for key in keys {
            store.ingest(app_ingest(key)).await.unwrap();
        }
        store
    }

    /// A worker delivering to `url` as the destination `app`.
    /// The test handlers' addresses.
    fn loopback() -> hooklatch_core::netguard::AddressPolicy {
        use hooklatch_core::netguard::AddressPolicy;
        AddressPolicy::new(vec![AddressPolicy::parse_entry("127.0.0.0/8").unwrap()])
    }

    fn worker(store: Arc<SlowCommits>, url: &str, concurrency: usize, poll: Duration) -> Worker {
        let destination = Destination {
            name: "app".to_owned(),
            kind: DestinationKind::Http {
                url: url.parse().unwrap(),
                secret: None,
                allow: loopback(),
                tls: Default::default(),
            },
            timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            disable_on_gone: true,
            provider_signature: Default::default(),
        };
        let enqueued = Arc::new(Notify::new());
        let listen = Arc::new(ListenHub::new(
            store.clone(),
            enqueued.clone(),
            &[],
            CancellationToken::new(),
            false,
        ));
        Worker {
            store,
            destinations: HashMap::from([("app".to_owned(), Arc::new(destination))]),
            publishers: HashMap::new(),
            providers: HashMap::new(),
            signers: HashMap::new(),
            under_way: Default::default(),
            clients: HashMap::from([(
                "app".to_owned(),
                Arc::new(crate::outbound::client(loopback(), &Default::default()).unwrap())
                    as Arc<dyn Post>,
            )]),
            owner: "test-worker".to_owned(),
            concurrency,
            poll_interval: poll,
            lease: Duration::from_secs(60),
            enqueued,
            handoff: Arc::new(Handoff::new(
                "test-worker".to_owned(),
                Duration::from_secs(60),
                concurrency,
            )),
            listen,
            disabled: Default::default(),
            retry_scheduled: AtomicBool::new(false),
        }
    }

    /// A lease that fails (a full store) is tried again after the poll interval, not at once:
    /// the worker used to ask the store again straight away, thousands of times a second.
    #[tokio::test]
    async fn a_failed_lease_waits_the_poll_interval_before_the_next_try() {
        let store = Arc::new(slow_commits(true, &["evt_1"]).await);
        let worker = worker(
            store.clone(),
            "http://127.0.0.1:9/unused",
            4,
            Duration::from_millis(100),
        );
        let cancel = CancellationToken::new();
        let running = tokio::spawn(worker.run(cancel.clone(), Duration::from_secs(1)));
        tokio::time::sleep(Duration::from_millis(550)).await;
        cancel.cancel();
        running.await.unwrap();
        // One try at start and one per 100 ms poll: about six in 550 ms, never hundreds.
        let leases = store.leases.load(Ordering::SeqCst);
        assert!(
            (1..=12).contains(&leases),
            "{leases} lease attempts in 550 ms"
        );
    }

    #[tokio::test]
    async fn a_busy_task_attempts_its_next_delivery_while_the_last_attempt_commits() {
        let (url, received) = counting_sink().await;

        // Three events for one destination, due now.
        let store = Arc::new(slow_commits(false, &["evt_1", "evt_2", "evt_3"]).await);
        // One task: whatever overlaps is the task's own pipelining.
        let worker = worker(store.clone(), &url, 1, Duration::from_secs(60));
        let cancel = CancellationToken::new();
        let running = tokio::spawn(worker.run(cancel.clone(), Duration::from_secs(5)));

        // The first attempt's commit is held: the second delivery goes out meanwhile, and
        // the task then waits for that commit before it records the second.
        eventually("two deliveries were sent", || {
            received.load(Ordering::SeqCst) == 2
        })
        .await;
        // Only the first attempt is being recorded: the task waits for that commit before it
        // records the second, and no third row is leased until it does.
        assert_eq!(store.recording.load(Ordering::SeqCst), 1);

        // Each commit let through brings the next.
        store.commits.add_permits(1);
        eventually("three deliveries were sent", || {
            received.load(Ordering::SeqCst) == 3
        })
        .await;
        store.commits.add_permits(2);
        eventually("every attempt was recorded", || {
            store.recording.load(Ordering::SeqCst) == 3
        })
        .await;
        eventually("every delivery was recorded as delivered", || {
            delivered(&store.inner) == 3
        })
        .await;
        assert_eq!(received.load(Ordering::SeqCst), 3, "nothing was sent twice");
        cancel.cancel();
        running.await.unwrap();
    }

    /// An enable that comes between a worker's "disabled: put it back" and the put-back's
    /// commit finds the row leased and wakes nothing; the worker, looking again once its
    /// put-back is committed, wakes it (`hooklatch_http::disabled`).
    #[tokio::test]
    async fn a_delivery_put_back_while_its_destination_is_enabled_is_woken_by_the_worker() {
        let (url, received) = counting_sink().await;
        let store = Arc::new(slow_commits(false, &["evt_1"]).await);
        let worker = worker(store.clone(), &url, 1, Duration::from_secs(60));
        let disabled = disable_app(&worker).await;
        let cancel = CancellationToken::new();
        let running = tokio::spawn(worker.run(cancel.clone(), Duration::from_secs(5)));
        eventually("the put-back is being committed", || {
            store.recording.load(Ordering::SeqCst) == 1
        })
        .await;
        assert_eq!(
            received.load(Ordering::SeqCst),
            0,
            "nothing sent while disabled"
        );
        assert_eq!(
            disabled
                .enable(store.as_ref(), "app", Timestamp::now())
                .await
                .unwrap(),
            Some(0),
            "the row is still leased: the enable wakes nothing"
        );
        store.commits.add_permits(10);
        eventually("the delivery goes out", || delivered(&store.inner) == 1).await;
        assert_eq!(received.load(Ordering::SeqCst), 1);
        cancel.cancel();
        running.await.unwrap();
    }

    /// A disabled destination's deliveries are put back until it is enabled ([`HELD`]), not
    /// for a while: a held backlog is not leased again. When the store has the destination
    /// enabled while this instance still holds its deliveries (it heard late, as an instance
    /// on a shared store can), the sweep wakes them and they go out, once each.
    #[tokio::test]
    async fn held_deliveries_wait_for_the_enable_and_the_sweep_wakes_what_it_missed() {
        let (url, received) = counting_sink().await;
        let store = Arc::new(slow_commits(false, &["evt_1", "evt_2"]).await);
        store.commits.add_permits(1_000);
        let worker = worker(store.clone(), &url, 2, Duration::from_millis(20));
        let disabled = disable_app(&worker).await;
        let enqueued = worker.enqueued.clone();
        let cancel = CancellationToken::new();
        let running = tokio::spawn(worker.run(cancel.clone(), Duration::from_secs(5)));
        eventually("both deliveries are held", || held(&store.inner) == 2).await;

        // Enabled in the store behind this instance's back: it wakes both, and this instance,
        // still holding the destination disabled, puts them back again.
        assert_eq!(
            store
                .inner
                .enable_destination("app", Timestamp::now())
                .await
                .unwrap(),
            Some(2)
        );
        eventually("both deliveries are held again", || held(&store.inner) == 2).await;
        assert_eq!(received.load(Ordering::SeqCst), 0);

        // It hears of the enable (a reload), and the sweep finds what it held meanwhile.
        disabled.reload(store.as_ref()).await.unwrap();
        let sweep = tokio::spawn(sweep_held(
            store.clone(),
            enqueued,
            Duration::from_secs(3600),
            cancel.clone(),
        ));
        eventually("both deliveries go out", || delivered(&store.inner) == 2).await;
        assert_eq!(received.load(Ordering::SeqCst), 2);
        cancel.cancel();
        running.await.unwrap();
        sweep.await.unwrap();
    }

    /// A sink answering 200 to every POST, and how many it got.
    async fn counting_sink() -> (String, Arc<AtomicUsize>) {
        let received = Arc::new(AtomicUsize::new(0));
        let counter = received.clone();
        let app = axum::Router::new().route(
            "/sink",
            post(move || {
                let counter = counter.clone();
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    "ok"
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/sink", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, received)
    }

    /// A delivery of `svix:msg_provider` to `destination`, received at `received`, built by hand.
    fn hand_built(destination: &str, received: Timestamp) -> LeasedDelivery {
        LeasedDelivery {
            id: DeliveryId(7),
            request_id: RequestId(3),
            source: "svix".to_owned(),
            event_key: "msg_provider".to_owned(),
            event_type: None,
            destination: destination.to_owned(),
            idempotency_key: IdempotencyKey::from_stored("svix:msg_provider".to_owned()),
            attempts: 0,
            round_started_at: received,
            method: "POST".to_owned(),
            path: "/in/svix".to_owned(),
            headers: Vec::new(),
            body: bytes::Bytes::from_static(b"{}"),
            lease_until: None,
        }
    }

    /// A delivery to a destination this instance does not have: dead-lettered where no other
    /// instance could have it (SQLite); on a shared store put back uncounted for one that may
    /// (a rolling deploy that adds a destination), as soon as a listener's row would be.
    #[tokio::test]
    async fn a_destination_only_another_instance_has_is_left_to_it_on_a_shared_store() {
        let store = Arc::new(slow_commits(false, &[]).await);
        let received = Timestamp::now();
        let delivery = hand_built("added-elsewhere", received);
        let alone = worker(
            store.clone(),
            "http://127.0.0.1:9/",
            1,
            Duration::from_secs(1),
        );
        let result = alone.deliver(delivery.clone()).await;
        assert_eq!(result.next, AttemptNext::DeadLetter);
        assert!(
            result.error.as_deref()
                == Some("destination \"added-elsewhere\" is no longer configured"),
            "{result:?}"
        );

        let mut shared = worker(
            store.clone(),
            "http://127.0.0.1:9/",
            1,
            Duration::from_secs(1),
        );
        shared.listen = Arc::new(ListenHub::new(
            store,
            shared.enqueued.clone(),
            &[],
            CancellationToken::new(),
            true,
        ));
        let result = shared.deliver(delivery).await;
        let AttemptNext::Wait(until) = result.next else {
            panic!("put back: {result:?}");
        };
        let wait = until.since(result.started_at);
        assert!(
            (crate::listen::AWAY_RECHECK_SHARED_MIN..=crate::listen::AWAY_RECHECK_SHARED)
                .contains(&wait),
            "{wait:?}"
        );
        assert_eq!(result.error, None);
    }

    /// A standard-webhooks source's signature reaches a destination without a secret as the
    /// provider sent it (the application may verify it); a signing destination gets the
    /// gateway's in its place, under both libraries' names, and never two.
    #[test]
    fn a_providers_standard_webhooks_headers_go_through_unless_the_destination_signs() {
        let provider = [
            ("content-type", "application/json"),
            ("webhook-id", "msg_provider"),
            ("webhook-timestamp", "1700000000"),
            ("webhook-signature", "v1,provider="),
            ("svix-id", "msg_provider"),
            ("svix-signature", "v1,provider="),
            ("idempotency-key", "from-the-provider"),
            ("host", "gateway.example"),
        ];
        let mut delivery = hand_built("app", Timestamp::from_secs(1_700_000_000));
        delivery.headers = provider
            .iter()
            .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
            .collect();
        let now = Timestamp::from_secs(1_700_000_100);
        let sent = |secret: Option<&Secret>| -> Vec<(String, String)> {
            let (_, headers) = outgoing(&delivery, 1, secret, None, now);
            headers
                .into_iter()
                .map(|(n, v)| (n, String::from_utf8(v).unwrap()))
                .collect()
        };
        let values = |headers: &[(String, String)], name: &str| -> Vec<String> {
            headers
                .iter()
                .filter(|(n, _)| n == name)
                .map(|(_, v)| v.clone())
                .collect()
        };

        let plain = sent(None);
        for (name, value) in &provider[..6] {
            assert_eq!(values(&plain, name), [*value], "{name}");
        }
        assert_eq!(values(&plain, "idempotency-key"), ["svix:msg_provider"]);
        assert!(values(&plain, "host").is_empty());

        let secret = Secret::from_text("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD");
        let signed = sent(Some(&secret));
        assert_eq!(values(&signed, "webhook-id"), ["svix:msg_provider"]);
        assert_eq!(values(&signed, "webhook-timestamp"), ["1700000100"]);
        let signature = values(&signed, "webhook-signature");
        assert!(
            signature.len() == 1 && signature[0] != "v1,provider=",
            "{signature:?}"
        );
        for name in ["svix-id", "svix-signature"] {
            assert!(values(&signed, name).is_empty(), "{name}");
        }
    }

    /// A signer for a source of `provider` with `secrets`.
    fn provider_signer(provider: &str, secrets: &[&str]) -> ProviderSigner {
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        let adapter = crate::fixtures::signer(provider, &secrets[0]).expect("a provider");
        ProviderSigner {
            adapter: Arc::from(adapter),
            secrets,
        }
    }

    impl ProviderSigner {
        /// The headers the provider signs `delivery`'s body with, under event `key`, at `at`,
        /// with the first secret: what the provider sent.
        fn headers(
            &self,
            delivery: &LeasedDelivery,
            key: &str,
            at: Timestamp,
        ) -> Vec<(String, String)> {
            self.adapter.sign(&SignRequest {
                body: &delivery.body,
                secret: &self.secrets[0],
                now: at,
                event_key: key,
                event_type: None,
                url: "",
            })
        }
    }

    /// `delivery`'s headers as sent with `signer` at `now` (no destination secret).
    fn sent_with(
        delivery: &LeasedDelivery,
        signer: Option<&ProviderSigner>,
        now: Timestamp,
    ) -> Vec<(String, String)> {
        let (_, headers) = outgoing(delivery, 1, None, signer, now);
        headers
            .into_iter()
            .map(|(n, v)| (n, String::from_utf8(v).unwrap()))
            .collect()
    }

    /// Whether `headers` verify for `provider` under `secret` at `now` with the libraries'
    /// 300 s tolerance.
    fn verifies_at(
        provider: &str,
        secret: &str,
        delivery: &LeasedDelivery,
        headers: &[(String, String)],
        now: Timestamp,
    ) -> bool {
        let secret = Secret::from_text(secret);
        let adapter = crate::fixtures::signer(provider, &secret).unwrap();
        let mut map = http::HeaderMap::new();
        for (n, v) in headers {
            map.append(
                http::HeaderName::from_bytes(n.as_bytes()).unwrap(),
                http::HeaderValue::from_str(v).unwrap(),
            );
        }
        let req = InboundRequest {
            path_and_query: &delivery.path,
            headers: &map,
            body: &delivery.body,
            now,
        };
        adapter
            .verify(&req, &[secret], Duration::from_secs(300))
            .is_ok()
    }

    /// An hour-late attempt of a Stripe event is signed again at its own time, with the one
    /// of the source's secrets that signed the original (here the second, as in a rotation),
    /// so the application's Stripe library takes it; `provider_signature = "original"` (no
    /// signer) sends the header as received, which that library refuses by then; a request no
    /// secret of the source signed (an import without its signature) goes as received.
    #[test]
    fn a_late_attempt_carries_the_providers_signature_made_again_at_its_own_time() {
        let (old, new) = ("whsec_old_secret_0123", "whsec_new_secret_4567");
        let signer = provider_signer("stripe", &[new, old]);
        let received = Timestamp::from_secs(1_780_000_000);
        let mut delivery = hand_built("app", received);
        delivery.source = "stripe".to_owned();
        delivery.path = "/in/stripe".to_owned();
        delivery.body = bytes::Bytes::from_static(br#"{"id":"evt_late","object":"event"}"#);
        let signed = provider_signer("stripe", &[old]).headers(&delivery, "evt_late", received);
        delivery.headers =
            std::iter::once(("content-type".to_owned(), b"application/json".to_vec()))
                .chain(
                    signed
                        .into_iter()
                        .map(|(n, v)| (n.to_ascii_lowercase(), v.into_bytes())),
                )
                .collect();
        let late = received.plus(Duration::from_secs(3600));

        let fresh = sent_with(&delivery, Some(&signer), late);
        let stripe_signatures: Vec<&str> = fresh
            .iter()
            .filter(|(n, _)| n == "stripe-signature")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(stripe_signatures.len(), 1, "{fresh:?}");
        assert!(
            stripe_signatures[0].starts_with(&format!("t={},", late.as_secs())),
            "{fresh:?}"
        );
        assert!(
            verifies_at("stripe", old, &delivery, &fresh, late),
            "{fresh:?}"
        );
        assert!(!verifies_at("stripe", new, &delivery, &fresh, late));
        let content_type = fresh.iter().find(|(n, _)| n == "content-type");
        assert_eq!(
            content_type.map(|(_, v)| v.as_str()),
            Some("application/json")
        );

        let original = sent_with(&delivery, None, late);
        assert!(!verifies_at("stripe", old, &delivery, &original, late));
        assert!(verifies_at("stripe", old, &delivery, &original, received));

        let unsigned_by_us = provider_signer("stripe", &[new]);
        assert_eq!(sent_with(&delivery, Some(&unsigned_by_us), late), original);
    }

    /// A standard-webhooks source's late event: the provider's headers, under either
    /// library's names, are replaced by fresh `webhook-*` ones, never both sets.
    #[test]
    fn a_standard_webhooks_event_is_signed_again_under_one_set_of_names() {
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let signer = provider_signer("standard-webhooks", &[secret]);
        let received = Timestamp::from_secs(1_780_000_000);
        let mut delivery = hand_built("app", received);
        let signed = signer.headers(&delivery, "msg_provider", received);
        delivery.headers = signed
            .into_iter()
            .map(|(n, v)| {
                (
                    n.to_ascii_lowercase().replace("webhook-", "svix-"),
                    v.into_bytes(),
                )
            })
            .collect();
        let late = received.plus(Duration::from_secs(86_400));
        let fresh = sent_with(&delivery, Some(&signer), late);
        let names: Vec<&str> = fresh
            .iter()
            .map(|(n, _)| n.as_str())
            .filter(|n| n.starts_with("svix-") || n.starts_with("webhook-"))
            .collect();
        assert_eq!(
            names,
            ["webhook-id", "webhook-timestamp", "webhook-signature"],
            "{fresh:?}"
        );
        assert!(verifies_at(
            "standard-webhooks",
            secret,
            &delivery,
            &fresh,
            late
        ));
    }

    /// An event type with a control character cannot be a header value: the delivery goes
    /// out without `hooklatch-event-type` instead of failing on every attempt.
    #[tokio::test]
    async fn an_event_type_no_header_can_carry_does_not_stop_the_delivery() {
        let (url, received) = counting_sink().await;
        let store = Arc::new(slow_commits(false, &[]).await);
        store.commits.add_permits(10);
        let mut ingest = app_ingest("evt_nul");
        ingest.events[0].event_type = Some("invoice.\0paid\n".to_owned());
        store.ingest(ingest).await.unwrap();
        let worker = worker(store.clone(), &url, 1, Duration::from_secs(60));
        let cancel = CancellationToken::new();
        let running = tokio::spawn(worker.run(cancel.clone(), Duration::from_secs(5)));
        eventually("the event was delivered", || delivered(&store.inner) == 1).await;
        assert_eq!(received.load(Ordering::SeqCst), 1, "on the first attempt");
        cancel.cancel();
        running.await.unwrap();
    }

    /// Once the worker found nothing due, a new event written leased to it is attempted from
    /// the hand-off: the store is asked for no lease, and the attempt is its only other write.
    #[tokio::test]
    async fn a_caught_up_worker_attempts_handed_off_events_without_leasing_them() {
        let (url, received) = counting_sink().await;
        let (store, handoff, cancel, running) = caught_up_worker(&url, 2).await;
        assert_eq!(store.leases.load(Ordering::SeqCst), 1);

        hand_off_one_by_one(&store, &handoff, 2).await;
        assert_eq!(received.load(Ordering::SeqCst), 2, "nothing was sent twice");
        assert_eq!(
            store.leases.load(Ordering::SeqCst),
            1,
            "no lease beyond the first look"
        );
        assert_eq!(store.recording.load(Ordering::SeqCst), 2, "one write each");
        cancel.cancel();
        running.await.unwrap();
    }

    /// A worker delivering to `url` with `concurrency` tasks, on a store with nothing due
    /// and commits let through, once its first look at the store found it caught up.
    async fn caught_up_worker(
        url: &str,
        concurrency: usize,
    ) -> (
        Arc<SlowCommits>,
        Arc<Handoff>,
        CancellationToken,
        tokio::task::JoinHandle<()>,
    ) {
        let store = Arc::new(slow_commits(false, &[]).await);
        store.commits.add_permits(1000);
        let worker = worker(store.clone(), url, concurrency, Duration::from_secs(60));
        let handoff = worker.handoff.clone();
        let cancel = CancellationToken::new();
        let running = tokio::spawn(worker.run(cancel.clone(), Duration::from_secs(5)));
        eventually("the worker found nothing due", || handoff.caught_up()).await;
        (store, handoff, cancel, running)
    }

    /// Lets every other task of this test's one-thread runtime run until it waits on
    /// something outside it (a socket, a timer).
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    /// Ingests one event for a caught-up worker with its delivery written leased to it, and
    /// hands the delivery over, as the ingest route does.
    async fn hand_off(store: &SlowCommits, handoff: &Arc<Handoff>, key: &str) {
        let mut ingest = app_ingest(key);
        let reservation = handoff
            .reserve(ingest.most_deliveries(), ingest.request.received_at)
            .expect("caught up, with room");
        ingest.lease = Some(reservation.lease.clone());
        let outcome = store.ingest(ingest.clone()).await.unwrap();
        reservation.fulfil(&ingest, &outcome);
    }

    /// Hands `n` events, one after the other, to a caught-up worker and waits for each to
    /// be delivered and its task to end.
    async fn hand_off_one_by_one(store: &SlowCommits, handoff: &Arc<Handoff>, n: usize) {
        for i in 0..n {
            hand_off(store, handoff, &format!("evt_{i}")).await;
            eventually("the event was delivered", || {
                delivered(&store.inner) == i + 1
            })
            .await;
            // The task ends once its attempt is recorded, as it does between events that do
            // not come back to back; the dispatcher then takes its turn (this test's runtime
            // has one thread: yielding runs it).
            settle().await;
        }
    }

    /// Each handed-off event ends a task, and the dispatcher then works out how long it may
    /// sleep: it uses the store's recent answer to "when is the next row due?" instead of
    /// asking again after every event.
    #[tokio::test]
    async fn the_dispatcher_does_not_ask_for_the_next_due_time_after_every_event() {
        let (url, received) = counting_sink().await;
        let (store, handoff, cancel, running) = caught_up_worker(&url, 4).await;

        let started = Instant::now();
        let events = 30;
        hand_off_one_by_one(&store, &handoff, events).await;
        let asked = store.next_dues.load(Ordering::SeqCst);
        // One answer per NEXT_DUE_REUSE at most, and the first; asking after every event
        // would be one per event.
        let allowed = 2 + (started.elapsed().as_millis() / NEXT_DUE_REUSE.as_millis()) as usize;
        assert!(
            asked <= allowed,
            "asked {asked} times for {events} events in {:?}",
            started.elapsed()
        );
        assert_eq!(
            received.load(Ordering::SeqCst),
            events,
            "nothing was sent twice"
        );
        cancel.cancel();
        running.await.unwrap();
    }

    /// A delivery handed over while a task is still busy may be taken by that task before the
    /// dispatcher wakes: the dispatcher, finding nothing, does not then ask the store for a
    /// lease (the store has nothing new for a caught-up worker; on PostgreSQL an empty lease
    /// is a statement and a transaction of its own, and at 1,500 events/s there was one for
    /// most ingest batches).
    #[tokio::test]
    async fn a_hand_off_a_task_took_first_does_not_make_the_dispatcher_lease() {
        let (url, received) = counting_sink().await;
        let (store, handoff, cancel, running) = caught_up_worker(&url, 4).await;
        assert_eq!(store.leases.load(Ordering::SeqCst), 1, "the first look");

        // Handed over, then taken (as a busy task takes it) before the dispatcher runs.
        hand_off(&store, &handoff, "evt_taken").await;
        assert_eq!(handoff.take(1, Timestamp::now()).len(), 1);
        // The dispatcher wakes (this test's runtime has one thread: it runs now) and finds
        // the queue empty.
        settle().await;
        assert_eq!(
            store.leases.load(Ordering::SeqCst),
            1,
            "no lease after a hand-off taken elsewhere"
        );

        // The worker still delivers what is handed over.
        hand_off_one_by_one(&store, &handoff, 1).await;
        assert_eq!(received.load(Ordering::SeqCst), 1);
        assert_eq!(store.leases.load(Ordering::SeqCst), 1);
        cancel.cancel();
        running.await.unwrap();
    }
}
