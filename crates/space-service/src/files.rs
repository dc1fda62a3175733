//! The file API: typed calls that the sandbox's agent carries out inside the sandbox,
//! where every path resolves (see `space_agent::fs`). The rules live here, for every
//! front door: which paths may be asked for, the upload limit and the tenant's uploads
//! in flight, that the sandbox runs. The host never touches the sandbox's files itself,
//! and builds no agent request by hand (`space_agent_host` does).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{Stream, StreamExt};
use space_agent_host::{self as agent, body_from_stream, AgentConn, AgentError, Retry};
pub use space_agent_host::{
    BodyError, Download, DownloadBody, DownloadFormat, UploadKind, Uploaded,
};
use space_api::{
    ApiError, ErrorCode, FileInfo, FileListing, MkdirRequest, MoveRequest, Removed, SandboxState,
};

use super::{Service, ServiceError, Tenant};

/// How long a file request (or another one-shot call, such as a create's write of
/// `/etc/hosts`) waits for a (re)connecting agent.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest path accepted (Linux's PATH_MAX).
pub const MAX_PATH: usize = 4096;
/// Longest path component (NAME_MAX).
pub const MAX_NAME: usize = 255;
/// Deepest listing.
pub const MAX_DEPTH: u32 = 64;
/// Largest permission bits (setuid, setgid and sticky included).
pub const MAX_MODE: u32 = 0o7777;

fn api(code: ErrorCode, message: impl Into<String>) -> ServiceError {
    ServiceError::Api(ApiError::new(code, message))
}

/// A path the sandbox could resolve: absolute, bounded, no NUL, no `..`. `what` names
/// it in the error (`path`, `from`, `to`).
pub fn check_path(what: &str, p: &str) -> Result<(), ServiceError> {
    let bad = |m: String| api(ErrorCode::InvalidPath, m);
    if !p.starts_with('/') {
        return Err(bad(format!(
            "{what} must be an absolute path inside the sandbox"
        )));
    }
    if p.len() > MAX_PATH {
        return Err(bad(format!("{what} is longer than {MAX_PATH} bytes")));
    }
    if p.contains('\0') {
        return Err(bad(format!("{what} contains a NUL byte")));
    }
    for c in p.split('/') {
        if c == ".." {
            return Err(bad(format!("{what} must not contain '..' components")));
        }
        if c.len() > MAX_NAME {
            return Err(bad(format!(
                "{what} has a component longer than {MAX_NAME} bytes"
            )));
        }
    }
    Ok(())
}

fn check_mode(mode: Option<u32>) -> Result<(), ServiceError> {
    match mode {
        Some(m) if m > MAX_MODE => Err(api(
            ErrorCode::InvalidRequest,
            format!("mode {m:o} is not permission bits: at most 0o7777"),
        )),
        _ => Ok(()),
    }
}

/// What an agent's failure is to the caller. Its refusals keep their code when it is
/// one of the API's (the agent-host crate checks), and so their status; anything else
/// the agent said is a bad gateway; an agent that is away is worth a retry.
pub(crate) fn agent_failure(e: AgentError) -> ServiceError {
    match e {
        AgentError::NotConnected
        | AgentError::Timeout(_)
        | AgentError::Connection(_)
        | AgentError::NotSent(_) => ServiceError::Unavailable(super::error_chain(&e)),
        AgentError::Refused {
            status,
            code,
            message,
        } if status.is_client_error() || status == http::StatusCode::INSUFFICIENT_STORAGE => {
            api(code, message)
        }
        AgentError::Refused { status, .. } => api(
            ErrorCode::AgentError,
            format!("the sandbox's agent answered {status}"),
        ),
        AgentError::Broken(_) => ServiceError::Unavailable(format!(
            "the file transfer with the sandbox's agent broke off: {}",
            super::error_chain(&e)
        )),
        AgentError::Protocol(_) | AgentError::Failed(_) => {
            api(ErrorCode::AgentError, super::error_chain(&e))
        }
        AgentError::Request(m) => ServiceError::BadRequest(m),
    }
}

