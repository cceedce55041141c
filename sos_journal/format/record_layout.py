"""The journal record layout in construct: the single definition of protocol.md Part 2,
like ``sos_wire/frames.py`` is for the wire frames.

    u32 length | u32 crc32c | u8 type | u64 seq | u64 time_ns | body [| key_id(8) | tag(16)]

(the trailer when ``type`` has the flag 0x80: an authenticated record, protocol.md 2.5)

``records.py`` keeps a hand-written ``struct`` fast path (journals are read at hundreds of
MB/s during a restore; construct parses a few MB/s); ``tests/journal/test_layout.py``
checks it against this definition byte for byte: every record kind, edge sizes, random
records, and malformed ones (both refuse them with :class:`JournalCorrupt`).
Never use construct's compiled parsers on untrusted bytes.
"""

from __future__ import annotations

from typing import Any

from construct import (
    Adapter,
    Bytes,
    Check,
    ConstructError,
    FixedSized,
    GreedyBytes,
    If,
    IfThenElse,
    Int8ub,
    Int16ub,
    Int32ub,
    Int64ub,
    OneOf,
    Prefixed,
    RawCopy,
    Struct,
    Switch,
    Terminated,
    this,
)

from sos_journal.errors import JournalCorrupt
from sos_journal.format.records import (
    AEAD_TAG_SIZE,
    AUTH_FLAG,
    ENC_FLAG,
    KEY_ID_SIZE,
    MAX_DATA,
    MAX_FILE_SIZE,
    MAX_LABEL_BYTES,
    MAX_MODE,
    MAX_RECORD_LENGTH,
    MIN_LENGTH,
    TAG_SIZE,
    Create,
    Delete,
    Encrypted,
    Marker,
    Mkdir,
    Op,
    Record,
    RecordType,
    Rename,
    Rmdir,
    SnapshotEnd,
    Truncate,
    Write,
    validate_path,
)
from sos_wire.crc import crc32c

__all__ = ["BODIES", "CONTENT", "RECORD", "build_record", "parse_record"]


class _Text(Adapter):
    """u16 length + UTF-8 (surrogateescape: any byte string round-trips)."""

    def _decode(self, obj: bytes, context: Any, path: Any) -> str:
        return obj.decode("utf-8", "surrogateescape")

    def _encode(self, obj: str, context: Any, path: Any) -> bytes:
        return obj.encode("utf-8", "surrogateescape")


class _PathAdapter(_Text):
    """A path inside the namespace (records.validate_path: relative, no '.', '..', NUL)."""

    def _decode(self, obj: bytes, context: Any, path: Any) -> str:
        text = super()._decode(obj, context, path)
        try:
            return validate_path(text)
        except ValueError as exc:
            raise ConstructError(str(exc)) from None

    def _encode(self, obj: str, context: Any, path: Any) -> bytes:
        return super()._encode(validate_path(obj), context, path)


Path = _PathAdapter(Prefixed(Int16ub, GreedyBytes))
Label = _Text(Prefixed(Int16ub, GreedyBytes))
Data = Prefixed(Int32ub, GreedyBytes)
FileSize = Int64ub  # an offset or size: at most MAX_FILE_SIZE (checked in each body)
Mode = Int32ub

BODIES = {
    RecordType.MKDIR: Struct("path" / Path, "mode" / Mode, Check(this.mode <= MAX_MODE)),
    RecordType.RMDIR: Struct("path" / Path),
    RecordType.CREATE: Struct("path" / Path, "mode" / Mode, Check(this.mode <= MAX_MODE)),
    RecordType.WRITE: Struct(
        "path" / Path,
        "offset" / FileSize,
        "data" / Data,
        Check(lambda c: len(c.data) <= MAX_DATA),
        Check(lambda c: c.offset + len(c.data) <= MAX_FILE_SIZE),
    ),
    RecordType.TRUNCATE: Struct("path" / Path, "size" / FileSize, Check(this.size <= MAX_FILE_SIZE)),
    RecordType.RENAME: Struct("src" / Path, "dst" / Path, "overwrite" / OneOf(Int8ub, [0, 1])),
    RecordType.DELETE: Struct("path" / Path),
    RecordType.MARKER: Struct(
        "label" / Label,
        Check(lambda c: len(c.label.encode("utf-8", "surrogateescape")) <= MAX_LABEL_BYTES),
        "payload" / Data,
        Check(lambda c: len(c.payload) <= MAX_DATA),
    ),
    RecordType.SNAPSHOT_END: Struct("generation" / Int64ub),
}

_TYPES = [int(t) | flags for flags in (0, AUTH_FLAG, AUTH_FLAG | ENC_FLAG) for t in RecordType]

