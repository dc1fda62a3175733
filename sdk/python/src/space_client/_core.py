"""What the sync and the async client share: argument checks, request building,
response decoding, and every multi-request flow (wait for an operation, run a
command and make sure its output is whole, …) written once, as generators that
yield effects (:class:`Req`, :class:`CollectOutput`, :class:`Sleep`) and receive
their results. ``Client`` drives them with blocking I/O, ``AsyncClient`` with
``await``."""

from __future__ import annotations

import base64
import json
import os
import random
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Mapping
from urllib.parse import quote

from .errors import (
    CommandTimeout,
    Conflict,
    DecodeError,
    InvalidArgument,
    NotFound,
    OperationFailed,
    ServerError,
    SpaceError,
    StreamInterrupted,
    TooManyRequests,
    Unavailable,
    WaitTimeout,
)
from .models import (
    FileInfo,
    FileList,
    Operation,
    OutputChunk,
    Result,
    Runtime,
    Template,
    UnpackStats,
)

DEFAULT_URL = "http://127.0.0.1:7070"
DEFAULT_TOKEN = "space-dev-token"
DEFAULT_TIMEOUT = 30.0
#: How long one long-poll asks the server to hold (``?wait=``).
POLL_SECONDS = 30
#: Stdin goes in bodies of at most this size (the server's limit is 1 MiB).
STDIN_CHUNK = 1 << 20
UPLOAD_CHUNK = 1 << 20

_UNSET: Any = object()


def resolve_config(url: str | None, token: str | None) -> tuple[str, str]:
    url = url if url is not None else os.environ.get("SPACE_URL") or DEFAULT_URL
    token = token if token is not None else os.environ.get("SPACE_TOKEN") or DEFAULT_TOKEN
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise InvalidArgument(f"url must be an http:// or https:// URL, got {url!r}")
    if not isinstance(token, str) or not token:
        raise InvalidArgument("token must be a non-empty string")
    return url.rstrip("/"), token


# --------------------------------------------------------------------------- effects


@dataclass
class Req:
    """One HTTP request. ``timeout``: ``_UNSET`` for the client's default, ``None``
    for no read timeout (a request the server holds open, e.g. ``wait: true``)."""

    method: str
    path: str
    params: dict[str, Any] | None = None
    json: Any = _UNSET
    content: bytes | None = None
    # A body streamed from a (sync) iterator of bytes; the async client reads it
    # in a worker thread.
    stream: Iterator[bytes] | None = None
    headers: dict[str, str] | None = None
    timeout: float | None = _UNSET


@dataclass
class Resp:
    status: int
    headers: Mapping[str, str]
    content: bytes

    def json(self) -> Any:
        try:
            return json.loads(self.content)
        except ValueError as e:
            raise DecodeError("decode_error", f"the server answered non-JSON ({e}): {self.content[:200]!r}") from None


@dataclass
class CollectOutput:
    """Read a command's whole output (following it to its end line, resuming on
    a broken connection). Answers ``(stdout, stderr, end_line)``."""

    sandbox_id: str
    command_id: str


@dataclass
class Sleep:
    seconds: float


Flow = Generator[Any, Any, Any]


def drive_sync(gen: Flow, do: Callable[[Any], Any]) -> Any:
    value: Any = None
    exc: BaseException | None = None
    while True:
        try:
            eff = gen.throw(exc) if exc is not None else gen.send(value)
        except StopIteration as stop:
            return stop.value
        value, exc = None, None
        try:
            value = do(eff)
        except SpaceError as e:
            exc = e


async def drive_async(gen: Flow, do: Callable[[Any], Any]) -> Any:
    value: Any = None
    exc: BaseException | None = None
    while True:
        try:
            eff = gen.throw(exc) if exc is not None else gen.send(value)
        except StopIteration as stop:
            return stop.value
        value, exc = None, None
        try:
            value = await do(eff)
        except SpaceError as e:
            exc = e


# --------------------------------------------------------------------------- checks


def seg(s: Any, what: str) -> str:
    """An id or name as one URL path segment."""
    if not isinstance(s, str) or not s:
        raise InvalidArgument(f"{what} must be a non-empty string, got {s!r}")
    return quote(s, safe="")


def _nonneg_int(v: Any, what: str, allow_none: bool = True) -> int | None:
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer() and v >= 0:
            return int(v)
        raise InvalidArgument(f"{what} must be a non-negative integer, got {v!r}")
    if v < 0:
        raise InvalidArgument(f"{what} must be >= 0, got {v}")
    return v


def _timeout(v: Any, what: str = "timeout") -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise InvalidArgument(f"{what} must be a number of seconds >= 0, got {v!r}")
    return float(v)


