"""Engine: the append-only rules, authentication decisions, group commit and retention.

Above storage (files) and below session (frames). Everything here is trio; blocking file
work that can take long (fdatasync, large writes and reads, fence files) runs in worker
threads.

Group commit: an append writes its frame to the object's file and a record of it to the
shared write-ahead log (sos_server.wal; neither synced), registers its object in the *next*
batch and waits. One syncer task takes the whole batch and fdatasyncs the log file once,
on a plain thread, whatever the number of objects the batch touched, then wakes the
waiters. A big append (64 KiB or more) is not copied into the log: its object file is
fdatasynced by the group commit, concurrently with the log (the disk's bandwidth, not the
number of syncs, is its cost). Appends that arrive while a batch is syncing go into the following batch, so N
pipelined appends cost about two syncs, not N. An ack is sent only after the sync that
covers its bytes. Object files are synced at a checkpoint: when the log file reaches its
size, the syncer switches to a fresh one at a batch boundary, and a checkpoint task
fdatasyncs the objects the old file touched (concurrently, on the same pool of threads)
and deletes it. Objects being synced are pinned, so the descriptor cache
(storage.OpenFiles) never closes a descriptor a sync is using. The test-only fault point
``SOS_SERVER_TEST_FAULT=after-log-sync:N`` is described in sos_server/wal.py.

Epochs: APPEND and SEAL must carry the namespace's fence epoch exactly (an epoch is taken
with FENCE first); FENCE moves the fence up by at most MAX_FENCE_STEP and never past
MAX_EPOCH (segment names carry epochs in 10 digits).

Journal generations (names ``gen/<G>/...``, protocol.md 2.1): the server does not read
journals, but it keeps their numbering honest, because retention acts on it. A new
generation directory may only be the next one (1 in a namespace without any); ``ready``
stays empty; a generation is *complete* only when its ``ready`` is empty and durably
sealed, and the server's clock at that seal (the file's mtime) dates the completion.
Retention (:func:`plan_retention`) counts only complete generations that have been
complete for ``min_age``.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import trio

from sos_wire.auth import verify_proof
from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.events import Payload
from sos_wire.frames import MAX_TIER_WAIT_MS
from sos_wire.names import BadName, validate_name, validate_namespace

from .metrics import Metrics, NamespaceStats, NullMetrics
from .storage import (
    MAX_EPOCH,
    OBJECT_CHARGE,
    ROLE_APPEND,
    Namespace,
    Storage,
    StorageError,
    StoredObject,
    journal_generation,
    unlink_durable,
)
from .wal import fault_after_syncs

__all__ = [
    "DEFAULT_MAX_OBJECTS",
    "MAX_EPOCH",
    "MAX_FENCE_STEP",
    "OBJECT_CHARGE",
    "Engine",
    "Limits",
    "Pending",
    "ServerError",
    "completed_at",
    "plan_retention",
]

if TYPE_CHECKING:
    from .tiering import Tier

log = logging.getLogger(__name__)

#: the engine's typed error is the storage one: a wire ErrorCode, a message and a u64
ServerError = StorageError

# writes this big would go to a worker thread: never, inline is cheaper (BENCHMARKS.md), and an
# object write and its log record must be one step on the event loop (group commit snapshots)
THREAD_WRITE_MIN = 1 << 62
THREAD_READ_MIN = 128 << 10
SYNC_THREADS = 128  # concurrent fdatasyncs of one checkpoint (one per touched file)
MAX_FENCE_STEP = 1000  # one FENCE moves a namespace's fence up by at most this much


#: objects per namespace by default (--max-objects). A journal namespace needs few: a
#: generation is ~1 GiB of 64 MiB segments (16), its ``ready`` and one segment per writer
#: restart, so 10,000 objects hold hundreds of generations; and at OBJECT_CHARGE each they
#: cost at most ~40 MiB of disk in a namespace without a byte quota (1,000,000 was ~4 GiB).
DEFAULT_MAX_OBJECTS = 10_000


@dataclass
class Limits:
    max_objects: int = DEFAULT_MAX_OBJECTS  # per namespace
    max_object_size: int = 1 << 40  # bytes per object
    max_list: int = 1000
    max_total_objects: int = 2_000_000  # in all namespaces together (~0.75 KiB of memory each)
    namespace_quota: int | None = None  # bytes per namespace without a quota file of its own


@dataclass
class Pending:
    """A write that landed in the file and waits for its group commit."""

    obj: StoredObject
    end_size: int  # file bytes that must be durable
    rollbacks: int  # obj.rollbacks when written
    result: int  # the length to acknowledge
    appended: int | None  # data bytes (for metrics), None for a seal
    completes: int | None = None  # the journal generation this seal completes (its first seal of ready)


@dataclass
class _Batch:
    objs: set[StoredObject] = field(default_factory=set)
    done: trio.Event = field(default_factory=trio.Event)


class _SyncJob:
    """One batch handed to the sync threads: a result per object ((size, length) or the
    OSError), how many are still running, and the event the last one sets."""

    __slots__ = ("done", "pending", "results")

    def __init__(self, n: int) -> None:
        # every slot is set by its sync thread before ``done``
        self.results: list[tuple[int, int] | OSError] = [OSError(errno.EIO, "not synced")] * n
        self.pending = n
        self.done = trio.Event()


class _Syncable(Protocol):
    """What the sync threads sync: a log file or an object file."""

    def sync(self) -> tuple[int, int]: ...


class _SyncPool:
    """Plain threads that fdatasync the files of a batch concurrently.

    Cheaper than one ``trio.to_thread`` per file: the event loop hands a whole batch over
    with queue puts and is woken once, by the last sync of the batch (on a loaded
    2-core machine every trio<->thread round trip costs the loop ~100+ us)."""

    def __init__(self, token: trio.lowlevel.TrioToken, max_threads: int = SYNC_THREADS) -> None:
        self.token = token
        self.max_threads = max_threads
        self.q: queue.SimpleQueue[tuple[_Syncable, _SyncJob, int] | None] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []
        self.idle = 0
        self.lock = threading.Lock()

    def _grow(self, wanted: int) -> None:
        with self.lock:
            missing = min(wanted, self.max_threads) - self.idle
            for _ in range(max(0, missing)):
                if len(self.threads) >= self.max_threads:
                    break
                t = threading.Thread(target=self._work, name="sos-sync", daemon=True)
                self.threads.append(t)
                self.idle += 1
                t.start()

    def _work(self) -> None:
        while True:
            item = self.q.get()
            if item is None:
                return
            with self.lock:
                self.idle -= 1
            obj, job, i = item
            res: tuple[int, int] | OSError
            try:
                res = obj.sync()
            except OSError as exc:
                res = exc
            except BaseException as exc:  # noqa: BLE001 - a sync thread's last resort: never lose a batch, report EIO
                res = OSError(errno.EIO, f"sync raised {exc!r}")
            with self.lock:
                self.idle += 1
                job.results[i] = res
                job.pending -= 1
                last = job.pending == 0
            if last:
                with contextlib.suppress(trio.RunFinishedError):
                    self.token.run_sync_soon(job.done.set)

    async def sync_all(self, objs: Sequence[_Syncable]) -> list[tuple[int, int] | OSError]:
        """fdatasync every object's file concurrently; (size, length) or OSError per object."""
        if not objs:
            return []
        job = _SyncJob(len(objs))
        self._grow(len(objs))
        for i, obj in enumerate(objs):
            self.q.put((obj, job, i))
        await job.done.wait()
        return job.results

    def close(self) -> None:
        for _ in self.threads:
            self.q.put(None)


