"""Exceptions of the SOS clients: one class per kind of refusal, built from ERROR frames.

Every exception is an :class:`SOSError` with ``.code`` (the wire ErrorCode, or None
for errors that did not come from the server), ``.message`` and, where known,
``.name`` (the object) and ``.length``.  Classes that have a natural Python
counterpart also derive from it, so ``except FileNotFoundError`` works.

Classification, the one place every layer asks (the journal writer, fsspec, the FUSE
mount and the WebHDFS gateway):

* :attr:`SOSError.retryable` and :func:`is_retryable` -- can the same call succeed if
  made again later (on a new connection)?
* :func:`to_oserror` -- the ``OSError`` (errno and message) an exception stands for, as
  a filesystem reports it;
* :func:`is_fenced` -- does the exception (or one it was raised from) say that a newer
  writer took the namespace over?

Exception classes outside this module take part by class attributes: ``retryable``
(bool), ``os_errno`` (int) and ``fenced`` (bool); the journal errors
(``sos_journal.errors``) declare them.
"""

from __future__ import annotations

import errno
import socket
import ssl
from typing import TYPE_CHECKING, Any

from sos_wire.errors import ErrorCode

if TYPE_CHECKING:
    from sos_wire.events import Error

__all__ = [
    "RETRYABLE_CODES",
    "BadKey",
    "BadNameError",
    "ChecksumMismatch",
    "ConnectionLost",
    "Corrupt",
    "Fenced",
    "NoSpace",
    "OffsetMismatch",
    "QuotaExceeded",
    "SOSError",
    "SOSNotFound",
    "SOSPermissionError",
    "SealedError",
    "ServerBusy",
    "TierUnavailable",
    "TooLarge",
    "error_from_reply",
    "is_fenced",
    "is_retryable",
    "to_oserror",
    "token_key_message",
]

#: Server refusals after which the same request can succeed later: the server is short of
#: a resource (BUSY, NO_SPACE, QUOTA_EXCEEDED: an operator or retention frees it), the
#: data was damaged in transit (CHECKSUM_MISMATCH: nothing was written), the server
#: failed unexpectedly (INTERNAL), or its object-store tier is behind or unreachable
#: (TIER_UNAVAILABLE: the bucket catches up once the store answers; a FENCE whose marker did
#: not reach the store is repeated with a higher epoch). Every other code (and a code this
#: version does not know) is an answer about the request or the key, which repeating does
#: not change.
RETRYABLE_CODES = frozenset(
    {
        ErrorCode.BUSY,
        ErrorCode.NO_SPACE,
        ErrorCode.QUOTA_EXCEEDED,
        ErrorCode.CHECKSUM_MISMATCH,
        ErrorCode.INTERNAL,
        ErrorCode.TIER_UNAVAILABLE,
    }
)

#: The errno a filesystem reports for each server refusal (codes not listed: EIO).
_ERRNO_OF_CODE: dict[int, int] = {
    ErrorCode.BAD_FRAME: errno.EPROTO,
    ErrorCode.UNSUPPORTED_VERSION: errno.EPROTO,
    ErrorCode.UNKNOWN_OP: errno.EOPNOTSUPP,
    ErrorCode.NOT_AUTHENTICATED: errno.EACCES,
    ErrorCode.AUTH_FAILED: errno.EACCES,
    ErrorCode.FORBIDDEN: errno.EACCES,
    ErrorCode.BAD_NAME: errno.EINVAL,
    ErrorCode.NOT_FOUND: errno.ENOENT,
    ErrorCode.OFFSET_MISMATCH: errno.EIO,
    ErrorCode.CHECKSUM_MISMATCH: errno.EIO,
    ErrorCode.SEALED: errno.EROFS,
    ErrorCode.FENCED: errno.EROFS,
    ErrorCode.TOO_LARGE: errno.EFBIG,
    ErrorCode.QUOTA_EXCEEDED: errno.EDQUOT,
    ErrorCode.NO_SPACE: errno.ENOSPC,
    ErrorCode.BUSY: errno.EBUSY,
    ErrorCode.CORRUPT: errno.EIO,
    ErrorCode.INTERNAL: errno.EIO,
    ErrorCode.BAD_REQUEST: errno.EINVAL,
    ErrorCode.TIER_UNAVAILABLE: errno.ETIMEDOUT,
}

#: OSError errnos of a network or a peer that may recover (other OSErrors, e.g.
#: EACCES or ENOENT, are answers that repeating does not change).
TRANSIENT_ERRNOS = frozenset(
    {
        errno.EAGAIN,
        errno.EINTR,
        errno.ETIMEDOUT,
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ENOTCONN,
        errno.ESHUTDOWN,
        errno.EHOSTUNREACH,
        errno.EHOSTDOWN,
        errno.ENETUNREACH,
        errno.ENETDOWN,
        errno.ENETRESET,
        errno.EADDRNOTAVAIL,
        errno.ENOBUFS,
        errno.EBUSY,
    }
)


