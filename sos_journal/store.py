"""The small slice of the blocking ``sos_client.Client`` the journal uses, and its errors.

The writer, restore and verify only call: ``stat``, ``list``, ``append``, ``append_many``,
``read_iter``, ``seal``, ``fence``, ``close``. They receive a ``client_factory``: a
callable returning a connected client (for one namespace). Tests of this layer pass an
in-memory store (``memstore.MemStore``); everything else passes a factory of real clients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Protocol

from sos_client.errors import (
    ConnectionLost,
    Corrupt,
    Fenced,
    OffsetMismatch,
    SealedError,
    SOSError,
    SOSNotFound,
    is_retryable,
)
from sos_wire.events import Payload

__all__ = [
    "ConnectionLost",
    "Corrupt",
    "Fenced",
    "ListedObject",
    "OffsetMismatch",
    "SOSError",
    "SOSNotFound",
    "SealedError",
    "StoreClient",
    "close_quietly",
    "fenced_epoch",
    "is_retryable",
    "mismatch_length",
    "without_reconnects",
]


class ListedObject(Protocol):
    """One object of a listing (``sos_wire.ListEntry`` and the test stores' entries)."""

    @property
    def name(self) -> str: ...
    @property
    def length(self) -> int: ...
    @property
    def sealed(self) -> bool: ...


class StoreClient(Protocol):
    def stat(self, name: str) -> tuple[int, bool]: ...
    def list(self, prefix: str = "") -> Iterator[ListedObject]: ...
    def append(self, name: str, offset: int, data: bytes, *, epoch: int = 0) -> int: ...
    def append_many(self, name: str, offset: int, chunks: Iterable[bytes], *, epoch: int = 0) -> int: ...
    def read_iter(self, name: str, offset: int = 0, length: int = 0) -> Iterator[Payload]: ...
    def seal(self, name: str, *, epoch: int = 0) -> int: ...
    def fence(self, epoch: int) -> int: ...
    def close(self) -> None: ...


def without_reconnects(client: StoreClient) -> StoreClient:
    """*client*, told not to reconnect on its own for long after a lost connection (a
    ``sos_client.Client`` waits up to its ``reconnect_timeout`` before it raises): for a caller
    that retries itself with its own backoff and bookkeeping (the replicator: STAT after a
    reconnect, its state "retrying" and its error count seen at once, not a timeout later)."""
    if hasattr(client, "reconnect_timeout"):
        setattr(client, "reconnect_timeout", 0.0)  # noqa: B010 - not part of the Protocol
    return client


def close_quietly(client: StoreClient | None) -> None:
    """Close a client that may be broken (after an error, at the end of a read): what its
    close raises changes nothing and must not hide the error being handled."""
    if client is None:
        return
    with contextlib.suppress(Exception):  # BLE: a last resort, the connection is dropped anyway
        client.close()


def mismatch_length(exc: BaseException) -> int:
    return int(getattr(exc, "length", 0) or 0)


def fenced_epoch(exc: BaseException) -> int:
    for attr in ("epoch", "length"):
        v = getattr(exc, attr, None)
        if isinstance(v, int):
            return v
    return 0
