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
import os
import posixpath
import stat as stat_mod
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from sos_client.errors import SOSError, errno_of, is_fenced, to_oserror
from sos_client.journal.beneath import Beneath
from sos_client.journal.errors import JournalError, JournalQuotaExceeded, JournalTierBehind
from sos_client.journal.facade import journal_error
from sos_client.journal.records import validate_path

if TYPE_CHECKING:
    from sos_client.journal.open import OpenNamespace

_R = TypeVar("_R")

__all__ = ["JAVA_CLASSES", "SETPERMISSION_MASK", "WebHdfsError", "WebHdfsNamespace",
           "effective_permission", "file_status", "hdfs_path", "parse_permission",
           "remote_exception"]

#: Java class of each exception the gateway reports, and the HTTP status HDFS gives it
#: (ExceptionHandler: FileNotFoundException 404, other IOExceptions 403,
#: IllegalArgumentException and UnsupportedOperationException 400, anything else 500).
JAVA_CLASSES: dict[str, tuple[str, int]] = {
    "FileNotFoundException": ("java.io.FileNotFoundException", 404),
    "FileAlreadyExistsException": ("org.apache.hadoop.fs.FileAlreadyExistsException", 403),
    "ParentNotDirectoryException": ("org.apache.hadoop.fs.ParentNotDirectoryException", 403),
    "PathIsNotEmptyDirectoryException": (
        "org.apache.hadoop.fs.PathIsNotEmptyDirectoryException", 403),
    "AlreadyBeingCreatedException": (
        "org.apache.hadoop.hdfs.protocol.AlreadyBeingCreatedException", 403),
    "DSQuotaExceededException": (
        "org.apache.hadoop.hdfs.protocol.DSQuotaExceededException", 403),
    "RetriableException": ("org.apache.hadoop.ipc.RetriableException", 403),
    "AccessControlException": ("org.apache.hadoop.security.AccessControlException", 403),
    "IOException": ("java.io.IOException", 403),
    "IllegalArgumentException": ("java.lang.IllegalArgumentException", 400),
    "HadoopIllegalArgumentException": ("org.apache.hadoop.HadoopIllegalArgumentException", 400),
    "UnsupportedOperationException": ("java.lang.UnsupportedOperationException", 400),
}

BLOCK_SIZE = 128 << 20
#: LISTSTATUS_BATCH entries per reply (HDFS's dfs.ls.limit default)
LIST_BATCH = 1000
#: a file whose body streams is written to the journal in pieces of this size
WRITE_PIECE = 1 << 20


def remote_exception(exception: str, message: str, java_class: str | None = None) -> dict:
    """The JSON document HDFS sends for a refusal."""
    if java_class is None:
        java_class = JAVA_CLASSES.get(exception, ("java.io.IOException", 500))[0]
    return {"RemoteException": {"exception": exception, "javaClassName": java_class,
                                "message": message}}


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
    return WebHdfsError("AccessControlException",
                        f"Permission denied: {hdfs_path(rel)} has more than one hard link; the "
                        f"journal never makes one, so another name of it may be outside the "
                        f"cache: refused")


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
        raise _illegal(f'Invalid value for webhdfs parameter "permission": {text!r} is not '
                       f"an octal number") from None
    if not 0 <= mode <= 0o1777:
        raise _illegal(f'Invalid value for webhdfs parameter "permission": {text} is out of '
                       f"the range [0, 1777]")
    return mode & 0o777  # the journal keeps rwx bits only


