"""The replicator of a JournalWriter: the thread that ships the spool to the server.

:class:`Replicator` (a role of :class:`~sos_journal.writer.writer.JournalWriter`) runs
``_run`` in its own thread. Its tasks, in this order: seal the objects older writers left
unsealed, create and seal the ``ready`` object of a generation whose SNAPSHOT_END is
acknowledged, ship what the server lacks of each spool segment, seal a complete segment (a
newer one exists) and remove it from the spool.

Shipping: each spool segment goes to the server object of the same name with pipelined,
offset-checked, epoch-fenced appends of whole records (``chunk_bytes`` per APPEND,
``pipeline`` APPENDs per round trip, so at most ``chunk_bytes * pipeline`` bytes of journal
are in memory in the replicator). Crash or restart of the server: the replicator reconnects
with backoff, STATs and continues (nothing missing, nothing doubled).

Bytes the server holds that this writer has not had acknowledged itself (a STAT or an
OFFSET_MISMATCH reports a length beyond them) are never counted as shipped on the server's
word: the writer sends the spool's bytes for that range again, and the server answers OK
only if it holds exactly those bytes (an identical retry, protocol.md 1.11 APPEND rule 6).
Anything else (another client with an append key wrote there first) stops the writer with
a JournalError, before anything in that segment is acknowledged.

Rounds of another transport (``claim_round``, ``round_done``, ``round_failed``): a caller
that waits for records and can send an APPEND round itself (the gateway's event loop,
loop_ship.py) claims the next round, chosen here as the thread would; the thread ships
nothing while it is out, and the answer goes through the same bookkeeping
(``_acknowledged``). Only a plain round is claimable (a known server length, on a record
boundary, no generation check due, the writer healthy); a failed one is the thread's again
(a STAT, then the confirmation above), and rounds are claimable again after its next
success. The thread waits on its own condition (``_work``): appends, barriers that want
held-back records and the close wake it, acknowledgements do not.

A retryable failure is retried with backoff; QUOTA_EXCEEDED puts the writer in the quota
state until a task of the refused kind succeeds (the writer's module docstring); any other
failure stops the replicator and every later call of the writer raises it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from sos_client.errors import QuotaExceeded
from sos_client.retry import Backoff
from sos_journal.errors import JournalError
from sos_journal.format import layout
from sos_journal.format.records import HEADER, PREFIX
from sos_journal.store import (
    OffsetMismatch,
    SealedError,
    SOSNotFound,
    StoreClient,
    close_quietly,
    is_retryable,
    mismatch_length,
    without_reconnects,
)
from sos_journal.writer.spool import SpoolSegment
from sos_journal.writer.state import WriterState

__all__ = ["Replicator", "ShipRound", "append_round"]

log = logging.getLogger(__name__)

#: A replicator task: ("seal_foreign", name), ("ready", (generation, seq)),
#: ("ship", segment) or ("seal", segment).
_Task = tuple[str, Any]


class ShipRound:
    """One APPEND round of a spool segment: ``chunks`` (whole records) from ``offset`` on;
    ``last_seq``: the sequence number of its last record."""

    __slots__ = ("chunks", "last_seq", "offset", "seg", "total")

    def __init__(self, seg: SpoolSegment, offset: int, chunks: list[bytes], last_seq: int | None) -> None:
        self.seg = seg
        self.offset = offset
        self.chunks = chunks
        self.last_seq = last_seq
        self.total = sum(len(c) for c in chunks)


def append_round(client: StoreClient, name: str, offset: int, chunks: list[bytes], epoch: int) -> int:
    """Append ``chunks`` to ``name`` from ``offset`` on in one round trip where the client can
    pipeline them (``append_many``), else one APPEND each; returns the server's new length."""
    if len(chunks) == 1 or not hasattr(client, "append_many"):
        new_len = offset
        for c in chunks:
            new_len = client.append(name, new_len, c, epoch=epoch)
        return new_len
    return client.append_many(name, offset, chunks, epoch=epoch)


