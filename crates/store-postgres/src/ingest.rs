//! The ingest job: record the request, claim each key, queue new events. Runs inside a
//! writer's group-commit transaction ([`crate::writer`]). A one-event ingest does it in one
//! statement ([`insert_and_claim`]), and the one-event ingests of a batch in one statement
//! together ([`insert_and_claim_many`]); what is left (a key held by another request, several
//! events) goes claim by claim.
//!
//! A claim is `INSERT … ON CONFLICT (source, key) DO NOTHING` on the claims table's primary
//! key. When another transaction (another batch of this instance, or another instance) holds
//! an uncommitted insert of the same key, PostgreSQL makes this insert wait on the unique
//! index until that transaction ends: after a commit the insert does nothing and the key reads
//! as a duplicate (or conflict), after a rollback it inserts and the claim is ours. The wait
//! is bounded by `lock_timeout` (the store's wait limit).
//!
//! `DO NOTHING` rather than `DO UPDATE … WHERE expired`: an `ON CONFLICT DO UPDATE` locks the
//! existing row even when its `WHERE` is false, so every duplicate would hold the claim's row
//! lock until its batch commits and duplicates of one event would queue behind each other. An
//! expired claim is rare; it is replaced by an `UPDATE … WHERE expires_at <= now`, which
//! re-checks the row under its lock, so two copies racing to replace one expired claim make
//! one claim.

use hooklatch_core::store::{
    Claim, Ingest, IngestLease, IngestOutcome, KeyDecision, NewEvent, Rejected, RequestRecord,
    Verdict,
};
use hooklatch_core::{DeliveryId, IdempotencyKey, RequestId, Timestamp};
use sqlx::{PgConnection, Row};

use hooklatch_core::headers;

/// How often a claim is tried again when its row changed between two statements (purged, or
/// replaced by a concurrent copy). Each retry needs another transaction to commit in between,
/// so this is never reached in practice.
const CLAIM_TRIES: usize = 4;

/// Text as PostgreSQL can store it (no NUL): [`hooklatch_core::store::storable_text`].
pub(crate) use hooklatch_core::store::storable_text as text;

/// The smallest `(source, key)` the ingest claims, the order jobs run in within a batch (jobs
/// without keys, `None`, go first).
/// The owner of the ingest's [`lease`](Ingest::lease), if it has one, as stored.
fn lease_owner(ingest: &Ingest) -> Option<String> {
    ingest.lease.as_ref().map(|l| l.owner.clone())
}

pub(crate) fn lock_order(ingest: &Ingest) -> Option<(&str, &str)> {
    ingest
        .events
        .iter()
        .map(|e| (ingest.source.as_str(), e.key.as_str()))
        .min()
}

pub(crate) async fn ingest(
    conn: &mut PgConnection,
    ingest: &Ingest,
) -> Result<IngestOutcome, sqlx::Error> {
    // The common case, one event claimed here: one round trip when the claim is new.
    if let Some(event) = one_event_claimed_here(ingest) {
        let keys = [event.key.as_str().to_owned()];
        let (request_id, deliveries) = insert_and_claim(conn, ingest, event, &keys).await?;
        return settle(conn, ingest, request_id, deliveries).await;
    }
    let keys: Vec<String> = ingest
        .events
        .iter()
        .map(|e| e.key.as_str().to_owned())
        .collect();
    let request_id =
        insert_request(conn, &ingest.request, Verdict::Accepted, None, 200, &keys).await?;
    claim_all(conn, ingest, request_id, false).await
}

/// The event of a one-event ingest whose key is claimed in this store (no external key store
/// decided it): the ingests [`insert_and_claim`] and [`insert_and_claim_many`] take.
pub(crate) fn one_event_claimed_here(ingest: &Ingest) -> Option<&NewEvent> {
    match (ingest.events.as_slice(), &ingest.keys) {
        ([event], KeyDecision::Store) => Some(event),
        _ => None,
    }
}

