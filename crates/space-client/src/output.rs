//! A command's output as typed items: the NDJSON lines of
//! `GET …/commands/{cid}/output` decoded (base64 included) into
//! [`OutputItem::Chunk`]s and the final [`OutputItem::End`].

use std::borrow::Cow;

use base64::Engine;
use futures::stream::BoxStream;
use serde::Deserialize;
use space_api::{CommandState, ProcessResult};

use crate::stream::{Decoder, Lines};
use crate::ClientError;

/// Longest NDJSON line read. The server sends chunks of at most 64 KiB (about
/// 88 KiB as base64); this leaves room without letting a line grow without bound.
pub const MAX_OUTPUT_LINE: usize = 4 << 20;

/// Which of a command's streams a chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StdStream {
    Stdout,
    Stderr,
}

impl StdStream {
    pub fn as_str(self) -> &'static str {
        match self {
            StdStream::Stdout => "stdout",
            StdStream::Stderr => "stderr",
        }
    }
}

/// Which bytes an output request reads, and where offsets count from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OutputView {
    /// Both streams interleaved in arrival order (the server's default).
    #[default]
    Combined,
    Stdout,
    Stderr,
}

impl OutputView {
    pub fn as_str(self) -> &'static str {
        match self {
            OutputView::Combined => "combined",
            OutputView::Stdout => "stdout",
            OutputView::Stderr => "stderr",
        }
    }
}

/// `?offset=&follow=&stream=` of an output request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutputQuery {
    /// First byte of the view to send.
    pub offset: u64,
    /// Keep the response open until the command ends.
    pub follow: bool,
    pub view: OutputView,
}

/// One item of a command's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputItem {
    /// Bytes of one stream; `offset` is their position in the view asked for.
    Chunk {
        stream: StdStream,
        offset: u64,
        data: Vec<u8>,
    },
    /// The command has ended; nothing follows. `result` is `None` for a command
    /// that was `lost` (then `lost_reason` says why).
    End {
        state: CommandState,
        result: Option<ProcessResult>,
        lost_reason: Option<String>,
    },
}

/// A command's output. It ends after [`OutputItem::End`]; a stream that ends
/// without one was cut off (the connection broke, or the output was read without
/// `follow` while the command ran): ask again from the next offset.
pub type OutputStream = BoxStream<'static, Result<OutputItem, ClientError>>;

/// One NDJSON line as the server writes it: a chunk or the end.
#[derive(Deserialize)]
struct Line<'a> {
    #[serde(default, borrow)]
    stream: Option<Cow<'a, str>>,
    #[serde(default)]
    offset: Option<u64>,
    #[serde(default, borrow)]
    data: Option<Cow<'a, str>>,
    #[serde(default)]
    state: Option<CommandState>,
    #[serde(default)]
    result: Option<ProcessResult>,
    #[serde(default)]
    lost_reason: Option<String>,
}

/// Why a line is not an output item.
#[derive(Debug, thiserror::Error)]
enum LineError {
    #[error("a chunk without {0}")]
    Missing(&'static str),
    #[error("a chunk of stream {0:?}")]
    UnknownStream(String),
    #[error("neither a chunk nor the end")]
    Neither,
}

pub(crate) fn parse_line(line: &[u8]) -> Result<OutputItem, ClientError> {
    let what = "output line";
    let l: Line = serde_json::from_slice(line).map_err(|e| ClientError::decode(what, e))?;
    if let Some(data) = l.data {
        let stream = match l.stream.as_deref() {
            Some("stdout") => StdStream::Stdout,
            Some("stderr") => StdStream::Stderr,
            Some(other) => {
                let other = other.chars().take(32).collect();
                return Err(ClientError::decode(what, LineError::UnknownStream(other)));
            }
            None => return Err(ClientError::decode(what, LineError::Missing("stream"))),
        };
        let offset = l
            .offset
            .ok_or_else(|| ClientError::decode(what, LineError::Missing("offset")))?;
        let data = base64::engine::general_purpose::STANDARD
            .decode(data.as_bytes())
            .map_err(|e| ClientError::decode("output chunk data", e))?;
        return Ok(OutputItem::Chunk {
            stream,
            offset,
            data,
        });
    }
    match l.state {
        Some(state) => Ok(OutputItem::End {
            state,
            result: l.result,
            lost_reason: l.lost_reason,
        }),
        None => Err(ClientError::decode(what, LineError::Neither)),
    }
}

pub(crate) struct OutputDecoder {
    lines: Lines,
    ended: bool,
}

impl OutputDecoder {
    pub fn new() -> Self {
        OutputDecoder {
            lines: Lines::lf(MAX_OUTPUT_LINE),
            ended: false,
        }
    }
}

impl Decoder for OutputDecoder {
    type Item = OutputItem;

    fn push(&mut self, data: &[u8]) {
        self.lines.push(data);
    }

    fn next(&mut self) -> Result<Option<OutputItem>, ClientError> {
        loop {
            let Some(r) = self
                .lines
                .next_line()
                .map_err(|e| ClientError::decode("output stream", e))?
            else {
                return Ok(None);
            };
            let line = self.lines.get(r);
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let item = parse_line(line)?;
            self.ended = matches!(item, OutputItem::End { .. });
            return Ok(Some(item));
        }
    }

