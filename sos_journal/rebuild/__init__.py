"""Turning a journal into a directory: ``replay`` (records applied in order, never following a
link, never leaving the target; ``ParallelReplayer``'s lanes keep each path's order),
``restore`` (a generation chosen, read, verified and replayed into an empty directory, with
progress; ``rebuild_cache`` for an opener whose cache is empty) and ``rollback`` (a namespace
continued from the tree as it was right after a Spark batch).

May import: ``sos_journal.read``, ``format``, ``beneath``, ``errors``, ``stats``. Never the
tree (import-linter contract "journal-replay") or the writer.
"""
