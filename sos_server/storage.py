"""Storage layer: objects as files of checksummed frames. No protocol, no trio.

Layout under the data directory::

    DATA/LOCK                                  flock held by a running server
    DATA/ns/<namespace>/fence                  fence epoch (decimal), replaced atomically
    DATA/ns/<namespace>/quota                  byte quota (decimal), optional, replaced atomically
    DATA/ns/<namespace>/keys/<key_id hex>      JSON {"namespace", "role", "secret" hex}
    DATA/ns/<namespace>/objects/<h2>/<h>       one object; h = sha256(name) hex, h2 = h[:2]

Every file is created 0600 and every directory 0700 (whatever the umask); start-up takes
group and other bits off object files and directories an older version created.

An object file is a header then frames::

    header: b"SOSOBJ1\\n" | u16 name_len | name utf-8 | u32 crc32c(everything before)
    frame:  u32 len | u32 crc32c(data) | data        (1 <= len <= MAX_FRAME)
    seal:   u32 0xFFFFFFFF | u32 SEAL_CRC            (last thing in a sealed object)

Files are created atomically (temp + fsync + rename + fsync dir), so a file either has a
whole header or does not exist. Appends go at the end of the file without a sync; the
engine calls :meth:`StoredObject.sync` (group commit) before acknowledging. Reads verify
every frame's checksum before returning its bytes.

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

Write descriptors: an object keeps its descriptor open between appends, but at most
``max_open_files`` of them are open (:class:`OpenFiles`, least recently used first closed).
Only a *clean* object's descriptor is closed (every byte written is synced) and never one
the engine pinned for a sync in progress, so durability and group commit do not change;
the next write reopens the file.

Names are hashed into file names so that any valid name (segments up to 255 bytes, an
object ``a`` beside an object ``a/b``) maps onto any POSIX filesystem; the name itself is
kept in the header and in memory for LIST.
"""

from __future__ import annotations

import bisect
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import stat
import struct
from array import array
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from sos_wire.crc import crc32c
from sos_wire.errors import ErrorCode
from sos_wire.frames import DEFAULT_MAX_BODY
from sos_wire.names import BadName, validate_name, validate_namespace

__all__ = [
    "MAX_EPOCH",
    "MAX_FRAME",
    "ROLE_APPEND",
    "ROLE_READ",
    "KeyRecord",
    "Namespace",
    "OpenFiles",
    "Storage",
    "StorageError",
    "StoredObject",
    "journal_generation",
    "segment_epoch",
]

log = logging.getLogger("sos_server.storage")

MAGIC = b"SOSOBJ1\n"
FRAME = struct.Struct(">II")
FRAME_HDR = FRAME.size
SEAL_LEN = 0xFFFFFFFF
SEAL_CRC = crc32c(b"SOS-SEAL")
SEAL_FRAME = FRAME.pack(SEAL_LEN, SEAL_CRC)
MAX_FRAME = 64 << 20  # larger than any body the protocol allows
MAX_APPEND_FRAME = DEFAULT_MAX_BODY  # no APPEND carries more data: a longer "torn" frame is damage
INDEX_EVERY = 256 << 10  # sparse index: one (logical, file) offset pair per ~256 KiB
READ_BLOCK = 1 << 20
DEFAULT_VERIFY_TAIL = 64 << 20
ROLE_APPEND = "append"
ROLE_READ = "read"
ROLES = (ROLE_APPEND, ROLE_READ)
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FILE_MODE = 0o600  # every file of the data directory: the server's user only
DIR_MODE = 0o700
DEFAULT_MAX_OPEN_FILES = 1024
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


