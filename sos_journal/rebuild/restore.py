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
An empty tree at the journal's end over records of an older generation that is not complete
(a writer started over without them) raises JournalIncomplete. A namespace without a complete
generation raises JournalNotFound; a point the journal does
not hold (before its first record or oldest kept generation, past its last record, a batch
that never committed) raises PositionUnavailable or BatchNotFound. Every error found before
replaying leaves the target untouched (not even created); a position found to lie past the
end once replayed is undone (the target is emptied, and removed if restore created it).
"""

from __future__ import annotations

import datetime as _dt
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator

from sos_journal.beneath import Beneath
from sos_journal.beneath import clear_directory as _clear
from sos_journal.errors import (
    JournalCorrupt,
    JournalIncomplete,
    JournalNotFound,
    PositionUnavailable,
    TargetNotEmpty,
)
from sos_journal.format import layout
from sos_journal.format.auth import JournalKeys, ReadAuth, resolve_journal_keys
from sos_journal.format.records import HEADER_SIZE, Record, RecordType, SnapshotEnd, peek_header
from sos_journal.read.points import parse_batch, parse_time
from sos_journal.read.reading import (
    SegmentReaders,
    ServerCorrupt,
    chain_breaks,
    choose_generation,
    complete_generations,
    generation_records,
    incomplete_after,
    list_generations,
    next_first_seq,
    read_segment_bytes,
    refuse_breaks,
    segment_records,
)
from sos_journal.read.spark_log import commit_path, find_batch
from sos_journal.rebuild.replay import DEFAULT_WORKERS, replay
from sos_journal.stats import ReplayStats, Summary, format_time
from sos_journal.store import SOSNotFound, StoreClient, close_quietly

__all__ = [
    "BATCH_LABEL",
    "ServerCorrupt",
    "Summary",
    "chain_breaks",
    "commit_path",
    "find_batch",
    "format_time",
    "generation_records",
    "list_generations",
    "parse_batch",
    "parse_time",
    "read_segment_bytes",
    "rebuild_cache",
    "restore",
    "segment_records",
]  # (the last ones: from their modules)

BATCH_LABEL = layout.BATCH_LABEL


def _through(records: Iterable[Record], position: int) -> Iterator[Record]:
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
            raise TargetNotEmpty(
                f"restore target {target} is not empty ({n} entries); use force (--force) to replace its contents"
            )


def _prepare_target(target: str, force: bool) -> None:
    _check_target(target, force)
    os.makedirs(target, exist_ok=True)
    _clear(target)


def _no_journal(namespace: str, gens: dict[int, layout.GenerationInfo]) -> JournalNotFound:
    if not gens:
        return JournalNotFound(
            namespace,
            f"namespace {namespace!r} has no journal (no objects under gen/): "
            f"nothing to restore; check the namespace and the server",
        )
    why = "; ".join(f"generation {g}: {i.ready_problem or 'no ready object'}" for g, i in gens.items())
    return JournalNotFound(
        namespace,
        f"namespace {namespace!r} has no complete generation ({why}): nothing to restore. A writer "
        f"opening the namespace (`sos gateway`, `sos mount`, fsspec) continues from the records of "
        f"the newest one whose snapshot is whole (protocol.md 2.1); `sos verify` shows what they hold",
    )


def _count(target: str, summary: Summary) -> None:
    """Files, directories and bytes under ``target`` (no recursion, no link followed)."""
    with Beneath(target) as at:
        for _d, dirs, entries in at.walk():
            summary.dirs += len(dirs)
            for _name, st in entries:
                summary.files += 1
                summary.bytes += st.st_size


def _unused_text(g: layout.GenerationInfo) -> str:
    why = g.ready_problem or f"no {layout.ready_name(g.generation)}"
    return (
        f"generation {g.generation} is not complete ({why}): restore does not use its {g.total_bytes} "
        f"bytes of records from record {g.first_seq} on. A writer reports no record of a generation "
        f"durable before its ready object exists: it is starting that generation, or it stopped first"
    )


def restore(
    client_factory: Callable[[], StoreClient],
    namespace: str,
    target: str,
    *,
    at: int | str | _dt.datetime | None = None,
    position: int | None = None,
    batch: str | tuple[str, int] | None = None,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    generation: int | None = None,
    workers: int = DEFAULT_WORKERS,
    journal_key: JournalKeys | str | None = None,
    observe: Callable[[Record], None] | None = None,
) -> Summary:
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

    ``workers``: threads that apply records of different files in parallel (each path in
    journal order; directories, renames and deletes in journal order for their paths);
    1 applies every record in order in this thread. ``journal_key``: protocol.md 2.5 (default
    $SOS_JOURNAL_KEY[_FILE]); a record it does not vouch for is a JournalAuthError (corrupt).
    ``observe``: :func:`~sos_journal.rebuild.replay.replay`'s."""
    auth = ReadAuth(resolve_journal_keys(journal_key), namespace)
    _check_args(at=at, position=position, batch=batch, generation=generation)
    at_ns = parse_time(at)
    bq = parse_batch(batch) if batch is not None else None
    target = os.path.abspath(target)
    _check_target(target, force)
    summary = Summary(namespace, target)
    t0 = time.monotonic()
    client = client_factory()
    try:
        listed = list_generations(client)
        gens = _generations(client, namespace, listed, generation, summary)
        meter = _Meter(summary, progress)
        if bq is not None:
            position = _batch_position(client, gens, listed, bq, meter, summary, auth)
        gen = choose_generation(client, gens, position=position, at_ns=at_ns)
        if gen is None:  # not reached: complete_generations(gens) was checked above
            raise _no_journal(namespace, gens)
        created = not os.path.exists(target)
        _prepare_target(target, force)
        summary.generation = gen.generation
        meter.start(gen.total_bytes)
        stats = _replay_generation(
            client_factory,
            client,
            gen,
            listed,
            target,
            summary,
            meter,
            position=position,
            at_ns=at_ns,
            workers=workers,
            t0=t0,
            auth=auth,
            observe=observe,
        )
        _check_point_reached(summary, stats, gens, gen, position, target, created)
        if generation is None and position is None and at_ns is None and bq is None:
            _refuse_empty_over_records(client, namespace, gens, gen, target, created)
    finally:
        close_quietly(client)
    summary.seconds = time.monotonic() - t0
    _count(target, summary)
    return summary


