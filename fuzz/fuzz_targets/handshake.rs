//! The handshake: one line of at most MAX_HANDSHAKE_BYTES, read without going
//! past the newline, then parsed as a Hello (host side) or HelloReply (agent side).
#![no_main]

use libfuzzer_sys::fuzz_target;
use space_agent::protocol::{read_handshake_line, Hello, HelloReply, MAX_HANDSHAKE_BYTES};

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let mut cursor = std::io::Cursor::new(data);
    if let Ok(line) = rt.block_on(read_handshake_line(&mut cursor)) {
        assert!(line.len() < MAX_HANDSHAKE_BYTES);
        assert!(!line.contains(&b'\n'));
        assert_eq!(cursor.position() as usize, line.len() + 1);
        if let Ok(h) = serde_json::from_slice::<Hello>(&line) {
            let again = serde_json::to_vec(&h).expect("serialises");
            assert_eq!(
                serde_json::from_slice::<Hello>(&again).expect("round trip"),
                h
            );
        }
        let _ = serde_json::from_slice::<HelloReply>(&line);
    } else {
        assert!(cursor.position() as usize <= MAX_HANDSHAKE_BYTES);
    }
});
