"""The tier's layout in a store (protocol.md Part 4): key names, the listing scan, the reader.

Nothing here knows the server: a store's listing (and, for names too long for a key, one small
key per object) is all a reader needs to rebuild every namespace. Keys are relative to the
store's root (the ``prefix`` of ``s3://bucket/prefix``)::

    v1/ns/<ns>/fence/<epoch 16 hex>                          {"epoch":E,"namespace":NS}; the highest
                                                             believable one is the fence
    v1/ns/<ns>/o/<E>/<begin 16 hex>-<end 16 hex>-<crc 8 hex> the object's bytes [begin, end)
    v1/ns/<ns>/o/<E>/seal-<length 16 hex>                    the object is sealed at length
    v1/ns/<ns>/o/!<sha256 hex>/name                          (long names only) the name, UTF-8

``E`` is the object name with every ``/`` replaced by ``!`` (:func:`escape_name`), or, when
that is over :data:`MAX_PLAIN_NAME` bytes, ``!`` and the SHA-256 of the name in hex.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import re
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from sos_tier.log import LOG_PREFIX, Batch, LogDamage, read_index
from sos_tier.store import Store, StoredKey, TierError, TierNotFound
from sos_wire.crc import crc32c
from sos_wire.names import MAX_NAME_BYTES, BadName, validate_name, validate_namespace

__all__ = [
    "FENCE_SLACK",
    "LAYOUT_VERSION",
    "MAX_FENCE_EPOCH",
    "MAX_MARKER_BYTES",
    "MAX_PIECE_BYTES",
    "MAX_PLAIN_NAME",
    "NOTICE_PREFIX",
    "FenceVerdict",
    "NamespaceState",
    "ObjectIncomplete",
    "ObjectState",
    "ParsedKey",
    "Piece",
    "Problem",
    "TierConflict",
    "TierDamage",
    "TierPieceTooLarge",
    "believe_fence",
    "delete_object",
    "escape_name",
    "fence_content",
    "fence_key",
    "iter_object",
    "keys_of",
    "name_key",
    "namespace_prefix",
    "notice_key",
    "object_prefix",
    "parse_key",
    "piece_key",
    "read_object",
    "scan",
    "scan_object",
    "seal_content",
    "seal_key",
    "seal_time",
    "take_run",
    "unescape_name",
]

LAYOUT_VERSION = "v1"
#: Longest escaped name kept readable in a key; longer ones are hashed. With a store prefix of
#: at most 256 bytes, a namespace of at most 63 and the longest last segment (42), every key fits
#: S3's 1024 bytes: 256 + 1 + len("v1/ns/") + 63 + len("/o/") + 640 + 1 + 42 = 1012.
MAX_PLAIN_NAME = 640
HASHED = "!"  # an escaped name never starts with it (a name never starts with '/')
#: The largest piece a writer makes (protocol.md 4.2): readers refuse a piece whose name claims
#: more (damage, never read), so no key of the bucket, whatever it claims, costs a reader more
#: memory than this (times the pieces it reads ahead).
MAX_PIECE_BYTES = 8 * 1024 * 1024
#: Seal markers and fence markers are small JSON objects; a reader reads at most this much of one.
MAX_MARKER_BYTES = 4096
#: A fence marker is believed only up to this far above the highest epoch the reader knows from
#: elsewhere (its own fence, the epochs in journal segment names): a marker far beyond is bogus.
#: A FENCE moves a fence by at most 1000 (protocol.md 1.11): this is a thousand of them.
FENCE_SLACK = 1_000_000
#: No FENCE sets an epoch above this (protocol.md 1.11, segment names carry 10 digits): a marker
#: above it is bogus whatever else is known.
MAX_FENCE_EPOCH = 9_999_999_999
#: Of the fence markers that might be the fence, at most this many are read (highest first).
MAX_FENCE_READS = 64

_HEX16 = "[0-9a-f]{16}"
_PIECE = re.compile(rf"({_HEX16})-({_HEX16})-([0-9a-f]{{8}})")
_SEAL = re.compile(rf"seal-({_HEX16})")
_FENCE = re.compile(_HEX16)
_HASH = re.compile(r"!([0-9a-f]{64})")


class TierDamage(TierError):
    """A piece's content fails its checksum (or its size its name): the bytes are damaged."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"damaged piece {key}: {message}")
        self.key = key


class TierPieceTooLarge(TierDamage):
    """A piece's name claims more bytes than a writer ever puts in one (MAX_PIECE_BYTES,
    protocol.md 4.2): refused unread, whatever the key holds."""

    def __init__(self, key: str, size: int) -> None:
        super().__init__(key, f"claims {size} bytes, over the {MAX_PIECE_BYTES} a writer ever makes; not read")
        self.size = size


