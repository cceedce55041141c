"""The part of the tier the server drives: flushes, compaction, fence markers, and the lag.

On the hot path the server calls :meth:`Uploader.flush`: ONE flushed object (``log.py``,
protocol.md 4.2a, 4.3a) holding every namespace's and object's bytes made durable since the last
flush; TIER_WAIT is answered by what the bucket holds in flushed objects and pieces together
(:meth:`Uploader.holds`). In the background :meth:`Uploader.compact` (4.3b) writes the objects'
per-object pieces with :meth:`Uploader.step` (below) and then deletes the flushed objects they
hold. What follows describes the per-object pieces, as compaction writes them.

Independent of the engine: the server tells the uploader what is durable (:meth:`Uploader.note`,
cheap, from the event loop) and, from a worker thread, asks it to make progress on one object
(:meth:`Uploader.step` / :meth:`Uploader.sync`) with a callable that reads the object's durable
bytes. The uploader

- learns what the bucket holds from the bucket's listing the first time it touches a namespace
  (:meth:`Uploader.learn`), never from local state alone: after a crash or on a replacement
  server it resumes where the bucket's run of pieces from 0 ends;
- writes the next piece, from where the bucket's run ends to the durable length, cut at
  multiples of ``max_piece`` (so a retry after a crash cuts the same way whenever it can),
  with ``put_once``: a piece that landed before the crash is ALREADY_SAME, nothing is
  duplicated; a key that holds other bytes (CONFLICT) is never overwritten: the object stops
  uploading and the problem is kept for the metrics and logs;
- writes the seal marker once every byte up to the seal is in the bucket;
- keeps, per namespace, the bytes and seconds acknowledged but not yet in the bucket, the last
  upload error and the conflicts (:meth:`Uploader.lag`), for metrics and the lag log line.

Thread-safe: a lock guards the bookkeeping, each object has its own lock so that two threads
never upload the same object at once, and no lock is held across a store call except the
object's own.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sos_tier.layout import (
    MAX_MARKER_BYTES,
    MAX_PIECE_BYTES,
    NOTICE_PREFIX,
    ObjectState,
    Problem,
    believe_fence,
    delete_object,
    fence_content,
    fence_key,
    name_key,
    namespace_prefix,
    notice_key,
    parse_key,
    piece_key,
    scan,
    scan_object,
    seal_content,
    seal_key,
    take_run,
)
from sos_tier.log import (
    LOG_PREFIX,
    MAX_INDEX_BYTES,
    MAX_LOG_DATA,
    Batch,
    LogDamage,
    decode_batch,
    encode_batch,
    log_key,
    read_index,
)
from sos_tier.store import PutOutcome, Store, TierError, TierNotFound
from sos_wire.crc import crc32c

__all__ = [
    "DEFAULT_MAX_PIECE",
    "CompactResult",
    "FlushItem",
    "FlushResult",
    "Lag",
    "LocalUnreadable",
    "Step",
    "TierFenced",
    "TierMarkerTaken",
    "Uploader",
]

log = logging.getLogger(__name__)

DEFAULT_MAX_PIECE = MAX_PIECE_BYTES  # readers refuse larger pieces (protocol.md 4.2)

#: Pieces under this size are absorbed by the next piece of their object (Uploader._absorb)
MERGE_BELOW = 1024 * 1024
#: Pieces of an object's run end the uploader remembers for absorbing (more than a block holds)
MAX_TAIL = 64

#: read(begin, end) -> the object's durable bytes [begin, end), exactly end - begin of them
Reader = Callable[[int, int], bytes]

#: Test hook: ``SOS_TIER_CRASH_AT=<point>`` ends the process (exit 137, like SIGKILL) at that
#: point: ``flushed`` (a flushed object landed, its waiters not yet told), ``compacted`` (the
#: per-object pieces of a compaction written, its flushed objects not yet deleted), ``deleted``
#: (its flushed objects deleted). The crash tests restart the server after each.
CRASH_ENV = "SOS_TIER_CRASH_AT"


def _crash_point(point: str) -> None:
    if os.environ.get(CRASH_ENV) == point:
        log.error("tier: crash point %s reached (%s): exiting", point, CRASH_ENV)
        logging.shutdown()
        os._exit(137)


class LocalUnreadable(Exception):
    """A :class:`FlushItem`'s reader cannot read the server's own copy (damage on its disk, or
    removed meanwhile): that object is left out of the flush, the others go on."""


@dataclass(frozen=True, slots=True)
class FlushItem:
    """What the server holds of one object now (captured where the engine changes it)."""

    namespace: str
    name: str
    read: Reader
    durable: int
    sealed: bool = False
    sealed_at_ns: int | None = None


@dataclass(slots=True)
class FlushResult:
    """One flush: the flushed object written (None: nothing to flush), its bytes and objects,
    whether more was pending than one flushed object holds, objects whose server copy could
    not be read (name -> why), and objects the bucket holds more of than the server."""

    key: str | None = None
    bytes: int = 0
    objects: int = 0
    pieces: int = 0  # entries (pieces inside the flushed object)
    more: bool = False
    unreadable: dict[tuple[str, str], str] = field(default_factory=dict)
    ahead: dict[tuple[str, str], str] = field(default_factory=dict)


@dataclass(slots=True)
class CompactResult:
    """One compaction pass: flushed objects listed, deleted, left (and why), pieces written,
    the age in seconds of the oldest flushed object left (0: none), pieces per compacted object."""

    listed: int = 0
    deleted: int = 0
    pieces: int = 0
    left: dict[str, str] = field(default_factory=dict)
    oldest_age: float = 0.0
    pieces_per_object: list[int] = field(default_factory=list)


class TierFenced(TierError):
    """The bucket holds a fence above this server's epoch for the namespace: another server
    took it over (this one is a zombie); it must not upload that namespace any more."""

    def __init__(self, namespace: str, bucket_epoch: int, epoch: int) -> None:
        super().__init__(
            f"namespace {namespace}: the bucket is fenced at epoch {bucket_epoch}, "
            f"this server holds {epoch}; another server took the namespace over"
        )
        self.namespace = namespace
        self.bucket_epoch = bucket_epoch
        self.epoch = epoch


class TierMarkerTaken(TierError):
    """The key of this server's own fence marker exists with other content (planted, or damage):
    the bucket cannot record this fence, so a FENCE of this epoch must not be answered OK."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, slots=True)
