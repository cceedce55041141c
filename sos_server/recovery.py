"""The start-up scan of an object file: rebuild its length and index, cut a torn tail,
keep and report damage. No protocol, no trio.

Start-up scans every object file (checksums over its last ``verify_tail`` bytes). It cuts
only a tail that a crash during an unacknowledged write can leave: fewer than 8 bytes of
a frame header, a frame the file ends inside of (no longer than an APPEND can be, and
with no whole frame ending the file), or nothing but zero bytes (a power loss). Anything
else is damage to bytes that may have been acknowledged, and is kept: a frame whose
checksum fails (also the last one), a frame length that lies, bytes after a seal. The
object keeps its length; READs of the damaged bytes answer CORRUPT; APPEND and SEAL to it
answer CORRUPT; the damage is logged at error level and listed in
:attr:`Storage.corruptions`. A length with one bad byte is recognized by the frame's own
checksum, so the frames after it stay readable; any other lying length makes the rest of
the file unreadable (frame boundaries are never guessed from frame-like bytes: journal
records inside frames are framed the same way) and the length an upper bound.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass
from typing import Literal

from sos_wire.crc import crc32c

from .durable import FILE_MODE, tighten
from .objfile import (
    FRAME,
    FRAME_HDR,
    MAX_APPEND_FRAME,
    MAX_FRAME,
    READ_BLOCK,
    SEAL_CRC,
    SEAL_FRAME,
    SEAL_LEN,
    decode_header,
    pread_all,
)
from .stored_object import Damage, StoredObject

__all__ = ["DEFAULT_VERIFY_TAIL", "RepairNote", "load_object", "read_object"]

log = logging.getLogger(__name__)

DEFAULT_VERIFY_TAIL = 64 << 20


def _all_zero(fd: int, pos: int, size: int) -> bool:
    """True if the file bytes [pos, size) are all zero (what a power loss can leave)."""
    while pos < size:
        b = os.pread(fd, min(size - pos, READ_BLOCK), pos)
        if not b:
            return True
        if b.count(0) != len(b):
            return False
        pos += len(b)
    return True


def _frame_ending_at(fd: int, target: int, lo: int) -> int | None:
    """The start q > lo of a whole frame [q, target) whose checksum matches, nearest first.

    A frame ``u32 n | u32 crc | data`` ends at *target* when ``n == target - q - 8``: for
    the positions q whose ``target - 8 - q`` shares its top three bytes, that is one
    3-byte pattern, so each 256 candidate positions cost one ``bytes.find``.

    The answer may be a record nested inside a frame's data (journal records are framed
    the same way), so it only says that *some* checksummed frame ends at *target*."""
    q_lo = max(lo + 1, target - FRAME_HDR - MAX_FRAME)
    q_hi = target - FRAME_HDR - 1  # n >= 1
    top = target - FRAME_HDR  # n == top - q
    while q_hi >= q_lo:
        base = max(q_lo, q_hi - READ_BLOCK)
        buf = os.pread(fd, q_hi + FRAME_HDR - base, base)  # headers of every q in [base, q_hi]
        g_first, g_last = (top - q_hi) >> 8, (top - base) >> 8
        for g in range(g_first, g_last + 1):  # nearest q first: n grows with g
            a = max(base, top - (g << 8) - 255)
            b = min(q_hi, top - (g << 8))
            pat = g.to_bytes(3, "big")
            hits = []
            i = buf.find(pat, a - base, b - base + 3)
            while i >= 0:
                q = base + i
                if buf[i + 3] == (top - q) & 0xFF:
                    hits.append(q)
                i = buf.find(pat, i + 1, b - base + 3)
            for q in reversed(hits):
                n = top - q
                (crc,) = struct.unpack_from(">I", buf, q - base + 4)
                if crc32c(pread_all(fd, n, q + FRAME_HDR)) == crc:
                    return q
        q_hi = base - 1
    return None


def _whole_frame_at(fd: int, t: int, size: int) -> bool:
    """True if a checksummed frame (or a seal) starts at file offset *t*, or t is the end."""
    if t == size:
        return True
    hdr = os.pread(fd, FRAME_HDR, t)
    if len(hdr) < FRAME_HDR:
        return False
    if hdr == SEAL_FRAME:
        return True
    n: int
    crc: int
    n, crc = FRAME.unpack(hdr)
    return 1 <= n <= MAX_FRAME and t + FRAME_HDR + n <= size and crc32c(pread_all(fd, n, t + FRAME_HDR)) == crc


def _length_confirmed(fd: int, pos: int, n: int, crc: int, size: int) -> int | None:
    """The end t of the frame at *pos* if its data [pos+8, t) matches its stored checksum
    although its stored length *n* says otherwise: the length field alone is damaged.

    Candidate ends: every length that differs from *n* in one byte, and the end of the
    file. The frame's own checksum decides (a false match has odds of 1 in 2^32)."""
    cands = {size}
    for k in range(4):
        shift = 8 * k
        for byte in range(256):
            n2 = (n & ~(0xFF << shift)) | (byte << shift)
            if 1 <= n2 <= MAX_FRAME:
                cands.add(pos + FRAME_HDR + n2)
    c = pos + FRAME_HDR
    value = 0
    for t in sorted(t for t in cands if pos + FRAME_HDR < t <= min(size, pos + FRAME_HDR + MAX_FRAME)):
        while c < t:
            b = os.pread(fd, min(t - c, READ_BLOCK * 4), c)
            value = crc32c(b, value)
            c += len(b)
        if value == crc:
            return t
    return None