class SOSError(Exception):
    """Base class. ``code``: ErrorCode (or int/None); ``length``: see the subclasses.

    ``retryable``: whether the same call can succeed later (see :data:`RETRYABLE_CODES`);
    without a code (an error the client found itself) the class decides. Pass
    ``retryable=`` to override it for one error."""

    #: for errors without a code: the class's answers
    _retryable_default = False
    _errno_default = errno.EIO

    def __init__(
        self,
        message: str = "",
        code: ErrorCode | int | None = None,
        *,
        name: str | None = None,
        length: int = 0,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.name = name
        self.length = length
        self._retryable = retryable

    def __str__(self) -> str:
        return self.message

    @property
    def retryable(self) -> bool:
        if self._retryable is not None:
            return self._retryable
        if self.code is None:
            return self._retryable_default
        return self.code in RETRYABLE_CODES

    @property
    def os_errno(self) -> int:
        """The errno a filesystem reports for this error."""
        if self.code is None:
            return type(self)._errno_default
        return _ERRNO_OF_CODE.get(self.code, errno.EIO)


class OffsetMismatch(SOSError):
    """The append offset is not the object's length. ``.length`` is the current length."""


class Fenced(SOSError):
    """The writer's epoch was fenced by a newer writer. ``.epoch`` is the namespace's fence."""

    fenced = True
    _errno_default = errno.EROFS

    @property
    def epoch(self) -> int:
        return self.length

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.length = value


class SealedError(SOSError):
    """The object is sealed: it refuses appends. ``.length`` is its final length."""

    _errno_default = errno.EROFS


class ChecksumMismatch(SOSError):
    """The data did not match the CRC32C sent with it (damaged in transit); nothing written."""

    _retryable_default = True


class Corrupt(SOSError):
    """Stored data failed its checksum on the server, or the server lost acknowledged data."""


class NoSpace(SOSError):
    """The server's disk is full."""

    _retryable_default = True
    _errno_default = errno.ENOSPC


class QuotaExceeded(SOSError):
    """A namespace or object limit of the server was reached."""

    _retryable_default = True
    _errno_default = errno.EDQUOT


class TooLarge(SOSError):
    """A frame or value exceeded a limit."""

    _errno_default = errno.EFBIG


class ServerBusy(SOSError):
    """The server refused the request for lack of resources; retry later."""

    _retryable_default = True
    _errno_default = errno.EBUSY


class TierUnavailable(SOSError):
    """TIER_UNAVAILABLE (protocol.md 1.11 TIER_WAIT, FENCE): the server's object-store tier does
    not hold the bytes asked for within the timeout (the store is down or slow: retryable, the
    bucket catches up once it answers), the server has no tier (message "no tier
    configured", ``length`` 0), or it stopped copying the object or namespace (another server
    took it over, a conflict). ``length``: the object's length in the tier (``tiered``).
    A filesystem reports it as ETIMEDOUT."""

    _retryable_default = True
    _errno_default = errno.ETIMEDOUT

    @property
    def tiered(self) -> int:
        return self.length


class ConnectionLost(SOSError, ConnectionError):
    """The connection broke (closed, reset, timed out or garbled). Retrying on a new one may work.

    Retryable whatever its code (a new connection gets its own answer), unless the TLS
    certificate of the server failed verification (that does not change by retrying)."""

    @property
    def retryable(self) -> bool:
        if self._retryable is not None:
            return self._retryable
        return not _caused_by(self, ssl.SSLCertVerificationError)

    @property
    def os_errno(self) -> int:
        cause = self.__cause__
        if isinstance(cause, OSError) and isinstance(cause.errno, int) and cause.errno in TRANSIENT_ERRNOS:
            return cause.errno  # e.g. ECONNREFUSED
        return errno.ECONNRESET


class SOSNotFound(SOSError, FileNotFoundError):
    """No such object."""

    _errno_default = errno.ENOENT


class SOSPermissionError(SOSError, PermissionError):
    """Authentication failed, or the key's role does not allow the operation (also a
    missing or malformed key: the client refuses it before connecting)."""

    _errno_default = errno.EACCES


class BadKey(SOSPermissionError, ValueError):
    """No key given, or not of the form ``<key_id>.<secret>``: refused before connecting.
    A PermissionError for the clients and commands, a ValueError for fsspec (a bad option)."""


class BadNameError(SOSError, ValueError):
    """The object name or namespace breaks the naming rules."""

    _errno_default = errno.EINVAL


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
    ErrorCode.TIER_UNAVAILABLE: TierUnavailable,
}


def token_key_message(namespace: str) -> str:
    """What a command says when given a token-role key (AUTH_OK role 3, protocol.md 1.6)."""
    return (
        f"the key of namespace {namespace!r} has the token role: it is a gateway-only key (`sos gateway`'s"
        " /oauth2/token exchanges it for an append bearer token) and sos-server serves it nothing; use an"
        " append or read key (`sos-server keygen --role append|read`)"
    )


def error_from_reply(reply: Error, what: str, *, name: str | None = None) -> SOSError:
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


