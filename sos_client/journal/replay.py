"""Replay journal records into a directory (used by restore AND to rebuild a cache).

Records are applied strictly in order, one at a time: nothing is reordered, a deletion is
applied exactly where it stands. ``stop(record) -> bool`` is asked before each journal
record; True stops without applying it. Records of a generation's snapshot (everything up
to its SNAPSHOT_END, when ``snapshot=True``) are never a stopping point: the snapshot is
the state of the tree at the end of the previous generation, as a whole.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable

from .errors import ReplayError
from .tree import _create_exact, _unmask
from .records import Create, Delete, Marker, Mkdir, Record, Rename, Rmdir, SnapshotEnd, Truncate, Write

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

    def __init__(self, target_dir: str, *, max_open: int = 64):
        self.root = os.path.abspath(target_dir)
        self.max_open = max_open
        self._fds: dict[str, int] = {}
        self.stats = ReplayStats()

    def _p(self, path: str) -> str:
        return os.path.join(self.root, path)

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is None:
            fd = os.open(self._p(path), os.O_WRONLY)
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
        t = type(op)
        try:
            if t is Write:
                n = os.pwrite(self._fd(op.path), op.data, op.offset)
                if n != len(op.data):
                    raise OSError(f"short write to {op.path}")
                self.stats.bytes_written += n
            elif t is Create:
                self._forget(op.path)
                self._keep(op.path, _create_exact(self._p(op.path), op.mode))
            elif t is Mkdir:
                try:
                    os.mkdir(self._p(op.path), op.mode)
                    _unmask(self._p(op.path), op.mode)  # exact, whatever our umask
                except FileExistsError:
                    if not os.path.isdir(self._p(op.path)):
                        raise
            elif t is Truncate:
                fd = self._fds.get(op.path)
                if fd is not None:
                    os.ftruncate(fd, op.size)
                else:
                    os.truncate(self._p(op.path), op.size)
            elif t is Rename:
                self._forget(op.src, tree=True)
                self._forget(op.dst, tree=True)
                os.rename(self._p(op.src), self._p(op.dst))
            elif t is Delete:
                self._forget(op.path)
                os.unlink(self._p(op.path))
            elif t is Rmdir:
                self._forget(op.path, tree=True)
                os.rmdir(self._p(op.path))
            elif t is Marker or t is SnapshotEnd:
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
                if type(rec.op) is SnapshotEnd:
                    in_snapshot = False
                    r.stats.snapshot_done = True
                continue
            if stop is not None and stop(rec):
                r.stats.stopped = True
                break
            r.apply(rec)
    except BaseException as e:
        e.replay_stats = r.stats  # what was applied before the failure
        raise
    finally:
        r.close()
    return r.stats