def _str_map(v: Any, what: str) -> dict[str, str] | None:
    if v is None:
        return None
    if not isinstance(v, Mapping):
        raise InvalidArgument(f"{what} must be a mapping of strings to strings, got {type(v).__name__}")
    for k, x in v.items():
        if not isinstance(k, str) or not isinstance(x, str):
            raise InvalidArgument(f"{what} must map strings to strings, got {k!r}: {x!r}")
    return dict(v)


def _opt_str(v: Any, what: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise InvalidArgument(f"{what} must be a non-empty string, got {v!r}")
    return v


def abs_path(p: Any, what: str = "path") -> str:
    if isinstance(p, os.PathLike):
        p = os.fspath(p)
    if not isinstance(p, str):
        raise InvalidArgument(f"{what} must be a string, got {type(p).__name__}")
    if not p.startswith("/"):
        raise InvalidArgument(f"{what} must be an absolute path inside the sandbox, got {p!r}")
    if "\0" in p:
        raise InvalidArgument(f"{what} must not contain NUL")
    return p


def _mode(m: Any) -> str | None:
    if m is None:
        return None
    if isinstance(m, bool):
        raise InvalidArgument(f"mode must be an int such as 0o644, got {m!r}")
    if isinstance(m, int):
        if not 0 <= m <= 0o7777:
            raise InvalidArgument(f"mode must be between 0 and 0o7777, got {oct(m)}")
        return f"{m:04o}"
    if isinstance(m, str) and 3 <= len(m) <= 5 and all(c in "01234567" for c in m):
        return m
    raise InvalidArgument(f"mode must be an int such as 0o644 or an octal string such as '0644', got {m!r}")


def _signal(sig: Any) -> int | str:
    if isinstance(sig, bool):
        raise InvalidArgument(f"signal must be a name such as 'TERM' or a number 1-64, got {sig!r}")
    if isinstance(sig, int):
        if not 1 <= sig <= 64:
            raise InvalidArgument(f"signal number must be 1-64, got {sig}")
        return sig
    if hasattr(sig, "value") and isinstance(sig.value, int):  # signal.Signals
        return _signal(int(sig.value))
    if isinstance(sig, str) and sig.strip():
        return sig.strip()
    raise InvalidArgument(f"signal must be a name such as 'TERM' or a number 1-64, got {sig!r}")


def _stream_view(stream: Any) -> str:
    if stream not in ("combined", "stdout", "stderr"):
        raise InvalidArgument(f"stream must be 'combined', 'stdout' or 'stderr', got {stream!r}")
    return stream


def command_body(
    cmd: Any,
    *,
    shell: bool,
    env: Any,
    cwd: Any,
    user: Any,
    secrets: Any,
    timeout_seconds: Any,
    stdin: bool = False,
    pty: Any = None,
    wait: bool = False,
) -> dict[str, Any]:
    if not isinstance(shell, bool):
        raise InvalidArgument(f"shell must be True or False, got {shell!r}")
    body: dict[str, Any] = {}
    if shell:
        if not isinstance(cmd, str):
            raise InvalidArgument(
                f"shell=True takes the command line as one string, got {type(cmd).__name__}"
                " (pass a list without shell=True to run argv directly)"
            )
        if not cmd.strip():
            raise InvalidArgument("the shell command is empty")
        body["shell"] = cmd
    else:
        if isinstance(cmd, str):
            raise InvalidArgument(
                f"a command given as a string needs shell=True (sb.run({cmd!r}, shell=True)); "
                "or pass argv as a list, e.g. ['ls', '-l']"
            )
        if not isinstance(cmd, (list, tuple)):
            raise InvalidArgument(f"command must be a list of strings (argv) or a string with shell=True, got {cmd!r}")
        if not cmd:
            raise InvalidArgument("argv is empty")
        argv = []
        for a in cmd:
            if isinstance(a, os.PathLike):
                a = os.fspath(a)
            if not isinstance(a, str):
                raise InvalidArgument(f"every argv item must be a string, got {a!r}")
            argv.append(a)
        body["argv"] = argv
    if (e := _str_map(env, "env")) is not None:
        body["env"] = e
    if (s := _str_map(secrets, "secrets")) is not None:
        body["secrets"] = s
    if (c := _opt_str(cwd, "cwd")) is not None:
        body["cwd"] = c
    if user is not None:
        body["user"] = str(user) if isinstance(user, int) and not isinstance(user, bool) else _opt_str(user, "user")
    if (t := _nonneg_int(timeout_seconds, "timeout_seconds")) is not None:
        body["timeout_seconds"] = t
    if stdin:
        body["stdin"] = True
    if pty is not None:
        if isinstance(pty, (tuple, list)) and len(pty) == 2:
            pty = {"rows": pty[0], "cols": pty[1]}
        if not isinstance(pty, Mapping) or set(pty) != {"rows", "cols"}:
            raise InvalidArgument(f"pty must be {{'rows': R, 'cols': C}} or (rows, cols), got {pty!r}")
        body["pty"] = {"rows": _nonneg_int(pty["rows"], "pty rows", False), "cols": _nonneg_int(pty["cols"], "pty cols", False)}
    if wait:
        body["wait"] = True
    return body


def stdin_bytes(data: Any) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    raise InvalidArgument(f"stdin must be bytes or str, got {type(data).__name__}")


def label_selector(label: Any) -> str | None:
    if label is None:
        return None
    if isinstance(label, str):
        if "=" not in label:
            raise InvalidArgument(f"label must be 'key=value' (several joined by ','), got {label!r}")
        return label
    if isinstance(label, Mapping):
        m = _str_map(label, "label")
        assert m is not None
        return ",".join(f"{k}={v}" for k, v in m.items())
    raise InvalidArgument(f"label must be 'key=value' or a dict, got {label!r}")


# --------------------------------------------------------------------------- operations


def _op(d: Any) -> Operation:
    return d if isinstance(d, Operation) else Operation.from_dict(d)


def wait_operation(op: Any, timeout: float | None = None) -> Flow:
    """Long-polls until the operation has ended; raises :class:`OperationFailed`
    unless it succeeded, :class:`WaitTimeout` past ``timeout``."""
    op = _op(op)
    timeout = _timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not op.done:
        poll = POLL_SECONDS
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"{op.kind} operation {op.id} still {op.status} after {timeout} s", op)
            poll = max(1, min(POLL_SECONDS, int(left + 0.999)))
        r = yield Req("GET", f"/v1/operations/{seg(op.id, 'operation id')}", params={"wait": f"{poll}s"}, timeout=poll + 30)
        op = _op(r.json())
    if op.status != "succeeded":
        raise OperationFailed(op)
    return op