class TierConflict(TierError):
    """Two pieces disagree about the same bytes (a zombie writer, or damage that kept its CRC)."""

    def __init__(self, key: str, message: str, offset: int = 0) -> None:
        super().__init__(f"conflicting piece {key}: {message}")
        self.key = key
        self.offset = offset  # the object's first byte on which they differ


class ObjectIncomplete(TierError):
    """A read asked for bytes the bucket does not hold whole (past a gap, damage or a conflict)."""

    def __init__(self, namespace: str, name: str, length: int, start: int, problems: list[Problem]) -> None:
        why = "; ".join(p.message for p in problems) or "no more bytes"
        super().__init__(f"{namespace}/{name}: the bucket holds bytes up to {length} only, asked from {start} ({why})")
        self.length = length
        self.problems = problems


# ---------------------------------------------------------------------------------------------
# names


def escape_name(name: str) -> str:
    """The key segment of an object name (protocol.md 4.2): ``/`` becomes ``!``, which no name
    contains, so the mapping is reversible; a name whose escaped form is over MAX_PLAIN_NAME
    bytes becomes ``!`` + SHA-256(name) in hex (its ``name`` key holds the name)."""
    validate_name(name)
    e = name.replace("/", "!")
    if len(e) > MAX_PLAIN_NAME:  # names are ASCII (protocol.md 1.10): characters are bytes
        return HASHED + hashlib.sha256(name.encode()).hexdigest()
    return e


def unescape_name(e: str) -> str:
    """The name an escaped segment stands for; ValueError for a hashed one (read its ``name``
    key) or for anything :func:`escape_name` cannot have made."""
    if e.startswith(HASHED):
        raise ValueError(f"{e!r} is a hashed name: its name key holds the name")
    name = e.replace("!", "/")
    try:
        if escape_name(name) != e:
            raise ValueError(f"{e!r} is not an escaped object name")
    except BadName as exc:
        raise ValueError(f"{e!r} is not an escaped object name: {exc}") from None
    return name


def namespace_prefix(namespace: str) -> str:
    return f"{LAYOUT_VERSION}/ns/{validate_namespace(namespace)}/"


def object_prefix(namespace: str, name: str) -> str:
    return f"{namespace_prefix(namespace)}o/{escape_name(name)}/"


def piece_key(namespace: str, name: str, begin: int, end: int, crc: int) -> str:
    if not 0 <= begin <= end < 2**64 or (begin == end and begin != 0) or not 0 <= crc < 2**32:
        raise ValueError(f"bad piece [{begin}, {end}) crc {crc:#x}")
    return f"{object_prefix(namespace, name)}{begin:016x}-{end:016x}-{crc:08x}"


def seal_key(namespace: str, name: str, length: int) -> str:
    return f"{object_prefix(namespace, name)}seal-{length:016x}"


def seal_content(sealed_at_ns: int | None) -> bytes:
    """The content of a seal marker: a JSON object; ``sealed_at_ns`` is when the server sealed
    the object by its clock (retention ages generations by it), absent if unknown. Must be the
    same bytes on every retry of one seal (the caller passes a time it stored durably)."""
    return json.dumps(
        {} if sealed_at_ns is None else {"sealed_at_ns": sealed_at_ns}, separators=(",", ":"), sort_keys=True
    ).encode()


def name_key(namespace: str, name: str) -> str | None:
    """The ``name`` key of a hashed object, None when the name is kept in its keys."""
    e = escape_name(name)
    return f"{namespace_prefix(namespace)}o/{e}/name" if e.startswith(HASHED) else None


def fence_key(namespace: str, epoch: int) -> str:
    if not 0 <= epoch < 2**64:
        raise ValueError(f"bad epoch {epoch}")
    return f"{namespace_prefix(namespace)}fence/{epoch:016x}"


#: copies of the fence markers, every namespace under one prefix (protocol.md 4.3a): one
#: listing per flush tells a server of every namespace another server took over
NOTICE_PREFIX = f"{LAYOUT_VERSION}/fence/"


def notice_key(namespace: str, epoch: int) -> str:
    if not 0 <= epoch < 2**64:
        raise ValueError(f"bad epoch {epoch}")
    return f"{NOTICE_PREFIX}{validate_namespace(namespace)}/{epoch:016x}"


def fence_content(namespace: str, epoch: int) -> bytes:
    """The content of a fence marker (protocol.md 4.2): the JSON object naming its namespace and
    epoch, ``{"epoch":E,"namespace":"NS"}``, compact, keys sorted. A reader believes a marker
    only if its content is exactly this (an empty or other marker is not one a writer made)."""
    return json.dumps({"epoch": epoch, "namespace": namespace}, separators=(",", ":"), sort_keys=True).encode()


