//! The backend conformance suite: one set of cases every [`Store`] implementation must pass.
//!
//! Each case is a public `async fn` taking a fresh, empty store and asserting one part of the
//! contract with explicit timestamps (no sleeping); [`store_suite`] runs them all, each on
//! its own store. A backend wires it up in one test, with a closure that makes an empty
//! store (a new database file, schema or key prefix each time):
//!
//! ```no_run
//! use hooklatch_testkit::{conformance::store_suite, MemoryStore};
//!
//! #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! async fn main() {
//!     store_suite(MemoryStore::default).await;
//! }
//! ```
//!
//! Run it on a multi-thread runtime: the concurrency case races real tasks.
//!
//! Layout: [`fixture`] builds requests, ingests and attempts; `claims` holds the ingest cases
//! (duplicates, conflicts, concurrency, cancellation, retention); `outbox` the lease, attempt
//! and redrive cases; `history` the history, purge and count cases.

mod claims;
pub mod fixture;
mod history;
mod outbox;

use std::future::Future;

use hooklatch_core::Store;

pub use claims::{
    a_claim_is_kept_for_its_retention_then_replaced,
    a_dropped_ingest_leaves_its_claim_and_deliveries_together_or_not_at_all,
    a_request_is_accepted_when_any_of_its_events_is_new,
    an_event_with_its_own_content_hash_is_judged_by_it,
    an_external_decision_is_followed_and_writes_no_claim,
    another_body_under_the_same_key_is_a_conflict_and_queues_nothing,
    concurrent_ingests_of_one_key_make_exactly_one_claim,
    first_ingest_claims_the_key_and_queues_one_delivery_per_destination,
    the_same_body_again_is_a_duplicate_and_queues_nothing,
    the_same_key_on_another_source_is_a_new_claim,
};
pub use history::{
    get_request_returns_the_request_byte_exact_with_its_deliveries,
    handshakes_are_recorded_in_history_and_claim_nothing,
    imports_are_kept_and_redeliverable_but_claim_nothing,
    list_deliveries_filters_and_pages_newest_first, list_requests_filters_and_pages_newest_first,
    purge_removes_claims_expired_at_or_before_now,
    purge_removes_old_finished_history_with_its_deliveries,
    rejections_are_recorded_in_history_and_claim_nothing, stats_count_pending_dead_and_claims,
    the_key_finds_every_request_that_carried_it_after_claims_are_replaced_or_purged,
};
pub use outbox::{
    a_conflict_is_released_or_dismissed_once_and_a_dismissed_one_is_not_released,
    a_dead_lettered_delivery_keeps_its_last_error,
    a_deliberate_redelivery_queues_anew_with_the_original_key,
    a_delivered_attempt_finishes_the_delivery,
    a_disabled_destination_is_kept_until_enabled_which_wakes_its_rows,
    a_failed_attempt_is_retried_no_sooner_than_asked, a_late_worker_never_undoes_a_newer_outcome,
    a_leased_delivery_is_not_leased_again_until_its_lease_expires,
    a_record_under_a_lease_taken_again_by_its_own_worker_moves_nothing,
    a_redelivered_conflict_goes_out_under_a_key_of_its_own,
    a_wait_leases_the_next_due_delivery_not_the_waited_one,
    an_attempt_recorded_again_with_its_token_changes_nothing,
    an_ingest_with_a_lease_writes_its_deliveries_leased_to_its_worker,
    deliveries_not_yet_due_are_not_leased, held_deliveries_wait_until_their_destination_is_enabled,
    lease_due_returns_due_deliveries_with_the_request_byte_exact,
    lease_due_takes_at_most_limit_deliveries_earliest_first,
    next_due_reports_the_earliest_due_time, recording_an_attempt_can_lease_the_next_due_delivery,
    redriving_a_dead_delivery_queues_it_again_with_the_same_key,
    redriving_what_is_not_dead_changes_nothing, released_leases_can_be_leased_again_at_once,
    wait_by_a_late_worker_moves_nothing, wait_counts_no_attempt,
    wake_destination_makes_waiting_rows_due,
};