def get_operation(op_id: str) -> Flow:
    r = yield Req("GET", f"/v1/operations/{seg(op_id, 'operation id')}")
    return _op(r.json())


def list_operations(sandbox_id: str | None, limit: int | None) -> Flow:
    params: dict[str, Any] = {}
    if sandbox_id is not None:
        params["sandbox_id"] = _opt_str(sandbox_id, "sandbox_id")
    if (n := _nonneg_int(limit, "limit")) is not None:
        params["limit"] = n
    r = yield Req("GET", "/v1/operations", params=params or None)
    return [_op(x) for x in r.json()["operations"]]


def cancel_operation(op_id: str) -> Flow:
    r = yield Req("POST", f"/v1/operations/{seg(op_id, 'operation id')}/cancel")
    return _op(r.json())


def operation_log(op_id: str) -> Flow:
    r = yield Req("GET", f"/v1/operations/{seg(op_id, 'operation id')}/log")
    return r.content.decode("utf-8", "replace")


# --------------------------------------------------------------------------- sandboxes


def _model_or_map(v: Any, what: str) -> dict | None:
    if v is None:
        return None
    if hasattr(v, "to_dict"):
        return {k: x for k, x in v.to_dict().items() if x is not None}
    if isinstance(v, Mapping):
        return dict(v)
    raise InvalidArgument(f"{what} must be a dict, got {type(v).__name__}")