/// Finishes a one-event ingest after its request was recorded and its claim tried in one
/// statement: `deliveries` are those the new claim queued, or `None` when another request
/// holds the key (its key is listed in `request_keys` already).
pub(crate) async fn settle(
    conn: &mut PgConnection,
    ingest: &Ingest,
    request_id: RequestId,
    deliveries: Option<Vec<DeliveryId>>,
) -> Result<IngestOutcome, sqlx::Error> {
    match deliveries {
        Some(deliveries) => Ok(claimed(ingest, request_id, deliveries)),
        // Held by another request: the general path reads it (or replaces it if it has
        // expired).
        None => claim_all(conn, ingest, request_id, true).await,
    }
}

/// The outcome of a one-event ingest whose claim is new, with the deliveries it queued.
pub(crate) fn claimed(
    ingest: &Ingest,
    request_id: RequestId,
    deliveries: Vec<DeliveryId>,
) -> IngestOutcome {
    IngestOutcome {
        request_id,
        claims: ingest
            .events
            .first()
            .map(|event| (event.key.clone(), Claim::New { deliveries }))
            .into_iter()
            .collect(),
    }
}

/// The SQLSTATE (`division_by_zero`) with which [`insert_and_claim_many`] run `alone` fails
/// on purpose when a key is held by a claim it cannot read. A genuine division by zero
/// would be read the same way, and would only make its batch run again in a transaction.
pub(crate) const HELD_ELSEWHERE: &str = "22012";

/// Claims every key of a recorded request and queues its new events. `listed`: the keys are
/// in `request_keys` already.
async fn claim_all(
    conn: &mut PgConnection,
    ingest: &Ingest,
    request_id: RequestId,
    listed: bool,
) -> Result<IngestOutcome, sqlx::Error> {
    let mut claimed: Vec<Option<Claimed>> = vec![None; ingest.events.len()];
    // Keys are claimed in key order, the same order in every batch and on every instance, so
    // two transactions claiming overlapping keys wait for each other instead of deadlocking.
    // Deliveries are then queued, and answers given, in event order (as SQLite does).
    let mut order: Vec<usize> = (0..ingest.events.len()).collect();
    order.sort_by_key(|&i| ingest.events[i].key.as_str());
    // Whether a claim row made here points at this request (not so for an external key
    // store's decision, even a new one).
    let mut claimed_here = vec![false; ingest.events.len()];
    for i in order {
        claimed[i] = Some(match &ingest.keys {
            // An external key store decided; an event it said nothing about is claimed here.
            KeyDecision::Decided(decided) if i < decided.len() => match &decided[i] {
                Claim::New { .. } => Claimed::Ours,
                earlier => Claimed::Earlier(earlier.clone()),
            },
            _ => {
                let found = claim(conn, ingest, &ingest.events[i], request_id).await?;
                claimed_here[i] = matches!(found, Claimed::Ours);
                found
            }
        });
    }
    // A claim made here points at this request, and history finds the request through it;
    // every other key it carries is listed in `request_keys`.
    if !listed {
        let unclaimed: Vec<&str> = ingest
            .events
            .iter()
            .zip(&claimed_here)
            .filter(|(_, here)| !**here)
            .map(|(event, _)| event.key.as_str())
            .collect();
        list_keys(conn, request_id, &unclaimed).await?;
    }
    let mut claims = Vec::with_capacity(ingest.events.len());
    for (event, claimed) in ingest.events.iter().zip(claimed) {
        let claim = match claimed.expect("every event was claimed") {
            Claimed::Ours => queue(conn, ingest, event, request_id).await?,
            Claimed::Earlier(claim) => claim,
        };
        claims.push((event.key.clone(), claim));
    }
    let outcome = IngestOutcome { request_id, claims };
    let verdict = outcome.verdict();
    if verdict != Verdict::Accepted {
        sqlx::query("UPDATE requests SET verdict = $1 WHERE id = $2")
            .bind(verdict.as_str())
            .bind(request_id.0)
            .execute(&mut *conn)
            .await?;
    }
    Ok(outcome)
}

