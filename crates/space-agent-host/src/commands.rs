//! Typed calls for commands: spawn, attach (the full-duplex frame stream), signal,
//! forget, list; and the agent's info and quiesce.

use bytes::Bytes;
use http::Method;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;
use serde::de::IgnoredAny;
use space_agent::protocol::{
    AgentInfo, CommandInfo, Frame, FrameDecoder, SignalRequest, SpawnReply, SpawnRequest,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use crate::conn::{
    body_from_stream, encode_segment, success, AgentConn, MAX_AGENT_JSON, REQUEST_TIMEOUT,
};
use crate::error::{AgentError, BodyError};

/// Host frames queued for one attach stream before a sender waits.
const HOST_FRAME_QUEUE: usize = 16;

impl AgentConn {
    /// Starts a command. A program that cannot be started is not an error here: the
    /// command ends at once with 127 or 126 (see the protocol). An id the agent already
    /// has is refused with 409.
    pub async fn spawn(&self, req: &SpawnRequest) -> Result<SpawnReply, AgentError> {
        self.call(
            Method::POST,
            "/v1/commands",
            Some(req),
            MAX_AGENT_JSON,
            Some(REQUEST_TIMEOUT),
        )
        .await
    }

    /// Signals a command's processes (see the protocol); 409 once it has exited.
    pub async fn signal(&self, command_id: &str, signal: i32) -> Result<(), AgentError> {
        let path = format!("/v1/commands/{}/signal", encode_segment(command_id));
        self.call::<IgnoredAny>(
            Method::POST,
            &path,
            Some(&SignalRequest { signal }),
            MAX_AGENT_JSON,
            Some(REQUEST_TIMEOUT),
        )
        .await
        .map(drop)
    }

    /// Makes the agent forget an exited command (what [`Frame::Done`] does on an attach).
    pub async fn forget(&self, command_id: &str) -> Result<(), AgentError> {
        let path = format!("/v1/commands/{}", encode_segment(command_id));
        self.call::<IgnoredAny>(
            Method::DELETE,
            &path,
            None::<&()>,
            MAX_AGENT_JSON,
            Some(REQUEST_TIMEOUT),
        )
        .await
        .map(drop)
    }

    /// Every command the agent still holds.
    pub async fn commands(&self) -> Result<Vec<CommandInfo>, AgentError> {
        self.call(
            Method::GET,
            "/v1/commands",
            None::<&()>,
            MAX_AGENT_JSON,
            Some(REQUEST_TIMEOUT),
        )
        .await
    }

    pub async fn info(&self) -> Result<AgentInfo, AgentError> {
        self.call(
            Method::GET,
            "/v1/info",
            None::<&()>,
            MAX_AGENT_JSON,
            Some(REQUEST_TIMEOUT),
        )
        .await
    }

    /// Has the agent drop this connection (a checkpoint cannot save an open host socket);
    /// it keeps its commands and dials again once woken. The connection may end before
    /// the answer comes: wait for [`AgentConn::closed`], not for this.
    pub async fn quiesce(&self) -> Result<(), AgentError> {
        self.call::<IgnoredAny>(
            Method::POST,
            "/v1/quiesce",
            None::<&()>,
            MAX_AGENT_JSON,
            Some(REQUEST_TIMEOUT),
        )
        .await
        .map(drop)
    }

    /// Opens the full-duplex attach stream of a command from the given offsets (what the
    /// caller has stored): 416 when the agent no longer holds them, 404 for a command it
    /// does not know.
    pub async fn attach(
        &self,
        command_id: &str,
        stdout: u64,
        stderr: u64,
    ) -> Result<Attach, AgentError> {
        self.open_attach(command_id, stdout, stderr, false).await
    }

    /// [`AgentConn::attach`] for input with offsets ([`AgentConn::input_offsets`] must
    /// hold): the agent's first frame is [`Frame::InputTaken`], how much of the command's
    /// input it has taken, and it sends another each time it takes more. Input then goes
    /// as [`Frame::StdinAt`] and [`Frame::StdinEofAt`].
    pub async fn attach_with_input(
        &self,
        command_id: &str,
        stdout: u64,
        stderr: u64,
    ) -> Result<Attach, AgentError> {
        self.open_attach(command_id, stdout, stderr, true).await
    }

    async fn open_attach(
        &self,
        command_id: &str,
        stdout: u64,
        stderr: u64,
        input: bool,
    ) -> Result<Attach, AgentError> {
        let (tx, rx) = mpsc::channel::<Bytes>(HOST_FRAME_QUEUE);
        let body = body_from_stream(ReceiverStream::new(rx).map(Ok::<_, BodyError>));
        let path = format!(
            "/v1/commands/{}/attach?stdout={stdout}&stderr={stderr}{}",
            encode_segment(command_id),
            if input { "&input=1" } else { "" }
        );
        let resp = self
            .request(Method::POST, &path, None, body, Some(REQUEST_TIMEOUT))
            .await?;
        let resp = success(resp).await?;
        let mut attach = Attach::new(tx, resp.into_body().map_err(BodyError::from).boxed_unsync());
        attach.reports_input = input;
        Ok(attach)
    }
}

/// An open attach stream: agent frames in, host frames out.
pub struct Attach {
    host: Option<mpsc::Sender<Bytes>>,
    body: UnsyncBoxBody<Bytes, BodyError>,
    decoder: FrameDecoder,
    /// Opened with [`AgentConn::attach_with_input`]: [`Frame::InputTaken`] may come.
    reports_input: bool,
}

impl Attach {
    pub(crate) fn new(host: mpsc::Sender<Bytes>, body: UnsyncBoxBody<Bytes, BodyError>) -> Attach {
        Attach {
            host: Some(host),
            body,
            decoder: FrameDecoder::new(),
            reports_input: false,
        }
    }

    /// Where host frames ([`Frame::Ack`], [`Frame::Stdin`], [`Frame::StdinEof`],
    /// [`Frame::Resize`], [`Frame::Done`]) go, encoded with [`Frame::to_bytes`]; `None`
    /// after [`Attach::close_host_frames`]. The queue is small: a sender waits while the
    /// agent is not reading.
    pub fn host_frames(&self) -> Option<mpsc::Sender<Bytes>> {
        self.host.clone()
    }

    /// Sends one host frame; an error when the stream is gone.
    pub async fn send(&self, frame: Frame) -> Result<(), AgentError> {
        let host = self
            .host
            .as_ref()
            .ok_or_else(|| AgentError::Request("the host's frames were closed".into()))?;
        host.send(frame.to_bytes())
            .await
            .map_err(|_| AgentError::Broken("the attach stream is closed".into()))
    }

    /// Ends the host's side of the stream once every other sender is gone too.
    pub fn close_host_frames(&mut self) {
        self.host = None;
    }

    /// The next agent frame ([`Frame::Stdout`], [`Frame::Stderr`], [`Frame::Exit`], and
    /// [`Frame::InputTaken`] on an attach with input);
    /// `None` when the stream ended at a frame boundary. Cancel-safe: nothing read is
    /// lost when the future is dropped. A host-only frame or a malformed one is a
    /// [`AgentError::Protocol`]; a stream that broke, or ended inside a frame, is
    /// [`AgentError::Broken`].
    pub async fn next_frame(&mut self) -> Result<Option<Frame>, AgentError> {
        loop {
            if let Some(f) = self.buffered_frame()? {
                return Ok(Some(f));
            }
            match self.body.frame().await {
                None if self.decoder.pending() == 0 => return Ok(None),
                None => {
                    return Err(AgentError::Broken(
                        "the attach stream ended inside a frame".into(),
                    ))
                }
                Some(Err(e)) => return Err(AgentError::Broken(e)),
                Some(Ok(f)) => {
                    // Trailers carry nothing for an attach.
                    if let Ok(d) = f.into_data() {
                        self.decoder.push_bytes(d);
                    }
                }
            }
        }
    }

    /// The next agent frame when it has already arrived, without waiting.
    pub fn buffered_frame(&mut self) -> Result<Option<Frame>, AgentError> {
        match self.decoder.next_frame() {
            Ok(Some(f @ (Frame::Stdout { .. } | Frame::Stderr { .. } | Frame::Exit(_)))) => {
                Ok(Some(f))
            }
            Ok(Some(f @ Frame::InputTaken(_))) if self.reports_input => Ok(Some(f)),
            Ok(Some(_)) => Err(AgentError::Protocol(
                "the agent sent a host-only frame".into(),
            )),
            Ok(None) => Ok(None),
            Err(e) => Err(AgentError::Protocol(format!("a malformed frame: {e}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::StreamBody;
    use hyper::body::Frame as BodyFrame;
    use space_agent::protocol::ExitStatus;

    fn attach_of(chunks: Vec<Result<Bytes, BodyError>>) -> (Attach, mpsc::Receiver<Bytes>) {
        let (tx, rx) = mpsc::channel(4);
        let body = StreamBody::new(futures::stream::iter(
            chunks.into_iter().map(|c| c.map(BodyFrame::data)),
        ));
        (Attach::new(tx, body.boxed_unsync()), rx)
    }

    fn exit() -> Frame {
        Frame::Exit(ExitStatus {
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            oom_killed: false,
            duration_ms: 1,
            error: None,
        })
    }

    #[tokio::test]
    async fn frames_split_anywhere_come_out_whole() {
        let mut bytes = Frame::Stdout {
            offset: 0,
            data: Bytes::from_static(b"hello"),
        }
        .to_bytes()
        .to_vec();
        bytes.extend_from_slice(&exit().to_bytes());
        let chunks = bytes
            .chunks(3)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let (mut a, _rx) = attach_of(chunks);
        assert!(matches!(
            a.next_frame().await,
            Ok(Some(Frame::Stdout { offset: 0, ref data })) if &data[..] == b"hello"
        ));
        assert!(matches!(a.next_frame().await, Ok(Some(Frame::Exit(_)))));
        assert!(matches!(a.next_frame().await, Ok(None)));
    }

    #[tokio::test]
    async fn frames_already_here_are_had_without_waiting() {
        let mut bytes = Frame::Stderr {
            offset: 0,
            data: Bytes::from_static(b"a"),
        }
        .to_bytes()
        .to_vec();
        bytes.extend_from_slice(&exit().to_bytes());
        let (mut a, _rx) = attach_of(vec![Ok(Bytes::from(bytes))]);
        assert!(matches!(a.buffered_frame(), Ok(None)));
        assert!(matches!(
            a.next_frame().await,
            Ok(Some(Frame::Stderr { .. }))
        ));
        assert!(matches!(a.buffered_frame(), Ok(Some(Frame::Exit(_)))));
        assert!(matches!(a.buffered_frame(), Ok(None)));
    }

    #[tokio::test]
    async fn an_end_inside_a_frame_or_a_break_is_broken() {
        let bytes = exit().to_bytes();
        let (mut a, _rx) = attach_of(vec![Ok(bytes.slice(..bytes.len() - 1))]);
        assert!(matches!(a.next_frame().await, Err(AgentError::Broken(_))));
        let (mut a, _rx) = attach_of(vec![Err("reset".into())]);
        assert!(matches!(a.next_frame().await, Err(AgentError::Broken(_))));
    }

    #[tokio::test]
    async fn host_frames_or_garbage_from_the_agent_are_protocol_errors() {
        let (mut a, _rx) = attach_of(vec![Ok(Frame::Done.to_bytes())]);
        assert!(matches!(a.next_frame().await, Err(AgentError::Protocol(_))));
        // An unknown frame type.
        let (mut a, _rx) = attach_of(vec![Ok(Bytes::from_static(&[99, 0, 0, 0, 0]))]);
        assert!(matches!(a.next_frame().await, Err(AgentError::Protocol(_))));
        // A length past the protocol's bound: refused at the header, nothing buffered.
        let (mut a, _rx) = attach_of(vec![Ok(Bytes::from_static(&[1, 0xff, 0xff, 0xff, 0xff]))]);
        assert!(matches!(a.next_frame().await, Err(AgentError::Protocol(_))));
    }

    #[tokio::test]
    async fn host_frames_go_out_encoded_until_closed() {
        let (mut a, mut rx) = attach_of(vec![]);
        a.send(Frame::StdinEof).await.unwrap();
        assert_eq!(rx.recv().await, Some(Frame::StdinEof.to_bytes()));
        a.close_host_frames();
        assert!(a.host_frames().is_none());
        assert!(a.send(Frame::Done).await.is_err());
        assert_eq!(rx.recv().await, None);
    }
}