def _batch_position(
    client: StoreClient,
    gens: dict[int, layout.GenerationInfo],
    listed: dict[int, layout.GenerationInfo],
    bq: tuple[str, int],
    meter: _Meter,
    summary: Summary,
    auth: ReadAuth,
) -> int:
    """The position right after the record that commits batch ``bq`` (a first pass over the
    journal, metered from 0; the replay's pass starts from 0 again)."""
    meter.total = sum(g.total_bytes for g in complete_generations(gens))  # at most: the scan may stop sooner
    position = find_batch(
        client, gens, bq[0], bq[1], on_bytes=meter.on_bytes, notes=summary.notes, listed=listed, auth=auth
    )
    meter.done = 0
    return position


def _check_args(
    *,
    at: int | str | _dt.datetime | None,
    position: int | None,
    batch: str | tuple[str, int] | None,
    generation: int | None,
) -> None:
    if sum(x is not None for x in (at, position, batch)) > 1:
        raise ValueError("give at most one of at, position, batch")
    if position is not None and (not isinstance(position, int) or position < 0):
        raise ValueError(f"bad position {position!r}")
    if generation is not None and (not isinstance(generation, int) or generation < 0):
        raise ValueError(f"bad generation {generation!r}")


def _generations(
    client: StoreClient,
    namespace: str,
    listed: dict[int, layout.GenerationInfo],
    generation: int | None,
    summary: Summary,
) -> dict[int, layout.GenerationInfo]:
    """The generations to restore from: generation ``generation`` alone, or every listed one
    once they form one chain (else GenerationBreak); JournalNotFound if none is complete."""
    if generation is not None:
        g = listed.get(generation)
        if g is None or not g.segments or not g.ready:
            why = (
                "not on the server"
                if g is None or not g.segments
                else f"not complete ({g.ready_problem or 'no ready object'})"
            )
            raise JournalNotFound(
                namespace, f"namespace {namespace!r}: generation {generation} is {why}: nothing to restore"
            )
        gens = {generation: g}
        summary.warnings.append(
            f"restoring generation {generation} alone (--generation): the other "
            f"generations were neither read nor checked"
        )
    else:
        breaks = chain_breaks(client, listed)
        if breaks:
            raise refuse_breaks(breaks)
        gens = listed
    if not complete_generations(gens):
        raise _no_journal(namespace, gens)
    return gens


