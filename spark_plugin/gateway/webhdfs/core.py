"""What every WebHDFS operation of the namespace stands on: the cache, the journal, the barrier.

:class:`NamespaceCore` holds the state of :class:`~spark_plugin.gateway.webhdfs.namespace.WebHdfsNamespace`
(the opened namespace, its lock, the leases of files being written, the memory of recent
RENAMEs, the observer) and the plumbing both the read-only answers
(:mod:`spark_plugin.gateway.webhdfs.reads`) and the changes
(:mod:`spark_plugin.gateway.webhdfs.changes`) use: the cache reached through descriptors only
(``_cache``, ``_stat``, ``_entry``, ``_require``), the admission of a change at the quota, a
tree call with its failures mapped to HDFS's exceptions (``_journal``), and the barrier.
:class:`NamespaceObserver` is what the namespace tells about its work (the gateway's metrics,
:mod:`spark_plugin.gateway.http.metrics`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_mod
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sos_client.errors import SOSError, errno_of, is_fenced, to_oserror
from sos_journal.beneath import Beneath
from sos_journal.errors import JournalError, JournalQuotaExceeded, JournalTierBehind
from sos_journal.faces.facade import journal_error
from sos_journal.tree.barrier_rule import acknowledged_early
from spark_plugin.gateway.webhdfs.hdfs import EXCEPTION_OF_ERRNO, WebHdfsError, hard_link, hdfs_path, not_found
from spark_plugin.gateway.webhdfs.inflight import InFlightBatches, predecessor_stopped_cleanly
from spark_plugin.gateway.webhdfs.renames import RENAME_MEMORY_FILE, RenameMemory
from spark_plugin.gateway.webhdfs.walk import OneCallWalk

if TYPE_CHECKING:
    from sos_journal.tree.open import OpenNamespace

_R = TypeVar("_R")

__all__ = ["BARRIER_RULES", "NamespaceCore", "NamespaceObserver"]

#: ``sos gateway --barrier``: "commit" (a checkpoint's state files are acknowledged from the
#: spool, commits wait, a rebuilt cache refuses the commit of batches in flight) or "every"
#: (every change waits), protocol.md 3.4
BARRIER_RULES = ("commit", "every")


class NamespaceObserver(Protocol):
    """What a namespace tells about its work, where it does it (outside its lock)."""

    def barrier_waited(self, seconds: float) -> None:
        """A barrier of sync mode ended after ``seconds``: durable, or failed."""

    def renamed(self, rel_dst: str) -> None:
        """A RENAME (or rename2) to ``rel_dst`` (the destination asked for, namespace-relative)
        succeeded, and its barrier with it."""


class NamespaceCore:
    """The state and plumbing of :class:`~spark_plugin.gateway.webhdfs.namespace.WebHdfsNamespace`.

    ``opened``: what :func:`sos_journal.tree.open.open_namespace` returned (its writer in
    async mode: the namespace places the barriers itself, outside its lock). ``sync``: wait
    for the server on RENAME, DELETE and markers. ``owner``/``group``: what FileStatus
    reports (the journal records no owners). ``observer``: told of barriers and renames
    (:attr:`observer` may also be set before the namespace serves). ``barrier``: one of
    :data:`BARRIER_RULES` (protocol.md 3.4).
    """

    def __init__(
        self,
        opened: OpenNamespace,
        *,
        sync: bool = True,
        owner: str = "sos",
        group: str = "sos",
        observer: NamespaceObserver | None = None,
        barrier: str = "commit",
    ) -> None:
        if barrier not in BARRIER_RULES:
            raise ValueError(f"barrier must be one of {BARRIER_RULES}, not {barrier!r}")
        self.opened = opened
        self.tree = opened.tree
        self.writer = opened.writer
        self.root = opened.tree_dir
        self.namespace = opened.namespace
        self.sync = sync
        self.owner = owner
        self.group = group
        self.observer = observer
        #: reentrant: the gateway's event loop takes it without blocking before it runs a
        #: change inline (:meth:`has_room`), and the change takes it again
        self.lock = threading.RLock()
        self._leases: set[str] = set()
        self._leases_lock = threading.Lock()
        #: the last RENAMEs, kept in the cache directory: see WebHdfsNamespace._renamed_already
        self.renames = RenameMemory(os.path.join(os.path.dirname(self.root), RENAME_MEMORY_FILE))
        #: the cache's root, opened once (as the journaled tree's own walk keeps it open);
        #: every request's walk starts from it
        self._root_fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._root_closer = weakref.finalize(self, os.close, self._root_fd)
        self._abs_root = os.path.abspath(self.root)
        #: ``--barrier commit`` in sync mode with a writer: state files acknowledged early
        self.early = barrier == "commit" and sync and self.writer is not None
        #: a cache rebuilt from the server by a writer that did not resume a spool (an empty
        #: cache, a spool moved aside): what its predecessor acknowledged early may be missing
        replaced = bool(opened.rebuilt) and self.writer is not None and not self.writer.had_spool
        if replaced and self.early and predecessor_stopped_cleanly(opened):
            replaced = False  # it flushed everything, then left stopped/<epoch>: nothing lost
        self.inflight = InFlightBatches.open(
            os.path.dirname(self.root), self.root, rebuilt=replaced, enabled=self.early
        )

    def set_root(self, root: str) -> None:
        """Serve the tree at ``root`` (a read worker of ``--workers``: the writer's cache tree)."""
        fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._root_closer()  # closes the old descriptor, once
        self.root, self._root_fd, self._abs_root = root, fd, os.path.abspath(root)
        self._root_closer = weakref.finalize(self, os.close, fd)

    def _is_checkpoint(self, rel: str, at: Beneath | None = None) -> bool:
        """``rel`` (``""``: the root) is a Spark checkpoint: it holds an ``offsets`` directory."""
        st = self._stat(f"{rel}/offsets" if rel else "offsets", at)
        return st is not None and stat_mod.S_ISDIR(st.st_mode)

    def acknowledged_early(self, *paths: str, at: Beneath | None = None) -> bool:
        """Whether a change of every one of ``paths`` is answered without a barrier
        (``--barrier commit``: :func:`sos_journal.tree.barrier_rule.acknowledged_early`)."""
        if not self.early:
            return False
        if at is None:
            with self._cache() as at:
                return self.acknowledged_early(*paths, at=at)
        return all(acknowledged_early(p, lambda d: self._is_checkpoint(d, at)) for p in paths)

    def body_waits(self, rel: str) -> bool:
        """Whether the end of a CREATE or APPEND body of ``rel`` waits for a barrier."""
        return self.waits and not self.acknowledged_early(rel)

    def local(self, rel: str) -> str:
        return self.root if rel == "" else os.path.join(self.root, rel)

    @contextlib.contextmanager
    def _cache(self) -> Iterator[Beneath]:
        """The cache for one request: every path resolved from a descriptor of its root,
        component by component, never through a symbolic link (a link planted in the cache
        by another local user or a bad restore is never followed out of it). One per
        request: a Beneath caches descriptors and is not shared between threads. Each
        directory is resolved in one system call where the kernel can
        (:class:`~spark_plugin.gateway.webhdfs.walk.OneCallWalk`)."""
        at = self._walk()
        try:
            yield at
        finally:
            at.close()

    def _walk(self) -> OneCallWalk:
        """A new walk of the cache from its root (what :meth:`_cache` yields); the caller closes it."""
        return OneCallWalk(self._abs_root, root_fd=self._root_fd)

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
            raise not_found(hdfs_path(rel)) from None
        try:
            st = os.fstat(fd)
            if stat_mod.S_ISREG(st.st_mode) and st.st_nlink > 1:
                raise hard_link(rel)
            if not (stat_mod.S_ISDIR(st.st_mode) or stat_mod.S_ISREG(st.st_mode)):
                raise not_found(hdfs_path(rel))  # a link (itself, not followed), a FIFO...
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

    def _admit_now(self) -> None:
        """``with self._admission(): pass``: a change would be refused for quota now
        (DSQuotaExceededException), without entering anything."""
        if self.writer is not None:
            try:
                self.writer.admit()
            except JournalQuotaExceeded as exc:
                raise self._quota_refusal(exc) from exc

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
                EXCEPTION_OF_ERRNO.get(err.errno or 0, "IOException"), f"{err.strerror or err}{where}"
            ) from exc

    def _last_seq(self) -> int:
        return self.writer.last_seq if self.writer is not None else 0

    def barrier(self, seq: int | None = None) -> None:
        """In sync mode: wait until every record up to ``seq`` (default: all so far) is
        durable on the server (with durability "tier": and in its bucket; 403
        RetriableException after the writer's tier patience). The observer is told how long
        it waited, whether it passed or failed."""
        if not self.waits:
            return
        started = time.perf_counter()
        try:
            self.wait_durable(seq)
        finally:
            if self.observer is not None:
                self.observer.barrier_waited(time.perf_counter() - started)

    @property
    def waits(self) -> bool:
        """Whether a barrier waits for anything (sync mode, with a writer)."""
        return self.sync and self.writer is not None

    def wait_durable(self, seq: int | None) -> None:
        """:meth:`barrier`'s wait, without telling the observer (the gateway's event loop
        shares one wait between the requests that need it and tells it per request)."""
        if self.writer is not None:
            self._journal(self.writer.barrier, seq)

    def has_room(self, nbytes: int) -> bool:
        """Whether a change journaling about ``nbytes`` can run without waiting for the
        server: the writer's lag bound and generation size are far enough
        (:meth:`JournalWriter.has_room`)."""
        return self.writer is None or self.writer.has_room(nbytes)

    def _require(self, rel: str, at: Beneath | None = None) -> os.stat_result:
        st = self._stat(rel, at)
        if st is None:
            raise not_found(hdfs_path(rel))
        return st

    def _require_file(self, rel: str, at: Beneath | None = None) -> os.stat_result:
        st = self._require(rel, at)
        if stat_mod.S_ISDIR(st.st_mode):
            raise WebHdfsError("FileNotFoundException", f"Path is not a file: {hdfs_path(rel)}")
        return st

    def _check_parent(self, rel: str, *, create_parent: bool, at: Beneath | None = None) -> list[str]:
        """The missing ancestors of ``rel`` (outermost first); refuses a file in the way,
        or a missing parent when ``create_parent`` is false."""
        parent = rel.rpartition("/")[0]
        if parent:  # the usual case first: a parent that is a directory (so is every ancestor:
            # its walk goes through directories only, never a link), in one lstat
            st = self._stat(parent, at)
            if st is not None and stat_mod.S_ISDIR(st.st_mode):
                return []
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
