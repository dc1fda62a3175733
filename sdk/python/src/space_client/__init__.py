"""Python client of space, the self-hosted sandbox platform.

>>> from space_client import Client
>>> with Client() as c, c.sandboxes.create(template="busybox") as sb:
...     print(sb.run(["echo", "hi"]).stdout)
"""

from ._async import (
    AsyncClient,
    AsyncCommand,
    AsyncFiles,
    AsyncOutputStream,
    AsyncSandbox,
)
from ._core import DEFAULT_TOKEN, DEFAULT_URL
from ._sync import Client, Command, Files, OutputStream, Sandbox
from .errors import (
    BadRequest,
    CommandError,
    CommandLost,
    CommandTimeout,
    Conflict,
    ConnectionFailed,
    DecodeError,
    Forbidden,
    InvalidArgument,
    InvalidRequest,
    NotFound,
    OperationFailed,
    PayloadTooLarge,
    ServerError,
    SpaceError,
    StreamInterrupted,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    WaitTimeout,
)
from .models import (
    FileInfo,
    FileList,
    Operation,
    OutputChunk,
    ProcessResult,
    Result,
    Template,
    UnpackStats,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncClient", "AsyncCommand", "AsyncFiles", "AsyncOutputStream", "AsyncSandbox",
    "Client", "Command", "Files", "OutputStream", "Sandbox",
    "DEFAULT_URL", "DEFAULT_TOKEN",
    "SpaceError", "BadRequest", "InvalidRequest", "InvalidArgument", "Unauthorized", "Forbidden",
    "NotFound", "Conflict", "PayloadTooLarge", "TooManyRequests", "ServerError", "Unavailable",
    "ConnectionFailed", "DecodeError", "StreamInterrupted", "OperationFailed", "CommandError",
    "CommandTimeout", "CommandLost", "WaitTimeout",
    "FileInfo", "FileList", "Operation", "OutputChunk", "ProcessResult", "Result", "Template",
    "UnpackStats",
]
