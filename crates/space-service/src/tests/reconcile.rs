//! Reconcile at start (`reconcile.rs`): records a killed server left behind, and what
//! the runtime says now, decide every sandbox's state and how every operation ends.

use space_api::{CommandState, ErrorCode, OperationKind, OperationStatus, SandboxState};
use space_core::runtime::RuntimeStatus;

use space_store::Store;

use super::assert_failed;
use crate::testing::{Op, TestBed};

#[tokio::test]
async fn a_running_sandbox_the_runtime_lost_is_failed_and_its_commands_lost() {
    let bed = TestBed::new();
    let sb = bed.seed(SandboxState::Running);
    let id = &sb.sandbox.id;
    bed.fake.set_status(id, RuntimeStatus::Missing);
    let cmd = bed.seed_command(id, CommandState::Running);
    let op = bed.seed_op(Some(id), OperationKind::Pause, OperationStatus::Running);

    let _svc = bed.start().await;

    let rec = bed.sandbox(id);
    assert_eq!(rec.sandbox.state, SandboxState::Failed);
    assert_eq!(
        rec.sandbox.failure_reason.as_deref(),
        Some("the sandbox vanished while the server was down")
    );
    // What is left of it is released.
    assert_eq!(bed.fake.actions(id), vec![Op::Destroy]);
    let cmd = &bed
        .commands(id)
        .into_iter()
        .find(|c| c.id == cmd.id)
        .unwrap();
    assert_eq!(cmd.state, CommandState::Lost);
    assert_eq!(
        cmd.lost_reason.as_deref(),
        Some("the sandbox failed: the sandbox vanished while the server was down")
    );
    assert_failed(&bed.operation(&op.id), ErrorCode::Interrupted);
}

#[tokio::test]
async fn an_interrupted_create_fails_the_sandbox() {
    let bed = TestBed::new();
    let sb = bed.seed(SandboxState::Creating);
    let id = &sb.sandbox.id;
    // The create operation was still running when the server died.
    let create = bed.operations(id).remove(0);
    let mut running = create.clone();
    running.status = OperationStatus::Running;
    bed.store.update_operation(&mut running).unwrap();
    bed.fake.set_status(id, RuntimeStatus::Running);

    let _svc = bed.start().await;

    let rec = bed.sandbox(id);
    assert_eq!(rec.sandbox.state, SandboxState::Failed);
    assert_eq!(
        rec.sandbox.failure_reason.as_deref(),
        Some("the server restarted while the sandbox was being created")
    );
    assert_eq!(bed.fake.actions(id), vec![Op::Destroy]);
    assert_eq!(bed.fake.status_of(id), RuntimeStatus::Missing);
    assert_failed(&bed.operation(&create.id), ErrorCode::Interrupted);
}

#[tokio::test]
async fn destroys_the_crash_cut_short_are_finished() {
    let bed = TestBed::new();
    // One with its destroy operation, one whose operation never got written.
    let with_op = bed.seed(SandboxState::Destroying);
    let a = &with_op.sandbox.id;
    bed.fake.set_status(a, RuntimeStatus::Running);
    let op = bed.seed_op(Some(a), OperationKind::Destroy, OperationStatus::Running);
    let without = bed.seed(SandboxState::Destroying);
    let b = &without.sandbox.id;
    bed.fake.set_status(b, RuntimeStatus::Paused);

    let _svc = bed.start().await;

    for id in [a, b] {
        let rec = bed.sandbox(id);
        assert_eq!(rec.sandbox.state, SandboxState::Destroyed, "{id}");
        assert!(rec.sandbox.destroyed_at.is_some());
        assert_eq!(bed.fake.actions(id), vec![Op::Destroy], "{id}");
        assert_eq!(bed.fake.status_of(id), RuntimeStatus::Missing);
    }
    // The interrupted operation is the one that finished: no second destroy was written.
    // (Seeded in the same millisecond, the operations may list in either order.)
    let ops = bed.operations(a);
    assert_eq!(ops.len(), 2, "{ops:?}");
    let finished = ops
        .iter()
        .find(|o| o.id == op.id)
        .expect("the interrupted destroy");
    assert_eq!(finished.status, OperationStatus::Succeeded);
    // The other got a destroy operation of its own, succeeded.
    let ops = bed.operations(b);
    assert_eq!(ops.len(), 2, "{ops:?}");
    let destroy = ops
        .iter()
        .find(|o| o.kind == OperationKind::Destroy)
        .expect("a destroy operation");
    assert_eq!(destroy.status, OperationStatus::Succeeded);
}