def create_sandbox(
    template: Any,
    *,
    runtime: Any = None,
    env: Any = None,
    labels: Any = None,
    resources: Any = None,
    network: Any = None,
    ttl_seconds: Any = None,
    idle_timeout_seconds: Any = None,
    on_idle: Any = None,
    secrets: Any = None,
    wait: bool = True,
    timeout: Any = None,
) -> Flow:
    """Answers the sandbox's JSON once it runs (``wait``), else the create Operation."""
    if not isinstance(template, str) or not template:
        raise InvalidArgument(f"template must be a template name, got {template!r}")
    body: dict[str, Any] = {"template": template}
    if (v := _opt_str(runtime, "runtime")) is not None:
        body["runtime"] = v
    if (v := _str_map(env, "env")) is not None:
        body["env"] = v
    if (v := _str_map(labels, "labels")) is not None:
        body["labels"] = v
    if (v := _str_map(secrets, "secrets")) is not None:
        body["secrets"] = v
    if (v := _model_or_map(resources, "resources")) is not None:
        body["resources"] = v
    if isinstance(network, str):
        network = {"mode": network}
    if (v := _model_or_map(network, "network")) is not None:
        body["network"] = v
    if (v := _nonneg_int(ttl_seconds, "ttl_seconds")) is not None:
        body["ttl_seconds"] = v
    if (v := _nonneg_int(idle_timeout_seconds, "idle_timeout_seconds")) is not None:
        body["idle_timeout_seconds"] = v
    if on_idle is not None:
        if on_idle not in ("suspend", "destroy"):
            raise InvalidArgument(f"on_idle must be 'suspend' or 'destroy', got {on_idle!r}")
        body["on_idle"] = on_idle
    timeout = _timeout(timeout)
    r = yield Req("POST", "/v1/sandboxes", json=body)
    op = _op(r.json())
    if not wait:
        return op
    try:
        op = yield from wait_operation(op, timeout)
    except OperationFailed:
        # A sandbox whose create failed is of no use and destroy always works from
        # `failed`: don't leave it behind (the exception keeps its id and reason).
        if op.sandbox_id:
            try:
                yield Req("DELETE", f"/v1/sandboxes/{seg(op.sandbox_id, 'sandbox id')}")
            except SpaceError:
                pass
        raise
    r = yield Req("GET", f"/v1/sandboxes/{seg(op.sandbox_id, 'sandbox id')}")
    return r.json()


def get_sandbox(sandbox_id: Any) -> Flow:
    r = yield Req("GET", f"/v1/sandboxes/{seg(sandbox_id, 'sandbox id')}")
    return r.json()


def list_sandboxes(label: Any = None) -> Flow:
    sel = label_selector(label)
    r = yield Req("GET", "/v1/sandboxes", params={"label": sel} if sel else None)
    return r.json()["sandboxes"]


_ACTIONS = {"pause": "POST", "resume": "POST", "suspend": "POST", "destroy": "DELETE"}


def lifecycle(sandbox_id: Any, action: str, wait: bool = True, timeout: Any = None) -> Flow:
    """pause / resume / suspend / destroy: the ended Operation (``wait``), else the
    Operation as accepted."""
    method = _ACTIONS[action]
    if not isinstance(wait, bool):
        raise InvalidArgument(f"wait must be True or False, got {wait!r}")
    timeout = _timeout(timeout)
    path = f"/v1/sandboxes/{seg(sandbox_id, 'sandbox id')}"
    if action != "destroy":
        path += f"/{action}"
    r = yield Req(method, path)
    op = _op(r.json())
    if not wait:
        return op
    return (yield from wait_operation(op, timeout))


def keepalive(sandbox_id: Any, ttl_seconds: Any = None) -> Flow:
    body = {}
    if (t := _nonneg_int(ttl_seconds, "ttl_seconds")) is not None:
        body["ttl_seconds"] = t
    r = yield Req("POST", f"/v1/sandboxes/{seg(sandbox_id, 'sandbox id')}/keepalive", json=body)
    return r.json()


def snapshot_template(sandbox_id: Any, name: Any, wait: bool = True, timeout: Any = None) -> Flow:
    name = _opt_str(name, "name")
    timeout = _timeout(timeout)
    r = yield Req("POST", f"/v1/sandboxes/{seg(sandbox_id, 'sandbox id')}/snapshot-template", json={"name": name})
    op = _op(r.json())
    if not wait:
        return op
    op = yield from wait_operation(op, timeout)
    return (yield from get_template(op.template or name))


# --------------------------------------------------------------------------- commands


def _cmd_path(sandbox_id: Any, command_id: Any = None) -> str:
    p = f"/v1/sandboxes/{seg(sandbox_id, 'sandbox id')}/commands"
    if command_id is not None:
        p += f"/{seg(command_id, 'command id')}"
    return p


def start_command(sandbox_id: Any, body: dict) -> Flow:
    r = yield Req("POST", _cmd_path(sandbox_id), json=body)
    return r.json()


def get_command(sandbox_id: Any, command_id: Any) -> Flow:
    r = yield Req("GET", _cmd_path(sandbox_id, command_id))
    return r.json()


def list_commands(sandbox_id: Any) -> Flow:
    r = yield Req("GET", _cmd_path(sandbox_id))
    return r.json()["commands"]


def signal_command(sandbox_id: Any, command_id: Any, sig: Any) -> Flow:
    r = yield Req("POST", _cmd_path(sandbox_id, command_id) + "/signal", json={"signal": _signal(sig)})
    return r.json()


