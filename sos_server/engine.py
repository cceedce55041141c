"""Engine: the append-only rules, authentication decisions, group commit and retention.

Above storage (files) and below session (frames). Everything here is trio; blocking file
work that can take long (fdatasync, large writes and reads, fence files) runs in worker
threads.

Group commit, per file: an append writes its frame (no sync) and waits for the next
fdatasync of its file. A file with waiting writes has one sync task; while its fdatasync
runs (in a worker thread), every append that lands in that file waits for the single
next round, so N pipelined appends cost about two syncs, not N. Files are synced
concurrently and independently (no file waits for a slower one). An ack is sent only
after the sync that covers its bytes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import trio

from sos_wire.auth import verify_proof
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.names import BadName, validate_name, validate_namespace

from .metrics import Metrics, NullMetrics
from .storage import (
    ROLE_APPEND,
    Namespace,
    Storage,
    StorageError,
    StoredObject,
)

__all__ = ["Engine", "ServerError", "Pending", "plan_retention", "Limits"]

log = logging.getLogger("sos_server.engine")

#: the engine's typed error is the storage one: a wire ErrorCode, a message and a u64
ServerError = StorageError

THREAD_WRITE_MIN = 128 << 10  # writes at least this big go to a worker thread
THREAD_READ_MIN = 128 << 10
SYNC_THREADS = 256  # concurrent fdatasyncs (one per file at most)


@dataclass
class Limits:
    max_objects: int = 1_000_000  # per namespace
    max_object_size: int = 1 << 40  # bytes per object
    max_list: int = 1000


@dataclass
class Pending:
    """A write that landed in the file and waits for its group commit."""

    obj: StoredObject
    end_size: int  # file bytes that must be durable
    rollbacks: int  # obj.rollbacks when written
    result: int  # the length to acknowledge
    appended: int | None  # data bytes (for metrics), None for a seal


class _LockTable:
    """trio.Lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[tuple, list] = {}

    def __call__(self, key: tuple) -> "_Held":
        return _Held(self, key)


class _Held:
    def __init__(self, table: _LockTable, key: tuple) -> None:
        self.table, self.key = table, key

    async def __aenter__(self) -> None:
        entry = self.table._locks.get(self.key)
        if entry is None:
            entry = self.table._locks[self.key] = [trio.Lock(), 0]
        entry[1] += 1
        try:
            await entry[0].acquire()
        except BaseException:
            self._drop(entry)
            raise

    async def __aexit__(self, *exc) -> None:
        entry = self.table._locks[self.key]
        entry[0].release()
        self._drop(entry)

    def _drop(self, entry: list) -> None:
        entry[1] -= 1
        if entry[1] == 0:
            del self.table._locks[self.key]


def _err(code: ErrorCode, message: str, length: int = 0) -> ServerError:
    return ServerError(code, message, length)


def _check_name(name: str) -> None:
    try:
        validate_name(name)
    except BadName as exc:
        raise _err(ErrorCode.BAD_NAME, str(exc)) from None


