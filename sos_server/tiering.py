"""The server's side of the object-store tier (protocol.md Part 4, ``serve --tier URL``).

:class:`Tier` drives a :class:`sos_tier.Uploader` from trio:

- After each group commit the engine calls :meth:`Tier.note` for every object the batch made
  durable (cheap, on the event loop: the uploader's bookkeeping under its lock). Nothing on the
  append path ever waits for the store: appends are acknowledged when they are durable on the
  server's disk, whether the store is up or not.
- :meth:`Tier.run` is the upload task: a round at least every ``interval`` seconds, sooner when
  ``bytes_trigger`` bytes were made durable since the last one or a TIER_WAIT asks. A round,
  per namespace with something pending: learn the store's progress from its listing (first
  time), compare the fence markers (:meth:`Uploader.check_fence`: a zombie learns within a
  round), then upload every pending object (``Uploader.step`` until idle) in worker threads,
  at most ``parallel`` at once, reading the object's verified bytes from its file.
- A store failure (TierError) puts the namespace in back-off (1 s doubling to 30 s,
  :class:`sos_tier.retry.Backoff`) and is logged and counted; appends go on. A conflict (another piece exists with other bytes) stops
  that object, a higher fence marker in the store (:class:`TierFenced`: another server took
  the namespace over) stops the whole namespace: both are logged as errors and exported, and
  nothing is ever overwritten.
- :meth:`Tier.wait` is TIER_WAIT: waiters are woken by the uploader's ``on_progress`` (called
  in the worker thread; handed to the event loop with the trio token) and at the end of each
  round (progress learned from the listing).
- :meth:`Tier.fence` writes the fence marker before FENCE_OK (protocol.md 1.11 FENCE), retried
  (:func:`sos_tier.retry.fence_retrying`: 0.2 s doubling to 2 s) within ``fence_timeout``.
- :meth:`Tier.remove` deletes a generation's objects from the store before retention deletes
  them locally (so a failure or a crash in between leaves the objects on the server and the
  next retention run does both again: nothing is orphaned in the bucket).
- A lag task exports, per namespace, the bytes and seconds acknowledged but not in the store,
  and logs once when the oldest such byte is older than ``lag_warn`` and once when it recovers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from functools import partial

import trio
from tenacity import RetryCallState

from sos_tier import PutOutcome, Store, TierError, TierFenced, Uploader
from sos_tier.retry import BACKOFF_MAX, BACKOFF_MIN, Backoff, fence_retrying
from sos_tier.uploader import DEFAULT_MAX_PIECE, TierMarkerTaken
from sos_wire.errors import ErrorCode

from .metrics import Metrics
from .storage import Storage, StorageError, StoredObject

__all__ = ["BACKOFF_MAX", "BACKOFF_MIN", "FENCE_TIMEOUT", "Tier"]

log = logging.getLogger(__name__)

FENCE_TIMEOUT = 10.0  # FENCE waits this long for its marker to reach the store


def _durably_sealed(obj: StoredObject) -> bool:
    return obj.sealed and obj.synced_size > obj.seal_pos


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


class Tier:
    def __init__(
        self,
        store: Store,
        storage: Storage,
        metrics: Metrics,
        *,
        interval: float = 1.0,
        bytes_trigger: int = 8 << 20,
        lag_warn: float = 30.0,
        parallel: int = 4,
        max_piece: int = DEFAULT_MAX_PIECE,
        fence_timeout: float = FENCE_TIMEOUT,
    ) -> None:
        self.store = store
        self.storage = storage
        self.metrics = metrics
        self.interval = interval
        self.bytes_trigger = bytes_trigger
        self.lag_warn = lag_warn
        self.fence_timeout = fence_timeout
        self.uploader = Uploader(store, max_piece=max_piece, on_progress=self._progress_in_thread)
        self._limiter = trio.CapacityLimiter(parallel)
        self._token: trio.lowlevel.TrioToken | None = None
        self._wake = trio.Event()
        self._since = 0  # bytes made durable since the last round started
        self._ns: dict[str, _NsState] = {}
        self._waiters: dict[tuple[str, str], list[_Waiter]] = {}
        self._busy: dict[tuple[str, str], trio.Event] = {}  # uploads in flight
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
                "bytes": self.bytes_trigger,
                "lag_warn": self.lag_warn,
            },
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._lag_loop)
            task_status.started()
            while True:
                await self._round()
                with trio.move_on_after(self.interval):
                    await self._wake.wait()
                self._wake = trio.Event()

    async def _round(self) -> None:
        self._since = 0
        self.rounds += 1
        now = trio.current_time()
        names = set(self.uploader.namespaces()) | {k[0] for k in self._waiters}
        async with trio.open_nursery() as nursery:
            for namespace in sorted(names):
                st = self._state(namespace)
                if st.stopped is None and now >= st.retry_at:
                    nursery.start_soon(self._round_ns, namespace)
        for namespace in names:
            self._wake_waiters(namespace)

    async def _round_ns(self, namespace: str) -> None:
        st = self._state(namespace)
        ns = self.storage.namespaces.get(namespace)
        if ns is None:
            return
        try:
            pending = self.uploader.pending(namespace)
            waiting = any(k[0] == namespace for k in self._waiters)
            if not pending and not waiting:
                return
            await trio.to_thread.run_sync(self.uploader.learn, namespace, limiter=self._limiter, abandon_on_cancel=True)
            await trio.to_thread.run_sync(
                self.uploader.check_fence, namespace, ns.fence, limiter=self._limiter, abandon_on_cancel=True
            )
            errors: list[BaseException] = []
            async with trio.open_nursery() as nursery:
                for name in self.uploader.pending(namespace):
                    nursery.start_soon(self._upload, namespace, name, errors)
            if errors:
                raise errors[0]
        except TierFenced as exc:
            self._stop(namespace, str(exc))
        except TierError as exc:
            self._failed(namespace, exc)
        else:
            if st.failing is not None:
                log.info("tier: uploads work again", extra={"namespace": namespace, "tier": self.store.url})
                self.metrics.tier_failing.labels(namespace=namespace).set(0)
            st.failing, st.delay, st.retry_at = None, 0.0, 0.0
            st.backoff.reset()

    async def _upload(self, namespace: str, name: str, errors: list[BaseException]) -> None:
        key = (namespace, name)
        ns = self.storage.namespaces.get(namespace)
        obj = ns.objects.get(name) if ns is not None else None
        if key in self._removing or key in self._busy or key in self._stuck:
            return
        if obj is None or obj.removed:
            self.uploader.forget(namespace, [name])
            return
        # what is durable, captured on the event loop (the engine changes these fields here)
        durable, sealed = obj.synced_length, _durably_sealed(obj)
        done = self._busy[key] = trio.Event()
        try:
            # abandoned on cancel (the server stopping): the store call ends in its own time
            await trio.to_thread.run_sync(
                self._sync_object, obj, durable, sealed, limiter=self._limiter, abandon_on_cancel=True
            )
        except TierError as exc:
            errors.append(exc)
        except (StorageError, OSError) as exc:  # the server's own copy: damaged, or removed meanwhile
            if not obj.removed:
                # this object stops (its lag stays, TIER_WAIT says why); the namespace's others go on
                msg = exc.message if isinstance(exc, StorageError) else str(exc)
                self._stuck[key] = f"cannot read the server's copy: {msg}"
                log.error(
                    "tier: cannot read %s/%s to upload it, not uploading it: %s",
                    namespace,
                    name,
                    msg,
                    extra={"namespace": namespace, "object": name},
                )
        finally:
            del self._busy[key]
            done.set()

    def _sync_object(self, obj: StoredObject, durable: int, sealed: bool) -> None:
        """In a worker thread: steps until the store holds *obj* up to *durable* (and its seal)."""
        sealed_at_ns = os.stat(obj.path).st_mtime_ns if sealed else None

        def read(begin: int, end: int) -> bytes:
            return obj.read_bytes(begin, end - begin, limit=durable)

        while True:
            step = self.uploader.step(obj.namespace, obj.name, read, durable, sealed, sealed_at_ns)
            if step.kind in ("piece", "exists") and step.outcome is PutOutcome.CREATED:
                self.metrics.tier_pieces.inc()
            if step.kind == "ahead" and (obj.namespace, obj.name) not in self._ahead:
                self._ahead.add((obj.namespace, obj.name))
                log.error("tier: %s", step.message, extra={"namespace": obj.namespace, "object": obj.name})
            if step.kind == "stuck":
                self._stuck[(obj.namespace, obj.name)] = step.message
                log.error(
                    "tier: a conflict stops uploading %s/%s: %s (nothing is overwritten)",
                    obj.namespace,
                    obj.name,
                    step.message,
                    extra={"namespace": obj.namespace, "object": obj.name},
                )
                self._wake_soon(obj.namespace)
            if step.kind in ("idle", "stuck", "ahead"):
                return

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
            st = self._ns[namespace] = _NsState()
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
        locally). TierError if the store refuses: the caller keeps them for the next run."""
        keys = [(namespace, n) for n in names]
        self._removing.update(keys)
        try:
            for k in keys:  # an upload in flight finishes first (its piece is then deleted too)
                busy = self._busy.get(k)
                if busy is not None:
                    await busy.wait()
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