def write_stdin(sandbox_id: Any, command_id: Any, data: Any, eof: bool = False) -> Flow:
    data = stdin_bytes(data)
    path = _cmd_path(sandbox_id, command_id) + "/stdin"
    # The server takes at most 1 MiB a request: larger input goes in pieces.
    pieces = [data[i : i + STDIN_CHUNK] for i in range(0, len(data), STDIN_CHUNK)] or [b""]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        tries = 0
        while True:
            try:
                yield Req("POST", path, params={"eof": "true"} if (eof and last) else None, content=piece,
                          headers={"content-type": "application/octet-stream"})
                break
            except Unavailable as e:
                # 503: the command is not connected to its agent right now. A command
                # that has just ended answers so until its end is recorded: then say
                # what it is (409, as for any ended command); else retry a few times.
                tries += 1
                c = yield from get_command(sandbox_id, command_id)
                if c.get("result") is not None or c.get("state") == "lost":
                    raise Conflict("conflict", f"command {command_id} has already ended ({c.get('state')})", 409) from e
                if tries >= 10:
                    raise
                yield Sleep(min(0.05 * 2**tries, 1.0))
    return None


def wait_command(sandbox_id: Any, command_id: Any, timeout: Any = None) -> Flow:
    """Long-polls until the command has a result (or is lost): its JSON."""
    timeout = _timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    cmd = None
    while True:
        poll = POLL_SECONDS
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 and cmd is not None:
                raise CommandTimeout(f"command {command_id} still {cmd.get('state')} after {timeout} s", None, "wait_timeout")
            poll_ms = max(0, min(POLL_SECONDS * 1000, int(left * 1000)))
        r = yield Req(
            "GET",
            _cmd_path(sandbox_id, command_id),
            params={"wait": f"{poll_ms}ms" if deadline is not None else f"{poll}s"},
            timeout=poll + 30,
        )
        cmd = r.json()
        if cmd.get("result") is not None or cmd.get("state") == "lost":
            return cmd


def _needs_full_output(cmd: dict) -> bool:
    """Whether the inline copy of a ``wait: true`` answer is not the whole output:
    cut at the inline cap, or turned into text lossily, or of another length than
    the result says."""
    if cmd.get("inline_truncated"):
        return True
    res = cmd.get("result") or {}
    for name in ("stdout", "stderr"):
        text = cmd.get(name)
        if text is None:
            return True
        if "\ufffd" in text:
            return True  # invalid UTF-8 was replaced: get the real bytes
        if not res.get("output_truncated") and len(text.encode()) != res.get(f"{name}_bytes", -1):
            return True
    return False


def _check_whole(cmd: dict, out: bytes, err: bytes) -> None:
    res = cmd.get("result") or {}
    if res.get("output_truncated"):
        return
    for name, got in (("stdout", out), ("stderr", err)):
        want = res.get(f"{name}_bytes")
        if want is not None and len(got) != want:
            raise DecodeError(
                "incomplete_output",
                f"command {cmd.get('id')}: read {len(got)} bytes of {name}, the result says {want}",
            )


def run_command(
    sandbox_id: Any,
    cmd: Any,
    *,
    shell: bool = False,
    env: Any = None,
    cwd: Any = None,
    user: Any = None,
    secrets: Any = None,
    stdin: Any = None,
    timeout_seconds: Any = None,
    check: bool = False,
) -> Flow:
    has_stdin = stdin is not None
    data = stdin_bytes(stdin) if has_stdin else b""
    body = command_body(
        cmd, shell=shell, env=env, cwd=cwd, user=user, secrets=secrets,
        timeout_seconds=timeout_seconds, stdin=has_stdin, wait=not has_stdin,
    )
    if not has_stdin:
        # The server holds the request until the command ends: no read timeout.
        r = yield Req("POST", _cmd_path(sandbox_id), json=body, timeout=None)
        c = r.json()
        inline_cut = bool(c.get("inline_truncated"))
        if c.get("result") is not None and not _needs_full_output(c):
            out, err = (c.get("stdout") or "").encode(), (c.get("stderr") or "").encode()
        else:
            out, err, end = yield CollectOutput(c["sandbox_id"], c["id"])
            c = _merge_end(c, end)
    else:
        r = yield Req("POST", _cmd_path(sandbox_id), json=body)
        c = r.json()
        try:
            yield from write_stdin(c["sandbox_id"], c["id"], data, eof=True)
        except Conflict:
            pass  # it ended before reading its input: its result says how
        inline_cut = False
        out, err, end = yield CollectOutput(c["sandbox_id"], c["id"])
        c = _merge_end(c, end)
    if c.get("result") is not None:
        _check_whole(c, out, err)
    result = Result._build(c, out, err, inline_cut)
    if check:
        result.check()
    return result


