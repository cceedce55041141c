"""Restore a namespace's tree from the server into an empty directory.

Reads the journal over the protocol (any key: read role is enough), verifies every
record's CRC32C, length, layout and sequence number, picks the generation to start from
and replays it in order up to the requested point:

- default: everything (newest complete generation, to its end);
- ``position=N``: the tree right after record N;
- ``at=TIME``: the tree after every record stamped at or before TIME;
- ``batch=(QUERYDIR, N)``: the tree right after Spark committed batch N of the query whose
  checkpoint directory is QUERYDIR (its path relative to the namespace root, as in the
  ``checkpoint`` field of a ``spark.batch`` marker; "" is the root itself): right after the
  last journal record that makes ``QUERYDIR/commits/N`` exist, see :func:`find_batch`.

Generations that do not form one chain (protocol.md 2.1: one does not continue the one
before it, e.g. a far-future generation published with an append key) raise GenerationBreak
before anything is written; ``generation=G`` restores generation G alone, unchecked. Records
of a newer generation that is not complete are not restored: ``Summary.warnings`` says so.
A corrupt record stops the restore before it (JournalCorrupt names segment and offset).
A namespace without a complete generation raises JournalNotFound; a point the journal does
not hold (before its first record or oldest kept generation, past its last record, a batch
that never committed) raises PositionUnavailable or BatchNotFound. Every error found before
replaying leaves the target untouched (not even created); a position found to lie past the
end once replayed is undone (the target is emptied, and removed if restore created it).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from . import layout
from ._store import Corrupt, SOSNotFound, StoreClient
from .errors import (
    BatchNotFound,
    GenerationBreak,
    JournalCorrupt,
    JournalError,
    JournalNotFound,
    JournalTruncated,
    PositionUnavailable,
    TargetNotEmpty,
)
from .records import (HEADER_SIZE, Create, Delete, Marker, Record, RecordDecoder, Rename, SnapshotEnd, Truncate,
                      Write, peek_header, validate_path)
from .beneath import Beneath
from .replay import replay
from .beneath import clear_directory as _clear

__all__ = ["restore", "rebuild_cache", "Summary", "parse_time", "format_time", "parse_batch", "find_batch",
           "commit_path", "segment_records", "generation_records", "list_generations", "BATCH_LABEL"]

BATCH_LABEL = layout.BATCH_LABEL


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
    stopped: bool = False  # a point was requested and reached (rather than the end of the journal)
    seconds: float = 0.0
    notes: list = field(default_factory=list)
    warnings: list = field(default_factory=list)  # things the caller must hear (the CLI prints them first)

    @property
    def last_time(self) -> str:
        if not self.last_time_ns:
            return "-"
        return format_time(self.last_time_ns)

    def text(self) -> str:
        return (f"restored {self.namespace} into {self.target}: {self.files} files, {self.dirs} dirs, "
                f"{self.bytes} bytes; generation {self.generation}, last record {self.last_seq} "
                f"at {self.last_time}; {self.records} records, {self.bytes_read} journal bytes "
                f"in {self.seconds:.2f}s")


_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.timezone.utc)
_FRACTION = re.compile(r"(\.\d{6})(\d{1,3})")


def parse_time(at: int | str | _dt.datetime | None) -> int | None:
    """ns since the epoch from a datetime, an int (ns) or an ISO-8601 string (naive = UTC;
    up to 9 fractional digits, as :func:`format_time` prints them)."""
    if at is None:
        return None
    if isinstance(at, int):
        return at
    extra_ns = 0
    if isinstance(at, str):
        text = at.strip()
        m = _FRACTION.search(text)
        if m:  # datetime keeps microseconds: carry the nanoseconds ourselves
            extra_ns = int(m.group(2).ljust(3, "0"))
            text = text[:m.start()] + m.group(1) + text[m.end():]
        try:
            at = _dt.datetime.fromisoformat(text)
        except ValueError:
            raise ValueError(f"bad time {at!r}: expected ISO-8601 like 2026-11-23T12:00:00Z") from None
    if isinstance(at, _dt.datetime):
        if at.tzinfo is None:
            at = at.replace(tzinfo=_dt.timezone.utc)
        d = at - _EPOCH  # exact integer arithmetic (a float timestamp loses microseconds)
        return (d.days * 86400 + d.seconds) * 1_000_000_000 + d.microseconds * 1000 + extra_ns
    raise TypeError(f"bad time {at!r}")


def format_time(ns: int) -> str:
    """ISO-8601 UTC with nanoseconds (what ``--at`` accepts back exactly)."""
    s, frac = divmod(ns, 1_000_000_000)
    return (_EPOCH + _dt.timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%S") + f".{frac:09d}Z"


def _norm_dir(p: str) -> str:
    p = p.strip().strip("/")
    while p.startswith("./"):
        p = p[2:].lstrip("/")
    return "" if p == "." else p


def parse_batch(batch: str | tuple[str, int]) -> tuple[str, int]:
    """(querydir, N) from ``"QUERYDIR:N"`` or a tuple. QUERYDIR is the checkpoint directory's
    path relative to the namespace root ("" or "." for the root); N >= 0."""
    raw_n: int | str
    if isinstance(batch, tuple):
        q, raw_n = batch
    elif isinstance(batch, str) and ":" in batch:
        q, _, raw_n = batch.rpartition(":")
    else:
        raise ValueError(f"bad batch {batch!r}: expected QUERYDIR:N")
    try:
        n = int(raw_n)
    except (TypeError, ValueError):
        raise ValueError(f"bad batch {batch!r}: expected QUERYDIR:N with N a batch id >= 0") from None
    if n < 0:
        raise ValueError(f"bad batch {batch!r}: batch ids are >= 0")
    q = _norm_dir(str(q))
    if q:
        try:
            validate_path(q)
        except ValueError:
            raise ValueError(f"bad batch {batch!r}: QUERYDIR must be a path relative to the namespace "
                             f"root without empty, '.' or '..' parts") from None
    return q, n


def list_generations(client: StoreClient) -> dict[int, layout.GenerationInfo]:
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
                       source: Callable[[int, layout.SegmentInfo], Iterator[Record]] | None = None,
                       next_first: int | None = None) -> Iterator[Record]:
    """Every record of a generation in order, with the sequence checks.

    A torn tail of the last, unsealed segment is a write in progress: the stream ends
    before it (noted). So is one of the last segment, sealed or not, when the next
    generation starts with the record that was cut (``next_first``, the first sequence
    number of the generation after ``gen``): a writer died in the middle of that append and
    its successor started the next generation with it (protocol.md 2.3 step 3). Anything
    else that does not decode raises JournalCorrupt. ``source(i, seg)`` gives the decoded
    records of segment i (default: read them with ``client``; restore passes the read-ahead
    of :class:`SegmentReaders`).
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
            cut = expected if expected is not None else seg.first_seq  # the seq the cut record has
            if i == len(segs) - 1 and next_first is not None and next_first == cut:
                if notes is not None:
                    notes.append(f"{seg.name}: abandoned partial record at offset {e.offset} (generation "
                                 f"{gen.generation + 1} starts with record {cut})")
                return
            if i == len(segs) - 1 and not seg.sealed:
                if notes is not None:
                    notes.append(f"{seg.name}: write in progress at offset {e.offset} (ignored)")
                return
            if i < len(segs) - 1 and segs[i + 1].first_seq == cut:
                # A writer died in the middle of an append; the next writer resumed with the
                # record that was cut (same seq) in a new segment: the partial bytes are dead.
                if notes is not None:
                    notes.append(f"{seg.name}: abandoned partial record at offset {e.offset} "
                                 f"(superseded by {segs[i + 1].name})")
                continue
            raise