/// Records a one-event request, claims its key and, when the claim is new, queues its
/// deliveries, in one statement (one round trip instead of three); when it is not, lists the
/// key in `request_keys`. `None`: another request
/// holds the key (the insert did nothing, and waited first if that request had not
/// committed); the request is recorded either way.
async fn insert_and_claim(
    conn: &mut PgConnection,
    ingest: &Ingest,
    event: &NewEvent,
    keys: &[String],
) -> Result<(RequestId, Option<Vec<DeliveryId>>), sqlx::Error> {
    let request = &ingest.request;
    let now = request.received_at;
    let idempotency_key = IdempotencyKey::new(&ingest.source, &event.key);
    let row = bind_request(
        sqlx::query(
            "WITH r AS (
                INSERT INTO requests (received_at, source, method, path, peer, headers, body,
                    body_truncated, verdict, reason, status, keys)
                VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'accepted', NULL, 200, $9)
                RETURNING id),
             c AS (
                INSERT INTO claims (source, key, body_sha256, request_id, claimed_at, expires_at)
                SELECT $10, $11, $12, r.id, $1, $13 FROM r
                ON CONFLICT (source, key) DO NOTHING
                RETURNING request_id),
             k AS (
                INSERT INTO request_keys (key, request_id)
                SELECT DISTINCT u.key, r.id FROM r, unnest($9::text[]) AS u (key)
                WHERE NOT EXISTS (SELECT 1 FROM c)
                ON CONFLICT DO NOTHING),
             d AS (
                INSERT INTO deliveries (request_id, source, event_key, event_type, destination,
                    idempotency_key, state, received_at, round_started_at, next_attempt_at,
                    updated_at, lease_owner, lease_until)
                SELECT c.request_id, $10, $11, $14, x.destination, $15, 'pending', $1, $1, $1, $1,
                    $17, $18
                FROM c, unnest($16::text[]) WITH ORDINALITY AS x (destination, n)
                ORDER BY x.n
                RETURNING id)
             SELECT r.id, EXISTS (SELECT 1 FROM c), ARRAY(SELECT id FROM d ORDER BY id) FROM r",
        ),
        request,
    )
    .bind(keys)
    .bind(ingest.source.as_str())
    .bind(event.key.as_str())
    .bind(&ingest.content_sha256(event)[..])
    .bind(now.plus(ingest.retention).0)
    .bind(event.event_type.as_deref().map(text))
    .bind(idempotency_key.as_str())
    .bind(&ingest.destinations)
    .bind(lease_owner(ingest))
    .bind(ingest.lease.as_ref().map(|l| l.until.0))
    .fetch_one(&mut *conn)
    .await?;
    inserted(&row)
}

/// A row of [`insert_and_claim`]'s and [`insert_and_claim_many`]'s answer: the request, and
/// whether its claim is new (then with the deliveries it queued).
fn inserted(
    row: &sqlx::postgres::PgRow,
) -> Result<(RequestId, Option<Vec<DeliveryId>>), sqlx::Error> {
    let request_id = RequestId(row.try_get(0)?);
    let claimed: bool = row.try_get(1)?;
    let deliveries: Vec<i64> = row.try_get(2)?;
    Ok((
        request_id,
        claimed.then(|| deliveries.into_iter().map(DeliveryId).collect()),
    ))
}

/// The event of an ingest handed to a batched statement, which takes only
/// [`one_event_claimed_here`] ingests.
fn batched_event(ingest: &Ingest) -> Result<&NewEvent, sqlx::Error> {
    one_event_claimed_here(ingest).ok_or_else(|| {
        sqlx::Error::Protocol("a batched ingest must carry one event claimed here".into())
    })
}

/// What [`insert_and_claim_many`] did for one ingest.
pub(crate) enum Batched {
    /// Its request is recorded and its claim is new, with the deliveries it queued.
    Claimed(RequestId, Vec<DeliveryId>),
    /// Its request is recorded with its verdict, decided by a live claim of another request
    /// that the statement could read.
    Settled(IngestOutcome),
    /// Its request is recorded, but the key was held by a claim the statement could not read
    /// (committed while it waited), or by an expired one: [`settle_held_many`] reads it.
    Held(RequestId),
}