@dataclass(frozen=True, slots=True)
class FenceVerdict:
    """The fence a reader believes from a namespace's markers, and the markers it ignored."""

    epoch: int  # the highest believable marker (0: none)
    key: str | None
    ignored: list[Problem]


def believe_fence(
    store: Store, namespace: str, markers: list[tuple[int, str, int]], known: int | None = None
) -> FenceVerdict:
    """Of the fence markers *markers* (epoch, key, listed size), the highest a reader can believe
    (protocol.md 4.4): its listed size and its content (at most MAX_MARKER_BYTES read) exactly
    :func:`fence_content`, and, when *known* (the highest epoch the reader knows from elsewhere)
    is given, at most FENCE_SLACK above it. Markers above the one believed that fail are
    returned as ``fence`` problems (to log and count, never to obey); those below are not read.
    At most MAX_FENCE_READS markers are read."""
    ignored: list[Problem] = []
    reads = 0

    def bogus(key: str, epoch: int, why: str) -> None:
        ignored.append(Problem("fence", namespace, "", key, epoch, f"{key}: {why}; ignored (not obeyed)"))

    for epoch, key, size in sorted(markers, reverse=True):
        want = fence_content(namespace, epoch)
        if epoch > MAX_FENCE_EPOCH:
            bogus(key, epoch, f"fence marker {epoch} is above {MAX_FENCE_EPOCH}, the highest epoch a FENCE sets")
            continue
        if known is not None and epoch > known + FENCE_SLACK:
            bogus(key, epoch, f"fence marker {epoch} is far beyond every epoch known ({known})")
            continue
        if size != len(want):
            bogus(key, epoch, f"fence marker of {size} bytes, not the {len(want)} its writer makes")
            continue
        if reads >= MAX_FENCE_READS:
            bogus(key, epoch, f"not read: over {MAX_FENCE_READS} fence markers to check")
            continue
        reads += 1
        try:
            got = store.get(key, 0, MAX_MARKER_BYTES)
        except TierNotFound:
            continue  # deleted meanwhile
        if got != want:
            bogus(key, epoch, "fence marker content is not the namespace and epoch its writer writes")
            continue
        return FenceVerdict(epoch, key, ignored)
    return FenceVerdict(0, None, ignored)


@dataclass(frozen=True, slots=True)
class ParsedKey:
    kind: str  # "piece", "seal", "name", "fence"
    namespace: str
    edir: str = ""  # the escaped object name (pieces, seals, name keys)
    begin: int = 0
    end: int = 0
    crc: int = 0
    length: int = 0  # seal
    epoch: int = 0  # fence


@functools.lru_cache(maxsize=4096)
def _edir_ok(edir: str) -> bool:
    """Whether *edir* is an escaped or hashed object name (cached: an object's keys share it)."""
    if _HASH.fullmatch(edir):
        return True
    try:
        unescape_name(edir)
    except ValueError:
        return False
    return True


def parse_key(key: str) -> ParsedKey | None:
    """What a key of the layout is, or None for a key the layout cannot have made."""
    parts = key.split("/")
    if len(parts) < 5 or parts[0] != LAYOUT_VERSION or parts[1] != "ns":
        return None
    ns = parts[2]
    try:
        validate_namespace(ns)
    except BadName:
        return None
    if len(parts) == 5 and parts[3] == "fence" and _FENCE.fullmatch(parts[4]):
        return ParsedKey("fence", ns, epoch=int(parts[4], 16))
    if len(parts) != 6 or parts[3] != "o":
        return None
    edir, last = parts[4], parts[5]
    if not _edir_ok(edir):
        return None
    if m := _PIECE.fullmatch(last):
        begin, end, crc = int(m[1], 16), int(m[2], 16), int(m[3], 16)
        if begin > end or (begin == end and (begin != 0 or crc != 0)):
            return None
        return ParsedKey("piece", ns, edir, begin=begin, end=end, crc=crc)
    if m := _SEAL.fullmatch(last):
        return ParsedKey("seal", ns, edir, length=int(m[1], 16))
    if last == "name" and edir.startswith(HASHED):
        return ParsedKey("name", ns, edir)
    return None


# ---------------------------------------------------------------------------------------------
# the scan


@dataclass(frozen=True, slots=True)
class Piece:
    key: str
    begin: int
    end: int
    crc: int
    size: int  # as listed
    #: -1: the key is the piece; else the piece is bytes [at, at + size) of the flushed object
    #: ``key`` (protocol.md 4.2a), named by its index
    at: int = -1

    @property
    def flushed(self) -> bool:
        return self.at >= 0


