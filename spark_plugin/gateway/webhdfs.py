"""WebHDFS semantics over a journaled namespace, without HTTP: what `sos gateway` serves.

:class:`WebHdfsNamespace` answers the WebHDFS operations Hadoop's ``WebHdfsFileSystem``
uses (paths, JSON documents and exceptions as HDFS's NameNode and DataNode produce them)
on top of an opened namespace (:func:`sos_client.journal.open.open_namespace`). Every
method is blocking: the HTTP layer (:mod:`spark_plugin.gateway`) runs them in worker
threads. Failures are :class:`WebHdfsError` with the HTTP status, the Java exception
class and a message, exactly as HDFS reports them (``{"RemoteException": {...}}``).

Concurrency: compound metadata operations (MKDIRS, RENAME, DELETE, the start of a CREATE
or APPEND) hold :attr:`WebHdfsNamespace.lock` for their check-then-change, never while a
request body streams nor while waiting for the server. A file being written (CREATE or
APPEND body streaming) holds a lease: a second writer of the same path is refused with
AlreadyBeingCreatedException, as HDFS does.

Durability (protocol.md 3.4, stricter than the mount's): in sync mode RENAME, DELETE, a marker, TRUNCATE and
the body of a CREATE or APPEND return only once their records (and every record before
them) are durable on the SOS server; MKDIRS returns once its record is in the local spool.
A file's contents must be durable when its writer is told so: the RENAME that makes the
file visible may reach ANOTHER gateway (a replacement on an empty cache, restored from the
server), whose barrier cannot cover what the lost one never shipped; it would rename an
empty or truncated file. In async mode nothing waits; the writer bounds the lag.

Quota (protocol.md 3.4, 3.5): while the SOS server refuses the journal for the namespace's
quota, every change is refused before it touches the tree, and a barrier fails promptly,
both as HDFS's DSQuotaExceededException (403); reads never wait for the writer.

Durability "tier" (``sos gateway --durability tier``, protocol.md 3.4): every barrier above
also waits until the server's object-store tier (the bucket) holds the records; one that the
bucket did not reach within ``--tier-patience`` answers 403 RetriableException (HDFS's class
for "try again later", at the status HDFS gives every IOException): the change was applied and
is durable on the SOS server, only the bucket is behind.

The cache is only reached through descriptors (:class:`sos_client.journal.beneath.Beneath`):
no request follows a symbolic link planted in it (reads, SETPERMISSION and SETTIMES
included), and entries that are neither directories nor regular files are not shown.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import posixpath
import stat as stat_mod
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from crc32c import crc32c  # sos_wire.crc's, without its wrapper: one call per 512 bytes

from sos_client.errors import SOSError, errno_of, is_fenced, to_oserror
from sos_client.journal.beneath import Beneath
from sos_client.journal.errors import JournalError, JournalQuotaExceeded, JournalTierBehind
from sos_client.journal.facade import journal_error
from sos_client.journal.records import validate_path

if TYPE_CHECKING:
    from sos_client.journal.open import OpenNamespace

_R = TypeVar("_R")

__all__ = [
    "JAVA_CLASSES",
    "SETPERMISSION_MASK",
    "WebHdfsError",
    "WebHdfsNamespace",
    "effective_permission",
    "file_status",
    "hdfs_path",
    "parse_permission",
    "remote_exception",
]

#: Java class of each exception the gateway reports, and the HTTP status HDFS gives it
#: (ExceptionHandler: FileNotFoundException 404, other IOExceptions 403,
#: IllegalArgumentException and UnsupportedOperationException 400, anything else 500).
JAVA_CLASSES: dict[str, tuple[str, int]] = {
    "FileNotFoundException": ("java.io.FileNotFoundException", 404),
    "FileAlreadyExistsException": ("org.apache.hadoop.fs.FileAlreadyExistsException", 403),
    "ParentNotDirectoryException": ("org.apache.hadoop.fs.ParentNotDirectoryException", 403),
    "PathIsNotEmptyDirectoryException": ("org.apache.hadoop.fs.PathIsNotEmptyDirectoryException", 403),
    "AlreadyBeingCreatedException": ("org.apache.hadoop.hdfs.protocol.AlreadyBeingCreatedException", 403),
    "DSQuotaExceededException": ("org.apache.hadoop.hdfs.protocol.DSQuotaExceededException", 403),
    "RetriableException": ("org.apache.hadoop.ipc.RetriableException", 403),
    "AccessControlException": ("org.apache.hadoop.security.AccessControlException", 403),
    "IOException": ("java.io.IOException", 403),
    "EOFException": ("java.io.EOFException", 403),
    "IllegalArgumentException": ("java.lang.IllegalArgumentException", 400),
    "HadoopIllegalArgumentException": ("org.apache.hadoop.HadoopIllegalArgumentException", 400),
    "UnsupportedOperationException": ("java.lang.UnsupportedOperationException", 400),
}

BLOCK_SIZE = 128 << 20
#: bytes per CRC of HDFS's block checksums (dfs.bytes-per-checksum), GETFILECHECKSUM's unit
BYTES_PER_CRC = 512
#: the one host of every block: a filesystem without locality (Hadoop's filesystem
#: specification, FileSystem.getFileBlockLocations' default: localhost, port 9866)
BLOCK_HOST = "localhost"
BLOCK_NAME = "localhost:9866"
#: ContentSummary.ecPolicy of a file with no erasure-coding policy (HDFS's name for it); a
#: directory without a policy has "" (HDFS's ContentSummaryComputationContext)
REPLICATED = "Replicated"
#: GETFILECHECKSUM reads the file in pieces of this size (a multiple of BYTES_PER_CRC)
CHECKSUM_PIECE = 1 << 20
#: RENAMEs remembered for a client's retry (see WebHdfsNamespace.recent_renames), at most
#: this many, for this long (seconds), in this file of the cache directory (beside tree/)
RENAME_MEMORY = 256
RENAME_RETRY_WINDOW = 600.0
RENAME_MEMORY_FILE = "gateway-renames.json"
#: LISTSTATUS_BATCH entries per reply (HDFS's dfs.ls.limit default)
LIST_BATCH = 1000
#: a file whose body streams is written to the journal in pieces of this size
WRITE_PIECE = 1 << 20


def remote_exception(exception: str, message: str, java_class: str | None = None) -> dict:
    """The JSON document HDFS sends for a refusal."""
    if java_class is None:
        java_class = JAVA_CLASSES.get(exception, ("java.io.IOException", 500))[0]
    return {"RemoteException": {"exception": exception, "javaClassName": java_class, "message": message}}


class WebHdfsError(Exception):
    """A refusal: HTTP ``status``, Java ``exception`` (simple name) and ``message``."""

    def __init__(self, exception: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        known = JAVA_CLASSES.get(exception)
        self.exception = exception
        self.java_class = known[0] if known else "java.io.IOException"
        self.status = status if status is not None else (known[1] if known else 500)
        self.message = message

    def body(self) -> dict:
        return remote_exception(self.exception, self.message, self.java_class)


#: The Java exception of a refused mutation, by the errno of its OSError (else IOException).
_EXCEPTION_OF_ERRNO = {
    errno.EACCES: "AccessControlException",
    errno.EPERM: "AccessControlException",
    errno.ENOENT: "FileNotFoundException",
    errno.EEXIST: "FileAlreadyExistsException",
    errno.ENOTDIR: "ParentNotDirectoryException",
    errno.ENOTEMPTY: "PathIsNotEmptyDirectoryException",
    errno.EDQUOT: "DSQuotaExceededException",
}

#: SETPERMISSION keeps these bits of the mode asked for: no setuid, setgid or sticky bit and
#: no write for group or others (other local users must not change the gateway's cache).
SETPERMISSION_MASK = 0o755
#: Without an O_PATH descriptor's own fchmod/futimens, these act on the inode it holds
#: (never on a link: the descriptor was opened O_NOFOLLOW and checked).
_PROC_FD = "/proc/self/fd/{}"


def _not_found(path: str) -> WebHdfsError:
    return WebHdfsError("FileNotFoundException", f"File does not exist: {path}")


def _hard_link(rel: str) -> WebHdfsError:
    return WebHdfsError(
        "AccessControlException",
        f"Permission denied: {hdfs_path(rel)} has more than one hard link; the "
        f"journal never makes one, so another name of it may be outside the "
        f"cache: refused",
    )


def _illegal(message: str) -> WebHdfsError:
    return WebHdfsError("IllegalArgumentException", message)


def hdfs_path(rel: str) -> str:
    """The absolute HDFS path of a namespace-relative path ("" is "/")."""
    return "/" + rel


def rel_path(path: str) -> str:
    """An absolute HDFS path ("/a/b", already percent-decoded) -> "a/b" ("/" -> "").

    Empty segments collapse (as HDFS's Path does); "." and ".." are refused
    (IllegalArgumentException, as DFSUtil.isValidName refuses them)."""
    if not path.startswith("/"):
        raise _illegal(f"Invalid path name {path}: a WebHDFS path must be absolute")
    parts = [p for p in path.split("/") if p]
    for p in parts:
        if p in (".", "..") or "\x00" in p:
            raise _illegal(f"Invalid path name {path}")
    rel = "/".join(parts)
    if rel:
        try:
            validate_path(rel)
        except ValueError as exc:
            raise _illegal(f"Invalid path name {path}: {exc}") from None
    return rel


def effective_permission(mode: int, is_dir: bool) -> int:
    """The mode SETPERMISSION gives: ``mode & SETPERMISSION_MASK``, and never less than
    u+rwx for a directory or u+rw for a file, so that the gateway (root or not) can still
    use its own cache: 0777 gives 0755, 000 gives 0700 on a directory (the root included)
    and 0600 on a file."""
    return (mode & SETPERMISSION_MASK) | (0o700 if is_dir else 0o600)


def parse_permission(text: str | None, default: int) -> int:
    """WebHDFS ``permission=`` (octal, e.g. "755"; up to 1777) -> mode bits."""
    if text is None or text == "":
        return default
    try:
        mode = int(text, 8)
    except ValueError:
        raise _illegal(f'Invalid value for webhdfs parameter "permission": {text!r} is not an octal number') from None
    if not 0 <= mode <= 0o1777:
        raise _illegal(f'Invalid value for webhdfs parameter "permission": {text} is out of the range [0, 1777]')
    return mode & 0o777  # the journal keeps rwx bits only


def file_status(st: os.stat_result, suffix: str, owner: str, group: str, children: int | None = None) -> dict[str, Any]:
    """An HDFS FileStatus JSON object (JsonUtil.toJsonMap's field names and types)."""
    is_dir = stat_mod.S_ISDIR(st.st_mode)
    doc: dict[str, Any] = {
        "accessTime": st.st_atime_ns // 1_000_000,
        "blockSize": 0 if is_dir else BLOCK_SIZE,
        "fileId": st.st_ino,
        "group": group,
        "length": 0 if is_dir else st.st_size,
        "modificationTime": st.st_mtime_ns // 1_000_000,
        "owner": owner,
        "pathSuffix": suffix,
        "permission": format(stat_mod.S_IMODE(st.st_mode) & 0o1777, "o"),
        "replication": 0 if is_dir else 1,
        "storagePolicy": 0,
        "type": "DIRECTORY" if is_dir else "FILE",
    }
    if children is not None:
        doc["childrenNum"] = children
    return doc


class WebHdfsNamespace:
    """The WebHDFS view of one opened namespace (see the module docstring).

    ``opened``: what :func:`sos_client.journal.open.open_namespace` returned (its writer in
    async mode: this class places the barriers itself, outside its lock). ``sync``: wait
    for the server on RENAME, DELETE and markers. ``owner``/``group``: what FileStatus
    reports (the journal records no owners).
    """

    def __init__(self, opened: OpenNamespace, *, sync: bool = True, owner: str = "sos", group: str = "sos") -> None:
        self.opened = opened
        self.tree = opened.tree
        self.writer = opened.writer
        self.root = opened.tree_dir
        self.namespace = opened.namespace
        self.sync = sync
        self.owner = owner
        self.group = group
        self.lock = threading.Lock()
        self._leases: set[str] = set()
        self._leases_lock = threading.Lock()
        #: (source, destination asked) -> [destination, its _identity, wall time] of the last
        #: RENAMEs, kept in the cache directory: see :meth:`_renamed_already`
        self._renames_file = os.path.join(os.path.dirname(self.root), RENAME_MEMORY_FILE)
        self.recent_renames: dict[tuple[str, str], list[Any]] = self._load_renames()

    # ------------------------------------------------------------------ rename retries
    def _load_renames(self) -> dict[tuple[str, str], list[Any]]:
        try:
            with open(self._renames_file, encoding="utf-8") as f:
                rows = json.load(f)
            return {(str(r[0]), str(r[1])): [str(r[2]), int(r[3]), float(r[4])] for r in rows}
        except (OSError, ValueError, TypeError, IndexError):
            return {}  # none yet, or unreadable: no retry is recognised, nothing else changes

    def _remember_rename(self, at: Beneath, rel: str, asked: str, dst: str) -> None:
        """Note a RENAME that was applied, before its reply (called under :attr:`lock`).
        The file is written whole (a few KiB) and replaced: a SIGKILLed gateway leaves it
        whole for the next one on the same cache."""
        st = self._stat(dst, at)
        if st is None:
            return
        now = time.time()
        renames = {k: v for k, v in self.recent_renames.items() if now - v[2] < RENAME_RETRY_WINDOW}
        renames.pop((rel, asked), None)
        renames[(rel, asked)] = [dst, self._identity(st), now]
        while len(renames) > RENAME_MEMORY:
            del renames[next(iter(renames))]
        self.recent_renames = renames
        tmp = self._renames_file + ".tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump([[k[0], k[1], *v] for k, v in renames.items()], f)
            os.replace(tmp, self._renames_file)
        except OSError:
            pass  # a retry after a crash is then not recognised: the client sees HDFS's answer

    def _renamed_already(self, at: Beneath, rel: str, asked: str) -> bool:
        """Whether a RENAME of a missing ``rel`` to ``asked`` is the retry of one this gateway
        (or the one before it on this cache) applied in the last RENAME_RETRY_WINDOW seconds,
        its destination still the entry it renamed: Hadoop's client resends a request whose
        reply it did not get (a gateway killed after applying a RENAME, before answering
        it), and a checkpoint's rename of its temporary file must not fail for it. HDFS's
        NameNode answers such a retry from its RetryCache, rebuilt from its edit log after a
        restart; this is the gateway's."""
        seen = self.recent_renames.get((rel, asked))
        if seen is None or time.time() - seen[2] >= RENAME_RETRY_WINDOW:
            return False
        st = self._stat(seen[0], at)
        return st is not None and self._identity(st) == seen[1]

    @staticmethod
    def _identity(st: os.stat_result) -> int:
        """What a rebuilt cache keeps of an entry (a gateway restarted after a crash may
        rebuild its tree from the server: new inodes, new times): -1 for a directory, else
        the file's size."""
        return -1 if stat_mod.S_ISDIR(st.st_mode) else st.st_size

    # ------------------------------------------------------------------ helpers
    def local(self, rel: str) -> str:
        return self.root if rel == "" else os.path.join(self.root, rel)

    @contextlib.contextmanager
    def _cache(self) -> Iterator[Beneath]:
        """The cache for one request: every path resolved from a descriptor of its root,
        component by component, never through a symbolic link (a link planted in the cache
        by another local user or a bad restore is never followed out of it). One per
        request: a Beneath caches descriptors and is not shared between threads."""
        at = Beneath(self.root)
        try:
            yield at
        finally:
            at.close()

    def _stat(self, rel: str, at: Beneath | None = None) -> os.stat_result | None:
        """lstat of ``rel`` if it is a directory or a regular file, else None: missing,
        below a link or a file, or something the journal never makes (a link, a FIFO...)."""
        if at is None:
            with self._cache() as at:
                return self._stat(rel, at)
        try:
            st = at.lstat(rel)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENAMETOOLONG):
                return None
            raise
        if not (stat_mod.S_ISDIR(st.st_mode) or stat_mod.S_ISREG(st.st_mode)):
            return None
        return st

    def _entry(self, at: Beneath, rel: str) -> tuple[int, os.stat_result]:
        """An ``O_PATH`` descriptor of ``rel`` itself (opened ``O_NOFOLLOW`` from its
        parent's descriptor) and its fstat: a directory, or a regular file with one link
        (the journal never makes a hard link: another name of the file may be outside the
        cache). The caller closes it."""
        try:
            if rel == "":
                fd = os.dup(at.fd)
            else:
                dfd, name = at.parent(rel)
                fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except (FileNotFoundError, NotADirectoryError):
            raise _not_found(hdfs_path(rel)) from None
        try:
            st = os.fstat(fd)
            if stat_mod.S_ISREG(st.st_mode) and st.st_nlink > 1:
                raise _hard_link(rel)
            if not (stat_mod.S_ISDIR(st.st_mode) or stat_mod.S_ISREG(st.st_mode)):
                raise _not_found(hdfs_path(rel))  # a link (itself, not followed), a FIFO...
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    @contextlib.contextmanager
    def _admission(self) -> Iterator[None]:
        """A change of the namespace: refused up front (DSQuotaExceededException, nothing
        changed) while the server refuses the journal for quota; admitted whole otherwise
        (the writer does not refuse its later records half-way, see JournalWriter.admission)."""
        if self.writer is None:
            yield
            return
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self.writer.admission())
            except JournalQuotaExceeded as exc:
                raise self._quota_refusal(exc) from exc
            yield

    def _quota_refusal(self, exc: BaseException) -> WebHdfsError:
        return WebHdfsError(
            "DSQuotaExceededException", f"The DiskSpace quota of namespace {self.namespace!r} is exceeded: {exc}"
        )

    def _journal(self, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        """Call a tree mutation; journal failures and races become WebHdfsErrors (by the
        errno of :func:`sos_client.errors.to_oserror`, as fsspec and the mount map them)."""
        try:
            return fn(*args, **kwargs)
        except (JournalError, SOSError, OSError) as exc:
            if errno_of(exc) == errno.EDQUOT:
                raise self._quota_refusal(exc) from exc
            err = to_oserror(journal_error(exc, self.namespace, "this gateway"))
            if isinstance(exc, JournalTierBehind):
                raise WebHdfsError(
                    "RetriableException",
                    f"{err.strerror or err}. The change was applied and is durable "
                    f"on the SOS server; its records reach the bucket once it "
                    f"catches up (GETFILESTATUS tells what the namespace holds)",
                ) from exc
            if is_fenced(exc) or isinstance(exc, JournalError):
                raise WebHdfsError(
                    "IOException", str(err.strerror or err), 500 if not is_fenced(exc) else None
                ) from exc
            where = f": {err.filename}" if err.filename is not None else ""
            raise WebHdfsError(
                _EXCEPTION_OF_ERRNO.get(err.errno or 0, "IOException"), f"{err.strerror or err}{where}"
            ) from exc

    def _last_seq(self) -> int:
        return self.writer.last_seq if self.writer is not None else 0

    def barrier(self, seq: int | None = None) -> None:
        """In sync mode: wait until every record up to ``seq`` (default: all so far) is
        durable on the server (with durability "tier": and in its bucket; 403
        RetriableException after the writer's tier patience)."""
        if self.sync and self.writer is not None:
            self._journal(self.writer.barrier, seq)

    def _require(self, rel: str, at: Beneath | None = None) -> os.stat_result:
        st = self._stat(rel, at)
        if st is None:
            raise _not_found(hdfs_path(rel))
        return st

    def _require_file(self, rel: str, at: Beneath | None = None) -> os.stat_result:
        st = self._require(rel, at)
        if stat_mod.S_ISDIR(st.st_mode):
            raise WebHdfsError("FileNotFoundException", f"Path is not a file: {hdfs_path(rel)}")
        return st

    def _check_parent(self, rel: str, *, create_parent: bool, at: Beneath | None = None) -> list[str]:
        """The missing ancestors of ``rel`` (outermost first); refuses a file in the way,
        or a missing parent when ``create_parent`` is false."""
        parts = rel.split("/")[:-1]
        missing: list[str] = []
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if missing:
                missing.append(sub)
                continue
            st = self._stat(sub, at)
            if st is None:
                if not create_parent:
                    raise WebHdfsError("FileNotFoundException", f"Parent directory doesn't exist: {hdfs_path(sub)}")
                missing.append(sub)
            elif not stat_mod.S_ISDIR(st.st_mode):
                raise WebHdfsError("ParentNotDirectoryException", f"Parent path is not a directory: {hdfs_path(sub)}")
        return missing

    # ------------------------------------------------------------------ reads
    def get_file_status(self, rel: str) -> dict:
        with self._cache() as at:
            st = self._require(rel, at)
            children = None
            if stat_mod.S_ISDIR(st.st_mode):
                try:
                    children = len(at.listdir(rel))
                except OSError:
                    children = 0
        return {"FileStatus": file_status(st, "", self.owner, self.group, children)}

    def _entries(self, rel: str) -> list[dict]:
        with self._cache() as at:
            st = self._require(rel, at)
            if not stat_mod.S_ISDIR(st.st_mode):
                return [file_status(st, "", self.owner, self.group)]
            out = []
            try:
                names = at.listdir(rel)
                dfd = at.dir_fd(rel)
            except (FileNotFoundError, NotADirectoryError):
                raise _not_found(hdfs_path(rel)) from None
            for name in names:
                try:
                    est = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed while listing
                if stat_mod.S_ISDIR(est.st_mode) or stat_mod.S_ISREG(est.st_mode):
                    out.append(file_status(est, name, self.owner, self.group))
        out.sort(key=lambda d: d["pathSuffix"].encode("utf-8", "surrogateescape"))
        return out

    def list_status(self, rel: str) -> dict:
        return {"FileStatuses": {"FileStatus": self._entries(rel)}}

    def list_status_batch(self, rel: str, start_after: str) -> dict:
        entries = self._entries(rel)
        if start_after:
            key = start_after.encode("utf-8", "surrogateescape")
            entries = [e for e in entries if e["pathSuffix"].encode("utf-8", "surrogateescape") > key]
        page, rest = entries[:LIST_BATCH], entries[LIST_BATCH:]
        return {
            "DirectoryListing": {
                "partialListing": {"FileStatuses": {"FileStatus": page}},
                "remainingEntries": len(rest),
            }
        }

    def content_summary(self, rel: str) -> dict:
        files = dirs = length = 0
        with self._cache() as at:
            st = self._require(rel, at)
            if stat_mod.S_ISDIR(st.st_mode):
                try:
                    for _dir, _subdirs, entries in at.walk(rel):
                        dirs += 1
                        for _name, est in entries:
                            if stat_mod.S_ISREG(est.st_mode):
                                files += 1
                                length += est.st_size
                except (FileNotFoundError, NotADirectoryError):
                    pass  # changed while summed up: HDFS does not lock either
            else:
                files, length = 1, st.st_size
        ec_policy = "" if stat_mod.S_ISDIR(st.st_mode) else REPLICATED
        return {
            "ContentSummary": {
                "directoryCount": dirs,
                "ecPolicy": ec_policy,
                "fileCount": files,
                "length": length,
                "quota": -1,
                "spaceConsumed": length,
                "spaceQuota": -1,
                "typeQuota": {},
            }
        }

    def block_locations(self, rel: str, offset: int, length: int | None) -> dict:
        """GETFILEBLOCKLOCATIONS: one BlockLocation per BLOCK_SIZE block of the file that
        overlaps [offset, offset + length) (the block holding ``offset`` at least, as HDFS's
        BlockManager gives it even for length 0), each on BLOCK_HOST: the filesystem
        specification's answer for a filesystem without locality. None past the end, none
        for an empty file; a directory is refused as HDFS refuses it (Path is not a file)."""
        if offset < 0:
            raise WebHdfsError(
                "HadoopIllegalArgumentException", f"Negative offset is not supported. File: {hdfs_path(rel)}"
            )
        if length is not None and length < 0:
            raise WebHdfsError(
                "HadoopIllegalArgumentException", f"Negative length is not supported. File: {hdfs_path(rel)}"
            )
        size = self._require_file(rel).st_size
        end = size if length is None else min(size, offset + length)
        blocks: list[dict[str, Any]] = []
        start = offset - offset % BLOCK_SIZE
        while offset < size and start < size and (start < end or not blocks):
            blocks.append(
                {
                    "cachedHosts": [],
                    "corrupt": False,
                    "hosts": [BLOCK_HOST],
                    "length": min(BLOCK_SIZE, size - start),
                    "names": [BLOCK_NAME],
                    "offset": start,
                    "storageIds": [],
                    "storageTypes": ["DISK"],
                    "topologyPaths": [],
                }
            )
            start += BLOCK_SIZE
        return {"BlockLocations": {"BlockLocation": blocks}}

    def file_checksum(self, rel: str) -> dict:
        """GETFILECHECKSUM: HDFS's MD5MD5CRC32FileChecksum of a replicated file, computed as
        a DataNode and DFSClient compute it (MD5MD5CRC combine mode, CRC32C): for each
        BLOCK_SIZE block the MD5 of its chunk CRCs (CRC32C of every BYTES_PER_CRC bytes,
        the last chunk short, 4 bytes big-endian each, as in the block's meta file), then
        the MD5 of those MD5s. crcPerBlock is the first block's CRC count when the file has
        more than one block, else 0 (FileChecksumHelper). An empty file has no block and no
        checksum of blocks: HDFS gives it the "magic entry" of earlier versions, the CRC32
        (gzip) checksum with bytesPerCRC 0, crcPerBlock 0 and the MD5 of 32 zero bytes
        (FileChecksumHelper.FileChecksumComputer.compute)."""
        fd, _start, count = self.open_for_read(rel, 0, None)
        try:
            if count == 0:
                raw = bytes(12) + hashlib.md5(bytes(32), usedforsecurity=False).digest()
                return {"FileChecksum": {"algorithm": "MD5-of-0MD5-of-0CRC32", "bytes": raw.hex(), "length": len(raw)}}
            file_md5 = hashlib.md5(usedforsecurity=False)  # of the blocks' MD5s
            blocks = 0
            for block_start in range(0, count, BLOCK_SIZE):
                block_end = min(count, block_start + BLOCK_SIZE)
                crcs = bytearray()
                pos = block_start
                while pos < block_end:
                    piece = os.pread(fd, min(CHECKSUM_PIECE, block_end - pos), pos)
                    if not piece:
                        raise WebHdfsError("IOException", f"{hdfs_path(rel)} shrank while its checksum was computed")
                    view = memoryview(piece)
                    sums = [crc32c(view[i : i + BYTES_PER_CRC]) for i in range(0, len(view), BYTES_PER_CRC)]
                    crcs += struct.pack(f">{len(sums)}I", *sums)
                    pos += len(piece)
                file_md5.update(hashlib.md5(crcs, usedforsecurity=False).digest())
                blocks += 1
        finally:
            os.close(fd)
        crc_per_block = -(-BLOCK_SIZE // BYTES_PER_CRC) if blocks > 1 else 0
        raw = BYTES_PER_CRC.to_bytes(4, "big") + crc_per_block.to_bytes(8, "big") + file_md5.digest()
        return {
            "FileChecksum": {
                "algorithm": f"MD5-of-{crc_per_block}MD5-of-{BYTES_PER_CRC}CRC32C",
                "bytes": raw.hex(),
                "length": len(raw),
            }
        }

    def fs_status(self) -> dict:
        """GETSTATUS: capacity, used and remaining bytes of the gateway's cache filesystem
        (statvfs): the SOS server tells a client neither its quota nor its disk."""
        sv = os.statvfs(self.root)
        return {
            "FsStatus": {
                "capacity": sv.f_blocks * sv.f_frsize,
                "remaining": sv.f_bavail * sv.f_frsize,
                "used": (sv.f_blocks - sv.f_bfree) * sv.f_frsize,
            }
        }

    @staticmethod
    def trash_root(user: str) -> dict:
        """GETTRASHROOT: /user/USER/.Trash, as HDFS outside an encryption zone."""
        return {"Path": f"/user/{user}/.Trash"}

    def trash_roots(self, user: str, all_users: bool) -> dict:
        """GETTRASHROOTS: the trash directories that exist (/user/*/.Trash for all users,
        else the caller's), as HDFS's DistributedFileSystem.getTrashRoots lists them, in the
        FileStatus form JsonUtil gives that list."""
        paths = []
        with self._cache() as at:
            if all_users:
                st = self._stat("user", at)
                users = sorted(at.listdir("user")) if st is not None and stat_mod.S_ISDIR(st.st_mode) else []
            else:
                users = [user]
            for name in users:
                rel = f"user/{name}/.Trash"
                try:
                    validate_path(rel)
                except ValueError:
                    continue
                tst = self._stat(rel, at)
                if tst is None or not stat_mod.S_ISDIR(tst.st_mode):
                    continue
                paths.append(
                    {
                        "path": hdfs_path(rel),
                        "length": 0,
                        "isdir": True,
                        "block_replication": 0,
                        "blocksize": 0,
                        "modification_time": tst.st_mtime_ns // 1_000_000,
                        "access_time": tst.st_atime_ns // 1_000_000,
                        "permission": format(stat_mod.S_IMODE(tst.st_mode) & 0o1777, "o"),
                        "owner": self.owner,
                        "group": self.group,
                    }
                )
        return {"Paths": paths}

    def set_owner(self, rel: str, owner: str, group: str) -> None:
        """SETOWNER: accepted and nothing recorded, as Hadoop's FileSystem base class and the
        object stores do for a filesystem without owners: the journal has no owner record,
        every entry reports the gateway's --owner/--group. The path must exist (HDFS's
        FileNotFoundException otherwise) and one of owner, group be given."""
        if not owner and not group:
            raise _illegal("Both owner and group are empty.")
        self._require(rel)

    def check_access(self, rel: str, fsaction: str, can_write: bool) -> None:
        self._require(rel)
        if "w" in fsaction and not can_write:
            raise WebHdfsError(
                "AccessControlException",
                f"Permission denied: write access to {hdfs_path(rel)} needs a token of a key with the append role",
            )

    def open_for_read(self, rel: str, offset: int, length: int | None) -> tuple[int, int, int]:
        """(fd, start, count): a snapshot of the file (a later rename or delete does not
        disturb it); the caller closes fd."""
        if offset < 0:
            raise _illegal(f'Invalid value for webhdfs parameter "offset": {offset} < 0')
        if length is not None and length < 0:
            raise _illegal(f'Invalid value for webhdfs parameter "length": {length} < 0')
        with self._cache() as at:
            self._require_file(rel, at)
            try:
                # O_NOFOLLOW from the parent's descriptor; a regular file with one link
                fd = at.open_file(rel, os.O_RDONLY, single_link=True)
            except OSError as exc:
                if exc.errno == errno.EMLINK:
                    raise _hard_link(rel) from None
                if exc.errno in (errno.EACCES, errno.EPERM):
                    raise WebHdfsError(
                        "AccessControlException", f"Permission denied: {hdfs_path(rel)}: {exc.strerror}"
                    ) from None
                raise _not_found(hdfs_path(rel)) from None  # gone, or swapped for a link
        st = os.fstat(fd)
        if offset > st.st_size:  # HDFS's DataNode: DFSInputStream.seek refuses it
            os.close(fd)
            raise WebHdfsError("EOFException", "Cannot seek after EOF")
        start = min(offset, st.st_size)
        count = st.st_size - start
        if length is not None:
            count = min(count, length)
        return fd, start, count

    # ------------------------------------------------------------------ metadata changes
    def mkdirs(self, rel: str, mode: int) -> dict:
        with self.lock, self._admission():
            st = self._stat(rel)
            if st is not None:
                if stat_mod.S_ISDIR(st.st_mode):
                    return {"boolean": True}
                raise WebHdfsError("FileAlreadyExistsException", f"Path is not a directory: {hdfs_path(rel)}")
            if rel == "":
                return {"boolean": True}
            for sub in [*self._check_parent(rel, create_parent=True), rel]:
                self._journal(self.tree.mkdir, sub, mode | 0o300 if sub != rel else mode)
        self.barrier()  # sync: durable before 200, and a fenced gateway's MKDIRS fails here
        return {"boolean": True}

    def rename(self, rel: str, dst_path: str, options: set[str] | None) -> dict | None:
        """RENAME: without ``options`` HDFS's boolean rename (false when it cannot; an
        existing directory as destination receives the source); with ``options`` (the
        ``renameoptions`` set: NONE, OVERWRITE) rename2, which raises instead."""
        dst = rel_path(dst_path)
        with self.lock, self._admission(), self._cache() as at:
            result = self._rename(at, rel, dst, options)
            seq = self._last_seq()
        if result is not False:
            self.barrier(seq)
        return {"boolean": result} if options is None else None

    def _rename(self, at: Beneath, rel: str, dst: str, options: set[str] | None) -> bool:
        src_st = self._stat(rel, at)
        boolean = options is None
        src_name, dst_name = hdfs_path(rel), hdfs_path(dst)
        asked = dst
        if src_st is None:
            if self._renamed_already(at, rel, asked):
                return True  # a retry of a RENAME already applied: its first answer
            if boolean:
                return False
            raise _not_found(src_name)
        if rel == "":
            if boolean:
                return False
            raise WebHdfsError("IOException", "The root directory cannot be renamed")
        src_is_dir = stat_mod.S_ISDIR(src_st.st_mode)
        dst_st = self._stat(dst, at)
        if boolean:
            if dst == rel:
                return True
            if dst_st is not None and stat_mod.S_ISDIR(dst_st.st_mode):
                dst = posixpath.join(dst, posixpath.basename(rel)) if dst else posixpath.basename(rel)
                dst_name = hdfs_path(dst)
                dst_st = self._stat(dst, at)
            if dst_st is not None:
                return False
        elif dst == rel:
            raise WebHdfsError(
                "FileAlreadyExistsException", f"The source {src_name} and destination {dst_name} are the same"
            )
        if dst == "":
            if boolean:
                return False
            raise WebHdfsError("FileAlreadyExistsException", f"rename destination {dst_name} already exists")
        if src_is_dir and (dst + "/").startswith(rel + "/"):
            if boolean:
                return False  # HDFS's boolean rename: false (rename2 raises)
            raise WebHdfsError(
                "IOException", f"Rename destination {dst_name} is a directory or file under source {src_name}"
            )
        parent = posixpath.dirname(dst)
        if parent:
            pst = self._stat(parent, at)
            if pst is None or not stat_mod.S_ISDIR(pst.st_mode):
                if boolean:
                    return False
                if pst is None:
                    raise WebHdfsError(
                        "FileNotFoundException", f"rename destination parent {hdfs_path(parent)} not found."
                    )
                raise WebHdfsError(
                    "ParentNotDirectoryException", f"rename destination parent {hdfs_path(parent)} is a file."
                )
        overwrite = options is not None and "OVERWRITE" in options
        if dst_st is not None:
            if not overwrite:
                raise WebHdfsError("FileAlreadyExistsException", f"rename destination {dst_name} already exists")
            dst_is_dir = stat_mod.S_ISDIR(dst_st.st_mode)
            if dst_is_dir != src_is_dir:
                kind = "directories" if src_is_dir else "files"
                raise WebHdfsError("IOException", f"Source {src_name} and destination {dst_name} must both be {kind}")
            if dst_is_dir and at.listdir(dst):
                raise WebHdfsError("IOException", f"rename destination directory is not empty: {dst_name}")
        with self._leases_lock:
            if rel in self._leases or dst in self._leases:
                raise WebHdfsError(
                    "AlreadyBeingCreatedException",
                    f"{src_name if rel in self._leases else dst_name} is being written by another request",
                )
        try:
            self._journal(self.tree.rename, rel, dst, overwrite=overwrite)
        except WebHdfsError as exc:
            if boolean and exc.exception == "FileAlreadyExistsException":
                return False  # appeared meanwhile (atomic no-replace rename)
            raise
        self._remember_rename(at, rel, asked, dst)
        return True

    def delete(self, rel: str, recursive: bool) -> dict:
        with self.lock, self._admission():
            with self._cache() as at:
                st = self._stat(rel, at)
                if rel == "" and not recursive and at.listdir(rel):
                    # HDFS's FSDirDeleteOp checks a non-recursive delete of a non-empty
                    # directory before it refuses the root
                    raise WebHdfsError("PathIsNotEmptyDirectoryException", "`/ is non empty': Directory is not empty")
                if st is None or rel == "":
                    return {"boolean": False}  # HDFS: false for a missing path and for the root
                if stat_mod.S_ISDIR(st.st_mode):
                    if not recursive and at.listdir(rel):
                        raise WebHdfsError(
                            "PathIsNotEmptyDirectoryException",
                            f"`{hdfs_path(rel)} is non empty': Directory is not empty",
                        )
                    doomed = self._doomed(at, rel)
                else:
                    doomed = [(rel, False)]
            # every check done: the records follow, deepest first, none refused half-way
            for path, is_dir in doomed:
                self._journal(self.tree.rmdir if is_dir else self.tree.unlink, path)
            seq = self._last_seq()
        self.barrier(seq)
        return {"boolean": True}

    def _doomed(self, at: Beneath, rel: str) -> list[tuple[str, bool]]:
        """(path, is a directory) of everything a recursive DELETE of directory ``rel``
        removes, each directory after its contents. Anything but directories and regular
        files (a link or FIFO planted in the cache: the journal has no record of it, so a
        DELETE of it would break every restore) refuses the DELETE before anything changes."""
        walked: list[tuple[str, list[str]]] = []
        for d, _subdirs, entries in at.walk(rel):
            files = []
            for name, est in entries:
                path = f"{d}/{name}"
                if not stat_mod.S_ISREG(est.st_mode):
                    raise WebHdfsError(
                        "IOException",
                        f"{hdfs_path(path)} is not a file or directory of the "
                        f"journal (a link or special file put in the gateway's "
                        f"cache by hand?): {hdfs_path(rel)} is not deleted",
                    )
                files.append(path)
            walked.append((d, files))
        doomed: list[tuple[str, bool]] = []
        for d, files in reversed(walked):  # reversed top-down order: children first
            doomed += [(f, False) for f in files] + [(d, True)]
        return doomed

    def set_permission(self, rel: str, mode: int) -> None:
        """Applied to the cache only: the journal has no record for modes of existing
        entries (a restore gives the mode each entry was created with). The mode is
        :func:`effective_permission`'s, applied to the entry itself, never through a link."""
        with self._cache() as at:
            fd, st = self._entry(at, rel)
            try:
                os.chmod(_PROC_FD.format(fd), effective_permission(mode, stat_mod.S_ISDIR(st.st_mode)))
            finally:
                os.close(fd)

    def set_times(self, rel: str, mtime: int, atime: int) -> None:
        """Applied to the cache only (the journal records no times); -1 keeps a time. The
        entry itself, never through a link."""
        with self._cache() as at:
            fd, st = self._entry(at, rel)
            try:
                a = st.st_atime_ns if atime < 0 else atime * 1_000_000
                m = st.st_mtime_ns if mtime < 0 else mtime * 1_000_000
                os.utime(_PROC_FD.format(fd), ns=(a, m))
            finally:
                os.close(fd)

    def set_replication(self, rel: str) -> dict:
        st = self._require(rel)
        return {"boolean": not stat_mod.S_ISDIR(st.st_mode)}

    def truncate(self, rel: str, new_length: int) -> dict:
        if new_length < 0:
            raise _illegal(f'Invalid value for webhdfs parameter "newlength": {new_length} < 0')
        with self.lock, self._admission():
            st = self._require_file(rel)
            if new_length > st.st_size:
                raise WebHdfsError(
                    "HadoopIllegalArgumentException",
                    f"Cannot truncate to a larger file size. Current size: {st.st_size}, truncate size: {new_length}.",
                )
            self._take_lease(rel)
            try:
                seq = self._journal(self.tree.truncate, rel, new_length)
            finally:
                self.release(rel)
        self.barrier(seq)  # outside the lock, as RENAME's
        return {"boolean": True}

    # ------------------------------------------------------------------ file bodies
    def _take_lease(self, rel: str) -> None:
        with self._leases_lock:
            if rel in self._leases:
                raise WebHdfsError(
                    "AlreadyBeingCreatedException", f"{hdfs_path(rel)} is being written by another request"
                )
            self._leases.add(rel)

    def check_lease(self, rel: str) -> None:
        """The first step of a CREATE or APPEND of a path being written is refused as its
        data step would be (HDFS's NameNode: AlreadyBeingCreatedException on create), not
        redirected to a step that is bound to fail after the client has sent its body. So is
        any first step while the namespace is over its quota (DSQuotaExceededException)."""
        with self._admission():
            pass
        with self._leases_lock:
            if rel in self._leases:
                raise WebHdfsError(
                    "AlreadyBeingCreatedException", f"{hdfs_path(rel)} is being written by another request"
                )

    def release(self, rel: str) -> None:
        """End of a CREATE/APPEND body (or of its failure): the path can be written again."""
        with self._leases_lock:
            self._leases.discard(rel)

    def check_create(self, rel: str, *, overwrite: bool, create_parent: bool) -> None:
        """The refusals of CREATE that can be told before its body is sent (the quota
        included: no body is sent for nothing)."""
        with self._admission():
            pass
        if rel == "":
            raise WebHdfsError("FileAlreadyExistsException", "/ already exists as a directory")
        st = self._stat(rel)
        if st is not None:
            if stat_mod.S_ISDIR(st.st_mode):
                raise WebHdfsError("FileAlreadyExistsException", f"{hdfs_path(rel)} already exists as a directory")
            if not overwrite:
                raise WebHdfsError("FileAlreadyExistsException", f"{hdfs_path(rel)} already exists")
        self._check_parent(rel, create_parent=create_parent)

    def begin_create(self, rel: str, mode: int, *, overwrite: bool, create_parent: bool) -> None:
        """Create (or truncate) ``rel`` and take its lease; the body follows as
        :meth:`write` calls, then :meth:`release`."""
        with self.lock, self._admission():
            self.check_create(rel, overwrite=overwrite, create_parent=create_parent)
            self._take_lease(rel)
            try:
                for sub in self._check_parent(rel, create_parent=create_parent):
                    self._journal(self.tree.mkdir, sub, 0o755)
                self._journal(self.tree.create, rel, mode)
            except BaseException:
                self.release(rel)
                raise

    def is_file(self, rel: str) -> bool:
        """``rel`` is an existing regular file (CREATE with the APPEND flag appends to it)."""
        st = self._stat(rel)
        return st is not None and stat_mod.S_ISREG(st.st_mode)

    def check_append(self, rel: str) -> os.stat_result:
        return self._require_file(rel)

    def begin_append(self, rel: str) -> int:
        """Take ``rel``'s lease; returns the offset the appended body starts at."""
        with self.lock, self._admission():
            st = self._require_file(rel)
            self._take_lease(rel)
            return st.st_size

    def write(self, rel: str, offset: int, data: bytes) -> None:
        """One piece of a CREATE or APPEND body. Refused at the quota like any change; the
        pieces before it stay (as HDFS keeps the blocks written before a quota refusal)."""
        try:
            with self._admission():
                self._journal(self.tree.write, rel, offset, data)
        except WebHdfsError as exc:
            if exc.exception != "DSQuotaExceededException":
                raise
            raise WebHdfsError(
                exc.exception,
                f"{exc.message}. {hdfs_path(rel)} keeps its first "
                f"{offset} bytes, journaled before the quota was reached",
            ) from exc

    def marker(self, label: str, payload: bytes) -> int:
        seq = self._journal(self.tree.marker, label, payload)
        self.barrier(seq)
        return int(seq)
