"""The server's side of the object-store tier (protocol.md Part 4, ``serve --tier URL``).

:class:`Tier` drives a :class:`sos_tier.Uploader` from trio:

- After each group commit the engine calls :meth:`Tier.note` for every object the batch made
  durable (cheap, on the event loop). Nothing on the append path ever waits for the store:
  appends are acknowledged when they are durable on the server's disk, whatever the store does.
- :meth:`Tier.run` is the flush task (protocol.md 4.3a): at most one flush per ``flush``
  seconds (``--tier-flush``) sustained (:class:`FlushSlots`: a few at once after a quiet
  spell), at least one per ``interval`` while bytes wait, sooner when a
  TIER_WAIT waits or ``bytes_trigger`` bytes were made durable. A flush: per namespace with
  something pending, learn the store's progress from its listing (first time) and compare the
  fence markers of those the last listing of ``v1/fence/`` names, then ONE flushed object for
  every namespace's new bytes (:meth:`Uploader.flush`), read from the objects' verified files
  in a worker thread, while the listing that gates the next flush runs beside its PUT (a
  zombie writes at most the flush in flight and one more, FENCE_FRESH). Every TIER_WAIT it
  satisfies is woken as it lands.
- :meth:`Tier.compact` (every ``compact_every`` seconds, ``--tier-compact``, and when
  COMPACT_AT flushed objects wait; protocol.md 4.3b): per-object pieces written from this
  server's copy, then the flushed objects they hold deleted. Its PUTs spend the flushes' slots
  (one budget, :class:`FlushSlots`): a slot the flushes left unused, else, on a loaded server,
  its share: while it waits, each flush that waits for its slot pays COMPACT_SHARE of a slot
  more, and compaction PUTs when those shares add up to a slot (and should the flushes neither
  leave nor wait for a slot for COMPACT_AHEAD_AFTER intervals, one is taken ahead of them). So
  the server's PUTs stay within the flush cadence whatever compaction has to do, the flushes
  keep nine slots in ten, and they stay evenly spaced (a barrier's wait grows by a ninth of an
  interval, not by a whole one now and then). (A pass for retention, :meth:`Tier.remove`, is
  not paced: it is rare and a deletion waits for it.)
- A store failure (TierError) puts the namespace in back-off (1 s doubling to 30 s,
  :class:`sos_tier.retry.Backoff`) and is logged and counted; appends go on. A conflict stops
  that object, a higher fence marker in the store (:class:`TierFenced`: another server took
  the namespace over) stops the whole namespace: both are logged as errors and exported, and
  nothing is ever overwritten.
- :meth:`Tier.fence` writes the fence marker before FENCE_OK (protocol.md 1.11 FENCE), retried
  (:func:`sos_tier.retry.fence_retrying`: 0.2 s doubling to 2 s) within ``fence_timeout``.
- :meth:`Tier.remove` compacts the flushed objects naming a generation's objects, then deletes
  the objects from the store, before retention deletes them locally (so a failure or a crash in
  between leaves the objects on the server and the next retention run does both again).
- A lag task exports, per namespace, the bytes and seconds acknowledged but not in the store,
  and logs once when the oldest such byte is older than ``lag_warn`` and once when it recovers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial

import trio
from tenacity import RetryCallState

from sos_tier import PutOutcome, Store, StoredKey, TierError, TierFenced, Uploader
from sos_tier.log import Batch
from sos_tier.retry import BACKOFF_MAX, BACKOFF_MIN, Backoff, fence_retrying
from sos_tier.uploader import (
    DEFAULT_MAX_PIECE,
    CompactResult,
    FlushItem,
    FlushResult,
    LocalUnreadable,
    TierMarkerTaken,
)
from sos_wire.errors import ErrorCode

from .metrics import Metrics
from .storage import Storage, StorageError, StoredObject

__all__ = ["BACKOFF_MAX", "BACKOFF_MIN", "DEFAULT_COMPACT", "DEFAULT_FLUSH", "FENCE_TIMEOUT", "Tier"]

log = logging.getLogger(__name__)

FENCE_TIMEOUT = 10.0  # FENCE waits this long for its marker to reach the store
#: --tier-flush: at most one flushed object per this (the whole server's PUT rate, 1/flush)
DEFAULT_FLUSH = 0.1
#: --tier-compact: a compaction pass at least this often
DEFAULT_COMPACT = 30.0
#: a compaction pass at once when this many flushed objects wait for one
COMPACT_AT = 600
#: ONE listing of ``v1/fence/`` (the copies of every namespace's fence markers) tells the
#: server of any namespace another server fenced, whose own markers it then compares before
#: that namespace flushes again. The listing runs beside a flush's PUT and gates the NEXT flush
#: (so a barrier waits for one PUT, not a LIST and a PUT in series), if that one starts within
#: FENCE_FRESH of the listing's start; a flush after a quieter spell lists first. A zombie thus
#: writes, after the marker's copy lands, at most the flush in flight and one more, both
#: started within FENCE_FRESH of it (protocol.md 4.3a, 4.5). Each namespace's own markers are
#: also compared about every FENCE_CHECK seconds while it flushes (one LIST each, beside the
#: PUT too, at most FENCE_CHECKS_PER_FLUSH a flush, the longest unchecked first: thirty
#: namespaces due at once would otherwise flood the store beside one PUT and hold up that
#: flush's barriers): a marker without a copy (planted, or written by an older server) is found
#: within that (longer when more namespaces flush than that many per flush covers) and one flush.
FENCE_CHECK = 10.0
FENCE_CHECKS_PER_FLUSH = 4
FENCE_FRESH = 0.5
#: flush slots saved up while the server was quieter than one flush per --tier-flush: a
#: batch's few barriers in a row each get a flush at once, while the sustained rate stays
#: one per --tier-flush (a token bucket of this depth, protocol.md 4.3a)
FLUSH_BURST = 3
#: a compaction PUT spends a flush slot (one PUT budget for the server, protocol.md 4.3b): one
#: the flushes left unused (keeping one saved for them), else its share: while compaction
#: waits, a flush that waits for its slot pays this much of a slot more (it starts that much of
#: an interval later), and compaction PUTs once the shares add up to a whole slot (one PUT in
#: ten; the flushes about 111 ms apart at --tier-flush 100ms rather than a 200 ms gap a second)
COMPACT_SHARE = 1 / 9
#: ...and if in this many flush intervals (at least COMPACT_AHEAD_MIN s) the flushes neither
#: left a slot nor had to wait for one (their demand right at the cadence), one slot taken
#: ahead of them: compaction never starves (shares come in about nine intervals, before it)
COMPACT_AHEAD_AFTER = 20
COMPACT_AHEAD_MIN = 2.0
FENCE_CHECKS = 32  # fence checks in flight at once


class _Stopping(Exception):
    """The compaction pass was abandoned (the server stops): its thread ends before its next PUT."""


class FlushSlots:
    """The flush cadence as a token bucket: one slot every ``every`` seconds, at most
    ``depth`` saved up. :meth:`take` returns when the next flush may start (now, if a slot is
    saved) and spends its slot: over any time T at most ``depth + T / every`` flushes."""

    def __init__(self, every: float, depth: int, now: float) -> None:
        self.every = every
        self.depth = depth
        self._slots = float(depth)
        self._at = now
        #: compaction waits for a slot (set by it): a flush that waits pays its share too
        self.sharing = False
        #: compaction's shares paid so far, in slots (:meth:`shared` spends a whole one)
        self._share = 0.0

    def take(self, now: float) -> float:
        """Spend a slot; the time the flush may start (``now`` or when the slot refills). A
        flush that has to wait while compaction waits (:attr:`sharing`) also pays
        COMPACT_SHARE of a slot for it; one that may start at once never does."""
        self._refill(now)
        self._slots -= 1.0
        if self._slots >= 0.0:
            return now
        if self.sharing:
            self._slots -= COMPACT_SHARE
            self._share += COMPACT_SHARE
        return now - self._slots * self.every  # the slot owed refills then

    def shared(self) -> bool:
        """Spend a whole slot of the shares the flushes paid for compaction, if there is one."""
        if self._share < 1.0 - 1e-9:
            return False
        self._share = max(0.0, self._share - 1.0)
        return True

    def spare(self, now: float) -> bool:
        """Spend a slot only if one more than the next flush needs is saved (a compaction PUT
        on what the flushes leave)."""
        self._refill(now)
        if self._slots < 2.0:
            return False
        self._slots -= 1.0
        return True

    def _refill(self, now: float) -> None:
        self._slots = min(float(self.depth), self._slots + (now - self._at) / self.every)
        self._at = now


def _durably_sealed(obj: StoredObject) -> bool:
    return obj.sealed and obj.synced_size > obj.seal_pos


def _seal_time(obj: StoredObject) -> int | None:
    try:
        return os.stat(obj.path).st_mtime_ns
    except OSError:
        return None


class _Counted:
    """The store, its requests counted by operation (``sos_tier_requests_total{op}``; a listing
    counts one request per 1,000 keys, S3's page) and timed (``sos_tier_request_seconds{op}``;
    a listing from its first page to its last)."""

    def __init__(self, store: Store, metrics: Metrics) -> None:
        self.inner, self.url = store, store.url
        self._count = metrics.tier_requests
        self._seconds = metrics.tier_request_seconds
        #: per worker thread: ``pace``, called before each PUT of that thread (compaction's)
        self.paced = threading.local()

    def put_once(self, key: str, data: bytes) -> PutOutcome:
        pace = getattr(self.paced, "pace", None)
        if pace is not None:
            pace()
        self._count.labels(op="put").inc()
        with self._seconds.labels(op="put").time():
            return self.inner.put_once(key, data)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        self._count.labels(op="get").inc()
        with self._seconds.labels(op="get").time():
            return self.inner.get(key, start, end)

    def list(self, prefix: str = "") -> Iterator[StoredKey]:
        self._count.labels(op="list").inc()
        t0 = time.perf_counter()
        for i, item in enumerate(self.inner.list(prefix), 1):
            if i % 1000 == 0:
                self._count.labels(op="list").inc()
            yield item
        self._seconds.labels(op="list").observe(time.perf_counter() - t0)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._count.labels(op="delete").inc(max(1, (len(keys) + 999) // 1000))
        with self._seconds.labels(op="delete").time():
            self.inner.delete(keys)

    def close(self) -> None:
        self.inner.close()


@dataclass
class _Waiter:
    offset: int
    event: trio.Event = field(default_factory=trio.Event)


@dataclass
class _NsState:
    retry_at: float = 0.0  # trio time before which the namespace is not tried again
    delay: float = 0.0  # the current back-off, 0 when healthy
    backoff: Backoff = field(default_factory=Backoff)  # the next delay (BACKOFF_MIN doubling to BACKOFF_MAX)
    failing: str | None = None  # the last store error while failing
    stopped: str | None = None  # why uploading stopped for good (fenced)
    lagging: bool = False  # the lag warning was logged
    uploaded_seen: int = 0  # Lag.uploaded_bytes at the last metrics refresh
    stuck_seen: set[str] = field(default_factory=set)
    fence_checked: float = -float("inf")  # trio time of the last comparison with the bucket's markers


class Tier:
    def __init__(
        self,
        store: Store,
        storage: Storage,
        metrics: Metrics,
        *,
        interval: float = 1.0,
        flush: float = DEFAULT_FLUSH,
        compact_every: float = DEFAULT_COMPACT,
        bytes_trigger: int = 8 << 20,
        lag_warn: float = 30.0,
        parallel: int = 4,
        max_piece: int = DEFAULT_MAX_PIECE,
        fence_timeout: float = FENCE_TIMEOUT,
        fence_fresh: float = FENCE_FRESH,
        retry_max: float = BACKOFF_MAX,
    ) -> None:
        self.store = store = _Counted(store, metrics)
        self.storage = storage
        self.metrics = metrics
        self.interval = interval
        self.flush = flush
        self.compact_every = compact_every
        self.bytes_trigger = bytes_trigger
        self.lag_warn = lag_warn
        self.fence_timeout = fence_timeout
        self.fence_fresh = fence_fresh
        self.retry_max = retry_max  # a failing namespace's back-off: BACKOFF_MIN doubling to this
        self.uploader = Uploader(store, max_piece=max_piece, on_progress=self._progress_in_thread)
        self._limiter = trio.CapacityLimiter(parallel)
        #: the fence checks before a flush, all at once (one LIST each): a flush waits for the slowest
        self._checks = trio.CapacityLimiter(FENCE_CHECKS)
        self._token: trio.lowlevel.TrioToken | None = None
        self._wake = trio.Event()
        #: the last listing of v1/fence/ (namespace -> highest copy's epoch; None: it failed,
        #: every namespace then compares its own markers) and the trio time it started
        self._copies: dict[str, int] | None = None
        self._copies_at = -float("inf")
        self._since = 0  # bytes made durable since the last round started
        self._ns: dict[str, _NsState] = {}
        self._waiters: dict[tuple[str, str], list[_Waiter]] = {}
        self._flushing = trio.Event()  # set when no flush is in flight
        self._flushing.set()
        self._more = False  # the last flush left bytes for the next one
        self._compact_lock = trio.Lock()
        self._compact_now = trio.Event()
        self._slots: FlushSlots | None = None  # the PUT budget, once run() started
        #: compaction's own worker thread: one waiting for a slot must not hold a token the
        #: flushes need (with --tier-parallel 1 they would wait for the whole pass)
        self._compact_limiter = trio.CapacityLimiter(1)
        self._left: set[str] = set()  # flushed objects compaction left (logged once each)
        self._removing: set[tuple[str, str]] = set()
        #: objects a conflict stopped (set in worker threads: one dict store each), and those the
        #: store holds more of than this server (both logged once)
        self._stuck: dict[tuple[str, str], str] = {}
        self._ahead: set[tuple[str, str]] = set()
        self.rounds = 0

    # -- what the engine tells us (event loop) ---------------------------------------------------

    def note(self, obj: StoredObject, grown: int) -> None:
        """*obj* was made durable up to ``synced_length`` by a group commit (*grown* more bytes)."""
        self.uploader.note(obj.namespace, obj.name, obj.synced_length, _durably_sealed(obj))
        self._since += grown
        if self._since >= self.bytes_trigger:
            self._wake.set()

    def kick(self) -> None:
        """Start a round now (a TIER_WAIT is waiting)."""
        self._wake.set()

    # -- the upload task -------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        for ns in list(self.storage.namespaces.values()):  # start-up: what the disk holds
            for obj in list(ns.objects.values()):
                self.note(obj, 0)
        log.info(
            "tier started",
            extra={
                "tier": self.store.url,
                "interval": self.interval,
                "flush": self.flush,
                "bytes": self.bytes_trigger,
                "compact": self.compact_every,
                "lag_warn": self.lag_warn,
            },
        )
        self._slots = slots = FlushSlots(self.flush, FLUSH_BURST, trio.current_time())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._lag_loop)
            nursery.start_soon(self._compact_loop)
            task_status.started()
            while True:
                # at most 1/--tier-flush flushes a second, whatever asks (TIER_WAITs, the byte
                # trigger); a few at once when they were not used (a batch's barriers in a row)
                await trio.sleep_until(slots.take(trio.current_time()))
                await self._round()
                if self._more:
                    continue
                with trio.move_on_after(self.interval):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _round(self) -> None:
        """One flush: per namespace with something pending, learn the bucket (first time) and
        compare the fence markers of those a listing of ``v1/fence/`` names (a zombie learns
        within a flush or two), then ONE flushed object for every namespace's new bytes; the
        waiters it satisfies are woken as it lands. The next flush's listing runs beside it."""
        self._since = 0
        self._more = False
        self.rounds += 1
        now = trio.current_time()
        names = set(self.uploader.namespaces()) | {k[0] for k in self._waiters}
        ready: list[str] = []
        later: list[str] = []  # their periodic fence check runs beside the PUT
        due = {n for n in names if self._due(n, now)}
        listed = bool(due) and now - self._copies_at > self.fence_fresh
        if listed:  # no listing recent enough to gate this flush: list first
            await self._list_fences(now)
        suspect = self._suspects(due)
        async with trio.open_nursery() as nursery:
            for namespace in sorted(due):
                nursery.start_soon(self._prepare_ns, namespace, namespace in suspect, ready, later)
        items = self._flush_items(ready)
        later.sort(key=lambda n: self._state(n).fence_checked)
        del later[FENCE_CHECKS_PER_FLUSH:]  # the others at the next flushes
        if items:
            self._flushing = trio.Event()
            try:
                async with trio.open_nursery() as nursery:
                    if not listed:  # the listing that gates the next flush
                        nursery.start_soon(self._list_fences, trio.current_time())
                    for namespace in later:
                        nursery.start_soon(self._check_beside, namespace)
                    await self._flush(items, ready)
            finally:
                self._flushing.set()
        for namespace in names:
            self._wake_waiters(namespace)

    def _due(self, namespace: str, now: float) -> bool:
        """The namespace has something for this flush (bytes, a seal, its fence marker)."""
        st = self._state(namespace)
        ns = self.storage.namespaces.get(namespace)
        if st.stopped is not None or now < st.retry_at or ns is None:
            return False
        return bool(self.uploader.pending(namespace)) or self.uploader.marker_due(namespace, ns.fence)

    async def _list_fences(self, started: float) -> None:
        """List the copies of fence markers under ``v1/fence/`` (one LIST for every namespace,
        protocol.md 4.3a); on a store error every namespace compares its own markers next."""
        try:
            copies: dict[str, int] | None = await trio.to_thread.run_sync(
                self.uploader.fence_copies, limiter=self._checks, abandon_on_cancel=True
            )
        except TierError:
            copies = None  # each is then checked by its own listing (and fails there if the store does)
        self._copies, self._copies_at = copies, started

    def _suspects(self, due: set[str]) -> set[str]:
        """The namespaces of *due* the last listing names a copy above this server's fence of."""
        if self._copies is None:
            return set(due)
        spaces = self.storage.namespaces
        return {n for n in due if n in spaces and self._copies.get(n, 0) > spaces[n].fence}

    async def _prepare_ns(self, namespace: str, suspect: bool, ready: list[str], later: list[str]) -> None:
        """Learn the namespace (first time) and, if *suspect* (a fence above ours was noticed)
        or its marker is due, compare its fence markers (one LIST); if only FENCE_CHECK passed,
        *later* gets it (compared beside the PUT); *ready* gets it if it flushes."""
        ns = self.storage.namespaces.get(namespace)
        if ns is None:
            return
        try:
            if not self.uploader.learned(namespace):  # no thread hop on every flush
                await trio.to_thread.run_sync(
                    self.uploader.learn, namespace, limiter=self._limiter, abandon_on_cancel=True
                )
            st = self._state(namespace)
            now = trio.current_time()
            if suspect or self.uploader.marker_due(namespace, ns.fence):
                await trio.to_thread.run_sync(
                    self.uploader.check_fence, namespace, ns.fence, limiter=self._checks, abandon_on_cancel=True
                )
                st.fence_checked = now
            elif now - st.fence_checked >= FENCE_CHECK:
                later.append(namespace)
        except TierFenced as exc:
            self._stop(namespace, str(exc))
        except TierError as exc:
            self._failed(namespace, exc)
        else:
            ready.append(namespace)

    async def _check_beside(self, namespace: str) -> None:
        """The periodic comparison of a namespace's own fence markers (FENCE_CHECK), beside a
        flush's PUT: a believed marker above this server's fence stops the namespace from the
        next flush on; a store error leaves it for the next flush."""
        ns = self.storage.namespaces.get(namespace)
        if ns is None:
            return
        epoch, now = ns.fence, trio.current_time()
        try:
            await trio.to_thread.run_sync(
                self.uploader.check_fence, namespace, epoch, limiter=self._checks, abandon_on_cancel=True
            )
        except TierFenced as exc:  # never this server's own newer marker (Uploader.check_fence)
            self._stop(namespace, str(exc))
        except TierError:
            return
        else:
            self._state(namespace).fence_checked = now

    def _flush_items(self, ready: list[str]) -> list[FlushItem]:
        """On the event loop (the engine changes these fields here): what is durable of every
        pending object of the *ready* namespaces, with a reader of its verified bytes."""
        items: list[FlushItem] = []
        for namespace in sorted(ready):
            ns = self.storage.namespaces.get(namespace)
            for name in self.uploader.pending(namespace):
                key = (namespace, name)
                obj = ns.objects.get(name) if ns is not None else None
                if key in self._removing or key in self._stuck:
                    continue
                if obj is None or obj.removed:
                    self.uploader.forget(namespace, [name])
                    continue
                items.append(self._item(obj))
        return items

    def _item(self, obj: StoredObject) -> FlushItem:
        durable, sealed = obj.synced_length, _durably_sealed(obj)

        def read(begin: int, end: int) -> bytes:
            try:
                return obj.read_bytes(begin, end - begin, limit=durable)
            except (StorageError, OSError) as exc:
                raise LocalUnreadable(exc.message if isinstance(exc, StorageError) else str(exc)) from None

        sealed_at_ns = _seal_time(obj) if sealed else None
        return FlushItem(obj.namespace, obj.name, read, durable, sealed, sealed_at_ns)

    async def _flush(self, items: list[FlushItem], ready: list[str]) -> None:
        try:
            res = await trio.to_thread.run_sync(
                self.uploader.flush, items, limiter=self._limiter, abandon_on_cancel=True
            )
        except TierError as exc:
            for namespace in {it.namespace for it in items}:
                self._failed(namespace, exc)
            return
        self._more = res.more
        self._flushed(res)
        for (namespace, name), why in res.unreadable.items():
            obj = self.storage.namespaces[namespace].objects.get(name)
            if obj is not None and not obj.removed:
                self._stuck[(namespace, name)] = f"cannot read the server's copy: {why}"
                log.error(
                    "tier: cannot read %s/%s to upload it, not uploading it: %s",
                    namespace,
                    name,
                    why,
                    extra={"namespace": namespace, "object": name},
                )
        for key, why in res.ahead.items():
            if key not in self._ahead:
                self._ahead.add(key)
                log.error("tier: %s", why, extra={"namespace": key[0], "object": key[1]})
        for namespace in ready:
            self._healthy(namespace)

    def _healthy(self, namespace: str) -> None:
        """A write of the namespace's bytes landed: out of back-off, and say so once."""
        st = self._state(namespace)
        if st.failing is not None:
            log.info("tier: uploads work again", extra={"namespace": namespace, "tier": self.store.url})
            self.metrics.tier_failing.labels(namespace=namespace).set(0)
        st.failing, st.delay, st.retry_at = None, 0.0, 0.0
        st.backoff.reset()

    def _flushed(self, res: FlushResult) -> None:
        if res.key is None:
            return
        m = self.metrics
        m.tier_flushes.inc()
        m.tier_pieces.inc(res.pieces)
        m.tier_flush_bytes.observe(res.bytes)
        m.tier_flush_objects.observe(res.objects)
        if self.uploader.flushed_count() >= COMPACT_AT:
            self._compact_now.set()

    # -- compaction --------------------------------------------------------------------------------

    async def _compact_loop(self) -> None:
        while True:
            with trio.move_on_after(self.compact_every):
                await self._compact_now.wait()
            self._compact_now = trio.Event()
            try:
                await self.compact()
            except TierError as exc:
                self.metrics.tier_upload_errors.inc()
                log.warning("tier: compaction failed, retried at the next: %s", exc, extra={"tier": self.store.url})

    async def compact(self, only: set[tuple[str, str]] | None = None) -> CompactResult:
        """One compaction pass (protocol.md 4.3b): list the flushed objects (those naming one
        of *only*, if given), write their objects' per-object pieces from this server's copy,
        then delete each flushed object that pieces now hold whole. TierError propagates."""
        async with self._compact_lock:
            batches, bad = await trio.to_thread.run_sync(
                self.uploader.flushed_objects, limiter=self._limiter, abandon_on_cancel=True
            )
            if only is not None:
                batches = [b for b in batches if b.objects() & only]
            local: dict[tuple[str, str], FlushItem] = {}
            for b in batches:
                for namespace, name in b.objects():
                    ns = self.storage.namespaces.get(namespace)
                    obj = ns.objects.get(name) if ns is not None else None
                    st = self._ns.get(namespace)
                    if obj is not None and not obj.removed and not (st is not None and st.stopped):
                        local[(namespace, name)] = self._item(obj)
            res = await trio.to_thread.run_sync(
                partial(self._compact_paced, batches, local, paced=only is None),
                limiter=self._compact_limiter,
                abandon_on_cancel=True,
            )
        res.left.update(bad)
        for namespace in {ns for ns, _ in local}:
            self._healthy(namespace)
        m = self.metrics
        m.tier_pieces.inc(res.pieces)
        m.tier_compacted.inc(res.deleted)
        m.tier_compaction_lag.set(res.oldest_age)
        m.tier_flushed_objects.set(len(res.left))
        for n in res.pieces_per_object:
            m.tier_object_pieces.observe(n)
        for key, why in res.left.items():
            if key not in self._left:
                log.warning("tier: a flushed object stays uncompacted: %s: %s", key, why, extra={"key": key})
        self._left = set(res.left)
        return res

    def _compact_paced(
        self, batches: list[Batch], local: dict[tuple[str, str], FlushItem], *, paced: bool
    ) -> CompactResult:
        """Uploader.compact in this worker thread, each of its PUTs waiting for a slot if *paced*."""
        self.store.paced.pace = self._compaction_slot_in_thread if paced else None
        try:
            return self.uploader.compact(batches, local)
        finally:
            self.store.paced.pace = None

    def _compaction_slot_in_thread(self) -> None:
        if self._token is None or self._slots is None:  # not running (a test's own pass)
            return
        try:
            trio.from_thread.check_cancelled()  # the pass was abandoned: no more PUTs
            trio.from_thread.run(self._compaction_slot, trio_token=self._token)
        except (trio.Cancelled, trio.RunFinishedError):
            raise _Stopping from None

    async def _compaction_slot(self) -> None:
        """Wait for the PUT budget to allow a compaction PUT and spend its slot: one the flushes
        left (at once on a quiet server), else its share (COMPACT_SHARE: the flushes that wait
        meanwhile pay a ninth of a slot each, about one PUT in ten for compaction on a loaded
        server), else, after COMPACT_AHEAD_AFTER intervals with neither, one taken ahead of the
        flushes. Compaction's PUTs come one at a time (one thread, one pass)."""
        slots = self._slots
        assert slots is not None
        since = trio.current_time()
        ahead = max(COMPACT_AHEAD_MIN, COMPACT_AHEAD_AFTER * slots.every)
        try:
            while True:
                now = trio.current_time()
                if slots.spare(now) or slots.shared():
                    return
                if now - since >= ahead:  # the flushes neither left a slot nor waited for one
                    await trio.sleep_until(slots.take(now))
                    return
                slots.sharing = True
                await trio.sleep(slots.every)
        finally:
            slots.sharing = False

    def _failed(self, namespace: str, exc: TierError) -> None:
        st = self._state(namespace)
        st.delay = st.backoff.next()
        st.retry_at = trio.current_time() + st.delay
        self.metrics.tier_upload_errors.inc()
        self.metrics.tier_failing.labels(namespace=namespace).set(1)
        self.metrics.tier_last_error.labels(namespace=namespace).set(time.time())
        if st.failing is None:
            log.warning(
                "tier: uploads fail, appends go on and uploads are retried: %s",
                exc,
                extra={"namespace": namespace, "tier": self.store.url, "retry_in": st.delay},
            )
        st.failing = str(exc)

    def _stop(self, namespace: str, why: str) -> None:
        st = self._state(namespace)
        if st.stopped is None:
            st.stopped = why
            log.error(
                "tier: stopped uploading the namespace: %s", why, extra={"namespace": namespace, "tier": self.store.url}
            )
            self.metrics.tier_fenced.labels(namespace=namespace).set(1)
        self._wake_waiters(namespace)

    def _state(self, namespace: str) -> _NsState:
        st = self._ns.get(namespace)
        if st is None:
            st = self._ns[namespace] = _NsState(backoff=Backoff(min(BACKOFF_MIN, self.retry_max), self.retry_max))
        return st

    # -- waking TIER_WAIT ------------------------------------------------------------------------

    def _progress_in_thread(self, namespace: str, name: str, uploaded: int, sealed: bool) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._wake_object, namespace, name, uploaded)

    def _wake_soon(self, namespace: str) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._wake_waiters, namespace)

    def _wake_object(self, namespace: str, name: str, uploaded: int) -> None:
        for w in self._waiters.get((namespace, name), ()):
            if self._reached(namespace, name, w.offset):
                w.event.set()

    def _reached(self, namespace: str, name: str, offset: int) -> bool:
        """The bucket holds what a TIER_WAIT for *offset* asks (protocol.md 1.11): the object's
        bytes up to *offset* and, if it is durably sealed here, its seal marker."""
        ns = self.storage.namespaces.get(namespace)
        obj = ns.objects.get(name) if ns is not None else None
        sealed = obj is not None and _durably_sealed(obj)
        return self.uploader.holds(namespace, name, offset, sealed)

    def _wake_waiters(self, namespace: str) -> None:
        """Every waiter of the namespace that can be answered now (done, or never will be)."""
        for (ns, name), ws in self._waiters.items():
            if ns != namespace:
                continue
            stop = self._unavailable(ns, name)
            for w in ws:
                if stop is not None or self._reached(ns, name, w.offset):
                    w.event.set()

    def _unavailable(self, namespace: str, name: str) -> str | None:
        """Why the store will not get more of this object from this server, or None."""
        st = self._ns.get(namespace)
        if st is not None and st.stopped is not None:
            return f"the tier stopped for namespace {namespace!r}: {st.stopped}"
        stuck = self._stuck.get((namespace, name))
        if stuck is not None:
            return f"the tier stopped copying {name!r}: {stuck}"
        return None

    async def wait(
        self,
        namespace: str,
        name: str,
        offset: int,
        timeout: float,  # noqa: ASYNC109 - TIER_WAIT's own timeout_ms: answered after it, not a cancellation
    ) -> int:
        """TIER_WAIT once the engine checked the object and *offset* (protocol.md 1.11): the
        length of the object's run in the store, >= offset; StorageError TIER_UNAVAILABLE."""
        key = (namespace, name)
        t0 = trio.current_time()
        why = self._unavailable(namespace, name)
        tiered = self.uploader.uploaded(namespace, name)
        if why is None and self._reached(namespace, name, offset):
            self.metrics.tier_wait_seconds.observe(0.0)
            return tiered
        if why is None and timeout > 0:
            w = _Waiter(offset)
            self._waiters.setdefault(key, []).append(w)
            self.kick()
            try:
                with trio.move_on_after(timeout):
                    await w.event.wait()
            finally:
                ws = self._waiters[key]
                ws.remove(w)
                if not ws:
                    del self._waiters[key]
            why = self._unavailable(namespace, name)
            tiered = self.uploader.uploaded(namespace, name)
            if why is None and self._reached(namespace, name, offset):
                self.metrics.tier_wait_seconds.observe(trio.current_time() - t0)
                return tiered
        if why is None:
            ms = round((trio.current_time() - t0) * 1000)
            why = (
                f"bucket holds {tiered} of {offset} bytes of {name!r} after {ms} ms"
                if tiered < offset
                else f"bucket does not hold {name!r}{' and its seal' if offset == tiered else ''} after {ms} ms"
            )
            st = self._ns.get(namespace)
            last = st.failing if st is not None and st.failing else self.uploader.lag(namespace).last_error
            if last:
                why += f": last upload error: {last}"
        raise StorageError(ErrorCode.TIER_UNAVAILABLE, why, tiered)

    # -- FENCE and retention -----------------------------------------------------------------------

    async def fence(self, namespace: str, epoch: int) -> None:
        """Write the fence marker of *epoch* (the namespace's new fence, already durable on the
        server) before FENCE_OK; StorageError TIER_UNAVAILABLE if the store holds a higher one
        or does not take it within ``fence_timeout``."""
        failed: list[BaseException] = []

        def before_sleep(state: RetryCallState) -> None:  # a store error: counted, retried
            if state.outcome is not None and (exc := state.outcome.exception()) is not None:
                failed.append(exc)
            self.metrics.tier_upload_errors.inc()

        check = partial(self.uploader.check_fence, strict=True)
        try:
            with trio.move_on_after(self.fence_timeout):  # also cancels a call in flight
                async for attempt in fence_retrying(trio.sleep, before_sleep):
                    with attempt:
                        await trio.to_thread.run_sync(check, namespace, epoch, abandon_on_cancel=True)
                return
        except TierMarkerTaken as exc:  # retrying cannot help: a higher epoch can
            raise StorageError(ErrorCode.TIER_UNAVAILABLE, f"fence {epoch} set on this server, but {exc}") from None
        except TierFenced as exc:
            self._stop(namespace, str(exc))
            raise StorageError(ErrorCode.TIER_UNAVAILABLE, f"fence {epoch} set on this server, but {exc}") from None
        last = failed[-1] if failed else None
        raise StorageError(
            ErrorCode.TIER_UNAVAILABLE,
            f"fence {epoch} set on this server, but its marker did not reach the tier within"
            f" {self.fence_timeout:g} s ({last or 'no answer'}); fence again with a higher epoch",
        )

    async def remove(self, namespace: str, names: list[str]) -> None:
        """Retention: delete these objects' keys from the store (the engine then deletes them
        locally). The flushed objects naming them are compacted and deleted first (else a reader
        would find the objects again in them). TierError if the store refuses, or if a flushed
        object naming them cannot be compacted: the caller keeps them for the next run."""
        keys = [(namespace, n) for n in names]
        self._removing.update(keys)
        try:
            await self._flushing.wait()  # a flush in flight may name them: it lands first
            res = await self.compact(only=set(keys))
            if res.left:
                key, why = next(iter(res.left.items()))
                raise TierError(f"flushed object {key} names objects being removed and stays: {why}")
            await trio.to_thread.run_sync(self.uploader.remove, namespace, names, limiter=self._limiter)
        except BaseException:
            self._removing.difference_update(keys)
            raise

    def removed(self, namespace: str, names: list[str]) -> None:
        """The engine deleted them locally: forget them."""
        self.uploader.forget(namespace, names)
        for n in names:
            self._removing.discard((namespace, n))
            self._stuck.pop((namespace, n), None)
            self._ahead.discard((namespace, n))

    # -- lag: metrics and the log line -------------------------------------------------------------

    async def _lag_loop(self) -> None:
        while True:
            self.refresh_metrics()
            await trio.sleep(min(1.0, self.interval))

    def refresh_metrics(self) -> None:
        m = self.metrics
        for namespace in self.uploader.namespaces():
            lag = self.uploader.lag(namespace)
            st = self._state(namespace)
            m.tier_lag_bytes.labels(namespace=namespace).set(lag.bytes)
            m.tier_lag_seconds.labels(namespace=namespace).set(lag.seconds)
            m.tier_uploaded_bytes.labels(namespace=namespace).inc(max(0, lag.uploaded_bytes - st.uploaded_seen))
            st.uploaded_seen = lag.uploaded_bytes
            if lag.last_error_at is not None:
                m.tier_last_error.labels(namespace=namespace).set(lag.last_error_at)
            new_stuck = set(lag.stuck) - st.stuck_seen
            if new_stuck:
                m.tier_conflicts.labels(namespace=namespace).inc(len(new_stuck))
                st.stuck_seen |= new_stuck
            m.tier_fenced.labels(namespace=namespace).set(1 if (lag.fenced or st.stopped) else 0)
            m.tier_ignored_fences.labels(namespace=namespace).set(len(lag.ignored_fences))
            if lag.seconds > self.lag_warn and not st.lagging:
                st.lagging = True
                log.warning(
                    "tier: acknowledged bytes not in the store for %.0f s (over --tier-lag-warn %g s): %d bytes",
                    lag.seconds,
                    self.lag_warn,
                    lag.bytes,
                    extra={
                        "namespace": namespace,
                        "lag_bytes": lag.bytes,
                        "lag_seconds": round(lag.seconds, 1),
                        "last_error": lag.last_error or st.failing,
                    },
                )
            elif st.lagging and lag.seconds <= self.lag_warn:
                st.lagging = False
                log.info(
                    "tier: lag back under --tier-lag-warn",
                    extra={"namespace": namespace, "lag_bytes": lag.bytes, "lag_seconds": round(lag.seconds, 1)},
                )

    def close(self) -> None:
        self.store.close()
