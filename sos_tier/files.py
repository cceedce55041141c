"""The file modes and directory fsync that every local file SOS keeps uses: the server's data
directory (``sos_server/durable.py``) and the tier's local-directory store (``store.py``).

They live here, below both: the tier's store may not import the server (the package layers,
pyproject.toml's import-linter contracts).
"""

from __future__ import annotations

import os

__all__ = ["DIR_MODE", "FILE_MODE", "fsync_dir"]

FILE_MODE = 0o600  # every file: the server's (or the tier's) user only, whatever the umask
DIR_MODE = 0o700


def fsync_dir(path: str) -> None:
    """Make the entries of directory *path* (a file created, renamed or removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