@dataclass(frozen=True, slots=True)
class Problem:
    """Something a reader reports. kind: ``gap`` (the run of pieces from 0 stops before later
    pieces or before its seal), ``damage`` (a piece's content fails its checksum or its size its
    name; ``key`` names it), ``conflict`` (pieces or seals that disagree; ``key`` names one),
    ``foreign`` (a key the layout cannot have made; ignored), ``fence`` (a fence marker that is not
    believable: empty, other content, far beyond the epochs known; ignored, ``offset`` is its
    epoch)."""

    kind: str
    namespace: str
    name: str  # the object's name ("" for namespace-level problems; the escaped dir if unknown)
    key: str
    offset: int
    message: str


@dataclass(slots=True)
class ObjectState:
    namespace: str
    name: str
    edir: str
    length: int = 0  # the good length: bytes [0, length) are held whole, in `pieces`
    run_end: int = 0  # where the run of pieces from 0 ends before cuts for conflicts/damage
    seal_length: int | None = None  # the (smallest) seal marker's length, None if unsealed
    seal_keys: list[str] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)  # the run from 0, in order (may overlap)
    extra: list[Piece] = field(default_factory=list)  # listed pieces not in the run
    problems: list[Problem] = field(default_factory=list)
    exists: bool = False  # any piece or seal (a 0-0 piece alone says "exists, empty")
    #: the seal's time from a flushed object's seal entry (no seal marker key yet)
    log_sealed_at_ns: int | None = None

    @property
    def sealed(self) -> bool:
        """Sealed, and the bucket holds every byte up to the seal."""
        return self.seal_length is not None and self.length == self.seal_length

    def _problem(self, kind: str, key: str, offset: int, message: str) -> None:
        self.problems.append(
            Problem(kind, self.namespace, self.name, key, offset, f"{self.namespace}/{self.name}: {message}")
        )


@dataclass(slots=True)
class NamespaceState:
    namespace: str
    fence: int = 0  # the highest believable fence marker (0: none); see believe_fence
    #: every fence marker listed: (epoch, key, size), whatever its content
    fence_markers: list[tuple[int, str, int]] = field(default_factory=list)
    objects: dict[str, ObjectState] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)  # namespace-level (foreign keys, names)

    def all_problems(self) -> list[Problem]:
        return [*self.problems, *(p for o in self.objects.values() for p in o.problems)]


def scan(
    store: Store,
    namespace: str | None = None,
    *,
    verify: bool = False,
    workers: int = 4,
    cache: dict[str, Batch] | None = None,
) -> dict[str, NamespaceState]:
    """Rebuild, from the store's listing alone, every namespace (or one): per object its good
    length, seal, the pieces to read and the problems found (protocol.md 4.4). The listing
    says nothing about content: with *verify* every piece is read and checked against its CRC,
    and every piece that overlaps the run against the run's bytes (damage cuts the good length
    at the damaged piece, a conflict at the first byte that differs). The flushed objects
    (``v1/log/``, 4.2a) are listed too and their indexes read: their entries are pieces of
    their objects like any other (*cache*: indexes already read, by key; filled as read)."""
    prefix = namespace_prefix(namespace) if namespace is not None else f"{LAYOUT_VERSION}/ns/"
    out: dict[str, NamespaceState] = {}
    by_dir: dict[tuple[str, str], list[tuple[ParsedKey, StoredKey]]] = {}
    # the flushed objects BEFORE the pieces (4.4): compaction writes a piece, then deletes
    # the flushed objects it holds, so what a flushed object listed here held is in it or
    # in a piece the later listing finds; the other order can miss both (seen: an object
    # read back empty while compaction ran)
    logged = read_log(store, namespace, workers=workers, cache=cache)
    for item in store.list(prefix):
        pk = parse_key(item.key)
        if pk is None:
            ns = item.key.split("/")[2] if item.key.count("/") >= 3 else ""
            st = out.setdefault(ns, NamespaceState(ns))
            st.problems.append(Problem("foreign", ns, "", item.key, 0, f"{item.key}: not a key of the layout; ignored"))
            continue
        st = out.setdefault(pk.namespace, NamespaceState(pk.namespace))
        if pk.kind == "fence":
            st.fence_markers.append((pk.epoch, item.key, item.size))
        else:
            by_dir.setdefault((pk.namespace, pk.edir), []).append((pk, item))
    for ns, _edir in logged.objects:
        out.setdefault(ns, NamespaceState(ns))
    if logged.problems:
        targets = [out[namespace]] if namespace is not None and namespace in out else list(out.values())
        if namespace is not None and not targets:
            targets = [out.setdefault(namespace, NamespaceState(namespace))]
        for st in targets:
            st.problems.extend(logged.problems)
    for st in out.values():
        if st.fence_markers:
            verdict = believe_fence(store, st.namespace, st.fence_markers)
            st.fence = verdict.epoch
            st.problems.extend(verdict.ignored)
    for ns, edir in sorted(set(by_dir) | set(logged.objects)):
        st = out[ns]
        keys = by_dir.get((ns, edir), [])
        name = logged.names.get((ns, edir)) or _object_name(store, ns, edir, keys, st)
        if name is None:
            continue
        obj = _build(ns, name, edir, keys, logged.objects.get((ns, edir)))
        if verify:
            _verify(store, obj, workers)
        st.objects[name] = obj
    return out


