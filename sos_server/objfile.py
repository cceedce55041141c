"""The object file format and the journal names the server knows. No I/O but preads.

An object file is a header then frames::

    header: b"SOSOBJ1\\n" | u16 name_len | name utf-8 | u32 crc32c(everything before)
    frame:  u32 len | u32 crc32c(data) | data        (1 <= len <= MAX_FRAME)
    seal:   u32 0xFFFFFFFF | u32 SEAL_CRC            (last thing in a sealed object)

Names are hashed into file names so that any valid name (segments up to 255 bytes, an
object ``a`` beside an object ``a/b``) maps onto any POSIX filesystem; the name itself is
kept in the header and in memory for LIST.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct

from sos_wire.crc import crc32c
from sos_wire.frames import DEFAULT_MAX_BODY

__all__ = [
    "FRAME",
    "FRAME_HDR",
    "MAGIC",
    "MAX_APPEND_FRAME",
    "MAX_EPOCH",
    "MAX_FRAME",
    "READ_BLOCK",
    "SEAL_CRC",
    "SEAL_FRAME",
    "SEAL_LEN",
    "decode_header",
    "encode_header",
    "journal_generation",
    "object_file_name",
    "pread_all",
    "segment_epoch",
]

MAGIC = b"SOSOBJ1\n"
FRAME = struct.Struct(">II")
FRAME_HDR = FRAME.size
SEAL_LEN = 0xFFFFFFFF
SEAL_CRC = crc32c(b"SOS-SEAL")
SEAL_FRAME = FRAME.pack(SEAL_LEN, SEAL_CRC)
MAX_FRAME = 64 << 20  # larger than any body the protocol allows
MAX_APPEND_FRAME = DEFAULT_MAX_BODY  # no APPEND carries more data: a longer "torn" frame is damage
READ_BLOCK = 1 << 20
MAX_EPOCH = 10**10 - 1  # segment names carry the epoch in 10 decimal digits (protocol.md 2.1)

# Journal names (protocol.md Part 2, 2.1). The server knows them only to enforce the
# generation rules and for retention: a generation directory is ``gen/<10 digits>/``.
_GEN_NAME = re.compile(r"gen/([0-9]{10})/(.+)\Z")
_SEG_NAME = re.compile(r"gen/[0-9]{10}/[0-9]{10}-([0-9]{10})\.seg\Z")


def journal_generation(name: str) -> int | None:
    """G if *name* lies in a journal generation directory ``gen/<G>/`` (G: 10 digits)."""
    m = _GEN_NAME.match(name)
    return int(m.group(1)) if m else None


def segment_epoch(name: str) -> int | None:
    """E if *name* is a journal segment ``gen/<G>/<S>-<E>.seg``."""
    m = _SEG_NAME.match(name)
    return int(m.group(1)) if m else None


def object_file_name(name: str) -> tuple[str, str]:
    h = hashlib.sha256(name.encode("utf-8")).hexdigest()
    return h[:2], h


def encode_header(name: str) -> bytes:
    raw = name.encode("utf-8")
    head = MAGIC + struct.pack(">H", len(raw)) + raw
    return head + struct.pack(">I", crc32c(head))


def decode_header(buf: bytes) -> tuple[str, int] | None:
    """(name, header size) or None when *buf* does not start with a valid header."""
    if len(buf) < len(MAGIC) + 2 or not buf.startswith(MAGIC):
        return None
    (n,) = struct.unpack_from(">H", buf, len(MAGIC))
    end = len(MAGIC) + 2 + n
    if len(buf) < end + 4:
        return None
    (crc,) = struct.unpack_from(">I", buf, end)
    if crc32c(buf[:end]) != crc:
        return None
    try:
        return buf[len(MAGIC) + 2 : end].decode("utf-8"), end + 4
    except UnicodeDecodeError:
        return None


def pread_all(fd: int, n: int, pos: int) -> bytes:
    out = []
    while n > 0:
        b = os.pread(fd, min(n, READ_BLOCK * 8), pos)
        if not b:
            break
        out.append(b)
        n -= len(b)
        pos += len(b)
    return b"".join(out)
