"""Typed models of what the API returns.

Each model that mirrors a schema of the server's OpenAPI document names it in
``__schema__``; the test suite checks every field against the served
``/v1/openapi.json`` (fields the server adds later are ignored when decoding).
"""

from __future__ import annotations

import base64
import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import CommandError, CommandLost, CommandTimeout, DecodeError


class _Model:
    """Decoding shared by every model: known fields are taken, nested models
    decoded, unknown fields ignored (a newer server may add some)."""

    __schema__: ClassVar[str | None] = None
    # field name -> model class (a dict is decoded to it, a list item-wise)
    _nested: ClassVar[dict[str, type]] = {}

    @classmethod
    def from_dict(cls, data: Any):
        if not isinstance(data, dict):
            raise DecodeError("decode_error", f"expected a JSON object for {cls.__name__}, got {type(data).__name__}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in data:
                continue
            v = data[f.name]
            sub = cls._nested.get(f.name)
            if sub is not None and v is not None:
                v = [sub.from_dict(x) for x in v] if isinstance(v, list) else sub.from_dict(v)
            kwargs[f.name] = v
        try:
            return cls(**kwargs)
        except TypeError as e:  # a required field is missing
            raise DecodeError("decode_error", f"cannot decode {cls.__name__}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _plain(v: Any) -> Any:
    if isinstance(v, _Model):
        return v.to_dict()
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@dataclass
class ApiError(_Model):
    """An error: its stable ``code`` and a human-readable ``message``."""

    __schema__: ClassVar[str] = "ApiError"
    code: str
    message: str


@dataclass
class Resources(_Model):
    __schema__: ClassVar[str] = "Resources"
    vcpus: int | None = None
    memory_mib: int | None = None
    disk_mib: int | None = None
    pids: int | None = None


@dataclass
class Cost(_Model):
    """What a sandbox's state costs."""

    __schema__: ClassVar[str] = "Cost"
    memory_bytes: int | None = None
    disk_bytes: int | None = None
    snapshot_bytes: int | None = None


@dataclass
class EgressRule(_Model):
    __schema__: ClassVar[str] = "EgressRule"
    entry: str
    cidr: str
    host: str | None = None
    port: int | None = None


@dataclass
class NetworkSpec(_Model):
    __schema__: ClassVar[str] = "NetworkSpec"
    _nested: ClassVar[dict[str, type]] = {"resolved": EgressRule}
    mode: str
    allow: list[str] | None = None
    resolved: list[EgressRule] | None = None


@dataclass
class PtySize(_Model):
    __schema__: ClassVar[str] = "PtySize"
    rows: int
    cols: int


@dataclass
class Sandbox(_Model):
    """A sandbox as the API returns it. The objects the clients hand out are
    subclasses of this one with methods (``run``, ``files``, ``destroy``, …)."""

    __schema__: ClassVar[str] = "Sandbox"
    _nested: ClassVar[dict[str, type]] = {"resources": Resources, "network": NetworkSpec, "cost": Cost}
    id: str
    state: str
    template: str
    template_version: str
    runtime: str
    labels: dict[str, str]
    resources: Resources
    env: dict[str, str]
    network: NetworkSpec
    created_at: str
    updated_at: str
    accelerator: str | None = None
    cost: Cost = field(default_factory=Cost)
    destroyed_at: str | None = None
    expires_at: str | None = None
    failure_reason: str | None = None
    idle_expires_at: str | None = None
    idle_timeout_seconds: int | None = None
    last_active_at: str | None = None
    on_idle: str | None = None
    secret_names: list[str] = field(default_factory=list)
    tenant: str = "default"
    ttl_seconds: int | None = None
    version: int = 0


@dataclass
class Operation(_Model):
    """The progress of one asynchronous request (create, pause, resume, suspend,
    destroy, build)."""

    __schema__: ClassVar[str] = "Operation"
    _nested: ClassVar[dict[str, type]] = {"error": ApiError}
    id: str
    kind: str
    status: str
    created_at: str
    updated_at: str
    error: ApiError | None = None
    progress: str | None = None
    sandbox_id: str | None = None
    template: str | None = None
    tenant: str = "default"
    version: int = 0

    @property
    def done(self) -> bool:
        """Whether it has ended (``succeeded``, ``failed`` or ``cancelled``)."""
        return self.status in ("succeeded", "failed", "cancelled")

    @property
    def succeeded(self) -> bool:
        return self.status == "succeeded"


@dataclass
class ProcessResult(_Model):
    """How a command ended, as the server records it. ``stdout_bytes`` and
    ``stderr_bytes`` are byte counts; ``output_truncated`` says the server's
    retention (``--output-cap-mib``) dropped the head of the output."""

    __schema__: ClassVar[str] = "ProcessResult"
    timed_out: bool
    oom_killed: bool
    duration_ms: int
    stdout_bytes: int
    stderr_bytes: int
    output_truncated: bool
    exit_code: int | None = None
    signal: int | None = None


@dataclass
class Command(_Model):
    """A command session. The objects the clients hand out are subclasses with
    methods (``wait``, ``output``, ``signal``, ``write_stdin``, …)."""

    __schema__: ClassVar[str] = "Command"
    _nested: ClassVar[dict[str, type]] = {"result": ProcessResult, "pty": PtySize}
    id: str
    sandbox_id: str
    state: str
    argv: list[str]
    created_at: str
    output_url: str
    cwd: str | None = None
    ended_at: str | None = None
    inline_truncated: bool | None = None
    lost_reason: str | None = None
    pid: int | None = None
    pty: PtySize | None = None
    result: ProcessResult | None = None
    secret_names: list[str] = field(default_factory=list)
    stdin: bool = False
    stdout: str | None = None
    stderr: str | None = None
    timeout_seconds: int | None = None
    user: str | None = None
    version: int = 0

    @property
    def done(self) -> bool:
        """Whether it has finished: it has a ``result``, or it is ``lost``."""
        return self.result is not None or self.state == "lost"


@dataclass
class Template(_Model):
    __schema__: ClassVar[str] = "Template"
    name: str
    ready: bool
    builtin: bool
    base: str | None = None
    created_at: str | None = None
    size_bytes: int | None = None
    version: str | None = None
    versions: list[str] = field(default_factory=list)


@dataclass
class FileInfo(_Model):
    """A path inside a sandbox (``files.stat``, ``files.list``, uploads).
    ``type`` is ``file``, ``dir``, ``symlink`` or ``other``; ``mtime`` Unix seconds.
    (The OpenAPI document has no schema for it; the tests check it against live
    answers.)"""

    path: str
    name: str
    type: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime: int = 0
    link_target: str | None = None
    name_base64: str | None = None
    link_target_base64: str | None = None

    @property
    def is_dir(self) -> bool:
        return self.type == "dir"

    @property
    def is_file(self) -> bool:
        return self.type == "file"


class FileList(list):
    """``files.list``: a list of :class:`FileInfo`; ``truncated`` says the agent's
    entry limit stopped the listing."""

    def __init__(self, entries=(), path: str = "", truncated: bool = False):
        super().__init__(entries)
        self.path = path
        self.truncated = truncated


@dataclass
class UnpackStats(_Model):
    """What a tar upload wrote."""

    entries: int
    bytes: int


@dataclass
class Runtime(_Model):
    name: str
    available: bool
    default: bool
    accelerator: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class OutputChunk:
    """Bytes of one stream of a command. ``offset`` is their position in the
    view asked for (``combined``, ``stdout`` or ``stderr``)."""

    stream: str
    offset: int
    data: bytes

    @property
    def end(self) -> int:
        """The offset just past this chunk."""
        return self.offset + len(self.data)

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", "replace")

    @classmethod
    def from_line(cls, obj: dict) -> "OutputChunk":
        try:
            return cls(obj["stream"], int(obj["offset"]), base64.b64decode(obj["data"], validate=True))
        except (KeyError, ValueError, TypeError) as e:
            raise DecodeError("decode_error", f"bad output chunk: {e}") from None


@dataclass
class Result:
    """What ``sandbox.run`` returns: how the command ended and all its output.

    ``stdout``/``stderr`` are the output as text (UTF-8, invalid bytes replaced);
    ``stdout_bytes``/``stderr_bytes`` the exact bytes. They are always the whole
    output the server kept: when the inline copy of the answer was cut, ``run``
    reads the rest from the output endpoint. ``output_truncated`` says the server
    itself dropped the head of a stream past its ``--output-cap-mib``.
    """

    exit_code: int | None
    signal: int | None
    timed_out: bool
    oom_killed: bool
    duration_ms: int
    stdout: str
    stderr: str
    stdout_bytes: bytes
    stderr_bytes: bytes
    output_truncated: bool
    inline_truncated: bool
    state: str
    command_id: str
    sandbox_id: str
    process: ProcessResult | None = None

    @property
    def ok(self) -> bool:
        """Exited 0, not killed by a signal or the timeout."""
        return self.exit_code == 0 and self.signal is None and not self.timed_out

    def check(self) -> "Result":
        """Raise :class:`CommandTimeout` or :class:`CommandError` unless ``ok``; returns self."""
        if self.timed_out:
            raise CommandTimeout(f"command {self.command_id} timed out after {self.duration_ms} ms", self)
        if not self.ok:
            how = f"signal {self.signal}" if self.signal is not None else f"exit code {self.exit_code}"
            tail = self.stderr[-500:].strip()
            raise CommandError(f"command {self.command_id} ended with {how}" + (f": {tail}" if tail else ""), self)
        return self

    @classmethod
    def _build(cls, cmd: dict, stdout: bytes, stderr: bytes, inline_truncated: bool) -> "Result":
        if cmd.get("result") is None:
            raise CommandLost(
                "command_lost",
                f"command {cmd.get('id')} is {cmd.get('state')}: {cmd.get('lost_reason') or 'no result'}",
            )
        pr = ProcessResult.from_dict(cmd["result"])
        return cls(
            exit_code=pr.exit_code,
            signal=pr.signal,
            timed_out=pr.timed_out,
            oom_killed=pr.oom_killed,
            duration_ms=pr.duration_ms,
            stdout=stdout.decode("utf-8", "replace"),
            stderr=stderr.decode("utf-8", "replace"),
            stdout_bytes=stdout,
            stderr_bytes=stderr,
            output_truncated=pr.output_truncated,
            inline_truncated=inline_truncated,
            state=cmd.get("state", ""),
            command_id=cmd.get("id", ""),
            sandbox_id=cmd.get("sandbox_id", ""),
            process=pr,
        )


#: Every model that mirrors a schema of the OpenAPI document.
SCHEMA_MODELS: tuple[type[_Model], ...] = (
    ApiError,
    Resources,
    Cost,
    EgressRule,
    NetworkSpec,
    PtySize,
    Sandbox,
    Operation,
    ProcessResult,
    Command,
    Template,
)
