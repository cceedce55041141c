"""One stored object (its file, length, frame index and damage) and the cache of their
write descriptors. No protocol, no trio.

Files are created atomically, so a file either has a whole header or does not exist.
Appends go at the end of the file without a sync; the engine makes them durable (its
write-ahead log, :mod:`sos_server.wal`, or :meth:`StoredObject.sync`) before
acknowledging. Reads verify every frame's checksum before returning its bytes.

Write descriptors: an object keeps its descriptor open between appends, but at most
``max_open_files`` of them are open (:class:`OpenFiles`, least recently used first closed).
Only a *clean* object's descriptor is closed (every byte written is durable) and never one
the engine pinned for a sync in progress, so durability and group commit do not change;
the next write reopens the file.
"""

from __future__ import annotations

import bisect
import logging
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.events import Payload

from .durable import StorageError, is_no_space, no_space
from .objfile import FRAME, FRAME_HDR, MAX_FRAME, READ_BLOCK, SEAL_FRAME, SEAL_LEN
from .wal import log_key

if TYPE_CHECKING:
    from .wal import WriteAheadLog

__all__ = ["DEFAULT_MAX_OPEN_FILES", "Damage", "OpenFiles", "StoredObject", "Usage"]

log = logging.getLogger(__name__)

INDEX_EVERY = 256 << 10  # sparse index: one (logical, file) offset pair per ~256 KiB
DEFAULT_MAX_OPEN_FILES = 1024


@dataclass
class Damage:
    """A stretch of an object file that start-up found damaged and kept.

    File bytes [file_pos, file_end) hold the object's logical bytes [start, end). When
    ``to_end`` is set the frame structure after file_pos is unknown: every byte from
    ``start`` on is unreadable and ``end`` is an upper bound (the object's length)."""

    file_pos: int
    file_end: int
    start: int
    end: int
    reason: str
    to_end: bool = False


class OpenFiles:
    """The write descriptors of objects: at most *capacity* open, least recently used
    closed first.

    Only a descriptor that can be closed without changing anything is closed: its object
    is clean (every byte written is synced) and not pinned by a sync in progress (the
    engine pins the objects of a group-commit batch). When every open descriptor is busy
    the cache goes over *capacity* for a while: the number of dirty objects is bounded by
    the writes in flight. Event-loop thread only."""

    def __init__(self, capacity: int = DEFAULT_MAX_OPEN_FILES) -> None:
        if capacity < 1:
            raise ValueError("max open files must be at least 1")
        self.capacity = capacity
        self._lru: OrderedDict[int, StoredObject] = OrderedDict()
        self.closed_by_limit = 0

    def __len__(self) -> int:
        return len(self._lru)

    def used(self, obj: StoredObject) -> None:
        """*obj* has an open descriptor and was just used: most recent, then trim."""
        key = id(obj)
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        self._lru[key] = obj
        if len(self._lru) > self.capacity:
            self._trim(obj)

    def forget(self, obj: StoredObject) -> None:
        self._lru.pop(id(obj), None)

    def trim(self) -> None:
        """Close descriptors over *capacity* that have become closable (the engine calls
        this after each group commit, when dirty objects have become clean)."""
        if len(self._lru) > self.capacity:
            self._trim(None)

    def _trim(self, keep: StoredObject | None) -> None:
        for obj in list(self._lru.values()):
            if len(self._lru) <= self.capacity:
                return
            if obj is keep or obj.pins or obj.synced_size < obj.file_size:
                continue
            obj.close()  # calls forget()
            self.closed_by_limit += 1


@dataclass
class Usage:
    """Bytes held by a namespace's objects (their logical lengths, synced or not)."""

    bytes: int = 0