def _merge_end(cmd: dict, end: dict | None) -> dict:
    cmd = dict(cmd)
    if end:
        for k in ("result", "state", "lost_reason"):
            if k in end:
                cmd[k] = end[k]
    return cmd


# --------------------------------------------------------------------------- output


class OutputState:
    """Resumable reading of ``…/commands/{cid}/output``: tracks the next offset so a
    reconnect asks for exactly the bytes not yet delivered (an overlap is trimmed,
    a partial line at a cut is dropped and asked for again), bounds the retries and
    keeps the end line."""

    def __init__(self, offset: Any, follow: Any, stream: Any, max_retries: int = 10):
        self.next_offset = _nonneg_int(offset, "offset", False) or 0
        if not isinstance(follow, bool):
            raise InvalidArgument(f"follow must be True or False, got {follow!r}")
        self.follow = follow
        self.stream = _stream_view(stream)
        self.max_retries = max_retries
        self.failures = 0
        self.reconnects = 0
        self.end: dict | None = None
        self.progressed = False
        self._buf = b""

    @property
    def params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"offset": self.next_offset, "stream": self.stream}
        if self.follow:
            p["follow"] = "true"
        return p

    def begin(self) -> None:
        self._buf = b""
        self.progressed = False

    def feed(self, data: bytes) -> list[OutputChunk]:
        """Bytes of the response: the whole chunks they complete."""
        self._buf += data
        out: list[OutputChunk] = []
        while True:
            i = self._buf.find(b"\n")
            if i < 0:
                return out
            line, self._buf = self._buf[:i], self._buf[i + 1 :]
            if line.strip() and (c := self._line(line)) is not None:
                out.append(c)

    def _line(self, line: bytes) -> OutputChunk | None:
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise DecodeError("decode_error", f"bad output line ({e}): {line[:200]!r}") from None
        if not isinstance(obj, dict):
            raise DecodeError("decode_error", f"bad output line: {line[:200]!r}")
        if "data" not in obj:
            if "state" in obj:
                self.end = obj
                return None
            raise DecodeError("decode_error", f"an output line neither a chunk nor the end: {line[:200]!r}")
        c = OutputChunk.from_line(obj)
        if c.end <= self.next_offset:
            return None  # already delivered
        if c.offset < self.next_offset:  # overlap: deliver only what is new
            c = OutputChunk(c.stream, self.next_offset, c.data[self.next_offset - c.offset :])
        self.next_offset = c.end
        self.progressed = True
        return c

    def finished(self) -> bool:
        """After a response ended cleanly: whether the stream is done (else it was
        cut off, and :meth:`broken` decides about a retry)."""
        return self.end is not None or not self.follow

    def broken(self, why: str) -> float:
        """The connection broke: seconds to wait before asking again, or raise."""
        if self.progressed:
            self.failures = 0
        self.failures += 1
        self.reconnects += 1
        if self.failures > self.max_retries:
            raise StreamInterrupted(
                f"output stream broke {self.failures} times in a row without progress ({why}); "
                f"resume with offset={self.next_offset}",
                self.next_offset,
            )
        return min(0.1 * 2 ** (self.failures - 1), 2.0) * (0.75 + random.random() / 2)

    def retryable(self, e: SpaceError) -> bool:
        return isinstance(e, (ServerError, TooManyRequests))


def split_streams(chunks: list[OutputChunk]) -> tuple[bytes, bytes]:
    out = b"".join(c.data for c in chunks if c.stream == "stdout")
    err = b"".join(c.data for c in chunks if c.stream == "stderr")
    return out, err


# --------------------------------------------------------------------------- files


def _files(sandbox_id: Any, sub: str = "") -> str:
    return f"/v1/sandboxes/{seg(sandbox_id, 'sandbox id')}/files{sub}"


def _iter_filelike(f: Any) -> Iterator[bytes]:
    while True:
        b = f.read(UPLOAD_CHUNK)
        if not b:
            return
        if isinstance(b, str):
            b = b.encode()
        yield b