class _Meter:
    """Journal bytes read: ``summary.bytes_read`` and ``progress(done, total)``, from the
    reader threads."""

    def __init__(self, summary: Summary, progress: Callable[[int, int], None] | None) -> None:
        self.summary = summary
        self.progress = progress
        self.done = 0
        self.total = 0
        self._lock = threading.Lock()

    def on_bytes(self, n: int) -> None:
        with self._lock:  # progress sees done grow (the reader threads would otherwise race)
            self.done += n
            self.summary.bytes_read += n
            if self.progress is not None:
                self.progress(self.done, self.total)

    def start(self, total: int) -> None:
        """The replay's pass: ``total`` bytes to read."""
        self.total = total
        if self.progress is not None:
            self.progress(0, total)


def _stop_rule(position: int | None, at_ns: int | None) -> Callable[[Record], bool] | None:
    """The replay stops before the first record past the point (None: at the end)."""
    if position is not None:

        def stop(rec: Record, _p: int = position) -> bool:
            return rec.seq > _p

        return stop
    if at_ns is not None:

        def stop_at(rec: Record, _t: int = at_ns) -> bool:
            return rec.time_ns > _t

        return stop_at
    return None


def _replay_generation(
    client_factory: Callable[[], StoreClient],
    client: StoreClient,
    gen: layout.GenerationInfo,
    listed: dict[int, layout.GenerationInfo],
    target: str,
    summary: Summary,
    meter: _Meter,
    *,
    position: int | None,
    at_ns: int | None,
    workers: int,
    t0: float,
    auth: ReadAuth,
    observe: Callable[[Record], None] | None = None,
) -> ReplayStats:
    """Replay ``gen`` into ``target`` up to the point. A JournalCorrupt leaves what came
    before the broken record applied and carries the summary of it (``exc.summary``)."""
    try:
        readers = SegmentReaders(
            client_factory, gen.segments, readers=2, on_bytes=meter.on_bytes, segment_keys=auth.for_segment
        )
        try:
            records = generation_records(
                client,
                gen,
                notes=summary.notes,
                source=readers.records,
                next_first=next_first_seq(listed, gen.generation),
                check=auth.chain(gen.generation),
            )
            if position is not None:
                records = _through(records, position)
            stats = replay(
                records, target, stop=_stop_rule(position, at_ns), snapshot=True, workers=workers, observe=observe
            )
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
        raise JournalCorrupt(
            gen.segments[-1].name, 0, f"generation {gen.generation} is marked ready but has no SNAPSHOT_END"
        )
    return stats


