//! `/v1/sandboxes/{id}/commands`: create (and run-and-wait), list, get (long-poll),
//! signal, stdin, output as typed items, and the attach WebSocket.

use std::time::Duration;

use reqwest::Method;
use space_api::{Command, CommandList, CreateCommandRequest, Signal, SignalRequest};
use tokio_tungstenite::tungstenite;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::output::{OutputDecoder, OutputQuery, OutputStream};
use crate::stream::decoded;
use crate::{wait_param, ByteStream, Client, ClientError, Result};

/// The handshake request of the attach WebSocket, for `tokio_tungstenite::connect_async`.
pub type AttachRequest = tungstenite::handshake::client::Request;
/// An open attach WebSocket.
pub type AttachSocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

impl Client {
    /// `POST /v1/sandboxes/{sb}/commands`: the command (with `wait:true`, ended, its
    /// output inline).
    pub async fn create_command(&self, sb: &str, req: &CreateCommandRequest) -> Result<Command> {
        self.post_json(&["v1", "sandboxes", sb, "commands"], req)
            .await
    }

    /// Runs `argv` with `wait:true`: the ended command with its output inline.
    pub async fn run<S: AsRef<str>>(&self, sb: &str, argv: &[S]) -> Result<Command> {
        let req = CreateCommandRequest {
            argv: Some(argv.iter().map(|a| a.as_ref().to_string()).collect()),
            wait: Some(true),
            ..Default::default()
        };
        self.create_command(sb, &req).await
    }

    /// `GET /v1/sandboxes/{sb}/commands`.
    pub async fn list_commands(&self, sb: &str) -> Result<Vec<Command>> {
        let list: CommandList = self
            .get_json(Method::GET, &["v1", "sandboxes", sb, "commands"], &[])
            .await?;
        Ok(list.commands)
    }

    /// `GET /v1/sandboxes/{sb}/commands/{cid}[?wait=…]`: with `wait`, the server
    /// answers when the command ends or the wait passes.
    pub async fn command(&self, sb: &str, cid: &str, wait: Option<Duration>) -> Result<Command> {
        let query: Vec<(&str, String)> =
            wait.map(|w| ("wait", wait_param(w))).into_iter().collect();
        self.get_json(
            Method::GET,
            &["v1", "sandboxes", sb, "commands", cid],
            &query,
        )
        .await
    }

    /// `POST …/commands/{cid}/signal`: a number (`9`) or a name (`"TERM"`) to the
    /// command's process group.
    pub async fn signal_command(
        &self,
        sb: &str,
        cid: &str,
        signal: impl Into<Signal>,
    ) -> Result<Command> {
        self.post_json(
            &["v1", "sandboxes", sb, "commands", cid, "signal"],
            &SignalRequest {
                signal: signal.into(),
            },
        )
        .await
    }

    /// `POST …/commands/{cid}/stdin[?eof=true]`: bytes (at most 1 MiB a call) to
    /// the stdin of a command started with `stdin` or `pty`; `eof` closes it after them.
    pub async fn write_stdin(
        &self,
        sb: &str,
        cid: &str,
        data: impl Into<reqwest::Body>,
        eof: bool,
    ) -> Result<()> {
        let query: Vec<(&str, String)> = if eof {
            vec![("eof", "true".into())]
        } else {
            vec![]
        };
        let url = self.url(&["v1", "sandboxes", sb, "commands", cid, "stdin"], &query)?;
        self.send_ok(self.req(Method::POST, url, true).body(data))
            .await?;
        Ok(())
    }

    /// `GET …/commands/{cid}/output?offset=&follow=&stream=`: the output as
    /// [`crate::OutputItem`]s (see [`OutputStream`] for how it ends).
    pub async fn command_output(
        &self,
        sb: &str,
        cid: &str,
        q: &OutputQuery,
    ) -> Result<OutputStream> {
        let resp = self
            .get_stream(
                &["v1", "sandboxes", sb, "commands", cid, "output"],
                &output_query(q, false),
            )
            .await?;
        Ok(decoded(self.byte_stream(resp), OutputDecoder::new()))
    }