# --------------------------------------------------------------------------------- classification
def _caused_by(exc: BaseException, cls: type[BaseException]) -> bool:
    """True if an exception ``exc`` was raised from (directly or not) is a ``cls``."""
    seen: set[int] = set()
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, cls):
            return True
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return False


def _flag(exc: BaseException, attr: str) -> bool | None:
    """A bool class attribute ``attr`` declared by the exception's class (None without one)."""
    value = getattr(type(exc), attr, None)
    return value if isinstance(value, bool) else None


def is_retryable(exc: BaseException) -> bool:
    """Can the call that raised ``exc`` succeed if made again later (on a new connection)?

    ========================================  =========================================
    SOSError                                  its ``retryable`` (by code, see RETRYABLE_CODES;
                                              ConnectionLost: yes)
    a class declaring ``retryable``           that (the journal errors: no)
    TLS certificate verification failure      no
    other ssl.SSLError                        only a connection cut (EOF, zero return, syscall)
    ConnectionError, TimeoutError             yes
    socket.gaierror                           only EAI_AGAIN (name server unavailable)
    other OSError                             only for an errno in TRANSIENT_ERRNOS
    anything else                             no (a bug, a bad argument: repeating it fails again)
    ========================================  =========================================
    """
    if isinstance(exc, SOSError):
        return exc.retryable
    declared = _flag(exc, "retryable")
    if declared is not None:
        return declared
    if isinstance(exc, ssl.SSLCertVerificationError):
        return False
    if isinstance(exc, ssl.SSLError):
        return isinstance(exc, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError))
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, socket.gaierror):
        return exc.errno == socket.EAI_AGAIN
    if isinstance(exc, OSError):
        return exc.errno in TRANSIENT_ERRNOS
    return False


def is_fenced(exc: BaseException | None) -> bool:
    """True if ``exc``, or an exception it was raised from, says that a newer writer took
    the namespace over (FENCED from the server, the journal's WriterFenced or SpoolStale)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if _flag(exc, "fenced"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


#: errno of built-in exceptions that carry none (checked in order: subclasses first)
_ERRNO_OF_CLASS: tuple[tuple[type[BaseException], int], ...] = (
    (FileExistsError, errno.EEXIST),
    (FileNotFoundError, errno.ENOENT),
    (IsADirectoryError, errno.EISDIR),
    (NotADirectoryError, errno.ENOTDIR),
    (PermissionError, errno.EACCES),
    (ConnectionRefusedError, errno.ECONNREFUSED),
    (ConnectionAbortedError, errno.ECONNABORTED),
    (BrokenPipeError, errno.EPIPE),
    (ConnectionError, errno.ECONNRESET),
    (TimeoutError, errno.ETIMEDOUT),
    (InterruptedError, errno.EINTR),
    (UnicodeError, errno.EINVAL),
    (ValueError, errno.EINVAL),
    (NotImplementedError, errno.EOPNOTSUPP),
)


def errno_of(exc: BaseException) -> int:
    """The errno of :func:`to_oserror`."""
    if isinstance(exc, SOSError):
        return exc.os_errno
    declared = getattr(type(exc), "os_errno", None)
    if isinstance(declared, int):
        return declared
    if isinstance(exc, OSError) and isinstance(exc.errno, int) and exc.errno > 0:
        return exc.errno
    for cls, code in _ERRNO_OF_CLASS:
        if isinstance(exc, cls):
            return code
    return errno.EIO


def to_oserror(exc: BaseException, context: str = "", filename: str | None = None) -> OSError:
    """The OSError (errno and message) that ``exc`` stands for, as a filesystem reports it.

    The errno is :func:`errno_of`'s; the message ``"<context>: <exc>"`` (just ``exc``'s
    without a context); the filename ``filename``, else ``exc``'s (an SOSError's object
    name). An OSError that carries an errno and is not an SOS error comes back as it is
    when neither ``context`` nor ``filename`` is given. Otherwise the result is new:
    ``OSError(errno, message[, filename])``, which Python makes the matching built-in
    subclass (ENOENT: FileNotFoundError, EACCES: PermissionError, ...). A fenced writer
    (:func:`is_fenced`) gets errno EROFS as a PermissionError: the process may no longer
    change the namespace. The caller chains ``exc`` (``raise to_oserror(exc) from exc``).
    """
    if (
        not context
        and filename is None
        and isinstance(exc, OSError)
        and not isinstance(exc, SOSError)
        and getattr(type(exc), "os_errno", None) is None
        and isinstance(exc.errno, int)
        and exc.errno > 0
    ):
        return exc
    code = errno_of(exc)
    text = (
        exc.strerror if isinstance(exc, OSError) and exc.strerror and not isinstance(exc, SOSError) else str(exc)
    ) or type(exc).__name__
    message = f"{context}: {text}" if context else text
    if filename is None:
        filename = getattr(exc, "filename", None)
        if filename is None and isinstance(exc, SOSError):
            filename = exc.name
    args: tuple[Any, ...] = (code, message) if filename is None else (code, message, filename)
    if code == errno.EROFS and is_fenced(exc):
        return PermissionError(*args)
    return OSError(*args)
