"""Replay journal records into a directory (used by restore AND to rebuild a cache).

With ``workers=1`` records are applied strictly in order, one at a time. With more (what
restore uses, :data:`DEFAULT_WORKERS`) a dispatcher reads the records in order and hands
each file's records to one of ``workers`` lanes (threads) chosen by the file's path, so
different files are written in parallel while each path sees its records in journal order;
a rename of a file waits for what came before it on both of its paths; directory records
(MKDIR, RMDIR, a directory's RENAME) are applied by the dispatcher in journal order, after
everything before them on the same path (RMDIR and a directory's RENAME: after everything
before them). Nothing is reordered that one path could see, and a deletion is applied
exactly where it stands for its path. ``stop(record) -> bool`` is asked before each journal
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
import queue
import stat as _stat
import threading
import zlib
from collections.abc import Callable, Iterable
from functools import partial

from sos_journal.beneath import Beneath
from sos_journal.errors import JournalCorrupt, ReplayError
from sos_journal.format.records import (
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
from sos_journal.stats import ReplayStats

__all__ = ["DEFAULT_WORKERS", "ReplayStats", "Replayer", "replay"]

#: lanes restore uses: writes of different files overlap in the kernel (creating a file,
#: writing its pages). On the 2-core machine of docs/BENCHMARKS.md ("Restore in parallel
#: lanes") 4 lanes and 1 are level on a disk and 1 is ahead on tmpfs (the GIL, the server
#: and the readers share the cores): one lane per core, at most 4.
DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))
#: tasks handed to a lane at once (one queue operation per batch, not per record), or
#: fewer once their WRITE data reaches BATCH_BYTES; a lane's queue holds QUEUED_BATCHES
BATCH = 64
BATCH_BYTES = 1 << 20
QUEUED_BATCHES = 4


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
            raise ReplayError(
                rec.seq, f"cannot apply {op.__class__.__name__} ({getattr(op, 'path', getattr(op, 'src', ''))}): {e}"
            ) from e
        self.stats.records += 1
        self.stats.last_seq = rec.seq
        self.stats.last_time_ns = rec.time_ns

    def forget_tree(self, path: str) -> None:
        """Drop every descriptor (files and directories) held for ``path`` and below."""
        self._forget(path, tree=True)
        self._at.forget(path)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._at.close()


class _Lane(threading.Thread):
    """One worker: applies the tasks queued to it in order with its own Replayer (its own
    descriptors). The queue holds batches of (ticket, record or callable); None stops it."""

    def __init__(self, root: str, index: int, max_open: int, failed: list) -> None:
        super().__init__(name=f"replay-lane-{index}", daemon=True)
        self.rep = Replayer(root, max_open=max_open)
        # batches; bounded (records carry data): at most QUEUED_BATCHES x BATCH_BYTES per lane
        self.q: queue.Queue = queue.Queue(maxsize=QUEUED_BATCHES)
        self.cond = threading.Condition()
        self.done = 0  # ticket of the last task finished
        self.queued = 0  # ticket of the last task handed out (dispatcher side)
        self.batch: list = []  # tasks handed out, not yet queued (dispatcher side)
        self.batch_bytes = 0  # WRITE data in ``batch``
        self._failed = failed  # shared: the first error of any lane

    def run(self) -> None:
        rep, q, cond, failed = self.rep, self.q, self.cond, self._failed
        while True:
            batch = q.get()
            if batch is None:
                return
            for ticket, task in batch:
                if not failed:
                    try:
                        if type(task) is Record:
                            rep.apply(task)
                        else:
                            task()
                    except BaseException as e:  # noqa: BLE001 - handed to the dispatcher
                        failed.append(e)
                if type(task) is not Record:  # a waiter may be waiting for this very task
                    with cond:
                        self.done = ticket
                        cond.notify_all()
            with cond:
                self.done = batch[-1][0]
                cond.notify_all()

    def wait_for(self, ticket: int) -> None:
        with self.cond:
            while self.done < ticket:
                self.cond.wait(0.5)


class ParallelReplayer:
    """Applies records in ``workers`` lanes, keeping each path's order (see module doc).

    ``apply(rec)`` is called in journal order by one thread (the dispatcher); ``drain()``
    returns once everything handed out is applied, raising the first lane's error."""

    def __init__(self, target_dir: str, workers: int, *, max_open: int = 64) -> None:
        self.root = os.path.abspath(target_dir)
        self._failed: list[BaseException] = []
        self.main = Replayer(self.root, max_open=2)  # directory records, in the dispatcher
        self.lanes = [_Lane(self.root, i, max(4, max_open // workers), self._failed) for i in range(workers)]
        for lane in self.lanes:
            lane.start()
        self._ticket = 0
        #: path -> (lane index, ticket) of the last task queued that touches it
        self._last: dict[str, tuple[int, int]] = {}
        #: directories the journal made (a RENAME of one of these is a directory rename)
        self._dirs: set[str] = set()
        self.stats = self.main.stats
        self._closed = False

    # -- dispatching -------------------------------------------------------------------
    def _lane_of(self, path: str) -> int:
        return zlib.crc32(path.encode("utf-8", "surrogateescape")) % len(self.lanes)

    def _queue(self, i: int, task: Record | Callable[[], object]) -> int:
        self._ticket += 1
        lane = self.lanes[i]
        lane.queued = self._ticket
        lane.batch.append((self._ticket, task))
        if type(task) is Record and type(task.op) is Write:
            lane.batch_bytes += len(task.op.data)
        if len(lane.batch) >= BATCH or lane.batch_bytes >= BATCH_BYTES:
            self._flush(lane)
        return self._ticket

    @staticmethod
    def _flush(lane: _Lane) -> None:
        if lane.batch:
            lane.q.put(lane.batch)
            lane.batch = []
            lane.batch_bytes = 0

    def _after(self, i: int, paths: Iterable[str]) -> None:
        """Make lane ``i`` wait for the tasks queued to other lanes that touch ``paths``."""
        for p in paths:
            last = self._last.get(p)
            if last is not None and last[0] != i and self.lanes[last[0]].done < last[1]:
                other, ticket = self.lanes[last[0]], last[1]
                self._flush(other)  # what lane i will wait for must be on its way
                self._queue(i, partial(other.wait_for, ticket))

    def _settle(self, paths: Iterable[str]) -> None:
        """Wait (dispatcher) until every task queued that touches ``paths`` is applied."""
        for p in paths:
            last = self._last.pop(p, None)
            if last is not None:
                self._flush(self.lanes[last[0]])
                self.lanes[last[0]].wait_for(last[1])
        self._raise_failed()

    def _quiesce(self) -> None:
        for lane in self.lanes:
            self._flush(lane)
        for lane in self.lanes:
            lane.wait_for(lane.queued)
        self._last.clear()
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self._failed:
            raise self._failed[0]

    def apply(self, rec: Record) -> None:
        # (the ignores: mypy does not narrow ``op`` through ``t = type(op)``; each branch checked t)
        if self._failed:
            self._quiesce()
        op = rec.op
        t = type(op)
        if t is Write or t is Truncate or t is Create or t is Delete:
            path = op.path  # type: ignore[union-attr]  # t is one with a path
            i = self._lane_of(path)
            self._after(i, (path,))
            self._last[path] = (i, self._queue(i, rec))
        elif t is Rename and op.src not in self._dirs:  # type: ignore[union-attr]  # a Rename
            src, dst = op.src, op.dst  # type: ignore[union-attr]  # a Rename
            i, j = self._lane_of(dst), self._lane_of(src)
            if j != i:  # src's lane may hold a descriptor of src: it drops it first
                self._last[src] = (j, self._queue(j, partial(self.lanes[j].rep.forget_tree, src)))
            self._after(i, (src, dst))
            ticket = self._queue(i, rec)
            self._last[src] = self._last[dst] = (i, ticket)
        elif t is Mkdir:
            self._settle((op.path,))  # type: ignore[union-attr]  # a Mkdir
            self.main.apply(rec)
            self._dirs.add(op.path)  # type: ignore[union-attr]  # a Mkdir
            return
        elif t is Marker or t is SnapshotEnd:
            self.main.apply(rec)
            return
        else:  # RMDIR, a directory's RENAME: after everything before it, then nothing is stale
            self._quiesce()
            self.main.apply(rec)
            paths = (op.path,) if t is Rmdir else (op.src, op.dst)  # type: ignore[union-attr]  # Rmdir or Rename
            for p in paths:
                self.main.forget_tree(p)
                for lane in self.lanes:
                    lane.rep.forget_tree(p)
            self._move_dirs(rec)
            return
        self.stats.records += 1
        self.stats.last_seq = rec.seq
        self.stats.last_time_ns = rec.time_ns

    def _move_dirs(self, rec: Record) -> None:
        op = rec.op
        if isinstance(op, Rmdir):
            self._dirs.discard(op.path)
        elif isinstance(op, Rename):
            pre = op.src + "/"
            moved = [d for d in self._dirs if d == op.src or d.startswith(pre)]
            for d in moved:
                self._dirs.discard(d)
                self._dirs.add(op.dst + d[len(op.src) :])

    def drain(self) -> None:
        """Return once every record handed out is applied; raises the first lane error."""
        self._quiesce()
        self.stats.bytes_written = self.main.stats.bytes_written + sum(
            lane.rep.stats.bytes_written for lane in self.lanes
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for lane in self.lanes:
            lane.q.put(None)
        for lane in self.lanes:
            lane.join()
            lane.rep.close()
        self.main.close()


def replay(
    records_iter: Iterable[Record],
    target_dir: str,
    *,
    stop: Callable[[Record], bool] | None = None,
    snapshot: bool = False,
    workers: int = 1,
    observe: Callable[[Record], None] | None = None,
) -> ReplayStats:
    """Apply ``records_iter`` to ``target_dir``; returns what was applied.

    ``snapshot=True``: the stream starts with a generation's snapshot, which is applied
    whole before ``stop`` is consulted. ``observe(record)`` is called, in journal order, with
    each record applied after the snapshot (what a gateway rebuilds its memory of recent
    RENAMEs from). ``workers`` > 1 applies different files in parallel
    (module doc); the target ends the same, and an error still names the record that failed
    (records of other files after it may have been applied).
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, not {workers!r}")
    os.makedirs(target_dir, exist_ok=True)
    r: Replayer | ParallelReplayer = Replayer(target_dir) if workers == 1 else ParallelReplayer(target_dir, workers)
    in_snapshot = snapshot
    try:
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
                if observe is not None:
                    observe(rec)
        finally:
            if isinstance(r, ParallelReplayer):
                r.drain()  # what was handed out is applied before anything is reported
    except JournalCorrupt as e:  # from the records: restore reports what was applied before it
        e.replay_stats = r.stats
        raise
    finally:
        r.close()
    return r.stats
