"""The FUSE mount's adapter over the journal core: what the JVM (Spark) writes through:
`SOSOperations`, the pyfuse3 operations over a `JournaledTree`, and `errno_for`, the errno a
FUSE reply carries.

`SOSOperations` is a thin pyfuse3 (trio) adapter over `JournaledTree`:

* reads and attributes are served straight from the tree's cache directory;
* every file-altering operation (create, write, truncate, rename, unlink, mkdir,
  rmdir) goes through the tree, so it becomes a journal record;
* blocking tree calls (barrier waits) run in worker threads
  (`trio.to_thread.run_sync`) so the FUSE loop keeps serving other requests;
* in sync mode (the default) fsync, fsyncdir, the close of `.sos/marker` and a
  rename onto, or the close (flush/release) of a written file at, a path that
  `sos_journal.tree.barrier_rule.needs_barrier` names (Spark's `offsets/N` and
  `commits/N`) return only after every record so far is durable on the server;
  other renames and closes are carried by the next such barrier (one ordered
  journal). With durability "tier" (`sos mount --durability tier`) those barriers
  also wait for the server's bucket; one it did not reach within the tier patience
  fails with ETIMEDOUT (the change stays applied and durable on the server). In async mode only fsync and fsyncdir wait (explicit requests for
  durability) and the writer bounds the lag;
* once the writer reports that a newer writer fenced it, the mount turns
  read-only: every later change fails with EROFS (the first failure with EIO)
  and the reason is logged once.

chmod, chown and utimens are applied to the cache only (the journal has no
record for them; Hadoop's local filesystem calls chmod and must not fail).

Ownership: the kernel checks permissions (`default_permissions`) against the
cache entries' owners and modes. When the mount runs as root (the sidecar), a
file or directory created through it is chowned to the calling process (uid,
and gid unless the parent directory is setgid), as a local filesystem does;
`owner=(uid, gid)` (`sos mount --owner`) gives the root directory, and every
entry rebuilt from the server (the journal records no owners), to that user, so
a non-root Spark can create its checkpoint directory. Other users reach a mount
only with allow_other (implied by an owner other than the mount's own user).

`.sos/marker` at the root is a virtual control file (not listed, not journaled
as a file): a JSON document {"label": str, "payload": any} written to it
becomes a MARKER record (JournaledTree.marker), durable when fsync or close
returns (sync mode). The Spark batch listener writes its batch markers there.
`.sos/namespace` (read-only) holds the mounted namespace's name and a newline.

The package: this module (the adapter), `inodes.py` (the inode table, the virtual
entries), `run.py` (`run_mount()`: server connection, writer, tree and mount wired
together; what `sos mount` runs), `cli.py` (the command), `process.py` (`MountProcess`:
`sos mount` in a child process for tests, the Spark helpers, the demo and the crash loop).
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import trio

from sos_client.errors import to_oserror
from sos_journal.faces.facade import FenceLatch
from sos_journal.tree.barrier_rule import needs_barrier

if TYPE_CHECKING:
    import pyfuse3
    from pyfuse3 import Operations as _OperationsBase

    from sos_journal.tree.tree import JournaledTree

else:
    try:  # pyfuse3 is an optional dependency (extra "mount")
        import pyfuse3
        from pyfuse3 import Operations as _OperationsBase
    except ImportError:  # pragma: no cover - exercised only where pyfuse3 is missing
        pyfuse3 = None
        _OperationsBase = object

from .inodes import (
    ATTR_TIMEOUT,
    CONTROL_DIR,
    CONTROL_DIR_INO,
    CONTROL_FILES,
    MARKER_FILE,
    MARKER_INO,
    NAMESPACE_FILE,
    NAMESPACE_INO,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    ROOT_INODE,
    VIRTUAL,
    InodeTable,
)

log = logging.getLogger(__name__)

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Ops = TypeVar("_Ops", bound="SOSOperations")


def errno_for(exc: BaseException) -> int:
    """The errno FUSE returns for an exception from the tree (or the OS): the one of
    :func:`sos_client.errors.to_oserror` (a fenced writer: EROFS)."""
    if pyfuse3 is not None and isinstance(exc, pyfuse3.FUSEError):
        return exc.errno
    return to_oserror(exc).errno or errno.EIO


@dataclass
class _Handle:
    ino: int
    fd: int
    writable: bool
    dirty: bool = False
    marker: bytearray | None = None  # the control file's pending document
    content: bytes | None = None  # a read-only virtual file's content (fd is -1)


def _guard(
    fn: Callable[Concatenate[_Ops, _P], Awaitable[_R]],
) -> Callable[Concatenate[_Ops, _P], Coroutine[Any, Any, _R]]:
    """Turn every exception of a handler into a FUSEError (pyfuse3 dies on others)."""

    @functools.wraps(fn)
    async def wrapper(self: _Ops, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return await fn(self, *args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to an errno, logged if unexpected
            code = errno_for(exc)
            if code == errno.EIO:
                log.error("%s failed: %r", fn.__name__, exc)
            elif code == errno.ETIMEDOUT:  # durability "tier": the bucket is behind
                log.warning("%s: %s -> ETIMEDOUT", fn.__name__, exc)
            else:
                log.debug("%s: %r -> %s", fn.__name__, exc, errno.errorcode.get(code, code))
            raise pyfuse3.FUSEError(code) from None

    return wrapper


class SOSOperations(_OperationsBase):
    """pyfuse3 operations over a `JournaledTree`."""

    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False
    #: what the barriers wait for ("server" or "tier": open_namespace's), shown in the ready line
    durability = "server"

    def __init__(
        self,
        tree: JournaledTree,
        cache_root: str,
        *,
        sync: bool = True,
        namespace: str = "",
        writeback_cache: bool = False,
        chown_to_caller: bool | None = None,
    ) -> None:
        super().__init__()
        # Kernel writeback cache (read by pyfuse3 at FUSE INIT): write(2) lands in the page
        # cache and reaches us in large WRITEs, at the latest when close(2) flushes (before
        # FLUSH, so the close barrier still covers the data). Far fewer round trips for
        # small writes (Hadoop writes 4 KiB at a time); write errors surface at close/fsync.
        self.enable_writeback_cache = writeback_cache
        self.tree = tree
        self.cache_root = os.path.abspath(cache_root)
        self.sync_mode = sync
        self.namespace = namespace
        self.inodes = InodeTable()
        self._handles: dict[int, _Handle] = {}
        self._dirs: dict[int, tuple[int, list[str]]] = {}
        self._next_fh = 1
        self._fence = FenceLatch(namespace, log, "sos mount")
        # Only root can give a new cache entry to the caller; other mounts own everything.
        self.chown_to_caller = (os.geteuid() == 0) if chown_to_caller is None else chown_to_caller

    # ------------------------------------------------------------------ helpers
    def _local(self, path: str) -> str:
        return self.cache_root if path == "" else self.tree.local_path(path)

    @staticmethod
    def _join(parent: str, name: bytes) -> str:
        text = os.fsdecode(name)
        text.encode("utf-8")  # surrogates (undecodable names) -> UnicodeError -> EINVAL
        if text in ("", ".", "..") or "/" in text:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return text if parent == "" else parent + "/" + text

    def _child(self, parent_ino: int, name: bytes) -> str:
        """The tree path of `name` in a directory; EPERM inside/onto the control directory."""
        if parent_ino in VIRTUAL or (parent_ino == ROOT_INODE and name == CONTROL_DIR.encode()):
            raise pyfuse3.FUSEError(errno.EPERM)
        return self._join(self.inodes.live_path(parent_ino), name)

    def _virtual_entry(self, ino: int) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.generation = 0
        e.entry_timeout = ATTR_TIMEOUT
        e.attr_timeout = ATTR_TIMEOUT
        root = os.stat(self.cache_root)
        e.st_size = 0
        if ino == CONTROL_DIR_INO:
            e.st_mode = stat.S_IFDIR | 0o755
            e.st_nlink = 2
        elif ino == NAMESPACE_INO:
            e.st_mode = stat.S_IFREG | 0o444
            e.st_nlink = 1
            e.st_size = len(self._namespace_bytes())
        else:
            e.st_mode = stat.S_IFREG | 0o200
            e.st_nlink = 1
        e.st_uid, e.st_gid = root.st_uid, root.st_gid
        e.st_blksize = 4096
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = root.st_mtime_ns
        return e

    def _namespace_bytes(self) -> bytes:
        return self.namespace.encode("utf-8") + b"\n"

    def _entry(self, ino: int, st: os.stat_result) -> pyfuse3.EntryAttributes:
        e = pyfuse3.EntryAttributes()
        e.st_ino = ino
        e.generation = 0
        e.entry_timeout = ATTR_TIMEOUT
        e.attr_timeout = ATTR_TIMEOUT
        e.st_mode = st.st_mode
        e.st_nlink = st.st_nlink
        e.st_uid = st.st_uid
        e.st_gid = st.st_gid
        e.st_rdev = st.st_rdev
        e.st_size = st.st_size
        e.st_blksize = st.st_blksize
        e.st_blocks = st.st_blocks
        e.st_atime_ns = st.st_atime_ns
        e.st_mtime_ns = st.st_mtime_ns
        e.st_ctime_ns = st.st_ctime_ns
        return e

    def _stat_path(self, path: str) -> tuple[int, os.stat_result]:
        st = os.lstat(self._local(path))
        ino = self.inodes.ino(path)
        self.inodes.mark_dir(ino, stat.S_ISDIR(st.st_mode))
        return ino, st

    def _give_to_caller(self, path: str, ctx: pyfuse3.RequestContext | None) -> None:
        """A new entry belongs to the process that created it (as on a local filesystem):
        its uid, and its gid unless the parent directory is setgid (then the cache entry
        already has the parent's group, and a new directory its setgid bit)."""
        if not self.chown_to_caller or ctx is None:
            return
        local = self._local(path)
        parent = os.lstat(os.path.dirname(local))
        gid = -1 if parent.st_mode & stat.S_ISGID else ctx.gid
        os.chown(local, ctx.uid, gid, follow_symlinks=False)

    def _open_fd(self, ino: int) -> int | None:
        for h in self._handles.values():
            if h.ino == ino:
                return h.fd
        return None

    @property
    def fenced(self) -> str | None:
        """Why the mount is read-only (a newer writer took the namespace over), or None."""
        return self._fence.fenced

    def _check_writable(self) -> None:
        if self.fenced is not None:
            raise pyfuse3.FUSEError(errno.EROFS)

    def _note_failure(self, exc: BaseException) -> None:
        self._fence.note(exc)

    async def _call(self, fn: Callable[..., _R], *args: Any, **kwargs: Any) -> _R:
        """Run a (possibly blocking) tree call in a worker thread."""
        self._check_writable()
        try:
            return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        except Exception as exc:
            self._note_failure(exc)
            raise

    async def _barrier(self) -> None:
        """Wait until every record so far is durable on the server (in both modes)."""
        await self._call(self.tree.sync, wait=True)

    # ------------------------------------------------------------ attributes
    @_guard
    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext | None = None
    ) -> pyfuse3.EntryAttributes:
        if parent_inode == ROOT_INODE and name == CONTROL_DIR.encode():
            return self._virtual_entry(CONTROL_DIR_INO)
        if parent_inode == CONTROL_DIR_INO:
            if name in CONTROL_FILES:
                return self._virtual_entry(CONTROL_FILES[name])
            raise pyfuse3.FUSEError(errno.ENOENT)
        path = self._child(parent_inode, name)
        ino, st = self._stat_path(path)
        self.inodes.lookup(ino)
        return self._entry(ino, st)

    @_guard
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        if inode in VIRTUAL:
            return self._virtual_entry(inode)
        path = self.inodes.path(inode)
        if path is None:
            fd = self._open_fd(inode)
            if fd is None:
                raise FileNotFoundError(errno.ENOENT, "removed")
            return self._entry(inode, os.fstat(fd))
        return self._entry(inode, os.lstat(self._local(path)))

    @_guard
    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        if inode in VIRTUAL:
            if fields.update_size and inode == MARKER_INO and attr.st_size == 0:
                return self._virtual_entry(inode)
            raise pyfuse3.FUSEError(errno.EPERM)
        path = self.inodes.path(inode)
        if path is None:  # an open file that was unlinked: not part of the tree any more
            fd = self._handles[fh].fd if fh in self._handles else self._open_fd(inode)
            if fd is None:
                raise FileNotFoundError(errno.ENOENT, "removed")
            if fields.update_size:
                os.ftruncate(fd, attr.st_size)
            return self._entry(inode, os.fstat(fd))
        changing = (
            fields.update_size
            or fields.update_mode
            or fields.update_uid
            or fields.update_gid
            or fields.update_atime
            or fields.update_mtime
        )
        if changing:
            self._check_writable()
        local = self._local(path)
        if fields.update_size:
            await self._call(self.tree.truncate, path, attr.st_size)
            if fh in self._handles:
                self._handles[fh].dirty = True
        if fields.update_mode:
            os.chmod(local, stat.S_IMODE(attr.st_mode))
        if fields.update_uid or fields.update_gid:
            os.chown(
                local,
                attr.st_uid if fields.update_uid else -1,
                attr.st_gid if fields.update_gid else -1,
                follow_symlinks=False,
            )
        if fields.update_atime or fields.update_mtime:
            st = os.lstat(local)
            atime = attr.st_atime_ns if fields.update_atime else st.st_atime_ns
            mtime = attr.st_mtime_ns if fields.update_mtime else st.st_mtime_ns
            os.utime(local, ns=(atime, mtime), follow_symlinks=False)
        return self._entry(inode, os.lstat(local))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            if ino not in VIRTUAL:
                self.inodes.forget(ino, n)

    @_guard
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        sv = os.statvfs(self.cache_root)
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail"):
            setattr(out, name, getattr(sv, name))
        out.f_namemax = min(sv.f_namemax, 255)
        return out

    @_guard
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        path = None if inode in VIRTUAL else self.inodes.path(inode)
        if path is not None:
            os.lstat(self._local(path))
        return not (mode & os.W_OK and self.fenced is not None)

    # ------------------------------------------------------------ directories
    @_guard
    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = self._child(parent_inode, name)
        await self._call(self.tree.mkdir, path, stat.S_IMODE(mode))
        self._give_to_caller(path, ctx)
        ino, st = self._stat_path(path)
        self.inodes.lookup(ino)
        return self._entry(ino, st)

    @_guard
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = self._child(parent_inode, name)
        await self._call(self.tree.rmdir, path)
        self.inodes.removed(path)

    @_guard
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if inode == CONTROL_DIR_INO:
            names = [MARKER_FILE, NAMESPACE_FILE]
        else:
            path = self.inodes.live_path(inode)
            names = sorted(os.listdir(self._local(path)))
            if path == "" and CONTROL_DIR in names:  # shadowed by the control directory
                names.remove(CONTROL_DIR)
        fh = self._next_fh
        self._next_fh += 1
        self._dirs[fh] = (inode, names)
        return fh

    @_guard
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        dir_ino, names = self._dirs[fh]
        # "." and ".." first (ids 1 and 2; the kernel counts no lookup for them), as every
        # POSIX file system lists them (`ls -a`)
        for index in range(start_id, 2):
            if not pyfuse3.readdir_reply(token, b"." * (index + 1), self._dot_entry(dir_ino, index == 1), index + 1):
                return
        start_id = max(start_id - 2, 0)
        if dir_ino == CONTROL_DIR_INO:
            for index in range(start_id, len(names)):
                vname = names[index].encode()
                if not pyfuse3.readdir_reply(token, vname, self._virtual_entry(CONTROL_FILES[vname]), index + 3):
                    break
            return
        for index in range(start_id, len(names)):
            name = names[index]
            # Looked up per entry: the directory may be renamed while it is listed.
            parent = self.inodes.live_path(dir_ino)
            path = name if parent == "" else parent + "/" + name
            try:
                ino, st = self._stat_path(path)
            except FileNotFoundError:
                continue  # removed since opendir
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._entry(ino, st), index + 3):
                break
            self.inodes.lookup(ino)  # readdirplus counts as a lookup

    def _dot_entry(self, dir_ino: int, parent: bool) -> pyfuse3.EntryAttributes:
        """The attributes of "." (``parent`` False) or ".." of the directory ``dir_ino``."""
        if dir_ino == CONTROL_DIR_INO:
            return self._virtual_entry(CONTROL_DIR_INO) if not parent else self._entry(*self._stat_path(""))
        path = self.inodes.live_path(dir_ino)
        if parent:
            path = path.rpartition("/")[0]  # the root's ".." is the root
        return self._entry(*self._stat_path(path))

    async def releasedir(self, fh: int) -> None:
        self._dirs.pop(fh, None)

    @_guard
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        await self._barrier()

    # ------------------------------------------------------------ files
    def _new_handle(self, ino: int, path: str, writable: bool) -> int:
        local = self._local(path)
        try:
            fd = os.open(local, os.O_RDWR | os.O_CLOEXEC)
        except IsADirectoryError:
            raise
        except OSError:
            fd = os.open(local, os.O_RDONLY | os.O_CLOEXEC)
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _Handle(ino=ino, fd=fd, writable=writable)
        self.inodes.opened(ino)
        return fh

    @_guard
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = self._child(parent_inode, name)
        existed = os.path.lexists(self._local(path))  # noqa: ASYNC240 - a cache lstat; an existing name is opened
        await self._call(self.tree.create, path, stat.S_IMODE(mode))
        if not existed:
            self._give_to_caller(path, ctx)
        ino, st = self._stat_path(path)
        fh = self._new_handle(ino, path, writable=True)
        self._handles[fh].dirty = True
        self.inodes.lookup(ino)
        return pyfuse3.FileInfo(fh=fh), self._entry(ino, st)

    @_guard
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode == CONTROL_DIR_INO:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if inode == MARKER_INO:
            self._check_writable()
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = _Handle(ino=inode, fd=-1, writable=True, marker=bytearray())
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        if inode == NAMESPACE_INO:
            if (flags & os.O_ACCMODE) != os.O_RDONLY:
                raise pyfuse3.FUSEError(errno.EACCES)
            fh = self._next_fh
            self._next_fh += 1
            self._handles[fh] = _Handle(ino=inode, fd=-1, writable=False, content=self._namespace_bytes())
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        path = self.inodes.live_path(inode)
        writable = (flags & os.O_ACCMODE) != os.O_RDONLY
        if writable:
            self._check_writable()
        dirty = False
        if writable and flags & os.O_TRUNC and os.lstat(self._local(path)).st_size != 0:
            await self._call(self.tree.truncate, path, 0)
            dirty = True
        fh = self._new_handle(inode, path, writable)
        self._handles[fh].dirty = dirty
        return pyfuse3.FileInfo(fh=fh)

    @_guard
    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self._handles[fh]
        if h.marker is not None:
            return b""
        if h.content is not None:
            return h.content[off : off + size]
        return os.pread(h.fd, size, off)

    @_guard
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        h = self._handles[fh]
        self._check_writable()
        if h.marker is not None:
            if off > len(h.marker) + (1 << 20):
                raise pyfuse3.FUSEError(errno.EFBIG)
            h.marker[off : off + len(buf)] = buf
            return len(buf)
        path = self.inodes.path(h.ino)
        if path is None:  # unlinked while open: the tree no longer has it
            return os.pwrite(h.fd, buf, off)
        await self._call(self.tree.write, path, off, bytes(buf))
        h.dirty = True
        return len(buf)

    async def _emit_marker(self, h: _Handle) -> None:
        """Turn the control file's pending JSON document into a MARKER record."""
        if h.marker is None:  # not the control file
            return
        doc_bytes = bytes(h.marker)
        h.marker.clear()
        try:
            doc = json.loads(doc_bytes)
            label = doc["label"]
            payload = doc.get("payload", "")
            if not isinstance(label, str) or not label:
                raise ValueError("label must be a non-empty string")
        except (ValueError, KeyError, TypeError) as exc:
            log.error("ignoring a bad marker document %r: %s", doc_bytes[:200], exc)
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        if isinstance(payload, str):
            data = payload.encode("utf-8")
        else:
            data = json.dumps(payload, sort_keys=True).encode("utf-8")
        await self._call(self.tree.marker, label, data)
        h.dirty = True

    def _close_waits(self, h: _Handle) -> bool:
        """Sync mode: does closing this handle wait for the server? Only for the control
        file (a marker) and a file the barrier policy names (``commits/N``...): any other
        file's records are carried by the next barrier of the one ordered journal."""
        if h.marker is not None:
            return True
        path = self.inodes.path(h.ino)
        return path is not None and needs_barrier(path)

    async def _settle(self, h: _Handle) -> None:
        """Close in sync mode: a marker, or a file :func:`needs_barrier` names, is durable
        before close returns; a fenced mount fails the close of any changed file (EIO)."""
        if h.marker:
            await self._emit_marker(h)
        if h.dirty and self.sync_mode:
            if self.fenced is not None:
                raise pyfuse3.FUSEError(errno.EIO)
            if self._close_waits(h):
                await self._barrier()
        h.dirty = False

    @_guard
    async def flush(self, fh: int) -> None:
        # flush is what close(2) waits for (release is sent asynchronously).
        await self._settle(self._handles[fh])

    @_guard
    async def fsync(self, fh: int, datasync: bool) -> None:
        # An explicit fsync waits for the server in both modes.
        h = self._handles[fh]
        if self.fenced is not None and (h.dirty or h.marker):
            raise pyfuse3.FUSEError(errno.EIO)
        if h.marker:
            await self._emit_marker(h)
        await self._barrier()
        h.dirty = False

    async def release(self, fh: int) -> None:
        h = self._handles.pop(fh, None)
        if h is None:
            return
        try:
            if h.marker and self.fenced is None:
                try:
                    await self._emit_marker(h)
                except Exception as exc:  # noqa: BLE001 - release cannot report errors
                    log.error("release: marker lost: %r", exc)
            if h.dirty and self.sync_mode and self.fenced is None and self._close_waits(h):
                try:
                    await self._barrier()
                except Exception as exc:  # noqa: BLE001 - release cannot report errors
                    log.error("release: barrier failed: %r", exc)
        finally:
            if h.fd >= 0:
                os.close(h.fd)
                self.inodes.closed(h.ino)

    # ------------------------------------------------------------ namespace changes
    @_guard
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = self._child(parent_inode, name)
        await self._call(self.tree.unlink, path)
        self.inodes.removed(path)

    @_guard
    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        if flags & RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        src = self._child(parent_inode_old, name_old)
        dst = self._child(parent_inode_new, name_new)
        overwrite = not (flags & RENAME_NOREPLACE)
        # The table moves first: in sync mode the tree may return only after the barrier
        # (needs_barrier(dst)), and the moved inode must resolve to its new path meanwhile
        # (fstat of an open fd).
        undo = self.inodes.renamed(src, dst)
        try:
            await self._call(self.tree.rename, src, dst, overwrite=overwrite)
        except BaseException:
            if os.path.lexists(self._local(src)):  # noqa: ASYNC240 - a cache lstat; the rename did not happen
                undo()
            raise
