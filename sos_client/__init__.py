"""sos_client: blocking and trio clients of the SOS protocol, and the `sos` command.

``Client`` (blocking) and ``aio.open_client`` (trio); exceptions in ``sos_client.errors``.
"""

from sos_wire import Key, ListEntry

from ._common import resolve_key, resolve_server
from .blocking import Client
from .errors import (
    BadKey,
    BadNameError,
    ChecksumMismatch,
    ConnectionLost,
    Corrupt,
    Fenced,
    NoSpace,
    OffsetMismatch,
    QuotaExceeded,
    SealedError,
    ServerBusy,
    SOSError,
    SOSNotFound,
    SOSPermissionError,
    TierUnavailable,
    TooLarge,
    is_fenced,
    is_retryable,
    to_oserror,
)

__all__ = [
    "BadKey",
    "BadNameError",
    "ChecksumMismatch",
    "Client",
    "ConnectionLost",
    "Corrupt",
    "Fenced",
    "Key",
    "ListEntry",
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
    "is_fenced",
    "is_retryable",
    "resolve_key",
    "resolve_server",
    "to_oserror",
]
