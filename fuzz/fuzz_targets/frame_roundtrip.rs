//! Frames built from fuzz input survive encode → decode unchanged, whatever
//! the split.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use space_agent::protocol::{ExitStatus, Frame, FrameDecoder, PtySize};

fn u64_at(d: &[u8], i: usize) -> u64 {
    let mut b = [0u8; 8];
    for (k, x) in b.iter_mut().enumerate() {
        *x = d.get(i + k).copied().unwrap_or(0);
    }
    u64::from_be_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    let mut frames = Vec::new();
    let mut rest = data;
    while rest.len() >= 2 && frames.len() < 16 {
        let kind = rest[0] % 8;
        let len = usize::from(rest[1]).min(rest.len() - 2);
        let body = &rest[2..2 + len];
        rest = &rest[2 + len..];
        let n = u64_at(body, 0);
        let payload = Bytes::copy_from_slice(body);
        frames.push(match kind {
            0 => Frame::Stdout {
                offset: n,
                data: payload,
            },
            1 => Frame::Stderr {
                offset: n,
                data: payload,
            },
            2 => Frame::Exit(ExitStatus {
                exit_code: (n % 3 == 0).then_some(n as i32),
                signal: (n % 5 == 0).then_some((n >> 8) as i32),
                timed_out: n % 2 == 0,
                oom_killed: n % 11 == 0,
                duration_ms: n,
                error: (n % 7 == 0).then(|| String::from_utf8_lossy(body).into_owned()),
            }),
            3 => Frame::Ack {
                stdout: n,
                stderr: u64_at(body, 8),
            },
            4 => Frame::Stdin(payload),
            5 => Frame::StdinEof,
            6 => Frame::Done,
            _ => Frame::Resize(PtySize {
                rows: n as u16,
                cols: (n >> 16) as u16,
            }),
        });
    }
    let mut wire = Vec::new();
    for f in &frames {
        wire.extend_from_slice(&f.to_bytes());
    }
    let split = data.first().map_or(1, |&b| usize::from(b).max(1));
    let mut d = FrameDecoder::new();
    let mut got = Vec::new();
    for piece in wire.chunks(split) {
        d.push(piece);
        while let Some(f) = d.next_frame().expect("an encoded frame decodes") {
            got.push(f);
        }
    }
    assert_eq!(got, frames);
    assert_eq!(d.pending(), 0);
});
