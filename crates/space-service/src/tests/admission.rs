//! Admission against the tenant limits (`tenancy.rs`): a refused request is a 429
//! (`ServiceError::TooMany`) and leaves nothing behind, neither in the store nor in a
//! runtime. An admitted create is followed to its end on a runtime that fails it.

use space_api::{
    CommandState, CreateCommandRequest, CreateSandboxRequest, ErrorCode, OperationKind,
    OperationStatus, SandboxState,
};
use space_store::{Store, TenantLimits};

use super::{assert_failed, ended};
use crate::tenancy::{Limits, Tenant};
use crate::testing::{Op, TestBed};
use crate::ServiceError;

fn me() -> Tenant {
    Tenant::new(space_api::DEFAULT_TENANT)
}

fn create_req() -> CreateSandboxRequest {
    CreateSandboxRequest {
        template: "tiny".into(),
        ..Default::default()
    }
}

fn sandbox_count(bed: &TestBed) -> usize {
    bed.store.list_sandboxes().unwrap().len()
}

#[tokio::test]
async fn the_sandbox_limit_refuses_a_create_and_stores_nothing() {
    let bed = TestBed::new();
    bed.add_template("tiny");
    let svc = bed.start().await;
    let tenant = me();
    bed.store
        .set_tenant_limits(
            tenant.as_str(),
            &TenantLimits {
                max_sandboxes: Some(2),
                ..Default::default()
            },
        )
        .unwrap();
    bed.seed(SandboxState::Running);
    // A failed sandbox counts until it is destroyed; a destroyed one does not.
    bed.seed(SandboxState::Failed);
    bed.seed(SandboxState::Destroyed);
    let writes = bed.store.writes();

    let refused = svc.for_tenant(&tenant).create_sandbox(create_req()).await;

    assert!(
        matches!(
            refused,
            Err(ServiceError::TooMany {
                retry_after: None,
                ..
            })
        ),
        "{refused:?}"
    );
    assert_eq!(sandbox_count(&bed), 3);
    assert_eq!(bed.store.writes(), writes);
    assert!(!bed.fake.calls().iter().any(|c| c.op == Op::Create));

    // One more allowed: the same request is admitted, so the limit was the reason.
    bed.store
        .set_tenant_limits(
            tenant.as_str(),
            &TenantLimits {
                max_sandboxes: Some(3),
                ..Default::default()
            },
        )
        .unwrap();
    bed.fake.fail(Op::Create, "out of memory");
    let op = svc
        .for_tenant(&tenant)
        .create_sandbox(create_req())
        .await
        .unwrap();
    let id = op.sandbox_id.clone().unwrap();
    // The runtime refuses the boot: the sandbox fails with the reason, and what the
    // create made is released.
    let op = ended(&svc, &op.id).await;
    assert_failed(&op, ErrorCode::RuntimeFailed);
    let rec = bed.sandbox(&id);
    assert_eq!(rec.sandbox.state, SandboxState::Failed);
    assert_eq!(
        rec.sandbox.failure_reason.as_deref(),
        Some("fake failed: out of memory")
    );
    assert_eq!(bed.fake.actions(&id), vec![Op::Create, Op::Destroy]);
    assert!(!bed
        .data_dir()
        .join("sandboxes")
        .join(&id)
        .join("run/agent.sock")
        .exists());
}