def generation_end(client, gen: layout.GenerationInfo) -> tuple[int, bool]:
    """(sequence number of the last whole record of ``gen``, exact).

    Reads ``gen``'s last segment (one segment at most). A torn tail is not a record; a
    last segment without a whole record ends the generation at its ``S - 1``. If the server
    reports the segment damaged, or a record does not decode, the answer is the last record
    before the damage and ``exact`` is False.
    """
    if not gen.segments:
        return 0, True
    seg = gen.segments[-1]
    last = None
    dec = RecordDecoder(seg.name)
    try:
        for chunk in read_segment_bytes(client, seg.name):
            dec.feed(chunk)
            for rec in dec:
                last = rec.seq
    except (JournalCorrupt, ServerCorrupt):
        try:
            for rec in dec:  # whole records read before the damage
                last = rec.seq
        except JournalCorrupt:
            pass
        return (last if last is not None else seg.first_seq - 1), False
    return (last if last is not None else seg.first_seq - 1), True


@dataclass
class ChainBreak:
    """One place where the generations present do not form one chain (protocol.md 2.1)."""

    generation: int  # the generation that does not continue the one before it
    previous: int | None  # the generation before it (None: a ready object without segments)
    name: str  # its first object
    reason: str

    def __str__(self) -> str:
        return self.reason


