"""Durable file helpers of the storage layer and its typed error. No protocol, no trio.

Every file of the data directory is created 0600 and every directory 0700 (whatever the
umask); files are replaced atomically (temp + fsync + rename + fsync dir), so a file is
either whole or absent. The modes and ``fsync_dir`` are ``sos_tier.files``' (the tier's
local-directory store uses them too), re-exported here.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import stat

from sos_tier.files import DIR_MODE, FILE_MODE, fsync_dir
from sos_wire.errors import ErrorCode

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "StorageError",
    "fsync_dir",
    "is_no_space",
    "makedirs_durable",
    "no_space",
    "tighten",
    "unlink_durable",
    "write_file_durable",
]

log = logging.getLogger(__name__)

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class StorageError(Exception):
    """A typed failure: ``code`` is the wire ErrorCode, ``length`` the ERROR frame's u64."""

    def __init__(self, code: ErrorCode, message: str, length: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.length = length

    def __repr__(self) -> str:
        return f"StorageError({self.code.name}, {self.message!r}, length={self.length})"


def no_space(what: str, exc: OSError) -> StorageError:
    return StorageError(ErrorCode.NO_SPACE, f"no space left on the server's disk while {what} ({exc.strerror})")


def is_no_space(exc: OSError) -> bool:
    return exc.errno in NO_SPACE_ERRNOS


def makedirs_durable(path: str) -> None:
    """mkdir -p (mode 0700, whatever the umask), fsyncing each parent whose entry we created."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    makedirs_durable(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):  # a file (or a dangling link) where a directory belongs
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path) from None
        return
    os.chmod(path, DIR_MODE)  # the umask may have taken bits the server needs
    fsync_dir(parent)


def write_file_durable(path: str, data: bytes, mode: int = FILE_MODE) -> None:
    """Replace *path* atomically: write temp + fsync + rename + fsync dir. The file gets
    exactly *mode* (default 0600), whatever the umask."""
    d = os.path.dirname(path)
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(d)


def unlink_durable(path: str) -> None:
    os.unlink(path)
    fsync_dir(os.path.dirname(path))


def tighten(path: str, mode: int, fd: int | None = None) -> None:
    """Take group and other permission bits off *path* (made by an older version, or by
    hand); a missing path or one the server may not chmod is left alone (logged)."""
    try:
        st = os.fstat(fd) if fd is not None else os.stat(path)
        if stat.S_IMODE(st.st_mode) & 0o077:
            if fd is not None:
                os.fchmod(fd, mode)
            else:
                os.chmod(path, mode)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot restrict the permissions of %s to %o: %s", path, mode, exc.strerror)
