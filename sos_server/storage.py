"""Storage layer: namespaces of objects under one data directory. No protocol, no trio.

Layout under the data directory::

    DATA/LOCK                                  flock held by a running server
    DATA/wal/<16 digits>.log                   the shared write-ahead log (sos_server.wal)
    DATA/retention                             optional retention settings (JSON), replaced atomically
    DATA/ns/<namespace>/fence                  fence epoch (decimal), replaced atomically
    DATA/ns/<namespace>/quota                  byte quota (decimal), optional, replaced atomically
    DATA/ns/<namespace>/keys/<key_id hex>      JSON {"namespace", "role", "secret" hex}
    DATA/ns/<namespace>/objects/<h2>/<h>       one object; h = sha256(name) hex, h2 = h[:2]

Every file is created 0600 and every directory 0700 (whatever the umask); start-up takes
group and other bits off object files and directories an older version created.

The parts, one module each: :mod:`.durable` (durable file helpers, the typed
StorageError), :mod:`.objfile` (the object file format, journal names), :mod:`.recovery`
(the start-up scan: torn tails cut, damage kept), :mod:`.stored_object` (one object and
the descriptor cache), :mod:`.keys` (namespace keys), :mod:`.wal` (the write-ahead log),
and here the namespaces and the data directory. The names tests and tools import from
here (``Storage``, ``StorageError``, ``StoredObject``, ``FRAME``...) stay importable here.
"""

from __future__ import annotations

import bisect
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field

from sos_wire.errors import ErrorCode
from sos_wire.names import BadName, validate_name, validate_namespace

from .durable import (
    DIR_MODE,
    FILE_MODE,
    StorageError,
    fsync_dir,
    is_no_space,
    makedirs_durable,
    no_space,
    tighten,
    unlink_durable,
    write_file_durable,
)
from .keys import ROLE_APPEND, ROLE_READ, ROLE_TOKEN, ROLES, KeyRecord, KeyStore
from .objfile import (
    FRAME,
    FRAME_HDR,
    MAX_EPOCH,
    MAX_FRAME,
    SEAL_FRAME,
    SEAL_LEN,
    decode_header,
    encode_header,
    journal_generation,
    object_file_name,
    segment_epoch,
)
from .recovery import DEFAULT_VERIFY_TAIL, RepairNote, load_object, read_object
from .stored_object import DEFAULT_MAX_OPEN_FILES, Damage, OpenFiles, StoredObject, Usage
from .wal import DEFAULT_CHECKPOINT_BYTES, ReplayNote, WriteAheadLog, replay

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "FRAME",
    "FRAME_HDR",
    "MAX_EPOCH",
    "MAX_FRAME",
    "OBJECT_CHARGE",
    "ROLES",
    "ROLE_APPEND",
    "ROLE_READ",
    "ROLE_TOKEN",
    "SEAL_FRAME",
    "SEAL_LEN",
    "Damage",
    "KeyRecord",
    "Namespace",
    "OpenFiles",
    "RepairNote",
    "Retention",
    "Storage",
    "StorageError",
    "StoredObject",
    "Usage",
    "decode_header",
    "encode_header",
    "fsync_dir",
    "journal_generation",
    "object_file_name",
    "segment_epoch",
    "unlink_durable",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """Retention settings: the newest *keep_generations* complete generations are kept, older
    ones go once complete for *min_age* seconds (engine.plan_retention)."""

    keep_generations: int
    min_age: float


#: what one object costs a namespace's byte quota besides its data (protocol.md 1.9): its
#: file's filesystem block (the header with the name, up to 1,038 bytes, sits in it), inode
#: and directory entry. Without it a tenant with a 64 KiB quota filled a 24 MiB disk with
#: 5,883 empty objects (~4.4 KB each on disk).
OBJECT_CHARGE = 4096