/// [`insert_and_claim`] for many one-event ingests of a batch in one statement: one round
/// trip instead of one each. Answers in the order given.
///
/// Request ids are drawn from the identity's sequence first, so every row of the statement
/// knows its request. The sequence is looked up once per statement (a scalar subquery, which
/// PostgreSQL runs once), not once per row: the lookup was 2.4 % of PostgreSQL's CPU at
/// 2,000 req/s. Claims are inserted in `(source, key)` order, as the batch's jobs would
/// claim them, and of two copies of one key in the batch the earlier one claims it (the later
/// one's insert does nothing, as it would in a statement of its own after the first).
///
/// The statement also knows who holds a key its copy could not claim, when it can (`held`):
/// an earlier copy in the same statement that claimed it, or a live claim in the statement's
/// snapshot (committed before it; read by key, `h`). Such a copy is recorded with its verdict
/// (duplicate or conflict) at once, without the two statements of [`settle_held_many`]. A
/// live claim cannot change under the statement: only an expired claim is ever replaced or
/// purged.
///
/// `alone`: the statement is its batch's only one, committed as it ends with no transaction
/// around it. A copy whose key is held where the statement cannot read it (a claim committed
/// while the statement waited for it, or an expired one) is then not recorded with its
/// request marked accepted, to be settled by the next statements: the statement fails
/// instead, dividing by zero ([`HELD_ELSEWHERE`]; the divisor is not a constant, which the
/// planner would fold and fail every time), and nothing of it is committed.
pub(crate) async fn insert_and_claim_many(
    conn: &mut PgConnection,
    ingests: &[&Ingest],
    alone: bool,
) -> Result<Vec<Batched>, sqlx::Error> {
    let n = ingests.len();
    let mut received_at = Vec::with_capacity(n);
    let mut source = Vec::with_capacity(n);
    let mut method = Vec::with_capacity(n);
    let mut path = Vec::with_capacity(n);
    let mut peer = Vec::with_capacity(n);
    let mut header_bytes = Vec::with_capacity(n);
    let mut body = Vec::with_capacity(n);
    let mut body_truncated = Vec::with_capacity(n);
    let mut key = Vec::with_capacity(n);
    let mut sha = Vec::with_capacity(n);
    let mut expires_at = Vec::with_capacity(n);
    let mut event_type = Vec::with_capacity(n);
    let mut idempotency_key = Vec::with_capacity(n);
    let mut lease_owners = Vec::with_capacity(n);
    let mut lease_until = Vec::with_capacity(n);
    let mut destination_of = Vec::new();
    let mut destination = Vec::new();
    for (i, ingest) in ingests.iter().enumerate() {
        let event = batched_event(ingest)?;
        let request = &ingest.request;
        received_at.push(request.received_at.0);
        source.push(text(&request.source).into_owned());
        method.push(text(&request.method).into_owned());
        path.push(text(&request.path).into_owned());
        peer.push(request.peer.as_deref().map(|p| text(p).into_owned()));
        header_bytes.push(headers::encode(&request.headers));
        body.push(&request.body[..]);
        body_truncated.push(request.body_truncated);
        key.push(event.key.as_str());
        sha.push(ingest.content_sha256(event));
        expires_at.push(request.received_at.plus(ingest.retention).0);
        event_type.push(event.event_type.as_deref().map(|t| text(t).into_owned()));
        idempotency_key.push(
            IdempotencyKey::new(&ingest.source, &event.key)
                .as_str()
                .to_owned(),
        );
        lease_owners.push(lease_owner(ingest));
        lease_until.push(ingest.lease.as_ref().map(|l| l.until.0));
        for d in &ingest.destinations {
            destination_of.push(i as i64 + 1);
            destination.push(d.as_str());
        }
    }
    let claim_source: Vec<&str> = ingests.iter().map(|i| i.source.as_str()).collect();
    let rows = sqlx::query(
        "WITH i AS MATERIALIZED (
            SELECT nextval((SELECT pg_get_serial_sequence('requests', 'id'))::regclass) AS id, u.*
            FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[],
                        $6::bytea[], $7::bytea[], $8::bool[], $9::text[], $10::bytea[],
                        $11::bigint[], $12::text[], $13::text[], $14::text[], $17::text[],
                        $18::bigint[])
                 WITH ORDINALITY AS u (received_at, source, method, path, peer, headers, body,
                        body_truncated, key, sha, expires_at, event_type, idempotency_key,
                        claim_source, lease_owner, lease_until, n)),
         h AS (
            SELECT i.n, held.body_sha256, held.request_id, held.claimed_at, held.expires_at
            FROM i CROSS JOIN LATERAL (
                SELECT body_sha256, request_id, claimed_at, expires_at FROM claims
                WHERE source = i.claim_source AND key = i.key LIMIT 1) held
            WHERE held.expires_at > i.received_at),
         c AS (
            INSERT INTO claims (source, key, body_sha256, request_id, claimed_at, expires_at)
            SELECT claim_source, key, sha, id, received_at, expires_at
            FROM i ORDER BY claim_source, key, n
            ON CONFLICT (source, key) DO NOTHING
            RETURNING request_id),
         held AS (
            SELECT n, body_sha256, request_id, claimed_at FROM h
            UNION ALL
            SELECT i.n, e.sha, e.id, e.received_at
            FROM i JOIN i e ON e.claim_source = i.claim_source AND e.key = i.key AND e.n < i.n
            JOIN c ON c.request_id = e.id),
         r AS (
            INSERT INTO requests (id, received_at, source, method, path, peer, headers, body,
                body_truncated, verdict, reason, status, keys)
            OVERRIDING SYSTEM VALUE
            SELECT i.id, i.received_at, i.source, i.method, i.path, i.peer, i.headers, i.body,
                i.body_truncated,
                CASE WHEN held.n IS NULL OR EXISTS (SELECT 1 FROM c WHERE c.request_id = i.id)
                        THEN 'accepted'
                    WHEN held.body_sha256 = i.sha THEN 'duplicate'
                    ELSE 'conflict' END,
                NULL, 200, ARRAY[i.key]
            FROM i LEFT JOIN held ON held.n = i.n ORDER BY i.n),
         k AS (
            INSERT INTO request_keys (key, request_id)
            SELECT i.key, i.id FROM i
            WHERE NOT EXISTS (SELECT 1 FROM c WHERE c.request_id = i.id)
            ON CONFLICT DO NOTHING),
         d AS (
            INSERT INTO deliveries (request_id, source, event_key, event_type, destination,
                idempotency_key, state, received_at, round_started_at, next_attempt_at,
                updated_at, lease_owner, lease_until)
            SELECT i.id, i.claim_source, i.key, i.event_type, x.destination, i.idempotency_key,
                'pending', i.received_at, i.received_at, i.received_at, i.received_at,
                i.lease_owner, i.lease_until
            FROM c JOIN i ON i.id = c.request_id
            JOIN unnest($15::bigint[], $16::text[]) WITH ORDINALITY AS x (n, destination, o)
                ON x.n = i.n
            ORDER BY i.n, x.o
            RETURNING id, request_id)
         SELECT i.id, EXISTS (SELECT 1 FROM c WHERE c.request_id = i.id),
            ARRAY(SELECT d.id FROM d WHERE d.request_id = i.id ORDER BY d.id),
            held.body_sha256, held.request_id, held.claimed_at,
            CASE WHEN $19 AND held.n IS NULL AND NOT EXISTS (SELECT 1 FROM c WHERE c.request_id = i.id)
                THEN 1 / (i.n - i.n) END
         FROM i LEFT JOIN held ON held.n = i.n ORDER BY i.n",
    )
    .bind(&received_at)
    .bind(&source)
    .bind(&method)
    .bind(&path)
    .bind(&peer)
    .bind(&header_bytes)
    .bind(&body)
    .bind(&body_truncated)
    .bind(&key)
    .bind(&sha)
    .bind(&expires_at)
    .bind(&event_type)
    .bind(&idempotency_key)
    .bind(&claim_source)
    .bind(&destination_of)
    .bind(&destination)
    .bind(&lease_owners)
    .bind(&lease_until)
    .bind(alone)
    .fetch_all(&mut *conn)
    .await?;
    if rows.len() != n {
        return Err(sqlx::Error::Protocol(format!(
            "a batched ingest of {n} requests answered {} rows",
            rows.len()
        )));
    }
    rows.iter()
        .zip(ingests)
        .map(|(row, ingest)| {
            let (request_id, claimed) = inserted(row)?;
            if let Some(deliveries) = claimed {
                return Ok(Batched::Claimed(request_id, deliveries));
            }
            let held: Option<Vec<u8>> = row.try_get(3)?;
            let Some(held_sha256) = held else {
                return Ok(Batched::Held(request_id));
            };
            let claim = earlier_claim(
                &ingest.content_sha256(batched_event(ingest)?),
                &held_sha256,
                RequestId(row.try_get(4)?),
                Timestamp(row.try_get(5)?),
            );
            Ok(Batched::Settled(IngestOutcome {
                request_id,
                claims: vec![(batched_event(ingest)?.key.clone(), claim)],
            }))
        })
        .collect()
}

