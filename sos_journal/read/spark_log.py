"""Spark's commit log in a journal: the record that makes ``QUERYDIR/commits/N`` exist
(batch N committed), found by scanning generations (``find_batch``), for
``sos restore --batch``."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from sos_journal.errors import BatchNotFound, JournalCorrupt, JournalError, PositionUnavailable
from sos_journal.format import layout
from sos_journal.format.auth import ReadAuth
from sos_journal.format.records import Create, Delete, Marker, Record, Rename, SnapshotEnd, Truncate, Write
from sos_journal.read.points import norm_dir
from sos_journal.read.reading import complete_generations, generation_records, incomplete_after, next_first_seq
from sos_journal.store import StoreClient

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
    auth: ReadAuth | None = None,
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
    search = _BatchSearch(client, querydir, batch_id, on_bytes, notes, auth=auth)
    newer: list[_CommitScan] = []  # newest first
    cands = complete_generations(gens)
    for g in cands:
        r = search.scan_complete(g, next_first_seq(listed or gens, g.generation))
        if r.start is not None:
            return search.position(r, newer)
        newer.append(r)
    raise search.not_found(gens, cands, newer)


@dataclass
class _BatchSearch:
    """One :func:`find_batch`: the commit file it looks for, and the checkpoints and batches
    the generations scanned so far hold (``seen``, for the error that names them)."""

    client: StoreClient
    querydir: str
    batch_id: int
    on_bytes: Callable[[int], None] | None
    notes: list[str] | None
    seen: dict[str, set[int]] = field(default_factory=dict)
    auth: ReadAuth | None = None

    def _records(self, g: layout.GenerationInfo, next_first: int | None = None) -> Iterator[Record]:
        check = self.auth.chain(g.generation) if self.auth is not None else None
        return generation_records(self.client, g, on_bytes=self.on_bytes, next_first=next_first, check=check)

    def __post_init__(self) -> None:
        self.path = commit_path(self.querydir, self.batch_id)
        self.crc = self.path.rpartition("/")[0] + f"/.{self.batch_id}.crc"
        self.where = f"batch {self.batch_id} of checkpoint {self.querydir or '.'!r}"

    def scan_complete(self, g: layout.GenerationInfo, next_first: int | None) -> _CommitScan:
        """What complete generation ``g`` says about the commit file; damage after the commit
        ends the scan (the replay stops before it too), damage before it raises."""
        r = _CommitScan()
        try:
            records = self._records(g, next_first)
            _scan_generation(records, self.path, self.crc, self.seen, r)
        except JournalCorrupt as e:
            if r.start is None:
                raise
            r.open = False
            self._note(
                f"the journal is corrupt after batch {self.batch_id} committed ({e}); a later "
                f"commit of the same batch would be behind it"
            )
        return r

    def position(self, r: _CommitScan, newer: list[_CommitScan]) -> int:
        """The position right after the commit ``r`` found, moved past the records of the
        newer generations (``newer``, newest first) that complete a file still open."""
        assert r.start is not None
        stop = r.start if r.stop is None else r.stop
        if r.open:  # the file may be completed in the next generation(s)
            for nr in reversed(newer):
                if nr.head_ext is not None:
                    stop = nr.head_ext
                if nr.head_closed:
                    break
        self._note(
            f"{self.where}: {self.path} appears at record {r.start}"
            + (f", complete at record {stop}" if stop != r.start else "")
            + f"; restored to position {stop}"
        )
        return stop

    def not_found(
        self, gens: dict[int, layout.GenerationInfo], cands: list[layout.GenerationInfo], newer: list[_CommitScan]
    ) -> JournalError:
        """Why no complete generation holds the commit: it is in an incomplete one, it came
        before the oldest generation kept, or the journal holds other batches or checkpoints."""
        # a commit in a newer, incomplete generation was never reported durable (protocol.md
        # 2.1) and restore does not use it: say so rather than "no batch"
        for g in incomplete_after(gens, cands[0].generation if cands else -1):
            r = _CommitScan()
            with contextlib.suppress(JournalCorrupt):
                _scan_generation(self._records(g), self.path, self.crc, {}, r)
            if r.start is not None:
                return BatchNotFound(
                    f"{self.where}: {self.path} appears at record {r.start}, in "
                    f"generation {g.generation}, which is not complete "
                    f"({g.ready_problem or 'no ' + layout.ready_name(g.generation)}): a writer reports no record "
                    f"of a generation durable before its ready object exists, and restore does not use it"
                )
        if any(r.in_snapshot for r in newer):
            oldest = cands[-1]
            return PositionUnavailable(
                f"{self.where} committed before the oldest generation the server keeps (generation "
                f"{oldest.generation} starts after record {oldest.segments[0].first_seq - 1} and "
                f"already holds {self.path}): the state right after that batch is gone"
            )
        q = self.querydir
        if q in self.seen:
            return BatchNotFound(
                f"checkpoint {q or '.'!r} has no {self.path} in the journal the server keeps "
                f"(its batches: {_ranges(self.seen[q])})"
            )
        known = ", ".join(repr(k or ".") for k in sorted(self.seen)) or "none"
        return BatchNotFound(
            f"no checkpoint {q or '.'!r} in this namespace's journal: no {self.path} "
            f"(checkpoints found: {known}; QUERYDIR is the checkpoint's path relative to "
            f"the namespace root)"
        )

    def _note(self, note: str) -> None:
        if self.notes is not None:
            self.notes.append(note)