def scan_object(store: Store, namespace: str, name: str, *, verify: bool = False, workers: int = 4) -> ObjectState:
    """:func:`scan` of one object (one listing of its prefix, and of the flushed objects); an
    object the store does not hold comes back with ``exists`` False and length 0."""
    keys = []
    edir = escape_name(name)
    logged = read_log(store, namespace, name, workers=workers)  # before the pieces, as scan()
    for item in store.list(object_prefix(namespace, name)):
        pk = parse_key(item.key)
        if pk is not None and pk.kind != "name":
            keys.append((pk, item))
    obj = _build(namespace, name, edir, keys, logged.objects.get((namespace, edir)))
    obj.problems.extend(logged.problems)
    if verify:
        _verify(store, obj, workers)
    return obj


@dataclass(slots=True)
class LogObject:
    """What the flushed objects hold of one object: pieces inside them and seal entries."""

    pieces: list[Piece] = field(default_factory=list)
    seals: list[tuple[int, str, int | None]] = field(default_factory=list)  # (length, batch key, sealed_at_ns)


@dataclass(slots=True)
class LogState:
    objects: dict[tuple[str, str], LogObject] = field(default_factory=dict)  # (ns, edir)
    names: dict[tuple[str, str], str] = field(default_factory=dict)  # (ns, edir) -> name
    problems: list[Problem] = field(default_factory=list)
    batches: int = 0


def read_log(
    store: Store,
    namespace: str | None = None,
    name: str | None = None,
    *,
    workers: int = 4,
    cache: dict[str, Batch] | None = None,
) -> LogState:
    """List ``v1/log/`` and read every flushed object's index (at most *workers* at once,
    each at most HEAD + MAX_INDEX_BYTES): their entries, as pieces, for *namespace* (or all)
    and *name* (or all). A flushed object whose index cannot be read is reported (damage, by
    its key) and left out; one gone since the listing (compacted) is skipped: a caller lists
    the pieces after this, and compaction deleted it only once its bytes were in one."""
    out = LogState()
    items = []
    for item in store.list(LOG_PREFIX):
        if item.key.count("/") != 2 or not _LOG_KEY.fullmatch(item.key[len(LOG_PREFIX) :]):
            out.problems.append(
                Problem("foreign", "", "", item.key, 0, f"{item.key}: not a key of the layout; ignored")
            )
            continue
        items.append(item)
    out.batches = len(items)

    def one(item: StoredKey) -> object:
        if cache is not None and item.key in cache:
            return cache[item.key]  # a flushed object never changes
        try:
            got = read_index(store, item.key, item.size)
            if cache is not None:
                cache[item.key] = got
            return got
        except TierNotFound:
            return None
        except LogDamage as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tier-index") as pool:
        for item, got in zip(items, pool.map(one, items)):
            if isinstance(got, LogDamage):
                out.problems.append(Problem("damage", "", "", item.key, 0, str(got)))
                continue
            if got is None:
                continue
            for e in got.entries:  # type: ignore[attr-defined]
                if (namespace is None or e.namespace == namespace) and (name is None or e.name == name):
                    lo = _log_object(out, e.namespace, e.name)
                    lo.pieces.append(Piece(item.key, e.begin, e.end, e.crc, e.end - e.begin, e.at))
            for se in got.seals:  # type: ignore[attr-defined]
                if (namespace is None or se.namespace == namespace) and (name is None or se.name == name):
                    _log_object(out, se.namespace, se.name).seals.append((se.length, item.key, se.sealed_at_ns))
    return out


_LOG_KEY = re.compile(r"[0-9a-f]{16}-[0-9a-f]{16}")


def _log_object(out: LogState, ns: str, name: str) -> LogObject:
    edir = escape_name(name)
    out.names[(ns, edir)] = name
    lo = out.objects.get((ns, edir))
    if lo is None:
        lo = out.objects[(ns, edir)] = LogObject()
    return lo


def _object_name(
    store: Store, ns: str, edir: str, keys: list[tuple[ParsedKey, StoredKey]], st: NamespaceState
) -> str | None:
    if not edir.startswith(HASHED):
        return unescape_name(edir)
    key = f"{namespace_prefix(ns)}o/{edir}/name"
    try:
        raw = store.get(key, 0, MAX_NAME_BYTES + 1)  # a name is at most 1024 bytes: read no more
        name = raw.decode()
        validate_name(name)
        if escape_name(name) != edir:
            raise ValueError("its hash does not match")
    except TierNotFound:
        st.problems.append(Problem("damage", ns, edir, key, 0, f"{ns}/{edir}: no name key; its pieces are unreadable"))
        return None
    except (UnicodeDecodeError, BadName, ValueError) as exc:
        st.problems.append(Problem("damage", ns, edir, key, 0, f"{key}: not this object's name ({exc})"))
        return None
    return name


