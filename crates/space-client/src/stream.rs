//! Turning a streamed answer into items: a bounded line splitter, and the
//! glue that drives a decoder over a byte stream. The decoders themselves are
//! [`crate::output`] (NDJSON command output) and [`crate::sse`] (events).

use std::ops::Range;

use futures::stream::BoxStream;
use futures::StreamExt;

use crate::{ByteStream, ClientError};

/// A line longer than the splitter's bound.
#[derive(Debug, thiserror::Error)]
#[error("a line longer than {max} bytes")]
pub(crate) struct LineTooLong {
    pub max: usize,
}

/// Splits bytes that arrive in arbitrary pieces into lines, holding at most one
/// partial line of `max` bytes (plus the piece being looked at).
pub(crate) struct Lines {
    buf: Vec<u8>,
    /// Start of the first byte not yet handed out.
    start: usize,
    /// `buf[start..scanned]` is known to hold no line end.
    scanned: usize,
    max: usize,
    /// Also end lines at a lone `\r` and treat `\r\n` as one end (server-sent events).
    cr: bool,
}

impl Lines {
    /// Lines ended by `\n` (a `\r` before it stays in the line).
    pub fn lf(max: usize) -> Lines {
        Lines {
            buf: Vec::new(),
            start: 0,
            scanned: 0,
            max,
            cr: false,
        }
    }

    /// Lines ended by `\n`, `\r\n` or `\r`, as server-sent events have them.
    pub fn any_eol(max: usize) -> Lines {
        Lines {
            cr: true,
            ..Lines::lf(max)
        }
    }

    pub fn push(&mut self, data: &[u8]) {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.scanned -= self.start;
            self.start = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// The next whole line, without its end, as a range of [`Lines::get`];
    /// `None` until more bytes arrive.
    pub fn next_line(&mut self) -> Result<Option<Range<usize>>, LineTooLong> {
        let found = self.buf[self.scanned..]
            .iter()
            .position(|b| *b == b'\n' || (self.cr && *b == b'\r'));
        let Some(i) = found else {
            self.scanned = self.buf.len();
            if self.buf.len() - self.start > self.max {
                return Err(LineTooLong { max: self.max });
            }
            return Ok(None);
        };
        let end = self.scanned + i;
        let mut next = end + 1;
        if self.cr && self.buf[end] == b'\r' {
            match self.buf.get(end + 1) {
                Some(b'\n') => next += 1,
                Some(_) => {}
                // A `\r` as the last byte so far: it may be half of a `\r\n`.
                None => {
                    self.scanned = end;
                    return Ok(None);
                }
            }
        }
        if end - self.start > self.max {
            return Err(LineTooLong { max: self.max });
        }
        let line = self.start..end;
        self.start = next;
        self.scanned = next;
        Ok(Some(line))
    }

    /// The bytes of a range [`Lines::next_line`] returned (valid until the next `push`).
    pub fn get(&self, r: Range<usize>) -> &[u8] {
        &self.buf[r]
    }

    /// At the end of the input: a last line ended by a lone `\r`, if that is what is left.
    pub fn finish(&mut self) -> Option<Range<usize>> {
        let rest = self.start..self.buf.len();
        if self.cr && self.buf[rest.clone()].ends_with(b"\r") {
            self.start = self.buf.len();
            self.scanned = self.start;
            return Some(rest.start..rest.end - 1);
        }
        None
    }
}

/// Items out of a byte stream.
pub(crate) trait Decoder: Send + 'static {
    type Item: Send + 'static;
    fn push(&mut self, data: &[u8]);
    /// The next whole item, `None` until more bytes arrive.
    fn next(&mut self) -> Result<Option<Self::Item>, ClientError>;
    /// The input ended: a last item, if one is complete.
    fn finish(&mut self) -> Result<Option<Self::Item>, ClientError>;
    /// No item can follow the last one (the stream stops reading).
    fn done(&self) -> bool {
        false
    }
}

/// Drives `decoder` over `body`. The stream ends after the decoder's last item,
/// at the end of the body, or after the first error.
pub(crate) fn decoded<D: Decoder>(
    body: ByteStream,
    decoder: D,
) -> BoxStream<'static, Result<D::Item, ClientError>> {
    futures::stream::unfold(Some((body, decoder)), |state| async move {
        let (mut body, mut d) = state?;
        loop {
            match d.next() {
                Ok(Some(item)) => {
                    let next = (!d.done()).then_some((body, d));
                    return Some((Ok(item), next));
                }
                Ok(None) => {}
                Err(e) => return Some((Err(e), None)),
            }
            match body.next().await {
                Some(Ok(chunk)) => d.push(&chunk),
                Some(Err(e)) => return Some((Err(e), None)),
                None => {
                    return match d.finish() {
                        Ok(Some(item)) => Some((Ok(item), None)),
                        Ok(None) => None,
                        Err(e) => Some((Err(e), None)),
                    }
                }
            }
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_lines(l: &mut Lines) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(r) = l.next_line().unwrap() {
            out.push(String::from_utf8_lossy(l.get(r)).into_owned());
        }
        out
    }

    #[test]
    fn lines_across_every_split() {
        let input = b"one\ntwo\r\n\nthree\n";
        for split in 0..=input.len() {
            let mut l = Lines::lf(64);
            l.push(&input[..split]);
            let mut got = all_lines(&mut l);
            l.push(&input[split..]);
            got.extend(all_lines(&mut l));
            assert_eq!(got, ["one", "two\r", "", "three"], "split at {split}");
        }
    }

    #[test]
    fn any_eol_across_every_split() {
        let input = b"a\rb\r\nc\n\r\nd\r";
        for split in 0..=input.len() {
            let mut l = Lines::any_eol(64);
            l.push(&input[..split]);
            let mut got = all_lines(&mut l);
            l.push(&input[split..]);
            got.extend(all_lines(&mut l));
            if let Some(r) = l.finish() {
                got.push(String::from_utf8_lossy(l.get(r)).into_owned());
            }
            assert_eq!(got, ["a", "b", "c", "", "d"], "split at {split}");
        }
    }

    #[test]
    fn an_overlong_line_is_refused_before_it_ends() {
        let mut l = Lines::lf(8);
        l.push(b"12345678");
        assert!(l.next_line().unwrap().is_none());
        l.push(b"9");
        assert!(l.next_line().is_err());
        let mut l = Lines::lf(8);
        l.push(b"ok\n123456789\n");
        assert!(l.next_line().unwrap().is_some());
        assert!(l.next_line().is_err());
    }

    #[test]
    fn memory_stays_bounded_by_the_partial_line() {
        let mut l = Lines::lf(16);
        for _ in 0..10_000 {
            l.push(b"abc\nde");
            while l.next_line().unwrap().is_some() {}
            l.push(b"f\n");
            while l.next_line().unwrap().is_some() {}
        }
        assert!(l.buf.len() <= 16, "{}", l.buf.len());
    }
}
