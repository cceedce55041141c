"""A namespace read from the object-store tier's bucket alone (protocol.md Part 4), with no server.

Restore and verify read a namespace through a small slice of the blocking client
(``_store.StoreClient``: ``list``, ``stat``, ``read_iter``, ``close``) that a ``client_factory``
hands out. :class:`BucketSource` is that factory for a bucket: it lists the namespace's keys
once (:func:`sos_tier.layout.scan`: per object its pieces, seal and problems) and gives every
caller a :class:`BucketClient` over that one listing, so restore, its reader threads and verify
see one consistent state, and the journal's own checks (record CRCs, the generation chain,
``--batch``, ``--at``, ``--position``) run unchanged on the bytes it returns::

    with BucketSource.open("s3://bucket/prefix", "myjob") as source:
        restore(source, "myjob", "/restored", batch="checkpoint:41")
        rebuild_cache(source, "myjob", cache_dir)

How the bucket's problems reach the journal's verdicts (protocol.md 4.4):

- Objects are listed with the length the bucket says they have (the furthest piece, or the
  seal's length) and sealed when a seal marker exists. Bytes are served only below the good
  length (every piece read whole, its CRC32C checked); a read that reaches past it yields the
  bytes before, then raises :class:`BucketCorrupt` (a ``Corrupt``, as a server that finds its
  stored bytes damaged) whose message names the bucket key and the offset: a **damaged** piece
  (CRC or size), a **gap** (a piece missing in the middle), a **conflict** (two histories: a
  zombie server). Restore then applies every whole record before that point and stops, naming
  the segment, the offset and the key (exit 3, as for damage on a server); verify lists it as a
  broken range.
- Pieces outside the run (a retry's overlapping copy, a zombie's) are read when the namespace is
  listed: bytes that differ from the run's are a conflict (the good length stops there); a damaged
  one is off every read's path, so verify lists it (:meth:`BucketSource.source_problems`).
- The bucket unreachable, credentials missing, a permission refused: :class:`BucketUnavailable`
  (a JournalError: exit 1), naming the URL.

Reads are ranged GETs in parallel: each read fetches up to ``workers`` pieces ahead, each in
4 MiB parts at once (:func:`sos_tier.layout.iter_object`), so memory is bounded by ``workers``
pieces per reader thread; a few small reads (headers, the salvage of a damaged tail) are served
from a small cache of verified pieces.
"""

from __future__ import annotations

import bisect
import builtins
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NoReturn

from sos_journal.errors import JournalError
from sos_journal.store import Corrupt, SOSNotFound
from sos_tier.layout import (
    NamespaceState,
    ObjectIncomplete,
    ObjectState,
    Piece,
    Problem,
    TierConflict,
    TierDamage,
    iter_object,
    scan,
)
from sos_tier.open import open_store
from sos_tier.store import Store, TierError, TierNotFound
from sos_wire.names import BadName, validate_namespace

__all__ = [
    "DEFAULT_GET_WORKERS",
    "BucketClient",
    "BucketCorrupt",
    "BucketEntry",
    "BucketReadOnly",
    "BucketSource",
    "BucketUnavailable",
]

#: pieces fetched ahead by one read (each in parallel ranged parts)
DEFAULT_GET_WORKERS = 4
_SMALL_READ = 64 * 1024  # reads up to this size inside one piece go through the piece cache
_CACHED_PIECES = 4


class BucketUnavailable(JournalError):
    """The bucket cannot be read: unreachable, no credentials, permission refused, no such
    bucket, or the S3 library is not installed. Nothing was restored past what is said."""


class BucketReadOnly(JournalError):
    """A bucket source is read-only: the journal writer needs a server."""


class BucketCorrupt(Corrupt):
    """The bucket does not hold an object's bytes whole from ``offset`` on (damage, a gap or a
    conflict); the message names the key. ``complete_message``: readers print it as it is."""

    complete_message = True

    def __init__(self, message: str, *, name: str, offset: int, key: str = "") -> None:
        super().__init__(message, name=name)
        self.offset = offset
        self.key = key


