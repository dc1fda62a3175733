//! A spawn request body as the agent reads it: decode, then validate.
#![no_main]

use libfuzzer_sys::fuzz_target;
use space_agent::protocol::{SignalRequest, SpawnRequest};

fuzz_target!(|data: &[u8]| {
    if let Ok(req) = serde_json::from_slice::<SpawnRequest>(data) {
        if req.validate().is_ok() {
            assert!(!req.argv.is_empty());
            assert!(req.argv.iter().all(|a| !a.contains('\0')));
        }
    }
    let _ = serde_json::from_slice::<SignalRequest>(data);
});
