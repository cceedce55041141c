"""JournalWriter: appends records to the local spool; a replicator thread ships them.

Shipping: each spool segment goes to the server object of the same name with pipelined,
offset-checked, epoch-fenced appends of whole records (``chunk_bytes`` per APPEND,
``pipeline`` APPENDs per round trip, so at most ``chunk_bytes * pipeline`` bytes of journal
are in memory in the replicator). A segment that is complete (a newer one exists) is
sealed on the server, then removed from the spool.

Crash of the writer: the spool survives; ``open()`` fences older epochs, cuts a torn tail
off the newest spool segment and the replicator ships whatever the server lacks (STAT gives
the server's length: nothing missing, nothing doubled). Crash or restart of the server: the
replicator reconnects with backoff, STATs and continues.

Bytes the server holds that this writer has not had acknowledged itself (a STAT or an
OFFSET_MISMATCH reports a length beyond them) are never counted as shipped on the server's
word: the writer sends the spool's bytes for that range again, and the server answers OK
only if it holds exactly those bytes (an identical retry, protocol.md 1.11 APPEND rule 6).
Anything else (another client with an append key wrote there first) stops the writer with
a JournalError, before anything in that segment is acknowledged.

``open()`` refuses a namespace whose generations do not form one chain (protocol.md 2.1),
e.g. a far-future generation someone else published: it would otherwise continue it.

Quota: when the server answers QUOTA_EXCEEDED the writer enters the "quota exceeded" state
(:attr:`JournalWriter.quota_exceeded`, ``status()["state"]``). The journal is one ordered
stream, so nothing after the refused record can become durable either: the spool is kept
(nothing is lost) and the replicator retries with backoff, which drains it by itself once
the operator raises the quota; meanwhile a barrier that waits for records not yet
acknowledged fails promptly with :class:`JournalQuotaExceeded` (after one more attempt, so a
quota raised a moment ago is seen), :meth:`JournalWriter.admit` refuses new changes before
they touch anything, and an append no longer waits for the lag bound (only changes admitted
before the state began are still appended). A successful retry ends the state.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import QuotaExceeded, TierUnavailable
from ..retry import Backoff, retrying
from . import layout
from ._store import (
    Fenced,
    OffsetMismatch,
    SealedError,
    SOSNotFound,
    StoreClient,
    close_quietly,
    fenced_epoch,
    is_retryable,
    mismatch_length,
)
from .errors import (
    GenerationBreak,
    JournalError,
    JournalQuotaExceeded,
    JournalTierBehind,
    JournalTierUnavailable,
    SpoolStale,
    WriterClosed,
    WriterFenced,
)
from .reading import chain_breaks
from .records import HEADER, MAX_RECORD_LENGTH, PREFIX, Op, Record, RecordDecoder, SnapshotEnd, encode
from .spool import Spool, SpoolSegment

log = logging.getLogger("sos.journal.writer")

#: A replicator task: ("seal_foreign", name), ("ready", (generation, seq)),
#: ("ship", segment) or ("seal", segment).
_Task = tuple[str, Any]

#: In the quota state a barrier waits at most this long for one more attempt of the
#: replicator (woken at once) before it fails: a quota raised a moment ago is then seen,
#: and an unreachable server does not turn the prompt refusal into a wait.
QUOTA_RECHECK = 5.0

#: ``durability`` values: a barrier waits for the server's disk, or also for its tier's bucket
DURABILITIES = ("server", "tier")

#: close() waits at most this long for the bucket when neither its timeout nor the writer's
#: tier_patience bounds it (a store down at shutdown must not hold a process forever)
CLOSE_TIER_PATIENCE = 60.0


def server_last_record(client: StoreClient, seg_name: str, length: int | None = None) -> tuple[int, int] | None:
    """(last seq, last time_ns) of the records in one server segment (None if empty)."""
    dec = RecordDecoder(seg_name)
    last: Record | None = None
    for chunk in client.read_iter(seg_name, 0, 0):
        dec.feed(chunk)
        for rec in dec:
            last = rec
    return (last.seq, last.time_ns) if last is not None else None


def _drop_empty(spool: Spool, segs: list[SpoolSegment]) -> tuple[list[SpoolSegment], int]:
    """Remove the empty local segments (created, then the writer died before writing);
    returns the others and the sequence number below every removed one's first."""
    floor = 0
    kept = []
    for s in segs:
        if s.written == 0:
            floor = max(floor, s.first_seq - 1)
            spool.remove(s)
        else:
            kept.append(s)
    return kept, floor


