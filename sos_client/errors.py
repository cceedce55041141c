"""Exceptions of the SOS clients: one class per kind of refusal, built from ERROR frames.

Every exception is an :class:`SOSError` with ``.code`` (the wire ErrorCode, or None
for errors that did not come from the server), ``.message`` and, where known,
``.name`` (the object) and ``.length``.  Classes that have a natural Python
counterpart also derive from it, so ``except FileNotFoundError`` works.
"""

from __future__ import annotations

from sos_wire.errors import ErrorCode

__all__ = [
    "SOSError", "OffsetMismatch", "Fenced", "SealedError", "ChecksumMismatch", "Corrupt", "NoSpace",
    "QuotaExceeded", "TooLarge", "ServerBusy", "ConnectionLost", "SOSNotFound", "SOSPermissionError",
    "BadNameError", "error_from_reply",
]


class SOSError(Exception):
    """Base class. ``code``: ErrorCode (or int/None); ``length``: see the subclasses."""

    def __init__(self, message: str = "", code=None, *, name: str | None = None, length: int = 0) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.name = name
        self.length = length

    def __str__(self) -> str:
        return self.message


class OffsetMismatch(SOSError):
    """The append offset is not the object's length. ``.length`` is the current length."""


class Fenced(SOSError):
    """The writer's epoch was fenced by a newer writer. ``.epoch`` is the namespace's fence."""

    @property
    def epoch(self) -> int:
        return self.length

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.length = value


class SealedError(SOSError):
    """The object is sealed: it refuses appends. ``.length`` is its final length."""


class ChecksumMismatch(SOSError):
    """The data did not match the CRC32C sent with it (damaged in transit); nothing written."""


class Corrupt(SOSError):
    """Stored data failed its checksum on the server, or the server lost acknowledged data."""


class NoSpace(SOSError):
    """The server's disk is full."""


class QuotaExceeded(SOSError):
    """A namespace or object limit of the server was reached."""


class TooLarge(SOSError):
    """A frame or value exceeded a limit."""


class ServerBusy(SOSError):
    """The server refused the request for lack of resources; retry later."""


class ConnectionLost(SOSError, ConnectionError):
    """The connection broke (closed, reset, timed out or garbled). Retrying on a new one may work."""


class SOSNotFound(SOSError, FileNotFoundError):
    """No such object."""


class SOSPermissionError(SOSError, PermissionError):
    """Authentication failed, or the key's role does not allow the operation."""


class BadNameError(SOSError, ValueError):
    """The object name or namespace breaks the naming rules."""


_CLASS_OF = {
    ErrorCode.OFFSET_MISMATCH: OffsetMismatch,
    ErrorCode.FENCED: Fenced,
    ErrorCode.SEALED: SealedError,
    ErrorCode.CHECKSUM_MISMATCH: ChecksumMismatch,
    ErrorCode.CORRUPT: Corrupt,
    ErrorCode.NO_SPACE: NoSpace,
    ErrorCode.QUOTA_EXCEEDED: QuotaExceeded,
    ErrorCode.TOO_LARGE: TooLarge,
    ErrorCode.BUSY: ServerBusy,
    ErrorCode.NOT_FOUND: SOSNotFound,
    ErrorCode.AUTH_FAILED: SOSPermissionError,
    ErrorCode.FORBIDDEN: SOSPermissionError,
    ErrorCode.NOT_AUTHENTICATED: SOSPermissionError,
    ErrorCode.BAD_NAME: BadNameError,
}


def error_from_reply(reply, what: str, *, name: str | None = None) -> SOSError:
    """The exception for an ERROR event answering the operation described by *what*
    (e.g. ``"append to ns/log at offset 5"``)."""
    code = reply.code
    cls = _CLASS_OF.get(code, SOSError)
    label = code.name if isinstance(code, ErrorCode) else f"error {code}"
    text = f"{what}: {label}: {reply.message}"
    if code == ErrorCode.OFFSET_MISMATCH:
        text += f" (current length of {name!r}: {reply.length})" if name else f" (current length: {reply.length})"
    elif code == ErrorCode.FENCED:
        text += f" (namespace fenced at epoch {reply.length})"
    elif code == ErrorCode.SEALED and name:
        text += f" (sealed at length {reply.length})"
    return cls(text, code, name=name, length=reply.length)
