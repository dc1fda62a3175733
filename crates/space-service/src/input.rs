//! A command's input on its way to the agent: what callers wrote and the agent has not
//! taken yet, kept so that a broken link loses none of it.
//!
//! Input is a sequence of positions: each stdin byte is one, and so is each end-of-file
//! (on a terminal a caller may type several). The agent reports how far it has taken the
//! sequence ([`Frame::InputTaken`]): first on every attach, then as it takes more. The
//! session forgets what is taken, and a new attach resends the rest from where the agent
//! says it stopped; the agent skips a position it already has. So a write answered 204 is
//! delivered once, whatever breaks in between, as long as this server runs the command's
//! session. Agents from before [`space_agent::protocol::FEATURE_INPUT_OFFSETS`] get input
//! the old way (at most once).

use std::collections::VecDeque;

use bytes::Bytes;
use space_agent::protocol::Frame;

/// Bytes of input a command may have written and not taken: the largest write
/// ([`crate::MAX_STDIN_WRITE`]), as much as the attach stream's queue held before. A write
/// waits for room, then gets a 503. It bounds what a tenant's commands hold in the server
/// while their agents are away (a suspend): 256 running commands hold at most 256 MiB.
pub(crate) const INPUT_LOG_BYTES: usize = crate::MAX_STDIN_WRITE;

/// Data per input frame.
pub(crate) const INPUT_FRAME_BYTES: usize = 64 * 1024;

#[derive(Debug, Clone)]
enum Item {
    Data(Bytes),
    Eof,
}

impl Item {
    fn len(&self) -> u64 {
        match self {
            Item::Data(d) => d.len() as u64,
            Item::Eof => 1,
        }
    }
}

/// The input of one command not taken yet (see the module).
#[derive(Debug, Default)]
pub(crate) struct InputLog {
    /// Items in order, each with its position; the first starts at `taken`.
    items: VecDeque<(u64, Item)>,
    /// Positions below this the agent has taken.
    taken: u64,
    /// The position after the last item.
    end: u64,
    /// Data bytes held.
    bytes: usize,
    /// The session is over: nothing more will be taken, and nothing more is accepted.
    closed: bool,
    /// The agent has reported once. Until then positions count from 0; the first report
    /// moves them after what the agent took before (a session resumed by a new server
    /// process starts with an empty log, and the agent with what it took from the old one).
    synced: bool,
}

impl InputLog {
    /// Appends `data` (in frames of at most [`INPUT_FRAME_BYTES`]) and, with `eof`, an
    /// end-of-file after it, if there is room for all of it; `false` (nothing appended)
    /// when there is not, or when the log is closed. An empty log takes any write.
    pub(crate) fn append(&mut self, data: &Bytes, eof: bool) -> bool {
        if self.closed || (self.bytes > 0 && self.bytes + data.len() > INPUT_LOG_BYTES) {
            return false;
        }
        let mut at = 0;
        while at < data.len() {
            let piece = data.slice(at..(at + INPUT_FRAME_BYTES).min(data.len()));
            at += piece.len();
            self.push(Item::Data(piece));
        }
        if eof {
            self.push(Item::Eof);
        }
        true
    }

    fn push(&mut self, item: Item) {
        if let Item::Data(d) = &item {
            self.bytes += d.len();
        }
        let len = item.len();
        self.items.push_back((self.end, item));
        self.end += len;
    }

    /// The agent has taken everything below `upto`: forgets it. `Ok(true)` when that
    /// freed something. An `upto` past the end is a lie (the agent cannot have taken input
    /// it was never sent), and an error.
    pub(crate) fn take(&mut self, upto: u64) -> Result<bool, String> {
        if !self.synced {
            self.synced = true;
            let shift = upto.saturating_sub(self.taken);
            for (pos, _) in &mut self.items {
                *pos += shift;
            }
            self.taken += shift;
            self.end += shift;
            return Ok(shift > 0);
        }
        if upto > self.end {
            return Err(format!(
                "the agent says it took input up to {upto}, but only {} was written",
                self.end
            ));
        }
        if upto <= self.taken {
            return Ok(false);
        }
        self.taken = upto;
        while let Some((pos, item)) = self.items.front_mut() {
            let len = item.len();
            if *pos + len <= upto {
                if let Item::Data(d) = item {
                    self.bytes -= d.len();
                }
                self.items.pop_front();
                continue;
            }
            if *pos < upto {
                // Part of a data item (an end-of-file is one position).
                let skip = (upto - *pos) as usize;
                if let Item::Data(d) = item {
                    *d = d.slice(skip..);
                    self.bytes -= skip;
                }
                *pos = upto;
            }
            break;
        }
        Ok(true)
    }

