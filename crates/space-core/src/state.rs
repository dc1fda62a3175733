//! The sandbox state machine: every transition of `DESIGN.md` §1 in one table.

use space_api::SandboxState;

/// Something that happens to a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SandboxEvent {
    /// The runtime booted it and its agent said hello.
    Ready,
    PauseRequested,
    Paused,
    ResumeRequested,
    Resumed,
    SuspendRequested,
    Suspended,
    DestroyRequested,
    Destroyed,
    /// Something went wrong that leaves it unusable.
    Failed,
    /// A pause, suspend or resume stopped before changing anything: back to
    /// where it came from (a suspend to `running`, a pause to `running`).
    PauseAborted,
    SuspendAborted,
    /// A resume that did not happen: back to `paused` or `suspended`.
    ResumeAbortedToPaused,
    ResumeAbortedToSuspended,
}

impl SandboxEvent {
    /// The verb a user would use, for error messages.
    pub fn describe(self) -> &'static str {
        match self {
            SandboxEvent::Ready => "become ready",
            SandboxEvent::PauseRequested | SandboxEvent::Paused => "pause",
            SandboxEvent::ResumeRequested | SandboxEvent::Resumed => "resume",
            SandboxEvent::SuspendRequested | SandboxEvent::Suspended => "suspend",
            SandboxEvent::DestroyRequested | SandboxEvent::Destroyed => "destroy",
            SandboxEvent::Failed => "fail",
            SandboxEvent::PauseAborted => "abort the pause of",
            SandboxEvent::SuspendAborted => "abort the suspend of",
            SandboxEvent::ResumeAbortedToPaused | SandboxEvent::ResumeAbortedToSuspended => {
                "abort the resume of"
            }
        }
    }
}

/// A transition the state machine does not allow (HTTP 409).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cannot {} a sandbox that is {}", .event.describe(), .from)]
pub struct InvalidTransition {
    pub from: SandboxState,
    pub event: SandboxEvent,
}

/// The next state after `event`, or why it cannot happen.
pub fn transition(
    from: SandboxState,
    event: SandboxEvent,
) -> Result<SandboxState, InvalidTransition> {
    use SandboxEvent as E;
    use SandboxState as S;
    let next = match (from, event) {
        (S::Creating, E::Ready) => S::Running,
        (S::Resuming, E::Ready) => S::Running,

        (S::Running, E::PauseRequested) => S::Pausing,
        (S::Pausing, E::Paused) => S::Paused,

        (S::Paused | S::Suspended, E::ResumeRequested) => S::Resuming,
        (S::Resuming, E::Resumed) => S::Running,

        (S::Running | S::Paused, E::SuspendRequested) => S::Suspending,
        (S::Suspending, E::Suspended) => S::Suspended,

        // Destroy always works, from every state but the end.
        (s, E::DestroyRequested) if s != S::Destroying && s != S::Destroyed => S::Destroying,
        (S::Destroying, E::Destroyed) => S::Destroyed,

        (s, E::Failed) if s != S::Destroying && s != S::Destroyed => S::Failed,

        (S::Pausing, E::PauseAborted) => S::Running,
        (S::Suspending, E::SuspendAborted) => S::Running,
        (S::Resuming, E::ResumeAbortedToPaused) => S::Paused,
        (S::Resuming, E::ResumeAbortedToSuspended) => S::Suspended,
        _ => return Err(InvalidTransition { from, event }),
    };
    Ok(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use SandboxEvent as E;
    use SandboxState as S;

    #[test]
    fn lifecycle_paths() {
        let mut s = S::Creating;
        for e in [
            E::Ready,
            E::PauseRequested,
            E::Paused,
            E::ResumeRequested,
            E::Resumed,
            E::SuspendRequested,
            E::Suspended,
            E::ResumeRequested,
            E::Resumed,
            E::DestroyRequested,
            E::Destroyed,
        ] {
            s = transition(s, e).unwrap();
        }
        assert_eq!(s, S::Destroyed);
    }

    #[test]
    fn destroy_works_from_everywhere_but_the_end() {
        for &s in S::ALL {
            let r = transition(s, E::DestroyRequested);
            if matches!(s, S::Destroying | S::Destroyed) {
                assert!(r.is_err());
            } else {
                assert_eq!(r, Ok(S::Destroying));
            }
        }
    }

    #[test]
    fn aborted_operations_go_back() {
        assert_eq!(transition(S::Suspending, E::SuspendAborted), Ok(S::Running));
        assert_eq!(
            transition(S::Resuming, E::ResumeAbortedToSuspended),
            Ok(S::Suspended)
        );
        assert!(transition(S::Running, E::SuspendAborted).is_err());
        // A suspended sandbox cannot be paused; a paused one can be suspended.
        assert!(transition(S::Suspended, E::PauseRequested).is_err());
        assert_eq!(
            transition(S::Paused, E::SuspendRequested),
            Ok(S::Suspending)
        );
    }

    #[test]
    fn illegal_transitions_say_why() {
        let e = transition(S::Running, E::ResumeRequested).unwrap_err();
        assert_eq!(e.to_string(), "cannot resume a sandbox that is running");
        assert!(transition(S::Destroyed, E::Ready).is_err());
        assert!(transition(S::Failed, E::PauseRequested).is_err());
    }
}
