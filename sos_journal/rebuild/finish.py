"""The tree a writer continues when it opens on an empty cache: the journal's end, also when the
namespace's newest generation is not complete (protocol.md 2.1, "Opening over a generation that
is not complete").

``sos restore`` uses complete generations only. A writer that opens on an empty cache (a new
gateway, a mount or fsspec on a new machine) cannot: it starts a new generation from the tree it
rebuilt, and that generation is complete as soon as its ``ready`` is sealed, so a rebuild that
skipped a generation that is not complete would start the next one from an older tree, or from
an EMPTY tree when no generation is complete, and every restore from then on would return that
tree with exit status 0. A generation with records is left not complete by a writer that died
during a rotation (SNAPSHOT_END(G) acknowledged, ``gen/<G>/ready`` not created or not sealed
yet), by a damaged ``ready`` (bytes planted past its seal in the bucket, which a replacement
server rebuilds unsealed), or for a moment while a new writer seals the ``ready`` its dead
predecessor created (the rebuild races that seal).

:func:`rebuild_journal_end` therefore *finishes* the newest generation whose snapshot is whole
(it holds its SNAPSHOT_END), complete or not: it replays it to its last whole record (a torn tail
of its last segment is a write its writer did not finish), and the writer then starts the next
generation from that tree, which every restore uses from then on. It refuses (JournalIncomplete)
only when records exist and no generation holds a whole snapshot: there is no tree to continue.
A complete newest generation is rebuilt by restore itself, unless its tree is empty while a
generation before it that is not complete holds records (what a writer that started over without
them left, restore refuses it): that generation is finished instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator

from sos_journal.beneath import clear_directory
from sos_journal.errors import JournalIncomplete, JournalTruncated
from sos_journal.format import layout
from sos_journal.format.auth import JournalKeys, ReadAuth, resolve_journal_keys
from sos_journal.format.records import Record
from sos_journal.read.reading import (
    chain_breaks,
    generation_records,
    list_generations,
    next_first_seq,
    refuse_breaks,
    segment_records,
)
from sos_journal.rebuild.replay import DEFAULT_WORKERS, replay
from sos_journal.rebuild.restore import restore
from sos_journal.stats import ReplayStats
from sos_journal.store import SOSNotFound, StoreClient, close_quietly

__all__ = ["rebuild_journal_end"]

log = logging.getLogger(__name__)


def rebuild_journal_end(
    client_factory: Callable[[], StoreClient],
    namespace: str,
    cache_dir: str,
    *,
    refuse: bool = True,
    journal_key: JournalKeys | str | None = None,
    observe: Callable[[Record], None] | None = None,
) -> int:
    """Fill ``cache_dir`` (emptied first) with the tree at the end of the newest generation
    whose snapshot is whole, complete or not (module doc); returns the seq of its last record, 0
    for a namespace without records (an empty tree).

    GenerationBreak when the generations do not form one chain; JournalIncomplete (with
    ``refuse``, the writer's case; else an empty tree, a read-only view's) when records exist
    but no generation holds a whole snapshot; JournalCorrupt as restore. ``journal_key``:
    restore's (protocol.md 2.5): every record read is checked under it, those of a generation
    that is not complete too. ``observe``: :func:`~sos_journal.rebuild.replay.replay`'s, for
    the records of the tree the cache ends with (a generation given up for an older one is
    observed too: its records' seqs are higher than the older one's, which come after them)."""
    cache_dir = os.path.abspath(cache_dir)
    keys = resolve_journal_keys(journal_key)
    cut_short: list[tuple[layout.GenerationInfo, int]] = []  # snapshots not whole: (generation, records)
    try:
        client = client_factory()
        try:
            gens = list_generations(client)
            breaks = chain_breaks(client, gens)
            if breaks:
                raise refuse_breaks(breaks)
            written = [g for g in reversed(gens.values()) if g.segments]  # the newest first
            first_complete = True
            for g in written:
                if g.ready:
                    last = _restore_complete(client_factory, namespace, cache_dir, g, first_complete, keys, observe)
                    if last is not None:
                        return last
                    first_complete = False
                    continue
                stats = _replay_incomplete(
                    client, gens, g, cache_dir, newest=g is written[0], auth=ReadAuth(keys, namespace), observe=observe
                )
                if stats.snapshot_done:
                    _log_finished(namespace, g, stats, cut_short)
                    return stats.last_seq
                cut_short.append((g, stats.records))
            return _nothing_to_continue(namespace, cache_dir, cut_short, refuse)
        finally:
            close_quietly(client)
    except SOSNotFound:
        _empty(cache_dir)
        return 0


def _restore_complete(
    client_factory: Callable[[], StoreClient],
    namespace: str,
    cache_dir: str,
    g: layout.GenerationInfo,
    newest: bool,
    keys: JournalKeys | None,
    observe: Callable[[Record], None] | None,
) -> int | None:
    """The end of complete generation ``g`` by restore (the newest complete one: restore's own
    choice, with its checks; an older one, reached because everything newer held no tree to
    continue: that generation alone). None when restore refuses an empty tree over records of a
    generation that is not complete (an older writer started over without them): the loop goes
    on to that generation and finishes it."""
    try:
        if newest:
            return restore(client_factory, namespace, cache_dir, force=True, journal_key=keys, observe=observe).last_seq
        return restore(
            client_factory, namespace, cache_dir, force=True, generation=g.generation, journal_key=keys, observe=observe
        ).last_seq
    except JournalIncomplete as e:
        log.warning("%s; the writer continues from those records", e)
        return None


def _empty(cache_dir: str) -> None:
    os.makedirs(cache_dir, exist_ok=True)
    clear_directory(cache_dir)


def _replay_incomplete(
    client: StoreClient,
    gens: dict[int, layout.GenerationInfo],
    g: layout.GenerationInfo,
    cache_dir: str,
    *,
    newest: bool,
    auth: ReadAuth,
    observe: Callable[[Record], None] | None = None,
) -> ReplayStats:
    """``g`` replayed into the emptied ``cache_dir``: its snapshot, then every whole record. The
    last segment of the newest generation may end inside a record even once sealed (the writer
    that opens seals its dead predecessor's segments): the record it cut is no record, and the
    generation the writer starts next begins with its seq (protocol.md 2.3 step 3)."""
    _empty(cache_dir)
    last = len(g.segments) - 1
    check = auth.chain(g.generation)

    def source(i: int, seg: layout.SegmentInfo) -> Iterator[Record]:
        try:
            yield from segment_records(client, seg, keys=check.for_segment(seg.name))
        except JournalTruncated as e:
            if not (newest and i == last):
                raise
            log.info(
                "%s: partial record at offset %d (its writer stopped in that append): left out", seg.name, e.offset
            )

    records = generation_records(
        client, g, notes=[], source=source, next_first=next_first_seq(gens, g.generation), check=check
    )
    return replay(records, cache_dir, snapshot=True, workers=DEFAULT_WORKERS, observe=observe)


def _why(g: layout.GenerationInfo) -> str:
    return g.ready_problem or f"no {layout.ready_name(g.generation)}"


def _log_finished(
    namespace: str,
    g: layout.GenerationInfo,
    stats: ReplayStats,
    cut_short: list[tuple[layout.GenerationInfo, int]],
) -> None:
    newer = "".join(
        f"; generation {c.generation}'s snapshot was cut short ({n} records, restating this tree)" for c, n in cut_short
    )
    log.warning(
        "namespace %r: generation %d is not complete (%s): the tree is rebuilt from its records "
        "(records %d to %d), and a writer continues from there in a new generation%s",
        namespace,
        g.generation,
        _why(g),
        g.first_seq,
        stats.last_seq,
        newer,
    )


def _nothing_to_continue(
    namespace: str, cache_dir: str, cut_short: list[tuple[layout.GenerationInfo, int]], refuse: bool
) -> int:
    """No generation holds a whole snapshot: an empty tree when none holds a record either (or
    for a reader), else JournalIncomplete."""
    _empty(cache_dir)
    held = [(g, n) for g, n in cut_short if n]
    if not held or not refuse:
        return 0
    g, _n = held[-1]  # the oldest: the namespace's first snapshot
    raise JournalIncomplete(
        namespace,
        f"namespace {namespace!r} holds {sum(n for _g, n in held)} records but no generation whose "
        f"snapshot is whole: generation {g.generation} ({g.segments[0].name}, {_why(g)}) stops "
        f"before its SNAPSHOT_END, so its writer stopped while it copied its first tree (no record "
        f"of it was ever reported durable) and no tree can be rebuilt from it. The writer refuses to start a new generation from an empty "
        f"tree in front of those records (a restore would then return the empty tree); nothing "
        f"was written. Open the namespace again with the cache directory of the writer that "
        f"started it (`sos gateway`/`sos mount` --cache DIR: its spool holds the rest of the "
        f"snapshot and finishes it); `sos verify {namespace}` shows what the server holds",
    )
