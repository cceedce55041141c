"""The shared write-ahead log: one fdatasync per group commit, whatever the number of
objects it touches. No protocol, no trio.

Every byte written to an object file (a data frame or a seal) is also appended, as one
record, to the current log file ``DATA/wal/<16 digits>.log``, in the same synchronous step
on the event loop (object file first, then the log; neither synced). A group commit
fdatasyncs the log file alone and then acknowledges everything written before it started,
as BookKeeper's journal does; the object files are written (so READs see the bytes at
once, from the page cache) but synced only at a *checkpoint*. Big writes are synced in
place instead of copied (:data:`INDIRECT_MIN`), and the log file is kept written with
zeros ahead of its records (:data:`ZERO_AHEAD`).

Checkpoint: when the current log reaches ``checkpoint_bytes`` the engine's syncer switches
to the spare log file (made ahead of time, so the switch costs nothing) at a group-commit
boundary, then fdatasyncs every object the old log touched and deletes it. At a clean
stop :meth:`WriteAheadLog.close_checkpoint` does the same for everything. After a crash,
start-up (:func:`replay`) writes every whole record of every log onto its object file at
the record's file offset, in log order (idempotent: a record carries its offset), cuts an
object file that ends after its last record back to that end, fdatasyncs the objects and
deletes the logs; the usual object scan (:mod:`.recovery`) follows.

Log file: ``b"SOSWAL1\\n" | u64 seq`` then records::

    u32 crc | u8 kind | u64 file offset | u32 n | u16 ns_len | u16 name_len
    | namespace | name | payload

``kind`` 1 (write): the payload is the n bytes written (one object frame: u32 len | u32 crc |
data, or a seal); 2 (in place): the frame's bytes were written and synced in the object file
itself by their group commit, the payload is its 8-byte frame header alone (n is the frame's
length); 3 (truncate): the object file was cut back to the offset (a failed sync's rollback),
n is 0 and there is no payload.

``crc`` is CRC32C of everything after it up to the payload's 8-byte frame header
included; the frame's own CRC covers its data. Zero bytes after a file's last record
(written ahead, :data:`ZERO_AHEAD`) end that file only: replay goes on with the next one (a
crash between a switch and its checkpoint leaves the old file, and the new one holds
acknowledged records). A *torn* record ends its file the same way: one the file ends
inside of, or one that fails a check while every byte from where the failed check's bytes
end (the last of them included) to the file's end is zero: a write the crash interrupted
lands in the zeros written ahead, so its record holds what was written and zeros after
(its header, key or data cut). It was never acknowledged (a group commit acknowledges only
after every record before it is synced); logged at info level. An object's records follow
one another in its file, so a gap before one (records lost with an older file's unsynced
tail or torn record) cuts the object there. A bad record followed by anything but zero
bytes is damage: logged at error level, the file kept as ``.log.damaged`` for an
operator, the records before it replayed, nothing after it.

Records of an object that retention removed are skipped at replay (its file is gone; a
removed name never comes back: journal generations only grow).

Test-only fault point, for the crash tests: with ``SOS_SERVER_TEST_FAULT=after-log-sync:N``
in its environment the server, right after its N-th log fdatasync and before it
acknowledges anything of that group commit, cuts every object file back to its last
checkpointed size (the object writes are lost, as a power loss could lose them) and
SIGKILLs itself. A restart must rebuild the objects from the log.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.events import Payload
from sos_wire.names import BadName, validate_name, validate_namespace

from .durable import FILE_MODE, StorageError, fsync_dir, is_no_space, makedirs_durable, no_space
from .objfile import FRAME, FRAME_HDR, MAX_FRAME, SEAL_FRAME, pread_all


class LoggedObject(Protocol):
    """What the log needs of an object it writes for (``stored_object.Obj`` is the one
    the server uses): declared here so that the log does not import the layer above it."""

    @property
    def name(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def log_key(self) -> bytes: ...
    @property
    def removed(self) -> bool: ...
    @property
    def checkpointed_size(self) -> int: ...
    def sync(self) -> tuple[int, int]: ...


Obj = TypeVar("Obj", bound=LoggedObject)

__all__ = [
    "DEFAULT_CHECKPOINT_BYTES",
    "FAULT_ENV",
    "LogFile",
    "ReplayNote",
    "WriteAheadLog",
    "fault_after_syncs",
    "replay",
]

log = logging.getLogger(__name__)

WAL_MAGIC = b"SOSWAL1\n"
WAL_HEAD = struct.Struct(">8sQ")
REC = struct.Struct(">IBQIHH")  # crc | kind | file offset | payload length | ns length | name length
META = struct.Struct(">BQI")  # the part of REC after the crc and before the object's key
KIND_WRITE = 1  # the bytes are in the record
KIND_INDIRECT = 2  # the bytes are in the object file, synced in place by their group commit
KIND_TRUNCATE = 3  # the object file was cut back to the offset (a failed sync's rollback)
INDIRECT_MIN = 64 << 10  # object writes this big are synced in place, not copied into the log
ZERO_AHEAD = 1 << 20  # the log file is written with zeros this far ahead of its records
_ZEROS = bytes(ZERO_AHEAD)
DEFAULT_CHECKPOINT_BYTES = 64 << 20
FAULT_ENV = "SOS_SERVER_TEST_FAULT"
_LOG_NAME = re.compile(r"([0-9]{16})\.log\Z")


def fault_after_syncs() -> int | None:
    """N of ``SOS_SERVER_TEST_FAULT=after-log-sync:N`` (see the module docstring), else None."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec.startswith("after-log-sync:"):
        return None
    return int(spec.split(":", 1)[1])