@dataclass
class Namespace:
    name: str
    path: str
    fence: int = 0
    objects: dict[str, StoredObject] = field(default_factory=dict)
    _sorted: list[str] | None = None
    files: OpenFiles | None = None
    wal: WriteAheadLog[StoredObject] | None = None  # the server's write-ahead log (None offline)
    usage: Usage = field(default_factory=Usage)  # bytes held by the objects
    quota: int | None = None  # byte quota from the ``quota`` file, None: none set
    #: the ``quota`` file's fingerprint when it was last read (False: never read; None: no file)
    _quota_state: tuple[int, ...] | bool | None = False
    creating: int = 0  # objects being created (their files are being written): the caps count them
    reserved: int = 0  # quota bytes of the objects being created (OBJECT_CHARGE and their data)
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

    def charged(self) -> int:
        """What the namespace's byte quota counts: its objects' data bytes plus
        ``OBJECT_CHARGE`` per object (and the reservations of objects being created)."""
        return self.usage.bytes + OBJECT_CHARGE * len(self.objects) + self.reserved

    @property
    def quota_path(self) -> str:
        path = self.__dict__.get("_quota_path")
        if path is None:  # built once: APPENDs stat it
            path = self.__dict__["_quota_path"] = os.path.join(self.path, "quota")
        return path

    def _quota_stat(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.quota_path)
        except FileNotFoundError:
            return None
        except OSError:
            return (-1,)  # read_quota says what is wrong
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def current_quota(self) -> int | None:
        """The byte quota, re-read if the ``quota`` file changed since it was last read (one
        stat): `sos-server quota` binds connections already open at their next APPEND."""
        if self._quota_stat() != self._quota_state:
            self.read_quota()
        return self.quota

    def peek_quota(self) -> int | None:
        """The byte quota as the ``quota`` file says now, changing nothing (another thread
        may call it: the metrics endpoint); the last value read if the file is unreadable."""
        try:
            with open(self.quota_path, "rb") as f:
                text = f.read(64).strip()
        except FileNotFoundError:
            return None
        except OSError:
            return self.quota
        try:
            return int(text.decode("ascii")) if text else None
        except (UnicodeDecodeError, ValueError):
            return self.quota

    def read_quota(self) -> int | None:
        """(Re)read the ``quota`` file: the namespace's byte quota, None if there is none.
        A damaged file is StorageError(INTERNAL): guessing could let a tenant fill the disk."""
        path = self.quota_path
        self._quota_state = self._quota_stat()  # before reading: a change after it is seen next time
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
            if is_no_space(exc):
                raise no_space(f"creating {name!r}", exc) from None
            raise
        return path, len(header)

    def adopt(self, name: str, path: str, header_size: int) -> StoredObject:
        """Register the object whose file :meth:`create_file` made."""
        obj = StoredObject(self.name, name, path, header_size, files=self.files, usage=self.usage)
        obj.wal = self.wal
        self._added(obj)
        return obj

    def set_fence(self, epoch: int) -> None:
        try:
            write_file_durable(os.path.join(self.path, "fence"), f"{epoch}\n".encode())
        except OSError as exc:
            if is_no_space(exc):
                raise no_space("recording the fence epoch", exc) from None
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
        obj.removed = True  # its log records are skipped at replay (wal.py)
        obj.close_if_done()  # now, or when a checkpoint's sync of it is over
        return obj.path


