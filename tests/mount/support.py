"""The FUSE mount's test helpers."""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_AT_FDCWD = -100
RENAME_NOREPLACE = 1


def renameat2(src, dst, flags: int = RENAME_NOREPLACE) -> None:
    """renameat2(2) of ``src`` onto ``dst`` (default RENAME_NOREPLACE: what Hadoop's local FS
    does for a rename that must not overwrite); OSError with the errno if it fails."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), dst)
