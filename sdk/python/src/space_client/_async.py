"""The asyncio client: :class:`AsyncClient` and the objects it hands out. The same
surface as the blocking one, with ``await`` (and ``async for`` / ``async with``)."""

from __future__ import annotations

import dataclasses
import weakref
import asyncio
from typing import Any, AsyncIterator, Iterator

import httpx

from . import _core as core
from . import models
from .errors import ConnectionFailed, NotFound, SpaceError, TooManyRequests, error_from_response
from .models import FileInfo, FileList, Operation, OutputChunk, ProcessResult, Result, Template, UnpackStats


class AsyncClient:
    """An asyncio client of the space API.

    ``url`` defaults to ``$SPACE_URL`` (else ``http://127.0.0.1:7070``), ``token`` to
    ``$SPACE_TOKEN`` (else ``space-dev-token``). ``timeout`` bounds each ordinary
    request (long-polls and requests that wait for a command get what they need).
    ``max_stream_retries``: how many times in a row a broken output stream is
    resumed without progress before :class:`StreamInterrupted` is raised.
    """

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = core.DEFAULT_TIMEOUT,
        max_stream_retries: int = 10,
        http_client: httpx.AsyncClient | None = None,
    ):
        self.url, self.token = core.resolve_config(url, token)
        self.timeout = core._timeout(timeout)
        self.max_stream_retries = max_stream_retries
        self._own_http = http_client is None
        self._http = http_client or httpx.AsyncClient(timeout=self.timeout)
        self._headers = {"authorization": f"Bearer {self.token}"}
        self.sandboxes = AsyncSandboxes(self)
        self.operations = AsyncOperations(self)
        self.templates = AsyncTemplates(self)

    # -- plumbing
    def _timeout_for(self, t: Any) -> httpx.Timeout:
        if t is core._UNSET:
            return httpx.Timeout(self.timeout)
        return httpx.Timeout(self.timeout, read=t, write=None if t is None else t)

    async def _send(self, req: core.Req) -> core.Resp:
        kw: dict[str, Any] = {}
        if req.json is not core._UNSET:
            kw["json"] = req.json
        elif req.content is not None:
            kw["content"] = req.content
        elif req.stream is not None:
            kw["content"] = _aiter_thread(req.stream)
        try:
            r = await self._http.request(
                req.method,
                self.url + req.path,
                params=req.params,
                headers={**self._headers, **(req.headers or {})},
                timeout=self._timeout_for(req.timeout),
                **kw,
            )
        except httpx.TransportError as e:
            raise ConnectionFailed("connection_error", f"{req.method} {req.path}: {type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content, r.headers)
        return core.Resp(r.status_code, r.headers, r.content)

    async def _do(self, eff: Any) -> Any:
        if isinstance(eff, core.Req):
            return await self._send(eff)
        if isinstance(eff, core.CollectOutput):
            s = AsyncOutputStream(self, eff.sandbox_id, eff.command_id, offset=0, follow=True, stream="combined")
            out, err = core.split_streams([c async for c in s])
            return out, err, s.end
        if isinstance(eff, core.Sleep):
            await asyncio.sleep(eff.seconds)
            return None
        raise TypeError(f"unknown effect {eff!r}")

    async def _run(self, flow: core.Flow) -> Any:
        return await core.drive_async(flow, self._do)

    # -- lifetime
    async def close(self) -> None:
        if self._own_http:
            await self._http.aclose()

    aclose = close

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # -- misc
    async def health(self) -> dict:
        """``GET /healthz``."""
        return await self._run(core.health())

    async def runtimes(self) -> list[models.Runtime]:
        """``GET /v1/runtimes``."""
        return await self._run(core.runtimes())

    async def openapi(self) -> dict:
        """The server's OpenAPI document (``GET /v1/openapi.json``)."""
        return await self._run(core.openapi())

    def __repr__(self) -> str:
        return f"AsyncClient(url={self.url!r})"


class AsyncSandboxes:
    """``client.sandboxes``."""

    def __init__(self, client: AsyncClient):
        self._c = client

    async def create(
        self,
        template: str,
        *,
        runtime: str | None = None,
        env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        resources: dict | models.Resources | None = None,
        network: dict | str | models.NetworkSpec | None = None,
        ttl_seconds: int | None = None,
        idle_timeout_seconds: int | None = None,
        on_idle: str | None = None,
        secrets: dict[str, str] | None = None,
        wait: bool = True,
        timeout: float | None = None,
    ) -> "AsyncSandbox | Operation":
        """Creates a sandbox and (``wait=True``) returns it once it runs; a failed
        create raises :class:`OperationFailed` (and the failed sandbox is destroyed).
        With ``wait=False``: the create :class:`Operation` (its ``sandbox_id`` names it)."""
        r = await self._c._run(core.create_sandbox(
            template, runtime=runtime, env=env, labels=labels, resources=resources, network=network,
            ttl_seconds=ttl_seconds, idle_timeout_seconds=idle_timeout_seconds, on_idle=on_idle,
            secrets=secrets, wait=wait, timeout=timeout,
        ))
        return r if isinstance(r, Operation) else AsyncSandbox._wrap(self._c, r)

    async def get(self, sandbox_id: str) -> "AsyncSandbox":
        return AsyncSandbox._wrap(self._c, await self._c._run(core.get_sandbox(sandbox_id)))

    async def list(self, label: str | dict[str, str] | None = None) -> "list[AsyncSandbox]":
        """Every sandbox (``label="k=v[,k2=v2]"`` or ``{"k": "v"}`` to filter)."""
        return [AsyncSandbox._wrap(self._c, d) for d in await self._c._run(core.list_sandboxes(label))]

    async def destroy(self, sandbox_id: str, *, wait: bool = True, timeout: float | None = None) -> Operation:
        return await self._c._run(core.lifecycle(sandbox_id, "destroy", wait, timeout))


class AsyncOperations:
    """``client.operations``."""

    def __init__(self, client: AsyncClient):
        self._c = client

    async def get(self, operation_id: str) -> Operation:
        return await self._c._run(core.get_operation(operation_id))

    async def list(self, sandbox_id: str | None = None, limit: int | None = None) -> list[Operation]:
        return await self._c._run(core.list_operations(sandbox_id, limit))

    async def wait(self, operation: str | Operation, timeout: float | None = None) -> Operation:
        """Long-polls until it ends; raises :class:`OperationFailed` unless it succeeded."""
        core._timeout(timeout)
        if isinstance(operation, str):
            operation = await self.get(operation)
        return await self._c._run(core.wait_operation(operation, timeout))

    async def cancel(self, operation_id: str) -> Operation:
        return await self._c._run(core.cancel_operation(operation_id))

    async def log(self, operation_id: str) -> str:
        """A build operation's log."""
        return await self._c._run(core.operation_log(operation_id))


class AsyncTemplates:
    """``client.templates``."""

    def __init__(self, client: AsyncClient):
        self._c = client

    async def list(self) -> list[Template]:
        return await self._c._run(core.list_templates())

    async def get(self, name: str) -> Template:
        return await self._c._run(core.get_template(name))

    async def build(self, recipe: Any, *, base_dir: Any = None, wait: bool = True,
              timeout: float | None = None) -> "Template | Operation":
        """Builds a template from a recipe: a dict (the JSON form), TOML text, or a
        path to a ``.toml``/``.json`` recipe. Returns the :class:`Template` once
        built (``wait=True``) or the build :class:`Operation`."""
        return await self._c._run(core.build_template(recipe, base_dir=base_dir, wait=wait, timeout=timeout))

    async def delete(self, name: str) -> None:
        await self._c._run(core.delete_template(name))


def _update(obj: Any, new: Any) -> None:
    for f in dataclasses.fields(new):
        setattr(obj, f.name, getattr(new, f.name))


class AsyncSandbox(models.Sandbox):
    """A sandbox (its fields as of the last read, see :meth:`refresh`) and what can
    be done with it. As a context manager it destroys the sandbox on exit."""

    _client: AsyncClient

    @classmethod
    def _wrap(cls, client: AsyncClient, d: dict) -> "AsyncSandbox":
        sb = cls.from_dict(d)
        sb._client = client
        return sb

    async def refresh(self) -> "AsyncSandbox":
        _update(self, models.Sandbox.from_dict(await self._client._run(core.get_sandbox(self.id))))
        return self

    # -- commands
    async def run(
        self,
        cmd: list[str] | str,
        *,
        shell: bool = False,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        secrets: dict[str, str] | None = None,
        stdin: bytes | str | None = None,
        timeout_seconds: int | None = None,
        check: bool = False,
    ) -> Result:
        """Runs a command to its end and returns its :class:`Result` with the whole
        output. ``cmd`` is argv (a list), or a string with ``shell=True``
        (``/bin/sh -c``). ``stdin``: bytes fed to it (then closed). ``check=True``
        raises :class:`CommandError` / :class:`CommandTimeout` unless it exited 0."""
        return await self._client._run(core.run_command(
            self.id, cmd, shell=shell, env=env, cwd=cwd, user=user, secrets=secrets, stdin=stdin,
            timeout_seconds=timeout_seconds, check=check,
        ))

    async def start(
        self,
        cmd: list[str] | str,
        *,
        shell: bool = False,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        secrets: dict[str, str] | None = None,
        stdin: bool = False,
        pty: dict | tuple[int, int] | None = None,
        timeout_seconds: int | None = None,
    ) -> "AsyncCommand":
        """Starts a command and returns at once. ``stdin=True`` lets
        :meth:`AsyncCommand.write_stdin` feed it."""
        body = core.command_body(cmd, shell=shell, env=env, cwd=cwd, user=user, secrets=secrets,
                                 timeout_seconds=timeout_seconds, stdin=stdin, pty=pty)
        return AsyncCommand._wrap(self._client, await self._client._run(core.start_command(self.id, body)))

    @property
    def commands(self) -> "AsyncSandboxCommands":
        return AsyncSandboxCommands(self._client, self.id)

    @property
    def files(self) -> "AsyncFiles":
        return AsyncFiles(self._client, self.id)

    # -- lifecycle
    async def _lifecycle(self, action: str, wait: bool, timeout: float | None) -> Operation:
        op = await self._client._run(core.lifecycle(self.id, action, wait, timeout))
        if wait:
            try:
                await self.refresh()
            except NotFound:
                pass
        return op

    def pause(self, *, wait: bool = True, timeout: float | None = None) -> Operation:
        """Freezes it in memory."""
        return self._lifecycle("pause", wait, timeout)

    def resume(self, *, wait: bool = True, timeout: float | None = None) -> Operation:
        """Resumes a paused or suspended sandbox."""
        return self._lifecycle("resume", wait, timeout)

    def suspend(self, *, wait: bool = True, timeout: float | None = None) -> Operation:
        """Snapshots it to disk and stops it."""
        return self._lifecycle("suspend", wait, timeout)

    def destroy(self, *, wait: bool = True, timeout: float | None = None) -> Operation:
        return self._lifecycle("destroy", wait, timeout)

    async def keepalive(self, ttl_seconds: int | None = None) -> "AsyncSandbox":
        _update(self, models.Sandbox.from_dict(await self._client._run(core.keepalive(self.id, ttl_seconds))))
        return self

    async def snapshot_template(self, name: str, *, wait: bool = True, timeout: float | None = None) -> "Template | Operation":
        """Saves its current files as the next version of template ``name``."""
        return await self._client._run(core.snapshot_template(self.id, name, wait, timeout))

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.state == "destroyed":
            return  # destroyed in the block
        try:
            await self.destroy()
        except NotFound:
            pass
        except SpaceError:
            if exc_type is None:
                raise  # else: don't hide the error that ended the block


class AsyncSandboxCommands:
    """``sandbox.commands``: the sandbox's command sessions."""

    def __init__(self, client: AsyncClient, sandbox_id: str):
        self._c, self._id = client, sandbox_id

    async def list(self) -> "list[AsyncCommand]":
        return [AsyncCommand._wrap(self._c, d) for d in await self._c._run(core.list_commands(self._id))]

    async def get(self, command_id: str) -> "AsyncCommand":
        return AsyncCommand._wrap(self._c, await self._c._run(core.get_command(self._id, command_id)))


class AsyncCommand(models.Command):
    """A command session (fields as of the last read) and what can be done with it."""

    _client: AsyncClient

    @classmethod
    def _wrap(cls, client: AsyncClient, d: dict) -> "AsyncCommand":
        c = cls.from_dict(d)
        c._client = client
        return c

    async def refresh(self) -> "AsyncCommand":
        _update(self, models.Command.from_dict(await self._client._run(core.get_command(self.sandbox_id, self.id))))
        return self

    async def wait(self, timeout: float | None = None) -> ProcessResult:
        """Waits for it to end and returns its :class:`ProcessResult`. Raises
        :class:`CommandLost` if the sandbox went away under it, and
        :class:`CommandTimeout` if ``timeout`` seconds pass first (it goes on)."""
        d = await self._client._run(core.wait_command(self.sandbox_id, self.id, timeout))
        _update(self, models.Command.from_dict(d))
        if self.result is None:
            Result._build(d, b"", b"", False)  # raises CommandLost
        return self.result  # type: ignore[return-value]

    async def signal(self, sig: str | int = "TERM") -> "AsyncCommand":
        """Signals its process group (``"TERM"``, ``"KILL"``, ``"INT"``, 9, …)."""
        _update(self, models.Command.from_dict(await self._client._run(core.signal_command(self.sandbox_id, self.id, sig))))
        return self

    async def kill(self) -> "AsyncCommand":
        return await self.signal("KILL")

    async def write_stdin(self, data: bytes | str, *, eof: bool = False) -> None:
        """Writes to its stdin (started with ``stdin=True`` or a pty); ``eof``
        closes it after."""
        await self._client._run(core.write_stdin(self.sandbox_id, self.id, data, eof))

    async def close_stdin(self) -> None:
        await self.write_stdin(b"", eof=True)

    def output(self, *, follow: bool = False, offset: int = 0, stream: str = "combined") -> "AsyncOutputStream":
        """Its output as :class:`OutputChunk` items, from byte ``offset`` of the
        ``stream`` view (``combined``, ``stdout`` or ``stderr``). With
        ``follow=True`` it goes on until the command ends; a broken connection is
        resumed from the next offset by itself (no byte lost or repeated)."""
        return AsyncOutputStream(self._client, self.sandbox_id, self.id, offset=offset, follow=follow,
                            stream=stream, command=self)

    async def collect(self) -> Result:
        """Follows its output to the end: a :class:`Result` like ``run``'s."""
        s = self.output(follow=True)
        out, err = core.split_streams([c async for c in s])
        d = core._merge_end(self.to_dict(), s.end)
        core._check_whole(d, out, err)
        return Result._build(d, out, err, False)


class AsyncOutputStream:
    """An async iterable of :class:`OutputChunk` (``async for chunk in
    cmd.output(follow=True)``). Once it is exhausted after the
    command's end, ``result``, ``state`` and ``lost_reason`` say how it ended
    (``end`` is the raw end line); ``next_offset`` is where to resume."""

    def __init__(self, client: AsyncClient, sandbox_id: str, command_id: str, *, offset: int = 0,
                 follow: bool = False, stream: str = "combined", command: AsyncCommand | None = None):
        self._c = client
        self._path = core._cmd_path(sandbox_id, command_id) + "/output"
        self._st = core.OutputState(offset, follow, stream, client.max_stream_retries)
        self._cmd = command
        self._gen: Any = None

    @property
    def next_offset(self) -> int:
        return self._st.next_offset

    @property
    def reconnects(self) -> int:
        """How many times the stream was resumed after a break."""
        return self._st.reconnects

    @property
    def end(self) -> dict | None:
        return self._st.end

    @property
    def state(self) -> str | None:
        return self._st.end.get("state") if self._st.end else None

    @property
    def result(self) -> ProcessResult | None:
        r = self._st.end.get("result") if self._st.end else None
        return ProcessResult.from_dict(r) if r else None

    @property
    def lost_reason(self) -> str | None:
        return self._st.end.get("lost_reason") if self._st.end else None

    def __aiter__(self) -> AsyncIterator[OutputChunk]:
        gen = self._iterate()
        # Only a weak reference: the generator's frame holds `self` (no cycle).
        self._gen = weakref.ref(gen)
        return gen

    async def aclose(self) -> None:
        """Stops reading (closes the connection) when the iteration was left early:
        ``async with cmd.output(follow=True) as s: async for chunk in s: …``."""
        gen = self._gen() if self._gen is not None else None
        if gen is not None:
            await gen.aclose()

    async def __aenter__(self) -> "AsyncOutputStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def _iterate(self) -> AsyncIterator[OutputChunk]:
        st, c = self._st, self._c
        while True:
            st.begin()
            delay = None
            try:
                async with c._http.stream(
                    "GET", c.url + self._path, params=st.params, headers=c._headers,
                    timeout=c._timeout_for(None if st.follow else core._UNSET),
                ) as resp:
                    if resp.status_code >= 400:
                        err = error_from_response(resp.status_code, await resp.aread(), resp.headers)
                        if not st.retryable(err):
                            raise err
                        delay = max(st.broken(str(err)), (err.retry_after or 0) if isinstance(err, TooManyRequests) else 0)
                    else:
                        async for data in resp.aiter_bytes():
                            for chunk in st.feed(data):
                                yield chunk
            except httpx.TransportError as e:
                delay = st.broken(f"{type(e).__name__}: {e}")
            if delay is None:
                if st.finished():
                    self._finish()
                    return
                delay = st.broken("the stream ended before the command's end line")
            await asyncio.sleep(delay)

    def _finish(self) -> None:
        if self._cmd is not None and self._st.end:
            self._cmd.state = self._st.end.get("state", self._cmd.state)
            self._cmd.result = self.result
            self._cmd.lost_reason = self._st.end.get("lost_reason")


class AsyncFiles:
    """``sandbox.files``: the sandbox's filesystem (paths are absolute, inside it)."""

    def __init__(self, client: AsyncClient, sandbox_id: str):
        self._c, self._id = client, sandbox_id

    async def write(self, path: str, data: bytes | str | Any, *, mode: int | str | None = None,
              uid: int | None = None, gid: int | None = None, parents: bool = True) -> FileInfo | None:
        """Writes a file atomically (bytes, str as UTF-8, or a binary file object,
        streamed); missing parent directories are made (``parents=False``:
        :class:`NotFound` instead)."""
        return await self._c._run(core.write_file(self._id, path, data, mode=mode, uid=uid, gid=gid, parents=parents))

    async def read(self, path: str) -> bytes:
        return await self._c._run(core.read_file(self._id, path))

    async def read_text(self, path: str, encoding: str = "utf-8") -> str:
        return (await self.read(path)).decode(encoding)

    async def stat(self, path: str) -> FileInfo:
        return await self._c._run(core.stat_file(self._id, path))

    async def exists(self, path: str) -> bool:
        return await self._c._run(core.exists(self._id, path))

    async def list(self, path: str, depth: int | None = None) -> FileList:
        """The entries below ``path`` (``depth`` levels, 1-64, default 1)."""
        return await self._c._run(core.list_files(self._id, path, depth))

    async def mkdir(self, path: str, *, mode: int | None = None, uid: int | None = None, gid: int | None = None) -> FileInfo | None:
        """``mkdir -p``."""
        return await self._c._run(core.mkdir(self._id, path, mode=mode, uid=uid, gid=gid))

    async def move(self, src: str, dst: str, *, overwrite: bool = False) -> FileInfo | None:
        return await self._c._run(core.move(self._id, src, dst, overwrite))

    async def remove(self, path: str, *, recursive: bool = False) -> int:
        """Removes a file (a directory tree with ``recursive=True``); returns how
        many entries went."""
        return await self._c._run(core.remove(self._id, path, recursive))

    async def upload_dir(self, local: Any, remote: str) -> UnpackStats | None:
        """Sends a local directory (a gzip'd tar, streamed) and unpacks it into
        ``remote`` (made if missing). Modes, symlinks and hard links are kept."""
        return await self._c._run(core.upload_dir(self._id, local, remote))

    async def download_dir(self, remote: str, local: Any) -> Any:
        """Fetches directory ``remote`` into ``local`` (made if missing)."""
        return await self._c._run(core.download_dir(self._id, remote, local))


async def _aiter_thread(it: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A blocking iterator (file reads, tar building) read in a worker thread."""
    done = object()
    while True:
        piece = await asyncio.to_thread(next, it, done)
        if piece is done:
            return
        yield piece