/// [`settle`] for many one-event ingests whose batched statement found their keys held: one
/// statement reads every held claim (a new statement, so it sees claims committed while the
/// insert waited for them), one more records the verdicts. Answers in the order given; `None`
/// for an ingest whose claim is gone or expired (purged or to be replaced), which the caller
/// settles on its own.
pub(crate) async fn settle_held_many(
    conn: &mut PgConnection,
    held: &[(&Ingest, RequestId)],
) -> Result<Vec<Option<IngestOutcome>>, sqlx::Error> {
    let mut source = Vec::with_capacity(held.len());
    let mut key = Vec::with_capacity(held.len());
    for (ingest, _) in held {
        let event = batched_event(ingest)?;
        source.push(ingest.source.as_str());
        key.push(event.key.as_str());
    }
    // Each key is looked up on the primary key (the `LIMIT` keeps the subquery a lookup per
    // key): as a plain join, the plan cached while the table was small hashed the whole claims
    // table for every batch, reading 8.5 M rows over 30,000 ingests.
    let rows = sqlx::query(
        "SELECT u.n, c.body_sha256, c.request_id, c.claimed_at, c.expires_at
         FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u (source, key, n)
         CROSS JOIN LATERAL (
            SELECT body_sha256, request_id, claimed_at, expires_at FROM claims
            WHERE source = u.source AND key = u.key LIMIT 1) c",
    )
    .bind(&source)
    .bind(&key)
    .fetch_all(&mut *conn)
    .await?;
    let mut outcomes: Vec<Option<IngestOutcome>> = vec![None; held.len()];
    for row in rows {
        let n: i64 = row.try_get(0)?;
        let Some((ingest, request_id)) = usize::try_from(n - 1).ok().and_then(|i| held.get(i))
        else {
            continue;
        };
        let expires: i64 = row.try_get(4)?;
        if expires <= ingest.request.received_at.0 {
            continue;
        }
        let sha: Vec<u8> = row.try_get(1)?;
        let claim = earlier_claim(
            &ingest.content_sha256(batched_event(ingest)?),
            &sha,
            RequestId(row.try_get(2)?),
            Timestamp(row.try_get(3)?),
        );
        outcomes[(n - 1) as usize] = Some(IngestOutcome {
            request_id: *request_id,
            claims: vec![(ingest.events[0].key.clone(), claim)],
        });
    }
    let (ids, verdicts): (Vec<i64>, Vec<&str>) = outcomes
        .iter()
        .flatten()
        .map(|o| (o.request_id.0, o.verdict().as_str()))
        .unzip();
    if !ids.is_empty() {
        // `r.id = ANY($1)` keeps the update on the primary key: the same join without it was
        // planned as a table scan for the attempts' update (`outbox`) once the table grew.
        sqlx::query(
            "UPDATE requests r SET verdict = u.verdict
             FROM unnest($1::bigint[], $2::text[]) AS u (id, verdict)
             WHERE r.id = u.id AND r.id = ANY($1)",
        )
        .bind(&ids)
        .bind(&verdicts)
        .execute(&mut *conn)
        .await?;
    }
    Ok(outcomes)
}