class StorageError(Exception):
    """A typed failure: ``code`` is the wire ErrorCode, ``length`` the ERROR frame's u64."""

    def __init__(self, code: ErrorCode, message: str, length: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.length = length

    def __repr__(self) -> str:
        return f"StorageError({self.code.name}, {self.message!r}, length={self.length})"


def _no_space(what: str, exc: OSError) -> StorageError:
    return StorageError(ErrorCode.NO_SPACE, f"no space left on the server's disk while {what} ({exc.strerror})")


def _is_no_space(exc: OSError) -> bool:
    return exc.errno in _NO_SPACE_ERRNOS


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def makedirs_durable(path: str) -> None:
    """mkdir -p (mode 0700, whatever the umask), fsyncing each parent whose entry we created."""
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return
    parent = os.path.dirname(path)
    makedirs_durable(parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not os.path.isdir(path):  # a file (or a dangling link) where a directory belongs
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path) from None
        return
    os.chmod(path, DIR_MODE)  # the umask may have taken bits the server needs
    fsync_dir(parent)


def write_file_durable(path: str, data: bytes, mode: int = FILE_MODE) -> None:
    """Replace *path* atomically: write temp + fsync + rename + fsync dir. The file gets
    exactly *mode* (default 0600), whatever the umask."""
    d = os.path.dirname(path)
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(d)


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


def _tighten(path: str, mode: int, fd: int | None = None) -> None:
    """Take group and other permission bits off *path* (made by an older version, or by
    hand); a missing path or one the server may not chmod is left alone (logged)."""
    try:
        st = os.fstat(fd) if fd is not None else os.stat(path)
        if stat.S_IMODE(st.st_mode) & 0o077:
            if fd is not None:
                os.fchmod(fd, mode)
            else:
                os.chmod(path, mode)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("cannot restrict the permissions of %s to %o: %s", path, mode, exc.strerror)


def _pread(fd: int, n: int, pos: int) -> bytes:
    out = []
    while n > 0:
        b = os.pread(fd, min(n, READ_BLOCK * 8), pos)
        if not b:
            break
        out.append(b)
        n -= len(b)
        pos += len(b)
    return b"".join(out)


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
                if crc32c(_pread(fd, n, q + FRAME_HDR)) == crc:
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
    n, crc = FRAME.unpack(hdr)
    return 1 <= n <= MAX_FRAME and t + FRAME_HDR + n <= size and crc32c(_pread(fd, n, t + FRAME_HDR)) == crc


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


def _examine(fd: int, pos: int, n: int | None, crc: int | None, size: int) -> tuple:
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


def _scan(fd: int, obj: StoredObject, size: int, verify_from: int):
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
                if not verified or crc32c(_pread(fd, n, pos + FRAME_HDR)) == crc:
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


@dataclass
class Damage:
    """A stretch of an object file that start-up found damaged and kept.

    File bytes [file_pos, file_end) hold the object's logical bytes [start, end). When
    ``to_end`` is set the frame structure after file_pos is unknown: every byte from
    ``start`` on is unreadable and ``end`` is an upper bound (the object's length)."""

    file_pos: int
    file_end: int
    start: int
    end: int
    reason: str
    to_end: bool = False


class OpenFiles:
    """The write descriptors of objects: at most *capacity* open, least recently used
    closed first.

    Only a descriptor that can be closed without changing anything is closed: its object
    is clean (every byte written is synced) and not pinned by a sync in progress (the
    engine pins the objects of a group-commit batch). When every open descriptor is busy
    the cache goes over *capacity* for a while: the number of dirty objects is bounded by
    the writes in flight. Event-loop thread only."""

    def __init__(self, capacity: int = DEFAULT_MAX_OPEN_FILES) -> None:
        if capacity < 1:
            raise ValueError("max open files must be at least 1")
        self.capacity = capacity
        self._lru: OrderedDict[int, StoredObject] = OrderedDict()
        self.closed_by_limit = 0

    def __len__(self) -> int:
        return len(self._lru)

    def used(self, obj: StoredObject) -> None:
        """*obj* has an open descriptor and was just used: most recent, then trim."""
        key = id(obj)
        if key in self._lru:
            self._lru.move_to_end(key)
            return
        self._lru[key] = obj
        if len(self._lru) > self.capacity:
            self._trim(obj)

    def forget(self, obj: StoredObject) -> None:
        self._lru.pop(id(obj), None)

    def trim(self) -> None:
        """Close descriptors over *capacity* that have become closable (the engine calls
        this after each group commit, when dirty objects have become clean)."""
        if len(self._lru) > self.capacity:
            self._trim(None)

    def _trim(self, keep: StoredObject | None) -> None:
        for obj in list(self._lru.values()):
            if len(self._lru) <= self.capacity:
                return
            if obj is keep or obj.pins or obj.synced_size < obj.file_size:
                continue
            obj.close()  # calls forget()
            self.closed_by_limit += 1


@dataclass
class Usage:
    """Bytes held by a namespace's objects (their logical lengths, synced or not)."""

    bytes: int = 0


class StoredObject:
    """One object: a file (its write descriptor open while in use, see :class:`OpenFiles`)
    plus its in-memory length and sparse frame index.

    Not thread-safe by itself: the engine serializes appends per object, and reads only
    look at frames below a length they captured before starting.
    """

    def __init__(
        self,
        namespace: str,
        name: str,
        path: str,
        header_size: int,
        *,
        files: OpenFiles | None = None,
        usage: Usage | None = None,
    ) -> None:
        self.namespace = namespace
        self.name = name
        self.path = path
        self.header_size = header_size
        self.length = 0  # logical bytes written (not necessarily synced)
        self.file_size = header_size  # bytes of the file that belong to the object
        self.synced_size = header_size  # file bytes known durable
        self.synced_length = 0  # logical bytes known durable (what STAT/READ/LIST see)
        self.sealed = False
        self.seal_pos = -1  # file offset of the seal frame, -1 if unsealed
        self.rollbacks = 0  # bumped whenever unsynced bytes are cut back
        self.cuts: list[int] = []  # file size each rollback cut back to, in order
        self.sync_error: StorageError | None = None  # why the last rollback happened
        self._idx_logical = array("Q", [0])
        self._idx_file = array("Q", [header_size])
        self._fd: int | None = None
        # synced (logical, file) pairs so a rollback can restore the lengths exactly
        self._sync_points: tuple[int, int] = (0, header_size)
        self.damage: list[Damage] = []  # found at start-up, kept (see Storage._load_object)
        self._damage_at: dict[int, Damage] | None = None  # file offset -> damage starting there
        self._files = files
        self.usage = usage
        self.pins = 0  # > 0 while a sync may use the descriptor: OpenFiles does not close it

    # -- damage ----------------------------------------------------------------------
    def add_damage(self, d: "Damage") -> None:
        self.damage.append(d)
        if self._damage_at is None:
            self._damage_at = {}
        self._damage_at[d.file_pos] = d

    def refuse_writes(self, what: str) -> None:
        """StorageError(CORRUPT) if start-up found damage in this object: writing after
        damaged bytes (or sealing them in) would bury what an operator has to look at."""
        if self.damage:
            d = self.damage[0]
            raise StorageError(
                ErrorCode.CORRUPT,
                f"cannot {what} {self.namespace}/{self.name}: its stored data is damaged from byte {d.start}"
                f" (file offset {d.file_pos} of {self.path}: {d.reason}); the server kept the bytes and refuses"
                " appends and seals to it until an operator repairs or removes the file",
                self.length,
            )

    # -- file handle -----------------------------------------------------------------
    def _wfd(self) -> int:
        """The write descriptor (event-loop thread only: it updates the descriptor cache)."""
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        if self._files is not None:
            self._files.used(self)
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            if self._files is not None:
                self._files.forget(self)
            os.close(fd)

    # -- index -----------------------------------------------------------------------
    def _note_frame(self, logical: int, file_pos: int) -> None:
        if logical - self._idx_logical[-1] >= INDEX_EVERY:
            self._idx_logical.append(logical)
            self._idx_file.append(file_pos)

    def _truncate_index(self, logical: int) -> None:
        i = bisect.bisect_right(self._idx_logical, logical)
        # keep entries with idx_logical <= logical (their frames start within the object)
        del self._idx_logical[i:]
        del self._idx_file[i:]

    def _seek_point(self, offset: int) -> tuple[int, int]:
        i = bisect.bisect_right(self._idx_logical, offset) - 1
        return self._idx_logical[i], self._idx_file[i]

    # -- writes ----------------------------------------------------------------------
    def append(self, data: bytes, crc: int) -> int:
        """Write one frame at the end of the file (no sync). Returns the new length.

        ENOSPC/EDQUOT -> StorageError(NO_SPACE) with the file cut back to where it was.
        """
        n = len(data)
        if not 0 < n <= MAX_FRAME:
            raise StorageError(ErrorCode.TOO_LARGE, f"frame of {n} bytes for {self.name!r}")
        if self.sealed:
            raise StorageError(ErrorCode.SEALED, f"object {self.name!r} is sealed", self.length)
        self._write_at_end([FRAME.pack(n, crc), data], f"appending to {self.name!r}")
        pos = self.file_size
        self.file_size += FRAME_HDR + n
        self.length += n
        if self.usage is not None:
            self.usage.bytes += n
        self._note_frame(self.length - n, pos)
        return self.length

    def write_seal(self) -> None:
        if self.sealed:
            return
        self._write_at_end([SEAL_FRAME], f"sealing {self.name!r}")
        self.seal_pos = self.file_size
        self.file_size += FRAME_HDR
        self.sealed = True

    def _write_at_end(self, bufs: list, what: str) -> None:
        fd = self._wfd()
        start = self.file_size
        total = sum(len(b) for b in bufs)
        try:
            done = os.pwritev(fd, bufs, start)
            while done < total:  # short write: finish it
                rest = b"".join(bytes(b) for b in bufs)[done:]
                done += os.pwrite(fd, rest, start + done)
        except OSError as exc:
            try:
                os.ftruncate(fd, start)
            except OSError:
                log.exception("could not cut %s back to %d after a failed write", self.path, start)
            if _is_no_space(exc):
                raise _no_space(what, exc) from None
            raise StorageError(ErrorCode.INTERNAL, f"write failed while {what}: {exc.strerror}") from None

    def sync(self) -> tuple[int, int]:
        """fdatasync; returns the (file_size, length) that is now durable.

        Safe to call from a worker thread while the event loop appends more: whatever was
        written before the call is covered.
        """
        size, length = self.file_size, self.length
        fd = self._fd  # the caller pinned the object: OpenFiles does not close it meanwhile
        if fd is not None:
            os.fdatasync(fd)
            return size, length
        # closed while clean (OpenFiles): sync through a descriptor of our own, never
        # through the cache (this may run in a worker thread)
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
        return size, length

    def mark_synced(self, size: int, length: int) -> None:
        if size > self.synced_size:
            self.synced_size = size
            self.synced_length = length
            self._sync_points = (length, size)
        if self.sealed and self.synced_size > self.seal_pos:
            self.close()  # a durable seal: no more writes, give the descriptor back

    def rollback(self) -> None:
        """Cut unsynced bytes back after a failed sync (they were never acknowledged)."""
        length, size = self._sync_points
        fd = self._wfd()
        os.ftruncate(fd, size)
        self.file_size = size
        if self.usage is not None:
            self.usage.bytes -= self.length - length
        self.length = length
        if self.seal_pos >= size:
            self.sealed = False
            self.seal_pos = -1
        self._truncate_index(length)
        self.cuts.append(size)
        self.rollbacks += 1

    # -- reads -----------------------------------------------------------------------
    def read(self, offset: int, length: int, *, limit: int | None = None) -> Iterator[memoryview]:
        """Yield verified pieces of [offset, offset+length) (up to *limit*, default durable).

        Raises StorageError(CORRUPT) naming the object and the file offset of a frame whose
        checksum does not match, before yielding any of that frame's bytes.
        """
        end_limit = self.synced_length if limit is None else limit
        end = end_limit if length == 0 else min(offset + length, end_limit)
        if offset >= end:
            return
        logical, pos = self._seek_point(offset)
        damage = self._damage_at
        fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            buf = b""
            buf_pos = pos  # file offset of buf[0]
            while logical < end:
                if damage is not None and pos in damage:
                    d = damage[pos]
                    if d.end > offset:
                        raise self._corrupt(pos, f"damaged, found at start-up: {d.reason}")
                    logical, pos = d.end, d.file_end  # entirely before the range: skip it
                    continue
                rel = pos - buf_pos
                if rel + FRAME_HDR > len(buf):
                    buf = os.pread(fd, max(READ_BLOCK, FRAME_HDR), pos)
                    buf_pos, rel = pos, 0
                    if len(buf) < FRAME_HDR:
                        raise self._corrupt(pos, "file ends inside a frame header")
                n, crc = FRAME.unpack_from(buf, rel)
                if n == SEAL_LEN or n == 0 or n > MAX_FRAME:
                    raise self._corrupt(pos, f"bad frame length {n}")
                frame_end = logical + n
                if frame_end <= offset:  # frame entirely before the range: skip it
                    logical = frame_end
                    pos += FRAME_HDR + n
                    continue
                if rel + FRAME_HDR + n > len(buf):
                    buf = os.pread(fd, max(READ_BLOCK, FRAME_HDR + n), pos)
                    buf_pos, rel = pos, 0
                    if len(buf) < FRAME_HDR + n:
                        raise self._corrupt(pos, "file ends inside a frame")
                data = memoryview(buf)[rel + FRAME_HDR : rel + FRAME_HDR + n]
                if crc32c(data) != crc:
                    raise self._corrupt(pos, "checksum mismatch")
                lo = max(offset - logical, 0)
                hi = min(end - logical, n)
                yield data[lo:hi]
                logical = frame_end
                pos += FRAME_HDR + n
        finally:
            os.close(fd)

    def read_bytes(self, offset: int, length: int, *, limit: int | None = None) -> bytes:
        return b"".join(self.read(offset, length, limit=limit))

    def _corrupt(self, pos: int, why: str) -> StorageError:
        return StorageError(
            ErrorCode.CORRUPT,
            f"stored data of {self.namespace}/{self.name} is corrupt at file offset {pos} ({self.path}): {why}",
        )

    def mtime(self) -> float:
        return os.stat(self.path).st_mtime


@dataclass
class KeyRecord:
    key_id: bytes
    secret: bytes
    role: str
    namespace: str


@dataclass
class Namespace:
    name: str
    path: str
    fence: int = 0
    objects: dict[str, StoredObject] = field(default_factory=dict)
    _sorted: list[str] | None = None
    files: OpenFiles | None = None
    usage: Usage = field(default_factory=Usage)  # bytes held by the objects
    quota: int | None = None  # byte quota from the ``quota`` file, None: none set
    generations: dict[int, int] = field(default_factory=dict)  # journal generation -> objects in it

    @property
    def objects_dir(self) -> str:
        return os.path.join(self.path, "objects")

    def _added(self, obj: StoredObject) -> None:
        self.objects[obj.name] = obj
        self._sorted = None
        g = journal_generation(obj.name)
        if g is not None:
            self.generations[g] = self.generations.get(g, 0) + 1

    def newest_generation(self) -> int | None:
        """The highest journal generation G with an object under ``gen/<G>/``."""
        return max(self.generations, default=None)

    def read_quota(self) -> int | None:
        """(Re)read the ``quota`` file: the namespace's byte quota, None if there is none.
        A damaged file is StorageError(INTERNAL): guessing could let a tenant fill the disk."""
        path = os.path.join(self.path, "quota")
        try:
            with open(path, "rb") as f:
                text = f.read().strip()
        except FileNotFoundError:
            text = b""
        except OSError as exc:
            raise StorageError(ErrorCode.INTERNAL, f"cannot read the quota file {path}: {exc.strerror}") from None
        if not text:
            self.quota = None
            return None
        try:
            quota = int(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            quota = -1
        if quota < 0:
            raise StorageError(
                ErrorCode.INTERNAL,
                f"the quota file {path} is damaged ({text[:40]!r} is not a decimal byte count): rewrite it"
                " with `sos-server quota`",
            )
        self.quota = quota
        return quota

    def get(self, name: str) -> StoredObject | None:
        return self.objects.get(name)

    def names(self) -> list[str]:
        if self._sorted is None:
            self._sorted = sorted(self.objects)
        return self._sorted

    def list(self, prefix: str = "", after: str = "", limit: int = 1000) -> tuple[list[StoredObject], bool]:
        """Objects whose name starts with *prefix* and sorts after *after*, in name order."""
        names = self.names()
        i = bisect.bisect_left(names, prefix)
        if after:
            i = max(i, bisect.bisect_right(names, after))
        out: list[StoredObject] = []
        while i < len(names) and len(out) < limit:
            n = names[i]
            if not n.startswith(prefix):
                break
            out.append(self.objects[n])
            i += 1
        more = i < len(names) and names[i].startswith(prefix)
        return out, more

    def create(self, name: str) -> StoredObject:
        """Create an empty object durably (temp + fsync + rename + fsync dir)."""
        validate_name(name)
        if name in self.objects:
            return self.objects[name]
        return self.adopt(name, *self.create_file(name))

    def create_file(self, name: str) -> tuple[str, int]:
        """The file part of :meth:`create`: (path, header size). Touches no shared state,
        so it may run in a worker thread; :meth:`adopt` then runs on the event loop."""
        validate_name(name)
        h2, h = object_file_name(name)
        d = os.path.join(self.objects_dir, h2)
        path = os.path.join(d, h)
        header = encode_header(name)
        try:
            makedirs_durable(d)
            write_file_durable(path, header)
        except OSError as exc:
            if _is_no_space(exc):
                raise _no_space(f"creating {name!r}", exc) from None
            raise
        return path, len(header)

    def adopt(self, name: str, path: str, header_size: int) -> StoredObject:
        """Register the object whose file :meth:`create_file` made."""
        obj = StoredObject(self.name, name, path, header_size, files=self.files, usage=self.usage)
        self._added(obj)
        return obj

    def set_fence(self, epoch: int) -> None:
        try:
            write_file_durable(os.path.join(self.path, "fence"), f"{epoch}\n".encode())
        except OSError as exc:
            if _is_no_space(exc):
                raise _no_space("recording the fence epoch", exc) from None
            raise
        self.fence = epoch

    def remove(self, name: str) -> None:
        """Delete an object (retention only; the protocol has no delete)."""
        unlink_durable(self.forget(name))

    def forget(self, name: str) -> str:
        """Drop an object from memory (descriptor, usage, generations); returns its file's
        path for :func:`unlink_durable`. Event-loop thread only (the descriptor cache and
        the counters are not thread-safe); the unlink may run in a worker thread."""
        obj = self.objects.pop(name)
        self._sorted = None
        g = journal_generation(name)
        if g is not None:
            self.generations[g] -= 1
            if not self.generations[g]:
                del self.generations[g]
        self.usage.bytes -= obj.length
        obj.close()
        return obj.path


def unlink_durable(path: str) -> None:
    os.unlink(path)
    fsync_dir(os.path.dirname(path))


class Storage:
    """All namespaces under one data directory."""

    def __init__(
        self, root: str, *, verify_tail: int = DEFAULT_VERIFY_TAIL, max_open_files: int = DEFAULT_MAX_OPEN_FILES
    ) -> None:
        self.root = os.path.abspath(root)
        self.verify_tail = verify_tail
        self.files = OpenFiles(max_open_files)
        self.namespaces: dict[str, Namespace] = {}
        self.repairs: list[RepairNote] = []
        self.corruptions: list[tuple[str, str, int]] = []  # (namespace, name, file offset)
        self._lock_fd: int | None = None

    # -- process lock ----------------------------------------------------------------
    def lock(self, *, create: bool = True) -> None:
        """Take DATA/LOCK exclusively; StorageError(BUSY) if another process holds it.

        With ``create=False`` the data directory must already be one (have ``ns/`` or
        ``LOCK``): StorageError(NOT_FOUND) otherwise, and nothing is created. Any other
        problem with the directory is StorageError(INTERNAL) saying what."""
        try:
            if not create:
                if not os.path.isdir(self.root):
                    what = "is not a directory" if os.path.exists(self.root) else "does not exist"
                    raise StorageError(ErrorCode.NOT_FOUND, f"data directory {self.root} {what}")
                if not any(os.path.exists(os.path.join(self.root, n)) for n in ("ns", "LOCK")):
                    raise StorageError(
                        ErrorCode.NOT_FOUND,
                        f"{self.root} is not an sos-server data directory (no ns/ and no LOCK in it)",
                    )
            makedirs_durable(self.root)
            fd = os.open(os.path.join(self.root, "LOCK"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as exc:
            raise StorageError(
                ErrorCode.INTERNAL, f"cannot use data directory {self.root}: {exc.strerror or exc}"
                + (f" ({exc.filename})" if exc.filename and exc.filename != self.root else "")
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StorageError(
                ErrorCode.BUSY, f"data directory {self.root} is in use by another sos-server process"
            ) from None
        self._lock_fd = fd

    def close(self) -> None:
        for ns in self.namespaces.values():
            for obj in ns.objects.values():
                obj.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- namespaces ------------------------------------------------------------------
    def ns_path(self, namespace: str) -> str:
        return os.path.join(self.root, "ns", validate_namespace(namespace))

    def open(self) -> None:
        """Load every namespace on disk, repairing torn tails."""
        base = os.path.join(self.root, "ns")
        if not os.path.isdir(base):
            return
        for entry in sorted(os.listdir(base)):
            try:
                validate_namespace(entry)
            except BadName:
                log.warning("ignoring %s: not a namespace directory", os.path.join(base, entry))
                continue
            self.load_namespace(entry)

    def namespace(self, namespace: str, *, create: bool = False) -> Namespace | None:
        ns = self.namespaces.get(namespace)
        if ns is not None:
            return ns
        path = self.ns_path(namespace)
        if not os.path.isdir(path):
            if not create:
                return None
            makedirs_durable(os.path.join(path, "objects"))
            makedirs_durable(os.path.join(path, "keys"))
        return self.load_namespace(namespace)

    def object_count(self) -> int:
        """Objects in all loaded namespaces."""
        return sum(len(ns.objects) for ns in self.namespaces.values())

    def load_namespace(self, namespace: str) -> Namespace:
        path = self.ns_path(namespace)
        ns = Namespace(namespace, path, files=self.files)
        ns.read_quota()
        fence = os.path.join(path, "fence")
        try:
            with open(fence, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            text = b""
        except OSError as exc:
            raise StorageError(ErrorCode.INTERNAL, f"cannot read the fence file {fence}: {exc.strerror}") from None
        if text.strip():
            try:
                ns.fence = int(text.strip().decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                ns.fence = -1
            if ns.fence < 0:
                # guessing would let a fenced-off (stale) writer back in: refuse
                raise StorageError(
                    ErrorCode.INTERNAL,
                    f"the fence file {fence} is damaged ({text[:40]!r} is not a decimal epoch): restore it"
                    " or write the highest epoch any writer of the namespace used",
                )
        objdir = ns.objects_dir
        if os.path.isdir(objdir):
            for d in (path, objdir, os.path.join(path, "keys")):
                _tighten(d, DIR_MODE)
            for h2 in sorted(os.listdir(objdir)):
                d = os.path.join(objdir, h2)
                if not os.path.isdir(d):
                    continue
                _tighten(d, DIR_MODE)
                for fn in sorted(os.listdir(d)):
                    p = os.path.join(d, fn)
                    if ".tmp-" in fn:  # an object creation that did not finish
                        os.unlink(p)
                        continue
                    obj = self._load_object(namespace, p)
                    if obj is not None:
                        obj._files, obj.usage = self.files, ns.usage
                        ns.usage.bytes += obj.length
                        ns._added(obj)
        self.namespaces[namespace] = ns
        return ns

    def _load_object(self, namespace: str, path: str) -> StoredObject | None:
        """Scan an object file: rebuild its length and index, cut a torn tail, keep damage.

        Only what a crash during an unacknowledged write can leave is cut: fewer than 8
        bytes of a frame header, a frame the file ends inside of, or zero bytes (a power
        loss). Anything else that is not a whole frame is damage to stored, possibly
        acknowledged, bytes: it is kept and recorded (see :class:`Damage`)."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            _tighten(path, FILE_MODE, fd)
            head = os.pread(fd, 8 + 2 + 1024 * 4 + 4, 0)
            dec = decode_header(head)
            if dec is None:
                log.error("ignoring %s: not an SOS object file (bad header)", path)
                return None
            name, hsize = dec
            size = os.fstat(fd).st_size
            scan = _scan(fd, StoredObject(namespace, name, path, hsize), size, max(hsize, size - self.verify_tail))
            if scan is None:
                # something is wrong after frames that were only length-checked (before
                # verify_tail): one of them may be where it starts. Check every checksum.
                scan = _scan(fd, StoredObject(namespace, name, path, hsize), size, hsize)
        finally:
            os.close(fd)
        obj, pos, logical, cut, damage = scan
        for d in damage:
            self._report_damage(obj, d)
        if pos < size:
            with open(path, "r+b") as f:
                f.truncate(pos)
                os.fsync(f.fileno())
            note = RepairNote(namespace, name, path, pos, size - pos, cut)
            self.repairs.append(note)
            log.warning(
                "torn tail cut back (a crash during an unacknowledged write): %s/%s (%s) kept %d bytes, cut %d: %s",
                namespace, name, path, pos, size - pos, note.reason,
            )
        obj.length = obj.synced_length = logical
        obj.file_size = obj.synced_size = pos
        obj._sync_points = (logical, pos)
        return obj

    def _report_damage(self, obj: StoredObject, d: Damage) -> None:
        if d.end > d.start or d.to_end:
            obj.add_damage(d)
        self.corruptions.append((obj.namespace, obj.name, d.file_pos))
        if d.to_end:
            what = f"object bytes from {d.start} on (length counted as {d.end}; frames after it unknown)"
        elif d.end > d.start:
            what = f"object bytes {d.start}..{d.end}"
        else:
            what = "no object bytes"
        log.error(
            "damaged object file kept, not cut (READ of the damaged bytes answers CORRUPT; APPEND and SEAL are"
            " refused): %s/%s file offsets %d..%d, %s: %s (%s)",
            obj.namespace, obj.name, d.file_pos, d.file_end, what, d.reason, obj.path,
        )

    # -- per-namespace settings (offline tools and keygen) ---------------------------
    def set_quota(self, namespace: str, quota: int | None) -> None:
        """Write (or with None remove) the byte quota of *namespace*. A running server
        reads it at the next AUTH to the namespace."""
        validate_namespace(namespace)
        if quota is not None and quota < 0:
            raise ValueError(f"quota must not be negative, not {quota}")
        path = self.ns_path(namespace)
        makedirs_durable(os.path.join(path, "objects"))
        makedirs_durable(os.path.join(path, "keys"))
        if quota is None:
            try:
                os.unlink(os.path.join(path, "quota"))
            except FileNotFoundError:
                return
            fsync_dir(path)
        else:
            write_file_durable(os.path.join(path, "quota"), f"{quota}\n".encode())

    def get_quota(self, namespace: str) -> int | None:
        validate_namespace(namespace)
        return Namespace(namespace, self.ns_path(namespace)).read_quota()

    def object_names(self, namespace: str) -> Iterator[str]:
        """The names of *namespace*'s objects, from the file headers alone (no scan)."""
        objdir = os.path.join(self.ns_path(namespace), "objects")
        if not os.path.isdir(objdir):
            return
        for h2 in sorted(os.listdir(objdir)):
            d = os.path.join(objdir, h2)
            if not os.path.isdir(d):
                continue
            for fn in sorted(os.listdir(d)):
                if ".tmp-" in fn:
                    continue
                with open(os.path.join(d, fn), "rb") as f:
                    dec = decode_header(f.read(8 + 2 + 1024 * 4 + 4))
                if dec is not None:
                    yield dec[0]

    def reset_fence(self, namespace: str, epoch: int | None = None) -> tuple[str, int]:
        """Offline (lock held): set the fence of *namespace* to *epoch*, by default to the
        highest epoch in its segment names (the newest writer's: a writer that restarts
        FENCEs one above it). Works on a damaged fence file. Returns (old text, new)."""
        validate_namespace(namespace)
        path = self.ns_path(namespace)
        if not os.path.isdir(path):
            raise StorageError(ErrorCode.NOT_FOUND, f"no namespace {namespace!r} in {self.root}")
        if epoch is None:
            epoch = max((e for e in map(segment_epoch, self.object_names(namespace)) if e is not None), default=0)
        if not 0 <= epoch <= MAX_EPOCH:
            raise ValueError(f"epoch must be in 0..{MAX_EPOCH}, not {epoch}")
        try:
            with open(os.path.join(path, "fence"), "rb") as f:
                old = f.read().strip().decode("ascii", "replace") or "0"
        except FileNotFoundError:
            old = "0"
        Namespace(namespace, path).set_fence(epoch)
        return old, epoch

    # -- keys ------------------------------------------------------------------------
    def keygen(self, namespace: str, role: str) -> str:
        """Create a key for *namespace* with *role*; returns ``<key_id hex>.<secret hex>``."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        validate_namespace(namespace)
        key_id, secret = secrets.token_bytes(8), secrets.token_bytes(32)
        kdir = os.path.join(self.ns_path(namespace), "keys")
        makedirs_durable(kdir)
        makedirs_durable(os.path.join(self.ns_path(namespace), "objects"))
        body = json.dumps({"role": role, "secret": secret.hex(), "namespace": namespace}).encode()
        write_file_durable(os.path.join(kdir, key_id.hex()), body, mode=0o600)
        return f"{key_id.hex()}.{secret.hex()}"

    def get_key(self, namespace: str, key_id: bytes) -> KeyRecord | None:
        """The key *key_id* of *namespace*, read from disk (so keygen works while serving)."""
        try:
            validate_namespace(namespace)
        except BadName:
            return None
        path = os.path.join(self.ns_path(namespace), "keys", bytes(key_id).hex())
        try:
            with open(path, "rb") as f:
                rec = json.loads(f.read())
            return KeyRecord(bytes(key_id), bytes.fromhex(rec["secret"]), rec["role"], namespace)
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError) as exc:
            log.error("unreadable key file %s: %s", path, exc)
            return None

    def key_state(self, namespace: str, key_id: bytes) -> tuple[int, ...] | None:
        """A fingerprint of the key's file (one stat), None if it is gone. Sessions compare it
        before each request, so that removing or rewriting a key ends the sessions opened with it."""
        try:
            st = os.stat(os.path.join(self.ns_path(namespace), "keys", bytes(key_id).hex()))
        except (BadName, OSError):
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