#: what _examine says of bytes that are not a whole, checksummed frame (its docstring)
_Verdict = tuple[Literal["cut"], str] | tuple[Literal["frame"], int, str] | tuple[Literal["rest"], int, bool, str]


def _examine(fd: int, pos: int, n: int | None, crc: int | None, size: int) -> _Verdict:
    """What the bytes from *pos* (not a whole, checksummed frame) are. One of:

    ("cut", reason)                      a torn tail: nothing acknowledged is in it
    ("frame", end, reason)               one damaged frame [pos, end), its extent certain
    ("rest", data_bytes, sealed, reason) damaged from pos to the end of the file, frame
                                          structure unknown; data_bytes is an upper bound

    Frame boundaries after a damaged header are never guessed by looking for frame-like
    bytes further on: journal records inside the data are framed exactly like frames."""
    if _all_zero(fd, pos, size):
        return ("cut", "zero bytes (a power loss)")
    if n is None or crc is None:  # both or neither: the header was cut
        return ("cut", "partial frame header")
    t = _length_confirmed(fd, pos, n, crc, size)
    if t is not None:
        real = t - pos - FRAME_HDR
        return ("frame", t, f"frame length field damaged: it says {n}, the frame's data and checksum say {real}")
    plausible = 1 <= n <= MAX_FRAME
    if plausible and pos + FRAME_HDR + n <= size and _whole_frame_at(fd, pos + FRAME_HDR + n, size):
        return ("frame", pos + FRAME_HDR + n, "checksum mismatch")
    sealed = size - pos >= 2 * FRAME_HDR and os.pread(fd, FRAME_HDR, size - FRAME_HDR) == SEAL_FRAME
    whole_after = sealed or _frame_ending_at(fd, size, pos + FRAME_HDR) is not None
    if plausible and pos + FRAME_HDR + n > size and not whole_after and n <= MAX_APPEND_FRAME:
        return ("cut", "partial frame")
    if plausible and pos + FRAME_HDR + n <= size:
        why = "checksum mismatch, and no whole frame follows it"
    elif n == SEAL_LEN:
        why = "bad seal frame"
    else:
        why = f"bad frame length {n}"
    if whole_after:
        why += "; whole frames end the file"
    data = size - pos - FRAME_HDR - (FRAME_HDR if sealed else 0)
    return ("rest", max(0, data), sealed, why)


def _scan(
    fd: int, obj: StoredObject, size: int, verify_from: int
) -> tuple[StoredObject, int, int, str, list[Damage]] | None:
    """Walk the frames of an object file; (obj, end, length, cut reason, [Damage]), or None
    if a bad spot follows a frame whose checksum was not checked (before *verify_from*):
    that frame's length may be the lie that led here, so start again checking every
    checksum to find where the damage really starts."""
    pos, logical, cut = obj.header_size, 0, ""
    damage: list[Damage] = []
    trusted = True  # pos is known to be a frame boundary (the frame before it was checksummed)
    while pos < size:
        hdr = os.pread(fd, FRAME_HDR, pos)
        n = crc = None
        if len(hdr) == FRAME_HDR:
            n, crc = FRAME.unpack(hdr)
            if n == SEAL_LEN and crc == SEAL_CRC:
                obj.sealed, obj.seal_pos = True, pos
                pos += FRAME_HDR
                if pos < size:
                    if _all_zero(fd, pos, size):
                        cut = "zero bytes after the seal"
                    else:  # never part of the object (a sealed object takes no appends): kept, reported
                        damage.append(Damage(pos, size, logical, logical, "bytes after the seal"))
                        pos = size
                break
            if 1 <= n <= MAX_FRAME and pos + FRAME_HDR + n <= size:
                verified = pos + FRAME_HDR + n > verify_from
                if not verified or crc32c(pread_all(fd, n, pos + FRAME_HDR)) == crc:
                    obj._note_frame(logical, pos)
                    trusted = verified
                    logical += n
                    pos += FRAME_HDR + n
                    continue
        if not trusted and not _all_zero(fd, pos, size):
            return None
        verdict = _examine(fd, pos, n, crc, size)
        if verdict[0] == "cut":
            cut = verdict[1]
            break
        if verdict[0] == "frame":
            _, end, reason = verdict
            d = Damage(pos, end, logical, logical + end - pos - FRAME_HDR, reason)
            damage.append(d)
            logical, pos, trusted = d.end, end, True
            continue
        _, add, sealed, reason = verdict  # "rest": unknown structure up to the end
        d = Damage(pos, size, logical, logical + add, reason, to_end=True)
        damage.append(d)
        logical, pos = d.end, size
        if sealed:
            obj.sealed, obj.seal_pos = True, size - FRAME_HDR
    return obj, pos, logical, cut, damage


