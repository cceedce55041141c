"""The fsspec file objects of ``sos://``: reads served from the cache (pread), writes
buffered and journaled as WRITE records, durable at close in sync mode."""

from __future__ import annotations

import errno
import io
import os
import stat as stat_mod
from collections.abc import Callable
from typing import Any

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

from .namespaces import SharedNamespace

#: WRITE records carry at most this many bytes (journal format limit).
RECORD_DATA_MAX = 1 << 20
READ_CHUNK = 1 << 20


def os_error(code: int, path: str, message: str | None = None) -> OSError:
    """``OSError(code, ...)``: Python makes it the matching subclass (ENOENT:
    FileNotFoundError, EEXIST: FileExistsError, ...), so no table of them is kept here."""
    return OSError(code, message or os.strerror(code), path)


def pread_all(fd: int, start: int, end: int) -> bytes:
    out = []
    pos = start
    while pos < end:
        chunk = os.pread(fd, min(end - pos, READ_CHUNK), pos)
        if not chunk:
            break
        out.append(chunk)
        pos += len(chunk)
    return b"".join(out)


class SOSReadFile(AbstractBufferedFile):
    """Reads a snapshot of the cached file: the descriptor is opened when the
    file is, so a later rename or delete does not disturb the reader."""

    def __init__(
        self,
        fs: AbstractFileSystem,
        path: str,
        local: str,
        block_size: int | None = None,
        cache_type: str = "none",
        cache_options: dict[str, Any] | None = None,
    ) -> None:
        try:
            fd = os.open(local, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            raise os_error(errno.ENOENT, path) from None
        try:
            st = os.fstat(fd)
            if stat_mod.S_ISDIR(st.st_mode):
                raise os_error(errno.EISDIR, path)
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd
        self._mtime = st.st_mtime
        super().__init__(
            fs,
            path,
            mode="rb",
            block_size=block_size or READ_CHUNK,
            cache_type=cache_type,
            cache_options=cache_options,
            size=st.st_size,
        )
        self.details = {
            "name": path,
            "size": st.st_size,
            "type": "file",
            "mtime": st.st_mtime,
            "mode": stat_mod.S_IMODE(st.st_mode),
        }

    def _fetch_range(self, start: int, end: int) -> bytes:
        end = min(end, self.size)
        if end <= start:
            return b""
        if self._fd is None:  # closed (fsspec's read checks that first)
            raise ValueError("I/O operation on closed file.")
        return pread_all(self._fd, start, end)

    def close(self) -> None:
        try:
            super().close()
        finally:
            fd, self._fd = getattr(self, "_fd", None), None
            if fd is not None:
                os.close(fd)


class SOSWriteFile(AbstractBufferedFile):
    """A file being written: CREATE was journaled at open; buffered data
    becomes WRITE records (at most 1 MiB each) whenever a block fills, so memory
    stays bounded; close (or :meth:`fsync`) is the durability barrier."""

    DEFAULT_BLOCK_SIZE = RECORD_DATA_MAX
    # set by AbstractBufferedFile (untyped); this class moves them on in fsync
    offset: int | None
    buffer: io.BytesIO

    def __init__(
        self,
        fs: AbstractFileSystem,
        path: str,
        mode: str,
        handle: SharedNamespace,
        barrier: Callable[[], None],
        target: str,
        final: str,
        offset: int,
        block_size: int | None = None,
        autocommit: bool = True,
    ) -> None:
        super().__init__(fs, path, mode=mode, block_size=block_size, autocommit=autocommit)
        self._h = handle
        self._barrier = barrier  # the filesystem's: waits in sync mode, not in async
        self._target = target  # what the records name (a temp file in a transaction)
        self._final = final
        self._pos = offset
        self._committed = False

    def _write_buffer(self) -> None:
        data = self.buffer.getbuffer()
        try:
            for i in range(0, len(data), RECORD_DATA_MAX):
                piece = bytes(data[i : i + RECORD_DATA_MAX])
                self._h.tree.write(self._target, self._pos, piece)
                self._pos += len(piece)
        finally:
            del data

    def _upload_chunk(self, final: bool = False) -> bool:
        self._write_buffer()
        if final and self.autocommit:
            self._barrier()
        return True

    def fsync(self) -> None:
        """Journal everything written so far and wait until it is durable."""
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        if self.offset is None:
            self.offset = 0
        self._write_buffer()
        self.offset += self.buffer.tell()
        self.buffer = io.BytesIO()
        self._h.tree.sync(wait=True)

    def commit(self) -> None:
        """Transaction commit: atomically rename the temp file onto its name."""
        if self.autocommit or self._committed:
            return
        self._committed = True
        with self._h.lock:
            # "xb" stays exclusive: a file that appeared meanwhile is not replaced
            self._h.tree.rename(self._target, self._final, overwrite=self.mode != "xb")
        self._barrier()

    def discard(self) -> None:
        if self.autocommit or self._committed:
            return
        self._committed = True
        with self._h.lock:
            if os.path.lexists(self._h.local(self._target)):
                self._h.tree.unlink(self._target)
