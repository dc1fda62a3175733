//! The tar upload unpacker (`PUT /v1/sandboxes/{id}/files?format=tar`) on hostile
//! archives: containment, limits, cleanup (see tar_common.rs).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "tar_common.rs"]
mod tar_common;

fuzz_target!(|data: &[u8]| {
    tar_common::check(data);
});
