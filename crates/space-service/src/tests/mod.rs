//! Unit tests of the service's logic on the recording fake runtime and an in-memory
//! store (`testing.rs`): each takes milliseconds, starts no process, and checks both
//! what the store holds and what the runtime was asked to do. The integration tests
//! (real server, real runtimes) stay in `crates/space/tests`.

mod admission;
mod lifecycle;
mod reconcile;
mod retention;

use std::time::Duration;

use space_api::{ErrorCode, Operation, OperationStatus};

use super::Service;

/// The operation once it has ended (at most 5 s).
async fn ended(svc: &Service, op: &str) -> Operation {
    let op = svc
        .wait_operation(op, Duration::from_secs(5))
        .await
        .expect("the operation exists");
    assert!(op.status.is_terminal(), "still {}: {op:?}", op.status);
    op
}

/// Asserts that `op` failed with `code`.
fn assert_failed(op: &Operation, code: ErrorCode) {
    assert_eq!(op.status, OperationStatus::Failed, "{op:?}");
    assert_eq!(op.error.as_ref().map(|e| e.code), Some(code), "{op:?}");
}

/// Waits until `cond` holds (at most 5 s): for effects no event announces.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn ago(secs: i64) -> String {
    space_core::format_time(time::OffsetDateTime::now_utc() - time::Duration::seconds(secs))
}