class _LockTable:
    """trio.Lock per key, dropped when nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[tuple[str, ...], _LockEntry] = {}

    def __call__(self, key: tuple[str, ...]) -> _Held:
        return _Held(self, key)


class _LockEntry:
    """A key's lock and how many tasks hold or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self.users = 0


class _Held:
    def __init__(self, table: _LockTable, key: tuple[str, ...]) -> None:
        self.table, self.key = table, key

    async def __aenter__(self) -> None:
        entry = self.table._locks.get(self.key)
        if entry is None:
            entry = self.table._locks[self.key] = _LockEntry()
        entry.users += 1
        try:
            await entry.lock.acquire()
        except BaseException:
            self._drop(entry)
            raise

    async def __aexit__(self, *exc: object) -> None:
        entry = self.table._locks[self.key]
        entry.lock.release()
        self._drop(entry)

    def _drop(self, entry: _LockEntry) -> None:
        entry.users -= 1
        if entry.users == 0:
            del self.table._locks[self.key]


def _err(code: ErrorCode, message: str, length: int = 0) -> ServerError:
    return ServerError(code, message, length)


def _check_name(name: str) -> None:
    try:
        validate_name(name)
    except BadName as exc:
        raise _err(ErrorCode.BAD_NAME, str(exc)) from None