    /// The frames of everything from position `from` on, and the position after them.
    pub(crate) fn frames_from(&self, from: u64) -> (Vec<Frame>, u64) {
        let from = from.max(self.taken);
        let mut frames = Vec::new();
        for (pos, item) in &self.items {
            let len = item.len();
            if pos + len <= from {
                continue;
            }
            frames.push(match item {
                Item::Data(d) => {
                    let skip = from.saturating_sub(*pos) as usize;
                    Frame::StdinAt {
                        offset: pos + skip as u64,
                        data: d.slice(skip..),
                    }
                }
                Item::Eof => Frame::StdinEofAt(*pos),
            });
        }
        (frames, self.end.max(from))
    }

    /// Ends the log with the session: writers waiting for room hear so.
    pub(crate) fn close(&mut self) {
        self.closed = true;
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(n: usize, b: u8) -> Bytes {
        Bytes::from(vec![b; n])
    }

    /// What the frames from `from` deliver, as (offset, bytes or None for an EOF).
    fn delivered(log: &InputLog, from: u64) -> Vec<(u64, Option<Bytes>)> {
        log.frames_from(from)
            .0
            .into_iter()
            .map(|f| match f {
                Frame::StdinAt { offset, data } => (offset, Some(data)),
                Frame::StdinEofAt(at) => (at, None),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn input_is_resent_from_where_the_agent_stopped_and_forgotten_once_taken() {
        let mut log = InputLog::default();
        assert_eq!(log.take(0), Ok(false));
        assert!(log.append(&Bytes::from_static(b"hello"), false));
        assert!(log.append(&Bytes::new(), true));
        assert!(log.append(&Bytes::from_static(b"more"), true));
        // Positions: "hello" 0..5, EOF 5, "more" 6..10, EOF 10; end 11.
        let all = delivered(&log, 0);
        assert_eq!(
            all,
            vec![
                (0, Some(Bytes::from_static(b"hello"))),
                (5, None),
                (6, Some(Bytes::from_static(b"more"))),
                (10, None),
            ]
        );
        assert_eq!(log.frames_from(0).1, 11);
        // A resend from the middle of an item starts inside it.
        assert_eq!(
            delivered(&log, 3),
            vec![
                (3, Some(Bytes::from_static(b"lo"))),
                (5, None),
                (6, Some(Bytes::from_static(b"more"))),
                (10, None)
            ]
        );
        // The agent took 7: "hello", the EOF and "m".
        assert_eq!(log.take(7), Ok(true));
        assert_eq!(log.bytes, 3);
        assert_eq!(
            delivered(&log, 0),
            vec![(7, Some(Bytes::from_static(b"ore"))), (10, None)]
        );
        // A stale or repeated report changes nothing; a report past the end is refused.
        assert_eq!(log.take(7), Ok(false));
        assert_eq!(log.take(2), Ok(false));
        assert!(log.take(12).is_err());
        assert_eq!(log.take(11), Ok(true));
        assert_eq!((log.bytes, log.items.len()), (0, 0));
        assert_eq!(log.frames_from(0), (Vec::new(), 11));
    }

    #[test]
    fn the_first_report_places_the_log_after_what_the_agent_took_before() {
        // A session resumed by a new server: a write came before the first attach.
        let mut log = InputLog::default();
        assert!(log.append(&Bytes::from_static(b"abc"), true));
        assert_eq!(log.take(500), Ok(true));
        assert_eq!(
            delivered(&log, 500),
            vec![(500, Some(Bytes::from_static(b"abc"))), (503, None)]
        );
        assert_eq!(log.frames_from(500).1, 504);
        assert!(log.take(505).is_err());
        assert_eq!(log.take(504), Ok(true));
        // A new command's agent has taken nothing: no move.
        let mut log = InputLog::default();
        assert_eq!(log.take(0), Ok(false));
        assert!(log.take(1).is_err());
    }

    #[test]
    fn the_log_is_bounded_takes_any_one_write_when_empty_and_nothing_once_closed() {
        let mut log = InputLog::default();
        let half = bytes(crate::MAX_STDIN_WRITE / 2, b'a');
        assert!(log.append(&half, false));
        assert!(log.append(&half, false));
        // Full: a write waits (nothing of it is appended), even a single byte.
        assert!(!log.append(&bytes(1, b'b'), false));
        assert_eq!(log.bytes, INPUT_LOG_BYTES);
        // Frames are at most INPUT_FRAME_BYTES.
        let (frames, end) = log.frames_from(0);
        assert_eq!(end, INPUT_LOG_BYTES as u64);
        assert_eq!(frames.len(), INPUT_LOG_BYTES / INPUT_FRAME_BYTES);
        assert!(frames
            .iter()
            .all(|f| matches!(f, Frame::StdinAt { data, .. } if data.len() == INPUT_FRAME_BYTES)));
        // Taken, it has room again.
        log.take(0).unwrap();
        log.take(INPUT_LOG_BYTES as u64).unwrap();
        assert!(log.append(&bytes(1, b'b'), true));
        // An empty log takes a write larger than its bound.
        let mut log = InputLog::default();
        assert!(log.append(&bytes(INPUT_LOG_BYTES + 1, b'c'), false));
        log.close();
        assert!(log.is_closed());
        assert!(!log.append(&Bytes::new(), true));
    }
}
