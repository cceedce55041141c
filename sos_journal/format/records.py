"""Journal record codec (sans-IO: bytes in, records out; records in, bytes out).

Normative description: protocol.md, Part 2. Every record is

    u32 length | u32 crc32c | u8 type | u64 seq | u64 time_ns | body [| key_id(8) | tag(16)]

big-endian; ``length`` counts the bytes after the crc field (type .. end of the record, so
``17 + len(body)``, + 24 for an authenticated record) and ``crc32c`` (Castagnoli) covers
exactly those bytes. Strings are u16 length + UTF-8, blobs u32 length + bytes. A type byte
with the flag 0x80 (``AUTH_FLAG``) marks an authenticated record: the journal key's
fingerprint and the record's tag follow the body (protocol.md 2.5, ``auth.py``).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from sos_journal.errors import JournalCorrupt
from sos_wire.crc import crc32c as _crc32c

__all__ = [
    "AUTH_FLAG",
    "ENC_FLAG",
    "HEADER_SIZE",
    "MAX_DATA",
    "MAX_FILE_SIZE",
    "MAX_MODE",
    "MAX_NAME_BYTES",
    "MAX_RECORD_LENGTH",
    "PREFIX_SIZE",
    "REPLAY_MODE_MASK",
    "TRAILER_SIZE",
    "Create",
    "Delete",
    "Encrypted",
    "Marker",
    "Mkdir",
    "Op",
    "Record",
    "RecordDecoder",
    "RecordType",
    "Rename",
    "Rmdir",
    "SnapshotEnd",
    "Truncate",
    "Write",
    "decode_all",
    "encode",
    "encode_ops",
    "peek_header",
    "replay_mode",
    "split_write",
    "validate_path",
]

MAX_DATA = 1 << 20  # WRITE data and MARKER payload per record
#: Largest file a journal can describe (1 TiB): a WRITE may not end and a TRUNCATE may not
#: reach past it (one 40-byte TRUNCATE must not make restore create an 8 TiB file).
MAX_FILE_SIZE = 1 << 40
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255  # one path segment (NAME_MAX)
MAX_LABEL_BYTES = 255
MAX_MODE = 0o7777  # a mode field holds permission bits only
#: What replay applies of a mode field: never setuid, setgid, sticky or write-for-others
#: (a journal may be hostile, and restore often runs as root). Writers record modes masked so.
REPLAY_MODE_MASK = 0o775
PREFIX = struct.Struct(">II")  # length, crc
HEAD = struct.Struct(">BQQ")  # type, seq, time_ns
HEADER = struct.Struct(">IIBQQ")
PREFIX_SIZE = PREFIX.size  # 8
HEADER_SIZE = HEADER.size  # 25
MIN_LENGTH = HEAD.size  # 17
#: the type byte's flag of an authenticated record, followed by KEY_ID_SIZE + TAG_SIZE bytes
AUTH_FLAG = 0x80
#: with AUTH_FLAG: the body is encrypted (ChaCha20-Poly1305: the body's bytes, then 16 bytes)
ENC_FLAG = 0x40
KEY_ID_SIZE = 8
TAG_SIZE = 16
AEAD_TAG_SIZE = 16
TRAILER_SIZE = KEY_ID_SIZE + TAG_SIZE  # 24
# Largest legal length field: an encrypted WRITE with the longest path and 1 MiB of data.
MAX_RECORD_LENGTH = MIN_LENGTH + 2 + MAX_PATH_BYTES + 8 + 4 + MAX_DATA + AEAD_TAG_SIZE + TRAILER_SIZE

_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")


class RecordType(enum.IntEnum):
    MKDIR = 1
    RMDIR = 2
    CREATE = 3
    WRITE = 4
    TRUNCATE = 5
    RENAME = 6
    DELETE = 7
    MARKER = 8
    SNAPSHOT_END = 9


def validate_path(path: str) -> str:
    """A path inside the namespace: relative POSIX, at most 4096 bytes, segments of 1..255
    bytes, no '.' or '..' segment, no NUL."""
    if not isinstance(path, str):
        raise TypeError(f"path must be str, not {type(path).__name__}")
    if not path or path.startswith("/") or "\x00" in path:
        raise ValueError(f"bad path {path!r}: must be a non-empty relative path without NUL")
    for part in path.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"bad path {path!r}: empty, '.' or '..' segment")
        if len(part) > MAX_NAME_BYTES // 4 and len(part.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            raise ValueError(f"bad path {path[:80]!r}...: a segment is longer than {MAX_NAME_BYTES} bytes")
    if len(path) > MAX_PATH_BYTES // 4 and len(path.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise ValueError(f"bad path {path[:80]!r}...: longer than {MAX_PATH_BYTES} bytes")
    return path


def replay_mode(mode: int) -> int:
    """The permission bits replay gives a new file or directory for a record's mode."""
    return mode & REPLAY_MODE_MASK


