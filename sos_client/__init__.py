"""sos_client: blocking and trio clients of the SOS protocol, and the `sos` command.

``Client`` (blocking) and ``aio.open_client`` (trio); exceptions in ``sos_client.errors``.
"""

from sos_wire import Key, ListEntry

from ._common import resolve_key, resolve_server
from .blocking import Client
from .errors import (
    BadKey, BadNameError, ChecksumMismatch, ConnectionLost, Corrupt, Fenced, NoSpace, OffsetMismatch, QuotaExceeded,
    SealedError, ServerBusy, SOSError, SOSNotFound, SOSPermissionError, TierUnavailable, TooLarge, is_fenced,
    is_retryable, to_oserror,
)

__all__ = [
    "Client", "Key", "ListEntry",
    "SOSError", "OffsetMismatch", "Fenced", "SealedError", "ChecksumMismatch", "Corrupt", "NoSpace",
    "QuotaExceeded", "TooLarge", "ServerBusy", "TierUnavailable", "ConnectionLost", "SOSNotFound",
    "SOSPermissionError",
    "BadKey", "BadNameError", "is_retryable", "to_oserror", "is_fenced", "resolve_key", "resolve_server",
]