#[tokio::test]
async fn interrupted_pauses_and_resumes_end_as_the_runtime_says() {
    let bed = TestBed::new();
    // The pause happened before the crash: it succeeded.
    let paused = bed.seed(SandboxState::Pausing).sandbox.id;
    bed.fake.set_status(&paused, RuntimeStatus::Paused);
    let paused_op = bed.seed_op(
        Some(&paused),
        OperationKind::Pause,
        OperationStatus::Running,
    );
    // It did not: back to running, the operation interrupted.
    let aborted = bed.seed(SandboxState::Pausing).sandbox.id;
    bed.fake.set_status(&aborted, RuntimeStatus::Running);
    let aborted_op = bed.seed_op(
        Some(&aborted),
        OperationKind::Pause,
        OperationStatus::Running,
    );
    // A resume from paused that happened.
    let resumed = bed.seed(SandboxState::Resuming).sandbox.id;
    bed.fake.set_status(&resumed, RuntimeStatus::Running);
    let resumed_op = bed.seed_op(
        Some(&resumed),
        OperationKind::Resume,
        OperationStatus::Running,
    );
    // A pause that was only requested (still pending) never happened.
    let pending = bed.seed(SandboxState::Running).sandbox.id;
    let pending_op = bed.seed_op(
        Some(&pending),
        OperationKind::Pause,
        OperationStatus::Pending,
    );

    let _svc = bed.start().await;

    assert_eq!(bed.sandbox(&paused).sandbox.state, SandboxState::Paused);
    assert_eq!(
        bed.operation(&paused_op.id).status,
        OperationStatus::Succeeded
    );
    assert_eq!(bed.sandbox(&aborted).sandbox.state, SandboxState::Running);
    assert_failed(&bed.operation(&aborted_op.id), ErrorCode::Interrupted);
    assert_eq!(bed.sandbox(&resumed).sandbox.state, SandboxState::Running);
    assert_eq!(
        bed.operation(&resumed_op.id).status,
        OperationStatus::Succeeded
    );
    assert_eq!(bed.sandbox(&pending).sandbox.state, SandboxState::Running);
    assert_failed(&bed.operation(&pending_op.id), ErrorCode::Interrupted);

    // Nothing was paused, resumed or destroyed to get there: the live ones are
    // re-adopted, and those now running get their agent woken (a quiesce may hold it).
    assert!(bed.fake.actions(&paused).is_empty());
    for id in [&aborted, &resumed, &pending] {
        bed.fake.called(Op::WakeAgent, id).await;
        assert_eq!(bed.fake.actions(id), vec![Op::WakeAgent], "{id}");
    }
}

#[tokio::test]
async fn a_suspended_sandbox_survives_only_with_a_complete_snapshot() {
    let bed = TestBed::new();
    let snapshots = bed.data_dir().join("snapshots");
    let with_image = |id: &str, complete: bool| {
        let dir = snapshots.join(id);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("checkpoint.img"), [0u8; 100]).unwrap();
        if complete {
            bed.fake.add_snapshot(&dir);
        }
        dir
    };
    let kept = bed.seed(SandboxState::Suspended).sandbox.id;
    let kept_dir = with_image(&kept, true);
    let lost = bed.seed(SandboxState::Suspended).sandbox.id;
    let lost_dir = with_image(&lost, false);
    // A suspend whose checkpoint was complete when the server died.
    let suspending = bed.seed(SandboxState::Suspending).sandbox.id;
    let suspending_dir = with_image(&suspending, true);
    let suspend_op = bed.seed_op(
        Some(&suspending),
        OperationKind::Suspend,
        OperationStatus::Running,
    );
    // A resume from a snapshot that had not started the sandbox yet.
    let resuming = bed.seed(SandboxState::Resuming).sandbox.id;
    with_image(&resuming, true);
    let resume_op = bed.seed_op(
        Some(&resuming),
        OperationKind::Resume,
        OperationStatus::Running,
    );

    let _svc = bed.start().await;

    assert_eq!(bed.sandbox(&kept).sandbox.state, SandboxState::Suspended);
    assert!(kept_dir.join("checkpoint.img").exists());
    assert_eq!(bed.fake.actions(&kept), vec![Op::Stop]);

    let rec = bed.sandbox(&lost);
    assert_eq!(rec.sandbox.state, SandboxState::Failed);
    assert_eq!(
        rec.sandbox.failure_reason.as_deref(),
        Some("its snapshot is missing")
    );
    assert_eq!(bed.fake.actions(&lost), vec![Op::Destroy]);
    // The half-written image nobody owns any more is removed.
    assert!(!lost_dir.exists());

    let rec = bed.sandbox(&suspending);
    assert_eq!(rec.sandbox.state, SandboxState::Suspended);
    assert_eq!(
        rec.snapshot_dir.as_deref(),
        Some(suspending_dir.to_string_lossy().as_ref())
    );
    assert_eq!(rec.sandbox.cost.snapshot_bytes, Some(100));
    assert_eq!(
        bed.operation(&suspend_op.id).status,
        OperationStatus::Succeeded
    );
    assert_eq!(bed.fake.actions(&suspending), vec![Op::Stop]);

    assert_eq!(
        bed.sandbox(&resuming).sandbox.state,
        SandboxState::Suspended
    );
    assert_failed(&bed.operation(&resume_op.id), ErrorCode::Interrupted);
    assert_eq!(bed.fake.actions(&resuming), vec![Op::Stop]);
}

#[tokio::test]
async fn leftovers_nobody_owns_are_removed() {
    let bed = TestBed::new();
    let live = bed.seed(SandboxState::Running).sandbox.id;
    // A container and a directory of a sandbox the store does not know as live.
    let stray = "sb_strayxxxxxxxxxxxxxxx";
    bed.fake.set_status(stray, RuntimeStatus::Running);
    let stray_dir = bed.data_dir().join("sandboxes").join(stray);
    std::fs::create_dir_all(&stray_dir).unwrap();
    let gone = bed.seed(SandboxState::Destroyed).sandbox.id;
    let gone_dir = bed.data_dir().join("sandboxes").join(&gone);

    let _svc = bed.start().await;

    assert_eq!(bed.fake.actions(stray), vec![Op::Destroy]);
    assert!(!stray_dir.exists());
    assert!(!gone_dir.exists());
    // The live one keeps its directory (with the socket its agent dials back into).
    let run = bed.data_dir().join("sandboxes").join(&live).join("run");
    assert!(run.join("agent.sock").exists());
    assert_eq!(bed.sandbox(&live).sandbox.state, SandboxState::Running);
    assert!(!bed.fake.actions(&live).contains(&Op::Destroy));
}