/// What a live claim held by another request makes of this copy: a duplicate when the
/// contents (`content`, [`Ingest::content_sha256`]) are the same, a conflict when they differ.
fn earlier_claim(
    content: &[u8; 32],
    held_sha256: &[u8],
    first_request: RequestId,
    first_seen: Timestamp,
) -> Claim {
    if held_sha256 == content.as_slice() {
        Claim::Duplicate {
            first_request,
            first_seen,
        }
    } else {
        let mut first_body_sha256 = [0u8; 32];
        if held_sha256.len() == 32 {
            first_body_sha256.copy_from_slice(held_sha256);
        }
        Claim::Conflict {
            first_request,
            first_body_sha256,
        }
    }
}

/// What claiming one key found.
#[derive(Clone)]
enum Claimed {
    /// The claim is ours now; its deliveries are still to queue.
    Ours,
    /// Another request holds it: a duplicate or a conflict.
    Earlier(Claim),
}

/// Claims one event's key for `request_id`.
async fn claim(
    conn: &mut PgConnection,
    ingest: &Ingest,
    event: &NewEvent,
    request_id: RequestId,
) -> Result<Claimed, sqlx::Error> {
    let source = ingest.source.as_str();
    let key = event.key.as_str();
    let now = ingest.request.received_at;
    let expires_at = now.plus(ingest.retention);
    let content = ingest.content_sha256(event);
    for _ in 0..CLAIM_TRIES {
        let inserted = sqlx::query(
            "INSERT INTO claims (source, key, body_sha256, request_id, claimed_at, expires_at)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (source, key) DO NOTHING",
        )
        .bind(source)
        .bind(key)
        .bind(&content[..])
        .bind(request_id.0)
        .bind(now.0)
        .bind(expires_at.0)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        if inserted == 1 {
            return Ok(Claimed::Ours);
        }
        // A new statement, so a new snapshot: it sees the claim the insert conflicted with,
        // even one committed while the insert waited for it.
        let held = sqlx::query(
            "SELECT body_sha256, request_id, claimed_at, expires_at FROM claims
             WHERE source = $1 AND key = $2",
        )
        .bind(source)
        .bind(key)
        .fetch_optional(&mut *conn)
        .await?;
        let Some(held) = held else {
            continue; // purged in between: insert again
        };
        let expires: i64 = held.try_get(3)?;
        if expires > now.0 {
            let sha: Vec<u8> = held.try_get(0)?;
            return Ok(Claimed::Earlier(earlier_claim(
                &content,
                &sha,
                RequestId(held.try_get(1)?),
                Timestamp(held.try_get(2)?),
            )));
        }
        // Expired: replace it, unless a concurrent copy already did (then look again).
        let replaced = sqlx::query(
            "UPDATE claims SET body_sha256 = $3, request_id = $4, claimed_at = $5, expires_at = $6
             WHERE source = $1 AND key = $2 AND expires_at <= $5",
        )
        .bind(source)
        .bind(key)
        .bind(&content[..])
        .bind(request_id.0)
        .bind(now.0)
        .bind(expires_at.0)
        .execute(&mut *conn)
        .await?
        .rows_affected();
        if replaced == 1 {
            return Ok(Claimed::Ours);
        }
    }
    // Not a protocol or connection error: the batch's other jobs go on.
    Err(sqlx::Error::Decode(
        format!("the claim row kept changing while claiming it ({CLAIM_TRIES} tries)").into(),
    ))
}

