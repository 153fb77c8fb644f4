//! The idempotency harness behind `hooklatch check`: deliver one event the ways providers
//! do, count the handler's effects, and say what is wrong when there are too many.
//!
//! Phases, in order, each against the handler URL:
//!
//! 1. **sequential** — N deliveries of event A, one after another (a provider's retries);
//! 2. **concurrent** — K deliveries of a *fresh* event B at once (two provider workers, or a
//!    retry racing a slow first attempt). B is fresh on purpose: a check-then-insert guard
//!    only races while the event is unknown, so repeating A here would hide the race;
//! 3. **late replay** — event A once more after the handler has finished (optionally after
//!    `late_after`): a guard kept in memory, or expired, lets it through;
//! 4. **conflict** (optional) — event A's id with a different body: must not do the work again.
//!
//! Every request is re-signed with a fresh timestamp when a secret is known (see
//! [`crate::replay`]). After each phase the [`EffectProbe`] counts the effects of the phase's
//! key; phases 1 and 2 expect `expect` (default 1), phases 3 and 4 expect no new effect. Any
//! answer that is not 2xx fails its phase too: a provider retries those for days.
//!
//! Events come from `hooklatch send`'s fixtures (two ids of one event type) or from a
//! [`Capture`]; for a capture, event B is the capture with its key replaced by a fresh one in
//! the body and headers (when the key cannot be found there, phase 2 repeats event A and the
//! report says so).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use hooklatch_core::{Secret, Timestamp};
use serde_json::{json, Value};

use crate::capture::Capture;
use crate::effect::{EffectError, EffectProbe};
use crate::fixtures::FixtureError;
use crate::replay::{self, ReplayError, ReplayOptions, Response, Signer, Signing, Target};

/// Why a check could not run (a failed phase is a result, not an error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckError {
    /// The test event could not be built.
    #[error(transparent)]
    Fixture(#[from] FixtureError),
    /// The requests could not be sent.
    #[error(transparent)]
    Replay(#[from] ReplayError),
    /// The effect could not be counted.
    #[error("counting effects for key {key:?}")]
    Effect {
        /// The key.
        key: String,
        /// Why.
        #[source]
        source: EffectError,
    },
    /// The capture has no event key to bind to `:key`.
    #[error("the capture has no event key (was it refused?); check needs one")]
    NoKey,
    /// Nothing answered the first delivery: no handler to check.
    #[error("no answer from the handler at {to} ({error}): is it running there?")]
    Unreachable {
        /// `--to`.
        to: String,
        /// The first request's transport error.
        error: String,
    },
}

/// What to deliver.
#[derive(Debug, Clone)]
pub enum CheckInput {
    /// A test event from `hooklatch send`'s fixtures, signed with `secret`.
    Fixture {
        /// The provider (`stripe`).
        provider: String,
        /// The event type (default: the provider's first).
        event: Option<String>,
        /// Event A's id (default: fresh).
        id: Option<String>,
        /// The signing secret.
        secret: Secret,
    },
    /// A captured request, re-signed by `signer` when there is one.
    Capture {
        /// The capture (event A).
        capture: Box<Capture>,
        /// Its signer.
        signer: Option<Signer>,
    },
}

/// How to check.
#[derive(Debug, Clone)]
pub struct CheckOptions {
    /// The handler's URL.
    pub to: String,
    /// Phase 1's number of deliveries.
    pub times: u32,
    /// Phase 2's number of simultaneous deliveries.
    pub concurrency: u32,
    /// How long to wait before phase 3.
    pub late_after: Duration,
    /// Run phase 4.
    pub conflict: bool,
    /// Effects expected per event.
    pub expect: i64,
    /// How long to wait after a phase before counting (for handlers that work in background).
    pub settle: Duration,
    /// How to count effects; `None`: only the answers are checked.
    pub effect: Option<EffectProbe>,
    /// Time allowed for one request.
    pub timeout: Duration,
    /// Send every request as the gateway delivers to a destination ([`Signing::AsDelivered`]):
    /// for a handler behind hooklatch that keys on `Idempotency-Key` or, with the
    /// destination's secret, verifies the gateway's signature. The provider's signature is
    /// made again with the check's own signer, as the gateway makes it.
    pub as_delivered: Option<crate::replay::AsDelivered>,
}

/// One phase's outcome.
#[derive(Debug, Clone)]
pub struct PhaseReport {
    /// `sequential`, `concurrent`, `late replay`, `conflict`.
    pub name: &'static str,
    /// What was sent, in words.
    pub sent: String,
    /// The event key whose effects were counted.
    pub key: String,
    /// The responses, in completion order.
    pub responses: Vec<Response>,
    /// The effect count before the phase.
    pub before: Option<i64>,
    /// The effect count after it.
    pub after: Option<i64>,
    /// The count the phase expects after it.
    pub expected: Option<i64>,
    /// What went wrong, explained; empty when the phase passed.
    pub failures: Vec<String>,
}

impl PhaseReport {
    /// The phase passed.
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }
}

