"""Check every segment and every record of a namespace without restoring anything (from a
server, or from a tier bucket alone: ``bucket.BucketSource`` as the client factory).

Reports each broken byte range (segment, start, end) it finds and keeps going after it:
it looks for the next record that decodes with a valid CRC and resumes there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from sos_journal.errors import JournalAuthError, JournalCorrupt, JournalTruncated
from sos_journal.format import layout
from sos_journal.format.auth import ChainCheck, JournalKeys, ReadAuth, resolve_journal_keys
from sos_journal.format.records import (
    AUTH_FLAG,
    ENC_FLAG,
    MAX_RECORD_LENGTH,
    MIN_LENGTH,
    PREFIX,
    Encrypted,
    Record,
    RecordDecoder,
    RecordType,
    SnapshotEnd,
)
from sos_journal.read.reading import ServerCorrupt, chain_breaks, list_generations, read_segment_bytes
from sos_journal.store import Corrupt, StoreClient, close_quietly
from sos_wire.crc import crc32c as _crc32c

__all__ = ["Problem", "VerifyReport", "verify"]

_RESYNC_WINDOW = 8 << 20


@dataclass
class Problem:
    segment: str
    start: int
    end: int | None  # None: to the end of the segment
    message: str

    def __str__(self) -> str:
        end = "end" if self.end is None else str(self.end)
        return f"{self.segment} [{self.start}, {end}): {self.message}"


@dataclass
class VerifyReport:
    namespace: str
    generations: int = 0
    complete_generations: int = 0
    segments: int = 0
    records: int = 0
    bytes: int = 0
    first_seq: int = 0
    last_seq: int = 0
    problems: list = field(default_factory=list)
    warnings: list = field(default_factory=list)  # no broken bytes, but records a restore does not use
    notes: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """No broken range (says nothing about whether there is anything to restore)."""
        return not self.problems

    @property
    def verdict(self) -> str:
        if self.problems:
            return f"{len(self.problems)} BROKEN"
        if not self.generations:
            return "NO JOURNAL"
        if not self.complete_generations:
            return "no problem, but NO COMPLETE GENERATION (nothing to restore)"
        if self.warnings:
            return f"OK, {len(self.warnings)} WARNING{'S' if len(self.warnings) > 1 else ''}"
        return "OK"

    def text(self) -> str:
        head = (
            f"{self.namespace}: {self.generations} generations ({self.complete_generations} complete), "
            f"{self.segments} segments, {self.records} records, {self.bytes} bytes, "
            f"records {self.first_seq}..{self.last_seq}: " + self.verdict
        )
        lines = (
            [head]
            + [f"  BROKEN {p}" for p in self.problems]
            + [f"  WARNING {w}" for w in self.warnings]
            + [f"  note: {n}" for n in self.notes]
        )
        return "\n".join(lines)


def _valid_at(buf: bytes, i: int) -> bool:
    if i + PREFIX.size > len(buf):
        return False
    length, crc = PREFIX.unpack_from(buf, i)
    if length < MIN_LENGTH or length > MAX_RECORD_LENGTH or i + 8 + length > len(buf):
        return False
    typ = buf[i + 8]
    if typ & ENC_FLAG and not typ & AUTH_FLAG:
        return False
    typ &= ~(AUTH_FLAG | ENC_FLAG)
    if not 1 <= typ <= max(RecordType):
        return False
    return _crc32c(memoryview(buf)[i + 8 : i + 8 + length]) == crc


def _readable_from(client: StoreClient, name: str, start: int, length: int) -> int | None:
    """Smallest offset >= start from which the server serves data (None: nothing to the end)."""

    def ok(off: int) -> bool:
        try:
            for _ in client.read_iter(name, off, 1):
                pass
            return True
        except Corrupt:
            return False

    if start >= length:
        return None
    if ok(start):
        return start
    bad, step = start, 4096
    good = None
    while bad + step < length:
        if ok(bad + step):
            good = bad + step
            break
        bad += step
        step *= 2
    if good is None:
        if ok(length - 1):
            good = length - 1
        else:
            return None
    while good - bad > 1:
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


def _resync(client: StoreClient, seg: layout.SegmentInfo, start: int, length: int) -> int | None:
    """Offset of the first valid record after a broken one at ``start`` (None: none)."""
    pos = _readable_from(client, seg.name, start + 1, length)
    if pos is None:
        return None
    want = min(length - pos, _RESYNC_WINDOW + MAX_RECORD_LENGTH + 8)
    try:
        buf = b"".join(client.read_iter(seg.name, pos, want))
    except Corrupt:
        return None
    # Fast path: the broken record's own length field may still be right.
    try:
        head = b"".join(client.read_iter(seg.name, start, PREFIX.size))
        if len(head) == PREFIX.size:
            nxt = start + 8 + PREFIX.unpack(head)[0]
            if pos <= nxt < pos + len(buf) and _valid_at(buf, nxt - pos):
                return nxt
    except Corrupt:
        pass
    limit = min(len(buf), _RESYNC_WINDOW)
    for i in range(limit):
        if _valid_at(buf, i):
            return pos + i
    return None


@dataclass
class _Scan:
    """What the walk over a namespace carries from record to record."""

    client: StoreClient
    rep: VerifyReport
    total: int  # bytes of every generation, for ``progress``
    progress: Callable[[int, int], None] | None
    newest: int | None  # the newest generation with segments
    done: int = 0
    # of the generation being read:
    expected: int | None = None  # seq of the next record (None: after a break, anything goes)
    saw_end: bool = False
    after_end: list[int] = field(default_factory=list)  # first and last seq after SNAPSHOT_END
    auth: ReadAuth = field(default_factory=lambda: ReadAuth(None, ""))
    chain: ChainCheck | None = None  # the journal key's check of the generation being read
    auth_problems: int = 0  # of the generation being read (the first few are listed)

    def count(self, n: int) -> None:
        self.rep.bytes += n
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)


def verify(
    client_factory: Callable[[], StoreClient],
    namespace: str,
    *,
    progress: Callable[[int, int], None] | None = None,
    journal_key: JournalKeys | str | None = None,
) -> VerifyReport:
    """Read and check every record of every generation; returns a VerifyReport.

    Besides each record, it checks that the generations form one chain (protocol.md 2.1:
    each continues the one before it); a break is a problem. Records a restore would not use
    because their generation is not complete are warnings. ``journal_key`` (default: from
    ``$SOS_JOURNAL_KEY`` / ``$SOS_JOURNAL_KEY_FILE``): every record must verify under it
    (protocol.md 2.5); without one an authenticated generation is a problem."""
    auth = ReadAuth(resolve_journal_keys(journal_key), namespace)
    t0 = time.monotonic()
    rep = VerifyReport(namespace)
    client = client_factory()
    try:
        gens = list_generations(client)
        rep.generations = len(gens)
        written = [g for g in gens.values() if g.segments]
        scan = _Scan(
            client,
            rep,
            total=sum(g.total_bytes for g in gens.values()),
            progress=progress,
            newest=written[-1].generation if written else None,
            auth=auth,
        )
        ends: dict[int, tuple[int, bool]] = {}  # generation -> (last whole record, exact)
        for gi, g in enumerate(written):
            nxt = written[gi + 1] if gi + 1 < len(written) else None
            ends[g.generation] = _verify_generation(scan, g, nxt)
        for b in chain_breaks(client, gens, ends=ends):
            rep.problems.append(Problem(b.name, 0, None, b.reason))
        _source_checks(client, rep)
    finally:
        close_quietly(client)
    rep.seconds = time.monotonic() - t0
    return rep


def _source_checks(client: StoreClient, rep: VerifyReport) -> None:
    """What only the source can show: a tier bucket (bucket.BucketClient) reads the pieces
    that are not on the journal's path (another copy of bytes the run holds) and names keys
    the layout did not make. A server's client has neither."""
    problems = getattr(client, "source_problems", None)
    if problems is not None:
        for name, offset, message in problems(layout.GEN_PREFIX):
            rep.problems.append(Problem(name, offset, None, message))
    notes = getattr(client, "source_notes", None)
    if notes is not None:
        rep.notes.extend(notes())