    /// `GET …/commands/{cid}/output?format=raw&offset=&follow=&stream=`: the view's
    /// bytes alone, with no framing. The stream ends where the NDJSON form sends its
    /// result line; [`Client::command`] then has the result.
    pub async fn command_output_raw(
        &self,
        sb: &str,
        cid: &str,
        q: &OutputQuery,
    ) -> Result<ByteStream> {
        let resp = self
            .get_stream(
                &["v1", "sandboxes", sb, "commands", cid, "output"],
                &output_query(q, true),
            )
            .await?;
        Ok(self.byte_stream(resp))
    }

    /// `ws(s)://…/commands/{cid}/attach[?offset=N]`.
    pub fn attach_url(&self, sb: &str, cid: &str, offset: Option<u64>) -> Result<String> {
        let query: Vec<(&str, String)> = offset
            .map(|o| ("offset", o.to_string()))
            .into_iter()
            .collect();
        let mut url = self.url(&["v1", "sandboxes", sb, "commands", cid, "attach"], &query)?;
        let ws = if url.scheme() == "https" { "wss" } else { "ws" };
        // http→ws and https→wss are both allowed scheme changes.
        let _ = url.set_scheme(ws);
        Ok(url.into())
    }

    /// The attach WebSocket's handshake request with the credentials, for
    /// `tokio_tungstenite::connect_async` (or to send deliberately odd frames).
    ///
    /// On the socket: binary messages from the server are output (first byte 1
    /// stdout, 2 stderr); binary messages to it are stdin; text messages are JSON
    /// controls (`{"type":"resize","rows","cols"}`, `{"type":"eof"}`,
    /// `{"type":"signal","signal"}`), and the server ends with `{"type":"exit",…}`.
    pub fn attach_request(
        &self,
        sb: &str,
        cid: &str,
        offset: Option<u64>,
    ) -> Result<AttachRequest> {
        let url = self.attach_url(sb, cid, offset)?;
        let mut req = url
            .as_str()
            .into_client_request()
            .map_err(|e| ClientError::WebSocket {
                url: url.clone(),
                source: Box::new(e),
            })?;
        req.headers_mut()
            .insert(reqwest::header::AUTHORIZATION, self.auth.clone());
        Ok(req)
    }

    /// Opens the attach WebSocket (see [`Client::attach_request`]). A refusal by
    /// the server (404, 409, …) is [`ClientError::Api`].
    pub async fn attach(&self, sb: &str, cid: &str, offset: Option<u64>) -> Result<AttachSocket> {
        let req = self.attach_request(sb, cid, offset)?;
        let url = req.uri().to_string();
        match tokio_tungstenite::connect_async(req).await {
            Ok((ws, _)) => Ok(ws),
            Err(tungstenite::Error::Http(resp)) => Err(refusal(&resp)),
            Err(e) => Err(ClientError::WebSocket {
                url,
                source: Box::new(e),
            }),
        }
    }
}

/// The query of `GET …/output`: offset, view, follow, and `format=raw` when `raw`.
fn output_query(q: &OutputQuery, raw: bool) -> Vec<(&'static str, String)> {
    let mut query = vec![
        ("offset", q.offset.to_string()),
        ("stream", q.view.as_str().to_string()),
    ];
    if q.follow {
        query.push(("follow", "true".into()));
    }
    if raw {
        query.push(("format", "raw".into()));
    }
    query
}

/// A WebSocket handshake the server answered with an error status.
fn refusal(resp: &tungstenite::http::Response<Option<Vec<u8>>>) -> ClientError {
    let status = resp.status().as_u16();
    let body = resp.body().as_deref().unwrap_or_default();
    let body = &body[..body.len().min(crate::MAX_ERROR_BODY)];
    match serde_json::from_slice::<space_api::ErrorBody>(body) {
        Ok(e) => ClientError::Api {
            status,
            error: e.error,
            retry_after: None,
        },
        Err(_) => ClientError::Status {
            status,
            body: String::from_utf8_lossy(body).into_owned(),
        },
    }
}