def _same_range_conflicts(obj: ObjectState, pieces: list[Piece]) -> None:
    """Same range, other checksum: two histories, whichever is right (no read needed to know).
    One checksum is the same bytes twice (a flushed object's entry and the piece compaction
    wrote of it, before the flushed object is deleted): the run takes one, no problem."""
    same_range: dict[tuple[int, int], list[Piece]] = {}
    for p in pieces:
        same_range.setdefault((p.begin, p.end), []).append(p)
    for (begin, _end), group in sorted(same_range.items()):
        if len({p.crc for p in group}) > 1:
            obj._problem(
                "conflict",
                group[1].key,
                begin,
                "pieces " + " and ".join(p.key for p in group) + " hold the same range with different checksums",
            )
            obj.length = min(obj.length, begin)


def _build(
    ns: str, name: str, edir: str, keys: list[tuple[ParsedKey, StoredKey]], logged: LogObject | None = None
) -> ObjectState:
    obj = ObjectState(ns, name, edir)
    pieces: list[Piece] = list(logged.pieces) if logged else []
    seals: list[tuple[int, str]] = [(length, key) for length, key, _ in logged.seals] if logged else []
    if logged is not None and (logged.pieces or logged.seals):
        obj.exists = True
        times = [t for _, _, t in sorted(logged.seals) if t is not None]
        obj.log_sealed_at_ns = times[0] if times else None
    for pk, item in keys:
        if pk.kind == "piece":
            obj.exists = True
            if pk.end - pk.begin > MAX_PIECE_BYTES:
                obj._problem(
                    "damage",
                    item.key,
                    pk.begin,
                    f"piece {item.key} claims {pk.end - pk.begin} bytes, over the {MAX_PIECE_BYTES} a writer"
                    " ever makes; not read",
                )
                continue
            if item.size != pk.end - pk.begin:
                obj._problem(
                    "damage",
                    item.key,
                    pk.begin,
                    f"piece {item.key} holds {item.size} bytes, its name says {pk.end - pk.begin}",
                )
                continue
            pieces.append(Piece(item.key, pk.begin, pk.end, pk.crc, item.size))
        elif pk.kind == "seal":
            obj.exists = True
            seals.append((pk.length, item.key))
    chosen, pos = _take_run(pieces)
    in_run = {p.key for p in chosen}
    obj.pieces = chosen
    obj.extra = [p for p in pieces if p.key not in in_run]  # also a 0-0 piece ("exists, empty")
    obj.run_end = obj.length = pos
    later = [p for p in pieces if p.begin > pos]
    if later:
        obj._problem(
            "gap",
            later[0].key,
            pos,
            f"no piece holds byte {pos}; the next piece starts at {later[0].begin} ({later[0].key})",
        )
    _same_range_conflicts(obj, pieces)
    if seals:
        seals.sort()
        obj.seal_length, first = seals[0]
        obj.seal_keys = [k for _, k in seals if not k.startswith(LOG_PREFIX)]  # marker keys only
        if len({s for s, _ in seals}) > 1:
            obj._problem(
                "conflict",
                seals[-1][1],
                seals[0][0],
                "sealed at different lengths: " + ", ".join(str(s) for s, _ in seals),
            )
        if obj.run_end > obj.seal_length:
            obj._problem(
                "conflict", first, obj.seal_length, f"pieces reach {obj.run_end}, past its seal at {obj.seal_length}"
            )
            obj.length = min(obj.length, obj.seal_length)
        elif obj.length < obj.seal_length and not later:
            obj._problem("gap", first, obj.length, f"sealed at {obj.seal_length} but the pieces end at {obj.length}")
    return obj


def _take_run(pieces: list[Piece]) -> tuple[list[Piece], int]:
    """The run from 0 (protocol.md 4.4 step 2) of *pieces* (sorted here) and where it ends."""
    # the run from 0: at each point take, of the pieces that start at or before it and reach
    # past it, the one that extends furthest (ties: the first key); protocol.md 4.4
    # Linear after the sort: every piece is looked at once. The pieces that start at or before
    # pos are considered once, when pos passes their begin; the one taken reaches furthest of
    # them, so once pos moves to its end none of them reaches past pos any more.
    # among equals a per-object piece before a flushed object's entry (it outlives compaction)
    pieces.sort(key=lambda p: (p.begin, -p.end, p.flushed, p.key))
    chosen: list[Piece] = []
    pos, i = 0, 0
    while True:
        best: Piece | None = None
        while i < len(pieces) and pieces[i].begin <= pos:
            p = pieces[i]
            i += 1
            # in sort order: a later piece with the same end has a higher begin or key (ties)
            if p.end > pos and (best is None or p.end > best.end):
                best = p
        if best is None:
            break
        chosen.append(best)
        pos = best.end
    return chosen, pos