def write_file(sandbox_id: Any, path: Any, data: Any, *, mode: Any = None, uid: Any = None, gid: Any = None,
               parents: bool = True) -> Flow:
    path = abs_path(path)
    params: dict[str, Any] = {"path": path}
    if (m := _mode(mode)) is not None:
        params["mode"] = m
    if (u := _nonneg_int(uid, "uid")) is not None:
        params["uid"] = u
    if (g := _nonneg_int(gid, "gid")) is not None:
        params["gid"] = g
    if not isinstance(parents, bool):
        raise InvalidArgument(f"parents must be True or False, got {parents!r}")
    if not parents:
        params["parents"] = "false"
    content: bytes | None = None
    rewind: Callable[[], None] | None = None
    if isinstance(data, str):
        content = data.encode()
    elif isinstance(data, (bytes, bytearray, memoryview)):
        content = bytes(data)
    elif hasattr(data, "read"):
        try:
            start = data.tell() if data.seekable() else None
        except (AttributeError, OSError):
            start = None
        if start is not None:
            rewind = lambda: data.seek(start)  # noqa: E731
        elif parents:
            # Not seekable, so it cannot be sent twice: make the parents first.
            yield from _ensure_parent(sandbox_id, path)
    else:
        raise InvalidArgument(f"data must be bytes, str or a binary file object, got {type(data).__name__}")

    def req() -> Req:
        return Req("PUT", _files(sandbox_id), params=params, timeout=None,
                   content=content, stream=None if content is not None else _iter_filelike(data),
                   headers={"content-type": "application/octet-stream"})

    try:
        r = yield req()
    except NotFound:
        # A server older than `parents` (default true) answers 404 for a missing
        # parent: make it and try once more.
        if not parents or (content is None and rewind is None):
            raise
        made = yield from _ensure_parent(sandbox_id, path)
        if not made:
            raise
        if rewind is not None:
            rewind()
        r = yield req()
    return _file_info_or_none(r)


def _ensure_parent(sandbox_id: Any, path: str) -> Flow:
    parent = path.rstrip("/").rsplit("/", 1)[0]
    if not parent:
        return False
    yield Req("POST", _files(sandbox_id, "/mkdir"), json={"path": parent})
    return True


def _file_info_or_none(r: Resp) -> FileInfo | None:
    d = r.json() if r.content else None
    if isinstance(d, dict) and "path" in d and "type" in d:
        return FileInfo.from_dict(d)
    return None


def read_file(sandbox_id: Any, path: Any) -> Flow:
    r = yield Req("GET", _files(sandbox_id), params={"path": abs_path(path)}, timeout=None)
    return r.content


def stat_file(sandbox_id: Any, path: Any) -> Flow:
    r = yield Req("GET", _files(sandbox_id, "/stat"), params={"path": abs_path(path)})
    return FileInfo.from_dict(r.json())


def exists(sandbox_id: Any, path: Any) -> Flow:
    try:
        yield from stat_file(sandbox_id, path)
    except NotFound:
        return False
    return True


def list_files(sandbox_id: Any, path: Any, depth: Any = None) -> Flow:
    params: dict[str, Any] = {"path": abs_path(path)}
    if depth is not None:
        d = _nonneg_int(depth, "depth", False)
        if not 1 <= d <= 64:
            raise InvalidArgument(f"depth must be 1-64, got {d}")
        params["depth"] = d
    r = yield Req("GET", _files(sandbox_id, "/list"), params=params)
    d = r.json()
    return FileList([FileInfo.from_dict(x) for x in d.get("entries", [])], d.get("path", params["path"]),
                    bool(d.get("truncated")))


def mkdir(sandbox_id: Any, path: Any, *, mode: Any = None, uid: Any = None, gid: Any = None) -> Flow:
    body: dict[str, Any] = {"path": abs_path(path)}
    if mode is not None:
        body["mode"] = int(_mode(mode), 8)  # type: ignore[arg-type]
    if (u := _nonneg_int(uid, "uid")) is not None:
        body["uid"] = u
    if (g := _nonneg_int(gid, "gid")) is not None:
        body["gid"] = g
    r = yield Req("POST", _files(sandbox_id, "/mkdir"), json=body)
    return _file_info_or_none(r)


def move(sandbox_id: Any, src: Any, dst: Any, overwrite: bool = False) -> Flow:
    body: dict[str, Any] = {"from": abs_path(src, "source path"), "to": abs_path(dst, "destination path")}
    if not isinstance(overwrite, bool):
        raise InvalidArgument(f"overwrite must be True or False, got {overwrite!r}")
    if overwrite:
        body["overwrite"] = True
    r = yield Req("POST", _files(sandbox_id, "/move"), json=body)
    return _file_info_or_none(r)


def remove(sandbox_id: Any, path: Any, recursive: bool = False) -> Flow:
    params: dict[str, Any] = {"path": abs_path(path)}
    if not isinstance(recursive, bool):
        raise InvalidArgument(f"recursive must be True or False, got {recursive!r}")
    if recursive:
        params["recursive"] = "true"
    r = yield Req("DELETE", _files(sandbox_id), params=params)
    d = r.json() if r.content else {}
    return int(d.get("removed", 0)) if isinstance(d, dict) else 0