/// An upload's bytes, from whatever front door received them.
pub type UploadStream = std::pin::Pin<Box<dyn Stream<Item = Result<Bytes, BodyError>> + Send>>;

impl Service {
    /// Where a running sandbox's agent connection is found, for a file call (409 in any
    /// other state).
    fn file_agent(
        &self,
        sandbox_id: &str,
    ) -> Result<tokio::sync::watch::Receiver<Option<AgentConn>>, ServiceError> {
        let rec = self.record(sandbox_id)?;
        match rec.sandbox.state {
            SandboxState::Running => {}
            SandboxState::Paused | SandboxState::Pausing => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {sandbox_id} is paused: its files can be reached again once it is resumed"
                )))
            }
            SandboxState::Suspended | SandboxState::Suspending => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {sandbox_id} is suspended: resume it to reach its files"
                )))
            }
            state => {
                return Err(ServiceError::Conflict(format!(
                    "sandbox {sandbox_id} is {state}: its files cannot be reached"
                )))
            }
        }
        self.touch(sandbox_id);
        let handle = self.live_handle(sandbox_id).ok_or_else(|| {
            ServiceError::Conflict(format!("sandbox {sandbox_id} is not running"))
        })?;
        Ok(handle.agent.subscribe())
    }

    /// Makes `call` (named `name` in the log) on a running sandbox's agent (409 in any
    /// other state); once more on the agent's next connection when its connection broke
    /// under the call and `retry` allows that (`agent::call_again_on_break`).
    async fn file_call<T, F, Fut>(
        &self,
        sandbox_id: &str,
        retry: Retry,
        name: &'static str,
        call: F,
    ) -> Result<T, ServiceError>
    where
        F: FnMut(AgentConn) -> Fut,
        Fut: std::future::Future<Output = Result<T, AgentError>>,
    {
        let mut rx = self.file_agent(sandbox_id)?;
        agent::call_again_on_break(&mut rx, CONNECT_TIMEOUT, retry, name, call)
            .await
            .map_err(agent_failure)
    }

    /// Starts a download: the file's bytes (or a tar of a directory) as a stream whose
    /// end is complete, or an error item, never a short success.
    pub(super) async fn download_file(
        &self,
        sandbox_id: &str,
        path: &str,
        format: DownloadFormat,
    ) -> Result<Download, ServiceError> {
        check_path("path", path)?;
        // Its request is made again after a break; once its answer came, a break is the
        // body's error.
        let mut d = self
            .file_call(sandbox_id, Retry::Repeatable, "download", |c| async move {
                c.download(path, format).await
            })
            .await?;
        self.touch(sandbox_id);
        // Counted here, so every front door's downloads are (`space_streamed_bytes_total`).
        let svc = self.clone();
        d.body = d.body.observed(move |n| svc.observe_streamed(true, n));
        Ok(d)
    }

    /// Writes `body` at `path`: a file (atomically) or a tar unpacked into a directory.
    /// At most the server's upload limit (413 past it, also when `declared` says so up
    /// front), unpacked too; one of `tenant`'s uploads in flight meanwhile (429 past
    /// its limit).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn upload_file(
        &self,
        tenant: &Tenant,
        sandbox_id: &str,
        path: &str,
        kind: UploadKind,
        parents: bool,
        declared: Option<u64>,
        body: UploadStream,
    ) -> Result<Uploaded, ServiceError> {
        check_path("path", path)?;
        let parent = match (&kind, path.rsplit_once('/')) {
            (UploadKind::File { .. }, Some((dir, _))) if parents && !dir.is_empty() => {
                Some(dir.to_string())
            }
            _ => None,
        };
        let max = self.max_upload_bytes();
        let too_large = || {
            api(
                ErrorCode::TooLarge,
                format!("upload larger than {max} bytes (the server's --max-upload-mib)"),
            )
        };
        let kind = match kind {
            UploadKind::File { mode, uid, gid } => {
                check_mode(mode)?;
                UploadKind::File { mode, uid, gid }
            }
            // The unpacked size is bounded by the same limit; never by the caller.
            UploadKind::Tar { gzip, .. } => UploadKind::Tar {
                gzip,
                max_bytes: Some(max),
            },
        };
        if declared.is_some_and(|n| n > max) {
            return Err(too_large());
        }
        let _upload = self.admit_upload(tenant)?;
        // Missing parent directories are made first (`mkdir -p`, inside the sandbox).
        if let Some(dir) = parent {
            let req = &MkdirRequest {
                path: dir,
                ..Default::default()
            };
            self.file_call(sandbox_id, Retry::Repeatable, "mkdir", |c| async move {
                c.mkdir(req).await
            })
            .await?;
        }
        // The upload itself is made once: its body is read as it goes out, so there is
        // nothing to send again. A break is a 503 that changes nothing (the agent
        // renames the file into place only once all of it came).
        let mut rx = self.file_agent(sandbox_id)?;
        let conn = agent::wait_connected(&mut rx, CONNECT_TIMEOUT)
            .await
            .map_err(agent_failure)?;
        let exceeded = Arc::new(AtomicBool::new(false));
        let body = bounded(body, max, exceeded.clone());
        let result = conn.upload(path, kind, body_from_stream(body)).await;
        if exceeded.load(Ordering::SeqCst) {
            return Err(too_large());
        }
        self.touch(sandbox_id);
        result.map_err(agent_failure)
    }

    pub(super) async fn list_files(
        &self,
        sandbox_id: &str,
        path: &str,
        depth: Option<u32>,
    ) -> Result<FileListing, ServiceError> {
        check_path("path", path)?;
        if depth.is_some_and(|d| d == 0 || d > MAX_DEPTH) {
            return Err(api(
                ErrorCode::InvalidQuery,
                format!("depth must be between 1 and {MAX_DEPTH}"),
            ));
        }
        self.file_call(sandbox_id, Retry::Repeatable, "list", |c| async move {
            c.list_files(path, depth).await
        })
        .await
    }

    pub(super) async fn stat_file(
        &self,
        sandbox_id: &str,
        path: &str,
    ) -> Result<FileInfo, ServiceError> {
        check_path("path", path)?;
        self.file_call(sandbox_id, Retry::Repeatable, "stat", |c| async move {
            c.stat(path).await
        })
        .await
    }

    pub(super) async fn mkdir(
        &self,
        sandbox_id: &str,
        req: &MkdirRequest,
    ) -> Result<FileInfo, ServiceError> {
        check_path("path", &req.path)?;
        check_mode(req.mode)?;
        // `mkdir -p`: made twice, the same.
        self.file_call(sandbox_id, Retry::Repeatable, "mkdir", |c| async move {
            c.mkdir(req).await
        })
        .await
    }

    pub(super) async fn move_file(
        &self,
        sandbox_id: &str,
        req: &MoveRequest,
    ) -> Result<FileInfo, ServiceError> {
        check_path("from", &req.from)?;
        check_path("to", &req.to)?;
        // Made again after it was done, a rename would answer "not found".
        self.file_call(sandbox_id, Retry::IfNotSent, "move", |c| async move {
            c.move_file(req).await
        })
        .await
    }

    pub(super) async fn remove_file(
        &self,
        sandbox_id: &str,
        path: &str,
        recursive: bool,
    ) -> Result<Removed, ServiceError> {
        check_path("path", path)?;
        if path.split('/').all(|c| c.is_empty() || c == ".") {
            return Err(api(
                ErrorCode::InvalidPath,
                "refusing to remove the root directory",
            ));
        }
        // Made again after it was done, a removal would answer "not found".
        self.file_call(sandbox_id, Retry::IfNotSent, "remove", |c| async move {
            c.remove(path, recursive).await
        })
        .await
    }
}

