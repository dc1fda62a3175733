//! Policies over time (`retention.rs`), one pass at a time (`reap_once`) on records
//! whose timestamps lie in the past: TTL, idle timeout, purging old records.

use space_api::{CommandState, OnIdle, OperationKind, OperationStatus, SandboxState};

use space_store::Store;

use super::{ago, ended, eventually};
use crate::testing::{Op, TestBed};

/// The progress an operation was requested with (its first event).
fn requested_with(bed: &TestBed, op: &str) -> Option<String> {
    bed.store
        .events_after(space_api::DEFAULT_TENANT, 0, 10_000)
        .unwrap()
        .into_iter()
        .find(|e| e.kind == "operation" && e.object["id"] == op)
        .and_then(|e| e.object["progress"].as_str().map(str::to_owned))
}

#[tokio::test]
async fn an_expired_ttl_destroys_the_sandbox() {
    let bed = TestBed::new();
    let svc = bed.start().await;
    let expired = bed
        .seed_with(SandboxState::Running, |r| {
            r.sandbox.ttl_seconds = Some(60);
            r.sandbox.expires_at = Some(ago(1));
        })
        .sandbox
        .id;
    // Paused sandboxes expire too.
    let paused = bed
        .seed_with(SandboxState::Paused, |r| {
            r.sandbox.ttl_seconds = Some(60);
            r.sandbox.expires_at = Some(ago(1));
        })
        .sandbox
        .id;
    let later = bed
        .seed_with(SandboxState::Running, |r| {
            r.sandbox.ttl_seconds = Some(3600);
            r.sandbox.expires_at = Some(ago(-3600));
        })
        .sandbox
        .id;

    svc.reap_once();

    for id in [&expired, &paused] {
        let ops = bed.operations(id);
        let op = ops.last().unwrap();
        assert_eq!(op.kind, OperationKind::Destroy, "{id}");
        assert_eq!(requested_with(&bed, &op.id).as_deref(), Some("ttl expired"));
        assert_eq!(ended(&svc, &op.id).await.status, OperationStatus::Succeeded);
        assert_eq!(bed.sandbox(id).sandbox.state, SandboxState::Destroyed);
        assert_eq!(bed.fake.actions(id), vec![Op::Destroy]);
    }
    assert_eq!(bed.operations(&later).len(), 1, "only its create");
    assert_eq!(bed.sandbox(&later).sandbox.state, SandboxState::Running);
    assert!(bed.fake.actions(&later).is_empty());
}

#[tokio::test]
async fn an_idle_sandbox_is_destroyed_or_suspended_as_it_asked() {
    let bed = TestBed::new();
    let svc = bed.start().await;
    let idle = |on_idle: Option<OnIdle>, last: i64, state| {
        bed.seed_with(state, |r| {
            r.sandbox.idle_timeout_seconds = Some(60);
            r.sandbox.on_idle = on_idle;
            r.sandbox.last_active_at = Some(ago(last));
        })
        .sandbox
        .id
    };
    let destroy = idle(Some(OnIdle::Destroy), 120, SandboxState::Running);
    let suspend = idle(None, 120, SandboxState::Running);
    let recent = idle(Some(OnIdle::Destroy), 10, SandboxState::Running);
    // Only a running sandbox can be idle.
    let paused = idle(Some(OnIdle::Destroy), 120, SandboxState::Paused);
    // A running command keeps its sandbox busy, however long ago the last request was.
    let busy = idle(Some(OnIdle::Destroy), 120, SandboxState::Running);
    let cmd = bed.seed_command(&busy, CommandState::Running);
    svc.register_command(&busy, &cmd.id, Default::default(), false);

    svc.reap_once();

    let op = bed.operations(&destroy).pop().unwrap();
    assert_eq!(op.kind, OperationKind::Destroy);
    assert_eq!(
        requested_with(&bed, &op.id).as_deref(),
        Some("idle for 60s")
    );
    assert_eq!(ended(&svc, &op.id).await.status, OperationStatus::Succeeded);
    assert_eq!(bed.sandbox(&destroy).sandbox.state, SandboxState::Destroyed);
    assert_eq!(bed.fake.actions(&destroy), vec![Op::Destroy]);

    // `suspend` is the default. It waits for the agent to let go of its connection; there
    // is none here, so only the request is checked.
    let op = bed.operations(&suspend).pop().unwrap();
    assert_eq!(op.kind, OperationKind::Suspend);
    assert_eq!(
        requested_with(&bed, &op.id).as_deref(),
        Some("idle for 60s")
    );

    for id in [&recent, &paused, &busy] {
        assert_eq!(bed.operations(id).len(), 1, "{id}: only its create");
        assert!(bed.fake.actions(id).is_empty(), "{id}");
    }
}

#[tokio::test]
async fn destroyed_records_are_purged_after_retention() {
    let bed = TestBed::new();
    let svc = bed.start().await;
    let destroyed = |secs_ago: i64| {
        let id = bed
            .seed_with(SandboxState::Destroyed, |r| {
                r.sandbox.destroyed_at = Some(ago(secs_ago));
            })
            .sandbox
            .id;
        bed.seed_command(&id, CommandState::Exited);
        let out = bed.data_dir().join("outputs").join(&id).join("cmd");
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(out.join("stdout"), "hello").unwrap();
        id
    };
    let old = destroyed(2 * 3600);
    let young = destroyed(600);

    svc.reap_once();

    assert!(bed.store.get_sandbox(&old).unwrap().is_none());
    assert!(bed.operations(&old).is_empty());
    assert!(bed.commands(&old).is_empty());
    assert!(!bed.data_dir().join("outputs").join(&old).exists());

    assert_eq!(bed.sandbox(&young).sandbox.state, SandboxState::Destroyed);
    assert_eq!(bed.commands(&young).len(), 1);
    assert!(bed.data_dir().join("outputs").join(&young).exists());
    // Records of destroyed sandboxes need nothing from the runtime.
    assert!(bed.fake.actions(&old).is_empty());
    assert!(bed.fake.actions(&young).is_empty());
}

#[tokio::test]
async fn failed_sandboxes_are_released_and_purged_after_retention() {
    let bed = TestBed::new();
    let svc = bed
        .start_with(|c| c.retention = std::time::Duration::from_secs(60))
        .await;
    let failed = |secs_ago: i64| {
        bed.seed_with(SandboxState::Failed, |r| {
            r.sandbox.failure_reason = Some("it broke".into());
            r.sandbox.updated_at = ago(secs_ago);
        })
        .sandbox
        .id
    };
    let old = failed(120);
    let young = failed(10);

    svc.reap_once();

    bed.fake.called(Op::Destroy, &old).await;
    eventually("the failed sandbox's records are purged", || {
        bed.store.get_sandbox(&old).unwrap().is_none()
    })
    .await;
    assert!(bed.operations(&old).is_empty());
    assert_eq!(bed.fake.actions(&old), vec![Op::Destroy]);
    assert_eq!(bed.sandbox(&young).sandbox.state, SandboxState::Failed);
    assert!(bed.fake.actions(&young).is_empty());
}
