//! As tar_unpack, for `&gzip=true` uploads: the bytes go through the gzip
//! decoder first.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "tar_common.rs"]
mod tar_common;

fuzz_target!(|data: &[u8]| {
    tar_common::check(flate2::read::GzDecoder::new(data));
});
