"""Error codes and the two exception kinds of the wire codec (h11 style).

``LocalProtocolError``: *we* misused the codec (bad event, wrong role, frame too
large for the peer).  ``RemoteProtocolError``: the *peer* sent something the
protocol does not allow.  Any garbage on the wire surfaces as
``RemoteProtocolError`` and never as ``struct.error``, a construct error or
``UnicodeDecodeError``.
"""

from __future__ import annotations

from enum import IntEnum

__all__ = ["ErrorCode", "LocalProtocolError", "ProtocolError", "RemoteProtocolError"]


class ErrorCode(IntEnum):
    """u16 codes carried by ERROR frames (protocol.md, "Error codes")."""

    BAD_FRAME = 1  # fatal: the sender closes the connection after the ERROR frame
    UNSUPPORTED_VERSION = 2
    UNKNOWN_OP = 3
    NOT_AUTHENTICATED = 4
    AUTH_FAILED = 5
    FORBIDDEN = 6
    BAD_NAME = 7
    NOT_FOUND = 8
    OFFSET_MISMATCH = 9
    CHECKSUM_MISMATCH = 10
    SEALED = 11
    FENCED = 12
    TOO_LARGE = 13
    QUOTA_EXCEEDED = 14
    NO_SPACE = 15
    BUSY = 16
    CORRUPT = 17
    INTERNAL = 18
    BAD_REQUEST = 19
    TIER_UNAVAILABLE = 20  # TIER_WAIT: no tier, or the bucket did not reach the offset in time; length = tiered


def error_code(value: int) -> ErrorCode | int:
    """The ErrorCode for *value*, or the bare int for a code this version does not know."""
    try:
        return ErrorCode(value)
    except ValueError:
        return value


class ProtocolError(Exception):
    """Base class of codec errors.

    ``code`` is the ErrorCode a server should put in the ERROR frame it answers with,
    ``request_id`` the id of the offending frame when known (0 otherwise) and
    ``fatal`` tells whether the connection is unusable afterwards.
    """

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode = ErrorCode.BAD_FRAME,
        request_id: int = 0,
        fatal: bool = True,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.request_id = request_id
        self.fatal = fatal


class LocalProtocolError(ProtocolError):
    """This side tried to do something the protocol forbids (a bug in the caller)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that violate the protocol.

    If ``fatal`` is true the byte stream can no longer be trusted: send
    ``Error(e.request_id, e.code, 0, e.message)`` if you are the server, then close.
    If ``fatal`` is false (an unknown opcode in an otherwise well-formed frame) the
    frame has been skipped and the connection remains usable.
    """