class Replicator(WriterState):
    """The replicator thread's side of a writer (see the module docstring)."""

    #: called without the lock, from the replicator's thread, after each of its attempts
    #: (an acknowledgement, a failure, its stop): a caller of ``durable_now()`` (barrier_waits.py)
    #: that got False asks again then. It must be quick; what it raises is logged.
    progress_listener: Callable[[], None] | None = None

    def _progress(self) -> None:
        """Tell :attr:`progress_listener` (without the lock held)."""
        listener = self.progress_listener
        if listener is not None:
            try:
                listener()
            except Exception:  # a listener's bug must not stop the replicator
                log.exception("progress listener failed")

    def _next_task(self) -> _Task | None:
        if self._foreign_unsealed:
            return ("seal_foreign", self._foreign_unsealed[0])
        for g, seq in self._pending_ready:
            if seq <= self._acked:
                return ("ready", (g, seq))
        if self._shipper == "loop":
            return None  # a claimed round is out: the spool's segments wait for it
        for s in self._segs:
            if s.shipped < s.written:
                return ("ship", s)
        for s in self._segs[:-1]:
            if s is not self._cur:
                return ("seal", s)
        return None

    def _hold(self, task: _Task, until: float) -> float:
        """With the lock held: how long to hold ``task`` back still (0: do it now). A ship
        waits up to :attr:`linger` after the replicator found it (``until``) while no barrier
        waits for a record (``_wanted``), the writer is not closing and the spool is far from
        its lag bound: the records appended meanwhile go in the same round, one APPEND round
        trip (and one wake-up of the writer's threads) for several changes."""
        if task[0] != "ship" or self._closed or self._wanted > self._acked:
            return 0.0
        if 2 * self._unshipped() > self.max_lag_bytes:
            return 0.0
        return max(0.0, until - time.monotonic())

    def _next_due(self) -> _Task | None:
        """With the lock held: the next task, once it is due (:meth:`_hold`); None when the
        writer failed or closed with nothing left to do. A ship or a seal is claimed for the
        thread (``_shipper``) until :meth:`_run` is done with it."""
        until = time.monotonic() + self.linger
        while self._error is None:
            task = self._next_task()
            if task is None:
                if self._closed:
                    return None
                # a writer whose barriers an event loop ships (loop_ship.py) is not woken by
                # appends: it looks for records no barrier waits for every linger by itself
                polls = self.linger > 0 and self.loop_client_factory is not None and self.poll_records
                poll = self.linger if polls else None
                self._idle, self._polling = True, poll is not None
                try:
                    woken = self._work.wait(poll)
                finally:
                    self._idle = self._polling = False
                # (records found by a poll waited a linger already: they go now)
                until = time.monotonic() + (self.linger if woken else 0.0)
                continue
            held = self._hold(task, until) if self.linger > 0 else 0.0
            if held <= 0:
                if task[0] in ("ship", "seal"):
                    self._shipper = "thread"
                return task
            self._lingering = True
            try:
                self._work.wait(held)
            finally:
                self._lingering = False
        return None

    def _run(self) -> None:
        client = None
        backoff = Backoff(self.max_backoff)
        while True:
            with self._cv:
                task = self._next_due()
                if task is None:
                    break
            try:
                if client is None:  # (the loop below is its retry: the client's own is off)
                    client = without_reconnects(self.client_factory())
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
                        if self._shipper == "thread":
                            self._shipper = None
                        self._cv.notify_all()
                    self._progress()
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
                # a barrier in the quota state cuts the wait short (Barriers._recheck_quota)
                self._wake.wait(delay)
                self._wake.clear()
                if self._stop.is_set():
                    break
        close_quietly(client)
        self._progress()  # stopped: a caller of durable_now() learns it from barrier()

    def _attempted(self, task: _Task, error: BaseException | None) -> None:
        """After each attempt: enter the quota state on QUOTA_EXCEEDED, leave it when a task
        of the kind the server refused succeeds; wake the barriers waiting on it."""
        with self._cv:
            self._attempts += 1
            if self._shipper == "thread":
                self._shipper = None
            if error is None and task[0] == "ship":
                self._claims_ok = True
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
        self._progress()

    def _do(self, client: StoreClient, task: _Task) -> None:
        kind, arg = task
        if kind == "seal_foreign":
            with contextlib.suppress(SOSNotFound):
                client.seal(arg, epoch=self.epoch)
            with self._cv:
                self._foreign_unsealed.remove(arg)
        elif kind == "ready":
            self._make_ready(client, arg)
        elif kind == "ship":
            self._ship(client, arg)
        elif kind == "seal":
            seg = arg
            if seg.written:
                client.seal(seg.name, epoch=self.epoch)
            with self._cv:
                self._segs.remove(seg)
                self._open_spool().remove(seg)

    def _make_ready(self, client: StoreClient, pending: tuple[int, int]) -> None:
        """Create (empty) and seal generation ``g``'s ready object: its SNAPSHOT_END is
        acknowledged, so a restore may now count the generation."""
        g, _seq = pending
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
                self._tier.owe_seal(name)
            self._pending_ready.remove(pending)
            if g == self.generation:
                self.generation_complete = True
            self._cv.notify_all()

    def _ship(self, client: StoreClient, seg: SpoolSegment) -> None:
        """One round of appends of ``seg``'s unshipped records (after a STAT if the server's
        length is not known)."""
        if self._new_generations.get(seg.generation) == seg.first_seq:
            self._check_new_generation(client, seg)
        if seg.shipped < 0 and self._restat(client, seg):
            return
        with self._cv:
            offset, end = seg.shipped, seg.written
        chunks, last_seq = self._gather(seg, offset, end)
        rnd = ShipRound(seg, offset, chunks, last_seq)
        try:
            new_len = append_round(client, seg.name, offset, chunks, self.epoch)
        except OffsetMismatch as e:
            have = mismatch_length(e)
            if have > seg.written:
                raise JournalError(f"server object {seg.name} is longer ({have}) than the spool ({seg.written})") from e
            new_len = -1  # STAT, then confirm whatever we did not send ourselves
        with self._cv:
            self._acknowledged(rnd, new_len)

    def _acknowledged(self, rnd: ShipRound, new_len: int) -> None:
        """With the lock held: the server answered a round of :meth:`_ship` or of a claimed
        round (:meth:`claim_round`) with its new length ``new_len`` (-1: an OFFSET_MISMATCH).
        The length the round makes counts as shipped and confirmed (acknowledged to us: ours,
        appended, or compared by the server); any other answer is believed only after a STAT
        (``shipped = -1``), which the thread makes."""
        seg = rnd.seg
        if new_len != rnd.offset + rnd.total:
            seg.shipped = -1
            return
        seg.shipped = new_len
        seg.confirmed = new_len
        seg.boundary = new_len  # every APPEND round ends on a record boundary
        self._owe_tier(seg.name, new_len)
        self._after_ack(rnd.last_seq)

    # ------------------------------------------------------------ rounds of another transport
    def claim_round(self, target: int) -> ShipRound | None:
        """For a transport other than the thread's blocking client (the gateway's event loop):
        a barrier waits for every record up to ``target``; the next APPEND round, claimed
        (the thread ships nothing meanwhile), to send with :func:`append_round`'s arguments
        and then report with :meth:`round_done` or :meth:`round_failed`. None when only the
        thread may ship now: it is shipping, the next task is another (a seal, a ready
        object, a STAT after a reconnect, a new generation's check, a record to complete), or
        the writer is not plainly healthy (failed, closed, quota, retrying, a claimed round
        failed since the thread's last success); the thread is then told the barrier waits
        (it ships at once), and the caller waits for its progress."""
        with self._cv:
            if target > self._wanted:
                self._wanted = target
            if (
                self._shipper is not None
                or not self._claims_ok
                or self._error is not None
                or self._closed
                or self._quota is not None
                or self._failing
                or not self.is_open
            ):
                self._leave_to_thread()
                return None
            task = self._next_task()
            if task is None or task[0] != "ship":
                self._leave_to_thread()
                return None
            seg = task[1]
            if (
                seg.shipped < 0
                or seg.shipped != seg.boundary
                or self._new_generations.get(seg.generation) == seg.first_seq
            ):
                self._leave_to_thread()
                return None
            self._shipper = "loop"
            offset, end = seg.shipped, seg.written
        try:
            chunks, last_seq = self._gather(seg, offset, end)
        except Exception:  # noqa: BLE001 - a damaged spool: the thread gives the verdict when it gathers it
            self.round_failed(None)
            return None
        return ShipRound(seg, offset, chunks, last_seq)

    def _leave_to_thread(self) -> None:
        """With the lock held: a claim refused; the thread, if it holds records back, ships
        them now (a barrier waits)."""
        if self._lingering or self._idle:
            self._work.notify()

    def round_done(self, rnd: ShipRound, new_len: int) -> None:
        """The server acknowledged a claimed round: its new length ``new_len`` (see
        :meth:`_acknowledged`); the claim is released."""
        with self._cv:
            self._acknowledged(rnd, new_len)
            self._release_claim()

    def round_failed(self, rnd: ShipRound | None) -> None:
        """A claimed round failed (its APPENDs may or may not have landed): the segment's
        server length is asked again and every later round is the thread's, with its
        reconnects, backoff, quota state and verdicts, until its next success."""
        with self._cv:
            if rnd is not None:
                rnd.seg.shipped = -1
            self._claims_ok = False
            self._release_claim()

    def _release_claim(self) -> None:
        """With the lock held: the claimed round is over; the thread is woken if it waits
        with work left (records appended meanwhile, a seal, a ready object, a STAT), or holds
        back records a barrier still waits for (the round failed)."""
        if self._shipper == "loop":
            self._shipper = None
        held = self._lingering or self._polling  # (it looks again by itself)
        if (self._idle and not self._polling and (self._next_task() is not None or self._closed)) or (
            held and self._wanted > self._acked
        ):
            self._work.notify()

    def _restat(self, client: StoreClient, seg: SpoolSegment) -> bool:
        """The server's length of ``seg`` (confirming bytes this writer did not have
        acknowledged itself); True if it holds the whole segment."""
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
        return length == seg.written

    def _gather(self, seg: SpoolSegment, offset: int, end: int) -> tuple[list[bytes], int | None]:
        """The chunks of one APPEND round from ``offset`` (at most ``pipeline`` chunks of at
        most ``chunk_bytes``, each ending on a record boundary), and the last record's seq."""
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
        return chunks, last_seq

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
                got = append_round(client, seg.name, pos, chunks, self.epoch)
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