/// `body`, cut off with an error (and `exceeded` set) once it passes `max` bytes.
fn bounded(
    body: UploadStream,
    max: u64,
    exceeded: Arc<AtomicBool>,
) -> impl Stream<Item = Result<Bytes, BodyError>> + Send + 'static {
    let mut seen: u64 = 0;
    let mut done = false;
    body.map(move |item| match item {
        Ok(b) => {
            seen += b.len() as u64;
            if seen > max {
                exceeded.store(true, Ordering::SeqCst);
                Err(BodyError::from(format!("upload larger than {max} bytes")))
            } else {
                Ok(b)
            }
        }
        Err(e) => Err(e),
    })
    // Nothing after the first error.
    .take_while(move |item| {
        let go = !done;
        done |= item.is_err();
        futures::future::ready(go)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn code(r: Result<(), ServiceError>) -> Option<ErrorCode> {
        r.err().map(|e| e.code())
    }

    #[test]
    fn paths_are_checked() {
        assert!(check_path("path", "/a/b").is_ok());
        assert!(check_path("path", "/").is_ok());
        assert!(check_path("path", "/a/..b/c").is_ok());
        for bad in [
            "a/b".to_string(),
            String::new(),
            "/a/../b".into(),
            "/..".into(),
            "/a\0b".into(),
            format!("/{}", "x".repeat(256)),
            "/x".repeat(2049),
        ] {
            assert_eq!(
                code(check_path("path", &bad)),
                Some(ErrorCode::InvalidPath),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn modes_are_permission_bits() {
        assert!(check_mode(None).is_ok());
        assert!(check_mode(Some(0o4755)).is_ok());
        assert!(check_mode(Some(0o7777)).is_ok());
        assert_eq!(
            code(check_mode(Some(0o10000))),
            Some(ErrorCode::InvalidRequest)
        );
    }

    #[test]
    fn agent_refusals_keep_their_code_and_nothing_else_does() {
        let refused = |status: u16, code| AgentError::Refused {
            status: http::StatusCode::from_u16(status).unwrap(),
            code,
            message: "m".into(),
        };
        let e = agent_failure(refused(403, ErrorCode::ForbiddenPath));
        assert_eq!(e.code(), ErrorCode::ForbiddenPath);
        assert_eq!(e.to_string(), "m");
        let e = agent_failure(refused(507, ErrorCode::NoSpace));
        assert_eq!(e.code(), ErrorCode::NoSpace);
        let e = agent_failure(refused(500, ErrorCode::Internal));
        assert_eq!(e.code(), ErrorCode::AgentError);
        assert_eq!(
            agent_failure(AgentError::NotConnected).code(),
            ErrorCode::Unavailable
        );
        assert_eq!(
            agent_failure(AgentError::Failed("EIO".into())).code(),
            ErrorCode::AgentError
        );
    }

    #[tokio::test]
    async fn uploads_past_the_limit_end_in_an_error() {
        let chunks = vec![
            Ok(Bytes::from_static(b"abcd")),
            Ok(Bytes::from_static(b"efgh")),
            Ok(Bytes::from_static(b"ijkl")),
        ];
        let flag = Arc::new(AtomicBool::new(false));
        let out: Vec<_> = bounded(Box::pin(futures::stream::iter(chunks)), 6, flag.clone())
            .collect()
            .await;
        assert_eq!(out.len(), 2);
        assert!(out[0].is_ok() && out[1].is_err());
        assert!(flag.load(Ordering::SeqCst));

        let flag = Arc::new(AtomicBool::new(false));
        let chunks = vec![Ok(Bytes::from_static(b"abcd"))];
        let out: Vec<_> = bounded(Box::pin(futures::stream::iter(chunks)), 4, flag.clone())
            .collect()
            .await;
        assert_eq!(out.len(), 1);
        assert!(!flag.load(Ordering::SeqCst));
    }
}