def _note_readiness(rep: VerifyReport, g: layout.GenerationInfo, newest: int | None) -> None:
    """Count a complete generation; say why one is not (a problem, a warning or a note)."""
    if g.ready:
        rep.complete_generations += 1
    elif g.ready_object is not None:
        problem = g.ready_problem
        if g.ready_object[0]:
            rep.problems.append(
                Problem(
                    layout.ready_name(g.generation), 0, None, f"{problem}: generation {g.generation} is not complete"
                )
            )
        elif g.generation == newest:
            rep.notes.append(f"generation {g.generation} is not complete yet ({problem})")
        else:
            rep.warnings.append(f"generation {g.generation} is not complete ({problem}): restore does not use it")
    elif g.generation != newest:
        rep.notes.append(f"generation {g.generation} has no ready object (abandoned snapshot)")
    else:
        rep.notes.append(f"generation {g.generation} is not complete yet (snapshot in progress)")


def _verify_generation(scan: _Scan, g: layout.GenerationInfo, nxt: layout.GenerationInfo | None) -> tuple[int, bool]:
    """Check one generation's segments; returns (its last whole record, exact) as
    ``generation_end()`` sees it, for the chain check."""
    rep = scan.rep
    _note_readiness(rep, g, scan.newest)
    scan.expected, scan.saw_end, scan.after_end = None, False, []
    scan.chain, scan.auth_problems = scan.auth.chain(g.generation), 0
    end, exact = g.segments[0].first_seq - 1, True
    for i, seg in enumerate(g.segments):
        last_here, clean = _verify_segment(scan, g, i, nxt)
        if i == len(g.segments) - 1:  # the generation's end, as generation_end() sees it
            end = last_here if last_here is not None else seg.first_seq - 1
            exact = clean
    if g.ready and not scan.saw_end:
        rep.problems.append(
            Problem(layout.ready_name(g.generation), 0, 0, "generation is marked ready but no SNAPSHOT_END was read")
        )
    if scan.chain is not None and scan.chain.key_id and not scan.auth_problems:
        rep.notes.append(
            f"generation {g.generation}: every record authenticated by journal key {scan.chain.key_id.hex()}"
        )
    after_end = scan.after_end
    if not g.ready and after_end:
        rep.warnings.append(
            f"generation {g.generation} is not complete but holds records {after_end[0]}.."
            f"{after_end[-1]} after its SNAPSHOT_END: restore does not use them (a writer reports no "
            f"record of a generation durable before its ready object exists)"
        )
    return end, exact