#[tokio::test]
async fn the_create_rate_refuses_with_a_retry_after() {
    let bed = TestBed::new();
    bed.add_template("tiny");
    let svc = bed.start().await;
    let tenant = me();
    bed.store
        .set_tenant_limits(
            tenant.as_str(),
            &TenantLimits {
                creates_per_minute: Some(1),
                ..Default::default()
            },
        )
        .unwrap();
    bed.fake.fail(Op::Create, "no");

    let first = svc
        .for_tenant(&tenant)
        .create_sandbox(create_req())
        .await
        .unwrap();
    let refused = svc.for_tenant(&tenant).create_sandbox(create_req()).await;

    match refused {
        Err(ServiceError::TooMany {
            retry_after: Some(s),
            ..
        }) => assert!((1..=60).contains(&s), "{s}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(sandbox_count(&bed), 1);
    ended(&svc, &first.id).await;
    let creates = bed
        .fake
        .calls()
        .iter()
        .filter(|c| c.op == Op::Create)
        .count();
    assert_eq!(creates, 1);
    // Another tenant has its own rate: admitted past it (then refused for a template it
    // cannot see, so nothing is created).
    let other = Tenant::new("other");
    let op = svc
        .for_tenant(&other)
        .create_sandbox(CreateSandboxRequest {
            template: "busybox-unknown".into(),
            ..Default::default()
        })
        .await;
    assert!(matches!(op, Err(ServiceError::NotFound(_))), "{op:?}");
}

/// Since `before`, the store took at most the sandbox's activity time: a command
/// request is use of the sandbox (for its idle timeout) even when it is refused.
fn assert_only_activity(bed: &TestBed, before: &[crate::testing::Write]) {
    let writes = bed.store.writes();
    assert_eq!(&writes[..before.len()], before);
    let new: Vec<_> = writes[before.len()..].iter().map(|w| w.what).collect();
    assert!(new.iter().all(|w| *w == "set_sandbox_times"), "{new:?}");
}

#[tokio::test]
async fn command_limits_refuse_and_store_nothing() {
    let bed = TestBed::new();
    let svc = bed
        .start_with(|c| {
            c.limits = Limits {
                max_commands_per_sandbox: 2,
                max_running_commands: 3,
                ..Limits::default()
            }
        })
        .await;
    let tenant = me();
    let scope = svc.for_tenant(&tenant);
    let req = || CreateCommandRequest {
        argv: Some(vec!["true".into()]),
        ..Default::default()
    };
    let full = bed.seed(SandboxState::Running).sandbox.id;
    let other = bed.seed(SandboxState::Running).sandbox.id;
    let _handles = (svc.handle(&full), svc.handle(&other));
    bed.seed_command(&full, CommandState::Running);
    bed.seed_command(&full, CommandState::Starting);
    // Ended commands do not count.
    bed.seed_command(&other, CommandState::Exited);
    bed.seed_command(&other, CommandState::Lost);

    let writes = bed.store.writes();

    // The sandbox's own limit.
    let refused = scope.create_command(&full, req()).await;
    match &refused {
        Err(ServiceError::TooMany { message, .. }) => {
            assert!(message.contains("has 2 commands running"), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(bed.commands(&full).len(), 2);

    assert_only_activity(&bed, &writes);

    // The tenant's: 2 here and 1 there make 3.
    bed.seed_command(&other, CommandState::Running);
    let writes = bed.store.writes();
    let refused = scope.create_command(&other, req()).await;
    match &refused {
        Err(ServiceError::TooMany { message, .. }) => {
            assert!(
                message.contains("tenant default has 3 commands"),
                "{message}"
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(bed.commands(&other).len(), 3);
    assert_only_activity(&bed, &writes);
    // No output directory was made for a refused command.
    assert!(!bed.data_dir().join("outputs").join(&full).exists());
    assert!(!bed.data_dir().join("outputs").join(&other).exists());
    assert!(bed.fake.actions(&full).is_empty());
}

#[tokio::test]
async fn the_build_limit_refuses_before_anything_is_recorded() {
    let bed = TestBed::new();
    let svc = bed
        .start_with(|c| {
            c.limits = Limits {
                max_builds: 1,
                ..Limits::default()
            }
        })
        .await;
    let tenant = me();
    bed.seed_op(None, OperationKind::Build, OperationStatus::Succeeded);
    let mut started = false;
    svc.admit_build(&tenant, || {
        started = true;
        Ok(())
    })
    .await
    .unwrap();
    assert!(started, "an ended build does not count");

    bed.seed_op(None, OperationKind::Build, OperationStatus::Running);
    let mut started = false;
    let refused = svc
        .admit_build(&tenant, || {
            started = true;
            Ok(())
        })
        .await;
    assert!(
        matches!(
            refused,
            Err(ServiceError::TooMany {
                retry_after: Some(5),
                ..
            })
        ),
        "{refused:?}"
    );
    assert!(!started);
    // Another tenant's builds are its own.
    svc.admit_build(&Tenant::new("other"), || Ok(()))
        .await
        .unwrap();
}

/// `GET /v1/events` through the service: an event feed holds one of the tenant's stream
/// slots for its life (a feed past the limit is a 429), passes over nothing, in order, and
/// answers empty when nothing happened within its wait.
#[tokio::test]
async fn an_event_feed_holds_a_stream_slot_and_misses_nothing() {
    let bed = TestBed::new();
    bed.add_template("tiny");
    let svc = bed.start_with(|c| c.limits.max_streams = 1).await;
    let tenant = me();
    let scope = svc.for_tenant(&tenant);
    let mut feed = scope.event_feed(None).expect("a first feed");
    match scope.event_feed(None) {
        Err(ServiceError::TooMany { .. }) => {}
        Err(e) => panic!("a second feed past the limit of 1: {e}"),
        Ok(_) => panic!("a second feed past the limit of 1 was admitted"),
    }
    let idle = std::time::Duration::from_millis(50);
    assert!(
        feed.next(10, idle).await.unwrap().is_empty(),
        "nothing happened yet"
    );

    // Events enough: a create the runtime fails (its sandbox and operation change a few times).
    bed.fake.fail(Op::Create, "no room");
    let op = scope.create_sandbox(create_req()).await.expect("create");
    ended(&svc, &op.id).await;
    let mut seen = Vec::new();
    loop {
        let batch = feed.next(2, idle).await.unwrap();
        if batch.is_empty() {
            break;
        }
        assert!(batch.len() <= 2);
        seen.extend(batch);
    }
    let all = bed.store.events_after(tenant.as_str(), 0, 10_000).unwrap();
    assert!(!all.is_empty());
    assert_eq!(
        seen.iter().map(|e| e.id).collect::<Vec<_>>(),
        all.iter().map(|e| e.id).collect::<Vec<_>>(),
        "every event after the feed opened, once, in order"
    );
    drop(feed);
    let again = scope.event_feed(Some(0)).expect("the slot is back");
    drop(again);
}
