"""Rolling a namespace back to a Spark batch (``sos gateway --restore-batch CHECKPOINT:N``).

The journal is append-only: nothing after the point is removed. A rollback instead continues
the journal from the tree as it was right after batch N of CHECKPOINT committed:

1. the opener's cache is emptied, so that opening the namespace takes the "rebuild from the
   server" path of :meth:`~sos_journal.tree.tree.JournaledTree.open` (which first ships
   whatever the spool still holds);
2. the rebuild function of :func:`rollback_rebuild` restores the tree at the batch's position
   (:func:`~sos_journal.read.spark_log.find_batch`, as ``sos restore --batch`` does) instead
   of at the journal's end;
3. the tree then sees the cache behind the journal's end and starts a new generation whose
   snapshot is that restored tree (the path every rebuild takes when the cache and the
   journal's end differ). From then on the namespace IS the rolled-back tree: ``sos restore``
   of the namespace, the next gateway, a mount all see it, plus what is written after.

It is the whole namespace that goes back, not one checkpoint: every other checkpoint (any
file) in it returns to the same journal position. The older generations still hold the
discarded records (``sos restore --position``/``--generation`` reach them until retention
removes them).

Refused (:class:`RollbackRefused`, nothing changed on the server; the emptied cache is rebuilt
from the journal's end by the next start) when records follow the point and ``discard`` is not
given.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sos_journal.errors import JournalError
from sos_journal.read.points import parse_batch
from sos_journal.read.reading import chain_breaks, complete_generations, generation_end, list_generations, refuse_breaks
from sos_journal.read.spark_log import find_batch
from sos_journal.rebuild.restore import restore
from sos_journal.store import StoreClient, close_quietly

__all__ = ["RollbackPoint", "RollbackRefused", "find_rollback_point", "rollback_rebuild"]

log = logging.getLogger(__name__)


class RollbackRefused(JournalError):
    """Records follow the batch and discarding them was not confirmed."""


class RollbackPoint:
    """Where batch ``batch`` of ``checkpoint`` committed (``position``) and the journal's
    end (``end``, the last record of its newest complete generation)."""

    def __init__(self, checkpoint: str, batch: int, position: int, end: int) -> None:
        self.checkpoint = checkpoint
        self.batch = batch
        self.position = position
        self.end = end

    @property
    def discards(self) -> int:
        """Records after the point (the changes a rollback leaves behind)."""
        return max(0, self.end - self.position)


def find_rollback_point(client: StoreClient, point: str | tuple[str, int]) -> RollbackPoint:
    """Locate ``CHECKPOINT:N`` in the namespace's journal (BatchNotFound, PositionUnavailable,
    GenerationBreak as ``sos restore --batch``)."""
    checkpoint, batch = parse_batch(point)
    gens = list_generations(client)
    breaks = chain_breaks(client, gens)
    if breaks:
        raise refuse_breaks(breaks)
    position = find_batch(client, gens, checkpoint, batch, listed=gens)
    complete = complete_generations(gens)
    end = generation_end(client, complete[0])[0] if complete else 0
    return RollbackPoint(checkpoint, batch, position, end)


def rollback_rebuild(
    point: str | tuple[str, int], *, discard: bool, on_point: Callable[[RollbackPoint], None] | None = None
) -> Callable[[Callable[[], StoreClient], str, str], int]:
    """A rebuild function for :func:`~sos_journal.tree.open.open_namespace` that fills the
    (emptied) cache with the tree right after batch N of CHECKPOINT (see the module
    docstring); ``discard`` confirms dropping the records after it. ``on_point`` sees the
    point found before anything is restored (for the caller's log)."""

    def rebuild(client_factory: Callable[[], StoreClient], namespace: str, cache_dir: str) -> int:
        client = client_factory()
        try:
            found = find_rollback_point(client, point)
        finally:
            close_quietly(client)
        if on_point is not None:
            on_point(found)
        if found.discards and not discard:
            raise RollbackRefused(
                f"rolling namespace {namespace!r} back to batch {found.batch} of checkpoint "
                f"{found.checkpoint or '.'!r} (journal record {found.position}) discards the {found.discards} "
                f"later records (up to {found.end}): newer batches of this and EVERY other checkpoint of the "
                f"namespace. Nothing was changed; pass --yes to roll back"
            )
        summary = restore(client_factory, namespace, cache_dir, position=found.position, force=True)
        log.warning(
            "namespace %r rolled back to batch %d of checkpoint %r (journal record %d of %d): "
            "a new generation starts from that tree",
            namespace,
            found.batch,
            found.checkpoint or ".",
            found.position,
            found.end,
        )
        return summary.last_seq

    return rebuild
