"""The mount's inode table: inode numbers of the cache's entries, their lookup counts and
the paths they stand for (kept across renames), the root and the virtual `.sos` entries."""

from __future__ import annotations

import collections
import errno
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


ROOT_INODE = 1
#: `.sos/` at the root is a virtual control directory (never journaled, not listed);
#: writing a JSON document {"label": str, "payload": any} to `.sos/marker` appends a
#: MARKER record (tree.marker); fsync/close of it waits until the marker is durable.
CONTROL_DIR = ".sos"
CONTROL_DIR_INO = 1 << 62
MARKER_FILE = "marker"
MARKER_INO = CONTROL_DIR_INO + 1
#: `.sos/namespace`: read-only, the mounted namespace's name and a newline (what
#: `journaled_checkpoint` reads to reuse a live mount of the same namespace).
NAMESPACE_FILE = "namespace"
NAMESPACE_INO = CONTROL_DIR_INO + 2
VIRTUAL = (CONTROL_DIR_INO, MARKER_INO, NAMESPACE_INO)
CONTROL_FILES = {MARKER_FILE.encode(): MARKER_INO, NAMESPACE_FILE.encode(): NAMESPACE_INO}
ATTR_TIMEOUT = 1.0
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


class InodeTable:
    """Inode number <-> tree path, with kernel lookup counts and open counts.

    Paths are relative POSIX paths inside the namespace ("" is the root).
    A path that is unlinked or replaced while the kernel still knows its inode
    becomes an orphan (path None) until the kernel forgets it and it is closed.
    """

    def __init__(self) -> None:
        self._paths: dict[int, str | None] = {ROOT_INODE: ""}
        self._inos: dict[str, int] = {"": ROOT_INODE}
        self._lookups: collections.Counter[int] = collections.Counter()
        self._opens: collections.Counter[int] = collections.Counter()
        self._dirs: set[int] = {ROOT_INODE}
        self._next = ROOT_INODE + 1

    def __len__(self) -> int:
        return len(self._paths)

    def path(self, ino: int) -> str | None:
        """The path of `ino`; None for an orphan; FileNotFoundError if unknown."""
        try:
            return self._paths[ino]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "stale inode", str(ino)) from None

    def live_path(self, ino: int) -> str:
        path = self.path(ino)
        if path is None:
            raise FileNotFoundError(errno.ENOENT, "file was removed", str(ino))
        return path

    def ino(self, path: str) -> int:
        """The inode number of `path`, allocating one if it has none yet."""
        ino = self._inos.get(path)
        if ino is None:
            ino = self._next
            self._next += 1
            self._inos[path] = ino
            self._paths[ino] = path
        return ino

    def known(self, path: str) -> int | None:
        return self._inos.get(path)

    def lookup(self, ino: int, n: int = 1) -> None:
        self._lookups[ino] += n

    def forget(self, ino: int, n: int) -> None:
        self._lookups[ino] -= n
        self._maybe_drop(ino)

    def opened(self, ino: int) -> None:
        self._opens[ino] += 1

    def closed(self, ino: int) -> None:
        self._opens[ino] -= 1
        self._maybe_drop(ino)

    def removed(self, path: str) -> None:
        ino = self._inos.pop(path, None)
        if ino is not None:
            self._paths[ino] = None
            self._maybe_drop(ino)

    def renamed(self, src: str, dst: str) -> Callable[[], None]:
        """Move `src` (and, for a directory, everything below it) to `dst`.

        Returns an undo callable that puts the table back (for a rename that
        turned out not to happen).
        """
        if src == dst:
            return lambda: None
        old_dst = self._inos.pop(dst, None)
        if old_dst is not None:
            self._paths[old_dst] = None
        ino = self._inos.get(src)
        moves = []
        if ino is not None:
            if ino in self._dirs:  # a directory moves everything the table knows below it
                prefix = src + "/"
                moves = [(p, i) for p, i in self._inos.items() if p == src or p.startswith(prefix)]
            else:
                moves = [(src, ino)]
        for old, moved in moves:
            new = dst + old[len(src) :]
            del self._inos[old]
            self._inos[new] = moved
            self._paths[moved] = new

        def undo() -> None:
            for old, moved in moves:
                new = dst + old[len(src) :]
                if self._paths.get(moved) == new:
                    self._inos.pop(new, None)
                    self._inos[old] = moved
                    self._paths[moved] = old
            if old_dst is not None and old_dst in self._paths and self._paths[old_dst] is None:
                self._paths[old_dst] = dst
                self._inos[dst] = old_dst

        if old_dst is not None:
            self._maybe_drop(old_dst)
        return undo

    def mark_dir(self, ino: int, is_dir: bool) -> None:
        if is_dir:
            self._dirs.add(ino)
        else:
            self._dirs.discard(ino)

    def _maybe_drop(self, ino: int) -> None:
        if ino == ROOT_INODE or self._lookups[ino] > 0 or self._opens[ino] > 0:
            return
        path = self._paths.pop(ino, None)
        if path is not None and self._inos.get(path) == ino:
            del self._inos[path]
        self._lookups.pop(ino, None)
        self._opens.pop(ino, None)
        self._dirs.discard(ino)