def log_key(namespace: str, name: str) -> bytes:
    """The part of a record that names its object (kept by the object: encoded once)."""
    ns, nm = namespace.encode("utf-8"), name.encode("utf-8")
    return struct.pack(">HH", len(ns), len(nm)) + ns + nm


class LogFile(Generic[Obj]):
    """One log file: its descriptor, its end, and the objects it holds records of."""

    def __init__(self, path: str, seq: int, fd: int, size: int) -> None:
        self.path = path
        self.seq = seq
        self.fd = fd
        self.size = size  # where the next record goes
        self.allocated = size  # the file's size: zeros from self.size on
        self.dirty: dict[int, Obj] = {}  # objects with records here, by id

    def sync(self) -> tuple[int, int]:
        """fdatasync (from a worker thread); (size, size) covered, like stored_object.StoredObject.sync."""
        size = self.size
        os.fdatasync(self.fd)
        return size, size

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _log_files(wal_dir: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(wal_dir)
    except FileNotFoundError:
        return []
    out = []
    for fn in names:
        m = _LOG_NAME.match(fn)
        if m:
            out.append((int(m.group(1)), os.path.join(wal_dir, fn)))
    return sorted(out)


def _new_log_file(wal_dir: str, seq: int) -> LogFile[Any]:
    """Create log file *seq* durably (header synced, directory entry synced)."""
    path = os.path.join(wal_dir, f"{seq:016d}.log")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)
        os.pwrite(fd, WAL_HEAD.pack(WAL_MAGIC, seq), 0)
        os.fdatasync(fd)
        fsync_dir(wal_dir)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    return LogFile(path, seq, fd, WAL_HEAD.size)


