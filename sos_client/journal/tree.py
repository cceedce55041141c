"""JournaledTree: a directory tree whose every change is also a journal record.

The core used by the fsspec filesystem, the FUSE mount and (through replay) restore.
Each operation is first applied to the local cache directory (which serves reads and
decides errors like FileExistsError exactly as POSIX does), then its record is appended to
the writer, under one lock so that the journal order is the order of the cache.
In sync mode (the writer's default) ``rename`` and ``sync`` return only once their records
are durable on the server (the barrier); callers (mount/fsspec) also call ``sync`` on close.

Paths are relative POSIX paths inside the namespace, e.g. ``"chk/offsets/3"``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat as _stat
import threading
from typing import Iterator

from .records import MAX_DATA, Create, Delete, Marker, Mkdir, Op, Rename, Rmdir, Truncate, Write, validate_path

__all__ = ["JournaledTree", "rename_noreplace"]

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


def _unmask(p, mode: int) -> None:
    """Give back the permission bits our umask took from ``mode`` (path or fd); special bits
    stay as the kernel set them (e.g. S_ISGID inherited from a setgid parent)."""
    st_mode = os.stat(p).st_mode
    want = _stat.S_IMODE(st_mode) | (mode & 0o777)
    if want != _stat.S_IMODE(st_mode):
        if isinstance(p, int):
            os.fchmod(p, want)
        else:
            os.chmod(p, want)


def _create_exact(p: str, mode: int) -> int:
    """O_CREAT|O_TRUNC; a new file gets exactly ``mode`` (the caller's umask was applied by
    whoever asked; ours must not mask it again). An existing file keeps its mode, as POSIX."""
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        return os.open(p, os.O_WRONLY | os.O_TRUNC)
    try:
        _unmask(fd, mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


def rename_noreplace(src: str, dst: str) -> None:
    """Atomically rename src to dst; FileExistsError if dst exists (files and directories)."""
    if _renameat2 is not None:
        r = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if r == 0:
            return
        e = ctypes.get_errno()
        if e not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
            raise OSError(e, os.strerror(e), dst) if e != errno.EEXIST else FileExistsError(
                e, os.strerror(e), dst)
    # Fallback: link+unlink is atomic for files; directories cannot be linked.
    if os.path.isdir(src) and not os.path.islink(src):
        if os.path.lexists(dst):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
        os.rename(src, dst)
        return
    os.link(src, dst)
    os.unlink(src)


def clear_directory(directory: str) -> None:
    """Remove everything inside ``directory`` (not the directory itself)."""
    import shutil

    for name in os.listdir(directory):
        p = os.path.join(directory, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)


class JournaledTree:
    def __init__(self, cache_dir: str, writer):
        self.cache_dir = os.path.abspath(cache_dir)
        os.makedirs(self.cache_dir, exist_ok=True)
        self._writer = writer
        self._lock = threading.RLock()
        self._closed = False
        self.rebuilt = False  # True when the cache was rebuilt from the server at start
        if not writer.is_open:
            writer.open()
        with self._lock:
            self._bootstrap()

    @property
    def writer(self):
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
            from .restore import rebuild_cache

            clear_directory(self.cache_dir)
            last = rebuild_cache(w.client_factory, w.namespace, self.cache_dir)
            self.rebuilt = True
            if not w.generation_complete or last != w.last_seq:
                w.rotate(self._snapshot_ops())
        elif not w.had_spool or not w.generation_complete:
            # The cache's relation to the server's journal is unknown (fresh spool with an
            # existing cache, e.g. after a point-in-time restore) or the current generation's
            # snapshot was cut short: start a new generation from the cache as it is.
            w.rotate(self._snapshot_ops())
        from .spool import private_file  # 0600, like everything in the spool

        private_file(self._dirty_path, "cache in use; removed by a clean close\n")

    def _snapshot_ops(self) -> Iterator[Op]:
        """MKDIR/CREATE/WRITE records rebuilding the cache, streamed from the files."""
        root = self.cache_dir
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
            if rel_dir:
                yield Mkdir(rel_dir, _stat.S_IMODE(os.stat(dirpath).st_mode))
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                st = os.lstat(full)
                if not _stat.S_ISREG(st.st_mode):
                    continue
                rel = f"{rel_dir}/{name}" if rel_dir else name
                yield Create(rel, _stat.S_IMODE(st.st_mode))
                with open(full, "rb", buffering=0) as f:
                    off = 0
                    while True:
                        data = f.read(MAX_DATA)
                        if not data:
                            break
                        yield Write(rel, off, data)
                        off += len(data)

    # ------------------------------------------------------------------ helpers
    def _abs(self, path: str) -> str:
        validate_path(path)
        return os.path.join(self.cache_dir, path)

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
        p = self._abs(path)
        with self._lock:
            os.mkdir(p, mode)
            _unmask(p, mode)
            self._append(Mkdir(path, mode))
            self._after()

    def rmdir(self, path: str) -> None:
        p = self._abs(path)
        with self._lock:
            os.rmdir(p)
            self._append(Rmdir(path))
            self._after()

    def create(self, path: str, mode: int = 0o644) -> None:
        """Create ``path`` or truncate it to 0 (O_CREAT|O_TRUNC)."""
        p = self._abs(path)
        with self._lock:
            fd = _create_exact(p, mode)
            os.close(fd)
            self._append(Create(path, mode))
            self._after()

    def write(self, path: str, offset: int, data) -> int:
        """Write ``data`` at ``offset`` of an existing file; returns the number of bytes."""
        if offset < 0:
            raise ValueError("negative offset")
        p = self._abs(path)
        mv = memoryview(data).cast("B")
        with self._lock:
            fd = os.open(p, os.O_WRONLY)
            try:
                done = 0
                while done < len(mv):
                    done += os.pwrite(fd, mv[done:], offset + done)
            finally:
                os.close(fd)
            for i in range(0, len(mv), MAX_DATA):
                self._append(Write(path, offset + i, bytes(mv[i:i + MAX_DATA])))
            self._after()
        return len(mv)

    def truncate(self, path: str, size: int) -> None:
        if size < 0:
            raise ValueError("negative size")
        p = self._abs(path)
        with self._lock:
            os.truncate(p, size)
            self._append(Truncate(path, size))
            self._after()

    def rename(self, src: str, dst: str, *, overwrite: bool) -> None:
        """Rename; with overwrite=False an existing dst raises FileExistsError (atomic)."""
        ps, pd = self._abs(src), self._abs(dst)
        with self._lock:
            if overwrite:
                os.rename(ps, pd)
            else:
                rename_noreplace(ps, pd)
            seq = self._append(Rename(src, dst, bool(overwrite)))
            self._after()
        if self._writer.sync:
            self._writer.barrier(seq)

    def unlink(self, path: str) -> None:
        p = self._abs(path)
        with self._lock:
            if os.path.isdir(p) and not os.path.islink(p):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            os.unlink(p)
            self._append(Delete(path))
            self._after()

    def marker(self, label: str, payload: bytes = b"") -> int:
        with self._lock:
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
            self._writer.close()
            try:
                os.unlink(self._dirty_path)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
