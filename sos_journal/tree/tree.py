"""JournaledTree: a directory tree whose every change is also a journal record.

The core used by the fsspec filesystem, the FUSE mount and (through replay) restore.
Each operation is first applied to the local cache directory (which serves reads and
decides errors like FileExistsError exactly as POSIX does), then its record is appended to
the writer, under one lock so that the journal order is the order of the cache.
In sync mode (the writer's default) ``sync``, and a ``rename`` onto a path the barrier
policy names (:func:`~sos_journal.tree.barrier_rule.needs_barrier`: a Spark ``offsets/N`` or
``commits/N``), return only once every record so far is durable on the server (the
barrier); other renames are carried by the next barrier of the one ordered journal.

Paths are relative POSIX paths inside the namespace, e.g. ``"chk/offsets/3"``. Every
operation on the cache resolves them from a descriptor of the cache directory without
following symbolic links (:class:`~sos_journal.beneath.Beneath`): a link planted in
the cache is refused, never followed out of it. Modes are recorded, and given to the cache
entries, masked with ``REPLAY_MODE_MASK`` (no setuid, setgid, sticky or write-for-others
bits), exactly what replay applies.

While the server refuses the journal for quota, every change is refused before it touches
the cache (:meth:`JournalWriter.admit`: JournalQuotaExceeded, EDQUOT for a filesystem), so
the cache never holds a change the journal does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import stat as _stat
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from sos_journal.beneath import Beneath, clear_directory
from sos_journal.errors import JournalError
from sos_journal.format.records import (
    MAX_DATA,
    MAX_FILE_SIZE,
    MAX_NAME_BYTES,
    MAX_PATH_BYTES,
    REPLAY_MODE_MASK,
    Create,
    Delete,
    Marker,
    Mkdir,
    Op,
    Rename,
    Rmdir,
    Truncate,
    Write,
    validate_path,
)
from sos_journal.store import StoreClient
from sos_journal.tree.barrier_rule import needs_barrier
from sos_journal.writer.spool import private_file

if TYPE_CHECKING:
    from sos_journal.writer.writer import JournalWriter

__all__ = ["JournaledTree", "clear_directory", "rename_noreplace", "renameat_noreplace", "snapshot_ops"]

_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _renameat2 = getattr(_libc, "renameat2", None)
    if _renameat2 is not None:
        _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        _renameat2.restype = ctypes.c_int
except OSError:  # pragma: no cover - no libc found
    _renameat2 = None


def renameat_noreplace(src_dir_fd: int | None, src: str, dst_dir_fd: int | None, dst: str) -> None:
    """Atomically rename src to dst (each relative to its directory descriptor, None: the
    working directory); FileExistsError if dst exists (files and directories)."""
    if _renameat2 is not None:
        r = _renameat2(
            _AT_FDCWD if src_dir_fd is None else src_dir_fd,
            os.fsencode(src),
            _AT_FDCWD if dst_dir_fd is None else dst_dir_fd,
            os.fsencode(dst),
            _RENAME_NOREPLACE,
        )
        if r == 0:
            return
        e = ctypes.get_errno()
        if e not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(e, os.strerror(e), dst) if e != errno.EEXIST else FileExistsError(e, os.strerror(e), dst)
    # Fallback: link+unlink is atomic for files; directories cannot be linked.
    if _stat.S_ISDIR(os.stat(src, dir_fd=src_dir_fd, follow_symlinks=False).st_mode):
        try:
            os.stat(dst, dir_fd=dst_dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            return
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
    os.link(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, follow_symlinks=False)
    os.unlink(src, dir_fd=src_dir_fd)


def rename_noreplace(src: str, dst: str) -> None:
    """Atomically rename src to dst; FileExistsError if dst exists (files and directories)."""
    renameat_noreplace(None, src, None, dst)


def snapshot_ops(at: Beneath) -> Iterator[Op]:
    """MKDIR/CREATE/WRITE/TRUNCATE records rebuilding the tree under ``at``, streamed from
    the files (no recursion; links and other non-regular entries are skipped). Modes are
    masked as replay applies them. Holes stay holes: only data extents (SEEK_DATA/SEEK_HOLE)
    that are not all zeros become WRITEs, and a TRUNCATE sets the size when the file ends
    in a hole; an 8 TiB sparse file costs a few records, not 8 TiB of zeros."""
    for rel_dir, _dirs, entries in at.walk():
        if rel_dir:
            yield Mkdir(rel_dir, _stat.S_IMODE(at.lstat(rel_dir).st_mode) & REPLAY_MODE_MASK)
        for name, st in entries:
            if not _stat.S_ISREG(st.st_mode):
                continue
            rel = f"{rel_dir}/{name}" if rel_dir else name
            try:
                fd = at.open_file(rel, os.O_RDONLY)
            except FileNotFoundError:  # pragma: no cover - gone since it was listed
                continue
            try:
                yield Create(rel, _stat.S_IMODE(os.fstat(fd).st_mode) & REPLAY_MODE_MASK)
                yield from _file_ops(fd, rel)
            finally:
                os.close(fd)


def _extents(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) of the data extents of a file of ``size`` bytes (all of it if the
    filesystem cannot tell holes)."""
    off = 0
    while off < size:
        try:
            start = os.lseek(fd, off, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole up to the end
                return
            if e.errno in (errno.EINVAL, errno.ENOTSUP):
                yield off, size
                return
            raise
        if start >= size:
            return
        end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
        yield start, end
        off = end


def _file_ops(fd: int, rel: str) -> Iterator[Op]:
    size = os.fstat(fd).st_size
    end = 0  # where the last WRITE ended
    for start, stop in _extents(fd, size):
        pos = start
        while pos < stop:
            data = os.pread(fd, min(MAX_DATA, stop - pos), pos)
            if not data:
                break
            if data.count(0) != len(data):  # a block of zeros is a hole to replay
                yield Write(rel, pos, data)
                end = pos + len(data)
            pos += len(data)
    if end < size:
        yield Truncate(rel, size)


def _name_too_long(path: str) -> bool:
    if len(path) > MAX_PATH_BYTES // 4 and len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        return True
    return any(
        len(p) > MAX_NAME_BYTES // 4 and len(p.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES
        for p in path.split("/")
    )


#: Fills a cache directory with the namespace's latest tree from the server; returns the
#: last seq (restore's rebuild_cache, given by the opener: the tree does not import restore).
RebuildCache = Callable[[Callable[[], StoreClient], str, str], int]


class JournaledTree:
    """Construct, then :meth:`open` (the constructor does no I/O on the network)."""

    def __init__(
        self,
        cache_dir: str,
        writer: JournalWriter,
        *,
        rebuild: RebuildCache | None = None,
        replayed_to: int | None = None,
    ) -> None:
        """``replayed_to``: the cache holds exactly the journal up to that record, replayed
        from the server by a standby gateway after its FENCE (nothing else can have changed
        it): a writer that resumes at that record in a complete generation continues it
        without a new snapshot."""
        self.cache_dir = os.path.abspath(cache_dir)
        self._replayed_to = replayed_to
        os.makedirs(self.cache_dir, exist_ok=True)
        self._at = Beneath(self.cache_dir)
        self._writer = writer
        self._rebuild = rebuild
        self._lock = threading.RLock()
        self._closed = False
        self._opened = False
        self.rebuilt = False  # True when the cache was rebuilt from the server at start

    def open(self) -> JournaledTree:
        """Open the writer (fencing older epochs) and make the cache and the journal agree:
        a first snapshot for a new namespace, or, when the cache is empty or was left
        half-changed by a crash, a rebuild from the server (``rebuild``). Idempotent."""
        with self._lock:
            if self._opened:
                return self
            if not self._writer.is_open:
                self._writer.open()
            self._bootstrap()
            self._opened = True
        return self

    @property
    def writer(self) -> JournalWriter:
        return self._writer

    # ------------------------------------------------------------------ start-up
    def _bootstrap(self) -> None:
        w = self._writer
        self._dirty_path = os.path.join(os.path.abspath(w.spool_dir), "tree-dirty")
        crashed = os.path.exists(self._dirty_path)
        cache_empty = not os.listdir(self.cache_dir)
        if w.generation == 0:
            # Brand-new namespace: generation 1 starts with a snapshot of the cache (empty
            # normally; a restored directory otherwise).
            w.rotate(self._snapshot_ops())
        elif (cache_empty and (not w.had_spool or w.last_seq > 0)) or (crashed and w.had_spool):
            # Empty cache, or the previous process died between changing the cache and
            # journaling the change: the journal is the truth. Ship the spool, then rebuild
            # the cache from the server by the same code as restore.
            if w.had_spool:
                w.barrier()
            if self._rebuild is None:
                raise JournalError(
                    f"the cache {self.cache_dir} must be rebuilt from the server, "
                    "but this tree was given no rebuild function"
                )
            self._at.clear()
            self._at.forget("")
            try:
                last = self._rebuild(w.client_factory, w.namespace, self.cache_dir)
            finally:
                self._at.forget("")  # the rebuild made new directories under the same names
            self.rebuilt = True
            if not w.generation_complete or last != w.last_seq:
                w.rotate(self._snapshot_ops())
        elif (
            self._replayed_to is not None
            and self._replayed_to == w.last_seq
            and not crashed
            and w.generation_complete
            and not w.had_spool
        ):
            pass  # a standby's tail of the journal, to its last record: continue the generation
        elif not w.had_spool or not w.generation_complete:
            # The cache's relation to the server's journal is unknown (fresh spool with an
            # existing cache, e.g. after a point-in-time restore) or the current generation's
            # snapshot was cut short: start a new generation from the cache as it is.
            w.rotate(self._snapshot_ops())
        if w.key_rotation_due:
            # the current generation is not authenticated by the writer's journal key (adopted
            # or rotated since): the key's first record starts a generation (protocol.md 2.5)
            w.rotate(self._snapshot_ops())
        private_file(  # 0600, like everything in the spool
            self._dirty_path, "cache in use; removed by a clean close\n"
        )

    def _snapshot_ops(self) -> Iterator[Op]:
        """Records rebuilding the cache, streamed from the files (see :func:`snapshot_ops`)."""
        return snapshot_ops(self._at)

    # ------------------------------------------------------------------ helpers
    def _abs(self, path: str) -> str:
        self._check(path)
        return os.path.join(self.cache_dir, path)

    @staticmethod
    def _check(path: str) -> str:
        if isinstance(path, str) and _name_too_long(path):
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG), path[:80])
        return validate_path(path)

    @staticmethod
    def _check_size(size: int) -> None:
        if size > MAX_FILE_SIZE:
            raise OSError(errno.EFBIG, f"file larger than {MAX_FILE_SIZE} bytes (the journal's limit)")

    def _append(self, op: Op) -> int:
        seq = self._writer.append(op)
        return seq

    def _after(self) -> None:
        """Called with the lock held after an operation: start a new generation when due."""
        w = self._writer
        if w.rotation_due():
            w.rotate(self._snapshot_ops())

    def local_path(self, path: str) -> str:
        """Where reads of ``path`` go ("" is the root of the tree)."""
        if path in ("", "."):
            return self.cache_dir
        return self._abs(path)

    # ------------------------------------------------------------------ operations
    def mkdir(self, path: str, mode: int = 0o755) -> None:
        """mkdir; the directory gets ``mode & REPLAY_MODE_MASK`` (what the umask took is given
        back; a setgid bit inherited from the parent stays in the cache, as POSIX)."""
        self._check(path)
        mode &= REPLAY_MODE_MASK
        with self._lock:
            self._writer.admit()
            self._at.mkdir(path, mode, exact=False)
            self._append(Mkdir(path, mode))
            self._after()

    def rmdir(self, path: str) -> None:
        self._check(path)
        with self._lock:
            self._writer.admit()
            self._at.rmdir(path)
            self._append(Rmdir(path))
            self._after()

    def create(self, path: str, mode: int = 0o644) -> None:
        """Create ``path`` (mode masked as in mkdir) or truncate it to 0 (O_CREAT|O_TRUNC)."""
        self._check(path)
        mode &= REPLAY_MODE_MASK
        with self._lock:
            self._writer.admit()
            fd = self._at.create_file(path, mode, exact=False)
            os.close(fd)
            self._append(Create(path, mode))
            self._after()

    def write(self, path: str, offset: int, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` at ``offset`` of an existing file; returns the number of bytes."""
        if offset < 0:
            raise ValueError("negative offset")
        self._check(path)
        mv = memoryview(data).cast("B")
        self._check_size(offset + len(mv))
        with self._lock:
            self._writer.admit()
            fd = self._at.open_file(path, os.O_WRONLY)
            try:
                done = 0
                while done < len(mv):
                    done += os.pwrite(fd, mv[done:], offset + done)
            finally:
                os.close(fd)
            for i in range(0, len(mv), MAX_DATA):
                self._append(Write(path, offset + i, bytes(mv[i : i + MAX_DATA])))
            self._after()
        return len(mv)

    def truncate(self, path: str, size: int) -> None:
        if size < 0:
            raise ValueError("negative size")
        self._check(path)
        self._check_size(size)
        with self._lock:
            self._writer.admit()
            fd = self._at.open_file(path, os.O_WRONLY)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
            self._append(Truncate(path, size))
            self._after()

    def rename(self, src: str, dst: str, *, overwrite: bool) -> None:
        """Rename; with overwrite=False an existing dst raises FileExistsError (atomic). In
        sync mode it waits for the server when :func:`needs_barrier` says so for ``dst``."""
        self._check(src)
        self._check(dst)
        with self._lock:
            self._writer.admit()
            if overwrite:
                self._at.rename(src, dst)
            else:
                sfd, sname = self._at.parent(src)
                dfd, dname = self._at.parent(dst)
                renameat_noreplace(sfd, sname, dfd, dname)
                self._at.forget(src)
                self._at.forget(dst)
            seq = self._append(Rename(src, dst, bool(overwrite)))
            self._after()
        if self._writer.sync and needs_barrier(dst):
            self._writer.barrier(seq)

    def unlink(self, path: str) -> None:
        self._check(path)
        with self._lock:
            self._writer.admit()
            if _stat.S_ISDIR(self._at.lstat(path).st_mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            self._at.unlink(path)
            self._append(Delete(path))
            self._after()

    def marker(self, label: str, payload: bytes = b"") -> int:
        with self._lock:
            self._writer.admit()
            seq = self._append(Marker(label, bytes(payload)))
            self._after()
        return seq

    def sync(self, wait: bool | None = None) -> None:
        """Barrier (in sync mode, or with wait=True): returns once every record so far is
        durable on the server."""
        if self._writer.sync if wait is None else wait:
            self._writer.barrier()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            try:
                self._writer.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._dirty_path)
            finally:
                self._at.close()

    def __enter__(self) -> JournaledTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
