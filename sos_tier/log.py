"""Flushed objects: the server's batched log in the store (protocol.md 4.2a).

One **flushed object** per flush holds every namespace's and object's new durable bytes since
the last flush (as WarpStream's and KIP-1150's one object per flush interval), with an index
at its head that says which bytes of which object it holds::

    v1/log/<seq 16 hex>-<writer 16 hex>

    "SOSLOG1\\n"  u32 index length (big-endian)  u32 CRC32C of the index  index  data

The index is compact JSON ``{"entries": [[ns, name, begin, end, crc, at], ...],
"seals": [[ns, name, length, sealed_at_ns or null], ...]}``: each entry is the object's
bytes ``[begin, end)`` (``0-0``: "exists, empty"), CRC32C ``crc``, at byte ``at`` of the
data. A reader takes an entry as a piece of its object (layout.py) located inside the flushed
object, and a seal entry as the object's seal marker. Compaction (uploader.py) later writes the
same bytes as per-object pieces, then deletes the flushed object.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field

from sos_tier.store import Store, TierError
from sos_wire.crc import crc32c
from sos_wire.names import BadName, validate_name, validate_namespace

__all__ = [
    "HEAD",
    "LOG_PREFIX",
    "MAGIC",
    "MAX_INDEX_BYTES",
    "MAX_LOG_DATA",
    "Batch",
    "Entry",
    "LogDamage",
    "SealEntry",
    "decode_batch",
    "encode_batch",
    "log_key",
    "parse_log_key",
    "read_index",
]

LOG_PREFIX = "v1/log/"
MAGIC = b"SOSLOG1\n"
HEAD = len(MAGIC) + 8
#: The index of one flushed object is at most this (a reader reads no more of one).
MAX_INDEX_BYTES = 1024 * 1024
#: The data of one flushed object is at most this (as a piece, protocol.md 4.2): a flush with
#: more is cut into several objects.
MAX_LOG_DATA = 8 * 1024 * 1024
FIRST_READ = 64 * 1024  # the first ranged GET of an index: a small flushed object whole
_KEY = re.compile(r"([0-9a-f]{16})-([0-9a-f]{16})")


class LogDamage(TierError):
    """A flushed object whose head or index is not one a writer makes (reported, never read)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"damaged flushed object {key}: {message}")
        self.key = key


@dataclass(frozen=True, slots=True)
class Entry:
    namespace: str
    name: str
    begin: int
    end: int
    crc: int
    at: int  # offset of the bytes in the flushed object (from its first byte)


@dataclass(frozen=True, slots=True)
class SealEntry:
    namespace: str
    name: str
    length: int
    sealed_at_ns: int | None


@dataclass(slots=True)
class Batch:
    key: str
    seq: int
    writer: str
    entries: list[Entry] = field(default_factory=list)
    seals: list[SealEntry] = field(default_factory=list)

    def objects(self) -> set[tuple[str, str]]:
        return {(e.namespace, e.name) for e in self.entries} | {(s.namespace, s.name) for s in self.seals}


def log_key(seq: int, writer: str) -> str:
    if not 0 <= seq < 2**64 or not re.fullmatch("[0-9a-f]{16}", writer):
        raise ValueError(f"bad flushed object seq {seq} writer {writer!r}")
    return f"{LOG_PREFIX}{seq:016x}-{writer}"


def parse_log_key(key: str) -> tuple[int, str] | None:
    """(seq, writer) of a flushed object's key, None for a key the layout cannot have made."""
    if not key.startswith(LOG_PREFIX):
        return None
    m = _KEY.fullmatch(key[len(LOG_PREFIX) :])
    return (int(m[1], 16), m[2]) if m else None