@dataclass(frozen=True, slots=True)
class BucketEntry:
    """One object as LIST shows it (the fields the journal reads of a server's list entry)."""

    name: str
    length: int
    sealed: bool


class BucketSource:
    """The namespace *namespace* in a tier store (a :class:`sos_tier.store.Store`, or its URL
    with :meth:`open`). Calling it returns a :class:`BucketClient`: it is a ``client_factory``
    for :func:`~sos_journal.rebuild.restore.restore`, ``rebuild_cache`` and
    :func:`~sos_journal.read.verify.verify`. Thread-safe. The listing is taken once, at the
    first call that needs it; :meth:`refresh` takes it again."""

    def __init__(
        self, store: Store, namespace: str, *, workers: int = DEFAULT_GET_WORKERS, owns_store: bool = False
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be at least 1")
        self.store = store
        self.namespace = namespace
        self.workers = workers
        self.url = getattr(store, "url", repr(store))
        self._owns = owns_store
        self._lock = threading.RLock()
        self._state: NamespaceState | None = None
        self._cache: OrderedDict[tuple[str, str], bytes] = OrderedDict()

    @classmethod
    def open(cls, url: str, namespace: str, *, workers: int = DEFAULT_GET_WORKERS) -> BucketSource:
        """The source of a tier URL (``s3://BUCKET/PREFIX``: credentials, region and endpoint
        from boto3's standard chain and ``AWS_ENDPOINT_URL``; ``file:///PATH``). ValueError for
        a URL that is none of these; BucketUnavailable when the store cannot be set up."""
        try:
            validate_namespace(namespace)
        except BadName as exc:
            raise ValueError(str(exc)) from None
        try:
            store = open_store(url)
        except ImportError as exc:
            raise BucketUnavailable(
                f"cannot read {url}: the s3:// tier needs boto3 (pip install 'sos[tier]'): {exc}"
            ) from exc
        except TierError as exc:
            raise BucketUnavailable(f"cannot read {url}: {exc}") from exc
        return cls(store, namespace, workers=workers, owns_store=True)

    def __call__(self) -> BucketClient:
        return BucketClient(self)

    client = __call__

    def __enter__(self) -> BucketSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns:
            self.store.close()

    def __repr__(self) -> str:
        return f"BucketSource({self.url!r}, {self.namespace!r})"

    # -- the listing ---------------------------------------------------------------------------

    def state(self) -> NamespaceState:
        """The namespace as the bucket's listing shows it (taken once)."""
        with self._lock:
            if self._state is None:
                self._state = self._scan()
            return self._state

    def refresh(self) -> None:
        with self._lock:
            self._state = None
            self._cache.clear()

    def _scan(self) -> NamespaceState:
        try:
            found = scan(self.store, self.namespace)
        except TierError as exc:
            raise BucketUnavailable(f"cannot read the bucket {self.url}: {exc}") from exc
        st = found.get(self.namespace) or NamespaceState(self.namespace)
        for obj in st.objects.values():
            if any(q.begin != q.end for q in obj.extra):
                self._check_extras(obj)
        return st

    def object(self, name: str) -> ObjectState:
        obj = self.state().objects.get(name)
        if obj is None or not obj.exists:
            raise SOSNotFound(f"{name}: not in the bucket {self.url}", name=name)
        return obj

    @staticmethod
    def listed_length(obj: ObjectState) -> int:
        """What the bucket says the object's length is: its seal's, else where its furthest
        piece ends. The bytes from the good length on are not served (BucketCorrupt)."""
        if obj.seal_length is not None:
            return obj.seal_length
        return max((p.end for p in (*obj.pieces, *obj.extra)), default=0)

    def entries(self, prefix: str = "") -> list[BucketEntry]:
        st = self.state()
        return [
            BucketEntry(name, self.listed_length(o), o.seal_length is not None)
            for name, o in sorted(st.objects.items())
            if name.startswith(prefix) and o.exists
        ]

    # -- reading -------------------------------------------------------------------------------

    def good_length(self, obj: ObjectState) -> int:
        with self._lock:
            return obj.length

    def why_short(self, obj: ObjectState, offset: int) -> BucketCorrupt:
        """The error for a read of *obj* from *offset*, past its good length."""
        with self._lock:
            good = obj.length
            problems = [p for p in obj.problems if p.kind != "foreign"]
        where = f"{self.url}: {obj.name} is held whole up to byte {good} only"
        if problems:
            first = min(problems, key=lambda p: p.offset)
            why = "; ".join(f"{p.kind}: {p.message}" for p in problems)
            return BucketCorrupt(f"{where}, not from {offset} ({why})", name=obj.name, offset=good, key=first.key)
        return BucketCorrupt(f"{where}, not from {offset}", name=obj.name, offset=good)

    def _cut(self, obj: ObjectState, exc: Exception) -> BucketCorrupt:
        """Reading found damage or a conflict the listing could not show: the good length
        stops there (for every later read too) and the problem is kept."""
        with self._lock:
            if isinstance(exc, TierDamage):
                bad = next((p for p in obj.pieces if p.key == exc.key), None)
                at = bad.begin if bad is not None else obj.length
                kind, key = "damage", exc.key
            else:
                assert isinstance(exc, TierConflict)
                at, kind, key = exc.offset, "conflict", exc.key
            if not any(p.key == key and p.kind == kind for p in obj.problems):
                obj.problems.append(
                    Problem(kind, obj.namespace, obj.name, key, at, f"{obj.namespace}/{obj.name}: {exc}")
                )
            obj.length = min(obj.length, at)
            self._cache.clear()
        return self.why_short(obj, at)

    def _piece(self, obj: ObjectState, p: Piece) -> bytes:
        """The verified bytes of a run piece below the good length, through the small cache."""
        k = (obj.name, p.key)
        with self._lock:
            data = self._cache.get(k)
            if data is not None:
                self._cache.move_to_end(k)
                return data
        end = min(p.end, self.good_length(obj))
        data = b"".join(iter_object(self.store, obj, p.begin, end, workers=self.workers))
        with self._lock:
            self._cache[k] = data
            while len(self._cache) > _CACHED_PIECES:
                self._cache.popitem(last=False)
        return data

    def read(self, obj: ObjectState, start: int, stop: int) -> Iterator[bytes]:
        """Verified bytes [start, stop) of *obj* (stop <= its good length) in chunks. Raises
        BucketCorrupt (damage or a conflict found while reading; the chunks before it are
        good) or BucketUnavailable."""
        try:
            if stop - start <= _SMALL_READ:
                run = obj.pieces  # begins and ends both increase: a binary search
                i = bisect.bisect_right(run, start, key=lambda q: q.end)
                p = run[i] if i < len(run) and run[i].begin <= start and stop <= run[i].end else None
                if p is not None:
                    data = self._piece(obj, p)
                    if stop - p.begin <= len(data):
                        yield data[start - p.begin : stop - p.begin]
                        return
            yield from iter_object(self.store, obj, start, stop, workers=self.workers)
        except (TierDamage, TierConflict) as exc:
            raise self._cut(obj, exc) from exc
        except ObjectIncomplete as exc:  # another reader cut the good length meanwhile
            raise self.why_short(obj, min(exc.length, stop)) from exc
        except TierError as exc:
            raise BucketUnavailable(f"cannot read {obj.name} from the bucket {self.url}: {exc}") from exc

    # -- what only a bucket can show -----------------------------------------------------------

    def source_notes(self) -> list[str]:
        """Keys of the namespace the layout did not make, or whose object cannot be named."""
        return [p.message for p in self.state().problems]

    def source_problems(self, prefix: str = "") -> list[tuple[str, int, str]]:
        """(object name, offset, message) for what reading the objects cannot show: a damaged
        piece outside the run (a retry's overlapping copy, another server's), which no read
        returns bytes of. (A piece outside the run whose bytes differ from the run's cuts the
        object's good length at the scan: reading reports it.)"""
        with self._lock:
            st = self.state()
            return [
                (name, p.offset, f"{self.url}: {p.message}")
                for name, o in sorted(st.objects.items())
                if name.startswith(prefix)
                for p in self._off_the_read_path(o)
            ]

    @staticmethod
    def _off_the_read_path(obj: ObjectState) -> list[Problem]:
        """The damaged pieces no read will name: outside the run (a retry's copy, another
        server's), or left out by the listing (a size that lies, over what a writer makes) below
        the good length, where the run's other pieces hold the bytes."""
        extra = {q.key for q in obj.extra}
        run = {q.key for q in obj.pieces}
        return [
            p
            for p in obj.problems
            if p.kind == "damage" and (p.key in extra or (p.offset < obj.length and p.key not in run))
        ]

    def _check_extras(self, obj: ObjectState) -> None:
        """Pieces outside the run (protocol.md 4.4 step 5): each read whole and checked against
        its CRC (damage: a problem, not on the read path), and the bytes it shares with the run
        compared with the run's (a difference: a conflict; the good length stops there)."""
        for q in obj.extra:
            if q.begin == q.end:
                continue
            alone = ObjectState(obj.namespace, obj.name, obj.edir, length=q.end, pieces=[q])
            try:
                theirs = b"".join(iter_object(self.store, alone, q.begin, q.end, workers=self.workers))
            except TierDamage as exc:
                obj._problem("damage", q.key, q.begin, str(exc))
                continue
            except (TierNotFound, ObjectIncomplete):
                continue  # deleted since the listing: a larger piece of the run holds its bytes
            hi = min(q.end, obj.length)
            if q.begin >= hi:
                continue
            try:
                ours = b"".join(self.read(obj, q.begin, hi))
            except BucketCorrupt:
                continue  # the run's own problem, kept by read()
            if ours != theirs[: hi - q.begin]:
                at = q.begin + next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
                obj._problem(
                    "conflict",
                    q.key,
                    at,
                    f"piece {q.key} differs from the run at byte {at} (two "
                    f"histories: another server wrote it, or damage that kept "
                    f"its CRC)",
                )
                obj.length = min(obj.length, at)


class BucketClient:
    """What restore and verify call on a server's client, answered from a :class:`BucketSource`
    (read-only: the writing calls raise BucketReadOnly)."""

    source_kind = "bucket"

    def __init__(self, source: BucketSource) -> None:
        self.source = source
        self.closed = False

    def __enter__(self) -> BucketClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.closed = True

    def list(self, prefix: str = "") -> Iterator[BucketEntry]:
        return iter(self.source.entries(prefix))

    def stat(self, name: str) -> tuple[int, bool]:
        obj = self.source.object(name)
        return self.source.listed_length(obj), obj.seal_length is not None

    def read_iter(self, name: str, offset: int = 0, length: int = 0) -> Iterator[bytes]:
        """Bytes [offset, offset + length) (length 0: to the end) as a server's READ streams
        them; past the good length: the bytes before, then BucketCorrupt."""
        obj = self.source.object(name)
        end = self.source.listed_length(obj)
        if length:
            end = min(end, offset + length)
        if offset >= end:
            return
        stop = min(end, self.source.good_length(obj))
        pos = offset
        if pos < stop:
            for chunk in self.source.read(obj, pos, stop):
                pos += len(chunk)
                yield chunk
        if pos < end:
            raise self.source.why_short(obj, pos)

    def read(self, name: str, offset: int = 0, length: int = 0) -> bytes:
        return b"".join(self.read_iter(name, offset, length))

    def source_problems(self, prefix: str = "") -> builtins.list[tuple[str, int, str]]:
        return self.source.source_problems(prefix)

    def source_notes(self) -> builtins.list[str]:
        return self.source.source_notes()

    def _read_only(self) -> NoReturn:
        raise BucketReadOnly(f"{self.source.url} is read from the bucket alone: writing needs a server")

    def append(self, name: str, offset: int, data: bytes, *, epoch: int = 0) -> int:
        return self._read_only()

    def append_many(self, name: str, offset: int, chunks: Iterable[bytes], *, epoch: int = 0) -> int:
        return self._read_only()

    def seal(self, name: str, *, epoch: int = 0) -> int:
        return self._read_only()

    def fence(self, epoch: int) -> int:
        return self._read_only()