/// Queues one pending delivery per destination for a newly claimed event.
async fn queue(
    conn: &mut PgConnection,
    ingest: &Ingest,
    event: &NewEvent,
    request_id: RequestId,
) -> Result<Claim, sqlx::Error> {
    let idempotency_key = IdempotencyKey::new(&ingest.source, &event.key);
    let deliveries = insert_deliveries(
        conn,
        request_id,
        ingest.source.as_str(),
        event.key.as_str(),
        event.event_type.as_deref(),
        idempotency_key.as_str(),
        &ingest.destinations,
        ingest.request.received_at,
        ingest.lease.as_ref(),
    )
    .await?;
    Ok(Claim::New { deliveries })
}

/// Inserts one pending delivery per destination, due at `now` (or leased, with `lease`), and
/// returns their ids in destination order.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn insert_deliveries(
    conn: &mut PgConnection,
    request_id: RequestId,
    source: &str,
    event_key: &str,
    event_type: Option<&str>,
    idempotency_key: &str,
    destinations: &[String],
    now: Timestamp,
    lease: Option<&IngestLease>,
) -> Result<Vec<DeliveryId>, sqlx::Error> {
    if destinations.is_empty() {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "INSERT INTO deliveries (request_id, source, event_key, event_type, destination,
            idempotency_key, state, received_at, round_started_at, next_attempt_at, updated_at,
            lease_owner, lease_until)
         SELECT $1, $2, $3, $4, d.destination, $5, 'pending', $6, $6, $6, $6, $8, $9
         FROM unnest($7::text[]) WITH ORDINALITY AS d (destination, n)
         ORDER BY d.n
         RETURNING id",
    )
    .bind(request_id.0)
    .bind(source)
    .bind(event_key)
    .bind(event_type.map(text))
    .bind(idempotency_key)
    .bind(now.0)
    .bind(destinations)
    .bind(lease.map(|l| l.owner.as_str()))
    .bind(lease.map(|l| l.until.0))
    .fetch_all(&mut *conn)
    .await?;
    // Identity values follow insertion order, which is destination order.
    let mut ids = rows
        .iter()
        .map(|r| r.try_get(0).map(DeliveryId))
        .collect::<Result<Vec<_>, _>>()?;
    ids.sort();
    Ok(ids)
}