@dataclass(frozen=True, slots=True)
class Mkdir:
    path: str
    mode: int = 0o755
    type = RecordType.MKDIR


@dataclass(frozen=True, slots=True)
class Rmdir:
    path: str
    type = RecordType.RMDIR


@dataclass(frozen=True, slots=True)
class Create:
    path: str
    mode: int = 0o644
    type = RecordType.CREATE


@dataclass(frozen=True, slots=True)
class Write:
    path: str
    offset: int
    data: bytes
    type = RecordType.WRITE


@dataclass(frozen=True, slots=True)
class Truncate:
    path: str
    size: int
    type = RecordType.TRUNCATE


@dataclass(frozen=True, slots=True)
class Rename:
    src: str
    dst: str
    overwrite: bool
    type = RecordType.RENAME


@dataclass(frozen=True, slots=True)
class Delete:
    path: str
    type = RecordType.DELETE


@dataclass(frozen=True, slots=True)
class Marker:
    label: str
    payload: bytes = b""
    type = RecordType.MARKER


@dataclass(frozen=True, slots=True)
class SnapshotEnd:
    generation: int
    type = RecordType.SNAPSHOT_END


@dataclass(frozen=True, slots=True)
class Encrypted:
    """An encrypted record read without its journal key: its type and its sealed body. Never
    applied: a reader without the key refuses the record (auth.ChainCheck) before replay."""

    type: RecordType
    sealed: bytes


Op = Mkdir | Rmdir | Create | Write | Truncate | Rename | Delete | Marker | SnapshotEnd | Encrypted
#: What the codec reads bytes from (collections.abc.Buffer once Python 3.12 is the minimum).
Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class Record:
    """A decoded record: its op plus where it came from."""

    seq: int
    time_ns: int
    op: Op
    segment: str = ""
    offset: int = 0  # byte offset of the record's first byte in its segment
    size: int = 0  # total encoded size (8 + length)
    key_id: bytes = b""  # an authenticated record: its key's fingerprint and its tag
    tag: bytes = b""
    #: the record's HMAC so far (auth.ChainCheck completes it), when decoded with the key ring
    mac: Any = field(default=None, compare=False, repr=False)


def _s(text: str, what: str, limit: int) -> bytes:
    b = text.encode("utf-8", "surrogateescape")
    if len(b) > limit:
        raise ValueError(f"{what} longer than {limit} bytes")
    return _U16.pack(len(b)) + b