/// The whole check.
#[derive(Debug, Clone)]
pub struct CheckReport {
    /// The handler's URL.
    pub to: String,
    /// The event, in words (`stripe invoice.payment_succeeded`).
    pub event: String,
    /// How requests were signed.
    pub signing: String,
    /// How effects were counted.
    pub effect: Option<String>,
    /// Effects expected per event.
    pub expect: i64,
    /// Things worth knowing that are not failures.
    pub notes: Vec<String>,
    /// The phases, in order.
    pub phases: Vec<PhaseReport>,
}

impl CheckReport {
    /// Every phase passed.
    pub fn ok(&self) -> bool {
        self.phases.iter().all(PhaseReport::ok)
    }

    /// The report as text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "check {} → {}", self.event, self.to);
        let _ = writeln!(out, "  signing  {}", self.signing);
        match &self.effect {
            Some(e) => {
                let _ = writeln!(out, "  effects  {e} (expected {} per event)", self.expect);
            }
            None => out.push_str("  effects  not measured (no --effects-sql or --effects-cmd): only the answers are checked\n"),
        }
        for note in &self.notes {
            let _ = writeln!(out, "  note     {note}");
        }
        for (i, phase) in self.phases.iter().enumerate() {
            out.push('\n');
            let verdict = if phase.ok() { "PASS" } else { "FAIL" };
            let _ = writeln!(out, "{verdict}  {}. {}: {}", i + 1, phase.name, phase.sent);
            let _ = writeln!(out, "      answers  {}", answers_line(&phase.responses));
            let _ = writeln!(
                out,
                "      latency  {}",
                replay::latency_line(&phase.responses)
            );
            if let (Some(before), Some(after)) = (phase.before, phase.after) {
                let expected = phase
                    .expected
                    .map(|e| format!(" (expected {e})"))
                    .unwrap_or_default();
                let _ = writeln!(
                    out,
                    "      effects  {before} → {after} for key {}{expected}",
                    phase.key
                );
            }
            for failure in &phase.failures {
                let _ = writeln!(out, "      ✗ {failure}");
            }
        }
        let failed = self.phases.iter().filter(|p| !p.ok()).count();
        out.push('\n');
        if failed == 0 && self.effect.is_none() {
            // Every answer was 2xx, which any endpoint that does nothing also manages.
            let _ = writeln!(
                out,
                "PASSED: {} phases, answers only — effects were not counted, so this says \
                 nothing of duplicates (add --effects-sql or --effects-cmd)",
                self.phases.len()
            );
        } else if failed == 0 {
            let _ = writeln!(out, "PASSED: {} phases", self.phases.len());
        } else {
            let _ = writeln!(
                out,
                "FAILED: {failed} of {} phases failed",
                self.phases.len()
            );
        }
        out
    }

    /// The report as JSON, for scripts.
    pub fn to_json(&self) -> Value {
        json!({
            "ok": self.ok(),
            "to": self.to,
            "event": self.event,
            "signing": self.signing,
            "effect": self.effect,
            "expect": self.expect,
            "notes": self.notes,
            "phases": self.phases.iter().map(|p| json!({
                "name": p.name,
                "ok": p.ok(),
                "sent": p.sent,
                "key": p.key,
                "statuses": statuses(&p.responses),
                "before": p.before,
                "after": p.after,
                "expected": p.expected,
                "failures": p.failures,
                "latency_ms": {
                    "p50": replay::latency_ms(&p.responses, 0.5),
                    "p99": replay::latency_ms(&p.responses, 0.99),
                },
                "responses": p.responses.iter().map(replay::response_json).collect::<Vec<_>>(),
            })).collect::<Vec<_>>(),
        })
    }
}