def _check_epoch(namespace: str, fence: int, epoch: int) -> None:
    """APPEND and SEAL carry the writer's epoch, which must be the namespace's fence: one
    below was fenced off by a newer writer, one above was never taken with FENCE."""
    if epoch < fence:
        raise _err(ErrorCode.FENCED, f"epoch {epoch} is fenced: namespace {namespace!r} is at {fence}", fence)
    if epoch > fence:
        raise _err(
            ErrorCode.FENCED,
            f"epoch {epoch} is above the fence of namespace {namespace!r} ({fence}): a writer takes its epoch"
            " with FENCE before it appends or seals",
            fence,
        )


def _ready_generation(name: str) -> int | None:
    """G if *name* is ``gen/<G>/ready``."""
    g = journal_generation(name)
    return g if g is not None and name.endswith("/ready") and name.count("/") == 2 else None


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
        #: the object-store tier (serve --tier), told of every group commit; None without one
        self.tier: Tier | None = None
        self._locks = _LockTable()
        self._batch = _Batch()
        self._wake = trio.Event()
        self._pool: _SyncPool | None = None
        self._fence_locks = _LockTable()
        self._running = False
        self._checkpointing = False
        self._log_failed = False  # the last log sync failed: switch files at the next batch
        self._fault = fault_after_syncs()
        self._spare_retry_at = 0.0
        self.metrics.open_files.set_function(lambda: len(storage.files))
        #: per namespace: [appends, bytes appended, unix time of the last] acknowledged since the start
        self._appended: dict[str, list[float]] = {}
        self._newest_mtime: dict[str, float | None] = {}  # before an append: the newest object file's mtime
        self.metrics.watch_namespaces(self.namespace_stats)

    # -- lifecycle -------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The group-commit syncer; run it in a nursery for the engine's lifetime."""
        if self.storage.wal is None:
            await trio.to_thread.run_sync(self.storage.start_wal)
        self._pool = _SyncPool(trio.lowlevel.current_trio_token())
        self._running = True
        try:
            async with trio.open_nursery() as checkpoints:
                task_status.started()
                while True:
                    await self._wake.wait()
                    self._wake = trio.Event()
                    batch, self._batch = self._batch, _Batch()
                    await self._sync_batch(batch, checkpoints)
        finally:
            self._running = False
            self._pool.close()

    async def _sync_batch(self, batch: _Batch, checkpoints: trio.Nursery) -> None:
        """One group commit: fdatasync the log file the batch's records are in, once."""
        wal = self.storage.wal
        if wal is None or self._pool is None:
            raise RuntimeError("the group-commit syncer is not running (Engine.run)")
        # what is durable once the log is: everything written before this point (each
        # object write and its log record are made in one step on the event loop)
        snap = [(obj, obj.file_size, obj.length) for obj in batch.objs]
        t0 = time.perf_counter()
        log_file = wal.current
        switched = (wal.wants_checkpoint() or self._log_failed) and not self._checkpointing and wal.spare is not None
        if switched:
            wal.switch()  # later records go to the next file; this batch syncs the old one
            self._checkpointing, self._log_failed = True, False
        elif wal.spare is None and not self._checkpointing and time.monotonic() >= self._spare_retry_at:
            self._checkpointing = True  # making the spare failed (a full disk?): try again
            self._spare_retry_at = time.monotonic() + 1.0
            checkpoints.start_soon(self._make_spare)
        indirect = wal.take_indirect()  # big writes: synced in place, beside the log
        for obj in indirect:
            obj.pins += 1  # the descriptor cache must not close what a sync thread uses
        try:
            res, *in_place = await self._pool.sync_all([log_file, *indirect])
        finally:
            for obj in indirect:
                obj.pins -= 1
                obj.close_if_done()
        failed: dict[int, OSError] = {}
        for obj, r in zip(indirect, in_place):
            if isinstance(r, OSError):
                failed[id(obj)] = r
                if not any(o is obj for o, _, _ in snap):
                    await self._sync_failed(obj, r)
            else:
                obj.checkpointed_size = max(obj.checkpointed_size, r[0])
        if isinstance(res, OSError):
            self._log_failed = True
            failed = {id(obj): res for obj, _, _ in snap}
        else:
            wal.syncs += 1
            if self._fault is not None and wal.syncs >= self._fault:
                wal.crash_for_test()
        tier = self.tier
        for obj, size, length in snap:
            if id(obj) in failed:
                await self._sync_failed(obj, failed[id(obj)])
            else:
                before = obj.synced_length
                obj.mark_synced(size, length)
                if tier is not None and not obj.removed:
                    tier.note(obj, obj.synced_length - before)  # before the acks: TIER_WAIT may follow at once
        self.storage.files.trim()  # what this batch made clean may be closed now
        if switched:
            checkpoints.start_soon(self._checkpoint)
        self.metrics.synced(time.perf_counter() - t0, len(snap))
        batch.done.set()

    async def _make_spare(self) -> None:
        wal = self.storage.wal
        assert wal is not None
        try:
            await trio.to_thread.run_sync(wal.make_spare)
        finally:
            self._checkpointing = False

    async def _checkpoint(self) -> None:
        """Make the objects of the retired log files durable in their own files, then
        delete those log files and make the next spare (see sos_server.wal)."""
        wal = self.storage.wal
        assert wal is not None and self._pool is not None
        try:
            files = list(wal.retired)
            objs = [obj for obj in wal.checkpoint_objects() if not obj.removed]
            for obj in objs:
                obj.pins += 1
            try:
                results = await self._pool.sync_all(objs)
            finally:
                for obj in objs:
                    obj.pins -= 1
                    obj.close_if_done()
                self.storage.files.trim()
            failed = [(obj, res) for obj, res in zip(objs, results) if isinstance(res, OSError) and not obj.removed]
            if failed:
                obj, exc = failed[0]
                log.error(
                    "checkpoint: fdatasync of %d object files failed (first: %s: %s); the log files are kept"
                    " (replayed at the next start) and the checkpoint is tried again later",
                    len(failed),
                    obj.path,
                    exc,
                )
            else:
                for obj, res in zip(objs, results):
                    if not isinstance(res, OSError):
                        obj.checkpointed_size = max(obj.checkpointed_size, res[0])
                wal.retired = [lf for lf in wal.retired if lf not in files]
                await trio.to_thread.run_sync(wal.drop_retired, files)
            await trio.to_thread.run_sync(wal.make_spare)
        except Exception:
            log.exception("checkpoint failed; the log files are kept")
        finally:
            self._checkpointing = False

    async def _sync_failed(self, obj: StoredObject, exc: OSError) -> None:
        code = ErrorCode.NO_SPACE if exc.errno in (errno.ENOSPC, errno.EDQUOT) else ErrorCode.INTERNAL
        log.error("fdatasync of the log failed (%s): cutting unsynced bytes of %s back", exc, obj.path)
        async with self._locks((obj.namespace, obj.name)):
            obj.sync_error = _err(code, f"could not make {obj.name!r} durable: {exc.strerror}")
            try:
                obj.rollback()
            except OSError:
                log.exception("rollback of %s failed", obj.path)

    def _register(self, obj: StoredObject) -> _Batch:
        if not self._running:
            raise _err(ErrorCode.INTERNAL, "server is shutting down")
        batch = self._batch
        batch.objs.add(obj)
        self._wake.set()
        return batch

    async def _wait_durable(self, obj: StoredObject, end_size: int, rollbacks: int) -> None:
        """Wait until file bytes [.., end_size) of *obj* are synced; raise if they were cut."""
        while obj.synced_size < end_size:
            if obj.rollbacks != rollbacks:
                break
            await self._register(obj).done.wait()
        if obj.rollbacks != rollbacks and any(cut < end_size for cut in obj.cuts[rollbacks:]):
            raise obj.sync_error or _err(ErrorCode.INTERNAL, "append was cut back")

    def namespace_stats(self) -> builtins.list[NamespaceStats]:
        """The per-namespace figures of the metrics endpoint. Runs in the endpoint's thread:
        reads only (snapshots of the tables; the quota file read afresh, not cached)."""
        out = []
        for ns in builtins.list(self.storage.namespaces.values()):
            counts = self._appended.get(ns.name)
            if counts is not None:
                last: float | None = counts[2]
            elif ns.name in self._newest_mtime:
                last = self._newest_mtime[ns.name]
            else:
                last = self._newest_mtime[ns.name] = _newest_mtime(ns)
            quota = ns.peek_quota()
            out.append(
                NamespaceStats(
                    namespace=ns.name,
                    data_bytes=ns.usage.bytes,
                    objects=len(ns.objects),
                    charged_bytes=ns.charged(),
                    quota_bytes=quota if quota is not None else self.limits.namespace_quota,
                    fence_epoch=ns.fence,
                    appends=int(counts[0]) if counts else 0,
                    append_bytes=int(counts[1]) if counts else 0,
                    last_append=last,
                )
            )
        return out

    # -- auth ------------------------------------------------------------------------
    def authenticate(
        self, namespace: str, key_id: bytes, nonce: bytes, proof: bytes, channel_binding: bytes = b""
    ) -> str:
        """Check an AUTH proof; returns the key's role. AUTH_FAILED says nothing more.

        *channel_binding*: ``b""`` on plain TCP; inside TLS the tls-server-end-point
        binding of the server's own certificate (protocol.md 1.6)."""
        failed = _err(ErrorCode.AUTH_FAILED, f"authentication to namespace {namespace!r} failed")
        try:
            validate_namespace(namespace)
        except BadName:
            raise failed from None
        rec = self.storage.get_key(namespace, key_id)
        if rec is None or rec.namespace != namespace:
            raise failed
        if not verify_proof(rec.secret, nonce, namespace, key_id, proof, channel_binding):
            raise failed
        ns = self.storage.namespace(namespace, create=True)
        assert ns is not None
        ns.read_quota()  # a damaged quota file shows at once (APPENDs re-read it when it changes)
        return rec.role

    def _ns(self, namespace: str) -> Namespace:
        ns = self.storage.namespace(namespace, create=True)
        assert ns is not None
        return ns

    @staticmethod
    def _writer(role: str, what: str) -> None:
        if role != ROLE_APPEND:
            raise _err(ErrorCode.FORBIDDEN, f"a {role} key cannot {what}")

    def _quota(self, ns: Namespace) -> int | None:
        """The namespace's byte quota now: its ``quota`` file (re-read when it changed, so
        `sos-server quota` binds open connections too), else ``--namespace-quota``."""
        quota = ns.current_quota()
        return quota if quota is not None else self.limits.namespace_quota

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
        self, namespace: str, role: str, name: str, offset: int, epoch: int, crc: int, data: Payload
    ) -> int:
        """Append and wait until durable; returns the new length (offset + len(data))."""
        pending = await self.append_begin(namespace, role, name, offset, epoch, crc, data)
        return await self.finish(pending)

    async def append_begin(
        self, namespace: str, role: str, name: str, offset: int, epoch: int, crc: int, data: Payload
    ) -> Pending:
        """Check and write (no sync). The session calls this in request order per object,
        then :meth:`finish` concurrently, so pipelined appends share one sync."""
        self._writer(role, "append")
        _check_name(name)
        n = len(data)
        if crc32c(data) != crc:
            raise _err(ErrorCode.CHECKSUM_MISMATCH, f"CRC32C of the {n} data bytes does not match; nothing written")
        ns = self._ns(namespace)
        async with self._locks((namespace, name)):
            _check_epoch(namespace, ns.fence, epoch)
            if n and _ready_generation(name) is not None:
                raise _err(
                    ErrorCode.BAD_REQUEST,
                    f"{name!r} marks a complete journal generation and stays empty: {n} bytes refused"
                    " (protocol.md 2.1)",
                )
            obj = ns.get(name)
            if obj is None:
                obj = await self._create_for_append(ns, namespace, name, offset, n)
            obj.refuse_writes("append to")
            if offset < obj.length:
                return await self._append_retry(obj, name, offset, data, n)
            self._check_append_growth(ns, namespace, name, obj, offset, n)  # the one call the hot path adds
            if n:
                if n >= THREAD_WRITE_MIN:
                    await trio.to_thread.run_sync(obj.append, data, crc)
                else:
                    obj.append(data, crc)
            return Pending(obj, obj.file_size, obj.rollbacks, offset + n, n)

    async def _create_for_append(self, ns: Namespace, namespace: str, name: str, offset: int, n: int) -> StoredObject:
        """The first append to *name*: the object-count, size and quota checks for a new object,
        then its file made (durable) and adopted. Under the object's lock."""
        if offset != 0:
            raise _err(ErrorCode.OFFSET_MISMATCH, f"object {name!r} does not exist: append at offset 0", 0)
        if len(ns.objects) + ns.creating >= self.limits.max_objects:
            raise _err(
                ErrorCode.QUOTA_EXCEEDED,
                f"namespace {namespace!r} already has {len(ns.objects) + ns.creating} objects, the limit"
                " (--max-objects)",
            )
        total = self.storage.object_count()
        if total >= self.limits.max_total_objects:
            raise _err(
                ErrorCode.QUOTA_EXCEEDED,
                f"the server holds {total} objects, its limit (--max-objects-total): no new object",
            )
        self._check_new_generation(ns, name)
        if n > self.limits.max_object_size:
            raise _err(
                ErrorCode.QUOTA_EXCEEDED, f"{n} bytes exceed the object size limit {self.limits.max_object_size}"
            )
        quota = self._quota(ns)
        if quota is not None and ns.charged() + OBJECT_CHARGE + n > quota:
            raise _err(
                ErrorCode.QUOTA_EXCEEDED,
                f"namespace {namespace!r} is charged {ns.charged()} bytes ({len(ns.objects)} objects at"
                f" {OBJECT_CHARGE} bytes each plus {ns.usage.bytes} data bytes): a new object ({OBJECT_CHARGE}"
                f" bytes) with {n} data bytes would exceed its quota of {quota} bytes (nothing written)",
            )
        # concurrent creations (pipelined) count this one while its file is made
        ns.creating += 1
        ns.reserved += OBJECT_CHARGE + n
        try:
            path, header_size = await trio.to_thread.run_sync(ns.create_file, name)
        finally:
            ns.creating -= 1
            ns.reserved -= OBJECT_CHARGE + n
        obj = ns.adopt(name, path, header_size)  # the in-memory tables: event loop only
        if self.tier is not None:
            self.tier.note(obj, 0)  # its file is durable: an empty object goes to the tier too
        return obj

    async def _append_retry(self, obj: StoredObject, name: str, offset: int, data: Payload, n: int) -> Pending:
        """An append below the object's end: a retry of something that landed (the same bytes
        at the same offset) is acknowledged again; anything else is refused."""
        if offset + n <= obj.length and await self._same_bytes(obj, offset, data):
            return Pending(obj, self._file_end_of(obj, offset + n), obj.rollbacks, offset + n, n)
        if obj.sealed:
            raise _err(ErrorCode.SEALED, f"object {name!r} is sealed at {obj.length}", obj.length)
        raise _err(ErrorCode.OFFSET_MISMATCH, f"append at {offset} but {name!r} is {obj.length} bytes long", obj.length)

    def _check_append_growth(
        self, ns: Namespace, namespace: str, name: str, obj: StoredObject, offset: int, n: int
    ) -> None:
        """An append at or past the object's end: it must be at the end, the object open, and
        the object's size and the namespace's quota leave room for *n* bytes."""
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
        quota = self._quota(ns) if n else None
        if quota is not None and ns.charged() + n > quota:
            raise _err(
                ErrorCode.QUOTA_EXCEEDED,
                f"namespace {namespace!r} is charged {ns.charged()} bytes ({len(ns.objects)} objects at"
                f" {OBJECT_CHARGE} bytes each plus {ns.usage.bytes} data bytes): {n} more would exceed its quota"
                f" of {quota} bytes (nothing written)",
            )

    @staticmethod
    def _check_new_generation(ns: Namespace, name: str) -> None:
        """A name that would open a new journal generation directory must open the next
        one: generations grow by one, from 1 (no far-future numbers that would sort as the
        newest, protocol.md 2.1)."""
        g = journal_generation(name)
        if g is None or g in ns.generations:
            return
        newest = ns.newest_generation()
        want = 1 if newest is None else newest + 1
        if g != want:
            raise _err(
                ErrorCode.BAD_REQUEST,
                f"{name!r} would start journal generation {g} in namespace {ns.name!r}, but generations grow"
                f" by one: the next one is {want} (protocol.md 2.1)",
            )

    async def finish(self, pending: Pending) -> int:
        """Wait until the write of *pending* is durable; returns its result length."""
        await self._wait_durable(pending.obj, pending.end_size, pending.rollbacks)
        if pending.appended is not None:
            self.metrics.appended(pending.appended)
            counts = self._appended.get(pending.obj.namespace)
            if counts is None:
                counts = self._appended[pending.obj.namespace] = [0, 0, 0.0]
            counts[0] += 1
            counts[1] += pending.appended
            counts[2] = time.time()
        elif pending.completes is not None and _durably_sealed(pending.obj):
            self.metrics.generations_completed.inc()
            log.info(
                "journal generation complete",
                extra={"namespace": pending.obj.namespace, "generation": pending.completes},
            )
        return pending.result

    @staticmethod
    def _file_end_of(obj: StoredObject, logical_end: int) -> int:
        """A file size that covers logical byte *logical_end* (conservative: the current end)."""
        if logical_end <= obj.synced_length:
            return obj.synced_size
        return obj.file_size

    async def _same_bytes(self, obj: StoredObject, offset: int, data: Payload) -> bool:
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

    async def seal_begin(self, namespace: str, role: str, name: str, epoch: int) -> Pending:
        self._writer(role, "seal")
        _check_name(name)
        ns = self._ns(namespace)
        async with self._locks((namespace, name)):
            _check_epoch(namespace, ns.fence, epoch)
            obj = ns.get(name)
            if obj is None:
                raise _err(ErrorCode.NOT_FOUND, f"no object {name!r} in namespace {namespace!r}")
            obj.refuse_writes("seal")
            completes = None
            if not obj.sealed:
                obj.write_seal()
                g = _ready_generation(name)
                completes = g if g is not None and obj.length == 0 else None
            return Pending(obj, obj.file_size, obj.rollbacks, obj.length, None, completes)

    async def fence(self, namespace: str, role: str, epoch: int) -> int:
        self._writer(role, "fence")
        ns = self._ns(namespace)
        async with self._fence_locks((namespace,)):
            if epoch <= ns.fence:
                stuck = ""
                if ns.fence >= MAX_EPOCH:
                    stuck = (
                        f"; no epoch can pass it (epochs end at {MAX_EPOCH}): the operator resets it offline with"
                        " `sos-server reset-fence`"
                    )
                raise _err(
                    ErrorCode.FENCED,
                    f"fence epoch {epoch} must be greater than the current {ns.fence}{stuck}",
                    ns.fence,
                )
            highest = min(MAX_EPOCH, ns.fence + MAX_FENCE_STEP)
            if epoch > highest:
                stuck = ""
                if highest <= ns.fence:
                    stuck = (
                        "; the fence is at the end of the range: the operator resets it with `sos-server reset-fence`"
                    )
                raise _err(
                    ErrorCode.TOO_LARGE,
                    f"fence epoch {epoch} is too far above the current {ns.fence}: at most {highest} (one FENCE"
                    f" moves the fence by at most {MAX_FENCE_STEP}; epochs end at {MAX_EPOCH}, the 10 digits of"
                    f" segment names){stuck}",
                    max(highest, ns.fence),
                )
            await trio.to_thread.run_sync(ns.set_fence, epoch)
            if self.tier is not None:
                # the store's marker before FENCE_OK: a replacement server takes the fence from
                # the store, and an acknowledged epoch must never be above it (protocol.md 1.11)
                await self.tier.fence(namespace, epoch)
        return epoch

    async def tier_wait(self, namespace: str, name: str, offset: int, timeout_ms: int) -> int:
        """TIER_WAIT (protocol.md 1.11): the object's length in the tier once it is >= offset."""
        _check_name(name)
        obj = self._ns(namespace).get(name)
        if obj is None:
            raise _err(ErrorCode.NOT_FOUND, f"no object {name!r} in namespace {namespace!r}")
        if offset > obj.synced_length:
            raise _err(
                ErrorCode.BAD_REQUEST,
                f"TIER_WAIT offset {offset} is beyond the durable length of {name!r} ({obj.synced_length})",
            )
        if self.tier is None:
            raise _err(ErrorCode.TIER_UNAVAILABLE, "no tier configured")
        return await self.tier.wait(namespace, name, offset, min(timeout_ms, MAX_TIER_WAIT_MS) / 1000)

    # -- retention -------------------------------------------------------------------
    async def gc(self, keep: int, min_age: float, *, now: float | None = None) -> builtins.list[tuple[str, str]]:
        """Apply retention to every namespace; returns the (namespace, name) removed."""
        removed = []
        for ns in list(self.storage.namespaces.values()):
            names = plan_retention(ns, keep, min_age, now=now)
            if names and self.tier is not None:
                # the store first: if it fails (or the server dies) the objects stay here and the
                # next run removes both, so nothing is left behind in the store
                try:
                    await self.tier.remove(ns.name, names)
                except Exception as exc:  # noqa: BLE001 - whatever the store did, the objects wait for the next run
                    log.warning(
                        "retention: cannot remove %d objects of %s from the tier, keeping them for the next run: %s",
                        len(names),
                        ns.name,
                        exc,
                        extra={"namespace": ns.name},
                    )
                    continue
            for name in names:
                async with self._locks((ns.name, name)):
                    if name in ns.objects:
                        path = ns.forget(name)  # bookkeeping here, on the event loop
                        await trio.to_thread.run_sync(unlink_durable, path)
                        removed.append((ns.name, name))
            if names and self.tier is not None:
                self.tier.removed(ns.name, names)
        if removed:
            self.metrics.gc_removed.inc(len(removed))
            log.info("retention removed %d objects", len(removed))
        return removed