#: What the length counts and the CRC covers: the head, the body of the type without its flag,
#: and for an authenticated record the key's fingerprint and the tag.
CONTENT = Struct(
    "type" / OneOf(Int8ub, _TYPES),
    "seq" / Int64ub,
    "time_ns" / Int64ub,
    "body"
    / IfThenElse(
        this.type & ENC_FLAG,
        # the sealed body (ChaCha20-Poly1305 output): everything up to the trailer
        Bytes(this._.length - MIN_LENGTH - KEY_ID_SIZE - TAG_SIZE),
        Switch(this.type & ~AUTH_FLAG, BODIES),
    ),
    "key_id" / If(this.type & AUTH_FLAG, Bytes(KEY_ID_SIZE)),
    "tag" / If(this.type & AUTH_FLAG, Bytes(TAG_SIZE)),
    Terminated,
)

#: One record. ``content`` is what the length counts and the CRC covers.
RECORD = Struct(
    "length" / Int32ub,
    Check(lambda c: MIN_LENGTH <= c.length <= MAX_RECORD_LENGTH),
    "crc" / Int32ub,
    "content" / RawCopy(FixedSized(this.length, CONTENT)),
    Check(lambda c: crc32c(c.content.data) == c.crc),
)

_FIELDS = {  # op class -> (type, body fields in order)
    Mkdir: (RecordType.MKDIR, ("path", "mode")),
    Rmdir: (RecordType.RMDIR, ("path",)),
    Create: (RecordType.CREATE, ("path", "mode")),
    Write: (RecordType.WRITE, ("path", "offset", "data")),
    Truncate: (RecordType.TRUNCATE, ("path", "size")),
    Rename: (RecordType.RENAME, ("src", "dst", "overwrite")),
    Delete: (RecordType.DELETE, ("path",)),
    Marker: (RecordType.MARKER, ("label", "payload")),
    SnapshotEnd: (RecordType.SNAPSHOT_END, ("generation",)),
}
_OPS = {typ: (cls, names) for cls, (typ, names) in _FIELDS.items()}


def build_record(op: Op, seq: int, time_ns: int, trailer: bytes | None = None) -> bytes:
    """The record's bytes, built from this definition (ValueError for what it refuses);
    ``trailer``: an authenticated record's key fingerprint + tag (24 bytes); an
    :class:`Encrypted` op (with a trailer) is built with its sealed body as it is."""
    body: Any
    if isinstance(op, Encrypted):
        typ, flag, body = op.type, AUTH_FLAG | ENC_FLAG, op.sealed
    else:
        typ, names = _FIELDS[type(op)]
        body = {n: (int(getattr(op, n)) if n == "overwrite" else getattr(op, n)) for n in names}
        flag = AUTH_FLAG if trailer is not None else 0
    key_id, tag = (trailer[:KEY_ID_SIZE], trailer[KEY_ID_SIZE:]) if trailer is not None else (None, None)
    size = MIN_LENGTH + (len(body) if isinstance(body, bytes) else 0) + KEY_ID_SIZE + TAG_SIZE
    try:
        content = CONTENT.build(
            {"type": int(typ) | flag, "seq": seq, "time_ns": time_ns, "body": body, "key_id": key_id, "tag": tag},
            length=size,
        )
    except ConstructError as exc:
        raise ValueError(str(exc)) from None
    try:
        return RECORD.build({"length": len(content), "crc": crc32c(content), "content": {"data": content}})
    except ConstructError as exc:
        raise ValueError(str(exc)) from None


def parse_record(data: bytes, segment: str = "", offset: int = 0) -> Record:
    """One whole record parsed by this definition; :class:`JournalCorrupt` if it is not one."""
    try:
        rec = RECORD.parse(data)
    except ConstructError as exc:
        raise JournalCorrupt(segment, offset, f"not a record by the layout: {exc}") from None
    value = rec.content.value
    base = RecordType(value.type & ~(AUTH_FLAG | ENC_FLAG))
    op: Op
    if value.type & ENC_FLAG:
        if len(value.body) < AEAD_TAG_SIZE:
            raise JournalCorrupt(segment, offset, "not a record by the layout: sealed body shorter than its tag")
        op = Encrypted(base, bytes(value.body))
    else:
        cls, names = _OPS[base]
        body = value.body
        fields = [bool(body[n]) if n == "overwrite" else body[n] for n in names]
        op = cls(*fields)
    key_id, tag = (value.key_id, value.tag) if value.type & AUTH_FLAG else (b"", b"")
    return Record(value.seq, value.time_ns, op, segment, offset, 8 + rec.length, key_id, tag)
