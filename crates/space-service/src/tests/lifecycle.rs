//! Lifecycle operations that need no agent (`lifecycle.rs`): destroy, pause, resume
//! from paused, what a failing runtime call leaves, cancel, and the 409s.

use space_api::{ErrorCode, OperationKind, OperationStatus, SandboxState};
use space_core::runtime::RuntimeStatus;

use space_store::Store;

use super::{assert_failed, ended};
use crate::tenancy::Tenant;
use crate::testing::{Op, TestBed};
use crate::ServiceError;

fn me() -> Tenant {
    Tenant::new(space_api::DEFAULT_TENANT)
}

#[tokio::test]
async fn destroy_of_a_running_sandbox() {
    let bed = TestBed::new();
    let svc = bed.start().await;
    let id = bed.seed(SandboxState::Running).sandbox.id;
    let snapshot = bed.data_dir().join("snapshots").join(&id);
    std::fs::create_dir_all(&snapshot).unwrap();

    let op = svc.for_tenant(&me()).destroy_sandbox(&id).unwrap();
    assert_eq!(op.status, OperationStatus::Pending);
    let op = ended(&svc, &op.id).await;

    assert_eq!(op.status, OperationStatus::Succeeded, "{op:?}");
    let rec = bed.sandbox(&id);
    assert_eq!(rec.sandbox.state, SandboxState::Destroyed);
    assert!(rec.sandbox.destroyed_at.is_some());
    assert!(!snapshot.exists());
    assert_eq!(bed.fake.actions(&id), vec![Op::Destroy]);
    // Two writes: `destroying` with the operation running, then `destroyed` with it
    // succeeded, each pair in one transaction (never one without the other).
    assert_eq!(rec.sandbox.version, 2);
    assert_eq!(
        bed.store.writes_on(&op.id),
        [
            "insert_operation",
            "update_sandbox_and_op",
            "update_sandbox_and_op"
        ]
    );
    assert_eq!(
        bed.history(&id, &op.id),
        [
            "sandbox:running",
            "operation:pending",
            "sandbox:destroying",
            "operation:running",
            "sandbox:destroyed",
            "operation:succeeded",
        ]
    );
}

#[tokio::test]
async fn pause_then_resume_from_paused() {
    let bed = TestBed::new();
    let svc = bed.start().await;
    let id = bed.seed(SandboxState::Running).sandbox.id;
    let scope = me();
    let scope = svc.for_tenant(&scope);

    let pause = ended(&svc, &scope.pause(&id).unwrap().id).await;
    assert_eq!(pause.status, OperationStatus::Succeeded, "{pause:?}");
    assert_eq!(bed.sandbox(&id).sandbox.state, SandboxState::Paused);
    assert_eq!(bed.fake.status_of(&id), RuntimeStatus::Paused);
    assert_eq!(
        bed.history(&id, &pause.id),
        [
            "sandbox:running",
            "operation:pending",
            "sandbox:pausing",
            "operation:running",
            "sandbox:paused",
            "operation:succeeded",
        ]
    );

    let together = [
        "insert_operation",
        "update_sandbox_and_op",
        "update_sandbox_and_op",
    ];
    assert_eq!(bed.store.writes_on(&pause.id), together);

    let resume = ended(&svc, &scope.resume(&id).unwrap().id).await;
    assert_eq!(bed.store.writes_on(&resume.id), together);
    assert_eq!(resume.kind, OperationKind::Resume);
    assert_eq!(resume.status, OperationStatus::Succeeded, "{resume:?}");
    let rec = bed.sandbox(&id);
    assert_eq!(rec.sandbox.state, SandboxState::Running);
    assert_eq!(rec.sandbox.version, 4);
    assert_eq!(bed.fake.status_of(&id), RuntimeStatus::Running);
    assert_eq!(bed.fake.actions(&id), vec![Op::Pause, Op::Resume]);
}

#[tokio::test]
async fn a_failed_pause_of_a_sandbox_still_running_goes_back_to_running() {
    let bed = TestBed::new();
    let svc = bed.start().await;
    let id = bed.seed(SandboxState::Running).sandbox.id;
    bed.fake.fail(Op::Pause, "the freezer is stuck");

    let op = ended(&svc, &svc.for_tenant(&me()).pause(&id).unwrap().id).await;

    assert_failed(&op, ErrorCode::RuntimeFailed);
    assert!(op.error.unwrap().message.contains("the freezer is stuck"));
    let rec = bed.sandbox(&id);
    assert_eq!(rec.sandbox.state, SandboxState::Running);
    assert_eq!(rec.sandbox.failure_reason, None);
    assert_eq!(bed.fake.actions(&id), vec![Op::Pause]);
    // Back to `running` first, then the operation's failure.
    assert_eq!(
        bed.store.writes_on(&id)[1..],
        [
            "insert_operation",
            "update_sandbox_and_op",
            "update_sandbox"
        ]
    );
    assert_eq!(
        bed.store.writes_on(&op.id),
        [
            "insert_operation",
            "update_sandbox_and_op",
            "update_operation"
        ]
    );
    assert_eq!(
        bed.history(&id, &op.id),
        [
            "sandbox:running",
            "operation:pending",
            "sandbox:pausing",
            "operation:running",
            "sandbox:running",
            "operation:failed",
        ]
    );
}