take_run = _take_run


def _verify(store: Store, obj: ObjectState, workers: int) -> None:
    """Read every piece: the run's (damage cuts the good length at the piece) and the others
    that overlap it (their bytes must agree with the run's)."""
    try:
        # as a read does: a piece gone since the listing (a flushed object compaction deleted)
        # lists the object again and goes on (4.4), rather than failing the whole scan
        for _chunk in iter_object(store, obj, 0, obj.length, workers=workers):
            pass
    except ObjectIncomplete as exc:
        obj.problems.extend(p for p in exc.problems if p not in obj.problems)
        obj.length = min(obj.length, exc.length)
    except TierDamage as exc:
        bad = next(p for p in obj.pieces if p.key == exc.key)
        obj._problem("damage", exc.key, bad.begin, str(exc))
        obj.length = min(obj.length, bad.begin)
    except TierConflict as exc:
        obj._problem("conflict", exc.key, exc.offset, str(exc))
        obj.length = min(obj.length, exc.offset)
    for q in obj.extra:
        try:
            data = get_piece(store, q)
        except TierDamage as exc:
            obj._problem("damage", q.key, q.begin, str(exc))
            continue
        except TierNotFound:
            continue  # deleted since the listing: a larger piece holds its bytes
        hi = min(q.end, obj.length)
        if q.begin >= hi:
            continue
        ours = b"".join(c for _, c in _fetch_run(store, obj, q.begin, hi, workers))
        theirs = data[: hi - q.begin]
        if ours != theirs:
            at = q.begin + _first_difference(ours, theirs)
            obj._problem("conflict", q.key, at, f"piece {q.key} differs from the run at byte {at}")
            obj.length = min(obj.length, at)


def _first_difference(a: bytes, b: bytes) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---------------------------------------------------------------------------------------------
# the reader

PART_SIZE = 4 * 1024 * 1024  # one ranged GET; a piece is fetched in parts of this, in parallel
RELISTS = 3  # a read that finds a listed piece gone lists the object again, this many times


def get_piece(store: Store, p: Piece, pool: ThreadPoolExecutor | None = None) -> bytes:
    """A piece's bytes, checked against its name (size, CRC32C); never more than its name's
    size (at most MAX_PIECE_BYTES) plus one byte is read, whatever the key holds."""
    if p.end - p.begin > MAX_PIECE_BYTES:
        raise TierPieceTooLarge(p.key, p.end - p.begin)
    size = p.end - p.begin
    base = max(p.at, 0)
    if size == 0:
        data = b""
    elif pool is None:
        data = store.get(p.key, base, base + size + (0 if p.flushed else 1))
    else:
        futs = [
            pool.submit(store.get, p.key, base + s, base + min(s + PART_SIZE, size)) for s in range(0, size, PART_SIZE)
        ]
        data = b"".join(f.result() for f in futs)
    if len(data) != p.end - p.begin:
        raise TierDamage(p.key, f"holds {len(data)} bytes, its name says {p.end - p.begin}")
    if crc32c(data) != p.crc:
        raise TierDamage(p.key, f"CRC32C {crc32c(data):08x}, its name says {p.crc:08x}")
    return data


def _run_slice(obj: ObjectState, start: int, end: int) -> list[Piece]:
    """The run's pieces that hold some byte of [start, end): a binary search (the run's begins
    and ends both increase), so a read costs no more for a long run than for a short one."""
    run = obj.pieces
    i = bisect.bisect_right(run, start, key=lambda p: p.end)
    j = i
    while j < len(run) and run[j].begin < end:
        j += 1
    return run[i:j]


