//! `GET /v1/events` as typed [`space_api::Event`]s: a server-sent-events parser
//! (the WHATWG event-stream format: `\n`, `\r\n` or `\r` line ends, `data:`
//! lines joined, comments and `retry:` ignored) with bounded lines and events.

use futures::stream::BoxStream;
use space_api::Event;

use crate::stream::{Decoder, Lines};
use crate::ClientError;

/// Longest line, and longest event (its `data` lines together), read.
pub const MAX_EVENT_BYTES: usize = 4 << 20;

/// Where an event stream starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventsQuery {
    /// `?after=N`: every retained event after id `N` (`0`: all), then live ones.
    pub after: Option<i64>,
    /// `Last-Event-ID: N`, as a reconnecting client sends it (wins over `after`).
    pub last_event_id: Option<i64>,
}

/// Sandbox and operation changes, in id order. It ends only when the connection
/// does; reconnect with `last_event_id` set to the last id seen.
pub type EventStream = BoxStream<'static, Result<Event, ClientError>>;

/// One dispatched server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SseEvent {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

/// The event-stream parser.
pub(crate) struct SseParser {
    lines: Lines,
    data: String,
    has_data: bool,
    id: Option<String>,
    event: Option<String>,
}

#[derive(Debug, thiserror::Error)]
#[error("an event larger than {0} bytes")]
struct EventTooLarge(usize);

impl SseParser {
    pub fn new() -> Self {
        SseParser {
            lines: Lines::any_eol(MAX_EVENT_BYTES),
            data: String::new(),
            has_data: false,
            id: None,
            event: None,
        }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        self.lines.push(bytes);
    }

    /// The next complete event with data.
    pub fn next_event(&mut self) -> Result<Option<SseEvent>, ClientError> {
        loop {
            let Some(r) = self
                .lines
                .next_line()
                .map_err(|e| ClientError::decode("event stream", e))?
            else {
                return Ok(None);
            };
            let line = String::from_utf8_lossy(self.lines.get(r)).into_owned();
            if let Some(ev) = self.line(&line)? {
                return Ok(Some(ev));
            }
        }
    }

    /// The input ended: only an event whose blank line ended with a lone `\r` is whole;
    /// anything else left is an unfinished event, dropped as the format says.
    pub fn finish(&mut self) -> Result<Option<SseEvent>, ClientError> {
        match self.lines.finish() {
            Some(r) => {
                let line = String::from_utf8_lossy(self.lines.get(r)).into_owned();
                self.line(&line)
            }
            None => Ok(None),
        }
    }

    fn line(&mut self, line: &str) -> Result<Option<SseEvent>, ClientError> {
        if line.is_empty() {
            let event = self.event.take();
            if !std::mem::take(&mut self.has_data) {
                return Ok(None);
            }
            let mut data = std::mem::take(&mut self.data);
            data.pop(); // the `\n` after the last data line
            return Ok(Some(SseEvent {
                id: self.id.clone(),
                event,
                data,
            }));
        }
        if line.starts_with(':') {
            return Ok(None);
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => {
                if self.data.len() + value.len() + 1 > MAX_EVENT_BYTES {
                    return Err(ClientError::decode(
                        "event stream",
                        EventTooLarge(MAX_EVENT_BYTES),
                    ));
                }
                self.data.push_str(value);
                self.data.push('\n');
                self.has_data = true;
            }
            "event" => self.event = Some(value.to_string()),
            "id" if !value.contains('\0') => self.id = Some(value.to_string()),
            _ => {}
        }
        Ok(None)
    }
}

/// Server-sent events decoded into [`Event`]s.
pub(crate) struct EventDecoder(pub SseParser);

/// An event whose `id:` or `event:` line says something else than its data: resuming
/// from the id a caller saw would skip or repeat events.
#[derive(Debug, thiserror::Error)]
#[error("the event's {field} line says {line:?}, its data {data:?}")]
struct FieldMismatch {
    field: &'static str,
    line: String,
    data: String,
}

impl EventDecoder {
    fn typed(ev: SseEvent) -> Result<Event, ClientError> {
        let typed: Event =
            serde_json::from_str(&ev.data).map_err(|e| ClientError::decode("event", e))?;
        let mismatch = |field, line: &str, data: String| {
            let line = line.chars().take(32).collect();
            ClientError::decode("event", FieldMismatch { field, line, data })
        };
        match ev.id.as_deref() {
            Some(id) if id != typed.id.to_string() => {
                return Err(mismatch("id", id, typed.id.to_string()))
            }
            _ => {}
        }
        match ev.event.as_deref() {
            Some(kind) if kind != typed.kind => {
                return Err(mismatch("event", kind, typed.kind.clone()))
            }
            _ => {}
        }
        Ok(typed)
    }
}

impl Decoder for EventDecoder {
    type Item = Event;

    fn push(&mut self, data: &[u8]) {
        self.0.push(data);
    }

    fn next(&mut self) -> Result<Option<Event>, ClientError> {
        self.0.next_event()?.map(Self::typed).transpose()
    }

    fn finish(&mut self) -> Result<Option<Event>, ClientError> {
        self.0.finish()?.map(Self::typed).transpose()
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    fn events(input: &[u8], split: &[usize]) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        let mut from = 0;
        for &at in split.iter().chain(std::iter::once(&input.len())) {
            p.push(&input[from..at]);
            from = at;
            while let Some(e) = p.next_event().unwrap() {
                out.push(e);
            }
        }
        out.extend(p.finish().unwrap());
        out
    }