    /// A last line without its `\n` is a cut-off one: the stream just ends.
    fn finish(&mut self) -> Result<Option<OutputItem>, ClientError> {
        Ok(None)
    }

    fn done(&self) -> bool {
        self.ended
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;
    use crate::stream::decoded;

    /// These pieces as a response body.
    fn body(parts: Vec<Vec<u8>>) -> crate::ByteStream {
        futures::stream::iter(parts.into_iter().map(|p| Ok(bytes::Bytes::from(p)))).boxed()
    }

    fn collect(parts: Vec<Vec<u8>>) -> Vec<Result<OutputItem, String>> {
        let s = decoded(body(parts), OutputDecoder::new());
        futures::executor::block_on(s.map(|r| r.map_err(|e| e.to_string())).collect())
    }

    const TWO_CHUNKS_AND_END: &str = concat!(
        r#"{"stream":"stdout","offset":0,"data":"aGk="}"#,
        "\n",
        r#"{"stream":"stderr","offset":2,"data":"AP8K"}"#,
        "\n",
        r#"{"result":{"exit_code":7,"signal":null,"timed_out":false,"oom_killed":false,"duration_ms":3,"stdout_bytes":2,"stderr_bytes":3,"output_truncated":false},"state":"exited"}"#,
        "\n",
    );

    fn expected() -> Vec<OutputItem> {
        vec![
            OutputItem::Chunk {
                stream: StdStream::Stdout,
                offset: 0,
                data: b"hi".to_vec(),
            },
            OutputItem::Chunk {
                stream: StdStream::Stderr,
                offset: 2,
                data: vec![0, 0xff, b'\n'],
            },
            OutputItem::End {
                state: CommandState::Exited,
                result: Some(ProcessResult {
                    exit_code: Some(7),
                    duration_ms: 3,
                    stdout_bytes: 2,
                    stderr_bytes: 3,
                    ..Default::default()
                }),
                lost_reason: None,
            },
        ]
    }

    #[test]
    fn items_across_every_chunk_boundary() {
        let input = TWO_CHUNKS_AND_END.as_bytes();
        for a in 0..=input.len() {
            for b in [a, (a + 7).min(input.len()), input.len()] {
                let parts = vec![
                    input[..a].to_vec(),
                    input[a..b].to_vec(),
                    input[b..].to_vec(),
                ];
                let got: Vec<OutputItem> = collect(parts)
                    .into_iter()
                    .map(|r| r.unwrap_or_else(|e| panic!("split {a}/{b}: {e}")))
                    .collect();
                assert_eq!(got, expected(), "split {a}/{b}");
            }
        }
    }

    #[test]
    fn one_byte_at_a_time() {
        let parts = TWO_CHUNKS_AND_END.bytes().map(|b| vec![b]).collect();
        let got: Vec<OutputItem> = collect(parts).into_iter().map(Result::unwrap).collect();
        assert_eq!(got, expected());
    }

    #[test]
    fn a_lost_command_ends_without_a_result() {
        let line = br#"{"result":null,"state":"lost","lost_reason":"sandbox destroyed"}"#;
        assert_eq!(
            parse_line(line).unwrap(),
            OutputItem::End {
                state: CommandState::Lost,
                result: None,
                lost_reason: Some("sandbox destroyed".into()),
            }
        );
    }

    #[test]
    fn the_stream_stops_at_the_end_line() {
        let mut input = TWO_CHUNKS_AND_END.as_bytes().to_vec();
        input.extend_from_slice(b"garbage that is never read\n");
        assert_eq!(collect(vec![input]).len(), 3);
    }

    #[test]
    fn a_cut_off_stream_just_ends() {
        let input = TWO_CHUNKS_AND_END.as_bytes();
        let cut = input.len() - 10;
        let got = collect(vec![input[..cut].to_vec()]);
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got.iter().all(Result::is_ok));
    }

    #[test]
    fn bad_lines_are_errors_and_end_the_stream() {
        for (line, want) in [
            (&b"not json\n"[..], "unreadable output line"),
            (
                b"{\"stream\":\"stdout\",\"offset\":0,\"data\":\"!!\"}\n",
                "unreadable output chunk data",
            ),
            (
                b"{\"stream\":\"tty\",\"offset\":0,\"data\":\"\"}\n",
                "unreadable output line",
            ),
            (
                b"{\"stream\":\"stdout\",\"data\":\"\"}\n",
                "unreadable output line",
            ),
            (b"{\"hello\":1}\n", "unreadable output line"),
            (b"{\"state\":\"sleeping\"}\n", "unreadable output line"),
        ] {
            let mut input = line.to_vec();
            input.extend_from_slice(TWO_CHUNKS_AND_END.as_bytes());
            let got = collect(vec![input]);
            assert_eq!(got.len(), 1, "{got:?}");
            let err = got[0].as_ref().unwrap_err();
            assert!(err.starts_with(want), "{err}");
        }
    }

    #[test]
    fn an_endless_line_is_refused() {
        let parts = (0..(MAX_OUTPUT_LINE / (1 << 16) + 2))
            .map(|_| vec![b'a'; 1 << 16])
            .collect();
        let got = collect(parts);
        assert_eq!(got.len(), 1);
        assert!(got[0].is_err());
    }
}
