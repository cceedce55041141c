"""An in-memory object store with the append-only rules of sos-server, for unit tests.

It implements the slice of the blocking client the journal uses (``_store.StoreClient``)
so the writer, tree, restore and verify can be unit-tested without a server process.
Proof tests run against a real ``sos-server``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from sos_client.errors import TooLarge
from sos_journal.store import ConnectionLost, Fenced, OffsetMismatch, SealedError, SOSNotFound
from sos_wire.crc import crc32c as _crc32c
from sos_wire.events import Payload

#: how far one FENCE may move the fence (protocol.md 1.11; the server's MAX_FENCE_STEP)
MAX_FENCE_STEP = 1000

_E = TypeVar("_E", bound=BaseException)


def _err(cls: type[_E], msg: str, **attrs: object) -> _E:
    """Build one of the client's exceptions whatever its constructor looks like."""
    for args in ((msg,), (0, msg), ()):
        try:
            e = cls(*args)
            break
        except TypeError:
            continue
    else:  # pragma: no cover
        e = cls.__new__(cls)
        Exception.__init__(e, msg)
    for k, v in attrs.items():
        with contextlib.suppress(AttributeError):
            setattr(e, k, v)
    return e


@dataclass
class _Entry:
    name: str
    length: int
    sealed: bool


class MemStore:
    """Shared state; ``client()`` / ``factory`` hand out clients bound to it."""

    def __init__(self) -> None:
        self.objects: dict[str, bytearray] = {}
        self.sealed: set[str] = set()
        self.fence_epoch = 0
        self.lock = threading.Lock()
        self.down = False  # while True every call raises ConnectionLost
        self.fail_appends = 0  # the next N append calls land but the ack is "lost"
        self.calls: list[str] = []

    def client(self) -> MemClient:
        return MemClient(self)

    factory = client

    def corrupt(self, name: str, offset: int) -> None:
        self.objects[name][offset] ^= 0xFF


class MemClient:
    def __init__(self, store: MemStore) -> None:
        self.s = store
        self.closed = False

    def __enter__(self) -> MemClient:
        return self

    def __exit__(self, *a: object) -> None:
        self.close()

    def _check(self) -> None:
        if self.closed or self.s.down:
            raise _err(ConnectionLost, "connection lost (memstore down)")

    def close(self) -> None:
        self.closed = True

    def ping(self) -> None:
        self._check()

    def stat(self, name: str) -> tuple[int, bool]:
        with self.s.lock:
            self._check()
            if name not in self.s.objects:
                raise _err(SOSNotFound, f"{name}: not found")
            return len(self.s.objects[name]), name in self.s.sealed

    def list(self, prefix: str = "") -> Iterator[_Entry]:
        with self.s.lock:
            self._check()
            out = [
                _Entry(n, len(b), n in self.s.sealed) for n, b in sorted(self.s.objects.items()) if n.startswith(prefix)
            ]
        return iter(out)

    def append(self, name: str, offset: int, data: Payload, *, epoch: int = 0) -> int:
        data = bytes(data)
        with self.s.lock:
            self._check()
            self.s.calls.append("append")
            if epoch != self.s.fence_epoch:  # as the server: only the fence's epoch appends/seals
                raise _err(Fenced, f"epoch {epoch} is not the fence {self.s.fence_epoch}", epoch=self.s.fence_epoch)
            obj = self.s.objects.get(name)
            cur = len(obj) if obj is not None else 0
            if (
                obj is not None
                and offset < cur
                and offset + len(data) <= cur
                and obj[offset : offset + len(data)] == data
            ):
                return offset + len(data)  # an identical retry (protocol.md 1.11 APPEND rule 6)
            if name in self.s.sealed:
                raise _err(SealedError, f"{name} is sealed")
            if offset != cur:
                raise _err(OffsetMismatch, f"offset {offset} != length {cur}", length=cur)
            _crc32c(data)
            if obj is None:
                obj = self.s.objects[name] = bytearray()
            obj += data
            new = len(obj)
            if self.s.fail_appends > 0:
                self.s.fail_appends -= 1
                self.closed = True
                raise _err(ConnectionLost, "ack lost (memstore fault injection)")
            return new

    def append_many(self, name: str, offset: int, chunks: Iterable[Payload], *, epoch: int = 0) -> int:
        for c in chunks:
            offset = self.append(name, offset, c, epoch=epoch)
        return offset

    def read(self, name: str, offset: int = 0, length: int = 0) -> bytes:
        return b"".join(self.read_iter(name, offset, length))

    def read_iter(self, name: str, offset: int = 0, length: int = 0) -> Iterator[bytes]:
        with self.s.lock:
            self._check()
            if name not in self.s.objects:
                raise _err(SOSNotFound, f"{name}: not found")
            obj = self.s.objects[name]
            end = len(obj) if length == 0 else min(len(obj), offset + length)
            data = bytes(obj[offset:end])
        for i in range(0, len(data), 1 << 20):
            yield data[i : i + (1 << 20)]

    def seal(self, name: str, *, epoch: int = 0) -> int:
        with self.s.lock:
            self._check()
            if epoch != self.s.fence_epoch:  # as the server: only the fence's epoch appends/seals
                raise _err(Fenced, f"epoch {epoch} is not the fence {self.s.fence_epoch}", epoch=self.s.fence_epoch)
            if name not in self.s.objects:
                raise _err(SOSNotFound, f"{name}: not found")
            self.s.sealed.add(name)
            return len(self.s.objects[name])

    def fence(self, epoch: int) -> int:
        with self.s.lock:
            self._check()
            if epoch <= self.s.fence_epoch:
                raise _err(Fenced, f"epoch {epoch} <= fence {self.s.fence_epoch}", epoch=self.s.fence_epoch)
            if epoch > self.s.fence_epoch + MAX_FENCE_STEP:  # as the server (protocol.md 1.11)
                raise _err(
                    TooLarge,
                    f"fence {epoch} jumps more than {MAX_FENCE_STEP} past {self.s.fence_epoch}",
                    length=self.s.fence_epoch + MAX_FENCE_STEP,
                )
            self.s.fence_epoch = epoch
            return epoch