/// Runs the phases; `on_response` is called for every response (a progress bar).
pub async fn check(
    input: CheckInput,
    opts: &CheckOptions,
    on_response: &(dyn Fn(&Response) + Sync),
) -> Result<CheckReport, CheckError> {
    let mut notes = Vec::new();
    let prepared = prepare(input, &opts.to, &mut notes)?;
    let signing = match (&opts.as_delivered, &prepared.signer) {
        (Some(how), signer) => Signing::AsDelivered(crate::replay::AsDelivered {
            secret: how.secret.clone(),
            signer: how.signer.clone().or_else(|| signer.clone()),
        }),
        (None, Some(s)) => Signing::Resign(s.clone()),
        (None, None) => {
            notes.push(
                "no signing secret: requests carry the captured signature, which a verifying handler refuses once it is stale".to_owned(),
            );
            Signing::Original
        }
    };
    let runner = Runner {
        opts,
        signing: signing.clone(),
        on_response,
    };
    // Fail before sending anything when the effect query does not work.
    runner.count(&prepared.key_a).await?;

    let mut phases = Vec::new();
    let n = opts.times.max(1);
    let k = opts.concurrency.max(1);
    let key_a = prepared.key_a.clone();

    // 1. sequential
    let (responses, before, after) = runner.run(&prepared.first, &key_a, n, 1).await?;
    // Not one HTTP answer: there is no handler to judge (a refused connection is not the
    // handler refusing the event), so the check could not run.
    if responses.iter().all(|r| r.status.is_none()) {
        if let Some(first) = responses.iter().min_by_key(|r| r.n) {
            return Err(CheckError::Unreachable {
                to: opts.to.clone(),
                error: first.describe(),
            });
        }
    }
    let mut failures = answer_failures(&responses, true);
    if let Some(after) = after {
        if after > opts.expect {
            failures.push(format!(
                "{} produced {after} effects: no dedup at all — every delivery does the work; record the event id under a unique constraint in the same transaction as the work, and answer 200 when it is already there",
                deliveries(n)
            ));
        } else if after < opts.expect {
            failures.push(too_few(n, after, opts.expect, &key_a));
        }
    }
    // With no dedup at all, later phases repeat phase 1's finding rather than guess at a guard
    // that is not there.
    let no_dedup = after.is_some_and(|after| after > opts.expect);
    phases.push(PhaseReport {
        name: "sequential",
        sent: format!("{} of {key_a}, one after another", deliveries(n)),
        key: key_a.clone(),
        responses,
        before,
        after,
        expected: after.map(|_| opts.expect),
        failures,
    });

    // 2. concurrent
    let key_b = prepared.key_b.clone();
    let (responses, before, after) = runner.run(&prepared.second, &key_b, k, k).await?;
    let mut failures = answer_failures(&responses, false);
    if let Some(after) = after {
        if after > opts.expect {
            failures.push(if no_dedup {
                format!(
                    "{} produced {after} effects: no dedup at all (see phase 1)",
                    deliveries(k)
                )
            } else {
                format!(
                    "{} produced {after} effects: the check-then-insert races under concurrency; use a unique constraint (INSERT … ON CONFLICT DO NOTHING) in the same transaction as the work",
                    deliveries(k)
                )
            });
        } else if after < opts.expect {
            failures.push(too_few(k, after, opts.expect, &key_b));
        }
    }
    let concurrent_what = if prepared.second_is_fresh {
        format!("{} of a fresh event {key_b}, all at once", deliveries(k))
    } else {
        format!("{} of {key_b} again, all at once", deliveries(k))
    };
    phases.push(PhaseReport {
        name: "concurrent",
        sent: concurrent_what,
        key: key_b,
        responses,
        before,
        after,
        expected: after.map(|_| opts.expect),
        failures,
    });

    // 3. late replay
    if !opts.late_after.is_zero() {
        tokio::time::sleep(opts.late_after).await;
    }
    let (responses, before, after) = runner.run(&prepared.first, &key_a, 1, 1).await?;
    let mut failures = answer_failures(&responses, false);
    if let (Some(before), Some(after)) = (before, after) {
        let new = crate::counted((after - before) as u64, "new effect", "new effects");
        if after > before && no_dedup {
            failures.push(format!(
                "a replay after the first delivery was fully processed produced {new}: no dedup at all (see phase 1)"
            ));
        } else if after > before {
            failures.push(format!(
                "a replay after the first delivery was fully processed produced {new}: the dedup record expires too early or is kept in memory (a restart or a second instance forgets it); keep it in the database for the provider's whole retry window"
            ));
        }
    }
    let late = if opts.late_after.is_zero() {
        String::new()
    } else {
        format!(" and {} more", humanize(opts.late_after))
    };
    phases.push(PhaseReport {
        name: "late replay",
        sent: format!("1 delivery of {key_a}'s original payload after the handler finished{late}"),
        key: key_a.clone(),
        responses,
        before,
        after,
        expected: before,
        failures,
    });

    // 4. conflict
    if opts.conflict {
        let mut changed = prepared.first.clone();
        changed.body = conflicting_body(&changed.body);
        let (responses, before, after) = runner.run(&changed, &key_a, 1, 1).await?;
        let mut failures: Vec<String> = responses
            .iter()
            .filter(|r| !r.is_success())
            .map(|r| format!(
                "the same id with a different body was answered {}: answer 2xx and keep it for a person to look at — providers retry anything else for days",
                r.describe()
            ))
            .collect();
        if let (Some(before), Some(after)) = (before, after) {
            let new = crate::counted((after - before) as u64, "new effect", "new effects");
            if after > before && no_dedup {
                failures.push(format!(
                    "the same id with a different body produced {new}: no dedup at all (see phase 1)"
                ));
            } else if after > before {
                failures.push(format!(
                    "the same id with a different body produced {new}: the handler keys on the body (or its hash), not on the provider's event id"
                ));
            }
        }
        phases.push(PhaseReport {
            name: "conflict",
            sent: format!("1 delivery of {key_a} with a different body"),
            key: key_a.clone(),
            responses,
            before,
            after,
            expected: before,
            failures,
        });
    }

    Ok(CheckReport {
        to: opts.to.clone(),
        event: prepared.event,
        signing: signing.describe(),
        effect: opts.effect.as_ref().map(EffectProbe::describe),
        expect: opts.expect,
        notes,
        phases,
    })
}