class StoredObject:
    """One object: a file (its write descriptor open while in use, see :class:`OpenFiles`)
    plus its in-memory length and sparse frame index.

    Not thread-safe by itself: the engine serializes appends per object, and reads only
    look at frames below a length they captured before starting.
    """

    def __init__(
        self,
        namespace: str,
        name: str,
        path: str,
        header_size: int,
        *,
        files: OpenFiles | None = None,
        usage: Usage | None = None,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.path = path
        self.header_size = header_size
        self.length = 0  # logical bytes written (not necessarily synced)
        self.file_size = header_size  # bytes of the file that belong to the object
        self.synced_size = header_size  # file bytes known durable
        self.synced_length = 0  # logical bytes known durable (what STAT/READ/LIST see)
        self.sealed = False
        self.seal_pos = -1  # file offset of the seal frame, -1 if unsealed
        self.rollbacks = 0  # bumped whenever unsynced bytes are cut back
        self.cuts: list[int] = []  # file size each rollback cut back to, in order
        self.sync_error: StorageError | None = None  # why the last rollback happened
        self._idx_logical = array("Q", [0])
        self._idx_file = array("Q", [header_size])
        self._fd: int | None = None
        # synced (logical, file) pairs so a rollback can restore the lengths exactly
        self._sync_points: tuple[int, int] = (0, header_size)
        self.damage: list[Damage] = []  # found at start-up, kept (see Storage._load_object)
        self._damage_at: dict[int, Damage] | None = None  # file offset -> damage starting there
        self._files = files
        self.usage = usage
        self.pins = 0  # > 0 while a sync may use the descriptor: OpenFiles does not close it
        self.wal: WriteAheadLog[StoredObject] | None = None  # the server's log: every write is logged there too
        self.checkpointed_size = header_size  # file bytes known durable in the file itself
        self.removed = False  # forgotten by retention: its file is gone
        self._log_key: bytes | None = None

    @property
    def log_key(self) -> bytes:
        """How write-ahead log records name this object (encoded once)."""
        if self._log_key is None:
            self._log_key = log_key(self.namespace, self.name)
        return self._log_key

    # -- damage ----------------------------------------------------------------------
    def add_damage(self, d: Damage) -> None:
        self.damage.append(d)
        if self._damage_at is None:
            self._damage_at = {}
        self._damage_at[d.file_pos] = d

    def refuse_writes(self, what: str) -> None:
        """StorageError(CORRUPT) if start-up found damage in this object: writing after
        damaged bytes (or sealing them in) would bury what an operator has to look at."""
        if self.damage:
            d = self.damage[0]
            raise StorageError(
                ErrorCode.CORRUPT,
                f"cannot {what} {self.namespace}/{self.name}: its stored data is damaged from byte {d.start}"
                f" (file offset {d.file_pos} of {self.path}: {d.reason}); the server kept the bytes and refuses"
                " appends and seals to it until an operator repairs or removes the file",
                self.length,
            )

    # -- file handle -----------------------------------------------------------------
    def _wfd(self) -> int:
        """The write descriptor (event-loop thread only: it updates the descriptor cache)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        if self._files is not None:
            self._files.used(self)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            if self._files is not None:
                self._files.forget(self)
            os.close(fd)

    # -- index -----------------------------------------------------------------------
    def _note_frame(self, logical: int, file_pos: int) -> None:
        if logical - self._idx_logical[-1] >= INDEX_EVERY:
            self._idx_logical.append(logical)
            self._idx_file.append(file_pos)

    def _truncate_index(self, logical: int) -> None:
        i = bisect.bisect_right(self._idx_logical, logical)
        # keep entries with idx_logical <= logical (their frames start within the object)
        del self._idx_logical[i:]
        del self._idx_file[i:]

    def _seek_point(self, offset: int) -> tuple[int, int]:
        i = bisect.bisect_right(self._idx_logical, offset) - 1
        return self._idx_logical[i], self._idx_file[i]

    # -- writes ----------------------------------------------------------------------
    def append(self, data: Payload, crc: int) -> int:
        """Write one frame at the end of the file (no sync). Returns the new length.

        ENOSPC/EDQUOT -> StorageError(NO_SPACE) with the file cut back to where it was.
        """
        n = len(data)
        if not 0 < n <= MAX_FRAME:
            raise StorageError(ErrorCode.TOO_LARGE, f"frame of {n} bytes for {self.name!r}")
        if self.sealed:
            raise StorageError(ErrorCode.SEALED, f"object {self.name!r} is sealed", self.length)
        self._write_at_end([FRAME.pack(n, crc), data], f"appending to {self.name!r}")
        pos = self.file_size
        self.file_size += FRAME_HDR + n
        self.length += n
        if self.usage is not None:
            self.usage.bytes += n
        self._note_frame(self.length - n, pos)
        return self.length

    def write_seal(self) -> None:
        if self.sealed:
            return
        self._write_at_end([SEAL_FRAME], f"sealing {self.name!r}")
        self.seal_pos = self.file_size
        self.file_size += FRAME_HDR
        self.sealed = True

    def _write_at_end(self, bufs: list[Payload], what: str) -> None:
        fd = self._wfd()
        start = self.file_size
        total = sum(len(b) for b in bufs)
        try:
            done = os.pwritev(fd, bufs, start)
            while done < total:  # short write: finish it
                rest = b"".join(bytes(b) for b in bufs)[done:]
                done += os.pwrite(fd, rest, start + done)
        except OSError as exc:
            try:
                os.ftruncate(fd, start)
            except OSError:
                log.exception("could not cut %s back to %d after a failed write", self.path, start)
            if is_no_space(exc):
                raise no_space(what, exc) from None
            raise StorageError(ErrorCode.INTERNAL, f"write failed while {what}: {exc.strerror}") from None
        if self.wal is not None:
            try:
                self.wal.write(self, start, bufs, total)
            except StorageError:
                try:
                    os.ftruncate(fd, start)  # what the log does not hold is not written
                except OSError:
                    log.exception("could not cut %s back to %d after a failed log write", self.path, start)
                raise

    def sync(self) -> tuple[int, int]:
        """fdatasync; returns the (file_size, length) that is now durable.

        Safe to call from a worker thread while the event loop appends more: whatever was
        written before the call is covered.
        """
        size, length = self.file_size, self.length
        fd = self._fd  # the caller pinned the object: OpenFiles does not close it meanwhile
        if fd is not None:
            os.fdatasync(fd)
            return size, length
        # closed while clean (OpenFiles): sync through a descriptor of our own, never
        # through the cache (this may run in a worker thread)
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        return size, length

    def mark_synced(self, size: int, length: int) -> None:
        if size > self.synced_size:
            self.synced_size = size
            self.synced_length = length
            self._sync_points = (length, size)
        self.close_if_done()

    def close_if_done(self) -> None:
        """A durable seal or a removed object: no more writes, give the descriptor back
        (unless a sync, e.g. a checkpoint's, is using it: whoever unpins calls this again)."""
        if not self.pins and (self.removed or (self.sealed and self.synced_size > self.seal_pos)):
            self.close()

    def rollback(self) -> None:
        """Cut unsynced bytes back after a failed sync (they were never acknowledged)."""
        length, size = self._sync_points
        fd = self._wfd()
        os.ftruncate(fd, size)
        self.file_size = size
        if self.usage is not None:
            self.usage.bytes -= self.length - length
        self.length = length
        if self.seal_pos >= size:
            self.sealed = False
            self.seal_pos = -1
        self._truncate_index(length)
        self.cuts.append(size)
        self.rollbacks += 1
        if self.wal is not None:
            try:
                self.wal.truncated(self, size)
            except StorageError:
                log.exception("could not log the rollback of %s to %d", self.path, size)

    # -- reads -----------------------------------------------------------------------
    def read(self, offset: int, length: int, *, limit: int | None = None) -> Iterator[memoryview]:
        """Yield verified pieces of [offset, offset+length) (up to *limit*, default durable).

        Raises StorageError(CORRUPT) naming the object and the file offset of a frame whose
        checksum does not match, before yielding any of that frame's bytes.
        """
        end_limit = self.synced_length if limit is None else limit
        end = end_limit if length == 0 else min(offset + length, end_limit)
        if offset >= end:
            return
        logical, pos = self._seek_point(offset)
        damage = self._damage_at
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            buf = b""
            buf_pos = pos  # file offset of buf[0]
            while logical < end:
                if damage is not None and pos in damage:
                    d = damage[pos]
                    if d.end > offset:
                        raise self._corrupt(pos, f"damaged, found at start-up: {d.reason}")
                    logical, pos = d.end, d.file_end  # entirely before the range: skip it
                    continue
                rel = pos - buf_pos
                if rel + FRAME_HDR > len(buf):
                    buf = os.pread(fd, max(READ_BLOCK, FRAME_HDR), pos)
                    buf_pos, rel = pos, 0
                    if len(buf) < FRAME_HDR:
                        raise self._corrupt(pos, "file ends inside a frame header")
                n, crc = FRAME.unpack_from(buf, rel)
                if n == SEAL_LEN or n == 0 or n > MAX_FRAME:
                    raise self._corrupt(pos, f"bad frame length {n}")
                frame_end = logical + n
                if frame_end <= offset:  # frame entirely before the range: skip it
                    logical = frame_end
                    pos += FRAME_HDR + n
                    continue
                if rel + FRAME_HDR + n > len(buf):
                    buf = os.pread(fd, max(READ_BLOCK, FRAME_HDR + n), pos)
                    buf_pos, rel = pos, 0
                    if len(buf) < FRAME_HDR + n:
                        raise self._corrupt(pos, "file ends inside a frame")
                data = memoryview(buf)[rel + FRAME_HDR : rel + FRAME_HDR + n]
                if crc32c(data) != crc:
                    raise self._corrupt(pos, "checksum mismatch")
                lo = max(offset - logical, 0)
                hi = min(end - logical, n)
                yield data[lo:hi]
                logical = frame_end
                pos += FRAME_HDR + n
        finally:
            os.close(fd)

    def read_bytes(self, offset: int, length: int, *, limit: int | None = None) -> bytes:
        return b"".join(self.read(offset, length, limit=limit))

    def _corrupt(self, pos: int, why: str) -> StorageError:
        return StorageError(
            ErrorCode.CORRUPT,
            f"stored data of {self.namespace}/{self.name} is corrupt at file offset {pos} ({self.path}): {why}",
        )

    def mtime(self) -> float:
        return os.stat(self.path).st_mtime
