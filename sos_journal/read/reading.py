"""Reading a journal from the server (or a tier bucket: ``bucket.BucketClient``): the
generations a namespace holds, segments read with salvage of a damaged tail, records decoded in order with read-ahead threads
(``SegmentReaders``), the generation chain check (protocol.md 2.1) and the choice of the
generation a restore starts from. Used by restore, verify and the writer."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sos_journal.errors import (
    GenerationBreak,
    JournalCorrupt,
    JournalError,
    JournalTruncated,
    PositionUnavailable,
)
from sos_journal.format import layout
from sos_journal.format.auth import ChainCheck
from sos_journal.format.records import HEADER_SIZE, Record, RecordDecoder, SnapshotEnd, peek_header
from sos_journal.stats import format_time
from sos_journal.store import Corrupt, StoreClient, close_quietly
from sos_wire.events import Payload


def list_generations(client: StoreClient) -> dict[int, layout.GenerationInfo]:
    return layout.scan_listing(client.list(layout.GEN_PREFIX))


class ServerCorrupt(Exception):
    """The server refused to read stored bytes (they failed its checksum) from ``offset``."""

    def __init__(self, offset: int, message: str) -> None:
        self.offset = offset
        self.message = message
        super().__init__(message)


def _readable_prefix(client: StoreClient, name: str, start: int, limit: int) -> int:
    """Largest n <= limit such that the server serves [start, start+n) (binary search)."""

    def ok(n: int) -> bool:
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


def read_segment_bytes(
    client: StoreClient, name: str, offset: int = 0, *, salvage_limit: int = 8 << 20
) -> Iterator[Payload]:
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
        # a bucket's reader (bucket.py) says itself what it does not hold whole, by key
        why = str(e) if getattr(e, "complete_message", False) else f"server reports stored data corrupt: {e}"
        raise ServerCorrupt(pos, why) from e


def segment_records(
    client: StoreClient,
    seg: layout.SegmentInfo,
    *,
    on_bytes: Callable[[int], None] | None = None,
    keys: Any = None,
) -> Iterator[Record]:
    """Decoded records of one segment. Raises JournalCorrupt (server-side corruption too) or
    JournalTruncated if the segment ends inside a record. ``keys``: the journal key ring's
    (auth.SegmentKeys): authenticated records carry their MAC so far, for a ChainCheck, and
    encrypted ones are opened."""
    dec = RecordDecoder(seg.name, keys=keys)
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


def generation_records(
    client: StoreClient,
    gen: layout.GenerationInfo,
    *,
    on_bytes: Callable[[int], None] | None = None,
    notes: list[str] | None = None,
    source: Callable[[int, layout.SegmentInfo], Iterator[Record]] | None = None,
    next_first: int | None = None,
    check: ChainCheck | None = None,
) -> Iterator[Record]:
    """Every record of a generation in order, with the sequence checks and the journal key's
    (``check``, a :class:`~.auth.ChainCheck` of this generation; default: without a key, so an
    authenticated journal is refused with JournalKeyRequired: protocol.md 2.5).

    A torn tail of the last, unsealed segment is a write in progress: the stream ends
    before it (noted). So is one of the last segment, sealed or not, when the next
    generation starts with the record that was cut (``next_first``, the first sequence
    number of the generation after ``gen``): a writer died in the middle of that append and
    its successor started the next generation with it (protocol.md 2.3 step 3). Anything
    else that does not decode raises JournalCorrupt. ``source(i, seg)`` gives the decoded
    records of segment i (default: read them with ``client``; restore passes the read-ahead
    of :class:`SegmentReaders`).
    """
    auth = check if check is not None else ChainCheck(None, "", gen.generation)
    auth.generation = gen.generation
    if source is None:

        def source(_i: int, seg: layout.SegmentInfo) -> Iterator[Record]:
            return segment_records(client, seg, on_bytes=on_bytes, keys=auth.for_segment(seg.name))

    expected = None
    segs = gen.segments
    for i, seg in enumerate(segs):
        first = True
        try:
            for rec in source(i, seg):
                if first:
                    first = False
                    if rec.seq != seg.first_seq:
                        raise JournalCorrupt(
                            seg.name,
                            rec.offset,
                            f"first record has seq {rec.seq} but the segment name says {seg.first_seq}",
                        )
                if expected is not None and rec.seq != expected:
                    raise JournalCorrupt(
                        seg.name, rec.offset, f"sequence gap: expected record {expected}, found {rec.seq}"
                    )
                if type(rec.op) is SnapshotEnd and rec.op.generation != gen.generation:
                    raise JournalCorrupt(
                        seg.name,
                        rec.offset,
                        f"SNAPSHOT_END of generation {rec.op.generation} inside generation {gen.generation}",
                    )
                auth.check(rec)
                expected = rec.seq + 1
                yield rec
        except JournalTruncated as e:
            cut = expected if expected is not None else seg.first_seq  # the seq the cut record has
            if i == len(segs) - 1 and next_first is not None and next_first == cut:
                if notes is not None:
                    notes.append(
                        f"{seg.name}: abandoned partial record at offset {e.offset} (generation "
                        f"{gen.generation + 1} starts with record {cut})"
                    )
                return
            if i == len(segs) - 1 and not seg.sealed:
                if notes is not None:
                    notes.append(f"{seg.name}: write in progress at offset {e.offset} (ignored)")
                return
            if i < len(segs) - 1 and segs[i + 1].first_seq == cut:
                # A writer died in the middle of an append; the next writer resumed with the
                # record that was cut (same seq) in a new segment: the partial bytes are dead.
                if notes is not None:
                    notes.append(
                        f"{seg.name}: abandoned partial record at offset {e.offset} (superseded by {segs[i + 1].name})"
                    )
                continue
            raise


def generation_end(client: StoreClient, gen: layout.GenerationInfo) -> tuple[int, bool]:
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


def chain_breaks(
    client: StoreClient, gens: dict[int, layout.GenerationInfo], *, ends: dict[int, tuple[int, bool]] | None = None
) -> list[ChainBreak]:
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
            out.append(
                ChainBreak(
                    g.generation,
                    None,
                    layout.ready_name(g.generation),
                    f"generation {g.generation} has a ready object but no segment: no writer wrote that generation",
                )
            )
    prev = None
    for g in written:
        if g.generation == 0:
            out.append(
                ChainBreak(0, None, g.segments[0].name, "generation 0 holds segments: generation numbers start at 1")
            )
        if prev is not None:
            end, exact = ends[prev.generation] if ends and prev.generation in ends else generation_end(client, prev)
            if exact or g.generation != prev.generation + 1:
                reason = layout.continues(prev.generation, end, g)
            elif g.segments[0].first_seq <= end:
                # damage hides where the previous generation ended: it holds at least record `end`
                reason = (
                    f"generation {g.generation} does not continue generation {prev.generation}: it starts "
                    f"with record {g.segments[0].first_seq} but generation {prev.generation} holds record {end}"
                )
            else:
                reason = None
            if reason is not None:
                out.append(ChainBreak(g.generation, prev.generation, g.segments[0].name, reason))
        prev = g
    return out


def next_first_seq(gens: dict[int, layout.GenerationInfo], generation: int) -> int | None:
    """First sequence number of generation ``generation + 1`` if the server holds it (what a
    record cut at the end of ``generation`` may be continued by, protocol.md 2.3 step 3)."""
    g = gens.get(generation + 1)
    return g.first_seq if g is not None and g.segments else None


def refuse_breaks(breaks: list[ChainBreak]) -> GenerationBreak:
    first = breaks[0]
    more = "; ".join(b.reason for b in breaks[1:])
    return GenerationBreak(
        first.name,
        first.reason
        + (f"; also: {more}" if more else "")
        + ". Objects under gen/ were written by someone else with an append key, or are damaged: "
        "restore does not guess which side is the journal (`sos verify` lists every break; "
        "--generation G restores one generation without checking the others)",
        generation=first.generation,
        previous=first.previous or 0,
    )


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

    def __init__(
        self,
        client_factory: Callable[[], StoreClient],
        segs: list[layout.SegmentInfo],
        *,
        readers: int = 2,
        on_bytes: Callable[[int], None] | None = None,
        max_batches: int = 2,
        batch_bytes: int = 2 << 20,
        segment_keys: Callable[[str], Any] | None = None,
    ) -> None:
        self._segs = segs
        self._segment_keys = segment_keys
        # per segment: lists of records, then _END (or the exception that stopped the reader)
        self._queues: list[queue.Queue[list[Record] | BaseException | _End]] = [
            queue.Queue(maxsize=max_batches) for _ in segs
        ]
        self._next = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._factory = client_factory
        self._on_bytes = on_bytes
        self._batch_bytes = batch_bytes
        self._threads = [
            threading.Thread(target=self._work, name=f"sos-restore-reader-{k}", daemon=True)
            for k in range(max(1, min(readers, len(segs))))
        ]
        for th in self._threads:
            th.start()

    def _put(
        self, q: queue.Queue[list[Record] | BaseException | _End], item: list[Record] | BaseException | _End
    ) -> bool:
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
                    for rec in segment_records(
                        client,
                        self._segs[i],
                        on_bytes=self._on_bytes,
                        keys=self._segment_keys(self._segs[i].name) if self._segment_keys else None,
                    ):
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
                        close_quietly(client)
                        client = None
        finally:
            close_quietly(client)

    def records(self, i: int, seg: layout.SegmentInfo) -> Iterator[Record]:
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


def _first_time(client: StoreClient, seg: layout.SegmentInfo) -> int | None:
    head = b"".join(client.read_iter(seg.name, 0, HEADER_SIZE))
    if len(head) < HEADER_SIZE:
        return None
    return peek_header(head)[3]


def complete_generations(gens: dict[int, layout.GenerationInfo]) -> list[layout.GenerationInfo]:
    return sorted((g for g in gens.values() if g.ready and g.segments), key=lambda g: -g.generation)


def choose_generation(
    client: StoreClient,
    gens: dict[int, layout.GenerationInfo],
    *,
    position: int | None = None,
    at_ns: int | None = None,
) -> layout.GenerationInfo | None:
    """The generation to replay for a point (None: no complete generation)."""
    cands = complete_generations(gens)
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
        raise PositionUnavailable(
            f"position {position} is before the oldest generation the server keeps "
            f"(generation {oldest.generation} starts after record {oldest_first - 1})"
        )
    assert at_ns is not None  # neither a position nor a time returned the newest above
    when = f"first record at {format_time(first_time)}" if first_time is not None else "no first record"
    if oldest_first == 1:
        raise PositionUnavailable(
            f"time {format_time(at_ns)} is before the first record of the journal "
            f"(generation 1, {when}): nothing was journaled yet"
        )
    raise PositionUnavailable(
        f"time {format_time(at_ns)} is before the oldest generation the server keeps "
        f"(generation {oldest.generation}, {when})"
    )


def incomplete_after(gens: dict[int, layout.GenerationInfo], generation: int) -> list[layout.GenerationInfo]:
    """Generations newer than ``generation`` that hold records but are not complete."""
    return [g for g in gens.values() if g.generation > generation and not g.ready and g.total_bytes]