def _newest_mtime(ns: Namespace) -> float | None:
    """The newest modification time of *ns*'s object files (None without objects)."""
    newest = None
    for obj in list(ns.objects.values()):
        try:
            t = os.stat(obj.path).st_mtime
        except OSError:
            continue
        newest = t if newest is None else max(newest, t)
    return newest


def _durably_sealed(obj: StoredObject) -> bool:
    return obj.sealed and obj.synced_size > obj.seal_pos


def completed_at(ns: Namespace, generation: int) -> float | None:
    """When the server saw journal generation *generation* complete (its clock, seconds
    since the epoch), or None if it is not complete: ``gen/<G>/ready`` exists, is empty,
    undamaged and durably sealed. The time is when the server wrote the seal: the
    modification time of the object's file (nothing writes to a sealed object)."""
    obj = ns.objects.get(f"gen/{generation:010d}/ready")
    if obj is None or obj.length != 0 or obj.damage or not _durably_sealed(obj):
        return None
    try:
        return os.stat(obj.path).st_mtime
    except FileNotFoundError:
        return None


def plan_retention(ns: Namespace, keep: int, min_age: float, *, now: float | None = None) -> list[str]:
    """Names to remove: the journal generations older than the newest *keep* generations
    that have been complete (:func:`completed_at`) for at least *min_age* seconds, whose
    objects are all older than *min_age* (file mtime). Only ``gen/<G>/...`` (G: 10 digits).

    Names a client chose cannot make history go: generation numbers only grow by one
    (the engine refuses others), "complete" is decided by the server, and a generation
    counts towards *keep* only once it has been complete for *min_age* by the server's
    clock, so whatever writes newer generations (a rogue append key too) cannot remove an
    older one before *min_age* has passed, time for an operator to notice and react."""
    if keep < 1:
        raise ValueError("keep-generations must be at least 1")
    now = time.time() if now is None else now
    gens: dict[int, list[str]] = {}
    for name in ns.objects:
        g = journal_generation(name)
        if g is not None:
            gens.setdefault(g, []).append(name)
    aged = []
    for g in gens:
        t = completed_at(ns, g)
        if t is not None and now - t >= min_age:
            aged.append(g)
    aged.sort(reverse=True)
    if len(aged) < keep:
        return []
    oldest_kept = aged[keep - 1]
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