def _open_log_file(path: str, seq: int) -> LogFile[Any]:
    """Reuse an empty log file (header only, or nothing: the header is rewritten)."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        if os.pread(fd, WAL_HEAD.size, 0) != WAL_HEAD.pack(WAL_MAGIC, seq):
            os.pwrite(fd, WAL_HEAD.pack(WAL_MAGIC, seq), 0)
            os.fdatasync(fd)
    except BaseException:
        os.close(fd)
        raise
    return LogFile(path, seq, fd, WAL_HEAD.size)


class WriteAheadLog(Generic[Obj]):
    """The log of a running server (see the module docstring). Event-loop thread only,
    except :meth:`LogFile.sync` and the file work of a checkpoint (worker threads)."""

    def __init__(self, wal_dir: str, *, checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES) -> None:
        if checkpoint_bytes < 1:
            raise ValueError("the log's checkpoint size must be at least 1 byte")
        self.dir = wal_dir
        self.checkpoint_bytes = checkpoint_bytes
        makedirs_durable(wal_dir)
        files = _log_files(wal_dir)
        if any(os.path.getsize(p) > WAL_HEAD.size for _, p in files):
            raise RuntimeError(f"{wal_dir} holds log records that were not replayed (Storage.open replays them)")
        # empty files a stop or a replay left are reused: a server restarted on a full disk
        # needs no new space for its log
        reuse: list[LogFile[Obj]] = [_open_log_file(p, seq) for seq, p in files[-2:]]
        for _, p in files[:-2]:
            os.unlink(p)
        while len(reuse) < 2:
            reuse.append(_new_log_file(wal_dir, (reuse[-1].seq if reuse else 0) + 1))
        self.current: LogFile[Obj] = reuse[0]
        self.spare: LogFile[Obj] | None = reuse[1]
        self.retired: list[LogFile[Obj]] = []  # switched away from, not yet checkpointed
        self.indirect: dict[int, Obj] = {}  # in-place writes the next group commit syncs
        self.syncs = 0

    # -- writes (event loop) ---------------------------------------------------------
    def write(self, obj: Obj, file_pos: int, bufs: list[Payload], total: int) -> None:
        """Append the record of *bufs* (total bytes, the first 8 a frame header) written at
        *file_pos* of *obj*'s file. No sync. StorageError(NO_SPACE) on a full disk, with
        the log cut back to where it was.

        A write of INDIRECT_MIN bytes or more is not copied: its record holds the frame
        header only, and the object joins :attr:`indirect`, the files the next group
        commit fdatasyncs beside the log (as ZFS's intent log treats large writes: for
        them the disk's bandwidth, not the number of syncs, is the cost)."""
        if total >= INDIRECT_MIN:
            self._append(obj, KIND_INDIRECT, file_pos, total, [bufs[0][:FRAME_HDR]])
            self.indirect[id(obj)] = obj
        else:
            self._append(obj, KIND_WRITE, file_pos, total, bufs)

    def truncated(self, obj: Obj, size: int) -> None:
        """Record that *obj*'s file was cut back to *size* (a rollback): replay must not
        bring back what an older record of it holds."""
        self._append(obj, KIND_TRUNCATE, size, 0, [])

    def take_indirect(self) -> list[Obj]:
        """The objects with in-place writes since the last group commit (event loop)."""
        objs, self.indirect = list(self.indirect.values()), {}
        return objs

    def _append(self, obj: Obj, kind: int, file_pos: int, n: int, bufs: list[Payload]) -> None:
        lf = self.current
        meta = META.pack(kind, file_pos, n) + obj.log_key
        crc = crc32c(bufs[0][:FRAME_HDR], crc32c(meta)) if bufs else crc32c(meta)
        head = struct.pack(">I", crc) + meta
        start = lf.size
        want = len(head) + sum(len(b) for b in bufs)
        if start + want > lf.allocated:
            self._zero_ahead(lf, start + want)
        try:
            done = os.pwritev(lf.fd, [head, *bufs], start)
            while done < want:  # short write: finish it
                rest = b"".join(bytes(b) for b in [head, *bufs])[done:]
                done += os.pwrite(lf.fd, rest, start + done)
        except OSError as exc:
            try:
                os.ftruncate(lf.fd, start)
            except OSError:
                log.exception("could not cut the log %s back to %d after a failed write", lf.path, start)
            lf.allocated = start
            if is_no_space(exc):
                raise no_space(f"logging a write to {obj.name!r}", exc) from None
            raise StorageError(ErrorCode.INTERNAL, f"write to the log failed: {exc.strerror}") from None
        lf.size = start + want
        lf.allocated = max(lf.allocated, lf.size)
        lf.dirty[id(obj)] = obj

    @staticmethod
    def _zero_ahead(lf: LogFile[Obj], end: int) -> None:
        """Write zeros past *end* (best effort: not on a full disk). A group commit's
        fdatasync then overwrites blocks the file already has, and does not also commit
        the file's growth: half the cost on this machine's disk (docs/BENCHMARKS.md).
        Replay reads zeros after the last record as the log's clean end."""
        try:
            n = os.pwrite(lf.fd, _ZEROS, lf.allocated)
        except OSError:
            n = 0
        lf.allocated += n
        if lf.allocated < end:
            lf.allocated = lf.size  # (partly) failed: the record write finds out

    def wants_checkpoint(self) -> bool:
        return self.current.size >= self.checkpoint_bytes and self.spare is not None

    def switch(self) -> LogFile[Obj]:
        """Make the spare current (at a group-commit boundary); returns the old file, now
        retired: the caller syncs it for the group commit, then checkpoints it."""
        assert self.spare is not None
        old, self.current, self.spare = self.current, self.spare, None
        self.retired.append(old)
        return old

    # -- checkpoint (worker thread for the file work) --------------------------------
    def checkpoint_objects(self) -> list[Obj]:
        """The objects a checkpoint of the retired files must make durable (event loop)."""
        objs: dict[int, Obj] = {}
        for lf in self.retired:
            objs.update(lf.dirty)
        return list(objs.values())

    def drop_retired(self, files: list[LogFile[Obj]]) -> None:
        """Delete retired log files whose objects are durable (worker thread)."""
        for lf in files:
            lf.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lf.path)
        fsync_dir(self.dir)

    def make_spare(self) -> None:
        """Create the next spare log file (worker thread); logged, not raised, on failure:
        the next checkpoint tries again."""
        if self.spare is not None:
            return
        seq = max([self.current.seq, *(lf.seq for lf in self.retired)]) + 1
        try:
            self.spare = _new_log_file(self.dir, seq)
        except OSError as exc:
            log.error("cannot create the next log file in %s: %s (checkpoints wait)", self.dir, exc.strerror)

    def close_checkpoint(self, objects: Iterable[Obj]) -> bool:
        """At a clean stop: fdatasync *objects* (every object with records in a live log
        file), then delete every log file. False (logs kept, replayed at the next start)
        if a sync fails."""
        try:
            for obj in objects:
                if not obj.removed:
                    obj.sync()
        except OSError as exc:
            log.error("checkpoint at stop failed (%s): the log is kept and replayed at the next start", exc)
            return False
        files, self.retired = self.retired, []
        self.drop_retired(files)
        os.ftruncate(self.current.fd, WAL_HEAD.size)  # kept empty for the next start
        os.fdatasync(self.current.fd)
        self.current.size = self.current.allocated = WAL_HEAD.size
        self.current.dirty.clear()
        return True

    def live_objects(self) -> list[Obj]:
        objs: dict[int, Obj] = {}
        for lf in [*self.retired, self.current]:
            objs.update(lf.dirty)
        return list(objs.values())

    def crash_for_test(self) -> None:
        """The fault point (module docstring): lose the unsynced object writes, SIGKILL."""
        for obj in self.live_objects():
            with contextlib.suppress(OSError):
                os.truncate(obj.path, obj.checkpointed_size)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass
class ReplayNote:
    """What start-up replayed from the log."""

    cuts: list[tuple[str, str, str, int, int]] = field(default_factory=list)  # (ns, name, path, kept, cut)
    files: int = 0
    records: int = 0
    bytes: int = 0
    objects: int = 0
    skipped: int = 0  # records of objects whose file is gone (removed by retention)
    damaged: str = ""  # where a damaged record stopped the replay, "" if none
    torn: list[str] = field(default_factory=list)  # where a torn record ended a file's records


@dataclass(frozen=True)
class _End:
    """Where a log file's records stop before the file's end (see :func:`_records`)."""

    pos: int  # the offset of the record that is not whole
    why: str
    #: a torn write if every byte from here to the file's end is zero (the file's size: the
    #: file ends inside the record); None: no write the crash interrupted looks like this
    torn_from: int | None


def _all_zero_from(fd: int, pos: int) -> bool:
    size = os.fstat(fd).st_size
    while pos < size:
        b = os.pread(fd, min(size - pos, 1 << 20), pos)
        if not b or b.count(0) != len(b):
            return not b
        pos += len(b)
    return True


def _records(fd: int, size: int) -> Iterable[tuple[int, str, str, bytes | tuple[int, int, bytes]] | _End]:
    """(file offset, namespace, name, payload) per whole record (for an indirect or
    truncate record (kind, extent length, frame header) instead of the payload), then, if
    the records stop before the file's end, an :class:`_End`.

    A write the crash interrupted leaves its record's first bytes and zeros after them (the
    file is written with zeros ahead, ZERO_AHEAD): whatever check it fails, the bytes that
    check covers end in a zero byte and only zeros follow to the file's end. So a record
    that fails a check is torn if the file is zero from the last byte the check covers on
    (``torn_from``): the header's for a bad kind or length, the record checksum's (header,
    key, frame header) for that checksum, the whole record's for the data's. A check that
    bytes a torn write cannot change fail (the frame length against the record's, the
    name's UTF-8: both under the record checksum) is damage wherever it is."""
    head = os.pread(fd, WAL_HEAD.size, 0)
    if len(head) < WAL_HEAD.size or WAL_HEAD.unpack(head)[0] != WAL_MAGIC:
        if head.strip(b"\0"):
            yield _End(0, "not a log file (bad header)", None)  # made and synced before any record
        return
    pos = WAL_HEAD.size
    while pos < size:
        h = os.pread(fd, REC.size, pos)
        if len(h) < REC.size:
            yield _End(pos, "torn record header", size)
            return
        crc, kind, fpos, n, nl, ml = REC.unpack(h)
        if kind == KIND_TRUNCATE and n == 0:
            stored = 0
        elif kind in (KIND_WRITE, KIND_INDIRECT) and FRAME_HDR <= n <= FRAME_HDR + MAX_FRAME:
            stored = n if kind == KIND_WRITE else FRAME_HDR
        else:  # a header cut inside its kind or length reads as zeros there: kind 0, or a length too small
            yield _End(pos, f"bad record (kind {kind}, length {n})", pos + REC.size - 1)
            return
        key = os.pread(fd, nl + ml, pos + REC.size)
        payload = pread_all(fd, stored, pos + REC.size + nl + ml)
        if len(key) < nl + ml or len(payload) < stored:
            yield _End(pos, "torn record", size)
            return
        end = pos + REC.size + nl + ml + stored
        if crc32c(payload[:FRAME_HDR], crc32c(h[4:] + key)) != crc:
            yield _End(pos, "record checksum mismatch", end - stored + min(stored, FRAME_HDR) - 1)
            return
        if kind == KIND_WRITE and payload != SEAL_FRAME:
            flen, fcrc = FRAME.unpack_from(payload)
            if flen != n - FRAME_HDR:
                yield _End(pos, f"record frame length {flen} is not the record's {n - FRAME_HDR}", None)
                return
            if crc32c(memoryview(payload)[FRAME_HDR:]) != fcrc:
                yield _End(pos, "record data checksum mismatch", end - 1)
                return
        try:
            namespace, name = key[:nl].decode("utf-8"), key[nl:].decode("utf-8")
        except UnicodeDecodeError:
            yield _End(pos, "bad object name", None)
            return
        yield fpos, namespace, name, (payload if kind == KIND_WRITE else (kind, n, payload))
        pos = end