class Engine:
    def __init__(
        self,
        storage: Storage,
        *,
        limits: Limits | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.storage = storage
        self.limits = limits or Limits()
        self.metrics = metrics or NullMetrics()
        self._locks = _LockTable()
        self._sync_state: dict[StoredObject, list] = {}
        self._nursery: trio.Nursery | None = None
        self._fence_locks = _LockTable()
        self._running = False
        # every file with waiting writes is synced at once (trio's default limiter is 40)
        self._sync_limiter = trio.CapacityLimiter(SYNC_THREADS)

    # -- lifecycle -------------------------------------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Hosts the sync tasks; run it in a nursery for the engine's lifetime."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._running = True
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._running = False
            self._nursery = None

    def _next_round(self, obj: StoredObject) -> trio.Event:
        """The event set when a sync of *obj* that starts after now has finished.

        Group commit per file: while a file's fdatasync runs, every write to it that lands
        meanwhile waits for the one next sync; files never wait for each other."""
        if not self._running:
            raise _err(ErrorCode.INTERNAL, "server is shutting down")
        state = self._sync_state.get(obj)
        if state is None:
            state = self._sync_state[obj] = [trio.Event()]
            self._nursery.start_soon(self._sync_rounds, obj, state)
        return state[0]

    async def _sync_rounds(self, obj: StoredObject, state: list) -> None:
        try:
            while True:
                done = state[0]
                state[0] = trio.Event()  # writes from now on wait for the next round
                t0 = time.perf_counter()
                await self._sync_one(obj)
                self.metrics.synced(time.perf_counter() - t0, 1)
                done.set()
                if not state[0].statistics().tasks_waiting:
                    return
        finally:
            if self._sync_state.get(obj) is state:
                del self._sync_state[obj]
            state[0].set()  # nobody is left behind (their loop re-checks and asks again)

    async def _sync_one(self, obj: StoredObject) -> None:
        try:
            size, length = await trio.to_thread.run_sync(obj.sync, limiter=self._sync_limiter)
        except OSError as exc:
            code = ErrorCode.NO_SPACE if exc.errno in (28, 122) else ErrorCode.INTERNAL
            log.error("fdatasync of %s failed (%s): cutting unsynced bytes back", obj.path, exc)
            async with self._locks((obj.namespace, obj.name)):
                obj.sync_error = _err(code, f"could not make {obj.name!r} durable: {exc.strerror}")
                try:
                    obj.rollback()
                except OSError:
                    log.exception("rollback of %s failed", obj.path)
            return
        obj.mark_synced(size, length)

    async def _wait_durable(self, obj: StoredObject, end_size: int, rollbacks: int) -> None:
        """Wait until file bytes [.., end_size) of *obj* are synced; raise if they were cut."""
        while obj.synced_size < end_size:
            if obj.rollbacks != rollbacks:
                break
            await self._next_round(obj).wait()
        if obj.rollbacks != rollbacks and any(cut < end_size for cut in obj.cuts[rollbacks:]):
            raise getattr(obj, "sync_error", None) or _err(ErrorCode.INTERNAL, "append was cut back")

    # -- auth ------------------------------------------------------------------------
    def authenticate(self, namespace: str, key_id: bytes, nonce: bytes, proof: bytes) -> str:
        """Check an AUTH proof; returns the key's role. AUTH_FAILED says nothing more."""
        failed = _err(ErrorCode.AUTH_FAILED, f"authentication to namespace {namespace!r} failed")
        try:
            validate_namespace(namespace)
        except BadName:
            raise failed from None
        rec = self.storage.get_key(namespace, key_id)
        if rec is None or rec.namespace != namespace:
            raise failed
        if not verify_proof(rec.secret, nonce, namespace, key_id, proof):
            raise failed
        self.storage.namespace(namespace, create=True)
        return rec.role

    def _ns(self, namespace: str) -> Namespace:
        ns = self.storage.namespace(namespace, create=True)
        assert ns is not None
        return ns

    @staticmethod
    def _writer(role: str, what: str) -> None:
        if role != ROLE_APPEND:
            raise _err(ErrorCode.FORBIDDEN, f"a read key cannot {what}")

    # -- reads -----------------------------------------------------------------------
    def stat(self, namespace: str, name: str) -> tuple[int, bool]:
        _check_name(name)
        obj = self._ns(namespace).get(name)
        if obj is None:
            raise _err(ErrorCode.NOT_FOUND, f"no object {name!r} in namespace {namespace!r}")
        return obj.synced_length, _durably_sealed(obj)

    def list(self, namespace: str, prefix: str, after: str, limit: int) -> tuple[list[tuple[str, int, bool]], bool]:
        limit = min(max(limit, 0), self.limits.max_list) or self.limits.max_list
        objs, more = self._ns(namespace).list(prefix, after, limit)
        return [(o.name, o.synced_length, _durably_sealed(o)) for o in objs], more

    def open_read(self, namespace: str, name: str, offset: int, length: int) -> tuple[int, Iterator[memoryview]]:
        """(bytes to expect, iterator of verified pieces) of the durable bytes in range."""
        _check_name(name)
        obj = self._ns(namespace).get(name)
        if obj is None:
            raise _err(ErrorCode.NOT_FOUND, f"no object {name!r} in namespace {namespace!r}")
        end = obj.synced_length
        if offset > end:
            raise _err(ErrorCode.BAD_REQUEST, f"read offset {offset} is beyond the end of {name!r} ({end})", end)
        want = end - offset if length == 0 else min(length, end - offset)
        return want, obj.read(offset, want, limit=end)

    # -- writes ----------------------------------------------------------------------
    async def append(
        self, namespace: str, role: str, name: str, offset: int, epoch: int, crc: int, data: bytes
    ) -> int:
        """Append and wait until durable; returns the new length (offset + len(data))."""
        pending = await self.append_begin(namespace, role, name, offset, epoch, crc, data)
        return await self.finish(pending)

    async def append_begin(
        self, namespace: str, role: str, name: str, offset: int, epoch: int, crc: int, data: bytes
    ) -> "Pending":
        """Check and write (no sync). The session calls this in request order per object,
        then :meth:`finish` concurrently, so pipelined appends share one sync."""
        self._writer(role, "append")
        _check_name(name)
        n = len(data)
        if crc32c(data) != crc:
            raise _err(ErrorCode.CHECKSUM_MISMATCH, f"CRC32C of the {n} data bytes does not match; nothing written")
        ns = self._ns(namespace)
        async with self._locks((namespace, name)):
            if epoch < ns.fence:
                raise _err(ErrorCode.FENCED, f"epoch {epoch} is fenced: namespace {namespace!r} is at {ns.fence}", ns.fence)
            obj = ns.get(name)
            if obj is None:
                if offset != 0:
                    raise _err(ErrorCode.OFFSET_MISMATCH, f"object {name!r} does not exist: append at offset 0", 0)
                if len(ns.objects) >= self.limits.max_objects:
                    raise _err(
                        ErrorCode.QUOTA_EXCEEDED,
                        f"namespace {namespace!r} already has {len(ns.objects)} objects, the limit",
                    )
                if n > self.limits.max_object_size:
                    raise _err(
                        ErrorCode.QUOTA_EXCEEDED, f"{n} bytes exceed the object size limit {self.limits.max_object_size}"
                    )
                obj = await trio.to_thread.run_sync(ns.create, name)
            if offset < obj.length:
                # a retry of something that landed? (same bytes at the same offset)
                if offset + n <= obj.length and await self._same_bytes(obj, offset, data):
                    return Pending(obj, self._file_end_of(obj, offset + n), obj.rollbacks, offset + n, n)
                if obj.sealed:
                    raise _err(ErrorCode.SEALED, f"object {name!r} is sealed at {obj.length}", obj.length)
                raise _err(
                    ErrorCode.OFFSET_MISMATCH, f"append at {offset} but {name!r} is {obj.length} bytes long", obj.length
                )
            if offset > obj.length:
                raise _err(
                    ErrorCode.OFFSET_MISMATCH, f"append at {offset} but {name!r} is {obj.length} bytes long", obj.length
                )
            if obj.sealed:
                raise _err(ErrorCode.SEALED, f"object {name!r} is sealed at {obj.length}", obj.length)
            if obj.length + n > self.limits.max_object_size:
                raise _err(
                    ErrorCode.QUOTA_EXCEEDED,
                    f"{name!r} would grow to {obj.length + n} bytes, the limit is {self.limits.max_object_size}",
                )
            if n:
                if n >= THREAD_WRITE_MIN:
                    await trio.to_thread.run_sync(obj.append, data, crc)
                else:
                    obj.append(data, crc)
            return Pending(obj, obj.file_size, obj.rollbacks, offset + n, n)

    async def finish(self, pending: "Pending") -> int:
        """Wait until the write of *pending* is durable; returns its result length."""
        await self._wait_durable(pending.obj, pending.end_size, pending.rollbacks)
        if pending.appended is not None:
            self.metrics.appended(pending.appended)
        return pending.result

    @staticmethod
    def _file_end_of(obj: StoredObject, logical_end: int) -> int:
        """A file size that covers logical byte *logical_end* (conservative: the current end)."""
        if logical_end <= obj.synced_length:
            return obj.synced_size
        return obj.file_size

    async def _same_bytes(self, obj: StoredObject, offset: int, data: bytes) -> bool:
        n = len(data)
        if n == 0:
            return True
        if n >= THREAD_READ_MIN:
            stored = await trio.to_thread.run_sync(lambda: obj.read_bytes(offset, n, limit=obj.length))
        else:
            stored = obj.read_bytes(offset, n, limit=obj.length)
        return stored == data

    async def seal(self, namespace: str, role: str, name: str, epoch: int) -> int:
        return await self.finish(await self.seal_begin(namespace, role, name, epoch))

    async def seal_begin(self, namespace: str, role: str, name: str, epoch: int) -> "Pending":
        self._writer(role, "seal")
        _check_name(name)
        ns = self._ns(namespace)
        async with self._locks((namespace, name)):
            if epoch < ns.fence:
                raise _err(ErrorCode.FENCED, f"epoch {epoch} is fenced: namespace {namespace!r} is at {ns.fence}", ns.fence)
            obj = ns.get(name)
            if obj is None:
                raise _err(ErrorCode.NOT_FOUND, f"no object {name!r} in namespace {namespace!r}")
            if not obj.sealed:
                obj.write_seal()
            return Pending(obj, obj.file_size, obj.rollbacks, obj.length, None)

    async def fence(self, namespace: str, role: str, epoch: int) -> int:
        self._writer(role, "fence")
        ns = self._ns(namespace)
        async with self._fence_locks((namespace,)):
            if epoch <= ns.fence:
                raise _err(
                    ErrorCode.FENCED, f"fence epoch {epoch} must be greater than the current {ns.fence}", ns.fence
                )
            await trio.to_thread.run_sync(ns.set_fence, epoch)
        return epoch

    # -- retention -------------------------------------------------------------------
    async def gc(self, keep: int, min_age: float, *, now: float | None = None) -> list[tuple[str, str]]:
        """Apply retention to every namespace; returns the (namespace, name) removed."""
        removed = []
        for ns in list(self.storage.namespaces.values()):
            for name in plan_retention(ns, keep, min_age, now=now):
                async with self._locks((ns.name, name)):
                    if name in ns.objects:
                        await trio.to_thread.run_sync(ns.remove, name)
                        removed.append((ns.name, name))
        if removed:
            self.metrics.gc_removed.inc(len(removed))
            log.info("retention removed %d objects", len(removed))
        return removed


def _durably_sealed(obj: StoredObject) -> bool:
    return obj.sealed and obj.synced_size > obj.seal_pos


def plan_retention(ns: Namespace, keep: int, min_age: float, *, now: float | None = None) -> list[str]:
    """Names to remove: generations older than the newest *keep* complete ones, whose
    objects are all older than *min_age* seconds (file mtime). Only ``gen/<G>/...``."""
    if keep < 1:
        raise ValueError("keep-generations must be at least 1")
    now = time.time() if now is None else now
    gens: dict[int, list[str]] = {}
    complete: set[int] = set()
    for name in ns.objects:
        parts = name.split("/")
        if len(parts) < 3 or parts[0] != "gen" or not (parts[1].isascii() and parts[1].isdigit()):
            continue
        g = int(parts[1])
        gens.setdefault(g, []).append(name)
        if len(parts) == 3 and parts[2] == "ready":
            complete.add(g)
    newest = sorted(complete, reverse=True)
    if len(newest) < keep:
        return []
    oldest_kept = newest[keep - 1]
    out: list[str] = []
    for g in sorted(gens):
        if g >= oldest_kept:
            continue
        names = gens[g]
        try:
            if all(now - os.stat(ns.objects[n].path).st_mtime > min_age for n in names):
                out.extend(sorted(names))
        except FileNotFoundError:
            continue
    return out