def chain_breaks(client, gens: dict[int, layout.GenerationInfo], *,
                 ends: dict[int, tuple[int, bool]] | None = None) -> list[ChainBreak]:
    """Every break of the chain of generations (protocol.md 2.1): a generation with segments
    whose number is not the previous one's + 1 or that does not start with the record after
    the previous one's last, generation 0, and a ``ready`` object of a generation without
    segments unless it is older than the oldest generation with segments (what retention
    left behind). ``ends`` gives :func:`generation_end` results already known
    (verify's); the others are read, one segment per generation."""
    out: list[ChainBreak] = []
    written = [g for g in gens.values() if g.segments]
    oldest = written[0].generation if written else None
    for g in gens.values():
        if not g.segments and g.ready_object is not None and (oldest is None or g.generation > oldest):
            out.append(ChainBreak(g.generation, None, layout.ready_name(g.generation),
                                  f"generation {g.generation} has a ready object but no segment: no writer "
                                  f"wrote that generation"))
    prev = None
    for g in written:
        if g.generation == 0:
            out.append(ChainBreak(0, None, g.segments[0].name,
                                  "generation 0 holds segments: generation numbers start at 1"))
        if prev is not None:
            end, exact = ends[prev.generation] if ends and prev.generation in ends else generation_end(client, prev)
            if exact or g.generation != prev.generation + 1:
                reason = layout.continues(prev.generation, end, g)
            elif g.segments[0].first_seq <= end:
                # damage hides where the previous generation ended: it holds at least record `end`
                reason = (f"generation {g.generation} does not continue generation {prev.generation}: it starts "
                          f"with record {g.segments[0].first_seq} but generation {prev.generation} holds record {end}")
            else:
                reason = None
            if reason is not None:
                out.append(ChainBreak(g.generation, prev.generation, g.segments[0].name, reason))
        prev = g
    return out


def _next_first(gens: dict[int, layout.GenerationInfo], generation: int) -> int | None:
    """First sequence number of generation ``generation + 1`` if the server holds it (what a
    record cut at the end of ``generation`` may be continued by, protocol.md 2.3 step 3)."""
    g = gens.get(generation + 1)
    return g.first_seq if g is not None and g.segments else None


def _refuse_breaks(breaks: list[ChainBreak]) -> GenerationBreak:
    first = breaks[0]
    more = "; ".join(b.reason for b in breaks[1:])
    return GenerationBreak(
        first.name,
        first.reason + (f"; also: {more}" if more else "")
        + ". Objects under gen/ were written by someone else with an append key, or are damaged: "
          "restore does not guess which side is the journal (`sos verify` lists every break; "
          "--generation G restores one generation without checking the others)",
        generation=first.generation, previous=first.previous or 0)


class _End:
    """The item a segment reader puts after the segment's last batch of records."""


_END = _End()


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
        # per segment: lists of records, then _END (or the exception that stopped the reader)
        self._queues: list[queue.Queue[list[Record] | BaseException | _End]] = [
            queue.Queue(maxsize=max_batches) for _ in segs]
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
            if isinstance(item, _End):
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
    """The generation to replay for a point (None: no complete generation)."""
    cands = _complete(gens)
    if not cands:
        return None
    if position is None and at_ns is None:
        return cands[0]
    first_time = None
    for g in cands:
        if position is not None and g.segments[0].first_seq - 1 <= position:
            return g
        if at_ns is not None:
            first_time = _first_time(client, g.segments[0])
            if first_time is not None and first_time <= at_ns:
                return g
    oldest = cands[-1]
    oldest_first = oldest.segments[0].first_seq
    if position is not None:
        if oldest_first == 1:
            return oldest  # generation 1: the point is before anything was written
        raise PositionUnavailable(f"position {position} is before the oldest generation the server keeps "
                                  f"(generation {oldest.generation} starts after record {oldest_first - 1})")
    when = f"first record at {format_time(first_time)}" if first_time is not None else "no first record"
    if oldest_first == 1:
        raise PositionUnavailable(f"time {format_time(at_ns)} is before the first record of the journal "
                                  f"(generation 1, {when}): nothing was journaled yet")
    raise PositionUnavailable(f"time {format_time(at_ns)} is before the oldest generation the server keeps "
                              f"(generation {oldest.generation}, {when})")


