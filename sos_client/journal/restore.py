"""Restore a namespace's tree from the server into an empty directory.

Reads the journal over the protocol (any key: read role is enough), verifies every
record's CRC32C, length, layout and sequence number, picks the generation to start from
and replays it in order up to the requested point:

- default: everything (newest complete generation, to its end);
- ``position=N``: the tree right after record N;
- ``at=TIME``: the tree after every record stamped at or before TIME;
- ``batch=(QUERYDIR, N)``: the tree right after the MARKER ``spark.batch`` whose JSON payload
  has ``checkpoint == QUERYDIR`` and ``batch_id == N`` (the last such marker).

A corrupt record stops the restore before it (JournalCorrupt names segment and offset).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from . import layout
from ._store import Corrupt, SOSNotFound
from .errors import (
    BatchNotFound,
    JournalCorrupt,
    JournalError,
    JournalTruncated,
    PositionUnavailable,
    TargetNotEmpty,
)
from .records import HEADER_SIZE, Marker, Record, RecordDecoder, SnapshotEnd, peek_header
from .replay import replay

__all__ = ["restore", "rebuild_cache", "Summary", "parse_time", "parse_batch", "segment_records",
           "generation_records", "list_generations", "BATCH_LABEL"]

BATCH_LABEL = "spark.batch"


@dataclass
class Summary:
    namespace: str
    target: str
    generation: int = 0
    files: int = 0
    dirs: int = 0
    bytes: int = 0  # total size of the restored files
    records: int = 0  # records applied (snapshot included)
    last_seq: int = 0
    last_time_ns: int = 0
    bytes_read: int = 0  # journal bytes read from the server
    stopped: bool = False  # stopped at the requested point (not at the end of the journal)
    seconds: float = 0.0
    notes: list = field(default_factory=list)

    @property
    def last_time(self) -> str:
        if not self.last_time_ns:
            return "-"
        return _dt.datetime.fromtimestamp(self.last_time_ns / 1e9, _dt.timezone.utc).isoformat()

    def text(self) -> str:
        return (f"restored {self.namespace} into {self.target}: {self.files} files, {self.dirs} dirs, "
                f"{self.bytes} bytes; generation {self.generation}, last record {self.last_seq} "
                f"at {self.last_time}; {self.records} records, {self.bytes_read} journal bytes "
                f"in {self.seconds:.2f}s")


def parse_time(at) -> int | None:
    """ns since the epoch from a datetime, an int (ns) or an ISO-8601 string (naive = UTC)."""
    if at is None:
        return None
    if isinstance(at, int):
        return at
    if isinstance(at, str):
        try:
            at = _dt.datetime.fromisoformat(at.strip())
        except ValueError:
            raise ValueError(f"bad time {at!r}: expected ISO-8601 like 2026-11-23T12:00:00Z") from None
    if isinstance(at, _dt.datetime):
        if at.tzinfo is None:
            at = at.replace(tzinfo=_dt.timezone.utc)
        return int(at.timestamp() * 1_000_000) * 1000
    raise TypeError(f"bad time {at!r}")


def _norm_dir(p: str) -> str:
    p = p.strip().strip("/")
    while p.startswith("./"):
        p = p[2:]
    return p


def parse_batch(batch) -> tuple[str, int]:
    if isinstance(batch, tuple):
        q, n = batch
        return _norm_dir(q), int(n)
    if isinstance(batch, str) and ":" in batch:
        q, _, n = batch.rpartition(":")
        try:
            return _norm_dir(q), int(n)
        except ValueError:
            pass
    raise ValueError(f"bad batch {batch!r}: expected QUERYDIR:N")


def list_generations(client) -> dict[int, layout.GenerationInfo]:
    return layout.scan_listing(client.list(layout.GEN_PREFIX))


class ServerCorrupt(Exception):
    """The server refused to read stored bytes (they failed its checksum) from ``offset``."""

    def __init__(self, offset: int, message: str):
        self.offset = offset
        self.message = message
        super().__init__(message)


def _readable_prefix(client, name: str, start: int, limit: int) -> int:
    """Largest n <= limit such that the server serves [start, start+n) (binary search)."""

    def ok(n):
        try:
            for _ in client.read_iter(name, start, n):
                pass
            return True
        except Corrupt:
            return False

    lo, hi = 0, limit + 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def read_segment_bytes(client, name: str, offset: int = 0, *, salvage_limit: int = 8 << 20):
    """Chunks of a segment from ``offset`` to its end. If the server reports stored data
    corrupt, the readable bytes before the damage are still yielded, then ServerCorrupt."""
    pos = offset
    try:
        for chunk in client.read_iter(name, pos, 0):
            pos += len(chunk)
            yield chunk
    except Corrupt as e:
        n = _readable_prefix(client, name, pos, salvage_limit)
        if n:
            for chunk in client.read_iter(name, pos, n):
                pos += len(chunk)
                yield chunk
        raise ServerCorrupt(pos, f"server reports stored data corrupt: {e}") from e


def segment_records(client, seg: layout.SegmentInfo, *, on_bytes: Callable[[int], None] | None = None
                    ) -> Iterator[Record]:
    """Decoded records of one segment. Raises JournalCorrupt (server-side corruption too) or
    JournalTruncated if the segment ends inside a record."""
    dec = RecordDecoder(seg.name)
    try:
        for chunk in read_segment_bytes(client, seg.name):
            dec.feed(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
            yield from dec
    except ServerCorrupt as e:
        yield from dec
        raise JournalCorrupt(seg.name, dec.offset, f"{e.message} (from offset {e.offset})") from e
    if dec.pending:
        raise JournalTruncated(seg.name, dec.offset, f"segment ends inside a record ({dec.pending} bytes)")


def generation_records(client, gen: layout.GenerationInfo, *, on_bytes=None, notes=None,
                       source: Callable[[int, layout.SegmentInfo], Iterator[Record]] | None = None
                       ) -> Iterator[Record]:
    """Every record of a generation in order, with the sequence checks.

    A torn tail of the last, unsealed segment is a write in progress: the stream ends
    before it (noted). Anything else that does not decode raises JournalCorrupt.
    ``source(i, seg)`` gives the decoded records of segment i (default: read them with
    ``client``; restore passes the read-ahead of :class:`SegmentReaders`).
    """
    if source is None:
        def source(_i, seg):
            return segment_records(client, seg, on_bytes=on_bytes)
    expected = None
    segs = gen.segments
    for i, seg in enumerate(segs):
        first = True
        try:
            for rec in source(i, seg):
                if first:
                    first = False
                    if rec.seq != seg.first_seq:
                        raise JournalCorrupt(seg.name, rec.offset, f"first record has seq {rec.seq} but the "
                                                                   f"segment name says {seg.first_seq}")
                if expected is not None and rec.seq != expected:
                    raise JournalCorrupt(seg.name, rec.offset,
                                         f"sequence gap: expected record {expected}, found {rec.seq}")
                if type(rec.op) is SnapshotEnd and rec.op.generation != gen.generation:
                    raise JournalCorrupt(seg.name, rec.offset, f"SNAPSHOT_END of generation "
                                                               f"{rec.op.generation} inside generation {gen.generation}")
                expected = rec.seq + 1
                yield rec
        except JournalTruncated as e:
            if i == len(segs) - 1 and not seg.sealed:
                if notes is not None:
                    notes.append(f"{seg.name}: write in progress at offset {e.offset} (ignored)")
                return
            if i < len(segs) - 1 and segs[i + 1].first_seq == (expected if expected is not None
                                                                 else seg.first_seq):
                # A writer died in the middle of an append; the next writer resumed with the
                # record that was cut (same seq) in a new segment: the partial bytes are dead.
                if notes is not None:
                    notes.append(f"{seg.name}: abandoned partial record at offset {e.offset} "
                                 f"(superseded by {segs[i + 1].name})")
                continue
            raise


_END = object()


class SegmentReaders:
    """Read-ahead of a generation's segments over ``readers`` connections of their own.

    Reader threads take segments in order; each reads and decodes its segment (CRC checks
    included) into that segment's bounded queue (``max_batches`` batches of about
    ``batch_bytes``), so memory stays below readers * max_batches * batch_bytes while the
    consumer applies records strictly in order. Exceptions reach the consumer in order.
    """

    def __init__(self, client_factory, segs, *, readers: int = 2, on_bytes=None, max_batches: int = 2,
                 batch_bytes: int = 2 << 20):
        import queue
        import threading

        self._segs = segs
        self._queues = [queue.Queue(maxsize=max_batches) for _ in segs]
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._factory = client_factory
        self._on_bytes = on_bytes
        self._batch_bytes = batch_bytes
        self._threads = [threading.Thread(target=self._work, name=f"sos-restore-reader-{k}", daemon=True)
                         for k in range(max(1, min(readers, len(segs))))]
        for th in self._threads:
            th.start()

    def _put(self, q, item) -> bool:
        import queue

        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        client = None
        try:
            while not self._stop.is_set():
                with self._lock:
                    i = self._next
                    self._next += 1
                if i >= len(self._segs):
                    return
                q = self._queues[i]
                batch, size = [], 0
                try:
                    if client is None:
                        client = self._factory()
                    for rec in segment_records(client, self._segs[i], on_bytes=self._on_bytes):
                        batch.append(rec)
                        size += rec.size
                        if size >= self._batch_bytes or len(batch) >= 4096:
                            if not self._put(q, batch):
                                return
                            batch, size = [], 0
                    if batch and not self._put(q, batch):
                        return
                    self._put(q, _END)
                except BaseException as e:  # noqa: BLE001 - handed to the consumer, in order
                    if batch and not self._put(q, batch):
                        return
                    self._put(q, e)
                    if client is not None and not isinstance(e, JournalCorrupt):
                        try:
                            client.close()
                        except Exception:  # noqa: BLE001
                            pass
                        client = None
        finally:
            if client is not None:
                try:
                    client.close()
                except Exception:  # noqa: BLE001
                    pass

    def records(self, i: int, seg) -> Iterator[Record]:
        import queue

        q = self._queues[i]
        while True:
            try:
                item = q.get(timeout=1.0)
            except queue.Empty:
                if not any(th.is_alive() for th in self._threads):
                    raise JournalError(f"restore readers stopped before segment {seg.name}") from None
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield from item

    def close(self) -> None:
        self._stop.set()
        for th in self._threads:
            th.join(timeout=120)


def _first_time(client, seg: layout.SegmentInfo) -> int | None:
    head = b"".join(client.read_iter(seg.name, 0, HEADER_SIZE))
    if len(head) < HEADER_SIZE:
        return None
    return peek_header(head)[3]


def _complete(gens) -> list[layout.GenerationInfo]:
    return sorted((g for g in gens.values() if g.ready and g.segments), key=lambda g: -g.generation)


def choose_generation(client, gens, *, position=None, at_ns=None) -> layout.GenerationInfo | None:
    cands = _complete(gens)
    if not cands:
        return None
    if position is None and at_ns is None:
        return cands[0]
    for g in cands:
        if position is not None and g.first_seq - 1 <= position:
            return g
        if at_ns is not None:
            t = _first_time(client, g.segments[0])
            if t is not None and t <= at_ns:
                return g
    if cands[-1].first_seq == 1:
        return cands[-1]  # generation 1: the point is before anything was written
    what = f"position {position}" if position is not None else f"time {at_ns} ns"
    raise PositionUnavailable(f"{what} is before the oldest generation the server keeps "
                              f"(generation {cands[-1].generation} starts after record {cands[-1].first_seq - 1})")


def find_batch(client, gens, querydir: str, batch_id: int, *, on_bytes=None) -> int:
    """Sequence number of the last ``spark.batch`` MARKER for (querydir, batch_id)."""
    for g in _complete(gens):
        found = None
        for rec in generation_records(client, g, on_bytes=on_bytes):
            op = rec.op
            if type(op) is Marker and op.label == BATCH_LABEL:
                try:
                    info = json.loads(op.payload)
                    if (_norm_dir(str(info.get("checkpoint", ""))) == querydir
                            and int(info.get("batch_id")) == batch_id):
                        found = rec.seq
                except (ValueError, TypeError, AttributeError):
                    continue
        if found is not None:
            return found
    raise BatchNotFound(f"no {BATCH_LABEL} marker for checkpoint {querydir!r} batch {batch_id}")


def _prepare_target(target: str, force: bool) -> None:
    if os.path.exists(target) and not os.path.isdir(target):
        raise NotADirectoryError(f"restore target {target} is not a directory")
    os.makedirs(target, exist_ok=True)
    entries = os.listdir(target)
    if entries and not force:
        raise TargetNotEmpty(f"restore target {target} is not empty ({len(entries)} entries); "
                             f"use force to replace its contents")
    for name in entries:
        p = os.path.join(target, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)


def _count(target: str, summary: Summary) -> None:
    for dirpath, dirnames, filenames in os.walk(target):
        summary.dirs += len(dirnames)
        for f in filenames:
            summary.files += 1
            try:
                summary.bytes += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:  # pragma: no cover
                pass


def restore(client_factory, namespace: str, target: str, *, at=None, position: int | None = None,
            batch=None, force: bool = False, progress: Callable[[int, int], None] | None = None) -> Summary:
    """Rebuild the tree of ``namespace`` in the empty directory ``target``; see module doc.

    ``progress(done_bytes, total_bytes)`` is called as journal bytes arrive.
    Raises TargetNotEmpty, JournalCorrupt (after applying everything before the broken
    record; ``exc.summary`` tells what was restored), BatchNotFound, PositionUnavailable.
    """
    if sum(x is not None for x in (at, position, batch)) > 1:
        raise ValueError("give at most one of at, position, batch")
    if position is not None and (not isinstance(position, int) or position < 0):
        raise ValueError(f"bad position {position!r}")
    at_ns = parse_time(at)
    bq = parse_batch(batch) if batch is not None else None
    target = os.path.abspath(target)
    _prepare_target(target, force)
    summary = Summary(namespace, target)
    t0 = time.monotonic()
    client = client_factory()
    try:
        gens = list_generations(client)
        done = [0]
        total = [0]
        lock = threading.Lock()

        def on_bytes(n):
            with lock:
                done[0] += n
                summary.bytes_read += n
                d = done[0]
            if progress is not None:
                progress(d, total[0])

        if bq is not None:
            total[0] = sum(g.total_bytes for g in _complete(gens)[:1])
            position = find_batch(client, gens, bq[0], bq[1], on_bytes=on_bytes)
            done[0] = 0
        gen = choose_generation(client, gens, position=position, at_ns=at_ns)
        if gen is None:
            summary.notes.append("namespace has no complete generation: nothing to restore")
            summary.seconds = time.monotonic() - t0
            return summary
        summary.generation = gen.generation
        total[0] = gen.total_bytes
        if progress is not None:
            progress(0, total[0])
        if position is not None:
            def stop(rec, _p=position):
                return rec.seq > _p
        elif at_ns is not None:
            def stop(rec, _t=at_ns):
                return rec.time_ns > _t
        else:
            stop = None
        try:
            readers = SegmentReaders(client_factory, gen.segments, readers=2, on_bytes=on_bytes)
            try:
                stats = replay(generation_records(client, gen, notes=summary.notes, source=readers.records),
                               target, stop=stop, snapshot=True)
            finally:
                readers.close()
        except JournalCorrupt as e:
            st = getattr(e, "replay_stats", None)
            if st is not None:
                summary.records, summary.last_seq, summary.last_time_ns = st.records, st.last_seq, st.last_time_ns
            summary.seconds = time.monotonic() - t0
            _count(target, summary)
            e.summary = summary
            raise
        if not stats.snapshot_done:
            raise JournalCorrupt(gen.segments[-1].name, 0,
                                 f"generation {gen.generation} is marked ready but has no SNAPSHOT_END")
        summary.records = stats.records
        summary.last_seq = stats.last_seq
        summary.last_time_ns = stats.last_time_ns
        summary.stopped = stats.stopped
    finally:
        try:
            client.close()
        except Exception:  # noqa: BLE001
            pass
    summary.seconds = time.monotonic() - t0
    _count(target, summary)
    return summary


def rebuild_cache(client_factory, namespace: str, cache_dir: str) -> int:
    """Fill an empty cache directory with the namespace's latest tree; returns the last seq."""
    try:
        return restore(client_factory, namespace, cache_dir, force=True).last_seq
    except SOSNotFound:
        return 0