/// The events a check sends.
struct Prepared {
    event: String,
    first: Capture,
    key_a: String,
    second: Capture,
    key_b: String,
    second_is_fresh: bool,
    signer: Option<Signer>,
}

fn prepare(input: CheckInput, to: &str, notes: &mut Vec<String>) -> Result<Prepared, CheckError> {
    match input {
        CheckInput::Fixture {
            provider,
            event,
            id,
            secret,
        } => {
            let now = Timestamp::now();
            let a = crate::fixtures::build(
                &provider,
                event.as_deref(),
                id.as_deref(),
                &secret,
                to,
                now,
            )?;
            let b = crate::fixtures::build(&provider, event.as_deref(), None, &secret, to, now)?;
            let path = reqwest::Url::parse(to)
                .map(|u| u.path().to_owned())
                .unwrap_or_else(|_| "/".to_owned());
            let as_capture = |e: &crate::fixtures::TestEvent| Capture {
                request_id: None,
                source: provider.clone(),
                provider: Some(provider.clone()),
                method: "POST".to_owned(),
                path: path.clone(),
                received_at_ms: now.as_millis(),
                keys: vec![e.key.clone()],
                verdict: None,
                reason: None,
                headers: e
                    .headers
                    .iter()
                    .map(|(n, v)| (n.clone(), v.clone().into_bytes()))
                    .collect(),
                body: e.body.clone(),
            };
            Ok(Prepared {
                event: format!("{provider} {}", a.event_type),
                first: as_capture(&a),
                key_a: a.key.clone(),
                second: as_capture(&b),
                key_b: b.key.clone(),
                second_is_fresh: true,
                signer: Some(Signer::for_provider(&provider, secret)?),
            })
        }
        CheckInput::Capture { capture, signer } => {
            let capture = *capture;
            let key_a = signer
                .as_ref()
                .and_then(|s| s.extract(&capture.headers, &capture.body))
                .and_then(|(keys, _)| keys.into_iter().next())
                .or_else(|| capture.keys.first().cloned())
                .ok_or(CheckError::NoKey)?;
            let event = format!("{} from source {}", capture.label(), capture.source);
            let (second, key_b, fresh) = match fresh_variant(&capture, &key_a, signer.as_ref()) {
                Some((variant, key)) => (variant, key, true),
                None => {
                    notes.push(format!(
                        "could not give the capture a fresh event id ({key_a} is not in its body or headers): phase 2 sends {key_a} again, which cannot show a check-then-insert race"
                    ));
                    (capture.clone(), key_a.clone(), false)
                }
            };
            Ok(Prepared {
                event,
                first: capture,
                key_a,
                second,
                key_b,
                second_is_fresh: fresh,
                signer,
            })
        }
    }
}