#[tokio::test]
async fn a_failed_pause_of_a_sandbox_the_runtime_lost_fails_it() {
    let bed = TestBed::new();
    let svc = bed.start().await;
    let id = bed.seed(SandboxState::Running).sandbox.id;
    bed.fake.fail(Op::Pause, "no such container");
    bed.fake.set_status(&id, RuntimeStatus::Stopped);

    let op = ended(&svc, &svc.for_tenant(&me()).pause(&id).unwrap().id).await;

    assert_failed(&op, ErrorCode::RuntimeFailed);
    let rec = bed.sandbox(&id);
    assert_eq!(rec.sandbox.state, SandboxState::Failed);
    assert_eq!(
        rec.sandbox.failure_reason.as_deref(),
        Some("fake failed: no such container")
    );
    // Whatever was left of it is released.
    assert_eq!(bed.fake.actions(&id), vec![Op::Pause, Op::Destroy]);
}

#[tokio::test]
async fn a_pending_operation_can_be_cancelled_a_running_one_cannot() {
    let bed = TestBed::new();
    let svc = bed.start().await;
    let id = bed.seed(SandboxState::Running).sandbox.id;
    let tenant = me();
    let scope = svc.for_tenant(&tenant);
    bed.fake.hold(Op::Pause);

    let pause = scope.pause(&id).unwrap();
    bed.fake.called(Op::Pause, &id).await;
    // The sandbox is `pausing` now; a destroy may queue behind the pause (pending),
    // but only one.
    assert!(matches!(
        scope.suspend(&id),
        Err(ServiceError::InvalidTransition(_))
    ));
    let destroy = scope.destroy_sandbox(&id).unwrap();
    assert!(matches!(
        scope.destroy_sandbox(&id),
        Err(ServiceError::Conflict(_))
    ));

    assert!(matches!(
        scope.cancel_operation(&pause.id),
        Err(ServiceError::Conflict(_))
    ));
    let cancelled = scope.cancel_operation(&destroy.id).unwrap();
    assert_eq!(cancelled.status, OperationStatus::Cancelled);
    assert_eq!(cancelled.error.map(|e| e.code), Some(ErrorCode::Cancelled));
    // An ended operation cannot be cancelled again.
    assert!(matches!(
        scope.cancel_operation(&destroy.id),
        Err(ServiceError::Conflict(_))
    ));

    bed.fake.release(Op::Pause);
    let pause = ended(&svc, &pause.id).await;
    assert_eq!(pause.status, OperationStatus::Succeeded);
    // The cancelled destroy never ran.
    assert_eq!(bed.sandbox(&id).sandbox.state, SandboxState::Paused);
    assert_eq!(
        bed.operation(&destroy.id).status,
        OperationStatus::Cancelled
    );
    assert_eq!(bed.fake.actions(&id), vec![Op::Pause]);
    // And it no longer blocks another.
    let again = ended(&svc, &scope.destroy_sandbox(&id).unwrap().id).await;
    assert_eq!(again.status, OperationStatus::Succeeded);
    assert_eq!(bed.fake.actions(&id), vec![Op::Pause, Op::Destroy]);
}

#[tokio::test]
async fn invalid_transitions_are_refused_and_change_nothing() {
    let bed = TestBed::new();
    let svc = bed.start().await;
    let tenant = me();
    let scope = svc.for_tenant(&tenant);
    let paused = bed.seed(SandboxState::Paused).sandbox.id;
    let running = bed.seed(SandboxState::Running).sandbox.id;
    let destroyed = bed.seed(SandboxState::Destroyed).sandbox.id;
    let creating = bed.seed(SandboxState::Creating).sandbox.id;
    let events_before = bed.store.events_after(tenant.as_str(), 0, 10_000).unwrap();
    let writes_before = bed.store.writes();

    let refusals = [
        (&paused, scope.pause(&paused)),
        (&running, scope.resume(&running)),
        (&destroyed, scope.destroy_sandbox(&destroyed)),
        (&destroyed, scope.suspend(&destroyed)),
        (&creating, scope.pause(&creating)),
    ];
    for (id, r) in refusals {
        assert!(
            matches!(r, Err(ServiceError::InvalidTransition(_))),
            "{id}: {r:?}"
        );
    }

    for id in [&paused, &running, &destroyed, &creating] {
        assert_eq!(bed.sandbox(id).sandbox.version, 0, "{id}");
        assert_eq!(bed.operations(id).len(), 1, "{id}: only its create");
        assert!(bed.fake.actions(id).is_empty(), "{id}");
    }
    let events_after = bed.store.events_after(tenant.as_str(), 0, 10_000).unwrap();
    assert_eq!(events_before.len(), events_after.len());
    assert_eq!(bed.store.writes(), writes_before);
}