def commit_path(querydir: str, batch_id: int) -> str:
    """``QUERYDIR/commits/N``: the file whose appearance commits batch N (Spark's commit log)."""
    return f"{querydir}/commits/{batch_id}" if querydir else f"commits/{batch_id}"


def _commit_of(path: str):
    """(querydir, batch id) if ``path`` is a Spark commit-log file ``[Q/]commits/N``, else None."""
    parent, _, name = path.rpartition("/")
    if not name.isdigit() or not name.isascii():
        return None
    if parent == "commits":
        return "", int(name)
    if parent.endswith("/commits"):
        return parent[:-len("/commits")], int(name)
    return None


@dataclass
class _CommitScan:
    """What one generation says about ``P = Q/commits/N`` (and its checksum ``Q/commits/.N.crc``).

    Only journal records count (a snapshot re-creates the tree, it does not commit anything).
    ``start``: the last record that makes P exist (RENAME onto P, or CREATE of P); ``stop``:
    that record or the last later record that completes the same file (WRITE/TRUNCATE of P;
    RENAME onto, CREATE, WRITE or TRUNCATE of its ``.crc``; DELETE of the renamed temp
    file's ``.crc``, which Spark removes instead, HADOOP-16255), before anything replaces or
    removes P; ``open``: that incarnation of P is still there at the generation's end.
    ``head_ext``/``head_closed``: completing records before the first record that makes,
    replaces or removes P (they continue an incarnation from the previous generation).
    """

    start: int | None = None
    stop: int | None = None
    open: bool = False
    head_ext: int | None = None
    head_closed: bool = False
    in_snapshot: bool = False  # P exists in this generation's snapshot
    tmp_crc: str | None = None  # checksum file of the temp file renamed onto P


def _scan_generation(records, path: str, crc: str, seen: dict, r: _CommitScan) -> _CommitScan:
    in_snap = True
    for rec in records:
        op = rec.op
        t = type(op)
        if in_snap:
            if t is SnapshotEnd:
                in_snap = False
            elif t is Create:
                if op.path == path:
                    r.in_snapshot = True
                c = _commit_of(op.path)
                if c is not None:
                    seen.setdefault(c[0], set()).add(c[1])
            continue
        if t is Marker:
            if op.label == BATCH_LABEL:
                try:
                    info = json.loads(op.payload)
                    seen.setdefault(_norm_dir(str(info["checkpoint"])), set()).add(int(info["batch_id"]))
                except (ValueError, TypeError, KeyError, AttributeError):
                    pass
            continue
        if t is Rename:
            made = op.dst
        elif t is Create:
            made = op.path
        else:
            made = None
        if made is not None:
            c = _commit_of(made)
            if c is not None:
                seen.setdefault(c[0], set()).add(c[1])
        if made == path:
            r.start = r.stop = rec.seq
            r.open = True
            r.head_closed = True
            if t is Rename:
                d, _, name = op.src.rpartition("/")
                r.tmp_crc = f"{d}/.{name}.crc" if d else f".{name}.crc"
        elif ((t is Rename and (op.src == path or path.startswith(op.src + "/")
                                or path.startswith(op.dst + "/")))
              or (t is Delete and op.path == path)):
            r.open = False  # P moved away, replaced by a directory rename, or deleted
            r.head_closed = True
        elif ((t is Write or t is Truncate) and (op.path == path or op.path == crc)) or (
                (t is Create and op.path == crc) or (t is Rename and op.dst == crc)) or (
                t is Delete and op.path == r.tmp_crc):
            if r.open:
                r.stop = rec.seq
            elif not r.head_closed:
                r.head_ext = rec.seq
    return r