def _fetch_run(store: Store, obj: ObjectState, start: int, end: int, workers: int) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of [start, end) from the run, each piece fetched whole (in parallel
    ranged parts, up to *workers* pieces ahead), its CRC32C checked, and the bytes it shares
    with the piece before it compared (a difference is a TierConflict)."""
    need = _run_slice(obj, start, end)
    if not need:
        return
    if len(need) == 1 and need[0].size <= PART_SIZE:  # one small piece: no threads to start
        p = need[0]
        data = get_piece(store, p)
        lo, hi = max(start, p.begin), min(end, p.end)
        yield lo, data[lo - p.begin : hi - p.begin]
        return
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tier-get") as pool:
        parts = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="tier-part")
        try:
            window: list[Future[bytes]] = []
            it = iter(need)
            for p in it:
                window.append(pool.submit(get_piece, store, p, parts))
                if len(window) >= workers:
                    break
            prev: tuple[Piece, bytes] | None = None
            idx = 0
            while window:
                p = need[idx]
                data = window.pop(0).result()
                nxt = next(it, None)
                if nxt is not None:
                    window.append(pool.submit(get_piece, store, nxt, parts))
                # overlap with the piece before: the bytes both hold (inside the range asked) agree
                lo_o, hi_o = max(p.begin, start), min(prev[0].end, end) if prev is not None else 0
                if prev is not None and hi_o > lo_o:
                    a = prev[1][lo_o - prev[0].begin : hi_o - prev[0].begin]
                    b = data[lo_o - p.begin : hi_o - p.begin]
                    if a != b:
                        at = lo_o + _first_difference(a, b)
                        raise TierConflict(p.key, f"differs from {prev[0].key} at byte {at}", at)
                lo = max(start, prev[0].end if prev else p.begin, p.begin)
                hi = min(end, p.end)
                if hi > lo:
                    yield lo, data[lo - p.begin : hi - p.begin]
                prev = (p, data)
                idx += 1
        finally:
            parts.shutdown(wait=True, cancel_futures=True)


def iter_object(
    store: Store, obj: ObjectState, start: int = 0, end: int | None = None, *, workers: int = 4
) -> Iterator[bytes]:
    """The object's bytes [start, end) (end None: its good length) in chunks, in order, every
    chunk from a piece whose CRC32C was checked; memory bounded by *workers* pieces.
    ObjectIncomplete if the range reaches past the good length; TierDamage / TierConflict
    if reading finds what the listing could not."""
    stop = obj.length if end is None else end
    if start < 0 or stop < start or stop > obj.length:
        raise ObjectIncomplete(obj.namespace, obj.name, obj.length, start if start > obj.length else stop, obj.problems)
    pos = start
    for attempt in range(RELISTS + 1):
        try:
            for off, chunk in _fetch_run(store, obj, pos, stop, workers):
                yield chunk
                pos = off + len(chunk)
            return
        except TierNotFound:
            # a piece of the listing is gone: a writer replaced small pieces by one that holds
            # their bytes (protocol.md 4.3 step 7), or retention removed the object. List the
            # object again and go on from where we are, if the new listing still holds it.
            if attempt == RELISTS:
                raise
            fresh = scan_object(store, obj.namespace, obj.name)
            if fresh.length < stop:
                raise ObjectIncomplete(obj.namespace, obj.name, fresh.length, pos, fresh.problems) from None
            obj.pieces, obj.extra = fresh.pieces, fresh.extra


def read_object(
    store: Store,
    namespace: str,
    name: str,
    start: int = 0,
    end: int | None = None,
    *,
    state: ObjectState | None = None,
    workers: int = 4,
) -> bytes:
    """The bytes [start, end) of one object, verified (see :func:`iter_object`); one listing of
    its prefix unless *state* (from :func:`scan`) is given."""
    obj = state if state is not None else scan_object(store, namespace, name)
    return b"".join(iter_object(store, obj, start, end, workers=workers))


def seal_time(store: Store, obj: ObjectState) -> int | None:
    """``sealed_at_ns`` from the object's seal marker, None if unsealed or not recorded."""
    if not obj.seal_keys:
        return obj.log_sealed_at_ns
    try:
        info = json.loads(store.get(obj.seal_keys[0], 0, MAX_MARKER_BYTES) or b"{}")
        t = info.get("sealed_at_ns") if isinstance(info, dict) else None
        return t if isinstance(t, int) else None
    except (TierNotFound, ValueError):
        return None


def keys_of(obj: ObjectState) -> list[str]:
    """Every key of an object: its pieces (from offset 0 up), then its seal markers and (hashed
    names) its name key."""
    own = [p for p in (*obj.pieces, *obj.extra) if not p.flushed]  # a flushed object is not the object's
    keys = [p.key for p in sorted(own, key=lambda p: (p.begin, p.end, p.key))]
    keys += obj.seal_keys
    if obj.edir.startswith(HASHED):
        keys.append(f"{namespace_prefix(obj.namespace)}o/{obj.edir}/name")
    return keys


def delete_object(store: Store, obj: ObjectState) -> None:
    """Retention's removal of one whole object (protocol.md 4.6): every piece first, then, once
    they are gone, the seal markers and the name key. Take *obj* from a fresh scan."""
    own = [p for p in (*obj.pieces, *obj.extra) if not p.flushed]
    pieces = [p.key for p in sorted(own, key=lambda p: (p.begin, p.end, p.key))]
    store.delete(pieces)
    rest = keys_of(obj)[len(pieces) :]
    if rest:
        store.delete(rest)