class Step:
    """What one :meth:`Uploader.step` did. kind: ``piece`` (wrote [begin, end)), ``seal``,
    ``exists`` (the marker of an empty object), ``idle`` (nothing to do), ``stuck`` (a conflict
    stops this object; ``message`` says why), ``ahead`` (the bucket holds more of the object than
    this server says is durable: another server wrote it, or the server lost data)."""

    kind: str
    key: str = ""
    begin: int = 0
    end: int = 0
    outcome: PutOutcome | None = None
    message: str = ""


@dataclass(frozen=True, slots=True)
class Lag:
    """Per namespace, for metrics: bytes acknowledged by the server and not yet in the bucket,
    the age of the oldest such byte (seconds; 0 when none), seals not yet in the bucket, the last
    upload error and when (wall clock), and the objects stopped by a conflict."""

    bytes: int
    seconds: float
    pending_seals: int
    last_error: str | None
    last_error_at: float | None
    stuck: dict[str, str]
    fenced: bool
    uploaded_bytes: int  # written by this uploader since it started (pieces it created)
    #: fence markers of the namespace not believed (key -> why): ignored, never obeyed
    ignored_fences: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Obj:
    uploaded: int = 0  # the bucket's run from 0 ends here (learned, then advanced by our puts)
    exists: bool = False  # the bucket holds some key of it
    bucket_seal: int | None = None
    durable: int = 0
    sealed: bool = False
    sealed_at_ns: int | None = None
    marks: deque[tuple[int, float]] = field(default_factory=deque)  # (durable length, first seen)
    stuck: str | None = None
    noted: bool = False  # the server told us of it (an empty object must reach the bucket too)
    #: the run's pieces (begin, end, key) at its end that a later piece may absorb (MERGE_BELOW)
    tail: list[tuple[int, int, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: the bucket holds bytes [0, logged) of it in flushed objects and pieces together (a TIER_WAIT
    #: is answered by it); ``uploaded``/``exists``/``bucket_seal`` are the per-object keys alone
    logged: int = 0
    log_seal: bool = False
    log_exists: bool = False

    @property
    def held(self) -> int:
        return max(self.uploaded, self.logged)

    @property
    def seal_held(self) -> bool:
        return self.bucket_seal is not None or self.log_seal

    @property
    def exists_held(self) -> bool:
        return self.exists or self.log_exists


@dataclass(slots=True)
class _Ns:
    objects: dict[str, _Obj] = field(default_factory=dict)
    learned: bool = False
    bucket_fence: int = 0
    fenced: bool = False
    last_error: str | None = None
    last_error_at: float | None = None
    uploaded_bytes: int = 0
    delete_refused: bool = False  # the store refused to delete absorbed pieces (logged once)
    marker_ok: int = 0  # the epoch whose marker this uploader wrote or checked
    # the highest epoch this server asked about (its own fence): a marker up to it that a
    # check with an older epoch lists is this server's own, written by a FENCE meanwhile
    own_fence: int = 0
    ignored_fences: dict[str, str] = field(default_factory=dict)
    learn_lock: threading.Lock = field(default_factory=threading.Lock)


class Uploader:
    def __init__(
        self,
        store: Store,
        *,
        max_piece: int = DEFAULT_MAX_PIECE,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        on_progress: Callable[[str, str, int, bool], None] | None = None,
    ) -> None:
        """*on_progress(namespace, name, uploaded, sealed_in_bucket)* is called (in the thread
        that made the step) after every write that moved an object on: the server wakes its
        wait-for-bucket waiters with it (``trio.lowlevel.TrioToken.run_sync_soon``)."""
        if not 1 <= max_piece <= MAX_PIECE_BYTES:
            raise ValueError(f"max_piece must be from 1 to {MAX_PIECE_BYTES} (readers refuse larger pieces)")
        self.store = store
        self.max_piece = max_piece
        self._on_progress = on_progress
        self._clock = clock
        self._wall = wall
        self._lock = threading.Lock()
        self._ns: dict[str, _Ns] = {}
        #: this process's name in its flushed objects' keys (random: two servers never collide)
        self.writer = secrets.token_hex(8)
        self._seq = 0
        self._batches: dict[str, Batch] = {}  # indexes of flushed objects known (immutable)
        self._flush_lock = threading.Lock()

    # -- what the server tells us (cheap; any thread) -------------------------------------------

    def note(
        self, namespace: str, name: str, durable: int, sealed: bool = False, sealed_at_ns: int | None = None
    ) -> None:
        """The server made *name* durable up to *durable* (and sealed it): start its lag clock."""
        now = self._clock()
        with self._lock:
            o = self._obj(namespace, name)
            o.noted = True
            if durable > o.durable:
                o.durable = durable
                o.marks.append((durable, now))
            if sealed and not o.sealed:
                o.sealed = True
                o.sealed_at_ns = sealed_at_ns
                if not o.marks or o.marks[-1][0] < durable + 1:
                    o.marks.append((durable + 1, now))  # a seal counts as one more byte to upload

    def remove(self, namespace: str, names: list[str]) -> None:
        """Retention: delete these objects' keys from the bucket (each from a fresh listing of
        its prefix: pieces first, then seal and name keys, protocol.md 4.6), then forget them.
        The server calls it with the names its own rule chose, after removing them locally."""
        for name in names:
            delete_object(self.store, scan_object(self.store, namespace, name))
        self.forget(namespace, names)

    def forget(self, namespace: str, names: list[str]) -> None:
        """Objects removed (retention): no lag for them any more."""
        with self._lock:
            ns = self._ns.get(namespace)
            for n in names:
                if ns is not None:
                    ns.objects.pop(n, None)

    # -- learning from the bucket --------------------------------------------------------------

    def learn(self, namespace: str, *, force: bool = False) -> None:
        """List the namespace in the bucket and take, per object, where its run of pieces from 0
        ends and whether it is sealed there; the fence markers' highest epoch. Done once per
        namespace (again with *force*); later progress is what this uploader wrote itself."""
        ns = self._namespace(namespace)
        with ns.learn_lock:
            if ns.learned and not force:
                return
            state = scan(self.store, namespace, cache=self._batches).get(namespace)
            with self._lock:
                ns.bucket_fence = state.fence if state else 0
                if state is not None:
                    for name, os_ in state.objects.items():
                        self._learn_object(ns, self._obj(namespace, name), os_)
                ns.learned = True

    def learned(self, namespace: str) -> bool:
        with self._lock:
            ns = self._ns.get(namespace)
            return ns is not None and ns.learned

    def _learn_object(self, ns: _Ns, o: _Obj, os_: ObjectState) -> None:  # under self._lock
        """What the bucket holds of one object: with flushed objects (``logged``, for TIER_WAIT)
        and in its own keys alone (``uploaded``, ``exists``, ``bucket_seal``: compaction's)."""
        own = [p for p in (*os_.pieces, *os_.extra) if not p.flushed]
        run, end = take_run(own)
        o.logged = os_.length
        o.uploaded = min(end, os_.length)
        o.tail = [(p.begin, p.end, p.key) for p in run[-MAX_TAIL:] if p.end <= o.uploaded]
        o.exists = bool(own) or bool(os_.seal_keys)
        o.log_exists = os_.exists
        # a seal marker counts even if pieces before it are missing: it is never written
        # again (its key exists); the missing pieces are
        lengths = [parse_key(k) for k in os_.seal_keys]
        o.bucket_seal = min((pk.length for pk in lengths if pk is not None), default=None)
        o.log_seal = os_.seal_length is not None
        if os_.problems:
            # the bucket's copy has a gap, damage or a conflict: say so; uploading goes on
            # from the good length (new pieces may overlap the bad ones)
            ns.last_error = "; ".join(p.message for p in os_.problems)
            ns.last_error_at = self._wall()

    def check_fence(self, namespace: str, epoch: int, *, strict: bool = False) -> None:
        """Compare the namespace's fence (the server's, *epoch*) with the bucket's markers (one
        listing): TierFenced if the bucket holds a believable marker above it (protocol.md 4.4:
        content ``{"epoch":E,"namespace":NS}``, at most FENCE_SLACK above *epoch*), which also
        stops every later upload of the namespace; if ours is higher, write our marker (once).
        A marker that is not believable (empty, other content, far beyond) is ignored: kept in
        :meth:`lag` (``ignored_fences``) and logged, never obeyed. When our own marker's key
        holds other content the bucket cannot record our fence: *strict* (FENCE, which must not
        be answered then) raises :class:`TierMarkerTaken`; otherwise (an upload round) it is
        kept like an ignored marker and uploading goes on. Call it when the server's fence
        changes and at each upload round, so a zombie learns within a round."""
        prefix = f"{namespace_prefix(namespace)}fence/"
        above: list[tuple[int, str, int]] = []
        own: tuple[int, str, int] | None = None
        ns = self._namespace(namespace)
        with self._lock:  # before listing: a marker our own FENCE writes later is then known ours
            ns.own_fence = max(ns.own_fence, epoch)
        for item in self.store.list(prefix):
            pk = parse_key(item.key)
            if pk is not None and pk.kind == "fence":
                if pk.epoch > epoch:
                    above.append((pk.epoch, item.key, item.size))
                elif pk.epoch == epoch:
                    own = (pk.epoch, item.key, item.size)
        verdict = believe_fence(self.store, namespace, above, known=epoch)
        self._ignored(ns, verdict.ignored)
        with self._lock:
            newer_here = ns.own_fence > epoch
        if newer_here and verdict.epoch <= ns.own_fence:
            # this check read the server's fence before a FENCE raised it; the marker above is
            # that FENCE's own (or none): nothing to obey, and the marker is the newer check's
            return
        if verdict.epoch > epoch:
            with self._lock:
                ns.bucket_fence, ns.fenced = verdict.epoch, True
                self._error(ns, str(TierFenced(namespace, verdict.epoch, epoch)))
            raise TierFenced(namespace, verdict.epoch, epoch)
        if epoch > 0 and ns.marker_ok != epoch:
            self._own_marker(namespace, ns, epoch, own, strict)
        with self._lock:
            ns.bucket_fence = epoch

    def _notice(self, namespace: str, epoch: int) -> None:
        """The copy of a fence marker under ``v1/fence/`` (protocol.md 4.3a): one listing tells a
        flushing server of every namespace taken over. Not authoritative (readers never read it);
        a key holding other content is logged and left."""
        key = notice_key(namespace, epoch)
        if self.store.put_once(key, fence_content(namespace, epoch)) is PutOutcome.CONFLICT:
            log.warning("tier: %s holds other content; left (a copy only, never obeyed)", key)

    def fence_copies(self) -> dict[str, int]:
        """The highest epoch of the copies of fence markers under ``v1/fence/``, by namespace:
        one listing for the whole bucket (keys that are not a copy's are skipped)."""
        out: dict[str, int] = {}
        for item in self.store.list(NOTICE_PREFIX):
            parts = item.key[len(NOTICE_PREFIX) :].split("/")
            if len(parts) == 2 and re.fullmatch("[0-9a-f]{16}", parts[1]):
                out[parts[0]] = max(out.get(parts[0], 0), int(parts[1], 16))
        return out

    def fences_above(self, epochs: dict[str, int]) -> set[str]:
        """Of the namespaces *epochs* names (namespace -> this server's fence), those with a
        copy of a fence marker above it under ``v1/fence/``: one listing for all of them. The
        caller then checks each with :meth:`check_fence` (which believes or ignores it)."""
        copies = self.fence_copies()
        return {n for n, e in epochs.items() if copies.get(n, 0) > e}

    def marker_due(self, namespace: str, epoch: int) -> bool:
        """Whether the fence marker of *epoch* is not yet known to be in the bucket."""
        with self._lock:
            ns = self._ns.get(namespace)
            return epoch > 0 and (ns is None or ns.marker_ok != epoch)

    def _own_marker(self, namespace: str, ns: _Ns, epoch: int, own: tuple[int, str, int] | None, strict: bool) -> None:
        """Our marker for *epoch*: written if the listing lacks it, else checked (once)."""
        key, want = fence_key(namespace, epoch), fence_content(namespace, epoch)
        if own is None:
            ok = self.store.put_once(key, want) is not PutOutcome.CONFLICT
        else:
            ok = own[2] == len(want) and self.store.get(key, 0, MAX_MARKER_BYTES) == want
        if ok:
            self._notice(namespace, epoch)
            ns.marker_ok = epoch
            return
        why = (
            f"{key}: the key of this server's fence marker (epoch {epoch}) holds content this server did not"
            " write; the bucket cannot record this fence"
        )
        self._ignored(ns, [Problem("fence", namespace, "", key, epoch, f"{why}; ignored (not obeyed)")])
        if strict:
            raise TierMarkerTaken(key, f"{why}: fence again with a higher epoch")

    def _ignored(self, ns: _Ns, problems: list[Problem]) -> None:
        """Fence markers not believed: kept (for the metric) and logged once each, loudly."""
        with self._lock:
            for p in problems:
                if p.key not in ns.ignored_fences:
                    ns.ignored_fences[p.key] = p.message
                    log.error("tier: bogus fence marker: %s", p.message)

    # -- uploading ---------------------------------------------------------------------------------

    def step(
        self,
        namespace: str,
        name: str,
        read: Reader,
        durable: int,
        sealed: bool = False,
        sealed_at_ns: int | None = None,
    ) -> Step:
        """Make one write of progress on *name*: the next piece, else the seal marker, else (an
        empty object the bucket does not know) the ``0-0`` piece. *durable*/*sealed* are what
        the server holds now (noted as by :meth:`note`). TierError from the store propagates
        (also kept as the namespace's last error); the caller retries later."""
        self.note(namespace, name, durable, sealed, sealed_at_ns)
        self.learn(namespace)
        ns = self._namespace(namespace)
        if ns.fenced:
            raise TierFenced(namespace, ns.bucket_fence, 0)
        with self._lock:
            o = self._obj(namespace, name)
        with o.lock:
            try:
                step = self._step(namespace, name, ns, o, read, durable, sealed, sealed_at_ns)
            except TierError as exc:
                with self._lock:
                    self._error(ns, f"{namespace}/{name}: {exc}")
                raise
            if step.kind in ("piece", "seal", "exists") and self._on_progress is not None:
                self._on_progress(namespace, name, o.uploaded, o.bucket_seal is not None)
            return step

    def _step(
        self,
        namespace: str,
        name: str,
        ns: _Ns,
        o: _Obj,
        read: Reader,
        durable: int,
        sealed: bool,
        sealed_at_ns: int | None,
    ) -> Step:
        if o.stuck:
            return Step("stuck", message=o.stuck)
        if o.uploaded > durable:
            msg = (
                f"{namespace}/{name}: the bucket holds {o.uploaded} bytes, this server {durable}: "
                "another server wrote it, or this one lost data; not uploading it"
            )
            with self._lock:
                self._error(ns, msg)
            return Step("ahead", message=msg)
        if o.uploaded < durable:
            return self._piece(namespace, name, ns, o, read, durable)
        if sealed and o.bucket_seal is None:
            key = seal_key(namespace, name, durable)
            if not o.exists:
                self._name_key(namespace, name)
            outcome = self.store.put_once(key, seal_content(sealed_at_ns))
            if outcome is PutOutcome.CONFLICT:  # same length, other time: sealed all the same
                with self._lock:
                    self._error(ns, f"{namespace}/{name}: seal marker {key} exists with another time")
            with self._lock:
                o.bucket_seal, o.exists = durable, True
                self._drop_marks(o)
            return Step("seal", key, durable, durable, outcome)
        if sealed and o.bucket_seal != durable:
            return self._stuck(
                ns,
                o,
                seal_key(namespace, name, o.bucket_seal or 0),
                f"sealed in the bucket at {o.bucket_seal}, on this server at {durable}",
            )
        if durable == 0 and not o.exists:
            if not o.exists:
                self._name_key(namespace, name)
            key = piece_key(namespace, name, 0, 0, 0)
            outcome = self.store.put_once(key, b"")
            with self._lock:
                o.exists = True
            return Step("exists", key, 0, 0, outcome)
        return Step("idle")

    def _piece(self, namespace: str, name: str, ns: _Ns, o: _Obj, read: Reader, durable: int) -> Step:
        """The next piece: from where the run ends to the durable length (cut at a multiple of
        max_piece), started further back to absorb the small pieces before it (:meth:`_absorb`),
        which are deleted once it is written (protocol.md 4.3 step 7)."""
        start = o.uploaded
        end = min(durable, (start // self.max_piece + 1) * self.max_piece)
        absorbed = self._absorb(o, start, end)
        begin = absorbed[0][0] if absorbed else start
        data = read(begin, end)
        if len(data) != end - begin:
            raise TierError(f"{namespace}/{name}: reading [{begin}, {end}) gave {len(data)} bytes")
        if not o.exists:
            self._name_key(namespace, name)
        key = piece_key(namespace, name, begin, end, crc32c(data))
        outcome = self.store.put_once(key, data)
        if outcome is PutOutcome.CONFLICT:
            return self._stuck(ns, o, key, f"piece {key} exists with other bytes (damage in the bucket)")
        kept = [t for t in o.tail if t not in absorbed][-MAX_TAIL + 1 :]
        o.tail = [*kept, (begin, end, key)]
        # bytes new to the bucket (compaction rewrites bytes a flushed object holds: not counted)
        self._advance(ns, o, end, max(0, end - o.held) if outcome is PutOutcome.CREATED else 0)
        if absorbed:
            self._delete_absorbed(ns, namespace, name, [k for _, _, k in absorbed if k != key])
        return Step("piece", key, begin, end, outcome)

    def _absorb(self, o: _Obj, start: int, end: int) -> list[tuple[int, int, str]]:
        """The pieces at the end of the run that the piece [start, end) takes in: while the one
        before is small (under MERGE_BELOW), in the same max_piece block, reaches *start* and is
        under twice the piece's size so far. Sizes then at least double going back, so an object
        that grows by small appends keeps about log2(MERGE_BELOW) small pieces per block, and
        every byte is written again only that many times."""
        block = start // self.max_piece * self.max_piece
        absorbed: list[tuple[int, int, str]] = []
        begin = start
        for b, e, k in reversed(o.tail):
            if b < block or e < begin or e - b >= MERGE_BELOW or e - b >= 2 * (end - begin):
                break
            absorbed.insert(0, (b, e, k))
            begin = b
        return absorbed

    def _delete_absorbed(self, ns: _Ns, namespace: str, name: str, keys: list[str]) -> None:
        """Delete pieces a written piece holds whole (same bytes, it was read from the same
        durable object). A store that refuses (object lock, no DeleteObject) leaves them: readers
        take the larger piece anyway (4.4); logged once per namespace, uploading goes on."""
        if not keys:
            return
        try:
            self.store.delete(keys)
        except TierError as exc:
            with self._lock:
                if not ns.delete_refused:
                    ns.delete_refused = True
                    log.warning(
                        "tier: %s/%s: cannot delete pieces a larger piece replaced (%s); they stay in the bucket",
                        namespace,
                        name,
                        exc,
                    )

    # -- flushing: one flushed object for every namespace (protocol.md 4.3a) ------------------------

    def flush(self, items: list[FlushItem]) -> FlushResult:
        """Write one flushed object holding, of every item, the bytes past what the bucket holds
        (up to MAX_LOG_DATA in all; the rest is left for the next flush, ``more``), its seal
        entry once every byte to the seal is in, and the ``0-0`` entry of a new empty object.
        Learn each item's namespace first. TierError from the store propagates (nothing is
        advanced: the next flush writes the same bytes again, in another flushed object)."""
        res = FlushResult()
        parts: list[tuple[str, str, int, bytes]] = []
        seals: list[tuple[str, str, int, int | None]] = []
        room, index = MAX_LOG_DATA, 64
        with self._flush_lock:
            for it in items:
                self.note(it.namespace, it.name, it.durable, it.sealed, it.sealed_at_ns)
                with self._lock:
                    o = self._obj(it.namespace, it.name)
                    start, seal_held, exists_held = o.held, o.seal_held, o.exists_held
                if o.stuck:
                    continue
                if start > it.durable:
                    res.ahead[(it.namespace, it.name)] = (
                        f"{it.namespace}/{it.name}: the bucket holds {start} bytes, this server {it.durable}: "
                        "another server wrote it, or this one lost data; not uploading it"
                    )
                    continue
                index += 64 + len(it.namespace) + 2 * len(it.name)  # JSON escapes at most double a name
                take = min(it.durable - start, room)
                if index > MAX_INDEX_BYTES or (take == 0 and start < it.durable):
                    res.more = True
                    break
                if take:
                    try:
                        data = it.read(start, start + take)
                    except LocalUnreadable as exc:  # the server's own copy: this object stops, not the flush
                        res.unreadable[(it.namespace, it.name)] = str(exc)
                        continue
                    if len(data) != take:
                        raise TierError(f"{it.namespace}/{it.name}: reading [{start}, {start + take}) gave {len(data)}")
                    parts.append((it.namespace, it.name, start, data))
                    room -= take
                    res.more = res.more or start + take < it.durable
                elif it.durable == 0 and not exists_held:
                    parts.append((it.namespace, it.name, 0, b""))
                if it.sealed and not seal_held and start + take == it.durable:
                    seals.append((it.namespace, it.name, it.durable, it.sealed_at_ns))
            if parts or seals:
                self._write_flush(parts, seals, res)
        return res

    def _write_flush(
        self, parts: list[tuple[str, str, int, bytes]], seals: list[tuple[str, str, int, int | None]], res: FlushResult
    ) -> None:
        self._seq = max(self._seq + 1, int(self._wall() * 1_000_000))  # wall microseconds: listing order is age
        key = log_key(self._seq, self.writer)
        body, entries = encode_batch(parts, seals)
        if self.store.put_once(key, body) is PutOutcome.CONFLICT:  # a random writer id: damage or a planted key
            raise TierError(f"{key}: a flushed object's key holds other bytes (planted, or damage)")
        _crash_point("flushed")
        res.key, res.bytes = key, sum(len(d) for *_, d in parts)
        touched = {(ns, n) for ns, n, *_ in parts} | {(ns, n) for ns, n, *_ in seals}
        res.objects, res.pieces = len(touched), len(parts)
        with self._lock:
            for ns_name, name, begin, end, _crc in entries:
                o = self._obj(ns_name, name)
                o.logged = max(o.logged, end)
                o.log_exists = True
                self._ns[ns_name].uploaded_bytes += end - begin
            for ns_name, name, _length, _t in seals:
                self._obj(ns_name, name).log_seal = True
            for ns_name, name in touched:
                self._drop_marks(self._obj(ns_name, name))
            self._batches[key] = decode_batch(key, body)
        if self._on_progress is not None:
            for ns_name, name in sorted(touched):
                with self._lock:
                    o = self._obj(ns_name, name)
                self._on_progress(ns_name, name, o.held, o.seal_held)

    # -- compaction: flushed objects into per-object pieces, then deleted (protocol.md 4.3b) -----

    def flushed_objects(self, workers: int = 4) -> tuple[list[Batch], dict[str, str]]:
        """The flushed objects the bucket lists now (oldest first), each with its index (read
        once, then remembered: a flushed object never changes), and those that cannot be read."""
        items = list(self.store.list(LOG_PREFIX))
        out: list[Batch] = []
        bad: dict[str, str] = {}
        for item in items:
            b = self._batches.get(item.key)
            if b is None:
                try:
                    b = read_index(self.store, item.key, item.size)
                except TierNotFound:
                    continue
                except LogDamage as exc:
                    bad[item.key] = str(exc)
                    continue
                with self._lock:
                    self._batches[item.key] = b
            out.append(b)
        listed = {i.key for i in items}
        with self._lock:
            for k in [k for k in list(self._batches) if k not in listed]:  # list(): atomic
                del self._batches[k]
        return out, bad

    def flushed_count(self) -> int:
        """Flushed objects this uploader knows in the bucket (its own since the last pass)."""
        with self._lock:
            return len(self._batches)

    def compact(self, batches: list[Batch], local: dict[tuple[str, str], FlushItem]) -> CompactResult:
        """Write, from the server's own copy (*local*, captured by the caller), per-object pieces
        and seal markers for every object the *batches* name, then delete each flushed object
        whose every entry a per-object piece now holds with the same bytes (its CRC32C checked
        against the server's copy when another process wrote it). A flushed object naming an
        object this server does not hold, or whose bytes differ, is left (``left``: why)."""
        res = CompactResult(listed=len(batches))
        done: dict[tuple[str, str], str | None] = {}  # object -> why it cannot be compacted
        for b in batches:
            for key in sorted(b.objects()):
                if key not in done:
                    done[key] = self._compact_object(key, local.get(key), res)
        _crash_point("compacted")
        gone: list[str] = []
        for b in batches:
            why = next((done[k] for k in sorted(b.objects()) if done[k] is not None), None)
            why = why or self._uncovered(b, local)
            if why is None:
                gone.append(b.key)
            else:
                res.left[b.key] = why
        if gone:
            self.store.delete(gone)
            with self._lock:
                for k in gone:
                    self._batches.pop(k, None)
        _crash_point("deleted")
        res.deleted = len(gone)
        now = self._wall()
        ages = [now - b.seq / 1e6 for b in batches if b.key not in gone]
        res.oldest_age = max(0.0, max(ages, default=0.0))
        return res

    def _compact_object(self, key: tuple[str, str], it: FlushItem | None, res: CompactResult) -> str | None:
        namespace, name = key
        ns = self._namespace(namespace)
        if it is None:
            return f"{namespace}/{name} is not on this server"
        if ns.fenced:
            return f"namespace {namespace} is fenced: another server took it over"
        try:
            n = self._compact_steps(it)
        except LocalUnreadable as exc:
            return f"{namespace}/{name}: cannot read this server's copy: {exc}"
        if isinstance(n, str):
            return n
        res.pieces += n
        with self._lock:
            res.pieces_per_object.append(len(self._obj(namespace, name).tail))
        return None

    def _compact_steps(self, it: FlushItem) -> int | str:
        """Steps of one object until idle: the pieces created, or why it stopped."""
        namespace, name = it.namespace, it.name
        n = 0
        while True:
            s = self.step(namespace, name, it.read, it.durable, it.sealed, it.sealed_at_ns)
            n += s.kind in ("piece", "exists") and s.outcome is PutOutcome.CREATED
            if s.kind in ("stuck", "ahead"):
                return s.message
            if s.kind == "idle":
                return n

    def _uncovered(self, b: Batch, local: dict[tuple[str, str], FlushItem]) -> str | None:
        """Why a per-object piece does not yet hold some entry of *b* with the same bytes."""
        for e in b.entries:
            with self._lock:
                o = self._obj(e.namespace, e.name)
                up, exists = o.uploaded, o.exists
            if up < e.end or (e.end == 0 and not exists):
                return f"{e.namespace}/{e.name}: pieces hold {up} bytes, the flushed object up to {e.end}"
            if b.writer != self.writer and e.end > e.begin:
                try:
                    data = local[(e.namespace, e.name)].read(e.begin, e.end)
                except LocalUnreadable as exc:
                    return f"{e.namespace}/{e.name}: cannot read this server's copy: {exc}"
                if crc32c(data) != e.crc:
                    return f"{e.namespace}/{e.name}: [{e.begin}, {e.end}) differs from this server's bytes"
        for se in b.seals:
            with self._lock:
                seal = self._obj(se.namespace, se.name).bucket_seal
            if seal != se.length:
                return f"{se.namespace}/{se.name}: no seal marker at {se.length} yet"
        return None

    def sync(
        self,
        namespace: str,
        name: str,
        read: Reader,
        durable: int,
        sealed: bool = False,
        sealed_at_ns: int | None = None,
        *,
        max_steps: int | None = None,
    ) -> int:
        """Steps until the bucket holds *name* up to *durable* (and its seal), or a step is
        stuck/ahead, or *max_steps* were taken; returns where the bucket's run now ends."""
        n = 0
        while max_steps is None or n < max_steps:
            s = self.step(namespace, name, read, durable, sealed, sealed_at_ns)
            n += 1
            if s.kind in ("idle", "stuck", "ahead"):
                break
        return self.uploaded(namespace, name)

    def uploaded(self, namespace: str, name: str) -> int:
        """Where the bucket's run of *name* from 0 ends, as far as this uploader knows (the
        wait-for-bucket operation compares offsets with it)."""
        with self._lock:
            o = self._ns.get(namespace, _Ns()).objects.get(name)
            return o.held if o else 0

    def holds(self, namespace: str, name: str, offset: int, sealed: bool = False) -> bool:
        """Whether the bucket holds *name* as far as a TIER_WAIT for *offset* asks: its run from
        0 reaching *offset* and, when the server's object is *sealed*, its seal marker
        (protocol.md 1.11 rule 6: a generation's ``ready`` is an empty sealed object whose marker
        is what a reader of the bucket alone needs)."""
        with self._lock:
            o = self._ns.get(namespace, _Ns()).objects.get(name)
            uploaded = o.held if o else 0
            if uploaded < offset:
                return False
            return not sealed or (o is not None and o.seal_held)

    def pending(self, namespace: str) -> list[str]:
        """Names with something acknowledged and not in the bucket (and not stuck)."""
        with self._lock:
            ns = self._ns.get(namespace)
            if ns is None:
                return []
            return sorted(
                n
                for n, o in ns.objects.items()
                if not o.stuck
                and (o.held < o.durable or (o.sealed and not o.seal_held) or (o.noted and not o.exists_held))
            )

    def lag(self, namespace: str) -> Lag:
        now = self._clock()
        with self._lock:
            ns = self._ns.get(namespace) or _Ns()
            behind = 0
            oldest: float | None = None
            seals = 0
            for o in ns.objects.values():
                self._drop_marks(o)
                behind += max(0, o.durable - o.held)
                if o.sealed and not o.seal_held:
                    seals += 1
                if o.marks:
                    oldest = o.marks[0][1] if oldest is None else min(oldest, o.marks[0][1])
            return Lag(
                behind,
                0.0 if oldest is None else max(0.0, now - oldest),
                seals,
                ns.last_error,
                ns.last_error_at,
                {n: o.stuck for n, o in ns.objects.items() if o.stuck},
                ns.fenced,
                ns.uploaded_bytes,
                dict(ns.ignored_fences),
            )

    def namespaces(self) -> list[str]:
        with self._lock:
            return sorted(self._ns)

    # -- helpers -----------------------------------------------------------------------------

    def _namespace(self, namespace: str) -> _Ns:
        with self._lock:
            return self._ns.setdefault(namespace, _Ns())

    def _obj(self, namespace: str, name: str) -> _Obj:  # under self._lock
        ns = self._ns.setdefault(namespace, _Ns())
        o = ns.objects.get(name)
        if o is None:
            o = ns.objects[name] = _Obj()
        return o

    def _advance(self, ns: _Ns, o: _Obj, end: int, created: int) -> None:
        with self._lock:
            o.uploaded = max(o.uploaded, end)
            o.exists = True
            ns.uploaded_bytes += created
            self._drop_marks(o)

    def _drop_marks(self, o: _Obj) -> None:  # under self._lock
        done = o.held + (1 if o.seal_held else 0)
        while o.marks and o.marks[0][0] <= done:
            o.marks.popleft()

    def _error(self, ns: _Ns, message: str) -> None:  # under self._lock
        ns.last_error, ns.last_error_at = message, self._wall()
        log.warning("tier: %s", message)

    def _stuck(self, ns: _Ns, o: _Obj, key: str, message: str) -> Step:
        with self._lock:
            o.stuck = message
            self._error(ns, message)
        return Step("stuck", key, message=message)

    def _name_key(self, namespace: str, name: str) -> None:
        """Before the first key of a hashed (long) name, its ``name`` key."""
        key = name_key(namespace, name)
        if key is not None and self.store.put_once(key, name.encode()) is PutOutcome.CONFLICT:
            raise TierError(f"{key} holds another name (SHA-256 collision or damage)")