def _ranges(ids) -> str:
    ids = sorted(ids)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}..{ids[j]}")
        i = j + 1
    return ", ".join(out)


def find_batch(client, gens, querydir: str, batch_id: int, *, on_bytes=None, notes=None,
               listed: dict[int, layout.GenerationInfo] | None = None) -> int:
    """The position right after batch ``batch_id`` of the checkpoint ``querydir`` committed.

    That is the sequence number of the last journal record that makes
    ``querydir/commits/batch_id`` exist (Spark's commit log renames a temp file onto it; a
    direct CREATE counts too), moved past the records that complete that same file (its
    WRITEs if it was written in place; the RENAME of its ``.N.crc`` checksum file, or the
    DELETE of the temp file's checksum file). The
    last such commit wins. ``spark.batch`` markers play no part in the position: they are
    written after the commit, asynchronously, possibly after later batches committed.
    Raises BatchNotFound (naming the checkpoints and batches the journal does hold) or
    PositionUnavailable (the batch committed before the oldest generation kept).
    """
    path = commit_path(querydir, batch_id)
    crc = path.rpartition("/")[0] + f"/.{batch_id}.crc"
    seen: dict = {}
    newer: list[_CommitScan] = []  # newest first
    cands = _complete(gens)
    for g in cands:
        r = _CommitScan()
        try:
            _scan_generation(generation_records(client, g, on_bytes=on_bytes,
                                                next_first=_next_first(listed or gens, g.generation)),
                             path, crc, seen, r)
        except JournalCorrupt as e:
            if r.start is None:
                raise
            # the batch committed before the damage: the replay stops before it too
            r.open = False
            if notes is not None:
                notes.append(f"the journal is corrupt after batch {batch_id} committed ({e}); a later "
                             f"commit of the same batch would be behind it")
        if r.start is not None:
            stop = r.start if r.stop is None else r.stop
            if r.open:  # the file may be completed in the next generation(s)
                for nr in reversed(newer):
                    if nr.head_ext is not None:
                        stop = nr.head_ext
                    if nr.head_closed:
                        break
            if notes is not None:
                notes.append(f"batch {batch_id} of checkpoint {querydir or '.'!r}: {path} appears at record "
                             f"{r.start}" + (f", complete at record {stop}" if stop != r.start else "")
                             + f"; restored to position {stop}")
            return stop
        newer.append(r)
    # Not in a complete generation: a commit in a newer, incomplete one was never reported
    # durable (protocol.md 2.1) and restore does not use it. Say so rather than "no batch".
    for g in _incomplete_after(gens, cands[0].generation if cands else -1):
        r = _CommitScan()
        try:
            _scan_generation(generation_records(client, g, on_bytes=on_bytes), path, crc, {}, r)
        except JournalCorrupt:
            pass
        if r.start is not None:
            raise BatchNotFound(
                f"batch {batch_id} of checkpoint {querydir or '.'!r}: {path} appears at record {r.start}, in "
                f"generation {g.generation}, which is not complete "
                f"({g.ready_problem or 'no ' + layout.ready_name(g.generation)}): a writer reports no record "
                f"of a generation durable before its ready object exists, and restore does not use it")
    if any(r.in_snapshot for r in newer):
        oldest = cands[-1]
        raise PositionUnavailable(
            f"batch {batch_id} of checkpoint {querydir or '.'!r} committed before the oldest generation the "
            f"server keeps (generation {oldest.generation} starts after record {oldest.segments[0].first_seq - 1} and "
            f"already holds {path}): the state right after that batch is gone")
    if querydir in seen:
        raise BatchNotFound(f"checkpoint {querydir or '.'!r} has no {path} in the journal the server keeps "
                            f"(its batches: {_ranges(seen[querydir])})")
    known = ", ".join(repr(q or ".") for q in sorted(seen)) or "none"
    raise BatchNotFound(f"no checkpoint {querydir or '.'!r} in this namespace's journal: no {path} "
                        f"(checkpoints found: {known}; QUERYDIR is the checkpoint's path relative to "
                        f"the namespace root)")


def _through(records, position: int):
    """The records up to ``position`` (the whole snapshot at least), without reading the next
    one: a corrupt record right after the point must not fail a restore that stops before it."""
    in_snapshot = True
    for rec in records:
        yield rec
        if type(rec.op) is SnapshotEnd:
            in_snapshot = False
        if not in_snapshot and rec.seq >= position:
            return


