"""The local spool: on-disk segment files mirroring the server's segment objects.

    <spool_dir>/LOCK                              flock()ed by the one writer using the spool
    <spool_dir>/gen/<G>/<S>-<E>.seg               records appended by the writer, same name as
                                                  the server object they are shipped to
    <spool_dir>/gen/<G>/snapshot_end              decimal seq of generation G's SNAPSHOT_END

The spool is the source of truth after a crash of the writer: every record is written
here before ``append`` returns; the replicator ships what the server does not have yet.
Segments are deleted locally once sealed on the server (never the newest one).

The spool holds whatever was written through the tree, so it is private whatever the
umask: directories 0700, files 0600 (:func:`private_dir`, :func:`private_file`; files and
directories a spool made before are narrowed when it is opened).
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from sos_journal.errors import JournalCorrupt, JournalError
from sos_journal.format import layout
from sos_journal.format.records import RecordDecoder
from sos_wire.events import Payload

_READ = 1 << 20
FILE_MODE = 0o600
DIR_MODE = 0o700


def private_dir(path: str) -> str:
    """Create ``path`` (and missing parents) if needed; make ``path`` itself 0700 exactly."""
    os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    if os.stat(path).st_mode & 0o7777 != DIR_MODE:
        os.chmod(path, DIR_MODE)
    return path


def open_private(path: str, flags: int) -> int:
    """``os.open`` with O_CREAT and mode 0600 exactly (whatever the umask; an existing file
    is narrowed to 0600). Never follows a symbolic link at ``path``."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o7777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def private_file(path: str, text: str) -> None:
    """Replace ``path`` atomically with ``text``, as a 0600 file."""
    tmp = path + ".tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = open_private(tmp, os.O_WRONLY | os.O_TRUNC | os.O_EXCL)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class SpoolSegment:
    """One local segment file. ``written`` counts whole records only."""

    def __init__(self, spool: Spool, sn: layout.SegmentName, path: str, written: int):
        self.spool = spool
        self.generation = sn.generation
        self.first_seq = sn.first_seq
        self.epoch = sn.epoch
        self.name = sn.name
        self.path = path
        self.written = written
        self.shipped = -1  # server length; -1 = not known yet (ask the server)
        self.confirmed = 0  # the server's bytes [0, confirmed) are known to be these (acked to us)
        self.boundary = 0  # a record boundary <= shipped (where header walks may start)
        self.last_seq = sn.first_seq - 1
        self.last_time = 0
        self.last_key_id = b""  # the last record's key fingerprint and tag (authenticated: protocol.md 2.5)
        self.last_tag = b""
        self.records = 0
        self.fd = open_private(path, os.O_RDWR | os.O_APPEND)

    def write(self, data: Payload) -> None:
        view = memoryview(data)
        while view:
            n = os.write(self.fd, view)
            view = view[n:]
        self.written += len(data)

    def pread(self, n: int, offset: int) -> bytes:
        out = os.pread(self.fd, n, offset)
        if len(out) != n:
            raise JournalError(f"spool file {self.path} shorter than expected ({len(out)} of {n} bytes at {offset})")
        return out

    def next_boundary(self, pos: int) -> tuple[int, int | None]:
        """(first record boundary >= pos, seq of the record ending there or None), walking
        record headers from ``self.boundary`` (a known boundary <= pos)."""
        b = self.boundary if self.boundary <= pos else 0
        seq = None
        while b < pos:
            head = self.pread(25, b)
            length = int.from_bytes(head[:4], "big")
            seq = int.from_bytes(head[9:17], "big")
            if length < 17:
                raise JournalError(f"spool segment {self.path}: bad record length at offset {b}")
            b += 8 + length
        return b, seq

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __repr__(self) -> str:
        return f"<SpoolSegment {self.name} written={self.written} shipped={self.shipped}>"


class Spool:
    def __init__(self, directory: str):
        self.dir = os.path.abspath(directory)
        private_dir(self.dir)
        private_dir(os.path.join(self.dir, "gen"))
        self._lock_fd = open_private(os.path.join(self.dir, "LOCK"), os.O_RDWR)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise JournalError(f"spool {self.dir} is in use by another writer") from None

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def path_of(self, name: str) -> str:
        return os.path.join(self.dir, *name.split("/"))

    def scan(self) -> list[SpoolSegment]:
        """Local segments in journal order (generation, first seq)."""
        found = []
        gdir = os.path.join(self.dir, "gen")
        for g in os.listdir(gdir):
            sub = os.path.join(gdir, g)
            if os.path.islink(sub) or not os.path.isdir(sub):
                continue
            private_dir(sub)  # (a spool made before spools were private)
            for f in os.listdir(sub):
                sn = layout.parse_segment_name(f"gen/{g}/{f}")
                if sn is not None:
                    path = os.path.join(sub, f)
                    found.append((sn, path, os.path.getsize(path)))
        found.sort(key=lambda t: (t[0].generation, t[0].first_seq, t[0].epoch))
        return [SpoolSegment(self, sn, path, size) for sn, path, size in found]

    def create(self, generation: int, first_seq: int, epoch: int) -> SpoolSegment:
        sn = layout.SegmentName(generation, first_seq, epoch)
        path = self.path_of(sn.name)
        private_dir(os.path.dirname(path))
        if os.path.exists(path) and os.path.getsize(path):
            raise JournalError(f"spool segment {path} already exists")
        return SpoolSegment(self, sn, path, 0)

    def remove(self, seg: SpoolSegment) -> None:
        seg.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(seg.path)

    def repair(self, seg: SpoolSegment) -> None:
        """Decode the whole local file; cut a torn or corrupt tail; set last_seq/records.

        A writer killed in the middle of a write leaves a partial record at the end; the
        replicator only ever ships whole records, so cutting it loses nothing acked.
        """
        dec = RecordDecoder(seg.name)
        good = 0
        last = seg.first_seq - 1
        n = 0
        off = 0
        try:
            while off < seg.written:
                chunk = os.pread(seg.fd, min(_READ, seg.written - off), off)
                if not chunk:
                    break
                off += len(chunk)
                dec.feed(chunk)
                for rec in dec:
                    last = rec.seq
                    seg.last_time = rec.time_ns
                    seg.last_key_id, seg.last_tag = rec.key_id, rec.tag
                    n += 1
                    good = dec.offset
        except JournalCorrupt:
            pass
        if good != seg.written:
            os.ftruncate(seg.fd, good)
            seg.written = good
        seg.last_seq = last
        seg.records = n

    # -- snapshot_end markers -------------------------------------------------------
    def _marker(self, generation: int) -> str:
        return os.path.join(self.dir, "gen", f"{generation:010d}", "snapshot_end")

    def set_snapshot_end(self, generation: int, seq: int) -> None:
        path = self._marker(generation)
        private_dir(os.path.dirname(path))
        private_file(path, str(seq))

    def snapshot_ends(self) -> dict[int, int]:
        out = {}
        gdir = os.path.join(self.dir, "gen")
        for g in os.listdir(gdir):
            p = os.path.join(gdir, g, "snapshot_end")
            try:
                with open(p) as f:
                    out[int(g)] = int(f.read().strip())
            except (FileNotFoundError, ValueError):
                continue
        return out

    def drop_snapshot_end(self, generation: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._marker(generation))