def file_status(st: os.stat_result, suffix: str, owner: str, group: str,
                children: int | None = None) -> dict[str, Any]:
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

    def __init__(self, opened: OpenNamespace, *, sync: bool = True, owner: str = "sos",
                 group: str = "sos") -> None:
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
        return WebHdfsError("DSQuotaExceededException",
                            f"The DiskSpace quota of namespace {self.namespace!r} is exceeded: "
                            f"{exc}")

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
                raise WebHdfsError("RetriableException",
                                   f"{err.strerror or err}. The change was applied and is durable "
                                   f"on the SOS server; its records reach the bucket once it "
                                   f"catches up (GETFILESTATUS tells what the namespace holds)") from exc
            if is_fenced(exc) or isinstance(exc, JournalError):
                raise WebHdfsError("IOException", str(err.strerror or err),
                                   500 if not is_fenced(exc) else None) from exc
            where = f": {err.filename}" if err.filename is not None else ""
            raise WebHdfsError(_EXCEPTION_OF_ERRNO.get(err.errno or 0, "IOException"),
                               f"{err.strerror or err}{where}") from exc

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

    def _check_parent(self, rel: str, *, create_parent: bool,
                      at: Beneath | None = None) -> list[str]:
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
                    raise WebHdfsError("FileNotFoundException",
                                       f"Parent directory doesn't exist: {hdfs_path(sub)}")
                missing.append(sub)
            elif not stat_mod.S_ISDIR(st.st_mode):
                raise WebHdfsError("ParentNotDirectoryException",
                                   f"Parent path is not a directory: {hdfs_path(sub)}")
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
            entries = [e for e in entries
                       if e["pathSuffix"].encode("utf-8", "surrogateescape") > key]
        page, rest = entries[:LIST_BATCH], entries[LIST_BATCH:]
        return {"DirectoryListing": {"partialListing": {"FileStatuses": {"FileStatus": page}},
                                     "remainingEntries": len(rest)}}

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
        return {"ContentSummary": {"directoryCount": dirs, "fileCount": files, "length": length,
                                   "quota": -1, "spaceConsumed": length, "spaceQuota": -1,
                                   "typeQuota": {}}}

    def check_access(self, rel: str, fsaction: str, can_write: bool) -> None:
        self._require(rel)
        if "w" in fsaction and not can_write:
            raise WebHdfsError("AccessControlException",
                               f"Permission denied: write access to {hdfs_path(rel)} needs a "
                               f"token of a key with the append role")

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
                    raise WebHdfsError("AccessControlException",
                                       f"Permission denied: {hdfs_path(rel)}: {exc.strerror}") from None
                raise _not_found(hdfs_path(rel)) from None  # gone, or swapped for a link
        st = os.fstat(fd)
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
                raise WebHdfsError("FileAlreadyExistsException",
                                   f"Path is not a directory: {hdfs_path(rel)}")
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
        if src_st is None:
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
            raise WebHdfsError("FileAlreadyExistsException",
                               f"The source {src_name} and destination {dst_name} are the same")
        if dst == "":
            if boolean:
                return False
            raise WebHdfsError("FileAlreadyExistsException",
                               f"rename destination {dst_name} already exists")
        if src_is_dir and (dst + "/").startswith(rel + "/"):
            raise WebHdfsError("IOException", f"Rename destination {dst_name} is a directory or "
                               f"file under source {src_name}")
        parent = posixpath.dirname(dst)
        if parent:
            pst = self._stat(parent, at)
            if pst is None or not stat_mod.S_ISDIR(pst.st_mode):
                if boolean:
                    return False
                if pst is None:
                    raise WebHdfsError("FileNotFoundException",
                                       f"rename destination parent {hdfs_path(parent)} not found.")
                raise WebHdfsError("ParentNotDirectoryException",
                                   f"rename destination parent {hdfs_path(parent)} is a file.")
        overwrite = options is not None and "OVERWRITE" in options
        if dst_st is not None:
            if not overwrite:
                raise WebHdfsError("FileAlreadyExistsException",
                                   f"rename destination {dst_name} already exists")
            dst_is_dir = stat_mod.S_ISDIR(dst_st.st_mode)
            if dst_is_dir != src_is_dir:
                kind = "directories" if src_is_dir else "files"
                raise WebHdfsError("IOException", f"Source {src_name} and destination {dst_name} "
                                   f"must both be {kind}")
            if dst_is_dir and at.listdir(dst):
                raise WebHdfsError("IOException",
                                   f"rename destination directory is not empty: {dst_name}")
        with self._leases_lock:
            if rel in self._leases or dst in self._leases:
                raise WebHdfsError("AlreadyBeingCreatedException",
                                   f"{src_name if rel in self._leases else dst_name} is being "
                                   f"written by another request")
        try:
            self._journal(self.tree.rename, rel, dst, overwrite=overwrite)
        except WebHdfsError as exc:
            if boolean and exc.exception == "FileAlreadyExistsException":
                return False  # appeared meanwhile (atomic no-replace rename)
            raise
        return True

    def delete(self, rel: str, recursive: bool) -> dict:
        with self.lock, self._admission():
            with self._cache() as at:
                st = self._stat(rel, at)
                if st is None or rel == "":
                    return {"boolean": False}  # HDFS: false for a missing path and for the root
                if stat_mod.S_ISDIR(st.st_mode):
                    if not recursive and at.listdir(rel):
                        raise WebHdfsError("PathIsNotEmptyDirectoryException",
                                           f"`{hdfs_path(rel)} is non empty': Directory is not empty")
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
                    raise WebHdfsError("IOException",
                                       f"{hdfs_path(path)} is not a file or directory of the "
                                       f"journal (a link or special file put in the gateway's "
                                       f"cache by hand?): {hdfs_path(rel)} is not deleted")
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
                os.chmod(_PROC_FD.format(fd),
                         effective_permission(mode, stat_mod.S_ISDIR(st.st_mode)))
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
                raise WebHdfsError("HadoopIllegalArgumentException",
                                   f"Cannot truncate to a larger file size. Current size: "
                                   f"{st.st_size}, truncate size: {new_length}.")
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
                raise WebHdfsError("AlreadyBeingCreatedException",
                                   f"{hdfs_path(rel)} is being written by another request")
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
                raise WebHdfsError("AlreadyBeingCreatedException",
                                   f"{hdfs_path(rel)} is being written by another request")

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
                raise WebHdfsError("FileAlreadyExistsException",
                                   f"{hdfs_path(rel)} already exists as a directory")
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
            raise WebHdfsError(exc.exception, f"{exc.message}. {hdfs_path(rel)} keeps its first "
                               f"{offset} bytes, journaled before the quota was reached") from exc

    def marker(self, label: str, payload: bytes) -> int:
        seq = self._journal(self.tree.marker, label, payload)
        self.barrier(seq)
        return int(seq)