def _check_target(target: str, force: bool) -> None:
    """Refuse an unusable target before anything is read or written."""
    if os.path.exists(target) and not os.path.isdir(target):
        raise NotADirectoryError(f"restore target {target} is not a directory")
    if os.path.isdir(target) and not force:
        n = len(os.listdir(target))
        if n:
            raise TargetNotEmpty(f"restore target {target} is not empty ({n} entries); "
                                 f"use force (--force) to replace its contents")


def _prepare_target(target: str, force: bool) -> None:
    _check_target(target, force)
    os.makedirs(target, exist_ok=True)
    _clear(target)


def _no_journal(namespace: str, gens) -> JournalNotFound:
    if not gens:
        return JournalNotFound(namespace, f"namespace {namespace!r} has no journal (no objects under gen/): "
                                          f"nothing to restore; check the namespace and the server")
    return JournalNotFound(namespace, f"namespace {namespace!r} has no complete generation "
                                      f"({len(gens)} incomplete: its first snapshot never finished): "
                                      f"nothing to restore")


def _count(target: str, summary: Summary) -> None:
    """Files, directories and bytes under ``target`` (no recursion, no link followed)."""
    with Beneath(target) as at:
        for _d, dirs, entries in at.walk():
            summary.dirs += len(dirs)
            for _name, st in entries:
                summary.files += 1
                summary.bytes += st.st_size


def _incomplete_after(gens, generation: int) -> list[layout.GenerationInfo]:
    """Generations newer than ``generation`` that hold records but are not complete."""
    return [g for g in gens.values() if g.generation > generation and not g.ready and g.total_bytes]


def _unused_text(g: layout.GenerationInfo) -> str:
    why = g.ready_problem or f"no {layout.ready_name(g.generation)}"
    return (f"generation {g.generation} is not complete ({why}): restore does not use its {g.total_bytes} "
            f"bytes of records from record {g.first_seq} on. A writer reports no record of a generation "
            f"durable before its ready object exists: it is starting that generation, or it stopped first")