struct Runner<'a> {
    opts: &'a CheckOptions,
    signing: Signing,
    on_response: &'a (dyn Fn(&Response) + Sync),
}

impl Runner<'_> {
    async fn count(&self, key: &str) -> Result<Option<i64>, CheckError> {
        match &self.opts.effect {
            Some(probe) => probe
                .count(key)
                .await
                .map(Some)
                .map_err(|source| CheckError::Effect {
                    key: key.to_owned(),
                    source,
                }),
            None => Ok(None),
        }
    }

    /// Sends `capture` `times` times, `concurrency` at once; counts `key`'s effects around it.
    async fn run(
        &self,
        capture: &Capture,
        key: &str,
        times: u32,
        concurrency: u32,
    ) -> Result<(Vec<Response>, Option<i64>, Option<i64>), CheckError> {
        let before = self.count(key).await?;
        let replay_opts = ReplayOptions {
            target: Target::Url(self.opts.to.clone()),
            times,
            concurrency,
            delay: Duration::ZERO,
            signing: self.signing.clone(),
            timeout: self.opts.timeout,
        };
        let responses =
            replay::send_many(capture, &self.opts.to, &replay_opts, self.on_response).await?;
        if !self.opts.settle.is_zero() {
            tokio::time::sleep(self.opts.settle).await;
        }
        let after = self.count(key).await?;
        Ok((responses, before, after))
    }
}

/// Failures among the answers. `first_is_new`: the first request (`n == 1`) delivered an
/// unknown event, so its refusal means the handler refused the event itself.
fn answer_failures(responses: &[Response], first_is_new: bool) -> Vec<String> {
    let failed: Vec<&Response> = responses.iter().filter(|r| !r.is_success()).collect();
    if failed.is_empty() {
        return Vec::new();
    }
    if failed.len() == responses.len() || (first_is_new && failed.iter().any(|r| r.n == 1)) {
        let first = failed.iter().min_by_key(|r| r.n).expect("not empty");
        let body: String = String::from_utf8_lossy(&first.body)
            .trim()
            .chars()
            .take(160)
            .collect();
        let answer = match body.is_empty() {
            true => first.describe(),
            false => format!("{} {body}", first.describe()),
        };
        return vec![format!(
            "the handler refused the event ({answer}): check --to and the signing secret"
        )];
    }
    let mut by_answer: BTreeMap<String, u32> = BTreeMap::new();
    for r in &failed {
        *by_answer.entry(r.describe()).or_insert(0) += 1;
    }
    let answers: Vec<String> = by_answer.iter().map(|(a, n)| format!("{a} ×{n}")).collect();
    vec![format!(
        "{} of {} duplicates were answered {}: duplicates must be answered 2xx or the provider retries for days (a unique-constraint violation means \"already done\": answer 200)",
        failed.len(),
        responses.len(),
        answers.join(", ")
    )]
}

fn too_few(n: u32, after: i64, expect: i64, key: &str) -> String {
    format!(
        "{} produced {after} effects, expected {expect}: the work did not happen, or the effect query does not see it (check --effects-sql and that :key = {key:?} is what the handler stores; --settle for a handler that works in the background)",
        deliveries(n)
    )
}