def _check_point_reached(
    summary: Summary,
    stats: ReplayStats,
    gens: dict[int, layout.GenerationInfo],
    gen: layout.GenerationInfo,
    position: int | None,
    target: str,
    created: bool,
) -> None:
    """After the replay: a position past the journal's end is undone (PositionUnavailable);
    the summary takes the replay's figures and what a restore did not use."""
    if position is not None and not stats.stopped and stats.last_seq < position:
        if gen is complete_generations(gens)[0]:
            _clear(target)  # a point the journal does not reach: leave nothing half-meant behind
            if created:
                os.rmdir(target)
            unused = "".join(f"; {_unused_text(g)}" for g in incomplete_after(gens, gen.generation))
            raise PositionUnavailable(
                f"position {position} is past the end of the journal: the last "
                f"record is {stats.last_seq} (at {format_time(stats.last_time_ns)})" + unused
            )
        summary.notes.append(
            f"position {position} is in a range of records no complete generation "
            f"holds (a generation abandoned before its snapshot was done): restored "
            f"the end of generation {gen.generation}, record {stats.last_seq}"
        )
    if gen is complete_generations(gens)[0] and position is None and not stats.stopped:
        summary.warnings.extend(_unused_text(g) for g in incomplete_after(gens, gen.generation))
    summary.records = stats.records
    summary.last_seq = stats.last_seq
    summary.last_time_ns = stats.last_time_ns
    summary.stopped = stats.stopped or (position is not None and stats.last_seq >= position)


def _bare_snapshot_end(client: StoreClient, g: layout.GenerationInfo) -> bool:
    """True if ``g`` holds one record, its SNAPSHOT_END, and nothing else (an empty tree)."""
    head = b"".join(client.read_iter(g.segments[0].name, 0, HEADER_SIZE))
    if len(head) < HEADER_SIZE:
        return g.total_bytes == 0
    length, typ, _seq, _t = peek_header(head)
    return typ == RecordType.SNAPSHOT_END and g.total_bytes == 8 + length


def _refuse_empty_over_records(
    client: StoreClient,
    namespace: str,
    gens: dict[int, layout.GenerationInfo],
    gen: layout.GenerationInfo,
    target: str,
    created: bool,
) -> None:
    """JournalIncomplete (the target emptied, removed if restore made it) when the journal's end
    is an empty tree while a generation before it that is not complete, newer than every complete
    one before it, holds records: a writer started over without them (protocol.md 2.1, "Opening
    over a generation that is not complete"); restore does not call that the namespace's tree."""
    if os.listdir(target):
        return
    for g in sorted(gens.values(), key=lambda x: -x.generation):
        if g.generation >= gen.generation or not g.segments:
            continue
        if g.ready:
            return
        if g.total_bytes and not _bare_snapshot_end(client, g):
            if created:
                os.rmdir(target)
            raise JournalIncomplete(
                namespace,
                f"namespace {namespace!r}: the newest complete generation, {gen.generation}, holds an empty "
                f"tree, but generation {g.generation} before it is not complete "
                f"({g.ready_problem or 'no ready object'}) and holds {g.total_bytes} bytes of records from "
                f"record {g.first_seq} on: a writer started generation {gen.generation} without them "
                f"(protocol.md 2.1). Nothing restored. A writer that opens the namespace (`sos gateway`, "
                f"`sos mount`) continues from those records; `sos restore --generation {gen.generation}` "
                f"restores the empty tree if that is what is meant; `sos verify` shows every generation",
            )


def rebuild_cache(
    client_factory: Callable[[], StoreClient],
    namespace: str,
    cache_dir: str,
    journal_key: JournalKeys | str | None = None,
    observe: Callable[[Record], None] | None = None,
) -> int:
    """Fill a cache directory with the namespace's latest tree (replacing what it holds);
    returns the last seq, 0 for a namespace without a complete generation (empty tree).
    ``journal_key`` and ``observe`` as :func:`restore`'s."""
    try:
        return restore(
            client_factory, namespace, cache_dir, force=True, journal_key=journal_key, observe=observe
        ).last_seq
    except (SOSNotFound, JournalNotFound):
        _prepare_target(os.path.abspath(cache_dir), True)
        return 0
