"""The gateway's walk of the cache: a whole path resolved in one ``openat2`` call.

:class:`~sos_journal.beneath.Beneath` opens each directory component of a path from its
parent's descriptor (``openat(O_PATH | O_DIRECTORY | O_NOFOLLOW)``), so a GETFILESTATUS of
``ckpt/state/0/1/.5.delta.tmp`` is seven opens and seven closes before its ``lstat``: a third
of the gateway's system calls per request. :class:`OneCallWalk` is a ``Beneath`` whose
``dir_fd`` asks the kernel to do that walk in one call, with the same guarantee:
``openat2(root, path, O_PATH | O_DIRECTORY | O_NOFOLLOW, RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)`` never follows a symbolic link anywhere in the
path and never leaves the root. Its answers are the component walk's: a missing component
is FileNotFoundError, a file or a symbolic link where a directory is needed
NotADirectoryError (the kernel says ELOOP for the link: told as the walk tells it).

Where the kernel has no ``openat2`` (before Linux 5.6) or a seccomp filter refuses it (ENOSYS,
EPERM), the component walk is used, for the rest of the process.
"""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections import OrderedDict

from sos_journal.beneath import O_WALK, Beneath

__all__ = ["OneCallWalk", "openat2_dir"]

#: openat2's number in Linux's common system call table (every architecture since 5.6)
_SYS_OPENAT2 = 437
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_HOW = _OpenHow(O_WALK, 0, _RESOLVE)
_HOW_ADDRESS = ctypes.addressof(_HOW)
_HOW_SIZE = ctypes.sizeof(_OpenHow)
_syscall = None
if sys.platform.startswith("linux"):
    try:
        _syscall = ctypes.CDLL(None, use_errno=True).syscall
        _syscall.restype = ctypes.c_long
        # syscall(2) is variadic; these are passed in registers as its integer arguments
        _syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):  # no libc to call through: the component walk
        _syscall = None


def openat2_dir(dir_fd: int, rel: str) -> int | None:
    """A new ``O_PATH`` descriptor of directory ``rel`` below ``dir_fd``, resolved in one call
    without following any link; None where openat2 cannot be used (then never again) or
    the path is longer than PATH_MAX."""
    global _syscall
    call = _syscall
    if call is None:
        return None
    path = os.fsencode(rel)
    if len(path) >= 4096:  # PATH_MAX: the component walk has no such bound
        return None
    fd = call(_SYS_OPENAT2, dir_fd, path, _HOW_ADDRESS, _HOW_SIZE)
    if fd >= 0:
        return int(fd)
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM, errno.E2BIG):
        _syscall = None  # an old kernel or a seccomp filter: the component walk from now on
        return None
    if err == errno.ELOOP:
        err = errno.ENOTDIR  # a link where a directory is needed: what the component walk says
    raise OSError(err, os.strerror(err), rel)


def _plain(rel: str) -> bool:
    """``rel`` is names joined by single slashes (no empty, ``.`` or ``..`` component, no NUL):
    the paths whose one-call walk is the component walk; the others (never made by the
    gateway, which normalizes every path) get the component walk itself."""
    if "\0" in rel or "//" in rel or rel[0] == "/" or rel[-1] == "/":
        return False
    return "." not in rel or not any(part in (".", "..") for part in rel.split("/"))


class OneCallWalk(Beneath):
    """A :class:`Beneath` whose directories are resolved by :func:`openat2_dir` (module
    docstring); everything else is Beneath's. ``root_fd``: a descriptor of ``root`` the
    caller keeps open (the namespace's, as the journaled tree keeps its own): used as the
    root, not opened and not closed here."""

    def __init__(self, root: str, *, root_fd: int | None = None, max_dirs: int = 32) -> None:
        if root_fd is None:
            super().__init__(root, max_dirs=max_dirs)
            self._owns_root = True
            return
        self.root = root if os.path.isabs(root) else os.path.abspath(root)  # (a name only)
        self.fd = root_fd
        self.max_dirs = max(2, max_dirs)
        self._dirs = OrderedDict()
        self._owns_root = False

    def close(self) -> None:
        if self._owns_root:
            super().close()
            return
        self.forget("")
        self.fd = -1

    def dir_fd(self, rel: str) -> int:
        if rel == "" or rel in self._dirs or not _plain(rel):
            return super().dir_fd(rel)
        fd = openat2_dir(self.fd, rel)
        if fd is None:
            return super().dir_fd(rel)
        self._dirs[rel] = fd
        while len(self._dirs) > self.max_dirs:
            _old, old_fd = self._dirs.popitem(last=False)
            os.close(old_fd)
        return fd
