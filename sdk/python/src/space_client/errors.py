"""Exceptions. Every error the server answers carries its stable ``ErrorCode``
(``e.code``, e.g. ``"not_found"``), its message and the HTTP status."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .models import Operation


class SpaceError(Exception):
    """Base of every exception this package raises.

    ``code`` is the server's error code (``not_found``, ``conflict``, …) or, for an
    error found on this side, one of ``invalid_argument``, ``connection_error``,
    ``stream_interrupted``, ``decode_error``, ``command_failed``, ``command_timeout``,
    ``command_lost``, ``wait_timeout``. ``status`` is the HTTP status (``None`` when
    no response is behind the error).
    """

    default_code = "error"

    def __init__(self, code: str | None = None, message: str = "", status: int | None = None):
        self.code = code or self.default_code
        self.message = message
        self.status = status
        super().__init__(code, message, status)

    def __str__(self) -> str:
        where = f" (HTTP {self.status})" if self.status is not None else ""
        return f"{self.code}: {self.message}{where}"


class BadRequest(SpaceError):
    """400: the request or one of its values is wrong (``invalid_request``,
    ``invalid_json``, ``invalid_query``, ``invalid_path``, ``invalid_signal``,
    ``not_a_file``, ``unsafe_archive``, …)."""

    default_code = "invalid_request"


InvalidRequest = BadRequest


class InvalidArgument(BadRequest, ValueError, TypeError):
    """Bad input found before anything was sent (a wrong type, a negative timeout,
    ``shell=True`` with a list, …). Also a ``ValueError`` and a ``TypeError``."""

    default_code = "invalid_argument"

    def __init__(self, message: str):
        super().__init__("invalid_argument", message, None)


class Unauthorized(SpaceError):
    """401: missing, wrong or revoked token."""

    default_code = "unauthorized"


class Forbidden(SpaceError):
    """403 (``forbidden``, ``forbidden_path``)."""

    default_code = "forbidden"


class NotFound(SpaceError):
    """404: unknown id (or another tenant's)."""

    default_code = "not_found"


class Conflict(SpaceError):
    """409: the object's state forbids it now (``conflict``, ``invalid_transition``)."""

    default_code = "conflict"


class PayloadTooLarge(SpaceError):
    """413 (``body_too_large``, ``too_large``)."""

    default_code = "too_large"


class TooManyRequests(SpaceError):
    """429: over a limit. ``retry_after`` is the server's ``Retry-After`` in seconds
    (``None`` when it sent none)."""

    default_code = "too_many_requests"

    def __init__(self, code=None, message="", status=429, retry_after: float | None = None):
        super().__init__(code, message, status)
        self.retry_after = retry_after


class ServerError(SpaceError):
    """5xx (``internal``, ``agent_error``, ``no_space``, ``agent_timeout``)."""

    default_code = "internal"


class Unavailable(ServerError):
    """503: the sandbox's agent is not reachable now; retry."""

    default_code = "unavailable"


class ConnectionFailed(SpaceError):
    """The server could not be reached, or the connection broke."""

    default_code = "connection_error"


class DecodeError(SpaceError):
    """The server answered something this client cannot read."""

    default_code = "decode_error"


class StreamInterrupted(ConnectionFailed):
    """A command's output stream broke and could not be resumed within the allowed
    retries. ``offset`` is the next byte to ask for (``cmd.output(offset=e.offset)``)."""

    default_code = "stream_interrupted"

    def __init__(self, message: str, offset: int):
        super().__init__("stream_interrupted", message, None)
        self.offset = offset


class OperationFailed(SpaceError):
    """A lifecycle operation ended ``failed`` or ``cancelled``. ``code`` is the
    operation's error code (``start_failed``, ``build_failed``, ``timed_out``,
    ``cancelled``, …); ``operation`` the operation as it ended."""

    default_code = "operation_failed"

    def __init__(self, operation: "Operation"):
        err = operation.error
        code = err.code if err else ("cancelled" if operation.status == "cancelled" else "operation_failed")
        msg = err.message if err else f"operation {operation.id} ended {operation.status}"
        super().__init__(code, f"{operation.kind} operation {operation.id} {operation.status}: {msg}", None)
        self.operation = operation


class CommandError(SpaceError):
    """``run(..., check=True)`` or ``Result.check()``: the command did not exit 0.
    ``result`` is the whole :class:`Result`."""

    default_code = "command_failed"

    def __init__(self, message: str, result: Any = None, code: str | None = None):
        super().__init__(code or self.default_code, message, None)
        self.result = result


class CommandTimeout(CommandError, TimeoutError):
    """The command was killed by its ``timeout_seconds`` (``run(check=True)``), or
    ``cmd.wait(timeout=…)`` ran out before the command ended (then ``result`` is
    ``None`` and the command goes on)."""

    default_code = "command_timeout"


class CommandLost(SpaceError):
    """The command is ``lost``: the sandbox went away under it. Never a success."""

    default_code = "command_lost"


class WaitTimeout(SpaceError, TimeoutError):
    """An operation did not end within the ``timeout`` given to a waiting call
    (the operation itself goes on: ``operation`` says where it was)."""

    default_code = "wait_timeout"

    def __init__(self, message: str, operation: "Operation | None" = None):
        super().__init__("wait_timeout", message, None)
        self.operation = operation


_BY_STATUS: dict[int, type[SpaceError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: PayloadTooLarge,
    429: TooManyRequests,
    503: Unavailable,
}


def error_from_response(status: int, body: bytes, headers: Any = None) -> SpaceError:
    """The exception for an error response (``{"error": {"code", "message"}}``)."""
    code: str | None = None
    message = ""
    try:
        parsed = json.loads(body) if body else None
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            code = parsed["error"].get("code")
            message = parsed["error"].get("message") or ""
    except ValueError:
        pass
    if code is None:
        message = body[:500].decode("utf-8", "replace") if body else f"HTTP {status}"
    cls = _BY_STATUS.get(status)
    if cls is None:
        cls = ServerError if status >= 500 else SpaceError
    if cls is TooManyRequests:
        retry_after = None
        raw = headers.get("retry-after") if headers is not None else None
        if raw:
            try:
                retry_after = float(raw)
            except ValueError:
                retry_after = None
        return TooManyRequests(code or "too_many_requests", message, status, retry_after)
    return cls(code or f"http_{status}", message, status)
