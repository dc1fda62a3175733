//! Property tests of the host ⇄ agent protocol decoders. Both ends decode bytes
//! the other sent, and the host treats the guest as hostile, so for any input:
//! no panic, bounded buffering, a clean error for garbage, and a round trip for
//! whatever the encoder produces, however the bytes are split.

use bytes::Bytes;
use proptest::prelude::*;
use space_agent::protocol::{
    AgentInfo, CommandInfo, ErrorBody, ExitStatus, Frame, FrameDecoder, Hello, HelloReply, PtySize,
    SpawnReply, SpawnRequest, FRAME_HEADER_LEN, MAX_FRAME_PAYLOAD, MAX_HANDSHAKE_BYTES,
};

fn exit_status() -> impl Strategy<Value = ExitStatus> {
    (
        any::<Option<i32>>(),
        any::<Option<i32>>(),
        any::<bool>(),
        any::<bool>(),
        any::<u64>(),
        proptest::option::of(".{0,40}"),
    )
        .prop_map(
            |(exit_code, signal, timed_out, oom_killed, duration_ms, error)| ExitStatus {
                exit_code,
                signal,
                timed_out,
                oom_killed,
                duration_ms,
                error,
            },
        )
}

fn data() -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..300).prop_map(Bytes::from)
}

fn frame() -> impl Strategy<Value = Frame> {
    prop_oneof![
        (any::<u64>(), data()).prop_map(|(offset, data)| Frame::Stdout { offset, data }),
        (any::<u64>(), data()).prop_map(|(offset, data)| Frame::Stderr { offset, data }),
        exit_status().prop_map(Frame::Exit),
        (any::<u64>(), any::<u64>()).prop_map(|(stdout, stderr)| Frame::Ack { stdout, stderr }),
        data().prop_map(Frame::Stdin),
        Just(Frame::StdinEof),
        Just(Frame::Done),
        (any::<u16>(), any::<u16>()).prop_map(|(rows, cols)| Frame::Resize(PtySize { rows, cols })),
        (any::<u64>(), data()).prop_map(|(offset, data)| Frame::StdinAt { offset, data }),
        any::<u64>().prop_map(Frame::StdinEofAt),
        any::<u64>().prop_map(Frame::InputTaken),
    ]
}