/// `1 delivery`, `10 deliveries`.
fn deliveries(n: u32) -> String {
    crate::counted(u64::from(n), "delivery", "deliveries")
}

fn answers_line(responses: &[Response]) -> String {
    let counts = statuses(responses);
    counts
        .iter()
        .map(|(s, n)| format!("{s} ×{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn statuses(responses: &[Response]) -> BTreeMap<String, u32> {
    let mut res = BTreeMap::new();
    for r in responses {
        let k = r.status.map_or("error".to_owned(), |s| s.to_string());
        *res.entry(k).or_insert(0) += 1;
    }
    res
}

fn humanize(d: Duration) -> String {
    if d.as_secs() >= 60 && d.as_secs().is_multiple_of(60) {
        format!("{}m", d.as_secs() / 60)
    } else if d.subsec_millis() == 0 {
        format!("{}s", d.as_secs())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// The capture with its event key replaced by a fresh one, and that key; `None` when the key
/// cannot be found in the body or headers (or the adapter does not see the new key).
fn fresh_variant(
    capture: &Capture,
    key: &str,
    signer: Option<&Signer>,
) -> Option<(Capture, String)> {
    let new_key = fresh_key(key);
    // A long key is unlikely to occur by accident; a short one is replaced only where it
    // stands whole (a JSON string, a header value).
    let long = key.len() >= 8;
    let mut replaced = false;
    let mut variant = capture.clone();
    let (from, to) = if long {
        (key.to_owned(), new_key.clone())
    } else {
        (format!("\"{key}\""), format!("\"{new_key}\""))
    };
    if let Some(body) = replace_bytes(&capture.body, from.as_bytes(), to.as_bytes()) {
        variant.body = body;
        replaced = true;
    }
    for (_, value) in &mut variant.headers {
        if value.as_slice() == key.as_bytes() {
            *value = new_key.clone().into_bytes();
            replaced = true;
        } else if long {
            if let Some(v) = replace_bytes(value, key.as_bytes(), new_key.as_bytes()) {
                *value = v;
                replaced = true;
            }
        }
    }
    if !replaced {
        return None;
    }
    variant.request_id = None;
    variant.keys = vec![new_key.clone()];
    if let Some(signer) = signer {
        let (keys, _) = signer.extract(&variant.headers, &variant.body)?;
        if !keys.contains(&new_key) {
            return None;
        }
    }
    Some((variant, new_key))
}

/// A key shaped like `key`: digits stay digits (same length), anything else gets a suffix.
fn fresh_key(key: &str) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    if !key.is_empty() && key.bytes().all(|b| b.is_ascii_digit()) {
        let mut s = rng.random_range(1..=9).to_string();
        for _ in 1..key.len() {
            s.push(char::from(b'0' + rng.random_range(0..10u8)));
        }
        return s;
    }
    let suffix: String = (0..8)
        .map(|_| char::from(rng.sample(rand::distr::Alphanumeric)).to_ascii_lowercase())
        .collect();
    format!("{key}_{suffix}")
}

fn replace_bytes(haystack: &[u8], from: &[u8], to: &[u8]) -> Option<Vec<u8>> {
    if from.is_empty() || !haystack.windows(from.len()).any(|w| w == from) {
        return None;
    }
    let mut out = Vec::with_capacity(haystack.len());
    let mut i = 0;
    while i < haystack.len() {
        if haystack[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(haystack[i]);
            i += 1;
        }
    }
    Some(out)
}

/// The same event with a different body: a field added to a JSON object, a parameter to a
/// form, otherwise a trailing newline.
pub fn conflicting_body(body: &[u8]) -> Vec<u8> {
    let start = body.iter().position(|b| !b.is_ascii_whitespace());
    match start {
        Some(i) if body[i] == b'{' => {
            let rest = &body[i + 1..];
            let empty = rest
                .iter()
                .find(|b| !b.is_ascii_whitespace())
                .is_some_and(|b| *b == b'}');
            let field: &[u8] = if empty {
                b"\"hooklatch_check_conflict\":true"
            } else {
                b"\"hooklatch_check_conflict\":true,"
            };
            [&body[..=i], field, rest].concat()
        }
        Some(_) if body.contains(&b'=') && !body.contains(&b'{') => {
            [body, b"&hooklatch_check_conflict=1"].concat()
        }
        _ => [body, b"\n"].concat(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check_conflict(body: &str, expect: &str) {
        assert_eq!(
            String::from_utf8(conflicting_body(body.as_bytes())).unwrap(),
            expect
        );
    }

    fn answered(n: u32, status: u16, body: &str) -> Response {
        Response {
            n,
            status: Some(status),
            error: None,
            latency: Duration::from_millis(1),
            answer: None,
            body: body.as_bytes().to_vec(),
        }
    }

    /// A refusal names the status, and the body only when there is one.
    #[test]
    fn a_refused_event_is_named_by_its_answer() {
        let failures = answer_failures(&[answered(1, 404, "")], true);
        assert_eq!(
            failures,
            ["the handler refused the event (404): check --to and the signing secret"]
        );
        let failures = answer_failures(&[answered(1, 401, " {\"code\":\"nope\"}\n")], true);
        assert_eq!(
            failures,
            ["the handler refused the event (401 {\"code\":\"nope\"}): check --to and the signing secret"]
        );
    }

    /// With no effect counted, a pass is said to be of the answers only: an endpoint that
    /// does nothing answers 2xx too.
    #[test]
    fn a_pass_without_counted_effects_says_it_checked_answers_only() {
        let phase = PhaseReport {
            name: "sequential",
            sent: format!("{} of evt_1, one after another", deliveries(1)),
            key: "evt_1".to_owned(),
            responses: vec![answered(1, 200, "ok")],
            before: None,
            after: None,
            expected: None,
            failures: Vec::new(),
        };
        let mut report = CheckReport {
            to: "http://127.0.0.1:3000/webhooks/stripe".to_owned(),
            event: "stripe invoice.paid".to_owned(),
            signing: "re-signed (stripe, as sent)".to_owned(),
            effect: None,
            expect: 1,
            notes: Vec::new(),
            phases: vec![phase],
        };
        let text = report.render();
        assert!(text.contains("1 delivery of evt_1"), "{text}");
        assert!(
            text.contains("PASSED: 1 phases, answers only — effects were not counted"),
            "{text}"
        );
        report.effect = Some("sql".to_owned());
        let text = report.render();
        assert!(text.ends_with("PASSED: 1 phases\n"), "{text}");
    }

    #[test]
    fn a_conflicting_body_differs_and_stays_parseable() {
        check_conflict(
            "{\n  \"id\": \"evt_1\"\n}",
            "{\"hooklatch_check_conflict\":true,\n  \"id\": \"evt_1\"\n}",
        );
        check_conflict("{ }", "{\"hooklatch_check_conflict\":true }");
        check_conflict("a=1&b=2", "a=1&b=2&hooklatch_check_conflict=1");
        check_conflict("plain", "plain\n");
    }

    #[test]
    fn a_fresh_variant_replaces_the_key_in_body_and_headers() {
        let capture = Capture {
            request_id: Some("req_1".to_owned()),
            source: "s".to_owned(),
            provider: None,
            method: "POST".to_owned(),
            path: "/in/s".to_owned(),
            received_at_ms: 0,
            keys: vec!["evt_123456".to_owned()],
            verdict: None,
            reason: None,
            headers: vec![("x-id".to_owned(), b"evt_123456".to_vec())],
            body: br#"{"id":"evt_123456","n":1}"#.to_vec(),
        };
        let (variant, key) = fresh_variant(&capture, "evt_123456", None).unwrap();
        assert!(key.starts_with("evt_123456_"));
        assert_eq!(variant.headers[0].1, key.as_bytes());
        assert_eq!(
            variant.body,
            format!(r#"{{"id":"{key}","n":1}}"#).into_bytes()
        );
        assert!(fresh_variant(&capture, "nowhere", None).is_none());
    }

    #[test]
    fn numeric_keys_stay_numeric() {
        let key = fresh_key("1234567890");
        assert_eq!(key.len(), 10);
        assert!(key.bytes().all(|b| b.is_ascii_digit()));
    }
}