def _verify_segment(
    scan: _Scan, g: layout.GenerationInfo, i: int, nxt: layout.GenerationInfo | None
) -> tuple[int | None, bool]:
    """Read segment ``i`` of ``g`` record by record, past any broken range (resynced on the
    next valid record); returns (seq of its last whole record or None, no broken range)."""
    seg = g.segments[i]
    rep = scan.rep
    rep.segments += 1
    last_here = None
    clean = True
    try:
        length = scan.client.stat(seg.name)[0]
    except Exception:  # noqa: BLE001 - fall back to the listed length
        length = seg.length
    offset = 0
    first = True
    while True:
        dec = RecordDecoder(seg.name, offset, keys=scan.auth.for_segment(seg.name))
        try:
            for chunk in read_segment_bytes(scan.client, seg.name, offset):
                dec.feed(chunk)
                scan.count(len(chunk))
                for rec in dec:
                    _check_record(scan, g, seg, rec, first)
                    last_here = rec.seq
                    first = False
            if dec.pending:
                raise JournalTruncated(seg.name, dec.offset, f"segment ends inside a record ({dec.pending} bytes)")
            break
        except JournalTruncated as e:
            _note_truncation(scan, g, i, nxt, e)
            break
        except (JournalCorrupt, ServerCorrupt) as e:
            clean = False
            if isinstance(e, ServerCorrupt):
                try:
                    for _rec in dec:  # whole records before the damage are fine
                        rep.records += 1
                        last_here = _rec.seq
                except JournalCorrupt:
                    pass
            bad = dec.offset
            reason = e.reason if isinstance(e, JournalCorrupt) else e.message
            nxt_off = _resync(scan.client, seg, bad, length)
            rep.problems.append(Problem(seg.name, bad, nxt_off, reason))
            scan.expected = None
            if nxt_off is None:
                break
            offset = nxt_off
    return last_here, clean


