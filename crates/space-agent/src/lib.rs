//! `space-agent`: the process that runs as PID 1 inside every sandbox, and the
//! protocol the host uses to talk to it.
//!
//! The library half ([`protocol`]) is shared by the agent binary and the host;
//! the host treats every byte it decodes with it as hostile.

pub mod fs;
pub mod protocol;
