//! The attach-stream frame decoder on hostile bytes (the host decodes what the
//! guest's agent sends, the agent what the host sends). The first byte picks the
//! chunk size the rest is fed in, so every split is explored. Properties: no
//! panic, and after draining the decoder never holds a whole frame's worth.
#![no_main]

use libfuzzer_sys::fuzz_target;
use space_agent::protocol::{FrameDecoder, FRAME_HEADER_LEN, MAX_FRAME_PAYLOAD};

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, rest)) = data.split_first() else {
        return;
    };
    let chunk = usize::from(chunk).max(1);
    let mut d = FrameDecoder::new();
    for piece in rest.chunks(chunk) {
        d.push(piece);
        loop {
            match d.next_frame() {
                Ok(Some(frame)) => {
                    // Whatever decodes re-encodes to no more than it came from.
                    assert!(frame.to_bytes().len() <= rest.len());
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(d.pending() < FRAME_HEADER_LEN + MAX_FRAME_PAYLOAD);
    }
});