def _check_record(scan: _Scan, g: layout.GenerationInfo, seg: layout.SegmentInfo, rec: Record, first: bool) -> None:
    """One decoded record: its seq against the segment's name and the one before it, and
    SNAPSHOT_END against its generation."""
    rep = scan.rep
    rep.records += 1
    if first and rec.seq != seg.first_seq:
        rep.problems.append(
            Problem(
                seg.name,
                rec.offset,
                rec.offset + rec.size,
                f"first record has seq {rec.seq}, name says {seg.first_seq}",
            )
        )
    if scan.expected is not None and rec.seq != scan.expected:
        rep.problems.append(
            Problem(
                seg.name, rec.offset, rec.offset + rec.size, f"sequence gap: expected {scan.expected}, found {rec.seq}"
            )
        )
    scan.expected = rec.seq + 1
    _check_auth(scan, rec)
    rep.first_seq = rep.first_seq or rec.seq
    rep.last_seq = max(rep.last_seq, rec.seq)
    if scan.saw_end:  # a journal record: first and last kept
        scan.after_end[1 if scan.after_end else 0 :] = [rec.seq]
    if type(rec.op) is Encrypted and rec.op.type == RecordType.SNAPSHOT_END:
        scan.saw_end = True  # sealed without the key (its authentication is reported): no more to check
    if type(rec.op) is SnapshotEnd:
        scan.saw_end = True
        if rec.op.generation != g.generation:
            rep.problems.append(
                Problem(seg.name, rec.offset, rec.offset + rec.size, f"SNAPSHOT_END of generation {rec.op.generation}")
            )


_AUTH_LISTED = 10  # records failing the journal key's check listed per generation


def _check_auth(scan: _Scan, rec: Record) -> None:
    """The journal key's check of one record (protocol.md 2.5): a failure is a problem (the
    first few of a generation listed, then one line with the count); the chain goes on from
    the record, so the records after a planted one are checked against it."""
    if scan.chain is None:
        return
    try:
        scan.chain.check(rec)
        return
    except JournalAuthError as e:
        scan.auth_problems += 1
        if scan.auth_problems <= _AUTH_LISTED:
            scan.rep.problems.append(Problem(rec.segment, rec.offset, rec.offset + rec.size, e.reason))
        elif scan.auth_problems == _AUTH_LISTED + 1:
            scan.rep.problems.append(
                Problem(rec.segment, rec.offset, None, "more records fail the journal key's check (not listed)")
            )
    scan.chain.prev = bytes(rec.tag) or scan.chain.prev


def _note_truncation(
    scan: _Scan, g: layout.GenerationInfo, i: int, nxt: layout.GenerationInfo | None, e: JournalTruncated
) -> None:
    """A segment that ends inside a record: a note where a writer abandoned it (the next
    segment or generation starts with the cut record) or is still writing, else a problem."""
    seg = g.segments[i]
    cut = scan.expected if scan.expected is not None else seg.first_seq
    last_seg = i == len(g.segments) - 1
    if last_seg and nxt is not None and nxt.generation == g.generation + 1 and nxt.first_seq == cut:
        scan.rep.notes.append(
            f"{seg.name}: abandoned partial record at offset {e.offset} "
            f"(generation {nxt.generation} starts with record {cut})"
        )
    elif last_seg and not seg.sealed and g.generation == scan.newest:
        scan.rep.notes.append(f"{seg.name}: write in progress at offset {e.offset}")
    elif not last_seg and g.segments[i + 1].first_seq == cut:
        scan.rep.notes.append(
            f"{seg.name}: abandoned partial record at offset {e.offset} (superseded by {g.segments[i + 1].name})"
        )
    else:
        scan.rep.problems.append(Problem(seg.name, e.offset, None, e.reason))