    fn ev(id: Option<&str>, event: Option<&str>, data: &str) -> SseEvent {
        SseEvent {
            id: id.map(Into::into),
            event: event.map(Into::into),
            data: data.into(),
        }
    }

    /// What the server sends: a retry hint, events, a keepalive comment.
    const SERVER: &[u8] = b"retry: 1000\n\nid: 7\nevent: sandbox\ndata: {\"a\":1}\n\n: keepalive\n\nid: 8\nevent: operation\ndata: {\"b\":2}\n\n";

    #[test]
    fn server_frames_across_every_split() {
        let want = vec![
            ev(Some("7"), Some("sandbox"), "{\"a\":1}"),
            ev(Some("8"), Some("operation"), "{\"b\":2}"),
        ];
        for a in 0..=SERVER.len() {
            for b in a..=SERVER.len() {
                assert_eq!(events(SERVER, &[a, b]), want, "split {a}/{b}");
            }
        }
    }

    #[test]
    fn the_format_in_full() {
        let input = b"data:no space\r\ndata:  two spaces\r\rid: 3\nevent\ndata\n\n:comment\ndata: x\rid: 4\r\n\r\ndata: unfinished";
        let want = vec![
            ev(None, None, "no space\n two spaces"),
            ev(Some("3"), Some(""), ""),
            ev(Some("4"), None, "x"),
        ];
        for a in 0..=input.len() {
            assert_eq!(events(input, &[a]), want, "split {a}");
        }
        // A last event closed by a lone `\r` is whole.
        assert_eq!(events(b"data: y\r\r", &[]), vec![ev(None, None, "y")]);
    }

    #[test]
    fn an_endless_event_is_refused() {
        let mut p = SseParser::new();
        let line = format!("data: {}\n", "x".repeat(1 << 16));
        let mut failed = false;
        for _ in 0..(MAX_EVENT_BYTES / (1 << 16) + 2) {
            p.push(line.as_bytes());
            if p.next_event().is_err() {
                failed = true;
                break;
            }
        }
        assert!(failed);
    }

    #[test]
    fn typed_events_and_bad_data() {
        let good = br#"id: 5
event: sandbox
data: {"id":5,"type":"sandbox","created_at":"2024-01-01T00:00:00Z","object":{"id":"sb_x"}}

"#;
        let body = futures::stream::iter(vec![Ok(bytes::Bytes::from_static(good))]).boxed();
        let got: Vec<_> = futures::executor::block_on(
            crate::stream::decoded(body, EventDecoder(SseParser::new())).collect(),
        );
        assert_eq!(got.len(), 1);
        let e = got[0].as_ref().unwrap();
        assert_eq!((e.id, e.kind.as_str()), (5, "sandbox"));
        assert_eq!(e.object["id"], "sb_x");

        let bad = b"data: {\"id\":\"five\"}\n\n";
        let body = futures::stream::iter(vec![Ok(bytes::Bytes::from_static(bad))]).boxed();
        let got: Vec<_> = futures::executor::block_on(
            crate::stream::decoded(body, EventDecoder(SseParser::new())).collect(),
        );
        assert_eq!(got.len(), 1);
        assert!(got[0]
            .as_ref()
            .unwrap_err()
            .to_string()
            .starts_with("unreadable event"));
    }

    fn typed(input: String) -> Vec<Result<Event, String>> {
        let body = futures::stream::iter(vec![Ok(bytes::Bytes::from(input))]).boxed();
        futures::executor::block_on(
            crate::stream::decoded(body, EventDecoder(SseParser::new()))
                .map(|r| r.map_err(|e| format!("{e}: {}", std::error::Error::source(&e).unwrap())))
                .collect(),
        )
    }

    const DATA_5: &str =
        r#"{"id":5,"type":"sandbox","created_at":"2024-01-01T00:00:00Z","object":{}}"#;

    #[test]
    fn id_and_event_lines_must_agree_with_the_data() {
        // Without the lines, or with lines that agree, the event is read.
        for input in [
            format!("data: {DATA_5}\n\n"),
            format!("id: 5\nevent: sandbox\ndata: {DATA_5}\n\n"),
        ] {
            let got = typed(input);
            assert_eq!(got.len(), 1);
            assert_eq!(got[0].as_ref().unwrap().id, 5);
        }
        for (input, want) in [
            (
                format!("id: 6\nevent: sandbox\ndata: {DATA_5}\n\n"),
                r#"the event's id line says "6", its data "5""#,
            ),
            (
                format!("id: 5\nevent: operation\ndata: {DATA_5}\n\n"),
                r#"the event's event line says "operation", its data "sandbox""#,
            ),
            // An id line carries over to the next event (the format's last event ID):
            // an event without its own is checked against the one before.
            (
                format!(
                    "id: 4\ndata: {}\n\ndata: {DATA_5}\n\n",
                    DATA_5.replace(":5", ":4")
                ),
                r#"the event's id line says "4", its data "5""#,
            ),
        ] {
            let got = typed(input);
            let err = got.last().unwrap().as_ref().unwrap_err();
            assert_eq!(err, &format!("unreadable event: {want}"), "{got:?}");
        }
    }
}