@dataclass
class RepairNote:
    """What start-up did to an object file (torn tail cut back)."""

    namespace: str
    name: str
    path: str
    kept_bytes: int
    cut_bytes: int
    reason: str


def load_object(
    namespace: str, path: str, verify_tail: int, repairs: list[RepairNote], corruptions: list[tuple[str, str, int]]
) -> StoredObject | None:
    """Scan an object file: rebuild its length and index, cut a torn tail, keep damage.

    Only what a crash during an unacknowledged write can leave is cut: fewer than 8
    bytes of a frame header, a frame the file ends inside of, or zero bytes (a power
    loss). Anything else that is not a whole frame is damage to stored, possibly
    acknowledged, bytes: it is kept and recorded (see :class:`Damage`)."""
    found = _scan_file(namespace, path, verify_tail, tighten_mode=True)
    if found is None:
        return None
    obj, pos, logical, cut, damage, size = found
    for d in damage:
        _report_damage(obj, d, corruptions)
    if pos < size:
        with open(path, "r+b") as f:
            f.truncate(pos)
            os.fsync(f.fileno())
        name = obj.name
        note = RepairNote(namespace, name, path, pos, size - pos, cut)
        repairs.append(note)
        log.warning(
            "torn tail cut back (a crash during an unacknowledged write): %s/%s (%s) kept %d bytes, cut %d: %s",
            namespace,
            name,
            path,
            pos,
            size - pos,
            note.reason,
        )
    obj.length = obj.synced_length = logical
    obj.file_size = obj.synced_size = pos
    obj._sync_points = (logical, pos)
    return obj


def read_object(namespace: str, path: str, verify_tail: int = DEFAULT_VERIFY_TAIL) -> StoredObject | None:
    """The object in *path* as :func:`load_object` finds it, without changing anything (no
    cut, no chmod, nothing logged): what a read-only look at a live data directory sees
    (``sos-server gc --dry-run``). A torn tail is left out of its length; damage is kept
    in ``obj.damage``. None if the file has no object header."""
    found = _scan_file(namespace, path, verify_tail, tighten_mode=False)
    if found is None:
        return None
    obj, pos, logical, _cut, damage, _size = found
    for d in damage:
        if d.end > d.start or d.to_end:
            obj.add_damage(d)
    obj.length = obj.synced_length = logical
    obj.file_size = obj.synced_size = pos
    obj._sync_points = (logical, pos)
    return obj


def _scan_file(
    namespace: str, path: str, verify_tail: int, *, tighten_mode: bool
) -> tuple[StoredObject, int, int, str, list[Damage], int] | None:
    """(object, end of its whole frames, logical length, why a tail is cut, damage, file size)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if tighten_mode:
            tighten(path, FILE_MODE, fd)
        head = os.pread(fd, 8 + 2 + 1024 * 4 + 4, 0)
        dec = decode_header(head)
        if dec is None:
            if tighten_mode:
                log.error("ignoring %s: not an SOS object file (bad header)", path)
            return None
        name, hsize = dec
        size = os.fstat(fd).st_size
        scan = _scan(fd, StoredObject(namespace, name, path, hsize), size, max(hsize, size - verify_tail))
        if scan is None:
            # something is wrong after frames that were only length-checked (before
            # verify_tail): one of them may be where it starts. Check every checksum.
            scan = _scan(fd, StoredObject(namespace, name, path, hsize), size, hsize)
            assert scan is not None  # every frame's checksum checked: each bad spot is where it is
    finally:
        os.close(fd)
    obj, pos, logical, cut, damage = scan
    return obj, pos, logical, cut, list(damage), size


def _report_damage(obj: StoredObject, d: Damage, corruptions: list[tuple[str, str, int]]) -> None:
    if d.end > d.start or d.to_end:
        obj.add_damage(d)
    corruptions.append((obj.namespace, obj.name, d.file_pos))
    if d.to_end:
        what = f"object bytes from {d.start} on (length counted as {d.end}; frames after it unknown)"
    elif d.end > d.start:
        what = f"object bytes {d.start}..{d.end}"
    else:
        what = "no object bytes"
    log.error(
        "damaged object file kept, not cut (READ of the damaged bytes answers CORRUPT; APPEND and SEAL are"
        " refused): %s/%s file offsets %d..%d, %s: %s (%s)",
        obj.namespace,
        obj.name,
        d.file_pos,
        d.file_end,
        what,
        d.reason,
        obj.path,
    )
