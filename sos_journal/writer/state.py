"""The state a JournalWriter's roles share, and the spool bookkeeping on it.

:class:`WriterState` is the base of :class:`~sos_journal.writer.writer.JournalWriter` and of
its role mixins (``resume.py``: open; ``replicator.py``: shipping; ``commit_wait.py``: the
barriers). It holds everything they share under one condition variable, ``_cv``: the spool
and its segments (the newest one ``_cur`` takes new records), the position (last sequence
number, generation, epoch), what the server acknowledged (``_acked``, the ready objects owed),
the replicator's failure and quota state; and the small questions asked of it with the lock
held (what is unshipped, is a record durable, may the writer still be used).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sos_journal.errors import JournalError, WriterClosed, WriterFenced
from sos_journal.store import Fenced, SealedError, StoreClient
from sos_journal.writer.spool import Spool, SpoolSegment
from sos_journal.writer.tier_wait import TierDurability

__all__ = ["WriterState"]


class WriterState:
    """The shared state (see the module docstring); the options are set by JournalWriter."""

    client_factory: Callable[[], StoreClient]
    namespace: str
    spool_dir: str
    sync: bool
    max_lag_bytes: int
    segment_bytes: int
    generation_bytes: int
    chunk_bytes: int
    pipeline: int
    max_backoff: float
    open_timeout: float
    durability: str
    tier_patience: float | None
    #: durability "tier": what the barriers owe the server's bucket (tier_wait.py)
    _tier: TierDurability

    def __init__(self) -> None:
        lock = threading.Lock()
        #: the barriers' and appends' waits: notified when records are acknowledged, an
        #: attempt ends, the writer fails or closes
        self._cv = threading.Condition(lock)
        #: the replicator thread's wait (the same lock): notified when there is work for it
        #: (a record appended, a barrier that wants held-back records, a ready object owed,
        #: the close); an acknowledgement alone does not wake it
        self._work = threading.Condition(lock)
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
        self._admitted = threading.local()  # see JournalWriter.admission()
        #: seconds the replicator holds back records nobody waits for, so that those appended
        #: meanwhile go in the same round (0: each goes at once); see Replicator._hold
        self.linger = 0.0
        #: the highest sequence number a barrier waits for (or waited for)
        self._wanted = 0
        #: the replicator holds back records (appends then do not wake it; barriers do)
        self._lingering = False
        #: who ships the spool now: None, "thread" (the replicator) or "loop" (a round of
        #: another transport, :meth:`Replicator.claim_round`): one APPEND round at a time
        self._shipper: str | None = None
        #: rounds may be claimed outside the thread: cleared when such a round fails (the
        #: thread then retries with its backoff), set again by the thread's next success
        self._claims_ok = True
        #: the replicator thread waits with nothing to do (only a notify of _work wakes it)
        self._idle = False
        #: ... and looks again by itself after ``linger`` (appends then do not wake it)
        self._polling = False
        #: makes the trio client of an event loop that ships this writer's rounds itself
        #: (loop_ship.LoopShipper, the gateway's); None: only the thread ships
        self.loop_client_factory: Callable[[], Any] | None = None
        #: with a loop client, the thread is not woken by appends but looks for records no
        #: barrier waits for every ``linger`` by itself (True); False: appends wake it, as
        #: without one (a short linger, where polling would keep an idle writer busy)
        self.poll_records = True

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
        replicator keeps the spool and retries; see the writer's module docstring)."""
        return self._quota is not None

    def _open_spool(self) -> Spool:
        if self._spool is None:
            raise WriterClosed("writer is not open: call open() first")
        return self._spool

    def _unshipped(self) -> int:
        return sum(s.written - max(s.shipped, 0) for s in self._segs)

    def _close_segments(self) -> None:
        for s in self._segs:
            s.close()

    def _new_segment(self, first_seq: int) -> SpoolSegment:
        """With the lock held: a new spool segment for records from ``first_seq`` on, in the
        current generation and named with this writer's epoch; it becomes ``_cur``."""
        if self.generation == 0:
            raise JournalError("no generation yet: call rotate() to start generation 1")
        seg = self._open_spool().create(self.generation, first_seq, self.epoch)
        seg.shipped = -1
        self._segs.append(seg)
        self._cur = seg
        return seg

    def _want(self, target: int) -> None:
        """With the lock held: a barrier waits for every record up to ``target``: a replicator
        holding records back ships them now."""
        if target > self._wanted:
            self._wanted = target
            if self._lingering or self._polling:
                self._work.notify()

    def _durable(self, target: int) -> bool:
        return self._acked >= target and not any(s <= target for _, s in self._pending_ready)

    def _owe_tier(self, name: str, length: int) -> None:
        """With the lock held: the server acknowledged ``name`` up to ``length`` (whole records):
        under durability "tier" the next barrier waits for the bucket to hold that much."""
        if self.durability == "tier":
            self._tier.owe(name, length)

    def _after_ack(self, last_seq: int | None) -> None:
        """Called with the lock held after the server acknowledged data."""
        if all(s.shipped == s.written for s in self._segs):
            self._acked = self._seq
        elif last_seq is not None and last_seq > self._acked:
            self._acked = last_seq
        self._cv.notify_all()

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