/// Feeds `bytes` in the given chunk sizes, draining after each push; returns the
/// frames and the first error. Checks the decoder never holds a whole frame it
/// could have returned (its buffer stays below one maximal frame).
fn decode_chunked(bytes: &[u8], chunks: &[usize]) -> (Vec<Frame>, Option<String>) {
    let mut d = FrameDecoder::new();
    let mut frames = Vec::new();
    let mut rest = bytes;
    let mut sizes = chunks.iter().copied().cycle();
    while !rest.is_empty() {
        let n = sizes.next().unwrap_or(1).clamp(1, rest.len());
        d.push(&rest[..n]);
        rest = &rest[n..];
        loop {
            match d.next_frame() {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => break,
                Err(e) => return (frames, Some(e.to_string())),
            }
        }
        assert!(
            d.pending() < FRAME_HEADER_LEN + MAX_FRAME_PAYLOAD,
            "decoder holds {} bytes after draining",
            d.pending()
        );
    }
    (frames, None)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Any sequence of frames survives encode → arbitrary split → decode.
    #[test]
    fn frames_round_trip_across_any_split(
        frames in proptest::collection::vec(frame(), 0..8),
        chunks in proptest::collection::vec(1usize..64, 1..8),
    ) {
        let mut wire = Vec::new();
        for f in &frames {
            wire.extend_from_slice(&f.to_bytes());
        }
        let (got, err) = decode_chunked(&wire, &chunks);
        prop_assert_eq!(err, None);
        prop_assert_eq!(got, frames);
    }

    /// Arbitrary bytes: frames or a clean error, never a panic.
    #[test]
    fn arbitrary_bytes_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..2048),
        chunks in proptest::collection::vec(1usize..512, 1..4),
    ) {
        let (frames, _err) = decode_chunked(&bytes, &chunks);
        // Every frame decoded came from the input: its encoding is no longer than it.
        let total: usize = frames.iter().map(|f| f.to_bytes().len()).sum();
        prop_assert!(total <= bytes.len());
    }

    /// Valid frames with bytes flipped, cut or inserted: still no panic, and frames
    /// before the first damaged byte decode unchanged.
    #[test]
    fn mutated_frames_never_panic(
        frames in proptest::collection::vec(frame(), 1..6),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let mut wire = Vec::new();
        for f in &frames {
            wire.extend_from_slice(&f.to_bytes());
        }
        let first = flips.iter().map(|(i, _)| i.index(wire.len())).min().unwrap_or(0);
        for (i, b) in &flips {
            let i = i.index(wire.len());
            wire[i] ^= b | 1;
        }
        let (got, _err) = decode_chunked(&wire, &[wire.len()]);
        // Frames that lie wholly before the first change are decoded as sent.
        let mut end = 0;
        for (k, f) in frames.iter().enumerate() {
            end += f.to_bytes().len();
            if end > first {
                break;
            }
            prop_assert_eq!(got.get(k), Some(f));
        }
    }

    /// A header announcing more than the limit is refused from the header alone,
    /// before any payload is buffered.
    #[test]
    fn oversized_frames_are_refused_early(t in prop::sample::select(vec![1u8, 2, 3, 16, 17, 18, 19, 20]),
                                          len in (MAX_FRAME_PAYLOAD as u32 + 1)..=u32::MAX) {
        let mut d = FrameDecoder::new();
        let mut h = vec![t];
        h.extend_from_slice(&len.to_be_bytes());
        d.push(&h);
        prop_assert!(d.next_frame().is_err());
    }

    /// The handshake line, both ways: any bytes are a parsed hello or an error, and
    /// what the encoder writes parses back.
    #[test]
    fn handshake_decodes_or_refuses(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = serde_json::from_slice::<Hello>(&bytes);
        let _ = serde_json::from_slice::<HelloReply>(&bytes);
    }

    #[test]
    fn hello_round_trips(protocol in any::<u32>(), sandbox_id in ".{0,64}", token in ".{0,64}", agent_version in ".{0,16}", features in proptest::collection::vec(".{0,16}", 0..3)) {
        let h = Hello { protocol, sandbox_id, token, agent_version, features };
        let line = serde_json::to_vec(&h).unwrap();
        prop_assert!(!line.contains(&b'\n'), "a hello must fit on one line");
        prop_assert_eq!(serde_json::from_slice::<Hello>(&line).unwrap(), h);
        let r = HelloReply { ok: protocol % 2 == 0, protocol, error: None };
        let line = serde_json::to_vec(&r).unwrap();
        prop_assert_eq!(serde_json::from_slice::<HelloReply>(&line).unwrap(), r);
    }

    /// `read_handshake_line` reads at most one line of at most MAX_HANDSHAKE_BYTES and
    /// never consumes a byte past the newline (those belong to HTTP/2).
    #[test]
    fn handshake_line_is_bounded(line in proptest::collection::vec(any::<u8>(), 0..(MAX_HANDSHAKE_BYTES + 64)),
                                 after in proptest::collection::vec(any::<u8>(), 0..16)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let mut input = line.clone();
        input.push(b'\n');
        input.extend_from_slice(&after);
        let mut cursor = std::io::Cursor::new(input);
        let got = rt.block_on(space_agent::protocol::read_handshake_line(&mut cursor));
        let newline = line.iter().position(|&b| b == b'\n').unwrap_or(line.len());
        if newline < MAX_HANDSHAKE_BYTES {
            prop_assert_eq!(got.unwrap(), line[..newline].to_vec());
            prop_assert_eq!(cursor.position() as usize, newline + 1);
        } else {
            prop_assert!(got.is_err());
            prop_assert!(cursor.position() as usize <= MAX_HANDSHAKE_BYTES);
        }
    }

    /// A spawn request body (host → agent): any bytes decode or fail cleanly, and
    /// whatever decodes can be validated without panicking.
    #[test]
    fn spawn_request_decodes_or_refuses(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Ok(req) = serde_json::from_slice::<SpawnRequest>(&bytes) {
            let _ = req.validate();
        }
    }

    #[test]
    fn spawn_request_json_validates(
        id in "[A-Za-z0-9_=\\-\u{0}]{0,70}",
        argv in proptest::collection::vec(".{0,12}", 0..4),
        env in proptest::collection::vec(("[A-Z=\u{0}]{0,6}", ".{0,8}"), 0..4),
    ) {
        let v = serde_json::json!({"id": id, "argv": argv, "env": env});
        let req: SpawnRequest = serde_json::from_value(v).unwrap();
        let ok = req.validate().is_ok();
        let expect = !req.id.is_empty() && req.id.len() <= 64
            && req.id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            && req.argv.first().is_some_and(|a| !a.is_empty())
            && !req.argv.iter().chain(req.env.iter().flat_map(|(k, v)| [k, v])).any(|s| s.contains('\0'))
            && req.env.iter().all(|(k, _)| !k.is_empty() && !k.contains('='));
        prop_assert_eq!(ok, expect, "{:?}", req);
    }

    /// The JSON replies the host reads from the agent (`service/agent.rs`): any bytes,
    /// and valid replies with bytes flipped, decode or fail cleanly.
    #[test]
    fn agent_replies_decode_or_refuse(
        bytes in proptest::collection::vec(any::<u8>(), 0..512),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        which in 0usize..5,
    ) {
        let _ = serde_json::from_slice::<SpawnReply>(&bytes);
        let _ = serde_json::from_slice::<Vec<CommandInfo>>(&bytes);
        let _ = serde_json::from_slice::<AgentInfo>(&bytes);
        let _ = serde_json::from_slice::<ErrorBody>(&bytes);
        let valid = [
            r#"{"pid":42}"#,
            r#"[{"id":"cmd_1","pid":7,"exit":null,"stdout_base":0,"stderr_base":0,"stdout_end":5,"stderr_end":0}]"#,
            r#"{"protocol":1,"agent_version":"0.1.0","pid":1,"commands":0}"#,
            r#"{"error":{"code":"not_found","message":"no command"}}"#,
            r#"{"exit_code":0,"signal":null,"timed_out":false,"duration_ms":3}"#,
        ];
        if flips.is_empty() {
            let v = valid[which].as_bytes();
            let ok = match which {
                0 => serde_json::from_slice::<SpawnReply>(v).is_ok(),
                1 => serde_json::from_slice::<Vec<CommandInfo>>(v).is_ok(),
                2 => serde_json::from_slice::<AgentInfo>(v).is_ok(),
                3 => serde_json::from_slice::<ErrorBody>(v).is_ok(),
                _ => serde_json::from_slice::<ExitStatus>(v).is_ok(),
            };
            prop_assert!(ok, "a valid reply did not decode: {}", valid[which]);
        }
        let mut v = valid[which].as_bytes().to_vec();
        for (i, b) in &flips {
            let i = i.index(v.len());
            v[i] ^= b | 1;
        }
        let _ = serde_json::from_slice::<SpawnReply>(&v);
        let _ = serde_json::from_slice::<Vec<CommandInfo>>(&v);
        let _ = serde_json::from_slice::<AgentInfo>(&v);
        let _ = serde_json::from_slice::<ErrorBody>(&v);
        let _ = serde_json::from_slice::<ExitStatus>(&v);
    }
}
