"""Replay journal records into a directory (used by restore AND to rebuild a cache).

Records are applied strictly in order, one at a time: nothing is reordered, a deletion is
applied exactly where it stands. ``stop(record) -> bool`` is asked before each journal
record; True stops without applying it. Records of a generation's snapshot (everything up
to its SNAPSHOT_END, when ``snapshot=True``) are never a stopping point: the snapshot is
the state of the tree at the end of the previous generation, as a whole.

The journal may be hostile and restore often runs as root, so (protocol.md, 2.2):

* every path is resolved below the target from a directory descriptor, component by
  component, without following symbolic links (:class:`~.beneath.Beneath`); files are
  opened ``O_NOFOLLOW | O_NONBLOCK`` and must be regular files with a single link. A link,
  FIFO, device or hard link planted under the target (say by a local user racing the
  restore) fails the record (ReplayError); it is never followed, truncated or written;
* a new file or directory gets exactly ``mode & 0o775`` (``records.replay_mode``): no
  setuid, setgid or sticky bit and no write permission for others, whatever the record says;
* nothing recurses over the tree, and paths are only ever handed to the kernel one
  component at a time, so any path the journal format allows can be replayed.
"""

from __future__ import annotations

import os
import stat as _stat
from dataclasses import dataclass
from typing import Callable, Iterable

from .beneath import Beneath
from .errors import JournalCorrupt, ReplayError
from .records import (
    Create,
    Delete,
    Marker,
    Mkdir,
    Record,
    Rename,
    Rmdir,
    SnapshotEnd,
    Truncate,
    Write,
    replay_mode,
)

__all__ = ["replay", "Replayer", "ReplayStats"]


@dataclass
class ReplayStats:
    records: int = 0
    bytes_written: int = 0
    last_seq: int = 0
    last_time_ns: int = 0
    stopped: bool = False  # a stop condition ended the replay
    snapshot_done: bool = False


class Replayer:
    """Applies records to ``target_dir``; keeps a few files open across WRITE records."""

    def __init__(self, target_dir: str, *, max_open: int = 64) -> None:
        self.root = os.path.abspath(target_dir)
        self.max_open = max_open
        self._fds: dict[str, int] = {}
        self._at = Beneath(self.root)
        self.stats = ReplayStats()

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._at.open_file(path, os.O_WRONLY, single_link=True)
            self._keep(path, fd)
        return fd

    def _keep(self, path: str, fd: int) -> None:
        if len(self._fds) >= self.max_open:
            old = next(iter(self._fds))
            os.close(self._fds.pop(old))
        self._fds[path] = fd

    def _forget(self, path: str, *, tree: bool = False) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)
        if tree:
            pre = path + "/"
            for p in [p for p in self._fds if p.startswith(pre)]:
                os.close(self._fds.pop(p))

    def apply(self, rec: Record) -> None:
        op = rec.op
        try:
            if isinstance(op, Write):
                n = os.pwrite(self._fd(op.path), op.data, op.offset)
                if n != len(op.data):
                    raise OSError(f"short write to {op.path}")
                self.stats.bytes_written += n
            elif isinstance(op, Create):
                self._forget(op.path)
                fd = self._at.create_file(op.path, replay_mode(op.mode), exact=True, single_link=True)
                self._keep(op.path, fd)
            elif isinstance(op, Mkdir):
                try:
                    self._at.mkdir(op.path, replay_mode(op.mode), exact=True)
                except FileExistsError:
                    if not _stat.S_ISDIR(self._at.lstat(op.path).st_mode):
                        raise
            elif isinstance(op, Truncate):
                os.ftruncate(self._fd(op.path), op.size)
            elif isinstance(op, Rename):
                self._forget(op.src, tree=True)
                self._forget(op.dst, tree=True)
                self._at.rename(op.src, op.dst)
            elif isinstance(op, Delete):
                self._forget(op.path)
                self._at.unlink(op.path)
            elif isinstance(op, Rmdir):
                self._forget(op.path, tree=True)
                self._at.rmdir(op.path)
            elif isinstance(op, (Marker, SnapshotEnd)):
                pass
            else:  # pragma: no cover - the decoder only yields known ops
                raise ReplayError(rec.seq, f"unknown op {op!r}")
        except OSError as e:
            raise ReplayError(rec.seq, f"cannot apply {op.__class__.__name__} "
                                       f"({getattr(op, 'path', getattr(op, 'src', ''))}): {e}") from e
        self.stats.records += 1
        self.stats.last_seq = rec.seq
        self.stats.last_time_ns = rec.time_ns

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._at.close()


def replay(records_iter: Iterable[Record], target_dir: str, *, stop: Callable[[Record], bool] | None = None,
           snapshot: bool = False) -> ReplayStats:
    """Apply ``records_iter`` to ``target_dir`` in order; returns what was applied.

    ``snapshot=True``: the stream starts with a generation's snapshot, which is applied
    whole before ``stop`` is consulted.
    """
    os.makedirs(target_dir, exist_ok=True)
    r = Replayer(target_dir)
    in_snapshot = snapshot
    try:
        for rec in records_iter:
            if in_snapshot:
                r.apply(rec)
                if isinstance(rec.op, SnapshotEnd):
                    in_snapshot = False
                    r.stats.snapshot_done = True
                continue
            if stop is not None and stop(rec):
                r.stats.stopped = True
                break
            r.apply(rec)
    except JournalCorrupt as e:  # from the records: restore reports what was applied before it
        e.replay_stats = r.stats
        raise
    finally:
        r.close()
    return r.stats