def _encode_body(op: Op) -> list[bytes]:
    if isinstance(op, Write):
        data = op.data
        if len(data) > MAX_DATA:
            raise ValueError(f"WRITE data of {len(data)} bytes exceeds {MAX_DATA}; use split_write")
        if op.offset < 0 or op.offset + len(data) > MAX_FILE_SIZE:
            raise ValueError(f"WRITE at offset {op.offset} ends outside 0..{MAX_FILE_SIZE} (largest file)")
        return [_s(validate_path(op.path), "path", MAX_PATH_BYTES), _U64.pack(op.offset), _U32.pack(len(data)), data]
    if isinstance(op, (Create, Mkdir)):
        if not 0 <= op.mode <= MAX_MODE:
            raise ValueError(f"mode {op.mode:#o} outside 0..{MAX_MODE:#o} (permission bits only)")
        return [_s(validate_path(op.path), "path", MAX_PATH_BYTES), _U32.pack(op.mode)]
    if isinstance(op, (Rmdir, Delete)):
        return [_s(validate_path(op.path), "path", MAX_PATH_BYTES)]
    if isinstance(op, Truncate):
        if not 0 <= op.size <= MAX_FILE_SIZE:
            raise ValueError(f"TRUNCATE size {op.size} outside 0..{MAX_FILE_SIZE} (largest file)")
        return [_s(validate_path(op.path), "path", MAX_PATH_BYTES), _U64.pack(op.size)]
    if isinstance(op, Rename):
        return [
            _s(validate_path(op.src), "path", MAX_PATH_BYTES),
            _s(validate_path(op.dst), "path", MAX_PATH_BYTES),
            bytes([1 if op.overwrite else 0]),
        ]
    if isinstance(op, Marker):
        payload = bytes(op.payload)
        if len(payload) > MAX_DATA:
            raise ValueError(f"MARKER payload exceeds {MAX_DATA} bytes")
        return [_s(op.label, "label", MAX_LABEL_BYTES), _U32.pack(len(payload)), payload]
    if isinstance(op, SnapshotEnd):
        return [_U64.pack(op.generation)]
    raise TypeError(f"not a journal op: {op!r}")


def encode(op: Op, seq: int, time_ns: int, sign: Callable[[list[bytes]], bytes] | None = None) -> bytes:
    """Encode one record. Raises ValueError/TypeError on an op that cannot be encoded.

    ``sign`` (an :class:`~.auth.Signer`): the record is authenticated; ``sign(parts)`` gets
    its bytes from the type byte (flagged) to the end of the body and returns the trailer;
    with ``sign.encrypt`` set, the body is first replaced by ``sign.encrypt(head, seq, body)``."""
    if not (0 <= seq < 1 << 64) or not (0 <= time_ns < 1 << 64):
        raise ValueError("seq and time_ns must fit in u64")
    parts = _encode_body(op)
    if sign is None:
        head = HEAD.pack(int(op.type), seq, time_ns)
    else:
        encrypt = getattr(sign, "encrypt", None)
        head = HEAD.pack(int(op.type) | AUTH_FLAG | (ENC_FLAG if encrypt else 0), seq, time_ns)
        if encrypt:
            parts = [encrypt(head, seq, b"".join(parts))]
        parts.append(sign([head, *parts]))
    length = len(head) + sum(len(p) for p in parts)
    crc = _crc32c(head)
    for p in parts:
        crc = _crc32c(p, crc)
    return b"".join([PREFIX.pack(length, crc), head, *parts])


def split_write(path: str, offset: int, data: Buffer) -> Iterator[Write]:
    """WRITE ops of at most MAX_DATA bytes each covering ``data`` at ``offset``."""
    mv = memoryview(data)
    if len(mv) == 0:
        return
    for i in range(0, len(mv), MAX_DATA):
        yield Write(path, offset + i, bytes(mv[i : i + MAX_DATA]))


def encode_ops(ops: Iterable[tuple[Op, int, int]]) -> bytes:
    return b"".join(encode(op, seq, t) for op, seq, t in ops)


def peek_header(buf: Buffer, pos: int = 0) -> tuple[int, int, int, int]:
    """(length, type, seq, time_ns) of the record at ``pos`` without checking it."""
    length, _crc_v, typ, seq, t = HEADER.unpack_from(buf, pos)
    return length, typ, seq, t


