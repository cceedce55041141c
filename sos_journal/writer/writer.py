"""JournalWriter: appends records to the local spool; a replicator thread ships them.

This module is the writer's public face: the options, ``open``/``close``/``abandon``,
``append`` and ``rotate`` (a new generation: snapshot records, then SNAPSHOT_END), the
admission of changes and ``status``. Its roles live beside it, each a base class of
:class:`JournalWriter` over the shared state of ``writer_state.py`` (the spool's segments, the
position, what is acknowledged, under one condition variable):

* ``resume.py``: open: the spool and the server's generations reconciled, older epochs fenced;
* ``replicator.py``: the thread that ships each spool segment to the server object of the same
  name, seals complete ones and creates the ``ready`` objects; and the rounds another
  transport may claim (``loop_ship.py``: the gateway's event loop ships a barrier's round);
* ``commit_wait.py``: ``barrier``/``check_tier``: waiting until records are durable;
* ``tier_wait.py``: durability "tier": what the barriers owe the server's bucket (TIER_WAIT).

Crash of the writer: the spool survives; ``open()`` fences older epochs, cuts a torn tail
off the newest spool segment and the replicator ships whatever the server lacks (STAT gives
the server's length: nothing missing, nothing doubled). Crash or restart of the server: the
replicator reconnects with backoff, STATs and continues. Bytes on the server this writer did
not have acknowledged itself are never counted as shipped (replicator.py).

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

from sos_client.retry import retrying
from sos_journal.errors import JournalError, JournalQuotaExceeded, WriterClosed
from sos_journal.format import layout
from sos_journal.format.auth import JournalKeys, Signer, resolve_journal_keys
from sos_journal.format.records import MAX_RECORD_LENGTH, TAG_SIZE, Op, SnapshotEnd, encode
from sos_journal.store import StoreClient, close_quietly
from sos_journal.writer.barrier_waits import CLOSE_TIER_PATIENCE, QUOTA_RECHECK, Barriers
from sos_journal.writer.replicator import Replicator
from sos_journal.writer.resume import Resume, server_last_record
from sos_journal.writer.spool import Spool
from sos_journal.writer.tier_wait import DURABILITIES, TierDurability

__all__ = ["CLOSE_TIER_PATIENCE", "DURABILITIES", "QUOTA_RECHECK", "JournalWriter", "server_last_record"]

log = logging.getLogger(__name__)


def _check_options(
    *,
    durability: str,
    tier_wait: float,
    tier_patience: float | None,
    chunk_bytes: int,
    sizes: tuple[int, ...],
) -> None:
    """ValueError for an option JournalWriter cannot work with."""
    if durability not in DURABILITIES:
        raise ValueError(f"durability must be one of {', '.join(DURABILITIES)}, not {durability!r}")
    if not 0 < tier_wait <= 60:
        raise ValueError(f"tier_wait must be in (0, 60] seconds, not {tier_wait!r}")
    if tier_patience is not None and tier_patience < 0:
        raise ValueError(f"tier_patience must be >= 0 seconds or None, not {tier_patience!r}")
    if chunk_bytes < 8 + MAX_RECORD_LENGTH:
        raise ValueError(f"chunk_bytes must be at least {8 + MAX_RECORD_LENGTH}")
    if min(sizes) < 1:
        raise ValueError("sizes must be positive")


class JournalWriter(Replicator, Resume, Barriers):
    """One namespace's journal: records appended to the spool, shipped by the replicator
    thread, waited for by the barriers (the module docstring says which module holds what)."""

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
        journal_key: JournalKeys | str | None = None,
    ) -> None:
        """*durability*: "server" or "tier" (see the module docstring); *tier_wait*: seconds one
        TIER_WAIT asks the server to wait (at most 60); *tier_patience*: seconds a barrier
        without a timeout waits for the bucket before it fails with JournalTierBehind (None:
        until the bucket holds its records); *journal_key*: the key ring records are
        authenticated with (protocol.md 2.5; default: $SOS_JOURNAL_KEY, else the file
        $SOS_JOURNAL_KEY_FILE; none: unauthenticated, with a warning in the log)."""
        _check_options(
            durability=durability,
            tier_wait=tier_wait,
            tier_patience=tier_patience,
            chunk_bytes=chunk_bytes,
            sizes=(max_lag_bytes, segment_bytes, generation_bytes, pipeline),
        )
        keys = resolve_journal_keys(journal_key)
        super().__init__()
        self.signer = Signer(keys, namespace) if keys is not None else None
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
        self._tier = TierDurability(
            namespace, client_factory, cv=self._cv, stop=self._stop, wait=tier_wait, max_backoff=max_backoff
        )

    # ------------------------------------------------------------------ state
    @property
    def tier_waits(self) -> int:
        """Durability "tier": the TIER_WAITs answered TIER_WAIT_OK."""
        return self._tier.waits

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
                "tier_owed_objects": len(self._tier.owed),
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
            self._close_segments()
            self._segs = []
            self._spool.close()
            self._spool = None
            raise
        self.is_open = True
        self._thread = threading.Thread(target=self._run, name=f"sos-replicator-{self.namespace}", daemon=True)
        self._thread.start()

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
                self._want(self._seq)  # (nothing held back while an append waits for room)
                self._cv.wait(1.0)
                self._check_usable()
            seq = self._seq + 1
            now = max(time.time_ns(), self._last_time)
            sign = self.signer
            if sign is not None and self.key_rotation_due and not self._in_snapshot:
                raise JournalError(
                    f"namespace {self.namespace!r}: generation {self.generation} is not authenticated by "
                    f"journal key {sign.key.fingerprint}: a new generation must start before any record"
                )
            data = encode(op, seq, now, sign)
            cur = self._cur
            if (
                cur is None
                or cur.generation != self.generation
                or (cur.written and cur.written + len(data) > self.segment_bytes)
            ):
                cur = self._new_segment(seq)
            cur.write(data)
            if sign is not None:
                sign.prev = data[-TAG_SIZE:]
            cur.last_seq = seq
            self._seq = seq
            self._last_time = now
            if not self._in_snapshot:
                self._gen_bytes += len(data)
            if not (self._lingering or self._polling):  # (it ships this one with the others)
                self._work.notify()
            return seq

    def has_room(self, nbytes: int) -> bool:
        """Whether appending about ``nbytes`` of records now returns at once: the unshipped
        spool stays below the lag bound and no new generation falls due (JournaledTree
        starts one inside the change that crosses ``generation_bytes``, waiting for the
        server in sync mode). An estimate read without the lock, for a caller that must not
        block (the gateway's event loop), which otherwise hands the change to a thread."""
        margin = nbytes + MAX_RECORD_LENGTH
        return (
            self.is_open
            and not self.rotation_due()
            and self._gen_bytes + margin < self.generation_bytes
            and self._unshipped() + margin <= self.max_lag_bytes
        )

    def rotation_due(self) -> bool:
        return self.generation == 0 or self._gen_bytes >= self.generation_bytes or self.key_rotation_due

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
                if self.signer is not None:
                    self.signer.restart(self.generation)
                self.key_rotation_due = False
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
                self._work.notify()
            if self.sync:
                self.barrier(seq)
            return seq

    # ------------------------------------------------------------------ close
    def close(self, timeout: float | None = None) -> None:
        """Flush (wait until everything is acked, up to ``timeout``) and stop the replicator."""
        if self._closed:
            return
        try:
            if self.is_open and self._error is None:
                self._flush(timeout)
        finally:
            self.abandon()

    def abandon(self) -> None:
        """Stop now without shipping what is left: the spool stays on disk as it is, and the
        next writer opened on it ships it (exactly what a process kill leaves behind). For a
        process that must exit at once, and for tests of recovery."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            self._work.notify_all()
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        with self._cv:
            self._close_segments()
        if self._spool is not None:
            self._spool.close()
        self._tier.drop()

    def __enter__(self) -> JournalWriter:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