def encode_batch(
    parts: list[tuple[str, str, int, bytes]], seals: list[tuple[str, str, int, int | None]]
) -> tuple[bytes, list[tuple[str, str, int, int, int]]]:
    """The content of a flushed object holding *parts* ((ns, name, begin, bytes)) and *seals*;
    also the entries (ns, name, begin, end, crc) it holds."""
    rows: list[list[object]] = []
    at = 0
    for ns, name, begin, data in parts:
        rows.append([ns, name, begin, begin + len(data), crc32c(data), at])
        at += len(data)
    index = json.dumps({"entries": rows, "seals": [list(s) for s in seals]}, separators=(",", ":")).encode()
    if len(index) > MAX_INDEX_BYTES or at > MAX_LOG_DATA:
        raise ValueError(f"flushed object too large: index {len(index)}, data {at}")
    head = MAGIC + struct.pack(">II", len(index), crc32c(index))
    body = head + index + b"".join(d for _, _, _, d in parts)
    return body, [(r[0], r[1], r[2], r[3], r[4]) for r in rows]  # type: ignore[misc]


def read_index(store: Store, key: str, size: int) -> Batch:
    """The index of the flushed object *key* (listed *size*): at most two ranged GETs and
    never more than HEAD + MAX_INDEX_BYTES bytes read. LogDamage for anything a writer does
    not make (bad magic, index CRC, JSON, an entry outside the object or over 8 MiB)."""
    parsed = parse_log_key(key)
    if parsed is None:
        raise LogDamage(key, "not a flushed object's key")
    head = store.get(key, 0, min(size, HEAD + FIRST_READ))
    if len(head) < HEAD or head[: len(MAGIC)] != MAGIC:
        raise LogDamage(key, "no flushed object's head")
    n, crc = struct.unpack(">II", head[len(MAGIC) : HEAD])
    if n > MAX_INDEX_BYTES or HEAD + n > size:
        raise LogDamage(key, f"index of {n} bytes does not fit (object of {size}, at most {MAX_INDEX_BYTES})")
    raw = head[HEAD : HEAD + n]
    if len(raw) < n:
        raw += store.get(key, HEAD + len(raw), HEAD + n)
    if len(raw) != n or crc32c(raw) != crc:
        raise LogDamage(key, "index fails its CRC32C")
    try:
        doc = json.loads(raw)
        return _batch(key, parsed, doc, size - HEAD - n, HEAD + n)
    except (ValueError, TypeError, KeyError, BadName) as exc:
        raise LogDamage(key, f"index not readable: {exc}") from None


class _Bytes:
    """A one-key store over bytes in memory (a flushed object this process just wrote)."""

    url = "memory:"

    def __init__(self, body: bytes) -> None:
        self.body = body

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self.body[start or 0 : end]


def decode_batch(key: str, body: bytes) -> Batch:
    """The index of a flushed object whose whole content is *body* (as :func:`read_index`)."""
    return read_index(_Bytes(body), key, len(body))  # type: ignore[arg-type]


def _batch(key: str, parsed: tuple[int, str], doc: dict[str, list[list[object]]], data_size: int, base: int) -> Batch:
    b = Batch(key, parsed[0], parsed[1])
    for row in doc["entries"]:
        ns, name, begin, end, crc, at = row
        if not (isinstance(ns, str) and isinstance(name, str)):
            raise ValueError("entry without names")
        validate_namespace(ns)
        validate_name(name)
        ints = (begin, end, crc, at)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise ValueError("entry with non-integer offsets")
        assert isinstance(begin, int) and isinstance(end, int) and isinstance(crc, int) and isinstance(at, int)
        if not (0 <= begin <= end < 2**64 and 0 <= crc < 2**32 and at >= 0 and at + end - begin <= data_size):
            raise ValueError(f"entry {ns}/{name} [{begin}, {end}) at {at} outside the object")
        if end - begin > MAX_LOG_DATA or (begin == end and (begin != 0 or crc != 0)):
            raise ValueError(f"entry {ns}/{name} [{begin}, {end}) is not one a writer makes")
        b.entries.append(Entry(ns, name, begin, end, crc, base + at))
    for row in doc.get("seals", []):
        ns, name, length, t = row
        if not (isinstance(ns, str) and isinstance(name, str) and isinstance(length, int) and 0 <= length < 2**64):
            raise ValueError("bad seal entry")
        validate_namespace(ns)
        validate_name(name)
        b.seals.append(SealEntry(ns, name, length, t if isinstance(t, int) else None))
    return b