def restore(client_factory: Callable[[], StoreClient], namespace: str, target: str, *,
            at: int | str | _dt.datetime | None = None, position: int | None = None,
            batch: str | tuple[str, int] | None = None, force: bool = False,
            progress: Callable[[int, int], None] | None = None, generation: int | None = None) -> Summary:
    """Rebuild the tree of ``namespace`` in the empty directory ``target``; see module doc.

    The generations on the server must form one chain (protocol.md 2.1), else GenerationBreak
    (before the target is touched). ``generation=G`` restores from generation G alone (its
    end, or a point inside it) without reading or checking the other generations: the way
    out after a break, once ``sos verify`` has shown which generations are the journal.

    ``progress(done_bytes, total_bytes)`` is called as journal bytes arrive (from reader
    threads; a ``batch`` restore first scans the journal for the batch, then replays: two
    passes, each starting from 0).
    Raises TargetNotEmpty, JournalNotFound, BatchNotFound, PositionUnavailable (all before
    the target is touched, except a position past the end: what was written is undone) and
    JournalCorrupt (after applying everything before the broken record; ``exc.summary``
    tells what was restored).
    """
    if sum(x is not None for x in (at, position, batch)) > 1:
        raise ValueError("give at most one of at, position, batch")
    if position is not None and (not isinstance(position, int) or position < 0):
        raise ValueError(f"bad position {position!r}")
    if generation is not None and (not isinstance(generation, int) or generation < 0):
        raise ValueError(f"bad generation {generation!r}")
    at_ns = parse_time(at)
    bq = parse_batch(batch) if batch is not None else None
    target = os.path.abspath(target)
    _check_target(target, force)
    summary = Summary(namespace, target)
    t0 = time.monotonic()
    client = client_factory()
    try:
        listed = list_generations(client)
        if generation is not None:
            g = listed.get(generation)
            if g is None or not g.segments or not g.ready:
                why = ("not on the server" if g is None or not g.segments
                       else f"not complete ({g.ready_problem or 'no ready object'})")
                raise JournalNotFound(namespace, f"namespace {namespace!r}: generation {generation} is {why}: "
                                                 f"nothing to restore")
            gens = {generation: g}
            summary.warnings.append(f"restoring generation {generation} alone (--generation): the other "
                                    f"generations were neither read nor checked")
        else:
            breaks = chain_breaks(client, listed)
            if breaks:
                raise _refuse_breaks(breaks)
            gens = listed
        if not _complete(gens):
            raise _no_journal(namespace, gens)
        done = [0]
        total = [0]
        lock = threading.Lock()

        def on_bytes(n):
            with lock:  # progress sees done grow (the reader threads would otherwise race)
                done[0] += n
                summary.bytes_read += n
                if progress is not None:
                    progress(done[0], total[0])

        if bq is not None:
            total[0] = sum(g.total_bytes for g in _complete(gens))  # at most: the scan may stop sooner
            position = find_batch(client, gens, bq[0], bq[1], on_bytes=on_bytes, notes=summary.notes,
                                  listed=listed)
            done[0] = 0
        gen = choose_generation(client, gens, position=position, at_ns=at_ns)
        if gen is None:  # not reached: _complete(gens) was checked above
            raise _no_journal(namespace, gens)
        created = not os.path.exists(target)
        _prepare_target(target, force)
        summary.generation = gen.generation
        total[0] = gen.total_bytes
        if progress is not None:
            progress(0, total[0])
        stop: Callable[[Record], bool] | None = None
        if position is not None:
            def stop(rec: Record, _p: int = position) -> bool:
                return rec.seq > _p
        elif at_ns is not None:
            def stop(rec: Record, _t: int = at_ns) -> bool:
                return rec.time_ns > _t
        try:
            readers = SegmentReaders(client_factory, gen.segments, readers=2, on_bytes=on_bytes)
            try:
                records = generation_records(client, gen, notes=summary.notes, source=readers.records,
                                             next_first=_next_first(listed, gen.generation))
                if position is not None:
                    records = _through(records, position)
                stats = replay(records, target, stop=stop, snapshot=True)
            finally:
                readers.close()
        except JournalCorrupt as e:
            st = e.replay_stats
            if st is not None:
                summary.records, summary.last_seq, summary.last_time_ns = st.records, st.last_seq, st.last_time_ns
            summary.seconds = time.monotonic() - t0
            _count(target, summary)
            e.summary = summary
            raise
        if not stats.snapshot_done:
            raise JournalCorrupt(gen.segments[-1].name, 0,
                                 f"generation {gen.generation} is marked ready but has no SNAPSHOT_END")
        if position is not None and not stats.stopped and stats.last_seq < position:
            if gen is _complete(gens)[0]:
                _clear(target)  # a point the journal does not reach: leave nothing half-meant behind
                if created:
                    os.rmdir(target)
                unused = "".join(f"; {_unused_text(g)}" for g in _incomplete_after(gens, gen.generation))
                raise PositionUnavailable(f"position {position} is past the end of the journal: the last "
                                          f"record is {stats.last_seq} (at {format_time(stats.last_time_ns)})"
                                          + unused)
            summary.notes.append(f"position {position} is in a range of records no complete generation "
                                 f"holds (a generation abandoned before its snapshot was done): restored "
                                 f"the end of generation {gen.generation}, record {stats.last_seq}")
        if gen is _complete(gens)[0] and position is None and not stats.stopped:
            summary.warnings.extend(_unused_text(g) for g in _incomplete_after(gens, gen.generation))
        summary.records = stats.records
        summary.last_seq = stats.last_seq
        summary.last_time_ns = stats.last_time_ns
        summary.stopped = stats.stopped or (position is not None and stats.last_seq >= position)
    finally:
        try:
            client.close()
        except Exception:  # noqa: BLE001
            pass
    summary.seconds = time.monotonic() - t0
    _count(target, summary)
    return summary


def rebuild_cache(client_factory: Callable[[], StoreClient], namespace: str, cache_dir: str) -> int:
    """Fill a cache directory with the namespace's latest tree (replacing what it holds);
    returns the last seq, 0 for a namespace without a complete generation (empty tree)."""
    try:
        return restore(client_factory, namespace, cache_dir, force=True).last_seq
    except (SOSNotFound, JournalNotFound):
        _prepare_target(os.path.abspath(cache_dir), True)
        return 0