def upload_dir(sandbox_id: Any, local: Any, remote: Any) -> Flow:
    from ._tar import tar_gz_stream

    remote = abs_path(remote, "remote directory")
    local = Path(os.fspath(local)) if isinstance(local, (str, os.PathLike)) else None
    if local is None:
        raise InvalidArgument("local must be a path to a directory")
    if not local.is_dir():
        raise InvalidArgument(f"{str(local)!r} is not a directory")
    r = yield Req(
        "PUT", _files(sandbox_id), params={"path": remote, "format": "tar", "gzip": "true"},
        stream=tar_gz_stream(local), timeout=None, headers={"content-type": "application/octet-stream"},
    )
    d = r.json() if r.content else {}
    return UnpackStats.from_dict(d) if isinstance(d, dict) and "entries" in d else None


def download_dir(sandbox_id: Any, remote: Any, local: Any) -> Flow:
    """Fetches a tar of ``remote`` and unpacks it into ``local`` (created) with
    :mod:`tarfile`'s ``data`` filter (no absolute names, no ``..``, no devices)."""
    import io
    import tarfile

    remote = abs_path(remote, "remote directory")
    r = yield Req("GET", _files(sandbox_id), params={"path": remote, "format": "tar"}, timeout=None)
    dest = Path(os.fspath(local))
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(r.content), mode="r:*") as tf:
        tf.extractall(dest, filter="data")
    return dest


# --------------------------------------------------------------------------- templates


def list_templates() -> Flow:
    r = yield Req("GET", "/v1/templates")
    return [Template.from_dict(x) for x in r.json()["templates"]]


def get_template(name: Any) -> Flow:
    name = _opt_str(name, "name")
    for t in (yield from list_templates()):
        if t.name == name:
            return t
    raise NotFound("not_found", f"no template {name!r}", None)


def recipe_json(recipe: Any, base_dir: Any = None) -> dict:
    """A recipe as the server takes it (JSON): a dict, TOML text, or a path to a
    ``.toml``/``.json`` file. ``src`` of a file entry (CLI-style) is read here,
    relative to ``base_dir`` (default: the recipe file's folder), and sent inline."""
    if isinstance(recipe, Path) or (isinstance(recipe, str) and "\n" not in recipe and recipe.endswith((".toml", ".json"))):
        p = Path(recipe)
        text = p.read_text()
        base_dir = base_dir if base_dir is not None else p.parent
        recipe = json.loads(text) if p.suffix == ".json" else text
    if isinstance(recipe, str):
        try:
            recipe = tomllib.loads(recipe)
        except tomllib.TOMLDecodeError as e:
            raise InvalidArgument(f"recipe is not valid TOML: {e}") from None
    if not isinstance(recipe, Mapping):
        raise InvalidArgument(f"recipe must be a dict, TOML text or a path, got {type(recipe).__name__}")
    recipe = dict(recipe)
    for k in ("name", "base"):
        if not isinstance(recipe.get(k), str) or not recipe.get(k):
            raise InvalidArgument(f"recipe needs a {k!r} (string)")
    files = []
    for f in recipe.get("files") or []:
        f = dict(f)
        if "src" in f:
            src = Path(os.fspath(f.pop("src")))
            if not src.is_absolute():
                src = Path(base_dir or ".") / src
            f["content_base64"] = base64.b64encode(src.read_bytes()).decode()
        files.append(f)
    if "files" in recipe:
        recipe["files"] = files
    return recipe


def build_template(recipe: Any, *, base_dir: Any = None, wait: bool = True, timeout: Any = None) -> Flow:
    body = recipe_json(recipe, base_dir)
    timeout = _timeout(timeout)
    r = yield Req("POST", "/v1/templates", json=body, timeout=None)
    op = _op(r.json())
    if not wait:
        return op
    op = yield from wait_operation(op, timeout)
    return (yield from get_template(op.template or body["name"]))


def delete_template(name: Any) -> Flow:
    yield Req("DELETE", f"/v1/templates/{seg(name, 'template name')}")
    return None


# --------------------------------------------------------------------------- misc


def runtimes() -> Flow:
    r = yield Req("GET", "/v1/runtimes")
    d = r.json()
    items = d.get("runtimes", d) if isinstance(d, dict) else d
    return [Runtime.from_dict(x) for x in items]


def openapi() -> Flow:
    r = yield Req("GET", "/v1/openapi.json")
    return r.json()


def health() -> Flow:
    r = yield Req("GET", "/healthz")
    return r.json() if r.content else {}