/// Runs every conformance case, each on a fresh store from `make`, and panics naming the
/// cases that failed (each failure's own message is printed as it happens).
///
/// Cases run one after another, each in its own task, so one failure does not hide the
/// others. Call it from a multi-thread tokio runtime.
pub async fn store_suite<S: Store>(make: impl Fn() -> S) {
    let mut failed = Vec::new();
    macro_rules! run {
        ($($case:ident),* $(,)?) => {
            $( run_case(stringify!($case), $case(make()), &mut failed).await; )*
        };
    }
    run!(
        first_ingest_claims_the_key_and_queues_one_delivery_per_destination,
        the_same_body_again_is_a_duplicate_and_queues_nothing,
        another_body_under_the_same_key_is_a_conflict_and_queues_nothing,
        an_event_with_its_own_content_hash_is_judged_by_it,
        the_same_key_on_another_source_is_a_new_claim,
        a_request_is_accepted_when_any_of_its_events_is_new,
        concurrent_ingests_of_one_key_make_exactly_one_claim,
        a_dropped_ingest_leaves_its_claim_and_deliveries_together_or_not_at_all,
        a_claim_is_kept_for_its_retention_then_replaced,
        an_external_decision_is_followed_and_writes_no_claim,
        rejections_are_recorded_in_history_and_claim_nothing,
        handshakes_are_recorded_in_history_and_claim_nothing,
        imports_are_kept_and_redeliverable_but_claim_nothing,
        lease_due_returns_due_deliveries_with_the_request_byte_exact,
        a_leased_delivery_is_not_leased_again_until_its_lease_expires,
        deliveries_not_yet_due_are_not_leased,
        lease_due_takes_at_most_limit_deliveries_earliest_first,
        released_leases_can_be_leased_again_at_once,
        next_due_reports_the_earliest_due_time,
        a_delivered_attempt_finishes_the_delivery,
        a_failed_attempt_is_retried_no_sooner_than_asked,
        a_dead_lettered_delivery_keeps_its_last_error,
        a_late_worker_never_undoes_a_newer_outcome,
        a_record_under_a_lease_taken_again_by_its_own_worker_moves_nothing,
        recording_an_attempt_can_lease_the_next_due_delivery,
        an_attempt_recorded_again_with_its_token_changes_nothing,
        wait_counts_no_attempt,
        wait_by_a_late_worker_moves_nothing,
        wake_destination_makes_waiting_rows_due,
        a_wait_leases_the_next_due_delivery_not_the_waited_one,
        a_disabled_destination_is_kept_until_enabled_which_wakes_its_rows,
        held_deliveries_wait_until_their_destination_is_enabled,
        an_ingest_with_a_lease_writes_its_deliveries_leased_to_its_worker,
        redriving_a_dead_delivery_queues_it_again_with_the_same_key,
        redriving_what_is_not_dead_changes_nothing,
        a_deliberate_redelivery_queues_anew_with_the_original_key,
        a_redelivered_conflict_goes_out_under_a_key_of_its_own,
        a_conflict_is_released_or_dismissed_once_and_a_dismissed_one_is_not_released,
        list_requests_filters_and_pages_newest_first,
        get_request_returns_the_request_byte_exact_with_its_deliveries,
        list_deliveries_filters_and_pages_newest_first,
        purge_removes_claims_expired_at_or_before_now,
        purge_removes_old_finished_history_with_its_deliveries,
        stats_count_pending_dead_and_claims,
        the_key_finds_every_request_that_carried_it_after_claims_are_replaced_or_purged,
    );
    assert!(
        failed.is_empty(),
        "store conformance cases failed: {failed:#?}"
    );
}

/// Runs one case in its own task, so its panic is caught and reported by name.
async fn run_case(
    name: &'static str,
    case: impl Future<Output = ()> + Send + 'static,
    failed: &mut Vec<&'static str>,
) {
    match tokio::spawn(case).await {
        Ok(()) => eprintln!("conformance: {name} ... ok"),
        Err(err) => {
            eprintln!("conformance: {name} ... FAILED ({err})");
            failed.push(name);
        }
    }
}
