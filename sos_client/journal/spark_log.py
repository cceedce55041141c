"""Spark's commit log in a journal: the record that makes ``QUERYDIR/commits/N`` exist
(batch N committed), found by scanning generations (``find_batch``), for
``sos restore --batch``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from . import layout
from ._store import StoreClient
from .errors import (
    BatchNotFound,
    JournalCorrupt,
    PositionUnavailable,
)
from .points import norm_dir
from .reading import complete_generations, generation_records, incomplete_after, next_first_seq
from .records import Create, Delete, Marker, Record, Rename, SnapshotEnd, Truncate, Write

BATCH_LABEL = layout.BATCH_LABEL


def commit_path(querydir: str, batch_id: int) -> str:
    """``QUERYDIR/commits/N``: the file whose appearance commits batch N (Spark's commit log)."""
    return f"{querydir}/commits/{batch_id}" if querydir else f"commits/{batch_id}"


def _commit_of(path: str) -> tuple[str, int] | None:
    """(querydir, batch id) if ``path`` is a Spark commit-log file ``[Q/]commits/N``, else None."""
    parent, _, name = path.rpartition("/")
    if not name.isdigit() or not name.isascii():
        return None
    if parent == "commits":
        return "", int(name)
    if parent.endswith("/commits"):
        return parent[: -len("/commits")], int(name)
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


def _scan_generation(
    records: Iterable[Record], path: str, crc: str, seen: dict[str, set[int]], r: _CommitScan
) -> _CommitScan:
    # (isinstance is ``type(op) is``: the record classes are final dataclasses)
    in_snap = True
    for rec in records:
        op = rec.op
        if in_snap:
            if isinstance(op, SnapshotEnd):
                in_snap = False
            elif isinstance(op, Create):
                if op.path == path:
                    r.in_snapshot = True
                c = _commit_of(op.path)
                if c is not None:
                    seen.setdefault(c[0], set()).add(c[1])
            continue
        if isinstance(op, Marker):
            if op.label == BATCH_LABEL:
                try:
                    info = json.loads(op.payload)
                    seen.setdefault(norm_dir(str(info["checkpoint"])), set()).add(int(info["batch_id"]))
                except (ValueError, TypeError, KeyError, AttributeError):
                    pass
            continue
        if isinstance(op, Rename):
            made = op.dst
        elif isinstance(op, Create):
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
            if isinstance(op, Rename):
                d, _, name = op.src.rpartition("/")
                r.tmp_crc = f"{d}/.{name}.crc" if d else f".{name}.crc"
        elif (
            isinstance(op, Rename)
            and (op.src == path or path.startswith(op.src + "/") or path.startswith(op.dst + "/"))
        ) or (isinstance(op, Delete) and op.path == path):
            r.open = False  # P moved away, replaced by a directory rename, or deleted
            r.head_closed = True
        elif (
            (isinstance(op, (Write, Truncate)) and (op.path == path or op.path == crc))
            or ((isinstance(op, Create) and op.path == crc) or (isinstance(op, Rename) and op.dst == crc))
            or (isinstance(op, Delete) and op.path == r.tmp_crc)
        ):
            if r.open:
                r.stop = rec.seq
            elif not r.head_closed:
                r.head_ext = rec.seq
    return r


def _ranges(batch_ids: Iterable[int]) -> str:
    ids = sorted(batch_ids)
    out, i = [], 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}..{ids[j]}")
        i = j + 1
    return ", ".join(out)


def find_batch(
    client: StoreClient,
    gens: dict[int, layout.GenerationInfo],
    querydir: str,
    batch_id: int,
    *,
    on_bytes: Callable[[int], None] | None = None,
    notes: list[str] | None = None,
    listed: dict[int, layout.GenerationInfo] | None = None,
) -> int:
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
    seen: dict[str, set[int]] = {}
    newer: list[_CommitScan] = []  # newest first
    cands = complete_generations(gens)
    for g in cands:
        r = _CommitScan()
        try:
            _scan_generation(
                generation_records(
                    client, g, on_bytes=on_bytes, next_first=next_first_seq(listed or gens, g.generation)
                ),
                path,
                crc,
                seen,
                r,
            )
        except JournalCorrupt as e:
            if r.start is None:
                raise
            # the batch committed before the damage: the replay stops before it too
            r.open = False
            if notes is not None:
                notes.append(
                    f"the journal is corrupt after batch {batch_id} committed ({e}); a later "
                    f"commit of the same batch would be behind it"
                )
        if r.start is not None:
            stop = r.start if r.stop is None else r.stop
            if r.open:  # the file may be completed in the next generation(s)
                for nr in reversed(newer):
                    if nr.head_ext is not None:
                        stop = nr.head_ext
                    if nr.head_closed:
                        break
            if notes is not None:
                notes.append(
                    f"batch {batch_id} of checkpoint {querydir or '.'!r}: {path} appears at record "
                    f"{r.start}"
                    + (f", complete at record {stop}" if stop != r.start else "")
                    + f"; restored to position {stop}"
                )
            return stop
        newer.append(r)
    # Not in a complete generation: a commit in a newer, incomplete one was never reported
    # durable (protocol.md 2.1) and restore does not use it. Say so rather than "no batch".
    for g in incomplete_after(gens, cands[0].generation if cands else -1):
        r = _CommitScan()
        with contextlib.suppress(JournalCorrupt):
            _scan_generation(generation_records(client, g, on_bytes=on_bytes), path, crc, {}, r)
        if r.start is not None:
            raise BatchNotFound(
                f"batch {batch_id} of checkpoint {querydir or '.'!r}: {path} appears at record {r.start}, in "
                f"generation {g.generation}, which is not complete "
                f"({g.ready_problem or 'no ' + layout.ready_name(g.generation)}): a writer reports no record "
                f"of a generation durable before its ready object exists, and restore does not use it"
            )
    if any(r.in_snapshot for r in newer):
        oldest = cands[-1]
        raise PositionUnavailable(
            f"batch {batch_id} of checkpoint {querydir or '.'!r} committed before the oldest generation the "
            f"server keeps (generation {oldest.generation} starts after record {oldest.segments[0].first_seq - 1} and "
            f"already holds {path}): the state right after that batch is gone"
        )
    if querydir in seen:
        raise BatchNotFound(
            f"checkpoint {querydir or '.'!r} has no {path} in the journal the server keeps "
            f"(its batches: {_ranges(seen[querydir])})"
        )
    known = ", ".join(repr(q or ".") for q in sorted(seen)) or "none"
    raise BatchNotFound(
        f"no checkpoint {querydir or '.'!r} in this namespace's journal: no {path} "
        f"(checkpoints found: {known}; QUERYDIR is the checkpoint's path relative to "
        f"the namespace root)"
    )