class JournalWriter:
    def __init__(
        self,
        client_factory: Callable[[], StoreClient],
        namespace: str,
        spool_dir: str,
        *,
        sync: bool = True,
        max_lag_bytes: int = 64 << 20,
        segment_bytes: int = 64 << 20,
        generation_bytes: int = 1 << 30,
        chunk_bytes: int = 2 << 20,
        pipeline: int = 4,
        max_backoff: float = 2.0,
        open_timeout: float = 120.0,
        durability: str = "server",
        tier_wait: float = 30.0,
        tier_patience: float | None = None,
    ) -> None:
        """*durability*: "server" or "tier" (see the module docstring); *tier_wait*: seconds one
        TIER_WAIT asks the server to wait (at most 60); *tier_patience*: seconds a barrier
        without a timeout waits for the bucket before it fails with JournalTierBehind (None:
        until the bucket holds its records)."""
        if durability not in DURABILITIES:
            raise ValueError(f"durability must be one of {', '.join(DURABILITIES)}, not {durability!r}")
        if not 0 < tier_wait <= 60:
            raise ValueError(f"tier_wait must be in (0, 60] seconds, not {tier_wait!r}")
        if tier_patience is not None and tier_patience < 0:
            raise ValueError(f"tier_patience must be >= 0 seconds or None, not {tier_patience!r}")
        if chunk_bytes < 8 + MAX_RECORD_LENGTH:
            raise ValueError(f"chunk_bytes must be at least {8 + MAX_RECORD_LENGTH}")
        if max_lag_bytes < 1 or segment_bytes < 1 or generation_bytes < 1 or pipeline < 1:
            raise ValueError("sizes must be positive")
        self.client_factory = client_factory
        self.namespace = namespace
        self.spool_dir = spool_dir
        self.sync = sync
        self.max_lag_bytes = max_lag_bytes
        self.segment_bytes = segment_bytes
        self.generation_bytes = generation_bytes
        self.chunk_bytes = chunk_bytes
        self.pipeline = pipeline
        self.max_backoff = max_backoff
        self.open_timeout = open_timeout
        self.durability = durability
        self.tier_wait = tier_wait
        self.tier_patience = tier_patience
        #: durability "tier": object -> length acknowledged by the server and not known to be in
        #: the tier's bucket (what the next barrier waits for); under self._cv
        self._tier_owed: dict[str, int] = {}
        self._tier_checked = False  # a TIER_WAIT at offset 0 said the server has a working tier
        self._tier_refused = False  # ... or said it has none (close() then waits for the server only)
        self._tier_lock = threading.Lock()  # one barrier asks the server at a time
        self._tier_client: StoreClient | None = None  # its own connection (waits can be long)
        self.tier_waits = 0  # TIER_WAITs answered TIER_WAIT_OK

        self._cv = threading.Condition(threading.Lock())
        self._rotate_lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._spool: Spool | None = None
        self._segs: list[SpoolSegment] = []
        self._cur: SpoolSegment | None = None
        self._foreign_unsealed: list[str] = []
        self._pending_ready: list[tuple[int, int]] = []
        self._new_generations: dict[int, int] = {}  # generation started here -> its first seq
        self._error: BaseException | None = None
        self._closed = False
        self._in_snapshot = False
        self.last_error: BaseException | None = None  # last transient error (for status)
        #: the server's QUOTA_EXCEEDED while the writer is in the quota state (else None),
        #: and the kind of replicator task it refused (a success of that kind ends the state)
        self._quota: BaseException | None = None
        self._quota_kind = ""
        self._quota_since = 0.0
        self._attempts = 0  # replicator attempts finished (success or failure)
        self._failing = False  # the last attempt failed (a retryable error)
        self._wake = threading.Event()  # cuts the replicator's backoff short
        self._admitted = threading.local()  # see admission()

        self.is_open = False
        self.epoch = 0
        self.generation = 0
        self.generation_complete = False
        self.had_spool = False
        self._seq = 0
        self._acked = 0
        self._last_time = 0
        self._gen_bytes = 0
        self.reconnects = 0

    # ------------------------------------------------------------------ state
    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def acked_seq(self) -> int:
        return self._acked

    @property
    def unshipped_bytes(self) -> int:
        with self._cv:
            return self._unshipped()

    @property
    def quota_exceeded(self) -> bool:
        """True while the server refuses the journal for the namespace's quota (the
        replicator keeps the spool and retries; see the module docstring)."""
        return self._quota is not None

    def status(self) -> dict[str, Any]:
        """What the writer is doing, for logs and health checks: ``state`` is "closed",
        "failed" (the replicator stopped: fenced, corrupt, refused key...), "quota_exceeded"
        (waiting for room on the server), "retrying" (a transient error, e.g. the server is
        unreachable, since the last success) or "ok"."""
        with self._cv:
            if self._closed:
                state = "closed"
            elif self._error is not None:
                state = "failed"
            elif self._quota is not None:
                state = "quota_exceeded"
            elif self._failing:
                state = "retrying"
            else:
                state = "ok"
            error = self._error or self._quota or (self.last_error if self._failing else None)
            return {
                "state": state,
                "last_seq": self._seq,
                "acked_seq": self._acked,
                "unshipped_bytes": self._unshipped(),
                "quota_exceeded_for": (time.monotonic() - self._quota_since) if self._quota is not None else 0.0,
                "error": f"{type(error).__name__}: {error}" if error is not None else None,
                "reconnects": self.reconnects,
                "epoch": self.epoch,
                "generation": self.generation,
                "durability": self.durability,
                "tier_owed_objects": len(self._tier_owed),
            }

    def admit(self) -> None:
        """Refuse a new change before it touches the tree while the server refuses the
        journal for quota (JournalQuotaExceeded, ``applied`` False: nothing changed). Inside
        :meth:`admission` of the same thread it lets everything through: a request made of
        several records was admitted as a whole."""
        if getattr(self._admitted, "depth", 0):
            return
        quota = self._quota
        if quota is not None:
            raise JournalQuotaExceeded(
                f"namespace {self.namespace!r} is over its quota on the SOS server ({quota}); nothing was "
                f"changed. The writer keeps {self.unshipped_bytes} bytes of journal in its spool and "
                f"retries: changes are accepted again once the server's operator raises the quota "
                f"(sos-server quota)",
                applied=False,
            )

    @contextlib.contextmanager
    def admission(self) -> Iterator[None]:
        """:meth:`admit` once for a change made of several records (a recursive delete,
        missing parents then a file): the calls of this thread inside are not refused, so
        the change is journaled whole or not at all."""
        self.admit()
        self._admitted.depth = getattr(self._admitted, "depth", 0) + 1
        try:
            yield
        finally:
            self._admitted.depth -= 1

    def _open_spool(self) -> Spool:
        if self._spool is None:
            raise WriterClosed("writer is not open: call open() first")
        return self._spool

    def _unshipped(self) -> int:
        return sum(s.written - max(s.shipped, 0) for s in self._segs)

    # ------------------------------------------------------------------ open
    def open(self) -> None:
        """Fence older epochs and resume from the spool and the server (idempotent)."""
        if self.is_open:
            return
        if self._closed:
            raise WriterClosed("writer is closed")
        self._spool = Spool(self.spool_dir)
        try:
            # a refused or malformed key, a bad name: raised at once (retrying cannot help)
            for attempt in retrying(self.open_timeout, cap=self.max_backoff, log=log, what="open"):
                with attempt:
                    client = self.client_factory()
                    try:
                        self._open_with(client)
                    finally:
                        close_quietly(client)
        except BaseException:
            for s in self._segs:
                s.close()
            self._segs = []
            self._spool.close()
            self._spool = None
            raise
        self.is_open = True
        self._thread = threading.Thread(target=self._run, name=f"sos-replicator-{self.namespace}", daemon=True)
        self._thread.start()

    def _open_with(self, client: StoreClient) -> None:
        """Resume over one connection: the spool's segments, the server's generations, the
        fence; then the position (sequence, generation) from the spool, else the server."""
        for s in self._segs:
            s.close()
        spool = self._open_spool()
        scanned = spool.scan()
        entries = list(client.list(layout.GEN_PREFIX))
        gens = layout.scan_listing(entries)
        self._check_chain(client, gens)
        server_segs = [s for g in gens.values() for s in g.segments]
        max_epoch = max((s.epoch for s in server_segs), default=0)
        # not before the listing and the chain check: an attempt failing there leaves the empty
        # segments (and the floor they give) to the next one
        segs, floor = _drop_empty(spool, scanned)
        if segs:
            self._refuse_stale_spool(spool, segs, server_segs)

        epoch = self._fence(client, max_epoch + 1)

        if segs:
            self._resume_from_spool(client, spool, segs, gens, floor)
        else:
            self._resume_from_server(client, gens, floor)
        self._foreign_unsealed = [s.name for s in server_segs if not s.sealed and s.name not in {x.name for x in segs}]
        # an empty ready object its writer did not get to seal: that writer saw SNAPSHOT_END
        # acknowledged (it creates ready only then); readers count it once sealed
        self._foreign_unsealed += [
            layout.ready_name(g.generation) for g in gens.values() if g.segments and g.ready_object == (0, False)
        ]
        self._segs = segs
        self._cur = None  # new records go to a new segment named with our epoch
        self.epoch = epoch
        if self.durability == "tier":
            self._tier_open(client, entries, gens)

    def _refuse_stale_spool(
        self, spool: Spool, segs: list[SpoolSegment], server_segs: list[layout.SegmentInfo]
    ) -> None:
        """SpoolStale if the server has segments newer than the spool's last: another writer
        took over (continuing the spool would fork the journal)."""
        last = segs[-1]
        newer = [s for s in server_segs if (s.generation, s.first_seq) > (last.generation, last.first_seq)]
        if newer:
            for s in segs:
                s.close()
            raise SpoolStale(
                f"spool {spool.dir} ends at segment {last.name} but the server has newer segment "
                f"{newer[-1].name}: another writer took over namespace {self.namespace!r}; "
                f"move the spool away to start from the server's state"
            )

    def _resume_from_spool(
        self,
        client: StoreClient,
        spool: Spool,
        segs: list[SpoolSegment],
        gens: dict[int, layout.GenerationInfo],
        floor: int,
    ) -> None:
        """The position from the spool's newest segment (completed from the server), and the
        ready objects its finished generations still owe."""
        last = segs[-1]
        # The server may hold more of the newest segment than the spool (spool tail lost
        # with the page cache): fetch it back so that sequence numbers never repeat.
        try:
            slen, _sealed = client.stat(last.name)
        except SOSNotFound:
            slen = 0
        if slen > last.written:
            for chunk in client.read_iter(last.name, last.written, 0):
                last.write(chunk)
        spool.repair(last)
        for s in segs[:-1]:
            s.last_seq = -1  # not needed: only the newest segment is decoded
        self._seq = max(last.last_seq, floor)
        self._last_time = last.last_time
        self.generation = last.generation
        ends = spool.snapshot_ends()
        end = ends.get(self.generation)
        self.generation_complete = end is not None and end <= self._seq
        for g, seq in ends.items():
            if seq > self._seq:
                spool.drop_snapshot_end(g)
            elif not gens.get(g, layout.GenerationInfo(g, [])).ready:
                self._pending_ready.append((g, seq))
        first_unknown = segs[0].first_seq - 1
        self._acked = min(first_unknown, self._seq)
        self.had_spool = True

    def _resume_from_server(self, client: StoreClient, gens: dict[int, layout.GenerationInfo], floor: int) -> None:
        """No spool: the position from the server's newest generation and its last record."""
        self.had_spool = False
        if not any(g.segments for g in gens.values()):
            self.generation = 0
            self._seq = floor
            self.generation_complete = False
        else:
            # the newest generation written (a ready object without segments is older than all
            # of them, or the chain check refused it)
            self.generation = max(g.generation for g in gens.values() if g.segments)
            self.generation_complete = gens[self.generation].ready
            last_seq, last_time = floor, 0
            for info in reversed(list(gens.values())):
                found = None
                for seg_info in reversed(info.segments):
                    if seg_info.length > 0:
                        found = server_last_record(client, seg_info.name)
                        if found:
                            break
                if found:
                    last_seq, last_time = max(found[0], floor), found[1]
                    break
            self._seq = last_seq
            self._last_time = last_time
        self._acked = self._seq

    def _tier_open(self, client: StoreClient, entries: list, gens: dict[int, layout.GenerationInfo]) -> None:
        """Durability "tier" at open: refuse a server without a working tier (a TIER_WAIT at
        offset 0 of any object fails only then, protocol.md 1.11), and owe the bucket the
        objects a restore from it would read (the newest complete generation and any after it),
        which an earlier writer may have left acknowledged but not uploaded."""
        complete = [g.generation for g in gens.values() if g.ready and g.segments]
        floor = max(complete, default=0)
        owed = {s.name: s.length for g in gens.values() if g.generation >= floor for s in g.segments if s.length > 0}
        # a complete generation's ready marker too: a reader of the bucket alone needs it
        owed |= {layout.ready_name(g.generation): 0 for g in gens.values() if g.generation >= floor and g.ready}
        with self._cv:
            self._tier_owed = owed
        if entries:
            self._tier_probe(client, entries[0].name)

    def _check_chain(self, client: StoreClient, gens: dict[int, layout.GenerationInfo]) -> None:
        """Refuse to write after generations that do not form one chain (protocol.md 2.1)."""
        breaks = chain_breaks(client, gens)
        if breaks:
            b = breaks[0]
            raise GenerationBreak(
                b.name,
                f"{b.reason}"
                + "".join(f"; also: {x.reason}" for x in breaks[1:])
                + f". The writer of namespace {self.namespace!r} refuses to open: objects under gen/ were "
                f"written by someone else with an append key (or are damaged) and it would continue them. "
                f"`sos verify` lists every break; the server's operator removes the foreign objects",
                generation=b.generation,
                previous=b.previous or 0,
            )

    def _fence(self, client: StoreClient, start: int) -> int:
        epoch = max(start, 1)
        for _ in range(100):
            try:
                got = client.fence(epoch)
                return int(got) if isinstance(got, int) and got else epoch
            except Fenced as e:  # every FENCED answer is a Fenced (sos_client.errors)
                epoch = max(epoch, fenced_epoch(e)) + 1
        raise JournalError("could not fence the namespace: another writer keeps racing")

    # ------------------------------------------------------------------ append
    def append(self, op: Op) -> int:
        """Write one record to the spool; returns its sequence number.

        Blocks only while the unshipped spool exceeds ``max_lag_bytes``.
        """
        with self._cv:
            self._check_usable()
            # in the quota state nothing drains: a change admitted before it began goes on
            # (admit() refuses new ones), rather than waiting with the caller's locks held
            while self._unshipped() > self.max_lag_bytes and self._quota is None:
                self._cv.wait(1.0)
                self._check_usable()
            seq = self._seq + 1
            now = max(time.time_ns(), self._last_time)
            data = encode(op, seq, now)
            cur = self._cur
            if (
                cur is None
                or cur.generation != self.generation
                or (cur.written and cur.written + len(data) > self.segment_bytes)
            ):
                cur = self._new_segment(seq)
            cur.write(data)
            cur.last_seq = seq
            self._seq = seq
            self._last_time = now
            if not self._in_snapshot:
                self._gen_bytes += len(data)
            self._cv.notify_all()
            return seq

    def _new_segment(self, first_seq: int) -> SpoolSegment:
        if self.generation == 0:
            raise JournalError("no generation yet: call rotate() to start generation 1")
        seg = self._open_spool().create(self.generation, first_seq, self.epoch)
        seg.shipped = -1
        self._segs.append(seg)
        self._cur = seg
        return seg

    def _check_usable(self) -> None:
        if self._error is not None:
            if isinstance(self._error, JournalError):
                raise JournalError(f"replicator stopped: {self._error}") from self._error
            if not isinstance(self._error, (Fenced, SealedError)):
                # a refused key, a bad name, a damaged segment (CORRUPT): not a takeover
                raise JournalError(f"replicator stopped: {type(self._error).__name__}: {self._error}") from self._error
            raise WriterFenced(
                f"writer epoch {self.epoch} was fenced or its segment sealed by a newer writer: {self._error}"
            ) from self._error
        if self._closed:
            raise WriterClosed("writer is closed")
        if not self.is_open:
            raise WriterClosed("writer is not open: call open() first")

    def rotation_due(self) -> bool:
        return self.generation == 0 or self._gen_bytes >= self.generation_bytes

    def rotate(self, snapshot_ops: Iterable[Op]) -> int:
        """Start generation G+1: the snapshot records, then SNAPSHOT_END; returns its seq.

        The caller guarantees that no other record is appended meanwhile (JournaledTree holds
        its lock) so the snapshot is the tree at the end of generation G.
        """
        with self._rotate_lock:
            with self._cv:
                self._check_usable()
                if self.generation >= layout.MAX_GENERATION:
                    raise JournalError(
                        f"generation {self.generation} is the last one a segment name can hold "
                        f"(protocol.md 2.1): namespace {self.namespace!r} cannot start another"
                    )
                self.generation += 1
                self.generation_complete = False
                self._gen_bytes = 0
                self._in_snapshot = True
                gen = self.generation
                self._new_generations[gen] = self._seq + 1
            try:
                for op in snapshot_ops:
                    self.append(op)
                with self._cv:
                    self._open_spool().set_snapshot_end(gen, self._seq + 1)
                seq = self.append(SnapshotEnd(gen))
            finally:
                with self._cv:
                    self._in_snapshot = False
            with self._cv:
                self._pending_ready.append((gen, seq))
                self._cv.notify_all()
            if self.sync:
                self.barrier(seq)
            return seq

    # ------------------------------------------------------------------ barrier
    def barrier(self, seq: int | None = None, timeout: float | None = None) -> None:
        """Block until every record <= seq (default: all so far) is durable on the server
        and restorable: the ``ready`` object of every generation that starts at or before
        ``seq`` exists (restore ignores a generation without it, so records acked after an
        asynchronous rotation would otherwise not count). With durability "tier", then until
        the server's tier holds them too (the module docstring): JournalTierBehind after
        ``timeout`` (else ``tier_patience``), JournalTierUnavailable if the server has no
        working tier."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._server_barrier(seq, deadline, timeout)
        if self.durability == "tier":
            if deadline is None and self.tier_patience is not None:
                deadline = time.monotonic() + self.tier_patience
            self._tier_barrier(deadline)

    def _server_barrier(self, seq: int | None, deadline: float | None, timeout: float | None) -> None:
        with self._cv:
            target = self._seq if seq is None else seq
            while not self._durable(target):
                if self._error is not None:
                    self._check_usable()
                if self._thread is None or not self._thread.is_alive():
                    raise WriterClosed(f"replicator is not running; records up to {target} not acked")
                if self._quota is not None:
                    self._recheck_quota(target, deadline)
                    continue
                wait = 1.0
                if deadline is not None:
                    wait = deadline - time.monotonic()
                    if wait <= 0:
                        raise TimeoutError(
                            f"barrier: record {target} not durable after {timeout} s "
                            f"(acked {self._acked}; last error: {self.last_error})"
                        )
                    wait = min(wait, 1.0)
                self._cv.wait(wait)

    # ------------------------------------------------------------------ durability "tier"
    def _tier_barrier(self, deadline: float | None) -> None:
        """Wait until the tier holds every object this writer owes it, as owed now (the
        server's durability of the barrier's records is already there)."""
        # one barrier asks at a time: the others wait here, then find its answers
        if not self._tier_lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise JournalTierBehind(
                f"barrier: another barrier of namespace {self.namespace!r} is still waiting for "
                f"the object-store tier after the caller's patience ran out"
            )
        try:
            with self._cv:
                owed = sorted(self._tier_owed.items())
            for name, length in owed:
                self._tier_wait_for(name, length, deadline)
        finally:
            self._tier_lock.release()

    def check_tier(self, timeout: float | None = None) -> None:
        """Durability "tier": make sure the server has a working tier (JournalTierUnavailable
        otherwise), if open() could not ask (a new namespace held no object yet): waits until
        something is durable on the server, then asks about it. A no-op once known."""
        if self.durability != "tier" or self._tier_checked:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        self._server_barrier(None, deadline, timeout)
        with self._cv:
            names = sorted(self._tier_owed)
        if not names:
            return  # nothing on the server yet: the first barrier asks
        with self._tier_lock:
            for attempt in retrying(self.open_timeout if timeout is None else timeout, cap=self.max_backoff):
                with attempt:
                    try:
                        self._tier_probe(self._tier_conn(), names[0])
                    except JournalError:
                        raise
                    except Exception:
                        self._tier_drop()
                        raise

    def _tier_conn(self) -> StoreClient:
        if self._tier_client is None:
            self._tier_client = self.client_factory()
        return self._tier_client

    def _tier_drop(self) -> None:
        client, self._tier_client = self._tier_client, None
        close_quietly(client)

    def _tier_probe(self, client: StoreClient, name: str) -> None:
        """TIER_WAIT ``name`` at offset 0 (answered at once): fails only when the server has no
        tier or its tier stopped copying the namespace or the object (protocol.md 1.11)."""
        wait = getattr(client, "tier_wait", None)
        if wait is None:
            raise JournalTierUnavailable(
                f"durability 'tier' for namespace {self.namespace!r}: this client "
                f"({type(client).__name__}) cannot ask for the server's tier (TIER_WAIT)"
            )
        try:
            wait(name, 0, 0)
        except TierUnavailable as e:
            if "no tier configured" not in e.message and "tier stopped" not in e.message:
                # rule 7: the tier is there and has not caught up yet (a sealed object's marker, an
                # object not copied yet): the barriers wait for it
                self._tier_checked = True
                return
            self._tier_refused = True
            no_tier = "no tier configured" in e.message
            raise JournalTierUnavailable(
                f"durability 'tier' for namespace {self.namespace!r}: "
                + (
                    "the SOS server has no object-store tier: start it with `sos-server serve --tier URL`, "
                    "or use durability 'server'"
                    if no_tier
                    else "the SOS server's tier does not copy this namespace's journal (another server took the "
                    "namespace over in the bucket, or a conflict: see the server's log)"
                )
                + f" ({e})"
            ) from e
        self._tier_checked = True

    def _tier_wait_for(self, name: str, length: int, deadline: float | None) -> None:
        """Until the tier holds ``name`` up to ``length``: TIER_WAIT, asked again after each
        TIER_UNAVAILABLE (the bucket behind) and each lost connection, until ``deadline``."""
        backoff = Backoff(self.max_backoff)
        last: BaseException | None = None
        tiered = 0
        recheck = False  # after a TIER_UNAVAILABLE: is the tier behind, or not copying at all?
        while True:
            if self._closed:
                raise WriterClosed(f"writer closed while waiting for the tier to hold {name} up to {length}")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0 and last is not None:
                raise JournalTierBehind(
                    f"barrier: the journal of namespace {self.namespace!r} is durable on the SOS server but its "
                    f"object-store tier (the bucket) holds {tiered} of the {length} bytes of {name} waited for, "
                    f"after the caller's patience ran out: {last}. Nothing is lost: the server keeps uploading",
                    segment=name,
                    tiered=tiered,
                    wanted=length,
                ) from last
            wait = self.tier_wait if left is None else min(self.tier_wait, max(0.0, left))
            started = time.monotonic()
            try:
                client = self._tier_conn()
                if recheck or not self._tier_checked:
                    self._tier_probe(client, name)  # JournalTierUnavailable: it will never have it
                    recheck = False
                got = client.tier_wait(name, length, wait)  # type: ignore[attr-defined]  # _tier_probe found it
            except TierUnavailable as e:
                last, tiered, recheck = e, max(tiered, e.length), True
                if time.monotonic() - started < wait / 2:  # answered early: do not ask in a loop
                    self._tier_sleep(backoff.next(), deadline)
                continue
            except JournalError:
                raise
            except Exception as e:
                if not is_retryable(e):
                    raise JournalError(
                        f"barrier: waiting for the tier to hold {name} up to {length}: {type(e).__name__}: {e}"
                    ) from e
                last = e
                self._tier_drop()
                delay = backoff.next()
                log.warning("barrier: waiting for the tier: %s: %s; retrying in %.2fs", type(e).__name__, e, delay)
                self._tier_sleep(delay, deadline)
                continue
            with self._cv:
                if self._tier_owed.get(name, 0) <= got:
                    self._tier_owed.pop(name, None)
                self.tier_waits += 1
            return

    def _tier_sleep(self, delay: float, deadline: float | None) -> None:
        if deadline is not None:
            delay = min(delay, max(0.0, deadline - time.monotonic()))
        self._stop.wait(delay)

    def _durable(self, target: int) -> bool:
        return self._acked >= target and not any(s <= target for _, s in self._pending_ready)

    def _recheck_quota(self, target: int, deadline: float | None) -> None:
        """With the lock held, in the quota state: wake the replicator for one more attempt
        and wait for it (at most QUOTA_RECHECK s); raise JournalQuotaExceeded if the server
        still refuses and ``target`` is not durable."""
        attempts = self._attempts
        self._wake.set()
        limit = time.monotonic() + QUOTA_RECHECK
        if deadline is not None:
            limit = min(limit, deadline)
        while (
            self._quota is not None and self._attempts == attempts and self._error is None and not self._durable(target)
        ):
            left = limit - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)
        if self._quota is not None and self._error is None and not self._durable(target):
            raise JournalQuotaExceeded(
                f"namespace {self.namespace!r} is over its quota on the SOS server ({self._quota}): record "
                f"{target} cannot become durable (acknowledged up to {self._acked}). It and every record "
                f"before it stay in the spool and are shipped, in order, once the server's operator raises "
                f"the quota (sos-server quota)",
                applied=True,
            )

    # ------------------------------------------------------------------ close
    def close(self, timeout: float | None = None) -> None:
        """Flush (wait until everything is acked, up to ``timeout``) and stop the replicator."""
        if self._closed:
            return
        try:
            if self.is_open and self._error is None:
                try:
                    deadline = None if timeout is None else time.monotonic() + timeout
                    self._server_barrier(None, deadline, timeout)
                    if self.durability == "tier" and not self._tier_refused:
                        if deadline is None:
                            patience = self.tier_patience if self.tier_patience is not None else CLOSE_TIER_PATIENCE
                            deadline = time.monotonic() + patience
                        self._tier_barrier(deadline)
                except (TimeoutError, JournalError) as e:
                    log.warning("close: journal not fully shipped: %s", e)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Stop now without shipping what is left: the spool stays on disk as it is, and the
        next writer opened on it ships it (exactly what a process kill leaves behind). For a
        process that must exit at once, and for tests of recovery."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._cv:
            for s in self._segs:
                s.close()
        if self._spool is not None:
            self._spool.close()
        self._tier_drop()

    def __enter__(self) -> JournalWriter:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ replicator
    def _next_task(self) -> _Task | None:
        if self._foreign_unsealed:
            return ("seal_foreign", self._foreign_unsealed[0])
        for g, seq in self._pending_ready:
            if seq <= self._acked:
                return ("ready", (g, seq))
        for s in self._segs:
            if s.shipped < s.written:
                return ("ship", s)
        for s in self._segs[:-1]:
            if s is not self._cur:
                return ("seal", s)
        return None

    def _run(self) -> None:
        client = None
        backoff = Backoff(self.max_backoff)
        while True:
            with self._cv:
                task = None
                while self._error is None:
                    task = self._next_task()
                    if task is not None or self._closed:
                        break
                    self._cv.wait()
                if task is None:
                    break
            try:
                if client is None:
                    client = self.client_factory()
                self._do(client, task)
                backoff.reset()
                self._attempted(task, None)
            except Exception as e:  # noqa: BLE001 - classified below, never swallowed silently
                if not is_retryable(e):
                    # Fenced/Sealed: a newer writer; JournalError: the spool and the server
                    # disagree; CORRUPT, BAD_REQUEST, a refused key...: repeating cannot help
                    log.error("replicator stopped: %s", e)
                    with self._cv:
                        self._error = e
                        self._attempts += 1
                        self._cv.notify_all()
                    break
                self.last_error = e
                self._attempted(task, e)
                delay = backoff.next()
                log.warning("replicator: %s: %s; retrying in %.2fs", type(e).__name__, e, delay)
                close_quietly(client)
                client = None
                self.reconnects += 1
                with self._cv:
                    for s in self._segs:
                        s.shipped = -1  # ask the server again after reconnecting
                # a barrier in the quota state cuts the wait short (_recheck_quota)
                self._wake.wait(delay)
                self._wake.clear()
                if self._stop.is_set():
                    break
        close_quietly(client)

    def _attempted(self, task: _Task, error: BaseException | None) -> None:
        """After each attempt: enter the quota state on QUOTA_EXCEEDED, leave it when a task
        of the kind the server refused succeeds; wake the barriers waiting on it."""
        with self._cv:
            self._attempts += 1
            if isinstance(error, QuotaExceeded):
                if self._quota is None:
                    self._quota_since = time.monotonic()
                    log.warning(
                        "replicator: namespace %r is over its quota on the server: the spool "
                        "(%d bytes unshipped) is kept and retried; barriers fail and new changes "
                        "are refused until the quota is raised: %s",
                        self.namespace,
                        self._unshipped(),
                        error,
                    )
                self._quota = error
                self._quota_kind = task[0]
            elif error is None and self._quota is not None and task[0] == self._quota_kind:
                log.warning(
                    "replicator: the server accepts namespace %r's journal again after %.1f s over its quota",
                    self.namespace,
                    time.monotonic() - self._quota_since,
                )
                self._quota = None
            self._failing = error is not None
            self._cv.notify_all()

    def _do(self, client: StoreClient, task: _Task) -> None:
        kind, arg = task
        if kind == "seal_foreign":
            with contextlib.suppress(SOSNotFound):
                client.seal(arg, epoch=self.epoch)
            with self._cv:
                self._foreign_unsealed.remove(arg)
        elif kind == "ready":
            g, _seq = arg
            name = layout.ready_name(g)
            try:
                length, _sealed = client.stat(name)
            except SOSNotFound:
                length = 0
                try:
                    client.append(name, 0, b"", epoch=self.epoch)
                except OffsetMismatch as e:
                    length = mismatch_length(e)  # created meanwhile (by a retry that landed?)
            if length:
                raise JournalError(
                    f"{name} holds {length} bytes: a ready object is empty, so this one was not "
                    f"written by a writer (someone else with an append key?); generation {g} "
                    f"cannot be marked complete"
                )
            client.seal(name, epoch=self.epoch)
            with self._cv:
                if self.durability == "tier":
                    # TIER_WAIT on a sealed object waits for its seal marker (protocol.md 1.11 rule 6)
                    self._tier_owed.setdefault(name, 0)
                self._pending_ready.remove(arg)
                if g == self.generation:
                    self.generation_complete = True
                self._cv.notify_all()
        elif kind == "ship":
            self._ship(client, arg)
        elif kind == "seal":
            seg = arg
            if seg.written:
                client.seal(seg.name, epoch=self.epoch)
            with self._cv:
                self._segs.remove(seg)
                self._open_spool().remove(seg)

    def _ship(self, client: StoreClient, seg: SpoolSegment) -> None:
        if self._new_generations.get(seg.generation) == seg.first_seq:
            self._check_new_generation(client, seg)
        if seg.shipped < 0:
            try:
                length, _sealed = client.stat(seg.name)
            except SOSNotFound:
                length = 0
            if length > seg.written:
                raise JournalError(f"server object {seg.name} is longer ({length}) than the spool ({seg.written})")
            if length > seg.confirmed:
                self._confirm(client, seg, length)  # bytes we have not had acknowledged ourselves
            with self._cv:
                seg.confirmed = length
                seg.shipped = length
                if length in (0, seg.written):
                    seg.boundary = length
                self._owe_tier(seg.name, length)
                self._after_ack(None)
            if length == seg.written:
                return
        with self._cv:
            offset, end = seg.shipped, seg.written
        chunks = []
        pos = offset
        last_seq = None
        if offset != seg.boundary:
            # The server's length came from STAT or an OFFSET_MISMATCH: it may fall inside a
            # record (a multi-frame append cut by a crash). Complete that record first.
            b, seq = seg.next_boundary(offset)
            if b > offset:
                chunks.append(seg.pread(b - offset, offset))
                last_seq = seq
                pos = b
            else:
                seg.boundary = offset
        while len(chunks) < self.pipeline and pos < end:
            n = min(self.chunk_bytes, end - pos)
            buf = seg.pread(n, pos)
            cut = 0
            while cut + PREFIX.size <= n:
                length = PREFIX.unpack_from(buf, cut)[0]
                if cut + 8 + length > n:
                    break
                last_seq = HEADER.unpack_from(buf, cut)[3]
                cut += 8 + length
            if cut == 0:
                raise JournalError(f"spool segment {seg.path}: no whole record at offset {pos}")
            chunks.append(buf if cut == n else buf[:cut])
            pos += cut
        total = sum(len(c) for c in chunks)
        try:
            if len(chunks) == 1 or not hasattr(client, "append_many"):
                new_len = offset
                for c in chunks:
                    new_len = client.append(seg.name, new_len, c, epoch=self.epoch)
            else:
                new_len = client.append_many(seg.name, offset, chunks, epoch=self.epoch)
        except OffsetMismatch as e:
            have = mismatch_length(e)
            if have > seg.written:
                raise JournalError(f"server object {seg.name} is longer ({have}) than the spool ({seg.written})") from e
            with self._cv:
                seg.shipped = -1  # STAT, then confirm whatever we did not send ourselves
            return
        if new_len != offset + total:
            # The server says another length: believe it after a STAT on the next round.
            with self._cv:
                seg.shipped = -1
            return
        with self._cv:
            seg.shipped = new_len
            seg.confirmed = new_len  # acknowledged to us: ours (appended, or compared by the server)
            seg.boundary = new_len  # every APPEND round ends on a record boundary
            self._owe_tier(seg.name, new_len)
            self._after_ack(last_seq)

    def _check_new_generation(self, client: StoreClient, seg: SpoolSegment) -> None:
        """Before the first segment of a generation this writer started goes out: nobody else
        has objects in that generation (else the journal would mix them in, protocol.md 2.1)."""
        prefix = layout.gen_prefix(seg.generation)
        others = sorted(e.name for e in client.list(prefix) if e.name != seg.name)
        if others:
            raise JournalError(
                f"generation {seg.generation} that this writer starts already holds "
                f"{', '.join(others[:3])}{' ...' if len(others) > 3 else ''}: written by "
                f"someone else with an append key; the writer stops rather than mix them "
                f"into the journal"
            )
        with self._cv:
            self._new_generations.pop(seg.generation, None)

    def _confirm(self, client: StoreClient, seg: SpoolSegment, end: int) -> None:
        """Make sure the server's bytes ``[seg.confirmed, end)`` of ``seg`` are the spool's: send
        them again at their offsets. The server acknowledges an identical retry without writing
        anything and refuses different bytes (OFFSET_MISMATCH, or SEALED if sealed), so bytes
        this writer did not send are never counted as acknowledged."""
        pos = seg.confirmed
        while pos < end:
            chunks: list[bytes] = []
            nxt = pos
            while len(chunks) < self.pipeline and nxt < end:
                n = min(self.chunk_bytes, end - nxt)
                chunks.append(seg.pread(n, nxt))
                nxt += n
            try:
                if len(chunks) == 1 or not hasattr(client, "append_many"):
                    got = pos
                    for c in chunks:
                        got = client.append(seg.name, got, c, epoch=self.epoch)
                else:
                    got = client.append_many(seg.name, pos, chunks, epoch=self.epoch)
            except (OffsetMismatch, SealedError) as e:
                raise JournalError(
                    f"server object {seg.name} holds bytes in [{pos}, {nxt}) that differ from this writer's "
                    f"spool ({seg.path}): this writer did not send them (another client with an append key "
                    f"wrote there first?); they are not counted as acknowledged and the writer stops "
                    f"({type(e).__name__}: {e})"
                ) from e
            if got != nxt:
                raise JournalError(
                    f"server object {seg.name}: re-sending [{pos}, {nxt}) to compare it answered length {got}"
                )
            with self._cv:
                seg.confirmed = nxt
            pos = nxt

    def _owe_tier(self, name: str, length: int) -> None:
        """With the lock held: the server acknowledged ``name`` up to ``length`` (whole records):
        under durability "tier" the next barrier waits for the bucket to hold that much."""
        if self.durability == "tier" and length > self._tier_owed.get(name, 0):
            self._tier_owed[name] = length

    def _after_ack(self, last_seq: int | None) -> None:
        """Called with the lock held after the server acknowledged data."""
        if all(s.shipped == s.written for s in self._segs):
            self._acked = self._seq
        elif last_seq is not None and last_seq > self._acked:
            self._acked = last_seq
        self._cv.notify_all()
