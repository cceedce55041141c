"""The frame layouts: ONE construct definition per frame, the single source of truth.

Every frame is a 16-byte header followed by ``body_len`` bytes of body; all
integers are big-endian.  Only the bodies differ by opcode.  The codec in
``connection.py`` parses the header only once 16 bytes are there, checks
``body_len`` against its cap, waits for the whole body, then parses it.

The hot frames (header, APPEND, APPEND_OK, READ_DATA) also have precompiled
``struct.Struct`` fast paths in ``connection.py``; ``tests/wire/test_fastpath.py``
checks them against these definitions byte for byte.  Never use construct's
compiled parsers on untrusted bytes.
"""

from __future__ import annotations

from enum import IntEnum

from construct import (
    Bytes,
    Checksum,
    Const,
    GreedyBytes,
    Int8ub,
    Int16ub,
    Int32ub,
    Int64ub,
    OneOf,
    PascalString,
    Prefixed,
    PrefixedArray,
    RawCopy,
    Struct,
    Terminated,
    this,
)

from .crc import crc32c

__all__ = [
    "BODIES",
    "DEFAULT_MAX_BODY",
    "HEADER_LEN",
    "MAGIC",
    "MAX_LIST_LIMIT",
    "MAX_PING_PAYLOAD",
    "MAX_TIER_WAIT_MS",
    "REPLIES",
    "REPLY_TO",
    "REQUESTS",
    "SUPPORTED_VERSIONS",
    "VERSION",
    "Blob",
    "Bool8",
    "Header",
    "HeaderFields",
    "ListEntryBody",
    "Op",
    "String",
    "build_header",
]

MAGIC = b"SO"
VERSION = 1
SUPPORTED_VERSIONS = (1,)
HEADER_LEN = 16
#: default cap on a frame body: room for an 8 MiB blob plus the other fields.
DEFAULT_MAX_BODY = 8 * 1024 * 1024 + 4096
MAX_PING_PAYLOAD = 64
MAX_LIST_LIMIT = 1000
#: TIER_WAIT's timeout_ms is capped at this (a longer one waits this long)
MAX_TIER_WAIT_MS = 60_000


class Op(IntEnum):
    HELLO = 0x01
    AUTH = 0x02
    PING = 0x03
    LIST = 0x04
    STAT = 0x05
    APPEND = 0x06
    READ = 0x07
    SEAL = 0x08
    FENCE = 0x09
    TIER_WAIT = 0x0A
    HELLO_OK = 0x81
    AUTH_OK = 0x82
    PONG = 0x83
    LIST_OK = 0x84
    STAT_OK = 0x85
    APPEND_OK = 0x86
    READ_DATA = 0x87
    SEAL_OK = 0x88
    FENCE_OK = 0x89
    TIER_WAIT_OK = 0x8A
    ERROR = 0xFF


REQUESTS = frozenset(op for op in Op if op < 0x80)
REPLIES = frozenset(op for op in Op if op >= 0x80)
#: the success reply of each request (ERROR answers any request)
REPLY_TO = {op: Op(op | 0x80) for op in REQUESTS}

# -- field types ------------------------------------------------------------------
#: u16 byte length + UTF-8 (strict: invalid UTF-8 is a bad frame)
String = PascalString(Int16ub, "utf8")
#: u32 byte length + bytes
Blob = Prefixed(Int32ub, GreedyBytes)
#: u8 that must be 0 or 1
Bool8 = OneOf(Int8ub, [0, 1])

# -- header -------------------------------------------------------------------------
HeaderFields = Struct(
    "magic" / Const(MAGIC),
    "version" / Int8ub,
    "opcode" / Int8ub,
    "request_id" / Int32ub,
    "body_len" / Int32ub,
)
#: 16 bytes: magic "SO" | version u8 | opcode u8 | request_id u32 | body_len u32 | header_crc u32
#: header_crc = CRC32C of the first 12 bytes.
Header = Struct(
    "fields" / RawCopy(HeaderFields),
    "header_crc" / Checksum(Int32ub, lambda data: crc32c(data), this.fields.data),
)

# -- bodies (each must be consumed exactly: Terminated) -----------------------------
ListEntryBody = Struct("name" / String, "length" / Int64ub, "sealed" / Bool8)

BODIES = {
    Op.HELLO: Struct("client" / String, "min_version" / Int8ub, "max_version" / Int8ub, Terminated),
    Op.HELLO_OK: Struct("version" / Int8ub, "nonce" / Bytes(32), "max_body" / Int32ub, "server" / String, Terminated),
    Op.AUTH: Struct("key_id" / Bytes(8), "namespace" / String, "proof" / Bytes(32), Terminated),
    Op.AUTH_OK: Struct("role" / OneOf(Int8ub, [1, 2, 3]), Terminated),
    Op.PING: Struct("payload" / Blob, Terminated),
    Op.PONG: Struct("payload" / Blob, Terminated),
    Op.LIST: Struct("prefix" / String, "after" / String, "limit" / Int32ub, Terminated),
    Op.LIST_OK: Struct("entries" / PrefixedArray(Int32ub, ListEntryBody), "more" / Bool8, Terminated),
    Op.STAT: Struct("name" / String, Terminated),
    Op.STAT_OK: Struct("length" / Int64ub, "sealed" / Bool8, Terminated),
    Op.APPEND: Struct(
        "name" / String, "offset" / Int64ub, "epoch" / Int64ub, "crc" / Int32ub, "data" / Blob, Terminated
    ),
    Op.APPEND_OK: Struct("length" / Int64ub, Terminated),
    Op.READ: Struct("name" / String, "offset" / Int64ub, "length" / Int64ub, Terminated),
    Op.READ_DATA: Struct("offset" / Int64ub, "last" / Bool8, "data" / Blob, Terminated),
    Op.SEAL: Struct("name" / String, "epoch" / Int64ub, Terminated),
    Op.SEAL_OK: Struct("length" / Int64ub, Terminated),
    Op.FENCE: Struct("epoch" / Int64ub, Terminated),
    Op.FENCE_OK: Struct("epoch" / Int64ub, Terminated),
    Op.TIER_WAIT: Struct("name" / String, "offset" / Int64ub, "timeout_ms" / Int32ub, Terminated),
    Op.TIER_WAIT_OK: Struct("tiered" / Int64ub, Terminated),
    Op.ERROR: Struct("code" / Int16ub, "length" / Int64ub, "message" / String, Terminated),
}
assert set(BODIES) == set(Op)


def build_header(opcode: int, request_id: int, body_len: int, version: int = VERSION) -> bytes:
    """The 16 header bytes, built by construct (the reference; the codec uses a fast path)."""
    header: bytes = Header.build(
        {"fields": {"value": {"version": version, "opcode": opcode, "request_id": request_id, "body_len": body_len}}}
    )
    return header