def _frame_in_place(fd: int, pos: int, n: int, hdr: bytes) -> bool:
    """True if the object file holds, at *pos*, the whole frame (n bytes) whose header is *hdr*."""
    if os.pread(fd, FRAME_HDR, pos) != hdr:
        return False
    data = pread_all(fd, n - FRAME_HDR, pos + FRAME_HDR)
    return len(data) == n - FRAME_HDR and crc32c(data) == FRAME.unpack(hdr)[1]


def replay(wal_dir: str, object_path: Callable[[str, str], str]) -> ReplayNote:
    """Apply every log file in *wal_dir* onto the object files (*object_path(ns, name)*),
    fdatasync them, delete the logs. Run before the object scan, with the data directory
    locked (see the module docstring)."""
    note = ReplayNote()
    files = _log_files(wal_dir)
    if not files:
        return note
    damaged: list[str] = []
    objects = _ReplayTarget(object_path, note)
    try:
        for _seq, path in files:
            note.files += 1
            if not _replay_file(path, objects, note, damaged):
                break  # a damaged record: nothing after it is replayed
        objects.finish()
    finally:
        objects.close()
    _retire_log_files(wal_dir, files, damaged)
    if note.records:
        log.warning(
            "replayed the write-ahead log: %d records, %d bytes onto %d objects (%d skipped)",
            note.records,
            note.bytes,
            note.objects,
            note.skipped,
        )
    return note


