"""The changes of the WebHDFS namespace: every operation that journals a record or alters the cache.

MKDIRS, RENAME (HDFS's boolean rename and rename2, a resent one answered from
:mod:`spark_plugin.gateway.webhdfs.renames`, which every change of a path tells to forget the RENAMEs
that left an entry there), DELETE (recursive: one record per entry, deepest
first), SETPERMISSION/SETTIMES (the cache only), SETOWNER/SETREPLICATION (nothing to record),
TRUNCATE, the leases of files being written and CREATE/APPEND with their bodies, and the
batch markers, as :class:`ChangeOperations`, a part of
:class:`~spark_plugin.gateway.webhdfs.namespace.WebHdfsNamespace`. Each checks then changes under the
namespace's lock and places its barrier outside it (the module docstring of
:mod:`spark_plugin.gateway.webhdfs.namespace` says what each waits for).

The barrier decisions (protocol.md 3.4): with ``--barrier commit`` a change whose paths are all
:meth:`~spark_plugin.gateway.webhdfs.core.NamespaceCore.acknowledged_early` (a checkpoint's state
files, the temp files of its logs) is answered once journaled in the spool; every other one
waits. A RENAME onto, or CREATE of, ``CHECKPOINT/commits/N`` of a batch that was in flight when
this gateway's cache was rebuilt from the server is refused
(:mod:`spark_plugin.gateway.webhdfs.inflight`).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import stat as stat_mod

from sos_journal.beneath import Beneath
from spark_plugin.gateway.webhdfs.core import NamespaceCore
from spark_plugin.gateway.webhdfs.hdfs import (
    WebHdfsError,
    effective_permission,
    hdfs_path,
    illegal,
    not_found,
    rel_path,
)
from spark_plugin.gateway.webhdfs.renames import identity

__all__ = ["WRITE_PIECE", "ChangeOperations"]

#: a file whose body streams is written to the journal in pieces of this size
WRITE_PIECE = 1 << 20
#: Without an O_PATH descriptor's own fchmod/futimens, these act on the inode it holds
#: (never on a link: the descriptor was opened O_NOFOLLOW and checked).
_PROC_FD = "/proc/self/fd/{}"


class ChangeOperations(NamespaceCore):
    """The changes (module docstring)."""

    # ------------------------------------------------------------------ rename retries
    def _remember_rename(self, at: Beneath, rel: str, asked: str, dst: str) -> None:
        """Note a RENAME that was applied, before its reply (called under :attr:`lock`)."""
        st = self._stat(dst, at)
        if st is not None:
            # not readable (a planted hard link?): not remembered, a resend gets HDFS's answer
            with contextlib.suppress(OSError):
                self.renames.remember(rel, asked, dst, identity(at, dst, st))

    def _renamed_already(self, at: Beneath, rel: str, asked: str) -> bool:
        """Whether a RENAME of a missing ``rel`` to ``asked`` is the retry of one this gateway
        (or the one before it on this cache) applied in the last RENAME_RETRY_WINDOW seconds:
        nothing changed its destination since, which still holds the very entry it renamed
        (the same kind, size and contents: :mod:`spark_plugin.gateway.webhdfs.renames`)."""
        seen = self.renames.applied(rel, asked)
        if seen is None:
            return False
        st = self._stat(seen.dst, at)
        try:
            return st is not None and identity(at, seen.dst, st) == seen.ident
        except OSError:
            return False

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
                self.renames.forget(sub)
                self._journal(self.tree.mkdir, sub, mode | 0o300 if sub != rel else mode)
            seq = self._last_seq()
        if not self.acknowledged_early(rel):  # its new parents are above it: early too if it is
            self.barrier(seq)  # sync: durable before 200, and a fenced gateway's MKDIRS fails here
        return {"boolean": True}

    def rename(self, rel: str, dst_path: str, options: set[str] | None) -> dict | None:
        """RENAME: without ``options`` HDFS's boolean rename (false when it cannot; an
        existing directory as destination receives the source); with ``options`` (the
        ``renameoptions`` set: NONE, OVERWRITE) rename2, which raises instead."""
        result, seq = self.rename_now(rel, dst_path, options)
        if result is not False:
            if seq is not None:
                self.barrier(seq)
            self.renamed(dst_path)
        return {"boolean": result} if options is None else None

    def rename_now(self, rel: str, dst_path: str, options: set[str] | None) -> tuple[bool, int | None]:
        """:meth:`rename` without its barrier: (its answer, the sequence number the barrier
        waits for, None when it waits for none: a RENAME within a checkpoint's state files
        with ``--barrier commit``). A True answer needs that barrier, then :meth:`renamed`."""
        dst = rel_path(dst_path)
        with self.lock, self._admission(), self._cache() as at:
            result = self._rename(at, rel, dst, options)
            early = result is not False and self.acknowledged_early(rel, dst, at=at)
            return result, None if early else self._last_seq()

    def renamed(self, dst_path: str) -> None:
        """A RENAME to ``dst_path`` succeeded, its barrier with it: the observer hears of it."""
        if self.observer is not None:
            self.observer.renamed(rel_path(dst_path))

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
            raise not_found(src_name)
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
        self._may_move(rel, dst)
        # what was at the destination, and the source (a directory with all below it), change
        self.renames.forget(rel, under=True)
        self.renames.forget(dst, under=True)
        try:
            self._journal(self.tree.rename, rel, dst, overwrite=overwrite)
        except WebHdfsError as exc:
            if boolean and exc.exception == "FileAlreadyExistsException":
                return False  # appeared meanwhile (atomic no-replace rename)
            raise
        self._remember_rename(at, rel, asked, dst)
        return True

    def _may_move(self, rel: str, dst: str) -> None:
        """The last checks of a RENAME: neither end is being written, and it is not the commit
        of a batch in flight across a rebuild of the cache (inflight.py)."""
        with self._leases_lock:
            if rel in self._leases or dst in self._leases:
                raise WebHdfsError(
                    "AlreadyBeingCreatedException",
                    f"{hdfs_path(rel if rel in self._leases else dst)} is being written by another request",
                )
        refusal = self.inflight.refusal(dst)
        if refusal is not None:
            raise refusal

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
            self.renames.forget(rel, under=True)
            for path, is_dir in doomed:
                self._journal(self.tree.rmdir if is_dir else self.tree.unlink, path)
            seq = self._last_seq()
        if not self.acknowledged_early(rel):  # everything it removed is below rel
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

    def set_owner(self, rel: str, owner: str, group: str) -> None:
        """SETOWNER: accepted and nothing recorded, as Hadoop's FileSystem base class and the
        object stores do for a filesystem without owners: the journal has no owner record,
        every entry reports the gateway's --owner/--group. The path must exist (HDFS's
        FileNotFoundException otherwise) and one of owner, group be given."""
        if not owner and not group:
            raise illegal("Both owner and group are empty.")
        self._require(rel)

    def set_replication(self, rel: str) -> dict:
        st = self._require(rel)
        return {"boolean": not stat_mod.S_ISDIR(st.st_mode)}

    def truncate(self, rel: str, new_length: int) -> dict:
        if new_length < 0:
            raise illegal(f'Invalid value for webhdfs parameter "newlength": {new_length} < 0')
        with self.lock, self._admission():
            st = self._require_file(rel)
            if new_length > st.st_size:
                raise WebHdfsError(
                    "HadoopIllegalArgumentException",
                    f"Cannot truncate to a larger file size. Current size: {st.st_size}, truncate size: {new_length}.",
                )
            self._take_lease(rel)
            try:
                self.renames.forget(rel)
                seq = self._journal(self.tree.truncate, rel, new_length)
            finally:
                self.release(rel)
        if not self.acknowledged_early(rel):
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
        self._admit_now()
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
        self._admit_now()
        if rel == "":
            raise WebHdfsError("FileAlreadyExistsException", "/ already exists as a directory")
        refusal = self.inflight.refusal(rel)  # a commit file written in place: as its RENAME
        if refusal is not None:
            raise refusal
        at = self._walk()  # (one walk for both: _cache's, without its context manager)
        try:
            st = self._stat(rel, at)
            if st is not None:
                if stat_mod.S_ISDIR(st.st_mode):
                    raise WebHdfsError("FileAlreadyExistsException", f"{hdfs_path(rel)} already exists as a directory")
                if not overwrite:
                    raise WebHdfsError("FileAlreadyExistsException", f"{hdfs_path(rel)} already exists")
            self._check_parent(rel, create_parent=create_parent, at=at)
        finally:
            at.close()

    def begin_create(self, rel: str, mode: int, *, overwrite: bool, create_parent: bool) -> None:
        """Create (or truncate) ``rel`` and take its lease; the body follows as
        :meth:`write` calls, then :meth:`release`."""
        with self.lock, self._admission():
            self.check_create(rel, overwrite=overwrite, create_parent=create_parent)
            self._take_lease(rel)
            try:
                for sub in self._check_parent(rel, create_parent=create_parent):
                    self.renames.forget(sub)
                    self._journal(self.tree.mkdir, sub, 0o755)
                self.renames.forget(rel)  # an overwritten file is another file
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
            self.renames.forget(rel)  # its contents change
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
        seq = self.marker_now(label, payload)
        self.barrier(seq)
        return seq

    def marker_now(self, label: str, payload: bytes) -> int:
        """:meth:`marker` without its barrier: the marker's sequence number."""
        return int(self._journal(self.tree.marker, label, payload))