class Storage(KeyStore):
    """All namespaces under one data directory."""

    def __init__(
        self,
        root: str,
        *,
        verify_tail: int = DEFAULT_VERIFY_TAIL,
        max_open_files: int = DEFAULT_MAX_OPEN_FILES,
        wal_checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES,
    ) -> None:
        self.root = os.path.abspath(root)
        self.verify_tail = verify_tail
        self.files = OpenFiles(max_open_files)
        self.namespaces: dict[str, Namespace] = {}
        self.repairs: list[RepairNote] = []
        self.corruptions: list[tuple[str, str, int]] = []  # (namespace, name, file offset)
        self.wal: WriteAheadLog[StoredObject] | None = None  # started by start_wal (the engine), None offline
        self.wal_checkpoint_bytes = wal_checkpoint_bytes
        self.replayed = ReplayNote()
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
                ErrorCode.INTERNAL,
                f"cannot use data directory {self.root}: {exc.strerror or exc}"
                + (f" ({exc.filename})" if exc.filename and exc.filename != self.root else ""),
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
        """Checkpoint the write-ahead log (objects synced, log files deleted), close."""
        if self.wal is not None:
            wal, self.wal = self.wal, None
            wal.close_checkpoint(wal.live_objects())
            for lf in (wal.current, wal.spare):
                if lf is not None:
                    lf.close()
            for ns in self.namespaces.values():
                ns.wal = None
                for obj in ns.objects.values():
                    obj.wal = None
        for ns in self.namespaces.values():
            for obj in ns.objects.values():
                obj.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- namespaces ------------------------------------------------------------------
    def ns_path(self, namespace: str) -> str:
        return os.path.join(self.root, "ns", validate_namespace(namespace))

    def _ns_root(self) -> str:
        return os.path.join(self.root, "ns")

    def open(self) -> None:
        """Replay the write-ahead log onto the object files, then load every namespace on
        disk, repairing torn tails."""
        self.replayed = replay(self.wal_dir, self.object_path)
        for namespace, name, path, kept, cut in self.replayed.cuts:
            note = RepairNote(namespace, name, path, kept, cut, "written after its last log record")
            self.repairs.append(note)
            log.warning(
                "torn tail cut back (a crash during an unacknowledged write): %s/%s (%s) kept %d bytes, cut %d: %s",
                namespace,
                name,
                path,
                kept,
                cut,
                note.reason,
            )
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

    @property
    def wal_dir(self) -> str:
        return os.path.join(self.root, "wal")

    def object_path(self, namespace: str, name: str) -> str:
        h2, h = object_file_name(name)
        return os.path.join(self.ns_path(namespace), "objects", h2, h)

    def start_wal(self) -> WriteAheadLog[StoredObject]:
        """Start logging every object write (the server does, before it serves). The log
        must have been replayed (:meth:`open`) if a crash left one. StorageError
        (NO_SPACE or INTERNAL) if its files cannot be made."""
        if self.wal is None:
            try:
                self.wal = WriteAheadLog(self.wal_dir, checkpoint_bytes=self.wal_checkpoint_bytes)
            except OSError as exc:
                if is_no_space(exc):
                    raise no_space("creating the write-ahead log", exc) from None
                raise StorageError(
                    ErrorCode.INTERNAL, f"cannot create the write-ahead log in {self.wal_dir}: {exc.strerror}"
                ) from None
            for ns in self.namespaces.values():
                ns.wal = self.wal
                for obj in ns.objects.values():
                    obj.wal = self.wal
        return self.wal

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
        """Objects in all loaded namespaces (those being created too)."""
        return sum(len(ns.objects) + ns.creating for ns in self.namespaces.values())

    def load_namespace(self, namespace: str) -> Namespace:
        path = self.ns_path(namespace)
        ns = Namespace(namespace, path, files=self.files, wal=self.wal)
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
                tighten(d, DIR_MODE)
            for h2 in sorted(os.listdir(objdir)):
                d = os.path.join(objdir, h2)
                if not os.path.isdir(d):
                    continue
                tighten(d, DIR_MODE)
                for fn in sorted(os.listdir(d)):
                    p = os.path.join(d, fn)
                    if ".tmp-" in fn:  # an object creation that did not finish
                        os.unlink(p)
                        continue
                    obj = load_object(namespace, p, self.verify_tail, self.repairs, self.corruptions)
                    if obj is not None:
                        obj._files, obj.usage, obj.wal = self.files, ns.usage, self.wal
                        obj.checkpointed_size = obj.file_size
                        ns.usage.bytes += obj.length
                        ns._added(obj)
        self.namespaces[namespace] = ns
        return ns

    # -- per-namespace settings (offline tools and keygen) ---------------------------
    def set_quota(self, namespace: str, quota: int | None) -> None:
        """Write (or with None remove) the byte quota of *namespace*. A running server
        applies it from the next APPEND to the namespace, on connections already open too
        (the file is replaced, so its stat changes: :meth:`Namespace.current_quota`)."""
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

    def read_only_namespaces(self) -> list[Namespace]:
        """Every namespace with its objects as their files hold them now, changing nothing and
        taking no lock (no log replay, no torn tail cut, no checksum read: lengths from the
        frame headers): what ``gc --dry-run`` plans on, also while the server runs."""
        base = self._ns_root()
        out: list[Namespace] = []
        if not os.path.isdir(base):
            return out
        for entry in sorted(os.listdir(base)):
            try:
                validate_namespace(entry)
            except BadName:
                continue
            ns = Namespace(entry, os.path.join(base, entry))
            objdir = ns.objects_dir
            for h2 in sorted(os.listdir(objdir)) if os.path.isdir(objdir) else ():
                d = os.path.join(objdir, h2)
                if not os.path.isdir(d):
                    continue
                for fn in sorted(os.listdir(d)):
                    if ".tmp-" in fn:
                        continue
                    try:
                        obj = read_object(entry, os.path.join(d, fn), verify_tail=0)
                    except FileNotFoundError:  # removed by the server's retention meanwhile
                        continue
                    if obj is not None:
                        ns.usage.bytes += obj.length
                        ns._added(obj)
            out.append(ns)
        return out

    # -- retention settings (``sos-server retention``; the server re-reads them) ----------
    @property
    def retention_path(self) -> str:
        return os.path.join(self.root, "retention")

    def read_retention(self) -> Retention | None:
        """The settings of ``DATA/retention``, None without the file. A damaged file is
        StorageError(INTERNAL) saying what: guessing could remove generations."""
        path = self.retention_path
        try:
            with open(path, "rb") as f:
                text = f.read(4096)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(ErrorCode.INTERNAL, f"cannot read {path}: {exc.strerror}") from None
        try:
            rec = json.loads(text)
            keep, min_age = rec["keep_generations"], rec["min_age"]
            if (
                not isinstance(keep, int)
                or isinstance(keep, bool)
                or keep < 1
                or not isinstance(min_age, (int, float))
                or isinstance(min_age, bool)
                or not min_age >= 0
            ):
                raise ValueError(f"keep_generations {keep!r} (an integer >= 1), min_age {min_age!r} (seconds >= 0)")
        except (ValueError, KeyError, TypeError) as exc:
            raise StorageError(
                ErrorCode.INTERNAL,
                f"the retention file {path} is damaged ({exc}): rewrite it with `sos-server retention`",
            ) from None
        return Retention(keep, float(min_age))

    def write_retention(self, retention: Retention | None) -> None:
        """Write (or with None remove) ``DATA/retention``; a running server applies it at its
        next retention round, or at once on SIGHUP."""
        makedirs_durable(self.root)
        if retention is None:
            try:
                os.unlink(self.retention_path)
            except FileNotFoundError:
                return
            fsync_dir(self.root)
            return
        body = {"keep_generations": retention.keep_generations, "min_age": retention.min_age}
        write_file_durable(self.retention_path, (json.dumps(body) + "\n").encode())

    def usage(self, namespace: str) -> tuple[int, int]:
        """(objects, data bytes) of *namespace* from its files, read-only (no lock, nothing
        repaired: safe while the server runs; a write in progress may count or not). An
        object's data bytes are its frames' lengths up to its seal, its end or the first
        frame that does not fit the file; what the byte quota charges is data bytes plus
        ``OBJECT_CHARGE`` per object."""
        objdir = os.path.join(self.ns_path(namespace), "objects")
        objects = data = 0
        if not os.path.isdir(objdir):
            return 0, 0
        for h2 in sorted(os.listdir(objdir)):
            d = os.path.join(objdir, h2)
            if not os.path.isdir(d):
                continue
            for fn in sorted(os.listdir(d)):
                if ".tmp-" in fn:
                    continue
                try:
                    n = _data_bytes(os.path.join(d, fn))
                except FileNotFoundError:  # removed by retention meanwhile
                    continue
                if n is not None:
                    objects += 1
                    data += n
        return objects, data

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


def _data_bytes(path: str) -> int | None:
    """The data bytes of the object file *path* by its frame headers (None: no object header)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        dec = decode_header(os.pread(fd, 8 + 2 + 1024 * 4 + 4, 0))
        if dec is None:
            return None
        pos, total = dec[1], 0
        while pos + FRAME_HDR <= size:
            n, _crc = FRAME.unpack(os.pread(fd, FRAME_HDR, pos))
            if n == SEAL_LEN or n == 0 or n > MAX_FRAME or pos + FRAME_HDR + n > size:
                break
            total += n
            pos += FRAME_HDR + n
        return total
    finally:
        os.close(fd)