def _replay_file(path: str, objects: _ReplayTarget, note: ReplayNote, damaged: list[str]) -> bool:
    """Apply the records of one log file in order. True if the file's records ended
    cleanly: at its end, in zero bytes (the zeros written ahead of the records, ZERO_AHEAD)
    or in a torn record (a write the crash interrupted, then zeros), so the replay goes on
    with the next file: a file the log switched away from ends so, and the next one may
    hold acknowledged records (an object whose next record there does not follow on is cut,
    _ReplayTarget). False if a damaged record stopped the replay (*damaged* gets the file)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for rec in _records(fd, os.fstat(fd).st_size):
            if not isinstance(rec, _End):
                fpos, namespace, name, payload = rec
                objects.apply(namespace, name, fpos, payload)
                continue
            if _all_zero_from(fd, rec.pos):
                return True  # the clean end of this file's records
            where = f"{path} offset {rec.pos}: {rec.why}"
            if rec.torn_from is not None and _all_zero_from(fd, rec.torn_from):
                note.torn.append(where)
                log.info(
                    "write-ahead log %s ends in a torn record at offset %d (%s, then zero bytes): a write"
                    " the crash interrupted, never acknowledged; the records before it were replayed",
                    path,
                    rec.pos,
                    rec.why,
                )
                return True
            note.damaged = where
            damaged.append(path)
            log.error(
                "damaged write-ahead log record: %s; the records before it were replayed, the"
                " file is kept as %s.damaged",
                note.damaged,
                path,
            )
            return False
    finally:
        os.close(fd)
    return True


class _ReplayTarget:
    """The object files a replay writes: their descriptors (opened at their first record),
    sizes, where each one's last record ends, and the ones cut at an in-place write that
    did not reach the disk."""

    def __init__(self, object_path: Callable[[str, str], str], note: ReplayNote) -> None:
        self.object_path = object_path
        self.note = note
        self.fds: dict[str, int] = {}
        self.names: dict[str, tuple[str, str]] = {}
        self.broken: set[str] = set()
        self.sizes: dict[str, int] = {}
        self.last_end: dict[str, int] = {}

    def _open(self, namespace: str, name: str) -> str | None:
        """The object's path, its file open; None if the name is bad or the file is gone."""
        try:
            validate_namespace(namespace)
            validate_name(name)
        except BadName:
            return None
        opath = self.object_path(namespace, name)
        if opath not in self.fds:
            try:
                ofd = os.open(opath, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                return None
            self.fds[opath] = ofd
            self.names[opath] = (namespace, name)
            self.sizes[opath] = os.fstat(ofd).st_size
        return opath

    def apply(self, namespace: str, name: str, fpos: int, payload: bytes | tuple[int, int, bytes]) -> None:
        """One record onto its object's file (or skipped: the note counts it)."""
        note, sizes, last_end = self.note, self.sizes, self.last_end
        opath = self._open(namespace, name)
        if opath is None:
            note.skipped += 1
            return
        ofd = self.fds[opath]
        if isinstance(payload, tuple) and payload[0] == KIND_TRUNCATE:
            os.ftruncate(ofd, fpos)
            sizes[opath] = last_end[opath] = fpos
            self.broken.discard(opath)
            note.records += 1
            return
        if opath in self.broken:  # after an in-place write that did not reach the disk
            note.skipped += 1
            return
        if fpos > last_end.get(opath, fpos):
            # an object's records follow one another in its file; a gap means records of it
            # were lost with the unsynced tail of an earlier log file (then nothing of it from
            # there on was acknowledged): cut it where its last record ended
            self.broken.add(opath)
            note.skipped += 1
            return
        if fpos > sizes[opath]:  # a hole: an earlier record of it is missing
            log.error(
                "log record for %s/%s at file offset %d is beyond its file's end %d: skipped",
                namespace,
                name,
                fpos,
                sizes[opath],
            )
            note.skipped += 1
            return
        if isinstance(payload, tuple):  # in place: there and whole, or never acknowledged
            _, n, hdr = payload
            if not _frame_in_place(ofd, fpos, n, hdr):
                self.broken.add(opath)
                last_end[opath] = fpos  # cut there: nothing from it on was acknowledged
                return
            end = fpos + n
            sizes[opath] = max(sizes[opath], end)
            last_end[opath] = end
            note.records += 1
            return
        os.pwrite(ofd, payload, fpos)
        end = fpos + len(payload)
        sizes[opath] = max(sizes[opath], end)
        last_end[opath] = end
        note.records += 1
        note.bytes += len(payload)

    def finish(self) -> None:
        """Cut what each object's file holds after its last record (never acknowledged), then
        fdatasync every object file."""
        for opath, ofd in self.fds.items():
            last = self.last_end.get(opath)
            if last is not None and self.sizes[opath] > last:
                os.ftruncate(ofd, last)
                self.note.cuts.append((*self.names[opath], opath, last, self.sizes[opath] - last))
            os.fdatasync(ofd)
        self.note.objects = len(self.last_end)

    def close(self) -> None:
        for ofd in self.fds.values():
            os.close(ofd)


def _retire_log_files(wal_dir: str, files: list[tuple[int, str]], damaged: list[str]) -> None:
    """After a replay: damaged files kept aside as ``.damaged``, the newest two others emptied
    (WriteAheadLog reuses them), the rest deleted; all of it durable."""
    for path in damaged:
        os.rename(path, path + ".damaged")
    keep = [p for _, p in files if p not in damaged][-2:]  # emptied, reused by WriteAheadLog
    for _seq, path in files:
        if path in keep:
            os.truncate(path, WAL_HEAD.size)
        elif path not in damaged:
            os.unlink(path)
    for path in keep:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    fsync_dir(wal_dir)