class _Body:
    __slots__ = ("mv", "off", "pos", "seg")

    def __init__(self, mv: memoryview, seg: str, off: int) -> None:
        self.mv = mv
        self.pos = 0
        self.seg = seg
        self.off = off

    def bad(self, why: str) -> JournalCorrupt:
        return JournalCorrupt(self.seg, self.off, why)

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.mv):
            raise self.bad("body shorter than its fields")
        v = self.mv[self.pos : self.pos + n]
        self.pos += n
        return v

    def u8(self) -> int:
        return self.take(1)[0]

    def u32(self) -> int:
        return _U32.unpack(self.take(4))[0]

    def u64(self) -> int:
        return _U64.unpack(self.take(8))[0]

    def size(self) -> int:
        """A file offset or size: a u64 no larger than the largest file (MAX_FILE_SIZE)."""
        v = self.u64()
        if v > MAX_FILE_SIZE:
            raise self.bad(f"file offset/size {v} exceeds {MAX_FILE_SIZE} (largest file)")
        return v

    def mode(self) -> int:
        v = self.u32()
        if v > MAX_MODE:
            raise self.bad(f"mode {v:#o} has bits outside {MAX_MODE:#o}")
        return v

    def label(self) -> str:
        n = _U16.unpack(self.take(2))[0]
        if n > MAX_LABEL_BYTES:
            raise self.bad(f"MARKER label of {n} bytes exceeds {MAX_LABEL_BYTES}")
        return bytes(self.take(n)).decode("utf-8", "surrogateescape")

    def string(self) -> str:
        n = _U16.unpack(self.take(2))[0]
        raw = bytes(self.take(n))
        try:
            return raw.decode("utf-8", "surrogateescape")
        except UnicodeDecodeError:  # pragma: no cover - surrogateescape never fails
            raise self.bad("string is not UTF-8") from None

    def path(self) -> str:
        p = self.string()
        try:
            return validate_path(p)
        except ValueError as e:
            raise self.bad(str(e)) from None

    def blob(self) -> bytes:
        n = self.u32()
        if n > MAX_DATA:
            raise self.bad(f"blob of {n} bytes exceeds {MAX_DATA}")
        return bytes(self.take(n))

    def end(self) -> None:
        if self.pos != len(self.mv):
            raise self.bad(f"{len(self.mv) - self.pos} trailing bytes after the body")


def _decode_op(typ: int, body: memoryview, seg: str, off: int) -> Op:
    b = _Body(body, seg, off)
    op: Op
    if typ == RecordType.WRITE:
        write = Write(b.path(), b.size(), b.blob())
        if write.offset + len(write.data) > MAX_FILE_SIZE:
            raise b.bad(f"write ends past {MAX_FILE_SIZE} (largest file)")
        op = write
    elif typ == RecordType.CREATE:
        op = Create(b.path(), b.mode())
    elif typ == RecordType.MKDIR:
        op = Mkdir(b.path(), b.mode())
    elif typ == RecordType.RMDIR:
        op = Rmdir(b.path())
    elif typ == RecordType.DELETE:
        op = Delete(b.path())
    elif typ == RecordType.TRUNCATE:
        op = Truncate(b.path(), b.size())
    elif typ == RecordType.RENAME:
        src, dst, ow = b.path(), b.path(), b.u8()
        if ow not in (0, 1):
            raise b.bad(f"overwrite flag {ow} is not 0 or 1")
        op = Rename(src, dst, bool(ow))
    elif typ == RecordType.MARKER:
        op = Marker(b.label(), b.blob())
    elif typ == RecordType.SNAPSHOT_END:
        op = SnapshotEnd(b.u64())
    else:
        raise b.bad(f"unknown record type {typ}")
    b.end()
    return op


_TYPES = frozenset(int(t) for t in RecordType)