pub(crate) async fn record_rejection(
    conn: &mut PgConnection,
    rejected: &Rejected,
) -> Result<RequestId, sqlx::Error> {
    insert_request(
        conn,
        &rejected.request,
        Verdict::Rejected,
        Some(&rejected.code),
        rejected.status,
        &[],
    )
    .await
}

pub(crate) async fn record_import(
    conn: &mut PgConnection,
    request: &RequestRecord,
    keys: &[String],
) -> Result<RequestId, sqlx::Error> {
    let id = insert_request(conn, request, Verdict::Imported, None, 202, keys).await?;
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    list_keys(conn, id, &keys).await?;
    Ok(id)
}

pub(crate) async fn record_handshake(
    conn: &mut PgConnection,
    request: &RequestRecord,
    status: u16,
) -> Result<RequestId, sqlx::Error> {
    insert_request(conn, request, Verdict::Handshake, None, status, &[]).await
}

/// Binds a request's history columns as `$1`–`$8` (received_at, source, method, path, peer,
/// headers, body, body_truncated), the order both request inserts use.
fn bind_request<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    request: &'q RequestRecord,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    query
        .bind(request.received_at.0)
        .bind(text(&request.source))
        .bind(text(&request.method))
        .bind(text(&request.path))
        .bind(request.peer.as_deref().map(text))
        .bind(headers::encode(&request.headers))
        .bind(&request.body[..])
        .bind(request.body_truncated)
}

/// Inserts the request into history (its keys in the `keys` column; see [`list_keys`] for
/// the key filter's table).
async fn insert_request(
    conn: &mut PgConnection,
    request: &RequestRecord,
    verdict: Verdict,
    reason: Option<&str>,
    status: u16,
    keys: &[String],
) -> Result<RequestId, sqlx::Error> {
    let row = bind_request(
        sqlx::query(
            "INSERT INTO requests (received_at, source, method, path, peer, headers, body,
                body_truncated, verdict, reason, status, keys)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
             RETURNING id",
        ),
        request,
    )
    .bind(verdict.as_str())
    .bind(reason.map(text))
    .bind(i32::from(status))
    .bind(keys)
    .fetch_one(&mut *conn)
    .await?;
    Ok(RequestId(row.try_get(0)?))
}

/// Lists `keys` in `request_keys` as carried by `request_id`, for history's key filter: the
/// keys no claim of this request points at (a claim is found by key already).
async fn list_keys(
    conn: &mut PgConnection,
    request_id: RequestId,
    keys: &[&str],
) -> Result<(), sqlx::Error> {
    if keys.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO request_keys (key, request_id)
         SELECT DISTINCT u.key, $2 FROM unnest($1::text[]) AS u (key)
         ON CONFLICT DO NOTHING",
    )
    .bind(keys)
    .bind(request_id.0)
    .execute(&mut *conn)
    .await?;
    Ok(())
}