class RecordDecoder:
    """Incremental decoder: ``feed(bytes)`` then ``next_record()`` until it returns None.

    Every byte is checked (length bounds, CRC32C, type, body layout, path rules). Any
    problem raises :class:`JournalCorrupt` naming the segment and the record's offset.
    ``offset`` is the absolute offset of the next undecoded byte; ``pending`` the number of
    buffered bytes that do not yet form a whole record (a torn tail if the stream ended).
    """

    def __init__(self, segment: str = "", offset: int = 0, keys: Any = None) -> None:
        self.segment = segment
        self.offset = offset
        #: the journal key ring for this segment (``auth.SegmentKeys``): authenticated records
        #: then carry their partial MAC (``Record.mac``) and encrypted ones are decrypted
        self.keys = keys
        self._buf = bytearray()
        self._pos = 0

    @property
    def pending(self) -> int:
        return len(self._buf) - self._pos

    def feed(self, data: Buffer) -> None:
        if self._pos and self._pos >= len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_record(self) -> Record | None:
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail < PREFIX_SIZE:
            return None
        length, crc = PREFIX.unpack_from(buf, pos)
        if length < MIN_LENGTH or length > MAX_RECORD_LENGTH:
            raise JournalCorrupt(
                self.segment, self.offset, f"record length {length} outside [{MIN_LENGTH}, {MAX_RECORD_LENGTH}]"
            )
        total = PREFIX_SIZE + length
        if avail < total:
            return None
        with memoryview(buf) as mv, mv[pos + PREFIX_SIZE : pos + total] as rec_mv:
            if _crc32c(rec_mv) != crc:
                raise JournalCorrupt(self.segment, self.offset, "CRC32C mismatch")
            typ, seq, t = HEAD.unpack_from(rec_mv, 0)
            key_id = tag = b""
            mac = None
            end = length
            if typ & AUTH_FLAG:
                if length < MIN_LENGTH + TRAILER_SIZE:
                    raise JournalCorrupt(self.segment, self.offset, "authenticated record shorter than its tag")
                end = length - TRAILER_SIZE
                key_id, tag = bytes(rec_mv[end : end + KEY_ID_SIZE]), bytes(rec_mv[end + KEY_ID_SIZE :])
                if self.keys is not None:
                    mac = self.keys.mac_start(key_id)
                    if mac is not None:
                        mac.update(rec_mv[: length - TAG_SIZE])
            if typ & ENC_FLAG and typ & AUTH_FLAG:
                op = self._open(typ & ~(AUTH_FLAG | ENC_FLAG), rec_mv, end, key_id)
            else:
                with rec_mv[MIN_LENGTH:end] as body:
                    op = _decode_op(typ & ~AUTH_FLAG, body, self.segment, self.offset)
        rec = Record(seq, t, op, self.segment, self.offset, total, key_id, tag, mac)
        self._pos = pos + total
        self.offset += total
        return rec

    def _open(self, typ: int, rec_mv: memoryview, end: int, key_id: bytes) -> Op:
        """The op of an encrypted record: decrypted with the ring's key (a sealed body that does
        not open is a JournalAuthError), or :class:`Encrypted` without the key."""
        sealed = bytes(rec_mv[MIN_LENGTH:end])
        plain = (
            self.keys.decrypt(key_id, bytes(rec_mv[:MIN_LENGTH]), sealed, self.offset)
            if self.keys is not None
            else None
        )
        if plain is None:
            if typ not in _TYPES or len(sealed) < AEAD_TAG_SIZE:
                raise JournalCorrupt(self.segment, self.offset, f"unknown record type {typ} or short sealed body")
            return Encrypted(RecordType(typ), sealed)
        return _decode_op(typ, memoryview(plain), self.segment, self.offset)

    def __iter__(self) -> Iterator[Record]:
        while True:
            r = self.next_record()
            if r is None:
                return
            yield r


def decode_all(data: Buffer, segment: str = "", *, allow_partial: bool = False) -> list[Record]:
    """Decode a complete byte string. A torn tail raises unless ``allow_partial``."""
    d = RecordDecoder(segment)
    d.feed(data)
    out = list(d)
    if d.pending and not allow_partial:
        raise JournalCorrupt(segment, d.offset, f"truncated record ({d.pending} bytes at the end)")
    return out
